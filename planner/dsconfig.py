"""DeepSpeed JSON configs: read a user's, and write the one a plan launches with.

Defaults are DeepSpeed 0.19.8's own (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig):
reduce_bucket_size 5e8, allgather_bucket_size 5e8, stage3_prefetch_bucket_size 5e7,
stage3_param_persistence_threshold 1e5, stage3_max_live_parameters 1e9,
stage3_max_reuse_distance 1e9, sub_group_size 1e9, contiguous_gradients true, overlap_comm true
for stage 3 only. Sizes count elements, not bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from planner.errors import PlannerError

DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_ALLGATHER_BUCKET = 500_000_000
DEFAULT_PREFETCH_BUCKET = 50_000_000
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000

# Top-level keys DeepSpeed 0.19.8 reads (deepspeed/runtime/config.py and the feature configs it
# parses). Anything else is a typo that DeepSpeed would silently ignore, so it is refused here.
TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "amp", "torch_autocast", "zero_optimization",
    "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "memory_breakdown",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "activation_checkpointing",
    "flops_profiler", "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "communication_data_type",
    "seq_parallel_communication_data_type", "data_types", "elasticity", "pipeline", "checkpoint",
    "aio", "dump_state", "compile", "data_efficiency", "curriculum_learning", "autotuning",
    "compression_training", "sparse_attention", "disable_allgather", "dataloader_drop_last",
    "eigenvalue", "progressive_layer_drop", "quantize_training", "nebula", "hybrid_engine",
    "weight_quantization", "timers", "use_node_local_storage", "load_universal_checkpoint",
    "graph_harvesting", "zenflow", "tensor_parallel", "expert_parallel",
})

# DeepSpeedZeroConfig fields and their aliases (0.19.8).
ZERO_KEYS = frozenset({
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
    "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
    "offload_optimizer", "sub_group_size", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold",
    "model_persistence_threshold", "stage3_model_persistence_threshold", "max_live_parameters",
    "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "module_granularity_threshold",
    "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
    "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
    "leaf_module", "parameter_alignment",
})

OFFLOAD_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                          "pin_memory", "pipeline_read", "pipeline_write", "fast_init", "ratio",
                          "super_offload", "cpuadam_cores_perc"})


@dataclass(frozen=True)
class ZeroSettings:
    """What of a DeepSpeed config decides memory. Sizes are element counts, as in DeepSpeed."""

    stage: int = 0
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET
    allgather_bucket_size: int = DEFAULT_ALLGATHER_BUCKET
    prefetch_bucket_size: int = DEFAULT_PREFETCH_BUCKET
    param_persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD
    max_live_parameters: int = DEFAULT_MAX_LIVE_PARAMETERS
    max_reuse_distance: int = DEFAULT_MAX_REUSE_DISTANCE
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None  # None: DeepSpeed's default, true for stage 3 only
    offload_optimizer: str = "none"
    offload_params: str = "none"
    pin_memory: bool = False
    precision: str | None = None  # from bf16/fp16 blocks; None when the config says neither
    micro_batch: int | None = None
    gradient_accumulation: int | None = None
    explicit: frozenset[str] = field(default_factory=frozenset)

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


def _int_field(block: dict[str, Any], key: str, where: str, minimum: int = 0) -> int | None:
    if key not in block or block[key] == "auto":
        return None
    value = block[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlannerError(f"{where}.{key} must be a whole number, got {value!r}")
    if value < minimum:
        raise PlannerError(f"{where}.{key} must be at least {minimum}, got {value}")
    return value


def _bool_field(block: dict[str, Any], key: str, where: str) -> bool | None:
    if key not in block or block[key] == "auto":
        return None
    if not isinstance(block[key], bool):
        raise PlannerError(f"{where}.{key} must be true or false, got {block[key]!r}")
    return block[key]


def _offload_device(block: Any, where: str) -> tuple[str, bool]:
    if block is None:
        return "none", False
    if not isinstance(block, dict):
        raise PlannerError(f"{where} must be an object, got {block!r}")
    unknown = sorted(set(block) - OFFLOAD_KEYS)
    if unknown:
        raise PlannerError(f"{where} has unknown key {unknown[0]!r}")
    device = block.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise PlannerError(f"{where}.device must be none, cpu or nvme, got {device!r}")
    if device == "nvme" and not block.get("nvme_path"):
        raise PlannerError(f"{where}.device is nvme but {where}.nvme_path is not set")
    return device, bool(block.get("pin_memory", False))


def _precision(config: dict[str, Any]) -> str | None:
    enabled = [name for name in ("bf16", "fp16") if isinstance(config.get(name), dict)
               and config[name].get("enabled") not in (False, None)]
    if len(enabled) == 2:
        raise PlannerError("ds_config enables both bf16 and fp16; enable at most one")
    return f"{enabled[0]}-mixed" if enabled else None


_ZERO_INT_KEYS = {
    "reduce_bucket_size": ("reduce_bucket_size", 1),
    "allgather_bucket_size": ("allgather_bucket_size", 0),
    "prefetch_bucket_size": ("stage3_prefetch_bucket_size", 0),
    "param_persistence_threshold": ("stage3_param_persistence_threshold", 0),
    "max_live_parameters": ("stage3_max_live_parameters", 0),
    "max_reuse_distance": ("stage3_max_reuse_distance", 0),
    "sub_group_size": ("sub_group_size", 0),
}


def parse_ds_config(config: Any) -> ZeroSettings:
    """Read a DeepSpeed JSON (already parsed) into ZeroSettings, refusing what DeepSpeed would not run."""
    if not isinstance(config, dict):
        raise PlannerError(f"ds_config must be a JSON object, got {type(config).__name__}")
    unknown = sorted(set(config) - TOP_LEVEL_KEYS)
    if unknown:
        raise PlannerError(f"ds_config has unknown key {unknown[0]!r}")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise PlannerError(f"ds_config.zero_optimization must be an object, got {zero!r}")
    unknown = sorted(set(zero) - ZERO_KEYS)
    if unknown:
        raise PlannerError(f"ds_config.zero_optimization has unknown key {unknown[0]!r}")
    where = "ds_config.zero_optimization"
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise PlannerError(f"{where}.stage must be 0, 1, 2 or 3, got {stage!r}")
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    for name, (key, minimum) in _ZERO_INT_KEYS.items():
        alias = key.removeprefix("stage3_")
        for candidate in dict.fromkeys((key, alias)):
            value = _int_field(zero, candidate, where, minimum)
            if value is not None:
                values[name] = value
                explicit.add(name)
    for name in ("contiguous_gradients", "overlap_comm"):
        value = _bool_field(zero, name, where)
        if value is not None:
            values[name] = value
    opt_device, opt_pin = _offload_device(zero.get("offload_optimizer"), f"{where}.offload_optimizer")
    param_device, param_pin = _offload_device(zero.get("offload_param"), f"{where}.offload_param")
    if opt_device != "none" and stage == 0:
        raise PlannerError(f"{where}.offload_optimizer needs stage 1, 2 or 3, got stage {stage}")
    if param_device != "none" and stage != 3:
        raise PlannerError(f"{where}.offload_param needs stage 3, got stage {stage}")
    micro = _int_field(config, "train_micro_batch_size_per_gpu", "ds_config", 1)
    accumulation = _int_field(config, "gradient_accumulation_steps", "ds_config", 1)
    return ZeroSettings(stage=stage, offload_optimizer=opt_device, offload_params=param_device,
                        pin_memory=opt_pin or param_pin, precision=_precision(config),
                        micro_batch=micro, gradient_accumulation=accumulation,
                        explicit=frozenset(explicit), **values)


def with_overrides(settings: ZeroSettings, **overrides: Any) -> ZeroSettings:
    """Explicit flags win over the config file."""
    present = {k: v for k, v in overrides.items() if v is not None}
    return replace(settings, **present, explicit=settings.explicit | frozenset(present))


def build_ds_config(*, stage: int, precision: str, micro_batch: int, gradient_accumulation: int,
                    optimizer: str, zero: ZeroSettings, nvme_path: str = "/local_nvme") -> dict[str, Any]:
    """The DeepSpeed JSON a plan launches with: every size the prediction assumed, spelled out."""
    block: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": zero.contiguous_gradients,
        "reduce_bucket_size": zero.reduce_bucket_size,
        "allgather_bucket_size": zero.allgather_bucket_size,
        "overlap_comm": zero.overlap,
    }
    if stage == 3:
        block |= {
            "stage3_prefetch_bucket_size": zero.prefetch_bucket_size,
            "stage3_param_persistence_threshold": zero.param_persistence_threshold,
            "stage3_max_live_parameters": zero.max_live_parameters,
            "stage3_max_reuse_distance": zero.max_reuse_distance,
            "sub_group_size": zero.sub_group_size,
        }
    for key, device in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_params)):
        if device != "none":
            block[key] = {"device": device, "pin_memory": zero.pin_memory}
            if device == "nvme":
                block[key]["nvme_path"] = nvme_path
    optimizers = {"adamw": "AdamW", "sgd": "SGD", "adamw-8bit": "AdamW"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gradient_accumulation,
        "optimizer": {"type": optimizers[optimizer], "params": {"lr": 1e-4}},
        "zero_optimization": block,
        "steps_per_print": 1_000_000,
    }
    if optimizer == "sgd":
        config["optimizer"]["params"]["momentum"] = 0.9
    if precision in ("bf16-mixed", "bf16-pure"):
        config["bf16"] = {"enabled": True}
    elif precision == "fp16-mixed":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config
