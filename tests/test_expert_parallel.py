"""Expert parallelism (issue 12): the probe's sharded experts compute what the model computes, the
verify job carries the ep degree, what the probe does not run is refused naming the field, and the
estimate follows the mechanism (the router scores every expert; the all-to-all buffers live inside
the MoE blocks, not at the loss)."""

from __future__ import annotations

import json

import pytest

from planner.errors import PlannerError
from planner.schema import EstimateRequest
from tests.real_runs import DEEPSEEK_V2, DEEPSEEK_V3, GPT_OSS, QWEN3_MOE


def _request(**fields) -> EstimateRequest:
    base = dict(model_config=QWEN3_MOE, strategy="fsdp", precision="fp32", gpus=2, gpu="cpu", micro_batch=2,
                seq_len=128, ep=2)
    return EstimateRequest(**(base | fields))


def test_verify_job_carries_the_ep_degree(tmp_path):
    from backend.launch import worker_job

    job = worker_job(_request(gpus=4), steps=1, warmup_steps=0, out_dir=tmp_path).for_rank()
    assert job["framework"] == "torch" and job["experts"] == {"ep": 2}
    assert job["torch"]["sharding"] == "FULL_SHARD" and job["parallel"] is None and job["pipeline"] is None


@pytest.mark.parametrize("fields, field, message", [
    (dict(strategy="zero2"), "ep", "ep=2 with strategy zero2: the probe runs expert parallelism with FSDP2"),
    (dict(strategy="zero1", gpus=4), "ep", "ep=2 with strategy zero1"),
    (dict(strategy="hsdp", gpus=2, nodes=2), "ep", "ep=2 with strategy hsdp"),
    (dict(model_config=dict(DEEPSEEK_V3, model_type="deepseek_v3"), gpu="h100-80gb", precision="bf16-mixed"), "gpu",
     "the expert-parallel probe runs on CPU ranks"),
])
def test_verify_refuses_what_the_ep_probe_does_not_run(tmp_path, fields, field, message):
    from backend.launch import worker_job

    with pytest.raises(PlannerError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        worker_job(_request(**fields), steps=1, warmup_steps=0, out_dir=tmp_path)
    assert caught.value.field == field and "\n" not in str(caught.value)


def test_verify_refuses_ep_on_a_family_without_fused_experts(tmp_path):
    from backend.launch import worker_job
    from tests.real_runs import LLAMA4

    with pytest.raises(PlannerError, match="model_type 'llama4_text'") as caught:
        worker_job(_request(model_config=LLAMA4), steps=1, warmup_steps=0, out_dir=tmp_path)
    assert caught.value.field == "model"


def test_router_activations_are_the_whole_models():
    """Every rank's router scores all E experts (torchtitan's router runs before the dispatch; the
    transformers router too): the saved activations under ep are those of the whole model, not of
    a model with E / ep experts (whose fp32 softmax over the experts would be ep times narrower)."""
    from planner.memory.orchestrator import estimate

    def saved(result) -> int:
        loss = next(p for p in result.phases if p.kind.value == "start_of_backward")
        return sum(i.bytes for i in loss.items if i.component == "activations")

    assert saved(estimate(_request(ep=2, gpus=2))) == saved(estimate(_request(ep=1, gpus=2))) > 0


def test_all_to_all_buffers_are_not_added_at_the_loss():
    """The dispatch/combine all-to-alls run inside the MoE blocks: the loss's backward (start of
    backward) holds no all-to-all buffer, a block's backward does (send + receive of the routed
    pairs: tokens x top-k x hidden x 2 bytes x 2)."""
    from planner.memory.orchestrator import estimate

    result = estimate(_request(ep=2, gpus=2, precision="bf16-mixed"))
    names = {p.kind.value: [i.name for i in p.items] for p in result.phases}
    assert not any("all-to-all" in n for n in names["start_of_backward"])
    block = next(p for p in result.phases if p.kind.value == "start_of_block")
    buffers = [i for i in block.items if "all-to-all" in i.name]
    assert [i.bytes for i in buffers] == [2 * 2 * 128 * 2 * 256 * 2]


EQUIVALENCE_MODELS = {
    "qwen3_moe": dict(QWEN3_MOE, num_hidden_layers=2),
    # biases, transposed and interleaved gate/up (GptOssExperts), a clamped SwiGLU gate
    "gpt_oss": dict(GPT_OSS, num_hidden_layers=2),
    # shared experts beside the routed ones, group-limited routing, a dense first block
    "deepseek_v3": dict(DEEPSEEK_V3, num_hidden_layers=2),
    "deepseek_v2": dict(DEEPSEEK_V2, num_hidden_layers=2),
    "mixtral": {"model_type": "mixtral", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 96,
                "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 512},
    # a gated shared expert beside the routed ones
    "qwen2_moe": {"model_type": "qwen2_moe", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
                  "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, "num_experts": 4,
                  "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 512},
}


def _equivalence_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for model_type in sorted(EQUIVALENCE_MODELS):
        _equivalence(rank, world, out_dir, model_type)
    dist.destroy_process_group()


def _equivalence(rank: int, world: int, out_dir: str, model_type: str) -> None:
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from backend.train_experts import routed_experts, shard_experts

    fields = dict(EQUIVALENCE_MODELS[model_type])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(7 + r))
               for r in range(world)]
    expert_names = {n for n, p in reference.named_parameters()
                    if any(p is q for e in routed_experts(reference) for q in e.parameters())}
    # the reference: this rank's logits and the non-expert gradients of this rank's loss; the
    # experts' gradients of every rank's loss (the all-to-all brings every rank's tokens to them)
    own = reference(input_ids=batches[rank], labels=batches[rank])
    own.loss.backward()
    dense_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if n not in expert_names}
    reference.zero_grad()
    sum(reference(input_ids=b, labels=b).loss for b in batches).backward()
    expert_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if n in expert_names}

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
    shard_experts(model, mesh["ep"])
    out = model(input_ids=batches[rank], labels=batches[rank])
    out.loss.backward()
    local = config.num_local_experts if hasattr(config, "num_local_experts") else \
        getattr(config, "n_routed_experts", None) or config.num_experts
    first = rank * local // world
    errors = {"logits": float((out.logits - own.logits).abs().max())}
    for name, param in model.named_parameters():
        if name in expert_names:
            want = expert_grads[name][first:first + local // world]
            errors[name] = float((param.grad - want).abs().max()) if param.shape == want.shape else float("inf")
        else:
            errors[name] = float((param.grad - dense_grads[name]).abs().max())
    with open(f"{out_dir}/{model_type}-rank{rank}.json", "w") as handle:
        json.dump(errors, handle)


@pytest.mark.deepspeed
def test_sharded_experts_compute_what_the_model_computes(tmp_path):
    """Two gloo ranks, each holding half the experts, exchange their tokens by all-to-all: the
    logits equal the unsharded model's, each local expert's gradient is that of every rank's loss
    (dispatch and combine run backward too), every other gradient that of the rank's own loss."""
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_equivalence_rank, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    for model_type in sorted(EQUIVALENCE_MODELS):
        for rank in range(world):
            errors = json.loads((tmp_path / f"{model_type}-rank{rank}.json").read_text())
            worst = max(errors, key=errors.get)
            assert errors[worst] < 1e-4, (model_type, rank, worst, errors[worst])
            assert any(".experts." in name for name in errors)


def test_expert_states_are_attributed_as_the_run_attributes_them():
    """ep 2 x FSDP2 on 2 ranks: each rank holds its 4 experts whole (efsdp = 1) and half the dense
    weights, 15,226,368 B of fp32 weights and 30,452,736 B of AdamW states, as the verify run
    attributed its tensors (qwen3moe-ep2-fsdp-fp32-t1024); the add-back of the sharded experts
    was counted as optimizer states, weights included."""
    from planner.memory.orchestrator import estimate

    device = estimate(_request(micro_batch=4, seq_len=256)).per_device
    assert (device.parameters_bytes, device.optimizer_states_bytes) == (15_226_368, 30_452_736)


def test_collective_volumes_under_ep():
    """The dense parameters over every rank, the routed experts over the expert-data-parallel
    group (none at efsdp 1), and the dispatch/combine all-to-alls: the qwen3_moe run's counted
    bytes: all-gathers 23,156,736 (2 x the 2,894,592 dense fp32 parameters), reduce-scatters
    11,578,368, all-to-alls 4 per MoE block of 1,024 tokens x top-2 x 256 x 4 B (34.6 MB counted,
    rank 0 receiving more pairs than the mean)."""
    from planner.time.step import collective_volumes

    rows = {r["what"]: r for r in collective_volumes(_request(micro_batch=4, seq_len=256))}
    assert rows["parameter all-gathers"]["bytes_per_step"] == 23_156_736
    assert rows["gradient reduce-scatter"]["bytes_per_step"] == 11_578_368
    assert rows["expert dispatch/combine all-to-alls"]["bytes_per_step"] == 4 * 4 * 1024 * 2 * 256 * 4
    four = {r["what"]: r for r in collective_volumes(_request(micro_batch=4, seq_len=256, gpus=4))}
    assert four["parameter all-gathers (routed experts)"]["group"] == "expert data-parallel"
    checkpointed = {r["what"]: r for r in collective_volumes(_request(micro_batch=4, seq_len=256, checkpointing="full"))}
    # the recomputed forward runs dispatch and combine again (8 forward dispatches counted for 4 blocks)
    assert checkpointed["expert dispatch/combine all-to-alls"]["bytes_per_step"] == 6 * 4 * 1024 * 2 * 256 * 4


def test_data_parallel_time_rings_the_experts_over_the_expert_group_only(monkeypatch):
    """Under ep the dense parameters still ring over every data-parallel rank, the routed experts
    over the ranks holding the same experts: at ep = dp_shard nothing of theirs (the measured run's
    all-gathers carried the dense 38% only), so the data-parallel communication of a model whose
    parameters are mostly routed experts shrinks; the all-to-alls are added beside it."""
    from planner.model.architecture import from_hf_config, parameter_numels
    from planner.parallel.experts import data_parallel_share
    from planner.memory.orchestrator import estimate
    from planner.parallel.dims import ParallelDims
    from planner.time.step import estimate_time

    a = from_hf_config(dict(QWEN3_MOE))
    total = sum(parameter_numels(a))
    routed = 4 * 8 * 3 * 192 * 256
    assert data_parallel_share(a, ParallelDims(dp_shard=2, ep=2), total) == pytest.approx((total - routed) / total)
    # ep 2 over 8 ranks: the experts ring over 4 ranks, each holding half of them
    share = data_parallel_share(a, ParallelDims(dp_shard=8, ep=2), total)
    assert share == pytest.approx(((total - routed) * 7 / 8 + routed / 2 * 3 / 4) / (total * 7 / 8))
    fields = dict(gpu="h100-80gb", precision="bf16-mixed", gpus=8, micro_batch=4, seq_len=256)

    def communication(ep: int) -> float:
        request = _request(ep=ep, **fields)
        return estimate_time(request, estimate(request)).communication_seconds

    # the data-parallel rings of ep 8 carry the dense 38% of the parameters: with the experts'
    # share put back (every parameter over every rank, as before), the rings take the ep 1 time
    rings = communication(1)
    sharded = communication(8)
    import planner.parallel.experts

    monkeypatch.setattr(planner.parallel.experts, "data_parallel_share", lambda *args: 1.0)
    assert communication(8) - sharded == pytest.approx(rings * (1 - (total - routed) / total))


def test_an_expert_job_needs_fsdp_settings(tmp_path):
    from pydantic import ValidationError

    from backend.job import VerifyJob
    from backend.launch import worker_job

    job = worker_job(_request(), steps=1, warmup_steps=0, out_dir=tmp_path).for_rank()
    job["torch"] = dict(job["torch"], strategy="ddp", sharding=None)
    with pytest.raises(ValidationError, match="experts .expert parallelism. needs torch FSDP2 settings"):
        VerifyJob.model_validate(job)


@pytest.mark.parametrize("fields", [
    dict(model="mixtral-8x7b", strategy="fsdp", ep=8),
    dict(model="qwen3-235b-a22b", strategy="zero3", ep=8),
    dict(model="deepseek-v3", strategy="fsdp", ep=8, pp=2, nodes=4),
    dict(model="qwen3-235b-a22b", strategy="hsdp", ep=4, hsdp_shard_size=8),
])
def test_localize_at_a_settings_other_batch_is_a_fresh_localize(fields):
    """localize's states of a setting are remembered across its batch fields (the plan's options
    share a Setup apart from the request, planner/plan/evaluate.py Search.resolved): at another
    micro-batch and accumulation they equal a fresh computation's, and the local setup carries the
    request it was asked with."""
    from dataclasses import replace

    from planner.memory.orchestrator import resolve, textbook_states
    from planner.parallel import experts

    base = dict(gpu="h100-80gb", gpus=8, nodes=2, seq_len=4096, micro_batch=1, gradient_accumulation=4) | fields
    first = resolve(EstimateRequest(**base))
    experts.localize(first, textbook_states)  # remembered
    for batch in ({"micro_batch": 2, "gradient_accumulation": 2}, {"micro_batch": 4, "gradient_accumulation": 1}):
        other = replace(first, request=first.request.model_copy(update=batch))
        shared = experts.localize(other, textbook_states)
        experts._LOCAL_STATES.clear()
        fresh = experts.localize(resolve(EstimateRequest(**(base | batch))), textbook_states)
        assert shared[0].request is other.request
        assert shared[0].model.parameters == fresh[0].model.parameters
        assert shared[0].model.architecture == fresh[0].model.architecture
        assert shared[1] == fresh[1] and shared[2] == fresh[2]
        assert textbook_states(shared[0]) == textbook_states(fresh[0])
        experts.localize(first, textbook_states)


def test_an_expert_pipelines_peak_and_resident_without_the_phases_are_the_estimates():
    """expert_pipeline_peak_bytes (the plan search's judgement of an expert-parallel pipeline option:
    the worst rank's phase bytes plus what experts.with_items adds per kind, no phase written out) is
    measure's peak, and expert_pipeline_resident_bytes (its floor: every rank's replayed resident
    bytes and the add-back items kept between steps) measure's resident bytes, over MoE families (shared experts or not, MLA), strategies, schedules, ep and
    tp degrees and micro-batch counts; a layout without pp or ep is refused."""
    from planner.memory.orchestrator import (expert_pipeline_peak_bytes, expert_pipeline_resident_bytes, measure,
                                             resolve)

    checked = 0
    for model, extra in (("qwen3-30b-a3b", {}), ("mixtral-8x7b", {"tp": 2}), ("deepseek-v3", {}),
                         ("qwen3-30b-a3b", {"pp_schedule": "interleaved", "pp_virtual_stages": 2}),
                         ("qwen3-30b-a3b", {"pp_schedule": "gpipe", "micro_batch": 2, "gradient_accumulation": 3})):
        for strategy, ep in (("fsdp", 2), ("fsdp", 4), ("hsdp", 2), ("ddp", 2), ("zero1", 2)):
            fields = dict(model=model, strategy=strategy, gpu="h100-80gb", gpus=8, nodes=2, pp=2, ep=ep, seq_len=4096,
                          micro_batch=1, gradient_accumulation=8) | extra
            try:
                setup = resolve(EstimateRequest(**fields))
                measured = measure(setup)
            except PlannerError:
                continue
            assert expert_pipeline_peak_bytes(setup) == measured.peak_bytes, fields
            assert expert_pipeline_resident_bytes(setup) == measured.resident_bytes, fields
            checked += 1
    assert checked >= 12
    for bytes_of in (expert_pipeline_peak_bytes, expert_pipeline_resident_bytes):
        with pytest.raises(ValueError, match="need pp > 1 and ep > 1"):
            bytes_of(resolve(_request(ep=1)))
