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

Borrowed outputs and inputs in place (issue 43), on the policy of workload c and the loop of
e2:

- ``bare replay`` (c): the hand-written graph's ``replay()`` alone, no copy and no clone:
  the launch floor, which no call of a graph goes below.
- ``floor, borrowed`` (c): the floor with its output lent instead of cloned: a new tensor
  over the graph's own output memory, the one that the call before lent made unreadable.
- ``cudagraph_td, borrowed``: this library with ``outputs="borrowed"`` (c: the inputs
  copied in as usual; e2: ``make_graphed_callables(..., outputs="borrowed")``).
- ``cudagraph_td, borrowed, in place`` (c): the same, called with the wrapper's
  ``input_buffers()``, which hold the input already (filled once before timing: writing the
  data is the caller's work, an environment's say), so that a call copies nothing in.

Workloads g and h call one wrapper in two modes or with two shapes, taking turns: each
tool's variant of that name takes turns, and its *steady* variants (``<tool>, <mode> only``)
are the same construction called in one mode or with one shape only. The report sets the
first against the mean of the second (``Workload.steady``).
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import pathlib
import random
from collections.abc import Callable, Sequence
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
    # A variant that takes turns between modes or shapes -> its steady variants, each the
    # same construction called in one of them only (workloads g and h).
    steady: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The least seconds per timing, where more than ``run.py --seconds``: a training loop
    # of a millisecond a step, whose wall-time target is a few percent (e, e2).
    seconds: float = 0.0


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


# Borrowed outputs (issue 43) ---------------------------------------------------------

# torch's functions that lend a graph's output memory: a storage over memory that it does
# not own, a CUDA tensor over it, and an error raised by every later access to its data
# (through any view). torch 2.11's CUDA builds have them; CPU builds lack the last two.
_LENDING = (
    "_construct_storage_from_data_pointer",
    "_construct_CUDA_Tensor_From_Storage_And_Metadata",
    "_set_storage_data_ptr_access_error_msg",
)
_OVERWRITTEN = "floor, borrowed: this output was overwritten by the graph's next replay"


def _check_lending() -> None:
    """Raise ``Unsupported`` unless this torch can lend a graph's output memory."""
    missing = [name for name in _LENDING if not hasattr(torch._C, name)]
    if missing:
        raise Unsupported(f"this torch cannot lend a graph's memory: no torch._C.{missing[0]}")


def _lending(out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """By hand: a function that lends ``out`` (a graph's static output) at each call, a new
    tensor over its memory, and makes the tensor it lent before unreadable."""
    _check_lending()
    storage = out.untyped_storage()
    where = (storage.data_ptr(), storage.device, storage.nbytes())
    layout = {
        "size": out.shape,
        "stride": out.stride(),
        "dtype": out.dtype,
        "device": out.device,
        "storage_offset": out.storage_offset(),
    }
    lent: list[Any] = []  # the storage lent last

    def lend() -> torch.Tensor:
        new = torch._C._construct_storage_from_data_pointer(*where)
        if lent:
            torch._C._set_storage_data_ptr_access_error_msg(lent.pop()._cdata, _OVERWRITTEN)
        lent.append(new)
        return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(layout, new)

    return lend


def _bare_replay(run: Callable[[list[torch.Tensor]], Any], inputs: list[torch.Tensor]) -> Call:
    """A hand-written graph of ``run``, whose call is its ``replay()`` alone."""
    graph, static, out = _hand_graph(run, inputs)

    def call() -> None:
        graph.replay()

    # The graph reads and writes its buffers at their captured addresses: kept with it.
    call.buffers = (static, out)  # type: ignore[attr-defined]
    return call


def _borrowing(
    fn: Callable[..., Any],
    call: Callable[[Callable[..., Any]], Call],
    in_place: Callable[[Any], Call],
) -> dict[str, Callable[[], Call]]:
    """The ``cudagraph_td`` variants of ``fn`` with ``outputs="borrowed"``: called by
    ``call`` (the inputs copied in), and by ``in_place(wrapper)``, a call with the wrapper's
    input buffers, filled once, made after the wrapper's capture. With a baseline, the same
    two of the version before (``cudagraph_td (before), borrowed``...)."""

    def variants(module: Any, name: str) -> dict[str, Callable[[], Call]]:
        def borrowed() -> Call:
            _check_lending()  # else the library returns fresh outputs, with a warning
            return call(module.CudaGraphModule(fn, warmup=2, outputs="borrowed"))

        def borrowed_in_place() -> Call:
            _check_lending()
            wrapper = module.CudaGraphModule(fn, warmup=2, outputs="borrowed")
            first = call(wrapper)
            for _ in range(3):  # warmup=2: two warm-ups and the capture, whose buffers these are
                first()
            return in_place(wrapper)

        return {f"{name}, borrowed": borrowed, f"{name}, borrowed, in place": borrowed_in_place}

    found = variants(cudagraph_td, "cudagraph_td")
    if BASELINE is not None and hasattr(BASELINE.CudaGraphModule, "input_buffers"):
        found.update(variants(BASELINE, BEFORE))
    return found


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

    def own() -> TensorDict:
        # A borrowing variant's TensorDict: the action it leaves there is made unreadable by
        # its next replay, which no other variant may read (the observation is shared).
        return TensorDict(observation=td["observation"], batch_size=td.batch_size)

    def floor_borrowed() -> Call:
        graph, static, out = _hand_graph(lambda s: policy.module(s[0]), [td["observation"]])
        lend, mine = _lending(out), own()

        def call() -> TensorDict:
            torch._foreach_copy_(static, [mine["observation"]])
            graph.replay()
            mine["action"] = lend()
            return mine

        return call

    def call(f: Callable[..., Any]) -> Call:
        return lambda: f(td)

    def call_own(f: Callable[..., Any]) -> Call:
        mine = own()
        return lambda: f(mine)

    def in_place(f: Any) -> Call:
        (buffers,), _ = f.input_buffers(td)
        # The caller's data, written once: producing it is not the call's work.
        buffers["observation"].copy_(td["observation"])
        return lambda: f(buffers)

    w = Workload(
        "c. policy, TensorDict",
        "a TensorDictModule MLP policy (17-256-256-6, batch 32) called with a TensorDict",
        no_grad=True,
    )
    _with_every_tool(w, policy, call, floor)
    w.variants["bare replay"] = lambda: _bare_replay(
        lambda s: policy.module(s[0]), [td["observation"]]
    )
    w.variants["floor, borrowed"] = floor_borrowed
    w.variants.update(_borrowing(policy, call_own, in_place))
    return w


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

    def floor_borrowed() -> Call:
        graph, static, out = _hand_graph(lambda s: policy.module(s[0]), [obs])
        lend = _lending(out)

        def call() -> torch.Tensor:
            torch._foreach_copy_(static, [obs])
            graph.replay()
            return lend()

        return call

    def call(f: Callable[..., Any]) -> Call:
        return lambda: f(observation=obs)

    def in_place(f: Any) -> Call:
        # Asked with a call's form: without it, a TensorDict module's only graph gives its
        # buffers as a TensorDict, whatever form its calls took.
        _, buffers = f.input_buffers(observation=obs)
        # The caller's data, written once: producing it is not the call's work.
        buffers["observation"].copy_(obs)
        return lambda: f(**buffers)

    w = Workload(
        "c. policy, keywords",
        "the same policy called with a keyword tensor: `policy(observation=obs)`",
        no_grad=True,
    )
    _with_every_tool(w, policy, call, floor)
    w.variants["bare replay"] = lambda: _bare_replay(lambda s: policy.module(s[0]), [obs])
    w.variants["floor, borrowed"] = floor_borrowed
    w.variants.update(_borrowing(policy, call, in_place))
    return w


def policy_grad(device: torch.device) -> Workload:
    """The TensorDict policy in grad mode (a training forward), against torch's
    ``make_graphed_callables`` on the same network (the floor here)."""
    template = _policy(device)
    td = TensorDict(observation=torch.randn(32, 17, device=device), batch_size=[32])

    def floor(cloned: bool = False) -> Call:
        net = copy.deepcopy(template.module)
        graphed = _torch_graphed(net, (td["observation"].clone(),))

        def call() -> TensorDict:
            td["action"] = graphed(td["observation"])
            return td

        def call_cloned() -> TensorDict:
            # torch's output is its graph's static buffer, which the next call overwrites:
            # cloned, it is what this library returns (the contract's fresh memory).
            td["action"] = graphed(td["observation"]).clone()
            return td

        return call_cloned if cloned else call

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
        "floor, output cloned": lambda: floor(cloned=True),
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
        seconds=0.4,
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
    if BASELINE is not None:
        w.variants[BEFORE] = with_net(lambda net: BASELINE.make_graphed_callables(net, sample))
        w.variants[f"{BEFORE} (module)"] = with_net(
            lambda net: BASELINE.CudaGraphModule(net, warmup=2)
        )
    return w


# (e2) --------------------------------------------------------------------------------


def documented_loop(device: torch.device) -> Workload:
    """The training loop of torch's CUDA graphs notes ("Partial-network capture"), with a
    launch-bound network: two modules graphed one by one, the second one's sample input
    requiring grad as its real input does; an eager loss, ``backward()``, an SGD step and
    ``zero_grad(set_to_none=True)``, over ten batches in turn.

    The notes pick the second module by ``tmp.sum().item() > 0``: a host synchronisation
    at every step, whose wait would be timed, not the graphs. Here it is always the same one.
    """
    torch.manual_seed(0)
    n, d_in, hidden, d_out = 128, 64, 256, 16
    layers1 = [nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()]
    layers2 = [nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)]
    template1, template2 = nn.Sequential(*layers1).to(device), nn.Sequential(*layers2).to(device)
    loss_fn = nn.MSELoss()
    x = torch.randn(n, d_in, device=device)
    h = torch.randn(n, hidden, device=device, requires_grad=True)
    batches = [(torch.rand_like(x), torch.randn(n, d_out, device=device)) for _ in range(10)]

    def loop(graph: Callable[[nn.Module, tuple[torch.Tensor, ...]], Any]) -> Callable[[], Call]:
        def factory() -> Call:
            module1, module2 = copy.deepcopy(template1), copy.deepcopy(template2)
            optimizer = torch.optim.SGD(
                itertools.chain(module1.parameters(), module2.parameters()), lr=0.01
            )
            # Samples of their own: torch's graphs keep theirs as static inputs.
            graphed1 = graph(module1, (x.clone(),))
            graphed2 = graph(module2, (h.detach().clone().requires_grad_(),))
            batch = itertools.cycle(batches)

            def step() -> None:
                data, target = next(batch)
                optimizer.zero_grad(set_to_none=True)
                tmp = graphed2(graphed1(data))
                loss = loss_fn(tmp, target)
                loss.backward()
                optimizer.step()

            return step

        return factory

    def borrowed(module: nn.Module, sample: tuple[torch.Tensor, ...]) -> Any:
        _check_lending()  # else the library returns fresh outputs, with a warning
        return cudagraph_td.make_graphed_callables(module, sample, outputs="borrowed")

    w = Workload(
        "e2. torch's documented loop",
        "torch's documented make_graphed_callables loop: two MLPs (64-256-256, 256-256-16, "
        "batch 128) graphed one by one, eager MSE loss, backward, SGD step, "
        "`zero_grad(set_to_none=True)`",
        seconds=0.4,
    )
    # torch's make_graphed_callables is the hand-written reference here: the floor.
    w.variants = {
        "eager": loop(lambda module, sample: module),
        "floor": loop(_torch_graphed),
        "cudagraph_td": loop(cudagraph_td.make_graphed_callables),
        "cudagraph_td (module)": loop(
            lambda module, sample: cudagraph_td.CudaGraphModule(module, warmup=2)
        ),
        # Outputs and gradients in the graphs' own memory, as torch's (issue 43).
        "cudagraph_td, borrowed": loop(borrowed),
    }
    w.captures = {"cudagraph_td": loop(cudagraph_td.make_graphed_callables)}
    if BASELINE is not None:
        w.variants[BEFORE] = loop(BASELINE.make_graphed_callables)
    return w


# (f) ---------------------------------------------------------------------------------

BUCKETS = [1, 2, 4, 8, 16, 32, 64]


def random_batches(device: torch.device, count: int = 512, seed: int = 0) -> list[TensorDict]:
    """``count`` observations for the policy of (c), of batch sizes drawn uniformly from 1 to
    64 (workload f's calls; the developers' tools draw theirs with other seeds)."""
    rng = random.Random(seed)
    return [
        TensorDict(observation=torch.randn(n, 17, device=device), batch_size=[n])
        for n in (rng.randint(1, 64) for _ in range(count))
    ]


def in_turn(
    tds: Sequence[TensorDict], f: Callable[[TensorDict], Any], position: list[int] | None = None
) -> Call:
    """``f`` called on each of ``tds`` in turn, one a call (``position``: the place in
    ``tds``, shared between calls that take turns over one sequence)."""
    position = [0] if position is None else position

    def call() -> Any:
        i = position[0] = (position[0] + 1) % len(tds)
        return f(tds[i])

    return call


def random_batch_wrapper(
    library: Any, shapes: str, policy: Any, tds: Sequence[TensorDict], **options: Any
) -> Any:
    """``library``'s wrapper of ``policy`` with ``shapes`` ``"buckets"`` (`BUCKETS`) or
    ``"exact"``, as workload f makes it, every batch size of ``tds`` past its capture."""
    chosen = library.Buckets(BUCKETS) if shapes == "buckets" else library.Exact(max_graphs=64)
    graphed = library.CudaGraphModule(policy, warmup=2, shapes=chosen, **options)
    with torch.no_grad():
        for _ in range(3):
            for td in tds:
                graphed(td)
    return graphed


def policy_random_batch(device: torch.device) -> Workload:
    """The policy of (c), called with batch sizes drawn uniformly from 1 to 64."""
    policy = _policy(device)
    tds = random_batches(device)

    def cycling(f: Callable[..., Any]) -> Call:
        # Every size seen three times before timing (warm-ups, captures, compilations),
        # then the same sequence of batches for every variant.
        for n in range(1, 65):
            td = TensorDict(observation=torch.randn(n, 17, device=device), batch_size=[n])
            for _ in range(3):
                f(td)
        return in_turn(tds, f)

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

    def buckets(library: Any = cudagraph_td) -> Any:
        graphed = library.CudaGraphModule(policy, warmup=2, shapes=library.Buckets(BUCKETS))
        graphed.precapture(tds[0])
        return graphed

    def exact(library: Any = cudagraph_td) -> Any:
        return library.CudaGraphModule(policy, warmup=2, shapes=library.Exact(max_graphs=64))

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
    if BASELINE is not None:
        w.variants[BEFORE] = lambda: cycling(buckets(BASELINE))
        w.variants[f"{BEFORE} exact"] = lambda: cycling(exact(BASELINE))
    return w


# (g, h) ------------------------------------------------------------------------------


def _taking_turns(calls: Sequence[Call]) -> Call:
    """Each of ``calls`` in turn, one per call. A steady variant (one call) goes through the
    same turn, so that the comparison with it leaves out the cost of taking turns."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _with_steady(
    w: Workload,
    tool: str,
    make: Callable[[tuple[Any, ...]], Call],
    settings: tuple[Any, ...],
    label: Callable[[Any], str],
) -> None:
    """Add to ``w`` the variant ``tool`` that takes turns between ``settings`` (modes or
    shapes), and its steady variants: the same construction, made anew, with one setting."""
    w.variants[tool] = lambda: make(settings)
    steady = []
    for setting in settings:
        name = f"{tool}, {label(setting)} only"
        w.variants[name] = lambda setting=setting: make((setting,))
        steady.append(name)
    w.steady[tool] = tuple(steady)


def _warm(calls: Sequence[Call]) -> None:
    # Every mode or shape past its warm-up and capture (warmup=2), in the order timed.
    for _ in range(3):
        for call in calls:
            call()


# (g) ---------------------------------------------------------------------------------

MODES = {False: "no_grad", True: "grad"}  # the collector's call first, then training's


def _in_mode(f: Callable[[TensorDict], Any], td: TensorDict, grad: bool) -> Call:
    def call() -> Any:
        with torch.set_grad_enabled(grad):  # the same context for both modes
            return f(td)

    return call


def _check_gradients(
    f: Callable[[TensorDict], Any],
    policy: TensorDictModule,
    td: TensorDict,
    reference: TensorDictModule,
) -> None:
    """Raise ``Unsupported`` unless a grad-mode call of ``f`` (wrapping ``policy``) returns
    an action that differentiates to ``policy``'s parameters as ``reference``'s eager one
    does (the same weights): what a training forward needs of the wrapper."""
    params, expected_params = list(policy.parameters()), list(reference.parameters())
    with torch.enable_grad():
        try:
            got = torch.autograd.grad(f(td)["action"].sum(), params)
        except Exception as err:
            why = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            raise Unsupported(f"no backward through a grad-mode call: {why}") from err
        action = reference.module(td["observation"])
        expected = torch.autograd.grad(action.sum(), expected_params)
    for a, b in zip(got, expected, strict=True):
        if not torch.allclose(a, b, rtol=1e-3, atol=1e-5):
            raise Unsupported("the gradients of a grad-mode call differ from eager's")


def policy_modes_in_turn(device: torch.device) -> Workload:
    """The policy of (c), one wrapper called in turn under ``torch.no_grad()`` (collecting)
    and in grad mode (a training forward; its backward not timed, as in "c, grad mode":
    it would add the same backward replay to the turns and to the steady grad calls)."""
    template = _policy(device)
    # The collector's batch, and two training batches taken in turn (a replay buffer's
    # samples): a call writes its action into its batch (in grad mode, an action that
    # requires grad, which tensordict's class refuses in a batch it captures), so the capture
    # call of each mode gets a batch of its own.
    observations = [torch.randn(32, 17, device=device) for _ in range(3)]

    def turns(modes: tuple[bool, ...]) -> list[tuple[bool, TensorDict]]:
        """The (grad mode, batch) of the calls, in turn; a variant's own batches."""
        tds = [TensorDict(observation=obs.clone(), batch_size=[32]) for obs in observations]
        order = {(False,): [0], (True,): [1, 2], (False, True): [0, 1, 0, 2]}[modes]
        return [(i > 0, tds[i]) for i in order]

    def made(wrap: Callable[[TensorDictModule], Any]) -> Callable[[tuple[bool, ...]], Call]:
        def make(modes: tuple[bool, ...]) -> Call:
            policy = copy.deepcopy(template)
            f, calls_in = wrap(policy), turns(modes)
            calls = [_in_mode(f, td, grad) for grad, td in calls_in]
            _warm(calls)
            for grad, td in calls_in:
                if grad:
                    _check_gradients(f, policy, td, template)
                    break
            return _taking_turns(calls)

        return make

    def floor(policy: TensorDictModule) -> Callable[[TensorDict], TensorDict]:
        # A graph per mode, by hand: a plain graph captured under no_grad, and torch's
        # make_graphed_callables (forward and backward in an autograd node) for grad mode.
        # In this order: torch's replaces the network's forward with its graphed one.
        net, obs = policy.module, observations[0]
        with torch.no_grad():
            graph, static, out = _hand_graph(lambda s: net(s[0]), [obs])
        graphed = _torch_graphed(net, (obs.clone(),))

        def call(td: TensorDict) -> TensorDict:
            if torch.is_grad_enabled():
                td["action"] = graphed(td["observation"])
                return td
            torch._foreach_copy_(static, [td["observation"]])
            graph.replay()
            td["action"] = out.clone()
            return td

        return call

    def ours(policy: TensorDictModule) -> Any:
        return cudagraph_td.CudaGraphModule(policy, warmup=2)

    w = Workload(
        "g. policy, modes in turn",
        "the policy of (c) (batch 32, a TensorDict), one wrapper called in turn under "
        "`torch.no_grad()` and in grad mode (forward only); steady: one mode only",
    )
    tools: dict[str, Callable[[TensorDictModule], Any]] = {
        "eager": lambda policy: policy,
        "floor": floor,
        "cudagraph_td": ours,
        # One graph, captured in the mode of its capture call, replayed in both.
        "tensordict": lambda policy: TDCudaGraphModule(policy, warmup=2),
    }
    if BASELINE is not None:
        tools[BEFORE] = lambda policy: BASELINE.CudaGraphModule(policy, warmup=2)
    for tool, wrap in tools.items():
        _with_steady(w, tool, made(wrap), tuple(MODES), MODES.__getitem__)

    def capture() -> Call:
        f = ours(copy.deepcopy(template))
        calls = [_in_mode(f, td, grad) for grad, td in turns(tuple(MODES))[:2]]
        # Both modes per call: the runner's three calls warm up, capture and replay each.
        return lambda: [call() for call in calls]

    w.captures = {"cudagraph_td, both modes": capture}
    return w


# (h) ---------------------------------------------------------------------------------

STEPS = (32, 48)


class MemoryPolicy(nn.Module):
    """A policy that attends over a memory of past steps: ``forward(obs, memory)``, with
    ``obs`` of shape ``[batch, 17]`` and ``memory`` ``[batch, steps, 32]``, any steps."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(17, 256), nn.Tanh(), nn.Linear(256, 32))
        self.head = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 6))

    def forward(self, obs: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        query = self.query(obs)  # [batch, 32]
        scores = (memory @ query.unsqueeze(-1)).squeeze(-1) * 32**-0.5  # [batch, steps]
        context = (scores.softmax(-1).unsqueeze(1) @ memory).squeeze(1)  # [batch, 32]
        return self.head(torch.cat([query, context], -1))


def policy_memory_lengths(device: torch.device) -> Workload:
    """A policy called with its second input's shape taking turns between two values."""
    policy = MemoryPolicy().to(device)
    obs = torch.randn(64, 17, device=device)
    memories = {steps: torch.randn(64, steps, 32, device=device) for steps in STEPS}

    def made(wrap: Callable[[tuple[int, ...]], Any]) -> Callable[[tuple[int, ...]], Call]:
        def make(steps: tuple[int, ...]) -> Call:
            f = wrap(steps)
            calls = [lambda memory=memories[n]: f(obs, memory) for n in steps]
            _warm(calls)
            return _taking_turns(calls)

        return make

    def floor(steps: tuple[int, ...]) -> Callable[..., torch.Tensor]:
        # A graph per memory length, by hand, captured largest first into one pool, as (f)'s
        # floor; a call picks the graph by the length.
        pool = torch.cuda.graph_pool_handle()
        graphs = {}
        for n in sorted(steps, reverse=True):
            graph, static, out = _hand_graph(lambda s: policy(*s), [obs, memories[n]], pool=pool)
            graphs[n] = (graph.replay, static, out)

        def call(obs: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
            replay, static, out = graphs[memory.shape[1]]
            torch._foreach_copy_(static, [obs, memory])
            replay()
            return out.clone()

        return call

    def ours(steps: tuple[int, ...]) -> Any:
        return cudagraph_td.CudaGraphModule(
            policy, warmup=2, shapes=cudagraph_td.Exact(max_graphs=64)
        )

    w = Workload(
        "h. memory policy, lengths in turn",
        "`policy(obs, memory)`: obs [64, 17] fixed, memory [64, L, 32] with L taking turns "
        'between 32 and 48 (`shapes="exact"`); steady: one length only',
        no_grad=True,
    )
    tools: dict[str, Callable[[tuple[int, ...]], Any]] = {
        "eager": lambda steps: policy,
        "floor": floor,
        "cudagraph_td": ours,
    }
    if BASELINE is not None:
        tools[BEFORE] = lambda steps: BASELINE.CudaGraphModule(
            policy, warmup=2, shapes="exact", max_graphs=64
        )
    for tool, wrap in tools.items():
        _with_steady(w, tool, made(wrap), STEPS, lambda n: f"length {n}")
    # One graph of one shape: the other length raises. Timed if that ever changes.
    w.variants["tensordict"] = lambda: made(lambda steps: TDCudaGraphModule(policy, warmup=2))(
        STEPS
    )

    def capture() -> Call:
        f = ours(STEPS)
        # Both lengths per call: the runner's three calls warm up, capture and replay each.
        return lambda: [f(obs, memories[n]) for n in STEPS]

    w.captures = {"cudagraph_td, both lengths": capture}
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
        documented_loop(device),
        policy_random_batch(device),
        policy_modes_in_turn(device),
        policy_memory_lengths(device),
    ]
