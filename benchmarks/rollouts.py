"""Whole rollouts on the GPU, timed: environment steps per second of torchrl's PendulumEnv.

For each number of environments (``--envs``), in rounds that interleave the variants:
the eager per-step loop; the per-step loop with the policy graphed (``CudaGraphModule``);
the whole K-step rollout graphed, for each K of ``--steps``; and torchrl's ``Collector``
over the same pendulums (a ``PendulumEnv`` with a batch size) and the same policy network,
with tensordict's ``cudagraph_policy`` on CUDA (batches of N x K frames). The rollout is
``examples/gpu_rollout.py``'s (policy, ``PendulumEnv._step``, resets with ``torch.where``,
the trajectory written in place). Each timing runs ``--calls`` rollouts of K steps between
two synchronisations; the report gives the median over the rounds, with their range, and
the ratio of each variant to the eager loop, in one run. Without CUDA, on the emulation
(a smoke test: those timings are not a GPU's).

    python benchmarks/rollouts.py --envs 256,1024,4096 --steps 16,64 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import CudaGraphModule

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "gpu_rollout.py"


def _example() -> Any:
    """``examples/gpu_rollout.py``, imported from its file."""
    spec = importlib.util.spec_from_file_location("gpu_rollout", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(
    example: Any, envs: int, steps: list[int], device: torch.device, closing: list[Any]
) -> dict[str, Any]:
    """Each variant's call (K steps of every environment) and its K; what must be shut down
    goes into ``closing``."""
    backend: Literal["cuda", "emulate"] = "cuda" if device.type == "cuda" else "emulate"
    found: dict[str, Any] = {}
    for k in steps:
        rollout = example.Rollout(envs, k, 200, device)
        if k == steps[0]:  # the per-step loops, timed over as many steps
            policy = CudaGraphModule(rollout.policy, backend=backend)
            found["eager, per step"] = (rollout.caller(rollout.run), k)
            graphed_policy = functools.partial(rollout.run, act=policy)
            found["policy graphed"] = (rollout.caller(graphed_policy), k)
        whole = CudaGraphModule(rollout.run, backend=backend)
        found[f"whole rollout graphed, K={k}"] = (rollout.caller(whole), k)
    first = example.Rollout(envs, steps[0], 200, device)
    call, collector = _collector(example, first, device.type == "cuda")
    closing.append(collector)
    name = "torchrl collector" + (", cudagraph_policy" if device.type == "cuda" else "")
    found[name] = (call, steps[0])
    return found


def _collector(example: Any, rollout: Any, cuda: bool) -> tuple[Callable[[], None], Any]:
    """torchrl's collector over N pendulums with the rollout's policy network: a call takes
    one batch of N x K frames. Returns the call and the collector (to shut down)."""
    from torchrl.collectors import Collector
    from torchrl.data import Bounded, Composite, Unbounded
    from torchrl.envs.utils import make_composite_from_td

    envs, device = rollout.envs, rollout.device

    class BatchedPendulum(example.PendulumEnv):  # type: ignore[misc]
        """``PendulumEnv`` with a batch size: N pendulums stepped as one batch."""

        def _make_spec(self, td_params: Any) -> None:
            self.batch_size = torch.Size([envs])
            params = self.gen_params(batch_size=[envs], device=device)["params"]
            self.observation_spec = Composite(
                th=Bounded(low=-torch.pi, high=torch.pi, shape=(envs,), dtype=torch.float32),
                thdot=Bounded(low=-8.0, high=8.0, shape=(envs,), dtype=torch.float32),
                params=make_composite_from_td(params, unsqueeze_null_shapes=False),
                shape=(envs,),
            )
            self.state_spec = self.observation_spec.clone()
            self.action_spec = Bounded(low=-2.0, high=2.0, shape=(envs, 1), dtype=torch.float32)
            self.reward_spec = Unbounded(shape=(envs, 1))

    class Features(nn.Module):
        """The rollout's policy network, on the pendulum's angle and speed."""

        def __init__(self, net: nn.Module):
            super().__init__()
            self.net = net

        def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
            return self.net(torch.stack([th.cos(), th.sin(), thdot], -1))  # type: ignore[no-any-return]

    policy = TensorDictModule(
        Features(rollout.policy.module), in_keys=["th", "thdot"], out_keys=["action"]
    )
    collector = Collector(
        BatchedPendulum(device=device),
        policy,
        frames_per_batch=envs * rollout.steps,
        total_frames=-1,
        max_frames_per_traj=rollout.horizon,
        device=device,
        cudagraph_policy=cuda,  # tensordict's class, which needs CUDA
        auto_register_policy_transforms=False,
    )
    batches = iter(collector)

    def call() -> None:
        next(batches)

    return call, collector


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
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    results: dict[str, Any] = {"meta": meta}
    with torch.no_grad():
        for envs in (int(n) for n in args.envs.split(",")):
            torch.manual_seed(0)
            closing: list[Any] = []
            found = variants(example, envs, ks, device, closing)
            for call, _ in found.values():  # warm-ups and captures
                for _ in range(3):
                    call()
            print(f"{envs} environments ({meta['device']})")
            results[str(envs)] = time_variants(found, envs, ks, args.rounds, args.calls)
            for collector in closing:
                collector.shutdown()
    if not cuda:
        print("(on the CPU emulation: a smoke test, not a GPU's timings)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


def time_variants(
    found: dict[str, tuple[Callable[[], Any], int]],
    envs: int,
    ks: list[int],
    rounds: int,
    calls: int,
) -> dict[str, Any]:
    """Time each variant (its call: K steps of every environment; its K) in ``rounds``
    rounds that interleave them, each timing ``calls`` rollouts of the largest K (as many
    environment steps for every variant); print each variant's median steps per second, its
    ratio to ``"eager, per step"`` and where the time goes, and return the rounds with their
    medians (see `medians`)."""
    cuda = torch.cuda.is_available()
    rates: dict[str, list[float]] = {name: [] for name in found}
    # Where the time goes: the CPU's time to issue a step, and the GPU's time a step (CUDA
    # events around the same calls); a graph's step is GPU-bound when the first is below
    # the second.
    issue: dict[str, list[float]] = {name: [] for name in found}
    gpu: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(rounds):
        for name, (call, k) in found.items():
            repeats = max(1, calls * ks[-1] // k)
            if cuda:
                torch.cuda.synchronize()
                begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record()
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            issued = time.perf_counter() - start
            if cuda:
                end.record()
                torch.cuda.synchronize()
                gpu[name].append(begin.elapsed_time(end) * 1e3 / (repeats * k))
            issue[name].append(issued * 1e6 / (repeats * k))
            rates[name].append(repeats * k * envs / (time.perf_counter() - start))
    eager = statistics.median(rates["eager, per step"])
    for name, each in rates.items():
        median = statistics.median(each)
        where = f"  CPU {statistics.median(issue[name]):8.1f} us/step issued"
        if gpu[name]:
            where += f", GPU {statistics.median(gpu[name]):8.1f} us/step"
        print(
            f"  {name:32s} {median:14,.0f} steps/s  x{median / eager:6.2f} eager"
            f"  (rounds {min(each):,.0f}..{max(each):,.0f}){where}"
        )
    return medians({"steps_per_s": rates, "cpu_us_per_step": issue, "gpu_us_per_step": gpu})


def medians(measured: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """The rounds of one number of environments, with each variant's median beside them
    (``"median"``: by measure, then by variant), which the docs quote."""
    median = {
        measure: {name: statistics.median(each) for name, each in by_variant.items() if each}
        for measure, by_variant in measured.items()
    }
    return {**measured, "median": median}


if __name__ == "__main__":
    main()
