"""Find the test files whose tests, run before a test in one process, make it crash it.

A test that passes alone can crash the process (a segmentation fault) after others, through
state that they leave behind (CUDA's, torch's, the library's). This runs the test after
halves of the test files collected before it, keeping the half that still crashes it, until
one file is left or both halves are needed:

    python3 scripts/bisect_crash.py "tests/test_sharing.py::test_a_workspace_priming_that_breaks_its_capture_leaves_random_ops_working"

``--files`` gives the files to bisect (default: every file of ``tests/`` that pytest collects
before the target's, in its order); the pytest options after ``--`` go to every run. Each
run is a process of its own, with Python's faulthandler on: its last lines are printed.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from pytest_through_crashes import CRASHED, collected


def crashes(files: list[str], target: str, options: list[str]) -> bool:
    """Whether ``target`` run after the tests of ``files`` crashes the process."""
    command = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(
        [*command, *options, *files, target], capture_output=True, text=True, check=False
    )
    tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
    print(f"{len(files)} files: exit {run.returncode}: {' / '.join(tail)}"[:400], flush=True)
    return run.returncode in CRASHED


def files_before(target: str) -> list[str]:
    """The test files that pytest collects before ``target``'s file, in its order."""
    files = list(dict.fromkeys(test.split("::")[0] for test in collected(["tests"])))
    return files[: files.index(target.split("::")[0])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="the test id that crashes after the others")
    parser.add_argument("--files", nargs="*", help="the files to bisect (default: those before)")
    args, options = parser.parse_known_args()
    options = [o for o in options if o != "--"]
    files = args.files if args.files else files_before(args.target)
    if crashes([], args.target, options):
        sys.exit("the target crashes alone: nothing to bisect")
    if not crashes(files, args.target, options):
        sys.exit("the target does not crash after these files")
    while len(files) > 1:
        half = len(files) // 2
        first, second = files[:half], files[half:]
        if crashes(first, args.target, options):
            files = first
        elif crashes(second, args.target, options):
            files = second
        else:
            print(f"neither half alone: both needed ({len(files)} files)")
            break
    print("crashes it:", " ".join(files))


if __name__ == "__main__":
    main()
