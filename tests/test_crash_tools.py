"""The GPU check's crash tools work where the GPU machine needs them: ``scripts/
pytest_through_crashes.py`` counts a whole suite past a test that crashes the process, and
under a debugger (``CRASH_DEBUGGER``) or torch's fatal-signal handler (``CRASH_STACKS``)
shows that test's native stack; ``scripts/test_pairs.py`` pairs each test body's outcomes
on the two backends from such a log."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "pytest_through_crashes.py"

# A suite with a test that crashes the process (ctypes reads address 0), one that fails, and
# one whose id holds a space.
SUITE = """
import ctypes
import pytest

def test_before():
    pass

def test_crashes():
    ctypes.string_at(0)

@pytest.mark.parametrize("case", ["with space"])
def test_after(case):
    pass

def test_fails():
    assert False
"""


# With torch's handler (``CRASH_STACKS``) pytest captures ``sys`` only: what a test writes to
# the process's stdout itself lands inside its ``-v`` line.
NOISY_SUITE = """
import ctypes
import os

def test_noisy():
    os.write(1, b"noise ")

def test_warns():
    os.write(1, b"warned\\n")  # as a C++ warning prints, on a line of its own

def test_crashes():
    ctypes.string_at(0)

def test_after():
    pass
"""


def _through_crashes(
    folder: pathlib.Path, suite: str = SUITE, **env: str
) -> subprocess.CompletedProcess[str]:
    (folder / "test_suite.py").write_text(suite)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "-q", "-p", "no:cacheprovider", "test_suite.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_a_crash_is_named_and_the_tests_after_it_run(tmp_path: pathlib.Path) -> None:
    run = _through_crashes(tmp_path)
    assert run.returncode == 1, run.stdout
    assert "== through crashes: 1 failed, 2 passed, 1 crashed" in run.stdout, run.stdout
    assert "== crashed: test_suite.py::test_crashes" in run.stdout
    assert "test_suite.py::test_after[with space] PASSED" in run.stdout  # -q dropped: -v lines


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb")
def test_under_a_debugger_a_crash_shows_its_native_stack(tmp_path: pathlib.Path) -> None:
    run = _through_crashes(tmp_path, CRASH_DEBUGGER=str(shutil.which("gdb")))
    assert run.returncode == 1, run.stdout
    assert "received signal SIGSEGV" in run.stdout, run.stdout
    assert "string_at" in run.stdout  # the native frame that crashed
    # The registers and the instruction that faulted (gdb marks it with `=>`).
    assert re.search(r"^rip +0x[0-9a-f]+", run.stdout, re.M), run.stdout
    assert re.search(r"^=> 0x[0-9a-f]+", run.stdout, re.M), run.stdout
    assert "== through crashes: 1 failed, 2 passed, 1 crashed" in run.stdout, run.stdout
    assert "== crashed: test_suite.py::test_crashes" in run.stdout


def test_with_torchs_handler_a_crash_shows_every_threads_native_stack(
    tmp_path: pathlib.Path,
) -> None:
    run = _through_crashes(tmp_path, CRASH_STACKS="torch")
    assert run.returncode == 1, run.stdout
    assert "SIGSEGV(11)" in run.stdout, run.stdout  # torch's handler, past pytest's capture
    assert "_ctypes" in run.stdout  # the native frames of the crash
    assert "== through crashes: 1 failed, 2 passed, 1 crashed" in run.stdout, run.stdout
    assert "== crashed: test_suite.py::test_crashes" in run.stdout


def test_output_inside_a_tests_line_does_not_move_the_crash_to_it(tmp_path: pathlib.Path) -> None:
    run = _through_crashes(tmp_path, NOISY_SUITE, CRASH_STACKS="torch")
    assert "test_suite.py::test_noisy noise PASSED" in run.stdout, run.stdout
    assert "test_suite.py::test_warns warned\nPASSED" in run.stdout, run.stdout
    assert "== crashed: test_suite.py::test_crashes" in run.stdout, run.stdout
    assert "== through crashes: 3 passed, 1 crashed" in run.stdout, run.stdout


# A `-v` log as a run under `CRASH_STACKS` writes it: a C++ warning between a test's id and
# its outcome, and a crash (whose test has no outcome).
PAIRED_LOG = """\
tests/test_a.py::test_x[emulate-1] PASSED [  1%]
tests/test_a.py::test_x[cuda-1] W1129 07:14:23 torch/_logging/_internal.py:1279] ignored
PASSED [  2%]
tests/test_a.py::test_y[emulate] SKIPPED (needs a GPU) [  3%]
tests/test_a.py::test_y[cuda] FAILED [  4%]
tests/test_a.py::test_z[cuda]
== CRASHED (exit -11): tests/test_a.py::test_z[cuda]; running the 1 after it
PASSED [  5%]
tests/test_a.py::test_z[emulate] PASSED [  6%]
"""


def test_pairs_count_an_outcome_that_a_warning_moved_to_a_line_of_its_own() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import test_pairs
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert test_pairs.pairs(PAIRED_LOG) == {
        "tests/test_a.py::test_x[1]": {"emulate": "PASSED", "cuda": "PASSED"},
        "tests/test_a.py::test_y": {"emulate": "SKIPPED", "cuda": "FAILED"},
        "tests/test_a.py::test_z": {"emulate": "PASSED"},
    }
