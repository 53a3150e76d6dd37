"""Where features meet: what one part writes, another reads back the same (emitted files and
DeepSpeed configs round-trip through estimate; a verify launch names its devices; traced models
are refused where only analytic ones run; FSDP units of mixed stacks are their biggest block)."""

import json

import pytest

from cli.main import main
from planner.model.architecture import block_parameters, from_hf_config
from planner.plan.emit import emit_estimate_files, estimate_request_for
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate
from planner.plan.search import plan
from planner.schema import EstimateRequest, PlanRequest
from tests.real_runs import LLAMA, LLAMA4


def _peak(request: EstimateRequest) -> int:
    return estimate(request).per_device.peak_bytes


def test_a_plans_emitted_request_keeps_the_network_it_was_planned_on():
    req = PlanRequest(model="llama-3-8b", nodes=2, fabric="eth-25g", nics_per_node=1)
    result = plan(req)
    emitted = estimate_request_for(req, result.recommended)
    assert (emitted.fabric, emitted.nics_per_node) == ("eth-25g", 1)


@pytest.mark.parametrize("strategy,precision", [("zero1", "fp32"), ("zero2", "bf16-mixed"), ("zero3", "fp32"),
                                                ("zero0", "fp16-mixed")])
def test_an_emitted_ds_config_estimates_as_the_request_it_came_from(strategy, precision):
    """`estimate --ds-config` of an emitted ds_config.json, without --strategy or --precision,
    is the same configuration: the stage names the strategy, no bf16/fp16 block means fp32."""
    request = EstimateRequest(model="llama-3-8b", strategy=strategy, precision=precision, micro_batch=2,
                              gradient_accumulation=4)
    files = emit_estimate_files(estimate(request))
    read_back = EstimateRequest(model="llama-3-8b", ds_config=json.loads(files["ds_config.json"]))
    assert read_back.strategy == strategy
    assert _peak(read_back) == _peak(request)
    assert estimate(read_back).request.precision == precision


def test_an_explicit_strategy_must_agree_with_the_config_stage():
    with pytest.raises(PlannerError, match=r"strategy zero3 contradicts ds_config zero_optimization.stage\(1\)"):
        estimate(EstimateRequest(model="gpt2", strategy="zero3", ds_config={"zero_optimization": {"stage": 1}}))


@pytest.mark.parametrize("argv,missing", [
    (["--gpus", "2"], "--gpu"), (["--gpu", "cpu"], "--gpus"), ([], "--gpu and --gpus")])
def test_verify_needs_the_devices_it_launches_on(capsys, tmp_path, argv, missing):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(LLAMA))
    code = main(["verify", "--model-file", str(config), "--strategy", "zero2", "--db", str(tmp_path / "r.sqlite"),
                 *argv])
    err = capsys.readouterr().err
    assert code == 2 and f"give {missing} (the devices of this machine" in err
    assert not (tmp_path / "r.sqlite").exists()  # refused before anything is recorded or launched


@pytest.mark.parametrize("outcome", ["refused", "interrupted"])
def test_an_in_process_verify_gives_the_callers_signal_handlers_back(monkeypatch, capsys, tmp_path, outcome):
    """main(["verify", ...]) from Python turns SIGTERM/SIGHUP into an interrupted run only while the
    run lasts: a handler left behind would raise into whatever the caller did next."""
    import signal

    import backend.verify

    mine = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGHUP)}
    during = []

    def fake_verify(request, **_):
        during.append({sig: signal.getsignal(sig) for sig in mine})
        if outcome == "refused":
            raise PlannerError("another planner verify is running on the same devices", field="gpu")
        return {"status": "interrupted", "message": "interrupted (SIGTERM); all ranks ended"}

    monkeypatch.setattr(backend.verify, "verify", fake_verify)
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(LLAMA))
    try:
        code = main(["verify", "--model-file", str(config), "--strategy", "zero2", "--gpus", "2", "--gpu", "cpu",
                     "--json"])
        after = {sig: signal.getsignal(sig) for sig in mine}
    finally:
        for sig, handler in mine.items():
            signal.signal(sig, handler)
    assert code == {"refused": 2, "interrupted": 130}[outcome], capsys.readouterr().err
    assert all(callable(handler) for handler in during[0].values())  # installed while it ran
    assert after == {signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}


def test_emit_refuses_a_model_it_can_only_trace():
    pytest.importorskip("transformers")
    config = {"model_type": "starcoder2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    from backend.anymodel import estimate_any

    result = estimate_any(EstimateRequest(model_config=config, gpu="cpu", gpus=2, seq_len=64))
    with pytest.raises(PlannerError, match="is estimated by tracing only; --emit writes launch files"):
        emit_estimate_files(result)


def test_an_fsdp_unit_of_a_mixed_stack_is_its_biggest_block():
    """Llama-4 with MoE every other layer: the MoE block, not the mean block, is what FSDP
    gathers and prefetches at once."""
    arch = from_hf_config(LLAMA4)
    blocks = block_parameters(arch)
    assert max(blocks) > sum(blocks) // len(blocks)  # a mixed stack
    result = estimate(EstimateRequest(model_config=LLAMA4, strategy="fsdp", gpu="cpu", gpus=2, precision="fp32",
                                      micro_batch=1, seq_len=64))
    prefetched = [item.bytes for phase in result.phases for item in phase.items
                  if item.name.startswith("prefetched block") and item.bytes]
    assert prefetched and max(prefetched) == 4 * max(blocks) * 2  # fp32, gloo's scratch copy on CPU ranks


def test_an_8bit_optimizer_is_never_emitted_or_probed_as_deepspeeds_fp32_adamw(tmp_path):
    """DeepSpeed's "AdamW" keeps fp32 moments: an adamw-8bit prediction must not be launched or
    emitted as one. The emitted config names no optimizer (the script passes bitsandbytes'
    AdamW8bit as a client optimizer) and the planner's own probe refuses to stand in for it."""
    request = EstimateRequest(model="gpt2", strategy="zero2", optimizer="adamw-8bit", gpu="cpu", gpus=2, seq_len=512)
    files = emit_estimate_files(estimate(request))
    assert "optimizer" not in json.loads(files["ds_config.json"])
    assert "launch.sh" not in files and "adamw-8bit" in files["LAUNCH.md"]
    pytest.importorskip("torch")
    from backend.launch import worker_job

    with pytest.raises(PlannerError, match="optimizer adamw-8bit with strategy zero2, pp=1: the probe trains adamw, sgd, sgd-momentum there"):
        worker_job(request, steps=1, warmup_steps=0, out_dir=tmp_path)


def test_a_sequence_past_learned_positions_is_flagged_capped_and_refused_by_verify(tmp_path):
    """GPT-2's position table has n_positions rows: a longer sequence is an index error in a real
    run (verify's ranks crashed with 'index out of range in self'). The estimate answers with a
    warning, the plan warns and caps its longest-sequence answer, verify refuses before launching."""
    from backend.launch import worker_job

    long = EstimateRequest(model="gpt2", gpu="cpu", gpus=2, strategy="zero2", seq_len=2048)
    warning = "seq_len(2048) exceeds the 1024 positions of gpt2's learned position embeddings"
    assert any(n.startswith("WARNING: " + warning) for n in estimate(long).notes)
    assert not any(n.startswith("WARNING") for n in estimate(long.model_copy(update={"seq_len": 1024})).notes)
    assert not any(n.startswith("WARNING") for n in estimate(EstimateRequest(model="llama-3.2-1b", seq_len=262_144)).notes)
    with pytest.raises(PlannerError, match=r"seq_len\(2048\) exceeds the 1024 positions") as refused:
        worker_job(long, steps=1, warmup_steps=0, out_dir=tmp_path)
    assert refused.value.field == "seq_len"
    planned = plan(PlanRequest(model="gpt2", gpu="a100-80gb", gpus=2, global_batch=8, seq_len=2048))
    assert planned.notes[0].startswith("WARNING: seq_len(2048) exceeds the 1024 positions")
    assert planned.max_seq_len == 1024  # memory would allow far more; the table does not
    short = plan(PlanRequest(model="gpt2", gpu="a100-80gb", gpus=2, global_batch=8, seq_len=512))
    assert short.max_seq_len == 1024 and not short.notes[0].startswith("WARNING")
