"""How the plan ranks layouts for three published setups, and which term of the step decides it.

    python bench/layout_ranking.py [--readme README.md]

The setups are those of published runs (the model, GPUs, sequence and global batch; the layout is
left to the plan): torchtitan's Llama-3-8B on 8 H100 at 8,192 tokens (docs/performance.md,
Table 1: FSDP, 8 H100s), llm-foundry's MPT-7B on 8 A100-80GB at 2,048 tokens, 96 sequences per step
(scripts/train/benchmarking/README.md line 182), and llm-foundry's MPT-30B on 32 H100 at 2,048 tokens,
1,344 sequences per step (line 101). For each, the best fitting candidate of each layout family
(strategy, TP and PP degree) in rank order, with its step split into compute, exposed communication
and offload; "decides" names the term that separates it most from the one ranked above it.
Gradients are reduced in fp32 as both ran: torchtitan's mixed_precision_reduce, composer's DEFAULT
MP mode (bench/published_throughput.py REDUCE_DTYPE). MPT is asked as it ran, the same definition as
bench/published_throughput.py's (mpt_config, MPT_RECIPE): exact GELU, flash-attn's cross-entropy with
composer's loop keeping the outputs and updating its two train metrics on them after each backward,
composer's DecoupledAdamW stepped one parameter at a time.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.published_throughput import MPT_RECIPE, mpt_config  # noqa: E402
from bench.readme import readme_main  # noqa: E402
from planner.plan.search import plan  # noqa: E402
from planner.schema import PlanRequest  # noqa: E402


SETUPS = [
    ("torchtitan Llama-3-8B, 8 x H100, 8,192 tokens",
     dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, seq_len=8192, global_batch=8, reduce_dtype="fp32")),
    ("llm-foundry MPT-7B, 8 x A100-80GB, 2,048 tokens",
     dict(model_config=mpt_config("7b", 2048), **MPT_RECIPE, gpu="a100-80gb", gpus=8, seq_len=2048, global_batch=96,
          attention_kernel="flash-attention-triton", reduce_dtype="fp32", fabric="roce-200g", nics_per_node=8)),
    ("llm-foundry MPT-30B, 32 x H100, 2,048 tokens",
     dict(model_config=mpt_config("30b", 2048), **MPT_RECIPE, gpu="h100-80gb", gpus=8, nodes=4, seq_len=2048, global_batch=1344,
          attention_kernel="flash-attention-triton", reduce_dtype="fp32")),
]
TERMS = ("compute_seconds", "exposed_communication_seconds", "offload_seconds")


def _family(c) -> str:
    p = c.parallel
    return c.strategy + (f" x tp{p.tp}" if p.tp > 1 else "") + (f" x pp{p.pp}" if p.pp > 1 else "")


def ranking(title: str, fields: dict) -> list[str]:
    r = plan(PlanRequest(**fields))
    best: dict[str, object] = {}
    for c in sorted((c for c in r.candidates if c.fits), key=lambda c: c.step_seconds):
        best.setdefault(_family(c), c)
    rows = list(best.values())[:6]
    out = [f"**{title}**", "", "| rank | layout | micro x accum | ckpt | step s | compute s | exposed comm s | offload s "
           "| tokens/s/GPU | MFU | decides |", "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    world = fields["gpus"] * fields.get("nodes", 1)
    for k, c in enumerate(rows, 1):
        decides = "-"
        if k > 1 and c.step_seconds <= rows[k - 2].step_seconds * 1.005:
            decides = "tie (within 0.5%)"
        elif k > 1:
            above = rows[k - 2]
            decides = max(TERMS, key=lambda t: getattr(c, t) - getattr(above, t)).replace("_seconds", "").replace("_", " ")
        out.append(f"| {k} | {_family(c)} | {c.micro_batch} x {c.gradient_accumulation} | {c.checkpointing} | "
                   f"{c.step_seconds:.2f} | {c.compute_seconds:.2f} | {c.exposed_communication_seconds:.2f} | "
                   f"{c.offload_seconds:.2f} | {c.tokens_per_second / world:,.0f} | {c.mfu:.1%} | {decides} |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    return readme_main(__doc__, "layout-ranking",
                       lambda: "\n".join(line for title, fields in SETUPS for line in ranking(title, fields)), argv)


if __name__ == "__main__":
    sys.exit(main())
