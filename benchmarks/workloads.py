"""The workloads of the benchmark, and every way of running each one.

A workload builds its function, its inputs, and a set of *variants*: callables that do the
same work, each through another tool. The runner times them side by side. A variant that
a tool cannot run is left out with the reason (``Unsupported``).

- ``eager``: the function itself.
- ``floor``: a hand-written CUDA graph: static buffers, ``torch._foreach_copy_`` of the new
  inputs, ``replay()``, one ``clone()`` per output. No checks, no generality: the cost a
  wrapper cannot go below without dropping fresh outputs.
- ``tensordict``: ``tensordict.nn.CudaGraphModule``.
- ``compile``: ``torch.compile(mode="reduce-overhead")`` (CUDA graphs through inductor).
- ``torch.make_graphed``: ``torch.cuda.make_graphed_callables`` (workload e).
- ``cudagraph_td``: this library.
- ``cudagraph_td (before)``: an earlier version of this library, timed in the same run
  (``run.py --baseline``), to check that a change costs nothing per call.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import CudaGraphModule as TDCudaGraphModule
from tensordict.nn import TensorDictModule
from torch import nn

import cudagraph_td

Call = Callable[[], Any]


class Unsupported(Exception):
    """A tool cannot run this workload; the message says why."""


@dataclass
class Workload:
    name: str
    description: str
    # variant name -> a factory of a no-argument call (built lazily: compilation and
    # capture happen when the runner asks for the variant).
    variants: dict[str, Callable[[], Call]] = field(default_factory=dict)
    # variant name -> a factory of the call counted in the capture cost (from construction
    # to the first replay), for the wrappers that capture.
    captures: dict[str, Callable[[], Call]] = field(default_factory=dict)
    # Timed under torch.no_grad() (a policy in a collector), else in grad mode.
    no_grad: bool = False


# An earlier version of the library, as a package of another name (see `run.py --baseline`).
BASELINE: Any = None
BEFORE = "cudagraph_td (before)"


def _other_stream() -> torch.cuda.Stream:
    """A stream of torch's pool that is not ``torch.cuda.graph``'s capture stream (see
    `skip_capture_stream`): a warm-up on the capture stream itself would leave its graphs
    a workspace in ordinary memory, which the next clear of the workspaces frees."""
    skip_capture_stream()
    return torch.cuda.Stream()


def skip_capture_stream() -> None:
    """Take streams from torch's pool until ``torch.cuda.graph``'s capture stream comes out,
    so that the next one is another: torch's ``make_graphed_callables`` warms up on the next
    one, then captures on that one (run.py's ``bracketed`` says why it matters)."""
    capture = torch.cuda.graph.default_capture_stream
    if capture is None:
        torch.cuda.graph(torch.cuda.CUDAGraph())  # makes it
        capture = torch.cuda.graph.default_capture_stream
    for _ in range(64):
        if torch.cuda.Stream() == capture:
            return


def _torch_graphed(net: nn.Module, sample: tuple[torch.Tensor, ...]) -> Any:
    """``torch.cuda.make_graphed_callables``, warmed up off its capture stream."""
    skip_capture_stream()
    return torch.cuda.make_graphed_callables(net, sample)


def _hand_graph(
    run: Callable[[list[torch.Tensor]], Any],
    inputs: list[torch.Tensor],
    warmup: int = 2,
    pool: Any = None,
) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]:
    """Capture ``run(static_inputs)`` as torch's documentation shows; return the graph's state."""
    static = [t.clone() for t in inputs]
    side = _other_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run(static)
    return graph, static, out


def _wrappers(
    fn: Callable[..., Any], call: Callable[[Callable[..., Any]], Call], *, td_ok: bool = True
) -> dict[str, Callable[[], Call]]:
    """The ``tensordict`` and ``cudagraph_td`` variants of ``fn``, called by ``call``."""
    variants = {"cudagraph_td": lambda: call(cudagraph_td.CudaGraphModule(fn, warmup=2))}
    if BASELINE is not None:
        variants[BEFORE] = lambda: call(BASELINE.CudaGraphModule(fn, warmup=2))
    if td_ok:
        variants["tensordict"] = lambda: call(TDCudaGraphModule(fn, warmup=2))
    return variants


def _with_every_tool(
    w: Workload, fn: Callable[..., Any], call: Callable[[Callable[..., Any]], Call], floor: Any
) -> Workload:
    """``w`` with the variants of a function that every tool can run, and its capture costs."""
    w.variants = {
        "eager": lambda: call(fn),
        "floor": floor,
        **_wrappers(fn, call),
        "compile": lambda: _compiled(fn, call),
    }
    w.captures = _wrappers(fn, call)
    return w


def _compiled(fn: Callable[..., Any], call: Callable[[Callable[..., Any]], Call]) -> Call:
    return call(_marking_steps(torch.compile(fn, mode="reduce-overhead")))


def _marking_steps(compiled: Callable[..., Any]) -> Callable[..., Any]:
    def step(*args: Any, **kwargs: Any) -> Any:
        # Each call is a new step for CUDA graph trees: outputs of the previous one may be
        # overwritten, as the other graphed variants' static buffers are.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return step


# (a) ---------------------------------------------------------------------------------


def tiny_op(device: torch.device) -> Workload:
    x = torch.randn(16, device=device)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def floor() -> Call:
        graph, static, out = _hand_graph(lambda s: fn(s[0]), [x])

        def call() -> torch.Tensor:
            torch._foreach_copy_(static, [x])
            graph.replay()
            return out.clone()

        return call

    def call(f: Callable[..., Any]) -> Call:
        return lambda: f(x)

    w = Workload(
        "a. tiny op", "`x + 1` on a 16-element tensor: the wrapper's own overhead", no_grad=True
    )
    return _with_every_tool(w, fn, call, floor)


# (b) ---------------------------------------------------------------------------------


def many_leaves(device: torch.device, n: int) -> Workload:
    inputs = {f"x{i}": torch.randn(64, device=device) for i in range(n)}

    def fn(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: t * 2 for key, t in tensors.items()}

    keys = list(inputs)

    def floor() -> Call:
        graph, static, out = _hand_graph(
            lambda s: fn(dict(zip(keys, s, strict=True))), list(inputs.values())
        )
        static_out = list(out.values())

        def call() -> dict[str, torch.Tensor]:
            torch._foreach_copy_(static, list(inputs.values()))
            graph.replay()
            return {key: t.clone() for key, t in zip(keys, static_out, strict=True)}

        return call

    def call(f: Callable[..., Any]) -> Call:
        return lambda: f(inputs)

    w = Workload(
        f"b. {n} leaves", f"a dict of {n} tensors in, {n} tensors out (`2 * x` each)", no_grad=True
    )
    return _with_every_tool(w, fn, call, floor)


# (c) ---------------------------------------------------------------------------------


def _policy(device: torch.device) -> TensorDictModule:
    net = nn.Sequential(
        nn.Linear(17, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 6)
    )
    return TensorDictModule(net.to(device), in_keys=["observation"], out_keys=["action"])


def policy_td(device: torch.device) -> Workload:
    policy = _policy(device)
    td = TensorDict(observation=torch.randn(32, 17, device=device), batch_size=[32])

    def floor() -> Call:
        graph, static, out = _hand_graph(lambda s: policy.module(s[0]), [td["observation"]])

        def call() -> TensorDict:
            torch._foreach_copy_(static, [td["observation"]])
            graph.replay()
            td["action"] = out.clone()
            return td

        return call

    def call(f: Callable[..., Any]) -> Call:
        return lambda: f(td)

    w = Workload(
        "c. policy, TensorDict",
        "a TensorDictModule MLP policy (17-256-256-6, batch 32) called with a TensorDict",
        no_grad=True,
    )
    return _with_every_tool(w, policy, call, floor)


def policy_kwargs(device: torch.device) -> Workload:
    policy = _policy(device)
    obs = torch.randn(32, 17, device=device)

    def floor() -> Call:
        graph, static, out = _hand_graph(lambda s: policy.module(s[0]), [obs])

        def call() -> torch.Tensor:
            torch._foreach_copy_(static, [obs])
            graph.replay()
            return out.clone()

        return call

    def call(f: Callable[..., Any]) -> Call:
        return lambda: f(observation=obs)

    w = Workload(
        "c. policy, keywords",
        "the same policy called with a keyword tensor: `policy(observation=obs)`",
        no_grad=True,
    )
    return _with_every_tool(w, policy, call, floor)


def policy_grad(device: torch.device) -> Workload:
    """The TensorDict policy in grad mode (a training forward), against torch's
    ``make_graphed_callables`` on the same network (the floor here)."""
    template = _policy(device)
    td = TensorDict(observation=torch.randn(32, 17, device=device), batch_size=[32])

    def floor() -> Call:
        net = copy.deepcopy(template.module)
        graphed = _torch_graphed(net, (td["observation"].clone(),))

        def call() -> TensorDict:
            td["action"] = graphed(td["observation"])
            return td

        return call

    def wrapped(make: Callable[..., Any]) -> Callable[[], Call]:
        return lambda: _calling_with(td, make(copy.deepcopy(template), warmup=2))

    w = Workload(
        "c. policy, grad mode",
        "the policy called with a TensorDict in grad mode (a training forward, backward not "
        "timed); floor: torch.cuda.make_graphed_callables on its network",
    )
    w.variants = {
        "eager": lambda: _calling_with(td, copy.deepcopy(template)),
        "floor": floor,
        "cudagraph_td": wrapped(cudagraph_td.CudaGraphModule),
    }
    if BASELINE is not None:
        w.variants[BEFORE] = wrapped(BASELINE.CudaGraphModule)
    w.captures = {"cudagraph_td": wrapped(cudagraph_td.CudaGraphModule)}
    return w


def _calling_with(td: TensorDict, module: Callable[..., Any]) -> Call:
    return lambda: module(td)


# (d) ---------------------------------------------------------------------------------


def _sac_module() -> Any:
    path = pathlib.Path(__file__).parent.parent / "examples" / "sac_update.py"
    spec = importlib.util.spec_from_file_location("sac_update", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sac_update(device: torch.device) -> Workload:
    sac = _sac_module()
    batch = sac.batches(1, device)[0]
    keys = list(batch.keys())
    torch.manual_seed(0)
    template = sac.SAC(device)

    def agent() -> Any:
        return copy.deepcopy(template)  # every variant starts from the same agent

    def floor() -> Call:
        update = agent().update

        def run(static: list[torch.Tensor]) -> TensorDict:
            return update(
                TensorDict(dict(zip(keys, static, strict=True)), batch_size=batch.batch_size)
            )

        graph, static, out = _hand_graph(run, [batch[k] for k in keys])
        out_keys, out_tensors = list(out.keys()), list(out.values())

        def call() -> TensorDict:
            torch._foreach_copy_(static, [batch[k] for k in keys])
            graph.replay()
            return TensorDict(
                {k: t.clone() for k, t in zip(out_keys, out_tensors, strict=True)}, batch_size=[]
            )

        # The graph reads and writes the agent's parameters, gradients and optimizer state
        # at their captured addresses: the agent must live as long as the graph.
        call.agent = update.__self__  # type: ignore[attr-defined]
        return call

    def call(f: Callable[..., Any]) -> Call:
        return lambda: f(batch)

    eager_agent = sac.SAC(device, graphed=False)  # float learning rates, foreach Adam
    eager_agent.load_state_dict(template.state_dict())
    w = Workload(
        "d. SAC update",
        "a whole SAC update (actor, 2 critics, 3 Adam steps, target lerp), batch 256",
    )
    w.variants = {
        "eager": lambda: call(eager_agent.update),
        "floor": floor,
        "cudagraph_td": lambda: call(cudagraph_td.CudaGraphModule(agent().update, warmup=2)),
        "tensordict": lambda: call(TDCudaGraphModule(agent().update, warmup=2)),
        "compile": lambda: _compiled(agent().update, call),
    }
    if BASELINE is not None:
        w.variants[BEFORE] = lambda: call(BASELINE.CudaGraphModule(agent().update, warmup=2))
    w.captures = {
        "cudagraph_td": lambda: call(cudagraph_td.CudaGraphModule(agent().update, warmup=2)),
        "tensordict": lambda: call(TDCudaGraphModule(agent().update, warmup=2)),
    }
    return w


# (e) ---------------------------------------------------------------------------------


def forward_backward(device: torch.device) -> Workload:
    torch.manual_seed(0)
    template = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
    ).to(device)
    x = torch.randn(128, 64, device=device)

    def train_call(model: Callable[..., Any], net: nn.Module) -> Call:
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)

        def call() -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return call

    def with_net(make: Callable[[nn.Module], Callable[..., Any]]) -> Callable[[], Call]:
        def factory() -> Call:
            net = copy.deepcopy(template)
            return train_call(make(net), net)

        return factory

    sample = (x.clone(),)
    w = Workload(
        "e. forward+backward",
        "an MLP (64-256-256-1, batch 128) graphed forward and backward, eager Adam step",
    )
    # torch's make_graphed_callables is the hand-written reference here: the floor.
    w.variants = {
        "eager": with_net(lambda net: net),
        "floor": with_net(lambda net: _torch_graphed(net, sample)),
        "cudagraph_td": with_net(lambda net: cudagraph_td.make_graphed_callables(net, sample)),
        "cudagraph_td (module)": with_net(lambda net: cudagraph_td.CudaGraphModule(net, warmup=2)),
        "compile": with_net(lambda net: _marking_steps(torch.compile(net, mode="reduce-overhead"))),
    }
    w.captures = {
        "cudagraph_td (module)": with_net(lambda net: cudagraph_td.CudaGraphModule(net, warmup=2)),
    }
    return w


# (f) ---------------------------------------------------------------------------------

BUCKETS = [1, 2, 4, 8, 16, 32, 64]


def policy_random_batch(device: torch.device) -> Workload:
    """The policy of (c), called with batch sizes drawn uniformly from 1 to 64."""
    policy = _policy(device)
    rng = random.Random(0)
    tds = [
        TensorDict(observation=torch.randn(n, 17, device=device), batch_size=[n])
        for n in (rng.randint(1, 64) for _ in range(512))
    ]

    def cycling(f: Callable[..., Any]) -> Call:
        # Every size seen three times before timing (warm-ups, captures, compilations),
        # then the same sequence of batches for every variant.
        for n in range(1, 65):
            td = TensorDict(observation=torch.randn(n, 17, device=device), batch_size=[n])
            for _ in range(3):
                f(td)
        position = [0]

        def call() -> Any:
            i = position[0] = (position[0] + 1) % len(tds)
            return f(tds[i])

        return call

    def floor() -> Call:
        # One graph per bucket (powers of two), as torch's documentation captures them,
        # largest first into one pool; a call copies its rows into the first rows of the
        # bucket's input buffer (the other rows keep earlier calls' rows) and clones the
        # first rows of the output: the views of both made once per batch size.
        pool = torch.cuda.graph_pool_handle()
        graphs = {}
        for b in sorted(BUCKETS, reverse=True):
            static = torch.randn(b, 17, device=device)
            graph, buffers, out = _hand_graph(lambda s: policy.module(s[0]), [static], pool=pool)
            graphs[b] = (graph, buffers[0], out)
        views = {}
        for n in range(1, 65):
            b = next(size for size in BUCKETS if size >= n)
            graph, static, out = graphs[b]
            views[n] = ([static[:n]], out[:n], graph.replay)

        def run(td: TensorDict) -> TensorDict:
            heads, out, replay = views[td.batch_size[0]]
            torch._foreach_copy_(heads, [td["observation"]])
            replay()
            td["action"] = out.clone()
            return td

        return cycling(run)

    def buckets() -> Any:
        graphed = cudagraph_td.CudaGraphModule(policy, warmup=2, shapes="buckets", buckets=BUCKETS)
        graphed.precapture(tds[0])
        return graphed

    def exact() -> Any:
        return cudagraph_td.CudaGraphModule(policy, warmup=2, shapes="exact", max_graphs=64)

    def compiled() -> Call:
        return cycling(_marking_steps(torch.compile(policy, mode="reduce-overhead")))

    w = Workload(
        "f. policy, random batch",
        "the policy of (c) called with TensorDicts of batch sizes drawn uniformly from 1 to 64",
        no_grad=True,
    )
    w.variants = {
        "eager": lambda: cycling(policy),
        "floor": floor,
        "cudagraph_td": lambda: cycling(buckets()),
        "cudagraph_td exact": lambda: cycling(exact()),
        "compile": compiled,
    }
    w.captures = {"cudagraph_td": lambda: (lambda g: lambda: g(tds[0]))(buckets())}
    return w


def all_workloads(device: torch.device) -> list[Workload]:
    return [
        tiny_op(device),
        many_leaves(device, 8),
        many_leaves(device, 32),
        policy_td(device),
        policy_kwargs(device),
        policy_grad(device),
        sac_update(device),
        forward_backward(device),
        policy_random_batch(device),
    ]
