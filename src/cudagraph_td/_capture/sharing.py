"""What the graphs of the wrappers on one device share: a capture stream, a cuBLAS workspace,
and so an order.

cuBLAS gives each (handle, stream) pair a workspace (32 MiB on Hopper), cached by torch and
made at the pair's first use: in a graph's pool when that use is inside a capture, else in
ordinary memory. A graph writes into the workspace it was captured with, at its address, at
every replay. Three hazards follow, and the `Workspace` below avoids each:

- A capture that finds a workspace made elsewhere uses it without owning it: made in another
  graph's pool, it is freed with the last user of that pool; made by eager work, it goes back
  to ordinary tensors. Either way the graph then writes into memory that is not its own
  (torch's graphs do this whenever two captures share a stream, pytorch#193402). So every
  capture of this library uses workspaces that its own priming capture made, in a pool that
  holds nothing else and lives for the process.
- Anything may clear torch's cache of workspaces (``torch._C._cuda_clearCublasWorkspaces``:
  torch.compile's CUDA graph trees do it around each recording). Freed, a workspace of the
  library's pool stays in that pool, where only the next workspace can take it.
- Clearing the cache frees the workspaces that *other* graphs use, which a graph that found
  one made elsewhere does not own: the library never clears it, unless its own stream's entry
  was made by someone else (a stream of torch's pool is handed out again every 32 streams, to
  tensordict's class, torch's ``make_graphed_callables``...), the one case where nothing else
  removes it.

Graphs that share memory must not run at the same time: every wrapper's replay, and every
warm-up (which uses the workspace eagerly), is ordered after the last replay on its device
(``ReplayOrder``); and all wrappers take ``REPLAY_LOCK`` for a call, so that no thread's
replay slips between another's order check and its launch.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .. import _compat
from .._compat import raw_stream  # on the replay path: one global read


@contextlib.contextmanager
def collection_held_off() -> Iterator[None]:
    """Garbage collection held off, for a capture: a collection during one can free tensors
    of other streams, whose deallocation is illegal while a stream captures (pytorch#161037).
    Turned back on after it, if it was on, whatever the capture raised."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


REPLAY_LOCK = threading.RLock()
"""The lock of every wrapper's call (re-entrant: a function may call another wrapper)."""


def _mm(x: torch.Tensor) -> None:
    torch.mm(x, x)  # cuBLAS


def _mm_bias(x: torch.Tensor) -> None:
    torch.nn.functional.linear(x, x, x[0])  # cuBLASLt, which keeps workspaces of its own


class _InBackward(torch.autograd.Function):
    """Runs a product in its backward, which autograd runs on a thread of its own per device
    (with its own cuBLAS handle): a training step captured whole runs its backward there."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, product: Any) -> torch.Tensor:
        ctx.product = product
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.product(grad)
        return grad, None


def _in_backward(product: Any, operand: torch.Tensor) -> None:
    with torch.inference_mode(False), torch.enable_grad():
        x = operand.detach().requires_grad_()
        torch.autograd.grad(_InBackward.apply(x, product), x, grad_outputs=operand)


def _products(operand: torch.Tensor) -> dict[str, Any]:
    """A product per kind of cuBLAS workspace, each of which makes it on the current stream,
    by this thread (its results are freed at once) or by autograd's."""
    return {
        "cublas": lambda: _mm(operand),
        "cublaslt": lambda: _mm_bias(operand),
        "autograd cublas": lambda: _in_backward(_mm, operand),
        "autograd cublaslt": lambda: _in_backward(_mm_bias, operand),
    }


def _owner(kind: str) -> object:
    """Whose workspace a kind makes: autograd's thread (one per device), or the caller."""
    return "autograd" if kind.startswith("autograd") else _thread.token


class _Thread(threading.local):
    """Per thread (torch keeps cuBLAS handles per thread): the devices where its handles
    exist, and a token that names the thread in a `Workspace`'s records."""

    def __init__(self) -> None:
        self.handles: set[torch.device] = set()
        self.token = object()


_thread = _Thread()


class Workspace:
    """The cuBLAS workspaces of the capture stream on one device, in a pool of their own.

    ``ensure()``, on the capture stream before each warm-up and capture, makes sure that the
    current thread's workspaces of that stream are blocks of this pool that a priming made:
    if a clear freed them (their blocks are free), a priming capture makes them again; if the
    stream's entry was made elsewhere (a priming finds a workspace and makes none), the
    cache is cleared, the one way to drop it, and the priming runs again.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        # Every priming capture, kept: torch cannot capture into a pool whose graphs were all
        # freed, and newer versions drop a stream's workspaces when a graph captured on it
        # is freed.
        self._primings: list[torch.cuda.CUDAGraph] = []
        # Per (thread, kind): the blocks of the workspace that the thread's last priming made.
        self._owned: dict[tuple[object, str], frozenset[int]] = {}
        with torch.inference_mode(False):  # a tensor that autograd can differentiate
            self._operand = torch.ones(8, 8, device=device)
        self._lock = threading.Lock()

    def ensure(self) -> None:
        """Make the current stream's cuBLAS workspaces of this thread blocks of this pool."""
        with self._lock:
            if self._owned_alive():
                return
            self._make_handles()
            try:
                # The warm-up primes too, with garbage collection on: held off here.
                with collection_held_off():
                    # A priming that finds the stream's entry made elsewhere: only a clear
                    # removes it, and the priming runs again. After two, the clear leaves
                    # the capture to make a workspace of its own: nothing made elsewhere is
                    # left.
                    for _attempt in range(2):
                        if self._prime():
                            return
                        self._forget()
            except Exception:
                # A priming that fails (out of memory, say) leaves the capture to make a
                # workspace of its own, in its pool: nothing made elsewhere is left to it.
                self._forget()

    def _forget(self) -> None:
        _compat.clear_cublas_workspaces()
        for kind in _products(self._operand):
            self._owned.pop((_owner(kind), kind), None)

    def _owned_alive(self) -> bool:
        owned = [self._owned.get((_owner(kind), kind)) for kind in _products(self._operand)]
        if any(blocks is None for blocks in owned):
            return False
        alive = _compat.pool_blocks(self.device, self.pool)
        return all(blocks <= alive for blocks in owned if blocks is not None)

    def _make_handles(self) -> None:
        """cuBLAS's handles of this thread: made on first use, which no capture admits. Made
        by products on the device's default stream (whose workspaces are ordinary memory,
        as any eager product would make them)."""
        if self.device not in _thread.handles:
            with torch.cuda.stream(torch.cuda.default_stream(self.device)):
                for product in _products(self._operand).values():
                    product()
            _thread.handles.add(self.device)

    def _prime(self) -> bool:
        """Capture a product of each kind into the pool; False if one found a workspace that
        this thread's primings did not make."""
        alive = _compat.pool_blocks(self.device, self.pool)
        for kind, product in _products(self._operand).items():
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            try:
                product()  # its result is freed at once: only the workspace stays allocated
            except BaseException:
                self._abandon(graph)
                raise
            _compat.end_capture(graph)
            self._primings.append(graph)
            now = _compat.pool_blocks(self.device, self.pool)
            made, alive = frozenset(now - alive), now
            key = (_owner(kind), kind)
            if made:
                # Blocks that another thread's priming made were freed since, by a clear of
                # that thread's workspaces too: its record no longer says they are its own.
                for other in [k for k, blocks in self._owned.items() if blocks & made]:
                    del self._owned[other]
                self._owned[key] = made
            elif key not in self._owned or not self._owned[key] <= alive:
                return False
        return True

    def _abandon(self, graph: torch.cuda.CUDAGraph) -> None:
        """End a failed priming capture. The pool then counts as recording still, and takes
        no other capture: the next priming takes a new one. The graph is kept: freeing the
        last graph of a pool releases it, and a pool released takes no capture either."""
        try:
            _compat.end_failed_capture(graph, self.device, self.pool)
        finally:
            self._primings.append(graph)
            self.pool = torch.cuda.graph_pool_handle()
            self._owned.clear()


@functools.cache
def workspace(device: torch.device) -> Workspace:
    """The workspace of the capture stream on ``device``."""
    return Workspace(device)


# One side stream per device, for every backend (see `CudaBackend`). The caching allocator
# keeps freed memory per stream, and cuBLAS a 32 MiB workspace per stream (on Hopper): a
# stream per wrapper would leave that much cached per wrapper, which no other one reuses.
@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


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
    return _side_stream(
        torch.device("cuda", torch.cuda.current_device() if index is None else index)
    )


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

    def keep(self) -> None:
        """Order the current stream after the last replay's, if it is another stream."""
        if self.raw != raw_stream(self.device):  # type: ignore[misc]
            self.follow()


@functools.cache
def replay_order(device: int) -> ReplayOrder:
    """The replay order of CUDA device ``device``, shared by every wrapper on it."""
    return ReplayOrder(device)


def ordered(device: int) -> ReplayOrder:
    """The replay order of CUDA device ``device``, with the current stream ordered after the
    last replay there (a call on another stream than it waits for it)."""
    order = replay_order(device)
    order.keep()
    return order
