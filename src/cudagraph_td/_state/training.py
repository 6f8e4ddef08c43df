"""Training steps inside a graph: the optimizers and gradients that a capture bakes in.

A function that runs ``loss.backward()`` and ``optimizer.step()`` reads state that is not
among its inputs: the parameters' ``.grad`` tensors, at the addresses the capture recorded,
and the optimizers' hyperparameters, whose Python numbers become constants of the captured
kernels. Nothing at replay re-reads either. ``observe`` finds that state before the
capturing call, and the ``Watch`` it yields checks it before each replay, so that a
gradient set to ``None`` or a Python learning rate changed after the capture raises an error
instead of being silently ignored.

The state is found by following the function's references (closure, globals it names,
default arguments, bound ``self``, attributes), as far as a few levels deep. Where each
module and optimizer was found is kept (``agent.net``, a global, a closure variable), so
that a model or an optimizer rebound there is followed as its replaced state is.
"""

from __future__ import annotations

import collections
import dis
import functools
import operator
import os
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from tensordict import is_tensor_collection
from torch import nn

from .._compat import module_children, version
from .._errors import state as _errors_state
from .state import CELLS, Binding, State, modules_entries, optimizer_entries, rebound

# How far the search for optimizers and modules follows references, and how many objects
# it looks at: enough for agents that hold their networks and optimizers as attributes,
# bounded for functions that reach large object graphs through their globals.
_MAX_DEPTH = 6
_MAX_OBJECTS = 20_000

_grad = operator.attrgetter("grad")


# A reference from one object to another, for the search: the name it adds to the path, the
# object referred to, and where it is bound, if it can be rebound (a holder and a key, see
# `_state.state.Binding`), else `None, None` (a tuple's item, a bound method's `self`).
Reference = tuple[str, Any, Any, Any]


def _references(obj: Any) -> Iterator[Reference]:
    """The objects that ``obj`` refers to, for the search."""
    if isinstance(obj, types.MethodType):
        yield "", obj.__func__, None, None
        yield "self", obj.__self__, None, None
    elif isinstance(obj, types.FunctionType):
        code = obj.__code__
        # The library's own closures (around a TensorDict module, say) are never rebound.
        users = not code.co_filename.startswith(_PACKAGE)
        for var, cell in zip(code.co_freevars, obj.__closure__ or (), strict=True):
            # An empty cell (a variable assigned after the function was made) reads as None.
            yield var, getattr(cell, "cell_contents", None), CELLS if users else None, cell
        for var in _global_names(code):
            if var in obj.__globals__:
                yield var, obj.__globals__[var], obj.__globals__ if users else None, var
        # Default arguments by their parameters' names (`lambda x, a=agent: ...` reads `a`).
        defaults = obj.__defaults__ or ()
        names = code.co_varnames[: code.co_argcount][code.co_argcount - len(defaults) :]
        for var, value in zip(names, defaults, strict=True):
            yield var, value, None, None
        yield "", obj.__kwdefaults__, None, None
        yield "", getattr(obj, "__wrapped__", None), None, None  # functools.wraps, torch.compile
    elif isinstance(obj, functools.partial):
        yield "", obj.func, None, None
        yield "", obj.args, None, None
        yield "", obj.keywords, None, None
    elif isinstance(obj, weakref.ref):
        yield "", obj(), None, None
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield str(key), value, obj, key
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield f"[{i}]", value, obj, i
    elif isinstance(obj, (tuple, set, frozenset)):
        for i, value in enumerate(obj):
            yield f"[{i}]", value, None, None
    elif isinstance(obj, nn.Module):
        # Its attributes, which may hold optimizers; its submodules, whose bindings the
        # module's own state follows (see `_state.state.module_entries`), as its tensors'.
        for key, value in vars(obj).items():
            if key not in _MODULE_STATE:
                yield key, value, obj.__dict__, key
        for key, value in module_children(obj).items():
            yield key, value, None, None
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        attributes = vars(obj)
        for key, value in attributes.items():
            yield key, value, attributes, key


_PACKAGE = os.path.dirname(__file__)
_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules"})


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:  # nested functions and comprehensions
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _loaded_globals(code: types.CodeType) -> set[str]:
    """The names that ``code`` reads as globals: `_global_names` holds attribute names too
    (``self.net`` names ``net``), which bind nothing that the function reads."""
    loads = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS")
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in loads}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _loaded_globals(const)
    return names


def _skipped(obj: Any) -> bool:
    """Objects whose references hold no optimizer of the function: data, types, modules."""
    return (
        obj is None
        or isinstance(obj, (torch.Tensor, type, types.ModuleType, str, bytes, int, float))
        or is_tensor_collection(obj)
    )


class Search:
    """The optimizers and modules that ``root`` reaches, and the references on the way.

    Breadth first, from ``root``: each object is named by its first path, and its depth
    is the length of that path. Each reference met between the objects visited is kept, so
    that `bindings` can tell where the objects found are bound.
    """

    def __init__(self, root: Any):
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.modules: dict[str, nn.Module] = {}
        # Each object visited, by `id`: the object (which keeps its `id` its own), its path,
        # its depth, the object it was first reached from.
        self.objects: dict[int, Any] = {id(root): root}
        self.paths = {id(root): ""}
        self.depths = {id(root): 0}
        self.parents: dict[int, int] = {}
        # The references to each object visited: (the referrer's id, the name, holder, key).
        self.referrers: dict[int, list[tuple[int, str, Any, Any]]] = {}
        self._loaded: dict[int, set[str]] = {}  # the globals that each function reads
        frontier = [root]
        for depth in range(1, _MAX_DEPTH + 1):
            found = []
            for obj in frontier:
                path = self.paths[id(obj)]
                if isinstance(obj, torch.optim.Optimizer):
                    self.optimizers.setdefault(path or "optimizer", obj)
                    continue  # its parameters are found through it; nothing else is needed
                if isinstance(obj, nn.Module):
                    self.modules.setdefault(path or "module", obj)
                for name, ref, holder, key in _references(obj):
                    if _skipped(ref):
                        continue
                    if id(ref) not in self.objects:
                        if len(self.objects) > _MAX_OBJECTS:
                            continue
                        self.objects[id(ref)] = ref
                        self.paths[id(ref)] = _join(path, name)
                        self.depths[id(ref)] = depth
                        self.parents[id(ref)] = id(obj)
                        found.append(ref)
                    self.referrers.setdefault(id(ref), []).append((id(obj), name, holder, key))
            frontier = found

    def bindings(self, targets: Iterable[Any]) -> list[Binding]:
        """Where each of ``targets`` (objects found) is bound, and each object on the way
        to it from the root, where it can be rebound (see `_state.state.Binding`).

        The references followed back from each target are those on a way from the root to
        it: not from an object met deeper than the one it refers to, nor from one reached
        through it (first reached through it by the search, or reached from it by this walk
        back). A module that a function reads as ``agent.net`` and as the global ``net`` is
        bound in both places; a reference back (``net.owner = agent``) binds nothing, nor
        one met deeper (the attribute of a graphed wrapper, held by ``agent``, that reaches
        ``agent.net`` again), nor a global that only has the name of an attribute
        (``self.net`` in a module with a global ``net``).
        """
        todo = collections.deque(id(target) for target in targets)
        # Each object of the walk, and the one it came from (`None` for a target).
        below: dict[int, int | None] = dict.fromkeys(todo)
        found: list[Binding] = []
        while todo:
            child = todo.popleft()
            for parent, name, holder, key in self.referrers.get(child, ()):
                if (
                    self._leads_back(parent, child)
                    or _walked_from(below, child, parent)
                    or not self._reads(parent, holder, key)
                ):
                    continue
                if holder is not None:
                    path = _join(self.paths[parent], name)
                    found.append((path, holder, key, self.objects[child]))
                if parent not in below:
                    below[parent] = child
                    todo.append(parent)
        return found

    def _leads_back(self, parent: int, child: int) -> bool:
        """Whether a reference from ``parent`` to ``child`` is on no way from the root to
        ``child``: ``parent`` met deeper, or reached through ``child`` (or ``child`` itself)."""
        if self.depths[parent] > self.depths[child]:
            return True
        while parent != child:
            if parent not in self.parents:
                return False
            parent = self.parents[parent]
        return True

    def _reads(self, parent: int, holder: Any, key: Any) -> bool:
        """Whether ``parent`` reads what ``holder[key]`` holds: not so for a function's
        global that its code only names as an attribute."""
        function = self.objects[parent]
        if not isinstance(function, types.FunctionType) or holder is not function.__globals__:
            return True
        if parent not in self._loaded:
            self._loaded[parent] = _loaded_globals(function.__code__)
        return key in self._loaded[parent]


def _walked_from(below: dict[int, int | None], obj: int, other: int) -> bool:
    """Whether the walk back of `Search.bindings` reached ``obj`` from ``other``."""
    step: int | None = obj
    while step is not None:
        if step == other:
            return True
        step = below[step]
    return False


def find_state(root: Any) -> tuple[dict[str, torch.optim.Optimizer], dict[str, nn.Module]]:
    """The optimizers and modules that ``root`` reaches, by the name of their first path."""
    search = Search(root)
    return search.optimizers, search.modules


def modules_state(fn: Any) -> State | None:
    """The parameters and buffers of the modules that ``fn`` reaches, followed by address and
    identity (see `_state.state`), and where the modules are bound, or ``None`` if it reaches
    none."""
    search = Search(fn)
    entries = modules_entries(search.modules)
    bindings = search.bindings(search.modules.values())
    return State(entries, identity=True, bindings=bindings) if entries or bindings else None


def _join(path: str, name: str) -> str:
    if not name or name.startswith("["):
        return path + name
    if name.startswith("_") and path:  # nn.Module internals: `_modules` and the like
        return path
    return f"{path}.{name}" if path else name


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
        self._bound = modules_entries(modules)
        self._groups = [
            (group, dict(group)) for opt in optimizers.values() for group in opt.param_groups
        ]
        params: dict[int, tuple[str, torch.Tensor]] = {}
        for path, module in modules.items():
            for pname, p in module.named_parameters():
                params.setdefault(id(p), (f"{path}.{pname}", p))
        for path, opt in optimizers.items():
            for i, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    params.setdefault(id(p), (f"{path}.param_groups[{i}]['params'][{j}]", p))
        self.params = [(name, p) for name, p in params.values() if p.requires_grad]
        self._before = [_state(p) for _, p in self.params]
        self.touched: list[tuple[str, torch.Tensor]] = []
        self.rebinds: list[bool] = []

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
        out = capture()
        # A gradient tensor that the capture replaced by one of its own: the step drops the
        # incoming gradient before it reads it (`zero_grad(set_to_none=True)` inside), so a
        # replay may re-point `.grad` to its own tensor whatever `.grad` is then, as eager
        # mode binds a new one (another step on the same parameters may have rebound it).
        self.rebinds = [
            p.grad is not before and before is not None
            for (_, p), before in zip(self.touched, eager, strict=True)
        ]
        with torch.no_grad():
            for (_, p), before in zip(self.touched, eager, strict=True):
                if p.grad is not before and p.grad is not None and before is not None:
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
        return Watch(name, self.touched, self._stepped(), written, self.rebinds)

    def _stepped(self) -> dict[str, torch.optim.Optimizer]:
        touched = {id(p) for _, p in self.touched}
        return {
            path: opt
            for path, opt in self.optimizers.items()
            if any(id(p) in touched for group in opt.param_groups for p in group["params"])
        }

    def state(self, name: str, *, identity: bool) -> State | None:
        """The state that the captured graph reads (see `_state.state`), as the capture left it, or
        ``None`` if it reads none. A training step's includes its optimizers'."""
        own = rebound(self._bound)
        if own:  # the function rebinds module state at each call: a graph cannot follow
            warnings.warn(
                _errors_state.rebinds_state(name, [entry[0] for entry in own]),
                UserWarning,
                stacklevel=2,
            )
        skipped = {(id(entry[1]), entry[2]) for entry in own}
        entries = [
            entry
            for entry in modules_entries(self.modules)
            if (id(entry[1]), entry[2]) not in skipped
        ]
        stepped = self._stepped() if self.touched else {}
        followed = {id(entry[3]) for entry in entries}
        for path, opt in stepped.items():
            entries += optimizer_entries(path, opt, followed)
        # Where the modules and the stepped optimizers were found, as before the call: a
        # binding that the call itself moved is no more the capture's than `own`'s tensors.
        bindings = self._search.bindings([*self.modules.values(), *stepped.values()])
        moved = rebound(bindings)
        if moved:
            warnings.warn(
                _errors_state.rebinds_state(name, [b[0] for b in moved], "a new object"),
                UserWarning,
                stacklevel=2,
            )
        gone = {id(b) for b in moved}
        bindings = [b for b in bindings if id(b) not in gone]
        if not entries and not bindings:
            return None
        return State(entries, identity=identity, bindings=bindings)


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
    writes, or when a hyperparameter of a stepped optimizer changed.
    """

    def __init__(
        self,
        name: str,
        params: list[tuple[str, torch.Tensor]],
        optimizers: dict[str, torch.optim.Optimizer],
        written: set[tuple[int, str]] = frozenset(),  # type: ignore[assignment]
        rebinds: list[bool] | None = None,
    ):
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.grads = [p.grad for p in self.params]
        # The gradients the step drops before reading (see `Observation.record`).
        self.rebinds = rebinds if rebinds is not None else [False] * len(self.params)
        # (where, group, keys, values): the hyperparameters that each step reads.
        self.groups: list[tuple[str, dict[str, Any], tuple[str, ...], tuple[Any, ...]]] = []
        for path, opt in optimizers.items():
            for i, group in enumerate(opt.param_groups):
                keys = tuple(
                    k
                    for k in opt.defaults
                    if k in group and k != "params" and (id(group), k) not in written
                )
                where = f"`{path}` ({type(opt).__name__}) param_groups[{i}]"
                self.groups.append((where, group, keys, tuple(group[k] for k in keys)))
        self._flatten_groups()

    def _flatten_groups(self) -> None:
        """Every (group, key, value) that ``__call__`` checks, as three parallel lists."""
        self._dicts = [group for _, group, keys, _ in self.groups for _ in keys]
        self._keys = [key for _, _, keys, _ in self.groups for key in keys]
        self._values = [value for _, _, _, values in self.groups for value in values]

    def __call__(self) -> None:
        # Identity checks, mapped in C over flat lists: the common case, where nothing
        # changed, costs no Python loop per parameter, group or hyperparameter.
        if not all(map(operator.is_, map(_grad, self.params), self.grads)):
            self._raise_for_grads()
        try:
            same = all(
                map(operator.is_, map(operator.getitem, self._dicts, self._keys), self._values)
            )
        except KeyError:  # a hyperparameter deleted from its group
            same = False
        if not same:
            for i, (where, group, keys, values) in enumerate(self.groups):
                self._check_group(i, where, group, keys, values)
            self._flatten_groups()

    def after_replay(self) -> None:
        """Put the captured gradient tensors back, with the values the replay computed."""
        with torch.no_grad():
            for p, grad in zip(self.params, self.grads, strict=True):
                if p.grad is not grad:
                    if grad is not None and p.grad is not None:
                        grad.copy_(p.grad)
                    p.grad = grad

    def _raise_for_grads(self) -> None:
        """Re-point the gradients that the step drops before reading to its own tensors;
        raise for another that was replaced."""
        pairs = zip(self.names, self.params, self.grads, self.rebinds, strict=True)
        for name, p, grad, rebinds in pairs:
            if p.grad is not grad:
                if not rebinds:
                    raise _errors_state.grad_replaced(self.name, name, grad, p.grad)
                p.grad = grad

    def _check_group(
        self,
        i: int,
        where: str,
        group: dict[str, Any],
        keys: tuple[str, ...],
        values: tuple[Any, ...],
    ) -> None:
        for key, value in zip(keys, values, strict=True):
            new = group.get(key, _MISSING)
            if new is value:
                continue
            tensors = isinstance(new, torch.Tensor) or isinstance(value, torch.Tensor)
            if tensors or type(new) is not type(value) or new != value:
                raise _errors_state.hyperparameter_changed(self.name, where, key, value, new)
        # Equal values in new objects (a scheduler that wrote the same number): keep checking
        # the new objects, so that the next replay takes the fast path again.
        self.groups[i] = (where, group, keys, tuple(group[k] for k in keys))


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
