"""The plan's inverse questions: the fewest GPUs on which each strategy (and each searched TP and
pipeline layout) trains at micro-batch 1, and the longest sequence the recommendation takes.
Per-device memory never grows with more GPUs and grows with the sequence, so each is a doubling
then a bisection, with bounds that answer at once where they can.
"""
from __future__ import annotations

import math

from planner.errors import PlannerError
from planner.memory.orchestrator import Measured, estimated, measure, resolve
from planner.memory.reserved import REPLAY_SHORTFALL
from planner.plan.recipe import refused_by_recipe
from planner.recipes.compile import accumulates
from planner.plan.settings import (OPTIMIZER_FIELDS, architecture_of, hsdp_shards, offload_options, planned_split,
                                   reduce_field, split_fields, version_field_of)
from planner.schema import Candidate, EstimateRequest, EstimateResult, PlanRequest
from planner.strategies import explicit_hsdp_shard, strategy as lookup_strategy


MAX_SEARCH_GPUS = 1 << 16


MAX_SEQ_LEN = 1 << 22  # PlanRequest.seq_len's bound (schema.py)

# the replays (planner/memory/reserved.py, a few milliseconds each) the largest micro-batch per
# strategy may spend checking the live peak's answers on reserved memory (rank.py _max_micro)
INVERSE_REPLAYS = 3


def longest_sequence(req: PlanRequest, c: Candidate, usable: float, model_fields: dict,
                     learned_positions: int = 0, on_reserved: bool = False) -> int | None:
    """The inverse question for sequence length: the longest sequence (a multiple of 2*cp, as
    load-balanced CP needs, and of 128) that the recommended layout trains at micro-batch 1 with
    full checkpointing (a pipeline: its rank's share of the batch as micro-batches of 1, in the
    request's schedule). Per-device memory grows with the sequence, so doubling then bisection on
    the live peak with the headroom; then, ``on_reserved`` (a GPU), the longest sequence up to
    that answer whose replay through the caching allocator fits the device (longest_replayed)."""
    unit = 128 * 2 * c.parallel.cp
    degrees = {k: v for k, v in c.parallel.model_dump().items() if k in ("tp", "cp", "pp", "ep") and v > 1}
    if c.parallel.pp > 1:
        # the rank's share of the batch in micro-batches of 1 (a pipeline's memory grows with the count:
        # torch's stages keep every micro-batch's output until the step ends); a multiple of the
        # candidate's own count, so its schedule's constraints on the count still hold
        degrees |= {"gradient_accumulation": c.micro_batch * c.gradient_accumulation,
                    "pp_schedule": c.pp_schedule or req.pp_schedule,
                    "pp_virtual_stages": c.pp_virtual_stages or req.pp_virtual_stages}
        degrees |= {k: v for k, v in (("pp_first_stage_layers", c.pp_first_stage_layers),
                                      ("pp_last_stage_layers", c.pp_last_stage_layers)) if v is not None}
    elif c.micro_batch * c.gradient_accumulation > 1 and accumulates(req.compile):
        # micro-batches of 1 accumulate (frameworks/), where the compile mode does (recipes/compile.py)
        degrees |= {"gradient_accumulation": 2}

    # a learned position table (GPT-2's n_positions) bounds the sequence whatever the memory
    longest = min(MAX_SEQ_LEN, learned_positions or MAX_SEQ_LEN)
    micro = 1

    def request(seq: int) -> EstimateRequest:
        return EstimateRequest(**model_fields, strategy=c.strategy, gpus=req.gpus, nodes=req.nodes,
                               gpu=req.gpu, precision=req.precision, optimizer=req.optimizer, micro_batch=micro,
                               optimizer_in_backward=req.optimizer_in_backward,
                               seq_len=seq, checkpointing="full", attention=req.attention,
                               offload_optimizer=c.offload_optimizer, offload_params=c.offload_params,
                               hsdp_shard_size=explicit_hsdp_shard(c.strategy, c.hsdp_shard_size, req.gpus),
                               alloc_conf=req.alloc_conf, nccl_buffsize_bytes=req.nccl_buffsize_bytes,
                               **reduce_field(req, c.strategy), **version_field_of(req, c.strategy), **degrees)

    measured: dict[int, Measured] = {}  # by sequence: the searches below ask some twice

    def at(seq: int) -> Measured:
        if seq not in measured:
            measured[seq] = measure(resolve(request(seq)))
        return measured[seq]

    if c.parallel.pp > 1:
        try:
            at(unit)
        except PlannerError:
            # the schedule refuses the share as micro-batches of 1 (interleaved 1F1B's rounds): the
            # candidate's own micro-batches, more sequences in flight than micro-batches of 1 hold
            micro, degrees["gradient_accumulation"] = c.micro_batch, c.gradient_accumulation

    def replayed(seq: int) -> EstimateResult:
        """The estimate with the caching allocator replayed (estimate_resolved(..., simulate=True)
        of the memory at() measured)."""
        return estimated(at(seq), simulate=True, brief=True)

    def largest(limit: float, high: int, low: int = 0) -> int:
        """The largest multiple of unit below high * unit whose live peak is within limit (0: none),
        low * unit known to be within it."""
        while low + 1 < high:
            mid = (low + high) // 2
            if at(mid * unit).peak_bytes <= limit:
                low = mid
            else:
                high = mid
        return low

    low = 0
    high = max(1, req.seq_len // unit)
    while high * unit <= longest and at(high * unit).peak_bytes <= usable:
        low, high = high, high * 2
    low = largest(usable, min(high, longest // unit + 1), low)
    if not (on_reserved and low):
        return low * unit if low else None
    # what the reserve gains per unit of sequence: the live peak's step (the answer's next unit was
    # measured above, or the one before where the table's positions stopped the search), and the
    # replay's shortfall held back on it
    below, above = (low, low + 1) if (low + 1) * unit in measured else (low - 1, low)
    step = (1 + REPLAY_SHORTFALL) * (at(above * unit).peak_bytes - at(below * unit).peak_bytes) if below else 0
    fitting = longest_replayed(lambda k: replayed(k * unit), low, step)
    return fitting * unit if fitting else None


def longest_replayed(replayed, live: int, step: float) -> int:
    """The longest k <= live (the live peak's answer, in units of sequence) whose estimate
    ``replayed(k)`` fits with the caching allocator replayed (0: none): the replays decide, a
    bracket of the longest known to fit and the shortest known not to narrows to adjacent units,
    so the answer is the one a bisection on reserved memory gives. Each probe is placed where the
    reserve predicts the boundary (``step``: the reserve's growth per unit; 0: bisection only):
    below one that does not fit, by the units its allocated peak exceeds the allocator's room
    plus a fragmentation guessed as one unit's growth and doubled after each miss; above one
    that fits, by the units its slack holds; after a prediction that failed, the bracket's middle.
    Over 53 plans' answers: 4.1 replayed estimates each, the live answer's included, where the
    bisection took 6.6."""
    e = replayed(live)
    if e.fits:
        return live
    low, high, last = 0, live, e  # last: the estimate at ``high`` (phase 1) or ``low`` (phase 2)
    guess = step
    while not low and high > 1:  # phase 1: the boundary from above
        x = high - max(1, math.ceil((_excess_bytes(last) + guess) / step)) if step > 0 else high // 2
        x = max(1, x)
        e = replayed(x)
        if e.fits:
            low, last = x, e
        else:
            high, last, guess = x, e, 2 * guess
    missed = False
    while low + 1 < high:  # phase 2: the bracket narrows to adjacent units
        slack = last.device_capacity_bytes - last.per_device.reserved_peak_bytes
        x = (low + high) // 2 if missed or step <= 0 else low + max(1, int(slack // step))
        x = min(max(x, low + 1), high - 1)
        e = replayed(x)
        if e.fits:
            low, last, missed = x, e, False
        else:
            high, missed = x, True
    return low


def _excess_bytes(e: EstimateResult) -> float:
    """By how much a replay that did not fit needs more than the allocator's room, at the least:
    its allocated peak (the live peak less the CUDA context outside the allocator) over the room
    (the device less the context, NCCL's buffers and the shortfall held back on the uncapped
    reserve, which the reserve it reports includes: reserve - context - nccl = uncapped x (1 + shortfall)).
    An estimate from the result's own numbers, to place the next probe; the replays decide."""
    d = e.per_device
    outside = d.cuda_context_bytes + d.nccl_bytes
    uncapped = (d.reserved_peak_bytes - outside) / (1 + REPLAY_SHORTFALL)
    room = e.device_capacity_bytes - d.reserved_peak_bytes + uncapped
    return (d.peak_bytes - d.cuda_context_bytes) - room


def strategy_min_gpus(req: PlanRequest, name: str, usable: float, model_fields: dict) -> int | None:
    """The smallest total GPU count (GPUs per node as given, growing the node count, or fewer GPUs
    on one node) on which the strategy trains at micro-batch 1 with full checkpointing, in any
    setting the plan itself tries: every offload it tries for the strategy, and for HSDP every
    shard-group size (so HSDP in groups of 2 on one node counts, as the plan recommends it).
    Per-device memory never grows with more GPUs (tests/test_properties.py), so a doubling search
    then a bisection finds it."""
    return min_gpus_search(req, name, usable, model_fields, per_node=req.gpus)


def _fits(req: PlanRequest, name: str, usable: float, model_fields: dict, gpus: int, nodes: int, tp: int = 1) -> bool:
    """Whether any of the plan's settings of the strategy fits this layout at micro-batch 1."""
    if gpus % tp:
        return False
    shards = hsdp_shards(gpus, nodes)[::-1] if lookup_strategy(name).shard_within_node else [None]
    degrees = {"tp": tp} if tp > 1 else {}
    for shard in shards:
        for off_opt, off_par in (reversed(offload_options(name, req)) if tp == 1 else [("none", "none")]):  # most offloaded first
            try:
                # micro-batch 1 accumulates when the rank's share of the global batch is more
                e = measure(resolve(EstimateRequest(**model_fields, strategy=name, gpus=gpus, nodes=nodes, gpu=req.gpu,
                                             precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                             optimizer_in_backward=req.optimizer_in_backward,
                                             gradient_accumulation=2 if req.global_batch * tp > gpus * nodes
                                             and accumulates(req.compile) else 1,
                                             seq_len=req.seq_len, checkpointing="full", attention=req.attention,
                                             offload_optimizer=off_opt, offload_params=off_par,
                                             hsdp_shard_size=explicit_hsdp_shard(name, shard, gpus),
                                             **reduce_field(req, name), **version_field_of(req, name),
                                             **degrees)))
            except PlannerError as refused:  # refused for this fine-tuning, optimizer or recipe (see _evaluate_setting)
                if req.finetune == "full" and refused.field not in OPTIMIZER_FIELDS and not refused_by_recipe(refused):
                    raise
                continue
            if e.peak_bytes <= usable:
                return True
    return False


def min_gpus_search(req, name, usable, model_fields, per_node: int, tp: int = 1) -> int | None:
    # bound: per-device memory never grows with more GPUs, so what does not fit on the most nodes
    # searched fits on none (one estimate instead of the whole doubling)
    if _replicated_weights_exceed(req, name, usable, model_fields, tp):
        return None
    asked: dict[tuple[int, int], bool] = {}  # (gpus, nodes) -> _fits: the bisection asks again what the doubling did

    def fits(gpus: int, nodes: int) -> bool:
        if (gpus, nodes) not in asked:
            asked[gpus, nodes] = _fits(req, name, usable, model_fields, gpus, nodes, tp)
        return asked[gpus, nodes]

    most = 1 << ((MAX_SEARCH_GPUS // per_node).bit_length() - 1)  # the doubling's last node count
    if most >= 2 and not fits(per_node, most):
        return None
    # and what does not fit on a whole node fits on none of its fewer GPUs
    if fits(per_node, 1):
        for gpus in range(tp, per_node + 1, tp):
            if fits(gpus, 1):
                return gpus
    nodes = 2
    while nodes * per_node <= MAX_SEARCH_GPUS:
        if fits(per_node, nodes):
            low = max(2, nodes // 2)
            while low < nodes:
                mid = (low + nodes) // 2
                if fits(per_node, mid):
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
        e = measure(resolve(EstimateRequest(**model_fields, strategy=name, gpus=tp, nodes=1, gpu=req.gpu,
                                     precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                     optimizer_in_backward=req.optimizer_in_backward,
                                     seq_len=req.seq_len, checkpointing="full", attention=req.attention,
                                     **version_field_of(req, name), **({"tp": tp} if tp > 1 else {}))))
    except PlannerError:
        return False
    return e.states[0] + e.framework_bytes > usable


def pipeline_min_gpus(req: PlanRequest, usable: float, model_fields: dict, tp: int, pp: int) -> int | None:
    """The inverse question for a pipeline layout: the smallest GPU count (GPUs per node as given,
    nodes a multiple of pp: stages of whole nodes) on which FSDP2 with these tp and pp degrees
    trains at micro-batch 1 with full checkpointing and pp micro-batches (the fewest 1F1B runs: the
    fewest in flight and receive buffers), in the request's schedule. More nodes shard each stage's
    states over more data-parallel ranks and hold the same activations, so the bound and the search
    of min_gpus_search apply to the stage groups."""
    def fits(groups: int) -> bool:
        try:
            e = measure(resolve(EstimateRequest(**model_fields, strategy="fsdp", gpus=req.gpus, nodes=groups * pp,
                                         gpu=req.gpu, precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                         optimizer_in_backward=req.optimizer_in_backward,
                                         gradient_accumulation=pp, seq_len=req.seq_len, checkpointing="full",
                                         attention=req.attention, tp=tp, pp=pp, pp_schedule=req.pp_schedule,
                                         pp_virtual_stages=req.pp_virtual_stages, **split_fields(split),
                                         **reduce_field(req, "fsdp"), **version_field_of(req, "fsdp"))))
        except PlannerError:
            return False
        return e.peak_bytes <= usable

    if req.gpus * pp > MAX_SEARCH_GPUS:
        return None
    split = planned_split(req, architecture_of(req), pp, req.pp_virtual_stages)
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
