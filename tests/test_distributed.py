"""DistributedDataParallel around a graph: what a capture needs is checked up front."""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cudagraph_td import CudaGraphModule, capture_stream, make_graphed_callables

from .conftest import HAS_CUDA, Backend, early


@contextlib.contextmanager
def _one_process(name: str) -> Iterator[None]:
    dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def group() -> Iterator[None]:
    """A process group of one process (gloo), for DDP modules on the CPU."""
    with _one_process("gloo"):
        yield


def _step(ddp: nn.Module, optimizer: torch.optim.Optimizer) -> object:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def test_a_ddp_module_itself_is_refused(group: None) -> None:
    ddp = DDP(nn.Linear(4, 1))
    with pytest.raises(TypeError, match=re.escape("cannot replay a DistributedDataParallel")):
        CudaGraphModule(ddp, backend="emulate")


def test_a_step_calling_ddp_needs_eleven_eager_iterations(group: None) -> None:
    ddp = DDP(nn.Linear(4, 1))
    step = _step(ddp, torch.optim.Adam(ddp.parameters()))
    message = "(`ddp`), with warmup=2: DDP rebuilds its gradient buckets"
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        CudaGraphModule(step, warmup=2, backend="emulate")
    assert "Pass `warmup=12` or more." in str(info.value)


def test_a_ddp_steps_tensordict_result_keeps_its_key_order(group: None) -> None:
    # The emulation replays a DDP step by running it again, into static outputs made from
    # the eager result's structure: its TensorDict's keys in the order the step set them.
    ddp = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> TensorDict:
        optimizer.zero_grad()
        pred = ddp(x)
        loss = nn.functional.mse_loss(pred, y)
        loss.backward()
        optimizer.step()
        return TensorDict(mean=pred.detach().mean(), loss=loss.detach(), batch_size=[])

    graphed = CudaGraphModule(step, warmup=12, backend="emulate")
    for _ in range(14):
        out = graphed(torch.randn(8, 4), torch.randn(8, 1))
        assert list(out.keys()) == ["mean", "loss"]
    assert graphed.is_captured


def test_ddp_step_and_graphed_module_under_ddp_track_eager_ddp(backend: Backend) -> None:
    # A group of one process: the all-reduce runs (captured, on CUDA), over one rank; two
    # ranks are the example's (tests/test_examples.py).
    with _one_process("nccl" if backend.name == "cuda" else "gloo"):
        _track_eager_ddp(backend)


class _GraphedInside(nn.Module):
    def __init__(self, net: nn.Module, backend: Backend):
        super().__init__()
        self.net = net  # registered: DDP finds its parameters
        self.graphed = backend.wrap(net, warmup=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.graphed(x)  # type: ignore[no-any-return]


def _on(stream: Any, step: Any) -> Any:
    """``step``, run under ``stream`` (a stream context, entered at each call)."""

    def run(*args: Any) -> Any:
        with stream:
            return step(*args)

    return run


def _replayed(graphed: CudaGraphModule) -> bool:
    return any(info.captured and info.replays for info in graphed.graphs())


def _track_eager_ddp(backend: Backend) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(backend.device)
    ids = [backend.device.index] if backend.name == "cuda" else None
    eager, partial, inner, whole = (copy.deepcopy(net) for _ in range(4))
    eager_ddp = DDP(eager, device_ids=ids)
    sample = backend.randn(16, 8)
    partial_ddp = DDP(
        make_graphed_callables(partial, (sample,), backend=backend.name), device_ids=ids
    )
    # A CudaGraphModule in grad mode inside the module that DDP wraps: its autograd node's
    # backward gives DDP's hooks the gradients, which DDP all-reduces eagerly. DDP keeps
    # its gradient accumulators, tied to the stream they were made on, where the wrapper's
    # captures and replays must both run: DDP built and its steps run on the capture stream.
    on_capture_stream = torch.cuda.stream(capture_stream()) if ids else contextlib.nullcontext()
    with on_capture_stream:
        inner_ddp = DDP(_GraphedInside(inner, backend), device_ids=ids)
    with torch.cuda.stream(capture_stream()) if ids else contextlib.nullcontext():
        whole_ddp = DDP(whole, device_ids=ids)  # its accumulators on the capture stream
    lr = 1e-2
    steps = {
        "eager": _step(eager_ddp, torch.optim.SGD(eager_ddp.parameters(), lr=lr)),
        "partial": _step(partial_ddp, torch.optim.SGD(partial_ddp.parameters(), lr=lr)),
        "inner": _on(
            on_capture_stream, _step(inner_ddp, torch.optim.SGD(inner_ddp.parameters(), lr=lr))
        ),
        "whole": CudaGraphModule(
            _step(whole_ddp, torch.optim.SGD(whole_ddp.parameters(), lr=lr)),
            warmup=12,
            backend=backend.name,
        ),
    }
    for _ in range(20):
        x, y = backend.randn(16, 8), backend.randn(16, 1)
        losses = {kind: step(x, y) for kind, step in steps.items()}
        for kind in ("partial", "inner", "whole"):
            torch.testing.assert_close(losses[kind], losses["eager"])
    assert _replayed(inner_ddp.module.graphed)
    for model in (partial, inner, whole):
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p, q)


# Two processes (gloo and the emulation on CPU, NCCL and a GPU each with two GPUs).
RANK_CASES = ["exact_same", "exact_differ", "buckets", "buckets_above"] + (
    ["capture_fails"] if HAS_CUDA else []
)
TWO_RANKS = early(
    "two ranks",
    *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
    *(str(Path(__file__).with_name("ddp_ranks.py")), *RANK_CASES),
    when=not HAS_CUDA or torch.cuda.device_count() >= 2,
    background=False,  # two ranks: both cores
    timeout=300,  # a hang fails the test
)


@pytest.mark.early("two ranks")
def test_two_ranks_agree_on_graphs_and_on_failed_captures() -> None:
    # The ranks replay the same graph with shapes=, raise the same error when they cannot,
    # and a capture that fails on one rank fails on both (CUDA: the emulation runs the
    # step's collectives at its capture, where a CUDA capture records them).
    if not TWO_RANKS.when:
        pytest.skip("needs two GPUs (one process per GPU)")
    result = TWO_RANKS.result()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for rank in (0, 1):
        for case in RANK_CASES:
            assert f"rank {rank}: {case} ok" in result.stdout, result.stdout
