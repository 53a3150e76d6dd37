"""``planner check --emit``: the job's files written back in their own formats with one change
applied (request fields -> each format's keys). Pure: returns {name: text}."""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

import yaml

from planner.errors import PlannerError
from planner.jobfiles.job import Job
from planner.jobfiles.parse import DS_JSON

Setter = Callable[[dict[str, Any], Any, dict[str, Any]], None]


def _put(path: str, convert: Callable[[Any], Any] = lambda v: v) -> Setter:
    def setter(data: dict[str, Any], value: Any, _fields: dict[str, Any]) -> None:
        block = data
        parts = path.split(".")
        for part in parts[:-1]:
            block = block.setdefault(part, {})
        block[parts[-1]] = convert(value)
    return setter


def _on(value: Any) -> bool:
    return value != "none"


HF = {"micro_batch": _put("per_device_train_batch_size"), "gradient_accumulation": _put("gradient_accumulation_steps"),
      "checkpointing": _put("gradient_checkpointing", _on)}
# Where each request field is written, per format (the reverse of each reader)
KEYS: dict[str, dict[str, Setter]] = {
    "hf-trainer": HF, "trl-sft": HF,
    "llamafactory": {**HF, "checkpointing": _put("disable_gradient_checkpointing", lambda v: not _on(v))},
    "axolotl": {"micro_batch": _put("micro_batch_size"), "gradient_accumulation": _put("gradient_accumulation_steps"),
                "checkpointing": _put("gradient_checkpointing", _on)},
    "torchtitan-toml": {"micro_batch": _put("training.local_batch_size"),
                        "gradient_accumulation": lambda d, v, f: _put("training.global_batch_size")(
                            d, f.get("micro_batch", 1) * v * _dp(f), f),
                        "checkpointing": _put("activation_checkpoint.mode")},
    "accelerate": {"nodes": lambda d, v, f: d.update(num_machines=v, num_processes=v * f["gpus"]),
                   "offload_optimizer": _put("deepspeed_config.offload_optimizer_device")},
    "deepspeed": {"micro_batch": _put("train_micro_batch_size_per_gpu"),
                  "gradient_accumulation": _put("gradient_accumulation_steps"),
                  "offload_optimizer": lambda d, v, f: d.setdefault("zero_optimization", {}).update(
                      offload_optimizer={"device": v})},
}


def _dp(fields: dict[str, Any]) -> int:
    """Data-parallel ranks: torchtitan's global_batch_size is local x accumulation x this."""
    world = fields.get("gpus", 1) * fields.get("nodes", 1)
    return world // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1))


def emit(job: Job, change: dict[str, Any], fields: dict[str, Any]) -> dict[str, str]:
    """Each file of the job, with ``change`` written into the file whose format has the key; a
    change no file can hold is refused by name. ``fields``: the job's request fields (the batch
    and degrees a derived key needs)."""
    out = {name: copy.deepcopy(job.parsed[name]) for name, _ in job.formats}
    kinds = dict(job.formats)
    for field, value in change.items():
        homes = [name for name, kind in job.formats if field in KEYS.get(kind, {})]
        if not homes:
            raise PlannerError(f"{field}={value!r} has no key in {', '.join(k for _, k in job.formats)}; "
                               "it cannot be written back", field=field)
        KEYS[kinds[homes[0]]][field](out[homes[0]], value, fields | change)
    return {name: _dump(name, kinds[name], data) for name, data in out.items()}


def _dump(name: str, kind: str, data: Any) -> str:
    if name.lower().endswith(".json") or kind in (DS_JSON, "hf-model-config"):
        return json.dumps(data, indent=2) + "\n"
    if kind == "torchtitan-toml":
        return toml_text(data)
    return yaml.safe_dump(data, sort_keys=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is JSON's string syntax for these values


def toml_text(data: dict[str, Any], prefix: str = "") -> str:
    """TOML of nested tables of scalars and lists (what a torchtitan job file holds)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    text = (f"[{prefix}]\n" if prefix and lines else "") + "".join(line + "\n" for line in lines)
    for key, value in data.items():
        if isinstance(value, dict):
            text += ("\n" if text else "") + toml_text(value, f"{prefix}.{key}" if prefix else key)
    return text
