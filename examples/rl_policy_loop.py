"""An RL rollout loop: a stochastic TensorDictModule policy drives a batched pendulum.

The policy (an MLP with a Normal head) and the environment step (plain torch) are each
wrapped in a CudaGraphModule. The script checks that the graphed policy gives the eager
policy's actions, then prints eager and graphed environment steps per second. On a machine
without CUDA the wrappers fall back to eager calls, and the script says so.
"""

from __future__ import annotations

import time
import warnings

import torch
from tensordict import TensorDict
from tensordict.nn import (
    InteractionType,
    NormalParamExtractor,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    set_interaction_type,
)
from torch import nn

from cudagraph_td import CudaGraphModule

G, MASS, LENGTH, DT, MAX_SPEED, MAX_TORQUE = 10.0, 1.0, 1.0, 0.05, 8.0, 2.0


def make_policy(device: str) -> ProbabilisticTensorDictSequential:
    net = nn.Sequential(
        nn.Linear(3, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 2),
        NormalParamExtractor(),
    ).to(device)
    return ProbabilisticTensorDictSequential(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        ProbabilisticTensorDictModule(
            in_keys=["loc", "scale"],
            out_keys=["action"],
            distribution_class=torch.distributions.Normal,
        ),
    )


def env_step(
    state: torch.Tensor, action: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of a batch of pendulums: returns the next state, its observation and the reward."""
    theta, speed = state.unbind(-1)
    torque = MAX_TORQUE * torch.tanh(action.squeeze(-1))
    angle = torch.remainder(theta + torch.pi, 2 * torch.pi) - torch.pi
    reward = -(angle**2 + 0.1 * speed**2 + 0.001 * torque**2)
    accel = 3 * G / (2 * LENGTH) * torch.sin(theta) + 3.0 / (MASS * LENGTH**2) * torque
    speed = torch.clamp(speed + accel * DT, -MAX_SPEED, MAX_SPEED)
    theta = theta + speed * DT
    state = torch.stack([theta, speed], -1)
    return state, observe(state), reward.unsqueeze(-1)


def observe(state: torch.Tensor) -> torch.Tensor:
    theta, speed = state.unbind(-1)
    return torch.stack([torch.cos(theta), torch.sin(theta), speed], -1)


def rollout(policy, step, state: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    """Run ``steps`` environment steps; return the summed reward and the seconds taken."""
    td = TensorDict(observation=observe(state), batch_size=[state.shape[0]])
    total = torch.zeros((), device=state.device)
    if state.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        td = policy(td)
        state, obs, reward = step(state, td["action"])
        total += reward.mean()
        td = TensorDict(observation=obs, batch_size=td.batch_size)
    if state.is_cuda:
        torch.cuda.synchronize()
    return total, time.perf_counter() - start


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    policy = make_policy(device)
    if device == "cpu":
        print("CUDA graphs need CUDA, which this machine lacks: running the eager fallback.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on the CPU, the wrappers' warning says the same
        graphed_policy = CudaGraphModule(policy, warmup=2)
        graphed_step = CudaGraphModule(env_step, warmup=2)

    batch, steps = 64, 200 if device == "cuda" else 50
    state = torch.rand(batch, 2, device=device) * torch.tensor(
        [2 * torch.pi, 2.0], device=device
    ) - torch.tensor([torch.pi, 1.0], device=device)
    with torch.no_grad():
        with set_interaction_type(InteractionType.DETERMINISTIC):  # parity: the mode of the policy
            for _ in range(4):
                td = TensorDict(observation=observe(state), batch_size=[batch])
                torch.testing.assert_close(
                    graphed_policy(td.clone())["action"], policy(td)["action"]
                )
            torch.testing.assert_close(
                graphed_step(state, td["action"]), env_step(state, td["action"])
            )
        print("graphed policy and step match eager")
        with set_interaction_type(InteractionType.RANDOM):  # the collector samples actions
            rollout(policy, env_step, state, 10)
            rollout(graphed_policy, graphed_step, state, 10)
            _, eager_s = rollout(policy, env_step, state, steps)
            _, graphed_s = rollout(graphed_policy, graphed_step, state, steps)
    eager_sps, graphed_sps = batch * steps / eager_s, batch * steps / graphed_s
    print(
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {batch} pendulums"
    )
    print(f"eager:   {eager_sps:12,.0f} env steps/s")
    label = "graphed" if device == "cuda" else "wrapped (eager fallback)"
    print(f"{label}: {graphed_sps:12,.0f} env steps/s ({graphed_sps / eager_sps:.2f}x eager)")


if __name__ == "__main__":
    main()
