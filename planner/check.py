"""`planner check`: a job as its files say it, answered for a scheduler: fits or not, the peak and
its moment, the step and wall time for the job's length, and the smallest changes that make it fit
(or, when it fits, run faster), each estimated in full. The estimator is passed in (the adapters
give the one that reads Hub ids), so this stays pure."""

from __future__ import annotations

import json
from typing import Any, Callable

from pydantic import ValidationError

from planner.errors import PlannerError
from planner.jobfiles.job import Job, read_job
from planner.schema import CheckChange, CheckRequest, CheckResult, EstimateRequest, EstimateResult, defer_sync_error, fsdp1_error

Estimator = Callable[[EstimateRequest], EstimateResult]
MAX_EXTRA_NODES = 8  # the GPU-count changes tried: up to this many times the nodes asked for


def job_request(body: CheckRequest) -> tuple[Job, EstimateRequest]:
    job = read_job([(f.name, f.text) for f in body.files], body.gpus * body.nodes, body.overrides)
    fields = {k: v for k, v in job.fields.items() if not k.startswith("_")}
    if body.model is not None:
        fields.pop("model_config", None)
        fields["model"] = body.model
    if "model" not in fields and "model_config" not in fields:
        raise PlannerError("the files do not name the model (TrainingArguments do not); give --model",
                           field="model")
    if body.seq_len is not None:
        fields["seq_len"] = body.seq_len
        job.origin["seq_len"] = "--seq-len"
    if "seq_len" not in fields:
        raise PlannerError("the files do not give the sequence length (TrainingArguments leave it to the script); "
                           "give --seq-len", field="seq_len")
    fields |= {"gpu": body.gpu, "gpus": body.gpus, "nodes": body.nodes}
    try:
        return job, EstimateRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = ".".join(str(p) for p in error.get("loc", ()))
        origin = job.origin.get(loc, "the files")
        raise PlannerError(f"{origin}: {loc}: {error['msg'].removeprefix('Value error, ')}",
                           field=f"files.{loc}" if loc else "files") from None


def check(body: CheckRequest, estimator: Estimator) -> CheckResult:
    job, request = job_request(body)
    result = estimator(request)
    steps, source = _steps(job, body, result)
    changes = _changes(request, result, estimator, steps)
    notes = job.notes + list(result.notes)
    if steps is None:
        notes.append("the job's length is unknown: give --tokens, or --dataset-tokens with a file's epochs")
    if result.time is None:
        notes.append("no step time: the time model needs a GPU with a datasheet and a model architecture")
    return CheckResult(
        formats=[[name, kind] for name, kind in job.formats], fits=result.fits,
        peak_bytes=result.per_device.peak_bytes, peak_phase=result.per_device.peak_phase,
        reserved_peak_bytes=result.per_device.reserved_peak_bytes, device_capacity_bytes=result.device_capacity_bytes,
        step_seconds=result.time.step_seconds if result.time else None, steps=steps,
        wall_seconds=_wall(steps, result), length_source=source, changes=changes,
        unknown_keys=job.unknown, origin={k: v for k, v in job.origin.items() if not k.startswith("_")}, notes=notes, request=result.request)


def _tokens_per_step(request: EstimateRequest, result: EstimateResult) -> int:
    replicas = result.world_size // (request.tp * request.cp * request.pp)
    return request.micro_batch * request.gradient_accumulation * request.seq_len * replicas


def _steps(job: Job, body: CheckRequest, result: EstimateResult) -> tuple[int | None, str]:
    per_step = _tokens_per_step(result.request, result)
    if body.tokens is not None:
        return -(-body.tokens // per_step), f"--tokens {body.tokens} / {per_step} tokens per step"
    if job.steps is not None:
        return job.steps, job.origin.get("steps", "the files' steps")
    if job.epochs is not None and body.dataset_tokens is not None:
        return (-(-int(job.epochs * body.dataset_tokens) // per_step),
                f"{job.epochs:g} epochs x {body.dataset_tokens} dataset tokens / {per_step} tokens per step")
    return None, "unknown"


def _wall(steps: int | None, result: EstimateResult) -> float | None:
    return steps * result.time.step_seconds if steps is not None and result.time else None


def _candidates(request: EstimateRequest, fits: bool) -> list[tuple[str, dict[str, Any]]]:
    """Each a single change of the job's micro-batch, checkpointing, offload, GPU count or layout,
    the global batch kept where the change touches it."""
    out: list[tuple[str, dict[str, Any]]] = []
    micro, accumulation = request.micro_batch, request.gradient_accumulation
    if micro > 1 and micro % 2 == 0:
        out.append((f"micro-batch {micro // 2}, accumulation {accumulation * 2} (same global batch)",
                    {"micro_batch": micro // 2, "gradient_accumulation": accumulation * 2}))
    if micro > 2:
        out.append((f"micro-batch 1, accumulation {accumulation * micro} (same global batch)",
                    {"micro_batch": 1, "gradient_accumulation": accumulation * micro}))
    if accumulation > 1 and accumulation % 2 == 0:
        out.append((f"micro-batch {micro * 2}, accumulation {accumulation // 2} (same global batch)",
                    {"micro_batch": micro * 2, "gradient_accumulation": accumulation // 2}))
    other = "none" if request.checkpointing != "none" else "full"
    out.append((f"checkpointing {other}", {"checkpointing": other}))
    if request.offload_optimizer == "none":
        out.append(("optimizer states offloaded to the CPU", {"offload_optimizer": "cpu"}))
    for strategy in ("zero3", "fsdp", "zero2"):
        if strategy != request.strategy and request.ds_config is None:
            out.append((f"layout {strategy}", {"strategy": strategy}))
    for nodes in (request.nodes * 2, request.nodes * 4, request.nodes * MAX_EXTRA_NODES):
        out.append((f"{nodes} nodes of {request.gpus} GPUs", {"nodes": nodes}))
    return out


def _pairs(singles: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """Two changes at once, on the GPUs asked for, where none alone makes the job fit."""
    same = [(label, change) for label, change in singles if "nodes" not in change]
    return [(f"{a} and {b}", ca | cb) for i, (a, ca) in enumerate(same) for b, cb in same[i + 1:]
            if not set(ca) & set(cb)]


def _changes(request: EstimateRequest, base: EstimateResult, estimator: Estimator,
             steps: int | None) -> list[CheckChange]:
    singles = _candidates(request, base.fits)
    found = _estimated(request, base, estimator, steps, singles)
    if not base.fits and not any(c.fits and "nodes" not in c.fields for c in found):
        found += _estimated(request, base, estimator, steps, _pairs(singles))
    return _ranked(found, base, steps)


def _estimated(request: EstimateRequest, base: EstimateResult, estimator: Estimator, steps: int | None,
               candidates: list[tuple[str, dict[str, Any]]]) -> list[CheckChange]:
    found = []
    for label, change in candidates:
        try:
            changed = _apply(request, change)
            result = estimator(changed)
        except (PlannerError, ValidationError):
            continue  # a change this job cannot take (offload with ddp, a layout the degrees refuse)
        scaled = None if steps is None else -(-steps * _tokens_per_step(request, base) //
                                             _tokens_per_step(changed, result))
        found.append(CheckChange(change=label, fields=change, fits=result.fits,
                                 peak_bytes=result.per_device.peak_bytes, peak_phase=result.per_device.peak_phase,
                                 step_seconds=result.time.step_seconds if result.time else None,
                                 wall_seconds=_wall(scaled, result)))
    return found


def _ranked(found: list[CheckChange], base: EstimateResult, steps: int | None) -> list[CheckChange]:
    base_wall = _wall(steps, base)
    if base.fits:  # faster: those that still fit and take less wall time (or step time)
        found = [c for c in found if c.fits and c.step_seconds is not None and base.time is not None
                 and (c.wall_seconds or c.step_seconds) < (base_wall or base.time.step_seconds)]
    else:
        found = [c for c in found if c.fits]
    # the smallest first: changes on the GPUs asked for before more GPUs, then the quickest
    found.sort(key=lambda c: ("nodes" in c.fields, c.wall_seconds is None, c.wall_seconds or c.step_seconds or 0))
    return found[:6]


# A DeepSpeed JSON fixes the batch and the optimizer's offload (planner/frameworks/deepspeed/config.py): a change of
# them is written into it, as --emit writes it into the file.
DS_KEYS = {"micro_batch": ("train_micro_batch_size_per_gpu",), "gradient_accumulation": ("gradient_accumulation_steps",),
           "offload_optimizer": ("zero_optimization", "offload_optimizer", "device")}


def _apply(request: EstimateRequest, change: dict[str, Any]) -> EstimateRequest:
    fields = request.model_dump(by_alias=True, exclude_unset=True) | change
    changed = request.model_copy(update=change)
    if fsdp1_error(changed):
        # an FSDP1 job's suggestion of a layout FSDP1 does not run (ZeRO, model parallelism) is FSDP2's or no FSDP
        fields.pop("fsdp_version", None)
    if defer_sync_error(changed):
        # a Trainer job's no_sync has no meaning under the suggested DeepSpeed or pipeline layout
        fields.pop("defer_gradient_sync", None)
    ds = fields.get("ds_config")
    if ds is not None:
        ds = fields["ds_config"] = json.loads(json.dumps(ds))
        ds.pop("train_batch_size", None)
        for name, value in change.items():
            if name in DS_KEYS:
                *path, last = DS_KEYS[name]
                block = ds
                for part in path:
                    block = block.setdefault(part, {})
                block[last] = value
    return EstimateRequest.model_validate(fields)
