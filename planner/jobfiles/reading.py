"""What a reader gets out of one file: request fields (EstimateRequest's names), where each came
from, the job's length, and the keys it could not place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planner.jobfiles.keys import Where


@dataclass
class Reading:
    format: str
    where: Where
    fields: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # request field -> "file:line key"
    steps: int | None = None
    epochs: float | None = None
    unknown: list[str] = field(default_factory=list)  # keys in none of the format's tables
    notes: list[str] = field(default_factory=list)
    # the DeepSpeed JSON this file names: (key, path as written); read from the given files
    ds_reference: tuple[str, str] | None = None
    # request fields that only fill what no other file sets (a class's default, not the user's value)
    defaults: dict[str, Any] = field(default_factory=dict)

    def set(self, name: str, value: Any, key: str) -> None:
        self.fields[name] = value
        self.origin[name] = f"{self.where.at(key)} {self.where.written(key)}"

    def default(self, name: str, value: Any) -> None:
        self.defaults[name] = value


def whole(value: Any, where: Where, key: str, minimum: int = 1) -> int:
    """A whole number as YAML/TOML/JSON/a command line write it (4, 4.0, "4")."""
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            raise where.error(key, f"must be a whole number, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.error(key, f"must be a whole number, got {value!r}")
    if value < minimum:
        raise where.error(key, f"must be at least {minimum}, got {value}")
    return value


def flag(value: Any, where: Where, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise where.error(key, f"must be true or false, got {value!r}")


def clipping_norm(value: Any, where: Where, key: str) -> bool:
    """A gradient-clipping threshold (TrainingArguments.max_grad_norm, DeepSpeed's gradient_clipping): whether
    it clips. Both clip only above 0 (transformers 5.25 trainer.py line 1975 ``max_grad_norm > 0``; DeepSpeed
    0.19.8 runtime/engine.py ``gradient_clipping() > 0.0``), so 0 or a negative value turns clipping off."""
    if isinstance(value, bool):
        raise where.error(key, f"must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise where.error(key, f"must be a number, got {value!r}") from None
    if out != out or out == float("inf"):
        raise where.error(key, f"must be a finite number, got {value!r}")
    return out > 0


def number(value: Any, where: Where, key: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise where.error(key, f"must be a number, got {value!r}") from None
    if out != out or out <= 0 or out == float("inf"):
        raise where.error(key, f"must be a positive number, got {value!r}")
    return out
