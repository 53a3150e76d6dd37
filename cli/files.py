"""Writing what the core produced: the launch files of ``--emit`` (planner/plan/emit/ returns them
as a mapping of names to text; the core writes no file)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from planner.errors import PlannerError


def write_files(directory: str | Path, files: dict[str, str]) -> list[Path]:
    """Write every file or none: each goes to a temporary name first, then all are renamed."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlannerError(f"--emit {directory}: cannot create the directory ({exc.strerror})", field="emit") from None
    staged = []
    try:
        for name, text in files.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            staged.append((tmp, out / name))
        for tmp, final in staged:
            os.replace(tmp, final)
            final.chmod(0o755 if final.name.endswith((".sh", ".sbatch")) else 0o644)
    except OSError as exc:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise PlannerError(f"--emit {directory}: cannot write ({exc.strerror})", field="emit") from None
    return [final for _, final in staged]
