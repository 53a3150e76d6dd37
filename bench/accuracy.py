"""Predicted vs measured per-rank memory on real DeepSpeed runs (CPU ranks, gloo), with the peers.

    python bench/accuracy.py [--only NAME ...] [--readme README.md] [--out bench/results/accuracy.md]

Runs every configuration in tests/real_runs.py through the verification backend, and prints a
Markdown table: measured peak and resident bytes of the worst rank, our prediction and its error,
and what DeepSpeed's own estimator (ZeRO-2/3) and the `accelerate estimate-memory` rule (4x the
model in the training dtype) would have said. With --readme, the table replaces the block between
the accuracy markers in the README.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.architecture import largest_layer_parameters  # noqa: E402
from planner.memory import cpu_rank_bytes, estimate, resolve  # noqa: E402
from planner.peers import (accelerate_adam_training_bytes, deepspeed_zero2_gpu_bytes,  # noqa: E402
                           deepspeed_zero3_gpu_bytes)
from planner.schema import EstimateRequest  # noqa: E402
from tests.real_runs import BENCH_RUNS, CPU_RUNS, KNOWN_MISSES, TOLERANCE  # noqa: E402

MB = 10**6
TARGET_PCT = 3.0  # the accuracy target per row, on peak and resident


def _peers(request: EstimateRequest) -> tuple[int | None, int]:
    setup = resolve(request)
    psi = setup.psi
    dtype_bytes = 4 if request.precision == "fp32" else 2
    accelerate = accelerate_adam_training_bytes(psi, dtype_bytes)
    if request.strategy == "zero2":
        return deepspeed_zero2_gpu_bytes(psi, request.gpus, request.nodes), accelerate
    if request.strategy == "zero3":
        largest = largest_layer_parameters(setup.arch)
        return deepspeed_zero3_gpu_bytes(psi, largest, request.gpus, request.nodes), accelerate
    return None, accelerate


def _err(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured


def run_all(names: set[str] | None) -> list[dict]:
    from backend.launch import run_probe

    rows = []
    for name, fields in CPU_RUNS + BENCH_RUNS + KNOWN_MISSES:
        if names and name not in names:
            continue
        request = EstimateRequest(**fields)
        predicted_peak, predicted_resident = cpu_rank_bytes(estimate(request), request.gpus)
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            result = run_probe(request, out_dir=Path(tmp), steps=2, warmup_steps=1)
        if result.status != "ok":
            print(f"{name}: {result.status}: {result.message}", file=sys.stderr)
            continue
        peak = max(r["peak_bytes"] for r in result.ranks)
        resident = max(r["resident_bytes"] for r in result.ranks)
        deepspeed_peer, accelerate_peer = _peers(request)
        label = name + (" (known miss)" if (name, fields) in KNOWN_MISSES else "") + \
            (" (CI)" if (name, fields) in CPU_RUNS else "")
        rows.append(dict(name=label, strategy=request.strategy, precision=request.precision,
                         ranks=request.gpus * request.nodes, offload=request.offload_optimizer,
                         tokens=f"{request.micro_batch}x{request.seq_len}", ckpt=request.checkpointing,
                         measured_peak=peak, predicted_peak=predicted_peak,
                         measured_resident=resident, predicted_resident=predicted_resident,
                         deepspeed=deepspeed_peer, accelerate=accelerate_peer,
                         seconds=time.monotonic() - started))
        print(f"{name}: peak {_err(predicted_peak, peak):+.2f}%, "
              f"resident {_err(predicted_resident, resident):+.2f}%", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| run | strategy | precision | ranks | tokens | ckpt | offload | measured peak (MB) | ours (MB) | err | "
            "measured resident (MB) | ours (MB) | err | DeepSpeed estimator err | accelerate rule err |\n"
            "|---|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    errors = []
    for r in rows:
        pe, re_ = _err(r["predicted_peak"], r["measured_peak"]), _err(r["predicted_resident"], r["measured_resident"])
        errors += [abs(pe), abs(re_)]
        ds = f"{_err(r['deepspeed'], r['measured_peak']):+.1f}%" if r["deepspeed"] else "n/a"
        acc = f"{_err(r['accelerate'], r['measured_peak']):+.1f}%"
        lines.append(f"| {r['name']} | {r['strategy']} | {r['precision']} | {r['ranks']} | {r['tokens']} | {r['ckpt']} | "
                     f"{r['offload']} | "
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
    args = parser.parse_args()
    text = table(run_all(set(args.only) if args.only else None))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    if args.readme:
        from bench.readme import replace_block

        return replace_block(args.readme, "accuracy", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
