"""Reserved memory: the step's allocations replayed through the caching allocator, plus the memory
outside it (the CUDA context, NCCL's buffers). Simulated until bench/gpu_check.py has measured it.

The allocation stream comes from the phase model (planner/frameworks/*: a PhasePlan of typed
moments, each the list of MemoryItems live then), for an analytic model and a traced one alike (the
trace's per-parameter numels and its hidden-state tensor size stand in for the architecture's). An item that appears between two moments is
allocated, one that disappears is freed, one whose size changes frees or allocates the difference
in whole tensors. Each item is cut into the tensors the allocator sees:
- saved activations: [micro_batch, seq_len / cp, hidden] tensors in the compute dtype (what a
  block saves is mostly of that shape: its inputs, norms' outputs, attention outputs);
- model states (weights, gradients, optimizer states, frozen weights): one tensor per parameter
  where the framework keeps them so (Framework.state_tensors_per_parameter: FSDP2's per-parameter
  shards, DDP), else one flat buffer (DeepSpeed's partitions);
- buffers: one tensor each, on the stream the framework allocates them under (MemoryItem.stream:
  FSDP2's all-gather output on all_gather_stream, its reduce-scatter input on reduce_scatter_stream).
A tensor allocated on a side stream and freed is used by the compute stream until the next moment
(record_stream semantics: FSDP2 holds the buffer until the consumer's wait): its block returns to
its pool one moment later. Frees precede allocations within a moment, so the allocated peak is the
phase model's live peak rounded as the allocator rounds. Two steps are replayed (the second starts
with the first's cache), then the resident set.

The phase model lists the moments backward can peak at; the cache is shaped by what comes before
them too (loss_tensors): for transformers' loss, each block's forward and the LM head's, and the
logits-sized tensors as the single allocations they are. bench/gpu_check.py on an H200 (Llama-3-8B
width, 2 layers, 128k vocabulary): with them the replayed reserved peak went from -21.5% / -13.5%
to -2.0% / -5.2% of the measured for QLoRA nf4 8192 x 2 (checkpointed) / fp4 4096 x 2, and from
-1.2..+18.4% to -0.9..+13.0% for the DDP grid. What remains under is not accounted for: the
replayed stream carries about a third of the bytes the device allocated in a step
(memory_stats allocated_bytes.all.allocated), the transients inside each phase left out.
So the reserved peak an estimate reports, and judges the fit on, holds back the replay's largest
measured shortfall (the calibration's replay_shortfall, which bench/gpu_report.py computes from the
measured runs under the current model) on top of the replayed reserve: a bound from measurement
for what the stream does not carry, not a model of it.
"""

from __future__ import annotations

import json
import math
from itertools import groupby
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from planner.cluster import cuda_context
from planner.memory.allocator import AllocConf, AllocatorStats, OutOfMemory, parse_alloc_conf, single_events
from planner.memory.fast_replay import replay
from planner.memory.buffers import SAVED, TRANSIENTS, item
from planner.memory.moments import PhaseKind
from planner.schema import AllocatorSummary, MemoryItem, Phase

if TYPE_CHECKING:
    from planner.memory.phase_plan import PhasePlan
    from planner.model.activations import Activations
    from planner.setup import Setup

# NCCL's buffers per connection and channel, one per protocol (NVIDIA/nccl src/include/device.h):
# LL: NCCL_LL_LINES_PER_THREAD 8 x NCCL_LL_MAX_NTHREADS 512 x NCCL_STEPS 8 x 16-byte ncclLLFifoLine
NCCL_LL_BYTES = 8 * 512 * 8 * 16
# LL128: NCCL_LL128_ELEMS_PER_THREAD 120 x NCCL_LL128_MAX_NTHREADS 640 x NCCL_STEPS 8 x 8 bytes
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
# Simple: NCCL_BUFFSIZE, default 4 MiB (NCCL user guide, Environment Variables: NCCL_BUFFSIZE 4194304)
NCCL_BUFFSIZE_DEFAULT = 4 * 2**20
# Channels: NCCL opens up to 32 per communicator on NVLink nodes (NVIDIA/nccl#1685: "as many as 32
# channels" on 8 x H100; memory "linearly tied to the number of channels", sjeaugey in #986), and
# a ring keeps 2 connections per channel "regardless of the scale" (#986). 32 x 2 x 9.2 MiB =
# 588 MiB per communicator; NVIDIA/nccl#964 measured 544-688 MB per process group on 4 A100.
NCCL_CHANNELS = 32
NCCL_RING_CONNECTIONS = 2
# NVLS (NVLink SHARP: NVSwitch multicast), on by default where the device supports multicast
# (NCCL_NVLS_ENABLE 2: "enable if supported"; NVIDIA/nccl src/transport/nvls.cc ncclNvlsInit: not for a
# communicator of 2 GPUs or fewer). ncclNvlsBufferSetup: buffSize = nvlsChunkSize x NCCL_STEPS, per
# rank nvlsChannels x 2 x buffSize for each of nHeads heads (every GPU of the node is a head), in
# unicast memory the multicast object maps. NCCL_NVLS_CHUNKSIZE default 128 KiB (NCCL user guide,
# Environment Variables), NCCL_STEPS 8 (src/include/device.h), NCCL_NVLS_NCHANNELS 16
# (nvls.cc NCCL_PARAM(NvlsChannels, "NVLS_NCHANNELS", 16)). NCCL 2.27 (torch 2.13's pin,
# .ci/docker/ci_commit_pins/nccl-cu12.txt v2.27.5-1). The GPUs with NVSwitch multicast:
# data/cuda_context.yaml nvls_gpus.
NVLS_CHUNK_BYTES = 128 * 1024
NCCL_STEPS = 8
NVLS_CHANNELS = 16
# torchtitan's ParallelDims.build_mesh, outer to inner: a dimension's ranks are consecutive in steps of
# the product of the dimensions inside it (tp innermost, on one node where it fits)
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# at most this many tensors per item (beyond it the tensors grow): keeps a replay within a few ms
MAX_TENSORS_PER_ITEM = 256
CALIBRATION_PATH = Path(__file__).parents[1] / "data" / "allocator_calibration.json"
STATE_COMPONENTS = ("parameters", "gradients", "optimizer_states", "frozen_weights")


@dataclass(frozen=True)
class Reserved:
    conf: AllocConf
    stats: AllocatorStats
    other: AllocatorStats | None  # the same stream with expandable_segments switched (None: not replayed)
    cuda_context_bytes: int
    nccl_bytes: int
    communicators: tuple[str, ...]
    fits: bool  # the replay at the device's capacity completes without an out-of-memory
    measured: bool
    shortfall_bytes: int = 0  # held back for the transients the stream leaves out (replay_shortfall)

    @property
    def reserved_peak_bytes(self) -> int:
        return self.stats.reserved_peak_bytes + self.shortfall_bytes + self.cuda_context_bytes + self.nccl_bytes

    def summary(self) -> AllocatorSummary:
        return AllocatorSummary(
            alloc_conf=self.conf.text, allocated_peak_bytes=self.stats.allocated_peak_bytes,
            active_peak_bytes=self.stats.active_peak_bytes, reserved_peak_bytes=self.stats.reserved_peak_bytes,
            segments_peak=self.stats.segments_peak, other_reserved_peak_bytes=self.other.reserved_peak_bytes,
            other_alloc_conf=self.conf.with_expandable(not self.conf.expandable_segments).text,
            communicators=list(self.communicators), measured=self.measured,
            replay_shortfall_bytes=self.shortfall_bytes)


# --- calibration (written by bench/gpu_check.py) ---------------------------------------------

def _calibration_file(path: Path) -> dict:
    """The calibration file bench/gpu_report.py writes, read once; {} without one (or another format)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if data.get("format") == 1 else {}


def load_calibration(path: Path = CALIBRATION_PATH) -> dict:
    """The measured terms by GPU name, when a GPU has measured them; {} otherwise. Format:
    {"format": 1, "torch": "2.13.0", "gpus": {NAME: {"cuda_context_bytes": int,
    "nccl_bytes_per_communicator": int, "driver": str, "runs": [...]}}} (bench/gpu_check.py)."""
    return _calibration_file(path).get("gpus", {})


_FILE = _calibration_file(CALIBRATION_PATH)  # read once at import
_CALIBRATION = _FILE.get("gpus", {})
# the largest fraction by which a measured reserved peak exceeded the replayed one (0 without a calibration)
REPLAY_SHORTFALL = float(_FILE.get("replay_shortfall", {}).get("fraction", 0.0))


# --- the terms outside the allocator ---------------------------------------------------------

@dataclass(frozen=True)
class Communicator:
    name: str  # "dp_shard(8)"
    size: int
    intra_node: bool  # all its ranks on one node


def communicator_groups(setup: "Setup") -> list[Communicator]:
    """The NCCL communicators a rank uses: one per mesh dimension of more than one rank
    (torchtitan's ParallelDims.build_mesh: FSDP2/HSDP's dp_replicate and dp_shard, tp, pp, whose
    send/recv go through batch_isend_irecv on the pp group's communicator, cp, ep), and the
    flattened dp_shard x cp FSDP shards over."""
    dims, per_node = setup.dims.as_dict(), setup.request.gpus
    stride, inner = {}, 1
    for name in reversed(MESH_ORDER):
        stride[name], inner = inner, inner * dims[name]
    stride["ep"] = dims["tp"]  # experts are spread over dp_shard x cp, inside tp

    def group(name: str, n: int, step: int) -> Communicator:
        return Communicator(f"{name}({n})", n, step * n <= per_node)

    found = [group(name, n, stride[name]) for name, n in dims.items() if n > 1]
    if dims["dp_shard"] > 1 and dims["cp"] > 1:
        found.append(group("dp_shard_cp", dims["dp_shard"] * dims["cp"], dims["tp"]))
    return found


def communicators(setup: "Setup") -> tuple[str, ...]:
    return tuple(c.name for c in communicator_groups(setup))


def nccl_communicator_bytes(buffsize: int | None) -> int:
    """One communicator's ring buffers: channels x ring connections x (LL + LL128 + Simple)."""
    simple = buffsize if buffsize is not None else NCCL_BUFFSIZE_DEFAULT
    return NCCL_CHANNELS * NCCL_RING_CONNECTIONS * (NCCL_LL_BYTES + NCCL_LL128_BYTES + simple)


def nvls_bytes(setup: "Setup", comm: Communicator) -> int:
    """NVLS's buffers for one communicator: on an NVSwitch GPU with multicast, a communicator of
    more than 2 GPUs within the node (ncclNvlsBufferSetup: channels x 2 x chunk x steps per head)."""
    if not (cuda_context.nvls_capable(setup.gpu.name) and comm.intra_node and comm.size > 2):
        return 0
    return NVLS_CHANNELS * 2 * NVLS_CHUNK_BYTES * NCCL_STEPS * comm.size


def nccl_bytes(setup: "Setup") -> int:
    """NCCL's buffers over the rank's communicators: the ring's (measured per communicator when
    calibrated and NCCL_BUFFSIZE is not set) and NVLS's where it applies; and under async TP its
    symmetric-memory workspace (symmetric_memory_bytes), the other communication buffer outside the allocator."""
    req = setup.request
    per_comm = _CALIBRATION.get(setup.gpu.name, {}).get("nccl_bytes_per_communicator")
    if per_comm is None or req.nccl_buffsize_bytes is not None:
        per_comm = nccl_communicator_bytes(req.nccl_buffsize_bytes)
    return sum(per_comm + nvls_bytes(setup, c) for c in communicator_groups(setup)) + symmetric_memory_bytes(setup)


def symmetric_memory_bytes(setup: "Setup") -> int:
    """Async TP's workspace on the TP group, 0 without it: allocated by the symmetric-memory allocator
    (empty_strided_p2p, mapped by every rank of the group), not the caching allocator, at the largest size
    any fused op asks and kept (torch 2.13 distributed/_symmetric_memory/__init__.py get_symm_mem_workspace).
    An all-gather with its matmuls asks its input shard (1/tp of a micro-batch's activation,
    _pipelined_multi_all_gather_and_consume); a matmul with its reduce-scatter two of its output's tp chunks
    (_pipelined_produce_and_all2all: one being filled while a peer reads the other): 2/tp of the activation."""
    req = getattr(setup, "request", None)
    if req is None or not getattr(req, "async_tp", False) or setup.dims.tp == 1:
        return 0
    unit = _activation_unit(setup)
    return 2 * (unit or 0) // setup.dims.tp


# --- the allocation stream -------------------------------------------------------------------

def _activation_unit(setup: "Setup") -> int | None:
    """The tensor size the saved activations are cut into: [micro_batch, seq_len / cp, hidden] in
    the compute dtype, from the architecture or, for a traced model, from its trace."""
    arch, req = setup.arch, setup.request
    if arch is None:
        traced = setup.model.traced
        return traced.hidden_state_bytes or None if traced is not None else None
    return req.micro_batch * max(1, req.seq_len // setup.cp) * arch.hidden_size * setup.recipe.compute_bytes


@dataclass(frozen=True)
class LossTensors:
    """The forward pass and the causal-LM loss's logits-sized tensors, which the phase model (the
    moments backward can peak at) leaves out of the stream: before the loss's backward, each
    block's forward (``blocks``: the saved activations live while block k runs, forward order:
    the sets kept by the blocks before it, its own, and under checkpointing the whole set it
    computes and lets go), whose freed blocks stay cached; then the LM head's and the loss's
    forward (``forward``) beside the saved set, and the loss's backward (``backward``: the phase
    model's transient at the start of backward, the same bytes). Each loss tensor is one
    allocation of its whole size, as the caching allocator sees it (cut into activation-sized
    pieces they would pack into any freed space); ``saved``, carved out of the saved set, are the
    LM head's 16-bit weight copy where its matmul saves one (Activations.head_weight_copy_bytes:
    autocast caches no cast of a frozen weight, aten/src/ATen/autocast_mode.cpp cached_cast needs
    ``requires_grad()`` and a leaf) and the fp32 log-probabilities, in the order the head makes them."""
    forward: tuple[int, ...]
    backward: tuple[int, ...]
    saved: tuple[int, ...]
    blocks: tuple[int, ...] = ()


def loss_tensors(setup: "Setup", acts: "Activations | None") -> LossTensors | None:
    """transformers' loss (planner/model/activations.py _loss_saved, _loss_transient; loss_utils.py
    ForCausalLMLoss): the forward's logits in the training dtype (the model's output, let go when
    the loop takes ``.loss``) and their fp32 upcast (freed when the loss returns), beside the
    fp32 log-probabilities the saved set holds; then in backward nll_loss's fp32 gradient and
    log_softmax's. Kept outputs (with_held_outputs) already hold the logits. None where the loss's
    tensors are not these: chunked and fused losses, vocab-parallel, activation offloading, a
    pipeline stage (its own schedule)."""
    req = setup.request
    if (acts is None or req.loss != "hf" or setup.loss_chunks > 1 or acts.host_offload or setup.dims.pp > 1
            or acts.loss_transient_bytes <= 0 or acts.loss_transient_bytes % 2):
        return None
    fp32 = acts.loss_transient_bytes // 2
    b = setup.recipe.compute_bytes
    logits = () if req.keeps_outputs else (fp32 * b // 4,)
    upcast = (fp32,) if b != 4 else ()
    blocks, kept = [], 0
    for k in range(acts.num_layers):
        _, rebuilt, own = acts.backward_of(acts.num_layers - 1 - k)
        blocks.append(kept + own + rebuilt)
        kept += own
    saved = tuple(b for b in (acts.head_weight_copy_bytes, fp32) if b)
    return LossTensors(forward=logits + upcast, backward=(fp32, fp32), saved=saved, blocks=tuple(blocks))


def _with_loss_tensors(phases: list[Phase], loss: LossTensors | None) -> list[list[MemoryItem]]:
    """The phases' items; the loss's moment (start of backward, where its transient is the loss's)
    preceded by each block's forward (its saved set, or under checkpointing the whole set it
    computes, on top of what the blocks before it keep), then the LM head's and the loss's
    forward, and its transient made the loss's own tensors (buffers: one tensor per item). No
    moment exceeds the phases' largest: a block's forward holds less than its backward start, the
    loss's forward less than its backward."""
    moments = []
    for p in phases:
        transient = next((i for i in p.items if i.name == TRANSIENTS), None)
        if loss is None or p.kind != PhaseKind.START_OF_BACKWARD or transient is None \
                or transient.bytes != sum(loss.backward):
            moments.append(list(p.items))
            continue
        saved = next((i for i in p.items if i.name == SAVED), None)
        if saved is None or saved.bytes < sum(loss.saved):
            moments.append(list(p.items))
            continue
        states = [i for i in p.items if i is not transient and i is not saved]
        moments += [states + [item(SAVED, live, "activations")] for live in loss.blocks]
        rest = states + [item(SAVED, saved.bytes - sum(loss.saved), "activations")] + [
            item(f"the head's saved tensor {n}", b, "buffers") for n, b in enumerate(loss.saved)]
        moments.append(rest + [item(f"the loss's forward tensor {n}", b, "buffers") for n, b in enumerate(loss.forward)])
        moments.append(rest + [item(f"the loss's backward tensor {n}", b, "buffers") for n, b in enumerate(loss.backward)])
    return moments


def _moments(plan: "PhasePlan", loss: LossTensors | None = None) -> list[list[MemoryItem]]:
    step = [list(plan.resident)] + _with_loss_tensors(plan.phases, loss)
    return step + step + [list(plan.resident)]


def _key(i: MemoryItem) -> tuple[str, str]:
    """What identifies an item's tensors from one moment to the next: its component and stream.
    Items of a component are concatenated in the phase's order, and the tensors a moment shares
    with the one before (the longest common prefix of sizes) are kept: a gradient renamed between
    moments ("sharded gradients", then "gradients" at the optimizer step) is the same tensors."""
    return (i.component, i.stream)


def _units(setup: "Setup", moments: list[list[MemoryItem]], parameters: int) -> dict[tuple, int | None]:
    """The tensor size each item key is cut into (fixed over the step, so a growing item keeps
    its earlier tensors)."""
    largest: dict[tuple, int] = {}
    for items in moments:
        for i in items:
            key = (i.component, i.stream)  # _key written out
            largest[key] = max(largest.get(key, 0), i.bytes)
    per_parameter = setup.framework.state_tensors_per_parameter and parameters > 1
    act = _activation_unit(setup)
    units: dict[tuple, int | None] = {}
    for key, most in largest.items():
        unit = None
        if key[0] == "activations":
            unit = act
        elif key[0] in STATE_COMPONENTS and per_parameter:
            unit = -(-most // parameters)
        if unit is not None:
            unit = max(unit, -(-most // MAX_TENSORS_PER_ITEM), 1)
        units[key] = unit
    return units


def _cut(item_bytes: list[int], unit: int | None) -> list[int]:
    """The tensors a key's items are cut into, in order: each item in tensors of ``unit`` bytes
    and its remainder (None: each item whole)."""
    out: list[int] = []
    for nbytes in item_bytes:
        if unit is None or unit >= nbytes:
            out.append(nbytes)
            continue
        out += [unit] * (nbytes // unit)
        if nbytes % unit:
            out.append(nbytes % unit)
    return out


def _common_prefix(held: list[int], sizes: list[int]) -> int:
    """How many leading tensors two moments share (equal sizes in the same places); the whole
    shorter list, the usual case (a set that only grows), is compared at once, else the first
    difference is found by bisection, each step comparing the slices not yet known equal (a
    shrinking set of thousands of activation tensors: a few list comparisons, not a loop over them)."""
    n = min(len(held), len(sizes))
    if held[:n] == sizes[:n]:
        return n
    if held[:n - 1] == sizes[:n - 1]:  # the next usual case: a set's last tensor (a cut's remainder) changed
        return n - 1
    keep, differs = 0, n - 1  # held[:keep] == sizes[:keep]; the first difference is before ``differs``
    while keep + 1 < differs:
        mid = (keep + differs) // 2
        if held[keep:mid] == sizes[keep:mid]:
            keep = mid
        else:
            differs = mid
    return keep


def allocation_events(setup: "Setup", plan: "PhasePlan", parameters: int, loss: LossTensors | None = None) -> list[tuple]:
    """The step as ("malloc", tag, bytes, stream) / ("free", tag) / ("record", tag, stream) /
    ("complete", stream) events (planner/memory/allocator.py replay). ``loss``: the loss's own
    tensors (loss_tensors), in their moments."""
    return single_events(allocation_runs(setup, plan, parameters, loss))


def allocation_runs(setup: "Setup", plan: "PhasePlan", parameters: int, loss: LossTensors | None = None) -> list[tuple]:
    """allocation_events with the mallocs of a key's tensors of one size in a row as one
    ("mallocs", first tag, count, bytes, stream) and the frees of a key's tensors on the compute
    stream as one ("frees", tags) (decreasing: the newest first), as replay takes them
    (fast_replay replays a run of blocks at a time).

    The moments are the resident set, a step, the resident set, the step again and the resident
    set (_moments); the second step and the resident set after it are written as a copy of the
    first's events, its tags moved (_second_step). Proof that the copy is what the loop below
    would write: the loop's state at a moment's start is, per key, its live tensors' tags, their
    sizes (``held``) and the items they were cut from (``live_bytes``). After the resident
    moments 0 and 1 + len(step) alike, a key of the resident set holds the cut of its items
    there, the same items both times, and every other key holds nothing (a key the moment lacks
    is freed whole; one that holds nothing writes no event, wherever it stands in ``tags``). So
    from equal states the same moments write the same events but for the tags: a tag made in
    the first step is the one the second makes as many mallocs later (the BLAS workspaces, made
    once at moment 1, carry names, not numbers), and a tensor the resident set held at the
    first step's start is the one in the same place of its key's list at the second's."""
    moments = _moments(plan, loss)
    first = moments[:(len(moments) + 1) // 2]  # the resident set, the step, the resident set
    units = _units(setup, first, parameters)
    tags: dict[tuple, list[int]] = {}  # key -> its live tensors' tags, in allocation order
    held: dict[tuple, list[int]] = {}  # key -> its live tensors' bytes, in the same order
    live_bytes: dict[tuple, list[int]] = {}  # key -> the item sizes its live tensors were cut from
    events: list[tuple] = []
    tag = 0
    for n, items in enumerate(first):
        if n == 1:  # the first matmul: the BLAS workspaces, kept for the process's life (CublasHandlePool.cpp)
            start_tags = {key: list(t) for key, t in tags.items()}  # the resident set's, at the step's start
            start_tag = tag
            events += [("malloc", f"blas workspace {i}", size, "default")
                       for i, size in enumerate(cuda_context.blas_workspaces(setup.gpu.name))]
            start = len(events)
        totals: dict[tuple, list[int]] = {}
        for i in items:
            totals.setdefault((i.component, i.stream), []).append(i.bytes)  # _key written out
        # an item of the same size as before is the same tensors (the cut depends on the bytes alone)
        want = {key: [] if live_bytes.get(key) == b else _cut(b, units[key]) for key, b in totals.items()}
        recorded = False
        for key in list(tags):
            sizes = want.get(key)
            if sizes is not None and not sizes and live_bytes.get(key) == totals[key]:
                continue
            key_tags = tags[key]
            keep = _common_prefix(held[key], sizes) if sizes else 0
            gone = key_tags[keep:]
            if gone:
                gone.reverse()
                if key[1] != "default":  # used on the compute stream: record_stream semantics
                    for t in gone:
                        events += (("record", t, "default"), ("free", t))
                    recorded = True
                else:
                    events.append(("frees", gone))
                del key_tags[keep:], held[key][keep:]
            live_bytes.pop(key, None)
        for key, sizes in want.items():
            if not sizes:
                continue
            live_bytes[key] = totals[key]
            key_tags, key_held = tags.setdefault(key, []), held.setdefault(key, [])
            new = sizes[len(key_held):]
            if new:
                stream = key[1]
                key_tags += range(tag, tag + len(new))
                for size, run in groupby(new):
                    count = len(list(run))
                    events.append(("mallocs", tag, count, size, stream))
                    tag += count
            key_held[:] = sizes
        if recorded:
            events.append(("complete", "default"))  # processed at the next moment's first malloc
    moved = {t: after for key, before in start_tags.items() for t, after in zip(before, tags[key])}
    return events + _second_step(events[start:], start_tag, tag - start_tag, moved)


def _second_step(events: list[tuple], made: int, shift: int, moved: dict[int, int]) -> list[tuple]:
    """The events of the first step and the resident set after it (allocation_runs) with their tags
    moved to the second step's: a tag from ``made`` on by ``shift`` (the tags the first step
    made), an older one, the resident set's, as ``moved`` maps it. The order of a "frees" list is
    kept (moved tags are older than the step's own)."""
    out: list[tuple] = []
    append = out.append
    for e in events:
        op = e[0]
        if op == "mallocs":
            append(("mallocs", e[1] + shift, e[2], e[3], e[4]))
        elif op == "frees":
            gone = e[1]
            if gone[-1] >= made:  # the newest first: all the step's own
                append(("frees", [t + shift for t in gone]))
            else:
                append(("frees", [t + shift if t >= made else moved[t] for t in gone]))
        elif op == "complete":
            append(e)
        else:  # a record or a free of one tensor
            t = e[1]
            append((op, t + shift if t >= made else moved[t]) + e[2:])
    return out


def simulate(setup: "Setup", plan: "PhasePlan", parameters: int, capacity_bytes: int,
             compare: bool = True, loss: LossTensors | None = None) -> Reserved:
    """The step's reserved memory under the request's allocator settings, the same with
    expandable_segments switched (``compare``), and whether the replay fits the device (the
    allocator empties its cache and retries before it reports out of memory)."""
    req = setup.request
    conf = parse_alloc_conf(req.alloc_conf)
    calibrated = _CALIBRATION.get(setup.gpu.name, {})
    context = calibrated.get("cuda_context_bytes", setup.gpu.cuda_context_bytes)
    comms = communicators(setup)
    nccl = nccl_bytes(setup)
    events = allocation_runs(setup, plan, parameters, loss)
    stats = replay(events, conf)
    other = replay(events, conf.with_expandable(not conf.expandable_segments)) if compare else None
    shortfall = 0 if setup.gpu.is_cpu else math.ceil(REPLAY_SHORTFALL * stats.reserved_peak_bytes)
    room = capacity_bytes - context - nccl - shortfall
    fits = room > 0 and stats.reserved_peak_bytes <= room
    # a replay capped at the room cannot hold more requested bytes than the room: every live block
    # holds at least its request (round_size rounds up; a block found or a segment made holds the
    # rounded size), live blocks do not overlap and lie in reserved segments, and alloc_block never
    # reserves past the capacity. The requested bytes live after each event are the events' own
    # (a free returns its malloc's request), the same capped or not: past the uncapped replay's
    # requested peak the capped one raises OutOfMemory at the latest (tests/test_allocator.py)
    if not fits and 0 < room and stats.requested_peak_bytes <= room:
        try:
            stats = replay(events, conf, capacity_bytes=room)  # what the device would show, capped
            fits = True
        except OutOfMemory:
            fits = False
    return Reserved(conf=conf, stats=stats, other=other, cuda_context_bytes=context, nccl_bytes=nccl,
                    communicators=comms, fits=fits, measured=bool(calibrated), shortfall_bytes=shortfall)
