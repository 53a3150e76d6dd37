"""The REST API and the page: every route x outcome, status code and message."""

from pathlib import Path
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from web.app import MAX_BODY_BYTES, create_app  # noqa: E402


@pytest.fixture()
def client(tmp_path, monkeypatch):
    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    monkeypatch.delenv("PLANNER_API_TOKEN_FILE", raising=False)
    return TestClient(create_app(str(tmp_path / "runs.sqlite")))


def test_health_and_catalogues(client):
    assert client.get("/healthz").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert any(m["name"] == "mistral-7b-v0.1" and m["parameters"] == 7_241_732_096 for m in models)
    assert client.get("/v1/models/gpt2").json()["parameters"] == 124_439_808
    r = client.get("/v1/models/gpt-5")
    assert r.status_code == 404 and "unknown model 'gpt-5'" in r.json()["detail"]
    assert any(g["name"] == "h200" for g in client.get("/v1/gpus").json())
    assert any(t["name"] == "dgx-a100" for t in client.get("/v1/topologies").json())


def test_estimate_equals_the_cli_json(client, capsys):
    import json

    from cli.main import main

    body = {"model": "llama-3-8b", "strategy": "zero3", "gpus": 8, "gpu": "h100-80gb", "seq_len": 4096}
    api = client.post("/v1/estimate", json=body)
    assert api.status_code == 200
    main(["estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--gpus", "8", "--gpu", "h100-80gb",
          "--seq-len", "4096", "--json"])
    cli = json.loads(capsys.readouterr().out)
    assert api.json() == cli


@pytest.mark.parametrize("body,status,message", [
    ({"model": "nope"}, 404, "unknown model 'nope'"),
    ({"model": "gpt2", "gpu": "tpu"}, 422, "unknown gpu 'tpu' (did you mean cpu?); choose from a100-40gb"),
    ({"model": "gpt2", "gpus": 0}, 422, "greater than or equal to 1"),
    ({"model": "gpt2", "strategy": "zero9"}, 422, "zero9"),
    ({"model": "gpt2", "surprise": 1}, 422, "Extra inputs are not permitted"),
    ({"model_config": {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 30}}, 422,
     "not divisible by num_attention_heads(30)"),
    ({"model": "gpt2", "strategy": "hsdp"}, 422, "is fsdp: give nodes >= 2"),
])
def test_estimate_errors(client, body, status, message):
    r = client.post("/v1/estimate", json=body)
    assert r.status_code == status and message in r.text


def test_plan_and_its_errors(client):
    r = client.post("/v1/plan", json={"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "topology": "hgx-h100",
                                      "seq_len": 4096, "global_batch": 256})
    assert r.status_code == 200 and r.json()["recommended"]["fits"]
    r = client.post("/v1/plan", json={"model": "gpt2", "gpus": 8, "global_batch": 101})
    assert r.status_code == 422 and "not divisible" in r.json()["detail"][0]["msg"]
    r = client.post("/v1/plan", json={"model": "gpt2", "topology": "dgx-z"})
    assert r.status_code == 422 and "choose from a6000-nvlink-pairs" in r.json()["detail"][0]["msg"]


def test_topology_route(client):
    text = (Path(__file__).parent / "fixtures" / "topologies" / "dgx_a100_8gpu_10nic.txt").read_text()
    r = client.post("/v1/topology", json={"text": text, "gpu": "a100-80gb"})
    assert r.status_code == 200 and r.json()["matrix"][0][1] == "NV12"
    r = client.post("/v1/topology", json={"text": "garbage", "gpu": "a100-80gb"})
    assert r.status_code == 422 and "no header line" in r.json()["detail"][0]["msg"]
    r = client.post("/v1/topology", json={"text": "x" * (70 * 1024)})
    assert r.status_code == 422


def test_oversized_body_is_413(client):
    r = client.post("/v1/estimate", content=b"{" + b" " * (MAX_BODY_BYTES + 10) + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_verify_needs_a_token(client, monkeypatch):
    body = {"request": {"model": "gpt2", "strategy": "zero2", "gpus": 2, "gpu": "cpu"}}
    r = client.post("/v1/verify", json=body)
    assert r.status_code == 401 and "no token is configured" in r.json()["detail"]
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    assert client.post("/v1/verify", json=body).status_code == 401
    r = client.post("/v1/verify", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = client.post("/v1/verify", json={"request": {"model": "nope", "gpu": "cpu"}},
                    headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 404
    assert client.get("/v1/runs/12345", headers={"Authorization": "Bearer s3cret"}).status_code == 404
    assert client.get("/v1/runs", headers={"Authorization": "Bearer s3cret"}).json() == []


@pytest.mark.deepspeed
def test_verify_job_runs_is_listed_and_cancel_ends_it(client, monkeypatch):
    pytest.importorskip("deepspeed")
    import time

    from tests.real_runs import LLAMA

    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    config = dict(LLAMA, num_hidden_layers=2)
    body = {"request": {"model_config": config, "strategy": "zero3", "gpus": 2, "gpu": "cpu", "micro_batch": 1,
                        "seq_len": 64}, "steps": 1, "warmup_steps": 1}
    r = client.post("/v1/verify", json=body, headers=auth)
    assert r.status_code == 202
    run_id = r.json()["id"]
    assert client.post("/v1/verify", json=body, headers=auth).status_code == 409  # one at a time per device set
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and client.get(f"/v1/runs/{run_id}", headers=auth).json()["status"] == "running":
        time.sleep(1)
    run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
    assert run["status"] == "ok" and run["record"]["measured"]["peak_bytes"] > 0
    monkeypatch.setenv("PLANNER_FAULT", "hang:0:1")
    run_id = client.post("/v1/verify", json=body, headers=auth).json()["id"]
    deadline = time.monotonic() + 120  # the rank hangs at step 1: step 0 is reported done first
    while time.monotonic() < deadline and "progress" not in client.get(f"/v1/runs/{run_id}", headers=auth).json():
        time.sleep(1)
    assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["progress"] == {"steps_done": 1, "steps_total": 2}
    assert "1 of 2 done" in client.get(f"/runs/{run_id}", headers=auth).text
    cancelled = client.delete(f"/v1/runs/{run_id}", headers=auth)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


def test_page_verify_button_needs_the_token_and_the_devices(client, monkeypatch):
    query = {"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "seq_len": 4096, "global_batch": 256}
    assert "run the recommended configuration" not in client.get("/", params=query).text  # no token: no button
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    assert "run the recommended configuration" in client.get("/", params=query).text
    wrong = client.post("/verify", params=query, data={"token": "nope"}, follow_redirects=False)
    assert wrong.status_code == 401
    # the token is right, but this CPU-only test machine has no H100s: refused before anything starts
    refused = client.post("/verify", params=query, data={"token": "s3cret"}, follow_redirects=False)
    assert refused.status_code == 422 and "CUDA device" in refused.text
    assert client.get("/v1/runs", headers={"Authorization": "Bearer s3cret"}).json() == []  # nothing recorded


def test_page_form_and_result(client):
    page = client.get("/")
    assert page.status_code == 200 and "<form" in page.text and "mistral-7b-v0.1" in page.text
    r = client.get("/", params={"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "seq_len": 4096,
                                "global_batch": 256})
    assert r.status_code == 200
    assert 'id="candidates"' in r.text and "<svg" in r.text and "capacity" in r.text and "GiB" in r.text
    assert "accelerate_config.yaml" in r.text and "job.sbatch" in r.text and "LAUNCH.md" in r.text
    bad = client.get("/", params={"model": "llama-3-8b", "gpus": 8, "tp": 2, "global_batch": 101})
    assert bad.status_code == 422 and "not divisible" in bad.text
    d = client.get("/download/launch.sh", params={"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8})
    assert d.status_code == 200 and ("deepspeed" in d.text or "torchrun" in d.text)


def test_page_takes_the_degrees_and_shows_the_layout(client):
    """The form's tp, pp, cp, ep come from the schema (bounds and description), empty lets the
    planner choose; the result names the recommended layout and draws it on the topology."""
    import re

    from planner.schema import PlanRequest

    page = client.get("/").text
    for name in ("tp", "pp", "cp", "ep"):
        tag = re.search(rf'<label title="([^"]*)">{name} <input name="{name}"[^>]*>', page)
        assert tag and tag.group(1) == PlanRequest.model_fields[name].description, name
        assert 'value=""' in tag.group(0) and 'placeholder="planner chooses"' in tag.group(0) and 'min="1"' in tag.group(0)
    r = client.get("/", params={"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "topology": "hgx-h100",
                                "global_batch": 256, "tp": ""})
    assert r.status_code == 200
    assert re.search(r'<p id="layout">Layout: tp 1 x pp 1 x cp 1 x data-parallel 8 ', r.text)
    assert 'class="layout-legend"' in r.text and "tp innermost" in r.text
    # the best of each layout family (data parallelism alone, with TP) and why the winner won
    assert '<table id="families">' in r.text and '<p id="winner-reason">Why: recommended ' in r.text
    fixed = client.get("/", params={"model": "llama-3-8b", "gpus": 8, "global_batch": 256, "tp": 2})
    assert fixed.status_code == 200 and re.search(r'<p id="layout">Layout: tp 2 x ', fixed.text)
    assert 'name="tp" type="number" min="1" max="1024" value="2"' in fixed.text  # the given degree stays in the form


def test_page_takes_the_pipeline_schedule_and_the_reduce_dtype(client):
    """The schedule, stages per rank and FSDP2's reduce dtype reach the plan from the form and stay
    selected; a value the schema refuses is a 422 naming the field."""
    r = client.get("/", params={"model": "llama-3.1-8b", "gpus": 8, "nodes": 2, "pp": 2, "pp_schedule": "interleaved",
                                "pp_virtual_stages": 2, "reduce_dtype": "fp32", "global_batch": 64})
    assert r.status_code == 200
    assert "<option selected>interleaved" in r.text and "<option selected>fp32" in r.text
    assert "Recommended: " in r.text and " x pp 2" in r.text
    bad = client.get("/", params={"model": "llama-3.1-8b", "pp_virtual_stages": 0})
    assert bad.status_code == 422 and "pp_virtual_stages: Input should be greater than or equal to 1" in bad.text


NON_ASCII = {"Authorization": b"Bearer s3cr\xe9t"}  # a latin-1 byte, as a client may send it


def test_a_non_ascii_token_is_401_not_500(client, monkeypatch):
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    body = {"request": {"model": "gpt2", "strategy": "zero2", "gpus": 2, "gpu": "cpu"}}
    assert client.post("/v1/verify", json=body, headers=NON_ASCII).status_code == 401
    assert client.delete("/v1/runs/1", headers=NON_ASCII).status_code == 401
    assert client.get("/v1/runs", headers=NON_ASCII).status_code == 401
    query = {"model": "gpt2", "gpu": "a100-80gb", "gpus": 1}
    assert client.post("/verify", params=query, data={"token": "s3cr\xe9t"}).status_code == 401
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cr\xe9t")  # a non-ASCII token configured: compared as bytes
    assert client.post("/verify", params=query, data={"token": "s3cr\xe9t"}).status_code != 401


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(client, monkeypatch, scheme):
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    r = client.delete("/v1/runs/12345", headers={"Authorization": f"{scheme} s3cret"})
    assert r.status_code == 404 and "no run with id 12345" in r.json()["detail"]  # past the token check
    assert client.delete("/v1/runs/12345", headers={"Authorization": "Basic s3cret"}).status_code == 401


def test_run_records_are_behind_the_token_unless_public(tmp_path, monkeypatch):
    from backend.store import RunStore

    db = tmp_path / "runs.sqlite"
    run_id = RunStore(db, create=True).start({"model": "gpt2", "request": {"strategy": "zero2", "gpus": 2, "nodes": 1,
                                              "gpu": "cpu"}, "prediction": {"per_device": {"peak_bytes": 1,
                                              "resident_bytes": 1}}, "status": "running"})
    monkeypatch.delenv("PLANNER_PUBLIC_RUNS", raising=False)
    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    open_client = TestClient(create_app(str(db)))
    assert open_client.get("/v1/runs").status_code == 200  # no token configured: nothing to guard with
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    private = TestClient(create_app(str(db)))
    for path in ("/v1/runs", f"/v1/runs/{run_id}", f"/runs/{run_id}"):
        r = private.get(path)
        assert r.status_code == 401 and "Bearer" in r.text, path
        assert private.get(path, headers={"Authorization": "bearer s3cret"}).status_code == 200, path
    assert private.post("/v1/estimate", json={"model": "gpt2"}).status_code == 200  # planning stays open
    # the page's verify form leaves a cookie keyed by the token (never the token) for the run pages
    from web.pages import RUNS_COOKIE, _runs_pass

    private.cookies.set(RUNS_COOKIE, _runs_pass("wrong"))
    assert private.get(f"/runs/{run_id}").status_code == 401
    private.cookies.set(RUNS_COOKIE, _runs_pass("s3cret"))
    assert private.get(f"/runs/{run_id}").status_code == 200 and "s3cret" not in _runs_pass("s3cret")
    assert TestClient(create_app(str(db), public_runs=True)).get("/v1/runs").json()[0]["id"] == run_id
    monkeypatch.setenv("PLANNER_PUBLIC_RUNS", "1")
    assert TestClient(create_app(str(db))).get(f"/v1/runs/{run_id}").status_code == 200


def test_reading_runs_creates_no_database(tmp_path):
    db = tmp_path / "later" / "runs.sqlite"
    client = TestClient(create_app(str(db)))
    assert client.get("/v1/runs").json() == [] and client.get("/v1/runs/1").status_code == 404
    assert not (tmp_path / "later").exists()


def test_an_unusable_database_is_503_with_the_reason(tmp_path, monkeypatch):
    import sqlite3

    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"garbage" * 1000)
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE invoices (id INTEGER)")
    for path, reason in ((corrupt, "file is not a database"), (foreign, "another program")):
        client = TestClient(create_app(str(path)))
        for r in (client.get("/v1/runs"), client.get("/v1/runs/1")):
            assert r.status_code == 503 and reason in r.json()["detail"] and str(path) in r.json()["detail"]
        assert client.post("/v1/estimate", json={"model": "gpt2"}).status_code == 200
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    r = TestClient(create_app(str(foreign))).post("/v1/verify", headers={"Authorization": "Bearer s3cret"}, json={
        "request": {"model": "gpt2", "strategy": "zero2", "gpus": 2, "gpu": "cpu"}})
    assert r.status_code == 503 and "another program" in r.json()["detail"]


def test_a_run_of_another_process_is_not_cancelled_here(tmp_path, monkeypatch):
    from backend.store import RunStore

    db = tmp_path / "runs.sqlite"
    run_id = RunStore(db, create=True).start({"model": "gpt2", "request": {"strategy": "zero2", "gpus": 2, "nodes": 1,
                                              "gpu": "cpu"}, "prediction": {"per_device": {"peak_bytes": 1,
                                              "resident_bytes": 1}}, "status": "running"})  # owned by this process
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    r = TestClient(create_app(str(db))).delete(f"/v1/runs/{run_id}", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 409 and "running in another planner process" in r.json()["detail"]


@pytest.mark.parametrize("content", [None, b"\xff\xfe\x00", b"  \n"], ids=["unreadable", "binary", "empty"])
def test_a_broken_token_file_keeps_the_run_records_closed(tmp_path, monkeypatch, capsys, content):
    """A token file that gives no token is the server's misconfiguration: taking it as "no token"
    would serve private run records to anyone. The request is refused (503, naming the file) and
    `planner serve` refuses to start (exit 2, one line); the estimate stays open."""
    from cli.main import main

    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_bytes(content)
    monkeypatch.delenv("PLANNER_PUBLIC_RUNS", raising=False)
    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    monkeypatch.setenv("PLANNER_API_TOKEN_FILE", str(token_file))
    client = TestClient(create_app(str(tmp_path / "runs.sqlite")))
    for path in ("/v1/runs", "/v1/runs/1"):
        r = client.get(path)
        assert r.status_code == 503 and "PLANNER_API_TOKEN_FILE" in r.json()["detail"], (path, r.text)
    assert client.delete("/v1/runs/1", headers={"Authorization": "Bearer x"}).status_code == 503
    assert client.post("/v1/estimate", json={"model": "gpt2"}).status_code == 200
    assert main(["serve", "--db", str(tmp_path / "runs.sqlite"), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"PLANNER_API_TOKEN_FILE={token_file}" in err
    token_file.write_text("s3cret\n")  # mended (or rotated): read again at the next request
    assert client.get("/v1/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/v1/runs").status_code == 401


def test_an_endless_token_file_is_refused_not_read_whole(tmp_path, monkeypatch):
    """The token file is read at every request: /dev/zero (no size, no end) is refused by its
    first 4 KiB, not read until the server runs out of memory."""
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    monkeypatch.setenv("PLANNER_API_TOKEN_FILE", "/dev/zero")
    r = TestClient(create_app(str(tmp_path / "runs.sqlite"))).get("/v1/runs")
    assert r.status_code == 503 and "PLANNER_API_TOKEN_FILE=/dev/zero: more than 4096 bytes" in r.json()["detail"]
