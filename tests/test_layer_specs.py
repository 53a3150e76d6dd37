"""Each family's per-block activations against what autograd really saves in transformers.

One forward of a tiny model of each family under ``torch.autograd.graph.saved_tensors_hooks``:
every distinct storage autograd keeps for backward (parameters excluded) is summed per decoder
block and compared with the planner's block of the same spec. This is the measurement the
per-block formulas in planner/model/activations.py were derived from; the real DeepSpeed runs in
tests/real_runs.py check the same numbers end to end.
"""

import pytest

from planner.errors import PlannerError
from planner.model.activations import block_saved_bytes
from planner.model.architecture import from_hf_config, layer_specs
from planner.model.layers import layer_numels
from tests.real_runs import (DEEPSEEK_V2, DEEPSEEK_V3, GEMMA2, GEMMA3, GPT2, GPT_OSS, LLAMA, LLAMA4, LLAMA_TP, MISTRAL,
                             OLMO2, QWEN2, QWEN3, QWEN3_MOE, SMOLLM3)

CASES = [
    ("qwen3", QWEN3, "bf16", 256), ("qwen3", QWEN3, "fp32", 256), ("olmo2", OLMO2, "bf16", 256),
    ("gemma3-window-eq-seq", GEMMA3, "bf16", 512), ("gemma3-window-lt-seq", GEMMA3, "fp32", 1024),
    ("smollm3", SMOLLM3, "bf16", 256), ("qwen3_moe", QWEN3_MOE | {"mlp_only_layers": [1]}, "bf16", 256),
    ("gpt_oss", GPT_OSS, "bf16", 256), ("deepseek_v3", DEEPSEEK_V3, "bf16", 256),
    ("deepseek_v3", DEEPSEEK_V3, "fp32", 256), ("deepseek_v2", DEEPSEEK_V2, "bf16", 256),
    ("llama4", LLAMA4, "bf16", 256), ("gemma2", GEMMA2, "bf16", 256),
]


def _measured_blocks(config, dtype_name, micro, seq, attention, autocast=False):
    """``autocast``: an fp32 model run under torch.autocast(bfloat16), as the torch strategies'
    mixed recipes train it (backend/train.py TorchEngine)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    fields = dict(config)
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation=attention, dtype=dtype)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = model.transformer.h if hf.model_type == "gpt2" else model.model.layers
    seen, blocks, current = set(), [0] * len(layers), [None]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            if current[0] is not None:
                blocks[current[0]] += storage.nbytes()
        return tensor

    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=index: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    ids = torch.randint(0, config["vocab_size"], (micro, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids, labels=ids)
    return blocks


@pytest.mark.parametrize("name,config,dtype,seq", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_block_saved_bytes_match_autograd(name, config, dtype, seq):
    micro = 2
    arch = from_hf_config(config)
    attention = "eager" if arch.attention_implementation == "eager" else "sdpa"
    measured = _measured_blocks(config, dtype, micro, seq, attention)
    b = 2 if dtype == "bf16" else 4
    first_of_table = set()
    for index, spec in enumerate(layer_specs(arch)):
        predicted = block_saved_bytes(arch, spec, micro * seq, seq, micro, b, attention, device="cpu")
        # the first block reading a RoPE table also holds that table (shared by all blocks,
        # counted once in the head's items); every other block within 0.5%
        if index and spec.attention.rope_table in first_of_table:
            assert predicted == pytest.approx(measured[index], rel=0.005), (name, index)
        first_of_table.add(spec.attention.rope_table)


@pytest.mark.parametrize("name,config", [("llama", LLAMA), ("llama-tp", LLAMA_TP), ("qwen2", QWEN2),
                                         ("mistral", MISTRAL)])
def test_autocast_block_saved_bytes_match_autograd(name, config):
    """Under torch.autocast over fp32 weights each block saves, beyond the 16-bit count, its fp32
    ``x * rsqrt`` in both norms and a 16-bit copy of the normed input per linear (q, k, v; gate, up):
    10 bytes more per token x hidden element on these shapes (the trace of llama-ddp-bf16 showed
    the same per site). The linears' 16-bit weights, which autograd saves too, are the framework's
    "autocast copies of the weights" item (frameworks/torch/v2.py), not the block's activations."""
    micro, seq = 2, 256
    arch = from_hf_config(config)
    measured = _measured_blocks(config, "fp32", micro, seq, "sdpa", autocast=True)
    hidden = arch.hidden_size
    for index, spec in enumerate(layer_specs(arch)):
        if not index:
            continue  # the first block also holds the (fp32) RoPE tables, counted once outside the blocks
        weights = 2 * sum(n for n in layer_numels(spec, hidden) if n > hidden)  # the linears' 16-bit casts
        predicted = block_saved_bytes(arch, spec, micro * seq, seq, micro, 2, "sdpa", device="cpu", autocast=True)
        assert predicted + weights == measured[index], (name, index)
        plain = block_saved_bytes(arch, spec, micro * seq, seq, micro, 2, "sdpa", device="cpu")
        assert predicted - plain == 10 * micro * seq * hidden


@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "gelu_pytorch_tanh", "silu", "relu"])
def test_gpt2_activation_saved_bytes_match_autograd(activation):
    """GPT-2's activation_function decides what its MLP saves (architecture.ACTIVATION_SAVED): NewGELU,
    composed in Python, five inner-width tensors; one fused op two (or one: relu). MPT's exact GELU
    (llm-foundry's MPTMLP, nn.GELU(approximate='none')) is activation_function gelu here."""
    micro, seq = 2, 128
    config = GPT2 | {"activation_function": activation, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    arch = from_hf_config(config)
    assert arch.mlp_activation == ("" if activation == "gelu_new" else activation)
    measured = _measured_blocks(config, "bf16", micro, seq, "sdpa")
    for index, spec in enumerate(layer_specs(arch)):
        predicted = block_saved_bytes(arch, spec, micro * seq, seq, micro, 2, "sdpa", device="cpu")
        assert predicted == pytest.approx(measured[index], rel=0.005), (activation, index)


def test_gpt2_unknown_activation_is_refused():
    with pytest.raises(PlannerError, match="activation_function 'quick_gelu' is not modelled"):
        from_hf_config(GPT2 | {"activation_function": "quick_gelu"})
