"""The web page people plan with: a form generated from the one schema (web/form.py) whose values
travel in the GET query (a result is shared by its link), the answer of `estimate` or `plan`
pictured on the server (SVG from planner/render.py, no JavaScript needed to read it), the launch
files to copy or download, and a verify button when the server has a token. One small script
(static/page.js) fills the form from a dropped file; one small style sheet (static/page.css)."""

from __future__ import annotations

import hashlib
import hmac
import typing
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlencode

from fastapi import FastAPI, Form, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from backend.anymodel import estimate_any, plan_any as plan  # Hub ids resolved as the API does
from planner.model.catalogue import load_catalogue
from planner.plan.emit import emit_files, estimate_request_for
from planner.errors import PlannerError
from planner.cluster.gpus import gpu as lookup_gpu, load_gpus
from planner.parallel.dims import ParallelDims, node_layout
from planner.parallel.pipeline import bubble_fraction
from planner.cluster.presets import default_preset_for, preset_topology
from planner.render import (memory_bars_svg, moments_svg, peak_components, strategy_label, time_bars_svg,
                            time_parts, topology_svg)
from planner.schema import Candidate, EstimateRequest, EstimateResult, PlanRequest, PlanResult
from planner.cluster.topology import Topology, link_rates, parse_topology
from planner.units import GIB
from web.form import ASKS, FormErrors, FormField, build_request, form_fields, form_values, grouped, share_query
from web.auth import UNAUTHORIZED, bearer, request_token, runs_are_private, token_matches
from web.bodies import VerifyBody

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
STATIC = Path(__file__).parent / "static"
STATIC_TYPES = {"page.css": "text/css; charset=utf-8", "page.js": "text/javascript; charset=utf-8"}


def _choice_text() -> dict[str, dict[str, str]]:
    """How a select names a catalogue's entries where the name alone says too little: each fabric
    with its per-NIC rate (data/links.yaml), each GPU with its memory."""
    return {"fabric": {name: f"{name} ({spec['gbps']:g} GB/s per NIC)" for name, spec in link_rates()["fabric"].items()},
            "gpu": {name: f"{name} ({g.memory_bytes / GIB:.0f} GiB)" for name, g in load_gpus().items()
                    if g.memory_bytes}}


@lru_cache(maxsize=1)
def page_fields() -> tuple[FormField, ...]:
    return tuple(form_fields(choice_text=_choice_text()))


@dataclass
class Option:
    """One answer the page pictures: a plan's option (the best setting of a strategy) or the estimate."""

    label: str
    fits: bool
    estimate: EstimateResult
    candidate: Candidate | None = None

    @property
    def peak_bytes(self) -> int:
        return self.estimate.per_device.peak_bytes

    @property
    def reserved_bytes(self) -> int | None:
        return getattr(self.estimate.per_device, "reserved_peak_bytes", None)  # issue 24's allocator model

    @property
    def timing(self):
        return self.candidate if self.candidate is not None else self.estimate.time

    @property
    def bubble_fraction(self) -> float:
        """The idle share of its pipeline's compute (0 without a pipeline), from the core's rule."""
        parallel = self.candidate.parallel if self.candidate is not None else self.estimate.parallel
        accumulation = (self.candidate or self.estimate.request).gradient_accumulation
        stages = self.estimate.request.pp_virtual_stages
        schedule = (self.candidate.pp_schedule if self.candidate is not None else None) \
            or self.estimate.request.pp_schedule
        return bubble_fraction(parallel.pp, accumulation, stages, schedule) if parallel.pp > 1 else 0.0


def headroom(peak_bytes: int, capacity_bytes: int) -> dict[str, float]:
    """How close a peak is to the card: free GiB and the percent of the card that is."""
    free = capacity_bytes - peak_bytes
    return {"gib": free / GIB, "percent": 100 * free / capacity_bytes if capacity_bytes else 0.0,
            "used_percent": 100 * peak_bytes / capacity_bytes if capacity_bytes else 0.0}


def _topology(req) -> Topology | None:
    if req.topology_text:
        return parse_topology(req.topology_text, lookup_gpu(req.gpu))
    name = req.topology or default_preset_for(req.gpu)
    return preset_topology(name) if name else None


def _layout(gpus: int, parallel, topo):
    """The layout's groups on the pictured node (its TP groups and PP stages), or None."""
    if parallel is None or topo is None or gpus > len(topo.gpus):
        return None
    return node_layout(ParallelDims(**parallel.model_dump()), gpus)


def _estimate_label(result: EstimateResult) -> str:
    shard = result.request.hsdp_shard_size
    return strategy_label(SimpleNamespace(strategy=result.strategy, hsdp_shard_size=shard, parallel=result.parallel))


def _plan_options(req: PlanRequest, result: PlanResult) -> list[Option]:
    """The best setting of each strategy (the plan ranks its candidates), each with its estimate
    for the memory pictures."""
    best, seen = [], set()
    for c in result.candidates:  # ranked: the first of each strategy is its best setting
        if c.strategy not in seen:
            seen.add(c.strategy)
            best.append(c)
    return [Option(label=strategy_label(c), fits=c.fits, estimate=estimate_any(estimate_request_for(req, c)),
                   candidate=c) for c in best]


def _focus(request: Request, options: list[Option], result: PlanResult) -> Option | None:
    """The option whose moments and layout are pictured: the one the query names (focus=N, its
    place in the options), else the recommended one, else the first."""
    given = request.query_params.get("focus", "")
    if given.isdigit() and int(given) < len(options):
        return options[int(given)]
    return next((o for o in options if o.candidate is result.recommended), options[0] if options else None)


def _pictures(options: list[Option], capacity_bytes: int, focus: Option | None, topo, gpus: int) -> dict[str, str]:
    if focus is None:  # a plan without a single candidate
        return {}
    rows = [(o.label + ("" if o.fits else " (no fit)"), peak_components(o.estimate)) for o in options]
    reserved = [o.reserved_bytes for o in options]
    timed = [o for o in options if o.timing is not None]
    parallel = focus.candidate.parallel if focus and focus.candidate else focus.estimate.parallel if focus else None
    return {"bars": memory_bars_svg(rows, capacity_bytes, reserved=reserved if any(r is not None for r in reserved)
                                    else None),
            "moments": moments_svg(focus.estimate, capacity_bytes) if focus else "",
            "time": time_bars_svg([(o.label, time_parts(o.timing, o.bubble_fraction)) for o in timed],
                                  [o.timing.step_seconds for o in timed]) if timed else "",
            "topology": topology_svg(topo, layout=_layout(gpus, parallel, topo)) if topo else ""}


def _context(request: Request, ask: str, values: dict[str, str], **extra) -> dict[str, typing.Any]:
    fields = page_fields()
    errors: dict[str, list[str]] = {}
    for name, message in extra.pop("errors", []):
        errors.setdefault(name, []).append(message)
    open_groups = {g.key for g, members in grouped(list(fields))
                   if not g.folded or any(values.get(f.name, f.default) != f.default or f.name in errors
                                          for f in members)}
    return dict(request=request, ask=ask, asks=list(ASKS), values=values, groups=grouped(list(fields)),
                open_groups=open_groups, errors=errors, models=list(load_catalogue()), result=None,
                strategy_label=strategy_label, time_parts=time_parts, check_route=_has_check(request.app)) | extra


def _has_check(app: FastAPI) -> bool:
    return any(getattr(r, "path", None) == "/v1/check" for r in app.routes)


def _render(context: dict[str, typing.Any], status: int = 200) -> HTMLResponse:
    return TEMPLATES.TemplateResponse(context["request"], "index.html", context, status_code=status)


def _form_errors(exc: PlannerError) -> list[tuple[str, str]]:
    if isinstance(exc, FormErrors):
        return exc.errors
    names = {f.name for f in page_fields()}
    first = (exc.field or "").split(".")[0]
    return [(first if first in names else "", str(exc))]


def _answer(request: Request, ask: str, values: dict[str, str]) -> HTMLResponse:
    """The asked question's answer as the page shows it: pictures, then tables and launch files."""
    fields = list(page_fields())
    try:
        req = build_request(ask, fields, values)
        if ask == "plan":
            result = plan(req)
            options = _plan_options(req, result)
            capacity = lookup_gpu(req.gpu).memory_bytes
            focus = _focus(request, options, result)
            files = sorted(emit_files(req, result.recommended).items()) if result.recommended else []
        else:
            result = estimate_any(req)
            options = [Option(label=_estimate_label(result), fits=result.fits, estimate=result)]
            capacity, focus, files = result.device_capacity_bytes, options[0], []
        topo = _topology(req)
    except PlannerError as exc:
        return _render(_context(request, ask, values, errors=_form_errors(exc)), 422)
    share = urlencode(share_query(ask, fields, values))
    return _render(_context(
        request, ask, values, result=result, req=req, options=options, focus=focus, capacity=capacity,
        room=headroom(focus.peak_bytes, capacity) if focus else None,
        room_reserved=headroom(focus.reserved_bytes, capacity) if focus and focus.reserved_bytes else None,
        pictures=_pictures(options, capacity, focus, topo, req.gpus), files=files, share=share,
        notes=result.notes, token_configured=request.app.state.token() is not None))


def _asked(request: Request) -> str:
    ask = request.query_params.get("ask", "plan")
    if ask not in ASKS:
        raise HTTPException(422, f"ask={ask!r}: choose from {', '.join(ASKS)}")
    return ask


def _recommended(request: Request, nothing_status: int, nothing_message: str) -> EstimateRequest:
    """The request the page's verify runs: an estimate as asked, or a plan's recommended option;
    else the HTTP error to answer."""
    ask = _asked(request)
    try:
        req = build_request(ask, list(page_fields()), form_values(page_fields(), request.query_params))
        if ask == "estimate":
            return req
        result = plan(req)
    except PlannerError as exc:
        raise HTTPException(422, str(exc)) from None
    if result.recommended is None:
        raise HTTPException(nothing_status, nothing_message)
    return estimate_request_for(req, result.recommended)


RUNS_COOKIE = "planner_runs"


def _runs_pass(token: str) -> str:
    """What the run pages' cookie holds: a digest keyed by the token, never the token itself."""
    return hmac.new(token.encode("utf-8", "surrogatepass"), b"planner run pages", hashlib.sha256).hexdigest()


def add_pages(app: FastAPI) -> None:
    app.state.token = request_token  # the server's token look-up, for the verify button (page context)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request) -> HTMLResponse:
        ask = _asked(request)
        values = form_values(page_fields(), request.query_params)
        asked = {"ask", "model", "model_config", "params"} & set(request.query_params)
        if not asked:
            return _render(_context(request, ask, values))
        return _answer(request, ask, values)

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> FileResponse:
        if name not in STATIC_TYPES:
            raise HTTPException(404, f"no file {name!r}")
        return FileResponse(STATIC / name, media_type=STATIC_TYPES[name])

    @app.get("/download/{name}", response_class=PlainTextResponse, include_in_schema=False)
    def download(name: str, request: Request) -> PlainTextResponse:
        if _asked(request) != "plan":
            raise HTTPException(404, "launch files are written for a plan's recommended option")
        req = build_request("plan", list(page_fields()), form_values(page_fields(), request.query_params))
        result = plan(req)
        if result.recommended is None:
            raise HTTPException(404, "nothing fits, so there is nothing to download")
        files = emit_files(req, result.recommended)
        if name not in files:
            raise HTTPException(404, f"no file {name!r}; files: {', '.join(sorted(files))}")
        return PlainTextResponse(files[name], headers={"Content-Disposition": f'attachment; filename="{name}"'})

    @app.post("/verify", include_in_schema=False)
    def verify_page(request: Request, token: str = Form("")) -> RedirectResponse:
        expected = request_token()
        if expected is None or not token_matches(token, expected):
            raise HTTPException(401, "wrong or missing token")
        job = _recommended(request, 422, "nothing fits, so nothing is run")
        defaults = VerifyBody.model_fields
        run_id = app.state.jobs.start(job, steps=defaults["steps"].default,
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
