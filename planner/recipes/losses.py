"""The loss implementation a script computes the causal-LM loss with (``loss``).

- ``hf``: transformers' ForCausalLMLoss over the whole logits (activations._loss_saved and
  _loss_transient): the fp32 log-probabilities saved, the backward's two fp32 tokens x vocab
  gradients. Under torch tensor parallelism the probe and the model compute it vocab-parallel
  (loss_parallel), which ``vocab-parallel`` names.
- ``chunked``: torchtune's chunked output loss (CEWithChunkedOutputLoss, num_output_chunks=8:
  the LM head applied to ``loss_chunks`` slices of the sequence and each slice upcast and
  cross-entropied apart). The log-probabilities of every chunk are still saved (4 bytes x tokens x
  vocab in all), but the loss's backward runs one chunk at a time: its two fp32 gradients are
  1/chunks of HF's. torchtitan's ChunkedLossWrapper runs each chunk's backward inside the forward
  instead: ``chunked-in-forward``.
- ``chunked-in-forward``: torchtitan 0.3.0's ChunkedLossWrapper (components/loss.py, num_chunks=8;
  the default loss of its llama3 configs): the model's forward stops at the final norm
  (``_skip_lm_head``); the hidden states are cut into ``loss_chunks`` equal slices of the sequence
  (torch._check: the sequence must divide), each made a detached leaf, and for each in turn the LM
  head, the cross-entropy (reduction sum) and ``chunk_loss.backward()`` run inside the loss's call:
  the head's weight gradient is made there, and each slice's input gradient is copied into one
  fp32 buffer of the hidden states' shape (GradAccumulator), cast at the end to the hidden states'
  dtype and saved by _DecoderOutputGradientBackProp, whose backward hands it to the decoder's
  backward. Nothing logits-sized outlives a chunk (in_forward_memory). Under tensor parallelism
  the hidden states enter the head replicated and each chunk's logits stay sharded over the
  vocabulary (its colwise LM head, always loss-parallel in 0.3.0: _LossParallelCrossEntropy, three
  TP all-reduces of one fp32 value per token per chunk). Activation checkpointing wraps the blocks
  only: the loss's call is outside them, nothing in it is recomputed. torchtitan also runs it on a
  pipeline's last stage and under context parallelism; those are refused here (not modelled).
- ``liger-fused``: Liger-Kernel 0.8.5's LigerFusedLinearCrossEntropyFunction
  (liger_kernel/ops/fused_linear_cross_entropy.py): the LM head and the cross-entropy in one
  autograd function whose forward also computes both gradients, chunk by chunk of tokens; the
  logits never exist beyond one chunk (``liger_memory``).
- ``cce``: Apple's Cut Cross-Entropy 25.1.1. On a GPU its default ``impl="cce"`` Triton kernels
  (cut_cross_entropy/cce.py): the logits live only in SRAM tiles, the forward saves the
  log-sum-exp, the backward recomputes the logits tile by tile (``cce_memory``). On CPU ranks,
  where no Triton kernel runs, its ``impl="torch_compile"`` (torch_compile.py): the logits
  materialised and cross-entropied under torch.compile, which saves them for backward
  (``cce_compile_memory``); the loss kernel is chosen by the device (``loss_kernel``).
- ``flash-attn``: flash-attn's CrossEntropyLoss (flash_attn/losses/cross_entropy.py; the loss
  llm-foundry's MPT trains with by default, ``loss_fn: fused_crossentropy``): the LM head's logits
  in the compute dtype go to one kernel without an fp32 upcast; it saves those logits, the fp32
  log-sum-exp per token and the labels, and its backward writes the gradient into a new tensor of
  the logits' shape and dtype (``flash_attn_memory``). The same in 1.0.x (the CUDA xentropy
  extension) and 2.x (a Triton kernel).
- ``vocab-parallel``: torch tensor parallelism's loss_parallel (tp > 1 on a torch strategy): the
  logits stay sharded over tp (planner/parallel/tensor.py loss_parallel_extra_bytes), verified by
  the tp runs of tests/real_runs.py on gloo (backend/train_parallel.py computes the loss under
  ``loss_parallel()``). Its three all-reduces (torch 2.13 distributed/tensor/parallel/loss.py
  _log_softmax: the max :209 and the sum of exponentials :214; _nll_loss_forward: the target's
  logit :316) carry one fp32 value per token each: charged as TP collectives on the critical path
  (planner/parallel/tensor.py tp_collectives), mostly their latency.

Liger and CCE's Triton kernels run on a GPU only: their terms are read from the source, not
measured here, and every result that uses them says so (``loss_notes``); bench/gpu_check.py
measures them. CCE's torch_compile implementation is measured on CPU ranks (tests/real_runs.py).
flash-attn's (Triton in 2.x, a CUDA extension in 1.0.x) runs on a GPU only and is read from the
source, unverified.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal

from planner.errors import PlannerError
from planner.model.activations import FP32, ActivationItem, Activations, EdgeTerms

Loss = Literal["hf", "chunked", "chunked-in-forward", "liger-fused", "cce", "flash-attn", "vocab-parallel"]
CHUNKED = ("chunked", "chunked-in-forward")  # the losses that take loss_chunks
TORCHTITAN_SOURCE = ("torchtitan 0.3.0 components/loss.py ChunkedLossWrapper (:567; slices :676, the head's reduction "
                     "off :731), GradAccumulator (:449, its fp32 buffer :498), _DecoderOutputGradientBackProp (:838, "
                     ":858), _LossParallelCrossEntropy (:69)")
FUSED = ("liger-fused", "cce")  # the LM head and the loss in one function: no logits returned
# the kernels whose terms replace HF's loss (with_fused_loss), data-parallel layouts only
KERNEL_LOSSES = (*FUSED, "flash-attn")
# torchtune modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss(num_output_chunks=8);
# torchtitan b5bcd76 components/loss.py ChunkedLossWrapper.Config.num_chunks = 8
DEFAULT_CHUNKS = 8
LABELS = 8  # the shifted int64 labels (transformers loss_utils.py:66), kept by every loss
LIGER_SOURCE = "Liger-Kernel 0.8.5 liger_kernel/ops/fused_linear_cross_entropy.py"
CCE_SOURCE = "cut-cross-entropy 25.1.1 cut_cross_entropy/cce.py, cce_backward.py, cce_lse_forward.py"
CCE_COMPILE_SOURCE = "cut-cross-entropy 25.1.1 cut_cross_entropy/torch_compile.py, utils.py"
FLASH_ATTN_SOURCE = ("flash-attn 2.4.2 flash_attn/ops/triton/cross_entropy.py (1.0.3 "
                     "flash_attn/losses/cross_entropy.py with csrc/xentropy)")
# The loss kernel that runs CCE on a CPU rank (loss_kernel): not a user choice, the device's
CCE_COMPILE = "cce-torch-compile"


def loss_kernel(loss: str, gpu_is_cpu: bool) -> str:
    """The implementation that computes ``loss`` on the device: Cut Cross-Entropy's Triton kernels
    need a GPU, so a CPU rank runs its ``impl="torch_compile"`` (linear_cross_entropy.py: the
    Triton kernels are the default on Linux, torch_compile the other implementation; the probe's
    backend/losses.py passes it where the hidden states are not on CUDA)."""
    return CCE_COMPILE if loss == "cce" and gpu_is_cpu else loss


def loss_chunks(request: Any, why_not: str | None, torch_tp: bool, fused_why_not: str | None = None,
                in_forward_why_not: str | None = None) -> int:
    """How many chunks the loss's backward runs in (1: the whole logits at once), after refusing
    what is not modelled, naming the field. ``why_not``: what of the request the chunked loss is
    not modelled with (a model-parallel layout, LoRA, a traced model); ``fused_why_not``: what
    the fused kernels are not (a model-parallel layout, a traced model; LoRA is: a frozen head
    only drops the weight's gradient); ``in_forward_why_not``: what torchtitan's
    ChunkedLossWrapper is not (check_in_forward)."""
    loss = request.loss
    if request.loss_chunks is not None and loss not in CHUNKED:
        raise PlannerError(f"loss_chunks={request.loss_chunks} applies to loss=chunked or chunked-in-forward, not "
                           f"loss={loss}", field="loss_chunks")
    if loss in (*CHUNKED, *KERNEL_LOSSES) and getattr(request, "params", None) is not None:
        raise PlannerError(f"loss={loss} needs an architecture (its terms are tokens x vocabulary): give model or "
                           "model_config, not params", field="loss")
    if loss == "vocab-parallel" and not torch_tp:
        raise PlannerError("loss=vocab-parallel is tensor parallelism's loss_parallel: it needs tp > 1 on a torch "
                           "strategy (fsdp, hsdp)", field="loss")
    if loss == "chunked-in-forward":
        if in_forward_why_not:
            raise PlannerError(f"loss=chunked-in-forward with {in_forward_why_not}: torchtitan's ChunkedLossWrapper "
                               "is modelled on one device (single), on FSDP2 (fsdp, fsdp-grad-op, hsdp) and on a "
                               "TP-only rank, with tp, for a full fine-tune", field="loss")
        chunks = request.loss_chunks or DEFAULT_CHUNKS
        local = request.seq_len // max(1, getattr(request, "cp", 1))
        if local % chunks:
            raise PlannerError(f"loss_chunks={chunks} with seq_len {request.seq_len}: torchtitan's ChunkedLossWrapper "
                               "cuts the sequence into equal chunks (torch._check: the sequence length must be "
                               "divisible by num_chunks)", field="loss_chunks")
        return chunks
    blocked = why_not if loss == "chunked" else fused_why_not if loss in KERNEL_LOSSES else None
    if blocked:
        raise PlannerError(f"loss={loss} with {blocked}: modelled for a data-parallel layout (single, ddp, zero0-3, "
                           "fsdp, hsdp)" + (" of a full fine-tune (torchtitan's ChunkedLossWrapper, modelled with tp, is "
                                            "loss=chunked-in-forward)" if loss == "chunked" else ""), field="loss")
    if loss == "chunked":
        return request.loss_chunks or DEFAULT_CHUNKS
    return 1


def in_forward_why_not(request: Any, strategy: Any, framework: Any, traced: bool, softcap: bool) -> str | None:
    """What of the request torchtitan's ChunkedLossWrapper is not modelled with, in words (None:
    modelled). It calls ``backward()`` inside the loss's call, so the head's parameters get their
    gradient before the wrapper's backward has begun: DeepSpeed's engine (whose backward(loss)
    drives its reduction hooks) and DDP's reducer (each chunk's backward marks the head's weight
    ready again) do not take that, and torchtitan wraps neither (FSDP2 or one device; its FSDP2
    keeps the head unsharded across the chunks, ``set_reshard_after_forward(False)``). Pipeline,
    context and expert parallelism, which torchtitan composes it with, are not modelled here; a
    frozen head (LoRA), a traced model or soft-capped logits (a tanh per chunk) neither."""
    # FSDP2's framework (its shards DTensors) on one device or sharding the parameters, or a TP-only rank (one
    # data-parallel rank: DDP wraps nothing): not DDP over replicas, not DeepSpeed
    replicas = request.gpus * request.nodes // max(1, request.tp * request.pp * request.cp)
    if not framework.shards_as_dtensors or not (strategy.one_device or strategy.shards_parameters or replicas == 1):
        return f"strategy {request.strategy} (not FSDP2, one device or a TP-only rank)"
    parallel = [f"{name}={getattr(request, name)}" for name in ("cp", "pp", "ep") if getattr(request, name) > 1]
    if parallel:
        return ", ".join(parallel)
    if request.finetune != "full":
        return f"finetune={request.finetune}"
    if softcap:
        return "a soft-capped model (final_logit_softcapping)"
    return "a traced model" if traced else None


def in_forward_memory(*, tokens: int, micro_batch: int, chunks: int, hidden: int, vocab: int, compute_bytes: int,
                      stream_bytes: int, vocab_parallel: bool, head_grad_bytes: int,
                      head_grad_fp32: bool, autocast: bool = False,
                      reduce_bytes: int = 0) -> tuple[int, int, list[ActivationItem]]:
    """(held from the loss's call to the decoder's backward, the transient during the loss's call
    on top of the saved set without that held tensor, items) of torchtitan 0.3.0's
    ChunkedLossWrapper on ``tokens`` (``micro_batch`` sequences), ``vocab`` the rank's columns of
    the head (vocabulary / tp) and ``stream_bytes`` the hidden states' dtype.

    Held: ``grad_accumulator.result().to(hidden_states.dtype)`` saved by
    _DecoderOutputGradientBackProp (tokens x hidden in the hidden states' dtype) and the labels.
    During the call: the hidden states (``pred``, deleted by the trainer after the call), their
    ``.contiguous()`` slices when a slice along the sequence is not contiguous (more than one
    sequence: a copy of the whole), GradAccumulator's fp32 zeros buffer of the same shape, and
    per chunk (c tokens): the head's logits (``logits``, bound until the next chunk's replace
    them; compute dtype) and the loss's fp32 tensors. Without TP, F.cross_entropy on
    ``.float()``: the saved log-softmax output and, in its backward, nll's and log_softmax's two
    fp32 gradients: 12 bytes per logit (the upcast, forward only, 4 more in 16-bit). Under TP,
    _LossParallelCrossEntropy.backward: the saved log-probabilities, ``grad_input`` zeros,
    ``torch.exp(log_probs)`` and their sum live together: 16 bytes per logit. Then the head's
    backward: the chunk's input gradient (compute dtype) and its fp32 copy into the buffer, and
    the weight's new gradient for the chunk (compute dtype, plus its fp32 cast where the head's
    gradient is kept in fp32: autocast over fp32 weights), added into the head's gradient. At the
    end the buffer's cast (the held tensor) beside the buffer, before the call returns. Under
    torch.autocast (``autocast``, over fp32 weights and an fp32 stream) each slice is a leaf that
    requires grad, so autocast's cast cache keeps its 16-bit copy until the region exits: the
    slices' copies add up to tokens x hidden by the last chunk (peak trace, llama 32k vocabulary, 2,048
    tokens, bf16 autocast: the eight 131,072-byte casts live at the last chunk's loss backward).

    Under FSDP2 torchtitan turns the head unit's gradient reduction off for every chunk but the
    last (``lm_head.set_requires_gradient_sync(False)``), so from the first chunk's post-backward
    the head's gradient is kept unsharded in the reduce dtype (torch 2.13
    _fully_shard/_fsdp_param.py to_accumulated_grad_if_needed ``unsharded_grad.to(self.reduce_dtype)``,
    each later chunk's added by accumulate_unsharded_grad_if_needed) until the last chunk's
    reduce-scatter: ``reduce_bytes`` (fp32 reducing a 16-bit compute) per element where the
    phases count the head's unsharded gradient in the compute dtype, the difference added here."""
    c = micro_batch * (tokens // micro_batch // chunks)
    b = compute_bytes
    logits = b * c * vocab
    loss_fp32 = (16 if vocab_parallel else 12) * c * vocab
    upcast_forward = (0 if b == FP32 else FP32 * c * vocab) + (12 if vocab_parallel else 4) * c * vocab
    hidden_states = stream_bytes * tokens * hidden
    slices = stream_bytes * tokens * hidden if micro_batch > 1 else 0
    slices += b * tokens * hidden if autocast else 0  # their casts, in autocast's cache
    buffer = FP32 * tokens * hidden
    weight_grad = head_grad_bytes * vocab * hidden + (FP32 * vocab * hidden if head_grad_fp32 else 0)
    accumulated = max(0, reduce_bytes - b) * vocab * hidden  # FSDP2's reduce-dtype copy, beyond the phases' own
    head_backward = b * c * vocab + b * c * hidden + FP32 * c * hidden + weight_grad
    held = stream_bytes * tokens * hidden + LABELS * tokens
    during = hidden_states + slices + buffer + logits + accumulated + max(loss_fp32, upcast_forward, head_backward)
    end = hidden_states + slices + buffer + logits + accumulated + stream_bytes * tokens * hidden
    transient = max(during, end) - stream_bytes * tokens * hidden
    items = [ActivationItem("loss (chunked-in-forward): the hidden states' gradient, accumulated in the loss's "
                            "call and saved for the decoder's backward, and the labels", held),
             ActivationItem(f"transient at the loss (chunked-in-forward, one of {chunks} chunks of {c} tokens: its "
                            f"logits and {'vocab-parallel ' if vocab_parallel else ''}loss gradients, the head's "
                            "backward into the fp32 gradient buffer, beside the hidden states)", transient)]
    return held, transient, items


def with_in_forward_loss(acts: Activations, *, tokens: int, micro_batch: int, chunks: int, hidden: int, vocab: int,
                         compute_bytes: int, stream_bytes: int, vocab_parallel: bool, head_grad_bytes: int,
                         head_grad_fp32: bool, norm_output_bytes: int, autocast: bool = False,
                         reduce_bytes: int = 0) -> Activations:
    """The activations with HF's loss terms replaced by torchtitan's ChunkedLossWrapper's
    (in_forward_memory): no logits-sized tensor is saved, and the LM head saves nothing for the
    decoder's backward (each chunk's graph is freed by its own backward), so the final norm's
    output the head would have saved (``norm_output_bytes``, within the final norm's terms) is
    not held either. The head's weight gradient exists from the loss's call on
    (Activations.head_gradient_in_loss, planner/memory/buffers.py backward_sweep)."""
    held, transient, items = in_forward_memory(
        tokens=tokens, micro_batch=micro_batch, chunks=chunks, hidden=hidden, vocab=vocab,
        compute_bytes=compute_bytes, stream_bytes=stream_bytes, vocab_parallel=vocab_parallel,
        head_grad_bytes=head_grad_bytes, head_grad_fp32=head_grad_fp32, autocast=autocast, reduce_bytes=reduce_bytes)
    edges = acts.edges
    hf_saved = edges.loss_saved if edges is not None else FP32 * tokens * vocab + LABELS * tokens
    if edges is not None:
        edges = EdgeTerms(edges.embedding_saved, edges.final_norm_saved - norm_output_bytes, held, edges.rope_saved)
    kept = [i for i in acts.items if i.name != "logits / loss (fp32)"
            and not i.name.startswith("backward transient at the loss")]
    if acts.kept_blocks:
        layer = max(acts.rebuilt_blocks) + acts.layer_transient_bytes
    else:
        layer = acts.layer_saved_bytes + acts.layer_transient_bytes if acts.checkpointed else 0
    change = held - hf_saved - norm_output_bytes
    return replace(acts, saved_bytes=acts.saved_bytes + change, head_saved_bytes=acts.head_saved_bytes + change,
                   loss_transient_bytes=transient, peak_extra_bytes=max(transient, layer), edges=edges,
                   items=tuple(kept + items), head_gradient_in_loss=True)


def check_fused(loss: str, hidden_bytes: int, gpu_is_cpu: bool, softcap: bool) -> None:
    """Liger's kernels are Triton (liger_kernel/ops import triton; CUDA/ROCm only): CPU ranks are
    refused. CCE's Triton backward takes 16-bit hidden states only (cce_backward.py:259, ``assert
    e.dtype in (torch.float16, torch.bfloat16), "Backwards requires embeddings to be bf16 or
    fp16"``): on a GPU an fp32 stream (precision fp32, or autocast over fp32 weights, where the
    final norm returns fp32) is refused as the library refuses it; its torch_compile
    implementation (CPU ranks) takes any dtype but is modelled without soft-capping (which adds a
    compiled tanh whose saved tensors are not measured here). flash-attn's cross-entropy is Triton
    (2.x) or CUDA (1.0.x's xentropy; its CrossEntropyLoss asserts ``input.is_cuda``): CPU ranks are
    refused."""
    if gpu_is_cpu and loss == "flash-attn":
        raise PlannerError("loss=flash-attn is a Triton or CUDA kernel that runs on a GPU only; gpu cpu (CPU ranks) "
                           "cannot run it: choose hf, chunked or cce for CPU ranks", field="loss")
    if gpu_is_cpu and loss == "liger-fused":
        raise PlannerError(f"loss={loss} is a Triton kernel that runs on a GPU only; gpu cpu (CPU ranks) cannot run "
                           "it: choose hf, chunked or cce for CPU ranks", field="loss")
    if loss == "cce" and gpu_is_cpu and softcap:
        raise PlannerError("loss=cce on CPU ranks with a soft-capped model (final_logit_softcapping): Cut "
                           "Cross-Entropy's torch_compile implementation is modelled without soft-capping",
                           field="loss")
    if loss == "cce" and hidden_bytes == FP32 and not gpu_is_cpu:
        raise PlannerError("loss=cce with fp32 hidden states (precision fp32, or autocast over fp32 weights: ddp, "
                           "single): Cut Cross-Entropy's backward asserts bf16/fp16 embeddings (cce_backward.py); "
                           "cast the model to bf16 (precision bf16-pure) or use a sharding strategy that casts the "
                           "weights (zero1-3, fsdp)", field="loss")


def liger_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk of tokens (fused_linear_cross_entropy.py, chunk_mem_const 1): the transient
    logits bounded to about tokens x hidden elements,
    ``inc_factor = cdiv(V, H)``, ``chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT)``."""
    inc_factor = -(-vocab // hidden)
    chunk = -(-tokens // inc_factor)
    return min(1 << max(0, math.ceil(math.log2(chunk))), tokens)


def liger_memory(tokens: int, hidden: int, vocab: int, compute_bytes: int, hidden_bytes: int, weight_bytes: int,
                 head_trained: bool) -> tuple[int, int, list[ActivationItem]]:
    """(held from the loss's forward to its backward, the forward's transient at the last chunk,
    items). With reduction mean or sum (HF's, the Trainer's num_items_in_batch) the forward
    computes the gradients and saves them (``ctx.save_for_backward(grad_input, grad_weight,
    grad_bias)``): ``grad_input = torch.zeros_like(_input)`` (tokens x hidden in the hidden
    states' dtype), ``grad_weight = torch.zeros_like(weight)`` (vocab x hidden in the weight's
    dtype, accum_dtype None; none for a frozen head) and ``loss_1d`` (fp32 per token). Each chunk
    makes its logits ``_input_chunk @ weight.t()`` (chunk x vocab, the compute dtype under
    autocast), which the Triton kernel overwrites in place with their gradient (no fp32 copy:
    it accumulates in fp32 registers), then ``grad_logits_chunk @ weight`` (chunk x hidden) copied
    into grad_input; grad_weight is accumulated in place (addmm out=, sm80+). The backward only
    scales the saved gradients in place (element_mul_kernel): no transient."""
    chunk = liger_chunk_tokens(tokens, hidden, vocab)
    grad_input = hidden_bytes * tokens * hidden
    grad_weight = weight_bytes * vocab * hidden if head_trained else 0
    held = grad_input + grad_weight + FP32 * tokens + LABELS * tokens
    transient = compute_bytes * chunk * vocab + compute_bytes * chunk * hidden
    items = [ActivationItem(f"loss (liger-fused): grad_input {grad_input:,} B + grad_weight {grad_weight:,} B "
                            "computed in the forward, fp32 per-token loss, labels", held),
             ActivationItem(f"backward transient at the loss (liger-fused forward: one chunk of {chunk} tokens' "
                            "logits and its grad_input product)", transient)]
    return held, transient, items


def cce_memory(tokens: int, hidden: int, vocab: int, compute_bytes: int, weight_bytes: int,
               head_trained: bool) -> tuple[int, int, list[ActivationItem]]:
    """(held from the loss's forward to its backward beyond the LM head's input, the backward's
    transient, items). The forward saves ``e, c, lse, targets, valids, logit_avg``
    (cce.py LinearCrossEntropyFunction.forward): e is the final norm's output, which the LM head
    saves under HF's loss too (activations._final_norm_saved), c the weight itself; new are lse
    (fp32 per token, cce_lse_forward.py:168) and logit_avg (fp32 per vocabulary entry, :176,
    filter_eps "auto"); valids is None when no label is ignored. The backward
    (cce_backward.py cce_backward_kernel) allocates ``de = zeros_like(e)`` (tokens x hidden),
    ``dc = zeros_like(c, dtype=e.dtype)`` (vocab x hidden in the compute dtype; none for a frozen
    head) and returns ``dc.to(c.dtype)``, a second vocab x hidden copy when the weight is fp32; its
    int32 locks (about one per token and one per vocabulary entry) and the vocabulary ordering
    (torch.argsort: int64, then .to(int32)) live beside them."""
    held = FP32 * tokens + FP32 * vocab + LABELS * tokens
    dc = compute_bytes * vocab * hidden if head_trained else 0
    dc_cast = weight_bytes * vocab * hidden if head_trained and weight_bytes != compute_bytes else 0
    locks = 4 * tokens + 4 * vocab
    ordering = (8 + 4) * vocab
    transient = compute_bytes * tokens * hidden + dc + dc_cast + locks + ordering
    items = [ActivationItem("loss (cce): fp32 log-sum-exp per token, fp32 logit average per vocabulary entry, "
                            "labels", held),
             ActivationItem(f"backward transient at the loss (cce backward: de, dc {dc:,} B"
                            + (f" and its cast to the weight's dtype {dc_cast:,} B" if dc_cast else "")
                            + ", locks, vocabulary ordering)", transient)]
    return held, transient, items


def cce_compile_memory(tokens: int, rows: int, hidden: int, vocab: int, compute_bytes: int, hidden_bytes: int,
                       weight_bytes: int, head_trained: bool) -> tuple[int, int, list[ActivationItem]]:
    """(held from the loss's forward to its backward beyond the final norm's output and the head's
    weight, the backward's transient, items) of CCE's torch_compile implementation
    (torch_compile.py), on ``rows`` of the ``tokens``: the positions whose label is not ignored.
    Before the compiled function, ``e = e[valids]`` copies those rows of the final norm's output
    (utils.py _build_flat_valids: int32 row indices, which the index's backward keeps) and
    ``targets[valids]`` their int64 labels; nothing else keeps the norm's output, freed when the
    forward ends. The compiled ``e @ c.T`` then ``F.cross_entropy(logits.float(), ...)`` is
    partitioned by torch 2.13's AOTAutograd (its graphs read with TORCH_LOGS=aot_graphs): the
    forward saves the logits (rows x vocab in the matmul's dtype), the row max and the log of the
    sum of exponentials (fp32 per row). The backward writes the logits' gradient into the saved
    logits' buffer (donated to the backward: bw_donated_idxs), makes the weight's gradient (vocab
    x hidden in the matmul's dtype, then the weight's dtype under autocast; none for a frozen
    head), frees the copied rows and makes their gradient; the index's backward scatters that
    into a zeroed tokens x hidden tensor after the logits are freed. Measured on CPU ranks: with a
    trained head the peak is the logits beside the weight's gradient; with a frozen one (LoRA) the
    forward's end, the logits beside the norm's output, not yet freed."""
    logits = compute_bytes * rows * vocab
    norm_output, rows_copy = hidden_bytes * tokens * hidden, hidden_bytes * rows * hidden
    # a trained head: the graph saves the copy (for the weight's gradient) where HF's head saved the norm's
    # output (activations' final norm terms); a frozen one saves neither (autograd keeps a matmul's
    # input only for its weight's gradient: measured, the copy freed when the forward ends)
    held = logits + 2 * FP32 * rows + (rows_copy - norm_output if head_trained else 0) + (4 + 8) * rows \
        + LABELS * tokens
    dc = compute_bytes * vocab * hidden if head_trained else 0
    dc_cast = weight_bytes * vocab * hidden if head_trained and weight_bytes != compute_bytes else 0
    backward = dc + dc_cast + max(0, (compute_bytes - hidden_bytes) * rows * hidden)
    # until the compiled forward returns, the norm's output (and a frozen head's copy) is alive beside the logits
    transient = max(backward, norm_output + (0 if head_trained else rows_copy))
    items = [ActivationItem(f"loss (cce, torch_compile): the logits {logits:,} B saved in the matmul's dtype, fp32 "
                            "row max and log-sum-exp, the labelled rows of the hidden states copied (the final "
                            "norm's output freed), labels", held),
             ActivationItem(f"backward transient at the loss (cce torch_compile backward: the weight's gradient "
                            f"{dc:,} B" + (f" and its cast to the weight's dtype {dc_cast:,} B" if dc_cast else "")
                            + "; the logits' gradient in the logits' buffer)", transient)]
    return held, transient, items


def flash_attn_memory(tokens: int, vocab: int, compute_bytes: int,
                      logits_held: bool) -> tuple[int, int, list[ActivationItem]]:
    """(held from the loss's forward to its backward, the backward's transient, items). The forward
    (flash-attn 2.4.2 ops/triton/cross_entropy.py CrossEntropyLoss.forward; 1.0.3
    losses/cross_entropy.py SoftmaxCrossEntropyLossFn.forward with xentropy_kernel.cu
    host_softmax_xentropy) takes the logits as the LM head made them (the compute dtype: no upcast),
    returns fp32 per-token losses and saves ``logits, lse, labels`` (2.4.2 line 225, 1.0.3 line 89;
    lse fp32 per token). The backward allocates ``dlogits = torch.empty_like(logits)`` (2.4.2 line
    238; 1.0.3's ``at::empty_like(logits_)``, xentropy_kernel.cu line 697) unless
    inplace_backward, which CrossEntropyLoss defaults to False. ``logits_held``: the loop keeps the
    model's outputs (keeps_outputs), whose logits are the very tensor the loss saves: counted once,
    as the loop's held item."""
    logits = compute_bytes * tokens * vocab
    held = (0 if logits_held else logits) + FP32 * tokens + LABELS * tokens
    items = [ActivationItem("loss (flash-attn): the logits in the compute dtype"
                            + (" (the loop's held outputs)" if logits_held else "") + ", fp32 log-sum-exp per token, "
                            "labels", held),
             ActivationItem(f"backward transient at the loss (flash-attn backward: the logits' gradient {logits:,} B)",
                            logits)]
    return held, logits, items


def with_fused_loss(acts: Activations, loss: str, *, tokens: int, rows: int, hidden: int, vocab: int,
                    compute_bytes: int, hidden_bytes: int, weight_bytes: int, head_trained: bool,
                    softcap: bool, logits_held: bool = False) -> Activations:
    """The activations with HF's loss terms (the fp32 log-probabilities saved, the two fp32
    gradients at its backward) replaced by the fused kernel's: the same blocks and final norm,
    another loss. ``hidden_bytes``: the dtype of the final norm's output (fp32 under autocast over
    fp32 weights); ``weight_bytes``: the LM head weight's as the kernel reads it; ``loss``: the
    loss kernel (loss_kernel); ``rows``: the positions with a label (CCE's torch_compile copies them)."""
    if loss == CCE_COMPILE:
        held, transient, items = cce_compile_memory(tokens, rows, hidden, vocab, compute_bytes, hidden_bytes,
                                                    weight_bytes, head_trained)
    elif loss == "liger-fused":
        held, transient, items = liger_memory(tokens, hidden, vocab, compute_bytes, hidden_bytes, weight_bytes,
                                              head_trained)
    elif loss == "flash-attn":
        held, transient, items = flash_attn_memory(tokens, vocab, compute_bytes, logits_held)
    else:
        held, transient, items = cce_memory(tokens, hidden, vocab, compute_bytes, weight_bytes, head_trained)
    hf_saved = FP32 * tokens * vocab * (2 if softcap else 1) + LABELS * tokens
    edges = acts.edges
    if edges is not None:
        edges = EdgeTerms(edges.embedding_saved, edges.final_norm_saved, held, edges.rope_saved)
    kept = [i for i in acts.items if i.name not in ("logits / loss (fp32)", "backward transient at the loss")
            and not i.name.startswith("backward transient at the loss")]
    if acts.kept_blocks:  # as activations._with_chunked_loss: the largest block backward beside the loss's
        layer = max(acts.rebuilt_blocks) + acts.layer_transient_bytes
    else:
        layer = acts.layer_saved_bytes + acts.layer_transient_bytes if acts.checkpointed else 0
    saved = acts.saved_bytes - hf_saved + held
    return replace(acts, saved_bytes=saved, head_saved_bytes=acts.head_saved_bytes - hf_saved + held,
                   loss_transient_bytes=transient, peak_extra_bytes=max(transient, layer), edges=edges,
                   items=tuple(kept + items))


def loss_bytes_per_logit(loss: str, compute_bytes: int, hf_bytes: float) -> float:
    """Bytes each logit element moves through memory-bound kernels in the loss (planner/time/kernels.py
    charges them at the achievable bandwidth). HF and torchtune's chunks: ``hf_bytes``
    (upcast, log-softmax and their backward). Liger: its Triton cross-entropy kernel reads each
    chunk's logits twice (the online max/sum pass, then the gradient pass) and writes the
    gradient once in place (liger_kernel/ops/cross_entropy.py:153, :209, :253): 3 x the compute
    dtype. CCE: none (the logits stay in SRAM tiles). CCE's torch_compile implementation: one fused
    inductor kernel reads the logits twice (the row max, then the sum of exponentials), the backward's
    reads them once and writes their gradient in place: 4 x the compute dtype. flash-attn 2.4.2: the
    forward reads each row once (online max and sum, cross_entropy.py cross_entropy_fwd_kernel), the
    backward reads it and writes its gradient (cross_entropy_bwd_kernel): 3 x the compute dtype (1.0.3's
    CUDA forward reads the row twice, xentropy_kernel.cu cunn_SoftMaxXEntropyForward: one pass more)."""
    if loss in ("liger-fused", "flash-attn"):
        return 3.0 * compute_bytes
    if loss == CCE_COMPILE:
        return 4.0 * compute_bytes
    if loss == "cce":
        return 0.0
    return hf_bytes


def loss_recomputes_logits(loss: str) -> bool:
    """CCE's backward recomputes the logits tile by tile (cce_backward.py _cce_backward_kernel:
    ``accum = tl.dot(e, c)`` over the hidden dimension before the softmax gradient): one more
    forward LM-head matmul. Liger computes every gradient in its forward (the same three head
    matmuls as HF's loss, none again); CCE's torch_compile implementation saves them."""
    return loss == "cce"


def loss_notes(loss: str) -> list[str]:
    """What the estimate assumes of the loss (the loss kernel: loss_kernel), and what is not verified."""
    if loss == CCE_COMPILE:
        return [f"loss: Cut Cross-Entropy's torch_compile implementation ({CCE_COMPILE_SOURCE}; its Triton kernels "
                "need a GPU): the logits made and saved for backward by torch.compile, the labelled rows of the "
                "hidden states copied; measured on CPU ranks"]
    if loss == "chunked-in-forward":
        return [f"loss: torchtitan's ChunkedLossWrapper ({TORCHTITAN_SOURCE}): each chunk's LM head, loss and "
                "backward inside the loss's call, the hidden states' gradient in an fp32 buffer handed to the decoder's "
                "backward; nothing logits-sized saved, the LM head's gradient made before the decoder's backward; under "
                "tp each chunk's logits vocab-sharded (three all-reduces per chunk); measured on CPU ranks (one device, "
                "FSDP2, tp 2). Under FSDP2 reducing in fp32, the head's gradient kept in fp32 across the chunks "
                "(torchtitan turns the head unit's reduction off until the last chunk) is read from torch's source, "
                "unverified: the probe keeps the head in FSDP2's root unit"]
    if loss == "liger-fused":
        return [f"loss: Liger's fused linear cross-entropy ({LIGER_SOURCE}): the LM head's logits only one chunk "
                "of tokens at a time, both gradients made in the forward and held to the backward; Triton (GPU "
                "only): unverified here (bench/gpu_check.py measures it)"]
    if loss == "cce":
        return [f"loss: Cut Cross-Entropy ({CCE_SOURCE}): the logits never leave SRAM, the backward recomputes "
                "them (one more LM-head matmul); gradient filtering (filter_eps) skips blocks and is not "
                "credited in the time; Triton (GPU only): unverified here (bench/gpu_check.py measures it)"]
    if loss == "flash-attn":
        return [f"loss: flash-attn's cross-entropy ({FLASH_ATTN_SOURCE}): the logits in the compute dtype saved, "
                "no fp32 copy, their gradient a new tensor of the same shape; GPU only: unverified here (bench/gpu_check.py "
                "measures it)"]
    return []
