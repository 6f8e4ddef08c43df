"""The autograd core: a forward graph and its backward graph inside one autograd node.

A differentiable call is captured twice: its forward, and the backward of that forward
(``torch.autograd.grad`` of its outputs that require grad with respect to its inputs that
require grad and to the leaves it reads, such as parameters). ``_GraphedFunction``
replays the first in its ``forward`` and the second in its ``backward``, so that autograd
sees one node whose gradients equal the eager ones. Gradients are returned in fresh memory:
two backward passes accumulate as in eager mode.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import foreach_copy_, graph_replay
from .._errors import inputs as _errors
from .._errors import log as _log
from .._state.state import State
from .._values import tree as _tree
from .._values.aliasing import versions, written
from .._values.borrowed import end_loan
from .._values.input_views import InputViews
from .._values.outputs import FreshCopies, Outputs
from .._values.signature import Signature
from . import sharing as _sharing
from .backend import Backend, CudaBackend, Graph
from .captured import Captured, copy_inputs


def _leaves_requiring_grad(
    outputs: Sequence[torch.Tensor], stop: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The leaf tensors that require grad and that ``outputs`` (tensors that require grad)
    depend on, except ``stop``.

    The walk follows the autograd graph from the outputs to its ``AccumulateGrad`` nodes; it
    does not go past the nodes of the tensors in ``stop`` (the call's own inputs).
    """
    stop_ids = {id(t) for t in stop}
    seen: set[Any] = {t.grad_fn for t in stop if t.grad_fn is not None}
    found: dict[int, torch.Tensor] = {}
    # A leaf output is its own node.
    pending: list[Any] = [o if o.grad_fn is None else o.grad_fn for o in outputs]
    while pending:
        node = pending.pop()
        # A leaf: an output that is one, or the variable of an `AccumulateGrad` node.
        leaf = node if isinstance(node, torch.Tensor) else getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in stop_ids:
                found.setdefault(id(leaf), leaf)
        elif node not in seen:
            seen.add(node)
            pending.extend(
                next_node for next_node, _ in node.next_functions if next_node is not None
            )
    return list(found.values())


class _GraphedFunction(torch.autograd.Function):
    """``forward`` replays the forward graph, ``backward`` the backward graph."""

    @staticmethod
    def forward(
        ctx: Any, call: DifferentiableCall, ungraded: tuple[str, ...], *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        copy_inputs(call.static_inputs, inputs[: call.n_inputs], call.inputs_lent)
        if call.order is not None:  # after the device's last replay: they share a workspace
            call.order.keep()
        call.replay_forward()
        call.generation += 1
        ctx.call, ctx.generation, ctx.ungraded = call, call.generation, ungraded
        # Each output cloned (grad mode is off here, and the static outputs are detached: see
        # `Capture.capture_backward`): one output without a generator, for speed. Not views
        # of one buffer: autograd refuses in-place writes into outputs that are views.
        one = call.one_output
        if call.lent_outputs is not None:  # outputs="borrowed"
            outputs: tuple[torch.Tensor, ...] = tuple(call.lent_outputs.make())
        elif one is not None:
            outputs = (one.clone(),)
        else:
            outputs = tuple([t.clone() for t in call.outputs.static])
        # Inputs that require grad where the samples did not (see `DifferentiableCall.ungraded`)
        # may reach any output, as in eager mode: all stay differentiable, as torch's are.
        if call.non_differentiable and not ungraded:
            ctx.mark_non_differentiable(*(outputs[i] for i in call.non_differentiable))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: DifferentiableCall = ctx.call
        call.hint_at = 0  # a backward ran: no hint (see `DifferentiableCall.hint_at`)
        if ctx.ungraded:
            raise _errors.ungraded_backward(call.name, ctx.ungraded)
        if torch.is_grad_enabled():
            raise _errors.double_backward(call.name)
        if ctx.generation != call.generation:
            raise _errors.stale_backward(call.name)
        # Grad mode is off (checked above): the copy needs no `no_grad`. Every output
        # differentiable (decided at capture): the incoming gradients are the list to copy.
        picked = call.picked_grads
        foreach_copy_(
            call.static_grad_outputs, grads if picked is None else [grads[i] for i in picked]
        )
        if call.order is not None:  # the forward's stream, which another may have followed
            call.order.keep()
        call.replay_backward()
        # Fresh memory: gradients accumulated over two backward passes must not alias. Made
        # by one allocation and one multi-tensor copy where they are small (see `FreshCopies`).
        fresh: list[Any] = call.fresh_grads.make()
        fresh.append(None)  # what `grad_result` gives the node's inputs without a gradient
        return call.grad_result(fresh)  # type: ignore[no-any-return]


class DifferentiableCall(Captured):
    """A call captured for autograd: a launch replays the forward inside an autograd node.

    Built by ``capture.capture_backward`` (see `Capture`) from its captured forward and the
    backward graph ``bwd_graph``, which reads the incoming gradients from ``grad_outputs``
    and writes ``grad_inputs`` (one per tensor that the backward differentiates: see
    ``Capture._gradients``; ``None`` if unused).
    """

    def __init__(
        self,
        capture: Capture,
        bwd_graph: Graph,
        grad_outputs: list[torch.Tensor],
        grad_inputs: Sequence[torch.Tensor | None],
        state: State | None,
    ):
        assert capture.outputs is not None and capture.differentiable is not None
        assert capture.fwd_graph is not None and capture.params is not None
        views = capture.views
        super().__init__(capture.signature, capture.outputs, state, capture.mutated, views)
        self.name = capture.name
        self.label = capture.name  # the graph, as log records name it (set by its entry)
        # The device's replay order (see `_capture.sharing`); None off CUDA.
        self.order: _sharing.ReplayOrder | None = None
        if isinstance(capture.backend, CudaBackend):
            self.order = _sharing.replay_order(capture.backend.device.index)
        self.static_inputs = capture.signature.static_inputs
        self.n_inputs = len(self.static_inputs)
        self.params = capture.params
        static_outputs = capture.outputs.static
        # The one output tensor, cloned without a loop; None for any other number.
        self.one_output = static_outputs[0] if len(static_outputs) == 1 else None
        differentiable = capture.differentiable
        self.non_differentiable = [i for i in range(len(static_outputs)) if i not in differentiable]
        # The outputs whose incoming gradients the backward copies, by index; None for all.
        self.picked_grads = differentiable if self.non_differentiable else None
        self.replay_forward = graph_replay(capture.fwd_graph)
        self.replay_backward = graph_replay(bwd_graph)
        self.static_grad_outputs = grad_outputs
        computed_slots = [slot for slot, g in enumerate(grad_inputs) if g is not None]
        computed = [g for g in grad_inputs if g is not None]
        device = computed[0].device if computed else torch.device("cpu")
        # The gradients lent too, under the backward graph's own lease (outputs="borrowed").
        lend_grads = capture.backend.lend_gradients(f"{capture.name}'s backward", self.params)
        self.fresh_grads = (
            FreshCopies(computed, device) if lend_grads is None else lend_grads(computed)
        )
        self.lent_outputs = capture.outputs.copies if capture.outputs.lent is not None else None
        # The backward's result, from the fresh gradients with `None` appended: for each input
        # of the node (the call, `ungraded`, the tensors, the parameters), the index of its
        # fresh gradient, or of that `None`. One `itemgetter` call builds it.
        fresh_index = {slot: k for k, slot in enumerate(computed_slots)}
        none = len(computed_slots)
        surface_slot = {i: slot for slot, i in enumerate(capture.grad_inputs)}
        slots = [surface_slot.get(i, -1) for i in range(self.n_inputs)]
        slots += range(len(capture.grad_inputs), len(grad_inputs))  # the parameters'
        self.grad_result = operator.itemgetter(
            none, none, *(fresh_index.get(slot, none) for slot in slots)
        )
        self.generation = 0  # the number of forwards replayed: a backward must be the last's
        # The forward, counted by `generation`, at which a call in grad mode logs the hint that
        # no backward ran (see `_errors.log.no_backward`); 0 once a backward ran, or the hint
        # was given. Read from the counter that the forward keeps anyway: one comparison.
        self.hint_at = _log.NO_BACKWARD_REPLAYS
        # Held for the life of the call: its graphs, and what the forward saved for the backward.
        self._held = (capture.fwd_graph, bwd_graph, capture.saved)
        # The caller's tensors that the forward writes get their new values outside autograd.
        self._copy_back = torch.no_grad()(self._writes.copy_back)
        # The node gives every output: those that are inputs or views of them (see
        # `_values.input_views`) are dropped, and autograd gives their gradients straight to
        # the inputs (the backward graph gets zeros for them).
        self._computed = views.computed if views is not None else None

    def launch(
        self, tensors: Sequence[torch.Tensor], ungraded: tuple[str, ...] = (), checked: bool = False
    ) -> Sequence[torch.Tensor]:
        """Replay the forward on ``tensors`` (checked) inside the autograd node, whose
        backward refuses to run if ``ungraded`` names inputs (see ``ungraded``)."""
        if self._touches_inputs and not checked:  # decided at capture: the others check nothing
            return self._launch_writing(tensors, ungraded)
        outputs = _GraphedFunction.apply(self, ungraded, *tensors, *self.params)
        if self.generation == self.hint_at:  # the forwards counted, no backward yet
            self._no_backward()
        return outputs  # type: ignore[no-any-return]

    def end_loans(self) -> None:
        """`Captured.end_loans`, and the gradients' lease (``outputs="borrowed"``)."""
        super().end_loans()
        end_loan(self.fresh_grads)

    def _no_backward(self) -> None:
        """The hint, once, that a graph replayed for autograd never ran its backward: in grad
        mode only (a forward under `torch.no_grad()` builds no autograd graph)."""
        if torch.is_grad_enabled():
            self.hint_at = 0
            _log.no_backward(self.label, self.generation)
        else:
            self.hint_at += _log.NO_BACKWARD_REPLAYS  # counted again from there

    def ungraded(self, tensors: Sequence[torch.Tensor]) -> tuple[str, ...]:
        """The paths of ``tensors`` that require grad where the captured inputs did not.

        torch's ``make_graphed_callables`` replays such a call, its outputs attached to its
        autograd node, whose backward gives those inputs no gradient (``None``, or an error
        where no backward graph was captured). The forward replays here too, and the
        backward, which cannot compute their gradients, raises.
        """
        if not torch.is_grad_enabled():  # no autograd node: nothing is differentiated
            return ()
        paths = self.signature.tensor_paths()
        return tuple(
            paths[i]
            for i, (t, static) in enumerate(zip(tensors, self.static_inputs, strict=True))
            if t.requires_grad and not static.requires_grad
        )


class Capture:
    """Captures one callable for autograd: warm-up, then its forward, then its backward graph.

    Several captures that share a memory pool record their forwards in order and their
    backwards in reverse order, as their replays will run.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        signature: Signature,
        backend: Backend,
        mutated: list[int],
        allow_unused_input: bool,
        views: InputViews | None = None,
    ):
        self.name = name
        self.fn = fn
        self.backend = backend
        self.signature = signature
        self.allow_unused_input = allow_unused_input
        # The inputs that the forward writes in place: read from the static inputs once the
        # forward has run on them (see `_values.aliasing`), else ``mutated``, an eager run's.
        self.mutated = mutated
        self.views = views  # the outputs that are inputs or views of them, if any
        self._versions = versions(signature.static_inputs)
        self._ran = False  # whether the forward ran on the static inputs
        self.grad_inputs = [i for i, t in enumerate(signature.static_inputs) if t.requires_grad]
        self.example: Any = None  # an eager result, detached: its shapes, for the emulation
        self.differentiable: list[int] | None = None  # its tensors that require grad, by index
        self.example_grads: tuple[torch.Tensor | None, ...] | None = None
        self.params: list[torch.Tensor] | None = None  # the other leaves it differentiates
        self._latest: Any = None  # the outputs of the last forward run, for the backward
        # The captured forward: its graph, outputs, and what it saved for the backward (held
        # alive), set by `capture_forward`.
        self.fwd_graph: Graph | None = None
        self.outputs: Outputs | None = None
        self.saved: list[torch.Tensor] = []

    def _run_forward(self) -> Any:
        self._ran = True
        args, kwargs = self.signature.static_tree()
        self._latest = self.fn(*args, **kwargs)
        return self._latest

    def _gradients(
        self,
        result: Any,
        inputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the tensors of ``result`` that require grad (for ``grad_outputs``,
        ones by default) with respect to what the backward differentiates: the tensors of
        ``inputs`` that require grad, then the other leaves (``params``); ``None`` for those
        the result does not depend on."""
        assert self.params is not None
        leaves, _ = _tree.flatten(result)
        outputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        surface = [inputs[i] for i in self.grad_inputs] + self.params
        if not outputs or not surface:  # nothing to differentiate: an empty backward
            return (None,) * len(surface)
        if grad_outputs is None:
            grad_outputs = [torch.ones_like(o) for o in outputs]
        # retain_graph: the emulation and a user's `retain_graph=True` may run it again.
        return torch.autograd.grad(
            outputs, surface, grad_outputs=grad_outputs, retain_graph=True, allow_unused=True
        )

    def _keep_example(self, example: Any, inputs: Sequence[torch.Tensor]) -> None:
        """Keep what an eager result of the call on ``inputs`` tells: its tensors that require
        grad, the leaves they depend on other than ``inputs`` (the module's parameters, or any
        tensor a function reads from its enclosing scope), found once, and the result itself,
        detached: no autograd graph of an eager run stays alive, the capture must create its
        own."""
        leaves, spec = _tree.flatten(example)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.differentiable = [i for i, t in enumerate(tensors) if t.requires_grad]
        if self.params is None:
            self.params = _leaves_requiring_grad([tensors[i] for i in self.differentiable], inputs)
        detached = [leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.example = _tree.unflatten(spec, detached)

    def warmup(self, iterations: int) -> None:
        """Run forward and backward eagerly on the static inputs, before the capture; then
        refuse an input that requires grad and that the outputs do not depend on, unless
        ``allow_unused_input``."""
        for _ in range(iterations):
            example = self.backend.warmup(self._run_forward)
            self.warmup_backward(example, self.signature.static_inputs)
            del example
        self._latest = None
        if self.allow_unused_input or self.example_grads is None:
            return
        paths = self.signature.tensor_paths()
        for slot, i in enumerate(self.grad_inputs):
            if self.example_grads[slot] is None:
                raise _errors.unused_input(self.name, paths[i])

    def warmup_backward(self, example: Any, inputs: Sequence[torch.Tensor]) -> None:
        """Run the backward of an eager result on ``inputs`` (the static ones, or the
        caller's), before the capture.

        The result keeps its autograd graph: the caller may still run its backward.
        """
        self._keep_example(example, inputs)
        self.example_grads = self.backend.warmup(lambda: self._gradients(example, inputs))

    def _capture(self, which: str, fn: Callable[[], Any], like: Any) -> tuple[Graph, Any]:
        """``backend.capture`` of the ``which`` graph ("forward" or "backward"), whose
        failure raises the error that names the call."""
        try:
            return self.backend.capture(fn, like=like)
        except Exception as err:
            raise _errors.capture_failure(
                self.name, f"capture the {which} graph", err, device=self.backend.device
            ) from err

    def capture_forward(self) -> None:
        # Hold every tensor that the forward saves for its backward: once the capture is
        # done, the autograd graph is dropped (see capture_backward), and the memory that
        # the backward graph reads must stay allocated, never reused by a later capture.
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            # The memory, without the autograd graph behind it: a saved output packed as
            # itself would form a cycle with its own node and keep the graph alive. The
            # captured backward reads only the data (double backward is refused).
            detached = t.detach()
            saved.append(detached)
            return detached

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            graph, static_out = self._capture("forward", self._run_forward, self.example)
        # The outputs of the recorded run carry the autograd graph (the static outputs may be
        # buffers: the emulation's, or lent ones' own memory).
        if self.params is None:  # no warm-up: the recorded outputs tell
            self._keep_example(self._latest, self.signature.static_inputs)
        self.outputs = Outputs(
            self.name,
            static_out,
            self.backend.device,
            allow_grad=True,
            lent=self.backend.lend(self.name),
        )
        self.fwd_graph, self.saved = graph, saved

    def capture_backward(self, state: State | None = None) -> DifferentiableCall:
        """Capture the backward of the captured forward; return the complete call, which
        follows ``state`` (see `_state.state`)."""
        assert self.outputs is not None and self.differentiable is not None
        inputs = self.signature.static_inputs
        with torch.no_grad():
            grad_outputs = [torch.empty_like(self.outputs.static[i]) for i in self.differentiable]
        graph, grads = self._capture(
            "backward",
            lambda: self._gradients(self._latest, inputs, grad_outputs),
            self.example_grads,
        )
        # Drop the recorded autograd graph: the graphs replay without it, and its gradient
        # accumulators, tied to the capture stream, would make autograd synchronise (and
        # warn) at every backward on the caller's stream.
        self._latest = None
        self.outputs.static = [t.detach() for t in self.outputs.static]
        if self._ran:
            self.mutated = written(inputs, self._versions)
        return DifferentiableCall(self, graph, grad_outputs, grads, state)
