"""Verify runs started by a long-lived process (the server), one at a time per device set, each on
a worker thread; their records live in the runs database as the CLI's do.

The runner speaks the core's error family, not HTTP: a busy device set or a run that is not
running is a ``JobConflict`` (the API answers 409), an unusable database a ``StoreError`` (503),
a request that cannot run a ``PlannerError`` with its field (422). web/app.py maps them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from backend.errors import JobConflict
from planner.errors import PlannerError
from planner.schema import EstimateRequest


class Stop(threading.Event):
    """A run's cancel signal, with the state it ends in: 'cancelled' by DELETE, 'interrupted' when
    the server stops."""

    status, message = "cancelled", "cancelled"

    def interrupt(self, message: str) -> None:
        self.status, self.message = "interrupted", message
        self.set()


class Jobs:
    """Verify runs, one at a time per device set, on a worker thread; records live in the runs DB."""

    def __init__(self, db: str | None):
        self.db = db
        self.lock = threading.Lock()
        self.cancels: dict[int, Stop] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.busy: set[str] = set()
        self.progress: dict[int, tuple[int, int]] = {}  # run id -> (steps done, steps in all)

    def store(self):
        """The runs database for reading: never created here (a verify creates it)."""
        from backend.store import RunStore

        return RunStore(self.db)

    def start(self, request: EstimateRequest, *, steps: int, warmup_steps: int,
              timeout_seconds: float | None = None) -> int:
        """The new run's id, once its record exists; the reason it could not start otherwise."""
        from backend.verify import verify

        devices = request.gpu
        with self.lock:
            if devices in self.busy:
                raise JobConflict(f"a verify run is already running on {devices}; wait or cancel it", field="gpu")
            self.busy.add(devices)
        started = threading.Event()
        holder: dict[str, Any] = {}
        cancel = Stop()

        def on_start(run_id: int) -> None:
            holder["id"] = run_id
            self.cancels[run_id] = cancel
            self.threads[run_id] = threading.current_thread()
            started.set()

        def on_progress(done: int, total: int) -> None:
            if "id" in holder:
                self.progress[holder["id"]] = (done, total)

        def work() -> None:
            try:
                verify(request, steps=steps, warmup_steps=warmup_steps, timeout_seconds=timeout_seconds, db=self.db,
                       cancel=cancel, on_start=on_start, on_progress=on_progress)
            except Exception as exc:  # recorded by verify() as refused; keep the reason for the caller
                holder["error"] = exc
            finally:
                with self.lock:
                    self.busy.discard(devices)
                started.set()

        threading.Thread(target=work, daemon=True, name=f"verify-{devices}").start()
        started.wait(timeout=60)
        if "id" not in holder:
            error = holder.get("error")
            if isinstance(error, PlannerError):
                raise error
            raise PlannerError(str(error or "the run could not start"))
        return holder["id"]

    def cancel(self, run_id: int) -> dict[str, Any]:
        run = self.store().get(run_id)
        event = self.cancels.get(run_id)
        if run["status"] != "running":
            raise JobConflict(f"run {run_id} is {run['status']}, not running")
        if event is None:
            raise JobConflict(f"run {run_id} is running in another planner process (a CLI verify or "
                              "another server); end it there: Ctrl-C or SIGTERM")
        event.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.store().get(run_id)["status"] == "running":
            time.sleep(0.2)
        return self.store().get(run_id)

    def interrupt_all(self, message: str, wait_seconds: float = 60.0) -> None:
        """End every run of this process, recorded as interrupted (the server is stopping)."""
        running = [(i, t) for i, t in self.threads.items() if t.is_alive()]
        for run_id, _ in running:
            self.cancels[run_id].interrupt(message)
        deadline = time.monotonic() + wait_seconds
        for _, thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
