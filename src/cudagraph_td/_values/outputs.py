"""A graph's outputs: returned in fresh memory at each call, in the captured structure.

``Outputs`` is built at capture from the recorded result: its treespec, its constants,
and the graph's static output tensors, which every replay overwrites. At each call
``FreshCopies`` copies those tensors into new memory (several small ones into views of
one buffer), and ``Outputs.rebuild`` puts the copies back into the result's structure:
through optree, or, for a result of TensorDicts (``TensorDictResult``), by building them
directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import optree
import torch
from tensordict import TensorDict

from .._compat import as_strided, foreach_copy_, td_entries, td_has_names, td_new_unsafe
from .._errors import inputs as _errors
from . import tree as _tree

# Results of at most this many bytes come back as views of one new buffer per dtype, filled
# by one multi-tensor copy: one allocation and one kernel launch per call instead of one of
# each per output. Larger results are cloned output by output, so that one output kept
# alive does not hold the memory of all the others.
_PACK_LIMIT_BYTES = 1 << 24


class Copies(Protocol):
    """What gives a graph's static output tensors back at each call: copies in fresh memory
    (``FreshCopies``), or tensors lent over them (`_values.borrowed.LentOutputs`)."""

    static: list[torch.Tensor]

    def make(self) -> list[torch.Tensor]: ...

    def one(self) -> torch.Tensor:
        """``make`` for one static tensor: the tensor itself."""
        ...


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
        # Tensors of one dtype and one shape (a step's scalar losses and metrics): stacked
        # and unbound, two calls whatever their number, instead of one view each.
        self._stacked = len(self._groups) == 1 and len({t.shape for t in static}) == 1

    def one(self) -> torch.Tensor:
        return self.static[0].clone()

    def make(self) -> list[torch.Tensor]:
        """Copies of the static tensors, in their order, in a new list at each call."""
        if not self._groups:
            return [t.clone() for t in self.static]
        if self._stacked:
            return [*torch.stack(self.static).unbind()]
        if len(self._groups) == 1:  # one dtype: its views are the copies, in their order
            dtype, numel, _, layouts = self._groups[0]
            fresh = _views(torch.empty(numel, dtype=dtype, device=self.device), layouts)
            foreach_copy_(fresh, self.static)
            return fresh
        fresh = list(self.static)
        for dtype, numel, indices, layouts in self._groups:
            views = _views(torch.empty(numel, dtype=dtype, device=self.device), layouts)
            for i, view in zip(indices, views, strict=True):
                fresh[i] = view
        foreach_copy_(fresh, self.static)
        return fresh


class Outputs:
    """How to turn the graph's static outputs into a result: in fresh memory, or lent by
    ``lent`` (``outputs="borrowed"``: what lends tensors over them, see `_values.borrowed`,
    under the lease of the graph they are the outputs of)."""

    def __init__(
        self,
        name: str,
        out: Any,
        device: torch.device,
        *,
        allow_grad: bool = False,
        lent: Callable[[list[torch.Tensor]], Copies] | None = None,
    ):
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
        self.lent = lent
        self.copies = self.copier(static)
        # A result of TensorDicts and tensors: built without optree (see `TensorDictResult`).
        self.tensordicts = TensorDictResult.of(out) if self.all_tensors else None
        # Other results are rebuilt by optree, which lists a TensorDict's keys sorted: the
        # order the function set them in, where it is another, is given back after.
        self.key_orders = _tree.key_orders(out) if self.tensordicts is None else None

    def copier(self, static: list[torch.Tensor]) -> Copies:
        """What returns ``static`` (some of the static outputs) at each call: copies in fresh
        memory, or lent ones."""
        return FreshCopies(static, self.device) if self.lent is None else self.lent(static)

    @property
    def static(self) -> list[torch.Tensor]:
        """The graph's output tensors, which each replay overwrites."""
        return self.copies.static

    @static.setter
    def static(self, tensors: list[torch.Tensor]) -> None:
        # One list, held by the copier: an old one (a recorded autograd graph's outputs,
        # replaced by their detached views) must not stay alive anywhere.
        self.copies.static = tensors

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The result tree, with ``tensors`` in place of the static output tensors."""
        if self.single_tensor:  # the most common result, without a tree to rebuild
            return tensors[0]
        if self.tensordicts is not None:
            return self.tensordicts.build(tensors)
        leaves: Sequence[Any] = tensors
        if not self.all_tensors:  # the constants, with the tensors in their places
            leaves = list(self.template)
            for i, t in zip(self.tensor_index, tensors, strict=True):
                leaves[i] = t
        result = optree.tree_unflatten(self.spec, leaves)
        if self.key_orders is not None:
            result = _tree.in_key_orders(result, self.key_orders)
        return result


class TensorDictResult:
    """A result of plain TensorDicts and tensors (in tuples, lists, dicts), rebuilt directly:
    one node of it, a TensorDict, tuple, list or dict, with its entries.

    optree rebuilds a TensorDict through a Python function per node (see `_values.tree`),
    which costs about as much as making the TensorDict: each node here makes its TensorDict
    at once, with the captured batch size, device and names. Its keys come in the order
    the function set them, as in the eager result (a treespec holds them sorted).
    """

    def __init__(self, kind: type, entries: Sequence[tuple[Any, _Entry]], td: Any = None):
        self.kind = kind
        self.entries = tuple(entries)  # (key or index, where its value comes from), in order
        # Tensors only (the common result): their indices, read by one plain comprehension.
        indices = [(key, entry) for key, entry in self.entries if isinstance(entry, int)]
        self.indices = tuple(indices) if len(indices) == len(self.entries) else None
        if kind is TensorDict:
            self.new = td_new_unsafe(TensorDict)
            self.batch_size = td.batch_size
            self.device = td.device
            self.names = tuple(td.names) if td_has_names(td) else None

    @classmethod
    def of(cls, out: Any) -> TensorDictResult | None:
        """The builder of results like ``out``, if ``out`` holds a TensorDict and its every
        node is a tensor, a plain TensorDict, a tuple, a list or a dict."""
        index = {path: i for i, path in enumerate(_tree.leaf_keys(out))}
        node = _node(out, (), index)
        return node if isinstance(node, TensorDictResult) and node.holds_tensordict() else None

    def holds_tensordict(self) -> bool:
        return self.kind is TensorDict or any(
            isinstance(entry, TensorDictResult) and entry.holds_tensordict()
            for _, entry in self.entries
        )

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The result, with ``tensors`` (in the order of the output tensors) as its tensors."""
        if self.indices is not None:
            values = {key: tensors[i] for key, i in self.indices}
        else:
            values = {
                key: tensors[entry] if isinstance(entry, int) else entry.build(tensors)
                for key, entry in self.entries
            }
        if self.kind is TensorDict:
            # The entries as they are (nested=False): no dict among them to make a TensorDict of.
            return self.new(
                source=values,
                batch_size=self.batch_size,
                device=self.device,
                names=self.names,
                nested=False,
            )
        if self.kind is dict:
            return values
        return self.kind(values.values())


def _node(tree: Any, path: tuple[Any, ...], index: dict[tuple[Any, ...], int]) -> _Entry | None:
    """Where ``tree``, at ``path`` in the result, comes from; None where no node builds it."""
    if isinstance(tree, torch.Tensor):
        return index[path]
    items: list[tuple[Any, Any]]
    if type(tree) is TensorDict:
        items = list(td_entries(tree).items())  # in the order the function set them
    elif type(tree) in (tuple, list):
        items = list(enumerate(tree))
    elif type(tree) is dict:
        items = list(tree.items())
    else:  # a subclass, a lazy stack, a tensorclass, a non-tensor entry, a constant, None
        return None
    entries = []
    for key, value in items:
        entry = _node(value, (*path, key), index)
        if entry is None:
            return None
        entries.append((key, entry))
    return TensorDictResult(type(tree), entries, tree)


# Where a value of the result comes from: its index among the output tensors, or the node
# that builds it.
_Entry = int | TensorDictResult


# Where a view lies in its buffer: (shape, strides, offset in elements).
_Layout = tuple[torch.Size, tuple[int, ...], int]


def _views(flat: torch.Tensor, layouts: list[_Layout]) -> list[torch.Tensor]:
    """Views of ``flat`` laid out as ``layouts``: one ``as_strided`` each, the cheapest view."""
    return [as_strided(flat, shape, strides, offset) for shape, strides, offset in layouts]
