"""make_graphed_callables and CudaGraphModule under autograd: values and every gradient vs eager."""

from __future__ import annotations

import copy
import itertools
import re
import warnings
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import InputMismatchError, make_graphed_callables

from .conftest import Backend, requires_cuda, run_python


def _mlp(backend: Backend, *, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(4, 16), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(16, 3))
    return nn.Sequential(*layers).to(backend.device)


def _assert_grads_equal(graphed: nn.Module, eager: nn.Module) -> None:
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_mlp_outputs_and_gradients_match_eager(backend: Backend) -> None:
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4, requires_grad=True),))
    assert graphed is net  # a module comes back, its forward replaced, as with torch's
    for _ in range(4):
        x = backend.randn(8, 4, requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        for m in (net, twin):
            m.zero_grad(set_to_none=True)
        out, expected = graphed(x), twin(x_twin)
        torch.testing.assert_close(out, expected)
        (out * expected.detach()).sum().backward()
        (expected * expected.detach()).sum().backward()
        torch.testing.assert_close(x.grad, x_twin.grad)
        _assert_grads_equal(net, twin)


class _Counting(nn.Module):
    """A linear layer scaled by a Python number, counting its forward's Python runs."""

    def __init__(self, backend: Backend):
        super().__init__()
        self.linear = nn.Linear(4, 3).to(backend.device)
        self.scale = 2.0
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.linear(x) * self.scale


def test_graphed_callables_replay_forward_and_backward_without_python(backend: Backend) -> None:
    net = _Counting(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4),))
    runs = net.runs  # the warm-ups' and the capture's
    net.scale = 3.0  # frozen at the capture, on CUDA as on the emulation
    for _ in range(3):
        x = backend.randn(8, 4)
        for m in (net, twin):
            m.zero_grad(set_to_none=True)
        out, expected = graphed(x), twin(x)
        torch.testing.assert_close(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        _assert_grads_equal(net, twin)
    assert net.runs == runs


def test_a_recurrent_network_trains_through_the_graph(backend: Backend) -> None:
    # oneDNN's LSTM kernel (the CPU's) returns its workspace for the backward in grad mode
    # only: the emulation replays each recorded operation in the grad mode of its capture.
    net = nn.LSTM(4, 8, batch_first=True).to(backend.device)
    # Not a deep copy: on CUDA, cuDNN wants the weights in one chunk, as `.to()` leaves them.
    twin = nn.LSTM(4, 8, batch_first=True).to(backend.device)
    twin.load_state_dict(net.state_dict())
    graphed = backend.wrap(lambda x: net(x)[0], warmup=2)
    for _ in range(4):
        x = backend.randn(2, 5, 4)
        out, expected = graphed(x), twin(x)[0]
        torch.testing.assert_close(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        del out  # a warm-up's result, kept into the next call: see the sharp edges page
    _assert_grads_equal(net, twin)


def test_gradients_accumulate_as_in_eager(backend: Backend) -> None:
    # torch's own returns its static gradient buffers (pytorch#181723): two backward passes
    # then accumulate into aliased memory. Ours are fresh.
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4),))
    for _ in range(3):
        x = backend.randn(8, 4)
        graphed(x).pow(2).sum().backward()
        twin(x).pow(2).sum().backward()
    _assert_grads_equal(net, twin)
    grads = [p.grad for p in net.parameters()]
    graphed(backend.randn(8, 4)).sum().backward()  # a later backward changes no earlier grad
    assert all(g is p.grad for g, p in zip(grads, net.parameters(), strict=True))


def test_gradients_taken_by_the_parameters_are_not_overwritten_by_the_next_backward(
    backend: Backend,
) -> None:
    # torch's documented loop: zero_grad(set_to_none=True), so autograd hands each backward's
    # gradients to the parameters as they are. They are fresh at each backward: a gradient
    # kept from one step is not changed by the next.
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4),))
    kept = []
    for _ in range(3):
        for model in (net, twin):
            for p in model.parameters():
                p.grad = None
        x = backend.randn(8, 4)
        graphed(x).pow(2).sum().backward()
        twin(x).pow(2).sum().backward()
        _assert_grads_equal(net, twin)
        kept.append(
            ([p.grad for p in net.parameters()], [p.grad.clone() for p in twin.parameters()])
        )
    for grads, expected in kept:
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e)


def test_tensordict_module(backend: Backend) -> None:
    net = _mlp(backend)
    module = TensorDictModule(net, in_keys=["obs"], out_keys=["value"])
    twin = copy.deepcopy(module)
    sample = TensorDict(obs=backend.randn(8, 4), batch_size=[8])
    graphed = backend.graph_callables(module, (sample,))
    for _ in range(3):
        td = TensorDict(obs=backend.randn(8, 4), batch_size=[8])
        out = graphed(td.clone())
        expected = twin(td.clone())
        torch.testing.assert_close(out["value"], expected["value"])
        out["value"].pow(2).mean().backward()
        expected["value"].pow(2).mean().backward()
    _assert_grads_equal(module, twin)


def test_keyword_arguments_and_pytrees(backend: Backend) -> None:
    w = torch.randn(4, 3, device=backend.device, requires_grad=True)
    w_twin = w.detach().clone().requires_grad_()

    def fn(x: torch.Tensor, *, extra: dict[str, Any], weight: torch.Tensor) -> dict[str, Any]:
        y = (x @ weight) * extra["scale"] + extra["shift"][0]
        return {"y": y, "argmax": y.detach().argmax(-1), "tag": "ok"}

    kwargs = {"extra": {"scale": 2.0, "shift": [backend.randn(3)]}}
    graphed = backend.graph_callables(
        fn, (backend.randn(5, 4, requires_grad=True),), sample_kwargs={**kwargs, "weight": w}
    )
    for _ in range(3):
        x = backend.randn(5, 4, requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        shift = [backend.randn(3)]
        out = graphed(x, extra={"scale": 2.0, "shift": shift}, weight=w)
        expected = fn(x_twin, extra={"scale": 2.0, "shift": shift}, weight=w_twin)
        torch.testing.assert_close(out["y"], expected["y"])
        assert out["tag"] == "ok" and not out["argmax"].requires_grad
        torch.testing.assert_close(out["argmax"], expected["argmax"])
        out["y"].sum().backward()
        expected["y"].sum().backward()
        torch.testing.assert_close(x.grad, x_twin.grad)
        torch.testing.assert_close(w.grad, w_twin.grad)


def test_several_outputs_one_not_differentiable_between_them(backend: Backend) -> None:
    # The backward copies the gradients of the differentiable outputs only (the first and
    # the last here), one of them unused by the loss; outputs may be written in place.
    net = _mlp(backend)
    twin = copy.deepcopy(net)

    def outputs(module: nn.Module) -> Any:
        def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            y = module(x)
            return y * 2, y.detach().argmax(-1), y.sum(-1)

        return fn

    graphed = backend.graph_callables(outputs(net), (backend.randn(5, 4, requires_grad=True),))
    for used in ([0], [2], [0, 2]):
        x = backend.randn(5, 4, requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        out, expected = graphed(x), outputs(twin)(x_twin)
        for a, b in zip(out, expected, strict=True):
            torch.testing.assert_close(a, b)
        assert [t.requires_grad for t in out] == [True, False, True]
        out[0].add_(1)  # as in eager: an output is the caller's to write
        expected[0].add_(1)
        sum(out[i].pow(2).sum() for i in used).backward()
        sum(expected[i].pow(2).sum() for i in used).backward()
        torch.testing.assert_close(x.grad, x_twin.grad)
        _assert_grads_equal(net, twin)


def test_callables_sharing_a_pool(backend: Backend) -> None:
    # torch's documented usage: three modules, captured together, replayed fwd 1-2-3, bwd 3-2-1.
    modules = [nn.Linear(6, 6).to(backend.device) for _ in range(3)]
    twins = copy.deepcopy(modules)
    x = backend.randn(4, 6)
    h = backend.randn(4, 6, requires_grad=True)
    graphed = backend.graph_callables(tuple(modules), ((x,), (h,), (h,)))
    assert isinstance(graphed, tuple) and len(graphed) == 3
    opt = torch.optim.SGD(itertools.chain(*(m.parameters() for m in modules)), lr=0.1)
    opt_twin = torch.optim.SGD(itertools.chain(*(m.parameters() for m in twins)), lr=0.1)
    for _ in range(5):
        data, target = backend.randn(4, 6), backend.randn(4, 6)
        for optimizer, chain in ((opt, graphed), (opt_twin, twins)):
            optimizer.zero_grad(set_to_none=True)
            out = chain[2](chain[1](chain[0](data)))
            nn.functional.mse_loss(out, target).backward()
            optimizer.step()
    for m, t in zip(modules, twins, strict=True):
        torch.testing.assert_close(m.weight, t.weight)
        torch.testing.assert_close(m.bias, t.bias)


def test_dropout_draws_new_masks_and_backward_uses_the_forwards(backend: Backend) -> None:
    drop = nn.Dropout(0.5).to(backend.device)
    graphed = backend.graph_callables(drop, (backend.randn(1000, requires_grad=True),))
    x = backend.randn(1000, requires_grad=True)
    first = graphed(x)
    first.sum().backward()
    mask = first.detach() != 0
    torch.testing.assert_close(x.grad, mask.float() * 2.0)  # the same mask as the forward's
    torch.testing.assert_close(first[mask], x.detach()[mask] * 2.0)
    second = graphed(x)
    assert not torch.equal(second != 0, mask)  # a fresh mask at each replay


def test_training_loop_tracks_the_eager_twin(backend: Backend) -> None:
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(32, 4),))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    opt_twin = torch.optim.Adam(twin.parameters(), lr=1e-2)
    for _ in range(20):
        x, target = backend.randn(32, 4), backend.randn(32, 3)
        for model, optimizer in ((graphed, opt), (twin, opt_twin)):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), target).backward()
            optimizer.step()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_gradients_kept_from_an_earlier_backward_are_not_overwritten(backend: Backend) -> None:
    # With `.grad` set to None between steps, autograd keeps the gradient tensors that the
    # backward returned: they must be new memory at each backward (one buffer per call,
    # shared by that call's gradients), never the graph's.
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4),))
    kept = []
    for _ in range(3):
        x = backend.randn(8, 4)
        net.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        graphed(x).pow(2).sum().backward()
        twin(x).pow(2).sum().backward()
        kept.append(
            ([p.grad for p in net.parameters()], [p.grad.clone() for p in twin.parameters()])
        )
    for grads, expected in kept:
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e)


def test_frozen_parameters_and_unused_inputs(backend: Backend) -> None:
    net = _mlp(backend)
    net[0].requires_grad_(False)
    twin = copy.deepcopy(net)

    def fn(x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return net(x)

    sample = (backend.randn(8, 4), backend.randn(3, requires_grad=True))
    with pytest.raises(
        ValueError,
        match=re.escape("the input args[1] requires grad, but the outputs do not depend on it"),
    ):
        backend.graph_callables(fn, sample)
    graphed = backend.graph_callables(fn, sample, allow_unused_input=True)
    unused = backend.randn(3, requires_grad=True)
    x = backend.randn(8, 4)
    graphed(x, unused).sum().backward()
    twin(x).sum().backward()
    assert unused.grad is None and net[0].weight.grad is None
    _assert_grads_equal(net, twin)


def test_module_in_the_other_training_mode_runs_eagerly(backend: Backend) -> None:
    net = _mlp(backend, dropout=0.5)
    graphed = backend.graph_callables(net, (backend.randn(8, 4),))
    x = backend.randn(8, 4)
    net.eval()
    eval_out = graphed(x)
    net.train()
    with torch.no_grad():
        net.eval()
        expected = net(x)
        net.train()
    torch.testing.assert_close(eval_out, expected)  # no dropout: the original forward ran
    assert not torch.equal(graphed(x), graphed(x))  # training mode: the graph, with dropout


def test_hooks_and_trainable_buffers_are_refused(backend: Backend) -> None:
    net = _mlp(backend)
    handle = net[1].register_forward_hook(lambda *a: None)
    with pytest.raises(
        ValueError, match=re.escape("its submodule `1` has forward hooks registered")
    ):
        backend.graph_callables(net, (backend.randn(2, 4),))
    handle.remove()
    net.register_buffer("scale", torch.ones(1, device=backend.device, requires_grad=True))
    with pytest.raises(ValueError, match=re.escape("the buffer `scale` requires grad")):
        backend.graph_callables(net, (backend.randn(2, 4),))


def test_autocast_with_its_cache_is_refused(backend: Backend) -> None:
    dtype = torch.bfloat16
    with (
        torch.autocast(backend.device.type, dtype=dtype),
        pytest.raises(RuntimeError, match=re.escape("cache_enabled=False")),
    ):
        backend.graph_callables(_mlp(backend), (backend.randn(2, 4),))
    with torch.autocast(backend.device.type, dtype=dtype, cache_enabled=False):
        net = backend.graph_callables(_mlp(backend), (backend.randn(2, 4),))
        x = backend.randn(2, 4)
        assert net(x).dtype == dtype


def test_double_backward_and_stale_backward_are_refused(backend: Backend) -> None:
    net = _mlp(backend)
    graphed = backend.graph_callables(net, (backend.randn(8, 4, requires_grad=True),))
    x = backend.randn(8, 4, requires_grad=True)
    out = graphed(x).sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out, x, create_graph=True)
    first = graphed(backend.randn(8, 4, requires_grad=True)).sum()
    second = graphed(backend.randn(8, 4, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="backward of an earlier call, after a later call"):
        first.backward()
    second.backward()  # the latest call's backward is fine


def test_invalid_sample_args(backend: Backend) -> None:
    with pytest.raises(TypeError, match=re.escape("got a list of tensors: pass a tuple")):
        backend.graph_callables(_mlp(backend), [backend.randn(2, 4)])
    with pytest.raises(TypeError, match=re.escape("got a bare tensor: pass `(x,)`")):
        backend.graph_callables(_mlp(backend), backend.randn(2, 4))
    with pytest.raises(TypeError, match=re.escape("got a dict.")):
        backend.graph_callables(_mlp(backend), {"x": backend.randn(2, 4)})
    with pytest.raises(TypeError, match="2 callables need as many sample argument tuples"):
        backend.graph_callables((_mlp(backend), _mlp(backend)), ((backend.randn(2, 4),),))


def test_without_cuda_the_callables_come_back_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudagraph_td import make_graphed_callables

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    net = nn.Linear(2, 2)
    forward = net.forward
    with pytest.warns(UserWarning, match="returned unchanged"):
        assert make_graphed_callables(net, (torch.randn(1, 2),)) is net
    assert net.forward == forward


# CudaGraphModule in grad mode goes through the same core.


def test_cuda_graph_module_in_grad_mode(backend: Backend) -> None:
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.wrap(net, warmup=2)
    for _ in range(5):
        x = backend.randn(8, 4)
        net.zero_grad()
        twin.zero_grad()
        out = graphed(x)
        assert out.requires_grad
        expected = twin(x)
        torch.testing.assert_close(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        _assert_grads_equal(net, twin)
        # Results of warm-up and capturing calls come from a side stream: kept alive into a
        # later call, torch warns once of a gradient-accumulation stream mismatch (see the
        # sharp edges page). Loops that drop the last result before the next call avoid it.
        del out
    with torch.no_grad():  # a plain graph of its own
        x = backend.randn(8, 4)
        for _ in range(3):
            out = graphed(x)
            assert not out.requires_grad
            torch.testing.assert_close(out, twin(x))
    assert "grad, train: captured" in repr(graphed) and "no_grad, train: captured" in repr(graphed)


def test_cuda_graph_module_tensordict_module_in_grad_mode(backend: Backend) -> None:
    actor = TensorDictModule(_mlp(backend), in_keys=["obs"], out_keys=["action"])
    twin = copy.deepcopy(actor)
    graphed = backend.wrap(actor, warmup=2)
    for _ in range(4):
        td = TensorDict(obs=backend.randn(8, 4), batch_size=[8])  # drops the last result
        assert graphed(td) is td and td["action"].requires_grad
        expected = twin(td.clone())
        torch.testing.assert_close(td["action"], expected["action"])
        td["action"].pow(2).mean().backward()
        expected["action"].pow(2).mean().backward()
    _assert_grads_equal(actor, twin)


def test_cuda_graph_module_with_inputs_that_require_grad(backend: Backend) -> None:
    w = torch.randn(4, 4, device=backend.device, requires_grad=True)
    graphed = backend.wrap(lambda x: torch.tanh(x @ w), warmup=1)
    for _ in range(3):
        x = backend.randn(2, 4, requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        graphed(x).sum().backward()
        grad_w = w.grad.clone()
        w.grad = None
        torch.tanh(x_twin @ w).sum().backward()
        torch.testing.assert_close(x.grad, x_twin.grad)
        torch.testing.assert_close(grad_w, w.grad)
        w.grad = None
    with pytest.raises(
        RuntimeError,
        match=re.escape("with args[0] requiring grad, but received a tensor that does not"),
    ):
        graphed(backend.randn(2, 4))


def test_cuda_graph_module_training_mode_gets_its_own_graph(backend: Backend) -> None:
    net = _mlp(backend, dropout=0.5)
    graphed = backend.wrap(net, warmup=1)
    x = backend.randn(8, 4)
    with torch.no_grad():
        train_outs = [graphed(x) for _ in range(3)]
        net.eval()
        eval_outs = [graphed(x) for _ in range(3)]
    assert not torch.equal(train_outs[1], train_outs[2])  # dropout, fresh at each replay
    with torch.no_grad():
        for out in eval_outs:
            torch.testing.assert_close(out, net(x))


def test_torch_documentation_usage_with_the_import_swapped(cuda: Backend) -> None:
    # The example of torch.cuda.make_graphed_callables's docstring, with only the import
    # changed, run beside an eager twin.
    from cudagraph_td import make_graphed_callables

    N, D_in, H, D_out = 640, 4096, 2048, 1024
    module1 = torch.nn.Linear(D_in, H).cuda()
    module2 = torch.nn.Linear(H, D_out).cuda()
    module3 = torch.nn.Linear(D_out, D_out).cuda()
    twins = [copy.deepcopy(m) for m in (module1, module2, module3)]

    loss_fn = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(
        itertools.chain(module1.parameters(), module2.parameters(), module3.parameters()), lr=0.1
    )
    twin_optimizer = torch.optim.SGD(itertools.chain(*(t.parameters() for t in twins)), lr=0.1)

    # Sample inputs used for capture
    # requires_grad state of sample inputs must match
    # requires_grad state of real inputs each callable will see.
    x = torch.randn(N, D_in, device="cuda")
    h = torch.randn(N, H, device="cuda", requires_grad=True)

    module1 = make_graphed_callables(module1, (x,))
    module2 = make_graphed_callables(module2, (h,))
    module3 = make_graphed_callables(
        module3, (torch.randn(N, D_out, device="cuda", requires_grad=True),)
    )

    real_inputs = [torch.rand_like(x) for _ in range(10)]
    real_targets = [torch.randn(N, D_out, device="cuda") for _ in range(10)]

    for data, target in zip(real_inputs, real_targets, strict=True):
        for (m1, m2, m3), opt in (
            ((module1, module2, module3), optimizer),
            (twins, twin_optimizer),
        ):
            opt.zero_grad(set_to_none=True)
            tmp = m1(data)  # forward ops run as a graph
            tmp = torch.nn.functional.relu(tmp)  # regular eager op
            tmp = m2(tmp)  # forward ops run as a graph
            tmp = torch.nn.functional.relu(tmp)  # regular eager op
            tmp = m3(tmp)  # forward ops run as a graph
            loss = loss_fn(tmp, target)
            loss.backward()  # module3's, module2's, then module1's backward run as graphs
            opt.step()
    for graphed, twin in zip((module1, module2, module3), twins, strict=True):
        torch.testing.assert_close(graphed.weight, twin.weight, rtol=1e-4, atol=1e-5)


def test_a_callable_with_nothing_to_differentiate_is_graphed(backend: Backend) -> None:
    # No parameter and no input that requires grad: torch's function graphs it, and so does
    # this one (the backward graph is empty); the outputs do not require grad.
    graphed = backend.graph_callables(nn.ReLU(), (backend.randn(8, 4),))
    for _ in range(3):
        x = backend.randn(8, 4)
        out = graphed(x)
        assert not out.requires_grad
        torch.testing.assert_close(out, x.relu())


def test_wrong_inputs_of_a_graphed_callable_are_refused(backend: Backend) -> None:
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4),))
    with pytest.raises(ValueError, match=re.escape("of shape (8, 4), but received shape (8, 5)")):
        graphed(backend.randn(8, 5))
    # It has no `reset()`: the message says what does instead.
    again = "or graph the callable again with `make_graphed_callables` for the new inputs."
    with pytest.raises(ValueError, match=re.escape(again)) as info:
        graphed(backend.randn(8, 5))
    assert "reset()" not in str(info.value)
    with pytest.raises(ValueError, match=re.escape("of dtype torch.float32, but received dtype")):
        graphed(backend.randn(8, 4).double())
    with pytest.raises(ValueError):
        graphed(backend.randn(8, 4), backend.randn(8, 4))
    x = backend.randn(8, 4)  # intact: a good call still matches eager
    torch.testing.assert_close(graphed(x), twin(x))


def test_one_graph_pair_per_sample_shape(backend: Backend) -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(backend.device)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(
        net, [(backend.randn(16, 4, requires_grad=True),), (backend.randn(5, 4),)]
    )
    # Forwards of both shapes before either backward: each pair keeps its own saved tensors.
    x16, x5 = backend.randn(16, 4, requires_grad=True), backend.randn(5, 4)
    x16_twin = x16.detach().clone().requires_grad_()
    loss = graphed(x16).pow(2).sum() + graphed(x5).sum()
    loss.backward()
    (twin(x16_twin).pow(2).sum() + twin(x5).sum()).backward()
    torch.testing.assert_close(x16.grad, x16_twin.grad)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(InputMismatchError, match=re.escape("shape")):
        graphed(backend.randn(7, 4))


def test_a_list_of_samples_must_hold_tuples() -> None:
    net = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=re.escape("or a list of such tuples")):
        make_graphed_callables(net, [(torch.randn(3, 2),), torch.randn(4, 2)], backend="emulate")


def test_a_failed_capture_of_graphed_callables_says_what_to_do() -> None:
    # What a capture failure of `make_graphed_callables` says (its CUDA path): no wrapper to
    # call again, no `reset()`.
    from cudagraph_td._errors import inputs as _errors

    err = _errors.capture_failure(
        "make_graphed_callables(f)", "capture the forward graph", ValueError("bad")
    )
    assert "call `make_graphed_callables` again once it is fixed" in str(err)
    assert "reset()" not in str(err) and "wrapper" not in str(err)
    wrapper_err = _errors.capture_failure("CudaGraphModule", "capture the graph", ValueError("bad"))
    assert "call `reset()` to start the warm-up again" in str(wrapper_err)


class _Rows(nn.Module):
    """Parameterless, as in torch's tests of its function: a dict in (one entry unused), a
    dict out, the input's rows in reverse order, by a gather at indices made in the forward."""

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = inputs["x"]
        rows = torch.arange(x.shape[0] - 1, -1, -1, device=x.device)
        return {"output": x.gather(0, rows.unsqueeze(1).expand_as(x))}


@pytest.mark.parametrize("allow_unused_input", [False, True], ids=["used-only", "allow-unused"])
def test_inputs_that_require_grad_where_the_samples_do_not(
    backend: Backend, allow_unused_input: bool
) -> None:
    # torch's `test_graph_make_graphed_callables_parameterless_nograd_module`: samples that
    # do not require grad, calls with inputs that do. Torch's function replays the forward
    # and returns outputs that require grad (its autograd node's); so does this one, and a
    # backward through them is refused: no gradient was captured for those inputs.
    model = nn.Sequential(_Rows())
    twin = copy.deepcopy(model)
    x, unused = backend.randn(8, 5), backend.randn(8, 3)
    model[0] = backend.graph_callables(
        model[0], ({"x": x, "unused_input": unused},), allow_unused_input=allow_unused_input
    )
    theirs = None
    if backend.name == "cuda":
        # torch's own warnings are theirs to settle: raised as errors inside its capture, they
        # would leave it unended (see tests/corpus/test_torch_graphed_callables.py).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = torch.cuda.make_graphed_callables(
                copy.deepcopy(twin[0]),
                ({"x": x, "unused_input": unused},),
                allow_unused_input=allow_unused_input,
            )
    for _ in range(3):
        data = torch.rand_like(x, requires_grad=True)
        out = model({"x": data, "unused_input": unused})["output"]
        expected = twin({"x": data, "unused_input": unused})["output"]
        torch.testing.assert_close(out, expected)
        assert out.requires_grad and expected.requires_grad
        if theirs is not None:
            their_out = theirs({"x": data, "unused_input": unused})["output"]
            torch.testing.assert_close(out, their_out)
            assert their_out.requires_grad
        with pytest.raises(RuntimeError, match=re.escape('with args[0]["x"] requiring grad')):
            out.sum().backward()
        assert data.grad is None
    with torch.no_grad():  # no autograd node: nothing to refuse
        data = torch.rand_like(x, requires_grad=True)
        torch.testing.assert_close(
            model({"x": data, "unused_input": unused})["output"], data.flip(0)
        )
    model.eval()  # captured in training mode: eval runs the original forward
    torch.testing.assert_close(model({"x": x})["output"], twin({"x": x})["output"])


def test_an_input_that_requires_grad_where_its_sample_does_not_refuses_the_backward(
    backend: Backend,
) -> None:
    # torch's function would run the parameters' backward and leave `x.grad` None: a wrong
    # gradient, silently. The forward replays, as torch's; the backward says why it cannot.
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4),))
    x = backend.randn(8, 4, requires_grad=True)
    out = graphed(x)
    torch.testing.assert_close(out, twin(x))
    message = "backward through a call with args[0] requiring grad, where the samples did not"
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        out.pow(2).sum().backward()
    assert "samples that require grad where the real inputs do" in str(info.value)
    assert x.grad is None and all(p.grad is None for p in net.parameters())
    y = backend.randn(8, 4)  # the graph is intact: a call as captured trains as eager
    graphed(y).pow(2).sum().backward()
    twin(y).pow(2).sum().backward()
    _assert_grads_equal(net, twin)


def test_an_input_that_no_longer_requires_grad_gets_no_gradient(backend: Backend) -> None:
    # As torch's: the captured backward computes a gradient for it, which autograd drops.
    net = _mlp(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4, requires_grad=True),))
    for _ in range(2):
        x = backend.randn(8, 4)
        out, expected = graphed(x), twin(x)
        torch.testing.assert_close(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        assert x.grad is None
        _assert_grads_equal(net, twin)


# torch's documented loop ("Partial-network capture" in torch's CUDA graphs notes), in a
# process of its own: torch warns of a gradient-accumulation stream mismatch once per process.
_DOCUMENTED_LOOP = """
import copy, itertools, sys, warnings
import torch
from torch import nn
import cudagraph_td

warnings.filterwarnings("error", "The AccumulateGrad node's stream does not match")
torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(True)
torch.manual_seed(0)
module1 = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU()).cuda()
module2 = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16)).cuda()
twin1, twin2 = copy.deepcopy(module1), copy.deepcopy(module2)
x = torch.randn(32, 64, device="cuda")
h = torch.randn(32, 128, device="cuda", requires_grad=True)
if sys.argv[1] == "make_graphed_callables":
    graphed1 = cudagraph_td.make_graphed_callables(module1, (x,))
    graphed2 = cudagraph_td.make_graphed_callables(module2, (h,))
else:
    graphed1 = cudagraph_td.CudaGraphModule(module1, warmup=2)
    graphed2 = cudagraph_td.CudaGraphModule(module2, warmup=2)
params = itertools.chain(module1.parameters(), module2.parameters())
optimizer = torch.optim.SGD(params, lr=0.1)
twin_optimizer = torch.optim.SGD(itertools.chain(twin1.parameters(), twin2.parameters()), lr=0.1)
for step in range(6):
    data, target = torch.rand_like(x), torch.randn(32, 16, device="cuda")
    for model1, model2, opt in ((graphed1, graphed2, optimizer), (twin1, twin2, twin_optimizer)):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model2(model1(data)), target)
        loss.backward()
        opt.step()
for p, q in zip(optimizer.param_groups[0]["params"], twin_optimizer.param_groups[0]["params"]):
    torch.testing.assert_close(p, q)
print("ok")
"""


@requires_cuda
@pytest.mark.parametrize("tool", ["make_graphed_callables", "CudaGraphModule"])
def test_torchs_documented_loop_trains_as_eager_without_a_stream_mismatch(tool: str) -> None:
    # Autograd ties each parameter's gradient accumulation to a stream: if it were the
    # capture's side stream, every backward would synchronise with it (and torch warns).
    done = run_python("-c", _DOCUMENTED_LOOP, tool)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
