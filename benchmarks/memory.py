"""GPU memory held by captured graphs: reserved (what other work cannot use), not only allocated.

Each scenario runs in a process of its own (the caching allocator keeps what it reserved), and
prints the memory that its policies and their captures reserve and allocate, beyond the CUDA
context and cuBLAS's eager workspace:

- ``raw shared pool``: 50 small policies captured with ``torch.cuda.graph`` on one pool.
- ``raw private pools``: the same, one pool per graph.
- ``tensordict``: 50 ``tensordict.nn.CudaGraphModule`` wrappers.
- ``cudagraph_td private``: 50 wrappers, each with its own pool (the default).
- ``cudagraph_td shared``: 50 wrappers given one pool (``pool=``).
- ``buckets 10``: one policy, 10 bucket graphs (batch 1 to 512) in its one pool.
- ``bucket largest``: the same policy, only its largest bucket captured.
- ``borrowed private``, ``borrowed shared``, ``buckets 10 borrowed``: the cudagraph_td
  scenarios above with ``outputs="borrowed"`` (lent outputs in memory of their own).

Run: ``python benchmarks/memory.py [--json FILE]`` on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import workloads

POLICIES = 50
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
SCENARIOS: dict[str, Callable[[], list[Any]]] = {}


def scenario(fn: Callable[[], list[Any]]) -> Callable[[], list[Any]]:
    SCENARIOS[fn.__name__.replace("_", " ")] = fn
    return fn


def _policy() -> TensorDictModule:
    return workloads._policy(torch.device("cuda"))  # the policy of workload c


def _td(batch: int = 32) -> TensorDict:
    return TensorDict(observation=torch.randn(batch, 17, device="cuda"), batch_size=[batch])


def _raw(pool: Any) -> list[Any]:
    """``torch.cuda.graph`` captures as torch's documentation shows (one warm-up)."""
    kept = []
    for _ in range(POLICIES):
        net = _policy().module
        static = torch.randn(32, 17, device="cuda")
        kept.append(workloads._hand_graph(lambda s, net=net: net(s[0]), [static], 1, pool))
    return kept


@scenario
def raw_shared_pool() -> list[Any]:
    return _raw(torch.cuda.graph_pool_handle())


@scenario
def raw_private_pools() -> list[Any]:
    return _raw(None)


def _wrapped(make: Callable[[TensorDictModule], Any]) -> list[Any]:
    kept = []
    for _ in range(POLICIES):
        wrapper = make(_policy())
        for _ in range(3):  # warmup=2: a warm-up, the capture, a replay
            wrapper(_td())
        kept.append(wrapper)
    return kept


@scenario
def tensordict() -> list[Any]:
    from tensordict.nn import CudaGraphModule

    return _wrapped(lambda policy: CudaGraphModule(policy, warmup=2))


@scenario
def cudagraph_td_private() -> list[Any]:
    from cudagraph_td import CudaGraphModule

    return _wrapped(lambda policy: CudaGraphModule(policy, warmup=2))


@scenario
def cudagraph_td_shared() -> list[Any]:
    from cudagraph_td import CudaGraphModule

    pool = torch.cuda.graph_pool_handle()
    return _wrapped(lambda policy: CudaGraphModule(policy, warmup=2, pool=pool))


@scenario
def buckets_10() -> list[Any]:
    from cudagraph_td import Buckets, CudaGraphModule

    wrapper = CudaGraphModule(_policy(), warmup=2, shapes=Buckets(BUCKETS))
    for batch in (5, 5, 300):
        wrapper(_td(batch))
    assert len(wrapper.graphs()) == len(BUCKETS), wrapper.graphs()
    return [wrapper]


@scenario
def bucket_largest() -> list[Any]:
    from cudagraph_td import Buckets, CudaGraphModule

    wrapper = CudaGraphModule(_policy(), warmup=2, shapes=Buckets(BUCKETS[-1:]))
    for batch in (5, 5, 300):
        wrapper(_td(batch))
    return [wrapper]


@scenario
def borrowed_private() -> list[Any]:
    from cudagraph_td import CudaGraphModule

    return _wrapped(lambda policy: CudaGraphModule(policy, warmup=2, outputs="borrowed"))


@scenario
def borrowed_shared() -> list[Any]:
    from cudagraph_td import CudaGraphModule

    pool = torch.cuda.graph_pool_handle()
    return _wrapped(lambda policy: CudaGraphModule(policy, warmup=2, pool=pool, outputs="borrowed"))


@scenario
def buckets_10_borrowed() -> list[Any]:
    from cudagraph_td import Buckets, CudaGraphModule

    wrapper = CudaGraphModule(_policy(), warmup=2, shapes=Buckets(BUCKETS), outputs="borrowed")
    for batch in (5, 5, 300):
        wrapper(_td(batch))
    assert len(wrapper.graphs()) == len(BUCKETS), wrapper.graphs()
    return [wrapper]


def measure(name: str) -> dict[str, float]:
    """Run one scenario in this process; the memory its captures hold, in MiB."""
    with torch.no_grad():
        policy = _policy()
        policy(_td())  # CUDA context, cuBLAS handle and workspace: not the graphs'
        params = sum(p.numel() * p.element_size() for p in policy.parameters())
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        kept = SCENARIOS[name]()
        torch.cuda.synchronize()
    return {
        "reserved_mib": (torch.cuda.memory_reserved() - reserved) / 2**20,
        "allocated_mib": (torch.cuda.memory_allocated() - allocated) / 2**20,
        "policy_param_mib": params / 2**20,
        "objects": len(kept),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", help="run one scenario in this process (internal)")
    parser.add_argument("--only", nargs="*", help="the scenarios to run (default: all)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps(measure(args.scenario)))
        return
    results: dict[str, Any] = {}
    for name in args.only or SCENARIOS:
        proc = subprocess.run(
            [sys.executable, __file__, "--scenario", name], capture_output=True, text=True
        )
        if proc.returncode:
            results[name] = {"error": proc.stderr.strip().splitlines()[-1:]}
        else:
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name:24s} {results[name]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
