"""What the graphs of the wrappers on one device share: a cuBLAS workspace, and so an order.

cuBLAS gives each (handle, stream) pair a workspace (32 MiB on Hopper), which the caching
allocator makes at its first use. A capture that makes it puts it in the graph's pool, so
that each wrapper, with a pool of its own, would hold its own 32 MiB (50 policies: 1.6 GiB).
A graph may not use a workspace made outside every pool either: torch.compile's CUDA graph
trees free the workspaces around each recording, and the freed memory goes to other
tensors, which the graph's replays would then overwrite.

So the wrappers' graphs share one workspace per device, made by a small capture into a pool
that holds nothing else (see `CudaBackend`): freed, by whoever clears the workspaces, its memory
stays in that pool, where only the next workspace can take it. Graphs that share memory
must not run at the same time: every wrapper's replay is ordered after the last replay on
its device (``ReplayOrder``), and all wrappers take ``REPLAY_LOCK`` for a call, so
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
_workspace_pools: dict[torch.device, tuple[Any, torch.cuda.CUDAGraph | None]] = {}
# The anchors of pools given up after a failed priming: graphs may still use their workspace.
_retired: list[Any] = []


def workspace_pool(device: torch.device) -> Any:
    """The handle of ``device``'s workspace pool, which holds nothing but workspaces."""
    known = _workspace_pools.get(device)
    if known is None:
        known = _workspace_pools[device] = (torch.cuda.graph_pool_handle(), None)
    return known[0]


# The devices on which this thread has cuBLAS handles (see `CudaBackend`): per thread, as
# torch keeps them.
_handles = threading.local()


def has_handles(device: torch.device) -> bool:
    """Whether this thread made cuBLAS's handles on ``device`` (see `mark_handles`)."""
    return device in _handles.__dict__.get("devices", ())


def mark_handles(device: torch.device) -> None:
    """Note that this thread has cuBLAS handles on ``device``: no capture can create them."""
    _handles.__dict__.setdefault("devices", set()).add(device)


def products(device: torch.device) -> None:
    """Matrix products that make the current stream's cuBLAS and cuBLASLt workspaces: run in
    a capture into the workspace pool (see `CudaBackend`), they make them there."""
    a = torch.ones(8, 8, device=device)
    torch.mm(a, a)  # cuBLAS
    torch.nn.functional.linear(a, a, a[0])  # cuBLASLt, for a product with a bias


def adopt(device: torch.device, graph: torch.cuda.CUDAGraph) -> None:
    """Keep ``graph``, a priming capture, as the pool's anchor if it has none yet."""
    handle, anchor = _workspace_pools[device]
    if anchor is None:
        _workspace_pools[device] = (handle, graph)


def retire(device: torch.device) -> None:
    """After a failed priming capture (the pool counts as recording still): the next priming
    takes a new pool; the old one's anchor stays alive, for the graphs that use it."""
    known = _workspace_pools.pop(device, None)
    if known is not None:
        _retired.append(known[1])


# One side stream per device, for every backend (see `CudaBackend`). The caching allocator
# keeps freed memory per stream, and cuBLAS a 32 MiB workspace per stream (on Hopper): a
# stream per wrapper would leave that much cached per wrapper, which no other one reuses.
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device | int | str | None = None) -> torch.cuda.Stream:
    """The stream on which every graph of this library on ``device`` is warmed up and
    captured (default: the current CUDA device).

    Objects that autograd ties to a stream when they are made must be made on it, for
    their backward to be captured: build a
    ``DistributedDataParallel`` whose training step you capture
    whole under it (see the docs' Several GPUs page).

    Examples:
        >>> with torch.cuda.stream(cudagraph_td.capture_stream()):  # doctest: +SKIP
        ...     model = DistributedDataParallel(net, device_ids=[rank])
    """
    index: int | None = torch.device("cuda" if device is None else device).index
    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


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


def ordered(device: int) -> ReplayOrder:
    """The replay order of CUDA device ``device``, with the current stream ordered after the
    last replay there (a call on another stream than it waits for it)."""
    order = replay_order(device)
    if order.raw != torch.cuda.current_stream(device).cuda_stream:
        order.follow()
    return order
