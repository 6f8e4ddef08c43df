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
the host (``.cpu()``, ``torch.save``), synchronisations (``torch.cuda.synchronize()``, a
stream's or an event's: see `_emulation.capturing`), and CPU tensors that the function makes meeting
the graph's tensors. On the CPU every tensor is a CPU tensor; the recording tells
apart the ones that would be on the CPU in a GPU run too: those that the function makes
without a ``device=`` (``torch.ones(3)``, ``torch.tensor(2.0)``), and those computed from
them alone. Work on them is left out of the recording, as a CUDA capture leaves out CPU
work: their values are frozen at the capture.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch

from .._compat import (
    TorchDispatchMode,
    aten_index_put_impl_,
    aten_linalg_check_errors,
    aten_linalg_eigh,
    aten_local_scalar_dense,
    aten_unique,
    aten_unique2,
    below_autograd,
    inference_mode_state,
    op_arguments,
    set_grad_enabled,
)
from .capturing import capturing
from .host_calls import COPY, HOST_MEMORY, HOST_READ, MIXED, HostCalls, tensors_in

_aten = torch.ops.aten
# ATen operations whose output shape depends on tensor values, read by the host.
_DATA_DEPENDENT = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.unique_dim.default,
    aten_unique,
    aten_unique2,
    _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default,
    _aten.bincount.default,
}
# ATen operations whose CUDA kernel reads a 0-dim tensor argument (at this position) with
# `.item()`: a host read when it is the graph's tensor, not when it is a CPU tensor (torch
# 2.11; pytorch#190512 proposes a device read for `masked_fill`).
_READS_VALUE = {
    _aten.masked_fill.Tensor: 2,
    _aten.masked_fill_.Tensor: 2,
    _aten.index_fill.int_Tensor: 3,
    _aten.index_fill_.int_Tensor: 3,
}
# ATen operations that CUDA runs on tensors of one device only: a CPU scalar among them is
# refused too (elementwise operations take it as a number).
_ONE_DEVICE = {_aten.cat.default, _aten.stack.default}
_INDEX_PUTS = {_aten.index_put_.default, _aten.index_put.default, aten_index_put_impl_}
_INDEXING = {_aten.index.Tensor, *_INDEX_PUTS}


# A recorded operation: the function, its arguments, its result at the capture, and the
# modes it ran in (grad mode, inference mode). A replay runs it in them: some kernels return
# more in grad mode (oneDNN's LSTM, its workspace), and the tensors made under inference
# mode are inference tensors, which only that mode may write into.
Op = tuple[Any, tuple[Any, ...], dict[str, Any], Any, tuple[bool, bool]]


class Recorder(TorchDispatchMode):
    """Records the ATen operations of one call; undoes their writes to older tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._made: set[int] = set()  # the storages that the recorded operations allocated
        self._saved: dict[int, tuple[Any, Any]] = {}  # storage address: (storage, its copy)
        self._host: set[int] = set()  # the storages of the CPU tensors that the call made
        self._making_host = False  # while a factory makes such a tensor
        self._kept: list[torch.Tensor] = []  # those tensors, which the recording does not hold

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = tensors_in([*args, *kwargs.values()])
        on_host = [t for t in tensors if self.on_host(t)]
        if self._making_host or (on_host and len(on_host) == len(tensors)):
            # CPU work, left out of the recording (see above).
            out = func(*args, **kwargs)
            self._host_made(out)
            return out
        written = _written(func, args, kwargs)
        if func in _INDEXING:
            _check_indexing(func, args, kwargs, self.on_host)
        elif on_host:
            _check_mixed(func, on_host, written, self.on_host)
        read = _host_read(func, args, kwargs, self.on_host)
        if read:
            raise RuntimeError(f"{HOST_READ} {read})")
        # Writes into memory that existed before the call (parameters, optimizer state, and
        # views of them, such as `.data`) are undone: their storage is saved first.
        for tensor in written:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._made and key not in self._saved:
                self._saved[key] = (storage, storage.clone())
        if torch.Tag.nondeterministic_seeded in func.tags:
            # A random operation of the graph leaves the default generator as it was. A CUDA
            # capture draws no numbers: torch gives the graph an offset into the generator,
            # taken and advanced at each replay, so that the first replay draws what an
            # eager call would draw next. Left advanced, it would make every later draw,
            # eager or replayed, differ from a run without graphs seeded alike. (The
            # function's CPU work draws at the capture, as on CUDA: it is not recorded.)
            with torch.random.fork_rng(devices=[], device_type="cpu"):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if written and _in_place_foreach(func):
            # Under a dispatch mode, torch leaves the version counters of the tensors that an
            # in-place foreach operation writes as they were (`td.update_` copies with one);
            # a CUDA capture moves them, which tells the library the inputs a graph writes.
            torch.autograd.graph.increment_version([t for t in written if not t.is_inference()])
        # Memory the operation allocated (not a view of its inputs).
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        self._made |= {t.untyped_storage().data_ptr() for t in tensors_in(out)} - inputs
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        if on_host:  # CPU tensors are numbers to a CUDA kernel: their values at the capture
            args, kwargs = _map_tensors((args, kwargs), self._frozen)
        self.ops.append((func, args, kwargs, out, modes))
        return out

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` would be on the CPU in a GPU run too (see above), made by this
        call or by an eager run of the function (`HOST_MEMORY`)."""
        return (bool(self._host) and _address(tensor) in self._host) or HOST_MEMORY.holds(tensor)

    def _frozen(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor``'s value now if it is a CPU tensor (see `on_host`)."""
        return tensor.clone() if self.on_host(tensor) else tensor

    def stores_on_host(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is the memory of such a tensor (see `on_host`)."""
        return storage.data_ptr() in self._host or HOST_MEMORY.holds_storage(storage)

    def make_on_host(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Call a factory that makes its tensors on the CPU in a GPU run too."""
        self._making_host = True
        try:
            out = func(*args, **kwargs)
        finally:
            self._making_host = False
        self._host_made(out)
        return out

    def _host_made(self, out: Any) -> None:
        """Mark the tensors of ``out`` as made on the CPU. They are kept until the recording
        ends, as the recorded operations keep theirs: no other tensor gets their address."""
        for t in tensors_in(out):
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

    def __init__(self, ops: list[Op]):
        # The operations in runs of one mode each, on detached aliases of their tensors (the
        # same memory, without the autograd metadata that grad mode would check: a view of
        # a `split` whose base a replay rewrote may not be read there).
        aliases: dict[int, torch.Tensor] = {}  # one per tensor

        def detached(t: torch.Tensor) -> torch.Tensor:
            return aliases.setdefault(id(t), t.detach())

        self._runs = [
            (modes, [_map_tensors(op[:4], detached) for op in run])
            for modes, run in itertools.groupby(ops, key=operator.itemgetter(4))
        ]

    def replay(self) -> None:
        grad = torch.is_grad_enabled()
        try:
            with below_autograd():  # no autograd graph: the capture's tensors are reused
                for (enabled, inference), ops in self._runs:
                    with inference_mode_state(inference):
                        set_grad_enabled(enabled)
                        for func, args, kwargs, out in ops:
                            new = func(*args, **kwargs)
                            for old, fresh in zip(tensors_in(out), tensors_in(new), strict=True):
                                if old is not fresh and not _same_memory(old, fresh):
                                    old.copy_(fresh)
        finally:
            set_grad_enabled(grad)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to each tensor in it (in dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def record(fn: Callable[[], Any]) -> tuple[RecordedGraph, Any]:
    """Run ``fn`` once, recording it; its effects on older tensors are undone."""
    recorder = Recorder()
    try:
        with recorder, HostCalls(recorder), capturing(recorder):
            out = fn()
    finally:
        recorder.undo()
    return RecordedGraph(recorder.ops), out


def _address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage; 0 for a tensor without one (such as the
    batched tensors that `torch.vmap` passes to the function)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return 0


def _check_mixed(
    func: Any, on_host: list[torch.Tensor], written: list[torch.Tensor], host: Any
) -> None:
    """Refuse an operation between CPU tensors that the function made and the graph's
    tensors, as CUDA does, but for CPU scalars read as numbers."""
    if any(host(t) for t in written):
        raise RuntimeError(f"{COPY} a copy into a CPU tensor that the function made)")
    if func is _aten.copy_.default:
        raise RuntimeError(
            f"{COPY} a copy from a CPU tensor that the function made, or of a number "
            "assigned to one element, `x[0] = 0.0` on a 1-D `x`)"
        )
    if func in _ONE_DEVICE or any(t.dim() > 0 for t in on_host):
        raise RuntimeError(MIXED)


# Batch norms update their running statistics (arguments 3 and 4) in training (argument 5)
# without their schema saying so.
_BATCH_NORMS = {_aten.native_batch_norm.default, _aten.cudnn_batch_norm.default}


def _in_place_foreach(func: Any) -> bool:
    """Whether ``func`` is an in-place foreach operation (``_foreach_copy_``, ...)."""
    name: str = func.overloadpacket.__name__
    return name.startswith("_foreach_") and name.endswith("_")


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors that ``func`` writes into (its mutable arguments)."""
    written: list[torch.Tensor] = []
    if func in _BATCH_NORMS and len(args) > 5 and args[5]:
        written.extend(tensors_in([args[3], args[4]]))
    for i, argument in enumerate(op_arguments(func)):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or i >= len(args) else args[i]
        written.extend(tensors_in(value))
    return written


def _host_read(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], host: Any) -> str | None:
    """What an operation that CUDA runs with a read of tensor values on the host reads."""
    if func is aten_local_scalar_dense:
        return "a host read of a tensor's value, `.item()`"
    if func in _DATA_DEPENDENT:
        return "an output shape that depends on values"
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "an output shape that depends on values, `repeat_interleave`"
    if func is _aten.equal.default and _compares_values(args[0], args[1]):
        return "a host read of tensors' values, `torch.equal`"
    if func is _aten.allclose.default:
        return "a host read of tensors' values, `torch.allclose`"
    if func in _READS_VALUE and not host(args[_READS_VALUE[func]]):
        return (
            f"a host read of a tensor's value, the value given to `{func.__name__.split('.')[0]}`"
            ", which CUDA reads with `.item()`; `torch.where` reads it on the device"
        )
    if func is aten_linalg_check_errors:
        return (
            "a host read of the error codes of `torch.linalg`'s `cholesky`, `inv` or `solve`;"
            " their `_ex` forms, such as `torch.linalg.cholesky_ex`, leave them on the device"
        )
    if func is aten_linalg_eigh:
        return (
            "a host synchronisation of `torch.linalg.eigh` (or `eigvalsh`), whose CUDA solver"
            " reads on the host (torch 2.11)"
        )
    if func in _NORMAL_WITH_TENSOR_STD:
        return (
            "a host read of the standard deviations given to `torch.normal` as a tensor, which"
            " CUDA checks to be >= 0 with `.item()` (`torch.distributions.Normal.sample` calls"
            " it); draw `loc + scale * torch.randn_like(loc)` instead, as `rsample` does"
        )
    if func is _aten.histc.default and _range_not_given(args, kwargs):
        return "a host read of the range of `torch.histc`; give it `min` and `max`"
    return None


# `torch.normal` with a tensor of standard deviations: CUDA checks them on the host (torch
# 2.11, `normal expects all elements of std >= 0.0`, seen on the H100 in torchrl's CrossQ).
_NORMAL_WITH_TENSOR_STD = (
    _aten.normal.Tensor_Tensor,
    _aten.normal.float_Tensor,
    _aten.normal.Tensor_Tensor_out,
    _aten.normal.float_Tensor_out,
)


def _range_not_given(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``histc``'s call leaves its range to a read of the values' minimum and maximum
    (``min == max``, as by default)."""
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return bool(low == high and args[0].numel() > 0)


def _compares_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch.equal(a, b)`` reads values: unless their shapes differ, they are empty,
    or they are the same view of the same memory (a shortcut of CUDA's `equal` too)."""
    view = (a.storage_offset(), a.stride(), a.dtype)
    same_view = _same_memory(a, b) and view == (b.storage_offset(), b.stride(), b.dtype)
    return a.shape == b.shape and a.numel() > 0 and not same_view


def _check_indexing(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], host: Any) -> None:
    """Refuse an indexing that a CUDA capture refuses, as CUDA's indexing decides
    (``_index_put_impl_``, ``make_info`` in TensorAdvancedIndexing.cpp): an assignment of a
    CPU value (a Python number, `x[...] = 0.0`) with one boolean mask is a ``masked_fill_``;
    else a CPU value, or CPU indices, are copied to the device, and a mask's count of values
    is read on the host."""
    indices = [i for i in args[1] if isinstance(i, torch.Tensor)]
    masks = [i for i in indices if i.dtype in (torch.bool, torch.uint8)]
    if func in _INDEX_PUTS:
        value = args[2]
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if host(value) and value.numel() == 1:
            if not accumulate and len(indices) == len(masks) == 1 and not host(masks[0]):
                return
            if value.dim() == 0:
                raise RuntimeError(f"{COPY} a number assigned at tensor indices, `x[idx] = 0.0`)")
        if host(value):
            raise RuntimeError(MIXED)
    if host(args[0]):
        raise RuntimeError(f"{COPY} a CPU tensor that the function made, indexed by the graph's)")
    if any(host(i) for i in indices):
        raise RuntimeError(f"{COPY} an index tensor that the function made on the CPU)")
    if masks:
        raise RuntimeError(f"{HOST_READ} an output shape that depends on values, a mask)")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is ``a``'s memory (an in-place or view operation returned it again)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
