"""Batch dims of a call: read them, pad a call to a bucket's size, slice a result back.

``shapes="buckets"`` replays a graph captured for a batch of ``b`` rows on a call of ``n <= b``
rows. The batch dims are the leading ``batch_dims`` dims of every input tensor; a TensorDict
(or tensorclass) whose batch size has that many dims is padded and sliced as a whole, its
batch size with it; one with fewer (the ``[]`` of a keyword call) through its entries.
Padded rows repeat the call's first row, so that they hold real values (no NaN or inf that a
product with a zero gradient would spread); outputs are sliced back to ``n`` rows.
"""

from __future__ import annotations

from typing import Any, cast

import optree
import torch
from tensordict.base import is_tensor_collection

from .._errors import shapes as _errors_shapes
from .._values import tree as _tree

Batch = tuple[int, ...]


def _batched(batch_dims: int) -> Any:
    """Which nodes of a tree are padded whole: tensors, and tensor collections with batch dims."""

    def is_leaf(node: Any) -> bool:
        if is_tensor_collection(node):
            return len(node.batch_size) >= batch_dims
        return _tree.is_leaf(node)

    return is_leaf


def _leaves(tree: Any, batch_dims: int, root: str | None = None) -> list[tuple[str, Any]]:
    """``(path, node)`` for the nodes padded whole, and the other leaves."""
    _tree.flatten(tree)  # registers the tree's tensor collection types
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        cast(Any, tree), is_leaf=_batched(batch_dims), namespace=_tree.NAMESPACE
    )
    return [(_tree.format_path(a, root), leaf) for a, leaf in zip(accessors, leaves, strict=True)]


def batch_of(name: str, args: Any, kwargs: Any, batch_dims: int) -> Batch:
    """The batch dims that every tensor input of a call shares.

    Raises:
        ValueError: An input has fewer dims than ``batch_dims``, or other batch dims than
            the first input's, or the call has no tensor input.
    """
    batch: Batch | None = None
    first = ""
    for path, leaf in _leaves((args, kwargs), batch_dims):
        if not (isinstance(leaf, torch.Tensor) or is_tensor_collection(leaf)):
            continue
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


def _resize_leaf(leaf: Any, size: Batch) -> Any:
    for dim, target in enumerate(size):
        have = leaf.shape[dim]
        if have > target:
            leaf = leaf[(slice(None),) * dim + (slice(0, target),)]
        elif have < target:
            index = (slice(None),) * dim + (slice(0, 1),)
            shape = list(leaf.shape)
            shape[dim] = target - have
            leaf = torch.cat([leaf, leaf[index].expand(*shape)], dim)
    return leaf


def resize(args: Any, kwargs: Any, size: Batch) -> tuple[Any, Any]:
    """The call with its batch dims padded (its first rows repeated) or cut to ``size``."""

    def resize_leaf(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) or is_tensor_collection(leaf):
            return _resize_leaf(leaf, size)
        return leaf

    resized: tuple[Any, Any] = optree.tree_map(  # type: ignore[assignment]
        resize_leaf,
        cast(Any, (args, kwargs)),
        is_leaf=_batched(len(size)),
        namespace=_tree.NAMESPACE,
    )
    return resized


def rows(name: str, out: Any, padded: Batch, size: Batch) -> Any:
    """``out``, a result of a call padded to ``padded``, sliced back to ``size`` rows.

    Raises:
        RuntimeError: An output tensor does not start with the padded batch dims (a result
            computed over the batch, which the padded rows change).
    """
    index = tuple(slice(0, n) for n in size)

    def slice_leaf(path: str, leaf: Any) -> Any:
        if not (isinstance(leaf, torch.Tensor) or is_tensor_collection(leaf)):
            return leaf
        if tuple(leaf.shape[: len(padded)]) != padded:
            raise _errors_shapes.output_not_batched(name, path, leaf.shape, padded)
        return leaf[index]

    leaves = _leaves(out, len(size), root="output")
    sliced = iter([slice_leaf(path, leaf) for path, leaf in leaves])
    return optree.tree_map(
        lambda _: next(sliced),
        cast(Any, out),
        is_leaf=_batched(len(size)),
        namespace=_tree.NAMESPACE,
    )


def bucket_for(batch: Batch, buckets: tuple[int, ...] | None) -> Batch | None:
    """The smallest bucket size at least each batch dim (powers of two when ``buckets`` is
    None), or None above the largest bucket."""
    size = []
    for n in batch:
        if buckets is None:
            size.append(1 << max(0, n - 1).bit_length())
            continue
        fit = next((b for b in buckets if b >= n), None)
        if fit is None:
            return None
        size.append(fit)
    return tuple(size)
