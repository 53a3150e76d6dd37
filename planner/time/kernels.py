"""The compute side of a training step from its kernels: every matmul at the GPU's measured
achievable matmul rate, derated by its tile and wave quantisation; attention at FlashAttention's
measured rate for its head width and sequence length; every elementwise op (norms, activations,
rotary, residual adds, dropout, the loss and its fp32 upcast, the optimizer step, and each biased
linear's bias gradient, reduced over the tokens in backward: BIAS_GRADIENT_READS) at the GPU's
achievable memory bandwidth, a block's ops one by one as its code runs them forward and backward
(planner/time/elementwise.py), or under torch.compile as inductor's fused kernels run them
(planner/time/fusion.py: ``work(compiled="blocks" | "model")``); recomputation as the checkpointing
policy reruns it; and the host's launch cost when kernels are shorter than it (a compiled block's
kernels are fewer; each is still charged HOST_SECONDS_PER_KERNEL). Each part is a named term with its source.

One function serves a single estimate (plain floats) and the plan search (a numpy array of
micro-batch options): planner/time/arrays.py. Work that does not depend on the micro-batch (shapes,
bytes per token) is computed once per model, sequence length and split, and cached.

Sources of the constants:
- Achievable matmul TFLOP/s: Bekman, "Machine Learning Engineering", compute/accelerator/README.md,
  "Maximum Achievable Matmul FLOPS comparison table" (stas00/ml-engineering 744d01e): mean of
  100 iterations of the best shape found by mamf-finder.py (data/gpus.yaml mamf_tflops).
- Sustained matmul TFLOP/s: the MAMF is a burst; a training step holds its GEMMs at the power limit for
  seconds, where the clock settles lower. Where mamf-finder.py's MSMF (the best shape's rate over a 2-4 s
  window once the clock has settled) is published, every GEMM runs at most at it (_gemm_seconds; data/gpus.yaml
  sustained_tflops: H200 744.5, B200 1,424.5; the H100 SXM's 703.7 and the A100 SXM4's 257.5 from one large matmul
  run back to back at the power limit).
- Attention: measured forward + backward TFLOP/s of FlashAttention-2 and FlashAttention 1.x (the
  Triton kernel at FlashAttention 1.x's: STAND_IN below), causal mask, head dimension 64 and 128, sequence
  512-16k, on A100 80GB SXM4 and H100 80GB SXM5 (Dao-AILab/flash-attention
  0251105, README "Performance", assets/flash2_a100_fwd_bwd_benchmark.png and
  flash2_h100_fwd_bwd_benchmark.png, panels (c) and (d)); FLOPs counted as its
  benchmarks/benchmark_flash_attention.py counts them: 4·s²·heads·head_dim forward, halved by the
  causal mask, backward 2.5x forward. On Hopper also FlashAttention-3 and cuDNN's fused attention,
  forward and backward charted apart (FlashAttention-3 paper, HOPPER_ATTENTION_TFLOPS below).
- Wave quantisation: a GEMM's output is cut into tiles, one per SM at a time; the last wave runs
  partly empty (NVIDIA, "Matrix Multiplication Background User's Guide", Wave Quantization).
- The K loop: each output tile streams its K in steps through a multi-stage pipeline that is
  filled before and drained (the tile written back) after; that fixed part costs about K = 512 of
  loop time (K_PIPELINE below), so a GEMM of reduction length K runs at K / (K + 512) of its
  long-K rate. Derived from NVIDIA's cuBLAS bf16 measurements of square GEMMs on A100 ("CUDA 11
  Features Revealed", 2020, Figure 6, reproduced in Bekman's compute/accelerator/README.md):
  290 TFLOP/s at 8192, 260 at 4096 (after their 19 and 5 tile waves, 0.998 and 0.948, these two
  give K0 = 513), and the same K0 predicts 238 at 2560 and 195 at 2048 where the figure reads ~240
  and ~200. The MAMF was measured at one shape: its K (data/gpus.yaml mamf_k) places it on that
  curve, and a shorter K is read from there; a longer one stays at the MAMF (the search's maximum).
  The fixed part is memory traffic (the first operand stages in, the output tile out), so on
  another GPU K0 scales with its FLOP per byte over that A100 40GB's (312 TFLOP/s over 1,555 GB/s):
  390 on an A100 80GB. Hopper (sm 9.0) is measured instead: XLA's table of measured sm_90 matmul rates
  (openxla, xla/service/gpu/model/matmul_interpolator_data.h, kDefaultMatmulPTable "sm_90", bf16; in
  tensorflow/tensorflow 372d578) gives 4,096 x 4,096 outputs (512 tiles, 4 waves) 392 TFLOP/s at K = 256 and,
  batched x4 (16 waves), 504 at K = 256 and 620 at K = 512: K0 = 153 when other waves' tiles overlap a tile's
  fixed part (the rate R·K/(K + K0) through the two batched points, R = 805, MAMF 794.5), and 2,048^3 (128 tiles:
  one wave) 632: K0 = 481 where nothing overlaps it. So a Hopper GEMM takes waves x (K + 153) of loop time and
  the first wave's 481 - 153 once (HOPPER_K_PIPELINE, HOPPER_FIRST_WAVE_K); the A100-scaled K0 (753 on an H100
  SXM) had read 4,096^3 at 688 TFLOP/s where XLA measured 783, and a 512-K tensor-parallel GEMM at half its rate.
  Checked on an H200 (bench/results/gpu_check_h200_1.json "kernels", torch 2.11, one full wave of
  16,896 x 256 outputs): measured 648.7, 730.0, 763.0, 781.2 TFLOP/s at K = 2,048 ... 16,384 where
  the curve gives 650.8, 719.2, 759.1, 779.1 (within 1.5%); XLA's sm_90 rows of two waves or more within 8%
  (tests/test_kernels.py), its one-wave 4,096 x 1,024 x 512 (a 12 µs kernel) 17% under the curve. At K = 256,
  512 and 1,024 it measured
  96.5, 204.2, 413.6 against 270.4, 407.5, 545.7, but those calls took a flat 22.9, 21.7, 21.4 µs
  each: launches of eager `a @ b` timed back to back, the host's cost, not the K loop's (at K = 256
  the kernel's own operand traffic, 17.4 MB, is 4.4 µs at the copy rate measured there). The curve
  is kept; the step's host cost is the host term below (HOST_SECONDS_PER_KERNEL), and
  bench/gpu_check.py now times the GEMMs replayed from a CUDA graph.
- Memory bandwidth: planner/timing.MEMORY_BANDWIDTH_EFFICIENCY of the datasheet bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from planner.errors import PlannerError
from planner.cluster import cuda_context
from planner.time import arrays
from planner.model.architecture import Architecture, layer_specs
from planner.model.attention.kinds import kind_of
from planner.cluster.gpus import Gpu
from planner.model.activations import checkpointed_blocks, selective_op_rerun_flops
from planner.model.layers import LayerSpec, attention_numels
from planner.model.linears import attention_linears, block_linears
from planner.time.collectives import MEMORY_BANDWIDTH_EFFICIENCY
from planner.time import fusion
from planner.time.elementwise import FrozenBase, Traffic, block_traffic, edge_traffic
from planner.recipes.losses import liger_chunk_tokens, loss_bytes_per_logit, loss_recomputes_logits

AttentionKernel = Literal["flash-attention-2", "flash-attention-1", "flash-attention-triton", "flash-attention-3",
                          "cudnn"]
# Forward + backward TFLOP/s with a causal mask (sources above: the same charts measure
# FlashAttention-2 and FlashAttention 1.x side by side), by kernel, GPU and head dimension, at
# sequence lengths 512, 1k, 2k, 4k, 8k, 16k.
ATTENTION_SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
REFERENCES = {"a100": {"bf16_peak": 312.0, "mamf": 271.2}, "h100": {"bf16_peak": 989.0, "mamf": 794.5}}
FLASH_ATTENTION_CAUSAL_TFLOPS = {
    ("flash-attention-2", "a100"): {64: (88.0, 119.0, 140.0, 156.0, 165.0, 171.0),
                                    128: (99.0, 133.0, 155.0, 173.0, 182.0, 189.0)},
    ("flash-attention-2", "h100"): {64: (141.0, 192.0, 232.0, 257.0, 273.0, 284.0),
                                    128: (163.0, 221.0, 265.0, 294.0, 308.0, 328.0)},
    ("flash-attention-1", "a100"): {64: (58.0, 70.0, 77.0, 87.0, 92.0, 97.0),
                                    128: (55.0, 62.0, 69.0, 76.0, 80.0, 83.0)},
    ("flash-attention-1", "h100"): {64: (104.0, 123.0, 136.0, 138.0, 149.0, 156.0),
                                    128: (98.0, 109.0, 108.0, 126.0, 135.0, 137.0)},
}
# Hopper's own kernels, measured separately forward and backward on an H100 80GB SXM5 (BF16, batch
# x sequence = 16k tokens, 2,048 hidden = 16 heads of 128 or 32 of 64), by kernel, pass and head
# dimension at ATTENTION_SEQUENCES: Shah et al. 2024, "FlashAttention-3", arXiv 2407.08608v2,
# Figure 5 (forward, without and with the causal mask) and Figure 6 (backward, without the mask),
# the TFLOP/s written over each bar. FlashAttention-3 is the flash-attn "hopper" build
# (flash_attn_interface); cuDNN is cuDNN 9's fused attention, which torch's SDPA runs on sm90/sm100
# first (cudnn_attention before flash_attention) when its runtime cuDNN is newer than 9.15.0 and
# TORCH_CUDNN_SDPA_DEPRIORITIZED is unset (pytorch/pytorch 001f694,
# aten/src/ATen/native/transformers/cuda/sdp_utils.cpp check_prefer_cudnn_attention and
# priority_order); otherwise SDPA's first choice stays its FlashAttention-2 kernel, as it was for
# every GPU when cuDNN came last (flash, efficient, math, cudnn: 21c3369, same file, priority_order).
# The choice follows the wheel's cuDNN, which no request field states: attention_kernel says it.
# torchtitan pins its own order, FlashAttention first below sm100 (pytorch/torchtitan 2f78d7b,
# torchtitan/models/attention.py ScaledDotProductAttention._init_backend: cuDNN first only from
# capability 10.0), so its H100 runs stay at FlashAttention-2, the default.
HOPPER_ATTENTION_TFLOPS = {
    "flash-attention-2": {"forward": {64: (282.0, 306.0, 318.0, 321.0, 322.0, 324.0),
                                      128: (309.0, 350.0, 362.0, 368.0, 370.0, 370.0)},
                          "forward_causal": {64: (180.0, 229.0, 262.0, 284.0, 295.0, 299.0),
                                             128: (191.0, 260.0, 298.0, 319.0, 333.0, 335.0)},
                          "backward": {64: (198.0, 238.0, 264.0, 279.0, 287.0, 291.0),
                                       128: (214.0, 260.0, 291.0, 310.0, 318.0, 322.0)}},
    "flash-attention-3": {"forward": {64: (333.0, 392.0, 460.0, 476.0, 496.0, 497.0),
                                      128: (467.0, 565.0, 625.0, 638.0, 646.0, 648.0)},
                          "forward_causal": {64: (197.0, 265.0, 371.0, 420.0, 460.0, 473.0),
                                             128: (292.0, 423.0, 521.0, 579.0, 602.0, 616.0)},
                          "backward": {64: (272.0, 363.0, 422.0, 453.0, 472.0, 474.0),
                                       128: (316.0, 424.0, 501.0, 542.0, 559.0, 561.0)}},
    "cudnn": {"forward": {64: (335.0, 373.0, 395.0, 408.0, 412.0, 413.0),
                          128: (497.0, 574.0, 617.0, 609.0, 600.0, 595.0)},
              "forward_causal": {64: (225.0, 288.0, 334.0, 363.0, 379.0, 388.0),
                                 128: (315.0, 410.0, 484.0, 518.0, 529.0, 539.0)},
              "backward": {64: (266.0, 348.0, 395.0, 417.0, 432.0, 433.0),
                           128: (305.0, 408.0, 465.0, 499.0, 518.0, 516.0)}},
}


def causal_backward_tflops(kernel: str, head_dim: int) -> tuple[float, ...]:
    """The causal backward at each measured length, which Figure 6 does not chart: the unmasked
    backward slowed as the kernel's own forward is by the mask (causal over unmasked forward at the
    same length). The mask costs both passes alike: half the tiles, the diagonal ones computed in
    full and the query blocks unevenly loaded. Read back through the FlashAttention-2 row, this gives
    the forward + backward of the FlashAttention-2 chart above (H100, head 128) within 11% at 512
    and 3-8% from 2k, always slower than charted (tests/test_kernels.py)."""
    t = HOPPER_ATTENTION_TFLOPS[kernel]
    return tuple(b * fc / f for b, fc, f in zip(t["backward"][head_dim], t["forward_causal"][head_dim],
                                                t["forward"][head_dim]))


def causal_forward_backward_tflops(kernel: str, head_dim: int) -> tuple[float, ...]:
    """Forward + backward TFLOP/s with the causal mask from the separate passes (the backward's
    FLOPs ATTENTION_BACKWARD_FLOPS times the forward's, as the charts count them)."""
    forward = HOPPER_ATTENTION_TFLOPS[kernel]["forward_causal"][head_dim]
    return tuple((1.0 + ATTENTION_BACKWARD_FLOPS) / (1.0 / f + ATTENTION_BACKWARD_FLOPS / b)
                 for f, b in zip(forward, causal_backward_tflops(kernel, head_dim)))


# A kernel without published rates, read at a measured kernel's. FlashAttention's Triton kernel
# (flash_attn/flash_attn_triton.py, MPT's attn_impl "triton": llm-foundry 5f43bf1
# llmfoundry/models/layers/attention.py line 211) has no chart of its own; its header compares it
# with the CUDA kernel of its time, FlashAttention 1.x: "Triton forward is generally faster than
# CUDA forward, while Triton backward is generally slower [...] Overall Triton forward + backward
# is slightly slower than CUDA forward + backward" (Dao-AILab/flash-attention 470010f, Nov 2022),
# and MosaicML's warning on it says it "can be faster than attn_impl: flash" (FlashAttention 1.x
# then; attention.py line 315 at 5f43bf1). The charts' "Triton" line is another kernel, Triton's
# own triton.ops.flash_attention (benchmarks/benchmark_flash_attention.py imports it, 0469c72),
# whose head-128 backward the header says flash_attn_triton.py made "much faster by reducing
# register spilling". So FlashAttention 1.x's rates, an upper bound by "slightly".
STAND_IN = {"flash-attention-triton": "flash-attention-1"}
# Kernels that run every head width up to 128 on the same tiles: their rate at a wider head is at
# least their rate at 64. flash_attn_triton.py (470010f) runs its forward on 128 x 128 tiles at every
# width (_flash_attn_forward: BLOCK = 128; 4 warps up to 64, 8 above) and its backward on 128 x 128
# tiles with 8 warps at every width (_bwd_kernel's two autotune configs): per tile, the dots (Q K^T,
# P V, the backward's five) and the Q/K/V/dO loads grow with the width while the softmax over the
# tile's scores, its masks and the ALiBi bias do not, so a head of 128 takes at most twice a head of
# 64's time for twice its FLOPs. FlashAttention 1.x's CUDA kernel, the stand-in's charts, runs 128
# below its 64 (A100: 83 against 97 TFLOP/s at 16k) on smaller key blocks: its head-128 line is not
# this kernel's. The header's fix, "make the backward for d=128 much faster by reducing register
# spilling", is the reason the bound holds in the backward too.
WIDTH_KEEPS_TILE = frozenset({"flash-attention-triton"})
# Flash attention's varlen path over a padded batch (schema AttentionUnpadField), per layer. Its gathers and
# scatters at the copy rate, in elements of the tensors they move: forward, q, k and v each gathered (read and
# written once: bert_padding.IndexFirstAxis's torch.gather, transformers' tensor[indices]) and the output
# scattered back into zeros (IndexPutFirstAxis / _pad_input: the zeros written, the values read, the rows
# written); backward, each gather's gradient scattered into zeros (written, read, written) and the output's
# gradient gathered (read, written). Host synchronisations: torch.nonzero's output size and max_seqlen's
# .item() in each unpad: flash-attn's unpad_input runs per tensor (three per layer in llm-foundry 5e85bd6
# flash_attn_fn), transformers' _get_unpad_data once per layer (5.25 _upad_input). At each one the GPU's
# queue drains and it waits while the host returns and launches what follows, up to the attention kernel,
# one eager launch each (HOST_SECONDS_PER_KERNEL): the unpad's small kernels (the mask's sum, nonzero, max,
# cumsum, its pad, the gathers) cannot be hidden behind longer ones queued ahead.
UNPAD_PASSES = {"forward": {"gathered": 2, "output": 3}, "backward": {"gathered": 3, "output": 2}}


@dataclass(frozen=True)
class Unpad:
    """One layer's varlen bookkeeping for one unpadding implementation."""

    syncs: int  # host synchronisations per layer's forward
    launches: int  # kernels the host launches between the first synchronisation and the attention kernel
    backward_kernels: int  # the gathers' and the scatter's gradients


UNPAD = {"flash-attn": Unpad(syncs=6, launches=3 * 6, backward_kernels=3 * 2 + 1),
         "transformers": Unpad(syncs=2, launches=5 + 3, backward_kernels=3 * 2 + 1)}
# benchmark_flash_attention.py: backward = 2.5 x forward FLOPs (it recomputes the scores)
ATTENTION_BACKWARD_FLOPS = 2.5
# The forward runs at a higher rate than the backward; the tables above measure the two together,
# so this ratio splits their time (what checkpointing reruns is the forward alone). FlashAttention-2:
# up to 73% of A100's peak forward, 63% backward (Dao 2023, "FlashAttention-2", arXiv 2307.08691,
# Sec. 1); an H200 measured 579 forward and 509 backward at 8k, head 128, 16 heads (torch 2.11's SDPA,
# bench/results/gpu_check_h200_1.json): 1.14. Triton's FlashAttention (the algorithm of the Triton tutorial FlashAttention's kernel
# started from): the tutorial's published causal head-64 rates at 2k, 136.5 TFLOP/s forward and
# 76.2 backward (triton-lang.org, getting-started/tutorials/06-fused-attention). FlashAttention 1.x:
# no separate measurement, one rate for both.
FORWARD_OVER_BACKWARD_RATE = {"flash-attention-2": 73.0 / 63.0, "flash-attention-triton": 136.5 / 76.2}
# Hopper's kernels (no A100 measurement: FlashAttention-3 runs on sm90 only, and the paper charts
# cuDNN on H100 alone): their forward + backward from the separate passes, head 64 and 128, and the
# forward over backward rate at 8k, head 128 (unmasked over unmasked: the causal backward is read
# with the forward's mask factor, so the ratio is the same)
# FlashAttention-3 is built for sm90 alone (flash-attn's hopper/ directory); cuDNN's rates are the H100's, and
# cuDNN does not run on ROCm: both are refused on any other compute capability (attention_tflops)
HOPPER_SM = "9.0"
HOPPER_KERNELS = ("flash-attention-3", "cudnn")
for _kernel in HOPPER_KERNELS:
    FLASH_ATTENTION_CAUSAL_TFLOPS[(_kernel, "h100")] = {d: causal_forward_backward_tflops(_kernel, d) for d in (64, 128)}
    FORWARD_OVER_BACKWARD_RATE[_kernel] = (HOPPER_ATTENTION_TFLOPS[_kernel]["forward"][128][4]
                                           / HOPPER_ATTENTION_TFLOPS[_kernel]["backward"][128][4])
# A GPU without a measured MAMF: the datasheet peak times the H100 SXM's measured fraction
# (794.5 of 989 TFLOP/s, the MAMF table's median NVIDIA row, between GH200's 83.8% and B200's 77.6%).
UNMEASURED_MATMUL_FRACTION = 794.5 / 989.0
# cuBLAS's large bf16 tiles on Ampere and Hopper: 128 x 256 outputs per thread block (CUTLASS's
# default GEMM configurations, cutlass/gemm/device/default_gemm_configuration.h: ThreadblockShape
# 128x256 for Sm80 tensor-op f16/bf16); the shorter side goes along the tokens.
TILE_TOKENS = 128
TILE_FEATURES = 256
# The K loop's fixed cost per output tile, in K (module docstring: NVIDIA's A100 cuBLAS figure)
K_PIPELINE = 512
K_PIPELINE_BALANCE = 312e12 / 1555e9  # FLOP per byte of the GPU that figure measured (A100 40GB)
# The K of a GPU measured without a MAMF shape: the H100 SXM's (its fraction stands in for the rate)
UNMEASURED_MAMF_K = 13312
# Hopper's K loop, measured (module docstring: XLA's sm_90 matmul table): a tile's fixed cost when other waves'
# tiles overlap it, and the extra the first wave exposes (its prologue has nothing to hide behind), in K
HOPPER_K_PIPELINE = 153.0
HOPPER_FIRST_WAVE_K = 481.0
# Host time per kernel launch of eager PyTorch (dispatcher, autograd bookkeeping and
# cudaLaunchKernel): about 10 µs per op (Horace He, "Making Deep Learning Go Brrrr From First
# Principles", 2022, section Overhead). A GPU whose kernels are shorter waits for the host.
HOST_SECONDS_PER_KERNEL = 10e-6
# Bytes at the copy rate per logit element in the loss: the fp32 upcast (read 2, write 4), torch's
# cross_entropy on the fp32 logits forward and backward (36, measured below), and the cast of the
# gradient back for the head's matmuls (read 4, write 2): transformers' ForCausalLMLoss upcasts logits
# to float before cross_entropy. The 36 is measured, not counted: Liger-Kernel's published benchmark of
# torch's CrossEntropyLoss on fp32 logits (linkedin/Liger-Kernel ead96b6, benchmark/data/
# all_benchmark_data.csv, provider "huggingface", A100-SXM4-80GB, 16,384 rows of 131,072) takes 20.73 ms
# forward, 16.3 bytes per logit at this GPU's copy rate (0.83 x 2,039 GB/s) where one read and one write
# are 8 (its log-softmax passes over each row more than once), and 60.44 ms forward + backward, 47.6 bytes,
# of which 12 are the leaf's gradient accumulated across the benchmark's repeats (benchmark_cross_entropy.py
# at a307eac8 resets it in no mode but "backward"): 36 per logit; rows of 32,768 and 65,536 give the same
# (48.8 and 47.8 before the accumulation's 12).
LOSS_BYTES_PER_LOGIT = 48
# Bytes at the copy rate per fp32 logit of torch's cross_entropy forward alone: the same measurement's 20.73 ms
# forward over 16,384 x 131,072 fp32 logits at 0.83 x 2,039 GB/s (above). A train metric's cross-entropy
# (planner/recipes/loop.py) is this forward, under no_grad.
CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_LOGIT = 20.73e-3 * 0.83 * 2039e9 / (16384 * 131072)
# A linear with a bias is one addmm (torch aten/src/ATen/native/Linear.cpp linear: a 2-D or contiguous 3-D
# input with a bias goes to addmm; GPT-2's Conv1D calls torch.addmm itself). Its forward adds the bias in
# cuBLASLt's epilogue, no kernel of its own (aten/src/ATen/native/cuda/Blas.cpp addmm_out_cuda_impl:
# useLtInterface "to use lt interface only when self is bias", a 1-D contiguous bias with beta 1, CUDA
# >= 11.4). Its backward is not fused: derivatives.yaml's addmm entry gives the bias the output's whole
# gradient, ``self: maybe_multiply(grad, beta.conj())`` (torchgen/packaged/autograd/derivatives.yaml line
# 256, torch 2.13), which the autograd engine reduces to the bias's shape (validate_outputs: at::sum_to),
# one sum kernel reading the tokens x out_features output gradient once per biased linear. A CPU run
# shows the kernel: torch.profiler counts one more aten::sum per nn.Linear(bias=True) backward
# (tests/test_kernels.py). Reads of the output gradient per element and biased linear:
BIAS_GRADIENT_READS = 1


@dataclass(frozen=True)
class Rates:
    """What one GPU achieves per kind of kernel."""

    matmul_flops: float  # FLOP/s of a large dense matmul in the step's dtype
    matmul_source: str
    memory_bytes_per_s: float
    sms: int | None
    attention_reference: str  # the measured FlashAttention table scaled to this GPU
    attention_scale: float
    host_seconds_per_kernel: float = HOST_SECONDS_PER_KERNEL
    mamf_k: int | None = None  # K of the shape matmul_flops was measured at (None: no K-loop derating)
    k_pipeline: float = 512.0  # the K loop's fixed cost per tile, in K (K_PIPELINE at this GPU's balance)
    first_wave_k: float = 0.0  # the first wave's exposed fixed cost beyond k_pipeline, in K (Hopper: measured)
    sm: str | None = None  # compute capability (data/cuda_context.yaml), None where the catalogue places none
    sustained_flops: float | None = None  # the rate a GEMM holds at the power limit (gpus.yaml sustained_tflops)

    @property
    def steady_flops(self) -> float:
        """The most any GEMM of a training step runs at: the burst rate, held down to the sustained one."""
        return self.matmul_flops if self.sustained_flops is None else min(self.matmul_flops, self.sustained_flops)

    @property
    def long_k_flops(self) -> float:
        """The matmul rate the K-loop curve through the measured shape approaches; a GEMM never
        runs above matmul_flops, the maximum the MAMF search found over its shapes."""
        return self.matmul_flops if self.mamf_k is None else self.matmul_flops / k_efficiency(self.mamf_k,
                                                                                             self.k_pipeline)


_RATES: dict[tuple[str, str, float], Rates] = {}


def rates(g: Gpu, dtype: str, matmul_scale: float = 1.0) -> Rates:
    """``dtype``: the key of peak_tflops the matmuls run at; ``matmul_scale``: a calibration
    profile's measured-over-predicted factor (1 without one). Memoised per catalogue GPU."""
    key = (g.name, dtype, matmul_scale)
    if key not in _RATES or len(_RATES) > 64:
        if len(_RATES) > 64:
            _RATES.clear()
        _RATES[key] = _rates(g, dtype, matmul_scale)
    return _RATES[key]


def _rates(g: Gpu, dtype: str, matmul_scale: float) -> Rates:
    peak = g.peak_tflops[dtype] * 1e12
    if dtype in g.mamf_tflops:
        matmul, source = g.mamf_tflops[dtype] * 1e12, f"measured MAMF {g.mamf_tflops[dtype]:g} TFLOP/s ({dtype})"
    elif "bf16" in g.mamf_tflops and "bf16" in g.peak_tflops:  # same tensor cores, the bf16 fraction
        fraction = g.mamf_tflops["bf16"] / g.peak_tflops["bf16"]
        matmul, source = peak * fraction, f"{fraction:.1%} of peak (its measured bf16 MAMF fraction)"
    else:
        matmul, source = peak * UNMEASURED_MATMUL_FRACTION, \
            f"{UNMEASURED_MATMUL_FRACTION:.1%} of peak (no MAMF measurement for {g.name}: the H100 SXM's fraction)"
    bf16_peak = g.peak_tflops.get("bf16", g.peak_tflops.get("fp16", peak / 1e12))
    reference = min(REFERENCES, key=lambda k: abs(math.log(REFERENCES[k]["bf16_peak"] / bf16_peak)))
    ref_matmul = REFERENCES[reference]["mamf"] * 1e12
    bandwidth = (g.memory_bandwidth_gbps or 1000.0) * 1e9 * MEMORY_BANDWIDTH_EFFICIENCY
    measured_k = g.mamf_k.get(dtype, g.mamf_k.get("bf16", UNMEASURED_MAMF_K)) if g.sms else None
    # the tile's fixed part is memory traffic (its first operand stages in, its outputs out), so in
    # K it grows with the GPU's FLOP per byte over the figure's A100 40GB (312 TFLOP/s, 1,555 GB/s)
    balance = peak / ((g.memory_bandwidth_gbps or 1000.0) * 1e9)
    arch = cuda_context.architecture(g.name)
    sm = arch.sm if arch else None
    # Hopper's K loop is measured (HOPPER_K_PIPELINE); elsewhere the A100 figure's, at this GPU's balance
    k_pipeline, first_wave = ((HOPPER_K_PIPELINE, HOPPER_FIRST_WAVE_K - HOPPER_K_PIPELINE) if sm == HOPPER_SM
                              else (K_PIPELINE * balance / K_PIPELINE_BALANCE, 0.0))
    sustained = g.sustained_tflops.get(dtype)
    if sustained is None and dtype == "fp16" and "bf16" in g.sustained_tflops:  # the same tensor cores
        sustained = g.sustained_tflops["bf16"] * g.peak_tflops["fp16"] / g.peak_tflops["bf16"]
    if sustained is not None:
        source += f", at most the sustained {sustained:g} TFLOP/s at the power limit (gpus.yaml sustained_tflops)"
    elif g.sms:  # a burst's rate (gpus.yaml sustained_tflops): the H200 sustains 88% of its burst, the B200 84%
        source += "; a burst's rate: no sustained rate at the power limit is published for this GPU"
    return Rates(matmul_flops=matmul * matmul_scale, matmul_source=source, memory_bytes_per_s=bandwidth,
                 sms=g.sms, attention_reference=reference, attention_scale=matmul * matmul_scale / ref_matmul,
                 mamf_k=measured_k, k_pipeline=k_pipeline, first_wave_k=first_wave, sm=sm,
                 sustained_flops=None if sustained is None else sustained * 1e12 * matmul_scale)


def attention_tflops(r: Rates, seq: int, head_dim: int, kernel: str = "flash-attention-2") -> float:
    """The flash kernel's causal forward + backward TFLOP/s at this sequence length and head width:
    log-linear between the measured lengths; beyond the longest, the fixed-cost form through the
    last two (long_sequence_tflops); linear in head width between 64 and 128, the nearer end
    outside; scaled by this GPU's matmul rate over the reference's."""
    if kernel in HOPPER_KERNELS and r.sm != HOPPER_SM:
        raise PlannerError(f"attention_kernel {kernel!r} is measured on Hopper (sm {HOPPER_SM}: H100, H200, GH200) "
                           f"only; this GPU is sm {r.sm or 'unknown'}, where it does not run or its rate is unknown; "
                           "use flash-attention-2", field="attention_kernel")
    measured = FLASH_ATTENTION_CAUSAL_TFLOPS.get((STAND_IN.get(kernel, kernel), r.attention_reference))
    if measured is None:  # a Hopper whose peak is nearer the A100's: no chart at its rate
        raise PlannerError(f"attention_kernel {kernel!r} has no rate measured near this GPU's ({r.attention_reference}"
                           "-class peak); use flash-attention-2", field="attention_kernel")

    def at(row: tuple[float, ...]) -> float:
        if seq <= ATTENTION_SEQUENCES[0]:
            return row[0] * seq / ATTENTION_SEQUENCES[0]  # below 512 the launch dominates: time stays
        if seq >= ATTENTION_SEQUENCES[-1]:
            return long_sequence_tflops(row[-2], row[-1], ATTENTION_SEQUENCES[-1], seq)
        for k in range(1, len(ATTENTION_SEQUENCES)):
            if seq <= ATTENTION_SEQUENCES[k]:
                lo, hi = ATTENTION_SEQUENCES[k - 1], ATTENTION_SEQUENCES[k]
                w = math.log(seq / lo) / math.log(hi / lo)
                return row[k - 1] + w * (row[k] - row[k - 1])
        return row[-1]

    def rate(table) -> float:
        w = min(1.0, max(0.0, (head_dim - 64) / 64))
        between = at(table[64]) * (1 - w) + at(table[128]) * w
        # a kernel whose tile does not shrink with the head width runs a wider head at least at the
        # narrower one's rate (WIDTH_KEEPS_TILE)
        return max(between, at(table[64])) if kernel in WIDTH_KEEPS_TILE and head_dim > 64 else between

    return rate(measured) * r.attention_scale


def long_sequence_tflops(before: float, last: float, last_seq: int, seq: int) -> float:
    """A flash kernel's rate beyond its longest measured length. Each thread block of queries
    streams the keys before it (causal: seq / 2 on average) after a fixed cost (loading its
    queries, writing its output and softmax statistics), so the rate is R·s / (s + S0), the
    K loop's form (k_efficiency); R and S0 through the rates at half the last length and at the
    last. A curve that stopped rising there stays flat."""
    q = last / before
    if seq <= last_seq or not 1.0 < q < 2.0:
        return last
    s0 = last_seq * (q - 1.0) / (2.0 - q)  # from q = 2(s/2 + S0) / (s + S0) at s = last_seq
    return last * (last_seq + s0) / last_seq * seq / (seq + s0)


# --- the work of one micro-batch -----------------------------------------------------------------

@dataclass(frozen=True)
class Gemm:
    """One matmul of the forward pass: tokens x k times k x n, ``count`` of them per micro-batch
    (layers alike, or experts), each over ``token_fraction`` of the micro-batch's tokens."""

    n: int
    k: int
    count: int
    token_fraction: float = 1.0
    trained: bool = True  # its weight gets a gradient (a frozen base's linears do not)
    routed: bool = False  # a routed expert's weights (a parameter tensor, not an nn.Linear Float8 converts)
    rate: float = 1.0  # its matmul rate over the step dtype's: a low-precision linear's fp8/fp4 tensor cores


@dataclass(frozen=True)
class Work:
    """What one GPU runs for one sequence of a micro-batch, independent of the micro-batch size."""

    tokens: int  # tokens of one sequence on this GPU (seq / cp)
    gemms: tuple[Gemm, ...]
    attention_flops: float  # forward, executed (causal saving), per sequence on this GPU
    attention_seconds_fb: float  # forward + backward at the measured rate, per sequence
    eager_bytes: float  # eager attention's score-matrix traffic, forward, per sequence
    elementwise_bytes: float  # the blocks' forward, per sequence (what a checkpointing policy reruns)
    loss_bytes: float  # forward + backward, per sequence
    kernels: int  # launches of one forward
    layers: int
    attention_forward_share: float = 1.0 / (1.0 + ATTENTION_BACKWARD_FLOPS)  # of attention_seconds_fb
    loss_recompute_flops: float = 0.0  # the loss kernel's backward reruns the LM head's forward (CCE), per sequence
    cast_bytes: float = 0.0  # low precision: the activations' and gradients' casts, forward + backward, per sequence
    weight_cast_bytes: float = 0.0  # low precision: the converted weights' casts, per micro-batch
    # the LM head's (n, k, chunks) run chunk by chunk (liger_head): Liger's fused loss (chunks 0: its own
    # chunk size), torchtitan's chunked loss (that many chunks of the sequence)
    chunked_head: tuple[int, int, int] | None = None
    bias_gradient_bytes: float = 0.0  # the biased linears' bias-gradient reductions, backward, per sequence
    elementwise_backward_bytes: float = 0.0  # the blocks' elementwise backward, per sequence (planner/time/elementwise.py)
    edge_elementwise_bytes: float = 0.0  # the embedding's and final norm's, forward + backward, per sequence
    # what the ops above measured below the copy rate cost beyond their bytes, in bytes at the copy rate
    # (planner/time/elementwise.py Traffic): the blocks' forward, their backward, the edges'
    elementwise_excess_bytes: float = 0.0
    elementwise_backward_excess_bytes: float = 0.0
    edge_excess_bytes: float = 0.0
    backward_kernels: int = 0  # launches of one backward (the recompute's are the forward's again)
    compiled: str = "none"  # torch.compile: "none" (eager), "blocks" or "model" (planner/time/fusion.py)
    # compiled: the blocks' elementwise bytes each policy's recompute moves in backward, per sequence, as (policy,
    # bytes) pairs (fusion.recompute_bytes); a policy not listed (eager) reruns the whole forward op by op
    elementwise_rerun_bytes: tuple[tuple[str, float], ...] = ()
    stall_launches: float = 0.0  # the varlen path's synchronisations and exposed launches per forward (UNPAD)


def _attention_gemms(s: LayerSpec, hidden: int, tp: int) -> list[tuple[int, int]]:
    """(n, k) of the block's attention projections on one TP rank (columns split, rows split)."""
    a = s.attention
    if not kind_of(a).plain_projections:  # MLA: each projection tensor through its latents is one GEMM
        return [(max(1, numel // hidden // tp), hidden) for numel in attention_numels(a, hidden) if numel >= hidden * 8]
    q, kv = a.q_width // tp, max(1, a.kv_width // tp)
    proj = [(q + 2 * kv, hidden)] if a.fused_qkv else [(q, hidden), (kv, hidden), (kv, hidden)]
    return proj + [(hidden, max(1, a.out_width // tp))]


def _mlp_gemms(s: LayerSpec, hidden: int, tp: int) -> list[Gemm]:
    m = s.mlp
    inner = max(1, m.intermediate_size // tp)
    ups = 1 if (m.fused_gate_up or not m.gated) else 2
    up_n = inner * (2 if (m.gated and m.fused_gate_up) else 1)
    if not m.is_moe:
        return [Gemm(up_n, hidden, ups), Gemm(hidden, inner, 1)]
    # tokens per expert (no expert parallelism): the top-k's share under a dispatch that gathers each
    # expert's tokens; every token through every expert under Llama-4's, which repeats the tokens once
    # per expert, zeroes the unrouted rows' scores and runs one bmm over all experts
    # (transformers 5.x modeling_llama4.py Llama4TextMoe.forward lines 172-174, Llama4TextExperts lines 79-82)
    share = 1.0 if m.layout == "llama4" else m.experts_per_token / m.num_experts
    out = [Gemm(m.num_experts, hidden, 1),  # router
           Gemm(inner * (2 if m.gated else 1), hidden, m.num_experts, share, routed=True),
           Gemm(hidden, inner, m.num_experts, share, routed=True)]
    if m.shared_intermediate_size:
        shared = max(1, m.shared_intermediate_size // tp)
        out += [Gemm(shared, hidden, 2), Gemm(hidden, shared, 1)]
    return out


def tp_overlap_windows(arch: Architecture, seq: int, tp: int, cp: int, micro, r: Rates, compute_bytes: int,
                       low_precision: "LowPrecisionRate | None" = None) -> list[tuple[int, tuple]]:
    """(blocks of the spec, the seconds of its four matmuls an async-TP collective pipelines with) per
    layer spec, at ``micro`` sequences: the gathered input's projections (q, k and v: one all-gather feeds
    them all), the output projection, the MLP's up and gate (one all-gather), its down projection. A
    backward collective pairs with the same linear's input-gradient matmul (the same FLOPs, its shape
    transposed: timed as the forward's). Async TP fuses an all-gather with the matmuls that consume it and
    a matmul with the reduce-scatter of its output (torch 2.13 _inductor/fx_passes/micro_pipeline_tp.py
    fuse_all_gather_matmul, fuse_matmul_reduce_scatter): an attention whose projections go through latents
    (MLA) or a mixture of experts' MLP (the router and the dispatch stand between) has no such pair, None here."""
    out = []
    tokens = micro * max(1, seq // cp)  # the gathered (sequence-parallel) tokens of one micro-batch
    specs: dict[LayerSpec, int] = {}
    for spec in layer_specs(arch):
        specs[spec] = specs.get(spec, 0) + 1
    for spec, count in specs.items():
        def seconds(n: int, k: int):
            lp = low_precision
            fast = lp is not None and n % lp.dim_multiple == 0 and k % lp.dim_multiple == 0
            return _gemm_seconds(tokens, n, k, r, compute_bytes, lp.rate if fast else 1.0)
        into = out_of = up = down = None
        if kind_of(spec.attention).plain_projections:
            *projections, (n_out, k_out) = _attention_gemms(spec, arch.hidden_size, tp)
            into = sum(seconds(n, k) for n, k in projections)
            out_of = seconds(n_out, k_out)
        if not spec.mlp.is_moe:
            gemms = _mlp_gemms(spec, arch.hidden_size, tp)
            up = seconds(gemms[0].n, gemms[0].k) * gemms[0].count
            down = seconds(gemms[1].n, gemms[1].k)
        out.append((count, (into, out_of, up, down)))
    return out


def _bias_gradient_elements(arch: Architecture, s: LayerSpec, tp: int, sp: bool) -> float:
    """Elements of output gradient one token's block reads to reduce its biases' gradients, backward only
    (BIAS_GRADIENT_READS per biased linear).
    Column-parallel linears (all but the last of the attention's and of the MLP's) see out_features / tp
    of each token; the row-parallel last ones (output projection, down projection) the full hidden width,
    a 1/tp share of the tokens under sequence parallelism. A mixture of experts' MLP is not nn.Linear
    modules (its experts' biases are added outside a GEMM): only its attention's linears count."""
    width = arch.hidden_size / tp if sp else arch.hidden_size
    attention = attention_linears(arch, s)
    groups = [attention] + ([] if s.mlp.is_moe else [block_linears(arch, s)[len(attention):]])
    out = 0.0
    for linears in groups:
        for i, x in enumerate(linears):
            if x.bias:
                out += width if i == len(linears) - 1 else x.out_features / tp
    return out * BIAS_GRADIENT_READS


def _keys_per_query(s: LayerSpec, seq: int) -> float:
    """Mean keys one query attends to under the causal mask (and its window)."""
    a = s.attention
    if a.window != "full" and 0 < a.window_size < seq:
        w = a.window_size
        return w - w * w / (2 * seq)
    return seq / 2


_WORK: dict[tuple, tuple[Architecture, "Work"]] = {}


def work(arch: Architecture, seq: int, tp: int, cp: int, sp: bool, compute_bytes: int, eager: bool,
         r: Rates, kernel: str = "flash-attention-2", loss: str = "hf",
         low_precision: "LowPrecisionRate | None" = None, loss_chunks: int = 1, compiled: str = "none",
         frozen: FrozenBase | None = None, fused: tuple[str, ...] = (), unpad: str = "none") -> "Work":
    """One sequence's work on one GPU of a tp x cp group (the pipeline splits it later:
    pipeline.py), memoised per model object (an Architecture is not hashable; the plan search
    asks for the same one per setting). ``loss``: the loss implementation (planner/recipes/losses.py).
    ``compiled``: torch.compile of each block ("blocks", torchtitan) or of the whole model ("model", HF
    Trainer's torch_compile): the elementwise work as inductor fuses it (planner/time/fusion.py).
    ``frozen``: a frozen base's elementwise changes (LoRA / QLoRA: planner/time/elementwise.py FrozenBase;
    not with compile, which refuses LoRA: planner/recipes/compile.py). ``fused``: the block ops run as fused
    kernels (planner/recipes/fused_kernels.py; eager otherwise, not with compile: check_fused_kernels). ``unpad``:
    flash attention's varlen path over a padded batch (UNPAD; "none": the padded kernel)."""
    key = (id(arch), seq, tp, cp, sp, compute_bytes, eager, r, kernel, loss, low_precision, loss_chunks, compiled,
           frozen, fused, unpad)
    hit = _WORK.get(key)
    if hit is not None and hit[0] is arch:
        return hit[1]
    if len(_WORK) > 256:
        _WORK.clear()
    out = _work(arch, seq, tp, cp, sp, compute_bytes, eager, r, kernel, loss, loss_chunks, fusion.check_mode(compiled),
                frozen, fused)
    if unpad != "none" and not eager:
        out = _unpadded(out, arch, tp, compute_bytes, UNPAD[unpad])
    if low_precision is not None:
        out = _converted(out, compute_bytes, low_precision)
    _WORK[key] = (arch, out)
    return out


def _work(arch: Architecture, seq: int, tp: int, cp: int, sp: bool, compute_bytes: int, eager: bool,
          r: Rates, kernel: str, loss_kind: str = "hf", loss_chunks: int = 1, compiled: str = "none",
          frozen: FrozenBase | None = None, fused: tuple[str, ...] = ()) -> "Work":
    h = arch.hidden_size
    tokens = max(1, seq // cp)
    gemms: list[Gemm] = []
    attention_flops = attention_seconds = eager_bytes = bias_gradients = 0.0
    elementwise = frozen.adapters if frozen is not None else Traffic()  # the adapters', over every block
    rerun = dict.fromkeys(fusion.RERUN_POLICIES, 0.0)  # compiled: what a recompute moves (fusion.recompute_bytes)
    kernels = 0
    specs: dict[LayerSpec, int] = {}
    for spec in layer_specs(arch):
        specs[spec] = specs.get(spec, 0) + 1
    for spec, count in specs.items():
        proj = _attention_gemms(spec, h, tp)
        gemms += [Gemm(n, k, count) for n, k in proj]
        mlp = _mlp_gemms(spec, h, tp)
        gemms += [Gemm(g.n, g.k, g.count * count, g.token_fraction, routed=g.routed) for g in mlp]
        a = spec.attention
        heads = max(1, a.num_heads // tp)
        keys = _keys_per_query(spec, seq)
        # QKᵀ and AV: 2·head_dim + 2·v_head_dim FLOPs per query-key pair and head
        forward = 2 * (a.head_dim + a.v_head_dim) * tokens * keys * heads
        attention_flops += forward * count
        # under context parallelism each kernel call sees a chunk of seq / cp queries and keys
        # (ring attention passes the K/V chunks around): the measured rate at that length
        attention_seconds += forward * (1 + ATTENTION_BACKWARD_FLOPS) / (
            attention_tflops(r, tokens, a.head_dim, kernel) * 1e12) * count
        eager_bytes += heads * tokens * seq * 16 * count  # scores 2, softmax in fp32 4+4, probs 2+2, mask 2
        elementwise = elementwise + _block_traffic(arch, spec, tp, sp, compute_bytes, compiled,
                                                   frozen is not None, fused).times(count)
        if compiled != "none":
            for policy in rerun:
                rerun[policy] += fusion.recompute_bytes(arch, spec, tp, sp, compute_bytes, policy) * count
        bias_gradients += _bias_gradient_elements(arch, spec, tp, sp) * tokens * compute_bytes * count
        kernels += (len(proj) + len(mlp) + 1) * count  # the projections and attention (elementwise ops: Traffic)
    head = Gemm(max(1, arch.vocab_size // tp), h, 1)
    # Liger's and torchtitan's three head GEMMs run per chunk of tokens (liger_head)
    chunked = loss_kind in ("liger-fused", "chunked-in-forward")
    if not chunked:
        gemms.append(head)
    vocab = arch.vocab_size / tp
    # the plain cross-entropy (HF's ForCausalLMLoss, torchtitan's cross_entropy_loss) is compiled with the
    # model or apart (torchtitan); the others are their own kernels
    hf_bytes = (fusion.loss_bytes_per_logit(compiled, compute_bytes, LOSS_BYTES_PER_LOGIT) if loss_kind == "hf"
                else LOSS_BYTES_PER_LOGIT)
    loss = loss_bytes_per_logit(loss_kind, compute_bytes, hf_bytes) * vocab * tokens
    loss_recompute = 2.0 * tokens * head.n * head.k if loss_recomputes_logits(loss_kind) else 0.0
    last = layer_specs(arch)[-1]
    edge = fusion.edge_traffic(arch, last, tp, sp, compute_bytes,
                               edge_traffic(arch, last, tp, sp, compute_bytes, frozen, fused), compiled)
    if eager:
        attention_seconds = 0.0
    return Work(tokens=tokens, gemms=tuple(gemms), attention_flops=attention_flops,
                attention_seconds_fb=attention_seconds, eager_bytes=eager_bytes if eager else 0.0,
                elementwise_bytes=elementwise.forward_bytes * tokens, loss_bytes=loss,
                kernels=kernels + elementwise.forward_kernels + edge.forward_kernels + 8, layers=arch.num_layers,
                attention_forward_share=forward_share(kernel), loss_recompute_flops=loss_recompute,
                chunked_head=(head.n, head.k, loss_chunks if loss_kind == "chunked-in-forward" else 0)
                if chunked else None, bias_gradient_bytes=bias_gradients,
                elementwise_backward_bytes=elementwise.backward_bytes * tokens,
                edge_elementwise_bytes=(edge.forward_bytes + edge.backward_bytes) * tokens,
                elementwise_excess_bytes=elementwise.forward_excess_bytes * tokens,
                elementwise_backward_excess_bytes=elementwise.backward_excess_bytes * tokens,
                edge_excess_bytes=(edge.forward_excess_bytes + edge.backward_excess_bytes) * tokens,
                backward_kernels=2 * kernels + elementwise.backward_kernels + edge.backward_kernels + 8,
                compiled=compiled, elementwise_rerun_bytes=tuple((policy, bytes_ * tokens) for policy, bytes_ in
                                                                 rerun.items()) if compiled != "none" else ())


def _block_traffic(arch: Architecture, spec: LayerSpec, tp: int, sp: bool, c: int, compiled: str,
                   frozen: bool = False, fused: tuple[str, ...] = ()) -> Traffic:
    """A block's elementwise traffic: op by op in eager (a frozen base's norms without their weight
    gradients; Liger's kernels where ``fused`` names them), inductor's fused kernels (CUDA's) when compiled."""
    if compiled == "none":
        return block_traffic(arch, spec, tp, sp, c, frozen, fused)
    return fusion.block_traffic(arch, spec, tp, sp, c, "triton")


def forward_share(kernel: str) -> float:
    """The forward's share of a flash kernel's forward + backward time (FORWARD_OVER_BACKWARD_RATE)."""
    return 1.0 / (1.0 + ATTENTION_BACKWARD_FLOPS * FORWARD_OVER_BACKWARD_RATE.get(kernel, 1.0))


@dataclass(frozen=True)
class LowPrecisionRate:
    """A low_precision recipe as the time model reads it (planner/recipes/low_precision.py): a
    block's GEMMs whose two dimensions are multiples of ``dim_multiple`` run ``rate`` times the
    step dtype's matmul rate (the measured fp8 MAMF over the bf16 one where both are measured:
    H100 1402.6/794.5, H200 1453.4/794.5, B200 3432.5/1745.0, Bekman's table in gpus.yaml; else
    the datasheets' peaks, fp8 2x bf16 on Hopper and Blackwell), and every cast of one of their
    operands moves ``cast_bytes`` per element (low_precision.cast_bytes_per_element: torchao's
    eager float8 chain, or a fused kernel's read for the amax, read to convert and narrow write)."""

    rate: float
    dim_multiple: int
    cast_bytes: float


def _converted(w: "Work", compute_bytes: int, lp: LowPrecisionRate) -> "Work":
    """The work with a block's convertible GEMMs (not the LM head, the last GEMM; not a router or
    routed experts, token_fraction < 1 or count beyond the layers) at the low-precision rate, and
    their casts: per linear call the input and grad_output twice each (forward and grad_input,
    grad_weight; float8_linear.py matmul_with_hp_or_float8_args), the weight twice (forward, grad_input)."""
    per_cast = lp.cast_bytes
    gemms, casts, weights = [], 0.0, 0.0
    for i, g in enumerate(w.gemms):
        block = i < len(w.gemms) - 1 and g.token_fraction == 1.0 and not g.routed
        if block and g.n % lp.dim_multiple == 0 and g.k % lp.dim_multiple == 0:
            gemms.append(replace(g, rate=lp.rate))
            casts += 2 * (g.k + g.n) * g.count * w.tokens * per_cast
            weights += 2 * g.k * g.n * g.count * per_cast
        else:
            gemms.append(g)
    return replace(w, gemms=tuple(gemms), cast_bytes=casts, weight_cast_bytes=weights)


def _unpadded(w: "Work", arch: Architecture, tp: int, compute_bytes: int, u: Unpad) -> "Work":
    """``w`` with flash attention's varlen bookkeeping in every layer (UNPAD): the gathers and the scatter as
    elementwise traffic of the blocks (the forward's rerun by a checkpointing policy that reruns the blocks), their
    launches, and the host synchronisations' stalls."""
    fwd = bwd = 0.0
    for spec in layer_specs(arch):
        a = spec.attention
        heads, kv_heads = max(1, a.num_heads // tp), max(1, a.num_kv_heads // tp)
        gathered = heads * a.head_dim + kv_heads * (a.head_dim + a.v_head_dim)
        output = heads * a.v_head_dim
        fwd += UNPAD_PASSES["forward"]["gathered"] * gathered + UNPAD_PASSES["forward"]["output"] * output
        bwd += UNPAD_PASSES["backward"]["gathered"] * gathered + UNPAD_PASSES["backward"]["output"] * output
    layers = arch.num_layers
    return replace(w, elementwise_bytes=w.elementwise_bytes + fwd * compute_bytes * w.tokens,
                   elementwise_backward_bytes=w.elementwise_backward_bytes + bwd * compute_bytes * w.tokens,
                   kernels=w.kernels + layers * u.launches,
                   backward_kernels=w.backward_kernels + layers * u.backward_kernels,
                   stall_launches=layers * (u.syncs + u.launches))


def wave_efficiency(m, n, sms: int | None):
    """Busy fraction of the SMs over a GEMM's waves of output tiles (m, n: arrays or floats)."""
    if not sms:
        return arrays.full_like(arrays.as_float(m), 1.0)
    tiles = _ceil(arrays.as_float(m) / TILE_TOKENS) * _ceil(n / TILE_FEATURES)
    waves = _ceil(tiles / sms)
    return tiles / (waves * sms)


def _ceil(x):
    if arrays.is_array(x):
        import numpy as np

        return np.ceil(x)
    return float(math.ceil(x))


def k_efficiency(k, k_pipeline: float = K_PIPELINE):
    """The share of a tile's time spent in its K loop (module docstring: K_PIPELINE)."""
    return k / (k + k_pipeline)


def _gemm_seconds(m, n, k, r: Rates, compute_bytes: int, speedup=1.0):
    """One GEMM (m x k times k x n; m along the 128-row tiles): the slower of its tensor-core time
    (tile waves and the K loop's share included) and its operands' traffic. ``speedup``: a
    low-precision GEMM's rate over the step dtype's (LowPrecisionRate), its narrower operands' traffic alike.

    The shape's rate is a burst's; where the GPU's sustained rate is measured (Rates.sustained_flops) it
    is the ceiling on the kernel's achieved rate (the MSMF is one, its waves and prologue included): a
    long-K GEMM that a burst runs above it is held to it once the clock settles at the power limit, while
    a shorter K, already below it, keeps its rate (the MSMF's K walk on an H200: 2816 x
    1536 sustains 727 TFLOP/s at K = 20,480, 741 at 10,240, 749 at 6,144 at 1,879 MHz and 685 W, and 722 at
    4,096 at the 1,980 MHz ceiling, below the 700 W limit: gpus.yaml sustained_tflops). A low-precision
    GEMM's ceiling is the step dtype's times ``speedup`` (its burst ratio): 1,362 fp8 TFLOP/s on an H200,
    where the same README's fp8 runs sustained about 1,330-1,337."""
    flops = 2.0 * m * n * k
    rate = r.matmul_flops if r.mamf_k is None else arrays.minimum(r.matmul_flops, r.long_k_flops * k_efficiency(k, r.k_pipeline))
    compute = flops / (rate * speedup * wave_efficiency(m, n, r.sms))
    if r.first_wave_k and r.sms:  # the first wave's prologue, exposed once per SM: a tile's time over that K
        compute = compute + 2.0 * TILE_TOKENS * TILE_FEATURES * r.first_wave_k * r.sms / (r.long_k_flops * speedup)
    if r.sustained_flops is not None:  # the power limit's ceiling on the whole kernel's rate
        compute = arrays.maximum(compute, flops / (r.sustained_flops * speedup))
    traffic = compute_bytes * (m * k + k * n + m * n) / (r.memory_bytes_per_s * speedup)
    return arrays.maximum(compute, traffic)


# Which kinds of work each checkpointing policy runs again in backward, when no model says how much
# of each (a toy Work): all of it or none. A model's policy is measured by recompute_shares.
RECOMPUTED = {"none": frozenset(), "full": frozenset({"matmul", "attention", "elementwise"}),
              "selective-attention": frozenset({"attention"}), "selective-op": frozenset({"elementwise"})}


@dataclass(frozen=True)
class Recompute:
    """The share of each kind of forward work a checkpointing policy reruns in backward."""

    matmul: float = 0.0  # of the forward's matmul FLOPs
    attention: float = 0.0
    elementwise: float = 0.0

    @classmethod
    def of_kinds(cls, checkpointing: str) -> "Recompute":
        ops = RECOMPUTED.get(checkpointing, frozenset())
        return cls(*(1.0 if kind in ops else 0.0 for kind in ("matmul", "attention", "elementwise")))


_SHARES: dict[tuple, tuple[Architecture, Recompute]] = {}


def recompute_shares(arch: Architecture, checkpointing: str, every: int | None = None) -> Recompute:
    """What the policy reruns, from the model's blocks (memoised per model object):
    - full: the checkpointed blocks' forward (every block, or every N-th with checkpointing_every:
      activations.checkpointed_blocks), their linears' share of the forward's matmul FLOPs (the LM
      head is outside the blocks, never rerun);
    - selective-op (torchtitan's per-op SAC): the elementwise ops between the saved outputs, and the
      linears whose outputs it does not keep, every second mm per block (activations.
      selective_op_saved_linears); SDPA is saved;
    - selective-attention (Megatron's --recompute-granularity selective): the core attention."""
    key = (id(arch), checkpointing, every)
    hit = _SHARES.get(key)
    if hit is not None and hit[0] is arch:
        return hit[1]
    if len(_SHARES) > 256:
        _SHARES.clear()
    specs = layer_specs(arch)
    per_block = [sum(2.0 * x.in_features * x.out_features for x in block_linears(arch, spec)) for spec in specs]
    total = sum(per_block) + 2.0 * arch.vocab_size * arch.hidden_size
    if checkpointing == "full":
        chosen = checkpointed_blocks(len(specs), "full", every)
        blocks = sum(on for on in chosen) / max(1, len(specs))
        out = Recompute(sum(f for f, on in zip(per_block, chosen) if on) / total, blocks, blocks)
    elif checkpointing == "selective-op":
        out = Recompute(selective_op_rerun_flops(arch) / total, 0.0, 1.0)
    else:
        out = Recompute.of_kinds(checkpointing)
    _SHARES[key] = (arch, out)
    return out


@dataclass(frozen=True)
class ComputeTerms:
    """Seconds of one micro-batch on one GPU per kind of work (floats or arrays), and its FLOPs."""

    matmul: object
    attention: object
    elementwise: object
    recompute: object
    host: object
    hardware_flops: object
    backward: object = 0.0  # of the device seconds, the backward pass's (recompute included)
    bias_gradients: object = 0.0  # the biased linears' bias-gradient reductions (Work.bias_gradient_bytes)
    host_forward: object = 0.0  # of the host seconds, the forward pass's launches (the rest: backward's, recompute's)
    recompute_clocked: object = 0.0  # of the recompute, its GEMMs' and attention's seconds (the SM clock's work)
    stalls: object = 0.0  # the GPU idle at the varlen path's host synchronisations (UNPAD), forward and recompute

    @property
    def clocked(self):
        """The seconds of the kernels the SM clock paces, GEMMs and attention, recomputed ones included
        (planner/time/variation.py); the memory-bound rest runs at the HBM's clock."""
        return self.matmul + self.attention + self.recompute_clocked

    @property
    def seconds(self):
        """The micro-batch's device seconds and what its GPU waits for its launches (host_exposed_seconds)."""
        device = self.matmul + self.attention + self.elementwise + self.recompute + self.bias_gradients
        return device + host_exposed_seconds(self.host_forward, self.host - self.host_forward,
                                             device - self.backward, self.backward, self.stalls)


def host_exposed_seconds(host_forward, host_backward, forward, backward, stalls=0.0):
    """The seconds a micro-batch's GPU waits for its host: a kernel runs no sooner than the host has
    launched it, and within a micro-batch the host runs ahead of the GPU freely (eager PyTorch queues
    its launches; nothing synchronises the two before the loss is read). So the GPU ends the forward at
    the later of the host's forward launches and its own forward work, and the micro-batch at the later
    of that plus its backward work and the host's last launch: a pass whose host work outlasts its
    kernels (a small model's short kernels under a framework's per-module hooks) shows the difference,
    a backward the GPU takes longer than its launches absorbs none of the forward's. ``stalls``: where the host
    synchronises with the GPU inside a pass (the varlen path's unpad, UNPAD), the GPU idles that long besides."""
    after_forward = arrays.maximum(host_forward, forward)
    return arrays.maximum(after_forward + backward, host_forward + host_backward) - forward - backward + stalls


def liger_head(m_all, n: int, k: int, r: Rates, compute_bytes: int, accumulate_bytes: int, chunks: int = 0):
    """(forward, input-gradient, weight-gradient seconds, forward FLOPs) of the LM head under Liger's fused
    linear cross-entropy (liger_kernel 0.8.5 ops/fused_linear_cross_entropy.py): the micro-batch's ``m_all``
    tokens in chunks of liger_chunk_tokens (about tokens x hidden logits each), and per chunk the logits
    GEMM (chunk x n, reduced over k, line 164), the input's gradient (chunk x k, reduced over the
    vocabulary n, line 320) and the weight's, added into the whole n x k gradient by torch.addmm
    (line 341/364: reduced over the chunk's tokens, its output read and written once per chunk in the
    gradient's dtype, ``accumulate_bytes``: fp32 under autocast over fp32 weights, line 333). All three
    run in the forward; the time is the same wherever it falls. ``chunks`` > 0: torchtitan's
    ChunkedLossWrapper, the micro-batch's tokens in that many equal chunks (one slice of every
    sequence each), the same three GEMMs per chunk and the weight's gradient accumulated into the
    head's (AccumulateGrad's in-place add)."""
    if chunks:
        chunk = m_all / chunks
    elif arrays.is_array(m_all):  # liger_chunk_tokens over the plan's options
        import numpy as np

        inc_factor = -(-n // k)
        chunk = np.minimum(2.0 ** np.ceil(np.log2(np.maximum(1.0, np.ceil(m_all / inc_factor)))), m_all)
    else:
        chunk = float(liger_chunk_tokens(math.ceil(m_all), k, n))
    chunks = chunks or _ceil(m_all / chunk)
    forward = chunks * _gemm_seconds(chunk, n, k, r, compute_bytes)
    dgrad = chunks * _gemm_seconds(chunk, k, n, r, compute_bytes)
    accumulate = 2.0 * n * k * accumulate_bytes / r.memory_bytes_per_s
    wgrad = chunks * arrays.maximum(_gemm_seconds(n, k, chunk, r, compute_bytes), accumulate)
    return forward, dgrad, wgrad, 2.0 * m_all * n * k


def _gemm_operands(w: "Work", m_all):
    """(tokens, n, k, count, rate) of each GEMM, or once for all of them as (GEMMs x options) arrays."""
    if not arrays.is_array(m_all):
        return [(m_all * g.token_fraction, float(g.n), float(g.k), float(g.count), g.rate) for g in w.gemms]
    hit = _COLUMNS.get(id(w))
    if hit is None or hit[0] is not w:
        import numpy as np

        if len(_COLUMNS) > 256:
            _COLUMNS.clear()

        columns = np.array([(g.token_fraction, g.n, g.k, g.count, g.rate) for g in w.gemms],
                           dtype=np.float64).reshape(-1, 5)
        hit = _COLUMNS[id(w)] = (w, tuple(columns[:, j:j + 1] for j in range(5)))
    fraction, n, k, count, rate = hit[1]
    # without low-precision GEMMs every rate is 1: a scalar keeps the array arithmetic as it was
    return [(fraction * m_all[None, :], n, k, count, rate if w.cast_bytes else 1.0)]


_COLUMNS: dict[int, tuple["Work", tuple]] = {}  # a Work's GEMMs as numpy columns (the plan asks per setting)


def _sum_rows(x):
    return x.sum(axis=0) if arrays.is_array(x) and x.ndim == 2 else x


def micro_batch_terms(w: Work, micro, r: Rates, compute_bytes: int, checkpointing: str,
                      frozen_matmuls: float = 0.0, shares: Recompute | None = None,
                      gradient_bytes: int | None = None) -> ComputeTerms:
    """One micro-batch of ``micro`` sequences (a float or an array). ``frozen_matmuls``: the
    fraction of the matmul FLOPs whose weights are frozen (LoRA: no weight gradient for them);
    ``shares``: what the policy reruns (recompute_shares; without it, all or none of each kind);
    ``gradient_bytes``: the weights' gradient dtype where a kernel accumulates into it (liger_head;
    None: the compute dtype).
    A plan's array of options is computed once per Work and arguments: every strategy, shard
    group and offload of a layout asks the same (the arrays come back read-only)."""
    if not arrays.is_array(micro):
        return _micro_batch_terms(w, micro, r, compute_bytes, checkpointing, frozen_matmuls, shares, gradient_bytes)
    key = (id(w), micro.tobytes(), r, compute_bytes, checkpointing, frozen_matmuls, shares, gradient_bytes)
    hit = _TERMS.get(key)
    if hit is None or hit[0] is not w:
        if len(_TERMS) > 256:
            _TERMS.clear()
        terms = _micro_batch_terms(w, micro, r, compute_bytes, checkpointing, frozen_matmuls, shares, gradient_bytes)
        for value in vars(terms).values():
            if arrays.is_array(value):
                value.flags.writeable = False
        hit = _TERMS[key] = (w, terms)
    return hit[1]


_TERMS: dict[tuple, tuple[Work, "ComputeTerms"]] = {}  # micro_batch_terms of the plan's option arrays


def _micro_batch_terms(w: Work, micro, r: Rates, compute_bytes: int, checkpointing: str,
                       frozen_matmuls: float, shares: "Recompute | None",
                       gradient_bytes: int | None = None) -> ComputeTerms:
    m_all = arrays.as_float(micro) * w.tokens
    forward = dgrad = wgrad = flops = 0.0
    if w.chunked_head is not None:
        n, k, chunks = w.chunked_head
        forward, dgrad, wgrad, flops = liger_head(m_all, n, k, r, compute_bytes,
                                                  gradient_bytes or compute_bytes, chunks)
    # the plan's array of options: every GEMM at once (rows: GEMMs, columns: options); an estimate's
    # float: GEMM by GEMM. The same formulas (_gemm_seconds) either way.
    for m, n, k, count, rate in _gemm_operands(w, m_all):
        fwd = _gemm_seconds(m, n, k, r, compute_bytes, rate) * count
        forward = forward + _sum_rows(fwd)
        dgrad = dgrad + _sum_rows(_gemm_seconds(m, k, n, r, compute_bytes, rate) * count)
        # the weight gradient: an n x k output reduced over the tokens
        wgrad = wgrad + _sum_rows(_gemm_seconds(n, k, m, r, compute_bytes, rate) * count)
        flops = flops + _sum_rows(2.0 * m * n * k * count)
    backward = dgrad + wgrad * (1 - frozen_matmuls)
    matmul = forward + backward
    matmul_flops = flops * (3 - frozen_matmuls)
    micro_f = arrays.as_float(micro)
    if w.eager_bytes:
        eager_flops = 2 * w.attention_flops  # eager computes the masked half too
        attn_fwd = micro_f * (eager_flops / r.steady_flops + w.eager_bytes / r.memory_bytes_per_s)
        attention = attn_fwd * 3
        attention_flops = micro_f * eager_flops * 3
    else:
        attn_fwd = micro_f * w.attention_seconds_fb * w.attention_forward_share
        attention = micro_f * w.attention_seconds_fb
        attention_flops = micro_f * w.attention_flops * (1 + ATTENTION_BACKWARD_FLOPS)
    elementwise_fwd = micro_f * (w.elementwise_bytes + w.elementwise_excess_bytes) / r.memory_bytes_per_s
    elementwise_bwd = micro_f * (w.elementwise_backward_bytes + w.elementwise_backward_excess_bytes) / r.memory_bytes_per_s
    edge = micro_f * (w.edge_elementwise_bytes + w.edge_excess_bytes) / r.memory_bytes_per_s
    elementwise = elementwise_fwd + elementwise_bwd + edge + micro_f * w.loss_bytes / r.memory_bytes_per_s
    if w.cast_bytes or w.weight_cast_bytes:  # low precision's casts (LowPrecisionRate)
        elementwise = elementwise + (micro_f * w.cast_bytes + w.weight_cast_bytes) / r.memory_bytes_per_s
    share = shares if shares is not None else Recompute.of_kinds(checkpointing)
    fused = dict(w.elementwise_rerun_bytes).get(checkpointing)  # compiled: the fused kernels' bytes
    rerun = elementwise_fwd if fused is None else micro_f * fused / r.memory_bytes_per_s
    recompute_clocked = forward * share.matmul + attn_fwd * share.attention
    recompute = recompute_clocked + rerun * share.elementwise
    hardware = matmul_flops + attention_flops + flops * share.matmul + micro_f * w.attention_flops * share.attention
    kernels = w.kernels * (1 + max(share.matmul, share.attention, share.elementwise)) + w.backward_kernels
    if w.loss_recompute_flops:  # CCE's backward reruns the LM head's forward matmul
        loss_recompute = micro_f * w.loss_recompute_flops
        recompute = recompute + loss_recompute / r.steady_flops
        recompute_clocked = recompute_clocked + loss_recompute / r.steady_flops
        hardware = hardware + loss_recompute
    host = arrays.full_like(m_all, kernels * r.host_seconds_per_kernel)
    stalls = arrays.full_like(m_all, w.stall_launches * (1 + share.attention) * r.host_seconds_per_kernel)
    host_forward = arrays.full_like(m_all, w.kernels * r.host_seconds_per_kernel)
    # backward: the GEMMs' gradients, attention's backward (2.5 of its 3.5), the elementwise
    # backward, the loss's gradient half, and the recomputed forward that runs inside it
    loss = micro_f * w.loss_bytes / r.memory_bytes_per_s
    # a frozen base's biases get no gradient (LoRA): no reduction
    bias = micro_f * w.bias_gradient_bytes * (1 - frozen_matmuls) / r.memory_bytes_per_s
    backward_seconds = backward + (attention - attn_fwd) + elementwise_bwd + edge / 2 + loss / 2 + recompute + bias
    return ComputeTerms(matmul=matmul, attention=attention, elementwise=elementwise, recompute=recompute,
                        host=host, hardware_flops=hardware, backward=backward_seconds, bias_gradients=bias,
                        host_forward=host_forward, recompute_clocked=recompute_clocked, stalls=stalls)


def train_metric_bytes_per_logit(compute_bytes: int, autocast: bool) -> float:
    """Bytes each logit moves through one train metric's cross-entropy (planner/recipes/loop.py): under
    autocast the cast of the 16-bit logits to fp32 (read, write 4) and the forward on fp32 logits
    (CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_LOGIT, its reads and writes scaling with the width); without, the
    forward on the logits' own width."""
    fp32 = 4
    if autocast:
        cast = 0 if compute_bytes == fp32 else compute_bytes + fp32
        return cast + CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_LOGIT
    return CROSS_ENTROPY_FORWARD_BYTES_PER_FP32_LOGIT * compute_bytes / fp32


# AdamW stepped one kernel per line (torch 2.13 optim/adam.py _single_tensor_adam, lines 416-546; composer
# v0.14.0 optim/decoupled_weight_decay.py DecoupledAdamW.adamw, lines 248-275, the same lines with
# mul_ + add_ for lerp_), in units of one element of the state (each of the two), the parameter and
# the gradient, read + written per kernel:
#   param.mul_(1 - lr * wd)                   param 2   (both defaults decay: torch 1e-2, composer 1e-5)
#   exp_avg.lerp_(grad, 1 - beta1)            state 2, grad 1
#   exp_avg_sq.mul_(beta2)                    state 2
#   .addcmul_(grad, grad, value=1 - beta2)    state 2, grad 1
#   denom = exp_avg_sq.sqrt()                 state 2   (a new tensor of the state's dtype)
#   / bias_correction2_sqrt                   state 2
#   .add_(eps)                                state 2
#   param.addcdiv_(exp_avg, denom)            param 2, state 2
UNFUSED_ADAMW_STATE_UNITS = 14
UNFUSED_ADAMW_PARAM_UNITS = 4
UNFUSED_ADAMW_GRAD_UNITS = 2
UNFUSED_ADAMW_KERNELS = 8  # the lines above, each one launch per parameter tensor


def optimizer_step_seconds(elements: float, state_bits: float, master_bits: int, weight_bits: int, grad_bits: int,
                           r: Rates, unfused: bool = False) -> float:
    """The optimizer's step over this GPU's elements: it reads and writes its states and the
    master (or the weights), reads the gradient, and writes the compute copy where a master exists.
    ``unfused``: AdamW's update one kernel per line (UNFUSED_ADAMW_*), each kernel's reads and writes;
    ``state_bits`` is then both moments' bits."""
    param_bits = master_bits or weight_bits
    copy_out = weight_bits / 8 if master_bits else 0
    if unfused:
        per_element = (UNFUSED_ADAMW_STATE_UNITS * state_bits / 2 + UNFUSED_ADAMW_PARAM_UNITS * param_bits +
                       UNFUSED_ADAMW_GRAD_UNITS * grad_bits) / 8 + copy_out
    else:
        per_element = 2 * (state_bits + param_bits) / 8 + grad_bits / 8 + copy_out
    return elements * per_element / r.memory_bytes_per_s


# Clipping by the global norm, before the step, over the gradients this rank steps: one pass reads them for the
# local norm, one reads and writes them to scale by max_norm / (norm + 1e-6) clamped at 1, always applied (no
# host sync): torch 2.13 distributed/fsdp/fully_sharded_data_parallel.py FullyShardedDataParallel.clip_grad_norm_
# (_get_grad_norm: torch.linalg.vector_norm per gradient, line 2119; ``grad.mul_(clip_coef_clamped...)`` per
# gradient, line 1204), torch nn/utils/clip_grad.py (_foreach_norm line 95, then _foreach_mul_ line 173), the same bytes. The
# norms' all-reduce is one scalar. Passes over the gradient's bytes:
CLIP_GRADIENT_PASSES = 3


def gradient_clipping_seconds(elements: float, grad_bits: int, r: Rates) -> float:
    """Clipping ``elements`` gradients of ``grad_bits`` by their global norm (CLIP_GRADIENT_PASSES)."""
    return elements * CLIP_GRADIENT_PASSES * grad_bits / 8 / r.memory_bytes_per_s
