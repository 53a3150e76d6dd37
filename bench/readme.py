"""Put a benchmark's output into the README, between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def replace_block(readme: str | Path, name: str, text: str) -> int:
    """Replace the named block of the README with ``text``; 2 (and a message) if it has no such block."""
    path = Path(readme)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if not path.is_file():
        print(f"--readme {path}: no such file", file=sys.stderr)
        return 2
    content = path.read_text()
    if start not in content or end not in content:
        print(f"{path}: no {start} ... {end} block to replace", file=sys.stderr)
        return 2
    before, rest = content.split(start, 1)
    _, after = rest.split(end, 1)
    path.write_text(f"{before}{start}\n{text.rstrip()}\n{end}{after}")
    return 0


def publish(text: str, readme: str | Path | None, name: str) -> int:
    """A benchmark's last step: print its text and, with --readme, put it in the named block."""
    print(text)
    return replace_block(readme, name, text) if readme else 0


def readme_main(doc: str, name: str, text: Callable[[], str], argv: list[str] | None = None) -> int:
    """A benchmark's command line whose one option is --readme: its docstring's first line as the description,
    ``text`` made after the arguments are read (--help computes nothing), then published."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--readme", help=f"README to write the <!-- {name} --> block into")
    args = parser.parse_args(argv)
    return publish(text(), args.readme, name)
