"""A job file's text to a parsed value, and which format it is. Pure: pyyaml and the standard
library's tomllib and shlex. Every parse error names the file and the line."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from typing import Any

import yaml

from planner.errors import PlannerError

# the kind of a DeepSpeed JSON file: a file format, not the framework (planner/frameworks/)
DS_JSON = "deepspeed"

MAX_JOB_FILE_BYTES = 1 << 20  # the largest published config read here is a few KiB
MAX_JOB_FILES = 8


def parse_text(name: str, text: str) -> Any:
    """JSON, TOML, YAML or a torchtitan command line, by the name's suffix first, else by trying."""
    field = f"files.{name}"
    if len(text.encode()) > MAX_JOB_FILE_BYTES:
        raise PlannerError(f"{name}: more than {MAX_JOB_FILE_BYTES} bytes; not a training config", field=field)
    lower = name.lower()
    if lower.endswith(".py"):
        raise PlannerError(f"{name}: a Python file is not read (a torchtitan 0.3 config_registry function is run by "
                           "torchtitan, not here); give the launch line (--module M --config F --section.key V ...)",
                           field=f"files.{name}")
    if lower.endswith(".json"):
        return _json(name, text)
    if lower.endswith(".toml"):
        return _toml(name, text)
    if lower.endswith((".sh", ".args", ".txt")) or _looks_like_command(text):
        return command_line(name, text)
    if lower.endswith((".yaml", ".yml")):
        return _yaml(name, text)
    first = next((line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")), "")
    if first.startswith("{"):
        return _json(name, text)
    if re.match(r"^\[[\w.\-]+\]$", first) or re.match(r"^[\w.\-]+\s*=", first):
        return _toml(name, text)
    return _yaml(name, text)


def _json(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{name}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})",
                           field=f"files.{name}") from None


def _toml(name: str, text: str) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line N, column M)"
        raise PlannerError(f"{name}: not valid TOML: {exc}", field=f"files.{name}") from None


def _yaml(name: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PlannerError(f"{name}{line}: not valid YAML: {problem}", field=f"files.{name}") from None


def _looks_like_command(text: str) -> bool:
    return "--module" in text and "--config" in text


def command_line(name: str, text: str) -> dict[str, Any]:
    """A torchtitan 0.3 launch (``torchrun ... -m torchtitan.train --module M --config F --a.b V``,
    or the arguments alone): ``{"module", "config", "overrides": {"a.b": "V"}}``. Lines continued
    with a backslash are joined; comments are dropped."""
    joined = " ".join(line.split("#", 1)[0].rstrip().removesuffix("\\") for line in text.splitlines())
    try:
        words = shlex.split(joined)
    except ValueError as exc:
        raise PlannerError(f"{name}: not a command line: {exc}", field=f"files.{name}") from None
    out: dict[str, Any] = {"module": None, "config": None, "overrides": {}}
    index = 0
    while index < len(words):
        word = words[index]
        policy = re.fullmatch(r"activation[-_]checkpoint:([\w-]+)", word)
        if policy:  # 0.3's tyro subcommand (distributed/activation_checkpoint.py ActivationCheckpointingConfig)
            out["overrides"]["activation_checkpoint.mode"] = policy.group(1)
            if policy.group(1) == "selective":  # 0.3's SelectiveAC is per-op
                out["overrides"]["activation_checkpoint.selective_ac_option"] = "op"
        elif word.startswith("--") and len(word) > 2:
            key, eq, value = word[2:].partition("=")
            if not eq:
                nxt = words[index + 1] if index + 1 < len(words) else None
                if nxt is not None and not nxt.startswith("--"):
                    value, index = nxt, index + 1
                else:
                    value = "true"  # a switch (--compile.enable)
            if key in ("module", "config"):
                out[key] = value
            elif "." in key:
                out["overrides"][key] = value
        index += 1
    if not out["module"] or not out["config"]:
        raise PlannerError(f"{name}: a torchtitan 0.3 launch needs --module and --config (a config_registry "
                           "function)", field=f"files.{name}")
    return out


# Formats this module reads, and formats it recognises only to name them (a file of another kind).
def detect(name: str, data: Any) -> str:
    if isinstance(data, dict) and set(data) >= {"module", "config", "overrides"}:
        return "torchtitan-launch"
    if not isinstance(data, dict):
        raise PlannerError(f"{name}: a training config is a mapping of keys, got {type(data).__name__}",
                           field=f"files.{name}")
    keys = set(data)
    if keys & {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"} and not keys & {
            "distributed_type", "base_model", "model_name_or_path"}:
        return DS_JSON
    if "compute_environment" in keys or "distributed_type" in keys:
        return "accelerate"
    if keys & {"parallelism", "training", "activation_checkpoint"} and isinstance(data.get("training", {}), dict) \
            and ("model" in keys and isinstance(data["model"], dict) or "parallelism" in keys):
        return "torchtitan-toml"
    if "base_model" in keys:
        return "axolotl"
    if "model_name_or_path" in keys and keys & {"stage", "finetuning_type", "cutoff_len", "template"}:
        return "llamafactory"
    if keys & TRAINING_ARGUMENT_HINTS:
        return "hf-trainer"
    raise PlannerError(f"{name}: {_other_format(keys)}", field=f"files.{name}")


TRAINING_ARGUMENT_HINTS = frozenset({"per_device_train_batch_size", "output_dir", "num_train_epochs",
                                     "model_name_or_path", "gradient_accumulation_steps", "max_steps"})

# Formats recognised and named, not read: (keys that identify it, what it is and what to give instead).
OTHER_FORMATS = (
    ({"model_type", "hidden_size"}, "a Hugging Face model config (config.json): give it with --model-file, "
     "or as the model of a training config"),
    ({"apiVersion", "kind"}, "a Kubernetes manifest; give the training config it mounts"),
    ({"trainer", "exp_manager"}, "a NeMo config, which this version does not read"),
    ({"trainer", "model", "data"}, "a PyTorch Lightning CLI config, which this version does not read"),
    ({"services"}, "a docker compose file; give the training config it runs"),
    ({"project", "build-system"}, "a pyproject.toml; give the training config"),
    ({"estimate_request"}, "a plan.json written by `planner plan --emit`; give it to verify --plan"),
    ({"n_layer", "n_embd"}, "a GPT-2-style model config; give it with --model-file"),
)


def _other_format(keys: set[str]) -> str:
    for needed, what in OTHER_FORMATS:
        if needed <= keys:
            return f"{what}; not a training config read here (torchtitan, accelerate, HF Trainer/TRL, " \
                   "Axolotl, LLaMA-Factory or DeepSpeed)"
    return ("not a training config read here: no key of torchtitan, accelerate, HF Trainer/TRL, Axolotl, "
            f"LLaMA-Factory or DeepSpeed (keys: {', '.join(sorted(keys)[:8])})")
