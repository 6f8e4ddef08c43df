"""PPO epochs over a TensorDict of collected data, one CUDA graph per minibatch update.

The update runs PPO's clipped surrogate objective, the value loss and an entropy bonus,
then a backward, gradient-norm clipping and an Adam step (``capturable=True``, tensor
learning rate), and returns detached metrics. The epoch loop stays in Python: it shuffles
the collected TensorDict and calls the update on each minibatch, which a CudaGraphModule
replays as one graph.

The script checks that the graphed learner tracks an eager twin over whole epochs (same
seed, same data, same shuffles), then prints minibatch updates per second: eager,
``torch.compile``d, graphed, and graphed around the compiled function. On a machine without
CUDA it runs the check on the library's CPU emulation and times the eager update alone.
``--no-compile`` skips the compiled variants.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributions import Normal

from cudagraph_td import CudaGraphModule, capturable_on_cpu

OBS, ACT, HIDDEN = 17, 6, 64
FRAMES, MINIBATCH, EPOCHS = 2048, 64, 2
CLIP, VALUE_COEF, ENTROPY_COEF, MAX_GRAD_NORM = 0.2, 0.5, 0.01, 0.5


def mlp(n_in: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(n_in, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, n_out),
    )


class PPO(nn.Module):
    """A Gaussian actor with a learned log-std, a critic, and one Adam optimizer."""

    def __init__(self, device: torch.device, graphed: bool = True):
        super().__init__()
        self.actor = mlp(OBS, ACT)
        self.log_std = nn.Parameter(torch.full((ACT,), -0.5))
        self.critic = mlp(OBS, 1)
        self.to(device)
        # For a graph: a tensor learning rate (a scheduler may anneal it in place) and
        # `capturable=True`. For eager calls: what is fastest there, a float and foreach Adam.
        if graphed:
            lr = torch.tensor(3e-4, device=device)
            self.opt = torch.optim.Adam(self.parameters(), lr=lr, capturable=True)
        else:
            self.opt = torch.optim.Adam(self.parameters(), lr=3e-4)

    def dist(self, obs: torch.Tensor) -> Normal:
        # No argument validation: it checks values with a host sync at each call.
        return Normal(self.actor(obs), self.log_std.exp(), validate_args=False)

    def update(self, mb: TensorDict) -> TensorDict:
        """One minibatch update; returns detached metrics."""
        dist = self.dist(mb["obs"])
        log_prob = dist.log_prob(mb["action"]).sum(-1)
        ratio = (log_prob - mb["log_prob"]).exp()
        advantage = mb["advantage"]
        surrogate = torch.min(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage)
        policy_loss = -surrogate.mean()
        value_loss = (self.critic(mb["obs"]).squeeze(-1) - mb["value_target"]).pow(2).mean()
        entropy = dist.entropy().sum(-1).mean()
        loss = policy_loss + VALUE_COEF * value_loss - ENTROPY_COEF * entropy
        self.opt.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self.parameters(), MAX_GRAD_NORM)
        self.opt.step()
        return TensorDict(
            policy_loss=policy_loss.detach(),
            value_loss=value_loss.detach(),
            entropy=entropy.detach(),
            grad_norm=grad_norm,
            clip_fraction=((ratio - 1).abs() > CLIP).float().mean().detach(),
        )


def collected_data(agent: PPO, device: torch.device) -> TensorDict:
    """A stand-in for a collector's output: observations, actions and their targets."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    obs = torch.randn(FRAMES, OBS, generator=gen).to(device)
    with torch.no_grad():
        dist = agent.dist(obs)
        action = dist.sample()
        data = TensorDict(
            obs=obs,
            action=action,
            log_prob=dist.log_prob(action).sum(-1),
            advantage=torch.randn(FRAMES, generator=gen).to(device),
            value_target=torch.randn(FRAMES, generator=gen).to(device),
            batch_size=[FRAMES],
        )
    return data


def run_epochs(
    update: Callable[[TensorDict], TensorDict], data: TensorDict, shuffles: list[torch.Tensor]
) -> list[TensorDict]:
    """PPO's inner loop: for each epoch, a shuffle of the data split into minibatches."""
    return [update(data[idx]) for perm in shuffles for idx in perm.split(MINIBATCH)]


def shuffles(n: int, device: torch.device, seed: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randperm(FRAMES, generator=gen).to(device) for _ in range(n)]


def check_parity(backend: str, device: torch.device) -> None:
    torch.manual_seed(0)
    agent = PPO(device)
    twin = copy.deepcopy(agent)
    data = collected_data(agent, device)
    graphed = CudaGraphModule(agent.update, warmup=2, backend=backend)
    perms = shuffles(EPOCHS, device)
    with warnings.catch_warnings():  # torch's hint that capturable=True is for graphs
        warnings.filterwarnings("ignore", "This instance was constructed with capturable")
        twin_metrics = run_epochs(twin.update, data, perms)
    metrics = run_epochs(graphed, data, perms)
    for i, (m, t) in enumerate(zip(metrics, twin_metrics, strict=True)):
        torch.testing.assert_close(
            m.to_dict(), t.to_dict(), rtol=1e-4, atol=1e-5, msg=lambda e, i=i: f"update {i}: {e}"
        )
    torch.testing.assert_close(agent.state_dict(), twin.state_dict(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        agent.opt.state_dict()["state"], twin.opt.state_dict()["state"], rtol=1e-4, atol=1e-5
    )


def updates_per_second(
    make: Callable[[PPO], Callable[[TensorDict], TensorDict]],
    device: torch.device,
    epochs: int,
    graphed: bool,
) -> float:
    agent = PPO(device, graphed)
    update, data = make(agent), collected_data(agent, device)
    run_epochs(update, data, shuffles(1, device, seed=3))  # warm-up, compilation and capture
    perms = shuffles(epochs, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    run_epochs(update, data, perms)
    sync()
    return epochs * (FRAMES // MINIBATCH) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs per variant")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("CUDA graphs need CUDA, which this machine lacks: checking on the CPU emulation.")
    with capturable_on_cpu():  # the eager twin steps the same capturable Adam, on the CPU too
        check_parity("cuda" if cuda else "emulate", device)
    print(
        f"graphed PPO epochs track the eager twin ({EPOCHS} epochs of {FRAMES // MINIBATCH} minibatches)"
    )
    if not cuda:
        rate = updates_per_second(lambda agent: agent.update, device, args.epochs or 1, False)
        print(f"eager:   {rate:10,.0f} updates/s (cpu; no graph to compare without CUDA)")
        return
    variants: dict[str, Callable[[PPO], Callable[[TensorDict], TensorDict]]] = {
        "eager": lambda agent: agent.update,
        "graphed": lambda agent: CudaGraphModule(agent.update, warmup=2),
    }
    if not args.no_compile:
        variants["compiled"] = lambda agent: torch.compile(agent.update)
        variants["graphed+compiled"] = lambda agent: CudaGraphModule(
            torch.compile(agent.update), warmup=3
        )
    rates = {
        name: updates_per_second(make, device, args.epochs or 10, name.startswith("graphed"))
        for name, make in variants.items()
    }
    print(f"device: {torch.cuda.get_device_name()}, minibatch {MINIBATCH}, hidden {HIDDEN}")
    for name, rate in rates.items():
        ratios = f"{rate / rates['eager']:.2f}x eager"
        if "compiled" in rates and name != "compiled":
            ratios += f", {rate / rates['compiled']:.2f}x compiled"
        print(f"{name + ':':18} {rate:10,.0f} updates/s ({ratios})")


if __name__ == "__main__":
    main()
