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

from .._compat import no_subclass_functions


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
"""What runs on the plain tensor: ``torch.save`` and ``print`` show no subclass."""


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
        if func in _AS_PLAIN:  # saved and shown as the plain tensor it is on CUDA
            args = (args[0].as_subclass(torch.Tensor), *args[1:])
        with no_subclass_functions():
            out = func(*args, **kwargs)
            if not lent or func in _METADATA:
                return out
            # A result over a lent tensor's memory (a view, an in-place result) is lent with it.
            addresses = {t.untyped_storage().data_ptr(): t.token for t in lent}
            return optree.tree_map(lambda leaf: _lent_if_over(leaf, addresses), out)


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
