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
"""

from __future__ import annotations

from typing import Literal

from planner.errors import PlannerError

Compile = Literal["none", "blocks", "model"]
COMPILE_HELP = ("torch.compile (inductor, default mode): none; blocks (each transformer block compiled, and the loss: "
                "torchtitan's compile.enable); model (the whole model: HF Trainer torch_compile, accelerate "
                "dynamo_backend INDUCTOR). Step time from inductor's fused kernels; memory kept at eager's saved "
                "tensors, an upper bound (the partitioner saves at most what eager saves)")


def check_compile(request, dims) -> None:
    """What compile is not modelled with: a pipeline (its stages are compiled apart from the schedule's
    sends), selective checkpointing policies (the partitioner's cut under checkpoint tags was not
    measured), activation offloading (hooks around compiled saves), LoRA/QLoRA (PEFT's adapters under
    inductor were not measured)."""
    mode = request.compile
    if mode == "none":
        return
    why = None
    if dims.pp > 1:
        why = f"pp={dims.pp}: pipeline stages compiled apart from the schedule are not modelled"
    elif request.checkpointing in ("selective-op", "selective-attention"):
        why = (f"checkpointing {request.checkpointing}: what the partitioner saves under the policy's checkpoint tags "
               "was not measured (none and full are)")
    elif request.activation_offload:
        why = "activation_offload: offloading hooks around compiled saves are not modelled"
    elif request.finetune != "full":
        why = f"finetune {request.finetune}: PEFT's adapters under inductor were not measured"
    if why:
        raise PlannerError(f"compile {mode} with {why}; estimate without compile, or change that field",
                           field="compile")


def compile_note(mode: str) -> str | None:
    """What the estimate assumes under compile, for the result's notes."""
    if mode == "none":
        return None
    what = "each transformer block and the loss" if mode == "blocks" else "the whole model"
    return (f"torch.compile ({what}, inductor): step time from inductor's fused elementwise kernels "
            "(planner/time/fusion.py, read off inductor's source, CUDA unmeasured); activations kept at eager's saved "
            "tensors, an upper bound: the partitioner saves at most what eager saves (63-74% of it in the CPU blocks "
            "measured)")
