"""What the emulation's recording sees above the dispatcher: the device a call names.

A dispatch mode sees ATen operations, but not the Python calls that decide where a tensor
lives: a factory without ``device=`` makes a CPU tensor in a GPU run too, ``torch.tensor``
of Python data on the device is a copy from the host, ``x[i] = 0.0`` assigns a Python number
through a CPU tensor, and some reads of values (``tolist``, printing) run no ATen operation.
``HostCalls``, a ``TorchFunctionMode`` (the recording thread's alone), tells the recorder
which tensors are such CPU tensors and refuses what a CUDA capture refuses, with the phrase
of CUDA's error.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from .._compat import default_device_set

HOST_READ = "operation not permitted when stream is capturing (the emulation of"
COPY = "Cannot copy between CPU and CUDA tensors during CUDA graph capture (the emulation of"
GENERATOR = (
    "Attempt to increase offset for a CUDA generator not in capture mode. (the emulation of "
    "random numbers drawn from a `torch.Generator` of the function's own)"
)
MIXED = (
    "Expected all tensors to be on the same device (the emulation of a CPU tensor that the "
    "function made without `device=`, used with the graph's tensors)"
)

# Tensor methods that read values on the host without an ATen operation.
_HOST_METHODS = {
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.__array__,
}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
# Functions that make a tensor on the default device (the CPU) unless given `device=`.
_FACTORIES = {
    *_FROM_DATA,
    *(torch.scalar_tensor, torch.ones, torch.zeros, torch.full, torch.eye),
    *(torch.empty, torch.empty_strided),
    *(torch.arange, torch.linspace, torch.logspace, torch.tril_indices, torch.triu_indices),
    *(torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal),
    *(torch.hann_window, torch.hamming_window, torch.blackman_window, torch.bartlett_window),
    torch.kaiser_window,
}
# Functions that always make a CPU tensor, from host memory.
_FROM_HOST_MEMORY = {torch.from_numpy, torch.frombuffer}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
# The Python values that `x[index] = value` turns into a CPU tensor of `x`'s dtype.
_NUMBERS = (bool, int, float, complex)


class Host(Protocol):
    """The recorder's view of CPU tensors (`_emulation.recording.Recorder`)."""

    def on_host(self, tensor: torch.Tensor) -> bool: ...

    def make_on_host(self, func: Any, *args: Any, **kwargs: Any) -> Any: ...


class HostCalls(TorchFunctionMode):
    """Sees the calls that a dispatch mode cannot: host reads and copies, and the device
    that a factory or an assignment puts a tensor on."""

    def __init__(self, host: Host):
        super().__init__()
        self._host = host

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES:
            return self._factory(func, args, kwargs, data=args[0] if args else kwargs.get("data"))
        if func in _FROM_HOST_MEMORY:
            return self._host.make_on_host(func, *args, **kwargs)
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if this is None:
            return func(*args, **kwargs)
        on_host = self._host.on_host(this)
        if not on_host:
            _check_generator(kwargs)
        if func is torch.nn.functional.one_hot and not on_host:
            return _one_hot(this, *args[1:], **kwargs)
        if func in _INDEXING and _has_list(args[1]):
            # torch makes the index tensor of a list on the indexed tensor's device: a copy
            # to the device, or CPU work (a CPU tensor, indexed by CPU tensors, given one).
            if not on_host:
                raise RuntimeError(f"{COPY} a Python list used as an index, `x[[0, 2]]`)")
            if all(self._host.on_host(t) for t in tensors_in(list(args[1:]))):
                return self._host.make_on_host(func, *args, **kwargs)
        if func is torch.Tensor.__setitem__ and isinstance(args[2], _NUMBERS):
            # As torch does for a CUDA tensor (python_variable_indexing.cpp): the number
            # becomes a CPU tensor, which the assignment copies or reads (see
            # `_emulation.recording`).
            number = self._host.make_on_host(torch.scalar_tensor, args[2], dtype=this.dtype)
            return func(this, args[1], number)
        if func is torch.Tensor.new_tensor:  # on `this` tensor's device, unless told
            made_on_host = kwargs.get("device") is None and on_host
            self._check_data(args[1] if len(args) > 1 else kwargs.get("data"), made_on_host)
            if made_on_host:
                return self._host.make_on_host(func, *args, **kwargs)
        if not on_host:
            if func in _HOST_METHODS:
                raise RuntimeError(f"{HOST_READ} a host read of a tensor, `{func.__name__}`)")
            if func is torch.Tensor.cpu:
                raise RuntimeError(f"{HOST_READ} a copy to the host, `.cpu()`)")
        elif _copies_to_device(func, args[1:], kwargs):
            raise RuntimeError(f"{COPY} a CPU tensor copied to the device, `.to()`)")
        return func(*args, **kwargs)

    def _factory(self, func: Any, args: Any, kwargs: dict[str, Any], data: Any) -> Any:
        on_host = makes_on_host(func, args, kwargs, self._host.on_host)
        if func in _FROM_DATA:
            same_device = kwargs.get("device") is None and not default_device_set()
            if isinstance(data, torch.Tensor) and same_device:
                return func(*args, **kwargs)  # on the data's device
            self._check_data(data, on_host)
        if on_host:
            return self._host.make_on_host(func, *args, **kwargs)
        _check_generator(kwargs)
        return func(*args, **kwargs)

    def _check_data(self, data: Any, on_host: bool) -> None:
        """Refuse the data of ``torch.tensor(data)`` that CUDA cannot use in a capture:
        values of the graph's tensors, read on the host, or a copy from the host to the
        device (the tensor is not ``on_host``)."""
        if isinstance(data, torch.Tensor):
            if self._host.on_host(data) and not on_host:
                raise RuntimeError(f"{COPY} a CPU tensor copied to the device)")
            if on_host and not self._host.on_host(data):
                raise RuntimeError(f"{HOST_READ} a copy to the host)")
            return
        if any(not self._host.on_host(t) for t in tensors_in(data)):
            raise RuntimeError(
                f"{HOST_READ} a tensor made of other tensors' values, `torch.tensor([t, ...])`;"
                " `torch.stack` makes it on the device)"
            )
        if not on_host:
            raise RuntimeError(
                f"{COPY} a tensor made from Python data on the device, "
                "`torch.tensor([...], device=...)`)"
            )


def makes_on_host(func: Any, args: Any, kwargs: dict[str, Any], host: Any) -> bool:
    """Whether a call makes its tensor on the CPU in a GPU run too, as a factory without
    ``device=`` does: on the default device, the CPU, unless the caller has set another
    (`torch.set_default_device`, `with device:`). ``host`` tells the CPU tensors apart."""
    if func in _FROM_HOST_MEMORY:
        return True
    if func not in _FACTORIES or kwargs.get("device") is not None or default_device_set():
        return False
    if func in _FROM_DATA:  # `torch.tensor(x)` is on `x`'s device
        data = args[0] if args else kwargs.get("data")
        return not isinstance(data, torch.Tensor) or host(data)
    # Given a graph's tensor, a factory makes the graph's (`torch.normal(mean=x)`), or reads
    # its value (`torch.full((3,), x.sum())`, which the recorder refuses); `out=` is one too.
    return all(host(t) for t in tensors_in([*args, *kwargs.values()]))


class HostMemory:
    """The CPU tensors that wrapped functions made in their eager runs (warm-ups and
    capturing calls), which a GPU run has on the CPU too: state made on the first call (a
    counter made with `torch.zeros(())`). Held by their storages' weak references, keyed by
    address: a storage freed leaves the set."""

    def __init__(self) -> None:
        # A storage made at a freed one's address replaces it (the freed one's removal
        # leaves it there).
        self._storages: weakref.WeakValueDictionary[int, torch.UntypedStorage] = (
            weakref.WeakValueDictionary()
        )

    def add(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr():  # not an empty tensor's
                self._storages[storage.data_ptr()] = storage

    def holds(self, tensor: torch.Tensor) -> bool:
        if not self._storages:
            return False
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor without storage
            return False
        return self.holds_storage(storage)

    def holds_storage(self, storage: torch.UntypedStorage) -> bool:
        return self._storages.get(storage.data_ptr()) is storage


HOST_MEMORY = HostMemory()


class EagerRunWatch(TorchFunctionMode):
    """Marks, in `HOST_MEMORY`, the CPU tensors that a function makes in an eager run (a
    warm-up), and those computed from them alone."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.compiler.is_compiling():  # traced by `torch.compile`: nothing to mark
            return out
        made = tensors_in(out)
        if made and _made_on_host(func, args, kwargs):
            HOST_MEMORY.add(made)
        return out


def _made_on_host(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the result of an eager call is a CPU tensor in a GPU run too."""
    if func in _FACTORIES or func in _FROM_HOST_MEMORY:
        return makes_on_host(func, args, kwargs, HOST_MEMORY.holds)
    if kwargs.get("device") is not None or _copies_to_device(func, args[1:], kwargs):
        return False  # to a device (`x.new_zeros(3, device=...)`, `x.to(device)`)
    given = tensors_in([*args, *kwargs.values()])
    return bool(given) and all(HOST_MEMORY.holds(t) for t in given)


def _check_generator(kwargs: dict[str, Any]) -> None:
    """Refuse a draw of random numbers for the graph from a generator other than the default
    one: a capture gives its graph an offset into the default CUDA generator alone (torch
    refuses to advance an unregistered one while capturing)."""
    generator = kwargs.get("generator")
    defaults = (torch.default_generator, *torch.cuda.default_generators)
    if generator is not None and not any(generator is d for d in defaults):
        raise RuntimeError(GENERATOR)


def _copies_to_device(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``Tensor.cuda`` or ``Tensor.to`` names a device (else a dtype)."""
    if func is torch.Tensor.cuda:
        return True
    targets = [*args, kwargs.get("device")]
    return func is torch.Tensor.to and any(
        isinstance(t, str | torch.device | torch.Tensor) for t in targets
    )


def _one_hot(indices: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """``F.one_hot`` as CUDA computes it: the CPU's reads of the indices' range on the host
    (``.item()``) are not done, but a number of classes read from them (the default) is."""
    if num_classes == -1 and indices.numel() > 0:
        raise RuntimeError(
            f"{HOST_READ} a host read of the number of classes, `F.one_hot(x)`;"
            " give it `num_classes`)"
        )
    if num_classes < 0 or indices.dtype != torch.long:
        return torch.nn.functional.one_hot(indices, num_classes)  # torch's error
    one_hot = torch.zeros(*indices.shape, num_classes, dtype=torch.long, device=indices.device)
    return one_hot.scatter_(-1, indices.unsqueeze(-1), 1)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, in nested lists and tuples too (a factory's data, an
    operation's arguments or results)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for item in value for t in tensors_in(item)]
    return []


def _has_list(index: Any) -> bool:
    """Whether an index holds a list that torch turns into an index tensor (a list of
    numbers; a list of slices, tensors or lists is read as a tuple of indices, as NumPy)."""
    if isinstance(index, list) and not any(isinstance(i, _INDEX_ITEMS) for i in index):
        return True
    return isinstance(index, tuple | list) and any(isinstance(i, list) for i in index)


_INDEX_ITEMS = (torch.Tensor, slice, type(None), type(Ellipsis), list, tuple)
