"""The run's supervisor (backend/supervisor.py) with a stand-in launcher, no training: whatever
kills the owner, or the supervisor itself, every process of the run ends, the run's /dev/shm
segments go, the device lock stays held while any of them lives, and the record says interrupted.
The real launchers are exercised by tests/test_verify.py and tests/test_serve_signals.py."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from backend.store import RunStore
from backend.supervisor import SHM_DIR, clean_stale_runs, shm_segments
from tests.own_run import live_processes, state, wait_until

ROOT = Path(__file__).resolve().parent.parent

# The stand-in launcher, shaped like `deepspeed` (runner -> launch.py -> ranks): it starts a
# middle process that waits for one "rank"; the rank sits in a session of its own (as torchrun
# starts its workers), ignores SIGTERM (so the supervisor must escalate to SIGKILL) and binds
# itself to the run. Nothing but the rank's own watchdog ends it if the supervisor is killed.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    out = sys.argv[1]
    rank = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "from backend.procs import bind_rank; bind_rank(sys.argv[1], 0); time.sleep(600)")
    middle = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {rank!r}, sys.argv[1]], start_new_session=True).wait()"
    subprocess.Popen([sys.executable, "-c", middle, out])
    time.sleep(600)
""")

# The owner: holds the device lock, records a run, starts the supervisor and waits to be killed.
OWNER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from backend.launch import _start_supervisor
    from backend.store import RunStore
    from backend.verify import device_lock
    from planner.schema import EstimateRequest
    out, db, port = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = RunStore(db, create=True)
    request = EstimateRequest(model="gpt2", gpu="cpu", gpus=2, strategy="zero2")
    run_id = store.start({"model": "gpt2", "request": request.model_dump(by_alias=True),
                          "prediction": {"per_device": {"peak_bytes": 1, "resident_bytes": 1}}})
    env = dict(os.environ)
    spec = {"command": [sys.executable, "-c", sys.argv[4], str(out)], "cwd": os.getcwd(), "env": env,
            "log_path": str(out / "launcher.log"), "port": port, "state_path": str(out / "supervisor.json"),
            "result_path": str(out / "supervisor-result.json"), "db": db, "run_id": run_id,
            "owner_pid": os.getpid(), "grace_seconds": 2.0, "registry": sys.argv[5]}
    with device_lock(request) as fds:
        supervisor, stop_fd = _start_supervisor(spec, out, env, fds)
        print(run_id, flush=True)
        time.sleep(600)
""")


@pytest.fixture()
def run(tmp_path, monkeypatch):
    """Start an owner with a stand-in run; yield (owner, work dir, db, run id, fake segment)."""
    monkeypatch.setenv("PLANNER_LOCK_DIR", str(tmp_path / "locks"))
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    port = random.randrange(20000, 60000)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(work), str(db), str(port), LAUNCHER,
                              str(tmp_path / "locks" / "runs")], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, text=True)
    run_id = int(owner.stdout.readline())
    assert wait_until(lambda: (work / "rank0.pid").exists() and (work / "supervisor.json").exists(), 30)
    # a segment as DeepSpeed's shm.cpp names it, for this run's port: the supervisor must remove it
    segment = SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0"
    segment.write_bytes(b"x")
    yield owner, work, db, run_id, segment
    owner.kill()
    owner.wait()
    for pid in live_processes(work):
        os.kill(abs(pid), signal.SIGKILL) if pid > 0 else os.killpg(-pid, signal.SIGKILL)
    segment.unlink(missing_ok=True)


def _lock_is_held(tmp_path: Path) -> bool:
    with open(tmp_path / "locks" / "cpu.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def test_sigkill_of_the_owner_ends_the_run_cleans_and_records(run, tmp_path):
    owner, work, db, run_id, segment = run
    assert len(live_processes(work)) >= 3  # supervisor, launcher (+ its group), rank
    assert RunStore(db).get(run_id)["status"] == "running"  # its owner lives
    owner.kill()
    owner.wait()
    # the rank ignores SIGTERM, so for the 2 s grace it outlives the owner: the devices stay locked
    # as long as any process of the run lives, and are free once none does
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        # the lock is sampled before the processes: a process found alive after a free lock was
        # seen lived while the devices were free (sampling the other way round races the exit)
        held = _lock_is_held(tmp_path)
        if not live_processes(work):
            break
        assert held, "the device lock was freed while a process of the run lives"
        time.sleep(0.01)
    assert not live_processes(work)
    assert wait_until(lambda: not _lock_is_held(tmp_path), 5)
    assert not segment.exists() and not shm_segments(state(work)["port"])
    stored = RunStore(db).get(run_id)
    assert stored["status"] == "interrupted" and stored["finished"] is not None
    assert f"pid {owner.pid}" in stored["message"] and stored["record"]["status"] == "interrupted"
    assert json.loads((work / "supervisor-result.json").read_text())["reason"] == "owner-died"


def test_sigkill_of_the_supervisor_ends_launcher_and_ranks(run, tmp_path):
    owner, work, db, run_id, segment = run
    supervisor_pid = state(work)["supervisor"][0]
    os.kill(supervisor_pid, signal.SIGKILL)
    # the launcher dies by PR_SET_PDEATHSIG, the rank (own session, SIGTERM ignored) by its watchdog
    assert wait_until(lambda: not live_processes(work), 10), live_processes(work)
    # no one removed the run's segment: the next verify does, from the run's registry entry
    assert segment.exists()
    assert clean_stale_runs(tmp_path / "locks" / "runs") == [state(work)["port"]] and not segment.exists()
    assert not list((tmp_path / "locks" / "runs").iterdir())


def test_a_live_runs_segments_are_not_cleaned_as_stale(run, tmp_path):
    owner, work, db, run_id, segment = run
    assert clean_stale_runs(tmp_path / "locks" / "runs") == [] and segment.exists()
    owner.kill()
    assert wait_until(lambda: not live_processes(work), 15)
    assert not segment.exists() and not list((tmp_path / "locks" / "runs").iterdir())  # unregistered at its end


def test_sigterm_of_the_supervisor_still_cleans(run, tmp_path):
    owner, work, db, run_id, segment = run
    os.kill(state(work)["supervisor"][0], signal.SIGTERM)
    assert wait_until(lambda: not live_processes(work), 15), live_processes(work)
    assert not segment.exists()
    assert json.loads((work / "supervisor-result.json").read_text())["reason"] == "terminated"


def test_a_launcher_that_cannot_start_is_a_launcher_error(tmp_path, monkeypatch):
    from backend import launch
    from planner.schema import EstimateRequest

    monkeypatch.setattr(launch, "launcher_command", lambda *a, **k: [str(tmp_path / "no-such-launcher")])
    monkeypatch.setattr(launch, "prepare_extensions", lambda env, **_: None)
    request = EstimateRequest(model_config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                                            "intermediate_size": 128, "num_hidden_layers": 1,
                                            "num_attention_heads": 2}, gpu="cpu", gpus=2, strategy="zero2")
    result = launch.run_probe(request, out_dir=tmp_path / "w", timeout_seconds=60)
    assert result.status == "launcher-error" and "cannot start the launcher: no-such-launcher" in result.message
