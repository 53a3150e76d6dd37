"""The backend's own refusals, in the core's error family (web/app.py maps each to its status)."""

from __future__ import annotations

from planner.errors import PlannerError


class JobConflict(PlannerError):
    """The devices are busy, or the run is not in a state the action needs (HTTP 409): raised by
    the server's runner (backend/jobs.py) and by a verify that finds its devices locked
    (backend/verify.py)."""
