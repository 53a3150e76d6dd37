"""Parallel degrees: how a world of ranks divides into data, tensor, pipeline, context and expert
parallel groups, and the checks that a layout is possible.

The shape is torchtitan's ``ParallelDims`` (torchtitan/distributed/parallel_dims.py): the world is
dp_replicate x dp_shard x cp x tp x pp, and expert parallelism borrows its ranks from
dp_shard x cp rather than multiplying the world. A strategy name ("zero3", "hsdp") is the user's
shorthand for the data-parallel part: it parses into dims plus the framework that realises them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner.errors import PlannerError

# torch 2.13's schedules (torch/distributed/pipelining/schedules.py: Schedule1F1B,
# ScheduleInterleaved1F1B, ScheduleGPipe, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
# ScheduleZBVZeroBubble, ScheduleDualPipeV); planner/parallel/pipeline.py SCHEDULE_SPECS models each
PipelineSchedule = Literal["1f1b", "interleaved", "gpipe", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"]
SINGLE_STAGE_SCHEDULES = ("1f1b", "gpipe")
DEGREE_FIELDS = ("tp", "pp", "cp", "ep")

# What each degree needs before it can be > 1: the memory model of the dimension. The helper who
# models a dimension removes its line here (planner/memory/orchestrator.py resolve() refuses the rest).
NOT_MODELLED: dict[str, str] = {
}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one layout, each an integer >= 1 (checked at construction). Ranks fill the
    layout in MESH_ORDER (below): tp innermost (consecutive ranks), then cp, dp_shard,
    dp_replicate, and pp outermost, as torchtitan's build_mesh lays out its device mesh."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise PlannerError(f"{name}({value!r}) must be an integer >= 1",
                                   field=name if name in DEGREE_FIELDS else None)
        if (self.dp_shard * self.cp) % self.ep:
            raise PlannerError(f"ep({self.ep}) must divide dp_shard({self.dp_shard}) * cp({self.cp}) = "
                               f"{self.dp_shard * self.cp}: expert parallelism borrows its ranks from them", field="ep")

    @property
    def dp(self) -> int:
        """The data-parallel degree: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def model_parallel(self) -> int:
        """Ranks one data-parallel replica spans: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    def as_dict(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp,
                "cp": self.cp, "ep": self.ep}


def data_parallel_size(world: int, tp: int = 1, pp: int = 1, cp: int = 1, gpus: int | None = None,
                       nodes: int | None = None) -> int:
    """What remains of the world for data parallelism: world / (tp * pp * cp), refused when it does
    not divide (naming gpus and nodes when given)."""
    model = tp * pp * cp
    if world % model:
        where = f"gpus({gpus}) * nodes({nodes}) = {world}" if gpus is not None and nodes is not None else f"world({world})"
        raise PlannerError(f"{where} is not divisible by tp({tp}) * pp({pp}) * cp({cp}) = {model}",
                           field="gpus" if gpus is not None else None)
    return world // model


def dims_for(shards_data: bool, shard_group: int | None, dp: int, tp: int = 1, pp: int = 1, cp: int = 1,
             ep: int = 1) -> ParallelDims:
    """The dims of a data-parallel realisation over ``dp`` ranks: replicated (DDP, ZeRO-0),
    sharded over all of them (ZeRO-1..3, FSDP full-shard and grad-op), or sharded within groups of
    ``shard_group`` and replicated across them (HSDP)."""
    if shard_group is not None:
        if dp % shard_group:
            raise PlannerError(f"hsdp_shard_size({shard_group}) must divide the data-parallel size {dp}",
                               field="hsdp_shard_size")
        return ParallelDims(dp_replicate=dp // shard_group, dp_shard=shard_group, tp=tp, pp=pp, cp=cp, ep=ep)
    if shards_data:
        return ParallelDims(dp_shard=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    return ParallelDims(dp_replicate=dp, tp=tp, pp=pp, cp=cp, ep=ep)


@dataclass(frozen=True)
class ModelShape:
    """What the validator needs of a model (None where the request gives only a parameter count)."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    num_layers: int | None = None
    num_experts: int | None = None


def check_dims(dims: ParallelDims, *, gpus: int, nodes: int, model: ModelShape, seq_len: int,
               pp_virtual_stages: int = 1, pp_schedule: str = "1f1b") -> None:
    """Refuse a layout the model or the cluster cannot take, naming every operand."""
    world = gpus * nodes
    if dims.world != world:
        raise PlannerError(
            f"dp_replicate({dims.dp_replicate}) * dp_shard({dims.dp_shard}) * cp({dims.cp}) * tp({dims.tp}) * "
            f"pp({dims.pp}) = {dims.world} differs from gpus({gpus}) * nodes({nodes}) = {world}", field="gpus")
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if heads is not None and heads % dims.tp:
        raise PlannerError(f"num_attention_heads({heads}) is not divisible by tp({dims.tp})", field="tp")
    if kv is not None and dims.tp > 1 and kv % dims.tp and dims.tp % kv:
        raise PlannerError(f"num_key_value_heads({kv}) and tp({dims.tp}): neither divides the other, so the "
                           "key/value heads can be neither split nor replicated evenly", field="tp")
    if pp_virtual_stages > 1 and pp_schedule in SINGLE_STAGE_SCHEDULES:
        raise PlannerError(f"pp_virtual_stages({pp_virtual_stages}) needs a multi-stage pp_schedule (interleaved, "
                           f"looped-bfs, interleaved-zb, zbv, dualpipev), got {pp_schedule}", field="pp_virtual_stages")
    stages = dims.pp * pp_virtual_stages
    if model.num_layers is not None and dims.pp > 1 and model.num_layers < stages:
        raise PlannerError(f"num_layers({model.num_layers}) is fewer than pp({dims.pp}) * "
                           f"pp_virtual_stages({pp_virtual_stages}) = {stages} stages", field="pp")
    if dims.cp > 1 and seq_len % (2 * dims.cp):
        raise PlannerError(f"seq_len({seq_len}) is not divisible by 2 * cp({dims.cp}) = {2 * dims.cp} "
                           "(load-balanced context parallelism cuts each sequence into 2 * cp chunks)", field="cp")
    experts = model.num_experts
    if dims.ep > 1 and not experts:
        raise PlannerError(f"ep({dims.ep}) needs a mixture-of-experts model; this one has no experts", field="ep")
    if experts and experts % dims.ep:
        raise PlannerError(f"num_experts({experts}) is not divisible by ep({dims.ep})", field="ep")


def refuse_unmodelled(request) -> None:
    """One line naming the field and the value for a degree whose memory model has not landed.
    ``request``: anything with the request fields tp, pp, cp, ep and sequence_parallel."""
    for name in DEGREE_FIELDS:
        value = getattr(request, name)
        if value > 1 and name in NOT_MODELLED:
            raise PlannerError(f"{name}={value}: {NOT_MODELLED[name]}", field=name)
    if request.sequence_parallel and request.tp == 1:
        raise PlannerError("sequence_parallel=true needs tp > 1: it shards the tensor-parallel region's activations",
                           field="sequence_parallel")


# --- where each rank sits -----------------------------------------------------------------------
# Ranks fill the mesh as torchtitan's ParallelDims.build_mesh lays it out (torchtitan/distributed/
# parallel_dims.py: mesh dims ["pp", "dp_replicate", "dp_shard", "cp", "tp"], the last varying
# fastest): consecutive ranks form a tensor-parallel group, then context-parallel, data-parallel
# shard and replica groups, and the pipeline stage varies slowest. torchrun and Slurm number ranks
# node by node, so a TP group of at most a node's GPUs stays inside the node (its NVLink island).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first


def rank_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """The rank's index along each mesh dimension (MESH_ORDER)."""
    if not 0 <= rank < dims.world:
        raise PlannerError(f"rank({rank}) is outside the world of {dims.world} ranks", field=None)
    coords: dict[str, int] = {}
    for name in reversed(MESH_ORDER):
        size = getattr(dims, name)
        coords[name] = rank % size
        rank //= size
    return {name: coords[name] for name in MESH_ORDER}


def rank_groups(dims: ParallelDims, dim: str) -> list[tuple[int, ...]]:
    """Every group of ranks along one mesh dimension ("tp", "pp", ...): the ranks that differ only
    in that coordinate, in rank order."""
    if dim not in MESH_ORDER:
        raise PlannerError(f"dim({dim!r}) is not a mesh dimension; one of {', '.join(MESH_ORDER)}", field=None)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(dims.world):
        coords = rank_coordinates(dims, rank)
        groups.setdefault(tuple(v for k, v in coords.items() if k != dim), []).append(rank)
    return [tuple(g) for g in groups.values()]


@dataclass(frozen=True)
class NodeLayout:
    """One node's share of a layout, in the node's own GPU indices: its tensor-parallel groups
    (whole or the part on this node), each GPU's pipeline stage, and a caption saying how ranks
    were placed."""

    tp_groups: tuple[tuple[int, ...], ...]
    stage_of: dict[int, int]
    pp: int
    caption: str


def node_layout(dims: ParallelDims, gpus_per_node: int, node: int = 0) -> NodeLayout:
    """The layout's groups on one node: ranks node * gpus_per_node ... onward are its GPU0, GPU1, ..."""
    if dims.world % gpus_per_node:
        raise PlannerError(f"world({dims.world}) is not divisible by gpus({gpus_per_node})", field="gpus")
    first = node * gpus_per_node
    local = range(first, first + gpus_per_node)
    tp_groups = tuple(tuple(r - first for r in g if r in local) for g in rank_groups(dims, "tp")
                      if dims.tp > 1 and any(r in local for r in g))
    stage_of = {r - first: rank_coordinates(dims, r)["pp"] for r in local}
    nodes = dims.world // gpus_per_node
    degrees = " x ".join(f"{name} {getattr(dims, name)}" for name in ("tp", "cp", "pp", "dp_shard", "dp_replicate")
                         if getattr(dims, name) > 1) or "one rank"
    spans = "; a TP group spans nodes" if dims.tp > gpus_per_node else ""
    caption = (f"node {node} of {nodes}: {degrees}; consecutive ranks, tp innermost, then cp, dp_shard, dp_replicate, "
               f"pp (torchtitan's mesh order){spans}")
    return NodeLayout(tp_groups=tp_groups, stage_of=stage_of, pp=dims.pp, caption=caption)
