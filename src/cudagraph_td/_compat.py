"""Every private torch and tensordict API the library uses, in one place.

Each entry says why the public API does not do, and the versions it was checked against;
``tests/test_compat.py`` fails when one of them changes behaviour (or, for a function the
library bypasses, grows code). Checked with torch 2.11 and 2.13, tensordict 0.14.3 and 0.15.3.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import probabilistic

# The CPU emulation's recorder (`_recording`), checked with torch 2.11 and 2.13:
# `TorchDispatchMode`, the base class of a mode that sees every ATen operation (with its
# tensors) below autograd; `_AutoDispatchBelowAutograd`, which runs operations below autograd
# (a replay of recorded operations, as a CUDA graph's replay runs kernels); an operation's
# schema (`OpOverload._schema`), whose arguments' alias information marks the ones it writes;
# the function mode stack (see `default_device_set`).
from torch.overrides import _get_current_function_mode_stack as _function_modes
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode

below_autograd: Callable[[], Any] = torch._C._AutoDispatchBelowAutograd

# Whether autocast is on for any device type (`torch.is_autocast_enabled()` asks of one):
# read at every call of a wrapper, for the autocast part of its mode.
any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled

# Grad mode and inference mode set by the emulation's replay for each run of operations
# recorded under one mode: `torch._C._set_grad_enabled` and the `torch._C._InferenceMode`
# context, which `torch.set_grad_enabled` and `torch.inference_mode` wrap in Python frames.
set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled
inference_mode_state: Callable[[bool], Any] = torch._C._InferenceMode


def op_arguments(func: Any) -> Any:
    """The schema arguments of an ATen operation (``OpOverload._schema.arguments``)."""
    return func._schema.arguments


def default_device_set() -> bool:
    """Whether this thread has a default device for factories (``torch.set_default_device``,
    ``with torch.device(...)``): both push a ``torch.utils._device.DeviceContext`` on torch's
    function mode stack (``torch.overrides._get_current_function_mode_stack``), which no
    public API lists; ``torch.get_default_device()`` cannot tell a chosen CPU from none."""
    return any(isinstance(mode, DeviceContext) for mode in _function_modes())


# `torch._foreach_copy_(dst, src)`: one multi-tensor copy, issued faster than a `copy_` per
# tensor, even for one tensor. The replay's input copy and the packed outputs use it.
foreach_copy_ = torch._foreach_copy_

# A tensor's version counter (`Tensor._version`), which every in-place operation moves: how
# a capture tells the inputs and parameters that the function wrote.
version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")

# `Tensor.as_strided`, unbound: a view at a given offset, the cheapest view to make.
as_strided = torch.Tensor.as_strided

# tensordict's `interaction_type()` returns its mode holder's `get_mode()`: calling that
# directly saves a Python call at every replay. The public function where it is missing.
_holder = getattr(probabilistic, "_interaction_type", None)
interaction_type: Callable[[], Any] = getattr(_holder, "get_mode", probabilistic.interaction_type)


def graph_replay(graph: Any) -> Callable[[], None]:
    """``graph.replay``, without the Python frame that ``torch.cuda.CUDAGraph.replay`` adds.

    That frame only checks an input-liveness tracker (torch 2.13), which ``capture_begin(
    check_input_liveness=True)`` turns on and the library never does, or does nothing more
    (torch 2.11): the replay path calls the C++ method of ``torch._C._CUDAGraph`` directly.
    Any other graph (the emulation's, a graph with a tracker) replays through its own
    ``replay``.
    """
    if isinstance(graph, torch.cuda.CUDAGraph) and getattr(graph, "_tracker", None) is None:
        return super(torch.cuda.CUDAGraph, graph).replay
    return graph.replay  # type: ignore[no-any-return]


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-stream workspaces, as torch's CUDA graph trees do around a recording.

    ``torch._C._cuda_clearCublasWorkspaces``: no public function does this, nor frees the
    workspaces of one stream alone (torch 2.11 and 2.13).
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def pool_blocks(device: torch.device, pool: Any) -> frozenset[int]:
    """The addresses of the allocated blocks of the graph memory pool ``pool`` on ``device``.

    From ``torch.cuda.memory_snapshot`` (public), whose ``mempool_id`` argument (torch 2.11
    and 2.13) limits it to the pool's segments; filtered here too, in case a version lists
    every segment. Each segment names its pool (``segment_pool_id``), each block its state.
    """
    segments = torch.cuda.memory_snapshot(mempool_id=pool, include_traces=False)
    return frozenset(
        block["address"]
        for segment in segments
        if segment["device"] == device.index and tuple(segment["segment_pool_id"]) == tuple(pool)
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )


raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
"""The handle of a device's current stream as an int (CUDA builds of torch 2.11 and 2.13):
``torch.cuda.current_stream(device).cuda_stream`` builds a ``Stream`` object first, which the
replay path, comparing it at each call, does without."""


def end_allocate_to_pool(device: torch.device, pool: Any) -> None:
    """Stop routing the allocations of a failed capture's stream to its pool.

    ``CUDAGraph.capture_end`` does this after ending the capture; when ending it fails (the
    function broke the capture), torch raises first and the allocator keeps routing that
    stream's allocations into the pool, and refuses the next capture into it.
    ``torch._C._cuda_endAllocateToPool`` (torch 2.11 and 2.13): no public function does it.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        end(device.index, pool)


def distributions_validate_args() -> bool:
    """Whether ``torch.distributions`` validates arguments by default.

    Its setter, ``Distribution.set_default_validate_args``, is public; the value it sets is
    the class attribute ``_validate_args``.
    """
    return bool(torch.distributions.Distribution._validate_args)


# The entries of a `TensorDict` by key, as it stores them (nested TensorDicts as such):
# `TensorDict._tensordict`, which avoids a copy of the dict per call. The replay path reads
# it at every call: a C accessor, without a Python frame.
td_entries: Callable[[TensorDict], dict[str, Any]] = operator.attrgetter("_tensordict")

# Whether a TensorDict has dimension names, without building them (`_has_names()`).
td_has_names: Callable[[Any], bool] = operator.methodcaller("_has_names")

# `TensorDictBase._new_unsafe` of a class: a tensor collection around entries, without
# the public constructor's checks (the entries come from a TensorDict of this layout).
td_new_unsafe: Callable[[type], Callable[..., Any]] = operator.attrgetter("_new_unsafe")


def td_get(td: Any, key: Any) -> Any:
    """The entry of a TensorDict at a string key, ``NonTensorData`` still wrapped (``_get_str``)."""
    return td._get_str(key, None)


def tensorclass_parts(tc: Any) -> tuple[Any, dict[str, Any]]:
    """A tensorclass instance's TensorDict of tensor fields, and its other fields."""
    return tc._tensordict, tc._non_tensordict


def tensorclass_new(cls: type, td: TensorDict, others: dict[str, Any]) -> Any:
    """A tensorclass instance from its TensorDict and other fields (``_from_tensordict``)."""
    return cls._from_tensordict(td, non_tensordict=others)  # type: ignore[attr-defined]


_HOOK_KINDS = ("forward pre", "forward", "backward pre", "backward")


def module_hooks(module: torch.nn.Module) -> list[str]:
    """The kinds of hooks registered on ``module`` itself ("forward pre", "forward", ...).

    ``nn.Module._forward_pre_hooks`` and the like: no public API lists them.
    """
    return [
        kind for kind in _HOOK_KINDS if getattr(module, f"_{kind.replace(' ', '_')}_hooks", None)
    ]


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """Let optimizers built with ``capturable=True`` step on CPU parameters (experimental).

    A captured training step needs a capturable optimizer, which torch refuses for CPU
    parameters. The CPU emulation (``backend="emulate"``) lifts that refusal inside its own
    calls; code that runs the same optimizer eagerly on the CPU (an eager twin in a test)
    runs it inside this context.

    Examples:
        >>> import torch
        >>> from cudagraph_td import capturable_on_cpu
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> opt = torch.optim.Adam([w], lr=torch.tensor(0.1), capturable=True)
        >>> w.grad = torch.ones(3)
        >>> with capturable_on_cpu():
        ...     opt.step()
        >>> w.detach()
        tensor([0.9000, 0.9000, 0.9000])

    torch refuses ``capturable=True`` for CPU parameters through
    ``torch.optim.optimizer._get_capturable_supported_devices``, which each optimizer module
    imports by name (checked with torch 2.11 and 2.13); its capturable code paths are tensor
    operations that run on the CPU as they are.
    """
    with _CAPTURABLE_LOCK:
        if _capturable_entries[0] == 0:
            _allow_cpu_captures()
        _capturable_entries[0] += 1
    _capturable_here.depth = getattr(_capturable_here, "depth", 0) + 1
    try:
        yield
    finally:
        _capturable_here.depth -= 1
        with _CAPTURABLE_LOCK:  # the last one out restores torch's (threads may overlap)
            _capturable_entries[0] -= 1
            if _capturable_entries[0] == 0:
                _allow_cpu_captures(undo=True)


_CAPTURABLE_LOCK = threading.Lock()
_capturable_entries = [0]  # how many `capturable_on_cpu` contexts are open, in any thread
# How many this thread has open: the patched function answers as torch's on other threads.
_capturable_here = threading.local()
_patched: list[tuple[Any, Any]] = []  # (optimizer module, torch's function) while open


def _allow_cpu_captures(undo: bool = False) -> None:
    if undo:
        for module, original in _patched:
            module._get_capturable_supported_devices = original
        _patched.clear()
        return
    import torch.optim.optimizer as optimizer_module

    original = optimizer_module._get_capturable_supported_devices

    def with_cpu(*args: Any, **kwargs: Any) -> list[str]:
        devices = original(*args, **kwargs)
        return [*devices, "cpu"] if getattr(_capturable_here, "depth", 0) else devices

    for name, module in list(sys.modules.items()):
        if name.startswith("torch.optim") and (
            getattr(module, "_get_capturable_supported_devices", None) is original
        ):
            _patched.append((module, original))
            module._get_capturable_supported_devices = with_cpu  # type: ignore[attr-defined]
