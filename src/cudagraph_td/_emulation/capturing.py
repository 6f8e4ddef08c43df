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
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.serialization
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .host_calls import COPY, HOST_READ


class Storages(Protocol):
    """The recorder's view of CPU memory (`_emulation.recording.Recorder`)."""

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
    above); ``host`` tells the storages that a GPU run has on the CPU too.

    Other threads meanwhile get torch's own answers (and ``torch.cuda.Event`` is torch's
    class to them: its instances, subclasses and class attributes), recordings of their own
    included: torch's functions are swapped once, while any recording is open, for ones
    that ask this thread's recording, and put back when the last one, in any thread, ends.
    """
    outer = getattr(_here, "recording", None)  # a recording inside a recording's call
    with _LOCK:
        if _open[0] == 0:
            _swap_in()
        _open[0] += 1
    _here.recording = _Recording(host)
    try:
        yield
    finally:
        _here.recording = outer
        with _LOCK:
            _open[0] -= 1
            if _open[0] == 0:  # the last recording, in any thread, has ended
                _swapped.close()  # torch's functions back, in the reverse order


class _Recording:
    """What the answers of one recording need: its CPU memory, its streams."""

    def __init__(self, host: Storages):
        self.host = host
        self.streams = {"current_stream": CaptureStream(), "default_stream": CaptureStream()}


_here = threading.local()  # `recording`: the `_Recording` of this thread's call, if any
_LOCK = threading.Lock()
_open = [0]  # how many recordings are open, in any thread
# While they are: what puts torch's functions back, and removes the hook.
_swapped = contextlib.ExitStack()


def _swap_in() -> None:
    """Swap torch's functions for ones that answer this thread's recording, if any."""
    cuda = torch.cuda

    def is_capturing(recording: _Recording, *args: Any, **kwargs: Any) -> bool:
        return True

    def synchronize(recording: _Recording, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{HOST_READ} `torch.cuda.synchronize()`)")

    def stream(name: str) -> Callable[..., Any]:
        def get(recording: _Recording, *args: Any, **kwargs: Any) -> Any:
            return recording.streams[name]

        return get

    def saved_location(recording: _Recording, storage: Any) -> Any:
        if storage.nbytes() and not recording.host.stores_on_host(storage):
            raise RuntimeError(
                f"{COPY} a tensor of the graph saved, `torch.save`, which copies it to the host)"
            )
        return original_location_tag(storage)

    answers: list[tuple[Any, str, Callable[..., Any]]] = [
        (cuda, "is_available", is_capturing),
        (cuda, "is_current_stream_capturing", is_capturing),
        (cuda, "synchronize", synchronize),
        (cuda, "current_stream", stream("current_stream")),
        (cuda, "default_stream", stream("default_stream")),
        # `torch.save` (and `pickle`, through it) names the location of each storage it
        # saves with it, looked up at each call.
        (torch.serialization, "location_tag", saved_location),
    ]
    original_location_tag = torch.serialization.location_tag
    for module, name, answer in answers:
        original = getattr(module, name)
        _swapped.callback(setattr, module, name, original)
        setattr(module, name, _on_recording_thread(answer, original))
    _swapped.callback(setattr, cuda, "Event", cuda.Event)
    cuda.Event = _event_class(cuda.Event)  # type: ignore[assignment, misc]
    # A hook of torch's global registry of optimizer hooks, there while a call is recorded.
    _swapped.callback(register_optimizer_step_pre_hook(_check_optimizer).remove)


def _on_recording_thread(answer: Callable[..., Any], original: Any) -> Any:
    """``original``, which answers with ``answer`` on a thread that records a call."""

    @functools.wraps(original)  # its name, docstring and signature, to every thread
    def swapped(*args: Any, **kwargs: Any) -> Any:
        recording = getattr(_here, "recording", None)
        if recording is None:
            return original(*args, **kwargs)
        return answer(recording, *args, **kwargs)

    return swapped


def _event_class(torch_event: type) -> type:
    """``torch.cuda.Event`` while a call is recorded: a `CaptureEvent` on the recording
    thread, torch's event on others.

    A class, not a function, so that ``isinstance(e, torch.cuda.Event)`` still works; to
    other threads it is torch's class but in name: its calls make torch's events, torch's
    events and subclasses are its instances and subclasses, and its class attributes
    (``from_ipc_handle``) are torch's. (A class that another thread derives from it while a
    call is recorded is not torch's.)
    """

    class EventType(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            if getattr(_here, "recording", None) is None:
                return torch_event(*args, **kwargs)
            return super().__call__(*args, **kwargs)

        def __instancecheck__(cls, instance: Any) -> bool:
            return type.__instancecheck__(cls, instance) or isinstance(instance, torch_event)

        def __subclasscheck__(cls, subclass: type) -> bool:
            return type.__subclasscheck__(cls, subclass) or issubclass(subclass, torch_event)

        def __getattr__(cls, name: str) -> Any:
            return getattr(torch_event, name)

    class Event(CaptureEvent, metaclass=EventType):
        __doc__ = torch_event.__doc__

    Event.__module__, Event.__qualname__ = torch_event.__module__, torch_event.__qualname__
    return Event


def _check_optimizer(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    """On the recording thread, refuse the step of an optimizer that has a capturable mode
    without it, as torch's own check does in a CUDA capture
    (``Optimizer._accelerator_graph_capture_health_check``, which sees no accelerator on the
    CPU); its step counts would be read on the host. A fused optimizer needs it too."""
    if getattr(_here, "recording", None) is None:
        return
    groups = optimizer.param_groups
    if "capturable" in optimizer.defaults and not all(g.get("capturable") for g in groups):
        raise RuntimeError(
            f"Attempting CUDA graph capture of step() for an instance of "
            f"{type(optimizer).__name__} but param_groups' capturable is False. (the "
            "emulation of torch's check of an optimizer's step in a CUDA capture)"
        )
