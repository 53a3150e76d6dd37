"""Async TP (issue 22): the sequence-parallel collectives pipelined with the matmuls beside them
(torch's micro-pipeline TP, torchtitan's compile.enable_async_tensor_parallel, Megatron's --tp-comm-overlap)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from planner.errors import PlannerError
from planner.memory.orchestrator import estimate
from planner.model.architecture import layer_specs
from planner.parallel.tensor import SP_GATHER_ROW, SP_SCATTER_ROW
from planner.schema import EstimateRequest, PlanRequest
from planner.time import kernels
from planner.time.step import (ASYNC_TP_TERM, StepSettings, _async_tp_seconds, _async_tp_windows, estimate_with_time,
                               resolved_combo)
from planner.cluster.gpus import gpu as lookup_gpu

BASE = dict(model="llama-3.1-70b", strategy="fsdp", gpus=8, nodes=4, gpu="h100-80gb", tp=8, seq_len=8192,
            micro_batch=2, checkpointing="full")


def _time(**fields):
    return estimate_with_time(EstimateRequest(**(BASE | fields))).time


def _term(t, name):
    return next(x.seconds for x in t.terms if x.name == name)


def test_async_tp_hides_the_sequence_parallel_collectives_behind_their_matmuls():
    plain, pipelined = _time(), _time(async_tp=True)
    # 70B at tp 8: the MLP's matmuls are longer than their collectives, the attention's projections shorter
    assert pipelined.exposed_communication_seconds < 0.3 * plain.exposed_communication_seconds
    assert pipelined.exposed_communication_seconds > 0.0
    assert pipelined.step_seconds < plain.step_seconds
    # its own kernels (shard copies, partial-output sums) run on the compute stream
    assert _term(pipelined, ASYNC_TP_TERM) > 0.0
    # and its hidden transfers slow the matmuls beside them as hidden collectives do (contention_seconds)
    contention = _term(pipelined, "communication contention") - _term(plain, "communication contention")
    assert contention > 0.0
    assert pipelined.compute_seconds == pytest.approx(plain.compute_seconds + _term(pipelined, ASYNC_TP_TERM)
                                                      + contention, rel=1e-9)
    assert ASYNC_TP_TERM not in {x.name for x in plain.terms}


def _row_parts(request: EstimateRequest, c: float):
    """(_async_tp_seconds' exposed seconds, the row's seconds, what the windows hide) for one row whose
    messages each take c seconds."""
    result = estimate(request)
    combo, _, setup = resolved_combo(request)
    arch = setup.arch
    g = lookup_gpu(request.gpu)
    dtype = setup.recipe.peak_dtype(g.peak_tflops)
    settings = StepSettings(precision=request.precision, recipe=setup.recipe, seq_len=request.seq_len,
                            nodes=request.nodes, compute_efficiency=None, link_efficiency=1.0, async_tp=True)
    micro, per_rank = request.micro_batch, request.micro_batch * request.gradient_accumulation
    per_block = 6 if request.checkpointing == "full" else 4
    messages = (arch.num_layers * per_block + 2) * per_rank // micro
    message_bytes = micro * request.seq_len * arch.hidden_size * 2
    shown, _ = _async_tp_seconds(combo, _async_tp_windows(settings, combo, arch, g, dtype, micro), micro, per_rank,
                                 c * messages, messages, message_bytes, SP_GATHER_ROW)
    windows = kernels.tp_overlap_windows(arch, request.seq_len, request.tp, 1, micro,
                                         kernels.rates(g, dtype), setup.recipe.compute_bytes)
    hidden = (per_rank // micro) * per_block / 4 * (request.tp - 1) / request.tp * sum(
        count * sum(ts) for count, ts in windows)
    assert result.parameters > 0
    return shown, c * messages, hidden, windows


def test_a_slow_collective_shows_what_its_matmul_cannot_hide():
    """c above every window: each block's collective shows c less (tp-1)/tp of its matmul, the embedding's and
    head's whole; c zero: nothing shows."""
    request = EstimateRequest(**(BASE | {"async_tp": True, "gradient_accumulation": 3}))
    shown, seconds, hidden, windows = _row_parts(request, 1.0)
    assert all(0.0 < t < 1.0 for _, ts in windows for t in ts)
    assert shown == pytest.approx(seconds - hidden, rel=1e-9)
    shown, seconds, hidden, _ = _row_parts(request, 0.0)
    assert shown == 0.0


def test_a_mixture_of_experts_mlp_has_no_matmul_to_pair_with():
    arch_request = EstimateRequest(model="qwen3-30b-a3b", strategy="fsdp", gpus=8, tp=2, seq_len=4096, gpu="h100-80gb",
                                   async_tp=True)
    _, _, setup = resolved_combo(arch_request)
    g = lookup_gpu("h100-80gb")
    windows = kernels.tp_overlap_windows(setup.arch, 4096, 2, 1, 1, kernels.rates(g, "bf16"), 2)
    assert any(spec.mlp.is_moe for spec in layer_specs(setup.arch))
    assert all(ts[2] is None and ts[3] is None and ts[0] > 0 and ts[1] > 0 for _, ts in windows)


def test_the_workspace_is_two_tp_chunks_of_a_micro_batch_activation_outside_the_allocator():
    plain = estimate(EstimateRequest(**BASE))
    pipelined = estimate(EstimateRequest(**(BASE | {"async_tp": True})))
    workspace = 2 * (2 * 8192 * 8192 * 2) // 8
    assert pipelined.per_device.nccl_bytes - plain.per_device.nccl_bytes == workspace
    assert pipelined.per_device.reserved_peak_bytes - plain.per_device.reserved_peak_bytes == workspace
    assert pipelined.per_device.peak_bytes == plain.per_device.peak_bytes  # the live tensors are the same
    assert any("symmetric-memory workspace" in n for n in pipelined.notes)


@pytest.mark.parametrize("fields,match", [
    ({"tp": 1}, r"async_tp=true with tp=1"),
    ({"tp_plan": "transformers"}, r"async_tp=true with tp_plan=transformers"),
    ({"sequence_parallel": False}, r"async_tp=true with sequence_parallel=false"),
    ({"gpus": 4, "nodes": 8}, r"async_tp=true with tp\(8\) > gpus\(4\)"),
    ({"gpu": "cpu", "device_memory_gib": 80}, r"async_tp=true with gpu cpu"),
])
def test_what_async_tp_cannot_run_is_refused_by_name(fields, match):
    with pytest.raises(ValidationError, match=match):
        EstimateRequest(**(BASE | {"async_tp": True} | fields))
    plan = dict(model="llama-3.1-70b", gpus=8, nodes=4, gpu="h100-80gb", tp=8, async_tp=True) | fields
    plan.pop("device_memory_gib", None)
    with pytest.raises(ValidationError, match=match):
        PlanRequest(**plan)


def test_deepspeed_autotp_has_no_sequence_parallelism_to_pipeline():
    with pytest.raises(PlannerError, match=r"async_tp=true with strategy zero3") as info:
        estimate(EstimateRequest(**(BASE | {"strategy": "zero3", "async_tp": True})))
    assert info.value.field == "async_tp"


def test_the_plan_pipelines_its_torch_tp_candidates_only():
    from planner.plan.search import plan

    ask = dict(model="llama-3.1-8b", gpus=8, gpu="h100-80gb", tp=4, seq_len=8192, global_batch=16)

    def key(c):
        return c.strategy, c.micro_batch, c.gradient_accumulation, c.checkpointing, c.offload_optimizer, c.offload_params

    pipelined = {key(c): c for c in plan(PlanRequest(**ask, async_tp=True)).candidates}
    plain = {key(c): c for c in plan(PlanRequest(**ask)).candidates}
    both = set(pipelined) & set(plain)
    assert both
    for k in both:  # torch's sequence-parallel TP runs it
        assert pipelined[k].exposed_communication_seconds < plain[k].exposed_communication_seconds
    # a DeepSpeed candidate (AutoTP, no sequence parallelism) is asked without it, and timed as before
    from planner.plan.settings import Setting, _degree_fields

    request = PlanRequest(**ask, async_tp=True)
    autotp = Setting(8, "zero3", "none", "none", "none", None, 4, 1, False, 1)
    assert "async_tp" not in _degree_fields(request, autotp, 1)
    torch_tp = Setting(8, "fsdp", "none", "none", "none", None, 4, 1, True, 1)
    assert _degree_fields(request, torch_tp, 1)["async_tp"] is True


def test_emit_and_verify_refuse_it(tmp_path):
    from backend.launch import worker_job
    from planner.plan.emit import emit_estimate_files

    request = EstimateRequest(**(BASE | {"async_tp": True}))
    with pytest.raises(PlannerError, match="--emit with async_tp") as info:
        emit_estimate_files(estimate_with_time(request))
    assert info.value.field == "async_tp"
    with pytest.raises(PlannerError, match="async_tp: the probe trains torch's TP eager") as info:
        worker_job(request, steps=1, warmup_steps=0, out_dir=tmp_path)
    assert info.value.field == "async_tp"


@pytest.mark.parametrize("section,key", [("parallelism", "enable_async_tensor_parallel"),
                                         ("compile", "enable_async_tensor_parallel")])
def test_a_torchtitan_job_file_sets_it_where_compile_and_tp_are_on(section, key):
    from planner.jobfiles.job import read_job

    parts = {"model": 'name = "llama3"\nflavor = "8B"\n', "parallelism": "tensor_parallel_degree = 2\n",
             "compile": "enable = true\n"}
    parts[section] += f"{key} = true\n"
    text = "".join(f"[{name}]\n{body}" for name, body in parts.items())
    job = read_job([("a.toml", text)], 8)
    assert job.fields["async_tp"] is True and job.fields["tp"] == 2
    # no TP mesh: torchtitan's _maybe_enable_async_tp does nothing, nor does the reader
    assert "async_tp" not in read_job([("a.toml", text.replace("tensor_parallel_degree = 2", "tensor_parallel_degree = 1"))],
                                      8).fields
    with pytest.raises(PlannerError, match=rf"{section}.{key}: \(true\) needs compile.enable"):
        read_job([("a.toml", text.replace("enable = true\n", "enable = false\n", 1))], 8)
