"""Load test of the REST API: POST /v1/estimate and POST /v1/plan from a second process on loopback.

    python bench/load.py [--seconds 10] [--concurrency 8] [--readme README.md]

Starts `planner serve` (uvicorn, one worker) as a child process on a free loopback port, then
drives it from this process with CONCURRENCY client threads, each sending the same request body
back to back over a kept-alive connection, for SECONDS per endpoint. Reports requests per second
and p50/p99 latency per endpoint; every response must be 200, or the run fails. With --readme,
the table replaces the README's load block.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BODIES = {
    "POST /v1/estimate": ("/v1/estimate", {"model": "llama-3-8b", "strategy": "zero3", "gpus": 8, "gpu": "h100-80gb",
                                           "seq_len": 4096, "micro_batch": 1}),
    "POST /v1/plan": ("/v1/plan", {"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "topology": "hgx-h100",
                                   "seq_len": 4096, "global_batch": 256}),
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, db: str) -> subprocess.Popen:
    planner = Path(sys.executable).with_name("planner")
    command = [str(planner), "serve", "--host", "127.0.0.1", "--port", str(port), "--db", db]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.1)
        if server.poll() is not None:
            raise SystemExit(f"planner serve exited: {server.stderr.read().decode()[-2000:]}")
    server.kill()
    raise SystemExit("planner serve did not answer /healthz within 30 s")


def drive(base: str, path: str, body: dict, seconds: float, concurrency: int) -> dict:
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        mine, bad = [], []
        with httpx.Client(base_url=base, timeout=60) as session:
            session.post(path, json=body)  # connect and warm up outside the measurement
            while time.monotonic() < stop_at:
                start = time.perf_counter()
                response = session.post(path, json=body)
                mine.append(time.perf_counter() - start)
                if response.status_code != 200:
                    bad.append(f"{response.status_code}: {response.text[:200]}")
        with lock:
            latencies.extend(mine)
            failures.extend(bad)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    if failures:
        raise SystemExit(f"{path}: {len(failures)} of {len(latencies)} requests failed, first: {failures[0]}")
    latencies.sort()
    return {"requests": len(latencies), "rps": len(latencies) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def table(results: dict[str, dict], seconds: float, concurrency: int) -> str:
    lines = ["| endpoint | requests | requests/s | p50 latency (ms) | p99 latency (ms) |",
             "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['requests']:,} | {r['rps']:,.1f} | {r['p50_ms']:,.1f} | {r['p99_ms']:,.1f} |")
    cpu = platform.processor() or platform.machine()
    lines.append(f"\n`python bench/load.py --seconds {seconds:g} --concurrency {concurrency}`: one uvicorn worker, "
                 f"{concurrency} client threads in a second process on loopback, {seconds:g} s per endpoint, "
                 f"{os.cpu_count()} CPU cores ({cpu}); every response was 200.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--readme", help="replace the load block of this README")
    args = parser.parse_args()
    import tempfile

    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(port, os.path.join(tmp, "runs.sqlite"))
        try:
            results = {name: drive(f"http://127.0.0.1:{port}", path, body, args.seconds, args.concurrency)
                       for name, (path, body) in BODIES.items()}
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
    text = table(results, args.seconds, args.concurrency)
    from bench.readme import publish

    return publish(text, args.readme, "load")


if __name__ == "__main__":
    sys.exit(main())
