"""The capture of a call, and the plain captured call.

A graph's entry (`_capture.entry.GraphEntry`) runs a function through the stages of one
graph. ``capture`` records the call that ends the warm-up: a plain graph (``GraphCall``)
or, when the result needs gradients, a forward and a backward graph inside an autograd node
(see `_capture.autograd`). Either is a complete captured call (`_capture.captured.Captured`)
that the replay path launches. ``capture_turn`` is the one lock under which a wrapper's
function runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._compat import graph_replay
from .._errors import inputs as _errors
from .._errors import state as _errors_state
from .._state import training as _training
from .._state.state import Flags, State
from .._values import tree as _tree
from .._values.aliasing import versions, written
from .._values.input_views import InputViews, ReturnedTensorDicts, tensordicts_before
from .._values.outputs import Outputs
from .._values.signature import Signature
from .._values.tree import Call
from . import captured as _captured
from .autograd import Capture
from .backend import Backend, Graph
from .captured import Captured, copy_inputs


class GraphCall(Captured):
    """A plain captured graph (no autograd): its signature, its outputs, how to launch it."""

    def __init__(
        self,
        signature: Signature,
        graph: Graph,
        outputs: Outputs,
        mutated: list[int],
        watch: _training.Watch | None,
        state: State | None,
        views: InputViews | None = None,
    ):
        super().__init__(signature, outputs, state, mutated, views)
        self.graph = graph
        self.training_step = watch is not None
        self._watch = watch
        self._static_inputs = signature.static_inputs
        self._replay = graph_replay(graph)
        self._fresh = outputs.copies.make
        if views is not None:  # only the outputs that are not inputs or views of them copied
            computed = [outputs.static[j] for j in views.computed]
            self._fresh = outputs.copier(computed).make
        # One tensor in and one out, nothing else to do: the replay path launches it itself.
        one = len(self._static_inputs) == 1 and len(outputs.static) == 1
        if one and not mutated and watch is None and views is None:
            # Its output: a copy (the tensor's own `clone`, no Python frame), or lent.
            output = outputs.static[0].clone if outputs.lent is None else outputs.copies.one
            self.one_tensor_launch = (self._static_inputs, self._replay, output)

    def rows(self, signature: Signature, outputs: Outputs) -> GraphCall:
        """This graph replayed on fewer rows: ``signature``'s static inputs and ``outputs``'
        static tensors are views of the first rows of this graph's (a bucket's graph).

        Its outputs are all computed ones, copied or lent under this graph's lease (see
        `_values.outputs.Outputs`): a bucket's graph that returns an input or a view of one
        is refused at its capture (see `_shapes.buckets`).
        """
        mutated = self._writes.indices
        return GraphCall(signature, self.graph, outputs, mutated, self._watch, self.state)

    def launch(
        self, tensors: Sequence[torch.Tensor], ungraded: tuple[str, ...] = (), checked: bool = False
    ) -> Sequence[torch.Tensor]:
        """Copy ``tensors`` (checked) into the static inputs, replay, return fresh outputs
        (``ungraded`` is for an autograd node's launch: a plain graph has none)."""
        if self._touches_inputs and not checked:  # decided at capture: the others check nothing
            return self._launch_writing(tensors)
        if self._watch is not None:  # a training step: its gradients and hyperparameters
            self._watch()
        copy_inputs(self._static_inputs, tensors, self.inputs_lent)
        self._replay()
        return self._fresh()


def capture(
    name: str, fn: Callable[..., Any], call: Call, backend: Backend
) -> tuple[_captured.Captured, Any]:
    """Capture the function's ``call``; return the captured call and this call's result.

    The call runs ``fn`` eagerly once, on the caller's inputs, for its result and its
    effects; the capture that follows only records kernels. When grad mode is on and the
    result requires grad, the graph is captured for autograd (forward and backward).
    """
    grad = torch.is_grad_enabled()
    args, kwargs = call.args, call.kwargs
    signature = Signature(name, call, backend.device, allow_grad=grad, function=fn)
    inputs = signature.tensors(call)
    before = versions(inputs)
    tensordicts = tensordicts_before(args, kwargs)
    observed = _training.Observation(fn)
    try:
        result = backend.warmup(lambda: fn(*args, **kwargs))
    except Exception as err:
        raise _errors.capture_failure(
            name, "run the capturing call", err, device=backend.device
        ) from err
    path = _path_requiring_grad(result) if grad else None
    if observed.after_eager_run() and path:
        raise _errors_state.step_output_requires_grad(name, path)
    # The function wrote into these inputs (their version counters moved): each replay
    # copies them back to the caller's tensors. The caller's tensors may share a version
    # counter (one tensor passed twice, views of one): the graph's own copies, which the
    # capture runs the function on, tell which ones the graph writes (see `_values.aliasing`).
    mutated = written(inputs, before)
    # A TensorDict argument returned (`return td`): the graph returns the entries written
    # into it, which each call sets into the caller's (see `_values.input_views`).
    returned = ReturnedTensorDicts.of(result, tensordicts)
    graphed = fn if returned is None else returned.graphed(fn)
    form = result if returned is None else returned.form(result)
    # Outputs that are the caller's inputs or views of them: every call returns them so.
    views = InputViews.of(signature, form, inputs)
    if path:  # captured for autograd, from the eager result
        autograd = backend.for_autograd()
        capture = Capture(name, graphed, signature, autograd, mutated, True, views=views)
        capture.warmup_backward(form, inputs)
        capture.capture_forward()
        # The state found once the forward is captured. Autograd holds the parameters it
        # differentiates: they are followed by identity too.
        state = observed.state(name, identity=True, flags="frozen")
        return capture.capture_backward(state), result
    for i, t in enumerate(signature.static_inputs):
        if t.requires_grad:
            raise _errors.requires_grad(name, signature.tensor_paths()[i])

    def run_static() -> Any:
        # Fresh containers at each run, so that keys written into an input TensorDict by one
        # (emulated) run are not inputs of the next, as on CUDA where the function runs once.
        static_args, static_kwargs = signature.static_tree()
        return graphed(*static_args, **static_kwargs)

    static_versions = versions(signature.static_inputs)
    try:
        graph, static_out = observed.record(lambda: backend.capture(run_static, like=form))
    except Exception as err:
        raise _errors.capture_failure(
            name, "capture the graph", err, device=backend.device
        ) from err
    # Read from the graph's own copies, which count versions for inference tensors too (made
    # under `torch.inference_mode()`); an emulated DDP step, whose capture runs nothing,
    # keeps the eager run's.
    if not backend.reruns_python:
        mutated = written(signature.static_inputs, static_versions)
    outputs = Outputs(name, static_out, backend.device, lent=backend.lend(name))
    watch = observed.watch(name)
    if watch is not None and backend.reruns_python:
        graph = _training.PinnedGrads(graph, watch)
    # A training step's optimizers hold its parameters: followed by identity too. In grad
    # mode, `requires_grad` flags decide what the function computes: followed too.
    flags: Flags | None = "step" if watch is not None else "frozen" if grad else None
    state = observed.state(name, identity=watch is not None, flags=flags)
    return GraphCall(signature, graph, outputs, mutated, watch, state, views), result


def _path_requiring_grad(tree: Any) -> str | None:
    """The path of the first output tensor that requires grad, if any."""
    for path, leaf in _tree.leaves_with_paths(tree, root="output"):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return path
    return None


# One warm-up or capture at a time in the process: a capture admits no other thread's
# allocations (nor, in the "global" mode, their synchronisations). Re-entrant: a function
# may call another wrapper while it is warmed up or captured.
_CAPTURE_LOCK = threading.RLock()


@contextlib.contextmanager
def capture_turn(lock: Any = None) -> Iterator[None]:
    """Hold the capture lock: the one lock under which a wrapper's function runs.

    ``lock`` is the wrappers' replay lock (`_capture.sharing.REPLAY_LOCK`), which the calling thread
    holds once. When another thread holds the capture lock, this thread waits for it without
    holding ``lock``: the other thread's function may call a wrapper, and would otherwise
    wait for this thread, which waits for it. The wrapper's state may then have moved on
    while this thread waited (the other thread may have warmed it up or captured it).
    """
    if not _CAPTURE_LOCK.acquire(blocking=False):
        if lock is not None:
            lock.release()
        try:
            _CAPTURE_LOCK.acquire()
        finally:
            if lock is not None:
                lock.acquire()
    try:
        yield
    finally:
        _CAPTURE_LOCK.release()
