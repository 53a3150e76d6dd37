"""A calibration profile's name: checked where the schema reads it (planner/schema.py) and where
a profile is made (planner/time/profiles.py), before an adapter uses it as a file name."""

from __future__ import annotations

import re

from planner.errors import PlannerError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_profile_name(name: str) -> str:
    """A profile's name, usable as a file name by whoever stores it (backend/profiles.py)."""
    if not _NAME.match(name):
        raise PlannerError(f"profile name {name!r} must be 1-64 letters, digits, '.', '_' or '-'", field="profile",
                           value=name)
    return name
