"""The one exception family users see. Adapters map it to exit code 2 / HTTP 404 or 422."""


class PlannerError(ValueError):
    """Invalid input or an impossible request; the message names the field and the value."""


class UnknownModelError(PlannerError):
    """A model name that is not in the catalogue (HTTP 404)."""


class UnknownNameError(PlannerError):
    """Any other catalogue look-up that failed: a GPU, a topology preset (HTTP 404)."""


def unknown(kind: str, name: str, known: list[str]) -> str:
    """The message for a failed look-up: the closest names as a hint, then every choice."""
    import difflib

    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"unknown {kind} {name!r}{hint}; choose from {', '.join(sorted(known))}"
