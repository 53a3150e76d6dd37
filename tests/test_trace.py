"""Any causal LM: a model_type without an analytic reader is counted on the meta device and
traced on fake tensors (backend/trace.py), and the trace feeds the same phase model.

The tracer is checked against the analytic model on llama, the family the accuracy suite pins to
real runs within 0.5%: where both exist they must agree, so the trace of a family the core cannot
read is as trustworthy as the machinery it shares."""

import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from backend.anymodel import estimate_any  # noqa: E402
from backend.trace import count_parameters, trace_profile  # noqa: E402
from cli.main import main  # noqa: E402
from planner.model.activations import estimate_activations  # noqa: E402
from planner.model.architecture import from_hf_config  # noqa: E402
from planner.model.catalogue import traced_model  # noqa: E402
from planner.memory.orchestrator import estimate  # noqa: E402
from planner.schema import EstimateRequest  # noqa: E402

TINY_LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
# Model types transformers 5 builds offline from a config alone and the analytic core has no reader for.
TINY_OTHERS = {
    "starcoder2": {"model_type": "starcoder2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
                   "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2},
    "granite": {"model_type": "granite", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
                "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2},
    "stablelm": {"model_type": "stablelm", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
                 "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2},
}


def _transformers_count(config):
    fields = dict(config)
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    return sum(p.numel() for p in model.parameters()), [p.numel() for p in model.parameters()]


@pytest.mark.parametrize("model_type", sorted(TINY_OTHERS))
def test_parameter_count_is_transformers_own(model_type):
    count = count_parameters(TINY_OTHERS[model_type])
    total, numels = _transformers_count(TINY_OTHERS[model_type])
    assert count.parameters == total and list(count.numels) == numels
    assert count.num_layers == TINY_OTHERS[model_type]["num_hidden_layers"]


@pytest.mark.parametrize("compute,checkpointing", [("bf16", "none"), ("bf16", "full"), ("fp32", "none"),
                                                   ("fp32", "full")])
def test_traced_llama_activations_agree_with_the_analytic_model(compute, checkpointing):
    profile = trace_profile(TINY_LLAMA, micro_batch=2, seq_len=128, compute=compute, attention="sdpa",
                            checkpointing=checkpointing)
    analytic = estimate_activations(from_hf_config(TINY_LLAMA), micro_batch=2, seq_len=128,
                                    compute_bytes=2 if compute == "bf16" else 4, attention="sdpa",
                                    checkpointing=checkpointing, device="cpu")
    # everything saved at the end of the forward: the same to within the int64 labels' rounding
    assert profile.saved_bytes == pytest.approx(analytic.saved_bytes, rel=1e-3)
    # what a block keeps: its input under checkpointing, exactly; its saved set (the first block
    # also keeps its bf16 input, which the analytic model books to the embeddings) within 2%
    assert profile.layer_kept_bytes == pytest.approx(analytic.layer_kept_bytes, rel=0.02)
    assert profile.loss_transient_bytes == pytest.approx(analytic.loss_transient_bytes, rel=1e-3)
    assert profile.parameters == 4_999_424 and profile.late_parameters == 4096 * 256


@pytest.mark.parametrize("strategy,checkpointing", [("zero3", "none"), ("zero2", "none"), ("zero1", "full"),
                                                    ("ddp", "full"), ("fsdp", "none")])
def test_traced_llama_estimate_equals_the_analytic_one(strategy, checkpointing):
    request = EstimateRequest(model_config=TINY_LLAMA, strategy=strategy, gpus=2, gpu="cpu", micro_batch=2,
                              seq_len=128, checkpointing=checkpointing, reduce_bucket_size=200_000)
    profile = trace_profile(TINY_LLAMA, micro_batch=2, seq_len=128, compute="bf16", attention="sdpa",
                            checkpointing=checkpointing)
    analytic = estimate(request)
    traced = estimate(request, model=traced_model("tiny", "test", profile))
    assert traced.parameters == analytic.parameters
    assert traced.per_device.resident_bytes == analytic.per_device.resident_bytes
    assert traced.per_device.peak_bytes == pytest.approx(analytic.per_device.peak_bytes, rel=0.01)
    assert any(n.startswith("traced: model_type 'llama'") for n in traced.notes)


def test_a_traced_model_drives_the_allocator_replay_as_the_analytic_one_does():
    """The trace's per-parameter numels and its [micro_batch, seq_len, hidden] tensor size cut the
    step into the same tensors the analytic model's replay allocates (issue 24): the same
    activation tensors, and reserved peaks within 2% (the phases differ by the trace's rounding)."""
    from planner.memory import reserved
    from planner.memory.orchestrator import resolve

    request = EstimateRequest(model_config=TINY_LLAMA, strategy="fsdp", gpus=8, gpu="h100-80gb", micro_batch=2,
                              seq_len=128)
    profile = trace_profile(TINY_LLAMA, micro_batch=2, seq_len=128, compute="bf16", attention="sdpa",
                            checkpointing="none")
    assert profile.hidden_state_bytes == 2 * 128 * 256 * 2
    model = traced_model("tiny", "test", profile)
    assert reserved._activation_unit(resolve(request, model=model)) == reserved._activation_unit(resolve(request))
    analytic, traced = estimate(request), estimate(request, model=model)
    assert traced.allocator.reserved_peak_bytes == pytest.approx(analytic.allocator.reserved_peak_bytes, rel=0.02)
    assert traced.allocator.segments_peak == pytest.approx(analytic.allocator.segments_peak, rel=0.1)


def test_a_model_type_without_a_reader_is_traced_through_the_same_memory_model():
    config = TINY_OTHERS["starcoder2"]
    result = estimate_any(EstimateRequest(model_config={"name": "sc2", "config": config}, strategy="zero3",
                                          gpus=2, gpu="cpu", micro_batch=2, seq_len=128))
    assert result.parameters == _transformers_count(config)[0]
    assert result.model.architecture is None and result.time is None
    assert result.per_device.activations_bytes > 0
    names = [p.name for p in result.phases]
    assert "start of backward" in names and "optimizer step" in names
    notes = "\n".join(result.notes)
    assert "traced: model_type 'starcoder2' has no analytic reader" in notes
    assert "traced, assumed: transformers" in notes and "Starcoder2DecoderLayer x 3" in notes
    assert "time model" not in notes  # CPU ranks: no time model, traced or not


def test_a_traced_model_is_timed_from_its_parameter_count():
    from backend.anymodel import estimate_any
    from planner.time import variation
    from planner.time.step import SLOWEST_GPU_TERM, TracedShape, estimate_time
    from planner.time.collectives import matmul_parameters

    request = EstimateRequest(model_config=TINY_LLAMA, strategy="zero3", gpus=8, gpu="h100-80gb", micro_batch=2,
                              seq_len=128)
    profile = trace_profile(TINY_LLAMA, micro_batch=2, seq_len=128, compute="bf16", attention="sdpa",
                            checkpointing="none")
    analytic = estimate_any(request)
    result = estimate(request, model=traced_model("tiny", "test", profile))
    shape = TracedShape.of(profile)
    traced = estimate_time(result.request, result, traced=shape)
    # the matmul weights are the analytic model's (everything but the untied embedding lookup);
    # a traced model has no layer shapes, so its 6 FLOPs per matmul parameter and token (forward,
    # input and weight gradients) run at the H100's measured matmul rate (MAMF 794.5 TFLOP/s), the
    # attention scores and elementwise work left out: 2 x 128 tokens on each GPU
    a = from_hf_config(TINY_LLAMA)
    assert shape.matmul_parameters == matmul_parameters(a)
    matmul = next(t.seconds for t in traced.terms if t.name == "matmul")
    # the traced FLOPs at the H100's sustained rate (gpus.yaml sustained_tflops: 703.7), below its burst MAMF 794.5
    assert matmul == pytest.approx(2 * 128 * 6 * shape.matmul_parameters / 703.7e12, rel=1e-9)
    # beside it only the SMs ZeRO-3's hidden collectives hold (planner/time/collectives.py contention) and the
    # slowest of the 8 GPUs' longer GEMMs (planner/time/variation.py)
    slowest = next(t.seconds for t in traced.terms if t.name == SLOWEST_GPU_TERM)
    assert slowest == pytest.approx(matmul * variation.slowest_share(8), rel=1e-9)
    assert traced.compute_seconds == pytest.approx(matmul + slowest + sum(t.seconds for t in traced.terms
                                                                          if t.name == "communication contention"),
                                                   rel=1e-9)
    assert traced.compute_seconds < analytic.time.compute_seconds
    assert traced.communication_seconds == pytest.approx(analytic.time.communication_seconds, rel=1e-9)
    starcoder = estimate_any(EstimateRequest(model_config={"name": "sc2", "config": TINY_OTHERS["starcoder2"]},
                                             strategy="zero3", gpus=2, gpu="rtx-4090", micro_batch=1, seq_len=128))
    assert starcoder.time is not None and starcoder.time.step_seconds > 0
    assert any(n.startswith("time model (traced): forward FLOPs per token 2 x") for n in starcoder.notes)


def test_cli_estimate_of_a_model_file_without_a_reader(tmp_path, capsys):
    import json

    path = tmp_path / "granite.json"
    path.write_text(json.dumps(TINY_OTHERS["granite"]))
    code = main(["estimate", "--model-file", str(path), "--strategy", "zero2", "--gpus", "2", "--gpu", "cpu",
                 "--micro-batch", "1", "--seq-len", "64"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "granite: " in out.out and "note: traced: model_type 'granite'" in out.out
    assert "Warning" not in out.err and "bos_token_id" not in out.err


@pytest.mark.parametrize("flag", ["--tp", "--pp", "--cp", "--ep"])
def test_a_traced_model_refuses_model_parallel_degrees_naming_the_trace(tmp_path, capsys, flag):
    """The user gave the architecture (--model-file): the refusal says the model is traced, not that a
    parameter count was given, and names the degree."""
    import json

    path = tmp_path / "granite.json"
    path.write_text(json.dumps(TINY_OTHERS["granite"]))
    code = main(["estimate", "--model-file", str(path), "--strategy", "fsdp", "--gpus", "8", "--gpu", "h100-80gb",
                 "--micro-batch", "1", "--seq-len", "64", flag, "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"{flag.lstrip('-')}=2: granite is traced" in err and "parameter count" not in err


def test_plan_of_a_model_without_a_reader_is_refused_naming_estimate(tmp_path, capsys):
    import json

    path = tmp_path / "sc2.json"
    path.write_text(json.dumps(TINY_OTHERS["starcoder2"]))
    code = main(["plan", "--model-file", str(path), "--gpu", "rtx-4090", "--gpus", "2", "--global-batch", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "model_type 'starcoder2' has no analytic reader" in err and "`planner estimate` traces it" in err


def test_without_the_backend_extra_the_extra_is_named(tmp_path, capsys, monkeypatch):
    import json

    path = tmp_path / "sc2.json"
    path.write_text(json.dumps(dict(TINY_OTHERS["starcoder2"], num_hidden_layers=1)))  # not in the trace cache
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    code = main(["estimate", "--model-file", str(path), "--gpu", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "needs the backend extra (torch and transformers): pip install -e '.[backend]'" in err


def test_an_unknown_model_type_is_one_line():
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match="transformers .* cannot build model_type 'no-such-type' either"):
        estimate_any(EstimateRequest(model_config={"model_type": "no-such-type", "hidden_size": 8}, gpu="cpu"))


def test_api_traces_and_names_the_extra(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    client = TestClient(create_app(str(tmp_path / "runs.sqlite")))
    body = {"model_config": TINY_OTHERS["stablelm"], "strategy": "zero3", "gpus": 2, "gpu": "cpu",
            "micro_batch": 1, "seq_len": 64}
    r = client.post("/v1/estimate", json=body)
    assert r.status_code == 200, r.text
    assert any(n.startswith("traced: model_type 'stablelm'") for n in r.json()["notes"])
    monkeypatch.setitem(sys.modules, "torch", None)
    body["model_config"] = dict(TINY_OTHERS["stablelm"], num_hidden_layers=1)  # not in the trace cache
    r = client.post("/v1/estimate", json=body)
    assert r.status_code == 422 and "pip install -e '.[backend]'" in r.json()["detail"][0]["msg"]


def test_moe_without_a_reader_is_traced_independent_of_routing():
    config = {"model_type": "olmoe", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2}
    profile = trace_profile(config, micro_batch=1, seq_len=32, compute="bf16", attention="sdpa", checkpointing="none")
    assert profile.parameters == _transformers_count(config)[0]
    assert any("MoE experts as OlmoeExperts" in a and "do not depend on how the router" in a
               for a in profile.assumptions)
    again = trace_profile(config, micro_batch=1, seq_len=32, compute="bf16", attention="sdpa", checkpointing="none")
    assert again.saved_bytes == profile.saved_bytes


def test_a_family_without_sdpa_is_traced_with_what_will_run():
    config = {"model_type": "bloom", "vocab_size": 1024, "hidden_size": 128, "n_layer": 2, "n_head": 4}
    profile = trace_profile(config, micro_batch=1, seq_len=32, compute="bf16", attention="sdpa", checkpointing="none")
    assert any("no SDPA path for model_type 'bloom': traced with eager attention" in a for a in profile.assumptions)
    assert profile.setting.endswith("sdpa attention, checkpointing none")  # what was asked, answered with a note


def test_a_config_that_fails_inside_transformers_is_one_line(tmp_path, capsys):
    import json

    path = tmp_path / "olmoe.json"  # num_experts_per_tok defaults to 8, more than its 4 experts
    path.write_text(json.dumps({"model_type": "olmoe", "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 256, "num_experts": 4}))
    code = main(["estimate", "--model-file", str(path), "--gpu", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "model_type 'olmoe': one training step of this config fails in transformers" in err
    assert "k not in range" in err and "Traceback" not in err


def test_too_deep_to_trace_is_refused_before_building():
    from planner.errors import PlannerError

    config = dict(TINY_OTHERS["starcoder2"], num_hidden_layers=5000)
    with pytest.raises(PlannerError, match=r"num_hidden_layers\(5000\) is more than a trace walks \(limit 256\)"):
        count_parameters(config)


def test_traced_real_size_llama_equals_the_analytic_estimate():
    """Llama-3.2-1B at its real size (16 blocks, vocabulary 128k, 2k tokens): the trace of the
    catalogue entry and the analytic estimate agree on the peak to 0.01% and on resident exactly."""
    from planner.model.catalogue import load_catalogue

    config = dict(load_catalogue()["llama-3.2-1b"].config)
    request = EstimateRequest(model="llama-3.2-1b", strategy="zero3", gpus=8, gpu="h100-80gb", seq_len=2048)
    profile = trace_profile(config, micro_batch=1, seq_len=2048, compute="bf16", attention="sdpa",
                            checkpointing="none")
    analytic = estimate(request)
    traced = estimate(request, model=traced_model("llama-3.2-1b", "test", profile))
    assert traced.parameters == analytic.parameters == 1_235_814_400
    assert traced.per_device.resident_bytes == analytic.per_device.resident_bytes
    assert traced.per_device.peak_bytes == pytest.approx(analytic.per_device.peak_bytes, rel=1e-4)


def test_a_repeated_traced_estimate_is_answered_from_the_cache(monkeypatch):
    import backend.trace as trace

    request = EstimateRequest(model_config=dict(TINY_OTHERS["granite"], num_hidden_layers=2), gpu="cpu", seq_len=32)
    first = estimate_any(request)
    monkeypatch.setattr(trace, "_run", lambda *a, **k: pytest.fail("traced again"))
    assert estimate_any(request) == first


@pytest.mark.parametrize("model_type,checkpointing", [("starcoder2", False), ("granite", True)])
def test_fake_tensors_trace_what_real_tensors_allocate(model_type, checkpointing):
    """The same step on real CPU tensors, under the same tracker: fake tensors change nothing."""
    from backend.trace import _hf_config, _run

    config = TINY_OTHERS[model_type]
    hf = _hf_config(transformers, config, model_type)
    kwargs = dict(micro_batch=2, seq_len=64, dtype=torch.bfloat16, attention="sdpa", checkpointing=checkpointing,
                  blocks_path="model.layers")
    torch.manual_seed(0)
    assert _run(torch, transformers, hf, fake=True, **kwargs) == _run(torch, transformers, hf, fake=False, **kwargs)
