"""LeanRL (github.com/pytorch-labs/LeanRL at commit 8dbb6336b7f6cc65cdbbeb2e86637c38867e2677):
its five ``leanrl/*_torchcompile.py`` scripts, run with ``--cudagraphs``.

Each test rebuilds one script's networks, optimizers, update and policy functions and its
``CudaGraphModule(...)`` arguments as they stand in the script (written from reading it, not
copied), with the environment (and torchrl's replay buffer) replaced by random tensors of
the environment's shapes, drawn from a generator of their own: both runs see the same data.
A run collects and updates as the script's main loop does, at small sizes (each test's
``Args`` says which). The run with this library's ``CudaGraphModule`` must match an eager
twin: the same code without the wrapper, seeded alike (once, as the scripts are), on the
same data and initial weights. On CUDA, tensordict's ``CudaGraphModule``, for which the
scripts were written, runs the same code; its outcome is recorded, not asserted.

LeanRL was written against tensordict's nightly builds of September 2024, whose
``to_module`` put the given tensors into a module as they are: ``from_module(agent).data
.to_module(agent_inference)`` made a copy of the agent without gradients, for the rollouts.
tensordict 0.14 and 0.15 keep a module's parameters parameters by default
(``preserve_module_state=True``), and that copy requires grad: the PPO scripts then fail in
eager mode too (the second minibatch's backward goes through the rollout's graph again), and
so do SAC's and TD3's ``.numpy()`` of an action. Every ``to_module`` of the scripts is called
here with ``preserve_module_state=False``, the behaviour they were written for.

``--compile`` is off: the emulation records ATen operations, which inductor's kernels are
not, and a CUDA-only variant would compile ten functions three times (eager twin, ours,
tensordict's), minutes of GPU time. Without ``--compile``, the PPO loops'
``torch.compiler.cudagraph_mark_step_begin()`` does nothing (it marks steps for
``torch.compile``'s own graphs): left out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import optree
import pytest
import tensordict
import torch
import torch.nn.functional as F
from tensordict import TensorDict, from_module, from_modules
from tensordict.nn import TensorDictModule
from torch import nn
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal

from cudagraph_td import CudaGraphModule, _compat

from ..conftest import Backend
from .conftest import OnReplayPath, Recorder, same

SOURCE = "LeanRL"
COMMIT = "8dbb6336b7f6cc65cdbbeb2e86637c38867e2677"

# float32 (PPO continuous: float64 advantages), 8 to 24 Adam steps per network. The
# emulation replays eager's own kernels in eager's order: its runs match bitwise. On CUDA,
# the backward of `gather` (DQN) and of convolutions (Atari PPO) add with atomics in an
# order that changes from run to run, eager against eager too, at float32's rounding
# (~1e-7 relative per operation), which a few Adam steps keep at that scale. A missed or
# stale update moves a weight by about the learning rate (2.5e-4 to 1e-3 per Adam step),
# far above 1e-5 + 1e-4 |w| for the weights here (|w| < 1). On CUDA, values derived from
# several such networks (Atari PPO's advantages: differences of values, near zero) move by
# up to ~1e-4 absolute (7e-5 seen on the H100, eager against graph): an absolute 1e-4
# there, still under one Adam step.
RTOL, ATOL = 1e-4, 1e-5
ATOL_CUDA = 1e-4


def _atol(backend: str) -> float:
    return ATOL_CUDA if backend == "cuda" else ATOL


class Wrap:
    """How a run wraps the script's functions: not at all (the eager twin), or with a
    ``CudaGraphModule`` class; ``made`` keeps the wrappers it made."""

    def __init__(self, cls: Any = None, **options: Any):
        self.cls = cls
        self.options = options
        self.made: list[Any] = []

    def keep(self, result: Any) -> Any:
        """What the test records of a call's result, to compare at the end: the result itself,
        or, where the outputs are borrowed, a copy. The recording is the test's, not the
        script's: the scripts do not keep these results across calls (they log the last)."""
        if self.options.get("outputs") != "borrowed":
            return result
        return optree.tree_map(torch.clone, result)

    def __call__(self, fn: Any, **kwargs: Any) -> Any:
        if self.cls is None:
            return fn
        wrapped = self.cls(fn, **kwargs, **self.options)
        self.made.append(wrapped)
        return wrapped


def _eager() -> Wrap:
    return Wrap()


class Counting(Wrap):
    """This library's wrapper, each one's calls that fell off the replay path counted."""

    def __init__(self, backend: Backend, **options: Any):
        super().__init__(CudaGraphModule, backend=backend.name, **options)
        self.replay_path = OnReplayPath()

    def __call__(self, fn: Any, **kwargs: Any) -> Any:
        return self.replay_path.watch(super().__call__(fn, **kwargs))


def _ours(backend: Backend, **options: Any) -> Counting:
    return Counting(backend, **options)


def _tensordicts() -> Wrap:
    return Wrap(tensordict.nn.CudaGraphModule)


Split = Callable[[dict[str, Any]], tuple[dict[str, Any], Any]]


def _whole(result: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    return result, None


def compare(
    got: dict[str, Any], eager: dict[str, Any], split: Split, why: str, atol: float = ATOL
) -> tuple[str, str]:
    """The outcome of a run against the eager one, for the corpus table: ``split`` sets
    apart what differs for a known reason, ``why``, given as the detail."""
    kept, aside = split(got)
    eager_kept, eager_aside = split(eager)
    if not same(kept, eager_kept, RTOL, atol):
        return "differs from eager", ""
    if not same(aside, eager_aside, RTOL, atol):
        return "differs from eager", why
    return "matches eager", ""


def check(
    record: Recorder,
    backend: Backend,
    run: Callable[[Wrap], dict[str, Any]],
    split: Split = _whole,
    why: str = "",
    **options: Any,
) -> None:
    """Run ``run`` eagerly and with this library's wrapper, whose result must match (but
    what ``split`` sets apart, for the reason ``why``), every wrapper captured and replayed;
    on CUDA, with tensordict's too. Both outcomes are recorded. ``options``: the library's
    wrapper's (``outputs="borrowed"``); with any, tensordict's class is not run (the
    script's row without them runs it)."""
    eager = run(_eager())
    ours = _ours(backend, **options)
    try:
        got = run(ours)
    except Exception as err:
        record("cudagraph_td", "raises", _first_line(err), backend=backend.name)
        raise
    atol = _atol(backend.name)
    record("cudagraph_td", *compare(got, eager, split, why, atol), backend=backend.name)
    torch.testing.assert_close(split(got)[0], split(eager)[0], rtol=RTOL, atol=atol)
    for wrapper in ours.made:
        assert any(info.captured and info.replays for info in wrapper.graphs()), wrapper
    # Every call after a graph's capture replays on the replay path: none is answered by
    # the slow path's full check (LeanRL's updates were, at every call, until 2026-11-25).
    ours.replay_path.check()
    if options:
        return
    if backend.name != "cuda":
        record("tensordict", "not run", "needs CUDA", backend=backend.name)
        return
    first_pool = _next_pool_number(backend.device)
    theirs = _tensordicts()
    try:
        with warnings.catch_warnings():  # tensordict's and torch's own, theirs to settle
            warnings.simplefilter("ignore")
            got = run(theirs)
    except Exception as err:  # recorded, not raised: another wrapper's outcome
        record("tensordict", "raises", _first_line(err), backend=backend.name)
        _end_failed_captures(theirs.made, backend.device, first_pool)
        return
    record("tensordict", *compare(got, eager, split, why, atol), backend=backend.name)


# The graphs of tensordict's captures that failed, kept for the process. torch 2.11 leaves
# both allocators routing a failed capture's allocations to its pool, through a filter that
# reads its graph (pytorch#180395 ends them first): freed, that graph would leave a dangling
# pointer there, which a later CUDAGraph made at the same address answers to, and whose
# capture would then allocate in the failed one's pool, beside whatever else has.
FAILED_CAPTURES: list[Any] = []


def _next_pool_number(device: torch.device) -> int:
    """``n`` of the id ``(n, 0)`` of the pool that the next capture without a pool given
    will make for itself, read from a capture of one kernel. That capture ends well, which
    also clears the CUDA generator's mark as capturing that a failed capture leaves (the next
    random operation outside a graph would fail)."""
    torch.cuda.synchronize(device)
    with torch.cuda.stream(torch.cuda.Stream(device)):  # never on the default stream
        return int(_compat.one_node_graph(device).pool()[0]) + 1


def _end_failed_captures(wrappers: list[Any], device: torch.device, first_pool: int) -> None:
    """Undo what captures that failed inside ``torch.cuda.graph`` (tensordict's class
    captures with it, each into a pool of its own) leave behind on torch 2.11, for the tests
    that follow, as the library does for its own (`_compat.end_failed_capture`): the caching
    allocator's routing of each pool made since ``first_pool`` that is still routed (a
    failed capture's: ``graph.pool()`` refuses to name it), and the graphs, kept."""
    FAILED_CAPTURES.extend(
        graph for wrapper in wrappers if (graph := getattr(wrapper, "graph", None)) is not None
    )
    for number in range(first_pool, _next_pool_number(device)):
        with contextlib.suppress(RuntimeError):  # not routed: its capture ended well
            _compat.end_allocate_to_pool(device, (number, 0))


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


def _snapshot(module: Any) -> dict[str, torch.Tensor]:
    """The values of ``module``'s parameters and buffers (a module or a TensorDict) now."""
    params = from_module(module) if isinstance(module, nn.Module) else module
    return {
        ".".join(key): value.detach().clone() for key, value in params.flatten_keys(".").items()
    }


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [
        {key: value.detach().clone() for key, value in state.items()}
        for state in optimizer.state.values()
    ]


class RandomEnv:
    """A script's vectorised environment: random observations (of its shape and dtype),
    rewards and dones, on the CPU as the environments return them, from a generator of its
    own. Episode statistics, truncations and final observations are left out: they feed
    the scripts' logs, not their networks."""

    def __init__(
        self, num_envs: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype, seed: int = 1
    ):
        self.shape = (num_envs, *obs_shape)
        self.dtype = obs_dtype
        self.rng = torch.Generator().manual_seed(seed)

    def observation(self) -> torch.Tensor:
        if self.dtype == torch.uint8:  # Atari frames
            return torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=self.rng)
        return torch.randn(self.shape, generator=self.rng)

    def step(self, reward_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.shape[0]
        reward = torch.randn(n, generator=self.rng).to(reward_dtype)
        done = torch.rand(n, generator=self.rng) < 0.1
        return self.observation(), reward, done

    def uniform_actions(self, n_act: int) -> torch.Tensor:
        """``envs.single_action_space.sample()`` of a Box(-1, 1) (MuJoCo's HalfCheetah)."""
        return torch.rand(self.shape[0], n_act, generator=self.rng) * 2 - 1


class ReplayBuffer:
    """torchrl's ``ReplayBuffer(storage=LazyTensorStorage(size, device=device))`` as the
    scripts use it: ``extend`` a TensorDict of transitions, ``sample`` a batch uniformly (with
    replacement), here from a generator of its own."""

    def __init__(self, device: torch.device, seed: int = 2):
        self.storage: TensorDict | None = None
        self.device = device
        self.rng = torch.Generator().manual_seed(seed)

    def extend(self, data: TensorDict) -> None:
        data = data.to(self.device)
        self.storage = data if self.storage is None else torch.cat([self.storage, data])

    def sample(self, batch_size: int) -> TensorDict:
        assert self.storage is not None
        index = torch.randint(len(self.storage), (batch_size,), generator=self.rng)
        return self.storage[index.to(self.device)]


def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


# ----------------------------------------------------------------------------------------
# PPO: ppo_continuous_action_torchcompile.py and ppo_atari_envpool_torchcompile.py share
# `gae`, `rollout`, `update` and the main loop, word for word; their agents, environments
# and defaults differ.


@dataclasses.dataclass
class PPOArgs:
    num_envs: int
    num_steps: int
    num_minibatches: int
    update_epochs: int
    num_iterations: int
    learning_rate: float
    clip_coef: float
    ent_coef: float
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    norm_adv: bool = True
    clip_vloss: bool = True
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None

    @property
    def minibatch_size(self) -> int:
        return self.num_envs * self.num_steps // self.num_minibatches


class ContinuousAgent(nn.Module):
    """ppo_continuous_action's `Agent`."""

    def __init__(self, n_obs: int, n_act: int, device: torch.device | None = None):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1, device=device), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_act, device=device), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, n_act, device=device))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, obs: torch.Tensor, action: torch.Tensor | None = None) -> Any:
        action_mean = self.actor_mean(obs)
        action_logstd = self.actor_logstd.expand_as(action_mean)
        action_std = torch.exp(action_logstd)
        probs = Normal(action_mean, action_std)
        if action is None:
            action = action_mean + action_std * torch.randn_like(action_mean)
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(obs)


class AtariAgent(nn.Module):
    """ppo_atari_envpool's `Agent` (Nature CNN on 4 stacked 84x84 frames)."""

    def __init__(self, n_act: int, device: torch.device | None = None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_act, device=device), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1, device=device), std=1)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, obs: torch.Tensor, action: torch.Tensor | None = None) -> Any:
        hidden = self.network(obs / 255.0)
        logits = self.actor(hidden)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def ppo(
    wrap: Wrap,
    args: PPOArgs,
    make_agent: Callable[[torch.device], nn.Module],
    env: RandomEnv,
    reward_dtype: torch.dtype,
    device: torch.device,
    clone_kept: bool = False,
) -> dict[str, Any]:
    """The PPO scripts' `__main__` with `--cudagraphs`: what ``wrap`` makes of `policy`,
    `gae` and `update` is what the script's `CudaGraphModule(...)` makes of them.
    ``clone_kept``: the one change that borrowed outputs need, the rollout's policy outputs
    cloned (see `test_ppo_continuous_action_borrowed`)."""
    torch.manual_seed(1)
    agent = make_agent(device)
    # Make a version of agent with detached params
    agent_inference = make_agent(device)
    from_module(agent).data.to_module(agent_inference, preserve_module_state=False)
    optimizer = torch.optim.Adam(
        agent.parameters(),
        lr=torch.tensor(args.learning_rate, device=device),
        eps=1e-5,
        capturable=True,  # args.cudagraphs and not args.compile
    )
    policy = agent_inference.get_action_and_value
    get_value = agent_inference.get_value

    def gae(next_obs: torch.Tensor, next_done: torch.Tensor, container: TensorDict) -> Any:
        # bootstrap value if not done
        next_value = get_value(next_obs).reshape(-1)
        lastgaelam: Any = 0
        nextnonterminals = (~container["dones"]).float().unbind(0)
        vals = container["vals"]
        vals_unbind = vals.unbind(0)
        rewards = container["rewards"].unbind(0)
        advantages = []
        nextnonterminal = (~next_done).float()
        nextvalues = next_value
        for t in range(args.num_steps - 1, -1, -1):
            cur_val = vals_unbind[t]
            delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - cur_val
            advantages.append(delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam)
            lastgaelam = advantages[-1]
            nextnonterminal = nextnonterminals[t]
            nextvalues = cur_val
        advantages = container["advantages"] = torch.stack(list(reversed(advantages)))
        container["returns"] = advantages + vals
        return container

    def rollout(obs: torch.Tensor, done: torch.Tensor) -> Any:
        ts = []
        for _ in range(args.num_steps):
            action, logprob, _, value = policy(obs=obs)
            if clone_kept:  # kept in `ts` across the policy's calls, stacked after the loop
                action, logprob, value = action.clone(), logprob.clone(), value.clone()
            next_obs, reward, next_done = env.step(reward_dtype)
            ts.append(
                TensorDict._new_unsafe(
                    obs=obs,
                    dones=done,
                    vals=value.flatten(),
                    actions=action,
                    logprobs=logprob,
                    rewards=reward,
                    batch_size=(args.num_envs,),
                )
            )
            obs = next_obs = next_obs.to(device, non_blocking=True)
            done = next_done.to(device, non_blocking=True)
        container = torch.stack(ts, 0).to(device)
        return next_obs, done, container

    def update_fn(
        obs: Any, actions: Any, logprobs: Any, advantages: Any, returns: Any, vals: Any
    ) -> Any:
        optimizer.zero_grad()
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)
        logratio = newlogprob - logprobs
        ratio = logratio.exp()
        with torch.no_grad():
            old_approx_kl = (-logratio).mean()
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
        if args.norm_adv:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()
        newvalue = newvalue.view(-1)
        if args.clip_vloss:
            v_loss_unclipped = (newvalue - returns) ** 2
            v_clipped = vals + torch.clamp(newvalue - vals, -args.clip_coef, args.clip_coef)
            v_loss_clipped = (v_clipped - returns) ** 2
            v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
            v_loss = 0.5 * v_loss_max.mean()
        else:
            v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
        entropy_loss = entropy.mean()
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
        loss.backward()
        gn = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return (
            approx_kl,
            v_loss.detach(),
            pg_loss.detach(),
            entropy_loss.detach(),
            old_approx_kl,
            clipfrac,
            gn,
        )

    update = TensorDictModule(
        update_fn,
        in_keys=["obs", "actions", "logprobs", "advantages", "returns", "vals"],
        out_keys=[
            "approx_kl",
            "v_loss",
            "pg_loss",
            "entropy_loss",
            "old_approx_kl",
            "clipfrac",
            "gn",
        ],
    )
    policy = wrap(policy)
    gae = wrap(gae)
    update = wrap(update)

    containers, metrics = [], []
    next_obs = env.observation().to(device)
    next_done = torch.zeros(args.num_envs, device=device, dtype=torch.bool)
    for iteration in range(1, args.num_iterations + 1):
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"].copy_(frac * args.learning_rate)
        next_obs, next_done, container = rollout(next_obs, next_done)
        container = gae(next_obs, next_done, container)
        container_flat = container.view(-1)
        containers.append(wrap.keep(container.to_dict()))
        for _ in range(args.update_epochs):
            b_inds = torch.randperm(container_flat.shape[0], device=device)
            for b in b_inds.split(args.minibatch_size):
                container_local = container_flat[b]
                out = update(container_local, tensordict_out=TensorDict())
                metrics.append(wrap.keep(out.to_dict()))
    return {
        "containers": containers,
        "metrics": metrics,
        "params": _snapshot(agent),
        "optimizer": _optimizer_state(optimizer),
    }


def test_ppo_continuous_action(backend: Backend, record: Recorder) -> None:
    # leanrl/ppo_continuous_action_torchcompile.py at LeanRL 8dbb633: `policy`
    # (agent_inference.get_action_and_value, called `policy(obs=obs)`), `gae` and `update`
    # (a TensorDictModule, called `update(minibatch, tensordict_out=TensorDict())`), each
    # `CudaGraphModule(fn)` with the defaults (warmup=2). HalfCheetah-v4: 17 observations,
    # 6 actions; gymnasium's rewards are float64 (as the script stores them: its advantages
    # and returns are float64). 1 env, 16 steps, 4 minibatches of 4, 2 epochs, 3 iterations
    # (2048 steps, 32 minibatches, 10 epochs in the script).
    check(record, backend, _ppo_continuous(backend))


def _ppo_continuous(backend: Backend, clone_kept: bool = False) -> Callable[[Wrap], Any]:
    args = PPOArgs(
        num_envs=1,
        num_steps=16,
        num_minibatches=4,
        update_epochs=2,
        num_iterations=3,
        learning_rate=3e-4,
        clip_coef=0.2,
        ent_coef=0.0,
    )

    def run(wrap: Wrap) -> dict[str, Any]:
        env = RandomEnv(args.num_envs, (17,), torch.float32)
        agent = lambda d: ContinuousAgent(17, 6, d)  # noqa: E731
        return ppo(wrap, args, agent, env, torch.float64, backend.device, clone_kept)

    return run


@contextlib.contextmanager
def _atari_script_settings() -> Iterator[None]:
    """What ppo_atari_envpool sets when it is imported, restored after the test."""
    validate = torch.distributions.Distribution._validate_args
    precision = torch.get_float32_matmul_precision()
    torch.distributions.Distribution.set_default_validate_args(False)
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)
        torch.set_float32_matmul_precision(precision)


@pytest.fixture
def deterministic_convolutions() -> Any:
    """cuDNN's deterministic convolution algorithms, for both runs of a row: its default
    backward of a convolution adds with atomics in an order that changes between runs, and
    Adam turns such differences of near-zero gradients into steps of about its learning rate
    (eager against eager on the H100: advantages 2e-4 to 9e-4 apart after two iterations)."""
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


@pytest.mark.usefixtures("deterministic_convolutions")
def test_ppo_atari_envpool(backend: Backend, record: Recorder) -> None:
    # leanrl/ppo_atari_envpool_torchcompile.py at LeanRL 8dbb633: the same `policy`, `gae`
    # and `update` wrappers as ppo_continuous_action (defaults, warmup=2), with its CNN
    # agent and a Categorical policy. Breakout-v5 through envpool, the script's default:
    # frames of 4x84x84 uint8, 4 actions, float32 rewards. 4 envs, 4 steps, 2 minibatches
    # of 8, 2 epochs, 3 iterations (8 envs, 128 steps, 4 minibatches, 4 epochs).
    with _atari_script_settings():
        check(record, backend, _ppo_atari(backend))


def _ppo_atari(backend: Backend, clone_kept: bool = False) -> Callable[[Wrap], Any]:
    args = PPOArgs(
        num_envs=4,
        num_steps=4,
        num_minibatches=2,
        update_epochs=2,
        num_iterations=3,
        learning_rate=2.5e-4,
        clip_coef=0.1,
        ent_coef=0.01,
    )

    def run(wrap: Wrap) -> dict[str, Any]:
        env = RandomEnv(args.num_envs, (4, 84, 84), torch.uint8)
        agent = lambda d: AtariAgent(4, d)  # noqa: E731
        return ppo(wrap, args, agent, env, torch.float32, backend.device, clone_kept)

    return run


# ----------------------------------------------------------------------------------------
# SAC: sac_continuous_action_torchcompile.py


@dataclasses.dataclass
class OffPolicyArgs:
    total_timesteps: int
    learning_starts: int
    batch_size: int
    gamma: float = 0.99
    tau: float = 0.005
    policy_frequency: int = 2


class SoftQNetwork(nn.Module):
    """sac_continuous_action's `SoftQNetwork`."""

    def __init__(self, n_act: int, n_obs: int, device: Any = None):
        super().__init__()
        self.fc1 = nn.Linear(n_act + n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc3 = nn.Linear(256, 1, device=device)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


LOG_STD_MAX, LOG_STD_MIN = 2, -5


class SACActor(nn.Module):
    """sac_continuous_action's `Actor`; ``low`` and ``high`` are the vector env's
    ``action_space`` bounds, of shape (num_envs, n_act)."""

    def __init__(
        self, low: np.ndarray, high: np.ndarray, n_obs: int, n_act: int, device: Any = None
    ):
        super().__init__()
        self.fc1 = nn.Linear(n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc_mean = nn.Linear(256, n_act, device=device)
        self.fc_logstd = nn.Linear(256, n_act, device=device)
        scale, bias = (high - low) / 2.0, (high + low) / 2.0
        self.register_buffer(
            "action_scale", torch.tensor(scale, dtype=torch.float32, device=device)
        )
        self.register_buffer("action_bias", torch.tensor(bias, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


# HalfCheetah-v4 (the SAC and TD3 scripts' default): 17 observations, 6 actions in [-1, 1];
# a SyncVectorEnv of one env, whose `action_space` bounds are of shape (1, 6).
N_OBS, N_ACT = 17, 6
LOW, HIGH = -np.ones((1, N_ACT), dtype=np.float32), np.ones((1, N_ACT), dtype=np.float32)


def _transition(
    obs: torch.Tensor, next_obs: Any, actions: Any, rewards: Any, dones: Any, device: Any
) -> TensorDict:
    return TensorDict(
        observations=obs,
        next_observations=next_obs.clone(),  # real_next_obs: no truncation here
        actions=torch.as_tensor(actions, device=device, dtype=torch.float),
        rewards=torch.as_tensor(rewards, device=device, dtype=torch.float),
        terminations=dones,
        dones=dones,
        batch_size=obs.shape[0],
        device=device,
    )


def sac(wrap: Wrap, args: OffPolicyArgs, device: torch.device) -> dict[str, Any]:
    """sac_continuous_action's `__main__` with `--cudagraphs` (autotune on, its default)."""
    q_lr, policy_lr = 1e-3, 3e-4
    torch.manual_seed(1)
    env = RandomEnv(1, (N_OBS,), torch.float32)
    rb = ReplayBuffer(device)
    actor = SACActor(LOW, HIGH, n_obs=N_OBS, n_act=N_ACT, device=device)
    actor_detach = SACActor(LOW, HIGH, n_obs=N_OBS, n_act=N_ACT, device=device)
    from_module(actor).data.to_module(actor_detach, preserve_module_state=False)
    # The script's `TensorDictModule(actor_detach.get_action, in_keys=["observation"],
    # out_keys=["action"])`, called `policy(obs)`: the action, the first of get_action's
    # three outputs (tensordict 0.15 refuses more outputs than out_keys). Not graphed (its
    # `CudaGraphModule` is commented out in the script): eager in both runs.
    policy = actor_detach.get_action

    qf1 = SoftQNetwork(n_act=N_ACT, n_obs=N_OBS, device=device)
    qf2 = SoftQNetwork(n_act=N_ACT, n_obs=N_OBS, device=device)
    qnet_params = from_modules(qf1, qf2, as_module=True)
    qnet_target = qnet_params.data.clone()
    qnet = SoftQNetwork(n_act=N_ACT, n_obs=N_OBS, device="meta")
    qnet_params.to_module(qnet, preserve_module_state=False)

    q_optimizer = torch.optim.Adam(qnet.parameters(), lr=q_lr, capturable=True)
    actor_optimizer = torch.optim.Adam(list(actor.parameters()), lr=policy_lr, capturable=True)
    target_entropy = -torch.prod(torch.Tensor((N_ACT,)).to(device)).item()
    log_alpha = torch.zeros(1, requires_grad=True, device=device)
    alpha = log_alpha.detach().exp()
    a_optimizer = torch.optim.Adam([log_alpha], lr=q_lr, capturable=True)

    def batched_qf(params: Any, obs: Any, action: Any, next_q_value: Any = None) -> Any:
        with params.to_module(qnet, preserve_module_state=False):
            vals = qnet(obs, action)
            if next_q_value is not None:
                return F.mse_loss(vals.view(-1), next_q_value)
            return vals

    def update_main(data: TensorDict) -> TensorDict:
        q_optimizer.zero_grad()
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = actor.get_action(data["next_observations"])
            qf_next_target = torch.vmap(batched_qf, (0, None, None))(
                qnet_target, data["next_observations"], next_state_actions
            )
            min_qf_next_target = qf_next_target.min(dim=0).values - alpha * next_state_log_pi
            next_q_value = data["rewards"].flatten() + (
                ~data["dones"].flatten()
            ).float() * args.gamma * min_qf_next_target.view(-1)
        qf_a_values = torch.vmap(batched_qf, (0, None, None, None))(
            qnet_params, data["observations"], data["actions"], next_q_value
        )
        qf_loss = qf_a_values.sum(0)
        qf_loss.backward()
        q_optimizer.step()
        return TensorDict(qf_loss=qf_loss.detach())

    def update_pol(data: TensorDict) -> TensorDict:
        actor_optimizer.zero_grad()
        pi, log_pi, _ = actor.get_action(data["observations"])
        qf_pi = torch.vmap(batched_qf, (0, None, None))(qnet_params.data, data["observations"], pi)
        min_qf_pi = qf_pi.min(0).values
        actor_loss = ((alpha * log_pi) - min_qf_pi).mean()
        actor_loss.backward()
        actor_optimizer.step()
        a_optimizer.zero_grad()
        with torch.no_grad():
            _, log_pi, _ = actor.get_action(data["observations"])
        alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()
        alpha_loss.backward()
        a_optimizer.step()
        return TensorDict(
            alpha=alpha.detach(), actor_loss=actor_loss.detach(), alpha_loss=alpha_loss.detach()
        )

    def extend_and_sample(transition: TensorDict) -> TensorDict:
        rb.extend(transition)
        return rb.sample(args.batch_size)

    update_main = wrap(update_main, in_keys=[], out_keys=[])
    update_pol = wrap(update_pol, in_keys=[], out_keys=[])

    metrics, actions_taken = [], []
    obs = env.observation().to(device)
    for global_step in range(args.total_timesteps):
        if global_step < args.learning_starts:
            actions = env.uniform_actions(N_ACT)
        else:
            actions = policy(obs)[0]
            actions_taken.append(wrap.keep(actions))
            actions = actions.cpu()
        next_obs, rewards, terminations = env.step(torch.float64)
        next_obs = torch.as_tensor(next_obs, device=device, dtype=torch.float)
        transition = _transition(obs, next_obs, actions, rewards, terminations, device)
        obs = next_obs
        data = extend_and_sample(transition)
        if global_step > args.learning_starts:
            out_main = update_main(data)
            if global_step % args.policy_frequency == 0:
                for _ in range(args.policy_frequency):
                    out_main.update(update_pol(data))
                    alpha.copy_(log_alpha.detach().exp())
            qnet_target.lerp_(qnet_params.data, args.tau)  # target_network_frequency=1
            metrics.append(wrap.keep(out_main.to_dict()))
    return {
        "actions": actions_taken,
        "metrics": metrics,
        "actor": _snapshot(actor),
        "qnet": _snapshot(qnet_params.data),
        "qnet_target": _snapshot(qnet_target),
        "log_alpha": log_alpha.detach().clone(),
        "optimizers": [_optimizer_state(o) for o in (q_optimizer, actor_optimizer, a_optimizer)],
    }


def test_sac_continuous_action(backend: Backend, record: Recorder) -> None:
    # leanrl/sac_continuous_action_torchcompile.py at LeanRL 8dbb633: `update_main` and
    # `update_pol` (whole steps: losses, backward, capturable Adam; update_pol also tunes
    # alpha), each `CudaGraphModule(fn, in_keys=[], out_keys=[])` (warmup=2), called with
    # the sampled batch; the policy is not graphed (as in the script). HalfCheetah-v4 (17
    # observations, 6 actions), 4 random steps then 17 of the policy, 16 of which learn (8
    # with two policy updates), batches of 32 (5000 random steps, batches of 256).
    check(record, backend, _sac(backend), _alpha_aside, ALPHA)


def _sac(backend: Backend) -> Callable[[Wrap], Any]:
    args = OffPolicyArgs(total_timesteps=21, learning_starts=4, batch_size=32)
    return lambda wrap: sac(wrap, args, backend.device)


# update_pol returns `alpha.detach()`, a view of the global `alpha` that the script then
# updates in place (`alpha.copy_(log_alpha.detach().exp())`): eager's `out_main["alpha"]`
# shows the new value, a graph's replay returns the value at the call, in fresh memory (the
# library's contract, and tensordict's class's clone). The script does not log it.
ALPHA = "the alpha metric: eager's is a view of the global alpha, updated after the call"


def _alpha_aside(result: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    metrics = [{k: v for k, v in m.items() if k != "alpha"} for m in result["metrics"]]
    alphas = [m["alpha"] for m in result["metrics"] if "alpha" in m]
    return {**result, "metrics": metrics}, alphas


# ----------------------------------------------------------------------------------------
# TD3: td3_continuous_action_torchcompile.py


class QNetwork(nn.Module):
    """td3_continuous_action's `QNetwork`."""

    def __init__(self, n_obs: int, n_act: int, device: Any = None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs + n_act, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc3 = nn.Linear(256, 1, device=device)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class TD3Actor(nn.Module):
    """td3_continuous_action's `Actor` (bounds as for `SACActor`)."""

    def __init__(self, n_obs: int, n_act: int, exploration_noise: float = 1, device: Any = None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc_mu = nn.Linear(256, n_act, device=device)
        scale, bias = (HIGH - LOW) / 2.0, (HIGH + LOW) / 2.0
        self.register_buffer(
            "action_scale", torch.tensor(scale, dtype=torch.float32, device=device)
        )
        self.register_buffer("action_bias", torch.tensor(bias, dtype=torch.float32, device=device))
        self.register_buffer("exploration_noise", torch.as_tensor(exploration_noise, device=device))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        obs = F.relu(self.fc1(obs))
        obs = F.relu(self.fc2(obs))
        obs = self.fc_mu(obs).tanh()
        return obs * self.action_scale + self.action_bias

    def explore(self, obs: torch.Tensor) -> torch.Tensor:
        act = self(obs)
        return act + torch.randn_like(act).mul(self.action_scale * self.exploration_noise)


def td3(wrap: Wrap, args: OffPolicyArgs, device: torch.device) -> dict[str, Any]:
    """td3_continuous_action's `__main__` with `--cudagraphs`."""
    learning_rate, policy_noise, noise_clip, exploration_noise = 3e-4, 0.2, 0.5, 0.1
    action_low, action_high = float(LOW[0, 0]), float(HIGH[0, 0])
    torch.manual_seed(1)
    env = RandomEnv(1, (N_OBS,), torch.float32)
    rb = ReplayBuffer(device)
    actor = TD3Actor(N_OBS, N_ACT, exploration_noise, device=device)
    actor_detach = TD3Actor(N_OBS, N_ACT, exploration_noise, device=device)
    from_module(actor).data.to_module(actor_detach, preserve_module_state=False)
    policy = actor_detach.explore

    qf1 = QNetwork(n_obs=N_OBS, n_act=N_ACT, device=device)
    qf2 = QNetwork(n_obs=N_OBS, n_act=N_ACT, device=device)
    qnet_params = from_modules(qf1, qf2, as_module=True)
    qnet_target_params = qnet_params.data.clone()
    qnet = QNetwork(n_obs=N_OBS, n_act=N_ACT, device="meta")
    qnet_params.to_module(qnet, preserve_module_state=False)

    target_actor = TD3Actor(N_OBS, N_ACT, device="meta")
    actor_params = from_module(actor).data
    target_actor_params = actor_params.clone()
    target_actor_params.to_module(target_actor, preserve_module_state=False)

    q_optimizer = torch.optim.Adam(
        qnet_params.values(include_nested=True, leaves_only=True), lr=learning_rate, capturable=True
    )
    actor_optimizer = torch.optim.Adam(list(actor.parameters()), lr=learning_rate, capturable=True)

    def batched_qf(params: Any, obs: Any, action: Any, next_q_value: Any = None) -> Any:
        with params.to_module(qnet, preserve_module_state=False):
            vals = qnet(obs, action)
            if next_q_value is not None:
                return F.mse_loss(vals.view(-1), next_q_value)
            return vals

    action_scale = target_actor.action_scale

    def update_main(data: TensorDict) -> TensorDict:
        observations = data["observations"]
        next_observations = data["next_observations"]
        actions = data["actions"]
        rewards = data["rewards"]
        dones = data["dones"]
        clipped_noise = torch.randn_like(actions)
        clipped_noise = (
            clipped_noise.mul(policy_noise).clamp(-noise_clip, noise_clip).mul(action_scale)
        )
        next_state_actions = (target_actor(next_observations) + clipped_noise).clamp(
            action_low, action_high
        )
        qf_next_target = torch.vmap(batched_qf, (0, None, None))(
            qnet_target_params, next_observations, next_state_actions
        )
        min_qf_next_target = qf_next_target.min(0).values
        next_q_value = (
            rewards.flatten()
            + (~dones.flatten()).float() * args.gamma * min_qf_next_target.flatten()
        )
        qf_loss = torch.vmap(batched_qf, (0, None, None, None))(
            qnet_params, observations, actions, next_q_value
        )
        qf_loss = qf_loss.sum(0)
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()
        return TensorDict(qf_loss=qf_loss.detach())

    def update_pol(data: TensorDict) -> TensorDict:
        actor_optimizer.zero_grad()
        with qnet_params.data[0].to_module(qnet, preserve_module_state=False):
            actor_loss = -qnet(data["observations"], actor(data["observations"])).mean()
        actor_loss.backward()
        actor_optimizer.step()
        return TensorDict(actor_loss=actor_loss.detach())

    def extend_and_sample(transition: TensorDict) -> TensorDict:
        rb.extend(transition)
        return rb.sample(args.batch_size)

    update_main = wrap(update_main, in_keys=[], out_keys=[], warmup=5)
    update_pol = wrap(update_pol, in_keys=[], out_keys=[], warmup=5)
    policy = wrap(policy)

    metrics, actions_taken = [], []
    obs = env.observation().to(device)
    for global_step in range(args.total_timesteps):
        if global_step < args.learning_starts:
            actions = env.uniform_actions(N_ACT)
        else:
            actions = policy(obs=obs)
            actions_taken.append(wrap.keep(actions))
            actions = actions.clamp(action_low, action_high).cpu()
        next_obs, rewards, terminations = env.step(torch.float64)
        next_obs = torch.as_tensor(next_obs, device=device, dtype=torch.float)
        transition = _transition(obs, next_obs, actions, rewards, terminations, device)
        obs = next_obs
        data = extend_and_sample(transition)
        if global_step > args.learning_starts:
            out_main = update_main(data)
            if global_step % args.policy_frequency == 0:
                out_main.update(update_pol(data))
                qnet_target_params.lerp_(qnet_params.data, args.tau)
                target_actor_params.lerp_(actor_params.data, args.tau)
            metrics.append(wrap.keep(out_main.to_dict()))
    return {
        "actions": actions_taken,
        "metrics": metrics,
        "actor": _snapshot(actor),
        "target_actor": _snapshot(target_actor_params),
        "qnet": _snapshot(qnet_params.data),
        "qnet_target": _snapshot(qnet_target_params),
        "optimizers": [_optimizer_state(o) for o in (q_optimizer, actor_optimizer)],
    }


def test_td3_continuous_action(backend: Backend, record: Recorder) -> None:
    # leanrl/td3_continuous_action_torchcompile.py at LeanRL 8dbb633: `update_main` and
    # `update_pol` (whole steps, capturable Adam), each `CudaGraphModule(fn, in_keys=[],
    # out_keys=[], warmup=5)`, and `policy` (actor_detach.explore, called `policy(obs=obs)`),
    # `CudaGraphModule(fn)` (warmup=2). HalfCheetah-v4 (17 observations, 6 actions), 3
    # random steps then 17 steps of the policy and 16 learning ones (8 with a policy
    # update), batches of 32 (25000 random steps and batches of 256 in the script).
    check(record, backend, _td3(backend))


def _td3(backend: Backend) -> Callable[[Wrap], Any]:
    args = OffPolicyArgs(total_timesteps=20, learning_starts=3, batch_size=32)
    return lambda wrap: td3(wrap, args, backend.device)


# ----------------------------------------------------------------------------------------
# DQN: dqn_torchcompile.py


class DQNNetwork(nn.Module):
    """dqn's `QNetwork`."""

    def __init__(self, n_obs: int, n_act: int, device: Any = None):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(n_obs, 120, device=device),
            nn.ReLU(),
            nn.Linear(120, 84, device=device),
            nn.ReLU(),
            nn.Linear(84, n_act, device=device),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def linear_schedule(
    start_e: float, end_e: float, duration: float, device: Any
) -> Iterator[torch.Tensor]:
    # As the script's: a new 0-dim tensor each step (its value stays `end_e`).
    slope = torch.tensor((end_e - start_e) / duration, device=device)
    while True:
        yield slope.clamp_min(end_e)


def dqn(wrap: Wrap, device: torch.device, clone_kept: bool = False) -> dict[str, Any]:
    """dqn's `__main__` with `--cudagraphs`; CartPole-v1: 4 observations, 2 actions.
    ``clone_kept``: the one change that borrowed outputs need, the policy's actions cloned
    (see `test_dqn_borrowed`)."""
    n_obs, n_act = 4, 2
    gamma, tau, learning_rate, batch_size = 0.99, 1.0, 2.5e-4, 16
    # 24 steps, learning from step 4, an update every 2 steps and the target every 8
    # (500000 steps, 10000, 10 and 500 in the script).
    total_timesteps, learning_starts, train_frequency, target_network_frequency = 24, 4, 2, 8
    torch.manual_seed(1)
    env = RandomEnv(1, (n_obs,), torch.float32)
    rb = ReplayBuffer(device)
    q_network = DQNNetwork(n_obs=n_obs, n_act=n_act, device=device)
    q_network_detach = DQNNetwork(n_obs=n_obs, n_act=n_act, device=device)
    params_vals = from_module(q_network).detach()
    params_vals.to_module(q_network_detach, preserve_module_state=False)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=learning_rate, capturable=True)
    target_network = DQNNetwork(n_obs=n_obs, n_act=n_act, device=device)
    target_params = params_vals.clone().lock_()
    target_params.to_module(target_network, preserve_module_state=False)

    def update(data: TensorDict) -> torch.Tensor:
        with torch.no_grad():
            target_max, _ = target_network(data["next_observations"]).max(dim=1)
            td_target = (
                data["rewards"].flatten() + gamma * target_max * (~data["dones"].flatten()).float()
            )
        old_val = q_network(data["observations"]).gather(1, data["actions"].unsqueeze(-1)).squeeze()
        loss = F.mse_loss(td_target, old_val)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    def policy(obs: torch.Tensor, epsilon: torch.Tensor) -> torch.Tensor:
        q_values = q_network_detach(obs)
        actions = torch.argmax(q_values, dim=1)
        actions_random = (
            torch.rand(actions.shape, device=actions.device).mul(n_act).floor().to(torch.long)
        )
        use_policy = torch.rand(actions.shape, device=actions.device).gt(epsilon)
        return torch.where(use_policy, actions, actions_random)

    update = wrap(update)
    policy = wrap(policy)

    losses, actions_taken = [], []
    obs = env.observation().to(device)
    eps_schedule = linear_schedule(1.0, 0.05, 0.5 * total_timesteps, device)
    transitions = []
    for global_step in range(total_timesteps):
        epsilon = next(eps_schedule)
        actions = policy(obs, epsilon)
        if clone_kept:  # kept in `transitions` across the policy's calls, until the update
            actions = actions.clone()
        actions_taken.append(wrap.keep(actions))
        next_obs, rewards, terminations = env.step(torch.float64)
        next_obs = torch.as_tensor(next_obs, dtype=torch.float).to(device, non_blocking=True)
        terminations = terminations.to(device, non_blocking=True)
        rewards = torch.as_tensor(rewards, dtype=torch.float).to(device, non_blocking=True)
        transitions.append(
            TensorDict._new_unsafe(
                observations=obs,
                next_observations=next_obs,
                actions=actions,
                rewards=rewards,
                terminations=terminations,
                dones=terminations,
                batch_size=obs.shape[:1],
                device=device,
            )
        )
        obs = next_obs
        if global_step > learning_starts:
            if global_step % train_frequency == 0:
                rb.extend(torch.cat(transitions))
                transitions = []
                data = rb.sample(batch_size)
                losses.append(wrap.keep(update(data)))
            if global_step % target_network_frequency == 0:
                target_params.lerp_(params_vals, tau)
    return {
        "actions": actions_taken,
        "losses": losses,
        "q_network": _snapshot(q_network),
        "target": _snapshot(target_params),
        "optimizer": _optimizer_state(optimizer),
    }


def test_dqn(backend: Backend, record: Recorder) -> None:
    # leanrl/dqn_torchcompile.py at LeanRL 8dbb633: `update` (a whole step, capturable
    # Adam, called with the sampled batch) and `policy` (epsilon-greedy, called
    # `policy(obs, epsilon)` with a 0-dim tensor epsilon), each `CudaGraphModule(fn)` with
    # the defaults (warmup=2). CartPole-v1: 4 observations, 2 actions; batches of 16.
    check(record, backend, lambda wrap: dqn(wrap, backend.device))


# ----------------------------------------------------------------------------------------
# Borrowed outputs (issue 43): each script again, this library's wrappers made with
# `CudaGraphModule(..., outputs="borrowed")`, that option their only change. A script runs
# unchanged and matches its eager twin as the row above does, or raises the library's
# use-after-overwrite error where its own code keeps an output across calls; then the same
# script with the one `.clone()` that keeps a copy instead must match eager. What the test
# itself records to compare is copied (`Wrap.keep`): the scripts do not keep it.


def _overwritten(name: str) -> str:
    """The error of an output of the wrapper of ``name`` used after its graph's next replay."""
    return (
        re.escape(
            f"CudaGraphModule({name}), mode 'grad': this output was borrowed from its graph "
            '(`outputs="borrowed"`), and the graph\'s replay '
        )
        + r"\d+ has overwritten it"
    )


def check_keeps_output(
    record: Recorder, backend: Backend, run: Callable[[Wrap], Any], name: str, where: str
) -> None:
    """``run`` with borrowed outputs raises the use-after-overwrite error of the wrapper
    ``name``, at the script's line ``where`` (the one that reads the outputs it kept)."""
    with pytest.raises(RuntimeError, match=_overwritten(name)) as raised:
        run(_ours(backend, outputs="borrowed"))
    record("cudagraph_td", "raises", _first_line(raised.value), backend=backend.name)
    lines = [str(entry.statement).strip() for entry in raised.traceback]
    assert where in lines, lines


@pytest.mark.parametrize("clone_kept", [False, True], ids=["as_written", "clone_kept"])
def test_ppo_continuous_action_borrowed(
    backend: Backend, record: Recorder, clone_kept: bool
) -> None:
    # `rollout` keeps each step's `policy(obs=obs)` outputs (action, logprob and a view of
    # the value, `value.flatten()`) in `ts`, a TensorDict per step, and stacks them after the
    # loop (`container = torch.stack(ts, 0).to(device)`): by then the policy's next replays
    # have overwritten all but the last step's. `gae`'s container and `update`'s outputs are
    # read before the next call of their wrapper. The change: the outputs cloned as the
    # rollout takes them (`clone_kept`).
    _check_rollout_borrowed(record, backend, _ppo_continuous(backend, clone_kept), clone_kept)


@pytest.mark.usefixtures("deterministic_convolutions")
@pytest.mark.parametrize("clone_kept", [False, True], ids=["as_written", "clone_kept"])
def test_ppo_atari_envpool_borrowed(backend: Backend, record: Recorder, clone_kept: bool) -> None:
    # The same `rollout` as ppo_continuous_action: the policy's outputs kept in `ts`.
    run = _ppo_atari(backend, clone_kept)
    with _atari_script_settings():
        _check_rollout_borrowed(record, backend, run, clone_kept)


def _check_rollout_borrowed(record: Recorder, backend: Backend, run: Any, clone_kept: bool) -> None:
    """PPO's `rollout` with borrowed outputs: as written, the policy's kept outputs raise
    at the stack that reads them; with them cloned, the run matches eager."""
    if not clone_kept:
        check_keeps_output(
            record,
            backend,
            run,
            "get_action_and_value",
            "container = torch.stack(ts, 0).to(device)",
        )
        return
    check(record, backend, run, outputs="borrowed")


def test_sac_continuous_action_borrowed(backend: Backend, record: Recorder) -> None:
    # Unchanged: `out_main` holds the outputs of one step's `update_main` and last
    # `update_pol` (`out_main.update(update_pol(data))` replaces the first of the two policy
    # updates' outputs before the second), read before the next call. Its alpha metric
    # differs from eager's as in the row above: a replay's value at the call.
    check(record, backend, _sac(backend), _alpha_aside, ALPHA, outputs="borrowed")


def test_td3_continuous_action_borrowed(backend: Backend, record: Recorder) -> None:
    # Unchanged: the policy's action is clamped into a new tensor at once
    # (`actions.clamp(action_low, action_high).cpu()`), which the transition keeps; the
    # updates' outputs are read before their next call.
    check(record, backend, _td3(backend), outputs="borrowed")


@pytest.mark.parametrize("clone_kept", [False, True], ids=["as_written", "clone_kept"])
def test_dqn_borrowed(backend: Backend, record: Recorder, clone_kept: bool) -> None:
    # The loop keeps each step's `actions = policy(obs, epsilon)` in `transitions` (a
    # TensorDict per step, `actions=actions`) until the next update, `train_frequency` steps
    # later, concatenates them (`rb.extend(torch.cat(transitions))`): the policy's replays
    # have overwritten all but the last. `loss = update(data)` is read before the next
    # update. The change: `policy(obs, epsilon).clone()` (`clone_kept`).
    run = lambda wrap: dqn(wrap, backend.device, clone_kept)  # noqa: E731
    if not clone_kept:
        check_keeps_output(record, backend, run, "policy", "rb.extend(torch.cat(transitions))")
        return
    check(record, backend, run, outputs="borrowed")
