"""The model catalogue (models.yaml) and user-supplied model files."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.model.architecture import LOADED_CLASS, READERS, Architecture, from_hf_config, parameter_count
from planner.datafile import load_data_yaml
from planner.errors import PlannerError, UnknownModelError, unknown

CATALOGUE_PATH = Path(__file__).parents[1] / "data" / "models.yaml"
MAX_MODEL_FILE_BYTES = 1 << 20  # a config.json is a few KiB; anything this large is not one
_HUB_SOURCE = re.compile(r"^https://huggingface\.co/([\w.-]+/[\w.-]+)/(?:blob|resolve)/[^/]+/config\.json$")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")  # huggingface_hub's repo id shape


class ModelEntry(BaseModel):
    """One catalogue entry: a real architecture and where its numbers come from."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)  # built when models.yaml is read

    name: str = Field(description="catalogue name, used with --model")
    family: str = Field(description="architecture family (the Hugging Face model_type)")
    source: str = Field(pattern=r"^https://", description="official config.json the numbers come from")
    config: dict[str, Any] = Field(description="Hugging Face config fields, including model_type")
    aliases: tuple[str, ...] = Field(default=(), description="other names people type for it (a Hub id, -instruct)")

    @property
    def hub_id(self) -> str | None:
        """The Hugging Face repository the source config.json is in (``org/name``)."""
        match = _HUB_SOURCE.match(self.source)
        return match.group(1) if match else None

    @property
    def all_aliases(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.aliases, *((self.hub_id,) if self.hub_id else ()))))


class TracedProfile(BaseModel):
    """What a model without an analytic reader looks like to the memory model, measured outside
    the core (backend/trace.py: transformers on the meta device for the parameters, one forward
    and backward on fake tensors for the activations) for one micro-batch, sequence length,
    dtype, attention and checkpointing. Every figure is bytes or elements, as measured."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)  # built by the first trace

    model_type: str
    parameters: int = Field(gt=0)
    numels: tuple[int, ...] = Field(description="every parameter tensor's elements, registration order")
    num_layers: int = Field(gt=0, description="decoder blocks found (the ModuleList the forward walks)")
    layer_parameters: int = Field(ge=0, description="parameters of the mean block (all blocks / blocks)")
    blocks_parameters: int = Field(ge=0, description="parameters of all blocks together")
    late_parameters: int = Field(ge=0, description="parameters whose gradients backward produces after the "
                                 "last block (the untied input embeddings)")
    lm_head_elements: int = Field(ge=0, description="vocab x hidden of the output projection")
    largest_block_parameters: int = Field(ge=0, description="parameters of the biggest block (one FSDP unit)")
    tied_head_elements: int = Field(ge=0, description="the LM head's weight elements when it is the input "
                                    "embedding's (tied); 0 when untied")
    saved_bytes: int = Field(ge=0, description="activations live at the end of the forward (loss included)")
    layer_saved_bytes: int = Field(ge=0, description="one block's saved set (the largest)")
    layer_kept_bytes: int = Field(ge=0, description="what a block keeps until its backward (mean over blocks)")
    loss_transient_bytes: int = Field(ge=0, description="above the saved set before the first block's backward")
    layer_transient_bytes: int = Field(ge=0, description="above the saved set inside one block's backward")
    hidden_state_bytes: int = Field(0, ge=0, description="one [micro_batch, seq_len, hidden_size] tensor in the compute "
                                    "dtype (transformers' config.hidden_size; 0: the config has none): the tensor size "
                                    "the allocator replay cuts the saved activations into, as for an analytic model")
    setting: str = Field(description="the step traced: micro-batch, sequence, dtype, attention, checkpointing")
    assumptions: tuple[str, ...] = Field(description="what the trace assumed, for the output notes")


class UnsupportedModelTypeError(PlannerError):
    """A config whose model_type has no analytic reader; adapters may trace it (backend/trace.py)."""

    def __init__(self, message: str, config: dict[str, Any], name: str, source: str):
        super().__init__(message)
        self.config, self.name, self.source = config, name, source


class ResolvedModel(BaseModel):
    """A model ready for the memory model: its name, architecture and parameter count."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str
    config: dict[str, Any] | None
    architecture: Architecture | None
    parameters: int
    traced: TracedProfile | None = None


def _parse_text(text: str, source: str, field: str | None = None) -> Any:
    try:  # JSON first: PyYAML (YAML 1.1) reads JSON's 1e-05, as in every Llama config.json, as a string
        return json.loads(text)
    except ValueError:
        pass
    import yaml  # a user's YAML file only: the estimate of a config.json never imports PyYAML

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML/JSON"
        raise PlannerError(f"{source}: malformed YAML/JSON{where}: {problem}", field=field) from None


@lru_cache(maxsize=4)
def load_catalogue(path: Path = CATALOGUE_PATH) -> dict[str, ModelEntry]:
    data = load_data_yaml(path) if path == CATALOGUE_PATH else _parse_text(path.read_text(), str(path))
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise PlannerError(f"{path}: expected a mapping with a 'models' list", field=None)
    entries: dict[str, ModelEntry] = {}
    for index, raw in enumerate(data["models"]):
        where = f"{path}: models[{index}]"
        try:
            entry = ModelEntry.model_validate(raw)
        except ValidationError as exc:
            raise PlannerError(f"{where}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", field=None) from None
        if entry.name in entries:
            raise PlannerError(f"{where}: duplicate name {entry.name!r}", field=None)
        taken = {n.lower() for e in entries.values() for n in (e.name, *e.all_aliases)}
        clash = next((n for n in (entry.name, *entry.all_aliases) if n.lower() in taken), None)
        if clash is not None:
            raise PlannerError(f"{where} ({entry.name}): name or alias {clash!r} is already taken", field=None)
        if entry.config.get("model_type") != entry.family:
            raise PlannerError(
                f"{where} ({entry.name}): family {entry.family!r} contradicts "
                f"config.model_type {entry.config.get('model_type')!r}", field=None)
        from_hf_config(entry.config, source=f"{where} ({entry.name})")  # refuse what cannot be read
        entries[entry.name] = entry
    return entries


@lru_cache(maxsize=4)
def aliases(path: Path = CATALOGUE_PATH) -> dict[str, str]:
    """Every name a catalogue entry answers to, lower-cased, to its entry name: the name itself,
    its aliases and the Hub id of its source config.json. The one place names are resolved."""
    return {n.lower(): e.name for e in load_catalogue(path).values() for n in (e.name, *e.all_aliases)}


def find_entry(name: str) -> ModelEntry | None:
    """The catalogue entry a typed name means (case-insensitive, aliases and Hub ids included)."""
    target = aliases().get(name.strip().lower())
    return None if target is None else load_catalogue()[target]


def catalogue_model(name: str) -> ResolvedModel:
    entry = find_entry(name)
    if entry is None:
        known = list(aliases())
        hint = (f"; {name!r} looks like a Hugging Face Hub id: estimate and plan (CLI and API) read its "
                "config.json through huggingface_hub") if HUB_ID.match(name) else ""
        raise UnknownModelError(unknown("model", name, [n for n in known if "/" not in n] or known) + hint,
                                field="model")
    try:
        return _entry_model(entry.name)
    except PlannerError as exc:  # the entry's own config: about the model asked for, not a field of it
        exc.field = "model"
        raise


@lru_cache(maxsize=128)
def _entry_model(name: str) -> ResolvedModel:
    """A catalogue entry read into its architecture once per process (the plan resolves the same
    entry for each of its thousand settings); ResolvedModel is frozen and callers copy, not mutate."""
    entry = load_catalogue()[name]
    return _resolve(entry.name, entry.source, entry.config)


def _resolve(name: str, source: str, config: dict[str, Any]) -> ResolvedModel:
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(model_type, str) and model_type and model_type not in READERS:
        raise UnsupportedModelTypeError(
            f"{name}: model_type {model_type!r} has no analytic reader (analytic: {', '.join(sorted(READERS))}); "
            "with the backend extra installed (pip install -e '.[backend]') `planner estimate` traces it "
            "with transformers on fake tensors", config, name, source)
    architecture = from_hf_config(config, source=name)
    return ResolvedModel(name=name, source=source, config=config, architecture=architecture,
                         parameters=parameter_count(architecture))


def with_vision(model: ResolvedModel) -> ResolvedModel:
    """The model with its vision tower and projector counted (include_vision): only a multimodal
    config read analytically has them."""
    if model.config is None:
        what = "a traced model" if model.traced is not None else "only a parameter count"
        raise PlannerError(f"include_vision: {model.name} is {what}, not a multimodal config "
                           "(gemma3, llama4, mistral3) whose vision tower can be counted", field="include_vision")
    try:
        architecture = from_hf_config(model.config, source=model.name, include_vision=True)
    except PlannerError as exc:  # its vision_config, read from the request's model_config
        raise exc if exc.field == "include_vision" else exc.within("model_config")
    return model.model_copy(update={"architecture": architecture, "parameters": parameter_count(architecture)})


def as_loaded(model: ResolvedModel, text_only: bool = False, include_vision: bool = False) -> ResolvedModel:
    """The model as the training script builds it: for a multimodal config, what its loader builds
    (architecture.LOADED_CLASS: gemma3 and mistral3 whole, llama4's text decoder), unless the script
    loads the text decoder (``text_only``) or the whole conditional-generation class where
    AutoModelForCausalLM would build the text one (``include_vision``). A catalogue entry and a
    config are read as their text decoder; the vision tower is added here."""
    if include_vision and text_only:
        raise PlannerError("include_vision with text_only: the script loads either the whole multimodal model "
                           "or its text decoder", field="text_only")
    model_type = model.config.get("model_type") if model.config is not None else None
    if text_only and model_type not in LOADED_CLASS:
        what = f"model_type {model_type!r}" if model_type else ("a traced model" if model.traced is not None
                                                                 else "only a parameter count")
        raise PlannerError(f"text_only: {model.name} is {what}, which has no vision tower to leave out (text_only "
                           f"applies to the multimodal configs {', '.join(sorted(LOADED_CLASS))})", field="text_only")
    if include_vision or (not text_only and model_type in LOADED_CLASS and LOADED_CLASS[model_type][2]):
        return _with_vision_once(model)
    return model


# with_vision's answers by the model's identity, the model kept beside its answer so that an identity
# is never reused while its entry stands: the plan's search resolves every candidate from one model,
# and one answer (one Architecture) lets what is memoized on it (its shapes, its optimizer states)
# be computed once per plan, not re-read from the config per candidate
_VISION: dict[int, tuple[ResolvedModel, ResolvedModel]] = {}


def _with_vision_once(model: ResolvedModel) -> ResolvedModel:
    hit = _VISION.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    answer = with_vision(model)
    if len(_VISION) > 64:
        _VISION.clear()
    _VISION[id(model)] = (model, answer)
    return answer


def model_from_config(config: dict[str, Any], name: str = "custom", source: str = "user config") -> ResolvedModel:
    """A user's architecture: a Hugging Face config.json, or {name?, config: {...}} as in the catalogue.
    Every error's field is under ``model_config`` (the request field that carries it)."""
    try:
        return _from_config(config, name, source)
    except PlannerError as exc:
        raise exc.within("model_config")


def _from_config(config: dict[str, Any], name: str, source: str) -> ResolvedModel:
    if not isinstance(config, dict):
        raise PlannerError(f"model_config must be a JSON object, got {type(config).__name__}", field=None)
    if "config" in config and "model_type" not in config:
        inner = config["config"]
        if not isinstance(inner, dict):
            raise PlannerError(f"model_config.config must be a mapping, got {type(inner).__name__}", field="config")
        name = str(config.get("name", name))
        source = config.get("source", source)
        if not isinstance(source, str):
            raise PlannerError(f"model_config.source must be a string, got {type(source).__name__}", field="source")
        cleaned = {k: v for k, v in inner.items() if not k.startswith("_")}
        try:
            return _resolve(name, source, cleaned)
        except PlannerError as exc:
            raise exc.within("config")
    cleaned = {k: v for k, v in config.items() if not k.startswith("_")}
    return _resolve(name, source, cleaned)


def traced_model(name: str, source: str, profile: TracedProfile) -> ResolvedModel:
    """The hook for a model the analytic core cannot read: a profile measured outside the core
    (backend/trace.py) stands in for the Architecture in the same memory model."""
    if sum(profile.numels) != profile.parameters:
        raise PlannerError(f"traced profile of {name}: numels sum to {sum(profile.numels)}, "
                           f"not parameters({profile.parameters})", field=None)
    return ResolvedModel(name=name, source=source, config=None, architecture=None,
                         parameters=profile.parameters, traced=profile)


def read_bounded_text(path: str | Path, limit: int) -> str | None:
    """The file's text (UTF-8), or None when it holds more than ``limit`` bytes. Reads at most
    limit + 1 bytes: a device or a pipe (/dev/zero, a FIFO) reports no size and never ends, so
    a size from stat cannot bound it. OSError and UnicodeDecodeError are the caller's to name."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    return None if len(data) > limit else data.decode("utf-8")


def read_text_or_refuse(path: str | Path, limit: int, label: str, too_large: str, field: str | None = None) -> str:
    """read_bounded_text, every way the file cannot be read refused in one line naming ``label``
    (the flag or setting and the file): the OS's reason, not UTF-8 text, or more than ``limit``
    bytes (``too_large`` says what so large a file cannot be). The CLI and the server's token file
    read their files through it and re-raise in their own error type."""
    try:
        text = read_bounded_text(path, limit)
    except OSError as exc:
        raise PlannerError(f"{label}: cannot be read ({exc.strerror})", field=field) from None
    except UnicodeDecodeError:
        raise PlannerError(f"{label}: not a text file", field=field) from None
    if text is None:
        raise PlannerError(f"{label}: {too_large}", field=field)
    return text


def model_from_file(path: str | Path) -> ResolvedModel:
    path = Path(path)
    text = read_text_or_refuse(path, MAX_MODEL_FILE_BYTES, f"--model-file {path}",
                               f"more than {MAX_MODEL_FILE_BYTES} bytes, too large for a model config", "model_config")
    data = _parse_text(text, f"--model-file {path}", field="model_config")
    resolved = model_from_config(data, name=path.stem)
    return resolved.model_copy(update={"source": str(path)})


def raw_parameters(count: int) -> ResolvedModel:
    """Only a parameter count: model states can be computed, activations cannot."""
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise PlannerError(f"params must be a positive whole number, got {count!r}", field="params")
    if count > 10**14:
        raise PlannerError(f"params({count}) is absurd: over 100 trillion parameters", field="params")
    return ResolvedModel(name=f"{count} parameters", source="--params", config=None,
                         architecture=None, parameters=count)


def parse_json_text(text: str, label: str, field: str | None = None) -> Any:
    """``text`` as JSON; a malformed one is refused naming ``label`` (a flag and path, or a field)
    and, as data, the request ``field`` it was given for."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{label}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                           field=field) from None
