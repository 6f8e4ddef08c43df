"""Whole rollouts in one graph: K steps of a policy and an environment written in torch.

The pattern of ``examples/gpu_rollout.py`` and the docs' "Whole rollouts on the GPU" page,
without torchrl: a batch of pendulums, a policy, resets drawn on the device and kept with
``torch.where`` where an episode ended, each transition written into a preallocated
trajectory. Graphed, it gives eager mode's trajectories from the same seed; its random draws
advance at each replay; a host synchronisation inside is refused with the line and the fix;
the trajectory and the state can stay in the graph's memory (input buffers, borrowed
outputs) under the memory rule.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from .conftest import Backend

ENVS, STEPS, HORIZON = 6, 5, 7


class Pendulums:
    """A batch of pendulums (gym's dynamics), a policy, and a K-step rollout of both."""

    def __init__(self, device: torch.device):
        torch.manual_seed(0)
        self.device = device
        self.policy = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
        self.high = torch.tensor([math.pi, 1.0], device=device)  # made once: see the docs

    def start(self) -> TensorDict:
        th, thdot = self.draw()
        t = torch.zeros(ENVS, dtype=torch.long, device=self.device)
        return TensorDict(th=th, thdot=thdot, t=t, batch_size=[ENVS])

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        fresh = (torch.rand(ENVS, 2, device=self.device) * 2 - 1) * self.high
        return fresh[:, 0], fresh[:, 1]

    def trajectory(self) -> TensorDict:
        zeros = {"device": self.device}
        return TensorDict(
            observation=torch.zeros(ENVS, STEPS, 3, **zeros),
            reward=torch.zeros(ENVS, STEPS, 1, **zeros),
            done=torch.zeros(ENVS, STEPS, 1, dtype=torch.bool, **zeros),
            batch_size=[ENVS, STEPS],
        )

    def run(self, state: TensorDict, trajectory: TensorDict) -> TensorDict:
        th, thdot, t = state["th"], state["thdot"], state["t"]
        for k in range(STEPS):
            observation = torch.stack([th.cos(), th.sin(), thdot], -1)
            u = self.policy(observation).squeeze(-1).clamp(-2.0, 2.0)
            cost = ((th + math.pi) % (2 * math.pi) - math.pi) ** 2 + 0.1 * thdot**2
            thdot = (thdot + (15.0 * th.sin() + 3.0 * u) * 0.05).clamp(-8.0, 8.0)
            th = th + thdot * 0.05
            t = t + 1
            done = t >= HORIZON
            trajectory[:, k].update_(
                TensorDict(
                    observation=observation,
                    reward=-cost.unsqueeze(-1),
                    done=done.unsqueeze(-1),
                    batch_size=[ENVS],
                )
            )
            new_th, new_thdot = self.draw()  # every environment draws: no branch on `done`
            th = torch.where(done, new_th, th)
            thdot = torch.where(done, new_thdot, thdot)
            t = torch.where(done, torch.zeros_like(t), t)
        return TensorDict(th=th, thdot=thdot, t=t, batch_size=[ENVS])


def _trajectories(run: object, env: Pendulums, calls: int, seed: int) -> list[TensorDict]:
    torch.manual_seed(seed)
    state, trajectory, kept = env.start(), env.trajectory(), []
    for _ in range(calls):
        state = run(state, trajectory)  # type: ignore[operator]
        kept.append(trajectory.clone())
    return kept


@torch.no_grad()
def test_a_graphed_rollout_gives_eager_trajectories(backend: Backend) -> None:
    env = Pendulums(backend.device)
    graphed = backend.wrap(env.run, warmup=2)
    eager = _trajectories(env.run, env, 6, seed=1)
    replayed = _trajectories(graphed, env, 6, seed=1)
    assert [info.replays for info in graphed.graphs()] == [4]
    for expected, actual in zip(eager, replayed, strict=True):
        torch.testing.assert_close(actual, expected)
    # Episodes ended and reset within the replays (HORIZON < calls * STEPS).
    assert bool(torch.stack(replayed)["done"].any())


@torch.no_grad()
def test_the_resets_draw_new_numbers_at_each_replay(backend: Backend) -> None:
    env = Pendulums(backend.device)
    graphed = backend.wrap(env.draw, warmup=2)
    draws = [graphed()[0].clone() for _ in range(5)]
    for earlier, later in itertools.pairwise(draws):
        assert not torch.equal(earlier, later)


def _with_a_host_sync(x: torch.Tensor) -> torch.Tensor:
    done = x > 0
    if done.any():  # a host read of a tensor's value
        x = torch.zeros_like(x)
    return x


def test_a_host_sync_in_a_rollout_is_refused_with_its_line(backend: Backend) -> None:
    graphed = backend.wrap(_with_a_host_sync, warmup=1)
    with pytest.raises(RuntimeError) as raised:
        graphed(backend.randn(4))
    message = str(raised.value)
    assert re.search(r"test_rollout\.py:\d+ \(`if done\.any\(\):", message), message
    assert "`torch.where`" in message


@torch.no_grad()
def test_a_rollout_in_the_graphs_memory_keeps_the_memory_rule(backend: Backend) -> None:
    # The state and the trajectory in the graph's input buffers, the next state lent: each
    # call moves no memory but the launch. What a replay overwrites raises when read after.
    env = Pendulums(backend.device)
    graphed = backend.wrap(env.run, warmup=2, outputs="borrowed")
    eager = _trajectories(env.run, env, 6, seed=2)
    torch.manual_seed(2)
    state, trajectory = env.start(), env.trajectory()
    for _ in range(3):  # a warm-up, the capture, a replay
        state = graphed(state, trajectory).clone()
    (buffers, trajectory_buffers), _ = graphed.input_buffers(state, trajectory)
    buffers.update_(state)
    trajectory_buffers.update_(trajectory)
    for call in range(3, 6):
        lent = graphed(buffers, trajectory_buffers)
        torch.testing.assert_close(trajectory_buffers, eager[call])
        buffers.update_(lent)  # the next call's state, into the graph's own input
    graphed(buffers, trajectory_buffers)
    with pytest.raises(RuntimeError, match="overwritten"):
        lent["th"].sum()


# A simulator bound to torch as one operator (as MuJoCo Warp's step is in
# benchmarks/mjwarp_cheetah.py): the state it carries from step to step is its arguments,
# written in place and declared so. The emulated capture runs the operator (a CUDA capture
# runs nothing) and undoes the writes that the schema declares; the first replay then starts
# from the state the capturing call left, as on CUDA.
@torch.library.custom_op("cudagraph_td_tests::pendulum_step", mutates_args=("th", "thdot"))
def _pendulum_step(th: torch.Tensor, thdot: torch.Tensor, u: torch.Tensor) -> None:
    thdot.copy_((thdot + (15.0 * th.sin() + 3.0 * u) * 0.05).clamp(-8.0, 8.0))
    th.add_(thdot * 0.05)


class SimulatedPendulums(Pendulums):
    """`Pendulums` whose state lives in the simulator (not in the rollout's inputs)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.th = torch.zeros(ENVS, device=device)
        self.thdot = torch.zeros(ENVS, device=device)

    def start(self) -> TensorDict:
        th, thdot = self.draw()
        self.th.copy_(th)
        self.thdot.copy_(thdot)
        t = torch.zeros(ENVS, dtype=torch.long, device=self.device)
        return TensorDict(t=t, batch_size=[ENVS])

    def run(self, state: TensorDict, trajectory: TensorDict) -> TensorDict:
        t = state["t"]
        for k in range(STEPS):
            observation = torch.stack([self.th.cos(), self.th.sin(), self.thdot], -1)
            u = self.policy(observation).squeeze(-1).clamp(-2.0, 2.0)
            _pendulum_step(self.th, self.thdot, u)
            t = t + 1
            done = t >= HORIZON
            trajectory[:, k].update_(
                TensorDict(
                    observation=observation,
                    reward=-u.square().unsqueeze(-1),
                    done=done.unsqueeze(-1),
                    batch_size=[ENVS],
                )
            )
            new_th, new_thdot = self.draw()
            self.th.copy_(torch.where(done, new_th, self.th))
            self.thdot.copy_(torch.where(done, new_thdot, self.thdot))
            t = torch.where(done, torch.zeros_like(t), t)
        return TensorDict(t=t, batch_size=[ENVS])


@torch.no_grad()
def test_a_simulator_operator_that_declares_its_state_gives_eager_trajectories(
    backend: Backend,
) -> None:
    env = SimulatedPendulums(backend.device)
    graphed = backend.wrap(env.run, warmup=2)
    eager = _trajectories(env.run, env, 6, seed=3)
    replayed = _trajectories(graphed, env, 6, seed=3)
    assert [info.replays for info in graphed.graphs()] == [4]
    for expected, actual in zip(eager, replayed, strict=True):
        torch.testing.assert_close(actual, expected)
