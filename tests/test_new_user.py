"""What a new user typed and what must come back (issue 27, items 3-6 and 9): defaulted sizes said,
rows that add up to the peak, the host RAM an offloading option needs, fine-tuning in plan, and
the small things (n/a ratios, aligned long labels, help text, --seq-len 4k)."""

import json
import re
from pathlib import Path

import pytest

from backend.report import verify_table
from cli.main import main
from planner.memory.orchestrator import estimate
from planner.schema import EstimateRequest

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^  (\S.*?)\s+(-?[\d,]+\.\d\d)\s+(-?[\d,]+\.\d\d)$")

# many requests over strategies, layouts, fine-tuning, offload and --params
REQUESTS = [dict(model="llama-3.1-8b", strategy=s, gpus=8) for s in
            ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op")] + [
    dict(model="llama-3.1-8b", strategy="hsdp", gpus=8, nodes=2),
    dict(model="llama-3.1-8b", strategy="single", gpus=1, checkpointing="full"),
    dict(model="qwen3-32b", finetune="lora", strategy="zero3", gpus=8),
    dict(model="qwen3-32b", finetune="lora", strategy="ddp", gpus=8),
    dict(model="llama-3.1-8b", finetune="qlora", strategy="zero2", gpus=2),
    dict(model="mixtral-8x7b", strategy="zero3", gpus=8, ep=8),
    dict(model="mixtral-8x7b", strategy="fsdp", gpus=8, ep=8),
    dict(model="llama-3.1-70b", strategy="fsdp", gpus=8, tp=4),
    dict(model="llama-3.1-70b", strategy="fsdp", gpus=8, pp=2, gradient_accumulation=4),
    dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, cp=2, seq_len=16384),
    dict(params="7B", strategy="zero3", gpus=8),
    dict(model="llama-3.1-8b", strategy="zero3", gpus=8, offload_optimizer="cpu", offload_params="cpu"),
    dict(model="llama-3.1-8b", strategy="zero2", gpus=4, micro_batch=2, gradient_accumulation=3),
]


@pytest.mark.parametrize("kw", REQUESTS, ids=[f"{k.get('model', k.get('params'))}-{k['strategy']}-{i}"
                                              for i, k in enumerate(REQUESTS)])
def test_the_rows_add_up_to_the_peak_in_json_and_text(kw, capsys):
    r = estimate(EstimateRequest(**kw))
    a, d = r.per_device.at_peak, r.per_device
    rows = (a.parameters_bytes + a.gradients_bytes + a.optimizer_states_bytes + a.frozen_weights_bytes
            + a.activations_bytes + a.buffers_bytes + a.framework_bytes)
    assert rows == d.peak_bytes
    assert d.buffers_bytes == a.buffers_bytes >= 0
    assert min(a.model_dump().values()) >= 0
    args = ["estimate"] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    assert main(args) == 0
    text = capsys.readouterr().out
    table = text.split("  " + "-" * 54)[0].splitlines()
    shown = [float(m.group(3).replace(",", "")) for m in map(ROW.match, table) if m]
    peak = next(float(m.group(3).replace(",", "")) for m in map(ROW.match, text.splitlines())
                if m and m.group(1).startswith(("peak", "backward)", "micro-batch")) or False)
    assert abs(sum(shown) - peak) <= 0.005 * len(shown) + 1e-9, text


def test_lora_shows_its_frozen_base_and_names_it_in_rejections(capsys):
    assert main(["estimate", "--model", "qwen3-32b", "--finetune", "lora", "--gpus", "8", "--strategy", "ddp"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"frozen base weights\s+61\.02", text) and "parameters (trainable)" in text
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "1", "--gpu", "rtx-4090", "--finetune", "lora"]) == 0
    text = capsys.readouterr().out
    assert "0.0 GB of params" not in text and "GB of frozen base" in text


def test_the_buffers_row_counts_the_reduce_bucket_under_ep():
    r = estimate(EstimateRequest(model="mixtral-8x7b", strategy="zero3", gpus=8, ep=8))
    peak = next(p for p in r.phases if p.name == r.per_device.peak_phase)
    bucket = sum(i.bytes for i in peak.items if "reduce bucket" in i.name)
    assert bucket > 0 and r.per_device.buffers_bytes >= bucket


def test_plan_says_the_host_ram_an_offloading_option_needs(capsys):
    """The README's A6000 example: an option that offloads says its host RAM per node."""
    assert main(["plan", "--model", "llama-2-13b", "--gpu", "rtx-a6000", "--gpus", "8", "--topology-file",
                 str(ROOT / "examples" / "topo-rtx-a6000.txt"), "--seq-len", "2048", "--global-batch", "64",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    offloading = [(k, c) for k, c in enumerate(result["candidates"], 1) if c["fits"] and c["offload_optimizer"] != "none"]
    assert offloading and all(c["host"]["peak_bytes"] > 0 for _, c in offloading)
    assert main(["plan", "--model", "llama-2-13b", "--gpu", "rtx-a6000", "--gpus", "8", "--topology-file",
                 str(ROOT / "examples" / "topo-rtx-a6000.txt"), "--seq-len", "2048", "--global-batch", "64"]) == 0
    text = capsys.readouterr().out
    k, c = offloading[0]
    assert f"#{k} offloads {c['host']['peak_bytes'] / 2**30:,.2f} GiB of host RAM per node" in text


def test_finetune_auto_on_one_gpu_recommends_no_framework_and_labels_its_rows(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "1", "--gpu", "rtx-4090", "--finetune", "auto",
                 "--lora-alpha", "32"]) == 0
    text = capsys.readouterr().out
    assert "recommended: single," in text
    head = next(line for line in text.splitlines() if line.strip().startswith("#"))
    assert "method" in head and re.search(r"^\s+1 single\s+LoRA", text, re.M)
    lines = text.splitlines()
    for i, line in enumerate(lines):  # a heading has what it heads under it
        if line.startswith("rejected ("):
            assert lines[i + 1].startswith("  ")
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "1", "--gpu", "rtx-4090", "--quantize-base", "nf4"]) == 2
    assert "quantize_base" in capsys.readouterr().err


def test_a_config_missing_size_fields_names_each_default(tmp_path, capsys):
    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    assert main(["estimate", "--model-file", str(path)]) == 0
    text = capsys.readouterr().out
    warning = next(line for line in text.splitlines() if "does not give" in line)
    for name in ("num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads"):
        assert name in warning
    assert "hidden_size 4" not in warning


def test_verify_prints_na_for_a_zero_measurement_and_never_minus_100():
    record = {"id": 1, "status": "ok", "message": "", "tolerance": 0.05,
              "prediction": {"per_device": {"resident_bytes": 10**9, "peak_bytes": 2 * 10**9}},
              "measured": {"resident_bytes": 10**9, "peak_bytes": 2 * 10**9,
                           "ranks": [{"rank": 0, "status": "ok", "peak_bytes": 1, "resident_bytes": 1, "step_seconds": 1}]},
              "errors": {"within_tolerance": True, "resident_components": {
                  "buffers": {"predicted": 0, "measured": 1000, "error_pct": -100.0},
                  "gradients": {"predicted": 10**6, "measured": 0, "error_pct": None}}}}
    text = verify_table(record)
    assert "-100.00%" not in text
    assert re.search(r"buffers\s+0\.00\s+0\.00\s+n/a", text)


def test_small_things(capsys):
    assert main(["estimate", "--params", "7B", "--gpus", "8"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.count("7,000,000,000") + first.count("7000000000") == 1
    # a long phase label wraps; every row's figures sit in the same columns
    assert main(["estimate", "--model", "llama-3.1-8b", "--strategy", "fsdp", "--gpus", "8",
                 "--gradient-accumulation", "2"]) == 0
    table = capsys.readouterr().out.split("\n\n")[1].splitlines()
    ends = {len(line) for line in table[1:] if ROW.match(line)}
    assert len(ends) == 1 and all(len(line) <= max(ends) for line in table)
    for command in ("estimate", "plan"):
        try:
            main([command, "--help"])
        except SystemExit:
            pass
        text = " ".join(capsys.readouterr().out.split())
        assert "(what --" not in text
        assert not re.search(r"\(default[^)]*\) \(default: ", text)
    assert main(["estimate", "--model", "llama-3.1-8b", "--seq-len", "4k", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["seq_len"] == 4096
    assert main(["estimate", "--model", "llama-3.1-8b", "--seq-len", "4.0001k"]) == 2
    assert "--seq-len" in capsys.readouterr().err


def test_the_page_says_the_candidates_count_once(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    client = TestClient(create_app(str(tmp_path / "runs.sqlite")))
    page = client.get("/", params={"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "seq_len": 4096,
                                   "global_batch": 256}).text
    assert len(re.findall(r"candidates evaluated", page)) == 1
    assert not re.search(r"\d candidates; ", page)
