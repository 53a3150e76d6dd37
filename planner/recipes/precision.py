"""Precision recipes and optimizers: bits per parameter of each model state.

Sub-byte and 8-bit types are carried in bits per element so nothing rounds to zero bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from planner.recipes.optimizers import OptimizerName

Precision = Literal["bf16-mixed", "fp16-mixed", "bf16-pure", "fp32"]
Optimizer = OptimizerName  # the registry's names (planner/recipes/optimizers.py)


@dataclass(frozen=True)
class Recipe:
    weight_bits: int
    grad_bits: int
    master_bits: int  # fp32 master copy the optimizer steps on; 0 when it steps on the weights
    compute: Literal["bf16", "fp16", "fp32"]

    # What the code below the request reads of a precision, decoded here once: nothing else
    # compares a precision's name (tests/test_recipe.py checks).
    @property
    def param_bytes(self) -> int:
        """Bytes per element of the weights the model computes with (the 16-bit copy under mixed precision)."""
        return self.weight_bits // 8

    @property
    def grad_bytes(self) -> int:
        return self.grad_bits // 8

    @property
    def master_bytes(self) -> int:
        """Bytes per element of the fp32 master copy; 0 when the optimizer steps on the weights."""
        return self.master_bits // 8

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the activations: 4 in fp32, 2 in bf16 or fp16."""
        return 4 if self.compute == "fp32" else 2

    @property
    def wire_bytes(self) -> int:
        """Bytes per element of the parameters and gradients the sharded collectives move (ZeRO and
        FSDP gather and reduce the compute-dtype copy): the weights' dtype."""
        return self.weight_bits // 8

    @property
    def casts_model(self) -> bool:
        """The whole model is cast to the 16-bit compute dtype (bf16-pure): no autocast, no master copy."""
        return self.compute != "fp32" and self.master_bits == 0

    @property
    def autocast_dtype(self) -> Literal["bf16", "fp16"] | None:
        """The dtype torch.autocast runs the forward in over fp32 parameters (bf16-mixed, fp16-mixed);
        None when the model computes in its own dtype (fp32, bf16-pure). This is accelerate's
        mixed_precision and the Trainer's bf16/fp16 flags."""
        return None if self.compute == "fp32" or self.casts_model else self.compute

    def autocasts_over_weights(self, weights_are_master: bool, wrapper_casts: bool, pp: int, cp: int) -> bool:
        """Whether torch.autocast runs over the model's own fp32 weights: the framework keeps them as the
        optimizer's masters, this recipe autocasts, no sharding wrapper casts them to the compute dtype
        (FSDP's MixedPrecision: ``wrapper_casts``), and no pipeline or context split."""
        return (weights_are_master and self.autocast_dtype is not None and not wrapper_casts
                and pp == 1 and cp == 1)

    @property
    def reduced_dtype(self) -> Literal["bf16", "fp16"] | None:
        """The 16-bit compute dtype the rank casts to or autocasts in (backend/train.py); None in fp32."""
        return None if self.compute == "fp32" else self.compute

    @property
    def module_bytes(self) -> int:
        """Bytes per element of the parameters (and so the gradients) torch's module holds: fp32
        under autocast, whose gradients DDP all-reduces in fp32; the compute dtype once cast."""
        return self.compute_bytes if self.casts_model else 4

    @property
    def loss_scaling(self) -> bool:
        """fp16's narrow exponent needs dynamic loss scaling (DeepSpeed's fp16 block); bf16 and fp32 do not."""
        return self.compute == "fp16"

    def peak_dtype(self, peak_tflops: Mapping[str, float]) -> str:
        """The key of a GPU's peak_tflops the matrix multiplies run at: fp32 training runs on the
        TF32 tensor cores where the GPU has them (torch's allow_tf32 matmuls), else at fp32 rate."""
        if self.compute == "fp32":
            return "tf32" if "tf32" in peak_tflops else "fp32"
        return self.compute


RECIPES: dict[str, Recipe] = {
    # ZeRO paper (Rajbhandari et al. 2020), Sec. 3.1: mixed precision keeps fp16 weights and
    # gradients (2+2 bytes) and an fp32 master copy plus Adam moments (K = 12 bytes).
    "bf16-mixed": Recipe(weight_bits=16, grad_bits=16, master_bits=32, compute="bf16"),
    "fp16-mixed": Recipe(weight_bits=16, grad_bits=16, master_bits=32, compute="fp16"),
    # bf16 weights and grads, the optimizer steps them directly, no master copy; the moments are
    # the framework's (Framework.optimizer_state_bits): torch.optim.AdamW's take the bf16 dtype
    # (2+2+4 bytes), not the fp32 moments of the quoted ~87 GB Mistral-7B figure (2+2+8).
    "bf16-pure": Recipe(weight_bits=16, grad_bits=16, master_bits=0, compute="bf16"),
    "fp32": Recipe(weight_bits=32, grad_bits=32, master_bits=0, compute="fp32"),
}

# The spellings of each compute dtype accepted in a ds_config's communication_data_type (DeepSpeed
# 0.19.8 runtime/config.py get_communication_data_type reads fp32/fp16/bf16, lower-cased).
DTYPE_SPELLINGS: dict[str, tuple[str, ...]] = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16", "float16", "half"),
                                              "fp32": ("fp32", "float32", "float")}

def bits_to_bytes(count: int, bits: float) -> int:
    """Bytes of ``count`` elements of ``bits`` each, rounded up to whole bytes."""
    return -int(-count * bits // 8)
