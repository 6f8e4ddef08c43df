"""The docs' figures hook (scripts/mkdocs_figures.py) reads what the result files say."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("mkdocs")

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
# Runs whose report (Markdown) and result file (JSON) are both kept.
BOTH = sorted(p.stem for p in (DOCS / "benchmarks").glob("*.json") if p.with_suffix(".md").exists())


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mkdocs_figures", ROOT / "scripts" / "mkdocs_figures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("run", BOTH)
def test_a_report_gives_its_result_files_medians(figures: ModuleType, run: str) -> None:
    """Where a run kept no JSON, its report is read instead: the same numbers, rounded."""
    from_report = figures.Run(DOCS, run, report=True)
    raw: dict[str, Any] = json.loads((DOCS / "benchmarks" / f"{run}.json").read_text())
    assert from_report.meta["date"] == raw["meta"]["date"]
    assert from_report.meta["torch"] == raw["meta"]["torch"]
    for result in raw["results"]:
        for kind, key in (("cpu", "median_cpu_us"), ("wall", "median_us")):
            for variant, us in result.get(key, {}).items():
                read = from_report.median(kind, result["workload"], variant)
                assert read == pytest.approx(round(us, 1), abs=0.051), (kind, variant)
        assert set(from_report.skipped.get(result["workload"], {})) == set(result["skipped"])


def test_a_placeholder_is_replaced_by_the_figure_and_its_source(figures: ModuleType) -> None:
    page = figures.Figures(str(DOCS), "borrowed-outputs.md")
    run, workload = "h100-issue43-run2", "c. policy, TensorDict"
    assert page.cpu(run, workload, "bare replay") == "5.3"
    assert page.ratio(run, workload, "cudagraph_td", "floor") == f"{31.3 / 27.4:.2f}"
    assert page.source(run) == (
        "[NVIDIA H100, torch 2.11.0+cu130, 2026-11-27](benchmarks/h100-issue43-run2.md)"
    )


@pytest.mark.parametrize(
    ("placeholder", "error"),
    [
        ('{{ cpu("h100-issue43-run2", "c. policy, TensorDict", "nothing") }}', "no variant"),
        ('{{ cpu("h100-issue43-run2", "z. nothing", "eager") }}', "no workload"),
        ('{{ cpu("no-such-run", "a", "b") }}', "no result file"),
        ('{{ nothing("h100-issue43-run2") }}', "no figure function"),
    ],
    ids=["variant", "workload", "run", "function"],
)
def test_a_figure_that_is_not_in_the_file_fails_the_build(
    figures: ModuleType, placeholder: str, error: str
) -> None:
    page: Any = type("Page", (), {"file": type("File", (), {"src_uri": "index.md"})()})()
    with pytest.raises(figures.PluginError, match=re.escape(error)):
        figures.on_page_markdown(placeholder, page, {"docs_dir": str(DOCS)}, None)


# A figure on a page: a number with a unit of time, speed, size or ratio, a decimal, a
# number with thousands separators, or a table cell that starts with a number. Not a figure: code
# (blocks and `spans`), HTML comments, link targets, dates, versions (2.11.0, "torch 2.11"),
# targets (<= 1.05, target 2.0x, within 0.02) and what NOT_FIGURES names.
_SKIP = [
    re.compile(r"^(```|~~~).*?^\1", re.M | re.S),
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"\{\{.*?\}\}", re.S),
    re.compile(r"`[^`\n]*`"),
    re.compile(r"\]\([^)\s]*\)"),
    re.compile(r"\b\d{4}-\d\d-\d\d\b"),
    re.compile(r"\b\d+\.\d+\.\d+\S*"),
    re.compile(r"\b(?:torch|PyTorch|tensordict|torchrl|Python) \d+\.\d+(?: and \d+\.\d+)?\b"),
    re.compile(r"(?:[<>]=|[Tt]argets?:?(?: of)?|within)\s?\d+(?:\.\d+)?x?"),
    re.compile(r"\d+(?:\.\d+)?x? target"),
]
_UNIT = (
    r"µs|us|ms|ns|s|x|%|steps/s|frames/s|(?:environment )?steps a second|frames a second"
    r"|MiB|GiB|KiB|bytes"
)
_FIGURE = re.compile(
    rf"(?<![\w.#])[+-]?\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?\s*(?:{_UNIT})(?![\w/])"
    r"|(?<![\w.#/])[+-]?\d+\.\d+(?![\w.])"
    r"|(?<![\w.])\d{1,3}(?:,\d{3})+(?![\d])"
)
_CELL = re.compile(r"\**[+-]?\d[\d,.]*x?\**(?:[ /(].*)?")  # "1.05", "531 (582, 531)"
# Numbers that are not measurements: settings, sizes the library or the hardware fixes.
NOT_FIGURES = {
    "sharp-edges.md": ["1 MiB", "2 MiB", "32 MiB"],  # a threshold, a segment, cuBLAS's
    "benchmarks.md": ["16 calls", "0.4 s", "0.05 s"],  # the method's settings
    "runs/2026-11-27-borrowed-call.md": ["16 calls"],
    "runs/2026-11-25-run2.md": ["0.4 s"],
    "runs/2026-11-23.md": ["32 MiB", "2 MiB"],  # cuBLAS's workspace, a pool's segment
    "gpu-rollouts.md": ["1,024", "4,096"],  # numbers of environments
}
# Tables whose numbers are not figures, by their first header cell: the package's layers
# (architecture.md), the corpus scripts' settings (corpus.md).
NOT_FIGURE_TABLES = {"layer", "script (test)"}


def _figures(text: str, name: str) -> list[str]:
    """Every figure of the page ``name`` that no placeholder writes: ``name:line: figure``."""
    for pattern in [*_SKIP, *(re.compile(re.escape(s)) for s in NOT_FIGURES.get(name, []))]:
        # Blanked, not removed: line numbers stay, and no number runs into a unit.
        text = pattern.sub(lambda m: re.sub(r"[^\n]", "_", m[0]), text)
    found = [
        f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {' '.join(m[0].split())}"
        for m in _FIGURE.finditer(text)
    ]
    header = ""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = ""
        elif not header:
            header = line.strip("| ").split("|")[0].strip()
        elif header not in NOT_FIGURE_TABLES:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            found += [f"{name}:{number}: {c}" for c in cells if _CELL.fullmatch(c)]
    return sorted(dict.fromkeys(found), key=lambda f: int(f.split(":")[1]))


PAGES = sorted(p for p in DOCS.rglob("*.md") if p.parent.name != "benchmarks")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(DOCS).as_posix() for p in PAGES])
def test_every_figure_on_a_page_comes_from_a_result_file(page: pathlib.Path) -> None:
    """A number quoted by hand can disagree with its run, and names no GPU, torch or date:
    write it as a placeholder ({{ value(...) }}, {{ cell(...) }}, ...) of a result file."""
    assert _figures(page.read_text(), page.relative_to(DOCS).as_posix()) == []


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("the state check costs 13.7 µs", ["13.7 µs"]),
        ("1.44x the floor, 0.91 of tensordict's", ["1.44x", "0.91"]),
        ("PPO runs 3657\nenvironment steps a second", ["3657 environment steps a second"]),
        (
            "| a | b | c |\n| - | - | - |\n| eager | 114.7 | 531 (582, 531) |",
            ["114.7", "531 (582, 531)"],
        ),
        ("5,120 bytes, 10-20% apart", ["5,120 bytes", "10-20%"]),
        ('{{ cpu("h100", "a. tiny op", "eager") }} µs, `x + 1.5`, torch 2.11, 2.11.0', []),
        ("target 2.0x, <= 1.05, within 0.02, on 2026-11-23, pytorch#181723", []),
    ],
    ids=[
        "µs",
        "ratios",
        "across a line",
        "table cells",
        "sizes and ranges",
        "not figures",
        "targets",
    ],
)
def test_the_figure_scan(text: str, found: list[str]) -> None:
    assert [f.split(": ", 1)[1] for f in _figures(text, "page.md")] == found


def test_a_report_table_and_its_cells(figures: ModuleType) -> None:
    page = figures.Figures(str(DOCS), "runs/2026-11-23.md")
    targets = "## Targets (CPU time per call)"
    row = "c. policy, keywords: tensordict / cudagraph_td >= 1.3"
    assert page.cell("h100", targets, row, column="measured") == "1.92x"
    assert page.cell("h100", targets, row, column="measured", number=0) == "1.92"
    assert page.table("h100", targets).splitlines()[0] == "| target | met | measured |"
    turns, g = "## Modes and shapes in turn (g, h)", "g. policy, modes in turn"
    wall = page.cell("h100-issue31-run2", turns, g, "floor", column="in turn / steady", which=1)
    assert wall == "0.973"
    with pytest.raises(figures.PluginError, match=re.escape("has no row ['z. nothing']")):
        page.cell("h100", targets, "z. nothing", column="measured")
