"""Tensor (and sequence) parallelism composed with FSDP2 on one rank (imported only inside a launched rank).

The layout torchtitan applies to its llama (torchtitan/models/llama3/infra/parallelize.py,
``apply_tp``), here on the transformers llama-shaped decoder the planner's probe builds:

- a 2-D device mesh ``(dp_shard, tp)``, tp innermost, so a TP group is consecutive ranks
  (torch.distributed.device_mesh.init_device_mesh, row-major);
- per block: q/k/v and gate/up ``ColwiseParallel`` (output features split: heads, MLP inner dim),
  o and down ``RowwiseParallel`` (input features split; the partial sums reduced);
- with sequence parallelism: the norms ``SequenceParallel`` (their activations split over the
  sequence), the attention and MLP inputs ``PrepareModuleInput`` from Shard(1) to Replicate (the
  all-gather), o/down's outputs reduce-scattered to Shard(1); without it, o/down all-reduce to a
  replicated output and the norms run whole;
- embedding ``RowwiseParallel`` (vocab-parallel rows), LM head ``ColwiseParallel`` with its
  logits left sharded over the vocabulary, and the loss computed by ``loss_parallel``;
- then ``fully_shard`` of every block and of the root over the ``dp_shard`` mesh dimension
  (FSDP2 of the TP-sharded DTensors), when dp_shard > 1.

The loss is computed here, not by the transformers model (its ``ForCausalLMLoss`` shifts and views
the logits, which the vocab-sharded DTensor does not go through): labels shifted by one, padded
with -100, mean cross-entropy over the tokens, as ForCausalLMLoss does
(transformers/loss/loss_utils.py) and as torchtitan's ``cross_entropy_loss`` does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from backend.losses import InForwardChunkedLoss
from backend.train import AccumulatingEngine


def build_mesh(parallel: dict[str, int], device: torch.device):
    """(dp_replicate, dp_shard, cp, tp), tp innermost: torchtitan's order (parallel_dims.py, ["pp",
    "dp_replicate", "dp_shard", "cp", "tp"]); a degree of 1 is a dimension of one rank."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (int(parallel.get("dp_replicate", 1)), int(parallel["dp_shard"]), int(parallel.get("cp", 1)),
             int(parallel["tp"]))
    return init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))


def fsdp_mesh(mesh, parallel: dict[str, int]):
    """FSDP2 shards over dp_shard, and over dp_shard x cp flattened when cp > 1 (torchtitan's
    ``dp_shard_cp``: the cp ranks hold different tokens of the same batch, so they shard the
    parameters like data-parallel ranks). With dp_replicate > 1 (HSDP) the mesh is 2-D,
    (dp_replicate, dp_shard_cp): fully_shard replicates over the first dimension and shards over
    the second (torch 2.13 _fully_shard/_fsdp_init.py: a 2-D mesh is HSDPMeshInfo(shard_mesh_dim=1,
    replicate_mesh_dim=0)); the two are joined by DeviceMesh._concatenate, as fully_shard joins
    its own replicate and shard submeshes (_fsdp_init.py _get_mesh_info_from_named_dims)."""
    from torch.distributed.device_mesh import DeviceMesh

    shard = mesh["dp_shard"] if int(parallel.get("cp", 1)) == 1 else mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if int(parallel.get("dp_replicate", 1)) == 1:
        return shard
    return DeviceMesh._concatenate([mesh["dp_replicate"], shard])


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise RuntimeError(f"{type(model).__name__}: the TP probe knows llama-shaped decoders "
                           "(model.embed_tokens, model.layers[i].self_attn/mlp, model.norm, lm_head)")
    return inner


def apply_tp(model: torch.nn.Module, tp_mesh, sequence_parallel: bool, head_replicated: bool = False) -> None:
    """``head_replicated``: the LM head takes a replicated input and returns its local vocabulary
    columns (torchtitan 0.3.0's lm_head sharding, models/common/decoder_sharding.py, under its
    ChunkedLossWrapper: the hidden states are gathered whole before the head)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    decoder = _decoder(model)
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between blocks
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        **({"model.norm": SequenceParallel()} if sequence_parallel else {}),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True)
        if head_replicated else ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    })
    for block in decoder.layers:
        attention, mlp = block.self_attn, block.mlp
        # each rank keeps heads/tp query heads and kv_heads/tp key/value heads: the attention's
        # reshapes use -1 for the head count (LlamaAttention.forward), so they follow the shard
        plan = {
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": stream},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=stream),
            "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan["input_layernorm"] = SequenceParallel()
            plan["post_attention_layernorm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
        del attention, mlp


def apply_fsdp(model: torch.nn.Module, dp_mesh, settings: dict[str, Any], dtype) -> None:
    """FSDP2 over ``dp_mesh`` (fsdp_mesh: 1-D, dp_shard (x cp); 2-D, HSDP over (dp_replicate,
    dp_shard x cp)), every block a unit, then the root, as backend/train.py's _fully_shard does
    (torchtitan's apply_fsdp does the same on its dp mesh)."""
    from torch.distributed.fsdp import fully_shard

    from backend.train import mixed_precision_policy

    mixed = mixed_precision_policy(dtype, settings)
    options = dict(mesh=dp_mesh, reshard_after_forward=settings.get("sharding") != "SHARD_GRAD_OP",
                   mp_policy=mixed)
    for block in _decoder(model.lm).layers:
        fully_shard(block, **options)
    fully_shard(model, **options)


class CausalLMWithParallelLoss(torch.nn.Module):
    """The transformers model and its loss in one module, so that FSDP2's root unit (embeddings,
    final norm, LM head) is gathered by the root's own forward hook, which only a call of the root
    module runs."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        # the positions of the whole sequence: with SP the embedding's output is this rank's
        # slice of it, from which the model would derive too short a range
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.lm.model(input_ids=input_ids, position_ids=positions).last_hidden_state
        logits = self.lm.lm_head(hidden)
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        with loss_parallel():
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(),
                                                     ignore_index=-100)


class VocabShardCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of one slice's logits held as this rank's columns of the vocabulary
    (written from torchtitan 0.3.0's description of _LossParallelCrossEntropy, components/loss.py):
    fp32 log-probabilities from the all-reduced row max and sum of exponentials, the target's
    log-probability all-reduced from the rank that holds its column, the log-probabilities saved;
    the backward local: ``(exp(log_probs) - one_hot) * incoming`` on the rank's columns."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, first: int) -> torch.Tensor:
        import torch.distributed as dist

        columns = logits.shape[-1]
        top = logits.amax(dim=-1, keepdim=True)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top
        total = torch.exp(shifted).sum(dim=-1, keepdim=True)
        dist.all_reduce(total, group=group)
        log_probs = shifted - torch.log(total)
        del shifted
        valid = labels != -100
        mine = valid & (labels >= first) & (labels < first + columns)
        local = torch.where(mine, labels - first, 0)
        picked = torch.gather(log_probs, -1, local.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(log_probs, labels)
        ctx.first = first
        return -(picked * valid).sum()

    @staticmethod
    def backward(ctx, incoming: torch.Tensor):
        log_probs, labels = ctx.saved_tensors
        columns = log_probs.shape[-1]
        mine = (labels != -100) & (labels >= ctx.first) & (labels < ctx.first + columns)
        one_hot = torch.zeros_like(log_probs)
        rows = torch.arange(labels.shape[0], device=labels.device)
        one_hot[rows[mine], (labels - ctx.first)[mine]] = 1.0
        scale = torch.where(labels != -100, incoming, 0.0).unsqueeze(-1)
        return (torch.exp(log_probs) - one_hot) * scale, None, None, None


class InForwardParallelLoss(InForwardChunkedLoss):
    """torchtitan's ChunkedLossWrapper under TP (backend/losses.py InForwardChunkedLoss): the head's
    logits this rank's vocabulary columns (apply_tp head_replicated), each slice's loss
    VocabShardCrossEntropy over the tp group; the forward given the whole sequence's positions and
    returning the loss, as CausalLMWithParallelLoss."""

    def __init__(self, lm: torch.nn.Module, chunks: int, tp_mesh):
        group = tp_mesh.get_group()
        first = -(-lm.config.vocab_size // tp_mesh.size()) * tp_mesh.get_local_rank()

        def loss_of(logits: torch.Tensor, target: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
            flat = logits.float().reshape(-1, logits.size(-1))
            return VocabShardCrossEntropy.apply(flat, target.reshape(-1), group, first) / count

        super().__init__(lm, chunks, loss_of)

    @property
    def lm(self) -> torch.nn.Module:  # apply_fsdp's name for the causal LM
        return self.model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return super().forward(input_ids=input_ids, labels=labels, position_ids=positions).loss


class ParallelEngine(AccumulatingEngine):
    """A TP (x FSDP2) model (CausalLMWithParallelLoss): its forward returns the loss itself, and its
    backward runs under loss_parallel(), the vocab-sharded logits' loss."""

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor):
        return SimpleNamespace(loss=self.module(input_ids, labels))

    def backward(self, loss: torch.Tensor) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(loss)


def count_dtensor_collectives(counter) -> None:
    """Count DTensor's collectives (TP/SP redistributions, loss_parallel's reductions) beside
    FSDP's: DTensor calls torch.distributed._functional_collectives through the module
    (tensor/placement_types.py ``funcol.all_gather_single``, ``reduce_scatter_single``,
    ``all_reduce``), so wrapping those names sees every call, forward and backward. Bytes as
    CollectiveCounter counts them: an all-gather's output, a reduce-scatter's input. Their time is
    not taken: they return before the collective completes (AsyncCollectiveTensor)."""
    import torch.distributed._functional_collectives as funcol

    def group_size(group) -> int:
        if isinstance(group, tuple):  # (DeviceMesh, mesh dim), as DTensor passes it
            mesh, dim = group
            return mesh.size(dim)
        if isinstance(group, str):  # a group name
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(group).size()
        return group.size()

    sizes = {
        "all_gather_single": lambda t, gather_dim, group, *a, **k: t.numel() * t.element_size() * group_size(group),
        "reduce_scatter_single": lambda t, *a, **k: t.numel() * t.element_size(),
        "all_reduce": lambda t, *a, **k: t.numel() * t.element_size(),
    }
    for name, size_of in sizes.items():
        original = getattr(funcol, name)
        if getattr(original, "_planner_counted", False):
            continue

        def counted(*args, _original=original, _name=name, _size_of=size_of, **kwargs):
            if counter.on:
                counter.add(f"{_name} (DTensor)", int(_size_of(*args, **kwargs)))
            return _original(*args, **kwargs)

        counted._planner_counted = True
        setattr(funcol, name, counted)
