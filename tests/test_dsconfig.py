"""A DeepSpeed config: every key DeepSpeed 0.19.8 reads is modelled, inert (with the reason), accepted
only at the value that changes nothing, or refused (exit 2 / 422) naming the key. None is ignored."""

import json

import pytest

from cli.main import main
from planner.frameworks.deepspeed import config as dsconfig
from planner.frameworks.deepspeed.config import parse_ds_config
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate, resolve
from planner.recipes.precision import RECIPES
from planner.schema import EstimateRequest

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}


def zero3(**zero):
    return ZERO3 | {"zero_optimization": {"stage": 3} | zero}


def run(capsys, config, tmp_path, *extra):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    strategy = f"zero{config.get('zero_optimization', {}).get('stage', 0)}"
    code = main(["estimate", "--model", "llama-3-8b", "--strategy", strategy, "--gpus", "8", "--ds-config", str(path),
                 "--json", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("config,message", [
    (zero3(zero_hpz_partition_size=8), "ds_config.zero_optimization.zero_hpz_partition_size(8) is not modelled: "
                                       "ZeRO++ hpZ keeps a secondary copy"),
    (zero3(zero_quantized_weights=True), "zero_quantized_weights(true) is not modelled: ZeRO++ qwZ"),
    (zero3(zero_quantized_gradients=True), "zero_quantized_gradients(true) is not modelled: ZeRO++ qgZ"),
    (zero3(zero_quantized_nontrainable_weights=True), "zero_quantized_nontrainable_weights(true)"),
    (ZERO3 | {"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}},
     "ds_config.tensor_parallel.tp_overlap_comm(true) is not modelled: overlaps the row-parallel all-reduce"),
    (ZERO3 | {"tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False}}},
     "ds_config.tensor_parallel.partition_config"),
    (ZERO3 | {"zero_optimisation": {"stage": 3}}, "ds_config has unknown key 'zero_optimisation'"),
    (zero3(offload_optimizer={"device": "cpu", "ratio": 0.3}), "offload_optimizer.ratio(0.3) is not modelled"),
    (zero3(offload_param={"device": "nvme", "nvme_path": "/nvme", "buffer_count": 8}),
     "offload_param.buffer_count(8) is not modelled"),
    (zero3(reduce_scatter=False), "reduce_scatter(false) is not modelled"),
    (zero3(parameter_alignment=True), "parameter_alignment(true) is not modelled"),
    (zero3(stage3_use_all_reduce_for_fetch_params=True), "stage3_use_all_reduce_for_fetch_params(true)"),
    (zero3(mics_shard_size=4), "zero_optimization.mics_shard_size was removed in DeepSpeed 0.19.8"),
    (ZERO3 | {"sparse_attention": {"mode": "fixed"}}, "ds_config.sparse_attention was removed"),
    (ZERO3 | {"torch_autocast": {"enabled": True}}, "ds_config.torch_autocast({\"enabled\": true}) is not modelled"),
    (ZERO3 | {"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
    (ZERO3 | {"data_types": {"grad_accum_dtype": "fp32"}}, "ds_config.data_types"),
    (ZERO3 | {"communication_data_type": "fp32"}, "communication_data_type('fp32') is not modelled"),
    (ZERO3 | {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "ds_config.optimizer.type('Lamb') is not modelled"),
    (ZERO3 | {"optimizer": {"type": "Muon", "params": {"lr": 1e-3}}}, "ds_config.optimizer.type('Muon') is "
     "DeepSpeed's MuonWithAuxAdam"),
    (ZERO3 | {"train_batch_size": 100}, "train_batch_size(100) != train_micro_batch_size_per_gpu(1) * "
                                        "gradient_accumulation_steps(12) * world size(8)"),
    (zero3(cpu_offload=True, offload_optimizer={"device": "cpu"}), "sets both cpu_offload (deprecated) and "
                                                                    "offload_optimizer"),
    (ZERO3 | {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     "ds_config.bf16.bf16_master_weights_and_grads(true) is not modelled"),
    (ZERO3 | {"bf16": {"enabled": True, "enabeld": True}}, "ds_config.bf16 has unknown key 'enabeld'"),
])
def test_keys_that_would_change_memory_or_time_are_refused(capsys, tmp_path, config, message):
    code, out, err = run(capsys, config, tmp_path)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert message in err, err


@pytest.mark.parametrize("config", [
    zero3(zero_hpz_partition_size=1, zero_quantized_weights=False, zero_quantized_gradients=False),
    ZERO3 | {"tensor_parallel": {"autotp_size": 1}, "torch_autocast": {"enabled": False}},
    ZERO3 | {"wall_clock_breakdown": True, "steps_per_print": 10, "gradient_clipping": 1.0,
             "scheduler": {"type": "WarmupLR", "params": {}}, "tensorboard": {"enabled": True}},
    ZERO3 | {"communication_data_type": "bf16", "gradient_clipping": "auto"},
    ZERO3 | {"bf16": {"enabled": True, "check_grad_overflow": True, "immediate_grad_update": False}},
    zero3(stage3_gather_16bit_weights_on_model_save=True, ignore_unused_parameters=False),
    zero3(offload_param={"device": "cpu", "buffer_count": 8}),  # the NVMe swapper's keys do nothing on cpu
])
def test_inert_and_neutral_keys_are_accepted(capsys, tmp_path, config):
    code, _, err = run(capsys, config, tmp_path)
    assert code == 0, err


def request(config, **fields):
    return EstimateRequest(model="llama-3-8b", strategy="zero3", gpus=8, ds_config=config, **fields)


@pytest.mark.parametrize("value,clipping", [(1.0, True), (0.0, False), (0, False), ("auto", False), (None, False)])
def test_gradient_clipping_above_zero_clips(value, clipping):
    """DeepSpeed 0.19.8 clips when gradient_clipping() > 0.0; "auto" is left to the HF Trainer's max_grad_norm."""
    config = ZERO3 | ({} if value is None else {"gradient_clipping": value})
    assert resolve(request(config)).request.gradient_clipping is clipping
    # a request's own field wins, as for the precision
    assert resolve(request(config, gradient_clipping=not clipping)).request.gradient_clipping is (not clipping)


@pytest.mark.parametrize("value", ["strong", True, float("nan")])
def test_a_bad_gradient_clipping_is_named(value):
    with pytest.raises(PlannerError, match="ds_config.gradient_clipping must be a finite number"):
        resolve(request(ZERO3 | {"gradient_clipping": value}))


def test_offload_param_pin_memory_is_modelled_with_deepspeeds_default():
    """zero/offload_config.py: pin_memory defaults to true; partition_parameters.py pins the partition."""
    pinned = estimate(request(zero3(offload_param={"device": "cpu"}))).host.pinned_bytes
    unpinned = estimate(request(zero3(offload_param={"device": "cpu", "pin_memory": False}))).host.pinned_bytes
    explicit = estimate(request(zero3(offload_param={"device": "cpu", "pin_memory": True}))).host.pinned_bytes
    assert unpinned == 0 and pinned == explicit
    assert pinned == 2 * -(-8_030_261_248 // 8) * 8  # bf16 partition of each of the node's 8 ranks
    # the optimizer's pin no longer leaks into the parameters' and back
    both = zero3(offload_param={"device": "cpu", "pin_memory": False}, offload_optimizer={"device": "cpu"})
    only_optimizer = zero3(offload_optimizer={"device": "cpu"})
    assert estimate(request(both)).host.pinned_bytes == estimate(request(only_optimizer)).host.pinned_bytes > 0


def test_deprecated_cpu_offload_spellings_are_modelled():
    """DeepSpeed 0.19.8 maps cpu_offload to offload_optimizer {device: cpu} (zero/config.py)."""
    old = estimate(request(zero3(cpu_offload=True, cpu_offload_param=True, cpu_offload_use_pin_memory=False)))
    new = estimate(request(zero3(offload_optimizer={"device": "cpu", "pin_memory": False},
                                 offload_param={"device": "cpu", "pin_memory": False})))
    assert old.per_device == new.per_device and old.host == new.host
    assert old.per_device.optimizer_states_bytes == 0 and old.per_device.parameters_bytes == 0


def test_the_configs_optimizer_micro_batch_and_accumulation_are_used():
    base = estimate(request(ZERO3))
    sgd = estimate(request(ZERO3 | {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}))
    assert sgd.request.optimizer == "sgd-momentum"
    assert sgd.per_device.optimizer_states_bytes < base.per_device.optimizer_states_bytes
    plain = estimate(request(ZERO3 | {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    assert plain.request.optimizer == "sgd"
    assert plain.per_device.optimizer_states_bytes < sgd.per_device.optimizer_states_bytes
    four = estimate(request(ZERO3 | {"train_micro_batch_size_per_gpu": 4}))
    assert four.request.micro_batch == 4 and four.per_device.activations_bytes > 3 * base.per_device.activations_bytes
    # an explicit flag wins over the file, as for the precision
    assert estimate(request(ZERO3 | {"train_micro_batch_size_per_gpu": 4}, micro_batch=2)).request.micro_batch == 2
    # train_batch_size completes the accumulation, as DeepSpeed does
    derived = estimate(request(ZERO3 | {"train_batch_size": 96}))
    assert derived.request.gradient_accumulation == 12


def test_api_refuses_an_unmodelled_key_with_422(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    client = TestClient(create_app(str(tmp_path / "runs.sqlite")))
    r = client.post("/v1/estimate", json={"model": "llama-3-8b", "strategy": "zero3", "gpus": 8,
                                          "ds_config": zero3(zero_hpz_partition_size=8)})
    assert r.status_code == 422 and "zero_hpz_partition_size(8) is not modelled" in r.json()["detail"][0]["msg"]


def test_every_emitted_config_reads_back():
    from planner.frameworks.deepspeed.config import ZeroSettings, build_ds_config

    for stage in (0, 1, 2, 3):
        for optimizer in ("adamw", "sgd", "sgd-momentum", "lion", "adafactor"):
            zero = ZeroSettings(stage=stage, offload_optimizer="cpu" if stage else "none",
                                offload_params="cpu" if stage == 3 else "none")
            config = build_ds_config(stage=stage, recipe=RECIPES["bf16-mixed"], micro_batch=2, gradient_accumulation=3,
                                     optimizer=optimizer, zero=zero) | {"train_batch_size": 48}
            back = parse_ds_config(config)
            assert (back.stage, back.micro_batch, back.gradient_accumulation, back.optimizer) == (stage, 2, 3, optimizer)


def test_every_key_deepspeed_reads_is_classified():
    """Pinned to DeepSpeed's own config classes: a key they accept is in exactly one of our tables."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    def keys(model):
        return {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}

    tables = [dsconfig.MODELLED_ZERO, set(dsconfig.INERT_ZERO), set(dsconfig.UNMODELLED_ZERO), dsconfig.REMOVED_ZERO]
    assert keys(DeepSpeedZeroConfig) <= set().union(*tables)
    assert sum(len(t) for t in tables) == len(set().union(*tables))  # no key in two tables
    offload = keys(DeepSpeedZeroOffloadParamConfig) | keys(DeepSpeedZeroOffloadOptimizerConfig)
    assert offload <= dsconfig.OFFLOAD_KEYS
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    assert keys(DeepSpeedBF16Config) | keys(DeepSpeedFP16Config) <= dsconfig.PRECISION_KEYS
    top = [dsconfig.MODELLED_TOP, set(dsconfig.INERT_TOP), set(dsconfig.UNMODELLED_TOP), dsconfig.REMOVED_TOP]
    assert sum(len(t) for t in top) == len(set().union(*top))
    from deepspeed.runtime import config as ds_config

    assert set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS) == dsconfig.REMOVED_TOP
    assert set(ds_config._REMOVED_ZERO_CONFIG_KEYS) == dsconfig.REMOVED_ZERO


# LLaMA-Factory's shipped DeepSpeed configs (examples/deepspeed at ff6d4d1), the keys that were refused
LLAMAFACTORY_Z2_AUTOTP = {
    "_comment": "suooprted model list: https://www.deepspeed.ai/tutorials/automatic-tensor-parallelism/#supported-models",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": True, "round_robin_gradients": True},
    "tensor_parallel": {"autotp_size": 2},
}


def test_llamafactory_autotp_config_is_read_as_deepspeed_and_transformers_read_it(capsys, tmp_path):
    """A "_comment" key (DeepSpeed reads no key starting with _), round_robin_gradients (the same
    partition sizes), bf16 and fp16 both "auto" (the trainer's precision decides: the request's) and
    tensor_parallel.autotp_size 2 (the request's tp) give the estimate of the same job asked with
    flags; a tp flag that contradicts autotp_size is refused."""
    code, out, err = run(capsys, LLAMAFACTORY_Z2_AUTOTP, tmp_path, "--micro-batch", "2", "--seq-len", "2048")
    assert code == 0, err
    from_config = json.loads(out)
    assert from_config["parallel"]["tp"] == 2 and from_config["request"]["precision"] == "bf16-mixed"
    assert main(["estimate", "--model", "llama-3-8b", "--strategy", "zero2", "--gpus", "8", "--tp", "2",
                 "--micro-batch", "2", "--seq-len", "2048", "--json"]) == 0
    flags = json.loads(capsys.readouterr().out)
    assert from_config["per_device"] == flags["per_device"]
    code, out, err = run(capsys, LLAMAFACTORY_Z2_AUTOTP, tmp_path, "--tp", "4")
    assert code == 2 and "tp=4 but ds_config.tensor_parallel.autotp_size is 2" in err
    # communication_data_type against the precision "auto" leaves to the trainer: the request's
    code, _, err = run(capsys, dict(LLAMAFACTORY_Z2_AUTOTP, communication_data_type="bf16"), tmp_path)
    assert code == 0, err
    code, _, err = run(capsys, dict(LLAMAFACTORY_Z2_AUTOTP, communication_data_type="fp32"), tmp_path)
    assert code == 2 and "communication_data_type('fp32') is not modelled" in err
    fp16 = dict(LLAMAFACTORY_Z2_AUTOTP, fp16={"enabled": True}, tensor_parallel={"autotp_size": 1})
    code, out, err = run(capsys, fp16, tmp_path)
    assert code == 0 and json.loads(out)["request"]["precision"] == "fp16-mixed", err


def test_keys_deepspeed_does_not_read_are_accepted(capsys, tmp_path):
    """LLaMA-Factory's ds_z3_fp8_config.json writes comms_config and monitor_config, which DeepSpeed
    0.19.8 never reads (its keys are comms_logger and the monitors' own)."""
    code, _, err = run(capsys, ZERO3 | {"comms_config": {"verbose": False},
                                        "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor"}}, tmp_path)
    assert code == 0, err
