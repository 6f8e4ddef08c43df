"""The emulation's recording answers for torch's Python API on its own thread only."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cudagraph_td import CudaGraphModule, make_graphed_callables
from cudagraph_td._emulation.capturing import capturing

from .conftest import run_threads

_NAMES = (
    "is_available",
    "is_current_stream_capturing",
    "synchronize",
    "current_stream",
    "default_stream",
    "Event",
)


def _answering() -> dict[str, Any]:
    """What the recording answers for, as torch's modules hold it now."""
    return {
        **{name: getattr(torch.cuda, name) for name in _NAMES},
        "location_tag": torch.serialization.location_tag,
    }


_TORCH = _answering()  # torch's own, at import: no recording is open


def _outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    """What calling ``fn`` gives: its result, or its error's type and message."""
    try:
        return ("returns", fn())
    except Exception as err:  # torch's own error on this build (no CUDA, say)
        return ("raises", type(err), str(err))


def _check_torchs_answers() -> None:
    """This thread gets torch's own answers from what the recording answers for."""
    now = _answering()
    for name in ("is_available", "is_current_stream_capturing", "synchronize"):
        assert _outcome(now[name]) == _outcome(_TORCH[name]), name
    for name in ("current_stream", "default_stream"):  # Stream objects compare by handle
        assert _outcome(now[name]) == _outcome(_TORCH[name]), name
    made, torchs = _outcome(now["Event"]), _outcome(_TORCH["Event"])
    assert made[0] == torchs[0] and (made[1:] if made[0] == "raises" else type(made[1])) == (
        torchs[1:] if torchs[0] == "raises" else type(torchs[1])
    )
    storage = torch.ones(2).untyped_storage()
    assert now["location_tag"](storage) == _TORCH["location_tag"](storage)
    # Their names and signatures are torch's; torch's event class is `torch.cuda.Event`'s
    # instance and subclass check, and its class attributes are there.
    for name in ("is_available", "synchronize", "current_stream", "default_stream"):
        assert now[name].__name__ == name
        assert inspect.signature(now[name]) == inspect.signature(_TORCH[name])
    assert issubclass(_TORCH["Event"], torch.cuda.Event)
    assert torch.cuda.Event.from_ipc_handle == _TORCH["Event"].from_ipc_handle
    assert torch.cuda.Event.__name__ == "Event"
    # An optimizer without `capturable=True` steps, unchecked.
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    torch.optim.Adam([w], lr=0.1).step()
    assert w.detach().tolist() == pytest.approx([0.9, 0.9])


def test_another_thread_gets_torchs_answers_during_a_recording() -> None:
    recording, checked = threading.Event(), threading.Event()
    inside: list[tuple[bool, bool, bool]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if _recording_now():  # the recording, not an eager run
            event = torch.cuda.Event()
            inside.append(
                (torch.cuda.is_available(), isinstance(event, torch.cuda.Event), event.query())
            )
            recording.set()
            assert checked.wait(30)
        return x * 2

    graphed = CudaGraphModule(fn, warmup=1, backend="emulate")

    def record() -> None:
        graphed(torch.ones(3))

    def check() -> None:
        assert recording.wait(30)
        try:
            _check_torchs_answers()
        finally:
            checked.set()

    run_threads(record, check)
    assert inside == [(True, True, True)]  # the recording thread got the capture's answers
    assert graphed.is_captured
    assert _answering() == _TORCH
    torch.testing.assert_close(graphed(torch.full((3,), 2.0)), torch.full((3,), 4.0))


class _Host:
    """A recorder's view of CPU memory that holds every storage."""

    def stores_on_host(self, storage: torch.UntypedStorage) -> bool:
        return True


def test_recordings_in_two_threads_keep_their_own_answers() -> None:
    # Thread A's recording ends while B's is open: A gets torch's answers again, B keeps
    # its recording's until it ends, and then torch's functions are back.
    a_open, b_open, a_done = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with capturing(_Host()):
            a_open.set()
            assert b_open.wait(30)
            assert torch.cuda.is_current_stream_capturing()
        try:
            _check_torchs_answers()
        finally:
            a_done.set()

    def b() -> None:
        assert a_open.wait(30)
        with capturing(_Host()):
            b_open.set()
            assert a_done.wait(30)
            assert torch.cuda.is_current_stream_capturing() and torch.cuda.is_available()
            with pytest.raises(RuntimeError, match="operation not permitted when stream is"):
                torch.cuda.synchronize()

    run_threads(a, b)
    assert _answering() == _TORCH
    _check_torchs_answers()


def _recording_now() -> bool:
    # Outside a recording, a CPU build of torch raises.
    return _outcome(torch.cuda.is_current_stream_capturing) == ("returns", True)


def test_graphed_callables_made_in_two_threads_at_once() -> None:
    # Thread A's recording opens first and ends first, while B's is open; then A, still
    # running, gets torch's answers (it once kept the recording's for good).
    a_open, b_open, a_done, b_done = (threading.Event() for _ in range(4))

    def forward_a(x: torch.Tensor) -> torch.Tensor:
        if _recording_now():
            a_open.set()
            assert b_open.wait(30)
        return x * 2

    def forward_b(x: torch.Tensor) -> torch.Tensor:
        if _recording_now():
            b_open.set()
            assert a_done.wait(30)
            assert torch.cuda.is_available()  # still its recording's answer
        return x * 3

    def a() -> None:
        try:
            graphed = make_graphed_callables(forward_a, (torch.ones(2),), backend="emulate")
        finally:
            a_done.set()
        assert b_done.wait(30)
        _check_torchs_answers()
        torch.testing.assert_close(graphed(torch.ones(2)), torch.full((2,), 2.0))

    def b() -> None:
        assert a_open.wait(30)
        try:
            graphed = make_graphed_callables(forward_b, (torch.ones(2),), backend="emulate")
        finally:
            b_done.set()
        torch.testing.assert_close(graphed(torch.ones(2)), torch.full((2,), 3.0))

    run_threads(a, b)
    assert _answering() == _TORCH


def test_a_recording_inside_a_recording_gives_the_outer_ones_answers_back() -> None:
    outer, inner = _Host(), _Host()
    with capturing(outer):
        stream = torch.cuda.current_stream()
        with capturing(inner):
            assert torch.cuda.current_stream() is not stream
        assert torch.cuda.current_stream() is stream
        assert torch.cuda.is_current_stream_capturing()
    assert _answering() == _TORCH
