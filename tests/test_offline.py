"""Offline (issue 27, item 7): this machine has no network, as a user's may not. /docs renders
from assets the server serves itself, and an unknown Hub id without HF_HUB_OFFLINE is refused in
seconds, in one line naming --model-file and HF_HUB_OFFLINE=1; the API answers as fast."""

import re
import time

import pytest

from cli.main import main

pytest.importorskip("fastapi")
pytest.importorskip("swagger_ui_bundle")
from fastapi.testclient import TestClient  # noqa: E402

from web.app import create_app  # noqa: E402


@pytest.fixture()
def client(tmp_path):
    return TestClient(create_app(str(tmp_path / "runs.sqlite")))


def test_docs_are_served_without_a_cdn(client):
    page = client.get("/docs")
    assert page.status_code == 200
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text) + re.findall(r"url: '([^']+)'", page.text)
    assert urls and not any(u.startswith(("http:", "https:", "//")) for u in urls)
    for url in urls:
        asset = client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 0, url
    assert "SwaggerUIBundle" in client.get("/docs-assets/swagger-ui-bundle.js").text


def _online_env(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_an_unknown_hub_id_without_a_network_is_refused_in_seconds(monkeypatch, tmp_path, capsys):
    _online_env(monkeypatch, tmp_path)
    started = time.perf_counter()
    assert main(["estimate", "--model", "someorg/no-such-model"]) == 2
    assert time.perf_counter() - started < 8
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model-file" in err and "HF_HUB_OFFLINE=1" in err
    assert "Retrying" not in err


def test_the_api_answers_an_unknown_hub_id_and_unknown_names_fast(monkeypatch, tmp_path, client):
    _online_env(monkeypatch, tmp_path)
    started = time.perf_counter()
    r = client.post("/v1/estimate", json={"model": "someorg/no-such-model"})
    assert r.status_code == 422 and "HF_HUB_OFFLINE=1" in str(r.json()["detail"])
    assert client.post("/v1/estimate", json={"model": "no-such-catalogue-name"}).status_code == 404
    assert time.perf_counter() - started < 8
