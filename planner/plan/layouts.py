"""Which model-parallel degrees a plan searches, from the wiring and the model, and why the others
are not candidates.

Placement is torchrun's and Slurm's: consecutive ranks, tp innermost (torchtitan's mesh order
``pp, dp_replicate, dp_shard, cp, tp``, parallel_dims.py), so TP group k is GPUs
k*tp .. k*tp+tp-1 of a node. Tensor parallelism communicates inside every layer, forward and
backward, on the critical path (planner/parallel/tensor.py tp_collectives): it pays only where
every pair of its group is NVLink/NVSwitch-connected (Shoeybi et al. 2019, Sec. 5: TP within a
DGX node, data parallelism across). Context parallelism is searched only where the sequence does
not fit without it.

Pipeline stages are whole nodes: pp is the outermost mesh dimension, so with pp dividing the node
count each stage is nodes / pp consecutive nodes and every stage boundary is a node boundary, the
slowest link, which only the point-to-point activations cross (Narayanan et al. 2021, Sec. 3.2:
"tensor model parallelism within a server, pipeline model parallelism across servers"). Where pp x
virtual stages does not divide the blocks, the first and last stages are shortened
(planner/parallel/pipeline.py balanced_split) and the slowest stage sets the step's pace. Expert parallelism is searched for a mixture of experts:
every degree that divides each MoE block's routed experts (planner/parallel/experts.py), on the ranks it
borrows from dp_shard x cp (planner/parallel/dims.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from math import gcd

from planner.model.architecture import Architecture, distinct_specs, layer_specs
from planner.model.attention.kinds import kind_of
from planner.parallel.pipeline import balanced_split
from planner.cluster.topology import Topology

_NV = re.compile(r"^NV\d+$")


@dataclass(frozen=True)
class Rejected:
    """A degree that is not a candidate, with its operands in words."""

    field: str
    value: int
    reason: str

    def __str__(self) -> str:
        return f"{self.field}={self.value} not searched: {self.reason}"


def _nvlink_complete(topo: Topology, members: range) -> tuple[int, int] | None:
    """The first pair of ``members`` not joined by NVLink, or None when all pairs are."""
    for a in members:
        for b in members:
            if a < b and not _NV.match(topo.matrix[a][b]):
                return a, b
    return None


def tp_degrees(topo: Topology, gpus_per_node: int, arch: Architecture | None) -> tuple[list[int], list[Rejected]]:
    """Tensor-parallel degrees worth planning: divisors of the node's GPUs whose every group of
    consecutive GPUs is an NVLink island, and that split the model's heads evenly."""
    degrees, rejected = [1], []
    for tp in range(2, gpus_per_node + 1):
        if gpus_per_node % tp:
            continue
        why = _tp_refusal(topo, gpus_per_node, tp, arch)
        if why:
            rejected.append(Rejected("tp", tp, why))
        else:
            degrees.append(tp)
    return degrees, rejected


def _tp_refusal(topo: Topology, gpus_per_node: int, tp: int, arch: Architecture | None) -> str | None:
    if arch is None:
        return "a parameter count alone cannot be split over tensor-parallel ranks"
    for start in range(0, gpus_per_node, tp):
        pair = _nvlink_complete(topo, range(start, start + tp))
        if pair is not None:
            a, b = pair
            return (f"GPU{a}-GPU{b} of the TP group GPU{start}..GPU{start + tp - 1} is {topo.matrix[a][b]}, "
                    f"not NVLink ({topo.source}); TP's per-layer collectives need an NVLink island")
    for spec in distinct_specs(arch).values():
        attn = spec.attention
        if kind_of(attn).tp_refusal is not None:
            return f"{kind_of(attn).long} is not split by this planner's TP model"
        if attn.num_heads % tp:
            return f"num_attention_heads({attn.num_heads}) is not divisible by tp({tp})"
        if attn.num_kv_heads % tp and tp % attn.num_kv_heads:
            return f"num_key_value_heads({attn.num_kv_heads}) and tp({tp}): neither divides the other"
    return None


def cp_degrees(seq_len: int, world: int, tp: int, arch: Architecture | None) -> tuple[list[int], list[Rejected]]:
    """Context-parallel degrees > 1 that could split this sequence (powers of two dividing the
    ranks left after TP, with seq_len % (2*cp) == 0); whether they are needed is the search's call."""
    degrees, rejected = [], []
    if arch is None:
        return degrees, rejected
    cp = 2
    while tp * cp <= world and world % (tp * cp) == 0:
        if seq_len % (2 * cp):
            rejected.append(Rejected("cp", cp, f"seq_len({seq_len}) is not divisible by 2 * cp({cp}) = {2 * cp}"))
        else:
            degrees.append(cp)
        cp *= 2
    return degrees, rejected


def pp_degrees(nodes: int, arch: Architecture | None, virtual_stages: int = 1,
               seq_len: int = 4096) -> tuple[list[int], list[Rejected]]:
    """Pipeline degrees > 1 worth planning on ``nodes`` nodes: divisors of the node count (stages of
    whole nodes) with at least one block per stage. Where pp x virtual stages does not divide the
    blocks, the degree is planned with the best uneven split (planner/parallel/pipeline.py balanced_split:
    shorter first and last stages, as the Llama 3 405B run's 126 blocks over 16 stages)."""
    degrees: list[int] = []
    rejected: list[Rejected] = []
    if arch is None or nodes == 1:
        return degrees, rejected
    for pp in range(2, nodes + 1):
        if nodes % pp:
            continue
        stages = pp * virtual_stages
        if arch.num_layers < stages:
            rejected.append(Rejected("pp", pp, f"num_layers({arch.num_layers}) is fewer than pp({pp}) * "
                                     f"pp_virtual_stages({virtual_stages}) = {stages} stages"))
            break  # and so is every larger divisor
        if arch.num_layers % stages and balanced_split(arch, pp, virtual_stages, seq_len) is None:
            rejected.append(Rejected("pp", pp, f"num_layers({arch.num_layers}) is not divisible by pp({pp}) * "
                                     f"pp_virtual_stages({virtual_stages}) = {stages}, and no shorter first and "
                                     "last stages leave the others equal"))
        else:
            degrees.append(pp)
    return degrees, rejected


def ep_degrees(arch: Architecture | None) -> list[int]:
    """Expert-parallel degrees > 1 of a mixture of experts: the divisors of every MoE block's routed
    expert count (each rank of the group holds num_experts / ep of them); none for a dense model.
    Which of them a strategy takes (ep divides its dp_shard x cp) is the search's call."""
    if arch is None:
        return []
    counts = {spec.mlp.num_experts for spec in layer_specs(arch) if spec.mlp.is_moe}
    if not counts:
        return []
    common = gcd(*counts)
    return [d for d in range(2, common + 1) if common % d == 0]
