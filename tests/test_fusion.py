"""A compiled block's fused kernels (planner/time/fusion.py) against inductor's own accounting.

One decoder block of a tiny config (tests/real_runs.py, one layer, built from its config) is compiled by
torch.compile (inductor, CPU) and run forward and backward. Inductor's scheduler says, per kernel it
generates, the bytes of every buffer the kernel reads and writes (scheduler.py
get_read_write_buffer_accesses, which GraphLowering.count_bytes sums into metrics.num_bytes_accessed):
recorded here per kernel, for the forward graph and the backward graph. Matmuls and attention are extern
kernels (other terms); NopKernel nodes move nothing. Weight-sized buffers (norm weights, their gradients)
are per micro-batch, not per token: the block runs TOKENS = 97 tokens, a prime no weight's size is a
multiple of, so a buffer is per-token exactly when its bytes are a multiple of it. A bias's gradient (one
reduction reading one gradient: the bias term, kernels.BIAS_GRADIENT_READS) is compared with that term.
The CPU flash attention's backward copies its logsumexp (a kernel of the attention's own, not a block
piece): left out by its origin. The model is the planner's ``backend="cpp"`` (fusion.py's docstring names
each CPU-vs-CUDA difference); the kernel counts must match exactly and the bytes within 2%.
"""

from __future__ import annotations

import pytest

from planner.errors import PlannerError
from planner.model.architecture import from_hf_config, layer_specs
from planner.model.catalogue import catalogue_model, load_catalogue
from planner.time import elementwise, fusion
from planner.time.kernels import LOSS_BYTES_PER_LOGIT, _bias_gradient_elements
from tests.real_runs import GEMMA3, GPT2, LLAMA, OLMO2, QWEN3

TOKENS = 97
TOLERANCE = 0.02
KERNEL_NODES = ("SchedulerNode", "FusedSchedulerNode", "OuterLoopFusedSchedulerNode")


def _origins(node) -> set[str]:
    out: set[str] = set()
    for sub in node.get_nodes():
        out |= {str(o.target) for o in (getattr(sub.node, "origins", None) or ()) if o.op == "call_function"}
    return out


def _compile_block(config: dict, torch, wrap=None):
    """Per graph (forward, backward): per kernel, (per-token bytes read + written, its reads, its writes).
    ``wrap(block)``: what is compiled instead of the block (a checkpoint around it)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering
    from transformers import AutoConfig, AutoModelForCausalLM

    graphs: list[list[tuple[float, dict, dict]]] = []
    original = GraphLowering.count_bytes

    def count_bytes(self):
        kernels = []
        for node in self.scheduler.nodes:
            if type(node).__name__ not in KERNEL_NODES:
                continue
            origins = _origins(node)
            if origins and all("scaled_dot_product" in o or o.endswith(("permute.default", "reshape.default"))
                               for o in origins):
                continue  # the CPU flash attention's own logsumexp copy
            reads = node.get_read_write_buffer_accesses(include_reads=True, include_writes=False)
            writes = node.get_read_write_buffer_accesses(include_reads=False, include_writes=True)
            per_token = {k: v for k, v in (reads | writes).items() if v % TOKENS == 0}
            kernels.append((sum(v for k, v in reads.items() if v % TOKENS == 0)
                            + sum(v for k, v in writes.items() if v % TOKENS == 0), reads, writes, per_token))
        graphs.append(kernels)
        return original(self)

    torch._logging.set_logs(inductor_metrics=True)  # count_bytes runs only under this log
    torch._dynamo.reset()
    torch.manual_seed(0)
    hf = AutoConfig.for_model(**(config | ({"n_layer": 1} if config["model_type"] == "gpt2" else
                                           {"num_hidden_layers": 1})))
    hf._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(hf).to(torch.bfloat16)
    x = torch.randn(1, TOKENS, hf.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    if config["model_type"] == "gpt2":
        block, kwargs = model.transformer.h[0], {}
    else:
        block = model.model.layers[0]
        positions = torch.arange(TOKENS)[None]
        layer_types = getattr(hf, "layer_types", None)
        rotary = (x, positions, layer_types[0]) if config["model_type"].startswith("gemma3") else (x, positions)
        kwargs = {"attention_mask": None, "position_ids": positions,
                  "position_embeddings": model.model.rotary_emb(*rotary)}  # Gemma-3: a table per layer type
    patches = [(inductor_config, "fx_graph_cache", False), (functorch_config, "enable_autograd_cache", False)]
    saved = [(m, k, getattr(m, k)) for m, k, _ in patches]
    try:
        for m, k, v in patches:
            setattr(m, k, v)
        GraphLowering.count_bytes = count_bytes
        out = torch.compile(wrap(block) if wrap else block)(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    finally:
        GraphLowering.count_bytes = original
        for m, k, v in saved:
            setattr(m, k, v)
        torch._logging.set_logs()
        torch._dynamo.reset()
    return graphs


def _is_bias_gradient(kernel) -> bool:
    """A reduction reading one per-token gradient and writing only weight-sized buffers."""
    _, reads, writes, _ = kernel
    return (all(v % TOKENS for v in writes.values()) and len([v for v in reads.values() if v % TOKENS == 0]) == 1)


@pytest.mark.parametrize("name, config", [("llama", LLAMA), ("qwen3", QWEN3), ("gpt2", GPT2)])
def test_compiled_block_kernels_and_bytes_match_inductor_on_cpu(name, config):
    """Llama: composite RMSNorm, rotary, SwiGLU; Qwen3: per-head q/k norms; GPT-2: LayerNorm, a fused q/k/v
    (its gradients' cat), biases, NewGELU. No dropout (CPU draws its mask in a kernel of its own)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    graphs = _compile_block(config, torch)
    assert len(graphs) == 2, "one forward graph and one backward graph"
    forward, backward = graphs
    biases = [k for k in backward if _is_bias_gradient(k)]
    backward = [k for k in backward if not _is_bias_gradient(k)]
    arch = from_hf_config(config)
    spec = layer_specs(arch)[0]
    model = fusion.block_traffic(arch, spec, 1, False, 2, "cpp")
    detail = ([k[3] for k in forward], [k[3] for k in backward])
    assert (len(forward), len(backward)) == (model.forward_kernels, model.backward_kernels), detail
    assert sum(k[0] for k in forward) == pytest.approx(model.forward_bytes * TOKENS, rel=TOLERANCE), detail
    assert sum(k[0] for k in backward) == pytest.approx(model.backward_bytes * TOKENS, rel=TOLERANCE), detail
    assert sum(k[0] for k in biases) == pytest.approx(_bias_gradient_elements(arch, spec, 1, False) * 2 * TOKENS,
                                                      rel=TOLERANCE)


@pytest.mark.parametrize("name, config", [("olmo2", OLMO2), ("gemma3", GEMMA3)])
def test_compiled_forward_of_fp32_weight_norms_matches_inductor_on_cpu(name, config):
    """OLMo-2: post-norms, a q/k norm over the projection, q and k of one width (their rotary kernels fuse);
    Gemma-3: four sandwich norms and per-head q/k norms, GELU-tanh gate. Forward only: their fp32-weight
    norms' backward is split by the C++ backend into several kernels writing fp32 intermediates (OLMo-2's
    measured backward is 8% over the model, Gemma-3's 20%); the CUDA side is the model's, not measured."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    forward, _ = _compile_block(config, torch)
    arch = from_hf_config(config)
    model = fusion.block_traffic(arch, layer_specs(arch)[0], 1, False, 2, "cpp")
    assert len(forward) == model.forward_kernels, [k[3] for k in forward]
    assert sum(k[0] for k in forward) == pytest.approx(model.forward_bytes * TOKENS, rel=TOLERANCE)


@pytest.mark.parametrize("name", sorted(load_catalogue()))
@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_compiled_traffic_is_below_eager_for_every_catalogue_family(name, tp, sp):
    try:
        arch = catalogue_model(name).architecture
    except PlannerError as exc:  # an entry the planner refuses builds no block to time
        pytest.skip(f"{name}: the planner refuses it ({exc})")
    if arch is None:
        pytest.skip(f"{name}: a traced profile, no layer specs")
    for spec in set(layer_specs(arch)):
        eager = elementwise.block_traffic(arch, spec, tp, sp, 2)
        compiled = fusion.block_traffic(arch, spec, tp, sp, 2)
        assert compiled.forward_bytes < eager.forward_bytes, (name, spec)
        assert compiled.backward_bytes < eager.backward_bytes, (name, spec)
        assert compiled.forward_kernels <= eager.forward_kernels, (name, spec)
    last = layer_specs(arch)[-1]
    eager_edge = elementwise.edge_traffic(arch, last, tp, sp, 2)
    model_edge = fusion.edge_traffic(arch, last, tp, sp, 2, eager_edge, "model")
    assert model_edge.forward_bytes + model_edge.backward_bytes < eager_edge.forward_bytes + eager_edge.backward_bytes
    assert fusion.edge_traffic(arch, last, tp, sp, 2, eager_edge, "blocks") == eager_edge


def test_compiled_hf_loss_bytes_per_logit_match_inductor_on_cpu():
    """transformers' ForCausalLMLoss compiled (the "model" mode's loss): inductor's per-kernel bytes per
    logit (4,096 of them per token: the per-row max and sum are under 0.2%) against 4 x the compute dtype."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering
    from transformers.loss.loss_utils import ForCausalLMLoss

    vocab = 4096
    moved: list[int] = []
    original = GraphLowering.count_bytes

    def count_bytes(self):
        moved.append(sum(n.get_read_write_buffers_sizes() for n in self.scheduler.nodes
                         if type(n).__name__ in KERNEL_NODES))
        return original(self)

    logits = torch.randn(1, TOKENS, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, TOKENS))
    torch._logging.set_logs(inductor_metrics=True)
    saved = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    try:
        inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = False, False
        GraphLowering.count_bytes = count_bytes
        torch._dynamo.reset()
        torch.compile(lambda x, y: ForCausalLMLoss(x, y, vocab_size=vocab))(logits, labels).backward()
    finally:
        GraphLowering.count_bytes = original
        inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = saved
        torch._logging.set_logs()
        torch._dynamo.reset()
    per_logit = sum(moved) / (TOKENS * vocab)
    assert per_logit == pytest.approx(fusion.loss_bytes_per_logit("model", 2, 28.0, "cpp"), rel=TOLERANCE)
    assert fusion.loss_bytes_per_logit("none", 2, 28.0) == 28.0
    assert fusion.loss_bytes_per_logit("blocks", 2, 28.0) == 6.0  # torchtitan compiles its loss function too


def test_work_carries_the_compiled_bytes_kernels_loss_and_label():
    """kernels.work(compiled=...): a Llama's blocks at inductor's CUDA kernels (the same for "blocks" and
    "model"), its loss compiled under both; the embedding and final norm fused only under "model"; the
    elementwise term's source says which; an unknown mode is refused naming it."""
    from planner.cluster.gpus import load_gpus
    from planner.time.kernels import micro_batch_terms, rates, work
    from planner.time.step import _compute_labels

    arch = from_hf_config(LLAMA)
    r = rates(load_gpus()["h100-80gb"], "bf16")
    seq, layers = 2048, arch.num_layers
    eager, blocks, whole = (work(arch, seq, 1, 1, False, 2, False, r, compiled=mode)
                            for mode in ("none", "blocks", "model"))
    spec = layer_specs(arch)[0]
    fused, ops = fusion.block_traffic(arch, spec, 1, False, 2), elementwise.block_traffic(arch, spec, 1, False, 2)
    assert blocks.elementwise_bytes == pytest.approx(fused.forward_bytes * seq * layers)
    assert blocks.elementwise_backward_bytes == pytest.approx(fused.backward_bytes * seq * layers)
    assert blocks.kernels - eager.kernels == (fused.forward_kernels - ops.forward_kernels) * layers
    assert blocks.backward_kernels - eager.backward_kernels == (fused.backward_kernels - ops.backward_kernels) * layers
    assert blocks.edge_elementwise_bytes == eager.edge_elementwise_bytes
    assert whole.elementwise_bytes == blocks.elementwise_bytes
    assert whole.edge_elementwise_bytes < blocks.edge_elementwise_bytes
    assert eager.loss_bytes == pytest.approx(LOSS_BYTES_PER_LOGIT * arch.vocab_size * seq)
    assert whole.loss_bytes == blocks.loss_bytes == pytest.approx(3 * 2 * arch.vocab_size * seq)
    times = [micro_batch_terms(w, 1, r, 2, "none").elementwise for w in (eager, blocks, whole)]
    assert times[0] > times[1] > times[2]
    assert "eager, no torch.compile fusion" in dict(_compute_labels(r, "flash-attention-2", False, False, "none",
                                                                     "", eager.compiled))["elementwise and loss"]
    for w in (blocks, whole):
        label = dict(_compute_labels(r, "flash-attention-2", False, False, "none", "", w.compiled))
        assert f"torch.compile ({w.compiled})" in label["elementwise and loss"]
    with pytest.raises(PlannerError, match=r"compile\('yes'\)"):
        work(arch, seq, 1, 1, False, 2, False, r, compiled="yes")


def test_llama_3_8b_compiled_block_by_hand():
    """Llama-3-8B (hidden 4,096, MLP 14,336, q 4,096, k 1,024, head_dim 128), bf16, one token, CUDA's kernels,
    forward: norm (read x, write normed 2 x 8,192 + rstd 4) 16,388; q's rotary (read, write 2 x 8,192, cos
    and sin 2 x 256) 16,896; k's (2 x 2,048 + 512) 4,608; x + attn_out and the MLP's norm (read 2, write 1
    x 8,192 + 4) 24,580; SwiGLU (read gate and up, write 3 x 28,672) 86,016; the block's output (read x,
    attn_out, mlp_out, write 4 x 8,192) 32,768: 181,256 in 6 kernels. Backward: SwiGLU's (read the
    gradient, gate, up, write two: 5 x 28,672) 143,360; each norm's (read its 2 or 3 gradient parts, x (and
    attn_out), the rstd, the residual's gradient, write one: 6 x 8,192 + 4) 49,156 twice; q's and k's rotary
    (read, write, the table) 16,896 and 4,608: 263,176 in 5. Against eager's 36 and 92 bytes per element of
    a composite RMSNorm alone."""
    arch = catalogue_model("llama-3-8b").architecture
    t = fusion.block_traffic(arch, layer_specs(arch)[0], 1, False, 2)
    assert (t.forward_bytes, t.backward_bytes, t.forward_kernels, t.backward_kernels) == (181_256, 263_176, 6, 5)
    tp2 = fusion.block_traffic(arch, layer_specs(arch)[0], 2, False, 2)
    # tensor parallel: each normed input's gradient parts summed before the all-reduce, a kernel each
    assert tp2.backward_kernels == 7
