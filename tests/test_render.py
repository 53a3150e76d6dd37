"""The page's pictures and labels, checked as geometry without a browser (tests/test_browser.py
measures the same in Chromium): value labels clear of the capacity line and of each other, link
labels on their own link and clear of everything else, one strategy name for table and chart, and
the fabric / NICs inputs that reach the plan."""

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from planner.cluster.gpus import gpu
from planner.cluster.presets import PRESETS, preset_topology
from planner.render import memory_bars_svg, strategy_label, text_box, topology_svg
from planner.cluster.topology import link_rates, parse_topology

GIB = 2 ** 30
SVG = "{http://www.w3.org/2000/svg}"
FIXTURES = Path(__file__).parent / "fixtures" / "topologies"


def _box(text_el):
    return text_box(text_el.text or "", float(text_el.get("x")), float(text_el.get("y")),
                    text_el.get("text-anchor", "start"), pad=0)


def _bars(totals_gib, capacity_gib=80, labels=None):
    rows = [(labels[k] if labels else f"s{k}", {"parameters": int(t * GIB)}) for k, t in enumerate(totals_gib)]
    return ET.fromstring(memory_bars_svg(rows, int(capacity_gib * GIB)))


@pytest.mark.parametrize("totals", [[78.0], [79.5, 76.0, 70.0, 80.0], [40.0, 77.5, 85.0, 79.9], [1.0, 120.0, 79.0]])
def test_value_labels_never_cross_the_capacity_line(totals):
    # Before: a label started 4 px after its bar, so a bar ending just short of the line had its
    # "78.00 GiB" drawn across it.
    svg = _bars(totals)
    (line,) = svg.iter(SVG + "line")
    cx = float(line.get("x1"))
    labels = [t for t in svg.iter(SVG + "text") if t.get("class") == "total"]
    assert len(labels) == len(totals)
    boxes = [_box(t) for t in labels]
    width = float(svg.get("width"))
    for t, box in zip(labels, boxes):
        assert not box.x0 <= cx <= box.x1, f"{t.text} spans x {box.x0:.0f}..{box.x1:.0f} across the capacity line at {cx:.0f}"
        assert box.x1 <= width, f"{t.text} runs off the chart ({box.x1:.0f} > {width:.0f})"
    for i, a in enumerate(boxes):
        assert not any(a.meets(b) for b in boxes[i + 1:])


def test_each_value_label_sits_after_its_own_bar():
    svg = _bars([30.0, 79.0, 100.0])
    rects = [r for r in svg.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    labels = [t for t in svg.iter(SVG + "text") if t.get("class") == "total"]
    for rect, label in zip(rects, labels):
        assert float(label.get("x")) >= float(rect.get("x")) + float(rect.get("width"))
        assert float(rect.get("y")) <= float(label.get("y")) <= float(rect.get("y")) + float(rect.get("height"))


def test_long_strategy_names_stay_inside_the_chart():
    # Before: the names' column was a fixed 170 px, so "hsdp (shard groups of 2) (no fit)" began off the left edge.
    svg = _bars([10.0, 90.0], labels=["hsdp (shard groups of 2) (no fit)", "fsdp-grad-op (no fit)"])
    for t in svg.iter(SVG + "text"):
        if t.get("class") == "strategy":
            assert _box(t).x0 >= 0, t.text


def _topologies():
    out = [(name, preset_topology(name)) for name in ("dgx-a100", "a6000-nvlink-pairs", "pcie-8x-rtx4090", "hgx-h100")]
    parsed = {"dgx_a100_8gpu_10nic.txt": "a100-80gb", "rtx_a6000_8gpu_nvlink_bridge_pairs_2nic.txt": "rtx-a6000",
              "pcie_8x_rtx4090_all_sys_tabs.txt": "rtx-4090", "rtx4090_8gpu_all_sys_2nic_tabs.txt": "rtx-4090"}
    out += [(f, parse_topology((FIXTURES / f).read_text(), gpu(g))) for f, g in parsed.items()]
    return out


@pytest.mark.parametrize("name,topo", _topologies(), ids=[n for n, _ in _topologies()])
def test_link_labels_each_name_one_link_and_meet_nothing(name, topo):
    # Before: every label sat at its link's midpoint, so on 8 GPUs the four diameters' labels were
    # piled on the centre and no label could be told from its neighbours'.
    svg = ET.fromstring(topology_svg(topo))
    lines = [ln for ln in svg.iter(SVG + "line") if ln.get("class") == "link"]
    assert len(lines) == len(topo.links)
    circles = list(svg.iter(SVG + "circle"))
    labels = [t for t in svg.iter(SVG + "text") if t.get("class") == "link-label"]
    boxes = [_box(t) for t in labels]
    for i, (label, box) in enumerate(zip(labels, boxes)):
        crossed = [ln for ln in lines if box.crosses(*(float(ln.get(k)) for k in ("x1", "y1", "x2", "y2")))]
        assert len(crossed) == 1, f"{name}: label {label.text} at ({label.get('x')}, {label.get('y')}) " \
                                  f"lies on {len(crossed)} links"
        assert label.text in crossed[0].find(SVG + "title").text
        assert not any(box.meets(other) for other in boxes[i + 1:]), f"{name}: two link labels overlap"
        for c in circles:
            x, y, r = (float(c.get(k)) for k in ("cx", "cy", "r"))
            assert not box.meets(type(box)(x - r, y - r, x + r, y + r)), f"{name}: label {label.text} on a GPU"
    legend = " | ".join(t.text for t in svg.iter(SVG + "text") if t.get("class") == "link-class")
    for link in topo.links:  # every link class is named with its bandwidth, labelled on its links or not
        assert f"{link.code}: {link.kind}, {link.bandwidth_gbps:.1f} GB/s" in legend


def test_the_rare_nvlink_pairs_are_labelled_on_their_links():
    svg = ET.fromstring(topology_svg(preset_topology("a6000-nvlink-pairs")))
    assert sorted(t.text for t in svg.iter(SVG + "text") if t.get("class") == "link-label") == ["NV4"] * 4


def test_every_preset_draws():
    for name in PRESETS:
        ET.fromstring(topology_svg(preset_topology(name)))


class _Candidate:
    def __init__(self, strategy, hsdp_shard_size=None):
        self.strategy, self.hsdp_shard_size = strategy, hsdp_shard_size


def test_strategy_label():
    assert strategy_label(_Candidate("hsdp", 2)) == "hsdp (shard groups of 2)"
    assert strategy_label(_Candidate("zero3")) == "zero3"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    return TestClient(create_app(str(tmp_path_factory.mktemp("web") / "runs.sqlite")))


PAGE = {"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "topology": "hgx-h100", "seq_len": 4096, "global_batch": 256}


def test_chart_and_table_name_strategies_alike(client):
    # Before: the table said "hsdp (shard groups of 4)" and the chart "hsdp".
    html = client.get("/", params=PAGE).text
    table = re.findall(r'<td class="strategy">([^<]*)</td>', html.split('<table id="strategies">')[1].split("</table>")[0])
    chart = [re.sub(r" \(no fit\)$", "", s) for s in re.findall(r'<text class="strategy"[^>]*>([^<]*)</text>', html)]
    assert any("shard groups of" in s for s in table)
    assert chart == table


def test_fabric_choices_come_from_the_catalogue(client):
    html = client.get("/").text
    select = re.search(r'<select name="fabric"[^>]*>(.*?)</select>', html, re.S).group(1)
    assert re.findall(r'<option value="([^"]+)"', select) == list(link_rates()["fabric"])
    assert re.search(r'<input name="nics_per_node" type="number"', html)


def test_fabric_and_nics_reach_the_plan(client):
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    shown = {}
    for fabric in ("eth-25g", "ib-ndr"):
        params = PAGE | {"nodes": 2, "fabric": fabric, "nics_per_node": 1}
        response = client.get("/", params=params)
        assert response.status_code == 200
        assert f'<option value="{fabric}" selected>' in response.text
        assert 'name="nics_per_node" type="number" min="1" max="64" value="1"' in response.text
        shown[fabric] = float(re.search(r'<span id="inter-node">([\d.]+)</span>', response.text).group(1))
        expected = plan(PlanRequest(**params)).topology.inter_node_gbps_per_gpu
        assert shown[fabric] == pytest.approx(expected, abs=0.005)
    assert shown["eth-25g"] < shown["ib-ndr"]


def test_a_large_parsed_topology_is_named_by_its_legend():
    n = 32  # two classes: NVLink inside each 8-GPU board, SYS between boards
    text = "\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\n" + "".join(
        f"GPU{i}\t" + "\t".join(" X " if i == j else "NV12" if i // 8 == j // 8 else "SYS" for j in range(n)) + "\n"
        for i in range(n))
    svg = ET.fromstring(topology_svg(parse_topology(text, gpu("a100-80gb"))))
    legend = [t.text for t in svg.iter(SVG + "text") if t.get("class") == "link-class"]
    assert len(legend) == 2 and "112 pairs" in legend[0] and "384 pairs" in legend[1]
    assert not [t for t in svg.iter(SVG + "text") if t.get("class") == "link-label"]


def test_the_layout_on_the_topology_picture():
    """Each TP group is a band behind its GPUs and each PP stage a GPU colour, in torchtitan's mesh
    order (tp innermost, pp outermost): tp 2 x pp 2 x dp 2 on 8 GPUs puts GPU0-1, 2-3, 4-5, 6-7 in
    TP groups, GPU0-3 in stage 0 and GPU4-7 in stage 1."""
    from planner.parallel.dims import ParallelDims, node_layout, rank_coordinates

    dims = ParallelDims(dp_shard=2, tp=2, pp=2)
    assert rank_coordinates(dims, 5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    svg = ET.fromstring(topology_svg(preset_topology("hgx-h100"), layout=node_layout(dims, 8)))
    groups = [g.get("data-gpus") for g in svg.iter(SVG + "g") if g.get("class") == "tp-group"]
    assert groups == ["0,1", "2,3", "4,5", "6,7"]
    stages = [c.get("data-stage") for c in svg.iter(SVG + "circle") if c.get("data-stage") is not None
              and c.get("r") != "6"]
    assert stages == ["0"] * 4 + ["1"] * 4
    legend = [t.text for t in svg.iter(SVG + "text") if t.get("class") == "layout-legend"]
    assert legend[:4] == ["TP group 0: GPU0-1", "TP group 1: GPU2-3", "TP group 2: GPU4-5", "TP group 3: GPU6-7"]
    assert legend[4:6] == ["PP stage 0: GPU0-3", "PP stage 1: GPU4-7"]
    assert "tp innermost" in legend[-1]
    # four of the eight GPUs of a preset: the rest are drawn as unused
    svg = ET.fromstring(topology_svg(preset_topology("hgx-h100"), layout=node_layout(ParallelDims(tp=4), 4)))
    fills = [c.get("fill") for c in svg.iter(SVG + "circle") if c.get("r") == "24"]
    assert fills[4:] == ["#bbbbbb"] * 4 and "#bbbbbb" not in fills[:4]
    # without a layout the picture is as before: no band, no layout legend
    plain = topology_svg(preset_topology("hgx-h100"))
    assert "tp-group" not in plain and "layout-legend" not in plain


def test_the_reserved_peak_is_a_tick_over_its_bar_and_keyed():
    rows = [("a", {"parameters": 10 * GIB}), ("b", {"parameters": 20 * GIB})]
    svg = ET.fromstring(memory_bars_svg(rows, 80 * GIB, reserved=[12 * GIB, None]))
    (tick,) = [p for p in svg.iter(SVG + "path") if p.get("class") == "reserved"]
    (bar_a, _) = [r for r in svg.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    x = float(re.match(r"M([\d.]+) ", tick.get("d")).group(1))
    end = float(bar_a.get("x")) + float(bar_a.get("width"))
    assert x == pytest.approx(float(bar_a.get("x")) + 1.2 * float(bar_a.get("width")), abs=0.2) and x > end
    assert "reserved by the allocator" in "".join(t.text or "" for t in svg.iter(SVG + "text"))
    plain = ET.fromstring(memory_bars_svg(rows, 80 * GIB))
    assert not [p for p in plain.iter(SVG + "path")]
    keys = [t.text for t in plain.iter(SVG + "text") if t.get("class") is None and t.text in
            ("parameters", "gradients", "frozen base")]
    assert keys == ["parameters"]  # the legend names only what is drawn


def test_a_qlora_estimate_s_moments_and_its_frozen_base():
    from planner.memory.orchestrator import estimate
    from planner.render import moment_rows, moments_svg, peak_components
    from planner.schema import EstimateRequest

    result = estimate(EstimateRequest(model="llama-3.1-8b", gpu="rtx-4090", gpus=1, finetune="qlora",
                                      strategy="zero0", checkpointing="full"))
    parts = peak_components(result)
    assert parts["frozen_weights"] > 0 and sum(parts.values()) == result.per_device.peak_bytes
    rows = moment_rows(result)
    framework = result.per_device.peak_bytes - max(p.bytes for p in result.phases)
    assert [sum(d.values()) for _, d in rows] == [p.bytes + framework for p in result.phases]
    assert [name for name, _ in rows if name.endswith(" (peak)")] == [result.per_device.peak_phase + " (peak)"]
    svg = ET.fromstring(moments_svg(result, result.device_capacity_bytes))
    assert len([t for t in svg.iter(SVG + "text") if t.get("class") == "moment"]) == len(result.phases)


def test_the_step_time_split_adds_up_and_names_the_pipeline_bubble():
    from planner.parallel.pipeline import bubble_fraction
    from planner.plan.search import plan
    from planner.render import time_bars_svg, time_parts
    from planner.schema import PlanRequest

    result = plan(PlanRequest(model="llama-3.1-8b", gpus=8, nodes=2, pp=2, global_batch=64))
    c = result.recommended
    fraction = bubble_fraction(c.parallel.pp, c.gradient_accumulation, 1)
    parts = time_parts(c, fraction)
    assert sum(parts.values()) == pytest.approx(c.step_seconds, rel=1e-9)
    assert parts["bubbles"] == pytest.approx(c.compute_seconds * fraction) and parts["bubbles"] > 0
    assert time_parts(c)["bubbles"] == pytest.approx(c.step_seconds - c.compute_seconds
                                                      - c.exposed_communication_seconds - c.offload_seconds, abs=1e-12)
    svg = ET.fromstring(time_bars_svg([("x", parts)], [c.step_seconds]))
    assert [t.text for t in svg.iter(SVG + "text") if t.get("class") == "total"] == [f"{c.step_seconds:.3f} s"]
    assert not [line for line in svg.iter(SVG + "line")]  # seconds have no capacity line
