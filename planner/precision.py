"""Precision recipes and optimizers: bits per parameter of each model state.

Sub-byte and 8-bit types are carried in bits per element so nothing rounds to zero bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Precision = Literal["bf16-mixed", "fp16-mixed", "bf16-pure", "fp32"]
Optimizer = Literal["adamw", "adamw-8bit", "sgd"]


@dataclass(frozen=True)
class Recipe:
    weight_bits: int
    grad_bits: int
    master_bits: int  # fp32 master copy the optimizer steps on; 0 when it steps on the weights
    compute: Literal["bf16", "fp16", "fp32"]


RECIPES: dict[str, Recipe] = {
    # ZeRO paper (Rajbhandari et al. 2020), Sec. 3.1: mixed precision keeps fp16 weights and
    # gradients (2+2 bytes) and an fp32 master copy plus Adam moments (K = 12 bytes).
    "bf16-mixed": Recipe(weight_bits=16, grad_bits=16, master_bits=32, compute="bf16"),
    "fp16-mixed": Recipe(weight_bits=16, grad_bits=16, master_bits=32, compute="fp16"),
    # bf16 weights and grads, optimizer steps on them directly, fp32 moments: 2+2+8 bytes, the
    # ~87 GB Mistral-7B full fine-tune figure.
    "bf16-pure": Recipe(weight_bits=16, grad_bits=16, master_bits=0, compute="bf16"),
    "fp32": Recipe(weight_bits=32, grad_bits=32, master_bits=0, compute="fp32"),
}

# bitsandbytes 8-bit optimizers quantize each state block-wise with one fp32 absmax per block of
# 2048 values (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", Sec. 2.1).
BNB_BLOCK = 2048


def optimizer_state_bits(optimizer: str) -> float:
    """Bits per parameter the optimizer keeps, beyond any master copy."""
    if optimizer == "adamw":
        return 2 * 32  # exp_avg and exp_avg_sq in fp32
    if optimizer == "adamw-8bit":
        return 2 * (8 + 32 / BNB_BLOCK)
    if optimizer == "sgd":
        return 32  # one momentum buffer in fp32
    raise ValueError(optimizer)


def optimizer_state_count(optimizer: str) -> int:
    """Tensors the optimizer keeps per parameter (torch's AdamW: exp_avg, exp_avg_sq)."""
    return {"adamw": 2, "adamw-8bit": 2, "sgd": 1}[optimizer]


def bits_to_bytes(count: int, bits: float) -> int:
    """Bytes of ``count`` elements of ``bits`` each, rounded up to whole bytes."""
    return -int(-count * bits // 8)
