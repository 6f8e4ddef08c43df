"""What the wrappers on one device share: one cuBLAS workspace, and the order of replays."""

from __future__ import annotations

import functools
import gc
import threading
from typing import Any

import pytest
import torch
from torch import nn

from cudagraph_td import CudaGraphModule
from cudagraph_td._capture import sharing as _sharing

from .conftest import requires_cuda, run_python, run_threads


def _policy() -> nn.Module:
    return nn.Sequential(
        nn.Linear(17, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 6)
    ).cuda()


def _captured(net: nn.Module) -> CudaGraphModule:
    graphed = CudaGraphModule(net, warmup=2)
    for _ in range(3):
        graphed(torch.randn(32, 17, device="cuda"))
    return graphed


@requires_cuda
def test_wrappers_share_one_cublas_workspace() -> None:
    # cuBLAS makes a workspace (32 MiB on Hopper) per stream; made in each wrapper's pool, 50
    # small policies reserved 1.6 GiB for them. A wrapper's graphs now take a pool segment.
    nets = [_policy() for _ in range(9)]
    with torch.no_grad():
        kept = [_captured(nets[0])]
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        kept += [_captured(net) for net in nets[1:]]
        torch.cuda.synchronize()
        grown = (torch.cuda.memory_reserved() - before) / 2**20
        assert grown <= 8 * 6, f"8 more wrappers reserved {grown:.0f} MiB"
        for net, graphed in zip(nets, kept, strict=True):
            x = torch.randn(32, 17, device="cuda")
            torch.testing.assert_close(graphed(x), net(x))


@requires_cuda
def test_shared_workspace_survives_cleared_workspaces_and_new_captures() -> None:
    # Cleared (torch.compile's CUDA graph trees do it around each recording), the shared
    # workspace stays in its own pool: memory given to other tensors is never written by a
    # replay, and a capture after it makes the workspace again, which both graphs then use.
    first, second = _policy(), _policy()
    with torch.no_grad():
        graphed = _captured(first)
        torch._C._cuda_clearCublasWorkspaces()
        fillers = [torch.full((n << 20,), float("nan"), device="cuda") for n in (1, 2, 4, 8, 16)]
        other = _captured(second)
        for _ in range(3):
            x = torch.randn(32, 17, device="cuda")
            torch.testing.assert_close(graphed(x), first(x))
            torch.testing.assert_close(other(x), second(x))
    torch.cuda.synchronize()
    assert all(bool(f.isnan().all()) for f in fillers), "a replay wrote into reused memory"


def _logging(log: torch.Tensor, digit: int) -> Any:
    def fn(x: torch.Tensor) -> torch.Tensor:
        log.mul_(10).add_(digit)  # the order of the replays, written in the digits of `log`
        return x + digit

    return fn


@requires_cuda
def test_wrappers_on_a_device_replay_in_call_order_across_streams() -> None:
    # Graphs that share memory (the workspace, a pool) must not run at the same time: a
    # wrapper called on another stream than the device's last replay waits for it.
    log = torch.zeros(1, device="cuda")
    a = CudaGraphModule(_logging(log, 1), warmup=2)
    b = CudaGraphModule(_logging(log, 2), warmup=2)
    x = torch.ones(4, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            a(x), b(x)
        log.zero_()
        first, second = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(first):
            torch.cuda._sleep(50_000_000)  # a's replay waits behind this ...
            out_a = a(x)
        with torch.cuda.stream(second):  # ... and b's, called after it, must wait for it
            out_b = b(x)
    torch.cuda.synchronize()
    assert log.item() == 12, "b's replay ran before a's"
    torch.testing.assert_close(out_a, x + 1)
    torch.testing.assert_close(out_b, x + 2)


@requires_cuda
def test_threads_with_wrappers_and_streams_of_their_own_get_their_results() -> None:
    nets = [_policy() for _ in range(4)]
    with torch.no_grad():
        wrappers = [_captured(net) for net in nets]
    results: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    lock = threading.Lock()

    def work(i: int) -> None:
        stream = torch.cuda.Stream()
        pairs = []
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(50):
                x = torch.randn(32, 17, device="cuda")
                pairs.append((wrappers[i](x), nets[i](x)))
        stream.synchronize()
        with lock:
            results[i] = pairs

    run_threads(*(functools.partial(work, i) for i in range(len(nets))))
    for pairs in results.values():
        for out, expected in pairs:
            torch.testing.assert_close(out, expected)


@requires_cuda
def test_a_first_capture_before_any_matrix_product_in_the_process() -> None:
    # The shared workspace is made by matrix products; the first ones of a process create
    # cuBLAS's handle, which no capture admits. A process whose first graph has no product.
    script = (
        "import torch, cudagraph_td\n"
        "graphed = cudagraph_td.CudaGraphModule(lambda x: x + 1, warmup=2)\n"
        "x = torch.ones(4, device='cuda')\n"
        "outs = [graphed(x) for _ in range(3)]\n"
        "assert all(bool((out == 2).all()) for out in outs)\n"
    )
    done = run_python("-c", script)
    assert done.returncode == 0, done.stderr[-2000:]


@requires_cuda
def test_a_workspace_priming_that_breaks_its_capture_leaves_random_ops_working(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A priming whose product breaks its capture (a host sync inside it): ending the capture
    # raises, and torch skips the end of its bookkeeping. The library ends it: the pool's
    # routing, and the CUDA generator's mark as capturing, which would fail the next random
    # op outside a graph ("Offset increment outside graph capture").
    # A garbage collection inside the broken capture could free other streams' tensors,
    # which is illegal there (pytorch#161037): the priming holds it off, at a warm-up too.
    products = _sharing._products
    collecting: list[bool] = []

    def breaking(operand: torch.Tensor) -> dict[str, Any]:
        def broken() -> None:
            if torch.cuda.is_current_stream_capturing():
                collecting.append(gc.isenabled())
                operand.sum().item()  # a host sync: the capture is invalidated

        return {kind: broken for kind in products(operand)}

    _sharing.workspace(torch.device("cuda", torch.cuda.current_device()))._forget()
    monkeypatch.setattr(_sharing, "_products", breaking)  # the next capture primes again
    net = _policy()
    with torch.no_grad():
        graphed = _captured(net)
        assert not torch.cuda.is_current_stream_capturing()
        x = torch.randn(32, 17, device="cuda")  # the generator is not left marked
        torch.testing.assert_close(graphed(x), net(x))
        assert torch.rand(4, device="cuda").shape == (4,)
    assert collecting and not any(collecting)
    assert gc.isenabled()


@requires_cuda
def test_a_failed_workspace_priming_leaves_the_capture_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    products = _sharing._products

    def failing(operand: torch.Tensor) -> dict[str, Any]:
        def fail() -> None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("priming failed")

        return {kind: fail for kind in products(operand)}

    monkeypatch.setattr(_sharing, "_products", failing)
    net = _policy()
    with torch.no_grad():
        graphed = _captured(net)
        assert not torch.cuda.is_current_stream_capturing()
        x = torch.randn(32, 17, device="cuda")
        torch.testing.assert_close(graphed(x), net(x))
    monkeypatch.setattr(_sharing, "_products", products)
    with torch.no_grad():  # the next priming takes a new pool
        other_net = _policy()
        other = _captured(other_net)
        torch.testing.assert_close(other(x), other_net(x))
        torch.testing.assert_close(graphed(x), net(x))
