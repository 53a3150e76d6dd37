"""The recommender: search and rank. Every strategy x micro-batch x checkpointing x offload (x GPU count) that
reaches the global batch, memory and time for each, ranked by the objective, every rejection
explained.

Speed: each phase of the memory model is affine in the micro-batch (activations scale with the
tokens), so two estimates per (GPU count, strategy, checkpointing, offload) give every micro-batch
exactly, and numpy evaluates the whole grid at once.
"""

from __future__ import annotations

import math
import time as wallclock

import numpy as np

from planner import timing
from planner.catalogue import catalogue_model, model_from_config, with_vision
from planner.errors import PlannerError
from planner.frameworks import framework_of
from planner.gpus import Gpu, check_precision, gpu as lookup_gpu
from planner.hardware import profile_efficiencies, topology_of
from planner.layouts import Rejected, cp_degrees, tp_degrees
from planner.memory import estimate, host_capacity
from planner.parallel import refuse_unmodelled
from planner.schema import Candidate, EstimateRequest, EstimateResult, PlanRequest, PlanResult, TopologySummary
from planner.steptime import Combo, StepSettings, estimate_with_time, frozen_base_shape, step_times
from planner.strategies import STRATEGIES, explicit_hsdp_shard, strategy as lookup_strategy
from planner.topology import Topology
from planner.units import GB, GIB

__all__ = ["estimate_with_time", "plan"]  # estimate_with_time: re-exported for scripts outside the repo (/work/golden/dump.py)



def _hsdp_shards(gpus: int, nodes: int) -> list[int]:
    """HSDP shard group sizes worth planning: every divisor of a node's GPUs from 2 up (groups of
    consecutive ranks, as DeviceMesh builds them), the whole node only when there are 2+ nodes."""
    return [d for d in range(2, gpus + 1) if gpus % d == 0 and (d < gpus or nodes > 1)]


def _offloads(name: str) -> list[tuple[str, str]]:
    s = lookup_strategy(name)
    return framework_of(s).offload_options(s)


def _gpu_counts(req: PlanRequest) -> list[int]:
    counts = {req.gpus}
    k = 1
    while k < req.gpus:
        counts.add(k)
        k *= 2
    return sorted(c for c in counts if req.global_batch % (c * req.nodes) == 0)


def _estimate(req: PlanRequest, combo: Combo, micro: int, model_fields: dict, accumulation: int = 1) -> EstimateResult:
    return estimate(_request(req, combo, micro, model_fields, accumulation))


def _request(req: PlanRequest, combo: Combo, micro: int, model_fields: dict, accumulation: int = 1) -> EstimateRequest:
    # accumulation > 1: a micro-batch after the first holds the earlier ones' gradients (frameworks/)
    steps = {"gradient_accumulation": accumulation} if accumulation > 1 else {}
    return (EstimateRequest(
        **model_fields, **steps, strategy=combo.strategy, gpus=combo.gpus, nodes=req.nodes, gpu=req.gpu,
        precision=req.precision, optimizer=req.optimizer, micro_batch=micro, seq_len=req.seq_len,
        checkpointing=combo.checkpointing, attention=req.attention,
        offload_optimizer=combo.offload_optimizer, offload_params=combo.offload_params,
        hsdp_shard_size=explicit_hsdp_shard(combo.strategy, combo.shard * combo.tp if combo.shard else None,
                                            combo.gpus),
        host_memory_gib=req.host_memory_gib, topology=req.topology, **_degree_fields(req, combo)))


def _frozen(req: PlanRequest, combo: Combo, model_fields: dict, arch):
    """The LoRA / QLoRA step the time model takes for this combo (None for full fine-tuning)."""
    if req.finetune == "full":
        return None
    try:
        return frozen_base_shape(_request(req, combo, 1, model_fields), arch)
    except PlannerError:  # refused for this combo: its estimate says so and the combo is skipped
        return None


def _degree_fields(req: PlanRequest, combo: Combo) -> dict:
    """The combo's model-parallel degrees as request fields (none when all are 1, so that a
    data-parallel estimate stays the request it always was)."""
    fields = {k: v for k, v in (("tp", combo.tp), ("cp", combo.cp)) if v > 1}
    for name in ("pp", "ep"):  # fixed by the request; the search keeps them
        if getattr(req, name) > 1:
            fields[name] = getattr(req, name)
    return fields


def _per_rank(req: PlanRequest, combo: Combo) -> int:
    """Sequences per data-parallel rank per step: the global batch over the data-parallel ranks
    (a TP or CP group trains one rank's share together)."""
    return req.global_batch * combo.tp * combo.cp // (combo.gpus * req.nodes)


def _divisors(n: int) -> np.ndarray:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return np.array(sorted(set(small + [n // d for d in small])), dtype=np.int64)


class _Grid:
    """Everything about one combo that the vectorized evaluation needs."""

    def __init__(self, combo: Combo, one: EstimateResult, two: EstimateResult):
        self.combo = combo
        self.constant = np.array([2 * a.bytes - b.bytes for a, b in zip(one.phases, two.phases)], dtype=np.float64)
        self.slope = np.array([b.bytes - a.bytes for a, b in zip(one.phases, two.phases)], dtype=np.float64)
        self.framework = one.per_device.framework_bytes

    def peaks(self, micro: np.ndarray) -> np.ndarray:
        return (self.constant[:, None] + self.slope[:, None] * micro[None, :]).max(axis=0) + self.framework


def plan(req: PlanRequest, profile=None) -> PlanResult:
    """``profile``: the Profile the request names, read by the adapter (backend/profiles.py)."""
    if req.finetune == "auto":
        from planner.finetune_plan import plan_finetune_auto

        return plan_finetune_auto(req, lambda one: plan(one, profile))
    started = wallclock.perf_counter()
    g = lookup_gpu(req.gpu)
    check_precision(g, req.precision)
    refuse_unmodelled(req)  # fixed degrees only, the search over them comes with their memory models
    for name, what in (("pp", "pipeline"), ("ep", "expert")):
        if getattr(req, name) > 1:  # modelled by estimate; the plan's candidates do not carry the degree yet
            raise PlannerError(f"{name}={getattr(req, name)}: the plan does not search {what}-parallel layouts yet; "
                               f"estimate this layout with `planner estimate --{name} {getattr(req, name)}`",
                               field=name)
    model = catalogue_model(req.model) if req.model else model_from_config(req.model_config_)
    if req.include_vision:
        model = with_vision(model)
    arch = model.architecture
    model_fields = {"model": req.model} if req.model else {"model_config": req.model_config_}
    model_fields |= {"include_vision": True} if req.include_vision else {}
    model_fields |= finetune_fields(req)
    world_max = req.gpus * req.nodes
    if req.global_batch % world_max:
        raise PlannerError(f"global_batch({req.global_batch}) is not divisible by gpus({req.gpus}) * "
                           f"nodes({req.nodes}) = {world_max}", field="global_batch")
    topo, fabric_name, nics = topology_of(req, g)
    compute_efficiency, link_efficiency = profile_efficiencies(req.profile, req.gpu, topo, req.gpus,
                                                               req.compute_efficiency, req.link_efficiency, profile)
    if req.profile is not None:
        req = req.model_copy(update={"compute_efficiency": compute_efficiency, "link_efficiency": link_efficiency})
    capacity = g.memory_bytes
    usable = capacity * (1 - req.headroom)
    fabric = timing.fabric(fabric_name)
    layout = (g, model, topo, fabric, nics, usable, model_fields)
    rows, evaluated = _evaluate(req, _gpu_counts(req), *layout)
    layout_notes = [str(r) for r in _layouts(req, req.gpus, arch, topo)[1]]
    if "cp" not in req.model_fields_set and not any(r[3] and r[0].gpus == req.gpus for r in rows):
        cp_rows, count, cp_notes = _context_parallel_rows(req, *layout)
        rows += cp_rows
        evaluated += count
        layout_notes += ["nothing fits without context parallelism: cp searched"] + cp_notes
    fewer = []
    if req.nodes > 1 and req.objective != "memory":
        for k in _fewer_nodes(req):
            fewer_rows, count = _evaluate(req.model_copy(update={"nodes": k}), [req.gpus], *layout)
            evaluated += count
            fewer.append((k, fewer_rows))
    result = _rank(req, rows, fewer, usable, capacity, topo, fabric_name, nics, model_fields, evaluated, started, g)
    if layout_notes:
        result = result.model_copy(update={"notes": result.notes + layout_notes})
    if req.include_vision:  # say what was counted (the reader's note), as estimate does
        counted = [n for n in arch.notes if "include_vision" in n or "vision_config" in n]
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


def _evaluate(req: PlanRequest, counts: list[int], g: Gpu, model, topo: Topology, fabric: dict, nics: int,
              usable: float, model_fields: dict, layouts: list[tuple[int, int]] | None = None,
              strategies: tuple[str, ...] = STRATEGIES) -> tuple[list[tuple], int]:
    """(combo, micro-batch, peak bytes, fits, step time) for every setting on these GPU counts, for
    each (tp, cp) layout (by default: the degrees the request fixes, or those the wiring allows).

    Bound: a model-parallel layout computes what the data-parallel ones do and adds its own
    collectives, so on a GPU count where a data-parallel setting already fits, a layout none of
    whose step times beats the best fitting one (by step time or GPU-seconds per token, the same
    ordering at a fixed GPU count) cannot be recommended: its memory is not estimated."""
    rows: list[tuple[Combo, int, float, bool, timing.StepTime]] = []
    evaluated = 0
    host = host_capacity(req, g)  # offload's host RAM per node does not depend on the micro-batch
    for gpus in counts:
        options = layouts if layouts is not None else _layouts(req, gpus, model.architecture, topo)[0]
        best = None
        for tp, cp in sorted(options):  # data-parallel (1, 1) first: it gives the bound
            if tp * cp > 1 and best is None and req.objective != "memory":
                fitting = [r[4].step_seconds for r in rows if r[0].gpus == gpus and r[3]]
                best = min(fitting) if fitting else None
            if (gpus * req.nodes) % (tp * cp) or req.global_batch % (gpus * req.nodes // (tp * cp)):
                continue
            for name in strategies:
                s = lookup_strategy(name)
                if (tp > 1 or cp > 1) and not _model_parallel_framework(s, cp):
                    continue
                shards = _hsdp_shards(gpus // tp, req.nodes) if s.shard_within_node else [None]
                for shard, ckpt in ((sh, c) for sh in shards for c in ("none", "full")):
                    # TP/CP layouts are the alternative to offload: searched without it
                    for off_opt, off_par in (_offloads(name) if tp * cp == 1 else [("none", "none")]):
                        combo = Combo(gpus, name, ckpt, off_opt, off_par, shard, tp, cp,
                                      tp > 1 and s.framework == "torch")
                        per_rank = _per_rank(req, combo)
                        micro = _divisors(per_rank)
                        times = step_times(StepSettings.of(req), combo, micro, per_rank, model.parameters,
                                           model.architecture, g, topo, fabric, nics,
                                           frozen=_frozen(req, combo, model_fields, model.architecture))
                        evaluated += micro.size
                        if best is not None and min(t.step_seconds for t in times) >= best:
                            continue
                        try:
                            one = _estimate(req, combo, 1, model_fields)
                            grid = _Grid(combo, one, _estimate(req, combo, 2, model_fields))
                            # a micro-batch below the rank's share accumulates: its memory is that
                            # of a later micro-batch, the same for any number of them
                            later = grid if per_rank == 1 else _Grid(
                                combo, _estimate(req, combo, 1, model_fields, 2),
                                _estimate(req, combo, 2, model_fields, 2))
                        except PlannerError:  # a setting the fine-tuning refuses (QLoRA under ZeRO-3, TP, ...)
                            if req.finetune == "full":
                                raise
                            continue
                        host_ok = host is None or one.host.peak_bytes <= host[0]
                        peaks = np.where(micro < per_rank, later.peaks(micro), grid.peaks(micro))
                        rows += [(combo, int(mb), float(peaks[k]), bool(peaks[k] <= usable and host_ok), times[k])
                                 for k, mb in enumerate(micro)]
    return rows, evaluated


def _model_parallel_framework(s, cp: int) -> bool:
    """Which data-parallel realisations take a model-parallel layout: torch's (torchtitan: FSDP2,
    HSDP, DDP with TP; FSDP2/HSDP with CP) and DeepSpeed's AutoTP with ZeRO (no CP)."""
    if cp > 1:
        return s.framework == "torch" and s.shards_parameters
    return True


def _layouts(req: PlanRequest, gpus: int, arch, topo: Topology) -> tuple[list[tuple[int, int]], list[Rejected]]:
    """(tp, cp) pairs to search on ``gpus`` GPUs per node: the request's when it fixes them (a tp
    or cp given explicitly), else every TP degree inside the wiring's NVLink islands with cp 1
    (CP is searched only when nothing fits without it: _context_parallel_rows)."""
    fixed = {"tp", "cp"} & req.model_fields_set
    if fixed:
        return [(req.tp, req.cp)], []
    degrees, rejected = tp_degrees(topo, gpus, arch)
    return [(tp, 1) for tp in degrees], rejected


def _context_parallel_rows(req: PlanRequest, g: Gpu, model, topo: Topology, fabric: dict, nics: int,
                           usable: float, model_fields: dict) -> tuple[list[tuple], int, list[str]]:
    """When nothing fits on the full cluster: the same search with the sequence split over cp
    ranks (torch FSDP2/HSDP with context_parallel), for every TP degree the wiring allows."""
    tps = [tp for tp, _ in _layouts(req, req.gpus, model.architecture, topo)[0]]
    layouts, notes = [], []
    for tp in tps:
        degrees, rejected = cp_degrees(req.seq_len, req.gpus * req.nodes, tp, model.architecture)
        layouts += [(tp, cp) for cp in degrees]
        notes += [str(r) for r in rejected]
    rows, evaluated = _evaluate(req, [req.gpus], g, model, topo, fabric, nics, usable, model_fields, layouts,
                                strategies=tuple(n for n in STRATEGIES if lookup_strategy(n).framework == "torch"
                                                 and not lookup_strategy(n).shard_within_node))
    return rows, evaluated, notes


def _setting(combo: Combo, mb: int) -> str:
    """The rejected setting in words, so it is not mistaken for the strategy's other settings."""
    shard = f" (shard groups of {combo.shard})" if combo.shard else ""
    degrees = "".join(f" x {k} {v}" for k, v in (("tp", combo.tp), ("cp", combo.cp)) if v > 1)
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
    unsharded = []
    s = lookup_strategy(combo.strategy)
    if not s.shards_parameters and d.parameters_bytes:
        unsharded.append(f"{d.parameters_bytes / GB:.1f} GB of params")
    if not s.shards_gradients and d.gradients_bytes:
        unsharded.append(f"{d.gradients_bytes / GB:.1f} GB of grads")
    what = (("optimizer states are sharded but " if s.shards_optimizer else "nothing is sharded: ")
            + " and ".join(unsharded) + " are not; ") if unsharded else ""
    return (f"{_setting(combo, mb)}: {peak / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable of {capacity / GIB:.1f} GiB "
            f"on each GPU ({headroom:.0%} kept free): {what}the peak is at {d.peak_phase}, largest "
            f"{_peak_items(e)}")


def _host_reason(combo: Combo, mb: int, e: EstimateResult, host: tuple[int, str] | None) -> str:
    capacity, source = host if host else (0, "unknown")
    return (f"{_setting(combo, mb)}: offload holds {e.host.peak_bytes / GIB:,.1f} GiB of host RAM per node "
            f"(the sum over its {combo.gpus} ranks) > {capacity / GIB:,.1f} GiB on the node ({source})")


def _candidate(combo: Combo, mb: int, per_rank: int, fits: bool, t: timing.StepTime, e: EstimateResult,
               reason: str | None) -> Candidate:
    return Candidate(strategy=combo.strategy, micro_batch=mb, gradient_accumulation=per_rank // mb,
                     checkpointing=combo.checkpointing, offload_optimizer=combo.offload_optimizer,
                     offload_params=combo.offload_params,
                     hsdp_shard_size=combo.shard * combo.tp if combo.shard else None, parallel=e.parallel, fits=fits,
                     per_device=e.per_device,
                     step_seconds=t.step_seconds, compute_seconds=t.compute_seconds,
                     communication_seconds=t.communication_seconds,
                     exposed_communication_seconds=t.exposed_communication_seconds,
                     offload_seconds=t.offload_seconds, tokens_per_second=t.tokens_per_second, mfu=t.mfu,
                     rejected_reason=reason)


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


def _label(c: Candidate | Combo) -> str:
    shard = c.hsdp_shard_size if isinstance(c, Candidate) else c.shard
    tp, cp = (c.parallel.tp, c.parallel.cp) if isinstance(c, Candidate) else (c.tp, c.cp)
    degrees = (f"+tp{tp}" if tp > 1 else "") + (f"+cp{cp}" if cp > 1 else "")
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


def _rank(req, rows, fewer, usable, capacity, topo, fabric_name, nics, model_fields, evaluated, started, g) -> PlanResult:
    fabric = timing.fabric(fabric_name)
    by_combo: dict[Combo, list[tuple]] = {}
    for row in rows:
        by_combo.setdefault(row[0], []).append(row)
    best: dict[Combo, tuple] = {}
    for combo, options in by_combo.items():
        if combo.gpus != req.gpus:
            continue
        fitting = [r for r in options if r[3]]
        # a fitting setting by the objective (ties to headroom); one that fits nowhere at its smallest peak
        best[combo] = (_tie_order(req, capacity, fitting, lambda r: _objective(req, r[0], r[2], r[4]), lambda r: r[2],
                                  lambda r: r[4].communication_seconds)[0] if fitting
                       else min(options, key=lambda r: r[2]))
    ranked = _tie_order(req, capacity, [c for c in best if best[c][3]], lambda c: _objective(req, c, best[c][2], best[c][4]),
                        lambda c: best[c][2], lambda c: best[c][4].communication_seconds)
    ranked += sorted((c for c in best if not best[c][3]), key=lambda c: best[c][2])
    candidates = []
    for combo in ranked:
        _, mb, peak, fits, t = best[combo]
        per_rank = _per_rank(req, combo)
        e = _estimate(req, combo, mb, model_fields, per_rank // mb)
        reason = None if fits else (_reason(combo, mb, peak, usable, capacity, req.headroom, e) if peak > usable
                                    else _host_reason(combo, mb, e, host_capacity(req, g)))
        candidates.append(_candidate(combo, mb, per_rank, fits, t, e, reason))
    fitting = [c for c in candidates if c.fits]
    recommended = fitting[0] if fitting else None
    max_micro = _max_micro(req, rows)
    min_gpus = {name: _min_gpus(req, name, usable, model_fields) for name in STRATEGIES}
    # the inverse question per model-parallel layout the plan searched: FSDP2 with each TP degree
    for tp in sorted({c.parallel.tp for c in candidates} - {1}):
        min_gpus[f"fsdp+tp{tp}"] = _search(req, "fsdp", usable, model_fields, per_node=req.gpus, tp=tp)
    ring, ring_bw, _ = timing.node_ring(topo, req.gpus)
    inter = nics * fabric["gbps"] * fabric["efficiency"] / req.gpus if req.nodes > 1 else None
    notes = [f"{evaluated:,} candidates evaluated in {wallclock.perf_counter() - started:.3f} s",
             (f"ring over GPUs {list(ring)}: slowest link {ring_bw:.1f} GB/s ({topo.source})"
              if math.isfinite(ring_bw) else f"one GPU per node: no ring ({topo.source})"),
             f"compute at {req.compute_efficiency:.0%} of {g.name}'s peak dense TFLOP/s"]
    notes += [f"time model: {caveat}" for caveat in g.time_model_caveats]
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
    return PlanResult(recommended=recommended, candidates=candidates, candidates_evaluated=evaluated,
                      min_gpus=min_gpus, max_micro_batch=max_micro, faster_on_fewer_nodes=faster_on,
                      max_seq_len=_longest_sequence(req, recommended, usable, model_fields) if recommended else None,
                      topology=TopologySummary(source=topo.source, gpu_type=topo.gpu_type, gpus_per_node=req.gpus,
                                               nodes=req.nodes, nvlink_groups=topo.nvlink_groups, ring=list(ring),
                                               ring_bandwidth_gbps=ring_bw if math.isfinite(ring_bw) else None,
                                               inter_node_gbps_per_gpu=inter),
                      notes=notes, request=req)


def _max_micro(req: PlanRequest, rows) -> dict[str, int | None]:
    """The largest micro-batch that fits on the full cluster, per strategy (any checkpointing/offload)."""
    out: dict[str, int | None] = {}
    for combo, mb, _, fits, _ in rows:
        out.setdefault(combo.strategy, None)
        if fits and combo.gpus == req.gpus and combo.tp * combo.cp == 1 and (out[combo.strategy] is None or mb > out[combo.strategy]):
            out[combo.strategy] = mb
    return out


MAX_SEARCH_GPUS = 1 << 16
MAX_SEQ_LEN = 1 << 22  # PlanRequest.seq_len's bound (schema.py)


def _longest_sequence(req: PlanRequest, c: Candidate, usable: float, model_fields: dict) -> int | None:
    """The inverse question for sequence length: the longest sequence (a multiple of 2*cp, as
    load-balanced CP needs, and of 128) that the recommended layout trains at micro-batch 1 with
    full checkpointing. Per-device memory grows with the sequence, so doubling then bisection."""
    unit = 128 * 2 * c.parallel.cp

    def fits(seq: int) -> bool:
        degrees = {k: v for k, v in c.parallel.model_dump().items() if k in ("tp", "cp", "pp", "ep") and v > 1}
        e = estimate(EstimateRequest(**model_fields, strategy=c.strategy, gpus=req.gpus, nodes=req.nodes,
                                     gpu=req.gpu, precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                     gradient_accumulation=2 if c.micro_batch * c.gradient_accumulation > 1 else 1,
                                     seq_len=seq, checkpointing="full", attention=req.attention,
                                     offload_optimizer=c.offload_optimizer, offload_params=c.offload_params,
                                     hsdp_shard_size=explicit_hsdp_shard(c.strategy, c.hsdp_shard_size, req.gpus),
                                     **degrees))
        return e.per_device.peak_bytes <= usable

    low = 0
    high = max(1, req.seq_len // unit)
    while high * unit <= MAX_SEQ_LEN and fits(high * unit):
        low, high = high, high * 2
    high = min(high, MAX_SEQ_LEN // unit + 1)
    while low + 1 < high:
        mid = (low + high) // 2
        if fits(mid * unit):
            low = mid
        else:
            high = mid
    return low * unit if low else None


def finetune_fields(req: PlanRequest) -> dict:
    """The plan's fine-tuning as estimate fields (nothing for full fine-tuning)."""
    if req.finetune == "full":
        return {}
    given = {"lora_rank": req.lora_rank, "lora_targets": req.lora_targets, "lora_dropout": req.lora_dropout}
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
                                             gradient_accumulation=2 if req.global_batch * tp > gpus * nodes else 1,
                                             seq_len=req.seq_len, checkpointing="full", attention=req.attention,
                                             offload_optimizer=off_opt, offload_params=off_par,
                                             hsdp_shard_size=explicit_hsdp_shard(name, shard, gpus), **degrees))
            except PlannerError:  # refused for this fine-tuning (see _evaluate)
                if req.finetune == "full":
                    raise
                continue
            if e.per_device.peak_bytes <= usable:
                return True
    return False


def _search(req, name, usable, model_fields, per_node: int, tp: int = 1) -> int | None:
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
