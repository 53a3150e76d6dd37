"""End to end in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright
fills the form on a live server, submits it, and checks the ranked table and the chart against the
core's own plan for the same inputs.

CI installs chromium and sets PLANNER_REQUIRE_BROWSER=1, so there a missing browser fails the
test instead of skipping it. The questions people bring (a QLoRA fit on one consumer GPU, a plan
over four nodes, a dropped job file) are asked as a user asks them, and the page's numbers are
checked against the API's for the same question. Screenshots (desktop and phone) are taken each
run; PLANNER_SCREENSHOTS=docs saves them where the README shows them.
"""

import json
import os
import re
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_port

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

    port = free_port()
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
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    expected = plan(PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, topology="hgx-h100",
                                seq_len=4096, global_batch=256))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(server + "/")
        page.fill("input[name=model]", "llama-3-8b")
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
        browser.close()


def test_fabric_inputs_and_a_labelled_topology(server):
    """The fabric and NICs inputs reach the plan (the page's inter-node bandwidth is the core's),
    and the NVLink-pair box's picture labels its NVLink pairs clear of everything else."""
    sync_playwright = _playwright()
    from planner.plan.search import plan
    from planner.schema import PlanRequest
    from planner.cluster.topology import link_rates

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(server + "/")
        options = page.locator("select[name=fabric] option").evaluate_all("os => os.map(o => o.value)")
        assert options == [""] + list(link_rates()["fabric"])  # the catalogue's fabrics, after "(preset's)"
        page.fill("input[name=model]", "llama-3-8b")
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
        page.fill("input[name=model]", "llama-3-8b")
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


GIB = 2 ** 30
QLORA = {"model": "llama-3.1-8b", "gpu": "rtx-4090", "gpus": 1, "finetune": "qlora", "strategy": "zero0",
         "checkpointing": "full"}
FOUR_NODES = {"model": "llama-3.1-70b", "gpu": "h100-80gb", "gpus": 8, "nodes": 4, "global_batch": 512}


def _post(server: str, route: str, body: dict) -> dict:
    request = urllib.request.Request(server + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def _shots(tmp_path) -> Path:
    """Where screenshots go: PLANNER_SCREENSHOTS (the README's docs/), else this test's own folder."""
    where = Path(os.environ.get("PLANNER_SCREENSHOTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


def _room(page) -> dict:
    return {k: page.locator(f"#{k}").inner_text() for k in ("peak", "capacity", "headroom", "headroom-percent")}


def _expected_room(peak: int, capacity: int) -> dict:
    return {"peak": f"{peak / GIB:.2f}", "capacity": f"{capacity / GIB:.2f}",
            "headroom": f"{(capacity - peak) / GIB:.2f}", "headroom-percent": f"{100 * (capacity - peak) / capacity:.1f}"}


def _no_sideways_scroll(page, width: int) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= width


def test_a_qlora_question_on_one_rtx_4090(server, tmp_path):
    """Can I QLoRA Llama-3.1-8B on my 4090? Asked through the form with the keyboard's controls;
    the verdict, peak and headroom are the API's; the page holds on a phone."""
    sync_playwright = _playwright()
    api = _post(server, "/v1/estimate", QLORA)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server + "/")
        page.check("input[name=ask][value=estimate]")
        assert page.locator("input[name=global_batch]").is_disabled()  # the plan's field is not sent
        assert page.locator("input[name=micro_batch]").is_enabled()
        page.fill("input[name=model]", QLORA["model"])
        page.select_option("select[name=gpu]", QLORA["gpu"])
        page.fill("input[name=gpus]", "1")
        page.select_option("select[name=finetune]", "qlora")
        page.select_option("select[name=strategy]", "zero0")
        page.select_option("select[name=checkpointing]", "full")
        page.click("button[type=submit]")
        page.wait_for_selector("#room")
        assert "ask=estimate" in page.url and "finetune=qlora" in page.url
        assert page.locator("#verdict").inner_text().startswith("Fits" if api["fits"] else "Does not fit")
        assert _room(page) == _expected_room(api["per_device"]["peak_bytes"], api["device_capacity_bytes"])
        assert f"{api['time']['step_seconds']:.3f} s per step" in page.locator("#recommended").inner_text()
        assert page.locator("#moments svg text.moment").count() == len(api["phases"])
        assert page.locator("#time svg").bounding_box()["width"] > 200
        assert page.locator("select[name=finetune]").input_value() == "qlora"  # the form keeps the question
        answer, ask = page.locator("#answer").bounding_box(), page.locator("#ask").bounding_box()
        assert ask["x"] + ask["width"] <= answer["x"]  # wide: the form beside the answer
        page.set_viewport_size({"width": 2560, "height": 1200})
        _no_sideways_scroll(page, 2560)
        assert page.locator("#ask").bounding_box()["y"] == page.locator("#answer").bounding_box()["y"]
        phone = browser.new_page(viewport={"width": 375, "height": 812})
        phone.goto(page.url)
        _no_sideways_scroll(phone, 375)
        assert phone.locator("#answer").bounding_box()["y"] < phone.locator("#ask").bounding_box()["y"]  # pictures first
        assert _room(phone) == _room(page)
        phone.screenshot(path=str(_shots(tmp_path) / "page-qlora-phone.png"))
        browser.close()


def test_a_plan_over_four_nodes(server, tmp_path):
    """A 70B model on four nodes of eight H100: the recommendation, its peak and headroom, its step
    time are the API's; every picture is drawn; the link asks it again."""
    sync_playwright = _playwright()
    api = _post(server, "/v1/plan", FOUR_NODES)
    best = api["recommended"]
    capacity = next(g["memory_bytes"] for g in json.load(urllib.request.urlopen(server + "/v1/gpus", timeout=30))
                    if g["name"] == "h100-80gb")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server + "/")
        page.fill("input[name=model]", FOUR_NODES["model"])
        page.fill("input[name=nodes]", "4")
        page.fill("input[name=global_batch]", "512")
        page.click("button[type=submit]")
        page.wait_for_selector("#room")
        assert page.locator("#recommended").inner_text().startswith(f"Recommended: {best['strategy']}")
        assert _room(page) == _expected_room(best["per_device"]["peak_bytes"], capacity)
        assert f"{best['step_seconds']:.3f} s per step" in page.locator("#recommended").inner_text()
        assert page.locator("#network").inner_text().startswith("Wiring: 4 nodes of 8 h100-80gb")
        for figure in ("bars", "moments", "time", "topology"):
            assert page.locator(f"#{figure} svg").bounding_box()["width"] > 200, figure
        _labels_clear(page)
        rows = page.locator("#strategies td.strategy").all_inner_texts()
        assert page.locator("#time svg text.option").all_text_contents() == rows  # one time bar per option
        page.set_viewport_size({"width": 1400, "height": 1100})  # the form, the verdict and the first pictures
        page.screenshot(path=str(_shots(tmp_path) / "page-plan-desktop.png"))
        page.goto(server + page.locator("#share").get_attribute("href"))
        assert _room(page) == _expected_room(best["per_device"]["peak_bytes"], capacity)
        phone = browser.new_page(viewport={"width": 375, "height": 812})
        phone.goto(page.url)
        _no_sideways_scroll(phone, 375)
        browser.close()


def _drop(page, name: str, text: str) -> None:
    """A file dropped on the drop zone, as a desktop's file manager drops it."""
    transfer = page.evaluate_handle("""([name, text]) => { const t = new DataTransfer();
        t.items.add(new File([text], name, {type: "application/octet-stream"})); return t; }""", [name, text])
    page.dispatch_event("#drop", "drop", {"dataTransfer": transfer})


def test_a_dropped_request_file_fills_the_form_and_is_answered(server):
    sync_playwright = _playwright()
    request = {"model": "mistral-7b-v0.1", "strategy": "zero2", "gpus": 4, "micro_batch": 2, "seq_len": 2048,
               "gpu": "a100-80gb"}
    api = _post(server, "/v1/estimate", request)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server + "/")  # the plan is asked by default; the file's fields are the estimate's
        with page.expect_navigation():
            _drop(page, "job.json", json.dumps(request))
        page.wait_for_selector("#room")
        assert "ask=estimate" in page.url and "strategy=zero2" in page.url
        assert page.locator("input[name=micro_batch]").input_value() == "2"
        assert page.locator("select[name=gpu]").input_value() == "a100-80gb"
        assert _room(page) == _expected_room(api["per_device"]["peak_bytes"], api["device_capacity_bytes"])
        # a result file holds its request: dropped, it asks the same question again
        with page.expect_navigation():
            _drop(page, "estimate.json", json.dumps(api))
        page.wait_for_selector("#room")
        assert _room(page) == _expected_room(api["per_device"]["peak_bytes"], api["device_capacity_bytes"])
        # a plan's result: its request lists every degree at 1; the planner still chooses them
        plan_result = _post(server, "/v1/plan", {"model": "llama-3-8b", "gpus": 8, "global_batch": 256})
        with page.expect_navigation():
            _drop(page, "plan.json", json.dumps(plan_result))
        page.wait_for_selector("#room")
        assert "ask=plan" in page.url and page.locator("input[name=tp]").input_value() == ""
        assert page.locator("#recommended").inner_text().startswith(
            f"Recommended: {plan_result['recommended']['strategy']}")
        assert page.locator("#peak").inner_text() == f"{plan_result['recommended']['per_device']['peak_bytes'] / GIB:.2f}"
        # any other job file goes to POST /v1/check; where the server lacks it, the page says so
        _drop(page, "launch.sh", "#!/bin/sh\ndeepspeed train.py --deepspeed ds_config.json\n")
        status = page.locator("#drop-status")
        if status.get_attribute("data-check") == "no":
            status.filter(has_text="launch.sh: this server has no POST /v1/check").wait_for()
        else:  # read by /v1/check: the form is filled from its request and answered, or its refusal is shown
            status.filter(has_text=re.compile(r"launch\.sh: (read by|/v1/check refused)")).wait_for()
        browser.close()


def test_keyboard_and_screen_reader(server):
    """Every visible control has a label and a described-by help text that exists; the tab order
    runs drop zone, question, model; an error's field says it is invalid and names the error."""
    sync_playwright = _playwright()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server + "/?model=llama-3-8b&gpus=0")
        unlabelled = page.evaluate("""() => [...document.querySelectorAll('#form input, #form select, #form textarea')]
            .filter(c => c.type !== 'hidden' && (!c.labels || c.labels.length === 0)).map(c => c.name)""")
        assert unlabelled == []
        broken = page.evaluate("""() => [...document.querySelectorAll('[aria-describedby]')].filter(c =>
            c.getAttribute('aria-describedby').split(' ').some(id => !document.getElementById(id))).map(c => c.name)""")
        assert broken == []
        assert page.locator("input[name=gpus]").get_attribute("aria-invalid") == "true"
        assert "greater than or equal to 1" in page.locator("#err-gpus").inner_text()
        page.click("#errors a")  # the summary's link takes focus to the field
        assert page.evaluate("location.hash") == "#f-gpus"
        page.goto(server + "/")
        order = []
        for _ in range(3):
            page.keyboard.press("Tab")
            order.append(page.evaluate("document.activeElement.name || document.activeElement.id"))
        assert order == ["job-file", "ask", "model"], order
        browser.close()


def test_a_job_file_read_by_check_fills_the_form(server):
    """The page's side of POST /v1/check (issue 23): its answer's request (a full EstimateRequest,
    every field listed) fills the form and is answered; a refusal is shown beside the drop zone.
    The route is answered here by Playwright, so the page is tested whichever server it meets."""
    sync_playwright = _playwright()
    from planner.schema import EstimateRequest

    job = EstimateRequest(model="qwen3-8b", strategy="zero2", gpus=4, gpu="a100-80gb", micro_batch=2,
                          seq_len=2048, checkpointing="full")
    sent = []

    def answer(route):
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, content_type="application/json",
                      body=json.dumps({"request": job.model_dump(mode="json", by_alias=True),
                                       "notes": ["zero stage 2 from ds_config.json"]}))

    api = _post(server, "/v1/estimate", job.model_dump(mode="json", by_alias=True, exclude_defaults=True))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server + "/")
        page.route("**/v1/check", answer)
        with page.expect_navigation():
            _drop(page, "ds_config.json", '{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2}')
        page.wait_for_selector("#room")
        assert sent[0]["files"] == [{"name": "ds_config.json",
                                     "text": '{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2}'}]
        assert "ask=estimate" in page.url and page.locator("select[name=strategy]").input_value() == "zero2"
        assert _room(page) == _expected_room(api["per_device"]["peak_bytes"], api["device_capacity_bytes"])
        page.unroute("**/v1/check")
        page.route("**/v1/check", lambda route: route.fulfill(
            status=422, content_type="application/json",
            body=json.dumps({"detail": [{"loc": ["body", "files", 0, "text"], "msg": "not a job file we read",
                                         "type": "value_error"}]})))
        _drop(page, "notes.txt", "hello")
        page.locator("#drop-status").filter(has_text="notes.txt: /v1/check refused it (422): files.0.text: "
                                                      "not a job file we read").wait_for()
        browser.close()
