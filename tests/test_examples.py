"""The examples run as scripts: on a GPU they capture graphs, elsewhere the eager fallback."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(script: pathlib.Path) -> None:
    root = str(script.parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "eager" in result.stdout


def test_benchmark_runs_without_cuda_and_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the benchmark takes minutes: run benchmarks/run.py itself")
    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "run.py"
    result = subprocess.run(
        [sys.executable, str(script), "--repeats", "1", "--calls", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA graphs need CUDA" in result.stdout
    assert "cudagraph_td" in result.stdout and "tensordict" in result.stdout
