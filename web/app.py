"""The REST API (versioned under /v1) and the web page, one FastAPI app over the pure core.

Request and response bodies are the core's pydantic models, so the API's fields are the CLI's
flags and --json objects, field for field. Domain errors map at this edge: an unknown model or
name is 404, any other invalid request 422, a body over the limit 413, a missing or wrong token on
POST /v1/verify and DELETE /v1/runs/{id} 401, an unusable runs database 503.

Planning is open. Run records (GET /v1/runs, /v1/runs/{id}, the page's /runs/{id}) name the host,
paths and logs, so when a token is configured they need it too, unless the server makes them
public (`planner serve --public-runs`, or PLANNER_PUBLIC_RUNS=1).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
import os
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Header, HTTPException, Path as PathParam, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.staticfiles import StaticFiles

try:  # Swagger UI's assets served by this server: /docs works offline (the web extra installs it)
    from swagger_ui_bundle import swagger_ui_path
except ImportError:  # without it FastAPI's /docs loads them from its CDN
    swagger_ui_path = None

from backend.anymodel import analytic_estimate, estimate_any, plan_any, traced_estimate
from backend.errors import JobConflict
from backend.jobs import Jobs
from backend.profiles import profile_for
from backend.store import StoreError
from planner import __version__
from planner.check import check
from planner.model.catalogue import (UnsupportedModelTypeError, as_loaded, catalogue_model, load_catalogue,
                                     read_bounded_text)
from planner.errors import NO_VALUE, PlannerError, UnknownModelError, UnknownNameError
from planner.cluster.gpus import gpu as lookup_gpu, load_gpus
from planner.cluster.presets import PRESETS
from planner.schema import (CheckRequest, CheckResult, EstimateRequest, EstimateResult, GpuName, PlanRequest, PlanResult, TimeoutSeconds,
                            VerifySteps, WarmupSteps)
from planner.cluster.topology import MAX_TOPOLOGY_BYTES, Topology, parse_topology
from web.auth import TOKEN_ENV, TOKEN_FILE_ENV, UNAUTHORIZED, bearer, request_token, runs_are_private, token_matches
from web.bodies import VerifyBody

MAX_BODY_BYTES = 256 * 1024  # an estimate/plan body with a pasted config.json and topology is < 100 KiB
PUBLIC_RUNS_ENV = "PLANNER_PUBLIC_RUNS"

ESTIMATE_EXAMPLE = {"model": "llama-3-8b", "strategy": "zero3", "gpus": 8, "gpu": "h100-80gb", "seq_len": 4096,
                    "micro_batch": 1}
PLAN_EXAMPLE = {"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "topology": "hgx-h100", "seq_len": 4096,
                "global_batch": 256}
VERIFY_EXAMPLE = {"model_config": {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256,
                                   "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2}, "strategy": "zero3", "gpus": 2, "gpu": "cpu",
                  "micro_batch": 1, "seq_len": 64}


class TopologyBody(BaseModel):
    text: str = Field(max_length=MAX_TOPOLOGY_BYTES, description="`nvidia-smi topo -m` output")
    gpu: GpuName = Field(description="GPU type, which decides what each link code means (see GET /v1/gpus)")


class RunStarted(BaseModel):
    id: int
    status: str


# A run id is a SQLite rowid: a positive 64-bit integer (https://www.sqlite.org/lang_createtable.html#rowid).
RunId = Annotated[int, PathParam(ge=1, le=2**63 - 1, description="the run's id, as POST /v1/verify returned it")]


class Message(BaseModel):
    """The body of every error other than 422: what went wrong, in a sentence."""

    detail: str


# Error bodies as documented in the OpenAPI schema. 422 keeps FastAPI's own shape (a list of
# {loc, msg, type}) for domain errors too, so a client parses one format.
ERRORS = {404: {"model": Message, "description": "an unknown model, GPU, topology preset or run"},
          413: {"model": Message, "description": f"a request body over {MAX_BODY_BYTES} bytes"}}
AUTH_ERRORS = {401: {"model": Message, "description": "no token configured, or a missing or wrong bearer token"},
               409: {"model": Message, "description": "the device set is busy, or the run is not running"},
               503: {"model": Message, "description": "the runs database is unusable (not ours, corrupt)"}}
READ_ERRORS = {401: {"model": Message, "description": "a token is configured and the bearer token is missing or wrong"},
               503: {"model": Message, "description": "the runs database is unusable (not ours, corrupt)"}}


def validation_detail(exc: PlannerError) -> list[dict[str, Any]]:
    """A domain error as one FastAPI validation error: loc is the field the error names as data
    (``model_config.hidden_size`` -> body.model_config.hidden_size; none: the body as a whole),
    and input the rejected value where the error carries it."""
    loc = ["body", *exc.field.split(".")] if exc.field else ["body"]
    detail: dict[str, Any] = {"loc": loc, "msg": str(exc), "type": "value_error"}
    if exc.value is not NO_VALUE:
        detail["input"] = exc.value
    return [detail]


def json_safe(value: Any) -> Any:
    """A 422 echoes the rejected input; NaN and Infinity (which Python's JSON reader accepts in a
    body) cannot be written back as JSON, so they are echoed as text instead of failing with a 500."""
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return repr(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def require_token(authorization: str | None = Header(None, description="Bearer token configured on the server")) -> None:
    expected = request_token()
    if expected is None:
        raise HTTPException(401, "launching runs is disabled: no token is configured on the server "
                                 f"({TOKEN_ENV} or {TOKEN_FILE_ENV})")
    if not token_matches(bearer(authorization), expected):
        raise HTTPException(*UNAUTHORIZED)


def require_runs_access(request: Request, authorization: str | None = Header(
        None, description="Bearer token, needed when the server has one and its run records are not public")) -> None:
    expected = request_token()
    if runs_are_private(request.app) and not token_matches(bearer(authorization), expected):
        raise HTTPException(*UNAUTHORIZED)


class BodyLimit:
    """Refuse a request body over the limit with 413, reading no more of it than the limit (plus
    the chunk that crossed it): a chunked body has no Content-Length to refuse up front. What was
    read is replayed to the app."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def too_large(self, scope, receive, send):
        # built only when refusing (a JSONResponse per request cost ~20 us on every estimate)
        return JSONResponse({"detail": f"request body over {self.limit} bytes"}, status_code=413)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self.too_large(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self.too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        pending = iter(messages)

        async def replay():
            return next(pending, None) or await receive()

        return await self.app(scope, replay, send)


LOOP_LAYER_LIMIT = 200  # a config with more layers is answered in the threadpool (the core reads it layer by layer)


def _slow_on_the_loop(body: EstimateRequest) -> bool:
    """Requests whose analytic answer would hold the event loop for tens of milliseconds: a pasted
    topology is parsed (~28 ms for an uncached 8-GPU paste), and a config of many layers is read
    layer by layer (the schema allows 10,000). A catalogue model on a preset topology stays on the loop."""
    if body.topology_text is not None:
        return True
    config = body.model_config_
    if not isinstance(config, dict):
        return False
    for block in (config, *(v for v in config.values() if isinstance(v, dict))):  # text_config and the like
        for key, value in block.items():
            if isinstance(value, list) and len(value) > LOOP_LAYER_LIMIT:  # layer_types, per-layer lists
                return True
            if "layers" in key and isinstance(value, int) and not isinstance(value, bool) and value > LOOP_LAYER_LIMIT:
                return True
    return False


DOCS_ASSETS = "/docs-assets"


def _local_docs(app: FastAPI) -> None:
    """/docs from swagger-ui-bundle's copy of Swagger UI (swagger_ui_bundle/vendor/), not a CDN:
    the page renders on a machine without internet. ReDoc has no local copy, so no /redoc."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def _docs():
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


def _add_error_handlers(app: FastAPI) -> None:
    """Each domain error to its status: 503 an unusable runs store, 409 a conflict, 404 an unknown
    name, 422 the rest."""

    @app.exception_handler(StoreError)
    async def _store_unusable(_: Request, exc: PlannerError):
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(JobConflict)
    async def _conflict(_: Request, exc: PlannerError):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(UnknownModelError)
    @app.exception_handler(UnknownNameError)
    async def _not_found(_: Request, exc: PlannerError):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(RequestValidationError)
    async def _unprocessable(_: Request, exc: RequestValidationError):
        return JSONResponse({"detail": json_safe(jsonable_encoder(exc.errors()))}, status_code=422)

    @app.exception_handler(PlannerError)
    async def _invalid(_: Request, exc: PlannerError):
        return JSONResponse({"detail": json_safe(jsonable_encoder(validation_detail(exc)))}, status_code=422)


def _add_catalogue_routes(app: FastAPI) -> None:
    """The health check, the model and GPU catalogues, and the topology presets and parser."""

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/v1/models", tags=["catalogue"])
    def models() -> list[dict[str, Any]]:
        return [{"name": n, "family": e.family, "parameters": as_loaded(catalogue_model(n)).parameters, "source": e.source,
                 "aliases": list(e.all_aliases), "config": e.config} for n, e in load_catalogue().items()]

    @app.get("/v1/models/{name:path}", tags=["catalogue"])  # :path, so a Hub id alias (org/name) reaches it
    def model(name: str) -> dict[str, Any]:
        resolved = catalogue_model(name)
        entry = load_catalogue()[resolved.name]
        return {"name": resolved.name, "family": entry.family, "parameters": resolved.parameters,
                "source": entry.source, "aliases": list(entry.all_aliases), "config": entry.config,
                "architecture": resolved.architecture.model_dump() if resolved.architecture else None}

    @app.get("/v1/gpus", tags=["catalogue"])
    def gpus() -> list[dict[str, Any]]:
        return [g.model_dump() | {"memory_bytes": g.memory_bytes} for g in load_gpus().values()]

    @app.get("/v1/topologies", tags=["topology"])
    def topologies() -> list[dict[str, Any]]:
        return [{"name": p.name, "gpu": p.gpu, "gpus": p.gpus, "description": p.description, "fabric": p.fabric,
                 "nics_per_node": p.nics_per_node, "source": p.source} for p in PRESETS.values()]

    @app.post("/v1/topology", tags=["topology"], response_model=Topology)
    def topology(body: TopologyBody = Body(..., examples=[{"text": "\tGPU0\tGPU1\nGPU0\t X \tNV12\nGPU1\tNV12\t X \n",
                                                            "gpu": "a100-80gb"}])) -> Topology:
        try:
            return parse_topology(body.text, lookup_gpu(body.gpu), source="POST /v1/topology")
        except PlannerError as exc:  # the pasted text is this body's `text`, an estimate's `topology_text`
            if exc.field == "topology_text":
                exc.field = "text"
            raise


def _add_planning_routes(app: FastAPI) -> None:
    """POST /v1/estimate and /v1/plan."""

    @app.post("/v1/estimate", tags=["planning"], response_model=EstimateResult, response_model_by_alias=True)
    async def estimate_route(body: EstimateRequest = Body(..., examples=[ESTIMATE_EXAMPLE])) -> EstimateResult:
        # The analytic answer (~1 ms) on the event loop: a sync route costs two threadpool hops per
        # request (the endpoint, then the response check) and 8 clients' threads fight for the GIL.
        # A Hub read or a trace takes seconds, so it goes to the threadpool.
        if _slow_on_the_loop(body):
            return await run_in_threadpool(estimate_any, body)
        answer = analytic_estimate(body)
        if answer is None:
            return await run_in_threadpool(estimate_any, body)  # a Hub id
        if isinstance(answer, UnsupportedModelTypeError):
            return await run_in_threadpool(traced_estimate, body, answer)
        return answer

    @app.post("/v1/check", tags=["planning"], response_model=CheckResult, response_model_by_alias=True)
    def check_route(body: CheckRequest = Body(...)) -> CheckResult:
        """A job as its own files say it (their text), on the cluster given: fits, the peak, the step
        and wall time (a scheduler's time limit), the smallest changes; 422 names the file and key."""
        return check(body, estimate_any)

    @app.post("/v1/plan", tags=["planning"], response_model=PlanResult, response_model_by_alias=True)
    def plan_route(body: PlanRequest = Body(..., examples=[PLAN_EXAMPLE])) -> PlanResult:
        return plan_any(body)  # Hub ids


def _add_run_routes(app: FastAPI, jobs: Jobs) -> None:
    """Verify runs: start one, list and read them (behind the token unless public), cancel one."""

    @app.post("/v1/verify", tags=["runs"], response_model=RunStarted, status_code=202,
              dependencies=[Depends(require_token)], responses=AUTH_ERRORS)
    def verify_route(body: VerifyBody = Body(..., examples=[{"request": VERIFY_EXAMPLE, "steps": 2}])) -> RunStarted:
        from planner.memory.orchestrator import resolve

        resolve(body.request)  # refuse a bad request with 404/422 before anything starts
        profile_for(body.request)  # a profile it names must exist, as for estimate
        run_id = jobs.start(body.request, steps=body.steps, warmup_steps=body.warmup_steps,
                            timeout_seconds=body.timeout_seconds)
        return RunStarted(id=run_id, status="running")

    @app.get("/v1/runs", tags=["runs"], dependencies=[Depends(require_runs_access)], responses=READ_ERRORS)
    def runs(limit: int = Query(100, ge=1, le=10_000)) -> list[dict[str, Any]]:
        return jobs.store().list(limit)

    @app.get("/v1/runs/{run_id}", tags=["runs"], dependencies=[Depends(require_runs_access)], responses=READ_ERRORS)
    def run(run_id: RunId) -> dict[str, Any]:
        try:
            out = jobs.store().get(run_id)
        except StoreError:
            raise
        except PlannerError as exc:
            raise HTTPException(404, str(exc)) from None
        if out["status"] == "running" and run_id in jobs.progress:
            done, total = jobs.progress[run_id]
            out["progress"] = {"steps_done": done, "steps_total": total}
        return out

    @app.delete("/v1/runs/{run_id}", tags=["runs"], dependencies=[Depends(require_token)], responses=AUTH_ERRORS)
    def cancel(run_id: RunId) -> dict[str, Any]:
        try:
            return jobs.cancel(run_id)
        except (StoreError, JobConflict):
            raise
        except PlannerError as exc:
            raise HTTPException(404, str(exc)) from None


def create_app(db: str | None = None, public_runs: bool | None = None) -> FastAPI:
    """``public_runs``: serve run records without the token; None reads PLANNER_PUBLIC_RUNS."""
    jobs = Jobs(db or os.environ.get("PLANNER_DB"))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            jobs.store().mark_interrupted()  # runs whose owner is gone; a live one is left running
        except (PlannerError, ImportError):
            pass  # the run routes answer 503 with the reason; planning still works
        yield
        # SIGTERM/SIGINT (uvicorn's graceful shutdown): end our runs, recorded as interrupted. A
        # SIGKILL never gets here: each run's supervisor then ends the ranks and records it.
        jobs.interrupt_all("interrupted: the server stopped; all ranks ended")

    local_docs = swagger_ui_path is not None
    app = FastAPI(title="planner", version=__version__, lifespan=lifespan, responses=ERRORS,
                  description="Per-GPU memory, strategy and interconnect planning for distributed training.",
                  docs_url=None if local_docs else "/docs", redoc_url=None if local_docs else "/redoc")
    if local_docs:
        _local_docs(app)
    app.state.jobs = jobs
    if public_runs is None:
        public_runs = os.environ.get(PUBLIC_RUNS_ENV, "").lower() in ("1", "true", "yes")
    app.state.public_runs = public_runs
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    _add_error_handlers(app)
    _add_catalogue_routes(app)
    _add_planning_routes(app)
    _add_run_routes(app, jobs)

    from web.pages import add_pages

    add_pages(app)
    return app
