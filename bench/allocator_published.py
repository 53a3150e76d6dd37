"""Published allocated/reserved memory next to the planner's allocated and reserved predictions.

    python bench/allocator_published.py [--readme README.md]

The reserved prediction is simulated (planner/memory/reserved.py replays the step through a model of torch
2.13's caching allocator, plus the CUDA context and NCCL's buffers); one H200 has measured it on one
GPU (bench/gpu_report.py's table: the replay matches the device's allocator; multi-GPU runs are unmeasured).
No constant is fitted to these figures. Sources:
- torchtitan docs/performance.md (9dec370, December 2024; Tables 1, 3, 4, 5): Llama 3.1 on H100
  SXM 96 GB at 500 W, memory = max_reserved (torch.cuda.max_memory_reserved), torch 1963fc8;
  Tables 1 and 3 are plain FSDP (no compile, no Float8), local batch 2 x 8192 tokens, selective
  (per-op) activation checkpointing, which the planner brackets by none (above) and full (below);
- meta-llama/llama-cookbook issue #120 (HamidShojanazeri, 2023-08-22): Llama 2 70B, FSDP,
  pure_bf16, 16 A100 80GB: "Max CUDA memory allocated was 42 GB / reserved was 63 GB / Peak
  active CUDA memory was 59 GB" (units as the script printed them). The thread states neither the
  batch nor the sequence: micro-batch 4 and 4096 tokens with full checkpointing are assumed, and
  FSDP2 stands for the FSDP1 FULL_SHARD it ran.
With --readme, the table replaces the README block between the allocator markers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.published_parallel import RUNS, _llama  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.units import GIB  # noqa: E402

TITAN = "torchtitan docs/performance.md"
COOKBOOK = "llama-cookbook #120"


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    fields: dict
    reserved_gib: float
    allocated_gib: float | None = None
    assumed: str = ""


def _titan(name: str) -> Row:
    run = next(r for r in RUNS if r.name == name)
    return Row(run.name, f"{TITAN}, {run.table}", run.fields, run.memory_gib,
               assumed="published run used torch.compile + Float8 (smaller activations than counted)")


def _eight_b(nodes: int, table: str, memory: float, checkpointing: str) -> Row:
    fields = _llama("llama-3.1-8b", nodes, 8192, 2, 1) | {"checkpointing": checkpointing}
    bound = "above" if checkpointing == "none" else "below"
    return Row(f"8B FSDP {8 * nodes}, checkpointing {checkpointing}", f"{TITAN}, {table}", fields, memory,
               assumed=f"published: selective per-op checkpointing, bracketed from {bound} by '{checkpointing}'")


ROWS = [
    _eight_b(1, "Table 1", 82.4, "none"), _eight_b(1, "Table 1", 82.4, "full"),
    _eight_b(16, "Table 3", 67.0, "none"), _eight_b(16, "Table 3", 67.0, "full"),
    _titan("70B FSDP 32 x TP 8"),
    _titan("405B FSDP 8 x TP 8 x PP 8, 1F1B"),
    _titan("405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B"),
    Row("Llama 2 70B FSDP 16 x A100 80GB, pure bf16", COOKBOOK,
        dict(model="llama-2-70b", strategy="fsdp", precision="bf16-pure", gpu="a100-80gb", gpus=8, nodes=2,
             seq_len=4096, micro_batch=4, checkpointing="full", optimizer="adamw"),
        63.0, 42.0, assumed="micro-batch 4 x 4096 tokens assumed; FSDP2 stands for FSDP1; published units as printed"),
]


def predict(row: Row) -> dict:
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    try:
        e = estimate(EstimateRequest(**row.fields))
    except (PlannerError, ValueError) as exc:
        return {"error": str(exc).splitlines()[0]}
    d, a = e.per_device, e.allocator
    return {"allocated": a.allocated_peak_bytes / GIB, "live": d.peak_bytes / GIB,
            "reserved": d.reserved_peak_bytes / GIB, "allocator_reserved": a.reserved_peak_bytes / GIB,
            "expandable": (d.reserved_peak_bytes - a.reserved_peak_bytes + a.other_reserved_peak_bytes) / GIB,
            "terms": (d.cuda_context_bytes + d.nccl_bytes) / GIB}


def _pct(predicted: float, published: float) -> str:
    return f"{100.0 * (predicted - published) / published:+.0f}%"


def table(rows: list[tuple[Row, dict]]) -> str:
    lines = ["| configuration | published allocated | published reserved | predicted allocated | "
             "predicted reserved (simulated) | gap | expandable_segments:True (simulated) | of which context + NCCL | "
             "source | assumed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for row, p in rows:
        if "error" in p:
            lines.append(f"| {row.name} | | {row.reserved_gib:.1f} | | | | | | {row.source} | not predicted: {p['error']} |")
            continue
        published_alloc = "" if row.allocated_gib is None else f"{row.allocated_gib:.1f}"
        lines.append(f"| {row.name} | {published_alloc} | {row.reserved_gib:.1f} | {p['allocated']:.1f} | "
                     f"{p['reserved']:.1f} | {_pct(p['reserved'], row.reserved_gib)} | {p['expandable']:.1f} | "
                     f"{p['terms']:.1f} | {row.source} | {row.assumed} |")
    lines += ["", "GiB = 2^30 bytes (the cookbook row: its printed figures against ours in GiB). Predicted allocated: "
              "the caching allocator's allocated peak (the live peak rounded as it rounds); reserved: its reserved "
              "peak + CUDA context + NCCL's buffers, under torch's default PYTORCH_CUDA_ALLOC_CONF. Simulated: "
              "the allocator model is checked on one H200 (the gpucheck table), these multi-GPU rows are not. "
              "Written by `python bench/allocator_published.py --readme README.md`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.readme import readme_main

    return readme_main(__doc__, "allocator", lambda: table([(row, predict(row)) for row in ROWS]), argv)


if __name__ == "__main__":
    sys.exit(main())
