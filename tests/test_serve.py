"""`planner serve` as a user runs it: uvicorn in a process of its own on 127.0.0.1. A served
verify ends with the server however the server is stopped; a chunked body is refused at the limit."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.own_run import live_processes, ranks_training, segments, wait_until
from tests.ports import free_port
from tests.real_runs import LLAMA

pytest.importorskip("uvicorn")
ROOT = Path(__file__).resolve().parent.parent
TOKEN = "s3cret"


def _get(url: str, **headers) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


@pytest.fixture()
def serve(tmp_path):
    """Start `planner serve` with the given extra environment; yields (process, port)."""
    started = []

    def start(db: Path, **env_extra: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path), PLANNER_LOCK_DIR=str(tmp_path / "locks"),
                   PLANNER_API_TOKEN=TOKEN, **env_extra)
        log = open(tmp_path / f"serve-{port}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--db", str(db)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        assert wait_until(lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200, 90), \
            (tmp_path / f"serve-{port}.log").read_text()
        return proc, port

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.mark.deepspeed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_server_leaves_no_rank_no_segment_and_records_interrupted(serve, tmp_path, sig):
    pytest.importorskip("deepspeed")
    from backend.store import RunStore

    db = tmp_path / "runs.sqlite"
    server, port = serve(db, PLANNER_FAULT="hang:0:1")
    body = {"request": {"model_config": dict(LLAMA, num_hidden_layers=2), "strategy": "zero1", "gpus": 2,
                        "gpu": "cpu", "micro_batch": 1, "seq_len": 64}, "steps": 2, "warmup_steps": 1}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/verify", json.dumps(body), {"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {TOKEN}"})
    response = conn.getresponse()
    assert response.status == 202, response.read()
    run_id = json.loads(response.read())["id"]
    work = wait_until(lambda: sorted(tmp_path.glob(f"planner-run{run_id}-*")), 60)[0]
    assert wait_until(lambda: ranks_training(work), 240), "the ranks never trained"
    assert len(live_processes(work)) >= 4 and segments(work)
    for pid_file in work.glob("rank*.pid"):  # the API token never reaches a training rank
        environ = Path(f"/proc/{pid_file.read_text().split()[0]}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith(b"PLANNER_API_TOKEN")]
    server.send_signal(sig)
    server.wait(timeout=90)
    assert wait_until(lambda: not live_processes(work), 15), live_processes(work)
    assert segments(work) == []
    run = RunStore(db).get(run_id)
    assert run["status"] == "interrupted" and run["finished"] is not None, run
    expected = "the server stopped" if sig == signal.SIGTERM else f"(pid {server.pid}) ended"
    assert expected in run["message"], run["message"]


def test_a_chunked_body_is_refused_at_the_limit_not_read_whole(serve, tmp_path):
    from web.app import MAX_BODY_BYTES

    _, port = serve(tmp_path / "runs.sqlite")
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(b"POST /v1/estimate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b" " * 65536
        for _ in range(MAX_BODY_BYTES // len(chunk) + 2):  # over the limit, and never the final chunk:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))  # a server waiting for the end never answers
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    # a chunked body under the limit still reaches the route whole
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/estimate", iter([b'{"model": ', b'"gpt2", "gpu": "a100-80gb"}']),
                 {"Content-Type": "application/json"}, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["per_device"]["peak_bytes"] > 0
