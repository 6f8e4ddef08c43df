"""The code blocks of the README and of the docs run as written, on their stated device.

Every fenced ``python`` block of ``README.md`` and ``docs/*.md`` is a test. A block runs on
the CPU emulation, as on a machine without CUDA where ``CUDAGRAPH_TD_BACKEND=emulate`` is
set, unless an HTML comment just before it (invisible on the rendered page) says otherwise.
Its first line holds one of:

- ``<!-- docs-test: cuda`` -- the block needs CUDA, as the page says: it runs as written on a
  GPU machine, and is skipped elsewhere;
- ``<!-- docs-test: skip: <why> -->`` -- the block cannot run alone (a fragment of a
  ``torchrun`` script, say), and ``<why>`` says which test or example runs its code instead;
- ``<!-- docs-test: setup`` -- a block that uses names the page's prose gives (``actor``,
  ``td``).

The lines after the first, up to ``-->``, are code run before the block, in its namespace:
the names the page's prose gives, or a ``pytest.skip`` where the block needs more than the
machine has (two GPUs, torchrl).
"""

from __future__ import annotations

import fnmatch
import itertools
import pathlib
import re
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch

import cudagraph_td

from .conftest import HAS_CUDA, NO_CUDA_REASON

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A fenced python block, with the HTML comment that may stand just before it.
BLOCK = re.compile(
    r"(?:<!-- docs-test: (?P<how>[^\n]*?)(?: -->|\n(?P<setup>.*?)-->)\n\n)?"
    r"^```python\n(?P<code>.*?)^```",
    re.DOTALL | re.MULTILINE,
)


class Block(NamedTuple):
    where: str  # page:line of the fence
    how: str  # "", "cuda", "setup" or "skip: why"
    setup: str
    code: str


def _blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            how = m["how"] or ""
            assert how in ("", "cuda", "setup") or how.startswith("skip: "), (page, line, how)
            where = f"{page.relative_to(ROOT)}:{line}"
            blocks.append(Block(where, how, m["setup"] or "", m["code"]))
    return blocks


BLOCKS = _blocks()


def _run(block: Block) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    with torch.enable_grad():  # grad mode as it was, whatever the block sets
        if block.setup:
            exec(compile(block.setup, f"{block.where} (setup)", "exec"), namespace)
        exec(compile(block.code, block.where, "exec"), namespace)
    return namespace


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_a_code_block_runs_as_written(block: Block) -> None:
    if block.how.startswith("skip: "):
        pytest.skip(block.how.removeprefix("skip: "))
    if block.how == "cuda":
        if not HAS_CUDA:
            pytest.skip(f"the page runs it on CUDA: {NO_CUDA_REASON}")
        _run(block)
        return
    # As on a machine without CUDA, the whole program on the emulation: the one switch.
    with (
        cudagraph_td.set_default_backend("emulate"),
        mock.patch("torch.cuda.is_available", lambda: False),
    ):
        _run(block)


def test_the_blocks_are_found() -> None:
    found = {b.where.split(":")[0] for b in BLOCKS}
    assert {"README.md", "docs/quickstart.md", "docs/sharp-edges.md"} <= found
    fences = sum(page.read_text().count("```python\n") for page in PAGES)
    assert len(BLOCKS) == fences  # none left out by a comment the pattern misread


def test_the_readme_gives_the_docs_build_command_with_its_extra() -> None:
    readme = (ROOT / "README.md").read_text()
    assert '```bash\npip install -e ".[docs]" && mkdocs build --strict\n```' in readme
    extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    assert re.search(r'^docs = \[\n    "mkdocs>=', extras, re.MULTILINE)


def test_every_page_is_in_the_nav_or_declared_out_of_it() -> None:
    # A build lists the pages that are neither, which a reader of its output takes for a
    # mistake. The nav nests (the Benchmarks section's runs and reports); `not_in_nav`, if
    # any, declares the others.
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^ +- [^\n]+: (\S+\.md)$", config, re.MULTILINE))
    declared = config.split("not_in_nav: |\n")[1].split("\n") if "not_in_nav" in config else []
    patterns = [line.strip() for line in itertools.takewhile(str.strip, declared)]
    docs = ROOT / "docs"
    for page in docs.rglob("*.md"):
        name = page.relative_to(docs).as_posix()
        outside = any(fnmatch.fnmatch(f"/{name}", pattern) for pattern in patterns)
        assert (name in nav) != outside, name  # one or the other
