"""A captured call: capture it once, then replay it with new inputs.

:func:`capture` runs the capture protocol on a backend and returns a :class:`CapturedCall`,
whose ``__call__`` is the replay hot path: compare, copy, replay, rebuild the outputs.
Everything that path reads was decided at capture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from . import _errors, _training, _tree
from ._backend import Backend, Graph, replay_function
from ._signature import Signature, validate

# Results of at most this many bytes come back as views of one new buffer per dtype, filled
# by one multi-tensor copy: one allocation and one kernel launch per call instead of one of
# each per output. Larger results are cloned output by output, so that one output kept
# alive does not hold the memory of all the others.
_PACK_LIMIT_BYTES = 1 << 24


class FreshCopies:
    """Copies of a graph's static tensors in new memory, made at each call (see `make`).

    Small contiguous tensors come back as views of one new buffer per dtype, filled by one
    multi-tensor copy: one allocation and one kernel launch per call instead of one of each
    per tensor. Others are cloned one by one.
    """

    def __init__(self, static: list[torch.Tensor], device: torch.device):
        self.static = static
        self.device = device
        # One buffer per dtype: (dtype, numel, indices of its tensors, their views' layouts).
        self._groups: list[tuple[torch.dtype, int, list[int], list[_Layout]]] = []
        packable = (
            len(static) > 1
            and all(t.is_contiguous() and not t.requires_grad for t in static)
            and sum(t.numel() * t.element_size() for t in static) <= _PACK_LIMIT_BYTES
        )
        if packable:
            for dtype in dict.fromkeys(t.dtype for t in static):
                indices = [i for i, t in enumerate(static) if t.dtype == dtype]
                layouts, numel = [], 0
                for i in indices:
                    t = static[i]
                    layouts.append((t.shape, t.stride(), numel))
                    numel += t.numel()
                self._groups.append((dtype, numel, indices, layouts))

    def make(self) -> list[torch.Tensor]:
        """Copies of the static tensors, in their order."""
        if not self._groups:
            return [t.clone() for t in self.static]
        if len(self._groups) == 1:  # one dtype: its views are the copies, in their order
            dtype, numel, _, layouts = self._groups[0]
            fresh = _views(torch.empty(numel, dtype=dtype, device=self.device), layouts)
            torch._foreach_copy_(fresh, self.static)
            return fresh
        fresh = list(self.static)
        for dtype, numel, indices, layouts in self._groups:
            views = _views(torch.empty(numel, dtype=dtype, device=self.device), layouts)
            for i, view in zip(indices, views, strict=True):
                fresh[i] = view
        torch._foreach_copy_(fresh, self.static)
        return fresh


class Outputs:
    """How to turn the graph's static outputs into a result in fresh memory."""

    def __init__(self, name: str, out: Any, device: torch.device, *, allow_grad: bool = False):
        leaves, self.spec = _tree.flatten(out)
        paths = _tree.leaf_paths(out, root="output")
        self.tensor_index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        static = [leaves[i] for i in self.tensor_index]
        for i, t in zip(self.tensor_index, static, strict=True):
            if t.requires_grad and not allow_grad:
                raise _errors.outputs_require_grad(name, paths[i])
            if t.device != device:
                raise _errors.cpu_output(name, paths[i], t.device)
        self.device = device
        # The constants of the result; its tensors are filled in at each call.
        self.template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.single_tensor = self.spec.is_leaf() and bool(static)
        self.all_tensors = len(static) == len(leaves)
        self.copies = FreshCopies(static, device)
        self.fresh_tensors = self.copies.make

    @property
    def static(self) -> list[torch.Tensor]:
        """The graph's output tensors, which each replay overwrites."""
        return self.copies.static

    @static.setter
    def static(self, tensors: list[torch.Tensor]) -> None:
        # One list, held by the copier: an old one (a recorded autograd graph's outputs,
        # replaced by their detached views) must not stay alive anywhere.
        self.copies.static = tensors

    def fresh(self) -> Any:
        """The result of the last replay, in memory that no later replay writes."""
        if self.single_tensor:  # the most common result, without a tree to rebuild
            return self.static[0].clone()
        return self.rebuild(self.fresh_tensors())

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        """The result tree, with ``tensors`` in place of the static output tensors."""
        if self.all_tensors:
            return optree.tree_unflatten(self.spec, tensors)
        leaves = list(self.template)
        for i, t in zip(self.tensor_index, tensors, strict=True):
            leaves[i] = t
        return optree.tree_unflatten(self.spec, leaves)


# Where a view lies in its buffer: (shape, strides, offset in elements).
_Layout = tuple[torch.Size, tuple[int, ...], int]

_as_strided = torch.Tensor.as_strided


def _views(flat: torch.Tensor, layouts: list[_Layout]) -> list[torch.Tensor]:
    """Views of ``flat`` laid out as ``layouts``: one ``as_strided`` each, the cheapest view."""
    return [_as_strided(flat, shape, strides, offset) for shape, strides, offset in layouts]


class CapturedCall:
    """A graph with its signature and outputs: calling it replays the graph on new inputs."""

    def __init__(
        self,
        signature: Signature,
        graph: Graph,
        outputs: Outputs,
        mutated: list[int],
        watch: Callable[[], None] | None = None,
    ):
        self.signature = signature
        self.graph = graph
        self.outputs = outputs
        self.mutated = mutated
        self.watch = watch
        self.replay = self._replay_function()

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.replay(args, kwargs)

    def _replay_function(self) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
        """The replay hot path: one flat function whose state, decided here, are locals."""
        match = self.signature.match
        static_inputs = self.signature.static_inputs
        replay_graph = replay_function(self.graph)
        mutated = self.mutated
        mutated_static = [static_inputs[i] for i in mutated]
        watch = self.watch
        fresh = self.outputs.fresh
        if self.outputs.single_tensor:  # the most common result: no tree to rebuild
            fresh = self.outputs.static[0].clone

        quick_read = self.signature.quick_read
        positional = self.signature.positional_types
        n_positional = -1 if positional is None else len(positional)
        first = None if positional is None else positional[0]

        def replay(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # The commonest calls, positional tensors and one TensorDict, are read and
            # checked without flattening; any other call, and any mismatch, goes to the full
            # check, which flattens the inputs and raises the error that names the leaf.
            tensors = quick_read(args, kwargs)
            if tensors is None:
                tensors = match(args, kwargs)
            if watch is not None:  # a training step: its gradients and hyperparameters
                watch()
            if tensors:
                torch._foreach_copy_(static_inputs, tensors)
            replay_graph()
            if mutated:  # in-place updates of inputs reach the caller, as in eager
                torch._foreach_copy_([tensors[i] for i in mutated], mutated_static)
            return fresh()

        if n_positional != 1 or watch is not None or mutated or not self.outputs.single_tensor:
            return replay
        # One tensor in, one tensor out, nothing else to do: the commonest call (a network on
        # a batch), replayed in the fewest steps. Anything unexpected takes `replay`.
        static_output = self.outputs.static[0]

        def replay_one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not kwargs and len(args) == 1:
                t = args[0]
                try:
                    same = (type(t), t.shape, t.dtype, t.device, t.requires_grad) == first
                except AttributeError:
                    same = False
                if same:
                    # `_foreach_copy_` is issued faster than `copy_`, even for one tensor.
                    torch._foreach_copy_(static_inputs, args)
                    replay_graph()
                    return static_output.clone()
            return replay(args, kwargs)

        return replay_one


def capture(
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: Backend,
) -> tuple[Callable[[tuple[Any, ...], dict[str, Any]], Any], Any]:
    """Capture ``fn(*args, **kwargs)``; return the replayable call and this call's result.

    The call runs ``fn`` eagerly once, on the caller's inputs, for its result and its
    effects; the capture that follows only records kernels. When grad mode is on and the
    result requires grad, the graph is captured for autograd (forward and backward).
    """
    grad = torch.is_grad_enabled()
    signature = Signature(name, args, kwargs, backend.device, allow_grad=grad)
    inputs = signature.tensors(args, kwargs)
    versions = [t._version for t in inputs]
    observed = _training.Observation(fn)
    try:
        result = backend.warmup(lambda: fn(*args, **kwargs))
    except Exception as err:
        raise _errors.capture_failure(name, "run the capturing call", err) from err
    if observed.after_eager_run() and grad and (path := _path_requiring_grad(result)):
        raise _errors.step_output_requires_grad(name, path)
    # The function wrote into these inputs (their version counters moved): each replay
    # copies them back to the caller's tensors.
    mutated = [i for i, (t, v) in enumerate(zip(inputs, versions, strict=True)) if t._version != v]
    if grad and _path_requiring_grad(result):
        from ._autograd import capture_differentiable

        call = capture_differentiable(name, fn, signature, backend, result, inputs, mutated)
        return call, result
    if any(t.requires_grad for t in signature.static_inputs):
        paths = signature.tensor_paths()
        path = next(
            p for t, p in zip(signature.static_inputs, paths, strict=True) if t.requires_grad
        )
        raise _errors.requires_grad(name, path)

    def run_static() -> Any:
        # Fresh containers at each run, so that keys written into an input TensorDict by one
        # (emulated) run are not inputs of the next, as on CUDA where the function runs once.
        static_args, static_kwargs = signature.static_tree()
        return fn(*static_args, **static_kwargs)

    try:
        graph, static_out = observed.record(lambda: backend.capture(run_static, like=result))
    except Exception as err:
        raise _errors.capture_failure(name, "capture the graph", err) from err
    outputs = Outputs(name, static_out, backend.device)
    watch = observed.watch(name)
    if watch is not None and backend.reruns_python:
        graph = _training.PinnedGrads(graph, watch)
    return CapturedCall(signature, graph, outputs, mutated, watch), result


def _path_requiring_grad(tree: Any) -> str | None:
    """The path of the first output tensor that requires grad, if any."""
    for path, leaf in _tree.walk_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return _tree.format_path(path, "output")
    return None


class GraphRunner:
    """The life of one graph: warm-up calls, the capture, then replays.

    ``runner.run(args, kwargs)`` calls ``fn(*args, **kwargs)`` as the current stage requires:
    calls ``1 … warmup-1`` run it eagerly through the backend, call ``warmup`` captures it,
    later calls replay the graph. ``make_backend(args, kwargs)`` makes the backend on the
    first call, from its inputs; ``None`` means no graph at all: every call runs ``fn``.
    The runner holds no reference to the wrapper that owns it, so that dropping the wrapper
    frees the graph at once, without waiting for the garbage collector.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        warmup: int,
        make_backend: Callable[[tuple[Any, ...], dict[str, Any]], Backend] | None,
    ):
        self.name = name
        self.fn = fn
        self.warmup = warmup
        self.make_backend = make_backend
        self.backend: Backend | None = None
        self.counter = 0
        self.captured: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None
        # What the owner calls to replay, once captured: ``captured`` itself, or a layer's
        # faster path around it (see `CudaGraphModule.__call__`).
        self.replay: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        captured = self.captured
        if captured is not None:
            return captured(args, kwargs)
        if self.make_backend is None:
            return self.fn(*args, **kwargs)
        return self._prepare(args, kwargs)

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self.make_backend is not None
        backend = self.backend or self.make_backend(args, kwargs)
        self.backend = backend
        if self.counter < self.warmup - 1:
            validate(self.name, args, kwargs, backend.device, allow_grad=torch.is_grad_enabled())
            stage = f"run warm-up call {self.counter + 1} of {self.warmup - 1}"
            try:
                result = backend.warmup(lambda: self.fn(*args, **kwargs))
            except Exception as err:
                raise _errors.capture_failure(self.name, stage, err) from err
            self.counter += 1
            return result
        self.captured, result = capture(self.name, self.fn, args, kwargs, backend)
        self.counter += 1
        return result
