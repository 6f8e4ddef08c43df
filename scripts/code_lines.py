"""Count a package's code lines: no blank lines, comments or docstrings (string statements).

python3 scripts/code_lines.py src/cudagraph_td        # the total
python3 scripts/code_lines.py src/cudagraph_td --each  # and each module's
"""

from __future__ import annotations

import ast
import pathlib
import sys


def code_lines(path: pathlib.Path) -> int:
    """The lines of ``path`` that hold code: not blank, not a comment, not in a docstring."""
    source = path.read_text()
    strings = set()
    for node in ast.walk(ast.parse(source)):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):  # a docstring
            strings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in strings
    )


def main() -> None:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "src/cudagraph_td")
    counts = {str(p.relative_to(root)): code_lines(p) for p in sorted(root.rglob("*.py"))}
    if "--each" in sys.argv:
        for name, count in counts.items():
            print(f"{count:6}  {name}")
    print(f"{sum(counts.values()):6}  total")


if __name__ == "__main__":
    main()
