"""What a function reaches: the modules and optimizers it reads without taking them as
arguments, and where each is bound.

The state is found by following the function's references (closure, globals it names,
default arguments, bound ``self``, attributes), as far as a few levels deep. Where each
module and optimizer was found is kept (``agent.net``, a global, a closure variable), so
that a model or an optimizer rebound there is followed as its replaced state is (see
`_state.state.Binding`).
"""

from __future__ import annotations

import collections
import dis
import functools
import types
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from tensordict import is_tensor_collection
from torch import nn

from .._compat import module_children
from .state import CELLS, LIBRARY, Binding, State, modules_followed

# How far the search for optimizers and modules follows references, and how many objects
# it looks at: enough for agents that hold their networks and optimizers as attributes,
# bounded for functions that reach large object graphs through their globals.
_MAX_DEPTH = 6
_MAX_OBJECTS = 20_000


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
        users = not code.co_filename.startswith(LIBRARY)
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
        # module's own state follows (see `_state.state.module_followed`), as its tensors'.
        for key, value in vars(obj).items():
            if key not in _MODULE_STATE:
                yield key, value, obj.__dict__, key
        for key, value in module_children(obj).items():
            yield key, value, None, None
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        attributes = vars(obj)
        for key, value in attributes.items():
            yield key, value, attributes, key


_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules"})


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code of the functions and comprehensions nested in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _global_names(code: types.CodeType) -> Iterator[str]:
    for each in _code_objects(code):
        yield from each.co_names


def _loaded_globals(code: types.CodeType) -> set[str]:
    """The names that ``code`` reads as globals: `_global_names` holds attribute names too
    (``self.net`` names ``net``), which bind nothing that the function reads."""
    loads = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS")
    return {
        ins.argval
        for each in _code_objects(code)
        for ins in dis.get_instructions(each)
        if ins.opname in loads
    }


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
                    self.depths[parent] > self.depths[child]  # a reference met deeper
                    or _reaches(self.parents, parent, child)  # one reached through the child
                    or _reaches(below, child, parent)  # the walk back reached it from the child
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

    def _reads(self, parent: int, holder: Any, key: Any) -> bool:
        """Whether ``parent`` reads what ``holder[key]`` holds: not so for a function's
        global that its code only names as an attribute."""
        function = self.objects[parent]
        if not isinstance(function, types.FunctionType) or holder is not function.__globals__:
            return True
        if parent not in self._loaded:
            self._loaded[parent] = _loaded_globals(function.__code__)
        return key in self._loaded[parent]


def _reaches(links: dict[int, int] | dict[int, int | None], start: int, target: int) -> bool:
    """Whether ``target`` is ``start`` or is reached from it by following ``links`` (an
    object to the one it was reached from: `Search.parents`, or the walk back of
    `Search.bindings`)."""
    step: int | None = start
    while step is not None:
        if step == target:
            return True
        step = links.get(step)
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
    entries = modules_followed(search.modules)
    bindings = search.bindings(search.modules.values())
    return State(entries, identity=True, bindings=bindings) if entries or bindings else None


def _join(path: str, name: str) -> str:
    if not name or name.startswith("["):
        return path + name
    if name.startswith("_") and path:  # nn.Module internals: `_modules` and the like
        return path
    return f"{path}.{name}" if path else name
