"""composer's train metrics (planner/recipes/loop.py): two cross-entropies over each micro-batch's kept logits
after its backward, their memory (one metric's temporaries beside the logits and the states after backward) and
their time (each a cross-entropy forward at the copy rate). The real runs (tests/real_runs.py) measure the memory
on CPU ranks; these pin the mechanism and the refusals."""

import pytest
from pydantic import ValidationError

from planner.errors import PlannerError
from planner.memory.moments import PhaseKind
from planner.memory.orchestrator import estimate
from planner.schema import EstimateRequest
from planner.time import kernels
from planner.time.step import TRAIN_METRICS_TERM, estimate_with_time
from tests.real_runs import BENCH_RUNS, CI_RUNS, CPU_RUNS, LLAMA_32K

BASE = dict(model_config=LLAMA_32K, gpus=2, gpu="cpu", micro_batch=2, seq_len=512, keeps_outputs=True)
LOGITS = 2 * 512 * 32_000


def _metric_phase(result):
    phases = [p for p in result.phases if p.kind is PhaseKind.TRAIN_METRICS]
    assert len(phases) == 1
    return phases[0]


@pytest.mark.parametrize("strategy,precision,transient_per_logit", [
    ("ddp", "bf16-mixed", 4 + 4),  # autocast: the fp32 copy of the bf16 logits and the fp32 log-softmax
    ("fsdp", "bf16-mixed", 4 + 4),  # FSDP2's bf16 logits, the loop's autocast all the same
    ("ddp", "fp32", 4),  # fp32 logits: the log-softmax only, no copy
    ("zero2", "bf16-mixed", 2),  # DeepSpeed: composer enters no autocast, the log-softmax in bf16
    ("ddp", "bf16-pure", 2),  # a cast model: no autocast
])
def test_one_metrics_temporaries_sit_beside_the_logits_after_backward(strategy, precision, transient_per_logit):
    result = estimate(EstimateRequest(**BASE, strategy=strategy, precision=precision, train_metrics=2))
    metric = _metric_phase(result)
    transient = sum(i.bytes for i in metric.items if i.name.startswith("train metrics"))
    assert transient == transient_per_logit * LOGITS
    held = [i for i in metric.items if "keeps_outputs" in i.name]
    assert len(held) == 1  # the kept logits themselves, once
    kinds = [p.kind for p in result.phases]
    at = kinds.index(PhaseKind.TRAIN_METRICS)
    assert PhaseKind.END_OF_BACKWARD in kinds[:at] and kinds[at + 1:] == [PhaseKind.OPTIMIZER_STEP]
    # two metrics hold what one does: they run one after the other
    one = _metric_phase(estimate(EstimateRequest(**BASE, strategy=strategy, precision=precision, train_metrics=1)))
    assert one.bytes == metric.bytes


def test_the_metrics_phase_keeps_the_states_and_lets_the_backwards_passing_buffers_go():
    result = estimate(EstimateRequest(**BASE, strategy="fsdp", precision="bf16-mixed", train_metrics=2))
    metric = _metric_phase(result)
    end = max((p for p in result.phases if p.kind is PhaseKind.END_OF_BACKWARD), key=lambda p: p.bytes)
    resident = {(i.name, i.component) for i in result.phases[0].items}
    dropped = [i for i in end.items if i not in metric.items]
    assert dropped and all(i.component == "buffers" and (i.name, i.component) not in resident for i in dropped)
    for component in ("parameters", "gradients", "optimizer_states"):
        assert sum(i.bytes for i in metric.items if i.component == component) == \
            sum(i.bytes for i in end.items if i.component == component)


def test_where_the_metrics_are_the_peak_they_raise_it_and_nothing_else_moves():
    fields = dict(BASE, model_config=dict(LLAMA_32K, hidden_size=512, intermediate_size=1376), strategy="ddp",
                  precision="bf16-mixed", checkpointing="full", micro_batch=1, seq_len=768)
    without = estimate(EstimateRequest(**fields))
    with_metrics = estimate(EstimateRequest(**fields, train_metrics=2))
    assert with_metrics.per_device.peak_phase.startswith("train metrics")
    assert with_metrics.per_device.peak_bytes > without.per_device.peak_bytes
    assert with_metrics.per_device.resident_bytes == without.per_device.resident_bytes
    assert any("train metric" in n for n in with_metrics.notes)


@pytest.mark.parametrize("fields,words", [
    (dict(keeps_outputs=False), "set keeps_outputs"),
    (dict(loss="liger-fused", gpu="h100-80gb"), "returns no logits"),
    (dict(loss="chunked-in-forward", strategy="fsdp"), "returns no logits"),
    (dict(loss="chunked"), "list of chunks"),
])
def test_metrics_without_logits_to_read_are_refused(fields, words):
    with pytest.raises(ValidationError) as err:
        EstimateRequest(**(BASE | dict(strategy="ddp") | fields), train_metrics=2)
    assert "train_metrics=2" in str(err.value) and words in str(err.value)


def test_metrics_are_refused_where_the_step_keeps_no_outputs():
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**(BASE | dict(gpus=4)), strategy="fsdp", tp=2, train_metrics=2))
    assert err.value.field == "keeps_outputs"


def _timed(train_metrics: int, strategy: str = "fsdp", precision: str = "bf16-mixed", accumulation: int = 1):
    request = EstimateRequest(**(BASE | dict(gpu="a100-80gb", gpus=8)), strategy=strategy, precision=precision,
                              gradient_accumulation=accumulation, train_metrics=train_metrics)
    return estimate_with_time(request).time


@pytest.mark.parametrize("strategy,precision,per_logit", [
    ("fsdp", "bf16-mixed", 2 + 4 + kernels.CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_LOGIT),
    ("ddp", "fp32", kernels.CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_LOGIT),
    ("zero2", "bf16-mixed", kernels.CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_LOGIT / 2),
])
def test_each_metric_is_a_cross_entropy_forward_at_the_copy_rate(strategy, precision, per_logit):
    from planner.cluster.gpus import load_gpus

    bandwidth = kernels.rates(load_gpus()["a100-80gb"], "bf16").memory_bytes_per_s
    for accumulation in (1, 3):
        base, timed = _timed(0, strategy, precision, accumulation), _timed(2, strategy, precision, accumulation)
        term = {t.name: t.seconds for t in timed.terms}[TRAIN_METRICS_TERM]
        assert term == pytest.approx(accumulation * 2 * LOGITS * per_logit / bandwidth)
        assert TRAIN_METRICS_TERM not in {t.name for t in base.terms}
        # memory-bound work after backward: added to the step, the clock-bound terms untouched
        assert timed.step_seconds == pytest.approx(base.step_seconds + term, rel=1e-9)
        assert {t.name: t.seconds for t in timed.terms}["slowest GPU"] == \
            pytest.approx({t.name: t.seconds for t in base.terms}["slowest GPU"])


def test_the_measured_cross_entropy_rate_reads_back_from_its_benchmark():
    # Liger's benchmark: 20.73 ms forward over 16,384 x 131,072 fp32 logits at 0.83 x 2,039 GB/s
    assert kernels.CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_LOGIT * 16384 * 131072 / (0.83 * 2039e9) == \
        pytest.approx(20.73e-3)


def test_train_metrics_have_real_runs_where_they_are_the_peak_and_one_runs_in_ci():
    runs = {name: f for name, f in CPU_RUNS + BENCH_RUNS if f.get("train_metrics")}
    assert {f["strategy"] for f in runs.values()} >= {"ddp", "single", "fsdp", "zero2"}
    peaks = {name for name, f in runs.items()
             if estimate(EstimateRequest(**f)).per_device.peak_phase.startswith("train metrics")}
    assert {runs[name]["strategy"] for name in peaks} >= {"ddp", "single"}
    assert peaks & CI_RUNS
    assert all(f["model_config"]["vocab_size"] >= 32_000 for f in runs.values())
