"""The state around a graph: parameters, buffers, optimizers, autocast and threads that change
after the capture are followed (a new capture) or refused, never replayed stale."""

from __future__ import annotations

import copy
import functools
import io
import re
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from cudagraph_td import CudaGraphModule, RecaptureWarning

from .conftest import Backend, current_entry, regression_step, requires_cuda, run_threads
from .test_whole_step import _agent


class Scale(nn.Module):
    """Scales by a tensor attribute of its own, neither parameter nor buffer."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.scale = torch.full((2,), 0.5, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _net(backend: Backend) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2), Scale(backend.device)
    ).to(backend.device)


def _warm(graphed: CudaGraphModule, net: nn.Module, backend: Backend, calls: int = 3) -> None:
    for _ in range(calls):
        x = backend.randn(8, 4)
        torch.testing.assert_close(graphed(x), net(x))


def _replace(net: nn.Sequential, how: str, backend: Backend) -> str:
    """Replace state of ``net`` after the capture, as users do; return what the warning names."""
    fresh = _net(backend).eval()
    if how == "attribute":
        net[0].weight = nn.Parameter(fresh[0].weight.detach().clone())
        return "module[0].weight"
    if how == "assign":
        net.load_state_dict(copy.deepcopy(fresh.state_dict()), assign=True)
        return "module[0].weight"
    if how == "data":
        net[3].bias.data = fresh[3].bias.detach().clone()
        return "module[3].bias"
    if how == "buffer":
        net[1].running_mean = torch.randn(16, device=backend.device)
        return "module[1].running_mean"
    if how == "tensor-attribute":
        net[4].scale = torch.full((2,), 3.0, device=backend.device)
        return "module[4].scale"
    if how == "submodule":
        net[2] = nn.ReLU()  # no state of its own: only what the Sequential runs changed
        return "module[2]"
    if how == "appended":
        net.append(nn.Softplus())
        return "module (submodules added or removed)"
    if how == "deleted":
        del net[2]
        return "module[2]"
    assert how == "to"
    net.to(torch.float64)
    return "module[0].weight"


REPLACEMENTS = [
    "attribute",
    "assign",
    "data",
    "buffer",
    "tensor-attribute",
    "to",
    "submodule",
    "appended",
    "deleted",
]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_parameters_updated_in_place_flow_through_the_graph(backend: Backend, grad: bool) -> None:
    net = _net(backend).eval()
    other = _net(backend).eval()
    graphed = backend.wrap(net, warmup=2)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)  # no recapture
        _warm(graphed, net, backend)
        captured = current_entry(graphed).captured
        net.load_state_dict(other.state_dict())  # copies in place
        with torch.no_grad():
            net[0].weight.mul_(2)
            net[1].running_var.add_(1)
        _warm(graphed, net, backend)
        assert current_entry(graphed).captured is captured


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("how", REPLACEMENTS)
def test_replaced_state_is_captured_again_with_a_warning(
    backend: Backend, how: str, grad: bool
) -> None:
    net = _net(backend).eval()
    graphed = backend.wrap(net, warmup=2)
    with torch.set_grad_enabled(grad):
        _warm(graphed, net, backend)
        named = _replace(net, how, backend)
        dtype = net[0].weight.dtype
        x = backend.randn(8, 4).to(dtype)
        with pytest.warns(RecaptureWarning, match=re.escape(f"`{named}`")) as record:
            out = graphed(x)
        # The warning points at the user's call, not at the library's code.
        assert {w.filename for w in record if w.category is RecaptureWarning} == {__file__}
        torch.testing.assert_close(out, net(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # captured again once: no more warnings
            for _ in range(3):
                x = backend.randn(8, 4).to(dtype)
                torch.testing.assert_close(graphed(x), net(x))
        assert graphed.is_captured


def test_replaced_state_is_refused_when_the_warning_is_an_error(backend: Backend) -> None:
    net = _net(backend).eval()
    graphed = backend.wrap(net, warmup=2)
    with torch.no_grad():
        _warm(graphed, net, backend)
        _replace(net, "attribute", backend)
        x = backend.randn(8, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RecaptureWarning)
            for _ in range(2):  # refused at every call, the stale graph never replayed
                with pytest.raises(RecaptureWarning, match=re.escape("`module[0].weight`")):
                    graphed(x)
        graphed.reset()
        _warm(graphed, net, backend)


def test_a_graphed_callable_refuses_replaced_parameters(backend: Backend) -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(backend.device)
    graphed = backend.graph_callables(net, (backend.randn(5, 4),))
    net[2].weight = nn.Parameter(torch.randn(1, 8, device=backend.device))
    with pytest.raises(
        RuntimeError, match=re.escape("replaced after the capture: `module[2].weight`")
    ):
        graphed(backend.randn(5, 4))


@pytest.mark.parametrize("kind", ["buffer", "tensor-attribute"])
def test_a_module_that_rebinds_its_state_is_warned_at_capture(backend: Backend, kind: str) -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            calls = torch.zeros((), device=backend.device)
            if kind == "buffer":
                self.register_buffer("calls", calls)
            else:
                self.calls = calls

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = self.calls + 1  # rebinds: a graph would read the capture's value
            return x * self.calls

    graphed = backend.wrap(Counter(), warmup=2)
    graphed(backend.randn(3))
    with pytest.warns(UserWarning, match=re.escape("rebinds `module.calls` to a new tensor")):
        graphed(backend.randn(3))


def _batches(backend: Backend, n: int) -> list[TensorDict]:
    return [
        TensorDict(
            obs=backend.randn(64, 3),
            next_obs=backend.randn(64, 3),
            reward=backend.randn(64, 1),
            batch_size=[64],
        )
        for _ in range(n)
    ]


def test_a_training_step_resumed_from_a_checkpoint_matches_its_eager_twin(
    backend: Backend,
) -> None:
    update, net, target, opt = _agent(backend, "adam")
    twin_update, twin_net, twin_target, twin_opt = _agent(backend, "adam")
    graphed = backend.wrap(update, warmup=2)
    batches = _batches(backend, 10)
    for td in batches[:4]:
        graphed(td)
    checkpoint = copy.deepcopy(
        {"net": net.state_dict(), "target": target.state_dict(), "opt": opt.state_dict()}
    )
    for td in batches[4:6]:  # steps that the restore undoes
        graphed(td)
    for module, twin, key in ((net, twin_net, "net"), (target, twin_target, "target")):
        module.load_state_dict(checkpoint[key])  # in place: the graph keeps reading them
        twin.load_state_dict(checkpoint[key])
    # New state tensors and param_groups (a copy each: a CPU optimizer would share them).
    opt.load_state_dict(copy.deepcopy(checkpoint["opt"]))
    twin_opt.load_state_dict(copy.deepcopy(checkpoint["opt"]))
    with pytest.warns(RecaptureWarning, match=re.escape("`opt.state`")):
        torch.testing.assert_close(graphed(batches[6])["loss"], twin_update(batches[6])["loss"])
    for td in batches[7:]:
        torch.testing.assert_close(graphed(td)["loss"], twin_update(td)["loss"])
    for p, q in zip(net.parameters(), twin_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    for state, twin_state in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        for key in state:
            torch.testing.assert_close(state[key], twin_state[key], rtol=1e-4, atol=1e-5)


def _autocast(backend: Backend) -> torch.autocast:
    return torch.autocast(backend.device.type, dtype=torch.bfloat16)


def test_the_autocast_state_selects_a_graph_of_its_own(backend: Backend) -> None:
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).to(backend.device)
    graphed = backend.wrap(net, warmup=2)
    with torch.no_grad():
        with _autocast(backend):
            for _ in range(3):
                x = backend.randn(8, 4)
                out = graphed(x)
                assert out.dtype == torch.bfloat16
                torch.testing.assert_close(out, net(x))
        for _ in range(3):  # outside: float32, as eager
            x = backend.randn(8, 4)
            out = graphed(x)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, net(x))
        with torch.autocast(backend.device.type, dtype=torch.float16):  # another dtype
            x = backend.randn(8, 4)
            assert graphed(x).dtype == torch.float16
        with _autocast(backend):  # the first graph again, not a new one
            captured = current_entry(graphed).captured
            x = backend.randn(8, 4)
            torch.testing.assert_close(graphed(x), net(x))
            assert current_entry(graphed).captured is captured
    assert "autocast" in repr(graphed)


def test_a_graph_captured_under_autocast_reads_the_parameters_not_a_cached_cast(
    backend: Backend,
) -> None:
    net = nn.Linear(4, 2).to(backend.device)
    graphed = backend.wrap(net, warmup=2)
    with torch.no_grad():
        with _autocast(backend):  # the warm-up fills autocast's cache with casts of net
            for _ in range(3):
                graphed(backend.randn(8, 4))
        net.weight.mul_(-1)  # in place, after autocast's region ended
        with _autocast(backend):
            x = backend.randn(8, 4)
            torch.testing.assert_close(graphed(x), net(x))


def test_threads_sharing_a_wrapper_get_their_own_results(backend: Backend) -> None:
    # An inference server: one wrapper, four threads calling it at once from their first
    # call (warm-up and capture included). Calls take turns, each gets its own result.
    net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3)).to(backend.device)
    graphed = backend.wrap(net, warmup=2)
    # Drawn before the threads start: a capture admits no random op in another thread
    # (torch's CUDA generator is marked as capturing, for every thread).
    inputs = [[backend.randn(5, 4) + i for _ in range(150)] for i in range(4)]
    outputs: list[list[torch.Tensor]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def serve(i: int) -> None:
        barrier.wait()
        with torch.no_grad():
            outputs[i].extend(graphed(x) for x in inputs[i])

    run_threads(*(functools.partial(serve, i) for i in range(4)))
    with torch.no_grad():
        for i in range(4):
            for x, out in zip(inputs[i], outputs[i], strict=True):
                torch.testing.assert_close(out, net(x))
    (runner,) = graphed._graphs.values()  # one graph, shared
    assert runner.captured is not None


def test_wrappers_calling_each_other_from_two_threads_do_not_deadlock(backend: Backend) -> None:
    # An agent's step that calls a graphed policy, in one thread, while another thread calls
    # the policy itself, both from their first calls. The first thread warms its wrapper up
    # (under the capture lock) and then calls the policy; the second holds the policy's lock
    # and waits for the capture lock: it must let go of the policy's lock while it waits.
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).to(backend.device)
    policy = backend.wrap(net, warmup=2)
    started = threading.Event()

    def step(x: torch.Tensor) -> torch.Tensor:
        started.set()
        time.sleep(0.2)  # the other thread's first call to the policy starts meanwhile
        return policy(x) + 1

    agent = backend.wrap(step, warmup=50)  # warm-ups only: the function runs at each call
    step_inputs = [backend.randn(3, 4) for _ in range(3)]
    policy_inputs = [backend.randn(3, 4) for _ in range(20)]
    results: dict[str, list[torch.Tensor]] = {"step": [], "policy": []}

    def run(name: str, fn: Any, inputs: list[torch.Tensor]) -> None:
        if name == "policy":
            started.wait()
        with torch.no_grad():
            results[name].extend(fn(x) for x in inputs)

    run_threads(
        functools.partial(run, "step", agent, step_inputs),
        functools.partial(run, "policy", policy, policy_inputs),
        timeout=30,
    )
    with torch.no_grad():
        for x, out in zip(step_inputs, results["step"], strict=True):
            torch.testing.assert_close(out, net(x) + 1)
        for x, out in zip(policy_inputs, results["policy"], strict=True):
            torch.testing.assert_close(out, net(x))
        assert policy.is_captured


@requires_cuda
def test_a_call_on_another_stream_waits_for_the_last_call() -> None:
    graphed = CudaGraphModule(lambda x: x * 2, warmup=2)
    with torch.no_grad():
        for _ in range(2):
            graphed(torch.randn(1024, device="cuda"))
        first, second = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(first):
            x = torch.ones(1024, device="cuda")
            torch.cuda._sleep(50_000_000)  # the last call's replay waits behind this ...
            out = graphed(x)
        with torch.cuda.stream(second):  # ... and this call must not overwrite its input
            other = graphed(torch.full((1024,), 3.0, device="cuda"))
        torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.full((1024,), 2.0, device="cuda"))
    torch.testing.assert_close(other, torch.full((1024,), 6.0, device="cuda"))


@pytest.mark.parametrize("saved_at", [0, 3, 8], ids=["at-start", "mid-run", "at-the-end"])
def test_a_resumed_run_tracks_its_resumed_eager_twin(backend: Backend, saved_at: int) -> None:
    # Issue 30's sequence: a whole step (warmup=3, Adam capturable=True) called 8 times, a
    # checkpoint saved through torch.save and loaded into the model and the optimizer, the
    # same for an eager twin; then both go on.
    def agent() -> tuple[Any, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1)).to(backend.device)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2, capturable=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = (net(x) - y).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return step, net, opt

    def saved(net: nn.Module, opt: torch.optim.Optimizer) -> Any:
        buffer = io.BytesIO()
        torch.save((net.state_dict(), opt.state_dict()), buffer)
        buffer.seek(0)
        return torch.load(buffer, map_location=backend.device)

    step, net, opt = agent()
    twin_step, twin_net, twin_opt = agent()
    graphed = backend.wrap(step, warmup=3)
    data = [(backend.randn(16, 4), backend.randn(16, 1)) for _ in range(14)]
    checkpoints = []
    for i, (x, y) in enumerate(data[:8]):
        if i == saved_at:
            checkpoints = [saved(net, opt), saved(twin_net, twin_opt)]
        torch.testing.assert_close(graphed(x, y), twin_step(x, y))
    if saved_at == 8:
        checkpoints = [saved(net, opt), saved(twin_net, twin_opt)]
    for (weights, state), (module, optimizer) in zip(
        checkpoints, [(net, opt), (twin_net, twin_opt)], strict=True
    ):
        module.load_state_dict(weights)
        optimizer.load_state_dict(state)
    with pytest.warns(RecaptureWarning, match=re.escape("`opt.state`")):
        torch.testing.assert_close(graphed(*data[8]), twin_step(*data[8]))
    for x, y in data[9:]:
        torch.testing.assert_close(graphed(x, y), twin_step(x, y))
    for p, q in zip(net.parameters(), twin_net.parameters(), strict=True):
        torch.testing.assert_close(p, q)


# A resume that builds a new model and optimizer, loads the checkpoint into them and binds
# them where the function finds its own: the graph read the old ones.


def _model(backend: Backend, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1)).to(backend.device)
    return net, torch.optim.Adam(net.parameters(), lr=1e-2, capturable=True)


def _train(net: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = (net(x) - y).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _act(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    return net(x)


class _Agent:
    """A model and its optimizer held as attributes of a plain object, as RL agents do."""

    def __init__(self, net: nn.Module, opt: torch.optim.Optimizer, body: Any) -> None:
        self.net, self.opt, self.body = net, opt, body
        self.calls = 0

    def step(self, *args: Any) -> Any:
        return self.body(self.net, self.opt, *args)


_NET: Any = None  # the model, optimizer and body of `_global_step`
_OPT: Any = None
_BODY: Any = None


def _global_step(*args: Any) -> Any:
    return _BODY(_NET, _OPT, *args)


def _bound(backend: Backend, kind: str, body: Any) -> tuple[Any, Any, Any, tuple[str, str]]:
    """``body(net, opt, *args)`` as a function that finds a model and optimizer where
    ``kind`` binds them; a function that binds others there, one that returns those bound,
    and the paths that a RecaptureWarning names."""
    net, opt = _model(backend)
    if kind in ("attribute", "method"):
        agent = _Agent(net, opt, body)

        def rebind(net: nn.Module, opt: torch.optim.Optimizer) -> None:
            agent.net, agent.opt = net, opt

        if kind == "method":
            return agent.step, rebind, lambda: (agent.net, agent.opt), ("self.net", "self.opt")
        fn = lambda *args, a=agent: a.step(*args)  # noqa: E731
        return fn, rebind, lambda: (agent.net, agent.opt), ("a.net", "a.opt")
    if kind == "dict":
        held = {"net": net, "opt": opt}

        def step(*args: Any) -> Any:
            return body(held["net"], held["opt"], *args)

        def rebind_entries(net: nn.Module, opt: torch.optim.Optimizer) -> None:
            held.update(net=net, opt=opt)

        return step, rebind_entries, lambda: (held["net"], held["opt"]), ("held.net", "held.opt")
    if kind == "global":
        global _NET, _OPT, _BODY
        _NET, _OPT, _BODY = net, opt, body

        def rebind_globals(net: nn.Module, opt: torch.optim.Optimizer) -> None:
            global _NET, _OPT
            _NET, _OPT = net, opt

        return _global_step, rebind_globals, lambda: (_NET, _OPT), ("_NET", "_OPT")
    assert kind == "closure"

    def closure_step(*args: Any) -> Any:
        return body(net, opt, *args)

    def rebind_cells(new_net: nn.Module, new_opt: torch.optim.Optimizer) -> None:
        nonlocal net, opt
        net, opt = new_net, new_opt

    return closure_step, rebind_cells, lambda: (net, opt), ("net", "opt")


def _saved(backend: Backend, net: nn.Module, opt: torch.optim.Optimizer) -> Any:
    buffer = io.BytesIO()
    torch.save((net.state_dict(), opt.state_dict()), buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location=backend.device)


def _resumed(
    backend: Backend, saved: Any, what: str, net: nn.Module, opt: torch.optim.Optimizer
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer that a resume from ``saved`` binds: new ones loaded from it,
    or (``what="optimizer"``) the same model, loaded in place, with a new optimizer."""
    weights, state = saved
    if what == "optimizer":
        net.load_state_dict(weights)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2, capturable=True)
    else:
        net, opt = _model(backend, seed=1)
        net.load_state_dict(weights)
    opt.load_state_dict(state)
    return net, opt


BINDINGS = ["attribute", "method", "dict", "global", "closure"]


@pytest.mark.parametrize("what", ["model+optimizer", "optimizer"])
@pytest.mark.parametrize("kind", BINDINGS)
def test_a_resume_that_rebinds_the_model_or_optimizer_is_captured_again(
    backend: Backend, kind: str, what: str
) -> None:
    step, rebind, bound, paths = _bound(backend, kind, _train)
    twin = {"net": None, "opt": None}
    twin["net"], twin["opt"] = _model(backend)
    twin_step = lambda x, y: _train(twin["net"], twin["opt"], x, y)  # noqa: E731
    graphed = backend.wrap(step, warmup=2)
    data = [(backend.randn(16, 4), backend.randn(16, 1)) for _ in range(12)]
    for i, (x, y) in enumerate(data[:6]):
        if i == 3:
            checkpoints = [_saved(backend, *bound()), _saved(backend, twin["net"], twin["opt"])]
        torch.testing.assert_close(graphed(x, y), twin_step(x, y))
    rebind(*_resumed(backend, checkpoints[0], what, *bound()))
    twin["net"], twin["opt"] = _resumed(backend, checkpoints[1], what, twin["net"], twin["opt"])
    named = paths[1] if what == "optimizer" else paths[0]
    with pytest.warns(RecaptureWarning, match=re.escape(f"`{named}`")):
        torch.testing.assert_close(graphed(*data[6]), twin_step(*data[6]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # captured again once
        for x, y in data[7:]:
            torch.testing.assert_close(graphed(x, y), twin_step(x, y))
    net, opt = bound()
    for p, q in zip(net.parameters(), twin["net"].parameters(), strict=True):
        torch.testing.assert_close(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], twin["opt"].state[q][key])


@pytest.mark.parametrize("kind", BINDINGS)
def test_a_policy_whose_model_is_rebound_is_captured_again(backend: Backend, kind: str) -> None:
    policy, rebind, bound, paths = _bound(backend, kind, _act)
    graphed = backend.wrap(policy, warmup=2)
    with torch.no_grad():
        for _ in range(3):
            x = backend.randn(8, 4)
            torch.testing.assert_close(graphed(x), bound()[0](x))
        net = _model(backend, seed=1)[0]
        rebind(net, bound()[1])
        with pytest.warns(RecaptureWarning, match=re.escape(f"`{paths[0]}`")):
            torch.testing.assert_close(graphed(x), net(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                x = backend.randn(8, 4)
                torch.testing.assert_close(graphed(x), net(x))


def test_other_attributes_of_the_agent_changing_keep_the_graph(backend: Backend) -> None:
    agent = _Agent(*_model(backend), _train)
    # A graphed policy of the same network, which the agent holds too (its wrapper's own
    # attributes, which reach the network again, change at each call).
    agent.policy = policy = backend.wrap(agent.net, warmup=2)
    agent.history = []
    graphed = backend.wrap(agent.step, warmup=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)  # no recapture
        for _ in range(8):
            x, y = backend.randn(16, 4), backend.randn(16, 1)
            loss = graphed(x, y)
            agent.calls += 1  # a counter, a log, a list rebound: not on the way to a module
            agent.log = {"loss": loss, "calls": agent.calls}
            agent.history = [*agent.history, float(loss)]
            with torch.no_grad():
                torch.testing.assert_close(policy(x), agent.net(x))
        captured = current_entry(graphed).captured
    agent.opt = torch.optim.Adam(agent.net.parameters(), lr=1e-2, capturable=True)
    with pytest.warns(RecaptureWarning, match=re.escape("`self.opt`")):
        graphed(backend.randn(16, 4), backend.randn(16, 1))
    assert current_entry(graphed).captured is not captured


def test_a_graphed_callable_refuses_a_rebound_module(backend: Backend) -> None:
    agent = _Agent(*_model(backend), _act)
    graphed = backend.graph_callables(lambda x, a=agent: a.net(x), (backend.randn(5, 4),))
    agent.net = _model(backend, seed=1)[0]
    with pytest.raises(RuntimeError, match=re.escape("replaced after the capture: `a.net`")):
        graphed(backend.randn(5, 4))


def test_a_function_that_rebinds_where_it_finds_its_model_is_warned_at_capture(
    backend: Backend,
) -> None:
    agent = _Agent(*_model(backend), _act)
    agent.nets = {"actor": agent.net}

    def act(x: torch.Tensor, a: _Agent = agent) -> torch.Tensor:
        a.nets = dict(a.nets)  # a new dict at each call: a graph reads the capture's
        return a.nets["actor"](x)

    graphed = backend.wrap(act, warmup=2)
    with torch.no_grad():
        graphed(backend.randn(3, 4))
        with pytest.warns(UserWarning, match=re.escape("rebinds `a.nets` to a new object")):
            graphed(backend.randn(3, 4))


def test_the_librarys_own_closures_are_no_bindings_to_follow(backend: Backend) -> None:
    # A TensorDict module runs inside the library's own closure, which no user can rebind:
    # its cell is not followed before each replay (only the module's state is).
    from tensordict.nn import TensorDictModule

    from cudagraph_td._state.state import CELLS

    policy = TensorDictModule(_net(backend).eval(), in_keys=["x"], out_keys=["y"])
    graphed = backend.wrap(policy, warmup=1)
    with torch.no_grad():
        for _ in range(3):
            td = TensorDict(x=backend.randn(8, 4), batch_size=[8])
            torch.testing.assert_close(graphed(td)["y"], policy(td.clone())["y"])
    (entry,) = graphed._table.entries()  # the entry of its one graph
    state = entry.captured.state
    assert state is not None and state.followed
    assert [b[0] for b in state.bindings if b[1] is CELLS] == []


def test_a_recapture_warning_says_only_what_applies_to_a_frozen_layer(backend: Backend) -> None:
    # A training step whose critic's first layer is frozen after the capture: the warning
    # names the flags and their cause, not the causes of a replaced tensor.
    critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(backend.device)
    step, _ = regression_step(backend, critic)
    graphed = backend.wrap(step, warmup=2)
    td = TensorDict(obs=backend.randn(8, 4), target=backend.randn(8, 1), batch_size=[8])
    for _ in range(3):
        graphed(td)
    critic[0].requires_grad_(False)
    with pytest.warns(RecaptureWarning) as record:
        graphed(td)
    assert str(record[0].message) == (
        "CudaGraphModule: state that the graph reads changed after the capture: "
        "`net[0].weight.requires_grad (set to False)`, `net[0].bias.requires_grad (set to "
        "False)` (a `requires_grad` flag changed (a layer frozen or unfrozen), which decides "
        "the gradients that the graph computes). The graph is captured again for the new "
        "state: the next calls warm up and capture as the first ones did. To keep the graph, "
        "set the flags before the first call. To refuse instead, turn this warning into an "
        "error: `warnings.simplefilter('error', cudagraph_td.RecaptureWarning)`."
    )


@torch.no_grad()
def test_a_recapture_warning_says_only_what_applies_to_a_replaced_tensor(
    backend: Backend,
) -> None:
    net = _net(backend)
    graphed = backend.wrap(net, warmup=2)
    _warm(graphed, net, backend)
    net[0].weight = nn.Parameter(net[0].weight.clone())
    with pytest.warns(RecaptureWarning) as record:
        graphed(backend.randn(8, 4))
    message = str(record[0].message)
    assert "`module[0].weight` (state replaced: a new tensor" in message
    assert "`load_state_dict(assign=True)`" in message and "requires_grad" not in message
    assert "To keep the graph, update state in place (`load_state_dict(sd)`, `copy_`)." in message
