"""TensorDict modules: keys, keyword calls, writes into the input, and the TensorDict surface."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict
from tensordict.nn import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    set_interaction_type,
)
from torch import nn

from .conftest import Backend, regression_step


def _actor(backend: Backend, out_keys: list[str] | None = None) -> TensorDictModule:
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).to(backend.device)
    return TensorDictModule(net, in_keys=["observation"], out_keys=out_keys or ["action"])


def _obs_td(backend: Backend, batch: int = 8, **extra: Any) -> TensorDict:
    return TensorDict(observation=backend.randn(batch, 4), batch_size=[batch], **extra)


@torch.no_grad()
def test_tensordict_call_writes_into_the_callers_tensordict(backend: Backend) -> None:
    actor = _actor(backend)
    graphed = backend.wrap(actor, warmup=2)
    assert graphed.in_keys == ["observation"] and graphed.out_keys == ["action"]
    actions = []
    for _ in range(5):
        td = _obs_td(backend)
        obs = td["observation"]
        expected = actor(td.clone())["action"]
        out = graphed(td)
        assert out is td  # identity kept, as a TensorDictModule keeps it
        assert td["observation"] is obs  # the input entries are the caller's own
        torch.testing.assert_close(td["action"], expected)
        actions.append((td["action"], expected))
    backend.sync()
    for action, expected in actions:  # written entries are fresh memory, not graph buffers
        torch.testing.assert_close(action, expected)


@torch.no_grad()
def test_keyword_tensors_return_the_out_keys(backend: Backend) -> None:
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4)).to(backend.device)
    actor = TensorDictModule(
        lambda x: net(x).chunk(2, -1), in_keys=["observation"], out_keys=["loc", "scale"]
    )
    graphed = backend.wrap(actor, warmup=2)
    for _ in range(4):
        obs = backend.randn(8, 4)
        loc, scale = graphed(observation=obs)
        expected = actor(observation=obs)
        torch.testing.assert_close(loc, expected[0])
        torch.testing.assert_close(scale, expected[1])
    single = backend.wrap(_actor(backend), warmup=1)
    obs = backend.randn(8, 4)
    for _ in range(3):
        torch.testing.assert_close(single(observation=obs), single.module(observation=obs))


@torch.no_grad()
def test_tensordict_out(backend: Backend) -> None:
    actor = _actor(backend)
    graphed = backend.wrap(actor, warmup=2)
    for _ in range(4):
        td = _obs_td(backend)
        out_td = TensorDict(batch_size=[8])
        result = graphed(td, tensordict_out=out_td)
        assert result is out_td and "action" not in td.keys()  # noqa: SIM118 (a TensorDict)
        torch.testing.assert_close(out_td["action"], actor(td.clone())["action"])


def test_tensordict_out_of_a_function_without_in_keys(backend: Backend) -> None:
    # A PPO-style update wrapped with in_keys=[]: it writes a scalar loss into its input.
    # Given tensordict_out, the writes go there, and the caller's TensorDict is untouched.
    net = nn.Linear(4, 1).to(backend.device)

    def update(td: TensorDict) -> TensorDict:
        td["loss"] = net(td["observation"]).pow(2).mean().detach()
        return td

    graphed = backend.wrap(update, warmup=2, in_keys=[], out_keys=[])
    for _ in range(4):
        td = _obs_td(backend)
        out_td = TensorDict()
        result = graphed(td, tensordict_out=out_td)
        assert result is out_td and list(td.keys()) == ["observation"]
        torch.testing.assert_close(out_td["loss"], net(td["observation"]).pow(2).mean())


def test_a_tensordict_module_writes_scalars_into_an_empty_tensordict_out(
    backend: Backend,
) -> None:
    # LeanRL's PPO: `update = CudaGraphModule(TensorDictModule(update_fn, in_keys=[...],
    # out_keys=[metrics]))`, called as `update(minibatch, tensordict_out=TensorDict())`. The
    # eager module writes the scalar metrics into the empty tensordict_out; the minibatch,
    # of batch size [n], would refuse them.
    net = nn.Linear(4, 1).to(backend.device)

    def update_fn(obs: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss = (net(obs).squeeze(-1) * advantages).mean()
        return loss.detach(), loss.detach().abs(), advantages.std()

    keys = ["loss", "approx_kl", "adv_std"]
    module = TensorDictModule(update_fn, in_keys=["obs", "advantages"], out_keys=keys)
    graphed = backend.wrap(module, warmup=2)
    with torch.no_grad():
        for _ in range(4):
            td = TensorDict(obs=backend.randn(16, 4), advantages=backend.randn(16), batch_size=[16])
            expected = module(td.clone(), tensordict_out=TensorDict())
            out_td = TensorDict()
            result = graphed(td, tensordict_out=out_td)
            assert result is out_td and result.batch_size == expected.batch_size == ()
            assert sorted(td.keys()) == ["advantages", "obs"]  # the minibatch is untouched
            for key in keys:
                torch.testing.assert_close(result[key], expected[key])


def test_keys_from_the_arguments_for_a_function(backend: Backend) -> None:
    def fn(tensordict: TensorDict) -> TensorDict:
        tensordict["y"] = tensordict["x"] * 2 + 1
        return tensordict

    graphed = backend.wrap(fn, warmup=2, in_keys=["x"], out_keys=["y"])
    for _ in range(4):
        x = backend.randn(3)
        torch.testing.assert_close(graphed(x=x), x * 2 + 1)


def test_keys_given_twice_warn_and_the_modules_win(backend: Backend) -> None:
    with pytest.warns(
        UserWarning,
        match=re.escape(
            "ignores in_keys=['obs'] because the module has its own in_keys=['observation']"
        ),
    ):
        graphed = backend.wrap(_actor(backend), in_keys=["obs"])
    assert graphed.in_keys == ["observation"]
    graphed = backend.wrap(_actor(backend), in_keys=[], out_keys=[])  # torchrl's form: no warning
    assert graphed.out_keys == ["action"]


def test_function_of_a_tensordict_returning_a_tuple(backend: Backend) -> None:
    # torchrl's training scripts: CudaGraphModule(update, in_keys=[], out_keys=[]), whose
    # update returns (loss_td, info); tensordict's class fails on such an output.
    def update(td: TensorDict) -> tuple[TensorDict, dict[str, torch.Tensor]]:
        loss = TensorDict(loss_actor=td["obs"].pow(2).mean(), loss_value=td["reward"].mean())
        return loss, {"max": td["reward"].max(), "step": 1}

    graphed = backend.wrap(update, in_keys=[], out_keys=[], warmup=2)
    for _ in range(4):
        td = TensorDict(obs=backend.randn(16, 3), reward=backend.randn(16, 1), batch_size=[16])
        loss, info = graphed(td)
        expected_loss, expected_info = update(td)
        torch.testing.assert_close(loss.to_dict(), expected_loss.to_dict())
        torch.testing.assert_close(info["max"], expected_info["max"])
        assert info["step"] == 1


@torch.no_grad()
def test_entries_outside_the_in_keys_are_ignored(backend: Backend) -> None:
    actor = _actor(backend)
    graphed = backend.wrap(actor, warmup=1)
    graphed(_obs_td(backend))
    td = _obs_td(
        backend,
        other=backend.randn(8, 5),
        done=torch.zeros(8, 1, dtype=torch.bool, device=backend.device),
    )
    other = td["other"]
    graphed(td)
    assert td["other"] is other
    torch.testing.assert_close(td["action"], actor(td.clone())["action"])


@pytest.mark.parametrize("warmup", [1, 3], ids=["at-capture", "at-warm-up"])
def test_missing_in_key_is_a_key_error(backend: Backend, warmup: int) -> None:
    graphed = backend.wrap(_actor(backend), warmup=warmup)
    with (
        torch.no_grad(),
        pytest.raises(KeyError, match=re.escape("input lacks the in_keys ['observation']")),
    ):
        graphed(TensorDict(obs=backend.randn(8, 4), batch_size=[8]))


@torch.no_grad()
def test_missing_in_key_after_capture(backend: Backend) -> None:
    graphed = backend.wrap(_actor(backend), warmup=1)
    graphed(_obs_td(backend))
    with pytest.raises(KeyError, match=re.escape('input lacks the key(s) args[0]["observation"]')):
        graphed(TensorDict(obs=backend.randn(8, 4), batch_size=[8]))


@torch.no_grad()
@pytest.mark.parametrize(
    ("td", "message"),
    [
        (
            lambda b: _obs_td(b, batch=4),
            "captured with args[0] of batch size [8], but received batch size [4]",
        ),
        (
            lambda b: TensorDict(observation=b.randn(8, 4).double(), batch_size=[8]),
            'args[0]["observation"] of dtype torch.float32, but received dtype torch.float64',
        ),
        (
            lambda b: TensorDict(observation=b.randn(8, 4), batch_size=[]),
            "captured with args[0] of batch size [8], but received batch size []",
        ),
    ],
    ids=["batch-size", "dtype", "batch-size-empty"],
)
def test_wrong_tensordict_inputs_name_the_key(backend: Backend, td: Any, message: str) -> None:
    graphed = backend.wrap(_actor(backend), warmup=1)
    graphed(_obs_td(backend))
    with pytest.raises(ValueError, match=re.escape(message)):
        graphed(td(backend))


@torch.no_grad()
@pytest.mark.parametrize("capture", ["tensordict", "keywords"])
@pytest.mark.parametrize(
    ("obs", "message"),
    [
        (
            lambda b: b.randn(16, 4),
            'captured with kwargs["observation"] of shape (8, 4), but received shape (16, 4). '
            "A CUDA graph replays fixed shapes: pass an input of the captured shape, make the "
            "CudaGraphModule with `shapes=Exact()` (a graph per shape) or "
            "`shapes=Buckets([...])` (batch sizes padded to a few graphs), or call `reset()`",
        ),
        (
            lambda b: b.randn(8, 4).double(),
            'captured with kwargs["observation"] of dtype torch.float32, but received dtype '
            "torch.float64",
        ),
    ],
    ids=["shape", "dtype"],
)
def test_wrong_keyword_tensors_name_the_keyword(
    backend: Backend, capture: str, obs: Any, message: str
) -> None:
    # `policy(observation=obs)` is told about `observation`, not about the TensorDict that
    # the keyword call builds (`args[0]`), whichever call captured the graph.
    graphed = backend.wrap(_actor(backend), warmup=1)
    if capture == "tensordict":
        graphed(_obs_td(backend))
    else:
        graphed(observation=backend.randn(8, 4))
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        graphed(observation=obs(backend))
    assert info.value.path == 'kwargs["observation"]'  # type: ignore[attr-defined]
    expected = _obs_td(backend)
    out = graphed(observation=expected["observation"])  # the graph still answers
    torch.testing.assert_close(out, graphed.module(expected)["action"])


@torch.no_grad()
def test_a_keyword_call_without_an_in_key_names_the_keyword(backend: Backend) -> None:
    net = nn.Linear(4, 2).to(backend.device)
    module = TensorDictModule(
        lambda o, h: net(o) + h, in_keys=["observation", "hidden"], out_keys=["action"]
    )
    graphed = backend.wrap(module, warmup=1)
    graphed(observation=backend.randn(8, 4), hidden=backend.randn(8, 1))
    message = (
        'CudaGraphModule received no kwargs["hidden"], which the captured graph reads (an '
        "in_key of the module). Pass every in_key by keyword, or a TensorDict with every in_key."
    )
    with pytest.raises(KeyError, match=re.escape(message)):
        graphed(observation=backend.randn(8, 4))


def test_recurrent_state_written_under_an_input_key(backend: Backend) -> None:
    def cell(tensordict: TensorDict) -> TensorDict:
        hidden = torch.tanh(tensordict["hidden"] * 0.9 + tensordict["obs"].sum(-1, keepdim=True))
        tensordict["hidden"] = hidden  # rebinds an input key, as an RNN policy does
        tensordict["out"] = hidden * 2
        tensordict["obs"].add_(1)  # and updates an input in place
        return tensordict

    graphed = backend.wrap(cell, warmup=2, in_keys=["obs", "hidden"], out_keys=["hidden", "out"])
    td = TensorDict(
        obs=backend.randn(4, 3), hidden=torch.zeros(4, 1, device=backend.device), batch_size=[4]
    )
    eager = td.clone()
    for _ in range(5):
        graphed(td)
        cell(eager)
        torch.testing.assert_close(td.to_dict(), eager.to_dict())


@torch.no_grad()
def test_nested_keys_and_device_none(backend: Backend) -> None:
    net = nn.Linear(3, 2).to(backend.device)
    module = TensorDictModule(net, in_keys=[("next", "obs")], out_keys=[("next", "value")])
    graphed = backend.wrap(module, warmup=2)
    for _ in range(4):
        td = TensorDict(next=TensorDict(obs=backend.randn(5, 3), batch_size=[5]), batch_size=[5])
        assert td.device is None
        graphed(td)
        torch.testing.assert_close(td["next", "value"], net(td["next", "obs"]))


@torch.no_grad()
def test_lazy_stack_input(backend: Backend) -> None:
    actor = _actor(backend)
    graphed = backend.wrap(actor, warmup=2)
    for _ in range(4):
        td = LazyStackedTensorDict(
            *[TensorDict(observation=backend.randn(4)) for _ in range(3)], stack_dim=0
        )
        graphed(td)
        torch.testing.assert_close(td["action"], actor.module(td["observation"]))


@torch.no_grad()
@pytest.mark.parametrize("capture", ["lazy", "dense"])
def test_lazy_stack_and_dense_tensordict_replay_one_graph(backend: Backend, capture: str) -> None:
    # tensordict's `test_tdmodule_lazy_and_dense_inputs`: the module reads the same entries
    # from a lazy stack and from a dense TensorDict, eagerly and through tensordict's class.
    actor = _actor(backend)
    graphed = backend.wrap(actor, warmup=2)

    def make(lazy: bool) -> Any:
        td = _obs_td(backend, batch=3)
        return LazyStackedTensorDict(*td.unbind(0), stack_dim=0) if lazy else td

    for _ in range(3):
        graphed(make(capture == "lazy"))
    for lazy in (capture != "lazy", capture == "lazy", capture != "lazy"):
        td = make(lazy)
        expected = actor.module(td["observation"])
        assert graphed(td) is td
        torch.testing.assert_close(td["action"], expected)
    assert graphed.is_captured
    with pytest.raises(ValueError, match="but received shape"):
        graphed(TensorDict(observation=backend.randn(3, 5), batch_size=[3]))


def test_an_in_key_given_to_a_function_that_no_call_holds(backend: Backend) -> None:
    # tensordict's `test_tdmodule_uncaptured_in_key_missing`: the function does not read
    # the key, and runs as it does eagerly. A TensorDictModule reads each of its in_keys:
    # it is refused (`test_missing_in_key_is_a_key_error`).
    graphed = backend.wrap(
        lambda td: td.set("y", td["x"] + 1), warmup=2, in_keys=["x", "unused"], out_keys=["y"]
    )
    for _ in range(4):
        td = TensorDict(x=backend.randn(3), w=backend.randn(3), batch_size=[3])
        torch.testing.assert_close(graphed(td)["y"], td["x"] + 1)
    td = graphed(TensorDict(x=torch.ones(3, device=backend.device), batch_size=[3]))
    torch.testing.assert_close(td["y"], torch.full((3,), 2.0, device=backend.device))
    assert graphed.is_captured


def test_non_tensor_entries_are_checked_constants(backend: Backend) -> None:
    def fn(td: TensorDict) -> torch.Tensor:
        return td["x"] * (2 if td["mode"] == "double" else 3)

    graphed = backend.wrap(fn, warmup=1, in_keys=[], out_keys=[])
    td = TensorDict(x=backend.randn(3), mode=NonTensorData("double"), batch_size=[3])
    torch.testing.assert_close(graphed(td), td["x"] * 2)
    td = TensorDict(x=backend.randn(3), mode=NonTensorData("double"), batch_size=[3])
    torch.testing.assert_close(graphed(td), td["x"] * 2)
    td["mode"] = "triple"
    with pytest.raises(
        ValueError,
        match=re.escape("non-tensor argument args[0][\"mode\"] = 'double', but received 'triple'"),
    ):
        graphed(td)


def test_locked_tensordict_behaves_as_in_eager(backend: Backend) -> None:
    def total(td: TensorDict) -> torch.Tensor:
        return td["x"].sum(-1) + td["y"]

    reader = backend.wrap(total, warmup=1, in_keys=[], out_keys=[])
    for _ in range(3):  # a locked input that the function only reads
        td = TensorDict(x=backend.randn(4, 3), y=backend.randn(4), batch_size=[4]).lock_()
        torch.testing.assert_close(reader(td), total(td))
        assert td.is_locked
    actor = _actor(backend)
    writer = backend.wrap(actor, warmup=1)
    td = _obs_td(backend, action=torch.zeros(8, 2, device=backend.device)).lock_()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict") as eager:
            actor(td)
        for _ in range(2):  # eager refuses to write into a locked TensorDict: so does the wrapper
            with pytest.raises(RuntimeError, match=re.escape(str(eager.value))):
                writer(td)


def test_a_locked_tensordict_is_refused_on_the_replay_path_too(backend: Backend) -> None:
    actor = _actor(backend)
    writer = backend.wrap(actor, warmup=1)
    with torch.no_grad():
        for _ in range(3):  # captured and replayed on unlocked TensorDicts
            writer(_obs_td(backend))
        td = _obs_td(backend, action=torch.zeros(8, 2, device=backend.device)).lock_()
        with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict") as eager:
            actor(td)
        with pytest.raises(RuntimeError, match=re.escape(str(eager.value))):
            writer(td)
        assert (td["action"] == 0).all()  # the entry is the caller's, untouched
        fresh = _obs_td(backend)  # and an unlocked one is written again
        expected = actor(fresh.clone())["action"]
        torch.testing.assert_close(writer(fresh)["action"], expected)


def _stochastic_policy(backend: Backend) -> ProbabilisticTensorDictSequential:
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4)).to(backend.device)

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc, scale = x.chunk(2, -1)
        return loc, nn.functional.softplus(scale) + 1e-3

    return ProbabilisticTensorDictSequential(
        TensorDictModule(
            lambda x: split(net(x)), in_keys=["observation"], out_keys=["loc", "scale"]
        ),
        ProbabilisticTensorDictModule(
            in_keys=["loc", "scale"],
            out_keys=["action"],
            distribution_class=torch.distributions.Normal,
        ),
    )


@torch.no_grad()
def test_one_graph_per_interaction_type(backend: Backend) -> None:
    policy = _stochastic_policy(backend)
    graphed = backend.wrap(policy, warmup=2)
    td = _obs_td(backend)
    with set_interaction_type(InteractionType.RANDOM):
        samples = [graphed(td.clone())["action"] for _ in range(4)]
        assert graphed.is_captured
    assert not torch.allclose(samples[-1], samples[-2])  # each replay draws new noise
    with set_interaction_type(InteractionType.DETERMINISTIC):
        assert not graphed.is_captured  # a graph of its own, warmed up and captured anew
        for _ in range(4):
            mode = graphed(td.clone())["action"]
            torch.testing.assert_close(mode, policy(td.clone())["action"])
    with set_interaction_type(InteractionType.RANDOM):
        assert graphed.is_captured and graphed.counter == 2  # the first graph is kept
        out = graphed(td.clone())["action"]
        assert not torch.allclose(out, mode)


def test_tensordict_docs_example_with_the_import_swapped(backend: Backend) -> None:
    # The example of tensordict.nn.CudaGraphModule's docstring, device and backend aside.
    def func(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    func = backend.wrap(func)
    x = torch.rand((), device=backend.device)
    for _ in range(3):
        out = func(x)
        assert isinstance(out, torch.Tensor)
        assert out == x + 1
    func = TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"])
    func = backend.wrap(func)
    for _ in range(3):
        y = func(x=x)
        assert y == x + 1
        td = TensorDict(x=x)
        td = func(td)
        assert td["y"] == x + 1


def test_torchrl_style_update_step(backend: Backend) -> None:
    torch.manual_seed(1)
    value = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).to(backend.device)
    twin = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).to(backend.device)
    twin.load_state_dict(value.state_dict())

    def make_update(net: nn.Module) -> Any:
        return regression_step(backend, net)[0]

    graphed = backend.wrap(make_update(value), warmup=2)
    eager = make_update(twin)
    for _ in range(6):
        td = TensorDict(obs=backend.randn(32, 3), target=backend.randn(32, 1), batch_size=[32])
        torch.testing.assert_close(graphed(td)["loss"], eager(td)["loss"])
    for p, q in zip(value.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_calling_with_a_tensor_in_tensordict_mode_is_refused(backend: Backend) -> None:
    graphed = backend.wrap(lambda td: td, in_keys=[], out_keys=[])
    with pytest.raises(
        TypeError,
        match=re.escape(
            "call it with a TensorDict, or with keyword tensors named by its in_keys []; got Tensor."
        ),
    ):
        graphed(backend.randn(3))


@torch.no_grad()
@pytest.mark.parametrize("call", ["tensordict", "keywords"])
def test_several_nested_in_and_out_keys_match_eager(backend: Backend, call: str) -> None:
    # Two inputs (one nested, named "next_obs" as a keyword, as tensordict's dispatch does)
    # and two outputs, called many times after the capture: the replay path for these calls.
    weight = backend.randn(3, 2)

    def step(next_obs: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return next_obs @ weight + h, h * 2

    module = TensorDictModule(step, in_keys=[("next", "obs"), "h"], out_keys=["a", ("out", "b")])
    graphed = backend.wrap(module, warmup=2)
    for _ in range(5):
        obs, h = backend.randn(4, 3), backend.randn(4, 2)
        if call == "keywords":
            expected = module(next_obs=obs, h=h)
            actual = graphed(next_obs=obs, h=h)
            assert isinstance(actual, tuple) and len(actual) == 2
            for a, e in zip(actual, expected, strict=True):
                torch.testing.assert_close(a, e)
        else:
            td = TensorDict(next=TensorDict(obs=obs, batch_size=[4]), h=h, batch_size=[4])
            expected_td = module(td.clone())
            out = graphed(td)
            assert out is td
            for key in ("a", ("out", "b")):
                torch.testing.assert_close(td[key], expected_td[key])


@pytest.mark.parametrize("first", ["tensordict", "keywords"])
def test_tensordict_and_keyword_calls_replay_one_graph(backend: Backend, first: str) -> None:
    net = nn.Linear(4, 2).to(backend.device)
    policy = backend.wrap(TensorDictModule(net, in_keys=["obs"], out_keys=["act"]), warmup=2)

    def by_tensordict(obs: torch.Tensor) -> torch.Tensor:
        return policy(TensorDict(obs=obs, batch_size=[8]))["act"]  # type: ignore[no-any-return]

    def by_keywords(obs: torch.Tensor) -> torch.Tensor:
        return policy(obs=obs)  # type: ignore[no-any-return]

    calls = [by_tensordict, by_keywords] if first == "tensordict" else [by_keywords, by_tensordict]
    with torch.no_grad():
        for call in [calls[0]] * 2 + calls * 3:  # a warm-up and the capture, then both kinds
            obs = backend.randn(8, 4)
            torch.testing.assert_close(call(obs), net(obs))
        (info,) = policy.graphs()
        assert info.captured and info.replays == 6
        # A TensorDict you pass keeps its batch size: another one than the capture's raises.
        other = (
            TensorDict(obs=backend.randn(8, 4), batch_size=[]) if first == "tensordict" else None
        )
        if other is not None:
            with pytest.raises(
                ValueError, match=re.escape("of batch size [8], but received batch size []")
            ):
                policy(other)


def test_a_call_without_input_raises_the_exported_key_error(backend: Backend) -> None:
    import cudagraph_td

    net = nn.Linear(4, 2).to(backend.device)
    policy = backend.wrap(TensorDictModule(net, in_keys=["obs"], out_keys=["act"]), warmup=2)
    with pytest.raises(cudagraph_td.InputKeyError, match=re.escape("lacks the in_keys ['obs']")):
        policy()  # a KeyError, as tensordict's module raises


@pytest.mark.parametrize("first", ["tensordict", "positional"])
def test_positional_tensors_and_a_tensordict_replay_one_graph(backend: Backend, first: str) -> None:
    # policy(obs) with a plain tensor, as a TensorDictModule takes it: its in_keys' values.
    net = nn.Linear(4, 2).to(backend.device)
    eager = TensorDictModule(net, in_keys=["obs"], out_keys=["act"])
    policy = backend.wrap(TensorDictModule(net, in_keys=["obs"], out_keys=["act"]), warmup=2)
    with torch.no_grad():
        for _ in range(3):
            x = backend.randn(8, 4)
            if first == "tensordict":
                out = policy(TensorDict(obs=x, batch_size=[8]))["act"]
            else:
                out = policy(x)
            torch.testing.assert_close(out, net(x))
        for _ in range(2):
            x = backend.randn(8, 4)
            torch.testing.assert_close(policy(x), eager(x))
            torch.testing.assert_close(policy(obs=x), eager(obs=x))
            td = TensorDict(obs=x, batch_size=[8])
            torch.testing.assert_close(policy(td)["act"], net(x))
    assert len(policy.graphs()) == 1
