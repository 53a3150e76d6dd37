"""Three published trainings at scale: the layout they used beside the planner's recommendation.

    python bench/published_layouts.py [--readme README.md]

For each training the planner estimates the published layout (its degrees, batch, sequence and
data-parallel sharding, as near as the schema states them) and plans the same cluster, model,
sequence and global batch from scratch; the table shows both with the predicted memory per GPU
and MFU, and why they differ, in the planner's own numbers (the plan's winner_reason and both
step-time breakdowns), beside what each run did that the model does not. No figure is fitted.

Sources:
- Llama 3 405B: Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Sec. 3.3.2
  and Table 4: 16,384 H100 (2,048 nodes of 8), 8,192 tokens, TP 8 x CP 1 x PP 16 x DP 128,
  16 sequences per data-parallel rank (2,048 per step), 400 TFLOP/s per GPU, 38% BF16 MFU; FSDP
  sharding the optimizer states and gradients, the weights not resharded after forward (ZeRO-2
  style: the planner's fsdp-grad-op); "we reduce one Transformer layer each from the first and
  the last stages" (126 blocks: 7 + 14 x 8 + 7).
- DeepSeek-V3: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437, Sec. 3.2
  and 4.2: 2,048 H800 (256 nodes of 8), 16-way pipeline parallelism (DualPipe), 64-way expert
  parallelism across 8 nodes, ZeRO-1 data parallelism; 4,096 tokens, batch 15,360 sequences at
  its largest. No MFU is published. The H800 has the H100 SXM's compute and memory with NVLink
  cut to 400 GB/s; the planner's catalogue has the H100 (h100-80gb), used here.
- torchtitan 405B: torchtitan docs/performance.md Table 5 (torchtitan 9dec370, December 2024):
  512 H100 (64 nodes of 8), FSDP 8 x TP 8 x PP 8, 1F1B, local batch 32 as 8 micro-batches of 4
  (global 256), 8,192 tokens, 100 tokens/s per GPU, 82.5 GiB max_reserved; MFU here is that
  throughput x the model's FLOPs per token (planner/time/collectives.py model_flops_per_token) over the
  GPU's dense bf16 peak. Its hosts are Grand Teton H100s (96 GB HBM2e at 500 W: the catalogue's
  h100-sxm-96gb and preset grand-teton-h100), asked as such.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.model.catalogue import catalogue_model  # noqa: E402
from planner.cluster.gpus import gpu as lookup_gpu  # noqa: E402
from planner.memory.orchestrator import estimate  # noqa: E402
from planner.parallel.pipeline import bubble_fraction  # noqa: E402
from planner.plan.search import plan  # noqa: E402
from planner.schema import Candidate, EstimateRequest, PlanRequest  # noqa: E402
from planner.time.step import estimate_time  # noqa: E402
from planner.time.collectives import model_flops_per_token  # noqa: E402
from planner.units import GIB  # noqa: E402


@dataclass(frozen=True)
class Training:
    name: str
    source: str
    layout: str  # the published layout in words
    cluster: dict  # the PlanRequest's cluster, model, sequence and batch
    published: dict  # the layout as EstimateRequest fields beyond the cluster's
    mfu: float | None  # published MFU
    tokens_per_gpu: float | None = None  # published throughput, when MFU is not given
    unmodelled: tuple[str, ...] = field(default_factory=tuple)


TRAININGS = [
    Training("Llama 3 405B, 16,384 H100", "Llama 3 paper, Table 4",
             "TP 8 x PP 16 (7/8x14/7 blocks) x DP 128, FSDP (ZeRO-2 style), 16 micro-batches of 1",
             dict(model="llama-3.1-405b", gpu="h100-80gb", gpus=8, nodes=2048, seq_len=8192, global_batch=2048),
             dict(strategy="fsdp-grad-op", tp=8, pp=16, pp_first_stage_layers=7, pp_last_stage_layers=7,
                  micro_batch=1, gradient_accumulation=16), 0.38,
             unmodelled=("its own interleaved schedule with a tunable number of rounds (the planner times 1F1B at "
                         "16 micro-batches: a (16-1)/(16+16-1) = 48% bubble of the step)",
                         "asynchronous point-to-point and the stages' compute overlapped with FSDP's collectives")),
    Training("DeepSeek-V3, 2,048 H800", "DeepSeek-V3 report, Sec. 3.2",
             "PP 16 (DualPipe) x EP 64 x DP 128 with ZeRO-1, 120 micro-batches of 1",
             dict(model="deepseek-v3", gpu="h100-80gb", gpus=8, nodes=256, seq_len=4096, global_batch=15360),
             dict(strategy="zero1", pp=16, ep=64, micro_batch=1, gradient_accumulation=120), None,
             unmodelled=("DualPipe (two directions at once: fewer bubbles, a second copy of the parameters) is not "
                         "modelled: 1F1B is timed",
                         "FP8 GEMMs and its selective recomputation (RMSNorm and MLA up-projections) are not modelled: "
                         "full checkpointing is the nearest setting",
                         "the H800's NVLink (400 GB/s) is slower than the h100-80gb's the planner times")),
    Training("torchtitan 405B, 512 H100", "torchtitan docs/performance.md, Table 5",
             "FSDP 8 x TP 8 x PP 8 (1F1B), 8 micro-batches of 4",
             # AsyncTP (Table 5's title): asked of the published layout and of every TP layout the plan searches
             dict(model="llama-3.1-405b", gpu="h100-sxm-96gb", gpus=8, nodes=64, seq_len=8192, global_batch=256,
                  async_tp=True),
             dict(strategy="fsdp", tp=8, pp=8, micro_batch=4, gradient_accumulation=8, reduce_dtype="fp32"), None,
             tokens_per_gpu=100.0,
             unmodelled=("torch.compile and Float8 linears and all-gathers (the model counts bf16)",)),
]


def _published(t: Training) -> tuple[EstimateRequest, object, object]:
    """The published layout's estimate and time, at the first checkpointing that fits (none, then full)."""
    cluster = {k: v for k, v in t.cluster.items() if k != "global_batch"}
    for ckpt in ("none", "full"):
        request = EstimateRequest(**cluster, **t.published, checkpointing=ckpt)
        result = estimate(request)
        if result.fits or ckpt == "full":
            return request, result, estimate_time(result.request, result)
    raise AssertionError("unreachable")


def _published_mfu(t: Training) -> float | None:
    if t.mfu is not None:
        return t.mfu
    if t.tokens_per_gpu is None:
        return None
    arch = catalogue_model(t.cluster["model"]).architecture
    g = lookup_gpu(t.cluster["gpu"])
    return t.tokens_per_gpu * model_flops_per_token(arch, t.cluster["seq_len"]) / (g.peak_tflops["bf16"] * 1e12)


def _layout(c: Candidate) -> str:
    p = c.parallel
    degrees = " x ".join(f"{name.upper()} {value}" for name, value in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp),
                                                                      ("ep", p.ep)) if value > 1)
    split = (f" ({c.pp_first_stage_layers}/../{c.pp_last_stage_layers} blocks)"
             if c.pp_first_stage_layers is not None else "")
    offload = (f", offload {c.offload_optimizer}/{c.offload_params}" if (c.offload_optimizer, c.offload_params)
               != ("none", "none") else ", no offload")
    return (f"{degrees + split + ' x ' if degrees else ''}DP {p.dp_replicate * p.dp_shard} {c.strategy}, "
            f"{c.gradient_accumulation} micro-batch(es) of {c.micro_batch}, checkpointing {c.checkpointing}{offload}")


def _checks(req: PlanRequest, c: Candidate, families: list[Candidate]) -> str:
    """The layout properties the issue asks of the Llama 3 recommendation, in numbers, and where
    it does not pipeline, why: its best pipeline against it."""
    p = c.parallel
    tp_in_node = p.tp > 1 and req.gpus % p.tp == 0
    text = (f"TP inside a node: {'yes' if tp_in_node else 'no'} (tp {p.tp} of {req.gpus} GPUs per node); "
            f"pipelined across nodes: {'yes' if p.pp > 1 else 'no'} (pp {p.pp}); "
            f"offloads: {'nothing' if (c.offload_optimizer, c.offload_params) == ('none', 'none') else 'yes'}")
    piped = [f for f in families if f.parallel.pp > 1 and f.fits]
    if p.pp == 1 and piped:
        best = min(piped, key=lambda f: f.step_seconds)
        m, v, pp = best.gradient_accumulation, best.pp_virtual_stages or 1, best.parallel.pp
        bubble = bubble_fraction(pp, m, v, best.pp_schedule or "1f1b")
        text += (f". Why no pipeline: the best one, {best.strategy} x TP {best.parallel.tp} x PP {pp} "
                 f"({best.pp_schedule}, {v} stage(s) per rank, {m} micro-batches: the global batch of "
                 f"{req.global_batch} over {best.parallel.dp_replicate * best.parallel.dp_shard} data-parallel "
                 f"ranks), idles a bubble of (pp-1)/(m x v + pp-1) = {bubble:.0%} of its step and takes "
                 f"{best.step_seconds:.2f} s against {c.step_seconds:.2f} s; without a pipeline the "
                 f"{p.dp_replicate * p.dp_shard} data-parallel ranks' FSDP collectives leave "
                 f"{c.exposed_communication_seconds:.2f} s exposed in the model. A pipeline pays where the batch "
                 "gives each data-parallel rank many micro-batches, or where the data-parallel collectives cannot "
                 "be hidden (the model overlaps FSDP's all-gathers with the blocks' compute)")
    return text


def row(t: Training) -> tuple[str, str]:
    req = PlanRequest(**t.cluster)
    result = plan(req)
    best = result.recommended
    request, pub, pub_time = _published(t)
    fits = "fits" if pub.fits else "does not fit"
    pub_mfu = _published_mfu(t)
    published = (f"{pub.per_device.peak_bytes / GIB:.1f} GiB ({fits}, checkpointing {request.checkpointing}), "
                 f"MFU {pub_time.mfu:.2f} (published {'n/a' if pub_mfu is None else f'{pub_mfu:.2f}'}); "
                 f"step {pub_time.step_seconds:.2f} s: compute {pub_time.compute_seconds:.2f} s, exposed "
                 f"communication {pub_time.exposed_communication_seconds:.2f} s")
    if best is None:
        return (f"| {t.name} | {t.layout} | {published} | nothing fits | | {result.winner_reason} |", "")
    mine = (f"{best.per_device.peak_bytes / GIB:.1f} GiB, MFU {best.mfu:.2f}; step {best.step_seconds:.2f} s: "
            f"compute {best.compute_seconds:.2f} s, exposed communication {best.exposed_communication_seconds:.2f} s")
    faster = pub_time.step_seconds / best.step_seconds - 1
    why = [f"the planner predicts its layout {faster:+.0%} faster per step than the published one"
           if abs(faster) > 0.01 else "the planner predicts the two within 1% of each other",
           result.winner_reason]
    why += [f"not modelled: {u}" for u in t.unmodelled]
    text = (f"| {t.name} ({t.source}) | {t.layout} | {published} | {_layout(best)} | {mine} | "
            f"{'; '.join(why)} |")
    return text, _checks(req, best, result.families)


def table() -> str:
    lines = ["| training | published layout | its prediction | planner's recommendation | its prediction | "
             "why they differ |", "| --- | --- | --- | --- | --- | --- |"]
    checks = []
    for t in TRAININGS:
        text, check = row(t)
        lines.append(text)
        if check:
            checks.append(f"- {t.name}, the recommendation: {check}.")
    lines += ["", *checks, "",
              "GiB = 2^30 bytes; MFU = model FLOPs (no recomputation) per second over the GPU's dense bf16 peak. "
              "Predictions at the planner's defaults (compute from the kernels' measured rates, planner/time/kernels.py; its link model). Written by "
              "`python bench/published_layouts.py --readme README.md`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.readme import readme_main

    return readme_main(__doc__, "published-layouts", table, argv)


if __name__ == "__main__":
    sys.exit(main())
