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

from dataclasses import dataclass
from typing import Literal

from planner.architecture import Architecture

Attention = Literal["sdpa", "eager"]
Checkpointing = Literal["none", "full"]

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
class Activations:
    """``saved_bytes``: held from the forward until backward reaches it (all layers together).
    ``peak_extra_bytes``: the largest transient on top of the saved set, at the loss or inside
    one layer's backward (recomputed layer under checkpointing). ``items`` explains both."""

    saved_bytes: int
    peak_extra_bytes: int
    items: tuple[ActivationItem, ...]
    layer_saved_bytes: int = 0  # one block's saved set (without checkpointing)
    layer_kept_bytes: int = 0  # what each block keeps until its backward (its saved set, or its input)
    head_saved_bytes: int = 0  # final norm, logits/loss, RoPE tables, embedding dropout
    loss_transient_bytes: int = 0
    layer_transient_bytes: int = 0
    num_layers: int = 0
    checkpointed: bool = False

    @property
    def peak_bytes(self) -> int:
        return self.saved_bytes + self.peak_extra_bytes


def _norm_saved(a: Architecture, tokens: int, b: int) -> int:
    """RMSNorm (LlamaRMSNorm.forward): the fp32 upcast (saved by pow and mul; in fp32 it is the
    input itself), ``x * rsqrt`` cast back to the compute dtype (saved by ``weight * x`` for the
    weight's gradient), the ``weight * x`` output (saved by the next linear), and rsqrt per token.
    LayerNorm (native_layer_norm): its input, fp32 mean and rstd per token, and its output (saved
    by the next linear)."""
    h = a.hidden_size
    if a.norm == "rmsnorm":
        return FP32 * tokens * h + b * tokens * h + b * tokens * h + FP32 * tokens
    return b * tokens * h + b * tokens * h + 2 * FP32 * tokens


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


def _mlp_saved(a: Architecture, tokens: int, b: int) -> int:
    inner = a.intermediate_size
    if a.mlp == "gated":
        # gate output (saved by the activation), act(gate) and up (saved by the product),
        # the product (saved by down_proj)
        per_expert_tokens = tokens * a.experts_per_token if a.is_moe else tokens
        return 4 * b * per_expert_tokens * inner
    if a.model_type == "gpt2":
        # NewGELUActivation, 0.5*x*(1+tanh(c*(x+0.044715*x**3))) in Python: c_fc output, the
        # tanh output, 1+tanh, 0.5*x, and their product (saved by c_proj)
        return 5 * b * tokens * inner
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
                      attention: Attention, device: Device = "cuda") -> int:
    norms = a.norms_per_layer * _norm_saved(a, tokens, b)
    return (norms + _attention_saved(a, tokens, seq_len, micro_batch, b, attention, device)
            + _mlp_saved(a, tokens, b) + _moe_router_saved(a, tokens)
            + _dropout_saved(a, tokens, b, device))


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
    inner = a.intermediate_size * (a.experts_per_token if a.is_moe else 1)
    return b * tokens * inner + b * tokens * a.hidden_size


def _embedding_saved(a: Architecture, tokens: int, b: int, device: Device) -> int:
    """Embedding dropout (GPT-2): its saved noise, and the token+position sum it reads."""
    if a.hidden_dropout <= 0:
        return 0
    summed = b * tokens * a.hidden_size if a.learned_positions else 0
    return _dropout_keep_bytes(b, device) * tokens * a.hidden_size + summed


def estimate_activations(a: Architecture, *, micro_batch: int, seq_len: int, compute_bytes: int,
                         attention: Attention = "sdpa", checkpointing: Checkpointing = "none",
                         device: Device = "cuda") -> Activations:
    tokens = micro_batch * seq_len
    b = compute_bytes
    per_layer = layer_saved_bytes(a, tokens, seq_len, micro_batch, b, attention, device)
    final_norm = _norm_saved(a, tokens, b)
    loss = _loss_saved(a, tokens, b) + _rope_saved(a, seq_len, b)
    embed_dropout = _embedding_saved(a, tokens, b, device)
    items = [ActivationItem("final norm", final_norm), ActivationItem("logits / loss (fp32)", loss)]
    if checkpointing == "full":
        # Each block keeps only its input (bytes of the residual stream); one block at a time is
        # recomputed in backward and holds its full saved set (Chen et al. 2016, sqrt(n) form).
        boundary = b * tokens * a.hidden_size
        saved = a.num_layers * boundary + final_norm + loss + embed_dropout
        items.insert(0, ActivationItem(f"{a.num_layers} block inputs (checkpointed)", a.num_layers * boundary))
        recompute = per_layer
        extra = max(_loss_transient(a, tokens, b), recompute + _layer_backward_transient(a, tokens, b))
        items.append(ActivationItem("one block recomputed in backward", recompute))
    else:
        saved = a.num_layers * per_layer + final_norm + loss + embed_dropout
        items.insert(0, ActivationItem(f"{a.num_layers} blocks x {per_layer} B saved", a.num_layers * per_layer))
        extra = _loss_transient(a, tokens, b)
    items.append(ActivationItem("backward transient at the loss", _loss_transient(a, tokens, b)))
    kept = b * tokens * a.hidden_size if checkpointing == "full" else per_layer
    return Activations(saved_bytes=saved, peak_extra_bytes=extra, items=tuple(items),
                       layer_saved_bytes=per_layer, layer_kept_bytes=kept,
                       head_saved_bytes=saved - a.num_layers * kept,
                       loss_transient_bytes=_loss_transient(a, tokens, b),
                       layer_transient_bytes=_layer_backward_transient(a, tokens, b),
                       num_layers=a.num_layers, checkpointed=checkpointing == "full")
