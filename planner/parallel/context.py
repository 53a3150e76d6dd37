"""Context parallelism: each rank of a cp group holds 2 chunks of every sequence (load-balanced
ring attention), so everything per token is 1/cp of the sequence; attention exchanges K/V.

The realisation is torch's ``context_parallel`` (torch 2.13,
torch/distributed/tensor/experimental/_context_parallel/_attention.py) as torchtitan applies it
(FSDP2 then shards over dp_shard x cp, parallel_dims.py ``dp_shard_cp``):

- the sequence is cut into 2*cp chunks and rank r keeps chunks r and 2*cp-1-r
  (_load_balancer.py, the round-robin "head-tail" layout that evens out the causal mask's work),
  hence seq_len % (2*cp) == 0;
- forward (_templated_ring_attention): the local K and V are concatenated into one buffer and,
  with the default rotate method ALL_GATHER (_ContextParallelOptions.rotate_method), all-gathered
  once: the whole sequence's K and V live while the layer's attention runs;
- backward (_templated_ring_attention_backward): the K/V buffer is gathered again, the gradients
  of q, k and v are accumulated in fp32 (convert_to_f32, zeros_like(..., dtype=float32)) and the
  K/V gradients rotate with all-to-all (dkv_rotater), two chunks' worth in flight.

The ring dispatch covers the flash, efficient and cuDNN SDPA kernels only (the _attention.py op
table), i.e. CUDA; on CPU torch 2.13 stops at ``_scaled_dot_product_flash_attention_for_cpu``
("does not have a sharding strategy registered"). verify gives that kernel to the same ring
(backend/context_parallel.py: torch's _templated_ring_attention and its buffers, CPU's flash kernel
in each ring step), and the saved copy and backward transient below were found with its peak traces.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from planner.model.activations import FP32, ActivationItem, Activations
from planner.model.architecture import Architecture, distinct_specs
from planner.model.attention.kinds import kind_of
from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.frameworks.base import Framework
    from planner.strategies import Strategy


def check_context_parallel(cp: int, framework: "Framework", strategy: "Strategy", attention: str,
                           arch: Architecture | None) -> None:
    if cp == 1:
        return
    framework.check_context_parallel(strategy, cp)
    if attention != "sdpa":
        raise PlannerError(f"cp={cp} with attention {attention}: ring attention replaces SDPA's flash/efficient/cuDNN "
                           "kernels; use attention sdpa", field="cp")
    if arch is None:
        raise PlannerError(f"cp={cp}: splitting the sequence needs the architecture (--model or --model-file)",
                           field="cp")
    for spec in distinct_specs(arch).values():
        attn = spec.attention
        kind = kind_of(attn)
        if not kind.ring_attention or attn.sinks or attn.window != "full" or attn.logit_softcap:
            what = (kind.short if not kind.ring_attention else "attention sinks" if attn.sinks else
                    f"{attn.window} attention" if attn.window != "full" else "attention logit soft-capping")
            raise PlannerError(f"cp={cp}: {what} is not what torch's ring attention computes (plain causal SDPA); "
                               "this model cannot be context-parallel", field="cp")


def ring_attention_transient_bytes(a: Architecture, tokens: int, cp: int, b: int, device: str = "cuda") -> int:
    """What torch 2.13's ``_templated_ring_attention_backward`` holds at its largest (the kernel of
    the last ring step running), for the widest layer; ``tokens`` the whole sequence's, b the
    compute dtype's bytes:

    - ``grad_query/grad_key/grad_value = zeros_like(..., dtype=float32)``: fp32 q/k/v accumulators
      over the rank's tokens (convert_to_f32);
    - ``key.contiguous(), value.contiguous()``: copies of the saved K and V, which are transposed
      views in the model's (batch, seq, heads, dim) storage;
    - ``next_kv = torch.cat([key.flatten(), value.flatten()])`` and the ALL_GATHER rotater's
      ``all_gather_single`` of it: the local K/V buffer and the whole sequence's K and V;
    - the dkv rotater (always ALL_TO_ALL): the fp32 K/V gradients concatenated and the buffer
      ``permute_tensor`` received, two local K/V's worth in fp32;
    - one ring step's kernel gradients (q, k and v, compute dtype);
    - on CPU ranks in a 16-bit dtype, ``grad_query += grad_query_`` (an fp32 accumulator, a 16-bit
      step gradient) first copies the step gradient to fp32: TensorIterator promotes a CPU op's
      inputs to the common dtype by temporaries (torch 2.13 aten/src/ATen/TensorIterator.cpp
      compute_types, "Creates temporaries for CPU operations"); CUDA casts inside the kernel. It
      is made after the K/V gradients' all-to-all, when the rotating gradients above are live
      (peak trace, bf16 cp 2 x tp 2: 524,288 bytes, the rank's q gradient in fp32, at the peak).

    Measured on CPU ranks with the peak trace (llama 4 heads x 64, fp32, 4,096 tokens over cp 2:
    39.9 MB at the ring's peak over the block's state; these terms 37.7 MB plus the incoming
    gradients counted by cp_activations)."""
    local = tokens // cp
    q_width, kv_width = max((spec.attention.q_width, spec.attention.kv_width) for spec in distinct_specs(a).values())
    accumulators = FP32 * local * (q_width + 2 * kv_width)
    contiguous_kv = b * local * 2 * kv_width
    local_kv = b * local * 2 * kv_width
    gathered_kv = b * tokens * 2 * kv_width
    rotating_grads = 2 * FP32 * local * 2 * kv_width
    step_grads = b * local * (q_width + 2 * kv_width)
    promoted_q = FP32 * local * q_width if device == "cpu" and b != FP32 else 0
    return accumulators + contiguous_kv + local_kv + gathered_kv + rotating_grads + step_grads + promoted_q


def gloo_ring_scratch_bytes(a: Architecture, tokens: int, b: int) -> int:
    """On CPU ranks: gloo's scratch copy of the ring's K/V all-gather output (the whole sequence's
    K and V in the compute dtype), which its worker thread holds until the collective completes
    (ProcessGroupGloo's AsyncWork keeps its tensors: torch 2.13 c10d/ProcessGroupGloo.hpp:114, the
    same scratch FSDP2's all-gathers show, planner/frameworks/torch/v2.py). In backward the main
    thread runs the first ring step's kernel and the K/V gradients' all-to-all meanwhile; whether
    the worker has let go by then is a race between threads, so it is a note (memory._notes), not a
    term. Peak traces (llama 4 x 64 heads, fp32, 2,048 tokens, cp 2 x tp 2, rank 0, block 4's
    backward): in one run gloo freed its 2 MiB during the kernel (peak 68,399,040: the kernel's
    per-thread buffer, 2 x 256 x 512 fp32, FlashAttentionKernel.cpp cpu_flash_attention_backward,
    over the scratch); in a second traced run only after the all-to-all's output was allocated
    (69,446,592, the peak all three untraced runs measured: 67,349,440 without the scratch, which
    the block's modelled ring phase, 67,710,976, holds with 361,536 bytes to spare). In bf16 the
    same (43,937,216, the scratch 1 MiB). At 4,096 tokens over cp 2 alone the traced ring peak had
    no room for its 8 MiB scratch (a causal kernel over 2,048 local tokens x 4 heads: 8x the work).
    Checkpointed (fp32, cp 2 x tp 2, two traced runs, block 2's ring): every rank's peak held the
    scratch (ranks 2-3 35,754,816 in both), but rank 1's worker let go before the all-to-all in the
    second run (34,706,240, its peak at the kernel's buffer, against 35,492,608 in the first); a
    re-measure of the untraced fp32 run read 68,399,040, the low outcome, where its record has
    69,446,592. Over dp_shard 2 x cp 2 x tp 2 (8 ranks, fp32, 1,024 tokens, one traced run) both
    outcomes at once: ranks 0 and 5 held the 1 MiB scratch at their peak (37,098,704), ranks 1 and 4,
    their cp peers, had let go (36,445,648; the estimate 36,427,776)."""
    kv_width = max(spec.attention.kv_width for spec in distinct_specs(a).values())
    return b * tokens * 2 * kv_width


def merged_output_copy_bytes(a: Architecture, local_tokens: int, b: int) -> int:
    """Per layer, on every cp rank but the last: a second copy of the attention output.
    ``_SDPAMerger`` assembles a load-balanced rank's output with ``_partial_update`` (torch.cat
    along the sequence: a contiguous (batch, heads, seq, dim) tensor, saved by the attention's
    autograd node), where the kernel's own output is a transposed view of (batch, seq, heads, dim)
    storage; the model's ``attn_output.transpose(1, 2).contiguous()`` (transformers
    sdpa_attention_forward, torchtitan's attention alike) then copies it, and o_proj saves the copy.
    Rank cp-1 never takes the partial branch (i > rank) and shares one tensor, as without cp.
    Measured on CPU ranks: rank 0 saves 2 x 2.1 MB per layer, rank 1 2.1 MB (4,096 tokens, cp 2)."""
    return max(b * local_tokens * spec.attention.q_width for spec in distinct_specs(a).values())


def _freed_before_attention_bytes(a: Architecture, local_tokens: int, b: int, sp_cut: int = 0,
                                  fused: tuple[str, ...] = ()) -> int:
    """What a block's backward has freed when it reaches the attention: the MLP's saved tensors and
    the post-attention norm's (dense MLPs and compute-dtype norms; nothing assumed freed for MoE
    blocks or fp32-weight norms). ``sp_cut``: what sequence parallelism took off that norm's saved
    set (tensor_parallel.tp_activations: its fp32 input, ``x * rsqrt`` and rsqrt hold 1/tp of the
    tokens; its all-gathered output, saved by the MLP's linears, stays whole), so not freed here."""
    from planner.model.activations import gated_tensors, norm_saved_bytes

    freed = []
    for spec in distinct_specs(a).values():
        gated = gated_tensors(fused) if spec.mlp.gated else 2
        mlp = 0 if spec.mlp.is_moe else gated * b * local_tokens * spec.mlp.intermediate_size
        norm = norm_saved_bytes(a, local_tokens, b, fused) - sp_cut if spec.norm_weight != "float" else 0
        freed.append(mlp + norm)
    return min(freed)


def cp_activations(acts: Activations, a: Architecture, *, cp: int, tokens: int, b: int, tp: int = 1,
                   sequence_parallel: bool = False, device: str = "cuda", fused: tuple[str, ...] = ()) -> Activations:
    """``acts`` computed at seq_len / cp (the rank's two chunks), with ring attention's saved copy
    (merged_output_copy_bytes) and its backward transient: in a block's backward the attention comes
    after the MLP has freed its saved tensors, with the gradient flowing in (tokens x hidden) and
    that of the attention output live; the block's transient is the larger of the MLP's and this.
    ``a`` is the model one TP rank runs. Under sequence parallelism (cp x tp) the residual stream's
    gradient is sequence-sharded (tokens/tp x hidden) and the post-attention norm freed only what
    SP left of it (peak trace, llama 4 x 64 heads, fp32, 2,048 tokens, cp 2 x tp 2, at the start of
    block 4's ring: the residual gradient 524,288 bytes, the norm's shard and its gathered output
    freed with the MLP's 7,733,248 bytes)."""
    if cp == 1:
        return acts
    from planner.parallel.tensor import sequence_parallel_norm_cut_bytes

    local = tokens // cp
    copy = merged_output_copy_bytes(a, local, b)
    ring = ring_attention_transient_bytes(a, tokens, cp, b, device)
    q_width = max(spec.attention.q_width for spec in distinct_specs(a).values())
    stream_tokens, sp_cut = local, 0
    if sequence_parallel and tp > 1:
        stream_tokens = -(-local // tp)  # DTensor's Shard: ceil(n / tp) on the first ranks
        sp_cut = sequence_parallel_norm_cut_bytes(a, local, b, tp)  # no fused norm under tp (check_fused_kernels)
    attention_phase = (b * (stream_tokens * a.hidden_size + local * q_width) + ring
                       - _freed_before_attention_bytes(a, local, b, sp_cut, fused))
    transient = max(acts.layer_transient_bytes, attention_phase)
    if acts.checkpointed:  # the copy exists in the recomputed layer only
        saved, layer_saved, kept = acts.saved_bytes, acts.layer_saved_bytes + copy, acts.layer_kept_bytes
    else:
        saved = acts.saved_bytes + a.num_layers * copy
        layer_saved, kept = acts.layer_saved_bytes + copy, acts.layer_kept_bytes + copy
    recompute = layer_saved if acts.checkpointed else 0
    peak_extra = max(acts.loss_transient_bytes, recompute + transient) if acts.checkpointed else \
        max(acts.peak_extra_bytes, transient)
    items = acts.items + (
        ActivationItem(f"ring attention's merged output, copied by the model (cp ranks but the last; "
                       f"{a.num_layers} layers)", 0 if acts.checkpointed else a.num_layers * copy),
        ActivationItem(f"ring attention backward over cp({cp}): fp32 q/k/v gradient accumulators, the whole "
                       "sequence's K/V gathered, rotating fp32 K/V gradients", ring))
    # each block's whole saved set gains the copy (a pipeline stage's share, and the set a
    # checkpointed block recomputes); under checkpointing what it keeps is still its input
    blocks = tuple(block + copy for block in acts.blocks)
    return replace(acts, saved_bytes=saved, layer_saved_bytes=layer_saved, layer_kept_bytes=kept,
                   layer_transient_bytes=transient, peak_extra_bytes=peak_extra, items=items, blocks=blocks)


def cp_collectives(a: Architecture, *, tokens: int, micro_batches: float, b: int, cp: int,
                   tp: int = 1, checkpointing: str = "none") -> list[tuple[str, float, int, float]]:
    """(what, bytes per step, ring passes, message bytes) of the CP group's K/V exchange: per layer
    and micro-batch, the whole sequence's K and V gathered in forward and again in backward
    (ALL_GATHER rotation), once more in the recomputed forward under full checkpointing (measured:
    12 all-gathers per step over 4 layers, 8 without), and the fp32 K/V gradients sent back around
    the ring in backward (dkv_rotater: each rank's chunk passes cp-1 peers, what a reduce-scatter
    moves). ``a`` is the model one TP rank runs, so the K/V widths are already 1/tp."""
    if cp == 1:
        return []
    kv_width = max(spec.attention.kv_width for spec in distinct_specs(a).values())
    kv = 2 * tokens * kv_width
    layers = a.num_layers * micro_batches
    gathers = 3 if checkpointing == "full" else 2
    what = "forward, recomputed forward and backward" if gathers == 3 else "forward and backward"
    return [(f"CP K/V all-gathers ({what})", gathers * layers * b * kv, 1, b * kv),
            ("CP K/V gradient ring (fp32)", layers * FP32 * kv, 1, FP32 * kv)]
