"""torchtitan jobs: the TOML of its 0.2 line (torchtitan 0.2.2 config/job_config.py JobConfig,
``--job.config_file``), and a 0.3 launch (``--module M --config F`` naming a config_registry
function, plus ``--section.field value`` overrides; torchtitan 0.3.0 config/manager.py). Both use
the same section and field names for what is read here (0.3.0 config/configs.py TrainingConfig,
ParallelismConfig, CompileConfig), so one table serves both.

A 0.3 config function is Python; it is not run. ``REGISTRY`` holds the values of the published
ones read from their source (torchtitan 0.3.0 models/llama3/config_registry.py), as sections."""

from __future__ import annotations

from typing import Any

from planner.jobfiles.common import inert, value_needs
from planner.jobfiles.keys import Inert, Key, Modelled, Needs, Refused, Where, check_block, equals, off
from planner.jobfiles.reading import Reading, flag, whole

LOG, SAVE = "logging and profiling", "saving checkpoints"

TABLE: dict[str, Key] = {
    "model.name": Modelled("model, with flavor (FLAVORS)"), "model.flavor": Modelled("model"),
    "model.hf_assets_path": Inert("the tokenizer's files"), "model.tokenizer_path": Inert("the tokenizer's files"),
    "model.converters": Needs("low_precision", "float8-tensorwise", "float8/mx converters change the linears' "
                              "dtypes", lambda v, b: not v),
    "model.print_after_conversion": Inert(LOG),
    # the JobConfig of torchtitan before 0.2 (config_manager.py --model.norm_type, 157a12c56: layernorm, np_layernorm,
    # rmsnorm, fused_rmsnorm); fused_rmsnorm was removed in 37c4b8181 (#826), norm_type in #1115
    "model.norm_type": Modelled("rmsnorm (the default), or fused_rmsnorm: fused_kernels rms_norm (models/norms.py "
                                "TritonFusedRMSNorm, planner/recipes/fused_kernels.py)"),
    "optimizer.name": Modelled("AdamW / Adam: adamw"),
    "optimizer.implementation": Inert("foreach, fused or for-loop kernels over the same states"),
    **inert("hyper-parameters change values, not memory or time", "optimizer.lr", "optimizer.eps",
            "optimizer.beta1", "optimizer.beta2", "optimizer.weight_decay", "lr_scheduler.warmup_steps",
            "lr_scheduler.decay_ratio", "lr_scheduler.decay_type", "lr_scheduler.min_lr_factor",
            "lr_scheduler.lr_min"),
    # torchtitan 0.3.0 trainer.py line 940: clip_grad_norm_ with training.max_norm (default 1.0, config/configs.py
    # line 55) before every optimizer step, whatever the value
    "training.max_norm": Modelled("gradient_clipping, always on (the norm and the scale run every step)"),
    "optimizer.early_step_in_backward": Needs("optimizer_in_backward", True, "each parameter's step runs in its "
                                              "gradient's hook, so gradients are not all held", lambda v, b: off(v)),
    "training.local_batch_size": Modelled("micro_batch (x accumulation with pp)"),
    "training.global_batch_size": Modelled("gradient_accumulation = global / (local x dp)"),
    "training.seq_len": Modelled("seq_len"), "training.steps": Modelled("the job's length"),
    "training.mixed_precision_param": Modelled("precision: bfloat16 bf16-mixed, float32 fp32"),
    "training.mixed_precision_reduce": Modelled("reduce_dtype fp32 (the only value torchtitan takes)"),
    "training.enable_cpu_offload": Modelled("offload_params and offload_optimizer cpu (FSDP2 CPUOffloadPolicy)"),
    "training.dtype": Refused("float32 is the only training dtype modelled for FSDP's sharded parameters",
                              equals("float32"), "float32"),
    **inert("the data pipeline, outside the step", "training.dataset", "training.dataset_path"),
    **inert("Python's garbage collector, between steps", "training.gc_freq", "training.gc_debug"),
    "training.disable_cuda_graphs": Inert("CUDA graphs are not what compile.enable turns on (inductor's default mode)"),
    "parallelism.data_parallel_replicate_degree": Modelled("dp_replicate"),
    "parallelism.data_parallel_shard_degree": Modelled("dp_shard (-1: the rest of the world)"),
    "parallelism.fsdp_reshard_after_forward": Modelled("default / always: fsdp; never: fsdp-grad-op"),
    "parallelism.tensor_parallel_degree": Modelled("tp"), "parallelism.pipeline_parallel_degree": Modelled("pp"),
    "parallelism.context_parallel_degree": Modelled("cp"), "parallelism.expert_parallel_degree": Modelled("ep"),
    "parallelism.enable_sequence_parallel": Modelled("sequence_parallel"),
    "parallelism.pipeline_parallel_schedule": Modelled("pp_schedule: 1F1B, Interleaved1F1B, GPipe, LoopedBFS, "
                                                       "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"),
    "parallelism.pipeline_parallel_microbatch_size": Modelled("micro_batch with pp"),
    "parallelism.disable_loss_parallel": Refused("the loss over the whole vocabulary on every TP rank",
                                                 lambda v, b: off(v), "false"),
    "parallelism.enable_async_tensor_parallel": Modelled("async_tp (earlier releases' key; needs compile.enable)"),
    "parallelism.enable_compiled_autograd": Refused("compiled autograd", lambda v, b: off(v), "false"),
    "parallelism.context_parallel_rotate_method": Refused("all-to-all rotation keeps other buffers",
                                                          equals("allgather"), "allgather"),
    "parallelism.module_fqns_per_model_part": Refused("a hand-made stage split", lambda v, b: not v, "remove it"),
    "parallelism.pipeline_parallel_layers_per_stage": Refused("a hand-made stage split", lambda v, b: v is None,
                                                              "remove it"),
    "parallelism.pipeline_parallel_first_stage_less_layers": Inert("torchtitan's split of stages; the model keeps "
                                                                   "its own (planner.parallel.pipeline.stage_bounds)"),
    "parallelism.pipeline_parallel_last_stage_less_layers": Inert("as first_stage_less_layers"),
    "parallelism.pipeline_parallel_schedule_csv": Refused("a schedule from a file", lambda v, b: not v, "remove it"),
    "parallelism.pipeline_parallel_split_points": Refused("a hand-made stage split", lambda v, b: not v, "remove it"),
    "activation_checkpoint.mode": Modelled("none / full; selective with op: checkpointing selective-op; selective "
                                           "with an integer: checkpointing_every (0.3: the activation-checkpoint:"
                                           "none|full|selective word; memory-budget refused)"),
    "activation_checkpoint.selective_ac_option": Modelled("see mode"),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": Inert("MoE router shapes only"),
    "activation_checkpoint.early_stop": Refused("stops recomputation early", lambda v, b: off(v), "false"),
    "activation_checkpoint.memory_budget": Refused("a solver picks what to save", lambda v, b: v in (None, 0.5),
                                                   "remove it"),
    "activation_checkpoint.visualize_memory_budget_pareto": Inert(LOG),
    "activation_checkpoint.preserve_rng_state": Inert("one RNG state per block"),
    "activation_checkpoint.determinism_check": Inert("a check on recomputation"),
    "activation_checkpoint.debug": Inert(LOG),
    "compile.enable": Modelled("with components model and loss (the default): compile blocks (_compile)"),
    "compile.components": Modelled("read with compile.enable: model and loss (the default) are compile blocks"),
    "compile.backend": Modelled("read with compile.enable: inductor (the default)"),
    "compile.enable_async_tensor_parallel": Modelled("async_tp where tp > 1 (it needs compile.enable with the model "
                                                     "component)"),
    "checkpoint.async_mode": Refused("async_with_pinned_mem keeps a pinned host copy of the state",
                                     lambda v, b: not b.get("enable") or v in (None, "disabled", "async"), "disabled"),
    **inert(SAVE, "checkpoint.enable", "checkpoint.enable_checkpoint", "checkpoint.folder", "checkpoint.interval",
            "checkpoint.last_save_model_only", "checkpoint.export_dtype", "checkpoint.keep_latest_k",
            "checkpoint.load_step", "checkpoint.initial_load_path", "checkpoint.initial_load_model_only",
            "checkpoint.exclude_from_loading", "checkpoint.initial_load_in_hf", "checkpoint.last_save_in_hf",
            "checkpoint.create_seed_checkpoint", "checkpoint.enable_first_step_checkpoint"),
    "validation.enable": Refused("validation runs extra forward passes every freq steps (time not counted)",
                                 lambda v, b: off(v), "false"),
    **inert("read only with validation.enable (refused)", "validation.dataset", "validation.dataset_path",
            "validation.freq", "validation.steps", "validation.local_batch_size", "validation.seq_len"),
    **inert(LOG, "job.dump_folder", "job.description", "job.print_args", "job.print_config", "job.use_for_integration_test",
            "profiling.enable_profiling", "profiling.save_traces_folder", "profiling.profile_freq",
            "profiling.enable_memory_snapshot", "profiling.save_memory_snapshot_folder", "metrics.log_freq",
            "metrics.enable_tensorboard", "metrics.save_tb_folder", "metrics.enable_wandb", "metrics.disable_color_printing",
            "metrics.save_for_all_ranks", "metrics.rank_0_only", "comm.init_timeout_seconds",
            "comm.train_timeout_seconds", "comm.trace_buf_size", "comm.save_traces_folder",
            "comm.save_traces_file_prefix", "debug.seed", "debug.print_config", "debug.save_config_file"),
    "debug.deterministic": Refused("deterministic kernels run slower", lambda v, b: off(v), "false"),
    **inert("float8's own settings, read only with a float8 converter (model.converters)",
            "float8.precompute_float8_dynamic_scale_for_fsdp", "float8.filter_fqns", "float8.recipe_name",
            "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "quantize.linear.float8.filter_fqns",
            "quantize.linear.float8.recipe_name"),
    **{key: Needs("float8_all_gather", True, "FSDP2 gathers the float8 linears' weights in fp8",
                  lambda v, b: off(v))
       for key in ("float8.enable_fsdp_float8_all_gather", "quantize.linear.float8.enable_fsdp_float8_all_gather")},
}

# (model.name, model.flavor) -> catalogue entry. torchtitan's llama3 flavors (0.2.2
# models/llama3/__init__.py llama3_configs; 0.3.0 model_registry): 8B dim 4096, 32 layers, 32 heads,
# 8 KV heads, ffn_dim_multiplier 1.3 and multiple_of 1024 (hidden 14336), vocab 128256, rope theta
# 500000: Llama 3.1 8B's config (its hf_assets_path is Llama-3.1-8B); 70B and 405B likewise.
FLAVORS = {("llama3", "8B"): "llama-3.1-8b", ("llama3", "70B"): "llama-3.1-70b",
           ("llama3", "405B"): "llama-3.1-405b"}

# torchtitan 0.3.0 models/llama3/config_registry.py llama3_8b (lines 184-216): Trainer.Config with
# ChunkedLossWrapper(CrossEntropyLoss), default_adamw, TrainingConfig(local_batch_size=1,
# seq_len=8192, steps=1000), SelectiveAC.Config() (per-op SAC); everything else the dataclass
# defaults (ParallelismConfig: data_parallel_shard_degree -1; TrainingConfig.mixed_precision_param
# bfloat16; CompileConfig.enable False).
REGISTRY: dict[tuple[str, str], dict[str, Any]] = {
    ("llama3", "llama3_8b"): {
        "model": {"name": "llama3", "flavor": "8B"},
        "optimizer": {"name": "AdamW"},
        "training": {"local_batch_size": 1, "seq_len": 8192, "steps": 1000},
        "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
        "loss": {"chunked": True},
    },
    # the same file, llama3_70b (lines 257-292): TrainingConfig(local_batch_size=8, seq_len=8192,
    # steps=1000), ParallelismConfig(tensor_parallel_degree=8), FullAC.Config()
    ("llama3", "llama3_70b"): {
        "model": {"name": "llama3", "flavor": "70B"},
        "optimizer": {"name": "AdamW"},
        "training": {"local_batch_size": 8, "seq_len": 8192, "steps": 1000},
        "parallelism": {"tensor_parallel_degree": 8},
        "activation_checkpoint": {"mode": "full"},
        "loss": {"chunked": True},
    },
    # llama3_405b (lines 295-346): as 70B with local_batch_size 2, steps 3000, lr warmup 600, a
    # Float8LinearConverter (filter_fqns lm_head, tensorwise: Float8LinearConfig's default recipe) and
    # CompileConfig(enable=True, enable_async_tensor_parallel=True): async_tp
    ("llama3", "llama3_405b"): {
        "model": {"name": "llama3", "flavor": "405B", "converters": ["float8"]},
        "optimizer": {"name": "AdamW"},
        "lr_scheduler": {"warmup_steps": 600},
        "training": {"local_batch_size": 2, "seq_len": 8192, "steps": 3000},
        "parallelism": {"tensor_parallel_degree": 8},
        "activation_checkpoint": {"mode": "full"},
        "compile": {"enable": True, "enable_async_tensor_parallel": True},
        "loss": {"chunked": True},
    },
}
# ChunkedLossWrapper (torchtitan 0.3.0 components/loss.py): each chunk's LM head, loss and backward inside the
# loss's call, the planner's loss=chunked-in-forward (not torchtune's chunked, whose chunks' backward waits for
# the model's); its Config.num_chunks (default 8) is loss_chunks
IN_FORWARD = "ChunkedLossWrapper runs each chunk's LM head, loss and backward inside the loss's call"
LAUNCH_ONLY: dict[str, Key] = {
    "loss.chunked": Needs("loss", "chunked-in-forward", IN_FORWARD, lambda v, b: off(v)),
    "loss.num_chunks": Modelled("loss_chunks (ChunkedLossWrapper.Config.num_chunks, default 8)"),
}
SCHEDULES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved", "GPipe": "gpipe", "LoopedBFS": "looped-bfs",
             "InterleavedZeroBubble": "interleaved-zb", "ZBVZeroBubble": "zbv", "DualPipeV": "dualpipev"}
# torchtitan b5bcd76 distributed/pipeline_parallel.py: without pipeline_parallel_layers_per_stage a
# multi-stage schedule runs 2 stages per rank ("For multi-stage schedules, default is 2")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def read_toml(data: dict[str, Any], where: Where) -> Reading:
    return _read(_flatten(data), where, "torchtitan-toml", TABLE)


def read_launch(data: dict[str, Any], where: Where) -> Reading:
    key = (str(data["module"]), str(data["config"]))
    if key not in REGISTRY:
        raise where.error("config", f"({data['module']}.{data['config']}) is not a torchtitan 0.3 config function read "
                                    f"here; those read: {', '.join('.'.join(k) for k in REGISTRY)}")
    flat = _flatten(REGISTRY[key])
    for name, value in data["overrides"].items():
        flat[name] = _scalar(value)
    return _read(flat, where, "torchtitan-launch", {**TABLE, **LAUNCH_ONLY})


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and f"{name}.placeholder" not in TABLE and not _is_leaf(name):
            out |= _flatten(value, name + ".")
        else:
            out[name] = value
    return out


def _is_leaf(name: str) -> bool:
    return name in TABLE


def _scalar(text: str) -> Any:
    """A command-line value as torchtitan's tyro parser would type it for the fields read here."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _norm_type(reading: Reading, norm: Any) -> None:
    """model.norm_type -> fused_kernels: torchtitan's fused_rmsnorm is a Triton RMSNorm saving its input and an
    fp32 rstd per row (norms.py at 157a12c56); layernorm and np_layernorm would change the model's norms."""
    if norm is None or norm == "rmsnorm":
        return
    if norm != "fused_rmsnorm":
        raise reading.where.error("model.norm_type", f"({norm!r}) is not modelled: rmsnorm and fused_rmsnorm are "
                                                     "(torchtitan's llama models are RMSNorm models)")
    reading.set("fused_kernels", ("rms_norm",), "model.norm_type")


def _read(flat: dict[str, Any], where: Where, fmt: str, table: dict[str, Key]) -> Reading:
    reading = Reading(fmt, where)
    reading.unknown = check_block(flat, table, where)
    get = flat.get
    name, flavor = get("model.name"), get("model.flavor")
    if name is not None or flavor is not None:
        if (name, flavor) not in FLAVORS:
            raise where.error("model.flavor", f"({name} {flavor}) is not a torchtitan model read here; those read: "
                                              f"{', '.join(f'{n} {f}' for n, f in FLAVORS)}")
        reading.set("model", FLAVORS[(name, flavor)], "model.flavor")
    optimizer = str(get("optimizer.name", "AdamW"))
    if optimizer not in ("AdamW", "Adam"):
        raise where.error("optimizer.name", f"({optimizer!r}) is not modelled: AdamW and Adam are")
    reading.set("optimizer", "adamw", "optimizer.name")
    _converters(reading, flat)
    _norm_type(reading, get("model.norm_type"))
    if not off(get("optimizer.early_step_in_backward")):
        value_needs(reading, "optimizer.early_step_in_backward", "optimizer_in_backward", True, True,
                    TABLE["optimizer.early_step_in_backward"].reason)
    if get("loss.chunked"):
        value_needs(reading, "loss.chunked", "loss", "chunked-in-forward", "ChunkedLossWrapper", IN_FORWARD)
        if "loss.num_chunks" in flat:
            reading.set("loss_chunks", whole(get("loss.num_chunks"), reading.where, "loss.num_chunks"),
                        "loss.num_chunks")
    elif "loss.num_chunks" in flat:
        raise reading.where.error("loss.num_chunks", f"({get('loss.num_chunks')}) is ChunkedLossWrapper's: it applies "
                                                     "with loss.chunked")
    if "training.max_norm" in flat:
        reading.set("gradient_clipping", True, "training.max_norm")
    else:
        reading.default("gradient_clipping", True)
    _training(reading, flat)
    _parallel(reading, flat)
    _checkpointing(reading, flat)
    _compile(reading, flat)
    return reading


# torchtitan's compile section (config/job_config.py Compile: enable False, components ["model", "loss"],
# backend "inductor"): "model" compiles each TransformerBlock (models/llama3/infra/parallelize.py apply_compile),
# "loss" the loss function apart: together they are the planner's compile blocks (planner/recipes/compile.py)
COMPILE_COMPONENTS = ("model", "loss")


# async TP: current torchtitan's compile.enable_async_tensor_parallel (b5bcd76 config/configs.py CompileConfig, whose
# __post_init__ refuses it without compile.enable and the model component), earlier releases'
# parallelism.enable_async_tensor_parallel; with no TP mesh it does nothing (distributed/compile.py _maybe_enable_async_tp)
ASYNC_TP_KEYS = ("compile.enable_async_tensor_parallel", "parallelism.enable_async_tensor_parallel")


def _async_tp(reading: Reading, flat: dict[str, Any]) -> None:
    key = next((k for k in ASYNC_TP_KEYS if k in flat and not off(flat[k])), None)
    if key is None:
        return
    if off(flat.get("compile.enable")):
        raise reading.where.error(key, "(true) needs compile.enable: torchtitan refuses async TP without compile")
    if whole(flat.get("parallelism.tensor_parallel_degree", 1), reading.where, "parallelism.tensor_parallel_degree") > 1:
        reading.set("async_tp", True, key)


def _compile(reading: Reading, flat: dict[str, Any]) -> None:
    _async_tp(reading, flat)
    if off(flat.get("compile.enable")):
        return
    components = flat.get("compile.components", list(COMPILE_COMPONENTS))
    if isinstance(components, str):
        components = [c.strip() for c in components.split(",") if c.strip()]
    if sorted(components) != sorted(COMPILE_COMPONENTS):
        raise reading.where.error("compile.components", f"({', '.join(map(str, components)) or 'none'}): compile blocks "
                                                        "models the blocks and the loss compiled together (model, loss)")
    backend = flat.get("compile.backend", "inductor")
    if str(backend).lower() != "inductor":
        raise reading.where.error("compile.backend", f"({backend}) is not modelled: inductor is")
    reading.set("compile", "blocks", "compile.enable")


# model.converters -> low_precision: torchtitan 0.2.2 components/quantization (float8.py: Float8Converter,
# recipe_name None = tensorwise scaling, "rowwise"; mx.py: MXConverter, mxfp8)
CONVERTERS = {("float8", None): "float8-tensorwise", ("float8", "tensorwise"): "float8-tensorwise",
              ("float8", "rowwise"): "float8-rowwise", ("mx", None): "mxfp8", ("quantize.linear.float8", None):
              "float8-tensorwise"}


def _converters(reading: Reading, flat: dict[str, Any]) -> None:
    converters = flat.get("model.converters") or []
    if isinstance(converters, str):
        converters = [c for c in converters.split(",") if c]
    if not converters:
        return
    recipe = flat.get("float8.recipe_name", flat.get("quantize.linear.float8.recipe_name"))
    if len(converters) != 1 or (converters[0], recipe) not in CONVERTERS:
        raise reading.where.error("model.converters", f"({converters!r}, recipe {recipe!r}) is not modelled: one "
                                                      "float8 (tensorwise or rowwise) or mx converter is")
    value_needs(reading, "model.converters", "low_precision", CONVERTERS[(converters[0], recipe)], converters,
                TABLE["model.converters"].reason)
    # torchtitan 0.2.2 float8.py Float8Converter passes enable_fsdp_float8_all_gather to torchao's
    # Float8LinearConfig (read only with the float8 converter, as its other settings)
    for key in ("float8.enable_fsdp_float8_all_gather", "quantize.linear.float8.enable_fsdp_float8_all_gather"):
        if converters[0] != "mx" and not off(flat.get(key)):
            value_needs(reading, key, "float8_all_gather", True, flat[key], TABLE[key].reason)


def _training(reading: Reading, flat: dict[str, Any]) -> None:
    where, get = reading.where, flat.get
    if "training.local_batch_size" in flat:
        reading.set("micro_batch", whole(get("training.local_batch_size"), where, "training.local_batch_size"),
                    "training.local_batch_size")
    else:
        reading.default("micro_batch", 8)  # TrainingConfig.local_batch_size's default
    if "training.seq_len" in flat:
        reading.set("seq_len", whole(get("training.seq_len"), where, "training.seq_len"), "training.seq_len")
    else:
        reading.default("seq_len", 2048)
    reading.steps = whole(get("training.steps", 10000), where, "training.steps")
    param = str(get("training.mixed_precision_param", "bfloat16"))
    if param not in ("bfloat16", "float32"):
        raise where.error("training.mixed_precision_param", f"({param!r}) must be bfloat16 or float32")
    reading.set("precision", "bf16-mixed" if param == "bfloat16" else "fp32", "training.mixed_precision_param")
    reduce = str(get("training.mixed_precision_reduce", "float32"))
    if reduce != "float32":
        raise where.error("training.mixed_precision_reduce", f"({reduce!r}) must be float32")
    if flag(get("training.enable_cpu_offload"), where, "training.enable_cpu_offload"):
        reading.set("offload_params", "cpu", "training.enable_cpu_offload")
        reading.set("offload_optimizer", "cpu", "training.enable_cpu_offload")
    if get("training.global_batch_size", -1) not in (-1, None):
        reading.fields["_global_batch"] = whole(get("training.global_batch_size"), where, "training.global_batch_size")
        reading.origin["_global_batch"] = where.at("training.global_batch_size") + " training.global_batch_size"


def _parallel(reading: Reading, flat: dict[str, Any]) -> None:
    where, get = reading.where, flat.get
    degrees = {}
    for key, name in (("tensor_parallel_degree", "tp"), ("pipeline_parallel_degree", "pp"),
                      ("context_parallel_degree", "cp"), ("expert_parallel_degree", "ep"),
                      ("data_parallel_replicate_degree", "_dp_replicate")):
        full = f"parallelism.{key}"
        degrees[name] = whole(get(full, 1), where, full)
        if full in flat and name != "_dp_replicate":
            reading.set(name, degrees[name], full)
    shard = get("parallelism.data_parallel_shard_degree", -1)
    shard = -1 if shard == -1 else whole(shard, where, "parallelism.data_parallel_shard_degree")
    reading.fields["_dp"] = (degrees["_dp_replicate"], shard)  # strategy and shard group: the job, with the world
    reading.origin["_dp"] = where.at("parallelism.data_parallel_shard_degree") + " parallelism.data_parallel_shard_degree"
    reshard = str(get("parallelism.fsdp_reshard_after_forward", "default"))
    if reshard not in ("default", "always", "never"):
        raise where.error("parallelism.fsdp_reshard_after_forward", f"({reshard!r}) must be default, always or never")
    reading.fields["_reshard"] = reshard != "never"
    if "parallelism.enable_sequence_parallel" in flat:
        reading.set("sequence_parallel", flag(get("parallelism.enable_sequence_parallel"), where,
                                              "parallelism.enable_sequence_parallel"),
                    "parallelism.enable_sequence_parallel")
    if degrees["pp"] > 1:
        schedule = str(get("parallelism.pipeline_parallel_schedule", "1F1B"))
        if schedule not in SCHEDULES:
            raise where.error("parallelism.pipeline_parallel_schedule", f"({schedule!r}) is not modelled: "
                                                                        f"{', '.join(SCHEDULES)} are")
        reading.set("pp_schedule", SCHEDULES[schedule], "parallelism.pipeline_parallel_schedule")
        if schedule in MULTI_STAGE_SCHEDULES:
            reading.set("pp_virtual_stages", 2, "parallelism.pipeline_parallel_schedule")
        micro = whole(get("parallelism.pipeline_parallel_microbatch_size", 1), where,
                      "parallelism.pipeline_parallel_microbatch_size")
        local = reading.fields.get("micro_batch", 8)
        if local % micro:
            raise where.error("parallelism.pipeline_parallel_microbatch_size",
                              f"({micro}) must divide training.local_batch_size ({local})")
        reading.set("micro_batch", micro, "parallelism.pipeline_parallel_microbatch_size")
        reading.set("gradient_accumulation", local // micro, "training.local_batch_size")


def _checkpointing(reading: Reading, flat: dict[str, Any]) -> None:
    mode = str(flat.get("activation_checkpoint.mode", "selective"))
    key = "activation_checkpoint.mode"
    if mode in ("none", "full"):
        reading.set("checkpointing", mode, key)
    elif mode == "selective":
        option = str(flat.get("activation_checkpoint.selective_ac_option", "2"))
        if option == "op":
            value_needs(reading, key, "checkpointing", "selective-op", "selective op",
                        "torchtitan's per-op selective checkpointing saves matmul and attention outputs")
        elif option.isdigit() and int(option) >= 1:
            value_needs(reading, key, "checkpointing_every", int(option), f"selective {option}",
                        "checkpointing every N-th block")
            reading.set("checkpointing", "full", key)
        else:
            raise reading.where.error("activation_checkpoint.selective_ac_option",
                                      f"({option!r}) must be op or a positive integer")
    elif mode == "memory-budget":
        raise reading.where.error(key, "(memory-budget) is not modelled: the compiler's partitioner picks what to "
                                       "save; it is refused")
    else:
        raise reading.where.error(key, f"({mode!r}) must be none, selective or full")
