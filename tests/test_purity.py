"""`import planner` stays light: the analytic core never loads the heavy stack."""

import json
import subprocess
import sys

HEAVY = ["torch", "deepspeed", "transformers", "fastapi", "jinja2", "uvicorn", "accelerate"]


def test_import_planner_loads_no_heavy_module():
    code = ("import sys, json, planner, planner.memory.orchestrator, planner.memory.buffers, planner.model.catalogue, planner.frameworks.deepspeed.config; "
            "from planner.memory.orchestrator import estimate; from planner.schema import EstimateRequest; "
            "estimate(EstimateRequest(model='gpt2', strategy='zero2', gpus=2)); "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_core_never_imports_the_adapters():
    import pathlib

    core = pathlib.Path(__file__).resolve().parent.parent / "planner"
    for path in core.rglob("*.py"):
        text = path.read_text()
        for adapter in ("import backend", "from backend", "import web", "from web", "import cli", "from cli"):
            assert adapter not in text, f"{path.name} imports an adapter: {adapter}"
