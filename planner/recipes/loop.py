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

composer's loop (the trainer llm-foundry runs) keeps the outputs too, and after each micro-batch's backward
it updates the model's train metrics on them (``train_metrics``): composer 0.14-0.17 trainer.py
``_train_microbatch`` calls ``_eval_train_metrics`` under ``torch.no_grad()`` and its precision context, and
each of llm-foundry's LanguageCrossEntropy and LanguagePerplexity runs ``torch.nn.CrossEntropyLoss(reduction=
"sum")`` over the whole micro-batch's logits (composer metrics/nlp.py LanguageCrossEntropy.update). Its
precision context is torch.autocast in the 16-bit dtype (amp_bf16, amp_fp16), where cross_entropy runs in
fp32 (torch.amp's "CUDA ops that can autocast to float32" list names cross_entropy; on CPU ranks the same);
under DeepSpeed composer enters none (``_get_precision_context`` returns a null context), and the
cross-entropy runs in the logits' own dtype. Each metric, one after the other, holds for its
log-softmax (aten log_softmax, called by cross_entropy_loss before nll_loss) its output, and under
autocast the fp32 copy of the 16-bit logits autocast makes first; llm-foundry added ``use_train_metrics``
(October 2023, "free mem") to turn them off.
"""

from __future__ import annotations

from typing import Any

from planner.memory.buffers import FP32, item, phase
from planner.memory.moments import PhaseKind
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


TRAIN_METRICS_SOURCE = ("composer 0.14-0.17 trainer.py _train_microbatch -> _eval_train_metrics; composer "
                        "metrics/nlp.py LanguageCrossEntropy.update (torch cross_entropy, reduction sum)")


def metric_autocasts(framework: Any, autocast_dtype: str | None) -> bool:
    """Whether the loop's metrics run under torch.autocast: composer's precision context for a 16-bit
    recipe, where the framework leaves the loop its own (Framework.loop_autocasts; none under DeepSpeed)."""
    return framework.loop_autocasts and autocast_dtype is not None


def train_metric_items(vocab_size: int, tokens: int, compute_bytes: int, autocast: bool) -> list:
    """What one metric's cross-entropy holds beside the kept logits at its height (the metrics run one
    after the other): the log-softmax's output, fp32 under autocast (with the fp32 copy of 16-bit logits
    autocast makes first), else in the logits' dtype. The nll_loss's sum is a scalar."""
    logits = tokens * vocab_size
    if not autocast:
        return [item("train metrics: the log-softmax of the kept logits", compute_bytes * logits, "buffers",
                     TRAIN_METRICS_SOURCE)]
    items = [item("train metrics: the log-softmax of the kept logits (fp32 under autocast)", FP32 * logits,
                  "buffers", TRAIN_METRICS_SOURCE)]
    if compute_bytes != FP32:
        items.append(item("train metrics: autocast's fp32 copy of the kept logits", FP32 * logits, "buffers",
                          TRAIN_METRICS_SOURCE))
    return items


def with_train_metrics(plan: Any, transient: list, metrics: int) -> Any:
    """The phase plan with the loop's train metrics after the backward: what the end of the backward holds
    but its framework's passing buffers (a gathered unit, a reduce-scatter's input: let go when backward
    returns; the buffers held between steps stay), and one metric's cross-entropy temporaries
    (train_metric_items), placed after the backward's last phase."""
    ends = [n for n, p in enumerate(plan.phases) if p.kind is PhaseKind.END_OF_BACKWARD]
    if not ends:
        raise PlannerError(f"train_metrics={metrics}: this layout's phases have no end of backward to place the "
                           "metrics after", field="train_metrics")
    base = max((plan.phases[n] for n in ends), key=lambda p: p.bytes)
    between = {(i.name, i.component) for i in plan.resident}
    kept = [i for i in base.items if i.component != "buffers" or (i.name, i.component) in between]
    after = max(n for n, p in enumerate(plan.phases)
                if p.kind in (PhaseKind.END_OF_BACKWARD, PhaseKind.TIED_SUM))
    plan.phases.insert(after + 1, phase(PhaseKind.TRAIN_METRICS, f"train metrics ({metrics}, after backward)",
                                        kept + transient))
    return plan


def train_metrics_note(metrics: int, autocast: bool, transient_bytes: int) -> str:
    precision = ("in fp32 under the loop's autocast" if autocast
                 else "in the logits' dtype (no autocast: fp32 training, a cast model or DeepSpeed)")
    return (f"training loop: {metrics} train metric(s) on every micro-batch's kept logits after its backward, each a "
            f"cross-entropy {precision}, {transient_bytes:,} bytes at its height beside the logits and the states "
            f"(train_metrics; {TRAIN_METRICS_SOURCE})")
