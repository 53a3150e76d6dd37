"""loss=chunked-in-forward: torchtitan 0.3.0's ChunkedLossWrapper (planner/recipes/losses.py), its memory
terms, where it is refused, its step time, and torchtitan's jobs that name it (planner/jobfiles/torchtitan_job.py)."""

from __future__ import annotations

import pytest

from planner.check import check
from planner.errors import PlannerError
from planner.jobfiles.job import read_job
from planner.memory.buffers import backward_sweep, layout
from planner.memory.moments import PhaseKind
from planner.memory.orchestrator import activations, estimate, resolve
from planner.plan.recipe import allowed_layouts
from planner.recipes.losses import in_forward_memory
from planner.schema import CheckRequest, EstimateRequest, PlanRequest
from planner.setup import numels
from planner.time.step import estimate_with_time
from tests.real_runs import CI_RUNS, CPU_RUNS, BENCH_RUNS, LLAMA_32K, LLAMA_TP_32K

LOGITS = dict(model_config=LLAMA_32K, gpus=1, gpu="cpu", micro_batch=1, seq_len=2048, strategy="single")
T, H, V = 2048, 256, 32_000


def _launch(config: str, *extra: str) -> CheckRequest:
    text = f"torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config {config} " + " ".join(extra)
    return CheckRequest(files=[{"name": "run.sh", "text": text}], nodes=8)


def test_torchtitans_chunked_loss_is_read_as_chunked_in_forward_and_its_70b_default_estimates():
    """llama3_70b as published: tp 8 and ChunkedLossWrapper (num_chunks 8), estimated, not refused."""
    result = check(_launch("llama3_70b"), estimate_with_time)
    request = result.request
    assert (request.loss, request.tp, request.loss_chunks) == ("chunked-in-forward", 8, None)
    assert result.peak_bytes > 0 and result.step_seconds > 0
    eight = check(_launch("llama3_8b"), estimate_with_time).request
    assert eight.loss == "chunked-in-forward" and eight.checkpointing == "selective-op"


def test_torchtitans_num_chunks_is_loss_chunks_and_the_wrapper_can_be_turned_off():
    job = read_job([("run.sh", "torchrun -m torchtitan.train --module llama3 --config llama3_8b "
                               "--loss.num_chunks 4")], 8)
    assert (job.fields["loss"], job.fields["loss_chunks"]) == ("chunked-in-forward", 4)
    off = read_job([("run.sh", "torchrun -m torchtitan.train --module llama3 --config llama3_8b")], 8,
                   {"loss.chunked": "false"})
    assert "loss" not in off.fields
    with pytest.raises(PlannerError, match="loss.num_chunks.*with loss.chunked"):
        read_job([("run.sh", "torchrun -m torchtitan.train --module llama3 --config llama3_8b --loss.num_chunks 4")],
                 8, {"loss.chunked": "false"})


@pytest.mark.parametrize("fields,field,words", [
    (dict(strategy="ddp", gpus=2), "loss", "strategy ddp"),
    (dict(strategy="zero2", gpus=2), "loss", "strategy zero2"),
    (dict(strategy="fsdp", gpus=4, pp=2), "loss", "pp=2"),
    (dict(strategy="fsdp", gpus=2, cp=2), "loss", "cp=2"),
    (dict(finetune="lora"), "loss", "finetune=lora"),
    (dict(seq_len=2047), "loss_chunks", "divisible"),
    (dict(loss_chunks=3), "loss_chunks", "divisible"),
])
def test_what_chunked_in_forward_is_not_modelled_with_is_refused_by_field(fields, field, words):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**LOGITS | dict(loss="chunked-in-forward") | fields))
    assert err.value.field == field and words in str(err.value)


def test_a_tp_only_rank_takes_it_under_any_torch_strategy_name():
    """With one data-parallel rank nothing wraps the TP model (no DDP reducer to see the head's early
    gradient): torchtitan's llama3_70b on one node of 8 GPUs."""
    request = EstimateRequest(**LOGITS | dict(model_config=LLAMA_TP_32K, loss="chunked-in-forward", strategy="ddp",
                                              gpus=2, tp=2))
    assert estimate(request).per_device.peak_bytes > 0


def test_nothing_logits_sized_is_saved_and_the_transient_is_one_chunks():
    """bf16 autocast on one device, 8 chunks of 256 tokens: the saved set loses the fp32 log-probabilities
    and the head's 16-bit input, gains the hidden states' fp32 gradient; the transient is one chunk's
    logits and three fp32 logits-sized tensors (12 bytes per logit) beside the hidden states, the fp32
    buffer and the slices' casts (in_forward_memory)."""
    hf = activations(resolve(EstimateRequest(**LOGITS)))
    acts = activations(resolve(EstimateRequest(**LOGITS, loss="chunked-in-forward")))
    c = T // 8
    assert hf.saved_bytes - acts.saved_bytes == 4 * T * V + 2 * T * H - 4 * T * H
    # on top of the saved set, which already counts the held gradient (4 T H) the buffer's cast will be
    assert acts.loss_transient_bytes == (4 * T * H + 4 * T * H + 2 * T * H + 2 * c * V + 12 * c * V) - 4 * T * H
    assert acts.head_gradient_in_loss and acts.loss_transient_bytes < hf.loss_transient_bytes // 4


def test_vocab_parallel_chunks_are_sixteen_bytes_per_local_logit():
    """_LossParallelCrossEntropy's backward: the saved log-probabilities, grad_input's zeros, exp() and their
    sum, on the rank's vocabulary / tp columns."""
    plain = in_forward_memory(tokens=T, micro_batch=1, chunks=8, hidden=H, vocab=V // 2, compute_bytes=4,
                              stream_bytes=4, vocab_parallel=False, head_grad_bytes=4, head_grad_fp32=False)
    split = in_forward_memory(tokens=T, micro_batch=1, chunks=8, hidden=H, vocab=V // 2, compute_bytes=4,
                              stream_bytes=4, vocab_parallel=True, head_grad_bytes=4, head_grad_fp32=False)
    assert split[1] - plain[1] == 4 * (T // 8) * (V // 2)
    two = in_forward_memory(tokens=T, micro_batch=2, chunks=8, hidden=H, vocab=V, compute_bytes=4, stream_bytes=4,
                            vocab_parallel=False, head_grad_bytes=4, head_grad_fp32=False)
    one = in_forward_memory(tokens=T, micro_batch=1, chunks=8, hidden=H, vocab=V, compute_bytes=4, stream_bytes=4,
                            vocab_parallel=False, head_grad_bytes=4, head_grad_fp32=False)
    assert two[1] - one[1] == 4 * T * H  # two sequences: the slices are copies


def test_the_heads_gradient_exists_at_the_start_of_backward():
    setup = resolve(EstimateRequest(**LOGITS, loss="chunked-in-forward"))
    start = backward_sweep(activations(setup), numels(setup), layout(setup))[0]
    assert start.kind is PhaseKind.START_OF_BACKWARD and start.grad_elements >= V * H
    hf = resolve(EstimateRequest(**LOGITS))
    assert backward_sweep(activations(hf), numels(hf), layout(hf))[0].grad_elements == 0


def test_the_heads_gemms_run_per_chunk_in_the_step_time():
    request = dict(LOGITS, gpu="h100-80gb", precision="bf16-mixed")
    whole = estimate_with_time(EstimateRequest(**request)).time
    chunked = estimate_with_time(EstimateRequest(**request, loss="chunked-in-forward")).time
    finer = estimate_with_time(EstimateRequest(**request, loss="chunked-in-forward", loss_chunks=64)).time
    # smaller GEMMs and the weight's gradient read and written per chunk: never faster than one GEMM each
    assert whole.step_seconds <= chunked.step_seconds < finer.step_seconds


def test_the_plan_searches_tp_layouts_only():
    request = PlanRequest(model="llama-3.1-8b", gpus=8, loss="chunked-in-forward")
    kept, notes = allowed_layouts(request, [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1)])
    assert kept == [(1, 1, 1, 1), (2, 1, 1, 1)] and "2 layout(s) not searched" in notes[0]


def test_its_real_runs_are_logits_dominated_and_two_run_in_ci():
    runs = {name: f for name, f in CPU_RUNS + BENCH_RUNS if f.get("loss") == "chunked-in-forward"}
    assert len(runs) >= 4 and len(set(runs) & CI_RUNS) == 2
    assert any(f.get("tp", 1) > 1 for f in runs.values()) and any(f["strategy"] == "fsdp" and f.get("tp", 1) == 1
                                                                  for f in runs.values())
    assert all(f["model_config"]["vocab_size"] >= 32_000 for f in runs.values())


def test_under_tp_each_chunk_all_reduces_its_own_tokens():
    """The same bytes as loss_parallel's three all-reduces per micro-batch, in chunks times more messages."""
    from planner.model.architecture import from_hf_config
    from planner.parallel.tensor import LOSS_PARALLEL_ROW, tp_collectives

    arch = from_hf_config(dict(LLAMA_TP_32K))
    common = dict(tokens=1024, micro_batches=1.0, b=4, tp=2, sequence_parallel=True, checkpointing="none",
                  vocab_parallel_loss=True)
    whole = {row[0]: row for row in tp_collectives(arch, **common)}[LOSS_PARALLEL_ROW]
    chunked = {row[0]: row for row in tp_collectives(arch, **common, loss_chunks=8)}[LOSS_PARALLEL_ROW]
    assert chunked[1] == whole[1] and chunked[3] * 8 == whole[3]
    notes = estimate(EstimateRequest(**LOGITS, loss="chunked-in-forward")).notes
    assert any("ChunkedLossWrapper" in n and "measured on CPU ranks" in n for n in notes)


def test_fsdp2_reducing_in_fp32_keeps_the_heads_gradient_in_fp32_across_the_chunks():
    """torchtitan's set_requires_gradient_sync(False) on the head unit: FSDP2's unsharded accumulated
    gradient in the reduce dtype (fp32) from the first chunk's post-backward to the last's reduce-scatter."""
    fsdp = dict(LOGITS, strategy="fsdp", gpus=2, precision="bf16-mixed", loss="chunked-in-forward")
    compute = activations(resolve(EstimateRequest(**fsdp)))
    fp32 = activations(resolve(EstimateRequest(**fsdp, reduce_dtype="fp32")))
    assert fp32.loss_transient_bytes - compute.loss_transient_bytes == (4 - 2) * V * H


def test_a_loop_that_keeps_its_outputs_holds_no_logits_of_it():
    plain = estimate(EstimateRequest(**LOGITS, loss="chunked-in-forward")).per_device.peak_bytes
    kept = estimate(EstimateRequest(**LOGITS, loss="chunked-in-forward", keeps_outputs=True)).per_device.peak_bytes
    assert kept == plain
