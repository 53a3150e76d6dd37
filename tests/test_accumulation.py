"""Gradient accumulation (gradient_accumulation > 1): a micro-batch after the first runs beside the
gradients the earlier ones left. FSDP2 reduce-scatters every micro-batch and adds the output into
its sharded gradients (torch 2.13 _fsdp_collectives.py foreach_reduce); DDP keeps every param.grad
under no_sync(); ZeRO-2 keeps the earlier micro-batches' grads_in_partition beside the next one.
Each was under-predicted by 7-15% before (bench/results/runs/*-ga2-*.json)."""

import json
from pathlib import Path

import pytest

from planner.memory.orchestrator import cpu_rank_bytes, estimate
from planner.memory.moments import PhaseKind
from planner.schema import EstimateRequest
from tests.real_runs import LLAMA

RECORDS = Path(__file__).resolve().parent.parent / "bench" / "results" / "runs"
BASE = dict(model_config=LLAMA, gpu="cpu", gpus=2, micro_batch=1, seq_len=128)


def _phase(result, kind):
    return next(p for p in result.phases if p.kind == kind)


def _named(phase, start):
    return sum(i.bytes for i in phase.items if i.name.startswith(start))


@pytest.mark.parametrize("name", ["llama-fsdp-fp32-ga2-t128", "llama-fsdp-bf16-ga2-t128",
                                  "llama-fsdp-bf16-reduce32-ga2-t128", "llama-ddp-fp32-ga2-t128",
                                  "llama-zero2-fp32-small-ga2-t128", "llama-zero1-fp32-small-ga2-t128"])
def test_accumulating_runs_are_predicted_to_their_measured_peak(name):
    # were -13.4%, -15.4%, -6.65%, -7.56%, -8.10% and -7.34% (the sharded / full / partition
    # gradients of the earlier micro-batch missing); CPU ranks, each record one measured run
    record = json.loads((RECORDS / f"{name}.json").read_text())
    request = EstimateRequest(**record["fields"])
    peak, resident = cpu_rank_bytes(estimate(request), request.gpus)
    assert abs(peak - record["measured_peak"]) / record["measured_peak"] < 0.015
    assert resident == pytest.approx(record["measured_resident"], rel=1e-4)


def test_fsdp_later_micro_batch_holds_every_sharded_gradient_from_the_start_of_backward():
    one = estimate(EstimateRequest(**BASE, strategy="fsdp", precision="fp32"))
    two = estimate(EstimateRequest(**BASE, strategy="fsdp", precision="fp32", gradient_accumulation=2))
    sharded = 4 * -(-one.parameters // 2)  # fp32, each rank's half
    start = _phase(two, PhaseKind.START_OF_BACKWARD)
    assert _named(start, "sharded gradients (the earlier") == sharded
    assert _named(_phase(one, PhaseKind.START_OF_BACKWARD), "sharded gradients") == 0
    for p in two.phases:
        if p.kind not in (PhaseKind.RESIDENT, PhaseKind.OPTIMIZER_STEP):
            assert sum(i.bytes for i in p.items if "sharded gradients" in i.name) >= sharded, p.name
    # the optimizer step and what stays between steps do not change
    assert _phase(two, PhaseKind.OPTIMIZER_STEP).bytes == _phase(one, PhaseKind.OPTIMIZER_STEP).bytes
    assert two.per_device.resident_bytes == one.per_device.resident_bytes


def test_fsdp_accumulate_adds_the_reduce_output_and_its_cast_as_a_transient():
    # bf16-mixed: the block's reduce-scatter output in bf16, cast to fp32 (_to_dtype_if_needed),
    # then added in place into the fp32 sharded gradient
    two = estimate(EstimateRequest(**BASE, strategy="fsdp", precision="bf16-mixed", gradient_accumulation=2))
    end = _phase(two, PhaseKind.END_OF_BLOCK)
    block_shard = _named(end, "reduce-scatter output being added") // (2 + 4)
    assert block_shard > 0 and _named(end, "reduce-scatter output being added") == 6 * block_shard
    fp32 = estimate(EstimateRequest(**BASE, strategy="fsdp", precision="bf16-mixed", gradient_accumulation=2,
                                    reduce_dtype="fp32"))
    # reduced in fp32, the parameters' dtype: no cast, the fp32 output alone
    assert _named(_phase(fp32, PhaseKind.END_OF_BLOCK), "reduce-scatter output being added") == 4 * block_shard


def test_ddp_no_sync_keeps_every_gradient_through_the_next_micro_batch():
    one = estimate(EstimateRequest(**BASE, strategy="ddp", precision="fp32"))
    two = estimate(EstimateRequest(**BASE, strategy="ddp", precision="fp32", gradient_accumulation=2))
    assert _named(_phase(two, PhaseKind.START_OF_BACKWARD), "gradients (full)") == 4 * one.parameters
    assert _named(_phase(one, PhaseKind.START_OF_BACKWARD), "gradients (full)") == 0


def test_zero2_keeps_the_earlier_grads_in_partition_beside_the_next():
    fields = dict(BASE, strategy="zero2", precision="fp32", reduce_bucket_size=2_000_000)
    one = estimate(EstimateRequest(**fields))
    two = estimate(EstimateRequest(**fields, gradient_accumulation=2))
    first = _phase(two, PhaseKind.FIRST_BUCKET_REDUCTION)
    held = _named(first, "grads_in_partition of the earlier")
    assert held == _named(first, "grads_in_partition (params") > 0
    assert first.bytes - _phase(one, PhaseKind.FIRST_BUCKET_REDUCTION).bytes == held
    # offloaded, ZeRO-2 accumulates on the host (stage_1_and_2.py copy_grads_in_partition): not this term
    off = estimate(EstimateRequest(**fields, gradient_accumulation=2, offload_optimizer="cpu"))
    assert all(_named(p, "grads_in_partition of the earlier") == 0 for p in off.phases)


def test_zero1_keeps_every_gradient_and_the_bucket_until_the_boundary():
    fields = dict(BASE, strategy="zero1", precision="fp32", reduce_bucket_size=2_000_000)
    one = estimate(EstimateRequest(**fields))
    two = estimate(EstimateRequest(**fields, gradient_accumulation=2))
    start_one, start_two = _phase(one, PhaseKind.START_OF_BACKWARD), _phase(two, PhaseKind.START_OF_BACKWARD)
    # every fp32 gradient and the 2e6-element fp32 bucket: measured 28.0 MB higher (peak trace)
    assert start_two.bytes - start_one.bytes == 4 * one.parameters + 4 * 2_000_000
    assert _phase(two, PhaseKind.OPTIMIZER_STEP).bytes == _phase(one, PhaseKind.OPTIMIZER_STEP).bytes


def test_plan_candidates_are_estimated_with_their_accumulation():
    # the plan's memory grid and its candidates' estimates take the accumulating micro-batches'
    # phases (the browser's bars, which re-estimate a candidate, agree with the table)
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    req = PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, topology="hgx-h100", seq_len=4096,
                      global_batch=256)
    r = plan(req)
    c = next(c for c in r.candidates if c.strategy == "fsdp" and c.parallel.tp == 1 and c.gradient_accumulation > 1)
    fields = dict(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", topology="hgx-h100", seq_len=4096,
                  precision=req.precision, optimizer=req.optimizer, micro_batch=c.micro_batch,
                  checkpointing=c.checkpointing, offload_optimizer=c.offload_optimizer,
                  offload_params=c.offload_params)
    accumulating = estimate(EstimateRequest(**fields, gradient_accumulation=c.gradient_accumulation))
    single = estimate(EstimateRequest(**fields))
    assert c.per_device.peak_bytes == accumulating.per_device.peak_bytes > single.per_device.peak_bytes


def test_plan_candidates_are_requests_an_estimate_takes_at_any_batch():
    """A rank's share of a huge global batch allows micro-batch options whose accumulation (or
    micro-batch) an estimate request cannot state; the plan leaves those out, so every candidate
    is an estimate request (emit and verify take it as one), and the plan answers."""
    from planner.plan.emit import estimate_request_for
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    req = PlanRequest(model="llama-3.2-1b", gpu="h100-80gb", gpus=1, global_batch=1 << 20, seq_len=4096)
    r = plan(req)
    assert r.candidates
    for c in r.candidates:
        assert c.gradient_accumulation <= 1 << 16 and c.micro_batch * c.gradient_accumulation == 1 << 20
        estimate_request_for(req, c)


@pytest.mark.parametrize("fields", [
    dict(strategy="fsdp"), dict(strategy="ddp"), dict(strategy="zero1"), dict(strategy="zero2"),
    dict(strategy="zero3"), dict(strategy="hsdp", hsdp_shard_size=4), dict(strategy="fsdp", tp=2), dict(strategy="fsdp", gpus=2, tp=2),
    dict(strategy="ddp", precision="fp32", gpus=2, tp=2), dict(strategy="fsdp", finetune="lora"),
])
def test_a_later_micro_batch_is_the_same_for_any_count(fields):
    """The memory of a micro-batch after the first does not depend on how many there are (its
    phases, names and bytes, equal at 2 and 7): the plan ranks a candidate of any accumulation
    with the estimate its grid made at two."""
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    kw = dict(model="llama-3.1-8b", gpu="h100-80gb", gpus=8) | fields
    two, seven = (estimate(EstimateRequest(**kw, gradient_accumulation=n)) for n in (2, 7))
    assert [(p.name, p.bytes) for p in two.phases] == [(p.name, p.bytes) for p in seven.phases]
    assert two.per_device == seven.per_device
