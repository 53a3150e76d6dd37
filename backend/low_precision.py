"""Low-precision linears on a rank (planner/recipes/low_precision.py models them): torchao's
float8 and MX linears swapped into the transformers model as torchtitan's converters swap them
(components/quantization/utils.py module_filter_fn: both dimensions multiples of 16, the LM head
left out). torchao is optional and CUDA-only here: imported inside the rank (bench/gpu_check.py)."""

from __future__ import annotations

import dataclasses

import torch

FLOAT8 = {"float8-tensorwise": "tensorwise", "float8-rowwise": "rowwise"}


def _filter(model: torch.nn.Module, multiple: int):
    head = model.get_output_embeddings()

    def keep(module: torch.nn.Module, _fqn: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and module is not head
                and module.in_features % multiple == 0 and module.out_features % multiple == 0)

    return keep


def convert(model: torch.nn.Module, name: str, fp8_all_gather: bool = False) -> torch.nn.Module:
    """Swap the model's linears for the recipe's (in place), before FSDP2 wraps it; ``none`` leaves
    it. ``fp8_all_gather``: the converted weights become torchao's WeightWithDynamicFloat8CastTensor,
    which FSDP2 gathers in fp8 (Float8LinearConfig.enable_fsdp_float8_all_gather, as torchtitan sets it)."""
    if name == "none":
        return model
    if name in FLOAT8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional, GPU only

        config = Float8LinearConfig.from_recipe_name(FLOAT8[name])
        if fp8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config, module_filter_fn=_filter(model, 16))
        return model
    if name == "mxfp8":
        from torchao.prototype.mx_formats import MXLinearConfig  # optional, Blackwell only
        from torchao.quantization import quantize_

        quantize_(model, config=MXLinearConfig.from_recipe_name("mxfp8_cublas"), filter_fn=_filter(model, 16))
        return model
    raise ValueError(f"low_precision={name}: the probe swaps torchao's float8 and mxfp8 linears only")
