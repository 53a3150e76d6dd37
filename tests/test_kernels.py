"""The kernel model of the step's compute (planner/time/kernels.py), pinned to hand-derived numbers."""

import json
from pathlib import Path

import pytest
from dataclasses import replace

from planner.model.architecture import from_hf_config, layer_specs
from planner.model.catalogue import catalogue_model
from planner.cluster.gpus import load_gpus
from planner.time.kernels import (FLASH_ATTENTION_CAUSAL_TFLOPS, Gemm, Rates, Work, _gemm_seconds, attention_tflops,
                                  causal_backward_tflops, causal_forward_backward_tflops, forward_share,
                                  long_sequence_tflops,
                                  micro_batch_terms, optimizer_step_seconds, rates, wave_efficiency, work)
from planner.errors import PlannerError
from planner.schema import EstimateRequest
from planner.model.shapes import parameter_shapes
from planner.time.kernels import HOST_SECONDS_PER_KERNEL, UNFUSED_ADAMW_KERNELS
from planner.time.step import estimate_with_time

A100 = load_gpus()["a100-80gb"]
H100 = load_gpus()["h100-80gb"]


def test_rates_read_the_measured_mamf_and_the_bandwidth():
    r = rates(A100, "bf16")
    assert r.matmul_flops == 271.2e12 and r.sms == 108  # Bekman's MAMF table: A100 SXM 271.2 TFLOP/s
    assert r.memory_bytes_per_s == pytest.approx(2039e9 * 0.83)  # datasheet x timing.MEMORY_BANDWIDTH_EFFICIENCY
    assert rates(H100, "bf16").attention_reference == "h100" and r.attention_reference == "a100"


def test_wave_quantisation():
    # 4096 x 4096 outputs in 128 x 256 tiles: 32 x 16 = 512 tiles; on 108 SMs 5 waves of 108 = 540 slots
    assert wave_efficiency(4096.0, 4096, 108) == pytest.approx(512 / 540)
    # 128 x 256 x 108 outputs: exactly one full wave
    assert wave_efficiency(128.0 * 108, 256, 108) == pytest.approx(1.0)
    assert wave_efficiency(4096.0, 4096, None) == 1.0  # no SM count: no derating


def test_attention_rate_interpolates_the_measured_table():
    r = rates(A100, "bf16")
    table = FLASH_ATTENTION_CAUSAL_TFLOPS[("flash-attention-2", "a100")]
    assert attention_tflops(r, 2048, 128) == pytest.approx(table[128][2])  # 155 TFLOP/s, measured
    assert attention_tflops(r, 4096, 96) == pytest.approx((table[64][3] + table[128][3]) / 2)  # width midway
    # past 16k: R·s / (s + S0) through 8k (182) and 16k (189): S0 = 16384 x (189/182 - 1) / (2 - 189/182)
    # = 656 tokens, R = 189 x (16384 + 656) / 16384 = 196.6; at 64k 196.6 x 65536 / 66192 = 194.6
    assert attention_tflops(r, 65536, 128) == pytest.approx(194.6, abs=0.05)
    assert attention_tflops(r, 16384, 128) == pytest.approx(table[128][-1])
    assert long_sequence_tflops(80.0, 80.0, 16384, 65536) == 80.0  # a flat curve stays flat
    # between 4k and 8k, log-linear in the length: 5,793 tokens is halfway
    assert attention_tflops(r, 5793, 128) == pytest.approx((173 + 182) / 2, rel=1e-3)
    # FlashAttention's Triton kernel has no chart of its own: FlashAttention 1.x's rates, which its
    # header says it runs slightly below (kernels.STAND_IN); at width 128 at least its width-64 rate, since
    # it keeps its 128 x 128 tiles at both widths (kernels.WIDTH_KEEPS_TILE), where FlashAttention 1.x's
    # own width-128 line runs below its 64: on H100 at 2k 136 TFLOP/s (the 64 line), not the 128 line's 108
    h = rates(H100, "bf16")
    assert attention_tflops(h, 2048, 128, "flash-attention-1") == pytest.approx(108.0)
    assert attention_tflops(h, 2048, 128, "flash-attention-triton") == pytest.approx(136.0)
    assert attention_tflops(r, 32768, 64, "flash-attention-triton") == attention_tflops(r, 32768, 64,
                                                                                       "flash-attention-1")
    assert attention_tflops(r, 8192, 128, "flash-attention-1") == pytest.approx(80.0)  # not the chart's Triton 78
    assert attention_tflops(r, 8192, 128, "flash-attention-triton") == pytest.approx(92.0)
    # between the widths: the interpolation where it is the higher (A100 at 512: 55 at 128 under 58 at 64)
    assert attention_tflops(r, 512, 96, "flash-attention-triton") == pytest.approx(58.0)
    assert attention_tflops(r, 2048, 128, "flash-attention-2") == pytest.approx(table[128][2])  # FA2: unbounded


def test_hopper_kernels_read_back_from_the_flashattention_3_charts():
    # FlashAttention-3 paper, H100, head 128, 8k: causal forward 602, unmasked forward 646 and
    # backward 559 TFLOP/s; the causal backward is 559 x 602 / 646 = 520.9, and forward + backward
    # 3.5 / (1/602 + 2.5/520.9) = 541.8
    h = rates(H100, "bf16")
    assert causal_backward_tflops("flash-attention-3", 128)[4] == pytest.approx(559 * 602 / 646)
    assert attention_tflops(h, 8192, 128, "flash-attention-3") == pytest.approx(541.8, abs=0.05)
    # cuDNN at 2k, head 64: forward 334 causal, 395 unmasked, backward 395: the causal backward 334,
    # so forward + backward 334 as well
    assert attention_tflops(h, 2048, 64, "cudnn") == pytest.approx(334.0)
    # between the charted lengths and widths as for the other kernels: 4k-8k log-linear, 96 midway
    fa3 = FLASH_ATTENTION_CAUSAL_TFLOPS[("flash-attention-3", "h100")]
    assert attention_tflops(h, 5793, 96, "flash-attention-3") == pytest.approx(
        (fa3[64][3] + fa3[64][4] + fa3[128][3] + fa3[128][4]) / 4, rel=1e-3)
    # the separate passes of FlashAttention-2 in the same paper give its own forward + backward chart
    # within 11% (512, head 128) and 8%, always slower than the chart: the causal-backward reading
    # over-times rather than under-times
    for d in (64, 128):
        derived, chart = causal_forward_backward_tflops("flash-attention-2", d), \
            FLASH_ATTENTION_CAUSAL_TFLOPS[("flash-attention-2", "h100")][d]
        assert all(0.88 < x / c <= 1.0 for x, c in zip(derived, chart))
    # forward over backward: unmasked 646 / 559 for FlashAttention-3, 600 / 518 for cuDNN
    assert forward_share("cudnn") == pytest.approx(1 / (1 + 2.5 * 600 / 518))
    # no A100 measurement: refused, not read at another GPU's rate
    with pytest.raises(PlannerError, match="attention_kernel 'flash-attention-3'"):
        attention_tflops(rates(A100, "bf16"), 2048, 128, "flash-attention-3")
    # nor on a GPU whose peak is near the H100's but is not a Hopper: Blackwell (FlashAttention-3 is sm90's build;
    # cuDNN's rates there unmeasured) and ROCm (no cuDNN)
    for name in ("b200", "mi300x"):
        for kernel in ("flash-attention-3", "cudnn"):
            with pytest.raises(PlannerError, match=f"attention_kernel '{kernel}' is measured on Hopper"):
                attention_tflops(rates(load_gpus()[name], "bf16"), 2048, 128, kernel)
    assert attention_tflops(rates(load_gpus()["h200"], "bf16"), 2048, 128, "cudnn") > 0


def test_the_h200s_sdpa_ran_at_hoppers_kernels_rates_not_flashattention_2s():
    # bench/results/gpu_check_h200_1.json: torch 2.11+cu130's SDPA, causal, head 128, 8k tokens:
    # 579 forward, 509 backward, 527 TFLOP/s together; the H200 has the H100's SMs and clocks
    measured = json.loads((Path(__file__).parents[1] / "bench/results/gpu_check_h200_1.json").read_text())
    row = next(a for a in measured["kernels"]["attention"] if a["seq"] == 8192)
    together = 3.5 / (1 / row["forward_tflops"] + 2.5 / row["backward_tflops"])
    h200 = rates(load_gpus()["h200"], "bf16")
    assert together / attention_tflops(h200, 8192, 128, "flash-attention-2") > 1.7  # not the 2023 kernel
    for kernel in ("flash-attention-3", "cudnn"):  # FlashAttention-3 542 (+3%), cuDNN of 2024 475 (-10%)
        assert abs(attention_tflops(h200, 8192, 128, kernel) / together - 1) < 0.11


def test_what_each_checkpointing_policy_reruns_of_llama_3_8b():
    # Llama-3-8B: 32 blocks of q 4096x4096, k and v 4096x1024, o 4096x4096, gate, up, down 4096x14336
    # (53,248 x 4096 weights a block), and the untied head 4096 x 128,256, never rerun
    from planner.time.kernels import recompute_shares

    arch = catalogue_model("llama-3-8b").architecture
    total = 32 * 53248 + 128256
    # torchtitan's per-op SAC reruns every second mm of a block in call order: k, o and up
    op = recompute_shares(arch, "selective-op")
    assert op.matmul == pytest.approx(32 * (1024 + 4096 + 14336) / total) and op.attention == 0 and op.elementwise == 1
    # full checkpointing of every second block: 16 blocks' linears, attention and elementwise
    every = recompute_shares(arch, "full", 2)
    assert every.matmul == pytest.approx(16 * 53248 / total) and every.attention == every.elementwise == 0.5
    assert recompute_shares(arch, "selective-attention").matmul == 0


def test_checkpointing_reruns_the_attention_forward_at_its_own_rate():
    # Triton tutorial's causal head-64 attention at 2k: 136.5 TFLOP/s forward, 76.2 backward over 2.5x
    # the FLOPs: of 1 s forward + backward the forward is 1 / 136.5 over (1 / 136.5 + 2.5 / 76.2) = 18.3%
    from planner.time.kernels import forward_share

    assert forward_share("flash-attention-triton") == pytest.approx((1 / 136.5) / (1 / 136.5 + 2.5 / 76.2))
    assert forward_share("flash-attention-triton") == pytest.approx(0.183, abs=1e-3)
    # FlashAttention-2 on A100: forward up to 73% of peak, backward up to 63%
    assert forward_share("flash-attention-2") == pytest.approx((1 / 73) / (1 / 73 + 2.5 / 63))
    w = Work(tokens=2048, gemms=(), attention_flops=0.0, attention_seconds_fb=1.0, eager_bytes=0.0,
             elementwise_bytes=0.0, loss_bytes=0.0, kernels=0, layers=1,
             attention_forward_share=forward_share("flash-attention-triton"))
    t = micro_batch_terms(w, 1, R, 2, "full")
    assert t.attention == pytest.approx(1.0) and t.recompute == pytest.approx(0.183, abs=1e-3)


def _square_tflops(r: Rates, n: int) -> float:
    return 2.0 * n ** 3 / _gemm_seconds(float(n), n, n, r, 2) / 1e12


def test_the_k_loop_share_reproduces_nvidia_a100_square_gemms():
    # NVIDIA, "CUDA 11 Features Revealed" (2020), Figure 6, cuBLAS bf16 on A100 (reproduced in Bekman's
    # compute/accelerator/README.md): m = n = k = 8192 reads 290 TFLOP/s, 4096 260, 2560 ~240, 2048 ~200.
    # Placed at the 8192 point (its K as the measured shape), the K loop's share and the tile waves give
    # the others; 2048 is within 5% (cuBLAS switches to smaller tiles there: the waves fill better)
    a100 = Rates(matmul_flops=290e12, matmul_source="figure", memory_bytes_per_s=1e15, sms=108,
                 attention_reference="a100", attention_scale=1.0, mamf_k=8192)
    assert _square_tflops(a100, 8192) == pytest.approx(290 * wave_efficiency(8192.0, 8192, 108))
    assert _square_tflops(a100, 4096) == pytest.approx(260, rel=0.02)
    assert _square_tflops(a100, 2560) == pytest.approx(240, rel=0.03)


def test_a_gemm_runs_at_the_mamf_from_its_measured_k_and_below_it_for_shorter_k():
    # Bekman's MAMF table: A100 SXM 271.2 TFLOP/s at 1024x10240x5120; one full wave of tiles. The
    # A100 80GB moves 2,039 GB/s where the figure's A100 40GB moved 1,555: its tile's fixed traffic
    # costs K0 = 512 x 1555 / 2039 = 390 of K loop
    r = replace(rates(A100, "bf16"), sustained_flops=None)  # the burst's curve (the sustained ceiling below)
    k0 = 512 * 1555 / 2039
    assert r.k_pipeline == pytest.approx(k0)
    m, n = 128.0 * 108, 256
    for k, share in ((5120, 1.0), (16384, 1.0), (2048, (2048 / (2048 + k0)) / (5120 / (5120 + k0)))):
        assert 2 * m * n * k / _gemm_seconds(m, n, k, r, 2) == pytest.approx(271.2e12 * share)
    # at the 400 W limit a long-K GEMM holds 257.5 (gpus.yaml sustained_tflops); the short K, below it, keeps its rate
    held = rates(A100, "bf16")
    assert 2 * m * n * 16384 / _gemm_seconds(m, n, 16384, held, 2) == pytest.approx(257.5e12)
    assert _gemm_seconds(m, n, 2048, held, 2) == _gemm_seconds(m, n, 2048, r, 2)
    # Hopper is measured (XLA's sm_90 table), not scaled from the A100 figure: K0 153 under other waves,
    # the first wave's 481 exposed once
    h100 = rates(H100, "bf16")
    assert (h100.k_pipeline, h100.k_pipeline + h100.first_wave_k) == (153.0, 481.0)
    assert r.first_wave_k == 0.0


# XLA's measured sm_90 bf16 matmul rates (openxla xla/service/gpu/model/matmul_interpolator_data.h,
# kDefaultMatmulPTable "sm_90"; tensorflow/tensorflow 372d578): (batch, m, n, k, TFLOP/s)
XLA_SM90 = [(1, 4096, 4096, 4096, 783.3), (2, 4096, 4096, 2048, 763.0), (2, 4096, 2048, 4096, 783.2),
            (1, 2048, 2048, 2048, 632.0), (4, 2048, 2048, 2048, 725.7), (4, 4096, 4096, 512, 619.9),
            (1, 4096, 4096, 256, 392.2), (4, 4096, 4096, 256, 503.9), (2, 4096, 1024, 4096, 750.6),
            (2, 4096, 512, 4096, 729.7), (4, 4096, 1024, 1024, 673.8), (2, 2048, 4096, 1024, 678.7),
            (1, 4096, 2048, 512, 447.0), (4, 1024, 2048, 2048, 712.7)]


@pytest.mark.parametrize("b,m,n,k,measured", XLA_SM90)
def test_hopper_gemms_run_at_xlas_measured_sm90_rates(b, m, n, k, measured):
    # the batch's matrices one after another along m (the tiles' waves); within 8% of what XLA measured.
    # XLA's table times bursts: the burst curve, without the sustained ceiling (the next tests)
    r = replace(rates(H100, "bf16"), sustained_flops=None)
    modelled = 2 * b * m * n * k / _gemm_seconds(float(b * m), n, k, r, 2) / 1e12
    assert modelled == pytest.approx(measured, rel=0.08)


# The MSMF's K walk on an H200 (stas00/ml-engineering compute/accelerator/benchmarks/README.md, "The K walk"):
# 2816 x 1536 outputs (132 tiles, one wave) sustained 749 TFLOP/s at K = 6,144 and 741 at 10,240 at the power
# limit, 727 at 20,480, and 722 at K = 4,096, where the clock reached its 1,980 MHz ceiling below the limit
H200_K_WALK = [(4096, 722.0), (6144, 749.0), (10240, 741.0), (20480, 727.0)]


@pytest.mark.parametrize("k,measured", H200_K_WALK)
def test_a_hopper_gemm_runs_at_the_lesser_of_its_burst_rate_and_the_sustained_one(k, measured):
    r = rates(load_gpus()["h200"], "bf16")
    assert r.sustained_flops == pytest.approx(744.5e12) and r.steady_flops == r.sustained_flops
    modelled = 2 * 2816 * 1536 * k / _gemm_seconds(2816.0, 1536, k, r, 2) / 1e12
    assert modelled == pytest.approx(measured, rel=0.04)
    assert modelled <= 744.5 + 1e-9


def test_the_sustained_ceiling_holds_long_k_gemms_down_and_leaves_short_k_ones():
    h100 = rates(H100, "bf16")
    burst = replace(h100, sustained_flops=None)
    long_k = (16384.0, 4096, 16384)  # an MLP's down projection: its burst rate is above the ceiling
    short_k = (16384.0, 4096, 512)  # a tp-8 row-parallel linear: below it, unchanged
    flops = 2 * 16384 * 4096 * 16384
    assert flops / _gemm_seconds(*long_k, burst, 2) > 760e12
    assert flops / _gemm_seconds(*long_k, h100, 2) == pytest.approx(703.7e12)
    assert _gemm_seconds(*short_k, h100, 2) == _gemm_seconds(*short_k, burst, 2)
    # no sustained rate is published for the GH200: no ceiling; fp16 shares bf16's tensor cores and its ceiling
    assert rates(load_gpus()["gh200"], "bf16").sustained_flops is None
    assert rates(H100, "fp16").sustained_flops == pytest.approx(703.7e12)
    assert "sustained 703.7 TFLOP/s" in h100.matmul_source and "power limit" in h100.matmul_source


def test_the_h100s_16k_matmul_reads_back_in_a_burst_and_at_the_power_limit():
    # Standard Kernel's H100 SXM5 at 700 W (gpus.yaml): 16,384^3 in 11.04 ms with 500 ms of sleep between trials
    # (a burst at 1,970-1,980 MHz) and 12.5 ms run back to back (the steady state)
    h100 = rates(H100, "bf16")
    shape = (16384.0, 16384, 16384)
    # the burst within 2%: the model's 128 x 256 tiles, 8,192 of them over 132 SMs in 63 waves, 98.5% busy
    assert _gemm_seconds(*shape, replace(h100, sustained_flops=None), 2) == pytest.approx(11.04e-3, rel=0.02)
    assert _gemm_seconds(*shape, h100, 2) == pytest.approx(12.5e-3, rel=1e-3)


def test_a_tensor_parallel_gemm_keeps_most_of_its_rate_on_hopper():
    # a row-parallel linear at tp 8 of a 4,096-wide model reduces over K = 512: XLA measured 620 TFLOP/s
    # for 16 waves of 4,096 x 4,096 outputs at that K; the A100-scaled K0 (753) had given it 329
    r = rates(H100, "bf16")
    assert 2 * 16384 * 4096 * 512 / _gemm_seconds(16384.0, 4096, 512, r, 2) / 1e12 > 560


def test_the_weight_gradient_reduces_over_the_tokens():
    # 256 tokens through 8192 x 8192 (compute-bound at this bandwidth): forward and input gradient
    # reduce over 8192, the weight gradient over 256 tokens: its K loop is 256 / (256 + 512) busy
    fast = Rates(matmul_flops=1e15, matmul_source="test", memory_bytes_per_s=1e18, sms=None,
                 attention_reference="a100", attention_scale=1.0, mamf_k=8192)
    w = Work(tokens=256, gemms=(Gemm(8192, 8192, 1),), attention_flops=0.0, attention_seconds_fb=0.0,
             eager_bytes=0.0, elementwise_bytes=0.0, loss_bytes=0.0, kernels=0, layers=1)
    flops = 2 * 256 * 8192 * 8192
    t = micro_batch_terms(w, 1, fast, 2, "none")
    assert t.matmul == pytest.approx(2 * flops / 1e15 + flops / (1e15 / (8192 / 8704) * 256 / 768))


def _toy(gemm: Gemm, attention_seconds: float = 0.0, elementwise: float = 0.0, backward: float = 0.0) -> Work:
    return Work(tokens=2048, gemms=(gemm,), attention_flops=0.0, attention_seconds_fb=attention_seconds,
                eager_bytes=0.0, elementwise_bytes=elementwise, loss_bytes=0.0, kernels=0, layers=1,
                elementwise_backward_bytes=backward)


R = Rates(matmul_flops=1e15, matmul_source="test", memory_bytes_per_s=1e12, sms=None, attention_reference="a100",
          attention_scale=1.0)


def test_a_gemm_runs_forward_input_and_weight_gradients_and_recomputes_its_forward():
    # 8 x 2048 tokens x 8192 x 8192: 2 M N K = 2.2e12 FLOPs forward, 2.2 ms at 1e15 FLOP/s; its
    # operands, 2 x (M K + K N + M N) = 0.67 GB at 1e12 B/s, 0.67 ms: compute-bound
    w = _toy(Gemm(8192, 8192, 1))
    forward = 2 * 16384 * 8192 * 8192 / 1e15
    none = micro_batch_terms(w, 8, R, 2, "none")
    full = micro_batch_terms(w, 8, R, 2, "full")
    frozen = micro_batch_terms(w, 8, R, 2, "none", frozen_matmuls=1.0)
    assert none.matmul == pytest.approx(3 * forward) and none.recompute == 0
    assert full.recompute == pytest.approx(forward)  # full checkpointing: the forward again
    assert frozen.matmul == pytest.approx(2 * forward)  # no weight gradient for a frozen weight
    assert full.hardware_flops == pytest.approx(4 * forward * 1e15)  # HFU counts the recompute
    # DDP's all-reduce hides behind backward only: the two gradient GEMMs, and the recomputed
    # forward that runs inside backward under full checkpointing
    assert none.backward == pytest.approx(2 * forward) and full.backward == pytest.approx(3 * forward)


def test_a_skinny_gemm_is_bandwidth_bound():
    # one sequence of 16 tokens through 8192 x 8192: 2.1 GFLOPs (2.1 µs), but its weight alone is
    # 2 x 67 MB = 134 MB at 1e12 B/s: 134 µs
    w = Work(tokens=16, gemms=(Gemm(8192, 8192, 1),), attention_flops=0.0, attention_seconds_fb=0.0,
             eager_bytes=0.0, elementwise_bytes=0.0, loss_bytes=0.0, kernels=0, layers=1)
    t = micro_batch_terms(w, 1, R, 2, "none")
    assert t.matmul == pytest.approx(3 * 2 * (16 * 8192 * 2 + 8192 * 8192) / 1e12)


def test_memory_bound_work_and_the_host():
    # 1 MB of elementwise traffic per sequence forward, 2.5 MB backward, at 1e12 B/s
    w = _toy(Gemm(8, 8, 1), elementwise=1e6, backward=2.5e6)
    t = micro_batch_terms(w, 2, R, 2, "full")
    assert t.elementwise == pytest.approx(2 * 3.5e6 / 1e12)
    # and the 8 x 8 GEMM's forward again: bandwidth-bound, 2 bytes x (4096 x 8 + 8 x 8 + 4096 x 8)
    assert t.recompute == pytest.approx(2e6 / 1e12 + 2 * (4096 * 8 + 64 + 4096 * 8) / 1e12, rel=1e-12)
    # 100 launches of a forward, 250 of a backward and the recompute's 100, 10 µs each: the host waits
    w = Work(tokens=1, gemms=(), attention_flops=0.0, attention_seconds_fb=0.0, eager_bytes=0.0,
             elementwise_bytes=0.0, loss_bytes=0.0, kernels=100, layers=1, backward_kernels=250)
    assert micro_batch_terms(w, 1, R, 2, "full").seconds == pytest.approx(450 * 10e-6)


def test_optimizer_step_bytes():
    # AdamW over bf16-mixed: reads and writes the fp32 master and two fp32 moments (2 x 12 bytes),
    # reads the bf16 gradient (2) and writes the bf16 weight (2): 28 bytes per element
    assert optimizer_step_seconds(1e9, 64, 32, 16, 16, R) == pytest.approx(28e9 / 1e12)
    # bf16-pure AdamW: the bf16 weight and two bf16 moments read and written, the gradient read
    assert optimizer_step_seconds(1e9, 32, 0, 16, 16, R) == pytest.approx((2 * 6 + 2) * 1e9 / 1e12)


def test_unfused_adamw_step_charges_each_kernel():
    # torch's _single_tensor_adam over fp32 parameters, gradients and moments: weight decay 8, lerp_ 12,
    # mul_ 8, addcmul_ 12, sqrt 8, division 8, add_ 8, addcdiv_ 16: 80 bytes per element, not the fused 28
    assert optimizer_step_seconds(1e9, 64, 0, 32, 32, R, unfused=True) == pytest.approx(80e9 / 1e12)
    assert optimizer_step_seconds(1e9, 64, 0, 32, 32, R) == pytest.approx(28e9 / 1e12)
    # with a bf16 compute copy written after the fp32 master's update (bf16 gradient read twice)
    assert optimizer_step_seconds(1e9, 64, 32, 16, 16, R, unfused=True) == pytest.approx((56 + 16 + 4 + 2) * 1e9 / 1e12)


def test_single_tensor_adamw_steps_slower_than_fused_in_the_estimate():
    base = dict(model="gpt2", gpu="a100-80gb", gpus=8, strategy="fsdp", seq_len=1024, micro_batch=4)
    terms = {o: {t.name: t.seconds for t in estimate_with_time(EstimateRequest(**base, optimizer=o)).time.terms}
             for o in ("adamw", "adamw-single-tensor")}
    assert terms["adamw-single-tensor"]["optimizer step"] > 2 * terms["adamw"]["optimizer step"]
    # GPT-2's 1/8 shards are small: the step waits for its launches, 8 kernels per parameter tensor
    arch = catalogue_model("gpt2").architecture
    launches = len(parameter_shapes(arch)) * UNFUSED_ADAMW_KERNELS
    assert terms["adamw-single-tensor"]["optimizer step"] == pytest.approx(launches * HOST_SECONDS_PER_KERNEL)


def test_causal_attention_flops_of_one_llama_block():
    # Llama-3-8B at 8,192 tokens: 32 heads of 128, 4,096 keys per query on average under the causal
    # mask: 2 x (128 + 128) x 8192 x 4096 x 32 FLOPs forward per block, 32 blocks
    arch = catalogue_model("llama-3-8b").architecture
    w = work(arch, 8192, 1, 1, False, 2, False, rates(H100, "bf16"))
    assert w.attention_flops == 32 * 2 * (128 + 128) * 8192 * 4096 * 32


def test_estimate_reports_terms_sources_mfu_and_hfu():
    t = estimate_with_time(EstimateRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, strategy="fsdp",
                                           seq_len=8192, checkpointing="full")).time
    names = [term.name for term in t.terms]
    assert names[:4] == ["matmul", "attention", "elementwise and loss", "recompute (full)"]
    assert "MAMF 794.5" in t.terms[0].source and "flash-attention-2 measured on H100" in t.terms[1].source
    assert 0 < t.mfu < t.hfu < 1  # the recompute runs FLOPs MFU does not count
    compute = sum(term.seconds for term in t.terms if term.name in ("matmul", "attention", "elementwise and loss",
                                                                     "recompute (full)", "host launch wait",
                                                                     "optimizer step", "communication contention",
                                                                     "sharding copies", "slowest GPU"))
    assert compute == pytest.approx(t.compute_seconds, rel=1e-9)
    # FSDP's hidden gathers and reduce-scatters hold 24 of the H100's 132 SMs while they run; FSDP2 copies
    # each gathered unit out and each unit's gradients in on the compute stream
    assert "communication contention" in names and "sharding copies" in names

def test_hidden_collectives_cost_the_compute_beside_them():
    # Lee et al. 2025's means (overlapped compute 18.9% slower; sequential 10.2% slower than
    # overlapped) imply 0.61 s of compute lost per second of overlapped communication: over an
    # NVLink node at its ring's rate, whatever the GPU; through NICs at a quarter of that rate the
    # excess over the SMs the blocks hold (24 of 132 on an H100, of 108 on an A100) is a quarter;
    # over PCIe the 2 blocks' SM share alone
    from planner.cluster.hardware import topology_of
    from planner.schema import PlanRequest
    from planner.time import collectives as timing
    from planner.cluster.gpus import gpu

    m = timing.OVERLAPPED_COMPUTE_SECONDS_PER_SECOND
    assert m == pytest.approx(0.189 / (1.102 * 1.189 - 1)) and 0.60 < m < 0.62
    for name, sms in (("h100-80gb", 132), ("a100-80gb", 108)):
        topo, _, _ = topology_of(PlanRequest(model="llama-3-8b", gpu=name, gpus=8), gpu(name))
        ring = timing.node_ring(topo, 8)[0]
        assert timing.contention_seconds(1.0, sms, topo, ring) == pytest.approx(m)
        assert timing.contention_seconds(1.0, sms, topo, ring, 0.25) == pytest.approx(24 / sms + (m - 24 / sms) / 4)
        assert timing.contention_seconds(1.0, sms, topo, ring, 0.0) == pytest.approx(24 / sms)
        assert timing.contention_seconds(1.0, sms, topo, ring[:1]) == 0.0  # one GPU: no collective
    topo, _, _ = topology_of(PlanRequest(model="llama-3-8b", gpu="l40s", gpus=8), gpu("l40s"))
    ring = timing.node_ring(topo, 8)[0]
    assert timing.collective_kind(topo, ring) == (timing.NCCL_CHANNEL_BLOCKS["other"], False)
    assert timing.NCCL_CHANNEL_BLOCKS["other"] == 2
    assert timing.contention_seconds(1.0, 142, topo, ring) == pytest.approx(2 / 142)


def test_a_slower_fabric_costs_the_overlapped_compute_less_per_second():
    # the same FSDP step over 2 nodes: through one 25GbE NIC its collectives move few bytes a second,
    # so each hidden second costs the compute about the SMs it holds; through 8 NDR NICs, at the
    # node's ring rate, nearly the measured 0.61 s
    from planner.time.step import estimate_with_time

    kw = dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=2, strategy="fsdp", seq_len=4096, micro_batch=1)
    rates = {}
    for fabric, nics in (("eth-25g", 1), ("ib-ndr", 8)):
        t = estimate_with_time(EstimateRequest(fabric=fabric, nics_per_node=nics, **kw)).time
        contention = next(x.seconds for x in t.terms if x.name == "communication contention")
        hidden = t.communication_seconds - t.exposed_communication_seconds
        rates[fabric] = contention / hidden
    assert rates["eth-25g"] < 0.2 < 0.5 < rates["ib-ndr"] <= 0.61


GPT2_BIASED = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_inner": 3072, "n_positions": 2048,
               "vocab_size": 50368, "activation_function": "gelu"}


def _gpt2(bias: bool):
    arch = from_hf_config(GPT2_BIASED)
    if bias:
        return arch
    specs = tuple(s.model_copy(update={"attention": s.attention.model_copy(update={"qkv_bias": False, "o_bias": False}),
                                       "mlp": s.mlp.model_copy(update={"bias": False})}) for s in layer_specs(arch))
    return arch.model_copy(update={"layers": specs})


def test_bias_gradients_read_each_biased_linears_output_gradient_once():
    # GPT-2's c_attn (3h), attn c_proj (h), c_fc (4h), mlp c_proj (h): 9h elements of output gradient per
    # token and block, summed over the tokens in backward (addmm's derivative + sum_to), bf16
    r = rates(A100, "bf16")
    biased, bare = _gpt2(True), _gpt2(False)
    assert layer_specs(biased)[0].attention.qkv_bias and layer_specs(biased)[0].mlp.bias
    w = work(biased, 2048, 1, 1, False, 2, False, r)
    assert w.bias_gradient_bytes == pytest.approx(9 * 768 * 2048 * 2 * 12)
    assert work(bare, 2048, 1, 1, False, 2, False, r).bias_gradient_bytes == 0
    # under TP 2 with sequence parallelism: c_attn and c_fc column-split, both c_proj on h / 2 per token
    assert work(biased, 2048, 2, 1, True, 2, False, r).bias_gradient_bytes == pytest.approx(9 / 2 * 768 * 2048 * 2 * 12)
    t = micro_batch_terms(w, 4, r, 2, "full")
    assert t.bias_gradients == pytest.approx(4 * w.bias_gradient_bytes / r.memory_bytes_per_s)
    # backward only: checkpointing reruns the forward, whose bias add is in the GEMM's epilogue
    assert micro_batch_terms(w, 4, r, 2, "none").bias_gradients == t.bias_gradients
    assert micro_batch_terms(w, 4, r, 2, "none", frozen_matmuls=1.0).bias_gradients == 0  # a frozen base's biases
    assert t.seconds == pytest.approx(t.matmul + t.attention + t.elementwise + t.recompute + t.bias_gradients)


def test_bias_gradients_are_a_named_term_of_the_estimate():
    request = EstimateRequest(model_config=GPT2_BIASED, gpu="a100-80gb", gpus=8, strategy="fsdp", seq_len=2048,
                              micro_batch=8, precision="bf16-mixed")
    terms = {x.name: x.seconds for x in estimate_with_time(request).time.terms}
    assert terms["bias gradients"] == pytest.approx(
        8 * 9 * 768 * 2048 * 2 * 12 / rates(A100, "bf16").memory_bytes_per_s)


def test_a_biased_linears_backward_runs_one_reduction_more_on_cpu():
    """The mechanism as torch runs it: nn.Linear(bias=True)'s backward has one aten::sum (the bias's
    gradient reduced over the tokens) that the same linear without a bias does not."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    def sums(bias: bool) -> int:
        linear = torch.nn.Linear(16, 32, bias=bias)
        x = torch.randn(2, 8, 16, requires_grad=True)
        y = linear(x)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            y.backward(torch.ones_like(y))
        return sum(e.count for e in p.key_averages() if e.key == "aten::sum")

    assert sums(True) == sums(False) + 1


def test_gradient_clipping_reads_the_ranks_gradients_and_scales_them_in_place():
    # FSDP over 8 GPUs, bf16-mixed: each rank clips its 1/8 shard of the gradients, in the recipe's gradient dtype
    # as the optimizer step's term reads them (bf16-mixed: 16 bits); the norm reads it once, the in-place scale
    # reads and writes it (kernels.CLIP_GRADIENT_PASSES = 3)
    base = dict(model_config=GPT2_BIASED, gpu="a100-80gb", gpus=8, strategy="fsdp", seq_len=2048, micro_batch=8,
                precision="bf16-mixed")
    plain = estimate_with_time(EstimateRequest(**base))
    clipped = estimate_with_time(EstimateRequest(**base, gradient_clipping=True))
    terms = {x.name: x.seconds for x in clipped.time.terms}
    assert "gradient clipping" not in {x.name for x in plain.time.terms}
    shard = plain.parameters / 8
    assert terms["gradient clipping"] == pytest.approx(shard * 3 * 2 / rates(A100, "bf16").memory_bytes_per_s)
    assert clipped.time.step_seconds == pytest.approx(plain.time.step_seconds + terms["gradient clipping"])


def test_llama4_experts_run_every_token_and_the_gathered_dispatch_its_top_k():
    # transformers' Llama4TextMoe repeats the tokens once per expert and runs one bmm over all of
    # them (the unrouted rows' scores zeroed); Mixtral's and Qwen3-MoE's grouped_mm dispatch gathers
    # each expert's top-k tokens: the matmul FLOPs of Llama-4-Scout's routed experts are
    # num_experts / top-k = 16x a gathered dispatch's
    from planner.time.kernels import _mlp_gemms

    scout = catalogue_model("llama-4-scout").architecture
    moe = next(s for s in layer_specs(scout) if s.mlp.is_moe)
    experts = [g for g in _mlp_gemms(moe, scout.hidden_size, 1) if g.routed]
    assert experts and all(g.token_fraction == 1.0 and g.count == moe.mlp.num_experts for g in experts)
    mixtral = catalogue_model("mixtral-8x7b").architecture
    spec = layer_specs(mixtral)[0]
    routed = [g for g in _mlp_gemms(spec, mixtral.hidden_size, 1) if g.routed]
    assert routed and all(g.token_fraction == spec.mlp.experts_per_token / spec.mlp.num_experts for g in routed)
    # the hardware FLOPs follow: every token's expert work over a top-1 dispatch's
    from planner.time.step import estimate_with_time

    t = estimate_with_time(EstimateRequest(model="llama-4-scout", gpu="h100-80gb", gpus=8, strategy="fsdp",
                                           seq_len=2048, micro_batch=1, checkpointing="full")).time
    assert t.hfu > 2 * t.mfu
