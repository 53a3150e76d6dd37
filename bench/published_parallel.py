"""Published GPU runs with tensor, pipeline and context parallelism next to the planner's prediction.

    python bench/published_parallel.py [--readme README.md]

Every row is a configuration someone ran and published with its memory per GPU and its
throughput; the planner predicts the same configuration (same model, degrees, batch, sequence,
checkpointing) and the table shows both and the gap. No constant is fitted to these figures:
where the gap is large, the "why" column names what the published run did that the model does
not (torch.compile, Float8 linears, asynchronous TP, the caching allocator's reserve). With
--readme, the table replaces the README block between the published-parallel markers.

Source of every figure: torchtitan's docs/performance.md (Tables 2, 4, 5 and 6; torchtitan
9dec370, torch 1963fc8, December 2024; also Liang et al. 2024, "TorchTitan: One-stop PyTorch
native solution for production ready LLM pre-training", arXiv:2410.06511). The runs: Grand
Teton hosts of 8 H100 SXM (96 GB HBM2e, 500 W) with NVLink, 400 Gb/s RDMA per GPU; memory is
torchtitan's logged peak ``max_reserved`` (torch.cuda.max_memory_reserved, the maximum across
GPUs: "Different PP ranks can have different peak memory usages. We take the maximum");
throughput is tokens per second per GPU at the 90th iteration. The planner models the 80 GB
H100 SXM at its full 700 W clock, which it has in its catalogue.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.errors import PlannerError  # noqa: E402
from planner.units import GIB  # noqa: E402

SOURCE = "torchtitan docs/performance.md"
COMPILE_FLOAT8 = ("torch.compile fuses the elementwise ops, and Float8 linears save their inputs in 8 bits: "
                  "both shrink the activations the model counts in bf16")
RESERVE = "published memory is the allocator's reserve (max_reserved), the prediction its allocated peak"


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
    return dict(model=model, strategy="fsdp", precision="bf16-mixed", gpu="h100-80gb", gpus=8, nodes=nodes,
                seq_len=seq, micro_batch=micro, gradient_accumulation=accumulation, checkpointing="full",
                optimizer="adamw", reduce_dtype="fp32") | degrees


# torchtitan's "local batch size" is per data-parallel rank. Under PP, 9dec370 splits it into
# experimental.pipeline_parallel_microbatches micro-batches, by default the pipeline degree
# (torchtitan/parallelisms/pipelining_utils.py:79-81): Table 5's local batch 32 over pp 8 is 8
# micro-batches of 4 sequences, Table 6's local batch 8 is 8 micro-batches of 1.
MICRO_BATCHES = "torchtitan 9dec370's default of pp micro-batches per step is assumed (local batch 32 = 8 x 4)"
RUNS = [
    Published("70B FSDP 32 x TP 8", "Table 4, 2D", _llama("llama-3.1-70b", 32, 8192, 16, 1, tp=8),
              71.9, 829, (COMPILE_FLOAT8, RESERVE)),
    Published("405B FSDP 8 x TP 8 x PP 8, 1F1B", "Table 5", _llama("llama-3.1-405b", 64, 8192, 4, 8, tp=8, pp=8),
              82.5, 100, (COMPILE_FLOAT8, "AsyncTP's symmetric-memory buffers", RESERVE, MICRO_BATCHES)),
    Published("405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B", "Table 5",
              _llama("llama-3.1-405b", 64, 8192, 4, 8, tp=8, pp=8, pp_schedule="interleaved", pp_virtual_stages=2),
              72.7, 128, (COMPILE_FLOAT8, "AsyncTP's symmetric-memory buffers", RESERVE, MICRO_BATCHES,
                          "torchtitan's default of 2 stages per rank for a multi-stage schedule is assumed")),
] + [
    Published(f"405B FSDP {fsdp} x CP {cp} x TP 8 x PP 8, {seq // 1024}k", "Table 6",
              _llama("llama-3.1-405b", 64, seq, 1, 8, tp=8, pp=8, cp=cp), memory, tps,
              (COMPILE_FLOAT8, "AsyncTP's symmetric-memory buffers", RESERVE))
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
    from planner.memory import estimate
    from planner.steptime import estimate_time
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
    return {"peak_gib": result.per_device.peak_bytes / GIB,
            "tokens_per_gpu": time.tokens_per_second / world if time else None}


def _pct(predicted: float | None, published: float) -> str:
    return "" if predicted is None else f"{100.0 * (predicted - published) / published:+.0f}%"


def table(rows: list[tuple[Published, dict]]) -> str:
    lines = ["| configuration | published GiB/GPU | predicted GiB/GPU | gap | published tokens/s/GPU | "
             "predicted tokens/s/GPU | gap | source | why the gap |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for run, p in rows:
        peak, tps = p.get("peak_gib"), p.get("tokens_per_gpu")
        why = "; ".join(run.why) if "error" not in p else f"not predicted: {p['error']}"
        lines.append(f"| {run.name} | {run.memory_gib:.1f} | {'' if peak is None else f'{peak:.1f}'} | "
                     f"{_pct(peak, run.memory_gib)} | {run.tokens_per_gpu:,.0f} | "
                     f"{'' if tps is None else f'{tps:,.0f}'} | {_pct(tps, run.tokens_per_gpu)} | "
                     f"{SOURCE}, {run.table} | {why} |")
    lines.append("")
    lines.append("GiB = 2^30 bytes. Published: H100 SXM 96 GB at 500 W, torch.compile + Float8 + full activation "
                 "checkpointing; predicted: h100-80gb, bf16 FSDP2, full checkpointing, no compile, no Float8. "
                 "Written by `python bench/published_parallel.py --readme README.md`.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", help="replace the README's published-parallel block with the table")
    args = parser.parse_args(argv)
    rows = [(run, predict(run)) for run in RUNS]
    text = table(rows)
    from bench.readme import publish

    return publish(text, args.readme, "published-parallel")


if __name__ == "__main__":
    sys.exit(main())
