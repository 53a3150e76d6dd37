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
table), i.e. CUDA; CPU's SDPA kernel is not sharded, so verify cannot run CP on CPU ranks.
"""

from __future__ import annotations

from dataclasses import replace

from planner.activations import FP32, ActivationItem, Activations
from planner.architecture import Architecture, distinct_specs
from planner.errors import PlannerError


def check_context_parallel(cp: int, framework: str, strategy: str, attention: str, arch: Architecture | None) -> None:
    if cp == 1:
        return
    if framework != "torch":
        raise PlannerError(f"cp={cp} with strategy {strategy}: DeepSpeed 0.19.8 has no ring/context parallelism "
                           "(its sequence parallelism is Ulysses all-to-all over heads); torch's context_parallel "
                           "with FSDP2 (strategy fsdp or hsdp, torchtitan) splits the sequence", field="cp")
    if strategy == "ddp":
        raise PlannerError(f"cp={cp} with strategy ddp: torchtitan shards the parameters over dp_shard x cp with "
                           "FSDP2 whenever cp > 1 (parallel_dims.py fsdp_enabled); use fsdp or hsdp", field="cp")
    if attention != "sdpa":
        raise PlannerError(f"cp={cp} with attention {attention}: ring attention replaces SDPA's flash/efficient/cuDNN "
                           "kernels; use attention sdpa", field="cp")
    if arch is None:
        raise PlannerError(f"cp={cp}: splitting the sequence needs the architecture (--model or --model-file)",
                           field="cp")
    for spec in distinct_specs(arch).values():
        attn = spec.attention
        if attn.kind == "mla" or attn.sinks or attn.window != "full" or attn.logit_softcap:
            what = ("MLA" if attn.kind == "mla" else "attention sinks" if attn.sinks else
                    f"{attn.window} attention" if attn.window != "full" else "attention logit soft-capping")
            raise PlannerError(f"cp={cp}: {what} is not what torch's ring attention computes (plain causal SDPA); "
                               "this model cannot be context-parallel", field="cp")


def ring_attention_transient_bytes(a: Architecture, tokens: int, cp: int, b: int) -> int:
    """The largest transient of one layer's ring attention, on top of its saved set: backward's
    fp32 q/k/v gradient accumulators over the rank's tokens, the re-gathered K/V of the whole
    sequence, and the K/V gradients rotating (all-to-all, two chunks in flight)."""
    local = tokens // cp
    widest = max((spec.attention.q_width, spec.attention.kv_width) for spec in distinct_specs(a).values())
    q_width, kv_width = widest
    accumulators = FP32 * local * (q_width + 2 * kv_width)
    gathered_kv = b * tokens * 2 * kv_width
    rotating_grads = 2 * FP32 * local * 2 * kv_width
    return accumulators + gathered_kv + rotating_grads


def cp_activations(acts: Activations, a: Architecture, *, cp: int, tokens: int, b: int) -> Activations:
    """``acts`` computed at seq_len / cp (the rank's two chunks), with ring attention's transient
    added to the block backward's."""
    if cp == 1:
        return acts
    ring = ring_attention_transient_bytes(a, tokens, cp, b)
    transient = acts.layer_transient_bytes + ring
    recompute = acts.layer_saved_bytes if acts.checkpointed else 0
    peak_extra = max(acts.loss_transient_bytes, recompute + transient) if acts.checkpointed else \
        max(acts.peak_extra_bytes, transient)
    items = acts.items + (ActivationItem(f"ring attention over cp({cp}): whole-sequence K/V gathered, fp32 q/k/v "
                                         "gradient accumulators, rotating K/V gradients", ring),)
    return replace(acts, layer_transient_bytes=transient, peak_extra_bytes=peak_extra, items=items)


def cp_collectives(a: Architecture, *, tokens: int, micro_batches: float, b: int, cp: int,
                   tp: int = 1) -> list[tuple[str, float, int, float]]:
    """(what, bytes per step, ring passes, message bytes) of the CP group's K/V exchange: per layer
    and micro-batch, the whole sequence's K and V gathered in forward and again in backward
    (ALL_GATHER rotation), and the fp32 K/V gradients sent back around the ring in backward
    (dkv_rotater: each rank's chunk passes cp-1 peers, what a reduce-scatter moves). ``a`` is the
    model one TP rank runs, so the K/V widths are already 1/tp."""
    if cp == 1:
        return []
    kv_width = max(spec.attention.kv_width for spec in distinct_specs(a).values())
    kv = 2 * tokens * kv_width
    layers = a.num_layers * micro_batches
    return [("CP K/V all-gathers (forward and backward)", 2 * layers * b * kv, 1, b * kv),
            ("CP K/V gradient ring (fp32)", layers * FP32 * kv, 1, FP32 * kv)]
