"""Request bodies of the API beyond planner/schema.py's, shared by the API (web/app.py) and the
page's form actions (web/pages.py)."""

from __future__ import annotations

from pydantic import BaseModel

from planner.schema import EstimateRequest, TimeoutSeconds, VerifySteps, WarmupSteps


class VerifyBody(BaseModel):
    request: EstimateRequest
    steps: VerifySteps = 2
    warmup_steps: WarmupSteps = 1
    timeout_seconds: TimeoutSeconds | None = None
