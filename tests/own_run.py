"""A test's own run, found by what the run recorded about itself, never by scanning for "any
python": the supervisor and launcher (<work>/supervisor.json, pid and start time), the launcher's
process group, every rank (<work>/rank<N>.pid), and the run's DeepSpeed /dev/shm segments (named
by its own master port)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from backend.procs import alive
from backend.supervisor import shm_segments


def state(work: Path) -> dict:
    return json.loads((Path(work) / "supervisor.json").read_text())


def live_processes(work: Path) -> list[int]:
    work = Path(work)
    out = []
    if (work / "supervisor.json").exists():
        s = state(work)
        out += [pid for pid, start in (s["supervisor"], s["launcher"]) if alive(pid, start)]
        try:
            os.killpg(s["launcher"][0], 0)  # anything left in the launcher's group (launch.py, ranks)
            out.append(-s["launcher"][0])
        except (ProcessLookupError, PermissionError):
            pass
    for pid_file in work.glob("rank*.pid"):
        pid, start = (int(v) for v in pid_file.read_text().split())
        if alive(pid, start):
            out.append(pid)
    return out


def segments(work: Path) -> list[Path]:
    return shm_segments(state(work)["port"])


def wait_until(predicate, timeout: float, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def ranks_training(work: Path, steps_done: int = 1) -> bool:
    """Rank 0 has reported steps_done steps (every rank is past start-up and inside training)."""
    progress = Path(work) / "progress0.txt"
    return progress.exists() and len(progress.read_text().splitlines()) >= steps_done
