"""The one switch: what ``backend="auto"`` picks for the whole process, set by
``set_default_backend`` or the ``CUDAGRAPH_TD_BACKEND`` environment variable."""

from __future__ import annotations

import re
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import cudagraph_td
from cudagraph_td import (
    CudaGraphModule,
    InputMismatchError,
    make_graphed_callables,
    set_default_backend,
)

from .conftest import HAS_CUDA, run_python

ENV = "CUDAGRAPH_TD_BACKEND"
OTHER_BATCH = (
    "CudaGraphModule was captured with args[0] of shape (8, 3), but received shape (4, 3)."
)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _called_three_times(graphed: Any) -> None:
    """A warm-up call, the capture and a replay, of batches of 8."""
    with torch.no_grad():
        for _ in range(3):
            graphed(torch.randn(8, 3))


def test_the_variable_runs_a_default_wrapper_on_the_emulation(
    monkeypatch: pytest.MonkeyPatch, no_cuda: None
) -> None:
    monkeypatch.setenv(ENV, "emulate")
    graphed = CudaGraphModule(nn.Linear(3, 2))  # no warning: the emulation was asked for
    _called_three_times(graphed)
    assert _captured(graphed) and "backend='emulate'" in repr(graphed)
    with torch.no_grad(), pytest.raises(InputMismatchError, match=re.escape(OTHER_BATCH)):
        graphed(torch.randn(4, 3))


def test_the_variable_graphs_the_callables_on_the_emulation(
    monkeypatch: pytest.MonkeyPatch, no_cuda: None
) -> None:
    monkeypatch.setenv(ENV, "emulate")
    net = nn.Linear(3, 2)
    graphed = make_graphed_callables(net, (torch.randn(8, 3),))
    graphed(torch.randn(8, 3)).sum().backward()
    assert net.weight.grad is not None
    with pytest.raises(InputMismatchError, match=re.escape("of shape (8, 3), but received")):
        graphed(torch.randn(4, 3))


def test_without_the_variable_the_default_is_eager_without_cuda(no_cuda: None) -> None:
    with pytest.warns(UserWarning, match=re.escape("set CUDAGRAPH_TD_BACKEND=emulate")):
        graphed = CudaGraphModule(nn.Linear(3, 2))
    _called_three_times(graphed)
    with torch.no_grad():
        assert graphed(torch.randn(4, 3)).shape == (4, 2)  # eager: no check
    net = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match=re.escape("set CUDAGRAPH_TD_BACKEND=emulate")):
        assert make_graphed_callables(net, (torch.randn(8, 3),)) is net


@pytest.mark.parametrize("value", ["", "auto"], ids=["empty", "auto"])
def test_an_empty_or_auto_variable_leaves_the_default(
    monkeypatch: pytest.MonkeyPatch, no_cuda: None, value: str
) -> None:
    monkeypatch.setenv(ENV, value)
    with pytest.warns(UserWarning, match=re.escape("created on a machine without CUDA")):
        graphed = CudaGraphModule(nn.Linear(3, 2))
    assert "eager (no CUDA)" in repr(graphed)


@pytest.mark.parametrize("value", ["emulated", "EMULATE", "gpu"])
def test_a_bad_variable_raises_naming_the_valid_values(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ENV, value)
    message = (
        "The environment variable CUDAGRAPH_TD_BACKEND must be one of 'cuda', 'emulate', "
        f"'eager' (or unset, or 'auto'), got {value!r}."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        CudaGraphModule(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=re.escape(message)):
        make_graphed_callables(nn.Linear(3, 2), (torch.randn(8, 3),))
    CudaGraphModule(nn.Linear(3, 2), backend="emulate")  # an explicit backend reads no switch


def test_an_explicit_backend_wins_over_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "eager")
    with set_default_backend("eager"):
        graphed = CudaGraphModule(nn.Linear(3, 2), backend="emulate")
        _called_three_times(graphed)
        assert _captured(graphed)


def test_the_function_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "eager")
    with set_default_backend("emulate"):
        assert "backend='emulate'" in repr(CudaGraphModule(nn.Linear(3, 2)))
    assert "eager (CUDAGRAPH_TD_BACKEND=eager)" in repr(CudaGraphModule(nn.Linear(3, 2)))


def test_the_switch_is_read_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    with set_default_backend("emulate"):
        graphed = CudaGraphModule(nn.Linear(3, 2))
    _called_three_times(graphed)  # built under the switch: on the emulation after it, too
    assert _captured(graphed)
    monkeypatch.setenv(ENV, "emulate")  # after the import: taken by the next wrapper
    assert "backend='emulate'" in repr(CudaGraphModule(nn.Linear(3, 2)))


def test_set_default_backend_lasts_until_the_next_call() -> None:
    try:
        set_default_backend("emulate")
        assert "backend='emulate'" in repr(CudaGraphModule(nn.Linear(3, 2)))
        with set_default_backend("eager"):  # nested: the previous comes back after it
            assert "eager (set_default_backend('eager'))" in repr(CudaGraphModule(nn.Linear(3, 2)))
        assert "backend='emulate'" in repr(CudaGraphModule(nn.Linear(3, 2)))
    finally:
        set_default_backend(None)
    with set_default_backend("emulate"), set_default_backend(None):  # None: the default again
        assert "backend='emulate'" not in repr(_quiet(lambda: CudaGraphModule(nn.Linear(3, 2))))


def test_the_eager_switch_calls_the_function_without_a_warning() -> None:
    net = nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: eager calls were asked for
        with set_default_backend("eager"):
            graphed = CudaGraphModule(net)
            assert make_graphed_callables(net, (torch.randn(8, 3),)) is net
        explicit = CudaGraphModule(net, backend="eager")
        assert make_graphed_callables(net, (torch.randn(8, 3),), backend="eager") is net
    _called_three_times(graphed)
    assert not _captured(graphed) and graphed.counter == 0
    assert "state=eager\n" in repr(explicit)


def test_a_bad_value_of_the_function_raises_naming_the_valid_ones() -> None:
    message = (
        "`set_default_backend(...)` must be one of 'cuda', 'emulate', 'eager', None, got 'auto'."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        set_default_backend("auto")  # type: ignore[arg-type]
    assert "backend='emulate'" not in repr(_quiet(lambda: CudaGraphModule(nn.Linear(3, 2))))


@pytest.mark.skipif(HAS_CUDA, reason="the error of a machine without CUDA")
@pytest.mark.parametrize("how", ["variable", "function"])
def test_the_cuda_switch_without_cuda_raises_naming_it(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    switch = "CUDAGRAPH_TD_BACKEND=cuda"
    if how == "variable":
        monkeypatch.setenv(ENV, "cuda")
    else:
        switch = "set_default_backend('cuda')"
        set_default_backend("cuda")
    try:
        message = f"CudaGraphModule: {switch} makes backend='auto' pick 'cuda', which needs CUDA"
        with pytest.raises(RuntimeError, match=re.escape(message)):
            CudaGraphModule(nn.Linear(3, 2))
        with pytest.raises(RuntimeError, match=re.escape(f"make_graphed_callables: {switch}")):
            make_graphed_callables(nn.Linear(3, 2), (torch.randn(8, 3),))
    finally:
        set_default_backend(None)


# The pytest recipe of docs/sharp-edges.md ("Testing without a GPU"): a test module whose
# wrappers, built with the defaults, run on the emulation.
@pytest.fixture
def emulated() -> Iterator[None]:
    with cudagraph_td.set_default_backend("emulate"):
        yield


def test_the_fixture_of_the_docs_runs_a_module_on_the_emulation(
    emulated: None, no_cuda: None
) -> None:
    graphed = CudaGraphModule(nn.Linear(3, 2))
    _called_three_times(graphed)
    with torch.no_grad(), pytest.raises(InputMismatchError, match=re.escape(OTHER_BATCH)):
        graphed(torch.randn(4, 3))


SCRIPT = textwrap.dedent(
    """
    import torch
    from cudagraph_td import CudaGraphModule, make_graphed_callables

    net = torch.nn.Linear(3, 2)
    graphed = CudaGraphModule(net)
    fn = make_graphed_callables(torch.nn.Linear(3, 2), (torch.randn(8, 3),))
    with torch.no_grad():
        for _ in range(3):
            graphed(torch.randn(8, 3))
    for name, call in (("module", lambda: graphed(torch.randn(4, 3))),
                       ("function", lambda: fn(torch.randn(4, 3)))):
        try:
            with torch.no_grad():
                call()
            print(name, "eager")
        except ValueError as err:
            print(name, type(err).__name__)
    """
)


@pytest.mark.skipif(HAS_CUDA, reason="the script of a machine without CUDA")
@pytest.mark.parametrize(
    ("value", "out"),
    [
        (None, "module eager\nfunction eager\n"),
        ("emulate", "module InputMismatchError\nfunction InputMismatchError\n"),
        ("emulat", None),
    ],
    ids=["unset", "emulate", "bad"],
)
def test_a_script_runs_on_the_emulation_under_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str | None, out: str | None
) -> None:
    # The script, as a user runs it: `CUDAGRAPH_TD_BACKEND=emulate python train.py`.
    if value is not None:
        monkeypatch.setenv(ENV, value)
    result = run_python("-W", "ignore::UserWarning", "-c", SCRIPT)
    if out is None:
        assert result.returncode != 0
        assert "CUDAGRAPH_TD_BACKEND must be one of 'cuda', 'emulate', 'eager'" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout == out


def _captured(graphed: CudaGraphModule) -> bool:
    return any(info.captured for info in graphed.graphs())


def _quiet(make: Any) -> Any:
    """``make()``, without the warning of a default wrapper on a machine without CUDA."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return make()
