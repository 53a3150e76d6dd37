"""Human-readable rendering of results (the CLI's default output)."""

from __future__ import annotations

import textwrap

from planner.schema import EstimateResult
from planner.units import GB, GIB

from backend.report import verify_table  # noqa: F401  (shared with the web page's run view)


def _row(label: str, num_bytes: int | None) -> str:
    if num_bytes is None:
        return f"  {label:<28} {'unknown':>12} {'unknown':>12}"
    return f"  {label:<28} {num_bytes / GIB:>12,.2f} {num_bytes / GB:>12,.2f}"


CAVEATS = ("traced", "time model", "WARNING")
ITEM_NAME_WIDTH = 54  # the by-item list's name column


def estimate_table(r: EstimateResult) -> str:
    d = r.per_device
    req = r.request
    model = r.model.name
    lines = [
        f"{model}: {r.parameters:,} parameters, {r.strategy} on {r.world_size} x {r.gpu} "
        f"({req.nodes} node{'s' if req.nodes > 1 else ''}), {req.precision}, {req.optimizer}, "
        f"micro-batch {req.micro_batch} x {req.seq_len} tokens, checkpointing {req.checkpointing}",
        "",
        f"  {'per device':<28} {'GiB':>12} {'GB':>12}",
        _row("parameters", d.parameters_bytes),
        _row("gradients", d.gradients_bytes),
        _row("optimizer states", d.optimizer_states_bytes),
        _row("activations (at peak)", d.activations_bytes),
        _row("framework buffers (at peak)", d.buffers_bytes),
        _row("CUDA context / overhead", d.framework_bytes),
        "  " + "-" * 54,
        _row("resident between steps", d.resident_bytes),
        _row(f"peak ({d.peak_phase})", d.peak_bytes),
    ]
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
    lines.append("")
    # what the reader must know about where the numbers come from (a traced model, a GPU the time
    # model only partly knows); the rest of the notes are in --json
    lines += [f"note: {n}" for n in r.notes if n.startswith(CAVEATS)]
    lines += [n.replace("host RAM does NOT fit", "DOES NOT FIT host RAM", 1) for n in r.notes
              if n.startswith("host RAM does NOT fit")]
    if r.device_capacity_bytes > 0:
        headroom = r.headroom_bytes
        verdict = "FITS" if d.peak_bytes <= r.device_capacity_bytes else "DOES NOT FIT"  # the device; host above
        lines.append(f"{verdict}: peak {d.peak_bytes / GIB:,.2f} GiB of {r.device_capacity_bytes / GIB:,.2f} GiB "
                     f"on each {r.gpu}; headroom {headroom / GIB:+,.2f} GiB ({headroom / GB:+,.2f} GB)")
    else:
        lines.append(f"peak {d.peak_bytes / GIB:,.2f} GiB per rank (no capacity known for {r.gpu}; "
                     "pass --device-memory-gib to judge the fit)")
    return "\n".join(lines)


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
    if r.model.architecture is None and r.per_device.buffers_bytes:
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


def plan_table(r) -> str:
    req = r.request
    lines = [f"{req.model or 'custom model'}: {req.gpus * req.nodes} x {req.gpu} ({req.nodes} node(s)), "
             f"global batch {req.global_batch} x {req.seq_len} tokens, objective {req.objective}",
             f"topology: {r.topology.source}; " + (
                 f"best ring {r.topology.ring} at {r.topology.ring_bandwidth_gbps:.1f} GB/s"
                 if r.topology.ring_bandwidth_gbps is not None else "one GPU per node, no ring")
             + (f"; across nodes {r.topology.inter_node_gbps_per_gpu:.2f} GB/s per GPU"
                if r.topology.inter_node_gbps_per_gpu is not None else ""),
             "",
             f"  {'#':>3} {'strategy':<16} {'mb':>4} {'accum':>5} {'ckpt':<5} {'offload':<11} {'peak GiB':>9} "
             f"{'step s':>8} {'exposed comm s':>15} {'tokens/s':>10} {'MFU':>5}"]
    for k, c in enumerate(r.candidates, 1):
        if not c.fits:
            continue
        name = (f"{c.strategy}/{c.hsdp_shard_size}" if c.hsdp_shard_size else c.strategy) + _degrees(c)  # hsdp: shard group size
        lines.append(f"  {k:>3} {name:<16} {c.micro_batch:>4} {c.gradient_accumulation:>5} {c.checkpointing:<5} "
                     f"{c.offload_optimizer + '/' + c.offload_params:<11} {c.per_device.peak_bytes / GIB:>9.2f} "
                     f"{c.step_seconds:>8.3f} {c.exposed_communication_seconds:>15.3f} {c.tokens_per_second:>10,.0f} "
                     f"{c.mfu:>5.2f}")
    rejected = [c for c in r.candidates if not c.fits]
    if rejected:
        lines += ["", "rejected (each strategy's closest setting to fitting; the reason names it):"]
        seen = set()
        for c in rejected:
            if c.rejected_reason and c.strategy not in seen:
                seen.add(c.strategy)
                count = sum(1 for o in rejected if o.strategy == c.strategy)
                fit = [k for k, o in enumerate(r.candidates, 1) if o.fits and o.strategy == c.strategy]
                others = (f" [{count} settings of {c.strategy} rejected" if count > 1 else f" [1 setting of {c.strategy} rejected") + (
                    f"; other settings fit: #{', #'.join(map(str, fit))}]" if fit else "]")
                lines.append(f"  {c.rejected_reason}{others}")
    best = r.recommended
    lines.append("")
    if best:
        shard = f" (shard groups of {best.hsdp_shard_size})" if best.hsdp_shard_size else ""
        lines.append(f"recommended: {best.strategy}{shard}{_degrees(best, ' x ')}, micro-batch {best.micro_batch} x {best.gradient_accumulation} "
                     f"accumulation, checkpointing {best.checkpointing}, offload {best.offload_optimizer}/"
                     f"{best.offload_params}: {best.step_seconds:.3f} s per step, peak {best.per_device.peak_bytes / GIB:.2f} GiB")
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
