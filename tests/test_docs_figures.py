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
