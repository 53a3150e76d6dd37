"""NVIDIA's published Megatron-Core / NeMo pretraining throughput next to the planner's prediction.

    python bench/published_nemo.py [--readme README.md]

Two published tables, every row asked through `planner estimate`'s code path
(planner.time.step.estimate_with_time) with the row's model, GPUs, batch, sequence and parallel degrees. No
constant of the planner is fitted to these figures. With --readme the table replaces the README block between
the published-nemo markers.

- Megatron-LM README.md at f2e5db402c ("New scaling figures on H100 GPUs", July 2024), the weak-scaling
  model table (images/model_table.png, Megatron-Core r0.8.0): nine GPT models, 1.7B to 462B, on 48 to
  6,144 H100 GPUs, each with its attention heads, hidden size, layers, tensor / pipeline / data-parallel
  sizes, global batch and per-GPU TFLOP/s. The README's text (line 66): vocabulary 131,072, sequence 4,096,
  ``--overlap-grad-reduce --overlap-param-gather`` (the distributed optimizer: Megatron asserts
  use_distributed_optimizer under overlap_param_gather, megatron/training/arguments.py lines 279-283 at
  core_r0.8.0 = baf94af), ``--tp-comm-overlap`` (which asserts sequence parallelism, lines 199-200), pipeline
  communication overlapped. Tokens per second per GPU are derived from the published TFLOP/s with the formula
  that logged them, num_floating_point_operations (megatron/training/training.py lines 73-108 at baf94af):
  12 s l h^2 (2 + s/h + ffn/h + V/(2 l h)) FLOPs per sequence for multi-head attention and a plain MLP, i.e.
  72 l h^2 + 12 l h s + 6 V h per token (Narayanan et al. 2021, arXiv:2104.04473, eq. 3 without its
  recomputation pass). Assumed where the table is silent, and said under the table: BF16 (the MFU column is the
  TFLOP/s over the H100's dense BF16 peak, 465.9 / 989 = 47%), micro-batch 1 (then every pipelined row runs 4 x
  pp micro-batches per step: 384 / 48 = 8 over pp 2, ..., 3,072 / 48 = 64 over pp 16), no activation
  recomputation, the non-interleaved 1F1B schedule, Megatron's GPT defaults (learned absolute positions:
  --position-embedding-type defaults to learned_absolute, arguments.py line 775; LayerNorm; biases; GELU; ffn 4h;
  untied output layer), which the table's parameter counts confirm (12 l h^2 + 2 V h: 1.75B ... 461.5B). The
  planner reads each as a GPT-2 config with those widths.
- NeMo docs/source/performance/performance_summary.md at 8e3d65dc ("24.07 perf numbers", September 2024;
  the last version before the page moved to the NeMo Framework docs): DGX-H100 pretraining, NeMo 24.07, FP8
  (Transformer Engine) only; tokens/s/GPU as published. Its Llama rows are asked (catalogue models) with
  low_precision te-fp8; the GPT3 and Nemotron rows are left out (their architectures are not in the catalogue).
  NVIDIA's later H100 tables read here (NeMo Framework docs 25.02-25.07, Megatron-Bridge 25.09-26.08)
  publish FP8 for every dense H100 row; their BF16 H100 rows are MoE models only.

How a Megatron run is asked. Megatron's distributed optimizer reduce-scatters the gradients and all-gathers the
updated parameters over the data-parallel ranks: per rank the bytes of one all-reduce, overlapped with backward
and the next forward, and the optimizer states sharded (ZeRO-1). The planner has two twins, each shown:
``ddp`` (torch DDP's bucketed all-reduce overlapped with backward and torch's pipeline schedules, interleaved
included: the primary ask, the same data-parallel traffic, but every rank steps the whole optimizer) and
``zero1`` (DeepSpeed's ZeRO-1 engine and, under pp, its pipeline engine: the same sharded states, but
DeepSpeed's runtime, which runs 1F1B only and no context parallelism). Neither can say what Megatron's bf16
recipe sends: accumulate_allreduce_grads_in_fp32 is forced on for bf16 (arguments.py lines 299-305), so the
gradients travel in fp32 where both twins reduce them in bf16; and the ddp twin copies each gradient into torch
DDP's bucket and back (the planner's "sharding copies") where Megatron's gradients are views of its contiguous
buffer from the start (megatron/core/distributed/param_and_grad_buffer.py line 1367 at d98e8a6: param.main_grad
is a slice of the bucket's grad_data). H100s are the catalogue's h100-80gb on its
preset (DGX H100: NVLink, 8 x 400 Gb/s per node); attention FlashAttention-2's rates (Megatron-Core runs
Transformer Engine's flash or cuDNN fused attention).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.summary import WITHIN, error_summary  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.schema import EstimateRequest  # noqa: E402
from planner.time.step import estimate_with_time  # noqa: E402
from planner.units import GIB  # noqa: E402

MEGATRON = "Megatron-LM README.md at f2e5db402c, images/model_table.png"
NEMO = "NeMo performance_summary.md at 8e3d65dc, Pretraining (FP8, DGX-H100)"
SOURCES = {MEGATRON: "https://github.com/NVIDIA/Megatron-LM/blob/f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4/README.md",
           NEMO: "https://github.com/NVIDIA/NeMo/blob/8e3d65dcfe3504689bfc5b6e67d502780aacad41/"
                 "docs/source/performance/performance_summary.md"}
SEQ_LEN = 4096  # the Megatron table's (README line 66)
VOCAB = 131072  # the Megatron table's; a multiple of 128 x tp, so Megatron pads nothing (padded_vocab_size)
GPUS_PER_NODE = 8  # DGX H100
STRATEGIES = ("ddp", "zero1")  # the primary ask first (module docstring)
# what every request carries: Megatron's bf16 recipe as the planner states it (module docstring)
RECIPE = {"gpu": "h100-80gb", "precision": "bf16-mixed", "optimizer": "adamw", "checkpointing": "none",
          "attention_kernel": "flash-attention-2"}
# what the runs did that neither twin models, shown under every row
UNMODELLED = ("TP comm overlap in the zero1 twin (--tp-comm-overlap: the sequence-parallel all-gathers and "
              "reduce-scatters split into chunks run beside the GEMMs by Transformer Engine's userbuffers; the ddp "
              "twin asks it as the planner's async_tp, torch's decomposition of the same collectives; DeepSpeed's "
              "AutoTP has no sequence parallelism, so the zero1 twin exposes them)",
              "Transformer Engine's fused LayerNorm-Linear and bias-GELU kernels (the planner times eager "
              "elementwise ops)",
              "the distributed optimizer's parameter all-gather run beside the next step's first forward "
              "(--overlap-param-gather: DistributedOptimizer._make_forward_pre_hook waits per bucket, "
              "megatron/core/optimizer/distrib_optimizer.py lines 1413-1438 at baf94af), where the ddp twin's "
              "all-reduce, both halves, has only the last micro-batch's backward to hide behind",
              "fp32 gradient reduction (accumulate_allreduce_grads_in_fp32; the planner's twins reduce in bf16)")


def gpt(heads: int, hidden: int, layers: int) -> dict:
    """A Megatron-table GPT as the planner reads it: GPT-2's blocks (learned positions, LayerNorm, biases, GELU,
    ffn 4h) with the table's widths, the README's vocabulary and an untied output layer."""
    return {"model_type": "gpt2", "n_embd": hidden, "n_head": heads, "n_layer": layers, "n_inner": 4 * hidden,
            "n_positions": SEQ_LEN, "vocab_size": VOCAB, "tie_word_embeddings": False,
            "activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def megatron_flops_per_token(hidden: int, layers: int, seq_len: int = SEQ_LEN, vocab: int = VOCAB) -> float:
    """num_floating_point_operations(args, 1) / seq_len at core_r0.8.0 for multi-head attention (num_query_groups
    = heads, kv_channels x heads = hidden), no SwiGLU, ffn_hidden_size 4h (training.py lines 73-108)."""
    return 12 * layers * hidden ** 2 * ((1 + 1 + seq_len / hidden) + 4 + vocab / (2 * layers * hidden))


@dataclass(frozen=True)
class Row:
    table: str
    name: str
    gpus: int
    global_batch: int
    micro_batch: int
    seq_len: int
    tp: int
    pp: int
    cp: int
    vp: int
    published_tflops: float  # per GPU, as published
    published_tokens: float | None = None  # per GPU, as published (None: derived from the TFLOP/s)
    model: str | None = None  # catalogue name
    arch: tuple[int, int, int] | None = None  # (heads, hidden, layers) of a Megatron-table GPT
    low_precision: str = "none"

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def accumulation(self) -> int:
        """Micro-batches per step on each data-parallel rank: Megatron's global batch / (micro-batch x dp)."""
        per_step = self.micro_batch * self.data_parallel
        if self.global_batch % per_step:
            raise PlannerError(f"global batch {self.global_batch} is not divisible by micro_batch({self.micro_batch}) "
                               f"x data_parallel({self.data_parallel}) = {per_step}")
        return self.global_batch // per_step

    @property
    def tokens(self) -> float:
        """Published tokens per second per GPU: the table's, or the TFLOP/s over Megatron's FLOPs per token."""
        if self.published_tokens is not None:
            return self.published_tokens
        return self.published_tflops * 1e12 / megatron_flops_per_token(self.arch[1], self.arch[2], self.seq_len)

    def fields(self, strategy: str) -> dict:
        model = {"model": self.model} if self.model else {"model_config": gpt(*self.arch)}
        schedule = {"pp_schedule": "interleaved", "pp_virtual_stages": self.vp} if self.vp > 1 else {}
        # --tp-comm-overlap (README line 66) is the planner's async TP: torch's sequence-parallel TP (the ddp twin)
        # runs it; DeepSpeed's AutoTP (the zero1 twin) has no sequence parallelism to pipeline
        overlap = {"async_tp": True} if self.table == MEGATRON and self.tp > 1 and strategy == "ddp" else {}
        return dict(**model, **RECIPE, **overlap, strategy=strategy, gpus=min(GPUS_PER_NODE, self.gpus),
                    nodes=max(1, self.gpus // GPUS_PER_NODE), tp=self.tp, pp=self.pp, cp=self.cp,
                    seq_len=self.seq_len, micro_batch=self.micro_batch, gradient_accumulation=self.accumulation,
                    low_precision=self.low_precision, **schedule)

    def request(self, strategy: str = STRATEGIES[0]) -> EstimateRequest:
        return EstimateRequest(**self.fields(strategy))


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
              tflops: float) -> Row:
    return Row(MEGATRON, f"GPT {size}", gpus, batch, 1, SEQ_LEN, tp, pp, 1, 1, tflops, arch=(heads, hidden, layers))


# images/model_table.png at f2e5db402c, row by row: size, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s/GPU
# (the data-parallel size is 48 in every row: GPUs / (TP x PP))
ROWS = [
    _megatron("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _megatron("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _megatron("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _megatron("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _megatron("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _megatron("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _megatron("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
] + [
    # performance_summary.md at 8e3d65dc, lines 16-24: model, GPUs, GBS, MBS, sequence, TP, PP, CP, VP, tokens/s/GPU,
    # model TFLOP/s/GPU
    Row(NEMO, name, gpus, gbs, mbs, seq, tp, pp, cp, vp, tflops, tokens, model=model, low_precision="te-fp8")
    for name, model, gpus, gbs, mbs, seq, tp, pp, cp, vp, tokens, tflops in [
        ("LLAMA2-7B", "llama-2-7b", 8, 128, 1, 4096, 1, 1, 1, 1, 16934, 780),
        ("LLAMA2-13B", "llama-2-13b", 16, 128, 1, 4096, 1, 4, 1, 10, 8715, 760),
        ("LLAMA2-70B", "llama-2-70b", 64, 128, 1, 4096, 4, 4, 1, 20, 1728, 768),
        ("LLAMA3-8B", "llama-3-8b", 8, 128, 1, 8192, 1, 1, 2, 1, 12273, 711),
        ("LLAMA3-70B", "llama-3-70b", 64, 128, 1, 8192, 4, 4, 2, 5, 1524, 734),
    ]
]


def _terms(time) -> dict[str, float]:
    return {term.name: term.seconds for term in time.terms}


def at_dp1(row: Row, strategy: str = STRATEGIES[0]) -> EstimateRequest:
    """The same row on only the ranks of one model replica (data-parallel size 1): what is exposed there is the
    tensor-, pipeline- and context-parallel traffic alone, the rest of the row's exposed time the data-parallel."""
    ranks = row.tp * row.pp * row.cp
    return row.request(strategy).model_copy(update={"gpus": min(GPUS_PER_NODE, ranks),
                                                    "nodes": max(1, ranks // GPUS_PER_NODE)})


def predict(row: Row, strategy: str) -> dict:
    """The prediction under one twin, or the planner's refusal (first line of its message)."""
    try:
        result = estimate_with_time(row.request(strategy))
    except (PlannerError, ValueError) as exc:
        return {"refused": str(exc).splitlines()[0]}
    t = result.time
    tokens = t.tokens_per_second / result.world_size
    terms = _terms(t)
    return {"tokens": tokens, "error": tokens / row.tokens - 1, "mfu": t.mfu, "parameters": result.parameters,
            "step": t.step_seconds, "gemm": terms.get("matmul", 0.0) + terms.get("attention", 0.0),
            "elementwise": terms.get("elementwise and loss", 0.0), "exposed": t.exposed_communication_seconds,
            "exposed_dp1": estimate_with_time(at_dp1(row, strategy)).time.exposed_communication_seconds,
            "peak_gib": result.per_device.peak_bytes / GIB}


def _cell(p: dict) -> str:
    if "refused" in p:
        return f"refused: {p['refused']} | |"
    return f"{p['tokens']:,.0f} | {p['error']:+.1%} |"


def _line(row: Row, preds: dict[str, dict]) -> str:
    main = preds[STRATEGIES[0]]
    layout = f"TP {row.tp} x PP {row.pp}" + (f" (VP {row.vp})" if row.vp > 1 else "") + \
             (f" x CP {row.cp}" if row.cp > 1 else "") + f" x DP {row.data_parallel}"
    detail = "" if "refused" in main else (f"{main['step']:.2f}: {main['gemm']:.2f} / {main['elementwise']:.2f} / "
                                           f"{main['exposed']:.2f} ({main['exposed_dp1']:.2f}) | {main['mfu']:.1%} | "
                                           f"{main['peak_gib']:.0f}")
    return (f"| {row.name} | {row.gpus} | {layout} | {row.seq_len:,} x {row.micro_batch} x {row.accumulation} | "
            f"{'FP8 (TE)' if row.low_precision == 'te-fp8' else 'BF16'} | {row.published_tflops:g} | {row.tokens:,.0f} | "
            + " ".join(_cell(preds[s]) for s in STRATEGIES) + (f" {detail} |" if detail else " | | |"))


def _gap(p: dict) -> str:
    """Where the predicted step goes: its exposed communication, split into what one model replica exposes
    (tensor, pipeline, context parallel) and what the data-parallel ranks add, and its elementwise time."""
    dp = p["exposed"] - p["exposed_dp1"]
    return (f"of the {p['step']:.2f} s step, {p['exposed']:.2f} s is exposed communication ({p['exposed_dp1']:.2f} s of it "
            f"with one model replica, i.e. tensor/pipeline/context-parallel traffic; {dp:.2f} s added by the data-parallel "
            f"ranks) and {p['elementwise']:.2f} s elementwise ops and loss")


def _by(results, table: str, strategy: str, keep=lambda row: True) -> list[float]:
    return [preds[strategy]["error"] for row, preds in results
            if row.table == table and keep(row) and "error" in preds[strategy]]


def report() -> str:
    results = [(row, {s: predict(row, s) for s in STRATEGIES}) for row in ROWS]
    head = ["| run | GPUs | layout | seq x micro x accum | precision | published TFLOP/s/GPU | published tokens/s/GPU | "
            "ddp | error | zero1 | error | ddp step s: GEMMs + attention / elementwise / exposed comm (at dp 1) | "
            "ddp MFU | ddp peak GiB |",
            "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines = []
    for table in (MEGATRON, NEMO):
        lines += [f"**[{table}]({SOURCES[table]})**", "", *head]
        lines += [_line(row, preds) for row, preds in results if row.table == table]
        lines.append("")
        for strategy in STRATEGIES:
            errors = _by(results, table, strategy)
            refused = sum(1 for row, preds in results if row.table == table and "refused" in preds[strategy])
            lines.append(f"- H100, asked as {strategy}: " + (error_summary(errors, span=True) if errors else "no row predicted")
                         + (f"; {refused} row(s) refused" if refused else ""))
        if table == MEGATRON:
            for label, keep in (("tp <= 2", lambda r: r.tp <= 2), ("tp 4", lambda r: r.tp == 4),
                                ("tp 8, pp 1", lambda r: r.tp == 8 and r.pp == 1), ("tp 8, pp > 1", lambda r: r.pp > 1)):
                errors = _by(results, table, STRATEGIES[0], keep)
                lines.append(f"  - ddp, {label}: " + error_summary(errors, span=True))
        lines.append("")
    lines += ["Rows outside 15%, in the planner's own terms (ddp):", ""]
    lines += [f"- {row.name} ({row.table.split(' ')[0]}): {preds[STRATEGIES[0]]['error']:+.1%}; " + _gap(preds[STRATEGIES[0]])
              for row, preds in results if abs(preds[STRATEGIES[0]].get("error", 0.0)) > WITHIN]
    lines += ["", "Why the gaps (the planner models none of these): " + "; ".join(UNMODELLED) + ". The Megatron table "
              "does not publish its micro-batch, recomputation or virtual stages: asked with micro-batch 1, none and "
              "1F1B (module docstring); an interleaved schedule would shrink the bubble the pipelined rows are charged. "
              "ddp steps the whole optimizer on every rank where the distributed optimizer steps 1/dp of it; zero1 is "
              "DeepSpeed's engine (its pipeline engine under pp), which refuses the interleaved schedule and context "
              "parallelism. The planner's te-fp8 is modelled for a data-parallel layout only, hence the FP8 rows' "
              "refusals. Peak GiB is the ddp twin's allocated peak (every rank holding the whole optimizer), not "
              "Megatron's.",
              "",
              "Published: NVIDIA's tables (BF16 assumed for the Megatron table: its MFU is the TFLOP/s over the dense "
              "BF16 peak); tokens/s/GPU of the Megatron rows derived from their TFLOP/s with "
              "num_floating_point_operations (72 l h^2 + 12 l h s + 6 V h per token). Predicted: h100-80gb on its "
              "preset, bf16-mixed AdamW, no recomputation, FlashAttention-2. Written by `python bench/published_nemo.py "
              "--readme README.md`. Under pp the compute terms include the stage's bubble."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.readme import readme_main

    return readme_main(__doc__, "published-nemo", report, argv)


if __name__ == "__main__":
    sys.exit(main())
