"""Calibration profiles: efficiency constants fitted from verify runs (`planner calibrate`), saved
as JSON files and applied by name (`--profile NAME`)."""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from planner.errors import PlannerError, UnknownNameError, unknown
from planner.gpus import gpu as lookup_gpu
from planner.timing import flops_per_token

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Residual(BaseModel):
    run_id: int
    measured_step_seconds: float
    predicted_step_seconds: float
    error_pct: float


class Profile(BaseModel):
    name: str
    gpu: str
    compute_efficiency: float = Field(description="achieved fraction of the GPU's peak dense TFLOP/s")
    runs: list[int]
    residuals: list[Residual]
    note: str


def profiles_dir() -> Path:
    override = os.environ.get("PLANNER_PROFILES")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "planner" / "profiles"


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise PlannerError(f"profile name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
    return name


def load_profile(name: str) -> Profile:
    path = profiles_dir() / f"{_check_name(name)}.json"
    if not path.exists():
        known = [p.stem for p in profiles_dir().glob("*.json")] if profiles_dir().exists() else []
        raise UnknownNameError(unknown("profile", name, known or ["(none saved: run planner calibrate)"]))
    try:
        return Profile.model_validate_json(path.read_text())
    except ValueError as exc:
        raise PlannerError(f"profile {name} ({path}) is not a planner profile: {str(exc).splitlines()[0]}") from None


def save_profile(profile: Profile) -> Path:
    directory = profiles_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{_check_name(profile.name)}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(profile.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def _run_flops(record: dict[str, Any]) -> tuple[str, float, float] | None:
    """(gpu, FLOPs one rank does per step, measured seconds) of an ok run, or None."""
    if record.get("status") != "ok" or not record.get("measured"):
        return None
    request = record["request"]
    arch_fields = record["prediction"]["model"].get("architecture")
    if not arch_fields:
        return None
    from planner.architecture import Architecture

    arch = Architecture.model_validate(arch_fields)
    tokens = request["micro_batch"] * request["seq_len"] * request["gradient_accumulation"]
    return request["gpu"], tokens * flops_per_token(arch, request["seq_len"], request["checkpointing"]), \
        float(record["measured"]["step_seconds"])


def _dtype(precision: str, peak: dict[str, float]) -> str:
    if precision == "fp32":
        return "tf32" if "tf32" in peak else "fp32"
    return "bf16" if precision.startswith("bf16") else "fp16"


def fit_profile(name: str, runs: list[tuple[int, dict[str, Any]]], gpu_name: str | None = None) -> Profile:
    """Median achieved efficiency over the runs of one GPU type, and each run's residual."""
    samples = []
    for run_id, record in runs:
        sample = _run_flops(record)
        if sample is None or (gpu_name and sample[0] != gpu_name):
            continue
        g = lookup_gpu(sample[0])
        peak = g.peak_tflops[_dtype(record["request"]["precision"], g.peak_tflops)] * 1e12
        samples.append((run_id, sample[0], sample[1], sample[2], peak))
    if not samples:
        raise PlannerError("no finished verify runs to calibrate from" + (f" on {gpu_name}" if gpu_name else "")
                           + "; run planner verify first")
    gpus = {s[1] for s in samples}
    if len(gpus) > 1:
        raise PlannerError(f"runs on several GPU types ({', '.join(sorted(gpus))}); choose one with --gpu")
    efficiencies = [flops / seconds / peak for _, _, flops, seconds, peak in samples]
    efficiency = statistics.median(efficiencies)
    residuals = [Residual(run_id=run_id, measured_step_seconds=seconds,
                          predicted_step_seconds=flops / (peak * efficiency),
                          error_pct=100 * (flops / (peak * efficiency) - seconds) / seconds)
                 for run_id, _, flops, seconds, peak in samples]
    note = ("compute efficiency fitted as the median over the runs of achieved FLOP/s (measured step time, "
            "communication included) over the GPU's peak; link efficiencies keep their defaults "
            "(data/links.yaml) until runs record per-collective sizes")
    return Profile(name=_check_name(name), gpu=next(iter(gpus)), compute_efficiency=min(1.0, efficiency),
                   runs=[s[0] for s in samples], residuals=residuals, note=note)
