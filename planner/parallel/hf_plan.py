"""transformers' own tensor parallelism: the layout ``from_pretrained(path, tp_plan="auto")`` applies.

transformers 5.25 (distributed/mixin.py ``init_parallel_plans``) merges three plans: the model
class's ``_tp_plan`` (every ForCausalLM of the families below: ``{"lm_head": "colwise_gather_output"}``,
e.g. models/llama/modeling_llama.py:414), the configuration's ``base_model_tp_plan``, and, when that
plan is not empty and the base model has an ``embed_tokens`` Embedding, ``"embed_tokens":
"embedding_rowwise"`` (mixin.py:93-94). distributed/tensor_parallel.py registers the styles
(ALL_PARALLEL_STYLES at its end):

- ``colwise`` (q/k/v, gate/up): weight Shard(0), output Shard(-1): the rank's heads or MLP columns;
- ``rowwise`` (o, down): weight Shard(-1), bias Replicate; the Partial output redistributed to
  Replicate, an all-reduce of tokens x hidden;
- ``embedding_rowwise``: EmbeddingParallel(shard_dim=0), vocab/tp rows, the partial lookups all-reduced;
- ``colwise_gather_output`` on ``lm_head``: vocab/tp rows of the head, its Shard(-1) output
  redistributed to Replicate: the whole tokens x vocab logits, all-gathered, on every rank, and the
  model's own loss (ForCausalLMLoss) computed on them locally, as on one device;
- ``replicated_with_grad_allreduce`` (Qwen3/Gemma-3 per-head q/k norms): whole, gradient all-reduced.

Nothing else is in the plan: the norms run whole on whole activations (no sequence parallelism),
and the routed experts of an MoE block are in ``base_model_ep_plan`` (``grouped_gemm``,
``ep_dispatch_experts``), which applies only with ``ep_size > 1`` (mixin.py
``_resolve_parallel_plans``: ``ep_plan = dict(self.ep_plan) if ep_size > 1 else {}``), so under TP
alone every rank holds every expert whole, and the router too. A rank is therefore a narrower model
where the plan splits (heads, dense MLP columns, shared experts where named), with the whole
vocabulary's logits, and the embedding and head parameters split over vocabulary rows.

What transformers refuses is refused here naming the field: a family without a plan
(``_resolve_parallel_plans``: "`tp_size=N` was requested, but X has no `tp_plan`"); heads that do
not divide (ColwiseParallel shards out_features unevenly, and the attention's
``view(..., -1, head_dim)`` of the rank's slice then fails). Plans whose styles the planner does not
model (the gathered q/k/v of OLMo-2 and Phi-3, Llama-4's deprecated ``moe_tp_experts``) are refused
with that reason. Verified by backend/hf_tensor_parallel.py (``from_pretrained(tp_plan="auto")`` on
CPU ranks over gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerError
from planner.model.architecture import Architecture, distinct_specs, layer_specs
from planner.model.layers import LayerSpec


@dataclass(frozen=True)
class HfTpPlan:
    """What one family's transformers 5.25 plan splits (its configuration's base_model_tp_plan)."""

    attention: bool  # q/k/v colwise, o rowwise: the rank's heads
    dense_mlp: bool  # gate/up colwise, down rowwise (a dense block's MLP)
    shared_experts: bool  # an MoE block's shared expert MLP named in the plan (DeepSeek's mlp.shared_experts.*)


_LLAMA = HfTpPlan(attention=True, dense_mlp=True, shared_experts=False)
# model_type -> its plan, read from transformers 5.25's models/<family>/configuration_<family>.py
# (tests/test_hf_plan.py compares every entry with the configuration class's base_model_tp_plan).
HF_TP_PLANS: dict[str, HfTpPlan] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "smollm3": _LLAMA, "gemma2": _LLAMA,
    # per-head q/k norms: replicated_with_grad_allreduce (whole on every rank, gradient all-reduced)
    "qwen3": _LLAMA, "gemma3_text": _LLAMA,
    # the text decoder of a multimodal config (gemma3_text's and mistral's plans), loaded text-only
    "gemma3": _LLAMA, "mistral3": _LLAMA,
    # mlp.gate_proj/up_proj/down_proj match the dense layers only (mlp_only_layers); experts in the ep plan
    "qwen3_moe": _LLAMA,
    "mixtral": HfTpPlan(attention=True, dense_mlp=False, shared_experts=False),  # attention only
    # base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}: only the embedding and the head split
    "gpt_oss": HfTpPlan(attention=False, dense_mlp=False, shared_experts=False),
}
# model_types with a plan whose styles the planner does not model, and why
HF_TP_NOT_MODELLED: dict[str, str] = {
    "olmo2": "its plan gathers q/k/v whole (colwise_gather_output, for the q/k norms over all heads) and splits o's "
             "input again (rowwise_split_input): every rank runs the whole attention",
    "phi3": "its plan gathers the fused qkv_proj and gate_up_proj outputs whole (colwise_gather_output) and splits "
            "them again (rowwise_split_input): every rank runs whole attention and MLP",
    "deepseek_v2": "multi-head latent attention (mla_kv_a_proj), which the planner's TP does not split",
    "deepseek_v3": "multi-head latent attention (mla_kv_a_proj), which the planner's TP does not split",
    "llama4_text": "its experts use moe_tp_experts, deprecated in transformers 5.25 (removal in 5.28)",
    "llama4": "its experts use moe_tp_experts, deprecated in transformers 5.25 (removal in 5.28)",
}
# model_types whose classes have no tp_plan at all (models/gpt2, models/falcon in 5.25)
HF_NO_TP_PLAN = frozenset({"gpt2", "falcon"})


def hf_tp_plan(arch: Architecture, tp: int) -> HfTpPlan:
    """The family's plan, or the refusal transformers (or the planner) gives, naming the field."""
    kind = arch.model_type
    if kind in HF_NO_TP_PLAN:
        raise PlannerError(f"tp_plan=transformers with tp={tp}: model_type {kind!r} has no tp_plan in transformers "
                           f"5.25 (from_pretrained refuses: `tp_size={tp}` was requested, but the model has no "
                           "`tp_plan`); use tp_plan torchtitan or tp 1", field="tp_plan")
    if kind in HF_TP_NOT_MODELLED:
        raise PlannerError(f"tp_plan=transformers with model_type {kind!r}: {HF_TP_NOT_MODELLED[kind]}; not "
                           "modelled, use tp_plan torchtitan or tp 1", field="tp_plan")
    plan = HF_TP_PLANS.get(kind)
    if plan is None:
        raise PlannerError(f"tp_plan=transformers with model_type {kind!r}: its tp_plan is not read by the planner "
                           f"(it reads {', '.join(sorted(HF_TP_PLANS))})", field="tp_plan")
    if arch.vision_numels:
        raise PlannerError(f"tp_plan=transformers with the vision tower of {kind!r} counted: the composite model's "
                           "plan is the text decoder's, the tower's placement is not modelled; estimate the text "
                           "decoder alone", field="tp_plan")
    return plan


def _check_heads(spec: LayerSpec, tp: int) -> None:
    attn = spec.attention
    for name, heads in (("num_attention_heads", attn.num_heads), ("num_key_value_heads", attn.num_kv_heads)):
        if heads % tp:
            raise PlannerError(f"tp({tp}) does not divide {name}({heads}): transformers' colwise q/k/v split gives a "
                               "rank a slice that is not whole heads, and its attention cannot reshape it",
                               field="tp")


def _split(value: int, tp: int) -> int:
    """DTensor's Shard puts ceil(n / tp) on the first ranks (placement_types.py Shard._split_tensor)."""
    return -(-value // tp)


def hf_rank_spec(spec: LayerSpec, plan: HfTpPlan, tp: int) -> LayerSpec:
    """One block as a rank of transformers' plan runs it."""
    attn, mlp = spec.attention, spec.mlp
    update: dict = {}
    if plan.attention:
        _check_heads(spec, tp)
        update["attention"] = attn.model_copy(update={"num_heads": attn.num_heads // tp,
                                                      "num_kv_heads": attn.num_kv_heads // tp})
    inner: dict = {}
    if mlp.num_experts == 0 and plan.dense_mlp:
        inner["intermediate_size"] = _split(mlp.intermediate_size, tp)
    if mlp.num_experts and mlp.shared_intermediate_size and plan.shared_experts:
        inner["shared_intermediate_size"] = _split(mlp.shared_intermediate_size, tp)
    if inner:
        update["mlp"] = mlp.model_copy(update=inner)
    return spec.model_copy(update=update) if update else spec


def hf_rank_architecture(a: Architecture, tp: int) -> Architecture:
    """The model one rank of transformers' plan holds and runs: narrower where the plan splits, the
    whole vocabulary (its logits are gathered); the embedding's and head's vocab/tp rows are the
    parameter split (tensor.rank_numels with embedding_split = lm_head_split = tp)."""
    plan = hf_tp_plan(a, tp)
    narrowed = {key: hf_rank_spec(spec, plan, tp) for key, spec in distinct_specs(a).items()}
    fields = {"layers": tuple(narrowed[id(spec)] for spec in a.layers)} if a.layers else {}
    if plan.attention:
        fields |= {"num_attention_heads": a.num_attention_heads // tp, "num_key_value_heads": a.num_key_value_heads // tp}
    if plan.dense_mlp and not any(spec.mlp.num_experts for spec in narrowed.values()):
        fields["intermediate_size"] = _split(a.intermediate_size, tp)
    return Architecture.model_validate({**a.__dict__, **fields})


def hf_tp_collectives(full: Architecture, *, tokens: int, micro_batches: float, b: int, stream_bytes: int, tp: int,
                      checkpointing: str) -> list[tuple[str, float, int, float]]:
    """(what, bytes per step, ring passes, message bytes) of the TP group under transformers' plan.

    Each DTensor redistribution is one collective (distributed/tensor_parallel.py): forward, every
    rowwise output's Partial to Replicate (one all-reduce per split attention and split MLP) and the
    vocab-parallel embedding's partial lookups (one); backward, every colwise input's Partial
    gradient, one per projection, since q, k and v (gate and up) each wrap the same input as their
    own Replicate DTensor (ColwiseParallel.transform_inputs_pre_forward), and the head's input
    gradient (one). Counted on CPU ranks (llama, 4 blocks, tp 2): 30 all-reduces of tokens x hidden
    per step = 4 + 4 + 1 forward, 4 x 3 + 4 x 2 + 1 backward. Full checkpointing repeats the blocks'
    forward ones. The head's colwise_gather_output all-gathers the whole tokens x vocab logits
    forward, its backward only slices (Replicate to Shard(-1) is local). The per-head q/k norms'
    gradients (replicated_with_grad_allreduce) are head_dim elements each, fp32. As for torchtitan's
    layout (tensor.tp_collectives) nothing overlaps compute.

    Dtypes: the rowwise outputs and the logits are the matmuls' (``b``, the compute dtype); the
    embedding's lookup and the gradients of the colwise inputs are the residual stream's
    (``stream_bytes``: the weights' dtype, fp32 under autocast, where the stream stays fp32).
    Counted (qwen3 tp 2, bf16-mixed, 1,024 tokens, hidden 256): 8 x 0.52 MB + 22 x 1.05 MB = 27.26 MB."""
    if tp == 1:
        return []
    plan = hf_tp_plan(full, tp)
    specs = layer_specs(full)
    forward = backward = 0
    norms = 0
    for spec in specs:
        mlp = spec.mlp
        if plan.attention:
            forward += 1
            backward += 1 if spec.attention.fused_qkv else 3
            norms += 2 if spec.attention.qk_norm != "none" else 0
        if (mlp.num_experts == 0 and plan.dense_mlp) or (mlp.num_experts and mlp.shared_intermediate_size
                                                          and plan.shared_experts):
            forward += 1
            backward += 2 if mlp.gated and not mlp.fused_gate_up else 1
    recomputed = forward if checkpointing == "full" else 0
    matmul = b * tokens * full.hidden_size
    stream = stream_bytes * tokens * full.hidden_size
    # + the embedding's lookup (forward) and the head's input gradient (backward), in the stream's dtype
    volume = ((forward + recomputed) * matmul + (backward + 2) * stream) * micro_batches
    logits = b * tokens * full.vocab_size
    rows = [("TP all-reduces (transformers tp_plan)", volume, 2, max(matmul, stream)),
            ("TP all-gather of the logits (lm_head colwise_gather_output)", micro_batches * logits, 1, logits)]
    if norms:
        head = 4 * specs[0].attention.head_dim
        rows.append(("TP all-reduces of the q/k norms' gradients", norms * micro_batches * head, 2, head))
    return rows
