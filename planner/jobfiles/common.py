"""Pieces two or more formats share: the HF Trainer's optimizer and attention names (Axolotl and
LLaMA-Factory pass theirs through to transformers' TrainingArguments), the precision a bf16/fp16
pair means, and values that wait for a schema field (``value_needs``)."""

from __future__ import annotations

from typing import Any

from planner.jobfiles.keys import Inert, Key, Needs, Refused, off, schema_accepts
from planner.jobfiles.reading import Reading


def inert(reason: str, *keys: str) -> dict[str, Key]:
    return {key: Inert(reason) for key in keys}


# transformers 5.x training_args.py OptimizerNames -> this model's optimizer. The 32-bit AdamW
# variants keep the same two fp32 moments (fused/foreach/apex change kernels, not states); paged
# 32-bit states are allocated on the device and evicted to the host only under memory pressure,
# so counting them on the device is the bound. "sgd" is torch.optim.SGD with momentum 0 unless
# optim_args sets one (trainer_optimizer.py _get_sgd): ``hf_sgd_momentum``.
HF_OPTIMIZERS: dict[str, str] = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_apex_fused": "adamw", "adamw_hf": "adamw",
    "adamw_torch_npu_fused": "adamw", "adamw_anyprecision": "adamw", "paged_adamw_32bit": "adamw",
    "adamw_bnb_8bit": "adamw-8bit", "adamw_8bit": "adamw-8bit",
    "paged_adamw_8bit": "adamw-paged-8bit", "paged_adamw": "adamw",
    "adamw_torch_8bit": "adamw-torchao-8bit", "adamw_torch_4bit": "adamw-torchao-4bit",
    "lion_32bit": "lion", "paged_lion_32bit": "lion", "sgd": "sgd",
}
# Optimizers whose states this model does not count, refused by name; where the reason is more
# than that, HF_OPTIMIZER_REASONS says it.
HF_OPTIMIZERS_REFUSED = ("adafactor", "adagrad", "rmsprop", "galore_adamw", "galore_adamw_8bit", "galore_adafactor",
                         "lomo", "adalomo", "grokadamw", "schedule_free_adamw", "schedule_free_sgd", "apollo_adamw",
                         "stable_adamw", "lion_8bit", "paged_lion_8bit", "rmsprop_bnb", "ademamix", "ademamix_8bit")
HF_OPTIMIZER_REASONS = {
    "adafactor": "it is transformers' own Adafactor (optimization.py: fp32 states and an fp32 update for 16-bit "
                 "parameters), not torch.optim.Adafactor, which optimizer=adafactor models",
    "lion_8bit": "8-bit Lion states are not a choice of this model (lion_32bit is: optimizer=lion)",
}


def hf_sgd_momentum(optim_args: Any) -> bool:
    """Whether an optim_args string ("momentum=0.9,nesterov=True") gives SGD a momentum buffer
    (transformers' _parse_optim_args splits on commas and '=')."""
    for pair in str(optim_args or "").replace(" ", "").split(","):
        key, _, value = pair.partition("=")
        if key == "momentum":
            try:
                return float(value) != 0.0
            except ValueError:
                return True  # a value float() cannot read: the Trainer fails on it; do not assume no state
    return False


def value_needs(reading: Reading, key: str, field: str, value: Any, shown: Any, reason: str) -> None:
    """Set ``field`` to ``value`` if the schema takes it, else refuse ``key`` by name."""
    if not schema_accepts(field, value):
        raise reading.where.error(key, f"({shown!r}) is not modelled yet: {reason}; it needs the request field "
                                       f"{field}={value!r}, which this build's schema does not have, so it is refused")
    reading.set(field, value, key)


def hf_optimizer(reading: Reading, key: str, name: Any) -> None:
    text = str(name).lower()
    if text in HF_OPTIMIZERS:
        target = HF_OPTIMIZERS[text]
        value_needs(reading, key, "optimizer", target, name, f"the {name} optimizer's states")
        return
    known = sorted(HF_OPTIMIZERS)
    why = HF_OPTIMIZER_REASONS.get(text) or ("its states are not counted by this model" if text in HF_OPTIMIZERS_REFUSED
                                              else "not an optimizer name transformers' TrainingArguments takes")
    raise reading.where.error(key, f"({name!r}) is refused: {why}; use one of {', '.join(known)}")


# attn_implementation values that run FlashAttention-3 (flash-attn's Hopper build): transformers'
# "flash_attention_3" (flash_attn_interface, or its Hub fallback) and the Hub's FlashAttention-3
# kernels (transformers 5.25.0 modeling_flash_attention_utils.py FLASH_ATTN_KERNEL_FALLBACK, lines 65-72)
HOPPER_FLASH_ATTENTION_3 = ("flash_attention_3", "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3")


def attention(reading: Reading, key: str, name: Any) -> None:
    """attn_implementation -> the model's attention: flash and SDPA keep no score matrix (sdpa),
    eager does."""
    text = str(name)
    if text in ("flash_attention_2", "flash_attention_3", "sdpa", "flash") or text.startswith("kernels-community/"):
        reading.set("attention", "sdpa", key)
        if text in HOPPER_FLASH_ATTENTION_3:  # timed at its own rates; other names run FlashAttention-2 or SDPA
            reading.set("attention_kernel", "flash-attention-3", key)
    elif text == "eager":
        reading.set("attention", "eager", key)
    else:
        raise reading.where.error(key, f"({name!r}) is not modelled: only eager, sdpa and flash attention are; "
                                       "the estimate would be wrong, so it is refused")


def precision(reading: Reading, bf16: Any, fp16: Any, keys: tuple[str, str], weights_16bit: bool = False) -> None:
    """bf16/fp16 switches: autocast over fp32 weights (the Trainer's mixed precision), or, when the
    model is loaded in 16 bit (``weights_16bit``), 16-bit weights and optimizer states (bf16-pure)."""
    on = [k for k, v in zip(keys, (bf16, fp16)) if v is True]
    if len(on) == 2:
        raise reading.where.error(keys[0], f"both {keys[0]} and {keys[1]} are on; set one")
    if not on:
        if bf16 is not None or fp16 is not None:
            reading.set("precision", "fp32", keys[0])
        return
    if on[0] == keys[0]:
        reading.set("precision", "bf16-pure" if weights_16bit else "bf16-mixed", keys[0])
    else:
        if weights_16bit:
            raise reading.where.error(keys[1], "fp16 training of weights loaded in fp16 is not modelled (the "
                                               "Trainer refuses it: no fp32 master copy to unscale into)")
        reading.set("precision", "fp16-mixed", keys[1])


def is_local_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def model_name(reading: Reading, key: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise reading.where.error(key, f"must name a model (a Hub id or a local path), got {value!r}")
    if is_local_path(value):
        reading.set("model_path", value, key)  # the job joins it to a config.json given beside it
    else:
        reading.set("model", value, key)


# torch.compile as the planner models it: inductor in its default mode (planner/recipes/compile.py)
def compile_backend_neutral(value: Any, block: dict[str, Any] | None = None) -> bool:
    return value is None or str(value).lower() == "inductor"


def compile_mode_neutral(value: Any, block: dict[str, Any] | None = None) -> bool:
    return value is None or str(value).lower() == "default"


# TrainingArguments' three torch.compile keys, which axolotl hands on as they are (axolotl
# utils/schemas/config.py torch_compile). transformers 5 TrainingArguments.__post_init__: a backend
# or a mode turns torch_compile on, the backend defaults to inductor (training_args.py lines
# 1621-1629); Trainer hands both to accelerate's TorchDynamoPlugin, which compiles the whole model
# (trainer.py lines 796-801)
TORCH_COMPILE_KEYS: dict[str, Key] = {
    "torch_compile": Needs("compile", "model", "the whole model compiled by inductor (fused elementwise kernels)",
                           lambda v, b: off(v)),
    "torch_compile_backend": Refused("a torch.compile backend other than inductor", compile_backend_neutral,
                                     "inductor, or remove it"),
    "torch_compile_mode": Refused("a torch.compile mode other than the default: max-autotune's Triton matmul "
                                  "templates and reduce-overhead's CUDA graphs are not modelled", compile_mode_neutral,
                                  "default, or remove it"),
}
