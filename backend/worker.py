"""One training rank, launched by `deepspeed` or `torchrun`: the planner's own trainer.

It builds the architecture from its Hugging Face config (random weights, no download), trains a
few steps on synthetic tokens, and writes what this rank allocated to ``<out>/rank<N>.json``.

Two entry points, both run by a launcher on every rank:

- ``python -m backend.worker --plan plan.json [--out DIR] [--steps N] [--warmup N]
  [--deepspeed_config ds_config.json]``: the configuration of a plan.json written by
  ``planner plan --emit`` / ``planner estimate --emit`` (what the emitted launch.sh and job.sbatch
  run). With ``--deepspeed_config`` the ranks use that DeepSpeed JSON (the emitted one, or the
  user's edit of it) instead of building the same one again.
- ``worker.py --job JOB.json``: JOB.json written by ``backend.launch`` for ``planner verify``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path


EXIT_USAGE = 2


class PlanFileError(Exception):
    """A plan.json or DeepSpeed JSON the trainer cannot run: one line, exit code 2."""


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backend.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", help="plan.json written by `planner plan --emit` or `planner estimate --emit`")
    source.add_argument("--job", help="path of the VerifyJob JSON (written by backend.launch)")
    parser.add_argument("--out", default="planner-run", help="with --plan: where each rank writes rank<N>.json "
                        "(default: planner-run)")
    parser.add_argument("--steps", type=int, default=3, help="with --plan: measured steps (default: 3)")
    parser.add_argument("--warmup", type=int, default=1, help="with --plan: warm-up steps (default: 1)")
    parser.add_argument("--deepspeed_config", help="with --plan: the DeepSpeed JSON to train with "
                        "(default: the one the plan assumed)")
    # The deepspeed launcher appends --local_rank=N; torchrun sets LOCAL_RANK instead.
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps({args.steps}) must be at least 1 and --warmup({args.warmup}) at least 0")
    return args


def job_from_file(path: str):
    """The VerifyJob backend.launch wrote, validated before the rank imports anything heavy."""
    from pydantic import ValidationError

    from backend.job import VerifyJob

    try:
        return VerifyJob.model_validate_json(Path(path).read_text())
    except OSError as exc:
        raise PlanFileError(f"--job {path}: cannot be read ({exc.strerror})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "job"
        raise PlanFileError(f"--job {path}: not a job written by backend.launch ({where}: {first.get('msg')})") from None


def job_from_plan(args: argparse.Namespace):
    """The VerifyJob of a plan.json, as `planner verify --plan` would launch it."""
    from pydantic import ValidationError

    from backend.launch import worker_job
    from planner.errors import PlannerError
    from planner.schema import EstimateRequest

    try:
        data = json.loads(Path(args.plan).read_text())
        request = EstimateRequest.model_validate(data["estimate_request"])
        job = worker_job(request, steps=args.steps, warmup_steps=args.warmup, out_dir=Path(args.out).resolve())
    except OSError as exc:
        raise PlanFileError(f"--plan {args.plan}: cannot be read ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError, ValidationError, PlannerError) as exc:
        raise PlanFileError(f"--plan {args.plan}: not a runnable plan.json written by `planner ... --emit` "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if args.deepspeed_config:
        if job.ds_config is None:
            raise PlanFileError(f"--deepspeed_config: the plan's strategy {request.strategy} is not a DeepSpeed one")
        try:
            user_config = json.loads(Path(args.deepspeed_config).read_text())
        except (OSError, ValueError) as exc:
            raise PlanFileError(f"--deepspeed_config {args.deepspeed_config}: cannot be read as JSON ({exc})") from None
        if not isinstance(user_config, dict):
            raise PlanFileError(f"--deepspeed_config {args.deepspeed_config}: not a JSON object")
        job = job.model_copy(update={"ds_config": user_config})
    return job.model_copy(update={"predicted_peak_bytes": _predicted_peak(request)})


def _predicted_peak(request) -> int | None:
    from planner.memory.orchestrator import estimate

    try:
        return estimate(request).per_device.peak_bytes
    except Exception:  # the prediction is only shown beside the measurement; the run does not need it
        return None


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        job = job_from_plan(args) if args.plan else job_from_file(args.job)
    except PlanFileError as exc:
        print(f"backend.worker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    status_path = out_dir / f"rank{rank}.json"
    from backend.procs import bind_rank

    bind_rank(out_dir, rank)  # ends with the run's launcher and supervisor, whatever kills them
    try:
        from backend.rank import run_rank  # heavy imports happen here, inside the rank

        result = run_rank(job.for_rank(), rank)
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
    _write_atomic(status_path, result)  # the result first: the teardown below may hang or fail
    if args.plan:
        print(_report(result, job, status_path), flush=True)
    _teardown(TEARDOWN_SECONDS)
    return 0


# How long a rank waits for its process group's teardown after its record is written; launch.py
# gives the launcher TEARDOWN_SECONDS after the last record before it ends the run.
TEARDOWN_SECONDS = 20.0


def _teardown(seconds: float) -> None:
    """destroy_process_group, bounded: on a daemon thread, waited for ``seconds``, so that a gloo
    or DeepSpeed teardown that never returns (seen on a loaded machine) cannot keep a rank whose
    record is written from exiting. The rank then exits without the interpreter's own teardown of
    what is left (os._exit: its record and stdout are flushed already)."""
    import torch.distributed as dist  # loaded already by the rank's training (this module keeps torch lazy)

    if not (dist.is_available() and dist.is_initialized()):
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            if os.environ.get("PLANNER_FAULT", "").startswith(f"teardown-hang:{os.environ.get('RANK', '0')}:"):
                time.sleep(3600)  # tests/test_verify.py: a teardown that never returns (PLANNER_FAULT)
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the record is written; a failing teardown changes nothing
            pass
        done.set()

    threading.Thread(target=destroy, name="planner-teardown", daemon=True).start()
    if not done.wait(seconds):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _report(result: dict, job, path: Path) -> str:
    """One line per rank for whoever ran the emitted launch.sh."""
    predicted = job.predicted_peak_bytes
    versus = f" (predicted {predicted / 2**30:.3f} GiB per device)" if predicted else ""
    return (f"rank {result['rank']}/{result.get('world_size', '?')}: trained {job.steps} steps after "
            f"{job.warmup_steps} warm-up, median step {result.get('step_seconds', 0.0):.3f} s, measured peak "
            f"{result['peak_bytes'] / 2**30:.3f} GiB{versus}; record {path}")


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
