"""Other tools' memory rules, reimplemented for side-by-side comparison (never for our estimate).

- DeepSpeed 0.19.8, deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs
  and stage3.py estimate_zero3_model_states_mem_needs (no offload): 2Ψ + 18Ψ/N for ZeRO-2 and
  4·largest_layer + 18Ψ/N for ZeRO-3, bytes per GPU. tests/test_peers.py checks these equal
  DeepSpeed's own functions.
- `accelerate estimate-memory` (accelerate/commands/estimate.py): training with Adam needs about
  4x the model's size in the training dtype (the "Training using Adam (Peak vRAM)" column).
"""

from __future__ import annotations


def deepspeed_zero2_gpu_bytes(total_params: int, gpus_per_node: int, nodes: int) -> int:
    total_gpus = gpus_per_node * nodes
    return int(2 * total_params + int(18 * total_params / total_gpus))


def deepspeed_zero3_gpu_bytes(total_params: int, largest_layer_params: int, gpus_per_node: int, nodes: int) -> int:
    total_gpus = gpus_per_node * nodes
    return int(4 * largest_layer_params + int(18 * total_params / total_gpus))


def accelerate_adam_training_bytes(total_params: int, dtype_bytes: int) -> int:
    return 4 * total_params * dtype_bytes
