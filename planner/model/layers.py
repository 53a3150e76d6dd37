"""One decoder block described as data: its attention, its MLP and its norms.

A model is an ordered list of these (``Architecture.layer_specs``). Parameter counts, the flat
order DeepSpeed partitions parameters in, FLOPs and activations all read the same list, so a
stack whose blocks differ (DeepSeek's dense layers before the MoE ones, Llama-4's MoE every other
layer, Gemma-3's sliding and global attention) is described once and never as
``num_layers * one_layer``.

Module registration orders are those of transformers 5.24's modeling_<family>.py ``__init__``
methods, because DeepSpeed and FSDP flatten parameters in that order.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.model.attention.kinds import kind_of
from planner.model.attention.spec import AttentionSpec  # the block's attention, kept below the kinds (re-exported here)

NormPlacement = Literal["pre", "post", "sandwich", "parallel"]
MoeLayout = Literal["mixtral", "qwen3_moe", "gpt_oss", "deepseek", "llama4"]


class MlpSpec(BaseModel):
    """One block's MLP: dense, or a mixture of experts with optional shared experts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gated: bool = Field(description="gated (SwiGLU/GeGLU: gate, up, down) or plain (up, down)")
    bias: bool = Field(default=False, description="projections (and experts) have biases")
    fused_gate_up: bool = Field(default=False, description="gate and up in one matrix (Phi-3; MoE experts)")
    intermediate_size: int = Field(gt=0, description="inner width of the dense MLP, or of one routed expert")
    num_experts: int = Field(default=0, ge=0, description="routed experts; 0 = dense")
    experts_per_token: int = Field(default=0, ge=0, description="routed experts each token goes to")
    shared_intermediate_size: int = Field(default=0, ge=0,
                                          description="inner width of the shared expert MLP every token goes through")
    shared_bias: bool = Field(default=False, description="the shared expert MLP has biases (DeepSeek-V2 mlp_bias)")
    router_bias: bool = Field(default=False, description="the router has a bias (gpt-oss)")
    layout: MoeLayout = Field(default="mixtral", description="which transformers experts module (parameter order)")
    router: Literal["softmax", "topk_softmax", "sigmoid_grouped", "softmax_grouped", "softmax_greedy",
                    "sigmoid_top1"] = Field(default="softmax", description="how the router scores and picks experts")
    normalise_top_k: bool = Field(default=False, description="the router divides the top-k weights by their sum "
                                  "(Mixtral always; Qwen3-MoE/DeepSeek norm_topk_prob)")
    groups: int = Field(default=0, ge=0, description="expert groups for group-limited routing (DeepSeek n_group)")
    groups_kept: int = Field(default=0, ge=0, description="groups each token may use (DeepSeek topk_group)")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class LayerSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    attention: AttentionSpec
    mlp: MlpSpec
    norm: Literal["rmsnorm", "layernorm"] = Field(description="RMSNorm (weight) or LayerNorm (weight, bias)")
    norms: int = Field(ge=1, le=8, description="hidden-width norms in the block")
    norm_placement: NormPlacement = Field(default="pre", description="pre-norm, post-norm (OLMo-2), both "
                                          "(Gemma-2/3 sandwich) or one norm feeding attention and MLP (Falcon)")
    norm_weight: Literal["cast", "float"] = Field(
        default="cast", description="RMSNorm applies its weight after casting back (Llama: weight * x.to(dtype)) "
        "or in fp32 before the cast (OLMo-2, Gemma-3); decides what autograd saves")


def _linear(n_in: int, n_out: int, bias: bool) -> list[int]:
    return [n_in * n_out] + ([n_out] if bias else [])


def norm_numels(norm: str, width: int) -> list[int]:
    return [width, width] if norm == "layernorm" else [width]


def attention_numels(s: AttentionSpec, hidden: int) -> list[int]:
    own = kind_of(s).numels
    if own is not None:
        return own(s, hidden)
    q, kv = s.q_width, s.kv_width
    if s.fused_qkv:
        out = _linear(hidden, q + 2 * kv, s.qkv_bias)
    elif s.qkv_bias:
        out = [hidden * q, hidden * kv, hidden * kv, q, kv, kv]
    else:
        out = [hidden * q, hidden * kv, hidden * kv]
    out += _linear(q, hidden, s.o_bias)
    if s.qk_norm == "head":
        out += [s.head_dim, s.head_dim]  # Qwen3Attention.q_norm / k_norm: RMSNorm(head_dim)
    elif s.qk_norm == "projection":
        out += [q, kv]  # Olmo2Attention: RMSNorm(heads * head_dim), RMSNorm(kv_heads * head_dim)
    if s.sinks:
        out.append(s.num_heads)  # GptOssAttention.sinks
    return out


def dense_mlp_numels(gated: bool, bias: bool, fused: bool, hidden: int, inner: int) -> list[int]:
    if fused:
        return [2 * hidden * inner, inner * hidden]
    if bias:
        return [hidden * inner, inner] * (2 if gated else 1) + [inner * hidden, hidden]
    return [hidden * inner] * (2 if gated else 1) + [inner * hidden]


def mlp_numels(m: MlpSpec, hidden: int) -> list[int]:
    if not m.is_moe:
        return dense_mlp_numels(m.gated, m.bias, m.fused_gate_up, hidden, m.intermediate_size)
    e, inner = m.num_experts, m.intermediate_size
    up = (2 if m.gated else 1) * inner
    # transformers 5 fuses every expert's gate and up in one (E, 2I, h) parameter, down (E, h, I)
    experts = [e * up * hidden] + ([e * up] if m.bias else []) + [e * hidden * inner] + ([e * hidden] if m.bias else [])
    router = [hidden * e] + ([e] if m.router_bias else [])
    shared = (dense_mlp_numels(True, m.shared_bias, False, hidden, m.shared_intermediate_size)
              if m.shared_intermediate_size else [])
    if m.layout in ("mixtral", "gpt_oss"):  # MixtralSparseMoeBlock: gate, experts; GptOssMLP: router, experts
        return router + experts + shared
    return experts + router + shared  # Qwen3Moe/DeepseekV3MoE/Llama4TextMoe: experts, gate, shared


def layer_numels(spec: LayerSpec, hidden: int) -> list[int]:
    """Parameters of one block in registration order: attention, MLP, then its norms."""
    return (attention_numels(spec.attention, hidden) + mlp_numels(spec.mlp, hidden)
            + norm_numels(spec.norm, hidden) * spec.norms)


def routed_inactive_numels(m: MlpSpec, hidden: int) -> int:
    """Expert parameters one token does not pass through (for FLOPs)."""
    if not m.is_moe:
        return 0
    one = sum(mlp_numels(m.model_copy(update={"num_experts": 1, "shared_intermediate_size": 0,
                                              "router_bias": False}), hidden)) - hidden
    return (m.num_experts - m.experts_per_token) * one
