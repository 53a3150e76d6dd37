"""LLaMA-Factory's YAML (``llamafactory-cli train FILE``). Keys: llamafactory 0.9.5 hparams/
model_args.py, data_args.py, finetuning_args.py, training_args.py (TrainingArguments plus its
own), read from its wheel; it pins torch and transformers, so its parser is not installed here and
is not run. TrainingArguments' keys are read by planner/jobfiles/hf_trainer.py's table.

Defaults (from that source): cutoff_len 2048, lora_rank 8, lora_alpha 2 x rank
(finetuning_args.py:568), lora_target all, gradient checkpointing on unless
disable_gradient_checkpointing, quantization_type nf4 with double_quantization. Precision: the
trainable parameters are upcast to fp32 unless pure_bf16 (model/adapter.py:316-325), so bf16 is
autocast over fp32 trainable weights (bf16-mixed); pure_bf16 is bf16-pure."""

from __future__ import annotations

from typing import Any

from planner.jobfiles.common import attention, hf_optimizer, inert, model_name, value_needs
from planner.jobfiles.hf_trainer import TRAINING_ARGUMENTS, liger_kernel, read_clipping, read_length
from planner.jobfiles.keys import Inert, Key, Modelled, Needs, Refused, Where, check_block, equals, off
from planner.jobfiles.reading import Reading, flag, number, whole
from planner.recipes.fused_kernels import LIGER_DEFAULT_PARTS

OWN: dict[str, Key] = {
    "model_name_or_path": Modelled("model"), "stage": Modelled("sft and pt are modelled"),
    "finetuning_type": Modelled("full, lora"), "lora_rank": Modelled("lora_rank"), "lora_alpha": Modelled("lora_alpha"),
    "lora_dropout": Modelled("lora_dropout"), "lora_target": Modelled("lora_targets (all: all-linear)"),
    "quantization_bit": Modelled("4: qlora, 8: quantize_base int8"), "quantization_type": Modelled("nf4 / fp4"),
    "double_quantization": Refused("without double quantization each block keeps an fp32 absmax",
                                   lambda v, b: v is not False or b.get("quantization_bit") != 4, "true"),
    "quantization_method": Refused("GPTQ / AWQ / AQLM bases", equals("bnb", "bitsandbytes"), "bnb"),
    "cutoff_len": Modelled("seq_len"), "packing": Modelled("sequences estimated full at cutoff_len"),
    "neat_packing": Modelled("as packing"),
    "disable_gradient_checkpointing": Modelled("checkpointing"),
    "pure_bf16": Modelled("bf16-pure"), "flash_attn": Modelled("attention: fa2 / sdpa / auto sdpa, disabled eager"),
    # LlamaFactory model/model_utils/liger_kernel.py: the family's apply_liger_kernel_to_<family>() before the model
    # loads, with its defaults (rope, rms_norm, swiglu and the fused linear cross-entropy; the last turned off where
    # the stage needs the logits: neither sft nor pt), planner/recipes/fused_kernels.py
    "enable_liger_kernel": Modelled("loss liger-fused and fused_kernels rms_norm, rope, swiglu (the family's "
                                    "apply_liger_kernel_to_* defaults)"),
    "use_unsloth": Refused("Unsloth's kernels and offloaded checkpointing", lambda v, b: off(v), "false"),
    "additional_target": Refused("modules trained in full beside the adapters", lambda v, b: not v, "remove it"),
    "use_dora": Refused("DoRA keeps a magnitude vector and the weight's norm", lambda v, b: off(v), "false"),
    "use_galore": Refused("GaLore projects the gradients", lambda v, b: off(v), "false"),
    "use_badam": Refused("BAdam trains one block at a time", lambda v, b: off(v), "false"),
    "use_apollo": Refused("APOLLO's low-rank states", lambda v, b: off(v), "false"),
    **{key: Refused(reason, lambda v, b: off(v), "false or remove it") for key, reason in (
        ("fp8", "FP8 training"), ("use_unsloth_gc", "Unsloth's offloaded checkpointing"),
        ("use_hyper_parallel", "its own parallelism"), ("use_v1_kernels", "its own kernels"),
        ("shift_attn", "shifted sparse attention"), ("pissa_init", "PiSSA's initialisation keeps the residual"),
        ("use_dft_loss", "the DFT loss keeps further per-token tensors"), ("use_asft_loss", "a loss of its own"),
        ("use_eaft_loss", "a loss of its own"), ("block_diag_attn", "a block-diagonal mask per packed sequence"),
        ("rope_scaling", "a RoPE scaling (the model's length changes)"), ("ref_model", "a reference model"),
        ("reward_model", "a reward model"), ("adapter_name_or_path", "adapters loaded and stacked"),
        ("kt_use_lora_experts", "KTransformers' experts"))},
    "trust_remote_code": Inert("permission to run code"), "upcast_layernorm": Inert("norm weights, a few KB"),
    "use_rslora": Inert("a scale, the same adapter shapes"),
    **inert("the data pipeline, outside the step", "dataset", "dataset_dir", "template", "max_samples",
            "overwrite_cache", "preprocessing_num_workers", "val_size", "eval_dataset", "tokenized_path",
            "streaming", "buffer_size", "mix_strategy", "media_dir", "image_max_pixels", "video_max_pixels"),
    **inert("logging and saving", "plot_loss", "include_effective_tokens_per_second"),
}
TABLE = {**TRAINING_ARGUMENTS, **OWN}


def read(data: dict[str, Any], where: Where) -> Reading:
    reading = Reading("llamafactory", where)
    reading.unknown = check_block(data, TABLE, where)
    get = data.get
    stage = str(get("stage", "sft"))
    if stage not in ("sft", "pt"):
        raise where.error("stage", f"({stage!r}) is not modelled: sft and pt are (the others hold a reference or "
                                   "reward model beside the trained one)")
    model_name(reading, "model_name_or_path", get("model_name_or_path"))
    reading.set("seq_len", whole(get("cutoff_len", 2048), where, "cutoff_len"), "cutoff_len")
    reading.set("micro_batch", whole(get("per_device_train_batch_size", 8), where, "per_device_train_batch_size"),
                "per_device_train_batch_size")
    reading.set("gradient_accumulation", whole(get("gradient_accumulation_steps", 1), where,
                                               "gradient_accumulation_steps"), "gradient_accumulation_steps")
    off_gc = flag(get("disable_gradient_checkpointing"), where, "disable_gradient_checkpointing")
    reading.set("checkpointing", "none" if off_gc else "full", "disable_gradient_checkpointing")
    if get("optim") is not None:
        hf_optimizer(reading, "optim", get("optim"))
    flash = str(get("flash_attn", "auto"))
    attention(reading, "flash_attn", {"fa2": "flash_attention_2", "auto": "sdpa", "sdpa": "sdpa",
                                      "disabled": "eager"}.get(flash, flash))
    if flag(get("enable_liger_kernel"), where, "enable_liger_kernel"):
        reading.set("loss", "liger-fused", "enable_liger_kernel")
        reading.set("fused_kernels", LIGER_DEFAULT_PARTS, "enable_liger_kernel")
    elif flag(get("use_liger_kernel"), where, "use_liger_kernel"):  # the Trainer's own instance patch
        liger_kernel(reading, get("liger_kernel_config"))
    kind = str(get("finetuning_type", "lora"))
    if kind not in ("full", "lora"):
        raise where.error("finetuning_type", f"({kind!r}) is not modelled: full and lora are")
    if kind == "lora":
        _lora(reading, data)
    pure = flag(get("pure_bf16"), where, "pure_bf16")
    if pure:
        reading.set("precision", "bf16-pure", "pure_bf16")
    elif get("bf16") is True:
        reading.set("precision", "bf16-mixed", "bf16")
    elif get("fp16") is True:
        reading.set("precision", "fp16-mixed", "fp16")
    else:
        reading.set("precision", "fp32", "bf16")
    read_length(reading, data)
    read_clipping(reading, data)
    if get("deepspeed"):
        reading.ds_reference = ("deepspeed", str(get("deepspeed")))
    return reading


def _lora(reading: Reading, data: dict[str, Any]) -> None:
    where, get = reading.where, data.get
    bits = get("quantization_bit")
    if bits not in (None, 4, 8):
        raise where.error("quantization_bit", f"({bits!r}) is not modelled: 4 and 8 are")
    reading.set("finetune", "lora" if bits is None else "qlora", "finetuning_type")
    if bits == 4:
        kind = str(get("quantization_type", "nf4"))
        if kind not in ("nf4", "fp4"):
            raise where.error("quantization_type", f"({kind!r}) must be nf4 or fp4")
        reading.set("quantize_base", kind, "quantization_bit")
    elif bits == 8:
        reading.set("quantize_base", "int8", "quantization_bit")
    rank = whole(get("lora_rank", 8), where, "lora_rank")
    reading.set("lora_rank", rank, "lora_rank")
    reading.set("lora_alpha", number(get("lora_alpha") or 2 * rank, where, "lora_alpha"), "lora_alpha")
    reading.set("lora_dropout", float(get("lora_dropout") or 0.0), "lora_dropout")
    target = get("lora_target", "all")
    target = ",".join(target) if isinstance(target, list) else str(target)
    reading.set("lora_targets", "all-linear" if target == "all" else target, "lora_target")
