"""The time model of one configuration: what its framework sends per step (collective volumes),
over which process groups and links, how much of it hides behind compute, the offload traffic,
and the step time that results. plan.py evaluates it over a grid; estimate_time for one estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError
from planner.time import arrays
from planner.recipes.activation_offload import transfer_seconds
from planner.recipes.losses import DEFAULT_CHUNKS, loss_kernel
from planner.recipes.loop import metric_autocasts
from planner.time import flat_shards, host_hooks, kernels, variation
from planner.time import collectives as timing
from planner.model.architecture import Architecture, layer_parameters, parameter_numels
from planner.frameworks import Buckets, Framework, Traffic, framework_of, version_for
from planner.cluster.gpus import Gpu, gpu as lookup_gpu
from planner.cluster.hardware import profile_compute_scale, profile_efficiencies, topology_of
from planner.memory.orchestrator import activation_offload_bytes, estimate, setup_of
from planner.memory.buffers import FP32
from planner.memory.optimizer import flat, state_bits
from planner.model.shapes import TensorShape, parameter_shapes
from planner.recipes.optimizers import OPTIMIZERS
from planner.recipes.low_precision import cast_bytes_per_element, converted_weight_elements, recipe_of as low_precision_recipe
from planner.recipes.precision import Recipe
from planner.schema import EstimateRequest, EstimateResult, PlanRequest, TimeEstimate, TimeTerm
from planner.strategies import strategy as lookup_strategy
from planner.cluster.topology import Topology
from planner.parallel.tensor import SP_GATHER_ROW, SP_SCATTER_ROW

HOST_TERM = "host launch wait"  # the GPU waiting for its host: the eager launches and the framework's own Python

if TYPE_CHECKING:
    from planner.setup import Setup
    from planner.time.elementwise import FrozenBase

# Device-to-host rates of offload traffic per PCIe generation, GB/s. They sit about 5% below
# links.yaml's pcie x16_gbps * efficiency (gen4: 24.0 vs 25.2); reading links.yaml instead would
# change every offload prediction, so they stay here until a measured offload run refits them.
PCIE_DEVICE_TO_HOST_GBPS = {"gen3": 12.0, "gen4": 24.0, "gen5": 48.0, "gen6": 92.0, "none": 24.0}
NVME_GBPS = 5.0  # one PCIe Gen4 NVMe drive, sequential (vendor datasheets: 5-7 GB/s); calibratable


@dataclass(frozen=True)
class Combo:
    """One configuration as the time model and the plan search take it."""

    gpus: int
    strategy: str
    checkpointing: str
    offload_optimizer: str
    offload_params: str
    shard: int | None = None  # hsdp: GPUs per shard group
    tp: int = 1  # tensor-parallel degree: consecutive GPUs of a node (planner/plan/layouts.py)
    cp: int = 1  # context-parallel degree
    sequence_parallel: bool = False
    pp: int = 1  # pipeline stages (planner/parallel/pipeline.py)
    # with full checkpointing: every N-th block; keyword-only, so that subclasses (plan.Setting)
    # keep their positional fields
    checkpointing_every: int | None = field(default=None, kw_only=True)
    tp_plan: str = field(default="torchtitan", kw_only=True)  # whose TP layout (planner/parallel/hf_plan.py)

    def data_parallel_wrapped(self, nodes: int) -> bool:
        """Whether a data-parallel wrapper (DDP, FSDP2) runs on it: not with one data-parallel
        rank under model parallelism (cp 1), as torchtitan's parallelize.py applies FSDP only
        when dp_shard > 1 or cp > 1 (memory.Setup.data_parallel_wrapped; a pipeline's stages:
        pipeline.pipeline_volumes). A single GPU's DDP or FSDP still wraps (its collectives
        are over one rank)."""
        if lookup_strategy(self.strategy).one_device:
            return False
        dp = self.gpus * nodes // (self.tp * self.cp * self.pp)
        return self.tp * self.pp == 1 or dp * self.cp > 1


@dataclass(frozen=True)
class TracedShape:
    """What the time model knows of a model traced outside the core (catalogue.TracedProfile):
    its parameter count, not its attention widths or routing. Every parameter but the untied
    input embeddings' lookup is a matmul weight one token meets (a tied head is the embedding
    matrix used as a matmul), so forward FLOPs per token are 2 x those; attention-score FLOPs
    (4 x layers x seq x q width) are left out, and an MoE's experts all count as active."""

    matmul_parameters: int
    block_parameters: int  # the mean block: ZeRO-3's and FSDP's message size
    numels: tuple[int, ...] = ()  # each parameter's elements (ZeRO-3's persistent ones)

    @classmethod
    def of(cls, profile) -> "TracedShape":
        return cls(matmul_parameters=profile.parameters - profile.late_parameters,
                   block_parameters=max(1, profile.layer_parameters), numels=tuple(profile.numels))

    def note(self) -> str:
        return (f"time model (traced): forward FLOPs per token 2 x {self.matmul_parameters:,} matmul parameters, "
                "from the traced parameter count; attention-score FLOPs are not counted and every MoE expert "
                "counts as active, so compute is a lower bound at long sequences and an upper bound for MoE")


@dataclass(frozen=True)
class FrozenBaseShape:
    """What the time model reads of a LoRA / QLoRA step (planner/recipes/finetune.py resolves which
    linears carry adapters and how the base is stored).

    - ``trainable``: the elements that make gradients (adapters, trained embedding copies): what
      DDP buckets, ZeRO reduces and partitions, and the optimizer updates.
    - ``adapter_forward_flops``: 2r(in + out) per targeted linear per token (x @ Aᵀ, then @ Bᵀ).
    - ``trained_weight_flops``: weight-gradient FLOPs per token of trained copies of frozen matmuls
      (modules_to_save LM head: 2 x hidden x vocab).
    - ``dequantize_forward_bytes`` / ``dequantize_backward_bytes``: device-memory bytes one forward
      / one backward pass moves to dequantize the quantized base (0 for a 16-bit base).
    - ``elementwise``: the frozen base's elementwise changes and the adapters' own ops
      (planner/time/elementwise.py FrozenBase, adapter_traffic)."""

    method: str
    trainable: int
    adapter_forward_flops: int
    trained_weight_flops: int
    dequantize_forward_bytes: int
    dequantize_backward_bytes: int
    elementwise: FrozenBase | None = None
    adapted_linears: int = 0  # the linears carrying adapters (each adds PEFT's modules and two trained tensors)

    @classmethod
    def of(cls, arch, f, compute_bytes: int) -> "FrozenBaseShape":
        from planner.model.architecture import layer_specs
        from planner.recipes.finetune import trainable_numels
        from planner.model.linears import block_linears
        from planner.time.elementwise import FrozenBase, adapter_traffic

        adapters = 0
        forward = backward = 0
        adapted: list[tuple[int, int]] = []
        for spec in layer_specs(arch):
            for linear in block_linears(arch, spec):
                if f.targeted(linear):
                    adapters += 2 * f.rank * (linear.in_features + linear.out_features)
                    adapted.append((linear.in_features, linear.out_features))
                per_pass = dequantize_bytes(linear.in_features * linear.out_features, f.quantize,
                                            linear.out_features, compute_bytes)
                forward += per_pass if f.quantize != "int8" else 0  # LLM.int8's forward: int8 x int8
                backward += per_pass
        head = 2 * arch.hidden_size * arch.vocab_size if f.train_embeddings else 0
        elementwise = FrozenBase(adapter_traffic(adapted, f.dropout, f.quantize in ("nf4", "fp4"), compute_bytes),
                                 embeddings_trained=f.train_embeddings)
        return cls(method=f.method, trainable=sum(trainable_numels(arch, f)), adapter_forward_flops=adapters,
                   trained_weight_flops=head, dequantize_forward_bytes=forward, dequantize_backward_bytes=backward,
                   elementwise=elementwise, adapted_linears=len(adapted))


def dequantize_bytes(numel: int, quantize: str, out_features: int, compute_bytes: int) -> int:
    """Device-memory bytes one dequantization of one bitsandbytes weight moves: it reads the
    stored weight and its constants and writes the weight in the compute dtype.

    4-bit (bitsandbytes 0.50 functional.py dequantize_4bit): with double quantization it first
    dequantizes the uint8 absmax to fp32 (dequantize_blockwise: read 1 byte, write 4 per block of
    64), then reads the packed values (2 per byte) and the fp32 absmax and writes numel values.
    MatMul4Bit (autograd/_functions.py) does it in forward and again in backward for the input's
    gradient. LLM.int8 (MatMul8bitLt) multiplies int8 x int8 in forward, without dequantizing
    the weight; its backward rebuilds CB * SCB / 127 in the compute dtype for the input's gradient."""
    from planner.recipes.finetune import BNB_4BIT_BLOCK, quantized_weight_bytes

    if quantize == "none":
        return 0
    stored = quantized_weight_bytes(numel, quantize, out_features)
    if quantize == "int8":
        return stored + compute_bytes * numel
    absmax = -(-numel // BNB_4BIT_BLOCK)
    return stored + 4 * absmax * 2 + compute_bytes * numel  # fp32 absmax written, then read


def frozen_base_shape(request: EstimateRequest, arch, framework: Framework, recipe: Recipe) -> FrozenBaseShape | None:
    """The request's LoRA / QLoRA as the time model takes it (None for full fine-tuning), with the
    framework version and precision recipe its Setup (or the plan) resolved."""
    if request.finetune == "full" or arch is None or isinstance(arch, TracedShape):
        return None
    from planner.recipes.finetune import resolve_finetune

    f = resolve_finetune(request, arch, lookup_strategy(request.strategy), framework, recipe)
    return FrozenBaseShape.of(arch, f, recipe.compute_bytes)


def _flops_per_token(shape, seq_len: int, checkpointing: str,
                     frozen: FrozenBaseShape | None = None, every: int | None = None) -> tuple[float, float]:
    """(FLOPs per token the step runs, recomputation included; FLOPs per token MFU counts)."""
    if frozen is not None:
        return timing.frozen_base_flops_per_token(shape, seq_len, checkpointing, frozen.adapter_forward_flops,
                                                  frozen.trained_weight_flops)
    if isinstance(shape, TracedShape):
        forward = 2 * shape.matmul_parameters
        return forward * (4 if checkpointing == "full" else 3), 3 * forward
    return timing.flops_per_token(shape, seq_len, checkpointing, every), timing.model_flops_per_token(shape, seq_len)


@dataclass(frozen=True)
class StepSettings:
    """What the step time reads beyond the configuration: the precision (its name and its recipe,
    decoded once), the sequence length, the node count and the achieved fractions of peak compute
    and of the modelled link bandwidths."""

    precision: str
    recipe: Recipe
    seq_len: int
    nodes: int
    compute_efficiency: float | None  # the override: every FLOP at this fraction of peak (None: planner/time/kernels.py)
    link_efficiency: float
    reduce_dtype: str = "compute"  # FSDP2's MixedPrecisionPolicy.reduce_dtype (the request's)
    fsdp_version: int = 2  # the request's torch FSDP (a plan's candidates are FSDP2's, what it writes)
    attention: str = "sdpa"
    attention_kernel: str = "flash-attention-2"
    attention_unpad: str = "none"  # flash attention's varlen path over a padded batch (kernels.UNPAD)
    optimizer: str = "adamw"
    compute_scale: float = 1.0  # a calibration profile's measured kernel-rate factor (planner/time/profiles.py)
    loss: str = "hf"  # the loss implementation (planner/recipes/losses.py)
    loss_chunks: int | None = None  # the request's (chunked-in-forward's head GEMMs per chunk); None: the default
    low_precision: str = "none"  # fp8/fp4 linears (planner/recipes/low_precision.py)
    float8_all_gather: bool = False  # FSDP2 gathers the float8 linears' weights in fp8
    framework_version: str | None = None  # the request's (planner/frameworks/base.py); None: the default
    gradient_clipping: bool = False  # the gradients clipped by their global norm before each step
    compile: str = "none"  # torch.compile: "none", "blocks" or "model" (planner/time/fusion.py)
    fused_kernels: tuple[str, ...] = ()  # Liger's fused block kernels (planner/recipes/fused_kernels.py)
    async_tp: bool = False  # the sequence-parallel collectives pipelined with their matmuls (_async_tp_seconds)
    defer_gradient_sync: bool = False  # the loop's no_sync: FSDP reduces once per step (Traffic.deferred_sync)
    train_metrics: int = 0  # the loop's cross-entropy metrics on each micro-batch's kept logits (recipes/loop.py)

    def framework(self, s) -> Framework:
        """The framework version that realises strategy ``s`` in this step: the request's where it
        is ``s``'s framework's (a plan's version names one framework), else the default."""
        return framework_of(s, version_for(s, self.framework_version))

    @classmethod
    def of(cls, req: PlanRequest, recipe: Recipe, compute_scale: float = 1.0) -> "StepSettings":
        """``recipe``: the request's precision, decoded once by the plan's search."""
        return cls(precision=req.precision, recipe=recipe, framework_version=req.framework_version,
                   seq_len=req.seq_len, nodes=req.nodes,
                   compute_efficiency=req.compute_efficiency, link_efficiency=req.link_efficiency,
                   reduce_dtype=req.reduce_dtype, attention=req.attention, optimizer=req.optimizer,
                   attention_kernel=req.attention_kernel, attention_unpad=req.attention_unpad,
                   compute_scale=compute_scale, loss=req.loss, loss_chunks=req.loss_chunks,
                   low_precision=req.low_precision,
                   float8_all_gather=req.float8_all_gather, gradient_clipping=req.gradient_clipping,
                   compile=req.compile, fused_kernels=req.fused_kernels, async_tp=req.async_tp,
                   defer_gradient_sync=req.defer_gradient_sync, train_metrics=req.train_metrics)


def collective_volumes(request: EstimateRequest) -> list[dict]:
    """What the time model sends per optimizer step for this configuration, per collective:
    payload bytes (before the ring's 2(n-1)/n or (n-1)/n factor), message size and group."""
    result = estimate(request)
    if result.model.architecture is None:
        return []
    request = result.request  # with what a ds_config fixed (micro-batch, accumulation, optimizer)

    combo, buckets, setup = resolved_combo(request)
    per_rank = request.micro_batch * request.gradient_accumulation
    wb = setup.recipe.wire_bytes
    arch = Architecture.model_validate(result.model.architecture)
    frozen = frozen_base_shape(request, arch, setup.framework, setup.recipe)
    rows = combo_collectives(setup.recipe, setup.framework, combo, result.parameters // combo.tp, request.micro_batch,
                             per_rank, wb, arch, buckets, trainable=frozen.trainable if frozen else None,
                             reduce_dtype=request.reduce_dtype, nodes=request.nodes,
                             fp8_gathered=_fp8_gathered(request.float8_all_gather, request.low_precision, arch),
                             deferred_sync=request.defer_gradient_sync)
    out = [{"what": what, "bytes_per_step": int(volume), "message_bytes": int(message), "group": group}
           for what, volume, _, message, group, _ in rows]
    if request.ep > 1:  # routed experts over the expert-data-parallel group; the all-to-alls
        from planner.parallel.experts import expert_volumes

        out = expert_volumes(arch, setup, out, result.parameters)
    if combo.tp * combo.cp > 1:
        out += [{"what": what, "bytes_per_step": int(volume), "message_bytes": int(message * request.micro_batch),
                 "group": group}
                for what, volume, _, message, group in model_parallel_collectives(
                    setup.recipe, combo, arch, per_rank, request.seq_len,
                    setup.loss_chunks if request.loss == "chunked-in-forward" else 1)]
    if request.pp > 1:  # a stage's data-parallel collectives carry its parameters only; p2p between stages
        from planner.parallel.pipeline import pipeline_volumes

        out = pipeline_volumes(setup, out)
    return out


def estimate_time(request: EstimateRequest, result: EstimateResult, profile=None,
                  traced: TracedShape | None = None) -> TimeEstimate | None:
    """The time model for one estimate's configuration (None without an architecture or a traced
    shape, or on CPU); ``profile``: the calibration profile the request names (planner.time.profiles.Profile)."""
    g = lookup_gpu(request.gpu)
    if (result.model.architecture is None and traced is None) or (g.is_cpu and request.profile is None):
        return None
    per_rank = request.micro_batch * request.gradient_accumulation
    topo, fabric_name, nics = topology_of(request, g)
    compute_efficiency, link_efficiency = profile_efficiencies(
        request.profile, request.gpu, topo, request.gpus, PlanRequest.model_fields["compute_efficiency"].default,
        PlanRequest.model_fields["link_efficiency"].default, profile)  # the plan's defaults, so both time alike
    # the estimate's own Setup where it has one for this request (a traced model is timed from its count)
    known = setup_of(result) if traced is None and result.request == request else None
    combo, buckets, setup = resolved_combo(request, result.parameters if traced is not None else None, known)
    settings = StepSettings(precision=result.request.precision, recipe=setup.recipe,
                            framework_version=setup.request.framework_version, seq_len=request.seq_len, nodes=request.nodes,
                            compute_efficiency=compute_efficiency, link_efficiency=link_efficiency,
                            reduce_dtype=request.reduce_dtype, fsdp_version=request.fsdp_version,
                            attention=request.attention, attention_kernel=request.attention_kernel,
                            attention_unpad=request.attention_unpad,
                            optimizer=result.request.optimizer,
                            compute_scale=profile_compute_scale(request.profile, profile), loss=request.loss,
                            loss_chunks=request.loss_chunks,
                            low_precision=request.low_precision, float8_all_gather=request.float8_all_gather,
                            gradient_clipping=request.gradient_clipping, compile=request.compile,
                            fused_kernels=request.fused_kernels, async_tp=request.async_tp,
                            defer_gradient_sync=request.defer_gradient_sync, train_metrics=request.train_metrics)
    arch = traced if traced is not None else Architecture.model_validate(result.model.architecture)
    moved = activation_offload_bytes(setup) / request.micro_batch if traced is None else 0.0
    t = step_times(settings, combo, request.micro_batch, per_rank, result.parameters, arch, g,
                   topo, timing.fabric(fabric_name), nics, buckets,
                   frozen=frozen_base_shape(request, arch, setup.framework, setup.recipe), offloaded_per_sequence=moved)[0]  # one micro-batch: floats
    if request.pp > 1 or request.ep > 1:  # the pipeline bubble, p2p and expert all-to-alls (issue 12)
        from planner.parallel.pipeline import parallel_step

        t = _pipeline_terms(t, parallel_step(t, setup, arch, topo, timing.fabric(fabric_name), nics, link_efficiency))
    return TimeEstimate(step_seconds=t.step_seconds, compute_seconds=t.compute_seconds,
                        communication_seconds=t.communication_seconds,
                        exposed_communication_seconds=t.exposed_communication_seconds,
                        offload_seconds=t.offload_seconds, tokens_per_second=t.tokens_per_second, mfu=t.mfu,
                        hfu=t.hfu, terms=[TimeTerm(name=n, seconds=v, source=src) for n, v, src in t.terms],
                        ring_bandwidth_gbps=t.ring_bandwidth_gbps if math.isfinite(t.ring_bandwidth_gbps) else None,
                        topology=topo.source)


def _pipeline_terms(whole: timing.StepTime, staged: timing.StepTime) -> timing.StepTime:
    """The terms of a pipeline or expert-parallel step: the compute terms at the stage's share
    (the schedule's compute, bubble included, over the whole model's), the exposed communication
    and offload as that step has them."""
    share = staged.compute_seconds / whole.compute_seconds if whole.compute_seconds else 0.0
    replaced = {"exposed communication": staged.exposed_communication_seconds, "offload": staged.offload_seconds}
    labels = tuple((name, source if name in replaced else f"{source}; x {share:.3f}: the stage's share, "
                    "bubble included") for name, source in whole.term_labels)
    values = tuple(replaced[name] if name in replaced else seconds * share
                   for (name, _), seconds in zip(whole.term_labels, whole.term_values))
    return staged._replace(term_labels=labels, term_block=values, term_option=None)


def estimate_with_time(request: EstimateRequest, profile=None) -> EstimateResult:
    """``profile``: the Profile the request names, read by the adapter (backend/profiles.py)."""
    result = estimate(request)  # result.request holds what a ds_config fixed (micro-batch, accumulation, optimizer)
    return result.model_copy(update={"time": estimate_time(result.request, result, profile)})


def resolved_combo(request: EstimateRequest, parameters: int | None = None,
                   setup: "Setup | None" = None) -> tuple[Combo, Buckets, "Setup"]:
    """One estimate's configuration as the time model takes it, with offload and bucket sizes as
    resolved (--ds-config included), and the resolved Setup it was read from (the pipeline's
    time reads it too: resolved once). ``parameters``: the model's count, for a model resolved
    outside the core (traced), whose config the core cannot read again. ``setup``: the request
    already resolved (the estimate's own), not resolved again."""
    from planner.model.catalogue import raw_parameters
    from planner.memory.orchestrator import resolve

    if setup is None:
        setup = resolve(request, model=raw_parameters(parameters) if parameters is not None else None)
    zero = setup.zero
    # HSDP's shard group per TP rank: dp_shard x cp (the cp ranks shard the parameters with the
    # data-parallel ranks; its replicas all-reduce a 1/(dp_shard x cp) shard of the gradients)
    shard = setup.dims.dp_shard * setup.dims.cp if lookup_strategy(request.strategy).shard_within_node else None
    combo = Combo(request.gpus, request.strategy, request.checkpointing, zero.offload_optimizer, zero.offload_params,
                  shard, request.tp, request.cp, setup.sequence_parallel, request.pp,
                  checkpointing_every=request.checkpointing_every, tp_plan=request.tp_plan)
    return combo, Buckets(zero.reduce_bucket_size, zero.allgather_bucket_size, zero.prefetch_bucket_size,
                          zero.param_persistence_threshold, zero.max_reuse_distance,
                          zero.contiguous_gradients), setup


def _fp8_gathered(float8_all_gather: bool, low_precision: str, arch) -> tuple[int, int]:
    """(the model's, one block's) weight elements FSDP2 gathers in fp8 (Traffic.fp8_gathered)."""
    if not float8_all_gather or not isinstance(arch, Architecture):
        return 0, 0
    return converted_weight_elements(arch, low_precision)


def combo_collectives(recipe: Recipe, framework: Framework, combo: Combo, psi: int, micro, per_rank: int,
                      wb: int, arch=None, buckets: Buckets = Buckets(),
                      trainable: int | None = None, reduce_dtype: str = "compute", *,
                      nodes: int, fp8_gathered: tuple[int, int] = (0, 0),
                      deferred_sync: bool = False) -> list[tuple[str, Any, int, float, str]]:
    """(what, bytes per step, ring passes, message bytes, group) for the strategy's collectives,
    as its framework sends them (planner/frameworks/: Framework.collectives).

    Message sizes are what the frameworks really send: DDP's 25 MiB buckets, DeepSpeed's reduce
    and all-gather buckets (capped by the model), and for ZeRO-3 and FSDP one transformer block
    at a time (the FSDP unit; ZeRO-3 fetches a module's parameters, at most prefetch_bucket_size).
    ``micro``: one micro-batch size, or a numpy array of the options (then each volume is an array).
    ``reduce_dtype`` fp32: FSDP2 reduce-scatters its gradients in fp32 (4 bytes on the wire).
    ``nodes``: with the combo's degrees, whether a data-parallel wrapper runs at all (Combo.data_parallel_wrapped)."""
    return framework.collectives(lookup_strategy(combo.strategy),
                                 combo_traffic(recipe, combo, psi, micro, per_rank, wb, arch, buckets, trainable,
                                               reduce_dtype, nodes=nodes, fp8_gathered=fp8_gathered,
                                               deferred_sync=deferred_sync))


def combo_traffic(recipe: Recipe, combo: Combo, psi: int, micro, per_rank: int, wb: int, arch=None,
                  buckets: Buckets = Buckets(), trainable: int | None = None, reduce_dtype: str = "compute", *,
                  nodes: int, fp8_gathered: tuple[int, int] = (0, 0), fsdp_version: int = 2,
                  deferred_sync: bool = False) -> Traffic:
    """What the data-parallel wrapper moves in one step (combo_collectives' arguments): the
    frameworks' collectives and their compute-stream copies read it."""
    s = lookup_strategy(combo.strategy)
    block = (arch.block_parameters if isinstance(arch, TracedShape) else layer_parameters(arch)) if arch is not None \
        else max(psi // 100, 1)
    # each parameter's elements (ZeRO-3 never gathers its persistent small ones); under tp, psi is a
    # rank's share, which the whole model's numels do not describe
    numels = () if combo.tp > 1 else tuple(arch.numels) if isinstance(arch, TracedShape) else \
        tuple(parameter_numels(arch)) if isinstance(arch, Architecture) else ()
    traffic = Traffic(psi=psi, wire_bytes=wb, block=block, step=arrays.full_like(arrays.as_float(micro), 1.0),
                      accumulation=per_rank / micro, recipe=recipe, shard=combo.shard or combo.gpus,
                      buckets=buckets, trainable=trainable,
                      reduce_bytes=FP32 if reduce_dtype == "fp32" and s.shards_parameters else wb,
                      wrapped=combo.data_parallel_wrapped(nodes), numels=numels, fp8_gathered=fp8_gathered,
                      fsdp_version=fsdp_version, pipelined=combo.pp > 1, deferred_sync=deferred_sync)
    return traffic


def process_group(combo: Combo, group: str, nodes: int) -> tuple[timing.Group, tuple[int, ...]]:
    """The process group a collective runs over, and its members inside one node.

    world / shard (ZeRO and FSDP shard over the whole data-parallel group): every GPU of every node.
    HSDP's shard group: `shard` consecutive ranks (DeviceMesh's inner dimension), inside a node when
    it fits there. HSDP's replica group: the GPUs at the same place in every shard group, so every
    shard-th GPU of a node, and each of the node's `shard` replica groups crosses its NICs at once."""
    if combo.tp > 1 or group in ("tp", "cp"):
        return _model_parallel_group(combo, group, nodes)
    g = combo.gpus
    world = g * nodes
    shard = combo.shard
    if group == "replicas" and shard:
        if shard < g:
            return timing.Group(world // shard, g // shard, shard), tuple(range(0, g, shard))
        return timing.Group(world // shard, 1, g), (0,)
    if group == "shard" and shard:
        if shard <= g:
            return timing.Group(shard, shard, g // shard), tuple(range(shard))
        return timing.Group(shard, g, 1), tuple(range(g))
    return timing.Group(world, g, 1), tuple(range(g))


def _model_parallel_group(combo: Combo, group: str, nodes: int) -> tuple[timing.Group, tuple[int, ...]]:
    """Groups of a layout with model parallelism, placed as torchtitan's mesh (pp, dp_replicate,
    dp_shard, cp, tp; tp innermost): a TP group is tp consecutive GPUs of a node; a CP group the
    GPUs tp apart; the data-parallel group (FSDP shards over dp_shard x cp) the GPUs tp apart over
    every node, tp such groups per node crossing its NICs at once."""
    g, tp = combo.gpus, combo.tp
    world = g * nodes
    if group == "tp":
        return timing.Group(tp, tp, g // tp), tuple(range(tp))
    if group == "cp":
        span = tp * combo.cp
        if span <= g:
            return timing.Group(combo.cp, combo.cp, g // span), tuple(range(0, span, tp))
        return timing.Group(combo.cp, g // tp, tp), tuple(range(0, g, tp))
    if group == "replicas" and combo.shard:
        shard = combo.shard  # data-parallel ranks per shard group
        per_node = max(1, g // (tp * shard))
        return timing.Group(world // (tp * shard), per_node, g // per_node), tuple(range(0, g, tp * shard))
    if group == "shard" and combo.shard and combo.shard * tp <= g:
        return timing.Group(combo.shard, combo.shard, g // combo.shard), tuple(range(0, combo.shard * tp, tp))
    return timing.Group(world // tp, g // tp, tp), tuple(range(0, g, tp))


def model_parallel_collectives(recipe: Recipe, combo: Combo, arch, per_rank: int, seq_len: int,
                               loss_chunks: int = 1) -> list[tuple[str, float, int, float, str]]:
    """(what, bytes per step, ring passes, message bytes at micro-batch 1, group) of the TP group's
    per-layer collectives (tensor_parallel.tp_collectives) and the CP group's K/V exchange
    (context_parallel.cp_collectives). The bytes per step do not depend on the micro-batch (its
    tokens times the accumulation steps are the rank's share); each message grows with it."""
    from planner.parallel.context import cp_collectives
    from planner.parallel.hf_plan import hf_tp_collectives
    from planner.parallel.tensor import rank_architecture, tp_collectives

    wb = recipe.compute_bytes  # activations cross the TP/CP groups in the compute dtype
    if combo.tp_plan == "transformers":
        rows = [(what, volume, passes, message, "tp") for what, volume, passes, message in hf_tp_collectives(
            arch, tokens=seq_len, micro_batches=per_rank, b=wb, stream_bytes=recipe.param_bytes, tp=combo.tp,
            checkpointing=combo.checkpointing)]
        return rows
    # torch's TP computes the loss vocab-parallel (loss_parallel); DeepSpeed's AutoTP gathers the
    # logits whole (planner/parallel/tensor.py tp_fields)
    vocab_parallel = not framework_of(lookup_strategy(combo.strategy)).autotp
    rows = [(what, volume, passes, message, "tp") for what, volume, passes, message in tp_collectives(
        arch, tokens=seq_len // combo.cp, micro_batches=per_rank, b=wb, tp=combo.tp,
        sequence_parallel=combo.sequence_parallel, checkpointing=combo.checkpointing,
        vocab_parallel_loss=vocab_parallel, loss_chunks=loss_chunks)]
    rows += [(what, volume, passes, message, "cp") for what, volume, passes, message in cp_collectives(
        rank_architecture(arch, combo.tp), tokens=seq_len, micro_batches=per_rank, b=wb, cp=combo.cp,
        checkpointing=combo.checkpointing)]
    return rows


def _over_group(combo: Combo, group: str, nodes: int, topo: Topology, req: "StepSettings", nic_gbps: float,
                fabric: dict, volume, message: float, passes: int) -> timing.CollectiveTime:
    """One collective on its process group's links: inside a node at the group's slowest ring,
    across nodes at the NICs (timing.collective_seconds)."""
    key = (combo.gpus, combo.tp, combo.cp, combo.shard, group, nodes, id(topo), req.link_efficiency, nic_gbps,
           fabric["latency_us"])
    hit = _GROUP_WIRES.get(key)
    if hit is None or hit[0] is not topo:
        layout, members = process_group(combo, group, nodes)
        _, intra_bw, intra_lat = timing.ring_over(topo, members)
        if len(_GROUP_WIRES) >= 1024:
            _GROUP_WIRES.clear()
        hit = _GROUP_WIRES[key] = (topo, layout, timing.Wire(intra_bw * req.link_efficiency, intra_lat, nic_gbps,
                                                             fabric["latency_us"]))
    return timing.collective_seconds(volume, hit[1], hit[2], message, passes)


# _over_group's process group and links, by what they are read from (the plan times every setting's
# collectives over the same few groups); the topology is kept beside them, its identity in the key
_GROUP_WIRES: dict[tuple, tuple[Topology, timing.Group, timing.Wire]] = {}


def _data_parallel_seconds(req: "StepSettings", fw: Framework, s, combo: Combo, traffic: Traffic, topo: Topology,
                           fabric: dict, nic_gbps: float, slowest: float) -> tuple[Any, Any, float, Any]:
    """(seconds, of them what the forward pass sends, the slowest link's GB/s, from ``slowest`` on,
    the seconds weighted by the share of the node's ring rate each collective runs at) of the
    data-parallel framework's collectives (FSDP/ZeRO/DDP) in one step. What they send does not
    depend on checkpointing (Traffic carries no policy: a ZeRO-3 or FSDP gather for the
    recomputation is the backward's gather), so a setting's checkpointing options share them.
    ``slowest`` starts at the node's ring rate: a collective through slower NICs moves fewer bytes a
    second, and what it costs the compute beside it beyond the SMs it holds follows its bytes
    (timing.contention_seconds)."""
    nodes = req.nodes
    node_gbps = slowest
    # every sum starts from a float: numpy broadcasts it over the options (fewer array operations)
    comm = 0.0
    in_forward = 0.0  # of it, what the forward pass sends
    at_node_rate = 0.0  # comm, each collective weighted by its rate over the node's ring rate
    for _, volume, passes, message, group, forward_share in fw.collectives(s, traffic):
        t = _over_group(combo, group, nodes, topo, req, nic_gbps, fabric, arrays.as_float(volume), message, passes)
        comm += t.seconds
        at_node_rate = at_node_rate + t.seconds * arrays.minimum(1.0, t.bottleneck_gbps / node_gbps)
        if forward_share:
            in_forward = in_forward + forward_share * t.seconds
        slowest = min(slowest, arrays.smallest(t.bottleneck_gbps))
    return comm, in_forward, slowest, at_node_rate


# a Combo's fields but its checkpointing policy: _data_parallel_seconds' key in step_times
_UNCHECKPOINTED = attrgetter(*(name for name in Combo.__dataclass_fields__
                               if name not in ("checkpointing", "checkpointing_every")))


def step_times(req: "StepSettings", combo: Combo, micro, per_rank: int, psi: int, arch, g: Gpu,
               topo: Topology, fabric: dict, nics: int, buckets: Buckets = Buckets(),
               frozen: FrozenBaseShape | None = None, offloaded_per_sequence: float = 0.0,
               sent: dict | None = None) -> list[timing.StepTime]:
    """The step time of each micro-batch option: ``micro`` is one size (a single estimate: plain
    floats throughout) or a numpy array of them (the plan search); the same formulas either way.
    ``frozen``: a LoRA / QLoRA step (fewer FLOPs, gradient traffic of the trainable elements only,
    the base's dequantization per pass); None for full fine-tuning. ``offloaded_per_sequence``:
    activation_offload's bytes per sequence a rank moves to the host and back (0: no offloading).
    ``sent``: where a caller that times many settings of one ``req``, model, GPU and topology (the
    plan search) keeps what settings share by its key: the data-parallel collectives' seconds
    (_data_parallel_seconds) and the kernels' (compute_seconds)."""
    wb = req.recipe.wire_bytes
    dtype = req.recipe.peak_dtype(g.peak_tflops)
    peak_flops = g.peak_tflops[dtype] * 1e12
    tokens_rank = per_rank * req.seq_len
    model_parallel = combo.tp * combo.cp  # GPUs that share one data-parallel rank's tokens
    per_token, model_per_token = _flops_per_token(arch, req.seq_len, combo.checkpointing, frozen,
                                                  combo.checkpointing_every)
    compute, backward, optimizer, hardware_flops, terms, clocked = compute_seconds(
        req, combo, micro, per_rank, psi, arch, g, frozen, tokens_rank * per_token / model_parallel, sent)
    # every rank waits for the slowest GPU's clock-bound kernels (planner/time/variation.py)
    world = combo.gpus * req.nodes
    slowest_gpu = 0.0 if g.is_cpu else clocked * variation.slowest_share(world)
    backward = backward + slowest_gpu * backward / arrays.maximum(compute, 1e-30)
    compute = compute + slowest_gpu
    terms = terms + [(SLOWEST_GPU_TERM, slowest_gpu, variation.source(world))]
    ring, ring_bw, _ = timing.node_ring(topo, combo.gpus)
    s = lookup_strategy(combo.strategy)
    fw = req.framework(s)  # the request's framework version, resolved once for the step
    nodes = req.nodes
    nic_gbps = nics * fabric["gbps"] * fabric["efficiency"] * req.link_efficiency
    trainable = frozen.trainable if frozen is not None else None
    key = None if sent is None else (_UNCHECKPOINTED(combo), tuple(micro.tolist()) if arrays.is_array(micro) else micro,
                                     per_rank, psi, buckets, trainable)
    hit = None if key is None else sent.get(key)
    if hit is None:
        # what the wrapper moves, read by its collectives and by its copies on the compute stream
        traffic = combo_traffic(req.recipe, combo, psi // combo.tp, micro, per_rank, wb, arch, buckets, trainable,
                                req.reduce_dtype, nodes=nodes,
                                fp8_gathered=_fp8_gathered(req.float8_all_gather, req.low_precision, arch),
                                fsdp_version=req.fsdp_version, deferred_sync=req.defer_gradient_sync)
        hit = (_data_parallel_seconds(req, fw, s, combo, traffic, topo, fabric, nic_gbps, ring_bw * req.link_efficiency)
               + _copy_seconds(req, fw, s, combo, traffic, g, dtype))
        if key is not None:
            sent[key] = hit
    # every later sum makes a new array: the remembered ones are not changed
    comm, in_forward, slowest, at_node_rate, copies, copies_backward, copies_after = hit
    # the copies after the backward's collectives hide none of them, as the optimizer step
    compute, backward, optimizer = compute + copies, backward + copies_backward, optimizer + copies_after
    exposed_model_parallel = 0.0
    pipelined_tp = (0.0, 0.0)  # async TP's own work on the compute stream: (seconds, of them in backward)
    hidden_tp = 0.0  # async TP's transfers hidden behind the matmuls
    windows = None  # async TP's matmul windows, shared by its two rows (_async_tp_windows)
    data_parallel = comm + 0.0  # what FSDP/ZeRO/DDP send, hidden behind the framework's windows (a copy)
    if model_parallel > 1 and arch is not None:
        chunks = (req.loss_chunks or DEFAULT_CHUNKS) if req.loss == "chunked-in-forward" else 1
        for what, volume, passes, message, group in model_parallel_collectives(req.recipe, combo, arch, per_rank,
                                                                               req.seq_len, chunks):
            # a ring's time is a bandwidth term in the bytes plus a latency term per message
            # (timing._ring): two evaluations give both, then every micro-batch's message size
            one = _over_group(combo, group, nodes, topo, req, nic_gbps, fabric, float(volume), volume, passes)
            two = _over_group(combo, group, nodes, topo, req, nic_gbps, fabric, float(volume), volume / 2, passes)
            per_message = float(arrays.item(two.seconds, 0)) - float(arrays.item(one.seconds, 0))
            seconds = float(arrays.item(one.seconds, 0)) - per_message + per_message * volume / (message * micro)
            # TP: on each layer's critical path, nothing hides it unless async TP pipelines it (_async_tp_seconds);
            # CP: ring attention overlaps the K/V exchange with the attention it feeds (Liu et
            # al. 2023, "Ring Attention", Sec. 3), only what exceeds the compute shows
            if req.async_tp and what in (SP_GATHER_ROW, SP_SCATTER_ROW):
                windows = windows or _async_tp_windows(req, combo, arch, g, dtype, micro)
                shown, work = _async_tp_seconds(combo, windows, micro, per_rank, seconds,
                                                volume / (message * micro), message * micro, what)
                exposed_model_parallel = exposed_model_parallel + shown
                pipelined_tp = (pipelined_tp[0] + work[0], pipelined_tp[1] + work[1])
                hidden_tp = hidden_tp + (seconds - shown)
            else:
                exposed_model_parallel = exposed_model_parallel + (
                    seconds if group == "tp" else arrays.maximum(0.0, seconds - compute))
            comm = comm + seconds
            slowest = min(slowest, arrays.smallest(one.bottleneck_gbps))
    # the optimizer step's own collectives (Muon on FSDP2 shards): inside the step, nothing hides them
    stepping = 0.0
    for (message, passes), count in (optimizer_collectives(req, combo, arch) if frozen is None else {}).items():
        one = _over_group(combo, "shard", nodes, topo, req, nic_gbps, fabric, float(message), message, passes)
        stepping = stepping + count * float(arrays.item(one.seconds, 0))
    comm = comm + stepping
    per_micro_batch = exposed_model_parallel + 0.0  # on each micro-batch's critical path (a pipeline's bubble stretches it)
    exposed_model_parallel = exposed_model_parallel + stepping
    compute, backward = compute + pipelined_tp[0], backward + pipelined_tp[1]
    offload = offload_seconds(combo, psi // combo.tp, per_rank / micro, combo.gpus * nodes // combo.tp, wb, g,
                              trainable)
    dequantize = _dequantize_seconds(frozen, combo.checkpointing, per_rank / micro, g)
    # activation_offload (planner/recipes/activation_offload.py): per_rank sequences' saved tensors to
    # the host beside the forward's compute and back on demand in backward, over the GPU's host link
    saved_to_host = transfer_seconds(per_rank * offloaded_per_sequence, compute - backward,
                                     PCIE_DEVICE_TO_HOST_GBPS.get(g.pcie, 24.0) * 1e9) if offloaded_per_sequence \
        else 0.0
    offload = offload + saved_to_host
    model_flops = tokens_rank * model_per_token / model_parallel
    tokens = tokens_rank / model_parallel * world
    # every option at once (elementwise: the same floating-point operations as one option alone)
    busy = compute + dequantize
    exposed_data_parallel = _exposed_data_parallel(fw, s, in_forward, data_parallel - in_forward,
                                                   busy - backward - optimizer, backward, arch)
    exposed = exposed_data_parallel + exposed_model_parallel
    # the hidden collectives slow the compute they run beside (timing.contention_seconds)
    contention = timing.contention_seconds(data_parallel - exposed_data_parallel, g.sms, topo, ring,
                                           arrays.where(data_parallel > 0, at_node_rate / arrays.maximum(data_parallel, 1e-30), 0.0))
    # async TP's hidden transfers cross the node's NVLink and HBM beside the matmuls as the data-parallel ones do
    # (contention_seconds' memory traffic and power; its copy engines hold no SMs, TE's userbuffers some)
    contention = contention + timing.contention_seconds(hidden_tp, g.sms, topo, ring)
    step = busy + contention + exposed + offload
    terms = terms + [(timing.COPIES_TERM, copies,
                      "the wrapper's own copies on the compute stream: FSDP2's all-gather copy-out and reduce-scatter "
                      "copy-in (Framework.compute_stream_copies), at the achievable memory bandwidth"),
                     ("dequantize", dequantize, "QLoRA's dequantization at the achievable memory bandwidth"),
                     ] + ([(ASYNC_TP_TERM, pipelined_tp[0], ASYNC_TP_SOURCE)] if req.async_tp and combo.tp > 1 else []) + [
                     ("communication contention", contention,
                      "overlapped communication slows the compute beside it: 0.61 s per second over NVLink (Lee et al. 2025, "
                      "arXiv 2507.03114, the abstract's mean; timing.OVERLAPPED_COMPUTE_SECONDS_PER_SECOND), the SMs "
                      "its NCCL blocks hold over PCIe (timing.NCCL_CHANNEL_BLOCKS)"),
                     ("exposed communication", exposed, "α-β rings on the topology, less the framework's overlap"),
                     (timing.MODEL_PARALLEL_TERM, per_micro_batch,
                      "the tensor-parallel collectives and the context-parallel exchange left exposed on each "
                      "micro-batch's critical path: part of the exposed communication; under a pipeline, inside the "
                      "stages' compute, which the bubble stretches (parallel_step)"),
                     ("offload", offload, "PCIe and CPU Adam rates (steptime.PCIE_DEVICE_TO_HOST_GBPS)"),
                     ("of which activation offload", saved_to_host,
                      "saved tensors over the GPU's host link (gpus.yaml pcie, PCIE_DEVICE_TO_HOST_GBPS): the "
                      "forward's copies overlap its compute (a side stream), the backward's are waited for (TRL "
                      "OffloadActivations); unverified")]
    columns = [busy + contention, comm, exposed, offload, step, tokens / step, model_flops / (step * peak_flops),
               hardware_flops / (step * peak_flops)] + [t[1] for t in terms]
    labels = tuple((name, source) for name, _, source in terms)
    return timing.step_times_of(columns, slowest, ring, labels, micro.size if arrays.is_array(micro) else None)


ASYNC_TP_TERM = "async TP copies and reductions"
SLOWEST_GPU_TERM = "slowest GPU"
ASYNC_TP_SOURCE = ("async TP's own kernels on the compute stream, at the achievable memory bandwidth: each all-gather's "
                   "local shard copied into the symmetric-memory workspace, each reduce-scatter's partial outputs summed "
                   "(torch 2.13 distributed/_symmetric_memory: _pipelined_multi_all_gather_and_consume, "
                   "_fused_matmul_reduce_scatter_impl); modelled from the source, unverified on a GPU")


def _async_tp_windows(req: "StepSettings", combo: Combo, arch, g: Gpu, dtype: str, micro):
    """(the achievable memory bytes per second, kernels.tp_overlap_windows at the kernels' rates, also under a
    compute_efficiency override): what both async-TP rows of a step read (_async_tp_seconds)."""
    r = kernels.rates(g, dtype)
    low = _low_precision_rate(req.low_precision, g, dtype, r, req.recipe.compute_bytes, req.compile != "none")
    return r.memory_bytes_per_s, kernels.tp_overlap_windows(arch, req.seq_len, combo.tp, combo.cp, micro, r,
                                                            req.recipe.compute_bytes, low)


def _async_tp_seconds(combo: Combo, windows, micro, per_rank: int, seconds, messages, message_bytes, row: str):
    """(exposed seconds, (seconds on the compute stream, of them in backward)) of one sequence-parallel row
    of collectives (``seconds`` for its ``messages``, each ``message_bytes``) under async TP; ``windows``:
    _async_tp_windows.

    Each block's all-gather is cut into its tp shards: the matmul of the local shard runs at once, each
    remote shard is copied over NVLink (copy engines, no SMs) while the matmul of the one before it runs,
    and the matmuls alternate between two streams so that their waves overlap (torch 2.13
    distributed/_symmetric_memory/__init__.py _pipelined_multi_all_gather_and_consume; the reduce-scatter
    mirrored in _pipelined_produce_and_all2all). A collective of c seconds beside a matmul of t therefore
    ends max(0, c - t (tp - 1) / tp) after it: the transfer hides behind every shard's matmul but the one
    that runs before the first copy arrives (or after the last leaves). The matmuls are timed whole (the
    streams' overlap is what the decomposition keeps of their waves). Each forward, recompute and backward
    set of a block pairs one collective with each of its four windows (kernels.tp_overlap_windows; one
    without a matmul to pair with hides nothing); the embedding's and LM head's two per micro-batch (not
    compiled with the blocks in torchtitan) stay exposed.
    On the compute stream: the all-gather's local shard copied into the workspace (read and write,
    1/tp of the message), the reduce-scatter's tp partial outputs summed into its shard (read the
    message, write 1/tp of it)."""
    tp = combo.tp
    memory_bytes_per_s, spec_windows = windows
    micro_batches = per_rank / micro
    per_block = 6 if combo.checkpointing == "full" else 4  # tensor.tp_collectives: 2 sets, 3 with the recompute
    c = seconds / messages
    hiding = (tp - 1) / tp
    shown = 0.0
    fused = 0  # the collectives with a matmul to pair with, per set of a block
    for count, times in spec_windows:
        for t in times:
            shown = shown + count * (c if t is None else arrays.maximum(0.0, c - hiding * t))
            fused += 0 if t is None else count
    # each set of a block pairs this row's collectives with two of the four windows: per row, a quarter
    # of the block's collectives per window
    shown = micro_batches * (per_block / 4 * shown + 2 * c)
    moved = 2 * message_bytes / tp if row == SP_GATHER_ROW else message_bytes * (1 + 1 / tp)
    work = micro_batches * per_block / 4 * fused * moved / memory_bytes_per_s
    sets = per_block // 2
    return shown, (work, work * (sets - 1) / sets)


def _copy_seconds(req: "StepSettings", fw: Framework, s, combo: Combo, traffic: Traffic, g: Gpu,
                  dtype: str) -> tuple[Any, Any, Any]:
    """(seconds per step, of them the backward's, of them what runs after the backward's collectives) of
    the data-parallel wrapper's copies on the compute stream (Framework.compute_stream_copies), at the
    achievable memory bandwidth and a profile's scale."""
    if g.memory_bandwidth_gbps is None or req.compute_efficiency is not None:  # CPU ranks (the host's bandwidth
        return 0.0, 0.0, 0.0  # is not in the catalogue); the override times the whole compute as one fraction
    forward, backward, after = fw.compute_stream_copies(s, traffic, _gradient_bytes(req, combo))
    rate = kernels.rates(g, dtype).memory_bytes_per_s * req.compute_scale
    return (forward + backward + after) / rate, backward / rate, after / rate


def _exposed_data_parallel(fw: Framework, s, forward_comm, backward_comm, forward_seconds, backward_seconds, arch):
    """The data-parallel collectives' seconds no compute hides, pass by pass: what the forward
    sends (FSDP's and ZeRO-3's gathers) can hide only behind the forward, what the backward sends
    (their gathers again, every gradient reduction: a gradient exists only once its backward ran)
    only behind the backward (its recomputation included), each within the framework's window
    for that pass (Framework.overlap_windows); the optimizer step hides neither. With parameters
    sharded per block, the first block's gather precedes the forward's first matmul and the last
    block's reduction follows the backward's last one: one block's share of each pass, the
    backward's reduction half of its block's backward collectives (Zhao et al. 2023, "PyTorch
    FSDP", Sec. 3.3: the prefetches overlap every gather but the first with the preceding block's
    compute)."""
    forward_window, backward_window = fw.overlap_windows(s, arrays.maximum(0.0, forward_seconds), backward_seconds)
    blocks = getattr(arch, "num_layers", None)
    if s.shards_parameters and blocks:
        forward_edge, backward_edge = forward_comm / blocks, backward_comm / (2.0 * blocks)
    else:
        forward_edge = backward_edge = 0.0
    return (forward_edge + arrays.maximum(0.0, forward_comm - forward_edge - forward_window)
            + backward_edge + arrays.maximum(0.0, backward_comm - backward_edge - backward_window))


def _gradient_bytes(req: "StepSettings", combo: Combo) -> int:
    """Bytes per element of the gradients the model's own weights receive: fp32 where torch.autocast runs
    over the framework's fp32 weights (Recipe.autocasts_over_weights, the memory model's rule), else the
    compute dtype."""
    s = lookup_strategy(combo.strategy)
    autocast = req.recipe.autocasts_over_weights(req.framework(s).weights_are_master,
                                                 s.shards_parameters and combo.data_parallel_wrapped(req.nodes),
                                                 combo.pp, combo.cp)
    return 4 if autocast else req.recipe.compute_bytes


def compute_seconds(req: "StepSettings", combo: Combo, micro, per_rank: int, psi: int, arch, g: Gpu,
                    frozen: FrozenBaseShape | None, override_flops: float, shared: dict | None = None):
    """(compute seconds per optimizer step on one GPU, the backward passes' share of them, the
    optimizer step's share, hardware FLOPs it runs, [(term, seconds, source)], the seconds of them the SM
    clock paces: GEMMs and attention, planner/time/variation.py; none under the compute_efficiency
    override, which states the job's own rate) for each micro-batch option. Every kernel at its measured rate (planner/time/kernels.py);
    with the compute_efficiency override, ``override_flops`` at that fraction of peak instead; a
    traced model (no layer shapes) at the measured matmul rate. ``shared``: step_times' (the
    kernels' part, _kernel_seconds, by its key)."""
    recipe = req.recipe
    dtype = recipe.peak_dtype(g.peak_tflops)
    micro_f = arrays.as_float(micro)
    accumulation = per_rank / micro_f
    if req.compute_efficiency is not None:
        seconds = override_flops / (g.peak_tflops[dtype] * 1e12 * req.compute_efficiency)
        return seconds, seconds * timing.BACKWARD_FRACTION, 0.0, override_flops, [
            ("compute", seconds, f"override: compute_efficiency {req.compute_efficiency:g} of peak {dtype}")], 0.0
    r = kernels.rates(g, dtype)
    scaled = "" if req.compute_scale == 1.0 else f" x {req.compute_scale:.3f} (calibration profile)"
    if not isinstance(arch, Architecture):  # traced: FLOPs only, no layer shapes
        seconds = override_flops / r.steady_flops / req.compute_scale
        return seconds, seconds * timing.BACKWARD_FRACTION, 0.0, override_flops, [
            ("matmul", seconds, f"traced FLOPs at {r.matmul_source}{scaled}")], seconds
    gradient_bytes = _gradient_bytes(req, combo)
    key = None if shared is None else ("compute", combo.tp, combo.cp, combo.sequence_parallel, combo.checkpointing,
                                       combo.checkpointing_every, tuple(micro_f.tolist()) if arrays.is_array(micro_f)
                                       else micro_f, per_rank, frozen, gradient_bytes)
    kernel = None if key is None else shared.get(key)
    if kernel is None:
        kernel = _kernel_seconds(req, combo, micro_f, accumulation, arch, g, frozen, gradient_bytes, r, dtype, scaled)
        if key is not None:
            shared[key] = kernel
    device, backward, host, hardware, labels, values, clocked = kernel  # later sums make new arrays: unchanged
    hooks = _hook_seconds(req, combo, arch, r, frozen)
    wait = kernels.host_exposed_seconds(host[0] + hooks[0], host[1] + hooks[1], device - host[2], host[2], host[3])
    stepped = accumulation * (device + wait)
    if hooks[2]:  # the framework's Python beside the model's launches: the host's term says so
        labels = tuple((name, f"{source}; {hooks[2]}" if name == HOST_TERM else source) for name, source in labels)
    optimizer, clipping = _optimizer_seconds(req, combo, psi, arch, frozen, r)
    metrics, metrics_label = _train_metric_seconds(req, combo, micro_f, arch, r)
    scale = req.compute_scale  # a profile's measured factor on every kernel rate
    seconds = (stepped + accumulation * metrics + optimizer + clipping) / scale
    values = values + (accumulation * wait, optimizer, clipping, accumulation * metrics)
    labels = labels + (metrics_label,)
    if scale != 1.0:
        values = tuple(v / scale for v in values)
    return (seconds, backward, (optimizer + clipping) / scale, hardware,
            [(n, v, src) for (n, src), v in zip(labels, values)], clocked / scale)


def _kernel_seconds(req: "StepSettings", combo: Combo, micro_f, accumulation, arch, g: Gpu,
                    frozen: FrozenBaseShape | None, gradient_bytes: int, r: kernels.Rates, dtype: str, scaled: str):
    """compute_seconds' kernels, everything but the optimizer's step and the host's wait: (one micro-batch's
    device seconds, the backward passes' share of the step scaled, one micro-batch's (forward launches,
    backward and recompute launches, backward device seconds, the varlen path's stalls), hardware FLOPs, the
    terms' labels, the terms' seconds but the host's wait and the optimizer step's, the step's clock-bound
    seconds: GEMMs and attention, for planner/time/variation.py). What it reads of the setting is its degrees,
    checkpointing and options, and the gradients' bytes: a layout's strategies and offloads share it (the
    framework's own host work, which differs by strategy, is compute_seconds')."""
    recipe = req.recipe
    if req.attention_unpad != "none" and arch.attention_implementation == "eager":
        raise PlannerError(f"attention_unpad={req.attention_unpad}: this model's attention is timed eager (its family "
                           "has no SDPA path in transformers: Architecture.attention_implementation), which masks the "
                           "padded scores and unpads nothing", field="attention_unpad")
    w = kernels.work(arch, req.seq_len, combo.tp, combo.cp, combo.sequence_parallel, recipe.compute_bytes,
                     req.attention == "eager" or arch.attention_implementation == "eager", r, req.attention_kernel,
                     loss_kernel(req.loss, g.is_cpu), _low_precision_rate(req.low_precision, g, dtype, r, recipe.compute_bytes,
                                                                             req.compile != "none"),
                     loss_chunks=req.loss_chunks or DEFAULT_CHUNKS, compiled=req.compile,
                     frozen=frozen.elementwise if frozen is not None else None, fused=req.fused_kernels,
                     unpad=req.attention_unpad)
    t = kernels.micro_batch_terms(w, micro_f, r, recipe.compute_bytes, combo.checkpointing,
                                  frozen_matmuls=1.0 if frozen is not None else 0.0,
                                  shares=kernels.recompute_shares(arch, combo.checkpointing, combo.checkpointing_every),
                                  gradient_bytes=gradient_bytes)
    matmul = t.matmul
    hardware = t.hardware_flops
    if frozen is not None:  # the adapters and trained copies of frozen matmuls, at the matmul rate
        adapters = micro_f * w.tokens * (3 * frozen.adapter_forward_flops + frozen.trained_weight_flops) / combo.tp
        matmul = matmul + adapters / r.steady_flops
        hardware = hardware + adapters
    device = matmul + t.attention + t.elementwise + t.recompute + t.bias_gradients
    scale = req.compute_scale
    labels = _compute_labels(r, req.attention_kernel, bool(w.eager_bytes), bool(w.chunked_head), combo.checkpointing,
                             scaled, w.compiled, arch.num_experts > 0, req.fused_kernels,
                             req.attention_unpad)
    values = (accumulation * matmul, accumulation * t.attention, accumulation * t.elementwise,
              accumulation * t.recompute, accumulation * t.bias_gradients)
    backward_device = t.backward + (matmul - t.matmul) * 2 / 3  # the adapters' backward: 2 of their 3
    host = (t.host_forward, t.host - t.host_forward, backward_device, t.stalls)
    clocked = accumulation * (t.clocked + matmul - t.matmul)  # the adapters' GEMMs too
    return device, accumulation * backward_device / scale, host, accumulation * hardware, labels, values, clocked


def _hook_seconds(req: "StepSettings", combo: Combo, arch: Architecture, r: kernels.Rates,
                  frozen: "FrozenBaseShape | None" = None):
    """(forward, backward seconds, the source) of one micro-batch's framework Python on the host
    (planner/time/host_hooks.py), at the time model's host time per eager op; (0, 0, "") where the
    framework runs none. ZeRO-3's module hooks run again for each module the checkpointing policy
    recomputes (its recompute calls the modules); an FSDP unit's hooks do not (its checkpoint wraps the
    block inside the unit). ``frozen`` (LoRA): PEFT's modules are hooked too, and only the trained
    tensors have gradient hooks."""
    s = lookup_strategy(combo.strategy)
    measured = req.framework(s).host_hooks(s)
    if measured is None:
        return 0.0, 0.0, ""
    rate = host_hooks.rate(measured)
    per = rate.per
    count = host_hooks.hooked(arch, per, frozen.adapted_linears if frozen is not None else None,
                              bool(frozen is not None and frozen.trained_weight_flops))
    rerun = kernels.recompute_shares(arch, combo.checkpointing, combo.checkpointing_every).matmul \
        if per == "module" else 0.0
    forward = count * rate.forward_ops * r.host_seconds_per_kernel
    backward = count * (rate.backward_ops + rerun * rate.forward_ops) * r.host_seconds_per_kernel
    fsdp1 = " (FSDP1 at FSDP2's figure: it does not run on CPU ranks)" if per == "unit" and req.fsdp_version == 1 else ""
    return forward, backward, (f"and the framework's own Python, {count} {per}s' hooks at {rate.forward_ops:g} + "
                               f"{rate.backward_ops:g} eager ops each{fsdp1} ({rate.source})")


TRAIN_METRICS_TERM = "train metrics"


def _train_metric_seconds(req: "StepSettings", combo: Combo, micro_f, arch, r: kernels.Rates):
    """(one micro-batch's seconds of the loop's train metrics, the term's (name, source)): each metric one
    cross-entropy forward over the micro-batch's logits at the copy rate (planner/recipes/loop.py,
    kernels.train_metric_bytes_per_logit); 0 without them (the plan's search asks for every setting)."""
    if not req.train_metrics:
        return 0.0, (TRAIN_METRICS_TERM, "")
    autocast = metric_autocasts(req.framework(lookup_strategy(combo.strategy)), req.recipe.autocast_dtype)
    per_logit = kernels.train_metric_bytes_per_logit(req.recipe.compute_bytes, autocast)
    seconds = req.train_metrics * micro_f * req.seq_len * arch.vocab_size * per_logit / r.memory_bytes_per_s
    source = (f"{req.train_metrics} cross-entropy forward(s) over each micro-batch's kept logits after its backward, "
              f"{per_logit:.1f} bytes per logit {'(the fp32 cast under autocast, then ' if autocast else '('}torch's "
              "cross_entropy forward as Liger's benchmark measured it: kernels.CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_"
              f"LOGIT) at {r.memory_bytes_per_s / 1e9:,.0f} GB/s; composer's train metrics (planner/recipes/loop.py); "
              "unverified on a GPU (bench/gpu_check.py train_metric)")
    return seconds, (TRAIN_METRICS_TERM, source)


def _optimizer_seconds(req: "StepSettings", combo: Combo, psi: int, arch, frozen: FrozenBaseShape | None,
                       r: kernels.Rates) -> tuple[float, float]:
    """compute_seconds' optimizer step and gradient clipping (0 when the step is offloaded), unscaled."""
    recipe = req.recipe
    s = lookup_strategy(combo.strategy)
    optimizer = clipping = 0.0
    if combo.offload_optimizer == "none":
        shards = combo.gpus * req.nodes // (combo.tp * combo.pp) if s.shards_optimizer else 1
        elements = (frozen.trainable if frozen is not None else psi) / combo.tp / max(1, shards)
        param_bits = recipe.master_bits or recipe.weight_bits
        spec = OPTIMIZERS[req.optimizer]
        bits = state_bits(spec, flat(max(1, int(elements))), param_bits)
        # one fused pass (DeepSpeed's FusedAdam, torchtitan's `implementation = "fused"`); torch's foreach
        # path (torch.optim.AdamW's default) moves about three times the bytes, which is the script's choice;
        # an optimizer named as stepped one kernel per line (adamw-single-tensor) is charged each kernel's bytes
        optimizer = kernels.optimizer_step_seconds(elements, bits, recipe.master_bits, recipe.weight_bits,
                                                   recipe.grad_bits, r, unfused=spec.unfused_step)
        if spec.unfused_step and frozen is None:
            # and launches them one parameter at a time: under FSDP2 every original parameter's shard is a tensor
            # of its own; under FSDP1 with use_orig_params (composer's default: trainer/dist_strategy.py line 237
            # at v0.14.0, line 151 at v0.17.2) only those its flat shard meets have a gradient
            # (planner/time/flat_shards.py); a small shard's kernels wait for the host
            tensors = (flat_shards.stepped_tensors(arch, max(1, shards), recipe.compute_bytes)
                       if req.fsdp_version == 1 and s.shards_parameters else len(parameter_shapes(arch)))
            launches = tensors * kernels.UNFUSED_ADAMW_KERNELS
            optimizer = max(optimizer, launches * r.host_seconds_per_kernel)
        if spec.whole_matrices and frozen is None:  # Muon's Newton-Schulz matmuls
            on_shards = dtensor_shards(req, combo)
            flops = sum(_step_flops(spec.group_of(t), t, on_shards) for t in parameter_shapes(arch)) / combo.tp
            optimizer = optimizer + flops / r.steady_flops
        if req.gradient_clipping:
            clipping = kernels.gradient_clipping_seconds(elements, recipe.grad_bits, r)
    return optimizer, clipping


def _compute_labels(r: kernels.Rates, attention_kernel: str, eager: bool, chunked_head: bool, checkpointing: str,
                    scaled: str, compiled: str = "none", moe: bool = False,
                    fused: tuple[str, ...] = (), unpad: str = "none") -> tuple[tuple[str, str], ...]:
    """compute_seconds' terms' (name, source), in its order; remembered per argument (the plan
    times every setting of a layout with the same)."""
    key = (r, attention_kernel, eager, chunked_head, checkpointing, scaled, compiled, moe, fused, unpad)
    hit = _LABELS.get(key)
    if hit is None:
        attention_source = ("eager attention: its matmuls at the matmul rate, the score matrix at the memory "
                            "bandwidth" if eager else f"{attention_kernel}{_stand_in(attention_kernel)} measured on "
                            f"{r.attention_reference.upper()}, scaled by matmul rate x {r.attention_scale:.2f}")
        bandwidth = f"{r.memory_bytes_per_s / 1e9:,.0f} GB/s achievable memory bandwidth"
        head = ("; the LM head as Liger runs it, its three GEMMs per chunk of tokens and the weight's gradient "
                "read and written per chunk" if chunked_head else "")
        hit = (("matmul", f"{r.matmul_source}, tile waves over {r.sms or '?'} SMs{head}"),
               ("attention", attention_source),
               ("elementwise and loss", f"{bandwidth}; {_elementwise_source(compiled, moe, fused)}"),
               (f"recompute ({checkpointing})", "the forward kernels rerun, same rates"),
               ("bias gradients", f"each biased linear's backward sums its output gradient over the tokens "
                f"(torch addmm's derivative, one reduction kernel; kernels.BIAS_GRADIENT_READS), at {bandwidth}"),
               (HOST_TERM, f"{r.host_seconds_per_kernel * 1e6:g} µs per eager kernel launch" + _unpad_source(unpad)),
               ("optimizer step", bandwidth),
               ("gradient clipping", f"the norm reads this rank's gradients, the scale reads and writes them "
                f"(kernels.CLIP_GRADIENT_PASSES), at {bandwidth}"))
        hit = tuple((name, source + scaled) for name, source in hit)
        if len(_LABELS) >= 256:
            _LABELS.clear()
        _LABELS[key] = hit
    return hit


_LABELS: dict[tuple, tuple[tuple[str, str], ...]] = {}  # _compute_labels' answers


def _unpad_source(unpad: str) -> str:
    if unpad == "none":
        return ""
    u = kernels.UNPAD[unpad]
    return (f"; attention_unpad {unpad}: {u.syncs} host synchronisations per layer's forward (and its recompute), "
            f"the GPU idle through them and the {u.launches} launches up to the attention kernel (kernels.UNPAD); "
            "its gathers and scatter are elementwise traffic; modelled from flash-attn's and transformers' source, "
            "unverified on a GPU (bench/gpu_check.py unpad)")


def _elementwise_source(compiled: str, moe: bool = False, fused: tuple[str, ...] = ()) -> str:
    """How the elementwise term counts a block's work: eager op by op, or inductor's fused kernels."""
    if compiled == "none":
        experts = ("; MoE routing and dispatch as transformers 5.x's default experts implementation runs them "
                   "(grouped_mm: sort, gathers, weighted rows, gather back, sum over the top-k; tokens x top-k rows, "
                   "balanced; Llama-4: every expert on every token, bmm)" if moe else "")
        if fused:
            experts += (f"; {', '.join(fused)} as Liger's Triton kernels, one each way at the rates Liger's published "
                        "benchmarks measured (elementwise.LIGER_*_RATES; unverified here)")
        return ("a block's ops one by one, forward and backward, as its code dispatches them "
                f"(planner/time/elementwise.py; eager, no torch.compile fusion{experts})")
    edges = ("the embedding and final norm compiled too" if compiled == "model"
             else "the embedding and final norm eager")
    return (f"torch.compile ({compiled}): inductor's fused kernels between the matmuls and attention, each "
            f"reading its inputs and writing its outputs once, forward and backward; a plain cross-entropy "
            f"compiled too; {edges} "
            "(planner/time/fusion.py)")


def dtensor_shards(req: "StepSettings", combo: Combo) -> int:
    """The ranks each parameter's Shard(0) spans when the optimizer steps FSDP2's DTensor shards
    (planner/memory/optimizer.py check: Muon there only with tp 1); 1 when it steps whole tensors."""
    s = lookup_strategy(combo.strategy)
    if combo.tp > 1 or not (s.shards_parameters and combo.data_parallel_wrapped(req.nodes)
                            and req.framework(s).shards_as_dtensors):
        return 1
    return combo.shard or combo.gpus * req.nodes // combo.pp


def _step_flops(spec, t, shards: int) -> int:
    """One rank's FLOPs stepping parameter ``t``: its whole matrix, or on ``shards`` > 1 its FSDP2
    shard through the optimizer's DTensor step (OptimizerSpec.dtensor_flops)."""
    if shards > 1 and spec.dtensor_flops is not None:
        return spec.dtensor_flops(TensorShape((-(-t.dims[0] // shards),) + t.dims[1:]), shards)
    return spec.flops(t)


def optimizer_collectives(req: "StepSettings", combo: Combo, arch) -> dict[tuple[int, int], int]:
    """What the optimizer's step itself sends on FSDP2's DTensor shards (Muon's redistributions
    inside Newton-Schulz: OptimizerSpec.dtensor_collectives), as {(message bytes, ring passes): count}
    over the model's parameters; empty where the step is local."""
    spec = OPTIMIZERS[req.optimizer]
    shards = dtensor_shards(req, combo)
    out: dict[tuple[int, int], int] = {}
    if shards <= 1 or spec.dtensor_collectives is None or not isinstance(arch, Architecture):
        return out
    for t in parameter_shapes(arch):
        group = spec.group_of(t)
        if group.dtensor_collectives is None:
            continue
        for _, message, passes in group.dtensor_collectives(TensorShape((-(-t.dims[0] // shards),) + t.dims[1:]),
                                                            shards):
            out[(message, passes)] = out.get((message, passes), 0) + 1
    return out


def _stand_in(kernel: str) -> str:
    """How a kernel without published rates is read (kernels.STAND_IN), for the term's source."""
    return f" at {kernels.STAND_IN[kernel]}'s rates" if kernel in kernels.STAND_IN else ""


def _low_precision_rate(name: str, g: Gpu, dtype: str, r: kernels.Rates, compute_bytes: int,
                        compiled: bool = False) -> kernels.LowPrecisionRate | None:
    """The converted GEMMs' rate over the step dtype's (planner/time/kernels.py LowPrecisionRate); ``compiled``:
    torch.compile fuses torchao's casts (cast_bytes_per_element)."""
    recipe = low_precision_recipe(name)
    if recipe is None or recipe.matmul_dtype not in g.peak_tflops:
        return None
    low = kernels.rates(g, recipe.matmul_dtype)
    return kernels.LowPrecisionRate(low.matmul_flops / r.matmul_flops, recipe.dim_multiple,
                                    cast_bytes_per_element(recipe, compute_bytes, compiled))


def _dequantize_seconds(frozen: FrozenBaseShape | None, checkpointing: str, accumulation, g: Gpu):
    """The quantized base's dequantizations in one optimizer step: per micro-step one forward
    (two with full checkpointing's recomputation) and one backward, each bandwidth-bound."""
    seconds = arrays.zeros_like(arrays.as_float(accumulation))
    if frozen is None or not (frozen.dequantize_forward_bytes or frozen.dequantize_backward_bytes):
        return seconds
    if g.memory_bandwidth_gbps is None:  # CPU ranks: the host's bandwidth is not in the catalogue
        return seconds
    forwards = 2 if checkpointing == "full" else 1
    per_micro = forwards * frozen.dequantize_forward_bytes + frozen.dequantize_backward_bytes
    return seconds + accumulation * timing.dequantize_seconds(per_micro, g.memory_bandwidth_gbps)


def offload_seconds(combo: Combo, psi: int, accumulation, world: int, wb: int, g: Gpu, trainable: int | None = None):
    """``trainable``: the elements the optimizer updates when not all of ``psi`` (LoRA)."""
    shard = (psi if trainable is None else trainable) / world
    pcie = PCIE_DEVICE_TO_HOST_GBPS.get(g.pcie, 24.0) * 1e9
    seconds = arrays.zeros_like(accumulation)
    if combo.offload_optimizer != "none":
        # gradients down, updated 16-bit parameters up, then DeepSpeedCPUAdam on the host
        seconds += 2 * shard * wb / pcie + shard / timing.CPU_ADAM_PARAMS_PER_SECOND
        if combo.offload_optimizer == "nvme":
            seconds += 2 * shard * 16 / (NVME_GBPS * 1e9)  # read and write master + moments
    if combo.offload_params != "none":
        shard = psi / world  # every parameter is fetched, frozen or not
        seconds += accumulation * 2 * shard * wb / pcie  # each micro-step fetches the shard twice
        if combo.offload_params == "nvme":
            seconds += accumulation * 2 * shard * wb / (NVME_GBPS * 1e9)
    return seconds
