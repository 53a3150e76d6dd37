"""torchtitan's published Llama 3.1 8B FSDP rows with selective (per-op) activation checkpointing,
next to the planner's prediction of the same run asked as it was run (--checkpointing selective-op).

    python bench/published_selective.py [--readme README.md]

Source: torchtitan benchmarks/llama3_h100_202412_torchtitan.md (b5bcd76; the December 2024 table
that was docs/performance.md at 9dec370), Tables 1 and 3, the plain "FSDP" rows (no
torch.compile, no Float8): Llama 3.1 8B, local batch 2 at torchtitan's 8,192 tokens
(train_configs/llama3_8b.toml seq_len), 8 and 128 H100 (96 GB, 500 W), activation checkpointing
mode 'selective' with selective_ac_option 'op' (llama3_8b.toml at 9dec370), FSDP2 reducing in
fp32. Memory is torchtitan's logged max_reserved, throughput tokens/s per GPU at the 90th step.
The predictions for no and for full checkpointing are shown beside them: the published rows sit
between the two, where the planner could not place them before it modelled the op policy. With
--readme the table replaces the README block between the published-selective markers.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.published_parallel import RESERVE, Published, _llama, predict  # noqa: E402

TABLE = "benchmarks/llama3_h100_202412_torchtitan.md"
RUNS = [
    Published("8B FSDP 8, selective AC (op)", "Table 1", _llama("llama-3.1-8b", 1, 8192, 2, 1,
                                                                 checkpointing="selective-op"), 82.4, 5762, (RESERVE,)),
    Published("8B FSDP 128, selective AC (op)", "Table 3", _llama("llama-3.1-8b", 16, 8192, 2, 1,
                                                                   checkpointing="selective-op"), 67.0, 5605, (RESERVE,)),
]


def _with(run: Published, checkpointing: str) -> Published:
    return Published(run.name, run.table, run.fields | {"checkpointing": checkpointing}, run.memory_gib,
                     run.tokens_per_gpu)


def _pct(predicted: float | None, published: float) -> str:
    return "" if predicted is None else f"{100.0 * (predicted - published) / published:+.1f}%"


def table() -> str:
    lines = ["| configuration | published GiB/GPU | predicted, selective-op | gap | reserve as published (+ the "
             "bf16 logits' cached segment) | gap | no checkpointing | full | published tokens/s/GPU | predicted | "
             "gap |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in RUNS:
        p = predict(run)
        if "error" in p:
            lines.append(f"| {run.name} | {run.memory_gib:.1f} | not predicted: {p['error']} | | | | | | | | |")
            continue
        none, full = (predict(_with(run, c)).get("peak_gib") for c in ("none", "full"))
        peak, tps = p["peak_gib"], p["tokens_per_gpu"]
        segment = 2 * run.fields["micro_batch"] * run.fields["seq_len"] * p["vocab"] / 2**30
        reserve = peak + segment
        lines.append(f"| {run.name} ({run.table}) | {run.memory_gib:.1f} | {peak:.1f} | {_pct(peak, run.memory_gib)} | "
                     f"{reserve:.1f} | {_pct(reserve, run.memory_gib)} | {none:.1f} | {full:.1f} | "
                     f"{run.tokens_per_gpu:,.0f} | {tps:,.0f} | {_pct(tps, run.tokens_per_gpu)} |")
    lines += ["", f"Source: torchtitan {TABLE}, Tables 1 and 3 (FSDP rows: no torch.compile, no Float8). GiB = 2^30 "
              "bytes. Published memory is the allocator's reserve (max_reserved); the reserve column adds the bf16 "
              "logits' segment, cached when they are freed before backward and too small for the loss backward's "
              "fp32 blocks (bench/published_parallel.py logits_reserve). Predicted: h100-sxm-96gb (the 96 GB "
              "HBM2e H100 at 500 W: 2.4 TB/s, its unpublished peak read at the H100 NVL's) on 8 x 400 Gb/s RoCE per "
              "node, bf16 FSDP2 reducing in fp32, torchtitan's per-op SAC (every second "
              "matmul recomputed, SDPA kept), transformers' Llama blocks. The predictions are under the published "
              "reserve by 7-11% after the logits' segment: the rest of the allocator's reserve (fragmentation "
              "across 8,192-token activations) is not modelled, and torchtitan's own Llama differs from "
              "transformers' in what its norms save; both unverified here (no GPU run). "
              "Written by `python bench/published_selective.py --readme README.md`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.readme import readme_main

    return readme_main(__doc__, "published-selective", table, argv)


if __name__ == "__main__":
    sys.exit(main())
