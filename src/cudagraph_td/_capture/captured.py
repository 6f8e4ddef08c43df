"""A captured call: what both kinds have in common, and its checked replay.

A capture (`_capture.graph.capture`) builds a captured call complete: a plain graph
(`_capture.graph.GraphCall`) or a forward and backward pair in one autograd node
(`_capture.autograd.DifferentiableCall`). ``Captured`` is their base: what a graph's entry
(`_capture.entry`) and the graphs of several shapes (`_shapes`) read, and the launch of a
graph that writes into inputs or returns some, written once; ``call`` is the slow path's
replay of one: the full check, which raises the error naming the leaf, then the launch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import foreach_copy_
from .._state.state import State
from .._values.aliasing import WrittenInputs
from .._values.borrowed import end_loan
from .._values.input_views import InputViews, into_callers
from .._values.outputs import Outputs
from .._values.signature import Signature
from .._values.tree import Call

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def copy_inputs(
    static: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], lent: bool
) -> None:
    """Copy a call's input tensors (checked) into a graph's static inputs: the one copy of
    every launch. None where the caller filled the static inputs themselves (``lent``: they
    were handed out by ``input_buffers``) and passes them."""
    if tensors and not (lent and all(map(operator.is_, tensors, static))):
        foreach_copy_(static, tensors)  # type: ignore[arg-type]  # one call for every tensor


OneTensorLaunch = tuple[list[torch.Tensor], Callable[[], None], Callable[[], torch.Tensor]]
"""The parts of the launch of a plain graph with one tensor in and one out and nothing else to
do (the replay path of the commonest graph, a policy): its static input (a list of one), its
replay, and its output (a copy, the tensor's own ``clone``, no Python frame; or a lent
tensor). ``launch_one`` launches them."""


def launch_one(parts: OneTensorLaunch, tensor: Any) -> Any:
    """Launch a graph's `OneTensorLaunch` on ``tensor`` (a tensor, checked): ``copy_inputs``
    for one tensor beside the replay, in one call. One function for every graph, given the
    parts, which its caller holds: not a closure per graph, which a replay would read besides
    the parts (a function, its cells and their tuple). A GPU host's driver leaves the caches
    cold between two launches, so each object read costs: with exact shapes (a graph per
    batch size, calls in turn), a closure per graph cost 0.6 to 0.9 µs a call more than its
    parts on an H200 (`benchmarks/graft.py`; docs/runs/2026-11-29-one-entry-redesign.md)."""
    static, replay, output = parts
    # Copied in unless it is the static input (see `copy_inputs`: only `input_buffers` hands
    # it out), replayed, its output returned.
    if tensor is not static[0]:
        foreach_copy_(static, (tensor,))  # faster than `copy_`
    replay()
    return output()


class Captured:
    """A captured call, built complete at capture: what every entry reads of it (its
    signature: the static inputs, the full check and its errors; its outputs: their
    structure and static tensors; the state it reads, see `_state.state`; whether it is a
    training step, which cannot be verified), the inputs that its graph writes in place or
    returns, and the launch of a graph that writes or returns some (``_launch_writing``,
    around the subclass's ``launch``). Its two kinds: a plain graph
    (`_capture.graph.GraphCall`), and a forward and backward pair in one autograd node
    (`_capture.autograd.DifferentiableCall`)."""

    training_step = False
    # Whether the caller was given the static inputs to fill (see `input_buffers`): a
    # launch then copies no input that is its static input.
    inputs_lent = False
    # Set by a plain one-tensor graph (see `GraphCall`).
    one_tensor_launch: OneTensorLaunch | None = None
    # Where the graph's launch gives more outputs than the computed ones (an autograd node
    # gives all of them): the indices of those that are not inputs or views of inputs.
    _computed: list[int] | None = None
    # Each kind's own: replay on checked ``tensors``, return the output tensors in fresh
    # memory. A graph that writes into inputs or returns some launches through
    # ``_launch_writing``, which calls it again with ``checked`` set.
    launch: Callable[..., Sequence[torch.Tensor]]

    def __init__(
        self,
        signature: Signature,
        outputs: Outputs,
        state: State | None,
        mutated: list[int],
        views: InputViews | None,
    ):
        self.signature = signature
        self.outputs = outputs
        self.state = state
        # The inputs that the graph writes in place, copied back to the caller's tensors;
        # a call where another input shares their memory is refused (see `_values.aliasing`).
        self._writes = WrittenInputs(signature, mutated)
        self._copy_back = self._writes.copy_back
        # Outputs that are inputs or views of them, taken from the caller's tensors (see
        # `_values.input_views`).
        self.input_views = views
        self._touches_inputs = bool(mutated) or views is not None

    def end_loans(self) -> None:
        """The graph goes (a reset, a new capture, its wrapper deleted): what its last replay
        lent (``outputs="borrowed"``) made unreadable now, whatever still holds the graph.
        Its lease would do it when collected, which a reference elsewhere can put off."""
        end_loan(self.outputs.copies)

    def _launch_writing(
        self, tensors: Sequence[torch.Tensor], ungraded: tuple[str, ...] = ()
    ) -> Sequence[torch.Tensor]:
        """``launch`` for a graph that writes into inputs, or returns some: refused, before
        anything is copied, if another input shares the memory of one it writes, or if one
        that it returns a view of is laid out otherwise; the new values of those it writes
        reach the caller, and those it returns are the caller's, as in eager mode."""
        views = self.input_views
        self._writes.check(tensors)
        if views is not None:
            views.check(tensors)
        # After the checks: a training step's watch gives gradients set to `None` back, zeroed.
        outputs = self.launch(tensors, ungraded, checked=True)
        if self._writes.indices:
            self._copy_back(tensors)
        if views is None:
            return outputs
        if self._computed is not None:
            outputs = [outputs[j] for j in self._computed]
        return views.result(outputs, tensors)


def replay_checked(captured: Captured, call: Call) -> Any:
    """The slow path's replay: the full check (which raises the error naming the leaf), then
    the launch; the result in the structure the function returned."""
    tensors = captured.signature.match(call)
    # A TensorDict argument returned: the caller's, its written entries set (see `IntoCallers`).
    outputs = captured.outputs.rebuild(captured.launch(tensors))
    return into_callers(call.args, call.kwargs, outputs)
