"""End to end in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright
fills the form on a live server, submits it, and checks the ranked table and the chart against the
core's own plan for the same inputs.

CI installs chromium and sets PLANNER_REQUIRE_BROWSER=1, so there a missing browser fails the
test instead of skipping it. PLANNER_SCREENSHOT=PATH also saves the result page (the README's
picture: docs/result-page.png).
"""

import os
import shutil
import socket
import threading
import time

import pytest

REQUIRED = os.environ.get("PLANNER_REQUIRE_BROWSER") == "1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _need(condition: bool, why: str) -> None:
    if not condition:
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    uvicorn = pytest.importorskip("uvicorn")
    from web.app import create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(create_app(str(tmp_path_factory.mktemp("web") / "runs.sqlite")),
                            host="127.0.0.1", port=port, log_level="warning")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not instance.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert instance.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    instance.should_exit = True
    thread.join(timeout=10)


def _playwright():
    _need(CHROMIUM is not None, "Debian's chromium is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need(False, "playwright (the Python package) is not installed")
    return sync_playwright


def _meets(a, b) -> bool:
    return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and \
        a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]


def _labels_clear(page) -> None:
    """As drawn by Chromium: no value label crosses the capacity line or meets another; no link
    label meets another or a GPU."""
    line = page.locator("#bars svg line.capacity").bounding_box()
    totals = [t.bounding_box() for t in page.locator("#bars svg text.total").all()]
    assert totals
    for i, box in enumerate(totals):
        assert not box["x"] <= line["x"] + line["width"] / 2 <= box["x"] + box["width"], (box, line)
        assert not any(_meets(box, other) for other in totals[i + 1:])
    labels = [t.bounding_box() for t in page.locator("#topology svg text.link-label").all()]
    gpus = [c.bounding_box() for c in page.locator("#topology svg circle").all()]
    assert gpus
    for i, box in enumerate(labels):
        assert not any(_meets(box, other) for other in labels[i + 1:] + gpus)
    assert page.locator("#topology svg text.link-class").count() >= 1  # the legend names each link class


def test_form_to_ranked_table_and_chart(server):
    sync_playwright = _playwright()
    from planner.plan import plan
    from planner.schema import PlanRequest

    expected = plan(PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, topology="hgx-h100",
                                seq_len=4096, global_batch=256))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(server + "/")
        page.select_option("select[name=model]", "llama-3-8b")
        page.select_option("select[name=gpu]", "h100-80gb")
        page.fill("input[name=gpus]", "8")
        page.select_option("select[name=topology]", "hgx-h100")
        page.fill("input[name=seq_len]", "4096")
        page.fill("input[name=global_batch]", "256")
        page.click("button[type=submit]")
        page.wait_for_selector("#strategies")
        assert "model=llama-3-8b" in page.url and "global_batch=256" in page.url  # the link carries the inputs
        best = expected.recommended
        assert page.locator("#recommended").inner_text().startswith(f"Recommended: {best.strategy}")
        strategies = {c.strategy for c in expected.candidates}
        assert page.locator("#strategies tr").count() == len(strategies) + 1  # the best setting of each
        assert page.locator("#candidates tr").count() == len(expected.candidates) + 1  # all, folded
        first = page.locator("#strategies tr").nth(1).locator("td")
        assert first.nth(1).inner_text() == best.strategy
        assert first.nth(2).inner_text() == "yes"
        assert first.nth(6).inner_text() == f"{best.per_device.peak_bytes / 2**30:.2f}"
        assert first.nth(7).inner_text() == f"{best.step_seconds:.3f}"
        totals = page.locator("#bars svg text.total")  # each bar adds up to its strategy's peak
        assert totals.nth(0).text_content() == f"{best.per_device.peak_bytes / 2**30:.2f} GiB"
        bars = page.locator("#bars svg")
        assert bars.count() == 1 and bars.bounding_box()["width"] > 200  # the chart is drawn, not just present
        assert "capacity" in page.locator("#bars").inner_text() or "capacity" in bars.inner_html()
        assert page.locator("#topology svg").count() == 1
        _labels_clear(page)
        table = page.locator("#strategies td.strategy").all_inner_texts()
        chart = [t.removesuffix(" (no fit)") for t in page.locator("#bars svg text.strategy").all_text_contents()]
        assert chart == table  # one name for a strategy in the table and the chart
        assert any("(shard groups of" in t for t in table)
        if os.environ.get("PLANNER_SCREENSHOT"):
            page.set_viewport_size({"width": 1200, "height": 1250})  # form, verdict, table and chart
            page.screenshot(path=os.environ["PLANNER_SCREENSHOT"])
        browser.close()


def test_fabric_inputs_and_a_labelled_topology(server):
    """The fabric and NICs inputs reach the plan (the page's inter-node bandwidth is the core's),
    and the NVLink-pair box's picture labels its NVLink pairs clear of everything else."""
    sync_playwright = _playwright()
    from planner.plan import plan
    from planner.schema import PlanRequest
    from planner.topology import link_rates

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(server + "/")
        options = page.locator("select[name=fabric] option").evaluate_all("os => os.map(o => o.value)")
        assert options == [""] + list(link_rates()["fabric"])  # the catalogue's fabrics, after "(preset's)"
        page.select_option("select[name=model]", "llama-3-8b")
        page.select_option("select[name=gpu]", "rtx-a6000")
        page.select_option("select[name=topology]", "a6000-nvlink-pairs")
        page.fill("input[name=nodes]", "2")
        page.select_option("select[name=fabric]", "eth-25g")
        page.fill("input[name=nics_per_node]", "1")
        page.click("button[type=submit]")
        page.wait_for_selector("#network")
        assert "fabric=eth-25g" in page.url and "nics_per_node=1" in page.url
        expected = plan(PlanRequest(model="llama-3-8b", gpu="rtx-a6000", gpus=8, nodes=2, topology="a6000-nvlink-pairs",
                                    seq_len=4096, global_batch=256, fabric="eth-25g", nics_per_node=1))
        assert page.locator("#inter-node").inner_text() == f"{expected.topology.inter_node_gbps_per_gpu:.2f}"
        assert page.locator("select[name=fabric]").input_value() == "eth-25g"
        _labels_clear(page)
        assert page.locator("#topology svg text.link-label").all_text_contents() == ["NV4"] * 4
        browser.close()


def test_degrees_on_the_form_and_the_layout_on_the_picture(server):
    """The degree inputs are the schema's (empty: the planner chooses), and the recommended layout
    is named and drawn on the topology: its legend says how ranks were placed."""
    sync_playwright = _playwright()
    from planner.schema import PlanRequest

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(server + "/")
        for name in ("tp", "pp", "cp", "ep"):
            box = page.locator(f"#degrees input[name={name}]")
            assert box.input_value() == "" and box.get_attribute("placeholder") == "planner chooses"
            assert box.locator("xpath=..").get_attribute("title") == PlanRequest.model_fields[name].description
        page.select_option("select[name=model]", "llama-3-8b")
        page.select_option("select[name=topology]", "hgx-h100")
        page.click("button[type=submit]")
        page.wait_for_selector("#layout")
        assert "&tp=&" in page.url  # sent empty, as the form sends any empty input: the planner chooses
        assert page.locator("#layout").inner_text().startswith("Layout: tp 1 x pp 1 x cp 1 x data-parallel 8")
        legend = page.locator("#topology svg text.layout-legend").all_text_contents()
        assert legend and "tp innermost" in legend[-1] and legend[-1].startswith("node 0 of 1")
        _labels_clear(page)
        page.fill("#degrees input[name=tp]", "2")
        page.click("button[type=submit]")
        page.wait_for_selector("#topology svg g.tp-group")  # a fixed degree: its TP groups drawn on the GPUs
        assert "tp=2" in page.url and page.locator("#layout").inner_text().startswith("Layout: tp 2 x")
        groups = page.locator("#topology svg g.tp-group").evaluate_all("gs => gs.map(g => g.dataset.gpus)")
        assert groups[:4] == ["0,1", "2,3", "4,5", "6,7"]  # tp innermost: consecutive GPUs of the node
        browser.close()
