"""What each framework really holds, phase by phase: the textbook states plus its buffers.

Every buffer term names the source that allocates it. The DeepSpeed terms were read from
DeepSpeed 0.19.8 (deepspeed/runtime/...) and confirmed allocation by allocation with the
verification backend's peak trace (``backend.train.live_at``); the torch terms from torch 2.13.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.activations import Activations
from planner.architecture import block_parameters, blocks_parameters, layer_parameters, vision_parameters
from planner.schema import MemoryItem, Phase

if TYPE_CHECKING:
    from planner.architecture import Architecture
    from planner.memory import Setup

FP32 = 4
# engine.py, buffered_allreduce_fallback(elements_per_buffer=500000000): ZeRO-0 all-reduces the
# gradients through flat copies of at most this many elements.
DS_ALLREDUCE_FALLBACK_ELEMENTS = 500_000_000
# torch DDP's default bucket_cap_mb (torch/nn/parallel/distributed.py).
DDP_BUCKET_CAP_BYTES = 25 * 2**20


@dataclass
class PhasePlan:
    phases: list[Phase]
    resident_bytes: int
    buffers: list[MemoryItem]
    notes: list[str] = field(default_factory=list)
    resident: list[MemoryItem] = field(default_factory=list)  # what is held between steps
    host_resident_bytes: int = 0
    host_peak_bytes: int = 0
    host_pinned_bytes: int = 0
    nvme_bytes: int = 0


def _item(name: str, nbytes: int, component: str, source: str = "") -> MemoryItem:
    return MemoryItem(name=name, bytes=int(nbytes), component=component, source=source)


def _phase(name: str, items: list[MemoryItem]) -> Phase:
    kept = [i for i in items if i.bytes > 0]
    return Phase(name=name, bytes=sum(i.bytes for i in kept), items=kept)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- the backward sweep ----------------------------------------------------------------------

@dataclass(frozen=True)
class SweepPoint:
    label: str
    activation_bytes: int
    grad_elements: int  # gradient elements produced so far
    in_flight_elements: int  # of which produced since the last block boundary (not yet reduced)
    transient_bytes: int
    # A tied LM head's contribution to the embedding weight's gradient (counted in grad_elements),
    # held by autograd until the embedding's own arrives: no parameter hook has seen it yet.
    held_elements: int = 0
    # At the embedding's backward, the two tied contributions live while autograd sums them.
    tied_sum_elements: int = 0


@dataclass(frozen=True)
class Layout:
    """What the backward sweep needs of a model's blocks, from its Architecture or from a profile
    traced outside the core (catalogue.TracedProfile): the one place either is read."""

    num_layers: int
    layer_parameters: int  # one block's (the per-block step of the sweep)
    blocks_parameters: int  # all blocks together
    late_parameters: int  # gradients produced after the last block: the untied input embeddings
    lm_head_elements: int  # vocab x hidden, the LM head's matmul (tied or not)
    tied_head_elements: int = 0  # the LM head's gradient contribution to a tied embedding (_tied_head_elements)
    # The biggest block, which FSDP gathers, prefetches and autocast recasts as one unit: in a
    # mixed stack (dense then MoE, MoE every other layer) it exceeds the mean block.
    largest_block_parameters: int = 0


def layout(setup: "Setup") -> Layout | None:
    traced = setup.model.traced
    if traced is not None:
        return Layout(traced.num_layers, traced.layer_parameters, traced.blocks_parameters,
                      traced.late_parameters, traced.lm_head_elements, traced.tied_head_elements,
                      traced.largest_block_parameters)
    arch = setup.arch
    if arch is None:
        return None
    if setup.finetune is not None:  # only adapters make gradients (planner/finetune.py)
        from planner.finetune import layout_fields

        return Layout(**layout_fields(arch, setup.finetune))
    # Backward meets the input embeddings last; a tied head's gradient is the embedding's,
    # allocated at the head.
    embedding = arch.vocab_size * arch.hidden_size + arch.learned_positions * arch.hidden_size
    # include_vision: the vision tower and projector run before the decoder on an image batch, so
    # their gradients come last, with the embeddings' (on a text batch they get none: counting them
    # here is the bound). They are no block: FSDP wraps them with the root (psi - blocks).
    late = (0 if arch.tie_word_embeddings else embedding) + vision_parameters(arch)
    return Layout(arch.num_layers, layer_parameters(arch), blocks_parameters(arch),
                  late, arch.vocab_size * arch.hidden_size,
                  _tied_head_elements(arch), max(block_parameters(arch)))


def _tied_head_elements(arch: "Architecture") -> int:
    """Elements of the LM head's contribution to a tied embedding weight's gradient.

    The tied weight is one leaf used twice, so autograd gives it one AccumulateGrad node and
    sums both contributions in that node's input buffer before running it (torch 2.13,
    torch/csrc/autograd/input_buffer.cpp, InputBuffer::add): the LM head's V x h gradient waits
    there from the head's backward to the embedding's, at the very end, where the embedding's
    dense gradient (embedding_dense_backward) and their out-of-place sum are made. Only then
    does the parameter's post-accumulate hook run (ZeRO's reduction, DDP's bucket copy).
    Measured with the backend's peak trace on ZeRO-2 (qwen2 fp32, gpt2 bf16, exact): three V x h
    tensors live at the embedding's backward, and the head's contribution unreduced through
    every block; on ZeRO-1 (qwen2 fp32, exact) the same sum, with every gradient and the bucket
    live, before the reduction; on FSDP2 (qwen2 fp32 and bf16, exact) the same sum, beside the
    root's unsharded gradients. ZeRO-3 and DDP were within 3% without the term and do not use it."""
    return arch.vocab_size * arch.hidden_size if arch.tie_word_embeddings else 0


def _head_and_late(shape: Layout, numels: list[int]) -> tuple[int, int]:
    """(gradient elements backward produces before the first block: LM head and final norm;
    those it produces after the last block: the untied input embeddings)."""
    return sum(numels) - shape.blocks_parameters - shape.late_parameters, shape.late_parameters


def backward_sweep(acts: Activations | None, numels: list[int], shape: Layout | None) -> list[SweepPoint]:
    """Live activations and produced gradients at each moment of the backward pass where the
    live total can peak: the loss, after the LM head, the start and the end of every block (last
    to first), and the end. A block's saved activations are freed by the end of its backward,
    and its parameters' gradients exist from then on."""
    total = sum(numels)
    if acts is None or shape is None:
        return [SweepPoint("backward", 0, total, max(numels), 0)]
    per_layer = shape.layer_parameters
    head, late = _head_and_late(shape, numels)
    held = shape.tied_head_elements
    body = acts.saved_bytes - acts.head_saved_bytes
    points = [SweepPoint("start of backward", acts.saved_bytes, 0, 0, acts.loss_transient_bytes),
              SweepPoint("after the LM head", body, head, head, 0)]
    recompute = acts.layer_saved_bytes if acts.checkpointed else 0
    # Live activations fall and produced gradients rise linearly with the block index, so every
    # phase total is linear in it and its maximum is at the first or the last block: the blocks
    # between can never be the peak and are not listed.
    for index in sorted({0, shape.num_layers - 1}):
        block = shape.num_layers - index
        live = body - index * acts.layer_kept_bytes
        produced = head + index * per_layer
        points.append(SweepPoint(f"start of block {block} backward", live + recompute, produced,
                                 0, acts.layer_transient_bytes, held_elements=held))
        points.append(SweepPoint(f"end of block {block} backward", live - acts.layer_kept_bytes,
                                 produced + per_layer, per_layer, 0, held_elements=held))
    # The embeddings' backward comes last: an untied embedding's gradient awaits its hook, or a
    # tied weight's two contributions live while autograd sums them.
    points.append(SweepPoint("end of backward", 0, total, late or per_layer, 0, held_elements=held,
                             tied_sum_elements=2 * held))
    return points


# --- DeepSpeed -------------------------------------------------------------------------------

def _adam_temporaries(elements: int, setup: "Setup") -> int:
    """Temporaries of the optimizer step over ``elements`` (one tensor, or the largest one).

    CPU ranks step with torch.optim.AdamW's single-tensor path, which allocates
    exp_avg_sq.sqrt() and its division by the bias correction before the in-place add: two fp32
    tensors of the parameter's size (torch/optim/adam.py, _single_tensor_adam). On CUDA,
    DeepSpeed steps with FusedAdam (multi_tensor_apply, no temporaries) and torch with the
    foreach path, whose _foreach_sqrt makes one fp32 copy of the group's exp_avg_sq. SGD
    allocates none worth counting."""
    if not setup.request.optimizer.startswith("adamw"):
        return 0
    if setup.device == "cpu":
        return 2 * FP32 * elements
    return 0 if setup.strategy.framework == "deepspeed" else FP32 * elements


def _optimizer_items(setup: "Setup", elements: int, where: str) -> list[MemoryItem]:
    from planner.precision import bits_to_bytes, optimizer_state_bits

    items = []
    if setup.zero.offload_optimizer == "none":
        items.append(_item(f"fp32 master weights ({where})", FP32 * elements, "optimizer_states",
                           "ZeRO paper Sec. 3.1; DeepSpeed keeps an fp32 copy even for fp32 training"))
        items.append(_item(f"{setup.request.optimizer} states ({where})",
                           bits_to_bytes(elements, optimizer_state_bits(setup.request.optimizer)),
                           "optimizer_states", "exp_avg and exp_avg_sq"))
    return items


def _activation_items(point: SweepPoint) -> list[MemoryItem]:
    return [
        _item("saved activations", point.activation_bytes, "activations"),
        _item("backward transients", point.transient_bytes, "activations",
              "gradients of the loss (2 x fp32 tokens x vocab) or of one block's intermediates"),
    ]


def _tied_sum_item(point: SweepPoint, grad_bytes: int) -> MemoryItem:
    return _item("tied embedding: LM head's and embedding's gradients being summed",
                 grad_bytes * point.tied_sum_elements, "gradients",
                 "autograd input_buffer.cpp: one AccumulateGrad node per leaf, contributions summed out of place")


def _zero0_phases(setup: "Setup", acts: Activations | None, numels: list[int]) -> PhasePlan:
    """ZeRO stage 0: the DeepSpeed engine without partitioning. bf16/fp16 go through
    FP16_UnfusedOptimizer (deepspeed/runtime/fp16/unfused_optimizer.py): an fp32 master per
    parameter, fp32 gradients made in step(); fp32 trains the torch optimizer directly."""
    psi, wb = sum(numels), setup.weight_bytes
    largest = max(numels)
    mixed = setup.recipe.master_bits > 0
    weights = _item("weights", wb * psi, "parameters")
    states = _optimizer_items(setup, psi, "full") if mixed else [
        i for i in _optimizer_items(setup, psi, "full") if "master" not in i.name]
    resident = [weights, *states]
    grads = _item("gradients", wb * psi, "gradients")
    phases = []
    for point in backward_sweep(acts, numels, layout(setup)):
        phases.append(_phase(point.label, resident + _activation_items(point) + [
            _item("gradients so far", wb * point.grad_elements, "gradients")]))
    flat = min(psi, DS_ALLREDUCE_FALLBACK_ELEMENTS) * wb
    phases.append(_phase("gradient all-reduce", resident + [grads, _item(
        "flat all-reduce bucket", flat, "buffers", "engine.py buffered_allreduce_fallback")]))
    step = resident + [grads, _item("Adam temporaries (largest parameter)", _adam_temporaries(largest, setup),
                                    "buffers", "torch.optim.AdamW single-tensor step")]
    if mixed:
        step.append(_item("fp32 gradients for the master step", FP32 * psi, "buffers",
                          "unfused_optimizer.py step(): p.grad = fp16 grad .float()"))
    phases.append(_phase("optimizer step", step))
    return PhasePlan(phases=phases, resident_bytes=sum(i.bytes for i in resident), resident=resident,
                     buffers=[i for p in phases for i in p.items if i.component == "buffers"])


def _partition_span(numels: list[int], dp: int) -> tuple[int, int]:
    """(partition size, largest sum of whole parameters touching one rank's partition).

    ZeRO-1/2 flatten the 16-bit parameters in order and cut the flat buffer into dp equal
    partitions; grads_in_partition holds every parameter that overlaps the partition, whole
    (stage_1_and_2.py: total_size = sum of params_in_partition numels)."""
    import numpy as np

    sizes = np.asarray(numels, dtype=np.int64)
    total = int(sizes.sum())
    part = _ceil_div(total, dp)
    ends = np.cumsum(sizes)  # parameter k spans [ends[k] - sizes[k], ends[k])
    lo = np.arange(min(dp, total), dtype=np.int64) * part
    lo = lo[lo < total]
    hi = np.minimum(lo + part, total)
    first = np.searchsorted(ends, lo, side="right")  # first parameter ending after lo
    last = np.minimum(np.searchsorted(ends, hi, side="left"), len(sizes) - 1)  # last one starting before hi
    best = int((ends[last] - (ends[first] - sizes[first])).max()) if lo.size else 0
    return part, best


def _zero12_phases(setup: "Setup", acts: Activations | None, numels: list[int]) -> PhasePlan:
    """ZeRO stages 1 and 2 (deepspeed/runtime/zero/stage_1_and_2.py)."""
    z, wb, dp = setup.zero, setup.weight_bytes, setup.shard_size
    psi = sum(numels)
    part, touching = _partition_span(numels, dp)
    stage = z.stage
    weights = _item("flat 16-bit weights (full)", wb * psi, "parameters",
                    "flatten_dense_tensors_aligned of the bit16 groups")
    resident = [weights, *_optimizer_items(setup, part, f"1/{dp} partition")]
    if z.offload_optimizer != "none":
        resident.append(_item("offload staging buffer on the device (largest parameter)", wb * max(numels), "buffers",
                              "stage_1_and_2.py __init__: temp_grad_buffer_for_gpu_offload"))
    bucket = _item(f"ipg reduce bucket ({z.reduce_bucket_size:,} elements)",
                   wb * z.reduce_bucket_size * (2 if z.overlap else 1) if z.contiguous_gradients else 0,
                   "buffers", "stage_1_and_2.py: torch.empty(reduce_bucket_size) per ipg buffer")
    in_partition = _item("grads_in_partition (params touching this partition)", wb * touching, "buffers",
                         "stage_1_and_2.py copy_grads_in_partition")
    phases = []
    # Stage 2 reduces whenever the bucket would overflow; the worst rank is the one whose
    # partition holds the last parameters (the LM head, reduced first), so its grads_in_partition
    # exists from the first such reduction on. Stage 1, and stage 2 when the whole model fits one
    # bucket, reduce once, at the end of backward.
    first = _first_reduction(numels, z.reduce_bucket_size) if stage == 2 else None
    sweep = backward_sweep(acts, numels, layout(setup))
    for point in sweep:
        items = resident + _activation_items(point)
        reduced = point.label == "end of backward" or (first is not None and point.grad_elements >= first[0])
        if stage == 1:
            # Stage 1 keeps every param.grad until the accumulation boundary, then reduces
            # through the bucket into grads_in_partition (reduce_gradients at the boundary).
            items.append(_item("16-bit gradients", wb * point.grad_elements, "gradients"))
            if reduced:
                items += [bucket, in_partition]
        elif point.grad_elements:
            # Each gradient is copied into the bucket by its hook and freed: only the gradients
            # of the current block are in flight. The bucket exists from the first hook on.
            # A tied head's gradient waits in autograd, unreduced, for the embedding's; at the
            # embedding's backward both live while their sum (then the one unreduced gradient)
            # is made: measured, three V x h tensors.
            unreduced = point.held_elements if point.tied_sum_elements else \
                point.in_flight_elements + point.held_elements
            items += [_item("16-bit gradients not yet reduced", wb * unreduced, "gradients"), bucket,
                      _tied_sum_item(point, wb)] + ([in_partition] if reduced else [])
        phases.append(_phase(point.label, items))
        if stage == 1 and point.tied_sum_elements:
            # ZeRO-1 reduces once the last hook has run: the tied weight's contributions are
            # summed with every gradient and the bucket live, before grads_in_partition exists
            # (peak trace: the gradients, the bucket and two more V x h at that moment).
            phases.append(_phase("embeddings' backward (tied gradients summed)", resident + _activation_items(point) + [
                _item("16-bit gradients", wb * point.grad_elements, "gradients"), bucket,
                _tied_sum_item(point, wb)]))
    if first is not None and acts is not None and layout(setup) is not None:
        produced, trigger = first
        items = resident + [_item("saved activations", _activations_when_produced(acts, layout(setup), numels, produced),
                                  "activations"),
                            _item("16-bit gradient that overflowed the bucket", wb * trigger, "gradients"),
                            bucket, in_partition]
        phases.append(_phase(f"first bucket reduction ({produced:,} gradient elements in)", items))
    offloaded = z.offload_optimizer != "none"
    step = resident if offloaded else resident + [
        _item("fp32 gradient partition", FP32 * part, "buffers", "stage_1_and_2.py step(): single_grad_partition"),
        _item("Adam temporaries (flat partition)", _adam_temporaries(part, setup), "buffers",
              "torch.optim.AdamW single-tensor step on the flat fp32 partition")]
    phases.append(_phase("optimizer step", step))
    plan = PhasePlan(phases=phases, resident_bytes=sum(i.bytes for i in resident), resident=resident,
                     buffers=[i for p in phases for i in p.items if i.component == "buffers"])
    if offloaded:
        _offload_optimizer_host(plan, setup, part)
        # ZeRO-1/2 also keep, per rank on the host, a 16-bit copy of the partition and a staging
        # buffer of the largest parameter (stage_1_and_2.py __init__:
        # param_buffer_of_bit16_for_cpu_offload_groups, temp_grad_buffer_for_cpu_offload)
        extra = (wb * part + wb * max(numels)) * setup.request.gpus
        plan.host_resident_bytes += extra
        plan.host_peak_bytes += extra
    return plan


def _first_reduction(numels: list[int], bucket_elements: int) -> tuple[int, int] | None:
    """When ZeRO-2 first reduces during backward: (gradient elements produced before it, the
    element count of the parameter whose hook triggers it), or None when no bucket overflows.

    stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads reduces the bucket when
    ``bucket.elements + param.numel() > reduce_bucket_size`` and adds the parameter's count to
    the bucket afterwards, also for a parameter larger than the bucket (reduced on its own at the
    next trigger). Hooks fire in reverse registration order."""
    produced = in_bucket = 0
    for numel in reversed(numels):
        if in_bucket and in_bucket + numel > bucket_elements:
            return produced, numel
        in_bucket += numel
        produced += numel
    return None


def _activations_when_produced(acts: Activations, shape: Layout, numels: list[int], produced: int) -> int:
    """Saved activations still live when backward has produced ``produced`` gradient elements: the
    blocks not yet finished keep theirs, the current one (recomputed under checkpointing) too."""
    per_layer = shape.layer_parameters
    head, _ = _head_and_late(shape, numels)
    body = acts.saved_bytes - acts.head_saved_bytes
    if produced <= head:
        return body
    done = min(shape.num_layers - 1, (produced - head) // max(per_layer, 1))
    return body - done * acts.layer_kept_bytes + (acts.layer_saved_bytes if acts.checkpointed else 0)


def _offload_optimizer_host(plan: PhasePlan, setup: "Setup", part: int) -> None:
    """ZeRO-Offload: the fp32 partition, its gradient and the Adam moments live on the host
    (DeepSpeedCPUAdam steps there). Host memory is per node: every local rank keeps its own."""
    from planner.precision import bits_to_bytes, optimizer_state_bits

    per_rank = FP32 * part * 2 + bits_to_bytes(part, optimizer_state_bits(setup.request.optimizer))
    ranks = setup.request.gpus
    target = setup.zero.offload_optimizer
    if target == "nvme":
        plan.nvme_bytes += per_rank * ranks
        plan.host_peak_bytes += FP32 * part * 2 * ranks  # swap buffers for one partition in flight
        plan.host_resident_bytes += FP32 * part * ranks
    else:
        plan.host_resident_bytes += per_rank * ranks
        plan.host_peak_bytes += per_rank * ranks
    if setup.zero.pin_memory:
        plan.host_pinned_bytes += FP32 * part * 2 * ranks
    plan.notes.append(f"optimizer offloaded to {target}: {per_rank:,} bytes per rank on the host side")


def _persistent_numel(numels: list[int], threshold: int) -> int:
    return sum(n for n in numels if n <= threshold)


def _zero3_phases(setup: "Setup", acts: Activations | None, numels: list[int]) -> PhasePlan:
    """ZeRO stage 3 (deepspeed/runtime/zero/stage3.py, partition_parameters.py)."""
    z, wb, dp = setup.zero, setup.weight_bytes, setup.shard_size
    psi = sum(numels)
    part = _ceil_div(psi, dp)
    persistent = _persistent_numel(numels, z.param_persistence_threshold)
    offload_params = z.offload_params != "none"
    resident = [
        _item(f"16-bit parameter partition (1/{dp})", 0 if offload_params else wb * part, "parameters",
              "partition_parameters.py ds_tensor, defragmented into one flat buffer"),
        _item("persistent small parameters (kept whole)", wb * persistent, "buffers",
              f"stage3_param_persistence_threshold={z.param_persistence_threshold:,}"),
        *_optimizer_items(setup, part, f"1/{dp} partition"),
        _item(f"16-bit gradient partition (1/{dp})", wb * part, "gradients",
              "stage3.py _setup_for_real_optimizer: grad partitions buffer"),
        _item(f"ipg reduce bucket ({z.reduce_bucket_size:,} elements)", wb * z.reduce_bucket_size, "buffers",
              "stage3.py _setup_for_real_optimizer: __ipg_bucket_flat_buffer"),
    ]
    gathered = _zero3_gathered(setup, numels)
    phases = []
    for point in backward_sweep(acts, numels, layout(setup)):
        phases.append(_phase(point.label, resident + _activation_items(point) + [
            _item("gathered 16-bit parameters", gathered, "buffers", _gathered_source(setup, numels)),
            _item("16-bit gradients not yet reduced", wb * point.in_flight_elements, "gradients")]))
    offloaded = z.offload_optimizer != "none"
    step = resident if offloaded else resident + [
        _item("fp32 gradient partition", FP32 * part, "buffers", "stage3.py: fp32 grad of each sub-group"),
        _item("Adam temporaries (flat partition)", _adam_temporaries(min(part, z.sub_group_size), setup),
              "buffers", "torch.optim.AdamW single-tensor step per sub_group_size group")]
    phases.append(_phase("optimizer step", step))
    plan = PhasePlan(phases=phases, resident_bytes=sum(i.bytes for i in resident), resident=resident,
                     buffers=[i for p in phases for i in p.items if i.component == "buffers"])
    if offloaded:
        _offload_optimizer_host(plan, setup, part)
    if offload_params:
        plan.host_resident_bytes += wb * part * setup.request.gpus
        plan.host_peak_bytes += wb * part * setup.request.gpus
        if z.offload_params == "cpu" and z.pin_params:  # partition_parameters.py: pin_memory(partitioned_tensor)
            plan.host_pinned_bytes += wb * part * setup.request.gpus
        if z.offload_params == "nvme":
            plan.nvme_bytes += wb * part * setup.request.gpus
        plan.notes.append(f"parameters offloaded to {z.offload_params}: each rank's 1/{dp} partition lives off the device")
    return plan


def _zero3_gathered(setup: "Setup", numels: list[int]) -> int:
    """Parameters all-gathered at the start of backward. DeepSpeed releases a parameter after
    its module unless it will be used again within stage3_max_reuse_distance elements; in
    backward every parameter is reused, so when the whole model is within that distance nothing
    is released between forward and backward (partitioned_param_coordinator.py,
    release_sub_module). Otherwise what stays is bounded by max_live_parameters plus the
    prefetch bucket."""
    z, wb, psi = setup.zero, setup.weight_bytes, sum(numels)
    persistent = _persistent_numel(numels, z.param_persistence_threshold)
    gatherable = psi - persistent
    if z.max_reuse_distance >= psi:
        return wb * gatherable
    return wb * min(gatherable, z.max_live_parameters + z.prefetch_bucket_size + max(numels))


def _gathered_source(setup: "Setup", numels: list[int]) -> str:
    if setup.zero.max_reuse_distance >= sum(numels):
        return (f"stage3_max_reuse_distance({setup.zero.max_reuse_distance:,}) covers the whole model, "
                "so gathered parameters stay until backward")
    return "stage3_max_live_parameters + stage3_prefetch_bucket_size"


# --- torch DDP and FSDP ----------------------------------------------------------------------

def _torch_phases(setup: "Setup", acts: Activations | None, numels: list[int]) -> PhasePlan:
    """torch DDP (autocast for the mixed recipes: fp32 weights, which are the master copy) and
    FSDP (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD) with a mixed-precision policy."""
    s, r = setup.strategy, setup.recipe
    psi = sum(numels)
    shard = setup.shard_size if s.shards_parameters else 1
    part = _ceil_div(psi, shard)
    mixed = r.master_bits > 0
    store_bytes = FP32 if mixed or r.weight_bits == 32 else r.weight_bits // 8
    compute_bytes = r.weight_bits // 8
    offload = setup.zero.offload_params != "none"
    from planner.precision import bits_to_bytes, optimizer_state_bits

    states = bits_to_bytes(part if s.shards_optimizer else psi, optimizer_state_bits(setup.request.optimizer))
    resident = [
        _item("weights" + (" (fp32, the master copy)" if mixed else ""),
              0 if offload else store_bytes * (part if s.shards_parameters else psi), "parameters"),
        _item(f"{setup.request.optimizer} states", 0 if offload else states, "optimizer_states"),
    ]
    if s.name == "ddp":
        # The Reducer allocates its flat buckets when DDP wraps the model and keeps them; with
        # the default gradient_as_bucket_view=False they are a second copy of every gradient
        # (torch/nn/parallel/distributed.py docstring of gradient_as_bucket_view).
        resident.append(_item("DDP gradient buckets (a copy of the gradients)", store_bytes * psi, "buffers",
                              "torch DDP Reducer, gradient_as_bucket_view=False"))
    shape = layout(setup)
    block = shape.largest_block_parameters if shape else max(numels)
    root = psi - shape.blocks_parameters if shape else max(numels)
    phases = []
    for point in backward_sweep(acts, numels, layout(setup)):
        items = resident + _activation_items(point)
        if s.name == "ddp":
            items.append(_item("gradients (full)", store_bytes * point.grad_elements, "gradients"))
            if mixed:
                items.append(_autocast_copies(setup, point, psi, block, compute_bytes))
        else:
            items += _fsdp_items(setup, point, psi, block, root, shard, compute_bytes, store_bytes)
        phases.append(_phase(point.label, items))
        if s.name != "ddp" and point.tied_sum_elements:
            phases.append(_phase("embeddings' backward (tied gradients summed)",
                                 resident + _fsdp_tied_sum_items(point, psi, root, shard, compute_bytes, store_bytes)))
    grad_bytes = store_bytes * (part if s.shards_gradients else psi)
    phases.append(_phase("optimizer step", resident + [
        _item("gradients", 0 if offload else grad_bytes, "gradients"),
        _item("optimizer step temporaries",
              _adam_temporaries(_ceil_div(max(numels), shard) if setup.device == "cpu" else part, setup),
              "buffers", "torch.optim.AdamW: single-tensor on CPU, foreach on CUDA")]))
    plan = PhasePlan(phases=phases, resident_bytes=sum(i.bytes for i in resident), resident=resident,
                     buffers=[i for p in phases for i in p.items if i.component == "buffers"])
    if offload:
        per_rank = store_bytes * part * 2 + states
        plan.host_resident_bytes = per_rank * setup.request.gpus
        plan.host_peak_bytes = per_rank * setup.request.gpus
        plan.notes.append("FSDP CPUOffload: parameters, gradients and optimizer states of each shard on the host")
    if s.name == "ddp":
        plan.notes.append(f"DDP buckets of {DDP_BUCKET_CAP_BYTES // 2**20} MiB (bucket_cap_mb) hold a full copy of the gradients")
    return plan


def _autocast_copies(setup: "Setup", point: SweepPoint, psi: int, block: int, compute_bytes: int) -> MemoryItem:
    """torch.autocast casts each weight to 16 bits once per forward (its cast cache); each linear
    saves its cast weight for backward, so without checkpointing all of them live until their
    layer's backward. Under checkpointing the blocks save nothing: only the LM head's cast stays,
    plus the cast weights of the one block being recomputed."""
    shape = layout(setup)
    if setup.request.checkpointing != "full" or shape is None:
        return _item("autocast copies of the weights", compute_bytes * psi, "buffers",
                     "torch.autocast's cast cache; each linear saves its 16-bit weight for backward")
    head = shape.lm_head_elements
    recomputed = block if point.label.startswith("start of block") else 0
    return _item("autocast copies of the weights (LM head, recomputed block)", compute_bytes * (head + recomputed),
                 "buffers", "checkpointed blocks keep no cast weights; recomputation casts one block's again")


def _fsdp_items(setup: "Setup", point: SweepPoint, psi: int, block: int, root: int, shard: int,
                compute_bytes: int, store_bytes: int) -> list[MemoryItem]:
    """What FSDP2 (torch.distributed.fsdp.fully_shard, per-parameter sharding) holds beyond the
    sharded states at one moment of backward, with every transformer block a unit and the root
    (embeddings, final norm, LM head) the last one.

    _fsdp_param_group.py: a unit is all-gathered into one flat output of its unsharded size,
    then copied out into the parameters; the root is gathered again at the start of backward
    and stays so to its end (its embedding's gradient comes last); the previous block is
    prefetched while the current one runs backward; after a unit's backward its unsharded
    gradients are reduce-scattered from one flat input, and the shard is kept in the
    parameter's dtype (fp32 under mixed precision). On CPU ranks gloo's all-gather holds a
    scratch copy of its output on the worker thread while it runs (measured by the backend)."""
    gloo_copy = 2 if setup.device == "cpu" else 1
    keep_gathered = setup.strategy.params_unsharded_in_step  # SHARD_GRAD_OP: no reshard after forward
    if keep_gathered:
        gathered = compute_bytes * max(0, psi - point.grad_elements + point.in_flight_elements)
        source = "SHARD_GRAD_OP (reshard_after_forward=False): every unit stays gathered until its backward"
    else:
        current = 0 if point.label == "start of backward" else block
        gathered = compute_bytes * (root + current)
        source = "the root unit and the block in backward, gathered"
    prefetch = 0 if point.label == "end of backward" or keep_gathered else compute_bytes * block * gloo_copy
    items = [
        _item("all-gathered units", gathered, "buffers", source),
        _item("prefetched block (all-gather output" + (" and gloo's scratch)" if gloo_copy == 2 else ")"), prefetch,
              "buffers", "FSDP paper Sec. 3.2: the next unit's all-gather overlaps the current unit's backward"),
        _item("unsharded gradients in flight", compute_bytes * point.in_flight_elements, "gradients",
              "a unit's gradients until its reduce-scatter"),
        _item("reduce-scatter input of the finished unit", compute_bytes * point.in_flight_elements
              if point.label.startswith("end of") else 0, "buffers", "foreach_reduce: one flat input per unit"),
        _item("sharded gradients", store_bytes * _ceil_div(point.grad_elements, shard), "gradients"),
    ]
    if point.label.startswith("start of block"):
        # the root's gradients (LM head, final norm) wait unsharded for the root's reduce-scatter
        head_grads = point.grad_elements - point.in_flight_elements
        items.append(_item("root gradients (unsharded, until the end of backward)",
                           compute_bytes * min(head_grads, root), "gradients"))
    return items


def _fsdp_tied_sum_items(point: SweepPoint, psi: int, root: int, shard: int, compute_bytes: int,
                         store_bytes: int) -> list[MemoryItem]:
    """FSDP2 at the embeddings' backward of a tied model (_tied_head_elements): the root unit is
    gathered, every block's gradients are reduce-scattered, and the root's unsharded gradients
    (the head's contribution to the tied weight among them) wait for its post-backward while
    autograd sums the tied contributions (peak trace: aten::mm's and EmbeddingBackward0's
    V x h and aten::add's sum, all live, then _fsdp_param_group.py post_backward)."""
    return [
        _item("all-gathered root unit", compute_bytes * root, "buffers", "the root unit, gathered for backward"),
        _item("sharded gradients of the blocks", store_bytes * _ceil_div(psi - root, shard), "gradients"),
        _item("root gradients (unsharded), the tied head's contribution among them", compute_bytes * root,
              "gradients", "until the root's reduce-scatter at the end of backward"),
        _tied_sum_item(point, compute_bytes),
    ]


def phases_for(setup: "Setup", acts: Activations | None, numels: list[int]) -> PhasePlan:
    s = setup.strategy
    if s.framework == "deepspeed":
        if s.zero_stage == 0:
            return _zero0_phases(setup, acts, numels)
        if s.zero_stage in (1, 2):
            return _zero12_phases(setup, acts, numels)
        return _zero3_phases(setup, acts, numels)
    return _torch_phases(setup, acts, numels)
