"""Context parallelism on CPU ranks: torch 2.13's own ring attention, given CPU's SDPA kernel
(imported only inside a launched rank).

torch's ``context_parallel`` (torch/distributed/tensor/experimental/_context_parallel/_attention.py)
monkey-patches ``F.scaled_dot_product_attention`` so that q, k and v become DTensors sharded on the
sequence (Shard(2)) over the CP mesh; SDPA then decomposes into one backend kernel, and DTensor's
dispatcher hands that kernel to ``_sdpa_handler`` (its ``custom_ops`` table), which runs
``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the same kernel on the
local chunks. The table and the Shard(2) sharding rules (_sharding_rules.py
``register_cp_sharding_rules``) list the flash, efficient and cuDNN kernels only: all CUDA. On CPU,
SDPA decomposes into ``aten._scaled_dot_product_flash_attention_for_cpu`` and torch 2.13 stops with

    NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
    have a sharding strategy registered.

(``CPU_KERNEL_ERROR``; tests/test_context_parallel_backend.py shows it on two gloo ranks).

This module adds the CPU kernel to the same two extension points torch uses for the CUDA ones, and
nothing else:

- a sharding strategy for the CPU op and its backward (``register_op_strategy``, as
  _sharding_rules.py registers the flash rule): q, k, v, out, logsumexp and the gradients all
  Shard(2);
- an entry in DTensor's ``_custom_op_handlers`` for each (as ``_enable_cp_dtensor_dispatcher``
  installs ``custom_ops``), whose handler is ``_sdpa_handler``'s body calling torch's
  ``_templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu, ...)`` and
  ``_templated_ring_attention_backward(..., aten._scaled_dot_product_flash_attention_for_cpu_backward)``.

What then runs is torch's algorithm and torch's buffers: the head-tail load balancer's sharding of
the inputs (_load_balancer.py), the rotater (ALL_GATHER by default: the whole sequence's K/V
concatenated and all-gathered; ALL_TO_ALL with ``set_rotate_method("alltoall")``), ``_SDPAMerger``'s
fp32 merge of the partial outputs by their log-sum-exp, backward's fp32 q/k/v gradient
accumulators and the K/V gradients rotated by all-to-all. What differs from CUDA is the kernel each
ring step calls: CPU's flash kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) returns the
same (out, logsumexp) pair (logsumexp [B, H, L] fp32, as flash's) and its backward the q/k/v
gradients; what autograd saves for backward is the same set (q, k, v, out, logsumexp; CUDA flash
also keeps its philox seed/offset and cumulative-length scalars).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from backend.train_parallel import ParallelEngine

CPU_KERNEL_ERROR = ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a "
                    "sharding strategy registered")

aten = torch.ops.aten
RING_ATTENTION = "context_parallel_sdpa"  # the attention implementation's name in transformers' registry
SEQ_DIM = 2  # (batch, heads, sequence, head_dim), as torch's CP hard-codes it ("seq_dim = 2")


def _forward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    mesh = op_schema.get_mesh_from_args()
    # outputs (out, logsumexp), then the tensor inputs (q, k, v); attn_mask is refused below
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 5], input_index=2)


def _backward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    mesh = op_schema.get_mesh_from_args(validate=False)
    # outputs (grad q, k, v), then (grad_out, q, k, v, out, logsumexp)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 9], input_index=3)


def _ring_forward(mesh, query, key, value, dropout_p: float = 0.0, is_causal: bool = False, *,
                  attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None:
        raise NotImplementedError("context parallelism runs causal SDPA without an attention mask")
    return _templated_ring_attention(mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
                                     query=query, key=key, value=value, is_causal=is_causal,
                                     dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p: float, is_causal: bool, *,
                   attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward)

    if attn_mask is not None:
        raise NotImplementedError("context parallelism runs causal SDPA without an attention mask")
    return _templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value, out=out,
        logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


RING = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _ring_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _ring_backward,
}


def _cpu_sdpa_handler(op_call, args, kwargs):
    """torch's ``_sdpa_handler`` with the CPU kernel's entries: unwrap the DTensors, propagate
    their (Shard(2)) sharding, run the ring on the local tensors, wrap the results."""
    from torch.distributed.tensor import DTensor

    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise AssertionError(f"{op_call}: q, k and v must all be sharded on the sequence (Shard(2))")
    local = RING[op_call](op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return DTensor._op_dispatcher.wrap(local, output_sharding.output_spec)


@contextmanager
def cpu_ring_attention():
    """While open, torch's context parallel dispatches CPU's SDPA kernel to its ring attention.
    Entered inside ``context_parallel(...)``, which installs its own table on entry and, on exit,
    the table it captured at import (``existing_custom_ops``); removed on exit here too, with the
    strategies restored, leaving DTensor as it was."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops.utils import register_op_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    strategies = {aten._scaled_dot_product_flash_attention_for_cpu.default: _forward_strategy,
                  aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _backward_strategy}
    saved = {op: (propagator.op_strategy_funcs.get(op), propagator.op_to_schema_info.get(op)) for op in strategies}
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op, strategy in strategies.items():
        register_op_strategy(op)(strategy)
    DTensor._op_dispatcher._custom_op_handlers = {**handlers, **{op: _cpu_sdpa_handler for op in RING}}
    try:
        yield
    finally:
        DTensor._op_dispatcher._custom_op_handlers = {
            op: h for op, h in DTensor._op_dispatcher._custom_op_handlers.items() if op not in RING}
        for op, (func, schema) in saved.items():
            for table, value in ((propagator.op_strategy_funcs, func), (propagator.op_to_schema_info, schema)):
                if value is None:
                    table.pop(op, None)
                else:
                    table[op] = value


class ContextParallelLM(torch.nn.Module):
    """The transformers model and its loss under context parallelism: the rank's load-balanced
    chunks of the tokens, of the labels (shifted by one before sharding, as torchtitan's batches
    are: inputs tokens[:-1], labels tokens[1:]) and of the positions, so that RoPE sees each token's
    place in the whole sequence. Mean cross-entropy over the rank's tokens (torchtitan's per-rank
    loss; FSDP2's reduce-scatter over dp_shard x cp averages the gradients). One module, so that
    FSDP2's root unit is gathered by the root's own hooks (as CausalLMWithParallelLoss)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        # transformers' own SDPA attention under a name that has no mask function: the model then
        # passes no mask and SDPA runs is_causal (what the ring needs, and what the model does at
        # one rank). Under "sdpa" the rank's head-tail positions (0..c-1, then a jump) read as packed
        # sequences (masking_utils.find_packed_sequence_indices) and a block mask would be built.
        AttentionInterface.register(RING_ATTENTION, sdpa_attention_forward)
        lm.set_attn_implementation(RING_ATTENTION)
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, shifted_labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        hidden = self.lm.model(input_ids=input_ids, position_ids=positions).last_hidden_state
        logits = self.lm.lm_head(hidden)
        with loss_parallel():  # a no-op on plain logits; the vocab-sharded DTensor's loss with tp
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shifted_labels.flatten(),
                                                     ignore_index=-100)


class ContextParallelEngine(ParallelEngine):
    """A CP (x TP, x FSDP2) model (ContextParallelLM). Each micro-batch's forward and backward run
    inside torch's ``context_parallel`` (torchtitan's train step: ``with train_context(cp_ctx): pred =
    model(...); loss.backward()``): the context opens in the forward call and closes after backward
    (ParallelEngine's, under loss_parallel)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, cp_mesh, **options):
        super().__init__(module, optimizer, **options)
        self.cp_mesh = cp_mesh
        self._open = None

    def __call__(self, *, input_ids: torch.Tensor, labels: torch.Tensor):
        from contextlib import ExitStack
        from types import SimpleNamespace

        from torch.distributed.tensor.experimental import context_parallel

        if self._open is not None:
            raise RuntimeError("a CP forward before the previous micro-batch's backward")
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        input_ids = input_ids.clone()  # sharded in place by context_parallel; labels may be the same tensor
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        buffers = [input_ids, shifted, positions]
        stack = ExitStack()
        # shards the three buffers in place with the head-tail load balancer (2 * cp chunks, rank r
        # keeps r and 2cp-1-r) and patches F.scaled_dot_product_attention for the ring
        stack.enter_context(context_parallel(self.cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                             no_restore_buffers=set(buffers)))
        if self.device.type == "cpu":
            stack.enter_context(cpu_ring_attention())
        self._open = stack
        try:
            with self.autocast():
                return SimpleNamespace(loss=self.module(input_ids, shifted, positions))
        except BaseException:
            self._close()
            raise

    def _close(self) -> None:
        stack, self._open = self._open, None
        if stack is not None:
            stack.close()

    def backward(self, loss: torch.Tensor) -> None:
        try:
            super().backward(loss)
        finally:
            self._close()


def count_ring_collectives(counter) -> None:
    """Count the ring's K/V gradient rotation (``_AllToAllRotater``: funcol.permute_tensor, an
    all-to-all in which each rank sends its buffer to the next) beside its K/V all-gathers, which
    count_dtensor_collectives already sees (``ft_c.all_gather_single``, "all_gather_single
    (DTensor)"). Bytes: the buffer one rank sends."""
    import torch.distributed._functional_collectives as funcol

    original = funcol.permute_tensor
    if getattr(original, "_planner_counted", False):
        return

    def counted(tensor, *args, **kwargs):
        if counter.on:
            counter.add("permute_tensor (CP K/V gradient ring)", int(tensor.numel() * tensor.element_size()))
        return original(tensor, *args, **kwargs)

    counted._planner_counted = True
    funcol.permute_tensor = counted
