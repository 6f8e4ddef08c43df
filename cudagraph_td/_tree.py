"""Pytrees of call arguments and results: flattening, TensorDict nodes, readable leaf paths.

Trees are flattened with optree in the library's own namespace, :data:`NAMESPACE`. TensorDict
types are registered there (never in torch's global pytree registry), so that a TensorDict's
entries become leaves of the tree and its batch size, device and keys become part of the
treespec: comparing two treespecs then compares the whole structure of two calls at once.

optree matches node types exactly, and tensorclasses are user-defined types, so tensor
collections are registered lazily, the first time :func:`flatten` meets their type.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import optree
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from tensordict.base import is_tensor_collection
from tensordict.tensorclass import NonTensorData

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
    names = tuple(td.names) if td._has_names() else None
    # ``_get_str`` returns NonTensorData entries wrapped, so that they stay nodes of the tree.
    children = [td._get_str(key, None) for key in keys]
    return children, _TensorDictMeta(keys, td.batch_size, td.device, names), keys


def _unflatten_tensordict(cls: type, meta: _TensorDictMeta, children: Any) -> TensorDictBase:
    return cls._new_unsafe(  # type: ignore[attr-defined, no-any-return]
        source=dict(zip(meta.keys, children, strict=True)),
        batch_size=meta.batch_size,
        device=meta.device,
        names=meta.names,
    )


def _flatten_lazy_stack(td: LazyStackedTensorDict) -> tuple[list[Any], tuple[int, type], None]:
    return list(td.tensordicts), (td.stack_dim, type(td)), None


def _unflatten_lazy_stack(meta: tuple[int, type], children: Any) -> LazyStackedTensorDict:
    stack_dim, cls = meta
    return cls(*children, stack_dim=stack_dim)  # type: ignore[no-any-return]


class _TensorClassMeta(NamedTuple):
    tensor_keys: tuple[str, ...]
    other_keys: tuple[str, ...]
    batch_size: torch.Size
    device: torch.device | None


def _flatten_tensorclass(tc: Any) -> tuple[list[Any], _TensorClassMeta, tuple[str, ...]]:
    td = tc._tensordict
    tensor_keys = tuple(sorted(td.keys()))
    other_keys = tuple(tc._non_tensordict)
    children = [td._get_str(key, None) for key in tensor_keys]
    children += [tc._non_tensordict[key] for key in other_keys]
    meta = _TensorClassMeta(tensor_keys, other_keys, td.batch_size, td.device)
    return children, meta, tensor_keys + other_keys


def _unflatten_tensorclass(cls: type, meta: _TensorClassMeta, children: Any) -> Any:
    children = list(children)
    n = len(meta.tensor_keys)
    source = TensorDict._new_unsafe(
        source=dict(zip(meta.tensor_keys, children[:n], strict=True)),
        batch_size=meta.batch_size,
        device=meta.device,
    )
    others = dict(zip(meta.other_keys, children[n:], strict=True))
    return cls._from_tensordict(source, non_tensordict=others)  # type: ignore[attr-defined]


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


def register(cls: type) -> None:
    """Register a tensor collection type as a pytree node in :data:`NAMESPACE`."""
    if cls in _registered:
        return
    if issubclass(cls, NonTensorData):
        _register_node(
            cls,
            _flatten_non_tensor,
            lambda meta, children, cls=cls: _unflatten_non_tensor(cls, meta, children),
            path_entry_type=NonTensorEntry,
            namespace=NAMESPACE,
        )
    elif issubclass(cls, LazyStackedTensorDict):
        _register_node(
            cls,
            _flatten_lazy_stack,
            _unflatten_lazy_stack,
            path_entry_type=optree.SequenceEntry,
            namespace=NAMESPACE,
        )
    elif issubclass(cls, TensorDictBase):
        _register_node(
            cls,
            _flatten_tensordict,
            lambda meta, children, cls=cls: _unflatten_tensordict(cls, meta, children),
            path_entry_type=TensorDictKeyEntry,
            namespace=NAMESPACE,
        )
    else:
        _register_node(
            cls,
            _flatten_tensorclass,
            lambda meta, children, cls=cls: _unflatten_tensorclass(cls, meta, children),
            path_entry_type=optree.GetAttrEntry,
            namespace=NAMESPACE,
        )
    _registered.add(cls)


def _register_new_collections(leaves: list[Any]) -> bool:
    new = {type(leaf) for leaf in leaves if is_tensor_collection(leaf)} - _registered
    for cls in new:
        register(cls)
    return bool(new)


def flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into its leaves and treespec, TensorDicts included.

    Tensor collections of a type not yet registered are registered, then the tree is
    flattened again. This is the slow, capture-time entry point: the replay path calls
    ``optree.tree_flatten`` directly, since every type it can meet is registered by then.
    """
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    while _register_new_collections(leaves):
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    return leaves, spec


def unflatten(spec: optree.PyTreeSpec, leaves: Any) -> Any:
    """Rebuild a tree from its treespec and leaves (the inverse of :func:`flatten`)."""
    return optree.tree_unflatten(spec, leaves)


def is_leaf(tree: Any) -> bool:
    """Whether ``tree`` is a leaf in the library's namespace."""
    if is_tensor_collection(tree):
        register(type(tree))
    return optree.tree_is_leaf(tree, namespace=NAMESPACE)


class Node(NamedTuple):
    """One level of a tree: its children, the entries naming them, and the node's metadata."""

    children: list[Any]
    entries: tuple[Any, ...]
    metadata: Any
    entry_type: type


def one_level(tree: Any) -> Node:
    """Split a node of the tree into its direct children."""
    children, metadata, entries, _ = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
    if optree.is_namedtuple_instance(tree):
        entry_type: type = optree.GetAttrEntry
        entries = optree.namedtuple_fields(tree)
    elif isinstance(tree, (tuple, list)):
        entry_type = optree.SequenceEntry
    elif isinstance(tree, dict):
        entry_type = optree.MappingEntry
    elif isinstance(tree, TensorDictBase) and not isinstance(tree, LazyStackedTensorDict):
        entry_type = TensorDictKeyEntry
    elif isinstance(tree, LazyStackedTensorDict):
        entry_type = optree.SequenceEntry
    elif isinstance(tree, NonTensorData):
        entry_type = NonTensorEntry
    else:
        entry_type = optree.GetAttrEntry
    return Node(list(children), tuple(entries), metadata, entry_type)


# A path is a tuple of (entry_type, entry) pairs from the root of ``(args, kwargs)``.
Path = tuple[tuple[type, Any], ...]


def format_path(path: Path, root: str | None = None) -> str:
    """Write a leaf path as a user reads it, e.g. ``args[0]["next", "obs"]`` or ``kwargs["x"]``.

    Without ``root``, the path starts at a call's tree, the pair ``(args, kwargs)``, whose
    first entry becomes the name ``args`` or ``kwargs``; with ``root``, the path starts at
    a tree of that name. Consecutive TensorDict keys form one nested key.
    """
    if root is not None:
        out, rest = [root], path
    elif not path:
        return "(args, kwargs)"
    else:
        (_, first), rest = path[0], path[1:]
        out = ["args" if first == 0 else "kwargs"]
    td_keys: list[str] = []
    for entry_type, entry in rest:
        if issubclass(entry_type, NonTensorEntry):
            continue
        if issubclass(entry_type, TensorDictKeyEntry):
            td_keys.append(entry)
            continue
        if td_keys:
            out.append(_format_key(tuple(td_keys)))
            td_keys = []
        if issubclass(entry_type, optree.GetAttrEntry):
            out.append(f".{entry}")
        elif issubclass(entry_type, optree.MappingEntry):
            out.append(_format_key((entry,)))
        else:
            out.append(f"[{entry!r}]")
    if td_keys:
        out.append(_format_key(tuple(td_keys)))
    return "".join(out)


def _format_key(keys: tuple[Any, ...]) -> str:
    return "[" + ", ".join(f'"{k}"' if isinstance(k, str) else repr(k) for k in keys) + "]"


def walk_leaves(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for every leaf of ``tree``, in the order of :func:`flatten`."""
    if is_leaf(tree):
        yield path, tree
        return
    node = one_level(tree)
    for entry, child in zip(node.entries, node.children, strict=True):
        yield from walk_leaves(child, (*path, (node.entry_type, entry)))


def leaf_paths(tree: Any, root: str | None = None) -> list[str]:
    """Readable paths of the leaves of ``tree``, in the order of :func:`flatten`."""
    return [format_path(path, root) for path, _ in walk_leaves(tree)]
