"""Ranking what the search found: each setting's best option, the settings in order of the
objective (ties to headroom, then to less communication), the shortlist replayed through the
caching allocator, each rejection's reason, the best of each layout family and why the winner won.
"""
from __future__ import annotations

import math
import time as wallclock
from collections.abc import Callable

from planner.cluster.gpus import Gpu
from planner.memory.orchestrator import host_capacity, sequence_past_positions
from planner.plan.evaluate import TIE_TOLERANCE, Search
from planner.plan.inverse import INVERSE_REPLAYS, longest_sequence, min_gpus_search, pipeline_min_gpus, strategy_min_gpus
from planner.plan.settings import Row, Setting, layout_family, per_rank_sequences, schedule_fields, split_fields
from planner.recipes.precision import Recipe
from planner.schema import Candidate, EstimateResult, PlanRequest, PlanResult, TopologySummary
from planner.strategies import STRATEGIES, strategy as lookup_strategy
from planner.time import collectives as timing
from planner.time import kernels
from planner.time.step import Combo
from planner.units import GB, GIB


# Peaks closer than this fraction of the device are a tie in turn, broken by less communication
# (the time model's least certain term): the memory model is no finer, 31 of 31 verified runs
# within 3% (README, accuracy table).
MEMORY_TIE_FRACTION = 0.03


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
                     **split_fields(getattr(combo, "split", None)), **schedule_fields(combo), fits=fits,
                     per_device=e.per_device,
                     step_seconds=t.step_seconds, compute_seconds=t.compute_seconds,
                     communication_seconds=t.communication_seconds,
                     exposed_communication_seconds=t.exposed_communication_seconds,
                     offload_seconds=t.offload_seconds, tokens_per_second=t.tokens_per_second, mfu=t.mfu,
                     rejected_reason=reason, host=e.host if e.host.peak_bytes else None)


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


def _unfit_why(c: Candidate, usable: float) -> str:
    """Why a candidate does not fit, in short: its live peak over the usable memory, else what its
    rejected_reason says after naming the setting (the replayed reserved peak over the device, or
    the host RAM its offload needs)."""
    if c.per_device.peak_bytes > usable or not c.rejected_reason:
        return f"{c.per_device.peak_bytes / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable"
    return c.rejected_reason.partition(": ")[2]


def _against(req: PlanRequest, best: Candidate, other: Candidate, usable: float) -> str:
    """Why ``other``, the best of its family, lost to ``best``, in its numbers."""
    schedule = f", {_schedule_label(other)}" if other.parallel.pp > 1 else ""
    name = (f"{_family(other)} (best: {_label(other)}{schedule}, micro-batch {other.micro_batch} x "
            f"{other.gradient_accumulation})")
    if not other.fits:
        return f"{name} does not fit: {_unfit_why(other, usable)}"
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


def _compute_note(req: PlanRequest, g: Gpu, recipe: Recipe, compute_scale: float) -> str:
    if req.compute_efficiency is not None:
        return f"compute at {req.compute_efficiency:.0%} of {g.name}'s peak dense TFLOP/s (the compute_efficiency override)"
    r = kernels.rates(g, recipe.peak_dtype(g.peak_tflops), compute_scale)
    return (f"compute: each kernel at its measured rate (planner/time/kernels.py): matmuls at {r.matmul_source}"
            + (f" x {compute_scale:.3f} (profile)" if compute_scale != 1.0 else "")
            + f", attention at FlashAttention-2's measured rate, elementwise work at "
            f"{r.memory_bytes_per_s / 1e9:,.0f} GB/s")


def _replayed_first(search: Search, req: PlanRequest, candidates: list[Candidate], rows_of: dict,
                    capacity: int) -> list[Candidate]:
    """The candidates with the first fitting one replayed through the caching allocator: a candidate
    the shortlist did not replay fits on its live peak + NCCL, a lower bound of what it reserves,
    and the re-ranking after a fall-back can bring one first. Each such one ahead of the first
    replayed fit is replayed (Search.shown remembers the shortlist's), and one that reserves too
    much joins the rejected, until the first fitting candidate is one whose replay fits."""
    out = list(candidates)
    while (i := next((k for k, x in enumerate(out) if x.fits), None)) is not None:
        c = out[i]
        combo, peak, t = rows_of[id(c)]
        shown = search.shown(req, combo, c.micro_batch, accumulation=min(c.gradient_accumulation, 2))
        if shown.fits:
            return out
        del out[i]
        rejected = _candidate(combo, c.micro_batch, c.micro_batch * c.gradient_accumulation, False, t, shown,
                              _reserved_reason(combo, c.micro_batch, shown, capacity))
        rows_of[id(rejected)] = (combo, peak, t)
        out.insert(next((k for k, x in enumerate(out) if not x.fits), len(out)), rejected)
    return out


def ranked_result(search: Search, req: PlanRequest, rows: list[Row],
                  fewer_search: Callable[[Candidate | None], tuple[list[tuple[int, list[Row]]], int]] | None,
                  capacity: int, fabric_name: str, evaluated: int, started: float) -> PlanResult:
    """The plan's result from the search's rows. ``fewer_search``: the search on fewer nodes
    (evaluate.fewer_node_rows), asked with the recommendation once it is known (None: not searched);
    its rows feed the fewer-nodes advice and its options the count evaluated."""
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
        per_rank = per_rank_sequences(req, combo)
        # a later micro-batch's memory is the same for any number of them (planner/frameworks/: the
        # phases of micro-batch 2+), so the estimate the grid made with two stands for the candidate's
        e = search.estimate(req, combo, mb, accumulation=min(per_rank // mb, 2)).candidate()
        reason = None if fits else (_reason(combo, mb, peak, usable, capacity, req.headroom, e) if peak > usable
                                    else _host_reason(combo, mb, e, host_capacity(req, g)))
        if fits and replayed is not None and not g.is_cpu:
            # the shortlist: fitting candidates in rank order are replayed through the caching
            # allocator until one fits on reserved memory (the recommendation); a setting whose best
            # micro-batch reserves too much tries its next fitting options of a smaller live peak,
            # within RESERVED_REPLAYS replays; past them, still until one fits, each setting's option of
            # the smallest live peak alone: a recommendation is always one whose replay fits
            past = replayed >= RESERVED_REPLAYS
            first = None
            for _, option_mb, option_peak, _, option_t in (
                    [min(ordered[combo], key=lambda r: r[2])] if past else ordered[combo]):
                if not past and (replayed >= RESERVED_REPLAYS or (first is not None and option_peak >= peak)):
                    continue
                shown = search.shown(req, combo, option_mb, accumulation=min(per_rank // option_mb, 2))
                replayed += 1
                if shown.fits:
                    # a smaller micro-batch than the rank was made with: the next settings are
                    # replayed too, and the fitting ones ordered again below
                    fell_back = fell_back or first is not None or option_mb != mb
                    e, mb, peak, t = shown, option_mb, option_peak, option_t
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
    if not g.is_cpu:
        candidates = _replayed_first(search, req, candidates, rows_of, capacity)
    fitting = [c for c in candidates if c.fits]
    recommended = fitting[0] if fitting else None
    fewer, count = fewer_search(recommended) if fewer_search is not None else ([], 0)
    evaluated += count
    max_micro = _max_micro(req, rows, search)
    min_gpus = {name: strategy_min_gpus(req, name, usable, model_fields) for name in STRATEGIES
                if not lookup_strategy(name).one_device}
    # the inverse question per model-parallel layout the plan searched: FSDP2 with each TP degree
    for tp in sorted({c.parallel.tp for c in candidates} - {1}):
        min_gpus[f"fsdp+tp{tp}"] = min_gpus_search(req, "fsdp", usable, model_fields, per_node=req.gpus, tp=tp)
    # and with each pipeline degree (stages of whole nodes) at the candidates' TP degrees
    for tp, pp in sorted({(c.parallel.tp, c.parallel.pp) for c in candidates if c.parallel.pp > 1}):
        label = f"fsdp+tp{tp}+pp{pp}" if tp > 1 else f"fsdp+pp{pp}"
        min_gpus[label] = pipeline_min_gpus(req, usable, model_fields, tp, pp)
    ring, ring_bw, _ = timing.node_ring(topo, req.gpus)
    inter = nics * fabric["gbps"] * fabric["efficiency"] / req.gpus if req.nodes > 1 else None
    notes = [f"{evaluated:,} candidates evaluated in {wallclock.perf_counter() - started:.3f} s",
             (f"ring over GPUs {list(ring)}: slowest link {ring_bw:.1f} GB/s ({topo.source})"
              if math.isfinite(ring_bw) else f"one GPU per node: no ring ({topo.source})"),
             _compute_note(req, g, search.recipe, search.compute_scale)]
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
                      max_seq_len=(longest_sequence(req, recommended, usable, model_fields, positions,
                                                    on_reserved=not g.is_cpu)
                                   if recommended else None),
                      topology=TopologySummary(source=topo.source, gpu_type=topo.gpu_type, gpus_per_node=req.gpus,
                                               nodes=req.nodes, nvlink_groups=topo.nvlink_groups, ring=list(ring),
                                               ring_bandwidth_gbps=ring_bw if math.isfinite(ring_bw) else None,
                                               inter_node_gbps_per_gpu=inter),
                      notes=notes, request=req)


def _max_micro(req: PlanRequest, rows: list[Row], search: "Search | None" = None) -> dict[str, int | None]:
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
                              if search.shown(req, options[mb][0], mb,
                                              accumulation=min(per_rank_sequences(req, options[mb][0]) // mb, 2)).fits),
                             None)
    return out
