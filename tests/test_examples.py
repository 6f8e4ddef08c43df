"""The examples run as scripts: on a GPU they capture graphs, elsewhere the eager fallback."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _run(script: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as a user would, with the repository importable; check it succeeded."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(script: pathlib.Path) -> None:
    assert "eager" in _run(script).stdout


def test_benchmark_runs_without_cuda_and_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the benchmark takes minutes: run benchmarks/run.py itself")
    result = _run(ROOT / "benchmarks" / "run.py", "--repeats", "1", "--calls", "20")
    assert "CUDA graphs need CUDA" in result.stdout
    assert "cudagraph_td" in result.stdout and "tensordict" in result.stdout
