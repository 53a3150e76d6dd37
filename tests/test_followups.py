"""Reviewer follow-ups: emitted files keep the user's DeepSpeed settings; launches and locks name
the GPUs DeepSpeed really runs on; slow estimate requests leave the event loop; a synthesised
topology is not held to the paste limit; the collector runs while tracing; one /dev/shm pattern."""

import json

import pytest

from planner.emit import emit_estimate_files
from planner.memory import estimate
from planner.schema import EstimateRequest

USERS_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000},
    "steps_per_print": 10,
}


def _emit_users_config(config=USERS_DS_CONFIG, **fields):
    request = EstimateRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, ds_config=config, **fields)
    return request, emit_estimate_files(estimate(request))


def test_emit_keeps_the_users_deepspeed_settings_and_carries_them_to_the_trainer():
    _, files = _emit_users_config()
    ds = json.loads(files["ds_config.json"])
    assert ds["optimizer"] == USERS_DS_CONFIG["optimizer"]
    assert ds["scheduler"] == USERS_DS_CONFIG["scheduler"]
    assert ds["gradient_clipping"] == 1.0 and ds["steps_per_print"] == 10
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 200_000_000
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (2, 4, 64)
    args = json.loads(files["trainer_args.json"])
    assert (args["learning_rate"], args["weight_decay"], args["max_grad_norm"]) == (3e-4, 0.1, 1.0)
    assert (args["adam_beta1"], args["adam_beta2"], args["warmup_steps"]) == (0.9, 0.95, 100)
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (2, 4)


def test_emit_overwrites_what_the_plan_decides_over_the_users_config():
    """An explicit offload and precision win over the config's; the user's other keys stay."""
    _, files = _emit_users_config(offload_optimizer="cpu", precision="fp16-mixed", micro_batch=1)
    ds = json.loads(files["ds_config.json"])
    assert "bf16" not in ds and ds["fp16"]["enabled"] is True
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["train_batch_size"] == 32
    assert ds["scheduler"] == USERS_DS_CONFIG["scheduler"]


def test_an_emitted_user_config_parses_and_estimates_back_the_same():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    request, files = _emit_users_config()
    ds = json.loads(files["ds_config.json"])
    read_back = EstimateRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, ds_config=ds)
    assert estimate(read_back).per_device.peak_bytes == estimate(request).per_device.peak_bytes
    ds.pop("train_batch_size")  # outside a process group DeepSpeedConfig assumes world size 1
    parsed = DeepSpeedConfig(ds)
    assert parsed.gradient_clipping == 1.0 and parsed.scheduler_name == "WarmupDecayLR"
    assert parsed.optimizer_params["lr"] == 3e-4
