"""tensordict's own tests of its ``CudaGraphModule`` (``TestCudaGraphs``), with ours.

Each test here re-expresses the test of the same name in pytorch/tensordict's
``test/compile/test_compile.py`` (commit ``03e84fcba6b0f87163b3271ad47700d41cb35a9f``, whose
``TestCudaGraphs`` has the checks and messages of tensordict 0.15.3, installed here; the
stored snapshot's newest tag is v0.14.0, whose class holds 7 of these 17 tests), with
``tensordict.nn.CudaGraphModule`` swapped for ``cudagraph_td.CudaGraphModule``: the same
calls and the same assertions. Each runs on the CPU emulation and on CUDA, and, on CUDA, the
same body with tensordict's class, whose outcome is recorded, not asserted.

As upstream's class fixture does, tensors made without ``device=`` are made on the GPU
when there is one, and tensordict's types are taken out of torch's pytree registry. ``compiled`` wraps
the function in ``torch.compile`` first: inductor on the GPU; on the CPU, where inductor
would spend seconds in a C++ compiler, the same Dynamo and AOTAutograd path without code
generation (``aot_eager``).

Where the upstream test pins tensordict's error messages, ours are pinned instead: the
same error types, other words. Where it reads tensordict's private attributes
(``_is_tensordict_module``, ``_out_matches_in``, ``_selected_keys``), the public behaviour
they stand for is checked (``in_keys is not None``, the entries written into the caller's
TensorDict). One test relies on a behaviour that our contract deliberately differs from:
``test_tdmodule_cpu_input_copied_before_return`` passes a CPU tensor to a graph on CUDA,
which tensordict copies and we refuse (a ``ValueError``: see the error table of the docs'
Sharp edges page). ``test_signature`` is not re-expressed: it checks the test class's own
type-check helper on a plain function, and never calls ``CudaGraphModule``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import tensordict.nn
import torch
from tensordict import LazyStackedTensorDict, TensorDict
from tensordict.nn import TensorDictModule
from tensordict.nn.functional_modules import (
    PYTREE_REGISTERED_LAZY_TDS,
    PYTREE_REGISTERED_TDS,
    _exclude_td_from_pytree,
)
from torch.utils._pytree import SUPPORTED_NODES

from cudagraph_td import CudaGraphModule

from ..conftest import Backend
from .conftest import Recorder

SOURCE = "tensordict TestCudaGraphs"

Wrap = Callable[..., Any]  # a wrapper class: ours, or tensordict's

# Warnings that torch's own code raises while Dynamo traces it (and inductor's TF32 hint).
compile_warnings = pytest.mark.filterwarnings(
    "ignore::UserWarning:torch", "ignore::DeprecationWarning:torch"
)
compiled_or_not = pytest.mark.parametrize("compiled", [False, True], ids=["eager-fn", "compiled"])


class Differs(AssertionError):
    """A result other than the one the upstream test expects (recorded as "differs")."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Differs(what)


def close(actual: Any, expected: Any, what: str = "result") -> None:
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as err:
        raise Differs(f"{what}: {err}") from None


@contextlib.contextmanager
def raises(kind: type[BaseException], match: str) -> Iterator[None]:
    """``pytest.raises`` for a body that also runs inside ``Recorder.attempt`` (pytest's
    failure is no ``Exception``): no error, or another message, is a ``Differs``."""
    try:
        yield
    except kind as err:
        check(re.search(match, str(err)) is not None, f"{kind.__name__} {err!s:.200}")
        return
    raise Differs(f"no {kind.__name__} raised")


def _passes(body: Callable[[], None]) -> bool:
    try:
        body()
    except Differs:
        return False
    return True


def run_rows(
    record: Recorder, backend: Backend, body: Callable[[Wrap, bool], None], compiled: bool
) -> None:
    """Run ``body(wrap, ours)`` with ours (asserted), then, on CUDA, with tensordict's class
    (recorded): ``ours`` says whose error messages it expects."""
    ours = functools.partial(_make_cudagraph, _ours(backend), compiled, backend)
    body(ours, True)
    record("cudagraph_td", "matches eager", backend=backend.name)
    if backend.name == "cuda":
        theirs = functools.partial(
            _make_cudagraph, tensordict.nn.CudaGraphModule, compiled, backend
        )
        with warnings.catch_warnings():  # tensordict's and torch's own, theirs to settle
            warnings.simplefilter("ignore")
            record.attempt(
                "tensordict", lambda: _passes(lambda: body(theirs, False)), backend="cuda"
            )


def _ours(backend: Backend) -> Wrap:
    return functools.partial(CudaGraphModule, backend=backend.name)


def _make_cudagraph(
    wrap: Wrap, compiled: bool, backend: Backend, func: Any, *args: Any, **kwargs: Any
) -> Any:
    if compiled:
        func = torch.compile(func, backend="inductor" if backend.name == "cuda" else "aot_eager")
    return wrap(func, *args, **kwargs)


@pytest.fixture(autouse=True)
def _as_upstream(backend: Backend) -> Iterator[None]:
    # Upstream's class fixture: with CUDA, tensors made without `device=` on the GPU; and
    # tensordict's types out of torch's pytree registry.
    excluder = None
    if any(t in SUPPORTED_NODES for t in PYTREE_REGISTERED_TDS + PYTREE_REGISTERED_LAZY_TDS):
        excluder = _exclude_td_from_pytree()
        excluder.set()
    torch._dynamo.reset()
    try:
        # A block, not `torch.set_default_device`, whose undoing would leave a CPU default
        # set (which the emulation reads: see `_emulation.host_calls`) for the tests that follow.
        with torch.device(backend.device) if backend.name == "cuda" else contextlib.nullcontext():
            yield
    finally:
        if excluder is not None:
            excluder.unset()


@compile_warnings
@compiled_or_not
def test_cudagraphs_random(record: Recorder, backend: Backend, compiled: bool) -> None:
    def body(wrap: Wrap, ours: bool) -> None:
        def func(x: torch.Tensor) -> torch.Tensor:
            return x + torch.randn_like(x)

        func = wrap(func)
        x = torch.randn(10)
        for _ in range(10):
            func(x)
        check(isinstance(func(torch.zeros(10)), torch.Tensor), "not a tensor")
        check(bool((func(torch.zeros(10)) != 0).any()), "no random numbers drawn")
        y0 = func(x)
        y1 = func(x + 1)
        check(not torch.allclose(y0, y1 + 1), "the same random numbers at two replays")

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_cudagraphs_module_rewriting_its_input_key(
    record: Recorder, backend: Backend, compiled: bool
) -> None:
    class Recurrent(torch.nn.Module):
        def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.tanh(h + x)
            return h.sum(-1, keepdim=True), h

    def body(wrap: Wrap, ours: bool) -> None:
        module = TensorDictModule(Recurrent(), in_keys=["x", "h"], out_keys=["y", "h"])
        graphed = wrap(module, warmup=2)

        def make(h: float) -> TensorDict:
            return TensorDict({"x": torch.ones(4, 3), "h": torch.full((4, 3), h)}, [4])

        for _ in range(3):
            graphed(make(0.0))
        for h in (1.0, -1.0):
            expected = module(make(h))
            result = graphed(make(h))
            close(result["y"], expected["y"], "y")
            close(result["h"], expected["h"], "h")

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_backprop(record: Recorder, backend: Backend, compiled: bool) -> None:
    def body(wrap: Wrap, ours: bool) -> None:
        x = torch.nn.Parameter(torch.ones(3))
        y = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.SGD([x, y], lr=1)

        def func() -> None:
            optimizer.zero_grad()
            z = x + y
            z = z.sum()
            z.backward()
            optimizer.step()

        func = wrap(func, warmup=4)
        for i in range(1, 11):
            torch.compiler.cudagraph_mark_step_begin()
            func()
            check(bool((x == 1 - i).all()), f"x after step {i}: {x}")
            check(bool((y == 1 - i).all()), f"y after step {i}: {y}")

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_tdmodule(record: Recorder, backend: Backend, compiled: bool) -> None:
    # Upstream also reads tensordict's private `_is_tensordict_module` (here the public
    # `in_keys is not None` it stands for, in both classes), `_out_matches_in` and
    # `_selected_keys` (here the entries written into the caller's TensorDict).
    def body(wrap: Wrap, ours: bool) -> None:
        tdmodule = wrap(TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"]))
        check(tdmodule.in_keys is not None, "not a TensorDict module")
        for i in range(10):
            td = TensorDict(x=torch.randn(()))
            tdmodule(td)
            check(bool(td["y"] == td["x"] + 1), f"call {i}: td['y']")

        tdmodule = wrap(TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"]))
        for _ in range(10):
            x = torch.randn(())
            y = tdmodule(x=x)
            check(bool(y == x + 1), "keyword call")

        tdmodule = wrap(TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"]))
        for _ in range(10):
            td = TensorDict(x=torch.randn(()))
            tdout = TensorDict()
            tdmodule(td, tensordict_out=tdout)
            check(tdout is not td and "x" not in tdout, "tensordict_out holds the input")
            check(bool(tdout["y"] == td["x"] + 1), "tensordict_out['y']")

        tdmodule = wrap(lambda td: td.set("y", td.get("x") + 1), in_keys=[], out_keys=[])
        check(tdmodule.in_keys is not None, "not a TensorDict module")
        for i in range(10):
            td = TensorDict(x=torch.randn(()))
            tdmodule(td)
            check(bool(td["y"] == td["x"] + 1), f"call {i}: td['y'] (empty in_keys)")

        tdmodule = wrap(lambda td: td.set("y", td.get("x") + 1), in_keys=["x"], out_keys=["y"])
        for _ in range(10):
            td = TensorDict(x=torch.randn(()))
            tdmodule(td)
            check(bool(td["y"] == td["x"] + 1), "td['y'] (function given in_keys)")

        tdmodule = wrap(lambda td: td.copy().set("y", td.get("x") + 1), in_keys=[], out_keys=[])
        for _ in range(10):
            td = TensorDict(x=torch.randn(()))
            tdout = tdmodule(td)
            check(tdout is not td and "y" not in td, "the input was written")
            check(bool(tdout["y"] == td["x"] + 1), "the copy's 'y'")

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_tdmodule_outputs_do_not_alias(record: Recorder, backend: Backend, compiled: bool) -> None:
    def body(wrap: Wrap, ours: bool) -> None:
        tdmodule = wrap(TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"]))
        tds = [tdmodule(TensorDict(x=torch.full((3,), float(i)), batch_size=[3])) for i in range(6)]
        for i, td in enumerate(tds):
            close(td["x"], torch.full((3,), float(i)), f"call {i}: x")
            close(td["y"], torch.full((3,), float(i + 1)), f"call {i}: y")

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_tdmodule_structure_change_raises(
    record: Recorder, backend: Backend, compiled: bool
) -> None:
    # Upstream runs it on CUDA only: tensordict's class calls the function eagerly elsewhere.
    def body(wrap: Wrap, ours: bool) -> None:
        tdmodule = wrap(TensorDictModule(lambda x, z: x + z, in_keys=["x", "z"], out_keys=["y"]))
        for _ in range(4):
            tdmodule(
                TensorDict(x=torch.randn(3), z=torch.randn(3), w=torch.randn(3), batch_size=[3])
            )
        # A key that is not an in_key may be missing.
        td = tdmodule(TensorDict(x=torch.ones(3), z=torch.ones(3), batch_size=[3]))
        close(td["y"], torch.full((3,), 2.0))
        missing = re.escape('lacks the key(s) args[0]["z"]') if ours else r"in_keys \['z'\]"
        with raises(KeyError, missing):
            tdmodule(TensorDict(x=torch.randn(3), batch_size=[3]))
        batch = re.escape("batch size [3], but received batch size [1]")
        with raises(ValueError, batch if ours else "captured with batch_size"):
            tdmodule(TensorDict(x=torch.randn(1), z=torch.randn(1), batch_size=[1]))

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_tdmodule_cpu_input_copied_before_return(
    record: Recorder, backend: Backend, compiled: bool
) -> None:
    # The caller overwrites a pinned CPU input as soon as the call returns: tensordict's
    # class copies it into the graph's CUDA buffer before returning. Ours refuses a CPU
    # tensor where the graph read a CUDA one (a ValueError, before any copy: the contract's
    # error table), so that no implicit host-to-device copy hides in a replay.
    if backend.name != "cuda":
        pytest.skip("a pinned CPU input of a graph on the GPU: needs CUDA")

    def body(wrap: Wrap, ours: bool) -> None:
        tdmodule = wrap(TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"]))
        for _ in range(4):
            tdmodule(TensorDict(x=torch.zeros(3), batch_size=[3]))
        x = torch.ones(3, device="cpu").pin_memory()
        # Keep the stream busy so that a pending copy would run after the write.
        torch.cuda._sleep(100_000_000)
        if ours:
            with raises(ValueError, re.escape('args[0]["x"]') + ".*cpu"):
                tdmodule(TensorDict(x=x, batch_size=[3]))
            torch.cuda.synchronize()
            return
        td = tdmodule(TensorDict(x=x, batch_size=[3]))
        x.fill_(100.0)
        close(td["y"], torch.full((3,), 2.0))

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_tdmodule_entry_shape_change_raises(
    record: Recorder, backend: Backend, compiled: bool
) -> None:
    def body(wrap: Wrap, ours: bool) -> None:
        tdmodule = wrap(TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"]))
        for _ in range(4):
            tdmodule(TensorDict(x=torch.zeros(3, 4), w=torch.zeros(3), batch_size=[3]))
        if ours:
            match = re.escape('args[0]["x"] of shape (3, 4), but received shape')
        else:
            match = r"entry 'x' of shape torch.Size\(\[3, 4\]\) but got shape"
        for shape in ((3, 1), (3, 5)):
            # Every captured entry is present.
            with raises(ValueError, match):
                tdmodule(TensorDict(x=torch.zeros(shape), w=torch.zeros(3), batch_size=[3]))
            # A captured entry that is not an in_key is missing.
            with raises(ValueError, match):
                tdmodule(TensorDict(x=torch.zeros(shape), batch_size=[3]))
        # Captured on a lazy stack, replayed on a dense tensordict: ours names the entry of
        # the stacked TensorDict that the graph reads.
        tdmodule = wrap(TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"]))
        for _ in range(4):
            tdmodule(
                LazyStackedTensorDict(*TensorDict(x=torch.zeros(3, 4), batch_size=[3]).unbind(0))
            )
        if ours:
            match = re.escape('args[0][0]["x"] of shape (4,), but received shape (1,)')
        with raises(ValueError, match):
            tdmodule(TensorDict(x=torch.zeros(3, 1), batch_size=[3]))

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_tdmodule_uncaptured_in_key_missing(
    record: Recorder, backend: Backend, compiled: bool
) -> None:
    # An in_key that the captured input did not hold is not reported missing (ours refused
    # it at the first call until this test: see the changelog).
    def body(wrap: Wrap, ours: bool) -> None:
        func = wrap(lambda td: td.set("y", td["x"] + 1), in_keys=["x", "unused"], out_keys=["y"])
        for _ in range(4):
            func(TensorDict(x=torch.zeros(3), w=torch.zeros(3), batch_size=[3]))
        td = func(TensorDict(x=torch.ones(3), batch_size=[3]))
        close(td["y"], torch.full((3,), 2.0))

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
@pytest.mark.parametrize("capture_lazy", [True, False], ids=["capture-lazy", "capture-dense"])
def test_tdmodule_lazy_and_dense_inputs(
    record: Recorder, backend: Backend, compiled: bool, capture_lazy: bool
) -> None:
    # Captured on a lazy stack and replayed on a dense tensordict, or the reverse (ours
    # refused the other layout until this test: see the changelog).
    def body(wrap: Wrap, ours: bool) -> None:
        def make(value: float, lazy: bool) -> Any:
            td = TensorDict(x=torch.full((2, 3), value), batch_size=[2])
            return LazyStackedTensorDict(*td.unbind(0), stack_dim=0) if lazy else td

        tdmodule = wrap(TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"]))
        for _ in range(4):
            tdmodule(make(0.0, capture_lazy))
        td = tdmodule(make(5.0, not capture_lazy))
        close(td["y"], torch.full((2, 3), 6.0))

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_non_tdmodule_shape_change_raises(
    record: Recorder, backend: Backend, compiled: bool
) -> None:
    def body(wrap: Wrap, ours: bool) -> None:
        func = wrap(lambda x: x + 1)
        for _ in range(4):
            func(torch.randn(3))
        shape = re.escape("args[0] of shape (3,), but received shape (1,)")
        with raises(ValueError, shape if ours else "captured with an input of shape"):
            func(torch.randn(1))
        func = wrap(lambda td: td["x"] + 1)
        for _ in range(4):
            func(TensorDict(x=torch.randn(3), batch_size=[3]))
        batch = re.escape("args[0] of batch size [3], but received batch size [1]")
        with raises(ValueError, batch if ours else "captured with batch_size"):
            func(TensorDict(x=torch.randn(1), batch_size=[1]))

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_td_input_non_tdmodule_writes_input(
    record: Recorder, backend: Backend, compiled: bool
) -> None:
    def body(wrap: Wrap, ours: bool) -> None:
        def func(td: TensorDict) -> TensorDict:
            return td.set("y", td.get("x") + 1)

        func = wrap(func)
        for i in range(4):
            td = TensorDict(x=torch.randn(3), batch_size=[3])
            out = func(td)
            close(out["y"], td["x"] + 1, f"call {i}")

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_repr(record: Recorder, backend: Backend, compiled: bool) -> None:
    def body(wrap: Wrap, ours: bool) -> None:
        check("warmup=3" in repr(wrap(lambda x: x + 1, warmup=3)), "repr")

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_td_input_non_tdmodule(record: Recorder, backend: Backend, compiled: bool) -> None:
    # Upstream checks tensordict's private `_is_tensordict_module`; here `in_keys`, which it
    # stands for, and the result, which upstream does not read.
    def body(wrap: Wrap, ours: bool) -> None:
        func = wrap(lambda x: x + 1)
        for i in range(10):
            td = TensorDict(a=1)
            out = func(td)
            if i == 5:
                check(func.in_keys is None, "a TensorDict module")
            close(out["a"], torch.tensor(2), f"call {i}")

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_td_input_non_tdmodule_nontensor(
    record: Recorder, backend: Backend, compiled: bool
) -> None:
    # Upstream expects the error on CUDA only (tensordict's class is eager elsewhere).
    def body(wrap: Wrap, ours: bool) -> None:
        func = wrap(lambda x, y: x + y)
        for i in range(10):
            check(bool(func(torch.zeros(()), 1.0) == 1.0), f"call {i}")
            if i == 5:
                check(func.in_keys is None, "a TensorDict module")
        changed = re.escape("args[1] = 1.0, but received 2.0")
        with raises(ValueError, changed if ours else "Varying inputs must be torch.Tensor"):
            func(torch.zeros(()), 2.0)

    run_rows(record, backend, body, compiled)


@compile_warnings
@compiled_or_not
def test_state_dict(record: Recorder, backend: Backend, compiled: bool) -> None:
    def body(wrap: Wrap, ours: bool) -> None:
        linear = wrap(torch.nn.Linear(3, 4))
        x = torch.randn(10, 3)
        for _ in range(10):
            linear(x)
        state_dict = linear.state_dict()
        if compiled:
            state_dict_get = TensorDict(state_dict).unflatten_keys(".")["_orig_mod"]
        else:
            state_dict_get = state_dict
        check("weight" in state_dict_get and "bias" in state_dict_get, "keys")
        check(state_dict_get["weight"].shape == (4, 3), "weight shape")
        check(state_dict_get["bias"].shape == (4,), "bias shape")
        linear2 = wrap(torch.nn.Linear(3, 4))
        linear2.load_state_dict(state_dict)
        close(linear(x), linear2(x))

    run_rows(record, backend, body, compiled)


@pytest.mark.parametrize("is_tensordict_module", [False, True], ids=["function", "tdmodule"])
def test_cudagraph_module_is_released_without_gc(
    record: Recorder, backend: Backend, is_tensordict_module: bool
) -> None:
    # A module-level test of the same file, beside the class: a wrapper holds no reference
    # cycle, so that it is freed as soon as it is dropped.
    def body(wrap: Wrap, ours: bool) -> None:
        module: Any
        if is_tensordict_module:
            module = TensorDictModule(lambda x: x, in_keys=["x"], out_keys=["y"])
        else:

            def module(x: torch.Tensor) -> torch.Tensor:
                return x

        gc.collect()
        gc.disable()
        try:
            wrapper = wrap(module)
            wrapper_ref = weakref.ref(wrapper)
            del wrapper
            check(wrapper_ref() is None, "the wrapper outlives its last reference")
        finally:
            gc.enable()

    run_rows(record, backend, body, compiled=False)
