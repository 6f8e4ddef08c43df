"""The package's layout: small private modules, and imports that never go in a circle."""

from __future__ import annotations

import ast
import pathlib
import pydoc
import re

import pytest

import cudagraph_td

PACKAGE = pathlib.Path(__file__).parent.parent / "src" / "cudagraph_td"


def _package_imports(path: pathlib.Path) -> set[str]:
    """The package's modules that ``path`` imports at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only or not isinstance(node, ast.ImportFrom) or node.level != 1:
            continue
        if node.module:  # from ._graph import GraphRunner
            found.add(node.module)
        else:  # from . import _errors, _tree
            found.update(alias.name for alias in node.names)
    return found


def test_no_import_cycle() -> None:
    graph = {p.stem: _package_imports(p) for p in PACKAGE.glob("*.py")}
    assert graph["_replay"] and graph["_module"]  # the walk sees the imports

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for module in graph.get(start, ()):
            if module == goal or (module not in seen and reaches(module, goal, seen | {module})):
                return True
        return False

    cycles = sorted(module for module in graph if reaches(module, module, set()))
    assert cycles == []


@pytest.mark.parametrize("name", sorted(set(cudagraph_td.__all__) - {"__version__"}))
def test_public_docstrings_read_as_plain_text(name: str) -> None:
    # `help()` shows docstrings as they are: no Sphinx roles, no Markdown links (the docs'
    # pages are named in words), and examples in an `Examples:` section, which the API page
    # renders as code blocks.
    text = pydoc.render_doc(getattr(cudagraph_td, name), renderer=pydoc.plaintext)
    assert (
        re.findall(r":(?:class|func|meth|attr|data|mod|exc):`|\]\[[\w.-]*\]|\]\([\w.#-]+\)", text)
        == []
    )
    assert "Example:\n" not in text
