"""``verify=``: the first replays of a wrapper checked against eager runs of its function.

A graph replays the kernels recorded at capture, with every value the Python code read
then: a branch on a tensor's value, a global or an attribute read at capture, stays as it
was. Such a graph returns wrong answers without any error. ``Verifier`` copies the
inputs of a replay, runs the function eagerly on the copies after it, and compares the two
results and the two sets of inputs (which the function may update in place), leaf by leaf.

The eager run must leave no trace: it runs under ``torch.no_grad()``, inside
``torch.random.fork_rng`` (the caller's random numbers stay those of a run without
``verify=``), and the parameters, buffers and tensor attributes of modules that it changed in
place (running statistics, for instance) get back the values the replay left (see
`_shapes.row_check.StateSnapshot`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from .._capture.entry import GraphEntry
from .._errors import inputs as _errors
from .._shapes.row_check import StateSnapshot
from .._values import tree as _tree
from .._values.tree import Call


class VerificationError(RuntimeError):
    """A verified replay differs from an eager run of the function on the same inputs."""


class Verifier:
    """Checks the first ``replays`` replays of each of ``fn``'s graphs against eager runs."""

    def __init__(self, name: str, fn: Callable[..., Any], replays: int):
        self.name = name
        self.fn = fn
        self.replays = replays
        self.done = 0  # replays checked, all graphs together
        self._checked: dict[Hashable, int] = {}  # by graph

    def wants(self, graph: Hashable) -> bool:
        """Whether the next replay of ``graph`` is to be checked."""
        return self._checked.get(graph, 0) < self.replays

    def copy_inputs(self, call: Call) -> Any:
        """The call's inputs with every tensor cloned: the eager run's own, taken before the
        replay."""
        with torch.no_grad():
            copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in call.leaves]
        return _tree.unflatten(call.spec, copies)

    def check(
        self,
        copies: Any,
        call: Call,
        out: Any,
        entry: GraphEntry,
    ) -> None:
        """Run ``fn`` eagerly on ``copies``; raise if its result or inputs differ from the
        replay's, which ``entry`` answered (counted by its key: a bucket's rows are its graph).

        Raises:
            RuntimeError: The graph is a training step, which an eager run would apply twice.
            VerificationError: A leaf of the result, or an input updated in place, differs.
        """
        assert entry.backend is not None and entry.captured is not None
        device = entry.backend.device
        graph = entry.key
        self.done += 1
        self._checked[graph] = self._checked.get(graph, 0) + 1
        if entry.captured.training_step:
            raise _errors.cannot_verify_training_step(self.name)
        state = StateSnapshot(self.fn)
        with torch.random.fork_rng([device] if device.type == "cuda" else []), torch.no_grad():
            expected = self.fn(*copies[0], **copies[1])
        state.restore_written()  # the replay's values, where the eager run moved them
        difference = _first_difference(out, expected, "output")
        if difference is None:  # the inputs as the call left them (a TensorDict written into)
            difference = _first_difference((call.args, call.kwargs), copies, None)
        if difference is not None:
            replay = self._checked[graph]
            raise VerificationError(_errors.verification_failed(self.name, replay, *difference))


def _first_difference(actual: Any, expected: Any, root: str | None) -> tuple[str, str] | None:
    """The path of the first leaf where ``actual`` and ``expected`` differ, and how, if any.

    ``root`` names the trees in the path (see `_values.tree.format_path`); ``None`` for a call's
    ``(args, kwargs)``.
    """
    leaves, spec = _tree.flatten(actual)
    expected_leaves, expected_spec = _tree.flatten(expected)
    if spec != expected_spec:
        return root or "(args, kwargs)", f"another structure ({spec} instead of {expected_spec})."
    paths = _tree.leaf_paths(actual, root=root)
    for path, a, e in zip(paths, leaves, expected_leaves, strict=True):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            try:
                torch.testing.assert_close(a.detach(), e, equal_nan=True)
            except AssertionError as err:
                return path, " ".join(str(err).split()) + "."
        elif type(a) is not type(e) or a != e:
            return path, f"{a!r} instead of {e!r}."
    return None
