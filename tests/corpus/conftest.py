"""The corpus: public code (LeanRL, torchrl's sota-implementations, torch's and tensordict's
own tests of their graph wrappers) run through the library against eager twins.

Each row of the docs' corpus table is one test. A test runs its script's code with this
library's wrapper (and must match its eager twin), and, where the script was written for it,
with the wrapper it was written for (tensordict's ``CudaGraphModule``, torch's
``make_graphed_callables``), whose outcome is recorded, not asserted. With the environment
variable ``CORPUS_REPORT`` set to a file, every outcome is appended to it as a JSON line, which
``scripts/corpus_table.py`` turns into the docs' table.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ..conftest import slow_replays

OUTCOMES = ("matches eager", "differs from eager", "raises", "not run")


class Recorder:
    """Records the outcome of one row for one wrapper (see ``record``)."""

    def __init__(self, source: str, row: str):
        self.source = source
        self.row = row

    def __call__(
        self, wrapper: str, outcome: str, detail: str = "", *, backend: str | None = None
    ) -> None:
        assert outcome in OUTCOMES, outcome
        path = os.environ.get("CORPUS_REPORT")
        if not path:
            return
        line = {
            "source": self.source,
            "row": self.row,
            "wrapper": wrapper,
            "backend": backend or ("cuda" if torch.cuda.is_available() else "emulate"),
            "outcome": outcome,
            "detail": detail[:300],
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def attempt(self, wrapper: str, run: Callable[[], bool], *, backend: str | None = None) -> str:
        """Run ``run()`` (True: matches eager) and record its outcome, which is returned;
        an exception is recorded as ``raises`` with its message."""
        try:
            same = run()
        except Exception as err:  # recorded, not raised: another wrapper's outcome
            message = f"{type(err).__name__}: {err}".splitlines()[0]
            self(wrapper, "raises", message, backend=backend)
            traceback.clear_frames(err.__traceback__)
            return "raises"
        outcome = "matches eager" if same else "differs from eager"
        self(wrapper, outcome, backend=backend)
        return outcome


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Iterator[Recorder]:
    """``record(wrapper, outcome, detail)`` for this test's row: the source is the test
    module's ``SOURCE``, the row the test's id."""
    source = getattr(request.module, "SOURCE", request.module.__name__)
    yield Recorder(source, request.node.name)


def same(a: Any, b: Any, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Whether two results (trees of tensors) are close, for ``Recorder.attempt``."""
    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True


class OnReplayPath:
    """The wrappers of a run (``watch`` each as it is made), and an assertion (``check``)
    that no call after a graph's capture took the wrapper's slow path."""

    def __init__(self) -> None:
        self.counts: list[tuple[Any, list[int]]] = []

    def watch(self, wrapper: Any) -> Any:
        self.counts.append((wrapper, slow_replays(wrapper)))
        return wrapper

    def check(self) -> None:
        fell_off = {repr(w)[:200]: n[0] for w, n in self.counts if n[0]}
        assert not fell_off, f"calls that took the slow path after the capture: {fell_off}"
