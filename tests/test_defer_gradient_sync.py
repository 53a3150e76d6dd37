"""defer_gradient_sync: the HF Trainer's and accelerate's no_sync on every micro-batch but the last (transformers
5.25 trainer.py sync_context; accelerate 1.16 no_sync): under FSDP every unit keeps its unsharded gradient between
micro-batches and reduce-scatters once per step."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from planner.errors import PlannerError
from planner.memory.orchestrator import estimate
from planner.schema import EstimateRequest, PlanRequest
from planner.time.step import collective_volumes, estimate_with_time

BASE = dict(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", seq_len=4096, micro_batch=1,
            gradient_accumulation=4)


def _item(result, name):
    phase = max(result.phases, key=lambda p: p.bytes)
    return sum(i.bytes for i in phase.items if i.name.startswith(name))


@pytest.mark.parametrize("fields,per_element", [({}, 2), ({"reduce_dtype": "fp32"}, 4),
                                                ({"fsdp_version": 1, "reduce_dtype": "fp32"}, 2)])
def test_the_later_micro_batches_hold_every_units_unsharded_gradient(fields, per_element):
    """FSDP2 keeps them in its reduce dtype where that differs (to_accumulated_grad_if_needed), FSDP1 in autograd's."""
    plain = estimate(EstimateRequest(**(BASE | fields)))
    deferred = estimate(EstimateRequest(**(BASE | fields), defer_gradient_sync=True))
    kept = _item(deferred, "unsharded gradients of every unit")
    assert kept == per_element * deferred.parameters
    # in place of the sharded fp32 gradients the earlier micro-batches accumulate into
    assert _item(deferred, "sharded gradients") == 0 and _item(plain, "sharded gradients") > 0
    assert deferred.per_device.peak_bytes > plain.per_device.peak_bytes + kept // 2


def test_one_micro_batch_a_step_and_ddp_are_unchanged():
    one = dict(BASE, gradient_accumulation=1)
    assert estimate(EstimateRequest(**one, defer_gradient_sync=True)).per_device == \
        estimate(EstimateRequest(**one)).per_device
    ddp = dict(BASE, strategy="ddp", model="qwen3-0.6b")  # DDP is modelled with no_sync already
    a, b = estimate_with_time(EstimateRequest(**ddp)), estimate_with_time(EstimateRequest(**ddp, defer_gradient_sync=True))
    assert a.per_device == b.per_device and a.time.step_seconds == b.time.step_seconds


def test_the_reduce_scatter_runs_once_per_step():
    plain = {r["what"]: r["bytes_per_step"] for r in collective_volumes(EstimateRequest(**BASE))}
    deferred = {r["what"]: r["bytes_per_step"] for r in collective_volumes(EstimateRequest(**BASE,
                                                                                           defer_gradient_sync=True))}
    assert deferred["gradient reduce-scatter"] == plain["gradient reduce-scatter"] // 4
    assert deferred["parameter all-gathers"] == plain["parameter all-gathers"]  # units still reshard
    a, b = estimate_with_time(EstimateRequest(**BASE)), estimate_with_time(EstimateRequest(**BASE,
                                                                                          defer_gradient_sync=True))
    assert b.time.communication_seconds < a.time.communication_seconds


@pytest.mark.parametrize("fields,match", [({"strategy": "zero3"}, r"defer_gradient_sync=true with strategy zero3"),
                                          ({"strategy": "single", "gpus": 1}, r"with strategy single"),
                                          ({"pp": 2, "nodes": 2}, r"defer_gradient_sync=true with pp=2")])
def test_what_has_no_such_sync_is_refused_by_name(fields, match):
    with pytest.raises(ValidationError, match=match):
        EstimateRequest(**(BASE | fields), defer_gradient_sync=True)


def test_the_plan_defers_its_torch_candidates_only():
    from planner.plan.settings import Setting, _degree_fields

    request = PlanRequest(model="llama-3-8b", gpus=8, gpu="h100-80gb", defer_gradient_sync=True)
    assert _degree_fields(request, Setting(8, "fsdp", "none", "none", "none"), 1)["defer_gradient_sync"] is True
    assert "defer_gradient_sync" not in _degree_fields(request, Setting(8, "zero3", "none", "none", "none"), 1)


def test_trainer_job_files_defer_unless_sync_each_batch():
    from planner.jobfiles.job import read_job

    sft = {"model_name_or_path": "meta-llama/Meta-Llama-3-8B", "per_device_train_batch_size": 1,
           "gradient_accumulation_steps": 4, "fsdp": "full_shard", "fsdp_config": {"version": 2}, "bf16": True}
    assert read_job([("sft.json", json.dumps(sft))], 8).fields["defer_gradient_sync"] is True
    synced = dict(sft, accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}})
    assert read_job([("sft.json", json.dumps(synced))], 8).fields["defer_gradient_sync"] is False
    assert "defer_gradient_sync" not in read_job([("sft.json", json.dumps(dict(sft, gradient_accumulation_steps=1)))],
                                                 8).fields
    axolotl = "base_model: NousResearch/Meta-Llama-3-8B\ngradient_accumulation_steps: 2\nfsdp_version: 2\n" \
              "fsdp_config:\n  reshard_after_forward: true\n"
    assert read_job([("a.yaml", axolotl)], 8).fields["defer_gradient_sync"] is True


@pytest.mark.parametrize("defer", [False, True])
def test_the_emitted_trainer_arguments_sync_as_estimated(defer):
    from planner.plan.emit import emit_estimate_files

    request = EstimateRequest(**BASE, defer_gradient_sync=defer)
    files = emit_estimate_files(estimate_with_time(request))
    arguments = json.loads(next(text for name, text in files.items() if name.endswith(".json")
                                and "per_device_train_batch_size" in text))
    synced = arguments.get("accelerator_config", {}).get("gradient_accumulation_kwargs", {}).get("sync_each_batch")
    assert synced is (None if defer else True)


def test_verify_refuses_it_with_model_parallel_engines(tmp_path):
    from backend.launch import worker_job

    request = EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=4, gpu="cpu", device_memory_gib=80, tp=2,
                              gradient_accumulation=2, defer_gradient_sync=True)
    with pytest.raises(PlannerError, match="defer_gradient_sync with tp=2") as info:
        worker_job(request, steps=1, warmup_steps=0, out_dir=tmp_path)
    assert info.value.field == "defer_gradient_sync"


def test_a_trainer_file_beside_an_accelerate_fsdp_config_defers_and_the_config_alone_does_not():
    """LLaMA-Factory's FSDP recipe: its Trainer config, FSDP from an accelerate config (a script of one's own
    may or may not call accumulate(): the accelerate config alone says nothing of it)."""
    from planner.jobfiles.job import read_job

    trainer = ("model_name_or_path: meta-llama/Meta-Llama-3-8B\nstage: sft\nfinetuning_type: full\n"
               "per_device_train_batch_size: 1\ngradient_accumulation_steps: 8\nbf16: true\ncutoff_len: 2048\n")
    fsdp = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\nnum_processes: 8\n"
    job = read_job([("train.yaml", trainer), ("fsdp.yaml", fsdp)], 8)
    assert job.fields["strategy"] == "fsdp" and job.fields["defer_gradient_sync"] is True
    alone = read_job([("fsdp.yaml", fsdp)], 8)
    assert "defer_gradient_sync" not in alone.fields
    assert any("accelerator.accumulate()" in note for note in alone.notes)  # what it assumes is said
    assert "defer_gradient_sync" not in read_job([("train.yaml", trainer.replace("steps: 8", "steps: 1")),
                                                  ("fsdp.yaml", fsdp)], 8).fields


def test_a_check_suggesting_deepspeed_or_a_pipeline_drops_the_trainers_no_sync():
    from planner.check import _apply

    request = EstimateRequest(**BASE, defer_gradient_sync=True)
    assert _apply(request, {"strategy": "zero3"}).defer_gradient_sync is False
    assert _apply(request, {"micro_batch": 2}).defer_gradient_sync is True
