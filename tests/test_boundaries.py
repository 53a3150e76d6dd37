"""Boundaries (issue 10): core errors carry their field as data, adapters render it (the API's 422
loc, the CLI's --flag); web does not import the CLI; the verify job runner lives in backend; the
job every rank reads is a typed model, validated when read."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.model.architecture import from_hf_config
from planner.frameworks.deepspeed.config import parse_ds_config
from planner.errors import NO_VALUE, PlannerError

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("config,field", [
    (TINY | {"hidden_size": 250}, "hidden_size"),
    (TINY | {"num_key_value_heads": 3}, "num_key_value_heads"),
    (TINY | {"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({"vocab_size": 3}, "model_type"),
    ({"model_type": "gemma3", "text_config": TINY | {"hidden_size": -1}}, "text_config.hidden_size"),
])
def test_a_config_refusal_names_its_field_as_data(config, field):
    with pytest.raises(PlannerError) as caught:
        from_hf_config(config, source="mine")
    assert caught.value.field == field and caught.value.value is NO_VALUE
    assert str(caught.value).startswith("mine: ")  # the message is unchanged: the source, then the field


@pytest.mark.parametrize("config,field", [
    ({"zero_optimization": {"stage": 7}}, "ds_config.zero_optimization.stage"),
    ({"bogus": 1}, "ds_config.bogus"),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}, "ds_config.zero_optimization.offload_param"),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}, "stage": 2}},
     "ds_config.zero_optimization.offload_optimizer.device"),
])
def test_a_ds_config_refusal_names_its_key_path(config, field):
    with pytest.raises(PlannerError) as caught:
        parse_ds_config(config)
    assert caught.value.field == field


@pytest.fixture()
def client(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    monkeypatch.delenv("PLANNER_API_TOKEN_FILE", raising=False)
    return TestClient(create_app(str(tmp_path / "runs.sqlite")))


@pytest.mark.parametrize("body,loc,message", [
    # the message names the config by its name ("custom"), which a regex once took for the field
    ({"model_config": TINY | {"hidden_size": 250}}, ["body", "model_config", "hidden_size"],
     "custom: hidden_size(250) is not divisible by num_attention_heads(4) and no head_dim is given"),
    ({"model_config": {"name": "mine", "config": TINY | {"num_key_value_heads": 3}}},
     ["body", "model_config", "config", "num_key_value_heads"],
     "mine: num_attention_heads(4) is not divisible by num_key_value_heads(3)"),
    ({"model": "gpt2", "ds_config": {"bogus": 1}}, ["body", "ds_config", "bogus"], "ds_config has unknown key 'bogus'"),
    ({"model": "gpt2", "gpu": "v100-32gb", "precision": "bf16-mixed"}, ["body", "precision"],
     "precision bf16-mixed needs bfloat16, which v100-32gb"),
    ({"model": "gpt2", "strategy": "zero3", "ds_config": {"zero_optimization": {"stage": 2}}}, ["body", "strategy"],
     "strategy zero3 contradicts ds_config zero_optimization.stage(2)"),
    ({"model": "gpt2", "topology_text": "garbage"}, ["body", "topology_text"], "topology: no header line"),
])
def test_api_422_body_names_the_field_of_a_core_refusal(client, body, loc, message):
    r = client.post("/v1/estimate", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert len(detail) == 1 and detail[0]["loc"] == loc and detail[0]["msg"].startswith(message), detail
    assert detail[0]["type"] == "value_error"


def test_the_topology_route_names_its_own_text_field(client):
    r = client.post("/v1/topology", json={"text": "garbage", "gpu": "a100-80gb"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "text"], r.text


def test_a_refusal_with_a_value_is_shown_with_it(client, monkeypatch):
    """An error that carries the rejected value (not quoted in its message) shows it as the 422's
    input, as FastAPI shows a schema error's, and the CLI as --flag: got VALUE."""
    from cli.main import error_message
    from web.app import validation_detail

    exc = PlannerError("unknown profile 'nope'; none exists yet", field="profile", value="nope")
    assert validation_detail(exc) == [{"loc": ["body", "profile"], "msg": "unknown profile 'nope'; none exists yet",
                                       "type": "value_error", "input": "nope"}]
    assert error_message(exc) == "--profile: got 'nope': unknown profile 'nope'; none exists yet"
    assert error_message(PlannerError("bad", field="model_config.hidden_size", value=3)) == "--model-file: got 3: bad"
    # without a value, the message (which quotes field and value already) is shown as it is
    assert error_message(PlannerError("hsdp_shard_size(3) must divide ...", field="hsdp_shard_size")) == \
        "hsdp_shard_size(3) must divide ..."


def test_web_does_not_import_the_cli_and_the_job_runner_is_the_backends():
    pytest.importorskip("fastapi")
    code = ("import sys, web.app, web.pages, backend.report; "
            "print(sorted(m for m in sys.modules if m == 'cli' or m.startswith('cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
    import backend.jobs
    import web.app

    assert web.app.Jobs is backend.jobs.Jobs and not hasattr(web.app, "Stop")
    assert "\nimport re\n" not in (ROOT / "web" / "app.py").read_text()  # no message is parsed back into a field


ERRORS = {"PlannerError", "UnknownModelError", "UnknownNameError"}


def _raises_without_field(source: str, name: str) -> list[str]:
    """Each ``raise PlannerError(...)`` (or a subclass) in ``source`` that passes no ``field=``
    keyword: where it is, as ``name:line``. ``field=None`` (the request as a whole) counts as given."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called in ERRORS and not any(k.arg == "field" for k in node.exc.keywords):
                found.append(f"{name}:{node.lineno}")
    return found


def test_every_core_refusal_names_its_field():
    """A refusal without ``field=`` loses its field: the API's 422 loc falls back to the body, the
    CLI's --flag to nothing. Every raise in planner/ (and verify's refusals) must pass it."""
    assert _raises_without_field('raise PlannerError("x")\nraise errors.UnknownNameError(f"y", value=1)', "s") \
        == ["s:1", "s:2"]
    assert _raises_without_field('raise PlannerError("x", field=None)\nraise PlannerError("y", field="pp")', "s") == []
    files = sorted((ROOT / "planner").rglob("*.py")) + [ROOT / "backend" / "launch.py"]
    missing = [m for path in files for m in _raises_without_field(path.read_text(), str(path.relative_to(ROOT)))]
    assert missing == []


def test_worker_job_is_typed_and_validated_when_read(tmp_path, capsys):
    pytest.importorskip("torch")
    from backend.job import VerifyJob
    from backend.launch import worker_job
    from backend.worker import main
    from planner.schema import EstimateRequest

    request = EstimateRequest(model_config=TINY, strategy="fsdp", gpu="cpu", gpus=2, micro_batch=1, seq_len=64)
    job = worker_job(request, steps=1, warmup_steps=0, out_dir=tmp_path)
    assert isinstance(job, VerifyJob) and job.framework == "torch" and job.torch.sharding == "FULL_SHARD"
    written = json.loads(job.to_json())
    assert written["model_config"] == TINY and VerifyJob.model_validate(written) == job
    assert job.for_rank()["model_config"] == TINY  # what backend/train.py reads

    broken = dict(written, micro_batch=0)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(broken))
    assert main(["--job", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--job" in err and "not a job written by backend.launch (micro_batch:" in err
    path.write_text(json.dumps({k: v for k, v in written.items() if k != "torch"}))
    assert main(["--job", str(path)]) == 2
    assert "framework torch needs torch or pipeline settings" in capsys.readouterr().err
    assert not list(tmp_path.glob("rank*.json"))  # refused before the rank started


def test_the_core_reads_no_profile_files_and_no_environment(tmp_path, monkeypatch):
    """planner/time/profiles.py fits and the core applies a Profile it is given; the files and
    PLANNER_PROFILES are backend/profiles.py's. A name without its profile is refused, naming it."""
    import planner.time.profiles
    from backend.profiles import load_profile, profile_for, save_profile
    from planner.time.profiles import Profile
    from planner.schema import EstimateRequest
    from planner.time.step import estimate_with_time

    source = Path(planner.time.profiles.__file__).read_text()
    assert "os.environ" not in source and "read_text" not in source and "import os" not in source
    monkeypatch.setenv("PLANNER_PROFILES", str(tmp_path))
    save_profile(Profile(name="box", gpu="h100-80gb", compute_efficiency=0.3, runs=[], residuals=[], note="test"))
    request = EstimateRequest(model="gpt2", strategy="zero2", gpus=8, gpu="h100-80gb", profile="Box")
    assert load_profile("Box").name == "box"  # case-insensitive, as catalogue names are
    slow = estimate_with_time(request, profile_for(request)).time
    # a profile saved before the kernel model holds one compute efficiency: the override, every
    # model FLOP (no recompute here: what MFU counts) at 30% of peak
    assert slow.compute_seconds == pytest.approx(slow.mfu * slow.step_seconds / 0.3, rel=1e-9)
    with pytest.raises(PlannerError) as caught:
        estimate_with_time(request)  # named, not given
    assert caught.value.field == "profile" and "the core reads no profile files" in str(caught.value)
    with pytest.raises(PlannerError) as caught:
        profile_for(request.model_copy(update={"profile": "boxx"}))
    assert (caught.value.field, caught.value.value) == ("profile", "boxx")
    assert str(caught.value) == "unknown profile 'boxx' (did you mean box?); choose from box"
    save_profile(Profile(name="fast", gpu="h100-80gb", compute_scale=2.0, runs=[], residuals=[], note="test"))
    fast_request = request.model_copy(update={"profile": "fast"})
    fast = estimate_with_time(fast_request, profile_for(fast_request)).time
    plain = estimate_with_time(request.model_copy(update={"profile": None})).time
    assert fast.compute_seconds == pytest.approx(plain.compute_seconds / 2.0, rel=1e-12)  # every kernel rate x 2
