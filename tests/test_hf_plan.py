"""transformers' own tensor parallelism (tp_plan=transformers, planner/parallel/hf_plan.py): the plans
the planner reads against transformers' configuration classes, the rank's parameters against
transformers' own sharding (from_pretrained(tp_plan="auto") on a fake 2-rank process group, no
collective and no download), the refusals, and the counted collectives."""

from __future__ import annotations

import pytest

from planner.errors import PlannerError
from planner.memory.orchestrator import resolve
from planner.model.architecture import from_hf_config
from planner.parallel.hf_plan import HF_NO_TP_PLAN, HF_TP_NOT_MODELLED, HF_TP_PLANS, hf_tp_collectives
from planner.schema import EstimateRequest
from planner.setup import numels
from tests.real_runs import LLAMA_TP, QWEN3, QWEN3_MOE

MODELLED_STYLES = {"colwise", "rowwise", "replicated_with_grad_allreduce", "embedding_rowwise"}


def _plan_of(model_type: str) -> dict[str, str]:
    from transformers import AutoConfig

    return dict(AutoConfig.for_model(model_type).get_text_config().base_model_tp_plan or {})


@pytest.mark.parametrize("model_type", sorted(HF_TP_PLANS))
def test_each_plan_is_transformers_own(model_type):
    """What the table says each family's plan splits is what its configuration class names."""
    plan, ours = _plan_of(model_type), HF_TP_PLANS[model_type]
    assert set(plan.values()) <= MODELLED_STYLES, plan
    assert ours.attention == (plan.get("layers.*.self_attn.q_proj") == "colwise")
    assert ours.dense_mlp == (plan.get("layers.*.mlp.gate_proj") == "colwise")
    assert ours.shared_experts == any("shared_expert" in key for key in plan)


@pytest.mark.parametrize("model_type", sorted(HF_TP_NOT_MODELLED))
def test_the_plans_not_modelled_use_styles_outside_the_model(model_type):
    assert set(_plan_of(model_type).values()) - MODELLED_STYLES


@pytest.mark.parametrize("model_type", sorted(HF_NO_TP_PLAN))
def test_the_families_without_a_plan_have_none(model_type):
    assert _plan_of(model_type) == {}


def _request(config: dict, **extra) -> EstimateRequest:
    fields = dict(model_config=config, strategy="fsdp", gpus=2, gpu="cpu", tp=2, tp_plan="transformers",
                  precision="fp32", seq_len=256, micro_batch=1) | extra
    return EstimateRequest(**fields)


SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "vocab_size": 1001, "max_position_embeddings": 512}
CASES = {
    "llama untied, odd vocabulary": {"model_type": "llama", "intermediate_size": 97, "tie_word_embeddings": False},
    "qwen3 tied, q/k norms": {"model_type": "qwen3", "intermediate_size": 96, "tie_word_embeddings": True},
    "qwen3_moe: a dense layer split, experts whole": {
        "model_type": "qwen3_moe", "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "mlp_only_layers": [0], "tie_word_embeddings": False},
    "gemma3_text: sliding and global layers, q/k norms": {
        "model_type": "gemma3_text", "intermediate_size": 96, "sliding_window": 64, "tie_word_embeddings": True},
    "mixtral: attention only": {"model_type": "mixtral", "intermediate_size": 48, "num_local_experts": 4,
                                "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "gpt_oss: embedding and head only": {
        "model_type": "gpt_oss", "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 64, "pad_token_id": None, "eos_token_id": None, "tie_word_embeddings": False},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rank_parameters_are_transformers_sharding(name, tmp_path, monkeypatch):
    """Every rank's local parameter elements under from_pretrained(tp_plan="auto") (DTensor shards,
    whole where the plan names nothing) against the planner's rank; the worst rank is the first
    (DTensor gives it ceil(n / tp))."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, AutoModelForCausalLM

    config = SMALL | CASES[name]
    fields = dict(config)
    model_type = fields.pop("model_type")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).save_pretrained(tmp_path)
    local = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            model = AutoModelForCausalLM.from_pretrained(tmp_path, tp_plan="auto")
            local.append(sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()))
        finally:
            dist.destroy_process_group()
    predicted = sum(numels(resolve(_request(config))))
    assert predicted == max(local), (predicted, local)


def test_refusals_name_the_field_and_value():
    with pytest.raises(PlannerError, match="'gpt2' has no tp_plan") as e:
        resolve(_request({"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4}))
    assert e.value.field == "tp_plan"
    with pytest.raises(PlannerError, match=r"tp\(4\) does not divide num_key_value_heads\(2\)") as e:
        resolve(_request(QWEN3, gpus=4, tp=4))
    assert e.value.field == "tp"
    with pytest.raises(PlannerError, match="does not compose DDP with TP") as e:
        resolve(_request(QWEN3, strategy="ddp", gpus=4))
    assert e.value.field == "strategy"
    with pytest.raises(PlannerError, match="tp_plan=transformers with strategy zero2") as e:
        resolve(_request(QWEN3, strategy="zero2"))
    assert e.value.field == "tp_plan"
    with pytest.raises(PlannerError, match="no sequence_parallel style") as e:
        resolve(_request(QWEN3, sequence_parallel=True))
    assert e.value.field == "sequence_parallel"
    with pytest.raises(PlannerError, match="tp_plan=transformers with tp=1") as e:
        resolve(_request(QWEN3, tp=1))
    assert e.value.field == "tp_plan"


def test_the_default_plan_is_torchtitans():
    """tp_plan's default is today's layout: the same setup as before the field existed."""
    request = _request(LLAMA_TP)
    default = resolve(request.model_copy(update={"tp_plan": "torchtitan"}))
    assert EstimateRequest(**{k: v for k, v in request.model_dump().items() if k != "tp_plan"}).tp_plan == "torchtitan"
    assert default.vocab_parallel_loss and default.sequence_parallel


def test_the_gathered_logits_stay_whole_on_each_rank():
    """The rank model keeps the whole vocabulary (its logits are gathered), and the loss is HF's."""
    setup = resolve(_request(LLAMA_TP))
    assert setup.arch.vocab_size == LLAMA_TP["vocab_size"]
    assert not setup.vocab_parallel_loss and not setup.sequence_parallel
    assert setup.arch.num_attention_heads == LLAMA_TP["num_attention_heads"] // 2


def test_collectives_as_counted_on_cpu_ranks():
    """llama, 4 blocks, tp 2, fp32, 1,024 tokens: 30 all-reduces of tokens x hidden and one all-gather
    of the whole logits per step (the backend's DTensor counter on llama-v32k-tp2-hfplan-fp32-t1024:
    30x 31.46 MB, 1x 131.07 MB)."""
    arch = from_hf_config(dict(LLAMA_TP, vocab_size=32_000))
    rows = hf_tp_collectives(arch, tokens=1024, micro_batches=1, b=4, stream_bytes=4, tp=2, checkpointing="none")
    assert [int(v) for _, v, _, _ in rows] == [30 * 1024 * 256 * 4, 1024 * 32_000 * 4]


def test_collectives_under_autocast_and_qk_norms():
    """qwen3, bf16-mixed: the rowwise outputs in bf16, the embedding and the colwise input gradients
    in fp32 (the stream's dtype), the q/k norms' gradients (counted: 8 x 256 bytes); measured on
    qwen3-v32k-tp2-hfplan-bf16-t1024: 27.26 MB of all-reduces, 65.54 MB of logits."""
    arch = from_hf_config(dict(QWEN3, vocab_size=32_000))
    rows = hf_tp_collectives(arch, tokens=1024, micro_batches=1, b=2, stream_bytes=4, tp=2, checkpointing="none")
    assert [int(v) for _, v, _, _ in rows] == [8 * 1024 * 256 * 2 + 22 * 1024 * 256 * 4, 1024 * 32_000 * 2, 8 * 64 * 4]


def test_moe_experts_stay_whole():
    arch = resolve(_request(QWEN3_MOE)).arch
    full = from_hf_config(QWEN3_MOE)
    assert [s.mlp for s in arch.layers] == [s.mlp for s in full.layers]


def test_emit_writes_the_loader_and_a_plan_that_launches_transformers_tp(tmp_path):
    """--emit for a transformers-TP estimate: load_model.py loads with tp_plan="auto" (it compiles, and
    names the recipe's dtype), no torchtitan.toml (not torchtitan's layout), and plan.json reads back
    into the verify job that loads it the same way (backend/hf_tensor_parallel.py)."""
    import json
    from pathlib import Path

    from backend.launch import worker_job
    from planner.memory.orchestrator import estimate
    from planner.plan.emit import emit_estimate_files

    request = _request(dict(QWEN3, vocab_size=32_000), precision="bf16-mixed", gpu="h100-80gb")
    files = emit_estimate_files(estimate(request))
    assert "torchtitan.toml" not in files
    loader = files["load_model.py"]
    compile(loader, "load_model.py", "exec")
    assert 'tp_plan="auto", dtype=torch.float32)' in loader and "torch.autocast(dtype=torch.bfloat16)" in loader
    back = EstimateRequest.model_validate(json.loads(files["plan.json"])["estimate_request"])
    assert back.tp_plan == "transformers" and back.tp == 2
    job = worker_job(back.model_copy(update={"gpu": "cpu"}), steps=1, warmup_steps=0, out_dir=Path(tmp_path))
    assert job.parallel.tp_plan == "transformers" and job.parallel.tp == 2 and job.parallel.dp_shard == 1


def test_the_probe_runs_transformers_tp_with_fsdp2_as_transformers_composes_it(tmp_path):
    """4 ranks, tp 2: the probe loads over a (dp_shard 2, tp 2) mesh (backend/hf_tensor_parallel.py
    _distribution: DistributedConfig(tp_size, fsdp_size)), in fp32; the mixed recipe is refused
    naming precision."""
    from pathlib import Path

    from backend.launch import worker_job

    job = worker_job(_request(LLAMA_TP, gpus=4), steps=1, warmup_steps=0, out_dir=Path(tmp_path))
    assert job.parallel.tp == 2 and job.parallel.dp_shard == 2 and job.parallel.tp_plan == "transformers"
    with pytest.raises(PlannerError, match="fp32 only") as e:
        worker_job(_request(LLAMA_TP, gpus=4, precision="bf16-mixed"), steps=1, warmup_steps=0, out_dir=Path(tmp_path))
    assert e.value.field == "precision"


def test_transformers_fsdp_plan_keeps_the_head_unit_and_frees_the_embedding():
    """transformers 5.25's fsdp plan under its own TP: at the loss the final norm and LM head's unit
    is gathered (kept from the forward), the embedding is not (its own unit, resharded), and no block
    is prefetched yet (the loss runs outside every unit); measured to the byte on 4 CPU ranks
    (llama-v32k-tp2-fsdp2-hfplan-fp32-t1024, whose prediction before this was 19.5 MB over)."""
    from planner.memory.orchestrator import estimate

    e = estimate(_request(dict(LLAMA_TP, vocab_size=32_000), gpus=4, precision="fp32", gpu="cpu", seq_len=1024))
    start = next(p for p in e.phases if p.name == "start of backward")
    items = {i.name: i.bytes for i in start.items}
    h, v = LLAMA_TP["hidden_size"], 32_000
    assert items["all-gathered units"] == 4 * (v // 2 * h + h)  # the LM head's vocab/2 rows and the final norm
    assert "prefetched block (all-gather output and gloo's scratch)" not in items  # 0 bytes: not listed
    after = next(p for p in e.phases if p.name == "after the LM head")  # the head unit's pre_backward prefetched it
    assert any(i.name.startswith("prefetched block") and i.bytes > 0 for i in after.items)
    assert not any("held by gloo" in p.name for p in e.phases)  # the head unit is not gathered again


def test_emit_loads_transformers_tp_with_fsdp2_through_distributedconfig():
    """Over a (dp_shard 2, tp 2) layout load_model.py asks transformers for both (its own composition,
    what the estimate models), not from_pretrained(tp_plan="auto") plus an FSDP2 wrap."""
    from planner.memory.orchestrator import estimate
    from planner.plan.emit import emit_estimate_files

    files = emit_estimate_files(estimate(_request(LLAMA_TP, gpus=4, gpu="h100-80gb")))
    loader = files["load_model.py"]
    compile(loader, "load_model.py", "exec")
    assert 'distributed_config=DistributedConfig(tp_plan="auto", tp_size=2, fsdp_size=2)' in loader
    assert "does not wrap the model in FSDP again" in loader
    # accelerate's FSDP2 cannot wrap it under transformers 5.25: no accelerate config; the planner's trainer runs it
    assert "accelerate_config.yaml" not in files and "launch.sh" in files
    assert "Cannot concatenate overlapping meshes" in files["LAUNCH.md"]
    mixed = emit_estimate_files(estimate(_request(LLAMA_TP, gpus=4, gpu="h100-80gb", precision="bf16-mixed")))
    assert "launch.sh" not in mixed and "fp32 only" in mixed["LAUNCH.md"]


def test_transformers_tp_with_fsdp2_refuses_tied_embeddings():
    from planner.memory.orchestrator import estimate

    with pytest.raises(PlannerError, match="tied embeddings") as e:
        estimate(_request(QWEN3, gpus=4))
    assert e.value.field == "tp_plan"


def test_the_plan_searches_transformers_tp_where_accelerate_trains_it():
    """A plan asked with tp_plan=transformers: its TP candidates are torch's sharded strategies only
    (no DDP x TP, no DeepSpeed), their estimates carry the plan, and tp 4 (kv heads 2) is rejected
    with transformers' reason."""
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    result = plan(PlanRequest(model_config=dict(QWEN3, vocab_size=32_000, tie_word_embeddings=False), gpu="h100-80gb",
                              gpus=8, seq_len=1024, tp_plan="transformers"))
    tp = [c for c in result.candidates if c.parallel.tp > 1]
    assert tp and {c.strategy for c in tp} <= {"fsdp", "fsdp-grad-op", "hsdp"}
    # tied embeddings: transformers' TP x FSDP2 is refused (tp_plan), so no TP candidate over 8 GPUs
    tied = plan(PlanRequest(model_config=dict(QWEN3, vocab_size=32_000), gpu="h100-80gb", gpus=8, seq_len=1024,
                            tp_plan="transformers"))
    assert tied.candidates and not [c for c in tied.candidates if c.parallel.tp > 1]
    assert any("tp=4 not searched: tp_plan=transformers: tp(4) does not divide num_key_value_heads(2)" in n
               for n in result.notes)
