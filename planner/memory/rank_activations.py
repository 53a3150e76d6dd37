"""What one rank's autograd saves for backward: the model's activations (planner/model/activations.py)
narrowed to the rank by tensor and context parallelism, LoRA's when fine-tuning, or a traced
model's as measured. The orchestrator (planner/memory/orchestrator.py) and the pipeline's stages
(planner/parallel/pipeline.py) both start from it.
"""

from __future__ import annotations

from planner.model.activations import FP32, ActivationItem, Activations, estimate_activations
from planner.model.architecture import derived
from planner.parallel.context import cp_activations
from planner.errors import PlannerError
from planner.recipes.activation_offload import offloaded, on_shared_memory
from planner.recipes.finetune import lora_activations
from planner.recipes.losses import KERNEL_LOSSES, check_fused, loss_kernel, with_fused_loss, with_in_forward_loss
from planner.recipes.low_precision import converted_weight_elements, recipe_of, with_low_precision
from planner.setup import Setup
from planner.parallel.tensor import tp_activations


def activations(setup: Setup) -> Activations | None:
    acts = _rank_activations(setup)
    if acts is None or not setup.request.activation_offload:
        return acts
    tokens = setup.request.micro_batch * setup.request.seq_len // setup.cp
    # on CPU ranks the host copies are the rank's own memory (planner/recipes/activation_offload.py)
    if setup.device == "cpu":
        return on_shared_memory(acts, setup.arch, tokens, setup.recipe.compute_bytes, autocast=_autocast(setup),
                                hf_loss=setup.request.loss == "hf" and not setup.vocab_parallel_loss)
    autocast = _autocast(setup)
    return offloaded(acts, setup.arch, tokens, setup.recipe.compute_bytes, autocast=autocast,
                     uncast_elements=converted_weight_elements(setup.arch, setup.request.low_precision)[0]
                     if autocast else 0, fused=setup.request.fused_kernels)


def _rank_activations(setup: Setup) -> Activations | None:
    if setup.model.traced is not None:
        return _traced_activations(setup)
    if setup.arch is None:
        return None
    acts, autocast = _activations(setup)
    recipe = recipe_of(setup.request.low_precision)
    if recipe is not None:  # a data-parallel full fine-tune (check_low_precision): the whole model's blocks
        acts = with_low_precision(acts, setup.arch, recipe, setup.request.micro_batch * setup.request.seq_len)
    if setup.request.loss == "chunked-in-forward":
        return _in_forward(setup, acts, autocast)
    if setup.request.loss not in KERNEL_LOSSES:
        return acts
    # the fused kernel reads the final norm's output (fp32 under autocast over fp32 weights) and
    # the LM head's weight as the forward sees it (fp32 under autocast, the compute copy otherwise)
    req, arch, compute = setup.request, setup.arch, setup.recipe.compute_bytes
    hidden_bytes = FP32 if autocast else compute
    check_fused(req.loss, hidden_bytes, setup.gpu.is_cpu, arch.final_logit_softcapping)
    head_trained = setup.finetune is None or setup.finetune.train_embeddings
    # the last position of each sequence has no next token (transformers' ForCausalLMLoss shift)
    rows = req.micro_batch * (req.seq_len - 1)
    return with_fused_loss(acts, loss_kernel(req.loss, setup.gpu.is_cpu), tokens=req.micro_batch * req.seq_len,
                           rows=rows, hidden=arch.hidden_size,
                           vocab=arch.vocab_size, compute_bytes=compute, hidden_bytes=hidden_bytes,
                           weight_bytes=FP32 if autocast else compute, head_trained=head_trained,
                           softcap=arch.final_logit_softcapping, logits_held=req.keeps_outputs)


def _in_forward(setup: Setup, acts: Activations, autocast: bool) -> Activations:
    """torchtitan's ChunkedLossWrapper on the rank (planner/recipes/losses.py with_in_forward_loss): the
    hidden states in the residual stream's dtype (fp32 under autocast over fp32 weights), the rank's
    columns of the head (vocabulary / tp, its logits vocab-parallel under torch's TP), the weight's
    per-chunk gradient in the compute dtype, cast to fp32 where the head's gradient is fp32 (autocast
    over fp32 weights). The final norm's output the head saves under HF's loss (the compute dtype, its
    1/tp under SP) is not saved. Under FSDP2 reducing in fp32 the head's gradient waits across the
    chunks in fp32 (in_forward_memory reduce_bytes)."""
    req, arch, compute = setup.request, setup.arch, setup.recipe.compute_bytes
    tokens = req.micro_batch * req.seq_len
    norm_output = compute * tokens * arch.hidden_size
    sharded = setup.strategy.shards_parameters and setup.data_parallel_wrapped  # FSDP2 wraps the head
    if setup.sequence_parallel and setup.tp > 1:
        norm_output //= setup.tp
    return with_in_forward_loss(acts, tokens=tokens, micro_batch=req.micro_batch, chunks=setup.loss_chunks,
                                hidden=arch.hidden_size, vocab=arch.vocab_size, compute_bytes=compute,
                                stream_bytes=FP32 if autocast else compute,
                                vocab_parallel=bool(setup.vocab_parallel_loss), head_grad_bytes=compute,
                                head_grad_fp32=autocast and compute != FP32, norm_output_bytes=norm_output,
                                autocast=autocast and compute != FP32,
                                reduce_bytes=FP32 if sharded and req.reduce_dtype == "fp32" else 0)


def _activations(setup: Setup) -> tuple[Activations, bool]:
    """(the rank's activations with HF's loss, whether the forward runs under autocast over fp32
    weights)."""
    req = setup.request
    compute = setup.recipe.compute_bytes
    if setup.finetune is not None:
        # torch.autocast (ddp with a mixed recipe) keeps PEFT's fp32 adapters: each casts its input
        adapter_copy = setup.framework.weights_are_master and not setup.strategy.shards_parameters \
            and setup.recipe.master_bits > 0
        fp32_stream = setup.finetune.quantize != "none" and adapter_copy
        return lora_activations(setup.arch, setup.finetune, micro_batch=req.micro_batch, seq_len=req.seq_len,
                                compute_bytes=compute, attention=req.attention, checkpointing=req.checkpointing,
                                device=setup.device, adapter_copy=adapter_copy,
                                linears_save_inputs=setup.framework.linears_save_inputs(setup.strategy),
                                fp32_stream=fp32_stream, fused=req.fused_kernels), fp32_stream
    arch = setup.arch
    seq_len = req.seq_len // setup.cp  # the rank's two chunks of each sequence under cp
    # torch.autocast over the fp32 weights: torch's mixed recipes where nothing casts them (DDP, a
    # TP-only rank; FSDP2 casts them by its MixedPrecisionPolicy: backend/train.py, train_parallel.py).
    # A pipeline stage counts its own (pipeline._autocast_fp32_stream_extra); cp keeps the 16-bit count.
    autocast = _autocast(setup)
    fused = req.fused_kernels  # planner/recipes/fused_kernels.py (check_fused_kernels: no pp or compile)
    acts = _model_activations(arch, req.micro_batch, seq_len, compute, req.attention, req.checkpointing, setup.device,
                              autocast, req.checkpointing_every, setup.loss_chunks, fused)
    if setup.rank_architecture is not None:
        acts = _tp_activations(acts, setup.model.architecture, setup.arch, setup.tp, setup.sequence_parallel,
                               req.micro_batch * seq_len, compute, setup.vocab_parallel_loss, autocast)
    return cp_activations(acts, setup.arch, cp=setup.cp, tokens=req.micro_batch * req.seq_len, b=compute,
                          tp=setup.tp, sequence_parallel=setup.sequence_parallel, device=setup.device,
                          fused=fused), autocast


def _autocast(setup: Setup) -> bool:
    """torch.autocast over the fp32 weights (see _rank_activations)."""
    return setup.recipe.autocasts_over_weights(setup.framework.weights_are_master,
                                               setup.strategy.shards_parameters and setup.data_parallel_wrapped,
                                               setup.dims.pp, setup.cp)


def _model_activations(arch, micro_batch: int, seq_len: int, compute: int, attention: str, checkpointing: str,
                       device: str, autocast: bool, every: int | None, loss_chunks: int,
                       fused: tuple[str, ...] = ()) -> Activations:
    """estimate_activations, once per architecture and arguments: the plan search asks the same
    ones for every strategy, shard group and offload of a layout (an Activations is frozen)."""
    memo = derived(arch).setdefault("_activations", {})
    key = (micro_batch, seq_len, compute, attention, checkpointing, device, autocast, every, loss_chunks, fused)
    if key not in memo:
        if len(memo) >= 4096:
            memo.clear()
        memo[key] = estimate_activations(arch, micro_batch=micro_batch, seq_len=seq_len, compute_bytes=compute,
                                         attention=attention, checkpointing=checkpointing, device=device,
                                         autocast=autocast, every=every, loss_chunks=loss_chunks, fused=fused)
    return memo[key]


def _tp_activations(acts: Activations, full, rank, tp: int, sequence_parallel: bool, tokens: int, b: int,
                    vocab_parallel_loss: bool, autocast: bool) -> Activations:
    """tensor_parallel.tp_activations, once per its arguments: the plan search asks the same for
    every strategy, shard group and pipeline schedule of a TP layout. ``acts`` (an answer of
    _model_activations, frozen) and the rank's architecture are kept in the memo beside the
    answer, so their identities in the key stay theirs."""
    memo = derived(full).setdefault("_tp_activations", {})
    key = (id(acts), id(rank), tp, sequence_parallel, tokens, b, vocab_parallel_loss, autocast)
    hit = memo.get(key)
    if hit is None or hit[0] is not acts or hit[1] is not rank:
        if len(memo) >= 4096:
            memo.clear()
        hit = memo[key] = (acts, rank, tp_activations(acts, full, rank, tp=tp, sequence_parallel=sequence_parallel,
                                                      tokens=tokens, b=b, vocab_parallel_loss=vocab_parallel_loss,
                                                      autocast=autocast))
    return hit[2]


def _traced_activations(setup: Setup) -> Activations:
    """The activations of a model traced outside the core, measured at this request's setting."""
    t, req = setup.model.traced, setup.request
    setting = traced_setting(req.micro_batch, req.seq_len, setup.recipe.compute, req.attention, req.checkpointing)
    if t.setting != setting:
        raise PlannerError(f"traced profile of {setup.model.name} was measured at {t.setting}, "
                           f"but the request is {setting}", field=None)
    body = t.num_layers * t.layer_kept_bytes
    checkpointed = req.checkpointing == "full"
    extra = max(t.loss_transient_bytes,
                (t.layer_saved_bytes if checkpointed else 0) + t.layer_transient_bytes)
    items = (ActivationItem(f"{t.num_layers} blocks, {t.layer_kept_bytes:,} B kept each (traced)", body),
             ActivationItem("embeddings, final norm, logits / loss (traced)", t.saved_bytes - body),
             ActivationItem("backward transient at the loss (traced)", t.loss_transient_bytes))
    return Activations(saved_bytes=t.saved_bytes, peak_extra_bytes=extra, items=items,
                       layer_saved_bytes=t.layer_saved_bytes, layer_kept_bytes=t.layer_kept_bytes,
                       head_saved_bytes=t.saved_bytes - body, loss_transient_bytes=t.loss_transient_bytes,
                       layer_transient_bytes=t.layer_transient_bytes, num_layers=t.num_layers,
                       checkpointed=checkpointed)


def traced_setting(micro_batch: int, seq_len: int, compute: str, attention: str, checkpointing: str) -> str:
    """The step a traced profile stands for, in words (the profile is valid for this one only)."""
    return (f"micro_batch {micro_batch} x seq_len {seq_len}, {compute} compute, {attention} attention, "
            f"checkpointing {checkpointing}")
