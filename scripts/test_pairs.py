"""The outcomes of each test body on both backends, from a `pytest -v` log.

Every test that takes the `backend` fixture runs once on the emulation and once on CUDA;
this pairs the two outcomes, so that a GPU run says in one table whether the emulation and
the GPU agree. `scripts/gpu_check.sh` runs it on its test log:

    python3 scripts/test_pairs.py gpu-logs/gpu-tests.log tests/test_capture.py tests/test_recording.py

Arguments after the log keep the pairs of those test files alone (the table); the summary
counts every pair of the log.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

from pytest_through_crashes import VerboseLines

# `tests/test_x.py::test_y[emulate-case] PASSED [ 12%]` (a case may hold spaces): the id,
# then (on that line, or on a later one where the test's own output came between) its outcome.
_ID = re.compile(r"^(\S+::[^\s\[]+)(?:\[(.+?)\])?(?= |$)")
_BACKENDS = ("emulate", "cuda")


def _id_of(line: str) -> str | None:
    return found[0] if (found := _ID.match(line)) else None


def pairs(log: str) -> dict[str, dict[str, str]]:
    """Each paired test (its id without the backend) with its outcome on each backend."""
    found: dict[str, dict[str, str]] = defaultdict(dict)
    lines = VerboseLines(_id_of)
    for line in log.splitlines():
        if not (ended := lines.read(line)):
            continue
        test, bracket, params = ended[0].partition("[")  # a name holds no `[`
        if not bracket:
            continue
        parts = params.removesuffix("]").split("-")
        at = next((i for i, p in enumerate(parts) if p in _BACKENDS), None)
        if at is None:
            continue
        backend = parts.pop(at)  # the first one: a case may be named after CUDA too
        rest = "-".join(parts)
        found[f"{test}[{rest}]" if rest else test][backend] = ended[1]
    return found


def main(path: str, files: list[str]) -> int:
    with open(path, encoding="utf-8") as f:
        found = pairs(f.read())
    shown = [t for t in sorted(found) if not files or t.split("::")[0] in files]
    for test in shown:
        outcomes = found[test]
        print(f"{test:100} " + " ".join(f"{b}={outcomes.get(b, '-')}" for b in _BACKENDS))
    both = [t for t, o in found.items() if all(o.get(b) == "PASSED" for b in _BACKENDS)]
    other = sorted(t for t in found if t not in both)
    print(f"\n{len(found)} test bodies run on both backends: {len(both)} passed on both")
    for test in other:
        print(f"  not passed on both: {test} {found[test]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
