"""The recommender: every strategy x micro-batch x checkpointing x offload (x GPU count) that
reaches the global batch, memory and time for each, ranked by the objective, every rejection
explained.

Speed: each phase of the memory model is affine in the micro-batch (activations scale with the
tokens), so two estimates per (GPU count, strategy, checkpointing, offload) give every micro-batch
exactly, and numpy evaluates the whole grid at once.
"""

from __future__ import annotations

import math
import time as wallclock
from dataclasses import dataclass

import numpy as np

from planner import timing
from planner.architecture import layer_parameters
from planner.catalogue import catalogue_model, model_from_config, with_vision
from planner.errors import PlannerError
from planner.gpus import Gpu, check_precision, gpu as lookup_gpu
from planner.memory import estimate
from planner.presets import default_preset_for, preset, preset_topology
from planner.schema import (Candidate, EstimateRequest, EstimateResult, PlanRequest, PlanResult, TimeEstimate,
                            TopologySummary)
from planner.strategies import STRATEGIES, explicit_hsdp_shard, strategy as lookup_strategy
from planner.topology import GpuRow, Topology, link_between, parse_topology
from planner.units import GB, GIB

OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme"))
DEFAULT_FABRIC, DEFAULT_NICS = "ib-hdr", 1
PCIE_DEVICE_TO_HOST_GBPS = {"gen3": 12.0, "gen4": 24.0, "gen5": 48.0, "gen6": 92.0, "none": 24.0}
NVME_GBPS = 5.0  # one PCIe Gen4 NVMe drive, sequential (vendor datasheets: 5-7 GB/s); calibratable


@dataclass(frozen=True)
class Combo:
    gpus: int
    strategy: str
    checkpointing: str
    offload_optimizer: str
    offload_params: str
    shard: int | None = None  # hsdp: GPUs per shard group


def _hsdp_shards(gpus: int, nodes: int) -> list[int]:
    """HSDP shard group sizes worth planning: every divisor of a node's GPUs from 2 up (groups of
    consecutive ranks, as DeviceMesh builds them), the whole node only when there are 2+ nodes."""
    return [d for d in range(2, gpus + 1) if gpus % d == 0 and (d < gpus or nodes > 1)]


def _offloads(name: str) -> list[tuple[str, str]]:
    s = lookup_strategy(name)
    if s.name == "zero3":
        return list(OFFLOADS)
    if s.name in ("fsdp", "hsdp"):
        return [("none", "none"), ("cpu", "cpu")]  # FSDP CPUOffload moves params, grads and states together
    if s.framework == "torch":
        return [("none", "none")]
    if s.shards_optimizer:
        return [("none", "none"), ("cpu", "none"), ("nvme", "none")]
    return [("none", "none")]


def collective_volumes(request: EstimateRequest) -> list[dict]:
    """What the time model sends per optimizer step for this configuration, per collective:
    payload bytes (before the ring's 2(n-1)/n or (n-1)/n factor), message size and group."""
    result = estimate(request)
    if result.model.architecture is None:
        return []
    request = result.request  # with what a ds_config fixed (micro-batch, accumulation, optimizer)
    from planner.architecture import Architecture

    combo, buckets = _resolved_combo(request)
    model_fields = {"model": request.model} if request.model else {"model_config": request.model_config_}
    model_fields |= {"include_vision": True} if request.include_vision else {}
    per_rank = request.micro_batch * request.gradient_accumulation
    plan_req = PlanRequest(**model_fields, gpu=request.gpu, gpus=request.gpus, nodes=request.nodes,
                           seq_len=request.seq_len, global_batch=per_rank * request.gpus * request.nodes,
                           precision=result.request.precision, optimizer=request.optimizer)
    wb = 4 if request.precision == "fp32" else 2
    arch = Architecture.model_validate(result.model.architecture)
    rows = _collective_volumes(plan_req, combo, result.parameters, np.array([request.micro_batch]), per_rank, wb,
                               arch, buckets)
    return [{"what": what, "bytes_per_step": int(volume[0]), "message_bytes": int(message), "group": group}
            for what, volume, _, message, group in rows]


def estimate_time(request: EstimateRequest, result: EstimateResult) -> TimeEstimate | None:
    """The time model for one estimate's configuration (None without an architecture, or on CPU)."""
    g = lookup_gpu(request.gpu)
    if result.model.architecture is None or (g.is_cpu and request.profile is None):
        return None
    model_fields = {"model": request.model} if request.model else {"model_config": request.model_config_}
    model_fields |= {"include_vision": True} if request.include_vision else {}
    world = request.gpus * request.nodes
    per_rank = request.micro_batch * request.gradient_accumulation
    plan_req = PlanRequest(**model_fields, gpu=request.gpu, gpus=request.gpus, nodes=request.nodes,
                           topology=request.topology, topology_text=request.topology_text,
                           fabric=request.fabric, nics_per_node=request.nics_per_node,
                           seq_len=request.seq_len, global_batch=per_rank * world,
                           precision=result.request.precision, optimizer=request.optimizer,
                           attention=request.attention, profile=request.profile)
    topo, fabric_name, nics = _topology(plan_req, g)
    plan_req = _apply_profile(plan_req, topo)
    from planner.architecture import Architecture

    combo, buckets = _resolved_combo(request)
    arch = Architecture.model_validate(result.model.architecture)
    t = _step_times(plan_req, combo, np.array([request.micro_batch]), per_rank, result.parameters, arch, g,
                    topo, timing.fabric(fabric_name), nics, buckets)[0]
    return TimeEstimate(step_seconds=t.step_seconds, compute_seconds=t.compute_seconds,
                        communication_seconds=t.communication_seconds,
                        exposed_communication_seconds=t.exposed_communication_seconds,
                        offload_seconds=t.offload_seconds, tokens_per_second=t.tokens_per_second, mfu=t.mfu,
                        ring_bandwidth_gbps=t.ring_bandwidth_gbps if math.isfinite(t.ring_bandwidth_gbps) else None,
                        topology=topo.source)


def estimate_with_time(request: EstimateRequest) -> EstimateResult:
    result = estimate(request)  # result.request holds what a ds_config fixed (micro-batch, accumulation, optimizer)
    return result.model_copy(update={"time": estimate_time(result.request, result)})


def _one_host_bridge(gpus: int, g: Gpu) -> Topology:
    """The topology assumed for a GPU type without a preset: every pair of GPUs over PCIe through
    one host bridge (nvidia-smi's PHB), no NVLink, no NICs. Built directly: it is what parsing the
    matching `nvidia-smi topo -m` text gives, but that text's size limit is for pastes, and a large
    --gpus (its matrix grows as gpus squared) is no paste."""
    link = link_between(0, 1, "PHB", g)  # every pair the same link
    return Topology(gpus=[GpuRow(index=i, cpu_affinity=None, numa_node=None) for i in range(gpus)], nics=[],
                    matrix=[["X" if i == j else "PHB" for j in range(gpus)] for i in range(gpus)],
                    links=[link.model_copy(update={"a": i, "b": j}) for i in range(gpus) for j in range(i + 1, gpus)],
                    nvlink_groups=[[i] for i in range(gpus)], gpu_type=g.name,
                    source=f"assumed: {gpus} GPUs under one PCIe host bridge")


def _topology(req: PlanRequest, g: Gpu) -> tuple[Topology, str, int]:
    fabric, nics = DEFAULT_FABRIC, DEFAULT_NICS
    if req.topology_text is not None:
        topo = parse_topology(req.topology_text, g, source="pasted nvidia-smi topo -m")
    else:
        name = req.topology or default_preset_for(g.name)
        if name is None:
            topo = _one_host_bridge(req.gpus, g)
        else:
            p = preset(name)
            if p.gpu != g.name:
                raise PlannerError(f"topology preset {name} is built from {p.gpu}, but gpu is {g.name}")
            topo, fabric, nics = preset_topology(name), p.fabric, p.nics_per_node
    if len(topo.gpus) < req.gpus:
        raise PlannerError(f"gpus({req.gpus}) exceeds the {len(topo.gpus)} GPUs of the topology ({topo.source})")
    return topo, req.fabric or fabric, req.nics_per_node or nics


def _gpu_counts(req: PlanRequest) -> list[int]:
    counts = {req.gpus}
    k = 1
    while k < req.gpus:
        counts.add(k)
        k *= 2
    return sorted(c for c in counts if req.global_batch % (c * req.nodes) == 0)


def _resolved_combo(request: EstimateRequest) -> tuple[Combo, Buckets]:
    """One estimate's configuration as the time model takes it, with offload and bucket sizes as
    resolved (--ds-config included)."""
    from planner.memory import resolve

    zero = resolve(request).zero
    shard = (request.hsdp_shard_size or request.gpus) if request.strategy == "hsdp" else None
    combo = Combo(request.gpus, request.strategy, request.checkpointing, zero.offload_optimizer, zero.offload_params,
                  shard)
    return combo, Buckets(zero.reduce_bucket_size, zero.allgather_bucket_size, zero.prefetch_bucket_size)


def _estimate(req: PlanRequest, combo: Combo, micro: int, model_fields: dict) -> EstimateResult:
    return estimate(EstimateRequest(
        **model_fields, strategy=combo.strategy, gpus=combo.gpus, nodes=req.nodes, gpu=req.gpu,
        precision=req.precision, optimizer=req.optimizer, micro_batch=micro, seq_len=req.seq_len,
        checkpointing=combo.checkpointing, attention=req.attention,
        offload_optimizer=combo.offload_optimizer, offload_params=combo.offload_params,
        hsdp_shard_size=explicit_hsdp_shard(combo.strategy, combo.shard, combo.gpus)))


def _divisors(n: int) -> np.ndarray:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return np.array(sorted(set(small + [n // d for d in small])), dtype=np.int64)


class _Grid:
    """Everything about one combo that the vectorized evaluation needs."""

    def __init__(self, combo: Combo, one: EstimateResult, two: EstimateResult):
        self.combo = combo
        self.constant = np.array([2 * a.bytes - b.bytes for a, b in zip(one.phases, two.phases)], dtype=np.float64)
        self.slope = np.array([b.bytes - a.bytes for a, b in zip(one.phases, two.phases)], dtype=np.float64)
        self.framework = one.per_device.framework_bytes

    def peaks(self, micro: np.ndarray) -> np.ndarray:
        return (self.constant[:, None] + self.slope[:, None] * micro[None, :]).max(axis=0) + self.framework


def _apply_profile(req: PlanRequest, topo: Topology) -> PlanRequest:
    """With a profile: its compute efficiency, and the link efficiency fitted for the kind of this
    topology's ring bottleneck where its runs measured that kind, else its overall one."""
    if req.profile is None:
        return req
    from planner.profiles import load_profile

    profile = load_profile(req.profile)
    if profile.gpu != req.gpu:
        raise PlannerError(f"profile {profile.name} was fitted on {profile.gpu}, but gpu is {req.gpu}")
    ring, _, _ = timing.node_ring(topo, req.gpus)
    kind = timing.ring_bottleneck_kind(topo, ring)
    return req.model_copy(update={"compute_efficiency": profile.compute_efficiency,
                                  "link_efficiency": profile.link_efficiencies.get(kind, profile.link_efficiency)})


def plan(req: PlanRequest) -> PlanResult:
    if req.finetune == "auto":
        from planner.finetune_plan import plan_finetune_auto

        return plan_finetune_auto(req, plan)
    started = wallclock.perf_counter()
    g = lookup_gpu(req.gpu)
    check_precision(g, req.precision)
    model = catalogue_model(req.model) if req.model else model_from_config(req.model_config_)
    if req.include_vision:
        model = with_vision(model)
    arch = model.architecture
    model_fields = {"model": req.model} if req.model else {"model_config": req.model_config_}
    model_fields |= {"include_vision": True} if req.include_vision else {}
    model_fields |= finetune_fields(req)
    world_max = req.gpus * req.nodes
    if req.global_batch % world_max:
        raise PlannerError(f"global_batch({req.global_batch}) is not divisible by gpus({req.gpus}) * "
                           f"nodes({req.nodes}) = {world_max}")
    topo, fabric_name, nics = _topology(req, g)
    req = _apply_profile(req, topo)
    capacity = g.memory_bytes
    usable = capacity * (1 - req.headroom)
    fabric = timing.fabric(fabric_name)
    layout = (g, model, topo, fabric, nics, usable, model_fields)
    rows, evaluated = _evaluate(req, _gpu_counts(req), *layout)
    fewer = []
    if req.nodes > 1 and req.objective != "memory":
        for k in _fewer_nodes(req):
            fewer_rows, count = _evaluate(req.model_copy(update={"nodes": k}), [req.gpus], *layout)
            evaluated += count
            fewer.append((k, fewer_rows))
    result = _rank(req, rows, fewer, usable, capacity, topo, fabric_name, nics, model_fields, evaluated, started, g)
    if req.include_vision:  # say what was counted (the reader's note), as estimate does
        counted = [n for n in arch.notes if "include_vision" in n or "vision_config" in n]
        result = result.model_copy(update={"notes": result.notes + counted})
    if req.finetune != "full":
        result = with_finetune(result, req.finetune)
    return result


def _fewer_nodes(req: PlanRequest) -> list[int]:
    """Node counts below the request's (halving) that still divide the global batch: on a slow
    fabric the best plan may leave nodes idle rather than send every gather through their NICs."""
    counts, k = [], req.nodes // 2
    while k >= 1:
        if req.global_batch % (req.gpus * k) == 0:
            counts.append(k)
        k //= 2
    return counts


def _evaluate(req: PlanRequest, counts: list[int], g: Gpu, model, topo: Topology, fabric: dict, nics: int,
              usable: float, model_fields: dict) -> tuple[list[tuple], int]:
    """(combo, micro-batch, peak bytes, fits, step time) for every setting on these GPU counts."""
    rows: list[tuple[Combo, int, float, bool, timing.StepTime]] = []
    evaluated = 0
    for gpus in counts:
        for name in STRATEGIES:
            shards = _hsdp_shards(gpus, req.nodes) if name == "hsdp" else [None]
            for shard, ckpt in ((sh, c) for sh in shards for c in ("none", "full")):
                for off_opt, off_par in _offloads(name):
                    combo = Combo(gpus, name, ckpt, off_opt, off_par, shard)
                    try:
                        grid = _Grid(combo, _estimate(req, combo, 1, model_fields),
                                     _estimate(req, combo, 2, model_fields))
                    except PlannerError:  # a setting the fine-tuning refuses (QLoRA under ZeRO-3, ...)
                        if req.finetune == "full":
                            raise
                        continue
                    per_rank = req.global_batch // (gpus * req.nodes)
                    micro = _divisors(per_rank)
                    peaks = grid.peaks(micro)
                    times = _step_times(req, combo, micro, per_rank, model.parameters, model.architecture, g, topo,
                                        fabric, nics)
                    evaluated += micro.size
                    rows += [(combo, int(mb), float(peaks[k]), bool(peaks[k] <= usable), times[k])
                             for k, mb in enumerate(micro)]
    return rows, evaluated


@dataclass(frozen=True)
class Buckets:
    """DeepSpeed's message sizes in elements (deepspeed/runtime/zero/config.py defaults)."""

    reduce: int = 500_000_000
    allgather: int = 500_000_000
    prefetch: int = 50_000_000


DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP bucket_cap_mb=25 (torch/nn/parallel/distributed.py)


def _collective_volumes(req: PlanRequest, combo: Combo, psi: int, micro: np.ndarray, per_rank: int,
                        wb: int, arch=None, buckets: Buckets = Buckets()) -> list[tuple[str, np.ndarray, int, float, str]]:
    """(what, bytes per step, ring passes, message bytes, group) for the strategy's collectives.

    Message sizes are what the frameworks really send: DDP's 25 MiB buckets, DeepSpeed's reduce
    and all-gather buckets (capped by the model), and for ZeRO-3 and FSDP one transformer block
    at a time (the FSDP unit; ZeRO-3 fetches a module's parameters, at most prefetch_bucket_size)."""
    accumulation = per_rank / micro
    s = lookup_strategy(combo.strategy)
    step = np.ones_like(micro, dtype=np.float64)
    grads = psi * wb
    block = layer_parameters(arch) if arch is not None else max(psi // 100, 1)
    reduce_msg = min(psi, buckets.reduce) * wb
    gather_msg = min(psi, buckets.allgather) * wb
    if s.name == "ddp":
        master = 4 if req.precision in ("bf16-mixed", "fp16-mixed", "fp32") else wb
        return [("gradient all-reduce", step * psi * master, 2, min(psi * master, DDP_BUCKET_BYTES), "world")]
    if s.name == "zero0":
        return [("gradient all-reduce", step * grads, 2, reduce_msg, "world")]
    if s.name == "zero1":
        return [("gradient reduce-scatter", step * grads, 1, reduce_msg, "world"),
                ("parameter all-gather", step * grads, 1, gather_msg, "world")]
    if s.name == "zero2":
        return [("gradient reduce-scatter", accumulation * grads, 1, reduce_msg, "world"),
                ("parameter all-gather", step * grads, 1, gather_msg, "world")]
    gathers = 1 if s.params_unsharded_in_step else 2
    unit = block * wb
    gather_unit = min(unit, buckets.prefetch * wb) if s.framework == "deepspeed" else unit
    items = [("parameter all-gathers", accumulation * gathers * grads, 1, gather_unit, "shard"),
             ("gradient reduce-scatter", accumulation * grads, 1,
              min(unit, reduce_msg) if s.framework == "deepspeed" else unit, "shard")]
    if s.name == "hsdp":
        shard = combo.shard or combo.gpus
        items.append(("replica all-reduce of each shard", accumulation * grads / shard, 2, unit / shard, "replicas"))
    return items


def _group(combo: Combo, group: str, nodes: int) -> tuple[timing.Group, tuple[int, ...]]:
    """The process group a collective runs over, and its members inside one node.

    world / shard (ZeRO and FSDP shard over the whole data-parallel group): every GPU of every node.
    HSDP's shard group: `shard` consecutive ranks (DeviceMesh's inner dimension), inside a node when
    it fits there. HSDP's replica group: the GPUs at the same place in every shard group, so every
    shard-th GPU of a node, and each of the node's `shard` replica groups crosses its NICs at once."""
    g = combo.gpus
    world = g * nodes
    shard = combo.shard
    if group == "replicas" and shard:
        if shard < g:
            return timing.Group(world // shard, g // shard, shard), tuple(range(0, g, shard))
        return timing.Group(world // shard, 1, g), (0,)
    if group == "shard" and shard:
        if shard <= g:
            return timing.Group(shard, shard, g // shard), tuple(range(shard))
        return timing.Group(shard, g, 1), tuple(range(g))
    return timing.Group(world, g, 1), tuple(range(g))


def _step_times(req: PlanRequest, combo: Combo, micro: np.ndarray, per_rank: int, psi: int, arch, g: Gpu,
                topo: Topology, fabric: dict, nics: int, buckets: Buckets = Buckets()) -> list[timing.StepTime]:
    wb = 4 if req.precision == "fp32" else 2
    dtype = "fp32" if req.precision == "fp32" else ("bf16" if req.precision.startswith("bf16") else "fp16")
    if req.precision == "fp32":
        dtype = "tf32" if "tf32" in g.peak_tflops else "fp32"
    peak_flops = g.peak_tflops[dtype] * 1e12
    tokens_rank = per_rank * req.seq_len
    flops = tokens_rank * timing.flops_per_token(arch, req.seq_len, combo.checkpointing)
    compute = flops / (peak_flops * req.compute_efficiency)
    ring, ring_bw, _ = timing.node_ring(topo, combo.gpus)
    nodes = req.nodes
    nic_gbps = nics * fabric["gbps"] * fabric["efficiency"] * req.link_efficiency
    comm = np.zeros_like(micro, dtype=np.float64)
    slowest = ring_bw * req.link_efficiency
    for _, volume, passes, message, group in _collective_volumes(req, combo, psi, micro, per_rank, wb, arch, buckets):
        layout, members = _group(combo, group, nodes)
        _, intra_bw, intra_lat = timing.ring_over(topo, members)
        wire = timing.Wire(intra_bw * req.link_efficiency, intra_lat, nic_gbps, fabric["latency_us"])
        t = timing.collective_seconds(np.asarray(volume, dtype=np.float64), layout, wire, message, passes)
        comm += t.seconds
        slowest = min(slowest, float(t.bottleneck_gbps.min()))
    s = lookup_strategy(combo.strategy)
    if s.framework == "torch" or s.zero_stage == 3:
        window = compute if s.shards_parameters else compute * timing.BACKWARD_FRACTION
    else:
        window = 0.0  # ZeRO 0-2: overlap_comm defaults to false (DeepSpeedZeroConfig)
    offload = _offload_seconds(combo, psi, per_rank / micro, combo.gpus * nodes, wb, g)
    results = []
    world = combo.gpus * nodes
    model_flops = tokens_rank * timing.model_flops_per_token(arch, req.seq_len)
    for k in range(micro.size):
        exposed = max(0.0, float(comm[k]) - window)
        step = compute + exposed + float(offload[k])
        tokens = tokens_rank * world
        results.append(timing.StepTime(
            compute_seconds=compute, communication_seconds=float(comm[k]), exposed_communication_seconds=exposed,
            offload_seconds=float(offload[k]), step_seconds=step, tokens_per_second=tokens / step,
            mfu=model_flops / (step * peak_flops), ring_bandwidth_gbps=slowest, ring=ring))
    return results


def _offload_seconds(combo: Combo, psi: int, accumulation: np.ndarray, world: int, wb: int, g: Gpu) -> np.ndarray:
    shard = psi / world
    pcie = PCIE_DEVICE_TO_HOST_GBPS.get(g.pcie, 24.0) * 1e9
    seconds = np.zeros_like(accumulation, dtype=np.float64)
    if combo.offload_optimizer != "none":
        # gradients down, updated 16-bit parameters up, then DeepSpeedCPUAdam on the host
        seconds += 2 * shard * wb / pcie + shard / timing.CPU_ADAM_PARAMS_PER_SECOND
        if combo.offload_optimizer == "nvme":
            seconds += 2 * shard * 16 / (NVME_GBPS * 1e9)  # read and write master + moments
    if combo.offload_params != "none":
        seconds += accumulation * 2 * shard * wb / pcie  # each micro-step fetches the shard twice
        if combo.offload_params == "nvme":
            seconds += accumulation * 2 * shard * wb / (NVME_GBPS * 1e9)
    return seconds


def _setting(combo: Combo, mb: int) -> str:
    """The rejected setting in words, so it is not mistaken for the strategy's other settings."""
    shard = f" (shard groups of {combo.shard})" if combo.shard else ""
    return (f"{combo.strategy}{shard} at micro-batch {mb}, checkpointing {combo.checkpointing}, "
            f"offload {combo.offload_optimizer}/{combo.offload_params}")


def _peak_items(e: EstimateResult, count: int = 3) -> str:
    """The peak phase's largest items, as the estimate names them."""
    phase = next((p for p in e.phases if p.name == e.per_device.peak_phase), None)
    if phase is None:
        return ""
    largest = sorted(phase.items, key=lambda i: -i.bytes)[:count]
    return ", ".join(f"{i.name} {i.bytes / GB:.1f} GB" for i in largest)


def _reason(combo: Combo, mb: int, peak: float, usable: float, capacity: int, headroom: float,
            e: EstimateResult) -> str:
    d = e.per_device
    unsharded = []
    s = lookup_strategy(combo.strategy)
    if not s.shards_parameters and d.parameters_bytes:
        unsharded.append(f"{d.parameters_bytes / GB:.1f} GB of params")
    if not s.shards_gradients and d.gradients_bytes:
        unsharded.append(f"{d.gradients_bytes / GB:.1f} GB of grads")
    what = (("optimizer states are sharded but " if s.shards_optimizer else "nothing is sharded: ")
            + " and ".join(unsharded) + " are not; ") if unsharded else ""
    return (f"{_setting(combo, mb)}: {peak / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable of {capacity / GIB:.1f} GiB "
            f"on each GPU ({headroom:.0%} kept free): {what}the peak is at {d.peak_phase}, largest "
            f"{_peak_items(e)}")


def _candidate(combo: Combo, mb: int, per_rank: int, fits: bool, t: timing.StepTime, e: EstimateResult,
               reason: str | None) -> Candidate:
    return Candidate(strategy=combo.strategy, micro_batch=mb, gradient_accumulation=per_rank // mb,
                     checkpointing=combo.checkpointing, offload_optimizer=combo.offload_optimizer,
                     offload_params=combo.offload_params, hsdp_shard_size=combo.shard, fits=fits,
                     per_device=e.per_device,
                     step_seconds=t.step_seconds, compute_seconds=t.compute_seconds,
                     communication_seconds=t.communication_seconds,
                     exposed_communication_seconds=t.exposed_communication_seconds,
                     offload_seconds=t.offload_seconds, tokens_per_second=t.tokens_per_second, mfu=t.mfu,
                     rejected_reason=reason)


# Options whose step times (or, for --objective cost, GPU-seconds per token) are closer than this
# are a tie, and the one that leaves more memory free wins. The time model resolves no finer: its
# compute and link efficiencies are fitted constants (`planner calibrate` reports the residuals per
# run), and a prediction 1% faster at 99% of the memory is a promise it cannot keep, while the
# headroom is what absorbs allocator fragmentation and a longer batch.
TIE_TOLERANCE = 0.01
# Peaks closer than this fraction of the device are a tie in turn, broken by less communication
# (the time model's least certain term): the memory model is no finer, 31 of 31 verified runs
# within 3% (README, accuracy table).
MEMORY_TIE_FRACTION = 0.03


def _objective(req: PlanRequest, combo: Combo, peak: float, t: timing.StepTime) -> float:
    """What the objective minimizes: step seconds, GPU-seconds per token, or peak bytes."""
    if req.objective == "memory":
        return peak
    if req.objective == "cost":
        return combo.gpus * req.nodes / t.tokens_per_second
    return t.step_seconds


def _runs(items: list, key, width) -> list[list]:
    """Items sorted by key, cut into runs whose keys lie within `width(first key)` of the run's first."""
    rest, runs = sorted(items, key=key), []
    while rest:
        limit = key(rest[0]) + width(key(rest[0]))
        runs.append([x for x in rest if key(x) <= limit])
        rest = [x for x in rest if key(x) > limit]
    return runs


def _tie_order(req: PlanRequest, capacity: float, items: list, value, peak, traffic) -> list:
    """Items best first: by the objective, where values within TIE_TOLERANCE are a tie ordered by
    peak (more headroom first), and peaks within MEMORY_TIE_FRACTION of the device a tie ordered by
    communication, then the objective."""
    if req.objective == "memory":
        return sorted(items, key=lambda x: (peak(x), value(x), traffic(x)))
    ordered = []
    for same_time in _runs(items, value, lambda v: v * TIE_TOLERANCE):
        for same_memory in _runs(same_time, peak, lambda _: capacity * MEMORY_TIE_FRACTION):
            ordered += sorted(same_memory, key=lambda x: (traffic(x), value(x), peak(x)))
    return ordered


def _label(c: Candidate | Combo) -> str:
    shard = c.hsdp_shard_size if isinstance(c, Candidate) else c.shard
    return f"{c.strategy}/{shard}" if shard else c.strategy


def _why_recommended(req: PlanRequest, best: Candidate, fitting: list[Candidate], capacity: float) -> str:
    """Why the recommendation won: by the objective, or how it won a tie."""
    if req.objective == "memory":
        return f"recommended {_label(best)}: the lowest peak of every fitting option"
    value = (lambda c: c.step_seconds) if req.objective == "time" else (lambda c: req.gpus * req.nodes / c.tokens_per_second)
    what = "step time" if req.objective == "time" else "GPU-seconds per token"
    fastest = min(value(c) for c in fitting)
    tied = [c for c in fitting if c is not best and value(c) <= fastest * (1 + TIE_TOLERANCE)]
    if not tied:
        return f"recommended {_label(best)}: the best {what} of every fitting option"
    group = tied + [best]
    peak = lambda c: c.per_device.peak_bytes  # noqa: E731
    lowest, fullest = min(group, key=peak), max(group, key=peak)
    text = (f"recommended {_label(best)}: {len(tied)} other option(s) are within {TIE_TOLERANCE:.0%} of the best "
            f"{what} (the time model's uncertainty), peaks {peak(lowest) / GIB:.1f} to {peak(fullest) / GIB:.1f} GiB "
            f"({_label(fullest)} the fullest); ")
    same_memory = [c for c in group if peak(c) <= peak(lowest) + capacity * MEMORY_TIE_FRACTION]
    if len(same_memory) == 1:
        return text + f"it leaves the most memory free ({peak(best) / GIB:.1f} GiB peak)"
    return text + (f"{len(same_memory)} of them peak within {MEMORY_TIE_FRACTION:.0%} of the device of the lowest "
                   f"(the memory model's accuracy), and of those it communicates least "
                   f"({best.communication_seconds:.3f} s per step, {peak(best) / GIB:.1f} GiB peak)")


def _fewer_nodes_advice(req: PlanRequest, best: Candidate, fewer: list[tuple[int, list]], fabric_name: str,
                        nics: int) -> tuple[int | None, str | None]:
    """The node count whose best fitting option beats the recommendation on all nodes by more than
    the time model's uncertainty (by step time, or GPU-seconds per token for --objective cost)."""
    def value(nodes: int, t) -> float:
        return req.gpus * nodes / t.tokens_per_second if req.objective == "cost" else t.step_seconds

    here = value(req.nodes, best)
    winner = None
    for k, rows in fewer:
        fitting = [r for r in rows if r[3]]
        if fitting:
            row = min(fitting, key=lambda r: (value(k, r[4]), r[2]))
            if value(k, row[4]) < here * (1 - TIE_TOLERANCE) and (winner is None or value(k, row[4]) < winner[2]):
                winner = (k, row, value(k, row[4]))
    if winner is None:
        return None, None
    k, (combo, mb, peak, _, t), v = winner
    what = "s per step" if req.objective == "time" else "GPU-s per token"
    return k, (f"fewer nodes do better: on {k} node(s) {_label(combo)} (micro-batch {mb}, checkpointing "
               f"{combo.checkpointing}, offload {combo.offload_optimizer}/{combo.offload_params}) takes {v:.4g} {what} "
               f"against {here:.4g} on {req.nodes} with the best option here: {fabric_name} x {nics} NIC(s) per node "
               f"cannot carry what spanning the extra nodes sends (plan with --nodes {k}, or a faster fabric)")


def _fabric_note(req: PlanRequest, fabric_name: str, nics: int) -> str:
    f = timing.fabric(fabric_name)
    node = nics * f["gbps"] * f["efficiency"] * req.link_efficiency
    return (f"across nodes: {fabric_name} x {nics} NIC(s) per node, {node:.2f} GB/s achieved per node "
            f"({node / req.gpus:.2f} GB/s per GPU); a collective whose group spans nodes runs at that rate: "
            "all-gather and reduce-scatter as NCCL's flat ring, all-reduce the faster of its ring and tree")


def _rank(req, rows, fewer, usable, capacity, topo, fabric_name, nics, model_fields, evaluated, started, g) -> PlanResult:
    fabric = timing.fabric(fabric_name)
    by_combo: dict[Combo, list[tuple]] = {}
    for row in rows:
        by_combo.setdefault(row[0], []).append(row)
    best: dict[Combo, tuple] = {}
    for combo, options in by_combo.items():
        if combo.gpus != req.gpus:
            continue
        fitting = [r for r in options if r[3]]
        # a fitting setting by the objective (ties to headroom); one that fits nowhere at its smallest peak
        best[combo] = (_tie_order(req, capacity, fitting, lambda r: _objective(req, r[0], r[2], r[4]), lambda r: r[2],
                                  lambda r: r[4].communication_seconds)[0] if fitting
                       else min(options, key=lambda r: r[2]))
    ranked = _tie_order(req, capacity, [c for c in best if best[c][3]], lambda c: _objective(req, c, best[c][2], best[c][4]),
                        lambda c: best[c][2], lambda c: best[c][4].communication_seconds)
    ranked += sorted((c for c in best if not best[c][3]), key=lambda c: best[c][2])
    candidates = []
    for combo in ranked:
        _, mb, peak, fits, t = best[combo]
        per_rank = req.global_batch // (combo.gpus * req.nodes)
        e = _estimate(req, combo, mb, model_fields)
        reason = None if fits else _reason(combo, mb, peak, usable, capacity, req.headroom, e)
        candidates.append(_candidate(combo, mb, per_rank, fits, t, e, reason))
    fitting = [c for c in candidates if c.fits]
    recommended = fitting[0] if fitting else None
    max_micro = _max_micro(req, rows)
    min_gpus = {name: _min_gpus(req, name, usable, model_fields) for name in STRATEGIES}
    ring, ring_bw, _ = timing.node_ring(topo, req.gpus)
    inter = nics * fabric["gbps"] * fabric["efficiency"] / req.gpus if req.nodes > 1 else None
    notes = [f"{evaluated:,} candidates evaluated in {wallclock.perf_counter() - started:.3f} s",
             (f"ring over GPUs {list(ring)}: slowest link {ring_bw:.1f} GB/s ({topo.source})"
              if math.isfinite(ring_bw) else f"one GPU per node: no ring ({topo.source})"),
             f"compute at {req.compute_efficiency:.0%} of {g.name}'s peak dense TFLOP/s"]
    notes += [f"time model: {caveat}" for caveat in g.time_model_caveats]
    if req.nodes > 1:
        notes.append(_fabric_note(req, fabric_name, nics))
    faster_on = None
    if recommended is not None:
        notes.append(_why_recommended(req, recommended, fitting, capacity))
        faster_on, note = _fewer_nodes_advice(req, recommended, fewer, fabric_name, nics)
        if note:
            notes.append(note)
    if recommended is None:
        notes.append("nothing fits: see each candidate's rejected_reason, and min_gpus for the GPU count that would")
    return PlanResult(recommended=recommended, candidates=candidates, candidates_evaluated=evaluated,
                      min_gpus=min_gpus, max_micro_batch=max_micro, faster_on_fewer_nodes=faster_on,
                      topology=TopologySummary(source=topo.source, gpu_type=topo.gpu_type, gpus_per_node=req.gpus,
                                               nodes=req.nodes, nvlink_groups=topo.nvlink_groups, ring=list(ring),
                                               ring_bandwidth_gbps=ring_bw if math.isfinite(ring_bw) else None,
                                               inter_node_gbps_per_gpu=inter),
                      notes=notes, request=req)


def _max_micro(req: PlanRequest, rows) -> dict[str, int | None]:
    """The largest micro-batch that fits on the full cluster, per strategy (any checkpointing/offload)."""
    out: dict[str, int | None] = {}
    for combo, mb, _, fits, _ in rows:
        out.setdefault(combo.strategy, None)
        if fits and combo.gpus == req.gpus and (out[combo.strategy] is None or mb > out[combo.strategy]):
            out[combo.strategy] = mb
    return out


MAX_SEARCH_GPUS = 1 << 16


def finetune_fields(req: PlanRequest) -> dict:
    """The plan's fine-tuning as estimate fields (nothing for full fine-tuning)."""
    if req.finetune == "full":
        return {}
    given = {"lora_rank": req.lora_rank, "lora_targets": req.lora_targets, "lora_dropout": req.lora_dropout}
    return {"finetune": req.finetune} | {k: v for k, v in given.items() if v is not None}


def with_finetune(result: PlanResult, method: str) -> PlanResult:
    update = {"finetune": method}
    return result.model_copy(update={
        "candidates": [c.model_copy(update=update) for c in result.candidates],
        "recommended": result.recommended.model_copy(update=update) if result.recommended else None})


def _min_gpus(req: PlanRequest, name: str, usable: float, model_fields: dict) -> int | None:
    """The smallest total GPU count (GPUs per node as given, growing the node count, or fewer GPUs
    on one node) on which the strategy trains at micro-batch 1 with full checkpointing, in any
    setting the plan itself tries: every offload it tries for the strategy, and for HSDP every
    shard-group size (so HSDP in groups of 2 on one node counts, as the plan recommends it).
    Per-device memory never grows with more GPUs (tests/test_properties.py), so a doubling search
    then a bisection finds it."""
    return _search(req, name, usable, model_fields, per_node=req.gpus)


def _fits(req: PlanRequest, name: str, usable: float, model_fields: dict, gpus: int, nodes: int) -> bool:
    """Whether any of the plan's settings of the strategy fits this layout at micro-batch 1."""
    shards = _hsdp_shards(gpus, nodes)[::-1] if name == "hsdp" else [None]
    for shard in shards:
        for off_opt, off_par in reversed(_offloads(name)):  # most offloaded first: the likeliest fit
            try:
                e = estimate(EstimateRequest(**model_fields, strategy=name, gpus=gpus, nodes=nodes, gpu=req.gpu,
                                             precision=req.precision, optimizer=req.optimizer, micro_batch=1,
                                             seq_len=req.seq_len, checkpointing="full", attention=req.attention,
                                             offload_optimizer=off_opt, offload_params=off_par,
                                             hsdp_shard_size=explicit_hsdp_shard(name, shard, gpus)))
            except PlannerError:  # refused for this fine-tuning (see _evaluate)
                if req.finetune == "full":
                    raise
                continue
            if e.per_device.peak_bytes <= usable:
                return True
    return False


def _search(req, name, usable, model_fields, per_node: int) -> int | None:
    for gpus in range(1, per_node + 1):
        if _fits(req, name, usable, model_fields, gpus, 1):
            return gpus
    nodes = 2
    while nodes * per_node <= MAX_SEARCH_GPUS:
        if _fits(req, name, usable, model_fields, per_node, nodes):
            low = max(2, nodes // 2)
            while low < nodes:
                mid = (low + nodes) // 2
                if _fits(req, name, usable, model_fields, per_node, mid):
                    nodes = mid
                else:
                    low = mid + 1
            return nodes * per_node
        nodes *= 2
    return None
