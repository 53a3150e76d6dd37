"""The runs database: one SQLite file, a versioned schema, every write in one transaction."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from planner.errors import PlannerError

SCHEMA_VERSION = 1
# Each entry migrates from version N-1 to N; a database newer than this release is refused.
MIGRATIONS: dict[int, str] = {
    1: """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        created REAL NOT NULL,
        finished REAL,
        status TEXT NOT NULL,
        message TEXT NOT NULL DEFAULT '',
        model TEXT NOT NULL,
        strategy TEXT NOT NULL,
        world_size INTEGER NOT NULL,
        device TEXT NOT NULL,
        predicted_peak_bytes INTEGER,
        measured_peak_bytes INTEGER,
        predicted_resident_bytes INTEGER,
        measured_resident_bytes INTEGER,
        step_seconds REAL,
        record TEXT NOT NULL
    );
    CREATE INDEX runs_created ON runs (created);
    """,
}


def default_db_path() -> Path:
    override = os.environ.get("PLANNER_DB")
    if override:
        return Path(override)
    try:
        from platformdirs import user_data_dir

        base = Path(user_data_dir("planner", appauthor=False))
    except ImportError:
        base = Path.home() / ".local" / "share" / "planner"
    return base / "runs.sqlite"


class RunStore:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_db_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PlannerError(f"--db {self.path}: cannot create its directory ({exc.strerror})") from None
        self._migrate()

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            connection = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        except sqlite3.Error as exc:
            raise PlannerError(f"--db {self.path}: cannot open ({exc})") from None
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.row_factory = sqlite3.Row
            yield connection
        except sqlite3.DatabaseError as exc:
            raise PlannerError(f"--db {self.path}: not a planner runs database ({exc})") from None
        finally:
            connection.close()

    def _migrate(self) -> None:
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                row = db.execute("SELECT version FROM schema_version").fetchone()
                version = row[0] if row else 0
                if version > SCHEMA_VERSION:
                    raise PlannerError(f"--db {self.path}: schema version {version} is newer than this "
                                       f"planner ({SCHEMA_VERSION}); upgrade planner")
                for target in range(version + 1, SCHEMA_VERSION + 1):  # statement by statement: executescript would commit
                    for statement in MIGRATIONS[target].split(";"):
                        if statement.strip():
                            db.execute(statement)
                if row is None:
                    db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                elif version < SCHEMA_VERSION:
                    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def start(self, record: dict[str, Any]) -> int:
        request = record["request"]
        with self._connect() as db:
            cursor = db.execute(
                "INSERT INTO runs (created, status, model, strategy, world_size, device, predicted_peak_bytes,"
                " predicted_resident_bytes, record) VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?)",
                (time.time(), record["model"], request["strategy"], request["gpus"] * request["nodes"],
                 request["gpu"], record["prediction"]["per_device"]["peak_bytes"],
                 record["prediction"]["per_device"]["resident_bytes"], json.dumps(record)))
            return int(cursor.lastrowid)

    def finish(self, run_id: int, record: dict[str, Any]) -> None:
        measured = record.get("measured") or {}
        with self._connect() as db:
            db.execute(
                "UPDATE runs SET finished = ?, status = ?, message = ?, measured_peak_bytes = ?,"
                " measured_resident_bytes = ?, step_seconds = ?, record = ? WHERE id = ?",
                (time.time(), record["status"], record.get("message", ""), measured.get("peak_bytes"),
                 measured.get("resident_bytes"), measured.get("step_seconds"), json.dumps(record), run_id))

    def mark_interrupted(self) -> int:
        """Runs left 'running' by a process that is gone (a crash, a restart)."""
        with self._connect() as db:
            return db.execute("UPDATE runs SET status = 'interrupted', message = 'the planner process ended "
                              "before the run finished' WHERE status = 'running' AND finished IS NULL "
                              "AND created < ?", (time.time() - 1,)).rowcount

    def list(self, limit: int = 100) -> list[dict[str, Any]]:
        with self._connect() as db:
            rows = db.execute("SELECT id, created, finished, status, message, model, strategy, world_size, device,"
                              " predicted_peak_bytes, measured_peak_bytes, predicted_resident_bytes,"
                              " measured_resident_bytes, step_seconds FROM runs ORDER BY id DESC LIMIT ?",
                              (limit,)).fetchall()
        return [dict(r) for r in rows]

    def get(self, run_id: int) -> dict[str, Any]:
        if not 1 <= run_id < 2**63:  # a SQLite rowid
            raise PlannerError(f"no run with id {run_id} in {self.path}: run ids are positive 64-bit integers")
        with self._connect() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise PlannerError(f"no run with id {run_id} in {self.path}")
        out = dict(row)
        out["record"] = json.loads(out["record"])
        return out
