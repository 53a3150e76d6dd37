"""A block's linear layers by the names PEFT matches (one nn.Linear, or GPT-2's Conv1D, each): what
LoRA targets (planner/recipes/finetune.py) and what torchtitan's per-op checkpointing saves
(planner/model/activations.py) both read."""

from __future__ import annotations

from dataclasses import dataclass

from planner.model.architecture import Architecture
from planner.model.attention.kinds import kind_of
from planner.model.layers import AttentionSpec, LayerSpec


@dataclass(frozen=True)
class Linear:
    """One nn.Linear (or GPT-2's Conv1D) of a block, by the name PEFT matches."""

    name: str
    in_features: int
    out_features: int
    bias: bool



def _attention_linears(arch: Architecture, s: AttentionSpec, h: int) -> list[Linear]:
    own = kind_of(s).linears
    if own is not None:
        return [Linear(*fields) for fields in own(s, h)]
    q, kv = s.q_width, s.kv_width
    if arch.model_type == "gpt2":
        return [Linear("c_attn", h, q + 2 * kv, s.qkv_bias), Linear("c_proj", q, h, s.o_bias)]
    if arch.model_type == "falcon":
        return [Linear("query_key_value", h, q + 2 * kv, s.qkv_bias), Linear("dense", q, h, s.o_bias)]
    if s.fused_qkv:  # phi3
        return [Linear("qkv_proj", h, q + 2 * kv, s.qkv_bias), Linear("o_proj", q, h, s.o_bias)]
    return [Linear("q_proj", h, q, s.qkv_bias), Linear("k_proj", h, kv, s.qkv_bias),
            Linear("v_proj", h, kv, s.qkv_bias), Linear("o_proj", q, h, s.o_bias)]


def _mlp_linears(arch: Architecture, spec: LayerSpec, h: int) -> list[Linear]:
    m = spec.mlp
    inner, bias = m.intermediate_size, m.bias
    if arch.model_type == "gpt2":
        return [Linear("c_fc", h, inner, bias), Linear("c_proj", inner, h, bias)]
    if arch.model_type == "falcon":
        return [Linear("dense_h_to_4h", h, inner, bias), Linear("dense_4h_to_h", inner, h, bias)]
    if m.fused_gate_up:
        return [Linear("gate_up_proj", h, 2 * inner, bias), Linear("down_proj", inner, h, bias)]
    if m.gated:
        return [Linear("gate_proj", h, inner, bias), Linear("up_proj", h, inner, bias),
                Linear("down_proj", inner, h, bias)]
    return [Linear("up_proj", h, inner, bias), Linear("down_proj", inner, h, bias)]


def attention_linears(arch: Architecture, spec: LayerSpec) -> list[Linear]:
    """The block's attention linears alone (a mixture of experts' MLP is not nn.Linear modules)."""
    return _attention_linears(arch, spec.attention, arch.hidden_size)


def block_linears(arch: Architecture, spec: LayerSpec) -> list[Linear]:
    """A dense block's linears in registration order (attention, then MLP)."""
    return _attention_linears(arch, spec.attention, arch.hidden_size) + _mlp_linears(arch, spec, arch.hidden_size)


def attention_linears(arch: Architecture, spec: LayerSpec) -> list[Linear]:
    """A block's attention linears in registration order (the output projection last)."""
    return _attention_linears(arch, spec.attention, arch.hidden_size)
