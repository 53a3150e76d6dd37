"""`planner verify` end to end on CPU ranks: the record, the failures, no orphan processes, the lock."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.real_runs import LLAMA

pytestmark = pytest.mark.deepspeed
pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(LLAMA, num_hidden_layers=2)


def request(**kw):
    from planner.schema import EstimateRequest

    fields = dict(model_config=TINY, strategy="zero2", gpus=2, gpu="cpu", micro_batch=1, seq_len=64)
    fields.update(kw)
    return EstimateRequest(**fields)


def rank_processes(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "worker.py" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_ok_run_is_recorded_and_listed(tmp_path):
    from backend.store import RunStore
    from backend.verify import verify

    db = tmp_path / "runs.sqlite"
    record = verify(request(strategy="zero3"), steps=1, warmup_steps=1, db=str(db), work_dir=str(tmp_path / "w"))
    assert record["status"] == "ok" and record["errors"]["within_tolerance"]
    assert {"status", "request", "prediction", "measured", "errors", "environment"} <= set(record)
    ranks = record["measured"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all({"rank", "peak_bytes", "resident_bytes", "step_seconds", "by_category_resident"} <= set(r) for r in ranks)
    assert record["environment"]["versions"]["deepspeed"]
    # DeepSpeed's shm all-reduce segments of this run are gone (backend.launch.remove_shm_segments)
    assert not list(Path("/dev/shm").glob("deepspeed_*")) if Path("/dev/shm").is_dir() else True
    stored = RunStore(db).get(record["id"])
    assert stored["status"] == "ok" and stored["record"]["measured"]["peak_bytes"] == record["measured"]["peak_bytes"]


@pytest.mark.parametrize("fault,status", [("crash:1:1", "crashed"), ("oom:0:1", "oom")])
def test_failing_rank_is_reported_recorded_and_every_rank_ended(tmp_path, monkeypatch, fault, status):
    from backend.store import RunStore
    from backend.verify import verify

    monkeypatch.setenv("PLANNER_FAULT", fault)
    work = tmp_path / "w"
    record = verify(request(), steps=2, warmup_steps=1, db=str(tmp_path / "db"), work_dir=str(work), timeout_seconds=300)
    assert record["status"] == status, record["message"]
    assert "after 1 of 3 steps" in record["message"]
    if status == "oom":
        assert "the prediction said the peak" in record["message"]
    assert rank_processes(str(work)) == []
    assert RunStore(tmp_path / "db").get(record["id"])["status"] == status


def test_hang_times_out_and_leaves_no_orphan(tmp_path, monkeypatch):
    from backend.verify import verify

    monkeypatch.setenv("PLANNER_FAULT", "hang:1:1")
    work = tmp_path / "w"
    started = time.monotonic()
    record = verify(request(), steps=2, warmup_steps=1, db=str(tmp_path / "db"), work_dir=str(work), timeout_seconds=60)
    assert record["status"] == "timeout" and time.monotonic() - started < 120
    assert rank_processes(str(work)) == []


def test_ctrl_c_ends_every_rank_and_records_interrupted(tmp_path):
    db = tmp_path / "db"
    model = tmp_path / "model.json"
    model.write_text(json.dumps(TINY))
    env = dict(os.environ, PLANNER_FAULT="hang:0:1", PLANNER_DB=str(db))
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "verify", "--model-file", str(model), "--strategy",
                             "zero1", "--gpus", "2", "--gpu", "cpu", "--micro-batch", "1", "--seq-len", "64",
                             "--steps", "2"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not rank_processes("planner-run"):
        time.sleep(0.5)
    time.sleep(20)  # let the ranks reach the hang
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    time.sleep(1)
    assert rank_processes("planner-run") == []
    from backend.store import RunStore

    assert RunStore(db).list()[0]["status"] == "interrupted"


def test_two_runs_on_the_same_devices_are_refused(tmp_path):
    from backend.store import RunStore
    from backend.verify import device_lock, verify
    from planner.errors import PlannerError

    db = tmp_path / "db"
    with device_lock(request(), Path(db).parent):
        with pytest.raises(PlannerError, match="another planner verify is running on the same devices"):
            verify(request(), steps=1, warmup_steps=0, db=str(db))
    assert RunStore(db).list()[0]["status"] == "refused"


def test_calibrate_fits_a_profile_that_estimate_and_plan_apply(tmp_path, monkeypatch):
    from backend.store import RunStore
    from backend.verify import verify
    from planner.plan import estimate_with_time
    from planner.profiles import fit_profile, load_profile, save_profile

    monkeypatch.setenv("PLANNER_PROFILES", str(tmp_path / "profiles"))
    db = tmp_path / "db"
    record = verify(request(strategy="zero1"), steps=2, warmup_steps=1, db=str(db))
    store = RunStore(db)
    runs = [(row["id"], store.get(row["id"])["record"]) for row in store.list() if row["status"] == "ok"]
    profile = fit_profile("cpu-test", runs)
    assert 0 < profile.compute_efficiency <= 1 and profile.runs == [record["id"]]
    assert abs(profile.residuals[0].error_pct) < 1e-6  # one run: the fit reproduces it
    # the run timed its collectives (DeepSpeed's comms logger), so the link efficiency is fitted too
    assert record["communication"]["measured_bytes_per_step"] > 0
    assert profile.link_efficiency != 1.0 and abs(profile.communication_residuals[0].error_pct) < 1e-6
    assert list(profile.link_efficiencies.values()) == [profile.link_efficiency]  # one run, one link type
    save_profile(profile)
    assert load_profile("cpu-test").compute_efficiency == profile.compute_efficiency
    timed = estimate_with_time(request(strategy="zero1", profile="cpu-test"))
    assert timed.time is not None
    assert abs(timed.time.compute_seconds - record["measured"]["step_seconds"]) / record["measured"]["step_seconds"] < 0.01
    save_profile(profile.model_copy(update={"name": "cpu-test-nominal", "link_efficiency": 1.0, "link_efficiencies": {}}))
    nominal = estimate_with_time(request(strategy="zero1", profile="cpu-test-nominal")).time
    assert timed.time.communication_seconds != nominal.communication_seconds  # the link efficiency is applied
