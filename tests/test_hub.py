"""Hub ids (org/name) read config.json through huggingface_hub, from a cache made here: never the network."""

import json

import pytest

pytest.importorskip("huggingface_hub")

from cli.main import main  # noqa: E402

TINY = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "architectures": ["LlamaForCausalLM"]}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root, repo_id: str, config: dict) -> None:
    """huggingface_hub's cache layout (file_download.py): models--org--name/{refs/main, snapshots/<commit>/}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))


@pytest.fixture()
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_cached_hub_id_is_read_offline(offline_cache, capsys):
    fake_cache(offline_cache, "someorg/tiny-llama", TINY)
    code, out, err = run(capsys, "estimate", "--model", "someorg/tiny-llama", "--strategy", "zero2", "--gpus", "2",
                         "--gpu", "cpu", "--seq-len", "64", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["model"]["name"] == "someorg/tiny-llama"
    assert result["model"]["source"] == "https://huggingface.co/someorg/tiny-llama/blob/main/config.json"
    from planner.model.catalogue import model_from_config

    assert result["parameters"] == model_from_config(TINY).parameters


def test_offline_and_not_cached_is_one_line_exit_2(offline_cache, capsys):
    code, out, err = run(capsys, "estimate", "--model", "someorg/not-here", "--gpu", "cpu")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "model 'someorg/not-here': offline (HF_HUB_OFFLINE=1) and its config.json is not in the Hugging Face cache" in err


def test_catalogue_hub_ids_need_no_network_nor_cache(offline_cache, capsys):
    code, out, err = run(capsys, "estimate", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["name"] == "llama-3.1-8b"


def test_plan_takes_a_hub_id(offline_cache, capsys):
    fake_cache(offline_cache, "someorg/tiny-llama", TINY)
    code, out, err = run(capsys, "plan", "--model", "someorg/tiny-llama", "--gpu", "rtx-4090", "--gpus", "2",
                         "--seq-len", "128", "--global-batch", "4", "--json")
    assert code == 0, err
    assert json.loads(out)["recommended"] is not None


def test_a_cached_hub_id_without_a_reader_is_traced(offline_cache, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    fake_cache(offline_cache, "someorg/tiny-starcoder2", {**TINY, "model_type": "starcoder2", "intermediate_size": 1024})
    code, out, err = run(capsys, "estimate", "--model", "someorg/tiny-starcoder2", "--gpu", "cpu", "--seq-len", "64",
                         "--json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any(n.startswith("traced: model_type 'starcoder2'") for n in notes)


def test_a_broken_cached_config_is_one_line(offline_cache, capsys):
    fake_cache(offline_cache, "someorg/broken", TINY)
    (offline_cache / "models--someorg--broken" / "snapshots" / COMMIT / "config.json").write_text("[1, 2")
    code, _, err = run(capsys, "estimate", "--model", "someorg/broken", "--gpu", "cpu")
    assert code == 2 and err.count("\n") == 1 and "the cached config.json" in err


def test_api_reads_hub_ids_and_says_422_offline(offline_cache, tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from web.app import create_app

    fake_cache(offline_cache, "someorg/tiny-llama", TINY)
    client = TestClient(create_app(str(tmp_path / "runs.sqlite")))
    r = client.post("/v1/estimate", json={"model": "someorg/tiny-llama", "gpu": "cpu", "seq_len": 64})
    assert r.status_code == 200 and r.json()["model"]["name"] == "someorg/tiny-llama"
    r = client.post("/v1/estimate", json={"model": "someorg/absent", "gpu": "cpu"})
    assert r.status_code == 422
    assert "offline (HF_HUB_OFFLINE=1) and its config.json is not in the Hugging Face cache" in r.json()["detail"][0]["msg"]
    r = client.post("/v1/plan", json={"model": "someorg/absent", "gpu": "rtx-4090", "gpus": 2, "global_batch": 4})
    assert r.status_code == 422
    # catalogue entries answer to their Hub ids everywhere, /v1/models/{org/name} included
    assert client.get("/v1/models/meta-llama/Llama-3.1-8B").json()["name"] == "llama-3.1-8b"
    listed = {m["name"]: m for m in client.get("/v1/models").json()}
    assert {"llama-3.1-8b", "llama-3.1-70b", "llama-3.3-70b", "phi-4", "mistral-small-24b"} <= set(listed)
    assert "mistral-7b" in listed["mistral-7b-v0.1"]["aliases"]
    assert client.get("/v1/models/nobody/nothing").status_code == 404


def test_models_lists_aliases(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("mistral-7b-v0.1 "))
    assert "mistral-7b" in line and "mistralai/Mistral-7B-v0.1" in line
    for name in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.3-70b", "phi-4", "mistral-small-24b"):
        assert any(ln.startswith(name + " ") for ln in out.splitlines())
    code, out, _ = run(capsys, "models", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert "meta-llama/Llama-3.1-8B" in rows["llama-3.1-8b"]["aliases"]


@pytest.mark.parametrize("error,message", [
    ("GatedRepoError", "is gated on the Hugging Face Hub: accept its license there and give a token"),
    ("RepositoryNotFoundError", "no such Hugging Face Hub repository"),
    ("EntryNotFoundError", "the repository has no config.json"),
    ("LocalEntryNotFoundError", "the Hub cannot be reached and its config.json is not in the Hugging Face cache"),
])
def test_hub_errors_are_one_line(tmp_path, monkeypatch, capsys, error, message):
    """What hf_hub_download raises online (no network here: the download is replaced by the error)."""
    import huggingface_hub
    from huggingface_hub import errors

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    seen = []

    def download(repo_id, filename, **kwargs):
        seen.append((repo_id, filename))
        cls = getattr(errors, error)
        exc = cls.__new__(cls)  # the HTTP errors want a live response; only the type matters here
        Exception.__init__(exc, "simulated")
        raise exc

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr("backend.hub._reachable", lambda *args: None)  # online, as simulated
    code, out, err = run(capsys, "estimate", "--model", "someorg/private-model", "--gpu", "cpu")
    assert seen == [("someorg/private-model", "config.json")]
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err
