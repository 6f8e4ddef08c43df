"""The whole memory contract, in random runs: every output and buffer kept is read after each
call, and holds eager's values or raises the documented error, never other values.

One run drives wrappers that share memory as users' do: a policy's graphs of several shapes
(``Exact``) in grad and no_grad modes, its graphs of several buckets, a wrapper with fresh
outputs in the same pool, a training step of two shapes; with borrowed outputs, gradients
lent through autograd, input buffers filled in place, resets and replaced parameters (new
captures). A kept output whose graph has not replayed since must hold eager's values; one
whose graph replayed, or went, may raise the borrowed error instead. A handed-out buffer holds
what was last put into it. ``MEMORY_CONTRACT_STEPS`` sets the steps of a run (200 by
default; scripts/gpu_check.sh runs 1,000 on the GPU, and a shorter one under memcheck).
"""

from __future__ import annotations

import copy
import os
import random
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from cudagraph_td import Buckets, Exact

from .conftest import Backend, regression_step

STEPS = int(os.environ.get("MEMORY_CONTRACT_STEPS", "200"))
BORROWED = ("has overwritten it: a borrowed output", "that graph is gone")


@dataclass
class Kept:
    """A tensor kept across calls: what it must hold, and the graph whose replay may end it."""

    what: str
    tensor: torch.Tensor
    expected: torch.Tensor
    graph: tuple[Any, ...] | None  # None: never overwritten (fresh outputs, buffers)
    replays: int  # the graph's calls when it was kept
    epoch: int  # its wrapper's resets and recaptures when it was kept


class Run:
    def __init__(self, backend: Backend, seed: int):
        self.backend = backend
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh()
        )
        self.net = torch.nn.Sequential(*net, torch.nn.Linear(32, 3)).to(backend.device)
        # The gradients' eager twin: the graphed calls' autograd nodes stay apart from eager's.
        self.twin = copy.deepcopy(self.net)
        self.exact = backend.wrap(self.net, outputs="borrowed", shapes=Exact(), warmup=2)
        self.buckets = backend.wrap(self.net, outputs="borrowed", shapes=Buckets([8, 16]))
        pool = self.exact.pool() if backend.name == "cuda" else None
        self.fresh = backend.wrap(self.net, shapes=Exact(), pool=pool)
        learner = torch.nn.Linear(4, 1).to(backend.device)
        self.twin_step, _ = regression_step(backend, copy.deepcopy(learner))
        step, _ = regression_step(backend, learner)
        self.step = backend.wrap(step, outputs="borrowed", shapes=Exact())
        self.calls: dict[tuple[Any, ...], int] = {}  # each graph's calls
        self.epochs = {"exact": 0, "buckets": 0, "fresh": 0, "step": 0}
        self.kept: list[Kept] = []
        # Handed-out buffers: (rows, buffer, what the graph last copied or read into it).
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(self, what: str, tensor: torch.Tensor, expected: torch.Tensor, graph: Any) -> None:
        replays = self.calls.get(graph, 0) if graph is not None else 0
        epoch = self.epochs[graph[0]] if graph is not None else 0
        self.kept.append(Kept(what, tensor, expected.detach(), graph, replays, epoch))
        del self.kept[:-48]  # the latest ones: enough to reach across every graph

    def called(self, graph: tuple[Any, ...]) -> None:
        self.calls[graph] = self.calls.get(graph, 0) + 1

    def step_once(self) -> None:
        rng, backend = self.rng, self.backend
        roll = rng.random()
        if roll < 0.35:  # the policy, one of its shapes, in no_grad or grad mode
            rows = rng.choice([3, 5, 8])
            x = backend.randn(rows, 4)
            if rng.random() < 0.7:
                with torch.no_grad():
                    if rows in self.buffers and rng.random() < 0.5:  # its buffer, in place
                        buffer, _ = self.buffers[rows]
                        buffer.copy_(x)
                        y = self.exact(buffer)
                    else:
                        y = self.exact(x)
                    self.called(("exact", "no_grad", rows))
                    if rows in self.buffers:
                        self.buffers[rows] = (self.buffers[rows][0], x.clone())
                    self.keep("exact no_grad", y, self.net(x), ("exact", "no_grad", rows))
                    if rows not in self.buffers and rng.random() < 0.2:
                        self.hand_out(rows, x)
            else:
                y = self.exact(x)
                self.called(("exact", "grad", rows))
                with torch.no_grad():  # its storage, without the autograd graph kept alive
                    self.keep("exact grad", y.detach(), self.net(x), ("exact", "grad", rows))
                if rng.random() < 0.5:  # its backward: gradients lent too
                    self.net.zero_grad(set_to_none=True)
                    y.pow(2).sum().backward()
                    self.called(("exact", "backward", rows))
                    weight = self.net[0].weight
                    twin_weight = self.twin[0].weight
                    (expected,) = torch.autograd.grad(self.twin(x).pow(2).sum(), twin_weight)
                    assert weight.grad is not None
                    self.keep("exact gradient", weight.grad, expected, ("exact", "backward", rows))
                    self.net.zero_grad(set_to_none=True)
        elif roll < 0.62:  # the policy's buckets
            rows = rng.choice([3, 5, 8, 13, 16])
            bucket = 8 if rows <= 8 else 16
            x = backend.randn(rows, 4)
            with torch.no_grad():
                y = self.buckets(x)
                self.called(("buckets", bucket))
                self.keep("buckets", y, self.net(x), ("buckets", bucket))
        elif roll < 0.75:  # fresh outputs, in the policy's pool
            rows = rng.choice([5, 8])
            x = backend.randn(rows, 4)
            with torch.no_grad():
                self.keep("fresh", self.fresh(x), self.net(x), None)
        elif roll < 0.97:  # a training step, of two shapes
            rows = rng.choice([8, 16])
            data = TensorDict(
                obs=backend.randn(rows, 4), target=backend.randn(rows, 1), batch_size=[rows]
            )
            loss = self.step(data)["loss"]
            self.called(("step", rows))
            self.keep("step loss", loss, self.twin_step(data.clone())["loss"], ("step", rows))
        elif roll < 0.99:  # a reset: its graphs go, captured again later
            which = rng.choice(["exact", "buckets", "fresh", "step"])
            getattr(self, which).reset()
            self.epochs[which] += 1
            if which == "exact":
                self.buffers.clear()  # no longer the graph's: kept below as plain tensors
        else:  # a replaced parameter, same values: the policy's graphs are captured again
            bias = self.net[0].bias
            self.net[0].bias = torch.nn.Parameter(bias.detach().clone())
            for which in ("exact", "buckets", "fresh"):
                self.epochs[which] += 1
            self.buffers.clear()

    def hand_out(self, rows: int, x: torch.Tensor) -> None:
        try:
            (buffer,), _ = self.exact.input_buffers(x)
        except RuntimeError:  # not captured yet
            return
        self.buffers[rows] = (buffer, buffer.clone())

    def check(self) -> None:
        for rows, (buffer, content) in self.buffers.items():
            torch.testing.assert_close(buffer, content, msg=lambda m: f"buffer {rows}: {m}")  # noqa: B023
        alive = []
        for kept in self.kept:
            try:
                with torch.no_grad():
                    value = kept.tensor.detach().clone()
            except RuntimeError as err:
                assert any(text in str(err) for text in BORROWED), err
                assert kept.graph is not None, f"{kept.what}: raised, but nothing lent it"
                moved = self.calls.get(kept.graph, 0) > kept.replays
                gone = self.epochs[kept.graph[0]] > kept.epoch
                assert moved or gone, f"{kept.what} {kept.graph}: raised before its graph replayed"
                continue
            torch.testing.assert_close(
                value,
                kept.expected,
                msg=lambda m: f"{kept.what} {kept.graph}: {m}",  # noqa: B023
            )
            alive.append(kept)
        self.kept = alive


@pytest.mark.parametrize("seed", range(3))
def test_a_random_run_reads_every_kept_output_right_or_raises(backend: Backend, seed: int) -> None:
    run = Run(backend, seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "CudaGraphModule", UserWarning)  # recaptures
        # Seen only under compute-sanitizer (scripts/gpu_check.sh MEMORY=1), whose slower host
        # keeps an autograd node of an earlier step alive longer: a note on speed, not memory.
        warnings.filterwarnings("ignore", "The AccumulateGrad node's stream", UserWarning)
        for _ in range(STEPS):
            run.step_once()
            backend.sync()
            run.check()
