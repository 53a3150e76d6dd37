"""Per-device memory of one training configuration: the orchestrator.

The textbook model states (parameters, gradients, optimizer states) follow the ZeRO paper.
What the frameworks really hold is modelled as *phases*: the live set at the moments a step
can peak (the start of backward, the end of backward, the gradient reduction, the optimizer
step). Each phase is a list of named items; resident is what survives the step; the peak is the
largest phase. The items beyond the textbook states are the framework's buffers, each named
after the DeepSpeed / torch source that allocates it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.cluster import cuda_context
from planner.memory import buffers as buf
from planner.memory import reserved
from planner.model.activations import Activations, check_checkpointing
from planner.model.architecture import distinct_specs
from planner.recipes import activation_offload as act_offload
from planner.recipes.compile import check_compile, compile_note
from planner.model.architecture import defaulted_size_fields
from planner.model.catalogue import ResolvedModel, as_loaded, catalogue_model, model_from_config, raw_parameters
from planner.parallel import experts, pipeline
from planner.parallel.context import check_context_parallel, gloo_ring_scratch_bytes
from planner.frameworks.deepspeed.config import (ZeroSettings, batch_from_config, check_communication_dtype,
                                                parse_ds_config, with_overrides)
from planner.errors import PlannerError
from planner.recipes.losses import FUSED, in_forward_why_not, loss_chunks, loss_kernel, loss_notes
from planner.recipes.loop import (check_loop, held_outputs_bytes, loop_note, metric_autocasts, train_metric_items,
                                  train_metrics_note, with_held, with_held_outputs, with_train_metrics)
from planner.recipes.fused_kernels import check_fused_kernels, fused_kernels_notes
from planner.recipes.low_precision import RECIPES as LP_RECIPES, check_float8_all_gather, check_low_precision, \
    low_precision_notes, recipe_of, resident_weight_bytes
from planner.recipes.finetune import Finetune, resolve_finetune, trainable_numels, with_frozen
from planner.frameworks import framework_of
from planner.cluster.gpus import Gpu, check_precision, gpu as lookup_gpu
from planner.memory.moments import PhaseKind
from planner.parallel.dims import ModelShape, ParallelDims, check_dims, data_parallel_size, dims_for, refuse_unmodelled
from planner.recipes.precision import RECIPES, bits_to_bytes
from planner.memory.rank_activations import activations, traced_setting
from planner.schema import (EstimateRequest, EstimateResult, HostMemory, ModelSummary, ParallelDegrees,
                            PeakRows, PerDevice, Phase)
from planner.setup import Setup, numels as _numels, with_fields
from planner.memory.optimizer import check as check_optimizer, notes as optimizer_notes
from planner.strategies import Strategy, shard_group_size, strategy as lookup_strategy
from planner.parallel.tensor import tensor_parallel_fields
from planner.units import GIB, fmt_bytes

# Setup, activations and traced_setting are imported from here by callers that predate their own
# modules (planner/setup.py, planner/memory/rank_activations.py); _numels by the tests.
__all__ = ["Setup", "activations", "traced_setting", "_numels", "resolve", "resolve_model", "estimate",
           "estimate_resolved", "setup_of", "textbook_states", "trainable_count", "resident_by_component",
           "host_capacity", "host_notes", "activation_offload_bytes", "sequence_past_positions", "position_limit_error", "position_notes",
           "cpu_rank_bytes"]


def resolve_model(request: EstimateRequest) -> ResolvedModel:
    if request.model is not None:
        return catalogue_model(request.model)
    if request.model_config_ is not None:
        return model_from_config(request.model_config_)
    return raw_parameters(request.params)


def _zero_settings(request: EstimateRequest, s: Strategy) -> ZeroSettings:
    if request.ds_config is not None:
        return _zero_settings_of(request, s)
    # without a config file the settings are the strategy's and the flags' (a ZeroSettings is
    # frozen): once per combination, as the plan resolves hundreds of requests
    key = (s.name, s.zero_stage, request.offload_optimizer, request.offload_params) + tuple(
        getattr(request, name) for name in _ZERO_FLAGS)
    if key not in _ZERO_SETTINGS:
        if len(_ZERO_SETTINGS) >= 1024:
            _ZERO_SETTINGS.clear()
        _ZERO_SETTINGS[key] = _zero_settings_of(request, s)
    return _ZERO_SETTINGS[key]


_ZERO_SETTINGS: dict[tuple, ZeroSettings] = {}
# the request's flags that override a config's (every one _zero_settings_of reads: the memo's key)
_ZERO_FLAGS = ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "param_persistence_threshold",
               "max_live_parameters", "max_reuse_distance")


def _zero_settings_of(request: EstimateRequest, s: Strategy) -> ZeroSettings:
    settings = parse_ds_config(request.ds_config) if request.ds_config is not None else ZeroSettings()
    if request.ds_config is not None and s.zero_stage is not None and settings.stage != s.zero_stage:
        raise PlannerError(f"strategy {s.name} contradicts ds_config zero_optimization.stage({settings.stage}); "
                           f"use strategy zero{settings.stage} or change the config", field="strategy")
    settings = with_overrides(settings, **{name: getattr(request, name) for name in _ZERO_FLAGS})
    offload_optimizer = request.offload_optimizer if request.offload_optimizer != "none" else settings.offload_optimizer
    offload_params = request.offload_params if request.offload_params != "none" else settings.offload_params
    return replace(settings, stage=s.zero_stage or 0, offload_optimizer=offload_optimizer,
                   offload_params=offload_params)


def _from_config(request: EstimateRequest, zero: ZeroSettings) -> dict:
    """What a ds_config fixes beyond ZeRO (its optimizer, micro-batch, accumulation and clipping), where the
    request's own field was not given: explicit flags win, as for the precision."""
    if request.ds_config is None:
        return {}
    micro, accumulation = batch_from_config(zero, request.world_size)
    given = request.model_fields_set
    if zero.autotp_size is not None and "tp" in given and request.tp != zero.autotp_size:
        raise PlannerError(f"tp={request.tp} but ds_config.tensor_parallel.autotp_size is {zero.autotp_size}: "
                           "DeepSpeed trains the config's degree; give one of them", field="tp")
    found = {"optimizer": zero.optimizer, "micro_batch": micro, "gradient_accumulation": accumulation,
             "tp": zero.autotp_size, "gradient_clipping": zero.gradient_clipping}
    return {k: v for k, v in found.items() if v is not None and k not in given}


def resolve(request: EstimateRequest, model: ResolvedModel | None = None) -> Setup:
    """``model``: one resolved outside the core (a traced profile, catalogue.traced_model) in
    place of the request's own model fields."""
    s = lookup_strategy(request.strategy)
    g = lookup_gpu(request.gpu)
    zero = _zero_settings(request, s)
    precision = request.precision
    if request.ds_config is not None and zero.precision and zero.precision != precision \
            and "precision" not in request.model_fields_set:
        precision = zero.precision  # the config's bf16/fp16 block, unless --precision was given
    check_communication_dtype(zero.communication_data_type, precision)  # a config whose precision is "auto"
    from_config = _from_config(request, zero)
    # what the config fixes is the request from here on: its AutoTP degree shapes the layout below
    if from_config:
        request = request.model_copy(update=from_config)
    recipe = RECIPES[precision]  # the precision decoded once: the Setup carries it
    check_precision(g, precision, recipe)
    fw = framework_of(s, request.framework_version)
    fw.check_offload(s, zero.offload_optimizer, zero.offload_params)
    fw.check_precision(s, recipe)
    model = as_loaded(model if model is not None else resolve_model(request), request.text_only,
                      request.include_vision)
    shard = shard_group_size(s, request.gpus, request.nodes, request.hsdp_shard_size)
    dims = _dims(request, s, shard, model)
    check_context_parallel(dims.cp, fw, s, request.attention, model.architecture)
    finetune = resolve_finetune(request, model.architecture, s, fw, recipe)
    check_loop(request, model.architecture)
    check_low_precision(request, g, model.architecture, fw, s.shards_parameters, recipe.compute,
                        request.finetune)
    check_float8_all_gather(request, s.shards_parameters, s.params_unsharded_in_step)
    act_offload.check_activation_offload(request, model, dims)
    check_compile(request, dims)
    check_fused_kernels(request.fused_kernels, model.architecture, gpu_is_cpu=g.is_cpu, pp=dims.pp, tp=dims.tp,
                        compile_mode=request.compile, traced=model.traced is not None)
    if dims.pp > 1 and model.architecture is not None and model.architecture.vision_numels:
        raise PlannerError(f"pp={dims.pp} with the vision tower counted (what the loader builds for model_type "
                           f"{model.architecture.model_type!r}): the pipeline model splits the text decoder's blocks "
                           "and places no vision tower; give text_only (a pipeline trains the text decoder)",
                           field="text_only")
    check_checkpointing(model.architecture, request.checkpointing, request.checkpointing_every, request.attention,
                        _checkpointing_why_not(request, model, finetune))
    if request.tp > 1 and shard % request.tp == 0:
        fw.check_tp_plan(s, request.tp_plan, request.tp, shard // request.tp)
    fields = {"shard_size": shard} | tensor_parallel_fields(request, s, fw, model, shard)
    fields["loss_chunks"] = loss_chunks(request, _checkpointing_why_not(request, model, finetune),
                                        torch_tp=bool(fields.get("vocab_parallel_loss")),
                                        fused_why_not=_checkpointing_why_not(request, model, None),
                                        in_forward_why_not=in_forward_why_not(
                                            request, s, fw, model.traced is not None,
                                            bool(model.architecture and model.architecture.final_logit_softcapping))
                                        if request.loss == "chunked-in-forward" else None)
    setup = Setup(request=request.model_copy(update={"precision": precision}), model=model, strategy=s,
                  recipe=recipe, gpu=g, zero=zero, world_size=request.world_size, dims=dims,
                  finetune=finetune, **fields)
    check_optimizer(setup)
    return setup


def _checkpointing_why_not(request: EstimateRequest, model: ResolvedModel, finetune: Finetune | None) -> str | None:
    """What of the request the checkpointing policies beyond none/full are not modelled with."""
    parallel = [f"{name}={getattr(request, name)}" for name in ("tp", "cp", "pp", "ep") if getattr(request, name) > 1]
    if parallel:
        return ", ".join(parallel)
    if finetune is not None:
        return f"finetune={request.finetune}"
    if model.traced is not None:
        return "a traced model"
    return None


def _dims(request: EstimateRequest, s: Strategy, shard: int, model: ResolvedModel) -> ParallelDims:
    """The request's degrees, the data-parallel part realised as the strategy does; a layout the
    model or cluster cannot take, or a degree not modelled yet, is refused naming the field."""
    dp = data_parallel_size(request.world_size, request.tp, request.pp, request.cp, request.gpus, request.nodes)
    # a shard group's GPUs hold tp x cp model-parallel ranks per data-parallel rank (tp and cp innermost)
    model_parallel = request.tp * request.cp
    if s.shard_within_node and request.cp > 1 and shard % model_parallel:
        # torchtitan's HSDP shards over dp_shard x cp (parallelize.py dp_mesh_dim_names ("dp_replicate",
        # "dp_shard_cp")): a shard group is whole cp groups, or the cp ranks would not shard together
        raise PlannerError(f"hsdp_shard_size({shard}) with cp={request.cp}: a shard group must hold whole context-"
                           f"parallel groups, a multiple of tp({request.tp}) * cp({request.cp}) = {model_parallel} "
                           "GPUs (HSDP shards over dp_shard x cp)", field="hsdp_shard_size")
    within = shard // model_parallel if s.shard_within_node and shard % model_parallel == 0 else shard
    dims = dims_for(s.shards_optimizer, within if s.shard_within_node else None, dp,
                    request.tp, request.pp, request.cp, request.ep)
    arch = model.architecture
    shape = ModelShape(arch.num_attention_heads, arch.num_key_value_heads, arch.num_layers,
                       arch.num_experts or None) if arch is not None else ModelShape()
    check_dims(dims, gpus=request.gpus, nodes=request.nodes, model=shape, seq_len=request.seq_len,
               pp_virtual_stages=request.pp_virtual_stages, pp_schedule=request.pp_schedule)
    refuse_unmodelled(request)
    return dims


# --- textbook model states -------------------------------------------------------------------

def _shard(count: int, setup: Setup, sharded: bool) -> int:
    return -(-count // setup.shard_size) if sharded else count


def textbook_states(setup: Setup) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) in bytes per device, as the ZeRO paper counts
    them: 16-bit weights and grads, K bytes of optimizer state per parameter, each divided over
    the shard group where the strategy shards it, and zero on the device where it is offloaded."""
    s, r, psi = setup.strategy, setup.recipe, trainable_count(setup)
    k_bits = r.master_bits + setup.framework.optimizer_state_bits(setup, _numels(setup))
    params = bits_to_bytes(_shard(psi, setup, s.shards_parameters), r.weight_bits)
    grads = bits_to_bytes(_shard(psi, setup, s.shards_gradients), r.grad_bits)
    optim = bits_to_bytes(_shard(psi, setup, s.shards_optimizer), k_bits)
    if setup.zero.offload_params != "none":
        params = 0
        if setup.framework.offloads_gradients_with_params:
            grads = 0
    if setup.zero.offload_optimizer != "none":
        optim = 0
    return params, grads, optim


# --- the orchestrator -----------------------------------------------------------------------

def trainable_count(setup: Setup) -> int:
    """Parameters with gradients and optimizer states: all of them, or LoRA's adapters."""
    return setup.rank_psi if setup.finetune is None else sum(trainable_numels(setup.arch, setup.finetune))


def estimate(request: EstimateRequest, model: ResolvedModel | None = None, simulate: bool = True) -> EstimateResult:
    """``simulate``: replay the step through the caching allocator (planner/memory/reserved.py) and judge
    the fit on reserved memory; the plan's search passes False (its settings are judged on the live
    peak with the request's headroom) and simulates the candidates it shows."""
    return estimate_resolved(resolve(request, model), simulate)


def setup_of(result: EstimateResult) -> Setup | None:
    """The Setup ``result`` was computed from (None for a result read back from JSON)."""
    return result._setup


@dataclass(eq=False)
class Measured:
    """An estimate's numbers before its result is written out: the plan search judges thousands of
    settings on the peak, resident and phase bytes and writes out (``result``) only those it shows."""

    whole: Setup  # the request's Setup (``setup`` is the rank's: localized experts, a stage's shard)
    setup: Setup
    acts: Activations | None
    plan: "buf.PhasePlan"
    states: tuple[int, int, int]  # (parameters, gradients, optimizer states) bytes
    peak_phase: Phase
    framework_bytes: int
    host: HostMemory
    _result: EstimateResult | None = None

    @property
    def peak_bytes(self) -> int:
        return self.peak_phase.bytes + self.framework_bytes

    @property
    def resident_bytes(self) -> int:
        return self.plan.resident_bytes + self.framework_bytes

    def phase_bytes(self) -> list[int]:
        """Each phase's bytes as the result lists them: between steps first, then the plan's."""
        return [sum(i.bytes for i in self.plan.resident if i.bytes > 0)] + [p.bytes for p in self.plan.phases]

    def result(self) -> EstimateResult:
        """The estimate without the allocator's replay (estimate(..., simulate=False))."""
        if self._result is None:
            self._result = _result(self, False)
        return self._result

    def candidate(self, replay: bool = False) -> EstimateResult:
        """The estimate as a plan's candidate shows it (its per-device rows, degrees and host
        memory; ``replay``: its reserved peak and fit by the allocator's replay): without the
        notes, the architecture and the allocator's summary a Candidate does not carry, so without
        the replay with expandable_segments switched that only they report."""
        return _result(self, replay, brief=True)


def measure(setup: Setup) -> Measured:
    """The memory of a resolved request: its phases, peak and host memory (estimate_resolved
    writes them out)."""
    whole = setup
    ep_items, ep_transient = [], None
    if setup.dims.ep > 1:
        setup, ep_items, ep_transient = experts.localize(setup, textbook_states)
    # the router still scores every expert and a rank computes as many (token, expert) pairs as
    # without ep (dropless, the mean): a rank's activations are the whole model's (planner/parallel/experts.py)
    acts = activations(whole if setup.dims.ep > 1 else setup)
    if setup.dims.pp > 1:
        # the stages' share of the activations just computed (a localized expert setup computes its own)
        plan, (params_b, grads_b, optim_b), _ = pipeline.estimate_plan(setup, acts if setup is whole else None)
        # a stage's states are sharded over its data-parallel ranks only (notes, shard_size)
        d = setup.dims  # FSDP shards over dp_shard x cp (torchtitan's dp_shard_cp)
        setup = with_fields(setup, shard_size=d.dp_shard * d.cp if setup.strategy.shards_optimizer else d.dp * d.cp)
    else:
        params_b, grads_b, optim_b = textbook_states(setup)
        plan = setup.framework.phases(setup, acts, _numels(setup))
        if setup.finetune is not None:
            plan = with_frozen(plan, setup)
        if setup.request.keeps_outputs:
            plan = with_held_outputs(plan, _held_outputs(setup))
        if setup.request.train_metrics:
            plan = with_train_metrics(plan, _train_metric_items(setup), setup.request.train_metrics)
        workspaces = _low_precision_workspaces(setup)
        if workspaces:
            plan = with_held(plan, buf.item(f"{setup.request.low_precision}: fp8 weights and their transposes "
                                        "(the modules' workspaces)", workspaces, "buffers", LP_RECIPES["te-fp8"].source))
        if setup.request.activation_offload:
            _offload_activations_host(plan, setup, acts)
    if ep_items or ep_transient is not None:
        plan = experts.with_items(plan, ep_items, ep_transient)
        params_b += sum(i.bytes for i in ep_items if i.component == "parameters")
        optim_b += sum(i.bytes for i in ep_items if i.component == "optimizer_states")
        grads_b += sum(i.bytes for i in ep_items if i.component == "gradients")
    return Measured(whole, setup, acts, plan, (params_b, grads_b, optim_b), max(plan.phases, key=lambda p: p.bytes),
                    setup.gpu.cuda_context_bytes + setup.gpu.blas_workspace_bytes, _host(setup, plan))


def pipeline_resident_bytes(setup: Setup) -> int:
    """measure(setup).resident_bytes of a pipeline without expert parallelism, its schedule not
    replayed (planner/parallel/pipeline.py resident_bytes): the plan search's floor."""
    if setup.dims.pp == 1 or setup.dims.ep > 1:
        raise ValueError(f"pipeline_resident_bytes needs pp > 1 and ep 1, got pp={setup.dims.pp} ep={setup.dims.ep}")
    return pipeline.resident_bytes(setup) + setup.gpu.cuda_context_bytes + setup.gpu.blas_workspace_bytes


def pipeline_peak_bytes(setup: Setup, above: int | None = None) -> int:
    """measure(setup).peak_bytes of a pipeline without expert parallelism, its worst rank's phases
    not written out (planner/parallel/pipeline.py peak_bytes): the plan search's judgement of a
    pipeline option. ``above``: a peak above it may be answered by a lower bound above it."""
    if setup.dims.pp == 1 or setup.dims.ep > 1:
        raise ValueError(f"pipeline_peak_bytes needs pp > 1 and ep 1, got pp={setup.dims.pp} ep={setup.dims.ep}")
    framework = setup.gpu.cuda_context_bytes + setup.gpu.blas_workspace_bytes
    return pipeline.peak_bytes(setup, None if above is None else above - framework) + framework


def expert_pipeline_peak_bytes(setup: Setup) -> int:
    """measure(setup).peak_bytes of a pipeline with expert parallelism, its worst rank's phases not
    written out: the rank's setup localized (experts.localize), the worst rank's phase bytes
    (pipeline.worst_rank_phases) each with what experts.with_items adds to a phase of its kind (a
    phase's items all hold bytes, so its new total is its old plus the added items' bytes), the
    whole setup's activations computed as measure computes (and refuses) them. The plan search's
    judgement of an expert-parallel pipeline option (a test compares the two)."""
    local, items, transient = _expert_pipeline(setup)
    added = {}
    peak = max(nbytes + (added[kind] if kind in added else added.setdefault(
        kind, experts.added_bytes(items, transient, kind))) for kind, nbytes in pipeline.worst_rank_phases(local))
    return peak + setup.gpu.cuda_context_bytes + setup.gpu.blas_workspace_bytes


def expert_pipeline_resident_bytes(setup: Setup) -> int:
    """measure(setup).resident_bytes of a pipeline with expert parallelism, no phase written out: the
    localized setup's resident bytes as estimate_plan answers them (pipeline.replayed_resident_bytes)
    and the add-back items experts.with_items keeps between steps. The plan search's floor of an
    expert-parallel pipeline setting (a test compares the two)."""
    local, items, _ = _expert_pipeline(setup)
    return pipeline.replayed_resident_bytes(local) + experts.kept_between_bytes(items) \
        + setup.gpu.cuda_context_bytes + setup.gpu.blas_workspace_bytes


def _expert_pipeline(setup: Setup):
    """measure's first steps for a pipeline with expert parallelism: the rank's localized setup and
    the items it adds back (experts.localize), the whole setup's activations computed as measure
    computes (and refuses) them."""
    if setup.dims.pp == 1 or setup.dims.ep == 1:
        raise ValueError(f"an expert-parallel pipeline's bytes need pp > 1 and ep > 1, got pp={setup.dims.pp} "
                         f"ep={setup.dims.ep}")
    local, items, transient = experts.localize(setup, textbook_states)
    activations(setup)
    return local, items, transient


def estimate_resolved(setup: Setup, simulate: bool = True, brief: bool = False) -> EstimateResult:
    """The estimate of a resolved request: the Setup goes with the result (``setup_of``). ``brief``:
    the fit and the peaks only (no allocator summary, no second replay with expandable_segments
    switched), as the plan's inverse questions need them."""
    return estimated(measure(setup), simulate, brief)


def estimated(m: Measured, simulate: bool = True, brief: bool = False) -> EstimateResult:
    """The estimate of memory already measured (estimate_resolved's second half)."""
    return _result(m, simulate, brief)


def _result(m: Measured, simulate: bool, brief: bool = False) -> EstimateResult:
    whole, setup, acts, plan, peak_phase, host = m.whole, m.setup, m.acts, m.plan, m.peak_phase, m.host
    params_b, grads_b, optim_b = m.states
    framework = m.framework_bytes
    peak = peak_phase.bytes + framework
    resident = plan.resident_bytes + framework
    frozen_b = sum(i.bytes for i in plan.resident if i.component == "frozen_weights")
    at_peak = _at_peak(peak_phase, framework)
    act_at_peak = at_peak.activations_bytes  # the peak phase's activation items' bytes
    buffers_at_peak = at_peak.buffers_bytes
    capacity = _capacity(setup)
    held = reserved.simulate(setup, plan, len(_numels(setup)), capacity, compare=not brief,
                             loss=reserved.loss_tensors(setup, acts)) \
        if simulate and not setup.gpu.is_cpu else None
    # not replayed (the plan's search, cpu ranks): the live peak and NCCL's buffers, a lower bound
    nccl = held.nccl_bytes if held else (0 if setup.gpu.is_cpu else reserved.nccl_bytes(setup))
    reserved_peak = peak + nccl if held is None else held.reserved_peak_bytes
    device_fits = peak <= capacity if held is None else held.fits
    fits = capacity > 0 and device_fits and host.fits is not False
    notes = [] if brief else _notes(setup, acts, plan, peak_phase, capacity, peak, held) + host_notes(setup, host)
    # a brief result is read, not written out (the plan's candidates take its validated per-device
    # rows, degrees and host memory): filled in without validating what was just built
    result = (EstimateResult.model_construct if brief else EstimateResult)(
        parameters=whole.psi,
        trainable_parameters=whole.psi if whole.finetune is None else trainable_count(whole),
        model=(ModelSummary.model_construct if brief else ModelSummary)(
            name=whole.model.name, source=whole.model.source, parameters=whole.psi,
            architecture=whole.model.architecture.model_dump() if whole.model.architecture and not brief else None),
        strategy=setup.strategy.name, world_size=setup.world_size, dp_size=setup.dims.dp,
        shard_size=setup.shard_size, parallel=ParallelDegrees(**setup.dims.as_dict()), gpu=setup.gpu.name,
        per_device=PerDevice(
            parameters_bytes=params_b, gradients_bytes=grads_b, optimizer_states_bytes=optim_b,
            frozen_weights_bytes=frozen_b,
            activations_bytes=act_at_peak if acts is not None else None,
            buffers_bytes=buffers_at_peak, framework_bytes=framework,
            resident_bytes=resident, peak_bytes=peak, peak_phase=peak_phase.name, at_peak=at_peak,
            reserved_peak_bytes=reserved_peak, cuda_context_bytes=held.cuda_context_bytes if held else framework,
            nccl_bytes=nccl),
        host=host,
        nvme_bytes=plan.nvme_bytes, device_capacity_bytes=capacity, fits=fits,
        headroom_bytes=capacity - reserved_peak, allocator=held.summary() if held and not brief else None,
        phases=[buf.phase(PhaseKind.RESIDENT, "between steps (resident)", plan.resident)] + list(plan.phases), buffers=list(plan.buffers),
        notes=notes, request=setup.request)
    result._setup = whole
    return result


_STATE_ROWS = ("parameters", "gradients", "optimizer_states", "frozen_weights", "activations")


def _at_peak(peak_phase, framework: int) -> PeakRows:
    """The peak phase's items by component; what is not a state or an activation is a buffer."""
    rows = dict.fromkeys(_STATE_ROWS, 0)
    for item in peak_phase.items:
        if item.component in rows:
            rows[item.component] += item.bytes
    buffers = peak_phase.bytes - sum(rows.values())
    return PeakRows(**{f"{k}_bytes": v for k, v in rows.items()}, buffers_bytes=buffers, framework_bytes=framework)


def _held_outputs(setup: Setup) -> int:
    """The logits a keeps_outputs loop holds (planner/recipes/loop.py); 0 for the Trainer's loop."""
    if not setup.request.keeps_outputs or setup.request.loss in (*FUSED, "chunked-in-forward"):
        # the fused kernels' forwards return no logits in training (Liger: skip_logits), nor does torchtitan's
        # ChunkedLossWrapper (its logits die with each chunk)
        return 0
    req = setup.request
    return held_outputs_bytes(setup.arch.vocab_size, req.micro_batch * req.seq_len, setup.recipe.compute_bytes)


def _train_metric_items(setup: Setup) -> list:
    """One train metric's temporaries over a micro-batch's kept logits (planner/recipes/loop.py)."""
    req = setup.request
    return train_metric_items(setup.arch.vocab_size, req.micro_batch * req.seq_len, setup.recipe.compute_bytes,
                              _metric_autocasts(setup))


def _metric_autocasts(setup: Setup) -> bool:
    return metric_autocasts(setup.framework, setup.recipe.autocast_dtype)


def _low_precision_workspaces(setup: Setup) -> int:
    """Transformer Engine's fp8 weight copies, held across steps (planner/recipes/low_precision.py)."""
    recipe = recipe_of(setup.request.low_precision)
    return resident_weight_bytes(setup.arch, recipe) if recipe is not None and setup.arch is not None else 0
def activation_offload_bytes(setup: Setup, acts: Activations | None = None) -> int:
    """Bytes one rank's micro-batch moves to the host and back under activation_offload (0 without it)."""
    acts = acts if acts is not None else activations(setup)
    if not setup.request.activation_offload or acts is None:
        return 0
    return acts.offloaded_bytes  # set by rank_activations.activations under activation_offload


def _offload_activations_host(plan: "buf.PhasePlan", setup: Setup, acts: Activations | None) -> None:
    """activation_offload's pinned host memory, per node (the sum over its ranks; the caching host
    allocator keeps the blocks between steps: resident too), and its note. On CPU ranks the host
    copies are the rank's own memory, counted in its phases (rank_activations.activations)."""
    if acts is None:
        return
    arch, req = setup.arch, setup.request
    tokens = req.micro_batch * req.seq_len // setup.cp
    moved = activation_offload_bytes(setup, acts)
    widths = [arch.hidden_size, arch.vocab_size] + [w for spec in distinct_specs(arch).values() for w in (
        spec.mlp.intermediate_size, spec.mlp.shared_intermediate_size, spec.attention.q_width, spec.attention.kv_width)]
    pinned = act_offload.pinned_bytes(moved, widths, tokens, setup.recipe.compute_bytes)
    if setup.device != "cpu":
        plan.host_resident_bytes += pinned * req.gpus
        plan.host_peak_bytes += pinned * req.gpus
        plan.host_pinned_bytes += pinned * req.gpus
    plan.notes.extend(act_offload.offload_notes(acts, moved, pinned, setup.device == "cpu"))


def resident_by_component(result: EstimateResult) -> dict[str, int]:
    """The predicted bytes held between steps, by component (the "between steps" phase)."""
    totals = {"parameters": 0, "gradients": 0, "optimizer_states": 0, "buffers": 0}
    for item in result.phases[0].items:
        component = "parameters" if item.component == "frozen_weights" else item.component  # module parameters
        totals[component if component in totals else "buffers"] += item.bytes
    return totals


def _capacity(setup: Setup) -> int:
    if setup.request.device_memory_gib is not None:
        return int(setup.request.device_memory_gib * GIB)
    return setup.gpu.memory_bytes


def host_capacity(request: EstimateRequest, g: Gpu) -> tuple[int, str] | None:
    """(bytes, where from) of one node's host RAM: --host-memory-gib, else the system memory its
    topology preset's datasheet states (the preset given, or the one --gpu implies); None: unknown.
    CPU ranks have no separate host: their capacity is the device capacity."""
    if g.is_cpu:
        return None
    if request.host_memory_gib is not None:
        return int(request.host_memory_gib * GIB), "--host-memory-gib"
    # what follows reads the preset's catalogue only: once per (topology, GPU), as the plan asks per estimate
    key = (request.topology if request.topology_text is None else None, request.topology_text is None, g.name)
    if key not in _PRESET_HOSTS:
        if len(_PRESET_HOSTS) >= 256:
            _PRESET_HOSTS.clear()
        _PRESET_HOSTS[key] = _preset_host(request, g)
    return _PRESET_HOSTS[key]


_PRESET_HOSTS: dict[tuple, tuple[int, str] | None] = {}  # host_capacity's answers from a topology preset


def _preset_host(request: EstimateRequest, g: Gpu) -> tuple[int, str] | None:
    from planner.cluster.presets import default_preset_for, preset

    name = request.topology if request.topology_text is None else None
    name = name or (default_preset_for(g.name) if request.topology_text is None else None)
    p = preset(name) if name else None
    if p is None or p.host_memory_gb is None:
        return None
    return p.host_memory_gb * 10**9, f"preset {p.name}: {p.host_memory_source}"


def _host(setup: Setup, plan: "buf.PhasePlan") -> HostMemory:
    known = host_capacity(setup.request, setup.gpu)
    capacity = known[0] if known else None
    used = plan.host_peak_bytes > 0
    key = (plan.host_resident_bytes, plan.host_peak_bytes, plan.host_pinned_bytes, capacity,
           (plan.host_peak_bytes <= capacity) if used and capacity is not None else None)
    # one per value, shared as items are (buffers.item: nothing in the core changes one); most are all zeros
    hit = _HOSTS.get(key)
    if hit is None:
        if len(_HOSTS) >= 1024:
            _HOSTS.clear()
        hit = _HOSTS[key] = HostMemory(resident_bytes=key[0], peak_bytes=key[1], pinned_bytes=key[2],
                                       capacity_bytes=key[3], fits=key[4])
    return hit


_HOSTS: dict[tuple, HostMemory] = {}  # _host's answers, by their fields


def host_notes(setup: Setup, host: HostMemory) -> list[str]:
    """What offload holds in one node's host RAM, against the node's RAM (both numbers named)."""
    if host.peak_bytes == 0:
        return []
    ranks = setup.request.gpus
    held = f"offload holds {fmt_bytes(host.peak_bytes)} of host RAM per node at its peak (the sum over its {ranks} ranks)"
    known = host_capacity(setup.request, setup.gpu)
    if known is None:
        return [f"host RAM: {held}; the node's RAM is unknown, so it is not checked (give --host-memory-gib)"]
    verdict = "fits" if host.fits else "does NOT fit"
    return [f"host RAM {verdict}: {held} vs {fmt_bytes(known[0])} on the node ({known[1]})"]


def _ring_scratch_note(setup: Setup, acts: Activations | None, plan: "buf.PhasePlan", peak: int) -> list[str]:
    """CPU ranks under cp: how far above the peak a measurement can read when gloo's worker still
    holds its scratch of the ring's K/V all-gather through a block's ring backward
    (context_parallel.gloo_ring_scratch_bytes), bounded from the largest block-backward start."""
    starts = [p.bytes for p in plan.phases if p.kind is PhaseKind.START_OF_BLOCK]
    if setup.device != "cpu" or acts is None or setup.arch is None or not starts:
        return []
    req = setup.request
    held = gloo_ring_scratch_bytes(setup.arch, req.micro_batch * req.seq_len, setup.recipe.compute_bytes)
    above = max(starts) + held - peak
    if above <= 0:
        return []
    return [f"CPU ranks (gloo): the worker thread of ring attention's K/V all-gather may still hold its scratch copy "
            f"({held:,} bytes) through a block's ring backward; a measured peak can then read up to {above:,} bytes "
            "above this one (a race between threads, seen at short ring kernels)"]


def sequence_past_positions(model_name: str, learned_positions: int, seq_len: int) -> str | None:
    """Why the model cannot take a sequence of seq_len, or None: a learned position table has one
    row per position (GPT2Model indexes wpe with position ids 0..seq_len-1, transformers' gpt2
    modeling), so a longer sequence is an index error in a real run, not a cost. RoPE models
    extrapolate past max_position_embeddings (badly, but they run): not refused."""
    if not learned_positions or seq_len <= learned_positions:
        return None
    return (f"seq_len({seq_len}) exceeds the {learned_positions} positions of {model_name}'s learned "
            "position embeddings (config n_positions): the model cannot take a longer sequence")


def position_limit_error(setup: Setup) -> str | None:
    """sequence_past_positions for the setup's model and request."""
    arch = setup.model.architecture
    return sequence_past_positions(setup.model.name, arch.learned_positions if arch is not None else 0,
                                   setup.request.seq_len)


def position_notes(setup: Setup) -> list[str]:
    """The estimate still answers (its arithmetic is that of a longer table); the note says the run
    would fail, and verify refuses it (backend/launch.py worker_job)."""
    error = position_limit_error(setup)
    return [f"WARNING: {error}; a real run fails at its first forward"] if error else []


def _defaulted_notes(setup: Setup) -> list[str]:
    """A user's config that leaves out size-defining fields is sized by its config class's defaults
    (as transformers builds it): said, each field and the value taken, where the text shows it."""
    if setup.request.model_config_ is None or setup.model.config is None:
        return []
    missing = defaulted_size_fields(setup.model.config)
    if not missing:
        return []
    taken = ", ".join(f"{name} {value:,}" for name, value in missing.items())
    return [f"WARNING: the config does not give {', '.join(missing)}: taken from model_type "
            f"{setup.model.config.get('model_type')!r}'s defaults ({taken}), so the size is partly that default "
            "model's; give them as the model's config.json does"]


def _notes(setup: Setup, acts: Activations | None, plan: "buf.PhasePlan", peak_phase: Phase,
           capacity: int, peak: int, held: "reserved.Reserved | None" = None) -> list[str]:
    s, r = setup.strategy, setup.recipe
    notes = [
        f"parameters: {setup.psi:,} x {r.weight_bits} bits"
        + (f", sharded over {setup.shard_size} ranks" if s.shards_parameters else ", replicated on every rank"),
        f"gradients: {r.grad_bits}-bit" + (f", sharded over {setup.shard_size}" if s.shards_gradients else ", full on every rank"),
        f"optimizer states: {setup.request.optimizer}"
        + (f" + fp32 master ({r.master_bits} bits)" if r.master_bits else "")
        + (f", sharded over {setup.shard_size}" if s.shards_optimizer else ", full on every rank")
        + (f", offloaded to {setup.zero.offload_optimizer}" if setup.zero.offload_optimizer != "none" else ""),
    ]
    notes.extend(optimizer_notes(setup))
    notes.extend(position_notes(setup))
    notes.extend(_defaulted_notes(setup))
    if setup.tp > 1 and setup.request.tp_plan == "transformers":
        notes.append(f"tensor parallelism: transformers' own tp_plan (from_pretrained(tp_plan=\"auto\"), model_type "
                     f"{setup.model.architecture.model_type!r}): tp({setup.tp}) splits what the plan names (heads, dense "
                     "MLP columns; routed experts whole), embedding and LM head over vocabulary rows, norms whole, no "
                     f"sequence parallelism: {setup.rank_psi:,} parameters per rank before data-parallel sharding; the "
                     "whole logits all-gathered on every rank (lm_head colwise_gather_output) and HF's loss on them"
                     + ("; FSDP2 over dp_shard as transformers 5.25 composes it (DistributedConfig(tp_size, "
                        "fsdp_size): the embedding its own unit, the final norm and LM head one unit kept gathered "
                        "from the forward to their backward)" if setup.world_size > setup.tp else ""))
    elif setup.tp > 1:
        notes.append(f"tensor parallelism: tp({setup.tp}) splits the heads, the MLP's inner width and the vocabulary "
                     f"(Megatron column/row and vocab-parallel), norms whole: {setup.rank_psi:,} parameters per rank "
                     f"before data-parallel sharding; sequence parallelism {'on' if setup.sequence_parallel else 'off'}; "
                     + ("logits vocab-sharded (loss_parallel)" if setup.vocab_parallel_loss
                        else "logits gathered on every rank (DeepSpeed AutoTP)"))
    if setup.cp > 1:
        notes.append(f"context parallelism: cp({setup.cp}) keeps {setup.request.seq_len // setup.cp:,} of each sequence's "
                     f"{setup.request.seq_len:,} tokens per rank; ring attention gathers the whole sequence's K/V per layer")
        notes.extend(_ring_scratch_note(setup, acts, plan, peak))
    if setup.model.traced is not None:
        t = setup.model.traced
        notes.append(f"traced: model_type {t.model_type!r} has no analytic reader; parameters counted by "
                     f"transformers on the meta device, activations measured by tracing one forward and "
                     f"backward on fake tensors at {t.setting}")
        notes.extend(f"traced, assumed: {a}" for a in t.assumptions)
    if acts is None:
        notes.append("activations: unknown (only a parameter count was given); the peak excludes them")
    else:
        eager_only = setup.arch is not None and setup.arch.attention_implementation == "eager"
        notes.append(f"activations: {acts.saved_bytes:,} bytes saved for backward at micro_batch "
                     f"{setup.request.micro_batch} x seq_len {setup.request.seq_len} "
                     f"({'eager' if eager_only else setup.request.attention}, "
                     f"checkpointing {setup.request.checkpointing})")
    if setup.arch is not None:
        notes.extend(setup.arch.notes)  # what the family's reader assumed (eager only, vision tower)
    notes.append(f"peak occurs during {peak_phase.name}")
    notes.append(loop_note(setup.request.keeps_outputs, _held_outputs(setup)))
    if setup.request.train_metrics:
        notes.append(train_metrics_note(setup.request.train_metrics, _metric_autocasts(setup),
                                        sum(i.bytes for i in _train_metric_items(setup))))
    compiled = compile_note(setup.request.compile, setup.request.checkpointing)
    if compiled:
        notes.append(compiled)
    notes.extend(loss_notes(loss_kernel(setup.request.loss, setup.gpu.is_cpu)))
    notes.extend(low_precision_notes(setup.request.low_precision, setup.arch, setup.strategy.shards_parameters,
                                     setup.request.float8_all_gather))
    notes.extend(fused_kernels_notes(setup.request.fused_kernels))
    notes.extend(plan.notes)
    if setup.finetune is not None and setup.finetune.quantize != "none" and setup.device == "cuda":
        notes.append(f"quantized base ({setup.finetune.quantize}) on CUDA: bitsandbytes 0.50's CUDA path (MatMul4Bit, "
                     "MatMul8bitLt) modelled from its source, unverified on a GPU (bench/gpu_check.py RECIPE_GRID); "
                     "its CPU path is measured")
    if setup.gpu.is_cpu:
        notes.append("cpu ranks: no CUDA context; capacity is host memory shared by the ranks of a node")
    else:
        arch = cuda_context.architecture(setup.gpu.name)
        notes.append(f"framework: CUDA context {fmt_bytes(setup.gpu.cuda_context_bytes)} on {setup.gpu.name} "
                     f"({arch.name if arch else 'architecture not catalogued'}, lazy module loading as torch sets "
                     f"it; gpus.yaml's envelope raised to the largest published context of the architecture, "
                     f"data/cuda_context.yaml; CUDA_MODULE_LOADING=EAGER would add "
                     f"{fmt_bytes(cuda_context.eager_extra_bytes())}) + BLAS workspaces "
                     f"{fmt_bytes(setup.gpu.blas_workspace_bytes)} through the caching allocator (torch's "
                     f"CublasHandlePool.cpp defaults for sm {arch.sm if arch else '?'}, one pair per thread "
                     "running matmuls: forward and autograd's backward)")
    notes.extend(f"time model: {caveat}" for caveat in setup.gpu.time_model_caveats)
    if setup.request.fsdp_version == 1:
        notes.append("fsdp_version 1 (torch FSDP1): memory by FSDP2's per-unit model (the same units gathered, "
                     "unsharded and sharded gradients); the step makes no copies on the compute stream (FSDP1 gathers "
                     "into its flat parameters and casts and reduces its gradients on its own stream), its "
                     "collectives and their overlap are FSDP2's")
    workspace = reserved.symmetric_memory_bytes(setup)
    if workspace:
        notes.append(f"async TP: its symmetric-memory workspace on the tp({setup.dims.tp}) group, "
                     f"{fmt_bytes(workspace)} outside the caching allocator (counted with NCCL's buffers: 2/tp of a "
                     "micro-batch's activation, what a matmul with its reduce-scatter asks); its step time pipelines "
                     "each sequence-parallel collective with the matmul beside it (time terms); modelled from torch's "
                     "source, unverified on a GPU (no multi-GPU device here)")
    if held is not None:
        notes.extend(reserved_notes(held))
    if capacity > 0 and held is None:
        verdict = "fits" if peak <= capacity else "does NOT fit"
        notes.append(f"{verdict}: peak {fmt_bytes(peak)} vs {fmt_bytes(capacity)} on each {setup.gpu.name}")
    elif capacity > 0:
        verdict = "fits" if held.fits else "does NOT fit"
        notes.append(f"{verdict}: reserved peak {fmt_bytes(held.reserved_peak_bytes)} (live peak {fmt_bytes(peak)}) "
                     f"vs {fmt_bytes(capacity)} on each {setup.gpu.name}")
    return notes


def reserved_notes(held: "reserved.Reserved") -> list[str]:
    """What the caching allocator, the CUDA context and NCCL add, and what is assumed (simulated)."""
    s, other = held.stats, held.other
    conf = held.conf.text or "unset (torch's defaults)"
    other_conf = held.conf.with_expandable(not held.conf.expandable_segments).text or "unset"
    notes = [f"reserved (simulated, torch 2.13's caching allocator replaying the step; PYTORCH_CUDA_ALLOC_CONF "
             f"{conf}): {fmt_bytes(s.reserved_peak_bytes)} reserved for {fmt_bytes(s.allocated_peak_bytes)} "
             f"allocated at peak, {s.segments_peak} segments; with {other_conf} it would reserve "
             f"{fmt_bytes(other.reserved_peak_bytes)}"
             + (f"; {fmt_bytes(held.shortfall_bytes)} more held back ({100 * reserved.REPLAY_SHORTFALL:.1f}%: the "
                "largest shortfall of the replay measured on a GPU, bench/gpu_report.py)" if held.shortfall_bytes else ""),
             f"outside the allocator: CUDA context {fmt_bytes(held.cuda_context_bytes)}"
             + (" (calibrated)" if held.measured else " (gpus.yaml)")
             + (f", NCCL buffers {fmt_bytes(held.nccl_bytes)} for {len(held.communicators)} communicator(s) "
                f"({', '.join(held.communicators)}; channels x 2 ring connections x LL + LL128 + NCCL_BUFFSIZE, "
                "and NVLS's multicast buffers for a communicator of 3+ GPUs within an NVSwitch node)"
                if held.communicators else ", no NCCL communicator")]
    if held.conf.garbage_collection_threshold > 0:
        notes.append("garbage_collection_threshold acts only under torch.cuda.set_per_process_memory_fraction "
                     "(CUDACachingAllocator.cpp malloc: set_fraction); not assumed here")
    return notes


def cpu_rank_bytes(result: EstimateResult, ranks_per_node: int) -> tuple[int, int]:
    """(peak, resident) one CPU rank holds in all: on `--gpu cpu` the "device" and the host are
    the same RAM, so what offload moves to the host (per node, shared by the node's ranks) is
    measured in the rank's own allocations too."""
    share = max(1, ranks_per_node)
    return (result.per_device.peak_bytes + result.host.peak_bytes // share,
            result.per_device.resident_bytes + result.host.resident_bytes // share)
