"""Outputs that are inputs, or views of inputs: returned as eager mode returns them.

A function may return one of its input tensors (``lambda x: x``) or a view of one
(``x[:, :2]``, ``x.t()``). An eager call returns the caller's tensor, or a view of its
memory; a graph's output is the graph's own copy of that input, or a view of it, and a
replay would return a copy. ``InputViews`` is read at capture from the capturing call's eager
result, which ran on the caller's tensors: which outputs are one of them or lie in its
memory, and where. Each later call's result then takes, there, the caller's tensor itself,
or the same view of it (one ``as_strided``), so that a write into the result reaches the
input on every call, as on the warm-up and capturing calls. A graph without such outputs
has no ``InputViews``: its calls do nothing more.

A view is taken at the capture's strides and offset from the caller's tensor: a call whose
tensor is laid out otherwise (a transposed tensor, where the capture had a contiguous one)
is refused, since no view of the same elements can be named in another layout (eager's
``x.view`` fails there, its ``reshape`` copies).

A function may also return one of its TensorDict arguments, alone or in a returned tuple
(``ReturnedTensorDicts``, below): every call returns the caller's TensorDict, the entries
the function wrote set into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from .._compat import as_strided
from .._errors import inputs as _errors
from . import tree as _tree
from .aliasing import span
from .signature import Signature
from .storages import address as storage_address
from .storages import addresses

# Output j as input i itself: (j, i).
_Same = tuple[int, int]
# Output j as a view of input i: (j, i, shape, strides, offset from the input's, the input's
# strides at capture, whether the view is detached from the input's autograd graph).
_View = tuple[int, int, torch.Size, tuple[int, ...], int, tuple[int, ...], bool]


class InputViews:
    """The outputs that are the caller's input tensors or views of them (by index among the
    output tensors), and how to take them from a call's inputs."""

    def __init__(self, signature: Signature, out_paths: list[str], n_outputs: int):
        self.same: list[_Same] = []
        self.views: list[_View] = []
        # The other outputs, which the graph computes (by index among the output tensors).
        self.computed: list[int] = []
        self._signature = signature
        self._out_paths = out_paths
        self._n_outputs = n_outputs

    @classmethod
    def of(
        cls, signature: Signature, result: Any, inputs: Sequence[torch.Tensor]
    ) -> InputViews | None:
        """The outputs of ``result``, the eager result of a call on ``inputs`` (the caller's
        tensors), that are inputs or lie in their memory; None if none does (the common case).

        Raises:
            ValueError: An output lies in an input's memory but is no view that can be taken
                again (another dtype, or memory outside the input).
        """
        tensors = [
            (path, leaf)
            for path, leaf in _tree.leaves_with_paths(result, root="output")
            if isinstance(leaf, torch.Tensor)
        ]
        storages = addresses(inputs)
        views = cls(signature, [path for path, _ in tensors], len(tensors))
        for j, (path, out) in enumerate(tensors):
            address = storage_address(out)
            sharing = [i for i, s in enumerate(storages) if address and s == address]
            if not sharing:
                continue
            same = [i for i in sharing if inputs[i] is out]
            if same:
                views.same.append((j, same[0]))
                continue
            start, end = span(out)
            within = [i for i in sharing if _within(start, end, inputs[i])]
            if not within or out.dtype != inputs[within[0]].dtype:
                paths = signature.tensor_paths()
                raise _errors.untakeable_input_view(signature.name, path, paths[sharing[0]])
            i = within[0]
            t = inputs[i]
            detach = t.requires_grad and not out.requires_grad  # `x.detach()`, `x.data`
            offset = int(out.storage_offset() - t.storage_offset())
            views.views.append((j, i, out.shape, out.stride(), offset, t.stride(), detach))
        if not views.same and not views.views:
            return None
        taken = {j for j, _ in views.same} | {view[0] for view in views.views}
        views.computed = [j for j in range(len(tensors)) if j not in taken]
        return views

    def first(self) -> tuple[str, str]:
        """The paths of the first output that is an input or a view of one, and of that input."""
        j, i = min([(j, i) for j, i in self.same] + [(view[0], view[1]) for view in self.views])
        return self._out_paths[j], self._signature.tensor_paths()[i]

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raise if a call's input is laid out otherwise than the capture's, where an output
        is a view of it.

        Raises:
            InputMismatchError: Such an input has other strides than at the capture.
        """
        for j, i, _, _, _, strides, _ in self.views:
            received = tensors[i].stride()
            if received != strides:
                paths = self._signature.tensor_paths()
                raise _errors.input_view_layout(
                    self._signature.name, self._out_paths[j], paths[i], strides, received
                )

    def result(
        self, computed: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The output tensors of a call on ``tensors`` (checked), from the ``computed`` ones
        (in fresh memory, in the order of `computed`) and the call's own inputs."""
        result: list[Any] = [None] * self._n_outputs
        for j, t in zip(self.computed, computed, strict=True):
            result[j] = t
        for j, i in self.same:
            result[j] = tensors[i]
        for j, i, shape, strides, offset, _, detach in self.views:
            t = tensors[i].detach() if detach else tensors[i]
            result[j] = as_strided(t, shape, strides, t.storage_offset() + offset)
        return result


def _within(start: int, end: int, t: torch.Tensor) -> bool:
    """Whether the bytes from ``start`` to ``end`` lie in ``t``'s span."""
    t_start, t_end = span(t)
    return t_start <= start and end <= t_end


# Results that are the caller's TensorDicts ---------------------------------------------------
#
# A function may return one of its TensorDict arguments (``td["y"] = net(td["x"]);
# return td``, ``lambda td: td``), alone or as an item of a returned tuple (``td, loss``).
# An eager call returns the caller's TensorDict, with the function's writes; a graph would
# return a new one. ``ReturnedTensorDicts`` is read at capture from the capturing call's
# eager result: the graph then returns, in the TensorDict's place, the written-input form
# of the TensorDict-module layer (`_call.tdmodule`): a marker naming the argument, and the
# entries the function wrote (new keys, and keys rebound to other tensors); each call sets
# those into the caller's TensorDict (`into_callers`), which it returns.

# An argument of the call: its index among the positional ones, or a keyword's name.
_Argument = int | str


@dataclass(frozen=True)
class WrittenInput:
    """The marker of the written-input form, ``(WrittenInput(argument), entries)``: the
    result is the call's TensorDict ``argument``, with ``entries`` written into it. The
    one marker of "returned its input TensorDict": ``argument`` None marks the TensorDict a
    TensorDict module was called with, which its layer writes (see `recording_writes`)."""

    argument: _Argument | None

    def __repr__(self) -> str:
        if self.argument is None:
            return "<the module's input TensorDict>"
        return f"<the caller's TensorDict {self.argument!r}>"


def tensordicts_before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[_Argument, Any]:
    """The entries of each TensorDict argument before a call (for `ReturnedTensorDicts.of`)."""
    arguments: list[tuple[_Argument, Any]] = [*enumerate(args), *kwargs.items()]
    return {
        where: (value, _entries(value))
        for where, value in arguments
        if isinstance(value, TensorDictBase)
    }


def _entries(td: TensorDictBase) -> dict[Any, Any]:
    """The leaves of ``td`` by key, nested keys included."""
    return dict(td.items(include_nested=True, leaves_only=True))


def _written(td: TensorDictBase, before: dict[Any, Any]) -> list[Any]:
    """The keys that a call wrote into ``td`` (new keys, and keys rebound to other tensors,
    such as a recurrent state); ``before``: its `_entries` before the call."""
    return [key for key, value in _entries(td).items() if before.get(key) is not value]


class ReturnedTensorDicts:
    """Where a function's result is one of the call's TensorDict arguments: the place in the
    result (``None``: the whole result; else an index of the returned tuple), the argument,
    and the keys it wrote there."""

    def __init__(self, places: list[tuple[int | None, _Argument, list[Any]]]):
        self.places = places

    @classmethod
    def of(cls, result: Any, before: dict[_Argument, Any]) -> ReturnedTensorDicts | None:
        """The TensorDict arguments that ``result``, an eager result, returns; ``before``:
        their entries before the call (`tensordicts_before`). None if none (the common case)."""
        if not before:
            return None
        items: list[tuple[int | None, Any]] = [(None, result)]
        if type(result) is tuple:
            items = list(enumerate(result))
        places: list[tuple[int | None, _Argument, list[Any]]] = []
        for place, item in items:
            for where, (td, entries) in before.items():
                if item is td:
                    places.append((place, where, _written(td, entries)))
                    break
        return cls(places) if places else None

    def form(self, result: Any) -> Any:
        """``result`` with each TensorDict argument it returns in the written-input form."""
        if self.places[0][0] is None:
            _, where, written = self.places[0]
            return (WrittenInput(where), result.select(*written))
        items = list(result)
        for place, where, written in self.places:
            assert place is not None
            items[place] = (WrittenInput(where), items[place].select(*written))
        return tuple(items)

    def graphed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its result in the written-input form: the function a graph captures."""

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.form(fn(*args, **kwargs))

        return call


def is_written_input(value: Any) -> bool:
    """Whether ``value`` is in the written-input form."""
    return type(value) is tuple and len(value) == 2 and isinstance(value[0], WrittenInput)


def into_callers(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
    """A graph's ``result`` with each written-input form replaced by the caller's
    TensorDict, its entries set: what the function returned eagerly."""
    if is_written_input(result):
        return _into_caller(args, kwargs, result)
    if type(result) is tuple and any(map(is_written_input, result)):
        return tuple(_into_caller(args, kwargs, i) if is_written_input(i) else i for i in result)
    return result


def _into_caller(args: tuple[Any, ...], kwargs: dict[str, Any], written: Any) -> Any:
    where = written[0].argument
    if where is None:  # a TensorDict module's: its layer writes it (see `recording_writes`)
        return written
    td = args[where] if isinstance(where, int) else kwargs[where]
    return td.update(written[1])


# The TensorDict-module layer's form (see `_call.tdmodule`): a module called with a
# TensorDict of its in_keys entries that returns that TensorDict gives the layer the entries
# it wrote, which the layer sets into the caller's TensorDict (or ``tensordict_out``).

MODULE_INPUT = WrittenInput(None)
"""The marker of a TensorDict module's written-input form (see `recording_writes`)."""


def is_module_input(value: Any) -> bool:
    """Whether ``value`` is a TensorDict module's written-input form."""
    return is_written_input(value) and value[0].argument is None


def recording_writes(module: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a TensorDict module so that "returned its input" becomes an explicit result.

    When ``module(td, ...)`` returns ``td`` itself, the wrapper returns
    ``(MODULE_INPUT, entries)``, where ``entries`` holds the entries that the call wrote
    (see `_written`). The graph then treats them as outputs, returned in fresh memory at
    each replay, and the layer sets them where the module call puts them.
    """

    def call(td: Any, *args: Any, **kwargs: Any) -> Any:
        before = _entries(td)
        out = module(td, *args, **kwargs)
        if out is not td:
            return out
        return (MODULE_INPUT, td.select(*_written(td, before)))

    return call
