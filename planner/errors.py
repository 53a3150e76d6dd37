"""The one exception family users see. Adapters map it to exit code 2 / HTTP 404 or 422.

An error names the request field it is about as data (``field``, a dotted path into the request:
``hsdp_shard_size``, ``model_config.hidden_size``, ``ds_config.zero_optimization.stage``) and,
where the message does not already quote it, the rejected ``value``. The core never names a CLI
flag or an HTTP location: the API turns ``field`` into the 422 body's ``loc``, the CLI into its
``--flag``.
"""

from __future__ import annotations

from typing import Any

NO_VALUE: Any = type("NoValue", (), {"__repr__": lambda self: "NO_VALUE", "__bool__": lambda self: False})()


class PlannerError(ValueError):
    """Invalid input or an impossible request; the message names the field and the value.

    ``field``: the request field it is about (dotted, None when it is about the request as a
    whole); ``value``: the rejected value, given when the message does not quote it itself (then
    adapters show it beside the field, as they show a schema error's input)."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = NO_VALUE):
        super().__init__(message)
        self.field = field
        self.value = value

    def within(self, prefix: str) -> PlannerError:
        """This error, its field placed under ``prefix``: a config read from inside a request field
        (``hidden_size`` of the request's ``model_config`` is ``model_config.hidden_size``)."""
        self.field = f"{prefix}.{self.field}" if self.field else prefix
        return self


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
