"""The elementwise work of a block, op by op (planner/time/elementwise.py), against what torch runs.

One decoder block of a tiny config runs forward and backward on CPU under a TorchDispatchMode that
records every ATen op autograd dispatches, with its tensors' bytes (inputs, storage-sized where an input is
a broadcast view, and outputs). Matmuls and attention are other terms, views move nothing; the rest is what
the model counts: the number of ops forward and backward, and their bytes. Ops whose implementation differs
between CPU and CUDA are kept out of these blocks (dropout: p = 0; CPU composes it, CUDA runs native_dropout),
and the fused LayerNorm's per-row mean and rstd (bf16 on CPU, fp32 on CUDA) are 1/128 of its bytes here. Two ops
move more than their operands on CUDA, added to what the recorder sees: slice_backward (zero-fill, then the
slice) and native_layer_norm_backward (its weight/bias kernel rereads the gradient and the input).
"""

from __future__ import annotations

import pytest

from planner.cluster.gpus import load_gpus
from planner.model.architecture import from_hf_config, layer_specs
from planner.time.elementwise import (COMPOSITE_RMSNORM, FUSED_LAYERNORM, GRADIENT_SUM, _mlp_gradient_sums,
                                      block_traffic, mlp_traffic, traffic)
from planner.time.kernels import Recompute, micro_batch_terms, rates, work
from tests.real_runs import (DEEPSEEK_V2, DEEPSEEK_V3, GEMMA3, GPT2, GPT_OSS, LLAMA, LLAMA4, MISTRAL, OLMO2, QWEN2,
                             QWEN3, QWEN3_MOE, SMOLLM3)

TOKENS = 96  # no weight (256, 64 elements) is a multiple of it: weight-sized tensors are told apart by that
SKIPPED = {"mm", "addmm", "bmm", "detach", "view", "_unsafe_view", "expand", "as_strided", "slice", "unsqueeze",
           "t", "transpose", "permute", "empty_like", "empty_strided", "empty", "ones_like", "reshape", "alias",
           "squeeze", "split", "split_with_sizes", "select", "clone_", "_grouped_mm"}
# Ops that write a fresh tensor shaped like their input without reading it (index_backward's and
# value_selecting_reduction_backward's zeros: derivatives.yaml lines 844, 1608; Llama4Router's full_like)
FILLS = {"new_zeros", "zeros_like", "new_empty", "full_like"}


def _record(config: dict, torch, lora: dict | None = None, layer: int = 0, mlp_only: bool = False):
    """The ops of block ``layer``'s forward and backward (``mlp_only``: of its MLP module alone)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from transformers import AutoConfig, AutoModelForCausalLM

    def nbytes(t) -> int:
        if t.numel() % TOKENS:  # a weight, its gradient, or a scalar: per micro-batch, not counted
            return 0
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            # Conv1D's bias: the bias-gradient term (a sum over the tokens, dim 0; an MoE's routing-weight gradient
            # sums over the hidden width instead)
            bias_gradient = name == "sum" and inputs[0].dim() == 2 and len(args) > 1 and list(args[1]) == [0]
            if name not in SKIPPED and "scaled_dot_product" not in name and not bias_gradient:
                moved = sum(nbytes(t) for t in (outputs if name in FILLS else inputs + outputs))
                if name == "slice_backward":  # zeros, then the slice copied in: the slice is written twice
                    moved += nbytes(inputs[0])
                if name == "native_layer_norm_backward" and any(args[-1][1:]):  # CUDA's weight/bias kernel rereads
                    moved += sum(nbytes(t) for t in inputs[:4])  # dY, X, mean, rstd (when a weight wants a gradient)
                self.ops.append((name, moved))
            return out

    torch.manual_seed(0)
    hf = AutoConfig.for_model(**config)
    # the MLP alone runs no attention (and gpt-oss has no SDPA)
    hf._attn_implementation = "eager" if mlp_only else "sdpa"
    model = AutoModelForCausalLM.from_config(hf).to(torch.bfloat16)
    if lora is not None:  # PEFT freezes the base and wraps the targeted linears (adapters in bf16, as the base)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora), autocast_adapter_dtype=False).base_model.model
    x = torch.randn(1, TOKENS, hf.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    if config["model_type"] == "gpt2":
        block = model.transformer.h[0]

        def run():
            out = block(x)
            return out[0] if isinstance(out, tuple) else out
    elif mlp_only:
        layer_module = model.model.layers[layer]
        mlp = getattr(layer_module, "mlp", None) or layer_module.feed_forward  # Llama-4: feed_forward

        def run():
            out = mlp(x)
            return out[0] if isinstance(out, tuple) else out  # GptOssMLP returns the router scores beside
    else:
        block = model.model.layers[layer]
        positions = torch.arange(TOKENS)[None]
        layer_types = getattr(hf, "layer_types", None)
        rotary = ((x, positions, layer_types[0]) if config["model_type"].startswith("gemma3") else (x, positions))
        cos_sin = model.model.rotary_emb(*rotary)  # Gemma-3: a table per layer type

        def run():
            out = block(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            return out[0] if isinstance(out, tuple) else out

    grad = torch.ones_like(run())
    with Recorder() as r:
        y = run()
        forward = list(r.ops)
        y.backward(grad)
    return forward, r.ops[len(forward):]


# Gemma-3's RMSNorm adds two weight-sized ops per call the model does not count (``1.0 + self.weight.float()``: a
# cast and an add, per micro-batch), six calls per block: its forward runs 12 ops more.
WEIGHT_SIZED_FORWARD_OPS = {"gemma3": 12}


@pytest.mark.parametrize("name, config", [("llama", LLAMA), ("mistral", MISTRAL), ("qwen2", QWEN2), ("qwen3", QWEN3),
                                          ("smollm3", SMOLLM3), ("gemma3", GEMMA3), ("olmo2", OLMO2), ("gpt2", GPT2),
                                          ("gpt2-gelu", GPT2 | {"activation_function": "gelu"})])
def test_block_elementwise_ops_and_bytes_match_torch(name, config):
    """Llama, Mistral, Qwen2 (q/k/v biases: their gradients are the bias term), SmolLM3: composite RMSNorm, rotary,
    SwiGLU; Qwen3: per-head q/k norms; Gemma-3: four fp32-weight sandwich norms and per-head q/k norms, GELU-tanh
    gate; OLMo-2: fp32-weight norms over the whole q/k projections, rotary in fp32 (fp32 cos/sin) cast back; GPT-2: fused LayerNorm, a fused q/k/v split, NewGELU's eight ops (exact GELU, MPT's: one)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    forward, backward = _record(config, torch)
    arch = from_hf_config(config)
    model = block_traffic(arch, layer_specs(arch)[0], 1, False, 2)
    counts = (len(forward) - WEIGHT_SIZED_FORWARD_OPS.get(name, 0), len(backward))
    assert counts == (model.forward_kernels, model.backward_kernels), (forward, backward)
    assert sum(b for _, b in forward) == pytest.approx(model.forward_bytes * TOKENS, rel=0.01)
    assert sum(b for _, b in backward) == pytest.approx(model.backward_bytes * TOKENS, rel=0.01)


# Mixtral: top-2 of 8 experts of intermediate 192 (real_runs has none: the dense blocks' shape)
MIXTRAL = {"model_type": "mixtral", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 192,
           "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": False}


@pytest.mark.parametrize("name, config", [("qwen3-moe", QWEN3_MOE),
                                          ("qwen3-moe-norm", QWEN3_MOE | {"norm_topk_prob": True}),
                                          ("qwen3-moe-k4", QWEN3_MOE | {"num_experts_per_tok": 4}),
                                          ("mixtral", MIXTRAL), ("mixtral-k3", MIXTRAL | {"num_experts_per_tok": 3})])
def test_moe_block_routing_and_dispatch_match_torch(name, config):
    """An MoE block under transformers 5.x's default experts implementation (grouped_mm): the router's fp32 softmax,
    top-k, renormalisation (Mixtral always, Qwen3-MoE with norm_topk_prob) and Qwen3-MoE's cast of the weights; the
    dispatch's sort, gathers, the rows' multiply by their (Mixtral: fp32) routing weight, the gather back and the sum
    over the k pairs; their backward. k rows per token of hidden width: top-2, -3 and -4 all exact. Before these were
    counted a Qwen3-MoE block's forward measured 55,152 bytes per token against 47,552 modelled."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    forward, backward = _record(config, torch)
    names = [n for n, _ in forward]
    assert "histc" in names and "index_add_" not in names  # grouped_mm's offsets, not the eager loop's index_add_
    arch = from_hf_config(config)
    spec = layer_specs(arch)[0]
    assert spec.mlp.is_moe
    model = block_traffic(arch, spec, 1, False, 2)
    assert (len(forward), len(backward)) == (model.forward_kernels, model.backward_kernels), (forward, backward)
    assert sum(b for _, b in forward) == pytest.approx(model.forward_bytes * TOKENS, rel=0.01)
    assert sum(b for _, b in backward) == pytest.approx(model.backward_bytes * TOKENS, rel=0.01)


# Weight-sized ops of the MLP alone the model leaves out, forward and backward: DeepSeek's router weight to fp32
# and its gradient's cast back (a copy for bf16 weights as here; none for fp32 weights). gpt-oss's zeros of its two
# expert biases' gradients are counted (launches, no per-token bytes), as the dispatch's histc and cumsum.
MLP_WEIGHT_SIZED_OPS = {"deepseek_v2": (1, 1), "deepseek_v3": (1, 1), "gpt_oss": (0, 0), "llama4_text": (0, 0)}


@pytest.mark.parametrize("name, config", [
    ("gpt-oss", GPT_OSS | {"intermediate_size": 200}), ("gpt-oss-k3", GPT_OSS | {"intermediate_size": 200,
                                                                                "num_experts_per_tok": 3}),
    ("deepseek-v3", DEEPSEEK_V3), ("deepseek-v3-unnormalised", DEEPSEEK_V3 | {"norm_topk_prob": False}),
    ("deepseek-v3-2-groups-k3", DEEPSEEK_V3 | {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 3}),
    ("deepseek-v2-greedy", DEEPSEEK_V2), ("llama4", LLAMA4), ("llama4-top2", LLAMA4 | {"num_experts_per_tok": 2}),
    ("deepseek-v2-group-limited",
     DEEPSEEK_V2 | {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2})])
def test_moe_modules_routing_and_dispatch_match_torch(name, config):
    """The MoE module alone (these blocks' attention is another matter: MLA, gpt-oss's sinks). DeepseekV3MoE: the fp32
    sigmoid router, group-limited (top-2 per group summed, top groups masked), the scores' gather, renormalisation
    and routed scaling; the grouped_mm dispatch with fp32 routing weights (as Mixtral's); the shared expert's gate
    and its add; the input's three gradient sums (router, experts, the shared expert's gate and up). DeepseekV2Moe:
    the fp32 softmax router, greedy or group-limited (each group's max, top groups masked), routed scaling.
    Llama4TextMoe: the sigmoid of the scattered top-k, every expert on every token (repeat, bmm), the sum over the
    copies. GptOssMLP: top-k of the biased logits and their softmax in bf16; the experts' bias rows gathered and
    added; the clamped SwiGLU on the interleaved halves. gpt-oss at intermediate 200: its (8, 384) gate/up bias
    would be a multiple of the tokens."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    layer = config.get("first_k_dense_replace", config.get("interleave_moe_layer_step", 1) - 1)
    forward, backward = _record(config, torch, layer=layer, mlp_only=True)
    arch = from_hf_config(config)
    m = layer_specs(arch)[layer].mlp
    assert m.is_moe
    model = mlp_traffic(arch, m, 1, 2) + traffic(GRADIENT_SUM, arch.hidden_size, 2).times(_mlp_gradient_sums(m))
    skipped_forward, skipped_backward = MLP_WEIGHT_SIZED_OPS[config["model_type"]]
    assert (len(forward) - skipped_forward, len(backward) - skipped_backward) == (
        model.forward_kernels, model.backward_kernels), (forward, backward)
    assert sum(b for _, b in forward) == pytest.approx(model.forward_bytes * TOKENS, rel=0.01)
    assert sum(b for _, b in backward) == pytest.approx(model.backward_bytes * TOKENS, rel=0.01)


def test_an_moe_router_no_block_runs_is_refused_naming_it():
    from planner.errors import PlannerError
    from planner.model.layers import MlpSpec
    from planner.time.elementwise import moe_traffic

    odd = MlpSpec(gated=True, intermediate_size=64, num_experts=8, experts_per_token=2, layout="mixtral",
                  router="sigmoid_top1")
    with pytest.raises(PlannerError, match=r"mlp.layout\('mixtral'\) with mlp.router\('sigmoid_top1'\)"):
        moe_traffic(odd, 256, 1, 2)


def test_moe_dispatch_bytes_grow_with_the_routed_rows():
    # Qwen3-MoE in bf16, one more expert per token (top-3 against top-2), forward bytes per token: the hidden row
    # gathered (2h), multiplied by its weight (read and written, 4h), gathered back (4h) and read by the sum (2h):
    # 12h; the expert's gate over its intermediate (silu 4, the product 6 bytes per element); and per pair its
    # indices and weight: topk's value and index (12), the cast (6), sort (24), // k (16), the gathers' indices (8, 8)
    # and the weight's gather (12), the ids to 4 bytes (12), histc (4), the weight read by the mul (2), arange (8),
    # index_put_ (32): 144. The router's scores (per expert) do not change.
    two, three = (from_hf_config(QWEN3_MOE | {"num_experts_per_tok": k}) for k in (2, 3))
    t2, t3 = (block_traffic(a, layer_specs(a)[0], 1, False, 2) for a in (two, three))
    assert t3.forward_bytes - t2.forward_bytes == 12 * two.hidden_size + 10 * 192 + 144


def test_a_composite_rmsnorm_moves_nine_times_a_fused_norms_bytes_forward():
    # LlamaRMSNorm forward in bf16: 36 bytes per element (to fp32 6, pow 8, mean 4, x * rsqrt 8, to bf16 6,
    # weight * 4) where one fused kernel reads 2 and writes 2; backward 92 against 10 (CUDA's two LayerNorm
    # backward kernels read the gradient and the input twice); per-row statistics aside
    rms, fused = traffic(COMPOSITE_RMSNORM, 4096, 2), traffic(FUSED_LAYERNORM, 4096, 2)
    assert (rms.forward_bytes, fused.forward_bytes) == (36 * 4096, 4 * 4096)
    assert (rms.backward_bytes, fused.backward_bytes) == (92 * 4096, 10 * 4096)


def test_a_policy_reruns_the_blocks_elementwise_forward_and_not_the_edges():
    # Llama, 2,048 tokens: the Work's elementwise forward is the blocks' op-by-op forward; a policy that reruns
    # all of it (selective-op: every op between the saved mm outputs) adds exactly that time to the recompute,
    # nothing of the backward, the embedding or the final norm
    arch = from_hf_config(LLAMA)
    r = rates(load_gpus()["a100-80gb"], "bf16")
    w = work(arch, 2048, 1, 1, False, 2, False, r)
    block = block_traffic(arch, layer_specs(arch)[0], 1, False, 2)
    assert w.elementwise_bytes == pytest.approx(block.forward_bytes * 2048 * arch.num_layers)
    assert w.elementwise_backward_bytes == pytest.approx(block.backward_bytes * 2048 * arch.num_layers)
    none = micro_batch_terms(w, 2, r, 2, "none", shares=Recompute())
    rerun = micro_batch_terms(w, 2, r, 2, "selective-op", shares=Recompute(elementwise=1.0))
    assert w.elementwise_excess_bytes == pytest.approx(block.forward_excess_bytes * 2048 * arch.num_layers)
    assert w.elementwise_excess_bytes > 0  # the norms and the rotary run below the copy rate
    rerun_seconds = 2 * (w.elementwise_bytes + w.elementwise_excess_bytes) / r.memory_bytes_per_s
    assert rerun.recompute - none.recompute == pytest.approx(rerun_seconds)
    assert rerun.elementwise == none.elementwise


def test_norms_and_rotary_run_at_their_measured_rates_plain_ops_at_the_copy_rate():
    # A piece's time in bytes at the copy rate: its bytes scaled by the copy rate over its measured rate
    # (Liger-Kernel's benchmarks of the eager baselines); an add or an activation streams at the copy rate
    from planner.time.collectives import MEMORY_BANDWIDTH_EFFICIENCY as copy
    from planner.time.elementwise import (ADD, COMPOSITE_RMSNORM, FUSED_ACTIVATION, FUSED_LAYERNORM, ROTARY,
                                          traffic)
    rms = traffic(COMPOSITE_RMSNORM, 4096, 2, rows=1)
    assert rms.forward_seconds_bytes == pytest.approx(rms.forward_bytes * copy / 0.652)
    assert rms.backward_seconds_bytes == pytest.approx(rms.backward_bytes * copy / 0.683)
    ln = traffic(FUSED_LAYERNORM, 4096, 2, rows=1)
    assert ln.forward_seconds_bytes == pytest.approx(ln.forward_bytes * copy / 0.520)
    rope = traffic(ROTARY, 4096, 2, table=128)
    assert rope.forward_seconds_bytes == pytest.approx(rope.forward_bytes * copy / 0.435)
    for piece in (ADD, FUSED_ACTIVATION):
        t = traffic(piece, 4096, 2)
        assert (t.forward_excess_bytes, t.backward_excess_bytes) == (0.0, 0.0)
    both = (rms + ln).times(3)
    assert both.forward_excess_bytes == pytest.approx(3 * (rms.forward_excess_bytes + ln.forward_excess_bytes))


@pytest.mark.parametrize("name, config, targets", [
    ("llama-qv", LLAMA, ["q_proj", "v_proj"]), ("llama-all", LLAMA, "all-linear"), ("qwen2-all", QWEN2, "all-linear"),
    ("gemma3-all", GEMMA3, "all-linear"), ("olmo2-qv", OLMO2, ["q_proj", "v_proj"]), ("gpt2-attn", GPT2, ["c_attn"])])
def test_a_lora_blocks_elementwise_ops_and_bytes_match_torch(name, config, targets):
    """A frozen base under PEFT LoRA adapters: the norms' weight-gradient ops are not run (composite RMSNorm: the
    grad * x and its sum; fp32-weight norms: those and the weight's cast; LayerNorm: CUDA's weight/bias kernel), and
    each adapter adds its scaling's mul, the add of its output and the sum of its input's two gradients. Adapters in
    the base's dtype (autocast_adapter_dtype=False: PEFT's default fp32 adapters add casts the model does not count)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from planner.model.linears import block_linears
    from planner.time.elementwise import adapter_traffic

    forward, backward = _record(config, torch, lora={"r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                                                     "target_modules": targets})
    arch = from_hf_config(config)
    spec = layer_specs(arch)[0]
    names = {l.name for l in block_linears(arch, spec)} if targets == "all-linear" else set(targets)
    adapted = [(l.in_features, l.out_features) for l in block_linears(arch, spec) if l.name in names]
    assert adapted, names
    model = block_traffic(arch, spec, 1, False, 2, frozen=True) + adapter_traffic(adapted, 0.0, False, 2)
    counts = (len(forward) - WEIGHT_SIZED_FORWARD_OPS.get(name.split("-")[0], 0), len(backward))
    assert counts == (model.forward_kernels, model.backward_kernels), (forward, backward)
    assert sum(b for _, b in forward) == pytest.approx(model.forward_bytes * TOKENS, rel=0.01)
    assert sum(b for _, b in backward) == pytest.approx(model.backward_bytes * TOKENS, rel=0.01)
    assert model.backward_kernels < block_traffic(arch, spec, 1, False, 2).backward_kernels + 3 * len(adapted)
