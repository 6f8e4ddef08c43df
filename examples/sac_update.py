"""A whole SAC update captured as one CUDA graph.

One update of Soft Actor-Critic: the critic loss against the target critics, the actor loss
through the critics, the entropy temperature, three Adam steps (``capturable=True``, tensor
learning rates) and the soft update of the target critics with ``torch._foreach_lerp_``.
The update function takes a TensorDict batch and returns detached metrics; wrapped in a
CudaGraphModule, every call after the capture is one graph replay.

The script checks that the graphed agent tracks an eager twin (same seed, same batches: the
parameters, the optimizer state and the metrics agree), then prints updates per second:
eager, ``torch.compile``d, graphed, and graphed around the compiled function.
On a machine without CUDA it runs the check on the library's CPU emulation, and times the
eager update alone. ``--no-compile`` skips the compiled variants.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings
from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import nn

from cudagraph_td import CudaGraphModule, capturable_on_cpu

OBS, ACT, HIDDEN, BATCH = 17, 6, 256, 256
GAMMA, TAU = 0.99, 0.005


def mlp(n_in: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(n_in, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, n_out),
    )


class SAC(nn.Module):
    """Actor, two critics, their targets, the entropy temperature, and their optimizers."""

    def __init__(self, device: torch.device, graphed: bool = True):
        super().__init__()
        self.actor = mlp(OBS, 2 * ACT)
        self.critics = nn.ModuleList([mlp(OBS + ACT, 1), mlp(OBS + ACT, 1)])
        self.targets = copy.deepcopy(self.critics).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.zeros(()))
        self.to(device)
        # For a graph: tensor learning rates on the graph's device, which a scheduler (or
        # `lr.fill_()`) can change between replays, and `capturable=True`, which keeps Adam's
        # step counts on the GPU (the library's CPU emulation accepts it inside its calls).
        # For eager calls: what is fastest there, float learning rates and foreach Adam.
        capturable = graphed

        def adam(params, lr: float) -> torch.optim.Adam:
            if not graphed:
                return torch.optim.Adam(params, lr=lr)
            return torch.optim.Adam(
                params, lr=torch.tensor(lr, device=device), capturable=capturable
            )

        self.actor_opt = adam(self.actor.parameters(), 3e-4)
        self.critic_opt = adam(self.critics.parameters(), 3e-4)
        self.alpha_opt = adam([self.log_alpha], 3e-4)
        self.target_entropy = -float(ACT)

    def act(self, obs: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A tanh-squashed Gaussian action and its log-probability (reparameterised)."""
        loc, log_scale = self.actor(obs).chunk(2, -1)
        scale = log_scale.clamp(-5, 2).exp()
        pre_tanh = loc + scale * noise
        action = torch.tanh(pre_tanh)
        log_prob = -0.5 * noise.pow(2) - scale.log() - 0.5 * math.log(2 * math.pi)
        log_prob = log_prob - torch.log1p(-action.pow(2) + 1e-6)  # the tanh correction
        return action, log_prob.sum(-1, keepdim=True)

    def q(self, critics: nn.ModuleList, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        obs_action = torch.cat([obs, action], -1)
        return torch.min(critics[0](obs_action), critics[1](obs_action))

    def update(self, batch: TensorDict) -> TensorDict:
        """One SAC update on ``batch``; returns detached metrics.

        The batch carries the Gaussian noise of both action samples, so that a graphed and an
        eager agent see the same random numbers.
        """
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_action, next_log_prob = self.act(batch["next_obs"], batch["next_noise"])
            next_q = self.q(self.targets, batch["next_obs"], next_action) - alpha * next_log_prob
            target_q = batch["reward"] + GAMMA * (1 - batch["done"]) * next_q
        obs_action = torch.cat([batch["obs"], batch["action"]], -1)
        critic_loss = sum((c(obs_action) - target_q).pow(2).mean() for c in self.critics)
        self.critic_opt.zero_grad()
        critic_loss.backward()
        self.critic_opt.step()

        action, log_prob = self.act(batch["obs"], batch["noise"])
        actor_loss = (alpha * log_prob - self.q(self.critics, batch["obs"], action)).mean()
        self.actor_opt.zero_grad()
        actor_loss.backward()
        self.actor_opt.step()

        alpha_loss = -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad()
        alpha_loss.backward()
        self.alpha_opt.step()

        with torch.no_grad():  # the soft update of the target critics, in place
            torch._foreach_lerp_(
                list(self.targets.parameters()), list(self.critics.parameters()), TAU
            )
        return TensorDict(
            critic_loss=critic_loss.detach(),
            actor_loss=actor_loss.detach(),
            alpha=alpha,
        )


def batches(n: int, device: torch.device, seed: int = 1) -> list[TensorDict]:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    return [
        TensorDict(
            obs=randn(BATCH, OBS),
            action=torch.tanh(randn(BATCH, ACT)),
            reward=randn(BATCH, 1),
            next_obs=randn(BATCH, OBS),
            done=(randn(BATCH, 1) > 1.5).float(),
            noise=randn(BATCH, ACT),
            next_noise=randn(BATCH, ACT),
            batch_size=[BATCH],
        )
        for _ in range(n)
    ]


def check_parity(backend: str, device: torch.device) -> None:
    torch.manual_seed(0)
    agent = SAC(device)
    twin = copy.deepcopy(agent)  # the same parameters and optimizer state, run eagerly
    graphed = CudaGraphModule(agent.update, warmup=2, backend=backend)
    for i, batch in enumerate(batches(12, device)):
        with warnings.catch_warnings():  # torch's hint that capturable=True is for graphs
            warnings.filterwarnings("ignore", "This instance was constructed with capturable")
            twin_metrics = twin.update(batch)
        metrics = graphed(batch)
        torch.testing.assert_close(
            metrics.to_dict(), twin_metrics.to_dict(), msg=lambda m, i=i: f"update {i}: {m}"
        )
    torch.testing.assert_close(agent.state_dict(), twin.state_dict(), rtol=1e-4, atol=1e-5)
    for opt, twin_opt in (
        (agent.actor_opt, twin.actor_opt),
        (agent.critic_opt, twin.critic_opt),
        (agent.alpha_opt, twin.alpha_opt),
    ):
        torch.testing.assert_close(
            opt.state_dict()["state"], twin_opt.state_dict()["state"], rtol=1e-4, atol=1e-5
        )


def updates_per_second(
    update: Callable[[TensorDict], TensorDict], data: list[TensorDict], iters: int
) -> float:
    for batch in data[:3]:  # warm-up, compilation and capture
        update(batch)
    sync = torch.cuda.synchronize if data[0]["obs"].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(iters):
        update(data[i % len(data)])
    sync()
    return iters / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--iters", type=int, default=None, help="timed updates per variant")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("CUDA graphs need CUDA, which this machine lacks: checking on the CPU emulation.")
    with capturable_on_cpu():  # the eager twin steps the same capturable Adam, on the CPU too
        check_parity("cuda" if cuda else "emulate", device)
    print("graphed SAC updates track the eager twin (parameters, optimizer state, metrics)")
    if not cuda:
        rate = updates_per_second(
            SAC(device, graphed=False).update, batches(4, device), args.iters or 20
        )
        print(f"eager:   {rate:10,.0f} updates/s (cpu; no graph to compare without CUDA)")
        return
    iters, data = args.iters or 500, batches(8, device)
    variants: dict[str, Callable[[], Callable[[TensorDict], TensorDict]]] = {
        "eager": lambda: SAC(device, graphed=False).update,
        "graphed": lambda: CudaGraphModule(SAC(device).update, warmup=2),
    }
    if not args.no_compile:
        variants["compiled"] = lambda: torch.compile(SAC(device, graphed=False).update)
        variants["graphed+compiled"] = lambda: CudaGraphModule(
            torch.compile(SAC(device).update), warmup=3
        )
    rates = {name: updates_per_second(make(), data, iters) for name, make in variants.items()}
    print(f"device: {torch.cuda.get_device_name()}, batch {BATCH}, hidden {HIDDEN}")
    for name, rate in rates.items():
        ratios = f"{rate / rates['eager']:.2f}x eager"
        if "compiled" in rates and name != "compiled":
            ratios += f", {rate / rates['compiled']:.2f}x compiled"
        print(f"{name + ':':18} {rate:10,.0f} updates/s ({ratios})")


if __name__ == "__main__":
    main()
