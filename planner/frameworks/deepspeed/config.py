"""DeepSpeed JSON configs: read a user's, and write the one a plan launches with.

Defaults are DeepSpeed 0.19.8's own (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig):
reduce_bucket_size 5e8, allgather_bucket_size 5e8, stage3_prefetch_bucket_size 5e7,
stage3_param_persistence_threshold 1e5, stage3_max_live_parameters 1e9,
stage3_max_reuse_distance 1e9, sub_group_size 1e9, contiguous_gradients true, overlap_comm true
for stage 3 only. Sizes count elements, not bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from planner.errors import PlannerError
from planner.recipes.precision import DTYPE_SPELLINGS, RECIPES, Recipe

# DeepSpeed 0.19.8's defaults, in elements (deepspeed/runtime/zero/config.py lines 113, 132, 222,
# 228, 245, 251); the only definition: ZeroSettings and frameworks' Buckets both default to them
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_ALLGATHER_BUCKET = 500_000_000
DEFAULT_PREFETCH_BUCKET = 50_000_000
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000

# Every key DeepSpeed 0.19.8 reads is in exactly one of these tables; anything else is a typo that
# DeepSpeed would silently ignore, so it is refused. A key either
#   - is MODELLED (read into ZeroSettings, the precision, the batch), or
#   - is INERT: it changes neither a step's memory nor its time (the reason says why), or
#   - is UNMODELLED: it would change memory or time in a way this model does not compute, so it is
#     accepted only at a value that changes nothing (DeepSpeed's default) and refused otherwise, or
#   - was REMOVED: DeepSpeed 0.19.8 refuses it itself (runtime/config.py _reject_removed_config_keys).
# Defaults: deepspeed/runtime/constants.py, zero/config.py, zero/offload_config.py (0.19.8).


@dataclass(frozen=True)
class Unmodelled:
    """A key accepted only where it changes nothing; ``neutral`` says whether a value does."""

    neutral: Callable[[Any], bool]
    reason: str
    default: str  # what to write instead, shown in the message


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v == "auto" or any(v == x and type(v) is type(x) for x in values)


def _at_most(limit: int) -> Callable[[Any], bool]:
    return lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v <= limit)


def _switched_off(*switches: str) -> Callable[[Any], bool]:
    """A feature block whose switches are all off (absent, false, or null)."""
    return lambda block: isinstance(block, dict) and not any(block.get(k) not in (None, False) for k in switches)


def _empty(block: Any) -> bool:
    return block in (None, {}, [])


MODELLED_TOP = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                          "optimizer", "fp16", "bf16", "zero_optimization", "communication_data_type",
                          "tensor_parallel", "gradient_clipping"})

# tensor_parallel: DeepSpeed 0.19.8's AutoTP training block (runtime/tensor_parallel/config.py
# TPTrainingConfig); autotp_size is the request's tp (the planner's AutoTP layout), the rest is
# accepted at its default only
UNMODELLED_TP = {
    "tp_overlap_comm": Unmodelled(_is(False), "overlaps the row-parallel all-reduce with compute", "false"),
    "vocab_parallel_lm_head": Unmodelled(lambda v: v is None, "sets the LM head's vocabulary sharding; the "
                                         "model follows the default (null: the model's HF plan)", "remove it"),
    "tensor_parallel": Unmodelled(_empty, "the inference TP settings", "remove it"),
    "tp": Unmodelled(_empty, "the inference TP settings", "remove it"),
    "injection_policy_tuple": Unmodelled(lambda v: v is None, "a custom injection policy splits other layers",
                                         "remove it"),
    "partition_config": Unmodelled(lambda v: v is None, "custom layer partitioning rules split other layers",
                                   "remove it"),
    "preset_model": Unmodelled(lambda v: v is None, "a preset's partitioning rules instead of the model's HF plan",
                               "remove it"),
    "replace_with_kernel_inject": Unmodelled(_is(False), "inference kernels", "false"),
    "kernel_inject": Unmodelled(_is(False), "inference kernels", "false"),
    "dtype": Unmodelled(lambda v: v is None, "converts the model to another dtype than the training precision",
                        "remove it"),
}
INERT_TP = {"vocab_parallel_ce_backend": "the cross-entropy kernel of a vocabulary-sharded head (not used by default)",
            "keep_module_on_host": "where checkpoints load, before training"}
TP_KEYS = frozenset({"autotp_size"}) | frozenset(UNMODELLED_TP) | frozenset(INERT_TP)

INERT_TOP = {
    "scheduler": "the learning-rate schedule changes values, not memory or time",
    "steps_per_print": "logging", "wall_clock_breakdown": "logging (timers)", "memory_breakdown": "logging",
    "dump_state": "logging", "log_level": "logging", "timers": "logging", "flops_profiler": "logging (one profiled step)",
    "comms_logger": "logging", "tensorboard": "logging", "wandb": "logging", "csv_monitor": "logging",
    "comet": "logging",
    "prescale_gradients": "scales the same gradient tensors in place, before instead of after the reduction",
    "gradient_predivide_factor": "scales the same gradient tensors in place",
    "gradient_allreduce_op": "mean or sum over the same messages",
    "zero_allow_untested_optimizer": "permission to use a client optimizer; the optimizer itself is read from "
                                     "--optimizer / optimizer.type",
    "zero_force_ds_cpu_optimizer": "which CPU Adam implementation runs an offloaded step, not what it holds",
    "dataloader_drop_last": "the data loader, outside the step",
    "checkpoint": "saving and loading checkpoints, outside the step",
    "use_node_local_storage": "checkpoints", "load_universal_checkpoint": "checkpoints",
    "disable_python_gc": "Python's cyclic collector runs on the host between kernels",
    "vocabulary_size": "read only for a divisibility warning (runtime/config.py _do_warning_check)",
    "seq_parallel_communication_data_type": "used only by Ulysses sequence parallelism, which a plan does not use",
    "autotuning": "read by the `deepspeed --autotuning` launcher, not by the training step",
    "aio": "tunes the NVMe swapper's I/O queue; the model takes the drive's rate as one constant "
           "(planner/plan/search.py NVME_GBPS, calibratable)",
    # LLaMA-Factory's examples/deepspeed/ds_z3_fp8_config.json writes these two; DeepSpeed 0.19.8 reads
    # neither (runtime/config.py: DeepSpeedCommsConfig reads comms_logger, get_monitor_config reads
    # tensorboard, wandb, csv_monitor and comet, all at the top level)
    "comms_config": "not a key DeepSpeed reads (its communication logger is comms_logger)",
    "monitor_config": "not a key DeepSpeed reads (its monitors are tensorboard, wandb, csv_monitor and comet)",
}
# JSON has no comments; configs write them as keys like "_comment" (LLaMA-Factory's
# ds_z2_autotp_config.json), and DeepSpeed reads no key that starts with "_"
COMMENT_PREFIX = "_"

UNMODELLED_TOP = {
    "torch_autocast": Unmodelled(_switched_off("enabled"), "autocast keeps fp32 weights and casts per op", "enabled: false"),
    "data_types": Unmodelled(lambda b: isinstance(b, dict) and all(b.get(k) is None for k in (
        "grad_accum_dtype", "param_dtype", "buffer_dtype")) and b.get("keep_in_fp32_modules", "auto") == "auto",
        "a gradient-accumulation, parameter or buffer dtype other than the training dtype changes their bytes",
        "{}"),
    "disable_allgather": Unmodelled(_is(False), "broadcasts replace the parameter all-gather", "false"),
    "activation_checkpointing": Unmodelled(
        _switched_off("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"),
        "DeepSpeed's own checkpointing partitions or offloads the saved activations; use --checkpointing full "
        "for torch checkpointing", "false for partition_activations, cpu_checkpointing and "
        "contiguous_memory_optimization"),
    "compile": Unmodelled(_switched_off("deepcompile"), "DeepCompile reschedules gathers and frees activations",
                          "deepcompile: false"),
    "data_efficiency": Unmodelled(_switched_off("enabled"), "curriculum sampling and random-LTD change the tokens "
                                  "and layers a step runs", "enabled: false"),
    "hybrid_engine": Unmodelled(_switched_off("enabled"), "the RLHF hybrid engine keeps inference copies",
                                "enabled: false"),
    "weight_quantization": Unmodelled(_empty, "quantized weights change their bytes", "remove the block"),
    "expert_parallel": Unmodelled(_switched_off("enabled"), "expert parallelism places MoE experts on "
                                  "different ranks", "enabled: false"),
    "use_data_before_expert_parallelism": Unmodelled(_is(False), "changes the expert-parallel group layout", "false"),
    "pipeline": Unmodelled(_empty, "pipeline parallelism (a PipelineModule) splits layers over stages",
                           "remove the block"),
    "sequence_parallel_size": Unmodelled(_at_most(1), "sequence parallelism splits each sequence over ranks", "1"),
    "managed_gradient_accumulation": Unmodelled(_is(True), "with false every micro-step applies an optimizer "
                                                "update", "true"),
}

REMOVED_TOP = frozenset({"nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
                         "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
                         "progressive_layer_drop"})

# zero_optimization keys (DeepSpeedZeroConfig, with its aliases).
MODELLED_ZERO = frozenset({
    "stage", "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "max_live_parameters",
    "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance", "sub_group_size",
    "contiguous_gradients", "overlap_comm", "offload_param", "offload_optimizer",
    "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",  # deprecated spellings of the two offloads
})

INERT_ZERO = {
    "load_from_fp32_weights": "checkpoint loading", "elastic_checkpoint": "checkpoints",
    "gather_16bit_weights_on_model_save": "saving", "stage3_gather_16bit_weights_on_model_save": "saving",
    "stage3_gather_fp16_weights_on_model_save": "saving", "pipeline_loading_checkpoint": "checkpoint loading",
    "ignore_unused_parameters": "whether unused parameters are an error",
    # stage_1_and_2.py _round_robin_reorder (DeepSpeed 0.19.8): the group's parameters are reordered
    # so consecutive ones belong to different ranks before the flat buffer is laid out; without
    # parameter_alignment (refused) no padding sits between them, so the buffer, the partitions and
    # the buckets keep their sizes
    "round_robin_gradients": "orders the parameters in the flat buffer so that consecutive ones belong to "
                             "different ranks; the buffer, the partitions and the buckets keep their sizes",
    "override_module_apply": "wraps nn.Module.apply, which a step does not call",
    "log_trace_cache_warnings": "logging",
    "compute_grad_norm": "one scalar norm per step",
    "save_muon_momentum_buffer_in_memory": "applies to the Muon optimizer only, which is not modelled (refused)",
    "use_multi_rank_bucket_allreduce": "applies only with reduce_scatter false, which is refused",
}

UNMODELLED_ZERO = {
    "reduce_scatter": Unmodelled(_is(True), "all-reduce of whole buckets replaces the reduce-scatter", "true"),
    "allgather_partitions": Unmodelled(_is(True), "broadcasts replace the parameter all-gather", "true"),
    "model_persistence_threshold": Unmodelled(lambda v: v == "auto" or (isinstance(v, int) and v >= 2**63 - 1),
                                              "caps the persistent parameters kept whole", "remove it"),
    "stage3_model_persistence_threshold": Unmodelled(lambda v: v == "auto" or (isinstance(v, int) and v >= 2**63 - 1),
                                                     "caps the persistent parameters kept whole", "remove it"),
    "module_granularity_threshold": Unmodelled(_is(0), "fetches fine-grained modules as one unit", "0"),
    "stage3_module_granularity_threshold": Unmodelled(_is(0), "fetches fine-grained modules as one unit", "0"),
    "use_all_reduce_for_fetch_params": Unmodelled(_is(False), "an all-reduce replaces the parameter all-gather",
                                                  "false"),
    "stage3_use_all_reduce_for_fetch_params": Unmodelled(_is(False), "an all-reduce replaces the parameter "
                                                         "all-gather", "false"),
    "allgather_sequential": Unmodelled(_is(False), "gathers parameters one by one, without the flat buffer",
                                       "false"),
    "stage3_allgather_sequential": Unmodelled(_is(False), "gathers parameters one by one, without the flat "
                                              "buffer", "false"),
    "legacy_stage1": Unmodelled(_is(False), "the old stage-1 implementation allocates differently", "false"),
    "parameter_alignment": Unmodelled(_is(False), "pads every parameter in the flat buffers to 16 bytes", "false"),
    "zero_hpz_partition_size": Unmodelled(
        _at_most(1), "ZeRO++ hpZ keeps a secondary copy of the parameters partitioned inside each node "
        "(zero/partition_parameters.py ds_secondary_tensor) and gathers from it in backward", "1"),
    "zero_quantized_weights": Unmodelled(_is(False), "ZeRO++ qwZ all-gathers int8 weights, with quantization "
                                         "buffers", "false"),
    "zero_quantized_nontrainable_weights": Unmodelled(_is(False), "stores frozen weights quantized", "false"),
    "zero_quantized_gradients": Unmodelled(_is(False), "ZeRO++ qgZ reduces int4 gradients through all-to-all",
                                           "false"),
    "memory_efficient_linear": Unmodelled(_is(True), "the plain linear saves different tensors for backward",
                                          "true"),
    "enable_sanity_checks": Unmodelled(_is(False), "adds checking collectives to every step", "false"),
    "leaf_module": Unmodelled(lambda b: isinstance(b, dict) and not any(b.get(k) for k in (
        "classes", "names", "name_suffixes")), "leaf modules are gathered whole", "remove it"),
    "zenflow": Unmodelled(lambda b: b is None, "ZenFlow splits the optimizer step between GPU and CPU", "remove it"),
}

REMOVED_ZERO = frozenset({"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"})

# offload_param / offload_optimizer keys (zero/offload_config.py).
MODELLED_OFFLOAD = frozenset({"device", "nvme_path", "pin_memory"})
INERT_OFFLOAD = {"fast_init": "initialisation only"}
# Only the NVMe swapper reads these (swap_tensor/); with device cpu they change nothing.
NVME_ONLY_OFFLOAD = {
    "buffer_count": "the number of pinned swap buffers", "buffer_size": "the size of the pinned swap buffers",
    "max_in_cpu": "parameters kept in host memory instead of NVMe",
    "pipeline_read": "overlaps swap-in with the step", "pipeline_write": "overlaps swap-out with the step",
}
NVME_ONLY_DEFAULTS = {"param": {"buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000},
                      "optimizer": {"buffer_count": 4, "pipeline_read": False, "pipeline_write": False}}
UNMODELLED_OFFLOAD = {
    "ratio": Unmodelled(_is(1, 1.0), "a partial offload keeps part of the optimizer states on the device", "1.0"),
    "super_offload": Unmodelled(_is(False), "SuperOffload changes where the optimizer step runs", "false"),
    "cpuadam_cores_perc": Unmodelled(_is(0.8), "changes the CPU optimizer step's speed, which the model does not "
                                     "scale with cores", "0.8"),
}

# The precision blocks (runtime/precision_config.py): "enabled" is modelled (the precision).
INERT_PRECISION = {
    "auto_cast": "casts the inputs, which are integer token ids", "loss_scale": "a scalar",
    "initial_scale_power": "a scalar", "loss_scale_window": "a scalar", "hysteresis": "a scalar",
    "consecutive_hysteresis": "a scalar", "min_loss_scale": "a scalar",
    "check_grad_overflow": "one scalar check per step",
}
UNMODELLED_PRECISION = {
    "bf16_master_weights_and_grads": Unmodelled(_is(False), "bf16 master weights and gradients replace the fp32 "
                                                "master copy", "false"),
    "bf16_optimizer_states": Unmodelled(_is(False), "bf16 optimizer states halve the Adam moments", "false"),
    "fp16_master_weights_and_grads": Unmodelled(_is(False), "fp16 master weights replace the fp32 master copy",
                                                "false"),
    "immediate_grad_update": Unmodelled(_is(False), "the BF16 optimizer applies each gradient as it arrives "
                                        "instead of keeping them for the step", "false"),
}
PRECISION_KEYS = frozenset({"enabled"}) | frozenset(INERT_PRECISION) | frozenset(UNMODELLED_PRECISION)

TOP_LEVEL_KEYS = MODELLED_TOP | frozenset(INERT_TOP) | frozenset(UNMODELLED_TOP) | REMOVED_TOP
ZERO_KEYS = MODELLED_ZERO | frozenset(INERT_ZERO) | frozenset(UNMODELLED_ZERO) | REMOVED_ZERO
OFFLOAD_KEYS = MODELLED_OFFLOAD | frozenset(INERT_OFFLOAD) | frozenset(NVME_ONLY_OFFLOAD) | frozenset(UNMODELLED_OFFLOAD)


def _check_keys(block: dict[str, Any], where: str, unmodelled: dict[str, Unmodelled], removed: frozenset[str],
                known: frozenset[str]) -> None:
    """Refuse unknown keys, removed keys, and unmodelled keys at a value that changes something."""
    unknown_keys = sorted(set(block) - known)
    if unknown_keys:
        raise PlannerError(f"{where} has unknown key {unknown_keys[0]!r}", field=f"{where}.{unknown_keys[0]}")
    for key in sorted(set(block) & removed):
        raise PlannerError(f"{where}.{key} was removed in DeepSpeed 0.19.8, which refuses a config that has it",
                           field=f"{where}.{key}")
    for key in sorted(set(block) & set(unmodelled)):
        rule = unmodelled[key]
        if not rule.neutral(block[key]):
            raise PlannerError(f"{where}.{key}({json.dumps(block[key])[:80]}) is not modelled: {rule.reason}; "
                               f"the estimate would be wrong, so it is refused (use {rule.default})",
                               field=f"{where}.{key}")


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
    pin_memory: bool = False  # offload_optimizer.pin_memory
    pin_params: bool = False  # offload_param.pin_memory
    precision: str | None = None  # from bf16/fp16 blocks; None when the config says neither
    optimizer: str | None = None  # from optimizer.type; None when the config names none
    micro_batch: int | None = None
    gradient_accumulation: int | None = None
    train_batch_size: int | None = None
    autotp_size: int | None = None  # tensor_parallel.autotp_size: the AutoTP degree; None when not set
    # gradient_clipping above 0: the norm over the rank's gradients, then their scale (zero/stage_1_and_2.py
    # unscale_and_clip_grads, stage3.py alike); None when the config does not say ("auto" left unfilled)
    gradient_clipping: bool | None = None
    # communication_data_type left for resolve to check: the config's precision is "auto"
    communication_data_type: Any = None
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
        raise PlannerError(f"{where}.{key} must be a whole number, got {value!r}", field=f"{where}.{key}")
    if value < minimum:
        raise PlannerError(f"{where}.{key} must be at least {minimum}, got {value}", field=f"{where}.{key}")
    return value


def _bool_field(block: dict[str, Any], key: str, where: str) -> bool | None:
    if key not in block or block[key] == "auto":
        return None
    if not isinstance(block[key], bool):
        raise PlannerError(f"{where}.{key} must be true or false, got {block[key]!r}", field=f"{where}.{key}")
    return block[key]


def _offload_block(block: Any, where: str, kind: str) -> tuple[str, bool]:
    """(device, pin_memory) of offload_param / offload_optimizer. DeepSpeed 0.19.8 pins by default
    (zero/offload_config.py: pin_memory = True in both)."""
    if block is None:
        return "none", False
    if not isinstance(block, dict):
        raise PlannerError(f"{where} must be an object, got {block!r}", field=where)
    _check_keys(block, where, UNMODELLED_OFFLOAD, frozenset(), OFFLOAD_KEYS)
    device = block.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise PlannerError(f"{where}.device must be none, cpu or nvme, got {device!r}", field=f"{where}.device")
    if device == "nvme" and not block.get("nvme_path"):
        raise PlannerError(f"{where}.device is nvme but {where}.nvme_path is not set", field=f"{where}.nvme_path")
    if device == "nvme":
        defaults = NVME_ONLY_DEFAULTS[kind]
        for key in sorted(set(block) & set(NVME_ONLY_OFFLOAD)):
            if key not in defaults:
                raise PlannerError(f"{where}.{key} is not an offload_{kind} setting in DeepSpeed 0.19.8",
                                   field=f"{where}.{key}")
            if block[key] != defaults[key]:
                raise PlannerError(f"{where}.{key}({block[key]!r}) is not modelled: {NVME_ONLY_OFFLOAD[key]} of the "
                                   f"NVMe swapper; the estimate would be wrong, so it is refused (use "
                                   f"{defaults[key]!r} or remove it)", field=f"{where}.{key}")
    pin = _bool_field(block, "pin_memory", where)
    return device, device != "none" and (True if pin is None else pin)


def _deprecated_offloads(zero: dict[str, Any], where: str) -> dict[str, Any]:
    """DeepSpeed 0.19.8 still maps the old spellings (zero/config.py): cpu_offload true is
    offload_optimizer {device: cpu}, cpu_offload_param true is offload_param {device: cpu};
    cpu_offload_use_pin_memory is their pin_memory. Rewritten here so they are modelled, not ignored."""
    zero = dict(zero)
    pin = _bool_field(zero, "cpu_offload_use_pin_memory", where)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        value = _bool_field(zero, old, where)
        if value and zero.get(new) is not None:
            raise PlannerError(f"{where} sets both {old} (deprecated) and {new}; keep {new}", field=f"{where}.{old}")
        if value:
            zero[new] = {"device": "cpu"} | ({} if pin is None else {"pin_memory": pin})
    return zero


def _precision(config: dict[str, Any]) -> str | None:
    """The precision the config sets; None where it leaves it to the trainer: "auto" is filled in by
    transformers' HfTrainerDeepSpeedConfig from the TrainingArguments' bf16/fp16 (integrations/deepspeed.py
    trainer_config_process), which is the request's precision here."""
    states = {name: config[name].get("enabled") for name in ("bf16", "fp16") if isinstance(config.get(name), dict)}
    enabled = [name for name, on in states.items() if on not in (False, None, "auto")]
    if len(enabled) == 2:
        raise PlannerError("ds_config enables both bf16 and fp16; enable at most one", field="ds_config.bf16")
    if enabled:
        return f"{enabled[0]}-mixed"
    if "auto" in states.values():
        return None
    # Neither block enabled: DeepSpeed trains in fp32 (its bf16/fp16 engines are opt-in), which a
    # config read back must say, or an emitted fp32 config would be estimated as bf16-mixed.
    return "fp32"


# The optimizers a ds_config names (the engine builds them: engine.py _configure_basic_optimizer);
# the rest (bitsandbytes, torchao) are client optimizers the script passes to deepspeed.initialize.
DS_OPTIMIZER_TYPES = {"adamw": "AdamW", "sgd": "SGD", "sgd-momentum": "SGD", "lion": "Lion", "adafactor": "Adafactor"}


def _optimizer(config: dict[str, Any]) -> str | None:
    """The optimizer a config names, as this model's --optimizer; None when it names none."""
    block = config.get("optimizer")
    if block is None:
        return None
    if not isinstance(block, dict) or not isinstance(block.get("type", ""), str):
        raise PlannerError(f"ds_config.optimizer must be an object with a type, got {block!r}",
                           field="ds_config.optimizer")
    _check_keys(block, "ds_config.optimizer", {}, frozenset(), frozenset({"type", "params", "legacy_fusion"}))
    kind = block.get("type", "").lower()
    params = block.get("params") or {}
    if kind in ("adam", "adamw"):  # the same two fp32 moments (ops/adam/fused_adam.py, cpu_adam.py)
        return "adamw"
    if kind == "lion":  # ops/lion FusedLion / DeepSpeedCPULion: one fp32 exp_avg
        return "lion"
    if kind == "muon":
        raise PlannerError("ds_config.optimizer.type('Muon') is DeepSpeed's MuonWithAuxAdam, which gathers each "
                           "matrix's partition slices (stage_1_and_2.py _muon_all_gather_partitions): not modelled; "
                           "torch's Muon runs under the torch strategies (--optimizer muon --strategy ddp)",
                           field="ds_config.optimizer.type")
    # any other type is getattr(torch.optim, type) (engine.py _configure_basic_optimizer)
    if kind == "sgd":  # torch.optim.SGD: one momentum buffer, none without momentum
        return "sgd-momentum" if isinstance(params, dict) and params.get("momentum") else "sgd"
    if kind == "adafactor":  # torch.optim.Adafactor over the flat partitions: nothing to factor
        return "adafactor"
    raise PlannerError(f"ds_config.optimizer.type({block.get('type')!r}) is not modelled; use Adam, AdamW, Lion, "
                       "SGD or Adafactor (--optimizer adamw|lion|sgd|sgd-momentum|adafactor; the client optimizers "
                       "adamw-8bit, adamw-paged-8bit, adamw-torchao-8bit/4bit are passed by the script, not named "
                       "in the config)", field="ds_config.optimizer.type")


def check_communication_dtype(value: Any, precision: str) -> None:
    """communication_data_type changes message bytes unless it is the training dtype. Checked when
    the config is read, or, where its precision is "auto" (ZeroSettings.precision None), by resolve
    against the request's precision, which the trainer fills it with."""
    if value is None or value == "auto":
        return
    training = DTYPE_SPELLINGS[RECIPES[precision].compute]
    if value not in training:
        raise PlannerError(f"ds_config.communication_data_type({value!r}) is not modelled: gradients reduced in another "
                           f"dtype than the training dtype ({training[0]}) change the message bytes; remove it",
                           field="ds_config.communication_data_type")


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
    """Read a DeepSpeed JSON (already parsed) into ZeroSettings, refusing what DeepSpeed would not
    run and what would change memory or time without being modelled (the tables above)."""
    if not isinstance(config, dict):
        raise PlannerError(f"ds_config must be a JSON object, got {type(config).__name__}", field="ds_config")
    _check_keys({k: v for k, v in config.items() if not str(k).startswith(COMMENT_PREFIX)}, "ds_config",
                UNMODELLED_TOP, REMOVED_TOP, TOP_LEVEL_KEYS)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise PlannerError(f"ds_config.zero_optimization must be an object, got {zero!r}",
                           field="ds_config.zero_optimization")
    where = "ds_config.zero_optimization"
    _check_keys(zero, where, UNMODELLED_ZERO, REMOVED_ZERO, ZERO_KEYS)
    zero = _deprecated_offloads(zero, where)
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise PlannerError(f"{where}.stage must be 0, 1, 2 or 3, got {stage!r}", field=f"{where}.stage")
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
    opt_device, opt_pin = _offload_block(zero.get("offload_optimizer"), f"{where}.offload_optimizer", "optimizer")
    param_device, param_pin = _offload_block(zero.get("offload_param"), f"{where}.offload_param", "param")
    if opt_device != "none" and stage == 0:
        raise PlannerError(f"{where}.offload_optimizer needs stage 1, 2 or 3, got stage {stage}",
                           field=f"{where}.offload_optimizer")
    if param_device != "none" and stage != 3:
        raise PlannerError(f"{where}.offload_param needs stage 3, got stage {stage}", field=f"{where}.offload_param")
    for name in ("bf16", "fp16"):
        if isinstance(config.get(name), dict):
            _check_keys(config[name], f"ds_config.{name}", UNMODELLED_PRECISION, frozenset(), PRECISION_KEYS)
    precision = _precision(config)
    communication = config.get("communication_data_type")
    if precision is not None:
        check_communication_dtype(communication, precision)
    autotp = _autotp_size(config.get("tensor_parallel"))
    micro = _int_field(config, "train_micro_batch_size_per_gpu", "ds_config", 1)
    accumulation = _int_field(config, "gradient_accumulation_steps", "ds_config", 1)
    train_batch = _int_field(config, "train_batch_size", "ds_config", 1)
    return ZeroSettings(stage=stage, offload_optimizer=opt_device, offload_params=param_device,
                        pin_memory=opt_pin, pin_params=param_pin, precision=precision, optimizer=_optimizer(config),
                        micro_batch=micro, gradient_accumulation=accumulation, train_batch_size=train_batch,
                        autotp_size=autotp, communication_data_type=None if precision else communication,
                        gradient_clipping=_clipping(config.get("gradient_clipping")),
                        explicit=frozenset(explicit), **values)


def _clipping(value: Any) -> bool | None:
    """ds_config.gradient_clipping: whether DeepSpeed clips (0.19.8 runtime/engine.py ``gradient_clipping() > 0.0``;
    its default 0.0); None for "auto" (the HF Trainer fills it from max_grad_norm) and when absent."""
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"), -float("inf")):
        raise PlannerError(f"ds_config.gradient_clipping must be a finite number or \"auto\", got {value!r}",
                           field="ds_config.gradient_clipping")
    return value > 0


def _autotp_size(block: Any) -> int | None:
    """The AutoTP degree tensor_parallel sets (0 and 1 are off: 1), None when the config has no block."""
    if block is None:
        return None
    where = "ds_config.tensor_parallel"
    if not isinstance(block, dict):
        raise PlannerError(f"{where} must be a mapping, got {block!r}", field=where)
    _check_keys(block, where, UNMODELLED_TP, frozenset(), TP_KEYS)
    size = block.get("autotp_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise PlannerError(f"{where}.autotp_size must be a whole number >= 0, got {size!r}", field=f"{where}.autotp_size")
    return max(1, size)


def batch_from_config(settings: ZeroSettings, world_size: int) -> tuple[int | None, int | None]:
    """(micro-batch, gradient accumulation) a config fixes for this world size, completed from
    train_batch_size as DeepSpeed 0.19.8 does (runtime/config.py _set_batch_related_parameters),
    and checked as its _batch_assertion does; (None, None) where the config says nothing."""
    micro, accumulation, train = settings.micro_batch, settings.gradient_accumulation, settings.train_batch_size
    if train is not None:
        if micro is None and accumulation is None:
            accumulation = 1
        if micro is None:
            micro = train // world_size // accumulation
        elif accumulation is None:
            accumulation = train // micro // world_size
        if micro < 1 or accumulation < 1 or micro * accumulation * world_size != train:
            raise PlannerError(f"ds_config train_batch_size({train}) != train_micro_batch_size_per_gpu({micro}) * "
                               f"gradient_accumulation_steps({accumulation}) * world size({world_size}), "
                               "which DeepSpeed refuses", field="ds_config.train_batch_size")
    return micro, accumulation


def with_overrides(settings: ZeroSettings, **overrides: Any) -> ZeroSettings:
    """Explicit flags win over the config file."""
    present = {k: v for k, v in overrides.items() if v is not None}
    return replace(settings, **present, explicit=settings.explicit | frozenset(present))


def build_ds_config(*, stage: int, recipe: Recipe, micro_batch: int, gradient_accumulation: int,
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
            pin = zero.pin_memory if key == "offload_optimizer" else zero.pin_params
            block[key] = {"device": device, "pin_memory": pin}
            if device == "nvme":
                block[key]["nvme_path"] = nvme_path
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gradient_accumulation,
        "zero_optimization": block,
        "steps_per_print": 1_000_000,
    }
    # DeepSpeed builds AdamW and SGD from the config; it has no 8-bit Adam ("AdamW" keeps fp32
    # moments), so for adamw-8bit the config names none and the script passes bitsandbytes'
    # AdamW8bit to deepspeed.initialize(optimizer=...), which ZeRO wraps as a client optimizer.
    if optimizer in DS_OPTIMIZER_TYPES:
        config["optimizer"] = {"type": DS_OPTIMIZER_TYPES[optimizer], "params": {"lr": 1e-4}}
    if optimizer == "sgd-momentum":
        config["optimizer"]["params"]["momentum"] = 0.9
    if optimizer == "adafactor":  # a torch.optim optimizer ZeRO has not tested (zero/utils.py ZERO_SUPPORTED_OPTIMIZERS)
        config["zero_allow_untested_optimizer"] = True
    if recipe.compute == "bf16":
        config["bf16"] = {"enabled": True}
    elif recipe.loss_scaling:
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config
