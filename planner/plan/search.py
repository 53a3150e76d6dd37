"""The recommender: search and rank. Every layout (tp inside the NVLink islands, pp across the
nodes, ep for a mixture of experts, cp when nothing fits without it: planner/plan/layouts.py) x strategy
x checkpointing x offload x micro-batch that reaches the global batch, memory and time for each
(planner/plan/evaluate.py, the settings of planner/plan/settings.py), ranked by the objective
(planner/plan/rank.py), every rejection explained.
"""
from __future__ import annotations

import gc
import time as wallclock

from planner.cluster.gpus import check_precision, gpu as lookup_gpu
from planner.cluster.hardware import profile_compute_scale, profile_efficiencies, topology_of
from planner.errors import PlannerError
from planner.frameworks import check_version
from planner.model.architecture import LOADED_CLASS
from planner.model.catalogue import as_loaded, catalogue_model, model_from_config
from planner.parallel.dims import refuse_unmodelled
from planner.parallel.pipeline import check_split
from planner.plan.evaluate import (TIE_TOLERANCE, Search, context_parallel_rows, evaluate_layouts, fewer_node_rows,
                                   layouts_to_search)
from planner.plan.rank import MEMORY_TIE_FRACTION, ranked_result
from planner.plan.recipe import allowed_layouts, recipe_fields
from planner.plan.settings import PIPELINE_SCHEDULES, Setting, finetune_fields, layout_family
from planner.recipes.precision import RECIPES
from planner.schema import PlanRequest, PlanResult
from planner.time import collectives as timing
from planner.time.step import estimate_with_time

# re-exported: estimate_with_time for scripts outside the repo (/work/golden/dump.py); the rest for
# the modules and tests that read them here
__all__ = ["MEMORY_TIE_FRACTION", "TIE_TOLERANCE", "Setting", "estimate_with_time", "finetune_fields", "layout_family",
           "plan"]


def plan(req: PlanRequest, profile=None) -> PlanResult:
    """``profile``: the Profile the request names, read by the adapter (backend/profiles.py).

    The cyclic garbage collector is paused while the plan runs (and resumed as it was): the search
    allocates hundreds of thousands of short-lived tuples and lists, none in a reference cycle
    (reference counting frees them), and every few thousand allocations the collector would scan
    them and every long-lived object of the process (the catalogue, the memos) again: about a
    tenth of a 70B plan's time (bench/plan_speed.py's plan: median 0.33 s collecting, 0.28 s
    not). Whatever cycle the plan did leave is collected once the collector resumes."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return _plan(req, profile)
    finally:
        if paused:
            gc.enable()


def _plan(req: PlanRequest, profile=None) -> PlanResult:
    if req.finetune == "auto":
        from planner.plan.finetune import plan_finetune_auto

        return plan_finetune_auto(req, lambda one: plan(one, profile))
    started = wallclock.perf_counter()
    check_version(req.framework_version)
    g = lookup_gpu(req.gpu)
    recipe = RECIPES[req.precision]  # the plan's precision, decoded once: every evaluation reads search.recipe
    check_precision(g, req.precision, recipe)
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
    search = Search(req, g, model, topo, timing.fabric(fabric_name), nics, usable, model_fields, recipe)
    search.compute_scale = profile_compute_scale(req.profile, profile)
    layouts, rejected = layouts_to_search(req, req.gpus, arch, topo)
    layouts, recipe_notes = allowed_layouts(req, layouts)
    _check_fixed_degrees(req)
    _check_split(req, arch)
    _check_batch(req, layouts)
    rows, evaluated = evaluate_layouts(search, req, layouts)
    if not rows and search.refusals:  # the recipe refused every setting: say why, as the estimate would
        raise search.refusals[0]
    layout_notes = [str(r) for r in rejected] + _search_notes(req, layouts) + recipe_notes
    if "cp" not in req.model_fields_set and not any(r[3] for r in rows):
        cp_rows, count, cp_notes = context_parallel_rows(search, req)
        rows += cp_rows
        evaluated += count
        layout_notes += ["nothing fits without context parallelism: cp searched"] + cp_notes
    fewer = None
    if req.nodes > 1 and req.objective != "memory":
        def fewer(recommended):  # asked by the ranking once the recommendation is known
            return fewer_node_rows(search, req, rows, ranked=True, recommended=recommended)
    result = ranked_result(search, req, rows, fewer, capacity, fabric_name, evaluated, started)
    if layout_notes:
        result = result.model_copy(update={"notes": result.notes + layout_notes})
    if arch is not None and arch.model_type in LOADED_CLASS:  # say what was counted (the reader's note), as estimate does
        counted = [n for n in arch.notes if n.startswith(f"{arch.model_type}: ")]
        result = result.model_copy(update={"notes": result.notes + counted})
    if req.finetune != "full":
        result = with_finetune(result, req.finetune)
    return result


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


def with_finetune(result: PlanResult, method: str) -> PlanResult:
    update = {"finetune": method}
    return result.model_copy(update={
        "candidates": [c.model_copy(update=update) for c in result.candidates],
        "recommended": result.recommended.model_copy(update=update) if result.recommended else None})
