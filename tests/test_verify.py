"""`planner verify` end to end on CPU ranks: the record, the failures, no orphan processes, the lock."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.own_run import live_processes, ranks_training, segments, wait_until
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


@pytest.fixture(autouse=True)
def own_lock_dir(tmp_path, monkeypatch):
    """The device locks of this test's runs, apart from other jobs' runs on a shared host."""
    monkeypatch.setenv("PLANNER_LOCK_DIR", str(tmp_path / "locks"))


def cli_verify(tmp_path: Path, db: Path, *extra: str, fault: str | None = "hang:0:1", steps: int = 2) -> subprocess.Popen:
    """`planner verify` in a process of its own; its run's work directory lands in tmp_path."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps(TINY))
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    if fault:
        env["PLANNER_FAULT"] = fault
    # As a terminal's foreground job: SIGINT at its default, so that Python turns it into Ctrl-C. A
    # test run launched as a background job of a non-interactive shell (`pytest ... &`) ignores
    # SIGINT, POSIX's rule for such jobs, and a child inherits an ignored signal across exec: the
    # CLI would then rightly ignore the test's Ctrl-C. A handler set here is reset to the default
    # in the child by exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([sys.executable, "-m", "cli.main", "verify", "--model-file", str(model), "--strategy",
                                 "zero1", "--gpus", "2", "--gpu", "cpu", "--micro-batch", "1", "--seq-len", "64",
                                 "--steps", str(steps), "--db", str(db), *extra], cwd=ROOT, env=env,
                                stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)


def work_dir(tmp_path: Path, timeout: float = 180) -> Path:
    found = wait_until(lambda: sorted(tmp_path.glob("planner-run*")), timeout)
    assert found, "the run never started"
    return found[0]


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
    # DeepSpeed's shm all-reduce segments of this run (its own master port) are gone; other jobs'
    # segments on a shared host are none of this test's business
    assert not segments(tmp_path / "w") and not live_processes(tmp_path / "w")
    assert not list((tmp_path / "locks" / "runs").iterdir())  # the supervisor unregistered the run
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
    assert live_processes(work) == [] and segments(work) == []
    assert RunStore(tmp_path / "db").get(record["id"])["status"] == status


def test_hang_times_out_and_leaves_no_orphan(tmp_path, monkeypatch):
    from backend.verify import verify

    monkeypatch.setenv("PLANNER_FAULT", "hang:1:1")
    work = tmp_path / "w"
    started = time.monotonic()
    record = verify(request(), steps=2, warmup_steps=1, db=str(tmp_path / "db"), work_dir=str(work), timeout_seconds=60)
    assert record["status"] == "timeout" and time.monotonic() - started < 120
    assert live_processes(work) == [] and segments(work) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=["ctrl-c", "sigterm", "sighup", "sigkill"])
def test_a_killed_cli_verify_leaves_no_rank_no_segment_and_records_interrupted(tmp_path, sig):
    from backend.store import RunStore

    db = tmp_path / "runs.sqlite"
    proc = cli_verify(tmp_path, db)
    work = work_dir(tmp_path)
    assert wait_until(lambda: ranks_training(work), 240), "the ranks never trained"
    assert len(live_processes(work)) >= 4 and segments(work)  # supervisor, launcher group, 2 ranks
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 128 + 15, signal.SIGHUP: 128 + 1,
                               signal.SIGKILL: -9}[sig], err
    assert wait_until(lambda: not live_processes(work), 15), live_processes(work)
    assert segments(work) == [] and not list((tmp_path / "locks" / "runs").iterdir())
    run = RunStore(db).list()[0]
    assert run["status"] == "interrupted" and run["finished"] is not None, run
    if sig in (signal.SIGTERM, signal.SIGHUP):
        assert f"interrupted ({sig.name})" in run["message"]


def test_two_runs_on_the_same_devices_are_refused_whatever_their_database(tmp_path):
    from backend.store import RunStore
    from backend.verify import device_lock, verify
    from planner.errors import PlannerError

    with device_lock(request()):
        for db in (tmp_path / "a" / "db", tmp_path / "b" / "db"):  # the devices are locked, not a database
            with pytest.raises(PlannerError, match="another planner verify is running on the same devices"):
                verify(request(), steps=1, warmup_steps=0, db=str(db))
            assert RunStore(db).list()[0]["status"] == "refused"


def test_calibrate_fits_a_profile_that_estimate_and_plan_apply(tmp_path, monkeypatch):
    from backend.store import RunStore
    from backend.verify import verify
    from planner.time.step import estimate_with_time
    from backend.profiles import load_profile, profile_for, save_profile
    from planner.time.profiles import fit_profile

    monkeypatch.setenv("PLANNER_PROFILES", str(tmp_path / "profiles"))
    db = tmp_path / "db"
    record = verify(request(strategy="zero1"), steps=2, warmup_steps=1, db=str(db))
    store = RunStore(db)
    runs = [(row["id"], store.get(row["id"])["record"]) for row in store.list() if row["status"] == "ok"]
    profile = fit_profile("cpu-test", runs)
    assert 0 < profile.compute_scale <= 10 and profile.compute_efficiency is None and profile.runs == [record["id"]]
    assert abs(profile.residuals[0].error_pct) < 1e-6  # one run: the fit reproduces it
    # the run timed its collectives (DeepSpeed's comms logger), so the link efficiency is fitted too
    assert record["communication"]["measured_bytes_per_step"] > 0
    assert profile.link_efficiency != 1.0 and abs(profile.communication_residuals[0].error_pct) < 1e-6
    assert list(profile.link_efficiencies.values()) == [profile.link_efficiency]  # one run, one link type
    save_profile(profile)
    assert load_profile("cpu-test").compute_scale == profile.compute_scale
    named = request(strategy="zero1", profile="cpu-test")
    timed = estimate_with_time(named, profile_for(named))
    assert timed.time is not None
    assert abs(timed.time.compute_seconds - record["measured"]["step_seconds"]) / record["measured"]["step_seconds"] < 0.01
    save_profile(profile.model_copy(update={"name": "cpu-test-nominal", "link_efficiency": 1.0, "link_efficiencies": {}}))
    nominal_request = request(strategy="zero1", profile="cpu-test-nominal")
    nominal = estimate_with_time(nominal_request, profile_for(nominal_request)).time
    assert timed.time.communication_seconds != nominal.communication_seconds  # the link efficiency is applied


def test_a_second_verify_leaves_the_first_running_and_cancellable(tmp_path, monkeypatch):
    """A verify started while another trains (same database, or another one) is refused by the
    device lock, and does not touch the first run: it stays running, and DELETE still ends it."""
    from fastapi.testclient import TestClient

    from web.app import create_app

    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    monkeypatch.setenv("PLANNER_FAULT", "hang:0:1")
    auth = {"Authorization": "Bearer s3cret"}
    db = tmp_path / "runs.sqlite"
    client = TestClient(create_app(str(db)))
    body = {"request": {"model_config": TINY, "strategy": "zero1", "gpus": 2, "gpu": "cpu", "micro_batch": 1,
                        "seq_len": 64}, "steps": 2, "warmup_steps": 1}
    first = client.post("/v1/verify", json=body, headers=auth)
    assert first.status_code == 202, first.text
    run_id = first.json()["id"]
    assert wait_until(lambda: "progress" in client.get(f"/v1/runs/{run_id}", headers=auth).json(), 240)
    (tmp_path / "second").mkdir()
    for other_db in (db, tmp_path / "elsewhere" / "runs.sqlite"):
        second = cli_verify(tmp_path / "second", other_db, fault=None)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and "another planner verify is running on the same devices" in err, err
        assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["status"] == "running"
    cancelled = client.delete(f"/v1/runs/{run_id}", headers=auth)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    work = Path(cancelled.json()["record"]["work_dir"])
    assert live_processes(work) == [] and segments(work) == []


def test_a_hanging_teardown_still_reports(tmp_path, monkeypatch):
    """A rank whose process-group teardown never returns (PLANNER_FAULT teardown-hang): its record
    is written first and the teardown is bounded, so the run reports ok (issue 26)."""
    from backend.verify import verify
    from backend.worker import TEARDOWN_SECONDS

    monkeypatch.setenv("PLANNER_FAULT", "teardown-hang:0:0")
    started = time.monotonic()
    record = verify(request(strategy="fsdp"), steps=1, warmup_steps=1, db=str(tmp_path / "db"),
                    work_dir=str(tmp_path / "w"), timeout_seconds=600)
    assert record["status"] == "ok", record["message"]
    assert time.monotonic() - started < 600 - TEARDOWN_SECONDS
    assert not live_processes(tmp_path / "w")


def test_fsdp_verify_reports_beside_a_busy_process(tmp_path):
    """An FSDP verify on 2 CPU ranks while another process keeps a core busy: the run whose ranks
    finish their steps reports (issue 26: "timeout - no result after 420 s" on a loaded machine)."""
    from backend.verify import verify

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        record = verify(request(strategy="fsdp"), steps=3, warmup_steps=1, db=str(tmp_path / "db"),
                        work_dir=str(tmp_path / "w"))
    finally:
        busy.kill()
        busy.wait()
    assert record["status"] == "ok", record["message"]
    assert [r["rank"] for r in record["measured"]["ranks"]] == [0, 1]
    assert "buffers" not in record["message"]
