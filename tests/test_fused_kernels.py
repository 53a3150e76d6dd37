"""fused_kernels (planner/recipes/fused_kernels.py): Liger-Kernel's RMSNorm, rotary and SiLU-mul and torchtitan's
fused_rmsnorm in place of the eager modules. The saved bytes are derived here from what each side's code saves
(LlamaRMSNorm: fp32 upcast, x * rsqrt, output, rsqrt per token; LigerRMSNormFunction: input, fp32 rstd, output;
LlamaMLP's act(gate) * up: gate, act(gate), up, product; LigerSiLUMulFunction: gate, up, product), the time terms
from the kernels' reads and writes, then the job files that turn them on and the refusals. The kernels are Triton:
these pin the model to the source; bench/gpu_check.py measures them when a GPU is lent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.check import job_request
from planner.errors import PlannerError
from planner.memory.orchestrator import activations, estimate, resolve, resolve_model
from planner.model.activations import block_saved_bytes, estimate_activations
from planner.model.architecture import layer_specs
from planner.model.catalogue import model_from_config
from planner.schema import CheckRequest, EstimateRequest
from planner.time import elementwise
from planner.time.collectives import MEMORY_BANDWIDTH_EFFICIENCY
from planner.time.step import estimate_with_time
from tests.real_runs import LLAMA, LLAMA_32K

FIXTURES = Path(__file__).parent / "fixtures" / "jobfiles"
ARCH = model_from_config(LLAMA).architecture
H, INNER, LAYERS = 256, 688, 4  # LLAMA's hidden, intermediate and blocks
GPU = dict(model_config=LLAMA_32K, gpus=2, gpu="h100-80gb", strategy="fsdp", micro_batch=1, seq_len=2048)


def _block(fused: tuple[str, ...], tokens: int = 1024, b: int = 2, autocast: bool = False) -> int:
    spec = layer_specs(ARCH)[0]
    return block_saved_bytes(ARCH, spec, tokens, tokens, 1, b, "sdpa", "cuda", autocast, fused)


# --- memory --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b", [2, 4])
def test_a_fused_rms_norm_saves_four_bytes_per_element_fewer_per_norm(b):
    tokens = 1024
    # eager LlamaRMSNorm: the fp32 upcast (the input itself in fp32), x * rsqrt in the input's dtype, the output
    # (saved by the next linear), rsqrt per token; the fused norm: the input, the output, an fp32 rstd per token
    eager = 4 * H + b * H + b * H + 4
    fused = b * H + b * H + 4
    assert eager - fused == 4 * H
    # input_layernorm and post_attention_layernorm
    assert _block((), b=b) - _block(("rms_norm",), b=b) == 2 * (eager - fused) * tokens


def test_under_autocast_the_fused_norm_saves_its_fp32_input_and_still_four_bytes_fewer():
    # autocast over fp32 weights: the stream is fp32; eager saves the fp32 input (its no-op upcast) and an fp32
    # x * rsqrt, the fused norm the fp32 input alone
    assert _block((), autocast=True) - _block(("rms_norm",), autocast=True) == 2 * 4 * H * 1024


def test_swiglu_saves_one_inner_tensor_fewer_and_rope_changes_nothing_saved():
    tokens, b = 1024, 2
    # LlamaMLP saves gate, act(gate), up and their product; LigerSiLUMulFunction saves gate and up, returns the product
    assert _block(()) - _block(("swiglu",)) == (4 - 3) * b * tokens * INNER
    # Liger's rope rotates q and k in place and saves the shared cos/sin tables only
    assert _block(("rope",)) == _block(())


def test_the_final_norm_and_its_backward_transient():
    eager = estimate_activations(ARCH, micro_batch=1, seq_len=1024, compute_bytes=2)
    fused = estimate_activations(ARCH, micro_batch=1, seq_len=1024, compute_bytes=2, fused=("rms_norm",))
    assert eager.edges.final_norm_saved - fused.edges.final_norm_saved == 4 * H * 1024
    # Liger's backward writes dX into dY's storage: no tokens x hidden tensor of its own
    assert eager.final_norm_transient_bytes > 0 == fused.final_norm_transient_bytes
    assert eager.saved_bytes - fused.saved_bytes == (2 * LAYERS + 1) * 4 * H * 1024


def test_llama_2_13b_at_8192_tokens_saves_about_12_gib_less_with_a_fused_rms_norm():
    arch = resolve_model(EstimateRequest(model="llama-2-13b")).architecture
    tokens, hidden, layers = 8192, 5120, 40
    eager = estimate_activations(arch, micro_batch=1, seq_len=tokens, compute_bytes=2)
    fused = estimate_activations(arch, micro_batch=1, seq_len=tokens, compute_bytes=2, fused=("rms_norm",))
    assert eager.saved_bytes - fused.saved_bytes == (2 * layers + 1) * 4 * tokens * hidden
    assert 12.0 < (eager.saved_bytes - fused.saved_bytes) / 2**30 < 13.0


def test_the_estimate_counts_the_fused_set_in_every_layout_it_models():
    base = estimate(EstimateRequest(**GPU)).per_device.peak_bytes
    fused = estimate(EstimateRequest(**GPU, fused_kernels="rms_norm,swiglu")).per_device.peak_bytes
    assert fused < base
    cp_base = estimate(EstimateRequest(**GPU | {"cp": 2})).per_device.peak_bytes
    cp_fused = estimate(EstimateRequest(**GPU | {"cp": 2}, fused_kernels=("rms_norm", "swiglu"))).per_device.peak_bytes
    assert cp_fused < cp_base
    tp_base = estimate(EstimateRequest(**GPU | {"tp": 2})).per_device.peak_bytes
    assert estimate(EstimateRequest(**GPU | {"tp": 2}, fused_kernels="swiglu,rope")).per_device.peak_bytes < tp_base


def test_ring_attention_frees_less_at_the_mlp_when_it_saved_less():
    from planner.parallel.context import _freed_before_attention_bytes

    # a block's backward reaches the attention once the MLP's and the post-attention norm's saved sets are freed:
    # the fused ones held act(gate) and the fp32 upcast and x * rsqrt less
    local = 1024
    eager = _freed_before_attention_bytes(ARCH, local, 2)
    fused = _freed_before_attention_bytes(ARCH, local, 2, 0, ("rms_norm", "swiglu"))
    assert eager - fused == local * (2 * INNER + 4 * H)


def test_lora_blocks_save_the_fused_norms_input_in_the_stream_dtype():
    tokens = 2048
    request = dict(GPU | {"gpus": 1, "strategy": "single"}, finetune="lora", precision="bf16-mixed")
    # a frozen-weight LlamaRMSNorm keeps its fp32 upcast and rsqrt; Liger's keeps the bf16 input and rstd: 2 bytes
    # per element fewer per norm (2 per block and the final norm; block 0's first norm saves nothing either way,
    # its input needing no gradient); the SiLU-mul keeps gate and up (the frozen linears' bf16 outputs), not act(gate)
    expected = (2 * LAYERS - 1 + 1) * 2 * H * tokens + LAYERS * 2 * INNER * tokens
    a = activations(resolve(EstimateRequest(**request)))
    f = activations(resolve(EstimateRequest(**request, fused_kernels="rms_norm,swiglu")))
    assert a.saved_bytes - f.saved_bytes == expected


# --- time ----------------------------------------------------------------------------------------------------


def test_each_fused_kernel_is_one_kernel_each_way_moving_its_reads_and_writes():
    c = 2
    norm = elementwise.traffic(elementwise.LIGER_RMSNORM, H, c, rows=1.0)
    # forward X in, Y out, rstd out; backward dY, X, rstd in, dX out
    assert (norm.forward_bytes, norm.backward_bytes) == (2 * c * H + 4, 3 * c * H + 4)
    assert (norm.forward_kernels, norm.backward_kernels) == (1, 1)
    qk, head_dim = 256 + 128, 64
    rope = elementwise.traffic(elementwise.LIGER_ROPE, qk, c, table=head_dim)
    # q and k read and written in place, half of cos and half of sin per token
    assert rope.forward_bytes == rope.backward_bytes == 2 * c * qk + c * head_dim
    gate = elementwise.traffic(elementwise.LIGER_SWIGLU, INNER, c)
    assert (gate.forward_bytes, gate.backward_bytes) == (3 * c * INNER, 5 * c * INNER)
    # at its measured rate: (bytes) x copy rate / rate at the copy rate
    assert norm.forward_seconds_bytes == pytest.approx(norm.forward_bytes * MEMORY_BANDWIDTH_EFFICIENCY / 0.691)


def test_block_traffic_drops_and_the_step_is_faster():
    spec = layer_specs(ARCH)[0]
    eager = elementwise.block_traffic(ARCH, spec, 1, False, 2)
    fused = elementwise.block_traffic(ARCH, spec, 1, False, 2, fused=("rms_norm", "rope", "swiglu"))
    assert fused.forward_bytes < eager.forward_bytes and fused.backward_bytes < eager.backward_bytes
    assert fused.forward_kernels < eager.forward_kernels
    # the eager norms' ops replaced by one kernel each way: 2 norms x (ops - 1) fewer forward launches, and so on
    composite = elementwise.COMPOSITE_RMSNORM
    rotary = elementwise.ROTARY
    gated = elementwise.GATED
    assert eager.forward_kernels - fused.forward_kernels == (
        2 * (len(composite.forward) - 1) + (2 * len(rotary.forward) - 1) + (len(gated.forward) - 1))
    slow = estimate_with_time(EstimateRequest(**GPU)).time
    fast = estimate_with_time(EstimateRequest(**GPU, fused_kernels="rms_norm,rope,swiglu")).time
    terms = {n: {t.name: t.seconds for t in x.terms} for n, x in (("slow", slow), ("fast", fast))}
    assert terms["fast"]["elementwise and loss"] < terms["slow"]["elementwise and loss"]
    assert fast.step_seconds < slow.step_seconds
    assert any("Liger" in t.source for t in fast.terms if t.name == "elementwise and loss")


# --- the field, its notes and refusals ---------------------------------------------------------------------


def test_the_field_reads_text_and_lists_in_one_order():
    assert EstimateRequest(**GPU, fused_kernels="swiglu, rms_norm").fused_kernels == ("rms_norm", "swiglu")
    assert EstimateRequest(**GPU, fused_kernels=["rope", "rope"]).fused_kernels == ("rope",)
    assert EstimateRequest(**GPU).fused_kernels == ()
    with pytest.raises(ValueError, match="rms_norm"):
        EstimateRequest(**GPU, fused_kernels="layer_norm")


def test_the_notes_say_unverified_gpu_only():
    notes = estimate(EstimateRequest(**GPU, fused_kernels="rope")).notes
    assert any("fused kernels (rope)" in n and "unverified" in n and "GPU" in n for n in notes)


@pytest.mark.parametrize("fields,words", [
    ({"gpu": "cpu", "device_memory_gib": 64, "strategy": "ddp"}, "CPU ranks"),
    ({"pp": 2}, "pp=2"),
    ({"tp": 2}, "tensor-parallel"),
    ({"compile": "blocks"}, "compile blocks"),
])
def test_what_is_not_modelled_is_refused_by_name(fields, words):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**GPU | {"gpus": 4} | fields, fused_kernels="rms_norm"))
    assert err.value.field == "fused_kernels" and words in str(err.value) and "rms_norm" in str(err.value)


@pytest.mark.parametrize("config,part,words", [
    ("GEMMA3", "swiglu", "patches no swiglu"),  # Gemma's MLP is GeGLU (geglu=)
    ("GEMMA3", "rms_norm", "fp32"),  # Gemma3RMSNorm multiplies its weight in fp32
    ("QWEN3_MOE", "swiglu", "LigerExperts"),
    ("GPT2", "rope", "patches no rope"),
    ("DEEPSEEK_V3", "rms_norm", "patches no rms_norm"),
])
def test_a_part_the_family_does_not_get_is_refused(config, part, words):
    import tests.real_runs as runs

    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**GPU | {"model_config": getattr(runs, config)}, fused_kernels=part))
    assert err.value.field == "fused_kernels" and words in str(err.value) and part in str(err.value)


def test_verify_refuses_a_model_parallel_probe_with_fused_kernels(tmp_path):
    from backend.launch import worker_job

    request = EstimateRequest(**GPU | {"gpus": 2, "cp": 2}, fused_kernels="swiglu")
    with pytest.raises(PlannerError) as err:
        worker_job(request, steps=1, warmup_steps=0, out_dir=tmp_path)
    assert err.value.field == "fused_kernels" and "unverified" in str(err.value)
    job = worker_job(EstimateRequest(**GPU | {"gpus": 1, "strategy": "single"}, fused_kernels="swiglu"), steps=1,
                     warmup_steps=0, out_dir=tmp_path)
    assert job.fused_kernels == ("swiglu",)


def test_gpu_check_has_a_fused_kernels_row():
    from bench import gpu_check

    assert any(fields.get("fused_kernels") for _, _, fields in gpu_check.RECIPE_GRID)
    assert "fused_kernels" in gpu_check.GPU_ONLY_RECIPES


# --- job files -----------------------------------------------------------------------------------------------


def _request(files: tuple[str, ...], overrides: dict):
    body = CheckRequest(files=[{"name": Path(f).name, "text": (FIXTURES / f).read_text()} for f in files],
                        overrides=overrides, gpus=8, gpu="h100-80gb")
    return job_request(body)


@pytest.mark.parametrize("files,overrides,kernels,loss", [
    # HF Trainer: _apply_liger_kernel_to_instance with the family's defaults (rope, rms_norm, swiglu, FLCE)
    (("trl/example_config.yaml",), {"use_liger_kernel": True}, ("rms_norm", "rope", "swiglu"), "liger-fused"),
    (("trl/example_config.yaml",), {"use_liger_kernel": True, "liger_kernel_config": {
        "rope": False, "fused_linear_cross_entropy": False}}, ("rms_norm", "swiglu"), "hf"),
    (("llamafactory/llama3_full_sft.yaml", "llamafactory/ds_z3_config.json"), {"enable_liger_kernel": True},
     ("rms_norm", "rope", "swiglu"), "liger-fused"),
    (("axolotl/lora-8b.yml",), {"liger_rms_norm": True, "liger_glu_activation": True, "liger_layer_norm": True},
     ("rms_norm", "swiglu"), None),
    (("axolotl/lora-8b.yml",), {"liger_rope": True, "liger_swiglu": True}, ("rope", "swiglu"), None),
    (("torchtitan/llama3_8b.toml",), {"model.norm_type": "fused_rmsnorm"}, ("rms_norm",), None),
])
def test_job_files_turn_the_fused_kernels_on(files, overrides, kernels, loss):
    job, request = _request(files, overrides)
    assert request.fused_kernels == kernels and next(iter(overrides)) in job.origin["fused_kernels"]
    if loss is not None:
        assert request.loss == loss


@pytest.mark.parametrize("files,overrides,key", [
    (("trl/example_config.yaml",), {"use_liger_kernel": True, "liger_kernel_config": {
        "cross_entropy": True, "fused_linear_cross_entropy": False}}, "liger_kernel_config"),
    (("trl/example_config.yaml",), {"use_liger_kernel": True, "liger_kernel_config": {"rms_norm_offset": 1}},
     "liger_kernel_config"),
    (("axolotl/lora-8b.yml",), {"liger_cross_entropy": True}, "liger_cross_entropy"),
    (("torchtitan/llama3_8b.toml",), {"model.norm_type": "layernorm"}, "model.norm_type"),
])
def test_job_file_values_not_modelled_are_refused_by_key(files, overrides, key):
    with pytest.raises(PlannerError) as err:
        _request(files, overrides)
    assert key in str(err.value)


def test_layer_norm_alone_turns_nothing_on():
    _, request = _request(("axolotl/lora-8b.yml",), {"liger_layer_norm": True})
    assert request.fused_kernels == ()


def test_emit_names_each_liger_part_the_estimate_counted():
    from planner.plan.emit import emit_estimate_files

    base = dict(model_config=LLAMA_32K, gpus=2, gpu="h100-80gb", seq_len=1024, strategy="zero2")
    args = json.loads(emit_estimate_files(estimate(EstimateRequest(**base, fused_kernels="swiglu")))[
        "trainer_args.json"])
    assert args["use_liger_kernel"] is True
    assert args["liger_kernel_config"] == {"fused_linear_cross_entropy": False, "rms_norm": False, "rope": False,
                                           "swiglu": True}
    args = json.loads(emit_estimate_files(estimate(EstimateRequest(**base, loss="liger-fused")))["trainer_args.json"])
    assert args["liger_kernel_config"] == {"fused_linear_cross_entropy": True, "rms_norm": False, "rope": False,
                                           "swiglu": False}


def test_the_form_and_the_cli_take_the_field_as_comma_separated_text(capsys):
    from cli.main import main
    from web.form import build_request, form_fields

    fields = form_fields()
    field = next(f for f in fields if f.name == "fused_kernels")
    assert (field.kind, field.default) == ("text", "")  # empty: none fused, and not sent on
    request = build_request("estimate", fields, {"model": "llama-3-8b", "fused_kernels": "swiglu,rms_norm"})
    assert request.fused_kernels == ("rms_norm", "swiglu")
    assert "fused_kernels" not in build_request("estimate", fields, {"model": "llama-3-8b"}).model_fields_set
    assert main(["estimate", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--fused-kernels",
                 "rms_norm,swiglu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["fused_kernels"] == ["rms_norm", "swiglu"]


def test_emitted_trainer_arguments_read_back_to_the_same_kernels():
    from planner.jobfiles.job import read_job
    from planner.plan.emit import emit_estimate_files

    request = EstimateRequest(model_config=LLAMA_32K, gpus=2, gpu="h100-80gb", seq_len=1024, strategy="zero2",
                              loss="liger-fused", fused_kernels="rms_norm,swiglu")
    files = emit_estimate_files(estimate(request))
    text = files["trainer_args.json"]
    job = read_job([("trainer_args.json", text), ("ds_config.json", files["ds_config.json"])], 2)
    assert job.fields["fused_kernels"] == ("rms_norm", "swiglu") and job.fields["loss"] == "liger-fused"
    # and transformers' own parser takes the file (TrainingArguments.liger_kernel_config: dict[str, bool])
    from transformers import HfArgumentParser, TrainingArguments

    fields = json.loads(text) | {"output_dir": "unused", "deepspeed": None, "use_cpu": True}
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(fields)
    assert args.use_liger_kernel and args.liger_kernel_config == {"fused_linear_cross_entropy": True,
                                                                  "rms_norm": True, "rope": False, "swiglu": True}


def test_activation_offload_keeps_no_repeated_save_of_a_fused_norm():
    from planner.recipes.activation_offload import repeat_saved_bytes

    spec, tokens = layer_specs(ARCH)[0], 1024
    # eager: each norm's fp32 input saved by pow and by x * rsqrt, its rsqrt by two nodes: TRL keeps the second
    # save on the device; Liger's norm saves (X, W, RSTD) once
    assert repeat_saved_bytes(ARCH, spec, tokens, 2, False) - repeat_saved_bytes(
        ARCH, spec, tokens, 2, False, ("rms_norm",)) == 2 * (4 * H + 4) * tokens
    plain = activations(resolve(EstimateRequest(**GPU, activation_offload=True)))
    fused = activations(resolve(EstimateRequest(**GPU, activation_offload=True, fused_kernels="rms_norm")))
    assert plain.device_block_bytes - fused.device_block_bytes == 2 * (4 * H + 4) * 2048


def test_anything_but_names_is_a_validation_error():
    for bad in ([{}], [1], "rms_norm,", 3):
        if bad == "rms_norm,":  # a trailing comma is read as the one name
            assert EstimateRequest(**GPU, fused_kernels=bad).fused_kernels == ("rms_norm",)
            continue
        with pytest.raises(ValueError):
            EstimateRequest(**GPU, fused_kernels=bad)
