"""What the plan searches, one setting at a time: the Setting (the time model's Combo with the
pipeline and expert degrees), the estimate request that measures it, the pipeline schedules and
splits each degree is planned with, and the micro-batch options a setting can take.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from operator import attrgetter

import numpy as np

from planner.errors import PlannerError
from planner.frameworks import Framework, framework_of, version_field, version_for
from planner.recipes.compile import accumulates
from planner.recipes.precision import Recipe
from planner.model.catalogue import as_loaded, catalogue_model, model_from_config
from planner.parallel.pipeline import balanced_split, check_schedule, check_split, check_split_backward, stage_bounds
from planner.schema import (MAX_BATCH_FIELD, MAX_GLOBAL_BATCH, MAX_TOKENS, SHARDING_STRATEGIES, EstimateRequest,
                            PlanRequest, batch_error)
from planner.strategies import Strategy, explicit_hsdp_shard, strategy as lookup_strategy
from planner.time import collectives as timing
from planner.time.step import Combo, frozen_base_shape


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

    def __hash__(self) -> int:
        """The hash dataclass would generate (of the fields' tuple, in their order), computed once per
        setting: a setting keys the search's memos (its estimates, peaks, requests, Setups), thousands
        of lookups per plan, and hashing sixteen fields each time was a few per cent of a plan's time.
        Kept out of the pickled state (a string's hash differs between processes)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(_SETTING_FIELDS(self))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}


# a Setting's fields as dataclass hashes them: every field compares, none sets its own hash
_SETTING_FIELDS = attrgetter(*(f.name for f in fields(Setting) if (f.compare if f.hash is None else f.hash)))

Row = tuple[Setting, int, float, bool, timing.StepTime]  # (setting, micro-batch, peak bytes, fits, step time)


def hsdp_shards(gpus: int, nodes: int) -> list[int]:
    """HSDP shard group sizes worth planning: every divisor of a node's GPUs from 2 up (groups of
    consecutive ranks, as DeviceMesh builds them), the whole node only when there are 2+ nodes."""
    return [d for d in range(2, gpus + 1) if gpus % d == 0 and (d < gpus or nodes > 1)]


def plan_framework(s: Strategy, req: PlanRequest) -> Framework:
    """The framework version a plan's candidate of strategy ``s`` runs on: the plan's
    ``framework_version`` where that is its framework's (planner/frameworks/base.py version_for),
    else its framework's default."""
    return framework_of(s, version_for(s, req.framework_version))


def offload_options(name: str, req: PlanRequest) -> list[tuple[str, str]]:
    """The offload settings strategy ``name`` takes in the plan's framework version."""
    s = lookup_strategy(name)
    return plan_framework(s, req).offload_options(s)


def estimate_request(req: PlanRequest, combo: Setting, micro: int, model_fields: dict,
             accumulation: int | None = None) -> EstimateRequest:
    # without pp, accumulation > 1: a micro-batch after the first holds the earlier ones' gradients
    # (planner/frameworks/), the same memory for any number of them; a pipeline's is _degree_fields'
    steps = {"gradient_accumulation": accumulation} if combo.pp == 1 and accumulation and accumulation > 1 else {}
    degrees = _degree_fields(req, combo, micro, accumulation)
    stated = (steps | degrees).get("gradient_accumulation")
    batch = {"micro_batch": micro} | ({} if stated is None else {"gradient_accumulation": stated})
    # the search asks for each setting at several micro-batches: the request of one is the setting's
    # first with its batch fields replaced, where the batch passes what validation checks of them
    key = (id(req), id(model_fields), combo, len(batch))
    hit = _REQUESTS.get(key)
    if hit is not None and hit[0] is req and hit[1] is model_fields and _batch_valid(hit[2], batch):
        return hit[2].model_copy(update=batch)
    made = _estimate_request(req, combo, micro, model_fields, steps, degrees)
    if len(_REQUESTS) >= 4096:
        _REQUESTS.clear()
    _REQUESTS[key] = (req, model_fields, made)
    return made


# estimate_request's first request per (plan request, model fields, setting, batch fields), by identity
_REQUESTS: dict[tuple, tuple[PlanRequest, dict, EstimateRequest]] = {}


def _batch_valid(request: EstimateRequest, batch: dict) -> bool:
    """Whether EstimateRequest's validation passes ``request`` with its batch fields replaced by
    ``batch``: their bounds and the one check that reads them (schema.batch_error); what else it
    checks does not depend on them."""
    micro = batch["micro_batch"]
    accumulation = batch.get("gradient_accumulation", request.gradient_accumulation)
    return 1 <= micro <= MAX_BATCH_FIELD and 1 <= accumulation <= MAX_BATCH_FIELD \
        and batch_error(request, micro, accumulation) is None


def _estimate_request(req: PlanRequest, combo: Setting, micro: int, model_fields: dict, steps: dict,
                      degrees: dict) -> EstimateRequest:
    return (EstimateRequest(
        **model_fields, **steps, strategy=combo.strategy, gpus=combo.gpus, nodes=req.nodes, gpu=req.gpu,
        precision=req.precision, optimizer=req.optimizer, optimizer_in_backward=req.optimizer_in_backward,
        micro_batch=micro, seq_len=req.seq_len,
        checkpointing=combo.checkpointing, attention=req.attention,
        offload_optimizer=combo.offload_optimizer, offload_params=combo.offload_params,
        hsdp_shard_size=explicit_hsdp_shard(combo.strategy, combo.shard * combo.tp if combo.shard else None,
                                            combo.gpus),
        host_memory_gib=req.host_memory_gib, topology=req.topology, **reduce_field(req, combo.strategy),
        **version_field_of(req, combo.strategy),
        alloc_conf=req.alloc_conf, nccl_buffsize_bytes=req.nccl_buffsize_bytes, **degrees))


def reduce_field(req: PlanRequest, strategy: str) -> dict:
    """FSDP2's reduce dtype for the sharding candidates (none when it is the default, so that the
    request stays the one it always was); the other strategies have no such setting."""
    return {"reduce_dtype": req.reduce_dtype} if req.reduce_dtype != "compute" and strategy in SHARDING_STRATEGIES else {}


def version_field_of(req: PlanRequest, strategy: str) -> dict:
    """The plan's framework_version where it is the strategy's framework's (planner/frameworks/base.py)."""
    return version_field(lookup_strategy(strategy), req.framework_version)


def _degree_fields(req: PlanRequest, combo: Setting, micro: int, accumulation: int | None = None) -> dict:
    """The setting's model-parallel degrees as request fields (none when all are 1, so that a
    data-parallel estimate stays the request it always was). A pipeline's memory depends on its
    micro-batches in flight: its request carries the accumulation and the request's schedule."""
    fields = {k: v for k, v in (("tp", combo.tp), ("cp", combo.cp), ("pp", combo.pp), ("ep", combo.ep)) if v > 1}
    if combo.tp > 1 and req.tp_plan != "torchtitan":
        fields["tp_plan"] = req.tp_plan  # whose TP layout (the default stays out of the request)
    if combo.tp > 1 and req.async_tp and combo.sequence_parallel:
        fields["async_tp"] = True  # torch's sequence-parallel TP pipelines; DeepSpeed's AutoTP has none to pipeline
    s = lookup_strategy(combo.strategy)
    if req.defer_gradient_sync and combo.pp == 1 and framework_of(s).loop_no_sync and not s.one_device:
        fields["defer_gradient_sync"] = True  # the loop's no_sync: torch's wrappers; DeepSpeed accumulates itself
    if combo.pp > 1:
        fields |= {"gradient_accumulation": accumulation or per_rank_sequences(req, combo) // micro, "pp_schedule": combo.schedule,
                   "pp_virtual_stages": combo.virtual_stages} | split_fields(combo.split)
    return fields


def schedule_fields(combo: Combo) -> dict:
    """A pipeline candidate's schedule (none without pp)."""
    if combo.pp == 1 or not isinstance(combo, Setting):
        return {}
    return {"pp_schedule": combo.schedule, "pp_virtual_stages": combo.virtual_stages}


def split_fields(split: tuple[int, int] | None) -> dict:
    """A pipeline's uneven split as request fields (none for an even split)."""
    return {} if split is None else {"pp_first_stage_layers": split[0], "pp_last_stage_layers": split[1]}


def planned_split(req: PlanRequest, arch, pp: int, virtual_stages: int) -> tuple[int, int] | None:
    """The split a pipeline layout is planned with: the request's own, else where pp x virtual
    stages does not divide the blocks the best uneven one (planner/parallel/pipeline.py balanced_split)."""
    if pp == 1:
        return None
    if req.pp_first_stage_layers is not None or req.pp_last_stage_layers is not None:
        bounds = stage_bounds(arch.num_layers, pp * virtual_stages, req.pp_first_stage_layers,
                              req.pp_last_stage_layers)
        return bounds[0][1], bounds[-1][1] - bounds[-1][0]
    return balanced_split(arch, pp, virtual_stages, req.seq_len)


OPTIMIZER_FIELDS = ("optimizer", "optimizer_in_backward")  # the fields a refused optimizer composition names


# The pipeline schedules a plan searches where the request fixes none: torch 2.13's
# torch/distributed/pipelining/schedules.py schedules that can be recommended, the multi-stage ones at
# torchtitan's default of 2 stages per rank, each replayed action by action by
# planner/parallel/pipeline.py (the zero-bubble ones with their split backward). Two cannot win, so
# they are estimated only when asked: ScheduleLoopedBFS has Interleaved1F1B's bubble and stages and
# holds every micro-batch of every local stage before its first backward (max_in_flight m x v, at
# least interleaved's); ScheduleDualPipeV has ZBV's stages and idle time (simulated_bubble: p - 1
# units past 2p micro-batches, the fewest it takes) and one chunk more in flight.
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("gpipe", 1), ("interleaved-zb", 2), ("zbv", 2))


def schedules_of(req: PlanRequest, arch, pp: int) -> list[tuple[str, int, tuple[int, int] | None]]:
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
        try:  # a split backward on blocks whose held gradients are not modelled (MoE, MLA)
            check_split_backward(arch, schedule)
        except PlannerError:
            continue
        if given:
            try:  # the request's split, over this schedule's pp x v stages
                check_split(arch.num_layers, pp, v, req.pp_first_stage_layers, req.pp_last_stage_layers)
            except PlannerError:
                continue
        split = planned_split(req, arch, pp, v)
        if split is None and arch.num_layers % (pp * v):
            continue
        out.append((schedule, v, split))
    return out


def architecture_of(req: PlanRequest):
    model = catalogue_model(req.model) if req.model else model_from_config(req.model_config_)
    return as_loaded(model, req.text_only, req.include_vision).architecture


def frozen_base_of(request: EstimateRequest, arch, recipe: Recipe):
    """The LoRA / QLoRA step the time model takes for this request (None for full fine-tuning);
    ``recipe``: the plan's precision, decoded once."""
    if request.finetune == "full":
        return None
    try:
        return frozen_base_shape(request, arch, framework_of(lookup_strategy(request.strategy),
                                                             request.framework_version), recipe)
    except PlannerError:  # refused for this combo: its estimate says so and the combo is skipped
        return None


def per_rank_sequences(req: PlanRequest, combo: Setting) -> int:
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


def layout_family(tp: int, cp: int, pp: int, ep: int) -> str:
    """The layout family of a setting: which model-parallel degrees it uses beside data
    parallelism ("dp", "dp x tp", "dp x tp x pp", ...), whatever their values."""
    return " x ".join(["dp"] + [name for name, degree in (("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep))
                                if degree > 1])


def expert_shards(s, shard: int | None, dp: int, cp: int) -> int:
    """dp_shard x cp of a strategy's data-parallel part (planner/parallel/dims.py dims_for): the ranks
    expert parallelism borrows."""
    if shard is not None:
        return shard * cp
    return (dp if s.shards_optimizer else 1) * cp


def framework_runs(req: PlanRequest, s, tp: int, cp: int, pp: int, schedule: str = "1f1b") -> bool:
    """Which data-parallel realisations take a model-parallel layout: the framework's answer
    (Framework.takes_layout), and a pipeline for full fine-tuning only (the pipeline model counts
    it: planner/parallel/pipeline.py check_framework), a TP layout by the request's tp_plan where the
    framework trains it (Framework.check_tp_plan). Expert parallelism: wherever ep divides
    dp_shard x cp."""
    if pp > 1 and req.finetune != "full":
        return False
    if tp > 1:
        try:  # the framework refuses the TP layout it does not train (transformers' plan: torch, no DDP x TP)
            plan_framework(s, req).check_tp_plan(s, req.tp_plan, tp, req.gpus * req.nodes // (tp * cp * pp))
        except PlannerError:
            return False
    return tp * cp * pp == 1 or plan_framework(s, req).takes_layout(s, tp, cp, pp, schedule)


# What an estimate request can state (planner/schema.py EstimateRequest): a pipeline setting's
# request carries its micro-batch count as gradient_accumulation.
MAX_ACCUMULATION = MAX_BATCH_FIELD


MAX_MICRO_BATCH = MAX_BATCH_FIELD


def micro_options(req: PlanRequest, combo: Setting, per_rank: int, num_layers: int) -> np.ndarray:
    """The micro-batch sizes a setting can take: the divisors of its rank's share of the batch, and
    for a pipeline those whose micro-batch count its schedule runs (planner/parallel/pipeline.py
    check_schedule: torch's schedules refuse the rest) and an estimate request can state."""
    if combo.pp == 1:
        options = _stateable(per_rank, req.seq_len)
        if not accumulates(req.compile):  # one micro-batch per rank (recipes/compile.py)
            options = options[options == per_rank]
        return options
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
