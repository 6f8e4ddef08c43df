"""The graph table: every kind of call seen before replays without the slow path, whatever
the order of the calls (modes, shapes of any input, static values)."""

from __future__ import annotations

import re
import weakref
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import CudaGraphModule

from .conftest import Backend, regression_step


def _slow_calls(graphed: CudaGraphModule) -> list[int]:
    """Count the calls that take the wrapper's slow path from now on."""
    count = [0]
    slow = graphed._call

    def counted(args: Any, kwargs: Any) -> Any:
        count[0] += 1
        return slow(args, kwargs)

    graphed._call = counted  # type: ignore[method-assign]
    return count


def test_alternating_grad_and_no_grad_calls_replay_without_the_slow_path(
    backend: Backend,
) -> None:
    # A policy that collects under no_grad and is trained in grad mode, in turn.
    torch.manual_seed(0)
    net = nn.Linear(4, 3).to(backend.device)
    policy = TensorDictModule(net, in_keys=["obs"], out_keys=["action"])
    graphed = backend.wrap(policy, warmup=2)
    for _ in range(2):  # each mode's warm-up call and capture
        with torch.no_grad():
            graphed(TensorDict(obs=backend.randn(8, 4), batch_size=[8]))
        graphed(TensorDict(obs=backend.randn(8, 4), batch_size=[8]))
    slow = _slow_calls(graphed)
    for _ in range(5):
        obs = backend.randn(8, 4)
        with torch.no_grad():
            collected = graphed(TensorDict(obs=obs.clone(), batch_size=[8]))["action"]
        trained = graphed(TensorDict(obs=obs.clone(), batch_size=[8]))["action"]
        expected = net(obs)
        assert not collected.requires_grad and trained.requires_grad
        torch.testing.assert_close(collected, expected.detach())
        torch.testing.assert_close(trained, expected)
        trained.sum().backward()  # the grad-mode graph's backward
    assert slow[0] == 0
    assert net.weight.grad is not None


def test_alternating_training_and_eval_modes_replay_without_the_slow_path(
    backend: Backend,
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).to(backend.device)
    graphed = backend.wrap(net, warmup=1)
    with torch.no_grad():
        net.eval()
        graphed(backend.randn(3, 4))
        net.train()
        graphed(backend.randn(3, 4))
        slow = _slow_calls(graphed)
        for _ in range(4):
            x = backend.randn(3, 4)
            net.eval()
            torch.testing.assert_close(graphed(x), net(x))
            net.train()
            assert graphed(x).shape == (3, 2)
    assert slow[0] == 0


def test_a_later_inputs_shape_alternating_stays_on_the_replay_path(backend: Backend) -> None:
    # "exact": the graphs are picked by every input's shape, not only the first one's.
    def f(obs: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return obs.sum(-1, keepdim=True) * hidden.mean(-1, keepdim=True)

    graphed = backend.wrap(f, warmup=1, shapes="exact")
    obs = backend.randn(4, 3)
    for width in (5, 7):
        graphed(obs, backend.randn(4, width))
    slow = _slow_calls(graphed)
    for _ in range(4):
        for width in (5, 7):
            hidden = backend.randn(4, width)
            torch.testing.assert_close(graphed(obs, hidden), f(obs, hidden))
    assert slow[0] == 0
    assert sorted(info.replays for info in graphed.graphs()) == [4, 4]


def test_alternating_static_values_stay_on_the_replay_path(backend: Backend) -> None:
    def update(x: torch.Tensor, actor: bool) -> torch.Tensor:
        return x * 2 if actor else x - 1

    graphed = backend.wrap(update, warmup=1, static=("actor",))
    for actor in (True, False):
        graphed(backend.randn(3), actor)
    slow = _slow_calls(graphed)
    for _ in range(3):
        for actor in (True, False):
            x = backend.randn(3)
            torch.testing.assert_close(graphed(x, actor), update(x, actor))
    assert slow[0] == 0


def test_calls_of_one_key_on_two_graphs_both_replay(backend: Backend) -> None:
    # Two TensorDicts of one batch size, with entries of other shapes ("exact"): the key
    # (the batch size) does not tell them apart; the table keeps a path for each.
    def f(td: TensorDict) -> torch.Tensor:
        return td["a"].sum(-1)

    graphed = backend.wrap(f, warmup=1, shapes="exact")

    def td(width: int) -> TensorDict:
        return TensorDict(a=backend.randn(2, width), batch_size=[2])

    graphed(td(3))
    graphed(td(5))
    for width in (3, 5):  # each one's first replay teaches the table
        graphed(td(width))
    slow = _slow_calls(graphed)
    for _ in range(3):
        for width in (3, 5):
            x = td(width)
            torch.testing.assert_close(graphed(x), f(x))
    assert slow[0] == 0


def test_a_mismatch_in_a_known_key_still_raises_the_slow_paths_error(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x + 1, warmup=1)
    for _ in range(2):
        graphed(backend.randn(3))
    with pytest.raises(ValueError, match="dtype"):
        graphed(torch.zeros(3, dtype=torch.float64, device=backend.device))


def test_a_recaptured_graph_is_replaced_in_its_entry(backend: Backend) -> None:
    # The entry is the graph's for its whole life: a new capture replaces what it holds, and
    # the old graph and its buffers are freed at once (no reference left anywhere).
    net = nn.Linear(2, 2).to(backend.device)
    graphed = backend.wrap(net, warmup=1)
    with torch.no_grad():
        for _ in range(2):
            graphed(backend.randn(1, 2))
        (entry,) = graphed._table.entries()
        old = weakref.ref(entry.captured)
        net.weight = nn.Parameter(torch.ones(2, 2, device=backend.device))
        with pytest.warns(UserWarning, match="captured again"):
            for _ in range(3):
                x = backend.randn(1, 2)
                torch.testing.assert_close(graphed(x), net(x))
    assert graphed._table.entries() == [entry]
    assert old() is None and entry.captured is not None
    # Its replays are the new graph's: the capture's call, then two replays.
    (info,) = graphed.graphs()
    assert info.replays == 2


def test_a_function_given_no_in_keys_replays_without_the_slow_path(backend: Backend) -> None:
    # LeanRL's SAC, TD3 and PPO scripts: `CudaGraphModule(update, in_keys=[], out_keys=[])`,
    # a whole training step that takes the sampled batch and returns a new TensorDict of
    # metrics. Every call took the slow path (its full check): in TD3's loop on the H100,
    # 280 against tensordict's 187 us a call. It replays as a plain function's graph.
    torch.manual_seed(0)
    net = nn.Linear(4, 1).to(backend.device)
    twin = nn.Linear(4, 1).to(backend.device)
    twin.load_state_dict(net.state_dict())
    update, _ = regression_step(backend, net)
    eager_update, _ = regression_step(backend, twin)
    graphed = backend.wrap(update, in_keys=[], out_keys=[], warmup=2)

    def batch() -> TensorDict:
        return TensorDict(obs=backend.randn(8, 4), target=backend.randn(8, 1), batch_size=[8])

    for _ in range(3):  # two warm-ups, the capture
        td = batch()
        torch.testing.assert_close(graphed(td)["loss"], eager_update(td.clone())["loss"])
    slow = _slow_calls(graphed)
    losses = []
    for _ in range(4):
        td = batch()
        out = graphed(td)
        assert type(out) is TensorDict and list(out.keys()) == ["loss"]
        torch.testing.assert_close(out["loss"], eager_update(td.clone())["loss"])
        losses.append(out)
    assert slow[0] == 0
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    # Fresh memory: each call's metrics, kept, are their own.
    assert len({t["loss"].data_ptr() for t in losses}) == len(losses)
    # Calls the graph cannot answer still take the slow path, and its errors.
    with pytest.raises(TypeError, match="call it with a TensorDict"):
        graphed(backend.randn(8, 4))
    assert slow[0] == 1


def test_a_tensordict_module_called_with_tensordict_out_replays_without_the_slow_path(
    backend: Backend,
) -> None:
    # LeanRL's PPO: `update = CudaGraphModule(TensorDictModule(update_fn, in_keys=[...],
    # out_keys=[metrics]))`, a whole training step called as `update(minibatch,
    # tensordict_out=TensorDict())`, hundreds of times an iteration. Each call took the
    # slow path; it replays, the metrics written into the given `tensordict_out`.
    torch.manual_seed(0)
    net = nn.Linear(4, 1).to(backend.device)
    twin = nn.Linear(4, 1).to(backend.device)
    twin.load_state_dict(net.state_dict())

    def make_update(net: nn.Module) -> TensorDictModule:
        opt = torch.optim.Adam(
            net.parameters(), lr=torch.tensor(1e-2, device=backend.device), capturable=True
        )

        def update_fn(obs: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, ...]:
            opt.zero_grad(set_to_none=False)
            loss = (net(obs).squeeze(-1) * advantages).mean()
            loss.backward()
            opt.step()
            return loss.detach(), advantages.std()

        keys = ["obs", "advantages"]
        return TensorDictModule(update_fn, in_keys=keys, out_keys=["loss", "adv_std"])

    graphed = backend.wrap(make_update(net), warmup=2)
    eager = make_update(twin)

    def minibatch(n: int = 16) -> TensorDict:
        return TensorDict(obs=backend.randn(n, 4), advantages=backend.randn(n), batch_size=[n])

    for _ in range(3):  # two warm-ups, the capture
        td = minibatch()
        graphed(td, tensordict_out=TensorDict())
        eager(td.clone(), tensordict_out=TensorDict())
    slow = _slow_calls(graphed)
    results = []
    for _ in range(4):
        td = minibatch()
        out = TensorDict()
        result = graphed(td, tensordict_out=out)
        expected = eager(td.clone(), tensordict_out=TensorDict())
        assert result is out and sorted(out.keys()) == ["adv_std", "loss"]
        assert sorted(td.keys()) == ["advantages", "obs"]  # the minibatch is untouched
        torch.testing.assert_close(out["loss"], expected["loss"])
        torch.testing.assert_close(out["adv_std"], expected["adv_std"])
        results.append(out)
    assert slow[0] == 0
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert len({r["loss"].data_ptr() for r in results}) == len(results)  # fresh memory
    # A call the graph cannot answer (a minibatch of another size) takes the slow path,
    # whose error names the entry; tensordict_out is left empty.
    out = TensorDict()
    message = 'args[0]["advantages"] of shape (16,), but received shape (12,)'
    with pytest.raises(ValueError, match=re.escape(message)):
        graphed(minibatch(12), tensordict_out=out)
    assert slow[0] == 1 and not out.keys()


@pytest.mark.parametrize("form", ["module, tensordict_out", "in_keys=[], writes its input"])
def test_tensordict_calls_of_tensordicts_own_tests_replay_without_the_slow_path(
    backend: Backend, form: str
) -> None:
    # Two forms of tensordict's own tests of its CudaGraphModule (test_tdmodule, in the
    # corpus) that took the slow path at every call: a one-entry module called with
    # `tensordict_out`, and a function given no in_keys that writes into its input and
    # returns it.
    if form == "module, tensordict_out":
        module = TensorDictModule(lambda x: x * 2 + 1, in_keys=["x"], out_keys=["y"])
        graphed = backend.wrap(module, warmup=2)
    else:
        graphed = backend.wrap(
            lambda td: td.set("y", td.get("x") * 2 + 1), warmup=2, in_keys=[], out_keys=[]
        )

    def call() -> tuple[TensorDict, Any]:
        td = TensorDict(x=backend.randn(5), batch_size=[5])
        if form == "module, tensordict_out":
            out = TensorDict()
            assert graphed(td, tensordict_out=out) is out and "y" not in td
            return td, out
        assert graphed(td) is td
        return td, td

    for _ in range(3):  # two warm-ups, the capture
        call()
    slow = _slow_calls(graphed)
    results = []
    for _ in range(4):
        td, out = call()
        expected = td["x"] * 2 + 1
        torch.testing.assert_close(out["y"], expected)
        results.append((out["y"], expected))
    assert slow[0] == 0
    backend.sync()
    for y, expected in results:  # later replays overwrote none of them
        torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("form", ["static bool", "keyword tensor"])
def test_torchrls_update_forms_replay_without_the_slow_path(backend: Backend, form: str) -> None:
    # torchrl's sota scripts: `CudaGraphModule(update, in_keys=[], out_keys=[], warmup=5)`
    # called as `update(td, update_actor)` (TD3, a bool declared static, alternating) or
    # `update(batch, num_network_updates=t)` (PPO, a keyword tensor). Both took the slow
    # path at every call: a route needed one TensorDict and nothing else.
    def make(net: nn.Module) -> Any:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step(td: TensorDict, weight: torch.Tensor | float) -> TensorDict:
            opt.zero_grad(set_to_none=False)
            loss = (net(td["obs"]) * weight).pow(2).mean()
            loss.backward()
            opt.step()
            return TensorDict(loss=loss.detach())

        if form == "static bool":
            return lambda td, update_actor: step(td, 2.0 if update_actor else 1.0)
        return lambda td, num_network_updates: step(td, num_network_updates)

    torch.manual_seed(0)
    net = nn.Linear(4, 1).to(backend.device)
    twin = nn.Linear(4, 1).to(backend.device)
    twin.load_state_dict(net.state_dict())
    options: dict[str, Any] = {"static": ("update_actor",)} if form == "static bool" else {}
    graphed = backend.wrap(make(net), in_keys=[], out_keys=[], warmup=2, **options)
    eager = make(twin)

    def call(i: int) -> tuple[Any, Any]:
        td = TensorDict(obs=backend.randn(8, 4), batch_size=[8])
        if form == "static bool":
            return graphed(td, i % 2 == 0), eager(td, i % 2 == 0)
        n = torch.full((), float(i % 3), device=backend.device)
        return graphed(td, num_network_updates=n), eager(td, num_network_updates=n.clone())

    for i in range(6):  # each graph's warm-ups and capture
        call(i)
    slow = _slow_calls(graphed)
    for i in range(6, 12):
        got, expected = call(i)
        torch.testing.assert_close(got["loss"], expected["loss"])
    assert slow[0] == 0
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def _pair(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"a": x * 2, "b": y + 1}


@pytest.mark.parametrize("shapes", ["static", "exact"])
def test_the_slow_path_flattens_a_call_once(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, shapes: str
) -> None:
    # A call that the table does not know replays its captured graph on the slow path,
    # which reads the call's structure once: its key, its device and its full check share it.
    import optree

    graphed = backend.wrap(_pair, warmup=1, shapes=shapes)
    with torch.no_grad():
        for _ in range(2):
            graphed(backend.randn(4), backend.randn(4))
        graphed._table.clear()  # the next call takes the slow path
        flattened = [0]
        flatten = optree.tree_flatten

        def counted(*args: Any, **kwargs: Any) -> Any:
            flattened[0] += 1
            return flatten(*args, **kwargs)

        monkeypatch.setattr(optree, "tree_flatten", counted)
        x, y = backend.randn(4), backend.randn(4)
        out = graphed(x, y)
    torch.testing.assert_close(out["a"], x * 2)
    torch.testing.assert_close(out["b"], y + 1)
    assert flattened[0] == 1
    assert graphed.graphs()[0].replays == 2  # the call before, and this one


def test_graphs_counts_the_replays_of_the_current_capture(backend: Backend) -> None:
    # The sequence: 2 replays, a parameter rebound, a warm-up, the capture, 3 replays.
    net = nn.Linear(2, 2).to(backend.device)
    graphed = backend.wrap(net, warmup=2)
    with torch.no_grad():
        for _ in range(4):  # a warm-up, the capture, 2 replays
            graphed(backend.randn(1, 2))
        assert [info.replays for info in graphed.graphs()] == [2]
        net.weight = nn.Parameter(torch.ones(2, 2, device=backend.device))
        with pytest.warns(UserWarning, match="captured again"):
            for _ in range(5):  # a warm-up, the capture, 3 replays
                x = backend.randn(1, 2)
                torch.testing.assert_close(graphed(x), net(x))
    assert [info.replays for info in graphed.graphs()] == [3]


def test_the_replay_paths_lookup_finds_the_key_the_slow_path_filed() -> None:
    # The table's `find` reads a call's mode and shapes in one closure (`_call.modes`); the
    # slow path files entries under `GraphTable.key`. Every form of call must meet its own
    # key, and no other.
    from cudagraph_td._call.table import GraphTable

    module = nn.Linear(4, 3)
    table = GraphTable(module, by_shapes=True, static=None)
    x, y = torch.randn(2, 4), torch.randn(5, 4)
    td = TensorDict(obs=torch.randn(3, 4), batch_size=[3])
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((x,), {}),
        ((y,), {}),
        ((td,), {}),
        ((x, 3), {}),
        ((), {"obs": x}),
        ((), {"obs": y}),
        ((x,), {"other": y, "flag": True}),
    ]
    filed = {}
    for i, (args, kwargs) in enumerate(calls):
        key = table.key(args, kwargs)
        filed[key] = f"entry {i}"
        table.add(key, filed[key])  # type: ignore[arg-type]
    for i, (args, kwargs) in enumerate(calls):
        assert table.find(args, kwargs) == (f"entry {i}",)
    with torch.no_grad():  # another mode: another key
        assert table.find((x,), {}) == ()
    assert table.find((torch.randn(7, 4),), {}) == ()  # a shape never seen
    assert table.find(([1],), {"obs": x}) == ()
