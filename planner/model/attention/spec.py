"""One block's attention described as data (``AttentionSpec``): the type the attention kinds
(planner/model/attention/) and the block (planner/model/layers.py) both read, kept below both so
that neither imports the other for it, not even for type checking."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

AttentionKind = Literal["mha", "gqa", "mqa", "mla"]
Window = Literal["full", "sliding", "chunked"]
QkNorm = Literal["none", "head", "projection", "l2"]


class AttentionSpec(BaseModel):
    """One block's attention. ``head_dim`` is the query/key width of one head (MLA: the no-RoPE
    part plus the RoPE part); ``v_head_dim`` the value width."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: AttentionKind = Field(description="MHA, GQA, MQA (one K/V head) or MLA (latent K/V, DeepSeek)")
    num_heads: int = Field(gt=0, description="query heads")
    num_kv_heads: int = Field(gt=0, description="key/value heads (MLA: the query heads)")
    head_dim: int = Field(gt=0, description="query/key width of one head")
    v_head_dim: int = Field(gt=0, description="value width of one head")
    q_lora_rank: int = Field(default=0, ge=0, description="MLA: rank of the query down-projection (0 = none)")
    kv_lora_rank: int = Field(default=0, ge=0, description="MLA: rank of the joint K/V latent")
    rope_head_dim: int = Field(default=0, ge=0, description="MLA: RoPE part of head_dim (shared by all heads)")
    window: Window = Field(default="full", description="full causal, sliding window, or chunked (Llama-4)")
    window_size: int = Field(default=0, ge=0, description="tokens of the sliding window or chunk")
    qk_norm: QkNorm = Field(default="none", description="RMSNorm of q and k per head (Qwen3, Gemma-3), over "
                            "the whole projection (OLMo-2), or a weightless L2 norm (Llama-4)")
    sinks: bool = Field(default=False, description="a learned sink logit per head (gpt-oss)")
    logit_softcap: bool = Field(default=False, description="tanh soft-capping of the attention logits (Gemma-2)")
    rope: bool = Field(default=True, description="rotary positions applied in this block")
    rope_table: Literal["global", "local"] = Field(
        default="global", description="which cos/sin table the block reads (Gemma-3's sliding layers have their own)")
    qkv_bias: bool = Field(default=False, description="query/key/value projections have biases")
    o_bias: bool = Field(default=False, description="output projection has a bias")
    fused_qkv: bool = Field(default=False, description="one fused QKV projection (GPT-2, Falcon, Phi-3)")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout on attention probabilities")

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        return self.num_kv_heads * self.v_head_dim

    @property
    def out_width(self) -> int:
        return self.num_heads * self.v_head_dim
