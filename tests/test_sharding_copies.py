"""FSDP2's copies on the compute stream (planner/frameworks/torch/v2.py compute_stream_copies): the
all-gather copy-out and the reduce-scatter copy-in, timed at the memory bandwidth; none for FSDP1
(fsdp_version 1) or DeepSpeed (its side streams); DDP's bucket copies once per step. And fsdp_version's
refusals."""

from __future__ import annotations

import pytest

from planner.cluster.gpus import load_gpus
from planner.errors import PlannerError
from planner.schema import EstimateRequest
from planner.time import kernels
from planner.time.step import estimate_with_time

BASE = dict(model="llama-3-8b", gpus=8, gpu="h100-80gb", micro_batch=1, seq_len=4096, checkpointing="full")


def _copies(**fields) -> float:
    result = estimate_with_time(EstimateRequest(**(BASE | fields)))
    return sum(t.seconds for t in result.time.terms if t.name == "sharding copies")


def _seconds(byte_count: float) -> float:
    return byte_count / kernels.rates(load_gpus()["h100-80gb"], "bf16").memory_bytes_per_s


def test_fsdp2_copies_each_gather_out_and_each_gradient_in_per_micro_batch():
    psi = estimate_with_time(EstimateRequest(**BASE, strategy="fsdp")).parameters
    # bf16-mixed: 2-byte gathers read and written (forward and backward), 2-byte gradients read and written
    # again in the compute dtype (reduce_dtype compute); per micro-batch
    assert _copies(strategy="fsdp") == pytest.approx(_seconds(psi * (2 * 2 * 2 + 2 + 2)))
    assert _copies(strategy="fsdp", gradient_accumulation=3) == pytest.approx(3 * _copies(strategy="fsdp"))
    # reduce_dtype fp32: the copy-in writes 4 bytes per element
    assert _copies(strategy="fsdp", reduce_dtype="fp32") == pytest.approx(_seconds(psi * (2 * 2 * 2 + 2 + 4)))
    # SHARD_GRAD_OP keeps the unit gathered from forward to backward: one copy-out
    assert _copies(strategy="fsdp-grad-op") == pytest.approx(_seconds(psi * (2 * 2 + 2 + 2)))
    assert _copies(strategy="hsdp", nodes=2) == pytest.approx(_copies(strategy="fsdp", nodes=2))


def test_ddp_copies_each_gradient_into_its_bucket_and_back_once_per_step():
    psi = estimate_with_time(EstimateRequest(**BASE, strategy="ddp")).parameters
    # autocast over fp32 weights: 4-byte gradients, into the bucket (read, write) and back (read, write)
    assert _copies(strategy="ddp") == pytest.approx(_seconds(psi * 4 * 4))
    assert _copies(strategy="ddp", gradient_accumulation=4) == pytest.approx(_copies(strategy="ddp"))  # no_sync
    assert _copies(strategy="single", gpus=1) == 0.0  # no data-parallel wrapper


def test_zero12_copy_each_gradient_into_the_bucket_zero3_and_fsdp1_on_their_own_streams():
    psi = estimate_with_time(EstimateRequest(**BASE, strategy="zero2")).parameters
    # contiguous_gradients: the bf16 gradient read and written into the bucket; stage 2 at every micro-step,
    # stage 1 at the step's boundary
    assert _copies(strategy="zero2") == pytest.approx(_seconds(psi * 2 * 2))
    assert _copies(strategy="zero2", gradient_accumulation=3) == pytest.approx(3 * _copies(strategy="zero2"))
    assert _copies(strategy="zero1", gradient_accumulation=3) == pytest.approx(_copies(strategy="zero1"))
    off = {"zero_optimization": {"stage": 2, "contiguous_gradients": False}, "train_micro_batch_size_per_gpu": 1,
           "gradient_accumulation_steps": 1, "bf16": {"enabled": True}}
    assert _copies(ds_config=off) == 0.0
    assert _copies(strategy="fsdp", fsdp_version=1) == 0.0
    assert _copies(strategy="zero3") == 0.0


def test_a_pipeline_copies_each_unit_once_per_step():
    # one copy-out and one copy-in of the stage's parameters per step, whatever the micro-batches (the
    # pipeline's terms are the stage's, scaled with its schedule: within a few percent)
    psi = estimate_with_time(EstimateRequest(**BASE, strategy="fsdp")).parameters
    one = _copies(strategy="fsdp", pp=2, gradient_accumulation=8)
    assert one == pytest.approx(_copies(strategy="fsdp", pp=2, gradient_accumulation=16), rel=0.1)
    assert _seconds(psi / 2 * (2 * 2 + 2 + 2)) < one < _seconds(psi * (2 * 2 + 2 + 2))  # the stage's share
    assert one < _copies(strategy="fsdp", gradient_accumulation=8) / 8  # not per micro-batch


def test_an_fsdp1_jobs_suggested_zero_layouts_are_estimated():
    from planner.check import _apply

    request = EstimateRequest(**BASE, strategy="fsdp", fsdp_version=1)
    assert _apply(request, {"strategy": "zero3"}).fsdp_version == 2
    assert _apply(request, {"strategy": "fsdp", "tp": 2}).fsdp_version == 2
    assert _apply(request, {"checkpointing": "none"}).fsdp_version == 1
    two = estimate_with_time(EstimateRequest(**BASE, strategy="fsdp"))
    one = estimate_with_time(EstimateRequest(**BASE, strategy="fsdp", fsdp_version=1))
    assert one.time.step_seconds < two.time.step_seconds and one.per_device == two.per_device
    assert any(n.startswith("fsdp_version 1 (torch FSDP1)") for n in one.notes)
    assert not any("fsdp_version 1" in n for n in two.notes)


def test_a_lora_step_copies_in_only_the_adapters_gradients():
    full = estimate_with_time(EstimateRequest(**BASE, strategy="fsdp"))
    lora = estimate_with_time(EstimateRequest(**BASE, strategy="fsdp", finetune="lora"))
    copies = sum(t.seconds for t in lora.time.terms if t.name == "sharding copies")
    # the frozen base is gathered (2 copy-outs of its bytes), only the adapters make gradients
    assert _seconds(lora.parameters * 2 * 2 * 2) < copies < _seconds(full.parameters * (2 * 2 * 2 + 0.1))


@pytest.mark.parametrize("fields,message", [
    (dict(strategy="zero3"), "applies to fsdp, fsdp-grad-op, hsdp, not strategy zero3"),
    (dict(strategy="ddp"), "not strategy ddp"),
    (dict(strategy="fsdp", tp=2), "fsdp_version=1 with tp=2"),
    (dict(strategy="fsdp", float8_all_gather=True, low_precision="float8-tensorwise"), "float8_all_gather"),
    (dict(strategy="fsdp", optimizer="muon"), "optimizer muon"),
    (dict(strategy="fsdp", fsdp_version=True), "must be 1 or 2, got True"),
])
def test_fsdp_version_1_is_refused_where_fsdp1_does_not_run(fields, message):
    with pytest.raises(ValueError, match=message):
        EstimateRequest(**(BASE | {"fsdp_version": 1} | fields))


def test_fsdp1_is_neither_emitted_nor_verified_as_fsdp2():
    from backend.launch import worker_job
    from planner.plan.emit import emit_estimate_files

    result = estimate_with_time(EstimateRequest(**BASE, strategy="fsdp", fsdp_version=1))
    with pytest.raises(PlannerError, match="--emit with fsdp_version=1"):
        emit_estimate_files(result)
    cpu = EstimateRequest(model="gpt2", strategy="fsdp", gpus=2, gpu="cpu", micro_batch=1, seq_len=64,
                          device_memory_gib=8, fsdp_version=1)
    with pytest.raises(PlannerError, match="the probe trains FSDP2"):
        worker_job(cpu, steps=1, warmup_steps=0, out_dir=__import__("pathlib").Path("/tmp"))


def test_gpu_check_times_fsdp2s_copies_with_the_ops_fsdp2_calls():
    """bench/gpu_check.py fsdp2_copies times FSDP2's own ops on a GPU; here the same calls run on CPU
    tensors and move what the model counts: the split copy fills every parameter from its rank-major
    slices, the chunk-cat writes every gradient element once in the reduce dtype."""
    import inspect

    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401

    from bench import gpu_check

    assert "split_with_sizes_copy" in inspect.getsource(gpu_check.fsdp2_copies)
    world, shard = 4, [3, 2]
    gathered = torch.arange(world * sum(shard), dtype=torch.bfloat16)
    params = [torch.empty(world * k, dtype=torch.bfloat16) for k in shard]
    torch.ops.fsdp.split_with_sizes_copy(gathered.view(world, -1), shard, dim=1, out=[p.view(world, -1) for p in params])
    assert params[1].tolist() == [3, 4, 8, 9, 13, 14, 18, 19]
    grads = [torch.arange(world * k, dtype=torch.bfloat16) for k in shard]
    flat = torch.empty(world * sum(shard), dtype=torch.float32)
    torch.ops.fsdp.chunk_cat(grads, 0, world, out=flat.view(world, -1))
    assert flat.view(world, -1)[1].tolist() == [3, 4, 5, 2, 3]
