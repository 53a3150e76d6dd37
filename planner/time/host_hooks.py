"""The host time a framework's own Python adds to every micro-batch, beside the model's eager kernels.

DeepSpeed ZeRO-3 runs a pre- and post-forward hook on every nn.Module and the matching pair in
backward (deepspeed 0.19.8 runtime/zero/parameter_offload.py _register_deepspeed_module; the hooks
call partitioned_param_coordinator.py fetch_sub_module and release_sub_module, which gather, wait for
and release the module's parameters, and wrap the module's outputs in autograd functions for the
backward hooks); ZeRO-1 and ZeRO-2 run a Python hook on every parameter's gradient (runtime/zero/
stage_1_and_2.py create_gradient_handling_hooks, each calling reduce_ready_partitions_and_remove_grads);
FSDP2 runs its pre/post forward and backward hooks once per fully_shard unit (torch 2.13
distributed/fsdp/_fully_shard/_fsdp_state.py); DDP's reducer hooks are C++ and none is charged. Each is measured by bench/host_hooks.py on CPU ranks,
in eager ops of the same host (planner/data/host_hooks.json), and charged at the time model's
host time per eager kernel (kernels.HOST_SECONDS_PER_KERNEL): the host's speed cancels in the ratio.
FSDP1 does not run on CPU ranks (torch 2.13's FullyShardedDataParallel needs an accelerator): it is
charged FSDP2's figure per unit, an assumption the term's source says.

Where the host's work for a pass outlasts the GPU's, the GPU waits (planner/time/kernels.py
host_exposed_seconds): a small model's short kernels under ZeRO-3 are host-bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from planner.model.architecture import derived_memo, layer_specs
from planner.model.linears import attention_linears, block_linears
from planner.model.shapes import parameter_shapes

DATA = Path(__file__).resolve().parent.parent / "data" / "host_hooks.json"
# modules DeepSpeed hooks outside the blocks: the model, its decoder, the embedding, the final norm and the LM head
EDGE_MODULES = 5
# modules of a block beyond its linears and norms: the block, its attention, its MLP, the MLP's activation
BLOCK_CONTAINERS = 4
# PEFT's LoRA (peft 0.21 tuners/lora/layer.py LoraLayer): each adapted linear becomes a wrapper holding the
# base layer, the lora_A, lora_B, lora_dropout and lora_magnitude_vector ModuleDicts, the lora_embedding_A and
# _B ParameterDicts (modules too), the A and B linears and the dropout: ten modules more, and the model gains
# the PeftModel and LoraModel wrappers (counted on a two-block Llama with two adapted linears per block:
# 33 modules, 75 after get_peft_model); the adapter's trained tensors are A's and B's weights
PEFT_MODULES_PER_ADAPTER = 10
PEFT_WRAPPERS = 2
ADAPTER_TENSORS = 2


@dataclass(frozen=True)
class HookRate:
    """Eager ops' worth of host time per hooked thing, forward and backward."""

    forward_ops: float
    backward_ops: float
    per: str  # "module", "parameter" or "unit"
    source: str


@lru_cache(maxsize=1)
def _measured() -> dict:
    return json.loads(DATA.read_text())


@lru_cache(maxsize=None)
def rate(measured: str) -> HookRate:
    """The measured host cost of one module, parameter or unit a framework hooks (planner/data/host_hooks.json,
    by the name bench/host_hooks.py measured it under: zero1, zero2, zero3, fsdp2)."""
    data = _measured()
    figures = data["frameworks"][measured]
    per = figures["per"]
    return HookRate(figures[f"forward_ops_per_{per}"], figures[f"backward_ops_per_{per}"], per,
                    f"{measured}'s hooks, {data['source']}")


def hooked(arch, per: str, adapted: int | None = None, trained_head: bool = False) -> int:
    """How many modules, parameter tensors or FSDP units of the model a framework's hooks run for: every
    module (each block's linears and norms, its BLOCK_CONTAINERS, and the EDGE_MODULES around the blocks; a
    mixture of experts' MLP as its router and its experts' module), every parameter tensor with a gradient
    (planner/model/shapes.py parameter_shapes), or every block plus the root unit. ``adapted`` (LoRA: the
    adapted linears' count): PEFT's modules join the model's, and the gradients are the adapters' (and the
    trained copy of the head, ``trained_head``)."""
    if per == "unit":
        return arch.num_layers + 1
    if per == "parameter":
        return len(parameter_shapes(arch)) if adapted is None else ADAPTER_TENSORS * adapted + int(trained_head)
    if adapted is not None:
        return hooked(arch, per) + PEFT_WRAPPERS + PEFT_MODULES_PER_ADAPTER * adapted
    memo = derived_memo(arch)
    if "_hooked_modules" not in memo:  # the plan asks for every setting
        memo["_hooked_modules"] = EDGE_MODULES + sum(_block_modules(arch, spec) for spec in layer_specs(arch))
    return memo["_hooked_modules"]


def _block_modules(arch, spec) -> int:
    moe = spec.mlp.is_moe
    linears = attention_linears(arch, spec) if moe else block_linears(arch, spec)
    experts = 2 if moe else 0  # the router and the experts' module (its weights as parameters, no nn.Linear)
    return len(linears) + experts + spec.norms + BLOCK_CONTAINERS
