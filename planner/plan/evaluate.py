"""The search: every setting of every layout evaluated, its step times for all its micro-batch
options at once and its memory from as few estimates as the bounds allow.

Speed: each phase of the memory model is affine in the micro-batch (activations scale with the
tokens), so two estimates per (layout, strategy, checkpointing, offload) give every micro-batch
exactly, and numpy evaluates the step times of the whole grid at once. A pipeline's memory depends on
its micro-batch count, so each of its options is an estimate; bounds (each named where it is taken)
prove which settings cannot fit or cannot be recommended before they are estimated.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from operator import attrgetter

import numpy as np

from planner.cluster.gpus import Gpu
from planner.cluster.topology import Topology
from planner.errors import PlannerError
from planner.memory.optimizer import check as check_optimizer
from planner.memory.orchestrator import (Measured, activation_offload_bytes, expert_pipeline_peak_bytes,
                                        expert_pipeline_resident_bytes, host_capacity, measure, pipeline_peak_bytes,
                                        pipeline_resident_bytes, resolve)
from planner.parallel.hf_plan import hf_rank_architecture
from planner.parallel.pipeline import SCHEDULE_SPECS, parallel_step
from planner.plan.layouts import Rejected, cp_degrees, ep_degrees, pp_degrees, tp_degrees
from planner.plan.recipe import checkpointings, refused_by_recipe
from planner.plan.settings import (OPTIMIZER_FIELDS, Row, Setting, estimate_request, expert_shards, framework_runs, frozen_base_of,
                                   hsdp_shards, layout_family, micro_options, offload_options, per_rank_sequences,
                                   plan_framework, schedules_of)
from planner.recipes.precision import Recipe
from planner.schema import MAX_TOKENS, Candidate, EstimateRequest, EstimateResult, PlanRequest
from planner.strategies import STRATEGIES, strategy as lookup_strategy
from planner.time import collectives as timing
from planner.time import kernels
from planner.setup import with_fields
from planner.time.step import Combo, StepSettings, step_times


# Options whose step times (or, for --objective cost, GPU-seconds per token) are closer than this
# are a tie, and the one that leaves more memory free wins. The time model resolves no finer: its
# compute and link efficiencies are fitted constants (`planner calibrate` reports the residuals per
# run), and a prediction 1% faster at 99% of the memory is a promise it cannot keep, while the
# headroom is what absorbs allocator fragmentation and a longer batch.
TIE_TOLERANCE = 0.01


class _Grid:
    """Everything about one combo that the vectorized evaluation needs."""

    def __init__(self, combo: Setting, one: Measured, two: Measured):
        self.combo = combo
        one_bytes, two_bytes = one.phase_bytes(), two.phase_bytes()
        self.constant = np.array([2 * a - b for a, b in zip(one_bytes, two_bytes)], dtype=np.float64)
        self.slope = np.array([b - a for a, b in zip(one_bytes, two_bytes)], dtype=np.float64)
        self.framework = one.framework_bytes

    def peaks(self, micro: np.ndarray) -> np.ndarray:
        return (self.constant[:, None] + self.slope[:, None] * micro[None, :]).max(axis=0) + self.framework


# the fields of a Setting the time model reads (its Combo's), as one tuple: Search.step_times_of's key
_COMBO_FIELDS = attrgetter(*(f.name for f in fields(Combo)))


class Search:
    """What one plan's evaluations share: the cluster, the usable memory, the model, and the
    estimates made while searching (the ranking reuses them instead of estimating again)."""

    def __init__(self, req: PlanRequest, g: Gpu, model, topo: Topology, fabric: dict, nics: int, usable: float,
                 model_fields: dict, recipe: Recipe):
        self.req, self.g, self.model, self.topo, self.fabric, self.nics = req, g, model, topo, fabric, nics
        self.usable, self.model_fields = usable, model_fields
        self.recipe = recipe  # the plan's precision, decoded once (planner/plan/search.py) for every evaluation
        self.estimates: dict[tuple[int, Setting, int], Measured] = {}
        self.floors: dict[tuple[int, Setting, int], int] = {}  # pipeline settings' resident bytes
        self.peaks: dict[tuple[int, Setting, int, int], int] = {}  # peak_of's, where no estimate was made
        self.bounds: dict[tuple[int, Setting, int, int], int] = {}  # peak_of's lower bounds above its ``above``
        self.floor_settings: dict[Setting, Setting] = {}  # _floor_setting's
        self.replayed: dict[tuple[int, Setting, int, int], EstimateResult] = {}  # shown() per candidate
        self.compute_scale = 1.0  # a calibration profile's kernel-rate factor (planner/time/kernels.py)
        self.refusals: list[PlannerError] = []  # settings the request's recipe refused (planner/plan/recipe.py)
        self._setups: dict[int, tuple[EstimateRequest, object]] = {}  # setup_of's, by the request's identity
        self._step_settings: dict[int, tuple[PlanRequest, StepSettings]] = {}  # settings_of's, likewise
        self._times: dict[tuple, tuple[StepSettings, timing.StepTimes]] = {}  # step_times_of's
        self._sent: dict[int, tuple[StepSettings, dict]] = {}  # step_times' data-parallel collectives, per settings
        self._resolved: dict[tuple[int, Setting], tuple[PlanRequest, object]] = {}  # resolved's first Setups

    def settings_of(self, req: PlanRequest) -> StepSettings:
        """StepSettings.of the plan request (the request itself, or fewer nodes' copy), once each."""
        hit = self._step_settings.get(id(req))
        if hit is None or hit[0] is not req or hit[1].compute_scale != self.compute_scale:
            hit = self._step_settings[id(req)] = (req, StepSettings.of(req, self.recipe, self.compute_scale))
        return hit[1]

    def step_times_of(self, req: PlanRequest, combo: Setting, micro: np.ndarray, per_rank: int, frozen,
                      offloaded_per_sequence: float) -> timing.StepTimes:
        """step_times of a setting's options, once per what the time model reads: the setting's
        Combo fields (planner/time/step.py reads no other), its options, the plan's StepSettings and
        the LoRA and activation-offload inputs. A pipeline's schedules and splits share a Combo: its
        bubble and sends are parallel_step's, per schedule (_parallel_times)."""
        settings = self.settings_of(req)
        key = (id(settings), _COMBO_FIELDS(combo), tuple(micro.tolist()), per_rank, frozen, offloaded_per_sequence)
        hit = self._times.get(key)
        if hit is None or hit[0] is not settings:
            sent = self._sent.get(id(settings))
            if sent is None or sent[0] is not settings:
                sent = self._sent[id(settings)] = (settings, {})
            hit = self._times[key] = (settings, step_times(settings, combo, micro, per_rank, self.model.parameters,
                                                           self.model.architecture, self.g, self.topo, self.fabric,
                                                           self.nics, frozen=frozen,
                                                           offloaded_per_sequence=offloaded_per_sequence,
                                                           sent=sent[1]))
        return hit[1]  # a StepTimes: read-only, each option's StepTime made when read

    def resolved(self, req: PlanRequest, combo: Setting, request: EstimateRequest):
        """resolve(request) for a request estimate_request made of ``combo`` under ``req``: the
        setting's first is resolved, a later one is that Setup with its own request. A setting's
        requests differ in their batch fields alone (micro_batch, gradient_accumulation: the
        model fields, the plan's and the setting's are the same), and resolve reads those only in
        memory/optimizer.py check (optimizer_in_backward refuses accumulation), which runs again
        (a test compares the Setups with resolve's)."""
        key = (id(req), combo)
        hit = self._resolved.get(key)
        if hit is None or hit[0] is not req or request.ds_config is not None:  # a config fixes batch fields too
            setup = resolve(request)
            self._resolved[key] = (req, setup)
            return setup
        # resolve's request is a copy with the precision set; one that sets it already is that copy
        # (the same fields, the same fields set: the plan's requests name their precision)
        setup = with_fields(hit[1], request=request if "precision" in request.model_fields_set else
                            request.model_copy(update={"precision": request.precision}))
        check_optimizer(setup)
        return setup

    def setup_of(self, request: EstimateRequest, req: PlanRequest | None = None, combo: Setting | None = None):
        """resolve(request), once per request object: a pipeline setting's first request is read by
        its step times and estimated again as its row (the same object). Given the plan request
        and the setting ``request`` was made of (estimate_request), through ``resolved``: the
        setting's other requests (its options' peaks, its floor) then share that Setup rather
        than resolve again."""
        hit = self._setups.get(id(request))
        if hit is None or hit[0] is not request:
            setup = resolve(request) if req is None else self.resolved(req, combo, request)
            hit = self._setups[id(request)] = (request, setup)
        return hit[1]

    def estimate(self, req: PlanRequest, combo: Setting, micro: int,
                 request: EstimateRequest | None = None, accumulation: int = 1) -> Measured:
        """The setting's memory (written out by ``.candidate()`` for the candidates the plan
        shows). ``accumulation``: micro-batches per step without pp (a later micro-batch's
        memory holds the earlier ones' gradients); a pipeline's request carries its own."""
        key = (req.nodes, combo, micro, accumulation if combo.pp == 1 else 1)
        if key not in self.estimates:
            self.estimates[key] = measure(self.setup_of(request, req, combo) if request is not None else self.resolved(
                req, combo, estimate_request(req, combo, micro, self.model_fields,
                                             accumulation if combo.pp == 1 else None)))
        return self.estimates[key]

    def peak_of(self, req: PlanRequest, combo: Setting, micro: int, above: float | None = None) -> float:
        """estimate(req, combo, micro).peak_bytes of a pipeline option: its worst rank's phases are
        not written out (orchestrator.pipeline_peak_bytes: the same replay, the same highest rank;
        with expert parallelism orchestrator.expert_pipeline_peak_bytes: the worst rank's phase
        bytes and the experts' items per kind; tests compare each with the estimate's), since a
        pipeline row reads its peak alone; the candidates the plan shows are estimated in full when
        shown. With expert parallelism the answer is always the peak (``above`` unused).

        ``above``: a peak above it may be answered by a lower bound above it (the first rank whose
        peak exceeds it; the others are not replayed), for a caller that reads only whether the
        peak exceeds ``above``. At most ``above`` the answer is the peak (every rank replayed)."""
        key = (req.nodes, combo, micro, 1)
        hit = self.estimates.get(key)
        if hit is not None:
            return hit.peak_bytes
        if key in self.peaks:
            return self.peaks[key]
        if combo.ep > 1:  # every rank replayed, the worst rank's phases not written out (the same peak)
            peak = self.peaks[key] = expert_pipeline_peak_bytes(self.resolved(req, combo, estimate_request(
                req, combo, micro, self.model_fields, None)))
            return peak
        bound = self.bounds.get(key)
        if above is not None and bound is not None and bound > above:
            return bound
        peak = pipeline_peak_bytes(self.resolved(req, combo, estimate_request(
            req, combo, micro, self.model_fields, None)), above if bound is None else None)
        if above is not None and peak > above and bound is None:
            self.bounds[key] = peak  # perhaps one rank's: a lower bound of the peak
        else:
            self.peaks[key] = peak
        return peak

    def shown(self, req: PlanRequest, combo: Setting, micro: int, accumulation: int = 1) -> EstimateResult:
        """The estimate of a candidate the plan shows, with the caching allocator replayed
        (planner/memory/reserved.py): the search judges settings on the live peak with the request's
        headroom; a shown candidate must also fit on reserved memory (simulated). The ranking's
        shortlist and the largest micro-batch per strategy replay some candidates twice: once each."""
        key = (req.nodes, combo, micro, accumulation if combo.pp == 1 else 1)
        if key not in self.replayed:
            self.replayed[key] = measure(self.resolved(req, combo, estimate_request(
                req, combo, micro, self.model_fields, accumulation if combo.pp == 1 else None))).candidate(replay=True)
        return self.replayed[key]


def evaluate_layouts(search: Search, req: PlanRequest, layouts: list[tuple[int, int, int, int]],
              strategies: tuple[str, ...] = STRATEGIES, ceiling: float | None = None) -> tuple[list[Row], int]:
    """(setting, micro-batch, peak bytes, fits, step time) for every setting on the request's
    GPUs per node and nodes, for each (tp, cp, pp, ep) layout.

    Bound: where a setting of the same layout family (layout_family: dp, dp x tp, dp x tp x pp,
    ...) already fits, a layout none of whose step times comes within the time model's uncertainty
    (TIE_TOLERANCE: the ranking's ties) of that family's best fitting one (by step time or
    GPU-seconds per token, the same ordering at a fixed GPU count) can be neither recommended nor
    its family's best (PlanResult.families): its memory is not estimated. Each family is searched
    to its own best, so the table can show the best of each beside the winner; data parallelism
    alone is not time-bounded (every strategy's settings are listed, offload among them).

    ``ceiling``: step seconds beyond whose ties no option is wanted (the fewer-node search asks
    only for what could beat the recommendation: fewer_node_rows): every setting, data-parallel
    ones too, is bounded by it as by its family's best. The options evaluated (the count
    returned) do not depend on any bound: _evaluate_setting counts a setting's options once their
    step times are computed, which it does before it reads a bound."""
    rows: list[Row] = []
    evaluated = 0
    world = req.gpus * req.nodes
    best_time: dict[str, float | None] = {}  # per layout family: each family's best is listed (PlanResult.families)
    best_peak: dict[str, float | None] = {}
    arch = search.model.architecture
    schedules = {pp: schedules_of(req, arch, pp) for pp in {d[2] for d in layouts}}
    for tp, cp, pp, ep in layouts:  # data-parallel (1, 1, 1, 1) first: it gives the bound
        family = layout_family(tp, cp, pp, ep)
        if world % (tp * cp * pp) or req.global_batch % (world // (tp * cp * pp)):
            continue
        runs = {option: _has_options(req, tp, cp, pp, ep, option, arch.num_layers) for option in schedules[pp]}
        for name, (schedule, virtual, split) in ((n, o) for n in strategies for o in schedules[pp]):
            if not runs[(schedule, virtual, split)]:
                continue  # every setting of it would have no micro-batch option: none evaluated, nothing listed
            s = lookup_strategy(name)
            if not s.runs_on(world) or not framework_runs(req, s, tp, cp, pp, schedule):
                continue
            shards = hsdp_shards(req.gpus // tp, req.nodes // pp) if s.shard_within_node else [None]
            for shard, ckpt in ((sh, c) for sh in shards for c in checkpointings(req)):
                if ep > 1 and expert_shards(s, shard, world // (tp * cp * pp), cp) % ep:
                    continue  # ep borrows its ranks from dp_shard x cp (planner/parallel/dims.py)
                # model-parallel layouts are the alternative to offload: searched without it
                for off_opt, off_par in (offload_options(name, req) if tp * cp * pp * ep == 1 else [("none", "none")]):
                    if world == 1 and not s.one_device and (off_opt, off_par) == ("none", "none"):
                        continue  # on one device a data-parallel framework adds only its offload to "single"
                    combo = Setting(req.gpus, name, ckpt, off_opt, off_par, shard, tp, cp,
                                    tp > 1 and plan_framework(s, req).tp_sequence_parallel and req.tp_plan == "torchtitan",
                                    pp, ep, split, schedule, virtual)
                    # data parallelism alone is listed whole (each strategy's settings, offload among them)
                    time_bound = best_time.get(family) if family != "dp" else None
                    if ceiling is not None:
                        time_bound = ceiling if time_bound is None else min(time_bound, ceiling)
                    found, count = _evaluate_setting(search, req, combo, time_bound, best_peak.get(family))
                    evaluated += count
                    rows += found
                    if req.objective == "memory":
                        best_peak[family] = _smallest([r[2] for r in found if r[3]], best_peak.get(family))
                    else:
                        best_time[family] = _smallest([r[4].step_seconds for r in found if r[3]],
                                                      best_time.get(family))
    return rows, evaluated


def _has_options(req: PlanRequest, tp: int, cp: int, pp: int, ep: int,
                 option: tuple[str, int, tuple[int, int] | None], num_layers: int) -> bool:
    """Whether the layout's settings under a schedule option (schedule, stages per rank, split) have
    micro-batch options: settings.micro_options reads the layout, the schedule and the rank's share
    alone (per_rank_sequences: the degrees), not the strategy, checkpointing, shard group or
    offload, so one setting answers for all (a test checks the plans' evaluations are unchanged)."""
    schedule, virtual, split = option
    probe = Setting(req.gpus, STRATEGIES[0], "none", "none", "none", None, tp, cp, False, pp, ep, split, schedule,
                    virtual)
    return micro_options(req, probe, per_rank_sequences(req, probe), num_layers).size > 0


def _smallest(values: list[float], default: float | None) -> float | None:
    return min(values + ([default] if default is not None else []), default=None)


def _evaluate_setting(search: Search, req: PlanRequest, combo: Setting, time_bound: float | None,
                      peak_bound: float | None) -> tuple[list[Row], int]:
    """The rows of one setting (its micro-batch options, or none when a bound proves it cannot be
    recommended) and how many options were evaluated: all of them once their step times (for a
    pipeline or expert layout, the bound of its compute) are computed, as a vector.

    Bound: every phase of a step grows with the micro-batch (activations and their transients
    scale with its tokens; nothing shrinks: tests/test_plan_search.py checks the slopes), so a
    setting that does not fit at micro-batch 1 fits at no larger one, and its smallest peak is at
    micro-batch 1: the larger options' memory is not estimated."""
    per_rank = per_rank_sequences(req, combo)
    arch = search.model.architecture
    micro = micro_options(req, combo, per_rank, arch.num_layers)
    if micro.size == 0:
        return [], 0
    # the request of its first option, for what reads one: a model-parallel setting's step times
    # and bounds, LoRA's frozen base, activation_offload's traffic (a data-parallel one's estimates
    # build their own)
    first = (estimate_request(req, combo, int(micro[-1]) if combo.pp > 1 else 1, search.model_fields)
             if combo.pp * combo.ep > 1 or req.finetune != "full" or req.activation_offload else None)
    times = search.step_times_of(req, combo, micro, per_rank,
                                 frozen_base_of(first, arch, search.recipe) if first else None,
                                 _offloaded_per_sequence(first) if first else 0.0)
    if combo.pp * combo.ep > 1:  # its rows are estimated option by option: each StepTime made when read
        return _model_parallel_rows(search, req, combo, micro, per_rank, times, first, time_bound,
                                    peak_bound), micro.size
    times = list(times)  # a data-parallel setting's rows are every option's
    if time_bound is not None and min(t.step_seconds for t in times) > time_bound * (1 + TIE_TOLERANCE):
        return [], micro.size
    try:
        return _grid_rows(search, req, combo, micro, times, first), micro.size
    except PlannerError as refused:  # a setting the fine-tuning, the optimizer or the recipe refuses (QLoRA
        # under ZeRO-3, Muon under ZeRO or HSDP, a step in backward with accumulation, a fused loss under tp)
        if refused_by_recipe(refused):
            search.refusals.append(refused)
        elif req.finetune == "full" and refused.field not in OPTIMIZER_FIELDS:
            raise
        return [], micro.size


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


def _grid_rows(search: Search, req: PlanRequest, combo: Setting, micro: np.ndarray, times: list[timing.StepTime],
               first: EstimateRequest | None) -> list[Row]:
    """Every micro-batch option's row from two estimates (each phase is affine in the micro-batch),
    or the smallest option's alone when it does not fit (the bound of _evaluate_setting).

    An option below the rank's share accumulates: its memory is a later micro-batch's, which holds
    everything the first does and the earlier gradients (planner/frameworks/), the same for any
    number of them, so those options come from the estimates at micro-batch 1 and 2 with
    accumulation; the option of the whole share (no accumulation) is estimated itself."""
    per_rank = per_rank_sequences(req, combo)
    host = host_capacity(req, search.g)  # offload's host RAM per node does not depend on the micro-batch
    if per_rank == 1:
        one = search.estimate(req, combo, 1, first)
        peak = one.peak_bytes
        host_ok = host is None or one.host.peak_bytes <= host[0]
        return [(combo, 1, float(peak), bool(peak <= search.usable and host_ok), times[0])]
    whole = int(micro[-1]) == per_rank
    small = micro[:-1] if whole else micro
    rows: list[Row] = []
    host_ok = True
    if small.size:
        base = search.estimate(req, combo, 1, accumulation=2)
        host_ok = host is None or base.host.peak_bytes <= host[0]
        if base.peak_bytes > search.usable or not host_ok:
            smallest = int(small[0])  # 1, unless its accumulation is more than a request can state
            e = base if smallest == 1 else search.estimate(req, combo, smallest, accumulation=2)
            rows.append((combo, smallest, float(e.peak_bytes), False, times[0]))
        else:
            peaks = (np.array([float(base.peak_bytes)]) if small.size == 1 and small[0] == 1 else
                     _Grid(combo, base, search.estimate(req, combo, 2, accumulation=2)).peaks(small))
            usable = search.usable
            rows += [(combo, mb, peak, peak <= usable, t) for mb, peak, t in zip(small.tolist(), peaks.tolist(), times)]
    if whole:
        e = search.estimate(req, combo, per_rank)
        if host is not None and not small.size:
            host_ok = e.host.peak_bytes <= host[0]
        peak = e.peak_bytes
        rows.append((combo, per_rank, float(peak), bool(peak <= search.usable and host_ok), times[len(micro) - 1]))
    return rows


def _model_parallel_rows(search: Search, req: PlanRequest, combo: Setting, micro: np.ndarray, per_rank: int,
                         times: Sequence[timing.StepTime], first: EstimateRequest, time_bound: float | None,
                         peak_bound: float | None) -> list[Row]:
    """The rows of a pipeline or expert-parallel setting, bounded by:

    - its compute: a rank's step is at least its share of the compute (the bubble stretches it,
      the collectives and all-to-alls only add), so where every option's is above the best fitting
      step time found so far (beyond the ties) it cannot be recommended (the least over the options:
      a small micro-batch's compute can be the larger, its host waiting on every micro-batch's hooks);
    - its memory floor, one estimate: a pipeline's resident bytes (between steps a stage holds its
      states and one receive buffer per micro-batch, m buffers of micro_batch sequences: the
      rank's share of the batch whatever the split, so one figure for every option, estimated at
      the fewest micro-batches, the cheapest to simulate); an expert layout's peak at micro-batch
      1 (the bound of _evaluate_setting). Above the usable memory no option fits: where another
      setting fits it cannot be recommended and is not listed;
    - its step times (the pipeline's bubble and point-to-point sends, the all-to-alls): where
      another setting fits, a layout none of whose options within the ties of it fits is not listed."""
    if time_bound is not None and times.least_compute_seconds() / combo.pp > time_bound * (1 + TIE_TOLERANCE):
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
        floor = e.resident_bytes if combo.pp > 1 else e.peak_bytes
    if floor > search.usable:
        if time_bound is not None or peak_bound is not None:
            return []  # another setting fits, none of this one's options does
        e = search.estimate(req, combo, int(micro[k]), first)
        t = timed[k] if timed else _parallel_times(search, req, combo, micro[k:k + 1], per_rank, times[k:k + 1],
                                                   first)[0]
        return [(combo, int(micro[k]), float(e.peak_bytes), False, t)]
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


def _resident_floor(search: Search, req: PlanRequest, combo: Setting, per_rank: int) -> int | None:
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
    combo = _floor_setting(search, combo)
    one, two = (_floor_estimate(search, req, combo, mb) for mb in (1, 2))
    per_sequence = (two - one) // pp
    return one + (per_rank - pp) * per_sequence


def _extrapolated(req: PlanRequest, combo: Setting, per_rank: int) -> bool:
    """Whether _resident_floor extrapolates (the rank's share is many times pp sequences)."""
    return per_rank > 4 * combo.pp and 2 * req.seq_len <= MAX_TOKENS


def _floor_setting(search: Search, combo: Setting) -> Setting:
    """The setting whose resident bytes stand for ``combo``'s (_resident_floor): without
    checkpointing, and under 1f1b for one stage per rank (what a rank keeps between steps, its states
    and receive buffers, pipeline.rank_phases, is the same under every one-stage-per-rank schedule:
    gpipe's floor is 1f1b's) or zbv for a V's two (DualPipeV takes no fewer micro-batches than
    stages; ZBV holds the same stages and buffers); made once per setting."""
    hit = search.floor_settings.get(combo)
    if hit is None:
        floor = replace(combo, checkpointing="none")
        if floor.virtual_stages == 1:
            floor = replace(floor, schedule="1f1b")
        elif SCHEDULE_SPECS[floor.schedule].v_shape:
            floor = replace(floor, schedule="zbv")
        hit = search.floor_settings[combo] = floor
    return hit


def _floor_estimate(search: Search, req: PlanRequest, combo: Setting, micro: int) -> int:
    """Resident bytes of the floor's setting (_floor_setting) at pp micro-batches of ``micro``
    sequences (a bound's input, not a row: the batch differs from the plan's)."""
    key = (req.nodes, combo, -micro)  # apart from the rows' estimates
    if key not in search.floors:
        setup = search.resolved(req, combo, estimate_request(req, combo, micro, search.model_fields,
                                                             accumulation=combo.pp))
        search.floors[key] = (pipeline_resident_bytes if combo.ep == 1 else expert_pipeline_resident_bytes)(setup)
    return search.floors[key]


def _parallel_times(search: Search, req: PlanRequest, combo: Setting, micro: np.ndarray, per_rank: int,
                    times: Sequence[timing.StepTime], first: EstimateRequest) -> list[timing.StepTime]:
    """Each option's step time with its pipeline bubble, point-to-point sends and expert
    all-to-alls: planner/parallel/pipeline.py parallel_step on the estimate's own Setup (as
    steptime.estimate_time), per micro-batch size and count: the setting's requests differ in
    those alone, so each option is timed on the first's Setup with its own (a test compares each
    with the step on a copy of the request at the option)."""
    setup = search.setup_of(first, req, combo)
    arch, topo, fabric, nics, link_efficiency = (search.model.architecture, search.topo, search.fabric, search.nics,
                                                 req.link_efficiency)
    return [parallel_step(times[k], setup, arch, topo, fabric, nics, link_efficiency, mb, per_rank // mb)
            for k, mb in enumerate(micro.tolist())]


def _pipeline_rows(search: Search, req: PlanRequest, combo: Setting, micro: np.ndarray,
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
        # with a bound, an option that does not fit is read for that alone: where none fits within
        # the bound's ties the setting is not listed (_model_parallel_rows), and a setting that has a
        # fitting option is ranked and shown by its fitting ones (rank.py ranked_result), so a peak
        # above the usable memory may be a lower bound (Search.peak_of); without a bound, a setting
        # none of whose options fits is shown at its smallest peak: each is the peak
        peak = search.peak_of(req, combo, int(micro[k]), search.usable if time_bound is not None else None)
        fits = peak <= search.usable
        rows.append((combo, int(micro[k]), float(peak), fits, t))
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


def layouts_to_search(req: PlanRequest, gpus: int, arch, topo: Topology) -> tuple[list[tuple[int, int, int, int]],
                                                                         list[Rejected]]:
    """(tp, cp, pp, ep) layouts to search on ``gpus`` GPUs per node: data-parallel first, then the
    tensor/context-parallel ones, the expert-parallel ones and the pipeline ones. A degree the
    request gives explicitly is kept; else every TP degree inside the wiring's NVLink islands with
    cp 1 (CP is searched only when nothing fits without it: context_parallel_rows), every pipeline
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


def context_parallel_rows(search: Search, req: PlanRequest) -> tuple[list[Row], int, list[str]]:
    """When nothing fits on the full cluster: the same search with the sequence split over cp
    ranks (torch FSDP2/HSDP with context_parallel), for every TP degree the wiring allows."""
    arch = search.model.architecture
    tps = sorted({tp for tp, _, pp, ep in layouts_to_search(req, req.gpus, arch, search.topo)[0] if pp * ep == 1})
    layouts, notes = [], []
    for tp in tps:
        degrees, rejected = cp_degrees(req.seq_len, req.gpus * req.nodes, tp, arch)
        layouts += [(tp, cp, 1, 1) for cp in degrees]
        notes += [str(r) for r in rejected]
    # the strategies whose framework takes context parallelism, sharding over the whole data-parallel group
    takes_cp = tuple(n for n in STRATEGIES if not lookup_strategy(n).shard_within_node
                     and plan_framework(lookup_strategy(n), req).takes_layout(lookup_strategy(n), 1, 2, 1, "1f1b"))
    rows, evaluated = evaluate_layouts(search, req, layouts, strategies=takes_cp)
    return rows, evaluated, notes


def _fewer_nodes(req: PlanRequest) -> list[int]:
    """Node counts below the request's (halving) that still divide the global batch: on a slow
    fabric the best plan may leave nodes idle rather than send every gather through their NICs."""
    counts, k = [], req.nodes // 2
    while k >= 1:
        if req.global_batch % (req.gpus * k) == 0:
            counts.append(k)
        k //= 2
    return counts


def fewer_node_rows(search: Search, req: PlanRequest, rows: list[Row], ranked: bool = False,
                    recommended: Candidate | None = None) -> tuple[list[tuple[int, list[Row]]], int]:
    """The search on each smaller node count that could beat the full cluster's best fitting
    option by more than the time model's uncertainty (what _fewer_nodes_advice asks).

    Bound: every setting computes at least its GPU's share of the batch's FLOPs without
    recomputation (step >= compute; the pipeline's bubble only adds), and that share grows as the
    nodes shrink; a node count whose bound is no better than the advice's threshold cannot win,
    and neither can any smaller one. (For --objective cost the bound is the same at every node
    count: GPU-seconds per token >= FLOPs per token / the GPU's achieved FLOP/s.)

    ``ranked``: asked once the full cluster's recommendation is known (``recommended``; rank.py
    ranked_result). The advice reads, of each node count's rows, the fitting one of the least step
    time (then peak), and only where that is below the recommendation's step time less the ties:
    with --objective time, every setting is bounded by that threshold (evaluate_layouts' ceiling),
    so what it leaves out is slower than the threshold, and the rows it keeps are as without it
    (the fastest fitting option of a setting is found before its slower ones; a test compares the
    advice and the count). Without a recommendation no advice is given: nothing is wanted."""
    fitting = [r for r in rows if r[3]]
    if not fitting:
        here = None
    else:
        here = min(_fewer_value(req, req.nodes, r[4]) for r in fitting)
    out, evaluated = [], 0
    floor = _compute_floor(search, req)
    ceiling = None
    if ranked and recommended is None:
        ceiling = 0.0
    elif ranked and req.objective == "time":
        # an option is left out above ceiling x (1 + TIE_TOLERANCE): the threshold, and a hair more
        # for the rounding of the two products
        ceiling = recommended.step_seconds * (1 - TIE_TOLERANCE) / (1 + TIE_TOLERANCE) * (1 + 1e-9)
    for k in _fewer_nodes(req):
        # the recommendation lies within the ties of the best fitting option (_tie_order), and the
        # advice asks for more than the ties below the recommendation
        if here is not None and floor is not None and \
                _floor_value(req, k, floor) >= here * (1 + TIE_TOLERANCE) * (1 - TIE_TOLERANCE):
            break
        fewer = req.model_copy(update={"nodes": k})
        layouts = [layout for layout in layouts_to_search(fewer, req.gpus, search.model.architecture, search.topo)[0]]
        k_rows, count = evaluate_layouts(search, fewer, layouts, ceiling=ceiling)
        evaluated += count
        out.append((k, k_rows))
    return out, evaluated


def _fewer_value(req: PlanRequest, nodes: int, t: timing.StepTime) -> float:
    return req.gpus * nodes / t.tokens_per_second if req.objective == "cost" else t.step_seconds


def _compute_floor(search: Search, req: PlanRequest) -> float | None:
    """Seconds of compute per sequence on one GPU without recomputation (full fine-tuning: the
    FLOPs the time model counts, at the achieved fraction of the GPU's peak); None for LoRA, whose
    FLOPs depend on the adapters (no bound taken)."""
    arch = search.model.architecture
    if req.finetune != "full" or arch is None:
        return None
    peak = search.recipe.peak_dtype(search.g.peak_tflops)
    if req.compute_efficiency is not None:
        flops = timing.flops_per_token(arch, req.seq_len, "none") * req.seq_len
        return flops / (search.g.peak_tflops[peak] * 1e12 * req.compute_efficiency)
    # the kernel model runs at most the matmul rate on every matmul FLOP and adds attention,
    # elementwise and host time (planner/time/kernels.py): the matmuls alone are a lower bound
    flops = 6 * timing.matmul_parameters(arch) * req.seq_len
    return flops / kernels.rates(search.g, peak, search.compute_scale).steady_flops


def _floor_value(req: PlanRequest, nodes: int, per_sequence: float) -> float:
    """The lower bound of the objective on ``nodes`` nodes: the GPU's share of the batch's compute."""
    step = per_sequence * req.global_batch / (req.gpus * nodes)
    if req.objective == "cost":
        return req.gpus * nodes * step / (req.global_batch * req.seq_len)
    return step
