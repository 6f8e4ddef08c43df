"""The state around a graph: the parameters, buffers and optimizer state that it reads.

A graph reads more than its inputs: the parameters and buffers of the modules its function
uses and, for a training step, its optimizers' state, each at the address it had at
capture. Updated in place (an optimizer step, ``load_state_dict``, ``copy_``), they flow
through the graph. Replaced (an attribute rebound, ``load_state_dict(assign=True)``,
``param.data = ...``, ``module.to(...)``, ``optimizer.load_state_dict(...)``), the graph
would keep reading the old memory. So would a graph whose modules or optimizers themselves
were replaced where the function finds them (a resume that binds a new model and optimizer
to ``agent.net``, ``agent.opt``, a global or a closure variable). ``State`` holds where each
piece was found and what it was at capture; its ``fresh()`` tells, before each replay,
whether all of it is still there. When not, the graph is captured again, with a
``RecaptureWarning``.

Host state that the capture baked in is followed the same way: the ``requires_grad`` flags
that decide what a graph captured in grad mode computes (see `Flags`), and the number of
parameter groups of a training step's optimizers, and of parameters in each
(``add_param_group``).
"""

from __future__ import annotations

import itertools
import operator
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from typing import Any, Literal, NamedTuple

import tensordict
import torch
from torch import nn

from .._compat import module_buffers, module_children, module_parameters
from .._errors import state as _errors_state

# Where a piece of state is bound: its path (for messages), the dict that holds it, its key
# there, and what the key held at capture. The dict is a module's `_parameters`, `_buffers`
# or `__dict__`, an optimizer's `__dict__` (for its `state` and `param_groups`), or a dict of
# its own for a tensor that nothing else binds (its address is still followed).
Followed = tuple[str, Mapping[Any, Any], Any, Any]

# A list whose length a graph bakes in: its path (for messages), the list, and what it says of
# a change (an optimizer's `param_groups`, and each group's `params`).
Lengths = tuple[str, Sized, str]

# Whose `requires_grad` flags a graph follows, by what it does with them:
# - "step", a training step: every parameter's, and any other tensor's that requires grad. A
#   layer frozen gets no gradient, and no optimizer step, in eager mode; one unfrozen does.
# - "frozen", any other graph captured in grad mode: the parameters that did not require grad
#   at capture. One unfrozen needs gradients that the graph never computes. One frozen after
#   the capture needs nothing: the graph's autograd node takes the parameters as inputs, and
#   autograd drops the gradients of those that no longer require grad, as in eager mode.
Flags = Literal["step", "frozen"]

# Where a module or optimizer that a graph reads was found, or an object on the way to it
# from the function: its path, the holder that binds it (a dict: an object's `__dict__`, a
# function's globals, a dict's entry; a list; `CELLS` for a closure variable), its key there,
# and what the key held at capture. See `_state.search.Search.bindings`.
Binding = tuple[str, Any, Any, Any]

_data_ptr = torch.Tensor.data_ptr
getitem: Callable[[Any, Any], Any] = operator.getitem  # a holder is a dict, a list or `CELLS`


class Change(NamedTuple):
    """A piece of state changed since the capture: its path, as messages show it, and its
    cause (a key of `_errors.state.CAUSES`: "replaced", "rebound", "children", "flag",
    "lengths"), which says what the warning explains."""

    path: str
    cause: str


class RecaptureWarning(UserWarning):
    """A graph was captured again: state that it reads changed after its capture (a tensor
    or a module replaced, a ``requires_grad`` flag, an optimizer's parameter groups).

    Turned into an error (``warnings.simplefilter("error", RecaptureWarning)``), it refuses
    the call instead, and leaves the graph as it was: no call returns a stale result.
    """


RecaptureWarning.__module__ = "cudagraph_td"  # where users import it from


def module_followed(path: str, module: nn.Module) -> Iterator[Followed]:
    """The submodules, parameters, buffers and tensor attributes (``self.scale =
    torch.ones(3)``, neither parameter nor buffer) of ``module`` and of its submodules,
    where each is bound."""
    for name, sub in module.named_modules():
        where = path + "".join(map(_part, name.split("."))) if name else path
        children = module_children(sub)
        for key, child in children.items():
            yield where + _part(key), children, key, child
        for holder in (module_parameters(sub), module_buffers(sub), sub.__dict__):
            for key, value in holder.items():
                if isinstance(value, torch.Tensor):
                    yield f"{where}.{key}", holder, key, value


def modules_followed(modules: Mapping[str, nn.Module]) -> list[Followed]:
    """The state followed in each of ``modules`` (by path), as ``module_followed`` lists it."""
    return [entry for path, module in modules.items() for entry in module_followed(path, module)]


def _part(name: str) -> str:
    """A submodule's name in a path: ``[0]`` for an index (a Sequential's), else ``.name``."""
    return f"[{name}]" if name.isdigit() else f".{name}"


def optimizer_params(
    path: str, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors that ``optimizer`` steps, each with its path."""
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            yield f"{path}.param_groups[{i}]['params'][{j}]", p


def optimizer_followed(
    path: str, optimizer: torch.optim.Optimizer, followed: set[int]
) -> Iterator[Followed]:
    """An optimizer's ``state`` and ``param_groups`` (``load_state_dict`` replaces both), and
    the tensors it steps that are not ``followed`` already (by ``id``: those of the modules),
    each in a dict of its own: their addresses are followed."""
    for key in ("state", "param_groups"):
        yield f"{path}.{key}", optimizer.__dict__, key, optimizer.__dict__[key]
    for where, p in optimizer_params(path, optimizer):
        if id(p) not in followed:
            yield where, {0: p}, 0, p


def optimizer_lengths(path: str, optimizer: torch.optim.Optimizer) -> Iterator[Lengths]:
    """The lists of ``optimizer`` whose lengths its step bakes in: its ``param_groups``
    (``add_param_group`` appends one) and each group's ``params``."""
    yield f"{path}.param_groups", optimizer.param_groups, "a group added or removed"
    for i, group in enumerate(optimizer.param_groups):
        where = f"{path}.param_groups[{i}]['params']"
        yield where, group["params"], "parameters added or removed"


class _Cells:
    """Closure cells as one holder: ``CELLS[cell]`` is what the cell's variable holds now.

    A closure variable is then followed as a dict entry is, by ``holder[key]``: a cell is no
    mapping, and a holder of its own per cell would cost an object each. An empty cell (the
    variable deleted, ``del x``) raises ``ValueError``.
    """

    # In C all the way, as a dict's: a `staticmethod` is called with the key alone, and
    # `attrgetter` reads `cell.cell_contents` (a method in Python costs ~30 ns more a cell).
    __getitem__ = staticmethod(operator.attrgetter("cell_contents"))


CELLS = _Cells()


def held(holder: Any, key: Any) -> Any:
    """What ``holder[key]`` holds now, or ``None`` where nothing is there any more."""
    try:
        return holder[key]
    except (LookupError, TypeError, ValueError):  # ValueError: an empty cell
        return None


def rebound(entries: Sequence[Followed | Binding]) -> list[Followed | Binding]:
    """The ``entries`` whose holder holds another object than when they were listed."""
    return [entry for entry in entries if held(entry[1], entry[2]) is not entry[3]]


class State:
    """The state a captured graph reads besides its inputs, and whether it is still there.

    Tensors are followed by address (the ``data_ptr`` of what their dict holds now) and, for
    a graph that hands them to autograd or steps them (``identity``), by identity too; the
    submodules of each module by identity, as the whole list of a module's children (one
    added or removed changes what a ``Sequential`` runs); an optimizer's ``state`` and
    ``param_groups`` by identity; the ``bindings`` where the modules and optimizers were
    found, and those of the objects on the way to them, by identity (another object bound
    there is another model or optimizer, whose state the graph never read). A graph captured
    in grad mode follows ``requires_grad`` flags too (``flags``, see `Flags`), and a training
    step the ``lengths`` of its optimizers' lists (see `optimizer_lengths`): both read from the
    capture's objects, which such a graph then follows by identity.
    """

    def __init__(
        self,
        entries: list[Followed],
        *,
        identity: bool,
        bindings: Sequence[Binding] = (),
        flags: Flags | None = None,
        lengths: Sequence[Lengths] = (),
    ):
        unique: dict[tuple[int, Any], Followed] = {}
        for entry in entries:  # a tensor bound twice (shared weights) is followed once
            unique.setdefault((id(entry[1]), entry[2]), entry)
        self.followed = [(*entry, _address(entry[3])) for entry in unique.values()]
        self.bindings = [*{_slot(b): b for b in bindings if _slot(b) not in unique}.values()]
        tensors = [e for e in self.followed if e[4] is not None]
        modules = [e for e in self.followed if isinstance(e[3], nn.Module)]
        others = [e for e in self.followed if e[4] is None and not isinstance(e[3], nn.Module)]
        # Each module's children, whole: (where, their dict, its values at capture).
        self.children = [
            (e[0].removesuffix(_part(e[2])), e[1], [*e[1].values()])
            for e in {id(e[1]): e for e in modules}.values()
        ]
        # Each tensor whose `requires_grad` is followed, with its flag at capture.
        self.flags = [(e, e[3].requires_grad) for e in tensors if _flag_followed(e[3], flags)]
        self.lengths = [(*each, len(each[1])) for each in lengths]
        # Flags and lengths are read from the objects of the capture: those must still be there.
        identity = self.identity = identity or bool(self.flags or self.lengths)
        followed: list[Any] = [*others, *self.bindings]  # by identity, whatever `identity`
        self.fresh: Callable[[], bool] = _fresh_check(
            tensors, followed, self.children, self.flags, self.lengths, identity=identity
        )

    def changes(self) -> list[Change]:
        """The state changed since the capture (none while ``fresh()``)."""
        # A model or optimizer rebound (`agent.net`) first: the old one's state, unchanged, is
        # not named.
        changed = [Change(path, "rebound") for path, *_ in rebound(self.bindings)]
        for path, holder, key, value, address in self.followed:
            now = holder.get(key)
            if ((address is None or self.identity) and now is not value) or (
                address is not None and _address(now) != address
            ):
                changed.append(Change(path, "replaced"))
        for where, children, before in self.children:
            if len(children) != len(before):
                changed.append(Change(f"{where} (submodules added or removed)", "children"))
        if changed:  # the flags of replaced tensors are no news
            return changed
        for (path, _, _, tensor, _), flag in self.flags:
            if tensor.requires_grad is not flag:
                changed.append(Change(f"{path}.requires_grad (set to {not flag})", "flag"))
        for path, sized, what, length in self.lengths:
            if len(sized) != length:
                changed.append(Change(f"{path} ({what})", "lengths"))
        return changed

    def recapture(self, name: str) -> str:
        """Warn that the graph of ``name`` is captured again, naming the state changed and
        why that needs a new graph; return the paths changed, for the log's one line."""
        changes = self.changes()
        message = _errors_state.recaptured(name, changes)
        warnings.warn(message, RecaptureWarning, stacklevel=_caller_level())
        return _errors_state.changed_paths(changes)


def _flag_followed(tensor: torch.Tensor, flags: Flags | None) -> bool:
    """Whether a graph that follows ``flags`` (see `Flags`) follows ``tensor``'s."""
    parameter = isinstance(tensor, nn.Parameter)
    if flags == "step":
        return parameter or tensor.requires_grad
    return flags == "frozen" and parameter and not tensor.requires_grad


def _slot(binding: Binding) -> tuple[int, Any]:
    """Where ``binding`` is: its holder, and its key (a cell, unhashable, by ``id``)."""
    holder, key = binding[1], binding[2]
    return id(holder), id(key) if holder is CELLS else key


def _address(value: Any) -> int | None:
    return _data_ptr(value) if isinstance(value, torch.Tensor) else None


def _fresh_check(
    tensors: list[tuple[str, Mapping[Any, Any], Any, Any, int | None]],
    followed: list[Any],
    children: list[tuple[str, Mapping[Any, Any], list[nn.Module]]],
    flags: list[tuple[Any, bool]],
    lengths: list[tuple[str, Sized, str, int]],
    *,
    identity: bool,
) -> Callable[[], bool]:
    """``State.fresh``: a closure over flat lists (no reference to the State, so no cycle).

    What the holders of the ``tensors`` and of the ``followed`` objects hold is gathered
    and mapped in C (no Python loop per tensor or module): the tensors' addresses are
    compared with those at capture, the ``children`` dicts' values with the modules they
    held (by identity: `nn.Module` defines no ``==``), both in one list, and the objects
    followed by identity (all, for an ``identity`` graph, else the ``followed`` ones) with
    ``operator.is_``. A holder is a dict, or a list or `CELLS` for a binding (see
    `Binding`). An ``identity`` graph compares, in the same list as the addresses, the
    ``requires_grad`` of the tensors of ``flags`` and the lengths of the lists of
    ``lengths``: read from the capture's objects, once their identities hold.

    Four forms, each the fastest for its case: addresses only (an inference graph that
    follows no object by identity); addresses, then identities, each from lists of their
    own (no list to slice); one list of all that the holders hold, for an ``identity``
    graph, whose tensors are followed both ways, with or without flags and lengths (each
    empty ``map`` would cost ~60 ns a call). (torch's C++ helper for addresses,
    ``torch._C._tensors_data_ptrs_at_indices_equal``, measured slower on the H100 at every
    count from 1 to 64 tensors: its three list arguments cost more than the comparison it
    saves.)
    """
    count = len(tensors)
    bound = tensors + followed
    holders = [e[1] for e in bound]
    keys = [e[2] for e in bound]
    objects = [e[3] for e in (bound if identity else followed)]
    dicts = [each[1] for each in children]
    flagged = [e[3] for e, _ in flags]
    lists = [each[1] for each in lengths]
    expected = [
        *(e[4] for e in tensors),
        *(module for each in children for module in each[2]),
        *(flag for _, flag in flags),
        *(each[3] for each in lengths),
    ]
    if flags or lengths:  # read from the capture's objects: an `identity` graph's

        def fresh_same_and_flagged() -> bool:
            try:
                held = [*map(getitem, holders, keys)]
                return [
                    *map(_data_ptr, held[:count]),
                    *_chain(map(_values, dicts)),
                    *map(_requires_grad, flagged),
                    *map(len, lists),
                ] == expected and all(map(is_, held, objects))
            except _GONE:
                return False

        assert identity, "flags and lengths are read by identity"
        return fresh_same_and_flagged

    if identity:

        def fresh_and_same() -> bool:
            try:
                held = [*map(getitem, holders, keys)]
                return [
                    *map(_data_ptr, held[:count]),
                    *_chain(map(_values, dicts)),
                ] == expected and all(map(is_, held, objects))
            except _GONE:
                return False

        return fresh_and_same

    if count == len(holders):  # addresses only (and the children)

        def fresh() -> bool:
            try:
                return [
                    *map(_data_ptr, map(getitem, holders, keys)),
                    *_chain(map(_values, dicts)),
                ] == expected
            except _GONE:  # deleted, set to None or to another type, emptied
                return False

        return fresh

    # The tensors by address, the others by identity: no list to slice.
    tensor_holders, tensor_keys = holders[:count], keys[:count]
    other_holders, other_keys = holders[count:], keys[count:]

    def fresh_and_bound() -> bool:
        try:
            return [
                *map(_data_ptr, map(getitem, tensor_holders, tensor_keys)),
                *_chain(map(_values, dicts)),
            ] == expected and all(map(is_, map(getitem, other_holders, other_keys), objects))
        except _GONE:
            return False

    return fresh_and_bound


# What reading a replaced piece of state raises: a key deleted, an empty cell, a tensor set
# to None or another type, a tensor without storage (whose address torch refuses).
_GONE = (LookupError, TypeError, ValueError, RuntimeError)
is_ = operator.is_
_chain = itertools.chain.from_iterable
_values: Callable[[Any], Any] = dict.values  # the children dicts are `_modules` dicts
_requires_grad = operator.attrgetter("requires_grad")


# The library's own sources: the package's root (this module's parent folder).
LIBRARY = os.path.dirname(os.path.dirname(__file__)) + os.sep
# The packages whose frames stand between the user's call and a warning.
_PACKAGES = (LIBRARY, os.path.dirname(tensordict.__file__) + os.sep)


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside this package and tensordict's (whose
    ``dispatch`` calls it for a TensorDict module): a warning then points at the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGES):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level
