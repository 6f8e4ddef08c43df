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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._compat import as_strided
from .._errors import inputs as _errors
from . import tree as _tree
from .aliasing import span
from .signature import Signature

_storage = torch.Tensor.untyped_storage
_storage_address = torch.UntypedStorage.data_ptr

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
        storages = [_storage_address(_storage(t)) for t in inputs]
        views = cls(signature, [path for path, _ in tensors], len(tensors))
        for j, (path, out) in enumerate(tensors):
            address = _storage_address(_storage(out))
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
