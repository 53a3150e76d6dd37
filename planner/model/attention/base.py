"""What an attention kind is asked (``AttentionKind``), and the GQA family, the standard kind:
num_heads queries over num_kv_heads keys and values, whose parameters planner/model/layers.py and saved
tensors planner/model/activations.py count over the two head counts, and which tensor and context
parallelism split. A kind with arithmetic of its own is a module beside this one
(planner/model/attention/mla.py), listed in planner/model/attention/kinds.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class AttentionKind:
    names: tuple[str, ...]  # the LayerSpec kinds it answers for
    short: str  # in messages: "MLA"
    long: str  # "multi-head latent attention"
    # why tensor parallelism cannot split it yet (None: its heads split over tp)
    tp_refusal: str | None = None
    # torch's ring attention computes plain causal SDPA: can this kind be context-parallel?
    ring_attention: bool = True
    # the hidden width is num_heads x head_dim (a scaled-down config keeps the identity)
    hidden_is_heads_by_head_dim: bool = True
    # separate k and v projections each cast the normed input again under autocast (unless fused)
    casts_kv_input_again: bool = True
    # q, k and v are each one projection of the hidden state (q_proj, k_proj, v_proj, o_proj: four
    # GEMMs; torchtitan's selective-op policy saves their outputs); False: low-rank latents between
    # (MLA), whose GEMMs are its parameter tensors
    plain_projections: bool = True
    # its own arithmetic, or None for the GQA family's formulas
    numels: Callable[..., list[int]] | None = None
    linears: Callable[..., list[tuple[str, int, int, bool]]] | None = None
    saved_bytes: Callable[..., int] | None = None


GQA_FAMILY = AttentionKind(names=("mha", "gqa", "mqa"), short="GQA", long="grouped-query attention")
