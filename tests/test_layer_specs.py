"""Each family's per-block activations against what autograd really saves in transformers.

One forward of a tiny model of each family under ``torch.autograd.graph.saved_tensors_hooks``:
every distinct storage autograd keeps for backward (parameters excluded) is summed per decoder
block and compared with the planner's block of the same spec. This is the measurement the
per-block formulas in planner/activations.py were derived from; the real DeepSpeed runs in
tests/real_runs.py check the same numbers end to end.
"""

import pytest

from planner.activations import block_saved_bytes
from planner.architecture import from_hf_config, layer_specs
from tests.real_runs import DEEPSEEK_V2, DEEPSEEK_V3, GEMMA2, GEMMA3, GPT_OSS, LLAMA4, OLMO2, QWEN3, QWEN3_MOE, SMOLLM3

CASES = [
    ("qwen3", QWEN3, "bf16", 256), ("qwen3", QWEN3, "fp32", 256), ("olmo2", OLMO2, "bf16", 256),
    ("gemma3-window-eq-seq", GEMMA3, "bf16", 512), ("gemma3-window-lt-seq", GEMMA3, "fp32", 1024),
    ("smollm3", SMOLLM3, "bf16", 256), ("qwen3_moe", QWEN3_MOE | {"mlp_only_layers": [1]}, "bf16", 256),
    ("gpt_oss", GPT_OSS, "bf16", 256), ("deepseek_v3", DEEPSEEK_V3, "bf16", 256),
    ("deepseek_v3", DEEPSEEK_V3, "fp32", 256), ("deepseek_v2", DEEPSEEK_V2, "bf16", 256),
    ("llama4", LLAMA4, "bf16", 256), ("gemma2", GEMMA2, "bf16", 256),
]


def _measured_blocks(config, dtype_name, micro, seq, attention):
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
    seen, blocks, current = set(), [0] * len(model.model.layers), [None]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            if current[0] is not None:
                blocks[current[0]] += storage.nbytes()
        return tensor

    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=index: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    ids = torch.randint(0, config["vocab_size"], (micro, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
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
