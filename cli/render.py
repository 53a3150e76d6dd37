"""Human-readable rendering of results (the CLI's default output)."""

from __future__ import annotations

import textwrap

from planner.schema import EstimateResult
from planner.time.step import HOST_TERM
from planner.units import GB, GIB

from backend.report import verify_table  # noqa: F401  (shared with the web page's run view)

# the share of a step the GPU spends waiting for its host past which the text says so (the terms are in --json)
HOST_BOUND_SHARE = 0.1


LABEL_WIDTH = 28  # the per-device table's label column


def _row(label: str, num_bytes: int | None) -> str:
    """One row; a label longer than its column (a long phase name) wraps within it, the figures
    on its last line, so the columns stay aligned."""
    *first, last = textwrap.wrap(label, LABEL_WIDTH, break_on_hyphens=False) or [""]
    head = "".join(f"  {part}\n" for part in first)
    if num_bytes is None:
        return f"{head}  {last:<{LABEL_WIDTH}} {'unknown':>12} {'unknown':>12}"
    return f"{head}  {last:<{LABEL_WIDTH}} {num_bytes / GIB:>12,.2f} {num_bytes / GB:>12,.2f}"


CAVEATS = ("traced", "time model", "WARNING")
ITEM_NAME_WIDTH = 54  # the by-item list's name column


def estimate_table(r: EstimateResult) -> str:
    d = r.per_device
    req = r.request
    # --params names the model by its count: said once
    model = f"{r.parameters:,} parameters (--params)" if r.model.source == "--params" else \
        f"{r.model.name}: {r.parameters:,} parameters"
    lines = [
        f"{model}, {r.strategy} on {r.world_size} x {r.gpu} "
        f"({req.nodes} node{'s' if req.nodes > 1 else ''}), {req.precision}, {req.optimizer}, "
        f"micro-batch {req.micro_batch} x {req.seq_len} tokens, checkpointing {req.checkpointing}",
        "",
        f"  {'per device, at the peak':<28} {'GiB':>12} {'GB':>12}",
        *_peak_rows(r),
        "  " + "-" * 54,
        _row("resident between steps", d.resident_bytes),
        _row(f"peak ({d.peak_phase})", d.peak_bytes),
    ]
    if r.allocator is not None:  # issue 24: reserved, the caching allocator's view (simulated)
        lines += [_row("reserved peak (simulated)", d.reserved_peak_bytes),
                  _row("  of which NCCL buffers", d.nccl_bytes)]
        change = r.allocator.other_reserved_peak_bytes - r.allocator.reserved_peak_bytes
        lines += ["", f"  allocator: PYTORCH_CUDA_ALLOC_CONF {r.allocator.alloc_conf or 'unset'}; "
                  f"{r.allocator.other_alloc_conf or 'unset'} would reserve {abs(change) / GIB:,.2f} GiB "
                  f"{'less' if change < 0 else 'more'}"]
    lines += _peak_items(r)
    if r.host.peak_bytes or r.nvme_bytes:
        lines += ["", f"  {'per node (offload)':<28} {'GiB':>12} {'GB':>12}",
                  _row("host RAM peak", r.host.peak_bytes), _row("of which pinned", r.host.pinned_bytes),
                  _row("NVMe", r.nvme_bytes)]
        if r.host.capacity_bytes is not None:
            lines.append(_row("host RAM of the node", r.host.capacity_bytes))
    if r.time is not None:
        t = r.time
        lines += ["", f"  time per step on {t.topology}: {t.step_seconds:.3f} s (compute {t.compute_seconds:.3f} s, "
                      f"communication {t.communication_seconds:.3f} s of which exposed {t.exposed_communication_seconds:.3f} s"
                      + (f", offload {t.offload_seconds:.3f} s" if t.offload_seconds else "")
                      + f"); {t.tokens_per_second:,.0f} tokens/s, MFU {t.mfu:.2f}, HFU {t.hfu:.2f}"]
        host = next((x for x in t.terms if x.name == HOST_TERM), None)
        if host is not None and host.seconds >= HOST_BOUND_SHARE * t.step_seconds:  # a surprise worth a line
            lines.append(f"  host-bound: the GPU waits {host.seconds:.3f} s of it for its host ({host.source}); a "
                         "larger micro-batch gives each launch and hook more work")
    lines.append("")
    # what the reader must know about where the numbers come from (a traced model, a GPU the time
    # model only partly knows); the rest of the notes are in --json
    lines += [f"note: {n}" for n in r.notes if n.startswith(CAVEATS)]
    lines += [n.replace("host RAM does NOT fit", "DOES NOT FIT host RAM", 1) for n in r.notes
              if n.startswith("host RAM does NOT fit")]
    if r.device_capacity_bytes > 0:
        headroom = r.headroom_bytes
        judged = d.reserved_peak_bytes if r.allocator is not None else d.peak_bytes  # reserved on a GPU
        fits = (r.fits or r.host.fits is False) if r.allocator is not None else judged <= r.device_capacity_bytes
        verdict = "FITS" if fits else "DOES NOT FIT"  # the device; host above
        what = "reserved peak" if r.allocator is not None else "peak"
        lines.append(f"{verdict}: {what} {judged / GIB:,.2f} GiB of {r.device_capacity_bytes / GIB:,.2f} GiB "
                     f"on each {r.gpu}; headroom {headroom / GIB:+,.2f} GiB ({headroom / GB:+,.2f} GB)")
    else:
        lines.append(f"peak {d.peak_bytes / GIB:,.2f} GiB per rank (no capacity known for {r.gpu}; "
                     "pass --device-memory-gib to judge the fit)")
    return "\n".join(lines)


def _peak_rows(r: EstimateResult) -> list[str]:
    """What is live at the peak by component (PerDevice.at_peak): the rows add up to the peak.
    With LoRA the trained parameters are the adapters, and the frozen base has its own row."""
    a, d = r.per_device.at_peak, r.per_device
    lora = r.request.finetune != "full"
    rows = [_row(f"parameters{' (trainable)' if lora else ''}", a.parameters_bytes)]
    if a.frozen_weights_bytes or lora:
        rows.append(_row("frozen base weights", a.frozen_weights_bytes))
    rows += [_row("gradients", a.gradients_bytes),
             _row("optimizer states", a.optimizer_states_bytes),
             _row("activations", a.activations_bytes if d.activations_bytes is not None else None),
             _row("framework buffers", a.buffers_bytes),
             _row("CUDA context / overhead", a.framework_bytes)]
    return rows


def _peak_items(r: EstimateResult) -> list[str]:
    """Every item live at the peak, so the buffers total is never a bare number; with --params the
    table says what a parameter count alone makes the model assume."""
    phase = next((p for p in r.phases if p.name == r.per_device.peak_phase), None)
    if phase is None:
        return []
    lines = ["", f"  at the peak ({phase.name}), by item"]
    for item in sorted(phase.items, key=lambda i: -i.bytes):
        if item.bytes:
            # a long name wraps within its column, the figures on its last line, so they stay aligned
            *first, last = textwrap.wrap(item.name, ITEM_NAME_WIDTH, break_on_hyphens=False) or [""]
            lines += [f"    {part}" for part in first]
            lines.append(f"    {last:<{ITEM_NAME_WIDTH}} {item.bytes / GIB:>10,.2f} GiB {item.bytes / GB:>10,.2f} GB")
    if r.model.source == "--params" and r.per_device.buffers_bytes:
        lines += ["  note: --params gives no layer sizes, so the model is taken as ONE tensor: what is sized by",
                  "        a layer (ZeRO-3/FSDP's gathered parameters, gradients not yet reduced, buckets capped by",
                  f"        the model) assumes the whole model here, {r.per_device.buffers_bytes / GIB:,.2f} GiB of buffers "
                  "beyond the textbook states;",
                  "        give --model or --model-file for per-layer sizes (and activations)"]
    return lines


def topology_table(t) -> str:
    n = len(t.gpus)
    head = "        " + "".join(f"GPU{i:<5}" for i in range(n)) + "NUMA"
    lines = [f"{t.source}: {n} x {t.gpu_type}, NVLink groups {t.nvlink_groups}", "", head]
    for i, row in enumerate(t.matrix):
        numa = t.gpus[i].numa_node
        lines.append(f"GPU{i:<5}" + "".join(f"{c:<8}" for c in row) + ("" if numa is None else str(numa)))
    lines += ["", "modelled links (unidirectional GB/s):"]
    kinds = {}
    for link in t.links:
        kinds.setdefault((link.code, link.kind, link.bandwidth_gbps, link.latency_us), []).append(f"{link.a}-{link.b}")
    for (code, kind, bw, lat), pairs in sorted(kinds.items(), key=lambda kv: -kv[0][2]):
        lines.append(f"  {code:<5} {kind:<32} {bw:>8.1f} GB/s  {lat:>4.1f} us  ({len(pairs)} pairs)")
    for nic in t.nics:
        lines.append(f"  NIC {nic.name}{' (' + nic.device + ')' if nic.device and nic.device != nic.name else ''}: "
                     f"nearest GPUs {nic.nearest_gpus or 'none'}")
    return "\n".join(lines)


def _degrees(c, sep: str = "+") -> str:
    """A candidate's model-parallel degrees beside its strategy: fsdp+tp2, hsdp/4+tp2+cp2."""
    p = c.parallel
    return "".join(f"{sep}{name}{' ' if sep != '+' else ''}{value}" for name, value in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp),
                                                                                        ("ep", p.ep)) if value > 1)


def _unfit(c) -> str:
    """A family's best that does not fit: its live peak, and the reserved peak when the caching
    allocator's replay is what refused it (a live peak under the usable memory)."""
    d = c.per_device
    reserved = f", reserved {d.reserved_peak_bytes / GIB:.2f} GiB" if d.reserved_peak_bytes > d.peak_bytes + d.nccl_bytes \
        else ""
    return f"does not fit (live peak {d.peak_bytes / GIB:.2f} GiB{reserved})"


def _host_lines(r) -> list[str]:
    """The host RAM a fitting option needs per node when it offloads (the sum over the node's
    ranks), and whether the node has it: the device table alone would hide it."""
    lines = []
    for k, c in enumerate(r.candidates, 1):
        if c.fits and c.host is not None:
            h = c.host
            room = ("capacity unknown: pass --host-memory-gib" if h.capacity_bytes is None else
                    f"{'fits' if h.fits else 'DOES NOT FIT'} the node's {h.capacity_bytes / GIB:,.2f} GiB")
            lines.append(f"  #{k} offloads {h.peak_bytes / GIB:,.2f} GiB of host RAM per node ({room})")
    return ["", "host RAM per node of the options that offload:", *lines] if lines else []


def plan_table(r) -> str:
    req = r.request
    lines = [f"{req.model or 'custom model'}: {req.gpus * req.nodes} x {req.gpu} ({req.nodes} node(s)), "
             f"global batch {req.global_batch} x {req.seq_len} tokens, objective {req.objective}",
             f"topology: {r.topology.source}; " + (
                 f"best ring {r.topology.ring} at {r.topology.ring_bandwidth_gbps:.1f} GB/s"
                 if r.topology.ring_bandwidth_gbps is not None else "one GPU per node, no ring")
             + (f"; across nodes {r.topology.inter_node_gbps_per_gpu:.2f} GB/s per GPU"
                if r.topology.inter_node_gbps_per_gpu is not None else ""),
             ""]
    names = {k: (f"{c.strategy}/{c.hsdp_shard_size}" if c.hsdp_shard_size else c.strategy) + _degrees(c)  # hsdp: shard group size
             for k, c in enumerate(r.candidates, 1)}
    width = max([16] + [len(n) for n in names.values()])  # a long layout name widens its column
    # LoRA / QLoRA rows say so (plan --finetune lora|qlora|auto); a full fine-tuning plan's table is unchanged
    method = {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}
    tuned = any(c.finetune != "full" for c in r.candidates)
    lines.append(f"  {'#':>3} {'strategy':<{width}} " + (f"{'method':<6} " if tuned else "")
                 + f"{'mb':>4} {'accum':>5} {'ckpt':<5} {'offload':<11} {'peak GiB':>9} "
                 f"{'step s':>8} {'exposed comm s':>15} {'tokens/s':>10} {'MFU':>5}")
    for k, c in enumerate(r.candidates, 1):
        if not c.fits:
            continue
        lines.append(f"  {k:>3} {names[k]:<{width}} " + (f"{method.get(c.finetune, c.finetune):<6} " if tuned else "")
                     + f"{c.micro_batch:>4} {c.gradient_accumulation:>5} {c.checkpointing:<5} "
                     f"{c.offload_optimizer + '/' + c.offload_params:<11} {c.per_device.peak_bytes / GIB:>9.2f} "
                     f"{c.step_seconds:>8.3f} {c.exposed_communication_seconds:>15.3f} {c.tokens_per_second:>10,.0f} "
                     f"{c.mfu:>5.2f}")
    last = max((k for k, c in enumerate(r.candidates, 1) if c.fits), default=0)
    gaps = [f"#{k}" for k, c in enumerate(r.candidates[:last], 1) if not c.fits]
    if gaps:  # ranked on their live peak, then refused on the replayed reserved peak or host RAM
        lines.append(f"  not listed: {', '.join(gaps)}, ranked among these but refused when replayed (see rejected)")
    if len(r.families) > 1:
        lines += ["", "best of each layout family (PlanResult.families):"]
        for c in r.families:
            p = c.parallel
            family = " x ".join(["dp"] + [n for n, v in (("tp", p.tp), ("cp", p.cp), ("pp", p.pp), ("ep", p.ep)) if v > 1])
            name = (f"{c.strategy}/{c.hsdp_shard_size}" if c.hsdp_shard_size else c.strategy) + _degrees(c)
            split = (f" stages {c.pp_first_stage_layers}/../{c.pp_last_stage_layers} blocks"
                     if c.pp_first_stage_layers is not None else "")
            if c.parallel.pp > 1:
                split = f" {c.pp_schedule}" + (f" v{c.pp_virtual_stages}" if (c.pp_virtual_stages or 1) > 1 else "") + split
            lines.append(f"  {family:<16} {name:<22} mb {c.micro_batch} x {c.gradient_accumulation}{split}: "
                         + (f"{c.per_device.peak_bytes / GIB:.2f} GiB, {c.step_seconds:.3f} s per step, MFU {c.mfu:.2f}"
                            if c.fits else _unfit(c)))
    lines += _host_lines(r)
    rejected = [c for c in r.candidates if not c.fits]
    reasons = []
    seen = set()
    for c in rejected:
        if c.rejected_reason and c.strategy not in seen:
            seen.add(c.strategy)
            count = sum(1 for o in rejected if o.strategy == c.strategy)
            fit = [k for k, o in enumerate(r.candidates, 1) if o.fits and o.strategy == c.strategy]
            others = (f" [{count} settings of {c.strategy} rejected" if count > 1 else f" [1 setting of {c.strategy} rejected") + (
                f"; other settings fit: #{', #'.join(map(str, fit))}]" if fit else "]")
            reasons.append(f"  {c.rejected_reason}{others}")
    if reasons:  # a heading only above reasons
        lines += ["", "rejected (each strategy's closest setting to fitting; the reason names it):", *reasons]
    best = r.recommended
    lines.append("")
    if best:
        shard = f" (shard groups of {best.hsdp_shard_size})" if best.hsdp_shard_size else ""
        lines.append(f"recommended: {best.strategy}{shard}{_degrees(best, ' x ')}, micro-batch {best.micro_batch} x {best.gradient_accumulation} "
                     f"accumulation, checkpointing {best.checkpointing}, offload {best.offload_optimizer}/"
                     f"{best.offload_params}: {best.step_seconds:.3f} s per step, peak {best.per_device.peak_bytes / GIB:.2f} GiB")
        if r.winner_reason:
            lines.append(f"why: {r.winner_reason}")
        if r.faster_on_fewer_nodes:
            lines.append(f"but fewer nodes do better on this fabric: --nodes {r.faster_on_fewer_nodes} (see the note)")
    else:
        lines.append("nothing fits this cluster")
    lines.append("smallest GPU count that trains (micro-batch 1, full checkpointing, any offload or HSDP group the plan tries): " +
                 ", ".join(f"{k} {v if v is not None else 'none'}" for k, v in r.min_gpus.items()))
    if r.max_seq_len is not None:
        lines.append(f"longest sequence the recommended layout trains (micro-batch 1, full checkpointing): "
                     f"{r.max_seq_len:,} tokens")
    lines.extend(f"note: {n}" for n in r.notes)
    return "\n".join(lines)
