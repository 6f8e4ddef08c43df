"""Turn the corpus outcomes (JSON lines written by ``tests/corpus`` with ``CORPUS_REPORT`` set)
into the markdown table of docs/corpus.md, between its ``<!-- corpus-table -->`` markers.

    CORPUS_REPORT=corpus.jsonl python -m pytest tests/corpus
    python scripts/corpus_table.py corpus.jsonl [more.jsonl ...] [--write docs/corpus.md]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

START, END = "<!-- corpus-table -->", "<!-- /corpus-table -->"
WRAPPERS = ("cudagraph_td", "tensordict", "torch")


def table(lines: list[dict[str, str]]) -> str:
    rows: dict[tuple[str, str], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for line in lines:
        cell = line["outcome"]
        if line.get("detail") and line["outcome"] != "matches eager":
            cell += f": {line['detail']}"
        rows[(line["source"], line["row"])][line["wrapper"]].append(f"{cell} ({line['backend']})")
    out = ["| source | row | " + " | ".join(WRAPPERS) + " |", "| --- | --- |" + " --- |" * 3]
    for (source, row), cells in sorted(rows.items()):
        shown = [
            "<br>".join(sorted(set(cells[w]))).replace("|", "\\|") if w in cells else ""
            for w in WRAPPERS
        ]
        out.append(f"| {source} | `{row}` | " + " | ".join(shown) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--write", type=Path, help="the page whose table to replace")
    args = parser.parse_args()
    lines = [json.loads(x) for p in args.reports for x in p.read_text().splitlines() if x]
    text = table(lines)
    if args.write is None:
        print(text)
        return
    page = args.write.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    args.write.write_text(pattern.sub(f"{START}\n{text}\n{END}", page))


if __name__ == "__main__":
    main()
