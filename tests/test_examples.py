"""The examples run as scripts: on a GPU they capture graphs, elsewhere the eager fallback."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from typing import Any
from unittest import mock

import pytest
import torch

from cudagraph_td import CudaGraphModule

from .conftest import Backend, early

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# The examples that need torchrl, which run in CI's environment beside torchrl.
WITH_TORCHRL = {"torchrl_sac", "gpu_rollout"}


def _run(
    script: pathlib.Path, *args: str, launcher: tuple[str, ...] | list[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as a user would (through ``python *launcher``), with the repository
    importable; check it succeeded."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])
        ),
    }
    result = subprocess.run(
        [sys.executable, *launcher, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


# The scripts that run in one process of their own (tests/one_process.py): the examples
# (without torchrl's, which runs in CI's environment beside torchrl), then the developers'
# benchmark tools, the ablation last (it stubs the emulation's replays).
SCRIPTS: dict[str, tuple[pathlib.Path, tuple[str, ...]]] = {
    **{p.stem: (p, ()) for p in EXAMPLES if p.stem not in WITH_TORCHRL},
    "run": (ROOT / "benchmarks" / "run.py", ("--repeats", "1", "--calls", "20")),
    "overhead": (ROOT / "benchmarks" / "overhead.py", ("--emulate", "--calls", "32", "--rounds", "1")),
    "leanrl": (
        ROOT / "benchmarks" / "leanrl.py",
        ("--emulate", "--steps", "20", "--skip", "4", "--ppo-iterations", "5", "--rounds", "1"),
    ),
    "python_work": (ROOT / "benchmarks" / "python_work.py", ()),
    "graft": (ROOT / "benchmarks" / "graft.py", ("--rounds", "2", "--batches", "64", "--pieces")),
    "graft cold": (ROOT / "benchmarks" / "graft.py", ("--rounds", "2", "--batches", "64", "--cold", "1")),
    "launches": (ROOT / "benchmarks" / "launches.py", ("--calls", "8")),
    "ablate_checks": (ROOT / "benchmarks" / "ablate_checks.py", ("--emulate", "--all")),
}  # fmt: skip


SCRIPTS_RUN = early(
    "scripts",
    str(ROOT / "tests" / "one_process.py"),
    json.dumps([(str(path), list(args)) for path, args in SCRIPTS.values()]),
)


@pytest.fixture(scope="module")
def scripts() -> dict[str, dict[str, Any]]:
    """Each script of SCRIPTS run as ``python script *args`` would, all in one process: its
    exit code, standard output and error, by name."""
    result = SCRIPTS_RUN.result()
    assert result.returncode == 0, result.stderr
    return dict(zip(SCRIPTS, json.loads(result.stdout), strict=True))


def _out(scripts: dict[str, dict[str, Any]], name: str) -> str:
    """The standard output of script ``name``, which succeeded."""
    run = scripts[name]
    assert run["returncode"] == 0, run["stderr"]
    return str(run["stdout"])


@pytest.mark.early("scripts")
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(script: pathlib.Path, scripts: dict[str, dict[str, Any]]) -> None:
    if script.stem in WITH_TORCHRL:
        pytest.importorskip("torchrl")  # CI's environment beside torchrl runs it
        assert "eager" in _run(script).stdout
        return
    assert "eager" in _out(scripts, script.stem)


@pytest.mark.early("scripts")
def test_the_python_work_of_a_replay_is_counted(scripts: dict[str, dict[str, Any]]) -> None:
    rows = _out(scripts, "python_work").splitlines()[1:]
    assert [row.split("  ")[0] for row in rows] == [
        "a. a function of one tensor",
        "c. a policy, module(td)",
        "c. a policy, module(obs=...)",
        "c. a function, grad mode",
        "c. borrowed, in place",
        "c. borrowed, in place, (td)",
        "f. buckets, 3 rows of 4",
        "f. exact shapes",
    ]
    assert all(int(row.split()[-1]) > 0 for row in rows)  # frames entered


@pytest.mark.parametrize("kind", ["a", "td", "kw", "exact", "buckets"])
def test_the_instruction_counts_child_replays_each_kind(kind: str) -> None:
    # What valgrind counts in benchmarks/instructions.py (valgrind itself is not needed here):
    # each kind's replays, run to the end.
    path = ROOT / "benchmarks" / "instructions.py"
    done = _run(path, "--child", "now", kind, "5")
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_rollout_benchmark_runs() -> None:
    pytest.importorskip("torchrl")  # CI's environment beside torchrl runs it
    out = _run(ROOT / "benchmarks" / "rollouts.py").stdout
    assert "eager, per step" in out and "whole rollout graphed" in out


@pytest.mark.early("scripts")
def test_benchmark_runs_without_cuda_and_says_so(scripts: dict[str, dict[str, Any]]) -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the benchmark takes minutes: run benchmarks/run.py itself")
    out = _out(scripts, "run")
    assert "CUDA graphs need CUDA" in out
    assert "cudagraph_td" in out and "tensordict" in out


@pytest.mark.early("scripts")
def test_the_overhead_breakdown_follows_the_librarys_replay_path(
    scripts: dict[str, dict[str, Any]],
) -> None:
    # A developer's tool (docs/benchmarks.md) that reads the library's internals: on the
    # emulation, each step it times is still found and runs, so that it follows them.
    out = _out(scripts, "overhead")
    for step in ("(a)", "(d)", "(e)", "the replay path", "state check", "fresh outputs"):
        assert step in out
    assert "cudagraph_td: forward, backward" in out


@pytest.mark.early("scripts")
def test_the_ablation_of_the_checks_follows_the_librarys_replay_path(
    scripts: dict[str, dict[str, Any]],
) -> None:
    # As the test above, for benchmarks/ablate_checks.py (docs/benchmarks.md cites it): its
    # policy, --buckets, --borrowed and --after parts.
    out = _out(scripts, "ablate_checks")
    assert out.count("State.fresh alone") == 3  # the policy's, the buckets' and borrowed
    assert "cycled: path alone" in out and "lookup + path" in out
    assert "after a grad-mode call" in out and "after an eager forward" in out
    assert "the same without the state check" in out and "State.fresh alone (borrowed)" in out
    # Its layers of each version (the version before where benchmarks/baseline has one).
    for shapes in ("buckets", "exact"):
        for layer in ("wrapper", "lookup alone", "path alone"):
            assert f"now, {shapes}: {layer}" in out


@pytest.mark.early("scripts")
def test_the_graft_of_the_old_replay_runs_on_the_current_entries(
    scripts: dict[str, dict[str, Any]],
) -> None:
    # benchmarks/graft.py (issue 52's note): the version before's replay code grafted onto
    # the current entries and table, each variant checked against its policy eager before
    # it is timed (the script raises otherwise), both shapes, built twice.
    out = _out(scripts, "graft")
    for shapes in ("buckets", "exact"):
        for copy in ("", "#2"):
            for variant in ("now", "now, old replay", "now, old replay and lookup"):
                assert f"{shapes}: {variant}{copy} " in out
            assert f"{shapes}: now{copy}, bare replay" in out
            assert f"{shapes}: now{copy}, copy+replay+clone" in out
    # With --cold on the CPU: each call alone after a write of memory, the replays no-ops
    # once checked; a later script's replays run again (the switch is put back). On CUDA,
    # where the launches leave the caches cold themselves, the script refuses it.
    if torch.cuda.is_available():
        refused = scripts["graft cold"]
        assert refused["returncode"] != 0 and "on CUDA, time without" in refused["stderr"]
        return
    cold = _out(scripts, "graft cold")
    assert "exact: now, old replay and lookup#2 " in cold and "bare replay" not in cold


@pytest.mark.early("scripts")
def test_the_launch_count_says_it_needs_cuda(scripts: dict[str, dict[str, Any]]) -> None:
    out = _out(scripts, "launches")
    if torch.cuda.is_available():  # a row per CUDA runtime call, a column per variant
        assert "cudaGraphLaunch" in out and "cudagraph_td exact" in out
    else:
        assert "it needs CUDA" in out


@pytest.mark.early("scripts")
def test_the_leanrl_benchmark_runs_the_corpus_loops(scripts: dict[str, dict[str, Any]]) -> None:
    # benchmarks/leanrl.py times the corpus's LeanRL loops end to end (docs/benchmarks.md):
    # on the emulation, a few steps of each, so that it keeps up with the corpus harness.
    out = _out(scripts, "leanrl")
    for script in ("sac", "td3", "ppo"):
        assert f"{script}: environment steps per second" in out
    assert out.count("cudagraph_td ") == 3 and out.count("eager ") >= 3


# On CPU: two gloo processes, the graphed variants on the emulation (what CI runs); on a
# machine with two GPUs or more: two NCCL processes, a GPU each.
DDP_EXAMPLE = early(
    "ddp example",
    *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
    *(str(ROOT / "examples" / "ddp_update.py"), "--steps", "20"),
    when=not torch.cuda.is_available() or torch.cuda.device_count() >= 2,
    background=False,  # two ranks: both cores
)


@pytest.mark.early("ddp example")
def test_ddp_example_runs_on_two_processes() -> None:
    if not DDP_EXAMPLE.when:
        pytest.skip("needs two GPUs (one process per GPU); run as a script above on one")
    result = DDP_EXAMPLE.result()
    assert result.returncode == 0, result.stderr
    assert "2 ranks, 20 updates: parameters equal across variants and ranks" in result.stdout


def test_the_quickstart_tensordict_example_runs_as_written(backend: Backend) -> None:
    # The block of docs/quickstart.md as a user pastes it, on each backend.
    text = (ROOT / "docs" / "quickstart.md").read_text()
    section = text[text.index("## TensorDict modules") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    block = block[: block.index("```")]
    assert "policy = CudaGraphModule(actor)" in block and "policy(observation=obs)" in block
    namespace: dict[str, Any] = {}
    # The block picks its device by `torch.cuda.is_available()`: the backend's, here.
    with (
        mock.patch("cudagraph_td.CudaGraphModule", functools.partial(backend.wrap)),
        mock.patch("torch.cuda.is_available", lambda: backend.name == "cuda"),
    ):
        exec(compile(block, "docs/quickstart.md", "exec"), namespace)
    assert any(info.captured and info.replays for info in namespace["policy"].graphs())


def test_the_quickstart_prints_the_replays_that_graphs_counts(
    backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    # examples/quickstart.py's policy section, on each backend: the replays it prints are
    # those its wrapper's graphs() counts, and the calls before them run the Python.
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    made: list[Any] = []

    def wrap(fn: Any, **kwargs: Any) -> Any:
        made.append(CudaGraphModule(fn, **kwargs))
        return made[-1]

    with mock.patch.object(quickstart, "CudaGraphModule", wrap):
        quickstart.policy_replays(str(backend.device), backend.name)
    (graphed,) = made
    replays = sum(info.replays for info in graphed.graphs())
    assert replays == 8  # 10 calls, warmup=2
    out = " ".join(capsys.readouterr().out.split())  # its words, whatever the line breaks
    # Its words add up: 1 warm-up run and 2 at the capture are the 3 runs it counts.
    assert "Python ran 3 times: once at the warm-up call, twice at the capturing call" in out
    assert f"not at the {replays} replays" in out


def test_the_install_lines_of_the_docs_install_from_the_repository() -> None:
    # The package is on no package index: an install line that names it fails for a new user.
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *EXAMPLES]
    lines = [
        (page.name, line.strip())
        for page in pages
        for line in page.read_text().splitlines()
        if "pip install" in line
    ]
    assert any(name == "README.md" for name, _ in lines)
    for name, line in lines:
        packages = line[line.index("pip install") :].split("&&")[0].split()[2:]
        assert not {"cudagraph_td", "cudagraph-td"} & set(packages), (name, line)
