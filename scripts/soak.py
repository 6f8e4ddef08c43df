"""Soak: this library's graphs beside every other user of CUDA graphs, in one process.

    python scripts/soak.py --seconds 120 --seed 0      # the GPU check runs this
    compute-sanitizer --tool memcheck python scripts/soak.py --steps 60   # a short run

A seeded random sequence of actions, each checked against eager PyTorch: wrappers of this
library (plain, TensorDict, keyword, grad mode, whole training step, buckets, exact shapes,
borrowed outputs with inputs in place at times),
captures that fail, ``torch.compile(mode="reduce-overhead")`` (its own failures too),
``torch.cuda.graph``, torch's and this library's ``make_graphed_callables``, tensordict's
``CudaGraphModule``; actors deleted and collected at random, ``torch.cuda.empty_cache()``.

Every result of a graph is compared with an eager twin (same weights, same inputs); a
training step's parameters with those of an eager twin after each step. A memory fault
kills the process (the exit status says so); a wrong result ends it with status 1.

The other tools' captures are bracketed by clears of cuBLAS's workspaces, as torch.compile's
own CUDA graph trees do around theirs, and torch's ``make_graphed_callables`` never warms up
on the stream it captures on (`benchmarks/workloads.py`'s ``skip_capture_stream``): without that, torch's graphs use
workspaces that they do not own (pytorch#193402), which any clear then frees under them,
whatever else runs in the process (the docs' sharp edges, "Other graphs in the process").
What this run checks is that this library neither breaks the others nor is broken by them.
"""

from __future__ import annotations

import argparse
import copy
import gc
import pathlib
import random
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import CudaGraphModule as TDCudaGraphModule
from tensordict.nn import TensorDictModule
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

from workloads import skip_capture_stream

import cudagraph_td

DEV = torch.device("cuda")
TOL = {"rtol": 1e-4, "atol": 1e-5}


def clear_workspaces() -> None:
    """What torch.compile's trees do around a recording, here around the other tools'."""
    torch._C._cuda_clearCublasWorkspaces()


def mlp(rng: random.Random, n_in: int = 17, n_out: int = 6) -> nn.Module:
    width = rng.choice([32, 64, 256])
    torch.manual_seed(rng.randrange(1 << 30))
    return nn.Sequential(
        nn.Linear(n_in, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, n_out),
    ).to(DEV)


def close(a: Any, b: Any, what: str) -> None:
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


class Actor:
    """One user of graphs: ``step()`` calls it once and checks the result against eager."""

    kind = ""

    def step(self, rng: random.Random) -> None:
        raise NotImplementedError


class Plain(Actor):
    kind = "plain"

    def __init__(self, rng: random.Random):
        self.net = mlp(rng)
        self.graphed = cudagraph_td.CudaGraphModule(self.net, warmup=rng.choice([1, 2, 3]))

    def step(self, rng: random.Random) -> None:
        x = torch.randn(32, 17, device=DEV)
        with torch.no_grad():
            close(self.graphed(x), self.net(x), self.kind)


class Policy(Actor):
    """A TensorDictModule, called with a TensorDict or with a keyword tensor."""

    def __init__(self, rng: random.Random, keyword: bool):
        self.kind = "keyword" if keyword else "tensordict"
        self.keyword = keyword
        self.policy = TensorDictModule(mlp(rng), in_keys=["observation"], out_keys=["action"])
        self.graphed = cudagraph_td.CudaGraphModule(self.policy, warmup=2)

    def step(self, rng: random.Random) -> None:
        obs = torch.randn(16, 17, device=DEV)
        with torch.no_grad():
            want = self.policy.module(obs)
            if self.keyword:
                got = self.graphed(observation=obs)
            else:
                got = self.graphed(TensorDict(observation=obs, batch_size=[16]))["action"]
        close(got, want, self.kind)


class GradMode(Actor):
    """A wrapper called in grad mode: the backward runs the captured backward graph."""

    kind = "grad"

    def __init__(self, rng: random.Random):
        self.net = mlp(rng)
        self.twin = copy.deepcopy(self.net)
        self.graphed = cudagraph_td.CudaGraphModule(self.net, warmup=2)

    def step(self, rng: random.Random) -> None:
        x = torch.randn(32, 17, device=DEV)
        self.graphed(x).square().mean().backward()
        self.twin(x).square().mean().backward()
        for p, q in zip(self.net.parameters(), self.twin.parameters(), strict=True):
            close(p.grad, q.grad, self.kind)
            p.grad, q.grad = None, None


class TrainingStep(Actor):
    """A whole step (zero_grad, forward, backward, Adam) captured as one graph."""

    kind = "training-step"

    def __init__(self, rng: random.Random):
        self.net = mlp(rng)
        self.twin = copy.deepcopy(self.net)
        lr = torch.tensor(1e-3, device=DEV)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=lr, capturable=True)
        self.twin_opt = torch.optim.Adam(self.twin.parameters(), lr=1e-3)

        def update(x: torch.Tensor, net: nn.Module = self.net, opt: Any = self.opt) -> Any:
            opt.zero_grad(set_to_none=False)
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        self.update = cudagraph_td.CudaGraphModule(update, warmup=2)

    def step(self, rng: random.Random) -> None:
        x = torch.randn(64, 17, device=DEV)
        loss = self.update(x)
        self.twin_opt.zero_grad()
        want = self.twin(x).square().mean()
        want.backward()
        self.twin_opt.step()
        close(loss, want.detach(), self.kind)
        for p, q in zip(self.net.parameters(), self.twin.parameters(), strict=True):
            # Adam scales each update to about lr: rounding differences between the graph's
            # kernels and eager's stay below a fraction of one update.
            torch.testing.assert_close(p, q, rtol=1e-3, atol=2e-4)


class Shapes(Actor):
    """Several batch sizes: padded to buckets, or a graph per shape."""

    def __init__(self, rng: random.Random, shapes: str):
        self.kind = shapes
        self.net = mlp(rng)
        value = cudagraph_td.Buckets([4, 16, 64]) if shapes == "buckets" else cudagraph_td.Exact()
        self.graphed = cudagraph_td.CudaGraphModule(self.net, warmup=2, shapes=value)

    def step(self, rng: random.Random) -> None:
        x = torch.randn(rng.randint(1, 64), 17, device=DEV)
        with torch.no_grad():
            close(self.graphed(x), self.net(x), self.kind)


class FailedCapture(Actor):
    """A function that syncs with the host: its capture fails, and the process goes on."""

    kind = "failed-capture"

    def __init__(self, rng: random.Random):
        self.net = mlp(rng)

        def fn(x: torch.Tensor) -> torch.Tensor:
            y = self.net(x)
            return y * float(y.sum().item() > 0)  # a host sync: no graph can capture it

        self.graphed = cudagraph_td.CudaGraphModule(fn, warmup=1)

    def step(self, rng: random.Random) -> None:
        x = torch.randn(8, 17, device=DEV)
        try:
            with torch.no_grad():
                self.graphed(x)
        except RuntimeError:
            pass
        else:
            raise AssertionError("a capture with .item() did not fail")
        assert not torch.cuda.is_current_stream_capturing()


class Compiled(Actor):
    """torch.compile(mode="reduce-overhead"): CUDA graph trees; sometimes misused on purpose
    (an output read after the next run, which the trees refuse)."""

    kind = "compile"

    def __init__(self, rng: random.Random):
        self.net = mlp(rng)
        self.compiled = torch.compile(self.net, mode="reduce-overhead")

    def step(self, rng: random.Random) -> None:
        x = torch.randn(32, 17, device=DEV)
        with torch.no_grad():
            torch.compiler.cudagraph_mark_step_begin()
            out = self.compiled(x)
            close(out.clone(), self.net(x), self.kind)
            if rng.random() < 0.3:  # its own failure: the last output overwritten, then read
                self.compiled(x)
                try:
                    out.sum()
                except RuntimeError:
                    COUNTS["compile-refused"] += 1


class TorchGraph(Actor):
    """A graph written by hand with torch.cuda.graph, as torch's documentation shows."""

    kind = "torch.cuda.graph"

    def __init__(self, rng: random.Random):
        self.net = mlp(rng)
        self.static = torch.randn(32, 17, device=DEV)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            self.net(self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        clear_workspaces()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.out = self.net(self.static)
        clear_workspaces()

    def step(self, rng: random.Random) -> None:
        x = torch.randn(32, 17, device=DEV)
        self.static.copy_(x)
        self.graph.replay()
        with torch.no_grad():
            close(self.out.clone(), self.net(x), self.kind)


class Graphed(Actor):
    """torch's make_graphed_callables, or this library's."""

    def __init__(self, rng: random.Random, ours: bool):
        self.kind = "make_graphed_callables" + (" (ours)" if ours else " (torch)")
        self.net = mlp(rng)
        self.twin = copy.deepcopy(self.net)
        sample = (torch.randn(32, 17, device=DEV),)
        if ours:
            self.graphed = cudagraph_td.make_graphed_callables(self.net, sample)
        else:
            skip_capture_stream()
            clear_workspaces()
            self.graphed = torch.cuda.make_graphed_callables(self.net, sample)
            clear_workspaces()

    def step(self, rng: random.Random) -> None:
        x = torch.randn(32, 17, device=DEV)
        out = self.graphed(x)
        want = self.twin(x)
        close(out.detach(), want.detach(), self.kind)
        out.square().mean().backward()
        want.square().mean().backward()
        for p, q in zip(self.net.parameters(), self.twin.parameters(), strict=True):
            close(p.grad, q.grad, self.kind)
            p.grad, q.grad = None, None


class TensorDictsClass(Actor):
    """tensordict's CudaGraphModule; its capture (the second call) bracketed by clears."""

    kind = "tensordict.nn.CudaGraphModule"

    def __init__(self, rng: random.Random):
        self.policy = TensorDictModule(mlp(rng), in_keys=["observation"], out_keys=["action"])
        self.graphed = TDCudaGraphModule(self.policy, warmup=2)
        self.calls = 0

    def step(self, rng: random.Random) -> None:
        obs = torch.randn(16, 17, device=DEV)
        self.calls += 1
        capturing = self.calls == 2
        if capturing:
            clear_workspaces()
        with torch.no_grad():
            got = self.graphed(TensorDict(observation=obs, batch_size=[16]))["action"].clone()
            want = self.policy.module(obs)
        if capturing:
            clear_workspaces()
        close(got, want, self.kind)


# Borrowed outputs whose wrapper was deleted, reset or captured again: each use must raise.
ORPHANS: list[tuple[torch.Tensor, str]] = []


def raises_on_use(t: torch.Tensor, what: str) -> None:
    """A borrowed output past its graph's next replay (or its graph gone): a use raises."""
    try:
        t.sum()
    except RuntimeError as err:
        if 'outputs="borrowed"' not in str(err):
            raise
        return
    raise AssertionError(f"{what}: a borrowed output was read after its graph overwrote it")


class Borrowing(Actor):
    """``outputs="borrowed"`` (exact shapes, inputs in place at times): each output as
    eager's, the previous one of the same graph unreadable; reset, parameters replaced (a
    new capture) and the wrapper deleted, with their last outputs kept and checked."""

    kind = "borrowed"

    def __init__(self, rng: random.Random):
        self.net = mlp(rng)
        self.graphed = cudagraph_td.CudaGraphModule(
            self.net, warmup=rng.choice([1, 2]), shapes="exact", outputs="borrowed"
        )
        self.last: torch.Tensor | None = None  # the last output, if it was lent
        self.in_place = rng.random() < 0.5
        self.history: list[str] = []  # its last steps, for a failure's message

    def replays(self) -> int:
        return sum(info.replays for info in self.graphed.graphs())

    def step(self, rng: random.Random) -> None:
        x = torch.randn(rng.choice([8, 32]), 17, device=DEV)
        roll = rng.random()
        same_graphs = True
        if roll < 0.05:  # reset: every graph gone, its last output with it
            self.graphed.reset()
            if self.last is not None:
                ORPHANS.append((self.last, f"{self.kind}: the last output before a reset"))
            self.last = None
            self.history.append("reset")
        elif roll < 0.1:  # a replaced parameter: a new capture; the old graph's output stays
            self.net[0].weight = nn.Parameter(self.net[0].weight.detach().clone())
            same_graphs = False
            self.history.append("parameter replaced")
        before = self.replays()
        with torch.no_grad():
            got = None
            if self.in_place and rng.random() < 0.5:
                try:
                    (buffer,), _ = self.graphed.input_buffers(x)
                except (RuntimeError, ValueError):  # no graph of this shape yet
                    pass
                else:
                    buffer.copy_(x)
                    got = self.graphed(buffer)
                    self.history.append(f"in place {tuple(x.shape)}")
            if got is None:
                got = self.graphed(x)
                self.history.append(f"call {tuple(x.shape)}")
            close(got, self.net(x), self.kind)
        lent = self.replays() > before
        self.history[-1] += f" (lent: {lent}, replays {before} -> {self.replays()})"
        del self.history[:-8]
        previous, self.last = self.last, got if lent else None
        if lent and same_graphs and previous is not None and previous.shape == got.shape:
            # its graph replayed since
            raises_on_use(previous, f"{self.kind}: steps {'; '.join(self.history)}")
        while ORPHANS:
            raises_on_use(*ORPHANS.pop())

    def __del__(self) -> None:
        if self.last is not None:
            ORPHANS.append((self.last, f"{self.kind}: the last output of a deleted wrapper"))


MAKERS: dict[str, Callable[[random.Random], Actor]] = {
    "borrowed": Borrowing,
    "plain": Plain,
    "tensordict": lambda rng: Policy(rng, keyword=False),
    "keyword": lambda rng: Policy(rng, keyword=True),
    "grad": GradMode,
    "training-step": TrainingStep,
    "buckets": lambda rng: Shapes(rng, "buckets"),
    "exact": lambda rng: Shapes(rng, "exact"),
    "failed-capture": FailedCapture,
    "compile": Compiled,
    "torch.cuda.graph": TorchGraph,
    "make_graphed_callables (torch)": lambda rng: Graphed(rng, ours=False),
    "make_graphed_callables (ours)": lambda rng: Graphed(rng, ours=True),
    "tensordict.nn.CudaGraphModule": TensorDictsClass,
}
COUNTS: Counter[str] = Counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to run")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many actions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alive", type=int, default=12, help="most actors alive at once")
    parser.add_argument("--compiles", type=int, default=6, help="most torch.compile actors")
    parser.add_argument("--verbose", action="store_true", help="print each action")
    parser.add_argument("--skip", default="", help="kinds of actors left out, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("soak: no CUDA device, nothing to run")
        return
    warnings.simplefilter("ignore")  # capturable Adam's and the trees' advice, every step
    torch._dynamo.config.cache_size_limit = 64  # each compile actor is a new module
    rng = random.Random(args.seed)
    actors: list[Actor] = []
    start = time.monotonic()
    step = 0
    while True:
        step += 1
        if args.steps and step > args.steps:
            break
        if not args.steps and time.monotonic() - start > args.seconds:
            break
        roll = rng.random()
        if roll < 0.25 and len(actors) < args.alive:
            kinds = [k for k in MAKERS if k not in args.skip.split(",")]
            if COUNTS["new compile"] >= args.compiles:
                kinds.remove("compile")
            kind = rng.choice(kinds)
            if args.verbose:
                print(f"{step}: new {kind}", flush=True)
            actors.append(MAKERS[kind](rng))
            COUNTS["new " + kind] += 1
        elif roll < 0.33 and actors:
            gone = actors.pop(rng.randrange(len(actors)))
            if args.verbose:
                print(f"{step}: delete {gone.kind}", flush=True)
            del gone
            COUNTS["deleted"] += 1
            if rng.random() < 0.5:
                gc.collect()
        elif roll < 0.36:
            if args.verbose:
                print(f"{step}: empty_cache", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            COUNTS["empty_cache"] += 1
        elif actors:
            actor = rng.choice(actors)
            if args.verbose:
                print(f"{step}: step {actor.kind} #{actors.index(actor)}", flush=True)
            actor.step(rng)
            COUNTS["step " + actor.kind] += 1
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    print(f"soak: {step - 1} actions in {elapsed:.0f} s, seed {args.seed}, every result as eager")
    for name, n in sorted(COUNTS.items()):
        print(f"  {name:40} {n}")


if __name__ == "__main__":
    main()
