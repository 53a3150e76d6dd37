"""The runs database, the device lock and the launch environment, without training: a read
creates nothing, a file that is not ours is refused unchanged, a run is interrupted only when its
owner process is gone, the devices are locked per host (not per database), no token reaches a rank."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from backend.procs import identity
from backend.store import MIGRATIONS, RunStore, StoreError
from cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def _record(model: str = "gpt2") -> dict:
    return {"model": model, "request": {"strategy": "zero2", "gpus": 2, "nodes": 1, "gpu": "cpu"},
            "prediction": {"per_device": {"peak_bytes": 1, "resident_bytes": 1}}, "status": "running"}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _foreign(path: Path) -> Path:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        db.execute("INSERT INTO users (name) VALUES ('ada')")
    return path


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_reading_creates_nothing(tmp_path, capsys):
    db = tmp_path / "not" / "yet" / "runs.sqlite"
    assert main(["runs", "--db", str(db)]) == 0
    assert main(["runs", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1]) == []
    assert main(["runs", "7", "--db", str(db)]) == 2
    assert "no run with id 7" in capsys.readouterr().err
    assert not (tmp_path / "not").exists()
    assert RunStore(db).list() == [] and RunStore(db).mark_interrupted() == 0 and not (tmp_path / "not").exists()


@pytest.mark.parametrize("argv", [["runs"], ["runs", "1"], ["serve"], ["calibrate", "--name", "x"]])
def test_another_programs_database_is_refused_unchanged(tmp_path, capsys, argv):
    db = _foreign(tmp_path / "app.sqlite")
    before, files = _digest(db), _siblings(db)
    assert main(argv + ["--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an SQLite database of another program (it has users)" in err, err
    assert _digest(db) == before and _siblings(db) == files  # no table added, no WAL, no journal
    with pytest.raises(StoreError, match="another program"):
        RunStore(db, create=True)  # not even a verify writes to it
    assert _digest(db) == before and _siblings(db) == files
    with sqlite3.connect(db) as check:
        assert check.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


@pytest.mark.parametrize("argv", [["runs"], ["serve"]])
def test_a_corrupt_database_is_refused_with_the_reason(tmp_path, capsys, argv):
    db = tmp_path / "runs.sqlite"
    db.write_bytes(b"this is not a database, it only has its name" * 100)
    assert main(argv + ["--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert f"--db {db}" in err and "not a usable planner runs database (file is not a database)" in err, err


def test_dev_null_is_refused_and_nothing_is_left_beside_it(capsys):
    journal = Path("/dev/null-journal")
    existed = journal.exists()
    assert main(["runs", "--db", "/dev/null"]) == 2
    assert "--db /dev/null: not a regular file" in capsys.readouterr().err
    with pytest.raises(StoreError, match="not a regular file"):
        RunStore("/dev/null", create=True)
    assert journal.exists() == existed


def test_a_run_is_interrupted_only_when_its_owner_is_gone(tmp_path):
    store = RunStore(tmp_path / "runs.sqlite", create=True)
    mine = store.start(_record("alive"))  # owned by this (live) process, however old
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    gone = store.start(_record("gone"))
    reused = store.start(_record("reused"))
    pid, start = identity()
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE runs SET created = 0, owner_start = ? WHERE id = ?", (start, mine))
        db.execute("UPDATE runs SET owner_pid = ? WHERE id = ?", (dead_pid, gone))
        db.execute("UPDATE runs SET owner_start = ? WHERE id = ?", (start - 1, reused))  # same pid, another process
    # a read already tells the truth, without writing
    assert {r["model"]: r["status"] for r in store.list()} == {"alive": "running", "gone": "interrupted",
                                                                "reused": "interrupted"}
    assert store.mark_interrupted() == 2
    assert store.get(mine)["status"] == "running" and store.get(mine)["finished"] is None
    for run_id in (gone, reused):
        run = store.get(run_id)
        assert run["status"] == "interrupted" and run["finished"] is not None
        assert run["record"]["status"] == "interrupted" and "owned the run ended" in run["message"]
    assert store.interrupt(gone, "again") is False  # only a running run is interrupted


def test_a_schema_1_database_is_read_as_is_and_migrated_by_a_write(tmp_path):
    path = tmp_path / "runs.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        db.execute("INSERT INTO schema_version VALUES (1)")
        for statement in MIGRATIONS[1].split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute("INSERT INTO runs (created, status, model, strategy, world_size, device, record) "
                   "VALUES (1, 'ok', 'old', 'zero2', 2, 'cpu', '{}')")
    before = _digest(path)
    assert [r["model"] for r in RunStore(path).list()] == ["old"] and _digest(path) == before
    store = RunStore(path, create=True)
    new = store.start(_record("new"))
    assert [r["model"] for r in store.list()] == ["new", "old"] and store.get(new)["status"] == "running"


def test_the_device_lock_is_per_host_and_device_not_per_database(monkeypatch, tmp_path):
    from backend.verify import LOCK_DIR, device_lock, device_names, lock_dir
    from planner.errors import PlannerError
    from planner.schema import EstimateRequest

    monkeypatch.delenv("PLANNER_LOCK_DIR", raising=False)
    assert lock_dir() == LOCK_DIR == Path("/tmp/planner-locks")
    monkeypatch.setenv("PLANNER_LOCK_DIR", str(tmp_path / "locks"))
    cpu = EstimateRequest(model="gpt2", gpu="cpu", gpus=2, strategy="zero2")
    gpus = EstimateRequest(model="gpt2", gpu="h100-80gb", gpus=2, strategy="zero2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_names(cpu) == ["cpu"] and device_names(gpus) == ["cuda-0", "cuda-1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,0")
    assert device_names(gpus) == ["cuda-3", "cuda-1"]
    with device_lock(gpus):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # shares device 1 with the run above
        with pytest.raises(PlannerError, match=r"same devices \(cuda-1, pid \d+\)"):
            with device_lock(gpus.model_copy(update={"gpus": 1})):
                pass
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # a free device
        with device_lock(gpus.model_copy(update={"gpus": 1})):
            pass
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,0")  # two visible again: a 2-GPU run needs two
    with device_lock(gpus):  # released with its holder
        pass


def test_the_api_token_never_reaches_a_rank(monkeypatch):
    from backend.job import VerifyJob
    from backend.launch import _environment

    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    monkeypatch.setenv("PLANNER_API_TOKEN_FILE", "/etc/planner-token")
    job = VerifyJob(model_config={"model_type": "llama"}, attn_implementation="sdpa", checkpointing="none",
                    micro_batch=1, seq_len=8, gradient_accumulation=1, steps=1, warmup_steps=0, device="cpu",
                    dist_backend="gloo", out_dir="/tmp/run", framework="deepspeed", ds_config={})
    env = _environment(job)
    assert "PLANNER_API_TOKEN" not in env and "PLANNER_API_TOKEN_FILE" not in env and env["DS_ACCELERATOR"] == "cpu"
