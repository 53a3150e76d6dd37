"""torch 2.13's DDP and FSDP2 (fully_shard: full-shard, grad-op, hybrid): what each holds phase by
phase, what it sends per step, which offloads it implements, and how a rank wraps the model.

The terms were read from torch 2.13 (torch/nn/parallel/distributed.py, torch/distributed/fsdp/
_fully_shard/) and confirmed with the verification backend's peak trace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planner.model.activations import Activations, checkpointed_blocks
from planner.model.architecture import derived, layer_specs, vision_parameters
from planner.memory.buffers import (FP32, PhasePlan, SweepPoint, activation_items, backward_sweep,
                                    ceil_div, item, layout, phase, tied_sum_item)
from planner.errors import PlannerError
from planner.memory.optimizer import dim0_shards, rank_tensors, spec_of, states_bytes, step_temporaries
from planner.model.shapes import TensorShape
from planner.recipes.optimizers import OPTIMIZERS, OptimizerSpec
from planner.model.layers import norm_numels
from planner.memory.moments import PhaseKind
from planner.frameworks.torch import launch as torch_launch
from planner.frameworks.base import Collective, Framework, Traffic, check_sharded_offload, register
from planner.recipes.low_precision import converted_weight_elements, fp8_gather_bytes
from planner.schema import MemoryItem
from planner.parallel.tensor import (gathered_logits_race_above, replicated_embedding_gradient_elements,
                                     tp_only_gradient_items)

if TYPE_CHECKING:
    from planner.setup_fields import SetupFields
    from planner.strategies import Strategy

# torch DDP's default bucket_cap_mb=25 (torch/nn/parallel/distributed.py).
DDP_BUCKET_CAP_BYTES = 25 * 2**20
# FSDP2's side streams (torch 2.13 _fsdp_param_group.py FSDPCommContext.lazy_init: all_gather_stream,
# reduce_scatter_stream): what is allocated under them comes from their own allocator pools
ALL_GATHER_STREAM = "all_gather"
REDUCE_SCATTER_STREAM = "reduce_scatter"
# How the backend's rank (backend/train.py _fully_shard) and the emitted accelerate config name
# each FSDP variant; DDP shards nothing (None).
FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD = "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"


def sharding(s: "Strategy") -> str | None:
    """The FSDP sharding of a torch strategy (None for DDP): the one map of names to variants."""
    if not s.shards_parameters:
        return None
    if s.shard_within_node:
        return HYBRID_SHARD
    return SHARD_GRAD_OP if s.params_unsharded_in_step else FULL_SHARD


class TorchDistributed(Framework):
    name = "torch"
    version = "2.13"
    # FSDP2 keeps one sharded tensor per parameter (_fsdp_param.py FSDPParam._sharded_param_data),
    # DDP and a TP rank one tensor per parameter: the allocator sees them one by one
    state_tensors_per_parameter = True
    launch = torch_launch.LAUNCHER
    cuda_adam_copies = 1  # the foreach path's _foreach_sqrt makes one fp32 copy of exp_avg_sq
    probe_optimizers = tuple(OPTIMIZERS)  # backend/train.py torch_optimizer builds every one
    shards_as_dtensors = True  # fully_shard: each parameter a DTensor of Shard(0)

    tp_sequence_parallel = True  # torchtitan's TP plan (SequenceParallel on the norms)
    loop_no_sync = True  # DDP's and FSDP's no_sync (defer_gradient_sync)

    def takes_layout(self, s: "Strategy", tp: int, cp: int, pp: int, schedule: str) -> bool:
        """torchtitan composes FSDP2, HSDP and DDP with TP and with pipelining (every schedule),
        and CP with FSDP2 / HSDP only (its dp_shard_cp mesh)."""
        return cp == 1 or s.shards_parameters

    def optimizer_tensors(self, setup: "SetupFields", counts: list[int], shard: int) -> tuple[list[TensorShape], int]:
        """torch.optim steps the module's own parameters, each FSDP2's dim-0 shard, and keeps its
        states in their dtype: fp32 under the mixed recipes (the weights are the master copy) and
        fp32, 16-bit under bf16-pure (the model cast to bf16)."""
        r = setup.recipe
        bits = 32 if r.master_bits or r.weight_bits == 32 else r.weight_bits
        return dim0_shards(rank_tensors(setup, counts), shard), bits

    def check_optimizer(self, setup: "SetupFields", spec: OptimizerSpec) -> None:
        s = setup.strategy
        if setup.request.optimizer_in_backward and setup.data_parallel_wrapped and not s.shards_parameters:
            raise PlannerError(
                f"optimizer_in_backward with strategy {s.name}: DDP all-reduces a bucket after the gradients' hooks "
                "have run, so a step in the post-accumulate-grad hook would use unreduced gradients (torchtune runs "
                "optimizer_in_bwd on one device or under FSDP); use single", field="optimizer_in_backward")
        if setup.request.optimizer_in_backward and s.shards_parameters and setup.data_parallel_wrapped:
            raise PlannerError(f"optimizer_in_backward with strategy {s.name}: the step per sharded parameter after "
                               "each unit's reduce-scatter is not modelled; use single", field="optimizer_in_backward")
    offloads_gradients_with_params = True  # FSDP CPUOffload moves gradients to the host with the parameters
    weights_are_master = True  # fp32 weights under autocast (DDP) or FSDP2's MixedPrecisionPolicy
    # torchao's Float8Linear / MXFP8 / NVFP4 linears, as torchtitan's converters swap them into a torch model
    low_precision = frozenset({"none", "float8-tensorwise", "float8-rowwise", "mxfp8", "nvfp4", "te-fp8"})

    def phases(self, setup: "SetupFields", acts: Activations | None, numels: list[int]) -> PhasePlan:
        return _torch_phases(setup, acts, numels)

    def collectives(self, s: "Strategy", t: Traffic) -> list[Collective]:
        """DDP all-reduces the gradients in its buckets (of the fp32 master weights under
        autocast); FSDP gathers each unit (a block) in forward and, unless SHARD_GRAD_OP kept it,
        again in backward, and reduce-scatters its gradients; HSDP adds an all-reduce of each
        shard across the replicas. A TP-only layout (one data-parallel rank) is not wrapped and
        sends none of them (its TP collectives: tensor_parallel.tp_collectives; measured on CPU
        ranks, LLAMA_TP tp 2 GA 4: DTensor's all-gathers and reduce-scatters only)."""
        if not t.wrapped:
            return []
        if not s.shards_parameters:
            master = t.recipe.module_bytes
            # DDP buckets only parameters that require grad (reducer.cpp: the reducer's params)
            return [("gradient all-reduce", t.step * t.trained * master, 2,
                     min(t.trained * master, DDP_BUCKET_CAP_BYTES), "world", 0.0)]
        # the reduce-scatter runs in MixedPrecisionPolicy.reduce_dtype (fp32: _fsdp_collectives.py
        # foreach_reduce casts the unit's gradients before reducing them); a unit's frozen
        # parameters make no gradient to reduce-scatter
        reduce = t.reduce_bytes or t.wire_bytes
        grads = t.trained * reduce
        gathers = 1 if s.params_unsharded_in_step else 2
        unit = fp8_gather_bytes(t.block, t.fp8_gathered[1], t.wire_bytes)
        # a deferred sync (the loop's no_sync) reduce-scatters, and all-reduces across replicas, in the last
        # micro-batch only (_fsdp_param_group.py post_backward: reduce_grads False keeps the unsharded gradient)
        syncs = t.step if t.deferred_sync else t.accumulation
        items = [("parameter all-gathers" + (" (float8 weights in fp8)" if t.fp8_gathered[0] else ""),
                  t.accumulation * gathers * fp8_gather_bytes(t.psi, t.fp8_gathered[0], t.wire_bytes), 1, unit,
                  "shard", 1 / gathers),
                 ("gradient reduce-scatter", syncs * grads, 1, t.block * reduce, "shard", 0.0)]
        if s.shard_within_node:
            items.append(("replica all-reduce of each shard", syncs * grads / t.shard, 2,
                          t.block * reduce / t.shard, "replicas", 0.0))
        return items

    def compute_stream_copies(self, s: "Strategy", t: Traffic, gradient_bytes: int) -> tuple[object, object, object]:
        """FSDP2 copies each gathered unit out of the all-gather's flat output into its parameters, and each
        unit's gradients into the reduce-scatter's flat input, both on the compute stream (torch 2.13
        distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_all_gather_copy_out waits for the gather on
        the current stream, then split_with_sizes_copy, lines 445-489, from FSDPParamGroup.wait_for_unshard;
        foreach_reduce runs foreach_reduce_scatter_copy_in, chunk_cat into the reduce dtype, line 603, before
        the reduce-scatter stream waits on the current one, line 607). The copy-out reads the gathered bytes
        and writes them again, per gather (forward, and backward unless SHARD_GRAD_OP kept the unit); the
        copy-in reads each trained element's gradient and writes it in the reduce dtype, per micro-batch.
        The all-gather's copy-in (the local shard) runs on its own stream (foreach_all_gather, line 336).
        FSDP1 (fsdp_version 1) makes neither on the compute stream: it gathers straight into the flat
        parameter (FlatParamHandle's all_gather_into_tensor, on its unshard stream) and casts its flat
        gradient to the reduce dtype, divides and reduce-scatters it under its post-backward stream
        (torch 2.13 distributed/fsdp/_runtime_utils.py _post_backward_hook, lines 748-766).

        DDP (gradient_as_bucket_view False, its default) copies each gradient into its bucket as its hook
        fires, divided by the world on the way (mul_out into the bucket view), and after the all-reduce
        copies the bucket back into the gradient (finalize_bucket_dense: copy_bucket_to_grad), both in the
        backward's stream, once per synchronised backward (pytorch/pytorch ad78a7b,
        torch/csrc/distributed/c10d/reducer.cpp Reducer::mark_variable_ready_dense, finalize_bucket_dense).
        Under a pipeline (pp > 1) a unit stays gathered across the schedule's micro-batches and its gradients
        are reduced once (planner/parallel/pipeline.py pipeline_volumes): one copy-out and one copy-in per
        step. The copy-in follows the planner's reduce-scatter, once per micro-batch (torchtitan's); a job
        that skips the sync between micro-batches (accelerate's no_sync: set_requires_gradient_sync(False))
        copies in once per step."""
        if not t.wrapped:
            return 0.0, 0.0, 0.0
        if not s.shards_parameters:  # into the bucket as the backward runs, back once the all-reduce is done
            bucket = t.step * t.trained * 2.0 * t.recipe.module_bytes
            return 0.0, bucket, bucket
        if t.fsdp_version == 1:
            return 0.0, 0.0, 0.0
        times = t.step if t.pipelined else t.accumulation
        gathered = times * fp8_gather_bytes(t.psi, t.fp8_gathered[0], t.wire_bytes)
        copy_out = 2.0 * gathered
        syncs = t.step if t.pipelined or t.deferred_sync else t.accumulation
        copy_in = syncs * t.trained * (gradient_bytes + (t.reduce_bytes or t.wire_bytes))
        backward_gathers = 0 if s.params_unsharded_in_step or t.pipelined else 1
        return copy_out, backward_gathers * copy_out + copy_in, 0.0

    def check_context_parallel(self, s: "Strategy", cp: int) -> None:
        if not s.shards_parameters:
            raise PlannerError(f"cp={cp} with strategy {s.name}: torchtitan shards the parameters over dp_shard x cp "
                               "with FSDP2 whenever cp > 1 (parallel_dims.py fsdp_enabled); use fsdp or hsdp",
                               field="cp")

    def gradient_bucket_copy(self, s: "Strategy") -> bool:
        return s.wraps and not s.shards_parameters  # DDP

    def fsdp_sharding(self, s: "Strategy") -> str | None:
        return sharding(s)

    def host_hooks(self, s: "Strategy") -> str | None:
        # FSDP's pre/post forward and backward hooks, once per unit (fully_shard's _fsdp_state.py; FSDP1's
        # _runtime_utils.py, charged FSDP2's figure: planner/time/host_hooks.py); DDP's reducer is C++
        return "fsdp2" if s.shards_parameters else None

    def overlap_windows(self, s: "Strategy", forward_seconds: float, backward_seconds: float) -> tuple[float, float]:
        # FSDP prefetches a block ahead in both passes: the forward's gathers hide behind the forward,
        # the backward's gathers and every unit's reduce-scatter (issued by its post-backward hook
        # once its gradients exist) behind the backward; DDP sends a bucket once its gradients are
        # ready (torch/nn/parallel/distributed.py, Reducer): behind the backward only.
        return (forward_seconds if s.shards_parameters else 0 * forward_seconds), backward_seconds

    def offload_options(self, s: "Strategy") -> list[tuple[str, str]]:
        if s.shards_parameters and not s.params_unsharded_in_step:
            return [("none", "none"), ("cpu", "cpu")]  # FSDP CPUOffload moves params, grads and states together
        return [("none", "none")]

    def check_tp_plan(self, s: "Strategy", tp_plan: str, tp: int, dp: int) -> None:
        """torchtitan's layout composes with every torch strategy; transformers' own plan: TP alone
        (accelerate 1.16's Accelerator.prepare_model skips the DDP wrap when
        parallelism_config.tp_enabled, accelerator.py:1855) or with FSDP2 over dp_shard, as
        transformers 5.25 composes them itself (DistributedConfig(tp_size, fsdp_size): _hf_fsdp_embedding);
        DDP x TP neither composes (ParallelismConfig: "composing DDP + TP is currently not supported",
        parallelism_config.py:43; a DDP wrap of DTensor parameters raises, accelerator.py:1856-1858)."""
        if tp_plan == "transformers" and dp > 1 and not s.shards_parameters:
            raise PlannerError(f"tp_plan=transformers with strategy {s.name} over {dp} data-parallel ranks: accelerate "
                               "1.16 does not compose DDP with TP (ParallelismConfig needs dp_shard_size > 1 with "
                               "tp_size > 1; DDP refuses DTensor parameters); use strategy fsdp", field="strategy")

    def check_offload(self, s: "Strategy", offload_optimizer: str, offload_params: str) -> None:
        check_sharded_offload(s, offload_optimizer, offload_params,
                              params_ok=s.shards_parameters and not s.params_unsharded_in_step)
        if offload_params == "nvme":
            raise PlannerError(f"offload_params=nvme is not available with {s.name}: FSDP offloads to CPU only",
                               field="offload_params")
        if offload_optimizer == "nvme":
            raise PlannerError(f"offload_optimizer=nvme is not available with {s.name}: FSDP offloads to CPU only",
                               field="offload_optimizer")
        if s.shards_optimizer and (offload_optimizer == "cpu") != (offload_params == "cpu"):
            raise PlannerError(
                f"{s.name} offloads parameters, gradients and optimizer states together (CPUOffload(offload_params=True)); "
                f"set offload_optimizer and offload_params both to cpu, got {offload_optimizer} and {offload_params}",
                field="offload_optimizer")

    def worker_settings(self, setup: "SetupFields", request: Any) -> dict[str, Any]:
        """How the rank wraps the model (backend/train.py _torch_engine)."""
        # the compute dtype and whether the whole model is cast to it, for the rank's MixedPrecisionPolicy
        dtype, pure = setup.recipe.reduced_dtype, setup.recipe.casts_model
        return {"framework": self.name, "torch": {
            "strategy": setup.strategy.name, "sharding": sharding(setup.strategy),
            "wrapped": not setup.strategy.one_device,  # "single": the bare module, no DDP
            "compute_dtype": dtype, "pure_16bit": pure, "reduce_dtype": request.reduce_dtype,
            "optimizer": request.optimizer, "optimizer_in_backward": request.optimizer_in_backward,
            "offload": setup.zero.offload_params != "none",
            "replicas": request.world_size // setup.shard_size, "shard_size": setup.shard_size,
            "defer_gradient_sync": request.defer_gradient_sync}}


def _torch_phases(setup: "SetupFields", acts: Activations | None, numels: list[int]) -> PhasePlan:
    """torch DDP (autocast for the mixed recipes: fp32 weights, which are the master copy) and
    FSDP (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD) with a mixed-precision policy."""
    s, r = setup.strategy, setup.recipe
    psi = sum(numels)
    # FSDP2 wraps the model only when there is more than one data-parallel rank (torchtitan's
    # parallelize.py applies fully_shard when dp_shard > 1 or cp > 1); a TP-only layout is not
    # wrapped: whole gradients, and no DDP buckets either
    sharded = s.shards_parameters and setup.data_parallel_wrapped
    buckets = not s.shards_parameters and setup.data_parallel_wrapped
    shard = setup.shard_size if sharded else 1
    part = ceil_div(psi, shard)
    mixed = r.master_bits > 0
    store_bytes = FP32 if mixed or r.weight_bits == 32 else r.weight_bits // 8
    compute_bytes = r.weight_bits // 8
    offload = setup.zero.offload_params != "none"
    stepped, step_bits = setup.framework.optimizer_tensors(setup, numels, shard if s.shards_optimizer else 1)
    states = states_bytes(spec_of(setup), stepped, step_bits)
    # A text batch gives a multimodal model's vision tower and projector no gradient (they run on no
    # image), and torch's optimizers create a parameter's state only once it has one (torch 2.13
    # torch/optim/adam.py _init_group: ``if p.grad is not None``): no states, no gradient for them
    # (measured: gemma3mm-vision-fsdp-bf16-s256's resident). DeepSpeed's flat partitions hold both.
    tower = len(setup.arch.vision_numels) if setup.arch is not None and setup.finetune is None else 0
    if tower:  # the tower's tensors come first (planner/model/shapes.py parameter_shapes)
        states = states_bytes(spec_of(setup), stepped[tower:], step_bits)
    trained = psi - (vision_parameters(setup.arch) if setup.arch is not None else 0)
    resident = [
        item("weights" + (" (fp32, the master copy)" if mixed else ""),
              0 if offload else store_bytes * part, "parameters"),
        item(f"{setup.request.optimizer} states", 0 if offload else states, "optimizer_states"),
    ]
    if buckets:  # DDP
        # The Reducer allocates its flat buckets when DDP wraps the model and keeps them; with
        # the default gradient_as_bucket_view=False they are a second copy of every gradient
        # (torch/nn/parallel/distributed.py docstring of gradient_as_bucket_view).
        resident.append(item("DDP gradient buckets (a copy of the gradients)", store_bytes * psi, "buffers",
                              "torch DDP Reducer, gradient_as_bucket_view=False"))
    shape = layout(setup)
    block = shape.largest_block_parameters if shape else max(numels)
    root = psi - shape.blocks_parameters if shape else max(numels)
    embedding = _hf_fsdp_embedding(setup) if sharded else 0
    # With gradient accumulation the phases are those of a micro-batch after the first: it holds
    # everything the first does, and the gradients the earlier micro-batches left
    # (_accumulated_items). Under FSDP CPUOffload those live on the host (foreach_reduce copies
    # each new sharded gradient to the CPU before adding it, _fsdp_collectives.py:736-749).
    later = " (micro-batch 2+)" if setup.request.gradient_accumulation > 1 else ""
    accumulated = bool(later) and not offload
    # the loop's no_sync (defer_gradient_sync): each unit keeps its unsharded gradient, accumulated over the
    # micro-batches, until the last one reduce-scatters it (_deferred_items); bytes per element kept, 0: none
    deferred = _deferred_gradient_bytes(setup, compute_bytes) if accumulated and sharded else 0
    if deferred:
        later = " (micro-batch 2+, gradients unsharded under no_sync)"
    phases = []
    tp_only = not setup.data_parallel_wrapped  # a TP-only rank: its gradients stay in param.grad
    excess = replicated_embedding_gradient_elements(setup.model.architecture, setup.tp) if tp_only else 0
    accumulation = setup.request.gradient_accumulation
    in_backward = setup.request.optimizer_in_backward
    largest_step = max((step_temporaries(setup, [t], step_bits) for t in stepped), default=0) if in_backward else 0
    for point in backward_sweep(acts, numels, layout(setup)):
        items = resident + activation_items(point)
        if in_backward:  # one device (memory/optimizer.py check): each parameter steps in its grad hook
            items += _in_backward_items(point, largest_step, store_bytes * max(numels))
            if mixed:
                items.append(_autocast_copies(setup, point, psi, block, compute_bytes))
            phases.append(phase(point.kind, point.label, items))
        elif tp_only:
            items += tp_only_gradient_items(point, rank_elements=psi, excess=excess, grad_bytes=store_bytes,
                                            accumulation=accumulation)
            if mixed:
                items.append(_autocast_copies(setup, point, psi, block, compute_bytes))
            phases.append(phase(point.kind, point.label + later, items))
        elif not sharded:  # DDP
            grads = trained if accumulated else min(point.grad_elements, trained)
            items.append(item("gradients (full)" + (", accumulating over the micro-batches" if accumulated else ""),
                              store_bytes * grads, "gradients",
                              "autograd adds each micro-batch's gradient into param.grad (DDP: under no_sync() "
                              "until the last micro-batch)" if accumulated else ""))
            if mixed:
                items.append(_autocast_copies(setup, point, psi, block, compute_bytes))
            phases.append(phase(point.kind, point.label + later, items))
        else:
            items += _fsdp_items(setup, point, psi, block, root, shard, compute_bytes, store_bytes,
                                 accumulated and not deferred, embedding, deferred_bytes=deferred * trained)
            phases.append(phase(point.kind, point.label + later, items))
            # SHARD_GRAD_OP, and transformers' kept head unit, gather nothing again for backward
            if point.kind is PhaseKind.START_OF_BACKWARD and setup.device == "cpu" and \
                    not s.params_unsharded_in_step and not embedding:
                phases.append(phase(point.kind, "start of backward, the root's all-gather output held by gloo" + later,
                                     resident + _fsdp_backward_gather_items(point, psi, block, root, shard,
                                                                            compute_bytes, store_bytes,
                                                                            accumulated and not deferred)
                                     + _deferred_items(deferred * trained)))
        if sharded and point.tied_sum_elements:
            phases.append(phase(PhaseKind.TIED_SUM, "embeddings' backward (tied gradients summed)" + later,
                                 resident + _fsdp_tied_sum_items(point, psi, root, shard, compute_bytes, store_bytes,
                                                                 accumulated and not deferred)
                                 + _deferred_items(deferred * trained)))
    grad_bytes = store_bytes * ((ceil_div(trained, shard) if s.shards_gradients and sharded else trained) + excess)
    phases.append(phase(PhaseKind.OPTIMIZER_STEP, "optimizer step", resident + [
        item("gradients", 0 if offload or in_backward else grad_bytes, "gradients"),
        item("optimizer step temporaries", 0 if in_backward else
             step_temporaries(setup, stepped, step_bits, shard if s.shards_optimizer else 1),
              "buffers", f"{spec_of(setup).source}: single-tensor on CPU, foreach or fused on CUDA")]))
    plan = PhasePlan.of(phases, resident)
    if offload:
        per_rank = store_bytes * part * 2 + states
        plan.host_resident_bytes = per_rank * setup.request.gpus
        plan.host_peak_bytes = per_rank * setup.request.gpus
        plan.notes.append("FSDP CPUOffload: parameters, gradients and optimizer states of each shard on the host")
    if sharded and reduce_bytes(setup, compute_bytes) != compute_bytes:
        plan.notes.append("FSDP2 reduces gradients in fp32 (MixedPrecisionPolicy reduce_dtype, torchtitan's default): "
                          "each unit's reduce-scatter input is 4 bytes per element")
    if setup.request.tp_plan == "transformers" and setup.tp > 1 and setup.device == "cpu" and acts is not None:
        _gathered_head_race(plan, setup, acts)
    if buckets:  # DDP
        plan.notes.append(f"DDP buckets of {DDP_BUCKET_CAP_BYTES // 2**20} MiB (bucket_cap_mb) hold a full copy of the gradients")
    return plan


def _in_backward_items(point: SweepPoint, step_bytes: int, gradient_bytes: int) -> list[MemoryItem]:
    """torchtune's optimizer_in_bwd (torchtune/training/memory.py register_optim_in_bwd_hooks): a
    parameter's optimizer steps in its post-accumulate-grad hook and the hook frees its gradient, so
    once backward has produced any gradient at most one parameter's gradient (the largest, at worst)
    and its step's temporaries exist."""
    produced = point.grad_elements > 0 or point.in_flight_elements > 0
    return [item("one parameter's gradient (stepped in its hook)", gradient_bytes if produced else 0, "gradients"),
            item("its optimizer step's temporaries", step_bytes if produced else 0, "buffers",
                 "the step runs inside backward")]


def _gathered_head_race(plan: PhasePlan, setup: "SetupFields", acts: Activations) -> None:
    """transformers' colwise_gather_output head on CPU ranks: DTensor's all-gather of the logits
    (funcol all_gather_tensor over gloo) can leave its input, the rank's tokens x vocab/tp logits,
    held by gloo's worker thread into the loss, as AutoTP's gather does
    (tensor_parallel.gathered_logits_race_above). Measured once (qwen3_moe, tp 2, fp32, vocabulary
    4,096, 1,024 tokens): one rank's peak 8,388,608 bytes (its local logits) above the other's,
    which matched the prediction; at 32,000 on none of the ranks (llama, qwen3, qwen3_moe). A note,
    not a phase: it is a race."""
    full, req = setup.model.architecture, setup.request
    held = setup.recipe.compute_bytes * req.micro_batch * req.seq_len * -(-full.vocab_size // setup.tp)
    above = gathered_logits_race_above(plan, setup, acts, held)
    if above > 0:
        plan.notes.append(f"CPU ranks (gloo): the worker thread of the LM head's logits all-gather may still hold its "
                          f"input ({held:,} bytes) into the loss; a measured peak can then read up to {above:,} bytes "
                          "above this one (a race between threads, seen at small vocabularies)")


def _autocast_copies(setup: "SetupFields", point: SweepPoint, psi: int, block: int, compute_bytes: int) -> MemoryItem:
    """torch.autocast casts each linear's weight to 16 bits once per forward (its cast cache; not
    the untied embedding or the norms' weights: _uncast_elements); each linear saves its cast
    weight for backward, so without checkpointing all of them live until their layer's backward.
    Under checkpointing the blocks save nothing: only the LM head's cast stays, plus the cast
    weights of the one block being recomputed."""
    shape, req = layout(setup), setup.request
    # low_precision's converted linears hand autocast no weight (converted_weight_elements)
    exempt, exempt_block = converted_weight_elements(setup.arch, req.low_precision)
    block -= exempt_block
    # the linears run inside a checkpoint under full checkpointing and the per-op SAC policy
    policy = "full" if req.checkpointing in ("full", "selective-op") else "none"
    chosen = checkpointed_blocks(shape.num_layers, policy, req.checkpointing_every) if shape else ()
    if req.activation_offload and setup.device != "cpu" and not any(chosen):
        # TRL's OffloadActivations copies each saved cast to the host (planner/recipes/activation_offload.py
        # autocast_weight_bytes) and the cast cache is cleared when the forward's autocast exits: in
        # backward the LM head's (kept on the device) and one block's, brought back
        held = shape.lm_head_elements + (block if point.kind is PhaseKind.START_OF_BLOCK else 0)
        return item("autocast copies of the weights (LM head, the block brought back)", compute_bytes * held,
                     "buffers", "the blocks' casts offloaded with the activations")
    if not any(chosen):
        # a layer's cast weight is released with its saved tensors once its backward has run: at a
        # moment of backward only the layers whose gradients are not yet produced hold theirs (the
        # uncast norms may be among the produced, so they are not subtracted: a bound within their
        # few elements); after the whole backward none (llama-single-bf16-sgdm-t128 measured it, +10%
        # when every cast was held to the end)
        cast = psi - _uncast_elements(setup)
        # at the start of backward, the gradients already made were made inside the forward's autocast
        # region (torchtitan's chunked loss: the LM head's), whose cast cache still holds their weights
        produced = point.grad_elements - (point.in_flight_elements if point.kind is PhaseKind.START_OF_BACKWARD else 0)
        left = min(cast, max(0, cast - produced + _norm_elements(setup)))
        if exempt:  # the blocks' converted weights not yet reached by backward were never cast
            head = psi - shape.blocks_parameters - shape.late_parameters
            reached = min(shape.blocks_parameters, max(0, point.grad_elements - head))
            left = max(0, left - exempt + exempt * reached // shape.blocks_parameters)
        return item("autocast copies of the weights", compute_bytes * left, "buffers",
                     "torch.autocast's cast cache; each linear saves its 16-bit weight for backward")
    head = shape.lm_head_elements + block * chosen.count(False)  # and the blocks not checkpointed
    recomputed = block if point.kind is PhaseKind.START_OF_BLOCK else 0
    return item("autocast copies of the weights (LM head, recomputed block)", compute_bytes * (head + recomputed),
                 "buffers", "checkpointed blocks keep no cast weights; recomputation casts one block's again")


def _norm_elements(setup: "SetupFields") -> int:
    a = setup.arch
    if a is None or setup.finetune is not None:
        return 0
    return _block_norms(a) + sum(norm_numels(a.norm, a.hidden_size))


def _block_norms(a) -> int:
    """The blocks' hidden-width norms' weight elements, once per architecture (_autocast_copies asks
    at every moment of every setting's backward)."""
    memo = derived(a)
    if "_block_norm_elements" not in memo:
        memo["_block_norm_elements"] = sum(sum(norm_numels(spec.norm, a.hidden_size)) * spec.norms
                                           for spec in layer_specs(a))
    return memo["_block_norm_elements"]


def _uncast_elements(setup: "SetupFields") -> int:
    """Parameter elements autocast never casts to 16 bits: the untied input embeddings
    (``embedding`` is in none of torch 2.13's autocast lists, aten/src/ATen/autocast_mode.cpp, so
    nn.Embedding reads its fp32 weight and returns fp32; a tied weight is still cast by the LM
    head's F.linear) and the hidden-width norms' weights (LlamaRMSNorm's ``weight * x`` is a plain
    fp32 mul). Backend peak trace, llama ddp bf16-mixed: the only 16-bit weight copies live at the
    peak are the linears' (activations._autocast_stream_extra)."""
    a = setup.arch
    if a is None or setup.finetune is not None:
        return 0
    embedding = (0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size) + a.learned_positions * a.hidden_size
    norms = _block_norms(a)
    # a multimodal model's vision tower runs on no image of a text batch: nothing casts its weights
    return embedding + norms + sum(norm_numels(a.norm, a.hidden_size)) + vision_parameters(a)


def reduce_bytes(setup: "SetupFields", compute_bytes: int) -> int:
    """Bytes per element FSDP2 reduces gradients in: MixedPrecisionPolicy.reduce_dtype, the compute
    dtype or fp32 (the request's reduce_dtype). torch 2.13 _fully_shard/_fsdp_param.py:587-600
    (init_dtype_attrs) clamps a reduce_dtype equal to param_dtype to None (no cast); otherwise
    foreach_reduce (_fsdp_collectives.py:597-603) allocates the reduce-scatter input in it and
    copies the unit's gradients in, and an accumulated gradient is kept in it
    (_fsdp_param.py:802-813 to_accumulated_grad_if_needed)."""
    return FP32 if setup.request.reduce_dtype == "fp32" else compute_bytes


def _hf_fsdp_embedding(setup: "SetupFields") -> int:
    """The embedding's elements on a rank when transformers composes FSDP2 with its own TP plan
    (tp_plan transformers, sharded over dp_shard): its fsdp plan makes the embedding a unit of its
    own, apart from the root's final norm and LM head; 0 for every other layout.

    transformers 5.25 distributed/fsdp.py apply_fully_sharded_data_parallelism, with
    configuration_utils.py base_model_fsdp_plan (embed_tokens and every layer ``free_full_weight``,
    norm ``keep_full_weight``) and the ForCausalLM's ``_fsdp_plan`` (lm_head ``keep_full_weight``):
    the embedding and each block are resharded after forward; the final norm and the LM head are one
    unit that stays gathered from its forward to its backward (reshard_after_forward=False), then is
    reduce-scattered; the root unit holds nothing. The loss runs outside every unit, so its backward
    starts before the head unit's pre_backward, which issues the last block's prefetch; the embedding
    is gathered again for its backward, last (backend/hf_tensor_parallel.py runs it)."""
    if setup.request.tp_plan != "transformers" or setup.tp == 1:
        return 0
    full = setup.model.architecture
    if full.tie_word_embeddings:
        raise PlannerError("tp_plan=transformers with FSDP2 over dp_shard and tied embeddings: transformers' fsdp "
                           "plan shards the tied weight in the embedding's unit, which the LM head's unit then reads; "
                           "not modelled", field="tp_plan")
    return -(-full.vocab_size // setup.tp) * full.hidden_size


def _deferred_gradient_bytes(setup: "SetupFields", compute_bytes: int) -> int:
    """Bytes per trained element of the unsharded gradients a deferred sync keeps (0: the loop syncs every
    micro-batch). FSDP2 moves a unit's unsharded gradient into its reduce dtype when that differs from the
    gradient's (torch 2.13 _fully_shard/_fsdp_param.py to_accumulated_grad_if_needed, called by
    _fsdp_param_group.py post_backward when reduce_grads is False) and adds the next micro-batch's into it
    (accumulate_unsharded_grad_if_needed); FSDP1's no_sync leaves the flat parameter's unsharded gradient in
    autograd's dtype (_runtime_utils.py _post_backward_hook: it returns before the cast when not syncing)."""
    if not setup.request.defer_gradient_sync:
        return 0
    return compute_bytes if setup.request.fsdp_version == 1 else reduce_bytes(setup, compute_bytes)


def _deferred_items(nbytes: int) -> list[MemoryItem]:
    """The earlier micro-batches' unsharded gradients under a deferred sync (none when ``nbytes`` is 0)."""
    if not nbytes:
        return []
    return [item("unsharded gradients of every unit (the earlier micro-batches', kept by no_sync)", nbytes,
                 "gradients", "defer_gradient_sync: the Trainer's and accelerate's no_sync on every micro-batch but "
                 "the last; _fsdp_param_group.py post_backward with reduce_grads False keeps them")]


def _fsdp_items(setup: "SetupFields", point: SweepPoint, psi: int, block: int, root: int, shard: int,
                compute_bytes: int, store_bytes: int, accumulated: bool = False,
                embedding: int = 0, deferred_bytes: int = 0) -> list[MemoryItem]:
    """What FSDP2 (torch.distributed.fsdp.fully_shard, per-parameter sharding) holds beyond the
    sharded states at one moment of backward, with every transformer block a unit and the root
    (embeddings, final norm, LM head) the last one.

    _fsdp_param_group.py: a unit is all-gathered into one flat output of its unsharded size,
    then copied out into the parameters; the root is gathered again at the start of backward
    and stays so to its end (its embedding's gradient comes last); the previous block is
    prefetched while the current one runs backward; after a unit's backward its unsharded
    gradients are reduce-scattered from one flat input, and the shard is kept in the
    parameter's dtype (fp32 under mixed precision). The reduce-scatter input is in the reduce
    dtype (fp32 with reduce_dtype fp32, torchtitan's default: 4 bytes per element while the
    unit's 16-bit gradients are copied into it, _fsdp_collectives.py:597-606). On CPU ranks
    gloo's all-gather holds a scratch copy of its output on the worker thread while it runs
    (measured by the backend).

    ``accumulated``: a micro-batch after the first (gradient accumulation, every micro-batch
    reduce-scattered): every parameter's sharded gradient from the earlier micro-batches is live
    all along (_accumulated_items), and a finished unit's reduce-scatter output is a transient
    added into it.

    ``embedding``: transformers' own TP x FSDP2 composition (_hf_fsdp_embedding): the embedding is
    the last unit, and the rest of the root (final norm, LM head) is kept gathered from the forward
    through the loss's backward, with no block prefetched before it.

    ``deferred_bytes``: a micro-batch of a deferred sync (the loop's no_sync): every unit's unsharded
    gradient from the earlier micro-batches is live all along and the new ones are added into it; no unit
    is reduce-scattered (the middle micro-batches: the last one's, which frees each unit's as it reduces
    it, holds no more)."""
    if deferred_bytes:
        return _deferred_fsdp_items(setup, point, psi, block, root, compute_bytes, deferred_bytes, embedding)
    if point.kind is PhaseKind.END_OF_BACKWARD:
        return _fsdp_root_reduce_items(setup, point, psi, block, embedding or root, shard, compute_bytes,
                                       store_bytes, accumulated, head_in_root=not embedding)
    items = _gathered_items(setup, point, psi, block, root, compute_bytes, embedding) + [
        item("unsharded gradients in flight", compute_bytes * point.in_flight_elements, "gradients",
              "a unit's gradients until its reduce-scatter"),
        item("reduce-scatter input of the finished unit" + (" (fp32)" if reduce_bytes(setup, compute_bytes) == FP32
                                                            and compute_bytes != FP32 else ""),
              reduce_bytes(setup, compute_bytes) * point.in_flight_elements if point.kind.ends_a_unit else 0,
              "buffers", "foreach_reduce: one flat input per unit, in the reduce dtype", stream=REDUCE_SCATTER_STREAM),
        # torch 2.13 _fsdp_param_group.py:640-657 post_backward: a unit's reduce-scatter input stays in
        # comm_ctx.reduce_scatter_states (reduce_scatter_max_input_buffers 1) until the next unit's
        # post_backward (FSDP::post_backward_rs_wait) drops it, so it lives through that whole block's
        # backward. Peak trace (llama fp32, cp 2 x tp 2, checkpointed, block 2's ring backward): block
        # 3's 1,583,104-byte input allocated in its post_backward_reduce, freed in block 2's rs_wait.
        item("reduce-scatter input of the block before (held until this block's post_backward)"
             + (" (fp32)" if reduce_bytes(setup, compute_bytes) == FP32 and compute_bytes != FP32 else ""),
             reduce_bytes(setup, compute_bytes) * point.reduced_before_elements, "buffers",
             "_fsdp_param_group.py post_backward: reduce_scatter_states, recycled at the next unit's post_backward",
             stream=REDUCE_SCATTER_STREAM),
    ]
    if accumulated:
        items += _accumulated_items(setup, point, psi, shard, compute_bytes, store_bytes)
    else:
        # at the start of backward the gradients already made (torchtitan's chunked loss: the LM head's, in the
        # forward) wait unsharded for the root's reduce-scatter: none of them is sharded yet
        early = point.in_flight_elements if point.kind is PhaseKind.START_OF_BACKWARD else 0
        items.append(item("sharded gradients", store_bytes * ceil_div(point.grad_elements - early, shard), "gradients"))
    if point.kind is PhaseKind.START_OF_BLOCK:
        # the root's gradients (LM head, final norm) wait unsharded for the root's reduce-scatter
        head_grads = point.grad_elements - point.in_flight_elements
        items.append(item("root gradients (unsharded, until the end of backward)",
                           compute_bytes * min(head_grads, root), "gradients"))
    return items


def _gathered_items(setup: "SetupFields", point: SweepPoint, psi: int, block: int, root: int, compute_bytes: int,
                    embedding: int = 0) -> list[MemoryItem]:
    """The units FSDP2 holds gathered at a moment of backward before its end (_fsdp_items' ``embedding``): the
    root and the block in backward, or under SHARD_GRAD_OP every unit not yet through its backward, and the
    next block's prefetched all-gather output."""
    gloo_copy = 2 if setup.device == "cpu" else 1
    keep_gathered = setup.strategy.params_unsharded_in_step  # SHARD_GRAD_OP: no reshard after forward
    # float8_all_gather: a block's converted weights gathered in fp8 (the fewest any block has: a bound)
    fp8 = converted_weight_elements(setup.arch, setup.request.low_precision)[1] if setup.request.float8_all_gather \
        else 0
    unit = fp8_gather_bytes(block, fp8, compute_bytes)
    if keep_gathered:  # check_float8_all_gather refuses fp8 gathers here
        gathered = compute_bytes * max(0, psi - point.grad_elements + point.in_flight_elements)
        source = "SHARD_GRAD_OP (reshard_after_forward=False): every unit stays gathered until its backward"
    else:
        # the last block is copied out of its prefetched flat output only at its own pre_backward,
        # after the LM head's and the final norm's backward (peak trace, llama bf16 cp 2 x tp 2 without
        # SP: FSDP::all_gather_copy_out (layers.3) after PowBackward0 of the final norm)
        current = 0 if point.kind in (PhaseKind.START_OF_BACKWARD, PhaseKind.AFTER_LM_HEAD) else unit
        gathered = compute_bytes * (root - embedding) + current
        source = ("the final norm and LM head's unit (kept from the forward) and the block in backward, gathered"
                  if embedding else "the root unit and the block in backward, gathered") \
            + (" (its float8 weights in fp8)" if fp8 else "")
    before_head = embedding and point.kind is PhaseKind.START_OF_BACKWARD  # the loss, outside every unit
    prefetch = 0 if keep_gathered or before_head else unit * gloo_copy
    return [
        item("all-gathered units", gathered, "buffers", source),
        # torch 2.13 _fsdp_collectives.py foreach_all_gather: the flat output is allocated under
        # all_gather_stream (its own allocator pool), copied out on the default stream
        item("prefetched block (all-gather output" + (" and gloo's scratch)" if gloo_copy == 2 else ")"), prefetch,
             "buffers", "FSDP paper Sec. 3.2: the next unit's all-gather overlaps the current unit's backward",
             stream=ALL_GATHER_STREAM),
    ]


def _deferred_fsdp_items(setup: "SetupFields", point: SweepPoint, psi: int, block: int, root: int,
                         compute_bytes: int, deferred_bytes: int, embedding: int = 0) -> list[MemoryItem]:
    """_fsdp_items in a micro-batch that reduces nothing (defer_gradient_sync): the gathered units as
    ever, the new gradients of the unit in backward (autograd's AccumulateGrad adds them into the kept
    ones: a transient of the unit's size), and every unit's unsharded gradients; no sharded gradient, no
    reduce-scatter input."""
    if point.kind is PhaseKind.END_OF_BACKWARD:  # the root, gathered for its own backward; nothing prefetched
        gathered, in_flight = [item("all-gathered root unit", compute_bytes * root, "buffers",
                                    "the root, gathered for its backward")], root
    else:
        gathered, in_flight = _gathered_items(setup, point, psi, block, root, compute_bytes, embedding), \
            point.in_flight_elements
    return gathered + [item("new gradients in flight (added into the kept ones)", compute_bytes * in_flight,
                            "gradients", "autograd's AccumulateGrad: the new gradient, then grad += it")] \
        + _deferred_items(deferred_bytes)


def _accumulated_items(setup: "SetupFields", point: SweepPoint, psi: int, shard: int, compute_bytes: int,
                       store_bytes: int) -> list[MemoryItem]:
    """FSDP2 in a micro-batch after the first, reduce-scattering every micro-batch (torchtitan's
    trainer; backend/train.py AccumulatingEngine). torch 2.13 _fully_shard/_fsdp_collectives.py
    foreach_reduce: the first micro-batch's reduce-scatter output becomes the sharded gradients,
    as views (:704-709, :750-753: sharded_param.grad = to_sharded_dtensor(new_sharded_grad)), cast
    first to the parameters' dtype (:696, _to_dtype_if_needed: fp32 under mixed precision);
    from the second on, ``sharded_param.grad._local_tensor += new_sharded_grad`` (:744-749)
    adds the new output into them in place, and the output (and its cast) is freed when
    foreach_reduce returns. So the whole sharded gradients (parameters' dtype) are live through
    every later micro-batch's forward and backward, and a finished unit's reduce-scatter output
    (reduce dtype, its 1/shard) and its cast are transients beside them. Peak trace (llama, fp32,
    2 ranks, 2 micro-batches): the 1/shard output of each block allocated and freed inside
    post_backward_reduce, the step's total 10.0 MB (every sharded gradient) higher through the
    second micro-batch than through the first."""
    items = [item("sharded gradients (the earlier micro-batches', accumulated into)", store_bytes * ceil_div(psi, shard),
                  "gradients", "_fsdp_collectives.py foreach_reduce: grad._local_tensor += new_sharded_grad")]
    if point.kind is PhaseKind.END_OF_BLOCK:
        reduce = reduce_bytes(setup, compute_bytes)
        output = ceil_div(point.in_flight_elements, shard)
        items.append(item("reduce-scatter output being added into the sharded gradients"
                          + (" (and its cast)" if reduce != store_bytes else ""),
                          (reduce + (store_bytes if reduce != store_bytes else 0)) * output, "buffers",
                          "_fsdp_collectives.py foreach_reduce: _to_dtype_if_needed, then +="))
    return items


def _fsdp_backward_gather_items(point: SweepPoint, psi: int, block: int, root: int, shard: int, compute_bytes: int,
                                store_bytes: int, accumulated: bool) -> list[MemoryItem]:
    """The start of FSDP2's backward on CPU ranks, before the loss's gradient: the root unit is
    gathered again for backward (pre_backward) and copied out into its parameters, and the last
    block's all-gather (output and gloo's scratch) starts while gloo's worker thread may still
    hold the root's flat all-gather output, whose last reference it drops when its work ends
    (peak trace, llama fp32 2 ranks, 2 micro-batches: an 8.39 MB free on gloo's thread after the
    block's two 2.90 MB allocations; on the other rank, before them). The model counts it (the
    worst case, as for the prefetch)."""
    items = [
        item("saved activations", point.activation_bytes, "activations"),
        item("all-gathered root unit", compute_bytes * root, "buffers", "the root, gathered and copied out for backward"),
        item("the root's flat all-gather output, until gloo's worker drops it", compute_bytes * root, "buffers",
             "peak trace, CPU ranks"),
        item("last block's all-gather (output and gloo's scratch)", 2 * compute_bytes * block, "buffers",
             "FSDP paper Sec. 3.2: the next unit's all-gather overlaps the current unit's backward"),
    ]
    if accumulated:
        items.append(item("sharded gradients (the earlier micro-batches', accumulated into)",
                          store_bytes * ceil_div(psi, shard), "gradients",
                          "_fsdp_collectives.py foreach_reduce: grad._local_tensor += new_sharded_grad"))
    return items


def _fsdp_root_reduce_items(setup: "SetupFields", point: SweepPoint, psi: int, block: int, root: int, shard: int,
                            compute_bytes: int, store_bytes: int, accumulated: bool = False,
                            head_in_root: bool = True) -> list[MemoryItem]:
    """The end of FSDP2's backward: the root unit (embeddings, final norm, LM head) gets its last
    gradient and is reduce-scattered, every block's gradients already sharded. The largest of
    four moments, each traced to the byte on CPU ranks (llama, bf16 and fp32 reduce):

    - the embedding's backward: the root gathered, all its unsharded gradients, and the last
      block's reduce-scatter input, kept until the next unit's post_backward recycles it
      (_fsdp_param_group.py:640-657, reduce_scatter_max_input_buffers 1);
    - the copy-in: post_backward reshards the root first (_fsdp_param_group.py:637-638), then
      foreach_reduce copies its gradients into one flat input of the reduce dtype and frees them
      (_fsdp_collectives.py:597-606);
    - the reduce-scatter: that input, the output (its 1/shard, reduce dtype), and the LM head's
      gradient, which the trace shows referenced until the root's post_backward returns; on CPU
      ranks gloo's reduce-scatter also copies its whole input (measured: one more input-sized
      tensor);
    - the cast of that output to the parameters' dtype (_to_dtype_if_needed, when the reduce
      dtype is not fp32 under mixed precision), after gloo's copy is freed.

    In a micro-batch after the first (``accumulated``) the root's sharded gradients from the
    earlier micro-batches are live in every moment, and the output (and its cast) is added into
    them and freed (_accumulated_items). ``head_in_root`` False: transformers' composition, whose
    last unit is the embedding alone (_hf_fsdp_embedding), the LM head reduce-scattered before."""
    reduce = reduce_bytes(setup, compute_bytes)
    late = point.in_flight_elements if setup.arch is not None and not setup.arch.tie_word_embeddings \
        and head_in_root else 0
    held = max(0, root - late) if late else 0  # the LM head and final norm's gradients
    blocks_sharded = item("sharded gradients of the blocks", store_bytes * ceil_div(psi - root, shard), "gradients")
    rs_input = item("reduce-scatter input of the root" + (" (fp32)" if reduce != compute_bytes else ""),
                    reduce * root, "buffers", "foreach_reduce: one flat input per unit, in the reduce dtype")
    output = item("reduce-scatter output (the root's shard, reduce dtype)", reduce * ceil_div(root, shard), "gradients")
    held_item = item("the LM head's unsharded gradient (referenced until the root's post-backward returns)",
                     compute_bytes * held, "gradients", "peak trace, CPU ranks")
    moments = [
        [item("all-gathered root unit", compute_bytes * root, "buffers", "the root, gathered for its backward"),
         item("root gradients (unsharded)", compute_bytes * root, "gradients", "until the root's reduce-scatter"),
         item("reduce-scatter input of the last block", reduce * block, "buffers",
              "recycled at the next unit's post_backward"), blocks_sharded],
        [item("root gradients (unsharded), being copied in", compute_bytes * root, "gradients"), rs_input,
         blocks_sharded],
        [held_item, rs_input, output, blocks_sharded]
        + ([item("gloo's copy of the reduce-scatter input", reduce * root, "buffers",
                 "CPU ranks: gloo's reduce-scatter works on a copy of its input (peak trace)")]
           if setup.device == "cpu" else []),
    ]
    if reduce != store_bytes:
        moments.append([held_item, rs_input, output, blocks_sharded,
                        item("the root's sharded gradients, cast to the parameters' dtype",
                             store_bytes * ceil_div(root, shard), "gradients", "_to_dtype_if_needed")])
    if accumulated:
        earlier = item("the root's sharded gradients (the earlier micro-batches', accumulated into)",
                       store_bytes * ceil_div(root, shard), "gradients",
                       "_fsdp_collectives.py foreach_reduce: grad._local_tensor += new_sharded_grad")
        moments = [moment + [earlier] for moment in moments]
    return max(moments, key=lambda items: sum(i.bytes for i in items))


def _fsdp_tied_sum_items(point: SweepPoint, psi: int, root: int, shard: int, compute_bytes: int,
                         store_bytes: int, accumulated: bool = False) -> list[MemoryItem]:
    """FSDP2 at the embeddings' backward of a tied model (_tied_head_elements): the root unit is
    gathered, every block's gradients are reduce-scattered, and the root's unsharded gradients
    (the head's contribution to the tied weight among them) wait for its post-backward while
    autograd sums the tied contributions (peak trace: aten::mm's and EmbeddingBackward0's
    V x h and aten::add's sum, all live, then _fsdp_param_group.py post_backward)."""
    return [
        item("all-gathered root unit", compute_bytes * root, "buffers", "the root unit, gathered for backward"),
        item("sharded gradients of the blocks", store_bytes * ceil_div(psi - root, shard), "gradients"),
        item("root gradients (unsharded), the tied head's contribution among them", compute_bytes * root,
              "gradients", "until the root's reduce-scatter at the end of backward"),
        tied_sum_item(point, compute_bytes),
        item("the root's sharded gradients (the earlier micro-batches', accumulated into)",
             store_bytes * ceil_div(root, shard) if accumulated else 0, "gradients",
             "_fsdp_collectives.py foreach_reduce: grad._local_tensor += new_sharded_grad"),
    ]


TORCH = register(TorchDistributed())
