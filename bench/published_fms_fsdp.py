"""IBM fms-fsdp's published Llama-2 training throughput next to the planner's step-time prediction.

    python bench/published_fms_fsdp.py [--readme README.md]

Every row of bench/data/fms_fsdp_throughput.csv is a run IBM published in fms-fsdp's README
(foundation-model-stack/fms-fsdp README.md at 5a296af, lines 14-19 and 25-30): Llama-2-architecture
7b, 13b, 34b and 70b trained by main_training_llama.py with torch FSDP1 on 128 A100-80GB ("with
400Gbps") and 96 H100 ("with 800 Gbps"), tokens/s per GPU, with the published MFU and HFU. Each is
asked through the code path of `planner estimate` (planner.time.step.estimate_with_time) with what
that code runs (every citation below is fms-fsdp at 5a296af unless it says otherwise); the prediction
is its tokens per second per GPU. No constant of the time model is fitted to these figures.

- Model: fms's LLaMA built from fms_fsdp/utils/config_utils.py get_model_config (lines 25-56):
  llama2_7b (emb 4096, 32 heads, 32 layers, hidden 11008), llama2_13b (5120, 40, 40, 13824) and
  llama2_70b (8192, 64 heads, 8 KV heads, 80 layers, 28672) are Llama-2's shapes, the planner's
  catalogue entries llama-2-7b, llama-2-13b, llama-2-70b; llama2_34b (lines 35-44: emb 8192, 64
  heads, 8 KV heads, 48 layers, hidden_grow_factor 22016/8192, rope_theta 1e6) is CodeLlama-34B's
  shape, asked as a Llama model_config (FMS_34B); the vocabulary is LLaMAConfig's default 32,000
  (fms_fsdp/config/training.py line 21 vocab_size 32000), embeddings untied.
- Shape: seq_length 4096 and batch_size 2 per GPU (training.py lines 20 and 38; the table's Batch
  Size column), no gradient accumulation (train_utils.py train: one backward per optimizer step).
- Sharding: train_utils.py get_policies (lines 227-234) maps "fsdp" to FULL_SHARD and "hsdp" to
  HYBRID_SHARD (shard within the node, replicate across nodes: the planner's hsdp with its default
  shard group of one node's 8 GPUs); one FSDP unit per LLaMABlock (policies/wrapping.py), FSDP1
  (main_training_llama.py lines 82-91, limit_all_gathers True, FSDP1's default backward_prefetch
  BACKWARD_PRE), estimated with the planner's FSDP2 per-unit overlap as bench/published_throughput.py
  argues for FSDP1's prefetch.
- FSDP1 (FullyShardedDataParallel, main_training_llama.py lines 82-91): fsdp_version 1, whose step makes no
  copies on the compute stream (FSDP2's all-gather copy-out and reduce-scatter copy-in; the planner's
  fsdp_version note), its memory by FSDP2's per-unit model.
- Precision: get_mixed_precision_policy picks bfSixteen (train_utils.py lines 201-204 on bf16-capable
  GPUs; policies/mixed_precision.py lines 11-15: param, reduce and buffer dtype bf16) over a model built
  in fp32 (main_training_llama.py line 64): fp32 sharded parameters gathered as bf16 (bf16-mixed),
  gradients reduced in bf16 (reduce_dtype compute).
- Compile: main_training_llama.py lines 105-110 torch.compile the FSDP-wrapped model (training.py
  line 61 use_torch_compile True; README line 10): compile "model". The loss is computed outside it.
- Loss: train_utils.py lines 88-95: torch's CrossEntropyLoss on the model's bf16 logits, and `del
  output` before backward (the commit 5a296af itself, "fix: free logits"): keeps_outputs False. The
  planner's nearest loss is "hf" (transformers' cross-entropy, which upcasts the logits to fp32 first):
  it charges the loss slightly more memory and elementwise time than fms's bf16 log-softmax.
- Optimizer: torch.optim.AdamW with defaults beyond lr, betas and weight decay (main_training_llama.py
  lines 113-115): foreach on CUDA, the planner's "adamw". Gradient clipping: model.clip_grad_norm_(
  grad_clip_thresh 1.0) every step (train_utils.py line 96; training.py line 42).
- Attention: fms's LLaMA runs F.scaled_dot_product_attention (README line 5: "SDPA implementation of
  Flash attention v2"; requirements.txt torch>=2.2.0): FlashAttention-2.
- Activation checkpointing: 7b "No AC"; 13b, 34b and 70b "Selective AC", fms's
  apply_fsdp_checkpointing(p) (policies/ac_handler.py lines 16-64), which wraps a fraction p of the
  blocks, evenly spaced ("apply ac on every 1/p blocks", line 34). The table does not state p
  (training.py line 33 defaults selective_checkpointing to 1; scripts/train.sh, an example with AC and
  compile off, lines 13-14 and 20, is not the benchmark's configuration). It is derived per row from
  the published HFU/MFU ratio: a recomputed block forward adds one forward to the three (forward,
  backward at twice the forward) that MFU counts, so HFU/MFU = 1 + p/3 and p = 3 (HFU/MFU - 1),
  clamped to [0, 1]. That is first-order: the README's HFU is PyTorch's FLOP counter (README line 21),
  which counts SDPA's backward at 2.5x its forward (torch/utils/flop_counter.py sdpa_backward_flop_count:
  5 bmm against the forward's 2), raising the ratio by 1-2% at 4,096 tokens, and not the embedding
  lookup that MFU's 6N counts, lowering it by 1-2%: about what the two-decimal rounding of the
  published MFU and HFU already allows (p_range gives the p each row's rounding admits; the 7b rows,
  without AC, publish HFU = MFU). The planner's checkpointing_every N checkpoints blocks 0, N, 2N, ...
  (planner/model/activations.py checkpointed_blocks): fractions 1, 1/2, 1/3, ...; each row is asked
  with the N whose checkpointed block count is nearest fms's count for the derived p (ac_handler's
  rule: a block k = 1..L is wrapped when k p passes the next half-integer), and the table shows both
  counts and the prediction at the neighbouring N, the range p's position between the planner's
  fractions leaves open.
- Fabric: the README names 400 Gb/s per node for the A100 cluster and 800 Gb/s for the H100 one (line
  14), no fabric. IBM's earlier FSDP scaling work ran on IBM Cloud over Ethernet (the PyTorch blog post
  of pytorch/pytorch.github.io commit 7869a1c: FSDP "scales to models of size 10B+ parameters using
  commodity Ethernet networking in IBM Cloud"); taking these clusters to be the same kind, RoCE: 2 x
  roce-200g (2 x 25 GB/s = 400 Gb/s) and 2 x roce-400g (800 Gb/s), planner/data/links.yaml fabric
  entries, nics_per_node 2 (an assumption: one 400 Gb/s NIC gives the same per-node rate). The H100
  cluster's fabric is not named; the summary also gives the H100 rows on 2 x ib-ndr (the same 800 Gb/s
  at InfiniBand's efficiency). Nodes: GPUs / 8 (8 GPUs per node: scripts/train.sh line 27
  --nproc_per_node=8), the GPUs' NVSwitch presets (dgx-a100, hgx-h100) within a node.

A request the planner refuses is shown as refused with its reason, not bent.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.summary import error_summary  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.schema import EstimateRequest  # noqa: E402
from planner.time.step import estimate_with_time  # noqa: E402

DATA = ROOT / "bench" / "data" / "fms_fsdp_throughput.csv"
SOURCE = ("https://github.com/foundation-model-stack/fms-fsdp/blob/5a296afe42f9932f590783cb053fa0f9384e01fc/"
          "README.md")
SEQ_LEN = 4096  # fms_fsdp/config/training.py line 20 seq_length
GPUS_PER_NODE = 8  # scripts/train.sh line 27 --nproc_per_node=8
# fms_fsdp/utils/config_utils.py get_model_config at 5a296af; llama2_34b (lines 35-44) as a Llama config:
# hidden_grow_factor 22016 / 8192 x emb_dim 8192 = 22016 (a multiple of LLaMAConfig's multiple_of 256);
# vocabulary LLaMAConfig's src_vocab_size default 32000 (training.py line 21); untied head
FMS_34B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 22016,
           "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 8,
           "max_position_embeddings": 16384, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu"}
MODEL = {"7b": "llama-2-7b", "13b": "llama-2-13b", "70b": "llama-2-70b"}
LAYERS = {"7b": 32, "13b": 40, "34b": 48, "70b": 80}
GPU = {"a100_80gb": "a100-80gb", "h100_80gb": "h100-80gb"}
SHARDING = {"HSDP": "hsdp", "FSDP": "fsdp"}  # train_utils.py get_policies lines 227-234
# per-node bandwidth (README line 14) -> fabric and NICs (module docstring)
FABRIC = {400: ("roce-200g", 2), 800: ("roce-400g", 2)}
H100_ALTERNATIVE = ("ib-ndr", 2)
# what every request carries: the code's recipe (module docstring, each with its line)
RECIPE = {"precision": "bf16-mixed", "reduce_dtype": "compute", "compile": "model", "loss": "hf",
          "keeps_outputs": False, "optimizer": "adamw", "gradient_clipping": True,
          "attention_kernel": "flash-attention-2", "gradient_accumulation": 1}
ROUNDING = 0.005  # the MFU and HFU are published to two decimals


def p_from_ratio(mfu: float, hfu: float) -> float:
    """fms's selective-AC fraction implied by HFU/MFU = 1 + p/3, clamped to [0, 1]."""
    return min(1.0, max(0.0, 3 * (hfu / mfu - 1)))


def p_range(mfu: float, hfu: float) -> tuple[float, float]:
    """The p the published two-decimal MFU and HFU admit (each within half a unit of its last digit)."""
    return (p_from_ratio(mfu + ROUNDING, hfu - ROUNDING), p_from_ratio(mfu - ROUNDING, hfu + ROUNDING))


def fms_blocks(layers: int, p: float) -> int:
    """How many of ``layers`` blocks fms's apply_fsdp_checkpointing(p) wraps (policies/ac_handler.py
    lines 43-58: block k = 1..L is wrapped when k p reaches the cut-off, which starts at 1/2 and moves
    up by one at each wrapped block)."""
    cut_off, wrapped = 0.5, 0
    for k in range(1, layers + 1):
        if k * p >= cut_off:
            cut_off += 1
            wrapped += 1
    return wrapped


def planner_blocks(layers: int, every: int) -> int:
    """Blocks the planner checkpoints with checkpointing_every N: 0, N, 2N, ... (checkpointed_blocks)."""
    return -(-layers // every)


def every_for(layers: int, p: float) -> int | None:
    """The checkpointing_every N whose block count is nearest fms's for p (None: no checkpointing);
    on a tie the smaller N, the one that checkpoints more (the side that does not overstate speed)."""
    target = fms_blocks(layers, p)
    if target == 0:
        return None
    return min(range(1, layers + 1), key=lambda n: (abs(planner_blocks(layers, n) - target), n))


@dataclass(frozen=True)
class Row:
    line: int
    mfu_line: int
    model: str
    sharding: str
    checkpointing: str
    batch: int
    gpu: str
    gpus: int
    gbps: int
    published: float
    mfu: float
    hfu: float

    @property
    def layers(self) -> int:
        return LAYERS[self.model]

    @property
    def p(self) -> float:
        return p_from_ratio(self.mfu, self.hfu) if self.checkpointing != "No AC" else 0.0

    @property
    def every(self) -> int | None:
        return every_for(self.layers, self.p) if self.checkpointing != "No AC" else None

    def request(self, every: int | None = None, fabric: tuple[str, int] | None = None) -> EstimateRequest:
        """The row as main_training_llama.py runs it; ``every`` and ``fabric`` override the derived
        checkpointing interval and the fabric (the neighbouring N, the H100 alternative)."""
        every = every if every is not None else self.every
        name, nics = fabric or FABRIC[self.gbps]
        model = {"model": MODEL[self.model]} if self.model in MODEL else {"model_config": FMS_34B}
        return EstimateRequest(**model, gpu=GPU[self.gpu], gpus=GPUS_PER_NODE, nodes=self.gpus // GPUS_PER_NODE,
                               strategy=SHARDING[self.sharding], seq_len=SEQ_LEN, micro_batch=self.batch,
                               checkpointing="full" if every else "none",
                               checkpointing_every=every if every and every > 1 else None,
                               fabric=name, nics_per_node=nics, fsdp_version=FSDP1, **RECIPE)


FSDP1 = 1  # the fsdp_version every row ran (module docstring)


def rows() -> list[Row]:
    with DATA.open() as f:
        reader = csv.DictReader(line for line in f if not line.startswith("#"))
        return [Row(int(r["throughput_line"]), int(r["mfu_line"]), r["model"], r["sharding"],
                    r["activation_checkpointing"], int(r["batch_size"]), r["gpu"], int(r["gpus"]),
                    int(r["network_gbps"]), float(r["tokens_per_s_per_gpu"]), float(r["mfu"]), float(r["hfu"]))
                for r in reader]


def predict(request: EstimateRequest):
    """(tokens/s per GPU, the time estimate, the result), or (None, the refusal's message, None)."""
    try:
        result = estimate_with_time(request)
    except PlannerError as e:
        return None, str(e), None
    return result.time.tokens_per_second / result.world_size, result.time, result


def _neighbours(row: Row) -> list[int]:
    """The other checkpointing_every values whose block counts bracket fms's for the derived p."""
    if row.every is None:
        return []
    target, own = fms_blocks(row.layers, row.p), planner_blocks(row.layers, row.every)
    if own == target:
        return []
    return [row.every + 1] if own > target else [row.every - 1]


def _ac_cell(row: Row) -> str:
    if row.every is None:
        return "none"
    low, high = p_range(row.mfu, row.hfu)
    return (f"p {row.p:.2f} ({low:.2f}-{high:.2f}): fms {fms_blocks(row.layers, row.p)}/{row.layers}, "
            f"planner every {row.every} = {planner_blocks(row.layers, row.every)}/{row.layers}")


def report() -> str:
    data = rows()
    results = [(row, *predict(row.request())) for row in data]
    table = ["| line | GPU | model | strategy | selective AC (p from HFU/MFU) | published | predicted | error | "
             "at neighbouring N | MFU pub / pred | HFU pub / pred | reserved / device |",
             "|---:|---|---|---|---|---:|---:|---:|---|---:|---:|---:|"]
    errors: dict[str, list[float]] = {}
    refused = []
    for row, tps, t, res in results:
        head = (f"| {row.line} | {row.gpu} x {row.gpus} | {row.model} | {SHARDING[row.sharding]} | {_ac_cell(row)} | "
                f"{row.published:,.0f} |")
        if tps is None:
            refused.append(row)
            table.append(f"{head} refused: {t} | - | - | {row.mfu:.2f} / - | {row.hfu:.2f} / - | - |")
            continue
        e = (tps - row.published) / row.published
        errors.setdefault(row.gpu, []).append(e)
        others = []
        for n in _neighbours(row):
            other, _, _ = predict(row.request(every=n))
            others.append(f"every {n}: {other:,.0f}" if other is not None else f"every {n}: refused")
        table.append(f"{head} {tps:,.0f} | {e:+.1%} | {'; '.join(others) or '-'} | {row.mfu:.2f} / {t.mfu:.2f} | "
                     f"{row.hfu:.2f} / {t.hfu:.2f} | "
                     f"{res.per_device.reserved_peak_bytes / res.device_capacity_bytes:.0%} |")
    every_error = [e for v in errors.values() for e in v]
    out = [f"Published: IBM fms-fsdp's Llama-2 training throughput table ({len(data)} rows, [source]({SOURCE}), "
           f"lines 14-19 and 25-30); predicted: `planner estimate` of what main_training_llama.py runs, tokens/s per "
           "GPU. No constant fitted to them.", "", f"- all rows: {error_summary(every_error)}"]
    out += [f"- by GPU {gpu}: {error_summary(v)}" for gpu, v in sorted(errors.items())]
    fits = [(row, res.per_device.reserved_peak_bytes / res.device_capacity_bytes) for row, tps, _, res in results
            if tps is not None]
    over = [f"line {row.line} {row.gpu} {row.model} ({share:.0%})" for row, share in fits if share > 1]
    out.append(f"- memory: {len(over)}/{len(fits)} published runs predicted not to fit (reserved peak over the device"
               + (f": {', '.join(over)}" if over else "") + "); every row ran, so each is the memory model's error or "
               "the derived p's (under compile the planner keeps eager's saved tensors, an upper bound)")
    if refused:
        out.append(f"- refused by the planner: {len(refused)} rows (lines {', '.join(str(r.line) for r in refused)})")
    alt = [(row, predict(row.request(fabric=H100_ALTERNATIVE))[0]) for row in data if row.gpu == "h100_80gb"]
    alt_errors = [(tps - row.published) / row.published for row, tps in alt if tps is not None]
    out.append(f"- H100 rows on {H100_ALTERNATIVE[1]} x {H100_ALTERNATIVE[0]} instead of 2 x roce-400g: "
               f"{error_summary(alt_errors)}")
    out += ["", *table, "",
            "p is fms's selective-checkpointing fraction, which the README does not state, from the published "
            "HFU/MFU = 1 + p/3 (in brackets, the p the two-decimal rounding admits); 'fms' is how many blocks "
            "apply_fsdp_checkpointing(p) wraps, 'planner' how many checkpointing_every N wraps (blocks 0, N, 2N, ...). "
            "The published HFU is PyTorch's FLOP counter (the whole attention, its backward at 2.5x the forward); "
            "the planner's HFU counts what FlashAttention runs under the causal mask, so only the MFU columns share a "
            "convention (PaLM's). The README itself says the same scripts and configurations ran on both GPU types "
            "(line 12), yet its ratios imply different p on the A100 and the H100 for the same model, and its prose "
            "gives the A100 13B an MFU of 0.48 (line 32) where the table has 0.61; line 32's 1,600 tokens/s for the 13B "
            "with activation checkpointing turned on is left out, its batch size and p unstated."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from bench.readme import readme_main

    return readme_main(__doc__, "fms-fsdp", report, argv)


if __name__ == "__main__":
    sys.exit(main())
