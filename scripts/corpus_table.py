"""Turn the corpus outcomes (JSON lines written by ``tests/corpus`` with ``CORPUS_REPORT`` set)
into the markdown table of docs/corpus.md, between its ``<!-- corpus-table -->`` markers.

    CORPUS_REPORT=corpus.jsonl python -m pytest tests/corpus
    python scripts/corpus_table.py corpus.jsonl [more.jsonl ...] [--write docs/corpus.md]
    python scripts/corpus_table.py corpus.jsonl --write docs/corpus.md --sources LeanRL

With ``--sources``, the rows of those sources come from the reports and the page keeps its
rows of the others (a run cut before some of the corpus).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

START, END = "<!-- corpus-table -->", "<!-- /corpus-table -->"
WRAPPERS = ("cudagraph_td", "tensordict", "torch")
_CALL = re.compile(r"(?<![\w`])([A-Za-z_][\w.]*\([\w.]*\))")  # `name(arg)`, no spaces


def table(lines: list[dict[str, str]], kept: dict[tuple[str, str], str] | None = None) -> str:
    """The table of the outcomes ``lines``, with the rows ``kept`` (by source and row) beside
    theirs."""
    rows: dict[tuple[str, str], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for line in lines:
        cell = line["outcome"]
        if line.get("detail") and line["outcome"] != "matches eager":
            cell += f": {_calls_as_code(line['detail'])}"
        rows[(line["source"], line["row"])][line["wrapper"]].append(f"{cell} ({line['backend']})")
    made = dict(kept or {})
    for (source, row), cells in rows.items():
        shown = [
            "<br>".join(sorted(set(cells[w]))).replace("|", "\\|") if w in cells else ""
            for w in WRAPPERS
        ]
        made[(source, f"`{row}`")] = f"| {source} | `{row}` | " + " | ".join(shown) + " |"
    out = ["| source | row | " + " | ".join(WRAPPERS) + " |", "| --- | --- |" + " --- |" * 3]
    return "\n".join(out + [made[key] for key in sorted(made)])


def _calls_as_code(text: str) -> str:
    """``text`` with each call written in it (``CudaGraphModule(get_action_and_value)``) as
    code, outside the code already marked: the docs wrap code at its joints, and a call of
    38 letters as one word widened the table past the page."""
    parts = text.split("`")
    parts[::2] = [_CALL.sub(r"`\1`", part) for part in parts[::2]]
    return "`".join(parts)


def page_rows(page: str) -> dict[tuple[str, str], str]:
    """The rows of the page's table, by source and row (the row as written, in backquotes)."""
    rows = {}
    for line in page[page.index(START) : page.index(END)].splitlines()[3:]:
        source, row = (cell.strip() for cell in line.strip("| ").split(" | ")[:2])
        rows[(source, row)] = line
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--write", type=Path, help="the page whose table to replace")
    parser.add_argument(
        "--sources",
        nargs="+",
        help="take only these sources' rows from the reports, and keep the page's rows of the"
        " others (a run that did not run them all)",
    )
    args = parser.parse_args()
    lines = [json.loads(x) for p in args.reports for x in p.read_text().splitlines() if x]
    page = args.write.read_text() if args.write is not None else ""
    kept = None
    if args.sources:
        if args.write is None:
            parser.error("--sources keeps rows of the page: give --write")
        lines = [line for line in lines if line["source"] in args.sources]
        kept = {k: v for k, v in page_rows(page).items() if k[0] not in args.sources}
    text = table(lines, kept)
    if args.write is None:
        print(text)
        return
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    args.write.write_text(pattern.sub(f"{START}\n{text}\n{END}", page))


if __name__ == "__main__":
    main()
