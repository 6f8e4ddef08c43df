"""What the graphs of the wrappers on one device share: a cuBLAS workspace, and so an order.

cuBLAS gives each (handle, stream) pair a workspace (32 MiB on Hopper), which the caching
allocator makes at its first use. A capture that makes it puts it in the graph's pool, so
that each wrapper, with a pool of its own, would hold its own 32 MiB (50 policies: 1.6 GiB).
A graph may not use a workspace made outside every pool either: torch.compile's CUDA graph
trees free the workspaces around each recording, and the freed memory goes to other
tensors, which the graph's replays would then overwrite.

So the wrappers' graphs share one workspace per device, made by a small capture into a pool
that holds nothing else (:func:`prime`): freed, by whoever clears the workspaces, its memory
stays in that pool, where only the next workspace can take it. Graphs that share memory
must not run at the same time: every wrapper's replay is ordered after the last replay on
its device (:class:`ReplayOrder`), and all wrappers take :data:`REPLAY_LOCK` for a call, so
that no thread's replay slips between another's order check and its launch.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

REPLAY_LOCK = threading.RLock()
"""The lock of every wrapper's call (re-entrant: a function may call another wrapper)."""

# Per device: the workspace pool's handle, and the first priming graph, which keeps the pool
# usable (torch cannot capture into a pool whose graphs were all freed; see `SharedPool`).
_workspace_pools: dict[torch.device, tuple[Any, torch.cuda.CUDAGraph]] = {}


def prime(device: torch.device) -> None:
    """Make cuBLAS's and cuBLASLt's workspaces of the current stream in ``device``'s workspace
    pool, for the capture that follows on this stream to use.

    The current stream must have no workspace yet (cleared, see `CudaBackend.capture`): a
    capture of two small matrix products makes them, in the pool it records into.
    """
    known = _workspace_pools.get(device)
    handle = known[0] if known is not None else torch.cuda.graph_pool_handle()
    a = torch.ones(8, 8, device=device)
    b = torch.ones(8, device=device)
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=handle)
    try:
        torch.mm(a, a)  # cuBLAS
        torch.nn.functional.linear(a, a, b)  # cuBLASLt, for a product with a bias
    finally:
        graph.capture_end()
    if known is None:
        _workspace_pools[device] = (handle, graph)


class ReplayOrder:
    """The stream of the last replay on a device, which the next one on another stream waits
    for: the replays of graphs that share memory (a workspace, a pool) never overlap.

    A call on the stream of the last one (the common case) costs one comparison.
    """

    __slots__ = ("device", "raw", "stream")

    def __init__(self, device: int):
        self.device = device
        self.raw: int | None = None  # the stream's handle, compared at each call
        self.stream: Any = None

    def follow(self) -> None:
        """Order the current stream after the last replay's."""
        stream = torch.cuda.current_stream(self.device)
        if self.stream is not None:
            stream.wait_stream(self.stream)
        self.stream, self.raw = stream, stream.cuda_stream


_orders: dict[int, ReplayOrder] = {}


def replay_order(device: int) -> ReplayOrder:
    """The replay order of CUDA device ``device``, shared by every wrapper on it."""
    order = _orders.get(device)
    if order is None:
        order = _orders[device] = ReplayOrder(device)
    return order
