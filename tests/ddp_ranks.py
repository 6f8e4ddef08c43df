"""Two ranks of a DDP step, for tests/test_distributed.py (launched by torch.distributed.run).

Each case prints ``rank R: CASE ok`` once it checked what every rank must see: the same
graphs, the same errors, parameters equal to an eager DDP twin and across ranks. On CPU:
gloo and the emulation; with a GPU per rank: NCCL and CUDA graphs.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cudagraph_td import Buckets, CudaGraphModule, capturable_on_cpu, capture_stream

CUDA = torch.cuda.is_available()
BACKEND = "cuda" if CUDA else "emulate"


def _setup() -> tuple[int, torch.device]:
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    if CUDA:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if CUDA else "gloo", device_id=device if CUDA else None)
    return rank, device


def _ddp(net: nn.Module, device: torch.device) -> DDP:
    if not CUDA:
        return DDP(net)
    with torch.cuda.stream(capture_stream(device)):  # its accumulators on the capture stream
        return DDP(net, device_ids=[device.index])


def _step(ddp: nn.Module, device: torch.device, fail: list[bool] | None = None) -> Any:
    lr = torch.tensor(1e-2, device=device)
    opt = torch.optim.Adam(ddp.parameters(), lr=lr, capturable=True)  # see `main`

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)  # graphs of several shapes share the gradients
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if fail and fail[0] and torch.cuda.is_current_stream_capturing():
            print(loss.item())  # a host read: this rank's capture fails (DDP's backward done)
        opt.step()
        return loss.detach()

    return step


def _net(device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)


def _batch(n: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)
    return x.to(device), y.to(device)


def _same_on_every_rank(params: Any) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for other in gathered:
        torch.testing.assert_close(other, flat)


def exact_same(rank: int, device: torch.device) -> None:
    """shapes="exact", every rank with the same sizes (8, then 5, in turn): a graph per size
    on every rank, parameters as eager DDP's."""
    eager_net, net = _net(device), _net(device)
    eager = _step(DDP(eager_net, device_ids=[device.index] if CUDA else None), device)
    graphed = CudaGraphModule(
        _step(_ddp(net, device), device), warmup=12, shapes="exact", backend=BACKEND
    )
    for i in range(30):
        x, y = _batch(8 if i % 2 else 5, device, seed=100 * i + rank)
        torch.testing.assert_close(graphed(x, y), eager(x, y))
    for p, q in zip(net.parameters(), eager_net.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    _same_on_every_rank(net.parameters())
    assert sorted(info.key for info in graphed.graphs()) == [((5, 6), (5, 1)), ((8, 6), (8, 1))]
    assert all(info.captured and info.replays for info in graphed.graphs())


def exact_differ(rank: int, device: torch.device) -> None:
    """shapes="exact", ranks with other sizes: the same error on every rank, no hang."""
    graphed = CudaGraphModule(
        _step(_ddp(_net(device), device), device), warmup=12, shapes="exact", backend=BACKEND
    )
    x, y = _batch(8 if rank else 5, device, seed=rank)
    message = "and its ranks were called with other shapes (rank"
    try:
        graphed(x, y)
    except ValueError as err:
        assert message in str(err), err
    else:
        raise AssertionError("no error")


def buckets(rank: int, device: torch.device) -> None:
    """shapes="buckets" (no grad): ranks of 3 and 6 rows both replay the bucket of 8."""
    net = _net(device)
    ddp = _ddp(copy.deepcopy(net), device)

    def evaluate(x: torch.Tensor) -> torch.Tensor:
        return ddp(x)

    graphed = CudaGraphModule(evaluate, warmup=12, shapes="buckets", backend=BACKEND)
    with torch.no_grad():
        for i in range(15):
            x, _ = _batch(6 if rank else 3, device, seed=10 * i + rank)
            torch.testing.assert_close(graphed(x), net(x))
    (info,) = graphed.graphs()
    assert info.key == (8,) and info.captured and info.replays == 3, info


def buckets_above(rank: int, device: torch.device) -> None:
    """A batch above the largest bucket on rank 1 alone: an error on every rank, each
    naming its own batch and where the batch above is."""
    ddp = _ddp(_net(device), device)
    graphed = CudaGraphModule(
        lambda x: ddp(x),
        warmup=12,
        shapes=Buckets([4, 8], overflow="raise"),
        backend=BACKEND,
    )
    expected = (
        "received batch dims [12], above its largest bucket 8"
        if rank
        else "received batch dims [3], and another rank of its DDP step a batch above its "
        "largest bucket 8"
    )
    with torch.no_grad():
        try:
            graphed(_batch(12 if rank else 3, device, seed=rank)[0])
        except RuntimeError as err:
            assert expected in str(err), err
        else:
            raise AssertionError("no error")


def capture_fails(rank: int, device: torch.device) -> None:
    """A capture that fails on rank 1 alone: an error on every rank, then, fixed, a new
    capture on every rank and parameters equal across ranks."""
    net = _net(device)
    fail = [rank == 1]
    graphed = CudaGraphModule(_step(_ddp(net, device), device, fail), warmup=12, backend=BACKEND)
    for i in range(11):
        graphed(*_batch(8, device, seed=10 * i + rank))
    expected = "host" if rank == 1 else "the capture failed on rank(s) [1] of 2"
    try:
        graphed(*_batch(8, device, seed=500 + rank))
    except RuntimeError as err:
        assert "could not capture the graph" in str(err) and expected in str(err), err
    else:
        raise AssertionError("no error")
    assert not graphed.is_captured
    fail[0] = False
    for i in range(5):
        graphed(*_batch(8, device, seed=1000 + 10 * i + rank))
    assert graphed.is_captured
    _same_on_every_rank(net.parameters())


CASES: dict[str, Callable[[int, torch.device], None]] = {
    "exact_same": exact_same,
    "exact_differ": exact_differ,
    "buckets": buckets,
    "buckets_above": buckets_above,
    "capture_fails": capture_fails,
}


def main(names: list[str]) -> None:
    rank, device = _setup()
    # The eager twins step the same capturable Adam as the graphed steps, on the CPU too.
    with capturable_on_cpu():
        _run(names, rank, device)


def _run(names: list[str], rank: int, device: torch.device) -> None:
    try:
        for name in names:
            CASES[name](rank, device)
            gc.collect()  # its graphs freed before the group is destroyed (see the example)
            print(f"rank {rank}: {name} ok", flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    unknown = [name for name in sys.argv[1:] if name not in CASES]
    assert not unknown, f"unknown cases {unknown}; known: {list(CASES)}"
    main(sys.argv[1:])
