"""A mkdocs hook: the figures that docs pages quote, read from the benchmark's result files.

A page writes ``{{ cpu("h100-issue43-run2", "c. policy, TensorDict", "cudagraph_td") }}``
where it quotes a figure, and the build puts in the number from that run's result file
(``docs/benchmarks/<run>.json``, or the run's Markdown report where the run kept no JSON), so
that a page cannot disagree with the run it cites. ``{{ source("h100-issue43-run2") }}``
names the run's GPU, torch and date, linked to its report. A placeholder whose run, workload
or variant is not in the file fails the build.

Functions (all arguments are strings but ``digits``):

- ``cpu(run, workload, variant)``, ``wall(...)``: median µs per call, one decimal;
- ``ratio(run, workload, variant, over, kind="cpu")``: one median over another, two decimals;
- ``diff(run, workload, variant, less, kind="cpu")``: one median less another, one decimal;
- ``steps(run, script, variant)``: LeanRL scripts, median environment steps a second;
  ``steps_each`` each run's; ``part(run, script, variant, part, kind="host")`` a part's µs
  per step, median of the runs, ``part_each`` each run's, ``part_ratio(..., part, over)``
  the range of one part's host time over another's;
- ``frames(run, variant, block=-1, ratio=False)``: the torchrl SAC loop, frames a second
  (or the ratio to eager) in one of the runs the file records;
- ``mib(run, scenario)``: ``benchmarks/memory.py``, MiB reserved;
- ``value(run, *keys, digits=0, over=None)``: any number of a JSON result file, by its keys
  or list indexes (with ``over``, its ratio to a sibling);
- ``source(run)``: "NVIDIA H100, torch 2.11.0+cu130, 2026-11-27", linked to the report;
- ``cpu_table(run)``: the headline table of CPU time per call, tools side by side;
- ``table(run, heading, which=0)``: a table under ``heading`` in a run's Markdown report,
  as it is;
- ``cell(run, heading, *row, column=..., which=0, number=None)``: one cell of it, the row
  named by its first cells (with ``number``, the number of that index in the cell).

A number on a page that none of these writes is caught by ``tests/test_docs_figures.py``.
"""

from __future__ import annotations

import ast
import functools
import json
import posixpath
import re
import statistics
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

RESULTS = "benchmarks"  # under docs/
PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\((.*?)\)\s*\}\}")

# Result files that do not record their GPU, torch or date themselves: what the commit that
# added each one says (git log -- docs/benchmarks/<file>).
UNRECORDED = {
    "h100-memory": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "date": "2026-11-23"},
    "h100-rl-loop": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "date": "2026-11-23"},
    "h100-leanrl-td3": {"date": "2026-11-27"},
    "h100-leanrl-td3-5runs": {"date": "2026-11-27"},
    "h100-leanrl-sac": {"date": "2026-11-27"},
}


class Run:
    """One result file: its medians by workload and variant, and its GPU, torch and date."""

    def __init__(self, docs: Path, name: str, report: bool = False) -> None:
        """The run ``name`` of ``docs``; with ``report``, from its Markdown report even where
        its JSON result file is kept too."""
        self.name = name
        folder = docs / RESULTS
        self.meta: dict[str, Any] = {}
        self.cpu: dict[str, dict[str, float]] = {}
        self.wall: dict[str, dict[str, float]] = {}
        self.skipped: dict[str, dict[str, str]] = {}
        self.raw: Any = None
        if (folder / f"{name}.json").exists() and not report:
            self.raw = json.loads((folder / f"{name}.json").read_text())
            self._read_json(self.raw)
        elif (folder / f"{name}.md").exists():
            self._read_report((folder / f"{name}.md").read_text())
        elif (folder / f"{name}.txt").exists():
            self.raw = (folder / f"{name}.txt").read_text()
        else:
            raise PluginError(f"no result file docs/{RESULTS}/{name}.json, .md or .txt")
        self.meta.update(UNRECORDED.get(name, {}))
        # A report page of its own, else the result file itself.
        has_page = (folder / f"{name}.md").exists()
        self.target = f"{RESULTS}/{name}.md" if has_page else None

    def _read_json(self, raw: dict[str, Any]) -> None:
        if "meta" in raw and "results" in raw:  # benchmarks/run.py
            self.meta = dict(raw["meta"])
            for result in raw["results"]:
                self.cpu[result["workload"]] = result.get("median_cpu_us", {})
                self.wall[result["workload"]] = result["median_us"]
                self.skipped[result["workload"]] = result.get("skipped", {})
        elif "meta" in raw:  # a result file of another script: its own keys, and its meta
            self.meta = dict(raw["meta"])
        elif "runs" in raw:  # benchmarks/leanrl_scripts.py: every run records its machine
            first = next(iter(next(iter(raw["runs"].values())).values()))[0]
            self.meta = {"device": first["device"], "torch": first["torch"]}

    def _read_report(self, text: str) -> None:
        """A report of benchmarks/run.py: its title, its first line, its time table."""
        device = re.search(r"^# Benchmark: (.+)$", text, re.M)
        line = re.search(r"^torch (\S+), .*?(\d{4}-\d\d-\d\d)\.", text, re.M)
        if device is None or line is None:
            raise PluginError(f"{self.name}.md: no device, torch or date line")
        self.meta = {"device": device[1], "torch": line[1], "date": line[2]}
        # The time tables (## Time per call, wall / CPU): | workload | variant | µs | ... |,
        # a variant not timed as n/a with a footnote that gives the reason.
        notes = dict(re.findall(r"^\[\^([\w-]+)\]: (.*)$", text, re.M))
        tables = {"## Time per call, wall": self.wall, "## Time per call, CPU": self.cpu}
        table = None
        for row in text.splitlines():
            if row.startswith("## "):
                table = tables.get(row)
            cells = [c.strip() for c in row.strip("|").split("|")]
            if table is None or not row.startswith("|") or len(cells) < 3:
                continue
            workload, variant, value = cells[0], cells[1].strip("*"), cells[2]
            if re.fullmatch(r"[\d.]+", value):
                table.setdefault(workload, {})[variant] = float(value)
            elif note := re.fullmatch(r"n/a\[\^([\w-]+)\]", value):
                self.skipped.setdefault(workload, {})[variant] = notes.get(note[1], "")

    def median(self, kind: str, workload: str, variant: str) -> float:
        medians = (self.cpu if kind == "cpu" else self.wall).get(workload)
        if medians is None:
            raise PluginError(f"{self.name}: no workload {workload!r}")
        if variant not in medians:
            raise PluginError(f"{self.name}: {workload!r} has no variant {variant!r}")
        return medians[variant]

    def describe(self) -> str:
        device = str(self.meta["device"]).replace(" 80GB HBM3", "")
        return f"{device}, torch {self.meta['torch']}, {self.meta['date']}"


@functools.cache
def _run(docs: str, name: str) -> Run:
    return Run(Path(docs), name)


class Figures:
    """The functions a page's placeholders call, for one page."""

    def __init__(self, docs: str, page: str) -> None:
        self.docs, self.page = docs, page

    def _link(self, target: str) -> str:
        return posixpath.relpath(target, posixpath.dirname(self.page) or ".")

    def cpu(self, run: str, workload: str, variant: str, digits: int = 1) -> str:
        return f"{_run(self.docs, run).median('cpu', workload, variant):.{digits}f}"

    def wall(self, run: str, workload: str, variant: str, digits: int = 1) -> str:
        return f"{_run(self.docs, run).median('wall', workload, variant):.{digits}f}"

    def ratio(
        self, run: str, workload: str, variant: str, over: str, kind: str = "cpu", digits: int = 2
    ) -> str:
        r = _run(self.docs, run)
        return f"{r.median(kind, workload, variant) / r.median(kind, workload, over):.{digits}f}"

    def diff(
        self, run: str, workload: str, variant: str, less: str, kind: str = "cpu", digits: int = 1
    ) -> str:
        """One median less another (µs a call saved, or added)."""
        r = _run(self.docs, run)
        return f"{r.median(kind, workload, variant) - r.median(kind, workload, less):.{digits}f}"

    def steps(self, run: str, script: str, variant: str) -> str:
        runs = _run(self.docs, run).raw["runs"]
        if variant not in runs.get(script, {}):
            raise PluginError(f"{run}: no {script!r} runs of {variant!r}")
        return f"{statistics.median(r['steps_per_s'] for r in runs[script][variant]):.0f}"

    def _script_runs(self, run: str, script: str, variant: str) -> list[dict[str, Any]]:
        runs = _run(self.docs, run).raw["runs"]
        if variant not in runs.get(script, {}):
            raise PluginError(f"{run}: no {script!r} runs of {variant!r}")
        return list(runs[script][variant])

    def _part(self, one: dict[str, Any], part: str, kind: str) -> float:
        if part == "step":
            return float(one[f"step_{kind}_us"])
        if part not in one[f"{kind}_us"]:
            raise PluginError(f"no part {part!r} in the {kind} times of a run")
        return float(one[f"{kind}_us"][part])

    def steps_each(self, run: str, script: str, variant: str) -> str:
        """LeanRL scripts: each run's environment steps a second, in the order they ran."""
        return ", ".join(f"{r['steps_per_s']:.0f}" for r in self._script_runs(run, script, variant))

    def part(self, run: str, script: str, variant: str, part: str, kind: str = "host") -> str:
        """LeanRL scripts: a part's µs per step (``kind`` "host" or "gpu"), median of the runs;
        ``part`` "step" is the whole step."""
        runs = self._script_runs(run, script, variant)
        return f"{statistics.median(self._part(r, part, kind) for r in runs):.0f}"

    def part_each(self, run: str, script: str, variant: str, part: str, kind: str = "host") -> str:
        """LeanRL scripts: a part's µs per step in each run, in the order they ran."""
        runs = self._script_runs(run, script, variant)
        return ", ".join(f"{self._part(r, part, kind):.0f}" for r in runs)

    def part_ratio(self, run: str, script: str, variant: str, part: str, over: str) -> str:
        """LeanRL scripts: the range over the runs of one part's host time over another's."""
        runs = self._script_runs(run, script, variant)
        ratios = [self._part(r, part, "host") / self._part(r, over, "host") for r in runs]
        low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
        return low if low == high else f"{low}-{high}"

    def frames(self, run: str, variant: str, block: int = -1, ratio: bool = False) -> str:
        """Frames a second of ``variant`` in the ``block``-th run the file records (blocks
        start with a "# " line; the last by default), or with ``ratio``, its ratio to eager
        as the run printed it."""
        blocks = re.split(r"^# ", _run(self.docs, run).raw, flags=re.M)[1:]
        pattern = rf"^{re.escape(variant)}:\s+(\d+) frames/s \(([\d.]+)x eager\)"
        found = re.search(pattern, blocks[block], re.M)
        if found is None:
            raise PluginError(f"{run}: no frames/s of {variant!r} in block {block}")
        return found[2] if ratio else found[1]

    def mib(self, run: str, scenario: str) -> str:
        raw = _run(self.docs, run).raw
        if scenario not in raw:
            raise PluginError(f"{run}: no scenario {scenario!r}")
        return f"{raw[scenario]['reserved_mib']:,.0f}"

    def value(self, run: str, *keys: str | int, digits: int = 0, over: str | None = None) -> str:
        """A number of a JSON result file, by its keys (an index for a list: a range's
        ``0`` and ``1``); with ``over``, its ratio to the number under the same keys but the
        last replaced by ``over``."""
        raw: Any = _run(self.docs, run).raw
        parent: Any = {}
        at: list[str | int] = []
        for key in keys:
            listed = isinstance(raw, list) and isinstance(key, int) and -len(raw) <= key < len(raw)
            if not listed and (not isinstance(raw, dict) or key not in raw):
                raise PluginError(f"{run}: no {key!r} under {at}")
            parent, raw, at = raw, raw[key], [*at, key]
        if over is not None:
            raw = raw / parent[over]
        return f"{raw:,.{digits}f}"

    def table(self, run: str, heading: str, which: int = 0) -> str:
        """The ``which``-th table under ``heading`` (a line of the report, "## Targets") in
        ``run``'s Markdown report, with its footnotes, as the run wrote it."""
        return "\n".join(_report_table(self.docs, run, heading, which))

    def cell(
        self,
        run: str,
        heading: str,
        *row: str,
        column: str,
        which: int = 0,
        number: int | None = None,
    ) -> str:
        """The cell of ``column`` in the row whose first cells are ``row`` (bold marks
        ignored), in the ``which``-th table under ``heading`` of ``run``'s report; with
        ``number``, the number of that index in it (1 gives "1.398" of "1.341 (wall: 1.398)")."""
        lines = [x for x in _report_table(self.docs, run, heading, which) if x.startswith("|")]
        header = _cells(lines[0])
        if column not in header:
            raise PluginError(f"{run}: {heading!r} has no column {column!r}")
        for line in lines[2:]:
            cells = _cells(line)
            if cells[: len(row)] == list(row):
                text = cells[header.index(column)]
                if number is None:
                    return text
                found = re.findall(r"[+-]?\d+(?:\.\d+)?", text)
                if number >= len(found):
                    raise PluginError(f"{run}: no number {number} in {text!r} ({list(row)!r})")
                return str(found[number])
        raise PluginError(f"{run}: {heading!r} has no row {list(row)!r}")

    def source(self, run: str) -> str:
        r = _run(self.docs, run)
        target = r.target or f"{RESULTS}/{run}.json"
        if r.target is None:
            for ext in (".json", ".txt"):
                if (Path(self.docs) / RESULTS / f"{run}{ext}").exists():
                    target = f"{RESULTS}/{run}{ext}"
        return f"[{r.describe()}]({self._link(target)})"

    def cpu_table(self, run: str) -> str:
        """CPU µs per call, the tools side by side, the best graph of each row in bold; a
        tool that failed gets a footnote with its error, not the error in a number cell."""
        r = _run(self.docs, run)
        columns = [
            ("eager", "eager"),
            ("cudagraph_td", "cudagraph_td"),
            ("tensordict's class", "tensordict"),
            ("torch's function", "floor"),
            ("torch.compile", "compile"),
        ]
        rows = [
            ("tiny op (`x + 1`)", "a. tiny op", False),
            ("32 tensors in and out", "b. 32 leaves", False),
            ("TensorDict policy, `policy(td)`", "c. policy, TensorDict", False),
            ("the same, `policy(observation=obs)`", "c. policy, keywords", False),
            ("the same in grad mode", "c. policy, grad mode", True),
            ("SAC update (a whole step)", "d. SAC update", False),
            ("forward and backward", "e. forward+backward", True),
            ("torch's documented training loop", "e2. torch's documented loop", True),
            ("random batch 1-64 (`Buckets`)", "f. policy, random batch", False),
        ]
        lines = [
            "| workload | " + " | ".join(title for title, _ in columns) + " |",
            "| --- |" + " ---: |" * len(columns),
        ]
        notes: list[str] = []
        for title, workload, torch_floor in rows:
            medians, skipped = r.cpu[workload], r.skipped.get(workload, {})
            cells = []
            for _, variant in columns:
                if variant == "floor" and not torch_floor:
                    cells.append("")
                elif variant in medians:
                    cells.append(f"{medians[variant]:.1f}")
                elif variant in skipped:
                    notes.append(f"{workload} / {variant}: {skipped[variant]}")
                    cells.append(f"fails[^{run}-{len(notes)}]")
                else:
                    cells.append("")
            lines.append(f"| {title} | " + " | ".join(cells) + " |")
        lines.append("")
        for i, note in enumerate(notes, 1):
            lines.append(f"[^{run}-{i}]: {note.replace('|', '/')}")
        return "\n".join(lines)


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*") for c in line.strip().strip("|").split("|")]


@functools.cache
def _report_table(docs: str, run: str, heading: str, which: int = 0) -> list[str]:
    """The lines of the ``which``-th table under ``heading`` in ``run``'s report, and the
    footnotes that its cells name."""
    path = Path(docs) / RESULTS / f"{run}.md"
    if not path.exists():
        raise PluginError(f"no report docs/{RESULTS}/{run}.md")
    lines = path.read_text().splitlines()
    if heading not in lines:
        raise PluginError(f"{run}.md: no heading {heading!r}")
    tables: list[list[str]] = [[]]
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            tables[-1].append(line)
        elif tables[-1]:
            tables.append([])
    tables = [t for t in tables if t]
    if which >= len(tables):
        raise PluginError(f"{run}.md: no table {which} under {heading!r}")
    rows = tables[which]
    notes = set(re.findall(r"\[\^([\w-]+)\]", "\n".join(rows)))
    footnotes = [x for x in lines if (m := re.match(r"\[\^([\w-]+)\]:", x)) and m[1] in notes]
    return rows + (["", *footnotes] if footnotes else [])


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    figures = Figures(config["docs_dir"], page.file.src_uri)

    def replace(match: re.Match[str]) -> str:
        name, arguments = match[1], match[2]
        function = getattr(figures, name, None)
        if name.startswith("_") or function is None:
            raise PluginError(f"{page.file.src_uri}: no figure function {name!r}")
        try:
            call = ast.parse(f"f({arguments})", mode="eval").body
            assert isinstance(call, ast.Call)
            args = [ast.literal_eval(arg) for arg in call.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        except (ValueError, SyntaxError) as error:
            raise PluginError(f"{page.file.src_uri}: {match[0]}: {error}") from error
        return str(function(*args, **kwargs))

    return PLACEHOLDER.sub(replace, markdown)
