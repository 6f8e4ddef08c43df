"""The CPU emulation's graphs: ATen operations recorded once, replayed without Python.

A CUDA capture records kernels; its replays run them again on the same memory, never the
function's Python code. The emulation does the same one level up: the capture runs the
function once under a ``TorchDispatchMode`` that records every ATen operation with its
tensors, and undoes the operation's effects on tensors that existed before (parameters,
optimizer state, inputs), as a CUDA capture has none. A replay runs the recorded operations
again, below autograd: in-place ones update the same tensors, and each other one's new
result is copied into the tensor it returned at the capture, which later operations read.

Operations that a CUDA capture refuses raise at the emulated capture, with the phrase of
CUDA's error (so that the capture failure names the same cause): host reads of tensor values
(``.item()``, ``bool()``, ``.tolist()``, printing), data-dependent output shapes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._compat import TorchDispatchMode, below_autograd, op_arguments

_HOST_READ = "operation not permitted when stream is capturing (the emulation of"
_aten = torch.ops.aten
# ATen operations whose output shape depends on tensor values, read by the host.
_DATA_DEPENDENT = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.unique_dim.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
}


class Recorder(TorchDispatchMode):
    """Records the ATen operations of one call; undoes their writes to older tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self._made: set[int] = set()  # the storages that the recorded operations allocated
        self._saved: dict[int, tuple[Any, Any]] = {}  # storage address: (storage, its copy)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            raise RuntimeError(f"{_HOST_READ} a host read of a tensor's value, `.item()`)")
        if func in _DATA_DEPENDENT or (func is _aten.index.Tensor and _boolean_index(args)):
            raise RuntimeError(f"{_HOST_READ} an output shape that depends on values)")
        if func is _aten.lift_fresh.default:  # `torch.tensor([...])`: copied to the GPU there
            raise RuntimeError(
                "Cannot copy between CPU and CUDA tensors during CUDA graph capture (the "
                "emulation of a tensor made from Python data, `torch.tensor([...])`)"
            )
        # Writes into memory that existed before the call (parameters, optimizer state, and
        # views of them, such as `.data`) are undone: their storage is saved first.
        for written in _written(func, args, kwargs):
            storage = written.untyped_storage()
            key = storage.data_ptr()
            if key not in self._made and key not in self._saved:
                self._saved[key] = (storage, storage.clone())
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors([*args, *kwargs.values()])}
        for t in _tensors(out):  # memory the operation allocated (not a view of its inputs)
            key = t.untyped_storage().data_ptr()
            if key not in inputs:
                self._made.add(key)
        self.ops.append((func, args, kwargs, out))
        return out

    def undo(self) -> None:
        """Give the tensors that existed before the call their values back."""
        with torch.no_grad(), below_autograd():
            for storage, before in self._saved.values():
                storage.copy_(before)
        self._saved.clear()


class RecordedGraph:
    """The recorded operations of a call, replayed on the same tensors."""

    def __init__(self, ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]]):
        self._ops = ops

    def replay(self) -> None:
        with torch.no_grad(), below_autograd():
            for func, args, kwargs, out in self._ops:
                new = func(*args, **kwargs)
                for old, fresh in zip(_tensors(out), _tensors(new), strict=True):
                    if old is not fresh and not _same_memory(old, fresh):
                        old.copy_(fresh)


def record(fn: Callable[[], Any]) -> tuple[RecordedGraph, Any]:
    """Run ``fn`` once, recording it; its effects on older tensors are undone."""
    recorder = Recorder()
    try:
        with recorder, _host_reads_refused():
            out = fn()
    finally:
        recorder.undo()
    return RecordedGraph(recorder.ops), out


# Host reads that torch serves without an ATen operation, which a dispatch mode cannot see.
_HOST_METHODS = ("tolist", "numpy", "__repr__", "__str__", "__format__", "__array__")


@contextlib.contextmanager
def _host_reads_refused() -> Iterator[None]:
    """Make this thread's host reads of tensors raise while a call is recorded (other
    threads are left alone)."""
    thread = threading.get_ident()
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_METHODS}

    def refusing(name: str, original: Any) -> Any:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                raise RuntimeError(f"{_HOST_READ} a host read of a tensor, `{name}`)")
            return original(self, *args, **kwargs)

        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, refusing(name, original))
    # Code that skips its host checks during a CUDA capture (torchrl's distributions, torch's
    # optimizers) asks `torch.cuda`: on the recording thread, a capture is in progress.
    cuda_queries = {
        name: getattr(torch.cuda, name) for name in ("is_available", "is_current_stream_capturing")
    }

    def capturing(original: Any) -> Any:
        def query(*args: Any, **kwargs: Any) -> Any:
            return threading.get_ident() == thread or original(*args, **kwargs)

        return query

    for name, original in cuda_queries.items():
        setattr(torch.cuda, name, capturing(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in cuda_queries.items():
            setattr(torch.cuda, name, original)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    return []


# Batch norms update their running statistics (arguments 3 and 4) in training (argument 5)
# without their schema saying so.
_BATCH_NORMS = {_aten.native_batch_norm.default, _aten.cudnn_batch_norm.default}


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors that ``func`` writes into (its mutable arguments)."""
    written: list[torch.Tensor] = []
    if func in _BATCH_NORMS and len(args) > 5 and args[5]:
        written.extend(_tensors([args[3], args[4]]))
    for i, argument in enumerate(op_arguments(func)):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or i >= len(args) else args[i]
        written.extend(_tensors(value))
    return written


def _boolean_index(args: tuple[Any, ...]) -> bool:
    """Whether an ``index`` operation indexes with a boolean mask (its shape is data's)."""
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is ``a``'s memory (an in-place or view operation returned it again)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
