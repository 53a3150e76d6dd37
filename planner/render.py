"""SVG pictures, rendered on the server so they need no JavaScript (topology, memory bars)."""

from __future__ import annotations

import math
from html import escape

from planner.topology import Topology

_COLOURS = [(200.0, "#1b7837"), (100.0, "#5aae61"), (40.0, "#a6dba0"), (20.0, "#f4a582"), (0.0, "#d6604d")]


def _colour(gbps: float) -> str:
    return next(c for limit, c in _COLOURS if gbps >= limit)


def topology_svg(t: Topology, width: int = 640) -> str:
    """GPUs on a circle (NICs outside), every GPU pair a line coloured and labelled by its modelled
    unidirectional bandwidth in GB/s."""
    n = len(t.gpus)
    cx = cy = width / 2
    r = width * 0.32
    pos = {g.index: (cx + r * math.cos(2 * math.pi * g.index / n - math.pi / 2),
                     cy + r * math.sin(2 * math.pi * g.index / n - math.pi / 2)) for g in t.gpus}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{width + 60}" '
             f'viewBox="0 0 {width} {width + 60}" font-family="sans-serif" font-size="11">',
             f'<title>{escape(t.gpu_type)} topology: {n} GPUs</title>',
             '<rect width="100%" height="100%" fill="white"/>']
    for link in sorted(t.links, key=lambda link: link.bandwidth_gbps):
        (x1, y1), (x2, y2) = pos[link.a], pos[link.b]
        stroke = 1 + 5 * min(link.bandwidth_gbps, 400) / 400
        parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{_colour(link.bandwidth_gbps)}" '
                     f'stroke-width="{stroke:.1f}" opacity="0.8"><title>GPU{link.a}-GPU{link.b}: {escape(link.code)}, '
                     f'{link.bandwidth_gbps:.1f} GB/s ({escape(link.kind)})</title></line>')
        if n <= 8:
            mx, my = (x1 + x2) / 2, (y1 + y2) / 2
            parts.append(f'<text x="{mx:.1f}" y="{my:.1f}" fill="#333" text-anchor="middle">{escape(link.code)}</text>')
    for g in t.gpus:
        x, y = pos[g.index]
        numa = f"NUMA {g.numa_node}" if g.numa_node is not None else ""
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="22" fill="#2166ac"/>'
                     f'<text x="{x:.1f}" y="{y + 4:.1f}" fill="white" text-anchor="middle">GPU{g.index}</text>'
                     f'<text x="{x:.1f}" y="{y + 36:.1f}" text-anchor="middle">{escape(numa)}</text>')
    for k, nic in enumerate(t.nics):
        angle = 2 * math.pi * (k + 0.5) / max(len(t.nics), 1) - math.pi / 2
        x, y = cx + r * 1.35 * math.cos(angle), cy + r * 1.35 * math.sin(angle)
        parts.append(f'<rect x="{x - 24:.1f}" y="{y - 10:.1f}" width="48" height="20" fill="#999"/>'
                     f'<text x="{x:.1f}" y="{y + 4:.1f}" fill="white" text-anchor="middle">{escape(nic.name)}</text>')
        for gi in nic.nearest_gpus:
            gx, gy = pos[gi]
            parts.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{gx:.1f}" y2="{gy:.1f}" stroke="#999" stroke-dasharray="3,3"/>')
    legend_y = width + 20
    for k, (limit, colour) in enumerate(_COLOURS):
        x = 20 + k * 120
        label = f">= {limit:.0f} GB/s" if limit else "< 20 GB/s"
        parts.append(f'<rect x="{x}" y="{legend_y}" width="14" height="14" fill="{colour}"/>'
                     f'<text x="{x + 18}" y="{legend_y + 11}">{label}</text>')
    parts.append(f'<text x="20" y="{legend_y + 34}">link colour and width: modelled unidirectional bandwidth (GB/s)</text>')
    parts.append("</svg>")
    return "\n".join(parts)


_PARTS = [("parameters", "parameters", "#2166ac"), ("gradients", "gradients", "#67a9cf"),
          ("optimizer_states", "optimizer states", "#fdb863"), ("activations", "activations", "#d6604d"),
          ("buffers", "buffers", "#999999"), ("framework", "framework", "#4d4d4d")]


def peak_components(result) -> dict[str, int]:
    """What is live at an estimate's peak, summed by component (an EstimateResult: its peak phase's
    items plus the framework overhead). The parts add up to ``per_device.peak_bytes`` exactly,
    unlike the textbook per-component figures, which are not all live at the same moment."""
    phase = max(result.phases, key=lambda p: p.bytes)
    parts = {key: 0 for key, _, _ in _PARTS}
    for item in phase.items:
        parts[item.component] += item.bytes
    parts["framework"] += result.per_device.peak_bytes - phase.bytes
    return parts


def memory_bars_svg(rows: list[tuple[str, dict[str, int]]], capacity_bytes: int, width: int = 720) -> str:
    """One stacked bar per strategy (bytes live at its peak by component, in GiB; see
    ``peak_components``) against the device's capacity line."""
    gib = 2 ** 30
    height = 40 + 28 * len(rows) + 40
    left, right = 170, width - 80
    top_value = max([capacity_bytes] + [sum(d.values()) for _, d in rows]) or 1
    scale = (right - left) / top_value
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><title>per-GPU memory at the peak, by component (GiB)</title>'
           f'<rect width="100%" height="100%" fill="white"/>']
    for k, (label, d) in enumerate(rows):
        y = 30 + 28 * k
        out.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{escape(label)}</text>')
        x = float(left)
        for key, name, colour in _PARTS:
            value = d.get(key, 0)
            w = value * scale
            if w > 0:
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="20" fill="{colour}">'
                           f'<title>{name}: {value / gib:.2f} GiB</title></rect>')
            x += w
        out.append(f'<text class="total" x="{x + 4:.1f}" y="{y + 14}">{sum(d.values()) / gib:.2f} GiB</text>')
    cx = left + capacity_bytes * scale
    out.append(f'<line x1="{cx:.1f}" y1="20" x2="{cx:.1f}" y2="{height - 40}" stroke="black" stroke-dasharray="4,3"/>'
               f'<text x="{cx:.1f}" y="14" text-anchor="middle">capacity {capacity_bytes / gib:.1f} GiB</text>')
    for k, (_, name, colour) in enumerate(_PARTS):
        x = 20 + k * 115
        out.append(f'<rect x="{x}" y="{height - 28}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{x + 16}" y="{height - 18}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)
