"""What the CLI and the API call for estimate and plan: Hub ids read through huggingface_hub,
then the pure core; a model_type the core has no reader for is traced (backend/trace.py).

Only the standard library and the core are imported here; huggingface_hub, torch and
transformers are imported when a request needs them, so a core-only install answers every
catalogue request and names the extra to install for the rest.
"""

from __future__ import annotations

import gc
import json
from contextlib import contextmanager
from typing import Iterator

from backend.profiles import profile_for
from planner.model.catalogue import UnsupportedModelTypeError, raw_parameters, traced_model
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate, resolve
from planner.time.step import TracedShape, estimate_time, estimate_with_time
from planner.schema import EstimateRequest, EstimateResult, PlanRequest, PlanResult


def estimate_any(request: EstimateRequest) -> EstimateResult:
    from backend.hub import with_hub_model

    request = with_hub_model(request)
    try:
        return estimate_with_time(request, profile_for(request))
    except UnsupportedModelTypeError as exc:
        return traced_estimate(request, exc)


def analytic_estimate(request: EstimateRequest) -> EstimateResult | UnsupportedModelTypeError | None:
    """estimate_any's answer when it needs neither the Hub nor a trace: the pure core, about a
    millisecond (tens of ms for a 10,000-layer config, the schema's bound), so an async caller may
    run it on its event loop. None for a Hub id (estimate_any reads it); the core's refusal for a
    model_type without a reader (``traced_estimate(request, refusal)`` traces it). Errors are
    raised as estimate_any raises them."""
    from backend.hub import needs_hub

    if needs_hub(request):
        return None
    try:
        return estimate_with_time(request, profile_for(request))
    except UnsupportedModelTypeError as exc:
        return exc


def plan_any(request: PlanRequest) -> PlanResult:
    """A plan searches thousands of settings with the analytic model; a model_type without a
    reader is refused with the core's message (which names `planner estimate` for tracing)."""
    from backend.hub import with_hub_model
    from planner.plan.search import plan  # numpy: only a plan searches arrays of options

    request = with_hub_model(request)
    return plan(request, profile_for(request))


def traced_estimate(request: EstimateRequest, exc: UnsupportedModelTypeError) -> EstimateResult:
    """The estimate of a model the core cannot read: parameters and activations measured by
    backend/trace.py at this request's setting, fed to the same phase model; step time from the
    traced parameter count (steptime.TracedShape)."""
    from backend.trace import cached_count, cached_trace

    _refuse_model_parallel(request, exc)
    text = json.dumps(exc.config, sort_keys=True, default=str)
    with _collecting():
        try:
            count = cached_count(text, exc.name)
        except PlannerError as refusal:  # the config transformers could not build: the model's field
            raise _about_model(refusal, request) from None
        # the request's effective settings (a ds_config may set the precision) before tracing at them
        setup = resolve(request, model=raw_parameters(count.parameters))
        req = setup.request
        try:
            profile = cached_trace(text, exc.name, req.micro_batch, req.seq_len, setup.recipe.compute, req.attention,
                                   req.checkpointing)
        except PlannerError as refusal:
            raise _about_model(refusal, request) from None
    result = estimate(request, model=traced_model(exc.name, exc.source, profile))
    shape = TracedShape.of(profile)
    time = estimate_time(result.request, result, profile_for(result.request), traced=shape)
    return result.model_copy(update={"time": time, "notes": result.notes + ([shape.note()] if time else [])})


# the degrees that split a model's layers, sequence or experts over ranks: each needs the layer
# specs an analytic reader builds, which a trace (one whole model's tensors) does not give
_MODEL_PARALLEL = ("tp", "pp", "cp", "ep")


def _refuse_model_parallel(request: EstimateRequest, exc: UnsupportedModelTypeError) -> None:
    """A traced model is estimated whole on every rank: a model-parallel degree is refused here,
    naming the model_type, before the trace (the core's own refusal would speak of a parameter
    count, what the trace is resolved from first)."""
    for name in _MODEL_PARALLEL:
        degree = getattr(request, name)
        if degree > 1:
            raise PlannerError(f"{name}={degree}: {exc.name} is traced (its model_type has no analytic reader), "
                               "and a trace measures the whole model, so it cannot be split over model-parallel "
                               f"ranks; use {name} 1 or a model_type with a reader (see `planner models`)", field=name)


def _about_model(exc: PlannerError, request: EstimateRequest) -> PlannerError:
    """A trace's refusal names the request field that gave the model, unless it names one itself."""
    if exc.field is None:
        exc.field = "model_config" if request.model_config_ is not None else "model"
    return exc


@contextmanager
def _collecting() -> Iterator[None]:
    """The cyclic collector on while tracing: `planner estimate` turns it off for its quick start-up
    (cli/main.py), but a trace builds transformers models (modules refer to their parents and
    hooks: cycles) that would otherwise stay until exit. Restored afterwards."""
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was_enabled:
            gc.disable()
