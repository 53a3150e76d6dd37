"""Published GPU runs with tensor, pipeline and context parallelism next to the planner's prediction.

    python bench/published_parallel.py [--readme README.md]

Every row is a configuration someone ran and published with its memory per GPU and its
throughput; the planner predicts the same configuration (same model, degrees, batch, sequence,
checkpointing, torchtitan's fp32 gradient reduction) and the table shows both and the gap. No
constant is fitted to these figures: where the gap is large, the "why" column names what the
published run did that the model does not (torch.compile, Float8 linears), and
the caching allocator's reserve where its size follows from the run (the bf16 logits' cached
segment). With --readme, the table replaces the README block between the published-parallel markers.

Source of every figure: torchtitan's docs/performance.md (Tables 2, 4, 5 and 6; torchtitan
9dec370, torch 1963fc8, December 2024; also Liang et al. 2024, "TorchTitan: One-stop PyTorch
native solution for production ready LLM pre-training", arXiv:2410.06511). The runs: Grand
Teton hosts of 8 H100 SXM (96 GB HBM2e, 500 W) with NVLink, 400 Gb/s RDMA per GPU; memory is
torchtitan's logged peak ``max_reserved`` (torch.cuda.max_memory_reserved, the maximum across
GPUs: "Different PP ranks can have different peak memory usages. We take the maximum");
throughput is tokens per second per GPU at the 90th iteration. The planner asks the catalogue's
h100-sxm-96gb (that board: 2.4 TB/s, its unpublished 500 W peak read at the H100 NVL's) on 8 x 400 Gb/s RoCE.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.errors import PlannerError  # noqa: E402
from planner.units import GIB  # noqa: E402

SOURCE = "torchtitan docs/performance.md"
GPU = "h100-sxm-96gb"
COMPILE_FLOAT8 = ("torch.compile fuses the elementwise ops, and Float8 linears save their inputs in 8 bits: "
                  "both shrink the activations the model counts in bf16")
RESERVE = "published memory is the allocator's reserve (max_reserved), the prediction its allocated peak"
# Modelled since the December 2024 table was first compared (they were the largest misses, -50% on
# the 405B 1F1B row): torchtitan's fp32 gradient reduction, which under PP keeps the stage's
# unsharded gradients in fp32 for the whole schedule (torch 2.13 pipelining/stage.py:844-847,
# _fully_shard/_fsdp_param.py:802-820), beside its unsharded bf16 parameters (9dec370
# parallelize_llama.py:326-339: reshard_after_forward=False under PP).
PP_FSDP = ("modelled: the stage's parameters unsharded in bf16 and its gradients accumulated unsharded in fp32 "
           "(torchtitan's mixed_precision_reduce) over the whole schedule")
FLOAT8_GATHER = ("torchtitan's 405B config gathers Float8 weights (enable_fsdp_float8_all_gather), 1 byte per "
                 "unsharded weight where the model counts 2: this alone would lower the prediction")
ASYNC_TP = ("modelled: AsyncTP (async_tp: each sequence-parallel collective pipelined with its matmul); its "
            "symmetric-memory workspace is outside the allocator, not in the allocated peak shown")
ASYNC_TP_MEMORY = ("published memory falls 4.3 GiB with AsyncTP (71.9 to 67.6) where the model adds its workspace "
                   "outside the allocator and changes no live tensor: not explained")


@dataclass(frozen=True)
class Published:
    name: str
    table: str
    fields: dict
    memory_gib: float
    tokens_per_gpu: float
    why: tuple[str, ...] = field(default_factory=tuple)


def _llama(model: str, nodes: int, seq: int, micro: int, accumulation: int, **degrees) -> dict:
    # torchtitan reduces gradients in fp32: training.mixed_precision_reduce's only choice, "float32"
    # (9dec370 torchtitan/config_manager.py:389-392), handed to FSDP2's MixedPrecisionPolicy
    # (parallelisms/parallelize_llama.py:320)
    # the Grand Teton H100 (96 GB HBM2e, 500 W: the catalogue's h100-sxm-96gb; its preset grand-teton-h100 has
    # the NVLink node and 400 Gb/s RoCE per GPU of torchtitan benchmarks/llama3_h100_202412_torchtitan.md)
    return dict(model=model, strategy="fsdp", precision="bf16-mixed", gpu=GPU, gpus=8, nodes=nodes,
                seq_len=seq, micro_batch=micro, gradient_accumulation=accumulation, checkpointing="full",
                optimizer="adamw", reduce_dtype="fp32") | degrees


# torchtitan's "local batch size" is per data-parallel rank. Under PP, 9dec370 splits it into
# experimental.pipeline_parallel_microbatches micro-batches, by default the pipeline degree
# (torchtitan/parallelisms/pipelining_utils.py:79-81): Table 5's local batch 32 over pp 8 is 8
# micro-batches of 4 sequences, Table 6's local batch 8 is 8 micro-batches of 1.
MICRO_BATCHES = ("torchtitan 9dec370's default of pp micro-batches per step is assumed (local batch 32 = 8 x 4): "
                 "the published interleaved/1F1B throughput ratio, 1.28, is the bubbles' ratio at 8 micro-batches "
                 "(1.30; 1.10 at 32)")
RUNS = [
    Published("70B FSDP 32 x TP 8", "Table 4, 2D", _llama("llama-3.1-70b", 32, 8192, 16, 1, tp=8),
              71.9, 829, (COMPILE_FLOAT8, RESERVE)),
    Published("70B FSDP 32 x TP 8 + AsyncTP", "Table 4, 2D + AsyncTP",
              _llama("llama-3.1-70b", 32, 8192, 16, 1, tp=8, async_tp=True), 67.6, 876,
              (COMPILE_FLOAT8, ASYNC_TP, ASYNC_TP_MEMORY, RESERVE)),
    Published("405B FSDP 8 x TP 8 x PP 8, 1F1B", "Table 5", _llama("llama-3.1-405b", 64, 8192, 4, 8, tp=8, pp=8, async_tp=True),
              82.5, 100, (PP_FSDP, MICRO_BATCHES, COMPILE_FLOAT8, FLOAT8_GATHER, ASYNC_TP, RESERVE)),
    Published("405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B", "Table 5",
              _llama("llama-3.1-405b", 64, 8192, 4, 8, tp=8, pp=8, pp_schedule="interleaved", pp_virtual_stages=2,
                     async_tp=True),
              72.7, 128, (PP_FSDP, MICRO_BATCHES,
                          "torchtitan's default of 2 stages per rank for a multi-stage schedule is assumed",
                          COMPILE_FLOAT8, FLOAT8_GATHER, ASYNC_TP, RESERVE)),
] + [
    Published(f"405B FSDP {fsdp} x CP {cp} x TP 8 x PP 8, {seq // 1024}k", "Table 6",
              _llama("llama-3.1-405b", 64, seq, 1, 8, tp=8, pp=8, cp=cp, async_tp=True), memory, tps,
              (PP_FSDP, COMPILE_FLOAT8, FLOAT8_GATHER, ASYNC_TP, RESERVE)
              + (("the published peak grows with cp at the same tokens per rank (75.3 to 84.9 GiB), the model's "
                  "does not: what context parallelism keeps beyond seq/cp tokens (one layer's gathered K/V, fp32 "
                  "q/k/v gradients) is under 1 GiB here; the growth is not explained",) if cp > 1 else ()))
    for fsdp, cp, seq, memory, tps in [(8, 1, 32768, 75.3, 76), (4, 2, 65536, 75.9, 47), (2, 4, 131072, 77.1, 31),
                                       (1, 8, 262144, 84.9, 16)]
] + [
    Published(f"8B FSDP {fsdp} x CP {cp}, {seq // 1024}k", "Table 2", _llama("llama-3.1-8b", 1, seq, 1, 1, cp=cp),
              memory, tps, (COMPILE_FLOAT8, RESERVE))
    for fsdp, cp, seq, memory, tps in [(8, 1, 32768, 83.9, 3890), (4, 2, 65536, 84.2, 2540),
                                       (2, 4, 131072, 84.0, 1071), (1, 8, 262144, 84.5, 548)]
]


def predict(run: Published) -> dict:
    """The planner's peak per GPU (GiB) and tokens per second per GPU, or why it cannot say."""
    from planner.memory.orchestrator import estimate
    from planner.time.step import estimate_time
    from planner.schema import EstimateRequest

    try:
        request = EstimateRequest(**run.fields)
        result = estimate(request)
    except (PlannerError, ValueError) as exc:
        errors = getattr(exc, "errors", None)
        if callable(errors):  # pydantic: the first field and its message
            first = errors()[0]
            return {"error": f"{'.'.join(map(str, first['loc']))}: {first['msg']}"}
        return {"error": str(exc).splitlines()[0]}
    time = None
    try:
        time = estimate_time(result.request, result)
    except PlannerError as exc:
        return {"peak_gib": result.per_device.peak_bytes / GIB, "error": f"time: {exc}"}
    world = run.fields["gpus"] * run.fields["nodes"]
    return {"peak_gib": result.per_device.peak_bytes / GIB, "vocab": result.model.architecture["vocab_size"],
            "tokens_per_gpu": time.tokens_per_second / world if time else None}


def logits_reserve(run: Published, predicted_gib: float, vocab: int) -> str | None:
    """The caching allocator's reserve at the loss's backward, for a rank that computes the loss
    (no pp): 9dec370 train.py:131-133 computes cross_entropy(pred.float(), ...) and frees the bf16
    logits before backward (``del pred``, train.py:307). Their segment stays cached, but the
    loss's backward asks for fp32 blocks twice its size (nll_loss_backward's gradient reuses the
    freed fp32 upcast's; log_softmax_backward's output finds no cached block large enough:
    c10/cuda/CUDACachingAllocator.cpp serves a request from a free block at least as large and
    never merges segments), so it reserves a new one: at that moment max_reserved is the allocated
    peak plus the bf16 logits' segment. Their size is the model's (tokens per rank x vocab / tp, 2 bytes; vocab
    sharded by loss parallelism); None under pp, where the worst rank is not the last stage."""
    f = run.fields
    if f.get("pp", 1) > 1:
        return None
    tokens = f["micro_batch"] * f["seq_len"] // f.get("cp", 1)
    logits_gib = 2 * tokens * vocab // f.get("tp", 1) / GIB
    return (f"published memory is the allocator's reserve (max_reserved): the {logits_gib:.1f} GiB segment of the "
            f"bf16 logits, freed before backward, stays cached and is too small for the loss backward's "
            f"{2 * logits_gib:.1f} GiB fp32 gradients, so the reserve at the peak is the allocated peak plus that segment: "
            f"{predicted_gib + logits_gib:.1f} GiB with the model's peak")


def _pct(predicted: float | None, published: float) -> str:
    return "" if predicted is None else f"{100.0 * (predicted - published) / published:+.0f}%"


def table(rows: list[tuple[Published, dict]]) -> str:
    lines = ["| configuration | published GiB/GPU | predicted GiB/GPU | gap | published tokens/s/GPU | "
             "predicted tokens/s/GPU | gap | source | why the gap |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for run, p in rows:
        peak, tps = p.get("peak_gib"), p.get("tokens_per_gpu")
        reserve = logits_reserve(run, peak, p["vocab"]) if "vocab" in p else None
        why = "; ".join(reserve if w == RESERVE and reserve else w for w in run.why) if "error" not in p \
            else f"not predicted: {p['error']}"
        lines.append(f"| {run.name} | {run.memory_gib:.1f} | {'' if peak is None else f'{peak:.1f}'} | "
                     f"{_pct(peak, run.memory_gib)} | {run.tokens_per_gpu:,.0f} | "
                     f"{'' if tps is None else f'{tps:,.0f}'} | {_pct(tps, run.tokens_per_gpu)} | "
                     f"{SOURCE}, {run.table} | {why} |")
    lines.append("")
    ratio = _async_tp_gain(rows)
    if ratio is not None:
        lines.append(f"AsyncTP's gain on the 70B 2D run (Table 4, the same run without and with it): published "
                     f"{ratio[0]:+.1%} tokens/s/GPU, predicted {ratio[1]:+.1%}.")
        lines.append("")
    lines.append("GiB = 2^30 bytes. Published: H100 SXM 96 GB at 500 W, torch.compile + Float8 + full activation "
                 "checkpointing; predicted: h100-sxm-96gb (2.4 TB/s; peak read at the H100 NVL's) on 8 x 400 Gb/s RoCE per node, bf16 FSDP2 reducing gradients in fp32 (torchtitan's "
                 "mixed_precision_reduce), full checkpointing, no compile, no Float8. "
                 "Written by `python bench/published_parallel.py --readme README.md`.")
    return "\n".join(lines)


def _async_tp_gain(rows: list[tuple[Published, dict]]) -> tuple[float, float] | None:
    """(published, predicted) throughput gain of Table 4's AsyncTP row over its 2D row."""
    by = {run.table: (run, p) for run, p in rows}
    plain, pipelined = by.get("Table 4, 2D"), by.get("Table 4, 2D + AsyncTP")
    if plain is None or pipelined is None or None in (plain[1].get("tokens_per_gpu"), pipelined[1].get("tokens_per_gpu")):
        return None
    return (pipelined[0].tokens_per_gpu / plain[0].tokens_per_gpu - 1,
            pipelined[1]["tokens_per_gpu"] / plain[1]["tokens_per_gpu"] - 1)


def main(argv: list[str] | None = None) -> int:
    from bench.readme import readme_main

    return readme_main(__doc__, "published-parallel", lambda: table([(run, predict(run)) for run in RUNS]), argv)


if __name__ == "__main__":
    sys.exit(main())
