"""The key tables of the job-file readers: every key a format's own loader reads is in one table,
as planner/frameworks/deepspeed/config.py keeps DeepSpeed's. A key is

- ``Modelled``: read into the request (its reader says how);
- ``Inert``: changes neither a step's memory nor its time (the reason says why);
- ``Refused``: would change memory or time in a way this model does not compute; accepted only at
  a value that changes nothing (``neutral``), refused by name otherwise;
- ``Needs``: modelled once the request schema takes ``field = value`` (a value agreed for the schema
  and added on another branch); until then it is refused by name, with the field it waits for. The
  schema is asked at run time (``schema_accepts``), so merging that branch turns it on.

A key in none of a format's tables is listed in the answer as unknown, never dropped.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Any, Callable

from planner.errors import PlannerError
from planner.schema import EstimateRequest


@dataclass(frozen=True)
class Modelled:
    reason: str = ""


@dataclass(frozen=True)
class Inert:
    reason: str


@dataclass(frozen=True)
class Refused:
    reason: str
    neutral: Callable[[Any, dict[str, Any]], bool]  # (value, the whole block) -> changes nothing
    instead: str  # what to write instead, shown in the message


@dataclass(frozen=True)
class Needs:
    field: str
    value: Any
    reason: str
    neutral: Callable[[Any, dict[str, Any]], bool]


Key = Modelled | Inert | Refused | Needs


def off(value: Any, block: dict[str, Any] | None = None) -> bool:
    """A switch left off: absent, null, false, 0, empty, or the string forms of those."""
    return value in (None, False, 0, "", [], {}) or (isinstance(value, str) and value.lower() in ("false", "no", "none",
                                                                                                   "disabled", "0"))


def equals(*values: Any) -> Callable[[Any, dict[str, Any]], bool]:
    return lambda v, _block: v is None or v in values


def schema_accepts(field: str, value: Any) -> bool:
    """Whether EstimateRequest has ``field`` and takes ``value`` in it (a Literal's member, or any
    value of a non-Literal field)."""
    info = EstimateRequest.model_fields.get(field)
    if info is None:
        return False
    annotation = info.annotation
    choices = [a for arg in (annotation, *typing.get_args(annotation)) if typing.get_origin(arg) is typing.Literal
               for a in typing.get_args(arg)]
    return value in choices if choices else True


@dataclass(frozen=True)
class Where:
    """A file being read: its name (as given) and text, for the line of a key."""

    name: str
    text: str
    # (key as the reader names it, key as the file writes it): a format that spells another's keys
    # its own way (axolotl's fsdp_config without accelerate's fsdp_ prefix) is read with the other's
    # table, and every line found and message given names the key as written
    aliases: tuple[tuple[str, str], ...] = ()

    def written(self, key: str) -> str:
        return dict(self.aliases).get(key, key)

    def line(self, key: str) -> int | None:
        """The line that sets ``key``: its last dotted part as ``key:`` (YAML), ``key =`` (TOML),
        ``"key":`` (JSON) or ``--section.key`` (a command line), after the line that opens each
        section before it (``[section]``, ``section:``), so a key name two sections share is found
        in its own."""
        lines = self.text.splitlines()
        start = 0
        *sections, last = self.written(key).split(".")
        for section in sections:
            found = self._find(lines, section, start, header=True)
            if found is not None:
                start = found
        found = self._find(lines, last, start, header=False)
        return None if found is None else found + 1

    @staticmethod
    def _find(lines: list[str], name: str, start: int, header: bool) -> int | None:
        word = re.escape(name)
        pattern = re.compile(rf"""(^|\s|[{{,]|--[\w.]*?)["']?{word}["']?\s*[:=\s]""")
        table = re.compile(rf"^\s*\[([\w.\-]+\.)?{word}(\.[\w.\-]+)?\]")
        for number in range(start, len(lines)):
            text = lines[number]
            if text.lstrip().startswith("#"):
                continue
            if (header and table.search(text)) or pattern.search(text):
                return number
        return None

    def at(self, key: str) -> str:
        line = self.line(key)
        return f"{self.name}:{line}" if line else self.name

    def error(self, key: str, message: str) -> PlannerError:
        shown = self.written(key)
        return PlannerError(f"{self.at(key)}: {shown}: {message}", field=f"files.{self.name}.{shown}")


def check_block(block: dict[str, Any], table: dict[str, Key], where: Where, prefix: str = "") -> list[str]:
    """Refuse what the table refuses at a value that changes something; return the keys in no
    table (dotted with ``prefix``), to be listed in the answer."""
    unknown = []
    for key, value in block.items():
        name = f"{prefix}{key}"
        rule = table.get(key)
        if rule is None:
            unknown.append(name)
        elif isinstance(rule, Refused) and not rule.neutral(value, block):
            raise where.error(name, f"{_shown(value)} is not modelled: {rule.reason}; the estimate would be wrong, "
                                    f"so it is refused (use {rule.instead})")
        elif isinstance(rule, Needs) and not rule.neutral(value, block) and not schema_accepts(rule.field, rule.value):
            raise where.error(name, f"{_shown(value)} is not modelled yet: {rule.reason}; it needs the request field "
                                    f"{rule.field}={rule.value!r}, which this build's schema does not have, so it is "
                                    "refused")
    return unknown


def needs_met(rule: Key, value: Any, block: dict[str, Any]) -> bool:
    """A Needs key at a value that changes something, and the schema takes it: the reader sets it."""
    return isinstance(rule, Needs) and not rule.neutral(value, block) and schema_accepts(rule.field, rule.value)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"({text[:77]}...)" if len(text) > 80 else f"({text})"


def table_rows(table: dict[str, Key]) -> list[tuple[str, str, str]]:
    """(key, kind, reason) for the docs."""
    rows = []
    for key, rule in table.items():
        kind = type(rule).__name__.lower()
        reason = rule.reason
        if isinstance(rule, Needs) and schema_accepts(rule.field, rule.value):
            kind = "modelled"  # this build's schema takes the value: the key is read into it
            reason = f"{reason} ({rule.field}={rule.value!r})"
        elif isinstance(rule, Needs):
            reason = f"{reason} (needs {rule.field}={rule.value!r})"
        rows.append((key, kind, reason))
    return rows
