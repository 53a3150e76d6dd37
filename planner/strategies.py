"""Distributed strategies: what each one shards, over which group, and what it may offload.

ZeRO paper (Rajbhandari et al. 2020, Sec. 5): stage 1 partitions optimizer states, stage 2 also
gradients, stage 3 also parameters. FSDP paper (Zhao et al. 2023, Sec. 3.2): FULL_SHARD is
ZeRO-3-like; SHARD_GRAD_OP keeps parameters unsharded from forward through backward;
HYBRID_SHARD shards inside a node and replicates across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner.errors import PlannerError

StrategyName = Literal["single", "ddp", "fsdp", "fsdp-grad-op", "hsdp", "zero0", "zero1", "zero2", "zero3"]
OffloadDevice = Literal["none", "cpu", "nvme"]
# "single" first: on one device it is what the plan prefers among equals (no framework to install)
STRATEGIES: tuple[str, ...] = ("single", "ddp", "zero0", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp")
SINGLE = "single"


@dataclass(frozen=True)
class Strategy:
    name: str
    framework: Literal["torch", "deepspeed"]
    shards_optimizer: bool
    shards_gradients: bool
    shards_parameters: bool
    zero_stage: int | None = None
    shard_within_node: bool = False  # HSDP: the shard group is one node's GPUs
    params_unsharded_in_step: bool = False  # SHARD_GRAD_OP keeps gathered params fwd -> bwd
    one_device: bool = False  # "single": one device, no data-parallel wrapper (no DDP buckets, no collectives)

    def runs_on(self, world: int) -> bool:
        return world == 1 or not self.one_device

    @property
    def wraps(self) -> bool:
        """A data-parallel wrapper runs (False: one device, the bare module)."""
        return not self.one_device


_TABLE: dict[str, Strategy] = {
    # plain torch on one device: the model, autocast and the optimizer, nothing wrapped around them
    "single": Strategy("single", "torch", False, False, False, one_device=True),
    "ddp": Strategy("ddp", "torch", False, False, False),
    "zero0": Strategy("zero0", "deepspeed", False, False, False, zero_stage=0),
    "zero1": Strategy("zero1", "deepspeed", True, False, False, zero_stage=1),
    "zero2": Strategy("zero2", "deepspeed", True, True, False, zero_stage=2),
    "zero3": Strategy("zero3", "deepspeed", True, True, True, zero_stage=3),
    "fsdp": Strategy("fsdp", "torch", True, True, True),
    "fsdp-grad-op": Strategy("fsdp-grad-op", "torch", True, True, True, params_unsharded_in_step=True),
    "hsdp": Strategy("hsdp", "torch", True, True, True, shard_within_node=True),
}


def strategy(name: str) -> Strategy:
    try:
        return _TABLE[name]
    except KeyError:
        raise PlannerError(f"strategy {name!r} is unknown; choose one of {', '.join(_TABLE)}",
                           field="strategy") from None


def shard_group_size(s: Strategy, gpus_per_node: int, nodes: int, hsdp_shard_size: int | None = None) -> int:
    """How many ranks a sharded state is divided over: the data-parallel group, or for HSDP one
    shard group (a node's GPUs by default, or fewer: e.g. the two GPUs of an NVLink pair)."""
    world = gpus_per_node * nodes
    if not s.runs_on(world):
        raise PlannerError(f"strategy {s.name} trains on one device; gpus({gpus_per_node}) * nodes({nodes}) = {world}: "
                           "choose a data-parallel strategy (ddp, fsdp, zero1-3, ...)", field="strategy")
    if not s.shard_within_node:
        if hsdp_shard_size is not None:
            raise PlannerError(f"hsdp_shard_size={hsdp_shard_size} applies to hsdp only, not to strategy {s.name}",
                               field="hsdp_shard_size")
        return world
    shard = gpus_per_node if hsdp_shard_size is None else hsdp_shard_size
    if world % shard:
        raise PlannerError(f"hsdp_shard_size({shard}) must divide the world size gpus({gpus_per_node}) * "
                           f"nodes({nodes}) = {world}", field="hsdp_shard_size")
    if shard >= world:
        raise PlannerError(f"hsdp with a single shard group (all {world} GPUs) is fsdp: give nodes >= 2, or an "
                           f"hsdp_shard_size smaller than gpus({gpus_per_node}) that divides it", field="strategy")
    return shard


def explicit_hsdp_shard(strategy_name: str, shard: int | None, gpus_per_node: int) -> int | None:
    """The hsdp_shard_size a request must carry for a planned shard group: None when it is the
    default (one node's GPUs) or the strategy is not hsdp."""
    return shard if strategy(strategy_name).shard_within_node and shard != gpus_per_node else None
