"""``benchmarks/mjwarp_ppo.py`` end to end on the CPU (Warp's CPU device, the emulation),
with a few worlds: where ``mujoco_warp`` is installed (CI's environments have none)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("mujoco_warp")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(*args: str) -> str:
    """``benchmarks/mjwarp_ppo.py`` with ``args``, as a user runs it; its output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    script = str(ROOT / "benchmarks" / "mjwarp_ppo.py")
    result = subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_ppo_on_mujoco_warp_runs_graphed_and_eager(tmp_path: pathlib.Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the script's defaults take minutes: run it itself")
    out = tmp_path / "ppo.json"
    _run("--seeds=0", f"--json={out}")
    found = json.loads(out.read_text())
    runs = {run["mode"]: run for run in found["runs"]}
    assert set(runs) == {"graphed", "eager"}
    for run in runs.values():
        assert run["summary"]["final_episodes"] > 0  # whole episodes of 16 steps ended
        assert run["summary"]["steps_per_s"] > 0
    # The warm-up and the capture are real iterations, and draw what eager mode draws.
    graphed, eager = (runs[m]["iterations"] for m in ("graphed", "eager"))
    for g, e in list(zip(graphed, eager, strict=True))[:2]:
        assert g["reward_per_step"] == pytest.approx(e["reward_per_step"], rel=1e-5)


def test_runs_made_apart_merge_into_one_report(tmp_path: pathlib.Path) -> None:
    # Each mode in a process of its own, then `--merge`: the same report as one process's
    # (the same returns, as both modes draw the same numbers from a seed).
    if torch.cuda.is_available():
        pytest.skip("on a GPU the script's defaults take minutes: run it itself")
    files = [tmp_path / f"{mode}.json" for mode in ("graphed", "eager")]
    for mode, path in zip(("graphed", "eager"), files, strict=True):
        _run("--seeds=0", f"--mode={mode}", f"--json={path}")
    merged = tmp_path / "merged.json"
    out = _run("--merge", *map(str, files), f"--json={merged}")
    assert "2 runs of 2 files, made apart" in out
    found = json.loads(merged.read_text())
    assert sorted(r["mode"] for r in found["runs"]) == ["eager", "graphed"]
    finals = {r["mode"]: r["summary"]["final_return"] for r in found["runs"]}
    assert finals["graphed"] == pytest.approx(finals["eager"], rel=1e-5)
    assert found["comparison"]["graphed_mean_in_eager_range"] is True
