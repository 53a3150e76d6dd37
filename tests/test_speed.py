"""What keeps the start-up path and POST /v1/estimate fast, checked without timing anything
(bench/speed.py and bench/load.py measure): the data files' C loader reads what the pure-Python
loader reads, preset topologies are parsed once, an analytic estimate takes no threadpool hop, and
the estimate CLI loads none of the modules only other requests need."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from planner.datafile import load_data_yaml
from planner.cluster.gpus import gpu as lookup_gpu
from planner.cluster.presets import PRESETS, preset_text, preset_topology
from planner.cluster.topology import parse_topology

ROOT = Path(__file__).resolve().parent.parent
DATA_FILES = sorted((ROOT / "planner" / "data").glob("*.yaml"))


@pytest.mark.parametrize("path", DATA_FILES, ids=lambda p: p.name)
def test_data_files_read_the_same_with_libyaml(path):
    # repr compares types too: a float read as a string (1e-05 in YAML 1.1) would differ
    assert repr(load_data_yaml(path)) == repr(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_is_parsed_once_and_equals_a_fresh_parse(name):
    p = PRESETS[name]
    assert preset_topology(name) is preset_topology(name)
    assert preset_topology(name) == parse_topology(preset_text(p), lookup_gpu(p.gpu), source=f"preset {p.name}")


def test_an_analytic_estimate_takes_no_threadpool_hop(tmp_path, monkeypatch, recorded_hops):
    from backend.anymodel import estimate_any
    from planner.schema import EstimateRequest

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub id below is answered from an empty cache, no network
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    client, hops = recorded_hops
    body = {"model": "llama-3-8b", "strategy": "zero3", "gpus": 8, "gpu": "h100-80gb", "seq_len": 4096}
    r = client.post("/v1/estimate", json=body)
    assert r.status_code == 200 and hops == []
    assert r.json() == json.loads(estimate_any(EstimateRequest(**body)).model_dump_json(by_alias=True))
    r = client.post("/v1/estimate", json={"model": "nobody/absent-model", "gpu": "cpu"})  # a Hub id: I/O
    assert hops == ["estimate_any"] and r.status_code == 422 and "offline (HF_HUB_OFFLINE=1)" in r.text


def test_the_estimate_cli_loads_only_what_it_needs():
    code = ("import contextlib, io, json, sys\n"
            "from cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['estimate', '--model-file', 'examples/tiny-llama.json', '--strategy', 'zero3',"
            " '--gpus', '8', '--gpu', 'h100-80gb', '--json']) == 0\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = set(json.loads(out.stdout))
    unneeded = ["torch", "transformers", "huggingface_hub", "accelerate", "deepspeed", "fastapi", "starlette",
                "uvicorn", "jinja2", "httpx", "sqlite3", "web", "backend.trace", "backend.store", "backend.verify",
                "planner.plan.emit", "cli.render", "planner.time.profiles"]
    assert [m for m in unneeded if m in loaded] == []


def test_only_the_planner_process_freezes_its_objects_before_exit(capsys):
    """The `planner` process (main() reading sys.argv) freezes the collector's objects before the
    interpreter's exit walks them; main() called from Python (tests, other programs) leaves the
    caller's collector alone."""
    import gc

    from cli.main import main

    before = gc.get_freeze_count()
    assert main(["gpus", "--json"]) == 0
    assert gc.get_freeze_count() == before
    code = ("import gc, sys\nsys.argv = ['planner', 'gpus', '--json']\nfrom cli.main import main\n"
            "code = main()\nprint(gc.get_freeze_count() > 0, code, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stderr.split() == ["True", "0"]
