"""LoRA and QLoRA on top of the transformers model a rank builds (imported only inside a rank).

What a user's script does, in the order it does it: the base model in its storage type (16-bit,
or its linears quantized with bitsandbytes as ``from_pretrained(quantization_config=
BitsAndBytesConfig(...))`` leaves them), ``peft.prepare_model_for_kbit_training`` for a quantized
base (it freezes everything and upcasts the 16-bit parameters that remain to fp32), then
``peft.get_peft_model`` with a ``LoraConfig``. The job's ``finetune`` entry is what
planner.recipes.finetune resolved (rank, alpha, target module names or "all-linear", dropout,
quantization, trained embeddings).
"""

from __future__ import annotations

from typing import Any

import torch

# transformers' bitsandbytes integration quantizes every nn.Linear except the modules it keeps
# (integrations/bitsandbytes.py replace_with_bnb_linear, modules_to_not_convert from
# get_keys_to_not_convert: the output embeddings); Params4bit's default blocksize is 64
# (bitsandbytes/nn/modules.py Params4bit.__new__) and double quantization
# (compress_statistics=True) quantizes the absmax in blocks of 256 (functional.py quantize_4bit).
BLOCKSIZE_4BIT = 64


def base_dtype(job: dict[str, Any]) -> torch.dtype:
    """The dtype the frozen base is loaded in: what the rank's engine would train in (the
    compute dtype for 16-bit recipes, as a user passes torch_dtype=bfloat16), fp32 otherwise."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job["finetune"].get("base_dtype"), torch.float32)


def _quantized_linear(linear: torch.nn.Linear, quantize: str, compute_dtype: torch.dtype,
                      double: bool = True) -> torch.nn.Module:
    import bitsandbytes as bnb

    bias = linear.bias is not None
    if quantize in ("nf4", "fp4"):
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=compute_dtype,
                                compress_statistics=double, quant_type=quantize)
        new.weight = bnb.nn.Params4bit(linear.weight.data.to(compute_dtype), requires_grad=False,
                                       compress_statistics=double, quant_type=quantize, blocksize=BLOCKSIZE_4BIT)
    else:  # int8: LLM.int8() (Dettmers et al. 2022), bitsandbytes' default threshold 6.0
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                  threshold=6.0)
        new.weight = bnb.nn.Int8Params(linear.weight.data.to(compute_dtype), requires_grad=False,
                                       has_fp16_weights=False)
    if bias:
        new.bias = torch.nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
    return new.to("cpu") if linear.weight.device.type == "cpu" else new.to(linear.weight.device)  # quantizes


def quantize_linears(model: torch.nn.Module, quantize: str, compute_dtype: torch.dtype, double: bool = True) -> None:
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child is not head:
                setattr(parent, name, _quantized_linear(child, quantize, compute_dtype, double))


def apply_finetune(model: torch.nn.Module, job: dict[str, Any]) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    spec = job["finetune"]
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.get("compute_dtype"), torch.float32)
    if spec["quantize"] != "none":
        quantize_linears(model, spec["quantize"], compute, bool(spec.get("double_quant", True)))
        model.is_loaded_in_4bit = spec["quantize"] != "int8"  # what from_pretrained sets; PEFT reads them
        model.is_loaded_in_8bit = spec["quantize"] == "int8"
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=job["checkpointing"] == "full",
            gradient_checkpointing_kwargs={"use_reentrant": False})
    targets = spec["targets"]
    config = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"], bias="none",
                        target_modules=targets if targets == "all-linear" else list(targets),
                        modules_to_save=list(spec.get("modules_to_save") or []) or None, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    if job["checkpointing"] == "full" and spec["quantize"] == "none":
        model.base_model.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model

