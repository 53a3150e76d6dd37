"""The activation checkpointing policies a rank runs beyond transformers' own (imported only inside
a rank): torchtitan's per-op selective checkpointing and Megatron's core-attention recompute, on
the transformers model the rank builds (backend/train.py build_model)."""

from __future__ import annotations

import functools
import sys

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
MM_OPS = (aten.mm.default, aten.linear.default)


@functools.cache
def save_ops() -> frozenset:
    """torchtitan's save list (b5bcd76, Aug 2026, distributed/activation_checkpoint.py
    _get_default_save_ops): the partitioner's compute-intensive ops, the SDPA variants, max, linear,
    topk, the reduce-scatter and all-to-all of _c10d_functional; and CPU's flash-attention kernel,
    the CPU ranks' twin of the CUDA flash op in that list (without it a CPU run would recompute
    attention where a GPU run keeps it)."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
            aten._scaled_dot_product_fused_attention_overrideable.default, aten.max.default, aten.linear.default,
            aten.topk.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    return frozenset(ops)


def _selective_op_policy():
    """SelectiveAC's policy: every listed op MUST_SAVE but every second mm/linear, counted per
    block forward and per recompute apart."""
    counts = {"forward": 0, "recompute": 0}
    saved = save_ops()

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if func in MM_OPS:
            counts[key] += 1
        if func in saved:
            if func in MM_OPS and counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_op_context():
    """checkpoint(..., context_fn=selective_op_context): a fresh policy (fresh counts) per block call."""
    return create_selective_checkpoint_contexts(_selective_op_policy())


CORE_RECOMPUTE = "planner_core_recompute_"  # + the attention implementation it wraps


def core_attention_recompute(implementation: str) -> str:
    """Register (once) an attention implementation that runs ``implementation``'s attention core
    (sdpa, or the family's eager_attention_forward) under a non-reentrant checkpoint, as Megatron's
    --recompute-granularity selective checkpoints core attention; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = CORE_RECOMPUTE + implementation

    def forward(module, query, key, value, attention_mask, **kwargs):
        if implementation == "eager":
            core = sys.modules[type(module).__module__].eager_attention_forward
        else:
            core = ALL_ATTENTION_FUNCTIONS[implementation]
        return checkpoint(functools.partial(core, module, **kwargs), query, key, value, attention_mask,
                          use_reentrant=False)

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name
