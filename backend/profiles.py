"""Where calibration profiles live: one JSON file per profile in the user's data directory
(``$PLANNER_PROFILES``, else ``$XDG_DATA_HOME/planner/profiles``, else ``~/.local/share/planner/profiles``).

The core fits a profile (planner.time.profiles.fit_profile) and applies one it is given; reading the
environment and the files is this adapter's, for the CLI and the server alike. A request names
its profile (``profile``); ``profile_for`` turns the name into the typed Profile the core takes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from planner.errors import PlannerError, unknown

if TYPE_CHECKING:  # imported where a profile is read or saved: an estimate naming none never builds its schema
    from planner.time.profiles import Profile

PROFILES_ENV = "PLANNER_PROFILES"


def profiles_dir() -> Path:
    override = os.environ.get(PROFILES_ENV)
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "planner" / "profiles"


def saved_names() -> list[str]:
    directory = profiles_dir()
    return sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []


def _saved_name(name: str) -> str:
    """The saved profile a typed name means (case-insensitive), or the refusal naming the choices."""
    known = saved_names()
    folded = {n.lower(): n for n in known}
    if name.lower() in folded:
        return folded[name.lower()]
    if not known:
        raise PlannerError(f"unknown profile {name!r}; none exists yet; save one with `planner calibrate`",
                           field="profile", value=name)
    raise PlannerError(unknown("profile", name, known), field="profile", value=name)


def load_profile(name: str) -> Profile:
    from planner.time.profiles import Profile, check_profile_name

    saved = _saved_name(name)
    path = profiles_dir() / f"{check_profile_name(saved)}.json"
    try:
        return Profile.model_validate_json(path.read_text())
    except OSError as exc:
        raise PlannerError(f"profile {saved} ({path}) cannot be read ({exc.strerror})", field="profile") from None
    except ValueError as exc:
        raise PlannerError(f"profile {saved} ({path}) is not a planner profile: {str(exc).splitlines()[0]}",
                           field="profile") from None


def save_profile(profile: Profile) -> Path:
    from planner.time.profiles import check_profile_name

    directory = profiles_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{check_profile_name(profile.name)}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(profile.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def profile_for(request) -> Profile | None:
    """The profile an estimate or plan request names, read from its file; None when it names none."""
    return None if request.profile is None else load_profile(request.profile)
