"""The page's form, generated from the one schema: every field of the requests the page asks
(EstimateRequest and PlanRequest) becomes an input whose kind, choices, bounds, default and help
come from the field itself (a Literal is a select, a bool a checkbox, a number a number input with
the schema's bounds, a catalogue name a select of the catalogue, an object a JSON text area).

Only the grouping is written here, as lists of names: a field the schema gains and no list names
lands in the folded "More settings" group, with its description as help, and works at once.

The form travels in the GET query (a result is shared by its link). A value equal to the field's
form default is not sent on to the request, so the request's ``model_fields_set`` holds what the
user gave: the plan keeps a degree the user fixed and searches the others, and a ds_config's
precision stands unless the user chose one.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, field as dc_field
from typing import Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen
from pydantic import BaseModel, ValidationError

from planner.model.catalogue import parse_json_text
from planner.errors import PlannerError
from planner.schema import CatalogueName, EstimateRequest, PlanRequest

ASKS: dict[str, type[BaseModel]] = {"plan": PlanRequest, "estimate": EstimateRequest}
DEGREES = ("tp", "pp", "cp", "ep")  # planner/parallel/dims.py DEGREE_FIELDS: empty in a plan lets the planner choose


@dataclass(frozen=True)
class Group:
    key: str  # the fieldset's id
    legend: str
    names: tuple[str, ...]
    folded: bool = False


# Names a future field is expected to have (BRIEF: the agreed names) are listed where it belongs;
# a name the schema lacks is skipped.
GROUPS = (
    Group("model", "Model and job", ("model", "model_config", "params", "seq_len", "global_batch", "micro_batch",
                                     "gradient_accumulation", "include_vision", "text_only", "keeps_outputs",
                                     "train_metrics")),
    Group("cluster", "Cluster and wiring", ("gpu", "gpus", "nodes", "topology", "fabric", "nics_per_node",
                                            "host_memory_gib", "device_memory_gib", "topology_text")),
    Group("recipe", "Recipe", ("finetune", "lora_rank", "lora_targets", "lora_alpha", "lora_dropout", "quantize_base",
                               "double_quant", "train_embeddings", "precision", "low_precision", "float8_all_gather", "optimizer",
                               "optimizer_in_backward", "gradient_clipping", "checkpointing", "checkpointing_every", "loss", "loss_chunks",
                               "attention", "attention_kernel", "attention_unpad", "offload_optimizer", "offload_params",
                               "activation_offload", "compile", "fused_kernels", "defer_gradient_sync")),
    Group("degrees", "Layout: the strategy and degrees (empty degrees in a plan: the planner chooses; data "
                     "parallelism takes the GPUs that remain)",
          ("strategy", *DEGREES, "hsdp_shard_size", "sequence_parallel", "tp_plan", "async_tp", "pp_schedule", "pp_virtual_stages",
           "pp_first_stage_layers", "pp_last_stage_layers", "reduce_dtype", "fsdp_version")),
    Group("search", "The planner's search", ("objective", "headroom", "compute_efficiency", "link_efficiency",
                                             "profile"), folded=True),
    Group("framework", "Framework details (DeepSpeed buckets, allocator, versions)",
          ("ds_config", "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
           "param_persistence_threshold", "max_live_parameters", "max_reuse_distance", "framework_version",
           "alloc_conf", "nccl_buffsize_bytes"), folded=True),
)
OTHER = Group("other", "More settings", (), folded=True)  # every field no group names

LABELS = {"model_config": "or a Hugging Face config.json (overrides the model)", "params": "or a parameter count",
          "seq_len": "sequence length", "global_batch": "global batch (sequences)", "gpus": "GPUs per node",
          "gpu": "GPU", "host_memory_gib": "host RAM per node (GiB)", "device_memory_gib": "device memory (GiB)",
          "nics_per_node": "NICs per node", "topology_text": "or paste nvidia-smi topo -m (overrides the topology)",
          "fabric": "fabric between nodes", "pp_virtual_stages": "stages per rank", "reduce_dtype": "FSDP2 reduce dtype",
          "fsdp_version": "torch FSDP version", "async_tp": "async TP (collectives pipelined with matmuls)",
          "defer_gradient_sync": "gradient sync on the last micro-batch only (HF Trainer's no_sync)",
          "pp_schedule": "pipeline schedule", "lora_rank": "LoRA rank", "lora_alpha": "LoRA alpha",
          "lora_targets": "LoRA targets", "lora_dropout": "LoRA dropout", "finetune": "fine-tuning"}
# What the empty choice of an optional field means, where the schema's description says it.
EMPTY = {"topology": "(the GPU's preset)", "fabric": "(the preset's)", "quantize_base": "(nf4 for qlora)"}
# An input the user rarely types wide; multi-line text for what is pasted.
TEXT_AREAS = ("model_config", "ds_config", "topology_text")


@dataclass
class FormField:
    name: str  # the request's field name as JSON spells it (the alias: model_config)
    label: str
    help: str
    kind: Literal["select", "checkbox", "tristate", "number", "text", "textarea"]
    asks: tuple[str, ...]  # the questions whose request has this field
    default: str = ""  # as the form shows it
    schema_default: str = ""  # as the schema has it, where the form's differs (a degree: 1, shown empty)
    choices: list[tuple[str, str]] = dc_field(default_factory=list)  # (value, text)
    min: Any = None
    max: Any = None
    step: str | None = None
    placeholder: str = ""


def _unwrap(annotation: Any) -> tuple[Any, list[Any], bool]:
    """(the bare type, the metadata inside Annotated layers, whether None is allowed)."""
    metadata: list[Any] = []
    optional = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation, *more = typing.get_args(annotation)
            for m in more:
                metadata += [m, *getattr(m, "metadata", [])]
        elif origin in (Union, types.UnionType) and type(None) in typing.get_args(annotation):
            rest = [a for a in typing.get_args(annotation) if a is not type(None)]
            optional = True
            annotation = rest[0] if len(rest) == 1 else Union[tuple(rest)]
        else:
            return annotation, metadata, optional


def _bounds(metadata: list[Any], integer: bool) -> tuple[Any, Any]:
    low = high = None
    for m in metadata:
        if isinstance(m, Ge):
            low = m.ge
        elif isinstance(m, Gt):
            low = m.gt + 1 if integer else m.gt  # HTML's min is inclusive
        elif isinstance(m, Le):
            high = m.le
        elif isinstance(m, Lt):
            high = m.lt - 1 if integer else m.lt
    return low, high


def _shown(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):  # a list of names (fused_kernels): the comma-separated text the schema parses
        return ",".join(map(str, value))
    if isinstance(value, (dict, list)):
        return json.dumps(value, indent=1)
    return str(value)


def _field(name: str, info, asks: tuple[str, ...], choice_text) -> FormField:
    annotation, metadata, optional = _unwrap(info.annotation)
    metadata += list(info.metadata)
    label = LABELS.get(name, name.replace("_", " ") if name not in DEGREES else name)
    out = FormField(name=name, label=label, help=info.description or "", kind="text", asks=asks,
                    default=_shown(info.default) if not info.is_required() else "")
    catalogue = next((m for m in metadata if isinstance(m, CatalogueName)), None)
    if typing.get_origin(annotation) is Literal or catalogue is not None:
        values = [str(v) for v in typing.get_args(annotation)] if catalogue is None else list(catalogue.names())
        out.kind = "select"
        out.choices = ([("", EMPTY.get(name, "(default)"))] if optional else []) + \
            [(v, choice_text.get(name, {}).get(v, v)) for v in values]
    elif annotation is bool:
        out.kind = "tristate" if optional else "checkbox"
        if optional:
            out.choices = [("", "(default)"), ("true", "on"), ("false", "off")]
    elif annotation in (int, float) and not any(getattr(m, "json_schema", None) for m in metadata):
        out.kind = "number"
        out.min, out.max = _bounds(metadata, annotation is int)
        out.step = None if annotation is int else "any"
        out.placeholder = "default" if optional else ""
    elif name in TEXT_AREAS or typing.get_origin(annotation) is dict or annotation is dict:
        out.kind = "textarea"
    else:
        maxlen = next((m.max_length for m in metadata if isinstance(m, MaxLen)), None)
        out.kind = "textarea" if maxlen and maxlen > 4096 else "text"
        out.placeholder = "default" if optional and name != "model" else ""
    if name in DEGREES:  # not the schema's 1: what the planner chooses, unless given
        out.schema_default, out.default, out.placeholder = out.default, "", "planner chooses"
    return out


def form_fields(asks: dict[str, type[BaseModel]] | None = None,
                choice_text: dict[str, dict[str, str]] | None = None) -> list[FormField]:
    """Every field of every asked request, once, in the order the first request that has it
    declares it; the first request's description and default win (the page's first question, the
    plan, says what the planner does with a field)."""
    asks = asks or ASKS
    fields: dict[str, FormField] = {}
    for ask, model in asks.items():
        for attr, info in model.model_fields.items():
            name = info.alias or attr
            if name in fields:
                fields[name].asks += (ask,)
                extra = [c for c in _field(name, info, (ask,), choice_text or {}).choices if c not in fields[name].choices]
                fields[name].choices += extra  # a Literal one request widens (plan's finetune auto)
            else:
                fields[name] = _field(name, info, (ask,), choice_text or {})
    return list(fields.values())


def grouped(fields: list[FormField]) -> list[tuple[Group, list[FormField]]]:
    """The fields by group, in each group's own order; what no group names goes to OTHER."""
    by_name = {f.name: f for f in fields}
    placed = {n for g in GROUPS for n in g.names}
    out = [(g, [by_name[n] for n in g.names if n in by_name]) for g in GROUPS]
    out.append((OTHER, [f for f in fields if f.name not in placed]))
    return [(g, members) for g, members in out if members]


def form_values(fields: list[FormField], query) -> dict[str, str]:
    """The form's values from a query (a starlette QueryParams or a dict): the last value given
    for a name (a checkbox's hidden 'false' comes before its 'true'), else the field's default."""
    out = {}
    for f in fields:
        given = query.getlist(f.name) if hasattr(query, "getlist") else [query[f.name]] if f.name in query else []
        out[f.name] = given[-1] if given else f.default
    if "model" in out and not out["model"] and not any(out.get(k) for k in ("model_config", "params")) \
            and "model" not in query:
        out["model"] = str(PlanRequest.model_fields["model"].examples[0])  # the page starts at the schema's example
    return out


class FormErrors(PlannerError):
    """The request's errors, each under the form field it is about ('' for the request as a whole)."""

    def __init__(self, errors: list[tuple[str, str]]):
        super().__init__("; ".join(f"{f}: {m}" if f else m for f, m in errors), field=errors[0][0] or None)
        self.errors = errors


def _error_field(loc: tuple, names: set[str]) -> str:
    """The form field a pydantic error's loc is about: its first part ('model_config' for
    model_config.hidden_size), or '' when that is not a field on the form."""
    first = str(loc[0]) if loc else ""
    return first if first in names else ""


def _loc(error: dict[str, Any]) -> tuple:
    """Where a pydantic error is: its loc, or, for a PlannerError a model validator raised (whose
    loc is the whole request), the field the error names."""
    cause = (error.get("ctx") or {}).get("error")
    if not error.get("loc") and isinstance(cause, PlannerError) and cause.field:
        return tuple(cause.field.split("."))
    return tuple(error.get("loc", ()))


def build_request(ask: str, fields: list[FormField], values: dict[str, str],
                  asks: dict[str, type[BaseModel]] | None = None) -> BaseModel:
    """The asked request from the form's values. A value equal to the form's default is left out
    (so not in model_fields_set); a value the other question alone takes is refused beside its
    field; JSON text areas are parsed. Raises FormErrors listing every field's error."""
    asks = asks or ASKS
    model = asks[ask]
    names = {f.name for f in fields}
    given: dict[str, Any] = {}
    errors: list[tuple[str, str]] = []
    for f in fields:
        value = values.get(f.name, f.default)
        if value == f.default or value == "":
            continue
        if ask not in f.asks:
            errors.append((f.name, f"{f.name} is asked by {' and '.join(f.asks)}, not by {ask}; clear it or ask "
                                   f"{f.asks[0]}"))
            continue
        if f.kind == "textarea" and f.name in ("model_config", "ds_config"):
            try:
                value = parse_json_text(value, f.name, field=f.name)
            except PlannerError as exc:
                errors.append((f.name, str(exc)))
                continue
        given[f.name] = value
    if "model_config" in given or "params" in given:
        given.pop("model", None)  # a pasted config or a count stands for the model
    if "topology_text" in given:
        given.pop("topology", None)
    if errors:
        raise FormErrors(errors)
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        raise FormErrors([(_error_field(_loc(e), names), e.get("msg", "invalid").removeprefix("Value error, "))
                          for e in exc.errors()]) from None
    except PlannerError as exc:
        raise FormErrors([(_error_field(tuple((exc.field or "").split(".")), names), str(exc))]) from None


def share_query(ask: str, fields: list[FormField], values: dict[str, str]) -> dict[str, str]:
    """The query that asks this question again: the question and every value not at its default."""
    return {"ask": ask} | {f.name: values[f.name] for f in fields if values.get(f.name, f.default) != f.default}
