"""The REST API (versioned under /v1) and the web page, one FastAPI app over the pure core.

Request and response bodies are the core's pydantic models, so the API's fields are the CLI's
flags and --json objects, field for field. Domain errors map at this edge: an unknown model or
name is 404, any other invalid request 422, a body over the limit 413, a missing or wrong token on
POST /v1/verify 401.
"""

from __future__ import annotations

import hmac
import re
from contextlib import asynccontextmanager
import os
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Header, HTTPException, Path as PathParam, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from planner import __version__
from planner.catalogue import catalogue_model, load_catalogue
from planner.errors import PlannerError, UnknownModelError, UnknownNameError
from planner.gpus import gpu as lookup_gpu, load_gpus
from planner.plan import estimate_with_time, plan
from planner.presets import PRESETS
from planner.schema import (EstimateRequest, EstimateResult, GpuName, PlanRequest, PlanResult, TimeoutSeconds,
                            VerifySteps, WarmupSteps)
from planner.topology import MAX_TOPOLOGY_BYTES, Topology, parse_topology

MAX_BODY_BYTES = 256 * 1024  # an estimate/plan body with a pasted config.json and topology is < 100 KiB
TOKEN_ENV, TOKEN_FILE_ENV = "PLANNER_API_TOKEN", "PLANNER_API_TOKEN_FILE"

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


class VerifyBody(BaseModel):
    request: EstimateRequest
    steps: VerifySteps = 2
    warmup_steps: WarmupSteps = 1
    timeout_seconds: TimeoutSeconds | None = None


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
               409: {"model": Message, "description": "the device set is busy, or the run is not running"}}
_FIELD_PREFIX = re.compile(r"^(--)?([A-Za-z_][\w.\[\]-]*)(\(|:| must| is| =)")


def validation_detail(message: str) -> list[dict[str, Any]]:
    """A domain error as one FastAPI validation error; loc names the field the message starts with
    (``hidden_size(4096) is not divisible ...`` -> body.hidden_size)."""
    match = _FIELD_PREFIX.match(message)
    loc = ["body", *match.group(2).replace("-", "_").split(".")] if match else ["body"]
    return [{"loc": loc, "msg": message, "type": "value_error"}]


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


def _token() -> str | None:
    token = os.environ.get(TOKEN_ENV)
    path = os.environ.get(TOKEN_FILE_ENV)
    if not token and path:
        try:
            token = Path(path).read_text().strip()
        except OSError:
            token = None
    return token or None


def require_token(authorization: str | None = Header(None, description="Bearer token configured on the server")) -> None:
    expected = _token()
    if expected is None:
        raise HTTPException(401, "launching runs is disabled: no token is configured on the server "
                                 f"({TOKEN_ENV} or {TOKEN_FILE_ENV})")
    given = (authorization or "").removeprefix("Bearer ").strip()
    if not authorization or not authorization.startswith("Bearer ") or not hmac.compare_digest(given, expected):
        raise HTTPException(401, "a valid 'Authorization: Bearer <token>' header is required", {"WWW-Authenticate": "Bearer"})


class Jobs:
    """Verify runs, one at a time per device set, on a worker thread; records live in the runs DB."""

    def __init__(self, db: str | None):
        self.db = db
        self.lock = threading.Lock()
        self.cancels: dict[int, threading.Event] = {}
        self.busy: set[str] = set()
        self.progress: dict[int, tuple[int, int]] = {}  # run id -> (steps done, steps in all)

    def store(self):
        from backend.store import RunStore

        return RunStore(self.db)

    def start(self, body: VerifyBody) -> int:
        from backend.verify import verify

        devices = body.request.gpu
        with self.lock:
            if devices in self.busy:
                raise HTTPException(409, f"a verify run is already running on {devices}; wait or cancel it")
            self.busy.add(devices)
        started = threading.Event()
        holder: dict[str, Any] = {}
        cancel = threading.Event()

        def on_start(run_id: int) -> None:
            holder["id"] = run_id
            self.cancels[run_id] = cancel
            started.set()

        def on_progress(done: int, total: int) -> None:
            if "id" in holder:
                self.progress[holder["id"]] = (done, total)

        def work() -> None:
            try:
                verify(body.request, steps=body.steps, warmup_steps=body.warmup_steps,
                       timeout_seconds=body.timeout_seconds, db=self.db, cancel=cancel, on_start=on_start,
                       on_progress=on_progress)
            except Exception as exc:  # recorded by verify() as refused; keep the reason for the caller
                holder["error"] = str(exc)
            finally:
                with self.lock:
                    self.busy.discard(devices)
                started.set()

        threading.Thread(target=work, daemon=True, name=f"verify-{devices}").start()
        started.wait(timeout=60)
        if "id" not in holder:
            raise HTTPException(422, validation_detail(holder.get("error", "the run could not start")))
        return holder["id"]

    def cancel(self, run_id: int) -> dict[str, Any]:
        run = self.store().get(run_id)
        event = self.cancels.get(run_id)
        if run["status"] != "running" or event is None:
            raise HTTPException(409, f"run {run_id} is {run['status']}, not running")
        event.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.store().get(run_id)["status"] == "running":
            time.sleep(0.2)
        return self.store().get(run_id)


def create_app(db: str | None = None) -> FastAPI:
    jobs = Jobs(db or os.environ.get("PLANNER_DB"))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            jobs.store().mark_interrupted()  # a run that was in flight when the server stopped
        except (PlannerError, ImportError):
            pass
        yield

    app = FastAPI(title="planner", version=__version__, lifespan=lifespan, responses=ERRORS,
                  description="Per-GPU memory, strategy and interconnect planning for distributed training.")
    app.state.jobs = jobs

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse({"detail": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return JSONResponse({"detail": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        return await call_next(request)

    @app.exception_handler(UnknownModelError)
    @app.exception_handler(UnknownNameError)
    async def _not_found(_: Request, exc: PlannerError):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(RequestValidationError)
    async def _unprocessable(_: Request, exc: RequestValidationError):
        return JSONResponse({"detail": json_safe(jsonable_encoder(exc.errors()))}, status_code=422)

    @app.exception_handler(PlannerError)
    async def _invalid(_: Request, exc: PlannerError):
        return JSONResponse({"detail": validation_detail(str(exc))}, status_code=422)

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/v1/models", tags=["catalogue"])
    def models() -> list[dict[str, Any]]:
        return [{"name": n, "family": e.family, "parameters": catalogue_model(n).parameters, "source": e.source,
                 "config": e.config} for n, e in load_catalogue().items()]

    @app.get("/v1/models/{name}", tags=["catalogue"])
    def model(name: str) -> dict[str, Any]:
        resolved = catalogue_model(name)
        entry = load_catalogue()[resolved.name]
        return {"name": resolved.name, "family": entry.family, "parameters": resolved.parameters,
                "source": entry.source, "config": entry.config,
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
        return parse_topology(body.text, lookup_gpu(body.gpu), source="POST /v1/topology")

    @app.post("/v1/estimate", tags=["planning"], response_model=EstimateResult, response_model_by_alias=True)
    def estimate_route(body: EstimateRequest = Body(..., examples=[ESTIMATE_EXAMPLE])) -> EstimateResult:
        return estimate_with_time(body)

    @app.post("/v1/plan", tags=["planning"], response_model=PlanResult, response_model_by_alias=True)
    def plan_route(body: PlanRequest = Body(..., examples=[PLAN_EXAMPLE])) -> PlanResult:
        return plan(body)

    @app.post("/v1/verify", tags=["runs"], response_model=RunStarted, status_code=202,
              dependencies=[Depends(require_token)], responses=AUTH_ERRORS)
    def verify_route(body: VerifyBody = Body(..., examples=[{"request": VERIFY_EXAMPLE, "steps": 2}])) -> RunStarted:
        from planner.memory import resolve

        resolve(body.request)  # refuse a bad request with 404/422 before anything starts
        return RunStarted(id=jobs.start(body), status="running")

    @app.get("/v1/runs", tags=["runs"])
    def runs(limit: int = Query(100, ge=1, le=10_000)) -> list[dict[str, Any]]:
        return jobs.store().list(limit)

    @app.get("/v1/runs/{run_id}", tags=["runs"])
    def run(run_id: RunId) -> dict[str, Any]:
        try:
            out = jobs.store().get(run_id)
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
        except PlannerError as exc:
            raise HTTPException(404, str(exc)) from None

    from web.pages import add_pages

    add_pages(app)
    return app
