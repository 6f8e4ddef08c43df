"""A CUDA capture in progress, as the emulation's recording thread sees torch's Python API.

Some of what a CUDA capture refuses runs no ATen operation and no overridable function, so
neither of the recorder's modes sees it: ``torch.cuda``'s synchronisations and queries, and
``torch.save``, which writes each storage from host memory (a CUDA storage is copied to the
host first, ``storage.cpu()``: a copy into pageable memory, which the capture refuses).
While a call is recorded, ``capturing`` has torch answer the recording thread as in a CUDA
capture (other threads get torch's own answers):

- ``torch.cuda.is_available()`` and ``is_current_stream_capturing()`` say ``True``: code
  that skips its host checks during a capture asks them (torchrl's distributions, torch's
  optimizers), and an optimizer's step is checked as torch checks it in a capture;
- ``torch.cuda.synchronize()``, the ``synchronize()`` or ``query()`` of a stream that
  ``torch.cuda.current_stream()`` or ``default_stream()`` gives, and those of a
  ``torch.cuda.Event`` recorded on one, raise with the phrase of CUDA's error;
- ``torch.save`` (and ``pickle``, which saves through it) of a graph's tensor raises, as
  the copy to the host does: ``torch.save`` names the location of every storage it saves
  with ``torch.serialization.location_tag``, which it looks up at each call (torch 2.13),
  and which the recording answers for.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.serialization
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._host_calls import COPY, HOST_READ


class Storages(Protocol):
    """The recorder's view of CPU memory (`_recording.Recorder`)."""

    def stores_on_host(self, storage: torch.UntypedStorage) -> bool: ...


class CaptureStream:
    """``torch.cuda.current_stream()`` (or ``default_stream()``) on the recording thread.

    Work on it is ordered as on the CPU, so waits do nothing; a synchronisation or a query
    is refused, as CUDA refuses it on a capturing stream (and on the legacy stream while
    another captures).
    """

    def synchronize(self) -> None:
        raise RuntimeError(f"{HOST_READ} a synchronisation of a stream, `Stream.synchronize()`)")

    def query(self) -> bool:
        raise RuntimeError(f"{HOST_READ} a query of a stream, `Stream.query()`)")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: CaptureEvent | None = None) -> CaptureEvent:
        event = CaptureEvent() if event is None else event
        event.record(self)
        return event


class CaptureEvent:
    """``torch.cuda.Event(...)`` on the recording thread.

    As torch's, it becomes a CUDA event at its first ``record``: before, its ``query`` and
    ``synchronize`` return at once; after, they read an event recorded in the capture (or
    before it, in the "global" error mode), which CUDA refuses.
    """

    def __init__(self, enable_timing: bool = False, *args: Any, **kwargs: Any):
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        if self.recorded:
            raise RuntimeError(f"{HOST_READ} a query of a recorded event, `Event.query()`)")
        return True

    def synchronize(self) -> None:
        if self.recorded:
            raise RuntimeError(
                f"{HOST_READ} a synchronisation of a recorded event, `Event.synchronize()`)"
            )

    def elapsed_time(self, end_event: CaptureEvent) -> float:
        raise RuntimeError(f"{HOST_READ} a query of two events, `Event.elapsed_time()`)")


@contextlib.contextmanager
def capturing(host: Storages) -> Iterator[None]:
    """On this thread, torch answers as in a CUDA capture while a call is recorded (see
    above); ``host`` tells the storages that a GPU run has on the CPU too."""
    thread = threading.get_ident()
    streams = {"current_stream": CaptureStream(), "default_stream": CaptureStream()}
    originals = {
        name: getattr(torch.cuda, name)
        for name in (
            "is_available",
            "is_current_stream_capturing",
            "synchronize",
            "current_stream",
            "default_stream",
            "Event",
        )
    }
    location_tag = torch.serialization.location_tag

    def true_here(original: Any) -> Any:
        def query(*args: Any, **kwargs: Any) -> Any:
            return threading.get_ident() == thread or original(*args, **kwargs)

        return query

    def synchronize(*args: Any, **kwargs: Any) -> None:
        if threading.get_ident() == thread:
            raise RuntimeError(f"{HOST_READ} `torch.cuda.synchronize()`)")
        originals["synchronize"](*args, **kwargs)

    def stream(name: str) -> Any:
        def get(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                return streams[name]
            return originals[name](*args, **kwargs)

        return get

    class Event(CaptureEvent):
        # A class, not a function, so that `isinstance(e, torch.cuda.Event)` still works on
        # this thread; other threads get torch's events.
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != thread:
                return originals["Event"](*args, **kwargs)
            return super().__new__(cls)

    def check_optimizer(optimizer: torch.optim.Optimizer, *args: Any) -> None:
        if threading.get_ident() == thread:
            _check_capturable(optimizer)

    def saved_location(storage: Any) -> Any:
        if (
            threading.get_ident() == thread
            and storage.nbytes()
            and not host.stores_on_host(storage)
        ):
            raise RuntimeError(
                f"{COPY} a tensor of the graph saved, `torch.save`, which copies it to the host)"
            )
        return location_tag(storage)

    torch.cuda.is_available = true_here(originals["is_available"])
    torch.cuda.is_current_stream_capturing = true_here(originals["is_current_stream_capturing"])
    torch.cuda.synchronize = synchronize
    torch.cuda.current_stream = stream("current_stream")
    torch.cuda.default_stream = stream("default_stream")
    torch.cuda.Event = Event  # type: ignore[misc]
    # `torch.save` (and `pickle`, through it) names the location of each storage it saves.
    torch.serialization.location_tag = saved_location
    # A hook of torch's global registry of optimizer hooks, there while the call is recorded.
    hook = register_optimizer_step_pre_hook(check_optimizer)
    try:
        yield
    finally:
        hook.remove()
        torch.serialization.location_tag = location_tag
        for name, original in originals.items():
            setattr(torch.cuda, name, original)


def _check_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse the step of an optimizer that has a capturable mode without it, as torch's own
    check does in a CUDA capture (``Optimizer._accelerator_graph_capture_health_check``,
    which sees no accelerator on the CPU); its step counts would be read on the host. A
    fused optimizer needs it too."""
    groups = optimizer.param_groups
    if "capturable" in optimizer.defaults and not all(g.get("capturable") for g in groups):
        raise RuntimeError(
            f"Attempting CUDA graph capture of step() for an instance of "
            f"{type(optimizer).__name__} but param_groups' capturable is False. (the "
            "emulation of torch's check of an optimizer's step in a CUDA capture)"
        )
