"""Activation offloading (``activation_offload``): the tensors autograd saves for backward kept in
pinned host memory between the forward and their backward, as TRL's and torchtune's
OffloadActivations do: what stays on the device, what the host holds, what crosses the host link.

The mechanism modelled is TRL 1.16.0's ``get_act_offloading_ctx_manager(model)``
(trl/models/activation_offloading.py, its defaults: use_pin_memory, use_streams, min_offload_size
1,024, max_fwd_stash_size 5), what SFTTrainer's ``activation_offloading=True`` and Axolotl's
``activation_offloading: true`` wrap the forward (and the loss computed in it) with. Read in its
source:
- pack_tensor: a saved tensor of at least 1,024 bytes whose storage is no parameter's
  (update_model_params) is copied to a pinned host tensor (``torch.empty_like(pin_memory=True)``)
  on a side stream, once per storage while the first copy is in flight (storage_to_tensor_id): the
  unique saved set, which is what planner/model/activations.py counts;
- the LM head runs under a NoOpManager (get_act_offloading_ctx_manager's "hack to disable
  offloading the last output Linear"): its input stays on the device;
- fwd_stash keeps the last 5 offloaded tensors alive on the device until later packs wait for
  their copies; the first backward node's hook releases the rest (unpack_tensor_with_streams):
  in flight during the forward only, never at a moment of backward modelled here;
- unpack_tensor_with_streams brings a tensor back when its node unpacks it (no prefetch: the
  compute stream waits for the copy, ``s0.wait_stream(s1)``) and drops its host copy
  (``del self.tracker[id]``); the device copy lives until the next node's hook
  (bwd_tensor_stash), so a block's backward holds at most its own saved set on the device.
torchtune 0.6.1's enable_activation_offloading runs the class TRL adapted
(torchtune/training/_activation_offloading.py): the same device side, but it filters parameters by
``isinstance(activation, nn.Parameter)``, so the ``weight.t()`` views the linears save are copied too,
and it does not deduplicate storages: more host memory and host-link traffic than modelled here.
torch.autograd.graph.save_on_cpu(pin_memory=True) (torch 2.13 torch/autograd/graph.py:400-420)
packs every save (parameters and each repeated save of one tensor) on the compute stream; its
device side is within this one.
"""

from __future__ import annotations

from dataclasses import replace

from planner.errors import PlannerError
from planner.model.activations import Activations
from planner.model.architecture import Architecture, distinct_specs, layer_specs
from planner.model.layers import LayerSpec
from planner.model.linears import attention_linears, block_linears

# trl 1.16.0 trl/models/activation_offloading.py OffloadActivations.__init__: min_offload_size=1024,
# max_fwd_stash_size=5 (get_act_offloading_ctx_manager passes its own defaults, the same)
MIN_OFFLOAD_BYTES = 1024
FORWARD_STASH_TENSORS = 5
FP32 = 4


def check_activation_offload(request, model, dims) -> None:
    """What the model does not cover: a pipeline's in-flight micro-batches, a model without its
    saved tensors (a parameter count, a traced profile)."""
    if not request.activation_offload:
        return
    if dims.pp > 1:
        raise PlannerError(f"activation_offload with pp={dims.pp}: a pipeline stage's in-flight micro-batches "
                           "offloaded are not modelled", field="activation_offload")
    if model.architecture is None:
        what = "a traced model" if model.traced is not None else "only a parameter count"
        raise PlannerError(f"activation_offload: {model.name} is {what}; what stays on the device needs the "
                           "model's saved tensors (give model or model_config)", field="activation_offload")



def repeat_saved_bytes(arch: Architecture, spec: LayerSpec, tokens: int, b: int, autocast: bool,
                       fused: tuple[str, ...] = ()) -> int:
    """A block's tensors saved more than once. pack_tensor offloads a storage at its first save
    and, finding it again among the tensors in flight (storage_to_tensor_id), keeps the tensor
    itself (``self.tracker[tensor_id] = (activation, False, ...)``: "Keep on GPU, don't offload")
    until its backward: the device holds it beside its host copy. Read in transformers 5's
    modeling files with torch 2.13's derivatives.yaml: an RMSNorm's fp32 input is saved by
    ``pow`` and by ``x * rsqrt`` and its rsqrt by RsqrtBackward and the product (both norm
    kinds: LlamaRMSNorm, Gemma3RMSNorm); a norm's output feeding two or more linears (q, k, v;
    gate and up; a router and its experts) is saved by each, except under torch.autocast, where
    every linear casts its own copy; LayerNorm (native_layer_norm) saves each tensor once.
    Measured on CPU ranks with TRL's own class (tests/real_runs.py llama-offload-*: the live
    total exceeds the one without offloading by these). A fused RMSNorm (``"rms_norm" in fused``:
    Liger's ``ctx.save_for_backward(X, W, RSTD)``, planner/recipes/fused_kernels.py) saves each once;
    Qwen3's q/k norms stay eager (activations.block_saved_bytes)."""
    h = arch.hidden_size
    out = 0
    if arch.norm == "rmsnorm" and "rms_norm" not in fused:
        out += spec.norms * (FP32 * tokens * h + FP32 * tokens)
    if arch.norm == "rmsnorm" and spec.attention.qk_norm != "none":
        out += FP32 * tokens * (spec.attention.q_width + spec.attention.kv_width) + 2 * FP32 * tokens
    if autocast:
        return out
    attention = len(attention_linears(arch, spec))
    linears = block_linears(arch, spec)
    if attention - 1 >= 2:  # every attention linear but the output projection reads the normed input
        out += b * tokens * h
    if len(linears) - attention - 1 >= 2 or spec.mlp.is_moe:
        out += b * tokens * h
    return out


def lm_head_input_bytes(hidden_size: int, tokens: int, compute_bytes: int) -> int:
    """The LM head's saved input (the final norm's output in the compute dtype), kept on the
    device by the NoOpManager around the head."""
    return hidden_size * tokens * compute_bytes


def autocast_weight_bytes(arch: Architecture, acts: Activations, b: int, autocast: bool) -> int:
    """The blocks' 16-bit weight casts torch.autocast makes in the forward: each linear saves its
    cast weight for the input's gradient, a tensor of no parameter's storage, so pack_tensor copies
    it to the host like an activation (measured: llama-offload-ddp-bf16-t512 offloaded exactly these
    beyond the saved set). None under full checkpointing (the blocks save only their inputs)."""
    if not autocast or (acts.checkpointed and not acts.kept_blocks):
        return 0
    return b * sum(linear.in_features * linear.out_features for spec in layer_specs(arch)
                   for linear in block_linears(arch, spec))


def kept_per_block(arch: Architecture, acts: Activations, tokens: int, b: int, autocast: bool,
                   fused: tuple[str, ...] = ()) -> int:
    """What each block keeps on the device until its backward (its repeated saves); none under
    full checkpointing, where a block saves its input once. The largest block's, for every block."""
    if acts.checkpointed and not acts.kept_blocks:
        return 0
    return max(repeat_saved_bytes(arch, spec, tokens, b, autocast, fused) for spec in distinct_specs(arch).values())


def offloaded(acts: Activations, arch: Architecture, tokens: int, compute_bytes: int,
              autocast: bool = False, uncast_elements: int = 0, fused: tuple[str, ...] = ()) -> Activations:
    """``acts`` as the device holds them under offloading (the backward sweep reads the fields,
    planner/memory/buffers.py): at the loss's backward its saved output brought back and the LM
    head's input kept; after the head, the final norm's saved tensors brought back; in a block's
    backward that block's saved set (bound: a node's and the one before it at a time), plus what
    checkpointing recomputes there (recomputation runs in backward, outside the hooks).
    ``uncast_elements``: block weights autocast never casts (low_precision's converted linears save
    a view of the fp32 parameter, which pack_tensor skips by its storage: TRL activation_offloading.py
    param_storages). ``fused``: the block ops run as fused kernels (a fused norm saves nothing twice)."""
    kept = lm_head_input_bytes(arch.hidden_size, tokens, compute_bytes)
    edges = acts.edges
    final_norm = _final_norm_repeat(arch, tokens, fused)
    at_loss = edges.loss_saved + kept + final_norm + edges.rope_saved if edges is not None else acts.head_saved_bytes
    after_head = edges.final_norm_saved + edges.rope_saved if edges is not None else acts.head_saved_bytes
    return replace(acts, host_offload=True, device_head_bytes=min(at_loss, acts.saved_bytes),
                   device_after_head_bytes=min(after_head, acts.saved_bytes),
                   device_block_bytes=kept_per_block(arch, acts, tokens, compute_bytes, autocast, fused),
                   offloaded_bytes=max(0, acts.saved_bytes - kept) + max(0, autocast_weight_bytes(
                       arch, acts, compute_bytes, autocast) - compute_bytes * uncast_elements))


def _final_norm_repeat(arch: Architecture, tokens: int, fused: tuple[str, ...] = ()) -> int:
    """The final RMSNorm's fp32 input and rsqrt, each saved twice (repeat_saved_bytes); a fused one's once."""
    return FP32 * tokens * arch.hidden_size + FP32 * tokens if arch.norm == "rmsnorm" and "rms_norm" not in fused \
        else 0


def on_shared_memory(acts: Activations, arch: Architecture, tokens: int, compute_bytes: int,
                     autocast: bool = False, hf_loss: bool = True) -> Activations:
    """``acts`` where the host is the device's own memory (CPU ranks): every saved tensor lives
    once, as its host copy, and ``Tensor.to("cpu")`` returns that copy itself at unpack; the
    repeated saves kept beside their copies are added (repeat_saved_bytes), and at the loss the end
    of the forward can exceed the loss's backward: while pack_tensor copies the log-probabilities
    (fp32 tokens x vocab), fwd_stash still holds them, beside the logits in the compute dtype and
    their fp32 upcast (transformers' ForCausalLMLoss, planner/model/activations.py _loss_saved).
    Measured: llama-offload-zero2-bf16-small-ckpt-t1024's peak is that moment (bf16: 10 bytes per
    logit against the backward's 8)."""
    logits = tokens * arch.vocab_size
    casts = autocast_weight_bytes(arch, acts, compute_bytes, autocast)
    # the forward's end also holds autocast's cast cache beside the host copies of the casts
    forward_end = (compute_bytes + (FP32 if compute_bytes != FP32 else 0) + FP32) * logits + casts if hf_loss else 0
    kept = lm_head_input_bytes(arch.hidden_size, tokens, compute_bytes)
    return replace(acts, device_block_bytes=kept_per_block(arch, acts, tokens, compute_bytes, autocast),
                   duplicate_head_bytes=_final_norm_repeat(arch, tokens),
                   loss_transient_bytes=max(acts.loss_transient_bytes, forward_end),
                   offloaded_bytes=max(0, acts.saved_bytes - kept) + casts)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pinned_bytes(offloaded_total: int, widths: list[int], tokens: int, element_bytes: int) -> int:
    """Pinned host memory the offloaded tensors take: torch 2.13's CachingHostAllocator rounds
    every allocation up to a power of two (aten/src/ATen/core/CachingHostAllocator.h:300-308,
    pinned_max_round_threshold unset) and keeps freed blocks cached for the next step. Bound: the
    offloaded bytes times the largest rounding any of the saved widths (tokens x width x bytes:
    hidden, MLP, heads, vocabulary) takes."""
    factor = max((_pow2_ceil(tokens * w * element_bytes) / (tokens * w * element_bytes) for w in widths if w),
                 default=1.0)
    return int(offloaded_total * factor)


def transfer_seconds(bytes_per_step, forward_seconds, pcie_bytes_per_second: float):
    """Host-link time a step adds: the forward's copies to the host run on a side stream beside
    the forward's compute (only what exceeds it shows); backward's copies back are on demand (the
    compute stream waits for each), so all of them show. Floats or numpy arrays alike."""
    copy = bytes_per_step / pcie_bytes_per_second
    over = copy - forward_seconds
    return copy + (over * (over > 0))


def offload_notes(acts: Activations | None, host_per_rank: int, pinned_per_rank: int, on_cpu: bool) -> list[str]:
    if acts is None:
        return []
    what = (f"activation offload (assumed: TRL 1.16's OffloadActivations, get_act_offloading_ctx_manager: saved "
            f"tensors of >= {MIN_OFFLOAD_BYTES} bytes, parameters' storages excluded, copied once per storage to "
            "pinned host memory on a side stream; the LM head's input, and every tensor saved a second time (norm "
            "inputs, the normed input of q/k/v and gate/up), kept on the device; torchtune 0.6.1's copies the "
            f"linears' weight views too, torch's save_on_cpu every save): {host_per_rank:,} bytes per micro-batch "
            "per rank to the host and back")
    if on_cpu:
        return [what + "; on CPU ranks the host copies are the rank's own memory: the step's live total is the "
                "one without offloading"]
    return [what + f"; held in {pinned_per_rank:,} bytes of pinned host memory per rank (power-of-two blocks of "
            "the caching host allocator); on the device: at the loss the loss's saved output brought back, in "
            "a block's backward that block's saved set, and the earlier blocks' repeated saves; during the forward "
            f"up to {FORWARD_STASH_TENSORS} "
            "offloaded tensors in flight (below the backward's peak); host-link time in the step: the forward's "
            "copies beside its compute, the backward's in full (unverified on a GPU: bench/gpu_check.py)"]
