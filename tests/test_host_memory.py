"""Host RAM for offload checked against the node's memory (issue 12): --host-memory-gib, or the
system memory the topology preset's datasheet states; per node, the sum over its ranks."""

import pytest

from cli.main import main
from planner.memory.orchestrator import estimate
from planner.plan.search import plan
from planner.cluster.presets import PRESETS
from planner.schema import EstimateRequest, PlanRequest

GIB = 2**30
# Llama-3.1-405B, ZeRO-3 with CPU offload on 4 x 8 H100 (the example): 1,700.91 GiB per node
OFFLOADED = dict(model="llama-3.1-405b", strategy="zero3", gpus=8, nodes=4, gpu="h100-80gb", seq_len=1024,
                 checkpointing="full", offload_optimizer="cpu", offload_params="cpu")


def test_the_preset_datasheet_is_the_default_and_it_fits():
    r = estimate(EstimateRequest(**OFFLOADED))
    assert r.host.capacity_bytes == 2000 * 10**9 and r.host.fits is True
    assert r.host.peak_bytes > 1700 * GIB  # the 1.7 TiB
    note = next(n for n in r.notes if n.startswith("host RAM fits"))
    assert "1,700.91 GiB" in note and "(the sum over its 8 ranks)" in note and "DGX H100 datasheet" in note


def test_an_offload_over_the_nodes_ram_does_not_fit_and_says_both_numbers():
    r = estimate(EstimateRequest(**OFFLOADED, host_memory_gib=1024))
    assert r.host.capacity_bytes == 1024 * GIB and r.host.fits is False and r.fits is False
    note = next(n for n in r.notes if n.startswith("host RAM does NOT fit"))
    assert "1,700.91 GiB" in note and "1,024.00 GiB) on the node (--host-memory-gib)" in note


def test_no_offload_or_unknown_ram_is_not_judged():
    plain = estimate(EstimateRequest(model="llama-3-8b", strategy="zero3", gpus=8))
    assert plain.host.fits is None and not any(n.startswith("host RAM") for n in plain.notes)
    pasted = estimate(EstimateRequest(model="llama-3-8b", strategy="zero3", gpus=2, offload_optimizer="cpu",
                                      topology_text="\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n"))
    assert pasted.host.capacity_bytes is None and pasted.host.fits is None and pasted.fits
    assert any("not checked (give --host-memory-gib)" in n for n in pasted.notes)
    cpu = estimate(EstimateRequest(model="llama-3-8b", strategy="zero3", gpus=2, gpu="cpu", offload_optimizer="cpu",
                                   host_memory_gib=1))
    assert cpu.host.capacity_bytes is None  # CPU ranks: the host is the device


def test_every_datasheet_preset_cites_its_system_memory():
    stated = {name: p for name, p in PRESETS.items() if p.host_memory_gb is not None}
    assert set(stated) == {"dgx-a100", "dgx-a100-320gb", "hgx-h100", "hgx-h200", "hgx-b200"}
    for p in stated.values():
        # the DGX A100 datasheet: 2TB in the 640GB system, 1TB in the 320GB one (8x A100 40GB)
        assert "datasheet" in p.host_memory_source and p.host_memory_gb == (1000 if p.gpu == "a100-40gb" else 2000)


def test_cli_estimate_shows_the_verdict_and_the_nodes_ram(capsys):
    argv = ["estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--gpus", "8", "--offload-optimizer", "cpu",
            "--offload-params", "cpu", "--host-memory-gib", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "host RAM of the node" in out
    line = next(line for line in out.splitlines() if line.startswith("DOES NOT FIT host RAM"))
    assert "134.62 GiB" in line and "64.00 GiB" in line
    assert main(argv[:-1] + ["0"]) == 2
    assert "--host-memory-gib: got 0.0" in capsys.readouterr().err


def test_plan_rejects_an_offload_over_the_nodes_ram_with_the_reason():
    req = dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, seq_len=2048, global_batch=64)
    tight = plan(PlanRequest(**req, host_memory_gib=64))
    offloaded = [c for c in tight.candidates if c.offload_optimizer != "none" or c.offload_params != "none"]
    assert offloaded and not any(c.fits for c in offloaded)
    reason = next(c.rejected_reason for c in offloaded if c.strategy == "zero3" and c.offload_params == "cpu")
    assert "offload holds 134.6 GiB of host RAM per node (the sum over its 8 ranks) > 64.0 GiB" in reason
    roomy = plan(PlanRequest(**req))  # hgx-h100's 2,000 GB
    assert any(c.fits for c in roomy.candidates if c.offload_optimizer != "none")


def test_verify_refuses_to_launch_over_the_nodes_ram(capsys, tmp_path):
    argv = ["verify", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "1", "--strategy", "zero3",
            "--offload-optimizer", "cpu", "--host-memory-gib", "8", "--db", str(tmp_path / "runs.sqlite")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "host RAM does NOT fit" in err and "8.00 GiB) on the node" in err and "does not launch" in err
    assert sum(line.startswith("planner: error:") for line in err.splitlines()) == 1


def test_api_refuses_the_verify_and_validates_the_field(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    client = TestClient(create_app(str(tmp_path / "runs.sqlite")))
    body = {"request": {"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 1, "strategy": "zero3",
                        "offload_optimizer": "cpu", "host_memory_gib": 8}}
    r = client.post("/v1/verify", json=body, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 422 and "host RAM does NOT fit" in str(r.json()["detail"])
    r = client.post("/v1/estimate", json={"model": "llama-3-8b", "host_memory_gib": -1})
    assert r.status_code == 422 and "host_memory_gib" in str(r.json()["detail"])
    r = client.post("/v1/estimate", json={"model": "llama-3-8b", "offload_optimizer": "cpu", "host_memory_gib": 4})
    assert r.status_code == 200 and r.json()["host"]["fits"] is False


def test_the_page_takes_the_nodes_ram_and_shows_the_rejection(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    client = TestClient(create_app(str(tmp_path / "runs.sqlite")))
    query = {"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "seq_len": 2048, "global_batch": 64}
    page = client.get("/", params=query | {"host_memory_gib": 64}).text
    assert 'name="host_memory_gib"' in page and 'value="64"' in page
    assert "GiB of host RAM per node (the sum over its 8 ranks) &gt; 64.0 GiB on the node" in page
    assert "GiB of host RAM per node" not in client.get("/", params=query).text
