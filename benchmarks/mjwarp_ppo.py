"""PPO on MuJoCo Warp's HalfCheetah, its rollout and its update graphed, against eager.

The environment is ``benchmarks/mjwarp_cheetah.py``'s ``Cheetah`` (gymnasium's
HalfCheetah-v4 on ``mujoco_warp``, N worlds as one batch). The learner is PPO in LeanRL's
manner (continuous actions, a Gaussian policy with a learned log-std, GAE, the clipped
objective with a clipped value loss, Adam with a tensor learning rate, annealed, and
``capturable=True``), with gymnasium's observation normalisation and reward scaling
written as running statistics in torch, updated inside the rollout. An iteration is:

1. ``collect``: K steps of every world (the observation statistics updated, the policy's
   sample, the environment's step with its resets, the reward scaled, the episode
   bookkeeping, the transition written into a preallocated trajectory TensorDict), one
   function;
2. ``gae``: the advantages and the value targets of the K steps, one function;
3. ``epochs`` passes over the N x K transitions in ``minibatches`` shuffled minibatches,
   each minibatch one call of ``update`` (gather, forward, backward, gradient clipping,
   ``opt.step()``).

``--mode graphed`` wraps each of the three functions in ``cudagraph_td.CudaGraphModule``
(on CUDA a CUDA graph each; on a machine without CUDA the library's CPU emulation);
``--mode eager`` runs the same loop, the same functions, without any wrapper. A run of
either mode from a seed starts from the same networks and environment states.

Episodes are truncated at ``--horizon`` steps (gymnasium's 1,000), and a truncation ends
the episode for the advantages too (as in CleanRL and LeanRL). The worlds start at random
points of their first episode (so that episodes end in every iteration, not all at once);
these first, shortened episodes are not counted: the episodic returns reported are those
of whole episodes only, mean of those finished in an iteration. The final return of a run
is the mean over the whole episodes finished in its last ``--final-fraction`` of
iterations. Steps per second are environment steps over the wall time of the whole loop
(the warm-ups and captures included), and past the first ``--skip`` iterations, with the
time split between the rollout and the rest (GAE and the update): the loop synchronises
with the GPU at those two boundaries and once an iteration to read the episode statistics.

At the end the script prints each mode's final return across the seeds (mean, min..max)
and whether each mode's mean lies within the other mode's range of seeds; and the graphed
mode's steps per second against eager's and against LeanRL's SAC on gymnasium's CPU
HalfCheetah as recorded in ``docs/benchmarks/h100-leanrl-sac.json`` (another algorithm,
another run: a point of reference, not a like-for-like ratio).

    python benchmarks/mjwarp_ppo.py --seeds 0,1,2 --mode graphed,eager --json out.json

Without CUDA it runs on Warp's CPU device and the emulation with tiny settings (8 worlds,
K = 8, 3 iterations, episodes of 16 steps): a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.mjwarp_cheetah import Cheetah  # noqa: E402
from cudagraph_td import CudaGraphModule, capturable_on_cpu  # noqa: E402

SAC_REFERENCE = ROOT / "docs" / "benchmarks" / "h100-leanrl-sac.json"


@dataclass
class Config:
    envs: int = 1024
    steps: int = 32  # K, the rollout's length an iteration
    total_steps: int = 1024 * 32 * 100
    horizon: int = 1000
    epochs: int = 4
    minibatches: int = 8
    lr: float = 3e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    max_grad_norm: float = 0.5
    hidden: int = 64
    skip: int = 3  # iterations left out of the steady rate (warm-ups and captures)
    final_fraction: float = 0.2

    @property
    def batch(self) -> int:
        return self.envs * self.steps

    @property
    def iterations(self) -> int:
        return max(1, self.total_steps // self.batch)


class RunningStats(nn.Module):
    """Mean and variance of a stream of batches (gymnasium's ``RunningMeanStd``), updated
    in place with tensor operations only, so that a graph can hold the update."""

    def __init__(self, size: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(size))
        self.register_buffer("var", torch.ones(size))
        self.register_buffer("count", torch.full((), 1e-4))

    def update(self, x: torch.Tensor) -> None:
        n = x.shape[0]
        batch_mean, batch_var = x.mean(0), x.var(0, unbiased=False)
        delta = batch_mean - self.mean
        total = self.count + n
        m2 = self.var * self.count + batch_var * n + delta.square() * self.count * n / total
        self.mean.add_(delta * n / total)
        self.var.copy_(m2 / total)
        self.count.copy_(total)


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class Agent(nn.Module):
    """LeanRL's continuous-action agent: two tanh MLPs and a state-independent log-std;
    with the running statistics of the observations and of the discounted returns."""

    def __init__(self, n_obs: int, n_act: int, hidden: int):
        super().__init__()
        root2 = math.sqrt(2)
        self.actor = nn.Sequential(
            _layer(n_obs, hidden, root2),
            nn.Tanh(),
            _layer(hidden, hidden, root2),
            nn.Tanh(),
            _layer(hidden, n_act, 0.01),
        )
        self.log_std = nn.Parameter(torch.zeros(n_act))
        self.critic = nn.Sequential(
            _layer(n_obs, hidden, root2),
            nn.Tanh(),
            _layer(hidden, hidden, root2),
            nn.Tanh(),
            _layer(hidden, 1, 1.0),
        )
        self.obs_stats = RunningStats(n_obs)
        self.return_stats = RunningStats(1)

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        stats = self.obs_stats
        return ((raw - stats.mean) / (stats.var + 1e-8).sqrt()).clamp(-10.0, 10.0)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def log_prob(self, mean: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        # Normal(mean, exp(log_std)).log_prob(action).sum(-1), without the distribution's
        # object (and its argument checks, a host sync).
        z = (action - mean) * (-self.log_std).exp()
        return (-0.5 * z.square() - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def entropy(self) -> torch.Tensor:
        return (0.5 + 0.5 * math.log(2 * math.pi) + self.log_std).sum()


class PPO:
    """One run: the environment, the agent, its optimizer, and the three functions of an
    iteration, wrapped (``graphed``) or not."""

    def __init__(self, cfg: Config, device: torch.device, seed: int, graphed: bool):
        self.cfg, self.device, self.graphed = cfg, device, graphed
        torch.manual_seed(seed)
        self.env = Cheetah(cfg.envs, device, horizon=cfg.horizon)
        n_obs, n_act = self.env.observation_size, self.env.action_size
        self.agent = Agent(n_obs, n_act, cfg.hidden).to(device)
        # The same optimizer in both modes (a tensor learning rate, capturable): the loops
        # differ by the wrappers only.
        self.lr = torch.tensor(cfg.lr, device=device)
        self.opt = torch.optim.Adam(self.agent.parameters(), lr=self.lr, eps=1e-5, capturable=True)
        n, k = cfg.envs, cfg.steps
        self.trajectory = TensorDict(
            obs=torch.zeros(n, k, n_obs, device=device),
            action=torch.zeros(n, k, n_act, device=device),
            log_prob=torch.zeros(n, k, device=device),
            value=torch.zeros(n, k, device=device),
            reward=torch.zeros(n, k, device=device),  # scaled, what PPO learns from
            raw_reward=torch.zeros(n, k, device=device),
            done=torch.zeros(n, k, dtype=torch.bool, device=device),
            finished=torch.zeros(n, k, dtype=torch.bool, device=device),  # a whole episode
            finished_return=torch.zeros(n, k, device=device),
            batch_size=[n, k],
        )
        if graphed:
            backend = "cuda" if device.type == "cuda" else "emulate"
            wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda f: CudaGraphModule(  # noqa: E731
                f, backend=backend
            )
        else:
            wrap = lambda f: f  # noqa: E731
        self.collect = wrap(self._collect)
        self.gae = wrap(self._gae)
        self.update = wrap(self._update)

    def start(self) -> TensorDict:
        """New episodes in every world, each world at a random step of its first one."""
        obs = self.env.reset()
        self.env.t.copy_(torch.randint(0, self.cfg.horizon, (self.cfg.envs,), device=self.device))
        zeros = torch.zeros(self.cfg.envs, device=self.device)
        return TensorDict(
            observation=obs,
            episode_return=zeros,
            episode_length=torch.zeros(self.cfg.envs, dtype=torch.long, device=self.device),
            discounted=zeros.clone(),
            next_value=zeros.clone(),
            batch_size=[self.cfg.envs],
        )

    def _collect(self, state: TensorDict, trajectory: TensorDict) -> TensorDict:
        """K steps of every world from ``state``; the transitions into ``trajectory`` (in
        place); the next state. No host sync: resets and bookkeeping with ``torch.where``."""
        cfg, agent, env = self.cfg, self.agent, self.env
        raw = state["observation"]
        episode_return, episode_length = state["episode_return"], state["episode_length"]
        discounted = state["discounted"]
        for k in range(cfg.steps):
            agent.obs_stats.update(raw)
            obs = agent.normalize(raw)
            mean = agent.actor(obs)
            action = mean + agent.log_std.exp() * torch.randn_like(mean)
            log_prob = agent.log_prob(mean, action)
            value = agent.value(obs)
            # gymnasium's ClipAction: the environment gets the clipped action, PPO keeps
            # the sampled one.
            raw, reward, done = env.step(action.clamp(-1.0, 1.0))
            # gymnasium's NormalizeReward: rewards over the spread of discounted returns.
            discounted = discounted * cfg.gamma + reward
            agent.return_stats.update(discounted.unsqueeze(-1))
            scaled = (reward / (agent.return_stats.var + 1e-8).sqrt()).clamp(-10.0, 10.0)
            episode_return = episode_return + reward
            episode_length = episode_length + 1
            whole = done & (episode_length >= cfg.horizon)
            trajectory[:, k].update_(
                TensorDict(
                    obs=obs,
                    action=action,
                    log_prob=log_prob,
                    value=value,
                    reward=scaled,
                    raw_reward=reward,
                    done=done,
                    finished=whole,
                    finished_return=torch.where(whole, episode_return, 0.0),
                    batch_size=[cfg.envs],
                )
            )
            episode_return = torch.where(done, 0.0, episode_return)
            episode_length = torch.where(done, 0, episode_length)
            discounted = torch.where(done, 0.0, discounted)
        return TensorDict(
            observation=raw,
            episode_return=episode_return,
            episode_length=episode_length,
            discounted=discounted,
            next_value=agent.value(agent.normalize(raw)),
            batch_size=[cfg.envs],
        )

    def _gae(self, next_value: torch.Tensor, trajectory: TensorDict) -> TensorDict:
        """Generalised advantage estimates of the K steps, and the value targets."""
        cfg = self.cfg
        reward, value = trajectory["reward"], trajectory["value"]
        going_on = (~trajectory["done"]).float()
        advantages = []
        last = torch.zeros_like(next_value)
        following = next_value
        for t in reversed(range(cfg.steps)):
            delta = reward[:, t] + cfg.gamma * following * going_on[:, t] - value[:, t]
            last = delta + cfg.gamma * cfg.gae_lambda * going_on[:, t] * last
            advantages.append(last)
            following = value[:, t]
        advantage = torch.stack(advantages[::-1], dim=1)
        return TensorDict(advantage=advantage, returns=advantage + value, batch_size=value.shape)

    def _update(self, data: TensorDict, index: torch.Tensor) -> TensorDict:
        """One minibatch (``data[index]``): PPO's losses, backward, clipping, Adam's step."""
        cfg, agent = self.cfg, self.agent
        mb = data[index]
        obs, action, old_log_prob = mb["obs"], mb["action"], mb["log_prob"]
        log_ratio = agent.log_prob(agent.actor(obs), action) - old_log_prob
        ratio = log_ratio.exp()
        advantage = mb["advantage"]
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        policy_loss = torch.max(
            -advantage * ratio, -advantage * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)
        ).mean()
        value, old_value, returns = agent.value(obs), mb["value"], mb["returns"]
        clipped = old_value + (value - old_value).clamp(-cfg.clip, cfg.clip)
        value_loss = (
            0.5 * torch.max((value - returns).square(), (clipped - returns).square()).mean()
        )
        entropy = agent.entropy()
        loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy
        self.opt.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
        self.opt.step()
        with torch.no_grad():
            return TensorDict(
                policy_loss=policy_loss.detach(),
                value_loss=value_loss.detach(),
                approx_kl=((ratio - 1) - log_ratio).mean(),
                clip_fraction=((ratio - 1).abs() > cfg.clip).float().mean(),
                grad_norm=grad_norm.detach(),
            )

    def train(self, log: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
        cfg, device, trajectory = self.cfg, self.device, self.trajectory
        keys = ["obs", "action", "log_prob", "value"]
        size = cfg.batch // cfg.minibatches
        records = []
        state = self.start()
        _synchronize(device)
        for iteration in range(cfg.iterations):
            begin = time.perf_counter()
            if cfg.anneal_lr:
                self.lr.fill_(cfg.lr * (1.0 - iteration / cfg.iterations))
            with torch.no_grad():
                state = self.collect(state, trajectory)
            _synchronize(device)
            collected = time.perf_counter()
            with torch.no_grad():
                targets = self.gae(state["next_value"], trajectory)
            data = trajectory.select(*keys).update(targets).reshape(-1)
            for _ in range(cfg.epochs):
                for index in torch.randperm(cfg.batch, device=device).split(size):
                    metrics = self.update(data, index)
            _synchronize(device)
            end = time.perf_counter()
            episodes, total, raw = torch.stack(
                [
                    trajectory["finished"].sum().float(),
                    trajectory["finished_return"].sum(),
                    trajectory["raw_reward"].mean(),
                ]
            ).tolist()
            record = {
                "iteration": iteration,
                "env_steps": (iteration + 1) * cfg.batch,
                "rollout_s": collected - begin,
                "update_s": end - collected,
                "episodes": int(episodes),
                "mean_return": total / episodes if episodes else None,
                "reward_per_step": raw,
                **{k: float(v) for k, v in metrics.items()},
            }
            records.append(record)
            log(record)
        return records


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(cfg: Config, records: list[dict[str, Any]]) -> dict[str, Any]:
    steady = records[cfg.skip :] or records
    seconds = sum(r["rollout_s"] + r["update_s"] for r in records)
    steady_seconds = sum(r["rollout_s"] + r["update_s"] for r in steady)
    last = records[-max(1, round(cfg.final_fraction * len(records))) :]
    episodes = sum(r["episodes"] for r in last)
    total = sum(r["mean_return"] * r["episodes"] for r in last if r["episodes"])
    return {
        "env_steps": len(records) * cfg.batch,
        "seconds": seconds,
        "steps_per_s": len(records) * cfg.batch / seconds,
        "steady_steps_per_s": len(steady) * cfg.batch / steady_seconds,
        "steady_rollout_steps_per_s": len(steady) * cfg.batch / sum(r["rollout_s"] for r in steady),
        "steady_rollout_s_per_iteration": statistics.median(r["rollout_s"] for r in steady),
        "steady_update_s_per_iteration": statistics.median(r["update_s"] for r in steady),
        "final_iterations": len(last),
        "final_episodes": episodes,
        "final_return": total / episodes if episodes else None,
        "final_reward_per_step": statistics.fmean(r["reward_per_step"] for r in last),
    }


def sac_reference() -> dict[str, Any] | None:
    """LeanRL's SAC script (gymnasium's HalfCheetah-v4 on the CPU, the update graphed by
    cudagraph_td), steps per second as recorded: the median of its runs."""
    try:
        found = json.loads(SAC_REFERENCE.read_text())
        runs = found["runs"]["sac"]["cudagraph_td"]
    except (OSError, KeyError, ValueError):
        return None
    return {
        "steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
        "runs": len(runs),
        "device": runs[0].get("device"),
        "source": str(SAC_REFERENCE.relative_to(ROOT)),
    }


def _spread(values: list[float]) -> str:
    if not values:
        return "no whole episode finished"
    return f"{statistics.fmean(values):9.1f} (seeds {min(values):.1f} .. {max(values):.1f})"


def report(
    results: dict[str, Any], modes: list[str], seeds: list[int], final_fraction: float
) -> None:
    """Print, and add to ``results["comparison"]``, each mode's final return across the
    seeds, whether each mode's mean lies within the other's seeds, where the modes part, and
    the steps per second against eager and against LeanRL's SAC."""
    finals: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    for r in results["runs"]:
        if r["summary"]["final_return"] is not None:
            finals.setdefault(r["mode"], []).append(r["summary"]["final_return"])
        rates.setdefault(r["mode"], []).append(r["summary"]["steady_steps_per_s"])
    print(f"\nfinal return (whole episodes, last {final_fraction:.0%} of iterations):")
    for mode in modes:
        print(f"  {mode:8s} {_spread(finals.get(mode, []))}")
    comparison: dict[str, Any] = {}
    if len(modes) == 2 and all(len(finals.get(m, [])) > 0 for m in modes):
        for mode, other in (modes, modes[::-1]):
            mean, span = statistics.fmean(finals[mode]), finals[other]
            inside = min(span) <= mean <= max(span)
            comparison[f"{mode}_mean_in_{other}_range"] = inside
            print(
                f"  {mode}'s mean {mean:.1f} {'lies' if inside else 'does NOT lie'} within"
                f" {other}'s seeds [{min(span):.1f}, {max(span):.1f}]"
            )
    # From the same seed, the two modes draw the same random numbers (the graphs' draws
    # advance at each replay as eager's do), so they follow each other until rounding
    # differences grow: the first iteration whose mean reward differs, per seed.
    by_run = {(r["mode"], r["seed"]): r["iterations"] for r in results["runs"]}
    apart: dict[str, int | None] = {}
    for seed in seeds:
        graphed, eager = by_run.get(("graphed", seed)), by_run.get(("eager", seed))
        if graphed is None or eager is None:
            continue
        apart[str(seed)] = next(
            (
                g["iteration"] + 1
                for g, e in zip(graphed, eager, strict=True)
                if not math.isclose(g["reward_per_step"], e["reward_per_step"], rel_tol=1e-5)
            ),
            None,
        )
    if apart:
        comparison["first_iteration_apart"] = apart
        print(
            "  first iteration whose mean reward differs between the modes, per seed:"
            f" {apart} (None: never)"
        )
    # Each mode's figures across its seeds, as the docs quote them.
    comparison["modes"] = {
        mode: {
            "final_return_mean": statistics.fmean(finals[mode]) if finals.get(mode) else None,
            "final_return_min": min(finals[mode], default=None),
            "final_return_max": max(finals[mode], default=None),
            "steady_steps_per_s_mean": statistics.fmean(rates[mode]),
            "steady_steps_per_s_min": min(rates[mode]),
            "steady_steps_per_s_max": max(rates[mode]),
        }
        for mode in modes
    }
    results["comparison"] = comparison
    print("steps/s past the warm-up (mean over seeds):")
    for mode in modes:
        print(f"  {mode:8s} {statistics.fmean(rates[mode]):12,.0f}")
    if "graphed" in rates and "eager" in rates:
        ratio = statistics.fmean(rates["graphed"]) / statistics.fmean(rates["eager"])
        comparison["graphed_over_eager_steps_per_s"] = ratio
        print(f"  graphed / eager: {ratio:.2f}x")
    sac = sac_reference()
    if sac is not None and "graphed" in rates:
        results["sac_reference"] = sac
        ratio = statistics.fmean(rates["graphed"]) / sac["steps_per_s"]
        comparison["graphed_over_leanrl_sac_cpu_env"] = ratio
        print(
            f"  LeanRL's SAC on gymnasium's CPU HalfCheetah ({sac['device']}, median of"
            f" {sac['runs']} runs, {sac['source']}): {sac['steps_per_s']:,.0f} steps/s;"
            f" graphed PPO here {ratio:,.2f}x that (another algorithm: a reference point)"
        )


def merge(paths: list[str], out: str) -> None:
    """The report of the runs that the result files ``paths`` hold, made apart (each seed
    and mode a process of its own, side by side on one GPU: their returns are what they
    would be in one process; their steps per second, sharing the GPU and the host, are not
    a timing). The files must share their configuration."""
    found = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    merged = {key: found[0][key] for key in ("device", "versions", "config")}
    merged["meta"] = {  # files written before their "meta" have the rest of it
        "device": found[0]["device"],
        "torch": found[0]["versions"]["torch"],
        "date": found[0].get("meta", {}).get("date", datetime.date.today().isoformat()),
        "note": "each seed and mode a process of its own, side by side on one GPU: the"
        " returns are each run's own; the steps per second were shared, not a timing",
    }
    for other, path in zip(found[1:], paths[1:], strict=True):
        if other["config"] != merged["config"]:
            raise SystemExit(f"{path}: another configuration than {paths[0]}'s")
    merged["runs"] = [run for each in found for run in each["runs"]]
    merged["merged_from"] = paths
    modes = sorted({r["mode"] for r in merged["runs"]}, key=["graphed", "eager"].index)
    seeds = sorted({r["seed"] for r in merged["runs"]})
    print(f"{len(merged['runs'])} runs of {len(paths)} files, made apart (timings shared)")
    report(merged, modes, seeds, merged["config"]["final_fraction"])
    if out:
        pathlib.Path(out).write_text(json.dumps(merged, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--mode", default="graphed,eager", help="graphed, eager, or both")
    parser.add_argument(
        "--eager-seeds", default=None, help="the eager mode's seeds, if fewer (default: --seeds)"
    )
    parser.add_argument("--envs", type=int, default=1024 if cuda else 8)
    parser.add_argument("--steps", type=int, default=32 if cuda else 8, help="K")
    parser.add_argument(
        "--total-steps", type=int, default=None, help="environment steps a run (all worlds)"
    )
    parser.add_argument("--horizon", type=int, default=1000 if cuda else 16)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=8 if cuda else 2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--log-every", type=int, default=10, help="iterations between logs")
    parser.add_argument("--json", default="", help="where to write the results")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="result files of runs made apart (a process each): their report, as one run's",
    )
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.json)
        return
    device = torch.device("cuda" if cuda else "cpu")
    cfg = Config(
        envs=args.envs,
        steps=args.steps,
        horizon=args.horizon,
        epochs=args.epochs,
        minibatches=args.minibatches,
        lr=args.lr,
    )
    cfg.total_steps = args.total_steps or (
        cfg.batch * 100 if cuda else cfg.batch * 3
    )  # 100 iterations on CUDA, 3 on the CPU
    if not cuda:
        cfg.skip = 1
    assert cfg.batch % cfg.minibatches == 0, "N x K must split into equal minibatches"
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = [m.strip() for m in args.mode.split(",")]
    eager_seeds = (
        seeds if args.eager_seeds is None else [int(s) for s in args.eager_seeds.split(",")]
    )
    assert set(modes) <= {"graphed", "eager"}, modes
    import mujoco
    import mujoco_warp
    import warp as wp

    wp.init()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        # As the docs' figures read a result file (scripts/mkdocs_figures.py).
        "meta": {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
        },
        "versions": {
            "torch": torch.__version__,
            "warp": wp.__version__,
            "mujoco": mujoco.__version__,
            "mujoco_warp": mujoco_warp.__version__,
        },
        "config": {**asdict(cfg), "iterations": cfg.iterations},
        "runs": [],
    }
    print(
        f"{results['device']}: {cfg.envs} worlds, K={cfg.steps}, {cfg.iterations} iterations"
        f" of {cfg.batch:,} steps ({cfg.iterations * cfg.batch:,} a run), episodes of"
        f" {cfg.horizon}; {cfg.epochs} epochs x {cfg.minibatches} minibatches of"
        f" {cfg.batch // cfg.minibatches}"
    )
    # Warp's kernels loaded (compiled, or read from WARP_CACHE_PATH) before any run.
    start = time.perf_counter()
    with torch.no_grad():
        prime = Cheetah(cfg.envs, device, horizon=cfg.horizon)
        prime.reset()
        prime.step(torch.zeros(cfg.envs, prime.action_size, device=device))
    _synchronize(device)
    results["warp_load_s"] = time.perf_counter() - start
    print(f"Warp's kernels loaded in {results['warp_load_s']:.1f} s")
    cpu = capturable_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
    with cpu:
        for seed in seeds:
            for mode in modes:
                if mode == "eager" and seed not in eager_seeds:
                    continue
                run = PPO(cfg, device, seed, graphed=mode == "graphed")

                def log(r: dict[str, Any], mode: str = mode, seed: int = seed) -> None:
                    i = r["iteration"]
                    if i < 4 or (i + 1) % args.log_every == 0 or i + 1 == cfg.iterations:
                        ret = r["mean_return"]
                        print(
                            f"  {mode} seed {seed} it {i + 1:4d}/{cfg.iterations}:"
                            f" rollout {r['rollout_s'] * 1e3:8.1f} ms, update"
                            f" {r['update_s'] * 1e3:8.1f} ms; {r['episodes']:4d} episodes,"
                            f" return {'   -   ' if ret is None else f'{ret:8.1f}'},"
                            f" reward/step {r['reward_per_step']:7.3f}, kl {r['approx_kl']:.4f}",
                            flush=True,
                        )

                records = run.train(log)
                summary = summarize(cfg, records)
                print(
                    f"{mode} seed {seed}: {summary['steps_per_s']:,.0f} steps/s"
                    f" ({summary['steady_steps_per_s']:,.0f} past {cfg.skip} iterations;"
                    f" rollout {summary['steady_rollout_s_per_iteration'] * 1e3:.1f} ms,"
                    f" update {summary['steady_update_s_per_iteration'] * 1e3:.1f} ms an"
                    f" iteration), final return {summary['final_return']}"
                    f" over {summary['final_episodes']} episodes",
                    flush=True,
                )
                results["runs"].append(
                    {"mode": mode, "seed": seed, "summary": summary, "iterations": records}
                )
                if args.json:  # after every run: a run cut short keeps what it did
                    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
                del run
    report(results, modes, seeds, cfg.final_fraction)
    if not cuda:
        print("(Warp's CPU device and the library's emulation: a smoke test, not a GPU's timings)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
