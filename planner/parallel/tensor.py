"""Tensor parallelism (Megatron column/row splits) and sequence parallelism: what one rank holds.

A rank of a TP group runs a *narrower model*: the same residual width, 1/tp of the query and
key/value heads, 1/tp of the MLP's inner width (and of each routed expert's when experts are not
sharded by ep), 1/tp of the vocabulary rows of the embedding and the LM head (Shoeybi et al.
2019, "Megatron-LM", Sec. 3: column-parallel q/k/v and the first MLP linear, row-parallel o and
the second; vocab-parallel embedding and output). Its parameter tensors are those of
``rank_architecture``, so the count, the memory states and the activations all read one
description. What TP replicates stays whole: the norms, the router, the biases of row-parallel
linears (their output is reduced, then the bias added), a learned position embedding.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.2.2) shards what the norms save over the sequence; the norm's output
is all-gathered before the column-parallel linears, and each of those saves the gathered whole.

The layout realised is torchtitan's (torchtitan/models/llama3/infra/parallelize.py ``apply_tp``:
ColwiseParallel q/k/v/w1/w3, RowwiseParallel wo/w2, SequenceParallel norms, the loss computed
with ``loss_parallel``), verified by backend/train_parallel.py on CPU ranks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from planner.model.activations import FP32, ActivationItem, Activations, EdgeTerms, final_norm_transient_bytes
from planner.model.architecture import Architecture, distinct_specs, layer_specs, parameter_numels
from planner.model.attention.kinds import kind_of
from planner.parallel.hf_plan import hf_rank_architecture
from planner.memory.buffers import SweepPoint, item
from planner.errors import PlannerError
from planner.model.layers import LayerSpec
from planner.memory.moments import PhaseKind
from planner.schema import MemoryItem

if TYPE_CHECKING:
    from planner.frameworks.base import Framework


def _split(value: int, tp: int) -> int:
    """A dimension split over tp ranks: DTensor's Shard puts ceil(n / tp) on the first ranks
    (torch/distributed/tensor/placement_types.py, Shard._split_tensor), the worst rank holds that."""
    return -(-value // tp)


def _kv_heads(kv: int, tp: int) -> int:
    """Key/value heads per rank: split when tp divides them; when there are fewer than tp, each
    rank keeps one (replicated, as Megatron does for GQA with tp > num_query_groups)."""
    return max(1, kv // tp)


def _rank_spec(spec: LayerSpec, tp: int) -> LayerSpec:
    attn, mlp = spec.attention, spec.mlp
    kind = kind_of(attn)
    if kind.tp_refusal is not None:
        raise PlannerError(f"tp({tp}) with {kind.long} ({kind.short}) is not modelled: {kind.tp_refusal}; "
                           "use tp 1 with fsdp", field="tp")
    attention = attn.model_copy(update={"num_heads": _split(attn.num_heads, tp),
                                        "num_kv_heads": _kv_heads(attn.num_kv_heads, tp)})
    inner = {"intermediate_size": _split(mlp.intermediate_size, tp)}
    if mlp.shared_intermediate_size:
        inner["shared_intermediate_size"] = _split(mlp.shared_intermediate_size, tp)
    return spec.model_copy(update={"attention": attention, "mlp": mlp.model_copy(update=inner)})


def rank_architecture(a: Architecture, tp: int) -> Architecture:
    """The narrower model one TP rank holds and runs (its parameters are the rank's shards)."""
    if tp == 1:
        return a
    key = (id(a), tp)
    cached = _RANKS.get(key)
    if cached is None or cached[0] is not a:
        if len(_RANKS) > 64:
            _RANKS.clear()
        cached = _RANKS[key] = (a, _rank_architecture(a, tp))  # the model kept: its id stays its own
    return cached[1]


# The plan search asks for the same split of the same model many times; Architecture is not
# hashable, so the cache is keyed by identity and holds the model it was made from.
_RANKS: dict[tuple[int, int], tuple[Architecture, Architecture]] = {}


def _rank_architecture(a: Architecture, tp: int) -> Architecture:
    fields = {
        "vocab_size": _split(a.vocab_size, tp),
        "num_attention_heads": _split(a.num_attention_heads, tp),
        "num_key_value_heads": _kv_heads(a.num_key_value_heads, tp),
        "intermediate_size": _split(a.intermediate_size, tp),
    }
    if a.layers:
        narrowed: dict[int, LayerSpec] = {key: _rank_spec(spec, tp) for key, spec in distinct_specs(a).items()}
        fields["layers"] = tuple(narrowed[id(spec)] for spec in a.layers)
    else:
        _rank_spec(layer_specs(a)[0], tp)  # refuses what cannot be split
    return _with(a, fields)


def autotp_rank_architecture(a: Architecture, tp: int) -> Architecture:
    """The rank's model under DeepSpeed's AutoTP: rank_architecture's with the whole vocabulary (the
    embedding is split along the hidden dimension, the logits gathered whole), made once per model
    and degree as rank_architecture is (the plan resolves every ZeRO setting of a TP layout, and the
    model's derived memo then serves them all)."""
    key = (id(a), tp)
    cached = _AUTOTP_RANKS.get(key)
    if cached is None or cached[0] is not a:
        if len(_AUTOTP_RANKS) > 64:
            _AUTOTP_RANKS.clear()
        cached = _AUTOTP_RANKS[key] = (a, _with(rank_architecture(a, tp), {"vocab_size": a.vocab_size}))
    return cached[1]


_AUTOTP_RANKS: dict[tuple[int, int], tuple[Architecture, Architecture]] = {}  # the model kept: its id stays its own


def _with(a: Architecture, fields: dict) -> Architecture:
    """A new Architecture (validated, its own memo): model_copy would carry the memoised numels
    and counts of the original along (architecture.derived_memo)."""
    return Architecture.model_validate({**a.__dict__, **fields})


def _sharded_norm_bytes(a: Architecture, tokens: int, b: int, autocast: bool = False) -> int:
    """What one hidden-width norm saves that SP splits over the sequence: RMSNorm's fp32 input
    (upcast), ``x * rsqrt`` in the compute dtype (fp32 under autocast: activations._norm_saved)
    and rsqrt per token; LayerNorm's input, mean and rstd. Its output, all-gathered, is saved
    whole by the following column-parallel linear (activations._norm_saved counts it, and it stays)."""
    if a.norm == "rmsnorm":
        product = FP32 if autocast else b
        return FP32 * tokens * a.hidden_size + product * tokens * a.hidden_size + FP32 * tokens
    return b * tokens * a.hidden_size + 2 * FP32 * tokens


def sequence_parallel_norm_cut_bytes(a: Architecture, tokens: int, b: int, tp: int) -> int:
    """What SP takes off one Llama-style norm's saved set over ``tokens`` (the part split over the
    sequence, less the rank's 1/tp of it), for modules that reason about what a block's backward
    frees at a norm (planner/parallel/context.py)."""
    unit = _sharded_norm_bytes(a, tokens, b)
    return unit - _split(unit, tp)


def _cast_norms(a: Architecture) -> tuple[int, int, int]:
    """(norms in the largest block, in all blocks, the final one) that SP shards: the Llama-style
    norms; a norm that multiplies in fp32 (OLMo-2, Gemma-3) is left whole (its sequence-parallel
    form is not what torchtitan ships)."""
    specs = layer_specs(a)
    per_block = [spec.norms if spec.norm_weight == "cast" else 0 for spec in specs]
    return max(per_block), sum(per_block), 1 if specs[-1].norm_weight == "cast" else 0


def loss_parallel_extra_bytes(rank: Architecture, tokens: int) -> int:
    """torch 2.13's loss_parallel backward (torch/distributed/tensor/parallel/loss.py,
    _nll_loss_and_log_softmax_backward) makes ``grad_input = zeros_like(x)``, then
    ``(grad_input + exp(x)) * grad_output``: three fp32 tokens x vocab/tp tensors live while the
    saved log-probabilities are, one more than the unsharded loss's two (activations.
    _loss_transient). Measured on CPU ranks: peak trace of the TP run shows aten::exp and
    aten::add of tokens x vocab/tp beside the zeros and the saved result."""
    return FP32 * tokens * rank.vocab_size


def replicated_embedding_gradient_elements(full: Architecture, tp: int) -> int:
    """Elements a TP-only rank's embedding gradient holds beyond the rank's shard: the whole
    vocabulary x hidden, where the parameter holds vocab/tp rows.

    torch 2.13's DTensor propagates aten.embedding_dense_backward with the single-dim strategies
    of tensor/_ops/_embedding_ops.py:62-97 (weight gradient Shard(1), or Partial) plus the all-
    Replicate one that _insert_single_dim_replication_strategy (single_dim_strategy.py:89-115)
    adds; none yields the Shard(0) of the vocab-parallel (RowwiseParallel) weight, and the
    replicated one is chosen: the output's gradient is all-gathered, and every rank computes the
    whole vocab x hidden gradient. AccumulateGrad stores it as the parameter's .grad as it is
    (placements are not checked), and nothing redistributes it before the optimizer's first op
    slices it locally (Replicate to Shard(0): no collective). Measured on CPU ranks (LLAMA_TP,
    tp 2, fp32, peak trace): EmbeddingBackward0 allocates 4 MiB (4,096 x 256 fp32) where the
    parameter holds 2 MiB, held between micro-batches and to the optimizer step; a 2-rank probe
    of RowwiseParallel shows grad.placements == (Replicate(),) with the whole table local.
    Under FSDP2 the post-backward redistributes it to the parameter's placements
    (fsdp/_fully_shard/_fsdp_param.py:934-966, _get_grad_inner_tensor), so only TP-only layouts keep it.
    A tied embedding (also the column-parallel LM head's weight) is not counted: not measured."""
    if tp == 1 or full.tie_word_embeddings:
        return 0
    return (full.vocab_size - _split(full.vocab_size, tp)) * full.hidden_size


def tp_only_gradient_items(point: SweepPoint, *, rank_elements: int, excess: int, grad_bytes: int,
                           accumulation: int) -> list[MemoryItem]:
    """The gradients of a TP-only rank (nothing wraps the model: each parameter's gradient is
    its DTensor's .grad) at one moment of backward, ``excess`` the embedding's replicated
    elements beyond its shard (replicated_embedding_gradient_elements), which exist once the
    embedding's backward has run (the end of backward).

    With gradient accumulation the micro-batches after the first run their forward and backward
    beside the gradients of those before, all of them (zero_grad comes only after the optimizer
    step): AccumulateGrad adds each new gradient in place into the existing .grad and drops it
    (torch 2.13 csrc/autograd/functions/accumulate_grad.h:85-99 and 238-252, ``variable_grad +=
    new_grad`` when grad mode is off), where the first micro-batch's was stolen as the .grad
    (accumulate_grad.h:188-200). So at every moment of a later micro-batch the rank holds the
    whole accumulated set, plus the new gradient being added where one is as large as a matrix
    of the vocabulary: the LM head's after its backward, the embedding's (replicated) at the end.
    A block's new gradients are added one tensor at a time and freed at once (not counted).
    Every later moment holds at least what the first micro-batch's does, so with accumulation
    the later micro-batches' phases are the ones listed (peak trace, LLAMA_TP tp 2 fp32 GA 4:
    micro-batch 1 peaks at 52,555,840 bytes, micro-batches 2-4 at 65,147,968, the difference
    the accumulated gradients to the byte: 10,494,976 of shards plus the embedding's 2,097,152
    replicated rows)."""
    if accumulation == 1:
        produced = point.grad_elements + (excess if point.kind is PhaseKind.END_OF_BACKWARD else 0)
        return [item("gradients (full)", grad_bytes * produced, "gradients")]
    new = {PhaseKind.AFTER_LM_HEAD: point.in_flight_elements,
           PhaseKind.END_OF_BACKWARD: point.in_flight_elements + excess}.get(point.kind, 0)
    return [item("gradients accumulated over the earlier micro-batches",
                 grad_bytes * (rank_elements + excess), "gradients",
                 "param.grad of every DTensor, kept to the optimizer step"),
            item("new gradient being added in place", grad_bytes * new, "gradients",
                 "AccumulateGrad: variable_grad += new_grad, then the new one is freed")]


def tp_activations(acts: Activations, full: Architecture, rank: Architecture, *, tp: int,
                   sequence_parallel: bool, tokens: int, b: int, vocab_parallel_loss: bool = True,
                   autocast: bool = False) -> Activations:
    """One TP rank's activations: ``acts`` are those of the narrower model (``rank``), with the
    loss's extra transient and, under SP, the norms' saved tensors and the checkpointed block
    inputs split over the sequence."""
    if tp == 1:
        return acts
    extra_loss = loss_parallel_extra_bytes(rank, tokens) if vocab_parallel_loss else 0
    layer_saved, kept, head = acts.layer_saved_bytes, acts.layer_kept_bytes, acts.head_saved_bytes
    block_sets, edges = acts.blocks, acts.edges
    final_norm_transient = acts.final_norm_transient_bytes
    items = list(acts.items)
    if sequence_parallel:
        unit = _sharded_norm_bytes(full, tokens, b, autocast and b != FP32)
        cut = unit - _split(unit, tp)
        largest, blocks, final = _cast_norms(full)
        layer_saved -= largest * cut
        head -= final * cut
        # block by block, as a pipeline stage reads them: each block's own Llama-style norms
        cut_of = {key: (spec.norms if spec.norm_weight == "cast" else 0) * cut
                  for key, spec in distinct_specs(full).items()}
        if len(cut_of) == 1:  # identical blocks (the plan search's common case): no per-layer loop
            block_sets = tuple(saved - next(iter(cut_of.values())) for saved in acts.blocks[:1]) * len(acts.blocks)
        else:
            block_sets = tuple(saved - cut_of[id(spec)] for saved, spec in zip(acts.blocks, layer_specs(full)))
        if edges is not None:
            edges = EdgeTerms(edges.embedding_saved, edges.final_norm_saved - final * cut, edges.loss_saved,
                              edges.rope_saved)
        # the final norm's backward runs on the rank's tokens / tp (a SequenceParallel norm)
        final_norm_transient = final_norm_transient_bytes(full, _split(tokens, tp))
        if acts.checkpointed:
            # the residual stream between blocks, each block's checkpointed input, is sequence-sharded
            kept = _split((FP32 if autocast and full.norm == "rmsnorm" else b) * tokens * full.hidden_size, tp)
        else:
            kept -= blocks * cut // acts.num_layers
        items.append(ActivationItem(f"sequence parallel: {blocks + final} norms' saved inputs split over "
                                    f"tp({tp})", -((blocks + final) * cut)))
    saved = acts.num_layers * kept + head
    loss_transient = acts.loss_transient_bytes + extra_loss
    if acts.checkpointed:
        peak_extra = max(loss_transient, layer_saved + acts.layer_transient_bytes)
    else:
        peak_extra = loss_transient
    if extra_loss:
        items.append(ActivationItem(f"loss_parallel backward: exp and sum of the vocab/tp({tp}) logits", extra_loss))
    return replace(acts, saved_bytes=saved, peak_extra_bytes=peak_extra, items=tuple(items),
                   layer_saved_bytes=layer_saved, layer_kept_bytes=kept, head_saved_bytes=head,
                   loss_transient_bytes=loss_transient, blocks=block_sets, edges=edges,
                   final_norm_transient_bytes=final_norm_transient)


def sequence_parallel_for(request, framework: "Framework") -> bool:
    """SP is on with tp by default (torchtitan's and Megatron's default); DeepSpeed's AutoTP
    splits the linear layers only and has no Megatron-style sequence parallelism (its "sequence
    parallel" is Ulysses, an all-to-all over heads), so there it is off and cannot be asked for."""
    asked = request.sequence_parallel
    if framework.autotp:
        if asked:
            raise PlannerError(f"sequence_parallel=true with strategy {request.strategy}: DeepSpeed's AutoTP "
                               "(tensor_parallel.autotp_size) splits linears only; torch (fsdp, hsdp, ddp with "
                               "torchtitan's SequenceParallel) shards the norms over the sequence",
                               field="sequence_parallel")
        return False
    return True if asked is None else bool(asked)


def tensor_parallel_fields(request, strategy, framework: "Framework", model, shard: int) -> dict:
    """Setup's TP fields for a request (empty when tp is 1): the rank's narrower model, SP, and
    the data-parallel shard group, which is what remains of the world once TP takes its ranks."""
    tp = request.tp
    if tp == 1 and request.tp_plan != "torchtitan":
        raise PlannerError(f"tp_plan={request.tp_plan} with tp=1: the plan is how tensor parallelism splits the "
                           "model; give tp > 1 or leave tp_plan at its default", field="tp_plan")
    if tp == 1:
        return {}
    if request.finetune != "full":
        raise PlannerError(f"tp={tp} with finetune {request.finetune}: LoRA/QLoRA under tensor parallelism is not "
                           "modelled (the adapters' split follows the base's); use tp 1", field="tp")
    arch = model.architecture
    if arch is None or model.traced is not None:
        raise PlannerError(f"tp={tp}: splitting layers over tensor-parallel ranks needs the architecture "
                           "(--model or --model-file), not "
                           + ("a traced profile" if model.traced is not None else "a parameter count alone"),
                           field="tp")
    if shard % tp:
        raise PlannerError(f"tp({tp}) must divide the data-parallel shard group of {strategy.name} ({shard} ranks): "
                           "tensor parallelism takes consecutive ranks inside it", field="tp")
    # DeepSpeed 0.19.8 trains AutoTP with every ZeRO stage: "AutoTP + ZeRO stage 3 is supported for
    # both inference and training" (runtime/engine.py, _configure_tensor_parallel_states), so no
    # stage is refused here; the ZeRO phases run on the TP rank's shards over the data-parallel ranks.
    # torch's loss_parallel keeps the logits vocab-sharded; DeepSpeed's AutoTP follows the model's
    # HuggingFace tp_plan (autotp_layout) and gathers the logits whole.
    if request.tp_plan == "transformers":
        return transformers_tp_fields(request, strategy, arch, shard)
    rank = rank_architecture(arch, tp)
    if framework.autotp:
        if getattr(request, "async_tp", False):
            raise PlannerError(f"async_tp=true with strategy {request.strategy}: DeepSpeed's AutoTP has no sequence "
                               "parallelism for async TP to pipeline; torch's TP (fsdp, hsdp, ddp) runs it",
                               field="async_tp")
        return {"sequence_parallel": sequence_parallel_for(request, framework), "vocab_parallel_loss": False,
                "rank_architecture": autotp_rank_architecture(arch, tp), **autotp_layout(arch, tp),
                "shard_size": shard // tp}
    return {"sequence_parallel": sequence_parallel_for(request, framework), "vocab_parallel_loss": True,
            "rank_architecture": rank, "shard_size": shard // tp}


def transformers_tp_fields(request, strategy, arch: Architecture, shard: int) -> dict:
    """Setup's TP fields for transformers' own plan (planner/parallel/hf_plan.py): the narrower rank
    with the whole vocabulary (the head's output is gathered), embedding and head split over their
    vocabulary rows, HF's loss on the whole logits, no sequence parallelism.

    accelerate 1.16 trains such a model TP-only (Accelerator.prepare_model: the multi-device DDP
    wrap is skipped when parallelism_config.tp_enabled, accelerator.py:1855) or with FSDP2 over
    dp_shard (ParallelismConfig: "If dp_replicate_size > 1 and tp_size > 1, dp_shard_size must also
    be greater than 1, as composing DDP + TP is currently not supported", parallelism_config.py:43;
    a DDP wrap of DTensor parameters raises, accelerator.py:1856-1858). DeepSpeed's AutoTP is its
    own layout (tp_plan torchtitan with a DeepSpeed strategy); the framework has refused what it
    does not train (Framework.check_tp_plan, asked by memory.orchestrator.resolve)."""
    tp = request.tp
    others = [f"{name}={getattr(request, name)}" for name in ("pp", "cp", "ep") if getattr(request, name) > 1]
    if others:
        raise PlannerError(f"tp_plan=transformers with {', '.join(others)}: transformers' TP is modelled alone or "
                           "with FSDP2 over the data-parallel ranks; use tp_plan torchtitan", field="tp_plan")
    dp = shard // tp
    if request.sequence_parallel:
        raise PlannerError("sequence_parallel=true with tp_plan=transformers: transformers' plans for the families "
                           "the planner reads name no sequence_parallel style (the norms run whole); use tp_plan "
                           "torchtitan", field="sequence_parallel")
    rank = hf_rank_architecture(arch, tp)
    split = 1 if arch.tie_word_embeddings else tp  # a tied head is the embedding's parameter
    return {"sequence_parallel": False, "vocab_parallel_loss": False, "rank_architecture": rank,
            "embedding_split": tp, "embedding_rows": True, "lm_head_split": split, "shard_size": dp}


def autotp_layout(arch: Architecture, tp: int) -> dict:
    """Which of the vocabulary-sized tensors DeepSpeed 0.19.8's AutoTP splits, and how.

    Every family the planner reads except GPT-2 and Falcon ships a HuggingFace tp_plan in
    transformers 5.24
    (``base_model_tp_plan`` in its configuration, ``_tp_plan = {"lm_head": "colwise_gather_output"}``
    on its ForCausalLM class, e.g. models/llama/modeling_llama.py:414), which AutoTP training follows
    before its name heuristics (runtime/engine.py:1055-1191, ``_get_hf_tp_plan`` and
    ``TPPlanConverter``). transformers' ``init_parallel_plans`` adds ``"embed_tokens":
    "embedding_rowwise"`` (distributed/mixin.py:93-94), which the converter turns into a SKIP spec
    (module_inject/tp_plan_converter.py:63, "embedding_rowwise" -> PartitionType.SKIP), so an untied
    input embedding stays whole; the LM head becomes a column-parallel LinearLayer with
    ``gather_output`` (auto_tp.py:601): vocab/tp of its rows per rank, its output all-gathered
    into the whole logits (layers.py:317-356, GatherFromTensorParallelRegion). Measured with the
    backend's peak trace (tp 2, ZeRO-2, vocabulary 4,096, fp32): the LM head's gradient is
    vocab/2 x hidden, the embedding's vocab x hidden. The parameter count per rank is the same as
    the heuristic split of the embedding along the hidden dimension, which is why ZeRO-1 matched
    either way; ZeRO-2's partitions, its first bucket and the logits' gather do not.

    A tied embedding is sharded with its head over the vocabulary and the loss computed vocab-
    parallel (runtime/engine.py:1112-1126, ``auto_vocab_parallel_lm_head``), and GPT-2 and Falcon
    (no tp_plan) go through the heuristic ``_slice_embedding`` (auto_tp.py:886, along the hidden
    dimension): for both the rank's tensor is modelled as the embedding split along the hidden
    dimension with the logits whole, the same parameter count; neither is verified on CPU ranks."""
    if arch.tie_word_embeddings or arch.model_type in NO_HF_TP_PLAN:
        return {"embedding_split": tp}
    return {"lm_head_split": tp}


# model_types whose transformers 5.24 classes define no tp_plan (models/gpt2, models/falcon: neither
# base_model_tp_plan nor _tp_plan), so AutoTP shards them by its name heuristics
NO_HF_TP_PLAN = frozenset({"gpt2", "falcon"})


def rank_numels(rank: Architecture, embedding_split: int, lm_head_split: int = 1, embedding_rows: bool = False) -> list[int]:
    """The parameter tensors one TP rank holds, in registration order: the rank model's, with the
    token embedding split along the hidden dimension (AutoTP) or over its vocabulary rows
    (``embedding_rows``: transformers' embedding_rowwise, the worst rank's ceil(vocab / tp) rows),
    and the untied LM head (registered last, architecture.parameter_numels) over its vocabulary
    rows, where the framework does so."""
    numels = parameter_numels(rank)
    if embedding_split > 1:
        at = len(rank.vision_numels)  # the token embedding follows the vision tower (parameter_numels)
        numels[at] = (_split(rank.vocab_size, embedding_split) * rank.hidden_size if embedding_rows
                      else _split(numels[at], embedding_split))
    if lm_head_split > 1:
        numels[-1] = _split(rank.vocab_size, lm_head_split) * rank.hidden_size
    return numels


def autotp_gather_held_bytes(full: Architecture, *, tokens: int, b: int, tp: int) -> int:
    """The two tensors of AutoTP's logits gather that gloo's worker thread can still hold after the
    gather returns: the rank's local logits (tokens x vocab/tp, the all-gather's input) and the
    gather buffer (tp x tokens x vocab/tp, its output), both in the compute dtype.

    GatherFromTensorParallelRegion.forward (deepspeed 0.19.8 module_inject/layers.py:352-356)
    allocates ``buffer = input.new_empty((tp_world_size * ...))``, calls
    ``dist.all_gather_into_tensor(buffer, input_padded)`` and returns ``torch.cat`` of the
    buffer's shards, so both are garbage once it returns, and on the main thread they are freed
    there. But gloo's AsyncWork holds its tensors (torch 2.13 c10d/ProcessGroupGloo.hpp:114,
    ``outputTensors_``, and the work's inputs) as long as the work lives, and the worker thread
    keeps the work in ``workInProgress_`` (ProcessGroupGloo.hpp:492) until it comes back to reset
    it, after completing the future that wakes the waiting main thread: on busy CPU ranks the
    main thread runs on into the loss first. Peak trace of
    llama-tp2-zero2-fp32-small-4ranks-s256 (two traced runs, the second with every step): on
    rank-steps where the release was late, no free of either tensor (2 MiB + 4 MiB) on the main
    thread, both still live at the loss's log_softmax or at the first op of its backward
    (nll_loss_backward), and gone before log_softmax's backward in every case; the step's peak was
    then that moment, 2 MiB above the start of backward."""
    local = _split(full.vocab_size, tp)
    return b * tokens * local * (1 + tp)


def gathered_logits_race_above(plan, setup, acts, held: int) -> int:
    """How far above the plan's peak a CPU rank can read when gloo's worker thread still holds
    ``held`` bytes of a gathered LM head's all-gather into the loss (a race between threads, not an
    allocation: see deepspeed_0_19._autotp_gather_held for where it was measured). The live set is
    the start of backward's without its activations' loss transient, plus the loss's larger moment
    (log_softmax's fp32 output, or the logits and their upcast), plus ``held``. 0 where none is above."""
    start = next((p for p in plan.phases if p.kind is PhaseKind.START_OF_BACKWARD), None)
    if start is None:
        return 0
    full, req, b = setup.model.architecture, setup.request, setup.recipe.compute_bytes
    logits = req.micro_batch * req.seq_len * full.vocab_size
    at_loss = max(FP32 * logits, b * logits + (FP32 * logits if b != FP32 else 0))
    others = sum(i.bytes for i in start.items if i.component != "activations")
    return max(0, others + acts.saved_bytes + at_loss + held - max(p.bytes for p in plan.phases))


# sequence parallelism's rows: per micro-batch, each block's all-gathers (reduce-scatters) in forward, backward
# and a full checkpoint's recompute, then the vocab-parallel embedding's and LM head's (step.py's async TP pairs
# each block's with the matmul it feeds or is fed by)
SP_GATHER_ROW = "TP all-gathers (sequence parallel)"
SP_SCATTER_ROW = "TP reduce-scatters (sequence parallel)"
# the loss's all-reduces: on the rank that computes the loss (a pipeline's last stage), whole
LOSS_PARALLEL_ROW = "TP all-reduces of loss_parallel (logits' max, sum of exponentials, target logit)"


def tp_collectives(full: Architecture, *, tokens: int, micro_batches: float, b: int, tp: int,
                   sequence_parallel: bool, checkpointing: str,
                   vocab_parallel_loss: bool = False, loss_chunks: int = 1) -> list[tuple[str, float, int, float]]:
    """(what, bytes per step, ring passes, message bytes) of the TP group's collectives.

    Megatron's f/g conjugate operators (Shoeybi et al. 2019, Sec. 3, Fig. 3): every block
    reduces the row-parallel outputs of attention and MLP in forward and the column-parallel
    inputs' gradients in backward, each a tokens x hidden activation: 4 all-reduces per block and
    micro-batch, 6 with full checkpointing (the recomputed forward reduces again). Sequence
    parallelism replaces each all-reduce by an all-gather plus a reduce-scatter of the same tensor
    (Korthikanti et al. 2022, Sec. 4.2.2): the same bytes on the wire (a ring all-reduce is a
    reduce-scatter then an all-gather). The vocab-parallel embedding and LM head add one each way.
    None of it overlaps compute: each is on the critical path of its layer, unless async TP (the
    request's async_tp: torchtitan's compile.enable_async_tensor_parallel, Megatron's --tp-comm-overlap)
    pipelines the sequence-parallel rows with their matmuls (planner/time/step.py _async_tp_seconds).

    ``vocab_parallel_loss``: torch's loss_parallel (torch 2.13 distributed/tensor/parallel/loss.py)
    all-reduces one fp32 value per token three times in the loss's forward, each between the
    loss's kernels: the logits' max (_log_softmax :209, MAX) and the sum of exponentials (:214,
    SUM), the target's logit (_nll_loss_forward :316, _MaskPartial._reduce_value, SUM); its
    backward (_nll_loss_and_log_softmax_backward) is local. Small messages: their latency, three per
    micro-batch, is most of their time. The loss is not inside a checkpointed block: none again.
    ``loss_chunks``: torchtitan's ChunkedLossWrapper computes the loss a chunk of the sequence at a
    time (its _LossParallelCrossEntropy: the same three all-reduces), so the same bytes go in that
    many times more messages."""
    if tp == 1:
        return []
    activation = b * tokens * full.hidden_size
    per_block = 6 if checkpointing == "full" else 4
    count = (full.num_layers * per_block + 2) * micro_batches
    loss = [(LOSS_PARALLEL_ROW,
             3 * micro_batches * FP32 * tokens, 2, FP32 * tokens / loss_chunks)] if vocab_parallel_loss else []
    if sequence_parallel:
        return [(SP_GATHER_ROW, count * activation, 1, activation),
                (SP_SCATTER_ROW, count * activation, 1, activation)] + loss
    return [("TP all-reduces", count * activation, 2, activation)] + loss
