"""Put a benchmark's output into the README, between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

import sys
from pathlib import Path


def replace_block(readme: str | Path, name: str, text: str) -> int:
    """Replace the named block of the README with ``text``; 2 (and a message) if it has no such block."""
    path = Path(readme)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    content = path.read_text()
    if start not in content or end not in content:
        print(f"{path}: no {start} ... {end} block to replace", file=sys.stderr)
        return 2
    before, rest = content.split(start, 1)
    _, after = rest.split(end, 1)
    path.write_text(f"{before}{start}\n{text.rstrip()}\n{end}{after}")
    return 0
