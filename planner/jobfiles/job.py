"""Several job files to one job: each read by its format's reader, a DeepSpeed JSON joined to the
file that names it (its "auto" values filled as the HF Trainer fills them), a model's config.json
joined to a local model path, and the cluster's world size applied to degrees a file leaves open.
Two files that set one request field to different values are refused, naming both."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from planner.model.catalogue import find_entry
from planner.errors import PlannerError
from planner.jobfiles import accelerate_config, axolotl, hf_trainer, llamafactory, torchtitan_job
from planner.jobfiles.keys import Where
from planner.jobfiles.parse import DS_JSON, MAX_JOB_FILES, detect, parse_text
from planner.jobfiles.reading import Reading
from planner.recipes.precision import RECIPES
from planner.schema import SHARDING_STRATEGIES

READERS = {"torchtitan-toml": torchtitan_job.read_toml, "torchtitan-launch": torchtitan_job.read_launch,
           "accelerate": accelerate_config.read, "hf-trainer": hf_trainer.read, "axolotl": axolotl.read,
           "llamafactory": llamafactory.read}
FORMAT_NAMES = {"torchtitan-toml": "torchtitan job TOML (0.2)", "torchtitan-launch": "torchtitan 0.3 launch",
                "accelerate": "accelerate config", "hf-trainer": "transformers TrainingArguments",
                "trl-sft": "TRL SFTConfig", "axolotl": "Axolotl config", "llamafactory": "LLaMA-Factory config",
                "deepspeed": "DeepSpeed JSON", "hf-model-config": "model config.json"}


@dataclass
class Job:
    fields: dict[str, Any]  # EstimateRequest fields
    origin: dict[str, str]
    formats: list[tuple[str, str]]  # (file, format)
    parsed: dict[str, Any]  # file -> its parsed value (for --emit)
    steps: int | None = None
    epochs: float | None = None
    unknown: list[str] = field(default_factory=list)  # "file: key"
    notes: list[str] = field(default_factory=list)


def read_job(files: list[tuple[str, str]], world_size: int, sets: dict[str, Any] | None = None) -> Job:
    """``files``: (name, text) pairs; ``world_size``: the cluster's GPUs; ``sets``: dotted keys of
    the first file overridden, as torchtitan's --section.field or a what-if."""
    if not files:
        raise PlannerError("give at least one job file", field="files")
    if len(files) > MAX_JOB_FILES:
        raise PlannerError(f"{len(files)} files; at most {MAX_JOB_FILES}", field="files")
    parsed = {name: parse_text(name, text) for name, text in files}
    if sets:
        first = files[0][0]
        parsed[first] = _apply_sets(first, parsed[first], sets)
    texts = dict(files)
    kinds = {}
    for name, data in parsed.items():
        if isinstance(data, dict) and {"model_type"} <= set(data) and "base_model" not in data:
            kinds[name] = "hf-model-config"
        else:
            kinds[name] = detect(name, data)
    readings: list[Reading] = []
    ds_files = {name for name, kind in kinds.items() if kind == DS_JSON}
    for name, kind in kinds.items():
        if kind in READERS:
            readings.append(_read(kind, name, parsed[name], texts[name]))
    if not readings and not ds_files:
        raise PlannerError("no training config among the files (only a model config.json)", field="files")
    job = Job({}, {}, [(n, r.format) for n, r in zip([n for n in kinds if kinds[n] in READERS], readings)],
              parsed)
    for reading in readings:
        _merge(job, reading)
    _join_deepspeed(job, readings, ds_files, parsed, kinds)
    _join_model(job, parsed, kinds)
    _world(job, world_size)
    if "strategy" not in job.fields and "ds_config" not in job.fields:
        # no file names a sharding framework: torchrun or accelerate's default runs DDP; one process
        # runs the bare module (accelerate 1.16 accelerator.py:1855 prepare_model wraps in DDP only when
        # multi_device, state.py:351: distributed_type != NO and num_processes > 1)
        one = world_size == 1
        job.fields["strategy"] = "single" if one else "ddp"
        job.origin["strategy"] = ("one GPU and no sharding framework: the bare module, no DDP" if one else
                                  "no file names a sharding framework (DDP, accelerate's MULTI_GPU default)")
    _trainer_sync(job, kinds)
    for name, kind in kinds.items():
        if kind in (DS_JSON, "hf-model-config"):
            job.formats.append((name, kind))
    return job


# the files whose training loop is transformers' Trainer (TRL's SFTTrainer, axolotl and LLaMA-Factory run it)
TRAINER_KINDS = ("hf-trainer", "trl-sft", "axolotl", "llamafactory")


def _trainer_sync(job: Job, kinds: dict[str, str]) -> None:
    """The Trainer skips the gradient sync on every micro-batch but the last (transformers 5.25 trainer.py
    sync_context: accelerator.no_sync; accelerate 1.16 no_sync: FSDP2's set_requires_gradient_sync(False), FSDP1's
    no_sync), FSDP set up by its own fsdp_config or by an accelerate config beside it (LLaMA-Factory's FSDP
    recipe): defer_gradient_sync, unless a file set it (hf_trainer.py: accelerator_config's sync_each_batch)."""
    trainer = next((name for name, kind in kinds.items() if kind in TRAINER_KINDS), None)
    fields = job.fields
    if "defer_gradient_sync" in fields or fields.get("strategy") not in SHARDING_STRATEGIES or fields.get("pp", 1) > 1:
        return
    if trainer is None:  # the accumulation may come from the command line: said whatever the files give
        if any(kind == "accelerate" for kind in kinds.values()):
            job.notes.append("with gradient accumulation the estimate reduce-scatters every micro-batch (the "
                             "script's own loop); a script that accumulates inside accelerator.accumulate() or "
                             "no_sync() keeps every unit's unsharded gradient until the last: ask it with "
                             "defer_gradient_sync")
        return
    if fields.get("gradient_accumulation", 1) <= 1:
        return
    fields["defer_gradient_sync"] = True
    job.origin["defer_gradient_sync"] = f"{trainer}: the Trainer's no_sync on every micro-batch but the last"


def _read(kind: str, name: str, data: Any, text: str) -> Reading:
    """One file by its format's reader. A value of a type the format does not take where the
    reader expects a section or a scalar (a list for fsdp_config, a number for a path) is refused
    naming the file, as the readers refuse the values they check one by one."""
    try:
        return READERS[kind](data, Where(name, text))
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        if isinstance(exc, PlannerError):
            raise
        raise PlannerError(f"{name}: a value of the wrong type for a {FORMAT_NAMES[kind]}: {exc}",
                           field=f"files.{name}") from None


def _apply_sets(name: str, data: Any, sets: dict[str, Any]) -> Any:
    if not isinstance(data, dict):
        raise PlannerError(f"{name}: a training config is a mapping of keys, got {type(data).__name__}",
                           field=f"files.{name}")
    bad = [key for key in sets if not key or any(not part for part in key.split("."))]
    if bad:
        raise PlannerError(f"overrides: {bad[0]!r} is not a dotted key of {name}", field="overrides")
    data = copy.deepcopy(data)
    if isinstance(data, dict) and {"module", "config", "overrides"} <= set(data):
        data["overrides"].update({k: str(v) for k, v in sets.items()})
        return data
    for dotted, value in sets.items():
        block = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if part in block and not isinstance(block[part], dict):
                raise PlannerError(f"overrides: {dotted!r}: {part} in {name} is not a section", field="overrides")
            block = block.setdefault(part, {})
        block[parts[-1]] = value
    return data


def _merge(job: Job, reading: Reading) -> None:
    for name, value in reading.fields.items():
        if name in job.fields and job.fields[name] != value:
            raise PlannerError(f"{reading.origin.get(name, reading.where.name)} sets {name} = {value!r}, but {job.origin[name]} sets "
                               f"{job.fields[name]!r}; make them agree", field=f"files.{reading.where.name}.{name}")
        job.fields[name] = value
        job.origin[name] = reading.origin.get(name, reading.where.name)
    for name, value in reading.defaults.items():
        job.fields.setdefault(name, value)
        job.origin.setdefault(name, f"{reading.where.name} (the {reading.format} default)")
    job.steps = reading.steps if reading.steps is not None else job.steps
    job.epochs = reading.epochs if reading.epochs is not None else job.epochs
    job.unknown += [f"{reading.where.name}: {key}" for key in reading.unknown]
    job.notes += reading.notes


def _join_deepspeed(job: Job, readings: list[Reading], ds_files: set[str], parsed: dict[str, Any],
                    kinds: dict[str, str]) -> None:
    referenced = [r for r in readings if r.ds_reference]
    if referenced:
        reading = referenced[0]
        key, path = reading.ds_reference
        base = path.replace("\\", "/").rsplit("/", 1)[-1]
        match = [name for name in ds_files if name.replace("\\", "/").rsplit("/", 1)[-1] == base]
        if not match:
            raise reading.where.error(key, f"names the DeepSpeed config {path!r}; give that file too (after the "
                                           f"{FORMAT_NAMES[reading.format]})")
        ds = _fill_auto(copy.deepcopy(parsed[match[0]]), job)
        job.fields["ds_config"] = ds
        job.origin["ds_config"] = f"{match[0]} (named by {reading.where.at(key)} {key})"
        for name in ("strategy",):
            job.fields.pop(name, None)  # the JSON's stage decides (EstimateRequest reads it)
    elif ds_files:
        name = sorted(ds_files)[0]
        job.fields["ds_config"] = _fill_auto(copy.deepcopy(parsed[name]), job)
        job.origin["ds_config"] = name


def _fill_auto(ds: dict[str, Any], job: Job) -> dict[str, Any]:
    """The HF Trainer's fill of "auto" (transformers 5.25 integrations/deepspeed.py
    HfTrainerDeepSpeedConfig.trainer_config_process, lines 143-186: batch sizes and the bf16/fp16
    switches from TrainingArguments; trainer_config_finalize, lines 234-245: reduce_bucket_size =
    hidden^2, stage3_prefetch_bucket_size = 0.9 hidden^2, stage3_param_persistence_threshold =
    10 hidden, from the model's hidden_size)."""
    fields = job.fields
    recipe = RECIPES.get(fields.get("precision", "fp32"))  # an unknown name is refused by the schema later
    compute = recipe.compute if recipe else None
    for name, on in (("bf16", compute == "bf16"), ("fp16", compute == "fp16")):
        if isinstance(ds.get(name), dict) and ds[name].get("enabled") == "auto":
            ds[name]["enabled"] = on
    for key, value in (("train_micro_batch_size_per_gpu", fields.get("micro_batch")),
                       ("gradient_accumulation_steps", fields.get("gradient_accumulation", 1))):
        if ds.get(key) == "auto" and value is not None:
            ds[key] = value
    if ds.get("train_batch_size") == "auto":
        ds.pop("train_batch_size")  # the product of the two above and the world size: implied
    zero = ds.get("zero_optimization")
    hidden = _hidden_size(job)
    if isinstance(zero, dict) and hidden:
        for key, value in (("reduce_bucket_size", hidden * hidden),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
                           ("stage3_param_persistence_threshold", 10 * hidden)):
            if zero.get(key) == "auto" and (zero.get("stage") == 3 or key == "reduce_bucket_size"):
                zero[key] = value
    return ds


def _hidden_size(job: Job) -> int | None:
    config = job.fields.get("model_config")
    if isinstance(config, dict):
        return config.get("config", config).get("hidden_size")
    entry = find_entry(job.fields["model"]) if isinstance(job.fields.get("model"), str) else None
    return entry.config.get("hidden_size") if entry else None


def _join_model(job: Job, parsed: dict[str, Any], kinds: dict[str, str]) -> None:
    configs = [name for name, kind in kinds.items() if kind == "hf-model-config"]
    path = job.fields.pop("model_path", None)
    if configs:
        job.fields.pop("model", None)
        job.fields["model_config"] = {"name": path or configs[0], "config": parsed[configs[0]]}
        job.origin["model_config"] = configs[0]
    elif path is not None:
        raise PlannerError(f"{job.origin['model_path']} names a local model {path!r}; give its config.json too",
                           field="files.model")


def _world(job: Job, world_size: int) -> None:
    """Degrees a torchtitan file leaves to the world (data_parallel_shard_degree -1), accelerate's
    num_processes checked against it, and the accumulation a global batch implies."""
    fields = job.fields
    declared = fields.pop("world_size", None)
    if declared is not None and declared != world_size:
        raise PlannerError(f"{job.origin['world_size']} says {declared} processes, but the cluster has "
                           f"{world_size} GPUs (gpus x nodes); give the cluster the job asks for", field="gpus")
    fields.pop("nodes", None)
    dp = fields.pop("_dp", None)
    reshard = fields.pop("_reshard", True)
    global_batch = fields.pop("_global_batch", None)
    if dp is None:
        return
    replicate, shard = dp
    model_parallel = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)
    if shard == -1:
        shard, left = divmod(world_size, replicate * model_parallel)
        if left or shard < 1:
            raise PlannerError(f"{job.origin['_dp']}: world size {world_size} is not divisible by "
                               f"data_parallel_replicate_degree({replicate}) x tp x pp x cp({model_parallel})",
                               field="gpus")
    if replicate * shard * model_parallel != world_size:
        raise PlannerError(f"{job.origin['_dp']}: replicate({replicate}) x shard({shard}) x tp x pp x cp"
                           f"({model_parallel}) != world size {world_size}", field="gpus")
    if replicate > 1 and shard > 1:
        fields["strategy"], fields["hsdp_shard_size"] = "hsdp", shard * model_parallel
    elif shard > 1:
        fields["strategy"] = "fsdp" if reshard else "fsdp-grad-op"
    else:
        fields["strategy"] = "ddp"
    # torchtitan reduces in fp32 (training.mixed_precision_reduce, its only value)
    fields["reduce_dtype"] = "fp32" if fields["strategy"] in SHARDING_STRATEGIES else "compute"
    if global_batch is not None:
        per_step = fields.get("micro_batch", 8) * fields.get("gradient_accumulation", 1) * replicate * shard
        if global_batch % per_step:
            raise PlannerError(f"{job.origin['_global_batch']}: global_batch_size({global_batch}) is not a multiple "
                               f"of local batch x dp ({per_step})", field="files.training.global_batch_size")
        fields["gradient_accumulation"] = fields.get("gradient_accumulation", 1) * global_batch // per_step
