"""Where a tensor's memory lies: the address of its storage, tensor subclasses included.

The library reads storage addresses to tell which inputs and outputs share memory. The
unbound ``torch.Tensor.untyped_storage``, mapped in C, is the fast read; a wrapper subclass
(tensordict's ``UnbatchedTensor``, say) has a storage of its own that holds no memory, and
gives its payload's through its own ``untyped_storage``, which these read where the fast one
fails.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._compat import NO_MEMORY

_storage = torch.Tensor.untyped_storage
_address = torch.UntypedStorage.data_ptr


def address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (for a wrapper subclass, its payload's).

    Raises:
        RuntimeError: Neither the tensor nor its subclass gives memory to read.
    """
    try:
        return _address(_storage(tensor))
    except RuntimeError:  # a storage without memory: the subclass's own view of it
        return tensor.untyped_storage().data_ptr()


def addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The address of each tensor's storage, mapped in C where every one has memory."""
    try:
        return list(map(_address, map(_storage, tensors)))
    except RuntimeError:  # a wrapper subclass among them
        return [address(t) for t in tensors]


def readable(tensor: torch.Tensor) -> bool:
    """Whether the memory of ``tensor`` can be read (see ``address``).

    Raises:
        RuntimeError: Reading it raised for another reason (a lent output overwritten since:
            its own error, which names it).
    """
    try:
        address(tensor)
    except RuntimeError as err:
        if NO_MEMORY not in str(err):
            raise
        return False
    return True
