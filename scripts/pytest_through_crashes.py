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
each run runs under it: at a crash it prints every thread's native stack (faulthandler shows
only Python frames, and none of a crash in torch's C++), and the run counts as crashed.
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

CRASHED = {-11, -6, 134, 139}  # SIGSEGV, SIGABRT: as a signal, or as a shell's exit status
# `tests/test_x.py::test_y[case] PASSED   [ 12%]`, as `pytest -v` reports a test.
# An id may hold spaces (`test_x[cuda-same tensor]`).
_REPORTED = re.compile(r"^(\S+::.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?= |$)")
# gdb's line at a fatal signal: `Thread 1 "python3" received signal SIGSEGV, ...`.
_SIGNALLED = re.compile(r"received signal (SIGSEGV|SIGABRT|SIGBUS|SIGILL|SIGFPE)\b")
SIGNALLED_STATUS = -11  # a run that gdb saw crash counts as crashed, whatever gdb exits with
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


def run(args: list[str]) -> tuple[int, set[str], dict[str, int]]:
    """One pytest run, its output passed through: its exit status, the tests it reported,
    and how many of each outcome it reported (a crashed run writes no summary)."""
    command = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-v", *args]
    if os.environ.get("CRASH_STACKS") == "torch":
        command = [sys.executable, "-X", "faulthandler", "-c", _TORCH_STACKS, "-v"]
        command += ["--capture=sys", *args]
    debugger = os.environ.get("CRASH_DEBUGGER")
    if debugger:  # stops at the signal, before faulthandler: the native stacks, then out
        steps = ("-ex", "set pagination off", "-ex", "run", "-ex", "thread apply all bt 40")
        command = [debugger, "-q", "-batch", *steps, "--args", *command]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reported: set[str] = set()
    counts: dict[str, int] = {}
    signalled = False
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        if found := _REPORTED.match(line):
            reported.add(found[1])
            counts[found[2].lower()] = counts.get(found[2].lower(), 0) + 1
        signalled = signalled or bool(debugger and _SIGNALLED.search(line))
    sys.stdout.flush()
    status = process.wait()
    return (SIGNALLED_STATUS if signalled else status), reported, counts


def as_collected(reported: set[str], ids: list[str]) -> set[str]:
    """The collected ids of the tests ``reported``. Output that a test writes to the process's
    own stdout or stderr (with ``CRASH_STACKS``, which captures ``sys`` only) lands inside its
    ``-v`` line, before the outcome: that line's id is the collected one it starts with."""
    known = set(ids)
    found = {test for test in reported if test in known}
    for test in reported - found:
        starts = [i for i in ids if test.startswith(i + " ")]
        if starts:
            found.add(max(starts, key=len))
    return found


def main() -> None:
    # -v, always: its lines say which tests ran (a -q would cancel it).
    args = [a for a in sys.argv[1:] if a not in ("-q", "--quiet")]
    # The options, for the runs after a crash, which name their tests one by one.
    options = [a for a in args if a.startswith("-") or not os.path.exists(a.split("::")[0])]
    ids = collected(args)
    totals: dict[str, int] = {}
    crashed: list[str] = []
    status, reported, counts = run(args)
    while True:
        for kind, number in counts.items():
            totals[kind] = totals.get(kind, 0) + number
        if status not in CRASHED:
            break
        # The test after the last one reported was running at the crash.
        done = [k for k, test in enumerate(ids) if test in as_collected(reported, ids)]
        left = ids[done[-1] + 1 :] if done else ids
        if not left:
            break
        crashed.append(left[0])
        print(f"\n== CRASHED (exit {status}): {left[0]}; running the {len(left) - 1} after it\n")
        ids = left[1:]
        if not ids:
            break
        status, reported, counts = run([*options, *ids])
    failed = status not in (0, 5) or bool(crashed) or totals.get("failed", 0) > 0
    failed = failed or totals.get("error", 0) > 0
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(totals.items()))
    print(f"\n== through crashes: {summary}, {len(crashed)} crashed")
    for test in crashed:
        print(f"== crashed: {test}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
