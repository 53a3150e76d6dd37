"""The core's module boundaries (issue 10): no planner module imports another's private name, and
no code below the strategy parser matches a phase by its display label."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sources(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_private_imports_between_planner_modules():
    found = []
    for path in _sources("planner"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("planner"):
                found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_phases_are_identified_by_kind_not_label():
    pattern = re.compile(r"label\s*==|label\.startswith|\.name\.startswith\(\"(start|end) of")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in _sources("planner", "backend", "web", "cli")
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_estimate_time_equals_the_plans_time_for_the_same_setting():
    from planner.plan.search import plan
    from planner.schema import EstimateRequest, PlanRequest
    from planner.time.step import estimate_with_time

    result = plan(PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, global_batch=64))
    c = result.recommended
    est = estimate_with_time(EstimateRequest(
        model="llama-3-8b", strategy=c.strategy, gpus=8, gpu="h100-80gb", micro_batch=c.micro_batch,
        gradient_accumulation=c.gradient_accumulation, checkpointing=c.checkpointing,
        offload_optimizer=c.offload_optimizer, offload_params=c.offload_params, hsdp_shard_size=c.hsdp_shard_size))
    assert est.time.step_seconds == c.step_seconds and est.time.communication_seconds == c.communication_seconds
