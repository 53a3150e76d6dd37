"""The optimizers: one entry each, with what it keeps per parameter, what its step allocates and
costs, and the library source it was read from.

Every byte count is a function of one parameter's shape (``TensorShape``) and ``bits``, the width
of the tensor the optimizer steps (fp32 master weights under the mixed recipes, 16 bits once the
model is cast): torch.optim's states take that dtype; bitsandbytes' and torchao's quantized states
do not. Temporaries of the step are counted over the ordered list of tensors one optimizer steps,
because a single-tensor loop keeps the previous parameter's update alive until the next one is
assigned (Python rebinds a local only after the new value exists).

Where the states live: all on the device except ``paged`` (bitsandbytes' paged states are CUDA
unified memory, see ``PAGED_MIN_NUMEL``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from planner.model.shapes import TensorShape

OptimizerName = Literal["adamw", "adamw-single-tensor", "adamw-8bit", "adamw-paged-8bit", "adamw-torchao-8bit", "adamw-torchao-4bit",
                        "adafactor", "lion", "sgd", "sgd-momentum", "muon"]

FP32 = 4
# bitsandbytes 0.50 optim/optimizer.py Optimizer2State.init_state (lines 502-529) and
# Optimizer1State.init_state (674-695): a tensor under min_8bit_size=4096 keeps fp32 states; a larger
# one uint8 states with one fp32 absmax per block of 256 (blocksize = 256). The two 256-entry qmaps
# are shared by every parameter (self.name2qmap): 2 KiB once, not counted.
BNB_MIN_8BIT = 4096
BNB_BLOCK = 256
# bitsandbytes 0.50 optim/optimizer.py get_state_buffer (383-390): a paged optimizer allocates the
# states of a tensor of at least 1e5 elements with F.get_paged (functional.py:91, cget_managed_ptr:
# cudaMallocManaged), outside torch's caching allocator; smaller ones are ordinary zeros_like.
PAGED_MIN_NUMEL = 100_000
# torchao 0.18 optim/adam.py _new_buffer (71-76): quantize a state only if the tensor has at least
# 4096 values and a whole number of blocks, else zeros_like(p) in the parameter's dtype.
# AdamW8bit block_size=256 (adam.py:319), subclass_8bit.py OptimState8bit.zeros: uint8 codes of the
# tensor's shape, one fp32 scale per block, a 256-entry fp32 qmap per state tensor.
# AdamW4bit block_size=128 (adam.py:352), subclass_4bit.py OptimState4bit.zeros (114-130): two codes
# per byte, one fp32 scale per block, a 16-entry fp32 qmap per state tensor.
AO_MIN_NUMEL = 4096
# torch 2.13 optim/_muon.py: DEFAULT_NS_STEPS = 5 quintic Newton-Schulz iterations in bf16.
MUON_NS_STEPS = 5


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer. ``states(t, bits)``: bytes of one parameter's states. ``cpu_temporaries``:
    the most bytes the step's temporaries hold at once over the ordered tensors it steps, as the
    library's CPU path runs it; ``cuda_temporaries`` the same on CUDA (``foreach_copies``: the
    framework's full-size copies for torch's foreach AdamW). ``flops(t)``: matrix FLOPs of one
    parameter's step (Muon's Newton-Schulz; 0 for the elementwise optimizers)."""

    name: str
    source: str
    states: Callable[[TensorShape, int], int]
    cpu_temporaries: Callable[[Sequence[TensorShape], int], int]
    cuda_temporaries: Callable[[Sequence[TensorShape], int, int], int]
    state_tensors: int  # full-size state tensors the step reads and writes (the memory-bound traffic)
    runs_on_cpu: bool = True
    verified_on_cpu: bool = True  # real CPU runs in tests/real_runs.py measured it
    paged: bool = False
    # a ds_config can name it, so the engine builds it and ZeRO-Offload steps it on the CPU (DeepSpeedCPUAdam,
    # DeepSpeedCPULion, or torch.optim's own); a client optimizer is refused there (engine.py:2342)
    deepspeed_offload: bool = False
    whole_matrices: bool = False  # the step needs each 2-D parameter whole (Muon's Newton-Schulz)
    factored: bool = False  # its states depend on the tensor's shape, which DeepSpeed's flat partitions lose
    # steps a DTensor (FSDP2's shards, a TP rank's): torch 2.13's Adafactor cannot (its
    # torch.norm(grad, dim=-1).square_() is an in-place op on a _NormPartial placement: DTensor refuses it;
    # measured on CPU ranks under FSDP2)
    steps_dtensors: bool = True
    flops: Callable[[TensorShape], int] = lambda t: 0
    # the step on FSDP2's Shard(0) DTensor shards when it is not elementwise (Muon): (the shards, bits,
    # ranks per shard group) -> the most bytes its temporaries hold at once; None: the step is local
    dtensor_temporaries: Callable[[Sequence[TensorShape], int, int], int] | None = None
    # and what one rank multiplies and sends there: (a shard, ranks) -> FLOPs, [(what, bytes, ring passes)]
    dtensor_flops: Callable[[TensorShape, int], int] | None = None
    dtensor_collectives: Callable[[TensorShape, int], list[tuple[str, int, int]]] | None = None
    # steps each parameter with one elementwise kernel per line of the update (torch's _single_tensor_adam,
    # composer's DecoupledAdamW), not one fused pass: the time model charges each kernel's reads and writes
    unfused_step: bool = False

    def group_of(self, t: TensorShape) -> "OptimizerSpec":
        """The optimizer that steps ``t`` (Muon hands everything but hidden matrices to AdamW)."""
        return self


def _largest(tensors: Sequence[TensorShape]) -> int:
    return max((t.numel for t in tensors), default=0)


def _copies(count_fp32: int, count_param: int = 0) -> Callable[[Sequence[TensorShape], int], int]:
    """``count_fp32`` fp32 and ``count_param`` parameter-dtype full-size copies of the largest tensor."""
    return lambda tensors, bits: _largest(tensors) * (count_fp32 * FP32 + count_param * bits // 8)


def _none(tensors: Sequence[TensorShape], bits: int, foreach: int = 0) -> int:
    return 0


# --- torch.optim.AdamW ---------------------------------------------------------------------------

def _adamw_states(t: TensorShape, bits: int) -> int:
    return 2 * t.numel * bits // 8  # torch 2.13 optim/adam.py _init_group: exp_avg, exp_avg_sq zeros_like(p)


# torch 2.13 optim/adam.py _single_tensor_adam: exp_avg_sq.sqrt() and its division by the bias
# correction are two tensors of the parameter's dtype before the in-place addcdiv_
_adamw_cpu = _copies(0, 2)


def _adamw_cuda(tensors: Sequence[TensorShape], bits: int, foreach_copies: int) -> int:
    # the foreach path's _foreach_sqrt copies the group's exp_avg_sq once (Framework.cuda_adam_copies)
    return foreach_copies * sum(t.numel for t in tensors) * bits // 8


# --- bitsandbytes ----------------------------------------------------------------------------------

def _bnb_8bit_states(t: TensorShape, count: int) -> int:
    n = t.numel
    if n < BNB_MIN_8BIT:
        return count * FP32 * n
    return count * (n + FP32 * -(-n // BNB_BLOCK))


def _bnb_adam_cpu(tensors: Sequence[TensorShape], bits: int) -> int:
    """bitsandbytes 0.50 backends/cpu/ops.py _optimizer_update_8bit_blockwise_cpu: both states
    dequantized to fp32, grad = g.float() * gnorm_scale, and while the denominator is formed
    (state2_fp32.sqrt() / correction2) two more: five fp32 copies; p.data.float() a sixth for a
    16-bit parameter. A tensor under 4096 values takes the 32-bit path (_optimizer_update_32bit_cpu:
    g_float, then state2.sqrt() + eps and the quotient: three)."""
    extra = 0 if bits == 32 else 1
    return max([(5 + extra) * FP32 * t.numel if t.numel >= BNB_MIN_8BIT else (3 + extra) * FP32 * t.numel
                for t in tensors] or [0])


def _lion_cpu(tensors: Sequence[TensorShape], bits: int) -> int:
    """bitsandbytes 0.50 backends/cpu/ops.py _optimizer_update_32bit_cpu, "lion": g_float, then
    state1.mul(beta1).add(g_float) (two at once), then its sign(): three fp32 copies; p.data.float()
    a fourth for a 16-bit parameter."""
    return _largest(tensors) * FP32 * (3 + (0 if bits == 32 else 1))


# --- torchao low-bit AdamW -------------------------------------------------------------------------

def _ao_state(t: TensorShape, bits: int, block: int, code_bits: int, qmap: int) -> int:
    n = t.numel
    if n < AO_MIN_NUMEL or n % block:
        return n * bits // 8  # zeros_like(p)
    return n * code_bits // 8 + FP32 * (n // block) + FP32 * qmap


def _ao_cpu(tensors: Sequence[TensorShape], bits: int) -> int:
    """torchao 0.18 optim/adam.py single_param_adam, compiled (fullgraph): the block-wise
    requantization of each new state (the subclass's copy_ from fp32: scale_tensor, then the codes)
    reads the whole fp32 state, so the compiled step materializes exp_avg_f32 and exp_avg_sq_f32;
    p.float() and grad.float() are two more for a 16-bit parameter."""
    return _largest(tensors) * (2 * FP32 + (0 if bits == 32 else 2 * FP32))


def _ao4_cpu(tensors: Sequence[TensorShape], bits: int) -> int:
    """torchao 0.18 AdamW4bit's step as inductor compiles it on CPU (torch 2.13; its generated code,
    TORCH_LOGS=output_code, for a (4096, 256) parameter): before the one fused kernel, each state's
    nibbles unpacked to one uint8 per value (subclass_4bit.py dequantize: torch.stack of codes >> 4
    and codes & 15, an aten.cat), and as the kernel's outputs, per state, the block-scaled fp32 values
    (scale_tensor), their fp32 block scales and the int64 codes of quantize_4bit_with_qmap's binary
    search (torch.where on integer indices): 2 x (1 + 4 + 8) bytes per value."""
    n = _largest(tensors)
    return 2 * (n + FP32 * n + 8 * n + FP32 * (n // 128))


# --- torch.optim.Adafactor --------------------------------------------------------------------------

def _adafactor_states(t: TensorShape, bits: int) -> int:
    """torch 2.13 optim/_adafactor.py _init_group (100-113): a tensor of two or more dimensions keeps
    row_var (its shape with the last dimension 1) and col_var (the next-to-last 1), new_zeros of the
    gradient's dtype; a vector keeps a full ``variance``. No first moment (beta1 does not exist)."""
    d = t.dims
    if len(d) < 2:
        return t.numel * bits // 8
    rows = t.numel // d[-1]
    cols = t.numel // d[-2]
    return (rows + cols) * bits // 8


def _adafactor_cpu(tensors: Sequence[TensorShape], bits: int) -> int:
    """torch 2.13 optim/_adafactor.py _single_tensor_adafactor (CPU: foreach off): a matrix's step
    builds var_estimate = row_var @ col_var, full size, which becomes the update in place; a vector's
    builds grad * grad and variance.clone(). The previous parameter's update (and the last vector's
    grad_squared) stay bound until reassigned, so they overlap the next parameter's."""
    peak = previous = squared = 0
    for t in tensors:
        now = t.numel
        held = previous + now + (max(squared, now) if len(t.dims) < 2 else squared)
        peak = max(peak, held)
        if len(t.dims) < 2:
            squared = now
        previous = now
    return peak * bits // 8


def _adafactor_cuda(tensors: Sequence[TensorShape], bits: int, foreach_copies: int) -> int:
    """_multi_tensor_adafactor (foreach, torch's default on CUDA): tensors grouped by whether they
    are matrices (_group_tensors_by_device_dtype_and_is_multidim); a group of matrices builds every
    var_estimate at once (a full copy of the group), a group of vectors grads_squared and the clones."""
    matrices = sum(t.numel for t in tensors if len(t.dims) >= 2)
    vectors = sum(t.numel for t in tensors if len(t.dims) < 2)
    return max(matrices, 2 * vectors) * bits // 8


# --- torch.optim.SGD ------------------------------------------------------------------------------

def _sgd_momentum_states(t: TensorShape, bits: int) -> int:
    return t.numel * bits // 8  # torch 2.13 optim/sgd.py: momentum_buffer = torch.clone(grad).detach()


# --- torch.optim.Muon -----------------------------------------------------------------------------

def _ns_flops(t: TensorShape) -> int:
    """_zeropower_via_newtonschulz on (m, n), k = min, l = max: per iteration the Gram matrix
    X X^T (2 k^2 l), addmm of the Gram with itself (2 k^3) and addmm of that with X (2 k^2 l)."""
    if len(t.dims) != 2:
        return 0
    k, l = min(t.dims), max(t.dims)
    return MUON_NS_STEPS * (4 * k * k * l + 2 * k ** 3)


def _muon_temporaries(tensors: Sequence[TensorShape], bits: int) -> int:
    """torch 2.13 optim/_muon.py _single_tensor_muon (the only path: "Foreach is not supported for
    Muon yet"), per matrix (m, n), k = min(m, n): the Nesterov update grad.lerp(buf) in the parameter's
    dtype, held as _zeropower_via_newtonschulz's argument; beside it two bf16 m x n tensors at once
    (the bf16 copy and the first iterate, or an old and a new iterate: with a bf16 parameter the copy
    is the lerp itself and the second iteration holds two iterates), and the k x k Gram matrix and
    its update (bf16). The previous matrix's bf16 update is still bound while the lerp is allocated."""
    peak = previous = 0
    for t in tensors:
        mn = t.numel
        k = min(t.dims) if len(t.dims) == 2 else 0
        lerp = mn * bits // 8
        peak = max(peak, previous + lerp, lerp + 2 * 2 * mn + 2 * 2 * k * k)
        previous = 2 * mn
    return peak


def _muon_dtensor_temporaries(shards: Sequence[TensorShape], bits: int, world: int) -> int:
    """torch 2.13 _single_tensor_muon on FSDP2's Shard(0) shards (local rows r of a matrix (m, n), m = r
    x world): DTensor's sharding propagation (torch/distributed/tensor/_ops/_matrix_ops.py) redistributes
    inside _zeropower_via_newtonschulz, traced on 2 and 4 CPU ranks (planner/memory/optimizer.py check):

    rows <= columns: X is Shard(0) (the bf16 r x n shard). ``X @ X.T`` gathers X.T (Shard(1)) to
    Replicate: a contiguous copy of the shard, the all-gathered buffer and their cat (two whole m x n
    matrices); the Gram is Shard(0) (r x m) while the previous iteration's Gram and Gram update are still
    bound; its all-gather (m x m) feeds addmm(gram, gram, gram) and X's all-gather the next addmm, whose
    whole m x n buffer gloo's Work frees on its own thread, with its input (the previous iterate), at times
    only after the next iteration's gathers allocated. Peak, in the X.T gather of an iteration after the
    first, in bytes (bf16: 2 per element): the update (lerp, parameter dtype), the iterate, the previous
    one and the contiguous copy (6rn), the old Gram, old Gram update and new Gram (6rm), the gathered
    buffer, gloo's staging or the cat, and the previous gathered X (6mn).

    rows > columns: X is the transposed shard (Shard(1) of n x m), the Gram a Partial n x n on every rank,
    all-reduced into a Replicate copy for the Gram update and the update's copy for the new iterate; the
    previous copy may still be live (gloo frees it on its thread). Peak in the new iterate's addmm: the
    update, the old and new iterates (2 x 2rn), the Gram, the Gram update, two Replicate copies and the
    Partial Gram of the next: lerp + 4rn + 8n^2 bytes.

    With a bf16 parameter the shard's bf16 copy is the lerp itself, but from the second iteration on
    the iterate is a separate tensor and the lerp stays bound as the function's argument, so the peak
    (after the first iteration) is the same. oneDNN's matmul workspaces on CPU (50-110 KB at these
    sizes) are not counted. The previous matrix's update is still bound while the lerp is allocated."""
    peak = previous = 0
    for t in shards:
        if len(t.dims) != 2:
            continue
        r, n = t.dims
        m = r * world
        lerp = r * n * bits // 8
        if m <= n:
            held = lerp + 6 * r * n + 6 * r * m + 6 * m * n
        else:
            held = lerp + 4 * r * n + 8 * n * n
        peak = max(peak, previous + lerp, held)
        previous = 2 * r * n
    return peak


def _muon_dtensor_flops(t: TensorShape, world: int) -> int:
    """One rank's Newton-Schulz FLOPs on its Shard(0) rows r of (m, n): rows <= columns, every matmul
    produces the rank's rows only (the whole matrix's / world); rows > columns, the Gram and the new
    iterate are the rank's columns (2 n^2 r each) but the Gram update is a whole n x n x n product on
    every rank (Replicate x Partial)."""
    if len(t.dims) != 2:
        return 0
    r, n = t.dims
    m = r * world
    if m <= n:
        return MUON_NS_STEPS * (4 * r * m * n + 2 * r * m * m)
    return MUON_NS_STEPS * (4 * n * n * r + 2 * n ** 3)


def _muon_dtensor_collectives(t: TensorShape, world: int) -> list[tuple[str, int, int]]:
    """(what, bytes per rank's message, ring passes) of one matrix's step on Shard(0) shards (r, n),
    as DTensor sends them (measured: 15 all-gathers and 1 all-reduce per matrix and step when rows <=
    columns, 11 all-reduces otherwise; the norm's all-reduce is a scalar and left out)."""
    if len(t.dims) != 2 or world <= 1:
        return []
    r, n = t.dims
    m = r * world
    if m <= n:
        return MUON_NS_STEPS * [("Muon: X.T all-gather", 2 * m * n, 1), ("Muon: Gram all-gather", 2 * m * m, 1),
                                ("Muon: X all-gather", 2 * m * n, 1)]
    return MUON_NS_STEPS * 2 * [("Muon: Partial Gram all-reduce", 2 * n * n, 2)]


@dataclass(frozen=True)
class MuonSpec(OptimizerSpec):
    """torch.optim.Muon for the hidden 2-D weights and torch.optim.AdamW for the rest (embeddings,
    LM head, norms, biases, 3-D experts), as Moonlight (Liu et al. 2025, "Muon is Scalable for LLM
    Training", Sec. 2.3) and torch's own docstring (optim/_muon.py: "Other parameters, such as bias,
    and embedding, should be optimized by a standard method such as AdamW") run it."""

    def group_of(self, t: TensorShape) -> OptimizerSpec:
        return self if len(t.dims) == 2 and not t.io else OPTIMIZERS["adamw"]


def _muon_states(t: TensorShape, bits: int) -> int:
    return t.numel * bits // 8  # _init_group: momentum_buffer = zeros_like(p.grad)


ADAMW = OptimizerSpec("adamw", "torch 2.13 torch/optim/adam.py (AdamW)", _adamw_states, _adamw_cpu, _adamw_cuda, 2,
                      deepspeed_offload=True)
# torch.optim.AdamW(foreach=False) on CUDA (adam.py _single_tensor_adam, line 544: ``denom =
# (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``, one parameter at a time) and composer's
# DecoupledAdamW (composer v0.14.0-v0.17.2 optim/decoupled_weight_decay.py DecoupledAdamW.adamw, lines
# 248-275 at v0.14.0: the same loop, ``denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)``):
# the foreach path's copy of the whole group's exp_avg_sq never exists; two copies of the largest
# tensor do, as on the CPU path
ADAMW_SINGLE_TENSOR = OptimizerSpec(
    "adamw-single-tensor", "torch 2.13 torch/optim/adam.py AdamW(foreach=False), _single_tensor_adam; composer "
    "0.14-0.17 optim/decoupled_weight_decay.py DecoupledAdamW (the same per-parameter loop)", _adamw_states,
    _adamw_cpu, lambda tensors, bits, foreach: _adamw_cpu(tensors, bits), 2, unfused_step=True)
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": ADAMW,
    "adamw-single-tensor": ADAMW_SINGLE_TENSOR,
    "adamw-8bit": OptimizerSpec("adamw-8bit", "bitsandbytes 0.50 optim/adamw.py AdamW8bit (Optimizer2State, 8 bits)",
                                lambda t, bits: _bnb_8bit_states(t, 2), _bnb_adam_cpu, _none, 2),
    "adamw-paged-8bit": OptimizerSpec("adamw-paged-8bit", "bitsandbytes 0.50 optim/adamw.py PagedAdamW8bit "
                                      "(Optimizer2State, 8 bits, is_paged)",
                                      lambda t, bits: _bnb_8bit_states(t, 2), _bnb_adam_cpu, _none, 2, paged=True),
    "adamw-torchao-8bit": OptimizerSpec("adamw-torchao-8bit", "torchao 0.18 optim/adam.py AdamW8bit, subclass_8bit.py",
                                        lambda t, bits: 2 * _ao_state(t, bits, 256, 8, 256), _ao_cpu, _none, 2),
    "adamw-torchao-4bit": OptimizerSpec("adamw-torchao-4bit", "torchao 0.18 optim/adam.py AdamW4bit, subclass_4bit.py",
                                        lambda t, bits: 2 * _ao_state(t, bits, 128, 4, 16), _ao4_cpu, _none, 2),
    "adafactor": OptimizerSpec("adafactor", "torch 2.13 torch/optim/_adafactor.py (Adafactor)", _adafactor_states,
                               _adafactor_cpu, _adafactor_cuda, 1, factored=True, deepspeed_offload=True,
                               steps_dtensors=False),
    "lion": OptimizerSpec("lion", "bitsandbytes 0.50 optim/lion.py Lion (Optimizer1State, 32 bits); DeepSpeed 0.19.8 "
                          "ops/lion FusedLion / DeepSpeedCPULion keep the same fp32 exp_avg",
                          lambda t, bits: FP32 * t.numel, _lion_cpu, _none, 1, deepspeed_offload=True),
    "sgd": OptimizerSpec("sgd", "torch 2.13 torch/optim/sgd.py (SGD, momentum=0: no momentum_buffer)",
                         lambda t, bits: 0, lambda tensors, bits: 0, _none, 0, deepspeed_offload=True),
    "sgd-momentum": OptimizerSpec("sgd-momentum", "torch 2.13 torch/optim/sgd.py (SGD, momentum > 0)",
                                  _sgd_momentum_states, lambda tensors, bits: 0, _none, 1, deepspeed_offload=True),
    "muon": MuonSpec("muon", "torch 2.13 torch/optim/_muon.py (Muon) + adam.py (AdamW for the rest)", _muon_states,
                     _muon_temporaries, lambda tensors, bits, foreach: _muon_temporaries(tensors, bits), 1,
                     whole_matrices=True, flops=_ns_flops, dtensor_temporaries=_muon_dtensor_temporaries,
                     dtensor_flops=_muon_dtensor_flops, dtensor_collectives=_muon_dtensor_collectives),
}
