"""The recipe a plan is asked with (issue 21): the PlanRequest's recipe fields carried into every
candidate's estimate, the checkpointing policies searched, and the layouts the recipe is modelled
for. planner/plan/search.py reads these and keeps its search as it is.
"""

from __future__ import annotations

from planner.errors import PlannerError
from planner.recipes.compile import accumulates
from planner.recipes.losses import KERNEL_LOSSES
from planner.schema import PlanRequest

# the estimate fields a plan carries unchanged into every candidate (their defaults are left out,
# so a plan without a recipe estimates the requests it always did)
CARRIED = ("checkpointing_every", "keeps_outputs", "train_metrics", "loss", "loss_chunks", "low_precision", "float8_all_gather",
           "activation_offload", "gradient_clipping", "compile", "fused_kernels")
# a refusal naming one of these is the recipe's, not the setting's: the setting is skipped
RECIPE_FIELDS = CARRIED + ("checkpointing", "tp_plan")  # tp_plan: e.g. transformers' TP x FSDP2 of a tied model
SEARCHED_CHECKPOINTING = ("none", "full")


def recipe_fields(req: PlanRequest) -> dict:
    """The request's recipe as estimate fields, defaults left out."""
    return {name: getattr(req, name) for name in CARRIED
            if getattr(req, name) != PlanRequest.model_fields[name].default}


def checkpointings(req: PlanRequest) -> tuple[str, ...]:
    """The checkpointing policies searched: the request's, or none and full."""
    return (req.checkpointing,) if req.checkpointing is not None else SEARCHED_CHECKPOINTING


def _data_parallel_only(req: PlanRequest) -> tuple[str, str] | None:
    """(field, value) of a recipe field the estimate models for data-parallel layouts only."""
    if req.loss == "chunked" or req.loss in KERNEL_LOSSES:
        return "loss", req.loss
    if req.low_precision != "none":
        return "low_precision", req.low_precision
    if req.checkpointing not in (None, *SEARCHED_CHECKPOINTING):
        return "checkpointing", req.checkpointing
    if req.checkpointing_every is not None:
        return "checkpointing_every", str(req.checkpointing_every)
    if req.keeps_outputs:
        return "keeps_outputs", "true"
    return None


def allowed_layouts(req: PlanRequest, layouts: list[tuple[int, int, int, int]]) -> tuple[list[tuple[int, int, int, int]],
                                                                                          list[str]]:
    """The layouts the recipe's fields allow (_allowed_layouts), and of those, under compile, the ones
    without a pipeline (planner/recipes/compile.py check_compile)."""
    kept, notes = _allowed_layouts(req, layouts)
    if req.compile == "none":
        return kept, notes
    unpiped = [d for d in kept if d[2] == 1]
    why = f"compile {req.compile} is modelled without pipeline parallelism"
    if not unpiped:
        raise PlannerError(f"{why}; none of the plan's layouts (tp, cp, pp, ep) {kept} is one", field="compile")
    left = len(kept) - len(unpiped)
    if not accumulates(req.compile):  # settings.micro_options: one micro-batch per rank and step
        notes = notes + ["recipe: compile model is modelled without gradient accumulation (its backward returns every "
                         "gradient at its end, beside the accumulated ones): each data-parallel rank takes its share of "
                         "the global batch as one micro-batch"]
    return unpiped, notes + ([f"recipe: {why}: {left} layout(s) not searched"] if left else [])


def _allowed_layouts(req: PlanRequest, layouts: list[tuple[int, int, int, int]]) -> tuple[list[tuple[int, int, int, int]],
                                                                                           list[str]]:
    """(the (tp, cp, pp, ep) layouts the recipe is modelled for, a note on those left out). A
    vocab-parallel loss needs tensor parallelism; torchtitan's chunked loss takes tp alone; the chunked and fused losses, low precision, the
    selective and every-N checkpointing policies and a loop that keeps its outputs are modelled
    for data parallelism alone. No layout left is refused, naming the field."""
    blocked = _data_parallel_only(req)
    if req.loss == "vocab-parallel":
        kept = [d for d in layouts if d[0] > 1]
        field, why = "loss", "loss=vocab-parallel is tensor parallelism's loss_parallel: it needs tp > 1"
    elif req.loss == "chunked-in-forward":
        kept = [d for d in layouts if d[1:] == (1, 1, 1)]
        field, why = "loss", "loss=chunked-in-forward is modelled with tp alone (no cp, pp or ep)"
    elif blocked is not None:
        kept = [d for d in layouts if d == (1, 1, 1, 1)]
        field, why = blocked[0], f"{blocked[0]}={blocked[1]} is modelled for data-parallel layouts only"
    else:
        return layouts, []
    if not kept:
        raise PlannerError(f"{why}; none of the plan's layouts (tp, cp, pp, ep) {layouts} is one", field=field)
    left = len(layouts) - len(kept)
    return kept, [f"recipe: {why}: {left} layout(s) not searched"] if left else []


def refused_by_recipe(exc: PlannerError) -> bool:
    return exc.field in RECIPE_FIELDS
