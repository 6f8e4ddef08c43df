"""Whole rollouts on the GPU: K steps of policy and environment in one graph.

torchrl's ``PendulumEnv`` is written in torch, so N pendulums step as one batch on the GPU.
Its step (``PendulumEnv._step``), the policy, the reset of the episodes that ended and the
writing of each transition into a preallocated trajectory TensorDict make one function,
``Rollout.run``, which ``CudaGraphModule`` captures and then replays once per K steps: one
launch instead of a few hundred kernels a step. The rules that make it capturable: no host
synchronisation (no ``if`` on a tensor, no ``.item()``), episodes reset without a branch
(``torch.where`` on the done flags, with states drawn for every environment), and the
trajectory written in place into a buffer made once.

The script checks the graphed rollout's trajectories against an eager run from the same
seed, then prints environment steps per second: the eager per-step loop, the per-step loop
with the policy graphed, and the whole K-step rollout graphed. Without CUDA it runs on the
library's CPU emulation, with a few environments (its timings are not a GPU's).

    pip install torchrl
    python examples/gpu_rollout.py --envs 1024 --steps 16
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

try:
    from torchrl.envs import PendulumEnv
except ImportError as err:  # pragma: no cover - what a user without torchrl sees
    raise SystemExit(f"this example needs torchrl (`pip install torchrl`): {err}") from err

from cudagraph_td import CudaGraphModule


class Rollout:
    """N pendulums and a policy, stepped K steps at a time; episodes of ``horizon`` steps."""

    def __init__(self, envs: int, steps: int, horizon: int, device: torch.device):
        self.envs, self.steps, self.horizon, self.device = envs, steps, horizon, device
        self.env = PendulumEnv(device=device)
        self.params = self.env.gen_params(batch_size=[envs], device=device)["params"]
        net = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
        self.policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action"])
        # The range of a new episode's angle and speed, made once: a tensor made from
        # Python numbers inside the rollout would be a host-to-device copy at each call.
        self.high = torch.tensor([math.pi, 1.0], device=device)

    def start(self) -> TensorDict:
        """The state of N new episodes: angle, speed, and the step within the episode."""
        th, thdot = self.draw()
        t = torch.zeros(self.envs, dtype=torch.long, device=self.device)
        return TensorDict(th=th, thdot=thdot, t=t, batch_size=[self.envs])

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An angle and a speed for each environment, drawn on the device."""
        fresh = (torch.rand(self.envs, 2, device=self.device) * 2 - 1) * self.high
        return fresh[:, 0], fresh[:, 1]

    def trajectory(self) -> TensorDict:
        """The buffer of K transitions of every environment, made once and filled in place."""
        n, k = self.envs, self.steps
        zeros = {"device": self.device}
        return TensorDict(
            observation=torch.zeros(n, k, 3, **zeros),
            action=torch.zeros(n, k, 1, **zeros),
            reward=torch.zeros(n, k, 1, **zeros),
            done=torch.zeros(n, k, 1, dtype=torch.bool, **zeros),
            batch_size=[n, k],
        )

    def observe(self, state: TensorDict) -> TensorDict:
        th, thdot = state["th"], state["thdot"]
        observation = torch.stack([th.cos(), th.sin(), thdot], -1)
        return TensorDict(
            th=th, thdot=thdot, params=self.params, observation=observation,
            batch_size=[self.envs],
        )  # fmt: skip

    def step(self, state: TensorDict, act: Callable[[TensorDict], TensorDict]) -> TensorDict:
        """One step of every environment: the policy (``act``), the pendulum, the reset of
        the episodes that end (branch-free); the transition, and the next state."""
        td = act(self.observe(state))
        out = self.env._step(td)
        t = state["t"] + 1
        done = t >= self.horizon
        th, thdot = self.draw()  # every environment draws: no branch on `done`
        return TensorDict(
            observation=td["observation"],
            action=td["action"],
            reward=out["reward"],
            done=done.unsqueeze(-1),
            th=torch.where(done, th, out["th"]),
            thdot=torch.where(done, thdot, out["thdot"]),
            t=torch.where(done, torch.zeros_like(t), t),
            batch_size=[self.envs],
        )

    def run(
        self,
        state: TensorDict,
        trajectory: TensorDict,
        act: Callable[[TensorDict], TensorDict] | None = None,
    ) -> TensorDict:
        """K steps from ``state``: each transition written into ``trajectory`` (in place), and
        the next state returned. The function that is graphed whole; eager, with ``act`` (a
        graphed policy, say) for the policy, the per-step loop."""
        act = self.policy if act is None else act
        for k in range(self.steps):
            new = self.step(state, act)
            trajectory[:, k].update_(new.select("observation", "action", "reward", "done"))
            state = new.select("th", "thdot", "t")
        return state

    def caller(self, run: Callable[[TensorDict, TensorDict], TensorDict]) -> Callable[[], None]:
        """A call of ``run`` (``self.run``, graphed or not) on episodes of its own: each call
        runs K steps from the state the last one left."""
        state, trajectory = self.start(), self.trajectory()

        def call() -> None:
            nonlocal state
            state = run(state, trajectory)

        return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--envs", type=int, default=1024 if cuda else 8)
    parser.add_argument("--steps", type=int, default=16, help="K: steps per graph replay")
    parser.add_argument("--horizon", type=int, default=200, help="steps per episode")
    parser.add_argument("--calls", type=int, default=50 if cuda else 4, help="timed rollouts")
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    backend = "cuda" if cuda else "emulate"
    torch.manual_seed(0)
    rollout = Rollout(args.envs, args.steps, args.horizon, device)
    whole = CudaGraphModule(rollout.run, backend=backend)
    policy = CudaGraphModule(rollout.policy, backend=backend)

    with torch.no_grad():
        # The graphed rollout's trajectories are eager ones, from the same seed.
        trajectories = []
        for run in (rollout.run, whole):
            torch.manual_seed(1)
            state, trajectory, kept = rollout.start(), rollout.trajectory(), []
            for _ in range(4):  # graphed: a warm-up, the capture, then two replays
                state = run(state, trajectory)
                kept.append(trajectory.clone())
            trajectories.append(torch.stack(kept))
        torch.testing.assert_close(trajectories[1], trajectories[0])
        print(f"trajectories: graphed as eager ({args.envs} environments, {4 * args.steps} steps)")

        variants = {
            "eager, per step": rollout.caller(rollout.run),
            "policy graphed, per step": rollout.caller(functools.partial(rollout.run, act=policy)),
            f"whole {args.steps}-step rollout graphed": rollout.caller(whole),
        }
        for name, call in variants.items():
            for _ in range(3):  # warm-ups and captures
                call()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            rate = args.calls * args.steps * args.envs / elapsed
            print(f"{name:32s} {rate:12,.0f} environment steps/s")
    if not cuda:
        print("(on the CPU emulation: timings of the emulation, not of a GPU)")


if __name__ == "__main__":
    main()
