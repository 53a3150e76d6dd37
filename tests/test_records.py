"""The measured records of bench/accuracy.py (bench/results/runs/*.json, CPU ranks: each reproduces
to the byte) against the current model, without training: every recorded run within the 3% target,
and the moments the model was fixed on predicted to their measurement."""

import json
from pathlib import Path

import pytest

from planner.memory.orchestrator import cpu_rank_bytes, estimate
from planner.schema import EstimateRequest
from tests.real_runs import BENCH_RUNS, CPU_RUNS, TARGET_MISSES, TOLERANCE

RECORDS = Path(__file__).resolve().parent.parent / "bench" / "results" / "runs"
DECLARED = dict(CPU_RUNS + BENCH_RUNS)


def _record(name):
    record = json.loads((RECORDS / f"{name}.json").read_text())
    assert record["fields"] == json.loads(json.dumps(DECLARED[name])), f"record {name} is stale"
    return record


def _errors(name):
    record = _record(name)
    request = EstimateRequest(**record["fields"])
    result = estimate(request)
    peak, resident = cpu_rank_bytes(result, request.gpus)
    return (100 * (peak - record["measured_peak"]) / record["measured_peak"],
            100 * (resident - record["measured_resident"]) / record["measured_resident"], result)


@pytest.mark.parametrize("name", sorted(p.stem for p in RECORDS.glob("*.json") if p.stem in DECLARED))
def test_every_recorded_run_is_within_the_target(name):
    peak_err, resident_err, _ = _errors(name)
    bound = 100 * TOLERANCE if name in TARGET_MISSES else 3.0  # a declared miss of the 3% target
    assert abs(peak_err) <= bound and abs(resident_err) <= bound


@pytest.mark.parametrize("name", ["qwen2-v64k-zero3-fp32-small-t128", "qwen2-v32k-zero3-fp32-small-t64"])
def test_zero3_tied_embedding_peak_is_the_embeddings_backward(name):
    # measured with the peak trace: resident + the gathered embedding + the LM head's held gradient
    # + the embedding's dense gradient (buffers._zero3_embedding_backward); was -2.76% at the loss
    peak_err, _, result = _errors(name)
    assert result.per_device.peak_phase == "end of backward"
    assert abs(peak_err) < 0.5


@pytest.mark.parametrize("name", ["llama-ddp-bf16", "llama-v32k-ddp-bf16-t1024", "llama-tp2-bf16-sp-t256-ga4",
                                  "mistral-ddp-bf16-ckpt"])
def test_autocast_runs_count_the_fp32_stream(name):
    # torch.autocast over fp32 weights (DDP, a TP-only rank): the fp32 residual stream, norms and
    # RoPE tables, one 16-bit input copy per linear, no cast of the untied embedding or the norms'
    # weights (activations._autocast_stream_extra, frameworks/torch_2._uncast_elements); the peak
    # trace of llama-ddp-bf16 accounts for every site. Were -0.59%, +0.67%, -1.75%, -1.80%.
    peak_err, _, _ = _errors(name)
    assert abs(peak_err) < 0.05


@pytest.mark.parametrize("name", sorted(p.stem for p in RECORDS.glob("*.json") if p.stem in DECLARED
                                        and "measured_offloaded" in json.loads(p.read_text())))
def test_activation_offload_moves_the_predicted_bytes(name):
    """What TRL's OffloadActivations copied to the host per micro-batch (counted at its pack hook on
    the CPU rank, backend/offload.py) against the bytes the planner puts on the host link and in
    pinned memory (planner/recipes/activation_offload.py: the saved set but the LM head's input)."""
    from planner.memory.orchestrator import activation_offload_bytes, resolve

    record = _record(name)
    predicted = activation_offload_bytes(resolve(EstimateRequest(**record["fields"])))
    assert abs(predicted - record["measured_offloaded"]) <= 0.03 * record["measured_offloaded"]
