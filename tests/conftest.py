"""Shared fixtures: every test body runs on the CPU emulation and, when a GPU is present, on CUDA."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from cudagraph_td import CudaGraphModule, _compat, make_graphed_callables

HAS_CUDA = torch.cuda.is_available()
NO_CUDA_REASON = "needs a CUDA device (CI has none; run scripts/gpu_check.sh on a GPU machine)"

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)


class Backend:
    """A graph backend as the tests see it: its name, its device, and a wrapper factory."""

    def __init__(self, name: str):
        self.name = name
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if name == "cuda"
            else torch.device("cpu")
        )

    def wrap(self, fn: Callable[..., Any], **kwargs: Any) -> CudaGraphModule:
        return CudaGraphModule(fn, backend=self.name, **kwargs)  # type: ignore[arg-type]

    def graph_callables(self, *args: Any, **kwargs: Any) -> Any:
        return make_graphed_callables(*args, backend=self.name, **kwargs)

    def randn(self, *shape: int, **kwargs: Any) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, **kwargs)

    def sync(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()

    def __repr__(self) -> str:
        return self.name


@pytest.fixture(
    params=[
        pytest.param("emulate", id="emulate"),
        pytest.param("cuda", id="cuda", marks=requires_cuda),
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    # One test body for both: the emulation lets capturable optimizers step on the CPU
    # inside its wrappers' calls; the eager twins of a test need the same, outside them.
    with _compat.capturable_on_cpu() if request.param == "emulate" else contextlib.nullcontext():
        yield Backend(request.param)


@pytest.fixture
def cuda() -> Backend:
    if not HAS_CUDA:
        pytest.skip(NO_CUDA_REASON)
    return Backend("cuda")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# torch's words when a random op runs outside a graph while the CUDA generator is still
# marked as capturing: a capture that ended abnormally (torch skips the generator's epilogue
# when ending an invalidated capture raises) left it so.
_MARKED_GENERATOR = "Offset increment outside graph capture"


@pytest.fixture(autouse=True)
def _cuda_left_as_found() -> Iterator[None]:
    """Each test leaves CUDA as it found it: no stream capturing, no fault pending, the CUDA
    generator not marked as capturing. Checked after each test that used CUDA, so that the
    test that left it so fails, not the tests after it (a fault is sticky: every later CUDA
    call fails; a marked generator fails every later random op outside a graph, and is
    cleared here for them)."""
    yield
    if not HAS_CUDA or not torch.cuda.is_initialized():
        return
    problems = []
    if torch.cuda.is_current_stream_capturing():
        problems.append("left the current stream capturing")
    torch.cuda.synchronize()  # a fault of this test's kernels raises here, in its teardown
    try:
        torch.randn(1, device="cuda")
    except RuntimeError as err:
        if _MARKED_GENERATOR not in str(err):
            raise
        problems.append("left the CUDA generator marked as capturing")
        with torch.cuda.stream(torch.cuda.Stream()):  # a capture that ends well clears it
            _compat.one_node_graph(torch.device("cuda", torch.cuda.current_device()))
    if problems:
        pytest.fail(f"the test {' and '.join(problems)}", pytrace=False)


@pytest.fixture(autouse=True)
def _no_backend_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each test picks its backends itself: a CUDAGRAPH_TD_BACKEND of the shell that runs the
    # suite is not theirs (tests/test_default_backend.py sets it where it tests it).
    monkeypatch.delenv("CUDAGRAPH_TD_BACKEND", raising=False)


def regression_step(backend: Backend, net: torch.nn.Module) -> tuple[Callable[..., Any], Any]:
    """A whole training step of ``net`` (capturable Adam on CUDA, tensor learning rate) on a
    TensorDict of ``obs`` and ``target``; returns the step and its optimizer."""
    opt = torch.optim.Adam(
        net.parameters(),
        lr=torch.tensor(1e-2, device=backend.device),
        capturable=True,
    )

    def update(td: TensorDict) -> TensorDict:
        opt.zero_grad(set_to_none=False)
        loss = (net(td["obs"]) - td["target"]).pow(2).mean()
        loss.backward()
        opt.step()
        return TensorDict(loss=loss.detach())

    return update, opt


def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``fn`` so that ``wrapper.calls`` counts its Python executions."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wrapper.calls += 1  # type: ignore[attr-defined]
        return fn(*args, **kwargs)

    wrapper.calls = 0  # type: ignore[attr-defined]
    return wrapper


def slow_replays(graphed: CudaGraphModule) -> list[int]:
    """Count, from now on, the calls of ``graphed`` that fell off its replay path: those
    that its slow path answered by replaying a graph captured before them (warm-ups and
    captures are not counted). The count is the list's one item."""
    count = [0]
    slow = graphed._call

    def replays() -> dict[tuple[str, str], int]:
        return {(i.mode, repr(i.key)): i.replays for i in graphed.graphs() if i.captured}

    def counted(args: Any, kwargs: Any) -> Any:
        before = replays()
        out = slow(args, kwargs)
        after = replays()
        count[0] += any(after[key] > n for key, n in before.items())
        return out

    graphed._call = counted  # type: ignore[method-assign]
    return count


def replays_as_eager(
    backend: Backend,
    graphed: Any,
    fn: Callable[..., Any],
    make_call: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
    calls: int,
    same: Callable[[Any, Any], None],
) -> list[tuple[Any, Any]]:
    """Call ``graphed`` and ``fn`` ``calls`` times on new inputs from ``make_call``, checking
    each result with ``same`` as it comes and again after the last call (later replays
    write into the graph's buffers: no earlier result may change). The (result, eager)
    pairs, in call order."""
    results = []
    for _ in range(calls):
        args, kwargs = make_call()
        expected = fn(*args, **kwargs)
        out = graphed(*args, **kwargs)
        same(out, expected)
        results.append((out, expected))
    assert graphed.is_captured
    backend.sync()
    for out, expected in results:
        same(out, expected)
    return results


def run_threads(*targets: Callable[[], None], timeout: float = 60.0) -> None:
    """Run each of ``targets`` in a thread of its own, all at once, and wait for them.

    Fails if a thread still runs after ``timeout`` seconds (they wait for each other: a
    deadlock; daemon threads, so that they do not hold the test run), else re-raises the
    first error raised in a thread.
    """
    errors: list[BaseException] = []

    def run(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as err:  # reported by the calling thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = sum(thread.is_alive() for thread in threads)
    assert not alive, f"{alive} of {len(threads)} threads still run after {timeout} s: a deadlock"
    assert not errors, errors[0]


# Figures that reliability tests measure (cases tried, memory before and after a long run),
# printed at the end of the session: "name" -> {"quantity": value}.
FIGURES: dict[str, dict[str, Any]] = {}


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a process of its own, which imports this checkout's packages:
    for what must not share a process with the other tests (a failed capture's leftovers,
    the first cuBLAS use of a process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)


class EarlyRun:
    """A command of its own process that a test reads the result of. A fresh Python importing
    torch and tensordict takes seconds of CPU: a run marked ``background`` starts before its
    test, one at a time, on the core that the tests leave free (on a two-core machine, the
    suite takes about three quarters of the time); the others start when their test reads
    them (a process of two ranks already keeps both cores busy)."""

    def __init__(self, args: list[str], *, when: bool, background: bool, timeout: float):
        self.args, self.when, self.background, self.timeout = args, when, background, timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._files: tuple[Any, Any] | None = None

    def start(self) -> None:
        if self._process is None and self.when:
            # Files, not pipes: a process that writes much would wait for its reader.
            self._files = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            if self.background:  # beside the tests: one thread, or both spin for the cores
                env["OMP_NUM_THREADS"] = "1"
            out, err = self._files
            self._process = subprocess.Popen(self.args, stdout=out, stderr=err, env=env)

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def result(self) -> subprocess.CompletedProcess[str]:
        """Wait for the process (killed past its timeout: a hang fails the test)."""
        assert self.when, "a test whose run cannot start here skips before reading it"
        self.start()
        assert self._process is not None and self._files is not None
        try:
            code = self._process.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait()
        texts = []
        for f in self._files:
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        self._files = ((), ())  # read once: the files are closed
        return subprocess.CompletedProcess(self.args, code, *texts)


# The early runs of the test modules, by name (``early``), which the tests marked
# ``@pytest.mark.early(name)`` read; those of this session's tests that wait to start.
EARLY: dict[str, EarlyRun] = {}
_WAITING: list[EarlyRun] = []


def early(
    name: str, *args: str, when: bool = True, background: bool = True, timeout: float = 300
) -> EarlyRun:
    """Register ``python *args`` as the early run ``name`` (``when``: whether it can run
    here, its tests skip otherwise; ``background``: whether it starts before its test)."""
    run = EARLY[name] = EarlyRun(
        [sys.executable, *args], when=when, background=background, timeout=timeout
    )
    return run


def _start_next() -> None:
    if not any(run.running() for run in EARLY.values()):
        while _WAITING:
            run = _WAITING.pop(0)
            if run._process is None:
                run.start()
                return


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "early(name): the test reads the early run `name`")


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker runs some of the tests it collects
        return
    for item in session.items:
        for mark in item.iter_markers("early"):
            run = EARLY[mark.args[0]]
            if run.background and run.when and run not in _WAITING:
                _WAITING.append(run)
    _start_next()


def pytest_runtest_logfinish() -> None:
    _start_next()


def record(name: str, **values: Any) -> None:
    """Add ``values`` to the figures reported under ``name``, summing counts.

    They travel in the test's report (``user_properties``), so that the summary sums them
    whichever process ran the test (pytest-xdist's workers included)."""
    _PENDING.append((name, values))


# Figures recorded by the test running in this process, not yet in its report.
_PENDING: list[tuple[str, dict[str, Any]]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    if call.when == "teardown" and _PENDING:
        outcome.get_result().user_properties.append(("figures", list(_PENDING)))
        _PENDING.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Runs where the session is reported: in the one process, or in xdist's controller.
    for key, recorded in report.user_properties:
        if key != "figures":
            continue
        for name, values in recorded:
            figures = FIGURES.setdefault(name, {})
            for k, value in values.items():
                if isinstance(value, int) and not isinstance(value, bool) and k in figures:
                    figures[k] += value
                else:
                    figures[k] = value


def pytest_terminal_summary(terminalreporter: Any) -> None:
    # The skipped tests, one line per reason (most need a GPU: run scripts/gpu_check.sh).
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else "skipped"
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("skipped tests, by reason")
        for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{count:5d}  {reason}")
    if not FIGURES:
        return
    terminalreporter.section("reliability figures (measured by tests/test_reliability.py)")
    for name, values in FIGURES.items():
        text = ", ".join(f"{key}: {value}" for key, value in values.items())
        terminalreporter.write_line(f"{name}: {text}")


def current_entry(graphed: CudaGraphModule) -> Any:
    """The entry of a ``shapes="static"`` wrapper's graph in the current mode, if any."""
    graphs = graphed._current_graphs()
    return None if graphs is None else graphs.entries.get(graphs.key)
