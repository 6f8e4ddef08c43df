"""One process, every kind of CUDA graph: cudagraph_td's (captured and failed), torch's own
(``torch.cuda.graph``, ``torch.cuda.make_graphed_callables``), ``torch.compile``'s CUDA graph
trees and tensordict's ``CudaGraphModule``. None may break another, nor random ops or cuBLAS."""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable

import pytest
import tensordict.nn
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import CudaGraphModule, _compat, capture_stream, make_graphed_callables

from .conftest import requires_cuda, run_python


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)).cuda()


def _eager_work() -> None:
    """Random ops and cuBLAS outside any graph: what a broken capture state would fail."""
    a = torch.randn(128, 128, device="cuda")
    b = torch.nn.functional.dropout(torch.rand(128, 128, device="cuda"), 0.5)
    c = (a @ b).relu()
    torch.testing.assert_close(c, (a.cpu() @ b.cpu()).relu().cuda(), rtol=1e-3, atol=1e-3)


@requires_cuda
# The other libraries' own warnings (torch.compile's, tensordict's) are theirs to settle.
@pytest.mark.filterwarnings("ignore:::torch", "ignore:::tensordict")
def test_every_kind_of_graph_lives_beside_the_others() -> None:
    # torch's own graphs below (its make_graphed_callables, torch.cuda.graph by hand) capture
    # on torch.cuda.graph's one capture stream, and use the cuBLAS workspace found there. An
    # earlier test's graphs of torch's may have made it, in a pool released with them: once
    # torch.compile's recordings below free the workspaces, that memory goes back to the
    # device, and torch's graphs here write into it (a launch failure in the hand-made graph
    # on an H200, with tests/corpus run just before this file). torch's hazard, not this
    # library's (its graphs use workspaces of their own pool): the test starts without it.
    _compat.clear_cublas_workspaces()
    torch.manual_seed(0)
    checks: list[Callable[[], None]] = []

    # cudagraph_td: a TensorDict policy, a function with keywords, a training step.
    policy_net = _mlp()
    policy = CudaGraphModule(TensorDictModule(policy_net, in_keys=["obs"], out_keys=["act"]))

    def check_policy() -> None:
        with torch.no_grad():
            td = policy(TensorDict(obs=torch.randn(32, 8, device="cuda"), batch_size=[32]))
            torch.testing.assert_close(td["act"], policy_net(td["obs"]))

    checks.append(check_policy)

    net, twin = _mlp(), None
    twin = copy.deepcopy(net)
    opt = torch.optim.Adam(net.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=True)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-3)

    def step(x: torch.Tensor, *, y: torch.Tensor, model: nn.Module = net, o=opt) -> torch.Tensor:
        o.zero_grad(set_to_none=False)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        o.step()
        return loss.detach()

    graphed_step = CudaGraphModule(step)

    def check_step() -> None:
        x, y = torch.randn(32, 8, device="cuda"), torch.randn(32, 4, device="cuda")
        loss = graphed_step(x, y=y)
        torch.testing.assert_close(loss, step(x, y=y, model=twin, o=twin_opt), rtol=1e-4, atol=1e-5)

    checks.append(check_step)

    # cudagraph_td: captures that fail (a host sync), retried: each must leave no trace.
    def check_failed_capture() -> None:
        broken = CudaGraphModule(lambda x: x * x.sum().item(), warmup=1)
        with pytest.raises(RuntimeError, match="could not capture the graph"):
            broken(torch.randn(4, device="cuda"))

    checks.append(check_failed_capture)

    # cudagraph_td's make_graphed_callables and torch's, on twins.
    ours_net, torch_net = _mlp(), None
    torch_net = copy.deepcopy(ours_net)
    sample = (torch.randn(16, 8, device="cuda", requires_grad=True),)
    ours = make_graphed_callables(ours_net, sample)
    theirs = torch.cuda.make_graphed_callables(torch_net, sample)

    def check_graphed_callables() -> None:
        x = torch.randn(16, 8, device="cuda", requires_grad=True)
        a, b = ours(x), theirs(x)
        torch.testing.assert_close(a, b)
        (ga,) = torch.autograd.grad(a.sum(), x)
        (gb,) = torch.autograd.grad(b.sum(), x)
        torch.testing.assert_close(ga, gb)

    checks.append(check_graphed_callables)

    # torch.cuda.graph by hand.
    static_x = torch.randn(64, 8, device="cuda")
    hand_net = _mlp()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            hand_net(static_x)  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = hand_net(static_x)

    def check_hand_graph() -> None:
        x = torch.randn(64, 8, device="cuda")
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            torch.testing.assert_close(static_y, hand_net(x))

    checks.append(check_hand_graph)

    # torch.compile's CUDA graph trees.
    compiled_net = _mlp()
    compiled = torch.compile(compiled_net, mode="reduce-overhead")

    def check_compiled() -> None:
        with torch.no_grad():
            x = torch.randn(32, 8, device="cuda")
            out = compiled(x).clone()  # its outputs are overwritten by its next run
            torch.testing.assert_close(out, compiled_net(x))

    checks.append(check_compiled)

    # tensordict's own CudaGraphModule.
    td_net = _mlp()
    theirs_td = tensordict.nn.CudaGraphModule(
        TensorDictModule(td_net, in_keys=["obs"], out_keys=["act"]), warmup=2
    )

    def check_tensordict() -> None:
        with torch.no_grad():
            td = theirs_td(TensorDict(obs=torch.randn(32, 8, device="cuda"), batch_size=[32]))
            torch.testing.assert_close(td["act"], td_net(td["obs"]))

    checks.append(check_tensordict)

    for round_ in range(6):  # the first rounds capture, the others replay, interleaved
        for i, check in enumerate(checks):
            check()
            _eager_work()
            torch.cuda.synchronize()
            assert not torch.cuda.is_current_stream_capturing(), (round_, i)


@requires_cuda
def test_captures_leave_alone_the_workspaces_that_other_graphs_use() -> None:
    # torch's graphs may use a cuBLAS workspace that they do not own (see the script): a
    # capture of this library clears no workspace, so it frees none under them.
    script = pathlib.Path(__file__).with_name("workspace_owners.py")
    done = run_python(str(script), "cudagraph_td")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@requires_cuda
def test_a_workspace_made_elsewhere_on_the_capture_stream_is_not_captured() -> None:
    # Cleared (by torch.compile's trees, say), then made again by eager work on the capture
    # stream (a stream of torch's pool is handed out again every 32 streams), the stream's
    # workspace is ordinary memory: a graph captured with it would write into other tensors.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
    graphed = CudaGraphModule(net, warmup=2)
    x = torch.randn(128, 64, device="cuda")
    stream = capture_stream()
    with torch.no_grad():
        graphed(x)  # the warm-up
        torch._C._cuda_clearCublasWorkspaces()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            net(x)  # eager products on the capture stream: a workspace in ordinary memory
        torch.cuda.current_stream().wait_stream(stream)
        graphed(x)  # the capture
        torch._C._cuda_clearCublasWorkspaces()  # that workspace goes back to tensors
        with torch.cuda.stream(stream):  # the allocator reuses a block on its stream
            fillers = [torch.full((n << 20,), float("nan"), device="cuda") for n in (8, 8, 1)]
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            x = torch.randn(128, 64, device="cuda")
            torch.testing.assert_close(graphed(x), net(x))
    torch.cuda.synchronize()
    assert all(bool(f.isnan().all()) for f in fillers), "a replay wrote into other tensors"
