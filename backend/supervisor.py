"""The supervisor of one verify run: it starts the launcher, and it ends every process the run
started, whatever ends the planner process that owns the run.

Why a process of its own: the launcher (`deepspeed`, torchrun) and its ranks sit in their own
session, so a SIGKILL of the owner, or its SIGTERM while it cannot clean up, would leave them
training, holding memory, /dev/shm segments and the devices. The owner (the CLI, or the server's
worker thread) starts this process in a session of its own and keeps the write end of a pipe; the
supervisor reads the other end. "stop" on it, or end-of-file because the owner is gone however it
died, makes the supervisor end the launcher's group and every descendant (it is their subreaper,
so none escapes by being re-parented), remove the run's DeepSpeed /dev/shm segments, and, when the
owner died, record the run as interrupted. It holds the device-lock file descriptors it inherited
until the last of those processes is gone, so the devices are never free while a rank lives.

The launcher gets PR_SET_PDEATHSIG(SIGKILL) from this single-threaded process, and every rank
watches this process (backend.procs.bind_rank), so even a SIGKILL of the supervisor ends the run.

Usage (by backend.launch only): python -m backend.supervisor - OWNER_FD [LOCK_FD ...], the spec
(command, environment, paths, port) as JSON on stdin.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `backend` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.procs import alive, become_subreaper, descendants, die_with_parent, identity  # noqa: E402
from planner.frameworks.deepspeed.shm import segment_glob  # noqa: E402

SHM_DIR = Path("/dev/shm")
SUPERVISOR_ENV = "PLANNER_SUPERVISOR"  # "pid:start" of this process, read by every rank


def shm_segments(port: int, uid: int | None = None) -> list[Path]:
    """DeepSpeed's CPU shm all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp, shm_initialize)
    names its segments deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> and never unlinks
    them: about 69 MB per rank that would stay in RAM until reboot. The port is the run's own
    master port, so these are this run's segments and no one else's."""
    uid = os.getuid() if uid is None else uid
    return sorted(SHM_DIR.glob(segment_glob(uid, port)))  # the same pattern the emitted launch.sh removes


def remove_shm_segments(port: int) -> int:
    removed = 0
    for segment in shm_segments(port):
        try:
            segment.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def registry_entry(registry: Path, port: int) -> Path:
    return Path(registry) / f"{os.getuid()}-{port}.json"


def clean_stale_runs(registry: Path) -> list[int]:
    """Remove the /dev/shm segments of this user's runs whose supervisor is gone without cleaning
    (it was SIGKILLed too): every supervisor registers its run (its identity and master port) in
    the registry at start and unregisters at its end, so what is left names a dead run's port.
    Returns the ports cleaned. Only runs of planner, only this user's: nothing else is touched."""
    cleaned = []
    for entry in Path(registry).glob(f"{os.getuid()}-*.json"):
        try:
            run = json.loads(entry.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if alive(*run["supervisor"]):
            continue
        remove_shm_segments(run["port"])
        entry.unlink(missing_ok=True)
        cleaned.append(run["port"])
    return cleaned


class Supervisor:
    def __init__(self, spec: dict, owner_fd: int):
        self.spec = spec
        self.owner_fd = owner_fd
        self.launcher: subprocess.Popen | None = None
        self.launcher_code: int | None = None
        self.terminated = False

    def _on_term(self, signum, _frame) -> None:
        self.terminated = True

    def _reap(self) -> None:
        """Collect every exited child (orphans re-parented here included); keep the launcher's code."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.launcher is not None and pid == self.launcher.pid:
                self.launcher_code = os.waitstatus_to_exitcode(status)
                self.launcher.returncode = self.launcher_code

    def _owner_says(self) -> str | None:
        ready, _, _ = select.select([self.owner_fd], [], [], 0.2)
        if not ready:
            return None
        data = os.read(self.owner_fd, 64)
        return "stop" if data.startswith(b"stop") else "owner-died" if not data else None

    def start(self) -> None:
        spec = self.spec
        env = dict(spec["env"])
        pid, start = identity()
        env[SUPERVISOR_ENV] = f"{pid}:{start}"
        with open(spec["log_path"], "ab") as log:
            self.launcher = subprocess.Popen(spec["command"], cwd=spec["cwd"], env=env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=die_with_parent)
        state = {"supervisor": [pid, start], "launcher": list(identity(self.launcher.pid)), "port": spec["port"]}
        _write_atomic(Path(spec["state_path"]), state)
        if spec.get("registry"):
            try:
                _write_atomic(registry_entry(spec["registry"], spec["port"]), state)
            except OSError as exc:  # the run goes on; only a double kill would then leak its segments
                print(f"planner supervisor: cannot register the run in {spec['registry']}: {exc}", flush=True)

    def watch(self) -> str | None:
        """Until the launcher exits (None) or the run must end: 'stop', 'owner-died', 'terminated'."""
        while True:
            self._reap()
            if self.launcher_code is not None:
                return None
            if self.terminated:
                return "terminated"
            said = self._owner_says()
            if said:
                return said

    def end_all(self, grace_seconds: float) -> None:
        """SIGTERM the launcher's group and every descendant, then SIGKILL what is left."""
        me = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            targets = [p for p in descendants(me) if alive(p, None)]
            if not targets:
                return
            try:
                os.killpg(self.launcher.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            for target in targets:
                try:
                    os.kill(target, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace_seconds
            while time.monotonic() < deadline:
                self._reap()
                if not [p for p in descendants(me) if alive(p, None)]:
                    return
                time.sleep(0.05)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the owner decides; its death is seen on the pipe
        signal.signal(signal.SIGTERM, self._on_term)
        become_subreaper()
        try:
            self.start()
        except OSError as exc:  # the launcher itself cannot be started (missing, not executable)
            _write_atomic(Path(self.spec["result_path"]), {"returncode": None, "reason": "launch-failed",
                                                           "error": f"{spec_command(self.spec)}: {exc}"})
            return 0
        reason = self.watch()
        self.end_all(float(self.spec.get("grace_seconds", 5.0)))  # after a clean exit: stragglers only
        self._reap()
        removed = remove_shm_segments(self.spec["port"])
        if self.spec.get("registry"):
            registry_entry(self.spec["registry"], self.spec["port"]).unlink(missing_ok=True)
        result = {"returncode": self.launcher_code if reason is None else None, "reason": reason,
                  "shm_segments_removed": removed}
        _write_atomic(Path(self.spec["result_path"]), result)
        if reason == "owner-died" and self.spec.get("db") and self.spec.get("run_id"):
            _record_interrupted(self.spec)
        return 0


def spec_command(spec: dict) -> str:
    return Path(spec["command"][0]).name


def _record_interrupted(spec: dict) -> None:
    from backend.store import RunStore
    from planner.errors import PlannerError

    try:
        RunStore(spec["db"], create=False).interrupt(
            spec["run_id"], f"interrupted: the planner process that owned the run (pid {spec['owner_pid']}) "
                            "ended; the supervisor ended every rank")
    except PlannerError:
        pass


def _write_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    spec = json.loads(sys.stdin.read() if argv[0] == "-" else Path(argv[0]).read_text())
    return Supervisor(spec, int(argv[1])).run()  # argv[2:]: lock fds, held open until this process exits


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
