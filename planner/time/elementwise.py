"""A decoder block's memory-bound work, op by op as its code runs it, forward and backward.

Each piece of a block (its norms, rotary embedding, activation, residual adds, dropout) is the list
of ATen ops autograd dispatches for it, and each op reads its inputs and writes its output once at
the GPU's memory bandwidth (planner/time/kernels.py). An op's bytes are counted per element of the
piece's width in the compute dtype (``c``) or fp32 (``f``, the upcasts at 4 bytes), per row (the
fp32 per-token statistics of a norm), per element of the rotary tables (``table``: cos/sin, one
row of head_dim per token, ``ftable`` where they are fp32) and in single bytes (dropout's bool mask). Forward ops are the module's
Python lines; backward ops are torch 2.13's derivative formulas (tools/autograd/derivatives.yaml,
shipped as torchgen/packaged/autograd/derivatives.yaml) for each forward op, plus the sums autograd's
input buffer runs where a tensor feeds several ops. Weight-sized work (a norm's weight read, its
gradient's few elements) is per micro-batch and not counted. The op lists were read off a
TorchDispatchMode trace of each module on CPU (tests/test_elementwise.py replays a block of Llama, Mistral,
Qwen2, Qwen3, SmolLM3, Gemma-3, OLMo-2 and GPT-2 and compares); what differs on CUDA is said where it does. An MoE block's
router and dispatch are counted op by op over transformers 5.x's default grouped_mm experts for Mixtral, Qwen3-MoE,
DeepSeek-V2/V3 and gpt-oss, and Llama-4's bmm over every expert (moe_traffic; tests/test_elementwise.py replays
them). Not counted: Gemma's two weight-sized ops per norm call; PEFT's default fp32 adapters on a 16-bit base
(get_peft_model's autocast_adapter_dtype=True: ``_cast_input_dtype`` casts each adapted linear's input to fp32,
lora/layer.py line 1100), which the adapter ops below count in the compute dtype (autocast_adapter_dtype=False).

How the code implements a norm is what the time depends on: a composite of Python ops (every
RMSNorm of transformers 5.x: LlamaRMSNorm.forward, modeling_llama.py lines 62-67, ~9x a fused
norm's bytes forward) or one fused kernel (nn.LayerNorm: aten::native_layer_norm). torch 2.13's
F.rms_norm is CompositeImplicitAutograd (rms_norm_symint, native_functions.yaml line 3250) and has a
fused CUDA kernel (_fused_rms_norm, line 3254, backward _fused_rms_norm_backward, line 3261;
derivatives.yaml line 1284), but no family the planner reads calls it (nn.RMSNorm's CPU path runs the
composite, rms_norm_composite). NORM_OPS keys the lists by the layer spec's norm and norm_weight,
which name the transformers module (planner/model/layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.model.architecture import Architecture
from planner.model.attention.kinds import kind_of
from planner.errors import PlannerError
from planner.model.layers import LayerSpec, MlpSpec
from planner.time.collectives import MEMORY_BANDWIDTH_EFFICIENCY

FP32 = 4


@dataclass(frozen=True)
class Op:
    """One dispatched op: elements it reads (``*_in``) and writes (``*_out``) per element of its piece."""

    c_in: float = 0.0
    c_out: float = 0.0
    f_in: float = 0.0
    f_out: float = 0.0
    row_in: float = 0.0
    row_out: float = 0.0
    table_in: float = 0.0
    ftable_in: float = 0.0
    byte_in: float = 0.0
    byte_out: float = 0.0

    def bytes(self, width: float, rows: float, table: float, c: int) -> float:
        return ((self.c_in + self.c_out) * c * width + (self.f_in + self.f_out) * FP32 * width
                + (self.row_in + self.row_out) * FP32 * rows + self.table_in * c * table
                + self.ftable_in * FP32 * table
                + (self.byte_in + self.byte_out) * width)


@dataclass(frozen=True)
class Piece:
    """A piece's ops forward and backward; ``forward_rate`` / ``backward_rate``: the fraction of the datasheet
    memory bandwidth its ops were measured to reach (COMPOSITE_NORM_RATES and the other *_RATES below), None where
    they stream at the copy rate (MEMORY_BANDWIDTH_EFFICIENCY)."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    forward_rate: float | None = None
    backward_rate: float | None = None


@dataclass(frozen=True)
class Traffic:
    """Bytes per token and launches per block call, forward and backward. ``*_excess_bytes``: what ops measured
    below the copy rate cost beyond their bytes, in bytes at the copy rate (their time at it is
    (bytes + excess) / the copy rate)."""

    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    forward_kernels: int = 0
    backward_kernels: int = 0
    forward_excess_bytes: float = 0.0
    backward_excess_bytes: float = 0.0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.forward_bytes + other.forward_bytes, self.backward_bytes + other.backward_bytes,
                       self.forward_kernels + other.forward_kernels, self.backward_kernels + other.backward_kernels,
                       self.forward_excess_bytes + other.forward_excess_bytes,
                       self.backward_excess_bytes + other.backward_excess_bytes)

    def times(self, n: int) -> "Traffic":
        return Traffic(self.forward_bytes * n, self.backward_bytes * n, self.forward_kernels * n,
                       self.backward_kernels * n, self.forward_excess_bytes * n, self.backward_excess_bytes * n)

    @property
    def forward_seconds_bytes(self) -> float:
        """The forward's time in bytes at the copy rate."""
        return self.forward_bytes + self.forward_excess_bytes

    @property
    def backward_seconds_bytes(self) -> float:
        return self.backward_bytes + self.backward_excess_bytes


def excess_bytes(moved: float, rate: float | None) -> float:
    """Bytes at the copy rate that ops moving ``moved`` bytes at ``rate`` of the datasheet bandwidth take beyond
    ``moved`` (0 for the copy rate)."""
    return 0.0 if rate is None else moved * (MEMORY_BANDWIDTH_EFFICIENCY / rate - 1.0)


def traffic(piece: Piece, width: float, c: int, rows: float = 0.0, table: float = 0.0) -> Traffic:
    """One call of ``piece`` over ``width`` elements per token (``rows`` per-row statistics, ``table`` rotary
    elements per token)."""
    forward = sum(op.bytes(width, rows, table, c) for op in piece.forward)
    backward = sum(op.bytes(width, rows, table, c) for op in piece.backward)
    return Traffic(forward, backward, len(piece.forward), len(piece.backward),
                   excess_bytes(forward, piece.forward_rate), excess_bytes(backward, piece.backward_rate))


# Measured rates of eager norm and rotary code, as fractions of the datasheet memory bandwidth: Liger-Kernel's
# published benchmarks of the transformers / torch baselines it compares against (linkedin/Liger-Kernel ead96b6,
# benchmark/data/all_benchmark_data.csv, provider "huggingface", median of triton.testing.do_bench; setups in
# benchmark/scripts/benchmark_rms_norm.py, benchmark_layer_norm.py and benchmark_rope.py at a307eac8), each row's
# bytes counted as the pieces below count them, over its time, over the datasheet (A100-SXM4-80GB 2,039 GB/s, H100
# SXM 3,350 GB/s), at the largest size measured (launch costs smallest; a training step's calls are as large):
# - LlamaRMSNorm (bf16 input, fp32 weight: FLOAT_WEIGHT_RMSNORM's ops with the product left in fp32, 38 bytes per
#   element forward, 104 backward), 2,048 x 32,768 on A100: forward 1.919 ms (0.652), backward 5.015 ms (0.683);
#   0.56-0.63 forward at 4,096-16,384 wide;
# - nn.LayerNorm, fp32, 4,096 x 16,384: forward 0.507 ms on A100 (0.520), 0.307 ms on H100 (0.522), backward
#   0.642 ms on H100 (0.624; A100's forward + backward, 1.621 ms, leaves 0.59 for its backward): 0.60 taken;
# - apply_rotary_pos_emb on q and k laid out as attention transposes them (32 q and 8 kv heads of 256), 16,384
#   tokens on A100: forward 3.817 ms (0.435), backward 4.557 ms (0.617).
# A plain elementwise op does reach the copy rate: torch's relu(x)**2 (two ops, 8 bytes per bf16 element), 4,096 x
# 16,384 on H100, 0.186 ms: 0.86 (the same file, liger 0.7.0).
COMPOSITE_NORM_RATES = (0.652, 0.683)
FUSED_LAYERNORM_RATES = (0.520, 0.60)
ROTARY_RATES = (0.435, 0.617)

# Measured rates of Liger-Kernel's fused kernels (planner/recipes/fused_kernels.py), derived as the eager rates above
# from the same file's provider "liger" rows (benchmark/data/all_benchmark_data.csv at ead96b6), each row's bytes
# counted as the pieces below count them (one kernel each way, its reads and writes from the kernel's source):
# - LigerRMSNorm (liger 0.2.1, A100, bf16, 2,048 rows): forward 4 bytes per element (X in, Y out) and 4 per row
#   (rstd), backward 6 (dY and X in, dX out) and 4 per row. Taken at 16,384 wide, the widest hidden size a model has
#   (Llama-3-405B): forward 0.0953 ms (0.691), backward 0.3205 ms (0.308); at 4,096-8,192 wide 0.53-0.64 forward,
#   0.25-0.28 backward; at 32,768 (no model's width) the backward falls to 0.187 (1.056 ms: one 32,768-wide block
#   per row, ops/utils.py calculate_settings' 32 warps);
# - liger_rotary_pos_emb (liger 0.2.1, A100, the huggingface row's setup: 32 q and 8 kv heads of 256, 16,384 tokens):
#   q and k read and written in place, half of cos and half of sin per token (ops/rope.py _triton_rope loads
#   ``pad_hd // 2`` of each), 41,472 bytes per token; forward 0.4105 ms (0.812), backward 0.4102 ms (0.812; the
#   benchmark's dq keeps q's strides, so ``dq.contiguous()`` copies nothing);
# - LigerSiLUMulFunction: the csv's "swiglu" rows time LigerSwiGLUMLP against LlamaMLP, the three matmuls included
#   (benchmark/scripts/benchmark_swiglu.py: 36 ms at 4 x 8,192 tokens), and are not used; "megatron_swiglu" (liger
#   0.8.1, H100 SXM 3,350 GB/s; benchmark_megatron_swiglu.py, 2120862b) times the same arithmetic alone over a
#   fused gate-up tensor (LigerFusedGateUpSiLUMulFunction: gate and up in, their product out, 6 bytes per inner
#   element in bf16): 8,192 rows x 32,768 forward 0.5275 ms (0.911). Its "backward" row times forward + ``.sum()`` +
#   backward (1.9116 ms); less the forward and the sum's read and its expanded gradient's contiguous copy (4 bytes
#   per element at the copy rate), the backward kernel (dc, gate and up in, both gradients out: 10 bytes) runs at
#   0.803.
LIGER_RMSNORM_RATES = (0.691, 0.308)
LIGER_ROPE_RATES = (0.812, 0.812)
LIGER_SWIGLU_RATES = (0.911, 0.803)

# The backward of ``x * rsqrt(mean(x²) + eps)`` in fp32 (derivatives.yaml: mul.Tensor line 1231, rsqrt line
# 1504, mean.dim line 1153, pow.Tensor_Scalar line 1400), shared by every composite RMSNorm:
_RSQRT_BACKWARD = (
    Op(f_in=2, f_out=1),  # grad * x: rsqrt's gradient before the row sum
    Op(f_in=1, row_in=1, f_out=1),  # grad * rsqrt: x's gradient through the product
    Op(f_in=1, row_out=1),  # sum over the row (rsqrt was broadcast)
    Op(row_in=1, row_out=1),  # rsqrt: -0.5 * grad * result.pow(3): pow,
    Op(row_in=1, row_out=1),  # * -0.5,
    Op(row_in=2, row_out=1),  # * grad
    Op(row_in=1, f_out=1),  # mean_backward: grad expanded / N
    Op(f_in=1, f_out=1),  # pow_backward: self.pow(1),
    Op(f_in=1, f_out=1),  # * 2,
    Op(f_in=2, f_out=1),  # * grad
    Op(f_in=2, f_out=1),  # the fp32 input's two gradients summed (autograd's input buffer)
)
_RMS_STATISTIC = (
    Op(c_in=1, f_out=1),  # hidden_states.to(torch.float32)
    Op(f_in=1, f_out=1),  # .pow(2)
    Op(f_in=1, row_out=1),  # .mean(-1, keepdim=True)
    Op(row_in=1, row_out=1),  # + variance_epsilon
    Op(row_in=1, row_out=1),  # torch.rsqrt
    Op(f_in=1, row_in=1, f_out=1),  # hidden_states * rsqrt
)
# transformers 5.x LlamaRMSNorm.forward (modeling_llama.py lines 62-67; Qwen2/3, Mistral, Mixtral, Phi-3,
# DeepSeek alike): ``self.weight * hidden_states.to(input_dtype)``
COMPOSITE_RMSNORM = Piece(
    forward=_RMS_STATISTIC + (
        Op(f_in=1, c_out=1),  # .to(input_dtype)
        Op(c_in=1, c_out=1),  # self.weight * x
    ),
    backward=(
        Op(c_in=1, c_out=1),  # grad * weight
        Op(c_in=2, c_out=1),  # grad * x, the weight's gradient before its reduction
        Op(c_in=1),  # summed over the tokens (sum_to the weight's shape)
        Op(c_in=1, f_out=1),  # _to_copy_backward: the gradient to fp32
    ) + _RSQRT_BACKWARD + (Op(f_in=1, c_out=1),),  # and back to the input's dtype
    forward_rate=COMPOSITE_NORM_RATES[0], backward_rate=COMPOSITE_NORM_RATES[1],
)
# Olmo2RMSNorm ``(self.weight * x).to(input_dtype)``, Gemma2/3RMSNorm ``x * (1.0 + self.weight.float())``, then
# the cast: the weight multiplies in fp32 (norm_weight "float"). Gemma's two weight-sized ops are not counted.
FLOAT_WEIGHT_RMSNORM = Piece(
    forward=_RMS_STATISTIC + (
        Op(f_in=1, f_out=1),  # x * weight in fp32
        Op(f_in=1, c_out=1),  # .to(input_dtype) / .type_as(x)
    ),
    backward=(
        Op(c_in=1, f_out=1),  # the cast's backward: the gradient to fp32
        Op(f_in=2, f_out=1),  # grad * x, the weight's gradient before its reduction
        Op(f_in=1, f_out=1),  # grad * weight
        Op(f_in=1),  # summed over the tokens
        Op(),  # the weight's gradient cast to its dtype (weight-sized)
    ) + _RSQRT_BACKWARD + (Op(f_in=1, c_out=1),),
    forward_rate=COMPOSITE_NORM_RATES[0], backward_rate=COMPOSITE_NORM_RATES[1],
)
# Llama4TextL2Norm: ``x.float() * rsqrt(mean(x²) + eps)`` cast back, no weight
L2_NORM = Piece(forward=_RMS_STATISTIC + (Op(f_in=1, c_out=1),),
                backward=(Op(c_in=1, f_out=1),) + _RSQRT_BACKWARD + (Op(f_in=1, c_out=1),),
                forward_rate=COMPOSITE_NORM_RATES[0], backward_rate=COMPOSITE_NORM_RATES[1])
# nn.LayerNorm: one aten::native_layer_norm (input in, output and fp32 mean and rstd per row out: acc_type on
# CUDA) and one native_layer_norm_backward (derivatives.yaml line 1274), which on CUDA runs two kernels: the input's
# gradient (reads the gradient, the input and the row statistics, writes the gradient) and the weight's and
# bias's, which read the gradient and the input again (aten/src/ATen/native/cuda/layer_norm_kernel.cu
# LayerNormBackwardKernelImplInternal: layer_norm_grad_input_kernel, then GammaBetaBackwardCUDAKernel; read at
# pytorch 0005c538). One dispatched op each way.
FUSED_LAYERNORM = Piece(forward=(Op(c_in=1, c_out=1, row_out=2),), backward=(Op(c_in=4, row_in=4, c_out=1),),
                        forward_rate=FUSED_LAYERNORM_RATES[0], backward_rate=FUSED_LAYERNORM_RATES[1])
# Under a frozen base (LoRA / QLoRA: PEFT sets requires_grad=False on every base parameter) the norms' weights
# get no gradient: autograd skips a derivative formula whose input does not require grad (the generated
# *Backward nodes' ``task_should_compute_output`` per input; native_layer_norm_backward's output_mask), so the
# weight's gradient (grad * x, its sum over the tokens, its cast) is not run; the input's gradient is.
FROZEN_COMPOSITE_RMSNORM = replace(COMPOSITE_RMSNORM,
                                   backward=(COMPOSITE_RMSNORM.backward[0],) + COMPOSITE_RMSNORM.backward[3:])
FROZEN_FLOAT_WEIGHT_RMSNORM = replace(FLOAT_WEIGHT_RMSNORM,
                                      backward=FLOAT_WEIGHT_RMSNORM.backward[:1] + FLOAT_WEIGHT_RMSNORM.backward[2:3]
                                      + FLOAT_WEIGHT_RMSNORM.backward[5:])
# output_mask (True, False, False): CUDA's GammaBetaBackward kernel is not launched (layer_norm_kernel.cu)
FROZEN_FUSED_LAYERNORM = replace(FUSED_LAYERNORM, backward=(Op(c_in=2, row_in=2, c_out=1),))
FROZEN_NORM_OPS = {("rmsnorm", "cast"): FROZEN_COMPOSITE_RMSNORM, ("rmsnorm", "float"): FROZEN_FLOAT_WEIGHT_RMSNORM,
                   ("layernorm", "cast"): FROZEN_FUSED_LAYERNORM, ("layernorm", "float"): FROZEN_FUSED_LAYERNORM}
NORM_OPS = {("rmsnorm", "cast"): COMPOSITE_RMSNORM, ("rmsnorm", "float"): FLOAT_WEIGHT_RMSNORM,
            ("layernorm", "cast"): FUSED_LAYERNORM, ("layernorm", "float"): FUSED_LAYERNORM}
# LigerRMSNormFunction (ops/rms_norm.py): one forward kernel (X in, Y and fp32 rstd per row out; the weight's row is
# weight-sized) and one backward kernel (dY, X and rstd in, dX out, written into dY's storage; its dW partial sums,
# sm_count x hidden in fp32, and their sum are weight-sized). torchtitan's TritonFusedRMSNorm (torchtitan 157a12c
# torchtitan/models/norms.py, its ``fused_rmsnorm``) moves the same bytes with the same launch shapes: forward one
# program per row (grid (M,), line 238) loading x and w (137-138), storing the fp32 rstd (146) and y (153; X's dtype,
# 229); backward sm_count programs of ceil(M / sm_count) rows each (274-284) loading w once (190), per row x, dy and
# rstd (198-200), storing dx (210: a fresh ``empty_like(x)``, 271, where Liger writes into dY) and one fp32 dW row
# per program (213; the sm_count x N buffer, 275, summed and cast, 301): Liger's row kernels (rms_norm.py 91-140,
# 181-234; 529, 605), which it runs above 256 wide (469, 551), read for read. Its num_warps are autotuned over 1 to
# 32 (norms.py 108-118, 156-166) where Liger's come from calculate_settings, so it is timed at Liger's measured
# rates: no timing of it alone is published (pytorch/torchtitan PR #181, commit 34711655b, which added it, reports
# +15% MFU over the eager RMSNorm with FSDP2 on a 7B, hardware unstated).
LIGER_RMSNORM = Piece(forward=(Op(c_in=1, c_out=1, row_out=1),), backward=(Op(c_in=2, row_in=1, c_out=1),),
                      forward_rate=LIGER_RMSNORM_RATES[0], backward_rate=LIGER_RMSNORM_RATES[1])

# transformers' apply_rotary_pos_emb (modeling_llama.py lines 119-149), per q or k: ``(x * cos) +
# (rotate_half(x) * sin)``, rotate_half = cat(-x2, x1) of the two halves (slices are views). Backward: mul's
# gradient per input, neg's, two slice_backward (each fills a full-width tensor with zeros, then copies the half's
# gradient into it: torch 2.13 _decomp/decompositions.py slice_backward, line 741: new_zeros, slice_scatter), their sum and the two paths' sum; then the q or k gradient, laid out as the rotary's fresh output, is copied back to the
# projection's layout (view's derivative reshapes the transposed gradient: a clone; measured on CPU, the same
# autograd formulas and strides on CUDA).
ROTARY = Piece(
    forward=(Op(c_in=1, table_in=1, c_out=1), Op(c_in=0.5, c_out=0.5), Op(c_in=1, c_out=1),
             Op(c_in=1, table_in=1, c_out=1), Op(c_in=2, c_out=1)),
    backward=(Op(c_in=1, table_in=1, c_out=1), Op(c_in=0.5, c_out=0.5), Op(c_in=0.5, c_out=1.5),
              Op(c_in=0.5, c_out=1.5), Op(c_in=2, c_out=1), Op(c_in=1, table_in=1, c_out=1), Op(c_in=2, c_out=1),
              Op(c_in=1, c_out=1)),
    forward_rate=ROTARY_RATES[0], backward_rate=ROTARY_RATES[1],
)
# OLMo-2's rotary (transformers 5.x modeling_olmo2.py): Olmo2RotaryEmbedding.forward returns fp32 cos and sin
# (lines 107-111, no cast to x's dtype as Llama's has), so ``q * cos`` and ``rotate_half(q) * sin`` promote to
# fp32, the two products add in fp32 and apply_rotary_pos_emb casts the sum back (``q_embed.to(q_type)``, lines
# 169-174). Backward: the cast's (the gradient to fp32), each product's gradient in fp32 cast to the bf16 input's
# dtype (mul_tensor_backward's ``.to(self_st)``: a _to_copy each), neg's, the two slice_backward and their sum,
# the two paths' sum and the clone back to the projection's layout, as ROTARY's.
FP32_ROTARY = Piece(
    forward=(Op(c_in=1, ftable_in=1, f_out=1), Op(c_in=0.5, c_out=0.5), Op(c_in=1, c_out=1),
             Op(c_in=1, ftable_in=1, f_out=1), Op(f_in=2, f_out=1), Op(f_in=1, c_out=1)),
    backward=(Op(c_in=1, f_out=1), Op(f_in=1, ftable_in=1, f_out=1), Op(f_in=1, c_out=1), Op(c_in=0.5, c_out=0.5),
              Op(c_in=0.5, c_out=1.5), Op(c_in=0.5, c_out=1.5), Op(c_in=2, c_out=1),
              Op(f_in=1, ftable_in=1, f_out=1), Op(f_in=1, c_out=1), Op(c_in=2, c_out=1), Op(c_in=1, c_out=1)),
    forward_rate=ROTARY_RATES[0], backward_rate=ROTARY_RATES[1],
)
# The families whose rotary tables stay fp32 (of those planner/model/architecture.py reads)
FP32_ROTARY_FAMILIES = frozenset({"olmo2"})
# LigerRopeFunction (ops/rope.py): one kernel over q and k together, each read and written in place, with half of
# cos and half of sin per token (``table``: head_dim elements); backward the same kernel over dq and dk. OLMo-2's
# fp32 tables are read as fp32 (the kernel computes in the tables' dtype and stores into q's).
LIGER_ROPE = Piece(forward=(Op(c_in=1, table_in=1, c_out=1),), backward=(Op(c_in=1, table_in=1, c_out=1),),
                   forward_rate=LIGER_ROPE_RATES[0], backward_rate=LIGER_ROPE_RATES[1])
LIGER_FP32_ROPE = Piece(forward=(Op(c_in=1, ftable_in=1, c_out=1),), backward=(Op(c_in=1, ftable_in=1, c_out=1),),
                        forward_rate=LIGER_ROPE_RATES[0], backward_rate=LIGER_ROPE_RATES[1])
# Two tensors added, and in backward the sum autograd runs where a tensor fed two ops: a residual's input
# (the branch's norm and the add; the add's own backward passes the gradient through) or a normed input read
# by several linears (q, k, v; gate, up)
ADD = Piece(forward=(Op(c_in=2, c_out=1),), backward=(Op(c_in=2, c_out=1),))
GRADIENT_SUM = Piece(forward=(), backward=(Op(c_in=2, c_out=1),))
# A fused q/k/v projection split into three (split's derivative: one cat of their gradients)
SPLIT = Piece(forward=(), backward=(Op(c_in=1, c_out=1),))
# One ATen activation (silu, gelu, gelu_pytorch_tanh, relu): its op, and its backward reading the gradient and
# the saved input (silu_backward, gelu_backward, threshold_backward)
FUSED_ACTIVATION = Piece(forward=(Op(c_in=1, c_out=1),), backward=(Op(c_in=2, c_out=1),))
# A gated MLP's ``act(gate) * up`` (LlamaMLP.forward): the activation, the product; backward the product's two
# gradients and the activation's
GATED = Piece(forward=FUSED_ACTIVATION.forward + (Op(c_in=2, c_out=1),),
              backward=(Op(c_in=2, c_out=1), Op(c_in=2, c_out=1)) + FUSED_ACTIVATION.backward)
# NewGELUActivation (transformers activations.py, GPT-2's gelu_new): 0.5 * x * (1 + tanh(sqrt(2/pi) *
# (x + 0.044715 * x**3))), eight ops; its backward eleven (tanh_backward, pow_backward's three, mul's and add's)
_UNARY, _BINARY = Op(c_in=1, c_out=1), Op(c_in=2, c_out=1)
NEW_GELU = Piece(forward=(_UNARY, _UNARY, _UNARY, _BINARY, _UNARY, _UNARY, _UNARY, _BINARY),
                 backward=(_BINARY, _BINARY, _BINARY, _UNARY, _UNARY, _UNARY, _UNARY, _BINARY, _BINARY, _UNARY,
                           _BINARY))
# LigerSiLUMulFunction (ops/swiglu.py): forward reads gate and up and writes their product; backward reads the
# incoming gradient, gate and up and writes both gradients into gate's and up's storage
LIGER_SWIGLU = Piece(forward=(Op(c_in=2, c_out=1),), backward=(Op(c_in=3, c_out=2),),
                     forward_rate=LIGER_SWIGLU_RATES[0], backward_rate=LIGER_SWIGLU_RATES[1])
PLAIN_ACTIVATIONS = {"gelu_new": NEW_GELU, "gelu": FUSED_ACTIVATION, "gelu_pytorch_tanh": FUSED_ACTIVATION,
                     "silu": FUSED_ACTIVATION, "swish": FUSED_ACTIVATION, "relu": FUSED_ACTIVATION}
# nn.Dropout on CUDA: aten::native_dropout (one kernel: the output and a bool mask; derivatives.yaml line 619)
# and native_dropout_backward (the gradient and the mask). On CPU torch composes it (bernoulli_, div_, mul).
DROPOUT = Piece(forward=(Op(c_in=1, c_out=1, byte_out=1),), backward=(Op(c_in=1, byte_in=1, c_out=1),))
# The embedding's lookup (a gather: ids in, rows out) and its gradient's scatter-add into the table
EMBEDDING = Piece(forward=(Op(c_in=1, c_out=1),), backward=(Op(c_in=1, c_out=1),))


# A LoRA adapter on one linear (PEFT 0.21 tuners/lora/layer.py Linear.forward, lines 1088-1102):
# ``result + lora_B(lora_A(dropout(x))) * scaling``; the two matmuls are the adapter FLOPs (step.py). Per element
# of the linear's output: the scaling's mul and the add forward; backward the mul's gradient (grad * scaling; add
# passes the gradient through to both). Per element of its input: the sum of x's two gradients (the base linear's
# and the adapter's: autograd's input buffer). lora_dropout > 0 runs nn.Dropout on the input (DROPOUT; an
# nn.Identity at 0). bitsandbytes' 4-bit base clones the base's output first (peft tuners/lora/bnb.py line 533,
# Linear4bit.forward: ``result = result.clone()``; clone's backward passes the gradient through).
ADAPTER_OUTPUT = Piece(forward=(Op(c_in=1, c_out=1), Op(c_in=2, c_out=1)), backward=(Op(c_in=1, c_out=1),))
CLONE = Piece(forward=(Op(c_in=1, c_out=1),), backward=())


@dataclass(frozen=True)
class FrozenBase:
    """What a frozen base (LoRA / QLoRA) changes of the elementwise work: the norms' weights get no gradient,
    the embedding's only when it is trained (``embeddings_trained``), and the adapters' own ops (``adapters``,
    per token over every block)."""

    adapters: Traffic = Traffic()
    embeddings_trained: bool = False


def adapter_traffic(linears: list[tuple[int, int]], dropout: float, clone: bool, c: int) -> Traffic:
    """The adapters' elementwise ops per token: one (in_features, out_features) per adapted linear call."""
    out = Traffic()
    for fan_in, fan_out in linears:
        out = out + traffic(ADAPTER_OUTPUT, fan_out, c) + traffic(GRADIENT_SUM, fan_in, c)
        if dropout > 0:
            out = out + traffic(DROPOUT, fan_in, c)
        if clone:
            out = out + traffic(CLONE, fan_out, c)
    return out


# --- a mixture of experts' routing and dispatch ------------------------------------------------------------------
# Its ops move tensors of several widths per token: the hidden width (``h``), one row of it per routed (token, expert)
# pair (``kh``: experts_per_token x hidden, the model's expected top-k load: every token's k rows go through the
# gathered expert input and output whatever the experts' balance; Llama-4: one per expert, routed_rows), the router's
# scores (``e``, one per expert), the top-k (``k``), one per token (``1``, the top-k sum) and the experts' fused
# gate/up output (``2ki``: rows x 2 x intermediate / tp, ``ki`` its halves). Each tensor is ``width:dtype``: ``c`` the
# compute dtype, ``f`` fp32, ``i`` int64 (topk's and sort's indices), ``b`` bool. An op's bytes are its tensors'
# (inputs and output once, as everywhere here). DeepSeek's group-limited routers add ``g`` (n_group), ``2g`` (top-2
# per group) and ``kg`` (topk_group).
_DTYPE_BYTES = {"f": FP32, "i": 8, "b": 1}


@dataclass(frozen=True)
class RoutedPiece:
    """An MoE piece's ops, forward and backward, each the tuple of ``width:dtype`` tensors it reads and writes."""

    forward: tuple[tuple[str, ...], ...]
    backward: tuple[tuple[str, ...], ...]


def routed_traffic(piece: RoutedPiece, widths: dict[str, float], c: int) -> Traffic:
    """One call of an MoE piece per token, its tensors' widths per token given by ``widths``."""
    size = _DTYPE_BYTES | {"c": c}

    def moved(op: tuple[str, ...]) -> float:
        return sum(widths[w] * size[d] for w, d in (t.split(":") for t in op))

    return Traffic(sum(map(moved, piece.forward)), sum(map(moved, piece.backward)), len(piece.forward),
                   len(piece.backward))


# Mixtral's ``softmax(router_logits.float())`` (modeling_mixtral.py line 107) and Qwen3-MoE's ``softmax(router_logits,
# dtype=torch.float)`` (modeling_qwen3_moe.py line 262) alike: the logits cast to fp32 (a bf16 input is converted
# before _softmax on CUDA too: ATen SoftMax.cpp softmax() keeps half_to_float for Half only), _softmax, topk. Backward:
# topk's value_selecting_reduction_backward (derivatives.yaml topk: zeros of the scores' shape, the k gradients
# scattered in), _softmax_backward_data (reads the gradient and the output), the cast back (_to_copy_backward).
SOFTMAX_TOP_K = RoutedPiece(
    forward=(("e:c", "e:f"), ("e:f", "e:f"), ("e:f", "k:f", "k:i")),
    backward=(("e:f",), ("e:f", "k:i", "k:f", "e:f"), ("e:f", "e:f", "e:f"), ("e:f", "e:c")),
)
# ``router_top_value /= router_top_value.sum(dim=-1, keepdim=True)`` (Mixtral line 109; Qwen3-MoE line 265 when
# norm_topk_prob): the sum, autograd's clone of the in-place op's original self (div_'s formula for ``other`` reads
# self), div_. Backward (derivatives.yaml div.Tensor, line 588): grad / other for self; for other
# ``-grad * ((self / other) / other)``: two divs, neg, mul, then its sum over the broadcast k; and the top-k values'
# two gradients summed (the sum's expanded one and div's).
TOP_K_NORMALISED = RoutedPiece(
    forward=(("k:f", "1:f"), ("k:f", "k:f"), ("k:f", "1:f", "k:f")),
    backward=(("k:f", "1:f", "k:f"), ("k:f", "1:f", "k:f"), ("k:f", "k:f"), ("k:f", "k:f", "k:f"),
              ("k:f", "1:f", "k:f"), ("k:f", "1:f"), ("k:f", "1:f", "k:f")),
)
# DeepseekV3TopkRouter.forward (modeling_deepseek_v3.py lines 132-156): the input to fp32 for an fp32 router linear
# (the weight's own cast is weight-sized), sigmoid, + e_score_correction_bias, the top-2 per group and their sum,
# the top groups, their mask (zeros_like, scatter_, expanded and reshaped: a copy, to bool, inverted), masked_fill,
# the top-k's indices (its values unused) and the scores' gather at them. Backward: only the gathered scores carry a
# gradient (the selections use indices): gather's backward (derivatives.yaml line 730: zeros, scatter_add),
# sigmoid_backward, the input's cast back. Then ``topk_weights * self.routed_scaling_factor`` (always; its backward
# one mul) after the renormalisation (DEEPSEEK_TOP_K_NORMALISED).
SIGMOID_GROUPED_TOP_K = RoutedPiece(
    forward=(("h:c", "h:f"), ("e:f", "e:f"), ("e:f", "e:f"), ("e:f", "2g:f", "2g:i"), ("2g:f", "g:f"),
             ("g:f", "kg:f", "kg:i"), ("g:f",), ("g:f", "kg:i", "g:f"), ("g:f", "e:f"), ("e:f", "e:b"), ("e:b", "e:b"),
             ("e:f", "e:b", "e:f"), ("e:f", "k:f", "k:i"), ("e:f", "k:i", "k:f")),
    backward=(("e:f",), ("e:f", "k:i", "k:f", "e:f"), ("e:f", "e:f", "e:f"), ("h:f", "h:c")),
)
# DeepseekV2TopkRouter.forward (modeling_deepseek_v2.py lines 97-116): the input to fp32 for the fp32 router linear,
# ``softmax(dim=-1, dtype=torch.float32)`` (fp32 already: no cast), topk; backward topk's (zeros, scatter),
# _softmax_backward_data, the input's cast back
FP32_SOFTMAX_TOP_K = RoutedPiece(
    forward=(("h:c", "h:f"), ("e:f", "e:f"), ("e:f", "k:f", "k:i")),
    backward=(("e:f",), ("e:f", "k:i", "k:f", "e:f"), ("e:f", "e:f", "e:f"), ("h:f", "h:c")),
)
# topk_method "group_limited_greedy" (lines 103-113) between the softmax and the top-k: each group's max (values and
# indices), the top groups, their mask (zeros_like, scatter_, expanded and reshaped: a copy, to bool, inverted) and
# ``scores.masked_fill(~mask, 0.0)``, whose backward masks the gradient (derivatives.yaml masked_fill.Scalar)
GROUP_LIMITED = RoutedPiece(
    forward=(("e:f", "g:f", "g:i"), ("g:f", "kg:f", "kg:i"), ("g:f",), ("g:f", "kg:i", "g:f"), ("g:f", "e:f"),
             ("e:f", "e:b"), ("e:b", "e:b"), ("e:f", "e:b", "e:f")),
    backward=(("e:f", "e:b", "e:f"),),
)
ROUTED_SCALING = RoutedPiece(forward=(("k:f", "k:f"),), backward=(("k:f", "k:f"),))
# DeepSeek-V3's ``denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20; topk_weights /= denominator``: one add
# more forward (its backward passes the gradient through)
DEEPSEEK_TOP_K_NORMALISED = RoutedPiece(forward=TOP_K_NORMALISED.forward[:1] + (("1:f", "1:f"),)
                                        + TOP_K_NORMALISED.forward[1:], backward=TOP_K_NORMALISED.backward)
# DeepseekV3MoE.forward (line 220): ``hidden_states + self.shared_experts(residuals)``, forward only (add's backward
# passes the gradient on; the shared expert's input gradients are summed in block_traffic)
SHARED_EXPERT_ADD = RoutedPiece(forward=(("h:c", "h:c", "h:c"),), backward=())
# Qwen3-MoE's ``router_top_value.to(router_logits.dtype)`` (line 266); Mixtral keeps its routing weights in fp32
CAST_TOP_K = RoutedPiece(forward=(("k:f", "k:c"),), backward=(("k:c", "k:f"),))


def grouped_mm_dispatch(weights: str) -> RoutedPiece:
    """transformers 5.x's default experts implementation: ``grouped_mm`` (modeling_utils.py
    get_correct_experts_implementation, line 1894: "grouped_mm" when none is asked for), integrations/moe.py
    grouped_mm_experts_forward (lines 424-537), with routing weights of dtype ``weights`` (``c``: Qwen3-MoE's cast;
    ``f``: Mixtral's fp32, which promotes the weighted rows, their gather and sum to fp32 and adds a cast back).
    Forward: sort of the pairs' expert ids (line 440), ``perm // num_top_k``, the gather of the tokens' rows
    (``hidden_states[perm // k]``: a row per pair written, the hidden states counted once as read, as every op's
    inputs here, though each row is read k times; whether those rereads hit L2 was not measured) and of the routing
    weights, the expert ids to 4 bytes for histc (fp32 on CPU, int32 on CUDA, line 448), histc and cumsum (expert-
    sized outputs: per micro-batch, not counted), [grouped_mm, the gate (GATED), grouped_mm: other terms], the rows'
    multiply by their routing weight (line 524), inv_perm's arange and index_put_ (line 528), the rows' gather back
    into token order (line 529) and their sum over the k pairs (line 535). Backward: the sum's expanded gradient
    reshaped (a copy), index's backward (derivatives.yaml line 844: zeros, then index_put with accumulate) for the
    weighted rows, mul's two gradients and the routing weights' sum over the hidden width, index's backward for the
    routing weights' gather and for the tokens' (the scatter-add of the pairs' row gradients into the hidden
    states). CUDA's accumulating index_put also sorts its indices (aten/src/ATen/native/cuda/Indexing.cu
    index_put_with_sort_kernel), and sort is a multi-pass radix sort: their extra passes over the int64 indices (8 x
    k bytes per token each) are not counted."""
    w = "f" if weights == "f" else "c"  # the weighted rows' dtype: torch's type promotion of c x weights
    cast = weights == "f"
    forward = (("k:i", "k:i", "k:i"), ("k:i", "k:i"), ("h:c", "k:i", "kh:c"), (f"k:{weights}", "k:i", f"k:{weights}"),
               ("k:i", "k:f"), ("k:f",), (), ("kh:c", f"k:{weights}", f"kh:{w}"), ("k:i",), ("k:i",) * 4,
               (f"kh:{w}", "k:i", f"kh:{w}"), (f"kh:{w}", f"h:{w}")) + ((("h:f", "h:c"),) if cast else ())
    backward = ((("h:c", "h:f"),) if cast else ()) + (
        (f"h:{w}", f"kh:{w}"), (f"kh:{w}",), (f"kh:{w}", "k:i", f"kh:{w}", f"kh:{w}"),
        (f"kh:{w}", "kh:c", f"kh:{w}"), (f"kh:{w}", f"k:{weights}", f"kh:{w}")) + (
        (("kh:f", "kh:c"),) if cast else ()) + (
        (f"kh:{w}", f"k:{weights}"), (f"k:{weights}",),
        (f"k:{weights}", "k:i", f"k:{weights}", f"k:{weights}"), ("h:c",), ("h:c", "k:i", "kh:c", "h:c"))
    return RoutedPiece(forward, backward)


GROUPED_MM_DISPATCH = {"c": grouped_mm_dispatch("c"), "f": grouped_mm_dispatch("f")}
# The experts' gate: _default_apply_gate (integrations/moe.py line 578) ``gate, up = gate_up_out.chunk(2, dim=-1)``,
# then GATED (mlp_traffic); chunk's backward is one cat of the two halves' gradients
CHUNK = RoutedPiece(forward=(), backward=(("ki:c", "ki:c", "2ki:c"),))
# GptOssExperts._apply_gate (modeling_gpt_oss.py lines 81-87): the interleaved halves ``gate_up[..., ::2]`` and
# ``[..., 1::2]`` (views), gate clamped above, up clamped both ways, ``gate * sigmoid(gate * alpha)``, ``(up + 1) *
# glu``. Backward: the product's two gradients, glu's two, sigmoid_backward, the alpha mul's, gate's two gradients
# summed; clamp_backward (derivatives.yaml line 428): ``where(self <= max, grad, 0)`` for gate (scalar_tensor, le,
# where), ``where((self >= min).logical_and_(self <= max), grad, 0)`` for up (bool masks); each strided half's
# slice_backward (zeros of the full width, the half written in, as ROTARY's) and their sum.
GPT_OSS_GATE = RoutedPiece(
    forward=(("ki:c", "ki:c"),) * 4 + (("ki:c", "ki:c", "ki:c"), ("ki:c", "ki:c"), ("ki:c", "ki:c", "ki:c")),
    backward=(("ki:c", "ki:c", "ki:c"),) * 5 + (("ki:c", "ki:c"), ("ki:c", "ki:c", "ki:c"), (), ("ki:c", "ki:b"),
                                              ("ki:c", "ki:b"), ("ki:b", "ki:b", "ki:b"), ("ki:b", "ki:c", "ki:c"), (),
                                              ("ki:c", "ki:b"), ("ki:b", "ki:c", "ki:c")) + (
        ("ki:c", "2ki:c", "ki:c"),) * 2 + (("2ki:c", "2ki:c", "2ki:c"),),
)
# has_bias experts (gpt-oss: ``@use_experts_implementation(..., has_bias=True)``, line 67): grouped_mm_experts_forward
# gathers each pair's bias rows (``self.gate_up_proj_bias[expert_ids_g]``, ``self.down_proj_bias[expert_ids_g]``) and
# _grouped_linear adds them in place (``out.add_(bias)``); backward, index's backward accumulates the pairs' rows into
# each bias's gradient (its zeros are bias-sized: per micro-batch)
EXPERT_BIASES = RoutedPiece(
    forward=(("k:i", "2ki:c"), ("2ki:c", "2ki:c", "2ki:c"), ("k:i", "kh:c"), ("kh:c", "kh:c", "kh:c")),
    backward=((), ("k:i", "kh:c"), (), ("k:i", "2ki:c")),
)
# GptOssTopKRouter.forward (lines 125-129): topk over the (biased) logits in the compute dtype, softmax over the k
# values in it (``dtype=router_top_value.dtype``); backward _softmax_backward_data and topk's (zeros, scatter)
TOP_K_SOFTMAX = RoutedPiece(forward=(("e:c", "k:c", "k:i"), ("k:c", "k:c")),
                            backward=(("k:c", "k:c", "k:c"), ("e:c",), ("e:c", "k:i", "k:c", "e:c")))
# Llama4Router.forward (modeling_llama4.py lines 151-156): topk of the logits, ``full_like(logits, -inf).scatter_(1,
# indices, values)``, sigmoid in fp32 and cast back; backward the casts', sigmoid_backward, scatter_'s for the values
# (derivatives.yaml scatter.src: ``grad.gather(dim, index)``; full_like's needs none) and topk's (zeros, scatter)
LLAMA4_ROUTER = RoutedPiece(
    forward=(("e:c", "k:c", "k:i"), ("e:c",), ("e:c", "k:i", "k:c", "e:c"), ("e:c", "e:f"), ("e:f", "e:f"),
             ("e:f", "e:c")),
    backward=(("e:c", "e:f"), ("e:f", "e:f", "e:f"), ("e:f", "e:c"), ("e:c", "k:i", "k:c"), ("e:c",),
              ("e:c", "k:i", "k:c", "e:c")),
)
# Llama4TextMoe.forward (lines 169-177) runs every expert on every token (Llama4TextExperts: bmm over (E, tokens, h),
# lines 79-84; no @use_experts_implementation): here ``kh`` is E x hidden. ``hidden_states.repeat(E, 1)``, the scores
# transposed and reshaped (a copy), the copies multiplied by their score, [bmm, chunk, the gate (GATED over E x
# intermediate), bmm], the sum over the E copies, ``out.add_`` onto the shared expert's output. Backward: the sum's
# expanded gradient reshaped (a copy), mul's two gradients, the scores' sum over the hidden width, repeat's backward (a
# sum over the copies).
LLAMA4_DISPATCH = RoutedPiece(
    forward=(("h:c", "kh:c"), ("e:c", "e:c"), ("kh:c", "e:c", "kh:c"), ("kh:c", "h:c"), ("h:c", "h:c", "h:c")),
    backward=(("h:c", "kh:c"), ("kh:c", "kh:c", "kh:c"), ("kh:c", "e:c", "kh:c"), ("kh:c", "e:c"), ("kh:c", "h:c")),
)
# The experts' gates transformers 5.x defines apart from the default (gate, up) chunk
EXPERT_GATES = {"gpt_oss": GPT_OSS_GATE}
# The MoE layouts whose routing and dispatch are counted op by op (planner/model/layers.py MoeLayout, router): the
# routers of Mixtral and Qwen3-MoE (fp32 softmax top-k), DeepSeek-V3 (fp32 sigmoid, group-limited) and DeepSeek-V2
# (fp32 softmax, greedy or group-limited), each over @use_experts_implementation experts (modeling_mixtral.py line 56,
# modeling_qwen3_moe.py line 210, modeling_deepseek_v3.py line 160, modeling_deepseek_v2.py line 45) and gpt-oss's
# (top-k of the logits, then their softmax: line 67, biased experts), with their routing weights' dtype: Qwen3-MoE
# casts them to the compute dtype, gpt-oss's stay in it.
ROUTED_WEIGHTS = {("mixtral", "softmax"): "f", ("qwen3_moe", "softmax"): "c", ("deepseek", "sigmoid_grouped"): "f",
                  ("deepseek", "softmax_greedy"): "f", ("deepseek", "softmax_grouped"): "f",
                  ("gpt_oss", "topk_softmax"): "c", ("llama4", "sigmoid_top1"): "c"}


def routed_rows(m: MlpSpec) -> int:
    """Rows of the hidden width each token sends through the routed experts: its top-k, or every expert under
    Llama-4's bmm (LLAMA4_DISPATCH)."""
    return m.num_experts if m.layout == "llama4" else m.experts_per_token


def _router(m: MlpSpec) -> tuple[RoutedPiece, ...]:
    if m.router == "topk_softmax":
        return (TOP_K_SOFTMAX,)
    if m.router == "sigmoid_top1":
        return (LLAMA4_ROUTER,)
    if m.router in ("softmax_greedy", "softmax_grouped"):
        return (FP32_SOFTMAX_TOP_K,) + ((GROUP_LIMITED,) if m.router == "softmax_grouped" else ()) + (ROUTED_SCALING,)
    if m.router == "sigmoid_grouped":
        return (SIGMOID_GROUPED_TOP_K,) + ((DEEPSEEK_TOP_K_NORMALISED,) if m.normalise_top_k else ()) + (
            ROUTED_SCALING,)
    return (SOFTMAX_TOP_K,) + ((TOP_K_NORMALISED,) if m.normalise_top_k else ())


def moe_traffic(m: MlpSpec, hidden: int, tp: int, c: int) -> Traffic:
    """An MoE layer's router and dispatch per token on one TP rank (the experts' gate is GATED, in mlp_traffic).
    The router and the dispatch run on every token's full hidden width (the MLP's input is gathered under sequence
    parallelism; the experts' down projection is row-parallel, its output summed); the experts' inner width is a 1/tp
    shard. A (layout, router) no transformers block runs (not in ROUTED_WEIGHTS) is refused."""
    weights = ROUTED_WEIGHTS.get((m.layout, m.router))
    if weights is None:
        known = ", ".join(f"{layout}/{router}" for layout, router in ROUTED_WEIGHTS)
        raise PlannerError(f"mlp.layout({m.layout!r}) with mlp.router({m.router!r}): no transformers MoE block routes "
                           f"so; the step-time model counts {known}", field="mlp.router", value=m.router)
    k, rows = m.experts_per_token, routed_rows(m)
    inner = rows * m.intermediate_size / tp
    widths = {"h": hidden, "kh": rows * hidden, "e": m.num_experts, "k": k, "1": 1, "ki": inner, "2ki": 2 * inner,
              "g": m.groups, "2g": 2 * m.groups, "kg": m.groups_kept}
    cast = weights == "c" and m.router == "softmax"  # Qwen3-MoE's
    if m.layout == "llama4":  # its own dispatch, the shared expert's add in it (out.add_)
        pieces = _router(m) + (LLAMA4_DISPATCH, CHUNK)
    else:
        pieces = (_router(m) + ((CAST_TOP_K,) if cast else ()) + (GROUPED_MM_DISPATCH[weights],)
                  + (EXPERT_GATES.get(m.layout, CHUNK),) + ((EXPERT_BIASES,) if m.bias else ())
                  + ((SHARED_EXPERT_ADD,) if m.shared_intermediate_size else ()))
    return sum((routed_traffic(p, widths, c) for p in pieces), Traffic())


def norm_piece(norm: str, weight: str, frozen: bool = False) -> Piece:
    return (FROZEN_NORM_OPS if frozen else NORM_OPS)[(norm, weight)]


def plain_activation(a: Architecture) -> Piece:
    """A plain MLP's activation: GPT-2's activation_function (gelu_new by default), else nn.GELU (Falcon),
    as planner/model/activations.py reads it."""
    if a.model_type == "gpt2":
        return PLAIN_ACTIVATIONS[a.mlp_activation or "gelu_new"]
    return FUSED_ACTIVATION


def _qk_norm(s: LayerSpec, tp: int, c: int, frozen: bool = False) -> Traffic:
    """q's norm and k's, one call each: per head (Qwen3: rows of head_dim), over the projection (OLMo-2: one
    row per token) or Llama-4's weightless L2 norm per head."""
    a = s.attention
    if a.qk_norm == "none":
        return Traffic()
    piece = L2_NORM if a.qk_norm == "l2" else norm_piece("rmsnorm", s.norm_weight, frozen)
    per_head = a.qk_norm != "projection"
    return sum((traffic(piece, width / tp, c, rows=(heads / tp if per_head else 1.0))
                for width, heads in ((a.q_width, a.num_heads), (a.kv_width, a.num_kv_heads))), Traffic())


def _mlp_gradient_sums(m: MlpSpec) -> int:
    """Extra readers of the MLP's input: gate and up; an MoE's router and experts, and its shared expert's gate and
    up (DeepseekV3MLP, Llama4TextMLP: two nn.Linear reading the MoE's input; the replay sums three gradients)."""
    if m.is_moe:
        return 1 + (2 if m.shared_intermediate_size else 0)
    return 1 if (m.gated and not m.fused_gate_up) else 0


def _gradient_sums(s: LayerSpec) -> int:
    """Extra readers of the block's normed inputs, whose gradients autograd sums in backward."""
    a = s.attention
    attention = (0 if a.fused_qkv else 2) if kind_of(a).plain_projections else 1  # q, k, v; MLA's q and kv latents
    return attention + _mlp_gradient_sums(s.mlp) + (1 if s.norm_placement == "parallel" else 0)  # one norm, both


def mlp_traffic(arch: Architecture, m: MlpSpec, tp: int, c: int, fused: tuple[str, ...] = ()) -> Traffic:
    """The MLP's own elementwise ops per token (not its input's gradient sums: block_traffic): the activation (or gate)
    over the routed experts' active inner width on this TP rank, the shared expert's, and an MoE's router and
    dispatch."""
    gate = GATED if m.gated else plain_activation(arch)
    if m.gated and not m.is_moe and "swiglu" in fused:
        gate = LIGER_SWIGLU
    out = Traffic()
    if not (m.is_moe and m.layout in EXPERT_GATES):  # those experts' gates: moe_traffic
        out = traffic(gate, (routed_rows(m) if m.is_moe else 1) * m.intermediate_size / tp, c)
    if m.shared_intermediate_size:  # the shared expert's own MLP call (DeepseekV3MLP, Llama4TextMLP)
        out = out + traffic(gate, m.shared_intermediate_size / tp, c)
    if m.is_moe:
        out = out + moe_traffic(m, arch.hidden_size, tp, c)
    return out


def block_traffic(arch: Architecture, s: LayerSpec, tp: int, sp: bool, c: int, frozen: bool = False,
                  fused: tuple[str, ...] = ()) -> Traffic:
    """One token's elementwise traffic through one block on one TP rank. Norms, residuals and dropout run on
    the hidden width, a 1/tp share of the tokens under sequence parallelism; the gradient sums of a
    normed input on the gathered tokens' full width; q/k pieces and the MLP's on their TP shard. ``frozen``: the
    base's weights get no gradient (LoRA / QLoRA; the adapters' ops are FrozenBase.adapters). ``fused``: the ops
    that run as fused kernels (planner/recipes/fused_kernels.py: the block's hidden-width norms, the rotary, the
    dense gated activation; Qwen3's q/k norms stay eager, as activations.block_saved_bytes counts them)."""
    h = arch.hidden_size
    share = 1.0 / tp if sp else 1.0
    norm = _fused_norm(s.norm, fused) or norm_piece(s.norm, s.norm_weight, frozen)
    out = traffic(norm, h * share, c, rows=share).times(s.norms)
    out = out + traffic(ADD, h * share, c).times(2)
    out = out + traffic(GRADIENT_SUM, h, c).times(_gradient_sums(s))
    out = out + mlp_traffic(arch, s.mlp, tp, c, fused)
    a = s.attention
    if a.rope and not arch.learned_positions and "rope" in fused:  # q and k in one kernel
        rotary = LIGER_FP32_ROPE if arch.model_type in FP32_ROTARY_FAMILIES else LIGER_ROPE
        out = out + traffic(rotary, (a.q_width + a.kv_width) / tp, c, table=a.head_dim)
    elif a.rope and not arch.learned_positions:  # GPT-2's learned positions: no rotary
        rotary = FP32_ROTARY if arch.model_type in FP32_ROTARY_FAMILIES else ROTARY
        out = out + traffic(rotary, a.q_width / tp, c, table=a.head_dim) + traffic(rotary, a.kv_width / tp, c,
                                                                                   table=a.head_dim)
    out = out + _qk_norm(s, tp, c, frozen)
    if a.fused_qkv:
        out = out + traffic(SPLIT, (a.q_width + 2 * a.kv_width) / tp, c)
    if arch.hidden_dropout > 0:
        out = out + traffic(DROPOUT, h * share, c).times(2)  # after attention's and the MLP's output projections
    return out


def _fused_norm(norm: str, fused: tuple[str, ...]) -> Piece | None:
    """The fused kernel that replaces a block's norm of kind ``norm``, if one does."""
    return LIGER_RMSNORM if norm == "rmsnorm" and "rms_norm" in fused else None


def edge_traffic(arch: Architecture, last: LayerSpec, tp: int, sp: bool, c: int,
                 frozen: FrozenBase | None = None, fused: tuple[str, ...] = ()) -> Traffic:
    """Outside the blocks: the embedding's lookup and gradient, learned positions' lookup and their sum with it
    (GPT-2's ``inputs_embeds + position_embeds``), the embedding dropout, and the final norm (the blocks' norm
    module). Under a frozen base a frozen embedding's gradient is not computed (embedding_backward runs for a
    weight that requires grad: derivatives.yaml, embedding's ``weight:`` formula)."""
    h = arch.hidden_size
    share = 1.0 / tp if sp else 1.0
    lookup = EMBEDDING if frozen is None or frozen.embeddings_trained else Piece(EMBEDDING.forward, ())
    norm = _fused_norm(last.norm, fused) or norm_piece(last.norm, last.norm_weight, frozen is not None)
    out = traffic(lookup, h, c) + traffic(norm, h * share, c, rows=share)
    if arch.learned_positions:
        out = out + traffic(lookup, h, c) + traffic(ADD, h, c)
    if arch.hidden_dropout > 0:
        out = out + traffic(DROPOUT, h, c)
    return out
