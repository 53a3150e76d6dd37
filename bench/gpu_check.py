"""The GPU check: predicted vs measured CUDA memory on one GPU, to calibrate the CUDA-specific terms.

    python bench/gpu_check.py [--gpu h200] [--model llama-3-8b] [--layers 2] [--out bench/results/gpu_check.json]

Trains a catalogue model at full width but few layers on one GPU with ZeRO-0 (the DeepSpeed engine
without partitioning, through `deepspeed`) and torch DDP (through torchrun), bf16-mixed, over sequence lengths, micro-batches, checkpointing on and off,
and SDPA and eager attention, and the recipes of issue 21 on one device (RECIPE_GRID: the checkpointing
policies, the kept outputs, the chunked loss, QLoRA under autocast). Every run records torch.cuda.max_memory_allocated, max_memory_reserved
and memory_stats. The script then prints:

- the error of the allocated peak against the prediction, per run;
- reserved minus allocated (allocator rounding and caching) as a fraction of the peak;
- the CUDA context and cuBLAS workspace, read from the driver (total minus free before any tensor,
  from torch.cuda.mem_get_info) and from the first matmul.

Its JSON output is what gpus.yaml's cuda_context_mib and a future allocator term are calibrated
from. It finishes in a few minutes on one H200. It has not yet been run: no GPU was available when
it was written.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.catalogue import catalogue_model  # noqa: E402
from planner.memory import estimate  # noqa: E402
from planner.schema import EstimateRequest  # noqa: E402

GRID = [  # (seq_len, micro_batch, checkpointing, attention)
    (512, 1, "none", "sdpa"), (2048, 1, "none", "sdpa"), (2048, 4, "none", "sdpa"), (4096, 2, "none", "sdpa"),
    (4096, 2, "full", "sdpa"), (8192, 1, "full", "sdpa"), (1024, 2, "none", "eager"), (2048, 1, "full", "eager"),
]

# The recipes of issue 21 on one device (strategy single), each verified on CPU ranks only: the CUDA
# kernels differ (SDPA's CUDA flash op in torchtitan's save list, bitsandbytes' CUDA 4-bit matmul,
# the bool dropout mask), so each gets a GPU row: (seq_len, micro_batch, request fields)
RECIPE_GRID = [  # long enough that activations and logits, not the states, make the peak
    (8192, 2, {"checkpointing": "selective-op"}),
    (8192, 2, {"checkpointing": "selective-attention"}),
    (8192, 2, {"checkpointing": "full", "checkpointing_every": 2}),
    (8192, 1, {"keeps_outputs": True}),
    (8192, 1, {"loss": "chunked"}),
    (8192, 2, {"finetune": "qlora", "checkpointing": "full"}),
    (4096, 2, {"finetune": "qlora", "quantize_base": "fp4", "double_quant": False}),
]


def cuda_context_bytes() -> dict[str, int]:
    import torch

    free_before, total = torch.cuda.mem_get_info()
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    free_after, _ = torch.cuda.mem_get_info()
    return {"total_bytes": total, "used_before_tensors_bytes": total - free_before,
            "used_after_first_matmul_bytes": total - free_after,
            "allocated_after_first_matmul_bytes": torch.cuda.memory_allocated()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    from backend.launch import run_probe

    base = catalogue_model(args.model)
    config = dict(base.config, num_hidden_layers=args.layers)
    results = {"device": torch.cuda.get_device_name(0), "context": cuda_context_bytes(), "runs": []}
    grid = [(s, (seq, micro, ckpt, attention, {})) for s in ("zero0", "ddp") for seq, micro, ckpt, attention in GRID]
    grid += [("single", (seq, micro, fields.get("checkpointing", "none"), "sdpa", fields))
             for seq, micro, fields in RECIPE_GRID]
    for strategy, (seq, micro, ckpt, attention, fields) in grid:
        request = EstimateRequest(model_config=config, strategy=strategy, gpus=1, gpu=args.gpu, precision="bf16-mixed",
                                  micro_batch=micro, seq_len=seq, attention=attention,
                                  **({"checkpointing": ckpt} | fields))
        predicted = estimate(request).per_device
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            run = run_probe(request, out_dir=Path(tmp), steps=2, warmup_steps=1, timeout_seconds=300)
        rank = run.ranks[0] if run.ranks else {}
        row = {"strategy": strategy, "seq_len": seq, "micro_batch": micro, "checkpointing": ckpt, "attention": attention,
               "recipe": {k: v for k, v in fields.items() if k != "checkpointing"},
               "status": run.status, "seconds": time.monotonic() - started,
               "predicted_peak_bytes": predicted.peak_bytes - predicted.framework_bytes,
               "measured_allocated_peak_bytes": rank.get("peak_bytes"),
               "measured_reserved_peak_bytes": rank.get("reserved_peak_bytes"),
               "memory_stats": rank.get("memory_stats")}
        if run.status == "ok":
            row["error_pct"] = 100 * (row["predicted_peak_bytes"] - row["measured_allocated_peak_bytes"]) / \
                row["measured_allocated_peak_bytes"]
            row["reserved_over_allocated"] = row["measured_reserved_peak_bytes"] / row["measured_allocated_peak_bytes"] - 1
            print(f"{strategy:<5} seq {seq:>5} mb {micro} ckpt {ckpt:<4} {attention:<5}: allocated peak error {row['error_pct']:+.2f}%, "
                  f"reserved +{100 * row['reserved_over_allocated']:.1f}%")
        else:
            print(f"{strategy:<5} seq {seq:>5} mb {micro} ckpt {ckpt:<4} {attention:<5}: {run.status}: {run.message}")
        results["runs"].append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"context: {results['context']}; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
