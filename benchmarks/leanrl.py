"""End to end: LeanRL's SAC and TD3 loops, steps per second, eager against the graphed ones.

    python benchmarks/leanrl.py [--scripts sac,td3] [--steps N] [--skip K] [--rounds R]

The loops are the corpus's (``tests/corpus/test_leanrl.py``): each script's networks,
optimizers, ``update_main``, ``update_pol`` and policy functions, and its ``CudaGraphModule``
arguments as they stand in LeanRL, the environment and replay buffer replaced by random
tensors of HalfCheetah's shapes, with the scripts' batch size (256). A step is what the
script's main loop does: the policy's action (copied to the host, as an environment needs
it), the transition stored and a batch sampled, ``update_main``, and every second step
``update_pol`` (SAC: twice) and the target networks' update.

Each variant runs the whole loop, built anew (construction, warm-up and capture
included): ``eager``, tensordict's ``CudaGraphModule`` (for which the scripts were
written) and ``cudagraph_td``'s, in a rotating order per round, in one process. The rate
is taken inside the loop: the time between ``update_main``'s call ``--skip`` (past every
warm-up and capture) and its last, over the steps between them (each step calls it once),
so that building, capturing and the random steps before learning starts count for none.
The median over rounds is reported, with each variant's ratio to eager and cudagraph_td's
to tensordict's.

With ``--emulate`` (and on a machine without CUDA), cudagraph_td runs on the CPU
emulation against eager, a few steps: its times say nothing of a GPU's (the test suite
runs it so, so that this script keeps up with the corpus).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import tensordict.nn  # noqa: E402

from cudagraph_td import CudaGraphModule, _compat  # noqa: E402
from tests.corpus import test_leanrl as leanrl  # noqa: E402

SCRIPTS: dict[str, Callable[..., dict[str, Any]]] = {"sac": leanrl.sac, "td3": leanrl.td3}


def variants(backend: str) -> dict[str, Callable[[], leanrl.Wrap]]:
    found: dict[str, Callable[[], leanrl.Wrap]] = {"eager": leanrl.Wrap}
    if backend == "cuda":
        found["tensordict"] = lambda: leanrl.Wrap(tensordict.nn.CudaGraphModule)
    found["cudagraph_td"] = lambda: leanrl.Wrap(CudaGraphModule, backend=backend)
    return found


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clocked(leanrl.Wrap):
    """A run's ``Wrap`` that also notes the time of each call of ``update_main``."""

    def __init__(self, wrap: leanrl.Wrap):
        super().__init__(wrap.cls, **wrap.options)
        self.made = wrap.made
        self.times: list[float] = []

    def __call__(self, fn: Any, **kwargs: Any) -> Any:
        wrapped = super().__call__(fn, **kwargs)
        if getattr(fn, "__name__", "") != "update_main":
            return wrapped
        times = self.times

        def clocked(*args: Any, **kw: Any) -> Any:
            times.append(time.perf_counter())
            return wrapped(*args, **kw)

        return clocked


def steady_rate(
    script: Callable[..., dict[str, Any]],
    wrap: leanrl.Wrap,
    steps: int,
    skip: int,
    device: torch.device,
) -> float:
    """Steps per second of one run of ``steps`` steps, built anew: the steps between
    ``update_main``'s call ``skip`` and its last, over the time between them."""
    clock = Clocked(wrap)
    args = leanrl.OffPolicyArgs(total_timesteps=steps, learning_starts=10, batch_size=256)
    sync(device)
    script(clock, args, device)
    sync(device)
    times = clock.times[skip:]
    return (len(times) - 1) / (times[-1] - times[0])


def report(name: str, backend: str, device: torch.device, args: argparse.Namespace) -> None:
    """Time ``name``'s loop with each variant and print the steady rates."""
    script = SCRIPTS[name]
    made = variants(backend)
    names = list(made)
    rates: dict[str, list[float]] = {v: [] for v in names}
    failed: dict[str, str] = {}
    for r in range(args.rounds):
        for variant in names[r % len(names) :] + names[: r % len(names)]:
            if variant in failed:
                continue
            wrap = made[variant]()
            try:
                rates[variant].append(steady_rate(script, wrap, args.steps, args.skip, device))
            except Exception as err:  # a wrapper that cannot run this loop (the corpus says why)
                failed[variant] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                if device.type == "cuda":
                    leanrl._end_failed_captures(wrap.made, device)
    steady = {v: statistics.median(rates[v]) for v in names if v not in failed}
    print(f"\n{name}: steps per second (median of {args.rounds} rounds)")
    for variant, why in failed.items():
        print(f"  {variant:13} n/a: {why}")
    for variant in steady:
        each = ", ".join(f"{x:.0f}" for x in rates[variant])
        print(
            f"  {variant:13} {steady[variant]:8.1f}  {steady[variant] / steady['eager']:5.2f}x "
            f"eager  (rounds: {each})"
        )
    if "tensordict" in steady:
        print(f"  cudagraph_td / tensordict: {steady['cudagraph_td'] / steady['tensordict']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", default="sac,td3", help="comma-separated: sac, td3")
    parser.add_argument("--steps", type=int, default=500, help="steps of a run")
    parser.add_argument("--skip", type=int, default=20, help="update calls before timing")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (median reported)")
    parser.add_argument("--emulate", action="store_true", help="the CPU emulation's graphs")
    args = parser.parse_args()
    if args.skip + 12 >= args.steps:
        parser.error("--steps must leave steps to time after --skip and the 10 random ones")
    cuda = torch.cuda.is_available() and not args.emulate
    device = torch.device("cuda" if cuda else "cpu")
    backend = "cuda" if cuda else "emulate"
    print(
        f"LeanRL {leanrl.COMMIT[:7]} loops, {device} ({backend}), torch {torch.__version__}, "
        f"tensordict {tensordict.__version__}; {args.steps} steps, timed from update {args.skip}, "
        f"{args.rounds} rounds"
    )
    # The emulation lets capturable optimizers step on the CPU, as the test suite does (the
    # eager runs need it too).
    with _compat.capturable_on_cpu() if not cuda else contextlib.nullcontext():
        for name in [s.strip() for s in args.scripts.split(",") if s.strip()]:
            report(name, backend, device, args)


if __name__ == "__main__":
    main()
