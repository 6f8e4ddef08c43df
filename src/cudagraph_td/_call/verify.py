"""``verify=``: the first replays of a wrapper checked against eager runs of its function.

A graph replays the kernels recorded at capture, with every value the Python code read
then: a branch on a tensor's value, a global or an attribute read at capture, stays as it
was. Such a graph returns wrong answers without any error. ``Verifier`` copies the
inputs of a replay, runs the function eagerly on the copies after it, and compares the two
results and the two sets of inputs (which the function may update in place), leaf by leaf.

The eager run must leave no trace: it runs under ``torch.no_grad()``, inside
``torch.random.fork_rng`` (the caller's random numbers stay those of a run without
``verify=``), and the parameters and buffers it changed in place (running statistics, for
instance) get back the values the replay left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from .._errors import inputs as _errors
from .._state.search import find_state
from .._values import tree as _tree


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

    def copy_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call's inputs with every tensor cloned: the eager run's own, taken before the replay."""
        leaves, spec = _tree.flatten((args, kwargs))
        with torch.no_grad():
            copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves]
        return _tree.unflatten(spec, copies)

    def check(
        self,
        copies: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        entry: Any,
        graph: Hashable = None,
    ) -> None:
        """Run ``fn`` eagerly on ``copies``; raise if its result or inputs differ from the
        replay's, which ``entry`` (`_capture.entry.GraphEntry`) answered.

        Raises:
            RuntimeError: The graph is a training step, which an eager run would apply twice.
            VerificationError: A leaf of the result, or an input updated in place, differs.
        """
        device = entry.runner.backend.device
        training_step = entry.graph.training_step
        self.done += 1
        self._checked[graph] = self._checked.get(graph, 0) + 1
        if training_step:
            raise _errors.cannot_verify_training_step(self.name)
        copy_args, copy_kwargs = copies
        with _state_kept(self.fn, device), torch.no_grad():
            expected = self.fn(*copy_args, **copy_kwargs)
        difference = _first_difference(out, expected, "output")
        if difference is None:  # the inputs that the function updates in place
            difference = _first_difference((args, kwargs), copies, None)
        if difference is not None:
            raise VerificationError(self._message(self._checked[graph], *difference))

    def _message(self, replay: int, path: str, detail: str) -> str:
        return _errors.verification_failed(self.name, replay, path, detail)


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


@contextlib.contextmanager
def _state_kept(fn: Any, device: torch.device) -> Iterator[None]:
    """Undo what an eager run of ``fn`` on ``device`` does to random numbers and module state."""
    _, modules = find_state(fn)
    tensors = {
        id(t): t for module in modules.values() for t in (*module.parameters(), *module.buffers())
    }.values()
    with torch.no_grad():
        saved = [(t, t.clone()) for t in tensors]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    with torch.no_grad():
        for t, before in saved:
            # Compared by value: some kernels (batch norm's running statistics) write in
            # place without moving the version counter. Only what changed is written back,
            # so that the others' version counters (which autograd checks) stay as they were.
            if not torch.equal(t, before):
                t.copy_(before)
