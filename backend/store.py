"""The runs database: one SQLite file, a versioned schema, every write in one transaction.

Only commands that record a run (verify) create the file; reading (`planner runs`, the API's GET
routes, calibrate) never creates, migrates or changes anything. A file that is not empty and not
a planner runs database (another program's SQLite file, a corrupt file, a device such as
/dev/null) is refused untouched.

A run that is 'running' is alive exactly as long as the process that owns it (pid and start time,
recorded at start): when that process is gone the run is 'interrupted', not sooner, whatever its age.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

from backend.procs import alive, identity
from planner.errors import PlannerError

SCHEMA_VERSION = 2
APPLICATION_ID = 0x706C6E72  # "plnr" in the SQLite header (https://www.sqlite.org/pragma.html#pragma_application_id)
OWN_TABLES = {"runs", "schema_version"}
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
    # the run's owner: the planner process (pid, start time in clock ticks) on this host
    2: """
    ALTER TABLE runs ADD COLUMN owner_pid INTEGER;
    ALTER TABLE runs ADD COLUMN owner_start INTEGER;
    ALTER TABLE runs ADD COLUMN owner_host TEXT;
    """,
}
LIST_COLUMNS = ("id", "created", "finished", "status", "message", "model", "strategy", "world_size", "device",
                "predicted_peak_bytes", "measured_peak_bytes", "predicted_resident_bytes",
                "measured_resident_bytes", "step_seconds")


class StoreError(PlannerError):
    """The database itself is unusable (not ours, corrupt, unreadable): a fault of the server's
    set-up, not of the request (HTTP 503, CLI exit 2)."""


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


def _owner_gone(row: dict[str, Any], host: str) -> bool:
    """A 'running' row whose owner process is gone. A row of another host cannot be judged here
    and stays as it is; a row without an owner was written by planner < schema 2, whose runs
    never outlived their command, so it is over."""
    if row.get("owner_host") not in (None, host):
        return False
    return row.get("owner_pid") is None or not alive(row["owner_pid"], row.get("owner_start"))


OWNER_GONE = "interrupted: the planner process that owned the run ended before the run finished"


class RunStore:
    """``create``: make the file and its schema if missing (commands that record a run). Without
    it a missing file is an empty store and nothing is created."""

    def __init__(self, path: str | Path | None = None, *, create: bool = False):
        self.path = Path(path) if path else default_db_path()
        self.host = platform.node()
        try:
            info = self.path.stat()
        except FileNotFoundError:
            info = None
        except OSError as exc:
            raise StoreError(f"--db {self.path}: cannot be read ({exc.strerror})") from None
        if info is not None and not stat.S_ISREG(info.st_mode):
            raise StoreError(f"--db {self.path}: not a regular file; give the path of a runs database file")
        self.exists = info is not None
        if not self.exists and not create:
            return
        if create:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"--db {self.path}: cannot create its directory ({exc.strerror})") from None
            if self.exists:  # refuse a foreign or corrupt file before any write lock or journal
                with self._connect(readonly=True) as db:
                    self._check(db)
            self._initialise()
            self.exists = True
        else:
            with self._connect(readonly=True) as db:
                self._check(db)

    @contextmanager
    def _connect(self, readonly: bool = False) -> Iterator[sqlite3.Connection]:
        uri = f"file:{quote(str(self.path.absolute()))}?mode={'ro' if readonly else 'rwc'}"
        try:
            connection = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"--db {self.path}: cannot open ({exc})") from None
        try:
            connection.row_factory = sqlite3.Row
            yield connection
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"--db {self.path}: not a usable planner runs database ({exc})") from None
        finally:
            connection.close()

    def _check(self, db: sqlite3.Connection) -> int:
        """The schema version of our database; 0 for an empty file; refuse anything else."""
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}
        if not names:
            return 0
        if not OWN_TABLES <= names:
            shown = ", ".join(sorted(names)[:6])
            raise StoreError(f"--db {self.path}: an SQLite database of another program (it has {shown}); "
                             "refusing to touch it: give a new file or a planner runs database")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        version = row[0] if row else 0
        if version > SCHEMA_VERSION:
            raise StoreError(f"--db {self.path}: schema version {version} is newer than this planner "
                             f"({SCHEMA_VERSION}); upgrade planner")
        return version

    def _initialise(self) -> None:
        """Create the schema in an empty file, or migrate ours; WAL is set once, in our file only."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                version = self._check(db)
                if version == 0:
                    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                for target in range(version + 1, SCHEMA_VERSION + 1):  # statement by statement: executescript would commit
                    for statement in MIGRATIONS[target].split(";"):
                        if statement.strip():
                            db.execute(statement)
                if version == 0:
                    db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                    db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                elif version < SCHEMA_VERSION:
                    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            if version == 0:
                db.execute("PRAGMA journal_mode=WAL")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection | None]:
        """A connection for a write to an existing database of ours (migrated first); None when
        there is no file, which a write of a non-creating store never makes."""
        if not self.exists:
            yield None
            return
        self._initialise()
        with self._connect() as db:
            yield db

    def start(self, record: dict[str, Any]) -> int:
        request = record["request"]
        pid, start = identity()
        with self._write() as db:
            if db is None:
                raise StoreError(f"--db {self.path}: no database (open it with create=True to record runs)")
            cursor = db.execute(
                "INSERT INTO runs (created, status, model, strategy, world_size, device, predicted_peak_bytes,"
                " predicted_resident_bytes, record, owner_pid, owner_start, owner_host)"
                " VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (time.time(), record["model"], request["strategy"], request["gpus"] * request["nodes"],
                 request["gpu"], record["prediction"]["per_device"]["peak_bytes"],
                 record["prediction"]["per_device"]["resident_bytes"], json.dumps(record), pid, start, self.host))
            return int(cursor.lastrowid)

    def finish(self, run_id: int, record: dict[str, Any]) -> None:
        measured = record.get("measured") or {}
        with self._write() as db:
            if db is None:
                return
            db.execute(
                "UPDATE runs SET finished = ?, status = ?, message = ?, measured_peak_bytes = ?,"
                " measured_resident_bytes = ?, step_seconds = ?, record = ? WHERE id = ?",
                (time.time(), record["status"], record.get("message", ""), measured.get("peak_bytes"),
                 measured.get("resident_bytes"), measured.get("step_seconds"), json.dumps(record), run_id))

    def interrupt(self, run_id: int, message: str) -> bool:
        """Mark one running run interrupted, with its finished time; False if it was not running."""
        with self._write() as db:
            if db is None:
                return False
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT status, record FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None or row["status"] != "running":
                db.execute("ROLLBACK")
                return False
            now = time.time()
            record = json.loads(row["record"]) | {"status": "interrupted", "message": message, "finished": now}
            db.execute("UPDATE runs SET status = 'interrupted', message = ?, finished = ?, record = ? WHERE id = ?",
                       (message, now, json.dumps(record), run_id))
            db.execute("COMMIT")
            return True

    def mark_interrupted(self) -> int:
        """Runs left 'running' by an owner that is gone (a crash, a kill, a restart). A run whose
        owner lives, however old, is left alone: it is training, and it can still be cancelled."""
        if not self.exists:
            return 0
        with self._connect(readonly=True) as db:
            if self._check(db) == 0:
                return 0
            rows = [dict(r) for r in db.execute("SELECT * FROM runs WHERE status = 'running'")]
        return sum(self.interrupt(row["id"], OWNER_GONE) for row in rows if _owner_gone(row, self.host))

    def _present(self, row: dict[str, Any]) -> dict[str, Any]:
        """A read shows the truth without writing: a 'running' row whose owner is gone reads as
        interrupted (the next verify or server start records it so)."""
        if row.get("status") == "running" and _owner_gone(row, self.host):
            row.update(status="interrupted", message=OWNER_GONE)
            if isinstance(row.get("record"), dict):
                row["record"] = row["record"] | {"status": "interrupted", "message": OWNER_GONE}
        return row

    def list(self, limit: int = 100) -> list[dict[str, Any]]:
        if not self.exists:
            return []
        with self._connect(readonly=True) as db:
            if self._check(db) == 0:
                return []
            present = {r[1] for r in db.execute("PRAGMA table_info(runs)")}
            owner = [c for c in ("owner_pid", "owner_start", "owner_host") if c in present]
            rows = db.execute(f"SELECT {', '.join(LIST_COLUMNS + tuple(owner))} FROM runs ORDER BY id DESC LIMIT ?",
                              (limit,)).fetchall()
        out = []
        for r in rows:
            row = self._present(dict(r))
            out.append({k: row[k] for k in LIST_COLUMNS})
        return out

    def get(self, run_id: int) -> dict[str, Any]:
        if not 1 <= run_id < 2**63:  # a SQLite rowid
            raise PlannerError(f"no run with id {run_id} in {self.path}: run ids are positive 64-bit integers")
        row = None
        if self.exists:
            with self._connect(readonly=True) as db:
                if self._check(db):
                    row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise PlannerError(f"no run with id {run_id} in {self.path}")
        out = dict(row)
        out["record"] = json.loads(out["record"])
        out = self._present(out)
        for column in ("owner_pid", "owner_start", "owner_host"):
            out.pop(column, None)
        return out
