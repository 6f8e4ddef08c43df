"""Static arguments (``static=``): a graph per value of a declared non-tensor argument."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from cudagraph_td import GraphLimitWarning, Static

from .conftest import Backend


def _td3(backend: Backend) -> tuple[Any, list[nn.Module], list[torch.optim.Optimizer]]:
    """An update shaped as torchrl's TD3 script's: the critic at every call, the actor and
    the target only when ``update_actor``, a Python bool that alternates."""
    actor = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).to(backend.device)
    critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(backend.device)
    target = copy.deepcopy(critic).requires_grad_(False)
    lr = torch.tensor(1e-2, device=backend.device)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=lr, capturable=True)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=lr, capturable=True)

    def update(td: TensorDict, update_actor: bool) -> tuple[torch.Tensor, torch.Tensor]:
        obs = td["obs"]
        with torch.no_grad():
            bootstrap = td["reward"] + 0.9 * target(torch.cat([obs, actor(obs)], -1))
        q_loss = (critic(torch.cat([obs, td["action"]], -1)) - bootstrap).pow(2).mean()
        q_loss.backward()
        critic_opt.step()
        critic_opt.zero_grad(set_to_none=True)
        if update_actor:  # through the critic's parameters detached, as torchrl's loss does
            detached = {name: p.detach() for name, p in critic.named_parameters()}
            value = torch.func.functional_call(
                critic, detached, (torch.cat([obs, actor(obs)], -1),)
            )
            actor_loss = -value.mean()
            actor_loss.backward()
            actor_opt.step()
            actor_opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                torch._foreach_lerp_(list(target.parameters()), list(critic.parameters()), 0.1)
        else:
            actor_loss = q_loss.new_zeros(())
        return q_loss.detach(), actor_loss.detach()

    return update, [actor, critic, target], [critic_opt, actor_opt]


def _batch(backend: Backend) -> TensorDict:
    return TensorDict(
        obs=backend.randn(32, 3), action=backend.randn(32, 1), reward=backend.randn(32, 1),
        batch_size=[32],
    )  # fmt: skip


@pytest.mark.parametrize("static", [("update_actor",), (1,)], ids=["by-name", "by-position"])
def test_a_training_step_with_an_alternating_bool_tracks_its_eager_twin(
    backend: Backend, static: tuple[Any, ...]
) -> None:
    torch.manual_seed(0)
    update, modules, opts = _td3(backend)
    torch.manual_seed(0)
    twin_update, twin_modules, twin_opts = _td3(backend)
    graphed = backend.wrap(update, in_keys=[], out_keys=[], warmup=3, static=static)
    for step in range(14):
        td = _batch(backend)
        update_actor = step % 2 == 0  # TD3's delayed actor updates
        q_loss, actor_loss = graphed(td, update_actor)
        twin_q_loss, twin_actor_loss = twin_update(td, update_actor)
        torch.testing.assert_close(q_loss, twin_q_loss, msg=f"step {step}")
        torch.testing.assert_close(actor_loss, twin_actor_loss, msg=f"step {step}")
    for module, twin in zip(modules, twin_modules, strict=True):
        for p, q in zip(module.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    for opt, twin_opt in zip(opts, twin_opts, strict=True):
        for state, twin_state in zip(opt.state.values(), twin_opt.state.values(), strict=True):
            torch.testing.assert_close(state["exp_avg"], twin_state["exp_avg"])
    infos = graphed.graphs()
    label = "update_actor" if static == ("update_actor",) else "args[1]"
    assert sorted(info.mode for info in infos) == [f"grad, {label}=False", f"grad, {label}=True"]
    assert all(info.captured and info.replays == 4 for info in infos)  # 7 calls: 3 to capture


def test_an_undeclared_changing_bool_is_refused_with_the_fix(backend: Backend) -> None:
    def fn(x: torch.Tensor, double: bool) -> torch.Tensor:
        return x * 2 if double else x + 1

    graphed = backend.wrap(fn, warmup=1)
    graphed(backend.randn(3), True)
    with pytest.raises(ValueError, match=re.escape("declare it static (`static=(1,)`")):
        graphed(backend.randn(3), False)
    graphed = backend.wrap(fn, warmup=1, static=("double",))
    with torch.no_grad():
        for double in (True, False, False, True, True, False):
            x = backend.randn(3)
            torch.testing.assert_close(graphed(x, double=double), fn(x, double))


def test_a_value_left_to_its_default_has_a_graph_of_its_own(backend: Backend) -> None:
    def fn(x: torch.Tensor, mode: str = "add") -> torch.Tensor:
        return x + 1 if mode == "add" else x * 3

    graphed = backend.wrap(fn, warmup=1, static=("mode",))
    for call in range(6):
        x = backend.randn(3)
        out = graphed(x) if call % 2 else graphed(x, mode="mul")
        torch.testing.assert_close(out, fn(x) if call % 2 else fn(x, "mul"))
    assert len(graphed.graphs()) == 2


def test_values_past_max_graphs_run_eagerly_after_a_warning_or_raise(backend: Backend) -> None:
    def fn(x: torch.Tensor, power: int) -> torch.Tensor:
        return x**power

    calls = []

    def counted(x: torch.Tensor, power: int) -> torch.Tensor:
        calls.append(power)
        return fn(x, power)

    graphed = backend.wrap(counted, warmup=1, static=(1,), shapes=Static(max_graphs=2))
    x = backend.randn(3)
    for power in (1, 2):
        graphed(x, power)
    with pytest.warns(
        GraphLimitWarning, match=re.escape("Static values with a graph: args[1]=1; args[1]=2")
    ):
        torch.testing.assert_close(graphed(x, 3), x**3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        calls.clear()
        torch.testing.assert_close(graphed(x, 3), x**3)
        torch.testing.assert_close(graphed(x, 2), x**2)
    assert calls == [3]  # the third value ran eagerly; the second replayed its graph
    assert graphed.graphs().eager_calls == {"past max_graphs static values": 2}
    strict = backend.wrap(fn, warmup=1, static=(1,), shapes=Static(max_graphs=1, overflow="raise"))
    strict(x, 1)
    with pytest.raises(RuntimeError, match="reached max_graphs=1"):
        strict(x, 2)


def test_static_options_and_values_are_checked(backend: Backend) -> None:
    def fn(x: torch.Tensor, flag: Any = True) -> torch.Tensor:
        return x + 1 if flag else x

    with pytest.raises(ValueError, match="has no argument named 'flags'"):
        backend.wrap(fn, static=("flags",))
    for bad in ((1.5,), (-1,), (True,), [None]):
        with pytest.raises(ValueError, match=re.escape("`static` must be a tuple of argument")):
            backend.wrap(fn, static=bad)
    graphed = backend.wrap(fn, warmup=1, static=("flag",))
    with pytest.raises(TypeError, match=re.escape('static argument kwargs["flag"] is a Tensor')):
        graphed(backend.randn(3), flag=backend.randn(3))
    with pytest.raises(
        TypeError, match=re.escape("static argument args[1] = [1] cannot be hashed")
    ):
        graphed(backend.randn(3), [1])
    # 1 and True compare equal, but are different graphs: the function may test the type.
    x = backend.randn(3)
    graphed(x, 1)
    graphed(x, True)
    assert len(graphed.graphs()) == 2
