"""Batch dims of a call: read them, pad a call to a bucket's size, slice a result back.

``shapes="buckets"`` replays a graph captured for a batch of ``b`` rows on a call of ``n <= b``
rows. The batch dims are the leading ``batch_dims`` dims of every input tensor; a TensorDict
(or tensorclass) whose batch size has that many dims is padded and sliced as a whole, its
batch size with it; one with fewer (the ``[]`` of a keyword call) through its entries.
Padded rows repeat the call's first row, so that they hold real values (no NaN or inf that a
product with a zero gradient would spread); outputs are sliced back to ``n`` rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from tensordict.base import is_tensor_collection

from .._errors import shapes as _errors_shapes
from .._values import tree as _tree
from .._values.tree import Call

Batch = tuple[int, ...]


def _is_batched(node: Any) -> bool:
    """Whether ``node`` has batch dims to pad and slice: a tensor or a tensor collection."""
    return isinstance(node, torch.Tensor) or is_tensor_collection(node)


def _leaf(batch_dims: int, node: Any) -> bool:
    """Whether ``node`` is a leaf of a tree as padding reads it: tensor collections with
    ``batch_dims`` batch dims are padded whole, like tensors."""
    if is_tensor_collection(node):
        return len(node.batch_size) >= batch_dims
    return _tree.is_leaf(node)


def _leaves(tree: Any, batch_dims: int, root: str | None = None) -> list[tuple[str, Any]]:
    """``(path, node)`` for the tensors and tensor collections padded whole, in a tree whose
    tensor collection types are registered (a call, flattened; a result, see ``rows``)."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        tree, is_leaf=functools.partial(_leaf, batch_dims), namespace=_tree.NAMESPACE
    )
    return [
        (_tree.format_path(accessor, root), leaf)
        for accessor, leaf in zip(accessors, leaves, strict=True)
        if _is_batched(leaf)
    ]


def _map(fn: Callable[[Any], Any], tree: Any, batch_dims: int) -> Any:
    """``tree`` with ``fn(node)`` in place of each tensor and tensor collection padded whole."""
    return optree.tree_map(
        lambda node: fn(node) if _is_batched(node) else node,
        tree,
        is_leaf=functools.partial(_leaf, batch_dims),
        namespace=_tree.NAMESPACE,
    )


def batch_of(name: str, call: Call, batch_dims: int) -> Batch:
    """The batch dims that every tensor input of a call shares.

    Raises:
        ValueError: An input has fewer dims than ``batch_dims``, or other batch dims than
            the first input's, or the call has no tensor input.
    """
    batch: Batch | None = None
    first = ""
    for path, leaf in _leaves((call.args, call.kwargs), batch_dims):
        shape = tuple(leaf.shape)
        if len(shape) < batch_dims:
            raise _errors_shapes.no_batch_dims(name, path, leaf.shape, batch_dims)
        if batch is None:
            batch, first = shape[:batch_dims], path
        elif shape[:batch_dims] != batch:
            raise _errors_shapes.batch_dims_differ(name, first, batch, path, shape[:batch_dims])
    if batch is None:
        raise _errors_shapes.no_batch_dims(name, "(args, kwargs)", None, batch_dims)
    return batch


def _resized(node: Any, size: Batch) -> Any:
    for dim, target in enumerate(size):
        have = node.shape[dim]
        if have > target:
            node = node[(slice(None),) * dim + (slice(0, target),)]
        elif have < target:
            first_row = node[(slice(None),) * dim + (slice(0, 1),)]
            shape = list(node.shape)
            shape[dim] = target - have
            node = torch.cat([node, first_row.expand(*shape)], dim)
    return node


def resize(call: Call, size: Batch) -> tuple[Any, Any]:
    """The call's ``(args, kwargs)`` with their batch dims padded (their first rows repeated)
    or cut to ``size``."""
    tree = (call.args, call.kwargs)
    resized: tuple[Any, Any] = _map(lambda node: _resized(node, size), tree, len(size))
    return resized


def rows(name: str, out: Any, padded: Batch, size: Batch) -> Any:
    """``out``, a result of a call padded to ``padded``, sliced back to ``size`` rows.

    Raises:
        RuntimeError: An output tensor does not start with the padded batch dims (a result
            computed over the batch, which the padded rows change).
    """
    _tree.flatten(out)  # registers its tensor collection types (a warm-up's result)
    for path, leaf in _leaves(out, len(size), root="output"):
        if tuple(leaf.shape[: len(padded)]) != padded:
            raise _errors_shapes.output_not_batched(name, path, leaf.shape, padded)
    index = tuple(slice(0, n) for n in size)
    return _map(lambda node: node[index], out, len(size))


def bucket_for(batch: Batch, buckets: Sequence[int] | None) -> Batch | None:
    """The smallest bucket size at least each batch dim (powers of two when ``buckets`` is
    None), or None above the largest bucket."""
    if buckets is None:  # powers of two
        return tuple(1 << max(0, n - 1).bit_length() for n in batch)
    if max(batch) > max(buckets):  # above the largest bucket
        return None
    return tuple(min(b for b in buckets if b >= n) for n in batch)
