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
    r = client.post("/v1/plan", json={"model": "gpt2", "gpus": 8, "global_batch": 100})
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
    assert client.get("/v1/runs/12345").status_code == 404
    assert client.get("/v1/runs").json() == []


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
    while time.monotonic() < deadline and client.get(f"/v1/runs/{run_id}").json()["status"] == "running":
        time.sleep(1)
    run = client.get(f"/v1/runs/{run_id}").json()
    assert run["status"] == "ok" and run["record"]["measured"]["peak_bytes"] > 0
    monkeypatch.setenv("PLANNER_FAULT", "hang:0:1")
    run_id = client.post("/v1/verify", json=body, headers=auth).json()["id"]
    deadline = time.monotonic() + 120  # the rank hangs at step 1: step 0 is reported done first
    while time.monotonic() < deadline and "progress" not in client.get(f"/v1/runs/{run_id}").json():
        time.sleep(1)
    assert client.get(f"/v1/runs/{run_id}").json()["progress"] == {"steps_done": 1, "steps_total": 2}
    assert "1 of 2 done" in client.get(f"/runs/{run_id}").text
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
    assert client.get("/v1/runs").json() == []  # nothing recorded, nothing launched


def test_page_form_and_result(client):
    page = client.get("/")
    assert page.status_code == 200 and "<form" in page.text and "mistral-7b-v0.1" in page.text
    r = client.get("/", params={"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "seq_len": 4096,
                                "global_batch": 256})
    assert r.status_code == 200
    assert 'id="candidates"' in r.text and "<svg" in r.text and "capacity" in r.text and "GiB" in r.text
    assert "ds_config.json" in r.text or "torch_settings.json" in r.text
    bad = client.get("/", params={"model": "llama-3-8b", "gpus": 8, "global_batch": 100})
    assert bad.status_code == 422 and "not divisible" in bad.text
    d = client.get("/download/launch.sh", params={"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8})
    assert d.status_code == 200 and ("deepspeed" in d.text or "torchrun" in d.text)
