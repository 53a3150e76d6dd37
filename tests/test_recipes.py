"""The recipes as they are run (issue 21): the training loop that keeps the model's outputs
(planner/recipes/loop.py). The real runs (tests/real_runs.py, measured by bench/accuracy.py) guard the
numbers; these fast tests pin the mechanism and the refusals."""

import pytest

from backend.launch import worker_job
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate
from planner.schema import EstimateRequest
from tests.real_runs import BENCH_RUNS, CPU_RUNS, LLAMA_32K

BASE = dict(model_config=LLAMA_32K, gpus=2, gpu="cpu", micro_batch=2, seq_len=512)


@pytest.mark.parametrize("strategy,precision,held_dtype_bytes", [
    ("ddp", "bf16-mixed", 2), ("zero2", "bf16-mixed", 2), ("zero3", "fp32", 4), ("fsdp", "bf16-mixed", 2)])
def test_keeps_outputs_holds_one_logits_tensor_at_every_moment_and_between_steps(strategy, precision,
                                                                                   held_dtype_bytes):
    trainer = estimate(EstimateRequest(**BASE, strategy=strategy, precision=precision))
    kept = estimate(EstimateRequest(**BASE, strategy=strategy, precision=precision, keeps_outputs=True))
    held = held_dtype_bytes * 2 * 512 * 32_000  # the logits in the training dtype: tokens x vocab
    assert kept.per_device.peak_bytes - trainer.per_device.peak_bytes == held
    assert kept.per_device.resident_bytes - trainer.per_device.resident_bytes == held
    assert [p.bytes for p in kept.phases] == [p.bytes + held for p in trainer.phases]


def test_every_result_names_the_loop_it_assumes():
    trainer = estimate(EstimateRequest(**BASE, strategy="ddp"))
    kept = estimate(EstimateRequest(**BASE, strategy="ddp", keeps_outputs=True))
    assert any(n.startswith("training loop: the Trainer's") for n in trainer.notes)
    assert any(n.startswith("training loop: the script keeps the model's outputs") and "65,536,000 bytes" in n
               for n in kept.notes)


@pytest.mark.parametrize("fields,words", [
    (dict(strategy="fsdp", tp=2), "tp=2"),
    (dict(strategy="fsdp", pp=2), "pp=2"),
])
def test_keeps_outputs_is_refused_where_the_step_keeps_no_outputs(fields, words):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**BASE | fields, keeps_outputs=True))
    assert err.value.field == "keeps_outputs" and words in str(err.value)


def test_keeps_outputs_needs_an_architecture():
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(params="7B", strategy="zero3", keeps_outputs=True))
    assert err.value.field == "keeps_outputs"


def test_the_probe_runs_the_loop_it_is_asked(tmp_path):
    request = EstimateRequest(**BASE, strategy="zero2", keeps_outputs=True)
    assert worker_job(request, steps=1, warmup_steps=0, out_dir=tmp_path).keeps_outputs
    assert not worker_job(request.model_copy(update={"keeps_outputs": False}), steps=1, warmup_steps=0,
                          out_dir=tmp_path).keeps_outputs


def test_keeps_outputs_has_logits_dominated_real_runs():
    runs = [f for _, f in CPU_RUNS + BENCH_RUNS if f.get("keeps_outputs")]
    assert len(runs) >= 2
    assert {f["strategy"] for f in runs} >= {"ddp", "zero2", "fsdp"}
    # logits-dominated: at least 768 tokens of a 32k vocabulary (24.6M logits per micro-batch)
    assert all(f["micro_batch"] * f["seq_len"] >= 768 and f["model_config"]["vocab_size"] >= 32_000 for f in runs)


def test_one_gpu_defaults_to_strategy_single_and_single_is_one_device():
    one = EstimateRequest(model_config=LLAMA_32K, gpus=1, gpu="cpu")
    assert one.strategy == "single"
    assert EstimateRequest(model_config=LLAMA_32K, gpus=1, gpu="cpu", strategy="ddp").strategy == "ddp"
    assert EstimateRequest(model_config=LLAMA_32K, gpus=2, gpu="cpu").strategy == "zero3"
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(model_config=LLAMA_32K, gpus=2, gpu="cpu", strategy="single"))
    assert err.value.field == "strategy" and "gpus(2) * nodes(1) = 2" in str(err.value)


def test_single_is_ddp_without_its_buckets():
    # the bare module: no DDP Reducer, so no bucket copy of the gradients (measured: llama-single-bf16-t512)
    single = estimate(EstimateRequest(model_config=LLAMA_32K, gpus=1, gpu="cpu", seq_len=256))
    ddp = estimate(EstimateRequest(model_config=LLAMA_32K, gpus=1, gpu="cpu", seq_len=256, strategy="ddp"))
    buckets = 4 * single.parameters  # fp32 gradients, one copy
    assert ddp.per_device.resident_bytes - single.per_device.resident_bytes == buckets
    assert not any("DDP" in i.name for p in single.phases for i in p.items)


QLORA = dict(model_config=LLAMA_32K, gpus=1, gpu="cpu", micro_batch=1, seq_len=1024, finetune="qlora",
             lora_targets="all-linear")


def test_qlora_as_it_is_run_keeps_an_fp32_stream_under_autocast():
    # a 4-bit base under torch.autocast after prepare_model_for_kbit_training: the checkpointed block
    # inputs are the fp32 residual stream (measured: llama-qlora-single-bf16-ckpt-all-r16-t1024)
    from planner.memory.orchestrator import activations, resolve

    ckpt = activations(resolve(EstimateRequest(**QLORA, checkpointing="full")))
    assert ckpt.layer_kept_bytes == 4 * 1024 * 256
    # the fp32 LM head's bf16 copy is saved for the input's gradient, beside the final norm's fp32 input
    final = next(i.bytes for i in ckpt.items if i.name == "final norm")
    assert final == 4 * 1024 * 256 + 4 * 1024 + 2 * 32_000 * 256
    # fp32 compute: the 16-bit terms are what they were (the stream is fp32 anyway)
    fp32 = activations(resolve(EstimateRequest(**QLORA, precision="fp32", checkpointing="full")))
    assert fp32.layer_kept_bytes == 4 * 1024 * 256


def test_qlora_int8_under_autocast_is_answered_and_double_quant_off_refused_by_field():
    """LLM.int8 under autocast (Axolotl's load_in_8bit with bf16) is modelled: its linears keep their
    fp32 inputs, which the 4-bit ones do not, and return 16-bit outputs on CPU where the 4-bit ones
    return fp32 (tests/real_runs.py llama-int8-lora-*, measured within 0.02%)."""
    int8 = estimate(EstimateRequest(**QLORA, quantize_base="int8")).per_device
    nf4 = estimate(EstimateRequest(**QLORA)).per_device
    assert int8.frozen_weights_bytes > nf4.frozen_weights_bytes and int8.activations_bytes != nf4.activations_bytes
    for fields in (dict(finetune="lora"), dict(quantize_base="int8")):
        with pytest.raises(ValueError, match="double_quant=False is bitsandbytes' 4-bit option"):
            EstimateRequest(**QLORA | fields, double_quant=False)


def test_double_quantization_stores_the_absmax_in_8_bits():
    from planner.recipes.finetune import quantized_weight_bytes

    n, blocks = 4096 * 4096, 4096 * 4096 // 64
    assert quantized_weight_bytes(n, "nf4", 4096, double_quant=False) == n // 2 + 4 * blocks + 64
    assert quantized_weight_bytes(n, "nf4", 4096) == n // 2 + blocks + 4 * (blocks // 256) + 1024 + 4 + 64
    single = estimate(EstimateRequest(**QLORA)).per_device.frozen_weights_bytes
    off = estimate(EstimateRequest(**QLORA, double_quant=False)).per_device.frozen_weights_bytes
    assert off > single


def test_qlora_recipe_has_real_runs_on_one_device_and_ddp():
    runs = [f for _, f in CPU_RUNS + BENCH_RUNS if f.get("finetune") == "qlora" and f["precision"] == "bf16-mixed"
            and f["strategy"] in ("single", "ddp")]
    assert {f["strategy"] for f in runs} == {"single", "ddp"}
    assert {f["checkpointing"] for f in runs} == {"none", "full"}
    assert {f.get("quantize_base", "nf4") for f in runs} == {"nf4", "fp4", "int8"}
    assert {f.get("double_quant", True) for f in runs} == {True, False}


# --- checkpointing policies -------------------------------------------------------------------

from planner.model.activations import recompute_flops_per_token, selective_op_saved_linears  # noqa: E402
from planner.model.architecture import from_hf_config  # noqa: E402
from planner.model.linears import Linear  # noqa: E402
from tests.real_runs import LLAMA  # noqa: E402

POLICY = dict(model_config=LLAMA, gpus=1, gpu="cpu", micro_batch=4, seq_len=256)


def test_selective_op_saves_every_other_matmul_and_every_addmm():
    linears = [Linear(n, 8, 8, False) for n in ("q", "k", "v", "o", "gate", "up", "down")]
    assert [x.name for x in selective_op_saved_linears(linears)] == ["q", "v", "gate", "down"]
    with_bias = [Linear("q", 8, 8, True), Linear("k", 8, 8, True), Linear("v", 8, 8, True), Linear("o", 8, 8, False)]
    assert [x.name for x in selective_op_saved_linears(with_bias)] == ["q", "k", "v", "o"]


@pytest.mark.parametrize("strategy", ["single", "zero2"])
def test_policies_order_memory_between_none_and_full(strategy):
    fields = POLICY | dict(strategy=strategy, gpus=1 if strategy == "single" else 2,
                           reduce_bucket_size=2_000_000, allgather_bucket_size=2_000_000) \
        if strategy == "zero2" else POLICY | dict(strategy=strategy)
    peak = {(c, e): estimate(EstimateRequest(**fields, checkpointing=c, checkpointing_every=e)).per_device.peak_bytes
            for c, e in [("none", None), ("full", None), ("full", 2), ("selective-op", None)]}
    assert peak[("full", None)] < peak[("selective-op", None)] < peak[("none", None)]
    assert peak[("full", None)] < peak[("full", 2)] < peak[("none", None)]


def test_recompute_flops_per_policy():
    a = from_hf_config(dict(LLAMA))
    h, kv, inner, s = 256, 128, 688, 1024
    block = 2 * (h * h + 2 * h * kv + h * h + 3 * h * inner) + 4 * s * h
    assert recompute_flops_per_token(a, s, "none") == 0
    assert recompute_flops_per_token(a, s, "full") == pytest.approx(4 * block, rel=1e-3)  # norms' weights aside
    assert recompute_flops_per_token(a, s, "full", every=2) == pytest.approx(2 * block, rel=1e-3)
    assert recompute_flops_per_token(a, s, "selective-op") == 4 * 2 * (h * kv + h * h + h * inner)  # k, o, up
    assert recompute_flops_per_token(a, s, "selective-attention") == 4 * 4 * s * h


@pytest.mark.parametrize("fields,field", [
    (dict(checkpointing="selective-op", tp=2, strategy="fsdp", gpus=2), "checkpointing"),
    (dict(checkpointing="selective-op", attention="eager"), "checkpointing"),
    (dict(checkpointing="selective-attention", finetune="lora"), "checkpointing"),
    (dict(checkpointing="full", checkpointing_every=2, pp=2, strategy="fsdp", gpus=2), "checkpointing_every"),
])
def test_policies_refused_where_not_modelled(fields, field):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**POLICY | fields))
    assert err.value.field == field


def test_checkpointing_every_needs_full_and_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="checkpointing_every=2 applies to checkpointing=full"):
        EstimateRequest(**POLICY, checkpointing="selective-op", checkpointing_every=2)
    with pytest.raises(ValueError, match="selective-op"):
        EstimateRequest(**POLICY, checkpointing="selective")


def test_policies_have_real_runs():
    runs = [f for _, f in CPU_RUNS + BENCH_RUNS]
    for policy in ("selective-op", "selective-attention"):
        assert sum(f["checkpointing"] == policy for f in runs) >= 2
    assert sum(f.get("checkpointing_every", 1) > 1 for f in runs) >= 2


# --- the loss ---------------------------------------------------------------------------------

LOGITS = dict(model_config=LLAMA_32K, gpus=1, gpu="cpu", micro_batch=1, seq_len=2048)


def test_chunked_loss_keeps_the_saved_set_and_peaks_at_the_forward_of_its_last_chunk():
    from planner.memory.orchestrator import activations, resolve

    hf = activations(resolve(EstimateRequest(**LOGITS)))
    chunked = activations(resolve(EstimateRequest(**LOGITS, loss="chunked")))
    tv = 2048 * 32_000
    assert chunked.saved_bytes == hf.saved_bytes  # every chunk's fp32 log-probabilities are saved
    assert hf.loss_transient_bytes == 8 * tv
    th = 2048 * 256
    # bf16 autocast, 8 chunks: the eight bf16 logits, the last chunk's fp32 upcast (> one chunk's 8 x tv / 8)
    # and the final norm's fp32 output beside the bf16 casts of its chunks the head saved
    assert chunked.loss_transient_bytes == 2 * tv + 4 * tv // 8 + 4 * th
    fp32 = activations(resolve(EstimateRequest(**LOGITS, loss="chunked", loss_chunks=4, precision="fp32")))
    assert fp32.loss_transient_bytes == 4 * tv  # the fp32 logits; the head saved views of the norm's output
    two = dict(LOGITS, micro_batch=2, seq_len=1024)  # chunks of 2 sequences: the head's matmul saves copies
    fp32_two = activations(resolve(EstimateRequest(**two, loss="chunked", loss_chunks=4, precision="fp32")))
    assert fp32_two.loss_transient_bytes == 4 * tv + 4 * th


@pytest.mark.parametrize("fields,field,words", [
    (dict(loss="liger-fused"), "loss", "GPU only"),
    (dict(loss="cce", gpu="h100-80gb"), "loss", "bf16/fp16"),  # autocast over fp32 weights: an fp32 stream
    (dict(loss="liger-fused", gpu="h100-80gb", strategy="fsdp", gpus=4, tp=2), "loss", "tp=2"),
    (dict(loss="vocab-parallel"), "loss", "tp > 1"),
    (dict(loss_chunks=4), "loss_chunks", "applies to loss=chunked"),
    (dict(loss="chunked", finetune="lora"), "loss", "finetune=lora"),
])
def test_losses_not_modelled_are_refused_by_field(fields, field, words):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**LOGITS | fields))
    assert err.value.field == field and words in str(err.value)


def test_unknown_loss_names_the_choices():
    with pytest.raises(ValueError, match="chunked"):
        EstimateRequest(**LOGITS, loss="fused")


def test_chunked_loss_has_logits_dominated_real_runs():
    runs = [f for _, f in CPU_RUNS + BENCH_RUNS if f.get("loss") == "chunked"]
    assert len(runs) >= 2 and all(f["model_config"]["vocab_size"] >= 32_000 for f in runs)
