"""The memory model against what DeepSpeed (and torch DDP/FSDP) really allocate, on CPU ranks.

Each run trains the architecture for a few steps through the real launcher (`deepspeed`, or
torch.distributed.run for the torch strategies) over gloo; every rank measures its live bytes
with the torch profiler's allocation events. The prediction is for the worst rank, so it is
compared with the largest rank's peak and resident bytes.
"""

import shutil

import pytest

from tests.real_runs import CI_RUNS, CPU_RUNS, TOLERANCE

pytestmark = pytest.mark.deepspeed

pytest.importorskip("deepspeed")
pytest.importorskip("torch")
pytest.importorskip("transformers")


# the runs CI leaves to bench/accuracy.py carry slow_matrix (scripts/test.sh deselects it)
MATRIX = [pytest.param(name, fields, id=name, marks=() if name in CI_RUNS else pytest.mark.slow_matrix)
          for name, fields in CPU_RUNS]


def test_the_ci_part_is_named_in_the_matrix_and_covers_each_axis():
    names = {name for name, _ in CPU_RUNS}
    assert CI_RUNS <= names
    chosen = [fields for name, fields in CPU_RUNS if name in CI_RUNS]
    assert {f["strategy"] for f in chosen} >= {"zero0", "zero1", "zero2", "zero3", "ddp", "fsdp"}
    for axis in ("tp", "cp", "pp", "ep"):
        assert any(f.get(axis, 1) > 1 for f in chosen), axis
    assert {f.get("finetune", "full") for f in chosen} == {"full", "lora", "qlora"}
    assert {f["precision"] for f in chosen} >= {"bf16-mixed", "fp32"}
    assert any(f.get("checkpointing") == "full" for f in chosen)
    assert any(f.get("gradient_accumulation", 1) > 1 for f in chosen)
    assert any(f["model_config"].get("vocab_size", 0) >= 32_000 for f in chosen)  # logits-dominated


@pytest.mark.parametrize("name,fields", MATRIX)
def test_prediction_within_tolerance_of_measured(name, fields, tmp_path):
    from backend.launch import run_probe
    from planner.memory.orchestrator import cpu_rank_bytes, estimate
    from planner.schema import EstimateRequest

    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not on PATH")
    request = EstimateRequest(**fields)
    predicted_peak, predicted_resident = cpu_rank_bytes(estimate(request), request.gpus)
    result = run_probe(request, out_dir=tmp_path, steps=2, warmup_steps=1, timeout_seconds=600)
    assert result.status == "ok", f"{result.message}\n{result.log_tail[-3000:]}"
    peak = max(r["peak_bytes"] for r in result.ranks)
    resident = max(r["resident_bytes"] for r in result.ranks)
    peak_error = (predicted_peak - peak) / peak
    resident_error = (predicted_resident - resident) / resident
    assert abs(peak_error) <= TOLERANCE, (
        f"{name}: peak predicted {predicted_peak:,} vs measured {peak:,}: {peak_error:+.1%}")
    assert abs(resident_error) <= TOLERANCE, (
        f"{name}: resident predicted {predicted_resident:,} vs measured {resident:,}: {resident_error:+.1%}")
