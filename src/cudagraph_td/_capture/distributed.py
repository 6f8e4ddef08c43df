"""DistributedDataParallel around a graph: what its capture needs, checked up front.

A training step that calls a DDP module captures its gradients' all-reduce too (NCCL 2.9.6
or later). torch's recipe for it, which the wrapper applies or asks for:

1. Eager DDP iterations before the capture: DDP rebuilds its gradient buckets after its
   first iteration, and torch asks for 11 (``warmup=12``: 11 warm-ups, then the capture).
2. The capture in the ``"thread_local"`` error mode: the process group's watchdog thread
   polls its collectives' events while a step is captured, which the ``"global"`` mode
   forbids (the capture fails on one rank, and the others wait for it).
3. DDP built on the capture stream (``capture_stream``): DDP keeps the parameters'
   gradient accumulators, which autograd ties to the stream they were made on.

4. The same graphs on every rank, in the same order (each replay runs the captured
   collectives). With ``shapes=``, the ranks agree before each call (``Agreement``,
   over a CPU group of their own, so no host synchronisation with the GPU): ``"exact"``
   checks that every rank has the same shapes, ``"buckets"`` pads every rank to the largest
   bucket any of them needs. Such calls skip the replay path (they cost a collective).
5. A capture that fails on one rank fails on all: captures record collectives without
   running them, so every rank reaches the end of its capture, where the ranks tell each
   other whether it succeeded; a rank whose capture succeeded drops its graph and raises.

Checked when the wrapper is made, from the objects that the function reaches: every rank
makes the same wrapper, so every rank raises the same error, and none waits for another.
A DDP module wrapped directly (a forward in grad mode) is refused: its backward hooks need
the forward that DDP runs, which a replay skips.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .._state.search import find_state

DDP_WARMUP = 12
"""The least ``warmup`` for a step that calls a DDP module: 11 eager iterations, a capture."""


def checked(name: str, fn: Any, warmup: int, mode: str) -> tuple[str, Agreement | None]:
    """The capture error mode for ``fn``: ``mode``, or ``"thread_local"`` for a function
    that calls a DDP module (see above), after checking what else that needs; and, for such
    a function, the ranks' ``Agreement``, which its shape options carry (else None)."""
    if isinstance(fn, DistributedDataParallel):
        raise TypeError(
            f"{name} cannot replay a DistributedDataParallel module's forward: DDP's "
            "gradient hooks need the forward that DDP runs, which a replay skips. Graph the "
            "module before DDP wraps it (`DDP(make_graphed_callables(module, (sample,)))`), "
            "or capture the whole training step (forward, backward and `optimizer.step()`, "
            "see the Several GPUs page of the docs)."
        )
    modules = find_state(fn)[1]
    ddps = [(path, m) for path, m in modules.items() if isinstance(m, DistributedDataParallel)]
    if not ddps:
        return mode, None
    path, ddp = ddps[0]
    if warmup < DDP_WARMUP:
        raise ValueError(
            f"{name} captures a step that calls a DistributedDataParallel module "
            f"(`{path}`), with warmup={warmup}: DDP rebuilds its gradient buckets during "
            f"its first iterations, and its capture needs {DDP_WARMUP - 1} eager ones "
            f"before it. Pass `warmup={DDP_WARMUP}` or more."
        )
    mode = "thread_local" if mode == "global" else mode
    return mode, Agreement(name, ddp.process_group)


class Agreement:
    """What the ranks of a DDP step's process group agree on: the graph of each call
    (``shapes=``) and the outcome of each capture. Over a gloo group of the same ranks
    (the DDP group itself if it is one), made when the wrapper is: CPU tensors, no host
    synchronisation with the GPU."""

    def __init__(self, name: str, group: Any):
        self.name = name
        if dist.get_backend(group) == "gloo":
            self.group = group
        else:  # made by the group's ranks alone (every rank makes the same wrapper)
            ranks = dist.get_process_group_ranks(group)
            self.group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)

    def largest(self, size: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The bucket of every rank: the largest that one needs (None: above every bucket,
        on some rank)."""
        mine = torch.tensor([_ABOVE] if size is None else [len(size), *size])
        wide = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64)
        wide[: len(mine)] = mine
        dist.all_reduce(wide, op=dist.ReduceOp.MAX, group=self.group)
        if wide[0] == _ABOVE:
            return None
        return tuple(int(n) for n in wide[1 : 1 + int(wide[0])])

    def same(self, key: Hashable, shown: Any) -> None:
        """Raise on every rank unless every rank's call has the graph of ``key`` (``"exact"``)."""
        digest = _digest(key)
        both = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if int(both[0]) != -int(both[1]):
            raise ValueError(
                f"{self.name} captures a step that calls a DistributedDataParallel module, "
                f"and its ranks were called with other shapes (rank {self.rank}: {shown}): "
                "each graph holds collectives, so every rank must replay the same one. Give "
                "every rank batches of one size (`DistributedSampler` pads the last one), or "
                "use shapes='buckets' (the ranks then pad to the largest bucket any of them "
                "needs; for a training step, pad and mask its loss yourself instead)."
            )

    def outcome(self, error: BaseException | None) -> None:
        """Tell the other ranks whether this rank's capture failed; raise, on a rank whose
        capture succeeded, if another's did."""
        failed = torch.zeros(self.world, dtype=torch.int64)
        failed[self.rank] = error is not None
        dist.all_reduce(failed, group=self.group)
        ranks = [r for r, f in enumerate(failed.tolist()) if f]
        if ranks and error is None:
            raise RuntimeError(
                f"the capture failed on rank(s) {ranks} of {self.world} (see their error for "
                f"the cause): this rank (rank {self.rank}) drops its graph too, so that no "
                "rank replays collectives that another does not"
            )


@functools.lru_cache(maxsize=256)  # keys of refused calls count too: the cache is bounded
def _digest(key: Hashable) -> int:
    """A key's digest, which the ranks compare: made once per key (a call pays a cache
    look-up, then the collective)."""
    return zlib.crc32(repr(key).encode())


_ABOVE = 1 << 40  # a call above every bucket, which every rank's agreement then takes
_MAX_DIMS = 8
