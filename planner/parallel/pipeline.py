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

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

from planner.model.activations import FP32, Activations
from planner.model.architecture import Architecture, block_numels, block_parameters, derived, layer_specs, norm_numels
from planner.model.attention.kinds import kind_of
from planner.memory.buffers import item, phase
from planner.memory.optimizer import step_temporaries
from planner.model.shapes import vectors
from planner.recipes.optimizers import OPTIMIZERS
from planner.errors import PlannerError
from planner.model.layers import routed_inactive_numels
from planner.memory.moments import PhaseKind
from planner.memory.rank_activations import activations
from planner.schema import MemoryItem, Phase
from planner.parallel.stages import stage_bounds

if TYPE_CHECKING:
    from planner.memory.buffers import PhasePlan
    from planner.setup import Setup

Schedule = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "gpipe")


@dataclass(frozen=True)
class Action:
    stage: int
    kind: Literal["F", "B"]
    micro_batch: int


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The idle share of a synchronous pipeline step: (p-1) / (m*v + p-1) (Narayanan et al. 2021)."""
    return (pp - 1) / (micro_batches * virtual_stages + pp - 1)


def check_schedule(pp: int, schedule: str, virtual_stages: int, micro_batches: int, num_layers: int) -> None:
    """Refuse what torch 2.13's schedules refuse, and a layer count the stages do not divide."""
    if schedule not in SCHEDULES:
        raise PlannerError(f"pp_schedule({schedule!r}) is unknown; choose one of {', '.join(SCHEDULES)}",
                           field="pp_schedule")
    if schedule != "interleaved" and virtual_stages != 1:
        raise PlannerError(f"pp_virtual_stages({virtual_stages}) needs pp_schedule interleaved, got {schedule}",
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
    if schedule == "interleaved":
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            # ScheduleInterleaved1F1B.__init__: micro-batches a multiple of the rounds
            raise PlannerError(f"gradient_accumulation({micro_batches}) micro-batches must be a multiple of "
                               f"max(1, gradient_accumulation // pp({pp})) = {rounds} for pp_schedule interleaved "
                               "(torch's ScheduleInterleaved1F1B)", field="gradient_accumulation")


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
    # ScheduleInterleaved1F1B._calculate_single_rank_operations
    v = virtual_stages
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v
    fwd_bwd = total - warmup

    def forward_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    counts_f: dict[int, int] = {}
    counts_b: dict[int, int] = {}
    out = []

    def push(kind: str, stage: int) -> None:
        counts = counts_f if kind == "F" else counts_b
        out.append(Action(stage, kind, counts.get(stage, 0)))
        counts[stage] = counts.get(stage, 0) + 1

    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup:
            push("F", forward_stage(op))
        elif op < warmup + fwd_bwd:
            push("F", forward_stage(op))
            push("B", backward_stage(op))
        else:
            push("B", backward_stage(op))
    return out


@lru_cache(maxsize=4096)
def _rank_ops(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> tuple[tuple[int, bool, int], ...]:
    """rank_actions as (local stage: the rank's k-th, forward, micro-batch), for the replay."""
    return tuple(((a.stage - rank) // pp, a.kind == "F", a.micro_batch)
                 for a in _rank_actions(schedule, pp, virtual_stages, micro_batches, rank))


def max_in_flight(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> int:
    """Micro-batch chunks whose activations a rank holds at once (gpipe: m; 1f1b: min(pp - rank, m);
    interleaved: its warm-up plus one, at most m x v)."""
    live = peak = 0
    for action in _rank_actions(schedule, pp, virtual_stages, micro_batches, rank):
        live += 1 if action.kind == "F" else -1
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
                  last: int | None = None) -> tuple[float, int]:
    """(share of a replica's compute on its busiest rank, that rank): the pace of the pipeline,
    since every rank waits for the slowest stage at each step of the schedule."""
    cache = derived(a).setdefault("_pp_slowest", {})  # asked once per option by the plan search
    key = (pp, virtual_stages, seq_len, first, last)
    if key not in cache:
        cache[key] = _slowest_share(a, pp, virtual_stages, seq_len, first, last)
    return cache[key]


def _slowest_share(a: Architecture, pp: int, virtual_stages: int, seq_len: int, first: int | None,
                   last: int | None) -> tuple[float, int]:
    per_stage = stage_flops(a, stage_bounds(a.num_layers, pp * virtual_stages, first, last), seq_len)
    per_rank = [sum(per_stage[r::pp]) for r in range(pp)]
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


def _block_largest(a: Architecture) -> list[int]:
    """Each block's largest parameter tensor (once per architecture: the plan cuts it many times)."""
    memo = derived(a)
    if memo.get("_pp_block_largest") is None:
        memo["_pp_block_largest"] = [max(numels) for numels in block_numels(a)]
    return memo["_pp_block_largest"]


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
    acts = acts if acts is not None else activations(setup)  # the caller's, where it has them (estimate_plan)
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
    specs = layer_specs(a)
    sums, largest = block_parameters(a), _block_largest(a)
    boundary = stream * tokens * h // sp
    head = vocab * h  # the last stage's own copy when the embedding is tied (torchtitan unties)
    out = []
    for index in range(count):
        first, last = bounds[index]
        is_first, is_last = index == 0, index == count - 1
        tensors = [sum(sums[first:last])] if first < last else []  # the blocks' sum, then the edges' tensors
        biggest = max(largest[first:last], default=0)
        if is_first:
            tensors += [vocab * h] + ([a.learned_positions * h] if a.learned_positions else [])
        if is_last:
            tensors += norm_numels(a.norm, h) + [head]
        edge = max(tensors[1:] if first < last else tensors, default=0)
        kept = acts.block_kept(first, last) + edges.rope_saved
        if autocast:
            kept += sum(_autocast_fp32_stream_extra(specs[i]) for i in range(first, last)) * tokens * h
            # torch.autocast casts each linear's weight once per forward and clears its cache when
            # the context exits (torch/amp/autocast_mode.py __exit__): every micro-batch's forward
            # makes its own 16-bit copies, which its graph saves until its backward
            linear = sum(n for block in block_numels(a)[first:last] for n in block if n > h) + (head if is_last else 0)
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
        out.append(Stage(index, first, last, is_first, is_last, sum(tensors), max(biggest, edge), kept,
                         0 if is_last else boundary, 0 if is_first else boundary, transient))
    return out


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


def _resident(setup: "Setup", mine: list[Stage], dp: DataParallel) -> list[MemoryItem]:
    """What a rank holding these stages keeps between steps: its states and receive buffers."""
    from planner.recipes.precision import bits_to_bytes

    m = setup.request.gradient_accumulation
    params = sum(s.parameters for s in mine)
    weight_bits, grad_bits, states_bits = _bits(setup, params)
    weights = bits_to_bytes(_ceil(params, dp.shard) if dp.shards_parameters else params, weight_bits)
    optim = bits_to_bytes(_ceil(params, dp.shard) if dp.shards_optimizer else params, states_bits)
    recv = m * sum(s.input_bytes for s in mine)
    grad_recv = m * sum(s.output_bytes for s in mine)
    where = f"stages {', '.join(str(s.index) for s in mine)}" if len(mine) > 1 else f"stage {mine[0].index}"
    resident = [
        _item(f"parameters ({where}, {params:,} elements)", weights, "parameters"),
        _item(f"optimizer states ({where})", optim, "optimizer_states"),
        _item(f"activation receive buffers ({m} micro-batches)", recv, "buffers",
              "torch pipelining stage.py _setup_forward_recv_info: one buffer per micro-batch"),
        _item(f"gradient receive buffers ({m} micro-batches)", grad_recv, "buffers",
              "torch pipelining stage.py _create_grad_recv_info: one buffer per micro-batch"),
    ]
    if setup.framework.gradient_bucket_copy(setup.strategy) and dp.dp > 1:
        resident.append(_item("DDP gradient buckets (a copy of the gradients)", grad_bits // 8 * params, "buffers",
                              "torch DDP Reducer, gradient_as_bucket_view=False"))
    return resident


@dataclass(frozen=True)
class _RankStep:
    """One rank's step replayed in integers: what rank_phases writes out as items, for the rank
    whose peak is the pipeline's (the others' are summed only: RankMemory)."""

    mine: tuple[Stage, ...]
    params: int
    resident: tuple[MemoryItem, ...]
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

    def phase_bytes(self) -> list[tuple[str, int]]:
        """(name, bytes) of each phase, in rank_phases' order."""
        out = []
        for name, (total, (_, live, _, _)) in self.worst.items():
            out.append((name if name.startswith("embedding") else
                        f"{name}, {sum(live)} micro-batches in flight", total))
        return out + [(name, total) for _, name, total in self.after]


def _rank_step(setup: "Setup", all_stages: list[Stage], rank: int, pp: int, virtual_stages: int,
               schedule: str, dp: DataParallel) -> _RankStep:
    r, req = setup.recipe, setup.request
    m = req.gradient_accumulation
    mine = tuple(all_stages[rank + k * pp] for k in range(virtual_stages))
    params = sum(s.parameters for s in mine)
    largest = max(s.largest_tensor for s in mine)
    compute = 4 if r.compute == "fp32" else 2
    grad_bits = _bits(setup, params)[1]
    resident = tuple(_resident(setup, list(mine), dp))
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
    resident_bytes = sum(i.bytes for i in resident)
    base = resident_bytes + gathered
    # The moments are replayed in integers; a phase's items are built only for each kind's worst
    # moment (the search estimates pipelines of hundreds of micro-batches). Sends whose work the
    # schedule waits for only at the step's end keep their tensors (``held``): ScheduleGPipe its
    # backward sends (bwd_sends_to_wait), the interleaved runtime every send (send_ops, waited in
    # _PipelineScheduleRuntime._step_microbatches after the last action); Schedule1F1B waits for
    # each with the next receive.
    live = [0] * virtual_stages  # micro-batches in flight per local stage
    done = [False] * virtual_stages  # local stages with gradients
    sent = [(s.input_bytes + (s.output_bytes if schedule == "interleaved" else 0)) if schedule != "1f1b" else 0
            for s in mine]  # the gradient of the stage's input sent back; interleaved also its output
    worst: dict[str, tuple[int, tuple]] = {}
    held = grads = acts = count = most = 0
    for k, forward, micro_batch in _rank_ops(schedule, pp, virtual_stages, m, rank):
        stage = mine[k]
        if forward:
            live[k] += 1
            acts += stage.activation_bytes
            count += 1
            if count > most:
                most = count
            continue
        name = "loss backward" if stage.is_last else "stage backward"
        total = base + grads + acts + held + stage.transient_bytes
        if name not in worst or total > worst[name][0]:
            worst[name] = (total, (stage, tuple(live), tuple(done), held))
        live[k] -= 1
        acts -= stage.activation_bytes
        count -= 1
        if not done[k]:
            done[k] = True
            grads += grad_bytes_per * stage.parameters
        held += sent[k]
        if stage.is_first and micro_batch > 0:
            # embedding_dense_backward's fresh V x h gradient, added into the accumulated one
            name = "embedding backward (first stage)"
            total = base + grads + acts + held + fresh_bytes_per * stage.largest_tensor
            if name not in worst or total > worst[name][0]:
                worst[name] = (total, (stage, tuple(live), tuple(done), held))
    # After the schedule: the reduction of the gradients over dp, and the optimizer step.
    after = []
    if dp.shards_parameters:
        after.append((PhaseKind.GRADIENT_ALLREDUCE, "gradient reduce-scatter over dp",
                      base + reduce * params + reduce * _largest_unit(setup, mine)
                      + grad_bits // 8 * _ceil(params, dp.shard)))
    after.append((PhaseKind.OPTIMIZER_STEP, "optimizer step",
                  resident_bytes + grad_bits // 8 * (_ceil(params, dp.shard) if dp.shards_gradients else params)
                  + _step_temporaries(setup, largest, params, dp)))
    return _RankStep(mine, params, resident, compute, reduce, grad_bytes_per, fresh_bytes_per, gathered, worst,
                     tuple(after), most)


def _largest_unit(setup: "Setup", mine: tuple[Stage, ...]) -> int:
    """Elements of the stage's largest FSDP unit: a block, or what the stage holds beside its
    blocks (the embedding, the final norm and the head)."""
    blocks = block_parameters(setup.arch)
    units = [n for s in mine for n in blocks[s.first_block:s.last_block]]
    units += [s.parameters - sum(blocks[s.first_block:s.last_block]) for s in mine]
    return max(units)


def _step_temporaries(setup: "Setup", largest: int, params: int, dp: DataParallel) -> int:
    """The optimizer step's temporaries over the stage: its largest tensor (a single-tensor step's)
    and the rest of the stage's (a foreach step's), as the strategies without a pipeline count them."""
    biggest = _ceil(largest, dp.shard) if dp.shards_optimizer else largest
    stepped = _ceil(params, dp.shard) if dp.shards_optimizer else params
    return step_temporaries(setup, vectors([biggest] + ([stepped - biggest] if stepped > biggest else [])),
                            _bits(setup, params)[0])


def rank_phases(setup: "Setup", all_stages: list[Stage], rank: int, pp: int, virtual_stages: int,
                schedule: str, dp: DataParallel, step: _RankStep | None = None) -> tuple[list[MemoryItem], list[Phase]]:
    """(what stays between steps, the phases a step can peak at) on one rank; ``step``: its
    replay, where the caller has it."""
    st = step or _rank_step(setup, all_stages, rank, pp, virtual_stages, schedule, dp)
    mine, params, resident = st.mine, st.params, list(st.resident)
    grad_bits = _bits(setup, params)[1]
    gathered = (_item("unsharded parameters of the stage (FSDP2, kept for every micro-batch)", st.gathered_bytes,
                      "buffers", "pipelining/stage.py backward_maybe_with_nosync")
                if dp.shards_parameters else _item("", 0, "buffers"))

    def grads_item(stages_done: tuple[bool, ...]) -> MemoryItem:
        elements = sum(s.parameters for s, has in zip(mine, stages_done) if has)
        return _item(f"gradients of {sum(stages_done)} of {len(mine)} local stage(s)", st.grad_bytes_per * elements,
                     "gradients")

    def acts_item(in_flight: tuple[int, ...]) -> MemoryItem:
        return _item(f"activations of {sum(in_flight)} micro-batch chunk(s) in flight",
                     sum(s.activation_bytes * n for s, n in zip(mine, in_flight)), "activations",
                     f"{schedule} schedule, torch 2.13 pipelining/schedules.py")

    def held_item(nbytes: int) -> MemoryItem:
        return _item("sent tensors held until the step ends (p2p works not yet waited)", nbytes, "buffers",
                     "torch 2.13 pipelining/schedules.py: send works waited after the last action")

    phases: list[Phase] = []
    for name, (_, (stage, in_flight, stages_done, held_bytes)) in st.worst.items():
        common = resident + [gathered, grads_item(stages_done), acts_item(in_flight), held_item(held_bytes)]
        if name.startswith("embedding"):
            phases.append(_phase(PhaseKind.END_OF_BACKWARD, name, common + [
                _item("embedding gradient being accumulated", st.fresh_bytes_per * stage.largest_tensor,
                      "gradients")]))
        else:
            kind = PhaseKind.START_OF_BACKWARD if stage.is_last else PhaseKind.START_OF_BLOCK
            phases.append(_phase(kind, f"{name}, {sum(in_flight)} micro-batches in flight",
                                 common + [_item("backward transient", stage.transient_bytes, "activations")]))
    grads_full = grad_bits // 8 * (_ceil(params, dp.shard) if dp.shards_gradients else params)
    step_items = resident + [_item("gradients", grads_full, "gradients")]
    if dp.shards_parameters:
        # foreach_reduce (_fsdp_collectives.py:597-606) copies one unit's accumulated gradients into a
        # flat reduce-scatter input of the reduce dtype before it frees them
        grads_during = _item("unsharded gradients, accumulated over micro-batches (FSDP2"
                             + (", fp32 reduce dtype)" if st.reduce != st.compute else ")"), st.reduce * params,
                             "gradients", "reduce-scattered once, at perform_reduce_grad")
        reduce_items = resident + [gathered, grads_during,
                                   _item("reduce-scatter input of one unit", st.reduce * _largest_unit(setup, mine),
                                         "buffers", "foreach_reduce: one flat input per unit, in the reduce dtype"),
                                   _item("sharded gradients (reduce-scatter output)",
                                         grad_bits // 8 * _ceil(params, dp.shard), "gradients")]
        phases.append(_phase(PhaseKind.GRADIENT_ALLREDUCE, "gradient reduce-scatter over dp", reduce_items))
    step_items.append(_item("optimizer step temporaries",
                            _step_temporaries(setup, max(s.largest_tensor for s in mine), params, dp), "buffers",
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


def resident_bytes(setup: "Setup") -> int:
    """What the rank that keeps the most holds between steps (estimate_plan's resident bytes),
    without replaying the schedule: the plan search's memory floor of a pipeline setting."""
    d, req = setup.dims, setup.request
    check_framework(setup, req.pp_schedule)
    dp, shard = _data_parallel_group(setup)
    all_stages = _checked_stages(setup, d.pp, req.pp_virtual_stages, req.pp_schedule, dp)
    parallel = data_parallel(setup, dp, shard)
    v = req.pp_virtual_stages
    return max(sum(i.bytes for i in _resident(setup, [all_stages[rank + k * d.pp] for k in range(v)], parallel))
               for rank in range(d.pp))


def _data_parallel_group(setup: "Setup") -> tuple[int, int]:
    """(dp, shard) of a stage: FSDP shards (and the gradients are reduced) over dp_shard x cp: the
    cp ranks hold the same weights (torchtitan's dp_shard_cp mesh dimension, parallel_dims.py)."""
    d = setup.dims
    dp = d.dp * d.cp
    return dp, d.dp_shard * d.cp if setup.strategy.shards_optimizer or setup.strategy.shards_parameters else dp


def _checked_stages(setup: "Setup", pp: int, virtual_stages: int, schedule: str, dp: int,
                    acts: Activations | None = None) -> list[Stage]:
    a = setup.arch
    if a is None:
        raise PlannerError(f"pp={pp} needs an architecture (its layers are split into stages): give a model, "
                           "not params", field="pp")
    if setup.model.traced is not None:
        raise PlannerError(f"pp={pp}: {setup.model.name} is estimated by tracing; its stages cannot be split",
                           field="pp")
    check_schedule(pp, schedule, virtual_stages, setup.request.gradient_accumulation, a.num_layers)
    check_split(a.num_layers, pp, virtual_stages, setup.request.pp_first_stage_layers,
                setup.request.pp_last_stage_layers)
    return stages(setup, pp, virtual_stages, dp, acts)


def pipeline_phases(setup: "Setup", pp: int, virtual_stages: int, schedule: str, dp: int,
                    shard: int | None = None, acts: Activations | None = None) -> tuple["PhasePlan", list[RankMemory]]:
    """The phase plan of the worst rank (highest peak) and a summary of every rank."""
    from planner.memory.buffers import PhasePlan

    all_stages = _checked_stages(setup, pp, virtual_stages, schedule, dp, acts)
    parallel = data_parallel(setup, dp, shard)
    ranks: list[RankMemory] = []
    steps = []
    for rank in range(pp):  # every rank replayed in integers; the items are written for the worst
        step = _rank_step(setup, all_stages, rank, pp, virtual_stages, schedule, parallel)
        peak_name, peak_bytes = max(step.phase_bytes(), key=lambda p: p[1])
        resident_bytes = sum(i.bytes for i in step.resident)
        mine = tuple(rank + k * pp for k in range(virtual_stages))
        ranks.append(RankMemory(rank, mine, sum(all_stages[i].parameters for i in mine), resident_bytes,
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
             f"{bubble_fraction(pp, setup.request.gradient_accumulation, virtual_stages):.1%} of the step"]
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
    return PhasePlan(phases=phases, resident_bytes=resident_bytes, buffers=buffers, notes=notes,
                     resident=[i for i in resident if i.bytes > 0]), ranks


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
                  slowest: float | None = None) -> PipelineTime:
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
    work stretched by the bubble. Default 1/pp (equal stages)."""
    m, v = micro_batches, virtual_stages
    ideal = replica_compute_seconds * (slowest if slowest is not None else 1 / pp)
    fraction = bubble_fraction(pp, m, v)
    compute = ideal / (1.0 - fraction) if pp > 1 else ideal
    sends = 2 * m * v if pp > 1 else 0
    per_send = boundary_bytes / (link_gbps * 1e9) + latency_us * 1e-6 if link_gbps > 0 else 0.0
    exposed = 2 * (pp * v - 1) * per_send if pp > 1 else 0.0
    return PipelineTime(compute, compute - ideal, sends * boundary_bytes, sends * per_send, exposed)


def _group_link(topo, gpus: int, stride: int, size: int, nic_gbps: float, link_efficiency: float) -> tuple[float, float]:
    """(GB/s, latency µs) of the slowest link a group of ``size`` ranks ``stride`` apart crosses:
    inside a node, its bottleneck NVLink/PCIe hop (planner/time/collectives.py ring_over); across nodes, the
    node's NICs shared by its GPUs, all of which send at once."""
    from planner.time import collectives as timing

    if stride * (size - 1) < gpus:
        members = tuple(range(0, stride * size, stride))
        _, bandwidth, latency = timing.ring_over(topo, members)
        return bandwidth * link_efficiency, latency
    return nic_gbps / max(1, gpus), 0.0


def parallel_step(t, setup: "Setup", arch, topo, fabric: dict, nics: int, link_efficiency: float):
    """The step time of one rank with pp and ep (planner/time/step.py estimate_time): the compute
    of its stage stretched by the bubble, and the data-parallel collectives over its stage's
    parameters only (1/pp of them); point-to-point sends between stages (exposed on the fill and
    the drain) and the all-to-alls of expert parallelism (planner/parallel/experts.py: dispatch and combine
    in forward, both again in backward, each MoE block and micro-batch; counted exposed: the
    model overlaps none of them) on the links their groups cross. ``t``: timing.StepTime of the
    replica without pp and ep."""
    from planner.parallel import experts

    d, req = setup.dims, setup.request
    if d.pp == 1 and d.ep == 1:
        return t
    gpus = req.gpus
    nic_gbps = nics * fabric["gbps"] * fabric["efficiency"] * link_efficiency
    compute, comm, exposed = t.compute_seconds, t.communication_seconds / d.pp, t.exposed_communication_seconds / d.pp
    if d.ep > 1:  # the routed experts ring over the expert-data-parallel group only
        from planner.model.architecture import parameter_numels

        share = experts.data_parallel_share(arch, d, sum(parameter_numels(arch)))
        comm, exposed = comm * share, exposed * share
    b = 4 if setup.recipe.compute == "fp32" else 2
    tokens = req.micro_batch * req.seq_len
    if d.pp > 1:
        stride = d.world // d.pp  # pp outermost on the mesh (torchtitan ParallelDims)
        gbps, latency = _group_link(topo, gpus, stride, d.pp, nic_gbps, link_efficiency)
        boundary = tokens * arch.hidden_size * b // max(1, d.tp * d.cp)
        share, _ = slowest_share(arch, d.pp, req.pp_virtual_stages, req.seq_len // max(1, d.cp),
                                 req.pp_first_stage_layers, req.pp_last_stage_layers)
        p = pipeline_time(t.compute_seconds, d.pp, req.gradient_accumulation, req.pp_virtual_stages, boundary,
                          gbps, latency, slowest=share)
        compute = p.compute_seconds
        comm += p.p2p_seconds
        exposed += p.exposed_p2p_seconds
    if d.ep > 1:
        gbps, latency = _group_link(topo, gpus, d.tp, d.ep, nic_gbps, link_efficiency)
        layers = len(experts.moe_blocks(arch))
        sent = experts.all_to_all_bytes_per_step(arch, tokens, b, d.ep, req.gradient_accumulation,
                                                 checkpointing=req.checkpointing) // d.pp
        seconds = experts.all_to_all_seconds(sent, gbps, d.ep, latency) \
            + experts.all_to_alls_per_block(req.checkpointing) * layers * req.gradient_accumulation // d.pp \
            * max(0, d.ep - 2) * latency * 1e-6
        comm += seconds
        exposed += seconds
    step = compute + exposed + t.offload_seconds
    # ``t`` counts every rank as a replica of the whole model; a pipeline replica spans pp ranks
    scale = t.step_seconds / step / d.pp
    return t._replace(compute_seconds=compute, communication_seconds=comm, exposed_communication_seconds=exposed,
                      step_seconds=step, tokens_per_second=t.tokens_per_second * scale, mfu=t.mfu * scale)


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
    return [dict(row, bytes_per_step=row["bytes_per_step"] * share[row["group"]][0] // share[row["group"]][1])
            for row in rows if row["group"] in share]


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
    mine = [s for s in stages(setup, d.pp, req.pp_virtual_stages, d.dp) if s.index % d.pp == rank]
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
    forward = sum(s.output_bytes for s in mine)
    backward = sum(s.input_bytes for s in mine)
    if forward:
        rows.append({"what": "send activations (p2p)", "bytes_per_step": m * forward,
                     "message_bytes": mine[0].output_bytes or mine[-1].output_bytes, "group": "pp"})
    if backward:
        rows.append({"what": "send gradients (p2p)", "bytes_per_step": m * backward,
                     "message_bytes": mine[-1].input_bytes or mine[0].input_bytes, "group": "pp"})
    return rows
