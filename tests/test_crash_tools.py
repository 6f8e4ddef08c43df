"""The GPU check's crash tools work where the GPU machine needs them: ``scripts/
pytest_through_crashes.py`` counts a whole suite past a test that crashes the process, and
under a debugger (``CRASH_DEBUGGER``) or torch's fatal-signal handler (``CRASH_STACKS``)
shows that test's native stack."""

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
