"""torch's own tests of ``torch.cuda.make_graphed_callables``, with ours.

Each test here re-expresses a test of pytorch/pytorch's ``test/test_cuda.py`` whose name holds
``make_graphed_callables`` (commit ``000e43cdff99f30291164c1f2e90133f19fa83fb``, the version
the file index serves: the repository's snapshot, with its tags, is too large to fetch here,
so the v2.11.0 file could not be singled out), with ``torch.cuda.make_graphed_callables``
swapped for ``cudagraph_td.make_graphed_callables``: the same modules, samples and calls, and
what torch's test asserts (parameters after training, outputs, gradients equal to the eager
twin's), plus the losses and outputs of every call, which torch's test does not compare.
Each runs on the CPU emulation (small sizes, autocast on the CPU) and on CUDA (torch's sizes),
and, on CUDA, the same body with torch's function, whose outcome is recorded, not asserted.

torch's ``test_graph_make_graphed_callables`` runs, in that file, only the two settings it
expects to fail (``unittest.expectedFailure``): autocast with its cache enabled, and an unused
input that requires grad without ``allow_unused_input``. Both raise with ours too (the
unused input with a ``ValueError`` that names it, where torch's fails in autograd with a
``RuntimeError``). The two settings under which its body passes, the others that its sibling
``..._parameterless_nograd_module`` runs, are added as rows of their own.
Under autocast, the body passes each module the half-precision activation of the one before
it, where the samples are float32: torch's function copies it into the float32 sample's
buffer; ours refuses another dtype than the samples' (a ``ValueError``, as for every input:
the error table of the docs' Sharp edges page), and matches eager once the samples have the
dtype that the calls pass.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ..conftest import Backend
from .conftest import Recorder, same

SOURCE = "torch test_cuda.py"

Make = Callable[..., Any]  # a make_graphed_callables: ours, or torch's

# Upstream's subtests: (with_amp, cache_enabled, allow_unused_input), named as torch names them.
SETTINGS = {
    "with_amp_cache_enabled_allow_unused_input": (True, True, True),
    "without_amp_not_allow_unused_input": (False, False, False),
    "without_amp_allow_unused_input": (False, False, True),
    "with_amp_cache_disabled_allow_unused_input": (True, False, True),
}


def _settings(*names: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("setting", [SETTINGS[n] for n in names], ids=names)


def _sizes(backend: Backend) -> tuple[int, int, int, int]:
    """``N, D_in, H, D_out``: torch's on the GPU, small ones for the emulation."""
    return (640, 4096, 2048, 1024) if backend.name == "cuda" else (64, 48, 32, 16)


def _seed() -> None:
    torch.manual_seed(5)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(5)


def _autocast(backend: Backend, with_amp: bool, cache_enabled: bool) -> Any:
    return torch.amp.autocast(
        device_type=backend.device.type, enabled=with_amp, cache_enabled=cache_enabled
    )


def _ours(backend: Backend) -> Make:
    return backend.graph_callables


class MLP1(torch.nn.Module):
    def __init__(self, d_in: int, h: int, d_out: int):
        super().__init__()
        self.net_1 = torch.nn.Sequential(torch.nn.Linear(d_in, h), torch.nn.Dropout(p=0.1))
        self.net_2 = torch.nn.Sequential(torch.nn.Linear(h, d_out), torch.nn.Dropout(p=0.2))

    def forward(self, input_dict: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net_2(self.net_1(input_dict["x"]))


class MLP2(torch.nn.Module):
    def __init__(self, d_in: int, h: int, d_out: int):
        super().__init__()
        self.net_1 = torch.nn.Sequential(torch.nn.Linear(d_in, h), torch.nn.Dropout(p=0.1))
        self.net_2 = torch.nn.Sequential(torch.nn.Linear(h, d_out), torch.nn.Dropout(p=0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net_2(self.net_1(x))


def _rows(x: torch.Tensor) -> dict[str, torch.Tensor]:
    idx = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
    return {"output": torch.gather(x, 0, idx)}


class ParameterlessModule(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return _rows(x)


class ParameterlessDictModule(torch.nn.Module):
    def forward(self, input_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _rows(input_dict["x"])


def _stress(
    make: Make, backend: Backend, setting: tuple[bool, bool, bool], sample_dtype: Any = None
) -> tuple[Any, Any]:
    """torch's ``test_graph_make_graphed_callables``: four callables graphed together (two
    modules, a parameterless module and two functions), trained ten steps beside an eager
    twin. Returns each one's losses, parameters after training and eval-mode output.

    ``sample_dtype``: the dtype of the samples of the callables that the calls pass
    autocast's activations (torch's test: float32).
    """
    with_amp, cache_enabled, allow_unused_input = setting
    n, d_in, h_size, d_out = _sizes(backend)
    device = backend.device
    _seed()
    model_graphed, model_control = (
        torch.nn.Sequential(
            MLP1(d_in, h_size, h_size), MLP2(h_size, h_size, d_out), ParameterlessModule()
        ).to(device)
        for _ in range(2)
    )
    model_graphed.load_state_dict(model_control.state_dict())
    opt_graphed = torch.optim.SGD(model_graphed.parameters(), lr=0.1)
    opt_control = torch.optim.SGD(model_control.parameters(), lr=0.1)

    dtype = {"dtype": sample_dtype} if sample_dtype is not None else {}
    x = torch.randn(n, d_in, device=device)
    h = torch.randn(n, h_size, device=device, requires_grad=True, **dtype)
    h2 = torch.randn(n, d_out, device=device, requires_grad=True, **dtype)
    unused_input = torch.randn(n, h_size, device=device, requires_grad=True)
    y_pred = torch.randn(n, d_out, device=device, requires_grad=True, **dtype)
    y = torch.randn(n, d_out, device=device)
    loss_fn_control = torch.nn.functional.mse_loss
    relu_control = torch.nn.functional.relu

    with _autocast(backend, with_amp, cache_enabled):
        (
            model_graphed[0],
            model_graphed[1],
            model_graphed[2],
            relu_graphed,
            loss_fn_graphed,
        ) = make(
            (model_graphed[0], model_graphed[1], model_graphed[2], relu_control, loss_fn_control),
            (({"x": x, "unused_input": unused_input},), (h,), (h2,), (y_pred,), (y_pred, y)),
            allow_unused_input=allow_unused_input,
        )

    real_inputs = [torch.rand_like(x) for _ in range(10)]
    real_targets = [torch.rand_like(y) for _ in range(10)]
    results = []
    for m, opt, relu, loss_fn in zip(
        (model_graphed, model_control),
        (opt_graphed, opt_control),
        (relu_graphed, relu_control),
        (loss_fn_graphed, loss_fn_control),
        strict=True,
    ):
        # The same random state for both: dropout draws the same masks.
        _seed()
        losses = []
        for data, target in zip(real_inputs, real_targets, strict=True):
            opt.zero_grad(set_to_none=True)
            with _autocast(backend, with_amp, cache_enabled):
                out = m({"x": data, "unused_input": unused_input})["output"]
                out = relu(out)
                loss = loss_fn(out, target)
                loss.backward()
            opt.step()
            losses.append(loss.detach())
        results.append([losses, [p.detach().clone() for p in m.parameters()]])
    # Graphed in training mode: eval runs the modules' own forward.
    for m, result in zip((model_graphed, model_control), results, strict=True):
        m.eval()
        result.append(m({"x": real_inputs[0]}))
    return results[0], results[1]


def _parameterless(
    make: Make, backend: Backend, setting: tuple[bool, bool, bool]
) -> tuple[Any, Any]:
    """torch's ``test_graph_make_graphed_callables_parameterless_nograd_module``: samples
    that do not require grad, calls whose inputs do. Returns each twin's outputs (and
    whether they require grad) and its eval-mode output."""
    with_amp, cache_enabled, allow_unused_input = setting
    n, d_in, h_size, _ = _sizes(backend)
    device = backend.device
    _seed()
    model_graphed, model_control = (
        torch.nn.Sequential(ParameterlessDictModule()).to(device) for _ in range(2)
    )
    model_graphed.load_state_dict(model_control.state_dict())
    x = torch.randn(n, d_in, device=device, requires_grad=False)
    unused_input = torch.randn(n, h_size, device=device, requires_grad=False)
    y = torch.randn(n, d_in, device=device)

    with _autocast(backend, with_amp, cache_enabled):
        model_graphed[0] = make(
            model_graphed[0],
            ({"x": x, "unused_input": unused_input},),
            allow_unused_input=allow_unused_input,
        )

    real_inputs = [torch.rand_like(x, requires_grad=True) for _ in range(10)]
    real_targets = [torch.rand_like(y) for _ in range(10)]
    results = []
    for m in (model_graphed, model_control):
        _seed()
        outs = []
        for data, _ in zip(real_inputs, real_targets, strict=True):
            with _autocast(backend, with_amp, cache_enabled):
                out = m({"x": data, "unused_input": unused_input})["output"]
            outs.append((out, out.requires_grad))
        m.eval()
        results.append([outs, m({"x": real_inputs[0]})])
    return results[0], results[1]


def _same_pool(make: Make, backend: Backend) -> tuple[Any, Any]:
    """torch's ``test_graph_make_graphed_callables_same_pool``: three models graphed into one
    memory pool (the emulation has none: ``pool=None``). Returns each twin's outputs,
    losses, parameters and gradients; fails if a graphed model shares a parameter's or a
    gradient's memory with its twin."""
    _seed()
    models = [
        torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128)
        ).to(backend.device)
        for _ in range(3)
    ]
    mempool = torch.cuda.graph_pool_handle() if backend.name == "cuda" else None
    graphed_models = []
    for model in models:
        x = torch.randn([64, 32], device=backend.device)
        graphed_model = copy.deepcopy(model)
        graphed_models.append(make(graphed_model, (x,), pool=mempool))

    graphed, eager = [], []
    for model, graphed_model in zip(models, graphed_models, strict=True):
        x = torch.randn([64, 32], device=backend.device)
        y = model(x)
        yg = graphed_model(x)
        loss = y.norm()
        loss_g = yg.norm()
        loss.backward()
        loss_g.backward()
        eager.append([y, loss, *[(p, p.grad) for p in model.parameters()]])
        graphed.append([yg, loss_g, *[(p, p.grad) for p in graphed_model.parameters()]])
        for p, pg in zip(model.parameters(), graphed_model.parameters(), strict=True):
            assert p.grad is not None and pg.grad is not None
            assert p.data_ptr() != pg.data_ptr()
            assert p.grad.data_ptr() != pg.grad.data_ptr()
    return graphed, eager


def _torch_too(record: Recorder, backend: Backend, body: Callable[[Make], tuple[Any, Any]]) -> None:
    """On CUDA, the same body with torch's function: its outcome recorded. torch's own
    warnings are theirs to settle: the suite's "error" filter would raise one inside torch's
    capture (its AccumulateGrad stream warning, once a process, from its warm-up's side
    stream), which then leaves the capture unended and the CUDA generator marked as
    capturing, and fails the tests after it."""
    if backend.name == "cuda":
        make = torch.cuda.make_graphed_callables
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            record.attempt("torch", lambda: same(*body(make)), backend="cuda")


@_settings(
    "with_amp_cache_enabled_allow_unused_input",
    "without_amp_not_allow_unused_input",
    "without_amp_allow_unused_input",
    "with_amp_cache_disabled_allow_unused_input",
)
def test_graph_make_graphed_callables(
    record: Recorder, backend: Backend, setting: tuple[bool, bool, bool]
) -> None:
    with_amp, cache_enabled, allow_unused_input = setting
    ours = _ours(backend)
    if with_amp and cache_enabled:
        # An expected failure upstream: torch's function refuses autocast's cache; ours too.
        with pytest.raises(RuntimeError, match=re.escape("under autocast with its cache enabled")):
            _stress(ours, backend, setting)
        record(
            "cudagraph_td",
            "raises",
            "RuntimeError: autocast's cache refused, as torch's",
            backend=backend.name,
        )
    elif not allow_unused_input:
        # An expected failure upstream: an input that requires grad, which the outputs do
        # not depend on. torch's function fails in autograd (a RuntimeError); ours names
        # the input before any warm-up (a ValueError).
        message = 'make_graphed_callables(MLP1): the input args[0]["unused_input"] requires grad'
        with pytest.raises(ValueError, match=re.escape(message)):
            _stress(ours, backend, setting)
        record(
            "cudagraph_td",
            "raises",
            "ValueError naming the unused input (torch's fails)",
            backend=backend.name,
        )
    elif with_amp:
        # MLP2 gets MLP1's half-precision output where its sample is float32: ours refuses
        # the dtype (torch's casts it into the sample's buffer); with samples of the dtype
        # the calls pass, ours matches the eager twin.
        half = torch.get_autocast_dtype(backend.device.type)
        message = (
            f"MLP2) was captured with args[0] of dtype torch.float32, but received dtype {half}"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            _stress(ours, backend, setting)
        graphed, control = _stress(ours, backend, setting, sample_dtype=half)
        torch.testing.assert_close(graphed, control)
        record(
            "cudagraph_td",
            "raises",
            f"ValueError: float32 samples, {half} calls (by design); samples of the calls' "
            "dtype match eager",
            backend=backend.name,
        )
    else:
        graphed, control = _stress(ours, backend, setting)
        torch.testing.assert_close(graphed, control)
        record("cudagraph_td", "matches eager", backend=backend.name)
    _torch_too(record, backend, lambda make: _stress(make, backend, setting))


@_settings(
    "without_amp_allow_unused_input",
    "with_amp_cache_disabled_allow_unused_input",
    "with_amp_cache_enabled_allow_unused_input",
    "without_amp_not_allow_unused_input",
)
def test_graph_make_graphed_callables_parameterless_nograd_module(
    record: Recorder, backend: Backend, setting: tuple[bool, bool, bool]
) -> None:
    # Inputs that require grad where the samples do not: the forward replays, and its
    # outputs require grad, as torch's (a backward through them is refused: see
    # tests/test_autograd.py). With autocast's cache, an expected failure upstream: refused.
    with_amp, cache_enabled, _ = setting
    if with_amp and cache_enabled:
        with pytest.raises(RuntimeError, match=re.escape("with its cache enabled")):
            _parameterless(_ours(backend), backend, setting)
        record(
            "cudagraph_td",
            "raises",
            "RuntimeError: autocast's cache refused, as torch's",
            backend=backend.name,
        )
    else:
        graphed, control = _parameterless(_ours(backend), backend, setting)
        torch.testing.assert_close(graphed, control)
        record("cudagraph_td", "matches eager", backend=backend.name)
    _torch_too(record, backend, lambda make: _parameterless(make, backend, setting))


def test_graph_make_graphed_callables_same_pool(record: Recorder, backend: Backend) -> None:
    graphed, eager = _same_pool(_ours(backend), backend)
    torch.testing.assert_close(graphed, eager)
    record("cudagraph_td", "matches eager", backend=backend.name)
    _torch_too(record, backend, lambda make: _same_pool(make, backend))
