"""Axolotl's YAML (``axolotl train FILE``). Keys: axolotl 0.19.0 utils/schemas/config.py
AxolotlInputConfig and its mixins (model.py, training.py, peft.py, integrations.py), read from
its wheel; axolotl pins torch, so its pydantic model is not installed here and is not run. Keys
its schema has that are not in this table are listed in the answer as unknown.

Precision: with bf16 (true or auto on a bf16 GPU) axolotl loads the model in bfloat16
(utils/models.py: torch_dtype bfloat16) and the Trainer keeps those weights: full fine-tuning
trains bf16 weights with bf16 AdamW states (bf16-pure); adapters are cast to fp32 by PEFT over the
frozen 16-bit base (bf16-mixed, the model's LoRA)."""

from __future__ import annotations

from typing import Any

from planner.jobfiles.accelerate_config import trainer_fsdp_section
from planner.jobfiles.common import TORCH_COMPILE_KEYS, attention, hf_optimizer, inert, model_name, value_needs
from planner.jobfiles.hf_trainer import embeddings, read_clipping
from planner.jobfiles.keys import Inert, Key, Modelled, Needs, Refused, Where, check_block, off
from planner.jobfiles.reading import Reading, flag, number, whole

TABLE: dict[str, Key] = {
    "base_model": Modelled("model"), "base_model_config": Modelled("model (its config)"),
    "model_type": Inert("the class that loads it; the architecture is the config's"),
    "tokenizer_type": Inert("the tokenizer"), "tokenizer_config": Inert("the tokenizer"),
    "load_in_8bit": Modelled("quantize_base int8"), "load_in_4bit": Modelled("finetune qlora"),
    "adapter": Modelled("lora / qlora"), "lora_r": Modelled("lora_rank"), "lora_alpha": Modelled("lora_alpha"),
    "lora_dropout": Modelled("lora_dropout"), "lora_target_linear": Modelled("lora_targets all-linear"),
    "lora_target_modules": Modelled("lora_targets"), "lora_modules_to_save": Modelled("train_embeddings"),
    "lora_model_dir": Inert("where the adapters are loaded from"),
    "sequence_len": Modelled("seq_len"),
    "sample_packing": Modelled("sequences are estimated full at sequence_len: what packing makes every one"),
    "eval_sample_packing": Inert("evaluation"), "pad_to_sequence_len": Modelled("as sample_packing"),
    "micro_batch_size": Modelled("micro_batch"), "gradient_accumulation_steps": Modelled("gradient_accumulation"),
    "num_epochs": Modelled("the job's length"), "max_steps": Modelled("the job's length"),
    "optimizer": Modelled("optimizer (transformers' names)"),
    "bf16": Modelled("precision"), "fp16": Modelled("precision"),
    "tf32": Refused("TF32 changes fp32 matmuls' speed, which the time model does not separate",
                    lambda v, b: off(v) or b.get("bf16") in (True, "auto") or b.get("fp16") is True, "false"),
    "gradient_checkpointing": Modelled("checkpointing full"),
    "gradient_checkpointing_kwargs": Modelled("use_reentrant: either saves the block inputs only (an int8 base's "
                                              "linears keep theirs as non-reentrant does: finetune.py int8_held_inputs; "
                                              "reentrant keeps fewer)"),
    "attn_implementation": Modelled("attention"), "flash_attention": Modelled("attention sdpa"),
    "sdp_attention": Modelled("attention sdpa"), "xformers_attention": Modelled("attention sdpa"),
    "deepspeed": Modelled("the DeepSpeed JSON, read from the files given"),
    "fsdp_version": Modelled("2 FSDP2; 1 (axolotl's default) FSDP1, estimated with FSDP2's per-unit model"), "fsdp_config": Modelled("FSDP section: accelerate's keys, written without their fsdp_ prefix as axolotl does, or with it"),
    "fsdp": Modelled("FSDP1's option list (full_shard, shard_grad_op, hybrid_shard, offload, auto_wrap), as transformers reads it"),
    "liger_fused_linear_cross_entropy": Needs("loss", "liger-fused", "Liger's fused linear cross-entropy never "
                                              "holds the logits", lambda v, b: off(v)),
    "cut_cross_entropy": Needs("loss", "cce", "cut cross-entropy never holds the logits", lambda v, b: off(v)),
    # the LigerPlugin (integrations/liger/plugin.py) hands these to the family's apply_liger_kernel_to_<family>
    # before the model loads: rope=, rms_norm=, and glu_activation as swiglu= (or geglu=, Gemma's, which the
    # estimate refuses for fused_kernels swiglu); liger_swiglu is its deprecated spelling (args.py
    # check_deprecated_swiglu). What each kernel saves: planner/recipes/fused_kernels.py
    "liger_rope": Modelled("fused_kernels rope (Liger's in-place rotary)"),
    "liger_rms_norm": Modelled("fused_kernels rms_norm (LigerRMSNorm: its input and fp32 rstd saved, not eager's fp32 "
                               "upcast and x * rsqrt)"),
    "liger_glu_activation": Modelled("fused_kernels swiglu (LigerSiLUMulFunction: gate and up saved, not act(gate))"),
    "liger_swiglu": Modelled("as liger_glu_activation (its deprecated spelling)"),
    "liger_layer_norm": Inert("Liger's layer_norm= patches only vision towers' LayerNorms (monkey_patch.py at "
                              "ead96b61: llama4, gemma3, mllama, paligemma, qwen2-vl), which text batches never run"),
    "liger_cross_entropy": Refused("Liger's cross-entropy over the whole logits is not modelled (its fused linear "
                                   "cross-entropy is: liger_fused_linear_cross_entropy)", lambda v, b: off(v),
                                   "false, or liger_fused_linear_cross_entropy"),
    "plugins": Modelled("their keys are read as keys of this file"),
    # axolotl's schema: torch_compile true, or "auto" (on from torch 2.6.0, so on under the 2.13 the planner
    # models), handed with its backend and mode to TrainingArguments
    **TORCH_COMPILE_KEYS,
    "unfrozen_parameters": Refused("trains a subset of the weights", lambda v, b: not v, "remove it"),
    "activation_offloading": Needs("activation_offload", True, "the saved activations live on the host",
                                   lambda v, b: off(v)),
    "special_tokens": Inert("new tokens resize the embeddings by a few rows"),
    "chunked_cross_entropy": Needs("loss", "chunked", "the loss computed a chunk of tokens at a time",
                                   lambda v, b: off(v)),
    "chunked_cross_entropy_num_chunks": Inert("read only with chunked_cross_entropy"),
    "use_liger_loss": Needs("loss", "liger-fused", "Liger's fused linear cross-entropy never holds the logits",
                            lambda v, b: off(v)),
    "batch_flattening": Modelled("as sample_packing"),
    # core/builders/base.py (0.19.0, line 644): passed to TrainingArguments when not null (then its 1.0)
    "max_grad_norm": Modelled("gradient_clipping: above 0 the Trainer clips; null leaves TrainingArguments' 1.0"),
    "eager_attention": Modelled("attention eager"),
    **{key: Refused("a parallel degree of accelerate's ND-parallelism (tensor, context, sequence, data shards), "
                    "read by this reader only as 1", lambda v, b: v in (None, 1), "1 or remove it")
       for key in ("tensor_parallel_size", "context_parallel_size", "sequence_parallel_degree", "dp_shard_size",
                   "data_parallel_size")},
    **{key: Refused(reason, lambda v, b: off(v), "false or remove it") for key, reason in (
        ("offload", "offloads layers"), ("layer_offloading", "offloads layers"),
        ("lora_on_cpu", "keeps the adapters on the CPU"), ("relora", "ReLoRA restarts and merges adapters"),
        ("peft_use_dora", "DoRA keeps a magnitude vector and the weight's norm"),
        ("flex_attention", "flex attention"), ("s2_attention", "shifted sparse attention"),
        ("sage_attention", "SageAttention's quantized attention"), ("fp8", "FP8 training"),
        ("deepcompile", "DeepCompile"), ("selective_checkpointing", "selective checkpointing of its own"),
        ("dynamic_checkpoint", "checkpointing decided at run time"), ("use_kernels", "hub kernels"),
        ("tiled_mlp_num_shards", "the MLP run in tiles"), ("quantize_moe_experts", "quantized experts"),
        ("model_quantization_config", "a quantization config other than load_in_4bit / load_in_8bit"),
        ("mixed_precision_policy", "an FSDP mixed-precision policy of its own"),
        ("torch_compile_options", "inductor options of its own"), ("qlora_sharded_model_loading", "loading, with FSDP1"),
        ("reshard_after_forward", "FSDP2's reshard, read from fsdp_config"),
        ("qat", "quantization-aware training (torchao's fake-quantized linears, their transients and saved tensors)"),
        ("activation_checkpointing", "activation checkpointing spelled apart from gradient_checkpointing"))},
    **inert("the data pipeline, outside the step", "datasets", "dataset_prepared_path", "val_set_size",
            "test_datasets", "shuffle_merged_datasets", "dataset_processes", "chat_template", "train_on_inputs",
            "group_by_length", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor"),
    **inert("logging, evaluation and saving", "output_dir", "wandb_project", "wandb_entity", "wandb_watch",
            "wandb_name", "wandb_log_model", "resume_from_checkpoint", "logging_steps", "evals_per_epoch",
            "saves_per_epoch", "eval_steps", "save_steps", "save_strategy", "hub_model_id", "save_first_step",
            "save_total_limit", "early_stopping_patience", "auto_resume_from_checkpoints", "local_rank",
            "strict", "seed", "save_safetensors"),
    **inert("hyper-parameters change values, not memory or time", "lr_scheduler", "learning_rate", "warmup_ratio",
            "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
            "lr_scheduler_kwargs", "cosine_min_lr_ratio"),
}


def read(data: dict[str, Any], where: Where) -> Reading:
    reading = Reading("axolotl", where)
    reading.unknown = check_block(data, TABLE, where)
    get = data.get
    model_name(reading, "base_model", get("base_model"))
    reading.set("seq_len", whole(get("sequence_len", 2048), where, "sequence_len"), "sequence_len")
    reading.set("micro_batch", whole(get("micro_batch_size", 1), where, "micro_batch_size"), "micro_batch_size")
    reading.set("gradient_accumulation", whole(get("gradient_accumulation_steps", 1), where,
                                               "gradient_accumulation_steps"), "gradient_accumulation_steps")
    if get("max_steps"):
        reading.steps = whole(get("max_steps"), where, "max_steps")
    else:
        reading.epochs = number(get("num_epochs", 1), where, "num_epochs")
    if get("optimizer") is not None:
        hf_optimizer(reading, "optimizer", get("optimizer"))
    else:
        reading.set("optimizer", "adamw", "optimizer")
    if get("gradient_checkpointing") == "offload":  # axolotl: checkpointed block inputs kept on the host
        value_needs(reading, "gradient_checkpointing", "activation_offload", True, "offload",
                    "checkpointing with the saved block inputs on the host")
        reading.set("checkpointing", "full", "gradient_checkpointing")
    else:
        reading.set("checkpointing", "full" if flag(get("gradient_checkpointing"), where, "gradient_checkpointing")
                    else "none", "gradient_checkpointing")
    if not off(get("torch_compile")):
        if get("torch_compile") is not True and str(get("torch_compile")).lower() not in ("true", "auto"):
            raise where.error("torch_compile", "axolotl takes true, false or auto")
        reading.set("compile", "model", "torch_compile")
    if get("eager_attention"):
        reading.set("attention", "eager", "eager_attention")
    if get("attn_implementation") is not None:
        attention(reading, "attn_implementation", get("attn_implementation"))
    elif any(get(k) for k in ("flash_attention", "sdp_attention", "xformers_attention")):
        reading.set("attention", "sdpa", next(k for k in ("flash_attention", "sdp_attention", "xformers_attention")
                                              if get(k)))
    _liger_parts(reading, data)
    for key, field, value in (("liger_fused_linear_cross_entropy", "loss", "liger-fused"),
                              ("use_liger_loss", "loss", "liger-fused"), ("chunked_cross_entropy", "loss", "chunked"),
                              ("cut_cross_entropy", "loss", "cce"), ("activation_offloading", "activation_offload", True)):
        if not off(get(key)):
            value_needs(reading, key, field, value, get(key), TABLE[key].reason)
    adapter = _adapter(reading, data)
    bf16 = get("bf16")
    if bf16 in (True, "auto"):
        reading.set("precision", "bf16-mixed" if adapter else "bf16-pure", "bf16")
    elif get("fp16") is True:
        reading.set("precision", "fp16-mixed", "fp16")
    else:
        reading.set("precision", "fp32", "bf16")
    read_clipping(reading, data, null_is_unset=True)
    if get("deepspeed"):
        reading.ds_reference = ("deepspeed", str(get("deepspeed")))
    if get("fsdp") or get("fsdp_config"):
        # axolotl hands fsdp and fsdp_config to transformers' TrainingArguments, but keeps FSDP1 where no
        # version is given (utils/schemas/validation.py check_fsdp_version_in_fsdp_config at 067b021)
        # and drops the keys' fsdp_ prefix itself (check_fsdp_config_kwargs_prefix)
        trainer_fsdp_section(reading, get("fsdp") or True, get("fsdp_config"), get("fsdp_version") or 1,
                             {"version": "fsdp_version"})
    return reading


def _adapter(reading: Reading, data: dict[str, Any]) -> str | None:
    where, get = reading.where, data.get
    adapter = get("adapter")
    four, eight = flag(get("load_in_4bit"), where, "load_in_4bit"), flag(get("load_in_8bit"), where, "load_in_8bit")
    if adapter in (None, ""):
        if four or eight:
            raise where.error("load_in_4bit" if four else "load_in_8bit", "a quantized base needs an adapter")
        return None
    if adapter not in ("lora", "qlora"):
        raise where.error("adapter", f"({adapter!r}) is not modelled: lora and qlora are")
    if adapter == "qlora" or four:
        reading.set("finetune", "qlora", "adapter")
        reading.set("quantize_base", "nf4", "load_in_4bit")  # bitsandbytes nf4, double quantization (axolotl's)
    else:
        # an 8-bit base is the model's qlora with quantize_base int8 (planner/recipes/finetune.py)
        reading.set("finetune", "qlora" if eight else "lora", "load_in_8bit" if eight else "adapter")
        if eight:
            reading.set("quantize_base", "int8", "load_in_8bit")
    reading.set("lora_rank", whole(get("lora_r", 8), where, "lora_r"), "lora_r")
    if get("lora_alpha") is not None:
        reading.set("lora_alpha", number(get("lora_alpha"), where, "lora_alpha"), "lora_alpha")
    reading.set("lora_dropout", float(get("lora_dropout") or 0.0), "lora_dropout")
    if get("lora_target_linear"):
        reading.set("lora_targets", "all-linear", "lora_target_linear")
    elif get("lora_target_modules"):
        modules = get("lora_target_modules")
        reading.set("lora_targets", modules if isinstance(modules, str) else ",".join(modules), "lora_target_modules")
    if get("lora_modules_to_save"):
        embeddings(reading, "lora_modules_to_save", get("lora_modules_to_save"))
    return adapter


# axolotl's Liger keys -> the fused_kernels part each turns on (integrations/liger/plugin.py pre_model_load)
LIGER_KEYS = (("liger_rms_norm", "rms_norm"), ("liger_rope", "rope"), ("liger_glu_activation", "swiglu"),
              ("liger_swiglu", "swiglu"))


def _liger_parts(reading: Reading, data: dict[str, Any]) -> None:
    """The Liger keys that are on -> fused_kernels. The plugin patches the classes before the model
    loads, so Qwen3's q/k norms run fused too, where the estimate counts them eager (as HF Trainer's
    instance patch leaves them): there it over-counts 4 bytes x (q + kv width) per token and block."""
    on = [(key, part) for key, part in LIGER_KEYS if flag(data.get(key), reading.where, key)]
    if on:
        reading.set("fused_kernels", tuple(dict.fromkeys(part for _, part in on)), on[0][0])
