"""SVG pictures, rendered on the server so they need no JavaScript (topology, memory bars).

Text is placed by geometry, not by trust: every label gets a box from ``text_box`` (a
conservative width estimate for the 11 px sans-serif the pictures use) and is put where its box
meets no other label, GPU, NIC or the capacity line."""

from __future__ import annotations

import math
from html import escape
from typing import NamedTuple

from planner.parallel.dims import NodeLayout
from planner.cluster.topology import Link, Topology

_COLOURS = [(200.0, "#1b7837"), (100.0, "#5aae61"), (40.0, "#a6dba0"), (20.0, "#f4a582"), (0.0, "#d6604d")]
# One dash pattern per link class, so classes that share a bandwidth colour stay apart.
_DASHES = ["", "9,4", "3,3", "12,3,3,3", "1,4", "6,6"]
FONT_PX = 11
CHAR_PX = 0.62 * FONT_PX  # sans-serif average advance is about 0.55 em; digits 0.556 em (Helvetica/DejaVu metrics)
LABELLED_MAX_GPUS = 16  # above this the pairs (n(n-1)/2 = 120 at 16) are too many to label; the legend names them
GPU_RADIUS = 24  # room for the GPU's name and its NUMA node inside the circle


class Box(NamedTuple):
    x0: float
    y0: float
    x1: float
    y1: float

    def meets(self, other: "Box") -> bool:
        return self.x0 < other.x1 and other.x0 < self.x1 and self.y0 < other.y1 and other.y0 < self.y1

    def crosses(self, x1: float, y1: float, x2: float, y2: float) -> bool:
        """Whether the segment (x1, y1)-(x2, y2) passes through the box (Liang-Barsky clipping)."""
        lo, hi = 0.0, 1.0
        for p, q in ((x1 - x2, x1 - self.x0), (x2 - x1, self.x1 - x1), (y1 - y2, y1 - self.y0), (y2 - y1, self.y1 - y1)):
            if p == 0:
                if q < 0:
                    return False
                continue
            t = q / p
            if p < 0:
                lo = max(lo, t)
            else:
                hi = min(hi, t)
            if lo > hi:
                return False
        return True


def text_box(text: str, x: float, y: float, anchor: str = "start", pad: float = 2.0) -> Box:
    """The box an SVG <text> at baseline (x, y) covers, with `pad` pixels around it."""
    w = len(text) * CHAR_PX
    left = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
    return Box(left - pad, y - FONT_PX - pad + 2, left + w + pad, y + 3 + pad)


def strategy_label(c) -> str:
    """How the page names a planned candidate (a PlanCandidate), in its table and its chart alike."""
    name = f"{c.strategy} (shard groups of {c.hsdp_shard_size})" if c.hsdp_shard_size else c.strategy
    parallel = getattr(c, "parallel", None)
    if parallel is None:
        return name
    return name + "".join(f" x {k} {v}" for k, v in (("tp", parallel.tp), ("pp", parallel.pp), ("cp", parallel.cp),
                                                     ("ep", parallel.ep)) if v > 1)


def _colour(gbps: float) -> str:
    return next(c for limit, c in _COLOURS if gbps >= limit)


def _link_classes(t: Topology) -> list[tuple[tuple[str, str, float], list[Link]]]:
    """Links grouped by (code, kind, bandwidth), fastest class first."""
    classes: dict[tuple[str, str, float], list[Link]] = {}
    for link in t.links:
        classes.setdefault((link.code, link.kind, link.bandwidth_gbps), []).append(link)
    return sorted(classes.items(), key=lambda kv: (-kv[0][2], kv[0][0]))


# Where along a link (0 = one GPU, 1 = the other) a label may sit, nearest the middle first.
_ALONG = (0.5, 0.42, 0.58, 0.34, 0.66, 0.27, 0.73)


def _place_link_labels(links: list[Link], pos: dict[int, tuple[float, float]], taken: list[Box],
                       all_links: list[Link]) -> list[tuple[str, float, float, Box]] | None:
    """A label on each of `links`, centred on its line, whose box meets nothing in `taken`, no
    other label and no other link's line (so it names one link, never a crossing); None when one of
    them finds no room (the class is then named by the legend alone)."""
    placed: list[tuple[str, float, float, Box]] = []
    for link in links:
        (x1, y1), (x2, y2) = pos[link.a], pos[link.b]
        others = [(pos[o.a], pos[o.b]) for o in all_links if o is not link]
        for t in _ALONG:
            x, y = x1 + t * (x2 - x1), y1 + t * (y2 - y1)
            box = text_box(link.code, x, y + 4, "middle")
            if not any(box.meets(b) for b in taken) and not any(box.meets(p[3]) for p in placed) \
                    and not any(box.crosses(*a, *b) for a, b in others):
                placed.append((link.code, x, y + 4, box))
                break
        else:
            return None
    return placed


# Tensor-parallel groups: translucent bands behind their GPUs; pipeline stages: the GPUs' fill.
_GROUP_COLOURS = ["#984ea3", "#ff7f00", "#1f78b4", "#e7298a", "#a65628", "#66a61e", "#e6ab02", "#666666"]
_STAGE_COLOURS = ["#2166ac", "#b2182b", "#1b7837", "#762a83", "#8c510a", "#01665e", "#c51b7d", "#4d4d4d"]


def _ranges(gpus: list[int]) -> str:
    """GPU indices as runs: [0, 1, 2, 3, 6] -> 'GPU0-3, GPU6'."""
    runs: list[list[int]] = []
    for g in sorted(gpus):
        if runs and g == runs[-1][-1] + 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    return ", ".join(f"GPU{r[0]}-{r[-1]}" if len(r) > 1 else f"GPU{r[0]}" for r in runs)


def _layout_parts(layout: NodeLayout, pos: dict[int, tuple[float, float]], legend_y: float) -> tuple[list[str], list[str]]:
    """(bands drawn behind the GPUs, legend lines) for a layout's TP groups and PP stages."""
    bands: list[str] = []
    legend: list[str] = []
    y = legend_y
    for k, group in enumerate(layout.tp_groups):
        colour = _GROUP_COLOURS[k % len(_GROUP_COLOURS)]
        points = [pos[g] for g in group if g in pos]
        segments = list(zip(points, points[1:])) or [(points[0], points[0])]
        lines = "".join(f'<line x1="{a[0]:.1f}" y1="{a[1]:.1f}" x2="{b[0]:.1f}" y2="{b[1]:.1f}"/>' for a, b in segments)
        bands.append(f'<g class="tp-group" data-gpus="{",".join(map(str, group))}" stroke="{colour}" '
                     f'stroke-width="{2 * GPU_RADIUS + 14}" stroke-linecap="round" opacity="0.3">'
                     f'<title>TP group {k}: {_ranges(list(group))}</title>{lines}</g>')
        legend.append(f'<rect x="20" y="{y:.0f}" width="40" height="12" fill="{colour}" opacity="0.3"/>'
                      f'<text class="layout-legend" x="68" y="{y + 10:.0f}">TP group {k}: {_ranges(list(group))}</text>')
        y += 18
    if layout.pp > 1:
        for stage in sorted(set(layout.stage_of.values())):
            members = [g for g, s in layout.stage_of.items() if s == stage]
            legend.append(f'<circle cx="40" cy="{y + 6:.0f}" r="6" fill="{_STAGE_COLOURS[stage % len(_STAGE_COLOURS)]}"/>'
                          f'<text class="layout-legend" x="68" y="{y + 10:.0f}">PP stage {stage}: {_ranges(members)}</text>')
            y += 18
    legend.append(f'<text class="layout-legend" x="20" y="{y + 10:.0f}">{escape(layout.caption)}</text>')
    return bands, legend


def topology_svg(t: Topology, width: int = 640, layout: NodeLayout | None = None) -> str:
    """GPUs on a circle (NICs outside), every GPU pair a line coloured by its modelled
    unidirectional bandwidth in GB/s and dashed by its link class. A class's links carry their code
    where every one of its labels finds room clear of the GPUs, NICs and other labels; the legend
    names every class with its bandwidth and how many pairs it joins.

    ``layout``: a parallel layout's groups on this node (planner.parallel.dims.node_layout): each
    tensor-parallel group a band behind its GPUs, each pipeline stage a GPU colour, both named in
    the legend."""
    n = len(t.gpus)
    cx = cy = width / 2
    r = width * 0.32
    pos = {g.index: (cx + r * math.cos(2 * math.pi * g.index / n - math.pi / 2),
                     cy + r * math.sin(2 * math.pi * g.index / n - math.pi / 2)) for g in t.gpus}
    classes = _link_classes(t)
    legend_y = width + 10
    layout_rows = 0 if layout is None else len(layout.tp_groups) + (len(set(layout.stage_of.values()))
                                                                      if layout.pp > 1 else 0) + 1
    height = legend_y + 40 + 18 * len(classes) + 18 * layout_rows
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="{FONT_PX}">',
             f'<title>{escape(t.gpu_type)} topology: {n} GPUs</title>',
             '<rect width="100%" height="100%" fill="white"/>']
    taken = [Box(x - GPU_RADIUS - 2, y - GPU_RADIUS - 2, x + GPU_RADIUS + 2, y + GPU_RADIUS + 2) for x, y in pos.values()]
    nic_pos = []
    for k, nic in enumerate(t.nics):
        angle = 2 * math.pi * (k + 0.5) / max(len(t.nics), 1) - math.pi / 2
        x, y = cx + r * 1.35 * math.cos(angle), cy + r * 1.35 * math.sin(angle)
        nic_pos.append((nic, x, y))
        taken.append(Box(x - 26, y - 12, x + 26, y + 12))
    dash = {key: _DASHES[k % len(_DASHES)] for k, (key, _) in enumerate(classes)}
    for (code, kind, gbps), links in sorted(classes, key=lambda kv: kv[0][2]):  # fastest drawn on top
        stroke = 1 + 5 * min(gbps, 400) / 400
        style = f' stroke-dasharray="{dash[(code, kind, gbps)]}"' if dash[(code, kind, gbps)] else ""
        for link in links:
            (x1, y1), (x2, y2) = pos[link.a], pos[link.b]
            parts.append(f'<line class="link" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                         f'stroke="{_colour(gbps)}" stroke-width="{stroke:.1f}"{style} opacity="0.8">'
                         f'<title>GPU{link.a}-GPU{link.b}: {escape(code)}, {gbps:.1f} GB/s ({escape(kind)})</title></line>')
    bands, layout_legend = _layout_parts(layout, pos, legend_y + 18 * len(classes) + 30) if layout else ([], [])
    parts += bands
    for nic, x, y in nic_pos:
        for gi in nic.nearest_gpus:
            gx, gy = pos[gi]
            parts.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{gx:.1f}" y2="{gy:.1f}" stroke="#999" stroke-dasharray="3,3"/>')
    labels = []
    for _, links in sorted(classes, key=lambda kv: len(kv[1])) if n <= LABELLED_MAX_GPUS else []:
        # the rarest links are the ones worth naming
        placed = _place_link_labels(links, pos, taken, t.links)
        if placed:
            labels += placed
            taken += [p[3] for p in placed]
    for code, x, y, box in labels:
        parts.append(f'<rect class="label-bg" x="{box.x0:.1f}" y="{box.y0:.1f}" width="{box.x1 - box.x0:.1f}" '
                     f'height="{box.y1 - box.y0:.1f}" fill="white" opacity="0.85"/>'
                     f'<text class="link-label" x="{x:.1f}" y="{y:.1f}" fill="#333" text-anchor="middle">{escape(code)}</text>')
    for g in t.gpus:
        x, y = pos[g.index]
        numa = f"NUMA {g.numa_node}" if g.numa_node is not None else ""
        stage = layout.stage_of.get(g.index) if layout is not None and layout.pp > 1 else None
        fill = "#2166ac" if stage is None else _STAGE_COLOURS[stage % len(_STAGE_COLOURS)]
        unused = layout is not None and g.index not in layout.stage_of
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{GPU_RADIUS}" fill="{"#bbbbbb" if unused else fill}"'
                     + (f' data-stage="{stage}"' if stage is not None else "") + '/>'
                     f'<text x="{x:.1f}" y="{y + (0 if numa else 4):.1f}" fill="white" text-anchor="middle">GPU{g.index}</text>'
                     f'<text x="{x:.1f}" y="{y + 12:.1f}" fill="white" font-size="9" text-anchor="middle">{escape(numa)}</text>')
    for nic, x, y in nic_pos:
        parts.append(f'<rect x="{x - 24:.1f}" y="{y - 10:.1f}" width="48" height="20" fill="#999"/>'
                     f'<text x="{x:.1f}" y="{y + 4:.1f}" fill="white" text-anchor="middle">{escape(nic.name)}</text>')
    pairs = n * (n - 1) // 2
    for k, ((code, kind, gbps), links) in enumerate(classes):
        y = legend_y + 18 * k
        stroke = 1 + 5 * min(gbps, 400) / 400
        style = f' stroke-dasharray="{dash[(code, kind, gbps)]}"' if dash[(code, kind, gbps)] else ""
        count = f"all {pairs} pairs" if len(links) == pairs and pairs > 1 else f"{len(links)} pair{'s' if len(links) != 1 else ''}"
        parts.append(f'<line x1="20" y1="{y + 6}" x2="60" y2="{y + 6}" stroke="{_colour(gbps)}" stroke-width="{stroke:.1f}"{style}/>'
                     f'<text class="link-class" x="68" y="{y + 10}">{escape(code)}: {escape(kind)}, {gbps:.1f} GB/s, {count}</text>')
    parts.append(f'<text x="20" y="{legend_y + 18 * len(classes) + 16}">line colour and width: modelled unidirectional '
                 f'bandwidth (GB/s: green &gt;= 200, red &lt; 20); dash: link class</text>')
    parts += layout_legend
    parts.append("</svg>")
    return "\n".join(parts)


_PARTS = [("frozen_weights", "frozen base", "#543005"), ("parameters", "parameters", "#2166ac"),
          ("gradients", "gradients", "#67a9cf"), ("optimizer_states", "optimizer states", "#fdb863"),
          ("activations", "activations", "#d6604d"), ("buffers", "buffers", "#999999"),
          ("framework", "framework", "#4d4d4d")]
# The step's time by where it goes (planner/time/collectives.py TimeEstimate): compute, communication the
# compute does not hide, offload traffic, and the rest of the step (pipeline bubbles and waits).
TIME_PARTS = [("compute", "compute", "#1b7837"), ("exposed", "exposed communication", "#d6604d"),
              ("offload", "offload", "#fdb863"), ("bubbles", "pipeline bubble", "#999999")]
GIB = 2 ** 30


def peak_components(result) -> dict[str, int]:
    """What is live at an estimate's peak, summed by component (an EstimateResult: its peak phase's
    items plus the framework overhead). The parts add up to ``per_device.peak_bytes`` exactly,
    unlike the textbook per-component figures, which are not all live at the same moment."""
    phase = max(result.phases, key=lambda p: p.bytes)
    return phase_components(phase, result.per_device.peak_bytes - phase.bytes)


def phase_components(phase, framework_bytes: int) -> dict[str, int]:
    """One moment's live bytes by component, with the framework overhead every moment carries."""
    parts = {key: 0 for key, _, _ in _PARTS}
    for item in phase.items:
        parts[item.component] = parts.get(item.component, 0) + item.bytes
    parts["framework"] += framework_bytes
    return parts


def moment_rows(result) -> list[tuple[str, dict[str, int]]]:
    """An estimate's moments in step order, each with its live bytes by component; the peak's
    name says so."""
    peak = max(result.phases, key=lambda p: p.bytes)
    framework = result.per_device.peak_bytes - peak.bytes
    return [(p.name + (" (peak)" if p is peak else ""), phase_components(p, framework)) for p in result.phases]


def time_parts(t, bubble_fraction: float = 0.0) -> dict[str, float]:
    """A step's seconds by where they go (a TimeEstimate or a plan Candidate). A pipeline's
    compute_seconds is its stage's compute stretched by the schedule's bubble
    (planner/parallel/pipeline.py pipeline_time: compute = ideal / (1 - fraction)), so ``bubble_fraction``
    (pipeline.bubble_fraction of the layout) of it is idle; any rest of the step beyond compute,
    exposed communication and offload is counted with the bubbles as waiting."""
    known = t.compute_seconds + t.exposed_communication_seconds + t.offload_seconds
    bubble = t.compute_seconds * bubble_fraction
    return {"compute": t.compute_seconds - bubble, "exposed": t.exposed_communication_seconds,
            "offload": t.offload_seconds, "bubbles": bubble + max(0.0, t.step_seconds - known)}


def _value_label_x(bar_end: float, text: str, capacity_x: float) -> float:
    """Where a bar's value label starts: just after the bar, unless its box would meet the
    capacity line, then just after the line."""
    x = bar_end + 4
    box = text_box(text, x, 0)
    return capacity_x + 5 if box.x0 <= capacity_x + 1 and box.x1 >= capacity_x - 1 else x


def _legend(parts: list[tuple[str, str, str]], y: float, width: int) -> tuple[list[str], float]:
    """Colour keys left to right, wrapping at the chart's width; (elements, the y below them)."""
    out, x = [], 20.0
    for _, name, colour in parts:
        w = 16 + text_box(name, 0, 0).x1 + 14
        if x + w > width and x > 20:
            x, y = 20.0, y + 18
        out.append(f'<rect x="{x:.0f}" y="{y:.0f}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{x + 16:.0f}" y="{y + 10:.0f}">{escape(name)}</text>')
        x += w
    return out, y + 18


def _stacked_bars(rows: list[tuple[str, dict[str, float]]], parts: list[tuple[str, str, str]], title: str,
                  totals: list[str], describe, capacity: float | None = None, capacity_text: str = "",
                  marks: list[float | None] | None = None, width: int = 720, row_class: str = "strategy") -> str:
    """One stacked bar per row; each row's total after its bar (or after the capacity line, where
    its box would meet it); rows 28 px apart, so totals never meet each other. ``marks``: a
    value per row drawn as a tick over the bar (the reserved peak); ``row_class``: the class of the
    rows' names (the page's tests find a chart's strategies by it)."""
    shown = [p for p in parts if any(d.get(p[0], 0) > 0 for _, d in rows)]  # a key for what is drawn
    keys = shown + ([("reserved", "| reserved by the allocator", "#000")] if any(m is not None for m in marks or [])
                    else [])
    legend_rows = _legend(keys, 0, width)[1] // 18
    height = int(40 + 28 * len(rows) + 20 + 18 * legend_rows)
    left = max([120.0] + [text_box(label, 0, 0).x1 + 10 for label, _ in rows])
    left = min(left, width * 0.55)
    right = width - 10 - max([text_box("000.00 GiB", 0, 0).x1] + [text_box(t, 0, 0).x1 for t in totals]) - 5
    values = [sum(d.values()) for _, d in rows] + [m for m in marks or [] if m is not None]
    top_value = max([capacity or 0] + values) or 1
    scale = (right - left) / top_value
    cx = left + (capacity or 0) * scale
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'font-family="sans-serif" font-size="{FONT_PX}" role="img"><title>{escape(title)}</title>'
           f'<rect width="100%" height="100%" fill="white"/>']
    for k, ((label, d), total) in enumerate(zip(rows, totals)):
        y = 30 + 28 * k
        out.append(f'<text class="{row_class}" x="{left - 6:.1f}" y="{y + 14}" text-anchor="end">{escape(label)}</text>')
        x = float(left)
        for key, name, colour in parts:
            value = d.get(key, 0)
            w = value * scale
            if w > 0:
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="20" fill="{colour}">'
                           f'<title>{escape(label)}: {name} {describe(value)}</title></rect>')
            x += w
        mark = (marks or [None] * len(rows))[k]
        if mark is not None:
            mx = left + mark * scale
            out.append(f'<path class="reserved" d="M{mx:.1f} {y - 3}v26" stroke="#000" stroke-width="3">'
                       f'<title>{escape(label)}: reserved by the allocator {describe(mark)}</title></path>')
            x = max(x, mx)
        out.append(f'<text class="total" x="{_value_label_x(x, total, cx if capacity else -99):.1f}" '
                   f'y="{y + 14}">{total}</text>')
    if capacity:
        out.append(f'<line class="capacity" x1="{cx:.1f}" y1="20" x2="{cx:.1f}" y2="{30 + 28 * len(rows)}" '
                   f'stroke="black" stroke-dasharray="4,3"/>'
                   f'<text x="{min(max(cx, 60), width - 60):.1f}" y="14" text-anchor="middle">{escape(capacity_text)}</text>')
    legend, _ = _legend(keys, 40 + 28 * len(rows), width)
    out += legend
    out.append("</svg>")
    return "\n".join(out)


def memory_bars_svg(rows: list[tuple[str, dict[str, int]]], capacity_bytes: int, width: int = 720,
                    reserved: list[int | None] | None = None,
                    title: str = "per-GPU memory at the peak, by component (GiB)", row_class: str = "strategy") -> str:
    """One stacked bar per row (bytes live at its peak by component, in GiB; see
    ``peak_components``) against the device's capacity line; ``reserved``: each row's peak
    reserved by the caching allocator, a tick over its bar (None where not modelled)."""
    totals = [f"{sum(d.values()) / GIB:.2f} GiB" for _, d in rows]
    return _stacked_bars(rows, _PARTS, title, totals, lambda v: f"{v / GIB:.2f} GiB", capacity_bytes,
                         f"capacity {capacity_bytes / GIB:.1f} GiB", reserved, width, row_class)


def moments_svg(result, capacity_bytes: int, width: int = 720) -> str:
    """One estimate's memory over the moments of a step, each moment's live bytes by component,
    against the card."""
    return memory_bars_svg(moment_rows(result), capacity_bytes, width,
                           title="per-GPU memory over the moments of a step, by component (GiB)", row_class="moment")


def time_bars_svg(rows: list[tuple[str, dict[str, float]]], step_seconds: list[float], width: int = 720) -> str:
    """One stacked bar per option: its step's seconds by where they go (``time_parts``)."""
    totals = [f"{s:.3f} s" for s in step_seconds]
    return _stacked_bars(rows, TIME_PARTS, "seconds per optimizer step: compute, exposed communication, offload, "
                         "bubbles", totals, lambda v: f"{v:.3f} s", width=width, row_class="option")
