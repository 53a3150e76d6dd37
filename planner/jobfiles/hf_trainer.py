"""transformers' TrainingArguments, and TRL's SFTConfig with its ModelConfig and ScriptArguments
(what ``trl sft --config FILE`` reads), as YAML or JSON.

Keys: transformers 5.25 training_args.py TrainingArguments (114 fields), TRL 1.16 trl/trainer/
sft_config.py SFTConfig (its own 21), trl/trainer/model_config.py ModelConfig, trl/scripts/utils.py
ScriptArguments. Defaults that differ in SFTConfig (read from its source): gradient_checkpointing
True, bf16 on unless fp16 (``__post_init__``), max_length 1024. A file with any TRL key is read as
an SFTConfig; otherwise as plain TrainingArguments, which do not name the model (give --model).
"""

from __future__ import annotations

from typing import Any

from planner.jobfiles.accelerate_config import trainer_fsdp_section
from planner.jobfiles.common import (TORCH_COMPILE_KEYS, attention, hf_optimizer, hf_sgd_momentum, inert,
                                     model_name, precision)
from planner.jobfiles.keys import Inert, Key, Modelled, Needs, Refused, Where, check_block, equals, needs_met, off
from planner.jobfiles.reading import Reading, clipping_norm, flag, number, whole
from planner.recipes.fused_kernels import FUSED_KERNELS

LOG, EVAL, SAVE, HUB, DATA = ("logging", "evaluation, outside the training step", "saving checkpoints",
                              "the Hugging Face Hub", "the data pipeline, outside the step")

TRAINING_ARGUMENTS: dict[str, Key] = {
    "per_device_train_batch_size": Modelled("micro_batch"),
    "gradient_accumulation_steps": Modelled("gradient_accumulation"),
    "bf16": Modelled("precision"), "fp16": Modelled("precision"),
    "gradient_checkpointing": Modelled("checkpointing full"),
    "activation_checkpointing": Modelled("checkpointing full (the 5.x spelling)"),
    "optim": Modelled("optimizer"),
    "optim_args": Modelled("with optim sgd, a momentum gives sgd-momentum (one buffer); the other keys change "
                           "values, not memory"),
    "max_steps": Modelled("the job's length"), "num_train_epochs": Modelled("the job's length (x dataset tokens)"),
    "deepspeed": Modelled("the DeepSpeed JSON, read from the files given"),
    "fsdp": Modelled("strategy fsdp / fsdp-grad-op / hsdp, offload"), "fsdp_config": Modelled("see fsdp"),
    "use_liger_kernel": Modelled("the parts liger_kernel_config leaves on: loss liger-fused "
                                 "(fused_linear_cross_entropy) and fused_kernels rms_norm, rope, swiglu "
                                 "(apply_liger_kernel_to_llama's defaults)"),
    "liger_kernel_config": Modelled("with use_liger_kernel: the apply function's arguments (rope, rms_norm, swiglu, "
                                    "fused_linear_cross_entropy; cross_entropy and geglu refused, layer_norm "
                                    "vision towers only)"),
    **TORCH_COMPILE_KEYS,
    "use_cpu": Refused("trains on the CPU", lambda v, b: off(v), "false"),
    "auto_find_batch_size": Refused("halves the micro-batch after each out-of-memory error, so the micro-batch that "
                                    "runs is not the file's", lambda v, b: off(v), "false"),
    "tf32": Refused("TF32 changes the speed of fp32 matmuls, which the time model does not separate",
                    lambda v, b: off(v) or b.get("bf16") is True or b.get("fp16") is True,
                    "false, or train in bf16/fp16"),
    "gradient_checkpointing_kwargs": Modelled("use_reentrant: either saves the block inputs only (an int8 base's "
                                              "linears keep theirs as non-reentrant does: finetune.py int8_held_inputs; "
                                              "reentrant keeps fewer)"),
    "activation_checkpointing_kwargs": Modelled("as gradient_checkpointing_kwargs"),
    "parallelism_config": Refused("accelerate's ParallelismConfig sets tp/cp/dp degrees", lambda v, b: v is None,
                                  "remove it; give the degrees with --tp / --cp"),
    "accelerator_config": Modelled("gradient_accumulation_kwargs.sync_each_batch: FSDP syncs every micro-batch "
                                   "(defer_gradient_sync false); its other keys dispatch and split batches, the same "
                                   "tensors"),
    "ddp_bucket_cap_mb": Refused("DDP's gradient bucket size (the model takes DDP's 25 MB)", equals(25), "25"),
    "ddp_find_unused_parameters": Inert("a graph traversal after forward"),
    "ddp_broadcast_buffers": Inert("buffers of a transformer are a few KB"),
    "ddp_static_graph": Inert("the same buckets"), "ddp_backend": Inert("the process group's library"),
    "ddp_timeout": Inert("a timeout"),
    "neftune_noise_alpha": Inert("noise added to the embeddings' output in place"),
    "torch_empty_cache_steps": Inert("returns cached blocks to the driver between steps; the peak is within a step"),
    "use_cache": Inert("the KV cache is off in training with checkpointing; without it HF training does not keep one"),
    "average_tokens_across_devices": Inert("one scalar all-reduce per step"),
    "max_grad_norm": Modelled("gradient_clipping: above 0 (TrainingArguments' default 1.0) the gradients' norm and "
                              "scale run before each optimizer step"),
    "label_smoothing_factor": Inert("a scalar in the loss"),
    "bf16_full_eval": Inert(EVAL), "fp16_full_eval": Inert(EVAL),
    "skip_memory_metrics": Inert(LOG), "debug": Inert(LOG),
    "do_train": Inert("a switch of example scripts"), "do_eval": Inert(EVAL), "do_predict": Inert(EVAL),
    "resume_from_checkpoint": Inert(SAVE), "local_rank": Inert("set by the launcher"),
    "seed": Inert("random values, not sizes"), "data_seed": Inert("random values, not sizes"),
    "full_determinism": Refused("deterministic kernels run slower", lambda v, b: off(v), "false"),
    **inert("the learning-rate and optimizer hyper-parameters change values, not memory or time",
            "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
            "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim_target_modules"),
    **inert(LOG, "logging_strategy", "logging_steps", "logging_first_step", "log_on_each_node",
            "logging_nan_inf_filter", "include_num_input_tokens_seen", "log_level", "log_level_replica",
            "disable_tqdm", "report_to", "run_name", "project", "trackio_space_id", "trackio_bucket_id",
            "trackio_static_space_id", "logging_dir", "include_tokens_per_second"),
    **inert(EVAL, "eval_strategy", "eval_steps", "eval_delay", "per_device_eval_batch_size", "prediction_loss_only",
            "eval_on_start", "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
            "include_for_metrics", "batch_eval_metrics", "load_best_model_at_end", "metric_for_best_model",
            "greater_is_better"),
    **inert(SAVE, "output_dir", "save_only_model", "save_strategy", "save_steps", "save_on_each_node",
            "save_total_limit", "enable_jit_checkpoint", "ignore_data_skip", "restore_callback_states_from_checkpoint",
            "overwrite_output_dir", "save_safetensors"),
    **inert(HUB, "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push",
            "hub_revision"),
    **inert(DATA, "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
            "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
            "dataloader_in_order", "remove_unused_columns", "label_names", "train_sampling_strategy",
            "length_column_name", "group_by_length"),
}

# TRL 1.16 SFTConfig's own fields, ModelConfig and ScriptArguments.
TRL: dict[str, Key] = {
    "max_length": Modelled("seq_len"), "max_seq_length": Modelled("seq_len (TRL < 0.20's name)"),
    "packing": Modelled("sequences are estimated full at max_length: what packing makes every one, and the "
                        "bound of each padded batch without it"),
    "padding_free": Modelled("as packing"), "packing_strategy": Modelled("as packing"),
    "pad_to_multiple_of": Inert("pads to at most max_length, which is estimated"),
    "activation_offloading": Needs("activation_offload", True, "the saved activations live on the host",
                                   lambda v, b: off(v)),
    "loss_type": Refused("the DFT loss keeps further per-token tensors", equals("nll"), "nll"),
    "eval_packing": Inert(EVAL), "completion_only_loss": Inert("masks labels; the same logits"), "assistant_only_loss": Inert("masks labels"),
    "model_name_or_path": Modelled("model"), "dtype": Modelled("16-bit weights with bf16: bf16-pure"),
    "torch_dtype": Modelled("as dtype (its older name)"),
    "attn_implementation": Modelled("attention"), "use_peft": Modelled("finetune lora"),
    "lora_r": Modelled("lora_rank"), "lora_alpha": Modelled("lora_alpha"), "lora_dropout": Modelled("lora_dropout"),
    "lora_target_modules": Modelled("lora_targets"),
    "lora_modules_to_save": Modelled("train_embeddings when it names the embeddings and the head"),
    "load_in_4bit": Modelled("finetune qlora"), "load_in_8bit": Modelled("quantize_base int8"),
    "bnb_4bit_quant_type": Modelled("quantize_base nf4 / fp4"),
    "use_bnb_nested_quant": Refused("without double quantization each block keeps an fp32 absmax (more bytes than "
                                    "the model's nf4 with double quantization)",
                                    lambda v, b: v is True or not b.get("load_in_4bit"), "true"),
    "bnb_4bit_quant_storage": Refused("a storage dtype other than uint8 changes the packed weights' bytes",
                                      equals("uint8"), "uint8"),
    "lora_target_parameters": Refused("adapters on parameters (MoE experts)", lambda v, b: not v, "remove it"),
    "lora_task_type": Inert("the PEFT task's wrapper class"),
    "use_rslora": Inert("a different scale, the same adapter shapes"),
    "use_dora": Refused("DoRA keeps a magnitude vector and the weight's norm per step", lambda v, b: off(v), "false"),
    "model_revision": Inert("which commit of the Hub repo"), "trust_remote_code": Inert("permission to run code"),
    "model_init_kwargs": Refused("passed to from_pretrained (dtype, quantization) unread", lambda v, b: not v,
                                 "remove it; use dtype / load_in_4bit"),
    "router_aux_loss_coef": Inert("a scalar in the loss"),
    **inert(DATA, "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming",
            "dataset_text_field", "dataset_kwargs", "dataset_num_proc", "eos_token", "pad_token", "truncation_mode",
            "shuffle_dataset", "chat_template_path", "ignore_bias_buffers", "datasets"),
}
TRL_ONLY = frozenset(TRL) - {"max_length"}


def read(data: dict[str, Any], where: Where) -> Reading:
    is_trl = bool(set(data) & TRL_ONLY)
    reading = Reading("trl-sft" if is_trl else "hf-trainer", where)
    table = {**TRAINING_ARGUMENTS, **(TRL if is_trl else {})}
    reading.unknown = check_block(data, table, where)
    get = data.get
    if "per_device_train_batch_size" in data:
        reading.set("micro_batch", whole(get("per_device_train_batch_size"), where, "per_device_train_batch_size"),
                    "per_device_train_batch_size")
    else:  # TrainingArguments' default: 8 sequences per device
        reading.default("micro_batch", 8)
    if "gradient_accumulation_steps" in data:
        reading.set("gradient_accumulation", whole(get("gradient_accumulation_steps"), where,
                                                   "gradient_accumulation_steps"), "gradient_accumulation_steps")
    checkpointing = next((k for k in ("gradient_checkpointing", "activation_checkpointing") if k in data), None)
    if checkpointing:
        reading.set("checkpointing", "full" if flag(get(checkpointing), where, checkpointing) else "none",
                    checkpointing)
    elif is_trl:
        reading.default("checkpointing", "full")  # SFTConfig's default
    if "optim" in data:
        hf_optimizer(reading, "optim", get("optim"))
        if str(get("optim")).lower() == "sgd" and hf_sgd_momentum(get("optim_args")):
            reading.set("optimizer", "sgd-momentum", "optim_args")
    if needs_met(table["torch_compile"], get("torch_compile"), data) or any(
            get(k) is not None for k in ("torch_compile_backend", "torch_compile_mode")):
        reading.set("compile", "model", next(k for k in ("torch_compile", "torch_compile_backend", "torch_compile_mode")
                                             if not off(get(k))))
    if flag(get("use_liger_kernel"), where, "use_liger_kernel"):
        liger_kernel(reading, get("liger_kernel_config"))
    if is_trl and needs_met(TRL["activation_offloading"], get("activation_offloading"), data):
        reading.set("activation_offload", True, "activation_offloading")
    _precision(reading, data, is_trl)
    read_length(reading, data)
    read_clipping(reading, data)
    if get("deepspeed"):
        if not isinstance(get("deepspeed"), str):
            raise where.error("deepspeed", "give the DeepSpeed config as a file path (an inline dict is not read)")
        reading.ds_reference = ("deepspeed", get("deepspeed"))
    if get("fsdp"):
        # transformers 5.25 TrainingArguments: fsdp_config's keys lose their fsdp_ prefix, the offload
        # is cpu_offload, and FSDP2 is the version when none is given (training_args.py lines 2784-2786,
        # 2826-2830)
        trainer_fsdp_section(reading, get("fsdp"), get("fsdp_config"), 2,
                             {"version": "fsdp_version", "cpu_offload": "fsdp_offload_params"})
        accelerator = get("accelerator_config")
        kwargs = accelerator.get("gradient_accumulation_kwargs") if isinstance(accelerator, dict) else None
        if isinstance(kwargs, dict) and kwargs.get("sync_each_batch") not in (None, False, "false", "False"):
            # accelerate's GradientAccumulationPlugin(sync_each_batch=True): the Trainer's sync_context stays open
            reading.set("defer_gradient_sync", False, "accelerator_config.gradient_accumulation_kwargs.sync_each_batch")
    if is_trl:
        _trl_model(reading, data)
    return reading


# transformers 5.25 integrations/liger.py apply_liger_kernel (lines 28-53): Trainer.__init__ (trainer.py line 1509)
# calls liger_kernel's _apply_liger_kernel_to_instance(model, **liger_kernel_config) on the built model, so each part
# the config leaves out takes the family's apply_liger_kernel_to_<family> default (monkey_patch.py at ead96b61:
# rope, rms_norm, swiglu and fused_linear_cross_entropy True, cross_entropy False for Llama, Mistral, Qwen2/3, ...;
# a family whose function differs is refused by the estimate, planner/recipes/fused_kernels.py). The instance patch
# replaces the blocks' and the final norm's modules, not Qwen3's q/k norms (counted eager).
LIGER_CONFIG_KEYS = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy", "cross_entropy", "geglu",
                     "layer_norm")


def liger_kernel(reading: Reading, config: Any, key: str = "liger_kernel_config") -> None:
    """use_liger_kernel with its config -> loss liger-fused and fused_kernels."""
    config = config or {}
    if not isinstance(config, dict):
        raise reading.where.error(key, f"must be a mapping of Liger's apply arguments, got {config!r}")
    unknown = sorted(set(config) - set(LIGER_CONFIG_KEYS))
    if unknown:
        raise reading.where.error(key, f"({', '.join(unknown)}) is not read: the planner reads "
                                       f"{', '.join(LIGER_CONFIG_KEYS)}")
    on = {name: flag(config.get(name, name not in ("cross_entropy", "geglu", "layer_norm")), reading.where,
                     f"{key}.{name}") for name in LIGER_CONFIG_KEYS}
    if on["cross_entropy"]:
        raise reading.where.error(key, "(cross_entropy: true) is not modelled: Liger's cross-entropy over the whole "
                                       "logits; its fused linear cross-entropy is (fused_linear_cross_entropy)")
    if on["geglu"]:
        raise reading.where.error(key, "(geglu: true) is not modelled: Liger's GeGLU (Gemma's MLP); fused_kernels "
                                       "swiglu is the SiLU-gated MLP's")
    # layer_norm= patches only vision towers' LayerNorms, which text batches never run (axolotl.py liger_layer_norm)
    if on["fused_linear_cross_entropy"]:
        reading.set("loss", "liger-fused", "use_liger_kernel")
    parts = tuple(part for part in FUSED_KERNELS if on[part])  # the apply arguments' names are the field's
    if parts:
        reading.set("fused_kernels", parts, "use_liger_kernel")


def _precision(reading: Reading, data: dict[str, Any], is_trl: bool) -> None:
    bf16, fp16 = data.get("bf16"), data.get("fp16")
    dtype = str(data.get("dtype") or data.get("torch_dtype") or "float32")
    key = "dtype" if "dtype" in data else "torch_dtype"
    if dtype not in ("float32", "auto", "bfloat16", "float16"):
        raise reading.where.error(key, f"({dtype!r}) is not a dtype the model loads in (float32, bfloat16, float16, "
                                       "auto)")
    if dtype == "auto":
        raise reading.where.error(key, "('auto') loads the checkpoint's own dtype, which the file does not say; "
                                       "write bfloat16 or float32")
    if is_trl and bf16 is None and fp16 is not True:
        bf16 = True  # SFTConfig.__post_init__: bf16 = not fp16 when unset
    if bf16 is None and fp16 is None:
        return
    precision(reading, flag(bf16, reading.where, "bf16") if bf16 is not None else None,
              flag(fp16, reading.where, "fp16") if fp16 is not None else None, ("bf16", "fp16"),
              weights_16bit=dtype in ("bfloat16", "float16"))


def read_clipping(reading: Reading, data: dict[str, Any], null_is_unset: bool = False) -> None:
    """max_grad_norm -> gradient_clipping: the Trainer clips when it is above 0 (transformers 5.25 trainer.py
    line 1975); unset, TrainingArguments' 1.0 clips (training_args.py line 866). A null reaches the Trainer's
    ``> 0`` and fails there, unless the format drops it first (``null_is_unset``)."""
    if "max_grad_norm" in data and not (null_is_unset and data["max_grad_norm"] is None):
        reading.set("gradient_clipping", clipping_norm(data["max_grad_norm"], reading.where, "max_grad_norm"),
                    "max_grad_norm")
    else:
        reading.default("gradient_clipping", True)


def read_length(reading: Reading, data: dict[str, Any]) -> None:
    steps = data.get("max_steps")
    if steps is not None and steps != -1:
        reading.steps = whole(steps, reading.where, "max_steps")
        reading.origin["steps"] = reading.where.at("max_steps") + " max_steps"
    else:
        reading.epochs = number(data.get("num_train_epochs", 3.0), reading.where, "num_train_epochs")


def _trl_model(reading: Reading, data: dict[str, Any]) -> None:
    where, get = reading.where, data.get
    if "model_name_or_path" in data:
        model_name(reading, "model_name_or_path", get("model_name_or_path"))
    if get("attn_implementation") is not None:
        attention(reading, "attn_implementation", get("attn_implementation"))
    if "max_length" in data or "max_seq_length" in data:
        key = "max_length" if "max_length" in data else "max_seq_length"
        if get(key) is None:
            raise where.error(key, "null: sequences are not truncated, so their length is the data's; give a length")
        reading.set("seq_len", whole(get(key), where, key), key)
    else:
        reading.default("seq_len", 1024)  # SFTConfig's default max_length
    four, eight = flag(get("load_in_4bit"), where, "load_in_4bit"), flag(get("load_in_8bit"), where, "load_in_8bit")
    if four and eight:
        raise where.error("load_in_4bit", "both load_in_4bit and load_in_8bit are on; set one")
    peft = flag(get("use_peft"), where, "use_peft")
    if (four or eight) and not peft:
        raise where.error("load_in_4bit" if four else "load_in_8bit", "a quantized base trains only adapters: set "
                                                                      "use_peft: true")
    if not peft:
        return
    # a quantized base (4- or 8-bit) is the model's qlora, with its quantize_base
    reading.set("finetune", "qlora" if four or eight else "lora", "load_in_4bit" if four else "use_peft")
    if four:
        kind = str(get("bnb_4bit_quant_type", "nf4"))
        if kind not in ("nf4", "fp4"):
            raise where.error("bnb_4bit_quant_type", f"({kind!r}) must be nf4 or fp4")
        reading.set("quantize_base", kind, "bnb_4bit_quant_type" if "bnb_4bit_quant_type" in data else "load_in_4bit")
    if eight:
        reading.set("quantize_base", "int8", "load_in_8bit")
    reading.set("lora_rank", whole(get("lora_r", 16), where, "lora_r"), "lora_r")  # ModelConfig's default 16
    reading.set("lora_alpha", number(get("lora_alpha", 32), where, "lora_alpha"), "lora_alpha")
    reading.set("lora_dropout", float(get("lora_dropout", 0.05)), "lora_dropout")  # ModelConfig's default 0.05
    targets = get("lora_target_modules")
    if targets is not None:
        reading.set("lora_targets", targets if isinstance(targets, str) else ",".join(targets), "lora_target_modules")
    save = get("lora_modules_to_save") or []
    if save:
        embeddings(reading, "lora_modules_to_save", save)


def embeddings(reading: Reading, key: str, modules: Any) -> None:
    """modules_to_save: the embeddings and the head trained in full is the model's train_embeddings;
    any other module trained in full is not modelled."""
    names = set(modules if isinstance(modules, list) else [modules])
    if names <= {"embed_tokens", "lm_head"} and names:
        if names != {"embed_tokens", "lm_head"}:
            raise reading.where.error(key, f"({sorted(names)}) trains one of embed_tokens and lm_head in full: only "
                                           "both together are modelled (train_embeddings)")
        reading.set("train_embeddings", True, key)
        return
    raise reading.where.error(key, f"({sorted(names)}) trains modules other than embed_tokens and lm_head in full, "
                                   "which is not modelled")
