"""Run pytest to the end even where a test crashes the process (a segmentation fault).

A crash ends a run: the tests after it never run, and a GPU call yields no count of them.
This runs ``python -m pytest -v ARGS``, and after a crash runs again the tests that pytest
collected after the one that crashed (the test after the last one reported), until every
test has run. Its output is pytest's, run after run (``-v`` lines, which
``scripts/test_pairs.py`` reads), then one line per crash and a summary:

    python3 scripts/pytest_through_crashes.py tests src/cudagraph_td -p no:cacheprovider

Exit status: 0 if every run passed, 1 if a test failed or crashed. A ``-q`` among the
arguments is dropped (the ``-v`` lines say which tests ran). The tests after a crash run in a
fresh process: what earlier tests left behind is gone there.

With ``CRASH_DEBUGGER`` set to a gdb (``/usr/local/cuda/bin/cuda-gdb`` on the GPU machine),
each run runs under it: at a crash it prints the crashed thread's registers and the
instructions at the fault, and every thread's native stack (faulthandler shows only Python
frames, and none of a crash in torch's C++), and the run counts as crashed.
A debugger slows a CUDA run (the suite's first 57% took 380 s under cuda-gdb on an H200) and
can hide a crash that depends on timing. ``CRASH_STACKS=torch`` costs nothing until the
crash: torch's own fatal-signal handler (``torch._C._set_print_stack_traces_on_fatal_signal``)
prints every thread's native stack, and pytest captures ``sys`` only (``--capture=sys``), so
that what the handler writes to the process's stderr is not lost with the captured output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

CRASHED = {-11, -6, 134, 139}  # SIGSEGV, SIGABRT: as a signal, or as a shell's exit status
# `tests/test_x.py::test_y[case] PASSED   [ 12%]`, as `pytest -v` reports a test.
# An id may hold spaces (`test_x[cuda-same tensor]`).
_REPORTED = re.compile(r"^(\S+::.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?= |$)")
# The outcome that ends a test's `-v` line: `PASSED   [ 12%]`, `SKIPPED (reason) [ 3%]`.
_OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?: \(.*\))? *(?:\[ *\d+%\])?$")
# pytest's last line: `=== 3 passed, 1 skipped, 2 warnings in 0.12s (0:00:00) ===`.
_SUMMARY = re.compile(r"^=+ (.+) in [\d.]+s\b.*=+$")
_KINDS = {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "error"}
_KINDS |= {"errors": "error", "xfailed": "xfail", "xpassed": "xpass"}
# gdb's line at a fatal signal: `Thread 1 "python3" received signal SIGSEGV, ...`.
_SIGNALLED = re.compile(r"received signal (SIGSEGV|SIGABRT|SIGBUS|SIGILL|SIGFPE)\b")
SIGNALLED_STATUS = -11  # a run that gdb saw crash counts as crashed, whatever gdb exits with
# What gdb prints where the run stopped at a fatal signal: the crashed thread's registers and
# the instructions at the fault (which field of which object it read: a crash inside
# Python's own loop has no other trace of it), then every thread's native stack.
_AT_THE_FAULT = ("-ex", "info registers", "-ex", "x/8i $pc", "-ex", "thread apply all bt 40")
# pytest, with torch's handler of fatal signals printing every thread's native stack.
_TORCH_STACKS = (
    "import sys, torch; torch._C._set_print_stack_traces_on_fatal_signal(True); "
    "import pytest; sys.exit(pytest.main(sys.argv[1:]))"
)


def collected(args: list[str]) -> list[str]:
    """The ids of the tests that ``args`` select, in pytest's order."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()
    return [line for line in listed if "::" in line and not line.startswith(" ")]


def _test_of(line: str, ids: list[str]) -> str | None:
    """The collected id that a ``-v`` line starts with (the longest: ids may hold spaces)."""
    if "::" not in line:
        return None
    starts = [i for i in ids if line == i or line.startswith(i + " ")]
    return max(starts, key=len) if starts else None


def _reported_id(line: str) -> str | None:
    """The id that a ``-v`` line with its outcome starts with (nothing collected to match)."""
    found = _REPORTED.match(line)
    return found[1] if found else None


class VerboseLines:
    """Reads ``pytest -v`` output a line at a time: a test's line is its id, then its
    outcome. Output that the test writes to the process's own stdout or stderr (a C++
    warning, which ``CRASH_STACKS`` lets through: it captures ``sys`` only) lands between the two, on that line or on
    lines of its own: the outcome still counts for the id before it. ``id_of`` gives the id
    that a line starts with, if any."""

    def __init__(self, id_of: Callable[[str], str | None]):
        self._id_of = id_of
        self._running: str | None = None  # the test whose line has begun and not yet ended

    def read(self, line: str) -> tuple[str, str] | None:
        """``(id, outcome)`` where ``line`` ends a test's line, else None."""
        text = line
        if test := self._id_of(line):
            self._running, text = test, line[len(test) :]
        elif line.startswith("="):  # pytest's section lines: no test's line goes on past one
            self._running = None
        outcome = _OUTCOME.search(text) if self._running else None
        if self._running is None or outcome is None:
            return None
        test, self._running = self._running, None
        return test, outcome[1]


def _summary(line: str) -> dict[str, int] | None:
    """The counts of pytest's last line (``== 3 passed, 1 skipped in 0.1s ==``), if it is."""
    if not (found := _SUMMARY.match(line.strip())):
        return None
    counts: dict[str, int] = {}
    for number, word in re.findall(r"(\d+) (\w+)", found[1]):
        if word in _KINDS:
            counts[_KINDS[word]] = counts.get(_KINDS[word], 0) + int(number)
    return counts


def run(args: list[str], ids: list[str]) -> tuple[int, set[str], dict[str, int]]:
    """One pytest run of the tests ``ids``, its output passed through: its exit status, the
    tests it reported, and how many of each outcome: pytest's own summary where the run
    ended, else (a crashed run writes none) its ``-v`` lines (`VerboseLines`).
    """
    command = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-v", *args]
    if os.environ.get("CRASH_STACKS") == "torch":
        command = [sys.executable, "-X", "faulthandler", "-c", _TORCH_STACKS, "-v"]
        command += ["--capture=sys", *args]
    debugger = os.environ.get("CRASH_DEBUGGER")
    if debugger:  # stops at the signal, before faulthandler: what crashed, then out
        steps = ("-ex", "set pagination off", "-ex", "run", *_AT_THE_FAULT)
        command = [debugger, "-q", "-batch", *steps, "--args", *command]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reported: set[str] = set()
    counts: dict[str, int] = {}
    summary: dict[str, int] | None = None
    lines = VerboseLines(lambda text: _test_of(text, ids) if ids else _reported_id(text))
    signalled = False
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        text = line.rstrip("\n")
        if ended := lines.read(text):
            reported.add(ended[0])
            counts[ended[1].lower()] = counts.get(ended[1].lower(), 0) + 1
        summary = _summary(text) or summary
        signalled = signalled or bool(debugger and _SIGNALLED.search(line))
    sys.stdout.flush()
    status = process.wait()
    return (SIGNALLED_STATUS if signalled else status), reported, summary or counts


def main() -> None:
    # -v, always: its lines say which tests ran (a -q would cancel it).
    args = [a for a in sys.argv[1:] if a not in ("-q", "--quiet")]
    # The options, for the runs after a crash, which name their tests one by one.
    options = [a for a in args if a.startswith("-") or not os.path.exists(a.split("::")[0])]
    ids = collected(args)
    totals: dict[str, int] = {}
    crashed: list[str] = []
    status, reported, counts = run(args, ids)
    while True:
        for kind, number in counts.items():
            totals[kind] = totals.get(kind, 0) + number
        if status not in CRASHED:
            break
        # The test after the last one reported was running at the crash.
        done = [k for k, test in enumerate(ids) if test in reported]
        left = ids[done[-1] + 1 :] if done else ids
        if not left:
            break
        crashed.append(left[0])
        print(f"\n== CRASHED (exit {status}): {left[0]}; running the {len(left) - 1} after it\n")
        ids = left[1:]
        if not ids:
            break
        status, reported, counts = run([*options, *ids], ids)
    failed = status not in (0, 5) or bool(crashed) or totals.get("failed", 0) > 0
    failed = failed or totals.get("error", 0) > 0
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(totals.items()))
    print(f"\n== through crashes: {summary}, {len(crashed)} crashed")
    for test in crashed:
        print(f"== crashed: {test}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
