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
(``.item()``, ``bool()``, ``.tolist()``, printing), data-dependent output shapes, copies to
the host (``.cpu()``), ``torch.cuda.synchronize()``, and CPU tensors that the function makes
meeting the graph's tensors. On the CPU every tensor is a CPU tensor; the recording tells
apart the ones that would be on the CPU in a GPU run too: those that the function makes
without a ``device=`` (``torch.ones(3)``, ``torch.tensor(2.0)``), and those computed from
them alone. Work on them is left out of the recording, as a CUDA capture leaves out CPU
work: their values are frozen at the capture.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._compat import TorchDispatchMode, below_autograd, op_arguments

_HOST_READ = "operation not permitted when stream is capturing (the emulation of"
_COPY = "Cannot copy between CPU and CUDA tensors during CUDA graph capture (the emulation of"
_MIXED = (
    "Expected all tensors to be on the same device (the emulation of a CPU tensor that the "
    "function made without `device=`, used with the graph's tensors)"
)
_aten = torch.ops.aten
# ATen operations whose output shape depends on tensor values, read by the host.
_DATA_DEPENDENT = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.unique_dim.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.bincount.default,
}
_INDEX_PUTS = {_aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}


class Recorder(TorchDispatchMode):
    """Records the ATen operations of one call; undoes their writes to older tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self._made: set[int] = set()  # the storages that the recorded operations allocated
        self._saved: dict[int, tuple[Any, Any]] = {}  # storage address: (storage, its copy)
        self._host: set[int] = set()  # the storages of the CPU tensors that the call made
        self.making_host = False  # while a factory makes such a tensor
        self._kept: list[torch.Tensor] = []  # those tensors, which the recording does not hold

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = _tensors([*args, *kwargs.values()])
        on_host = [t for t in tensors if self.on_host(t)]
        if self.making_host or (on_host and len(on_host) == len(tensors)):
            # CPU work, left out of the recording (see above).
            out = func(*args, **kwargs)
            self.host_made(out)
            return out
        if on_host:
            _check_mixed(func, on_host, _written(func, args, kwargs), self.on_host)
        if func is _aten._local_scalar_dense.default:
            raise RuntimeError(f"{_HOST_READ} a host read of a tensor's value, `.item()`)")
        if func in _DATA_DEPENDENT or _depends_on_values(func, args, kwargs):
            raise RuntimeError(f"{_HOST_READ} an output shape that depends on values)")
        # Writes into memory that existed before the call (parameters, optimizer state, and
        # views of them, such as `.data`) are undone: their storage is saved first.
        for written in _written(func, args, kwargs):
            storage = written.untyped_storage()
            key = storage.data_ptr()
            if key not in self._made and key not in self._saved:
                self._saved[key] = (storage, storage.clone())
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in _tensors(out):  # memory the operation allocated (not a view of its inputs)
            key = t.untyped_storage().data_ptr()
            if key not in inputs:
                self._made.add(key)
        self.ops.append((func, args, kwargs, out))
        return out

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` would be on the CPU in a GPU run too (see above)."""
        return bool(self._host) and _address(tensor) in self._host

    def host_made(self, out: Any) -> None:
        """Mark the tensors of ``out`` as made on the CPU. They are kept until the recording
        ends, as the recorded operations keep theirs: no other tensor gets their address."""
        for t in _tensors(out):
            key = _address(t)
            if key:  # not an empty tensor's, nor a tensor without storage
                self._host.add(key)
                self._made.add(key)
                self._kept.append(t)

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
        with recorder, _HostCalls(recorder), _cuda_capturing():
            out = fn()
    finally:
        recorder.undo()
    return RecordedGraph(recorder.ops), out


# Tensor methods that read values on the host without an ATen operation, which a dispatch
# mode cannot see.
_HOST_METHODS = {
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.__array__,
}
# Functions that make a tensor on the default device (the CPU) unless given `device=`.
_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.scalar_tensor,
    torch.ones,
    torch.zeros,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


class _HostCalls(TorchFunctionMode):
    """Sees the calls that a dispatch mode cannot: host reads and copies, and the device
    a factory was asked for (a mode is the recording thread's alone)."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if this is not None and not self._recorder.on_host(this):
            if func in _HOST_METHODS:
                raise RuntimeError(f"{_HOST_READ} a host read of a tensor, `{func.__name__}`)")
            if func is torch.Tensor.cpu:
                raise RuntimeError(f"{_HOST_READ} a copy to the host, `.cpu()`)")
        elif this is not None and _copies_to_device(func, args[1:], kwargs):
            raise RuntimeError(f"{_COPY} a CPU tensor copied to the device, `.to()`)")
        return func(*args, **kwargs)

    def _factory(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        data = args[0] if args else kwargs.get("data")
        if kwargs.get("device") is None and kwargs.get("out") is None:
            self._recorder.making_host = True
            try:
                out = func(*args, **kwargs)
            finally:
                self._recorder.making_host = False
            self._recorder.host_made(out)
            return out
        if func in _FROM_DATA and not isinstance(data, torch.Tensor):
            raise RuntimeError(
                f"{_COPY} a tensor made from Python data on the device, "
                "`torch.tensor([...], device=...)`)"
            )
        return func(*args, **kwargs)


@contextlib.contextmanager
def _cuda_capturing() -> Iterator[None]:
    """On this thread, ``torch.cuda`` says a capture is in progress while a call is recorded
    (other threads are left alone): code that skips its host checks during a CUDA capture
    asks it (torchrl's distributions, torch's optimizers), and a synchronisation raises."""
    thread = threading.get_ident()
    originals = {
        name: getattr(torch.cuda, name)
        for name in ("is_available", "is_current_stream_capturing", "synchronize")
    }

    def capturing(original: Any) -> Any:
        def query(*args: Any, **kwargs: Any) -> Any:
            return threading.get_ident() == thread or original(*args, **kwargs)

        return query

    def synchronize(*args: Any, **kwargs: Any) -> None:
        if threading.get_ident() == thread:
            raise RuntimeError(f"{_HOST_READ} `torch.cuda.synchronize()`)")
        originals["synchronize"](*args, **kwargs)

    torch.cuda.is_available = capturing(originals["is_available"])
    torch.cuda.is_current_stream_capturing = capturing(originals["is_current_stream_capturing"])
    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.cuda, name, original)


def _address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage; 0 for a tensor without one (such as the
    batched tensors that `torch.vmap` passes to the function)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return 0


def _copies_to_device(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``Tensor.cuda`` or ``Tensor.to`` names a device (else a dtype)."""
    if func is torch.Tensor.cuda:
        return True
    targets = [*args, kwargs.get("device")]
    return func is torch.Tensor.to and any(
        isinstance(t, str | torch.device | torch.Tensor) for t in targets
    )


def _check_mixed(
    func: Any, on_host: list[torch.Tensor], written: list[torch.Tensor], host: Any
) -> None:
    """Refuse an operation between CPU tensors that the function made and the graph's
    tensors, as CUDA does, but for CPU scalars read as numbers."""
    if any(host(t) for t in written):
        raise RuntimeError(f"{_COPY} a copy into a CPU tensor that the function made)")
    if func is _aten.copy_.default:
        raise RuntimeError(f"{_COPY} a copy from a CPU tensor that the function made)")
    if any(t.dim() > 0 for t in on_host):
        raise RuntimeError(_MIXED)


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


def _depends_on_values(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an operation needs the count of values that a tensor holds: indexing with a
    boolean mask (an assignment of one value is a ``masked_fill_`` on CUDA), or repeats
    given by a tensor without their total."""
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None and (len(args) < 2 or args[1] is None)
    if func is _aten.index.Tensor or func in _INDEX_PUTS:
        indices = args[1] if len(args) > 1 else ()
        masks = any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
        return masks and (func is _aten.index.Tensor or args[2].numel() != 1)
    return False


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is ``a``'s memory (an in-place or view operation returned it again)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
