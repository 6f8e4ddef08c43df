"""Whole rollouts on the GPU, timed: environment steps per second of torchrl's PendulumEnv.

For each number of environments (``--envs``), in rounds that interleave the variants:
the eager per-step loop; the per-step loop with the policy graphed (``CudaGraphModule``);
the whole K-step rollout graphed, for each K of ``--steps``. The rollout is
``examples/gpu_rollout.py``'s (policy, ``PendulumEnv._step``, resets with ``torch.where``,
the trajectory written in place). Each timing runs ``--calls`` rollouts of K steps between
two synchronisations; the report gives the median over the rounds, with their range, and
the ratio of each variant to the eager loop, in one run. Without CUDA, on the emulation
(a smoke test: those timings are not a GPU's).

    python benchmarks/rollouts.py --envs 256,1024,4096 --steps 16,64 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from cudagraph_td import CudaGraphModule

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "gpu_rollout.py"


def _example() -> Any:
    """``examples/gpu_rollout.py``, imported from its file."""
    spec = importlib.util.spec_from_file_location("gpu_rollout", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(example: Any, envs: int, steps: list[int], device: torch.device) -> dict[str, Any]:
    """Each variant's call (K steps of every environment) and its K."""
    backend: Literal["cuda", "emulate"] = "cuda" if device.type == "cuda" else "emulate"
    found: dict[str, Any] = {}
    for k in steps:
        rollout = example.Rollout(envs, k, 200, device)
        if k == steps[0]:  # the per-step loops, timed over as many steps
            policy = CudaGraphModule(rollout.policy, backend=backend)
            for name, act in (("eager, per step", rollout.policy), ("policy graphed", policy)):
                found[name] = (_per_step(rollout, act), k)
        whole = CudaGraphModule(rollout.run, backend=backend)
        found[f"whole rollout graphed, K={k}"] = (_whole(rollout, whole), k)
    return found


def _per_step(rollout: Any, act: Callable[..., Any]) -> Callable[[], None]:
    state, trajectory = rollout.start(), rollout.trajectory()

    def call() -> None:
        nonlocal state
        for k in range(rollout.steps):
            new = rollout.step(state, act)
            trajectory[:, k].update_(new.select("observation", "action", "reward", "done"))
            state = new.select("th", "thdot", "t")

    return call


def _whole(rollout: Any, whole: Callable[..., Any]) -> Callable[[], None]:
    state, trajectory = rollout.start(), rollout.trajectory()

    def call() -> None:
        nonlocal state
        state = whole(state, trajectory)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--envs", default="256,1024,4096" if cuda else "4")
    parser.add_argument("--steps", default="16,64" if cuda else "4", help="K values")
    parser.add_argument("--rounds", type=int, default=5 if cuda else 1)
    parser.add_argument("--calls", type=int, default=20 if cuda else 2, help="rollouts a timing")
    parser.add_argument("--json", default="", help="where to write the results")
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    example = _example()
    ks = [int(k) for k in args.steps.split(",")]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    with torch.no_grad():
        for envs in (int(n) for n in args.envs.split(",")):
            torch.manual_seed(0)
            found = variants(example, envs, ks, device)
            for call, _ in found.values():  # warm-ups and captures
                for _ in range(3):
                    call()
            rates: dict[str, list[float]] = {name: [] for name in found}
            for _ in range(args.rounds):
                for name, (call, k) in found.items():
                    # The same number of environment steps for every variant.
                    repeats = max(1, args.calls * ks[-1] // k)
                    if cuda:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(repeats):
                        call()
                    if cuda:
                        torch.cuda.synchronize()
                    rates[name].append(repeats * k * envs / (time.perf_counter() - start))
            eager = statistics.median(rates["eager, per step"])
            print(f"{envs} environments ({results['device']})")
            for name, each in rates.items():
                median = statistics.median(each)
                print(
                    f"  {name:32s} {median:14,.0f} steps/s  x{median / eager:6.2f} eager"
                    f"  (rounds {min(each):,.0f}..{max(each):,.0f})"
                )
            results[str(envs)] = rates
    if not cuda:
        print("(on the CPU emulation: a smoke test, not a GPU's timings)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
