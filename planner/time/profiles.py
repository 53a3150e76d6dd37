"""Calibration profiles: efficiency constants fitted from verify runs (`planner calibrate`) and
applied by name (`--profile NAME`). The core fits a profile from run records and applies one it is
given; where profiles are stored (files, the environment) is the adapters' (backend/profiles.py)."""

from __future__ import annotations

import re
import statistics
from typing import Any

from pydantic import BaseModel, Field

from planner.errors import PlannerError
from planner.cluster.gpus import gpu as lookup_gpu
from planner.recipes.precision import RECIPES
from planner.memory.orchestrator import estimate
from planner.time.profile_name import check_profile_name
from planner.schema import EstimateRequest
from planner.time.step import estimate_time
from planner.time.collectives import flops_per_token



class Residual(BaseModel):
    run_id: int
    measured_step_seconds: float
    predicted_step_seconds: float
    error_pct: float


class CommunicationResidual(BaseModel):
    run_id: int
    measured_seconds: float = Field(description="time of the counted step's collectives on rank 0")
    predicted_seconds: float = Field(description="the α-β ring model with the fitted link efficiency")
    error_pct: float


class Profile(BaseModel):
    name: str
    gpu: str
    compute_scale: float = Field(1.0, gt=0.0, le=10.0, description="measured over predicted kernel rate: every "
                                 "kernel rate of planner/time/kernels.py is multiplied by it")
    compute_efficiency: float | None = Field(
        None, description="a profile saved before the kernel model: one achieved fraction of peak for all compute "
        "(applied as the compute_efficiency override)")
    link_efficiency: float = Field(1.0, description="achieved fraction of the modelled link bandwidth, over all runs")
    link_efficiencies: dict[str, float] = Field(
        {}, description="the same per link type (the kind of the ring's slowest link), where runs measured it")
    runs: list[int]
    residuals: list[Residual]
    communication_residuals: list[CommunicationResidual] = []
    note: str


def _run_flops(record: dict[str, Any]) -> tuple[str, float, float] | None:
    """(gpu, FLOPs one rank does per step, measured seconds) of an ok run, or None."""
    if record.get("status") != "ok" or not record.get("measured"):
        return None
    request = record["request"]
    arch_fields = record["prediction"]["model"].get("architecture")
    if not arch_fields:
        return None
    from planner.model.architecture import Architecture

    arch = Architecture.model_validate(arch_fields)
    tokens = request["micro_batch"] * request["seq_len"] * request["gradient_accumulation"]
    return request["gpu"], tokens * flops_per_token(arch, request["seq_len"], request["checkpointing"]), \
        float(record["measured"]["step_seconds"])


def _dtype(precision: str, peak: dict[str, float]) -> str:
    return RECIPES[precision].peak_dtype(peak)


PASSES = {"all_reduce": 2}  # ring passes per collective (all-reduce = reduce-scatter + all-gather)


def _run_links(record: dict[str, Any]) -> tuple[float, float, float, str] | None:
    """(bandwidth term at the modelled link rates, latency term, measured seconds, the kind of the
    ring's slowest link) of the collectives a verify run timed in its counted step, or None."""
    comm = (record.get("communication") or {}).get("measured_rank0") or {}
    timed = {op: v for op, v in comm.items() if v.get("seconds", 0) > 0 and v["bytes"] > 0}
    if record.get("status") != "ok" or not timed:
        return None
    from planner.time import collectives as timing
    from planner.cluster.hardware import topology_of
    from planner.schema import PlanRequest

    request = record["request"]
    model = {"model": request["model"]} if request.get("model") else {"model_config": request.get("model_config")}
    plan_req = PlanRequest(**model, gpu=request["gpu"], gpus=request["gpus"], nodes=request["nodes"],
                           topology=request.get("topology"), topology_text=request.get("topology_text"),
                           seq_len=request["seq_len"])
    topo, _, _ = topology_of(plan_req, lookup_gpu(request["gpu"]))
    ring, bandwidth, latency = timing.node_ring(topo, request["gpus"])
    ranks = request["gpus"] * request["nodes"]
    bandwidth_term = latency_term = measured = 0.0
    for op, v in timed.items():
        passes = PASSES.get(op.split(" ")[0], 1)
        message = v["bytes"] / max(1, v["calls"])
        bandwidth_term += timing.ring_collective_seconds(v["bytes"], ranks, bandwidth, 0.0, message, passes)
        latency_term += timing.ring_collective_seconds(v["bytes"], ranks, float("inf"), latency, message, passes)
        measured += v["seconds"]
    return bandwidth_term, latency_term, measured, timing.ring_bottleneck_kind(topo, ring) or "none"


def _fit_links(samples: list[tuple[int, tuple[float, float, float, str]]]
               ) -> tuple[float, dict[str, float], list[CommunicationResidual]]:
    """The link efficiency e that makes bandwidth_term / e + latency_term the measured time: the
    median over all runs, the median per link type, and each run's residual with its type's e."""
    def ratio(bw: float, lat: float, seconds: float) -> float | None:
        return bw / (seconds - lat) if seconds > lat and bw > 0 else None

    usable = [(run_id, s) for run_id, s in samples if ratio(*s[:3]) is not None]
    if not usable:
        return 1.0, {}, []
    overall = statistics.median(ratio(*s[:3]) for _, s in usable)
    per_kind = {kind: statistics.median(ratio(*s[:3]) for _, s in usable if s[3] == kind)
                for kind in sorted({s[3] for _, s in usable})}
    residuals = []
    for run_id, (bw, lat, seconds, kind) in usable:
        predicted = bw / per_kind[kind] + lat
        residuals.append(CommunicationResidual(run_id=run_id, measured_seconds=seconds, predicted_seconds=predicted,
                                               error_pct=100 * (predicted - seconds) / seconds))
    return overall, per_kind, residuals


def _predicted_compute(record: dict[str, Any], gpu_name: str) -> float:
    """The kernel model's compute seconds of a run's step (planner/time/kernels.py at its published
    rates: a profile with scale 1), whatever GPU it ran on (CPU ranks included)."""
    request = EstimateRequest.model_validate(record["request"] | {"profile": _PROBE})
    time = estimate_time(request, estimate(request), Profile(name=_PROBE, gpu=gpu_name, runs=[], residuals=[],
                                                                note="kernel rates as published"))
    return time.compute_seconds


_PROBE = "kernel-rates"


def fit_profile(name: str, runs: list[tuple[int, dict[str, Any]]], gpu_name: str | None = None) -> Profile:
    """The median over the runs of one GPU type of the kernel model's predicted compute seconds
    over the measured step seconds: the factor on its kernel rates (compute_scale),
    and each run's residual with it."""
    samples = []
    for run_id, record in runs:
        sample = _run_flops(record)
        if sample is None or (gpu_name and sample[0] != gpu_name):
            continue
        samples.append((run_id, sample[0], _predicted_compute(record, sample[0]), sample[2]))
    if not samples:
        raise PlannerError("no finished verify runs to calibrate from" + (f" on {gpu_name}" if gpu_name else "")
                           + "; run planner verify first", field=None)
    gpus = {s[1] for s in samples}
    if len(gpus) > 1:
        raise PlannerError(f"runs on several GPU types ({', '.join(sorted(gpus))}); choose one with --gpu", field="gpu")
    scale = min(10.0, statistics.median(predicted / seconds for _, _, predicted, seconds in samples))
    residuals = [Residual(run_id=run_id, measured_step_seconds=seconds, predicted_step_seconds=predicted / scale,
                          error_pct=100 * (predicted / scale - seconds) / seconds)
                 for run_id, _, predicted, seconds in samples]
    link_samples = [(run_id, links) for run_id, record in runs
                    if any(run_id == s[0] for s in samples) and (links := _run_links(record)) is not None]
    link_efficiency, per_kind, link_residuals = _fit_links(link_samples)
    note = ("compute scale: the median over the runs of the kernel model's compute seconds (planner/time/kernels.py at "
            "its published rates) over the measured step seconds (communication included); it multiplies every "
            "kernel rate. Link efficiency: the median over the runs of the modelled "
            "bandwidth-bound time of the collectives each run timed (data/links.yaml rates, α-β ring) over their "
            f"measured time less the latency term ({len(link_samples)} runs with timed collectives"
            + ("; none, so it stays 1.0" if not link_samples else "") + ")")
    return Profile(name=check_profile_name(name), gpu=next(iter(gpus)), compute_scale=scale,
                   link_efficiency=min(4.0, link_efficiency),
                   link_efficiencies={k: min(4.0, v) for k, v in per_kind.items()},
                   runs=[s[0] for s in samples], residuals=residuals,
                   communication_residuals=link_residuals, note=note)
