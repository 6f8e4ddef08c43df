"""Long runs, lifetimes and threads: no state lost, nothing kept alive, no interference."""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import weakref
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import Buckets, CudaGraphModule, Exact, RecaptureWarning

from .conftest import Backend, current_entry, record, requires_cuda, run_threads


def _policy(backend: Backend) -> TensorDictModule:
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).to(backend.device)
    return TensorDictModule(net, in_keys=["obs"], out_keys=["action"])


def test_dropping_a_wrapper_frees_its_graph_without_the_garbage_collector(
    backend: Backend,
) -> None:
    # No reference cycle may keep a graph (and its memory pool) alive (tensordict#1804):
    # with the collector off, the last reference going away must free it.
    policy = _policy(backend)
    if backend.name == "cuda":  # the device's shared workspace, made once for all wrappers
        first = backend.wrap(policy, warmup=1)
        with torch.no_grad():
            first(TensorDict(obs=backend.randn(8, 4), batch_size=[8]))
        del first
    gc.collect()
    gc.disable()
    try:
        before = torch.cuda.memory_allocated() if backend.name == "cuda" else 0
        graphed = backend.wrap(policy, warmup=2)
        with torch.no_grad():
            for _ in range(3):
                graphed(TensorDict(obs=backend.randn(8, 4), batch_size=[8]))
            entry = weakref.ref(current_entry(graphed))
            captured = weakref.ref(current_entry(graphed).captured)
        del graphed
        assert entry() is None and captured() is None
        if backend.name == "cuda":
            backend.sync()
            assert torch.cuda.memory_allocated() == before
    finally:
        gc.enable()


def _host_memory_mib() -> float | None:
    """The process's resident memory (Linux), or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return None


LONG_RUN = 100_000


def _shown(value: float | None) -> str:
    return f"{value:.1f} MiB" if isinstance(value, float) else str(value)


def test_a_long_run_grows_nothing(backend: Backend) -> None:
    # 100,000 replays of a policy on a TensorDict: no growth of GPU memory, host memory,
    # live Python objects or the interpreter's allocated blocks.
    policy = _policy(backend)
    graphed = backend.wrap(policy, warmup=2)
    td = TensorDict(obs=backend.randn(8, 4), batch_size=[8])
    with torch.no_grad():
        for _ in range(1000):  # capture, then reach the steady state of the allocators
            td = graphed(td)
        backend.sync()
        gc.collect()
        before = {
            "objects": len(gc.get_objects()),
            "blocks": sys.getallocatedblocks(),
            "gpu": torch.cuda.memory_allocated() if backend.name == "cuda" else 0,
            "host": _host_memory_mib(),
        }
        for _ in range(LONG_RUN):
            td = graphed(td)
        backend.sync()
        gc.collect()
        after = {
            "objects": len(gc.get_objects()),
            "blocks": sys.getallocatedblocks(),
            "gpu": torch.cuda.memory_allocated() if backend.name == "cuda" else 0,
            "host": _host_memory_mib(),
        }
    record(
        f"long run ({backend.name})",
        replays=LONG_RUN,
        **{f"{key} before/after": f"{_shown(before[key])}/{_shown(after[key])}" for key in before},
    )
    assert after["objects"] <= before["objects"] + 10  # the loop's own locals, no more
    assert after["blocks"] <= before["blocks"] + 1000  # interpreter caches, not per replay
    assert after["gpu"] == before["gpu"]
    if before["host"] is not None:
        assert after["host"] - before["host"] < 16  # MiB: no growth per replay
    torch.testing.assert_close(td["action"], policy.module(td["obs"]))


def test_threads_replaying_their_own_wrappers_do_not_interfere(backend: Backend) -> None:
    torch.manual_seed(0)
    nets = [nn.Linear(4, 3).to(backend.device) for _ in range(2)]
    wrappers = [backend.wrap(net, warmup=2) for net in nets]
    with torch.no_grad():  # captured one after the other: a capture admits no other work
        for wrapper in wrappers:
            for _ in range(3):
                wrapper(torch.randn(5, 4, device=backend.device))
    barrier = threading.Barrier(2)

    def drive(i: int) -> None:
        barrier.wait()
        with torch.no_grad():
            for _ in range(200):
                x = torch.randn(5, 4, device=backend.device)
                out = wrappers[i](x)
                torch.testing.assert_close(out, nets[i](x))

    run_threads(*(functools.partial(drive, i) for i in range(2)))


@requires_cuda
def test_wrappers_sharing_a_pool_replay_in_capture_order_or_any_other() -> None:
    # Graphs that share a pool may reuse each other's intermediate memory: correct when
    # they replay one at a time. Each wrapper keeps its outputs' buffers and copies them
    # out at every replay, so that any order is correct, the capture order included.
    pool = torch.cuda.graph_pool_handle()
    fns = [lambda x: (x @ x.T).relu().sum(0), lambda x: (x * 3).exp().mean(1), lambda x: x.tanh()]
    wrappers = [CudaGraphModule(fn, warmup=2, pool=pool) for fn in fns]
    with torch.no_grad():
        for _ in range(2):
            for wrapper in wrappers:
                wrapper(torch.randn(16, 16, device="cuda"))
        for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2, 1]):
            results = []
            for i in order:
                x = torch.randn(16, 16, device="cuda")
                results.append((wrappers[i](x), fns[i](x)))
            for actual, expected in results:  # read after all the replays of the round
                torch.testing.assert_close(actual, expected)


@requires_cuda
def test_a_wrapper_uses_and_returns_its_memory() -> None:
    net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)).cuda()
    x = torch.randn(128, 64, device="cuda")
    # The device's shared cuBLAS workspace (see `_capture.sharing`) is made once for every wrapper:
    # a first wrapper makes sure it exists, so that the second one is measured alone.
    first = CudaGraphModule(net, warmup=2)
    with torch.no_grad():
        for _ in range(3):
            first(x)
    del first
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    graphed = CudaGraphModule(net, warmup=2)
    with torch.no_grad():
        for _ in range(3):
            out = graphed(x)
    del out
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    del graphed
    torch.cuda.synchronize()
    record(
        "memory per wrapper (cuda)",
        **{
            "held after capture (KiB)": held // 1024,
            "left after del (B)": torch.cuda.memory_allocated() - start,
        },
    )
    assert held > 0  # the static buffers and the graph's pool
    assert torch.cuda.memory_allocated() == start


@requires_cuda
def test_a_call_on_a_side_stream_is_ordered_against_its_inputs_and_outputs() -> None:
    graphed = CudaGraphModule(lambda x: x * 2 + 1, warmup=2)
    with torch.no_grad():
        for _ in range(2):
            graphed(torch.randn(1024, device="cuda"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x = torch.zeros(1024, device="cuda")
            torch.cuda._sleep(50_000_000)  # the GPU is busy on this stream for a while ...
            x.add_(1)  # ... then writes the input: a replay issued on another stream would
            out = graphed(x)  # read zeros
            out.mul_(10)  # the caller's next kernel on its stream reads the replay's result
            expected = (x * 2 + 1) * 10
        torch.cuda.current_stream().wait_stream(side)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(out, torch.full((1024,), 30.0, device="cuda"))


@pytest.mark.parametrize(
    "options",
    [{}, {"shapes": Exact()}, {"shapes": Buckets([8])}],
    ids=["static", "exact", "buckets"],
)
def test_a_graph_captured_again_frees_the_old_one(backend: Backend, options: Any) -> None:
    # After a replaced parameter, the wrapper captures again: nothing may keep the old
    # graph (and its buffers) alive, not even the replay paths learned for it.
    net = torch.nn.Linear(4, 2).to(backend.device)
    graphed = backend.wrap(net, warmup=2, **options)
    with torch.no_grad():
        for _ in range(3):
            graphed(backend.randn(5, 4))
        old = weakref.ref(next(iter(graphed._current_graphs().entries.values())).captured)
        net.weight = torch.nn.Parameter(torch.randn(2, 4, device=backend.device))
        with pytest.warns(RecaptureWarning):
            for _ in range(4):
                x = backend.randn(5, 4)
                torch.testing.assert_close(graphed(x), net(x))
    gc.collect()
    assert old() is None
