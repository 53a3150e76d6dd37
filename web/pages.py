"""The web page: a form whose inputs travel in the GET query (a plan is shared by link), the plan
rendered on the server (tables and SVG, no JavaScript), the launch files to copy or download, and
a verify button when the server has a token."""

from __future__ import annotations

import typing
from pathlib import Path
from urllib.parse import urlencode

from fastapi import FastAPI, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError

from planner.catalogue import load_catalogue, parse_json_text
from planner.emit import emit_files, estimate_request_for
from planner.errors import PlannerError
from planner.gpus import load_gpus
from backend.anymodel import plan_any as plan  # Hub ids resolved as the API does
from planner.precision import Optimizer, Precision
from planner.presets import PRESETS, preset_topology
from planner.memory import estimate
from planner.render import memory_bars_svg, peak_components, strategy_label, topology_svg
from planner.parallel import PipelineSchedule
from planner.schema import PlanRequest, ReduceDtype
from planner.topology import link_rates, parse_topology
from web.auth import UNAUTHORIZED, bearer, request_token, runs_are_private, token_matches
from web.bodies import VerifyBody

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
DEGREES = ("tp", "pp", "cp", "ep")  # planner/parallel.py DEGREE_FIELDS: empty on the form lets the planner choose
FORM_FIELDS = ("model", "gpu", "gpus", "nodes", "topology", "fabric", "nics_per_node", "host_memory_gib", "seq_len",
               "global_batch", "precision", "optimizer", "model_config", "topology_text", *DEGREES,
               "pp_schedule", "pp_virtual_stages", "reduce_dtype")
# The form starts at the schema's own defaults (planner/schema.py defines them once for estimate
# and plan); the model field has none, so the page shows the PlanRequest example.
DEFAULTS = {name: ("" if field.default is None else field.default)
            for name, field in PlanRequest.model_fields.items() if name != "model_config_"}
DEFAULTS["model"] = PlanRequest.model_fields["model"].examples[0]
DEFAULTS |= {name: "" for name in DEGREES}  # not the schema's 1: what the planner chooses, unless given


def _form(request: Request) -> dict[str, typing.Any]:
    q = request.query_params
    return {k: q.get(k, DEFAULTS.get(k, "")) for k in FORM_FIELDS}


def _plan_request(form: dict[str, typing.Any]) -> PlanRequest:
    fields: dict[str, typing.Any] = {k: v for k, v in form.items() if v not in ("", None)}
    if fields.get("model_config"):
        fields["model_config"] = parse_json_text(fields["model_config"], "model_config", field="model_config")
        fields.pop("model", None)
    if fields.get("topology_text"):
        fields.pop("topology", None)
    try:
        return PlanRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "form"
        raise PlannerError(f"{where}: {first.get('msg', 'invalid').removeprefix('Value error, ')}",
                           field=where if where != "form" else None) from None


def _fabrics() -> list[tuple[str, str]]:
    """The inter-node fabrics of the catalogue (data/links.yaml), each with its per-NIC rate."""
    return [(name, f"{name} ({spec['gbps']:g} GB/s per NIC)") for name, spec in link_rates()["fabric"].items()]


def _degree_inputs() -> list[dict[str, typing.Any]]:
    """The degree fields as the form shows them, from the schema: name, description, bounds."""
    inputs = []
    for name in DEGREES:
        field = PlanRequest.model_fields[name]
        bounds = {type(m).__name__: m for m in field.metadata}
        inputs.append({"name": name, "help": field.description or "",
                       "min": getattr(bounds.get("Ge"), "ge", 1), "max": getattr(bounds.get("Le"), "le", "")})
    return inputs


def _layout(req: PlanRequest, candidate, topo):
    """The candidate's layout on the pictured node (its TP groups and PP stages), or None."""
    if candidate is None or topo is None or req.gpus > len(topo.gpus):
        return None
    from planner.parallel import ParallelDims, node_layout

    return node_layout(ParallelDims(**candidate.parallel.model_dump()), req.gpus)


def _field_help() -> dict[str, str]:
    """Each form field's description from the schema, shown as the input's tooltip."""
    return {name: f.description or "" for name, f in PlanRequest.model_fields.items()}


def _page(request: Request, form: dict, **extra) -> HTMLResponse:
    context = dict(request=request, form=form, models=list(load_catalogue()), gpus=[g for g in load_gpus() if g != "cpu"],
                   topologies=sorted(PRESETS), precisions=typing.get_args(Precision),
                   optimizers=typing.get_args(Optimizer), fabrics=_fabrics(), field_help=_field_help(),
                   degrees=_degree_inputs(), schedules=typing.get_args(PipelineSchedule),
                   reduce_dtypes=typing.get_args(ReduceDtype),
                   strategy_label=strategy_label, result=None, error=None)
    context.update(extra)
    return TEMPLATES.TemplateResponse(request, "index.html", context, status_code=extra.get("status", 200))


def _recommended(request: Request, nothing_status: int, nothing_message: str):
    """The form's plan request and its recommended candidate, or the HTTP error to answer."""
    try:
        req = _plan_request(_form(request))
        result = plan(req)
    except PlannerError as exc:
        raise HTTPException(422, str(exc)) from None
    if result.recommended is None:
        raise HTTPException(nothing_status, nothing_message)
    return req, result.recommended


RUNS_COOKIE = "planner_runs"


def _runs_pass(token: str) -> str:
    """What the run pages' cookie holds: a digest keyed by the token, never the token itself."""
    import hashlib
    import hmac

    return hmac.new(token.encode("utf-8", "surrogatepass"), b"planner run pages", hashlib.sha256).hexdigest()


def add_pages(app: FastAPI) -> None:

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request) -> HTMLResponse:
        form = _form(request)
        if "model" not in request.query_params and "model_config" not in request.query_params:
            return _page(request, form)
        try:
            req = _plan_request(form)
            result = plan(req)
        except PlannerError as exc:
            return _page(request, form, error=str(exc), status=422)
        rows, best = [], []
        seen = set()
        for c in result.candidates:  # ranked: the first of each strategy is its best setting
            if c.strategy in seen:
                continue
            seen.add(c.strategy)
            best.append(c)
            components = peak_components(estimate(estimate_request_for(req, c)))
            rows.append((f"{strategy_label(c)}{'' if c.fits else ' (no fit)'}", components))
        from planner.gpus import gpu

        bars = memory_bars_svg(rows, gpu(req.gpu).memory_bytes)
        topo = parse_topology(req.topology_text, gpu(req.gpu)) if req.topology_text else \
            preset_topology(req.topology) if req.topology else None
        if topo is None:
            from planner.presets import default_preset_for

            name = default_preset_for(req.gpu)
            topo = preset_topology(name) if name else None
        files = sorted(emit_files(req, result.recommended).items()) if result.recommended else []
        query = urlencode({k: v for k, v in form.items() if v not in ("", None)})
        return _page(request, form, result=result, req=req, bars=bars, best=best,
                     topology_svg=topology_svg(topo, layout=_layout(req, result.recommended, topo)) if topo else "",
                     files=files, query=query,
                     notes="; ".join(result.notes), token_configured=request_token() is not None)

    @app.get("/download/{name}", response_class=PlainTextResponse, include_in_schema=False)
    def download(name: str, request: Request) -> PlainTextResponse:
        req, candidate = _recommended(request, 404, "nothing fits, so there is nothing to download")
        files = emit_files(req, candidate)
        if name not in files:
            raise HTTPException(404, f"no file {name!r}; files: {', '.join(sorted(files))}")
        return PlainTextResponse(files[name], headers={"Content-Disposition": f'attachment; filename="{name}"'})

    @app.post("/verify", include_in_schema=False)
    def verify_page(request: Request, token: str = Form("")) -> RedirectResponse:
        expected = request_token()
        if expected is None or not token_matches(token, expected):
            raise HTTPException(401, "wrong or missing token")
        req, candidate = _recommended(request, 422, "nothing fits, so nothing is run")
        defaults = VerifyBody.model_fields
        run_id = app.state.jobs.start(estimate_request_for(req, candidate), steps=defaults["steps"].default,
                                      warmup_steps=defaults["warmup_steps"].default)
        response = RedirectResponse(f"/runs/{run_id}", status_code=303)
        # the run's page is behind the token too: the browser that gave it may read run pages
        response.set_cookie(RUNS_COOKIE, _runs_pass(expected), httponly=True, samesite="strict", path="/runs")
        return response

    @app.get("/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
    def run_page(run_id: int, request: Request) -> HTMLResponse:
        from backend.report import verify_table

        expected = request_token()
        if runs_are_private(app) and not (token_matches(bearer(request.headers.get("authorization")), expected)
                                          or token_matches(request.cookies.get(RUNS_COOKIE), _runs_pass(expected))):
            raise HTTPException(*UNAUTHORIZED)
        try:
            run = app.state.jobs.store().get(run_id)
        except PlannerError as exc:
            raise HTTPException(404, str(exc)) from None
        table = verify_table(run["record"]) if run["status"] != "running" else "running ..."
        done = app.state.jobs.progress.get(run_id) if run["status"] == "running" else None
        progress = f"{done[0]} of {done[1]} done" if done else None
        return TEMPLATES.TemplateResponse(request, "run.html", {"run": run, "table": table, "progress": progress})
