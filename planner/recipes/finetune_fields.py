"""The fine-tuning fields of a request that cannot be meant together, refused when the request is
built (planner/schema.py's validator); what needs the model is checked by planner/recipes/finetune.py.
Also the fine-tuning a request resolves to (``Finetune``): it sits here, below finetune.py, because
planner/setup_fields.py names its type and finetune.py names the Framework's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.model.linears import Linear

ALL_LINEAR = "all-linear"

_LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "train_embeddings")


@dataclass(frozen=True)
class Finetune:
    method: str  # "lora" | "qlora"
    rank: int
    alpha: float
    targets: tuple[str, ...]  # module names, or (ALL_LINEAR,)
    dropout: float
    quantize: str  # "none" | "nf4" | "fp4" | "int8"
    train_embeddings: bool
    double_quant: bool = True  # bnb_4bit_use_double_quant (4-bit only)

    def targeted(self, linear: Linear) -> bool:
        return self.targets == (ALL_LINEAR,) or linear.name in self.targets

    def peft_targets(self) -> str | list[str]:
        return ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)


def check_request_fields(request: Any) -> None:
    """Field combinations that cannot be meant, refused with the field and its value (no model
    needed: what needs the architecture is checked by ``resolve_finetune``). ``request``: the
    EstimateRequest being validated (typed loosely: planner/schema.py imports this module)."""
    method = request.finetune
    if method == "full":
        for name in _LORA_FIELDS:
            value = getattr(request, name)
            if value not in (None, False):
                raise ValueError(f"{name}={value} applies to finetune lora or qlora, not finetune=full")
        if request.quantize_base not in (None, "none"):
            raise ValueError(f"quantize_base={request.quantize_base} needs finetune=qlora: a quantized base "
                             "cannot be trained in full")
    if method == "lora" and request.quantize_base not in (None, "none"):
        raise ValueError(f"quantize_base={request.quantize_base} with finetune=lora: a quantized base is "
                         "finetune=qlora")
    if request.double_quant is not None and (method != "qlora" or request.quantize_base == "int8"):
        raise ValueError(f"double_quant={request.double_quant} is bitsandbytes' 4-bit option "
                         "(bnb_4bit_use_double_quant): it needs finetune=qlora with quantize_base nf4 or fp4")
    if method == "qlora" and request.quantize_base == "none":
        raise ValueError("quantize_base=none with finetune=qlora: QLoRA quantizes the base; use finetune=lora")
