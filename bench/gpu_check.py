"""The GPU check: predicted vs measured CUDA memory on one GPU, to calibrate the CUDA-specific terms.

    python bench/gpu_check.py [--gpu h200] [--model llama-3-8b] [--layers 2] [--out bench/results/gpu_check.json]

Trains a catalogue model at full width but few layers on one GPU with ZeRO-0 (the DeepSpeed engine
without partitioning, through `deepspeed`) and torch DDP (through torchrun), bf16-mixed, over sequence lengths, micro-batches, checkpointing on and off,
and SDPA and eager attention, and the recipes of issue 21 on one device (RECIPE_GRID: the checkpointing
policies, the kept outputs, the chunked losses (torchtune's and torchtitan's), QLoRA under autocast, every optimizer of the registry and the
step in backward, activation offloading, Liger's and Cut Cross-Entropy's fused losses, torchao's float8 and MXFP8 linears; needs
liger-kernel, cut-cross-entropy and torchao installed on the GPU machine), and the bf16 and fp8 matmul rates
(matmul_tflops) the time model's low-precision speed-up reads from gpus.yaml. Every run records torch.cuda.max_memory_allocated, max_memory_reserved
and memory_stats. The script then prints:

- the error of the allocated peak against the prediction, per run;
- reserved minus allocated (allocator rounding and caching) as a fraction of the peak;
- the CUDA context and cuBLAS workspace, read from the driver (total minus free before any tensor,
  from torch.cuda.mem_get_info) and from the first matmul; and per run the training process's own
  (measured_context_bytes: device used minus torch's reserved at the end of its timed steps).

Its JSON output is what the CUDA context (gpus.yaml's cuda_context_mib, data/cuda_context.yaml) is
calibrated from: the device's used memory after the first matmul minus torch's reserved segments. It finishes in a few
minutes on one H200 when given the whole grid; a short lease measures the rows in PRIORITY order
within --budget-seconds (the first lease, 2026-12-04: bench/results/gpu_check_h200_*.json).

The caching allocator (issue 24): every grid run is made twice, with PYTORCH_CUDA_ALLOC_CONF unset
and with expandable_segments:True, and records allocated, active and reserved peaks
(torch.cuda.memory_stats: allocated_bytes / active_bytes / reserved_bytes .all.peak) beside the
simulator's (planner/memory/reserved.py). Then the allocation sequences of tests/test_allocator.py and
each run's simulated allocation stream are replayed with real tensors (torch.empty on CUDA streams,
record_stream on a stream kept busy) under both settings: the simulator's segment counts and
reserved peaks against the device's. Finally it writes the calibration the planner reads,
planner/data/allocator_calibration.json (--calibration), in this format:

    {"format": 1, "torch": "2.13.0", "gpus": {"<gpu name of gpus.yaml>": {
        "cuda_context_bytes": int,          # device memory used after the first matmul, minus reserved
        "nccl_bytes_per_communicator": int | null,   # null: not measured (one GPU, no communicator)
        "driver": "<nvidia driver version>", "cuda": "<torch.version.cuda>", "device": "<device name>",
        "runs": [{"strategy", "seq_len", ..., "alloc_conf",
                  "measured_{allocated,active,reserved}_peak_bytes",
                  "simulated_{allocated,active,reserved}_peak_bytes"}],
        "sequences": [{"name", "alloc_conf", "simulated_reserved_peak_bytes",
                       "measured_reserved_peak_bytes", "simulated_segments", "measured_segments"}]}}}

The time model's kernel claims (issue 22), measured first: bf16 GEMMs of one full wave of 128 x 256
tiles over K = 256 ... 16,384 against planner/time/kernels.py's K-loop curve (K0 scaled by the
GPU's FLOP per byte, from NVIDIA's A100 figure), timed replayed from a CUDA graph (device time; the
eager calls' rate is kept beside it), and SDPA's causal flash attention forward and backward
TFLOP/s at head 128 over 8,192 tokens at each length against FORWARD_OVER_BACKWARD_RATE; printed and
kept under "kernels". FSDP2's copy-out and copy-in of one Llama-3-8B block against the modelled seconds
("fsdp2_copies"), async TP's partial-output sum and shard copy ("async_tp"), and the host's side of a step
(bench/host_hooks.py on this GPU: seconds per eager op against kernels.HOST_SECONDS_PER_KERNEL, ZeRO-3's and
FSDP2's own Python against the CPU ranks' record the model charges: "host_hooks"), and flash attention's varlen
bookkeeping, MPT's unpad and pad per layer with its host synchronisations, against the bytes and stalls the model
charges ("unpad"). Then a transformer
block's GEMMs, sustained for --sustained-seconds (30), per
one-second window with the SM clock and power nvidia-smi reports ("sustained_matmul"): whether the
rates measured in a burst hold through a step. And one Llama-3-8B and one MPT-7B block's elementwise
kernels, forward and backward, timed by torch.profiler against planner/time/elementwise.py ("elementwise").

When the file has an entry for the estimate's GPU, planner/memory/reserved.py uses its cuda_context_bytes
(and nccl_bytes_per_communicator, unless NCCL_BUFFSIZE is given), and the estimate's allocator
summary says measured: true.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import replace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.memory import orchestrator as memory  # noqa: E402
from planner.memory import reserved
from planner.memory.allocator import parse_alloc_conf, replay  # noqa: E402
from planner.model.catalogue import catalogue_model  # noqa: E402
from planner.memory.orchestrator import estimate  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.schema import EstimateRequest  # noqa: E402
from planner.time.step import estimate_with_time  # noqa: E402

ALLOC_CONFS = ("", "expandable_segments:True")
MIB = 2**20
# hand-derived sequences of tests/test_allocator.py: (name, events); replayed on the device under each setting
SEQUENCES = [
    ("small packing", [("malloc", i, 1000) for i in range(4)]),
    ("small overflow", [("malloc", i, MIB) for i in range(3)]),
    ("medium 20 MiB segments", [("malloc", i, 3 * MIB) for i in range(7)]),
    ("best fit and split", [("malloc", "a", 30 * MIB), ("malloc", "b", 30 * MIB), ("free", "a"),
                            ("malloc", "c", 25 * MIB)]),
    ("fragmentation", [("malloc", "big", 100 * MIB), ("free", "big"), ("malloc", "a", 60 * MIB),
                       ("malloc", "b", 40 * MIB), ("free", "a"), ("malloc", "c", 70 * MIB)]),
    ("separate streams", [("malloc", "ag", 50 * MIB, "all_gather"), ("free", "ag"), ("malloc", "x", 50 * MIB)]),
    ("record_stream", [("malloc", "a", 50 * MIB), ("record", "a", "reduce_scatter"), ("free", "a"),
                       ("malloc", "b", 50 * MIB)]),
]

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
    # torchtitan's ChunkedLossWrapper (backend/losses.py InForwardChunkedLoss): on a GPU each chunk's backward runs
    # on autograd's device thread and the allocator caches the chunks' blocks, where the CPU runs measured neither
    (8192, 1, {"loss": "chunked-in-forward"}),
    (8192, 2, {"finetune": "qlora", "checkpointing": "full"}),
    (4096, 2, {"finetune": "qlora", "quantize_base": "fp4", "double_quant": False}),
    # the optimizers (planner/recipes/optimizers.py) at 512 tokens, where the states and the step make the
    # peak: on CUDA bitsandbytes' fused kernels, its paged states (cudaMallocManaged, outside the caching
    # allocator: measured allocated excludes them, so the prediction's bound shows as over), torchao's
    # compiled step, Adafactor's foreach var_estimates and Muon's Newton-Schulz run where CPU runs could not
    *[(512, 1, {"optimizer": name}) for name in ("adamw-8bit", "adamw-paged-8bit", "adamw-torchao-8bit",
                                                 "adamw-torchao-4bit", "adafactor", "lion", "sgd-momentum", "muon")],
    (512, 1, {"optimizer_in_backward": True}),
    # LoRA on an LLM.int8 base under autocast: CUDA's MatMul8bitLt (fp32 outputs, subA outliers, the
    # inputs checkpointing does not drop), where the CPU runs measured MatMul8bitFp
    (4096, 2, {"finetune": "qlora", "quantize_base": "int8"}),
    (8192, 2, {"finetune": "qlora", "quantize_base": "int8", "checkpointing": "full", "train_embeddings": True}),
    # the loss kernels (planner/recipes/losses.py; Triton, never run on CPU ranks): Liger's fused linear
    # cross-entropy under autocast, Cut Cross-Entropy on a bf16 model (its backward takes bf16 hidden states)
    (8192, 1, {"loss": "liger-fused"}),
    (8192, 2, {"loss": "liger-fused", "precision": "bf16-pure"}),
    (8192, 1, {"loss": "cce", "precision": "bf16-pure"}),
    # flash-attn's cross-entropy as llm-foundry runs it (compute-dtype logits, Composer's loop keeping the
    # outputs), and torch's single-tensor AdamW (composer's DecoupledAdamW: two copies of the largest tensor)
    (8192, 1, {"loss": "flash-attn", "keeps_outputs": True}),
    (512, 1, {"optimizer": "adamw-single-tensor"}),
    # low-precision linears (planner/recipes/low_precision.py): torchao float8 everywhere fp8 exists, MXFP8
    # on Blackwell only (a row the estimate refuses for the --gpu is skipped with its reason)
    (4096, 2, {"low_precision": "float8-tensorwise"}),
    (4096, 2, {"low_precision": "float8-rowwise"}),
    # FSDP2 on one rank (world 1, a real all-gather over one member) gathering the float8 weights in fp8
    # (float8_all_gather): the gathered and prefetched blocks at 1 byte per converted weight element
    (4096, 2, {"low_precision": "float8-tensorwise", "strategy": "fsdp", "float8_all_gather": True}),
    (4096, 2, {"low_precision": "mxfp8"}),
    # activation offloading (TRL's OffloadActivations, backend/offload.py): on a GPU the device peak is the
    # split the CPU runs cannot see (the loss's and one block's saved set, the repeated saves); the bytes TRL
    # copied (measured_offloaded_bytes) against the host-link bytes predicted; the step's seconds against
    # the same run without offloading (the host-link term, planner/time/step.py)
    (8192, 2, {"activation_offload": True}),
    (8192, 2, {"activation_offload": True, "checkpointing": "full"}),
    # Liger's block kernels (planner/recipes/fused_kernels.py; Triton, never run on CPU ranks): the fused RMSNorm's
    # input and fp32 rstd, the in-place rotary, the SiLU-mul's gate and up, patched into the instance as HF
    # Trainer's use_liger_kernel does (backend/fused_kernels.py); the step's seconds against the eager row
    (8192, 1, {"fused_kernels": ("rms_norm", "rope", "swiglu")}),
    (8192, 2, {"fused_kernels": ("rms_norm",), "precision": "bf16-pure"}),
]
# matmul rates the time model reads from gpus.yaml (mamf_tflops, peak_tflops fp8) for low_precision:
# (dtype, m = n = k), measured as the best of a few shapes would be (Bekman's mamf-finder uses many)
MATMUL_SHAPES = (4096, 8192, 16384)


# which rows a short lease measures first: what no CPU run can check (the CUDA allocator's peak on the
# plain grid, then the GPU-only kernels and CUDA code paths of the recipes), then the second allocator
# setting, then DeepSpeed's engine (its FusedAdam compiles with nvcc on first use)
GPU_ONLY_RECIPES = ("loss", "low_precision", "finetune", "activation_offload", "fused_kernels")
# the package each recipe value trains through (backend/), found or not on the GPU machine
PACKAGES = {("loss", "liger-fused"): "liger_kernel", ("loss", "cce"): "cut_cross_entropy",
            ("loss", "flash-attn"): "flash_attn",
            ("finetune", "qlora"): "bitsandbytes", ("activation_offload", True): "trl",
            ("optimizer", "adamw-8bit"): "bitsandbytes", ("optimizer", "adamw-paged-8bit"): "bitsandbytes",
            ("optimizer", "lion"): "bitsandbytes", ("optimizer", "adamw-torchao-8bit"): "torchao",
            ("optimizer", "adamw-torchao-4bit"): "torchao"}


def missing_packages(strategy: str, fields: dict) -> list[str]:
    import importlib.util

    needed = {PACKAGES[(k, v)] for k, v in fields.items() if (k, v) in PACKAGES}
    if fields.get("low_precision", "none") != "none":
        needed.add("torchao")
    if fields.get("finetune"):
        needed.add("peft")
    if fields.get("fused_kernels"):
        needed.add("liger_kernel")
    if strategy.startswith("zero"):
        needed.add("deepspeed")
    return sorted(n for n in needed if importlib.util.find_spec(n) is None)


def priority(entry: tuple) -> tuple:
    strategy, (seq, micro, ckpt, attention, fields), conf, _ = entry
    gpu_only = any(k in GPU_ONLY_RECIPES for k in fields)
    return (conf != "", strategy.startswith("zero"), strategy == "single" and not gpu_only)


def prioritized(entries: list[tuple]) -> list[tuple]:
    return sorted(entries, key=priority)  # stable: the grid's own order within a priority


def _log_tail(out_dir: Path) -> str:
    texts = []
    for name in ("launcher.log", "supervisor.log"):
        path = out_dir / name
        if path.exists():
            texts.append(f"--- {name}\n" + path.read_text(errors="replace")[-6000:])
    return "\n".join(texts)


def cuda_context_bytes() -> dict[str, int]:
    import torch

    free_before, total = torch.cuda.mem_get_info()
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    free_after, _ = torch.cuda.mem_get_info()
    return {"total_bytes": total, "used_before_tensors_bytes": total - free_before,
            "used_after_first_matmul_bytes": total - free_after,
            "allocated_after_first_matmul_bytes": torch.cuda.memory_allocated(),
            "reserved_after_first_matmul_bytes": torch.cuda.memory_reserved(),
            "module_loading": os.environ.get("CUDA_MODULE_LOADING", "")}  # torch sets LAZY at its CUDA init


def simulated(events: list[tuple], alloc_conf: str) -> dict:
    s = replay(events, parse_alloc_conf(alloc_conf))
    return {"simulated_allocated_peak_bytes": s.allocated_peak_bytes, "simulated_active_peak_bytes": s.active_peak_bytes,
            "simulated_reserved_peak_bytes": s.reserved_peak_bytes, "simulated_segments": s.segments_peak}


def step_events(request: EstimateRequest) -> list[tuple]:
    """The allocation stream planner/memory/reserved.py replays for this request."""
    setup = memory.resolve(request)
    acts = memory.activations(setup)
    plan = setup.framework.phases(setup, acts, memory._numels(setup))
    return reserved.allocation_events(setup, plan, len(memory._numels(setup)), reserved.loss_tensors(setup, acts))


def peaks(stats: dict) -> dict:
    """The three peaks of torch.cuda.memory_stats()."""
    return {f"measured_{name}_peak_bytes": int(stats.get(f"{name}_bytes.all.peak", 0))
            for name in ("allocated", "active", "reserved")}


def replay_on_cuda(events: list[tuple], alloc_conf: str) -> dict:
    """The events with real tensors: malloc = torch.empty on the named stream; record = a busy
    stream (torch.cuda._sleep) and Tensor.record_stream; complete = that stream's synchronize."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._set_allocator_settings(alloc_conf or "expandable_segments:False")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()
    streams: dict = {"default": torch.cuda.current_stream()}
    live: dict = {}
    for event in events:
        op = event[0]
        if op == "malloc":
            name = event[3] if len(event) > 3 else "default"
            stream = streams.setdefault(name, torch.cuda.Stream())
            with torch.cuda.stream(stream):
                live[event[1]] = torch.empty(event[2], dtype=torch.uint8, device="cuda")
        elif op == "record":
            stream = streams.setdefault(event[2], torch.cuda.Stream())
            with torch.cuda.stream(stream):
                torch.cuda._sleep(50_000_000)  # still running when the tensor is freed below
            live[event[1]].record_stream(stream)
        elif op == "free":
            del live[event[1]]
        elif op == "complete":
            streams.setdefault(event[1], torch.cuda.Stream()).synchronize()
    stats = torch.cuda.memory_stats()
    live.clear()
    torch.cuda.synchronize()
    out = peaks(stats)
    out["measured_segments"] = int(stats.get("segment.all.peak", 0)) - int(base.get("segment.all.current", 0))
    return out


def calibration(results: dict, gpu: str, torch_version: str) -> dict:
    """The file planner/memory/reserved.py reads, from this check's results (format in the docstring)."""
    context = results["context"]
    # the context: what the device uses beyond torch's segments (the cuBLAS workspaces the matmul
    # allocated are in the segments: planner/cluster/cuda_context.py counts them apart)
    entry = {"cuda_context_bytes": context["used_after_first_matmul_bytes"]
             - context["reserved_after_first_matmul_bytes"],
             "module_loading": context.get("module_loading", ""),
             "nccl_bytes_per_communicator": results.get("nccl_bytes_per_communicator"),
             "driver": results.get("driver", ""), "cuda": results.get("cuda", ""), "device": results["device"],
             "runs": [r for r in results["runs"] if r.get("status") == "ok"],
             "sequences": results.get("sequences", [])}
    return {"format": 1, "torch": torch_version, "gpus": {gpu: entry}}


def _cuda_seconds(fn, repeat: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def _graph_seconds(fn, repeat: int = 20) -> float:
    """Device seconds of one call of ``fn``, replayed from a CUDA graph of ``repeat`` calls: a
    kernel shorter than the host's launch cost is timed by itself, not by the launches (eager
    calls of a @ b timed back to back on the H200 took a flat 21.4-22.9 µs each from K = 256 to
    1,024: bench/results/gpu_check_h200_1.json)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    return _cuda_seconds(graph.replay, repeat=5) / repeat


def _sdpa_backends(q, k_, v, grad, flops: float, r, seq: int) -> dict:
    """Which kernel SDPA's default ran (planner/time/kernels.py HOPPER_ATTENTION_TFLOPS): each backend
    timed alone (cuDNN, torch's FlashAttention-2), forward and backward, beside the model's
    forward + backward for the kernel it stands for; a backend that refuses the shape is left out."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from planner.time import kernels

    out = {}
    for name, backend, kernel in (("cudnn", SDPBackend.CUDNN_ATTENTION, "cudnn"),
                                  ("flash", SDPBackend.FLASH_ATTENTION, "flash-attention-2")):
        try:
            with sdpa_kernel([backend]):
                fwd = _cuda_seconds(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True))
                bwd = _cuda_seconds(lambda: torch.autograd.grad(
                    F.scaled_dot_product_attention(q, k_, v, is_causal=True), (q, k_, v), grad)) - fwd
        except RuntimeError as e:  # no kernel of this backend for the shape or build
            out[name] = {"error": str(e).splitlines()[0]}
            continue
        try:
            modelled = kernels.attention_tflops(r, seq, 128, kernel)
        except PlannerError:  # cuDNN is modelled on Hopper only
            modelled = None
        out[name] = {"forward_tflops": flops / fwd / 1e12,
                     "backward_tflops": kernels.ATTENTION_BACKWARD_FLOPS * flops / bwd / 1e12,
                     "forward_backward_tflops": (1 + kernels.ATTENTION_BACKWARD_FLOPS) * flops / (fwd + bwd) / 1e12,
                     "modelled_forward_backward_tflops": modelled}
        print(f"  SDPA {name} alone, seq {seq}: forward {out[name]['forward_tflops']:.0f}, backward "
              f"{out[name]['backward_tflops']:.0f}, together {out[name]['forward_backward_tflops']:.0f} TFLOP/s "
              f"(modelled {kernel}: {modelled})")
    return out


def check_kernels(gpu_name: str) -> dict:
    """Measured against modelled: the K loop's share of a GEMM, and attention's forward/backward split."""
    import torch
    import torch.nn.functional as F

    from planner.cluster.gpus import load_gpus
    from planner.time import kernels

    r = kernels.rates(load_gpus()[gpu_name], "bf16")
    m, n = float(kernels.TILE_TOKENS * (r.sms or 1)), kernels.TILE_FEATURES
    gemms = []
    for k in (256, 512, 1024, 2048, 4096, 8192, 16384):
        a = torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        eager = 2 * m * n * k / _cuda_seconds(lambda: a @ b) / 1e12
        measured = 2 * m * n * k / _graph_seconds(lambda: a @ b) / 1e12
        modelled = 2 * m * n * k / kernels._gemm_seconds(m, n, k, r, 2) / 1e12
        gemms.append({"k": k, "measured_tflops": measured, "eager_tflops": eager, "modelled_tflops": modelled})
        print(f"GEMM {int(m)} x {n} x {k:>5}: measured {measured:7.1f} TFLOP/s (CUDA graph; eager calls "
              f"{eager:7.1f}), modelled {modelled:7.1f}")
    attention = []
    for seq in (2048, 8192):
        # the same 8,192 tokens at each length (batch 4 at 2k), so that both fill the SMs alike: at
        # batch 1 x 16 heads the 2k kernel has 256 query blocks for 132 SMs, and the timed
        # autograd call's host cost weighs on its 0.2 ms backward
        batch = max(1, 8192 // seq)
        q, k_, v = (torch.randn(batch, 16, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(3))
        flops = batch * 4 * seq * seq * 16 * 128 / 2
        out = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
        grad = torch.randn_like(out)
        fwd = _cuda_seconds(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True))
        bwd = _cuda_seconds(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k_, v, is_causal=True),
                                                        (q, k_, v), grad)) - fwd
        attention.append({"seq": seq, "batch": batch, "forward_tflops": flops / fwd / 1e12,
                          "backward_tflops": kernels.ATTENTION_BACKWARD_FLOPS * flops / bwd / 1e12,
                          "modelled_forward_over_backward": kernels.FORWARD_OVER_BACKWARD_RATE["flash-attention-2"],
                          "cudnn_version": torch.backends.cudnn.version(),
                          "backends": _sdpa_backends(q, k_, v, grad, flops, r, seq)})
        print(f"SDPA causal seq {seq}: forward {attention[-1]['forward_tflops']:.0f} TFLOP/s, backward "
              f"{attention[-1]['backward_tflops']:.0f} (modelled ratio {attention[-1]['modelled_forward_over_backward']:.2f})")
    return {"gemms": gemms, "attention": attention}


# Kernel names of the matmuls and attention in a profile; every other CUDA kernel is elementwise work
NOT_ELEMENTWISE = ("gemm", "cutlass", "xmma", "nvjet", "flash", "fmha", "attention")


def check_elementwise(gpu_name: str, tokens: int = 8192) -> list[dict]:
    """One block of Llama-3-8B and one of MPT-7B (GPT-2's block: fused LayerNorm, exact GELU) at full width,
    forward and backward over ``tokens`` in bf16 under torch.profiler: the CUDA time and count of every kernel
    that is not a GEMM or attention, against planner/time/elementwise.py's bytes at the time model's
    bandwidth and its op count (the model counts dispatched ops: slice_backward, native_layer_norm_backward
    run two kernels each on CUDA). Then the same block under torch.compile (inductor's Triton kernels)
    against planner/time/fusion.py's CUDA regions (block_traffic(..., "triton")): its rotary cat fused into
    the rotary kernel, the norms' weight gradients fused by mix_order_reduction, read off inductor's source
    and never measured. Unverified until this runs: the CPU tests (tests/test_elementwise.py,
    tests/test_fusion.py) check the ops and their bytes, not the kernels' time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig, AutoModelForCausalLM

    from planner.cluster.gpus import load_gpus
    from planner.model.architecture import from_hf_config, layer_specs
    from planner.time import fusion, kernels
    from planner.time.elementwise import block_traffic

    r = kernels.rates(load_gpus()[gpu_name], "bf16")
    out = []
    llama = catalogue_model("llama-3-8b").config
    mpt = {"model_type": "gpt2", "n_embd": 4096, "n_head": 32, "n_layer": 1, "vocab_size": 50368,
           "activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    runs = [(name, config, compiled) for compiled in ("none", "blocks")
            for name, config in (("llama-3-8b", dict(llama, num_hidden_layers=1)), ("mpt-7b (gpt2 block)", mpt))]
    for name, config, compiled in runs:
        hf = AutoConfig.for_model(**config)
        hf._attn_implementation = "sdpa"
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(hf).to(torch.bfloat16)
        x = torch.randn(1, tokens, hf.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if config["model_type"] == "gpt2":
            block, kwargs = model.transformer.h[0], {}
        else:
            positions = torch.arange(tokens, device="cuda")[None]
            block = model.model.layers[0]
            kwargs = {"position_ids": positions, "position_embeddings": model.model.rotary_emb(x, positions)}

        run = block if compiled == "none" else torch.compile(block)

        def step():
            y = run(x, **kwargs)
            (y[0] if isinstance(y, tuple) else y).backward(torch.ones_like(x))

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        elementwise = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and not any(k in e.name.lower() for k in NOT_ELEMENTWISE)]
        arch = from_hf_config(config)
        spec = layer_specs(arch)[0]
        t = block_traffic(arch, spec, 1, False, 2) if compiled == "none" else \
            fusion.block_traffic(arch, spec, 1, False, 2, "triton")
        row = {"model": name, "compiled": compiled, "tokens": tokens, "measured_seconds": sum(e.time_range.elapsed_us() for e in elementwise) / 1e6,
               "measured_kernels": len(elementwise),
               # bytes at the copy rate: the pieces measured below it (the eager norms and rotary, Liger's
               # published baselines: elementwise.py COMPOSITE_NORM_RATES) carry their excess
               "modelled_seconds": (t.forward_seconds_bytes + t.backward_seconds_bytes) * tokens / r.memory_bytes_per_s,
               "modelled_seconds_at_copy_rate": (t.forward_bytes + t.backward_bytes) * tokens / r.memory_bytes_per_s,
               "modelled_ops": t.forward_kernels + t.backward_kernels,
               "kernels": sorted({e.name[:80] for e in elementwise})}
        out.append(row)
        print(f"elementwise {name} (compile {compiled}), {tokens} tokens: measured {row['measured_seconds'] * 1e3:.2f} ms in "
              f"{row['measured_kernels']} kernels, modelled {row['modelled_seconds'] * 1e3:.2f} ms in {row['modelled_ops']} ops")
        del model, block, run, x
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return out


def grid_requests(config: dict, gpu: str) -> list[tuple]:
    """Every run of the check: (strategy, (seq_len, micro_batch, checkpointing, attention, recipe
    fields), PYTORCH_CUDA_ALLOC_CONF, the EstimateRequest), each grid row under each allocator setting."""
    grid = [(s, (seq, micro, ckpt, attention, {})) for s in ("zero0", "ddp") for seq, micro, ckpt, attention in GRID]
    grid += [(fields.get("strategy", "single"), (seq, micro, fields.get("checkpointing", "none"), "sdpa", fields))
             for seq, micro, fields in RECIPE_GRID]
    return [(strategy, row, conf, request_for(config, gpu, strategy, row, conf))
            for strategy, row in grid for conf in ALLOC_CONFS]


def request_for(config: dict, gpu: str, strategy: str, row: tuple, conf: str) -> EstimateRequest:
    """One run's request: row = (seq_len, micro_batch, checkpointing, attention, recipe fields)."""
    return EstimateRequest(**{
        "model_config": config, "strategy": strategy, "gpus": 1, "gpu": gpu, "precision": "bf16-mixed",
        "micro_batch": row[1], "seq_len": row[0], "attention": row[3], "alloc_conf": conf or None,
        "checkpointing": row[2]} | row[4])


def check_sequences(requests: list[EstimateRequest]) -> list[dict]:
    rows = []
    named = SEQUENCES + [(f"step: {r.strategy} seq {r.seq_len} mb {r.micro_batch} ckpt {r.checkpointing}",
                          step_events(r)) for r in requests]
    for name, events in named:
        for conf in ALLOC_CONFS:
            row = {"name": name, "alloc_conf": conf, **simulated(events, conf), **replay_on_cuda(events, conf)}
            print(f"{name:<44} {conf or 'default':<26} reserved simulated {row['simulated_reserved_peak_bytes']:>14,} "
                  f"measured {row['measured_reserved_peak_bytes']:>14,}; segments {row['simulated_segments']} vs "
                  f"{row['measured_segments']}")
            rows.append(row)
    return rows


def matmul_tflops() -> dict[str, float]:
    """The achieved bf16 and fp8 (torch._scaled_mm, e4m3 with tensorwise scales) matmul TFLOP/s on
    this GPU, best over MATMUL_SHAPES: the time model's fp8/bf16 rate ratio (planner/time/kernels.py
    LowPrecisionRate) against the device's."""
    import torch

    out: dict[str, float] = {}
    for dtype in ("bf16", "fp8"):
        best = 0.0
        for n in MATMUL_SHAPES:
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            if dtype == "fp8":
                if not hasattr(torch, "float8_e4m3fn") or torch.cuda.get_device_capability() < (8, 9):
                    break
                one = torch.ones((), device="cuda")
                a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()

                def mm():
                    return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            else:
                def mm():
                    return a @ b
            for _ in range(3):
                mm()
            torch.cuda.synchronize()
            start, reps = time.perf_counter(), 20
            for _ in range(reps):
                mm()
            torch.cuda.synchronize()
            best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12)
        if best:
            out[dtype] = best
    return out


# A transformer block's GEMMs at MPT-1B's widths (d_model 2,048, MLP 8,192) over 28,672 tokens (the
# llm-foundry H100 rows' micro-batch of 56 x 512 and 14 x 2,048): the published rows' "rest of the step"
# runs 8-20% slower than the time model's rates say (bench/published_throughput.py, "Where the error
# sits"), and one isolated GEMM measured at the MAMF here; this runs the block's forward, input-gradient
# and weight-gradient GEMMs back to back for a sustained while, as training does.
SUSTAINED_TOKENS, SUSTAINED_LINEARS = 28672, ((2048, 6144), (2048, 2048), (2048, 8192), (8192, 2048))


def _smi(fields: str) -> list[str]:
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=10)
        return [x.strip() for x in done.stdout.strip().splitlines()[0].split(",")] if done.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return []


def _driver() -> str:
    return (_smi("driver_version") or [""])[0]


def sustained_matmul(gpu_name: str, seconds: float) -> dict:
    """The block's GEMMs (SUSTAINED_LINEARS, each forward, input gradient and weight gradient) replayed
    from one CUDA graph for ``seconds``: TFLOP/s per one-second window with the SM clock, power draw
    and throttle reasons nvidia-smi reports after it, against the rate planner/time/kernels.py models
    for the same GEMMs. Whether a sustained step runs below the first second's rate (power or thermal
    clock limits) is what the published rows' slower "rest" asks."""
    import torch

    from planner.cluster.gpus import load_gpus
    from planner.time import kernels

    r = kernels.rates(load_gpus()[gpu_name], "bf16")
    m = SUSTAINED_TOKENS
    shapes = [s for d_in, d_out in SUSTAINED_LINEARS for s in ((m, d_out, d_in), (m, d_in, d_out), (d_in, d_out, m))]
    flops = sum(2.0 * a * b * c for a, b, c in shapes)
    modelled = flops / sum(kernels._gemm_seconds(a, b, c, r, 2) for a, b, c in shapes) / 1e12
    # the same GEMMs at their burst rates, without the sustained ceiling (gpus.yaml sustained_tflops)
    burst = replace(r, sustained_flops=None)
    burst_modelled = flops / sum(kernels._gemm_seconds(a, b, c, burst, 2) for a, b, c in shapes) / 1e12
    operands = [(torch.randn(a, c, device="cuda", dtype=torch.bfloat16),
                 torch.randn(c, b, device="cuda", dtype=torch.bfloat16)) for a, b, c in shapes]

    def block():
        for x, w in operands:
            x @ w

    per_call = _graph_seconds(block, repeat=4)
    graph_calls = max(1, int(0.25 / per_call))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            block()
    windows, started = [], time.monotonic()
    while time.monotonic() - started < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replays = max(1, int(1.0 / (per_call * graph_calls)))
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        tflops = flops * graph_calls * replays / (start.elapsed_time(end) / 1e3) / 1e12
        smi = _smi("clocks.sm,power.draw,clocks_throttle_reasons.active")
        windows.append({"at_seconds": time.monotonic() - started, "tflops": tflops, "nvidia_smi": smi})
        print(f"sustained block GEMMs at {windows[-1]['at_seconds']:5.1f} s: {tflops:6.1f} TFLOP/s "
              f"(modelled {modelled:.1f}, as a burst {burst_modelled:.1f}); SM MHz, W, throttle: {smi}")
    return {"tokens": m, "linears": SUSTAINED_LINEARS, "modelled_tflops": modelled,
            "burst_modelled_tflops": burst_modelled, "windows": windows,
            "power_limit": _smi("power.limit,clocks.max.sm")}


def fsdp2_copies(gpu_name: str, world: int = 8) -> dict:
    """FSDP2's copies on the compute stream (planner/frameworks/torch/v2.py compute_stream_copies) for one
    Llama-3-8B block as one rank of ``world`` runs them: the all-gather output split into the block's
    parameters (torch.ops.fsdp.split_with_sizes_copy, bf16) and the block's bf16 gradients concatenated
    into the reduce-scatter input (torch.ops.fsdp.chunk_cat, in bf16 and in fp32), each timed from a CUDA
    graph against the seconds the time model charges (bytes at the achievable memory bandwidth)."""
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 (registers torch.ops.fsdp)

    from planner.cluster.gpus import load_gpus
    from planner.time import kernels

    bandwidth = kernels.rates(load_gpus()[gpu_name], "bf16").memory_bytes_per_s
    h, kv, mlp = 4096, 1024, 14336  # Llama-3-8B: the block's seven matrices and two norms
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (mlp, h), (mlp, h), (h, mlp), (h,), (h,)]
    numels = [int(torch.Size(x).numel()) for x in shapes]
    shard = [-(-n // world) for n in numels]  # each parameter's padded shard on a rank (dim-0 sharding)
    out: dict[str, dict] = {}
    gathered = torch.empty(world * sum(shard), dtype=torch.bfloat16, device="cuda")
    params = [torch.empty(world * k, dtype=torch.bfloat16, device="cuda") for k in shard]
    views = [p.view(world, -1) for p in params]

    def copy_out():
        torch.ops.fsdp.split_with_sizes_copy(gathered.view(world, -1), shard, dim=1, out=views)

    seconds = _graph_seconds(copy_out)
    out["all-gather copy-out"] = {"measured_s": seconds, "modelled_s": 2 * gathered.numel() * 2 / bandwidth}
    grads = [torch.randn(world * k, dtype=torch.bfloat16, device="cuda") for k in shard]
    for name, dtype, size in (("reduce-scatter copy-in (bf16)", torch.bfloat16, 2),
                              ("reduce-scatter copy-in (fp32)", torch.float32, 4)):
        flat = torch.empty(world * sum(shard), dtype=dtype, device="cuda")

        def copy_in(flat=flat):
            torch.ops.fsdp.chunk_cat(grads, 0, world, out=flat.view(world, -1))

        out[name] = {"measured_s": _graph_seconds(copy_in), "modelled_s": flat.numel() * (2 + size) / bandwidth}
    for name, row in out.items():
        print(f"FSDP2 {name}: {row['measured_s'] * 1e6:.0f} µs measured, {row['modelled_s'] * 1e6:.0f} µs modelled")
    return out


def async_tp_kernels(gpu_name: str, tp: int = 8, tokens: int = 8192, hidden: int = 8192) -> dict:
    """Async TP's own kernels on the compute stream (planner/time/step.py _async_tp_seconds), for one
    sequence-parallel collective of a Llama-3-70B block at 8,192 tokens and tp 8: the reduce-scatter's sum of its tp
    partial outputs (torch 2.13 _fused_matmul_reduce_scatter_impl: stacked_partials viewed (tp, M/tp, N), summed
    over the first dimension) and the all-gather's local shard copied into the symmetric-memory workspace, each
    timed from a CUDA graph against the seconds the time model charges. The overlap itself (each shard's
    transfer beside the matmul of the one before) needs two or more GPUs over NVLink: not measured here."""
    import torch

    from planner.cluster.gpus import load_gpus
    from planner.time import kernels

    bandwidth = kernels.rates(load_gpus()[gpu_name], "bf16").memory_bytes_per_s
    partials = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    shard = torch.randn(tokens // tp, hidden, dtype=torch.bfloat16, device="cuda")
    workspace = torch.empty_like(shard)
    message = partials.numel() * partials.element_size()
    out = {"reduce-scatter partial sum": {
               "measured_s": _graph_seconds(lambda: partials.view(tp, tokens // tp, hidden).sum(0)),
               "modelled_s": message * (1 + 1 / tp) / bandwidth},
           "all-gather local shard copy": {
               "measured_s": _graph_seconds(lambda: workspace.copy_(shard)),
               "modelled_s": 2 * message / tp / bandwidth},
           "overlap": "not measured: needs 2+ GPUs over NVLink (symmetric memory); the time model's overlap is "
                      "unverified"}
    for name, row in out.items():
        if isinstance(row, dict):
            print(f"async TP {name}: {row['measured_s'] * 1e6:.0f} µs measured, {row['modelled_s'] * 1e6:.0f} µs modelled")
    return out


def unpad_bookkeeping(gpu_name: str, batch: int = 12, seq: int = 2048, heads: int = 16, head_dim: int = 128,
                      layers: int = 8) -> dict:
    """flash attention's varlen bookkeeping (schema attention_unpad, planner/time/kernels.py UNPAD) as MPT's
    flash_attn_fn runs it, without flash-attn: per layer, bert_padding's unpad_input for q, k and v (the mask's sum,
    nonzero, max().item(), cumsum, pad, a gather) and pad_input for the output (zeros, index_put), forward and
    backward, between two GEMMs of a 1b block, eager and timed end to end (the host synchronisations are the point),
    against the same layers without it. The difference is set beside what the model charges: the bytes at the copy
    rate and the stalls at HOST_SECONDS_PER_KERNEL per synchronisation and launch."""
    import torch

    from planner.cluster.gpus import load_gpus
    from planner.model.architecture import from_hf_config
    from planner.time import kernels

    d = heads * head_dim
    tokens = batch * seq
    x = torch.randn(tokens, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.randn(d, 3 * d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    mask = torch.ones(batch, seq, dtype=torch.bool, device="cuda")

    def unpad(t):  # bert_padding.unpad_input's work on an all-ones mask, as llm-foundry calls it per tensor
        seqlens = mask.sum(dim=-1, dtype=torch.int32)
        indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
        int(seqlens.max().item())
        torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
        return t.gather(0, indices[:, None].expand(-1, t.shape[1])), indices

    def layer(unpadded: bool):
        h = x
        for _ in range(layers):
            q, k, v = (h @ w).chunk(3, dim=-1)
            if unpadded:
                (q, indices), (k, _), (v, _) = unpad(q), unpad(k), unpad(v)
                out = torch.zeros_like(x)
                h = out.index_put((indices,), q + k + v)
            else:
                h = q + k + v
        h.float().sum().backward()

    seconds = {name: _cuda_seconds(lambda unpadded=unpadded: layer(unpadded), repeat=5)
               for name, unpadded in (("padded", False), ("unpadded", True))}
    r = kernels.rates(load_gpus()[gpu_name], "bf16")
    arch = from_hf_config({"model_type": "gpt2", "n_embd": d, "n_head": heads, "n_layer": layers,
                           "n_inner": 4 * d, "n_positions": seq, "vocab_size": 50368})
    plain, flash = (kernels.work(arch, seq, 1, 1, False, 2, False, r, unpad=u) for u in ("none", "flash-attn"))
    extra_bytes = (flash.elementwise_bytes + flash.elementwise_backward_bytes
                   - plain.elementwise_bytes - plain.elementwise_backward_bytes) * batch
    modelled = extra_bytes / r.memory_bytes_per_s + flash.stall_launches * r.host_seconds_per_kernel
    out = {"measured_extra_s": seconds["unpadded"] - seconds["padded"], "modelled_extra_s": modelled,
           "padded_s": seconds["padded"], "layers": layers, "tokens": tokens,
           "note": "the sum q + k + v stands in for the attention kernel; unverified until run on a GPU"}
    print(f"varlen bookkeeping over {layers} layers: {out['measured_extra_s'] * 1e3:.2f} ms measured, "
          f"{modelled * 1e3:.2f} ms modelled")
    return out


def train_metric_pass(gpu_name: str, tokens: int = 16384, vocab: int = 50368) -> dict:
    """One of composer's train metrics (schema train_metrics, planner/recipes/loop.py) as MPT runs it: a
    cross-entropy with reduction "sum" over bf16 logits under torch.autocast in bf16 and no_grad, timed against the
    bytes the model charges at the copy rate (kernels.train_metric_bytes_per_logit: the fp32 cast and the forward
    Liger's benchmark measured on a 131k vocabulary; a 50k row may stay in L2 between the log-softmax's passes)."""
    import torch

    from planner.cluster.gpus import load_gpus
    from planner.time import kernels

    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, device="cuda")
    labels = torch.randint(0, vocab, (tokens,), device="cuda")

    def metric():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            torch.nn.functional.cross_entropy(logits, labels, reduction="sum")

    measured = _cuda_seconds(metric)
    r = kernels.rates(load_gpus()[gpu_name], "bf16")
    modelled = tokens * vocab * kernels.train_metric_bytes_per_logit(2, True) / r.memory_bytes_per_s
    out = {"measured_s": measured, "modelled_s": modelled, "tokens": tokens, "vocab": vocab,
           "note": "the model's train-metric term; unverified until run on a GPU"}
    print(f"train metric (fp32 cross-entropy under autocast, {tokens} x {vocab}): {measured * 1e3:.2f} ms measured, "
          f"{modelled * 1e3:.2f} ms modelled")
    return out


def host_hooks_on_gpu(steps: int = 30) -> dict:
    """The host's side of a step on this machine (bench/host_hooks.py on one GPU over NCCL): its seconds per
    eager op, which the time model sets at kernels.HOST_SECONDS_PER_KERNEL, and ZeRO-3's and FSDP2's own
    Python in eager ops, against the CPU ranks' record the model charges (planner/data/host_hooks.json).
    One GPU: DeepSpeed skips the gathers of a world of one, so ZeRO-3's figure here is a lower bound."""
    import json

    from bench import host_hooks
    from planner.time import kernels
    from planner.time.host_hooks import DATA

    try:
        measured = host_hooks.measure(steps, 1, "cuda", ("zero3", "fsdp2"))
    except SystemExit as failed:  # a framework missing or failing on this machine: said, not fatal
        return {"error": str(failed)}
    record = json.loads(DATA.read_text())
    out = {"host_seconds_per_eager_op": measured["host_seconds_per_eager_op"],
           "modelled_seconds_per_eager_op": kernels.HOST_SECONDS_PER_KERNEL, "frameworks": {}}
    for arm, figures in measured["frameworks"].items():
        per = figures["per"]
        out["frameworks"][arm] = {part: {"gpu": figures[f"{part}_ops_per_{per}"],
                                         "cpu_record": record["frameworks"][arm][f"{part}_ops_per_{per}"]}
                                  for part in ("forward", "backward")}
        print(f"{arm} hooks per {per}: " + ", ".join(
            f"{part} {v['gpu']:g} eager ops on this GPU's host, {v['cpu_record']:g} charged"
            for part, v in out["frameworks"][arm].items()))
    print(f"host: {out['host_seconds_per_eager_op'] * 1e6:.1f} µs per eager op, "
          f"{kernels.HOST_SECONDS_PER_KERNEL * 1e6:g} µs modelled")
    return out


def hbm_copy_gbps() -> float:
    """Achieved HBM bandwidth of a 4 GiB device-to-device copy, counting bytes read and written: the
    ceiling the time model's memory-bound terms (gpus.yaml hbm bandwidth) are scaled from."""
    import torch

    a = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    seconds = _cuda_seconds(lambda: b.copy_(a), repeat=10)
    return 2 * 2**31 / seconds / 1e9  # a and b are freed on return; the probes' runs are other processes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    parser.add_argument("--calibration", default=str(reserved.CALIBRATION_PATH),
                        help="where to write the calibration the planner reads")
    parser.add_argument("--budget-seconds", type=float, default=None,
                        help="start no probe after this many seconds (the runs go in PRIORITY order; a lease "
                             "of a few minutes measures the most informative rows first)")
    parser.add_argument("--probe-timeout", type=float, default=300.0, help="seconds before one run is ended")
    parser.add_argument("--logs", default=None, help="a folder for the launcher log of each failed run")
    parser.add_argument("--select", default=None,
                        help="comma-separated positions in the prioritized run list (--list prints it): "
                             "a second short lease measures what the first did not reach")
    parser.add_argument("--skip-sequences", action="store_true", help="skip the allocator replays")
    parser.add_argument("--list", action="store_true", help="print the prioritized run list and exit")
    parser.add_argument("--sustained-seconds", type=float, default=30.0,
                        help="how long the sustained block-GEMM measurement runs (sustained_matmul)")
    parser.add_argument("--skip-kernels", action="store_true",
                        help="skip the GEMM, attention, matmul and copy measurements (a lease that has them)")
    args = parser.parse_args()
    import torch

    base = catalogue_model(args.model)
    config = dict(base.config, num_hidden_layers=args.layers)
    entries = prioritized(grid_requests(config, args.gpu))
    if args.list:
        for i, (strategy, row, conf, _) in enumerate(entries):
            print(f"{i:>3} {strategy:<6} seq {row[0]:>5} mb {row[1]} ckpt {row[2]:<20} {row[3]:<5} "
                  f"{conf or 'default':<26} {row[4]}")
        return 0
    if args.select:
        entries = [entries[int(i)] for i in args.select.split(",")]
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    from backend.launch import run_probe

    results = {"device": torch.cuda.get_device_name(0), "context": cuda_context_bytes(), "runs": [],
               "driver": _driver(), "cuda": torch.version.cuda or "", "torch": torch.__version__,
               "step_timing": "step-only", "model": args.model, "layers": args.layers, "gpu": args.gpu}  # the rank times the step alone (backend/train.py _train_steps)
    if not args.skip_kernels:
        results |= {"kernels": check_kernels(args.gpu), "elementwise": check_elementwise(args.gpu),
                    "matmul_tflops": matmul_tflops(),
                    "hbm_copy_gbps": hbm_copy_gbps(), "fsdp2_copies": fsdp2_copies(args.gpu),
                    "async_tp": async_tp_kernels(args.gpu), "unpad": unpad_bookkeeping(args.gpu),
                    "train_metric": train_metric_pass(args.gpu),
                    "host_hooks": host_hooks_on_gpu(),
                    "sustained_matmul": sustained_matmul(args.gpu, args.sustained_seconds)}
        print(f"device-to-device copy: {results['hbm_copy_gbps']:.0f} GB/s (bytes read + written)")
    print(f"matmul TFLOP/s measured: {results.get('matmul_tflops')}")
    requests = []
    started_at = time.monotonic()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for strategy, (seq, micro, ckpt, attention, fields), conf, request in entries:
        tried = [r for r in results["runs"] if r["status"] not in ("skipped", "not-run")]
        broken = len(tried) >= 3 and all(r["status"] != "ok" for r in tried)  # the CUDA path itself fails
        if broken or (args.budget_seconds is not None and time.monotonic() - started_at > args.budget_seconds):
            results["runs"].append({"strategy": strategy, "seq_len": seq, "micro_batch": micro, "checkpointing": ckpt,
                                    "attention": attention, "alloc_conf": conf, "recipe": fields,
                                    "status": "not-run", "message": "the first three runs failed" if broken
                                    else "the check's time budget was spent"})
            continue
        missing = missing_packages(strategy, fields)
        if missing:
            print(f"{strategy:<6} seq {seq:>5} {fields}: skipped: {', '.join(missing)} not installed")
            results["runs"].append({"strategy": strategy, "seq_len": seq, "micro_batch": micro, "checkpointing": ckpt,
                                    "attention": attention, "alloc_conf": conf, "recipe": fields,
                                    "status": "skipped", "message": f"{', '.join(missing)} not installed"})
            continue
        try:
            result = estimate(request)
        except PlannerError as exc:  # a recipe this GPU cannot run (MXFP8 before Blackwell)
            print(f"{strategy:<5} seq {seq:>5} {fields}: skipped: {exc}")
            continue
        if conf == "":
            requests.append(request)
        predicted = result.per_device
        os.environ.pop("PYTORCH_ALLOC_CONF", None)  # read before PYTORCH_CUDA_ALLOC_CONF by torch 2.13
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf  # the ranks inherit it (backend/launch.py _environment)
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            run = run_probe(request, out_dir=Path(tmp), steps=2, warmup_steps=1, timeout_seconds=args.probe_timeout)
            log_tail = _log_tail(Path(tmp)) if run.status != "ok" else ""
            if log_tail and args.logs:
                name = f"failed-{len(results['runs']):02d}-{strategy}-{seq}.log"
                (Path(args.logs) / name).write_text(log_tail)
        rank = run.ranks[0] if run.ranks else {}
        stats = rank.get("memory_stats") or {}
        row = {"strategy": strategy, "seq_len": seq, "micro_batch": micro, "checkpointing": ckpt, "attention": attention,
               "alloc_conf": conf, "recipe": {k: v for k, v in fields.items() if k != "checkpointing"},
               "status": run.status, "seconds": time.monotonic() - started,
               "predicted_peak_bytes": predicted.peak_bytes - predicted.framework_bytes,
               "simulated_allocated_peak_bytes": result.allocator.allocated_peak_bytes,
               "simulated_active_peak_bytes": result.allocator.active_peak_bytes,
               "simulated_reserved_peak_bytes": result.allocator.reserved_peak_bytes,
               **peaks(stats),
               "memory_stats": stats}
        try:  # the time model's step (issue 22) against the rank's measured median step
            row["predicted_step_seconds"] = estimate_with_time(request).time.step_seconds
        except PlannerError as exc:
            row["predicted_step_seconds"] = None
            print(f"    no step time: {exc}")
        if request.activation_offload:  # the GPU's split: bytes through TRL's pack hook, the host-link time
            row["predicted_offloaded_bytes"] = memory.activation_offload_bytes(memory.setup_of(result))
            row["measured_offloaded_bytes"] = rank.get("offloaded_bytes")
            row["measured_step_seconds"] = rank.get("step_seconds")
            row["predicted_offload_seconds"] = estimate_with_time(request).time.offload_seconds
        row["measured_allocated_peak_bytes"] = rank.get("peak_bytes") or row["measured_allocated_peak_bytes"]
        row["measured_reserved_peak_bytes"] = rank.get("reserved_peak_bytes") or row["measured_reserved_peak_bytes"]
        # the training process's device memory outside torch's segments at its timed steps' end (backend/
        # train.py run_cuda): the context with what training loaded (kernels, NCCL, managed pages), which
        # "context" above measures only for this process's first matmul
        row["measured_context_bytes"] = rank.get("context_bytes")
        row["measured_step_seconds"] = rank.get("step_seconds")
        if run.status == "ok":
            if row.get("predicted_step_seconds") and row["measured_step_seconds"]:
                print(f"    step: measured {row['measured_step_seconds'] * 1e3:.1f} ms, predicted "
                      f"{row['predicted_step_seconds'] * 1e3:.1f} ms")
            # the allocator's allocated peak: the model's peak plus the cuBLAS/cuBLASLt workspaces the
            # caching allocator holds (planner/cluster/cuda_context.py), which measured allocated includes
            row["error_pct"] = 100 * (row["simulated_allocated_peak_bytes"] - row["measured_allocated_peak_bytes"]) / \
                row["measured_allocated_peak_bytes"]
            row["reserved_over_allocated"] = row["measured_reserved_peak_bytes"] / row["measured_allocated_peak_bytes"] - 1
            simulated_error = 100 * (row["simulated_reserved_peak_bytes"] / row["measured_reserved_peak_bytes"] - 1)
            print(f"{strategy:<5} seq {seq:>5} mb {micro} ckpt {ckpt:<4} {attention:<5} {conf or 'default':<26}: "
                  f"allocated peak error {row['error_pct']:+.2f}%, reserved +{100 * row['reserved_over_allocated']:.1f}%, "
                  f"simulated reserved {simulated_error:+.2f}%")
        else:
            row["message"], row["log_tail"] = run.message, log_tail[-4000:]
            print(f"{strategy:<5} seq {seq:>5} mb {micro} ckpt {ckpt:<4} {attention:<5} {fields}: {run.status}: "
                  f"{run.message}\n{log_tail[-1500:]}")
        print(f"    ({row['seconds']:.0f} s; {time.monotonic() - started_at:.0f} s into the probes)", flush=True)
        results["runs"].append(row)
        out.write_text(json.dumps(results, indent=2))  # what a lease that ends early still brings back
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    results["sequences"] = [] if args.skip_sequences else check_sequences(requests)
    out.write_text(json.dumps(results, indent=2))
    Path(args.calibration).write_text(json.dumps(calibration(results, args.gpu, torch.__version__), indent=2) + "\n")
    print(f"context: {results['context']}; written to {out} and {args.calibration}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
