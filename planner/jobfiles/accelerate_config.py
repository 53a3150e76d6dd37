"""accelerate's config YAML (``accelerate launch --config_file``): accelerate 1.16
commands/config/config_args.py ClusterConfig and its deepspeed_config / fsdp_config sections
(the keys ``accelerate config`` writes). A DeepSpeed JSON it names (deepspeed_config_file) is
read by planner/frameworks/deepspeed/config.py from the files given."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner.jobfiles.common import compile_mode_neutral, inert
from planner.jobfiles.keys import Inert, Key, Modelled, Refused, Where, check_block, equals, off
from planner.jobfiles.reading import Reading, clipping_norm, flag, whole

LAUNCH = "where and how the processes start"

TOP: dict[str, Key] = {
    "distributed_type": Modelled("strategy: NO / MULTI_GPU ddp, DEEPSPEED zero<stage>, FSDP fsdp"),
    "mixed_precision": Modelled("precision: no fp32, bf16 bf16-mixed, fp16 fp16-mixed"),
    "num_processes": Modelled("world size (checked against gpus x nodes)"),
    "num_machines": Modelled("nodes"),
    "deepspeed_config": Modelled("the DeepSpeed section"), "fsdp_config": Modelled("the FSDP section"),
    "use_cpu": Refused("trains on the CPU", lambda v, b: off(v), "false"),
    "dynamo_config": Modelled("dynamo_backend INDUCTOR in the default mode: compile model (read_dynamo)"),
    "dynamo_backend": Modelled("INDUCTOR: compile model (read_dynamo)"),
    "megatron_lm_config": Refused("Megatron-LM's parallelism", lambda v, b: not v, "remove it"),
    "parallelism_config": Refused("accelerate's ParallelismConfig sets tp/cp degrees", lambda v, b: not v,
                                  "remove it; give --tp / --cp"),
    "fp8_config": Refused("FP8 training", lambda v, b: not v, "remove it"),
    "ipex_config": Refused("Intel extension", lambda v, b: not v, "remove it"),

    **inert(LAUNCH, "compute_environment", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend",
            "same_network", "main_training_function", "enable_cpu_affinity", "gpu_ids", "debug", "commands",
            "command_file", "mpirun_config"),
    **inert("TPU settings, read only with distributed_type XLA (refused)", "tpu_env", "tpu_use_cluster",
            "tpu_use_sudo", "tpu_name", "tpu_zone", "tpu_vm", "downcast_bf16"),
}

DEEPSPEED: dict[str, Key] = {
    "deepspeed_config_file": Modelled("the DeepSpeed JSON, read from the files given"),
    "zero_stage": Modelled("strategy zero<stage>"),
    "offload_optimizer_device": Modelled("offload_optimizer"), "offload_param_device": Modelled("offload_params"),
    "offload_optimizer_nvme_path": Modelled("with nvme"), "offload_param_nvme_path": Modelled("with nvme"),
    "gradient_accumulation_steps": Modelled("gradient_accumulation"),

    "gradient_clipping": Modelled("gradient_clipping: above 0 DeepSpeed clips (the norm, then the scale)"),
    **inert("initialisation and saving", "zero3_init_flag", "zero3_save_16bit_model"),
    **inert(LAUNCH, "deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter",
            "deepspeed_inclusion_filter"),
    "deepspeed_moe_layer_cls_names": Refused("DeepSpeed MoE layers", lambda v, b: not v, "remove it"),
}

# torch FSDP1 (FullyShardedDataParallel, fsdp_version 1) with one unit per transformer block holds
# per unit what FSDP2 does: the unit's parameters gathered in the param dtype (one padded flat
# parameter whose views are the parameters), its unsharded gradient until the reduce-scatter, the
# sharded gradient in the parameters' dtype, the next unit prefetched under BACKWARD_PRE (torch 2.13
# distributed/fsdp/_flat_param.py, _runtime_utils.py _pre_backward_hook / _post_backward_hook). The
# root stays gathered from forward to backward (_runtime_utils.py _post_forward_reshard: the root is
# not resharded), as FSDP2's model holds it through backward. Not counted: FSDP1's transients of
# 1/dp of a unit (the low-precision shard _mp_shard while a unit is gathered, the padded
# reduce-scatter output before it is added to the fp32 sharded gradient). Estimated with FSDP2's
# per-unit model and said so; the CPU ranks verify FSDP2 only.
FSDP1_NOTE = ("fsdp_version 1 (torch FSDP1, flat parameters) is estimated with FSDP2's per-unit model (the same "
              "units gathered, unsharded and sharded gradients); FSDP1's transients of 1/dp of a unit (its "
              "low-precision shard, the padded reduce-scatter output) are not counted; the CPU ranks verify FSDP2 only")
FSDP: dict[str, Key] = {
    "fsdp_version": Modelled("2 FSDP2; 1 FSDP1, estimated with FSDP2's per-unit model (said in the notes)"),
    "fsdp_sharding_strategy": Modelled("FULL_SHARD fsdp, SHARD_GRAD_OP fsdp-grad-op, HYBRID_SHARD hsdp"),
    "fsdp_reshard_after_forward": Modelled("FSDP2: true fsdp, false fsdp-grad-op"),
    "fsdp_offload_params": Modelled("offload_params and offload_optimizer cpu (CPUOffloadPolicy)"),
    "fsdp_activation_checkpointing": Modelled("checkpointing full"),
    "fsdp_auto_wrap_policy": Refused("a wrap other than one unit per transformer block gathers other units",
                                     equals("TRANSFORMER_BASED_WRAP"), "TRANSFORMER_BASED_WRAP"),
    "fsdp_transformer_layer_cls_to_wrap": Inert("names the block class; the model wraps each block"),
    "fsdp_min_num_params": Refused("a size-based wrap", equals(0), "remove it"),
    # accelerate 1.16 utils/dataclasses.py:1830: forward_prefetch raises under fsdp_version 2
    "fsdp_forward_prefetch": Refused("FSDP2 has no forward_prefetch (accelerate raises); under FSDP1 it holds the "
                                     "next unit gathered in forward, as FSDP2's implicit prefetch does (modelled)",
                                     lambda v, b: off(v) or str(b.get("fsdp_version", 1)) == "1", "false"),
    "fsdp_backward_prefetch": Modelled("FSDP1: BACKWARD_PRE holds the next unit gathered through the current "
                                       "unit's backward, as FSDP2 always does (modelled); BACKWARD_POST and "
                                       "NO_PREFETCH hold it for less or not at all (the estimate is the upper bound)"),
    **inert("saving and loading", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading",
            "fsdp_sync_module_states"),
    "fsdp_use_orig_params": Inert("FSDP1: the original parameters are views into the flat parameter, the same bytes"),
}

STRATEGY = {"NO": None, "MULTI_GPU": "ddp"}
FSDP_STRATEGY = {"FULL_SHARD": "fsdp", "1": "fsdp", "SHARD_GRAD_OP": "fsdp-grad-op", "2": "fsdp-grad-op",
                 "HYBRID_SHARD": "hsdp", "4": "hsdp"}


def read_dynamo(reading: Reading, data: dict[str, Any], where: Where) -> None:
    """accelerate's TorchDynamoPlugin from the config file (accelerate 1.x commands/config/config_args.py:
    dynamo_config with dynamo_backend, dynamo_mode, dynamo_use_fullgraph, dynamo_use_dynamic and
    dynamo_use_regional_compilation; an older file's top-level dynamo_backend): inductor in its default mode
    compiles the whole model (prepare_model: torch.compile(model, **dynamo_plugin.to_kwargs())) -> compile
    model; regional compilation compiles the repeated blocks alone and leaves the loss eager, which is
    neither of the planner's modes."""
    block = data.get("dynamo_config") or {}
    if not isinstance(block, dict):
        raise where.error("dynamo_config", "give it as a mapping (dynamo_backend, dynamo_mode, ...)")
    key, backend = next(((k, v) for k, v in (("dynamo_config.dynamo_backend", block.get("dynamo_backend")),
                                              ("dynamo_backend", data.get("dynamo_backend"))) if v is not None),
                        (None, None))
    if off(backend) or str(backend).upper() == "NO":  # YAML reads a bare NO as false
        return
    if str(backend).upper() != "INDUCTOR":
        raise where.error(key, "a torch.compile backend other than INDUCTOR is not modelled")
    if not compile_mode_neutral(block.get("dynamo_mode")):
        raise where.error("dynamo_config.dynamo_mode", "max-autotune's Triton matmul templates and reduce-overhead's "
                                                      "CUDA graphs are not modelled: default")
    if block.get("dynamo_use_regional_compilation") and not off(block.get("dynamo_use_regional_compilation")):
        raise where.error("dynamo_config.dynamo_use_regional_compilation",
                          "compiles the repeated blocks and leaves the loss eager, neither compile mode the planner "
                          "models (blocks compiles the loss too, model everything): false")
    reading.set("compile", "model", key)


def read(data: dict[str, Any], where: Where) -> Reading:
    reading = Reading("accelerate", where)
    reading.unknown = check_block(data, TOP, where)
    kind = str(data.get("distributed_type", "NO")).upper()
    if kind not in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP"):
        raise where.error("distributed_type", f"({kind!r}) is not modelled: NO, MULTI_GPU, DEEPSPEED and FSDP are")
    if kind in STRATEGY and STRATEGY[kind]:
        reading.set("strategy", STRATEGY[kind], "distributed_type")
    mixed = str(data.get("mixed_precision", "no")).lower()
    names = {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}
    if mixed not in names:
        raise where.error("mixed_precision", f"({mixed!r}) is not modelled: no, bf16 and fp16 are")
    if "mixed_precision" in data:
        reading.set("precision", names[mixed], "mixed_precision")
    read_dynamo(reading, data, where)
    if "num_processes" in data:
        reading.set("world_size", whole(data["num_processes"], where, "num_processes"), "num_processes")
    if "num_machines" in data:
        reading.set("nodes", whole(data["num_machines"], where, "num_machines"), "num_machines")
    if kind == "DEEPSPEED":
        _deepspeed(reading, data.get("deepspeed_config") or {})
    if kind == "FSDP":
        fsdp_section(reading, data.get("fsdp_config") or {})
    return reading


def _deepspeed(reading: Reading, block: dict[str, Any]) -> None:
    where = reading.where
    reading.unknown += check_block(block, DEEPSPEED, where, "deepspeed_config.")
    if block.get("deepspeed_config_file"):
        reading.ds_reference = ("deepspeed_config.deepspeed_config_file", block["deepspeed_config_file"])
        return  # accelerate reads the JSON alone then (utils/dataclasses.py DeepSpeedPlugin)
    stage = whole(block.get("zero_stage", 2), where, "deepspeed_config.zero_stage", minimum=0)
    if stage > 3:
        raise where.error("deepspeed_config.zero_stage", f"must be 0, 1, 2 or 3, got {stage}")
    reading.set("strategy", f"zero{stage}", "deepspeed_config.zero_stage")
    for key, name in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_params")):
        device = str(block.get(key, "none")).lower()
        if device not in ("none", "cpu", "nvme"):
            raise where.error(f"deepspeed_config.{key}", f"({device!r}) must be none, cpu or nvme")
        if key in block:
            reading.set(name, device, f"deepspeed_config.{key}")
    if "gradient_accumulation_steps" in block:
        reading.set("gradient_accumulation", whole(block["gradient_accumulation_steps"], where,
                                                   "deepspeed_config.gradient_accumulation_steps"),
                    "deepspeed_config.gradient_accumulation_steps")
    if block.get("gradient_clipping") not in (None, "auto"):  # accelerate 1.16 DeepSpeedPlugin: None is "auto"
        reading.set("gradient_clipping", clipping_norm(block["gradient_clipping"], where,
                                                       "deepspeed_config.gradient_clipping"),
                    "deepspeed_config.gradient_clipping")


def fsdp_section(reading: Reading, block: dict[str, Any]) -> None:
    where = reading.where
    reading.unknown += [where.written(k) for k in check_block(block, FSDP, where, "fsdp_config.")]
    version = str(block.get("fsdp_version", 1))
    if version not in ("1", "2"):
        raise where.error("fsdp_config.fsdp_version", f"({version}) must be 1 or 2")
    reading.default("fsdp_version", int(version))  # FSDP1's step makes no copies on the compute stream
    if version == "1":
        reading.notes.append(f"{where.at('fsdp_config.fsdp_version')} {FSDP1_NOTE}")
        prefetch = str(block.get("fsdp_backward_prefetch", "BACKWARD_PRE")).upper()
        if prefetch not in ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH", "1", "2"):
            raise where.error("fsdp_config.fsdp_backward_prefetch", f"({prefetch!r}) must be BACKWARD_PRE, "
                                                                    "BACKWARD_POST or NO_PREFETCH")
    strategy, decided_by = "fsdp", "fsdp_config.fsdp_version"
    if "fsdp_sharding_strategy" in block:
        decided_by = "fsdp_config.fsdp_sharding_strategy"
        text = str(block["fsdp_sharding_strategy"]).upper()
        if text not in FSDP_STRATEGY:
            raise where.error("fsdp_config.fsdp_sharding_strategy", f"({text!r}) is not modelled: FULL_SHARD, "
                                                                    "SHARD_GRAD_OP and HYBRID_SHARD are")
        strategy = FSDP_STRATEGY[text]
    if "fsdp_reshard_after_forward" in block:
        decided_by = "fsdp_config.fsdp_reshard_after_forward"
        value = block["fsdp_reshard_after_forward"]
        if isinstance(value, str) and value.upper() in FSDP_STRATEGY:
            strategy = FSDP_STRATEGY[value.upper()]
        else:
            strategy = "fsdp" if flag(value, where, "fsdp_config.fsdp_reshard_after_forward") else "fsdp-grad-op"
    reading.set("strategy", strategy, decided_by)
    if flag(block.get("fsdp_offload_params"), where, "fsdp_config.fsdp_offload_params"):
        reading.set("offload_params", "cpu", "fsdp_config.fsdp_offload_params")
        reading.set("offload_optimizer", "cpu", "fsdp_config.fsdp_offload_params")
    if "fsdp_activation_checkpointing" in block:
        on = flag(block["fsdp_activation_checkpointing"], where, "fsdp_config.fsdp_activation_checkpointing")
        reading.set("checkpointing", "full" if on else "none", "fsdp_config.fsdp_activation_checkpointing")


# transformers' fsdp option words (trainer_utils.py FSDPOption) that choose the sharding, as
# _apply_legacy_fsdp_to_config turns them into fsdp_config's reshard_after_forward (training_args.py
# at transformers 5.25, lines 2916-2932): FSDP2 takes full_shard (True) and shard_grad_op (False)
# only, FSDP1 the strategy's name; offload sets the CPU offload, auto_wrap nothing (the default wrap)
SHARDING_WORDS = {"full_shard": True, "shard_grad_op": False, "hybrid_shard": None}


def trainer_fsdp_section(reading: Reading, option: Any, written: Any, version: Any, renames: dict[str, str]) -> None:
    """An FSDP job as HF Trainer (and axolotl, which hands it on) writes it: ``option`` the ``fsdp``
    value (true, or the legacy option words), ``written`` its fsdp_config, whose keys both drop
    accelerate's ``fsdp_`` prefix (``renames`` says what else they call differently), ``version``
    the FSDP version where the config gives none. Read with accelerate's table (fsdp_section);
    every message names the key as written, a setting made by an option word names ``fsdp``."""
    where = reading.where
    if written is None:
        written = {}
    if isinstance(written, str):
        raise where.error("fsdp_config", f"({written!r}) names a file: give its settings inline as a mapping "
                                         "(the file is not read)")
    if not isinstance(written, dict):
        raise where.error("fsdp_config", f"must be a mapping of FSDP settings, got {written!r}")
    block: dict[str, Any] = {}
    aliases: list[tuple[str, str]] = []
    for key in map(str, written):
        inner = renames.get(key, key if key.startswith("fsdp_") else f"fsdp_{key}")
        if inner in block:
            first = dict(aliases).get(f"fsdp_config.{inner}", f"fsdp_config.{inner}")
            raise where.error(f"fsdp_config.{key}", f"sets what {first} sets (the fsdp_ prefix is dropped when "
                                                    "read); keep one")
        block[inner] = written[key]
        if inner != key:
            aliases.append((f"fsdp_config.{inner}", f"fsdp_config.{key}"))
    block.setdefault("fsdp_version", version)
    if not isinstance(option, bool):
        _option_words(where, option, block, aliases)
    reading.where = replace(where, aliases=where.aliases + tuple(aliases))
    try:
        fsdp_section(reading, block)
    finally:
        reading.where = where


def _option_words(where: Where, option: Any, block: dict[str, Any], aliases: list[tuple[str, str]]) -> None:
    words = option.split() if isinstance(option, str) else list(option) if isinstance(option, list) else None
    if words is None:
        raise where.error("fsdp", f"must be true, or a string or list of FSDP options, got {option!r}")
    fsdp2 = str(block["fsdp_version"]) == "2"
    for word in map(str, words):
        if word in SHARDING_WORDS and not (fsdp2 and SHARDING_WORDS[word] is None):
            key, value = "fsdp_reshard_after_forward", SHARDING_WORDS[word] if fsdp2 else word
        elif word == "offload":
            key, value = "fsdp_offload_params", True
        elif word == "auto_wrap":
            continue
        else:
            raise where.error("fsdp", f"({word!r}) is not modelled: full_shard, shard_grad_op, hybrid_shard (FSDP1 "
                                      "only, as transformers allows it), offload and auto_wrap are")
        if key not in block:
            block[key] = value
            aliases.append((f"fsdp_config.{key}", "fsdp"))
