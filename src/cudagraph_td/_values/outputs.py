"""A graph's outputs: returned in fresh memory at each call, in the captured structure.

``Outputs`` is built at capture from the recorded result: its treespec, its constants,
and the graph's static output tensors, which every replay overwrites. At each call
``FreshCopies`` copies those tensors into new memory (several small ones into views of
one buffer), and ``Outputs.rebuild`` puts the copies back into the result's structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from .._compat import as_strided, foreach_copy_
from .._errors import inputs as _errors
from . import tree as _tree

# Results of at most this many bytes come back as views of one new buffer per dtype, filled
# by one multi-tensor copy: one allocation and one kernel launch per call instead of one of
# each per output. Larger results are cloned output by output, so that one output kept
# alive does not hold the memory of all the others.
_PACK_LIMIT_BYTES = 1 << 24


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

    def make(self) -> list[torch.Tensor]:
        """Copies of the static tensors, in their order, in a new list at each call."""
        if not self._groups:
            return [t.clone() for t in self.static]
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
    """How to turn the graph's static outputs into a result in fresh memory."""

    def __init__(self, name: str, out: Any, device: torch.device, *, allow_grad: bool = False):
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
        self.copies = FreshCopies(static, device)

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
        if self.all_tensors:
            return optree.tree_unflatten(self.spec, tensors)
        leaves = list(self.template)
        for i, t in zip(self.tensor_index, tensors, strict=True):
            leaves[i] = t
        return optree.tree_unflatten(self.spec, leaves)


# Where a view lies in its buffer: (shape, strides, offset in elements).
_Layout = tuple[torch.Size, tuple[int, ...], int]


def _views(flat: torch.Tensor, layouts: list[_Layout]) -> list[torch.Tensor]:
    """Views of ``flat`` laid out as ``layouts``: one ``as_strided`` each, the cheapest view."""
    return [as_strided(flat, shape, strides, offset) for shape, strides, offset in layouts]
