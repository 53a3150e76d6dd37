"""`plan --finetune auto`: full fine-tuning, LoRA and QLoRA planned side by side.

Each method is planned on the same cluster and batch; the recommendation is the first of full,
LoRA, QLoRA that fits (in that order: each gives up some of what the one before trains, the
adapters replacing the weights' updates, then a 4-bit base under them), and the notes say what
each costs: its best option's peak and step time, or why it does not fit.
"""

from __future__ import annotations

from typing import Callable

from planner.errors import PlannerError
from planner.schema import PlanRequest, PlanResult
from planner.units import GIB

METHODS = ("full", "lora", "qlora")
LABEL = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}


def _cost(method: str, result: PlanResult | None, error: str | None) -> str:
    if result is None:
        return f"{LABEL[method]}: refused: {error}"
    best = result.recommended
    if best is None:
        smallest = min((c.per_device.peak_bytes for c in result.candidates), default=None)
        return f"{LABEL[method]}: does not fit" + (
            f" (smallest peak {smallest / GIB:.1f} GiB per GPU)" if smallest is not None else "")
    return (f"{LABEL[method]}: fits, best {best.strategy} at micro-batch {best.micro_batch}, peak "
            f"{best.per_device.peak_bytes / GIB:.1f} GiB per GPU, {best.step_seconds:.3f} s per step")


def _headline(req: PlanRequest, fitting: list[str]) -> str:
    name = req.model or "the model"
    where = f"{req.gpus * req.nodes} {req.gpu}" if req.gpus * req.nodes > 1 else f"one {req.gpu}"
    if not fitting:
        return f"{name} fits {where} with none of full fine-tuning, LoRA or QLoRA at these settings"
    if fitting == ["qlora"]:
        return f"{name} fits {where} only with QLoRA"
    if fitting == ["lora", "qlora"] or fitting == ["lora"]:
        return f"{name} fits {where} only with LoRA or QLoRA, not full fine-tuning"
    return f"{name} fits {where} with full fine-tuning" + (
        "" if fitting == list(METHODS) else f" ({', '.join(LABEL[m] for m in fitting)})")


def _method_fields(method: str) -> dict:
    """The request's LoRA fields as the method reads them: none for full fine-tuning, no quantized
    base for LoRA (the same validation PlanRequest makes for an explicit method)."""
    if method == "full":
        return {"lora_rank": None, "lora_alpha": None, "lora_targets": None, "lora_dropout": None,
                "quantize_base": None, "train_embeddings": False, "double_quant": None}
    return {"quantize_base": None, "double_quant": None} if method == "lora" else {}


def plan_finetune_auto(req: PlanRequest, plan: Callable[[PlanRequest], PlanResult]) -> PlanResult:
    results: dict[str, PlanResult | None] = {}
    errors: dict[str, str] = {}
    for method in METHODS:
        try:
            results[method] = plan(req.model_copy(update={"finetune": method} | _method_fields(method)))
        except PlannerError as exc:
            if method == "full":
                raise
            results[method], errors[method] = None, str(exc)
    fitting = [m for m in METHODS if results[m] is not None and results[m].recommended is not None]
    chosen = fitting[0] if fitting else "full"
    base = results[chosen]
    notes = [f"finetune auto: {_headline(req, fitting)}"]
    notes += [f"finetune auto: {_cost(m, results[m], errors.get(m))}" for m in METHODS]
    notes.append(f"finetune auto: recommended {LABEL[chosen]}" + (
        " (the first of full, LoRA, QLoRA that fits)" if fitting else ""))
    return base.model_copy(update={"notes": notes + base.notes, "request": req})
