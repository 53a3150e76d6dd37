"""Pipeline and expert parallelism through the CLI and the API: the worst stage is what is
reported, and every refusal is one line (exit 2) or one 422 naming its field."""

import json

import pytest

from cli.main import main
from planner.memory.orchestrator import cpu_rank_bytes, estimate
from planner.schema import EstimateRequest
from tests.real_runs import DEEPSEEK_V3, LLAMA

REFUSALS = [
    ({"strategy": "zero2", "pp": 2, "gradient_accumulation": 4}, "pp",
     "pp=2 with strategy zero2: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only; use zero1, "
     "or fsdp (torch pipelining x FSDP2) to shard gradients and parameters"),
    ({"strategy": "zero3", "pp": 2, "gradient_accumulation": 4}, "pp", "pp=2 with strategy zero3: DeepSpeed's"),
    ({"strategy": "zero1", "pp": 2, "pp_schedule": "gpipe", "gradient_accumulation": 4}, "pp_schedule",
     "pp_schedule=gpipe with strategy zero1: DeepSpeed's pipeline engine runs 1F1B only"),
    ({"strategy": "fsdp", "pp": 4, "gradient_accumulation": 2}, "gradient_accumulation",
     "gradient_accumulation(2) micro-batches must be at least pp(4) for pp_schedule 1f1b"),
    ({"strategy": "fsdp", "pp": 2, "pp_schedule": "interleaved", "pp_virtual_stages": 2, "gradient_accumulation": 7},
     "gradient_accumulation", "gradient_accumulation(7) micro-batches must be a multiple of "
     "max(1, gradient_accumulation // pp(2)) = 3 for pp_schedule interleaved"),
    ({"strategy": "zero1", "pp": 2, "gradient_accumulation": 4, "offload_optimizer": "cpu"}, "pp",
     "pp=2 with offload: the pipeline model keeps every state on the device"),
    ({"strategy": "fsdp", "params": 7e9, "model": None, "pp": 2, "gradient_accumulation": 4}, "pp",
     "pp=2 needs an architecture (its layers are split into stages)"),
]


def _flags(fields: dict) -> list[str]:
    out = []
    for key, value in fields.items():
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


@pytest.mark.parametrize("fields, field, message", REFUSALS)
def test_refusals_on_the_cli_are_one_line(fields, field, message, capsys):
    fields = {"model": "llama-3-8b"} | fields
    code = main(["estimate", *_flags(fields)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"planner: error: {message}") and err.count("\n") == 1


@pytest.mark.parametrize("fields, field, message", REFUSALS)
def test_refusals_on_the_api_are_422_naming_the_field(fields, field, message, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    monkeypatch.delenv("PLANNER_API_TOKEN_FILE", raising=False)
    client = TestClient(create_app(str(tmp_path / "runs.sqlite")))
    body = {k: v for k, v in ({"model": "llama-3-8b"} | fields).items() if v is not None}
    r = client.post("/v1/estimate", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["msg"].startswith(message) and detail["loc"] == ["body", field]


def test_verify_refuses_what_the_pipeline_probe_cannot_run():
    from backend.launch import worker_job
    from planner.errors import PlannerError

    base = dict(model_config=LLAMA, gpu="cpu", precision="fp32", micro_batch=2, seq_len=64, gradient_accumulation=4,
                pp=2)
    with pytest.raises(PlannerError, match=r"^pp=2 with strategy ddp over 2 data-parallel ranks: torch 2.13's DDP"):
        worker_job(EstimateRequest(**base, strategy="ddp", gpus=4), steps=1, warmup_steps=0, out_dir=None)
    with pytest.raises(PlannerError, match=r"^pp=2 with strategy zero1: verify runs pipeline stages with torch"):
        worker_job(EstimateRequest(**base, strategy="zero1", gpus=2), steps=1, warmup_steps=0, out_dir=None)
    job = worker_job(EstimateRequest(**base, strategy="fsdp", gpus=4), steps=1, warmup_steps=0, out_dir="x")
    assert job.pipeline.model_dump() == {"pp": 2, "dp": 2, "schedule": "1f1b", "virtual_stages": 1, "first_stage_layers": None,
                                         "last_stage_layers": None, "dp_strategy": "fsdp",
                               "compute_dtype": None, "reduce_dtype": "compute", "optimizer": "adamw", "tp": 1,
                               "sequence_parallel": False}


def test_the_worst_stage_is_reported_and_every_rank_is_noted():
    fields = dict(model_config=LLAMA, strategy="fsdp", gpu="cpu", precision="fp32", gpus=2, micro_batch=2,
                  seq_len=128, gradient_accumulation=4)
    one_f_one_b = estimate(EstimateRequest(**fields, pp=2))
    gpipe = estimate(EstimateRequest(**fields, pp=2, pp_schedule="gpipe"))
    # gpipe holds all 4 micro-batches at the last stage's loss, 1F1B one
    assert gpipe.per_device.peak_bytes > one_f_one_b.per_device.peak_bytes
    assert one_f_one_b.parallel.pp == 2 and one_f_one_b.parallel.dp_shard == 1
    assert any("pipeline rank 1: stages [1]" in n for n in one_f_one_b.notes)
    assert any("bubble 20.0% of the step" in n for n in one_f_one_b.notes)
    # the parameter count of the result is the whole model's, not a stage's
    assert one_f_one_b.parameters == estimate(EstimateRequest(**fields)).parameters


def test_cli_json_carries_the_degrees(capsys):
    code = main(["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--gpus", "8", "--pp", "4",
                 "--gradient-accumulation", "8", "--pp-schedule", "interleaved", "--pp-virtual-stages", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["parallel"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 4, "cp": 1, "ep": 1}
    assert data["per_device"]["peak_phase"].endswith("micro-batches in flight")


def test_expert_parallel_shrinks_replicated_experts_not_sharded_ones():
    fields = dict(model_config=DEEPSEEK_V3, gpu="cpu", precision="bf16-mixed", gpus=4, micro_batch=2, seq_len=128)
    zero1 = estimate(EstimateRequest(**fields, strategy="zero1"))
    zero1_ep = estimate(EstimateRequest(**fields, strategy="zero1", ep=4))
    # ZeRO-1 replicates the 16-bit weights and gradients: each rank keeps a quarter of the experts
    assert zero1_ep.per_device.resident_bytes < zero1.per_device.resident_bytes
    assert zero1_ep.parameters == zero1.parameters and zero1_ep.parallel.ep == 4
    assert any(i.name.startswith("all-to-all send and receive buffers") for p in zero1_ep.phases for i in p.items)
    fsdp = estimate(EstimateRequest(**fields, strategy="fsdp"))
    fsdp_ep = estimate(EstimateRequest(**fields, strategy="fsdp", ep=4))
    # FSDP shards every state over the data-parallel ranks with or without EP (the experts over
    # dp_shard / ep ranks of the expert-data-parallel group): resident unchanged within the router's columns
    assert abs(fsdp_ep.per_device.resident_bytes - fsdp.per_device.resident_bytes) < 0.01 * fsdp.per_device.resident_bytes
    assert cpu_rank_bytes(zero1_ep, 4)[0] > 0


def test_time_has_the_bubble_and_the_all_to_alls():
    from planner.time.step import estimate_time

    base = dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, micro_batch=1, seq_len=4096, gradient_accumulation=8)
    flat = estimate(EstimateRequest(**base))
    piped = estimate(EstimateRequest(**base, pp=2))
    t1, t2 = estimate_time(flat.request, flat), estimate_time(piped.request, piped)
    # the slower stage's share of one replica's compute, stretched by the bubble (pp-1)/(m+pp-1) = 1/9:
    # 16 blocks each, the last also the LM head (2 x vocab x hidden FLOPs per token forward); the
    # replica's compute holds its whole model's optimizer step, sharded over its 4 data-parallel
    # ranks: twice the flat layout's (8 ranks), which the share and the bubble scale with the rest
    from planner.model.catalogue import catalogue_model
    from planner.parallel.pipeline import block_flops

    arch = catalogue_model("llama-3.1-8b").architecture
    blocks, head = block_flops(arch, 4096), 2 * 128256 * 4096
    share = (sum(blocks[16:]) + head) / (sum(blocks) + head)
    assert 0.53 < share < 0.54  # the head is about two blocks' FLOPs
    optimizer = next(term.seconds for term in t1.terms if term.name == "optimizer step")
    # FSDP2's copies: the flat layout copies each unit out twice and its gradients in once per micro-batch
    # (2 x 4 + 4 bytes per parameter, 8 micro-batches), the pipeline once per step (4 + 4: units stay gathered)
    copies = next(term.seconds for term in t1.terms if term.name == "sharding copies")
    replica = t1.compute_seconds - copies + copies * 8 / (12 * 8)
    assert t2.compute_seconds == pytest.approx((replica + optimizer) * share * 9 / 8, rel=1e-9)
    # 4 replicas of 2 stages instead of 8 replicas: tokens per step halve, the step time less than halves
    assert t2.tokens_per_second == pytest.approx(t1.tokens_per_second * t1.step_seconds / t2.step_seconds / 2)
    moe = dict(model="qwen3-30b-a3b", strategy="fsdp", gpus=8, micro_batch=1, seq_len=4096)
    plain, experts = estimate(EstimateRequest(**moe)), estimate(EstimateRequest(**moe, ep=8))
    ta, tb = estimate_time(plain.request, plain), estimate_time(experts.request, experts)
    # at ep = 8 = dp_shard the routed experts (most of the 30B) no longer ring over the
    # data-parallel group (efsdp = 1, planner/parallel/experts.py data_parallel_share): the rings keep the
    # dense share, and the all-to-alls come on top of it
    from planner.model.architecture import Architecture, parameter_numels
    from planner.parallel.experts import data_parallel_share
    from planner.parallel.dims import ParallelDims

    a = Architecture.model_validate(experts.model.architecture)
    share = data_parallel_share(a, ParallelDims(**experts.parallel.model_dump()), sum(parameter_numels(a)))
    assert share < 0.2
    assert tb.exposed_communication_seconds > ta.exposed_communication_seconds * share
    assert tb.communication_seconds > ta.communication_seconds * share


def test_collective_volumes_of_a_pipeline_rank():
    # what backend/train_pipeline.py counts on rank 0 (stage 0) of the PP x FSDP2 run
    from planner.time.step import collective_volumes

    fields = dict(model_config=LLAMA, strategy="fsdp", gpu="cpu", micro_batch=2, seq_len=128, gradient_accumulation=4,
                  pp=2)
    rows = {r["what"]: r["bytes_per_step"] for r in collective_volumes(EstimateRequest(**fields, gpus=4,
                                                                                       precision="bf16-mixed"))}
    stage0 = 4096 * 256 + 2 * 725504  # embedding and two blocks
    assert rows == {"parameter all-gathers": 2 * stage0, "gradient reduce-scatter": 2 * stage0,
                    "send activations (p2p)": 4 * 2 * 128 * 256 * 2}
    rows = {r["what"]: r["bytes_per_step"] for r in collective_volumes(EstimateRequest(
        **fields, gpus=2, precision="fp32", pp_schedule="interleaved", pp_virtual_stages=2))}
    # rank 0 holds stages 0 and 2: sends both outputs forward and stage 2's input gradient back
    assert rows == {"send activations (p2p)": 2 * 4 * 2 * 128 * 256 * 4, "send gradients (p2p)": 4 * 2 * 128 * 256 * 4}


@pytest.mark.parametrize("flag", ["pp", "ep"])
def test_plan_keeps_a_fixed_pipeline_or_expert_degree(flag, capsys):
    # the plan searches pp and ep (issue 12); a degree given explicitly is kept
    code = main(["plan", "--model", "mixtral-8x7b", "--nodes", "2", "--global-batch", "64", f"--{flag}", "2",
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["candidates"] and {c["parallel"][flag] for c in data["candidates"]} == {2}


def test_lora_with_pp_is_refused(capsys):
    # (LoRA on a mixture of experts, so with ep, is refused by the LoRA model itself)
    code = main(["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--finetune", "lora", "--pp", "2",
                 "--gradient-accumulation", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("planner: error: pp=2 with finetune lora:") and err.count("\n") == 1


def test_one_table_says_which_probe_runs_which_family():
    """backend/launch.py keeps one table, family -> probes, and a reason for each probe a listed
    family does not run; a pipeline x tensor-parallel run needs both probes for its family."""
    from backend.launch import FAMILY_PROBES, PROBE_REFUSALS, PROBES, worker_job
    from planner.errors import PlannerError
    from tests.real_runs import OLMO2, QWEN3

    for family, probes in FAMILY_PROBES.items():
        assert set(probes) <= set(PROBES)
        for probe in set(PROBES) - set(probes):
            assert PROBE_REFUSALS[(family, probe)]  # every refusal of a listed family says why
    assert not set(PROBE_REFUSALS) & {(f, p) for f, probes in FAMILY_PROBES.items() for p in probes}
    base = dict(gpu="cpu", precision="fp32", micro_batch=1, seq_len=64, gradient_accumulation=4, pp=2,
                strategy="fsdp", gpus=4)
    with pytest.raises(PlannerError, match=r"^pp=2 x tp=2: the tensor-parallel probe does not run model_type 'olmo2': "
                                           r"its q/k norms span the whole projection") as olmo:
        worker_job(EstimateRequest(**base, model_config=OLMO2, tp=2), steps=1, warmup_steps=0, out_dir="x")
    assert olmo.value.field == "tp"
    with pytest.raises(PlannerError, match=r"model_type 'qwen3': its names are the plan's.*no TP run of it"):
        worker_job(EstimateRequest(**base, model_config=QWEN3, tp=2), steps=1, warmup_steps=0, out_dir="x")
    gpt2 = {"model_type": "gpt2", "vocab_size": 4096, "n_embd": 256, "n_layer": 2, "n_head": 4, "n_positions": 1024}
    with pytest.raises(PlannerError, match=r"^pp=2: the pipeline probe does not run model_type 'gpt2'"):
        worker_job(EstimateRequest(**base, model_config=gpt2), steps=1, warmup_steps=0, out_dir="x")
    job = worker_job(EstimateRequest(**base, model_config=QWEN3), steps=1, warmup_steps=0, out_dir="x")
    assert job.pipeline.tp == 1 and job.pipeline.dp == 2


def test_verify_lays_out_pipeline_stages_over_tensor_parallel_ranks():
    from backend.launch import worker_job
    from tests.real_runs import LLAMA_TP

    base = dict(model_config=LLAMA_TP, gpu="cpu", precision="fp32", micro_batch=1, seq_len=256,
                gradient_accumulation=4, pp=2, tp=2, strategy="fsdp", gpus=4)
    job = worker_job(EstimateRequest(**base), steps=1, warmup_steps=0, out_dir="x")
    assert (job.pipeline.pp, job.pipeline.dp, job.pipeline.tp, job.pipeline.sequence_parallel) == (2, 1, 2, True)
    off = worker_job(EstimateRequest(**base, sequence_parallel=False), steps=1, warmup_steps=0, out_dir="x")
    assert off.pipeline.sequence_parallel is False


def test_collective_volumes_of_a_pipeline_rank_with_tensor_parallelism():
    """Rank 0 of pp 2 x tp 2 (tests/real_runs.py llama-pp2-tp2-1f1b-fp32-sp-t256-m4): its stage's 2 blocks
    x 4 SP all-gathers and reduce-scatters, and the vocab-parallel embedding's, per micro-batch: 36 of
    each, as the counted run measured them (DTensor's funcol calls); the whole model's would be 72."""
    from planner.time.step import collective_volumes
    from tests.real_runs import LLAMA_TP

    fields = dict(model_config=LLAMA_TP, strategy="fsdp", gpu="cpu", gpus=4, micro_batch=1, seq_len=256,
                  gradient_accumulation=4, precision="fp32", pp=2, tp=2)
    rows = {r["what"]: r["bytes_per_step"] for r in collective_volumes(EstimateRequest(**fields))}
    activation = 4 * 256 * 256
    assert rows == {"TP all-gathers (sequence parallel)": 36 * activation,
                    "TP reduce-scatters (sequence parallel)": 36 * activation,
                    "send activations (p2p)": 4 * (activation // 2)}  # 4 micro-batches, the SP-sharded stream
