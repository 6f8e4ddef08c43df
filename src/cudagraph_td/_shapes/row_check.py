"""Padding checked, not assumed: whether a function's rows are independent of each other.

``shapes="buckets"`` answers a call of ``n`` rows with a graph of ``b > n`` rows: its output
rows ``:n`` are right only if each depends on its own input row alone. A mean, a softmax or a
normalisation over the batch, or a module that updates state from the batch (a
``BatchNorm``'s running statistics in training mode), gives silently wrong rows, or moves
state with the padding. So, the first time a bucket pads a call (unless the user declared
``Buckets(row_independent=True)``), `check_rows` runs the function eagerly on that call
padded to the bucket three times, each from the same random state: with the call's first
row repeated in the padded rows (the padding of a padded call), then with values beyond
every value of the call there, above all of them, then below all of them. The real rows of
the three results must agree; the state the function reaches must not move (else it is put
back).

A replay's padded rows hold the rows of earlier calls, whatever they were: the check cannot
validate those values one by one, so it makes the padding as unlike the real rows as a
padding can be. A reduction over the batch (a max, a min, a sort, a median, a norm, a
softmax, a mean) then sees a padded row above or below every real one, and changes, whatever
the values drawn: never a check that passes because the data happened to hide the padding.
Slow path only, once per bucket: three eager calls and a comparison on the host; the replay
path pays nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .._errors import shapes as _errors_shapes
from .._state.search import find_state
from .._state.state import modules_followed
from .._values import tree as _tree
from .._values.tree import Call
from . import padding as _padding

# How close the real rows of the two runs must be: the same kernels on the same shapes give
# the same bits, up to the order of atomic additions in a few of them.
_RTOL, _ATOL = 1e-4, 1e-5


def check_rows(
    name: str,
    fn: Callable[..., Any],
    call: Call,
    size: tuple[int, ...],
    batch: tuple[int, ...],
) -> None:
    """Raise if ``fn``'s output rows ``batch`` depend on the rows padded up to ``size``, or
    if it updates the state it reaches in place (that state is restored first).

    The caller holds the capture turn (`_capture.graph.capture_turn`): the function runs only
    under it.

    Raises:
        RuntimeError: The rows depend on each other, or the function updates module state.
    """
    padded = _padding.resize(call, size)
    probes = [_beyond(padded, batch, above) for above in (True, False)]
    if probes[0] is None:  # no input whose padded rows could differ
        return
    state = StateSnapshot(fn)
    # Each run from the caller's random state, which is put back after it: the runs draw
    # the same numbers, and the check none of the caller's.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    results = []
    try:
        with torch.no_grad():
            with torch.random.fork_rng(devices):
                results.append(fn(*padded[0], **padded[1]))
            for probe in probes:
                # Values that it refuses in the padded rows: that run is not compared.
                with torch.random.fork_rng(devices), contextlib.suppress(Exception):
                    results.append(fn(*probe[0], **probe[1]))  # type: ignore[index]
    finally:
        written = state.restore_written()
    if written:
        raise _errors_shapes.padding_moves_state(name, written)
    ours = _tree.leaves_with_paths(_padding.rows(name, results[0], size, batch), root="output")
    for result in results[1:]:
        theirs = _tree.leaves_with_paths(_padding.rows(name, result, size, batch), root="output")
        for (path, a), (_, b) in zip(ours, theirs, strict=True):
            if isinstance(a, torch.Tensor) and not _close(a, b):
                raise _errors_shapes.rows_depend_on_padding(name, path, batch, size)


def _beyond(padded: tuple[Any, Any], batch: tuple[int, ...], above: bool) -> tuple[Any, Any] | None:
    """``padded`` with each floating-point tensor's padded rows set ``above`` (else below)
    every value of the tensor; None if it has no floating-point tensor. (Integer and bool
    tensors keep their rows: indices, actions and masks, which other values would make
    invalid.)"""
    leaves, spec = _tree.flatten(padded)
    changed = False
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            continue
        value = _beyond_value(leaf, above)
        leaf = leaves[i] = leaf.clone()
        for dim, n in enumerate(batch):  # rows n: of a dim not padded, none
            leaf[(slice(None),) * dim + (slice(n, None),)] = value
        changed = True
    return _tree.unflatten(spec, leaves) if changed else None


def _beyond_value(t: torch.Tensor, above: bool) -> float:
    """A value above (or below) every value of the floating-point ``t``: far beyond, so
    that a padded row dominates any reduction that it takes part in, yet finite."""
    finite = t.detach().float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    magnitude = 4.0 * float(finite.abs().max()) + 4.0 if t.numel() else 4.0
    magnitude = min(magnitude, float(torch.finfo(t.dtype).max) / 4)
    return magnitude if above else -magnitude


def _close(a: torch.Tensor, b: Any) -> bool:
    if not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=_RTOL, atol=_ATOL, equal_nan=True))


class StateSnapshot:
    """The tensors of the modules that a function reaches (parameters, buffers, tensor
    attributes), copied, to find and undo the in-place updates of an eager check run (this
    module's, and ``verify=``'s, see `_call.verify`)."""

    def __init__(self, fn: Callable[..., Any]):
        _, modules = find_state(fn)
        seen: set[int] = set()
        self.tensors: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for where, _, _, value in modules_followed(modules):
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                self.tensors.append((where, value, value.detach().clone()))

    def restore_written(self) -> list[str]:
        """Put back the tensors that moved; their paths. Compared by value: a kernel that
        updates a tensor in place need not move its version counter (``batch_norm``'s
        running statistics do not)."""
        written = []
        for path, tensor, copy in self.tensors:
            if not torch.equal(tensor, copy):
                written.append(path)
                with torch.inference_mode() if tensor.is_inference() else torch.no_grad():
                    tensor.copy_(copy)
        return written
