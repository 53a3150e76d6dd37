"""Fused Triton kernels in place of a decoder block's eager norms, rotary embedding and gated activation
(``fused_kernels``): Liger-Kernel's LigerRMSNorm, liger_rotary_pos_emb and LigerSwiGLUMLP, as
``apply_liger_kernel_to_<family>(rope=, rms_norm=, swiglu=)`` installs them (HF Trainer's
``use_liger_kernel``, axolotl's ``liger_*`` keys, llamafactory's ``enable_liger_kernel``), and
torchtitan's ``norm_type = "fused_rmsnorm"`` (a Triton RMSNorm saving the same tensors as Liger's).

What each kernel saves for backward, read from the source (Liger-Kernel ead96b61, the 0.8 line;
torchtitan 157a12c56 torchtitan/models/norms.py):

- ``rms_norm``: LigerRMSNormFunction.forward (ops/rms_norm.py:636-660) saves ``(X, W, RSTD)``: its input
  as given (the residual stream, in its own dtype) and one fp32 rstd per row (``rstd_dtype = float32`` in
  the llama casting mode, :452); its output Y (X's dtype, :449) is saved by the next linear, as eager's.
  Eager LlamaRMSNorm saves an fp32 upcast and ``x * rsqrt`` beside them (activations._norm_saved): the
  fused norm saves 4 bytes per element fewer, in bf16 and fp32 alike. Its backward writes dX into dY's
  storage (``in_place=True``, the default, :540), so the final norm's backward makes no tokens x hidden
  tensor of its own (activations.final_norm_transient_bytes). torchtitan's TritonFusedRMSNorm saves
  ``(x, weight, rstd)`` with an fp32 rstd per row (norms.py:229-253), the same bytes; its backward
  allocates dx (``torch.empty_like(x)``, :271), the size of the gradient it replaces.
- ``rope``: LigerRopeFunction.forward (ops/rope.py) rotates q and k in place (rope_forward: the
  transposes undo transformers' ``.transpose(1, 2)``, so ``.contiguous()`` is a no-op on the projections'
  outputs) and saves only ``(cos, sin)``, the tables every layer shares: the saved set is eager's (whose
  ``q * cos`` saves nothing large either), the time is one kernel each way.
- ``swiglu``: LigerSiLUMulFunction.forward (ops/swiglu.py) saves ``(a, b)``, gate's and up's outputs,
  and returns ``c = silu(a) * b`` (saved by down_proj); eager's ``act_fn(gate) * up`` also saves
  ``act_fn(gate)``: one compute-dtype tensor of the MLP's inner width fewer. Its backward writes the
  two gradients into a's and b's storage.

The step time charges each one kernel each way at the rate Liger's published benchmarks measured
(planner/time/elementwise.py LIGER_*_RATES).

Which parts a family gets: the apply_liger_kernel_to_<family> functions of liger_kernel/transformers/
monkey_patch.py (ead96b61) and what this model counts; a part the family's function does not patch,
or that the planner does not model for the family's blocks, is refused by name (check_fused_kernels).
Qwen3's per-head q/k norms are counted eager, as HF Trainer's instance patch leaves them (the
function's ``model`` branch patches the block and final norms only); axolotl and LLaMA-Factory patch
the classes before the model loads, which fuses those too: there the estimate over-counts 4 bytes x
(q + kv width) per token and block. Liger's RMSNorm takes no DTensor, so rms_norm under tensor
parallelism is refused (as axolotl refuses it). Every kernel is Triton: GPU only, read from the source
and unverified here (bench/gpu_check.py's recipe rows measure it); CPU ranks are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from planner.errors import PlannerError

FusedKernel = Literal["rms_norm", "rope", "swiglu"]
FUSED_KERNELS: tuple[str, ...] = ("rms_norm", "rope", "swiglu")
FUSED_KERNELS_HELP = (
    "decoder-block ops run as fused Triton kernels, comma-separated: rms_norm (Liger's LigerRMSNorm, torchtitan's "
    "fused_rmsnorm: saves its input and an fp32 rstd per row, not eager's fp32 upcast and x*rsqrt), rope (Liger's "
    "in-place rotary: one kernel), swiglu (Liger's SiLU-mul: saves gate and up, not act(gate)); GPU only, from the "
    "kernels' source (unverified); default none: the transformers modules op by op")
LIGER_SOURCE = "Liger-Kernel ead96b61 (0.8) src/liger_kernel/ops/rms_norm.py, rope.py, swiglu.py"
TORCHTITAN_SOURCE = "torchtitan 157a12c56 torchtitan/models/norms.py TritonFusedRMSNorm"

# The model types whose apply_liger_kernel_to_<family> patches each part (monkey_patch.py at ead96b61:
# MODEL_TYPE_TO_APPLY_LIGER_FN and each function's body), among the families the planner reads. Gemma's MLP is
# GeGLU (``geglu=``, not swiglu), gpt-oss's and GLM-4's defaults leave swiglu and rope off but take the
# argument; DeepSeek-V2/V3, GPT-2 and Falcon have no function.
LIGER_FAMILIES: dict[str, frozenset[str]] = {
    "rms_norm": frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "smollm3", "phi3", "olmo2",
                           "gemma3", "gemma3_text", "gpt_oss", "llama4", "llama4_text", "granite", "glm4"}),
    "rope": frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "smollm3", "phi3", "olmo2",
                       "gemma3", "gemma3_text", "gpt_oss", "llama4", "llama4_text", "granite", "glm4"}),
    "swiglu": frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "smollm3", "phi3", "olmo2",
                         "gpt_oss", "llama4", "llama4_text", "granite", "glm4"}),
}
# apply_liger_kernel_to_llama's defaults (rope, rms_norm, swiglu all True; monkey_patch.py:221-227), what HF
# Trainer's use_liger_kernel and llamafactory's enable_liger_kernel install when no part is named
LIGER_DEFAULT_PARTS = ("rms_norm", "rope", "swiglu")


def parse_fused_kernels(value: Any) -> Any:
    """The field as written: a comma-separated string (the CLI, the form) or a list; each name once, in
    FUSED_KERNELS' order. An unknown name, or anything but names, is left for the schema to refuse."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in value):
        names = list(dict.fromkeys(value))
        return tuple(sorted(names, key=lambda n: FUSED_KERNELS.index(n) if n in FUSED_KERNELS else len(FUSED_KERNELS)))
    return value


def _why_not(part: str, arch: Any) -> str | None:
    """Why ``part`` cannot run fused on this model's blocks as modelled (None: it can)."""
    from planner.model.architecture import distinct_specs

    specs = list(distinct_specs(arch).values())
    if arch.model_type not in LIGER_FAMILIES[part]:
        return (f"Liger-Kernel's apply_liger_kernel_to_* patches no {part} for model_type {arch.model_type!r} "
                f"(monkey_patch.py); its families here: {', '.join(sorted(LIGER_FAMILIES[part]))}")
    if part == "rms_norm" and any(s.norm != "rmsnorm" or s.norm_weight != "cast" for s in specs):
        return ("its norms multiply their weight in fp32 (Olmo2, Gemma3 and GptOss RMSNorm: Liger's casting modes "
                "for them and the post-norm placements are not modelled); modelled for Llama-style RMSNorm "
                "(weight * x.to(dtype))")
    if part == "rope" and (arch.learned_positions or arch.model_type in ("llama4", "llama4_text")
                           or not any(s.attention.rope for s in specs)):
        return ("modelled for transformers' apply_rotary_pos_emb (SmolLM3's NoPE blocks call none; Llama-4's "
                "complex rotary is not modelled)")
    if part == "swiglu":
        if any(s.mlp.is_moe for s in specs):
            return "Liger's expert kernels (LigerExperts) are not modelled; swiglu is modelled for dense MLPs"
        if any(not s.mlp.gated or s.mlp.fused_gate_up for s in specs):
            return ("modelled for a gated SiLU MLP with separate gate and up projections (LigerSwiGLUMLP; Phi-3's "
                    "fused gate_up chunks are not)")
    return None


def check_fused_kernels(kernels: tuple[str, ...], arch: Any, *, gpu_is_cpu: bool, pp: int, tp: int, compile_mode: str,
                        traced: bool) -> None:
    """Refuse what is not modelled, naming the field and the value."""
    if not kernels:
        return
    value = ",".join(kernels)
    why = None
    if gpu_is_cpu:
        why = ("gpu cpu (CPU ranks): Liger's kernels and torchtitan's fused_rmsnorm are Triton, they run on a GPU "
               "only")
    elif traced or arch is None:
        why = "a traced or parameter-count model: the kernels replace blocks' modules, which it does not describe"
    elif pp > 1:
        why = f"pp={pp}: the pipeline stages' boundary and backward terms are counted for eager norms"
    elif compile_mode != "none":
        why = (f"compile {compile_mode}: inductor's fusion of the same ops is modelled instead (axolotl turns "
               "compile off around Liger's kernels)")
    if why:
        raise PlannerError(f"fused_kernels={value} with {why}; estimate without fused_kernels",
                           field="fused_kernels")
    if "rms_norm" in kernels and tp > 1:
        # LigerRMSNormFunction takes plain tensors (no DTensor path, unlike LigerSiLUMulFunction's): axolotl refuses
        # liger_rms_norm with tensor parallelism (integrations/liger/args.py check_liger_rms_norm_tensor_parallel,
        # citing Liger-Kernel issue #826)
        raise PlannerError(f"fused_kernels=rms_norm with tp={tp}: Liger's RMSNorm does not run on tensor-parallel "
                           "DTensors (axolotl refuses liger_rms_norm with tensor parallelism, Liger-Kernel issue "
                           "#826); drop rms_norm or use tp 1", field="fused_kernels")
    for part in kernels:
        reason = _why_not(part, arch)
        if reason:
            raise PlannerError(f"fused_kernels={part} on model_type {arch.model_type!r}: {reason}",
                               field="fused_kernels")


def fused_kernels_notes(kernels: tuple[str, ...]) -> list[str]:
    """What the estimate assumes of the fused kernels, and that it is not verified."""
    if not kernels:
        return []
    return [f"fused kernels ({', '.join(kernels)}): {LIGER_SOURCE} and {TORCHTITAN_SOURCE}; saved tensors and "
            "bytes moved read from the kernels' source, their rates from Liger's published benchmarks; Triton (GPU "
            "only): unverified here (bench/gpu_check.py measures it)"]
