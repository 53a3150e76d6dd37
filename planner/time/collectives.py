"""Time of one optimizer step: compute from the architecture's FLOPs, communication on the real
interconnect with an α-β ring model, and the part of it that overlap does not hide.

- FLOPs: 2 per multiply-add for every matmul parameter a token passes through, plus attention's
  QKᵀ and AV (4·seq·q_width per token per layer), x3 for forward and backward, +1 forward with full
  checkpointing (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training", Sec. 5.1).
- Communication volume per GPU (ZeRO paper, Sec. 7): all-reduce of the gradients = 2Ψ (DDP,
  ZeRO-1/2); ZeRO-3 and FSDP gather the parameters twice and reduce-scatter the gradients: 3Ψ,
  for every micro-batch. Rings move (n-1)/n of each volume through every GPU; a ring runs at its
  slowest link (Patarasuk & Yuan 2009, bandwidth-optimal all-reduce); each message pays the ring's
  latency, and messages are the framework's buckets, so small buckets are latency-bound.
- Across nodes (`collective_seconds`), as NCCL runs them. NCCL builds flat rings that span the
  intra- and inter-node links, never 2-D rings (NVIDIA/nccl#471, #530): every byte a ring moves
  crosses each node boundary, so a ring spanning nodes runs at the slower of the node's ring and
  the node's NICs (all of them: NCCL gives each NIC its own channel), shared by the groups that
  cross at once. All-gather and reduce-scatter have no tree algorithm (Tree applies only to
  all-reduce, NVIDIA/nccl#1473, #1413; PAT covers one GPU per node only), so ZeRO-1/2/3's and
  FSDP's gathers and reduce-scatters over a multi-node group are flat rings. All-reduce is
  hierarchical under NCCL's Tree (reduce inside the node, double binary tree across nodes,
  broadcast inside; NVIDIA/nccl#530), and NCCL picks the faster of Ring and Tree per size
  (NVIDIA/nccl#457), so an all-reduce takes the faster of the two here. HSDP is hierarchical by
  construction (FSDP paper, Zhao et al. 2023, Sec. 3.2.2): a reduce-scatter inside the shard group,
  then an all-reduce of the 1/shard slice across the replicas, each its own collective.
  Latency: NCCL pipelines a ring's chunks hop to hop, so one pass of one message costs the sum of
  its hops' latencies (the fabric's at each node boundary); Tree pays its chain and its levels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from functools import lru_cache, partial
from itertools import repeat

from planner.time import arrays
from planner.model.activations import recompute_flops_per_token
from planner.model.architecture import Architecture, active_parameter_count
from planner.cluster.topology import Topology, link_rates

# Of the compute, backward is 2/3 (the x3 above): what bucketed gradient reduction can hide behind.
BACKWARD_FRACTION = 2 / 3
# DeepSpeedCPUAdam updates about 1e9 parameters per second per rank on a server CPU (ZeRO-Offload
# paper, Ren et al. 2021, Sec. 5: CPU Adam 5-7x faster than PyTorch's). Calibratable.
CPU_ADAM_PARAMS_PER_SECOND = 1.0e9
# Achieved fraction of peak device-memory bandwidth for streaming kernels: a V100 reaches about
# 750 of its 900 GB/s in microbenchmarks (Jia et al. 2018, "Dissecting the NVIDIA Volta GPU
# Architecture via Microbenchmarking": global memory), ~83%; an H200's 4 GiB device-to-device copy
# moved 3,984 GB/s read + written of its 4,800 (83.0%; bench/results/gpu_check_h200_1.json
# hbm_copy_gbps, torch 2.11). Calibratable.
MEMORY_BANDWIDTH_EFFICIENCY = 0.83

# Thread blocks a ring collective's kernel holds while it runs (NCCL launches one per channel, each
# resident on one SM): 24 on NVSwitch nodes, both HGX A100 (NVIDIA/nccl-tests issue #100's log,
# "Channel 23/24") and H100 (NVIDIA developer forum, "Compute-Communication Overlap Causes Severe
# GEMM Performance Degradation because of Tail Effect", 2025: ncclAllGather of FSDP's prefetch
# launches 24 blocks on an H100's 132 SMs); 2 over PCIe (NVIDIA/nccl-tests issue #228's log,
# channels 00-01 via SHM). While it overlaps compute, the compute runs on the other SMs.
NCCL_CHANNEL_BLOCKS = {"nvlink": 24, "other": 2}


# What overlapped communication costs the compute beside it, per second of communication, on GPUs
# whose collectives run over their NVLink-class links. Lee et al. 2025, "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114,
# abstract (GPT and LLaMA training steps on 4x A100, H100, MI250 and MI210, each kernel timed alone
# and overlapped): overlapped compute runs a mean 18.9% slower than alone, and running compute and
# communication one after the other is a mean 10.2% slower than overlapping them. With compute C
# and communication M hidden behind it, (C + M) / (1.189 C) = 1.102 gives M = 0.310 C: the mean run
# loses 0.189 C of compute to 0.310 C of overlapped communication, 0.61 s per second. An upper
# bound of the mean: had any of those runs left communication exposed, M would be larger and the
# cost per second smaller. It holds more than the SMs the collective's blocks occupy (24 of an
# H100's 132: 0.18 s per second): the copies' memory traffic and the power they draw slow the
# compute's own kernels too. No per-GPU split is published, so it is one figure for every GPU.
OVERLAP_SLOWDOWN = 0.189
SEQUENTIAL_OVER_OVERLAPPED = 1.102
OVERLAPPED_COMPUTE_SECONDS_PER_SECOND = OVERLAP_SLOWDOWN / (SEQUENTIAL_OVER_OVERLAPPED * (1 + OVERLAP_SLOWDOWN) - 1)


def collective_kind(t: "Topology", ring: tuple[int, ...]) -> tuple[int, bool]:
    """(SMs a data-parallel collective's blocks hold while it runs, whether the ring's slowest link is
    NVLink-class), by the kind of that link (memoised per topology and ring: the plan search asks per option)."""
    key = (id(t), ring)
    hit = _COLLECTIVE_SMS.get(key)
    if hit is None or hit[0] is not t:
        if len(_COLLECTIVE_SMS) > 64:
            _COLLECTIVE_SMS.clear()
        nvlink = (ring_bottleneck_kind(t, ring) or "").startswith("nvlink")
        hit = _COLLECTIVE_SMS[key] = (t, (NCCL_CHANNEL_BLOCKS["nvlink" if nvlink else "other"], nvlink))
    return hit[1]


_COLLECTIVE_SMS: dict[tuple, tuple["Topology", tuple[int, bool]]] = {}


def contention_seconds(hidden_seconds, sms: int | None, t: "Topology", ring: tuple[int, ...], node_rate_share=1.0):
    """What overlapped communication costs the compute it hides behind, per second of it. Its
    blocks hold collective_kind's SMs for as long as it runs; over NVLink-class nodes, its
    copies' memory traffic and power slow the rest of the GPU too, in proportion to the bytes it
    moves a second: at the node's own ring rate (node_rate_share 1: inside the node, or NICs as
    fast) the measured mean OVERLAPPED_COMPUTE_SECONDS_PER_SECOND (0.61), through NICs slower than
    the node's ring that excess scaled by their rate over the ring's; over PCIe nodes the SM share
    alone (2 blocks on a slow link: the regime the measurement did not cover).
    ``node_rate_share``: the hidden seconds' mean rate over the node's ring rate (a number or one
    per option)."""
    if not sms or len(ring) < 2:
        return hidden_seconds * 0.0
    blocks, nvlink = collective_kind(t, ring)
    share = min(1.0, blocks / sms)
    if not nvlink:
        return hidden_seconds * share
    return hidden_seconds * (share + max(0.0, OVERLAPPED_COMPUTE_SECONDS_PER_SECOND - share) * node_rate_share)


# the step term of the data-parallel wrapper's copies on the compute stream (planner/time/step.py), which the
# pipeline and expert-parallel step rescales (planner/parallel/pipeline.py parallel_step)
COPIES_TERM = "sharding copies"
# the step term of the exposed communication inside each micro-batch (TP collectives, CP exchange), which a pipeline
# schedule runs inside its stages' compute and so stretches with its bubble (planner/parallel/pipeline.py parallel_step)
MODEL_PARALLEL_TERM = "TP/CP exposed inside micro-batches"


class StepTime(NamedTuple):
    """One step's time. A named tuple, not a dataclass: the plan search makes one per option it
    times, tens of thousands per plan (bench/plan_speed.py), and a tuple is built at a fraction
    of a frozen dataclass's cost; change one with ``_replace``."""

    compute_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    offload_seconds: float
    step_seconds: float
    tokens_per_second: float
    mfu: float
    ring_bandwidth_gbps: float
    ring: tuple[int, ...]
    hfu: float = 0.0  # hardware FLOPs (recomputation included) over peak
    # the step's parts: (name, source) shared by a plan's options, and their seconds per step: a
    # tuple of this option's, or (term_option not None) the array of every option's of its setting,
    # read at column term_option (step_times_of: the search shows a few of the options it times)
    term_labels: tuple[tuple[str, str], ...] = ()
    term_block: Any = ()
    term_option: int | None = None

    @property
    def term_values(self) -> tuple[float, ...]:
        """This option's seconds per term, in term_labels' order."""
        if self.term_option is None:
            return self.term_block
        return tuple(self.term_block[:, self.term_option].tolist())

    def term(self, name: str) -> float:
        """One term's seconds per step, 0.0 where the step has none of that name (this option's alone: the
        other options' columns are not read)."""
        for i, (term_name, _) in enumerate(self.term_labels):
            if term_name == name:
                return self.term_block[i] if self.term_option is None else float(self.term_block[i, self.term_option])
        return 0.0

    @property
    def terms(self) -> tuple[tuple[str, float, str], ...]:
        """(name, seconds per step, source) of each part that takes time (planner/time/kernels.py)."""
        return tuple((name, v, source) for (name, source), v in zip(self.term_labels, self.term_values) if v > 0)


class StepTimes(Sequence):
    """Every option's StepTime of one setting, each made when it is read (step_times_of): the plan
    search reads every option of a data-parallel setting, but a pipeline's rows are estimated option
    by option, so of its hundred options it reads one or a few."""

    __slots__ = ("_block", "_terms", "_ring_bandwidth_gbps", "_ring", "_labels")

    def __init__(self, block, ring_bandwidth_gbps: float, ring: tuple[int, ...],
                 term_labels: tuple[tuple[str, str], ...]):
        self._block, self._terms = block, block[8:]  # every option's term values, one array shared by them
        self._ring_bandwidth_gbps, self._ring, self._labels = ring_bandwidth_gbps, ring, term_labels

    def __len__(self) -> int:
        return self._block.shape[1]

    def least_compute_seconds(self) -> float:
        """The least compute of the options, read off the shared array (no StepTime made)."""
        return float(self._block[0].min())

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = range(len(self))[k]  # a negative index counts from the end; past the end: IndexError
        c, m, e, o, s, t, u, h = self._block[:8, k].tolist()
        return tuple.__new__(StepTime, (c, m, e, o, s, t, u, self._ring_bandwidth_gbps, self._ring, h, self._labels,
                                        self._terms, k))

    def __iter__(self):
        # each option's fields zipped into one tuple in C, then made a StepTime without a field-by-field copy
        c, m, e, o, s, t, u, h = self._block[:8].tolist()
        fields = zip(c, m, e, o, s, t, u, repeat(self._ring_bandwidth_gbps), repeat(self._ring), h,
                     repeat(self._labels), repeat(self._terms), range(len(self)))
        return map(partial(tuple.__new__, StepTime), fields)


def step_times_of(columns: list, ring_bandwidth_gbps: float, ring: tuple[int, ...],
                  term_labels: tuple[tuple[str, str], ...], options: int | None = None) -> Sequence[StepTime]:
    """One StepTime per option from the columns (compute, communication, exposed communication,
    offload, step, tokens/s, mfu, hfu, *term values: each a float, the same for every option, or
    an array of every option's), the ring and the labels shared; ``options``: how many (None: one
    option, every column a float).

    The plan search times tens of thousands of options and shows a few: with ``options``, a
    StepTimes whose options' eight ranked figures become floats when an option is read, the term
    values staying in one array per setting that each option reads when asked (StepTime.term_values)."""
    if options is None:
        c, m, e, o, s, t, u, h = (float(v) for v in columns[:8])
        values = tuple(float(v) for v in columns[8:])
        return [tuple.__new__(StepTime, (c, m, e, o, s, t, u, ring_bandwidth_gbps, ring, h, term_labels, values, None))]
    import numpy as np

    block = np.empty((len(columns), options))
    for i, column in enumerate(columns):
        block[i] = column  # a float fills its row
    return StepTimes(block, ring_bandwidth_gbps, ring, term_labels)


def matmul_parameters(a: Architecture) -> int:
    """Parameters used as matmul weights by one token: everything active but the embedding lookup
    (a tied head is a matmul with the embedding matrix)."""
    lookup = a.vocab_size * a.hidden_size + a.learned_positions * a.hidden_size
    head = a.vocab_size * a.hidden_size if a.tie_word_embeddings else 0
    return active_parameter_count(a) - lookup + head


def flops_per_token(a: Architecture, seq_len: int, checkpointing: str, every: int | None = None) -> float:
    """Forward and backward (3 x forward), plus what the checkpointing policy recomputes
    (activations.recompute_flops_per_token: the checkpointed blocks' forward under full, every
    second linear under selective-op, the attention core under selective-attention)."""
    forward = 2 * matmul_parameters(a) + 4 * a.num_layers * seq_len * a.q_width
    if checkpointing == "full" and every is None:
        # kept as it was (frozen_base_flops_per_token alike): the whole forward again, the LM head's
        # 2 x vocab x hidden included, which recompute_flops_per_token leaves out (the head is not
        # checkpointed); the time model's rewrite (issue 22) takes the function for every policy
        return forward * 4
    return forward * 3 + recompute_flops_per_token(a, seq_len, checkpointing, every)


def model_flops_per_token(a: Architecture, seq_len: int) -> float:
    """What MFU counts: forward + backward, no recomputation."""
    return 3 * (2 * matmul_parameters(a) + 4 * a.num_layers * seq_len * a.q_width)


def frozen_base_flops_per_token(a: Architecture, seq_len: int, checkpointing: str, adapter_forward_flops: float,
                                trained_weight_flops: float) -> tuple[float, float]:
    """(FLOPs per token the step runs, recomputation included; FLOPs per token MFU counts) when
    the base is frozen (LoRA, QLoRA).

    The 6N of a trained matmul is 2N forward, 2N for the input's gradient and 2N for the weight's
    (Narayanan et al. 2021, Sec. 5.1; Hu et al. 2021, LoRA, Sec. 4.2: no gradients for most
    parameters, "a 25% speedup during training on GPT-3 175B"). Autograd runs a frozen linear's
    backward for its input only (torch's linear backward computes grad_weight only when the weight
    requires it), so the base costs 2N + 2N = 4N. Attention's QKᵀ and AV have no weights: their
    backward stays twice their forward. The adapters (``adapter_forward_flops``: 2r(in + out) per
    target per token) train: 3x. ``trained_weight_flops``: the weight gradients of trained
    copies of frozen matmuls (PEFT's modules_to_save LM head, 2 x hidden x vocab). Full
    checkpointing reruns the forward, adapters included."""
    matmul = 2 * matmul_parameters(a)
    attention = 4 * a.num_layers * seq_len * a.q_width
    forward = matmul + attention + adapter_forward_flops
    backward = matmul + 2 * attention + 2 * adapter_forward_flops + trained_weight_flops
    recompute = forward if checkpointing == "full" else 0
    return forward + backward + recompute, forward + backward


def dequantize_seconds(bytes_moved: float, bandwidth_gbps: float) -> float:
    """A bandwidth-bound kernel (an elementwise dequantization: one read, one write per element)
    at the achieved fraction of the device memory's peak bandwidth."""
    return bytes_moved / (bandwidth_gbps * 1e9 * MEMORY_BANDWIDTH_EFFICIENCY)


# --- rings on the node's topology -------------------------------------------------------------

@lru_cache(maxsize=256)
def _best_ring(bandwidth: tuple[tuple[float, ...], ...], n: int) -> tuple[tuple[int, ...], float]:
    """The ring over GPUs 0..n-1 whose slowest link is fastest (NCCL searches rings the same way).
    Exhaustive for n <= 8 (5,040 rings), a nearest-neighbour chain beyond.

    The exhaustive search is a depth-first walk in itertools.permutations order that keeps the
    first ring strictly better than the best so far, so it answers what trying all 5,040 rings
    answers; it leaves a prefix whose slowest link so far cannot beat the best, and stops once the
    best is the fastest link there is (an NVSwitch box's first ring: 13 ms of every estimate before)."""
    if n == 1:
        return (0,), float("inf")
    if n <= 8:
        ceiling = max(bandwidth[i][j] for i in range(n) for j in range(n) if i != j)
        best: list = [(), -1.0]
        ring, used = [0], [True] + [False] * (n - 1)

        def extend(bottleneck: float) -> None:
            last = ring[-1]
            if len(ring) == n:
                bw = min(bottleneck, bandwidth[last][0])
                if bw > best[1]:
                    best[0], best[1] = tuple(ring), bw
                return
            for j in range(1, n):
                if used[j]:
                    continue
                if best[1] >= ceiling:
                    return  # nothing can be strictly faster than the fastest link
                b = min(bottleneck, bandwidth[last][j])
                if b <= best[1]:
                    continue  # every ring through this prefix is at most b
                used[j] = True
                ring.append(j)
                extend(b)
                ring.pop()
                used[j] = False

        extend(float("inf"))
        return best[0], best[1]
    ring, left = [0], set(range(1, n))
    while left:
        last = ring[-1]
        nxt = max(left, key=lambda j: bandwidth[last][j])
        ring.append(nxt)
        left.remove(nxt)
    return tuple(ring), min(bandwidth[ring[k]][ring[(k + 1) % n]] for k in range(n))


def node_ring(t: Topology, n: int) -> tuple[tuple[int, ...], float, float]:
    """(ring, bottleneck GB/s, worst hop latency µs) over the node's first n GPUs."""
    return ring_over(t, tuple(range(n)))


# ring_over's answers per topology (the plan search asks the same few groups for every setting):
# keyed by the Topology object, which is frozen; the last few topologies are kept
_RINGS: dict[int, tuple[Topology, dict[tuple[int, ...], tuple[tuple[int, ...], float, float]]]] = {}


def ring_over(t: Topology, members: tuple[int, ...]) -> tuple[tuple[int, ...], float, float]:
    """(ring, bottleneck GB/s, worst hop latency µs) over these GPUs of the node (HSDP's replica
    groups inside a node take every shard-size-th GPU)."""
    held = _RINGS.get(id(t))
    if held is None or held[0] is not t:
        if len(_RINGS) >= 8:
            _RINGS.clear()
        held = _RINGS[id(t)] = (t, {})
    members = tuple(members)
    if members not in held[1]:
        held[1][members] = _ring_over(t, members)
    return held[1][members]


def _ring_over(t: Topology, members: tuple[int, ...]) -> tuple[tuple[int, ...], float, float]:
    size = len(t.gpus)
    bw = [[0.0] * size for _ in range(size)]
    lat = [[0.0] * size for _ in range(size)]
    for link in t.links:
        bw[link.a][link.b] = bw[link.b][link.a] = link.bandwidth_gbps
        lat[link.a][link.b] = lat[link.b][link.a] = link.latency_us
    n = len(members)
    local, bottleneck = _best_ring(tuple(tuple(bw[i][j] for j in members) for i in members), n)
    ring = tuple(members[k] for k in local)
    latency = max((lat[ring[k]][ring[(k + 1) % n]] for k in range(n)), default=0.0) if n > 1 else 0.0
    return ring, bottleneck, latency


def ring_bottleneck_kind(t: Topology, ring: tuple[int, ...]) -> str | None:
    """The link type (data/links.yaml kind) of the ring's slowest hop, None for one GPU."""
    if len(ring) < 2:
        return None
    links = {frozenset((k.a, k.b)): k for k in t.links}
    hops = [links[frozenset((ring[i], ring[(i + 1) % len(ring)]))] for i in range(len(ring))]
    return min(hops, key=lambda k: k.bandwidth_gbps).kind


def ring_collective_seconds(volume_bytes: float, ranks: int, bandwidth_gbps: float, latency_us: float,
                            message_bytes: float, phases: int) -> float:
    """α-β time of `phases` ring passes (reduce-scatter = 1, all-gather = 1, all-reduce = 2) over
    `volume_bytes`, split into messages of `message_bytes`."""
    if ranks <= 1 or volume_bytes <= 0:
        return 0.0
    messages = max(1.0, volume_bytes / max(message_bytes, 1.0))
    bandwidth_term = phases * (ranks - 1) / ranks * volume_bytes / (bandwidth_gbps * 1e9)
    latency_term = phases * (ranks - 1) * messages * latency_us * 1e-6
    return bandwidth_term + latency_term


def fabric(name: str) -> dict:
    """A fabric's rates from data/links.yaml; an unknown name is the user's error (exit 2 / 422)."""
    fabrics = link_rates()["fabric"]
    if name not in fabrics:
        from planner.errors import PlannerError, unknown

        raise PlannerError(f"fabric: {unknown('fabric', name, list(fabrics))}", field="fabric")
    return fabrics[name]


# --- collectives over groups that may span nodes ------------------------------------------------

@dataclass(frozen=True)
class Group:
    """One process group as the time model sees it. Ranks are numbered node by node (torchrun and
    the deepspeed launcher both do), so a group of consecutive ranks fills a node first."""

    ranks: int  # members of the group
    per_node: int  # of them on each node it spans
    sharing_nics: int  # groups like it crossing the same node's NICs at the same moment

    @property
    def nodes(self) -> int:
        return max(1, self.ranks // max(self.per_node, 1))


@dataclass(frozen=True)
class Wire:
    """What one group's collective runs on: the ring over its members inside a node (the node's
    links), and the node's NICs (all of them together, one direction, achieved GB/s)."""

    intra_gbps: float
    intra_latency_us: float
    nic_gbps: float
    nic_latency_us: float


@dataclass(frozen=True)
class CollectiveTime:
    """Per micro-batch setting when the volume is an array, else one number each."""

    seconds: "np.ndarray | float"
    tree: "np.ndarray | bool"  # NCCL's Tree algorithm chosen (across nodes, all-reduce), else the ring
    bottleneck_gbps: "np.ndarray | float"  # the bandwidth the chosen algorithm ran at

    @property
    def algorithm(self) -> "np.ndarray | str":
        """"ring" (inside a node, or NCCL's flat ring across nodes) or "tree", per setting."""
        return arrays.where(self.tree, "tree", "ring")


def _ring(volume, ranks: int, bandwidth_gbps: float, pass_latency_us: float, message_bytes: float, phases: int):
    """ring_collective_seconds over a volume or an array of them, with the latency of one pass of
    one message around the ring given whole (the sum along its hops: NCCL pipelines chunks hop to hop)."""
    messages = arrays.maximum(1.0, volume / max(message_bytes, 1.0))
    seconds = phases * (ranks - 1) / ranks * volume / (bandwidth_gbps * 1e9) + \
        phases * messages * pass_latency_us * 1e-6
    return arrays.where(volume > 0, seconds, 0.0)


def collective_seconds(volume_bytes, group: Group, wire: Wire, message_bytes: float, passes: int) -> CollectiveTime:
    """One collective (passes: 1 = all-gather or reduce-scatter, 2 = all-reduce) over `group`;
    volume_bytes is one number (then so is each answer) or an array (one per micro-batch size).
    The same formulas either way (planner/time/arrays.py): a single estimate never imports numpy."""
    v = arrays.as_float(volume_bytes)
    if group.ranks <= 1:
        out = CollectiveTime(arrays.zeros_like(v), False, arrays.full_like(v, math.inf))
    elif group.nodes == 1:
        out = CollectiveTime(_ring(v, group.ranks, wire.intra_gbps, (group.ranks - 1) * wire.intra_latency_us,
                                   message_bytes, passes),
                             False, wire.intra_gbps)
    else:
        nic_share = wire.nic_gbps / group.sharing_nics
        ring_bw = min(wire.intra_gbps, nic_share)
        # a pass visits ranks - 1 hops, of which one per node boundary crosses the fabric
        crossings = group.nodes
        pass_latency = (group.ranks - 1 - crossings) * wire.intra_latency_us + crossings * wire.nic_latency_us
        ring = _ring(v, group.ranks, ring_bw, pass_latency, message_bytes, passes)
        if passes != 2:  # NCCL's Tree runs all-reduce only
            return CollectiveTime(ring, False, ring_bw)
        tree = tree_all_reduce_seconds(v, group, wire, nic_share, message_bytes)
        use_tree = tree < ring
        out = CollectiveTime(arrays.where(use_tree, tree, ring), use_tree,
                             arrays.where(use_tree, nic_share, ring_bw))
    return out


def tree_all_reduce_seconds(volume_bytes, group: Group, wire: Wire, nic_share: float, message_bytes: float):
    """NCCL's Tree all-reduce: reduce along a chain inside the node, a double binary tree across
    nodes, broadcast back along the chain; pipelined, so the slowest stage sets the pace. Across
    nodes each node sends (and receives) 2x the payload, except on 2 nodes, where each of the two
    trees is one edge and a node sends 1x (NVIDIA/nccl#457: 'for tree it would be 2*S'; the '2-node
    tree effect' of NVIDIA/nccl-tests#196). The chain moves the payload up and down its links in
    opposite directions: 1x per direction."""
    across = (1.0 if group.nodes == 2 else 2.0) * volume_bytes / (nic_share * 1e9)
    inside = volume_bytes / (wire.intra_gbps * 1e9) if group.per_node > 1 else arrays.zeros_like(volume_bytes)
    messages = arrays.maximum(1.0, volume_bytes / max(message_bytes, 1.0))
    # up and down: the chain inside the node, then the tree's levels across nodes
    latency_us = 2 * ((group.per_node - 1) * wire.intra_latency_us
                      + math.ceil(math.log2(group.nodes)) * wire.nic_latency_us)
    seconds = arrays.maximum(across, inside) + messages * latency_us * 1e-6
    return arrays.where(volume_bytes > 0, seconds, 0.0)
