"""FSDP2's reduce dtype (the request's reduce_dtype: torchtitan reduces gradients in fp32) and what
it holds: under PP the stage's unsharded gradients accumulate in it for the whole schedule; at the
end of backward the root unit's reduce-scatter input is in it. The backend's MixedPrecisionPolicy
follows the request, and the published torchtitan rows are estimated with it."""

import subprocess
import sys

import pytest
from pydantic import ValidationError

from planner.memory.orchestrator import estimate
from planner.schema import EstimateRequest
from tests.real_runs import LLAMA

PP_FSDP = dict(model_config=LLAMA, strategy="fsdp", precision="bf16-mixed", gpu="cpu", gpus=4, micro_batch=2,
               seq_len=128, pp=2, gradient_accumulation=4)


def _items(result, kind_name):
    phase = next(p for p in result.phases if p.name.startswith(kind_name))
    return {i.name: i.bytes for i in phase.items}


def test_pp_fsdp_accumulates_unsharded_gradients_in_the_reduce_dtype():
    compute = estimate(EstimateRequest(**PP_FSDP))
    fp32 = estimate(EstimateRequest(**PP_FSDP, reduce_dtype="fp32"))
    items = _items(fp32, "loss backward")
    # the stage's parameters, unsharded in bf16 for the whole schedule: 2 bytes per element
    params = items["unsharded parameters of the stage (FSDP2, kept for every micro-batch)"] // 2
    grads = [b for n, b in items.items() if n.startswith("gradients of")]
    assert grads == [4 * params]  # fp32 unsharded_accumulated_grad of the whole stage
    # 16-bit gradients of the whole stage, then fp32 ones: 2 bytes more per element of the stage
    assert fp32.per_device.peak_bytes - compute.per_device.peak_bytes == 2 * params
    # measured: bench/results/runs/llama-pp2-dp2-fsdp-1f1b-bf16-reduce32-m4.json
    assert abs(fp32.per_device.peak_bytes - 51_614_072) / 51_614_072 < 0.03


def test_fsdp_root_reduce_scatter_is_in_the_reduce_dtype_and_gloo_copies_it_on_cpu():
    fields = dict(model_config=LLAMA, strategy="fsdp", precision="bf16-mixed", gpus=2, micro_batch=1, seq_len=32)
    root = 2 * 4096 * 256 + 256  # embeddings, LM head, final norm
    cpu = _items(estimate(EstimateRequest(**fields, gpu="cpu", reduce_dtype="fp32")), "end of backward")
    assert cpu["reduce-scatter input of the root (fp32)"] == 4 * root
    assert cpu["gloo's copy of the reduce-scatter input"] == 4 * root
    assert cpu["reduce-scatter output (the root's shard, reduce dtype)"] == 4 * root // 2
    gpu = _items(estimate(EstimateRequest(**fields, gpu="h100-80gb", reduce_dtype="fp32")), "end of backward")
    assert not any("gloo" in name for name in gpu)
    bf16 = _items(estimate(EstimateRequest(**fields, gpu="cpu")), "end of backward")
    assert bf16["reduce-scatter input of the root"] == 2 * root


@pytest.mark.parametrize("strategy", ["zero2", "ddp"])
def test_reduce_dtype_is_refused_where_fsdp2_does_not_reduce(strategy):
    with pytest.raises(ValidationError, match=r"reduce_dtype=fp32 .* fsdp, fsdp-grad-op, hsdp, not strategy"):
        EstimateRequest(model="llama-3-8b", strategy=strategy, reduce_dtype="fp32")


def test_cli_reduce_dtype_flag():
    base = [sys.executable, "-m", "cli.main", "estimate", "--model", "llama-3-8b", "--json"]
    bad = subprocess.run(base + ["--strategy", "zero3", "--reduce-dtype", "fp32"], capture_output=True, text=True)
    assert bad.returncode == 2 and "reduce_dtype" in bad.stderr and "Traceback" not in bad.stderr
    ok = subprocess.run(base + ["--strategy", "fsdp", "--reduce-dtype", "fp32"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert '"reduce_dtype": "fp32"' in ok.stdout


def test_worker_job_carries_the_reduce_dtype(tmp_path):
    from backend.launch import worker_job

    job = worker_job(EstimateRequest(**PP_FSDP, reduce_dtype="fp32"), steps=1, warmup_steps=0, out_dir=tmp_path)
    assert job.pipeline.reduce_dtype == "fp32"
    flat = dict(model_config=LLAMA, strategy="fsdp", precision="bf16-mixed", gpu="cpu", gpus=2)
    job = worker_job(EstimateRequest(**flat, reduce_dtype="fp32"), steps=1, warmup_steps=0, out_dir=tmp_path)
    assert job.torch.reduce_dtype == "fp32"
    job = worker_job(EstimateRequest(**flat), steps=1, warmup_steps=0, out_dir=tmp_path)
    assert job.torch.reduce_dtype == "compute"


def test_backend_policy_follows_the_request():
    torch = pytest.importorskip("torch")
    from backend.train import mixed_precision_policy

    policy = mixed_precision_policy(torch.bfloat16, {"reduce_dtype": "fp32"})
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    policy = mixed_precision_policy(torch.bfloat16, {"reduce_dtype": "compute"})
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert mixed_precision_policy(None, {"reduce_dtype": "compute"}).reduce_dtype is None


def test_published_torchtitan_rows_reduce_in_fp32_with_torchtitans_micro_batches():
    from bench import published_parallel

    assert all(run.fields["reduce_dtype"] == "fp32" for run in published_parallel.RUNS)
    table5 = [r for r in published_parallel.RUNS if r.table == "Table 5"]
    # 9dec370 pipelining_utils.py: pipeline_parallel_microbatches defaults to the pp degree
    assert all((r.fields["micro_batch"], r.fields["gradient_accumulation"]) == (4, 8) for r in table5)
    one_f_one_b = published_parallel.predict(table5[0])
    assert one_f_one_b["peak_gib"] > 0.8 * table5[0].memory_gib  # was 41.5 of 82.5 GiB before the fp32 gradients
    eight_b = next(r for r in published_parallel.RUNS if r.name.startswith("8B FSDP 8"))
    why = published_parallel.logits_reserve(eight_b, 70.0, 128_256)
    assert "7.8 GiB segment of the bf16 logits" in why and "77.8 GiB with the model's peak" in why


def test_plan_candidates_reduce_in_the_requested_dtype():
    """plan --reduce-dtype fp32: each FSDP2 candidate is the estimate of its configuration with
    reduce_dtype fp32 (a pipeline's accumulated gradients at 4 bytes), the others unchanged."""
    from planner.plan.emit import estimate_request_for
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    # 8k tokens: FSDP's pipeline candidates rank among those shown (at 4k ZeRO-1's all-reduce costs the
    # compute less than FSDP's gathers do, and ZeRO/DDP fill the list)
    fields = dict(model="llama-3.1-8b", gpu="h100-80gb", gpus=8, nodes=2, seq_len=8192, global_batch=64, pp=2)
    fp32 = plan(PlanRequest(**fields, reduce_dtype="fp32"))
    moved = 0
    for c in fp32.candidates:
        request = estimate_request_for(PlanRequest(**fields, reduce_dtype="fp32"), c)
        sharding = c.strategy in ("fsdp", "fsdp-grad-op", "hsdp")
        assert request.reduce_dtype == ("fp32" if sharding else "compute")
        assert estimate(request).per_device.peak_bytes == c.per_device.peak_bytes
        # the same configuration reducing in the compute dtype: a pipeline's accumulated gradients at 2 bytes
        same = estimate(request.model_copy(update={"reduce_dtype": "compute"})).per_device.peak_bytes
        if sharding and c.parallel.pp > 1 and c.per_device.peak_bytes > same:
            moved += 1
    assert moved


def test_torchtitan_emit_reduces_in_fp32_and_says_what_that_costs(tmp_path):
    """torchtitan takes mixed_precision_reduce = "float32" only: the emitted TOML says so, and
    LAUNCH.md gives the torchtitan job's own peak (the estimate with reduce_dtype fp32) when the
    estimate reduced in the compute dtype; nothing is added when it already reduced in fp32."""
    import tomllib

    from planner.plan.emit import emit_estimate_files
    from planner.plan.search import estimate_with_time

    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpu="h100-80gb", gpus=8, tp=2, pp=2, gradient_accumulation=4)
    files = emit_estimate_files(estimate_with_time(EstimateRequest(**fields)))
    assert tomllib.loads(files["torchtitan.toml"])["training"]["mixed_precision_reduce"] == "float32"
    titan = estimate(EstimateRequest(**fields, reduce_dtype="fp32")).per_device.peak_bytes
    assert f"the torchtitan job's peak is {titan / 2**30:.2f} GiB" in files["LAUNCH.md"]
    again = emit_estimate_files(estimate_with_time(EstimateRequest(**fields, reduce_dtype="fp32")))
    assert "torchtitan job's peak" not in again["LAUNCH.md"]


def test_fp32_reduce_scatter_moves_four_bytes_per_gradient():
    """FSDP2 casts a unit's gradients to the reduce dtype before its reduce-scatter: in fp32 the
    time model sends twice the bf16 bytes (and the same all-gathers); the step is no faster."""
    from planner.plan.search import estimate_with_time
    from planner.time.step import collective_volumes

    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpu="h100-80gb", gpus=8, nodes=2)
    rows = {r: {v["what"]: v for v in collective_volumes(EstimateRequest(**fields, reduce_dtype=r))}
            for r in ("compute", "fp32")}
    assert rows["fp32"]["gradient reduce-scatter"]["bytes_per_step"] == \
        2 * rows["compute"]["gradient reduce-scatter"]["bytes_per_step"]
    assert rows["fp32"]["parameter all-gathers"] == rows["compute"]["parameter all-gathers"]
    slow, fast = (estimate_with_time(EstimateRequest(**fields, reduce_dtype=r)).time for r in ("fp32", "compute"))
    assert slow.communication_seconds > fast.communication_seconds
