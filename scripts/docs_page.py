"""Generated docs pages: their markdown tables, and writing a page or (`--check`) failing when
the committed one is stale."""
from __future__ import annotations

import pathlib
import sys


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """The lines of a markdown table; each cell as str() writes it."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(str(c) for c in row) + " |" for row in rows]]


def write_or_check(out: pathlib.Path, text: str, root: pathlib.Path) -> int:
    if "--check" in sys.argv:
        if not out.exists() or out.read_text() != text:
            print(f"{out.relative_to(root)} is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(f"wrote {out.relative_to(root)}")
    return 0
