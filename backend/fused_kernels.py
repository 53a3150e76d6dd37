"""Liger-Kernel's block kernels on a rank (planner/recipes/fused_kernels.py models them): the model instance
patched as HF Trainer's ``use_liger_kernel`` patches it (transformers' Trainer calls
liger_kernel.transformers._apply_liger_kernel_to_instance with the parts on, monkey_patch.py at ead96b61),
its own loss left alone (the loss is ``loss``'s). Triton: GPU only; liger_kernel is imported here alone."""

from __future__ import annotations

import torch


def apply_fused_kernels(model: torch.nn.Module, kernels: tuple[str, ...]) -> None:
    """Patch ``model``'s norms (rms_norm), rotary (rope) and gated MLPs (swiglu) in place."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # optional, GPU only

    parts = set(kernels)
    _apply_liger_kernel_to_instance(model=model, rope="rope" in parts, rms_norm="rms_norm" in parts,
                                    swiglu="swiglu" in parts, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
