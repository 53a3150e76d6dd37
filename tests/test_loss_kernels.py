"""The loss kernels and low-precision linears (issue 21): bytes hand-derived from the libraries'
source (Liger-Kernel 0.8.5, cut-cross-entropy 25.1.1, torchao 0.18, Transformer Engine), their
refusals, the job files that turn them on, and plans asked with the recipe. The Triton kernels run
on GPUs only: these pin the model to the source; bench/gpu_check.py measures them when a GPU is
lent. CCE's torch_compile implementation (CPU ranks) is measured by tests/real_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.check import job_request
from planner.errors import PlannerError
from planner.memory.orchestrator import activations, estimate, resolve
from planner.plan.search import plan
from planner.recipes.losses import liger_chunk_tokens
from planner.recipes.low_precision import RECIPES, converted_linears
from planner.model.architecture import layer_specs
from planner.schema import CheckRequest, EstimateRequest, PlanRequest
from planner.time import kernels
from planner.time.step import estimate_with_time
from tests.real_runs import LLAMA, LLAMA_32K

T, H, V = 2048, 256, 32_000  # tokens, hidden, vocabulary of LLAMA_32K at micro-batch 1 x 2,048
# FSDP2 casts the weights to bf16 (MixedPrecisionPolicy): the fused kernels read bf16 hidden states and weights
GPU = dict(model_config=LLAMA_32K, gpus=2, gpu="h100-80gb", strategy="fsdp", micro_batch=1, seq_len=T)


def _acts(**fields):
    return activations(resolve(EstimateRequest(**GPU | fields)))


# --- Liger's fused linear cross-entropy ----------------------------------------------------------

@pytest.mark.parametrize("tokens,hidden,vocab,chunk", [
    (16_384, 4096, 128_256, 512),  # inc_factor cdiv(128256, 4096) = 32; cdiv(16384, 32) = 512, a power of 2
    (2048, 256, 32_000, 32),  # inc_factor 125; cdiv(2048, 125) = 17 -> next power of 2: 32
    (8, 4096, 32_000, 1),  # inc_factor 8; one token per chunk
    (100, 8192, 4096, 100),  # vocab below hidden: inc_factor 1, chunk = next_pow2(100) = 128, capped at BT
])
def test_liger_chunk_size_is_its_sources(tokens, hidden, vocab, chunk):
    assert liger_chunk_tokens(tokens, hidden, vocab) == chunk


def test_liger_holds_both_gradients_from_its_forward_and_one_chunk_of_logits():
    hf, liger = _acts(), _acts(loss="liger-fused")
    hf_loss = 4 * T * V + 8 * T  # fp32 log-probabilities and int64 labels (activations._loss_saved)
    held = 2 * T * H + 2 * V * H + 4 * T + 8 * T  # grad_input, grad_weight (bf16), fp32 loss_1d, labels
    assert liger.saved_bytes - hf.saved_bytes == held - hf_loss
    assert liger.edges.loss_saved == held
    assert liger.loss_transient_bytes == 2 * 32 * V + 2 * 32 * H  # one 32-token chunk's logits and its grad_input
    assert hf.loss_transient_bytes == 8 * T * V


def test_liger_under_lora_makes_no_weight_gradient():
    hf, lora = _acts(finetune="lora"), _acts(loss="liger-fused", finetune="lora")
    held = 2 * T * H + 4 * T + 8 * T  # the frozen head: grad_weight None
    assert lora.saved_bytes - hf.saved_bytes == held - (4 * T * V + 8 * T)


def test_cce_saves_the_log_sum_exp_and_makes_its_gradients_in_backward():
    hf, cce = _acts(), _acts(loss="cce")
    held = 4 * T + 4 * V + 8 * T  # lse, logit_avg, labels (e and c are the head's input and weight)
    assert cce.saved_bytes - hf.saved_bytes == held - (4 * T * V + 8 * T)
    # de, dc (bf16), int32 locks (~ one per token and per vocabulary entry), argsort int64 then int32
    assert cce.loss_transient_bytes == 2 * T * H + 2 * V * H + 4 * T + 4 * V + 12 * V


def test_fused_losses_lower_the_logits_dominated_peak_and_name_their_source():
    hf = estimate(EstimateRequest(**GPU))
    for loss, source in (("liger-fused", "Liger-Kernel 0.8.5"), ("cce", "cut-cross-entropy 25.1.1")):
        fused = estimate(EstimateRequest(**GPU, loss=loss))
        assert fused.per_device.peak_bytes < hf.per_device.peak_bytes
        assert any(source in n and "unverified" in n for n in fused.notes)


def test_a_loop_that_keeps_its_outputs_holds_no_logits_under_a_fused_loss():
    fused = estimate(EstimateRequest(**GPU, loss="liger-fused"))
    kept = estimate(EstimateRequest(**GPU, loss="liger-fused", keeps_outputs=True))
    assert kept.per_device.peak_bytes == fused.per_device.peak_bytes


def test_a_loss_kernel_needs_an_architecture():
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(params="7B", gpus=8, gpu="h100-80gb", strategy="fsdp", loss="liger-fused"))
    assert err.value.field == "loss" and "architecture" in str(err.value)


@pytest.mark.parametrize("fields,words", [
    (dict(gpu="cpu", model_config=dict(LLAMA_32K, model_type="gemma2", final_logit_softcapping=30.0, head_dim=64)),
     "final_logit_softcapping"),  # CCE's torch_compile implementation, modelled without soft-capping
    (dict(strategy="ddp"), "bf16/fp16"),  # CCE: autocast over fp32 weights, an fp32 final norm output
    (dict(precision="fp32"), "bf16/fp16"),
    (dict(gpus=4, tp=2), "tp=2"),
])
def test_cce_refusals_name_the_field(fields, words):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**GPU | fields | {"loss": "cce"}))
    assert err.value.field == "loss" and words in str(err.value) and "\n" not in str(err.value)


# --- Cut Cross-Entropy's torch_compile implementation (CPU ranks) -------------------------------------

CPU = dict(model_config=LLAMA_32K, gpus=1, gpu="cpu", strategy="single", precision="fp32", micro_batch=1, seq_len=T)
ROWS = T - 1  # the last position has no next token: its label ignored, its row not copied


def test_cce_on_cpu_ranks_saves_the_logits_torch_compile_makes():
    """torch_compile.py's graph as AOTAutograd partitions it: the fp32 logits, row max and
    log-sum-exp saved; the labelled rows copied in place of the final norm's output; the weight's
    gradient beside the logits in backward (llama-v128k-single-fp32-cce-t1024 measured +0.00%)."""
    req = EstimateRequest(**CPU, loss="cce")
    hf, cce = activations(resolve(EstimateRequest(**CPU))), activations(resolve(req))
    held = 4 * ROWS * V + 2 * 4 * ROWS + (4 * ROWS * H - 4 * T * H) + (4 + 8) * ROWS + 8 * T
    assert cce.saved_bytes - hf.saved_bytes == held - (4 * T * V + 8 * T)
    assert cce.loss_transient_bytes == 4 * V * H  # the weight's fp32 gradient; the logits' in their buffer
    notes = estimate(req).notes
    assert any("torch_compile implementation" in n and "measured on CPU ranks" in n for n in notes)
    assert not any("Triton (GPU only)" in n for n in notes)


def test_cce_on_cpu_ranks_with_a_frozen_head_peaks_at_the_forwards_end():
    """LoRA in bf16: no weight gradient, so the copied rows are not saved; they and the norm's output are
    alive when the logits are made (llama-v32k-lora-ddp-bf16-cce-t512: the copy freed when the forward ends)."""
    req = EstimateRequest(**CPU | dict(precision="bf16-pure"), loss="cce", finetune="lora")
    hf = activations(resolve(EstimateRequest(**CPU | dict(precision="bf16-pure"), finetune="lora")))
    acts = activations(resolve(req))
    assert acts.loss_transient_bytes == 2 * T * H + 2 * ROWS * H
    held = 2 * ROWS * V + 2 * 4 * ROWS + (4 + 8) * ROWS + 8 * T  # the bf16 logits, no rows copy
    assert acts.saved_bytes - hf.saved_bytes == held - (4 * T * V + 8 * T)


def test_cce_on_cpu_ranks_keeps_the_logits_it_saved_in_the_time_model():
    arch = resolve(EstimateRequest(**CPU)).arch
    r = kernels.rates(__import__("planner.cluster.gpus", fromlist=["gpu"]).gpu("h100-80gb"), "fp32")
    triton, compiled = (kernels.work(arch, T, 1, 1, False, 4, False, r, loss=k) for k in ("cce", "cce-torch-compile"))
    assert triton.loss_recompute_flops == 2 * T * H * V and triton.loss_bytes == 0
    # the logits saved, not recomputed; read twice in the forward, once in backward, their gradient written once
    assert compiled.loss_recompute_flops == 0 and compiled.loss_bytes == 4 * 4 * T * V


def test_liger_on_cpu_ranks_is_refused_naming_what_runs_there():
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**CPU, loss="liger-fused"))
    assert err.value.field == "loss" and "GPU only" in str(err.value) and "cce" in str(err.value)


def test_the_probe_runs_cce_torch_compile_on_a_cpu_rank_and_matches_hfs_loss():
    """backend/losses.py FusedLinearLoss under a PEFT model (get_base_model), on CPU: CCE's
    torch_compile implementation, the same loss as transformers' ForCausalLMLoss."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cut_cross_entropy")
    peft = pytest.importorskip("peft")
    import transformers
    from backend.losses import FusedLinearLoss

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"} | {"num_hidden_layers": 1})
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    ids = torch.randint(0, config.vocab_size, (2, 16))
    expected = model(input_ids=ids, labels=ids).loss
    got = FusedLinearLoss(model, "cce")(input_ids=ids, labels=ids).loss
    assert got.item() == pytest.approx(expected.item(), rel=1e-4)


def test_cce_recomputes_the_logits_and_liger_moves_fewer_bytes():
    hf, liger, cce = (estimate_with_time(EstimateRequest(**GPU, loss=loss)).time for loss in ("hf", "liger-fused", "cce"))
    terms = {name: {t.name: t.seconds for t in x.terms} for name, x in (("hf", hf), ("liger", liger), ("cce", cce))}
    assert terms["cce"]["recompute (none)"] > 0 == terms["hf"].get("recompute (none)", 0.0)
    r = kernels.rates(__import__("planner.cluster.gpus", fromlist=["gpu"]).gpu("h100-80gb"), "bf16")
    assert terms["cce"]["recompute (none)"] == pytest.approx(2 * T * H * V / r.steady_flops)
    # per logit: HF 48 bytes at the copy rate (the upcast, torch's measured cross-entropy, the cast back),
    # Liger 3 x bf16, CCE none
    assert kernels.LOSS_BYTES_PER_LOGIT == 6 + 36 + 6
    per_logit = T * V / r.memory_bytes_per_s
    assert terms["hf"]["elementwise and loss"] - terms["liger"]["elementwise and loss"] == pytest.approx(
        (48 - 6) * per_logit)
    assert terms["hf"]["elementwise and loss"] - terms["cce"]["elementwise and loss"] == pytest.approx(48 * per_logit)


def test_liger_runs_the_lm_head_chunk_by_chunk_and_adds_each_chunk_into_the_weight_gradient():
    """The head's three GEMMs at Liger's chunk shapes (liger_head): 2,048 tokens in chunks of 32
    (inc_factor 125), the weight gradient read and written per chunk in the gradient's dtype."""
    r = kernels.rates(__import__("planner.cluster.gpus", fromlist=["gpu"]).gpu("h100-80gb"), "bf16")
    forward, dgrad, wgrad, flops = kernels.liger_head(float(T), V, H, r, 2, 4)
    chunks, chunk = T // 32, 32.0
    assert liger_chunk_tokens(T, H, V) == chunk
    assert forward == pytest.approx(chunks * kernels._gemm_seconds(chunk, V, H, r, 2))
    assert dgrad == pytest.approx(chunks * kernels._gemm_seconds(chunk, H, V, r, 2))
    accumulate = 2 * V * H * 4 / r.memory_bytes_per_s
    assert wgrad == pytest.approx(chunks * max(kernels._gemm_seconds(V, H, chunk, r, 2), accumulate))
    assert flops == 2 * T * V * H
    whole = sum(kernels._gemm_seconds(m, n, k, r, 2) for m, n, k in ((T, V, H), (T, H, V), (V, H, T)))
    assert forward + dgrad + wgrad > 2 * whole  # 32-token GEMMs and 64 passes over the fp32 gradient
    # the plan's arrays of micro-batch options give what one estimate gives for each
    import numpy as np
    options = np.array([1.0, 3.0, 8.0]) * T
    batched = kernels.liger_head(options, V, H, r, 2, 4)
    for i, m in enumerate(options):
        for got, want in zip(batched, kernels.liger_head(float(m), V, H, r, 2, 4)):
            assert got[i] == pytest.approx(want)


def test_liger_step_time_charges_its_chunked_head_and_says_so():
    hf, liger = (estimate_with_time(EstimateRequest(**GPU, loss=loss)).time for loss in ("hf", "liger-fused"))
    matmul = {name: next(t for t in x.terms if t.name == "matmul") for name, x in (("hf", hf), ("liger", liger))}
    assert matmul["liger"].seconds > matmul["hf"].seconds
    assert "Liger" in matmul["liger"].source and "Liger" not in matmul["hf"].source


# --- flash-attn's cross-entropy (llm-foundry's fused_crossentropy) ----------------------------------

def test_flash_attn_saves_the_compute_dtype_logits_and_makes_one_gradient_of_their_shape():
    hf, flash = _acts(), _acts(loss="flash-attn")
    held = 2 * T * V + 4 * T + 8 * T  # bf16 logits, fp32 lse, int64 labels (save_for_backward)
    assert flash.saved_bytes - hf.saved_bytes == held - (4 * T * V + 8 * T)
    assert flash.edges.loss_saved == held
    assert flash.loss_transient_bytes == 2 * T * V  # dlogits = torch.empty_like(logits), bf16


def test_flash_attn_under_a_loop_that_keeps_its_outputs_counts_the_logits_once():
    """Composer keeps the model's outputs through backward: their logits are the tensor the loss saves."""
    flash = estimate(EstimateRequest(**GPU, loss="flash-attn"))
    kept = estimate(EstimateRequest(**GPU, loss="flash-attn", keeps_outputs=True))
    assert _acts(loss="flash-attn", keeps_outputs=True).edges.loss_saved == 4 * T + 8 * T
    # the loss's backward: the logits and their gradient, either way; the held logits then outlive it
    assert kept.per_device.peak_bytes >= flash.per_device.peak_bytes
    assert kept.per_device.resident_bytes - flash.per_device.resident_bytes == 2 * T * V
    assert any("flash-attn" in n and "unverified" in n for n in kept.notes)


@pytest.mark.parametrize("fields,words", [(dict(gpu="cpu"), "GPU only"), (dict(gpus=4, tp=2), "tp=2")])
def test_flash_attn_refusals_name_the_field(fields, words):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**GPU | fields | {"loss": "flash-attn"}))
    assert err.value.field == "loss" and words in str(err.value) and "\n" not in str(err.value)


def test_the_probe_wires_flash_attns_loss_as_transformers_shifts_the_labels(monkeypatch):
    """backend/losses.py FlashAttnLoss on CPU with flash-attn's CrossEntropyLoss stood in by torch's
    (flash-attn is GPU only: bench/gpu_check.py runs the real one): the logits it returns are the
    model's, and the loss equals transformers' ForCausalLMLoss, so the labels are shifted as there."""
    import sys
    import types

    torch = pytest.importorskip("torch")
    import transformers
    from backend.losses import FlashAttnLoss

    cross_entropy = types.ModuleType("flash_attn.losses.cross_entropy")
    cross_entropy.CrossEntropyLoss = torch.nn.CrossEntropyLoss  # same signature: ignore_index, mean reduction
    for name in ("flash_attn", "flash_attn.losses"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.losses.cross_entropy", cross_entropy)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"} | {"num_hidden_layers": 1})
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    expected = model(input_ids=ids, labels=ids)
    got = FlashAttnLoss(model)(input_ids=ids, labels=ids)
    assert got.loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)
    assert torch.equal(got.logits, expected.logits)


def test_flash_attn_moves_three_compute_dtype_bytes_per_logit():
    hf, flash = (estimate_with_time(EstimateRequest(**GPU, loss=loss)).time for loss in ("hf", "flash-attn"))
    r = kernels.rates(__import__("planner.cluster.gpus", fromlist=["gpu"]).gpu("h100-80gb"), "bf16")
    terms = {name: {t.name: t.seconds for t in x.terms} for name, x in (("hf", hf), ("flash", flash))}
    assert terms["hf"]["elementwise and loss"] - terms["flash"]["elementwise and loss"] == pytest.approx(
        (kernels.LOSS_BYTES_PER_LOGIT - 6) * T * V / r.memory_bytes_per_s)


# --- low-precision linears ----------------------------------------------------------------------------

LP = dict(model_config=LLAMA, gpus=2, gpu="h100-80gb", strategy="fsdp", micro_batch=1, seq_len=1024)


def test_converted_linears_follow_torchtitans_filter():
    from planner.model.architecture import Architecture
    from planner.model.catalogue import model_from_config

    arch: Architecture = model_from_config(LLAMA).architecture
    spec = layer_specs(arch)[0]
    # q 256x256, k/v 256x128, o 256x256, gate/up 256x688, down 688x256: every dimension a multiple of 16
    assert len(converted_linears(arch, spec, RECIPES["float8-rowwise"])) == 7
    # NVFP4's kernels need multiples of 128: 688 is not, the MLP stays 16-bit
    assert [x.name for x in converted_linears(arch, spec, RECIPES["nvfp4"])] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    odd = model_from_config(dict(LLAMA, intermediate_size=680)).architecture  # 680 = 16 x 42.5
    assert [x.name for x in converted_linears(odd, layer_specs(odd)[0], RECIPES["float8-tensorwise"])] == \
        ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_torchao_float8_saves_what_a_16bit_linear_saves():
    base = activations(resolve(EstimateRequest(**LP)))
    f8 = activations(resolve(EstimateRequest(**LP, low_precision="float8-tensorwise")))
    assert f8.saved_bytes == base.saved_bytes  # matmul_with_hp_or_float8_args saves input_hp, weight_hp_t
    # the largest call's backward casts: grad_output twice, the weight and the input, 1 byte each (down_proj
    # 688 -> 256 and gate/up 256 -> 688 at 1,024 tokens: gate/up is larger)
    t = 1024
    casts = 2 * t * 688 + 256 * 688 + t * 256
    assert f8.layer_transient_bytes - base.layer_transient_bytes == casts
    rowwise = activations(resolve(EstimateRequest(**LP, low_precision="float8-rowwise")))
    assert rowwise.layer_transient_bytes - base.layer_transient_bytes == casts + 4 * (2 * t + 688 + t)


def test_float8_linears_under_autocast_make_no_16bit_weight_copies():
    # Float8Linear.forward hands matmul_with_hp_or_float8_args the fp32 parameter (float8_linear.py:264-269):
    # autocast's cast cache holds only the LM head's 16-bit weight; the H200 run measured it (0.00002% over)
    single = LP | {"strategy": "single", "gpus": 1, "precision": "bf16-mixed"}

    def copies(**fields):
        phases = estimate(EstimateRequest(**single, **fields)).phases
        return {p.name: sum(i.bytes for i in p.items if i.name.startswith("autocast copies")) for p in phases}

    plain, f8 = copies(), copies(low_precision="float8-tensorwise")
    blocks = 4 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 688)  # every block linear converts
    assert plain["start of backward"] - f8["start of backward"] == 2 * blocks
    assert f8["start of backward"] == 2 * 4096 * 256  # the LM head's
    assert 0 < plain["after the LM head"] and f8["after the LM head"] < 2 * 256 * 688  # at most the norms' bound
    offload = dict(activation_offload=True)
    assert activations(resolve(EstimateRequest(**single, **offload))).offloaded_bytes - activations(resolve(
        EstimateRequest(**single, **offload, low_precision="float8-tensorwise"))).offloaded_bytes == 2 * blocks


def test_nvfp4_saves_its_codes_and_te_keeps_fp8_weight_workspaces():
    b200 = LP | {"gpu": "b200"}
    base = activations(resolve(EstimateRequest(**b200)))
    nv = activations(resolve(EstimateRequest(**b200, low_precision="nvfp4")))
    t, ins, weights = 1024, 4 * 256, 256 * 256 * 2 + 256 * 128 * 2  # q, k, v, o convert
    assert nv.saved_bytes - base.saved_bytes == 4 * int(4.5 * (t * ins + weights) / 8)
    ddp = LP | {"strategy": "ddp"}
    plain = estimate(EstimateRequest(**ddp))
    te = estimate(EstimateRequest(**ddp, low_precision="te-fp8"))
    elements = 4 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 688)
    assert te.per_device.resident_bytes - plain.per_device.resident_bytes == 2 * elements


def test_fp8_matmuls_run_at_the_measured_fp8_rate():
    from planner.cluster.gpus import gpu

    g = gpu("h100-80gb")
    r = kernels.rates(g, "bf16")
    assert kernels.rates(g, "fp8").matmul_flops / r.matmul_flops == pytest.approx(1402.6 / 794.5)
    arch = __import__("planner.model.catalogue", fromlist=["x"]).model_from_config(LLAMA).architecture
    lp = kernels.LowPrecisionRate(1402.6 / 794.5, 16, 33.0)
    w = kernels.work(arch, 1024, 1, 1, False, 2, False, r, low_precision=lp)
    assert [g.rate for g in w.gemms[:-1]] == [lp.rate] * (len(w.gemms) - 1) and w.gemms[-1].rate == 1.0
    base = estimate_with_time(EstimateRequest(**LP)).time
    f8 = estimate_with_time(EstimateRequest(**LP, low_precision="float8-tensorwise")).time
    matmul = {x.name: x.seconds for x in base.terms}["matmul"], {x.name: x.seconds for x in f8.terms}["matmul"]
    assert matmul[1] < matmul[0]
    assert any("unverified" in n and "torchao 0.18" in n for n in estimate(
        EstimateRequest(**LP, low_precision="float8-tensorwise")).notes)


@pytest.mark.parametrize("name,c,expected", [
    ("float8-tensorwise", 2, 2 + 2 + 2 + 2 + 4 + 4 + 4 + 4 + 4 + 4 + 1),  # abs, max, to fp32, * scale, clamp, to fp8
    ("float8-rowwise", 4, 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 1),  # fp32 input: .to(float32) copies nothing
    ("mxfp8", 2, 2 + 2 + 1),  # a fused quantize kernel: amax read, convert read, fp8 write
    ("nvfp4", 2, 2 + 2 + 0.5),
])
def test_a_cast_moves_what_its_kernels_move(name, c, expected):
    from planner.recipes.low_precision import cast_bytes_per_element

    assert cast_bytes_per_element(RECIPES[name], c) == expected
    # under torch.compile inductor fuses torchao's chain: the amax read, the convert read, the narrow write
    assert cast_bytes_per_element(RECIPES[name], c, compiled=True) == 2 * c + RECIPES[name].element_bits / 8


def test_a_compiled_float8_step_charges_fused_casts():
    from planner.schema import EstimateRequest as Request

    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", seq_len=4096,
                  low_precision="float8-tensorwise", compile="blocks")
    terms = {c: {t.name: t.seconds for t in estimate_with_time(Request(**(fields | {"compile": c}))).time.terms}
             for c in ("none", "blocks")}
    bf16 = {t.name: t.seconds for t in estimate_with_time(Request(**(fields | {"low_precision": "none"}))).time.terms}
    # compiled float8 still casts (more elementwise than compiled bf16), far less than eager float8's chain
    assert bf16["elementwise and loss"] < terms["blocks"]["elementwise and loss"] < terms["none"]["elementwise and loss"]
    assert terms["blocks"]["matmul"] < bf16["matmul"]


def test_float8_step_charges_the_eager_casts_of_every_converted_call():
    r = kernels.rates(__import__("planner.cluster.gpus", fromlist=["gpu"]).gpu("h100-80gb"), "bf16")
    arch = __import__("planner.model.catalogue", fromlist=["x"]).model_from_config(LLAMA).architecture
    fused, eager = (kernels.work(arch, 1024, 1, 1, False, 2, False, r,
                                 low_precision=kernels.LowPrecisionRate(1.7, 16, b)) for b in (5.0, 33.0))
    assert eager.cast_bytes == pytest.approx(fused.cast_bytes * 33 / 5) and eager.cast_bytes > 0
    assert eager.weight_cast_bytes == pytest.approx(fused.weight_cast_bytes * 33 / 5)


@pytest.mark.parametrize("fields,words", [
    (dict(gpu="a100-80gb"), "no fp8 rate"),
    (dict(low_precision="mxfp8"), "Blackwell"),
    (dict(low_precision="nvfp4", gpu="rtx-4090"), "Blackwell"),
    (dict(precision="fp32"), "16-bit inputs"),
    (dict(finetune="lora"), "finetune=lora"),
    (dict(strategy="zero3"), "torch strategy"),
    (dict(low_precision="te-fp8"), "parameter sharding"),
    (dict(gpus=4, tp=2), "tp=2"),
    (dict(gpu="cpu"), "gpu cpu"),
    (dict(low_precision="nvfp4", gpu="b200", checkpointing="selective-op"), "selective"),
])
def test_low_precision_refusals_name_the_field(fields, words):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**LP | {"low_precision": "float8-tensorwise"} | fields))
    assert err.value.field == "low_precision" and words in str(err.value) and "\n" not in str(err.value)


def test_float8_all_gather_gathers_the_converted_weights_in_fp8():
    """FSDP2's float8 all-gather (torchao fsdp_utils.py fsdp_pre_all_gather gathers the fp8 _data):
    a block's converted weights take 1 byte in the all-gather buffers and on the wire."""
    from planner.time.step import collective_volumes

    fsdp = LP | {"gpus": 4, "low_precision": "float8-tensorwise", "micro_batch": 2}
    converted = 256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 688  # one block's, all of them
    rows = [{r["what"]: r for r in collective_volumes(EstimateRequest(**fsdp, float8_all_gather=f))} for f in (0, 1)]
    plain, fp8 = rows[0]["parameter all-gathers"], rows[1]["parameter all-gathers (float8 weights in fp8)"]
    assert plain["message_bytes"] - fp8["message_bytes"] == converted
    assert plain["bytes_per_step"] - fp8["bytes_per_step"] == 2 * 4 * converted  # forward and backward, 4 blocks

    def gathered(**fields):
        phases = estimate(EstimateRequest(**fsdp, **fields)).phases
        block = next(p for p in phases if p.name.startswith("start of block 1 backward"))
        return {i.name.split(" (")[0]: i.bytes for i in block.items}

    plain, fp8 = gathered(), gathered(float8_all_gather=True)
    assert plain["prefetched block"] - fp8["prefetched block"] == converted
    assert plain["all-gathered units"] - fp8["all-gathered units"] == converted
    assert any("fp8" in n for n in estimate(EstimateRequest(**fsdp, float8_all_gather=True)).notes)


@pytest.mark.parametrize("fields,words", [
    (dict(low_precision="float8-rowwise"), "tensorwise"),
    (dict(low_precision="none"), "tensorwise"),
    (dict(strategy="ddp"), "FSDP2"),
    (dict(strategy="fsdp-grad-op"), "kept through"),
])
def test_float8_all_gather_refusals_name_the_field(fields, words):
    with pytest.raises(PlannerError) as err:
        estimate(EstimateRequest(**LP | {"low_precision": "float8-tensorwise", "float8_all_gather": True} | fields))
    assert err.value.field == "float8_all_gather" and words in str(err.value) and "\n" not in str(err.value)


# --- job files ------------------------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "jobfiles"


@pytest.mark.parametrize("files,overrides,field,value", [
    (("trl/example_config.yaml",), {"use_liger_kernel": True}, "loss", "liger-fused"),
    (("llamafactory/llama3_full_sft.yaml", "llamafactory/ds_z3_config.json"), {"enable_liger_kernel": True},
     "loss", "liger-fused"),
    (("axolotl/lora-8b.yml",), {"cut_cross_entropy": True}, "loss", "cce"),
    (("axolotl/lora-8b.yml",), {"liger_fused_linear_cross_entropy": True}, "loss", "liger-fused"),
    (("torchtitan/llama3_8b.toml",), {"model.converters": ["float8"], "float8.recipe_name": "rowwise"},
     "low_precision", "float8-rowwise"),
    (("torchtitan/llama3_8b.toml",), {"float8.enable_fsdp_float8_all_gather": True, "model.converters": ["float8"]},
     "float8_all_gather", True),
])
def test_job_files_turn_the_kernels_on(files, overrides, field, value):
    body = CheckRequest(files=[{"name": Path(f).name, "text": (FIXTURES / f).read_text()} for f in files],
                        overrides=overrides, gpus=8, gpu="h100-80gb")
    job, request = job_request(body)
    assert getattr(request, field) == value and next(iter(overrides)) in job.origin[field]


# --- the plan asked with the recipe -----------------------------------------------------------------

PLAN = dict(model_config=LLAMA_32K, gpus=4, gpu="h100-80gb", seq_len=2048, global_batch=8)


def test_plan_evaluates_every_candidate_with_the_recipe():
    result = plan(PlanRequest(**PLAN, loss="liger-fused", checkpointing="selective-op", low_precision="float8-rowwise"))
    assert result.candidates and all(c.checkpointing == "selective-op" for c in result.candidates)
    assert all(c.parallel.tp == c.parallel.pp == c.parallel.cp == 1 for c in result.candidates)
    best = result.recommended
    one = estimate(EstimateRequest(model_config=LLAMA_32K, gpus=4, gpu="h100-80gb", seq_len=2048,
                                   strategy=best.strategy, micro_batch=best.micro_batch,
                                   gradient_accumulation=best.gradient_accumulation, checkpointing="selective-op",
                                   offload_optimizer=best.offload_optimizer, offload_params=best.offload_params,
                                   loss="liger-fused", low_precision="float8-rowwise"))
    assert best.per_device.peak_bytes == one.per_device.peak_bytes


def test_plan_vocab_parallel_searches_tensor_parallel_layouts_only():
    result = plan(PlanRequest(**PLAN, loss="vocab-parallel"))
    assert result.candidates and all(c.parallel.tp > 1 for c in result.candidates)


def test_plan_refuses_a_recipe_no_layout_or_gpu_can_take():
    with pytest.raises(PlannerError) as err:
        plan(PlanRequest(**PLAN, loss="chunked", tp=2))
    assert err.value.field == "loss"
    with pytest.raises(PlannerError) as err:
        plan(PlanRequest(**PLAN | {"gpu": "a100-80gb"}, low_precision="float8-tensorwise"))
    assert err.value.field == "low_precision"


def test_plan_request_has_every_recipe_field():
    recipe = {"checkpointing", "checkpointing_every", "keeps_outputs", "loss", "loss_chunks", "double_quant",
              "low_precision"}
    assert recipe <= set(PlanRequest.model_fields)
    with pytest.raises(ValueError, match="checkpointing_every=2 applies to checkpointing=full"):
        PlanRequest(**PLAN, checkpointing_every=2)
    with pytest.raises(ValueError, match="double_quant"):
        PlanRequest(**PLAN, finetune="lora", double_quant=False)


def test_plan_carries_double_quant_into_qlora_candidates():
    on = plan(PlanRequest(**PLAN | {"gpus": 1, "global_batch": 2}, finetune="qlora"))
    off = plan(PlanRequest(**PLAN | {"gpus": 1, "global_batch": 2}, finetune="qlora", double_quant=False))
    # without double quantization the absmax constants stay fp32: more frozen bytes
    assert off.recommended.per_device.frozen_weights_bytes > on.recommended.per_device.frozen_weights_bytes


def test_emit_turns_liger_on_and_refuses_what_its_configs_cannot_say():
    import json

    from planner.plan.emit import emit_estimate_files

    base = dict(model_config=LLAMA_32K, gpus=2, gpu="h100-80gb", seq_len=1024)
    files = emit_estimate_files(estimate(EstimateRequest(**base, strategy="zero2", loss="liger-fused")))
    assert json.loads(files["trainer_args.json"])["use_liger_kernel"] is True
    assert "use_liger_kernel" not in json.loads(emit_estimate_files(estimate(EstimateRequest(
        **base, strategy="zero2")))["trainer_args.json"])
    for field, value in (("loss", "cce"), ("low_precision", "float8-rowwise")):
        with pytest.raises(PlannerError) as err:
            emit_estimate_files(estimate(EstimateRequest(**base, strategy="fsdp", **{field: value})))
        assert err.value.field == field and "training script" in str(err.value)
