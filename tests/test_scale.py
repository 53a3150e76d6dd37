"""verify --scale on MoE and MLA configs (issue 11): the scaled config keeps the family (experts,
expert widths, latent ranks, layer pattern) and is one transformers builds, counted exactly."""

import pytest

from backend.verify import scale_config
from planner.model.architecture import from_hf_config, layer_specs, parameter_count
from planner.model.catalogue import load_catalogue
from planner.errors import PlannerError

# DeepSeek-V2-Lite's config.json (the fields that change bytes): no q LoRA, greedy routing, 1 dense layer
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
                    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
                    "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                    "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1}
GPT_OSS_LAYER_TYPES = dict(load_catalogue()["gpt-oss-120b"].config,
                           layer_types=["sliding_attention", "full_attention"] * 18)
CONFIGS = {name: dict(load_catalogue()[name].config)
           for name in ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-20b",
                        "llama-4-scout")} | {"deepseek-v2-lite": DEEPSEEK_V2_LITE,
                                             "gpt-oss-120b-layer-types": GPT_OSS_LAYER_TYPES}


def _meta_count(config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(config)
    if "text_config" in fields:  # the part verify trains: the text decoder
        fields = dict(fields["text_config"], model_type=fields["model_type"] + "_text")
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("factor", [0.1, 0.02])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scaled_moe_and_mla_configs_build_and_count_exactly(name, factor):
    config = CONFIGS[name]
    scaled, note = scale_config(dict(config), factor)
    arch, original = from_hf_config(scaled), from_hf_config(config)
    assert parameter_count(arch) == _meta_count(scaled)
    assert parameter_count(arch) < parameter_count(original) // 10
    assert arch.model_type == original.model_type and "the prediction is for the scaled model" in note
    # the family's shape survives: experts (never fewer than top-k), latent attention, a MoE layer
    assert arch.experts_per_token == original.experts_per_token <= arch.num_experts < original.num_experts
    assert f"experts {original.num_experts}->{arch.num_experts}" in note
    assert any(spec.mlp.is_moe for spec in layer_specs(arch))
    def latent(a):
        return any(spec.attention.kind == "mla" for spec in layer_specs(a))
    assert latent(arch) == latent(original) == name.startswith("deepseek")


def test_scaled_widths_follow_the_hidden_size():
    v3, _ = scale_config(dict(CONFIGS["deepseek-v3"]), 0.1)
    # 128 heads -> 13, hidden 7168 * 13/128 = 728; ranks and expert width by the same 728/7168
    assert (v3["num_attention_heads"], v3["num_key_value_heads"], v3["hidden_size"]) == (13, 13, 728)
    assert (v3["q_lora_rank"], v3["kv_lora_rank"], v3["moe_intermediate_size"]) == (156, 52, 208)
    assert (v3["qk_rope_head_dim"], v3["qk_nope_head_dim"], v3["v_head_dim"]) == (64, 128, 128)  # same heads
    # 256 experts in 8 groups -> 26 -> whole groups of at least 2, top-8 from 4 kept groups
    assert v3["n_routed_experts"] % v3["n_group"] == 0 and v3["n_routed_experts"] // v3["n_group"] >= 2
    assert v3["topk_group"] <= v3["n_group"] and v3["first_k_dense_replace"] == 3 and v3["num_hidden_layers"] == 6
    lite, _ = scale_config(dict(DEEPSEEK_V2_LITE), 0.1)
    assert lite["q_lora_rank"] is None and lite["first_k_dense_replace"] == 1 and lite["num_hidden_layers"] == 3
    gpt, _ = scale_config(dict(GPT_OSS_LAYER_TYPES), 0.1)
    assert gpt["layer_types"] == ["sliding_attention", "full_attention"] * 2
    scout, _ = scale_config(dict(CONFIGS["llama-4-scout"]), 0.1)
    text = scout["text_config"]
    assert scout["model_type"] == "llama4" and text["num_hidden_layers"] == 5
    assert text["intermediate_size_mlp"] == round(16384 * text["hidden_size"] / 5120)


def test_scale_still_refuses_a_factor_out_of_range():
    with pytest.raises(PlannerError, match=r"--scale must be in \(0, 1\], got 1.5"):
        scale_config(dict(CONFIGS["qwen3-30b-a3b"]), 1.5)
