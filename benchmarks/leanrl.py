"""End to end: LeanRL's SAC, TD3 and PPO loops, environment steps per second, eager against
the graphed ones.

    python benchmarks/leanrl.py [--scripts sac,td3,ppo] [--steps N] [--skip K]
                                [--ppo-iterations I] [--rounds R] [--borrowed]

The loops are the corpus's (``tests/corpus/test_leanrl.py``): each script's networks,
optimizers, update, policy and GAE functions, and its ``CudaGraphModule`` arguments as
they stand in LeanRL, the environment and replay buffer replaced by random tensors of
HalfCheetah's shapes. SAC and TD3 (``--steps`` steps, batches of 256 as in the scripts): a
step is the policy's action (copied to the host, as an environment needs it), the
transition stored and a batch sampled, ``update_main``, and every second step
``update_pol`` (SAC: twice) and the target networks' update. PPO (continuous actions,
``--ppo-iterations`` iterations): an iteration is a rollout of 512 steps (2048 in the
script), GAE, and 10 epochs of minibatches of 64 (as in the script): 80 calls of the
update, ``update(minibatch, tensordict_out=TensorDict())``.

Each variant runs the whole loop, built anew (construction, warm-up and capture
included): ``eager``, tensordict's ``CudaGraphModule`` (for which the scripts were
written) and ``cudagraph_td``'s, in a rotating order per round, in one process; with
``--borrowed``, also ``cudagraph_td, borrowed``: the same loops through
``cudagraph_td.CudaGraphModule(..., outputs="borrowed")``, that option their only change
(a loop that uses an output after its graph's next replay fails with the library's error,
reported as the variant's). The rate
is taken inside the loop, past every warm-up and capture: the time between two calls of
one function (SAC and TD3: ``update_main``, from its call ``--skip``, a step apart; PPO:
``gae``, from its fourth call, an iteration apart), so that building, capturing and the
random steps before learning starts count for none. The median over rounds is reported,
with each variant's ratio to eager, cudagraph_td's to tensordict's, and the borrowed
variant's to both cudagraph_td's default (fresh outputs) and tensordict's.

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
from typing import Any, NamedTuple

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import tensordict.nn  # noqa: E402

from cudagraph_td import CudaGraphModule, _compat  # noqa: E402
from tests.corpus import test_leanrl as leanrl  # noqa: E402


class Script(NamedTuple):
    """A loop to time: ``run(wrap, device, args)`` runs it whole; each call of the function
    named ``clocked`` is a tick of ``steps`` environment steps (an iteration of PPO, a step
    of the others), timed from its tick ``skip(args)``, past every warm-up and capture."""

    run: Callable[[leanrl.Wrap, torch.device, argparse.Namespace], Any]
    clocked: str
    steps: Callable[[argparse.Namespace], int]
    skip: Callable[[argparse.Namespace], int]


def _off_policy(script: Callable[..., dict[str, Any]]) -> Script:
    def run(wrap: leanrl.Wrap, device: torch.device, args: argparse.Namespace) -> Any:
        config = leanrl.OffPolicyArgs(
            total_timesteps=args.steps, learning_starts=10, batch_size=256
        )
        return script(wrap, config, device)

    return Script(run, "update_main", lambda args: 1, lambda args: args.skip)


# PPO on HalfCheetah with the script's minibatches of 64 and 10 epochs; 512 steps per
# iteration (2048 in the script) so that eager runs take seconds: 80 updates an iteration.
PPO_STEPS = 512


def _ppo(wrap: leanrl.Wrap, device: torch.device, args: argparse.Namespace) -> Any:
    config = leanrl.PPOArgs(
        num_envs=1,
        num_steps=PPO_STEPS,
        num_minibatches=PPO_STEPS // 64,
        update_epochs=10,
        num_iterations=args.ppo_iterations,
        learning_rate=3e-4,
        clip_coef=0.2,
        ent_coef=0.0,
    )
    env = leanrl.RandomEnv(1, (leanrl.N_OBS,), torch.float32)
    agent = lambda d: leanrl.ContinuousAgent(leanrl.N_OBS, leanrl.N_ACT, d)  # noqa: E731
    return leanrl.ppo(wrap, config, agent, env, torch.float64, device)


SCRIPTS: dict[str, Script] = {
    "sac": _off_policy(leanrl.sac),
    "td3": _off_policy(leanrl.td3),
    # gae, once an iteration, is captured at its third call (warmup=2): timed from the
    # fourth, the updates and the next rollout between two calls.
    "ppo": Script(_ppo, "gae", lambda args: PPO_STEPS, lambda args: 3),
}


OURS, BORROWED, TD = "cudagraph_td", "cudagraph_td, borrowed", "tensordict"


def variants(backend: str, borrowed: bool = False) -> dict[str, Callable[[], leanrl.Wrap]]:
    found: dict[str, Callable[[], leanrl.Wrap]] = {"eager": leanrl.Wrap}
    if backend == "cuda":
        found[TD] = lambda: leanrl.Wrap(tensordict.nn.CudaGraphModule)
    found[OURS] = lambda: leanrl.Wrap(CudaGraphModule, backend=backend)
    if borrowed:
        found[BORROWED] = lambda: leanrl.Wrap(CudaGraphModule, backend=backend, outputs="borrowed")
    return found


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clocked(leanrl.Wrap):
    """A run's ``Wrap`` that also notes the time of each call of the function ``clocked``."""

    def __init__(self, wrap: leanrl.Wrap, clocked: str):
        super().__init__(wrap.cls, **wrap.options)
        self.made = wrap.made
        self.clocked = clocked
        self.times: list[float] = []

    def __call__(self, fn: Any, **kwargs: Any) -> Any:
        wrapped = super().__call__(fn, **kwargs)
        if getattr(fn, "__name__", "") != self.clocked:
            return wrapped
        times = self.times

        def clocked(*args: Any, **kw: Any) -> Any:
            times.append(time.perf_counter())
            return wrapped(*args, **kw)

        return clocked


def steady_rate(
    script: Script, wrap: leanrl.Wrap, device: torch.device, args: argparse.Namespace
) -> float:
    """Environment steps per second of one run, built anew: the ticks between the clocked
    function's call ``skip`` and its last, over the time between them."""
    clock = Clocked(wrap, script.clocked)
    sync(device)
    script.run(clock, device, args)
    sync(device)
    times = clock.times[script.skip(args) :]
    return (len(times) - 1) * script.steps(args) / (times[-1] - times[0])


def report(name: str, backend: str, device: torch.device, args: argparse.Namespace) -> None:
    """Time ``name``'s loop with each variant and print the steady rates."""
    script = SCRIPTS[name]
    made = variants(backend, args.borrowed)
    names = list(made)
    rates: dict[str, list[float]] = {v: [] for v in names}
    failed: dict[str, str] = {}
    for r in range(args.rounds):
        for variant in names[r % len(names) :] + names[: r % len(names)]:
            if variant in failed:
                continue
            wrap = made[variant]()
            try:
                rates[variant].append(steady_rate(script, wrap, device, args))
            except Exception as err:  # a wrapper that cannot run this loop (the corpus says why)
                failed[variant] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                if device.type == "cuda":
                    leanrl._end_failed_captures(wrap.made, device)
    steady = {v: statistics.median(rates[v]) for v in names if v not in failed}
    print(f"\n{name}: environment steps per second (median of {args.rounds} rounds)")
    width = max(13, *map(len, names))
    for variant, why in failed.items():
        print(f"  {variant:{width}} n/a: {why}")
    for variant in steady:
        each = ", ".join(f"{x:.0f}" for x in rates[variant])
        print(
            f"  {variant:{width}} {steady[variant]:8.1f}  "
            f"{steady[variant] / steady['eager']:5.2f}x eager  (rounds: {each})"
        )
    for a, b in ((OURS, TD), (BORROWED, OURS), (BORROWED, TD)):
        if a in steady and b in steady:
            print(f"  {a} / {b}: {steady[a] / steady[b]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", default="sac,td3,ppo", help="comma-separated: sac, td3, ppo")
    parser.add_argument("--steps", type=int, default=500, help="steps of a run")
    parser.add_argument("--skip", type=int, default=20, help="update calls before timing")
    parser.add_argument("--ppo-iterations", type=int, default=7, help="PPO's iterations")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (median reported)")
    parser.add_argument("--emulate", action="store_true", help="the CPU emulation's graphs")
    parser.add_argument(
        "--borrowed",
        action="store_true",
        help='also time cudagraph_td with outputs="borrowed" (variant "cudagraph_td, borrowed")',
    )
    args = parser.parse_args()
    if args.skip + 12 >= args.steps:
        parser.error("--steps must leave steps to time after --skip and the 10 random ones")
    if args.ppo_iterations < 5:
        parser.error("--ppo-iterations must leave iterations to time after the capture's")
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
