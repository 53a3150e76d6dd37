"""DeepSpeed 0.19.8's ZeRO stages 0-3: what the engine allocates phase by phase, what it sends per
step, which offloads it implements, and the ds_config a launch of it needs.

Every buffer term was read from DeepSpeed 0.19.8 (deepspeed/runtime/...) and confirmed allocation by
allocation with the verification backend's peak trace (``backend.train.live_at``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planner.model.activations import Activations
from planner.memory.buffers import (FP32, Layout, PhasePlan, activation_items, backward_sweep, ceil_div, head_and_late,
                                    item, layout, optimizer_items, phase, step_temporaries_flat, tied_sum_item)
from planner.errors import PlannerError
from planner.memory.moments import PhaseKind
from planner.memory.optimizer import flat, spec_of, states_bytes
from planner.recipes.optimizers import OPTIMIZERS
from planner.frameworks.deepspeed import launch as launch_0_19
from planner.frameworks.base import Collective, Framework, Traffic, check_sharded_offload, register
from planner.parallel.tensor import autotp_gather_held_bytes, gathered_logits_race_above

if TYPE_CHECKING:
    from collections.abc import Sequence

    from planner.recipes.optimizers import OptimizerSpec
    from planner.recipes.precision import Recipe
    from planner.setup_fields import SetupFields
    from planner.schema import MemoryItem
    from planner.strategies import Strategy

# engine.py, buffered_allreduce_fallback(elements_per_buffer=500000000): ZeRO-0 all-reduces the
# gradients through flat copies of at most this many elements.
DS_ALLREDUCE_FALLBACK_ELEMENTS = 500_000_000
# The (offload_optimizer, offload_params) settings ZeRO-3 implements (ZeRO-Offload, ZeRO-Infinity).
OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme"))


class DeepSpeedZero(Framework):
    name = "deepspeed"
    version = "0.19.8"
    launch = launch_0_19.LAUNCHER
    cuda_adam_copies = 0  # FusedAdam: multi_tensor_apply, no temporaries
    offloads_gradients_with_params = False
    autotp = True  # tensor_parallel.autotp_size (runtime/engine.py _configure_tensor_parallel_states)
    own_pipeline_engine = True  # runtime/pipe/engine.py PipelineEngine
    loop_autocasts = False  # composer enters no precision context beside a DeepSpeed engine (base.Framework)

    def check_context_parallel(self, s: "Strategy", cp: int) -> None:
        raise PlannerError(f"cp={cp} with strategy {s.name}: DeepSpeed 0.19.8 has no ring/context parallelism "
                           "(its sequence parallelism is Ulysses all-to-all over heads); torch's context_parallel "
                           "with FSDP2 (strategy fsdp or hsdp, torchtitan) splits the sequence", field="cp")

    def check_pipeline(self, setup: "SetupFields", schedule: str) -> None:
        """DeepSpeed's PipelineEngine runs its own 1F1B TrainSchedule (deepspeed/runtime/pipe/schedule.py)
        with ZeRO stage 0 or 1 only (pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
        parallelism")."""
        s = setup.strategy
        if (s.zero_stage or 0) >= 2:
            raise PlannerError(f"pp={setup.dims.pp} with strategy {s.name}: DeepSpeed's pipeline engine supports "
                               "ZeRO stage 0 or 1 only; use zero1, or fsdp (torch pipelining x FSDP2) to shard "
                               "gradients and parameters", field="pp")
        if schedule != "1f1b":
            raise PlannerError(f"pp_schedule={schedule} with strategy {s.name}: DeepSpeed's pipeline engine runs 1F1B "
                               "only; use pp_schedule 1f1b, or a torch strategy (ddp, fsdp, hsdp) for torch's "
                               f"{schedule} schedule", field="pp_schedule")

    def host_hooks(self, s: "Strategy") -> str | None:
        # ZeRO-3: every module's pre/post forward and backward hooks (runtime/zero/parameter_offload.py
        # _register_deepspeed_module); ZeRO-1/2: every parameter's gradient hook (stage_1_and_2.py
        # create_gradient_handling_hooks, each calling reduce_ready_partitions_and_remove_grads); stage 0
        # reduces after backward, bucket by bucket
        return {3: "zero3", 2: "zero2", 1: "zero1"}.get(s.zero_stage)

    def linears_save_inputs(self, s: "Strategy") -> bool:
        return s.zero_stage == 3  # runtime/zero/linear.py LinearFunctionForZeroStage3 saves input and weight

    def check_optimizer(self, setup: "SetupFields", spec: "OptimizerSpec") -> None:
        if spec.whole_matrices:
            # measured on 2 CPU ranks (a client torch.optim.Muon handed to deepspeed.initialize): ZeRO-1/2
            # give it one flat (5376,) fp32 partition for a 96x64 and a 48x96 matrix and ZeRO-3 its flat
            # sub-groups, and its step raises "Param gradient must be a 2D matrix" (_muon.py
            # _single_tensor_muon); ZeRO-0 (fp32, and bf16 through FP16_UnfusedOptimizer) steps the whole
            # matrices, but the probe trains only the optimizer a ds_config names, so it stays unverified
            raise PlannerError(
                f"optimizer {spec.name} with strategy {setup.strategy.name}: under ZeRO-1/2/3 DeepSpeed hands a client "
                "torch.optim.Muon flat 1-D partitions, and its step raises 'Param gradient must be a 2D matrix' "
                "(measured on CPU ranks); DeepSpeed 0.19.8's own MuonWithAuxAdam (ds_config optimizer type Muon) "
                "gathers each matrix's partition slices (runtime/zero/muon), and ZeRO-0 steps whole matrices "
                "but its probe trains only a ds_config's optimizer: neither is modelled; use single or ddp",
                field="optimizer")
        if setup.request.optimizer_in_backward:
            raise PlannerError(f"optimizer_in_backward with strategy {setup.strategy.name}: DeepSpeed's engine steps "
                               "its optimizer in engine.step() after the gradients are reduced, never in a "
                               "gradient hook; use strategy single", field="optimizer_in_backward")

    def takes_layout(self, s: "Strategy", tp: int, cp: int, pp: int, schedule: str) -> bool:
        """AutoTP with ZeRO, no CP; the pipeline engine with ZeRO-0/1, its 1F1B schedule and without
        AutoTP (runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
        parallelism"; runtime/engine.py _configure_tensor_parallel_states replaces the engine's mpu,
        the pipeline's topology, by AutoTP's groups)."""
        return cp == 1 and (pp == 1 or ((s.zero_stage or 0) < 2 and schedule == "1f1b" and tp == 1))

    def phases(self, setup: "SetupFields", acts: Activations | None, numels: list[int]) -> PhasePlan:
        stage = setup.strategy.zero_stage
        if stage == 0:
            plan = _zero0_phases(setup, acts, numels)
        elif stage in (1, 2):
            plan = _zero12_phases(setup, acts, numels)
        else:
            plan = _zero3_phases(setup, acts, numels)
        _autotp_gather_held(plan, setup, acts)
        return plan

    def collectives(self, s: "Strategy", t: Traffic) -> list[Collective]:
        """ZeRO-0 all-reduces; ZeRO-1/2 reduce-scatter the gradients (stage 2 at every micro-step,
        in reduce buckets) and all-gather the updated parameters; ZeRO-3 gathers every module's
        parameters in forward and backward (at most prefetch_bucket_size at a time)."""
        grads = t.trained * t.wire_bytes  # frozen parameters: no gradient, no optimizer partition
        reduce_msg = min(t.trained, t.buckets.reduce) * t.wire_bytes
        gather_msg = min(t.trained, t.buckets.allgather) * t.wire_bytes
        # ZeRO-1/2 gather the updated partitions after the optimizer step: in no pass
        if s.zero_stage == 0:
            return [("gradient all-reduce", t.step * grads, 2, reduce_msg, "world", 0.0)]
        if s.zero_stage == 1:
            return [("gradient reduce-scatter", t.step * grads, 1, reduce_msg, "world", 0.0),
                    ("parameter all-gather", t.step * grads, 1, gather_msg, "world", 0.0)]
        if s.zero_stage == 2:
            return [("gradient reduce-scatter", t.accumulation * grads, 1, reduce_msg, "world", 0.0),
                    ("parameter all-gather", t.step * grads, 1, gather_msg, "world", 0.0)]
        # Forward gathers every partitioned parameter, the persistent small ones too (after an
        # optimizer step their updated partitions are gathered again: measured, one pass of the
        # whole model on a model within the reuse distance); backward gathers again what forward
        # released, all but the persistent ones, unless the whole model is within
        # stage3_max_reuse_distance: then nothing is released between its forward and backward use
        # (as the memory model holds it: _zero3_gathered). ZeRO-3 partitions frozen parameters too.
        unit = t.block * t.wire_bytes
        persistent = _persistent_numel(t.numels, t.buckets.persistence)
        backward = 0 if t.buckets.reuse >= t.psi else t.psi - persistent
        params = (t.psi + backward) * t.wire_bytes
        return [("parameter all-gathers", t.accumulation * params, 1,
                 min(unit, t.buckets.prefetch * t.wire_bytes), "shard", t.psi / (t.psi + backward)),
                ("gradient reduce-scatter", t.accumulation * grads, 1, min(unit, reduce_msg), "shard", 0.0)]

    def compute_stream_copies(self, s: "Strategy", t: Traffic, gradient_bytes: int) -> tuple[object, object, object]:
        """ZeRO-1/2 with contiguous_gradients (the default) copy each gradient into the reduce bucket on the
        current stream as its hook fires, when they reduce: stage 2 at every micro-step, stage 1 at the step's
        boundary (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads, lines 1441-1465: the bucket
        narrow's copy_, the stream recorded as its producer; reduce_ready_partitions_and_remove_grads, line
        2294). ZeRO-3 copies under its reduce_and_partition_stream (stage3.py __add_grad_to_ipg_bucket, line
        1628) and gathers into buffers its parameters view: nothing on the compute stream. Stage 0 is not
        counted."""
        if not t.wrapped or s.zero_stage not in (1, 2) or not t.buckets.contiguous:
            return 0.0, 0.0, 0.0
        times = t.accumulation if s.zero_stage == 2 else t.step
        return 0.0, times * t.trained * 2.0 * t.wire_bytes, 0.0

    def overlap_windows(self, s: "Strategy", forward_seconds: float, backward_seconds: float) -> tuple[float, float]:
        # ZeRO-3 prefetches in both passes (the forward's gathers behind the forward; the backward's
        # gathers and the gradient reduce-scatters behind the backward); ZeRO 0-2: overlap_comm
        # defaults to false (DeepSpeedZeroConfig).
        if s.zero_stage == 3:
            return forward_seconds, backward_seconds
        return 0 * forward_seconds, 0 * backward_seconds

    def offload_options(self, s: "Strategy") -> list[tuple[str, str]]:
        if s.zero_stage == 3:
            return list(OFFLOADS)
        if s.shards_optimizer:
            return [("none", "none"), ("cpu", "none"), ("nvme", "none")]
        return [("none", "none")]

    def check_offload(self, s: "Strategy", offload_optimizer: str, offload_params: str) -> None:
        check_sharded_offload(s, offload_optimizer, offload_params, params_ok=s.zero_stage == 3)

    def check_precision(self, s: "Strategy", recipe: "Recipe") -> None:
        if recipe.casts_model:
            raise PlannerError("precision bf16-pure (no fp32 master) is not what DeepSpeed's bf16 mode does: "
                               "it always keeps fp32 master weights; use bf16-mixed with zero0-3, or ddp/fsdp for bf16-pure",
                               field="precision")

    def ds_config(self, setup: "SetupFields", request: Any) -> dict[str, Any]:
        """The ds_config of this setting (planner/frameworks/deepspeed/config.py build_ds_config): stage, precision,
        batch, optimizer and the ZeRO settings as resolved."""
        from planner.frameworks.deepspeed.config import build_ds_config

        return build_ds_config(stage=setup.zero.stage, recipe=setup.recipe,
                               micro_batch=request.micro_batch, gradient_accumulation=request.gradient_accumulation,
                               optimizer=request.optimizer, zero=setup.zero)

    @staticmethod
    def use_torch_adam(config: dict[str, Any]) -> None:
        """CPU ranks: DeepSpeed's FusedAdam needs CUDA; torch's AdamW is what the model predicts."""
        if "optimizer" in config:
            config["optimizer"].setdefault("params", {})["torch_adam"] = True

    def worker_settings(self, setup: "SetupFields", request: Any) -> dict[str, Any]:
        config = self.ds_config(setup, request)
        if setup.gpu.is_cpu:
            self.use_torch_adam(config)
        return {"framework": self.name, "ds_config": config}


def _zero0_phases(setup: "SetupFields", acts: Activations | None, numels: list[int]) -> PhasePlan:
    """ZeRO stage 0: the DeepSpeed engine without partitioning. bf16/fp16 go through
    FP16_UnfusedOptimizer (deepspeed/runtime/fp16/unfused_optimizer.py): an fp32 master per
    parameter, fp32 gradients made in step(); fp32 trains the torch optimizer directly."""
    psi, wb = sum(numels), setup.weight_bytes
    largest = max(numels)
    mixed = setup.recipe.master_bits > 0
    weights = item("weights", wb * psi, "parameters")
    states = optimizer_items(setup, psi, "full") if mixed else [
        i for i in optimizer_items(setup, psi, "full") if "master" not in i.name]
    resident = [weights, *states]
    grads = item("gradients", wb * psi, "gradients")
    phases = []
    for point in backward_sweep(acts, numels, layout(setup)):
        phases.append(phase(point.kind, point.label, resident + activation_items(point) + [
            item("gradients so far", wb * point.grad_elements, "gradients")]))
    flat = min(psi, DS_ALLREDUCE_FALLBACK_ELEMENTS) * wb
    phases.append(phase(PhaseKind.GRADIENT_ALLREDUCE, "gradient all-reduce", resident + [grads, item(
        "flat all-reduce bucket", flat, "buffers", "engine.py buffered_allreduce_fallback")]))
    step = resident + [grads, item("Adam temporaries (largest parameter)", step_temporaries_flat(largest, setup),
                                    "buffers", "torch.optim.AdamW single-tensor step")]
    if mixed:
        step.append(item("fp32 gradients for the master step", FP32 * psi, "buffers",
                          "unfused_optimizer.py step(): p.grad = fp16 grad .float()"))
    phases.append(phase(PhaseKind.OPTIMIZER_STEP, "optimizer step", step))
    return PhasePlan.of(phases, resident)


def _autotp_gather_held(plan: PhasePlan, setup: "SetupFields", acts: Activations | None) -> None:
    """AutoTP's gathered LM head on CPU ranks: how far above the peak a measurement can read when
    gloo's worker thread still holds the gather's input and output into the loss
    (tensor_parallel.autotp_gather_held_bytes). A note, not a phase: whether it happens is a race
    between two threads, not an allocation DeepSpeed makes.

    Seen as late as the loss's log_softmax and the first op of its backward, never later: the live
    set there is the start of backward's, less log_softmax's backward output (the second fp32
    tokens x vocab transient, not made yet), plus the two gather tensors; at log_softmax the logits
    in the training dtype and their fp32 upcast are live instead of nll_loss's gradient
    (activations._loss_saved), the larger of the two moments is taken. Measured at vocabulary
    4,096 (tests/real_runs.py llama-tp2-zero2-fp32-small-4ranks-s256): in each of four runs the
    peak of at least one rank read 2 MiB above the start of backward (3 of 4 ranks and 1 of 4 in
    the two traced runs, the other ranks the start of backward to 152 bytes); at 32,000
    (llama-v32k-tp2-zero2-fp32-small-4ranks-s256), in two runs, on none of the 24 rank-steps:
    the start of backward to 152 bytes. The main thread holds its own references until it has
    concatenated the gathered logits, so the larger they are, the longer the worker has to let
    go first. In bf16 (llama-tp2-zero2-bf16-small-4ranks-s256) the late tensors can only show
    while the fp32 upcast lives, up to log_softmax (1 MiB above the start of backward there);
    measured once, the start of backward to 152 bytes. NCCL's work on CUDA ranks is not released
    this way (not counted, not measured)."""
    if setup.lm_head_split <= 1 or setup.device != "cpu" or acts is None:
        return
    full, req, b = setup.model.architecture, setup.request, setup.recipe.compute_bytes
    held = autotp_gather_held_bytes(full, tokens=req.micro_batch * req.seq_len, b=b, tp=setup.tp)
    above = gathered_logits_race_above(plan, setup, acts, held)
    if above > 0:
        plan.notes.append(f"CPU ranks (gloo): the worker thread of AutoTP's logits gather may still hold its input and "
                          f"output ({held:,} bytes) into the loss; a measured peak can then read up to {above:,} bytes "
                          "above this one (a race between threads, seen at small vocabularies)")


def _partition_span(numels: list[int], dp: int) -> tuple[int, int]:
    """(partition size, largest sum of whole parameters touching one rank's partition).

    ZeRO-1/2 flatten the 16-bit parameters in order and cut the flat buffer into dp equal
    partitions; grads_in_partition holds every parameter that overlaps the partition, whole
    (stage_1_and_2.py: total_size = sum of params_in_partition numels).

    Up to PURE_PYTHON_RANKS ranks the partitions are walked with bisect (a single estimate then
    imports no numpy); beyond, numpy does the same searches at once. Integers either way.
    Remembered per (numels, dp): the plan asks for every ZeRO-1/2 setting of a layout."""
    key = (tuple(numels), dp)
    if key not in _SPANS:
        if len(_SPANS) >= 256:
            _SPANS.clear()
        _SPANS[key] = _partition_span_of(numels, dp)
    return _SPANS[key]


_SPANS: dict[tuple[tuple[int, ...], int], tuple[int, int]] = {}  # _partition_span's answers


def _partition_span_of(numels: list[int], dp: int) -> tuple[int, int]:
    if dp <= PURE_PYTHON_RANKS:
        return _partition_span_bisect(numels, dp)
    import numpy as np

    sizes = np.asarray(numels, dtype=np.int64)
    total = int(sizes.sum())
    part = ceil_div(total, dp)
    ends = np.cumsum(sizes)  # parameter k spans [ends[k] - sizes[k], ends[k])
    lo = np.arange(min(dp, total), dtype=np.int64) * part
    lo = lo[lo < total]
    hi = np.minimum(lo + part, total)
    first = np.searchsorted(ends, lo, side="right")  # first parameter ending after lo
    last = np.minimum(np.searchsorted(ends, hi, side="left"), len(sizes) - 1)  # last one starting before hi
    best = int((ends[last] - (ends[first] - sizes[first])).max()) if lo.size else 0
    return part, best


PURE_PYTHON_RANKS = 4096


def _partition_span_bisect(numels: list[int], dp: int) -> tuple[int, int]:
    """_partition_span one rank at a time: bisect_right / bisect_left are numpy's searchsorted
    sides "right" / "left"."""
    import bisect
    import itertools

    total = sum(numels)
    part = ceil_div(total, dp)
    ends = list(itertools.accumulate(numels))  # parameter k spans [ends[k] - numels[k], ends[k])
    best = 0
    for rank in range(min(dp, total)):
        lo = rank * part
        if lo >= total:
            break
        hi = min(lo + part, total)
        first = bisect.bisect_right(ends, lo)  # first parameter ending after lo
        last = min(bisect.bisect_left(ends, hi), len(numels) - 1)  # last one starting before hi
        best = max(best, ends[last] - (ends[first] - numels[first]))
    return part, best


def _zero12_phases(setup: "SetupFields", acts: Activations | None, numels: list[int]) -> PhasePlan:
    """ZeRO stages 1 and 2 (deepspeed/runtime/zero/stage_1_and_2.py)."""
    z, wb, dp = setup.zero, setup.weight_bytes, setup.shard_size
    psi = sum(numels)
    part, touching = _partition_span(numels, dp)
    stage = z.stage
    weights = item("flat 16-bit weights (full)", wb * psi, "parameters",
                    "flatten_dense_tensors_aligned of the bit16 groups")
    resident = [weights, *optimizer_items(setup, part, f"1/{dp} partition")]
    if z.offload_optimizer != "none":
        resident.append(item("offload staging buffer on the device (largest parameter)", wb * max(numels), "buffers",
                              "stage_1_and_2.py __init__: temp_grad_buffer_for_gpu_offload"))
    bucket = item(f"ipg reduce bucket ({z.reduce_bucket_size:,} elements)",
                   wb * z.reduce_bucket_size * (2 if z.overlap else 1) if z.contiguous_gradients else 0,
                   "buffers", "stage_1_and_2.py: torch.empty(reduce_bucket_size) per ipg buffer")
    in_partition = item("grads_in_partition (params touching this partition)", wb * touching, "buffers",
                         "stage_1_and_2.py copy_grads_in_partition")
    # ZeRO-2 with gradient accumulation, a micro-batch after the first: the earlier micro-batches'
    # reduced partition gradients stay in their own grads_in_partition, beside the one this
    # micro-batch fills (_zero2_accumulated)
    earlier = _zero2_accumulated(setup, wb * touching) if stage == 2 else None
    accumulating = stage == 1 and _zero1_accumulating(setup)
    phases = []
    # Stage 2 reduces whenever the bucket would overflow; the worst rank is the one whose
    # partition holds the last parameters (the LM head, reduced first), so its grads_in_partition
    # exists from the first such reduction on. Stage 1, and stage 2 when the whole model fits one
    # bucket, reduce once, at the end of backward.
    first = _first_reduction(numels, z.reduce_bucket_size) if stage == 2 else None
    sweep = backward_sweep(acts, numels, layout(setup))
    for point in sweep:
        items = resident + activation_items(point)
        reduced = point.kind is PhaseKind.END_OF_BACKWARD or (first is not None and point.grad_elements >= first[0])
        if stage == 1:
            # Stage 1 keeps every param.grad until the accumulation boundary, then reduces
            # through the bucket into grads_in_partition (reduce_gradients at the boundary).
            # A micro-batch after the first (_zero1_accumulating): every gradient, and the bucket.
            # The bucket itself exists from the first gradient hook on, as in stage 2: with
            # contiguous_gradients the hooks are registered for stage 1 too (stage_1_and_2.py:713
            # create_gradient_handling_hooks), and the first one's process_gradients runs
            # setup_buckets (torch.empty(reduce_bucket_size), :3266) while the activations are
            # still held (measured: the tiny llama at 4,096 tokens, default buckets, peaked at the
            # LM head's backward with the bucket, 1,251 MB, where the end of backward was modelled,
            # 1,055 MB).
            items.append(item("16-bit gradients" + (", accumulating over the micro-batches" if accumulating else ""),
                              wb * (psi if accumulating else point.grad_elements), "gradients",
                              "engine.py:3084-3092: stage 1 reduces at the boundary only" if accumulating else ""))
            if reduced or accumulating or point.grad_elements:
                items += [bucket] + ([in_partition] if reduced else [])
        elif point.grad_elements:
            # Each gradient is copied into the bucket by its hook and freed: only the gradients
            # of the current block are in flight. The bucket exists from the first hook on.
            # A tied head's gradient waits in autograd, unreduced, for the embedding's; at the
            # embedding's backward both live while their sum (then the one unreduced gradient)
            # is made: measured, three V x h tensors.
            unreduced = point.held_elements if point.tied_sum_elements else \
                point.in_flight_elements + point.held_elements
            items += [item("16-bit gradients not yet reduced", wb * unreduced, "gradients"), bucket,
                      tied_sum_item(point, wb)] + ([in_partition] if reduced else [])
        if earlier is not None:
            items.append(earlier)
        phases.append(phase(point.kind, point.label, items))
        if stage == 1 and point.tied_sum_elements:
            # ZeRO-1 reduces once the last hook has run: the tied weight's contributions are
            # summed with every gradient and the bucket live, before grads_in_partition exists
            # (peak trace: the gradients, the bucket and two more V x h at that moment).
            phases.append(phase(PhaseKind.TIED_SUM, "embeddings' backward (tied gradients summed)", resident + activation_items(point) + [
                item("16-bit gradients", wb * (psi if accumulating else point.grad_elements), "gradients"), bucket,
                tied_sum_item(point, wb)]))
    if first is not None and acts is not None and layout(setup) is not None:
        produced, trigger = first
        items = resident + [item("saved activations", _activations_when_produced(acts, layout(setup), numels, produced),
                                  "activations"),
                            item("16-bit gradient that overflowed the bucket", wb * trigger, "gradients"),
                            bucket, in_partition] + ([earlier] if earlier is not None else [])
        phases.append(phase(PhaseKind.FIRST_BUCKET_REDUCTION, f"first bucket reduction ({produced:,} gradient elements in)", items))
    offloaded = z.offload_optimizer != "none"
    step = resident if offloaded else resident + [
        item("fp32 gradient partition", FP32 * part, "buffers", "stage_1_and_2.py step(): single_grad_partition"),
        item("Adam temporaries (flat partition)", step_temporaries_flat(part, setup), "buffers",
              "torch.optim.AdamW single-tensor step on the flat fp32 partition")]
    phases.append(phase(PhaseKind.OPTIMIZER_STEP, "optimizer step", step))
    plan = PhasePlan.of(phases, resident)
    if offloaded:
        _offload_optimizer_host(plan, setup, part)
        # ZeRO-1/2 also keep, per rank on the host, a 16-bit copy of the partition and a staging
        # buffer of the largest parameter (stage_1_and_2.py __init__:
        # param_buffer_of_bit16_for_cpu_offload_groups, temp_grad_buffer_for_cpu_offload)
        extra = (wb * part + wb * max(numels)) * setup.request.gpus
        plan.host_resident_bytes += extra
        plan.host_peak_bytes += extra
    return plan


def _zero1_accumulating(setup: "SetupFields") -> bool:
    """ZeRO-1 in a micro-batch after the first (gradient_accumulation_steps > 1): stage 1
    communicates at the accumulation boundary only (engine.py:3084-3092: no epilogue before it),
    so autograd adds every micro-batch's gradient into the same param.grad, all of which live
    from the first micro-batch on; and the ipg bucket, which setup_buckets allocates at the first
    gradient hook of the step (stage_1_and_2.py:2284-2286, :3256-3268), stays until the boundary's
    reduction releases it. Peak trace (llama fp32, 2 ranks, 2 micro-batches, 2e6-element bucket):
    the second micro-batch's backward starts 28.0 MB higher than the first's (every fp32
    gradient, 20.0 MB, and the 8.0 MB bucket), its peak the loss's backward, measured 95.24 MB."""
    return setup.request.gradient_accumulation > 1 and setup.zero.offload_optimizer == "none"


def _zero2_accumulated(setup: "SetupFields", in_partition_bytes: int) -> MemoryItem | None:
    """ZeRO-2 in a micro-batch after the first (gradient_accumulation_steps > 1), the gradients
    accumulated in the training dtype (engine.py get_data_types: grad_accum_dtype defaults to the
    model's dtype, so no grad_accum attribute and no compact buffer). At the end of every backward,
    independent_gradient_partition_epilogue (stage_1_and_2.py:1016-1061) keeps the partition's
    reduced gradients in all_grad_tensors (get_all_grad_tensors, :2703-2710: the params'
    .grad, views into grads_in_partition; later micro-batches add into them, :1041-1044), then
    _release_ipg_buffers (:924-931) drops grads_in_partition and _clear_param_grad_only the
    .grad. The next micro-batch's first reduction allocates a new grads_in_partition
    (copy_grads_in_partition, :2184-2196), so two live at once until the boundary. Peak trace
    (llama fp32, 2 ranks, 2 micro-batches, 2e6-element buckets): a second 9,999,360-byte
    aten::empty in the second micro-batch's backward, the step's total 10.0 MB higher there than
    at the same moment of the first; the peak at the bucket's flatten (the first reduction)."""
    if setup.request.gradient_accumulation < 2 or not setup.zero.contiguous_gradients or \
            setup.zero.offload_optimizer != "none":  # offload accumulates on the host (:2160-2175)
        return None
    return item("grads_in_partition of the earlier micro-batches (all_grad_tensors)", in_partition_bytes, "gradients",
                "stage_1_and_2.py independent_gradient_partition_epilogue, _release_ipg_buffers")


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
    head, _ = head_and_late(shape, numels)
    body = acts.saved_bytes - acts.head_saved_bytes
    waiting = acts.device_block_bytes * shape.num_layers  # activation_offload's kept saves (buffers.py)
    if produced <= head:
        return acts.device_after_head_bytes + waiting if acts.host_offload else \
            body + waiting + acts.duplicate_head_bytes
    done = min(shape.num_layers - 1, (produced - head) // max(per_layer, 1))
    kept_saves = (shape.num_layers - done) * acts.device_block_bytes
    if acts.host_offload:  # activation_offload: the current block's own set brought back, the earlier ones' kept
        _, rebuilt, own = acts.backward_of(done)
        return own + rebuilt + kept_saves - acts.device_block_bytes
    if acts.kept_blocks:  # blocks unlike each other (checkpointing_every, the selective policies)
        kept_by_done, rebuilt, _ = acts.backward_of(done)
        return body - kept_by_done + rebuilt + kept_saves
    return body - done * acts.layer_kept_bytes + (acts.layer_saved_bytes if acts.checkpointed else 0) + kept_saves


def _offload_optimizer_host(plan: PhasePlan, setup: "SetupFields", part: int) -> None:
    """ZeRO-Offload: the fp32 partition, its gradient and the Adam moments live on the host
    (DeepSpeedCPUAdam steps there). Host memory is per node: every local rank keeps its own."""
    spec = spec_of(setup)
    if not spec.deepspeed_offload:
        # DeepSpeed refuses a client optimizer under ZeRO-Offload (engine.py:2342, zero_force_ds_cpu_optimizer);
        # accelerate and the HF Trainer swap it for DeepSpeedCPUAdam first (accelerate 1.16 utils/deepspeed.py
        # map_pytorch_optim_to_deepspeed: the default class; bitsandbytes' 8-bit states do not survive)
        plan.notes.append(f"ZeRO-Offload with {spec.name}, a client optimizer: accelerate / the HF Trainer replace it "
                          "with DeepSpeedCPUAdam (fp32 moments on the host); plain deepspeed.initialize refuses it "
                          "unless zero_force_ds_cpu_optimizer is false")
        spec = OPTIMIZERS["adamw"]
    per_rank = FP32 * part * 2 + states_bytes(spec, flat(part), FP32 * 8)
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


def _persistent_numel(numels: "Sequence[int]", threshold: int) -> int:
    return sum(n for n in numels if n <= threshold)


def _zero3_phases(setup: "SetupFields", acts: Activations | None, numels: list[int]) -> PhasePlan:
    """ZeRO stage 3 (deepspeed/runtime/zero/stage3.py, partition_parameters.py)."""
    z, wb, dp = setup.zero, setup.weight_bytes, setup.shard_size
    psi = sum(numels)
    part = ceil_div(psi, dp)
    persistent = _persistent_numel(numels, z.param_persistence_threshold)
    offload_params = z.offload_params != "none"
    resident = [
        item(f"16-bit parameter partition (1/{dp})", 0 if offload_params else wb * part, "parameters",
              "partition_parameters.py ds_tensor, defragmented into one flat buffer"),
        item("persistent small parameters (kept whole)", wb * persistent, "buffers",
              f"stage3_param_persistence_threshold={z.param_persistence_threshold:,}"),
        *optimizer_items(setup, part, f"1/{dp} partition"),
        item(f"16-bit gradient partition (1/{dp})", wb * part, "gradients",
              "stage3.py _setup_for_real_optimizer: grad partitions buffer"),
        item(f"ipg reduce bucket ({z.reduce_bucket_size:,} elements)", wb * z.reduce_bucket_size, "buffers",
              "stage3.py _setup_for_real_optimizer: __ipg_bucket_flat_buffer"),
    ]
    gathered = _zero3_gathered(setup, numels)
    shape = layout(setup)
    phases = []
    for point in backward_sweep(acts, numels, shape):
        if shape is not None and point.kind == PhaseKind.END_OF_BACKWARD:  # the embeddings' backward, last
            phases.append(phase(point.kind, point.label, resident + _zero3_embedding_backward(setup, point, shape,
                                                                                              gathered)))
            continue
        phases.append(phase(point.kind, point.label, resident + activation_items(point) + [
            item("gathered 16-bit parameters", gathered, "buffers", _gathered_source(setup, numels)),
            item("16-bit gradients not yet reduced", wb * point.in_flight_elements, "gradients"),
            item("tied embedding: the LM head's gradient, held until the embedding's backward",
                 wb * point.held_elements, "gradients", "autograd input_buffer.cpp (buffers._tied_head_elements)")]))
    offloaded = z.offload_optimizer != "none"
    step = resident if offloaded else resident + [
        item("fp32 gradient partition", FP32 * part, "buffers", "stage3.py: fp32 grad of each sub-group"),
        item("Adam temporaries (flat partition)", step_temporaries_flat(min(part, z.sub_group_size), setup),
              "buffers", "torch.optim.AdamW single-tensor step per sub_group_size group")]
    phases.append(phase(PhaseKind.OPTIMIZER_STEP, "optimizer step", step))
    plan = PhasePlan.of(phases, resident)
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


def _zero3_embedding_backward(setup: "SetupFields", point, shape: Layout, gathered: int) -> list:
    """The embeddings' backward, the last moment of backward under ZeRO-3. Every block's parameters
    have been released by then (each module's post-backward hook partitions its parameters again:
    partitioned_param_coordinator.py release_sub_module; nothing after it in this step reuses
    them), so only the embeddings stay gathered. A tied weight's two contributions live there
    together: the LM head's, held since the head's backward, and the embedding's dense gradient
    (embedding_dense_backward); autograd then adds them in place (the held buffer is its own:
    input_buffer.cpp accumulate), and ZeRO-3's hook copies the sum into its reduce bucket.
    Measured with the backend's peak trace (tests/real_runs.py qwen2-v64k-zero3-fp32-small-t128,
    V=64,000 fp32): the step's peak is this moment, resident + the gathered embedding + 2 x V x h,
    where the whole-model gathered term under-predicted it by 2.76%."""
    wb = setup.weight_bytes
    embeddings = min(gathered, wb * (shape.late_parameters + shape.tied_head_elements))
    dense = shape.late_parameters if point.tied_sum_elements else point.in_flight_elements
    return [
        item("gathered 16-bit parameters (the embeddings; blocks released)", embeddings, "buffers",
             "partitioned_param_coordinator.py release_sub_module after each module's backward"),
        item("16-bit gradients not yet reduced", wb * dense, "gradients"),
        tied_sum_item(point, wb),
    ]


def _zero3_gathered(setup: "SetupFields", numels: list[int]) -> int:
    """Parameters all-gathered at the start of backward. DeepSpeed releases a parameter after
    its module unless it will be used again within stage3_max_reuse_distance elements; in
    backward every parameter is reused, so when the whole model is within that distance nothing
    is released between forward and backward (partitioned_param_coordinator.py,
    release_sub_module). Otherwise what stays is bounded by max_live_parameters plus the
    prefetch bucket."""
    z, wb, psi = setup.zero, setup.weight_bytes, sum(numels)
    persistent = _persistent_numel(numels, z.param_persistence_threshold)
    # a multimodal model's vision tower runs on no image of a text batch: its modules' pre-forward
    # hooks never fetch its partitioned parameters (measured: gemma3mm-vision-zero3-bf16-small-s256,
    # whose peak the whole-model term over-predicted by exactly the tower's 16-bit bytes)
    vision = setup.arch.vision_numels if setup.arch is not None else ()
    gatherable = psi - persistent - sum(n for n in vision if n > z.param_persistence_threshold)
    if z.max_reuse_distance >= psi:
        return wb * gatherable
    return wb * min(gatherable, z.max_live_parameters + z.prefetch_bucket_size + max(numels))


def _gathered_source(setup: "SetupFields", numels: list[int]) -> str:
    if setup.zero.max_reuse_distance >= sum(numels):
        return (f"stage3_max_reuse_distance({setup.zero.max_reuse_distance:,}) covers the whole model, "
                "so gathered parameters stay until backward")
    return "stage3_max_live_parameters + stage3_prefetch_bucket_size"


DEEPSPEED = register(DeepSpeedZero())
