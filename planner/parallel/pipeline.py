"""Pipeline parallelism: the stages, the schedules, and the memory of the worst stage (issue 12).

A decoder-only model is cut into ``pp * virtual_stages`` stages of consecutive blocks, as
torchtitan's manual split and Megatron do: the token embedding on the first stage, the final norm
and the LM head (and the loss) on the last. Rank r runs stages r, r + pp, r + 2pp, ... (the looped
placement of torch 2.13's interleaved schedule).

What a rank holds during the step is simulated action by action, in the order torch 2.13's
schedules run them (torch/distributed/pipelining/schedules.py): ScheduleGPipe (every forward,
then every backward), Schedule1F1B (``min(m, pp - stage)`` forwards of warm-up, then one
backward and one forward, then the cool-down backwards) and ScheduleInterleaved1F1B
(``_get_warmup_ops`` / ``_get_1f1b_rank_ops``). Each micro-batch in flight on a stage holds the
activations its blocks saved and the stage's output, which PipelineStage keeps in ``fwd_cache``
until that micro-batch's backward (pipelining/stage.py forward_one_chunk). A stage that receives
keeps one receive buffer per micro-batch for the whole step, and one for the incoming gradient
per micro-batch on a stage that sends (stage.py _setup_forward_recv_info, _create_grad_recv_info):
both are allocated once and stay between steps.

The bubble of a synchronous schedule is ``(pp - 1) / (m * v + pp - 1)`` of the step (Narayanan
et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 2.2: (p-1)/m of the ideal time, divided by v for the interleaved schedule).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from operator import mul
from typing import TYPE_CHECKING, Literal

from planner.model.activations import FP32, Activations
from planner.model.architecture import Architecture, block_numels, block_parameters, derived, layer_specs, norm_numels
from planner.model.attention.kinds import kind_of
from planner.memory.buffers import item, phase
from planner.memory.optimizer import step_temporaries
from planner.model.shapes import TensorShape, vectors
from planner.recipes.optimizers import OPTIMIZERS
from planner.recipes.precision import bits_to_bytes
from planner.errors import PlannerError
from planner.model.layers import routed_inactive_numels
from planner.memory.moments import PhaseKind
from planner.memory.rank_activations import activations
from planner.schema import MemoryItem, Phase
from planner.parallel import experts
from planner.parallel.stages import stage_bounds
from planner.parallel.tensor import LOSS_PARALLEL_ROW
from planner.time import collectives as timing

if TYPE_CHECKING:
    from planner.memory.phase_plan import PhasePlan
    from planner.setup import Setup

Schedule = Literal["gpipe", "1f1b", "interleaved", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"]


@dataclass(frozen=True)
class ScheduleSpec:
    """What the model needs to know of one of torch 2.13's schedules (pipelining/schedules.py).

    ``stages_per_rank``: 1 for the single-stage schedules, 2 for the V-shaped ones (their
    ``__init__``: "ZBV requires exactly 2 stages per rank"), None for any count. ``v_shape``: rank r
    holds stages r and 2pp-1-r (_utils.py generate_stage_to_rank_mapping style "v"), else r, r+pp,
    ... ``splits_backward``: its backwards are BACKWARD_INPUT then BACKWARD_WEIGHT actions (zero
    bubble; its bubble is simulated: simulated_bubble). ``runtime``: run by
    _PipelineScheduleRuntime, which waits for every send only after the last action.
    ``megatron``: Megatron-LM (d98e8a6 core/pipeline_parallel/schedules.py) runs it too: 1F1B, and
    interleaved 1F1B over virtual stages; it has no GPipe, breadth-first, zero-bubble or V schedule."""

    torch_class: str
    stages_per_rank: int | None
    v_shape: bool
    splits_backward: bool
    runtime: bool
    megatron: bool = False


SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    "1f1b": ScheduleSpec("Schedule1F1B", 1, False, False, False, megatron=True),
    "interleaved": ScheduleSpec("ScheduleInterleaved1F1B", None, False, False, True, megatron=True),
    "gpipe": ScheduleSpec("ScheduleGPipe", 1, False, False, False),
    "looped-bfs": ScheduleSpec("ScheduleLoopedBFS", None, False, False, True),
    "interleaved-zb": ScheduleSpec("ScheduleInterleavedZeroBubble", None, False, True, True),
    "zbv": ScheduleSpec("ScheduleZBVZeroBubble", 2, True, True, True),
    "dualpipev": ScheduleSpec("ScheduleDualPipeV", 2, True, True, True),
}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_SPECS)
MULTI_STAGE = tuple(name for name, spec in SCHEDULE_SPECS.items() if spec.stages_per_rank != 1)


@dataclass(frozen=True)
class Action:
    stage: int
    kind: Literal["F", "B", "I", "W"]  # forward, whole backward, input-gradient backward, weight-gradient backward
    micro_batch: int


def rank_stages(schedule: str, pp: int, virtual_stages: int, rank: int) -> tuple[int, ...]:
    """The stages a rank holds, its local order: looped r, r+pp, ...; V-shaped r, 2pp-1-r."""
    if SCHEDULE_SPECS[schedule].v_shape:
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + k * pp for k in range(virtual_stages))


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """The idle share of a pipeline step: (p-1) / (m*v + p-1) for GPipe, 1F1B and the looped
    schedules (Narayanan et al. 2021, Sec. 2.2; Lamy-Poirier 2023, "Breadth-First Pipeline
    Parallelism", Sec. 3); the zero-bubble schedules' from their own order (simulated_bubble)."""
    if pp == 1:
        return 0.0
    if SCHEDULE_SPECS[schedule].splits_backward:
        return simulated_bubble(schedule, pp, virtual_stages, micro_batches)
    return (pp - 1) / (micro_batches * virtual_stages + pp - 1)


# Unit times of a stage's actions in the simulation: a forward 1, the whole backward 2, split into
# the input gradient and the weight gradient of 1 each (Qi et al. 2024, "Zero Bubble Pipeline
# Parallelism", Sec. 2: T_F = T_B = T_W in its analysis; the backward's matmuls are twice the forward's)
_UNIT = {"F": 1, "B": 2, "I": 1, "W": 1}


def simulated_bubble(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> float:
    """The simulated idle share (_simulated_idle); past 2p micro-batches a split schedule's steady
    state adds no idle time (tests/test_pipeline.py checks it against the whole simulation), so the
    idle units of 2p micro-batches stand for more."""
    m = min(micro_batches, 2 * pp)
    idle = _simulated_idle(schedule, pp, virtual_stages, m)
    work = 3 * micro_batches * virtual_stages
    return idle / (work + idle)


@lru_cache(maxsize=1024)
def _simulated_idle(schedule: str, pp: int, virtual_stages: int, micro_batches: int) -> int:
    """Makespan - work of the busiest rank, in units, when every rank runs its actions in torch's order
    (rank_actions), each as soon as what it needs is done: a forward the previous stage's forward
    of its micro-batch, a backward (whole or input) the next stage's backward (the last stage its
    own forward), a weight gradient its input gradient; sends take no time. With F = I = W it gives
    the papers' closed forms where they hold (1F1B: (p-1)/(m+p-1); ZB-H1 a third of 1F1B's idle
    time; ZB-V none once m >= 2p - 1), and the schedule's own idle slots where the micro-batches
    are too few to fill it (ZBV pads its order to 2p - 1 micro-batches: torch schedules.py)."""
    orders = [_rank_actions(schedule, pp, virtual_stages, micro_batches, r) for r in range(pp)]
    last = pp * virtual_stages - 1
    finished: dict[tuple[int, str, int], int] = {}
    position, clock = [0] * pp, [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                a = order[position[r]]
                if a.kind == "F":
                    need = (a.stage - 1, "F", a.micro_batch) if a.stage else None
                elif a.kind == "W":
                    need = (a.stage, "b", a.micro_batch)
                else:
                    need = (a.stage, "F", a.micro_batch) if a.stage == last else (a.stage + 1, "b", a.micro_batch)
                if need is not None and need not in finished:
                    break
                start = max(clock[r], finished[need] if need else 0)
                clock[r] = start + _UNIT[a.kind]
                finished[(a.stage, "b" if a.kind in "BI" else a.kind, a.micro_batch)] = clock[r]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlannerError(f"pp_schedule {schedule}: the simulated order of pp({pp}) x {virtual_stages} stages and "
                               f"{micro_batches} micro-batches deadlocks", field="pp_schedule")
    return max(clock) - 3 * micro_batches * virtual_stages


def check_schedule(pp: int, schedule: str, virtual_stages: int, micro_batches: int, num_layers: int) -> None:
    """Refuse what torch 2.13's schedules refuse, and a layer count the stages do not divide."""
    if schedule not in SCHEDULES:
        raise PlannerError(f"pp_schedule({schedule!r}) is unknown; choose one of {', '.join(SCHEDULES)}",
                           field="pp_schedule")
    spec = SCHEDULE_SPECS[schedule]
    if spec.stages_per_rank == 1 and virtual_stages != 1:
        raise PlannerError(f"pp_virtual_stages({virtual_stages}) needs a multi-stage pp_schedule "
                           f"({', '.join(MULTI_STAGE)}), got {schedule}", field="pp_virtual_stages")
    if spec.stages_per_rank is not None and virtual_stages != spec.stages_per_rank:
        # ScheduleZBVZeroBubble / ScheduleDualPipeV.__init__: "requires exactly 2 stages per rank"
        raise PlannerError(f"pp_virtual_stages({virtual_stages}): pp_schedule {schedule} runs exactly "
                           f"{spec.stages_per_rank} stages per rank (torch's {spec.torch_class})",
                           field="pp_virtual_stages")
    stages = pp * virtual_stages
    if num_layers < stages:
        # torchtitan's generate_split_points: "Total stages cannot be greater than the number of layers"
        raise PlannerError(f"num_layers({num_layers}) is fewer than pp({pp}) * pp_virtual_stages({virtual_stages}) "
                           f"= {stages} stages", field="pp")
    if schedule == "1f1b" and micro_batches < pp:
        # Schedule1F1B.__init__: "Number of microbatches must be greater than or equal to the number of stages"
        raise PlannerError(f"gradient_accumulation({micro_batches}) micro-batches must be at least pp({pp}) for "
                           "pp_schedule 1f1b (torch's Schedule1F1B refuses fewer); raise it, or use gpipe",
                           field="gradient_accumulation")
    if schedule == "dualpipev" and micro_batches < stages:
        # ScheduleDualPipeV.__init__: "requires at least as many microbatches as stages"
        raise PlannerError(f"gradient_accumulation({micro_batches}) micro-batches must be at least pp({pp}) * "
                           f"pp_virtual_stages({virtual_stages}) = {stages} stages for pp_schedule dualpipev (torch's "
                           "ScheduleDualPipeV refuses fewer)", field="gradient_accumulation")
    if schedule in ("interleaved", "interleaved-zb"):
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble.__init__: micro-batches a multiple of the rounds
            raise PlannerError(f"gradient_accumulation({micro_batches}) micro-batches must be a multiple of "
                               f"max(1, gradient_accumulation // pp({pp})) = {rounds} for pp_schedule {schedule} "
                               f"(torch's {spec.torch_class})", field="gradient_accumulation")


def rank_actions(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> list[Action]:
    """The forwards and backwards one rank runs, in torch 2.13's order (idle slots dropped)."""
    return list(_rank_actions(schedule, pp, virtual_stages, micro_batches, rank))


@lru_cache(maxsize=4096)
def _rank_actions(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> tuple[Action, ...]:
    """rank_actions, replayed once per schedule, degree and micro-batch count (the plan search
    estimates many settings of the same pipeline)."""
    return tuple(_actions(schedule, pp, virtual_stages, micro_batches, rank))


def _actions(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> list[Action]:
    m = micro_batches
    if schedule == "gpipe":
        return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        out = [Action(rank, "F", i) for i in range(warmup)]
        forward = warmup
        for backward in range(m):
            out.append(Action(rank, "B", backward))
            if forward < m:
                out.append(Action(rank, "F", forward))
                forward += 1
        return out
    if schedule == "looped-bfs":
        # ScheduleLoopedBFS._calculate_single_rank_operations: every micro-batch's forward stage by
        # stage, then the backwards from the last local stage, micro-batches in reverse
        mine = rank_stages(schedule, pp, virtual_stages, rank)
        return [Action(s, "F", i) for s in mine for i in range(m)] + \
            [Action(s, "B", i) for s in reversed(mine) for i in reversed(range(m))]
    if schedule == "zbv":
        return _zbv_actions(pp, m, rank)
    if schedule == "dualpipev":
        return _dualpipev_actions(pp, m, rank)
    return _looped_1f1b_actions(pp, virtual_stages, m, rank, schedule == "interleaved-zb")


class _Counter:
    """Appends actions numbering each (stage, kind)'s micro-batches in order."""

    def __init__(self) -> None:
        self.out: list[Action] = []
        self.counts: dict[tuple[int, str], int] = {}

    def push(self, kind: str, stage: int, count_as: str | None = None) -> int:
        key = (stage, count_as or kind)
        mb = self.counts.get(key, 0)
        self.out.append(Action(stage, kind, mb))
        self.counts[key] = mb + 1
        return mb


def _looped_1f1b_actions(pp: int, v: int, m: int, rank: int, zero_bubble: bool) -> list[Action]:
    """ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble._calculate_single_rank_operations
    (schedules.py _get_warmup_ops, _get_1f1b_rank_ops): a warm-up of forwards ((v-1) rounds plus 2
    per hop to the last rank; zero bubble: 1 per hop), one forward and one backward each step,
    the cool-down backwards; zero bubble splits each backward into I and W and defers the W of
    the first ``rank`` steady steps, running the rest in order after each I."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)
    fwd_bwd = m * v - warmup

    def forward_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    c = _Counter()
    backward_steps: list[int] = []
    weights = 0
    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup + fwd_bwd:
            c.push("F", forward_stage(op))
        if op < warmup:
            continue
        c.push("I" if zero_bubble else "B", backward_stage(op))
        backward_steps.append(op)
        if zero_bubble and op - warmup >= rank:
            c.push("W", backward_stage(backward_steps[weights]))
            weights += 1
    while zero_bubble and weights < len(backward_steps):
        c.push("W", backward_stage(backward_steps[weights]))
        weights += 1
    return c.out


def _zbv_actions(pp: int, m: int, rank: int) -> list[Action]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations over max(2pp-1, m) micro-batches,
    those past m dropped: forwards of the first chunk, then both chunks, then I/W of the second
    chunk beside its forwards; the steady F/I/W of each chunk in turn; a cool-down of Is, then the
    deferred Ws."""
    n = max(2 * pp - 1, m)
    s0, s1 = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        out.append(Action(s0, "F", f0)); f0 += 1
    for _ in range(rank):
        out.append(Action(s1, "F", f1)); f1 += 1
        out.append(Action(s0, "F", f0)); f0 += 1
    for _ in range(pp - rank):
        out.append(Action(s1, "F", f1)); f1 += 1
        out += [Action(s1, "I", b1), Action(s1, "W", b1)]; b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(Action(s0, "F", f0)); f0 += 1
        out += [Action(s0, "I", b0), Action(s0, "W", b0)]; b0 += 1
        out.append(Action(s1, "F", f1)); f1 += 1
        out += [Action(s1, "I", b1), Action(s1, "W", b1)]; b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out.append(Action(s0, "I", b0)); b0 += 1
        out.append(Action(s1, "I", b1)); b1 += 1
    for _ in range(pp - rank):
        out.append(Action(s0, "I", b0)); b0 += 1
        out.append(Action(s0, "W", w0)); w0 += 1
    out += [Action(s1, "W", i) for i in range(w1, b1)] + [Action(s0, "W", i) for i in range(w0, b0)]
    return [a for a in out if a.micro_batch < m]


def _dualpipev_actions(pp: int, m: int, rank: int) -> list[Action]:
    """ScheduleDualPipeV._calculate_single_rank_operations: an overlapped forward+backward
    (OVERLAP_F_B) is run as its forward, then its whole backward (_PipelineScheduleRuntime runs the
    sub-actions in order); Ws are queued after each I and run in order where the schedule asks."""
    s0, s1 = rank, 2 * pp - 1 - rank
    c = _Counter()
    queue: list[tuple[int, int]] = []

    def backward(stage: int, split: bool) -> None:
        mb = c.push("I" if split else "B", stage, count_as="I")
        if split:
            queue.append((stage, mb))

    def weight() -> None:
        if queue:
            stage, mb = queue.pop(0)
            c.out.append(Action(stage, "W", mb))

    for _ in range(2 * (pp - rank - 1)):
        c.push("F", s0)
    for _ in range(rank + 1):
        c.push("F", s0); c.push("F", s1)
    for _ in range(pp - rank - 1):
        backward(s1, True); weight(); c.push("F", s1)
    for _ in range(m - 2 * pp + rank + 1):
        c.push("F", s0); backward(s1, False)
        c.push("F", s1); backward(s0, False)
    for _ in range(pp - rank - 1):
        backward(s1, False)
        c.push("F", s1); backward(s0, False)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(s1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(s0, split)
    for _ in range(pp - rank - 1):
        weight(); backward(s0, split)
    for _ in range(rank + 1):
        weight()
    return c.out


@lru_cache(maxsize=4096)
def _rank_ops(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> tuple[tuple[int, str, int], ...]:
    """rank_actions as (local stage: the rank's k-th, kind, micro-batch), for the replay."""
    local = {stage: k for k, stage in enumerate(rank_stages(schedule, pp, virtual_stages, rank))}
    return tuple((local[a.stage], a.kind, a.micro_batch)
                 for a in _rank_actions(schedule, pp, virtual_stages, micro_batches, rank))


def max_in_flight(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> int:
    """Micro-batch chunks whose activations a rank holds at once (gpipe: m; 1f1b: min(pp - rank, m);
    interleaved: its warm-up plus one, at most m x v). A chunk whose backward is split stays in
    flight until its weight-gradient backward (W): its graph is retained after the input gradient."""
    live = peak = 0
    for action in _rank_actions(schedule, pp, virtual_stages, micro_batches, rank):
        live += 1 if action.kind == "F" else -1 if action.kind in ("B", "W") else 0
        peak = max(peak, live)
    return peak


def check_split(num_layers: int, pp: int, virtual_stages: int, first: int | None, last: int | None) -> None:
    """Refuse an uneven split whose stages do not come out whole (Megatron-LM d98e8a6
    transformer_block.py: "With uneven pipelineing the left over layers must be divisible by left
    over stages"; transformer_config.py: a stage's layers larger than 0)."""
    if first is None and last is None:
        return
    given = ", ".join(f"{name}({n})" for name, n in (("pp_first_stage_layers", first),
                                                      ("pp_last_stage_layers", last)) if n is not None)
    field = "pp_first_stage_layers" if first is not None else "pp_last_stage_layers"
    if pp == 1:
        raise PlannerError(f"{given} needs pp > 1 (there is one stage)", field=field)
    stages = pp * virtual_stages
    fixed = [n for n in (first, last) if n is not None]
    left, rest = stages - len(fixed), num_layers - sum(fixed)
    if left == 0:
        if rest != 0:
            raise PlannerError(f"{given}: the {stages} stages must hold num_layers({num_layers}) blocks, not "
                               f"{sum(fixed)}", field=field)
        return
    if rest < left or rest % left:
        raise PlannerError(f"num_layers({num_layers}) - {given} = {rest} blocks do not split evenly over the other "
                           f"{left} of pp({pp}) * pp_virtual_stages({virtual_stages}) = {stages} stages",
                           field=field)


def block_flops(a: Architecture, seq_len: int) -> list[int]:
    """Forward FLOPs per token of each block (its active matmul weights and its attention scores,
    as planner/time/collectives.py flops_per_token counts the whole model)."""
    specs = layer_specs(a)
    return [2 * (n - routed_inactive_numels(spec.mlp, a.hidden_size)) + 4 * seq_len * a.q_width
            for n, spec in zip(block_parameters(a), specs)]


def stage_flops(a: Architecture, bounds: list[tuple[int, int]], seq_len: int) -> list[int]:
    """Forward FLOPs per token of each stage: its blocks, and the LM head on the last (the
    embedding is a lookup)."""
    blocks = block_flops(a, seq_len)
    out = [sum(blocks[first:last]) for first, last in bounds]
    out[-1] += 2 * a.vocab_size * a.hidden_size
    return out


def slowest_share(a: Architecture, pp: int, virtual_stages: int, seq_len: int, first: int | None = None,
                  last: int | None = None, schedule: str = "1f1b") -> tuple[float, int]:
    """(share of a replica's compute on its busiest rank, that rank): the pace of the pipeline,
    since every rank waits for the slowest stage at each step of the schedule."""
    cache = derived(a).setdefault("_pp_slowest", {})  # asked once per option by the plan search
    v_shape = SCHEDULE_SPECS[schedule].v_shape
    key = (pp, virtual_stages, seq_len, first, last, v_shape)
    if key not in cache:
        cache[key] = _slowest_share(a, pp, virtual_stages, seq_len, first, last, schedule)
    return cache[key]


def _slowest_share(a: Architecture, pp: int, virtual_stages: int, seq_len: int, first: int | None,
                   last: int | None, schedule: str) -> tuple[float, int]:
    per_stage = stage_flops(a, stage_bounds(a.num_layers, pp * virtual_stages, first, last), seq_len)
    per_rank = [sum(per_stage[i] for i in rank_stages(schedule, pp, virtual_stages, r)) for r in range(pp)]
    busiest = max(range(pp), key=lambda r: per_rank[r])
    return per_rank[busiest] / sum(per_stage), busiest


def _balanced(a: Architecture, stages: int, seq_len: int) -> tuple[int, int] | None:
    cache = derived(a).setdefault("_pp_balanced", {})  # the plan asks once per layout
    if (stages, seq_len) not in cache:
        cache[(stages, seq_len)] = _best_split(a, stages, seq_len)
    return cache[(stages, seq_len)]


def _best_split(a: Architecture, stages: int, seq_len: int) -> tuple[int, int] | None:
    blocks = block_flops(a, seq_len)
    head = 2 * a.vocab_size * a.hidden_size
    layers = len(blocks)
    best = None
    for middle in range(1, layers // max(1, stages - 2) + 1):
        rest = layers - (stages - 2) * middle
        for first in range(max(1, rest - middle), min(middle, rest - 1) + 1):
            last = rest - first
            if not 1 <= last <= middle:
                continue
            bounds = stage_bounds(layers, stages, first, last)
            sums = [sum(blocks[x:y]) for x, y in bounds]
            sums[-1] += head
            key = (max(sums), first)  # the pace, then the first stage lighter (it also holds the embedding)
            if best is None or key < best[0]:
                best = (key, (first, last))
        if stages == 2:
            break
    return best[1] if best else None


def balanced_split(a: Architecture, pp: int, virtual_stages: int, seq_len: int) -> tuple[int, int] | None:
    """The uneven split the plan takes where pp x virtual stages does not divide the blocks: the
    first and last stages' blocks (at most a middle stage's: torchtitan's
    pipeline_parallel_first/last_stage_less_layers and Megatron's --decoder-first/last-pipeline-
    num-layers both shorten them) whose slowest stage is the fastest, counting the LM head's
    FLOPs on the last; ties to the lighter first stage. The Llama 3 405B run's split comes out of
    it: 126 blocks over 16 stages, 7 on the first and the last, 8 on each other (Llama 3 paper,
    Sec. 3.3.2, "we reduce one Transformer layer each from the first and the last stages").
    None where no such split exists."""
    stages = pp * virtual_stages
    if a.num_layers % stages == 0:
        return None
    return _balanced(a, stages, seq_len)


# --- stages ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    index: int
    first_block: int
    last_block: int  # exclusive
    is_first: bool
    is_last: bool
    parameters: int
    largest_tensor: int
    activation_bytes: int  # one micro-batch in flight: saved activations and the stage's output
    output_bytes: int  # what it sends forward per micro-batch (0 on the last stage)
    input_bytes: int  # what it receives per micro-batch (0 on the first stage)
    transient_bytes: int  # on top, at the start of one micro-batch's backward
    # zero-bubble schedules (ScheduleSpec.splits_backward): between a micro-batch's input-gradient
    # backward (I) and its weight-gradient backward (W), the gradients flowing into every node that
    # consumes a weight, kept for W (pipelining/_backward.py stage_backward_input: param_groups
    # "grads"); what I frees (the last stage's loss and logits: the graph above its head, detached)
    weight_grad_inputs_bytes: int = 0
    freed_at_input_backward: int = 0
    # on top during I: the loss's backward transient at its start (the last stage), then a block's
    # backward transient beside the gradients it has collected, which reach the whole set at its end
    input_backward_bytes: int = 0


def _block_largest(a: Architecture) -> list[int]:
    """Each block's largest parameter tensor (once per architecture: the plan cuts it many times)."""
    memo = derived(a)
    if memo.get("_pp_block_largest") is None:
        memo["_pp_block_largest"] = [max(numels) for numels in block_numels(a)]
    return memo["_pp_block_largest"]


def _block_autocast(a: Architecture) -> tuple[list[int], list[int]]:
    """Per block, once per architecture: (_autocast_fp32_stream_extra of its spec, the elements of
    its tensors wider than the hidden size: the linears' weights autocast casts)."""
    memo = derived(a)
    if memo.get("_pp_block_autocast") is None:
        extra = {id(spec): _autocast_fp32_stream_extra(spec) for spec in layer_specs(a)}
        memo["_pp_block_autocast"] = ([extra[id(spec)] for spec in layer_specs(a)],
                                      [sum(n for n in block if n > a.hidden_size) for block in block_numels(a)])
    return memo["_pp_block_autocast"]


def _autocast(setup: "Setup", dp: int) -> bool:
    """Mixed precision by torch.autocast (fp32 weights, 16-bit matmuls): DDP or no wrapper; FSDP2
    over dp > 1 casts the weights themselves (MixedPrecisionPolicy param_dtype); DeepSpeed holds
    16-bit weights."""
    return (setup.recipe.compute != "fp32" and setup.recipe.master_bits > 0 and setup.framework.weights_are_master
            and not (dp > 1 and setup.strategy.shards_parameters))


def _autocast_fp32_stream_extra(spec) -> int:
    """Bytes per token x hidden element a block saves beyond activations.py's 16-bit count when
    autocast runs it on an fp32 residual stream (fp32 weights: the stage receives fp32, and the
    embedding's output is fp32). A Llama-style RMSNorm then makes ``x * rsqrt`` in fp32 (saved for
    the weight's gradient: 2 bytes more than a 16-bit one) and an fp32 output, which autocast casts
    to bf16 once per linear that reads it, each cast saved by its linear: q, k and v cast it three
    times, gate and up twice, where activations.py counts one 16-bit copy (torch 2.13 autocast
    caches only leaf weights' casts, aten/src/ATen/autocast_mode.cpp cached_cast). Measured on the
    bf16 pipeline runs (tests/real_runs.py llama-pp2-1f1b-bf16-m4, peak trace by site)."""
    if spec.norm != "rmsnorm" or spec.norm_weight != "cast":
        return 0
    attention = spec.attention
    extra = 2 * spec.norms
    if kind_of(attention).casts_kv_input_again and not attention.fused_qkv:
        extra += 2 * 2  # k and v cast the normed input again
    mlp = spec.mlp
    if not mlp.is_moe and mlp.gated and not mlp.fused_gate_up:
        extra += 2  # up casts it again beside gate
    return extra


def _stream_bytes(setup: "Setup", dp: int) -> int:
    """Bytes per element of the residual stream between blocks: fp32 when the weights are (fp32
    training, autocast), else the 16-bit compute dtype."""
    return FP32 if setup.recipe.compute == "fp32" or _autocast(setup, dp) else 2


def stages(setup: "Setup", pp: int, virtual_stages: int, dp: int = 1, acts: Activations | None = None) -> list[Stage]:
    """_stages, remembered per architecture for the settings that give it the same inputs: the
    activations (an Activations is frozen; kept beside the answer, so its identity in the key stays
    its own), the split, the rank's tokens, widths and dtypes, the residual stream's bytes and
    autocast (what it reads of the framework and the data-parallel group) and whether the schedule
    splits the backward. The plan's strategies, shard groups and schedules of a layout ask the same."""
    acts = acts if acts is not None else activations(setup)  # the caller's, where it has them (estimate_plan)
    req = setup.request
    key = (id(acts), pp * virtual_stages, req.pp_first_stage_layers, req.pp_last_stage_layers, setup.tp,
           setup.sequence_parallel, req.micro_batch, req.seq_len, setup.cp, setup.recipe.compute_bytes,
           _stream_bytes(setup, dp), _autocast(setup, dp), SCHEDULE_SPECS[req.pp_schedule].splits_backward)
    memo = derived(setup.arch).setdefault("_pp_stages", {})
    hit = memo.get(key)
    if hit is None or hit[0] is not acts:
        if len(memo) >= 1024:
            memo.clear()
        hit = memo[key] = (acts, _stages(setup, pp, virtual_stages, dp, acts))
    return list(hit[1])


def _stages(setup: "Setup", pp: int, virtual_stages: int, dp: int, acts: Activations) -> list[Stage]:
    """The model cut into ``pp * virtual_stages`` stages. A stage's activations are its share of
    the one Activations the whole model has (planner/memory/orchestrator.py ``activations``: the rank's
    narrower model under tp with tensor_parallel.tp_activations, its seq_len / cp tokens with
    context_parallel.cp_activations): its blocks' saved sets, the embedding's terms on the first
    stage, the final norm's and the loss's on the last, the RoPE tables on each. What is the
    pipeline's own is added here: the stage's output held in fwd_cache until its micro-batch's
    backward, the receive buffer (counted once, as a buffer), and autocast over an fp32 stream."""
    a: Architecture = setup.arch
    req = setup.request
    count = pp * virtual_stages
    bounds = stage_bounds(a.num_layers, count, req.pp_first_stage_layers, req.pp_last_stage_layers)
    edges = acts.edges
    # with cp the rank holds seq_len / cp tokens of each sequence (planner/parallel/context.py); with
    # sequence parallelism the residual stream between blocks (the stage's output and its receive
    # buffer) is sharded over the tp ranks along the sequence (Korthikanti et al. 2022, Sec. 4.2.2;
    # torchtitan's RowwiseParallel output_layouts Shard(1), sent as its local tensor)
    sp = setup.tp if setup.sequence_parallel else 1
    tokens = req.micro_batch * (req.seq_len // setup.cp)
    b = setup.recipe.compute_bytes
    stream = _stream_bytes(setup, dp)
    autocast = _autocast(setup, dp)
    h, vocab = a.hidden_size, a.vocab_size
    boundary = _boundary_bytes(setup, dp)
    split = SCHEDULE_SPECS[req.pp_schedule].splits_backward
    widths = _block_weight_node_widths(a, setup.tp, sp, b, stream) if split else []
    head = vocab * h  # the last stage's own copy when the embedding is tied (torchtitan unties)
    out = []
    for index, ((first, last), (parameters, largest)) in enumerate(zip(bounds, _stage_parameters(a, bounds))):
        is_first, is_last = index == 0, index == count - 1
        kept = acts.block_kept(first, last) + edges.rope_saved
        if autocast:
            extras, linears = _block_autocast(a)
            kept += sum(extras[first:last]) * tokens * h
            # torch.autocast casts each linear's weight once per forward and clears its cache when
            # the context exits (torch/amp/autocast_mode.py __exit__): every micro-batch's forward
            # makes its own 16-bit copies, which its graph saves until its backward
            linear = sum(linears[first:last]) + (head if is_last else 0)
            kept += b * linear
        if not is_first:
            # the first block's saved input is the receive buffer itself (counted once, as a buffer):
            # its checkpointed input, or the fp32 stream its norm saves as its own upcast
            if acts.checkpointed:
                kept -= acts.layer_kept_bytes
            elif stream == FP32:
                kept -= boundary
        if is_first:
            kept += edges.embedding_saved
        if is_last:
            # the loss's saved set and the logits, the stage's output (the LM head's output dtype:
            # 16-bit under autocast or 16-bit weights), kept in fwd_cache until this micro-batch's backward
            kept += edges.final_norm_saved + edges.loss_saved + b * tokens * vocab
            transient = max(acts.loss_transient_bytes, acts.layer_transient_bytes)
        else:
            kept += boundary
            transient = acts.layer_transient_bytes
        if acts.checkpointed:
            # each block is recomputed in its backward: the largest of the stage's holds its whole set
            transient = max(transient, max(acts.blocks[first:last]) + acts.layer_transient_bytes)
        held_for_weights, freed = 0, 0
        if split and not is_first:  # the first stage's I is skipped: its W runs the whole backward (stage.py)
            held_for_weights = tokens * sum(widths[first:last])
            if is_last:
                # the final norm's weighted output and the LM head's output (the logits' gradient)
                held_for_weights += tokens * h * stream // sp + b * tokens * vocab // setup.tp
                freed = edges.loss_saved + b * tokens * vocab
        # I retains the graph (retain_graph=True), so nothing it passes is freed: at a block's end the
        # collected gradients, the residual stream's gradient (the stage input's, at the last block)
        # and the norm's backward beside them: eager RMSNorm's PowBackward0 and MulBackward0 hold four
        # token x h tensors of the stream at once (this run's peak trace: llama-pp2-zbv-fp32-m4, rank 0)
        block_transient = max(acts.layer_transient_bytes, 4 * stream * tokens * h // sp)
        if acts.checkpointed:
            block_transient += max(acts.blocks[first:last], default=0)
        out.append(Stage(index, first, last, is_first, is_last, parameters, largest, kept,
                         0 if is_last else boundary, 0 if is_first else boundary, transient, held_for_weights,
                         freed, max(transient, held_for_weights + block_transient + boundary)))
    return out


def _boundary_bytes(setup: "Setup", dp: int) -> int:
    """What a stage sends forward per micro-batch and the next receives: its output on the residual
    stream, the rank's seq_len / cp tokens, sharded over the tp ranks with sequence parallelism."""
    sp = setup.tp if setup.sequence_parallel else 1
    tokens = setup.request.micro_batch * (setup.request.seq_len // setup.cp)
    return _stream_bytes(setup, dp) * tokens * setup.arch.hidden_size // sp


def _stage_parameters(a: Architecture, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(parameters, largest tensor) of each stage of a split, once per architecture and split: its
    blocks, the embedding (and learned positions) on the first, the final norm and the LM head on
    the last (the last stage's own copy when the embedding is tied: torchtitan unties)."""
    memo = derived(a).setdefault("_pp_stage_parameters", {})
    key = tuple(bounds)
    if key not in memo:
        h, vocab = a.hidden_size, a.vocab_size
        sums, largest = block_parameters(a), _block_largest(a)
        out = []
        for index, (first, last) in enumerate(bounds):
            tensors = [sum(sums[first:last])] if first < last else []  # the blocks' sum, then the edges' tensors
            biggest = max(largest[first:last], default=0)
            if index == 0:
                tensors += [vocab * h] + ([a.learned_positions * h] if a.learned_positions else [])
            if index == len(bounds) - 1:
                tensors += norm_numels(a.norm, h) + [vocab * h]
            edge = max(tensors[1:] if first < last else tensors, default=0)
            out.append((sum(tensors), max(biggest, edge)))
        memo[key] = out
    return memo[key]


def _block_weight_node_widths(a: Architecture, tp: int, sp: int, b: int, stream: int) -> list[int]:
    """_weight_node_widths of each block, once per architecture and arguments (a few kinds of
    block, many blocks)."""
    memo = derived(a).setdefault("_pp_weight_node_widths", {})
    key = (tp, sp, b, stream)
    if key not in memo:
        widths = {id(spec): _weight_node_widths(spec, a.hidden_size, tp, sp, b, stream) for spec in layer_specs(a)}
        memo[key] = [widths[id(spec)] for spec in layer_specs(a)]
    return memo[key]


def _weight_node_widths(spec, h: int, tp: int, sp: int, b: int, stream: int) -> int:
    """Bytes per token of the gradients flowing into a block's weight-consuming nodes: each
    linear's output (the q, k, v and gate/up outputs column-parallel over tp, o and down whole) in
    the compute dtype, and each norm's weighted output on the residual stream (over sp)."""
    att, mlp = spec.attention, spec.mlp
    q = att.num_heads * att.head_dim
    kv = att.num_kv_heads * (att.head_dim + att.v_head_dim)
    inner = mlp.intermediate_size * (2 if mlp.gated else 1)
    return b * ((q + kv + inner) // tp + 2 * h) + spec.norms * h * stream // sp


# --- memory of one rank ------------------------------------------------------------------------

@dataclass(frozen=True)
class RankMemory:
    rank: int
    stages: tuple[int, ...]
    parameters: int
    resident_bytes: int
    peak_bytes: int
    peak_phase: str
    in_flight: int


_item, _phase = item, phase  # the core's one way of building a phase's items (planner/memory/buffers.py)


@dataclass(frozen=True)
class DataParallel:
    """How a stage's states are held over its data-parallel ranks: ``dp`` replicas of the stage,
    its sharded states divided over ``shard`` of them (dp_shard: all of them, or HSDP's shard group)."""

    dp: int
    shard: int
    shards_parameters: bool
    shards_gradients: bool
    shards_optimizer: bool


def data_parallel(setup: "Setup", dp: int, shard: int | None = None) -> DataParallel:
    s = setup.strategy
    if dp == 1:
        return DataParallel(1, 1, False, False, False)
    return DataParallel(dp, shard or dp, s.shards_parameters, s.shards_gradients, s.shards_optimizer)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _bits(setup: "Setup", params: int) -> tuple[int, int, int]:
    """(weight, gradient, optimizer state) bits per element of a stage. torch (DDP, FSDP2, or no
    wrapper): the weights are the master copy (fp32 under the mixed recipes, as
    buffers._torch_phases stores them) and the optimizer keeps its states only; DeepSpeed's
    pipeline engine (ZeRO-0/1): 16-bit weights and gradients, fp32 master in the optimizer."""
    r = setup.recipe
    master_weights = setup.framework.weights_are_master
    weight_bits = 32 if master_weights and (r.master_bits or r.weight_bits == 32) else r.weight_bits
    grad_bits = weight_bits if master_weights else r.grad_bits
    states_bits = (0 if master_weights else r.master_bits) + setup.framework.optimizer_state_bits(setup, [params])
    return weight_bits, grad_bits, states_bits


def _shared_bits(setup: "Setup", params: int) -> tuple[int, int, int]:
    """_bits, remembered per architecture for the settings that give it the same inputs: what it
    reads of the setup is the framework (its weights' role, its optimizer's tensors), the recipe
    and the optimizer, and of a full model's stage (rank_tensors: the architecture's parameters,
    neither a LoRA adapter's nor a traced model's) only its parameter count. The plan's micro-batch
    options, checkpointing, shard groups and schedules of one layout ask the same few."""
    if setup.finetune is not None or setup.model.traced is not None:
        return _bits(setup, params)
    memo = derived(setup.arch).setdefault("_pp_bits", {})
    key = (setup.framework, setup.recipe, setup.request.optimizer, params)
    if key not in memo:
        if len(memo) >= 4096:
            memo.clear()
        memo[key] = _bits(setup, params)
    return memo[key]


def _resident_terms(setup: "Setup", mine: list[Stage] | tuple[Stage, ...], dp: DataParallel,
                    bits: tuple[int, int, int] | None = None) -> tuple[int, int, int, int, int | None]:
    """_resident's bytes without its items: (weights, optimizer states, activation receive buffers,
    gradient receive buffers, DDP's gradient buckets or None). The search sums them for every rank
    of every pipeline; the items are written for the rank it shows (rank_phases)."""
    params = sum(s.parameters for s in mine)
    return _resident_sums(setup, params, sum(s.input_bytes for s in mine), sum(s.output_bytes for s in mine), dp,
                          bits or _bits(setup, params))


def _resident_sums(setup: "Setup", params: int, received: int, sent: int, dp: DataParallel,
                   bits: tuple[int, int, int], bucket_copy: bool | None = None) -> tuple[int, int, int, int, int | None]:
    """_resident_terms of a rank's stages by their sums: ``params`` elements, ``received`` and
    ``sent`` bytes per micro-batch (its stages' inputs and outputs). ``bucket_copy``: the
    framework's gradient_bucket_copy, where the caller has it."""
    m = setup.request.gradient_accumulation
    weight_bits, grad_bits, states_bits = bits
    weights = bits_to_bytes(_ceil(params, dp.shard) if dp.shards_parameters else params, weight_bits)
    optim = bits_to_bytes(_ceil(params, dp.shard) if dp.shards_optimizer else params, states_bits)
    if bucket_copy is None:
        bucket_copy = setup.framework.gradient_bucket_copy(setup.strategy)
    buckets = grad_bits // 8 * params if bucket_copy and dp.dp > 1 else None
    return weights, optim, m * received, m * sent, buckets


def _resident_bytes(setup: "Setup", params: int, received: int, sent: int, dp: DataParallel,
                    bits: tuple[int, int, int], bucket_copy: bool | None = None) -> int:
    """The bytes of _resident's items, by its stages' sums (_resident_sums)."""
    return sum(b for b in _resident_sums(setup, params, received, sent, dp, bits, bucket_copy) if b is not None)


def _resident(setup: "Setup", mine: list[Stage], dp: DataParallel,
              bits: tuple[int, int, int] | None = None) -> list[MemoryItem]:
    """What a rank holding these stages keeps between steps: its states and receive buffers."""
    m = setup.request.gradient_accumulation
    params = sum(s.parameters for s in mine)
    weights, optim, recv, grad_recv, buckets = _resident_terms(setup, mine, dp, bits)
    where = f"stages {', '.join(str(s.index) for s in mine)}" if len(mine) > 1 else f"stage {mine[0].index}"
    resident = [
        _item(f"parameters ({where}, {params:,} elements)", weights, "parameters"),
        _item(f"optimizer states ({where})", optim, "optimizer_states"),
        _item(f"activation receive buffers ({m} micro-batches)", recv, "buffers",
              "torch pipelining stage.py _setup_forward_recv_info: one buffer per micro-batch"),
        _item(f"gradient receive buffers ({m} micro-batches)", grad_recv, "buffers",
              "torch pipelining stage.py _create_grad_recv_info: one buffer per micro-batch"),
    ]
    if buckets is not None:
        resident.append(_item("DDP gradient buckets (a copy of the gradients)", buckets, "buffers",
                              "torch DDP Reducer, gradient_as_bucket_view=False"))
    return resident


@dataclass(frozen=True)
class _RankStep:
    """One rank's step replayed in integers: what rank_phases writes out as items, for the rank
    whose peak is the pipeline's (the others' are summed only: RankMemory)."""

    mine: tuple[Stage, ...]
    params: int
    resident_bytes: int  # of _resident's items, written out by rank_phases (with ``bits``)
    bits: tuple[int, int, int]
    compute: int  # bytes per element of the compute dtype
    reduce: int  # of FSDP2's accumulated gradients (the reduce dtype)
    grad_bytes_per: int
    fresh_bytes_per: int
    gathered_bytes: int
    # each kind of moment's worst (in the order first met): name -> (bytes, (stage, micro-batches in
    # flight per local stage, whether each local stage has gradients, held bytes))
    worst: dict
    after: tuple[tuple[PhaseKind, str, int], ...]  # the phases after the schedule: (kind, name, bytes)
    in_flight: int  # the most micro-batch chunks in flight at once
    kept_input_grads: int = 0  # zero bubble: input gradients left on the receive buffers' .grad
    step_temporaries: int = 0  # the optimizer step's (_step_temporaries)


    def phase_bytes(self) -> list[tuple[str, int]]:
        """(name, bytes) of each phase, in rank_phases' order."""
        out = [(_phase_name(name, live), total) for name, (total, (_, live, *_)) in self.worst.items()]
        return out + [(name, total) for _, name, total in self.after]

    def phase_kinds(self) -> list[tuple[PhaseKind, int]]:
        """(kind, bytes) of each phase, in rank_phases' order: the kind rank_phases gives each moment
        (an embedding's backward ends the backward; a last stage's moment starts the loss's backward,
        any other a block's), then the phases after the schedule."""
        out = [(PhaseKind.END_OF_BACKWARD if name.startswith("embedding") else
                PhaseKind.START_OF_BACKWARD if stage.is_last else PhaseKind.START_OF_BLOCK, total)
               for name, (total, (stage, *_)) in self.worst.items()]
        return out + [(kind, total) for kind, _, total in self.after]

    def peak(self) -> tuple[str, int]:
        """The highest of phase_bytes (the first of equals), only its name written."""
        best = None
        for name, (total, (_, live, *_)) in self.worst.items():
            if best is None or total > best[1]:
                best = (name, total, live)
        for _, name, total in self.after:
            if best is None or total > best[1]:
                best = (name, total, None)
        name, total, live = best
        return (name if live is None else _phase_name(name, live)), total


def _phase_name(name: str, live: tuple[int, ...]) -> str:
    """A schedule moment's phase as rank_phases names it: with its micro-batches in flight."""
    return name if name.startswith("embedding") else f"{name}, {sum(live)} micro-batches in flight"


class _StageCosts:
    """``_bits`` and ``_step_temporaries`` of one setup, each computed once per distinct stage size:
    a pipeline's middle ranks hold stages of the same size, and the search replays every rank of
    thousands of pipelines (both are pure functions of the setup and these arguments)."""

    def __init__(self, setup: "Setup"):
        self.setup = setup
        self.bucket_copy = setup.framework.gradient_bucket_copy(setup.strategy)
        self._bits: dict[int, tuple[int, int, int]] = {}
        self._temporaries: dict[tuple, int] = {}

    def bits(self, params: int) -> tuple[int, int, int]:
        if params not in self._bits:
            self._bits[params] = _shared_bits(self.setup, params)
        return self._bits[params]

    def step_temporaries(self, largest: int, params: int, dp: DataParallel, weight_bits: int) -> int:
        key = (largest, params, dp.shard, dp.shards_optimizer, weight_bits)
        if key not in self._temporaries:
            self._temporaries[key] = _step_temporaries(self.setup, largest, params, dp, weight_bits)
        return self._temporaries[key]


@dataclass(frozen=True)
class _Moment:
    """A moment of a rank's schedule at which a phase can peak, as counts of its local stages' byte
    terms (the replay is linear in them): micro-batch chunks in flight (``live``), chunks whose
    activations are held (``acts``: each a stage's per-micro-batch bytes) less those whose
    input-gradient backward freed the loss's part (``freed``), sends held (``held``), input-gradient
    backwards waiting for their weight-gradient backward (``pending``), stages with gradients
    (``done``), and the transient on top (``extra``: input-gradient backward's, a backward's, a
    fresh gradient of the largest tensor, or none) on local stage ``stage``."""

    name: str
    stage: int
    live: tuple[int, ...]
    done: tuple[bool, ...]
    acts: tuple[int, ...]
    freed: tuple[int, ...]
    held: tuple[int, ...]
    pending: tuple[int, ...]
    extra: str


@lru_cache(maxsize=4096)
def _schedule_moments(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int,
                      firsts: tuple[bool, ...], lasts: tuple[bool, ...], silent: tuple[bool, ...]
                      ) -> tuple[tuple[str, ...], tuple[_Moment, ...], tuple[int, ...], int]:
    """The rank's schedule replayed once in counts, for every setting of the same pipeline: (phase
    names in the order first met, the moments that can be a phase's worst in order, the input-
    gradient backwards per local stage, the most chunks in flight). ``silent``: local stages whose
    sends are 0 bytes.

    Only moments that can be a phase's first highest are kept. Moments of the same phase whose
    counts differ only in the held sends (a steady state repeating: every 1F1B cycle after the
    warm-up, every cycle of the interleaved runtime, which holds one send more each time) differ
    in bytes only by the sends held; those only grow (a send is held until the step's end, and its
    bytes are not negative), so the first of them holding as many bytes as the last is their
    highest: the last one's held counts on every stage whose sends are not 0 bytes."""
    v = virtual_stages
    live, acts, freed, held, pending, inputs = ([0] * v for _ in range(6))
    done = [False] * v
    groups: dict[tuple, list[tuple[int, tuple[int, ...]]]] = {}
    names: dict[str, None] = {}
    count = most = position = 0

    def moment(name: str, extra: str, k: int) -> None:
        nonlocal position
        names.setdefault(name)
        key = (name, k, tuple(live), tuple(done), tuple(acts), tuple(freed), tuple(pending), extra)
        groups.setdefault(key, []).append((position, tuple(held)))
        position += 1

    for k, kind, micro_batch in _rank_ops(schedule, pp, v, micro_batches, rank):
        if kind == "F":
            live[k] += 1
            acts[k] += 1
            count += 1
            most = max(most, count)
            continue
        if kind == "I" and firsts[k]:
            continue  # stage.py backward_one_chunk: the first stage's W runs its whole backward
        if kind == "I":
            # stage_backward_input: the graph is retained (retain_graph=True) while the gradients
            # into the weights' nodes are collected; the input's gradient stays on the receive
            # buffer's .grad until the next step's clear_runtime_states
            moment("loss input-gradient backward" if lasts[k] else "stage input-gradient backward", "input", k)
            pending[k] += 1
            freed[k] += 1
            held[k] += 1
            inputs[k] += 1
            continue
        if kind == "W" and not firsts[k]:
            # stage_backward_weight: one parameter group's gradient at a time, added into .grad
            moment("weight-gradient backward", "fresh" if done[k] else "", k)
            acts[k] -= 1
            freed[k] -= 1
            pending[k] -= 1
        else:
            moment("loss backward" if lasts[k] else "stage backward", "transient", k)
            acts[k] -= 1
            held[k] += 1
        live[k] -= 1
        count -= 1
        done[k] = True
        if firsts[k] and micro_batch > 0:
            # embedding_dense_backward's fresh V x h gradient, added into the accumulated one
            moment("embedding backward (first stage)", "fresh", k)
    order = {name: i for i, name in enumerate(names)}
    kept = []
    for (name, k, in_flight, has, chunks, loss_freed, waiting, extra), points in groups.items():
        last = points[-1][1]
        position, sends = next((p, h) for p, h in points
                               if all(n == top or quiet for n, top, quiet in zip(h, last, silent)))
        # the moment's bytes as one dot product over _worst_moments' values: each local stage's
        # per-micro-batch activations, loss part freed, send, pending gradients, gradients, then the transients
        one_hot = [[int(extra == kind and j == k) for j in range(v)] for kind in _EXTRAS]
        counts = (chunks, tuple(-n for n in loss_freed), sends, waiting, tuple(int(h) for h in has), *one_hot)
        kept.append((position, order[name], tuple(n for row in counts for n in row),
                     _Moment(name, k, in_flight, has, chunks, loss_freed, sends, waiting, extra)))
    kept.sort(key=lambda p: p[0])
    return tuple(names), tuple(m[1:] for m in kept), tuple(inputs), most


_EXTRAS = ("input", "transient", "fresh")  # _Moment.extra's transients ("" is none)


def _dot(counts: tuple[int, ...], values: list[int]) -> int:
    return sum(map(mul, counts, values))


def _worst_moments(mine: tuple[Stage, ...], schedule: str, pp: int, virtual_stages: int, micro_batches: int,
                   rank: int, base: int, per_mb: list[int], sent: list[int], prev_local: list[bool],
                   grad_bytes_per: int, fresh_bytes_per: int) -> tuple[dict, int, int]:
    """(each phase's worst moment: name -> (bytes, (stage, chunks in flight per local stage, whether
    each has gradients, held, activation, pending and transient bytes)), in the order first met; the
    input gradients left on the receive buffers; the most chunks in flight) of the rank's schedule
    (_schedule_moments) at these stages' bytes. Ties go to the earlier moment."""
    values = (*per_mb, *[st.freed_at_input_backward for st in mine], *sent,
              *[st.weight_grad_inputs_bytes for st in mine], *[grad_bytes_per * st.parameters for st in mine],
              *[st.input_backward_bytes for st in mine], *[st.transient_bytes for st in mine],
              *[fresh_bytes_per * st.largest_tensor for st in mine])
    names, best, inputs, most = _worst_at(schedule, pp, virtual_stages, micro_batches, rank,
                                          tuple([st.is_first for st in mine]), tuple([st.is_last for st in mine]), values)
    worst = {name: (base + total, (mine[k], *moment)) for name, (total, k, *moment) in zip(names, best)}
    kept = sum(n * (0 if p else st.input_bytes) for n, p, st in zip(inputs, prev_local, mine))
    return worst, kept, most


# A schedule is replayed action by action (_replay_at) for its first few stages' bytes, and from its
# moments (_schedule_moments) after: replaying it in counts costs a few replays at bytes, and the plan
# asks most schedules at a few bytes only (one layout's strategies differ in few of them)
_COMPILE_AFTER = 4
_REPLAYED: dict[tuple, int] = {}  # replays at bytes so far, per schedule, degree, micro-batches and rank


@lru_cache(maxsize=4096)
def _worst_at(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int, firsts: tuple[bool, ...],
              lasts: tuple[bool, ...], values: tuple[int, ...]) -> tuple[tuple[str, ...], tuple, tuple[int, ...], int]:
    """_worst_moments above the resident bytes, at ``values`` (each local stage's per-micro-batch
    activations, loss part freed, send, pending gradients, gradients and transients: _schedule_moments'
    dot product): the plan's settings of one layout that differ in their strategy only (DDP, FSDP2,
    HSDP's shard groups) have the same stages, so the same worst moments above their resident bytes."""
    key = (schedule, pp, virtual_stages, micro_batches, rank, firsts, lasts)
    replayed = _REPLAYED.get(key, 0)
    if replayed < _COMPILE_AFTER:
        if len(_REPLAYED) >= 4096:
            _REPLAYED.clear()
        _REPLAYED[key] = replayed + 1
        return _replay_at(schedule, pp, virtual_stages, micro_batches, rank, firsts, lasts, values)
    return _moments_at(schedule, pp, virtual_stages, micro_batches, rank, firsts, lasts, values)


def _replay_at(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int, firsts: tuple[bool, ...],
               lasts: tuple[bool, ...], values: tuple[int, ...]) -> tuple[tuple[str, ...], tuple, tuple[int, ...], int]:
    """_worst_at by replaying every action at ``values``."""
    v = virtual_stages
    per_mb, freed, sent, waiting, grads_of, inputs_of, transient, fresh = (values[j * v:(j + 1) * v] for j in range(8))
    live, done, inputs = [0] * v, [False] * v, [0] * v
    worst: dict[str, tuple] = {}
    held = grads = acts = count = most = pending = 0

    def record(name: str, extra: int, k: int) -> None:
        total = grads + acts + held + pending + extra
        if name not in worst or total > worst[name][0]:
            worst[name] = (total, k, tuple(live), tuple(done), held, acts, pending, extra)

    for k, kind, micro_batch in _rank_ops(schedule, pp, v, micro_batches, rank):
        if kind == "F":
            live[k] += 1
            acts += per_mb[k]
            count += 1
            most = max(most, count)
            continue
        if kind == "I" and firsts[k]:
            continue  # stage.py backward_one_chunk: the first stage's W runs its whole backward
        if kind == "I":
            record("loss input-gradient backward" if lasts[k] else "stage input-gradient backward", inputs_of[k], k)
            pending += waiting[k]
            acts -= freed[k]
            held += sent[k]
            inputs[k] += 1
            continue
        if kind == "W" and not firsts[k]:
            record("weight-gradient backward", fresh[k] if done[k] else 0, k)
            acts -= per_mb[k] - freed[k]
            pending -= waiting[k]
        else:
            record("loss backward" if lasts[k] else "stage backward", transient[k], k)
            acts -= per_mb[k]
            held += sent[k]
        live[k] -= 1
        count -= 1
        if not done[k]:
            done[k] = True
            grads += grads_of[k]
        if firsts[k] and micro_batch > 0:
            record("embedding backward (first stage)", fresh[k], k)
    return tuple(worst), tuple(worst.values()), tuple(inputs), most


def _moments_at(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int, firsts: tuple[bool, ...],
                lasts: tuple[bool, ...], values: tuple[int, ...]) -> tuple[tuple[str, ...], tuple, tuple[int, ...], int]:
    """_worst_at from the schedule's moments (_schedule_moments) at ``values``."""
    v = virtual_stages
    sent = values[2 * v:3 * v]
    names, moments, inputs, most = _schedule_moments(schedule, pp, v, micro_batches, rank, firsts, lasts,
                                                     tuple(b == 0 for b in sent))
    best: list = [None] * len(names)
    for i, counts, mo in moments:
        total = sum(map(mul, counts, values))
        if best[i] is None or total > best[i][0]:
            best[i] = (total, mo)
    per_mb, freed, pending = values[:v], values[v:2 * v], values[3 * v:4 * v]
    out = []
    for total, mo in best:
        extra = 0 if not mo.extra else values[(5 + _EXTRAS.index(mo.extra)) * v + mo.stage]
        out.append((total, mo.stage, mo.live, mo.done, _dot(mo.held, sent),
                    _dot(mo.acts, per_mb) - _dot(mo.freed, freed), _dot(mo.pending, pending), extra))
    return names, tuple(out), inputs, most


def _rank_step(setup: "Setup", all_stages: list[Stage], rank: int, pp: int, virtual_stages: int,
               schedule: str, dp: DataParallel, costs: _StageCosts | None = None) -> _RankStep:
    r, req = setup.recipe, setup.request
    m = req.gradient_accumulation
    indices, next_local, prev_local = _rank_layout(schedule, pp, virtual_stages, rank)
    mine = tuple(all_stages[i] for i in indices)
    params = sum(s.parameters for s in mine)
    largest = max(s.largest_tensor for s in mine)
    compute = 4 if r.compute == "fp32" else 2
    costs = costs or _StageCosts(setup)
    bits = costs.bits(params)  # once per rank: the search replays thousands of ranks
    grad_bits = bits[1]
    # During the schedule: FSDP2 keeps the stage's parameters unsharded (compute dtype) and
    # accumulates unsharded gradients until the last backward (torch 2.13 pipelining/stage.py:844-847
    # backward_maybe_with_nosync sets reshard_after_backward and requires_gradient_sync False;
    # stage.py:1173-1190 perform_reduce_grad runs every group's post_backward at the end). The
    # accumulated gradients are in FSDP2's reduce dtype: with reduce_dtype fp32 (torchtitan's
    # default) each unit's post_backward without a reduction upcasts its 16-bit gradients to an fp32
    # unsharded_accumulated_grad and adds later micro-batches' into it (_fully_shard/
    # _fsdp_param_group.py:603-612, _fsdp_param.py:802-820), 4 bytes per element of the stage.
    reduce = FP32 if dp.shards_parameters and req.reduce_dtype == "fp32" else compute
    gathered = compute * params if dp.shards_parameters else 0
    grad_bytes_per = reduce if dp.shards_parameters else grad_bits // 8
    fresh_bytes_per = compute if dp.shards_parameters else grad_bits // 8  # autograd's new gradient, param dtype
    resident_bytes = _resident_bytes(setup, params, sum([s.input_bytes for s in mine]),
                                     sum([s.output_bytes for s in mine]), dp, bits, costs.bucket_copy)
    base = resident_bytes + gathered
    # The moments are replayed in integers; a phase's items are built only for each kind's worst
    # moment (the search estimates pipelines of hundreds of micro-batches). Sends whose work the
    # schedule waits for only at the step's end keep their tensors (``held``): ScheduleGPipe its
    # backward sends (bwd_sends_to_wait), the interleaved runtime every send (send_ops, waited in
    # _PipelineScheduleRuntime._step_microbatches after the last action); Schedule1F1B waits for
    # each with the next receive.
    spec = SCHEDULE_SPECS[schedule]
    # a stage's output handed to the next stage on the same rank is that stage's receive buffer
    # (stage.py set_local_fwd_input), counted once there
    per_mb = [st.activation_bytes - (st.output_bytes if nxt else 0) for st, nxt in zip(mine, next_local)]
    if spec.runtime:  # every send held to the step's end: the input's gradient back, the output forward
        sent = [(0 if p else st.input_bytes) + (0 if n else st.output_bytes)
                for st, p, n in zip(mine, prev_local, next_local)]
    else:  # GPipe holds its backward sends; Schedule1F1B waits for each with the next receive
        sent = [0 if schedule == "1f1b" else st.input_bytes for st in mine]
    worst, kept, most = _worst_moments(mine, schedule, pp, virtual_stages, m, rank, base, per_mb, sent, prev_local,
                                       grad_bytes_per, fresh_bytes_per)
    # After the schedule: the reduction of the gradients over dp, and the optimizer step.
    after = []
    if dp.shards_parameters:
        after.append((PhaseKind.GRADIENT_ALLREDUCE, "gradient reduce-scatter over dp",
                      base + kept + reduce * params + reduce * _largest_unit(setup, mine)
                      + grad_bits // 8 * _ceil(params, dp.shard)))
    temporaries = costs.step_temporaries(largest, params, dp, bits[0])
    after.append((PhaseKind.OPTIMIZER_STEP, "optimizer step",
                  resident_bytes + kept + grad_bits // 8 * (_ceil(params, dp.shard) if dp.shards_gradients else params)
                  + temporaries))
    return _RankStep(mine, params, resident_bytes, bits, compute, reduce, grad_bytes_per, fresh_bytes_per, gathered, worst,
                     tuple(after), most, kept, temporaries)


@lru_cache(maxsize=4096)
def _rank_layout(schedule: str, pp: int, virtual_stages: int, rank: int) -> tuple[tuple[int, ...], tuple[bool, ...],
                                                                                  tuple[bool, ...]]:
    """(the rank's stages, whether each one's next stage is on the rank too, whether its previous
    one is): the V's turn is passed by a call, not sent."""
    indices = rank_stages(schedule, pp, virtual_stages, rank)
    return indices, tuple(i + 1 in indices for i in indices), tuple(i - 1 in indices for i in indices)


def _largest_unit(setup: "Setup", mine: tuple[Stage, ...]) -> int:
    """Elements of the stage's largest FSDP unit: a block, or what the stage holds beside its
    blocks (the embedding, the final norm and the head)."""
    memo = derived(setup.arch).setdefault("_pp_largest_unit", {})  # asked per rank of every FSDP2 setting
    key = tuple((s.first_block, s.last_block, s.parameters) for s in mine)
    if key not in memo:
        blocks = block_parameters(setup.arch)
        units = [n for s in mine for n in blocks[s.first_block:s.last_block]]
        units += [s.parameters - sum(blocks[s.first_block:s.last_block]) for s in mine]
        memo[key] = max(units)
    return memo[key]


def _step_temporaries(setup: "Setup", largest: int, params: int, dp: DataParallel,
                      weight_bits: int | None = None) -> int:
    """The optimizer step's temporaries over the stage: its largest tensor (a single-tensor step's)
    and the rest of the stage's (a foreach step's), as the strategies without a pipeline count them."""
    biggest = _ceil(largest, dp.shard) if dp.shards_optimizer else largest
    stepped = _ceil(params, dp.shard) if dp.shards_optimizer else params
    return step_temporaries(setup, _step_vectors(biggest, stepped),
                            weight_bits if weight_bits is not None else _bits(setup, params)[0])


@lru_cache(maxsize=1024)
def _step_vectors(biggest: int, stepped: int) -> tuple[TensorShape, ...]:
    """The largest tensor and the rest of the stage, as vectors: one tuple per pair, since
    step_temporaries remembers its answer by the tuple's identity (planner/memory/optimizer.py
    _seen), so the plan's settings of one stage and optimizer ask it once."""
    return tuple(vectors([biggest] + ([stepped - biggest] if stepped > biggest else [])))


def rank_phases(setup: "Setup", all_stages: list[Stage], rank: int, pp: int, virtual_stages: int,
                schedule: str, dp: DataParallel, step: _RankStep | None = None) -> tuple[list[MemoryItem], list[Phase]]:
    """(what stays between steps, the phases a step can peak at) on one rank; ``step``: its
    replay, where the caller has it."""
    st = step or _rank_step(setup, all_stages, rank, pp, virtual_stages, schedule, dp)
    mine, params = st.mine, st.params
    resident = _resident(setup, list(mine), dp, st.bits)
    grad_bits = st.bits[1]
    gathered = (_item("unsharded parameters of the stage (FSDP2, kept for every micro-batch)", st.gathered_bytes,
                      "buffers", "pipelining/stage.py backward_maybe_with_nosync")
                if dp.shards_parameters else _item("", 0, "buffers"))

    def grads_item(stages_done: tuple[bool, ...]) -> MemoryItem:
        elements = sum(s.parameters for s, has in zip(mine, stages_done) if has)
        return _item(f"gradients of {sum(stages_done)} of {len(mine)} local stage(s)", st.grad_bytes_per * elements,
                     "gradients")

    def acts_item(in_flight: tuple[int, ...], nbytes: int) -> MemoryItem:
        return _item(f"activations of {sum(in_flight)} micro-batch chunk(s) in flight", nbytes, "activations",
                     f"{schedule} schedule, torch 2.13 pipelining/schedules.py")

    def pending_item(nbytes: int) -> MemoryItem:
        return _item("gradients into the weights' nodes, kept from each input-gradient backward to its weight-"
                     "gradient backward", nbytes, "activations", "torch 2.13 pipelining/_backward.py "
                     "stage_backward_input: param_groups' grads")

    kept = _item("input gradients left on the receive buffers (.grad) until the next step", st.kept_input_grads,
                 "buffers", "pipelining/_backward.py stage_backward_input: inp.grad = dinput; cleared by "
                 "stage.py clear_runtime_states at the next step")
    extras = {"loss input-gradient backward": "input-gradient backward transient and the gradients it collects",
              "stage input-gradient backward": "input-gradient backward transient and the gradients it collects",
              "weight-gradient backward": "a weight's fresh gradient, added into the accumulated one"}

    def held_item(nbytes: int) -> MemoryItem:
        return _item("sent tensors held until the step ends (p2p works not yet waited)", nbytes, "buffers",
                     "torch 2.13 pipelining/schedules.py: send works waited after the last action")

    phases: list[Phase] = []
    for name, (_, (stage, in_flight, stages_done, held_bytes, acts, pending, extra)) in st.worst.items():
        common = resident + [gathered, grads_item(stages_done), acts_item(in_flight, acts), held_item(held_bytes),
                             pending_item(pending)]
        if name.startswith("embedding"):
            phases.append(_phase(PhaseKind.END_OF_BACKWARD, name, common + [
                _item("embedding gradient being accumulated", extra, "gradients")]))
        else:
            kind = PhaseKind.START_OF_BACKWARD if stage.is_last else PhaseKind.START_OF_BLOCK
            phases.append(_phase(kind, f"{name}, {sum(in_flight)} micro-batches in flight",
                                 common + [_item(extras.get(name, "backward transient"), extra, "activations")]))
    grads_full = grad_bits // 8 * (_ceil(params, dp.shard) if dp.shards_gradients else params)
    step_items = resident + [kept, _item("gradients", grads_full, "gradients")]
    if dp.shards_parameters:
        # foreach_reduce (_fsdp_collectives.py:597-606) copies one unit's accumulated gradients into a
        # flat reduce-scatter input of the reduce dtype before it frees them
        grads_during = _item("unsharded gradients, accumulated over micro-batches (FSDP2"
                             + (", fp32 reduce dtype)" if st.reduce != st.compute else ")"), st.reduce * params,
                             "gradients", "reduce-scattered once, at perform_reduce_grad")
        reduce_items = resident + [kept, gathered, grads_during,
                                   _item("reduce-scatter input of one unit", st.reduce * _largest_unit(setup, mine),
                                         "buffers", "foreach_reduce: one flat input per unit, in the reduce dtype"),
                                   _item("sharded gradients (reduce-scatter output)",
                                         grad_bits // 8 * _ceil(params, dp.shard), "gradients")]
        phases.append(_phase(PhaseKind.GRADIENT_ALLREDUCE, "gradient reduce-scatter over dp", reduce_items))
    step_items.append(_item("optimizer step temporaries", st.step_temporaries, "buffers",
                            f"{OPTIMIZERS[setup.request.optimizer].source}, over the largest tensor"))
    phases.append(_phase(PhaseKind.OPTIMIZER_STEP, "optimizer step", step_items))
    return resident, phases


def check_framework(setup: "Setup", schedule: str) -> None:
    """What the data-parallel framework's pipeline supports. DeepSpeed's PipelineEngine runs its
    own 1F1B TrainSchedule (deepspeed/runtime/pipe/schedule.py) with ZeRO stage 0 or 1 only
    (pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"); torch's
    pipelining composes with DDP and FSDP2 (torchtitan: FSDP2 / HSDP), every schedule
    (Framework.check_pipeline)."""
    if getattr(setup, "finetune", None) is not None:
        raise PlannerError(f"pp={setup.dims.pp} with finetune {setup.request.finetune}: the pipeline model counts full "
                           "fine-tuning; estimate LoRA/QLoRA without pp", field="pp")
    if setup.zero.offload_optimizer != "none" or setup.zero.offload_params != "none":
        raise PlannerError(f"pp={setup.dims.pp} with offload: the pipeline model keeps every state on the device; "
                           "use offload_optimizer none and offload_params none", field="pp")
    setup.framework.check_pipeline(setup, schedule)


def estimate_plan(setup: "Setup", acts: Activations | None = None) -> tuple["PhasePlan", tuple[int, int, int],
                                                                         list[RankMemory]]:
    """The pipeline path of planner.memory.orchestrator.estimate: the worst rank's phases, its (parameters,
    gradients, optimizer states) bytes, and every rank's summary."""
    d, req = setup.dims, setup.request
    check_framework(setup, req.pp_schedule)
    dp, shard = _data_parallel_group(setup)
    plan, ranks = pipeline_phases(setup, d.pp, req.pp_virtual_stages, req.pp_schedule, dp, shard, acts)
    resident = {i.component: 0 for i in plan.resident}
    for i in plan.resident:
        resident[i.component] = resident.get(i.component, 0) + i.bytes
    step = next(p for p in plan.phases if p.kind == PhaseKind.OPTIMIZER_STEP)
    grads = sum(i.bytes for i in step.items if i.component == "gradients")
    return plan, (resident.get("parameters", 0), grads, resident.get("optimizer_states", 0)), ranks


def peak_bytes(setup: "Setup", above: int | None = None) -> int:
    """estimate_plan's peak (the highest phase of its worst rank) without writing the worst rank's
    phases out: pipeline_phases picks as worst the rank whose _RankStep.peak is highest, and
    rank_phases writes that rank's phases with the bytes _RankStep.phase_bytes lists (the same
    moments and after-schedule phases, item by item), so the plan's highest phase is the highest
    rank's _RankStep.peak (a test compares the two over every schedule). The plan search asks it of
    every pipeline option it judges; the items, the notes and the PhasePlan are written only for
    the candidates it shows.

    ``above``: where only whether the peak exceeds it matters, the first rank whose peak exceeds it
    answers (a rank's peak is at most the pipeline's, so it is above too) and the rest are not
    replayed: the answer is then that rank's peak, a lower bound above ``above``, not the peak."""
    peak = 0
    for step in _rank_replays(setup):
        peak = max(peak, step.peak()[1])
        if above is not None and peak > above:
            break
    return peak


def _rank_replays(setup: "Setup") -> Iterator[_RankStep]:
    """Each rank's replay in rank order, as estimate_plan (pipeline_phases) replays them, made as
    it is read (peak_bytes stops at the first rank above its bound); the stages' checks run at the call."""
    d, req = setup.dims, setup.request
    check_framework(setup, req.pp_schedule)
    dp, shard = _data_parallel_group(setup)
    all_stages = _checked_stages(setup, d.pp, req.pp_virtual_stages, req.pp_schedule, dp)
    parallel = data_parallel(setup, dp, shard)
    costs = _StageCosts(setup)
    return (_rank_step(setup, all_stages, rank, d.pp, req.pp_virtual_stages, req.pp_schedule, parallel, costs)
            for rank in range(d.pp))


def _rank_steps(setup: "Setup") -> list[_RankStep]:
    """Every rank's replay, as estimate_plan (pipeline_phases) replays them."""
    return list(_rank_replays(setup))


def worst_rank_phases(setup: "Setup") -> list[tuple[PhaseKind, int]]:
    """(kind, bytes) of each phase of estimate_plan's worst rank without writing them out: every rank
    replayed as pipeline_phases replays them, the worst picked as it picks it (the highest peak, then
    the most resident), its phases' bytes as _RankStep.phase_kinds lists them (a test compares them
    with estimate_plan's phases). The plan search's judgement of an expert-parallel pipeline option
    adds the experts' items per kind to these (orchestrator.expert_pipeline_peak_bytes)."""
    steps = _rank_steps(setup)
    worst = max(range(len(steps)), key=lambda i: (steps[i].peak()[1],
                                                  steps[i].resident_bytes + steps[i].kept_input_grads))
    return steps[worst].phase_kinds()


def replayed_resident_bytes(setup: "Setup") -> int:
    """estimate_plan's resident bytes without writing the phases out: the most any rank keeps between
    steps, its states and buffers and (zero bubble) the input gradients left on its receive buffers,
    as pipeline_phases answers it (a test compares them). Unlike resident_bytes it replays the
    schedule, so it is exact for a split backward too: the expert-parallel floor of the plan search
    (orchestrator.expert_pipeline_resident_bytes)."""
    return max(s.resident_bytes + s.kept_input_grads for s in _rank_steps(setup))


def resident_bytes(setup: "Setup") -> int:
    """What the rank that keeps the most holds between steps (estimate_plan's resident bytes),
    without replaying the schedule: the plan search's memory floor of a pipeline setting."""
    d, req = setup.dims, setup.request
    check_framework(setup, req.pp_schedule)
    dp, shard = _data_parallel_group(setup)
    v = req.pp_virtual_stages
    count = d.pp * v
    _check_stages(setup, d.pp, v, req.pp_schedule)
    activations(setup)  # what the stages' activations refuse (a fused loss's kernel), the estimate refuses
    # a stage's states and receive buffers (stages() without its activations): its parameters, and
    # one boundary per micro-batch received (all but the first stage) and sent (all but the last)
    parameters = [n for n, _ in _stage_parameters(setup.arch, stage_bounds(
        setup.arch.num_layers, count, req.pp_first_stage_layers, req.pp_last_stage_layers))]
    boundary = _boundary_bytes(setup, dp)
    parallel = data_parallel(setup, dp, shard)
    costs = _StageCosts(setup)  # the middle ranks' stages alike: their bits computed once
    out = []
    for rank in range(d.pp):
        mine = rank_stages(req.pp_schedule, d.pp, v, rank)
        params = sum(parameters[i] for i in mine)
        out.append(_resident_bytes(setup, params, boundary * sum(i > 0 for i in mine),
                                   boundary * sum(i < count - 1 for i in mine), parallel, costs.bits(params),
                                   costs.bucket_copy))
    return max(out)


def _data_parallel_group(setup: "Setup") -> tuple[int, int]:
    """(dp, shard) of a stage: FSDP shards (and the gradients are reduced) over dp_shard x cp: the
    cp ranks hold the same weights (torchtitan's dp_shard_cp mesh dimension, parallel_dims.py)."""
    d = setup.dims
    dp = d.dp * d.cp
    return dp, d.dp_shard * d.cp if setup.strategy.shards_optimizer or setup.strategy.shards_parameters else dp


def _checked_stages(setup: "Setup", pp: int, virtual_stages: int, schedule: str, dp: int,
                    acts: Activations | None = None) -> list[Stage]:
    _check_stages(setup, pp, virtual_stages, schedule)
    return stages(setup, pp, virtual_stages, dp, acts)


def _check_stages(setup: "Setup", pp: int, virtual_stages: int, schedule: str) -> None:
    """Refuse a pipeline whose stages the model does not split: no architecture, a traced model,
    what the schedule or the split refuses."""
    a = setup.arch
    if a is None:
        raise PlannerError(f"pp={pp} needs an architecture (its layers are split into stages): give a model, "
                           "not params", field="pp")
    if setup.model.traced is not None:
        raise PlannerError(f"pp={pp}: {setup.model.name} is estimated by tracing; its stages cannot be split",
                           field="pp")
    check_schedule(pp, schedule, virtual_stages, setup.request.gradient_accumulation, a.num_layers)
    check_split_backward(a, schedule)
    check_split(a.num_layers, pp, virtual_stages, setup.request.pp_first_stage_layers,
                setup.request.pp_last_stage_layers)


def check_split_backward(a: Architecture, schedule: str) -> None:
    """The weight-gradient split is modelled for dense blocks with plain attention: the gradients
    it keeps are those of each linear's output (_weight_node_widths); routed experts' and MLA's
    low-rank projections' nodes are not counted, so those models are refused."""
    if not SCHEDULE_SPECS[schedule].splits_backward:
        return
    memo = derived(a)
    if "_pp_split_refused" not in memo:  # the plan asks for every setting of a split schedule
        memo["_pp_split_refused"] = next((spec for spec in layer_specs(a) if spec.mlp.is_moe
                                          or spec.attention.q_lora_rank or spec.attention.kv_lora_rank), None)
    spec = memo["_pp_split_refused"]
    if spec is not None:
        raise PlannerError(f"pp_schedule {schedule} splits the backward into input and weight gradients; the "
                           f"split's held gradients are modelled for dense blocks with plain attention, not "
                           f"{a.model_type}'s {'experts' if spec.mlp.is_moe else 'MLA'}: use 1f1b, interleaved, "
                           "looped-bfs or gpipe", field="pp_schedule")


def pipeline_phases(setup: "Setup", pp: int, virtual_stages: int, schedule: str, dp: int,
                    shard: int | None = None, acts: Activations | None = None) -> tuple["PhasePlan", list[RankMemory]]:
    """The phase plan of the worst rank (highest peak) and a summary of every rank."""
    from planner.memory.phase_plan import PhasePlan

    all_stages = _checked_stages(setup, pp, virtual_stages, schedule, dp, acts)
    parallel = data_parallel(setup, dp, shard)
    ranks: list[RankMemory] = []
    steps = []
    costs = _StageCosts(setup)
    for rank in range(pp):  # every rank replayed in integers; the items are written for the worst
        step = _rank_step(setup, all_stages, rank, pp, virtual_stages, schedule, parallel, costs)
        peak_name, peak_bytes = step.peak()
        # zero bubble: the input gradients on the receive buffers stay until the next step's start
        resident_bytes = step.resident_bytes + step.kept_input_grads
        ranks.append(RankMemory(rank, tuple(s.index for s in step.mine), step.params, resident_bytes,
                                peak_bytes, peak_name, step.in_flight))
        steps.append(step)
    worst = max(range(pp), key=lambda i: (ranks[i].peak_bytes, ranks[i].resident_bytes))
    resident_bytes = ranks[worst].resident_bytes
    resident, phases = rank_phases(setup, all_stages, worst, pp, virtual_stages, schedule, parallel, steps[worst])
    sizes = sorted({s.last_block - s.first_block for s in all_stages})
    uneven = setup.request.pp_first_stage_layers is not None or setup.request.pp_last_stage_layers is not None
    split = (f"first {all_stages[0].last_block} and last {all_stages[-1].last_block - all_stages[-1].first_block}, "
             "the rest even (Megatron's uneven split)") if uneven else "torchtitan's split"
    notes = [f"pipeline: {pp} ranks x {virtual_stages} stage(s) of {'-'.join(map(str, sizes))} "
             f"blocks ({split}), {schedule} schedule, {setup.request.gradient_accumulation} micro-batches; worst rank "
             f"{worst} (stages {', '.join(map(str, ranks[worst].stages))}), bubble "
             f"{bubble_fraction(pp, setup.request.gradient_accumulation, virtual_stages, schedule):.1%} of the step"
             + (" (zero bubble: simulated in units, F = I = W, unverified)" if SCHEDULE_SPECS[schedule].splits_backward
                else "")]
    notes += [f"pipeline rank {r.rank}: stages {list(r.stages)}, {r.parameters:,} parameters, up to {r.in_flight} "
              f"micro-batch chunk(s) in flight, peak {r.peak_bytes:,} B ({r.peak_phase})" for r in ranks]
    buffers = [i for i in resident if i.component == "buffers" and i.bytes > 0]
    # what stays between steps is answered for the rank that keeps the most (uneven stages: a longer
    # stage keeps more states than the rank that peaks highest); its phases stay the worst rank's
    kept = max(ranks, key=lambda r: r.resident_bytes)
    if kept.resident_bytes > resident_bytes:
        notes.append(f"resident: pipeline rank {kept.rank} keeps the most between steps, {kept.resident_bytes:,} B "
                     f"(rank {worst}, which peaks highest, keeps {resident_bytes:,} B)")
        resident_bytes = kept.resident_bytes
    kept_grads = [i for i in phases[-1].items if i.name.startswith("input gradients left") and i.bytes > 0]
    return PhasePlan(phases=phases, resident_bytes=resident_bytes, buffers=buffers, notes=notes,
                     resident=[i for i in resident if i.bytes > 0] + kept_grads), ranks


# --- time --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineTime:
    compute_seconds: float  # one rank's share of the step's compute, stretched by the bubble
    bubble_seconds: float
    p2p_bytes: int  # what one rank sends per step (activations forward, gradients back)
    p2p_seconds: float
    exposed_p2p_seconds: float


def pipeline_time(replica_compute_seconds: float, pp: int, micro_batches: int, virtual_stages: int,
                  boundary_bytes: int, link_gbps: float, latency_us: float = 0.0,
                  slowest: float | None = None, schedule: str = "1f1b") -> PipelineTime:
    """A pipeline step on one rank. ``replica_compute_seconds``: the compute of the step's
    micro-batches through the whole model (one data-parallel replica's work); each rank does
    1/pp of it, and the synchronous schedule idles a bubble of (p-1)/(m*v+p-1) of the step
    (Narayanan et al. 2021, Sec. 2.2). ``boundary_bytes``: one micro-batch's activation at a
    stage boundary (micro_batch x seq x hidden x dtype); every micro-batch crosses each of the
    rank's v stage boundaries forward and its gradient crosses back. The sends of the steady state
    overlap compute; those on the fill and the drain are on the critical path, once per boundary
    of the pp*v - 1 in each direction. ``link_gbps``: the stage link's bandwidth in GB/s (the
    slowest link between consecutive stages: NVLink inside a node, the NIC across nodes).
    ``slowest``: the busiest rank's share of the replica's compute (slowest_share: uneven stages,
    the LM head on the last); every slot of the schedule waits for it, so the step is that rank's
    work stretched by the bubble. Default 1/pp (equal stages). ``schedule``: its bubble
    (ScheduleSpec.bubble: the zero-bubble schedules fill most of it with weight gradients; modelled
    from the papers, not measured); a V-shaped one passes the turn of the V on one rank, not over
    the link."""
    m, v = micro_batches, virtual_stages
    ideal = replica_compute_seconds * (slowest if slowest is not None else 1 / pp)
    fraction = bubble_fraction(pp, m, v, schedule)
    compute = ideal / (1.0 - fraction) if pp > 1 else ideal
    sends = 2 * m * v if pp > 1 else 0
    per_send = boundary_bytes / (link_gbps * 1e9) + latency_us * 1e-6 if link_gbps > 0 else 0.0
    crossings = pp * v - (2 if SCHEDULE_SPECS[schedule].v_shape else 1)
    exposed = 2 * crossings * per_send if pp > 1 else 0.0
    return PipelineTime(compute, compute - ideal, sends * boundary_bytes, sends * per_send, exposed)


def _group_link(topo, gpus: int, stride: int, size: int, nic_gbps: float, link_efficiency: float) -> tuple[float, float]:
    """(GB/s, latency µs) of the slowest link a group of ``size`` ranks ``stride`` apart crosses:
    inside a node, its bottleneck NVLink/PCIe hop (planner/time/collectives.py ring_over); across nodes, the
    node's NICs shared by its GPUs, all of which send at once."""
    if stride * (size - 1) < gpus:
        members = tuple(range(0, stride * size, stride))
        _, bandwidth, latency = timing.ring_over(topo, members)
        return bandwidth * link_efficiency, latency
    return nic_gbps / max(1, gpus), 0.0


def parallel_step(t, setup: "Setup", arch, topo, fabric: dict, nics: int, link_efficiency: float,
                  micro_batch: int | None = None, micro_batches: int | None = None):
    """The step time of one rank with pp and ep (planner/time/step.py estimate_time): the compute
    of its stage stretched by the bubble, and the data-parallel collectives over its stage's
    parameters only (1/pp of them); point-to-point sends between stages (exposed on the fill and
    the drain) and the all-to-alls of expert parallelism (planner/parallel/experts.py: dispatch and combine
    in forward, both again in backward, each MoE block and micro-batch; counted exposed: the
    model overlaps none of them) on the links their groups cross. ``t``: timing.StepTime of the
    replica without pp and ep. ``micro_batch``, ``micro_batches``: the option's size and count of
    micro-batches where they are not the request's (the plan search times a setting's options on
    its one Setup: the request's other fields are every option's; a test compares the two)."""
    d, req = setup.dims, setup.request
    if d.pp == 1 and d.ep == 1:
        return t
    micro_batch = req.micro_batch if micro_batch is None else micro_batch
    micro_batches = req.gradient_accumulation if micro_batches is None else micro_batches
    gpus = req.gpus
    nic_gbps = nics * fabric["gbps"] * fabric["efficiency"] * link_efficiency
    compute, comm, exposed = t.compute_seconds, t.communication_seconds / d.pp, t.exposed_communication_seconds / d.pp
    # the TP collectives and CP exchange a micro-batch leaves exposed run inside its stage's forward and backward:
    # the schedule's bubble stretches them with the compute (1F1B's stage waits on them as on its kernels)
    in_stage = t.term(timing.MODEL_PARALLEL_TERM) if d.pp > 1 else 0.0
    exposed = exposed - in_stage / d.pp
    if d.ep > 1:  # the routed experts ring over the expert-data-parallel group only
        from planner.model.architecture import parameter_numels

        total = sum(parameter_numels(arch))
        share = experts.data_parallel_share(arch, d, total)
        comm, exposed = comm * share, exposed * share
        # the wrapper's copies (FSDP2's copy-out and copy-in) move the rank's parameters: the dense ones and
        # 1/ep of the routed experts, where the replica's term counted them all
        copies = t.term(timing.COPIES_TERM)
        routed = experts.routed_total(arch)
        compute = compute - copies * (routed - routed / d.ep) / max(1, total)
        t = t._replace(compute_seconds=compute)
    b = 4 if setup.recipe.compute == "fp32" else 2
    tokens = micro_batch * req.seq_len
    if d.pp > 1:
        stride = d.world // d.pp  # pp outermost on the mesh (torchtitan ParallelDims)
        gbps, latency = _group_link(topo, gpus, stride, d.pp, nic_gbps, link_efficiency)
        boundary = tokens * arch.hidden_size * b // max(1, d.tp * d.cp)
        share, _ = slowest_share(arch, d.pp, req.pp_virtual_stages, req.seq_len // max(1, d.cp),
                                 req.pp_first_stage_layers, req.pp_last_stage_layers, req.pp_schedule)
        p = pipeline_time(t.compute_seconds + in_stage, d.pp, micro_batches, req.pp_virtual_stages, boundary,
                          gbps, latency, slowest=share, schedule=req.pp_schedule)
        compute = p.compute_seconds
        comm += p.p2p_seconds
        exposed += p.exposed_p2p_seconds
    if d.ep > 1:
        gbps, latency = _group_link(topo, gpus, d.tp, d.ep, nic_gbps, link_efficiency)
        layers = len(experts.moe_blocks(arch))
        sent = experts.all_to_all_bytes_per_step(arch, tokens, b, d.ep, micro_batches,
                                                 checkpointing=req.checkpointing) // d.pp
        seconds = experts.all_to_all_seconds(sent, gbps, d.ep, latency) \
            + experts.all_to_alls_per_block(req.checkpointing) * layers * micro_batches // d.pp \
            * max(0, d.ep - 2) * latency * 1e-6
        comm += seconds
        exposed += seconds
    step = compute + exposed + t.offload_seconds
    # ``t`` counts every rank as a replica of the whole model; a pipeline replica spans pp ranks
    scale = t.step_seconds / step / d.pp
    return t._replace(compute_seconds=compute, communication_seconds=comm, exposed_communication_seconds=exposed,
                      step_seconds=step, tokens_per_second=t.tokens_per_second * scale, mfu=t.mfu * scale,
                      hfu=t.hfu * scale)


def _model_parallel_share(setup: "Setup", rows: list[dict], mine: list[Stage]) -> list[dict]:
    """The rank's stages' share of the TP and CP rows (steptime.model_parallel_collectives, for the
    whole model): per micro-batch, each of its blocks' collectives (tensor_parallel.tp_collectives:
    4, 6 with full checkpointing; the CP K/V exchange once per block), and the vocab-parallel
    embedding's and LM head's where it holds the first or the last stage."""
    layers = setup.arch.num_layers
    per_block = 6 if setup.request.checkpointing == "full" else 4
    blocks = sum(s.last_block - s.first_block for s in mine)
    edges = sum(1 for s in mine if s.is_first) + sum(1 for s in mine if s.is_last)
    share = {"tp": (blocks * per_block + edges, layers * per_block + 2), "cp": (blocks, layers)}
    computes_loss = any(s.is_last for s in mine)
    return [row if row["what"] == LOSS_PARALLEL_ROW else
            dict(row, bytes_per_step=row["bytes_per_step"] * share[row["group"]][0] // share[row["group"]][1])
            for row in rows if row["group"] in share and (row["what"] != LOSS_PARALLEL_ROW or computes_loss)]


def pipeline_volumes(setup: "Setup", data_parallel_rows: list[dict], rank: int = 0) -> list[dict]:
    """What one pipeline rank sends per step, as steptime.collective_volumes lists it.

    Over its data-parallel group, its stages' parameters only: FSDP2 gathers them once per step
    and reduce-scatters the gradients once (pipelining keeps them unsharded across micro-batches,
    stage.py backward_maybe_with_nosync; the counted run: 3 all-gathers and 3 reduce-scatters of
    the stage's units); DDP all-reduces them once; DeepSpeed's rows scaled to the stage's share.
    To its neighbours: each micro-batch's output of every stage it holds but the last (forward),
    and the gradient of every stage's input but the first's (backward)."""
    d, req = setup.dims, setup.request
    m = req.gradient_accumulation
    held = set(rank_stages(req.pp_schedule, d.pp, req.pp_virtual_stages, rank))
    mine = [s for s in stages(setup, d.pp, req.pp_virtual_stages, d.dp) if s.index in held]
    params = sum(s.parameters for s in mine)
    compute = 4 if setup.recipe.compute == "fp32" else 2
    reduce = FP32 if req.reduce_dtype == "fp32" else compute  # FSDP2 reduce-scatters in its reduce dtype
    rows: list[dict] = []
    if d.dp > 1 and not setup.framework.own_pipeline_engine:  # DDP / FSDP2 per stage
        if setup.strategy.shards_parameters:
            rows += [{"what": "parameter all-gathers", "bytes_per_step": compute * params, "message_bytes":
                      compute * max(s.parameters for s in mine), "group": "shard"},
                     {"what": "gradient reduce-scatter", "bytes_per_step": reduce * params, "message_bytes":
                      reduce * max(s.parameters for s in mine), "group": "shard"}]
        else:
            rows.append({"what": "gradient all-reduce", "bytes_per_step": 4 * params, "message_bytes": 4 * params,
                         "group": "world"})
    elif d.dp > 1:
        rows += [dict(row, bytes_per_step=row["bytes_per_step"] // d.pp) for row in data_parallel_rows
                 if row["group"] not in ("tp", "cp")]
    rows += _model_parallel_share(setup, data_parallel_rows, mine)
    # a V's turn (stages pp-1 and pp on the last rank) is passed by a call, not sent (stage.py set_local_fwd_input)
    forward = sum(s.output_bytes for s in mine if s.index + 1 not in held)
    backward = sum(s.input_bytes for s in mine if s.index - 1 not in held)
    if forward:
        rows.append({"what": "send activations (p2p)", "bytes_per_step": m * forward,
                     "message_bytes": mine[0].output_bytes or mine[-1].output_bytes, "group": "pp"})
    if backward:
        rows.append({"what": "send gradients (p2p)", "bytes_per_step": m * backward,
                     "message_bytes": mine[-1].input_bytes or mine[0].input_bytes, "group": "pp"})
    return rows
