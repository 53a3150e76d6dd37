"""The model catalogue (models.yaml) and user-supplied model files."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.architecture import Architecture, from_hf_config, parameter_count
from planner.errors import PlannerError, UnknownModelError, unknown

CATALOGUE_PATH = Path(__file__).parent / "data" / "models.yaml"
MAX_MODEL_FILE_BYTES = 1 << 20  # a config.json is a few KiB; anything this large is not one


class ModelEntry(BaseModel):
    """One catalogue entry: a real architecture and where its numbers come from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="catalogue name, used with --model")
    family: str = Field(description="architecture family (the Hugging Face model_type)")
    source: str = Field(pattern=r"^https://", description="official config.json the numbers come from")
    config: dict[str, Any] = Field(description="Hugging Face config fields, including model_type")


class ResolvedModel(BaseModel):
    """A model ready for the memory model: its name, architecture and parameter count."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str
    config: dict[str, Any] | None
    architecture: Architecture | None
    parameters: int


def _parse_text(text: str, source: str) -> Any:
    try:  # JSON first: PyYAML (YAML 1.1) reads JSON's 1e-05, as in every Llama config.json, as a string
        return json.loads(text)
    except ValueError:
        pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML/JSON"
        raise PlannerError(f"{source}: malformed YAML/JSON{where}: {problem}") from None


@lru_cache(maxsize=4)
def load_catalogue(path: Path = CATALOGUE_PATH) -> dict[str, ModelEntry]:
    data = _parse_text(path.read_text(), str(path))
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise PlannerError(f"{path}: expected a mapping with a 'models' list")
    entries: dict[str, ModelEntry] = {}
    for index, raw in enumerate(data["models"]):
        where = f"{path}: models[{index}]"
        try:
            entry = ModelEntry.model_validate(raw)
        except ValidationError as exc:
            raise PlannerError(f"{where}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
        if entry.name in entries:
            raise PlannerError(f"{where}: duplicate name {entry.name!r}")
        if entry.config.get("model_type") != entry.family:
            raise PlannerError(
                f"{where} ({entry.name}): family {entry.family!r} contradicts "
                f"config.model_type {entry.config.get('model_type')!r}")
        from_hf_config(entry.config, source=f"{where} ({entry.name})")  # refuse what cannot be read
        entries[entry.name] = entry
    return entries


def catalogue_model(name: str) -> ResolvedModel:
    entries = load_catalogue()
    entry = entries.get(name) or _case_insensitive(entries, name)
    if entry is None:
        raise UnknownModelError(unknown("model", name, list(entries)))
    return _resolve(entry.name, entry.source, entry.config)


def _case_insensitive(entries: dict[str, ModelEntry], name: str) -> ModelEntry | None:
    lowered = {key.lower(): value for key, value in entries.items()}
    return lowered.get(name.lower())


def _resolve(name: str, source: str, config: dict[str, Any]) -> ResolvedModel:
    architecture = from_hf_config(config, source=name)
    return ResolvedModel(name=name, source=source, config=config, architecture=architecture,
                         parameters=parameter_count(architecture))


def model_from_config(config: dict[str, Any], name: str = "custom") -> ResolvedModel:
    """A user's architecture: a Hugging Face config.json, or {name?, config: {...}} as in the catalogue."""
    if not isinstance(config, dict):
        raise PlannerError(f"model_config must be a JSON object, got {type(config).__name__}")
    if "config" in config and "model_type" not in config:
        inner = config["config"]
        if not isinstance(inner, dict):
            raise PlannerError(f"model_config.config must be a mapping, got {type(inner).__name__}")
        name = str(config.get("name", name))
        config = inner
    cleaned = {k: v for k, v in config.items() if not k.startswith("_")}
    return _resolve(name, "user config", cleaned)


def model_from_file(path: str | Path) -> ResolvedModel:
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_MODEL_FILE_BYTES:
            raise PlannerError(f"--model-file {path}: {size} bytes is too large for a model config "
                               f"(limit {MAX_MODEL_FILE_BYTES})")
        text = path.read_text()
    except OSError as exc:
        raise PlannerError(f"--model-file {path}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise PlannerError(f"--model-file {path}: not a text file") from None
    data = _parse_text(text, f"--model-file {path}")
    resolved = model_from_config(data, name=path.stem)
    return resolved.model_copy(update={"source": str(path)})


def raw_parameters(count: int) -> ResolvedModel:
    """Only a parameter count: model states can be computed, activations cannot."""
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise PlannerError(f"params must be a positive whole number, got {count!r}")
    if count > 10**14:
        raise PlannerError(f"params({count}) is absurd: over 100 trillion parameters")
    return ResolvedModel(name=f"{count} parameters", source="--params", config=None,
                         architecture=None, parameters=count)


def parse_json_text(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{field}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
