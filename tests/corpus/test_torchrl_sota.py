"""torchrl's sota-implementations: each script's update step, wrapped as the script wraps it,
against an eager twin (skipped without torchrl).

The scripts (``sota-implementations/<name>/<name>.py`` and their ``utils.py``) were read at
pytorch/rl commit ae9719f17b1517af5c2523a36c4616f003ee55cf (2026-08-22, main, version.txt
0.14.0): the newest commit we could read, and the closest to the torchrl 0.14.1 wheel that the
tests run against (v0.14.1 itself was not among the commits we could read; the scripts'
update functions and ``utils.py`` builders use no API that differs between the two). Each test
rebuilds a script's networks, loss module and optimizers as its ``utils.py`` does (code written
from reading it, not copied), runs the script's ``update`` as the script writes it, wrapped as
the script wraps it under ``compile.cudagraphs=True`` (``CudaGraphModule(update, in_keys=[],
out_keys=[], warmup=5)``), and compares what the script logs after each update and the loss
module's state at the end with the same run unwrapped (``compile.cudagraphs=False``): same
seeds, same data, same initial weights.

What differs from the scripts: hidden layers of 32 units and batches of 32 (the scripts: 256
and 256), a few dozen updates, and the data. MuJoCo, Atari and gym's CartPole cannot be
installed in CI: the continuous-control scripts run on torchrl's ``PendulumEnv`` (written in
torch) with gym's Pendulum-v1 observation (cos, sin, angular velocity; the CQL and IQL online
scripts' own default task), DQN on batches of CartPole's keys and shapes. The scripts'
``warnings.warn("CudaGraphModule is experimental ...")`` line is left out (warnings are errors
in this suite).

Where a script cannot be captured as written (the ``as_written`` tests), the test asserts the
library's error, and the variants named after a change run the script with it
(docs/corpus.md, "torchrl's sota-implementations", says which change makes each script capturable):

- optimizers built without ``capturable=True`` (every script but A2C, which sets
  ``capturable=device.type == "cuda"``);
- ``GAE`` (PPO, A2C), which reads ``nan_mask.any()`` on the host at every call;
- CrossQ's ``TensorDict({"loss_actor": float("nan"), ...}, device=device)``, a copy of a
  Python number to the device;
- DQN's ``HardUpdate``, whose Python counter runs at the capture only: the graph copies the
  target network at every replay (or never), which no wrapper can see.
TD3 passes ``update(batch, update_actor)`` with a Python bool that alternates: it needs
``static=("update_actor",)``, and without it the wrapper refuses the second value.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from cudagraph_td import CudaGraphModule

from ..conftest import Backend
from .conftest import OnReplayPath, Recorder, same

torchrl = pytest.importorskip("torchrl")
from tensordict.nn import (  # noqa: E402
    AddStateIndependentNormalScale,
    InteractionType,
    NormalParamExtractor,
    TensorDictModule,
    TensorDictSequential,
)
from tensordict.nn import CudaGraphModule as TensorDictCudaGraphModule  # noqa: E402
from torchrl.data import Composite, OneHot, Unbounded  # noqa: E402
from torchrl.envs import (  # noqa: E402
    Compose,
    InitTracker,
    PendulumEnv,
    RewardSum,
    StepCounter,
    Transform,
    TransformedEnv,
)
from torchrl.envs.utils import ExplorationType, set_exploration_type  # noqa: E402
from torchrl.modules import (  # noqa: E402
    MLP,
    BatchRenorm1d,
    ProbabilisticActor,
    QValueActor,
    TanhModule,
    TanhNormal,
    ValueOperator,
)
from torchrl.objectives import (  # noqa: E402
    A2CLoss,
    ClipPPOLoss,
    CQLLoss,
    CrossQLoss,
    DQNLoss,
    HardUpdate,
    IQLLoss,
    SACLoss,
    SoftUpdate,
    TD3BCLoss,
    TD3Loss,
    group_optimizers,
)
from torchrl.objectives.value.advantages import GAE  # noqa: E402

SOURCE = "torchrl 0.14.1 sota-implementations"
TORCHRL_COMMIT = "ae9719f17b1517af5c2523a36c4616f003ee55cf"
HIDDEN = [32, 32]  # network.hidden_sizes: [256, 256] in the scripts
BATCH = 32  # optim.batch_size: 256 in the scripts
TOL = {"rtol": 1e-4, "atol": 1e-5, "equal_nan": True}

# The scripts' `torch.compiler.cudagraph_mark_step_begin()` imports torch's inductor, which
# warns once that a module of torch's own uses `torch.jit.script_method` (torch 2.13).
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)

# The library's errors, as the tests pin them.
NOT_CAPTURABLE = re.escape("an optimizer steps inside the capture without `capturable=True`")
HOST_SYNC = re.escape("the function synchronises the host with the GPU")
NOT_STATIC = re.escape("declare it static (`static=(1,)`")

Wrap = Callable[..., Any]  # tensordict's CudaGraphModule's signature: (fn, warmup, in_keys, ...)


def _eager(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """``compile.cudagraphs=False``: the function itself."""
    return fn


# ---------------------------------------------------------------------------------------------
# The environment and the data
# ---------------------------------------------------------------------------------------------


class _PendulumObservation(Transform):
    """gym's Pendulum-v1 observation, ``[cos(th), sin(th), thdot]``, from PendulumEnv's state."""

    def __init__(self) -> None:
        super().__init__(in_keys=["th", "thdot"], out_keys=["observation"])

    def _observe(self, td: TensorDictBase) -> TensorDictBase:
        th, thdot = td["th"], td["thdot"]
        return td.set("observation", torch.stack([th.cos(), th.sin(), thdot], -1))

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self._observe(next_tensordict)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> Any:
        return self._observe(tensordict_reset)

    def transform_observation_spec(self, observation_spec: Any) -> Any:
        shape = (*observation_spec.shape, 3)
        observation_spec["observation"] = Unbounded(shape, device=observation_spec.device)
        return observation_spec


def _pendulum(device: torch.device) -> TransformedEnv:
    """The scripts' ``apply_env_transforms`` around Pendulum (DoubleToFloat has no work here)."""
    transforms = Compose(_PendulumObservation(), InitTracker(), StepCounter(200), RewardSum())
    return TransformedEnv(PendulumEnv(device=device), transforms)


_KEYS = ["observation", "action", *(("next", k) for k in ("observation", "reward", "done"))]
_KEYS += [("next", "terminated"), ("next", "truncated")]


@functools.cache
def _replay_data(device: torch.device) -> TensorDict:
    """Frames of Pendulum acted on at random, as a replay buffer stores them (made once)."""
    return _rollout(device)


def _rollout(device: torch.device, policy: Any = None, frames: int = 128) -> TensorDict:
    """Frames of Pendulum, acted on at random or by ``policy``."""
    env = _pendulum(device)
    env.set_seed(0)
    torch.manual_seed(0)
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        data = env.rollout(frames, policy, break_when_any_done=False)
    keys = _KEYS if policy is None else [*_KEYS, "action_log_prob", "loc", "scale"]
    return data.select(*keys).contiguous()


def _samples(data: TensorDict, steps: int, size: int = BATCH) -> list[TensorDict]:
    """``replay_buffer.sample()`` ``steps`` times, from a generator of its own."""
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(len(data), (size,), generator=generator) for _ in range(steps)]
    return [data[idx.to(data.device)] for idx in rows]


def _step(i: int) -> None:
    """Before the ``i``-th update of a run: the scripts' ``cudagraph_mark_step_begin()``, and the
    same random numbers for the graphed run and its eager twin."""
    torch.manual_seed(1000 + i)
    torch.compiler.cudagraph_mark_step_begin()


def _logged(value: Any) -> Any:
    """What a script logs of an update's result: a copy, taken at once."""
    if isinstance(value, tuple):
        return tuple(_logged(v) for v in value)
    return value.detach().clone()


# ---------------------------------------------------------------------------------------------
# A run, its twin, and the outcomes
# ---------------------------------------------------------------------------------------------


@dataclass
class Agent:
    """A script once built, its update wrapped: the module whose state is compared, the loop
    that runs its updates on the test's data and returns what it logs, and the wrappers."""

    state: nn.Module
    loop: Callable[[], list[Any]]
    wrapped: list[Any] = field(default_factory=list)


Build = Callable[[torch.device, Wrap], Agent]


@dataclass
class Run:
    logged: list[Any]
    state: dict[str, torch.Tensor]
    wrapped: list[Any]


def _run(build: Build, device: torch.device, wrap: Wrap) -> Run:
    torch.manual_seed(0)  # the same initial weights for each run
    agent = build(device, wrap)
    logged = agent.loop()
    state = {k: v.detach().clone() for k, v in agent.state.state_dict().items()}
    return Run(logged, state, agent.wrapped)


class _Ours:
    """This library's wrapper, as the scripts call tensordict's; each wrapper's calls that
    fell off the replay path are counted (`replay_path`)."""

    def __init__(self, backend: Backend, **options: Any):
        self.options = {"backend": backend.name, **options}
        self.replay_path = OnReplayPath()

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> CudaGraphModule:
        wrapped: CudaGraphModule = self.replay_path.watch(
            CudaGraphModule(fn, *args, **kwargs, **self.options)
        )
        return wrapped


def _ours(backend: Backend, **options: Any) -> _Ours:
    return _Ours(backend, **options)


def _check_matches_eager(
    backend: Backend, record: Recorder, build: Build, **options: Any
) -> list[Any]:
    """Run ``build`` graphed and eager; assert that they match and that graphs replayed."""
    ours = _ours(backend, **options)
    try:
        graphed = _run(build, backend.device, ours)
    except Exception as err:  # the row's outcome, then the test's failure
        record("cudagraph_td", "raises", f"{type(err).__name__}: {err}", backend=backend.name)
        raise
    eager = _run(build, backend.device, _eager)
    for i, (got, want) in enumerate(zip(graphed.logged, eager.logged, strict=True)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, i=i: f"update {i}: {m}")
    torch.testing.assert_close(graphed.state, eager.state, **TOL)
    assert graphed.wrapped, "the build wrapped nothing"
    for wrapper in graphed.wrapped:
        assert any(info.captured and info.replays for info in wrapper.graphs()), wrapper
    # Every call after a graph's capture replays on the replay path: none is answered by
    # the slow path's full check (the scripts' updates were, at every call, until 2026-11-25).
    ours.replay_path.check()
    record("cudagraph_td", "matches eager", backend=backend.name)
    if "outputs" not in options:  # with outputs=, the row without it runs tensordict's class
        _attempt_tensordict(backend, record, build, eager)
    return graphed.wrapped


def _check_raises(
    backend: Backend, record: Recorder, build: Build, error: type[Exception], match: str
) -> None:
    """Run ``build`` graphed; assert the library's error (eager runs it as it is)."""
    with pytest.raises(error, match=match) as info:
        _run(build, backend.device, _ours(backend))
    record("cudagraph_td", "raises", str(info.value).split(". ")[0], backend=backend.name)
    _attempt_tensordict(backend, record, build)


def _attempt_tensordict(
    backend: Backend, record: Recorder, build: Build, eager: Run | None = None
) -> None:
    """The wrapper the scripts were written for, recorded and not asserted (CUDA only)."""
    if backend.name != "cuda":
        record("tensordict", "not run", "tensordict's class needs CUDA", backend=backend.name)
        return
    if eager is None:
        eager = _run(build, backend.device, _eager)

    def run() -> bool:
        got = _run(build, backend.device, TensorDictCudaGraphModule)
        return same(got.logged, eager.logged) and same(got.state, eager.state)

    record.attempt("tensordict", run, backend=backend.name)


def _adam(params: Any, capturable: bool, **kwargs: Any) -> torch.optim.Adam:
    """The scripts' ``optim.Adam(params, lr=..., ...)``, and the change a capture needs."""
    return torch.optim.Adam(params, capturable=capturable, **kwargs)


def _init(modules: Any, td: TensorDictBase, device: torch.device) -> None:
    """The scripts' "init nets": one call on a fake step, which sizes their lazy layers."""
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        td = td.to(device)
        for net in modules:
            net(td)


# ---------------------------------------------------------------------------------------------
# SAC: sota-implementations/sac/sac.py, utils.py (make_sac_agent, make_loss_module,
# make_sac_optimizer)
# ---------------------------------------------------------------------------------------------


def _sac(device: torch.device, wrap: Wrap, *, as_written: bool) -> Agent:
    env = _pendulum(device)
    action_spec = env.action_spec_unbatched.to(device)
    actor_net = MLP(
        num_cells=HIDDEN,
        out_features=2 * action_spec.shape[-1],
        activation_class=nn.ReLU,
        device=device,
    )
    extractor = NormalParamExtractor(scale_mapping="biased_softplus_1.0", scale_lb=0.1)
    actor_module = TensorDictModule(
        nn.Sequential(actor_net, extractor.to(device)),
        in_keys=["observation"],
        out_keys=["loc", "scale"],
    )
    actor = ProbabilisticActor(
        spec=action_spec,
        in_keys=["loc", "scale"],
        module=actor_module,
        distribution_class=TanhNormal,
        distribution_kwargs={
            "low": action_spec.space.low,
            "high": action_spec.space.high,
            "tanh_loc": False,
        },
        default_interaction_type=InteractionType.RANDOM,
        return_log_prob=False,
    )
    qvalue_net = MLP(num_cells=HIDDEN, out_features=1, activation_class=nn.ReLU, device=device)
    qvalue = ValueOperator(in_keys=["action", "observation"], module=qvalue_net)
    model = nn.ModuleList([actor, qvalue])
    _init(model, env.fake_tensordict(), device)

    loss_module = SACLoss(
        actor_network=model[0],
        qvalue_network=model[1],
        num_qvalue_nets=2,
        loss_function="l2",
        delay_actor=False,
        delay_qvalue=True,
        alpha_init=1.0,
    )
    loss_module.make_value_estimator(gamma=0.99)
    target_net_updater = SoftUpdate(loss_module, eps=0.995)

    capturable = not as_written
    critic_params = list(loss_module.qvalue_network_params.flatten_keys().values())
    actor_params = list(loss_module.actor_network_params.flatten_keys().values())
    optimizer_actor = _adam(actor_params, capturable, lr=3e-4, weight_decay=0.0, eps=1e-8)
    optimizer_critic = _adam(critic_params, capturable, lr=3e-4, weight_decay=0.0, eps=1e-8)
    optimizer_alpha = _adam([loss_module.log_alpha], capturable, lr=3.0e-4)
    optimizer = group_optimizers(optimizer_actor, optimizer_critic, optimizer_alpha)

    def update(sampled_tensordict: TensorDict) -> TensorDict:
        # Compute loss
        loss_td = loss_module(sampled_tensordict)

        actor_loss = loss_td["loss_actor"]
        q_loss = loss_td["loss_qvalue"]
        alpha_loss = loss_td["loss_alpha"]

        (actor_loss + q_loss + alpha_loss).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # Update qnet_target params
        target_net_updater.step()
        return loss_td.detach()

    update = wrap(update, in_keys=[], out_keys=[], warmup=5)
    batches = _samples(_replay_data(device), steps=10)

    def loop() -> list[Any]:
        logged = []
        for i, sampled_tensordict in enumerate(batches):
            _step(i)
            loss_td = update(sampled_tensordict.clone()).clone()
            logged.append(loss_td.select("loss_actor", "loss_qvalue", "loss_alpha", "alpha"))
        return logged

    return Agent(loss_module, loop, [update])


@pytest.mark.parametrize("as_written", [True, False], ids=["as_written", "capturable"])
def test_sac(backend: Backend, record: Recorder, as_written: bool) -> None:
    build = functools.partial(_sac, as_written=as_written)
    if as_written:
        _check_raises(backend, record, build, RuntimeError, NOT_CAPTURABLE)
    else:
        _check_matches_eager(backend, record, build)


# ---------------------------------------------------------------------------------------------
# TD3 and TD3+BC: sota-implementations/td3/td3.py and td3_bc/td3_bc.py, their utils.py
# (make_td3_agent, make_loss_module, make_optimizer)
# ---------------------------------------------------------------------------------------------


def _td3(device: torch.device, wrap: Wrap, *, as_written: bool, bc: bool = False) -> Agent:
    env = _pendulum(device)
    action_spec = env.action_spec_unbatched.to(device)
    actor_net = MLP(
        num_cells=HIDDEN,
        out_features=action_spec.shape[-1],
        activation_class=nn.ReLU,
        device=device,
    )
    actor = TensorDictSequential(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["param"]),
        TanhModule(in_keys=["param"], out_keys=["action"], spec=action_spec),
    )
    qvalue_net = MLP(num_cells=HIDDEN, out_features=1, activation_class=nn.ReLU, device=device)
    qvalue = ValueOperator(in_keys=["action", "observation"], module=qvalue_net)
    model = nn.ModuleList([actor, qvalue])
    _init(model, env.fake_tensordict(), device)

    loss_class, extra = (TD3BCLoss, {"alpha": 2.5}) if bc else (TD3Loss, {})
    loss_module = loss_class(
        actor_network=model[0],
        qvalue_network=model[1],
        num_qvalue_nets=2,
        loss_function="l2",
        delay_actor=True,
        delay_qvalue=True,
        action_spec=model[0][1].spec,
        policy_noise=0.2,
        noise_clip=0.5,
        **extra,
    )
    loss_module.make_value_estimator(gamma=0.99)
    target_net_updater = SoftUpdate(loss_module, eps=0.995)

    capturable = not as_written
    critic_params = list(loss_module.qvalue_network_params.flatten_keys().values())
    actor_params = list(loss_module.actor_network_params.flatten_keys().values())
    optimizer_actor = _adam(actor_params, capturable, lr=3e-4, weight_decay=0.0, eps=1e-4)
    optimizer_critic = _adam(critic_params, capturable, lr=3e-4, weight_decay=0.0, eps=1e-4)

    def update(sampled_tensordict: TensorDict, update_actor: bool) -> Any:  # td3.py
        # Compute loss
        q_loss, *_ = loss_module.value_loss(sampled_tensordict)

        # Update critic
        q_loss.backward()
        optimizer_critic.step()
        optimizer_critic.zero_grad(set_to_none=True)

        # Update actor
        if update_actor:
            actor_loss, *_ = loss_module.actor_loss(sampled_tensordict)

            actor_loss.backward()
            optimizer_actor.step()
            optimizer_actor.zero_grad(set_to_none=True)

            # Update target params
            target_net_updater.step()
        else:
            actor_loss = q_loss.new_zeros(())

        return q_loss.detach(), actor_loss.detach()

    def update_bc(sampled_tensordict: TensorDict, update_actor: bool) -> Any:  # td3_bc.py
        # Compute loss
        q_loss, *_ = loss_module.qvalue_loss(sampled_tensordict)

        # Update critic
        q_loss.backward()
        optimizer_critic.step()
        optimizer_critic.zero_grad(set_to_none=True)

        # Update actor
        if update_actor:
            actor_loss, actorloss_metadata = loss_module.actor_loss(sampled_tensordict)
            actor_loss.backward()
            optimizer_actor.step()
            optimizer_actor.zero_grad(set_to_none=True)

            # Update target params
            target_net_updater.step()
        else:
            actorloss_metadata = {}
            actor_loss = q_loss.new_zeros(())
        metadata = TensorDict(actorloss_metadata)
        metadata.set("q_loss", q_loss.detach())
        metadata.set("actor_loss", actor_loss.detach())
        return metadata

    wrapped = wrap(update_bc if bc else update, in_keys=[], out_keys=[], warmup=5)
    batches = _samples(_replay_data(device), steps=16)

    def loop() -> list[Any]:  # optim.policy_update_delay = 2
        logged = []
        for update_counter, sampled_tensordict in enumerate(batches, start=0 if bc else 1):
            update_actor = update_counter % 2 == 0
            _step(update_counter)
            logged.append(_logged(wrapped(sampled_tensordict.clone(), update_actor)))
        return logged

    return Agent(loss_module, loop, [wrapped])


@pytest.mark.parametrize("bc", [False, True], ids=["td3", "td3_bc"])
@pytest.mark.parametrize("variant", ["as_written", "capturable", "capturable_static"])
def test_td3(backend: Backend, record: Recorder, bc: bool, variant: str) -> None:
    # TD3 updates its actor every other call, through a Python bool: static=("update_actor",)
    # keeps a graph for each value; without it, the second value is refused.
    build = functools.partial(_td3, as_written=variant == "as_written", bc=bc)
    if variant == "as_written":
        _check_raises(backend, record, build, RuntimeError, NOT_CAPTURABLE)
    elif variant == "capturable":
        _check_raises(backend, record, build, ValueError, NOT_STATIC)
    else:
        (wrapped,) = _check_matches_eager(backend, record, build, static=("update_actor",))
        assert sorted(info.mode for info in wrapped.graphs()) == [
            "grad, update_actor=False",
            "grad, update_actor=True",
        ]


# ---------------------------------------------------------------------------------------------
# PPO (MuJoCo) and A2C (MuJoCo): sota-implementations/ppo/ppo_mujoco.py, utils_mujoco.py
# (make_ppo_models_state), and a2c/a2c_mujoco.py, utils_mujoco.py
# ---------------------------------------------------------------------------------------------


def _ppo_models(device: torch.device, safe_tanh: bool | None = None) -> tuple[Any, Any]:
    """``make_ppo_models_state`` of ppo/utils_mujoco.py (a2c's adds ``safe_tanh=True``)."""
    env = _pendulum(device)
    input_shape = env.observation_spec["observation"].shape
    num_outputs = env.action_spec_unbatched.shape[-1]
    distribution_kwargs = {
        "low": env.action_spec_unbatched.space.low.to(device),
        "high": env.action_spec_unbatched.space.high.to(device),
        "tanh_loc": False,
    }
    if safe_tanh is not None:
        distribution_kwargs["safe_tanh"] = safe_tanh
    policy_mlp = MLP(
        in_features=input_shape[-1],
        activation_class=nn.Tanh,
        out_features=num_outputs,
        num_cells=[64, 64],
        device=device,
    )
    for layer in policy_mlp.modules():
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, 1.0)
            layer.bias.data.zero_()
    policy_mlp = nn.Sequential(
        policy_mlp, AddStateIndependentNormalScale(num_outputs, scale_lb=1e-8).to(device)
    )
    policy_module = ProbabilisticActor(
        TensorDictModule(module=policy_mlp, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=env.full_action_spec_unbatched.to(device),
        distribution_class=TanhNormal,
        distribution_kwargs=distribution_kwargs,
        return_log_prob=True,
        default_interaction_type=ExplorationType.RANDOM,
    )
    value_mlp = MLP(
        in_features=input_shape[-1],
        activation_class=nn.Tanh,
        out_features=1,
        num_cells=[64, 64],
        device=device,
    )
    for layer in value_mlp.modules():
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, 0.01)
            layer.bias.data.zero_()
    return policy_module, ValueOperator(value_mlp, in_keys=["observation"])


class _GAEWithoutHostRead(GAE):
    """torchrl's GAE, with one of the two changes that make it capturable (the other:
    ``vectorized=False``, as the scripts build it under ``compile.compile``, whose vectorized
    kernel splits the batch into trajectories of data-dependent lengths). torchrl 0.14.1's
    ``_sanitize_next_obs_nan`` reads ``nan_mask.any()`` on the host at every call, to skip
    the substitution when no next observation is NaN; here it always substitutes, which
    gives the same values."""

    @staticmethod
    def _sanitize_next_obs_nan(data: TensorDictBase, in_keys: list[Any]) -> TensorDictBase:
        data = data.copy()
        for key in in_keys:
            root = data.get(key, default=None)
            next_key = ("next", *key) if isinstance(key, tuple) else ("next", key)
            nxt = data.get(next_key, default=None)
            if root is None or nxt is None or not root.is_floating_point():
                continue
            if nxt.shape == root.shape:
                data.set(next_key, torch.where(torch.isnan(nxt), root, nxt))
        return data


def _gae(variant: str, **kwargs: Any) -> GAE:
    """The scripts' GAE (``vectorized=not cfg.compile.compile``), or the capturable one."""
    if variant == "capturable":
        return _GAEWithoutHostRead(vectorized=False, **kwargs)
    return GAE(vectorized=True, **kwargs)


@functools.cache
def _on_policy_data(device: torch.device) -> TensorDict:
    """Frames collected by the initial PPO actor (with its log-probabilities), made once."""
    torch.manual_seed(0)
    actor, _ = _ppo_models(device)
    return _rollout(device, actor, frames=64)


def _minibatches(data: TensorDict, epoch: int, size: int) -> Iterator[TensorDict]:
    """A ``SamplerWithoutReplacement`` pass over ``data``, from a generator of its own."""
    rows = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
    for start in range(0, len(data) - size + 1, size):
        yield data[rows[start : start + size].to(data.device)]


def _ppo(device: torch.device, wrap: Wrap, *, as_written: bool, gae: str = "eager") -> Agent:
    actor, critic = _ppo_models(device)
    adv_module = _gae(
        gae, gamma=0.99, lmbda=0.95, value_network=critic, average_gae=False, device=device
    )
    loss_module = ClipPPOLoss(
        actor_network=actor,
        critic_network=critic,
        clip_epsilon=0.2,
        loss_critic_type="l2",
        entropy_coeff=0.0,
        critic_coeff=0.25,
        normalize_advantage=True,
    )
    capturable = not as_written
    actor_optim = _adam(
        actor.parameters(), capturable, lr=torch.tensor(3e-4, device=device), eps=1e-5
    )
    critic_optim = _adam(
        critic.parameters(), capturable, lr=torch.tensor(3e-4, device=device), eps=1e-5
    )
    optim = group_optimizers(actor_optim, critic_optim)

    ppo_epochs, mini_batch_size = 3, 16  # loss.ppo_epochs = 10, loss.mini_batch_size = 64
    data = _on_policy_data(device)
    total_network_updates = ppo_epochs * (len(data) // mini_batch_size)
    cfg_optim_anneal_lr = True
    cfg_optim_lr = torch.tensor(3e-4, device=device)
    cfg_loss_anneal_clip_eps = False
    cfg_loss_clip_epsilon = 0.2

    def update(batch: TensorDict, num_network_updates: torch.Tensor) -> Any:
        optim.zero_grad(set_to_none=True)
        # Linearly decrease the learning rate and clip epsilon
        alpha = torch.ones((), device=device)
        if cfg_optim_anneal_lr and total_network_updates > 0:
            alpha = (1 - (num_network_updates / total_network_updates)).clamp_min(0.0)
            for group in optim.param_groups:
                group["lr"] = cfg_optim_lr * alpha
        if cfg_loss_anneal_clip_eps:
            loss_module.clip_epsilon.copy_(cfg_loss_clip_epsilon * alpha)
        num_network_updates = num_network_updates + 1

        # Forward pass PPO loss
        loss = loss_module(batch)
        critic_loss = loss["loss_critic"]
        actor_loss = loss["loss_objective"] + loss["loss_entropy"]
        total_loss = critic_loss + actor_loss

        # Backward pass
        total_loss.backward()

        # Update the networks
        optim.step()
        return loss.detach().set("alpha", alpha), num_network_updates

    wrapped = [wrap(update, in_keys=[], out_keys=[], warmup=5)]
    if gae != "eager":
        adv_module = wrap(adv_module)
        wrapped.append(adv_module)
    update = wrapped[0]

    def loop() -> list[Any]:
        logged, batch_data = [], data.clone()
        num_network_updates = torch.zeros((), dtype=torch.int64, device=device)
        for j in range(ppo_epochs):
            # Compute GAE
            with torch.no_grad():
                _step(100 + j)
                batch_data = adv_module(batch_data)
            for k, batch in enumerate(_minibatches(batch_data, j, mini_batch_size)):
                _step(10 * j + k)
                loss, num_network_updates = update(batch, num_network_updates=num_network_updates)
                loss = loss.clone()
                num_network_updates = num_network_updates.clone()
                logged.append(loss.select("loss_critic", "loss_entropy", "loss_objective", "alpha"))
            logged.append(batch_data.select("advantage", "value_target").clone())
        return logged

    return Agent(loss_module, loop, wrapped)


def _a2c(device: torch.device, wrap: Wrap, *, gae: str = "eager") -> Agent:
    actor, critic = _ppo_models(device, safe_tanh=True)
    adv_module = _gae(
        gae, gamma=0.99, lmbda=0.95, value_network=critic, average_gae=False, device=device
    )
    loss_module = A2CLoss(
        actor_network=actor,
        critic_network=critic,
        loss_critic_type="l2",
        entropy_coeff=0.0,
        critic_coeff=0.25,
    )
    # a2c_mujoco.py builds them with `capturable=device.type == "cuda"`: the GPU run's.
    actor_optim = _adam(actor.parameters(), True, lr=torch.tensor(3e-4, device=device))
    critic_optim = _adam(critic.parameters(), True, lr=torch.tensor(3e-4, device=device))
    optim = group_optimizers(actor_optim, critic_optim)

    def update(batch: TensorDict) -> TensorDict:
        # Forward pass A2C loss
        loss = loss_module(batch)
        critic_loss = loss["loss_critic"]
        actor_loss = loss["loss_objective"] + loss.get("loss_entropy", 0.0)

        # Backward pass
        (actor_loss + critic_loss).backward()

        # Update the networks
        optim.step()

        optim.zero_grad(set_to_none=True)
        return loss.select("loss_critic", "loss_objective").detach()  # , "loss_entropy"

    wrapped = [wrap(update, in_keys=[], out_keys=[], warmup=20)]
    if gae != "eager":
        adv_module = wrap(adv_module, warmup=20)
        wrapped.append(adv_module)
    update = wrapped[0]
    data = _on_policy_data(device)
    # Several collector batches (the same frames here) to get past the warm-up of 20 calls
    # of each wrapper: the update runs in the last 3 (8 minibatches each).
    iterations = 3 if gae == "eager" else 21

    def loop() -> list[Any]:
        logged = []
        for i in range(iterations):
            with torch.no_grad():  # Compute GAE
                _step(100 + i)
                batch_data = adv_module(data.clone())
            logged.append(batch_data.select("advantage", "value_target").clone())
            if i < iterations - 3:
                continue
            for k, batch in enumerate(_minibatches(batch_data.reshape(-1), i, size=8)):
                _step(10 * i + k)
                logged.append(update(batch).clone())
        return logged

    return Agent(loss_module, loop, wrapped)


@pytest.mark.parametrize("as_written", [True, False], ids=["as_written", "capturable"])
def test_ppo_mujoco_update(backend: Backend, record: Recorder, as_written: bool) -> None:
    # The advantage computed eagerly here (see test_ppo_mujoco_and_a2c_advantage_module).
    build = functools.partial(_ppo, as_written=as_written)
    if as_written:
        _check_raises(backend, record, build, RuntimeError, NOT_CAPTURABLE)
    else:
        _check_matches_eager(backend, record, build)


def test_a2c_mujoco_update(backend: Backend, record: Recorder) -> None:
    # As written: its optimizers are capturable on CUDA (the advantage computed eagerly here).
    _check_matches_eager(backend, record, _a2c)


@pytest.mark.parametrize("gae", ["as_written", "capturable"])
@pytest.mark.parametrize("script", ["ppo_mujoco", "a2c_mujoco"])
def test_ppo_mujoco_and_a2c_advantage_module(
    backend: Backend, record: Recorder, script: str, gae: str
) -> None:
    # Both scripts also wrap their GAE module: `CudaGraphModule(adv_module)` (warmup=20 in
    # A2C), which torchrl 0.14.1's host read of `nan_mask.any()` keeps from being captured.
    if script == "ppo_mujoco":
        build = functools.partial(_ppo, as_written=False, gae=gae)
    else:
        build = functools.partial(_a2c, gae=gae)
    if gae == "as_written":
        _check_raises(backend, record, build, RuntimeError, HOST_SYNC)
    else:
        _check_matches_eager(backend, record, build)


# ---------------------------------------------------------------------------------------------
# DQN (CartPole): sota-implementations/dqn/dqn_cartpole.py, utils_cartpole.py
# (make_dqn_modules)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _cartpole_data(device: torch.device, frames: int = 256) -> TensorDict:
    """Frames of CartPole's keys, shapes and dtypes (gym cannot be installed in CI), made once."""
    generator = torch.Generator().manual_seed(0)

    def done() -> torch.Tensor:
        return torch.rand(frames, 1, generator=generator) < 0.05

    actions = torch.randint(2, (frames,), generator=generator)
    data = TensorDict(
        observation=torch.randn(frames, 4, generator=generator),
        action=nn.functional.one_hot(actions, 2),  # torchrl's OneHot(2) of gym's Discrete(2)
        next=TensorDict(
            observation=torch.randn(frames, 4, generator=generator),
            reward=torch.ones(frames, 1),
            done=done(),
            terminated=done(),
            truncated=torch.zeros(frames, 1, dtype=torch.bool),
            batch_size=[frames],
        ),
        batch_size=[frames],
    )
    return data.to(device)


def _dqn(device: torch.device, wrap: Wrap, *, variant: str) -> Agent:
    action_spec = OneHot(2, dtype=torch.int64)  # CartPole-v1's, as GymEnv makes it
    mlp = MLP(
        in_features=4,
        activation_class=nn.ReLU,
        out_features=action_spec.space.n,
        num_cells=[120, 84],
        device=device,
    )
    model = QValueActor(
        module=mlp, spec=Composite(action=action_spec).to(device), in_keys=["observation"]
    )

    loss_module = DQNLoss(value_network=model, loss_function="l2", delay_value=True)
    loss_module.make_value_estimator(gamma=0.99, device=device)
    loss_module = loss_module.to(device)
    target_net_updater = HardUpdate(loss_module, value_network_update_interval=50)
    optimizer = _adam(loss_module.parameters(), variant != "as_written", lr=2.5e-4)
    # The change that keeps the target network right: its hard update (a Python counter that
    # copies every 51st call) out of the graph, after each call.
    target_outside = variant == "capturable_target_outside"

    def update(sampled_tensordict: TensorDict) -> torch.Tensor:
        loss_td = loss_module(sampled_tensordict)
        q_loss = loss_td["loss"]
        optimizer.zero_grad()
        q_loss.backward()
        optimizer.step()
        if not target_outside:
            target_net_updater.step()
        return q_loss.detach()

    update = wrap(update, warmup=50)
    batches = _samples(_cartpole_data(device), steps=56)

    def loop() -> list[Any]:
        logged = []
        for j, sampled_tensordict in enumerate(batches):
            _step(j)
            logged.append(_logged(update(sampled_tensordict.clone())))
            if target_outside:
                target_net_updater.step()
        return logged

    return Agent(loss_module, loop, [update])


@pytest.mark.parametrize("variant", ["as_written", "capturable", "capturable_target_outside"])
def test_dqn_cartpole(backend: Backend, record: Recorder, variant: str) -> None:
    build = functools.partial(_dqn, variant=variant)
    if variant == "as_written":
        _check_raises(backend, record, build, RuntimeError, NOT_CAPTURABLE)
    elif variant == "capturable_target_outside":
        _check_matches_eager(backend, record, build)
    else:
        # HardUpdate counts calls in Python: the counter runs at the capture only, and the
        # graph copies the target network at every replay (the capture recorded a copy) or
        # at none, where eager copies every 51st call. No wrapper can see a Python counter:
        # the run drifts from eager after the first copy past the capture, silently.
        eager = _run(build, backend.device, _eager)
        graphed = _run(build, backend.device, _ours(backend))
        torch.testing.assert_close(graphed.logged[:52], eager.logged[:52], **TOL)
        assert not same(graphed.logged, eager.logged)
        assert not same(graphed.state, eager.state)
        record(
            "cudagraph_td",
            "differs from eager",
            "HardUpdate's Python counter runs at the capture only",
            backend=backend.name,
        )
        _attempt_tensordict(backend, record, build, eager)


# ---------------------------------------------------------------------------------------------
# CQL and IQL: sota-implementations/cql/cql_online.py, cql_offline.py, iql/iql_online.py, and
# their utils.py (make_cql_model, make_continuous_loss, make_continuous_cql_optimizer;
# make_iql_model, make_loss, make_iql_optimizer)
# ---------------------------------------------------------------------------------------------


def _offline_actor(device: torch.device, action_spec: Any) -> ProbabilisticActor:
    """The actor of cql/utils.py's make_cql_model and iql/utils.py's make_iql_model."""
    actor_net = MLP(
        num_cells=HIDDEN, out_features=2 * action_spec.shape[-1], activation_class=nn.ReLU
    )
    extractor = NormalParamExtractor(scale_mapping="biased_softplus_1.0", scale_lb=0.1)
    actor_module = TensorDictModule(
        nn.Sequential(actor_net, extractor), in_keys=["observation"], out_keys=["loc", "scale"]
    )
    return ProbabilisticActor(
        module=actor_module,
        in_keys=["loc", "scale"],
        spec=action_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={
            "low": action_spec.space.low.to(device),
            "high": action_spec.space.high.to(device),
            "tanh_loc": False,
        },
        default_interaction_type=ExplorationType.RANDOM,
    )


def _qvalue() -> ValueOperator:
    q_net = MLP(num_cells=HIDDEN, out_features=1, activation_class=nn.ReLU)
    return ValueOperator(
        in_keys=["observation", "action"], out_keys=["state_action_value"], module=q_net
    )


def _cql(device: torch.device, wrap: Wrap, *, as_written: bool, offline: bool) -> Agent:
    env = _pendulum("cpu")  # the scripts make their env on the CPU, the model on `device`
    model = nn.ModuleList([_offline_actor(device, env.action_spec_unbatched), _qvalue()])
    model = model.to(device)
    _init(model, env.reset(), device)

    loss_module = CQLLoss(
        model[0],
        model[1],
        loss_function="l2",
        temperature=1.0,
        min_q_weight=1.0,
        max_q_backup=False,
        deterministic_backup=False,
        num_random=10,
        with_lagrange=True,
        lagrange_thresh=5.0 if offline else 10.0,
    )
    loss_module.make_value_estimator(gamma=0.99, device=device)
    target_net_updater = SoftUpdate(loss_module, tau=0.005)

    capturable = not as_written
    critic_params = loss_module.qvalue_network_params.flatten_keys().values()
    actor_params = loss_module.actor_network_params.flatten_keys().values()
    actor_optim = _adam(actor_params, capturable, lr=3e-4, weight_decay=0.0)
    critic_optim = _adam(critic_params, capturable, lr=3e-4, weight_decay=0.0)
    alpha_optim = _adam([loss_module.log_alpha], capturable, lr=3e-4, weight_decay=0.0)
    alpha_prime_optim = _adam([loss_module.log_alpha_prime], capturable, lr=3e-4)
    optimizer = group_optimizers(actor_optim, critic_optim, alpha_optim, alpha_prime_optim)

    def update_online(sampled_tensordict: TensorDict) -> TensorDict:  # cql_online.py
        loss_td = loss_module(sampled_tensordict)

        actor_loss = loss_td["loss_actor"]
        q_loss = loss_td["loss_qvalue"]
        cql_loss = loss_td["loss_cql"]
        q_loss = q_loss + cql_loss
        alpha_loss = loss_td["loss_alpha"]
        alpha_prime_loss = loss_td["loss_alpha_prime"]

        total_loss = alpha_loss + actor_loss + alpha_prime_loss + q_loss
        total_loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # update qnet_target params
        target_net_updater.step()

        return loss_td.detach()

    def update_offline(data: TensorDict, policy_eval_start: Any, iteration: Any) -> Any:
        loss_vals = loss_module(data.to(device))  # cql_offline.py

        # official cql implementation uses behavior cloning loss for first few updating steps
        actor_loss = torch.where(
            iteration >= policy_eval_start,
            loss_vals["loss_actor"],
            loss_vals["loss_actor_bc"],
        )
        q_loss = loss_vals["loss_qvalue"]
        cql_loss = loss_vals["loss_cql"]

        q_loss = q_loss + cql_loss
        loss_vals["q_loss"] = q_loss

        # update model
        alpha_loss = loss_vals["loss_alpha"]
        alpha_prime_loss = loss_vals["loss_alpha_prime"]
        if alpha_prime_loss is None:
            alpha_prime_loss = 0

        loss = actor_loss + q_loss + alpha_loss + alpha_prime_loss

        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # update qnet_target params
        target_net_updater.step()

        return loss.detach(), loss_vals.detach()

    update = wrap(update_offline if offline else update_online, warmup=50)
    batches = _samples(_replay_data(device), steps=54)
    # optim.policy_eval_start = 40_000 in the script: here the switch from the behaviour-
    # cloning loss happens between the replays, through the tensors it compares.
    policy_eval_start = torch.tensor(52, device=device)

    def loop() -> list[Any]:
        logged = []
        for i, data in enumerate(batches):
            _step(i)
            if offline:
                i_device = torch.tensor(i, device=device)
                out = update(data.clone(), policy_eval_start=policy_eval_start, iteration=i_device)
            else:
                out = update(data.clone())
            logged.append(_logged(out))
        return logged

    return Agent(loss_module, loop, [update])


@pytest.mark.parametrize(
    ("script", "as_written"),
    [("cql_online", True), ("cql_online", False), ("cql_offline", False)],
    ids=["cql_online-as_written", "cql_online-capturable", "cql_offline-capturable"],
)
def test_cql(backend: Backend, record: Recorder, script: str, as_written: bool) -> None:
    # cql_offline.py builds its optimizers as cql_online.py does: as written, the same error.
    build = functools.partial(_cql, as_written=as_written, offline=script == "cql_offline")
    if as_written:
        _check_raises(backend, record, build, RuntimeError, NOT_CAPTURABLE)
    else:
        _check_matches_eager(backend, record, build)


def _iql(device: torch.device, wrap: Wrap, *, as_written: bool) -> Agent:
    env = _pendulum("cpu")
    value_net = MLP(num_cells=HIDDEN, out_features=1, activation_class=nn.ReLU)
    value = ValueOperator(in_keys=["observation"], out_keys=["state_value"], module=value_net)
    model = nn.ModuleList([_offline_actor(device, env.action_spec_unbatched), _qvalue(), value])
    model = model.to(device)
    _init(model, env.fake_tensordict(), device)

    loss_module = IQLLoss(
        model[0],
        model[1],
        value_network=model[2],
        loss_function="l2",
        temperature=3.0,
        expectile=0.7,
    )
    loss_module.make_value_estimator(gamma=0.99, device=device)
    target_net_updater = SoftUpdate(loss_module, tau=0.005)

    capturable = not as_written
    critic_params = list(loss_module.qvalue_network_params.flatten_keys().values())
    actor_params = list(loss_module.actor_network_params.flatten_keys().values())
    value_params = list(loss_module.value_network_params.flatten_keys().values())
    optimizer_actor = _adam(actor_params, capturable, lr=3e-4, weight_decay=0.0)
    optimizer_critic = _adam(critic_params, capturable, lr=3e-4, weight_decay=0.0)
    optimizer_value = _adam(value_params, capturable, lr=3e-4, weight_decay=0.0)
    optimizer = group_optimizers(optimizer_actor, optimizer_critic, optimizer_value)

    def update(sampled_tensordict: TensorDict) -> TensorDict:
        optimizer.zero_grad(set_to_none=True)
        # compute losses
        loss_info = loss_module(sampled_tensordict)
        actor_loss = loss_info["loss_actor"]
        value_loss = loss_info["loss_value"]
        q_loss = loss_info["loss_qvalue"]

        (actor_loss + value_loss + q_loss).backward()
        optimizer.step()

        # update qnet_target params
        target_net_updater.step()
        return loss_info.detach()

    update = wrap(update, warmup=50)
    batches = _samples(_replay_data(device), steps=54)

    def loop() -> list[Any]:
        logged = []
        for i, sampled_tensordict in enumerate(batches):
            _step(i)
            logged.append(_logged(update(sampled_tensordict.clone())))
        return logged

    return Agent(loss_module, loop, [update])


@pytest.mark.parametrize("as_written", [True, False], ids=["as_written", "capturable"])
def test_iql_online(backend: Backend, record: Recorder, as_written: bool) -> None:
    # iql_offline.py's update is the same function (on D4RL data).
    build = functools.partial(_iql, as_written=as_written)
    if as_written:
        _check_raises(backend, record, build, RuntimeError, NOT_CAPTURABLE)
    else:
        _check_matches_eager(backend, record, build)


# ---------------------------------------------------------------------------------------------
# CrossQ: sota-implementations/crossq/crossq.py, utils.py (make_crossQ_agent,
# make_loss_module, make_crossQ_optimizer)
# ---------------------------------------------------------------------------------------------


def _crossq(device: torch.device, wrap: Wrap, *, variant: str) -> Agent:
    env = _pendulum(device)
    action_spec = env.action_spec_unbatched
    actor_hidden, critic_hidden = HIDDEN, [64, 64]  # [256, 256] and [2048, 2048] in the script

    def norm(hidden: list[int]) -> dict[str, Any]:
        kwargs = {"momentum": 0.01, "num_features": hidden[-1], "warmup_steps": 100000}
        return {"norm_class": BatchRenorm1d, "norm_kwargs": kwargs}

    actor_net = MLP(
        num_cells=actor_hidden,
        out_features=2 * action_spec.shape[-1],
        activation_class=nn.ReLU,
        **norm(actor_hidden),
    )
    extractor = NormalParamExtractor(scale_mapping="biased_softplus_1.0", scale_lb=0.1)
    actor = ProbabilisticActor(
        spec=action_spec,
        in_keys=["loc", "scale"],
        module=TensorDictModule(
            nn.Sequential(actor_net, extractor), in_keys=["observation"], out_keys=["loc", "scale"]
        ),
        distribution_class=TanhNormal,
        distribution_kwargs={
            "low": torch.as_tensor(action_spec.space.low, device=device),
            "high": torch.as_tensor(action_spec.space.high, device=device),
            "tanh_loc": False,
            "safe_tanh": True,  # not cfg.compile.compile
        },
        default_interaction_type=InteractionType.RANDOM,
        return_log_prob=False,
    )
    qvalue_net = MLP(
        num_cells=critic_hidden, out_features=1, activation_class=nn.ReLU, **norm(critic_hidden)
    )
    qvalue = ValueOperator(in_keys=["action", "observation"], module=qvalue_net)
    model = nn.ModuleList([actor, qvalue]).to(device)
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        # The script's train_env is a ParallelEnv of env_per_collector=1 env: a batch of 1.
        td = env.fake_tensordict().unsqueeze(0).to(device)
        for net in model:
            net.eval()
            net(td)
            net.train()
    model[0].eval()  # crossq.py gives the collector `exploration_policy.eval()`: model[0]

    loss_module = CrossQLoss(
        actor_network=model[0],
        qvalue_network=model[1],
        num_qvalue_nets=2,
        loss_function="l2",
        alpha_init=1.0,
    )
    loss_module.make_value_estimator(gamma=0.99, device=device)

    capturable = variant != "as_written"
    critic_params = list(loss_module.qvalue_network_params.flatten_keys().values())
    actor_params = list(loss_module.actor_network_params.flatten_keys().values())
    options = {"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8, "betas": (0.5, 0.999)}
    optimizer_actor = _adam(actor_params, capturable, **options)
    optimizer_critic = _adam(critic_params, capturable, **options)
    optimizer_alpha = _adam([loss_module.log_alpha], capturable, lr=1e-3)
    optimizer = group_optimizers(optimizer_actor, optimizer_critic, optimizer_alpha)

    def nan() -> Any:
        # The script's `float("nan")`, which TensorDict(..., device=device) copies to the
        # device; the change that makes it capturable: a NaN made on the device.
        if variant == "capturable_nan_on_device":
            return torch.full((), float("nan"), device=device)
        return float("nan")

    def update_qloss(sampled_tensordict: TensorDict) -> TensorDict:
        optimizer.zero_grad(set_to_none=True)
        td_loss = {}
        q_loss, value_meta = loss_module.qvalue_loss(sampled_tensordict)
        sampled_tensordict.set(loss_module.tensor_keys.priority, value_meta["td_error"])
        q_loss = q_loss.mean()

        # Update critic
        q_loss.backward()
        optimizer.step()
        td_loss["loss_qvalue"] = q_loss
        td_loss["loss_actor"] = nan()
        td_loss["loss_alpha"] = nan()
        return TensorDict(td_loss, device=device).detach()

    def update_all(sampled_tensordict: TensorDict) -> TensorDict:
        optimizer.zero_grad(set_to_none=True)

        td_loss = {}
        q_loss, value_meta = loss_module.qvalue_loss(sampled_tensordict)
        sampled_tensordict.set(loss_module.tensor_keys.priority, value_meta["td_error"])
        q_loss = q_loss.mean()

        actor_loss, metadata_actor = loss_module.actor_loss(sampled_tensordict)
        actor_loss = actor_loss.mean()
        alpha_loss = loss_module.alpha_loss(log_prob=metadata_actor["log_prob"].detach()).mean()

        # Updates
        (q_loss + actor_loss + actor_loss).backward()
        optimizer.step()

        # Update critic
        td_loss["loss_qvalue"] = q_loss
        td_loss["loss_actor"] = actor_loss
        td_loss["loss_alpha"] = alpha_loss

        return TensorDict(td_loss, device=device).detach()

    update_all = wrap(update_all, warmup=50)
    update_qloss = wrap(update_qloss, warmup=50)

    def update(sampled_tensordict: TensorDict, update_actor: bool) -> TensorDict:
        if update_actor:
            return update_all(sampled_tensordict)
        return update_qloss(sampled_tensordict)

    # update_all runs every 3rd update (optim.policy_update_delay): 150 updates to capture it.
    steps = 156 if variant == "capturable_nan_on_device" else 78
    batches = _samples(_replay_data(device), steps=steps)

    def loop() -> list[Any]:
        logged = []
        for update_counter, sampled_tensordict in enumerate(batches, start=1):
            update_actor = update_counter % 3 == 0
            _step(update_counter)
            td_loss = update(sampled_tensordict.clone(), update_actor=update_actor)
            logged.append(td_loss.clone())
        return logged

    return Agent(loss_module, loop, [update_all, update_qloss])


@pytest.mark.parametrize(
    "variant",
    [
        "as_written",
        "capturable",
        "capturable_nan_on_device",
    ],
)
def test_crossq(backend: Backend, record: Recorder, variant: str) -> None:
    # Every variant samples the policy's TanhNormal with `.sample()`, whose `torch.normal`
    # checks its standard deviations on the host (seen on the H100; refused by the emulation
    # since): the first error of each, before the optimizer's and the NaN's.
    build = functools.partial(_crossq, variant=variant)
    _check_raises(backend, record, build, RuntimeError, HOST_SYNC)


# ---------------------------------------------------------------------------------------------
# Borrowed outputs (issue 43): each script's variant that matches eager above, its wrappers made
# with `CudaGraphModule(..., outputs="borrowed")`, that option their only change. Every loop
# copies what an update returns before the update's next call, as the scripts do: sac.py's
# `loss_td = update(sampled_tensordict).clone()`, ppo_mujoco.py's `loss = loss.clone()` and
# `num_network_updates = num_network_updates.clone()` (fed back to the next call), and the
# others' logging (`_logged`: a copy taken at once); a GAE's output is read (minibatches, the
# log) before its next call. So each must run unchanged and match eager.
# ---------------------------------------------------------------------------------------------

_BORROWED: dict[str, tuple[Build, dict[str, Any]]] = {
    "sac": (functools.partial(_sac, as_written=False), {}),
    "td3": (functools.partial(_td3, as_written=False), {"static": ("update_actor",)}),
    "td3_bc": (functools.partial(_td3, as_written=False, bc=True), {"static": ("update_actor",)}),
    "ppo_mujoco": (functools.partial(_ppo, as_written=False), {}),
    "ppo_mujoco-gae": (functools.partial(_ppo, as_written=False, gae="capturable"), {}),
    "a2c_mujoco": (_a2c, {}),
    "a2c_mujoco-gae": (functools.partial(_a2c, gae="capturable"), {}),
    "dqn_cartpole": (functools.partial(_dqn, variant="capturable_target_outside"), {}),
    "cql_online": (functools.partial(_cql, as_written=False, offline=False), {}),
    "cql_offline": (functools.partial(_cql, as_written=False, offline=True), {}),
    "iql_online": (functools.partial(_iql, as_written=False), {}),
}


@pytest.mark.parametrize("script", list(_BORROWED))
def test_borrowed_outputs(backend: Backend, record: Recorder, script: str) -> None:
    build, options = _BORROWED[script]
    _check_matches_eager(backend, record, build, outputs="borrowed", **options)
