"""HalfCheetah on MuJoCo Warp, N worlds stepped as one batch, and its whole rollouts graphed.

``Cheetah`` is gymnasium's HalfCheetah-v4 (its model, ``assets/half_cheetah.xml``; 5 MuJoCo
steps an environment step; reward = x velocity - 0.1 * sum(action^2); observation = qpos[1:]
and qvel; episodes truncated at 1,000 steps; a new episode starts at qpos0 + U(-0.1, 0.1)
and qvel N(0, 0.1^2)) on ``mujoco_warp``, for torch: its observation and action tensors
share the memory of Warp's arrays (``wp.to_torch``), its random resets are torch's (drawn for
every world, applied with ``torch.where``: no host sync), and on CUDA every Warp kernel is
launched on torch's current stream, read at each call, so that ``CudaGraphModule``'s
warm-up (a side stream) and capture (its own stream) hold the physics too. During a capture
the Warp launches are registered with Warp as an external capture
(``wp.capture_begin(external=True)``): the solver's early exit (``wp.capture_while``,
``opt.graph_conditional``) then becomes a conditional node of torch's graph, and the
solver's scratch arrays are graph allocations.

``Rollout`` is ``examples/gpu_rollout.py``'s pattern on this environment: K steps of a
small policy (with Gaussian exploration noise), the environment and the writing of each
transition into a trajectory TensorDict, one function that ``CudaGraphModule`` captures.

``--check`` compares (a) the batched environment against MuJoCo's C ``mj_step`` (float64)
from the same states and actions, over 100 environment steps (``--skip-c``: not), and (b)
the rollout graphed against the same rollout eager, and eager against itself, from the
same seed: 7 calls of K=20 steps (a warm-up, the capture, then 5 replays: 140 steps, 100 of
them replayed), with every episode ending and reset at steps 29, 59, 89 and 119, so inside
replays. For each pair it prints the largest absolute difference at each step (over the
worlds, of observation, action and reward), the first step where it exceeds 1e-3, and the
worlds where it ever does. It asserts what holds: graphed equals eager to float tolerance
where eager reproduces itself bit for bit (exactly, on the CPU); where eager does not,
graphed drifts from eager in no more worlds than eager drifts from itself, but for the
count's sampling noise. On a GPU, eager does not reproduce itself by default: MuJoCo Warp
adds floats with atomics, and orders contacts and constraint rows by atomic counters (see
`Cheetah`); ``--check-deterministic`` runs (b) without and with MuJoCo Warp's
``opt.deterministic`` (both, on CUDA). Warp's own deterministic mode for every kernel
(``wp.config.deterministic``), which would fix the counters' order too, does not compile
mujoco-warp 4.0.0's kernels (warp 1.19.0: passive.py's ``_eff_contact_build`` and a kernel
of solver.py's line search read or write arrays that they also add to atomically).
Then, as without ``--check``, it times environment steps per second: the eager per-step
loop, the policy graphed, and the whole K-step rollout graphed. Without CUDA it runs on
Warp's CPU device and the library's emulation, with a few worlds (a smoke test, not a GPU's
timings).

Needs ``mujoco-warp`` (4.0.0), ``warp-lang`` and ``mujoco``, which the library does not
(``scripts/carry_parts.sh`` carries their wheels to the GPU machine).

    python benchmarks/mjwarp_cheetah.py --check --envs 1024,4096 --steps 16,64 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

os.environ.setdefault("WARP_CACHE_PATH", "/tmp/warp-cache-mjw")  # compiled kernels

import mujoco
import mujoco_warp as mjw
import numpy as np
import torch
import warp as wp
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks.rollouts beside it

from benchmarks.rollouts import time_variants  # noqa: E402
from cudagraph_td import CudaGraphModule  # noqa: E402

MODEL = pathlib.Path(__file__).parent / "assets" / "half_cheetah.xml"


class Cheetah:
    """``nworld`` HalfCheetah-v4 environments on MuJoCo Warp, on ``device`` (torch's).

    Args:
        nworld: the number of worlds (environments).
        device: torch's device; Warp runs on the same one (``cuda:i`` or ``cpu``).
        horizon: steps an episode (gymnasium's TimeLimit: 1,000).
        conditional: the solver stops at convergence (``opt.graph_conditional``: a host
            sync an iteration when eager, a conditional node when graphed); False, it runs
            ``opt.iterations`` iterations every step (converged worlds skip the work).
        iterations: ``opt.iterations`` (the model's: 100), at most, a step.
        deterministic: MuJoCo Warp's ``opt.deterministic`` (``DeterminismType.ALL``): its
            floating-point atomic sums in a fixed order (Warp's ``DeterministicMode.RUN_TO_RUN``
            on those kernels). In mujoco-warp 4.0.0 the contact and constraint-row sorts that
            the flag also names are stubs (``_sort_contacts``, ``_sort_constraints``): the
            order of contacts and constraint rows, taken with atomic counters, still varies
            from run to run on a GPU. Warp's CPU device runs kernels in order: the same
            result every run, with or without it.
    """

    frame_skip = 5
    forward_reward_weight = 1.0
    ctrl_cost_weight = 0.1
    reset_noise_scale = 0.1

    def __init__(
        self,
        nworld: int,
        device: torch.device,
        horizon: int = 1000,
        conditional: bool = True,
        iterations: int | None = None,
        deterministic: bool = False,
    ):
        self.nworld, self.device, self.horizon = nworld, device, horizon
        self.mjm = mujoco.MjModel.from_xml_path(str(MODEL))
        if iterations is not None:
            self.mjm.opt.iterations = iterations
        self.wp_device = wp.get_device("cpu" if device.type == "cpu" else f"cuda:{_index(device)}")
        with wp.ScopedDevice(self.wp_device):
            self.m = mjw.put_model(self.mjm)
            self.m.opt.graph_conditional = conditional
            if deterministic:
                self.m.opt.deterministic = int(mjw.DeterminismType.ALL)
            self.d = mjw.make_data(self.mjm, nworld=nworld)
        self.dt = float(self.mjm.opt.timestep) * self.frame_skip
        # The state that `_simulate` declares it writes has no actuator activations.
        assert self.mjm.na == 0, "a model with activations: pass d.act to _simulate too"
        # Views of Warp's arrays: the same memory, no copies either way.
        self.qpos = wp.to_torch(self.d.qpos)  # (nworld, 9)
        self.qvel = wp.to_torch(self.d.qvel)  # (nworld, 9)
        self.ctrl = wp.to_torch(self.d.ctrl)  # (nworld, 6)
        self.qacc_warmstart = wp.to_torch(self.d.qacc_warmstart)
        self.time = wp.to_torch(self.d.time)
        self.init_qpos = torch.as_tensor(self.mjm.qpos0, dtype=self.qpos.dtype, device=device)
        self.t = torch.zeros(nworld, dtype=torch.long, device=device)  # steps into the episode
        self._streams: dict[int, wp.Stream] = {}  # Warp's wrapper of each torch stream seen
        self._captures: list[Any] = []  # Warp's records of the captures it took part in
        self._id = len(_ENVIRONMENTS)
        _ENVIRONMENTS.append(self)

    @property
    def observation_size(self) -> int:
        return self.mjm.nq - 1 + self.mjm.nv

    @property
    def action_size(self) -> int:
        return self.mjm.nu

    def observe(self) -> torch.Tensor:
        """qpos without the x position, and qvel (gymnasium's HalfCheetah observation)."""
        return torch.cat([self.qpos[:, 1:], self.qvel], dim=-1)

    def reset(self) -> torch.Tensor:
        """Every world to a new episode; the first observation."""
        self._reset(torch.ones(self.nworld, dtype=torch.bool, device=self.device))
        return self.observe()

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One environment step of every world: ``frame_skip`` MuJoCo steps under ``action``,
        then a new episode for the worlds whose episode ended (truncated at ``horizon``).

        Returns the observation the next step acts on (a new episode's, where one ended),
        the reward, and the done flags, each of leading size ``nworld``.
        """
        # MuJoCo clamps ctrl to the actuators' range (ctrllimited); the cost is of the
        # action as given, as in gymnasium.
        self.ctrl.copy_(action)
        x_before = self.qpos[:, 0].clone()
        _simulate(self.qpos, self.qvel, self.qacc_warmstart, self.time, self.ctrl, self._id)
        x_velocity = (self.qpos[:, 0] - x_before) / self.dt
        ctrl_cost = self.ctrl_cost_weight * action.square().sum(-1)
        reward = self.forward_reward_weight * x_velocity - ctrl_cost
        self.t += 1
        done = self.t >= self.horizon
        self._reset(done)
        return self.observe(), reward, done

    def _reset(self, done: torch.Tensor) -> None:
        """New episodes where ``done``, without a branch: every world draws its noise, and
        ``torch.where`` keeps it where an episode ended (no host sync)."""
        scale = self.reset_noise_scale
        qpos = self.init_qpos + (torch.rand_like(self.qpos) * 2 - 1) * scale
        qvel = scale * torch.randn_like(self.qvel)
        where = done.unsqueeze(-1)
        self.qpos.copy_(torch.where(where, qpos, self.qpos))
        self.qvel.copy_(torch.where(where, qvel, self.qvel))
        # What else a step carries over (mj_resetData's share of it): the solver's warm
        # start and the time.
        self.qacc_warmstart.masked_fill_(where, 0.0)
        self.time.masked_fill_(done, 0.0)
        self.t.masked_fill_(done, 0)

    def _simulate(self) -> None:
        if not self.wp_device.is_cuda:
            for _ in range(self.frame_skip):
                mjw.step(self.m, self.d)
            return
        # torch's current stream, read at each call: the wrapper warms up on a side stream
        # and captures on a stream of its own.
        stream = torch.cuda.current_stream(self.device)
        wp_stream = self._streams.get(stream.cuda_stream)
        if wp_stream is None:
            wp_stream = self._streams[stream.cuda_stream] = wp.stream_from_torch(stream)
        capturing = torch.cuda.is_current_stream_capturing()
        # sync_enter=False: no event wait on Warp's own stream, which a capture would refuse.
        with wp.ScopedStream(wp_stream, sync_enter=False):
            if capturing:
                # torch's capture, made known to Warp: its graph allocations are tracked and
                # capture_while becomes a conditional node. The library captures in
                # "global" mode (torch's default), which Warp is told.
                wp.capture_begin(
                    stream=wp_stream,
                    external=True,
                    force_module_load=False,
                    capture_mode=wp.CaptureMode.GLOBAL,
                )
            try:
                for _ in range(self.frame_skip):
                    mjw.step(self.m, self.d)
            finally:
                if capturing:
                    # Kept: it holds the modules (and allocations) the graph launches.
                    self._captures.append(wp.capture_end(stream=wp_stream))


_ENVIRONMENTS: list[Cheetah] = []


# The physics as one torch operator: to the library's CPU emulation, which records and
# replays ATen operations and no Python, Warp's CPU kernels are then one operation it replays;
# on CUDA it changes nothing (the operator runs its Python at the warm-up and at the capture,
# and the graph holds Warp's kernels). Its arguments are the state that a step carries to the
# next (HalfCheetah has no actuator activations, ``act``), written in place and declared so
# (``mutates_args``), and the controls it reads. The emulated capture runs the operator (a
# CUDA capture runs nothing) and then undoes the writes into older tensors that it sees,
# which are those the schema declares: with ``qpos`` alone declared, the velocities, the
# solver's warm start and the time stayed as the capture's first step had left them, and the
# first replay started from them (its trajectory wrong from its second step on; the next
# replay's was right again only because every world's episode ended at the last step of the
# first one, and the resets overwrite that whole state). Warp's other arrays (positions of
# bodies, contacts, constraint rows, ...) are recomputed by each step before they are read.
@torch.library.custom_op(
    "mjwarp_cheetah::simulate", mutates_args=("qpos", "qvel", "qacc_warmstart", "clock")
)
def _simulate(
    qpos: torch.Tensor,
    qvel: torch.Tensor,
    qacc_warmstart: torch.Tensor,
    clock: torch.Tensor,
    ctrl: torch.Tensor,
    env: int,
) -> None:
    _ENVIRONMENTS[env]._simulate()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class Rollout:
    """N cheetahs and a policy, stepped K steps at a time (``examples/gpu_rollout.py``'s
    ``Rollout``, on MuJoCo Warp)."""

    def __init__(self, envs: int, steps: int, device: torch.device, **env: Any):
        self.envs, self.steps, self.device = envs, steps, device
        self.env = Cheetah(envs, device, **env)
        n_obs, n_act = self.env.observation_size, self.env.action_size
        net = nn.Sequential(nn.Linear(n_obs, 64), nn.Tanh(), nn.Linear(64, n_act), nn.Tanh())
        self.policy = TensorDictModule(net.to(device), in_keys=["observation"], out_keys=["action"])
        self.noise = 0.3  # exploration: the graph's random numbers must advance each replay

    def start(self) -> TensorDict:
        """New episodes in every world; the state a rollout starts from."""
        return TensorDict(observation=self.env.reset(), batch_size=[self.envs])

    def trajectory(self) -> TensorDict:
        """The buffer of K transitions of every environment, made once and filled in place."""
        n, k, env = self.envs, self.steps, self.env
        zeros = {"device": self.device}
        return TensorDict(
            observation=torch.zeros(n, k, env.observation_size, **zeros),
            action=torch.zeros(n, k, env.action_size, **zeros),
            reward=torch.zeros(n, k, 1, **zeros),
            done=torch.zeros(n, k, 1, dtype=torch.bool, **zeros),
            batch_size=[n, k],
        )

    def run(
        self,
        state: TensorDict,
        trajectory: TensorDict,
        act: Callable[[TensorDict], TensorDict] | None = None,
    ) -> TensorDict:
        """K steps from ``state``, each transition written into ``trajectory`` (in place);
        the next state. Graphed whole, or eager with ``act`` for the policy."""
        act = self.policy if act is None else act
        for k in range(self.steps):
            observation = state["observation"]
            mean = act(TensorDict(observation=observation, batch_size=[self.envs]))["action"]
            action = (mean + self.noise * torch.randn_like(mean)).clamp(-1.0, 1.0)
            next_observation, reward, done = self.env.step(action)
            trajectory[:, k].update_(
                TensorDict(
                    observation=observation,
                    action=action,
                    reward=reward.unsqueeze(-1),
                    done=done.unsqueeze(-1),
                    batch_size=[self.envs],
                )
            )
            state = TensorDict(observation=next_observation, batch_size=[self.envs])
        return state

    def caller(self, run: Callable[[TensorDict, TensorDict], TensorDict]) -> Callable[[], None]:
        """A call of ``run`` on the rollout's worlds, from the state the last call left."""
        state, trajectory = self.start(), self.trajectory()

        def call() -> None:
            nonlocal state
            state = run(state, trajectory)

        return call


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_against_c(device: torch.device, worlds: int, steps: int, **env: Any) -> dict[str, float]:
    """The batched environment against MuJoCo's C ``mj_step`` (float64), ``steps``
    environment steps (no reset on the way): each step from the state Warp reached (a
    float32 step against a float64 one), and the whole trajectory from the first state
    (which two chaotic runs, of float32 and float64, follow only for a while)."""
    rollout = Rollout(worlds, steps, device, horizon=steps + 1, **env)
    torch.manual_seed(2)
    state, trajectory = rollout.start(), rollout.trajectory()
    start = time.perf_counter()
    state = rollout.run(state, trajectory)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    actions = trajectory["action"].double().cpu().numpy()
    observed = trajectory["observation"].double().cpu().numpy()
    observed = np.concatenate([observed, state["observation"].double().cpu().numpy()[:, None]], 1)
    rewards = trajectory["reward"].double().cpu().numpy()[..., 0]
    mjm, nq = rollout.env.mjm, rollout.env.mjm.nq
    free = mujoco.MjData(mjm)
    step_error, reward_error, free_error = 0.0, 0.0, np.zeros((worlds, steps + 1))
    for world in range(worlds):
        # qpos[0], the x position, is not observed; nothing in the dynamics depends on it.
        free.qpos[:], free.qvel[:] = (
            np.concatenate([[0.0], observed[world, 0, : nq - 1]]),
            observed[world, 0, nq - 1 :],
        )
        for k in range(steps):
            data = mujoco.MjData(mjm)
            data.qpos[1:], data.qvel[:] = observed[world, k, : nq - 1], observed[world, k, nq - 1 :]
            data.ctrl[:] = free.ctrl[:] = actions[world, k]
            mujoco.mj_step(mjm, data, nstep=Cheetah.frame_skip)
            reward = data.qpos[0] / rollout.env.dt - 0.1 * np.square(actions[world, k]).sum()
            expected = np.concatenate([data.qpos[1:], data.qvel])
            step_error = max(step_error, float(np.abs(observed[world, k + 1] - expected).max()))
            reward_error = max(reward_error, abs(float(rewards[world, k] - reward)))
            free_error[world, k] = np.abs(
                observed[world, k] - np.concatenate([free.qpos[1:], free.qvel])
            ).max()
            mujoco.mj_step(mjm, free, nstep=Cheetah.frame_skip)
        free_error[world, steps] = np.abs(
            observed[world, steps] - np.concatenate([free.qpos[1:], free.qvel])
        ).max()
    apart = free_error.max(0) > 1e-2
    # float32 against float64 over 5 steps of 0.01 s: velocities of a few m/s agree to 1e-3.
    assert step_error < 5e-3 and reward_error < 1e-3, (step_error, reward_error)
    return {
        "worlds": worlds,
        "steps": steps,
        "max_abs_obs_one_step": step_error,
        "max_abs_reward_one_step": reward_error,
        "max_abs_obs_free_run_10_steps": float(free_error[:, :11].max()),
        "free_run_apart_by_1e-2_at_step": int(np.argmax(apart)) if apart.any() else -1,
        "eager_seconds": elapsed,
    }


def _apart(a: TensorDict, b: TensorDict) -> torch.Tensor:
    """The largest absolute difference of two trajectories at each world and step (of the
    observation, the action and the reward): a (worlds, steps) tensor."""
    return torch.stack(
        [
            (a[key].double() - b[key].double()).abs().amax(-1)
            for key in ("observation", "action", "reward")
        ]
    ).amax(0)


def _summary(apart: torch.Tensor, threshold: float = 1e-3) -> dict[str, Any]:
    """Per step, the largest difference over the worlds; the first step where there is one,
    and where it exceeds ``threshold`` (-1: none); the worlds that ever differ by more."""
    per_step = apart.amax(0)
    over, differ = per_step > threshold, per_step > 0
    return {
        "max_abs": float(per_step.max()),
        "first_step_differing": int(differ.int().argmax()) if bool(differ.any()) else -1,
        "first_step_over_1e-3": int(over.int().argmax()) if bool(over.any()) else -1,
        "worlds_over_1e-3": int((apart > threshold).any(1).sum()),
        "max_abs_per_step": [float(f"{x:.2g}") for x in per_step.tolist()],
    }


def check_graph_against_eager(
    device: torch.device,
    worlds: int,
    steps: int,
    calls: int,
    deterministic: bool = False,
    **env: Any,
) -> dict[str, Any]:
    """The rollout graphed (warm-up, capture, replays) against the same rollout eager, and
    eager against itself, from the same seed and states, with episodes that end (and reset)
    on the way: ``calls`` calls of ``steps`` steps each.

    Graphed must equal eager to float tolerance where eager equals itself (Warp's CPU
    device, and on CUDA a reproducible step); where eager does not (on CUDA the order of
    contacts and constraint rows, and so of the solver's sums, varies from run to run, and
    contacts are chaotic: see `Cheetah`), graphed must not differ from eager in more worlds
    than eager differs from itself, but for the sampling noise of the count.
    """
    backend: Literal["cuda", "emulate"] = "cuda" if device.type == "cuda" else "emulate"
    rollout = Rollout(
        worlds, steps, device, horizon=3 * steps // 2, deterministic=deterministic, **env
    )

    def trajectories(run: Callable[[TensorDict, TensorDict], TensorDict]) -> TensorDict:
        torch.manual_seed(1)
        state, trajectory, kept = rollout.start(), rollout.trajectory(), []
        for _ in range(calls):
            state = run(state, trajectory)
            kept.append(trajectory.clone())
        _synchronize(device)
        return torch.cat(kept, dim=1)  # (worlds, calls * steps)

    start = time.perf_counter()
    eager = trajectories(rollout.run)
    eager_seconds = time.perf_counter() - start
    again = trajectories(rollout.run)
    start = time.perf_counter()
    graphed = trajectories(CudaGraphModule(rollout.run, backend=backend))
    graphed_seconds = time.perf_counter() - start
    assert bool(eager["done"].any()), "no episode ended: the resets were not checked"
    assert torch.equal(graphed["done"], eager["done"]), "the episodes end at other steps"
    eager_eager, graphed_eager = _apart(again, eager), _apart(graphed, eager)
    result = {
        "worlds": worlds,
        "steps": calls * steps,
        "replayed_steps": (calls - 2) * steps,
        "deterministic": deterministic,
        "eager_seconds": eager_seconds,
        "graphed_seconds_with_capture": graphed_seconds,
        "eager_vs_eager": _summary(eager_eager),
        "graphed_vs_eager": _summary(graphed_eager),
    }
    for name in ("eager_vs_eager", "graphed_vs_eager"):
        found = {k: v for k, v in result[name].items() if k != "max_abs_per_step"}
        print(f"  {name} (deterministic={deterministic}): {found}")
        print("    max abs a step:", " ".join(f"{x:.0e}" for x in result[name]["max_abs_per_step"]))
    if float(eager_eager.max()) == 0.0:  # eager reproduces itself bit for bit
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
        if device.type == "cpu":  # the emulation replays the same CPU kernels
            assert float(graphed_eager.max()) == 0.0, result["graphed_vs_eager"]
    else:
        ee, ge = (result[n]["worlds_over_1e-3"] for n in ("eager_vs_eager", "graphed_vs_eager"))
        # Two counts of worlds that drift apart, each of a binomial law if the graph adds no
        # difference of its own: 3 standard deviations of their difference.
        assert ge <= ee + 3 * (ee + ge) ** 0.5 + 3, (
            f"graphed drifts from eager in {ge} worlds, eager from itself in {ee}"
        )
    return result


def variants(envs: int, steps: list[int], device: torch.device, **env: Any) -> dict[str, Any]:
    """Each variant's call (K steps of every environment) and its K."""
    backend: Literal["cuda", "emulate"] = "cuda" if device.type == "cuda" else "emulate"
    found: dict[str, Any] = {}
    for k in steps:
        rollout = Rollout(envs, k, device, **env)
        if k == steps[0]:
            policy = CudaGraphModule(rollout.policy, backend=backend)
            found["eager, per step"] = (rollout.caller(rollout.run), k)
            found["policy graphed"] = (
                rollout.caller(functools.partial(rollout.run, act=policy)),
                k,
            )
        whole = CudaGraphModule(rollout.run, backend=backend)
        found[f"whole rollout graphed, K={k}"] = (rollout.caller(whole), k)
    return found


def bench(args: argparse.Namespace, device: torch.device, env: dict[str, Any]) -> dict[str, Any]:
    """Environment steps per second of each variant, at each number of worlds (the rounds,
    their medians and where the time goes: `benchmarks.rollouts.time_variants`)."""
    ks = [int(k) for k in args.steps.split(",")]
    results: dict[str, Any] = {}
    for envs in (int(n) for n in args.envs.split(",")):
        torch.manual_seed(0)
        start = time.perf_counter()
        found = variants(envs, ks, device, **env)
        for call, _ in found.values():  # warm-ups and captures
            for _ in range(3):
                call()
        _synchronize(device)
        setup = time.perf_counter() - start
        print(f"{envs} worlds (warm-ups and captures {setup:.1f} s)")
        results[str(envs)] = {
            **time_variants(found, envs, ks, args.rounds, args.calls),
            "setup_s": setup,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--check", action="store_true", help="check first (see the docstring)")
    parser.add_argument("--no-bench", action="store_true", help="only the check")
    parser.add_argument("--envs", default="1024,4096" if cuda else "4")
    parser.add_argument("--steps", default="16,64" if cuda else "4", help="K values")
    parser.add_argument("--rounds", type=int, default=5 if cuda else 1)
    parser.add_argument(
        "--calls", type=int, default=4 if cuda else 1, help="rollouts of the last K a timing"
    )
    parser.add_argument("--check-worlds", type=int, default=256 if cuda else 4)
    parser.add_argument(
        "--check-steps", type=int, default=20, help="K of the graphed rollout the check compares"
    )
    parser.add_argument(
        "--check-calls",
        type=int,
        default=7,
        help="its calls: a warm-up, the capture, then replays (7 with K=20: 100 steps replayed)",
    )
    parser.add_argument(
        "--check-deterministic",
        choices=("on", "off", "both"),
        default="both" if cuda else "off",
        help="the graphed-against-eager check with MuJoCo Warp's opt.deterministic, without, or both",
    )
    parser.add_argument("--skip-c", action="store_true", help="no check against C mj_step")
    parser.add_argument("--no-conditional", action="store_true", help="fixed solver iterations")
    parser.add_argument("--iterations", type=int, default=None, help="opt.iterations")
    parser.add_argument("--json", default="", help="where to write the results")
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    env = {"conditional": not args.no_conditional, "iterations": args.iterations}
    results: dict[str, Any] = {
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
            "mujoco_warp": mjw.__version__,
        },
        "options": env,
    }
    wp.init()
    with torch.no_grad():
        if args.check:
            if not args.skip_c:
                start = time.perf_counter()
                results["check_c"] = check_against_c(device, min(4, args.check_worlds), 100, **env)
                results["check_c"]["seconds_with_compilation"] = time.perf_counter() - start
                print("against C mj_step:", results["check_c"])
            modes = {"on": [True], "off": [False], "both": [False, True]}[args.check_deterministic]
            for deterministic in modes:
                start = time.perf_counter()
                print(f"graphed against eager, deterministic={deterministic}:")
                found = check_graph_against_eager(
                    device,
                    args.check_worlds,
                    args.check_steps,
                    args.check_calls,
                    deterministic=deterministic,
                    **env,
                )
                found["seconds_with_compilation"] = time.perf_counter() - start
                print(f"  ({found['seconds_with_compilation']:.1f} s)")
                results[f"check_graph_deterministic_{deterministic}"] = found
        if not args.no_bench:
            results["bench"] = bench(args, device, env)
    if not cuda:
        print("(Warp's CPU device and the library's emulation: a smoke test, not a GPU's timings)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
