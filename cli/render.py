"""Human-readable rendering of results (the CLI's default output)."""

from __future__ import annotations

from planner.schema import EstimateResult
from planner.units import GB, GIB


def _row(label: str, num_bytes: int | None) -> str:
    if num_bytes is None:
        return f"  {label:<28} {'unknown':>12} {'unknown':>12}"
    return f"  {label:<28} {num_bytes / GIB:>12,.2f} {num_bytes / GB:>12,.2f}"


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
    if r.host.peak_bytes or r.nvme_bytes:
        lines += ["", f"  {'per node (offload)':<28} {'GiB':>12} {'GB':>12}",
                  _row("host RAM peak", r.host.peak_bytes), _row("of which pinned", r.host.pinned_bytes),
                  _row("NVMe", r.nvme_bytes)]
    lines.append("")
    if r.device_capacity_bytes > 0:
        headroom = r.headroom_bytes
        verdict = "FITS" if r.fits else "DOES NOT FIT"
        lines.append(f"{verdict}: peak {d.peak_bytes / GIB:,.2f} GiB of {r.device_capacity_bytes / GIB:,.2f} GiB "
                     f"on each {r.gpu}; headroom {headroom / GIB:+,.2f} GiB ({headroom / GB:+,.2f} GB)")
    else:
        lines.append(f"peak {d.peak_bytes / GIB:,.2f} GiB per rank (no capacity known for {r.gpu}; "
                     "pass --device-memory-gib to judge the fit)")
    return "\n".join(lines)
