"""docs/ARCHITECTURE.md's list of every module: regenerated from the tree (the first line of each
module's docstring, grouped by package, and the core modules that call a file operation).

    python bench/architecture_doc.py          # rewrite the block between the layout markers
    python bench/architecture_doc.py --check  # exit 1 if the block is stale

tests/test_imports.py fails on a module the document does not name: run this after adding one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYOUT_START, LAYOUT_END = "<!-- layout:start -->", "<!-- layout:end -->"


def _first_doc_line(path: Path) -> str:
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree) or ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return first.split(". ")[0].rstrip(".") if first else "(no docstring)"


_FILE_CALLS = {"open", "read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "unlink", "fdopen", "mkstemp",
               "NamedTemporaryFile", "rename"}


def _file_users(path: Path) -> list[str]:
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in _FILE_CALLS:
                calls.add(name)
    return sorted(calls)


def layout_block(root: Path) -> str:
    lines = [LAYOUT_START, "", "Generated from the tree by `bench/architecture_doc.py` (first line of each module's",
             "docstring); `tests/test_imports.py` checks that the list names every module.", ""]
    for top in ("planner", "backend", "cli", "web"):
        by_dir: dict[str, list[Path]] = {}
        for path in sorted((root / top).rglob("*.py")):
            by_dir.setdefault(path.parent.relative_to(root).as_posix(), []).append(path)
        for directory, paths in sorted(by_dir.items()):
            init = root / directory / "__init__.py"
            about = _first_doc_line(init) if init.exists() and ast.get_docstring(ast.parse(init.read_text())) else ""
            lines.append(f"**{directory}/**" + (f": {about}" if about else ""))
            lines.append("")
            for path in paths:
                lines.append(f"- `{path.relative_to(root).as_posix()}`: {_first_doc_line(path)}")
            lines.append("")
    readers = []
    for path in sorted((root / "planner").rglob("*.py")):
        calls = _file_users(path)
        if calls:
            readers.append(f"`{path.relative_to(root).as_posix()}` ({', '.join(calls)})")
    lines.append("Files in the core: only these modules of planner/ call a file operation; everything else is")
    lines.append("arithmetic over typed inputs. " + "; ".join(readers) + ".")
    lines += ["", LAYOUT_END]
    return "\n".join(lines)


def update_doc(root: Path, write: bool) -> list[str]:
    doc = root / "docs" / "ARCHITECTURE.md"
    if not doc.exists():
        return []
    text = doc.read_text()
    block = layout_block(root)
    if LAYOUT_START in text and LAYOUT_END in text:
        head, _, rest = text.partition(LAYOUT_START)
        _, _, tail = rest.partition(LAYOUT_END)
        new = head + block + tail
    else:
        new = text.rstrip("\n") + "\n\n## Every module\n\n" + block + "\n"
    if new == text:
        return []
    if write:
        doc.write_text(new)
    return ["regenerate docs/ARCHITECTURE.md layout block"]


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    changed = update_doc(root, write="--check" not in argv)
    print("\n".join(changed) or "docs/ARCHITECTURE.md is current")
    return 1 if changed and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
