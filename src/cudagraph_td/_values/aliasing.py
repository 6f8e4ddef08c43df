"""Inputs that a graph writes in place: which ones, and that no other input shares their memory.

A function may write into its input tensors (``h.mul_(0.5)``). Its graph writes into its own
copies of them (the static inputs), which each replay copies back to the caller's tensors.
Which inputs it writes is read at capture from the copies' version counters: each copy has
memory and a version counter of its own, where the caller's tensors may share both (one
tensor passed twice, views of one tensor).

Eager mode sees a write into one input through every other input that shares its memory
(``f(x, x)``, ``f(base[:6], base[4:])``); the graph, reading its own copy of each, cannot.
``WrittenInputs.check`` refuses such a call before anything is copied, with an error that
names both inputs. Only the launch of a graph that writes inputs runs it (decided at
capture, see ``GraphCall.launch`` and ``DifferentiableCall.launch``): a graph that writes no
input checks nothing, and its inputs may share memory freely.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import foreach_copy_, version
from .._errors import inputs as _errors
from .signature import Signature
from .storages import addresses

# Above this many bytes in two views whose spans overlap, their bytes are not compared one by
# one: they count as overlapping (a refused call, never a wrong answer). Views that each fill
# their span do overlap then; views whose elements interleave (columns of one matrix) may not.
_EXACT_BYTES = 1 << 20


def versions(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """The tensors' version counters; ``None`` for inference tensors, which have none."""
    return [None if t.is_inference() else version(t) for t in tensors]


def written(tensors: Sequence[torch.Tensor], before: list[int | None]) -> list[int]:
    """The indices of the tensors whose version counter moved past ``before``."""
    pairs = enumerate(zip(tensors, before, strict=True))
    return [i for i, (t, v) in pairs if v is not None and version(t) != v]


class WrittenInputs:
    """The inputs that a captured call writes in place (by index among its tensors), and the
    check that no other input of a call shares their memory."""

    def __init__(self, signature: Signature, indices: list[int]):
        self.indices = indices
        self._signature = signature
        self._static = [signature.static_inputs[i] for i in indices]

    def copy_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """Give the caller's ``tensors`` the values that a replay wrote into the graph's
        static copies of them, as the function wrote into its inputs in eager mode."""
        foreach_copy_([tensors[i] for i in self.indices], self._static)

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raise if an input that the graph writes overlaps another input of a call.

        Raises:
            InputMismatchError: An input written in place shares memory with another input.
        """
        # The address of each tensor's storage (mapped in C). Inputs in storages of their
        # own, the common case, cannot overlap.
        storages = addresses(tensors)
        if len(set(storages)) == len(storages):
            return
        for i in self.indices:
            for j, storage in enumerate(storages):
                if j != i and storage == storages[i] and overlap(tensors[i], tensors[j]):
                    paths = self._signature.tensor_paths()
                    raise _errors.overlapping_inputs(self._signature.name, paths[i], paths[j])


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage have a byte in common."""
    if not a.nbytes or not b.nbytes:  # an empty tensor
        return False
    (a_start, a_end), (b_start, b_end) = span(a), span(b)
    if a_end <= b_start or b_end <= a_start:
        return False
    # The spans overlap: the views do if they have a byte in common (views whose elements
    # interleave, such as the columns of one matrix, may have none).
    return _common_byte(b_start - a_start, _layout(a), _layout(b))


Layout = tuple[tuple[int, ...], tuple[int, ...], int]  # shape, strides, element size


def _layout(t: torch.Tensor) -> Layout:
    return tuple(t.shape), t.stride(), t.element_size()


def span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses of the first byte of ``t``'s elements and one past the last (strides
    are never negative in torch)."""
    start = t.data_ptr()
    if t.is_contiguous():  # the common case (a consolidated TensorDict's entries), in C
        return start, start + t.nbytes
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


@functools.lru_cache(maxsize=256)
def _common_byte(distance: int, a: Layout, b: Layout) -> bool:
    """Whether views laid out as ``a`` and ``b``, ``b`` starting ``distance`` bytes after
    ``a``, have a byte in common: their bytes compared one by one, once per such pair (calls
    that pass views of new tensors laid out as before find the answer here)."""
    if math.prod(a[0]) * a[2] + math.prod(b[0]) * b[2] > _EXACT_BYTES:
        return True
    return bool(torch.isin(_bytes(0, *a), _bytes(distance, *b)).any())


def _bytes(start: int, shape: tuple[int, ...], strides: tuple[int, ...], size: int) -> Any:
    """The addresses of every byte of a view's elements, from ``start``: host data, on the
    CPU (nothing is read from the device)."""
    offsets = torch.zeros((), dtype=torch.int64, device="cpu")
    for n, stride in zip(shape, strides, strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, device="cpu") * stride
    first = offsets.reshape(-1, 1) * size + start
    return (first + torch.arange(size, device="cpu")).reshape(-1)
