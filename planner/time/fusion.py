"""A decoder block's memory-bound work under torch.compile (inductor), forward and backward.

Eager PyTorch runs every ATen op of a norm, a rotary embedding or an activation as its own kernel
(planner/time/elementwise.py). Inductor (torch 2.13, torch/_inductor/) fuses the ops between the ones it does
not generate code for into as few kernels as its scheduler can, and a fused kernel reads the tensors that come
from outside it once and writes the tensors that leave it once. Here a block is cut at those boundaries into
regions and each region's kernel is charged its external reads and writes.

What bounds a region, and why (paths under torch/_inductor/, torch 2.13):
- Matmuls (mm, addmm, bmm) run as extern cuBLAS calls: ``max_autotune`` and ``max_autotune_gemm`` are off
  unless TORCHINDUCTOR_MAX_AUTOTUNE=1 (config.py lines 514, 520), so no Triton mm template exists for
  ``epilogue_fusion`` (line 274) to fuse a pointwise epilogue into. A linear's bias rides in addmm.
- Attention (SDPA's flash/efficient/cudnn kernels) and collectives (TP/SP all-gather, reduce-scatter) are
  fallback kernels (ExternKernelSchedulerNode), never fused.
- Between them, pointwise ops and reductions fuse. A pointwise result read by several consumers is recomputed
  inside each instead of written when it reads few buffers (ir.py StorageBox.should_realize_on_reuse, line
  ~10093: realized only past ``realize_reads_threshold`` = 4 reads, config.py line 861): so a residual sum ``x
  + attn_out`` is never stored; the post-attention norm and the block's last add both read ``x`` and
  ``attn_out``.
- A row reduction and its pointwise epilogue fuse (scheduler.py Scheduler.can_fuse, line 7327, and the
  backends' can_fuse_vertical: the same numel x rnumel), so a norm is one kernel: read the input, write the
  output and its per-row statistics (saved for backward).
- AOTAutograd's partitioner (torch/_functorch/partitioners.py min_cut_rematerialization_partition, line 3725)
  saves the cheapest cut: the matmul inputs and outputs that exist anyway, and the norms' per-row statistics;
  what lies between (a residual sum, a normed input) is recomputed inside backward kernels.
- Dropout: the random mask is drawn inside the kernel (inductor_random) and saved as a bool (random ops are
  never recomputed by the partitioner, partitioners.py is_random, line 113): one byte written forward and read
  backward.

Where CUDA (Triton) and CPU (C++) differ, both are modelled (``backend``): ``"triton"`` is what the planner
times (kernels.work), the CUDA side of each difference read off the source, not measured here; ``"cpp"`` what
tests/test_fusion.py checks against inductor's own per-kernel byte count (scheduler.py
get_read_write_buffer_accesses) on CPU:
- cat: on CPU always a ConcatKernel (lowering.py cat, line 2254: "negative performance impact of pointwise_cat
  optimization on CPU"), so rotate_half's two halves are written before the rotary's mul-add reads them (two
  copy kernels more per q and k; with a q/k norm they share reads and fuse into one, scheduler.py
  score_fusion_memory, line 8080); on CUDA a cat of at most ``max_complex_pointwise_cat_inputs`` = 8 inputs is
  a pointwise_cat (masked loads, line 2279) fused into its consumer: one rotary kernel. Likewise the
  backward's cat of dq, dk, dv for a fused q/k/v projection: one copy kernel on CUDA (pointwise_cat of extern
  outputs), one per input on CPU.
- A norm's weight gradient (a column reduction over tokens) is a second reduction over the same inputs as the
  input gradient (a row reduction). On CUDA ``triton.mix_order_reduction`` (config.py line 2120, on outside
  fbcode) fuses the two (scheduler.py MixOrderReduction.can_fuse, line 336: sibling sum reductions sharing a
  read, rows >= 4096 and >= 2 x columns, columns <= 16384, rows x columns >= 5 Mi, at most 10 reads): one
  kernel. Training micro-batches have >= 4096 tokens per GPU and hidden <= 16384, so the planner takes it
  fused. On CPU it is one more kernel rereading the norm's inputs and gradients (the block's weight gradients
  fused into one kernel where they share a read, the block input).
- A q/k norm (Qwen3, OLMo-2) on CPU writes only its statistic in its own kernel, and its backward's rotary
  part is written before the norm's backward reads it; on CUDA the norm, rotate_half and the rotary multiply
  are one persistent reduction per head row, forward and backward.
- LayerNorm's saved mean and rstd are fp32 on CUDA and in the input's dtype on CPU (torch/_refs/__init__.py
  native_layer_norm, line 3505: ``if input.device.type in ["cpu", "mtia"]`` casts them).
- The softmax of the loss: CUDA's online softmax (``online_softmax``, config.py line 219;
  fx_passes/post_grad.py prepare_softmax_extra_check, line 470: triton only) reads the logits once for max and
  sum; CPU reads them twice.
- Not modelled on CPU: the CPU flash attention's backward copies its logsumexp (attention's own, not a block
  piece); CPU's C++ kernels draw dropout's mask in a kernel of its own (the test runs without dropout).

``compiled``: "blocks" (torchtitan's per-TransformerBlock torch.compile, models/llama3/infra/parallelize.py
apply_compile, "Apply torch.compile to each TransformerBlock") compiles each block, and torchtitan compiles
its loss function apart (config/job_config.py Compile.components, default ["model", "loss"];
components/loss.py build_cross_entropy_loss: ``torch.compile(loss_fn)`` over ``cross_entropy(pred.float(),
labels)``, HF's ops); the embedding and the final norm run eager. "model" (HF Trainer's ``torch_compile``,
fms-fsdp) compiles the whole model, the embedding and the final norm with it (edge_traffic). The loss is
compiled under both (loss_bytes_per_logit). Within the blocks both are charged the block layout (each block's
last residual add its own kernel): whole-model compile may fuse that add into the next block's first norm,
saving up to one residual write and read per block. Not fused here: eager attention's score matrix
(kernels.work's ``eager_bytes``, charged as eager runs it) and the host's launch cost per kernel
(kernels.HOST_SECONDS_PER_KERNEL, charged per fused kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerError
from planner.model.architecture import Architecture
from planner.model.layers import LayerSpec
from planner.model.attention.kinds import kind_of
from planner.time.elementwise import EMBEDDING, Traffic

FP32 = 4
COMPILE_MODES = ("none", "blocks", "model")
BACKENDS = ("triton", "cpp")


@dataclass
class _Kernels:
    """Bytes per token of each fused kernel, forward and backward; what a recompute does not rerun of the forward
    (recompute_bytes): ``output``, the kernel that writes the block's output; ``act_reads``, the activation's reads;
    ``norm_input_read``, the attention-input norm's read of the block input (pre-norm, sandwich); ``normed_mlp_out``:
    a norm reads the MLP's output in backward (post-norm, sandwich)."""

    forward: list[float]
    backward: list[float]
    output: float = 0.0
    act_reads: float = 0.0
    norm_input_read: float = 0.0
    normed_mlp_out: bool = False

    def traffic(self) -> Traffic:
        return Traffic(sum(self.forward), sum(self.backward), len(self.forward), len(self.backward))


def check_mode(compiled: str) -> str:
    if compiled not in COMPILE_MODES:
        raise PlannerError(f"compile({compiled!r}) is not one of {', '.join(COMPILE_MODES)}", field="compile")
    return compiled


def _statistic_bytes(norm: str, c: int, backend: str) -> int:
    """Per-row statistics a norm saves: RMSNorm's fp32 rstd (the module upcasts); LayerNorm's mean and rstd
    (fp32 on CUDA, the input's dtype on CPU)."""
    if norm == "rmsnorm":
        return FP32
    return 2 * (FP32 if backend == "triton" else c)


def _parts(s: LayerSpec) -> tuple[int, int]:
    """Gradient parts arriving at the attention's normed input and at the MLP's, one per matmul reading it
    (the readers elementwise._gradient_sums counts beyond the first): q, k, v (or one fused q/k/v; MLA's q
    and kv latents); gate and up (or one fused; a MoE's router, experts and shared expert)."""
    a, m = s.attention, s.mlp
    attention = (1 if a.fused_qkv else 3) if kind_of(a).plain_projections else 2
    if m.is_moe:
        mlp = 2 + (1 if m.shared_intermediate_size else 0)
    else:
        mlp = 2 if (m.gated and not m.fused_gate_up) else 1
    return attention, mlp


def _qk(arch: Architecture, s: LayerSpec, tp: int, c: int, backend: str, k: _Kernels) -> None:
    """q's and k's rotary embedding and norm: per head row (Qwen3), over the projection (OLMo-2) or none."""
    a = s.attention
    rope = a.rope and not arch.learned_positions
    norm = a.qk_norm != "none"
    if not (rope or norm):
        return
    table = 2 * c * a.head_dim if rope else 0  # cos and sin, one row of head_dim per token
    q, kv = (_projection(c * width, (heads if a.qk_norm != "projection" else 1.0) * FP32 if norm else 0.0, table,
                         rope, norm, backend)
             for width, heads in ((a.q_width / tp, a.num_heads / tp), (a.kv_width / tp, a.num_kv_heads / tp)))
    if rope and a.q_width == a.kv_width:
        _fuse_q_and_k(q, kv, backend)
    k.forward += q.forward + kv.forward
    k.backward += q.backward + kv.backward


def _projection(x: float, rows: float, table: float, rope: bool, norm: bool, backend: str) -> _Kernels:
    """One projection's (q's or k's) kernels: ``x`` its bytes per token, ``rows`` its norm's statistic."""
    if backend == "triton":  # read q, the table; write q', the statistic; backward read dq', the table (q)
        return _Kernels([2 * x + table + rows], [(3 if norm else 2) * x + table + rows])
    k = _Kernels([], [])
    if norm:
        k.forward.append(x + rows)  # the statistic alone
    if rope:
        k.forward += [x + rows + x] if norm else [x, x]  # rotate_half's two halves, written (ConcatKernel)
        k.forward.append(3 * x + rows + table)  # read q, both halves, the table; write q'
        k.backward.append(2 * x + table)  # dq' through the rotary: read dq', the table; write
    else:
        k.forward.append(2 * x + rows)  # the normed q: read q, the statistic; write
    if norm:
        k.backward.append(3 * x + rows)  # the norm's input gradient: read its output's gradient, q; write dq
        k.backward.append(2 * x + rows)  # its weight gradient: the same reads again
    return k


def _fuse_q_and_k(q: _Kernels, kv: _Kernels, backend: str) -> None:
    """Multi-head attention (as many k heads as q heads): q's and k's rotary kernels have the same size and
    share the table's reads, so the scheduler fuses them horizontally (scheduler.py can_fuse: the same
    iteration group; score_fusion_memory, line 8080: the shared cos and sin): one kernel. Its bytes stay
    the two kernels' (inductor's own count, get_read_write_buffer_accesses, charges the table once per
    load: q's and k's index it apart). On CPU only the two multiply-adds fuse forward (their halves read
    different buffers)."""
    kv.forward[-1] += q.forward.pop()
    if backend == "triton":
        kv.backward[0] += q.backward.pop(0)


def _qkv_cat(s: LayerSpec, tp: int, c: int, backend: str, k: _Kernels) -> None:
    """A fused q/k/v projection: its input gradient is one matmul over the cat of dq, dk and dv."""
    a = s.attention
    if not a.fused_qkv:
        return
    widths = (a.q_width / tp, a.kv_width / tp, a.kv_width / tp)
    if backend == "triton":
        k.backward.append(2 * c * sum(widths))
    else:
        k.backward += [2 * c * w for w in widths]


def _block_kernels(arch: Architecture, s: LayerSpec, tp: int, sp: bool, c: int, backend: str) -> _Kernels:
    """block_traffic's kernels, the block's output kernel marked."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)} (a caller's argument, not a request field)")
    share = 1.0 / tp if sp else 1.0
    hs = c * arch.hidden_size * share  # bytes of one hidden-width tensor per token
    hg = c * arch.hidden_size  # the same, gathered
    stat = _statistic_bytes(s.norm, c, backend) * share
    drop = arch.hidden_size * share if arch.hidden_dropout > 0 else 0.0  # one bool mask byte per element
    attn_parts, mlp_parts = _parts(s)
    k = _Kernels([], [])
    _mlp(s, tp, c, k)
    _residual(s, hs, hg, stat, drop, attn_parts, mlp_parts, tp, backend, k)
    _qk(arch, s, tp, c, backend, k)
    _qkv_cat(s, tp, c, backend, k)
    return k


def block_traffic(arch: Architecture, s: LayerSpec, tp: int, sp: bool, c: int, backend: str = "triton") -> Traffic:
    """One token's fused traffic through one compiled block on one TP rank (shares as
    elementwise.block_traffic: hidden-width work on 1/tp of the tokens under sequence parallelism, the
    gradient parts of a normed input on the gathered tokens, q/k and MLP work on their TP shard)."""
    return _block_kernels(arch, s, tp, sp, c, backend).traffic()


RERUN_POLICIES = ("full", "selective-op")  # the policies whose recompute reruns elementwise work


def recompute_bytes(arch: Architecture, s: LayerSpec, tp: int, sp: bool, c: int, checkpointing: str,
                    backend: str = "triton") -> float:
    """Bytes per token the fused kernels of a checkpointed compiled block's recompute move in backward, beyond
    its backward's own (``checkpointing``: full or selective-op; core-attention recompute reruns no elementwise
    work of this model's).

    Under a checkpoint the traced region's ops carry recompute tags (torch 2.13 utils/checkpoint.py
    _CachingTorchDispatchMode: ``fx_traceback.current_meta["recompute"] = policy`` when compiling; plain
    checkpoint: every op PREFER_RECOMPUTE) and the partitioner recomputes in backward each tagged node backward
    needs (torch/_functorch/partitioners.py solve_min_cut: ``must_recompute``). Inductor then schedules those
    nodes among the backward's own and fuses them where they share reads (scheduler.py score_fusion_memory):
    - the block's output (the last residual add; post-norm and sandwich: with a norm's statistic, which the
      norm's backward kernel recomputes from the tensor it reads anyway) is not needed: not rerun;
    - the activation's product, needed only by the down projection's weight gradient, fuses into the
      activation's backward kernel, which reads gate and up too: only its write remains. Not where the down
      projection itself reruns for a norm over its output (full checkpointing of a post-norm or sandwich
      block): the product is then needed before the MLP's backward, and reruns whole;
    - under per-op SAC (SDPA's output saved: the attention output is rebuilt by o_proj alone), a pre-norm or
      sandwich block's attention-input norm is needed only by the attention's half of backward, and fuses into
      the MLP-side norm's backward kernel, which reads the block input too: only its writes remain. Under full
      checkpointing the attention's rerun needs it first: rerun whole.
    The rest (the MLP-side norm, rotary, q/k norms) reruns as the forward ran it. Measured on CPU
    (tests/test_compile_checkpointing.py, inductor's own per-kernel bytes, backward with the checkpoint minus
    without): exactly this under per-op SAC for Llama, Qwen3 (pre-norm) and OLMo-2 (post-norm), Gemma-3
    (sandwich) 3% under it. Under full checkpointing: Qwen3 exactly, Llama 9% over it (its CPU rerun writes the
    rotated q and k once more), OLMo-2 and Gemma-3 1.3x and 1.6x it (their rotary and activation reruns write
    extra copies; the C++ backward of their fp32-weight norms is unmatched even unchecked, tests/test_fusion.py).
    The CUDA side follows the same scheduler rules, unmeasured."""
    if checkpointing not in RERUN_POLICIES:
        raise ValueError(f"checkpointing {checkpointing!r} is not one of {', '.join(RERUN_POLICIES)} (a caller's "
                         "argument)")
    k = _block_kernels(arch, s, tp, sp, c, backend)
    act = 0.0 if checkpointing == "full" and k.normed_mlp_out else k.act_reads
    fused = act + (k.norm_input_read if checkpointing == "selective-op" else 0.0)
    return sum(k.forward) - k.output - fused


def _mlp(s: LayerSpec, tp: int, c: int, k: _Kernels) -> None:
    """The activation between the MLP's matmuls: act(gate) * up, or act(up); backward reads its gradient and
    the saved matmul outputs (the product is the down matmul's input, saved anyway) and writes theirs."""
    m = s.mlp
    inner = c * ((m.experts_per_token if m.is_moe else 1) * m.intermediate_size + m.shared_intermediate_size) / tp
    if m.gated:
        k.forward.append(3 * inner)
        k.backward.append(5 * inner)
    else:
        k.forward.append(2 * inner)
        k.backward.append(3 * inner)
    k.act_reads = k.forward[-1] - inner


def _norm_backward(parts: int, hs: float, hg: float, tp: int, k: _Kernels) -> float:
    """Bytes of a normed input's gradient parts as the norm's backward reads them: summed inside it; under
    tensor parallelism summed before the all-reduce (or, with sequence parallelism, the reduce-scatter) on
    the gathered tokens, a kernel of its own, the norm reading the reduced gradient once."""
    if tp == 1:
        return parts * hg
    if parts > 1:
        k.backward.append((parts + 1) * hg)
    return hs


def _residual(s: LayerSpec, hs: float, hg: float, stat: float, drop: float, attn_parts: int, mlp_parts: int,
              tp: int, backend: str, k: _Kernels) -> None:
    """The norms and residual adds of the block, by where its norms sit (``drop``: the dropout masks' bytes
    after the attention's and the MLP's output projections, written forward and read backward)."""
    placement = s.norm_placement
    if placement == "parallel":
        _parallel(s, hs, hg, stat, drop, attn_parts, mlp_parts, tp, backend, k)
    elif placement == "post":
        _post(hs, hg, stat, drop, attn_parts, mlp_parts, tp, backend, k)
    elif placement == "sandwich":
        _sandwich(hs, hg, stat, drop, attn_parts, mlp_parts, tp, backend, k)
    else:
        _pre(hs, hg, stat, drop, attn_parts, mlp_parts, tp, backend, k)
    if drop:  # the gradient times the mask, before each output projection's backward matmul
        k.backward += [2 * hs + drop] * 2


def _pre(hs: float, hg: float, stat: float, drop: float, attn_parts: int, mlp_parts: int, tp: int,
         backend: str, k: _Kernels) -> None:
    """Llama, GPT-2: x2 = x + attn(norm1(x)); out = x2 + mlp(norm2(x2)). x2 is never written."""
    k.forward.append(2 * hs + stat)  # read x; write the normed input and its statistic
    k.forward.append(3 * hs + stat + drop)  # read x, attn_out; write the normed x2, its statistic (and a mask)
    k.forward.append(4 * hs + 2 * drop)  # read x, attn_out (its mask), mlp_out; write out (and its mask)
    k.output, k.norm_input_read = k.forward[-1], hs
    g2 = _norm_backward(mlp_parts, hs, hg, tp, k)
    g1 = _norm_backward(attn_parts, hs, hg, tp, k)
    k.backward.append(g2 + 2 * hs + stat + hs + hs + drop)  # read parts, x, attn_out, stat, dout; write dx2
    k.backward.append(g1 + hs + stat + hs + hs)  # read parts, x, stat, dx2; write dx
    _cpu_weight_gradients(backend, hs, [g1 + stat, g2 + hs + stat], k)


def _sandwich(hs: float, hg: float, stat: float, drop: float, attn_parts: int, mlp_parts: int, tp: int,
              backend: str, k: _Kernels) -> None:
    """Gemma-2/3: x2 = x + post1(attn(pre1(x))); out = x2 + post2(mlp(pre2(x2)))."""
    k.forward.append(2 * hs + stat)  # pre1: read x; write normed, statistic
    k.forward.append(3 * hs + 2 * stat + drop)  # post1 and pre2: read x, attn_out; write normed, two statistics
    k.forward.append(4 * hs + 2 * stat + 2 * drop)  # read x, attn_out, post1's statistic, mlp_out; write out, post2's
    k.output, k.norm_input_read, k.normed_mlp_out = k.forward[-1], hs, True
    g2 = _norm_backward(mlp_parts, hs, hg, tp, k)
    g1 = _norm_backward(attn_parts, hs, hg, tp, k)
    k.backward.append(3 * hs + stat + drop)  # post2: read dout, mlp_out, statistic; write d mlp_out
    # pre2 and post1: read the parts, x, attn_out, the statistics, dout; write dx2, d attn_out
    k.backward.append(g2 + 3 * hs + 2 * stat + 2 * hs + drop)
    k.backward.append(g1 + hs + stat + hs + hs)  # pre1: read parts, x, stat, dx2; write dx
    _cpu_weight_gradients(backend, hs, [g1 + stat, g2 + hs + 2 * stat, hs + stat], k)


def _post(hs: float, hg: float, stat: float, drop: float, attn_parts: int, mlp_parts: int, tp: int,
          backend: str, k: _Kernels) -> None:
    """OLMo-2: x2 = x + norm1(attn(x)); out = x2 + norm2(mlp(x2)): x2 is the MLP's matmul input, written.
    Backward, dx2 = dout + the MLP's input parts is never written: each kernel that needs it sums it."""
    k.forward.append(3 * hs + stat + drop)  # read x, attn_out; write x2, the statistic
    k.forward.append(3 * hs + stat + drop)  # read x2, mlp_out; write out, the statistic
    k.output, k.normed_mlp_out = k.forward[-1], True
    g2 = _norm_backward(mlp_parts, hs, hg, tp, k)
    g1 = _norm_backward(attn_parts, hs, hg, tp, k)
    k.backward.append(3 * hs + stat + drop)  # norm2: read dout, mlp_out, statistic; write d mlp_out
    k.backward.append(g2 + 3 * hs + stat + drop)  # norm1: read dout, the MLP's parts, attn_out, statistic; write
    k.backward.append(g1 + g2 + 2 * hs)  # dx = dout + the MLP's and the attention's input parts
    _cpu_weight_gradients(backend, hs, [2 * hs + stat, g2 + hs + stat], k)  # dout read once


def _parallel(s: LayerSpec, hs: float, hg: float, stat: float, drop: float, attn_parts: int, mlp_parts: int,
              tp: int, backend: str, k: _Kernels) -> None:
    """Falcon, GPT-J: out = x + attn(norm_a(x)) + mlp(norm_m(x)); one norm or two reading x (one kernel)."""
    norms = 1 if s.norms == 1 else 2
    k.forward.append(hs + norms * (hs + stat))  # read x; write the normed inputs, their statistics
    k.forward.append(4 * hs + 2 * drop)  # read x, attn_out, mlp_out; write out
    k.output = k.forward[-1]
    groups = (attn_parts + mlp_parts,) if norms == 1 else (attn_parts, mlp_parts)
    grads = [_norm_backward(parts, hs, hg, tp, k) for parts in groups]
    k.backward.append(sum(grads) + hs + norms * stat + hs + hs + 2 * drop)  # read parts, x, stats, dout; write dx
    _cpu_weight_gradients(backend, hs, [g + stat for g in grads], k)


def _cpu_weight_gradients(backend: str, shared: float, norms: list[float], k: _Kernels) -> None:
    """CPU only: the norms' weight gradients, one kernel rereading each norm's gradient parts, inputs and
    statistic (``norms``: bytes per norm beyond ``shared``, the block input they all read once); on CUDA
    mix-order reduction folds each into its norm's input-gradient kernel."""
    if backend == "cpp":
        k.backward.append(shared + sum(norms))


def edge_traffic(arch: Architecture, last: LayerSpec, tp: int, sp: bool, c: int, eager: Traffic,
                 compiled: str) -> Traffic:
    """Outside the blocks: eager under "blocks" (``eager``: elementwise.edge_traffic); under "model" the
    embedding's lookup, the learned positions' sum and the embedding dropout inline into the first block's
    kernels (no kernel, no write but the dropout's mask), their gradients' scatter-adds stay (the mask read
    inside), and the final norm is one fused kernel each way."""
    if check_mode(compiled) != "model":
        return eager
    share = 1.0 / tp if sp else 1.0
    hs = c * arch.hidden_size * share
    stat = _statistic_bytes(last.norm, c, "triton") * share
    scatters = 2 if arch.learned_positions else 1
    mask = arch.hidden_size if arch.hidden_dropout > 0 else 0.0
    norm = Traffic(2 * hs + stat + mask, 3 * hs + stat + mask, 1, 1)  # read x (dout, x); write normed (dx)
    return norm + Traffic(0.0, EMBEDDING.backward[0].bytes(arch.hidden_size, 0, 0, c) * scatters, 0, scatters)


def loss_bytes_per_logit(compiled: str, c: int, eager_bytes: float, backend: str = "triton") -> float:
    """The cross-entropy over the logits (HF's ForCausalLMLoss inside the compiled model, torchtitan's
    compiled loss function: ``logits.float()``, cross_entropy) compiled: the upcast inlines, the forward
    reads the logits for each row's max and sum of exponentials (saved, per row) and the label's logit, the
    backward reads them again and writes their gradient in the logits' dtype. CUDA's online softmax reads
    them once forward: 3 x the compute dtype; CPU twice (max, then the sum): 4 x. ``eager_bytes`` eager."""
    if check_mode(compiled) == "none":
        return eager_bytes
    return (3.0 if backend == "triton" else 4.0) * c
