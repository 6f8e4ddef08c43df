"""Inputs that share memory, for a function that writes into its inputs.

A graph works on its own copy of each input: a write into one input is not seen through
another input that shares its memory, as it is in eager mode. Such a call is refused, with
an error naming both inputs; a call of a function that writes no input, or of inputs that
share a tensor's memory without overlapping, replays as usual.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import InputMismatchError

from .conftest import Backend


def _message(name: str, written: str, other: str) -> str:
    return (
        f"{name} received {written} and {other} in overlapping memory, and its graph writes "
        f"into {written} in place."
    )


def _add_then_read(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a.add_(1)
    return b * 2


def _same_tensor(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return base, base


def _overlapping_views(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return base[:6], base[4:]


def _interleaved_columns(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Columns 1-3 and 2-4 of a matrix: rows interleave, and columns 2 and 3 are shared.
    matrix = base.view(2, 5)
    return matrix[:, 1:4], matrix[:, 2:5]


ALIASED = {
    "same tensor": _same_tensor,
    "overlapping views": _overlapping_views,
    "interleaved columns": _interleaved_columns,
}


def _apart(backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """Two inputs of the shapes of `_overlapping_views`, each in memory of its own."""
    return backend.randn(6), backend.randn(6)


@pytest.mark.parametrize("aliased", ALIASED.values(), ids=ALIASED.keys())
def test_inputs_that_overlap_a_written_input_are_refused(
    backend: Backend, aliased: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
) -> None:
    graphed = backend.wrap(_add_then_read, warmup=2)
    for _ in range(2):  # the warm-up and the capturing call run the function eagerly
        base = backend.randn(10)
        twin = base.clone()
        out = graphed(*aliased(base))
        torch.testing.assert_close(out, _add_then_read(*aliased(twin)))
        torch.testing.assert_close(base, twin)
    base = backend.randn(10)
    before = base.clone()
    with pytest.raises(
        InputMismatchError, match=re.escape(_message("CudaGraphModule", "args[0]", "args[1]"))
    ) as info:
        graphed(*aliased(base))
    assert (info.value.path, info.value.received) == ("args[0]", "memory shared with args[1]")
    assert "`.clone()`" in str(info.value)
    torch.testing.assert_close(base, before)  # refused before anything was copied
    # The wrapper is still usable: calls of separate tensors replay, as eager.
    a, b = (t.clone() for t in aliased(backend.randn(10)))
    a_twin, b_twin = a.clone(), b.clone()
    torch.testing.assert_close(graphed(a, b), _add_then_read(a_twin, b_twin))
    torch.testing.assert_close((a, b), (a_twin, b_twin))
    assert graphed.is_captured


def test_inputs_apart_at_capture_then_aliased_then_apart(backend: Backend) -> None:
    graphed = backend.wrap(_add_then_read, warmup=2)
    for aliased in (False, False, False, True, False, True, False):
        if aliased:
            x = backend.randn(6)
            with pytest.raises(InputMismatchError, match=re.escape("args[0] and args[1]")):
                graphed(x, x)
            continue
        a, b = _apart(backend)
        a_twin, b_twin = a.clone(), b.clone()
        torch.testing.assert_close(graphed(a, b), _add_then_read(a_twin, b_twin))
        torch.testing.assert_close((a, b), (a_twin, b_twin))


def test_inputs_aliased_at_capture_then_apart_replay_as_eager(backend: Backend) -> None:
    # The capturing call's inputs overlap: it runs eagerly, and the graph, captured on
    # copies, answers later calls of separate tensors. Only the written input is written
    # back to the caller: the other one, which shared its version counter at capture, is
    # left alone, as eager mode leaves it (autograd checks that no one wrote a tensor that
    # it saved for a backward).
    graphed = backend.wrap(_add_then_read, warmup=2)
    for _ in range(2):
        base = backend.randn(10)
        twin = base.clone()
        torch.testing.assert_close(
            graphed(*_overlapping_views(base)), _add_then_read(*_overlapping_views(twin))
        )
    for _ in range(3):
        a, b = _apart(backend)
        a_twin, b_twin = a.clone(), b.clone()
        weight = torch.ones(6, device=backend.device, requires_grad=True)
        loss = (weight * b).sum()  # saves `b` for its backward
        torch.testing.assert_close(graphed(a, b), _add_then_read(a_twin, b_twin))
        torch.testing.assert_close((a, b), (a_twin, b_twin))
        loss.backward()
        torch.testing.assert_close(weight.grad, b)


def test_views_of_one_tensor_that_do_not_overlap_replay(backend: Backend) -> None:
    graphed = backend.wrap(_add_then_read, warmup=2)
    for _ in range(4):
        base = backend.randn(12)
        twin = base.clone()
        out = graphed(base[:6], base[6:])
        torch.testing.assert_close(out, _add_then_read(twin[:6], twin[6:]))
        torch.testing.assert_close(base, twin)


def test_interleaved_views_that_share_no_element_replay(backend: Backend) -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.mul_(2)
        return a + b

    graphed = backend.wrap(step, warmup=2)
    for _ in range(4):
        matrix = backend.randn(3, 4)
        twin = matrix.clone()
        out = graphed(matrix[:, ::2], matrix[:, 1::2])  # even and odd columns
        torch.testing.assert_close(out, step(twin[:, ::2], twin[:, 1::2]))
        torch.testing.assert_close(matrix, twin)


def test_a_function_that_writes_no_input_replays_aliased_inputs(backend: Backend) -> None:
    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    graphed = backend.wrap(product, warmup=2)
    for _ in range(4):
        x = backend.randn(5)
        torch.testing.assert_close(graphed(x, x), x * x)
    assert graphed.is_captured


def test_tensordict_entries_that_alias(backend: Backend) -> None:
    def step(td: TensorDict) -> torch.Tensor:
        td["obs"].add_(1)
        return td["next", "obs"] * 2

    def call(x: torch.Tensor, y: torch.Tensor) -> TensorDict:
        return TensorDict(obs=x, next=TensorDict(obs=y, batch_size=[3]), batch_size=[3])

    graphed = backend.wrap(step, warmup=2)
    for _ in range(3):
        x, y = backend.randn(3), backend.randn(3)
        x_twin, y_twin = x.clone(), y.clone()
        torch.testing.assert_close(graphed(call(x, y)), step(call(x_twin, y_twin)))
        torch.testing.assert_close((x, y), (x_twin, y_twin))
    x = backend.randn(3)
    message = _message("CudaGraphModule", 'args[0]["obs"]', 'args[0]["next", "obs"]')
    with pytest.raises(InputMismatchError, match=re.escape(message)):
        graphed(call(x, x))  # a step's observation and the next one's: one tensor


def test_consolidated_tensordict_entries_replay(backend: Backend) -> None:
    # A consolidated TensorDict keeps its entries in one storage, apart from each other.
    def step(td: TensorDict) -> torch.Tensor:
        td["h"].mul_(0.5)
        return td["h"] + td["obs"]

    graphed = backend.wrap(step, warmup=2)
    for _ in range(4):
        td = TensorDict(h=backend.randn(4, 2), obs=backend.randn(4, 2), batch_size=[4])
        td = td.consolidate(device=backend.device)  # on CUDA, else it comes back on the CPU
        twin = td.clone()
        torch.testing.assert_close(graphed(td), step(twin))
        torch.testing.assert_close(td["h"], twin["h"])


def test_tensordict_module_in_keys_that_alias(backend: Backend) -> None:
    class Normalise(nn.Module):
        def forward(self, obs: torch.Tensor, next_obs: torch.Tensor) -> torch.Tensor:
            obs.sub_(obs.mean())  # in place
            return next_obs * 2

    module = TensorDictModule(Normalise(), in_keys=["obs", ("next", "obs")], out_keys=["out"])
    graphed = backend.wrap(module, warmup=2)

    def td_of(x: torch.Tensor, y: torch.Tensor) -> TensorDict:
        return TensorDict(obs=x, next=TensorDict(obs=y, batch_size=[4]), batch_size=[4])

    for _ in range(4):  # warm-up, capture, then replays through the module's replay path
        x, y = backend.randn(4, 2), backend.randn(4, 2)
        td, twin = td_of(x, y), td_of(x.clone(), y.clone())
        torch.testing.assert_close(graphed(td).to_dict(), module(twin).to_dict())
    x = backend.randn(4, 2)
    before = x.clone()
    message = _message("CudaGraphModule", 'args[0]["obs"]', 'args[0]["next", "obs"]')
    with pytest.raises(InputMismatchError, match=re.escape(message)):
        graphed(td_of(x, x))
    torch.testing.assert_close(x, before)


def test_grad_mode_graph_refuses_aliased_inputs(backend: Backend) -> None:
    # A module's forward and backward captured for autograd, writing a recurrent input.
    net = nn.Linear(3, 3).to(backend.device)

    def step(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h.mul_(0.5)
        return net(x + h)

    twin = nn.Linear(3, 3).to(backend.device)
    twin.load_state_dict(net.state_dict())

    def eager(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h.mul_(0.5)
        return twin(x + h)

    graphed = backend.wrap(step, warmup=2)
    for _ in range(4):
        h, x = backend.randn(2, 3), backend.randn(2, 3)
        h_twin = h.clone()
        out, expected = graphed(h, x), eager(h_twin, x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(h, h_twin)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(net.weight.grad, twin.weight.grad)
        del out, expected  # no autograd graph of a call alive at the next (see Gradients)
    x = backend.randn(2, 3)
    with pytest.raises(InputMismatchError, match=re.escape("args[0] and args[1]")):
        graphed(x, x)


def _graphed_add_then_read(backend: Backend) -> tuple[Any, torch.Tensor]:
    weight = torch.ones(3, device=backend.device, requires_grad=True)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return b * weight

    return backend.graph_callables(fn, (backend.randn(3), backend.randn(3))), weight


def test_graphed_callables_write_inputs_back_and_refuse_aliased_ones(backend: Backend) -> None:
    graphed, weight = _graphed_add_then_read(backend)
    for _ in range(3):  # an input updated in place reaches the caller, as in eager mode
        a, b = backend.randn(3), backend.randn(3)
        a_twin = a.clone()
        out = graphed(a, b)
        torch.testing.assert_close(out, b * weight)
        torch.testing.assert_close(a, a_twin + 1)
        out.sum().backward()
        torch.testing.assert_close(weight.grad, b)
        weight.grad = None
    x = backend.randn(3)
    before = x.clone()
    name = "make_graphed_callables(_graphed_add_then_read.<locals>.fn)"
    with pytest.raises(InputMismatchError, match=re.escape(_message(name, "args[0]", "args[1]"))):
        graphed(x, x)
    torch.testing.assert_close(x, before)


def _foreach_write(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    x = x + 1
    torch._foreach_copy_([buf], [x.unsqueeze(-1).expand_as(buf)])
    return x


def _trajectory_write(state: TensorDict, traj: TensorDict) -> TensorDict:
    # A rollout's transitions written into a preallocated buffer (`update_` copies with one
    # foreach copy), and the state carried by the returned TensorDict.
    x = state["x"]
    for k in range(traj.shape[1]):
        x = x + 1
        traj[:, k].update_(TensorDict(obs=x, batch_size=x.shape))
    state["x"] = x
    return state


def test_writes_by_a_foreach_copy_reach_the_callers_input(backend: Backend) -> None:
    # The emulation's recording runs under a dispatch mode, where torch leaves the version
    # counters of a foreach operation's tensors as they were: the writes were missed, and
    # every replay left the buffer as the capture did, silently.
    graphed = backend.wrap(_foreach_write, warmup=2)
    buf, x = torch.zeros(3, 4, device=backend.device), torch.zeros(3, device=backend.device)
    for i in range(5):
        x = graphed(x, buf)
        torch.testing.assert_close(buf, torch.full((3, 4), i + 1.0, device=backend.device))

    graphed = backend.wrap(_trajectory_write, warmup=2)
    traj = TensorDict(obs=torch.zeros(3, 4, device=backend.device), batch_size=[3, 4])
    state = TensorDict(x=torch.zeros(3, device=backend.device), batch_size=[3])
    for i in range(5):
        state = graphed(state, traj)
        expected = torch.arange(4 * i + 1, 4 * i + 5, device=backend.device, dtype=torch.float)
        torch.testing.assert_close(traj["obs"], expected.expand(3, 4))
        torch.testing.assert_close(
            state["x"], torch.full((3,), 4.0 * (i + 1), device=backend.device)
        )
