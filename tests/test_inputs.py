"""Every bad input is one clear line naming the field and the value: CLI exit 2, HTTP 422 (404 for an
unknown model), never a traceback. Names are checked once, at the schema (planner/schema.py)."""

import io
import json
import time
from pathlib import Path

import pytest

from cli.main import main
from planner.schema import EstimateRequest, PlanRequest
from planner.cluster.gpus import load_gpus

FABRICS = "choose from eth-100g, eth-25g, ib-edr, ib-hdr, ib-ndr, ib-xdr, roce-100g, roce-200g, roce-400g"
GPUS = "choose from " + ", ".join(sorted(load_gpus()))  # every catalogue GPU, in order


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_exit_2(capsys, *argv):
    code, out, err = run(capsys, *argv)
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert out == ""
    return err


@pytest.fixture()
def client(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    monkeypatch.delenv("PLANNER_API_TOKEN_FILE", raising=False)
    monkeypatch.setenv("PLANNER_PROFILES", str(tmp_path / "profiles"))
    return TestClient(create_app(str(tmp_path / "runs.sqlite")))


# --- 1. names, validated at the schema ------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "gpt2", "--fabric", "nope"], f"--fabric: got 'nope': unknown fabric 'nope'; {FABRICS}"),
    (["plan", "--model", "gpt2", "--fabric", "ib-ndrr"], "unknown fabric 'ib-ndrr' (did you mean ib-ndr"),
    (["plan", "--model", "gpt2", "--gpu", "tpu-v5"], f"--gpu: got 'tpu-v5': unknown gpu 'tpu-v5'; {GPUS}"),
    (["estimate", "--model", "gpt2", "--topology", "dgx-z"], "unknown topology preset 'dgx-z' (did you mean dgx-a100"),
    (["plan", "--model", "gpt2", "--objective", "fastest"], "invalid choice: 'fastest'"),
    (["estimate", "--model", "gpt2", "--profile", "mine"], "unknown profile 'mine'; none exists yet"),
    (["estimate", "--model", "gpt2", "--profile", ""], "unknown profile ''"),
    (["estimate", "--model", "", "--gpu", "cpu"], "--model: got '': String should have at least 1 character"),
    (["calibrate", "--name", "x", "--gpu", "tpu"], "argument --gpu: got 'tpu': unknown gpu 'tpu'"),
    (["calibrate", "--name", "my box"], "argument --name: got 'my box': profile name 'my box' must be 1-64 letters"),
])
def test_unknown_names_are_refused_with_the_choices(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.setenv("PLANNER_PROFILES", str(tmp_path / "profiles"))
    assert message in one_line_exit_2(capsys, *argv)


def test_saved_profiles_are_the_profile_catalogue(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_PROFILES", str(tmp_path))
    (tmp_path / "box-a.json").write_text("{}")
    err = one_line_exit_2(capsys, "estimate", "--model", "gpt2", "--profile", "box-b")
    assert "unknown profile 'box-b' (did you mean box-a?); choose from box-a" in err


@pytest.mark.parametrize("path,body,message", [
    ("/v1/plan", {"model": "gpt2", "fabric": "nope"}, "unknown fabric 'nope'; " + FABRICS),
    ("/v1/plan", {"model": "gpt2", "topology": "dgx-z"}, "unknown topology preset 'dgx-z'"),
    ("/v1/plan", {"model": "gpt2", "gpu": "tpu"}, "unknown gpu 'tpu'"),
    ("/v1/estimate", {"model": "gpt2", "gpu": "tpu"}, "unknown gpu 'tpu'"),
    ("/v1/estimate", {"model": "gpt2", "profile": "mine"}, "unknown profile 'mine'"),
    ("/v1/topology", {"text": "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n", "gpu": "a6000"},
     "unknown gpu 'a6000' (did you mean"),
    ("/v1/topology", {"text": "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n"}, "Field required"),
])
def test_api_names_are_422_with_the_choices(client, path, body, message):
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    assert message in r.text
    assert r.json()["detail"][0]["loc"][-1] in body or r.json()["detail"][0]["loc"][-1] == "gpu"


def test_unknown_model_stays_404_and_hub_ids_pass_the_schema(client):
    r = client.post("/v1/estimate", json={"model": "llama-9"})
    assert r.status_code == 404 and "unknown model 'llama-9'" in r.json()["detail"]
    # a Hugging Face Hub id is resolved elsewhere; the schema lets it through
    assert EstimateRequest(model="meta-llama/Llama-3.1-8B").model == "meta-llama/Llama-3.1-8B"
    assert PlanRequest(model="Qwen/Qwen2.5-7B").model == "Qwen/Qwen2.5-7B"


def test_names_are_case_insensitive_and_stored_as_the_catalogue_spells_them(capsys):
    assert EstimateRequest(model="gpt2", gpu="H100-80GB", topology="HGX-H100").gpu == "h100-80gb"
    assert PlanRequest(model="gpt2", fabric="IB-NDR").fabric == "ib-ndr"


def test_the_openapi_schema_lists_the_names():
    schema = PlanRequest.model_json_schema()["properties"]
    fabric = next(a for a in schema["fabric"]["anyOf"] if a.get("type") == "string")
    assert "ib-ndr" in fabric["enum"] and "eth-25g" in fabric["enum"]
    assert "h100-80gb" in schema["gpu"]["enum"]
    topology = next(a for a in schema["topology"]["anyOf"] if a.get("type") == "string")
    assert "hgx-h100" in topology["enum"]


def test_name_checks_do_not_reparse_the_catalogues(monkeypatch):
    """The estimate hot path: checking a name is a dict look-up in a cached catalogue."""
    import yaml

    EstimateRequest(model="gpt2", gpu="h100-80gb", topology="hgx-h100")  # warm the caches
    PlanRequest(model="gpt2", fabric="ib-ndr")
    calls = []
    monkeypatch.setattr(yaml, "safe_load", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(yaml, "load", lambda *a, **k: calls.append(a))  # the data files' loader (planner/datafile.py)
    start = time.perf_counter()
    for _ in range(2000):
        EstimateRequest(model="gpt2", gpu="h100-80gb", topology="hgx-h100")
        PlanRequest(model="gpt2", fabric="ib-ndr")
    assert calls == []
    assert time.perf_counter() - start < 2.0  # ~0.05 ms per request pair here; a guard, not a benchmark


# --- 2. --params as people write it --------------------------------------------------------

@pytest.mark.parametrize("text,count", [("7e9", 7_000_000_000), ("7B", 7_000_000_000), ("70b", 70_000_000_000),
                                        ("1.5T", 1_500_000_000_000), ("405_000_000_000", 405_000_000_000),
                                        ("125M", 125_000_000), ("7000000000", 7_000_000_000)])
def test_params_accepts_scientific_and_suffixed_counts(capsys, client, text, count):
    code, out, err = run(capsys, "estimate", "--params", text, "--strategy", "zero3", "--gpus", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["parameters"] == count
    r = client.post("/v1/estimate", json={"params": text, "strategy": "zero3", "gpus": 8})
    assert r.status_code == 200 and r.json()["parameters"] == count
    assert client.post("/v1/estimate", json={"params": float(count)}).json()["parameters"] == count


@pytest.mark.parametrize("text,message", [
    ("7x", "--params: got '7x': '7x' is not a parameter count; write it as 7000000000, 7e9, 7B"),
    ("1.5", "'1.5' is 1.5 parameters, not a whole number"),
    ("nan", "'nan' is not a parameter count"),
    ("inf", "'inf' is not a parameter count"),
    ("-7B", "'-7B' is not a parameter count"),
    ("", "'' is not a parameter count"),
    ("1__0", "'1__0' is not a parameter count"),
    ("1e99", "--params: got '1e99': Input should be less than or equal to 100000000000000"),
    ("7 billion", "'7 billion' is not a parameter count"),
])
def test_params_refuses_anything_else_naming_the_value(capsys, client, text, message):
    assert message in one_line_exit_2(capsys, "estimate", f"--params={text}")
    r = client.post("/v1/estimate", json={"params": text})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "params"


# --- 3. topo needs --gpu unless a preset names it -------------------------------------------

def test_topo_requires_gpu_for_a_file_or_stdin(capsys, monkeypatch):
    from pathlib import Path

    fixture = str(Path(__file__).parent / "fixtures" / "topologies" / "dgx_a100_8gpu_10nic.txt")
    err = one_line_exit_2(capsys, "topo", "--file", fixture)
    assert "--gpu is required" in err and GPUS in err
    monkeypatch.setattr("sys.stdin", io.StringIO(Path(fixture).read_text()))
    assert "--gpu is required" in one_line_exit_2(capsys, "topo")
    assert "unknown gpu 'a100'" in one_line_exit_2(capsys, "topo", "--file", fixture, "--gpu", "a100")
    code, out, _ = run(capsys, "topo", "--file", fixture, "--gpu", "a100-80gb", "--json")
    assert code == 0 and json.loads(out)["gpu_type"] == "a100-80gb"
    code, out, _ = run(capsys, "topo", "--preset", "a6000-nvlink-pairs", "--json")  # the preset names its GPU
    assert code == 0 and json.loads(out)["gpu_type"] == "rtx-a6000"
    assert "preset dgx-a100 is built from a100-80gb" in one_line_exit_2(capsys, "topo", "--preset", "dgx-a100",
                                                                          "--gpu", "h100-80gb")
    assert "unknown topology preset 'dgx'" in one_line_exit_2(capsys, "topo", "--preset", "dgx")


# --- 6. bounds checked at the request the user sent ----------------------------------------

@pytest.mark.parametrize("argv,body,message", [
    (["--gpus", "1024", "--nodes", "100000"], {"gpus": 1024, "nodes": 100000},
     "micro_batch(1) * gradient_accumulation(1) * gpus(1024) * nodes(100000) = 102400000 sequences per optimizer "
     "step exceeds the global batch bound 16777216"),
    (["--micro-batch", "256", "--gradient-accumulation", "8193", "--gpus", "8", "--seq-len", "64"],
     {"micro_batch": 256, "gradient_accumulation": 8193, "gpus": 8, "seq_len": 64},
     "micro_batch(256) * gradient_accumulation(8193) * gpus(8) * nodes(1) = 16779264"),
    (["--topology", "hgx-h100", "--topology-file", __file__], {"topology": "hgx-h100", "topology_text": "x"},
     "give --topology or --topology-file, not both"),
])
def test_estimate_bounds_name_the_fields_the_user_sent(capsys, client, argv, body, message):
    assert message in one_line_exit_2(capsys, "estimate", "--model", "gpt2", *argv)
    r = client.post("/v1/estimate", json={"model": "gpt2"} | body)
    assert r.status_code == 422 and message in r.json()["detail"][0]["msg"]


@pytest.mark.parametrize("argv,message", [
    (["runs", "--limit", "99999999999999999999"], "argument --limit: got '99999999999999999999': Input should be "
                                                  "less than or equal to 10000"),
    (["runs", "--limit", "0"], "argument --limit: got '0'"),
    (["runs", "99999999999999999999"], "argument ID: got '99999999999999999999'"),
    (["runs", "show", "0"], "argument ID: got '0'"),
    (["verify", "--model", "gpt2", "--gpu", "cpu", "--gpus", "2", "--timeout", "nan"],
     "argument --timeout: got 'nan': Input should be a finite number"),
    (["verify", "--model", "gpt2", "--gpu", "cpu", "--gpus", "2", "--timeout", "-1"],
     "argument --timeout: got '-1': Input should be greater than 0"),
    (["verify", "--model", "gpt2", "--gpu", "cpu", "--gpus", "2", "--timeout", "0"], "argument --timeout: got '0'"),
    (["verify", "--model", "gpt2", "--gpu", "cpu", "--gpus", "2", "--timeout", "inf"], "argument --timeout: got 'inf'"),
    (["verify", "--model", "gpt2", "--gpu", "cpu", "--gpus", "2", "--steps", "0"], "argument --steps: got '0'"),
    (["verify", "--model", "gpt2", "--gpu", "cpu", "--gpus", "2", "--scale", "nan"], "argument --scale: got 'nan'"),
    (["verify", "--model", "gpt2", "--gpu", "cpu", "--gpus", "2", "--tolerance", "-5"], "argument --tolerance"),
    (["serve", "--port", "99999999999999999999"], "argument --port: got '99999999999999999999'"),
    (["plan", "--model", "gpt2", "--emit", ""], "--emit: got '': give a path to write to"),
    (["plan", "--model", "gpt2", "--emit", "   "], "--emit: got '   ': give a path to write to"),
    (["plan", "--model", "gpt2", "--pick", "2"], "--pick 2: needs --emit DIR"),
    (["topo", "--preset", "dgx-a100", "--svg", ""], "--svg: got '': give a path to write to"),
])
def test_cli_numbers_and_paths_at_their_bounds(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANNER_DB", str(tmp_path / "runs.sqlite"))
    import backend.verify
    import uvicorn

    def launched(*a, **k):
        raise AssertionError("nothing may be launched or served on a refused input")

    monkeypatch.setattr(backend.verify, "verify", launched)
    monkeypatch.setattr(uvicorn, "run", launched)
    assert message in one_line_exit_2(capsys, *argv)
    assert list(tmp_path.iterdir()) == []  # nothing written, no database created


def test_api_verify_timeout_must_be_finite_and_positive(client, monkeypatch):
    monkeypatch.setenv("PLANNER_API_TOKEN", "s3cret")
    request = {"model": "gpt2", "strategy": "zero2", "gpus": 2, "gpu": "cpu"}
    for timeout in ("NaN", "-1", "0", "Infinity"):
        r = client.post("/v1/verify", content=f'{{"request": {json.dumps(request)}, "timeout_seconds": {timeout}}}',
                        headers={"Authorization": "Bearer s3cret", "content-type": "application/json"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "timeout_seconds", (timeout, r.text)
    assert client.get("/v1/runs", headers={"Authorization": "Bearer s3cret"}).json() == []


@pytest.mark.parametrize("path,body", [
    ("/v1/estimate", '{"model": "gpt2", "device_memory_gib": NaN}'),
    ("/v1/estimate", '{"model": "gpt2", "device_memory_gib": -Infinity}'),
    ("/v1/plan", '{"model": "gpt2", "headroom": NaN}'),
    ("/v1/plan", '{"model": "gpt2", "compute_efficiency": Infinity}'),
])
def test_nan_and_infinity_in_a_body_are_422_not_500(client, path, body):
    """Python's JSON reader accepts NaN and Infinity; the 422 that echoes them must still be JSON."""
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["input"] in ("nan", "inf", "-inf")


def test_a_config_json_keeps_its_exponent_floats(tmp_path):
    """HF writes "rms_norm_eps": 1e-05; PyYAML (YAML 1.1) would read it as the string '1e-05', and
    transformers' strict config then refuses the run. JSON is read as JSON."""
    from planner.model.catalogue import model_from_file

    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, '
                    '"num_hidden_layers": 1, "num_attention_heads": 4, "rms_norm_eps": 1e-05, "rope_theta": 5e5}')
    config = model_from_file(path).config
    assert config["rms_norm_eps"] == 1e-05 and config["rope_theta"] == 500000.0
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text("config:\n  model_type: gpt2\n  n_embd: 64\n  n_layer: 2\n  n_head: 4\n  vocab_size: 100\n")
    assert model_from_file(yaml_file).config["n_embd"] == 64  # YAML still reads


@pytest.mark.parametrize("flag", ["--ds-config", "--model-file", "--topology-file", "--plan"])
def test_a_binary_file_is_refused_as_not_text(capsys, tmp_path, flag):
    binary = tmp_path / "config.json"
    binary.write_bytes(b"\xff\xfe{\x00}")
    command = {"--plan": ["verify"], "--model-file": ["estimate"]}.get(flag, ["estimate", "--model", "gpt2"])
    err = one_line_exit_2(capsys, *command, flag, str(binary))
    assert f"{flag} {binary}: not a text file" in err


@pytest.mark.parametrize("flag", ["--ds-config", "--model-file", "--topology-file", "--plan"])
def test_an_endless_file_is_refused_by_its_size_not_read_whole(capsys, flag):
    """/dev/zero reports no size and never ends: a size from stat cannot bound it (the process was
    killed for memory); the read stops past the limit."""
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    command = {"--plan": ["verify"], "--model-file": ["estimate"]}.get(flag, ["estimate", "--model", "gpt2"])
    started = time.monotonic()
    err = one_line_exit_2(capsys, *command, flag, "/dev/zero")
    assert f"{flag} /dev/zero: " in err and ("more than" in err or "larger than" in err)
    assert time.monotonic() - started < 10
