"""Processes by identity, not by name: a pid together with its start time (a pid alone is reused
by the kernel), the descendants of a process, and the Linux prctl calls that tie a child's life to
its parent. Standard library only: the supervisor, the store and every rank import it."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from pathlib import Path

# <linux/prctl.h>: PR_SET_PDEATHSIG = 1, PR_SET_CHILD_SUBREAPER = 36.
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PROC = Path("/proc")


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (proc(5), /proc/PID/stat field 22), or
    None when there is no such process. The pair (pid, start) names one process for good."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # field 2 (comm) is in parentheses and may hold spaces: split after its closing parenthesis
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])  # field 22 overall; the state (field 3) is fields[0]


def alive(pid: int | None, start: int | None) -> bool:
    """Whether the process (pid, start) still exists and is not a zombie."""
    if not pid:
        return False
    now = start_ticks(pid)
    if now is None or (start is not None and now != start):
        return False
    try:
        state = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def identity(pid: int | None = None) -> tuple[int, int | None]:
    pid = os.getpid() if pid is None else pid
    return pid, start_ticks(pid)


def _parents() -> dict[int, int]:
    """pid -> parent pid for every process this user can see (/proc/PID/stat field 4). The kernel
    here may lack CONFIG_PROC_CHILDREN, so /proc/PID/task/TID/children is not relied on."""
    table = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            table[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return table


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid, children first."""
    parents = _parents()
    out, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        out += children
        frontier = children
    return out


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """PR_SET_PDEATHSIG (prctl(2)): the kernel sends sig to this process when the *thread* that
    forked it exits. So it is set only in processes forked by a single-threaded parent (the
    supervisor's main thread, DeepSpeed's launch.py main loop), never in a child of a server's
    worker thread, which would be killed when that thread returns rather than when its process ends."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> None:
    """PR_SET_CHILD_SUBREAPER (prctl(2)): orphaned descendants are re-parented to this process, not
    to init, so none escapes the supervisor by outliving its own parent."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def bind_rank(out_dir: Path, rank: int, interval_seconds: float = 0.5) -> None:
    """Called first thing in every rank: record (pid, start) in <out>/rank<N>.pid, so the run's own
    processes can be named; die with the launcher that forked this rank (PDEATHSIG, set from the
    rank itself: its parent forked it from its main thread); and die with the run's supervisor
    (a daemon thread polls it), so that not even a SIGKILL of the supervisor leaves a rank."""
    import threading

    pid, start = identity()
    (Path(out_dir) / f"rank{rank}.pid").write_text(f"{pid} {start}\n")
    try:
        die_with_parent(signal.SIGKILL)
    except OSError:
        pass
    spec = os.environ.get("PLANNER_SUPERVISOR", "")
    if ":" not in spec:
        return
    owner_pid, owner_start = (int(v) if v.isdigit() else None for v in spec.split(":", 1))

    def watch() -> None:
        import time

        while alive(owner_pid, owner_start):
            time.sleep(interval_seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="planner-supervisor-watch").start()
