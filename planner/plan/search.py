"""The recommender: search and rank. Every layout (tp inside the NVLink islands, pp across the
nodes, ep for a mixture of experts, cp when nothing fits without it: planner/plan/layouts.py) x strategy
x checkpointing x offload x micro-batch that reaches the global batch, memory and time for each,
ranked by the objective, every rejection explained.

Speed: each phase of the memory model is affine in the micro-batch (activations scale with the
tokens), so two estimates per (layout, strategy, checkpointing, offload) give every micro-batch
exactly, and numpy evaluates the step times of the whole grid at once. A pipeline's memory depends on
its micro-batch count, so each of its options is an estimate; bounds (each named where it is taken)
prove which settings cannot fit or cannot be recommended before they are estimated.
"""
from __future__ import annotations

import math
import time as wallclock
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from planner.time import kernels
from planner.time import collectives as timing
from planner.model.architecture import LOADED_CLASS
from planner.model.catalogue import as_loaded, catalogue_model, model_from_config
from planner.errors import PlannerError
from planner.frameworks import check_version, framework_of, version_field
from planner.cluster.gpus import Gpu, check_precision, gpu as lookup_gpu
from planner.cluster.hardware import profile_compute_scale, profile_efficiencies, topology_of
from planner.parallel.hf_plan import hf_rank_architecture
from planner.plan.layouts import Rejected, cp_degrees, ep_degrees, pp_degrees, tp_degrees
from planner.memory.orchestrator import activation_offload_bytes, estimate, host_capacity, resolve, sequence_past_positions
from planner.parallel.dims import refuse_unmodelled
from planner.parallel.pipeline import balanced_split, check_schedule, check_split, parallel_step, stage_bounds
from planner.recipes.precision import RECIPES
from planner.plan.recipe import allowed_layouts, checkpointings, recipe_fields, refused_by_recipe
from planner.schema import (MAX_GLOBAL_BATCH, MAX_TOKENS, SHARDING_STRATEGIES, Candidate, EstimateRequest,
                            EstimateResult, PlanRequest, PlanResult, TopologySummary)
from planner.time.step import Combo, StepSettings, estimate_with_time, frozen_base_shape, step_times
from planner.strategies import STRATEGIES, explicit_hsdp_shard, strategy as lookup_strategy
from planner.cluster.topology import Topology
from planner.units import GB, GIB

__all__ = ["estimate_with_time", "plan"]  # estimate_with_time: re-exported for scripts outside the repo (/work/golden/dump.py)



@dataclass(frozen=True)
class Setting(Combo):
    """One searched configuration: the time model's Combo and the pipeline and expert degrees
    (planner/plan/layouts.py places them; their memory and time are the estimate's: planner/parallel/pipeline.py
    and experts.py); pp is the Combo's own."""

    ep: int = 1
    split: tuple[int, int] | None = None  # a pipeline's first and last stages' blocks, when uneven
    schedule: str = "1f1b"  # a pipeline's schedule and stages per rank (PIPELINE_SCHEDULES)
    virtual_stages: int = 1

    @property
    def model_parallel(self) -> int:
        """GPUs that share one data-parallel rank's work, and the expert group: 1 for data parallelism."""
        return self.tp * self.cp * self.pp * self.ep


Row = tuple[Setting, int, float, bool, timing.StepTime]  # (setting, micro-batch, peak bytes, fits, step time)


def _hsdp_shards(gpus: int, nodes: int) -> list[int]:
    """HSDP shard group sizes worth planning: every divisor of a node's GPUs from 2 up (groups of
    consecutive ranks, as DeviceMesh builds them), the whole node only when there are 2+ nodes."""
    return [d for d in range(2, gpus + 1) if gpus % d == 0 and (d < gpus or nodes > 1)]


def _offloads(name: str) -> list[tuple[str, str]]:
    s = lookup_strategy(name)
    return framework_of(s).offload_options(s)


def _request(req: PlanRequest, combo: Setting, micro: int, model_fields: dict,
             accumulation: int | None = None) -> EstimateRequest:
    # without pp, accumulation > 1: a micro-batch after the first holds the earlier ones' gradients
    # (planner/frameworks/), the same memory for any number of them; a pipeline's is _degree_fields'
    steps = {"gradient_accumulation": accumulation} if combo.pp == 1 and accumulation and accumulation > 1 else {}
    return (EstimateRequest(
        **model_fields, **steps, strategy=combo.strategy, gpus=combo.gpus, nodes=req.nodes, gpu=req.gpu,
        precision=req.precision, optimizer=req.optimizer, optimizer_in_backward=req.optimizer_in_backward,
        micro_batch=micro, seq_len=req.seq_len,
        checkpointing=combo.checkpointing, attention=req.attention,
        offload_optimizer=combo.offload_optimizer, offload_params=combo.offload_params,
        hsdp_shard_size=explicit_hsdp_shard(combo.strategy, combo.shard * combo.tp if combo.shard else None,
                                            combo.gpus),
        host_memory_gib=req.host_memory_gib, topology=req.topology, **_reduce_field(req, combo.strategy),
        **_version_field(req, combo.strategy),
        alloc_conf=req.alloc_conf, nccl_buffsize_bytes=req.nccl_buffsize_bytes,
        **_degree_fields(req, combo, micro, accumulation)))


def _reduce_field(req: PlanRequest, strategy: str) -> dict:
    """FSDP2's reduce dtype for the sharding candidates (none when it is the default, so that the
    request stays the one it always was); the other strategies have no such setting."""
    return {"reduce_dtype": req.reduce_dtype} if req.reduce_dtype != "compute" and strategy in SHARDING_STRATEGIES else {}


def _version_field(req: PlanRequest, strategy: str) -> dict:
    """The plan's framework_version where it is the strategy's framework's (planner/frameworks/base.py)."""
    return version_field(lookup_strategy(strategy), req.framework_version)


def _degree_fields(req: PlanRequest, combo: Setting, micro: int, accumulation: int | None = None) -> dict:
    """The setting's model-parallel degrees as request fields (none when all are 1, so that a
    data-parallel estimate stays the request it always was). A pipeline's memory depends on its
    micro-batches in flight: its request carries the accumulation and the request's schedule."""
    fields = {k: v for k, v in (("tp", combo.tp), ("cp", combo.cp), ("pp", combo.pp), ("ep", combo.ep)) if v > 1}
    if combo.tp > 1 and req.tp_plan != "torchtitan":
        fields["tp_plan"] = req.tp_plan  # whose TP layout (the default stays out of the request)
    if combo.pp > 1:
        fields |= {"gradient_accumulation": accumulation or _per_rank(req, combo) // micro, "pp_schedule": combo.schedule,
                   "pp_virtual_stages": combo.virtual_stages} | _split_fields(combo.split)
    return fields


def _schedule_fields(combo: Combo) -> dict:
    """A pipeline candidate's schedule (none without pp)."""
    if combo.pp == 1 or not isinstance(combo, Setting):
        return {}
    return {"pp_schedule": combo.schedule, "pp_virtual_stages": combo.virtual_stages}


def _split_fields(split: tuple[int, int] | None) -> dict:
    """A pipeline's uneven split as request fields (none for an even split)."""
    return {} if split is None else {"pp_first_stage_layers": split[0], "pp_last_stage_layers": split[1]}


def _split(req: PlanRequest, arch, pp: int, virtual_stages: int) -> tuple[int, int] | None:
    """The split a pipeline layout is planned with: the request's own, else where pp x virtual
    stages does not divide the blocks the best uneven one (planner/parallel/pipeline.py balanced_split)."""
    if pp == 1:
        return None
    if req.pp_first_stage_layers is not None or req.pp_last_stage_layers is not None:
        bounds = stage_bounds(arch.num_layers, pp * virtual_stages, req.pp_first_stage_layers,
                              req.pp_last_stage_layers)
        return bounds[0][1], bounds[-1][1] - bounds[-1][0]
    return balanced_split(arch, pp, virtual_stages, req.seq_len)


# The pipeline schedules a plan searches where the request fixes none: torch 2.13's
# torch/distributed/pipelining/schedules.py Schedule1F1B, ScheduleInterleaved1F1B (at torchtitan's
# default of 2 stages per rank for a multi-stage schedule) and ScheduleGPipe, the ones whose memory
# planner/parallel/pipeline.py replays action by action. ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
# ScheduleZBVZeroBubble and ScheduleDualPipeV split the backward into input and weight gradients
# (or run two directions): their memory is not modelled, so they are not searched.
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("gpipe", 1))


def _schedules(req: PlanRequest, arch, pp: int) -> list[tuple[str, int, tuple[int, int] | None]]:
    """(schedule, virtual stages, split) for each schedule searched at this pipeline degree: the
    request's own when it gives one, else PIPELINE_SCHEDULES; one whose stages the blocks cannot
    fill (fewer blocks than stages, or no uneven split) is left out."""
    if pp == 1:
        return [("1f1b", 1, None)]
    fixed = {"pp_schedule", "pp_virtual_stages"} & req.model_fields_set
    options = [(req.pp_schedule, req.pp_virtual_stages)] if fixed else list(PIPELINE_SCHEDULES)
    out = []
    given = req.pp_first_stage_layers is not None or req.pp_last_stage_layers is not None
    for schedule, v in options:
        if arch.num_layers < pp * v:
            continue
        if given:
            try:  # the request's split, over this schedule's pp x v stages
                check_split(arch.num_layers, pp, v, req.pp_first_stage_layers, req.pp_last_stage_layers)
            except PlannerError:
                continue
        split = _split(req, arch, pp, v)
        if split is None and arch.num_layers % (pp * v):
            continue
        out.append((schedule, v, split))
    return out


def _architecture(req: PlanRequest):
    model = catalogue_model(req.model) if req.model else model_from_config(req.model_config_)
    return as_loaded(model, req.text_only, req.include_vision).architecture


def _offloaded_per_sequence(request: EstimateRequest) -> float:
    """activation_offload's bytes per sequence one rank of this setting moves to the host and back
    (its activations are linear in the micro-batch); 0 without offloading. A setting the estimate
    refuses is refused there."""
    if not request.activation_offload:
        return 0.0
    try:
        return activation_offload_bytes(resolve(request)) / request.micro_batch
    except PlannerError:
        return 0.0


def _frozen(request: EstimateRequest, arch):
    """The LoRA / QLoRA step the time model takes for this request (None for full fine-tuning)."""
    if request.finetune == "full":
        return None
    try:
        return frozen_base_shape(request, arch)
    except PlannerError:  # refused for this combo: its estimate says so and the combo is skipped
        return None


def _per_rank(req: PlanRequest, combo: Setting) -> int:
    """Sequences per data-parallel rank per step: the global batch over the data-parallel ranks
    (a TP, CP or pipeline group trains one rank's share together; EP borrows data-parallel ranks)."""
    return req.global_batch * combo.tp * combo.cp * combo.pp // (combo.gpus * req.nodes)


@lru_cache(maxsize=1024)
def _divisors(n: int) -> np.ndarray:
    """The divisors of n, ascending (shared between settings: read, never written)."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    out = np.array(sorted(set(small + [n // d for d in small])), dtype=np.int64)
    out.flags.writeable = False
    return out


class _Grid:
    """Everything about one combo that the vectorized evaluation needs."""

    def __init__(self, combo: Setting, one: EstimateResult, two: EstimateResult):
        self.combo = combo
        self.constant = np.array([2 * a.bytes - b.bytes for a, b in zip(one.phases, two.phases)], dtype=np.float64)
        self.slope = np.array([b.bytes - a.bytes for a, b in zip(one.phases, two.phases)], dtype=np.float64)
        self.framework = one.per_device.framework_bytes

    def peaks(self, micro: np.ndarray) -> np.ndarray:
        return (self.constant[:, None] + self.slope[:, None] * micro[None, :]).max(axis=0) + self.framework


class _Search:
    """What one plan's evaluations share: the cluster, the usable memory, the model, and the
    estimates made while searching (the ranking reuses them instead of estimating again)."""

    def __init__(self, req: PlanRequest, g: Gpu, model, topo: Topology, fabric: dict, nics: int, usable: float,
                 model_fields: dict):
        self.req, self.g, self.model, self.topo, self.fabric, self.nics = req, g, model, topo, fabric, nics
        self.usable, self.model_fields = usable, model_fields
        self.estimates: dict[tuple[int, Setting, int], EstimateResult] = {}
        self.compute_scale = 1.0  # a calibration profile's kernel-rate factor (planner/time/kernels.py)
        self.refusals: list[PlannerError] = []  # settings the request's recipe refused (planner/plan/recipe.py)

    def estimate(self, req: PlanRequest, combo: Setting, micro: int,
                 request: EstimateRequest | None = None, accumulation: int = 1) -> EstimateResult:
        """``accumulation``: micro-batches per step without pp (a later micro-batch's memory holds
        the earlier ones' gradients); a pipeline's request carries its own."""
        key = (req.nodes, combo, micro, accumulation if combo.pp == 1 else 1)
        if key not in self.estimates:
            self.estimates[key] = estimate(request or _request(req, combo, micro, self.model_fields,
                                                               accumulation if combo.pp == 1 else None),
                                           simulate=False)
        return self.estimates[key]

    def shown(self, req: PlanRequest, combo: Setting, micro: int, accumulation: int = 1) -> EstimateResult:
        """The estimate of a candidate the plan shows, with the caching allocator replayed
        (planner/memory/reserved.py): the search judges settings on the live peak with the request's
        headroom; a shown candidate must also fit on reserved memory (simulated)."""
        return estimate(_request(req, combo, micro, self.model_fields, accumulation if combo.pp == 1 else None))


def plan(req: PlanRequest, profile=None) -> PlanResult:
    """``profile``: the Profile the request names, read by the adapter (backend/profiles.py)."""
    if req.finetune == "auto":
        from planner.plan.finetune import plan_finetune_auto

        return plan_finetune_auto(req, lambda one: plan(one, profile))
    started = wallclock.perf_counter()
    check_version(req.framework_version)
    g = lookup_gpu(req.gpu)
    check_precision(g, req.precision)
    refuse_unmodelled(req)
    if req.pp > 1 and req.finetune != "full":  # as the estimate refuses it (planner/parallel/pipeline.py check_framework)
        raise PlannerError(f"pp={req.pp} with finetune {req.finetune}: the pipeline model counts full fine-tuning; "
                           "plan LoRA/QLoRA without pp", field="pp")
    model = as_loaded(catalogue_model(req.model) if req.model else model_from_config(req.model_config_),
                      req.text_only, req.include_vision)
    arch = model.architecture
    model_fields = {"model": req.model} if req.model else {"model_config": req.model_config_}
    model_fields |= {name: True for name in ("include_vision", "text_only") if getattr(req, name)}
    model_fields |= finetune_fields(req) | recipe_fields(req)
    topo, fabric_name, nics = topology_of(req, g)
    compute_efficiency, link_efficiency = profile_efficiencies(req.profile, req.gpu, topo, req.gpus,
                                                               req.compute_efficiency, req.link_efficiency, profile)
    if req.profile is not None:
        req = req.model_copy(update={"compute_efficiency": compute_efficiency, "link_efficiency": link_efficiency})
    capacity = g.memory_bytes
    usable = capacity * (1 - req.headroom)
    search = _Search(req, g, model, topo, timing.fabric(fabric_name), nics, usable, model_fields)
    search.compute_scale = profile_compute_scale(req.profile, profile)
    layouts, rejected = _layouts(req, req.gpus, arch, topo)
    layouts, recipe_notes = allowed_layouts(req, layouts)
    _check_fixed_degrees(req)
    _check_split(req, arch)
    _check_batch(req, layouts)
    rows, evaluated = _evaluate(search, req, layouts)
    if not rows and search.refusals:  # the recipe refused every setting: say why, as the estimate would
        raise search.refusals[0]
    layout_notes = [str(r) for r in rejected] + _search_notes(req, layouts) + recipe_notes
    if "cp" not in req.model_fields_set and not any(r[3] for r in rows):
        cp_rows, count, cp_notes = _context_parallel_rows(search, req)
        rows += cp_rows
        evaluated += count
        layout_notes += ["nothing fits without context parallelism: cp searched"] + cp_notes
    fewer = []
    if req.nodes > 1 and req.objective != "memory":
        fewer, count = _fewer_node_rows(search, req, rows)
        evaluated += count
    result = _rank(search, req, rows, fewer, capacity, fabric_name, evaluated, started)
    if layout_notes:
        result = result.model_copy(update={"notes": result.notes + layout_notes})
    if arch is not None and arch.model_type in LOADED_CLASS:  # say what was counted (the reader's note), as estimate does
        counted = [n for n in arch.notes if n.startswith(f"{arch.model_type}: ")]
        result = result.model_copy(update={"notes": result.notes + counted})
    if req.finetune != "full":
        result = with_finetune(result, req.finetune)
    return result


def _fewer_nodes(req: PlanRequest) -> list[int]:
    """Node counts below the request's (halving) that still divide the global batch: on a slow
    fabric the best plan may leave nodes idle rather than send every gather through their NICs."""
    counts, k = [], req.nodes // 2
    while k >= 1:
        if req.global_batch % (req.gpus * k) == 0:
            counts.append(k)
        k //= 2
    return counts


def _fewer_node_rows(search: _Search, req: PlanRequest, rows: list[Row]) -> tuple[list[tuple[int, list[Row]]], int]:
    """The search on each smaller node count that could beat the full cluster's best fitting
    option by more than the time model's uncertainty (what _fewer_nodes_advice asks).

    Bound: every setting computes at least its GPU's share of the batch's FLOPs without
    recomputation (step >= compute; the pipeline's bubble only adds), and that share grows as the
    nodes shrink; a node count whose bound is no better than the advice's threshold cannot win,
    and neither can any smaller one. (For --objective cost the bound is the same at every node
    count: GPU-seconds per token >= FLOPs per token / the GPU's achieved FLOP/s.)"""
    fitting = [r for r in rows if r[3]]
    if not fitting:
        here = None
    else:
        here = min(_fewer_value(req, req.nodes, r[4]) for r in fitting)
    out, evaluated = [], 0
    floor = _compute_floor(search, req)
    for k in _fewer_nodes(req):
        # the recommendation lies within the ties of the best fitting option (_tie_order), and the
        # advice asks for more than the ties below the recommendation
        if here is not None and floor is not None and \
                _floor_value(req, k, floor) >= here * (1 + TIE_TOLERANCE) * (1 - TIE_TOLERANCE):
            break
        fewer = req.model_copy(update={"nodes": k})
        layouts = [layout for layout in _layouts(fewer, req.gpus, search.model.architecture, search.topo)[0]]
        k_rows, count = _evaluate(search, fewer, layouts)
        evaluated += count
        out.append((k, k_rows))
    return out, evaluated


def _fewer_value(req: PlanRequest, nodes: int, t: timing.StepTime) -> float:
    return req.gpus * nodes / t.tokens_per_second if req.objective == "cost" else t.step_seconds


def _compute_floor(search: _Search, req: PlanRequest) -> float | None:
    """Seconds of compute per sequence on one GPU without recomputation (full fine-tuning: the
    FLOPs the time model counts, at the achieved fraction of the GPU's peak); None for LoRA, whose
    FLOPs depend on the adapters (no bound taken)."""
    arch = search.model.architecture
    if req.finetune != "full" or arch is None:
        return None
    peak = RECIPES[req.precision].peak_dtype(search.g.peak_tflops)
    if req.compute_efficiency is not None:
        flops = timing.flops_per_token(arch, req.seq_len, "none") * req.seq_len
        return flops / (search.g.peak_tflops[peak] * 1e12 * req.compute_efficiency)
    # the kernel model runs at most the matmul rate on every matmul FLOP and adds attention,
    # elementwise and host time (planner/time/kernels.py): the matmuls alone are a lower bound
    flops = 6 * timing.matmul_parameters(arch) * req.seq_len
    return flops / kernels.rates(search.g, peak, search.compute_scale).matmul_flops


def _compute_note(req: PlanRequest, g: Gpu, compute_scale: float) -> str:
    if req.compute_efficiency is not None:
        return f"compute at {req.compute_efficiency:.0%} of {g.name}'s peak dense TFLOP/s (the compute_efficiency override)"
    r = kernels.rates(g, RECIPES[req.precision].peak_dtype(g.peak_tflops), compute_scale)
    return (f"compute: each kernel at its measured rate (planner/time/kernels.py): matmuls at {r.matmul_source}"
            + (f" x {compute_scale:.3f} (profile)" if compute_scale != 1.0 else "")
            + f", attention at FlashAttention-2's measured rate, elementwise work at "
            f"{r.memory_bytes_per_s / 1e9:,.0f} GB/s")


def _floor_value(req: PlanRequest, nodes: int, per_sequence: float) -> float:
    """The lower bound of the objective on ``nodes`` nodes: the GPU's share of the batch's compute."""
    step = per_sequence * req.global_batch / (req.gpus * nodes)
    if req.objective == "cost":
        return req.gpus * nodes * step / (req.global_batch * req.seq_len)
    return step


def _evaluate(search: _Search, req: PlanRequest, layouts: list[tuple[int, int, int, int]],
              strategies: tuple[str, ...] = STRATEGIES) -> tuple[list[Row], int]:
    """(setting, micro-batch, peak bytes, fits, step time) for every setting on the request's
    GPUs per node and nodes, for each (tp, cp, pp, ep) layout.

    Bound: where a setting of the same layout family (layout_family: dp, dp x tp, dp x tp x pp,
    ...) already fits, a layout none of whose step times comes within the time model's uncertainty
    (TIE_TOLERANCE: the ranking's ties) of that family's best fitting one (by step time or
    GPU-seconds per token, the same ordering at a fixed GPU count) can be neither recommended nor
    its family's best (PlanResult.families): its memory is not estimated. Each family is searched
    to its own best, so the table can show the best of each beside the winner; data parallelism
    alone is not time-bounded (every strategy's settings are listed, offload among them)."""
    rows: list[Row] = []
    evaluated = 0
    world = req.gpus * req.nodes
    best_time: dict[str, float | None] = {}  # per layout family: each family's best is listed (PlanResult.families)
    best_peak: dict[str, float | None] = {}
    arch = search.model.architecture
    schedules = {pp: _schedules(req, arch, pp) for pp in {d[2] for d in layouts}}
    for tp, cp, pp, ep in layouts:  # data-parallel (1, 1, 1, 1) first: it gives the bound
        family = layout_family(tp, cp, pp, ep)
        if world % (tp * cp * pp) or req.global_batch % (world // (tp * cp * pp)):
            continue
        for name, (schedule, virtual, split) in ((n, o) for n in strategies for o in schedules[pp]):
            s = lookup_strategy(name)
            if not s.runs_on(world) or not _framework_runs(req, s, tp, cp, pp, schedule):
                continue
            shards = _hsdp_shards(req.gpus // tp, req.nodes // pp) if s.shard_within_node else [None]
            for shard, ckpt in ((sh, c) for sh in shards for c in checkpointings(req)):
                if ep > 1 and _expert_shards(s, shard, world // (tp * cp * pp), cp) % ep:
                    continue  # ep borrows its ranks from dp_shard x cp (planner/parallel/dims.py)
                # model-parallel layouts are the alternative to offload: searched without it
                for off_opt, off_par in (_offloads(name) if tp * cp * pp * ep == 1 else [("none", "none")]):
                    if world == 1 and not s.one_device and (off_opt, off_par) == ("none", "none"):
                        continue  # on one device a data-parallel framework adds only its offload to "single"
                    combo = Setting(req.gpus, name, ckpt, off_opt, off_par, shard, tp, cp,
                                    tp > 1 and s.framework == "torch" and req.tp_plan == "torchtitan", pp, ep, split,
                                    schedule, virtual)
                    # data parallelism alone is listed whole (each strategy's settings, offload among them)
                    time_bound = best_time.get(family) if family != "dp" else None
                    found, count = _evaluate_setting(search, req, combo, time_bound, best_peak.get(family))
                    evaluated += count
                    rows += found
                    if req.objective == "memory":
                        best_peak[family] = _smallest([r[2] for r in found if r[3]], best_peak.get(family))
                    else:
                        best_time[family] = _smallest([r[4].step_seconds for r in found if r[3]],
                                                      best_time.get(family))
    return rows, evaluated


def layout_family(tp: int, cp: int, pp: int, ep: int) -> str:
    """The layout family of a setting: which model-parallel degrees it uses beside data
    parallelism ("dp", "dp x tp", "dp x tp x pp", ...), whatever their values."""
    return " x ".join(["dp"] + [name for name, degree in (("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep))
                                if degree > 1])


def _smallest(values: list[float], default: float | None) -> float | None:
    return min(values + ([default] if default is not None else []), default=None)


def _expert_shards(s, shard: int | None, dp: int, cp: int) -> int:
    """dp_shard x cp of a strategy's data-parallel part (planner/parallel/dims.py dims_for): the ranks
    expert parallelism borrows."""
    if shard is not None:
        return shard * cp
    return (dp if s.shards_optimizer else 1) * cp


def _framework_runs(req: PlanRequest, s, tp: int, cp: int, pp: int, schedule: str = "1f1b") -> bool:
    """Which data-parallel realisations take a model-parallel layout: torch's (torchtitan: FSDP2,
    HSDP, DDP with TP and with pipelining; FSDP2/HSDP with CP) and DeepSpeed's AutoTP with ZeRO (no
    CP) and its pipeline engine with ZeRO-0/1, its 1F1B schedule and without AutoTP (deepspeed
    0.19.8 runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism";
    runtime/engine.py _configure_tensor_parallel_states replaces the engine's mpu, the pipeline's
    topology, by AutoTP's groups). Expert parallelism: wherever ep divides dp_shard x cp."""
    if cp > 1 and not (s.framework == "torch" and s.shards_parameters):
        return False
    if tp > 1:
        try:  # the framework refuses the TP layout it does not train (transformers' plan: torch, no DDP x TP)
            framework_of(s).check_tp_plan(s, req.tp_plan, tp, req.gpus * req.nodes // (tp * cp * pp))
        except PlannerError:
            return False
    if pp > 1:
        if req.finetune != "full":
            return False  # the pipeline model counts full fine-tuning (planner/parallel/pipeline.py check_framework)
        if s.framework == "deepspeed" and ((s.zero_stage or 0) >= 2 or schedule != "1f1b" or tp > 1):
            return False
    return True


# What an estimate request can state (planner/schema.py EstimateRequest): a pipeline setting's
# request carries its micro-batch count as gradient_accumulation.
MAX_ACCUMULATION = 1 << 16
MAX_MICRO_BATCH = 1 << 16


def _micro_options(req: PlanRequest, combo: Setting, per_rank: int, num_layers: int) -> np.ndarray:
    """The micro-batch sizes a setting can take: the divisors of its rank's share of the batch, and
    for a pipeline those whose micro-batch count its schedule runs (planner/parallel/pipeline.py
    check_schedule: torch's schedules refuse the rest) and an estimate request can state."""
    if combo.pp == 1:
        return _stateable(per_rank, req.seq_len)
    if per_rank * combo.gpus * req.nodes > MAX_GLOBAL_BATCH:
        return _divisors(per_rank)[:0]
    micro = _pipeline_micro(per_rank, combo.pp, combo.schedule, combo.virtual_stages, num_layers, req.seq_len)
    if combo.schedule == "gpipe" and not {"pp_schedule", "pp_virtual_stages"} & req.model_fields_set:
        # Bound: where 1F1B runs the same micro-batches (m >= pp) it has GPipe's bubble and holds
        # fewer of them in flight (min(m, pp - rank) against m: max_in_flight), so GPipe cannot be
        # recommended there; it is searched where 1F1B refuses (fewer micro-batches than stages)
        micro = micro[per_rank // micro < combo.pp]
    return micro


@lru_cache(maxsize=1024)
def _stateable(per_rank: int, seq_len: int) -> np.ndarray:
    """The divisors of the rank's share that an estimate request can state: its accumulation, its
    micro-batch and the micro-batch's tokens within the schema's bounds (a candidate is the
    estimate of its configuration: emit and verify take it as one)."""
    divisors = _divisors(per_rank)
    keep = (per_rank // divisors <= MAX_ACCUMULATION) & (divisors <= MAX_MICRO_BATCH) & \
        (divisors * seq_len <= MAX_TOKENS)
    if keep.all():
        return divisors
    out = divisors[keep]
    out.flags.writeable = False
    return out


@lru_cache(maxsize=1024)
def _pipeline_micro(per_rank: int, pp: int, schedule: str, virtual_stages: int, num_layers: int,
                    seq_len: int) -> np.ndarray:
    keep = []
    for mb in _divisors(per_rank).tolist():
        m = per_rank // mb
        if m > MAX_ACCUMULATION or mb > MAX_MICRO_BATCH or mb * seq_len > MAX_TOKENS:
            continue
        try:
            check_schedule(pp, schedule, virtual_stages, m, num_layers)
        except PlannerError:
            continue
        keep.append(mb)
    out = np.array(keep, dtype=np.int64)
    out.flags.writeable = False
    return out


OPTIMIZER_FIELDS = ("optimizer", "optimizer_in_backward")  # the fields a refused optimizer composition names


def _evaluate_setting(search: _Search, req: PlanRequest, combo: Setting, time_bound: float | None,
                      peak_bound: float | None) -> tuple[list[Row], int]:
    """The rows of one setting (its micro-batch options, or none when a bound proves it cannot be
    recommended) and how many options were evaluated: all of them once their step times (for a
    pipeline or expert layout, the bound of its compute) are computed, as a vector.

    Bound: every phase of a step grows with the micro-batch (activations and their transients
    scale with its tokens; nothing shrinks: tests/test_plan_search.py checks the slopes), so a
    setting that does not fit at micro-batch 1 fits at no larger one, and its smallest peak is at
    micro-batch 1: the larger options' memory is not estimated."""
    per_rank = _per_rank(req, combo)
    arch = search.model.architecture
    micro = _micro_options(req, combo, per_rank, arch.num_layers)
    if micro.size == 0:
        return [], 0
    first = _request(req, combo, int(micro[-1]) if combo.pp > 1 else 1, search.model_fields)
    times = step_times(StepSettings.of(req, search.compute_scale), combo, micro, per_rank, search.model.parameters, arch, search.g,
                       search.topo, search.fabric, search.nics, frozen=_frozen(first, arch),
                       offloaded_per_sequence=_offloaded_per_sequence(first))
    if combo.pp * combo.ep > 1:
        return _model_parallel_rows(search, req, combo, micro, per_rank, times, first, time_bound,
                                    peak_bound), micro.size
    if time_bound is not None and min(t.step_seconds for t in times) > time_bound * (1 + TIE_TOLERANCE):
        return [], micro.size
    try:
        return _grid_rows(search, req, combo, micro, times, first), micro.size
    except PlannerError as refused:  # a setting the fine-tuning, the optimizer or the recipe refuses (QLoRA
        # under ZeRO-3, Muon under sharding, a step in backward with accumulation, a fused loss under tp)
        if refused_by_recipe(refused):
            search.refusals.append(refused)
        elif req.finetune == "full" and refused.field not in OPTIMIZER_FIELDS:
            raise
        return [], micro.size


def _grid_rows(search: _Search, req: PlanRequest, combo: Setting, micro: np.ndarray, times: list[timing.StepTime],
               first: EstimateRequest) -> list[Row]:
    """Every micro-batch option's row from two estimates (each phase is affine in the micro-batch),
    or the smallest option's alone when it does not fit (the bound of _evaluate_setting).

    An option below the rank's share accumulates: its memory is a later micro-batch's, which holds
    everything the first does and the earlier gradients (planner/frameworks/), the same for any
    number of them, so those options come from the estimates at micro-batch 1 and 2 with
    accumulation; the option of the whole share (no accumulation) is estimated itself."""
    per_rank = _per_rank(req, combo)
    host = host_capacity(req, search.g)  # offload's host RAM per node does not depend on the micro-batch
    if per_rank == 1:
        one = search.estimate(req, combo, 1, first)
        peak = one.per_device.peak_bytes
        host_ok = host is None or one.host.peak_bytes <= host[0]
        return [(combo, 1, float(peak), bool(peak <= search.usable and host_ok), times[0])]
    whole = int(micro[-1]) == per_rank
    small = micro[:-1] if whole else micro
    rows: list[Row] = []
    host_ok = True
    if small.size:
        base = search.estimate(req, combo, 1, accumulation=2)
        host_ok = host is None or base.host.peak_bytes <= host[0]
        if base.per_device.peak_bytes > search.usable or not host_ok:
            smallest = int(small[0])  # 1, unless its accumulation is more than a request can state
            e = base if smallest == 1 else search.estimate(req, combo, smallest, accumulation=2)
            rows.append((combo, smallest, float(e.per_device.peak_bytes), False, times[0]))
        else:
            peaks = (np.array([float(base.per_device.peak_bytes)]) if small.size == 1 and small[0] == 1 else
                     _Grid(combo, base, search.estimate(req, combo, 2, accumulation=2)).peaks(small))
            rows += [(combo, int(mb), float(peaks[k]), bool(peaks[k] <= search.usable), times[k])
                     for k, mb in enumerate(small)]
    if whole:
        e = search.estimate(req, combo, per_rank)
        if host is not None and not small.size:
            host_ok = e.host.peak_bytes <= host[0]
        peak = e.per_device.peak_bytes
        rows.append((combo, per_rank, float(peak), bool(peak <= search.usable and host_ok), times[len(micro) - 1]))
    return rows


def _model_parallel_rows(search: _Search, req: PlanRequest, combo: Setting, micro: np.ndarray, per_rank: int,
                         times: list[timing.StepTime], first: EstimateRequest, time_bound: float | None,
                         peak_bound: float | None) -> list[Row]:
    """The rows of a pipeline or expert-parallel setting, bounded by:

    - its compute: a rank's step is at least its share of the compute (the bubble stretches it,
      the collectives and all-to-alls only add), so above the best fitting step time found so far
      (beyond the ties) it cannot be recommended;
    - its memory floor, one estimate: a pipeline's resident bytes (between steps a stage holds its
      states and one receive buffer per micro-batch, m buffers of micro_batch sequences: the
      rank's share of the batch whatever the split, so one figure for every option, estimated at
      the fewest micro-batches, the cheapest to simulate); an expert layout's peak at micro-batch
      1 (the bound of _evaluate_setting). Above the usable memory no option fits: where another
      setting fits it cannot be recommended and is not listed;
    - its step times (the pipeline's bubble and point-to-point sends, the all-to-alls): where
      another setting fits, a layout none of whose options within the ties of it fits is not listed."""
    if time_bound is not None and times[0].compute_seconds / combo.pp > time_bound * (1 + TIE_TOLERANCE):
        return []

    def beaten(ts: list[timing.StepTime]) -> bool:
        return time_bound is not None and min(t.step_seconds for t in ts) > time_bound * (1 + TIE_TOLERANCE)

    k = len(micro) - 1 if combo.pp > 1 else 0  # the option the floor is estimated at
    timed = None
    # which bound is tried first is a matter of cost only (each proves what it proves): a pipeline
    # estimate replays pp x virtual stages x m actions (the floor: m = pp, twice, or the fewest
    # micro-batches, _resident_floor), the step times cost one call per option
    replayed = 2 * combo.pp if _extrapolated(req, combo, per_rank) else per_rank // int(micro[k])
    if combo.pp > 1 and micro.size < combo.pp * combo.virtual_stages * replayed:
        timed = _parallel_times(search, req, combo, micro, per_rank, times, first)
        if beaten(timed):
            return []
    floor = _resident_floor(search, req, combo, per_rank) if combo.pp > 1 else None
    if floor is None:
        e = search.estimate(req, combo, int(micro[k]), first)
        floor = e.per_device.resident_bytes if combo.pp > 1 else e.per_device.peak_bytes
    if floor > search.usable:
        if time_bound is not None or peak_bound is not None:
            return []  # another setting fits, none of this one's options does
        e = search.estimate(req, combo, int(micro[k]), first)
        t = timed[k] if timed else _parallel_times(search, req, combo, micro[k:k + 1], per_rank, times[k:k + 1],
                                                   first)[0]
        return [(combo, int(micro[k]), float(e.per_device.peak_bytes), False, t)]
    if req.objective == "memory" and peak_bound is not None and floor > peak_bound:
        return []
    if timed is None:
        timed = _parallel_times(search, req, combo, micro, per_rank, times, first)
        if beaten(timed):
            return []
    rows = (_pipeline_rows(search, req, combo, micro, timed, time_bound) if combo.pp > 1
            else _grid_rows(search, req, combo, micro, timed, first))
    if time_bound is not None and not any(r[3] and r[4].step_seconds <= time_bound * (1 + TIE_TOLERANCE)
                                          for r in rows):
        return []  # its options that could win do not fit: it cannot be recommended
    return rows


def _resident_floor(search: _Search, req: PlanRequest, combo: Setting, per_rank: int) -> int | None:
    """A pipeline setting's resident bytes from two small estimates, where its fewest micro-batches
    are many (else None: that option is estimated itself). The resident bytes are the stage's
    states plus one receive buffer per sequence of the rank's share (m buffers of micro_batch
    sequences), so they are affine in m x micro_batch: at pp micro-batches of 1 and of 2 they give
    the states and the bytes per sequence (tests/test_plan_search.py checks the extrapolation
    against the estimate).

    What a rank keeps between steps (its states and receive buffers, pipeline.rank_phases) does
    not depend on checkpointing, so the floor of the setting without checkpointing stands for
    both: it is some rank's resident bytes, below that rank's peak under either setting, so below
    the worst rank's peak (a test checks the ranks' residents agree)."""
    pp = combo.pp
    if not _extrapolated(req, combo, per_rank):
        return None
    combo = replace(combo, checkpointing="none")
    one, two = (_floor_estimate(search, req, combo, mb) for mb in (1, 2))
    per_sequence = (two - one) // pp
    return one + (per_rank - pp) * per_sequence


def _extrapolated(req: PlanRequest, combo: Setting, per_rank: int) -> bool:
    """Whether _resident_floor extrapolates (the rank's share is many times pp sequences)."""
    return per_rank > 4 * combo.pp and 2 * req.seq_len <= MAX_TOKENS


def _floor_estimate(search: _Search, req: PlanRequest, combo: Setting, micro: int) -> int:
    """Resident bytes of the setting at pp micro-batches of ``micro`` sequences (a bound's input,
    not a row: the batch differs from the plan's). What a rank keeps between steps (its states and
    receive buffers, pipeline.rank_phases) is the same under every one-stage-per-rank schedule:
    gpipe's floor is 1f1b's."""
    if combo.virtual_stages == 1:
        combo = replace(combo, schedule="1f1b")
    key = (req.nodes, combo, -micro, 1)  # negative: apart from the rows' estimates
    if key not in search.estimates:
        search.estimates[key] = estimate(_request(req, combo, micro, search.model_fields, accumulation=combo.pp),
                                         simulate=False)
    return search.estimates[key].per_device.resident_bytes


def _parallel_times(search: _Search, req: PlanRequest, combo: Setting, micro: np.ndarray, per_rank: int,
                    times: list[timing.StepTime], first: EstimateRequest) -> list[timing.StepTime]:
    """Each option's step time with its pipeline bubble, point-to-point sends and expert
    all-to-alls: planner/parallel/pipeline.py parallel_step on the estimate's own Setup (as
    steptime.estimate_time), per micro-batch size and count."""
    setup = resolve(first)
    out = []
    for k, mb in enumerate(micro.tolist()):
        request = setup.request.model_copy(update={"micro_batch": mb, "gradient_accumulation": per_rank // mb})
        out.append(parallel_step(times[k], replace(setup, request=request), search.model.architecture, search.topo,
                                 search.fabric, search.nics, req.link_efficiency))
    return out


def _pipeline_rows(search: _Search, req: PlanRequest, combo: Setting, micro: np.ndarray,
                   times: list[timing.StepTime], time_bound: float | None) -> list[Row]:
    """The estimated rows of a pipeline setting. Its memory depends on the micro-batch count (the
    schedule's chunks in flight), so each option is its own estimate: fastest first, until one fits
    and the next is beyond the time model's uncertainty of it, or of the bound (the best fitting
    setting found before): those cannot be recommended. (--objective memory: every option.)"""
    rows: list[Row] = []
    memory_objective = req.objective == "memory"
    order = range(len(micro)) if memory_objective else sorted(range(len(micro)), key=lambda k: (times[k].step_seconds, k))
    fit_time = None
    for k in order:
        t = times[k]
        if not memory_objective:
            if fit_time is not None and t.step_seconds > fit_time * (1 + TIE_TOLERANCE):
                break
            if time_bound is not None and t.step_seconds > time_bound * (1 + TIE_TOLERANCE):
                break
        e = search.estimate(req, combo, int(micro[k]))
        fits = e.per_device.peak_bytes <= search.usable
        rows.append((combo, int(micro[k]), float(e.per_device.peak_bytes), fits, t))
        if fits and fit_time is None:
            fit_time = t.step_seconds
    return rows


def _hf_tp_pairs(pairs: list[tuple[int, int]], arch) -> tuple[list[tuple[int, int]], list[Rejected]]:
    """The (tp, cp) pairs transformers' own plan takes (planner/parallel/hf_plan.py refuses the rest)."""
    kept, refused = [], []
    for tp, cp in pairs:
        if tp == 1:
            kept.append((tp, cp))
            continue
        try:
            if cp > 1:
                raise PlannerError("transformers' TP is modelled without context parallelism", field="cp")
            if arch is not None:
                hf_rank_architecture(arch, tp)
        except PlannerError as exc:
            refused.append(Rejected("tp", tp, f"tp_plan=transformers: {exc}"))
            continue
        kept.append((tp, cp))
    return kept, refused


def _layouts(req: PlanRequest, gpus: int, arch, topo: Topology) -> tuple[list[tuple[int, int, int, int]],
                                                                         list[Rejected]]:
    """(tp, cp, pp, ep) layouts to search on ``gpus`` GPUs per node: data-parallel first, then the
    tensor/context-parallel ones, the expert-parallel ones and the pipeline ones. A degree the
    request gives explicitly is kept; else every TP degree inside the wiring's NVLink islands with
    cp 1 (CP is searched only when nothing fits without it: _context_parallel_rows), every pipeline
    degree whose stages are whole nodes (planner/plan/layouts.py pp_degrees) and every expert degree of
    a mixture of experts (ep_degrees)."""
    fields = req.model_fields_set
    rejected: list[Rejected] = []
    if {"tp", "cp"} & fields:
        pairs = [(req.tp, req.cp)]
    else:
        degrees, rejected = tp_degrees(topo, gpus, arch)
        pairs = [(tp, 1) for tp in degrees]
    if "pp" in fields:
        pps = [req.pp]
    elif req.activation_offload or (arch is not None and arch.vision_numels):
        pps = [1]  # not modelled: a pipeline's micro-batches offloaded; a vision tower's stage
    else:
        found, pp_rejected = pp_degrees(req.nodes, arch, req.pp_virtual_stages, req.seq_len)
        pps = [1] + found
        rejected = rejected + pp_rejected
    eps = [req.ep] if "ep" in fields else [1] + ep_degrees(arch)
    if req.tp_plan == "transformers":
        # transformers' own plan: TP alone or with FSDP2, on families whose plan it splits by whole heads
        pairs, refused = _hf_tp_pairs(pairs, arch)
        rejected = rejected + refused
    layouts = [(tp, cp, pp, ep) for pp in pps for ep in eps for tp, cp in pairs
               if req.tp_plan == "torchtitan" or tp == 1 or pp * ep == 1]  # transformers' TP: no pp, ep beside it
    return sorted(layouts, key=lambda d: (d[2] > 1, d[3] > 1, d[2], d[3], d[0], d[1])), rejected


def _check_fixed_degrees(req: PlanRequest) -> None:
    """A pipeline or expert degree the request fixes is refused, naming its operands, where no
    layout can take it (rather than a plan with no candidates)."""
    from planner.parallel.dims import data_parallel_size

    fields = req.model_fields_set
    if not {"pp", "ep"} & fields or req.pp * req.ep == 1:
        return
    tp, cp = (req.tp, req.cp) if {"tp", "cp"} & fields else (1, 1)
    world = req.gpus * req.nodes
    dp = data_parallel_size(world, tp, req.pp, cp, req.gpus, req.nodes)
    if req.global_batch % dp:
        raise PlannerError(f"global_batch({req.global_batch}) is not divisible by the {dp} data-parallel ranks of "
                           f"gpus({req.gpus}) * nodes({req.nodes}) / (tp({tp}) * pp({req.pp}) * cp({cp}))",
                           field="global_batch")


def _check_split(req: PlanRequest, arch) -> None:
    """An uneven split the request gives is for the pipeline degree it fixes."""
    first, last = req.pp_first_stage_layers, req.pp_last_stage_layers
    if first is None and last is None:
        return
    if "pp" not in req.model_fields_set or arch is None:
        raise PlannerError(f"pp_first_stage_layers({first}) / pp_last_stage_layers({last}) split a fixed pipeline: "
                           "give pp too (a plan that searches pp takes the best split of each degree itself)",
                           field="pp_first_stage_layers" if first is not None else "pp_last_stage_layers")
    check_split(arch.num_layers, req.pp, req.pp_virtual_stages, first, last)


def _check_batch(req: PlanRequest, layouts: list[tuple[int, int, int, int]]) -> None:
    """The global batch is micro-batch x accumulation x the data-parallel ranks (world / (tp x cp x
    pp)); refused, naming the degrees, only where no layout's data-parallel ranks divide it."""
    world = req.gpus * req.nodes
    if any(world % (tp * cp * pp) == 0 and req.global_batch % (world // (tp * cp * pp)) == 0
           for tp, cp, pp, _ in layouts):
        return
    tried = sorted({(tp, cp, pp) for tp, cp, pp, _ in layouts if world % (tp * cp * pp) == 0})
    if not tried:
        return  # no layout fits the GPUs at all: the plan answers with no option and the layouts' reasons
    shown = "; ".join(f"tp {tp} x cp {cp} x pp {pp}: {world // (tp * cp * pp)}" for tp, cp, pp in tried[:6])
    more = f" and {len(tried) - 6} more" if len(tried) > 6 else ""
    raise PlannerError(f"global_batch({req.global_batch}) is not divisible by the data-parallel ranks of any layout "
                       f"searched on gpus({req.gpus}) * nodes({req.nodes}) = {world} ({shown}{more}); give a multiple of "
                       "one of them, or fix tp/pp/cp", field="global_batch")


def _search_notes(req: PlanRequest, layouts: list[tuple[int, int, int, int]]) -> list[str]:
    """What the search tried beyond data and tensor parallelism (pipeline and expert degrees)."""
    pps = sorted({d[2] for d in layouts} - {1})
    eps = sorted({d[3] for d in layouts} - {1})
    notes = []
    if pps:
        fixed = {"pp_schedule", "pp_virtual_stages"} & req.model_fields_set
        options = [(req.pp_schedule, req.pp_virtual_stages)] if fixed else list(PIPELINE_SCHEDULES)
        schedule = ", ".join(name + (f" with {v} virtual stages" if v > 1 else "") for name, v in options)
        given = ", the request's pp_schedule" if fixed else ""
        notes.append(f"pipeline layouts searched: pp {', '.join(map(str, pps))} ({schedule}{given}), with DDP, "
                     "FSDP2 and HSDP (torch pipelining) and ZeRO-0/1 without AutoTP (DeepSpeed's pipeline engine, "
                     "1f1b), no offload")
    if eps:
        notes.append(f"expert-parallel layouts searched: ep {', '.join(map(str, eps))}, where ep divides the "
                     "strategy's dp_shard x cp")
    if pps or eps:
        notes.append("a pipeline or expert layout that cannot be recommended is not listed: none of its settings "
                     "within 1% of the best fitting step time found before it fits (bounded by its compute, its "
                     "resident memory, then its step times and peaks)")
    return notes


def _context_parallel_rows(search: _Search, req: PlanRequest) -> tuple[list[Row], int, list[str]]:
    """When nothing fits on the full cluster: the same search with the sequence split over cp
    ranks (torch FSDP2/HSDP with context_parallel), for every TP degree the wiring allows."""
    arch = search.model.architecture
    tps = sorted({tp for tp, _, pp, ep in _layouts(req, req.gpus, arch, search.topo)[0] if pp * ep == 1})
    layouts, notes = [], []
    for tp in tps:
        degrees, rejected = cp_degrees(req.seq_len, req.gpus * req.nodes, tp, arch)
        layouts += [(tp, cp, 1, 1) for cp in degrees]
        notes += [str(r) for r in rejected]
    rows, evaluated = _evaluate(search, req, layouts,
                                strategies=tuple(n for n in STRATEGIES if lookup_strategy(n).framework == "torch"
                                                 and not lookup_strategy(n).shard_within_node))
    return rows, evaluated, notes


def _setting(combo: Combo, mb: int) -> str:
    """The rejected setting in words, so it is not mistaken for the strategy's other settings."""
    shard = f" (shard groups of {combo.shard})" if combo.shard else ""
    degrees = "".join(f" x {k} {getattr(combo, k)}" for k in ("tp", "cp", "pp", "ep") if getattr(combo, k, 1) > 1)
    return (f"{combo.strategy}{shard}{degrees} at micro-batch {mb}, checkpointing {combo.checkpointing}, "
            f"offload {combo.offload_optimizer}/{combo.offload_params}")


def _peak_items(e: EstimateResult, count: int = 3) -> str:
    """The peak phase's largest items, as the estimate names them."""
    phase = next((p for p in e.phases if p.name == e.per_device.peak_phase), None)
    if phase is None:
        return ""
    largest = sorted(phase.items, key=lambda i: -i.bytes)[:count]
    return ", ".join(f"{i.name} {i.bytes / GB:.1f} GB" for i in largest)


def _reason(combo: Combo, mb: int, peak: float, usable: float, capacity: int, headroom: float,
            e: EstimateResult) -> str:
    d = e.per_device
    s = lookup_strategy(combo.strategy)
    # what the strategy leaves whole on every rank; LoRA's frozen base is most of it, its adapters
    # and their gradients a rounding error (named only where they show at one decimal)
    held = (("frozen base", d.frozen_weights_bytes, s.shards_parameters),
            ("params", d.parameters_bytes, s.shards_parameters), ("grads", d.gradients_bytes, s.shards_gradients))
    unsharded = [f"{num / GB:.1f} GB of {name}" for name, num, sharded in held if not sharded and num >= GB // 20]
    what = (("optimizer states are sharded but " if s.shards_optimizer else "nothing is sharded: ")
            + " and ".join(unsharded) + " are not; ") if unsharded else ""
    return (f"{_setting(combo, mb)}: {peak / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable of {capacity / GIB:.1f} GiB "
            f"on each GPU ({headroom:.0%} kept free): {what}the peak is at {d.peak_phase}, largest "
            f"{_peak_items(e)}")


# at most this many candidates are replayed through the allocator simulator per plan (each takes
# 0.05-0.3 s of Python): the search itself stays on the live peak (bench/plan_speed.py)
RESERVED_REPLAYS = 8


def _reserved_reason(combo: Combo, mb: int, e: EstimateResult, capacity: int) -> str:
    d = e.per_device
    return (f"{_setting(combo, mb)}: reserved peak {d.reserved_peak_bytes / GIB:.1f} GiB (simulated caching "
            f"allocator {d.reserved_peak_bytes - d.cuda_context_bytes - d.nccl_bytes:,} B, CUDA context, NCCL "
            f"{d.nccl_bytes / GIB:.2f} GiB) > {capacity / GIB:.1f} GiB on each GPU for a live peak of "
            f"{d.peak_bytes / GIB:.1f} GiB")


def _host_reason(combo: Combo, mb: int, e: EstimateResult, host: tuple[int, str] | None) -> str:
    capacity, source = host if host else (0, "unknown")
    return (f"{_setting(combo, mb)}: offload holds {e.host.peak_bytes / GIB:,.1f} GiB of host RAM per node "
            f"(the sum over its {combo.gpus} ranks) > {capacity / GIB:,.1f} GiB on the node ({source})")


def _candidate(combo: Combo, mb: int, per_rank: int, fits: bool, t: timing.StepTime, e: EstimateResult,
               reason: str | None) -> Candidate:
    return Candidate(strategy=combo.strategy, micro_batch=mb, gradient_accumulation=per_rank // mb,
                     checkpointing=combo.checkpointing, offload_optimizer=combo.offload_optimizer,
                     offload_params=combo.offload_params,
                     hsdp_shard_size=combo.shard * combo.tp if combo.shard else None, parallel=e.parallel,
                     **_split_fields(getattr(combo, "split", None)), **_schedule_fields(combo), fits=fits,
                     per_device=e.per_device,
                     step_seconds=t.step_seconds, compute_seconds=t.compute_seconds,
                     communication_seconds=t.communication_seconds,
                     exposed_communication_seconds=t.exposed_communication_seconds,
                     offload_seconds=t.offload_seconds, tokens_per_second=t.tokens_per_second, mfu=t.mfu,
                     rejected_reason=reason, host=e.host if e.host.peak_bytes else None)


# Options whose step times (or, for --objective cost, GPU-seconds per token) are closer than this
# are a tie, and the one that leaves more memory free wins. The time model resolves no finer: its
# compute and link efficiencies are fitted constants (`planner calibrate` reports the residuals per
# run), and a prediction 1% faster at 99% of the memory is a promise it cannot keep, while the
# headroom is what absorbs allocator fragmentation and a longer batch.
TIE_TOLERANCE = 0.01
# Peaks closer than this fraction of the device are a tie in turn, broken by less communication
# (the time model's least certain term): the memory model is no finer, 31 of 31 verified runs
# within 3% (README, accuracy table).
MEMORY_TIE_FRACTION = 0.03


def _objective(req: PlanRequest, combo: Combo, peak: float, t: timing.StepTime) -> float:
    """What the objective minimizes: step seconds, GPU-seconds per token, or peak bytes."""
    if req.objective == "memory":
        return peak
    if req.objective == "cost":
        return combo.gpus * req.nodes / t.tokens_per_second
    return t.step_seconds


def _runs(items: list, key, width) -> list[list]:
    """Items sorted by key, cut into runs whose keys lie within `width(first key)` of the run's first."""
    rest, runs = sorted(items, key=key), []
    while rest:
        limit = key(rest[0]) + width(key(rest[0]))
        runs.append([x for x in rest if key(x) <= limit])
        rest = [x for x in rest if key(x) > limit]
    return runs


def _tie_order(req: PlanRequest, capacity: float, items: list, value, peak, traffic) -> list:
    """Items best first: by the objective, where values within TIE_TOLERANCE are a tie ordered by
    peak (more headroom first), and peaks within MEMORY_TIE_FRACTION of the device a tie ordered by
    communication, then the objective."""
    if req.objective == "memory":
        return sorted(items, key=lambda x: (peak(x), value(x), traffic(x)))
    ordered = []
    for same_time in _runs(items, value, lambda v: v * TIE_TOLERANCE):
        for same_memory in _runs(same_time, peak, lambda _: capacity * MEMORY_TIE_FRACTION):
            ordered += sorted(same_memory, key=lambda x: (traffic(x), value(x), peak(x)))
    return ordered


def _label(c: Candidate | Setting) -> str:
    shard = c.hsdp_shard_size if isinstance(c, Candidate) else c.shard
    source = c.parallel if isinstance(c, Candidate) else c
    degrees = "".join(f"+{k}{getattr(source, k)}" for k in ("tp", "cp", "pp", "ep") if getattr(source, k) > 1)
    return (f"{c.strategy}/{shard}" if shard else c.strategy) + degrees


def _why_recommended(req: PlanRequest, best: Candidate, fitting: list[Candidate], capacity: float) -> str:
    """Why the recommendation won: by the objective, or how it won a tie."""
    if req.objective == "memory":
        return f"recommended {_label(best)}: the lowest peak of every fitting option"
    value = (lambda c: c.step_seconds) if req.objective == "time" else (lambda c: req.gpus * req.nodes / c.tokens_per_second)
    what = "step time" if req.objective == "time" else "GPU-seconds per token"
    fastest = min(value(c) for c in fitting)
    tied = [c for c in fitting if c is not best and value(c) <= fastest * (1 + TIE_TOLERANCE)]
    if not tied:
        return f"recommended {_label(best)}: the best {what} of every fitting option"
    group = tied + [best]
    peak = lambda c: c.per_device.peak_bytes  # noqa: E731
    lowest, fullest = min(group, key=peak), max(group, key=peak)
    text = (f"recommended {_label(best)}: {len(tied)} other option(s) are within {TIE_TOLERANCE:.0%} of the best "
            f"{what} (the time model's uncertainty), peaks {peak(lowest) / GIB:.1f} to {peak(fullest) / GIB:.1f} GiB "
            f"({_label(fullest)} the fullest); ")
    same_memory = [c for c in group if peak(c) <= peak(lowest) + capacity * MEMORY_TIE_FRACTION]
    if len(same_memory) == 1:
        return text + f"it leaves the most memory free ({peak(best) / GIB:.1f} GiB peak)"
    return text + (f"{len(same_memory)} of them peak within {MEMORY_TIE_FRACTION:.0%} of the device of the lowest "
                   f"(the memory model's accuracy), and of those it communicates least "
                   f"({best.communication_seconds:.3f} s per step, {peak(best) / GIB:.1f} GiB peak)")


def _family(c: Candidate) -> str:
    p = c.parallel
    return layout_family(p.tp, p.cp, p.pp, p.ep)


def _schedule_label(c: Candidate) -> str:
    v = c.pp_virtual_stages or 1
    return f"{c.pp_schedule}" + (f" x {v} stages per rank" if v > 1 else "")


def _families(candidates: list[Candidate]) -> list[Candidate]:
    """The first (best ranked) candidate of each layout family, in rank order."""
    seen: dict[str, Candidate] = {}
    for c in candidates:
        seen.setdefault(_family(c), c)
    return list(seen.values())


def _against(req: PlanRequest, best: Candidate, other: Candidate, usable: float) -> str:
    """Why ``other``, the best of its family, lost to ``best``, in its numbers."""
    schedule = f", {_schedule_label(other)}" if other.parallel.pp > 1 else ""
    name = (f"{_family(other)} (best: {_label(other)}{schedule}, micro-batch {other.micro_batch} x "
            f"{other.gradient_accumulation})")
    if not other.fits:
        return f"{name} does not fit: {other.per_device.peak_bytes / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable"
    if req.objective == "memory":
        return f"{name} peaks at {other.per_device.peak_bytes / GIB:.1f} GiB"
    slower = other.step_seconds / best.step_seconds - 1
    if abs(slower) <= TIE_TOLERANCE:
        return (f"{name} ties on time ({other.step_seconds:.3f} s per step) at {other.per_device.peak_bytes / GIB:.1f} "
                f"GiB peak")
    parts = [f"compute {other.compute_seconds:.3f} s (with its pipeline bubble)" if other.parallel.pp > 1
             else f"compute {other.compute_seconds:.3f} s",
             f"exposed communication {other.exposed_communication_seconds:.3f} s"]
    if other.offload_seconds:
        parts.append(f"offload {other.offload_seconds:.3f} s")
    return f"{name} is {slower:.0%} slower, {other.step_seconds:.3f} s per step: {', '.join(parts)}"


def _winner_reason(req: PlanRequest, best: Candidate | None, families: list[Candidate], fitting: list[Candidate],
                   capacity: float, usable: float) -> str:
    """Why the recommendation won: the tie it won (or the objective), then each other family's
    best against it (PlanResult.winner_reason)."""
    if best is None:
        return "nothing fits: " + "; ".join(f"{_family(c)} closest at {c.per_device.peak_bytes / GIB:.1f} GiB"
                                            for c in families)
    head = (f"{_why_recommended(req, best, fitting, capacity)}; its step: compute {best.compute_seconds:.3f} s, "
            f"exposed communication {best.exposed_communication_seconds:.3f} s, offload {best.offload_seconds:.3f} s, "
            f"peak {best.per_device.peak_bytes / GIB:.1f} GiB")
    others = [_against(req, best, c, usable) for c in families if _family(c) != _family(best)]
    return head + ("; against the best of each other layout family: " + "; ".join(others) if others else "")


def _fewer_nodes_advice(req: PlanRequest, best: Candidate, fewer: list[tuple[int, list]], fabric_name: str,
                        nics: int) -> tuple[int | None, str | None]:
    """The node count whose best fitting option beats the recommendation on all nodes by more than
    the time model's uncertainty (by step time, or GPU-seconds per token for --objective cost)."""
    def value(nodes: int, t) -> float:
        return req.gpus * nodes / t.tokens_per_second if req.objective == "cost" else t.step_seconds

    here = value(req.nodes, best)
    winner = None
    for k, rows in fewer:
        fitting = [r for r in rows if r[3]]
        if fitting:
            row = min(fitting, key=lambda r: (value(k, r[4]), r[2]))
            if value(k, row[4]) < here * (1 - TIE_TOLERANCE) and (winner is None or value(k, row[4]) < winner[2]):
                winner = (k, row, value(k, row[4]))
    if winner is None:
        return None, None
    k, (combo, mb, peak, _, t), v = winner
    what = "s per step" if req.objective == "time" else "GPU-s per token"
    return k, (f"fewer nodes do better: on {k} node(s) {_label(combo)} (micro-batch {mb}, checkpointing "
               f"{combo.checkpointing}, offload {combo.offload_optimizer}/{combo.offload_params}) takes {v:.4g} {what} "
               f"against {here:.4g} on {req.nodes} with the best option here: {fabric_name} x {nics} NIC(s) per node "
               f"cannot carry what spanning the extra nodes sends (plan with --nodes {k}, or a faster fabric)")


def _fabric_note(req: PlanRequest, fabric_name: str, nics: int) -> str:
    f = timing.fabric(fabric_name)
    node = nics * f["gbps"] * f["efficiency"] * req.link_efficiency
    return (f"across nodes: {fabric_name} x {nics} NIC(s) per node, {node:.2f} GB/s achieved per node "
            f"({node / req.gpus:.2f} GB/s per GPU); a collective whose group spans nodes runs at that rate: "
            "all-gather and reduce-scatter as NCCL's flat ring, all-reduce the faster of its ring and tree")


def _rank(search: _Search, req: PlanRequest, rows: list[Row], fewer: list[tuple[int, list[Row]]], capacity: int,
          fabric_name: str, evaluated: int, started: float) -> PlanResult:
    g, topo, nics, usable, model_fields = search.g, search.topo, search.nics, search.usable, search.model_fields
    fabric = timing.fabric(fabric_name)
    by_combo: dict[Setting, list[Row]] = {}
    for row in rows:
        by_combo.setdefault(row[0], []).append(row)
    best: dict[Setting, Row] = {}
    ordered: dict[Setting, list[Row]] = {}
    for combo, options in by_combo.items():
        fitting = [r for r in options if r[3]]
        # a fitting setting by the objective (ties to headroom); one that fits nowhere at its smallest peak
        ordered[combo] = _tie_order(req, capacity, fitting, lambda r: _objective(req, r[0], r[2], r[4]),
                                    lambda r: r[2], lambda r: r[4].communication_seconds) if fitting else []
        best[combo] = ordered[combo][0] if fitting else min(options, key=lambda r: r[2])
    ranked = _tie_order(req, capacity, [c for c in best if best[c][3]], lambda c: _objective(req, c, best[c][2], best[c][4]),
                        lambda c: best[c][2], lambda c: best[c][4].communication_seconds)
    ranked += sorted((c for c in best if not best[c][3]), key=lambda c: best[c][2])
    candidates, replayed, rows_of, fell_back = [], 0, {}, False
    for combo in ranked:
        _, mb, peak, fits, t = best[combo]
        per_rank = _per_rank(req, combo)
        # a later micro-batch's memory is the same for any number of them (planner/frameworks/: the
        # phases of micro-batch 2+), so the estimate the grid made with two stands for the candidate's
        e = search.estimate(req, combo, mb, accumulation=min(per_rank // mb, 2))
        reason = None if fits else (_reason(combo, mb, peak, usable, capacity, req.headroom, e) if peak > usable
                                    else _host_reason(combo, mb, e, host_capacity(req, g)))
        if fits and replayed is not None and replayed < RESERVED_REPLAYS and not g.is_cpu:
            # the shortlist: fitting candidates in rank order are replayed through the caching
            # allocator until one fits on reserved memory (the recommendation); a setting whose best
            # micro-batch reserves too much tries its next fitting options of a smaller live peak
            first = None
            for _, option_mb, option_peak, _, option_t in ordered[combo]:
                if replayed >= RESERVED_REPLAYS or (first is not None and option_peak >= peak):
                    continue
                shown = search.shown(req, combo, option_mb, accumulation=min(per_rank // option_mb, 2))
                replayed += 1
                if shown.fits:
                    e, mb, peak, t = shown, option_mb, option_peak, option_t
                    # a smaller micro-batch than the rank was made with: the next settings are
                    # replayed too, and the fitting ones ordered again below
                    fell_back = fell_back or first is not None
                    replayed = replayed if first is not None else None
                    break
                first = first or shown
            else:
                e = first or e
                if e.host.fits is not False:  # the live peak fits; what it reserves does not
                    fits, reason = False, _reserved_reason(combo, mb, e, capacity)
        elif fits and e.per_device.reserved_peak_bytes > capacity and not g.is_cpu:
            # not replayed: its live peak with NCCL's buffers, a lower bound of reserved, is too much
            fits, reason = False, _reserved_reason(combo, mb, e, capacity)
        candidates.append(_candidate(combo, mb, per_rank, fits, t, e, reason))
        rows_of[id(candidates[-1])] = (combo, peak, t)
    if fell_back:  # the replayed settings' micro-batches changed: rank the fitting ones again
        fits_now = [c for c in candidates if c.fits]
        candidates = _tie_order(req, capacity, fits_now, lambda c: _objective(req, *rows_of[id(c)]),
                                lambda c: rows_of[id(c)][1], lambda c: rows_of[id(c)][2].communication_seconds) \
            + [c for c in candidates if not c.fits]
    fitting = [c for c in candidates if c.fits]
    recommended = fitting[0] if fitting else None
    max_micro = _max_micro(req, rows, search)
    min_gpus = {name: _min_gpus(req, name, usable, model_fields) for name in STRATEGIES
                if not lookup_strategy(name).one_device}
    # the inverse question per model-parallel layout the plan searched: FSDP2 with each TP degree
    for tp in sorted({c.parallel.tp for c in candidates} - {1}):
        min_gpus[f"fsdp+tp{tp}"] = _search(req, "fsdp", usable, model_fields, per_node=req.gpus, tp=tp)
    # and with each pipeline degree (stages of whole nodes) at the candidates' TP degrees
    for tp, pp in sorted({(c.parallel.tp, c.parallel.pp) for c in candidates if c.parallel.pp > 1}):
        label = f"fsdp+tp{tp}+pp{pp}" if tp > 1 else f"fsdp+pp{pp}"
        min_gpus[label] = _pipeline_min_gpus(req, usable, model_fields, tp, pp)
    ring, ring_bw, _ = timing.node_ring(topo, req.gpus)
    inter = nics * fabric["gbps"] * fabric["efficiency"] / req.gpus if req.nodes > 1 else None
    notes = [f"{evaluated:,} candidates evaluated in {wallclock.perf_counter() - started:.3f} s",
             (f"ring over GPUs {list(ring)}: slowest link {ring_bw:.1f} GB/s ({topo.source})"
              if math.isfinite(ring_bw) else f"one GPU per node: no ring ({topo.source})"),
             _compute_note(req, g, search.compute_scale)]
    notes += [f"time model: {caveat}" for caveat in g.time_model_caveats]
    notes.append(f"memory: the search judges settings on the live peak with {req.headroom:.0%} kept free; the "
                 "fitting candidates are then replayed in rank order through torch 2.13's caching allocator "
                 f"(simulated, planner/memory/reserved.py; at most {RESERVED_REPLAYS}) until one's reserved peak with the "
                 "CUDA context and NCCL's buffers fits the device: that one is recommended; the others' "
                 "reserved_peak_bytes are their live peak + NCCL, not replayed "
                 f"(PYTORCH_CUDA_ALLOC_CONF {req.alloc_conf or 'unset'})")
    if req.nodes > 1:
        notes.append(_fabric_note(req, fabric_name, nics))
    faster_on = None
    if recommended is not None:
        notes.append(_why_recommended(req, recommended, fitting, capacity))
        faster_on, note = _fewer_nodes_advice(req, recommended, fewer, fabric_name, nics)
        if note:
            notes.append(note)
    if recommended is None:
        notes.append("nothing fits: see each candidate's rejected_reason, and min_gpus for the GPU count that would")
    positions = search.model.architecture.learned_positions if search.model.architecture is not None else 0
    too_long = sequence_past_positions(search.model.name, positions, req.seq_len)
    if too_long:  # every candidate's run would fail (verify refuses it)
        notes.insert(0, f"WARNING: {too_long}; no layout can run it: give --seq-len {positions} or less")
    families = _families(candidates)
    return PlanResult(recommended=recommended, candidates=candidates, candidates_evaluated=evaluated,
                      families=families, winner_reason=_winner_reason(req, recommended, families, fitting, capacity,
                                                                      usable),
                      min_gpus=min_gpus, max_micro_batch=max_micro, faster_on_fewer_nodes=faster_on,
                      max_seq_len=(_longest_sequence(req, recommended, usable, model_fields, positions,
                                                     on_reserved=not g.is_cpu)
                                   if recommended else None),
                      topology=TopologySummary(source=topo.source, gpu_type=topo.gpu_type, gpus_per_node=req.gpus,
                                               nodes=req.nodes, nvlink_groups=topo.nvlink_groups, ring=list(ring),
                                               ring_bandwidth_gbps=ring_bw if math.isfinite(ring_bw) else None,
                                               inter_node_gbps_per_gpu=inter),
                      notes=notes, request=req)


# the replays (planner/memory/reserved.py, a few tenths of a second each for an 8B model) an inverse
# answer may spend checking the live peak's answer on reserved memory
INVERSE_REPLAYS = 3


def _max_micro(req: PlanRequest, rows: list[Row], search: "_Search | None" = None) -> dict[str, int | None]:
    """The largest micro-batch that fits on the full cluster, per strategy (any checkpointing/offload),
    with data parallelism alone: judged on the live peak with the request's headroom, then on a GPU on
    reserved memory (the caching allocator replayed at the device's capacity, as the recommendation
    is): the largest live answers are replayed, each micro-batch's setting of the smallest live peak,
    until one fits (at most INVERSE_REPLAYS; none fitting among them: None)."""
    live: dict[str, dict[int, Row]] = {}
    for row in rows:
        combo, mb, peak, fits, _ = row
        options = live.setdefault(combo.strategy, {})
        if fits and combo.model_parallel == 1 and (mb not in options or peak < options[mb][2]):
            options[mb] = row
    out: dict[str, int | None] = {}
    for strategy, options in live.items():
        ordered = sorted(options, reverse=True)
        if search is None or search.g.is_cpu:
            out[strategy] = ordered[0] if ordered else None
            continue
        out[strategy] = next((mb for mb in ordered[:INVERSE_REPLAYS]
                              if search.shown(req, options[mb][0], mb, accumulation=min(_per_rank(req, options[mb][0]) // mb,
                                                                                        2)).fits), None)
    return out


MAX_SEARCH_GPUS = 1 << 16
MAX_SEQ_LEN = 1 << 22  # PlanRequest.seq_len's bound (schema.py)


def _longest_sequence(req: PlanRequest, c: Candidate, usable: float, model_fields: dict,
                      learned_positions: int = 0, on_reserved: bool = False) -> int | None:
    """The inverse question for sequence length: the longest sequence (a multiple of 2*cp, as
    load-balanced CP needs, and of 128) that the recommended layout trains at micro-batch 1 with
    full checkpointing (a pipeline: its rank's share of the batch as micro-batches of 1, in the
    request's schedule). Per-device memory grows with the sequence, so doubling then bisection on
    the live peak with the headroom; then, ``on_reserved`` (a GPU), the answer is replayed through
    the caching allocator and, while it does not fit the device, shortened by what reserved adds
    over the live peak (at most INVERSE_REPLAYS), then by bisection on reserved memory."""
    unit = 128 * 2 * c.parallel.cp
    degrees = {k: v for k, v in c.parallel.model_dump().items() if k in ("tp", "cp", "pp", "ep") and v > 1}
    if c.parallel.pp > 1:
        # the candidate's own count of micro-batches: its schedule accepts it (interleaved 1F1B
        # refuses counts that are not a multiple of count // pp, as micro x accumulation can be)
        degrees |= {"gradient_accumulation": c.gradient_accumulation,
                    "pp_schedule": c.pp_schedule or req.pp_schedule,
                    "pp_virtual_stages": c.pp_virtual_stages or req.pp_virtual_stages}
        degrees |= {k: v for k, v in (("pp_first_stage_layers", c.pp_first_stage_layers),
                                      ("pp_last_stage_layers", c.pp_last_stage_layers)) if v is not None}
    elif c.micro_batch * c.gradient_accumulation > 1:  # micro-batches of 1 accumulate (frameworks/)
        degrees |= {"gradient_accumulation": 2}

    # a learned position table (GPT-2's n_positions) bounds the sequence whatever the memory
    longest = min(MAX_SEQ_LEN, learned_positions or MAX_SEQ_LEN)

    def at(seq: int, simulate: bool = False) -> EstimateResult:
        return estimate(EstimateRequest(**model_fields, strategy=c.strategy, gpus=req.gpus, nodes=req.nodes,
                                        gpu=req.gpu, precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                        optimizer_in_backward=req.optimizer_in_backward,
                                        seq_len=seq, checkpointing="full", attention=req.attention,
                                        offload_optimizer=c.offload_optimizer, offload_params=c.offload_params,
                                        hsdp_shard_size=explicit_hsdp_shard(c.strategy, c.hsdp_shard_size, req.gpus),
                                        alloc_conf=req.alloc_conf, nccl_buffsize_bytes=req.nccl_buffsize_bytes,
                                        **_reduce_field(req, c.strategy), **_version_field(req, c.strategy),
                                        **degrees), simulate=simulate)

    def largest(limit: float, high: int, low: int = 0) -> int:
        """The largest multiple of unit below high * unit whose live peak is within limit (0: none),
        low * unit known to be within it."""
        while low + 1 < high:
            mid = (low + high) // 2
            if at(mid * unit).per_device.peak_bytes <= limit:
                low = mid
            else:
                high = mid
        return low

    low = 0
    high = max(1, req.seq_len // unit)
    while high * unit <= longest and at(high * unit).per_device.peak_bytes <= usable:
        low, high = high, high * 2
    low = largest(usable, min(high, longest // unit + 1), low)
    if not (on_reserved and low):
        return low * unit if low else None
    fitting, too_long = 0, low + 1  # the live answer's next unit does not fit even live
    for _ in range(INVERSE_REPLAYS):
        e = at(low * unit, simulate=True)
        if e.fits:
            fitting = low
            break
        too_long = low
        # what the allocator and the terms outside it add over the live peak, taken as the same at the
        # next shorter sequence (it grows with it: the next replay checks)
        gap = e.per_device.reserved_peak_bytes - e.per_device.peak_bytes
        low = largest(e.device_capacity_bytes - gap, low)
        if not low:
            break
    # the gap is an over-estimate below the sequence it was measured at (and a replay that does not
    # fit reports its uncapped reserve): bisection on reserved memory between the longest known to
    # fit (none: 0) and the shortest known not to, so the answer is the longest, not only one that fits
    low, high = fitting, too_long
    while low + 1 < high:
        mid = (low + high) // 2
        if at(mid * unit, simulate=True).fits:
            low = mid
        else:
            high = mid
    return low * unit if low else None


def finetune_fields(req: PlanRequest) -> dict:
    """The plan's fine-tuning as estimate fields (nothing for full fine-tuning)."""
    if req.finetune == "full":
        return {}
    given = {"lora_rank": req.lora_rank, "lora_alpha": req.lora_alpha, "lora_targets": req.lora_targets,
             "lora_dropout": req.lora_dropout, "train_embeddings": req.train_embeddings or None,
             # the quantized base is QLoRA's (finetune auto plans LoRA beside it, on a 16-bit base)
             "quantize_base": req.quantize_base if req.finetune == "qlora" else None,
             "double_quant": req.double_quant if req.finetune == "qlora" else None}
    return {"finetune": req.finetune} | {k: v for k, v in given.items() if v is not None}


def with_finetune(result: PlanResult, method: str) -> PlanResult:
    update = {"finetune": method}
    return result.model_copy(update={
        "candidates": [c.model_copy(update=update) for c in result.candidates],
        "recommended": result.recommended.model_copy(update=update) if result.recommended else None})


def _min_gpus(req: PlanRequest, name: str, usable: float, model_fields: dict) -> int | None:
    """The smallest total GPU count (GPUs per node as given, growing the node count, or fewer GPUs
    on one node) on which the strategy trains at micro-batch 1 with full checkpointing, in any
    setting the plan itself tries: every offload it tries for the strategy, and for HSDP every
    shard-group size (so HSDP in groups of 2 on one node counts, as the plan recommends it).
    Per-device memory never grows with more GPUs (tests/test_properties.py), so a doubling search
    then a bisection finds it."""
    return _search(req, name, usable, model_fields, per_node=req.gpus)


def _fits(req: PlanRequest, name: str, usable: float, model_fields: dict, gpus: int, nodes: int, tp: int = 1) -> bool:
    """Whether any of the plan's settings of the strategy fits this layout at micro-batch 1."""
    if gpus % tp:
        return False
    shards = _hsdp_shards(gpus, nodes)[::-1] if lookup_strategy(name).shard_within_node else [None]
    degrees = {"tp": tp} if tp > 1 else {}
    for shard in shards:
        for off_opt, off_par in (reversed(_offloads(name)) if tp == 1 else [("none", "none")]):  # most offloaded first
            try:
                # micro-batch 1 accumulates when the rank's share of the global batch is more
                e = estimate(EstimateRequest(**model_fields, strategy=name, gpus=gpus, nodes=nodes, gpu=req.gpu,
                                             precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                             optimizer_in_backward=req.optimizer_in_backward,
                                             gradient_accumulation=2 if req.global_batch * tp > gpus * nodes else 1,
                                             seq_len=req.seq_len, checkpointing="full", attention=req.attention,
                                             offload_optimizer=off_opt, offload_params=off_par,
                                             hsdp_shard_size=explicit_hsdp_shard(name, shard, gpus),
                                             **_reduce_field(req, name), **_version_field(req, name),
                                             **degrees), simulate=False)
            except PlannerError as refused:  # refused for this fine-tuning, optimizer or recipe (see _evaluate_setting)
                if req.finetune == "full" and refused.field not in OPTIMIZER_FIELDS and not refused_by_recipe(refused):
                    raise
                continue
            if e.per_device.peak_bytes <= usable:
                return True
    return False


def _search(req, name, usable, model_fields, per_node: int, tp: int = 1) -> int | None:
    # bound: per-device memory never grows with more GPUs, so what does not fit on the most nodes
    # searched fits on none (one estimate instead of the whole doubling)
    if _replicated_weights_exceed(req, name, usable, model_fields, tp):
        return None
    most = 1 << ((MAX_SEARCH_GPUS // per_node).bit_length() - 1)  # the doubling's last node count
    if most >= 2 and not _fits(req, name, usable, model_fields, per_node, most, tp):
        return None
    # and what does not fit on a whole node fits on none of its fewer GPUs
    if _fits(req, name, usable, model_fields, per_node, 1, tp):
        for gpus in range(tp, per_node + 1, tp):
            if _fits(req, name, usable, model_fields, gpus, 1, tp):
                return gpus
    nodes = 2
    while nodes * per_node <= MAX_SEARCH_GPUS:
        if _fits(req, name, usable, model_fields, per_node, nodes, tp):
            low = max(2, nodes // 2)
            while low < nodes:
                mid = (low + nodes) // 2
                if _fits(req, name, usable, model_fields, per_node, mid, tp):
                    nodes = mid
                else:
                    low = mid + 1
            return nodes * per_node
        nodes *= 2
    return None


def _replicated_weights_exceed(req: PlanRequest, name: str, usable: float, model_fields: dict, tp: int) -> bool:
    """Bound: a strategy that keeps the whole weights on every data-parallel rank (DDP, ZeRO 0-2)
    holds the same weights on any number of GPUs, and never offloads them; when they alone (with
    the framework's overhead) exceed the usable memory it fits on none (one small estimate)."""
    if lookup_strategy(name).shards_parameters:
        return False
    try:
        e = estimate(EstimateRequest(**model_fields, strategy=name, gpus=tp, nodes=1, gpu=req.gpu,
                                     precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                     optimizer_in_backward=req.optimizer_in_backward,
                                     seq_len=req.seq_len, checkpointing="full", attention=req.attention,
                                     **_version_field(req, name), **({"tp": tp} if tp > 1 else {})), simulate=False)
    except PlannerError:
        return False
    return e.per_device.parameters_bytes + e.per_device.framework_bytes > usable


def _pipeline_min_gpus(req: PlanRequest, usable: float, model_fields: dict, tp: int, pp: int) -> int | None:
    """The inverse question for a pipeline layout: the smallest GPU count (GPUs per node as given,
    nodes a multiple of pp: stages of whole nodes) on which FSDP2 with these tp and pp degrees
    trains at micro-batch 1 with full checkpointing and pp micro-batches (the fewest 1F1B runs: the
    fewest in flight and receive buffers), in the request's schedule. More nodes shard each stage's
    states over more data-parallel ranks and hold the same activations, so the bound and the search
    of _search apply to the stage groups."""
    def fits(groups: int) -> bool:
        try:
            e = estimate(EstimateRequest(**model_fields, strategy="fsdp", gpus=req.gpus, nodes=groups * pp,
                                         gpu=req.gpu, precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                         optimizer_in_backward=req.optimizer_in_backward,
                                         gradient_accumulation=pp, seq_len=req.seq_len, checkpointing="full",
                                         attention=req.attention, tp=tp, pp=pp, pp_schedule=req.pp_schedule,
                                         pp_virtual_stages=req.pp_virtual_stages, **_split_fields(split),
                                         **_reduce_field(req, "fsdp"), **_version_field(req, "fsdp")),
                         simulate=False)
        except PlannerError:
            return False
        return e.per_device.peak_bytes <= usable

    if req.gpus * pp > MAX_SEARCH_GPUS:
        return None
    split = _split(req, _architecture(req), pp, req.pp_virtual_stages)
    most = 1 << ((MAX_SEARCH_GPUS // (req.gpus * pp)).bit_length() - 1)  # the doubling's last group count
    if not fits(most):
        return None
    groups = 1
    while not fits(groups):
        groups *= 2
    low = groups // 2 + 1
    while low < groups:
        mid = (low + groups) // 2
        if fits(mid):
            groups = mid
        else:
            low = mid + 1
    return groups * pp * req.gpus
