"""The CPU emulation's borrowed outputs: lent as on CUDA, their use after overwrite detected.

On CUDA a lent output's storage is made unreadable by torch itself (`_values.borrowed`);
a CPU build of torch cannot do that. The emulation lends each output as a ``LentTensor``,
a subclass of ``torch.Tensor`` over the emulated graph's own output memory, which checks
its lease at every torch function that reads or writes it: a use after the graph's next
replay raises the same error as on CUDA. A view of it is a ``LentTensor`` of the same lease;
any other result is a plain tensor. What reads only its metadata (its shape, dtype, device)
is allowed, as on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from .._compat import no_subclass_functions, parse_to


class Token:
    """One replay's loan: ``error`` is set when it ends (see `Lease`)."""

    error: str | None = None


def forbid(token: Token, message: str) -> None:
    """What makes a loan unreadable: the lease's ``forbid`` (see `_values.borrowed.Lease`)."""
    token.error = message


_METADATA: set[Callable[..., Any]] = {
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    torch.Tensor.__len__,
    torch.Tensor.is_nested.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_sparse.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_meta.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
    torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.grad_fn.__get__,  # type: ignore[union-attr]
    torch.Tensor.is_quantized.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dim_order,
    torch.Tensor.element_size,
    torch.Tensor.is_contiguous,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
}
"""What reads a tensor's metadata only: allowed after the loan ends, as on CUDA."""


_AS_PLAIN = {torch.Tensor.__reduce_ex__, torch.Tensor.__repr__, torch.Tensor.__format__}
"""What runs on the plain tensor: ``torch.save``, pickling and ``print`` show no subclass."""

_TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__array__}
"""What copies a CUDA tensor into host memory (``.numpy()`` through ``.cpu()``): on the
emulation's CPU tensors a no-op, so run on a copy, whose result is independent of the loan
as on CUDA (a gym loop's ``action.cpu().numpy()``, kept)."""


def _copies_to_host(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func(*args, **kwargs)`` of a lent tensor is a copy into host memory on CUDA."""
    if func in _TO_HOST:
        return True
    if func is not torch.Tensor.to:
        return False
    device = parse_to(*args[1:], **kwargs)[0]
    return device is not None and device.type == "cpu"


class LentTensor(torch.Tensor):
    """An output lent by an emulated graph (see the module's docstring)."""

    token: Token

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves: list[Any] = optree.tree_leaves((args, kwargs))  # type: ignore[arg-type]
        lent = [leaf for leaf in leaves if isinstance(leaf, LentTensor)]
        if func not in _METADATA:
            for t in lent:
                if t.token.error is not None:
                    raise RuntimeError(t.token.error)
        if func is torch.Tensor.__deepcopy__:  # a plain copy, as on CUDA
            with no_subclass_functions():
                plain = args[0].as_subclass(torch.Tensor)
                return torch.Tensor.__deepcopy__(plain, *args[1:], **kwargs)
        if func in _AS_PLAIN:  # saved and shown as the plain tensor it is on CUDA
            args = (args[0].as_subclass(torch.Tensor), *args[1:])
        elif _copies_to_host(func, args, kwargs):  # a plain copy, as on CUDA
            with no_subclass_functions():
                args = (args[0].as_subclass(torch.Tensor).clone(), *args[1:])
                return func(*args, **kwargs)
        with no_subclass_functions():
            out = func(*args, **kwargs)
            if not lent or func in _METADATA:
                return out
            # A result over a lent tensor's memory (a view, an in-place result) is lent with it.
            addresses = {t.untyped_storage().data_ptr(): t.token for t in lent}
            return optree.tree_map(lambda leaf: _lent_if_over(leaf, addresses), out)

    def __copy__(self) -> LentTensor:
        """``copy.copy``: another tensor over the same memory, as on CUDA, lent with it."""
        with no_subclass_functions():
            if self.token.error is not None:
                raise RuntimeError(self.token.error)
            return lend(self.as_subclass(torch.Tensor).view_as(self), self.token)


def _lent_if_over(leaf: Any, addresses: dict[int, Token]) -> Any:
    if type(leaf) is not torch.Tensor:  # a LentTensor (an in-place result) is one already
        return leaf
    token = addresses.get(leaf.untyped_storage().data_ptr())
    return leaf if token is None else lend(leaf, token)


def lend(t: torch.Tensor, token: Token) -> LentTensor:
    """``t``, lent under ``token``."""
    lent = t.as_subclass(LentTensor)
    lent.token = token
    return lent


class EmulatedLentOutputs:
    """The outputs of an emulated graph, lent at each replay (`_values.borrowed.LentOutputs`'
    counterpart), under a `_values.borrowed.Lease` whose ``forbid`` is this module's."""

    def __init__(self, static: list[torch.Tensor], lease: Any):  # a `_values.borrowed.Lease`
        self.static = static
        self.lease = lease

    def make(self) -> list[torch.Tensor]:
        token = Token()
        self.lease.renew((token,))
        return [lend(t, token) for t in self.static]

    def one(self) -> torch.Tensor:
        return self.make()[0]


class EmulatedLentGradients:
    """The gradients of an emulated backward graph, lent at each replay: `EmulatedLentOutputs`
    for what autograd takes.

    autograd takes a new gradient into a leaf's ``.grad`` as a plain tensor over its memory
    (it detaches it), where no loan can be checked. On CUDA that memory is the graph's own,
    and the next backward's replay makes it unreadable: accumulating into that ``.grad``
    raises. Here each replay lends its gradients in new memory, so that a ``.grad`` taken
    from an earlier one keeps its values, and the next replay raises the same error if a
    leaf's ``.grad`` still is the previous replay's gradient, which autograd would now
    accumulate into (``leaves``: the parameters the backward differentiates).
    """

    def __init__(self, static: list[torch.Tensor], lease: Any, leaves: list[torch.Tensor]):
        self.static = static
        self.lease = lease
        self._leaves = leaves
        self._given: list[torch.Tensor] = []  # the last replay's, held: their memory stays theirs

    def make(self) -> list[torch.Tensor]:
        given = {t.untyped_storage().data_ptr() for t in self._given}
        for leaf in self._leaves:
            grad = leaf.grad
            if grad is not None and grad.untyped_storage().data_ptr() in given:
                raise RuntimeError(self.lease.overwritten_message())
        self._given = [t.clone() for t in self.static]
        token = Token()
        self.lease.renew((token,))
        return [lend(t, token) for t in self._given]

    def one(self) -> torch.Tensor:
        return self.make()[0]
