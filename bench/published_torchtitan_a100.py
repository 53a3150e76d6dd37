"""torchtitan's published FSDP2 throughput on 64 A100-80GB next to the planner's prediction of the same runs.

    python bench/published_torchtitan_a100.py [--readme README.md]

Source: torchtitan docs/performance.md at 157a12c (April 2024; the first table of the file, replaced by the
H100 tables in December 2024): Llama 3 8B / 70B and Llama 2 13B / 70B trained with FSDP2 alone on 64 A100
80GB (8 nodes), local batch 1 or 2, with no, per-layer ("selective layer") or per-op ("selective op") or full
activation checkpointing; tokens per second per GPU (torchtitan's "WPS"). What the runs ran, read from the same
commit: torchtitan/parallelisms/parallelize_llama.py (FSDP2 with MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), lines 219-221; the per-layer option checkpoints every second block, lines 82-97: the
planner's ``checkpointing full, checkpointing_every 2``, which checkpoints the same number of blocks; the per-op
option saves every other mm output and SDPA's, lines 35-69: the planner's ``selective-op``), train.py
(AdamW foreach, lines 93-97; clip_grad_norm_ foreach, line 295; the loss on the fp32 upcast of the logits,
model.py line 432 and train.py line 163, as transformers' loss), train_configs/*.toml (compile false; sequence
4,096 for Llama 2 and 8,192 for Llama 3; norm_type ``fused_rmsnorm`` for the 8B and 13B configs, ``rmsnorm``
for the 70B ones). The planner asks transformers' Llama blocks: torchtitan's own Llama differs in its rotary
(complex multiplication in fp32, model.py lines 84-110) and, for the 8B and 13B rows, its fused Triton RMSNorm;
the fabric between the 8 nodes is not published (the a100-80gb preset's is used). No constant of the planner
is fitted to these figures. With --readme the table replaces the README block between the
published-torchtitan-a100 markers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.schema import EstimateRequest  # noqa: E402
from planner.time.step import estimate_with_time  # noqa: E402
from planner.units import GIB  # noqa: E402

SOURCE = "torchtitan docs/performance.md at 157a12c"
WITHIN = 0.15
# what each published label ran (parallelize_llama.py at 157a12c): request fields
POLICIES = {"no": {"checkpointing": "none"}, "selective layer": {"checkpointing": "full", "checkpointing_every": 2},
            "selective op": {"checkpointing": "selective-op"}, "full": {"checkpointing": "full"}}


@dataclass(frozen=True)
class Row:
    table: str
    model: str
    seq_len: int
    local_batch: int
    policy: str
    published: float  # tokens/s per GPU
    fused_norm: bool  # the config's norm_type is fused_rmsnorm

    def request(self) -> EstimateRequest:
        return EstimateRequest(model=self.model, strategy="fsdp", precision="bf16-mixed", gpu="a100-80gb", gpus=8,
                               nodes=8, seq_len=self.seq_len, micro_batch=self.local_batch, gradient_accumulation=1,
                               optimizer="adamw", reduce_dtype="fp32", **POLICIES[self.policy])


ROWS = [
    Row("Llama 3", "llama-3-8b", 8192, 1, "selective layer", 2904, True),
    Row("Llama 3", "llama-3-8b", 8192, 1, "selective op", 2973, True),
    Row("Llama 3", "llama-3-70b", 8192, 1, "full", 331, False),
    Row("Llama 2", "llama-2-13b", 4096, 2, "no", 2162, True),
    Row("Llama 2", "llama-2-13b", 4096, 2, "selective layer", 1914, True),
    Row("Llama 2", "llama-2-13b", 4096, 2, "selective op", 1904, True),
    Row("Llama 2", "llama-2-70b", 4096, 1, "selective op", 355, False),
    Row("Llama 2", "llama-2-70b", 4096, 2, "full", 353, False),
]


def predict(row: Row) -> dict:
    result = estimate_with_time(row.request())
    t = result.time
    tokens = t.tokens_per_second / result.world_size
    return {"tokens": tokens, "error": tokens / row.published - 1, "mfu": t.mfu, "hfu": t.hfu,
            "peak_gib": result.per_device.peak_bytes / GIB,
            "reserved_gib": result.per_device.reserved_peak_bytes / GIB,
            "device_gib": result.device_capacity_bytes / GIB}


def summary(errors: list[float]) -> str:
    within = sum(abs(e) <= WITHIN for e in errors)
    return (f"{within}/{len(errors)} within 15%, median |error| {statistics.median(abs(e) for e in errors):.1%}, "
            f"median signed {statistics.median(errors):+.1%}, range {min(errors):+.1%} to {max(errors):+.1%}")


def report() -> str:
    results = [(row, predict(row)) for row in ROWS]
    lines = ["| table | model | seq | local batch | activation checkpointing | norm_type | published tokens/s/GPU | "
             "predicted | error | MFU / HFU pred | allocated / reserved peak, GiB (device 80) |",
             "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row, p in results:
        lines.append(f"| {row.table} | {row.model} | {row.seq_len:,} | {row.local_batch} | {row.policy} | "
                     f"{'fused_rmsnorm' if row.fused_norm else 'rmsnorm'} | {row.published:,.0f} | "
                     f"{p['tokens']:,.0f} | {p['error']:+.1%} | {p['mfu']:.1%} / {p['hfu']:.1%} | "
                     f"{p['peak_gib']:.1f} / {p['reserved_gib']:.1f} |")
    errors = [p["error"] for _, p in results]
    over = [row for row, p in results if p["reserved_gib"] > p["device_gib"]]
    lines += ["", f"All rows: {summary(errors)}. Predicted not to fit (reserved peak over the device): "
              + (", ".join(f"{r.model} {r.policy}" for r in over) if over else "none")
              + ": every row ran, so a row over the device is the memory model's error for torchtitan's model "
              "(the 8B and 13B configs' fused RMSNorm saves its bf16 input and an fp32 rstd per token where "
              "transformers' LlamaRMSNorm, which the planner asks, saves an fp32 copy of the input and a bf16 "
              "normalized tensor).",
              "",
              f"Source: {SOURCE} (64 A100 80GB, FSDP2, no torch.compile); predicted: a100-80gb x 8 nodes, bf16 FSDP2 "
              "reducing in fp32, transformers' Llama blocks (composite RMSNorm and rotary at their measured rates). "
              "Written by `python bench/published_torchtitan_a100.py --readme README.md`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", help="replace the README's published-torchtitan-a100 block with the table")
    args = parser.parse_args(argv)
    from bench.readme import publish

    return publish(report(), args.readme, "published-torchtitan-a100")


if __name__ == "__main__":
    sys.exit(main())
