"""The GPU check's measurements as the README shows them: predicted against measured on a real GPU.

    python bench/gpu_report.py [--results bench/results/gpu_check_h200_1.json ...] [--readme README.md]
                               [--calibration planner/data/allocator_calibration.json]

Reads the JSON files bench/gpu_check.py wrote (one per lease) and writes the README block
``gpucheck``; with --calibration, writes the file planner/memory/reserved.py reads (the CUDA context
measured, the runs without their memory_stats). Every figure comes from those files: nothing is typed in.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_check import request_for  # noqa: E402
from bench.readme import publish  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.time.step import estimate_with_time  # noqa: E402
from planner.memory.orchestrator import estimate  # noqa: E402
from planner.model.catalogue import catalogue_model  # noqa: E402

DEFAULT_RESULTS = sorted(str(p) for p in (ROOT / "bench" / "results").glob("gpu_check_*.json"))
GB = 1e9


def load(paths: list[str]) -> list[dict]:
    return [json.loads(Path(p).read_text()) | {"_file": Path(p).name} for p in paths]


def recipe_text(row: dict) -> str:
    fields = dict(row.get("recipe") or {})
    fields.pop("checkpointing", None)
    return ", ".join(f"{k}={v}" for k, v in fields.items()) or "-"


def predicted_now(result: dict, row: dict) -> tuple[int, int, float | None]:
    """The allocator simulation's allocated and reserved peaks and the step's seconds for this run
    under today's model (the figures the run itself recorded are the model's at the lease)."""
    # the first leases did not record the model: gpu_check's defaults then (llama-3-8b, 2 layers, h200)
    base = catalogue_model(result.get("model", "llama-3-8b"))
    config = dict(base.config, num_hidden_layers=result.get("layers", 2))
    fields = dict(row.get("recipe") or {})
    if row["checkpointing"] != "none":
        fields["checkpointing"] = row["checkpointing"]
    request = request_for(config, result.get("gpu", "h200"), row["strategy"],
                          (row["seq_len"], row["micro_batch"], row["checkpointing"], row["attention"], fields),
                          row.get("alloc_conf", ""))
    try:
        timed = estimate_with_time(request)
        allocator, seconds = timed.allocator, timed.time.step_seconds
    except PlannerError:  # a recipe the time model refuses: the memory alone
        allocator, seconds = estimate(request).allocator, None
    return allocator.allocated_peak_bytes, allocator.reserved_peak_bytes, seconds


def measured_runs(results: list[dict]):
    """(result, run, today's predicted_now) for every run that measured (status ok), in file order."""
    for result in results:
        for row in result["runs"]:
            if row.get("status") == "ok":
                yield result, row, predicted_now(result, row)


def summary(results: list[dict]) -> str:
    """One line: the spread of the allocated, reserved and step errors over the measured runs."""
    allocated, reserved, steps = [], [], []
    for result, row, (predicted, res_p, step_p) in measured_runs(results):
        allocated.append(100 * (predicted / row["measured_allocated_peak_bytes"] - 1))
        reserved.append(100 * (res_p / row["measured_reserved_peak_bytes"] - 1))
        if result.get("step_timing") == "step-only" and row.get("measured_step_seconds") and step_p:
            steps.append(row["measured_step_seconds"] / step_p)
    under = sum(e < 0 for e in allocated)
    text = (f"{len(allocated)} runs: allocated peak {min(allocated):+.2f}% to {max(allocated):+.2f}% "
            f"({under} under-predicted), reserved {min(reserved):+.1f}% to {max(reserved):+.1f}% "
            f"({sum(e < 0 for e in reserved)} under-predicted)")
    short = replay_shortfall(results)
    if short["fraction"] > 0:
        text += (f"; an estimate holds back the largest reserved shortfall, {100 * short['fraction']:.2f}% "
                 f"({short['worst_run']}), beyond the replay")
    if steps:
        text += f"; measured step / predicted {min(steps):.2f}x to {max(steps):.2f}x over {len(steps)} timed runs"
    return text + "."


def runs_table(results: list[dict]) -> list[str]:
    lines = ["| file | strategy | tokens (seq x mb) | ckpt | attention | recipe | allocated measured | allocated "
             "predicted | error | reserved measured | reserved predicted | error | step measured | step predicted |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result, row, (predicted, res_p, step_p) in measured_runs(results):
        measured, res_m = row["measured_allocated_peak_bytes"], row["measured_reserved_peak_bytes"]
        # the step seconds of the first lease counted the harness's barrier and gc.collect
        # (backend/train.py before add9d12): shown only where the rank timed the step alone
        step_m = row.get("measured_step_seconds") if result.get("step_timing", "") == "step-only" else None
        lines.append(
            f"| {result['_file']} | {row['strategy']} | {row['seq_len']} x {row['micro_batch']} | {row['checkpointing']} "
            f"| {row['attention']} | {recipe_text(row)} | {measured / GB:.3f} GB | {predicted / GB:.3f} GB "
            f"| {100 * (predicted / measured - 1):+.2f}% | {res_m / GB:.3f} GB | {res_p / GB:.3f} GB "
            f"| {100 * (res_p / res_m - 1):+.1f}% | {f'{1e3 * step_m:.0f} ms' if step_m else '-'} "
            f"| {f'{1e3 * step_p:.0f} ms' if step_p and step_m else '-'} |")
    return lines


def kernels_lines(result: dict) -> list[str]:
    kernels = result.get("kernels")
    if not kernels:
        return []
    lines = ["", "bf16 GEMM, one full wave of 128 x 256 tiles, against planner/time/kernels.py:", "",
             "| K | measured TFLOP/s | modelled TFLOP/s |", "|---:|---:|---:|"]
    lines += [f"| {g['k']} | {g['measured_tflops']:.0f} | {g['modelled_tflops']:.0f} |" for g in kernels["gemms"]]
    lines += ["", "| SDPA causal, head 128 | forward TFLOP/s | backward TFLOP/s | modelled forward/backward rate |",
              "|---|---:|---:|---:|"]
    lines += [f"| seq {a['seq']} | {a['forward_tflops']:.0f} | {a['backward_tflops']:.0f} | "
              f"{a['modelled_forward_over_backward']:.2f} (measured {a['forward_tflops'] / a['backward_tflops']:.2f}) |"
              for a in kernels["attention"]]
    return lines


def report(results: list[dict], torch_version: str) -> str:
    first = next(r for r in results if "context" in r)
    ctx = first["context"]
    out = [f"Measured on one {first['device']} (driver {first.get('driver') or '?'}, CUDA {first.get('cuda') or '?'}, "
           f"torch {torch_version}) by `bench/gpu_check.py`, {len(results)} lease(s): Llama-3-8B at full width, "
           "2 layers (vocabulary 128,256), bf16-mixed. Predicted allocated is the allocator simulation's peak "
           "(planner/memory/reserved.py: the step's tensors plus the cuBLAS workspaces) and the step's seconds "
           "are the current model's.", "",
           "| CUDA term | measured |", "|---|---:|",
           f"| context before any tensor | {ctx['used_before_tensors_bytes']:,} B |",
           f"| context after the first bf16 matmul (device used minus torch's reserved) | "
           f"{ctx['used_after_first_matmul_bytes'] - ctx['reserved_after_first_matmul_bytes']:,} B |",
           f"| allocated after the first matmul (a 2 MiB operand + cuBLAS's workspace) | "
           f"{ctx['allocated_after_first_matmul_bytes']:,} B |"]
    for result in results:
        if result.get("matmul_tflops"):
            rates = ", ".join(f"{k} {v:.0f}" for k, v in result["matmul_tflops"].items())
            out.append(f"| best square matmul TFLOP/s | {rates} |")
        if result.get("hbm_copy_gbps"):
            out.append(f"| device-to-device copy (read + written) | {result['hbm_copy_gbps']:.0f} GB/s |")
    out += ["", summary(results), "", *runs_table(results)]
    for result in results:
        out += kernels_lines(result)
    return "\n".join(out)


def replay_shortfall(results: list[dict]) -> dict:
    """The largest fraction by which a measured reserved peak exceeded the replay's, under the current
    model (0 when the replay never falls short): what planner/memory/reserved.py holds back."""
    worst, where = 0.0, ""
    for result, row, (_, replayed, _) in measured_runs(results):
        short = row["measured_reserved_peak_bytes"] / replayed - 1
        if short > worst:
            worst, where = short, f"{result['_file']}: {row['strategy']} {row['seq_len']} x {row['micro_batch']} " \
                                  f"{recipe_text(row)}"
    return {"fraction": math.ceil(worst * 1e4) / 1e4, "worst_run": where,
            "runs": sum(r.get("status") == "ok" for result in results for r in result["runs"])}


def calibration(results: list[dict], gpu: str, torch_version: str) -> dict:
    first = next(r for r in results if "context" in r)
    ctx = first["context"]
    runs = [{k: v for k, v in row.items() if k not in ("memory_stats", "log_tail")}
            for r in results for row in r["runs"] if row.get("status") == "ok"]
    return {"format": 1, "torch": torch_version, "replay_shortfall": replay_shortfall(results), "gpus": {gpu: {
        "cuda_context_bytes": ctx["used_after_first_matmul_bytes"] - ctx["reserved_after_first_matmul_bytes"],
        "module_loading": ctx.get("module_loading", ""),
        "nccl_bytes_per_communicator": first.get("nccl_bytes_per_communicator"),
        "driver": first.get("driver", ""), "cuda": first.get("cuda", ""), "device": first["device"],
        "sources": [r["_file"] for r in results], "runs": runs}}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", default=DEFAULT_RESULTS)
    parser.add_argument("--gpu", default="h200", help="the gpus.yaml name the results were measured on")
    parser.add_argument("--readme", help="replace the gpucheck block of this README")
    parser.add_argument("--calibration", help="write the allocator calibration here")
    args = parser.parse_args()
    results = load(args.results)
    if not results:
        print("--results: no gpu_check JSON files", file=sys.stderr)
        return 2
    torch_version = next((r["torch"] for r in results if r.get("torch")), "?")
    if args.calibration:
        Path(args.calibration).write_text(json.dumps(calibration(results, args.gpu, torch_version), indent=1) + "\n")
    return publish(report(results, torch_version), args.readme, "gpucheck")


if __name__ == "__main__":
    sys.exit(main())
