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

from . import _errors, _tree
from ._backend import Backend, Graph
from ._signature import Signature, validate


class Outputs:
    """How to turn the graph's static outputs into a result in fresh memory."""

    def __init__(self, name: str, out: Any, device: torch.device):
        leaves, self.spec = _tree.flatten(out)
        paths = _tree.leaf_paths(out, root="output")
        self.tensor_index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.static = [leaves[i] for i in self.tensor_index]
        for i, t in zip(self.tensor_index, self.static, strict=True):
            if t.requires_grad:
                raise _errors.outputs_require_grad(name, paths[i])
            if t.device != device:
                raise _errors.cpu_output(name, paths[i], t.device)
        self.template = leaves
        self.single_tensor = self.spec.is_leaf() and bool(self.static)
        self.all_tensors = len(self.static) == len(leaves)

    def fresh(self) -> Any:
        """The result of the last replay, in memory that no later replay writes."""
        if self.single_tensor:  # the most common result, without a tree to rebuild
            return self.static[0].clone()
        clones = [t.clone() for t in self.static]
        if self.all_tensors:
            return optree.tree_unflatten(self.spec, clones)
        leaves = list(self.template)
        for i, t in zip(self.tensor_index, clones, strict=True):
            leaves[i] = t
        return optree.tree_unflatten(self.spec, leaves)


class CapturedCall:
    """A graph with its signature and outputs: calling it replays the graph on new inputs."""

    def __init__(self, signature: Signature, graph: Graph, outputs: Outputs, mutated: list[int]):
        self.signature = signature
        self.graph = graph
        self.outputs = outputs
        # Decided here so that the replay reads attributes instead of recomputing them.
        self._spec = signature.spec
        self._tensor_index = signature.tensor_index
        self._all_tensors = not signature.const_index
        self._expected = signature.expected
        self._static_inputs = signature.static_inputs
        self._mutated = mutated
        self._mutated_static = [signature.static_inputs[i] for i in mutated]

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tree: Any = (args, kwargs)
        leaves, spec = optree.tree_flatten(tree, namespace=_tree.NAMESPACE)
        if spec != self._spec:
            raise self.signature.diagnose(args, kwargs)
        tensors = leaves if self._all_tensors else [leaves[i] for i in self._tensor_index]
        try:
            same = [
                (t.shape, t.dtype, t.device, t.requires_grad) for t in tensors
            ] == self._expected
        except AttributeError:  # a non-tensor where the capture had a tensor
            same = False
        if not same or not (self._all_tensors or self.signature.consts_match(leaves)):
            raise self.signature.diagnose(args, kwargs)
        if tensors:
            torch._foreach_copy_(self._static_inputs, tensors)
        self.graph.replay()
        if self._mutated:  # in-place updates of inputs reach the caller, as in eager
            torch._foreach_copy_([tensors[i] for i in self._mutated], self._mutated_static)
        return self.outputs.fresh()


def capture(
    name: str,
    module: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: Backend,
) -> tuple[CapturedCall, Any]:
    """Capture ``module(*args, **kwargs)`` and return the replayable call and this call's result.

    The call's effects happen once, as in eager mode. On CUDA the result comes from an eager
    run on the caller's inputs, and the capture that follows only records kernels. The
    emulation's capture runs the function, so its result is the capture's own output.
    """
    signature = Signature(name, args, kwargs, backend.device)
    static = signature.static_inputs
    versions = [t._version for t in static]

    def run_static() -> Any:
        # Fresh containers at each run, so that keys written into an input TensorDict by one
        # (emulated) run are not inputs of the next, as on CUDA where the function runs once.
        static_args, static_kwargs = signature.static_tree()
        return module(*static_args, **static_kwargs)

    try:
        if not backend.executes_on_capture:
            result = backend.warmup(lambda: module(*args, **kwargs))
        graph, static_out = backend.capture(run_static)
    except Exception as err:
        raise _errors.capture_failure(name, "capture the graph", err) from err
    outputs = Outputs(name, static_out, backend.device)
    if backend.executes_on_capture:
        result = outputs.fresh()
    # The function wrote into these inputs (their version counters moved): each replay
    # copies them back to the caller's tensors.
    mutated = [i for i, (t, v) in enumerate(zip(static, versions, strict=True)) if t._version != v]
    if backend.executes_on_capture and mutated:
        user_tensors = _input_tensors(signature, args, kwargs)
        with torch.no_grad():
            torch._foreach_copy_([user_tensors[i] for i in mutated], [static[i] for i in mutated])
    return CapturedCall(signature, graph, outputs, mutated), result


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
        self.captured: CapturedCall | None = None

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
            validate(self.name, args, kwargs, backend.device)
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


def _input_tensors(
    signature: Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    leaves, _ = _tree.flatten((args, kwargs))
    return [leaves[i] for i in signature.tensor_index]
