"""Training steps inside a graph: the optimizers and gradients that a capture bakes in.

A function that runs ``loss.backward()`` and ``optimizer.step()`` reads state that is not
among its inputs: the parameters' ``.grad`` tensors, at the addresses the capture recorded,
and the optimizers' hyperparameters, whose Python numbers become constants of the captured
kernels. Nothing at replay re-reads either. ``Observation`` finds that state around the
capturing call, and the ``Watch`` it yields checks it before each replay: a gradient set to
``None`` that the graph adds into is zeroed and given back (``None`` is zero, as eager mode
reads it), and a gradient replaced by another tensor, or a Python learning rate changed
after the capture, raises an error instead of being silently ignored.

The modules and optimizers are found by `_state.search`.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from .._compat import foreach_zero_, version
from .._errors import state as _errors_state
from .search import Search
from .state import (
    Binding,
    Flags,
    Followed,
    Lengths,
    State,
    modules_followed,
    optimizer_followed,
    optimizer_lengths,
    optimizer_params,
    rebound,
)

_grad = operator.attrgetter("grad")


class Observation:
    """The gradients and optimizer state around one capturing call.

    Made before the call's eager run; ``after_eager_run`` then tells whether the call
    was a training step (it moved parameters or their gradients).
    """

    def __init__(self, fn: Any):
        self._search = Search(fn)
        optimizers = self.optimizers = self._search.optimizers
        modules = self.modules = self._search.modules
        # Where the modules' parameters and buffers are bound, and the optimizers'
        # hyperparameters, before the call: what the call itself rebinds is its own output.
        self._bound = modules_followed(modules)
        self._groups = [
            (group, dict(group)) for opt in optimizers.values() for group in opt.param_groups
        ]
        params: dict[int, tuple[str, torch.Tensor]] = {}
        for path, module in modules.items():
            for pname, p in module.named_parameters():
                params.setdefault(id(p), (f"{path}.{pname}", p))
        for path, opt in optimizers.items():
            for where, param in optimizer_params(path, opt):
                params.setdefault(id(param), (where, param))
        self.params = [(name, p) for name, p in params.values() if p.requires_grad]
        self._before = [_state(p) for _, p in self.params]
        self.touched: list[tuple[str, torch.Tensor]] = []
        self.rebinds: list[bool] = []
        self.accumulates: list[bool] = []

    def after_eager_run(self) -> bool:
        """Whether the call moved a parameter or a gradient: a training step."""
        self.touched = [
            param
            for param, before in zip(self.params, self._before, strict=True)
            if _moved(param[1], before)
        ]
        self._before = []  # let go of the gradients of before the call
        return bool(self.touched)

    def record(self, capture: Any) -> Any:
        """Run ``capture()``, keeping the touched gradients' values as the eager run left them.

        A capture runs the function's Python code without running its kernels: a
        ``zero_grad()`` inside sets gradients to ``None``, and the backward then binds new
        ones, in graph memory that holds nothing until the first replay. Those receive the
        eager run's values, so that after the capturing call ``.grad`` reads as in eager mode.
        """
        eager = [p.grad for _, p in self.touched]
        with _accumulations(p for _, p in self.touched) as accumulated:
            out = capture()
        self.rebinds, self.accumulates = [], []
        with torch.no_grad():
            for (_, p), before in zip(self.touched, eager, strict=True):
                # A gradient tensor that the capture replaced by one of its own: the step drops
                # the incoming gradient before it reads it (`zero_grad(set_to_none=True)`
                # inside), so a replay may re-point `.grad` to its own tensor whatever `.grad`
                # is then, as eager mode binds a new one (another step on the same parameters
                # may have rebound it).
                rebinds = p.grad is not before and before is not None
                # A gradient tensor that the captured backward adds into (no `zero_grad()`
                # inside, or `set_to_none=False`): a replay may zero it when `.grad` is `None`,
                # which eager mode reads as zero, and give it back.
                self.rebinds.append(rebinds)
                self.accumulates.append(
                    before is not None and p.grad is before and accumulated.get(id(p)) is before
                )
                if rebinds and p.grad is not None and before is not None:
                    p.grad.copy_(before)
        return out

    def watch(self, name: str) -> Watch | None:
        """The checks that keep the captured step valid, or ``None`` if it has none."""
        if not self.touched:
            return None
        # Hyperparameters that the step itself sets (a schedule computed inside it): each
        # replay sets them as the capture did, whatever they were before.
        written = {
            (id(group), key)
            for group, before in self._groups
            for key, value in before.items()
            if group.get(key) is not value
        }
        return Watch(name, self.touched, self._stepped(), written, self.rebinds, self.accumulates)

    def _stepped(self) -> dict[str, torch.optim.Optimizer]:
        touched = {id(p) for _, p in self.touched}
        return {
            path: opt
            for path, opt in self.optimizers.items()
            if any(id(p) in touched for group in opt.param_groups for p in group["params"])
        }

    def state(self, name: str, *, identity: bool, flags: Flags | None = None) -> State | None:
        """The state that the captured graph reads (see `_state.state`), as the capture left it, or
        ``None`` if it reads none. A training step's includes its optimizers' and their
        parameter groups; a graph captured in grad mode follows ``requires_grad`` flags
        (``flags``: see `_state.state.Flags`)."""
        # The function rebinds module state at each call: a graph cannot follow.
        own = _rebound(name, self._bound, "a new tensor")
        skipped = {(id(entry[1]), entry[2]) for entry in own}
        entries = [
            entry
            for entry in modules_followed(self.modules)
            if (id(entry[1]), entry[2]) not in skipped
        ]
        stepped = self._stepped()
        followed = {id(entry[3]) for entry in entries}
        lengths: list[Lengths] = []
        for path, opt in stepped.items():
            entries += optimizer_followed(path, opt, followed)
            lengths += optimizer_lengths(path, opt)
        # Where the modules and the stepped optimizers were found, as before the call: a
        # binding that the call itself moved is no more the capture's than `own`'s tensors.
        bindings = self._search.bindings([*self.modules.values(), *stepped.values()])
        moved = {id(b) for b in _rebound(name, bindings, "a new object")}
        bindings = [b for b in bindings if id(b) not in moved]
        if not entries and not bindings:
            return None
        return State(entries, identity=identity, bindings=bindings, flags=flags, lengths=lengths)


def _rebound(
    name: str, entries: Sequence[Followed | Binding], new: str
) -> list[Followed | Binding]:
    """The ``entries`` that the capturing call rebound (to ``new``), with a warning: the
    function rebinds them at each call, and a graph reads the objects of its capture."""
    moved = rebound(entries)
    if moved:
        paths = [entry[0] for entry in moved]
        warnings.warn(_errors_state.rebinds_state(name, paths, new), UserWarning, stacklevel=3)
    return moved


@contextlib.contextmanager
def _accumulations(params: Iterable[torch.Tensor]) -> Iterator[dict[int, torch.Tensor | None]]:
    """The gradient tensor that a backward accumulated each parameter's gradient into, by the
    parameter's ``id``, while in the context (read by a post-accumulate-grad hook)."""
    accumulated: dict[int, torch.Tensor | None] = {}

    def seen(p: torch.Tensor) -> None:
        accumulated[id(p)] = p.grad

    handles = [p.register_post_accumulate_grad_hook(seen) for p in params if p.is_leaf]
    try:
        yield accumulated
    finally:
        for handle in handles:
            handle.remove()


def _state(p: torch.Tensor) -> tuple[int, torch.Tensor | None, int]:
    """What changes when a step writes a parameter or its gradient.

    The gradient itself, not its ``id``: holding it keeps a new gradient from taking the
    freed one's address, and so its ``id``.
    """
    grad = p.grad
    return version(p), grad, -1 if grad is None else version(grad)


def _moved(p: torch.Tensor, before: tuple[int, torch.Tensor | None, int]) -> bool:
    version, grad, grad_version = _state(p)
    return version != before[0] or grad is not before[1] or grad_version != before[2]


class Watch:
    """Checks, before each replay, the state a captured training step reads but does not copy.

    Calling it raises when a touched parameter's ``.grad`` is no longer the tensor the graph
    writes, or when a hyperparameter of a stepped optimizer changed. A ``.grad`` that the
    step drops before reading it, or that is ``None`` where the graph adds into its
    gradient tensor, is given the graph's tensor back (zeroed first in the second case).
    """

    def __init__(
        self,
        name: str,
        params: list[tuple[str, torch.Tensor]],
        optimizers: dict[str, torch.optim.Optimizer],
        written: set[tuple[int, str]],
        rebinds: list[bool],
        accumulates: list[bool],
    ):
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.grads = [p.grad for p in self.params]
        self.rebinds = rebinds  # the gradients the step drops before reading
        self.accumulates = accumulates  # the gradients the graph adds into, which `None` zeroes
        # The hyperparameters that each step reads: (where, its group, its key).
        read = [
            (f"`{path}` ({type(opt).__name__}) param_groups[{i}]", group, key)
            for path, opt in optimizers.items()
            for i, group in enumerate(opt.param_groups)
            for key in opt.defaults
            if key in group and key != "params" and (id(group), key) not in written
        ]
        # As parallel lists, which `__call__` maps in C, with each value at capture.
        self._wheres = [where for where, _, _ in read]
        self._groups = [group for _, group, _ in read]
        self._keys = [key for _, _, key in read]
        self._values = [group[key] for _, group, key in read]

    def __call__(self) -> None:
        # Identity checks, mapped in C over flat lists: the common case, where nothing
        # changed, costs no Python loop per parameter, group or hyperparameter.
        moved = None
        if not all(map(operator.is_, map(_grad, self.params), self.grads)):
            moved = self._moved_grads()
        try:
            same = all(
                map(operator.is_, map(operator.getitem, self._groups, self._keys), self._values)
            )
        except KeyError:  # a hyperparameter deleted from its group
            same = False
        if not same:
            self._check_hyperparameters()
        if moved is not None:  # every check passed: the gradients can be given back
            self._give_back(*moved)

    def after_replay(self) -> None:
        """Put the captured gradient tensors back, with the values the replay computed."""
        with torch.no_grad():
            for p, grad in zip(self.params, self.grads, strict=True):
                if p.grad is not grad:
                    if grad is not None and p.grad is not None:
                        grad.copy_(p.grad)
                    p.grad = grad

    def _moved_grads(self) -> tuple[list[int], list[torch.Tensor]]:
        """The parameters whose ``.grad`` gets the graph's tensor back, and the tensors to zero
        first; raise for a gradient replaced where the graph cannot give eager mode's answer.

        The step drops a gradient before reading it (`zero_grad()` inside): any ``.grad`` is
        fine. The graph adds into its gradient tensor: ``None`` is zero, as eager mode
        reads it. Anything else (another tensor, or ``None`` where the step reads the
        gradient without computing it) is refused, before anything changes.
        """
        back: list[int] = []
        zero: list[torch.Tensor] = []
        for i, (p, grad) in enumerate(zip(self.params, self.grads, strict=True)):
            now = p.grad
            if now is grad:
                continue
            if self.rebinds[i]:
                back.append(i)
            elif now is None and self.accumulates[i]:
                assert grad is not None  # a tensor that the graph adds into
                back.append(i)
                zero.append(grad)
            else:
                raise _errors_state.grad_replaced(self.name, self.names[i], grad, now)
        return back, zero

    def _give_back(self, back: list[int], zero: list[torch.Tensor]) -> None:
        if zero:  # one launch, on the replay's stream, before it; no host synchronisation
            foreach_zero_(zero)
        for i in back:
            self.params[i].grad = self.grads[i]

    def _check_hyperparameters(self) -> None:
        """Raise for a hyperparameter changed since the capture.

        Equal values in new objects (a scheduler that wrote the same number) pass, and are
        the ones checked from then on, so that the next replay takes the fast path again.
        """
        hyperparameters = zip(self._wheres, self._groups, self._keys, self._values, strict=True)
        for i, (where, group, key, value) in enumerate(hyperparameters):
            new = group.get(key, _MISSING)
            if new is value:
                continue
            tensors = isinstance(new, torch.Tensor) or isinstance(value, torch.Tensor)
            if tensors or type(new) is not type(value) or new != value:
                raise _errors_state.hyperparameter_changed(self.name, where, key, value, new)
            self._values[i] = new


_MISSING = object()


class PinnedGrads:
    """A graph whose replay re-runs Python (the emulation), made to leave ``.grad`` as CUDA does.

    A CUDA replay runs no Python, so the ``.grad`` tensors stay those of the capture, and
    receive the replay's gradients. A re-run of the function binds new ones (``zero_grad()``
    sets them to ``None``, the backward makes new tensors): their values are moved into the
    captured tensors, which are put back.
    """

    def __init__(self, graph: Any, watch: Watch):
        self.graph = graph
        self.watch = watch

    def replay(self) -> None:
        self.graph.replay()
        self.watch.after_replay()
