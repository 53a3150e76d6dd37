"""Low-precision training (``low_precision``): a block's linears run their three matmuls in fp8
or fp4 on the GPU's low-precision tensor cores, cast per call from the 16-bit weights and
activations.

- ``float8-tensorwise``, ``float8-rowwise``: torchao 0.18 Float8Linear (torchao/float8/float8_linear.py,
  recipes of float8/config.py Float8LinearRecipeName), as torchtitan's Float8LinearConverter
  applies it (components/quantization/float8.py). ``matmul_with_hp_or_float8_args.forward``
  saves ``input_hp`` and ``weight_hp_t``, the high-precision tensors a plain linear saves: the
  saved activations do not change. Under torch.autocast (bf16-mixed over fp32 weights) ``weight_hp_t``
  is the fp32 parameter: no 16-bit copy of a converted weight is made (converted_weight_elements).
  Each call casts what it multiplies (hp_tensor_to_float8_dynamic): forward the input and the weight; backward grad_output twice (for grad_input and for
  grad_weight), the weight again and the input again: transient fp8 copies (1 byte per element;
  rowwise adds an fp32 scale per row). With FSDP2 and tensorwise scaling,
  ``enable_fsdp_float8_all_gather`` gathers the weights in fp8 (fsdp_utils.py fsdp_pre_all_gather:
  ``float8_training_tensor._data``): half the all-gather bytes; config.py:271 refuses it for
  rowwise. It is off by default in torchtitan's converter; ``float8_all_gather`` turns it on
  (fp8_gather_bytes: the all-gather buffers and volume).
- ``mxfp8``: torchao's MXFP8 linear (prototype/moe_training/mxfp8_linear.py mx_mm, torchtitan's
  MXLinearConverter, components/quantization/mx.py): the same saved set (``ctx.save_for_backward(
  input_hp, weight_hp)``) and casts with one e8m0 scale byte per 32 elements; CUDA capability 10.0
  (Blackwell) only (mx.py: ``assert has_cuda_capability(10, 0)``).
- ``nvfp4``: torchao's NVFP4 linear (prototype/moe_training/nvfp4_training/nvfp4_linear.py
  nvfp4_mm_triton): it saves the input's fp4 codes and fp8 scales per 16 elements (4.5 bits per
  element) and the weight's transposed codes and scales (4.5 bits per weight element) in place of
  the 16-bit input; Blackwell only, every dimension a multiple of 128.
- ``te-fp8``: Transformer Engine's Linear (transformer_engine/pytorch/module/linear.py, _Linear.forward):
  the input cast to fp8 and its fp8 transpose saved for the weight gradient (``saved_inputmat_t``,
  1 byte per element), and the fp8 weight and its transpose kept as the module's workspaces
  (``weight_fp8``, ``weight_t_fp8``: 2 bytes per weight element, held across steps).

Which linears convert (torchtitan components/quantization/utils.py module_filter_fn): an nn.Linear
whose two dimensions are multiples of 16 (``dims_multiples_of_16``; NVFP4's kernels need 128),
not the LM head (``filter_fqns = ["output"]``, MXLinearConverter's default and torchtitan's float8
configs'); a mixture of experts' routed experts are grouped GEMMs, not Linears: they stay in 16 bits.

Every recipe runs only on a GPU: its terms come from the libraries' source and are unverified
here (bench/gpu_check.py measures them when a GPU is lent); the notes say so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from planner.errors import PlannerError
from planner.model.activations import ActivationItem, Activations
from planner.model.architecture import Architecture, layer_specs
from planner.model.layers import LayerSpec
from planner.model.linears import Linear, attention_linears, block_linears

LowPrecision = Literal["none", "float8-tensorwise", "float8-rowwise", "mxfp8", "nvfp4", "te-fp8"]
TORCHAO = "torchao 0.18"


@dataclass(frozen=True)
class LowPrecisionRecipe:
    """What one recipe changes in a converted linear: the dtype its matmuls run at, which
    linears convert, what it saves and keeps beyond a 16-bit linear, and its casts."""

    name: str
    source: str
    matmul_dtype: str  # the key of gpus.yaml peak_tflops / mamf_tflops the converted matmuls run at
    blackwell: bool  # needs block-scaled tensor cores (CUDA capability 10.0): gpus.yaml peak_tflops has fp4
    dim_multiple: int  # both dimensions of a converted linear are multiples of it
    scale_bits_per_element: float  # the scales of a cast (rowwise: one fp32 per row, block: one per block)
    element_bits: int  # a cast element: fp8 8, fp4 4
    saved_input_bits: float  # bits per input element the converted linear saves beyond a 16-bit linear's set
    saved_weight_bits: float  # bits per weight element saved for backward per linear call (NVFP4's codes)
    resident_weight_bits: float  # bits per weight element held across steps (TE's fp8 workspaces)
    eager_casts: bool = False  # its casts are torchao's eager float8 chain (cast_bytes_per_element), not one fused kernel


RECIPES: dict[str, LowPrecisionRecipe] = {
    "float8-tensorwise": LowPrecisionRecipe(
        "float8-tensorwise", f"{TORCHAO} torchao/float8/float8_linear.py (Float8LinearRecipeName.TENSORWISE)",
        "fp8", False, 16, 0.0, 8, 0.0, 0.0, 0.0, eager_casts=True),
    # rowwise: one fp32 scale per row of each cast (float8_scaling_utils.py, axiswise_dim)
    "float8-rowwise": LowPrecisionRecipe(
        "float8-rowwise", f"{TORCHAO} torchao/float8/float8_linear.py (Float8LinearRecipeName.ROWWISE)",
        "fp8", False, 16, 0.0, 8, 0.0, 0.0, 0.0, eager_casts=True),
    # MX: one e8m0 byte per 32 elements (torchao/prototype/mx_formats/mx_tensor.py, block_size 32)
    "mxfp8": LowPrecisionRecipe(
        "mxfp8", f"{TORCHAO} torchao/prototype/moe_training/mxfp8_linear.py (mx_mm); torchtitan "
        "components/quantization/mx.py MXLinearConverter", "fp8", True, 16, 8 / 32, 8, 0.0, 0.0, 0.0),
    # NVFP4: fp4 codes and one fp8 e4m3 scale per 16 elements: 4 + 8/16 bits
    "nvfp4": LowPrecisionRecipe(
        "nvfp4", f"{TORCHAO} torchao/prototype/moe_training/nvfp4_training/nvfp4_linear.py (nvfp4_mm_triton)",
        "fp4", True, 128, 8 / 16, 4, 4 + 8 / 16, 4 + 8 / 16, 0.0),
    "te-fp8": LowPrecisionRecipe(
        "te-fp8", "Transformer Engine transformer_engine/pytorch/module/linear.py (_Linear: saved_inputmat_t, "
        "weight_fp8, weight_t_fp8)", "fp8", False, 16, 0.0, 8, 8.0, 0.0, 16.0),
}
ROWWISE_SCALE_BITS = 32  # float8-rowwise: an fp32 scale per row


# torchao's float8 casts (recipes with eager_casts) as they run eager, bytes read + written per element cast from
# ``c``-byte inputs (torchao 0.18); under torch.compile dynamo traces the same functions into the compiled graph and
# inductor fuses them: the amax's abs into its max reduction, the upcast, scale, clamp and narrowing into one
# pointwise kernel (the fused form below):
#   float8_utils.py tensor_to_amax        torch.abs(x): c + c, then torch.max: c                3c
#   float8_training_tensor.py _ToFloat8ConstrFunc.forward, lines 153-154:
#     tensor.to(torch.float32)            c + 4 (no copy when the input is fp32 already)
#     * scale                             4 + 4
#   float8_utils.py to_fp8_saturated      clamp: 4 + 4, then .to(float8): 4 + 1


def cast_bytes_per_element(recipe: LowPrecisionRecipe, c: int, compiled: bool = False) -> float:
    """Bytes one cast moves per element of a ``c``-byte tensor: torchao's eager float8 chain above, or
    for the recipes whose casts are fused kernels (MX and NVFP4 quantize kernels, Transformer Engine's
    cast) and for torchao's chain under torch.compile (``compiled``) one read for the amax, one read to
    convert and the narrow write."""
    if recipe.eager_casts and not compiled:
        return 3 * c + (c + 4 if c != 4 else 0) + 8 + 8 + 4 + recipe.element_bits / 8
    return 2 * c + recipe.element_bits / 8


def recipe_of(name: str) -> LowPrecisionRecipe | None:
    return RECIPES.get(name)


def converted_linears(arch: Architecture, spec: LayerSpec, recipe: LowPrecisionRecipe) -> list[Linear]:
    """The block's linears the converter swaps (module_filter_fn): both dimensions multiples of
    the recipe's; a mixture of experts' routed experts are not nn.Linear modules and stay."""
    linears = attention_linears(arch, spec) if spec.mlp.is_moe else block_linears(arch, spec)
    return [x for x in linears if x.in_features % recipe.dim_multiple == 0
            and x.out_features % recipe.dim_multiple == 0]


def check_low_precision(request: Any, gpu: Any, arch: Architecture | None, framework: Any,
                        shards_parameters: bool, compute_dtype: str, finetune: str) -> None:
    """Refuse what the libraries refuse, or what is not modelled, in one line naming the field."""
    name = request.low_precision
    if name == "none":
        return
    recipe = RECIPES[name]
    if gpu.is_cpu:
        raise PlannerError(f"low_precision={name} runs on a GPU's fp8/fp4 tensor cores; gpu cpu has none (the "
                           "libraries refuse: torchtitan float8.py 'only supported on SM89 or later')",
                           field="low_precision")
    if recipe.blackwell and "fp4" not in gpu.peak_tflops:
        raise PlannerError(f"low_precision={name} needs Blackwell's block-scaled tensor cores (CUDA capability 10.0: "
                           f"torchtitan mx.py 'MXFP8 is only supported on CUDA SM100'); {gpu.name} "
                           f"({gpu.vendor_name}) has no fp4 (block-scaled) rate in gpus.yaml", field="low_precision")
    if recipe.matmul_dtype not in gpu.peak_tflops:
        raise PlannerError(f"low_precision={name} needs {recipe.matmul_dtype} tensor cores (CUDA capability 8.9+); "
                           f"{gpu.name} ({gpu.vendor_name}) has no {recipe.matmul_dtype} rate in gpus.yaml",
                           field="low_precision")
    if compute_dtype == "fp32":
        raise PlannerError(f"low_precision={name} with precision {request.precision}: the fp8/fp4 linears take "
                           "16-bit inputs (torchtitan sets training.mixed_precision_param bfloat16; nvfp4_mm_triton "
                           "'Requires: bfloat16 input'); use bf16-mixed or bf16-pure", field="low_precision")
    if finetune != "full":
        raise PlannerError(f"low_precision={name} with finetune={finetune}: the converters swap trained nn.Linear "
                           "modules; a frozen (or quantized) base under PEFT adapters is not converted by them",
                           field="low_precision")
    if arch is None:
        raise PlannerError(f"low_precision={name} needs an architecture (which linears convert): give model or "
                           "model_config", field="low_precision")
    if not any(converted_linears(arch, s, recipe) for s in layer_specs(arch)):
        raise PlannerError(f"low_precision={name}: no linear of model_type {arch.model_type!r} has both dimensions "
                           f"multiples of {recipe.dim_multiple}, so none converts", field="low_precision")
    parallel = [f"{k}={getattr(request, k)}" for k in ("tp", "cp", "pp") if getattr(request, k) > 1]
    if parallel:
        raise PlannerError(f"low_precision={name} with {', '.join(parallel)}: modelled for a data-parallel layout",
                           field="low_precision")
    if (recipe.saved_input_bits or recipe.saved_weight_bits) and request.checkpointing not in ("none", "full"):
        raise PlannerError(f"low_precision={name} with checkpointing={request.checkpointing}: what a selective "
                           "policy keeps of its fp8/fp4 saved tensors is not modelled; use none or full",
                           field="low_precision")
    if (recipe.saved_input_bits or recipe.saved_weight_bits) and request.checkpointing_every is not None:
        raise PlannerError(f"low_precision={name} with checkpointing_every: modelled for every block alike",
                           field="low_precision")
    if recipe.resident_weight_bits and shards_parameters:
        raise PlannerError(f"low_precision={name} with strategy {request.strategy}: Transformer Engine's fp8 weight "
                           "workspaces under parameter sharding are not modelled; use ddp, zero0-2 or single",
                           field="low_precision")
    if name not in framework.low_precision:
        raise PlannerError(f"low_precision={name} is torchao's, applied by torchtitan to a torch model: use a torch "
                           f"strategy (single, ddp, fsdp, hsdp), not strategy {request.strategy}",
                           field="low_precision")


@dataclass(frozen=True)
class BlockTerms:
    """One block's converted linears, in bytes for a micro-batch of ``tokens`` tokens."""

    saved_bytes: int  # saved for backward beyond a 16-bit block's set
    transient_bytes: int  # the largest converted call's casts, live during its backward
    weight_elements: int  # converted weight elements
    input_elements_per_token: int  # summed over the converted linears
    output_elements_per_token: int


def block_terms(arch: Architecture, spec: LayerSpec, recipe: LowPrecisionRecipe, tokens: int) -> BlockTerms:
    """A block's low-precision terms. A converted call's backward holds grad_output cast twice
    (for grad_input and for grad_weight), the weight cast and the input cast at once
    (float8_linear.py backward; mx_mm alike), with their scales; the forward's casts are fewer."""
    linears = converted_linears(arch, spec, recipe)
    bits = recipe.element_bits

    def cast(elements: int, rows: int) -> float:
        scale = ROWWISE_SCALE_BITS * rows if recipe.name == "float8-rowwise" else recipe.scale_bits_per_element * elements
        return (bits * elements + scale) / 8

    transient = 0.0
    for x in linears:
        weight = x.in_features * x.out_features
        call = 2 * cast(tokens * x.out_features, tokens) + cast(weight, x.out_features) \
            + cast(tokens * x.in_features, tokens)
        transient = max(transient, call)
    saved = sum(recipe.saved_input_bits * tokens * x.in_features + recipe.saved_weight_bits * x.in_features
                * x.out_features for x in linears) / 8
    return BlockTerms(saved_bytes=int(saved), transient_bytes=int(transient),
                      weight_elements=sum(x.in_features * x.out_features for x in linears),
                      input_elements_per_token=sum(x.in_features for x in linears),
                      output_elements_per_token=sum(x.out_features for x in linears))


def with_low_precision(acts: Activations, arch: Architecture, recipe: LowPrecisionRecipe,
                       tokens: int) -> Activations:
    """The activations with the converted linears' saved tensors added to every block (NVFP4's
    codes, TE's fp8 transposes: counted beside the 16-bit tensors the block's other ops may still
    save, an upper bound) and their casts to each block's backward transient."""
    terms = [block_terms(arch, spec, recipe, tokens) for spec in layer_specs(arch)]
    extra = max(t.saved_bytes for t in terms)
    total = sum(t.saved_bytes for t in terms)
    casts = max(t.transient_bytes for t in terms)
    layer_transient = acts.layer_transient_bytes + casts
    items = list(acts.items) + [ActivationItem(f"{recipe.name}: the largest converted linear's casts in its "
                                               "backward", casts)]
    if acts.checkpointed:  # full: each block keeps its input; the recomputed block saves the extra again
        layer_saved, saved, kept, blocks = acts.layer_saved_bytes + extra, acts.saved_bytes, acts.layer_kept_bytes, \
            acts.blocks
        peak_extra = max(acts.loss_transient_bytes, layer_saved + layer_transient)
    else:
        layer_saved, saved, kept = acts.layer_saved_bytes + extra, acts.saved_bytes + total, acts.layer_kept_bytes + extra
        blocks = tuple(b + t.saved_bytes for b, t in zip(acts.blocks, terms)) if acts.blocks else acts.blocks
        peak_extra = acts.peak_extra_bytes
        if total:
            items.append(ActivationItem(f"{recipe.name}: the converted linears' saved low-precision tensors", total))
    return replace(acts, saved_bytes=saved, layer_saved_bytes=layer_saved, layer_kept_bytes=kept, blocks=blocks,
                   layer_transient_bytes=layer_transient, peak_extra_bytes=peak_extra, items=tuple(items))


def resident_weight_bytes(arch: Architecture, recipe: LowPrecisionRecipe) -> int:
    """TE's fp8 weight workspaces, held across steps: resident_weight_bits per converted element."""
    if not recipe.resident_weight_bits:
        return 0
    elements = sum(block_terms(arch, spec, recipe, 1).weight_elements for spec in layer_specs(arch))
    return int(recipe.resident_weight_bits * elements / 8)


def converted_weight_elements(arch: Architecture | None, name: str) -> tuple[int, int]:
    """(the converted weight elements of all blocks, the fewest of one block's). Weights torch.autocast
    never casts, and those FSDP2 gathers in fp8 with ``float8_all_gather`` (fp8_gather_bytes). Float8Linear.forward (float8_linear.py:255-269) casts only its input to the autocast
    dtype and hands ``self.weight.t()``, the fp32 parameter itself, to matmul_with_hp_or_float8_args,
    which saves that view and casts it straight to fp8; the cast cache (which holds F.linear's 16-bit
    weights) gets none of them. Measured on the H200 (bench/results/gpu_check_h200_2.json, float8-tensorwise
    4096x2, Llama-3-8B width, 2 layers, bf16-mixed): the prediction that counted their 16-bit copies
    read 872,420,864 bytes over, the converted linears' 436,207,616 elements at 2 bytes within 5,632."""
    recipe = RECIPES.get(name)
    if recipe is None or arch is None:
        return 0, 0
    per_block = [block_terms(arch, spec, recipe, 1).weight_elements for spec in layer_specs(arch)]
    return sum(per_block), min(per_block, default=0)


FP8_GATHER_SOURCE = (f"{TORCHAO} torchao/float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather: "
                     "the shard cast to fp8, (float8_training_tensor._data,) gathered, the scale as metadata")


def fp8_gather_bytes(elements: int, converted: int, compute_bytes: int) -> int:
    """Bytes FSDP2 all-gathers for ``elements`` of which ``converted`` are float8 linears' weights
    under ``float8_all_gather``: those 1 byte each (FP8_GATHER_SOURCE; the tensorwise scale travels
    as metadata, computed alike on every rank by an amax all-reduce), the rest in the compute dtype."""
    return compute_bytes * elements - (compute_bytes - 1) * min(converted, elements)


def check_float8_all_gather(request: Any, shards_parameters: bool, unsharded_in_step: bool) -> None:
    """float8_all_gather: torchao's FSDP2 hook, tensorwise scaling only (config.py:270-274 asserts it)."""
    if not request.float8_all_gather:
        return
    if request.low_precision != "float8-tensorwise":
        raise PlannerError(f"float8_all_gather with low_precision={request.low_precision}: torchao gathers float8 "
                           "weights for tensorwise scaling only (float8/config.py:270-274); use low_precision "
                           "float8-tensorwise", field="float8_all_gather")
    if not shards_parameters:
        raise PlannerError(f"float8_all_gather with strategy {request.strategy}: it is FSDP2's all-gather "
                           "(fsdp_pre_all_gather); use fsdp or hsdp", field="float8_all_gather")
    if unsharded_in_step:
        raise PlannerError(f"float8_all_gather with strategy {request.strategy}: the unsharded weights kept through "
                           "the step in fp8 are not modelled; use fsdp or hsdp", field="float8_all_gather")


def converted_fraction(arch: Architecture, recipe: LowPrecisionRecipe) -> float:
    """The share of the blocks' linear weights that convert (for the notes)."""
    converted = total = 0
    for spec in layer_specs(arch):
        converted += block_terms(arch, spec, recipe, 1).weight_elements
        total += sum(x.in_features * x.out_features for x in block_linears(arch, spec))
    return converted / total if total else 0.0


def low_precision_notes(name: str, arch: Architecture | None, fsdp: bool, fp8_gather: bool = False) -> list[str]:
    recipe = RECIPES.get(name)
    if recipe is None or arch is None:
        return []
    share = converted_fraction(arch, recipe)
    notes = [f"low precision: {name} ({recipe.source}): {share:.0%} of the blocks' linear weights convert "
             f"(both dimensions multiples of {recipe.dim_multiple}; the LM head and routed experts stay 16-bit), "
             f"their matmuls at the GPU's {recipe.matmul_dtype} rate, casts charged at the memory bandwidth; "
             "GPU only: unverified here (bench/gpu_check.py measures it)"]
    if fp8_gather:
        notes.append("low precision: FSDP2 gathers the converted weights in fp8 (float8_all_gather: 1 byte per "
                     "element in the all-gather buffers and on the wire; GPU only, unverified here); each gather's "
                     "per-weight amax all-reduce (reduce_amax, or torchtitan's precompute_float8_dynamic_scale_for_fsdp "
                     "once per step) is not charged, nor the casts it saves")
    elif fsdp and name == "float8-tensorwise":
        notes.append("low precision: FSDP2's float8 all-gather (enable_fsdp_float8_all_gather, off by default in "
                     "torchtitan) is not assumed: the weights are gathered in 16 bits (float8_all_gather turns it on)")
    return notes
