"""Copies of a wrapper: ``copy.copy``, ``copy.deepcopy`` and pickling (``torch.save``).

A copy is a new, uncaptured wrapper, made with the wrapper's options, of what the wrapper
wraps: the same function or module (``copy.copy``), a deep copy of it (``copy.deepcopy``, as
deep-copying a module gives a new module), or the one pickling restores. Graphs, pools, locks
and streams are never copied: the copy warms up and captures graphs of its own.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from .._capture.sharing import REPLAY_LOCK
from .._errors import copies as _errors
from .._state.search import find_state


def shallow(wrapper: Any, module: Any, options: dict[str, Any]) -> Any:
    """``copy.copy(wrapper)``: a new wrapper of the same function or module."""
    new = object.__new__(type(wrapper))  # made at its first use (see `restore`)
    restore(new, {"module": module, "options": options})
    return new


def deep(
    wrapper: Any, name: str, module: Any, options: dict[str, Any], memo: dict[int, Any]
) -> Any:
    """``copy.deepcopy(wrapper)``: a new wrapper of a deep copy of its function or module
    (``module``), made with ``options``.

    Raises:
        TypeError: The function reaches modules or optimizers, which its copy (the function
            itself: Python does not copy functions) would share.
    """
    new = object.__new__(type(wrapper))  # made at its first use (see `restore`)
    memo[id(wrapper)] = new  # an object that the function reaches may hold the wrapper
    copied = copy.deepcopy(module, memo)
    if copied is module:
        shared = _state_paths(module)
        if shared:
            raise _errors.deepcopy_shares_state(name, module, shared)
    restore(new, {"module": copied, "options": copy.deepcopy(options, memo)})
    return new


def _state_paths(fn: Any) -> list[str]:
    """The modules and optimizers that ``fn`` reaches, by path (not their submodules)."""
    optimizers, modules = find_state(fn)
    paths = sorted({*modules, *optimizers})
    return [p for p in paths if not any(p.startswith(f"{q}.") for q in paths)]


def state(name: str, module: Any, options: dict[str, Any], cls: type) -> dict[str, Any]:
    """What pickling keeps of a wrapper (of class ``cls``): its function or module, and its
    options, without a memory pool (a pool belongs to the process that made it).

    Raises:
        TypeError: The function or module cannot be pickled (a local function, a lambda).
    """
    # A clear error before pickling starts: Python's own (``Can't pickle local object``)
    # would not say what to save instead.
    try:
        _DryRun(cls).dump(module)
    except Exception as error:
        raise _errors.cannot_pickle(name, module, error) from error
    return {"module": module, "options": {**options, "pool": None}}


def restore(wrapper: Any, state: Mapping[str, Any]) -> None:
    """Make ``wrapper`` (new, not initialised) the wrapper that ``state`` describes, at its
    first use (see `initialise`).

    Not at once: when an object that the wrapped function reaches holds the wrapper (an agent
    whose ``self.act = CudaGraphModule(self.explore)``), ``copy.deepcopy`` and unpickling of
    that object make the wrapper before they fill the object, which the wrapper's constructor
    reads (its modules, its training mode).
    """
    wrapper.__dict__["_pending"] = (state["module"], dict(state["options"]))


def initialise(wrapper: Any, name: str) -> Any:
    """The attribute ``name`` of a wrapper, made first if it is a copy not made yet (from
    ``__getattr__``: once a wrapper is made, its attributes are found without it)."""
    with REPLAY_LOCK:  # two threads that use a new copy at once make it once
        pending = wrapper.__dict__.pop("_pending", None)
        if pending is not None:
            module, options = pending
            try:
                wrapper.__init__(module, **options)
            except BaseException:  # an error of its options: raised again at each use
                wrapper.__dict__["_pending"] = pending
                raise
    return object.__getattribute__(wrapper, name)


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


class _DryRun(pickle.Pickler):
    """A pickler that writes nothing and skips tensors (and other wrappers, which check
    themselves): whether pickling an object can succeed, at the cost of its Python objects."""

    def __init__(self, skip: type):
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self._skip = skip

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage, self._skip)):
            return id(obj)
        return None
