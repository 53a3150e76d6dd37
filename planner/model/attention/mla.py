"""Multi-head latent attention (DeepSeek-V2/V3, transformers' DeepseekV2/V3Attention): its
parameters, its linears as PEFT names them, what autograd saves for it, and what the parallel
dimensions can do with it: what planner/model/attention/kinds.py answers for kind "mla".

The query goes through an optional low-rank projection (q_a_proj, q_a_layernorm, q_b_proj), keys
and values through one shared latent (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj) plus a
shared RoPE key, so neither the heads x head width identity nor ring attention's plain causal SDPA
holds for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.model.attention.base import AttentionKind

if TYPE_CHECKING:
    from planner.model.attention.spec import AttentionSpec

FP32 = 4


def _linear(n_in: int, n_out: int, bias: bool) -> list[int]:
    return [n_in * n_out] + ([n_out] if bias else [])


def numels(s: "AttentionSpec", hidden: int) -> list[int]:
    """DeepseekV3Attention.__init__: q_proj, or q_a_proj + q_a_layernorm + q_b_proj; then
    kv_a_proj_with_mqa (latent plus the shared RoPE key), kv_a_layernorm, kv_b_proj, o_proj."""
    heads = s.num_heads
    if s.q_lora_rank:
        q = _linear(hidden, s.q_lora_rank, s.qkv_bias) + [s.q_lora_rank] + [s.q_lora_rank * heads * s.head_dim]
    else:
        q = [hidden * heads * s.head_dim]
    nope = s.head_dim - s.rope_head_dim
    kv = _linear(hidden, s.kv_lora_rank + s.rope_head_dim, s.qkv_bias) + [s.kv_lora_rank]
    kv += [s.kv_lora_rank * heads * (nope + s.v_head_dim)]
    return q + kv + _linear(heads * s.v_head_dim, hidden, s.o_bias)


def linears(s: "AttentionSpec", h: int) -> list[tuple[str, int, int, bool]]:
    """(name, in_features, out_features, bias) of each nn.Linear, by the names PEFT matches."""
    out = ([("q_a_proj", h, s.q_lora_rank, s.qkv_bias), ("q_b_proj", s.q_lora_rank, s.num_heads * s.head_dim, False)]
           if s.q_lora_rank else [("q_proj", h, s.num_heads * s.head_dim, False)])
    nope = s.head_dim - s.rope_head_dim
    return out + [("kv_a_proj_with_mqa", h, s.kv_lora_rank + s.rope_head_dim, s.qkv_bias),
                  ("kv_b_proj", s.kv_lora_rank, s.num_heads * (nope + s.v_head_dim), False),
                  ("o_proj", s.num_heads * s.v_head_dim, h, s.o_bias)]


def saved_bytes(s: "AttentionSpec", tokens: int, seq_len: int, micro_batch: int, b: int, attention: str,
                device: str) -> int:
    """DeepseekV2/V3Attention (multi-head latent attention): the query LoRA (q_a_proj output through
    q_a_layernorm: fp32 input, rsqrt, the cast back, and its output saved by q_b_proj), the K/V
    latent through kv_a_layernorm likewise (in fp32 the norm's input is a view that keeps the whole
    kv_a_proj output, latent plus RoPE key, alive), then attention, and its output saved by o_proj."""
    heads, v = s.num_heads, s.v_head_dim
    nope = s.head_dim - s.rope_head_dim

    def latent_norm(width: int, storage: int) -> int:
        return FP32 * tokens * storage + b * tokens * width + FP32 * tokens + b * tokens * width

    lora = latent_norm(s.q_lora_rank, s.q_lora_rank) if s.q_lora_rank else 0
    latent = latent_norm(s.kv_lora_rank, s.kv_lora_rank + (s.rope_head_dim if b == FP32 else 0))
    out = b * tokens * heads * v
    scores = micro_batch * heads * seq_len * seq_len
    if attention == "eager":
        probs = FP32 * scores + (b * scores if b != FP32 else 0)
        return lora + latent + 2 * b * tokens * heads * s.head_dim + b * tokens * heads * (nope + v) + probs + out
    if device == "cpu" and s.head_dim != v:
        # CPU's flash kernel needs equal q/k and v head widths: SDPA falls back to its math path,
        # which upcasts to fp32 and saves q, k, the fp32 probabilities and v (measured with
        # saved-tensor hooks, bf16 and fp32)
        return lora + latent + FP32 * (tokens * heads * (2 * s.head_dim + v) + scores) + out
    # flash/efficient kernels: the concatenated query, the key assembled by expand_kv, the value (a
    # view that keeps all of kv_b_proj's heads x (nope + v) output alive), the output, fp32 logsumexp
    lse = FP32 * micro_batch * heads * seq_len
    q = k = b * tokens * heads * s.head_dim
    return lora + latent + q + k + b * tokens * heads * (nope + v) + out + lse


MLA = AttentionKind(
    names=("mla",), short="MLA", long="multi-head latent attention",
    # the latent down-projections would be replicated and the up-projections split (torchtitan's
    # deepseek_v3 parallelize), which the TP model does not count yet
    tp_refusal="its latent down-projections are replicated and its up-projections split, which torchtitan's "
               "deepseek_v3 does and this planner does not yet count",
    ring_attention=False, hidden_is_heads_by_head_dim=False, casts_kv_input_again=False, plain_projections=False,
    numels=numels, linears=linears, saved_bytes=saved_bytes)
