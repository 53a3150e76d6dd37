"""Expert parallelism composed with FSDP2 on one rank (imported only inside a launched rank; issue 12).

The mechanism torchtitan 0.3 applies to its MoE models (torchtitan/models/common/token_dispatcher.py
``AllToAllTokenDispatcher``; torchtitan/distributed/fsdp.py, the ``ep_degree > 1`` branch;
torchtitan/distributed/parallel_dims.py ``efsdp``), here on a transformers MoE built from its
config (the experts module every ``@use_experts_implementation`` family has in transformers 5:
fused 3-D ``gate_up_proj`` (E, 2I, h) and ``down_proj`` (E, h, I), optional biases):

- ranks form an (efsdp, ep) mesh, ep innermost (consecutive ranks share their tokens); rank r of
  an ep group keeps routed experts ``[r E/ep, (r+1) E/ep)`` of every MoE block, the other
  experts' weights are dropped before anything is wrapped;
- the router, attention, norms, embeddings, LM head and shared experts stay whole on every rank
  and are FSDP2-sharded over all dp_shard ranks; the routed experts are FSDP2-sharded over the
  efsdp ranks (those holding the same experts, dp_shard / ep of them) only, inside the same
  block unit (``shard_placement_fn`` returning a ``ShardPlacementResult`` on the efsdp mesh), so
  their gradients are reduce-scattered over the expert-data-parallel group only;
- each MoE forward: the router scores all E experts; the (token, expert) pairs are sorted by
  expert, the per-expert counts exchanged by an all-to-all, the pairs' hidden states sent to the
  rank holding their expert by a second, uneven all-to-all (dispatch), regrouped by local expert,
  run through the local experts (transformers' own grouped_mm path and gating), sent back by a
  third all-to-all (combine), weighted by the routing scores and summed per token. Backward runs
  the two data all-to-alls in reverse (``all_to_all_single_autograd``). Dropless: every routed pair
  is computed, however unbalanced (torchtitan's default; no capacity factor).

gloo implements ``all_to_all_single`` with uneven splits on CPU tensors in torch 2.13
(ProcessGroupGloo::alltoall_base, alltoallv): the same collective torchtitan calls over NCCL.

What a rank holds for backward per MoE block is the transformers grouped_mm path's set over its
R received pairs (the regrouped input, the up output and the gate's intermediates) plus the
combined output and routing weights over its own S = T x k pairs, and four int64 index vectors
(three in transformers): the same bytes on average (R = S) as without ep, which is what
planner/parallel/experts.py models; the all-to-all send and receive buffers live only inside the block.

The routing weights are applied in the compute dtype, as the transformers experts forward does
(torchtitan upcasts the combined output to fp32 for the product): the EP run computes the same
function as the model it shards. Gradients: FSDP2's own division is turned off and the loss is
divided by the world size, as torchtitan does (disable_fsdp_gradient_division), so that an
expert's gradient, which collects every ep rank's tokens, is the mean over the global batch.
"""

from __future__ import annotations

from types import MethodType, SimpleNamespace
from typing import Any

import torch

from backend.train import AccumulatingEngine


def routed_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routed-experts modules of the model: transformers 5 marks every MoE family's with
    ``@use_experts_implementation`` (integrations/moe.py), which sets ``_is_expert_parallel``."""
    found = [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "down_proj")]
    if not found:
        raise RuntimeError(f"{type(model).__name__}: no routed experts module (transformers' "
                           "@use_experts_implementation) to shard over the ep group")
    return found


EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def keep_local_experts(experts: torch.nn.Module, ep_rank: int, ep: int) -> None:
    """Keep experts [ep_rank E/ep, (ep_rank+1) E/ep) of the fused (E, ...) tensors; the rest is freed."""
    total = int(experts.num_experts)
    if total % ep:
        raise RuntimeError(f"num_experts({total}) is not divisible by ep({ep})")
    local = total // ep
    first = ep_rank * local
    for name in EXPERT_TENSORS:
        weight = getattr(experts, name, None)
        if isinstance(weight, torch.nn.Parameter):
            setattr(experts, name, torch.nn.Parameter(weight.data[first:first + local].clone(),
                                                      requires_grad=weight.requires_grad))
    experts.num_experts = local
    experts.first_expert = first
    experts.global_experts = total


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None,
             transposed: bool) -> torch.Tensor:
    from transformers.integrations.moe import _grouped_linear

    return _grouped_linear(x, weight, offsets, bias=bias, is_transposed=transposed)


def expert_parallel_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward under EP (bound to the module by ``shard_experts``).

    ``hidden_states`` (T, h), ``top_k_index`` (T, k) global expert ids, ``top_k_weights`` (T, k)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    group, ep, local = self.ep_group, self.ep_size, self.num_experts
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    with torch.no_grad():
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)  # (S,) pairs grouped by expert, S = T k
        sent_per_expert = torch.bincount(expert_ids, minlength=self.global_experts)
        # counts exchange: what every rank sends to each of my local experts, (ep, E/ep) rank-major
        received_per_expert = torch.empty_like(sent_per_expert)
        torch.distributed.all_to_all_single(received_per_expert, sent_per_expert, group=group)
        input_splits = sent_per_expert.view(ep, local).sum(1).tolist()
        output_splits = received_per_expert.view(ep, local).sum(1).tolist()
        token_of = order // k
    weights_sorted = top_k_weights.reshape(-1)[order]
    routed = hidden_states[token_of]  # (S, h): the dispatch send buffer
    received = all_to_all_single_autograd(routed, output_splits, input_splits, group)  # (R, h)
    _count(routed, received, "dispatch")
    del routed
    with torch.no_grad():
        # rank-major (source rank, local expert) segments -> grouped by local expert
        segment_expert = torch.arange(local).repeat(ep)
        row_expert = torch.repeat_interleave(segment_expert, received_per_expert)
        regroup = torch.argsort(row_expert, stable=True)
        row_expert = row_expert[regroup]
        offsets = torch.cumsum(received_per_expert.view(ep, local).sum(0), dim=0, dtype=torch.int32)
    x = received[regroup]
    del received
    if self.has_gate:
        up_weight, up_bias = self.gate_up_proj, getattr(self, "gate_up_proj_bias", None)
    else:
        up_weight, up_bias = self.up_proj, getattr(self, "up_proj_bias", None)
    up = _grouped(x, up_weight, offsets, up_bias[row_expert] if self.has_bias else None, self.is_transposed)
    act = self._apply_gate(up) if self.has_gate else self.act_fn(up)
    down_bias = self.down_proj_bias[row_expert] if self.has_bias else None
    out = _grouped(act, self.down_proj, offsets, down_bias, self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    back = out.new_zeros(out.shape).index_put((regroup,), out)  # back to rank-major order
    del out
    combined = all_to_all_single_autograd(back, input_splits, output_splits, group)  # (S, h), expert-sorted
    _count(back, combined, "combine")
    del back
    weighted = combined * weights_sorted.unsqueeze(-1)
    with torch.no_grad():
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
    # as grouped_mm_experts_forward: restore the pair order, then sum each token's k outputs
    final = weighted[inverse].view(tokens, k, hidden).sum(dim=1)
    return final.to(hidden_states.dtype)


def shard_experts(model: torch.nn.Module, ep_mesh) -> list[torch.nn.Module]:
    """Cut every MoE block's experts to this rank's share and bind the all-to-all forward."""
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = routed_experts(model)
    for experts in modules:
        keep_local_experts(experts, ep_rank, ep)
        experts.ep_group, experts.ep_size = ep_mesh.get_group(), ep
        experts.forward = MethodType(expert_parallel_forward, experts)
    return modules


def build_meshes(world: int, ep: int):
    """(dp mesh over every rank, (efsdp, ep) mesh with ep innermost), as torchtitan's
    ParallelDims builds its dense and sparse meshes."""
    from torch.distributed.device_mesh import init_device_mesh

    if world % ep:
        raise RuntimeError(f"world size {world} is not divisible by ep({ep})")
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    sparse = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    return dense, sparse


def apply_fsdp(model: torch.nn.Module, dense, sparse, experts: list[torch.nn.Module], dtype,
               reshard_after_forward: bool) -> None:
    """FSDP2 per decoder block, then the root; in a block with routed experts their parameters
    go on the efsdp mesh, the rest on the dense one (torchtitan/distributed/fsdp.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    from backend.train import _decoder_layer_class

    mixed = MixedPrecisionPolicy() if dtype is None else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    options = dict(mesh=dense, reshard_after_forward=reshard_after_forward, mp_policy=mixed)
    expert_params = {p for e in experts for p in e.parameters()}
    dense_info, expert_info = _get_mesh_info(dense), _get_mesh_info(sparse["efsdp"])

    def placement(param: torch.nn.Parameter) -> ShardPlacementResult:
        if param in expert_params:
            return ShardPlacementResult(placement=Shard(0), mesh_info=expert_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)

    block = _decoder_layer_class(model)
    for module in list(model.modules()):
        if isinstance(module, block):
            has_experts = any(p in expert_params for p in module.parameters())
            fully_shard(module, **options, **({"shard_placement_fn": placement} if has_experts else {}))
    fully_shard(model, **options)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            # a plain SUM (gloo has no PREMUL_SUM, which a custom factor otherwise selects:
            # fsdp/_fully_shard/_fsdp_collectives.py _get_gradient_divide_factors)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class ExpertEngine(AccumulatingEngine):
    """The EP x FSDP2 model: its forward returns the transformers model's own loss, divided in the
    backward by the world size as well as the accumulation (FSDP2's own division is off: apply_fsdp)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, accumulation: int, world: int):
        super().__init__(module, optimizer, accumulation=accumulation)
        self.loss_divisor = accumulation * world

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor):
        return SimpleNamespace(loss=self.module(input_ids=input_ids, labels=labels).loss)


COUNTED = SimpleNamespace(counter=None)


def _count(sent: torch.Tensor, arrived: torch.Tensor, what: str) -> None:
    """Count one data all-to-all forward (what this rank sends) and its backward (the gradient of
    what arrived, sent back): ``all_to_all_single_autograd`` calls the c10d op directly, past
    CollectiveCounter's wrappers. Their time is not taken (funcol returns before completion)."""
    counter = COUNTED.counter
    if counter is None or not counter.on:
        return
    counter.add(f"all_to_all_single ({what}, forward)", sent.numel() * sent.element_size())
    if arrived.requires_grad:
        arrived.register_hook(lambda grad: counter.add(f"all_to_all_single ({what}, backward)",
                                                       grad.numel() * grad.element_size()))


def expert_engine(job: dict[str, Any], model: torch.nn.Module, device: torch.device) -> ExpertEngine:
    from backend.train import COUNTER, torch_optimizer

    if device.type != "cpu":
        raise RuntimeError("the expert-parallel probe runs on CPU ranks (--gpu cpu)")
    COUNTER.wrap_torch_distributed()
    COUNTED.counter = COUNTER
    settings, experts = job["torch"], job["experts"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[settings["compute_dtype"]]
    if settings["pure_16bit"]:  # bf16-pure: the weights themselves in the 16-bit dtype, no policy cast
        model = model.to(dtype)
    world = torch.distributed.get_world_size()
    dense, sparse = build_meshes(world, int(experts["ep"]))
    modules = shard_experts(model, sparse["ep"])
    apply_fsdp(model, dense, sparse, modules, None if settings["pure_16bit"] else dtype,
               reshard_after_forward=settings["sharding"] != "SHARD_GRAD_OP")
    optimizer = torch_optimizer(job, model)
    return ExpertEngine(model, optimizer, accumulation=int(job.get("gradient_accumulation", 1)), world=world)
