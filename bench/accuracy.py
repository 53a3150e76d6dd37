"""Predicted vs measured per-rank memory on real DeepSpeed runs (CPU ranks, gloo), with the peers.

    python bench/accuracy.py [--only NAME ...] [--readme README.md] [--out bench/results/accuracy.md]
    python bench/accuracy.py --from-records [--readme README.md]

Runs every configuration in tests/real_runs.py through the verification backend, and prints a
Markdown table: measured peak and resident bytes of the worst rank, our prediction and its error,
and what DeepSpeed's own estimator (ZeRO-2/3) and the `accelerate estimate-memory` rule (4x the
model in the training dtype) would have said. With --readme, the table replaces the block between
the accuracy markers in the README.

Every measured run is also kept as bench/results/runs/<name>.json (its request fields and what the
ranks measured: CPU-rank measurements reproduce to the byte). --from-records builds the table from
those records without training again, recomputing every prediction with the current code; a record
whose request fields no longer match the run's declaration is stale and refused by name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.model.architecture import largest_layer_parameters  # noqa: E402
from planner.memory.orchestrator import cpu_rank_bytes, estimate, resolve  # noqa: E402
from planner.memory.peers import (accelerate_adam_training_bytes, deepspeed_zero2_gpu_bytes,  # noqa: E402
                                  deepspeed_zero3_gpu_bytes)
from planner.recipes.precision import RECIPES  # noqa: E402
from planner.schema import EstimateRequest  # noqa: E402
from tests.real_runs import BENCH_RUNS, CI_RUNS, CPU_RUNS, KNOWN_MISSES, TOLERANCE  # noqa: E402

MB = 10**6
RECORDS = ROOT / "bench" / "results" / "runs"
TARGET_PCT = 3.0  # the accuracy target per row, on peak and resident


def _peers(request: EstimateRequest) -> tuple[int | None, int]:
    setup = resolve(request)
    psi = setup.psi
    dtype_bytes = RECIPES[request.precision].param_bytes
    accelerate = accelerate_adam_training_bytes(psi, dtype_bytes)
    if request.strategy == "zero2":
        return deepspeed_zero2_gpu_bytes(psi, request.gpus, request.nodes), accelerate
    if request.strategy == "zero3":
        largest = largest_layer_parameters(setup.arch)
        return deepspeed_zero3_gpu_bytes(psi, largest, request.gpus, request.nodes), accelerate
    return None, accelerate


# The recipe fields (issue 21 and before) a row names when they differ from the default: the
# schema's own defaults, so a new field is one entry here
RECIPE_FIELDS = ("finetune", "quantize_base", "double_quant", "keeps_outputs", "train_metrics", "checkpointing_every",
                 "loss", "loss_chunks", "optimizer", "optimizer_in_backward", "tp_plan", "activation_offload",
                 "text_only", "defer_gradient_sync", "reduce_dtype")


def recipe(request: EstimateRequest) -> str:
    """The recipe a run uses beyond its strategy and precision, in words ("-" when none)."""
    defaults = EstimateRequest.model_fields
    words = []
    for name in RECIPE_FIELDS:
        value = getattr(request, name)
        if name not in request.model_fields_set or value == defaults[name].default:
            continue
        words.append(name.replace("_", "-") if value is True else
                     f"every {value}" if name == "checkpointing_every" else
                     f"{value} chunks" if name == "loss_chunks" else f"{value} loss" if name == "loss" else
                     f"{value} tp_plan" if name == "tp_plan" else
                     f"{value} reduce" if name == "reduce_dtype" else
                     f"{value} train metrics" if name == "train_metrics" else f"{value}")
    return ", ".join(words) or "-"


def _err(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured


def _declared(names: set[str] | None) -> list[tuple[str, dict]]:
    runs = CPU_RUNS + BENCH_RUNS + KNOWN_MISSES
    known = {name for name, _ in runs}
    unknown = sorted((names or set()) - known)
    if unknown:
        raise SystemExit(f"--only: no run named {', '.join(unknown)} in tests/real_runs.py")
    return [(name, fields) for name, fields in runs if not names or name in names]


def _measure(name: str, fields: dict) -> dict | None:
    from backend.launch import run_probe

    request = EstimateRequest(**fields)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        result = run_probe(request, out_dir=Path(tmp), steps=2, warmup_steps=1)
    if result.status != "ok":
        print(f"{name}: {result.status}: {result.message}", file=sys.stderr)
        return None
    record = dict(name=name, fields=fields, seconds=round(time.monotonic() - started, 1),
                  measured_peak=max(r["peak_bytes"] for r in result.ranks),
                  measured_resident=max(r["resident_bytes"] for r in result.ranks))
    if any("offloaded_bytes" in r for r in result.ranks):  # activation_offload: what TRL copied to the host
        record["measured_offloaded"] = max(r["offloaded_bytes"] for r in result.ranks)
    RECORDS.mkdir(parents=True, exist_ok=True)
    (RECORDS / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def _recorded(name: str, fields: dict) -> dict:
    path = RECORDS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"--from-records: run {name} has no record {path.relative_to(ROOT)}; "
                         f"measure it with --only {name}")
    record = json.loads(path.read_text())
    if record["fields"] != json.loads(json.dumps(fields)):
        raise SystemExit(f"--from-records: record of run {name} is stale (its request fields changed); "
                         f"measure it again with --only {name}")
    return record


def _row(name: str, fields: dict, record: dict) -> dict:
    request = EstimateRequest(**fields)
    predicted_peak, predicted_resident = cpu_rank_bytes(estimate(request), request.gpus)
    peak, resident = record["measured_peak"], record["measured_resident"]
    deepspeed_peer, accelerate_peer = _peers(request)
    label = name + (" (known miss)" if (name, fields) in KNOWN_MISSES else "") + \
        (" (CI)" if (name, fields) in CPU_RUNS and name in CI_RUNS else "")  # the part scripts/test.sh runs
    print(f"{name}: peak {_err(predicted_peak, peak):+.2f}%, "
          f"resident {_err(predicted_resident, resident):+.2f}%", file=sys.stderr, flush=True)
    return dict(name=label, strategy=request.strategy, precision=request.precision,
                ranks=request.gpus * request.nodes, offload=request.offload_optimizer,
                tokens=f"{request.micro_batch}x{request.seq_len}", ckpt=request.checkpointing, recipe=recipe(request),
                measured_peak=peak, predicted_peak=predicted_peak,
                measured_resident=resident, predicted_resident=predicted_resident,
                deepspeed=deepspeed_peer, accelerate=accelerate_peer, seconds=record["seconds"])


def run_all(names: set[str] | None, from_records: bool = False) -> list[dict]:
    rows = []
    for name, fields in _declared(names):
        record = _recorded(name, fields) if from_records else _measure(name, fields)
        if record is not None:
            rows.append(_row(name, fields, record))
    return rows


def table(rows: list[dict]) -> str:
    head = ("| run | strategy | precision | ranks | tokens | ckpt | offload | recipe | measured peak (MB) | ours (MB) | "
            "err | measured resident (MB) | ours (MB) | err | DeepSpeed estimator err | accelerate rule err |\n"
            "|---|---|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    errors = []
    for r in rows:
        pe, re_ = _err(r["predicted_peak"], r["measured_peak"]), _err(r["predicted_resident"], r["measured_resident"])
        errors += [abs(pe), abs(re_)]
        ds = f"{_err(r['deepspeed'], r['measured_peak']):+.1f}%" if r["deepspeed"] else "n/a"
        acc = f"{_err(r['accelerate'], r['measured_peak']):+.1f}%"
        lines.append(f"| {r['name']} | {r['strategy']} | {r['precision']} | {r['ranks']} | {r['tokens']} | {r['ckpt']} | "
                     f"{r['offload']} | {r['recipe']} | "
                     f"{r['measured_peak'] / MB:,.2f} | {r['predicted_peak'] / MB:,.2f} | {pe:+.2f}% | "
                     f"{r['measured_resident'] / MB:,.2f} | {r['predicted_resident'] / MB:,.2f} | {re_:+.2f}% | "
                     f"{ds} | {acc} |")
    within = sum(1 for r in rows if abs(_err(r["predicted_peak"], r["measured_peak"])) <= TARGET_PCT
                 and abs(_err(r["predicted_resident"], r["measured_resident"])) <= TARGET_PCT)
    summary = (f"\n{len(rows)} runs on CPU ranks (gloo). Our absolute error over peak and resident: "
               f"median {statistics.median(errors):.2f}%, max {max(errors):.2f}%; {within} of {len(rows)} rows "
               f"within {TARGET_PCT:g}% on both. (CI) rows are asserted within {100 * TOLERANCE:.0f}% by "
               "tests/test_deepspeed_cpu.py.\n") if errors else "\nno runs\n"
    return head + "\n".join(lines) + "\n" + summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="run only these names")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "accuracy.md"))
    parser.add_argument("--readme", help="replace the accuracy block of this README")
    parser.add_argument("--from-records", action="store_true",
                        help="build the table from bench/results/runs/ without training again")
    args = parser.parse_args()
    text = table(run_all(set(args.only) if args.only else None, from_records=args.from_records))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    from bench.readme import publish

    return publish(text, args.readme, "accuracy")


if __name__ == "__main__":
    sys.exit(main())
