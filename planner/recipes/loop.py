"""The training loop around the model: what the script itself keeps alive.

Two loops are common, and they hold different things:

- the Trainer's (transformers 5 Trainer.training_step: ``loss = self.compute_loss(model, inputs)``
  returns only the loss, and torchtitan 0.3's train step ``del pred`` before backward): the model's
  output object dies once ``.loss`` is taken, so its logits are gone before backward begins. This
  is what every other term of the estimate assumes.
- accelerate's examples (accelerate 1.x examples/nlp_example.py: ``outputs = model(**batch);
  loss = outputs.loss; accelerator.backward(loss)``) and many hand-written scripts keep
  ``outputs``, so the logits (``lm_head`` output, the training dtype) stay referenced through
  backward and the optimizer step, and into the next micro-batch's forward: the name is rebound
  only when that forward returns. So the tensor is live at every moment of the step and between
  steps (``keeps_outputs``).
"""

from __future__ import annotations

from typing import Any

from planner.memory.buffers import item
from planner.errors import PlannerError

TRAINER_LOOP = ("training loop: the Trainer's (the model's outputs freed once .loss is taken, as HF Trainer and "
                "torchtitan do); a script that keeps `outputs` through backward (accelerate's examples) holds "
                "one more logits tensor: set keeps_outputs")


def check_loop(request: Any, arch: Any) -> None:
    """keeps_outputs is modelled for the transformers model's own loop (DeepSpeed, DDP, FSDP,
    LoRA/QLoRA); the tp/cp/pp/ep layouts are torchtitan-style steps that compute the loss inside
    the step and keep no output object."""
    if not request.keeps_outputs:
        return
    parallel = [f"{name}={getattr(request, name)}" for name in ("tp", "cp", "pp", "ep") if getattr(request, name) > 1]
    if parallel:
        raise PlannerError(f"keeps_outputs with {', '.join(parallel)}: these layouts run a torchtitan-style step "
                           "that keeps no output object (the loss is computed inside the step); keeps_outputs "
                           "applies to the transformers model's loop (DeepSpeed, ddp, fsdp, hsdp)",
                           field="keeps_outputs")
    if arch is None:
        raise PlannerError("keeps_outputs needs an architecture (the held logits are tokens x vocabulary): give "
                           "--model or --model-file, not --params", field="keeps_outputs")


def held_outputs_bytes(vocab_size: int, tokens: int, compute_bytes: int) -> int:
    """The held output's logits: ``lm_head(hidden_states)`` of shape (batch, seq, vocab) in the
    compute dtype (bf16 under autocast, as F.linear is in autocast's lower-precision list; the
    weights' dtype otherwise). The output's ``loss`` is a scalar whose graph backward has freed;
    ``past_key_values`` is None in training (use_cache False). Gemma-2's final softcapping
    returns one tensor of the same shape."""
    return compute_bytes * tokens * vocab_size


def loop_note(keeps_outputs: bool, held_bytes: int) -> str:
    if not keeps_outputs:
        return TRAINER_LOOP
    return (f"training loop: the script keeps the model's outputs through backward (accelerate's examples: "
            f"outputs = model(**batch); accelerator.backward(outputs.loss)): their logits, {held_bytes:,} bytes, "
            "are live at every moment of the step and between steps (keeps_outputs)")


def with_held_outputs(plan: Any, held_bytes: int) -> Any:
    """The phase plan with the held logits added to every moment and to what stays between steps."""
    return with_held(plan, item("logits held by the loop's outputs (keeps_outputs)", held_bytes, "activations",
                                "accelerate examples/nlp_example.py: outputs = model(**batch)"))


def with_held(plan: Any, held: Any) -> Any:
    """The phase plan with one item live at every moment of the step and between steps."""
    held_bytes = held.bytes
    plan.phases = [p.model_copy(update={"bytes": p.bytes + held_bytes, "items": list(p.items) + [held]})
                   for p in plan.phases]
    plan.resident = list(plan.resident) + [held]
    plan.resident_bytes += held_bytes
    return plan
