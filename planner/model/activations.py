"""Activation memory of a decoder-only transformer, from what autograd saves for backward.

Counted tensor by tensor for the transformers (v5) implementations, per micro-batch of
``tokens = micro_batch * seq_len``. A tensor saved by several ops (the normed input of the q, k
and v projections) is counted once. Autograd only saves an input when the other operand needs a
gradient (PyTorch's derivatives.yaml codegen), so e.g. ``q * cos`` saves nothing large.

Sources for the per-op accounting: Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", Sec. 4.1 (the 34·s·b·h + 5·a·s²·b per-layer form this refines),
and the modeling_<family>.py files of transformers 5.24 read line by line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from planner.model.architecture import (ACTIVATION_SAVED, Architecture, active_parameter_count, distinct_specs,
                                        layer_specs)
from planner.model.attention.kinds import kind_of
from planner.errors import PlannerError
from planner.model.layers import AttentionSpec, LayerSpec, MlpSpec
from planner.model.linears import Linear, block_linears

Attention = Literal["sdpa", "eager"]
# none | full (every block, or every N-th: checkpointing_every) | selective-op (torchtitan's per-op
# SAC policy) | selective-attention (Megatron's core-attention recompute); see checkpointed_blocks,
# selective_op_saved_linears and recompute_flops_per_token below
Checkpointing = Literal["none", "full", "selective-op", "selective-attention"]
CHECKPOINTING_CHOICES = ("none", "full", "selective-op", "selective-attention")

FP32 = 4
MASK = 1  # CUDA's fused native_dropout saves a torch.bool mask, one byte per element
Device = Literal["cuda", "cpu"]


def _dropout_keep_bytes(b: int, device: Device) -> int:
    """Bytes per element a dropout saves for backward. On CUDA, native_dropout's bool mask; on
    CPU, ATen's _dropout_impl (aten/src/ATen/native/Dropout.cpp) multiplies by a noise tensor of
    the input's dtype, and the multiply saves it."""
    return MASK if device == "cuda" else b


@dataclass(frozen=True)
class ActivationItem:
    name: str
    bytes: int


@dataclass(frozen=True)
class EdgeTerms:
    """The per-micro-batch terms outside the blocks. The whole model adds them all once; a model
    cut into pipeline stages (planner/parallel/pipeline.py) adds the embedding's on the first stage, the
    final norm's and the loss's on the last, and the RoPE tables on every stage (each computes its
    own)."""

    embedding_saved: int
    final_norm_saved: int
    loss_saved: int  # without the RoPE tables
    rope_saved: int  # every cos/sin table one forward computes (Gemma-3: two)


@dataclass(frozen=True)
class Activations:
    """``saved_bytes``: held from the forward until backward reaches it (all layers together).
    ``peak_extra_bytes``: the largest transient on top of the saved set, at the loss or inside
    one layer's backward (recomputed layer under checkpointing). ``items`` explains both.
    ``blocks`` and ``edges``: the same saved sets block by block (each block's whole saved set,
    in layer order) and outside the blocks, from which a pipeline stage takes its share."""

    saved_bytes: int
    peak_extra_bytes: int
    items: tuple[ActivationItem, ...]
    layer_saved_bytes: int = 0  # one block's saved set (without checkpointing)
    layer_kept_bytes: int = 0  # what each block keeps until its backward (its saved set, or its input)
    head_saved_bytes: int = 0  # final norm, logits/loss, RoPE tables, embedding dropout
    loss_transient_bytes: int = 0
    layer_transient_bytes: int = 0
    final_norm_transient_bytes: int = 0  # the final norm's backward, after the LM head's (final_norm_transient_bytes)
    num_layers: int = 0
    checkpointed: bool = False
    blocks: tuple[int, ...] = ()
    edges: EdgeTerms | None = None
    # checkpointing_every: what each block keeps until its backward and what its backward rebuilds
    # on top, in layer order (empty: every block alike, layer_kept_bytes and layer_saved_bytes)
    kept_blocks: tuple[int, ...] = ()
    rebuilt_blocks: tuple[int, ...] = ()
    # activation_offload (planner/recipes/activation_offload.py): the saved set lives on the host; the
    # device holds at the loss's backward device_head_bytes, after the LM head device_after_head_bytes,
    # in a block's backward that block's own set; offloaded_bytes cross the host link each way
    host_offload: bool = False
    device_head_bytes: int = 0
    device_after_head_bytes: int = 0
    device_block_bytes: int = 0  # what each block keeps on the device until its backward (repeated saves)
    duplicate_head_bytes: int = 0  # CPU ranks: the head's repeated saves beside their host copies
    offloaded_bytes: int = 0
    # the LM head's 16-bit weight copy its matmul saves (a frozen fp32 head under autocast: QLoRA), one
    # tensor within head_saved_bytes (planner/memory/reserved.py allocates it whole)
    head_weight_copy_bytes: int = 0
    # the LM head's backward runs inside the loss's call (torchtitan's ChunkedLossWrapper,
    # planner/recipes/losses.py): its weight's gradient exists from the start of backward on
    head_gradient_in_loss: bool = False

    @property
    def peak_bytes(self) -> int:
        return self.saved_bytes + self.peak_extra_bytes

    def backward_of(self, index: int) -> tuple[int, int, int]:
        """(kept by the blocks whose backward is done, what the block's backward rebuilds on top,
        what the block itself keeps) for the ``index``-th block backward reaches (0: the last)."""
        n = self.num_layers
        if self.kept_blocks:
            block = n - 1 - index
            return sum(self.kept_blocks[block + 1:]), self.rebuilt_blocks[block], self.kept_blocks[block]
        return index * self.layer_kept_bytes, self.layer_saved_bytes if self.checkpointed else 0, self.layer_kept_bytes

    def block_kept(self, first: int, last: int) -> int:
        """What blocks [first, last) keep until their backward: their saved sets, or under full
        checkpointing each one's input."""
        if self.checkpointed:
            return (last - first) * self.layer_kept_bytes
        return sum(self.blocks[first:last])


def _norm_saved(a: Architecture, tokens: int, b: int, autocast: bool = False) -> int:
    """RMSNorm (LlamaRMSNorm.forward): the fp32 upcast (saved by pow and mul; in fp32 it is the
    input itself), ``x * rsqrt`` cast back to the compute dtype (saved by ``weight * x`` for the
    weight's gradient), the ``weight * x`` output (saved by the next linear), and rsqrt per token.
    Under torch.autocast the stream is fp32, so ``x * rsqrt`` stays fp32 (``_autocast_stream``).
    LayerNorm (native_layer_norm): its input, fp32 mean and rstd per token, and its output (saved
    by the next linear)."""
    h = a.hidden_size
    if a.norm == "rmsnorm":
        product = FP32 if autocast else b
        return FP32 * tokens * h + product * tokens * h + b * tokens * h + FP32 * tokens
    return b * tokens * h + b * tokens * h + 2 * FP32 * tokens


def _fused_rms_norm_saved(a: Architecture, tokens: int, b: int, autocast: bool = False) -> int:
    """A fused RMSNorm (Liger's LigerRMSNormFunction, torchtitan's TritonFusedRMSNorm:
    planner/recipes/fused_kernels.py): its input as given (fp32 under autocast, the fp32 stream) and
    one fp32 rstd per row, and its output (saved by the next linear): no fp32 upcast and no
    ``x * rsqrt``. A block's norms are counted with ``autocast`` off and the fp32 stream's extra
    bytes added by _autocast_stream_extra, as for the eager norm (there the fp32 ``x * rsqrt``, here
    the fp32 input: 4 - b per element each)."""
    stream = FP32 if autocast else b
    return stream * tokens * a.hidden_size + b * tokens * a.hidden_size + FP32 * tokens


def _norm_saved_of(a: Architecture, tokens: int, b: int, fused: tuple[str, ...], autocast: bool = False) -> int:
    """A hidden-width RMSNorm or LayerNorm, eager or fused (``"rms_norm" in fused``)."""
    if "rms_norm" in fused and a.norm == "rmsnorm":
        return _fused_rms_norm_saved(a, tokens, b, autocast)
    return _norm_saved(a, tokens, b, autocast)


def norm_saved_bytes(a: Architecture, tokens: int, b: int, fused: tuple[str, ...] = ()) -> int:
    """One hidden-width norm's saved tensors (a weight-in-compute-dtype norm), for modules that
    reason about what a block's backward frees at a norm (planner/parallel/context.py)."""
    return _norm_saved_of(a, tokens, b, fused)


def _float_norm_saved(tokens: int, width: int, rows: int) -> int:
    """An RMSNorm that multiplies its weight in fp32 (Olmo2RMSNorm: ``(weight * x).to(dtype)``;
    Gemma3RMSNorm: ``x * (1 + weight.float())``): the fp32 input (saved by pow and the rsqrt
    product), rsqrt per row, and the normalized fp32 tensor (saved for the weight's gradient).
    Its cast-back output is saved only by a following linear (counted there)."""
    return FP32 * tokens * width + FP32 * tokens * width + FP32 * rows


def _block_norms_saved(a: Architecture, spec: LayerSpec, tokens: int, b: int, fused: tuple[str, ...] = ()) -> int:
    """The block's hidden-width norms. Llama-style (weight * x.to(dtype)) for pre-norm blocks;
    OLMo-2's post-norms and Gemma-3's sandwich norms multiply in fp32 (above), and the inputs of
    attention and MLP (the residual stream or a pre-norm's output) are saved by their linears."""
    if spec.norm_weight == "float":
        inputs = 2 * b * tokens * a.hidden_size
        return spec.norms * _float_norm_saved(tokens, a.hidden_size, tokens) + inputs
    if "rms_norm" in fused and spec.norm == "rmsnorm":
        return spec.norms * _fused_rms_norm_saved(a, tokens, b)
    return spec.norms * _norm_saved(a, tokens, b)


def _qk_norm_saved(s: AttentionSpec, tokens: int, b: int, float_weight: bool) -> int:
    """q/k norms before RoPE. Qwen3RMSNorm per head: fp32 input, rsqrt per (token, head), and the
    cast back (saved by ``weight * x``); its output is only multiplied by cos/sin, which saves
    nothing large (cos/sin need no gradient). OLMo-2 (whole projection) and Gemma-3 multiply in fp32."""
    if s.qk_norm == "none":
        return 0
    if s.qk_norm == "l2":
        # Llama4TextL2Norm after RoPE: fp32 input and rsqrt per (token, head); no weight, and its
        # cast-back output is saved by attention (counted there)
        return FP32 * tokens * (s.q_width + s.kv_width) + FP32 * tokens * (s.num_heads + s.num_kv_heads)
    if s.qk_norm == "head":
        q_rows, k_rows = tokens * s.num_heads, tokens * s.num_kv_heads
    else:
        q_rows = k_rows = tokens
    if float_weight:
        return _float_norm_saved(tokens, s.q_width, q_rows) + _float_norm_saved(tokens, s.kv_width, k_rows)
    return (FP32 + b) * tokens * (s.q_width + s.kv_width) + FP32 * (q_rows + k_rows)


def _uses_kv_repeat(a: Architecture, attention: Attention, seq_len: int) -> bool:
    """transformers' sdpa path repeats K/V to every query head unless SDPA's enable_gqa can be
    used (no mask and head_dim <= 256: integrations/sdpa_attention.py, use_gqa_in_sdpa); a sliding
    window shorter than the sequence forces a mask. Eager attention always repeats."""
    if a.num_key_value_heads == a.num_attention_heads:
        return False
    if attention == "eager":
        return True
    return a.head_dim > 256


def _attention_saved(a: Architecture, tokens: int, seq_len: int, micro_batch: int, b: int,
                     attention: Attention, device: Device) -> int:
    q, kv = a.q_width, a.kv_width
    kv_saved = q if _uses_kv_repeat(a, attention, seq_len) else kv
    qkv = b * tokens * (q + 2 * kv_saved)
    scores = micro_batch * a.num_attention_heads * seq_len * seq_len
    if attention == "sdpa" and a.attention_dropout > 0 and device == "cpu":
        # SDPA with dropout has no fused CPU kernel: the math path saves the (scaled) q, k and v,
        # the softmax, the dropout noise and the dropped-out probabilities, then the
        # transpose(1, 2).contiguous() output that c_proj/o_proj saves.
        return b * tokens * 3 * q + 3 * b * scores + b * tokens * q
    if attention == "sdpa":
        # SDPA saves its output (also the o_proj input: flash/efficient kernels lay it out as
        # (batch, seq, heads, dim), so transpose(1, 2) needs no copy) and the fp32 logsumexp.
        out = b * tokens * q
        lse = FP32 * micro_batch * a.num_attention_heads * seq_len
        return qkv + out + lse
    merged = b * tokens * q  # eager: matmul output, then transpose(1, 2).contiguous() for o_proj
    probs = FP32 * scores + (b * scores if b != FP32 else 0)  # softmax(float32) and its cast
    dropout = (_dropout_keep_bytes(b, device) + b) * scores if a.attention_dropout > 0 else 0
    return qkv + probs + dropout + merged


def gated_tensors(fused: tuple[str, ...]) -> int:
    """Inner-width tensors a dense gated MLP saves: gate's output (saved by the activation), act(gate)
    and up (saved by the product) and the product (saved by down_proj); Liger's SiLU-mul (``"swiglu"
    in fused``: ops/swiglu.py LigerSiLUMulFunction saves ``(a, b)``) keeps gate, up and the product."""
    return 3 if "swiglu" in fused else 4


def _mlp_saved(a: Architecture, tokens: int, b: int, fused: tuple[str, ...] = ()) -> int:
    inner = a.intermediate_size
    if a.mlp == "gated":
        # gated_tensors over the tokens; an MoE's experts (never fused) over each token's experts_per_token rows
        if a.is_moe:
            return 4 * b * tokens * a.experts_per_token * inner
        return gated_tensors(fused) * b * tokens * inner
    if a.model_type == "gpt2":
        # GPT-2's activation_function (architecture.ACTIVATION_SAVED: NewGELU's five tensors by default)
        return ACTIVATION_SAVED[a.mlp_activation or "gelu_new"] * b * tokens * inner
    # up output (saved by the activation), activation output (saved by down/c_proj)
    return 2 * b * tokens * inner


def _moe_router_saved(a: Architecture, tokens: int) -> int:
    if not a.is_moe:
        return 0
    # router logits, fp32 softmax over experts, and the gathered/scattered token copies
    return FP32 * tokens * a.num_experts * 2 + 2 * FP32 * tokens * a.hidden_size


def _dropout_saved(a: Architecture, tokens: int, b: int, device: Device) -> int:
    """Residual dropout after attention and after the MLP."""
    return 2 * _dropout_keep_bytes(b, device) * tokens * a.hidden_size if a.hidden_dropout > 0 else 0


def layer_saved_bytes(a: Architecture, tokens: int, seq_len: int, micro_batch: int, b: int,
                      attention: Attention, device: Device = "cuda", fused: tuple[str, ...] = ()) -> int:
    """The largest block's saved set (every block's, when they are alike)."""
    return max(block_saved_bytes(a, spec, tokens, seq_len, micro_batch, b, attention, device, fused=fused)
               for spec in distinct_specs(a).values())


def block_saved_bytes(a: Architecture, spec: LayerSpec, tokens: int, seq_len: int, micro_batch: int, b: int,
                      attention: Attention, device: Device = "cuda", autocast: bool = False,
                      fused: tuple[str, ...] = ()) -> int:
    """What one block saves for backward, from its layer spec; ``autocast``: the block runs under
    torch.autocast over fp32 weights (``_autocast_stream``); ``fused``: the block ops run as fused
    kernels (planner/recipes/fused_kernels.py; Qwen3's per-head q/k norms are counted eager: HF
    Trainer's use_liger_kernel patches the instance's block norms only, monkey_patch.py
    apply_liger_kernel_to_qwen3 with ``model``)."""
    attn = spec.attention
    kind = kind_of(attn)
    if kind.saved_bytes is not None:
        attention_bytes = kind.saved_bytes(attn, tokens, seq_len, micro_batch, b, attention, device)
    elif attn.sinks:
        attention_bytes = _sink_attention_saved(attn, tokens, seq_len, micro_batch, b)
    else:
        attention_bytes = _attention_saved(a, tokens, seq_len, micro_batch, b, attention, device)
    if attn.logit_softcap and attention == "eager":
        # Gemma2's eager_attention_forward: tanh(logits / cap) saves its output (compute dtype)
        attention_bytes += b * micro_batch * attn.num_heads * seq_len * seq_len
    # masking_utils skips the mask only while kv_length < the window (_ignore_causal_mask_sdpa), so a
    # window no longer than the sequence gives the block a (micro_batch, 1, seq, seq) mask, which
    # SDPA saves converted to the compute dtype (measured with saved-tensor hooks on CPU, bf16 and
    # fp32, one per such block); with a mask transformers repeats K/V to every query head
    # (integrations/sdpa_attention.py, use_gqa_in_sdpa).
    if attn.window != "full" and attn.window_size <= seq_len and attention == "sdpa" and not attn.sinks:
        attention_bytes += b * micro_batch * seq_len * seq_len
        if attn.num_kv_heads != attn.num_heads and not _uses_kv_repeat(a, attention, seq_len):
            attention_bytes += 2 * b * tokens * (attn.q_width - attn.kv_width)
    float_weight = spec.norm_weight == "float"
    if spec.mlp.is_moe and spec.mlp.layout != "mixtral":
        mlp = _routed_saved(spec.mlp, a.hidden_size, tokens, b) + _router_saved(spec.mlp, a.hidden_size, tokens, b)
        mlp += 4 * b * tokens * spec.mlp.shared_intermediate_size  # shared expert: a dense gated MLP
    elif spec.mlp.is_moe or not a.layers:
        mlp = _mlp_saved(a, tokens, b, fused) + _moe_router_saved(a, tokens)
    else:
        # a dense MLP of the block's own width (DeepSeek's first layers, Llama-4's dense layers):
        # gate, act(gate), up and their product; plain: up and act(up)
        mlp = (gated_tensors(fused) if spec.mlp.gated else 2) * b * tokens * spec.mlp.intermediate_size
    return (_block_norms_saved(a, spec, tokens, b, fused) + attention_bytes
            + _qk_norm_saved(attn, tokens, b, float_weight) + mlp + _dropout_saved(a, tokens, b, device)
            + (_autocast_stream_extra(a, spec, b) * tokens * a.hidden_size if autocast else 0))


def _autocast_stream(a: Architecture, b: int, autocast: bool) -> bool:
    """Whether the fp32-stream terms below apply: torch.autocast over fp32 weights with a 16-bit
    compute dtype, on Llama-style RMSNorm blocks (the ones measured; other norms keep the 16-bit
    count)."""
    return autocast and b != FP32 and a.norm == "rmsnorm"


def _autocast_stream_extra(a: Architecture, spec: LayerSpec, b: int) -> int:
    """Bytes per token x hidden element a block saves under torch.autocast beyond the 16-bit count.

    Autocast keeps the model fp32 and casts per op (torch 2.13 aten/src/ATen/autocast_mode.cpp:
    ``linear``, ``matmul``, ``scaled_dot_product_attention`` are in the lower-precision list on CPU
    and CUDA; ``embedding``, ``mul``, ``add``, ``pow``, ``rsqrt`` are in no list and run in their
    inputs' dtype). The embedding's output is fp32 and each residual add (fp32 + a 16-bit linear
    output) promotes back to fp32, so the stream between blocks is fp32. LlamaRMSNorm.forward
    (transformers 5 modeling_llama.py) then computes ``x * rsqrt`` in fp32, ``.to(input_dtype)``
    is a no-op and ``weight * x`` saves that fp32 product for the weight's gradient: 2 bytes more
    per norm than a 16-bit one. Its fp32 output is read by several linears, and each F.linear casts
    its input itself: autocast's cast cache holds only leaf tensors that require grad, i.e. weights
    (autocast_mode.cpp ``cached_cast``: ``can_try_cache``), so q, k and v (LlamaAttention.forward)
    each save their own 16-bit copy, as do gate and up (LlamaMLP.forward): two and one copies more
    than the one activations.py counts. Measured with saved-tensor hooks (tests/test_layer_specs.py
    test_autocast_llama_block_saved_bytes) and the backend's peak trace (TP 2 with SP, bf16)."""
    if not (spec.norm == "rmsnorm" and spec.norm_weight == "cast"):
        return 0
    attention = spec.attention
    extra = (FP32 - b) * spec.norms
    if kind_of(attention).casts_kv_input_again and not attention.fused_qkv:
        extra += 2 * b  # k and v cast the normed input again
    mlp = spec.mlp
    if not mlp.is_moe and mlp.gated and not mlp.fused_gate_up:
        extra += b  # up casts it again beside gate
    return extra


INDEX = 8  # int64 indices


def _sink_attention_saved(s: AttentionSpec, tokens: int, seq_len: int, micro_batch: int, b: int) -> int:
    """gpt-oss's eager_attention_forward (modeling_gpt_oss.py), the only path transformers 5 has
    for sinks: q and the repeated K/V saved by the two matmuls, the max over the logits plus the
    sink column saves its int64 indices, softmax in the compute dtype saves its output (one extra
    column for the sink, the scores are a view of it), and the transpose(1, 2).contiguous() copy
    that o_proj saves. The mask is added, which saves nothing."""
    rows = micro_batch * s.num_heads * seq_len
    return 3 * b * tokens * s.q_width + b * rows * (seq_len + 1) + INDEX * rows + b * tokens * s.q_width


def _routed_saved(m: MlpSpec, hidden: int, tokens: int, b: int) -> int:
    """transformers 5's default experts path, grouped_mm_experts_forward (integrations/moe.py), over
    the S = tokens x top-k (token, expert) pairs: the gather ``hidden[perm // k]`` and
    ``weights[perm]`` save their int64 indices, the gathered copy is saved by the up grouped_mm,
    the (S, 2I) up output by the activation (chunk views keep all of it), act(gate) and the
    product (S, I) for the product and the down grouped_mm, the (S, h) down output and the
    (S,) routing weights by their product, and ``weighted[inv_perm]`` saves inv_perm."""
    inner = m.intermediate_size
    if m.layout == "llama4":
        # Llama4TextMoe/Llama4TextExperts: every expert runs on every token (bmm over E x tokens):
        # hidden.repeat(E) and its product with the scores (a transposed copy), both saved, the
        # (E*T, 2I) up output, act(gate), and the product saved by the down bmm
        rows = tokens * m.num_experts
        return b * rows * hidden + b * rows + b * rows * hidden + 4 * b * rows * inner
    pairs = tokens * m.experts_per_token
    indices = 3 * INDEX * pairs + (2 * INDEX * pairs if m.bias else 0)  # both biases gathered by expert id
    # GptOssExperts._apply_gate (clamped SwiGLU): the clamps keep the (S, 2I) output, then
    # sigmoid's output, the clamped gate, up + 1, glu, and their product (S, I) each
    gate = (2 + 5) * inner if m.layout == "gpt_oss" else 4 * inner
    weights = FP32 if m.layout == "deepseek" else b  # DeepSeek's routing weights stay fp32
    return indices + b * pairs * hidden + b * pairs * gate + b * pairs * hidden + weights * pairs


def _router_saved(m: MlpSpec, hidden: int, tokens: int, b: int) -> int:
    """Qwen3MoeTopKRouter: softmax(logits, float32) saves its fp32 output (tokens x experts), topk
    its int64 indices, the in-place renormalisation (norm_topk_prob) the fp32 top-k values and
    their sum. The router's input is the norm output, already saved by the router linear."""
    k, e = m.experts_per_token, m.num_experts
    if m.router == "topk_softmax":
        # GptOssTopKRouter: topk over the logits saves its indices, softmax over the k values its output
        return INDEX * tokens * k + b * tokens * k
    if m.router == "sigmoid_top1":
        # Llama4Router: topk's int64 indices, sigmoid's fp32 output over the scattered scores
        return INDEX * tokens * k + FP32 * tokens * e
    if m.router == "softmax":
        return FP32 * tokens * e + INDEX * tokens * k + FP32 * tokens * k + FP32 * tokens
    # DeepSeek (modeling_deepseek_v2/v3.py TopkRouter): the fp32 copy of the input (saved by the fp32
    # router linear; the input itself in fp32), the fp32 scores (sigmoid or softmax output), the int64
    # indices of every topk / max, the bool group mask of masked_fill, and the final top-k.
    upcast = FP32 * tokens * hidden if b != FP32 else 0
    out = upcast + FP32 * tokens * e + INDEX * tokens * k
    if m.router == "sigmoid_grouped":
        # top-2 per group, top groups, masked_fill's mask, and the in-place renormalisation
        # (norm_topk_prob) saving the fp32 weights and their sum
        out += INDEX * tokens * m.groups * 2 + INDEX * tokens * m.groups_kept + tokens * e
        out += FP32 * tokens * k + FP32 * tokens
    elif m.router == "softmax_grouped":
        out += INDEX * tokens * m.groups + INDEX * tokens * m.groups_kept + tokens * e
    return out


def _extra_rope_tables(a: Architecture, seq_len: int, b: int) -> int:
    """cos/sin tables beyond the first (Gemma-3: one for the sliding layers, one for the global)."""
    tables = {spec.attention.rope_table for spec in distinct_specs(a).values() if spec.attention.rope}
    return max(len(tables) - 1, 0) * _rope_saved(a, seq_len, b)


def _final_norm_saved(a: Architecture, tokens: int, b: int, autocast: bool = False,
                      fused: tuple[str, ...] = ()) -> int:
    """The final norm and its output (saved by the LM head); under autocast its ``x * rsqrt`` is fp32
    (a fused norm's input is)."""
    if layer_specs(a)[-1].norm_weight == "float":  # the final norm is the blocks' norm class
        return _float_norm_saved(tokens, a.hidden_size, tokens) + b * tokens * a.hidden_size
    return _norm_saved_of(a, tokens, b, fused, autocast)


def final_norm_transient_bytes(a: Architecture, tokens: int, fused: tuple[str, ...] = ()) -> int:
    """The final norm's backward, on top of what backward holds after the LM head's: LlamaRMSNorm
    (``weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(dtype)``) differentiated by
    autograd op by op, its fp32 input x and rsqrt still saved, and at PowBackward0 five fp32
    tokens x hidden tensors live: the gradient of x through ``x * rsqrt`` (waiting in x's input
    buffer for the second path), MeanBackward1's expanded division, and pow_backward's
    ``pow(x, 1)``, ``2 * ...`` and its product with the incoming gradient (torch 2.13
    derivatives.yaml pow.Tensor_Scalar: ``grad * (exponent * self.pow(exponent - 1))``). The
    incoming 16-bit gradient and its fp32 copy (ToCopyBackward0) are freed before. The same five
    in fp32, where the casts are no-ops. Peak trace (llama 256 hidden, 1,024 tokens, bf16, cp 2 x
    tp 2 without SP, rank 0): 1,048,576 bytes each, the fp32 input beside them, the rank's peak.
    A Llama-style final norm only (LayerNorm's backward is one native_layer_norm_backward kernel;
    fp32-weight norms, OLMo-2's and Gemma-3's, differ): 0 for the others, and for a fused RMSNorm
    (Liger's backward writes dX into dY's storage, ops/rms_norm.py rms_norm_backward ``in_place``;
    its dW partial sums are weight-sized; torchtitan's dx replaces the freed gradient)."""
    if a.norm != "rmsnorm" or layer_specs(a)[-1].norm_weight == "float" or "rms_norm" in fused:
        return 0
    return FP32 * tokens * a.hidden_size + FP32 * tokens + 5 * FP32 * tokens * a.hidden_size


# --- checkpointing policies ---------------------------------------------------------------------

def checkpointed_blocks(num_layers: int, checkpointing: str, every: int | None) -> tuple[bool, ...]:
    """Which blocks (layer order) run under a checkpoint: none, or all, or with ``every`` = N the
    blocks whose index is a multiple of N (transformers 5.25 modeling_utils.py
    _set_gradient_checkpointing: ``layer_index % every_n_layers == 0``, the index from 0: blocks 0,
    N, 2N, ...; torchtitan 0.2's integer selective_ac_option counts from 1 and takes blocks N-1,
    2N-1, ..., activation_checkpoint.py _apply_layer_sac)."""
    if checkpointing == "none":
        return (False,) * num_layers
    step = every or 1
    return tuple(index % step == 0 for index in range(num_layers))


def selective_op_saved_linears(linears: list[Linear]) -> list[Linear]:
    """The linears whose outputs torchtitan's per-op SAC keeps (torchtitan b5bcd76, Aug 2026,
    distributed/activation_checkpoint.py SelectiveAC._get_custom_policy): every op of the save list
    is MUST_SAVE except every second mm/linear, counted per block in call order; a linear with a
    bias runs as addmm (aten/src/ATen/native/Linear.cpp: contiguous 3-D input with bias), which
    is in the save list (torch._functorch.partitioners.get_default_op_list().compute_intensive_ops)
    and not counted."""
    saved, count = [], 0
    for linear in linears:
        if linear.bias:
            saved.append(linear)
            continue
        count += 1
        if count % 2 == 1:
            saved.append(linear)
    return saved


# outputs that the block's own saved set keeps as they are (so SAC's cached copy is the same
# tensor in the recomputed backward): v (SDPA's input; no RoPE), gate (the activation's input), up
# (the product's input)
_SAVED_AS_IS = ("v_proj", "gate_proj", "up_proj")


def check_checkpointing(a: Architecture | None, checkpointing: str, every: int | None, attention: str,
                        why_not: str | None) -> None:
    """The policies beyond none/full are modelled for a plain layout (``why_not`` names what is
    not: tp, cp, pp, ep, LoRA, a traced model) and, for selective-op, Llama-style blocks under SDPA."""
    if checkpointing in ("none", "full") and every is None:
        return
    field = "checkpointing" if checkpointing not in ("none", "full") else "checkpointing_every"
    value = checkpointing if field == "checkpointing" else every
    if why_not:
        raise PlannerError(f"{field}={value} with {why_not}: modelled for a data-parallel layout (single, ddp, "
                           "zero0-3, fsdp, hsdp) of a full fine-tune", field=field)
    if a is None:
        raise PlannerError(f"{field}={value} needs an architecture: give model or model_config", field=field)
    if checkpointing == "selective-op":
        specs = distinct_specs(a).values()
        plain = all(kind_of(s.attention).plain_projections and not s.attention.sinks and not s.attention.fused_qkv
                    and not s.mlp.is_moe and [x.name for x in block_linears(a, s)][:3] == ["q_proj", "k_proj",
                                                                                          "v_proj"]
                    for s in specs)
        if not plain or attention != "sdpa" or a.attention_implementation == "eager":
            raise PlannerError(f"checkpointing=selective-op on model_type {a.model_type!r} with {attention} attention: "
                               "torchtitan's op policy is modelled for blocks of separate q/k/v/o projections and a "
                               "dense MLP under SDPA (no MoE, MLA, sinks or eager attention)", field="checkpointing")


def _selective_op_kept(a: Architecture, spec: LayerSpec, tokens: int, micro_batch: int, seq_len: int,
                       b: int) -> tuple[int, int]:
    """(bytes a block keeps from its forward under torchtitan's per-op SAC beyond its input: the
    saved linears' outputs and SDPA's output and logsumexp; the part of them the block's own saved
    set holds as the same tensors, which its recomputed backward does not allocate again)."""
    saved = selective_op_saved_linears(block_linears(a, spec))
    attention = spec.attention
    sdpa = b * tokens * attention.q_width + FP32 * micro_batch * attention.num_heads * seq_len
    outputs = sum(b * tokens * linear.out_features for linear in saved)
    shared = sum(b * tokens * linear.out_features for linear in saved if linear.name in _SAVED_AS_IS
                 and not (linear.name == "v_proj" and _uses_kv_repeat(a, "sdpa", seq_len)))
    return outputs + sdpa, shared + sdpa


def _core_attention_kept(spec: LayerSpec, tokens: int, b: int, fp32_stream: bool) -> int:
    """What a block keeps of its attention core under Megatron's core-attention recompute
    (--recompute-granularity selective: the core under a checkpoint, megatron/core/transformer/
    attention.py _checkpointed_attention_forward): the checkpoint's arguments q, k, v (unrepeated)
    and the core's output (o_proj's input). Under torch.autocast over fp32 RoPE tables the rotated
    q and k are fp32 (``q * cos`` promotes) and the checkpoint keeps them so, where SDPA would
    have saved its own 16-bit casts; v comes from its linear in 16 bits. The rest of the core's
    saved set (SDPA's logsumexp; eager attention's probabilities, dropout and repeated K/V) is
    rebuilt by the block's backward."""
    s = spec.attention
    rotated = FP32 if fp32_stream and s.rope else b
    return rotated * tokens * (s.q_width + s.kv_width) + b * tokens * s.kv_width + b * tokens * s.q_width


def recompute_flops_per_token(a: Architecture, seq_len: int, checkpointing: str, every: int | None = None) -> float:
    """FLOPs per token a policy recomputes in backward (the model's convention: 2 x in x out per
    linear, 4 x seq x q_width for attention's QK^T and AV per block, no causal halving).

    full: every checkpointed block's forward (the LM head is outside the blocks); selective-op:
    the linears SAC recomputes (every second mm), SDPA is kept; selective-attention: the attention
    core of every block."""
    if checkpointing == "none":
        return 0.0
    specs = layer_specs(a)
    attention = 4.0 * seq_len

    if checkpointing == "full":
        # the blocks' parameters one token passes through (MoE: its routed experts), the block mean
        embeddings = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2) \
            + a.learned_positions * a.hidden_size
        per_block = (2.0 * (active_parameter_count(a) - embeddings)) / len(specs)
        chosen = checkpointed_blocks(len(specs), "full", every)
        return sum(per_block + attention * spec.attention.q_width for spec, on in zip(specs, chosen) if on)
    if checkpointing == "selective-op":
        return selective_op_rerun_flops(a)
    return sum(attention * spec.attention.q_width for spec in specs)


def selective_op_rerun_flops(a: Architecture) -> float:
    """Forward FLOPs per token of the linears per-op SAC reruns in backward: every block linear
    selective_op_saved_linears does not keep."""
    total = 0.0
    for spec in layer_specs(a):
        linears = block_linears(a, spec)
        kept = {id(x) for x in selective_op_saved_linears(linears)}
        total += sum(2.0 * x.in_features * x.out_features for x in linears if id(x) not in kept)
    return total


def _loss_saved(a: Architecture, tokens: int, b: int) -> int:
    """What the causal-LM loss keeps for backward (transformers 5.24, loss/loss_utils.py).

    ``logits = self.lm_head(hidden_states)`` (modeling_llama.py:471, modeling_qwen2.py:459,
    modeling_gpt2.py:698) is in the training dtype; ForCausalLMLoss upcasts it,
    ``logits = logits.float()`` (loss_utils.py:61, a no-op in fp32), and fixed_cross_entropy
    calls ``nn.functional.cross_entropy`` (loss_utils.py:42): log_softmax, whose backward needs
    only its fp32 output (derivatives.yaml, _log_softmax: result), then nll_loss, which saves
    that same output and the labels. Neither the training-dtype logits nor their fp32 upcast
    are saved: the upcast dies when the loss returns, the logits with the model's output
    object once the loop has taken ``.loss`` (backend peak trace: at the peak, the only
    logits-sized tensors are this output and the two below). So: 4 bytes x tokens x vocab, the
    largest single activation, plus the shifted int64 labels (loss_utils.py:66)."""
    softcap = FP32 * tokens * a.vocab_size if a.final_logit_softcapping else 0  # tanh output
    return FP32 * tokens * a.vocab_size + softcap + 8 * tokens


def _rope_saved(a: Architecture, seq_len: int, b: int) -> int:
    """cos and sin of shape (1, seq, head_dim) in the compute dtype, shared by every layer."""
    return 0 if a.learned_positions else 2 * seq_len * a.head_dim * b


def _loss_transient(a: Architecture, tokens: int, b: int) -> int:
    """The peak of the loss's backward, on top of the saved set: nll_loss_backward's gradient
    (fp32 tokens x vocab, zeros with one entry per row) and log_softmax_backward's output
    (fp32 tokens x vocab), both live while the saved log-probabilities are still held
    (autograd frees a node's saved tensors after it runs). The cast back to the training dtype
    (``.float()``'s backward, 2 x tokens x vocab in bf16) comes after the incoming gradient and
    the log-probabilities are freed, so it never adds to this: 8 bytes x tokens x vocab in bf16
    and fp32 alike, measured to the byte on llama, qwen2 and gpt2 shapes with vocabularies of
    32k-128k (tests/real_runs.py, the logits-dominated runs)."""
    return 2 * FP32 * tokens * a.vocab_size


def _layer_backward_transient(a: Architecture, tokens: int, b: int) -> int:
    """Starting one block's backward: the gradient flowing in (tokens x hidden) and that of the
    MLP's widest intermediate."""
    if a.layers:
        inner = max(_widest_intermediate(spec.mlp) for spec in distinct_specs(a).values())
    else:
        inner = a.intermediate_size * (a.experts_per_token if a.is_moe else 1)
    return b * tokens * inner + b * tokens * a.hidden_size


def _widest_intermediate(m: MlpSpec) -> int:
    """Per token: the MLP intermediate whose gradient is the widest (routed pairs x expert width,
    every expert for Llama-4, the shared expert beside them)."""
    if not m.is_moe:
        return m.intermediate_size
    routed = m.num_experts if m.layout == "llama4" else m.experts_per_token
    return max(routed * m.intermediate_size, m.shared_intermediate_size)


def _embedding_saved(a: Architecture, tokens: int, b: int, device: Device) -> int:
    """Embedding dropout (GPT-2): its saved noise, and the token+position sum it reads."""
    if a.hidden_dropout <= 0:
        return 0
    summed = b * tokens * a.hidden_size if a.learned_positions else 0
    return _dropout_keep_bytes(b, device) * tokens * a.hidden_size + summed


def estimate_activations(a: Architecture, *, micro_batch: int, seq_len: int, compute_bytes: int,
                         attention: Attention = "sdpa", checkpointing: Checkpointing = "none",
                         device: Device = "cuda", autocast: bool = False, every: int | None = None,
                         loss_chunks: int = 1, fused: tuple[str, ...] = ()) -> Activations:
    """``autocast``: the forward runs under torch.autocast over fp32 weights (torch's mixed recipes
    when nothing casts the weights: DDP, or a TP-only rank); the residual stream, the RoPE tables
    and the checkpointed block inputs are then fp32 (``_autocast_stream_extra``). ``every``: with
    full checkpointing, only every N-th block (checkpointed_blocks). ``fused``: the block ops that run as
    fused kernels (planner/recipes/fused_kernels.py), in the blocks and the final norm."""
    tokens = micro_batch * seq_len
    b = compute_bytes
    fp32_stream = _autocast_stream(a, b, autocast)
    # LlamaRotaryEmbedding.forward returns ``cos.to(dtype=x.dtype)`` with x the fp32 embedding
    # output under autocast: fp32 tables
    table_bytes = FP32 if fp32_stream else b
    if a.attention_implementation == "eager":
        attention = "eager"  # transformers has no SDPA path for this family (see the architecture's notes)
    if loss_chunks > 1:
        return _with_chunked_loss(estimate_activations(
            a, micro_batch=micro_batch, seq_len=seq_len, compute_bytes=compute_bytes, attention=attention,
            checkpointing=checkpointing, device=device, autocast=autocast, every=every, fused=fused), a, micro_batch,
            seq_len,
            loss_chunks, compute_bytes, FP32 if fp32_stream else compute_bytes)
    per_spec = {key: block_saved_bytes(a, spec, tokens, seq_len, micro_batch, b, attention, device, fp32_stream,
                                       fused)
                for key, spec in distinct_specs(a).items()}
    if len(per_spec) == 1:
        blocks = [next(iter(per_spec.values()))] * a.num_layers
    else:
        blocks = [per_spec[id(spec)] for spec in layer_specs(a)]
    per_layer = max(blocks)
    all_blocks = sum(blocks)
    final_norm = _final_norm_saved(a, tokens, b, fp32_stream, fused)
    rope = _rope_saved(a, seq_len, table_bytes)
    extra_rope = _extra_rope_tables(a, seq_len, table_bytes)
    edges = EdgeTerms(_embedding_saved(a, tokens, b, device), final_norm, _loss_saved(a, tokens, b), rope + extra_rope)
    loss = edges.loss_saved + rope
    embed_dropout = edges.embedding_saved + extra_rope
    items = [ActivationItem("final norm", final_norm), ActivationItem("logits / loss (fp32)", loss)]
    boundary = (FP32 if fp32_stream else b) * tokens * a.hidden_size  # a block's input (the residual stream)
    if checkpointing in ("selective-op", "selective-attention") or (checkpointing == "full" and (every or 1) > 1):
        specs = layer_specs(a)
        if checkpointing == "selective-op":
            cached = [_selective_op_kept(a, spec, tokens, micro_batch, seq_len, b) for spec in specs]
            kept = [boundary + c for c, _ in cached]
            rebuilt = [saved - shared for saved, (_, shared) in zip(blocks, cached)]
            what = "per-op SAC: input, saved linears' and SDPA's outputs"
        elif checkpointing == "selective-attention":
            core = _attention_saved(a, tokens, seq_len, micro_batch, b, attention, device)
            # Liger's rope rotates the 16-bit q and k in place: no fp32 promotion under autocast
            rotated_fp32 = fp32_stream and "rope" not in fused
            kept = [saved - core + _core_attention_kept(spec, tokens, b, rotated_fp32)
                    for saved, spec in zip(blocks, specs)]
            rebuilt = [core] * len(specs)  # the core's whole saved set, rebuilt at its backward
            what = "core attention recomputed: its inputs and output kept"
        else:
            chosen = checkpointed_blocks(a.num_layers, checkpointing, every)
            kept = [boundary if on else saved for saved, on in zip(blocks, chosen)]
            rebuilt = [saved if on else 0 for saved, on in zip(blocks, chosen)]
            what = f"every {every}-th block checkpointed ({sum(chosen)} of {a.num_layers})"
        loss_t = _loss_transient(a, tokens, b)
        layer_t = _layer_backward_transient(a, tokens, b)
        saved = sum(kept) + final_norm + loss + embed_dropout
        items.insert(0, ActivationItem(f"{a.num_layers} blocks kept ({what})", sum(kept)))
        items.append(ActivationItem("the largest block's backward rebuilds", max(rebuilt)))
        items.append(ActivationItem("backward transient at the loss", loss_t))
        return Activations(saved_bytes=saved, peak_extra_bytes=max(loss_t, max(rebuilt) + layer_t),
                           items=tuple(items), layer_saved_bytes=per_layer, layer_kept_bytes=max(kept),
                           head_saved_bytes=saved - sum(kept), loss_transient_bytes=loss_t,
                           layer_transient_bytes=layer_t,
                           final_norm_transient_bytes=final_norm_transient_bytes(a, tokens, fused),
                           num_layers=a.num_layers, checkpointed=checkpointing != "selective-attention",
                           blocks=tuple(blocks), edges=edges, kept_blocks=tuple(kept), rebuilt_blocks=tuple(rebuilt))
    if checkpointing == "full":
        # Each block keeps only its input (bytes of the residual stream); one block at a time is
        # recomputed in backward and holds its full saved set (Chen et al. 2016, sqrt(n) form).
        saved = a.num_layers * boundary + final_norm + loss + embed_dropout
        items.insert(0, ActivationItem(f"{a.num_layers} block inputs (checkpointed)", a.num_layers * boundary))
        recompute = per_layer
        extra = max(_loss_transient(a, tokens, b), recompute + _layer_backward_transient(a, tokens, b))
        items.append(ActivationItem("one block recomputed in backward", recompute))
    else:
        saved = all_blocks + final_norm + loss + embed_dropout
        label = (f"{a.num_layers} blocks x {per_layer} B saved" if all_blocks == a.num_layers * per_layer
                 else f"{a.num_layers} blocks saved (largest {per_layer} B)")
        items.insert(0, ActivationItem(label, all_blocks))
        extra = _loss_transient(a, tokens, b)
    items.append(ActivationItem("backward transient at the loss", _loss_transient(a, tokens, b)))
    kept = boundary if checkpointing == "full" else all_blocks // a.num_layers
    return Activations(saved_bytes=saved, peak_extra_bytes=extra, items=tuple(items),
                       layer_saved_bytes=per_layer, layer_kept_bytes=kept,
                       head_saved_bytes=saved - a.num_layers * kept,
                       loss_transient_bytes=_loss_transient(a, tokens, b),
                       layer_transient_bytes=_layer_backward_transient(a, tokens, b),
                       final_norm_transient_bytes=final_norm_transient_bytes(a, tokens, fused),
                       num_layers=a.num_layers, checkpointed=checkpointing == "full",
                       blocks=tuple(blocks), edges=edges)


def _with_chunked_loss(acts: Activations, a: Architecture, micro_batch: int, seq_len: int, chunks: int,
                       b: int, stream_bytes: int) -> Activations:
    """torchtune's chunked output loss (planner/recipes/losses.py): the same saved set, the loss's backward
    one chunk at a time (torch.chunk along the sequence: chunks of ceil(seq / chunks) tokens), so
    its two fp32 gradients are one chunk's. That makes the forward's last chunk the loss's peak:
    every chunk's logits (the model's output list, in the compute dtype) live beside every chunk's
    saved log-probabilities and the last chunk's fp32 upcast (a no-op in fp32). Peak trace (llama
    32k vocabulary, 2,048 tokens, bf16 autocast, 8 chunks): the eight log-probabilities, the eight
    bf16 logits and one fp32 chunk at the last chunk's log_softmax.

    Beside them the final norm's output (``hidden``, tokens x hidden in the residual stream's dtype
    ``stream_bytes``), a local of the loss's forward until it returns, is a second tensor whenever the
    LM head saves a copy of its chunks rather than views of it (the saved set counts that copy as the
    head's input): under autocast, the cast to the compute dtype; with more than one sequence a
    chunk along the sequence is not contiguous and the linear's matmul saves its reshaped copy
    (torch 2.13 aten/src/ATen/native/LinearAlgebra.cpp _matmul_impl folds the batch with
    ``reshape``). Peak traces (backend/losses.py on CPU, llama 256 hidden, 32k vocabulary): bf16
    autocast 1 x 2,048 tokens and 2 x 1,024, both norm outputs (``x * rsqrt`` saved, and ``hidden``)
    live at the last chunk's log_softmax; fp32 2 x 512 tokens, four 2 x 128 x 256 fp32 copies beside
    ``hidden``; fp32 1 x 1,024, views only. The H200 run of bench/gpu_check.py (Llama-3-8B width, 8,192
    tokens, bf16 autocast) measured the same 134,217,728 bytes over the prediction before this term."""
    chunk_tokens = micro_batch * -(-seq_len // chunks)
    upcast = FP32 * chunk_tokens * a.vocab_size if b != FP32 else 0
    copied = stream_bytes != b or micro_batch > 1
    norm_output = stream_bytes * micro_batch * seq_len * a.hidden_size if copied else 0
    transient = max(_loss_transient(a, chunk_tokens, FP32),
                    b * micro_batch * seq_len * a.vocab_size + upcast + norm_output)
    items = tuple(ActivationItem(f"backward transient at the loss (one of {chunks} chunks)", transient)
                  if i.name == "backward transient at the loss" else i for i in acts.items)
    if acts.kept_blocks:
        layer = max(acts.rebuilt_blocks) + acts.layer_transient_bytes
    else:
        layer = acts.layer_saved_bytes + acts.layer_transient_bytes if acts.checkpointed else 0
    return replace(acts, loss_transient_bytes=transient, peak_extra_bytes=max(transient, layer), items=items)


# The terms planner/recipes/finetune.py reuses for a block with a frozen base (LoRA): the attention core,
# the loss and its transient, the RoPE tables and one block's backward transient are the same
# tensors whether the weights train or not.
attention_saved = _attention_saved
loss_saved = _loss_saved
loss_transient = _loss_transient
rope_saved = _rope_saved
layer_backward_transient = _layer_backward_transient
