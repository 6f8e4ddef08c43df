"""Borrowed outputs (``outputs="borrowed"``): a replay's outputs over its graph's own memory.

By default a replay copies the graph's static outputs into fresh memory, so that a result
never changes. With ``outputs="borrowed"``, a replay instead lends new tensors over the
static outputs themselves, valid until the next replay of the same graph: no copy, and no
allocation but the tensors' own. Each replay lends its tensors over storages of their own
(`_compat.storage_over`, memory that they do not own), and makes the storages that the
replay before it lent unreadable (`_compat.forbid_access`): every later use of those
outputs, or of any view of them, raises an error that names the wrapper, the replay that
overwrote them and the fix. A graph's ``Lease`` holds what its last replay lent; when the
graph goes (a reset, a new capture, the wrapper deleted), the lease ends and makes those
unreadable too (`_capture.captured.Captured.end_loans`, called by whoever drops the graph,
whatever else still holds it; and when the lease is collected, for a graph that no wrapper
drops): never a stale read, never a read of freed memory.

This module lends CUDA memory (``LentOutputs``); the CPU emulation lends its own way, with
the same ``Lease`` (`_emulation.lent`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import cuda_tensor_over, forbid_access, storage_over
from .._errors import borrowed as _errors


class Lease:
    """What the last replay of one graph lent: made unreadable by the graph's next replay
    (``renew``), or when the graph goes (``end``, also when the lease is collected with it).

    ``forbid(held, message)`` makes one held thing unreadable: a CUDA storage, or the
    emulation's token. ``label`` names the graph in messages (set by its entry). ``held``:
    what the last replay lent.
    """

    def __init__(self, label: str, forbid: Callable[[Any, str], None] = forbid_access):
        self.label = label
        self.replays = 0  # the replays that lent
        self._forbid = forbid
        self.held: Sequence[Any] = ()

    def overwritten_message(self) -> str:
        """The error of a use of what the last replay lent, once the next one has replayed."""
        return _errors.overwritten(self.label, self.replays + 1)

    def renew(self, lent: Sequence[Any]) -> None:
        """A replay lends ``lent``: what the one before it lent made unreadable."""
        if self.held:
            message = self.overwritten_message()
            for each in self.held:
                self._forbid(each, message)
        self.replays += 1
        self.held = lent

    def end(self) -> None:
        """The graph goes: what its last replay lent made unreadable."""
        lent, self.held = self.held, ()
        if lent:
            message = _errors.released(self.label)
            for each in lent:
                self._forbid(each, message)

    def __del__(self) -> None:
        # Collected with its graph (whose memory it keeps until now, see `LentOutputs`). At
        # the interpreter's exit the modules it needs may be gone already: nothing to protect.
        with contextlib.suppress(Exception):
            self.end()


def lease_of(copies: Any) -> Lease | None:
    """The lease of what returns a graph's outputs (`LentOutputs`, the emulation's); None for
    fresh copies, which lend nothing."""
    return getattr(copies, "lease", None)


def end_loan(copies: Any) -> None:
    """End the loan of what ``copies`` returns, if it lends: its graph goes (see
    `_capture.captured.Captured.end_loans`)."""
    lease = lease_of(copies)
    if lease is not None:
        lease.end()


# A tensor's place in the memory it is lent from: its storage's index, its layout.
_Place = tuple[int, dict[str, Any]]


class LentOutputs:
    """The outputs of a graph on CUDA, lent at each replay (see the module's docstring):
    ``make`` has the interface of `_values.outputs.FreshCopies`, which it replaces.

    ``static`` are the graph's static output tensors, which it holds (with ``lease``): the
    graph's memory stays allocated while a lent output can still be read.
    """

    def __init__(self, static: list[torch.Tensor], lease: Lease):
        self.lease = lease
        self.static = static

    @property
    def static(self) -> list[torch.Tensor]:
        return self._static

    @static.setter
    def static(self, tensors: list[torch.Tensor]) -> None:
        self._static = tensors
        # The storages the tensors lie in, each lent once per replay: (address, device,
        # bytes), and each tensor's place in them.
        storages: dict[int, int] = {}
        self._storages: list[tuple[int, torch.device, int]] = []
        self._places: list[_Place] = []
        for t in tensors:
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if address not in storages:
                storages[address] = len(self._storages)
                self._storages.append((address, storage.device, storage.nbytes()))
            layout = {
                "size": t.shape,
                "stride": t.stride(),
                "dtype": t.dtype,
                "device": t.device,
                "storage_offset": t.storage_offset(),
            }
            self._places.append((storages[address], layout))
        # One output (the commonest): lent without lists (see `one`).
        self._one = len(self._storages) == 1 and len(self._places) == 1
        self._where = self._storages[0] if self._storages else None
        self._layout = self._places[0][1] if self._places else None

    def make(self) -> list[torch.Tensor]:
        """The outputs of this replay, lent; those of the previous replay made unreadable."""
        if self._one:
            return [self.one()]
        storages = [storage_over(*where) for where in self._storages]
        self.lease.renew(storages)
        return [cuda_tensor_over(layout, storages[i]) for i, layout in self._places]

    def one(self) -> torch.Tensor:
        """``make`` for one output: the tensor itself."""
        storage = storage_over(*self._where)  # type: ignore[misc]
        self.lease.renew((storage,))
        return cuda_tensor_over(self._layout, storage)  # type: ignore[arg-type]
