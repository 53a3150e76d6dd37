"""torchtitan's published FSDP2 throughput next to the planner's prediction of the same runs.

    python bench/published_torchtitan.py [--readme README.md]

Two published tables, each run asked as its configuration ran it. No constant of the planner is fitted to
these figures. With --readme the table replaces the README block between the published-torchtitan markers.

- torchtitan docs/performance.md at 157a12c (April 2024; the file's first table, replaced by the H100 tables in
  December 2024): Llama 3 8B / 70B and Llama 2 13B / 70B trained with FSDP2 alone on 64 A100 80GB (8 nodes),
  local batch 1 or 2, with no, per-layer ("selective layer"), per-op ("selective op") or full activation
  checkpointing; tokens per second per GPU (torchtitan's "WPS"). What the runs ran, read from the same commit:
  torchtitan/parallelisms/parallelize_llama.py (FSDP2 with MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32), lines 219-221; the per-layer option checkpoints every second block, lines 82-97: the
  planner's ``checkpointing full, checkpointing_every 2``, which checkpoints the same number of blocks; the
  per-op option saves every other mm output and SDPA's, lines 35-69: the planner's ``selective-op``), train.py
  (AdamW foreach, lines 93-97; clip_grad_norm_ foreach, line 295; the loss on the fp32 upcast of the logits,
  model.py line 432 and train.py line 163, as transformers' loss), train_configs/*.toml (compile false;
  sequence 4,096 for Llama 2 and 8,192 for Llama 3; norm_type ``fused_rmsnorm`` for the 8B and 13B configs,
  ``rmsnorm`` for the 70B ones). The fabric between the 8 nodes is not published (the a100-80gb preset's is used).
- torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (Trainy on WhiteFiber, June 2025; torchtitan
  e7c0cae, torch 2.8.0a0): Llama 3.1 8B on 4 and 8 nodes of 8 H200 with "400Gb/s (Mellanox CX-7) per GPU"
  (InfiniBand NDR here), local batch 2 of 8,192 tokens, ``--training.compile``, Float8 linears with FSDP's
  float8 all-gather (``quantize.linear.float8.enable_fsdp_float8_all_gather``), the llama3_8b.toml's per-op
  selective checkpointing, nn.RMSNorm (torchtitan/models/llama3/model.py lines 341-342 at e7c0cae); published
  TPS per GPU and memory (torchtitan's max_reserved, GiB) at the 100th step.

The planner asks transformers' Llama blocks: torchtitan's own Llama differs in its rotary (complex
multiplication in fp32, model.py lines 84-110 at 157a12c); where the config says fused_rmsnorm, its norms are the
planner's fused rms_norm kernel.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.summary import error_summary  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.schema import EstimateRequest  # noqa: E402
from planner.time.step import estimate_with_time  # noqa: E402
from planner.units import GIB  # noqa: E402

A100_TABLE = "docs/performance.md at 157a12c"
H200_TABLE = "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
# what each published label ran (parallelize_llama.py at 157a12c): request fields
POLICIES = {"no": {"checkpointing": "none"}, "selective layer": {"checkpointing": "full", "checkpointing_every": 2},
            "selective op": {"checkpointing": "selective-op"}, "full": {"checkpointing": "full"}}
A100 = {"gpu": "a100-80gb", "nodes": 8}
COMPILE_FLOAT8 = {"compile": "blocks", "low_precision": "float8-tensorwise", "float8_all_gather": True}


@dataclass(frozen=True)
class Row:
    table: str
    model: str
    seq_len: int
    local_batch: int
    policy: str
    published: float  # tokens/s per GPU
    norm: str  # the config's norm_type
    cluster: dict
    recipe: dict = field(default_factory=dict)
    memory_gib: float | None = None  # published max_reserved

    def request(self) -> EstimateRequest:
        # torchtitan's fused_rmsnorm (torchtitan/models/norms.py at 157a12c: a Triton RMSNorm saving its input and
        # rstd) is the planner's fused rms_norm kernel (planner/recipes/fused_kernels.py)
        fused = {"fused_kernels": ("rms_norm",)} if self.norm == "fused_rmsnorm" else {}
        return EstimateRequest(model=self.model, strategy="fsdp", precision="bf16-mixed", gpus=8,
                               seq_len=self.seq_len, micro_batch=self.local_batch, gradient_accumulation=1,
                               optimizer="adamw", reduce_dtype="fp32", **self.cluster, **POLICIES[self.policy],
                               **self.recipe, **fused)


ROWS = [
    Row(A100_TABLE, "llama-3-8b", 8192, 1, "selective layer", 2904, "fused_rmsnorm", A100),
    Row(A100_TABLE, "llama-3-8b", 8192, 1, "selective op", 2973, "fused_rmsnorm", A100),
    Row(A100_TABLE, "llama-3-70b", 8192, 1, "full", 331, "rmsnorm", A100),
    Row(A100_TABLE, "llama-2-13b", 4096, 2, "no", 2162, "fused_rmsnorm", A100),
    Row(A100_TABLE, "llama-2-13b", 4096, 2, "selective layer", 1914, "fused_rmsnorm", A100),
    Row(A100_TABLE, "llama-2-13b", 4096, 2, "selective op", 1904, "fused_rmsnorm", A100),
    Row(A100_TABLE, "llama-2-70b", 4096, 1, "selective op", 355, "rmsnorm", A100),
    Row(A100_TABLE, "llama-2-70b", 4096, 2, "full", 353, "rmsnorm", A100),
] + [
    Row(H200_TABLE, "llama-3.1-8b", 8192, 2, "selective op", tps, "nn.RMSNorm",
        {"gpu": "h200", "nodes": nodes, "fabric": "ib-ndr", "nics_per_node": 8}, COMPILE_FLOAT8, memory)
    for nodes, tps, memory in ((4, 10938, 47.96), (8, 10753, 46.97))
]


def predict(row: Row) -> dict:
    """The prediction, or why the planner does not make one (a refused field, named)."""
    try:
        result = estimate_with_time(row.request())
    except (PlannerError, ValueError) as exc:
        return {"refused": str(exc).splitlines()[0]}
    t = result.time
    tokens = t.tokens_per_second / result.world_size
    return {"tokens": tokens, "error": tokens / row.published - 1, "mfu": t.mfu, "hfu": t.hfu,
            "peak_gib": result.per_device.peak_bytes / GIB,
            "reserved_gib": result.per_device.reserved_peak_bytes / GIB,
            "device_gib": result.device_capacity_bytes / GIB}


def _line(row: Row, p: dict) -> str:
    nodes = row.cluster["nodes"]
    recipe = ", ".join(f"{k} {v}" for k, v in row.recipe.items()) or "eager, bf16"
    head = (f"| {row.table} | {nodes} x 8 {row.cluster['gpu']} | {row.model} | {row.seq_len:,} x {row.local_batch} | "
            f"{row.policy} | {row.norm}; {recipe} | {row.published:,.0f} | ")
    if "refused" in p:
        return head + f"not predicted: {p['refused']} | | | | |"
    memory = "" if row.memory_gib is None else f" (published {row.memory_gib:.1f})"
    return head + (f"{p['tokens']:,.0f} | {p['error']:+.1%} | {p['mfu']:.1%} / {p['hfu']:.1%} | "
                   f"{p['peak_gib']:.1f} / {p['reserved_gib']:.1f}{memory} |")


def report() -> str:
    results = [(row, predict(row)) for row in ROWS]
    lines = ["| table | GPUs | model | seq x local batch | activation checkpointing | norm_type; recipe | "
             "published tokens/s/GPU | predicted | error | MFU / HFU pred | allocated / reserved peak, GiB |",
             "| --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [_line(row, p) for row, p in results]
    lines.append("")
    for table in (A100_TABLE, H200_TABLE):
        errors = [p["error"] for row, p in results if row.table == table and "error" in p]
        refused = sum(1 for row, p in results if row.table == table and "refused" in p)
        lines.append(f"- {table}: " + (error_summary(errors, span=True) if errors else "no row predicted")
                     + (f"; {refused} row(s) refused" if refused else ""))
    over = [row for row, p in results if "reserved_gib" in p and p["reserved_gib"] > p["device_gib"]]
    lines += ["", "Predicted not to fit (reserved peak over the device): "
              + (", ".join(f"{r.model} {r.policy}" for r in over) if over else "none")
              + ". Every row ran, so a row over the device would be the memory model's error.",
              "",
              "Predicted: bf16 FSDP2 reducing in fp32, transformers' Llama blocks (eager: composite RMSNorm and rotary "
              "at their measured rates; a fused_rmsnorm config's norms as the fused rms_norm kernel, "
              "`--fused-kernels rms_norm`); the A100 rows on a100-80gb x 8 nodes (fabric unpublished: the preset's), "
              "the H200 rows on 8 x 400 Gb/s NDR per node, compiled blocks with per-op SAC (memory: eager SAC's saved "
              "set, the upper bound compile keeps). Written by `python bench/published_torchtitan.py --readme "
              "README.md`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.readme import readme_main

    return readme_main(__doc__, "published-torchtitan", report, argv)


if __name__ == "__main__":
    sys.exit(main())
