"""Pytrees of call arguments and results: flattening, TensorDict nodes, readable leaf paths.

Trees are flattened with optree in the library's own namespace, ``NAMESPACE``. TensorDict
types are registered there (never in torch's global pytree registry), so that a TensorDict's
entries become leaves of the tree and its batch size, device and keys become part of the
treespec: comparing two treespecs then compares the whole structure of two calls at once.

optree matches node types exactly, and tensorclasses are user-defined types, so tensor
collections are registered lazily, the first time ``flatten`` meets their type.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from tensordict.base import is_tensor_collection
from tensordict.tensorclass import NonTensorData

from .. import _compat

NAMESPACE = "cudagraph_td"
"""The optree namespace in which the library registers tensor collections."""

_registered: set[type] = set()
# optree's annotations want a Collection type and typed callables; tensor collections are
# neither, so the registration goes through an untyped handle.
_register_node: Any = optree.register_pytree_node


class _TensorDictMeta(NamedTuple):
    """What a TensorDict node keeps in its treespec, besides its entries."""

    keys: tuple[str, ...]
    batch_size: torch.Size
    device: torch.device | None
    names: tuple[str | None, ...] | None


def _flatten_tensordict(td: TensorDictBase) -> tuple[list[Any], _TensorDictMeta, tuple[str, ...]]:
    # Sorted, as optree sorts a dict's keys: the order in which entries were set is not part
    # of a TensorDict's structure, and two calls that differ only by it are the same call.
    keys = tuple(sorted(td.keys()))
    # NonTensorData entries come wrapped, so that they stay nodes of the tree.
    children = [_compat.td_get(td, key) for key in keys]
    return children, _TensorDictMeta(keys, td.batch_size, td.device, _names(td)), keys


def _names(td: TensorDictBase) -> tuple[str | None, ...] | None:
    """A TensorDict's dim names; None where it has none."""
    return tuple(td.names) if _compat.td_has_names(td) else None


def _unflatten_tensordict(cls: type, meta: _TensorDictMeta, children: Any) -> TensorDictBase:
    return _compat.td_new_unsafe(cls)(  # type: ignore[no-any-return]
        source=dict(zip(meta.keys, children, strict=True)),
        batch_size=meta.batch_size,
        device=meta.device,
        names=meta.names,
    )


def _flatten_lazy_stack(td: LazyStackedTensorDict) -> tuple[list[Any], tuple[int, type], None]:
    return list(td.tensordicts), (td.stack_dim, type(td)), None


def _unflatten_lazy_stack(
    cls: type, meta: tuple[int, type], children: Any
) -> LazyStackedTensorDict:
    stack_dim, _ = meta
    return cls(*children, stack_dim=stack_dim)  # type: ignore[no-any-return]


class _TensorClassMeta(NamedTuple):
    tensor_keys: tuple[str, ...]
    other_keys: tuple[str, ...]
    batch_size: torch.Size
    device: torch.device | None


def _flatten_tensorclass(tc: Any) -> tuple[list[Any], _TensorClassMeta, tuple[str, ...]]:
    td, others = _compat.tensorclass_parts(tc)
    tensor_keys = tuple(sorted(td.keys()))
    other_keys = tuple(others)
    children = [_compat.td_get(td, key) for key in tensor_keys]
    children += [others[key] for key in other_keys]
    meta = _TensorClassMeta(tensor_keys, other_keys, td.batch_size, td.device)
    return children, meta, tensor_keys + other_keys


def _unflatten_tensorclass(cls: type, meta: _TensorClassMeta, children: Any) -> Any:
    children = list(children)
    n = len(meta.tensor_keys)
    source = _compat.td_new_unsafe(TensorDict)(
        source=dict(zip(meta.tensor_keys, children[:n], strict=True)),
        batch_size=meta.batch_size,
        device=meta.device,
    )
    others = dict(zip(meta.other_keys, children[n:], strict=True))
    return _compat.tensorclass_new(cls, source, others)


class _NonTensorMeta(NamedTuple):
    batch_size: torch.Size
    device: torch.device | None


def _flatten_non_tensor(data: NonTensorData) -> tuple[list[Any], _NonTensorMeta, None]:
    # One child, the wrapped value: a constant leaf that the call checks like any other.
    return [data.data], _NonTensorMeta(data.batch_size, data.device), None


def _unflatten_non_tensor(cls: type, meta: _NonTensorMeta, children: Any) -> NonTensorData:
    (value,) = children
    return cls(data=value, batch_size=meta.batch_size, device=meta.device)  # type: ignore[no-any-return]


class TensorDictKeyEntry(optree.MappingEntry):  # type: ignore[type-arg]
    """Path entry of a TensorDict key; consecutive ones print as one nested key."""


class NonTensorEntry(optree.GetAttrEntry):
    """Path entry of the value that a ``NonTensorData`` wraps; it prints as nothing."""


# Each kind of tensor collection: its flatten and unflatten functions and the type of the path
# entries of its children. The first kind that a type is a subclass of is its kind: a lazy
# stack is a TensorDictBase too, and what is none of the first three is a tensorclass.
_KINDS: tuple[tuple[type, Callable[..., Any], Callable[..., Any], type], ...] = (
    (NonTensorData, _flatten_non_tensor, _unflatten_non_tensor, NonTensorEntry),
    (LazyStackedTensorDict, _flatten_lazy_stack, _unflatten_lazy_stack, optree.SequenceEntry),
    (TensorDictBase, _flatten_tensordict, _unflatten_tensordict, TensorDictKeyEntry),
    (object, _flatten_tensorclass, _unflatten_tensorclass, optree.GetAttrEntry),
)


def register(cls: type) -> None:
    """Register a tensor collection type as a pytree node in ``NAMESPACE``."""
    if cls in _registered:
        return
    _, flatten, unflatten, entry = next(kind for kind in _KINDS if issubclass(cls, kind[0]))
    _register_node(
        cls,
        flatten,
        functools.partial(unflatten, cls),  # which rebuilds a node of this type
        path_entry_type=entry,
        namespace=NAMESPACE,
    )
    _registered.add(cls)


def _register_new_collections(leaves: list[Any]) -> bool:
    new = {type(leaf) for leaf in leaves if is_tensor_collection(leaf)} - _registered
    for cls in new:
        register(cls)
    return bool(new)


Flat = tuple[list[Any], optree.PyTreeSpec]
"""A tree's leaves and treespec (``flatten``)."""


class Call(NamedTuple):
    """A call on the slow path: its arguments, with their leaves and treespec, flattened once
    (``flatten_call``) and handed down to every step that reads them."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: list[Any]
    spec: optree.PyTreeSpec

    def paths(self) -> list[str]:
        """Readable paths of its leaves, in order (``args[0]["obs"]``)."""
        return spec_paths(self.spec)


def spec_paths(spec: optree.PyTreeSpec) -> list[str]:
    """Readable paths of the leaves of a call's tree, read off its treespec (no flattening)."""
    return [format_path(accessor) for accessor in spec.accessors()]


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """A call's arguments, flattened once (see ``flatten``)."""
    leaves, spec = flatten((args, kwargs))
    return Call(args, kwargs, leaves, spec)


def flatten(tree: Any) -> Flat:
    """Flatten ``tree`` into its leaves and treespec, TensorDicts included.

    Tensor collections of a type not yet registered are registered, then the tree is
    flattened again. This is the slow, capture-time entry point: the replay path calls
    ``optree.tree_flatten`` directly, since every type it can meet is registered by then.
    """
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    # Until no new type is met: a lazy stack, once registered, shows its TensorDicts, whose
    # type may be new too.
    while _register_new_collections(leaves):
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    return leaves, spec


def unflatten(spec: optree.PyTreeSpec, leaves: Any) -> Any:
    """Rebuild a tree from its treespec and leaves (the inverse of ``flatten``)."""
    return optree.tree_unflatten(spec, leaves)


def key_orders(tree: Any) -> list[tuple[str, ...]] | None:
    """The keys of each TensorDict of ``tree`` in the order they were set (depth first), or
    None where every one's are sorted.

    Flattening sorts a TensorDict's keys (see ``_flatten_tensordict``), so that rebuilt
    from its leaves it lists them in sorted order; a function that iterates over its keys
    (``torch.cat(list(td.values()))``) would then compute another result, and a compiled one
    recompile. ``in_key_orders`` gives a rebuilt tree the captured call's orders."""
    orders: list[tuple[str, ...]] = []

    def record(td: TensorDictBase) -> TensorDictBase:
        orders.append(tuple(td.keys()))
        return td

    _visit(tree, record)
    return orders if any(order != tuple(sorted(order)) for order in orders) else None


def in_key_orders(tree: Any, orders: list[tuple[str, ...]]) -> Any:
    """``tree`` (rebuilt by ``unflatten``) with its TensorDicts' keys in ``orders``."""
    pending = iter(orders)

    def reorder(td: TensorDictBase) -> TensorDictBase:
        order = next(pending)
        if order == tuple(td.keys()):
            return td
        meta = _TensorDictMeta(order, td.batch_size, td.device, _names(td))
        return _unflatten_tensordict(type(td), meta, [_compat.td_get(td, key) for key in order])

    return _visit(tree, reorder)


def _visit(tree: Any, on_tensordict: Callable[[TensorDictBase], TensorDictBase]) -> Any:
    """``tree`` with ``on_tensordict`` applied to each plain TensorDict, depth first: its
    entries (in sorted key order) before it. What changes is set into its container (a
    tuple or list is rebuilt); ``tree`` itself is left as it is when nothing changes."""
    if type(tree) is TensorDict:
        for key in sorted(tree.keys()):
            entry = _compat.td_get(tree, key)
            if isinstance(entry, TensorDictBase | tuple | list | dict):
                new = _visit(entry, on_tensordict)
                if new is not entry:
                    _compat.td_set(tree, key, new)
        return on_tensordict(tree)
    if isinstance(tree, tuple | list):
        items = [_visit(item, on_tensordict) for item in tree]
        if all(new is old for new, old in zip(items, tree, strict=True)):
            return tree
        return type(tree)(items) if type(tree) in (tuple, list) else tree
    if isinstance(tree, dict):
        for key in sorted(tree, key=repr):
            new = _visit(tree[key], on_tensordict)
            if new is not tree[key]:
                tree[key] = new
    return tree


def leaves_with_paths(tree: Any, root: str | None = None) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of ``tree``, in the order of ``flatten``.

    The paths read as in ``format_path``; ``root`` names the tree (``None``: a call's
    ``(args, kwargs)``).
    """
    flatten(tree)  # which registers the tensor collections of types not yet registered
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [(format_path(a, root), leaf) for a, leaf in zip(accessors, leaves, strict=True)]


def leaf_paths(tree: Any, root: str | None = None) -> list[str]:
    """Readable paths of the leaves of ``tree``, in the order of ``flatten``."""
    return [path for path, _ in leaves_with_paths(tree, root)]


def leaf_keys(tree: Any) -> list[tuple[Any, ...]]:
    """The entries (keys, indices) that lead to each leaf of ``tree``, as tuples."""
    accessors, _, _ = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [tuple(entry.entry for entry in accessor) for accessor in accessors]


def fast_keys(keys: Sequence[Any]) -> list[Any]:
    """TensorDict keys with single-key tuples as plain strings, the faster lookups."""
    return [key[0] if isinstance(key, tuple) and len(key) == 1 else key for key in keys]


def is_leaf(tree: Any) -> bool:
    """Whether ``tree`` is a leaf in the library's namespace."""
    if is_tensor_collection(tree):
        register(type(tree))
    return optree.tree_is_leaf(tree, namespace=NAMESPACE)


def one_level(tree: Any) -> tuple[dict[Any, tuple[optree.PyTreeEntry, Any]], Any]:
    """A node's direct children by entry (a key, an index), each with the path entry that
    names it, and the node's metadata (for comparing two trees)."""
    accessors, children, _ = optree.tree_flatten_with_accessor(
        tree, is_leaf=lambda node: node is not tree, namespace=NAMESPACE
    )
    _, metadata, _, _ = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
    named = zip((accessor[0] for accessor in accessors), children, strict=True)
    return {entry.entry: (entry, child) for entry, child in named}, metadata


def format_path(path: Sequence[optree.PyTreeEntry], root: str | None = None) -> str:
    """Write a leaf path as a user reads it, e.g. ``args[0]["next", "obs"]`` or ``kwargs["x"]``.

    ``path`` is an optree accessor (or its entries). Without ``root``, it starts at a
    call's tree, the pair ``(args, kwargs)``, whose first entry becomes the name ``args`` or
    ``kwargs``; with ``root``, at a tree of that name. Consecutive TensorDict keys form one
    nested key.
    """
    entries = [entry for entry in path if not isinstance(entry, NonTensorEntry)]
    if root is not None:
        out = [root]
    elif not entries:
        return "(args, kwargs)"
    else:
        out = ["args" if entries.pop(0).entry == 0 else "kwargs"]
    for td_keys, group in itertools.groupby(
        entries, key=lambda entry: isinstance(entry, TensorDictKeyEntry)
    ):
        if td_keys:
            out.append(_format_key(tuple(entry.entry for entry in group)))
        else:
            out.extend(map(_format_entry, group))
    return "".join(out)


def _format_entry(entry: optree.PyTreeEntry) -> str:
    if isinstance(entry, optree.NamedTupleEntry):
        return f".{entry.field}"
    if isinstance(entry, optree.GetAttrEntry):
        return f".{entry.entry}"
    if isinstance(entry, optree.MappingEntry):
        return _format_key((entry.entry,))
    return f"[{entry.entry!r}]"


def _format_key(keys: tuple[Any, ...]) -> str:
    return "[" + ", ".join(f'"{k}"' if isinstance(k, str) else repr(k) for k in keys) + "]"
