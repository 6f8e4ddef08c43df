"""Every private torch and tensordict API the library uses, in one place.

Each entry says why the public API does not do, and the versions it was checked against;
``tests/test_compat.py`` fails when one of them changes behaviour (or, for a function the
library bypasses, grows code). Checked with torch 2.11 and 2.13, tensordict 0.15.3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import probabilistic

# `torch._foreach_copy_(dst, src)`: one multi-tensor copy, issued faster than a `copy_` per
# tensor, even for one tensor. The replay's input copy and the packed outputs use it.
foreach_copy_ = torch._foreach_copy_

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
    (torch 2.11): the replay path calls the C++ method of ``torch._C._CUDAGraph`` directly. Any other graph (the emulation's, a
    graph with a tracker) replays through its own ``replay``.
    """
    if isinstance(graph, torch.cuda.CUDAGraph) and getattr(graph, "_tracker", None) is None:
        return super(torch.cuda.CUDAGraph, graph).replay
    return graph.replay  # type: ignore[no-any-return]


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-stream workspaces, as torch's CUDA graph trees do around a recording.

    ``torch._C._cuda_clearCublasWorkspaces``: no public function does this.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def distributions_validate_args() -> bool:
    """Whether ``torch.distributions`` validates arguments by default.

    Its setter, ``Distribution.set_default_validate_args``, is public; the value it sets is
    the class attribute ``_validate_args``.
    """
    return bool(torch.distributions.Distribution._validate_args)


def td_entries(td: TensorDict) -> dict[str, Any]:
    """The entries of a ``TensorDict`` by key, as it stores them (nested TensorDicts as such).

    ``TensorDict._tensordict``: reading it avoids a copy of the dict per call.
    """
    return td._tensordict


def td_get(td: Any, key: Any) -> Any:
    """The entry of a TensorDict at a string key, ``NonTensorData`` still wrapped (``_get_str``)."""
    return td._get_str(key, None)


def td_has_names(td: Any) -> bool:
    """Whether a TensorDict has dimension names (``_has_names``, which does not build them)."""
    return bool(td._has_names())


def td_new(cls: type, entries: dict[str, Any], batch_size: Any, device: Any, names: Any) -> Any:
    """A tensor collection of type ``cls`` around ``entries``, without checking them.

    ``TensorDictBase._new_unsafe``: the entries come from a TensorDict of this layout, so the
    checks of the public constructor (shapes against the batch size) would only cost time.
    """
    return cls._new_unsafe(  # type: ignore[attr-defined]
        source=entries, batch_size=batch_size, device=device, names=names
    )


def tensorclass_parts(tc: Any) -> tuple[Any, dict[str, Any]]:
    """A tensorclass instance's TensorDict of tensor fields, and its other fields."""
    return tc._tensordict, tc._non_tensordict


def tensorclass_new(cls: type, td: TensorDict, others: dict[str, Any]) -> Any:
    """A tensorclass instance from its TensorDict and other fields (``_from_tensordict``)."""
    return cls._from_tensordict(td, non_tensordict=others)  # type: ignore[attr-defined]
