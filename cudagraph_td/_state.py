"""The state around a graph: the parameters, buffers and optimizer state that it reads.

A graph reads more than its inputs: the parameters and buffers of the modules its function
uses and, for a training step, its optimizers' state, each at the address it had at
capture. Updated in place (an optimizer step, ``load_state_dict``, ``copy_``), they flow
through the graph. Replaced (an attribute rebound, ``load_state_dict(assign=True)``,
``param.data = ...``, ``module.to(...)``, ``optimizer.load_state_dict(...)``), the graph
would keep reading the old memory. :class:`State` holds where each piece was found and what
it was at capture; its ``fresh()`` tells, before each replay, whether all of it is still
there. When not, the graph is captured again, with a :class:`RecaptureWarning`.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from operator import getitem, is_
from typing import Any

import tensordict
import torch
from torch import nn

from . import _errors_state

# Where a piece of state is bound: its path (for messages), the dict that holds it, its key
# there, and what the key held at capture. The dict is a module's `_parameters` or
# `_buffers`, an optimizer's `__dict__` (for its `state` and `param_groups`), or a dict of
# its own for a tensor that nothing else binds (its address is still followed).
Entry = tuple[str, Mapping[Any, Any], Any, Any]

_data_ptr = torch.Tensor.data_ptr


class RecaptureWarning(UserWarning):
    """A graph was captured again: state that it reads was replaced after its capture.

    Turned into an error (``warnings.simplefilter("error", RecaptureWarning)``), it refuses
    the call instead, and leaves the graph as it was: no call returns a stale result.
    """


RecaptureWarning.__module__ = "cudagraph_td"  # where users import it from


def module_entries(path: str, module: nn.Module) -> Iterator[Entry]:
    """The parameters and buffers of ``module`` and its submodules, where each is bound."""
    for name, sub in module.named_modules():
        parts = [f"[{part}]" if part.isdigit() else f".{part}" for part in name.split(".") if part]
        where = path + "".join(parts)
        for holder in (sub._parameters, sub._buffers):
            for key, value in holder.items():
                if value is not None:
                    yield f"{where}.{key}", holder, key, value


def optimizer_entries(path: str, optimizer: torch.optim.Optimizer) -> Iterator[Entry]:
    """An optimizer's ``state`` and ``param_groups`` (``load_state_dict`` replaces both), and
    the tensors it steps, each in a dict of its own: their addresses are followed."""
    for key in ("state", "param_groups"):
        yield f"{path}.{key}", optimizer.__dict__, key, optimizer.__dict__[key]
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            yield f"{path}.param_groups[{i}]['params'][{j}]", {0: p}, 0, p


def rebound(entries: list[Entry]) -> list[Entry]:
    """The ``entries`` whose dict holds another object than when they were listed."""
    return [entry for entry in entries if entry[1].get(entry[2]) is not entry[3]]


class State:
    """The state a captured graph reads besides its inputs, and whether it is still there.

    Tensors are followed by address (the ``data_ptr`` of what their dict holds now) and, for
    a graph that hands them to autograd or steps them (``identity``), by identity too; an
    optimizer's ``state`` and ``param_groups`` by identity.
    """

    def __init__(self, entries: list[Entry], *, identity: bool):
        unique: dict[tuple[int, Any], Entry] = {}
        for entry in entries:  # a tensor bound twice (shared weights) is followed once
            unique.setdefault((id(entry[1]), entry[2]), entry)
        self.identity = identity
        self.entries = [(*entry, _address(entry[3])) for entry in unique.values()]
        tensors = [e for e in self.entries if e[4] is not None]
        objects = [e for e in self.entries if e[4] is None or identity]
        self.fresh: Callable[[], bool] = _fresh_check(
            [e[1] for e in tensors],
            [e[2] for e in tensors],
            [e[4] for e in tensors],
            [e[1] for e in objects],
            [e[2] for e in objects],
            [e[3] for e in objects],
        )

    def changes(self) -> list[str]:
        """The paths of the state replaced since the capture (none while ``fresh()``)."""
        changed = []
        for path, holder, key, value, address in self.entries:
            now = holder.get(key)
            if ((address is None or self.identity) and now is not value) or (
                address is not None and _address(now) != address
            ):
                changed.append(path)
        return changed

    def recapture(self, name: str) -> None:
        """Warn that the graph of ``name`` is captured again, naming the state replaced."""
        warnings.warn(
            _errors_state.recaptured(name, self.changes()),
            RecaptureWarning,
            stacklevel=_caller_level(),
        )


def _address(value: Any) -> int | None:
    return _data_ptr(value) if isinstance(value, torch.Tensor) else None


def _fresh_check(
    holders: list[Mapping[Any, Any]],
    keys: list[Any],
    addresses: list[int | None],
    object_holders: list[Mapping[Any, Any]],
    object_keys: list[Any],
    objects: list[Any],
) -> Callable[[], bool]:
    """``State.fresh``: a closure over flat lists (no reference to the State, so no cycle),
    whose checks are mapped in C, without a Python loop per tensor."""
    if not objects:

        def fresh() -> bool:
            try:
                return [*map(_data_ptr, map(getitem, holders, keys))] == addresses
            except (KeyError, TypeError):  # an entry deleted, or set to None
                return False

        return fresh

    def fresh_and_same() -> bool:
        try:
            return [*map(_data_ptr, map(getitem, holders, keys))] == addresses and all(
                map(is_, map(getitem, object_holders, object_keys), objects)
            )
        except (KeyError, TypeError):
            return False

    return fresh_and_same


# The packages whose frames stand between the user's call and a warning.
_PACKAGES = (os.path.dirname(__file__), os.path.dirname(tensordict.__file__))


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this package and tensordict's (whose
    ``dispatch`` calls it for a TensorDict module): a warning then points at the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGES):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level
