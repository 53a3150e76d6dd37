"""Published training throughput next to the planner's step-time prediction, row by row.

    python bench/published_throughput.py [--readme README.md] [--rows]

Every row of bench/data/llm_foundry_throughput.csv is a run MosaicML published (llm-foundry's
scripts/train/benchmarking/README.md at 8c8dd48, cited per row by its line there): an MPT model
125M-70B trained with PyTorch FSDP (FULL_SHARD or SHARD_GRAD_OP) on 8-512 A100-40GB, A100-80GB
or H100-80GB, 512-65,536 tokens, with or without activation checkpointing. Each is asked through
the code path of `planner estimate` (planner.time.step.estimate_with_time) with the same model,
GPUs, nodes, micro-batch, accumulation, precision, sharding and checkpointing; the prediction is
its tokens per second per GPU. No constant of the time model is fitted to these figures (its
rates come from kernel measurements: planner/time/kernels.py). The A100 tables' clusters have
1,600 Gb/s RoCE per node (8 x roce-200g); the H100 tables name no fabric, so the h100-80gb
preset's is used.

MPT as the planner reads it: a GPT-2 config (learned positions, LayerNorm, plain MLP of 4 x d_model,
tied embeddings, vocabulary 50,368) with MPT's widths. The benchmark yamls set none of alibi, no_bias
or learned_pos_emb, so the runs had MPTConfig's defaults (llmfoundry/models/mpt/configuration_mpt.py
at 5f43bf1 and 5e85bd6: alibi False, learned_pos_emb True, no_bias False): learned positions and
biases, as GPT-2 has; submit_benchmarks.py sets low_precision_layernorm (line 270 at 5f43bf1; norm_type
line 307 at 5e85bd6), a LayerNorm run in bf16 that saves what the planner's 16-bit LayerNorm saves.
The MLP's activation is MPT's exact GELU, one fused op (activation_function "gelu": MPT_ACTIVATION),
not GPT-2's default gelu_new, which is composed in Python and saves 2.5 times as much. The loss is
llm-foundry's default, flash-attn's cross-entropy on the bf16 logits, and composer's loop keeps the
outputs (MPT_LOSS, COMPOSER_KEEPS_OUTPUTS) and after each micro-batch's backward updates the model's two
train metrics on them, LanguageCrossEntropy and LanguagePerplexity, each a torch cross-entropy over the
logits in fp32 under the amp_bf16 autocast (MPT_TRAIN_METRICS; planner/recipes/loop.py): on a 50k
vocabulary the metrics move about seven times the bytes of the loss they shadow. The optimizer, the yamls' decoupled_adamw (composer's
DecoupledAdamW: fp32 exp_avg and exp_avg_sq, AdamW's states), steps one parameter at a time, as
torch's AdamW(foreach=False) does (MPT_OPTIMIZER), where torch's default foreach AdamW copies the
shard's exp_avg_sq whole. Attention: the runs were
submitted by scripts/train/benchmarking/submit_benchmarks.py, whose `--attn_impl` defaults to
`triton` (line 119 at 5f43bf1, May 2023, when the A100 tables appeared; line 144 at 5e85bd6, January
2024, whose sweep.sh, the H100 runs, does not override it): MPT's triton_flash_attn_fn, FlashAttention's
Triton kernel flash_attn_triton.py (attention_kernel "flash-attention-triton"), which no chart measures:
planner/time/kernels.py reads it at FlashAttention 1.x's rates, which its header says it runs slightly below.
The large-scale H100 table (>= 128 GPUs) is the one sweep.py submitted (scripts/train/benchmarking/sweep.py
at 5e85bd6, which added that table): `--attn_impl flash` for 1b, 3b, 7b and 70b (FlashAttention 2.4.2,
the `gpu-flash2` extra its submit_benchmarks.py installs), `triton` for 13b and 30b. MPT's flash path unpads
q, k and v with flash-attn's bert_padding in every layer, an all-ones mask too, and calls the varlen kernel
(attention_unpad "flash-attn": the gathers, the scatter and the host synchronisations, planner/time/kernels.py
UNPAD).

Precision as composer 0.16 (llm-foundry v0.3.0's pin) builds FSDP's MixedPrecision from the MP Mode
column (composer/trainer/mosaic_fsdp_utils.py get_mixed_precision): DEFAULT computes in bf16 and
reduces gradients in fp32, PURE reduces in bf16; both keep FSDP's sharded fp32 parameters and an fp32
AdamW (MixedPrecision casts the gathered copy only), so both are the planner's bf16-mixed.

FSDP's prefetch schedule as the rows ran it (torch FSDP1): the 8-64-GPU tables with composer's
defaults, backward_prefetch BACKWARD_POST and forward_prefetch False (composer v0.14.0
trainer/dist_strategy.py lines 218 and 223, the pin of the A100 tables' llm-foundry 5f43bf1; v0.17.2
lines 135 and 138, the pin at 5e85bd6), limit_all_gathers true (submit_benchmarks.py line 304 at
5f43bf1; the pretrain yamls' fsdp_config at 5e85bd6); the large-scale table with BACKWARD_PRE and
forward_prefetch true (sweep.py's base_args at 5e85bd6). The planner has no field for it: under
BACKWARD_POST the post-backward hook issues the next unit's all-gather before the current unit's
reduce-scatter (torch 2.13 fsdp/_runtime_utils.py: _post_backward_reshard's _prefetch_handle, line
807, runs before _reduce_grad, line 766; the same order since torch 1.13), and the rate limiter
holds the host until the GPU has finished the unit before, so the gather runs beside the current
unit's gradient computation, queued behind the previous reduce-scatter: the overlap the time model
gives FSDP2 (planner/time/step.py _unhidden_edge), not one exposed gather per unit. The summary
splits the rows by the schedule they ran.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.readme import publish  # noqa: E402
from bench.summary import error_summary  # noqa: E402
from planner.cluster.gpus import load_gpus  # noqa: E402
from planner.time import kernels  # noqa: E402
from planner.time.kernels import rates  # noqa: E402
from planner.schema import EstimateRequest  # noqa: E402
from planner.time.step import TRAIN_METRICS_TERM, estimate_with_time  # noqa: E402

DATA = ROOT / "bench" / "data" / "llm_foundry_throughput.csv"
SOURCE = ("https://github.com/mosaicml/llm-foundry/blob/8c8dd48f72168c5d51e2f7b151595892a8fba43d/"
          "scripts/train/benchmarking/README.md")
# scripts/train/yamls/pretrain/mpt-<size>.yaml at 8c8dd48: (d_model, n_heads, n_layers)
MPT = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
       "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
       "70b": (8192, 64, 80)}
# MPTMLP's activation: nn.GELU(approximate='none') (llmfoundry/models/layers/blocks.py line 25 at 5f43bf1;
# ffn.py _FFN_ACT_FN_DEFAULT, torch.nn.functional.gelu with approximate 'none', lines 23-26 at 5e85bd6):
# one fused op, GPT-2's activation_function "gelu", not its default gelu_new (composed in Python)
MPT_ACTIVATION = "gelu"
# the loss: ComposerMPTCausalLM's loss_fn defaults to fused_crossentropy, flash-attn's CrossEntropyLoss
# (llmfoundry/models/mpt/modeling_mpt.py lines 584-589 at 5f43bf1, flash-attn 1.0.3.post0 with its
# xentropy extension; lines 981-987 at 5e85bd6, flash-attn 2.4.2 under gpu-flash2), on the bf16 logits
# without an upcast; no benchmark yaml sets loss_fn. Composer's training loop keeps the model's
# outputs through backward: ``self.state.outputs = self.state.model(self.state.batch)`` then
# ``microbatch_loss.backward()`` (composer/trainer/trainer.py lines 2276 and 2340 at v0.14.0, the A100
# tables' pin; 2417 and 2481 at v0.17.2, 5e85bd6's), so the logits stay live (keeps_outputs)
MPT_LOSS = "flash-attn"
COMPOSER_KEEPS_OUTPUTS = True
# the optimizer: every benchmark yaml names decoupled_adamw (line 60 of scripts/train/yamls/mpt/<size>.yaml
# at 5f43bf1 and of yamls/pretrain/mpt-<size>.yaml at 5e85bd6; submit_benchmarks.py leaves it), which
# llmfoundry/utils/builders.py builds as composer's DecoupledAdamW (line 89 at 5f43bf1, 361 at 5e85bd6):
# AdamW's two fp32 moments, stepped one parameter at a time (adamw-single-tensor), not torch's foreach
MPT_OPTIMIZER = "adamw-single-tensor"
# gradient clipping: the MPT yamls set composer's gradient_clipping algorithm, clipping_type norm, threshold 1.0
# (scripts/train/yamls/pretrain/mpt-<size>.yaml, "algorithms: gradient_clipping", lines 68-71 of mpt-1b.yaml at
# 06560d5; the benchmark commits' copies not re-read), which under FSDP calls FSDP.clip_grad_norm_
MPT_CLIPPING = True
# composer's train metrics: ComposerMPTCausalLM builds LanguageCrossEntropy and LanguagePerplexity as its train
# metrics (llmfoundry/models/mpt/modeling_mpt.py lines 561-564 at 5f43bf1; lines 955-957 at 5e85bd6, where
# use_train_metrics defaults true and no benchmark yaml or sweep sets it), and composer's trainer updates both on
# every micro-batch's outputs after its backward (composer/trainer/trainer.py lines 2345-2347 at v0.14.0, 2484-2488
# at v0.17.2), each a torch cross-entropy over the logits under the amp_bf16 autocast (planner/recipes/loop.py)
MPT_TRAIN_METRICS = 2
# the recipe fields every MPT request carries (this table's and bench/layout_ranking.py's)
MPT_RECIPE = {"loss": MPT_LOSS, "optimizer": MPT_OPTIMIZER, "keeps_outputs": COMPOSER_KEEPS_OUTPUTS,
              "gradient_clipping": MPT_CLIPPING, "train_metrics": MPT_TRAIN_METRICS}
GPU = {"a100_40gb": "a100-40gb", "a100_80gb": "a100-80gb", "h100_80gb": "h100-80gb"}
SHARDING = {"FULL_SHARD": "fsdp", "SHARD_GRAD_OP": "fsdp-grad-op"}
# composer 0.16 mosaic_fsdp_utils.py get_mixed_precision (lines 87-95): DEFAULT reduces in fp32,
# PURE in the compute dtype; both gather bf16 copies of fp32 sharded parameters (bf16-mixed)
REDUCE_DTYPE = {"DEFAULT": "fp32", "PURE": "compute"}
# sweep.py at 5e85bd6 (the large-scale H100 table's runs): --attn_impl flash for these models
LARGE_SCALE_TABLE = "H100 80GB BF16 (Large Scale >= 128 GPUs)"
FLASH2_IN_SWEEP = ("1b", "3b", "7b", "70b")
# MPT's attn_impl flash unpads q, k and v with flash-attn's bert_padding every layer, an all-ones mask too
# (llm-foundry 5e85bd6 llmfoundry/models/layers/attention.py flash_attn_fn, lines 270-289)
MPT_FLASH_UNPAD = "flash-attn"
# FSDP1's backward prefetch each table ran (module docstring): sweep.py's, else composer's default
PREFETCH = {LARGE_SCALE_TABLE: "BACKWARD_PRE + forward prefetch"}
COMPOSER_PREFETCH = "BACKWARD_POST"
# composer wraps the model with torch FSDP1 (FullyShardedDataParallel: composer/trainer/dist_strategy.py
# prepare_fsdp_module at v0.14.0 and v0.17.2): no copies on the compute stream (the planner's fsdp_version 1)
COMPOSER_FSDP = 1


def mpt_config(size: str, seq_len: int) -> dict:
    """MPT-<size> as the planner reads it (module docstring): a GPT-2 config with MPT's widths."""
    d, heads, layers = MPT[size]
    return {"model_type": "gpt2", "n_embd": d, "n_head": heads, "n_layer": layers, "n_inner": 4 * d,
            "n_positions": seq_len, "vocab_size": 50368, "tie_word_embeddings": True,
            "activation_function": MPT_ACTIVATION, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@dataclass(frozen=True)
class Row:
    line: int
    table: str
    model: str
    seq_len: int
    gpus: int
    gpu: str
    micro_batch: int
    accumulation: int
    published: float
    precision: str
    mp_mode: str
    sharding: str
    checkpointing: bool

    @property
    def prefetch(self) -> str:
        return PREFETCH.get(self.table, COMPOSER_PREFETCH)

    def request(self) -> EstimateRequest:
        nodes = max(1, self.gpus // 8)
        fabric = {"fabric": "roce-200g", "nics_per_node": 8} if self.gpu.startswith("a100") else {}
        flash2 = self.table == LARGE_SCALE_TABLE and self.model in FLASH2_IN_SWEEP
        return EstimateRequest(model_config=mpt_config(self.model, self.seq_len), gpu=GPU[self.gpu], gpus=min(8, self.gpus), nodes=nodes,
                               strategy=SHARDING[self.sharding], seq_len=self.seq_len, micro_batch=self.micro_batch,
                               gradient_accumulation=self.accumulation, precision="bf16-mixed",
                               reduce_dtype=REDUCE_DTYPE[self.mp_mode],
                               checkpointing="full" if self.checkpointing else "none", **MPT_RECIPE,
                               attention_kernel="flash-attention-2" if flash2 else "flash-attention-triton",
                               attention_unpad=MPT_FLASH_UNPAD if flash2 else "none",
                               fsdp_version=COMPOSER_FSDP, **fabric)


def rows() -> list[Row]:
    with DATA.open() as f:
        reader = csv.DictReader(line for line in f if not line.startswith("#"))
        return [Row(int(r["readme_line"]), r["table"], r["model"], int(r["seq_len"]), int(r["gpus"]), r["gpu"],
                    int(r["micro_batch"]), int(r["grad_accum"]), float(r["tokens_per_s_per_gpu"]), r["precision"],
                    r["mp_mode"], r["sharding"], r["activation_checkpointing"] == "True") for r in reader]


def predict(row: Row):
    result = estimate_with_time(row.request())
    t = result.time
    return t.tokens_per_second / result.world_size, t, result


def _memory(results) -> str:
    """Every row ran, so every row fits: the rows whose predicted peaks exceed the device are the
    memory model's (or this bench's) error, shown beside the time's."""
    share = [(r, res.per_device.reserved_peak_bytes / res.device_capacity_bytes,
              res.per_device.peak_bytes / res.device_capacity_bytes) for r, _, _, _, res in results]
    over = [x for x in share if x[1] > 1]
    worst = max(share, key=lambda x: x[1])
    return (f"- memory: {len(over)}/{len(share)} published runs predicted not to fit (reserved peak over the "
            f"device; allocated peak over it: {sum(x[2] > 1 for x in share)}); highest reserved peak "
            f"{worst[1]:.0%} of the device (line {worst[0].line}), median {statistics.median(x[1] for x in share):.0%}")


def _median_of(results, gpu: str, shortest: int, longest: int | None) -> float:
    """The median signed error of one GPU's rows between two sequence lengths (inclusive; None: no limit)."""
    return statistics.median(e for r, _, e, _, _ in results
                             if r.gpu == gpu and shortest <= r.seq_len and (longest is None or r.seq_len <= longest))


def _unexplained(data: list[Row], results) -> str:
    """What the time model leaves out, from the published rows themselves: the H100/A100-80GB
    throughput ratio of configurations run on both, against the ratio of the two GPUs' modelled
    matmul rates."""
    by_config: dict[tuple, dict[str, float]] = {}
    for r in data:
        key = (r.model, r.seq_len, r.gpus, r.micro_batch, r.accumulation, r.checkpointing)
        by_config.setdefault(key, {})[r.gpu] = r.published
    short = [v["h100_80gb"] / v["a100_80gb"] for k, v in by_config.items()
             if k[1] <= 4096 and {"h100_80gb", "a100_80gb"} <= v.keys()]
    flash2 = [e for r, _, e, _, _ in results if r.table == LARGE_SCALE_TABLE and r.model in FLASH2_IN_SWEEP]
    long = [e for r, _, e, _, _ in results if r.seq_len > 16384]
    h100 = [(r, e) for r, _, e, _, _ in results if r.gpu == "h100_80gb"]
    post = [e for r, e in h100 if r.prefetch == COMPOSER_PREFETCH]
    pre = [(r, e) for r, e in h100 if r.prefetch != COMPOSER_PREFETCH]
    grad_op = [e for r, e in pre if r.sharding == "SHARD_GRAD_OP"]
    steady = {g: rates(load_gpus()[GPU[g]], "bf16").steady_flops / 1e12 for g in ("h100_80gb", "a100_80gb")}
    return (f"Not explained: on the {len(short)} configurations up to 4,096 tokens that ran on both, H100 "
            f"throughput is {statistics.median(short):.2f}x the A100-80GB's (median; "
            f"{min(short):.2f}-{max(short):.2f}), where the measured matmul rates differ "
            f"{steady['h100_80gb'] / steady['a100_80gb']:.2f}x ({steady['h100_80gb']:g} / {steady['a100_80gb']:g} "
            "TFLOP/s: each GPU's rate sustained at its power limit, both measured back to back on one large matmul, "
            "gpus.yaml sustained_tflops): the H100's matmul-bound rows are over-predicted by what no kernel measurement here "
            "accounts for (the 'communication contention' term, what overlapped collectives cost the compute, "
            "explains part of it where the collectives take a large share of the step); the large-scale table's FlashAttention-2 rows (sweep.py's `--attn_impl flash`) "
            f"are over-predicted by a median {statistics.median(flash2):+.0%}, while the same models with Triton "
            "attention on 8-64 H100s publish about the same throughput. By sequence length the H100's error falls "
            f"from {_median_of(results, 'h100_80gb', 0, 2048):+.0%} up to 2k tokens to "
            f"{_median_of(results, 'h100_80gb', 16384, None):+.0%} from 16k, the A100-80GB's stays level "
            f"({_median_of(results, 'a100_80gb', 0, 2048):+.0%} and {_median_of(results, 'a100_80gb', 16384, None):+.0%}): "
            "the H100's excess is in the matmul-bound rest of the step, not its attention. MPT's `triton` attention, "
            "FlashAttention's flash_attn_triton.py, has no published rates; it is read at FlashAttention 1.x's, "
            "which its header says it runs slightly below in forward + backward, and at width 128 at no less than "
            "FlashAttention 1.x's width-64 rate (it keeps its 128 x 128 tiles at both widths: "
            "kernels.WIDTH_KEEPS_TILE); beyond 16k tokens (FlashAttention's charts end there) the rate follows the "
            f"per-block fixed-cost form through the 8k and 16k rates; the {len(long)} rows beyond 16k are predicted "
            f"at a median {statistics.median(long):+.0%}. FSDP's prefetch schedule does not explain the H100's "
            f"over-prediction: the {len(post)} H100 rows run with composer's BACKWARD_POST are over-predicted by a "
            f"median {statistics.median(post):+.0%}, the {len(pre)} run with BACKWARD_PRE and forward prefetch "
            f"(sweep.py, on 128-512 GPUs, most with FlashAttention-2), which hide the gathers at least as well, by "
            f"{statistics.median(e for _, e in pre):+.0%}, "
            f"and {len(grad_op)} of those are SHARD_GRAD_OP, with no gather in backward at all "
            f"({statistics.median(grad_op):+.0%}).")


def _small_models(results) -> str:
    """The head-64 models' rows (MPT-125M and 350M, 768 and 1,024 wide) beside the rest, up to 8k tokens."""
    def errors(small: bool) -> list[float]:
        return [e for r, _, e, _, _ in results if r.seq_len <= 8192 and (MPT[r.model][0] <= 1024) == small]

    def metric_share(model: str) -> float:
        return statistics.median(next((x.seconds for x in t.terms if x.name == TRAIN_METRICS_TERM), 0.0)
                                 / t.step_seconds for r, _, _, t, _ in results if r.model == model and r.seq_len <= 8192)

    small, rest = errors(True), errors(False)
    pipelines = [rates(load_gpus()[GPU[g]], "bf16").k_pipeline for g in ("a100_40gb", "a100_80gb")]
    shares = [kernels.k_efficiency(k, p) for k in (768, 1024) for p in pipelines]
    return (f"The smallest models are under-predicted: MPT-125M and 350M (768 and 1,024 wide, heads of 64) up to "
            f"8k tokens by a median {statistics.median(small):+.0%} ({len(small)} rows), the larger models' rows "
            f"there by {statistics.median(rest):+.0%} ({len(rest)}). On them the train metrics weigh most (two "
            f"50k-vocabulary cross-entropies beside a narrow model: a median {metric_share('125m'):.0%} of the "
            f"125M's predicted step there, {metric_share('350m'):.0%} of the 350M's, {metric_share('7b'):.0%} of "
            "the 7B's) and their GEMMs "
            "reduce over K = 768 or 1,024, where the A100 K-loop curve (planner/time/kernels.py, K_PIPELINE from "
            "NVIDIA's square-GEMM figure) reads them at "
            f"{min(shares):.0%}-{max(shares):.0%} of the long-K rate; neither is measured on these "
            "shapes here (no GPU), so neither is tuned to these rows.")


def _split_fit(samples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The factors (n, a) that best turn the model's per-step non-attention and attention seconds into the
    published step (least squares on the relative error), and the fit's median |relative error|. samples:
    (non-attention seconds, attention seconds, published seconds)."""
    w = [(x / p, y / p) for x, y, p in samples]
    nn, aa, na = sum(x * x for x, _ in w), sum(y * y for _, y in w), sum(x * y for x, y in w)
    n1, a1 = sum(x for x, _ in w), sum(y for _, y in w)
    det = nn * aa - na * na
    n, a = (n1 * aa - a1 * na) / det, (a1 * nn - n1 * na) / det
    return n, a, statistics.median(abs(n * x + a * y - 1) for x, y in w)


def _implied(results) -> str:
    """What the published rows say of the model's two largest parts, per GPU and attention kernel: over
    the rows without checkpointing (the attention then runs once), the factors by which the model's
    attention time and the rest of its step (matmuls, elementwise, loss, optimizer, exposed
    communication) would have to be scaled to meet the published steps. Only where the rows span three
    sequence lengths or more (else the two parts cannot be told apart). A diagnostic of where the error
    sits; the model uses none of it."""
    by_key: dict[str, list[tuple[float, float, float]]] = {}
    lengths: dict[str, set[int]] = {}
    for r, tps, _, t, _ in results:
        if r.checkpointing:
            continue
        attention = next(x.seconds for x in t.terms if x.name == "attention")
        key = f"{r.gpu}, {r.request().attention_kernel}"
        by_key.setdefault(key, []).append((t.step_seconds - attention, attention, t.step_seconds * tps / r.published))
        lengths.setdefault(key, set()).add(r.seq_len)
    fits = {k: _split_fit(v) for k, v in sorted(by_key.items()) if len(lengths[k]) >= 3}
    parts = [f"{k} ({len(by_key[k])} rows, {min(lengths[k]):,}-{max(lengths[k]):,} tokens): the rest x{n:.2f}, "
             f"attention x{a:.2f} (then {res:.1%} median |error|)" for k, (n, a, res) in fits.items()]
    rest = [n for n, _, _ in fits.values()]
    return ("Where the error sits (a diagnostic; no constant of the model comes from it): scaling the model's "
            "attention time and the rest of its step by one factor each, per GPU and attention kernel, fitted to "
            "the published steps of the rows without checkpointing, gives " + "; ".join(parts) + ". "
            f"The rest of the step runs {min(rest) - 1:.0%} to {max(rest) - 1:.0%} slower than the model's "
            "matmul, bandwidth and collective rates say, so the sequences where it dominates (the short ones) are "
            "over-predicted, and where the attention factor is under 1 the long sequences are under-predicted. "
            "No kernel measurement here says what slows the rest: the matmul rates are MAMF measurements of each "
            "GPU's best shape in a burst, held to the rate a large matmul sustains at the power limit (the H100's and "
            "the A100's each measured on one shape), and these runs used 2023-24 software.")


COMMUNICATION_BINS = (0.05, 0.10, 0.20)  # edges of the model's communication share of the step


def _share_bin(share: float) -> str:
    """The communication-share bin a row falls in ("<5%", "5-10%", "10-20%", ">=20%")."""
    edges = COMMUNICATION_BINS
    if share < edges[0]:
        return f"<{edges[0]:.0%}"
    for low, high in zip(edges, edges[1:]):
        if share < high:
            return f"{low:.0%}-{high:.0%}".replace("%-", "-")
    return f">={edges[-1]:.0%}"


def _communication(results) -> str:
    """The error by how much of the modelled step its collectives take (hidden or exposed), per GPU:
    where the model hides most of that time behind the compute, a trend here says the overlap or the
    collectives' rates are not what the model takes them to be. A diagnostic; the model uses none of it."""
    groups: dict[str, dict[str, list[float]]] = {}
    for r, _, e, t, _ in results:
        share = t.communication_seconds / t.step_seconds if t.step_seconds else 0.0
        groups.setdefault(r.gpu, {}).setdefault(_share_bin(share), []).append(e)
    order = [_share_bin(x) for x in (0.0,) + tuple(b + 1e-9 for b in COMMUNICATION_BINS)]
    parts = []
    for gpu, bins in sorted(groups.items()):
        cells = [f"{b} {statistics.median(bins[b]):+.1%} ({len(bins[b])} rows)" for b in order if b in bins]
        parts.append(f"{gpu}: " + ", ".join(cells))
    return ("By the model's communication share of the step (its collectives' seconds, hidden or not, over "
            "the step; a diagnostic, the model uses none of it), the median signed error: " + "; ".join(parts)
            + ". The model hides nearly all of that time behind the compute (FSDP's prefetches) and charges "
            "the overlap 'communication contention', 0.61 s of compute per second of it over NVLink (the mean "
            "that Lee et al. 2025, arXiv 2507.03114, implies; charging only the SMs the collectives hold, "
            "0.18 s per second on an H100, left an error that grew with the share to +25%), "
            "so an error that still grows with the share says the published runs hid less of it, or sent it "
            "slower, than the model takes; the rows with little communication are the long sequences, so this trend and the "
            "attention factor above are not independent.")


def report(show_rows: bool) -> str:
    data = rows()
    results = []
    for row in data:
        tps, t, res = predict(row)
        results.append((row, tps, (tps - row.published) / row.published, t, res))
    errors = [e for _, _, e, _, _ in results]
    out = [f"Published: MosaicML llm-foundry's MPT throughput tables ({len(data)} bf16 rows, [source]({SOURCE})); "
           "predicted: `planner estimate` of the same configuration, tokens/s per GPU. No constant fitted to them.",
           "", f"- all rows: {error_summary(errors, share=True)}"]
    for label, key in (("GPU", lambda r: r.gpu), ("checkpointing", lambda r: "full" if r.checkpointing else "none"),
                       ("sequence", lambda r: "<=2k" if r.seq_len <= 2048 else ("4k-8k" if r.seq_len <= 8192 else
                                                                                  ">=16k")),
                       ("model", lambda r: "<=1b" if r.model in ("125m", "350m", "760m", "1b") else ">=3b"),
                       ("H100 FSDP prefetch", lambda r: r.prefetch if r.gpu == "h100_80gb" else None)):
        groups: dict[str, list[float]] = {}
        for row, _, e, _, _ in results:
            if key(row) is not None:
                groups.setdefault(key(row), []).append(e)
        out += [f"- by {label} {name}: {error_summary(v, share=True)}" for name, v in sorted(groups.items())]
    out += [_memory(results), "", _implied(results), "", _communication(results), "", _unexplained(data, results),
            "", _small_models(results)]
    if show_rows:
        out += ["", "| line | GPU | model | seq | GPUs | micro x accum | ckpt | published | predicted | error | MFU pred | "
                "HFU pred | reserved / device |",
                "|---:|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r.line} | {r.gpu} | {r.model} | {r.seq_len:,} | {r.gpus} | {r.micro_batch} x {r.accumulation} | "
                f"{'full' if r.checkpointing else 'none'} | {r.published:,.0f} | {p:,.0f} | {e:+.1%} | "
                f"{t.mfu:.1%} | {t.hfu:.1%} | "
                f"{res.per_device.reserved_peak_bytes / res.device_capacity_bytes:.0%} |" for r, p, e, t, res in results]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", help="README to write the <!-- throughput --> block into")
    parser.add_argument("--rows", action="store_true", help="every row (always in the README block)")
    args = parser.parse_args(argv)
    return publish(report(args.rows or bool(args.readme)), args.readme, "throughput")


if __name__ == "__main__":
    sys.exit(main())
