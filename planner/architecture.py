"""A decoder-only transformer described explicitly, read from Hugging Face config fields.

Each supported ``model_type`` has a reader that maps that family's config field names (and the
defaults its transformers config class uses when a field is absent) onto one ``Architecture``.
Nothing is folded into "equivalent" numbers: gated or plain MLP, biases, the norms per layer,
tied embeddings, learned positions and MoE experts are all stated, so the parameter count is the
exact count of the modules transformers builds.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlannerError

Mlp = Literal["gated", "plain"]
Norm = Literal["rmsnorm", "layernorm"]

# Sizes above these are not a model anyone trains; they are typing mistakes (a hidden size of
# 10**9 would be ~10**20 parameters). The largest published dense models are far inside them.
MAX_DIMENSION = 1_000_000
MAX_LAYERS = 10_000
MAX_VOCAB = 10_000_000
MAX_EXPERTS = 100_000


class Architecture(BaseModel):
    """Everything about a model that decides its bytes and FLOPs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: str = Field(description="Hugging Face model_type the config was read as")
    vocab_size: int = Field(gt=0, le=MAX_VOCAB, description="token vocabulary size")
    hidden_size: int = Field(gt=0, le=MAX_DIMENSION, description="residual stream width")
    num_layers: int = Field(gt=0, le=MAX_LAYERS, description="decoder blocks")
    num_attention_heads: int = Field(gt=0, le=MAX_DIMENSION, description="query heads")
    num_key_value_heads: int = Field(gt=0, le=MAX_DIMENSION,
                                     description="key/value heads (GQA; 1 = multi-query)")
    head_dim: int = Field(gt=0, le=MAX_DIMENSION, description="width of one attention head")
    intermediate_size: int = Field(gt=0, le=MAX_DIMENSION * 16, description="MLP inner width")
    mlp: Mlp = Field(description="gated (SwiGLU/GeGLU: gate, up, down) or plain (up, down)")
    norm: Norm = Field(description="RMSNorm (weight) or LayerNorm (weight and bias)")
    norms_per_layer: int = Field(ge=1, le=8, description="normalization layers in each block")
    qkv_bias: bool = Field(description="query/key/value projections have biases")
    o_bias: bool = Field(description="attention output projection has a bias")
    mlp_bias: bool = Field(description="MLP projections have biases")
    fused_qkv: bool = Field(default=False, description="one fused QKV projection (GPT-2, Falcon, Phi-3)")
    fused_gate_up: bool = Field(default=False, description="gate and up projections fused in one matrix (Phi-3)")
    tie_word_embeddings: bool = Field(description="the LM head reuses the input embedding")
    learned_positions: int = Field(ge=0, le=MAX_VOCAB,
                                   description="rows of a learned position embedding (GPT-2); 0 for RoPE")
    parallel_attention: bool = Field(default=False,
                                     description="attention and MLP read the same normed input (Falcon)")
    num_experts: int = Field(default=0, ge=0, le=MAX_EXPERTS, description="MoE experts per layer; 0 = dense")
    experts_per_token: int = Field(default=0, ge=0, le=MAX_EXPERTS, description="experts each token is routed to")
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout on attention probabilities")
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0,
                                  description="dropout on residual branches and embeddings")
    final_logit_softcapping: bool = Field(default=False, description="tanh soft-capping of the logits (Gemma-2)")
    max_position_embeddings: int = Field(default=0, ge=0, description="longest sequence the config supports")

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# --- parameter counts: one function per module group, composed by parameter_count ----------

def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def attention_parameters(a: Architecture) -> int:
    h = a.hidden_size
    qkv_out = a.q_width + 2 * a.kv_width
    qkv = _linear(h, qkv_out, a.qkv_bias)
    return qkv + _linear(a.q_width, h, a.o_bias)


def expert_parameters(a: Architecture) -> int:
    """One MLP (one expert, for MoE)."""
    h, inner = a.hidden_size, a.intermediate_size
    up_matrices = 2 if a.mlp == "gated" else 1
    return up_matrices * _linear(h, inner, a.mlp_bias) + _linear(inner, h, a.mlp_bias)


def mlp_parameters(a: Architecture) -> int:
    if not a.is_moe:
        return expert_parameters(a)
    router = a.hidden_size * a.num_experts  # Mixtral: gate = Linear(h, E, bias=False)
    return router + a.num_experts * expert_parameters(a)


def norm_parameters(a: Architecture) -> int:
    return a.hidden_size * (2 if a.norm == "layernorm" else 1)


def layer_parameters(a: Architecture) -> int:
    return attention_parameters(a) + mlp_parameters(a) + a.norms_per_layer * norm_parameters(a)


def embedding_parameters(a: Architecture) -> int:
    tokens = a.vocab_size * a.hidden_size
    positions = a.learned_positions * a.hidden_size
    head = 0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    return tokens + positions + head


def parameter_count(a: Architecture) -> int:
    """Exactly what ``sum(p.numel() for p in model.parameters())`` gives in transformers
    (tied weights counted once), checked for every catalogue entry by tests/test_catalogue.py."""
    final_norm = norm_parameters(a)
    return embedding_parameters(a) + a.num_layers * layer_parameters(a) + final_norm


def active_parameter_count(a: Architecture) -> int:
    """Parameters one token passes through (MoE: only its experts), for FLOPs."""
    if not a.is_moe:
        return parameter_count(a)
    inactive = (a.num_experts - a.experts_per_token) * expert_parameters(a)
    return parameter_count(a) - a.num_layers * inactive


def parameter_numels(a: Architecture) -> list[int]:
    """Every parameter tensor's element count, in module registration order (the order
    DeepSpeed flattens them in), tied weights once."""
    h = a.hidden_size
    norm = [h, h] if a.norm == "layernorm" else [h]
    out = [a.vocab_size * h] + ([a.learned_positions * h] if a.learned_positions else [])
    q, kv = a.q_width, a.kv_width
    attention = [h * (q + 2 * kv)] + ([q + 2 * kv] if a.qkv_bias else [])
    if not a.fused_qkv:
        attention = [h * q, h * kv, h * kv] + ([q, kv, kv] if a.qkv_bias else [])
    attention += [q * h] + ([h] if a.o_bias else [])
    inner = a.intermediate_size
    expert = [h * inner] * (2 if a.mlp == "gated" else 1) + [inner * h]
    if a.fused_gate_up:
        expert = [2 * h * inner, inner * h]
    if a.mlp_bias:
        expert = [h * inner, inner] * (2 if a.mlp == "gated" else 1) + [inner * h, h]
    if a.is_moe:
        # transformers 5 (MixtralExperts) fuses gate and up: gate_up_proj (E, 2I, h), down_proj (E, h, I)
        up = sum(expert[:-1]) if a.mlp == "gated" else expert[0]
        mlp = [h * a.num_experts, up * a.num_experts, expert[-1] * a.num_experts]
    else:
        mlp = expert
    layer = attention + mlp + norm * a.norms_per_layer
    out += layer * a.num_layers + norm
    if not a.tie_word_embeddings:
        out.append(a.vocab_size * h)
    return out


def largest_layer_parameters(a: Architecture) -> int:
    """The biggest single module group DeepSpeed/FSDP gather at once (a block or the embedding)."""
    return max(layer_parameters(a), a.vocab_size * a.hidden_size)


# --- reading Hugging Face configs ------------------------------------------------------------

class _Fields:
    """Typed access to a config dict that names the field and value in every error."""

    def __init__(self, source: str, fields: dict[str, Any]):
        self.source = source
        self.fields = fields

    def int(self, name: str, default: Any = None, aliases: tuple[str, ...] = ()) -> int:
        value = self._get(name, default, aliases)
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise PlannerError(f"{self.source}: {name} must be a whole number, got {value!r}")
        if value <= 0:
            raise PlannerError(f"{self.source}: {name} must be positive, got {value}")
        return value

    def opt_int(self, name: str, aliases: tuple[str, ...] = ()) -> int | None:
        value = self._get(name, None, aliases)
        return None if value is None else self.int(name, aliases=aliases)

    def bool(self, name: str, default: bool) -> bool:
        value = self.fields.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise PlannerError(f"{self.source}: {name} must be true or false, got {value!r}")
        return value

    def prob(self, name: str, default: float = 0.0) -> float:
        value = self.fields.get(name, default)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise PlannerError(f"{self.source}: {name} must be a probability in [0, 1), got {value!r}")
        return float(value)

    def _get(self, name: str, default: Any, aliases: tuple[str, ...]) -> Any:
        for key in (name, *aliases):
            if self.fields.get(key) is not None:
                return self.fields[key]
        if default is None:
            return None
        return default


def _head_dim(f: _Fields, hidden: int, heads: int) -> int:
    explicit = f.opt_int("head_dim")
    if explicit is not None:
        return explicit
    if hidden % heads:
        raise PlannerError(
            f"{f.source}: hidden_size({hidden}) is not divisible by num_attention_heads({heads}) "
            "and no head_dim is given")
    return hidden // heads


def _kv_heads(f: _Fields, heads: int, default: int | None = None) -> int:
    kv = f.int("num_key_value_heads", default if default is not None else heads)
    if heads % kv:
        raise PlannerError(
            f"{f.source}: num_attention_heads({heads}) is not divisible by num_key_value_heads({kv})")
    return kv


def _llama_like(f: _Fields, defaults: dict[str, Any], *, qkv_bias: bool | None, norms: int,
                tied_default: bool, softcap: bool = False) -> dict[str, Any]:
    hidden = f.int("hidden_size", defaults["hidden_size"])
    heads = f.int("num_attention_heads", defaults["num_attention_heads"])
    attention_bias = f.bool("attention_bias", False)
    return dict(
        vocab_size=f.int("vocab_size", defaults["vocab_size"]),
        hidden_size=hidden,
        num_layers=f.int("num_hidden_layers", defaults["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=_kv_heads(f, heads, defaults.get("num_key_value_heads")),
        head_dim=_head_dim(f, hidden, heads),
        intermediate_size=f.int("intermediate_size", defaults["intermediate_size"]),
        mlp="gated",
        norm="rmsnorm",
        norms_per_layer=norms,
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if qkv_bias is None else False,
        mlp_bias=f.bool("mlp_bias", False),
        tie_word_embeddings=f.bool("tie_word_embeddings", tied_default),
        learned_positions=0,
        attention_dropout=f.prob("attention_dropout"),
        final_logit_softcapping=softcap and f.fields.get("final_logit_softcapping", 30.0) is not None,
        max_position_embeddings=f.int("max_position_embeddings", defaults["max_position_embeddings"]),
    )


# Defaults are those of transformers' configuration_<family>.py (v5.24), used when a field is
# absent from a user's config.json, exactly as transformers would.
_LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, max_position_embeddings=2048)
_MISTRAL = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)
_QWEN2 = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
              num_attention_heads=32, max_position_embeddings=32768)
_GEMMA2 = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
_MIXTRAL = dict(_MISTRAL)
_PHI3 = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
             num_attention_heads=32, max_position_embeddings=4096)


def _read_llama(f: _Fields) -> dict[str, Any]:
    return _llama_like(f, _LLAMA, qkv_bias=None, norms=2, tied_default=False)


def _read_mistral(f: _Fields) -> dict[str, Any]:
    return _llama_like(f, _MISTRAL, qkv_bias=False, norms=2, tied_default=False)


def _read_qwen2(f: _Fields) -> dict[str, Any]:
    # Qwen2Attention: q/k/v projections always carry a bias, o_proj never does.
    return _llama_like(f, _QWEN2, qkv_bias=True, norms=2, tied_default=False)


def _read_gemma2(f: _Fields) -> dict[str, Any]:
    fields = _llama_like(f, _GEMMA2, qkv_bias=None, norms=4, tied_default=True, softcap=True)
    if "head_dim" not in f.fields:
        fields["head_dim"] = 256  # Gemma2Config default, independent of hidden_size
    return fields


def _read_mixtral(f: _Fields) -> dict[str, Any]:
    fields = _llama_like(f, _MIXTRAL, qkv_bias=False, norms=2, tied_default=False)
    experts = f.int("num_local_experts", 8)
    top_k = f.int("num_experts_per_tok", 2)
    if top_k > experts:
        raise PlannerError(f"{f.source}: num_experts_per_tok({top_k}) exceeds num_local_experts({experts})")
    return fields | dict(num_experts=experts, experts_per_token=top_k)


def _read_phi3(f: _Fields) -> dict[str, Any]:
    fields = _llama_like(f, _PHI3, qkv_bias=False, norms=2, tied_default=False)
    fields["hidden_dropout"] = max(f.prob("resid_pdrop"), f.prob("embd_pdrop"))
    return fields | dict(fused_qkv=True, fused_gate_up=True)  # Phi3MLP.gate_up_proj


def _read_gpt2(f: _Fields) -> dict[str, Any]:
    hidden = f.int("n_embd", 768, aliases=("hidden_size",))
    heads = f.int("n_head", 12, aliases=("num_attention_heads",))
    if hidden % heads:
        raise PlannerError(f"{f.source}: n_embd({hidden}) is not divisible by n_head({heads})")
    positions = f.int("n_positions", 1024, aliases=("max_position_embeddings",))
    inner = f.opt_int("n_inner") or 4 * hidden
    return dict(
        vocab_size=f.int("vocab_size", 50257), hidden_size=hidden,
        num_layers=f.int("n_layer", 12, aliases=("num_hidden_layers",)),
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        intermediate_size=inner, mlp="plain", norm="layernorm", norms_per_layer=2,
        qkv_bias=True, o_bias=True, mlp_bias=True, fused_qkv=True,
        tie_word_embeddings=f.bool("tie_word_embeddings", True), learned_positions=positions,
        attention_dropout=f.prob("attn_pdrop", 0.1),
        hidden_dropout=max(f.prob("resid_pdrop", 0.1), f.prob("embd_pdrop", 0.1)),
        max_position_embeddings=positions,
    )


def _read_falcon(f: _Fields) -> dict[str, Any]:
    hidden = f.int("hidden_size", 4544)
    heads = f.int("num_attention_heads", 71, aliases=("n_head",))
    if hidden % heads:
        raise PlannerError(f"{f.source}: hidden_size({hidden}) is not divisible by num_attention_heads({heads})")
    new_arch = f.bool("new_decoder_architecture", False)
    parallel = f.bool("parallel_attn", True)
    if new_arch:
        kv = f.int("num_kv_heads", heads)
        # FalconDecoderLayer: ln_attn + ln_mlp, or one input_layernorm if num_ln_in_parallel_attn=1
        norms = 1 if f.fields.get("num_ln_in_parallel_attn") == 1 else 2
    else:
        kv = 1 if f.bool("multi_query", True) else heads
        norms = 1 if parallel else 2
    bias = f.bool("bias", False)
    return dict(
        vocab_size=f.int("vocab_size", 65024), hidden_size=hidden,
        num_layers=f.int("num_hidden_layers", 32, aliases=("n_layer",)),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
        intermediate_size=f.opt_int("ffn_hidden_size") or 4 * hidden, mlp="plain",
        norm="layernorm", norms_per_layer=norms, qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        fused_qkv=True, tie_word_embeddings=f.bool("tie_word_embeddings", True),
        learned_positions=0, parallel_attention=parallel or new_arch,
        attention_dropout=f.prob("attention_dropout"), hidden_dropout=f.prob("hidden_dropout"),
        max_position_embeddings=f.int("max_position_embeddings", 2048),
    )


READERS: dict[str, Callable[[_Fields], dict[str, Any]]] = {
    "llama": _read_llama,
    "mistral": _read_mistral,
    "qwen2": _read_qwen2,
    "gemma2": _read_gemma2,
    "mixtral": _read_mixtral,
    "phi3": _read_phi3,
    "gpt2": _read_gpt2,
    "falcon": _read_falcon,
}


def from_hf_config(config: dict[str, Any], source: str = "config") -> Architecture:
    """Read a Hugging Face ``config.json`` (as a dict) into an Architecture."""
    if not isinstance(config, dict):
        raise PlannerError(f"{source}: a model config must be a mapping of field names, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise PlannerError(f"{source}: model_type is required (one of {', '.join(sorted(READERS))})")
    reader = READERS.get(model_type)
    if reader is None:
        raise PlannerError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(sorted(READERS))}")
    fields = reader(_Fields(source, config))
    if fields["num_key_value_heads"] > fields["num_attention_heads"]:
        raise PlannerError(
            f"{source}: num_key_value_heads({fields['num_key_value_heads']}) exceeds "
            f"num_attention_heads({fields['num_attention_heads']})")
    try:
        return Architecture(model_type=model_type, **fields)
    except ValueError as exc:  # pydantic's range checks, re-worded with the source
        raise PlannerError(f"{source}: {_first_error(exc)}") from None


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()))
        return f"{field}={first.get('input')!r}: {first.get('msg')}"
    return str(exc)
