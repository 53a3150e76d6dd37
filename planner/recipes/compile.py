"""torch.compile as the request names it (``compile``): what it changes and what the planner models.

- "blocks": torch.compile applied to each transformer block, as torchtitan's apply_compile does for
  ``compile.components`` containing "model" (torchtitan models/llama3/infra/parallelize.py), its loss
  compiled apart ("loss", the default second component);
- "model": the whole model compiled once, as HF Trainer's ``torch_compile: true`` and accelerate's
  ``dynamo_backend: INDUCTOR`` do (inductor, default mode).

Step time: inductor's fused kernels (planner/time/fusion.py). Memory: AOTAutograd splits the joint
forward-backward graph with functorch's min_cut_rematerialization_partition (torch 2.13,
torch/_functorch/partitioners.py; inductor's compile_fx passes it with compiler="inductor"), which saves
the cut of fewest bytes between forward and backward and recomputes the cheap pointwise ops in backward.
What eager autograd saves is one such cut, so a compiled block saves at most eager's bytes; the
planner keeps eager's saved set (planner/model/activations.py) as the compiled run's, an upper bound.
Measured on CPU (tests/test_compile.py: the partitioner's forward outputs against saved-tensor
hooks of the same block in eager), the compiled Llama, Qwen3 and GPT-2 blocks save 63-74% of eager's
bytes: the bound is loose by that much, on the side that does not send a job to OOM.

Under a checkpoint (torchtitan wraps each block before compiling it, models/llama3/parallelize.py at b5bcd76:
"turn on per-TransformerBlock compile after AC wrapping") dynamo traces the checkpointed region and tags its
ops with the policy (torch 2.13 utils/checkpoint.py _CachingTorchDispatchMode: ``fx_traceback.current_meta[
"recompute"] = policy`` when compiling; a plain checkpoint, as Megatron-style core-attention recompute runs,
tags every op PREFER_RECOMPUTE). The partitioner then recomputes every PREFER_RECOMPUTE node backward needs
(partitioners.py solve_min_cut: ``must_recompute``, an infinite edge to the sink) and never recomputes a
MUST_SAVE one (should_ban_recomputation: "marked MUST_SAVE"): it saves the policy's MUST_SAVE outputs that
backward reads, and the block's input. Eager SAC keeps every MUST_SAVE output in its cache until the recompute
(_CachingTorchDispatchMode's storage), read or not; core-attention recompute keeps the core's inputs and output.
Measured on CPU (tests/test_compile_checkpointing.py, one bf16 block of 97 tokens; the allocator's live bytes
after the forward, eager and inductor alike):
- selective-op (torchtitan's per-op SAC): eager 308,848 B, to the byte the planner's count; compiled 258,796 B,
  0.84 of it, in Llama and Qwen3 alike: q's, v's and gate's outputs and SDPA's output and logsumexp, without
  down_proj's output (eager's cache holds it, no backward node reads it);
- selective-attention: compiled 0.66 (Llama) and 0.60 (Qwen3) of eager's: the partitioner saves the rotated q
  and k and v and recomputes the attention forward in backward (with its RNG state), so not even the core's
  output is kept.
Whole tiny Llama and Qwen3 models (two fp32 blocks, the loss with them), compiled blocks and the whole model
save 0.83-0.89 of eager SAC's bytes and 0.69-0.75 of eager core-attention recompute's, their peaks under the
planner's. So the
planner keeps eager's set for these policies too, an upper bound. Time: the recompute reruns what the policy
recomputes: the same linears as eager (kernels.recompute_shares; 17 matmuls in the compiled SAC block's backward
against 14 without a checkpoint; core-attention recompute: the attention forward), and the forward's elementwise
kernels as inductor fuses them among the backward's (planner/time/fusion.py recompute_bytes: matched to inductor's
own per-kernel bytes on CPU under per-op SAC for Llama, Qwen3 and OLMo-2).
"""

from __future__ import annotations

from typing import Literal

from planner.errors import PlannerError

Compile = Literal["none", "blocks", "model"]
COMPILE_HELP = ("torch.compile (inductor, default mode): none; blocks (each transformer block compiled, and the loss: "
                "torchtitan's compile.enable); model (the whole model: HF Trainer torch_compile, accelerate "
                "dynamo_backend INDUCTOR). Step time from inductor's fused kernels; memory kept at eager's saved "
                "tensors, an upper bound (the partitioner saves at most what eager saves, under every checkpointing "
                "policy)")


def accumulates(mode: str) -> bool:
    """Whether gradient accumulation is modelled under compile ``mode``: not under the whole model, whose
    backward returns every gradient when it ends, beside the accumulated ones (check_compile). The plan
    searches one micro-batch per rank where it is not (planner/plan/settings.py, inverse.py)."""
    return mode != "model"


def check_compile(request, dims) -> None:
    """What compile is not modelled with: a pipeline (its stages are compiled apart from the schedule's
    sends), activation offloading (hooks around compiled saves), LoRA/QLoRA (PEFT's adapters under
    inductor were not measured), and the whole model compiled under gradient accumulation (its backward
    returns every gradient when it ends, beside the accumulated ones: not in the memory model, whose peak a
    tiny CPU Llama exceeded by 4%). Every checkpointing policy is (the module docstring)."""
    mode = request.compile
    if mode == "none":
        return
    why = None
    if dims.pp > 1:
        why = f"pp={dims.pp}: pipeline stages compiled apart from the schedule are not modelled"
    elif request.activation_offload:
        why = "activation_offload: offloading hooks around compiled saves are not modelled"
    elif request.finetune != "full":
        why = f"finetune {request.finetune}: PEFT's adapters under inductor were not measured"
    elif not accumulates(mode) and request.gradient_accumulation > 1:
        why = (f"gradient_accumulation {request.gradient_accumulation}: a whole-model compiled backward returns every "
               "parameter's gradient when it ends, so from the second micro-batch on a full set is held beside the "
               "accumulated .grad (on a tiny CPU Llama the peak came out 4% over the modelled one), which the "
               "memory model does not hold; use compile blocks or gradient_accumulation 1")
    if why:
        raise PlannerError(f"compile {mode} with {why}; estimate without compile, or change that field",
                           field="compile")


# what the compiled partitioner saves against eager's set, measured on CPU (the module docstring)
_MEASURED = {"none": "63-74% of it in the CPU blocks measured",
             "full": "a checkpointed block keeps its input, as eager; an unchecked one 63-74% of eager's in the CPU "
             "blocks measured",
             "selective-op": "84% of eager per-op SAC's in the CPU blocks measured: down_proj's output, cached by "
             "eager SAC, is not saved",
             "selective-attention": "60-66% of eager core-attention recompute's in the CPU blocks measured: the "
             "attention forward is recomputed whole"}


def compile_note(mode: str, checkpointing: str = "none") -> str | None:
    """What the estimate assumes under compile, for the result's notes."""
    if mode == "none":
        return None
    what = "each transformer block and the loss" if mode == "blocks" else "the whole model"
    recompute = ("" if checkpointing == "none" else f"; checkpointing {checkpointing}: its recompute reruns the fused "
                 "kernels of what the policy recomputes")
    return (f"torch.compile ({what}, inductor): step time from inductor's fused elementwise kernels "
            "(planner/time/fusion.py, read off inductor's source, CUDA unmeasured); activations kept at eager's saved "
            f"tensors, an upper bound: the partitioner saves at most what eager saves ({_MEASURED[checkpointing]})"
            f"{recompute}")
