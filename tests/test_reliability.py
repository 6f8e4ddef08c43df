"""Long runs, lifetimes and threads: no state lost, nothing kept alive, no interference."""

from __future__ import annotations

import gc
import threading
import weakref

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from .conftest import Backend


def _policy(backend: Backend) -> TensorDictModule:
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).to(backend.device)
    return TensorDictModule(net, in_keys=["obs"], out_keys=["action"])


def test_dropping_a_wrapper_frees_its_graph_without_the_garbage_collector(
    backend: Backend,
) -> None:
    # No reference cycle may keep a graph (and its memory pool) alive (tensordict#1804):
    # with the collector off, the last reference going away must free it.
    policy = _policy(backend)
    gc.collect()
    gc.disable()
    try:
        before = torch.cuda.memory_allocated() if backend.name == "cuda" else 0
        graphed = backend.wrap(policy, warmup=2)
        with torch.no_grad():
            for _ in range(3):
                graphed(TensorDict(obs=backend.randn(8, 4), batch_size=[8]))
        runner = weakref.ref(graphed._runner)
        captured = weakref.ref(graphed._runner.captured)
        del graphed
        assert runner() is None and captured() is None
        if backend.name == "cuda":
            backend.sync()
            assert torch.cuda.memory_allocated() == before
    finally:
        gc.enable()


def test_many_replays_grow_nothing(backend: Backend) -> None:
    policy = _policy(backend)
    graphed = backend.wrap(policy, warmup=2)
    td = TensorDict(obs=backend.randn(8, 4), batch_size=[8])
    with torch.no_grad():
        for _ in range(50):
            graphed(td)
        backend.sync()
        gc.collect()
        objects = len(gc.get_objects())
        memory = torch.cuda.memory_allocated() if backend.name == "cuda" else 0
        for _ in range(2000):
            td = graphed(td)
        backend.sync()
        gc.collect()
        assert len(gc.get_objects()) <= objects + 10  # the loop's own locals, no more
        if backend.name == "cuda":
            assert torch.cuda.memory_allocated() == memory
        torch.testing.assert_close(td["action"], policy.module(td["obs"]))


def test_threads_replaying_their_own_wrappers_do_not_interfere(backend: Backend) -> None:
    torch.manual_seed(0)
    nets = [nn.Linear(4, 3).to(backend.device) for _ in range(2)]
    wrappers = [backend.wrap(net, warmup=2) for net in nets]
    with torch.no_grad():  # captured one after the other: a capture admits no other work
        for wrapper in wrappers:
            for _ in range(3):
                wrapper(torch.randn(5, 4, device=backend.device))
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def drive(i: int) -> None:
        try:
            barrier.wait()
            with torch.no_grad():
                for _ in range(200):
                    x = torch.randn(5, 4, device=backend.device)
                    out = wrappers[i](x)
                    torch.testing.assert_close(out, nets[i](x))
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
