"""One training rank, launched by `deepspeed` (or `torch.distributed.run`).

It builds the architecture from its Hugging Face config (random weights, no download), trains a
few steps on synthetic tokens, and writes what this rank allocated to ``<out>/rank<N>.json``.

Usage (by the launcher, never by hand): ``worker.py --job JOB.json``; JOB.json is written by
``backend.launch`` from a ``planner.schema.WorkerJob``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="path of the WorkerJob JSON")
    # The deepspeed launcher appends --local_rank=N; torchrun sets LOCAL_RANK instead.
    parser.add_argument("--local_rank", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    job = json.loads(Path(args.job).read_text())
    out_dir = Path(job["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    status_path = out_dir / f"rank{rank}.json"
    from backend.procs import bind_rank

    bind_rank(out_dir, rank)  # ends with the run's launcher and supervisor, whatever kills them
    try:
        from backend.train import run_rank  # heavy imports happen here, inside the rank

        result = run_rank(job, rank)
        result["status"] = "ok"
    except BaseException as exc:  # a rank must always leave a record, whatever ended it
        result = {
            "rank": rank,
            "status": _classify(exc),
            "error": f"{type(exc).__name__}: {exc}"[:4000],
            "traceback": traceback.format_exc()[-8000:],
        }
        _write_atomic(status_path, result)
        raise
    _write_atomic(status_path, result)
    return 0


def _classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, MemoryError) or "out of memory" in text or "outofmemory" in text:
        return "oom"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return "crashed"


def _write_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}.{time.monotonic_ns()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
