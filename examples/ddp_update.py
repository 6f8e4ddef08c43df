"""A DistributedDataParallel training step, graphed in part and whole.

Launch one process per GPU (run as a script, it is a group of one process):

    torchrun --nproc-per-node 2 examples/ddp_update.py

Three ways to run the same update of an MLP regression (Adam, a batch per rank), each
checked against the others after ``--steps`` updates (same start, same batches):

- ``eager``: DDP as usual.
- ``partial``: the module's forward and backward graphed by ``make_graphed_callables``
  before DDP wraps it; DDP all-reduces the gradients outside the graphs.
- ``whole``: the whole step (forward, backward with its all-reduce, ``optimizer.step()``)
  captured by ``CudaGraphModule``, with DDP built on the library's capture stream, and 11
  eager iterations before the capture (``warmup=12``).

Every rank checks that its parameters equal the eager twin's and rank 0's. On GPUs (NCCL)
rank 0 then prints updates per second of each. On a machine without CUDA the processes use
gloo, and the graphed variants run on the library's CPU emulation (so CI runs the checks);
there is nothing to time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cudagraph_td import (
    CudaGraphModule,
    capturable_on_cpu,
    capture_stream,
    make_graphed_callables,
)

BATCH, FEATURES, HIDDEN = 256, 32, 256
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    )  # fmt: skip


def build(kind: str, net: nn.Module, device: torch.device) -> tuple[Step, nn.Module]:
    """The update of ``kind`` on a copy of ``net``, and that copy."""
    cuda = device.type == "cuda"
    backend = "cuda" if cuda else "emulate"
    model = copy.deepcopy(net)
    ids = [device.index] if cuda else None
    if kind == "partial":  # graphed before DDP wraps it: DDP's hooks see its gradients
        sample = torch.randn(BATCH, FEATURES, device=device)
        ddp = DDP(make_graphed_callables(model, (sample,), backend=backend), device_ids=ids)
    elif kind == "whole":  # its gradient accumulators made on the capture stream
        with torch.cuda.stream(capture_stream(device)) if cuda else contextlib.nullcontext():
            ddp = DDP(model, device_ids=ids)
    else:
        ddp = DDP(model, device_ids=ids)
    # A captured step needs a tensor learning rate and Adam's state on the GPU; every
    # variant uses the same Adam, so that they compute the same updates (on the CPU, torch
    # takes `capturable=True` inside `capturable_on_cpu()`, where the check runs).
    lr = torch.tensor(1e-3, device=device)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=lr, capturable=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    if kind == "whole":
        return CudaGraphModule(step, warmup=12, backend=backend), model
    return step, model


def check(models: dict[str, nn.Module]) -> None:
    """Every variant's parameters equal the eager one's, and rank 0's."""
    flat = {k: torch.cat([p.detach().flatten() for p in m.parameters()]) for k, m in models.items()}
    problems = []
    for kind, params in flat.items():
        gap = (params - flat["eager"]).abs().max().item()
        if not torch.allclose(params, flat["eager"], rtol=1e-4, atol=1e-5):
            problems.append(f"{kind}: {gap:.3g} from eager at most")
        gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, params)
        for rank, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                problems.append(f"{kind}: rank {rank} differs from rank 0")
    assert not problems, f"rank {dist.get_rank()}: " + "; ".join(problems)


def updates_per_second(step: Step, x: torch.Tensor, y: torch.Tensor, n: int) -> float:
    for _ in range(3):
        step(x, y)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step(x, y)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="updates before the check")
    parser.add_argument("--timed", type=int, default=300, help="updates timed per variant")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    else:  # run as a script: a group of one process
        dist.init_process_group(
            "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    net = mlp().to(device)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    batches = [
        (torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 1, generator=generator))
        for _ in range(args.steps)
    ]  # fmt: skip
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    variants = {kind: build(kind, net, device) for kind in ("eager", "partial", "whole")}
    with capturable_on_cpu():  # the eager variants step the capturable Adam on the CPU too
        for x, y in batches:
            losses = {kind: step(x, y) for kind, (step, _) in variants.items()}
    check({kind: model for kind, (_, model) in variants.items()})
    if rank == 0:
        shown = ", ".join(f"{k} {v.item():.4f}" for k, v in losses.items())
        print(f"{dist.get_world_size()} ranks, {args.steps} updates: parameters equal "
              f"across variants and ranks; last losses: {shown}")  # fmt: skip
    if cuda:
        x, y = batches[0]
        rates = {k: updates_per_second(step, x, y, args.timed) for k, (step, _) in variants.items()}
        if rank == 0:
            for kind, rate in rates.items():
                print(f"{kind:8s} {rate:10,.0f} updates/s ({rate / rates['eager']:.2f}x eager)")
    elif rank == 0:
        print("no CUDA: the graphed variants ran on the CPU emulation; nothing to time")
    # Graphs that captured collectives hold on to the communicator: dropped first, so that
    # destroying the process group does not wait for them.
    del variants
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
