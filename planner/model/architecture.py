"""A decoder-only transformer described explicitly, read from Hugging Face config fields.

Each supported ``model_type`` has a reader that maps that family's config field names (and the
defaults its transformers config class uses when a field is absent) onto one ``Architecture``.
Nothing is folded into "equivalent" numbers: gated or plain MLP, biases, the norms per layer,
tied embeddings, learned positions and MoE experts are all stated, so the parameter count is the
exact count of the modules transformers builds.

The blocks are an ordered list of layer specs (planner/model/layers.py): the families whose blocks
differ or carry more than the flat fields say (q/k norms, MLA, routed and shared experts,
dense-then-MoE, sliding/global/chunked windows, attention sinks) give it explicitly; for the
others it is ``num_layers`` alike blocks built from the flat fields. Counts, the flat DeepSpeed
order, FLOPs and activations all read that one list.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer, model_validator

from planner.errors import PlannerError
from planner.model.layers import (AttentionSpec, LayerSpec, MlpSpec, layer_numels, norm_numels,
                                  routed_inactive_numels)

Mlp = Literal["gated", "plain"]
# What a plain MLP's activation keeps for backward, in tensors of the MLP's inner width, the output
# that the down projection saves included, by transformers 5.25's ACT2FN name (activations.py):
# NewGELUActivation (gelu_new, GPT-2's default) is composed in Python, 0.5*x*(1+tanh(c*(x+0.044715*x**3))):
# the up projection's output (saved by pow), the tanh output, 0.5*x and 1+tanh (saved by their
# product) and the product: 5. A single ATen op saves its input (gelu, gelu_pytorch_tanh: F.gelu;
# silu, swish: F.silu) beside its output: 2; relu saves only its output (threshold_backward reads
# the result), which the down projection saves too: 1. Measured with saved-tensor hooks
# (tests/test_layer_specs.py test_gpt2_activation_saved_bytes_match_autograd).
ACTIVATION_SAVED = {"gelu_new": 5, "gelu": 2, "gelu_pytorch_tanh": 2, "silu": 2, "swish": 2, "relu": 1}
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
    mlp_activation: str = Field(default="", description="the plain MLP's activation by its transformers ACT2FN name "
                                "when the config chooses one other than the family's own (GPT-2's activation_function; "
                                "'' = gelu_new); activations.py counts what it saves")
    max_position_embeddings: int = Field(default=0, ge=0, description="longest sequence the config supports")
    layers: tuple[LayerSpec, ...] = Field(
        default=(), description="the blocks in order, when they are not all alike or differ from the flat "
        "fields (MLA, MoE with shared experts, q/k norm, sliding/chunked windows); empty: num_layers blocks "
        "described by the flat fields")
    attention_implementation: Literal["any", "eager"] = Field(
        default="any", description="'eager' where transformers has no SDPA path for the family")
    notes: tuple[str, ...] = Field(default=(), description="what the reader assumed or left out")
    vision_numels: tuple[int, ...] = Field(
        default=(), description="parameter numels of the vision tower and multimodal projector, in "
        "registration order, when they are counted (include_vision); empty: the text decoder only")

    _cache: dict[str, Any] | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Fields only: the memoised block numels (a private cache) do not make two models differ."""
        return isinstance(other, Architecture) and self.__dict__ == other.__dict__

    __hash__ = BaseModel.__hash__

    @model_validator(mode="before")
    @classmethod
    def _expand_runs(cls, data: Any) -> Any:
        """Read back the dumped form: runs of equal blocks ({count, spec}) become ``count`` blocks."""
        if isinstance(data, dict) and isinstance(data.get("layers"), (list, tuple)):
            layers = []
            for run in data["layers"]:
                if isinstance(run, dict) and "count" in run:
                    count = run["count"]
                    if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_LAYERS:
                        raise ValueError(f"layers: count must be a whole number of blocks, got {count!r}")
                    layers += [{k: v for k, v in run.items() if k != "count"}] * count
                else:
                    layers.append(run)
            data = data | {"layers": layers}
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        """Stacks of alike blocks dump exactly as before layer specs existed; an explicit stack
        dumps as runs of equal blocks ({count, spec})."""
        data = handler(self)
        for key in ("notes", "attention_implementation", "vision_numels", "mlp_activation"):
            if data.get(key) == Architecture.model_fields[key].default:
                data.pop(key, None)
        if not self.layers:
            data.pop("layers", None)
            return data
        runs: list[dict[str, Any]] = []
        for spec, dumped in zip(self.layers, data["layers"]):
            if runs and runs[-1]["_spec"] == spec:
                runs[-1]["count"] += 1
            else:
                runs.append({"_spec": spec, "count": 1, **dumped})
        data["layers"] = [{k: v for k, v in run.items() if k != "_spec"} for run in runs]
        return data

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# --- parameter counts: every count is a sum over the same per-tensor numels ------------------

def uniform_layer_spec(a: Architecture) -> LayerSpec:
    """The block of a stack whose blocks are all alike, from the flat fields."""
    kv, heads = a.num_key_value_heads, a.num_attention_heads
    kind = "mha" if kv == heads else ("mqa" if kv == 1 else "gqa")
    attention = AttentionSpec(kind=kind, num_heads=heads, num_kv_heads=kv, head_dim=a.head_dim,
                              v_head_dim=a.head_dim, qkv_bias=a.qkv_bias, o_bias=a.o_bias,
                              fused_qkv=a.fused_qkv, dropout=a.attention_dropout)
    mlp = MlpSpec(gated=a.mlp == "gated", bias=a.mlp_bias, fused_gate_up=a.fused_gate_up,
                  intermediate_size=a.intermediate_size, num_experts=a.num_experts,
                  experts_per_token=a.experts_per_token,
                  normalise_top_k=a.num_experts > 0)  # MixtralTopKRouter always (modeling_mixtral.py line 109)
    placement = "parallel" if a.parallel_attention else ("sandwich" if a.norms_per_layer == 4 else "pre")
    return LayerSpec(attention=attention, mlp=mlp, norm=a.norm, norms=a.norms_per_layer,
                     norm_placement=placement)


def derived_memo(a: Architecture) -> dict[str, Any]:
    """Per-instance results derived from the (frozen) fields; read directly, as pydantic's
    attribute lookup for private attributes is slow on the plan search's hot path."""
    private = a.__pydantic_private__
    cache = private.get("_cache")  # type: ignore[union-attr]
    if cache is None:
        cache = private["_cache"] = {}  # type: ignore[index]
    return cache


def derived(a: Architecture) -> dict[str, Any]:
    """The per-instance cache of results other modules derive from the (frozen) fields, under
    their own keys (planner/parallel/pipeline.py: the balanced split and the slowest stage's share)."""
    return derived_memo(a)


def layer_specs(a: Architecture) -> tuple[LayerSpec, ...]:
    """The ordered blocks: the reader's explicit list, or ``num_layers`` alike blocks."""
    if a.layers:
        return a.layers
    memo = derived_memo(a)
    if memo.get("_uniform") is None:
        memo["_uniform"] = (uniform_layer_spec(a),) * a.num_layers
    return memo["_uniform"]


def distinct_specs(a: Architecture) -> dict[int, LayerSpec]:
    """The distinct block objects of the stack, by identity (readers reuse one object per kind),
    so per-block arithmetic runs once per kind of block."""
    memo = derived_memo(a)
    if memo.get("_distinct") is None:
        memo["_distinct"] = {id(spec): spec for spec in layer_specs(a)}
    return memo["_distinct"]


def block_numels(a: Architecture) -> list[list[int]]:
    """Each block's parameter tensors' element counts, in registration order."""
    return [list(numels) for numels in _block_numels(a)]


def _block_numels(a: Architecture) -> list[list[int]]:
    """Each block's parameter numels, computed once per Architecture (the plan search asks often)."""
    memo = derived_memo(a)
    if memo.get("_blocks") is None:
        per_kind = {key: layer_numels(spec, a.hidden_size) for key, spec in distinct_specs(a).items()}
        if len(per_kind) == 1:
            memo["_blocks"] = [next(iter(per_kind.values()))] * a.num_layers
        else:
            memo["_blocks"] = [per_kind[id(spec)] for spec in layer_specs(a)]
    return memo["_blocks"]


def block_parameters(a: Architecture) -> list[int]:
    """Parameters of each block, first to last."""
    memo = derived_memo(a)
    if memo.get("_block_sums") is None:
        memo["_block_sums"] = [sum(numels) for numels in _block_numels(a)]
    return memo["_block_sums"]


def blocks_parameters(a: Architecture) -> int:
    """All blocks together (everything but the embeddings, the final norm and the LM head)."""
    return sum(block_parameters(a))


def layer_parameters(a: Architecture) -> int:
    """The mean block: every block's count when they are all alike (the per-block step of the
    backward sweep and the collective message size); see ``block_parameters`` for each one."""
    return blocks_parameters(a) // a.num_layers


def norm_parameters(a: Architecture) -> int:
    return a.hidden_size * (2 if a.norm == "layernorm" else 1)


def embedding_parameters(a: Architecture) -> int:
    tokens = a.vocab_size * a.hidden_size
    positions = a.learned_positions * a.hidden_size
    head = 0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    return tokens + positions + head


def parameter_numels(a: Architecture) -> list[int]:
    """Every parameter tensor's element count, in module registration order (the order
    DeepSpeed flattens them in), tied weights once."""
    memo = derived_memo(a)
    if memo.get("_numels") is None:
        h = a.hidden_size
        # ForConditionalGeneration registers the vision tower and projector before the language
        # model (Gemma3Model, Mistral3Model, Llama4ForConditionalGeneration.__init__), so they lead
        out = list(a.vision_numels) + [a.vocab_size * h] + ([a.learned_positions * h] if a.learned_positions else [])
        for numels in _block_numels(a):
            out += numels
        out += norm_numels(a.norm, h)
        if not a.tie_word_embeddings:
            out.append(a.vocab_size * h)
        memo["_numels"] = out
    return list(memo["_numels"])


def parameter_count(a: Architecture) -> int:
    """Exactly what ``sum(p.numel() for p in model.parameters())`` gives in transformers
    (tied weights counted once), checked for every catalogue entry by tests/test_catalogue.py."""
    memo = derived_memo(a)
    if memo.get("_count") is None:
        memo["_count"] = sum(parameter_numels(a))
    return memo["_count"]


def active_parameter_count(a: Architecture) -> int:
    """Parameters one token passes through (MoE: only its routed experts), for FLOPs."""
    memo = derived_memo(a)
    if memo.get("_active") is None:  # the time model asks for every setting the plan searches
        per_kind = {key: routed_inactive_numels(spec.mlp, a.hidden_size) for key, spec in distinct_specs(a).items()}
        inactive = sum(per_kind[id(spec)] for spec in layer_specs(a))
        memo["_active"] = parameter_count(a) - inactive - vision_parameters(a)  # a text token never meets the vision tower
    return memo["_active"]


def vision_parameters(a: Architecture) -> int:
    """The vision tower and projector (0 unless include_vision counted them): model states only."""
    return sum(a.vision_numels)


def largest_layer_parameters(a: Architecture) -> int:
    """The biggest single module group DeepSpeed/FSDP gather at once (a block or the embedding)."""
    return max(max(block_parameters(a)), a.vocab_size * a.hidden_size)


# --- reading Hugging Face configs ------------------------------------------------------------

# The fields that set a model's size: a config without one is sized as its config class's default
# model (a llama config with only hidden_size has Llama-2-7B's other dimensions), as transformers
# builds it; the estimate's notes name each one so taken (defaulted_size_fields).
SIZE_DEFINING = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads")


class _Fields:
    """Typed access to a config dict that names the field and value in every error."""

    def __init__(self, source: str, fields: dict[str, Any], path: str = ""):
        self.source = source
        self.fields = fields
        self.path = path  # where these fields sit in the config: "", "text_config", "vision_config"
        self.missing: dict[str, Any] = {}  # size-defining fields the config left to its class's defaults

    def key(self, name: str) -> str:
        """The field's dotted path in the config (the error's ``field``)."""
        return f"{self.path}.{name}" if self.path else name

    def int(self, name: str, default: Any = None, aliases: tuple[str, ...] = ()) -> int:
        value = self._get(name, default, aliases)
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise PlannerError(f"{self.source}: {name} must be a whole number, got {value!r}", field=self.key(name))
        if value <= 0:
            raise PlannerError(f"{self.source}: {name} must be positive, got {value}", field=self.key(name))
        return value

    def opt_int(self, name: str, aliases: tuple[str, ...] = ()) -> int | None:
        value = self._get(name, None, aliases)
        return None if value is None else self.int(name, aliases=aliases)

    def bool(self, name: str, default: bool) -> bool:
        value = self.fields.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise PlannerError(f"{self.source}: {name} must be true or false, got {value!r}", field=self.key(name))
        return value

    def prob(self, name: str, default: float = 0.0) -> float:
        value = self.fields.get(name, default)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise PlannerError(f"{self.source}: {name} must be a probability in [0, 1), got {value!r}",
                               field=self.key(name))
        return float(value)

    def count(self, name: str, default: int) -> int:
        """A whole number that may be 0 (first_k_dense_replace)."""
        value = self.fields.get(name, default)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlannerError(f"{self.source}: {name} must be a whole number >= 0, got {value!r}",
                               field=self.key(name))
        return value

    def layer_indices(self, name: str, layers: int) -> set[int] | None:
        """A list of layer indices (mlp_only_layers, moe_layers), or None when absent."""
        value = self.fields.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                              for i in value):
            raise PlannerError(f"{self.source}: {name} must list layer indices in [0, {layers}), got {value!r}",
                               field=self.key(name))
        return set(value)

    def layer_flags(self, name: str, default: list[int]) -> list[int]:
        """One 0/1 flag per layer (no_rope_layers), or the config class's default pattern."""
        value = self.fields.get(name) or default
        if not isinstance(value, list) or len(value) != len(default) or any(v not in (0, 1) for v in value):
            raise PlannerError(f"{self.source}: {name} must have one 0/1 entry per layer ({len(default)}), "
                               f"got {value!r}", field=self.key(name))
        return [int(v) for v in value]

    def _get(self, name: str, default: Any, aliases: tuple[str, ...]) -> Any:
        for key in (name, *aliases):
            if self.fields.get(key) is not None:
                return self.fields[key]
        if default is None:
            return None
        if name in SIZE_DEFINING and self.path == "":
            self.missing[name] = default  # said in the estimate's notes (defaulted_size_fields)
        return default


def _head_dim(f: _Fields, hidden: int, heads: int) -> int:
    explicit = f.opt_int("head_dim")
    if explicit is not None:
        return explicit
    if hidden % heads:
        raise PlannerError(
            f"{f.source}: hidden_size({hidden}) is not divisible by num_attention_heads({heads}) "
            "and no head_dim is given", field=f.key("hidden_size"))
    return hidden // heads


def _kv_heads(f: _Fields, heads: int, default: int | None = None) -> int:
    kv = f.int("num_key_value_heads", default if default is not None else heads)
    if heads % kv:
        raise PlannerError(
            f"{f.source}: num_attention_heads({heads}) is not divisible by num_key_value_heads({kv})",
            field=f.key("num_key_value_heads"))
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
    # Gemma2DecoderLayer: sandwich norms whose weight multiplies in fp32 (Gemma2RMSNorm), sliding
    # and global layers alternating, attention logits soft-capped (attn_logit_softcapping, 50 by
    # default) -- which is why Gemma2PreTrainedModel._supports_sdpa = False: eager runs
    n = fields["num_layers"]
    window = f.int("sliding_window", 4096)
    softcap = f.fields.get("attn_logit_softcapping", 50.0) is not None
    kinds = _layer_types(f, n, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    return _stack(fields, [LayerSpec(attention=_attention(fields, logit_softcap=softcap, **_window(f, k, window)),
                                     mlp=MlpSpec(gated=True, intermediate_size=fields["intermediate_size"]),
                                     norm="rmsnorm", norms=4, norm_placement="sandwich", norm_weight="float")
                           for k in kinds],
                  attention_implementation="eager",
                  notes=("gemma2: transformers 5 has no SDPA path (attention logit soft-capping); "
                         "eager attention is predicted",))


def _read_mixtral(f: _Fields) -> dict[str, Any]:
    fields = _llama_like(f, _MIXTRAL, qkv_bias=False, norms=2, tied_default=False)
    experts = f.int("num_local_experts", 8)
    top_k = f.int("num_experts_per_tok", 2)
    if top_k > experts:
        raise PlannerError(f"{f.source}: num_experts_per_tok({top_k}) exceeds num_local_experts({experts})",
                          field=f.key("num_experts_per_tok"))
    return fields | dict(num_experts=experts, experts_per_token=top_k)


def _read_phi3(f: _Fields) -> dict[str, Any]:
    fields = _llama_like(f, _PHI3, qkv_bias=False, norms=2, tied_default=False)
    fields["hidden_dropout"] = max(f.prob("resid_pdrop"), f.prob("embd_pdrop"))
    return fields | dict(fused_qkv=True, fused_gate_up=True)  # Phi3MLP.gate_up_proj


def _read_gpt2(f: _Fields) -> dict[str, Any]:
    hidden = f.int("n_embd", 768, aliases=("hidden_size",))
    heads = f.int("n_head", 12, aliases=("num_attention_heads",))
    if hidden % heads:
        raise PlannerError(f"{f.source}: n_embd({hidden}) is not divisible by n_head({heads})", field=f.key("n_embd"))
    positions = f.int("n_positions", 1024, aliases=("max_position_embeddings",))
    inner = f.opt_int("n_inner") or 4 * hidden
    activation = f.fields.get("activation_function", "gelu_new")
    if activation not in ACTIVATION_SAVED:
        raise PlannerError(f"{f.source}: activation_function {activation!r} is not modelled (what autograd saves is "
                           f"counted for {', '.join(ACTIVATION_SAVED)})", field=f.key("activation_function"))
    return dict(
        vocab_size=f.int("vocab_size", 50257), hidden_size=hidden,
        num_layers=f.int("n_layer", 12, aliases=("num_hidden_layers",)),
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        intermediate_size=inner, mlp="plain", norm="layernorm", norms_per_layer=2,
        qkv_bias=True, o_bias=True, mlp_bias=True, fused_qkv=True,
        tie_word_embeddings=f.bool("tie_word_embeddings", True), learned_positions=positions,
        attention_dropout=f.prob("attn_pdrop", 0.1),
        hidden_dropout=max(f.prob("resid_pdrop", 0.1), f.prob("embd_pdrop", 0.1)),
        max_position_embeddings=positions, mlp_activation="" if activation == "gelu_new" else activation,
    )


def _read_falcon(f: _Fields) -> dict[str, Any]:
    hidden = f.int("hidden_size", 4544)
    heads = f.int("num_attention_heads", 71, aliases=("n_head",))
    if hidden % heads:
        raise PlannerError(f"{f.source}: hidden_size({hidden}) is not divisible by num_attention_heads({heads})",
                          field=f.key("hidden_size"))
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


# --- the 2025-2026 families: explicit layer specs --------------------------------------------

_QWEN3 = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
              num_attention_heads=32, max_position_embeddings=32768)
_OLMO2 = dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, max_position_embeddings=2048)
_GEMMA3 = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=131072)
_SMOLLM3 = dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768)
_QWEN3_MOE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768)
_GPT_OSS = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072)
_DEEPSEEK_V2 = dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, max_position_embeddings=2048)
_DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                    num_attention_heads=128, max_position_embeddings=4096)
_LLAMA4 = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, num_hidden_layers=48,
               num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072)


def _kind(heads: int, kv: int) -> str:
    return "mha" if kv == heads else ("mqa" if kv == 1 else "gqa")


def _attention(fields: dict[str, Any], **extra: Any) -> AttentionSpec:
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    return AttentionSpec(kind=_kind(heads, kv), num_heads=heads, num_kv_heads=kv, head_dim=fields["head_dim"],
                         v_head_dim=fields["head_dim"], qkv_bias=fields["qkv_bias"], o_bias=fields["o_bias"],
                         dropout=fields["attention_dropout"], **extra)


def _dense(fields: dict[str, Any], inner: int | None = None) -> MlpSpec:
    return MlpSpec(gated=True, bias=fields["mlp_bias"], intermediate_size=inner or fields["intermediate_size"])


def _layer_types(f: _Fields, n: int, default: list[str]) -> list[str]:
    """``layer_types`` as given (validated), or the config class's own default pattern."""
    given = f.fields.get("layer_types")
    if given is None:
        return default
    allowed = {"full_attention", "sliding_attention", "chunked_attention"}
    if not isinstance(given, list) or len(given) != n or not set(given) <= allowed:
        raise PlannerError(f"{f.source}: layer_types must list one of {sorted(allowed)} for each of the "
                           f"{n} layers, got {given!r}", field=f.key("layer_types"))
    return given


def _window(f: _Fields, kind: str, size: int | None) -> dict[str, Any]:
    if kind == "sliding_attention" and size:
        return dict(window="sliding", window_size=size)
    if kind == "chunked_attention" and size:
        return dict(window="chunked", window_size=size)
    return {}


def _stack(fields: dict[str, Any], layers: list[LayerSpec], **extra: Any) -> dict[str, Any]:
    return fields | dict(layers=tuple(layers), **extra)


def _read_qwen3(f: _Fields, defaults: dict[str, Any] = _QWEN3, head_dim: int | None = 128) -> dict[str, Any]:
    # Qwen3Attention: attention_bias on q/k/v/o; q_norm/k_norm RMSNorm(head_dim); Qwen3Config's
    # head_dim is 128 by default, Qwen3MoeConfig has none (hidden_size // heads)
    fields = _llama_like(f, defaults, qkv_bias=None, norms=2, tied_default=False)
    if head_dim is not None:
        fields["head_dim"] = f.int("head_dim", head_dim)
    n = fields["num_layers"]
    window = f.opt_int("sliding_window") if f.bool("use_sliding_window", False) else None
    first_sliding = f.int("max_window_layers", 28)
    kinds = _layer_types(f, n, ["sliding_attention" if window and i >= first_sliding else "full_attention"
                                for i in range(n)])
    return _stack(fields, [LayerSpec(attention=_attention(fields, qk_norm="head", **_window(f, k, window)),
                                     mlp=_dense(fields), norm="rmsnorm", norms=2) for k in kinds])


def _read_smollm3(f: _Fields) -> dict[str, Any]:
    # SmolLM3: llama-shaped; every no_rope_layer_interval-th layer has no RoPE (NoPE), optional sliding
    fields = _llama_like(f, _SMOLLM3, qkv_bias=None, norms=2, tied_default=True)
    n = fields["num_layers"]
    interval = f.int("no_rope_layer_interval", 4)
    rope = f.layer_flags("no_rope_layers", [int((i + 1) % interval != 0) for i in range(n)])
    window = f.opt_int("sliding_window") if f.bool("use_sliding_window", False) else None
    kinds = _layer_types(f, n, ["sliding_attention" if window and not r else "full_attention" for r in rope])
    return _stack(fields, [LayerSpec(attention=_attention(fields, rope=bool(r), **_window(f, k, window)),
                                     mlp=_dense(fields), norm="rmsnorm", norms=2) for k, r in zip(kinds, rope)])


def _read_olmo2(f: _Fields) -> dict[str, Any]:
    # Olmo2DecoderLayer: post-norm (norm after attention and after the MLP, before the residual add);
    # q_norm/k_norm over the whole projection (RMSNorm(heads * head_dim))
    fields = _llama_like(f, _OLMO2, qkv_bias=None, norms=2, tied_default=False)
    spec = LayerSpec(attention=_attention(fields, qk_norm="projection"), mlp=_dense(fields), norm="rmsnorm",
                     norms=2, norm_placement="post", norm_weight="float")
    return _stack(fields, [spec] * fields["num_layers"])


def _read_gemma3_text(f: _Fields) -> dict[str, Any]:
    # Gemma3DecoderLayer: four norms (sandwich), q_norm/k_norm RMSNorm(head_dim); layers alternate
    # sliding_window_pattern - 1 sliding and one global (Gemma3TextConfig.__post_init__)
    fields = _llama_like(f, _GEMMA3, qkv_bias=None, norms=4, tied_default=True)
    fields["head_dim"] = f.int("head_dim", 256)
    fields["final_logit_softcapping"] = f.fields.get("final_logit_softcapping") is not None
    n = fields["num_layers"]
    pattern = f.int("sliding_window_pattern", 6)
    window = f.int("sliding_window", 4096)
    kinds = _layer_types(f, n, ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
    if f.fields.get("attn_logit_softcapping") is not None:
        raise PlannerError(f"{f.source}: attn_logit_softcapping is not modelled for gemma3 (its released "
                           "configs have none); remove it or use a config without it",
                           field=f.key("attn_logit_softcapping"))
    # Gemma3TextModel.rotary_emb keeps one table per layer type (rope_local_base_freq for sliding)
    return _stack(fields, [LayerSpec(attention=_attention(fields, qk_norm="head", **_window(f, k, window),
                                                          rope_table="local" if k == "sliding_attention" else "global"),
                                     mlp=_dense(fields), norm="rmsnorm", norms=4, norm_placement="sandwich",
                                     norm_weight="float")
                           for k in kinds])


# Mistral3Config's default text_config (configuration_mistral3.py, SubConfigSpec): Mistral-Small-3.1
_MISTRAL3_TEXT = dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=131072, tie_word_embeddings=False)


def _text_config(f: _Fields, model_type: str, text_type: str, default: dict[str, Any] | None = None) -> _Fields:
    text = f.fields.get("text_config")
    if text is None:  # absent: the multimodal config class's default text config
        text = default or {}
    if not isinstance(text, dict):
        raise PlannerError(f"{f.source}: a {model_type} config needs its text_config (a mapping)",
                          field=f.key("text_config"))
    return _Fields(f"{f.source}: text_config", {"model_type": text_type} | text, f.key("text_config"))


_VISION_NOTE = ("{family}: the text decoder alone is counted and modelled (text_only, or a loader that builds "
                "it); the vision tower and projector of the multimodal checkpoint are not")

# What a script's loading code builds for a multimodal config (transformers 5.25 models/auto/
# modeling_auto.py): MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (line 788) maps gemma3 to
# Gemma3ForConditionalGeneration (line 850: the vision tower included) and llama4 to Llama4ForCausalLM
# (line 905: the text decoder of text_config); mistral3 has no entry there (AutoModelForCausalLM refuses
# the config), so a script loads it with AutoModelForImageTextToText, Mistral3ForConditionalGeneration
# (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, line 1267), the whole model. Checked on the meta device
# (tests/test_vision.py): AutoModelForCausalLM on gemma-3-12b-it's config builds 12,187,325,040
# parameters, its text decoder 11,766,034,176.
LOADED_CLASS = {"gemma3": ("AutoModelForCausalLM", "Gemma3ForConditionalGeneration", True),
                "llama4": ("AutoModelForCausalLM", "Llama4ForCausalLM", False),
                "mistral3": ("AutoModelForImageTextToText", "Mistral3ForConditionalGeneration", True)}


def _read_gemma3(f: _Fields) -> dict[str, Any]:
    fields = _read_gemma3_text(_text_config(f, "gemma3", "gemma3_text"))
    return fields | dict(notes=(_VISION_NOTE.format(family="gemma3"),))


def _read_mistral3(f: _Fields) -> dict[str, Any]:
    text = _text_config(f, "mistral3", "mistral", _MISTRAL3_TEXT)
    kind = text.fields["model_type"]
    if kind != "mistral":
        raise PlannerError(f"{f.source}: text_config.model_type {kind!r} is not supported for mistral3 (mistral)",
                          field=text.key("model_type"))
    return _read_mistral(text) | dict(notes=(_VISION_NOTE.format(family="mistral3"),))


def _experts(f: _Fields, count: str, top_k: str, default_count: int | None, default_top_k: int | None,
             aliases: tuple[str, ...] = ()) -> tuple[int, int]:
    experts = f.int(count, default_count, aliases=aliases)
    k = f.int(top_k, default_top_k)
    if k > experts:
        raise PlannerError(f"{f.source}: {top_k}({k}) exceeds {count}({experts})", field=f.key(top_k))
    return experts, k


def _read_qwen3_moe(f: _Fields) -> dict[str, Any]:
    # Qwen3MoeDecoderLayer: sparse when not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    fields = _read_qwen3(f, _QWEN3_MOE, head_dim=None)
    experts, k = _experts(f, "num_experts", "num_experts_per_tok", 128, 8)
    inner = f.int("moe_intermediate_size", 768)
    step = f.int("decoder_sparse_step", 1)
    dense_only = f.layer_indices("mlp_only_layers", fields["num_layers"]) or set()
    # Qwen3MoeTopKRouter renormalises the top-k when norm_topk_prob (modeling_qwen3_moe.py line 264; the config's
    # default is False, configuration_qwen3_moe.py line 98; Qwen3-30B-A3B sets it)
    moe = MlpSpec(gated=True, intermediate_size=inner, num_experts=experts, experts_per_token=k, layout="qwen3_moe",
                  normalise_top_k=f.bool("norm_topk_prob", False))
    layers = [spec.model_copy(update={"mlp": moe}) if i not in dense_only and (i + 1) % step == 0 else spec
              for i, spec in enumerate(fields["layers"])]
    return fields | dict(layers=tuple(layers), num_experts=experts, experts_per_token=k, intermediate_size=inner)


def _read_gpt_oss(f: _Fields) -> dict[str, Any]:
    # GptOssAttention: biases on q/k/v/o, a sink logit per head; GptOssMLP: router with bias, experts
    # with biases (gate_up interleaved, clamped SwiGLU); sliding and full layers alternate
    fields = _llama_like(f, _GPT_OSS, qkv_bias=None, norms=2, tied_default=False)
    attention_bias = f.bool("attention_bias", True)
    fields.update(qkv_bias=attention_bias, o_bias=attention_bias, head_dim=f.int("head_dim", 64))
    experts, k = _experts(f, "num_local_experts", "num_experts_per_tok", 128, 4, aliases=("num_experts",))
    n = fields["num_layers"]
    window = f.int("sliding_window", 128)
    kinds = _layer_types(f, n, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    moe = MlpSpec(gated=True, bias=True, intermediate_size=fields["intermediate_size"], num_experts=experts,
                  experts_per_token=k, router_bias=True, layout="gpt_oss", router="topk_softmax")
    # GptOssRMSNorm multiplies its weight before the cast back, like OLMo-2's
    layers = [LayerSpec(attention=_attention(fields, sinks=True, **_window(f, kind, window)), mlp=moe,
                        norm="rmsnorm", norms=2, norm_weight="float") for kind in kinds]
    return _stack(fields, layers, num_experts=experts, experts_per_token=k, attention_implementation="eager",
                  notes=("gpt_oss: transformers 5 has no SDPA path for attention sinks; eager attention is "
                         "predicted",))


def _read_deepseek(f: _Fields, defaults: dict[str, Any], v3: bool) -> dict[str, Any]:
    fields = _llama_like(f, defaults, qkv_bias=None, norms=2, tied_default=False)
    if not v3:
        fields["mlp_bias"] = f.bool("mlp_bias", False)
    else:
        fields["mlp_bias"] = False  # DeepseekV3MLP: no biases
    heads = fields["num_attention_heads"]
    q_rank = f.opt_int("q_lora_rank") if "q_lora_rank" in f.fields else 1536
    kv_rank = f.int("kv_lora_rank", 512)
    rope, nope, v = f.int("qk_rope_head_dim", 64), f.int("qk_nope_head_dim", 128), f.int("v_head_dim", 128)
    mla = AttentionSpec(kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=nope + rope, v_head_dim=v,
                        q_lora_rank=q_rank or 0, kv_lora_rank=kv_rank, rope_head_dim=rope,
                        qkv_bias=fields["qkv_bias"], o_bias=fields["o_bias"], dropout=fields["attention_dropout"])
    experts, k = _experts(f, "n_routed_experts", "num_experts_per_tok", 256 if v3 else 64, 8 if v3 else None,
                          aliases=("num_local_experts",))
    inner = f.int("moe_intermediate_size", 2048 if v3 else 1407)
    shared = f.int("n_shared_experts", 1 if v3 else 2)
    # DeepseekV2Experts never has biases; its shared experts are a DeepseekV2MLP (mlp_bias)
    if v3:  # DeepseekV3TopkRouter: sigmoid scores, always group-limited
        router, groups, kept = "sigmoid_grouped", f.int("n_group", 8), f.int("topk_group", 4)
    elif f.fields.get("topk_method", "greedy") == "group_limited_greedy":  # DeepseekV2TopkRouter
        router, groups, kept = "softmax_grouped", f.int("n_group"), f.int("topk_group")
    else:
        router, groups, kept = "softmax_greedy", 0, 0
    if groups and experts % groups:
        raise PlannerError(f"{f.source}: n_routed_experts({experts}) is not divisible by n_group({groups})",
                          field=f.key("n_group"))
    moe = MlpSpec(gated=True, intermediate_size=inner, num_experts=experts, experts_per_token=k,
                  shared_intermediate_size=inner * shared, shared_bias=fields["mlp_bias"], layout="deepseek",
                  router=router, groups=groups, groups_kept=kept,
                  # DeepseekV3TopkRouter renormalises when norm_topk_prob (modeling_deepseek_v3.py line 151; default
                  # True, configuration_deepseek_v3.py line 103); DeepseekV2TopkRouter never (modeling_deepseek_v2.py
                  # lines 97-116)
                  normalise_top_k=v3 and f.bool("norm_topk_prob", True))
    dense_first = f.count("first_k_dense_replace", 3 if v3 else 0)
    layers = [LayerSpec(attention=mla, mlp=moe if i >= dense_first else _dense(fields), norm="rmsnorm", norms=2)
              for i in range(fields["num_layers"])]
    fields.update(num_key_value_heads=heads, head_dim=nope + rope)
    return _stack(fields, layers, num_experts=experts, experts_per_token=k)


def _read_deepseek_v2(f: _Fields) -> dict[str, Any]:
    return _read_deepseek(f, _DEEPSEEK_V2, v3=False)


def _read_deepseek_v3(f: _Fields) -> dict[str, Any]:
    return _read_deepseek(f, _DEEPSEEK_V3, v3=True)


def _read_llama4_text(f: _Fields) -> dict[str, Any]:
    # Llama4TextDecoderLayer: MoE (routed experts + one shared expert) in moe_layers, dense MLP of
    # intermediate_size_mlp elsewhere; NoPE layers every no_rope_layer_interval-th use full attention,
    # the others chunked attention and a weightless L2 q/k norm (use_qk_norm)
    fields = _llama_like(f, _LLAMA4, qkv_bias=None, norms=2, tied_default=False)
    fields["head_dim"] = f.int("head_dim", 128)
    n = fields["num_layers"]
    experts, k = _experts(f, "num_local_experts", "num_experts_per_tok", 16, 1)
    step = f.int("interleave_moe_layer_step", 1)
    moe_layers = f.layer_indices("moe_layers", n)
    if moe_layers is None:
        moe_layers = set(range(step - 1, n, step))
    interval = f.int("no_rope_layer_interval", 4)
    rope = f.layer_flags("no_rope_layers", [int((i + 1) % interval != 0) for i in range(n)])
    chunk = f.opt_int("attention_chunk_size") if "attention_chunk_size" in f.fields else 8192
    kinds = _layer_types(f, n, ["chunked_attention" if r and chunk else "full_attention" for r in rope])
    qk_norm = "l2" if f.bool("use_qk_norm", True) else "none"
    inner = fields["intermediate_size"]
    moe = MlpSpec(gated=True, intermediate_size=inner, num_experts=experts, experts_per_token=k,
                  shared_intermediate_size=inner, layout="llama4", router="sigmoid_top1")
    dense = _dense(fields, f.int("intermediate_size_mlp", 16384))
    layers = [LayerSpec(attention=_attention(fields, rope=bool(r), qk_norm=qk_norm if r else "none",
                                             **_window(f, kind, chunk)),
                        mlp=moe if i in moe_layers else dense, norm="rmsnorm", norms=2)
              for i, (kind, r) in enumerate(zip(kinds, rope))]
    return _stack(fields, layers, num_experts=experts, experts_per_token=k)


def _read_llama4(f: _Fields) -> dict[str, Any]:
    fields = _read_llama4_text(_text_config(f, "llama4", "llama4_text"))
    return fields | dict(notes=(_VISION_NOTE.format(family="llama4"),))


# --- the vision tower and projector of a multimodal checkpoint (include_vision) ---------------
# Each reader lists the parameter numels of the family's vision tower and multimodal projector in
# module registration order (a module's own parameters before its children's), read from the
# transformers 5 modeling files named below; tests/test_vision.py checks the list against
# transformers' ForConditionalGeneration on the meta device.

def _vision_config(f: _Fields, family: str, model_type: str | None,
                   absent: dict[str, Any]) -> tuple[_Fields, bool]:
    """(the vision_config fields, whether the config gave one). Absent, transformers builds the
    multimodal config class's default vision config; a given one fills missing fields with its
    own config class's defaults (the readers' ``default=`` arguments)."""
    vision = f.fields.get("vision_config")
    if vision is None:
        return _Fields(f"{f.source}: vision_config", dict(absent), f.key("vision_config")), False
    if not isinstance(vision, dict):
        raise PlannerError(f"{f.source}: include_vision needs the {family} config's vision_config as a mapping, "
                           f"got {type(vision).__name__}", field=f.key("vision_config"))
    kind = vision.get("model_type", model_type)
    if model_type is not None and kind != model_type:
        raise PlannerError(f"{f.source}: vision_config.model_type {kind!r} is not supported for {family} "
                           f"({model_type})", field=f.key("vision_config.model_type"))
    return _Fields(f"{f.source}: vision_config", vision, f.key("vision_config")), True


def _linear(out_features: int, in_features: int, bias: bool) -> list[int]:
    return [out_features * in_features] + ([out_features] if bias else [])


def _patches(v: _Fields, image_default: int, patch_default: int) -> tuple[int, int]:
    image, patch = v.int("image_size", image_default), v.int("patch_size", patch_default)
    if patch > image:
        raise PlannerError(f"{v.source}: patch_size({patch}) exceeds image_size({image})", field=v.key("patch_size"))
    return image, patch


def _gemma3_vision(f: _Fields, text_hidden: int) -> tuple[list[int], list[int], str]:
    # SiglipVisionModel (siglip/modeling_siglip.py; SiglipVisionConfig defaults): embeddings
    # (patch_embedding Conv2d with bias, position_embedding of (image // patch)^2 rows), encoder
    # layers (layer_norm1, self_attn k/v/q/out with bias, layer_norm2, mlp fc1/fc2 with bias),
    # post_layernorm, and the attention-pooling head when vision_use_head (Gemma 3's configs: false)
    v, given = _vision_config(f, "gemma3", "siglip_vision_model", {})
    h, inner = v.int("hidden_size", 768), v.int("intermediate_size", 3072)
    layers, channels = v.int("num_hidden_layers", 12), v.int("num_channels", 3)
    v.int("num_attention_heads", 12)
    image, patch = _patches(v, 224, 16)
    out = [h * channels * patch * patch, h, (image // patch) ** 2 * h]
    layer = [h, h, *_linear(h, h, True) * 4, h, h, *_linear(inner, h, True), *_linear(h, inner, True)]
    out += layer * layers + [h, h]
    if v.bool("vision_use_head", True):  # SiglipMultiheadAttentionPoolingHead: probe, nn.MultiheadAttention
        out += [h, 3 * h * h, 3 * h, h * h, h, h, h, *_linear(inner, h, True), *_linear(h, inner, True)]
    # Gemma3MultiModalProjector: mm_input_projection_weight (vision x text hidden), mm_soft_emb_norm
    projector = [h * text_hidden, h]
    return out, projector, "" if given else "SiglipVisionConfig"


def _llama4_vision(f: _Fields, text_hidden: int) -> tuple[list[int], list[int], str]:
    # Llama4VisionModel (llama4/modeling_llama4.py; Llama4VisionConfig defaults): class_embedding,
    # positional_embedding_vlm ((image // patch)^2 + 1 rows), patch_embedding (Llama4UnfoldConvolution:
    # a Linear without bias), layernorm_pre/post, encoder layers (q/k/v/o with bias, fc1/fc2 with bias,
    # two LayerNorms), vision_adapter (Llama4VisionMLP2: fc1, fc2 without bias)
    v, given = _vision_config(f, "llama4", None, {})
    h, inner = v.int("hidden_size", 768), v.int("intermediate_size", 5632)
    layers, heads, channels = v.int("num_hidden_layers", 34), v.int("num_attention_heads", 16), v.int("num_channels", 3)
    image, patch = _patches(v, 448, 14)
    width = heads * (h // heads)  # Llama4VisionAttention: head_dim = hidden_size // num_attention_heads
    if not width:
        raise PlannerError(f"{v.source}: num_attention_heads({heads}) exceeds hidden_size({h})",
                          field=v.key("num_attention_heads"))
    out = [h, ((image // patch) ** 2 + 1) * h, h * channels * patch * patch, h, h, h, h]
    layer = [*_linear(width, h, True) * 3, *_linear(h, width, True), *_linear(inner, h, True),
             *_linear(h, inner, True), h, h, h, h]
    projector_in, projector_out = v.int("projector_input_dim", 4096), v.int("projector_output_dim", 4096)
    out += layer * layers + [projector_in * inner, projector_out * projector_out]
    # Llama4MultiModalProjector: linear_1, vision_output_dim -> text hidden, no bias
    projector = [text_hidden * v.int("vision_output_dim", 7680)]
    return out, projector, "" if given else "Llama4VisionConfig"


# Mistral3Config's default vision_config (configuration_mistral3.py, SubConfigSpec init_kwargs): Pixtral
_MISTRAL3_VISION = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, patch_size=14,
                        image_size=1540, num_hidden_layers=24, num_attention_heads=16, head_dim=64)


def _mistral3_vision(f: _Fields, text_hidden: int) -> tuple[list[int], list[int], str]:
    # PixtralVisionModel (pixtral/modeling_pixtral.py; PixtralVisionConfig defaults): patch_conv
    # without bias, ln_pre (RMSNorm), layers (attention_norm, feed_forward gate/up/down, attention
    # k/v/q/o, all hidden x hidden, no biases, ffn_norm)
    v, given = _vision_config(f, "mistral3", "pixtral", _MISTRAL3_VISION)
    h, inner = v.int("hidden_size", 1024), v.int("intermediate_size", 4096)
    layers, channels = v.int("num_hidden_layers", 24), v.int("num_channels", 3)
    v.int("num_attention_heads", 16)
    _, patch = _patches(v, 1024, 16)
    out = [h * channels * patch * patch, h]
    out += [h, inner * h, inner * h, h * inner, h * h, h * h, h * h, h * h, h] * layers
    # Mistral3MultiModalProjector: norm (RMSNorm), patch_merger.merging_layer, linear_1, linear_2
    merge = f.int("spatial_merge_size", 2)
    feature_layer = f.fields.get("vision_feature_layer", -1)
    feature_layers = len(feature_layer) if isinstance(feature_layer, list) and feature_layer else 1
    bias = f.bool("multimodal_projector_bias", False)
    projector = [h, h * h * merge * merge, *_linear(text_hidden, h * feature_layers, bias),
                 *_linear(text_hidden, text_hidden, bias)]
    return out, projector, "" if given else "Mistral3Config default (Pixtral)"


VISION_READERS: dict[str, Callable[[_Fields, int], tuple[list[int], list[int], str]]] = {
    "gemma3": _gemma3_vision,
    "llama4": _llama4_vision,
    "mistral3": _mistral3_vision,
}
# The whole ForConditionalGeneration ties its LM head by the multimodal config's own
# tie_word_embeddings, not text_config's (transformers 5, checked on the meta device: a mistral3
# config without the top-level field ties, whatever text_config says); the class defaults:
_MULTIMODAL_TIED = {"gemma3": True, "llama4": False, "mistral3": True}


def _with_vision(f: _Fields, model_type: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's fields with the vision tower and projector counted as model states."""
    tower, projector, defaults = VISION_READERS[model_type](f, fields["hidden_size"])
    auto, built, _ = LOADED_CLASS[model_type]
    counted = (f"{model_type}: the whole {built} is counted ({auto} builds it; text_only for a script that loads "
               f"the text decoder): the vision tower ({sum(tower):,} parameters) and the multimodal projector "
               f"({sum(projector):,}) are model states, sharded like the rest and trained (parameters, "
               "gradients and optimizer states: a bound, as on a text batch the tower gets no gradient); activations are those of a batch of text tokens (the tower runs on no "
               "image): image activations are not modelled")
    notes = [counted] + ([f"{model_type}: the config has no vision_config; the vision tower is built from "
                          f"transformers' {defaults} defaults, which may differ from the published checkpoint's"] if defaults else [])
    tied = f.bool("tie_word_embeddings", _MULTIMODAL_TIED[model_type])
    if tied != fields["tie_word_embeddings"]:
        notes.append(f"{model_type}: the whole model's LM head is {'tied to' if tied else 'separate from'} the input "
                     "embeddings (the multimodal config's tie_word_embeddings, which transformers follows)")
    kept = tuple(n for n in fields.get("notes", ()) if not n.startswith(f"{model_type}: the text decoder is counted"))
    return fields | dict(vision_numels=tuple(tower + projector), notes=kept + tuple(notes), tie_word_embeddings=tied)


READERS: dict[str, Callable[[_Fields], dict[str, Any]]] = {
    "llama": _read_llama,
    "mistral": _read_mistral,
    "qwen2": _read_qwen2,
    "gemma2": _read_gemma2,
    "mixtral": _read_mixtral,
    "phi3": _read_phi3,
    "gpt2": _read_gpt2,
    "falcon": _read_falcon,
    "qwen3": _read_qwen3,
    "qwen3_moe": _read_qwen3_moe,
    "olmo2": _read_olmo2,
    "gemma3_text": _read_gemma3_text,
    "gemma3": _read_gemma3,
    "smollm3": _read_smollm3,
    "mistral3": _read_mistral3,
    "gpt_oss": _read_gpt_oss,
    "deepseek_v2": _read_deepseek_v2,
    "deepseek_v3": _read_deepseek_v3,
    "llama4_text": _read_llama4_text,
    "llama4": _read_llama4,
}


def from_hf_config(config: dict[str, Any], source: str = "config", include_vision: bool = False) -> Architecture:
    """Read a Hugging Face ``config.json`` (as a dict) into an Architecture; ``include_vision``
    counts a multimodal checkpoint's vision tower and projector as model states too."""
    if not isinstance(config, dict):
        raise PlannerError(f"{source}: a model config must be a mapping of field names, got {type(config).__name__}",
                           field=None)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise PlannerError(f"{source}: model_type is required (one of {', '.join(sorted(READERS))})",
                          field="model_type")
    reader = READERS.get(model_type)
    if reader is None:
        raise PlannerError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(sorted(READERS))}",
            field="model_type")
    if include_vision and model_type not in VISION_READERS:
        raise PlannerError(f"include_vision: {source} is a text-only model (model_type {model_type!r}); "
                           f"include_vision applies to the multimodal configs {', '.join(sorted(VISION_READERS))}",
                           field="include_vision")
    fields = reader(_Fields(source, config))
    if include_vision:
        fields = _with_vision(_Fields(source, config), model_type, fields)
    if fields["num_key_value_heads"] > fields["num_attention_heads"]:
        raise PlannerError(
            f"{source}: num_key_value_heads({fields['num_key_value_heads']}) exceeds "
            f"num_attention_heads({fields['num_attention_heads']})", field="num_key_value_heads")
    try:
        return Architecture(model_type=model_type, **fields)
    except ValueError as exc:  # pydantic's range checks, re-worded with the source
        raise PlannerError(f"{source}: {_first_error(exc)}", field=_first_field(exc)) from None


def defaulted_size_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The size-defining fields a config leaves out, with the default its reader took for each."""
    reader = READERS.get(config.get("model_type")) if isinstance(config, dict) else None
    if reader is None:
        return {}
    read = _Fields("config", config)
    reader(read)
    return read.missing


def _first_field(exc: ValueError) -> str | None:
    errors = getattr(exc, "errors", None)
    loc = errors()[0].get("loc", ()) if callable(errors) else ()
    return ".".join(str(p) for p in loc) or None


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()))
        return f"{field}={first.get('input')!r}: {first.get('msg')}"
    return str(exc)
