"""LoRA and QLoRA: which parameters train, what the frozen base weighs, what the adapters save.

LoRA (Hu et al. 2021) freezes the base and adds, beside each targeted linear W (out x in), two
trainable matrices A (r x in) and B (out x r); the forward adds ``B(A(dropout(x))) * alpha / r``.
QLoRA (Dettmers et al. 2023) stores the frozen linears in 4-bit NormalFloat with double
quantization and computes in bf16. The names and rules are PEFT 0.21's (peft/tuners/lora/
config.py LoraConfig, its defaults r=8, lora_alpha=8, lora_dropout=0.0, and the per-model
default targets of peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING;
``all-linear``: every nn.Linear/Conv1D but the output head, tuners_utils.py
_maybe_include_all_linear_layers). Storage follows bitsandbytes 0.50 (functional.py
quantize_4bit / int8_vectorwise_quant; nn/modules.py Params4bit, Int8Params), measured per
tensor by the verification backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.model.architecture import Architecture, layer_specs
from planner.errors import PlannerError
from planner.recipes.finetune_fields import ALL_LINEAR, Finetune
from planner.model.layers import LayerSpec
from planner.model.linears import Linear, block_linears

if TYPE_CHECKING:
    from planner.frameworks.base import Framework
    from planner.recipes.precision import Recipe
    from planner.schema import EstimateRequest
    from planner.strategies import Strategy

# PEFT 0.21 LoraConfig defaults (peft/tuners/lora/config.py): r=8, lora_alpha=8, lora_dropout=0.0.
DEFAULT_RANK = 8
DEFAULT_ALPHA = 8.0
DEFAULT_DROPOUT = 0.0
# peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (PEFT 0.21); a model
# type it does not list has no default, and PEFT asks for target_modules.
PEFT_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"),
    "qwen3": ("q_proj", "v_proj"), "gemma2": ("q_proj", "v_proj"), "gemma3_text": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",), "falcon": ("query_key_value",),
}

# bitsandbytes 0.50: Params4bit(blocksize=64) (nn/modules.py), one absmax per block; with
# compress_statistics (double quantization) the absmax is itself quantized to uint8 in blocks of
# 256 (functional.py quantize_4bit: quantize_blockwise(absmax - offset, blocksize=256)), whose fp32
# absmax, 256-entry fp32 code and fp32 offset are kept; the 4-bit code (nf4/fp4) is 16 fp32 values.
BNB_4BIT_BLOCK = 64
BNB_NESTED_BLOCK = 256
BNB_NESTED_CODE_BYTES = 256 * 4
BNB_4BIT_CODE_BYTES = 16 * 4
BNB_OFFSET_BYTES = 4
FP32_BYTES = 4


# --- the request ------------------------------------------------------------------------------

def _targets(request: "EstimateRequest", arch: Architecture) -> tuple[str, ...]:
    if request.lora_targets is None:
        default = PEFT_DEFAULT_TARGETS.get(arch.model_type)
        if default is None:
            raise PlannerError(f"lora_targets: PEFT 0.21 has no default target modules for model_type "
                               f"{arch.model_type!r}; give lora_targets (module names, or all-linear)",
                               field="lora_targets")
        return default
    names = tuple(dict.fromkeys(n.strip() for n in request.lora_targets.split(",") if n.strip()))
    if not names:
        raise PlannerError(f"lora_targets={request.lora_targets!r} names no module", field="lora_targets")
    if ALL_LINEAR in names:
        if len(names) > 1:
            raise PlannerError(f"lora_targets={request.lora_targets}: all-linear stands alone", field="lora_targets")
        return (ALL_LINEAR,)
    known = {linear.name for spec in {id(s): s for s in layer_specs(arch)}.values()
             for linear in block_linears(arch, spec)}
    missing = [n for n in names if n not in known]
    if missing:
        raise PlannerError(f"lora_targets={request.lora_targets}: {', '.join(missing)} matches no linear of "
                           f"{arch.model_type} (its linears: {', '.join(sorted(known))})", field="lora_targets")
    return names


def resolve_finetune(request: "EstimateRequest", arch: Architecture | None, strategy: "Strategy",
                     framework: "Framework", recipe: "Recipe") -> Finetune | None:
    """The request's fine-tuning, checked against the architecture, the framework and the
    precision ``recipe``."""
    if request.finetune == "full":
        return None
    if arch is None:
        raise PlannerError(f"finetune={request.finetune} needs an architecture to place adapters: give model or "
                           "model_config, not params", field="finetune")
    if any(spec.mlp.is_moe for spec in layer_specs(arch)):
        raise PlannerError(f"finetune={request.finetune} on model_type {arch.model_type!r}: its routed experts are "
                           "fused parameters, not linears PEFT's target_modules name; LoRA on MoE is not modelled",
                           field="finetune")
    if arch.vision_numels:
        raise PlannerError(f"finetune={request.finetune} with the vision tower counted (what the loader builds for "
                           f"model_type {arch.model_type!r}): PEFT's target names also match the tower's linears "
                           "(q_proj, v_proj, fc1, ...), and adapters there are not modelled; give text_only for a "
                           "script that loads the text decoder", field="finetune")
    quantize = request.quantize_base or ("nf4" if request.finetune == "qlora" else "none")
    if quantize != "none" and strategy.shards_parameters:
        # ZeRO-3 and FSDP2 partition every parameter as a flat floating-point shard; bitsandbytes'
        # Params4bit/Int8Params carry their quantization state beside the data, which the shard loses
        # (measured: see backend/finetune.py and the README's LoRA section).
        raise PlannerError(f"quantize_base={quantize} with strategy {strategy.name}: {_SHARDED_QUANT_REASON}",
                           field="quantize_base")
    check_activation_family(arch, request.finetune)
    if strategy.params_unsharded_in_step:  # fsdp-grad-op
        raise PlannerError(f"finetune={request.finetune} with strategy fsdp-grad-op: SHARD_GRAD_OP with a frozen base "
                           "is not modelled; use fsdp, hsdp, ddp or zero0-3", field="finetune")
    if request.offload_params != "none":
        raise PlannerError(f"offload_params={request.offload_params} with finetune={request.finetune}: offloading a "
                           "frozen base is not modelled", field="offload_params")
    if request.train_embeddings and arch.tie_word_embeddings:
        raise PlannerError(f"train_embeddings=true on a tied model ({arch.model_type}, tie_word_embeddings): "
                           "PEFT's modules_to_save copies would untie them; not modelled", field="train_embeddings")
    if request.train_embeddings and arch.learned_positions:
        raise PlannerError("train_embeddings=true with learned position embeddings (gpt2) is not modelled",
                           field="train_embeddings")
    return Finetune(method=request.finetune, rank=request.lora_rank or DEFAULT_RANK,
                    alpha=request.lora_alpha if request.lora_alpha is not None else DEFAULT_ALPHA,
                    targets=_targets(request, arch),
                    dropout=request.lora_dropout if request.lora_dropout is not None else DEFAULT_DROPOUT,
                    quantize=quantize, train_embeddings=request.train_embeddings,
                    double_quant=request.double_quant is not False)


# ZeRO-3 with a 4-bit base was run on CPU ranks (llama shape, bf16, all-linear r=16): it trains, but
# how DeepSpeed partitions and gathers bitsandbytes' packed uint8 weights beside their quant_state
# (kept whole on every rank) is not modelled; FSDP2 shards every parameter as a DTensor, which
# bitsandbytes' Params4bit is not. Both are refused rather than guessed.
_SHARDED_QUANT_REASON = ("a sharded quantized base is not modelled (ZeRO-3 and FSDP2 partition bitsandbytes' "
                         "packed weights apart from their quant_state); use zero0-2 or ddp")


# --- linears and adapters ---------------------------------------------------------------------

def adapter_numels(f: Finetune, linear: Linear) -> list[int]:
    """lora_A (r x in) and lora_B (out x r) of one targeted linear (peft/tuners/lora/layer.py
    update_layer: nn.Linear(in, r, bias=False), nn.Linear(r, out, bias=False))."""
    return [f.rank * linear.in_features, linear.out_features * f.rank]


def block_adapter_numels(arch: Architecture, spec: LayerSpec, f: Finetune) -> list[int]:
    out: list[int] = []
    for linear in block_linears(arch, spec):
        if f.targeted(linear):
            out += adapter_numels(f, linear)
    return out


def trainable_numels(arch: Architecture, f: Finetune) -> list[int]:
    """Trainable tensors in registration order: the embedding's trained copy (modules_to_save),
    each block's adapters, the LM head's trained copy."""
    embed = [arch.vocab_size * arch.hidden_size] if f.train_embeddings else []
    out = list(embed)
    for spec in layer_specs(arch):
        out += block_adapter_numels(arch, spec, f)
    return out + embed


def block_trainable(arch: Architecture, f: Finetune) -> list[int]:
    """Trainable elements of each block, first to last."""
    per_kind = {id(spec): sum(block_adapter_numels(arch, spec, f)) for spec in layer_specs(arch)}
    return [per_kind[id(spec)] for spec in layer_specs(arch)]


# --- the frozen base's storage ----------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantized_weight_bytes(numel: int, quantize: str, out_features: int, double_quant: bool = True) -> int:
    """Bytes bitsandbytes keeps for one quantized weight of ``numel`` elements.

    4-bit (functional.py quantize_4bit): two values per byte; one absmax per 64 values, fp32, or
    with double quantization uint8 plus, per 256 absmax, one fp32 absmax, the fp32 code of that
    second quantization (256 values) and its fp32 offset; the 16-value fp32 4-bit code.
    int8 (LLM.int8, int8_vectorwise_quant): one byte per value and one fp32 scale per output row
    (Int8Params.SCB)."""
    if quantize == "int8":
        return numel + 4 * out_features
    blocks = _ceil_div(numel, BNB_4BIT_BLOCK)
    if not double_quant:  # compress_statistics=False: the fp32 absmax kept as it is
        return _ceil_div(numel, 2) + 4 * blocks + BNB_4BIT_CODE_BYTES
    nested = _ceil_div(blocks, BNB_NESTED_BLOCK)
    return (_ceil_div(numel, 2) + blocks + 4 * nested + BNB_NESTED_CODE_BYTES + BNB_OFFSET_BYTES
            + BNB_4BIT_CODE_BYTES)


@dataclass(frozen=True)
class FrozenBase:
    quantized_bytes: int  # the quantized linears, with their constants
    other_numel: int  # everything else frozen (embeddings, norms, LM head, biases, unquantized linears)
    other_bytes: int

    @property
    def bytes(self) -> int:
        return self.quantized_bytes + self.other_bytes


def frozen_base(arch: Architecture, f: Finetune, psi: int, other_bytes_per: int) -> FrozenBase:
    """The frozen base: every parameter of the model (the trained embedding copies are extra
    tensors, ``trainable_numels``), the quantized linears in bitsandbytes' storage and the rest
    in ``other_bytes_per`` bytes each."""
    if f.quantize == "none":
        return FrozenBase(0, psi, psi * other_bytes_per)
    quantized = numel = 0
    for spec in layer_specs(arch):
        for linear in block_linears(arch, spec):
            n = linear.in_features * linear.out_features
            numel += n
            quantized += quantized_weight_bytes(n, f.quantize, linear.out_features, f.double_quant)
    return FrozenBase(quantized, psi - numel, (psi - numel) * other_bytes_per)


def lora_config(f: Finetune) -> dict[str, Any]:
    """The PEFT LoraConfig's arguments (emitted beside the launch files)."""
    return {"r": f.rank, "lora_alpha": f.alpha, "lora_dropout": f.dropout, "target_modules": f.peft_targets(),
            "bias": "none", "task_type": "CAUSAL_LM",
            "modules_to_save": ["embed_tokens", "lm_head"] if f.train_embeddings else None}


def bnb_config(f: Finetune, compute: str) -> dict[str, Any] | None:
    """transformers' BitsAndBytesConfig arguments for the quantized base (QLoRA paper: nf4,
    double quantization, bf16 compute)."""
    if f.quantize == "none":
        return None
    if f.quantize == "int8":
        return {"load_in_8bit": True}
    return {"load_in_4bit": True, "bnb_4bit_quant_type": f.quantize, "bnb_4bit_use_double_quant": f.double_quant,
            "bnb_4bit_compute_dtype": {"bf16": "bfloat16", "fp16": "float16"}.get(compute, "float32")}


# --- activations --------------------------------------------------------------------------------

# The families whose blocks the LoRA activation count below is written for: pre-norm blocks with
# a Llama-style RMSNorm (weight * x.to(dtype)), separate q/k/v/o projections and a dense gated MLP
# (modeling_llama.py, modeling_mistral.py, modeling_qwen2.py, modeling_qwen3.py, modeling_smollm3.py).
LORA_ACTIVATION_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def check_activation_family(arch: Architecture, method: str) -> None:
    if arch.model_type not in LORA_ACTIVATION_FAMILIES:
        raise PlannerError(f"finetune={method} on model_type {arch.model_type!r}: what its blocks save for "
                           f"backward with a frozen base is modelled for {', '.join(LORA_ACTIVATION_FAMILIES)} only",
                           field="finetune")


@dataclass(frozen=True)
class AdapterInputs:
    """How each adapter gets its input: the one tensor the base linear reads (shared by every
    adapter reading it) or a copy of its own. PEFT's lora.Linear.forward casts x to lora_A's
    dtype (tuners_utils.py _cast_input_dtype): under torch.autocast with fp32 adapters that is an
    fp32 copy, which autocast casts back to 16 bits for the matmul, and that 16-bit copy is what
    lora_A saves, one per adapter. With lora_dropout > 0 each adapter has its own nn.Dropout: on
    CPU ATen's dropout saves its noise tensor (activations._dropout_keep_bytes), on CUDA a bool
    mask, and lora_A saves the dropped-out input."""

    compute_bytes: int
    own_copy: bool  # autocast with fp32 adapters
    dropout: float
    device: str
    stream_bytes: int = 0  # the frozen linears' output dtype (0: compute_bytes); fp32_stream below
    norm_bytes: int = 0  # the norms' outputs, read by q/k/v and gate/up (0: compute_bytes); fp32_stream below

    @property
    def norm_out(self) -> int:
        return self.norm_bytes or self.compute_bytes

    @property
    def linear_out(self) -> int:
        return self.stream_bytes or self.compute_bytes

    @property
    def shared(self) -> bool:
        return not self.own_copy and self.dropout == 0

    def noise_bytes(self, tokens: int, width: int) -> int:
        """What one adapter's dropout saves (nothing without dropout)."""
        if self.dropout == 0:
            return 0
        return (1 if self.device == "cuda" else (4 if self.own_copy else self.compute_bytes)) * tokens * width

    def per_adapter_bytes(self, tokens: int, width: int) -> int:
        if self.shared:
            return 0
        return self.compute_bytes * tokens * width + self.noise_bytes(tokens, width)


def _norm_core(h: int, tokens: int, inputs: AdapterInputs, fused: tuple[str, ...]) -> int:
    """What one RMSNorm over a frozen weight keeps for its input's gradient: eager LlamaRMSNorm its
    fp32 upcast and rsqrt per token; a fused one (``"rms_norm" in fused``: Liger's LigerRMSNormFunction
    saves ``(X, W, RSTD)`` whether the weight trains or not, ops/rms_norm.py) its input in the residual
    stream's dtype (fp32 under QLoRA's fp32 stream, where eager's upcast is that same tensor) and rstd."""
    from planner.model.activations import FP32

    stream = inputs.norm_bytes or inputs.compute_bytes
    return (stream if "rms_norm" in fused else FP32) * tokens * h + FP32 * tokens


def _lora_block_saved(arch: Architecture, spec: LayerSpec, f: Finetune, tokens: int, seq_len: int,
                      micro_batch: int, inputs: AdapterInputs, attention: str, linears_save_inputs: bool = False,
                      fused: tuple[str, ...] = ()) -> int:
    """What one Llama-style block saves for backward when its base is frozen.

    A frozen linear saves nothing (its input is needed only for its weight's gradient; torch's
    derivatives.yaml saves an operand only when the other needs a gradient), so: each RMSNorm
    keeps its fp32 upcast and rsqrt (for the input's gradient) but not ``x * rsqrt`` cast back
    (the frozen weight's gradient); SDPA keeps q, k, v, its output and logsumexp as in full
    fine-tuning; the gated MLP keeps gate, act(gate) and up, but its product only where
    down_proj's adapter reads it. Each adapter keeps its input (shared with the base or its own,
    AdapterInputs) and lora_A's r-wide output (saved by lora_B). ``linears_save_inputs``: every
    linear keeps its input, frozen or not (DeepSpeed ZeRO-3's LinearFunctionForZeroStage3).
    ``fused``: Liger's kernels (planner/recipes/fused_kernels.py): a fused norm keeps its input
    (_norm_core), the SiLU-mul keeps gate and up but not act(gate)."""
    from planner.model.activations import FP32, attention_saved

    b, h = inputs.compute_bytes, arch.hidden_size
    a = spec.attention
    names = {linear.name for linear in block_linears(arch, spec) if f.targeted(linear)}
    norm_core = _norm_core(h, tokens, inputs, fused)
    saved = 2 * norm_core + attention_saved(arch, tokens, seq_len, micro_batch, b, attention, inputs.device)
    if a.qk_norm == "head":  # Qwen3's q_norm / k_norm: fp32 upcast and rsqrt, not the cast back
        saved += FP32 * tokens * (a.q_width + a.kv_width) + FP32 * tokens * (a.num_heads + a.num_kv_heads)
    inner = spec.mlp.intermediate_size
    # gate, act(gate) and up: the frozen linears' outputs (fp32 for a 4-bit base under autocast); Liger's
    # SiLU-mul saves gate and up alone (ops/swiglu.py LigerSiLUMulFunction: ``save_for_backward(a, b)``)
    saved += (2 if "swiglu" in fused else 3) * inputs.linear_out * tokens * inner
    kept_by_adapters = inputs.shared
    if kept_by_adapters:
        saved += b * tokens * h * (bool(names & set(_QKV)) + bool(names & set(_GATE_UP)))
        saved += b * tokens * inner if "down_proj" in names else 0
    if f.quantize == "int8" or linears_save_inputs:
        # LLM.int8's training paths keep every int8 linear's input, frozen or not (bitsandbytes 0.50
        # autograd/_functions.py: on CPU MatMul8bitFp.forward ``ctx.A = A``, on CUDA MatMul8bitLt
        # ``ctx.tensors = (CAt, subA, A)``), and so does ZeRO-3's F.linear (deepspeed 0.19.8
        # runtime/zero/linear.py LinearFunctionForZeroStage3.setup_context: ctx.save_for_backward(input,
        # weight, bias), installed by zero.Init's memory_efficient_linear, default true, when ZeRO-3
        # converts the module): the q/k/v input, the gate/up input (the norms' outputs) and down_proj's
        # (o_proj's is SDPA's output, saved anyway), where no adapter already keeps the same tensor.
        saved += inputs.norm_out * tokens * h * ((not (kept_by_adapters and names & set(_QKV)))
                                                 + (not (kept_by_adapters and names & set(_GATE_UP))))
        saved += 0 if kept_by_adapters and "down_proj" in names else inputs.linear_out * tokens * inner
    if f.quantize == "int8" and inputs.device == "cuda":
        saved += sum(int8_outliers_bytes(tokens, linear.in_features, inputs.norm_out)
                     for linear in block_linears(arch, spec))
    for linear in block_linears(arch, spec):
        if linear.name in names:
            saved += inputs.per_adapter_bytes(tokens, linear.in_features) + b * tokens * f.rank
    return saved


def _first_block_untracked(arch: Architecture, f: Finetune, tokens: int, inputs: AdapterInputs,
                           linears_save_inputs: bool = False, fused: tuple[str, ...] = ()) -> int:
    """The first block's input does not require a gradient (the embeddings are frozen), so its
    first RMSNorm saves nothing, nor does the dropout of an adapter reading that norm's output
    (q/k/v): autograd records no graph until the first adapter's output. (Measured: qwen2 fp32
    with lora_dropout 0.1 was one noise tensor per q/k/v adapter over without this.)"""
    from planner.model.activations import FP32

    if f.train_embeddings:
        return 0
    first = layer_specs(arch)[0]
    noise = sum(inputs.noise_bytes(tokens, linear.in_features) for linear in block_linears(arch, first)
                if linear.name in _QKV and f.targeted(linear))
    # ZeRO-3's linear is an autograd.Function: with no input needing a gradient it records no node
    # and saves nothing, so the q/k/v input _lora_block_saved counted for it is not kept in block 0
    qkv_targeted = any(linear.name in _QKV and f.targeted(linear) for linear in block_linears(arch, first))
    # so is LLM.int8's (MatMul8bitFp/MatMul8bitLt are autograd.Functions too: ctx.A is dropped with the ctx)
    qkv_input = (inputs.norm_out * tokens * arch.hidden_size
                 if (linears_save_inputs or f.quantize == "int8") and not (inputs.shared and qkv_targeted) else 0)
    # (a fused norm is an autograd.Function: with no input needing a gradient it records no node either)
    return _norm_core(arch.hidden_size, tokens, inputs, fused) + noise + qkv_input


def lora_activations(arch: Architecture, f: Finetune, *, micro_batch: int, seq_len: int, compute_bytes: int,
                     attention: str, checkpointing: str, device: str, adapter_copy: bool,
                     linears_save_inputs: bool = False, fp32_stream: bool = False, fused: tuple[str, ...] = ()):
    """The saved set and transients of a LoRA step, in the form of activations.Activations.
    ``linears_save_inputs``: DeepSpeed ZeRO-3, whose F.linear keeps every linear's input (the
    frozen LM head's too).

    ``fp32_stream``: QLoRA as it is run (a 4-bit or int8 base under torch.autocast after
    prepare_model_for_kbit_training, which leaves the embeddings, norms and LM head fp32: peft
    0.18 utils/other.py). The embedding's output is fp32 and so is the residual stream; each
    bitsandbytes Linear4bit casts its input to the compute dtype and its output back to the
    input's (bitsandbytes 0.49 nn/modules.py Linear4bit.forward: ``.to(inp_dtype)``), so gate,
    up and act(gate) are fp32; RoPE's tables follow the fp32 stream; the fp32 LM head's matmul
    under autocast saves its bf16 weight copy for the input's gradient; a checkpointed block
    keeps its fp32 input; backward's gradients through the stream and the MLP are fp32.
    Measured with saved-tensor hooks (llama, all-linear r=8, bf16): every block's saved set to
    the byte.

    An int8 base differs in its linears' outputs (bitsandbytes 0.50 autograd/_functions.py): on CPU
    MatMul8bitFp dequantizes the weight to the input's dtype and calls F.linear inside the
    autograd.Function, where autocast makes the output 16-bit, so gate, up and act(gate) and
    down_proj's input are 16-bit; on CUDA MatMul8bitLt's int8_scaled_mm returns ``dtype=A.dtype``,
    fp32 as the 4-bit linears'. Either keeps its fp32 input (the norms' outputs)."""
    from planner.model.activations import (FP32, ActivationItem, Activations, layer_backward_transient, loss_saved,
                                           loss_transient, rope_saved)

    tokens, b = micro_batch * seq_len, compute_bytes
    stream = FP32 if fp32_stream else b
    out = b if f.quantize == "int8" and device == "cpu" else stream
    inputs = AdapterInputs(compute_bytes=b, own_copy=adapter_copy, dropout=f.dropout, device=device,
                           stream_bytes=out, norm_bytes=stream)
    specs = layer_specs(arch)
    blocks = [_lora_block_saved(arch, spec, f, tokens, seq_len, micro_batch, inputs, attention, linears_save_inputs,
                                fused) for spec in specs]
    per_layer = max(blocks)
    # a trained LM head saves its input, and under ZeRO-3 a frozen one too
    head_out = b * tokens * arch.hidden_size if f.train_embeddings or linears_save_inputs else 0
    head_cast = b * arch.vocab_size * arch.hidden_size if fp32_stream and not f.train_embeddings else 0
    final_norm = _norm_core(arch.hidden_size, tokens, inputs, fused) + head_out + head_cast
    loss = loss_saved(arch, tokens, b) + rope_saved(arch, seq_len, stream)
    at_loss = loss_transient(arch, tokens, b)
    layer_transient = layer_backward_transient(arch, tokens, stream) + dequantized_weight_bytes(arch, f, b, tokens,
                                                                                                 inputs)
    if checkpointing == "full":
        boundary = stream * tokens * arch.hidden_size + max(int8_held_inputs(arch, spec, tokens, inputs)
                                                            for spec in specs) * (f.quantize == "int8")
        body = arch.num_layers * boundary
        extra = max(at_loss, per_layer + layer_transient)
        items = [ActivationItem(f"{arch.num_layers} block inputs (checkpointed)", body),
                 ActivationItem("one block recomputed in backward (frozen base, adapters)", per_layer)]
        kept = boundary
    else:
        body = sum(blocks) - _first_block_untracked(arch, f, tokens, inputs, linears_save_inputs, fused)
        extra = at_loss
        items = [ActivationItem(f"{arch.num_layers} blocks with a frozen base and LoRA adapters", body)]
        kept = body // arch.num_layers
    saved = body + final_norm + loss
    items += [ActivationItem("final norm", final_norm), ActivationItem("logits / loss (fp32)", loss),
              ActivationItem("backward transient at the loss", at_loss)]
    return Activations(saved_bytes=saved, peak_extra_bytes=extra, items=tuple(items),
                       layer_saved_bytes=per_layer, layer_kept_bytes=kept,
                       head_saved_bytes=saved - arch.num_layers * kept, loss_transient_bytes=at_loss,
                       layer_transient_bytes=layer_transient, num_layers=arch.num_layers,
                       checkpointed=checkpointing == "full", head_weight_copy_bytes=head_cast)


def int8_held_inputs(arch: Architecture, spec: LayerSpec, tokens: int, inputs: AdapterInputs) -> int:
    """What a checkpointed block's int8 linears keep from the first forward until their backward:
    MatMul8bitFp/MatMul8bitLt hold their input as a ctx attribute (``ctx.A = A``; ``ctx.tensors``),
    not through save_for_backward, so non-reentrant checkpointing's saved-tensor hooks do not drop
    it (torch 2.13 utils/checkpoint.py _checkpoint_hook packs save_for_backward's tensors only), and
    PEFT's prepare_model_for_kbit_training(use_gradient_checkpointing=True) makes the embeddings'
    output require a gradient (enable_input_require_grads), so block 0's are held too. Inputs:
    q/k/v's and gate/up's (the norms' outputs, one tensor each), o_proj's (the attention output)
    and down_proj's (gate x up), with MatMul8bitLt's outlier columns on CUDA. Measured (llama,
    all-linear, bf16 autocast, checkpointed: 16.1 MB under without it, 4 blocks x 4.03 MB)."""
    held: dict[str, int] = {}
    for linear in block_linears(arch, spec):
        group = "qkv" if linear.name in _QKV else "gate_up" if linear.name in _GATE_UP else linear.name
        width = {"qkv": inputs.norm_out, "gate_up": inputs.norm_out,
                 "o_proj": inputs.compute_bytes}.get(group, inputs.linear_out)
        held[group] = width * tokens * linear.in_features
        if inputs.device == "cuda":
            held[group] += int8_outliers_bytes(tokens, linear.in_features, inputs.norm_out)
    return sum(held.values())


def dequantized_weight_bytes(arch: Architecture, f: Finetune, compute_bytes: int, tokens: int = 0,
                             inputs: AdapterInputs | None = None) -> int:
    """A 4-bit linear's forward and backward dequantize its weight to the compute dtype before the
    matmul (bitsandbytes autograd/_functions.py MatMul4Bit: gemm_4bit, and backward's
    dequantize_4bit(B).to(grad_output.dtype)): one weight of the largest quantized linear at once.
    LLM.int8's CPU path (MatMul8bitFp) dequantizes likewise, to its input's dtype; with an fp32
    input (under autocast, int8_autocast_transient) more is live at once."""
    if f.quantize == "none":
        return 0
    linears = [linear for spec in layer_specs(arch) for linear in block_linears(arch, spec)]
    if f.quantize == "int8" and inputs is not None and inputs.norm_out != compute_bytes:
        return max(int8_autocast_transient(linear, tokens, compute_bytes, inputs.device) for linear in linears)
    return compute_bytes * max(linear.in_features * linear.out_features for linear in linears)


# LLM.int8 (Dettmers et al. 2022, arXiv 2208.07339, abstract): "more than 99.9% of values are
# multiplied in 8-bit"; the outlier columns (|x| > threshold 6.0) are at most 0.1% of the input's.
INT8_OUTLIER_FRACTION = 0.001


def int8_outliers_bytes(tokens: int, in_features: int, input_bytes: int) -> int:
    """What MatMul8bitLt (CUDA) saves beside its input: subA, the input's outlier columns in the
    input's dtype (backends/default/ops.py int8_mixed_scaled_mm: ``A[:, outlier_cols].contiguous()``),
    bounded by the paper's fraction."""
    return input_bytes * tokens * _ceil_div(in_features, round(1 / INT8_OUTLIER_FRACTION))


def int8_autocast_transient(linear: Linear, tokens: int, compute_bytes: int, device: str) -> int:
    """The transient of one int8 linear with an fp32 input (the fp32 stream under autocast), the
    larger of its forward and backward (bitsandbytes 0.50 autograd/_functions.py).
    CPU, MatMul8bitFp.forward: the weight dequantized to fp32 (``CB.data.to(A.dtype)``), then F.linear
    under autocast casts it and the input to 16 bits. CUDA, MatMul8bitLt.forward: the input cast to
    fp16 (``A.to(torch.float16)``) and quantized to int8 (CA), int8_scaled_mm's int32 product before
    its dequantization to fp32. Backward (both): ``state.CB.to(ctx.dtype_A, copy=True)`` (fp32) and
    ``grad_output.to(ctx.dtype_A)``, an fp32 copy of a 16-bit output's gradient (CPU)."""
    n, i, o = linear.in_features * linear.out_features, tokens * linear.in_features, tokens * linear.out_features
    if device == "cpu":
        forward = FP32_BYTES * n + compute_bytes * n + compute_bytes * i
        backward = FP32_BYTES * n + FP32_BYTES * o
    else:
        forward = 2 * i + i + 4 * o  # fp16 input, int8 CA, int32 product
        backward = FP32_BYTES * n
    return max(forward, backward)


# --- wiring into the phases -----------------------------------------------------------------------

def layout_fields(arch: Architecture, f: Finetune) -> dict[str, int]:
    """What the backward sweep needs (buffers.Layout) when only adapters (and trained embedding
    copies) make gradients: per-block trainable elements, the LM head copy produced before the
    blocks, the embedding copy after them. The LM head's matmul is counted for autocast only when
    it trains (a frozen 16-bit head is not recast)."""
    per_block = block_trainable(arch, f)
    embed = arch.vocab_size * arch.hidden_size if f.train_embeddings else 0
    return dict(num_layers=arch.num_layers, layer_parameters=sum(per_block) // arch.num_layers,
                blocks_parameters=sum(per_block), late_parameters=embed, lm_head_elements=embed,
                tied_head_elements=0, largest_block_parameters=max(per_block))


def frozen_bytes_per_element(setup: Any) -> int:
    """The frozen base's 16/32-bit tensors: the recipe's weight dtype (DeepSpeed casts the module
    to it; the torch strategies load the base in it). For a k-bit base under torch,
    prepare_model_for_kbit_training upcasts every 16-bit parameter left to fp32 (peft/utils/
    other.py) and nothing casts it back; DeepSpeed's engine casts the module back to 16 bits."""
    f = setup.finetune
    if f.quantize != "none" and setup.framework.weights_are_master:
        return 4
    return setup.recipe.weight_bits // 8


def frozen_base_of(setup: Any) -> FrozenBase:
    return frozen_base(setup.arch, setup.finetune, setup.psi, frozen_bytes_per_element(setup))


def _forward_only_frozen(setup: Any) -> list[int]:
    """Frozen parameters that no backward of the step uses, so ZeRO-3 releases them after their
    module's forward: partitioned_param_coordinator.py __params_to_release keeps a parameter only
    if the step's recorded module trace uses it again, and a module enters the backward trace
    through the hooks DeepSpeed puts on its outputs that require a gradient. Without
    checkpointing and trained embeddings, nothing that the embedding lookup or block 0's q/k/v
    projections (of the frozen embeddings' output) compute requires a gradient. Measured
    (tests/real_runs.py llama-lora-zero3-*: the peak trace frees the embedding right after its
    index_select, and block 0's q/k/v weights are not among the gathered tensors live at the
    start of backward). A tied embedding is the LM head's weight, used in backward."""
    arch = setup.arch
    if setup.request.checkpointing != "none" or setup.finetune.train_embeddings:
        return []
    first = layer_specs(arch)[0]
    qkv = [linear for linear in block_linears(arch, first) if linear.name in _QKV]
    out = [] if arch.tie_word_embeddings else [arch.vocab_size * arch.hidden_size]
    out += [linear.in_features * linear.out_features for linear in qkv]
    return out + [linear.out_features for linear in qkv if linear.bias]


def _zero3_frozen(setup: Any, numels: list[int]) -> tuple[int, int, int]:
    """(partition bytes, persistent bytes, gathered bytes) of the frozen base under ZeRO-3, which
    partitions every parameter of the module, frozen or not (stage3.py initialize_ds_offload ->
    DeepSpeedZeRoOffload._convert_to_zero_parameters over module.parameters()). Gathered: what
    stays all-gathered through backward (_forward_only_frozen's parameters released)."""
    z, wb, dp = setup.zero, frozen_bytes_per_element(setup), setup.shard_size
    threshold = z.param_persistence_threshold
    part = sum(wb * _ceil_div(n, dp) for n in numels if n > threshold)
    persistent = sum(wb * n for n in numels if n <= threshold)
    gatherable = sum(n for n in numels if n > threshold) - sum(n for n in _forward_only_frozen(setup)
                                                               if n > threshold)
    gathered = wb * gatherable if z.max_reuse_distance >= setup.psi else wb * min(
        gatherable, z.max_live_parameters + z.prefetch_bucket_size + max(numels))
    return part, persistent, gathered


def _fsdp_frozen(setup: Any, kind: Any) -> list[Any]:
    """FSDP2 shards a unit's frozen parameters with its trainable ones and all-gathers both in the
    policy's param dtype (_fsdp_param_group.py: one all-gather per unit, every FSDPParam)."""
    from planner.model.architecture import block_parameters, blocks_parameters
    from planner.memory.moments import PhaseKind
    from planner.schema import MemoryItem

    arch = setup.arch
    compute = setup.recipe.weight_bits // 8
    root = setup.psi - blocks_parameters(arch)
    block = max(block_parameters(arch))
    gloo_copy = 2 if setup.device == "cpu" else 1
    if kind in (None, PhaseKind.RESIDENT, PhaseKind.OPTIMIZER_STEP, PhaseKind.TIED_SUM):
        gathered = 0  # (SHARD_GRAD_OP is refused for LoRA: resolve_finetune)
    elif kind is PhaseKind.START_OF_BACKWARD:
        gathered = root + block * gloo_copy  # the root, and the last block prefetched
    elif kind is PhaseKind.END_OF_BACKWARD:
        gathered = root + block
    else:
        gathered = root + block + block * gloo_copy
    return [MemoryItem(name="frozen base: all-gathered units (root, block in backward, prefetched block)",
                       bytes=compute * gathered, component="buffers",
                       source="FSDP2 gathers frozen and trainable parameters of a unit together")]


def frozen_items(setup: Any, kind: Any) -> list[Any]:
    """The frozen base's items at one moment of the step (``kind``: the phase's PhaseKind)."""
    from planner.model.architecture import parameter_numels
    from planner.memory.moments import PhaseKind
    from planner.schema import MemoryItem

    f, s, dp = setup.finetune, setup.strategy, setup.shard_size
    base = frozen_base_of(setup)
    how = f"{f.quantize} (bitsandbytes)" if f.quantize != "none" else f"{8 * frozen_bytes_per_element(setup)}-bit"
    if s.zero_stage == 3:  # DeepSpeed ZeRO-3 partitions the frozen parameters with the rest
        part, persistent, gathered = _zero3_frozen(setup, parameter_numels(setup.arch))
        items = [MemoryItem(name=f"frozen base, {how}: 1/{dp} partition", bytes=part, component="frozen_weights",
                            source="ZeRO-3 partitions frozen parameters too"),
                 MemoryItem(name="frozen base: persistent small parameters (kept whole)", bytes=persistent,
                            component="frozen_weights", source="stage3_param_persistence_threshold")]
        if kind not in (None, PhaseKind.RESIDENT, PhaseKind.OPTIMIZER_STEP):
            items.append(MemoryItem(name="frozen base: gathered 16-bit parameters", bytes=gathered,
                                    component="buffers", source="gathered with the trainable ones (reuse distance)"))
        return items
    if s.shards_parameters:  # FSDP2
        items = [MemoryItem(name=f"frozen base, {how}: 1/{dp} shard", bytes=_ceil_div(base.bytes, dp),
                            component="frozen_weights", source="fully_shard shards every parameter of a unit")]
        return items + _fsdp_frozen(setup, kind)
    return [MemoryItem(name=f"frozen base weights, {how} (replicated)", bytes=base.bytes, component="frozen_weights",
                       source="no gradient, no optimizer state; " + (
                           "quantized linears packed by bitsandbytes, the rest "
                           f"{8 * frozen_bytes_per_element(setup)}-bit" if f.quantize != "none" else "frozen"))]


def with_frozen(plan: Any, setup: Any) -> Any:
    """The phase plan of the trainable parameters, with the frozen base added to every moment."""
    from planner.memory.moments import PhaseKind
    from planner.schema import Phase

    def phase(p: Phase) -> Phase:
        items = list(p.items) + [i for i in frozen_items(setup, p.kind) if i.bytes > 0]
        return p.model_copy(update={"bytes": sum(i.bytes for i in items), "items": items})

    resident = [i for i in frozen_items(setup, PhaseKind.RESIDENT) if i.bytes > 0]
    plan.phases = [phase(p) for p in plan.phases]
    plan.resident = list(plan.resident) + resident
    plan.resident_bytes += sum(i.bytes for i in resident)
    plan.buffers = [i for p in plan.phases for i in p.items if i.component == "buffers"]
    plan.notes.append(f"{setup.finetune.method}: frozen base {frozen_base_of(setup).bytes:,} bytes before sharding; "
                      f"gradients and optimizer states for {sum(trainable_numels(setup.arch, setup.finetune)):,} "
                      "trainable parameters only")
    plan.notes.append(f"{setup.finetune.method}: the step time, where shown, runs no weight-gradient matmuls for the "
                      "frozen base (4N FLOPs per token, not 6N) plus the adapters' forward and backward, and "
                      "reduces the trainable parameters' gradients only" + (
                          f"; dequantizing the {setup.finetune.quantize} base in every forward and backward pass "
                          "is timed at the GPU's memory bandwidth" if setup.finetune.quantize != "none" else ""))
    return plan
