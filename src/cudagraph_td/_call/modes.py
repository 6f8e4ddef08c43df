"""The mode of a call: what changes what the function computes, and so needs graphs of its own.

tensordict's interaction type (a stochastic policy captured while sampling must not replay its
samples when called for its mode), grad mode (a graph captured for autograd under grad mode, a
plain one under no_grad), a module's training mode (dropout), and the autocast state (None when
autocast is off everywhere, else each device type's ``(enabled, dtype)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from .._compat import any_autocast_enabled, interaction_type, td_batch_size

Mode = tuple[Any, bool, Any, Any]

_AUTOCAST_DEVICES = ("cuda", "cpu")


def _autocast_state() -> Any:
    """The autocast part of a mode where autocast is on somewhere: each device type's."""
    return tuple(
        (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
    )


def mode_reader(module: Any) -> Callable[[], Mode]:
    """A function that reads the mode of a call of ``module`` now, its reads bound once: the
    graph table calls it at every call (see `_call.table`)."""
    return mode_lookup(module, {})[0]


def mode_lookup(
    module: Any, table: dict[Any, Any], by_shapes: bool = False
) -> tuple[Callable[[], Mode], Callable[[tuple[Any, ...], dict[str, Any]], Any]]:
    """The read of the mode of a call of ``module`` now, and a lookup of ``table`` as one
    function of a call: the graph table's ``find`` where a call's key is read without its
    static arguments (there are none), two calls fewer on the replay path than the read, the
    key and a lookup. ``table`` is keyed by the mode alone (one graph per mode), or with
    ``by_shapes`` by a `GraphKey` of the mode and the call's shapes (``shapes="exact"`` and
    ``"buckets"``, as `_call.table.GraphTable.key` makes it). Both read the mode with the
    same expression, and the same shapes as the table (a TensorDict's batch size read as
    stored, not through its properties: the object they return; `tests/test_modes.py`
    checks that they agree in every mode, `tests/test_table.py` on calls of every form)."""
    # The reads bound to the closures' own names: one lookup each at a call, not a global's
    # and a module attribute's. The autocast part is None when autocast is off everywhere.
    interaction, grad = interaction_type, torch.is_grad_enabled
    on, cast, get = any_autocast_enabled, _autocast_state, table.get
    plain, batch_size = TensorDict, td_batch_size

    def read() -> Mode:
        return (interaction(), grad(), getattr(module, "training", None), cast() if on() else None)

    def find(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode = (interaction(), grad(), getattr(module, "training", None), cast() if on() else None)
        return get(mode, ())

    def find_by_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode = (interaction(), grad(), getattr(module, "training", None), cast() if on() else None)
        # The shapes of its arguments, by position then by keyword (None for one without); a
        # TensorDict's read as stored, not through its properties' two Python frames.
        listed = [batch_size(a) if type(a) is plain else getattr(a, "shape", None) for a in args]
        if kwargs:
            listed.extend((name, getattr(v, "shape", None)) for name, v in kwargs.items())
        try:
            return get((mode, None, (), tuple(listed)), ())
        except TypeError:  # a shape that does not hash: a key never seen
            return ()

    return read, find_by_shapes if by_shapes else find


def current_mode(module: Any) -> Mode:
    """The mode of a call of ``module`` now."""
    return mode_reader(module)()


def mode_name(mode: Mode, device: Any = None) -> str:
    """A mode as ``repr`` and ``graphs()`` show it, e.g. ``no_grad, eval``; with ``device``
    (for a wrapper with graphs on several), e.g. ``no_grad, eval, cuda:1``."""
    interaction, grad, training, autocast = mode
    parts = ["grad" if grad else "no_grad"]
    if training is not None:
        parts.append("train" if training else "eval")
    if interaction is not None:
        parts.append(f"interaction {interaction}")
    if autocast is not None:
        enabled = [
            f"{device} {str(dtype).removeprefix('torch.')}"
            for device, (on, dtype) in zip(_AUTOCAST_DEVICES, autocast, strict=True)
            if on
        ]
        parts.append(f"autocast {', '.join(enabled)}")
    if device is not None:
        parts.append(str(device))
    return ", ".join(parts)
