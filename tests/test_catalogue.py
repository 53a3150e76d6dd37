"""Every catalogue entry's analytic parameter count equals what transformers builds (meta device)."""

import textwrap

import pytest

from planner.model.architecture import from_hf_config, parameter_count, parameter_numels
from planner.model.catalogue import as_loaded, catalogue_model, load_catalogue, model_from_config
from planner.errors import PlannerError, UnknownModelError

ENTRIES = sorted(load_catalogue())
MULTIMODAL = {"gemma3", "llama4", "mistral3"}
NEW_FAMILIES = {"qwen3-0.6b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
                "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b", "olmo-2-7b", "olmo-2-32b",
                "llama-4-scout", "smollm3-3b"}


def test_catalogue_has_the_required_models():
    required = {"mistral-7b-v0.1", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b",
                "llama-3.1-405b", "llama-3.2-1b", "llama-3.2-3b", "qwen2.5-7b", "qwen2.5-72b", "gemma-2-9b",
                "gemma-2-27b", "mixtral-8x7b", "gpt2", "gpt2-xl", "falcon-7b", "phi-3-mini-4k"}
    assert required <= set(ENTRIES)
    assert NEW_FAMILIES <= set(ENTRIES)
    for entry in load_catalogue().values():
        assert entry.source.startswith("https://huggingface.co/") and entry.source.endswith("config.json")


def test_mistral_7b_parameter_count():
    # transformers' MistralForCausalLM on the meta device (the figure in DEVELOPERS.md)
    assert catalogue_model("mistral-7b-v0.1").parameters == 7_241_732_096


@pytest.mark.parametrize("name", ENTRIES)
def test_parameter_count_matches_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    entry = load_catalogue()[name]
    fields = dict(entry.config)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    if entry.family in MULTIMODAL:
        config = config.text_config  # the text decoder only (the vision tower is not counted; see notes)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())
    resolved = catalogue_model(name)
    assert resolved.parameters == expected
    assert sum(parameter_numels(resolved.architecture)) == expected
    assert len(parameter_numels(resolved.architecture)) == len(list(model.parameters()))


def test_unknown_model_names_close_matches():
    with pytest.raises(UnknownModelError, match="unknown model 'mistral-8b'.*mistral-7b"):
        catalogue_model("mistral-8b")


def test_current_entries_are_in_the_catalogue_with_their_published_sizes():
    # Parameter counts as the model cards state them (rounded there): Llama-3.1 8B/70B, Llama-3.3 70B,
    # Phi-4 14.7B, Mistral-Small-24B; the exact figure is transformers' own (parametrized test above).
    approx = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "llama-3.1-405b": 405.9e9,
              "llama-3.3-70b": 70.6e9, "phi-4": 14.66e9, "mistral-small-24b": 23.57e9}
    for name, expected in approx.items():
        assert catalogue_model(name).parameters == pytest.approx(expected, rel=0.005), name
    assert catalogue_model("llama-3.1-8b").parameters == 8_030_261_248


@pytest.mark.parametrize("typed,name", [
    ("mistral-7b", "mistral-7b-v0.1"), ("Mistral-7B", "mistral-7b-v0.1"),
    ("llama-3.1-8b", "llama-3.1-8b"), ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/llama-3.1-8b-instruct", "llama-3.1-8b"), ("mistralai/Mistral-7B-v0.1", "mistral-7b-v0.1"),
    ("microsoft/phi-4", "phi-4"), ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b"),
    ("mistralai/Mistral-Small-24B-Base-2501", "mistral-small-24b"), ("openai-community/gpt2", "gpt2"),
])
def test_aliases_and_hub_ids_resolve_in_one_place(typed, name):
    assert catalogue_model(typed).name == name


def test_every_hub_id_and_alias_is_listed_and_unique():
    from planner.model.catalogue import aliases

    table = aliases()
    for entry in load_catalogue().values():
        assert entry.hub_id is not None and entry.hub_id in entry.all_aliases
        for alias in entry.all_aliases:
            assert table[alias.lower()] == entry.name


def test_an_alias_taken_twice_is_refused(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(textwrap.dedent("""
        models:
          - name: a
            family: llama
            source: https://huggingface.co/x/a/blob/main/config.json
            config: {model_type: llama, hidden_size: 64, num_attention_heads: 4, intermediate_size: 128,
                     num_hidden_layers: 1, vocab_size: 10}
          - name: b
            family: llama
            source: https://huggingface.co/x/b/blob/main/config.json
            aliases: [A]
            config: {model_type: llama, hidden_size: 64, num_attention_heads: 4, intermediate_size: 128,
                     num_hidden_layers: 1, vocab_size: 10}
    """))
    with pytest.raises(PlannerError, match=r"models\[1\] \(b\): name or alias 'A' is already taken"):
        load_catalogue.__wrapped__(path)


def test_an_unknown_hub_like_name_says_how_it_is_read():
    with pytest.raises(UnknownModelError, match="looks like a Hugging Face Hub id"):
        catalogue_model("someone/some-model")


def test_a_model_type_without_a_reader_is_its_own_error_carrying_the_config():
    from planner.model.catalogue import UnsupportedModelTypeError

    config = {"model_type": "starcoder2", "hidden_size": 64}
    with pytest.raises(UnsupportedModelTypeError, match="model_type 'starcoder2' has no analytic reader.*"
                       r"pip install -e '\.\[backend\]'") as caught:
        model_from_config(config, name="sc2")
    assert caught.value.config == config and caught.value.name == "sc2"


@pytest.mark.parametrize("config,message", [
    ({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 30}, r"hidden_size\(4096\) is not divisible by num_attention_heads\(30\)"),
    ({"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 5}, r"num_attention_heads\(32\) is not divisible by num_key_value_heads\(5\)"),
    ({"model_type": "llama", "hidden_size": -4}, "hidden_size must be positive, got -4"),
    ({"model_type": "llama", "num_hidden_layers": "many"}, "num_hidden_layers must be a whole number, got 'many'"),
    ({"model_type": "llama", "hidden_size": 10**9, "num_attention_heads": 1}, "hidden_size"),
    ({"model_type": "bert"}, "model_type 'bert' is not supported"),
    ({"hidden_size": 8}, "model_type is required"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 4}, r"num_experts_per_tok\(4\) exceeds num_local_experts\(2\)"),
    ({"model_type": "qwen3_moe", "num_hidden_layers": 4, "mlp_only_layers": [7]}, r"mlp_only_layers must list layer indices in \[0, 4\), got \[7\]"),
    ({"model_type": "deepseek_v3", "first_k_dense_replace": -1}, "first_k_dense_replace must be a whole number >= 0, got -1"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 10, "n_group": 4}, r"n_routed_experts\(10\) is not divisible by n_group\(4\)"),
    ({"model_type": "gemma3_text", "num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types must list one of"),
    ({"model_type": "smollm3", "num_hidden_layers": 2, "no_rope_layers": [1, 2]}, "no_rope_layers must have one 0/1 entry per layer"),
    ({"model_type": "gpt_oss", "num_local_experts": 2, "num_experts_per_tok": 4}, r"num_experts_per_tok\(4\) exceeds num_local_experts\(2\)"),
    ({"model_type": "gemma3", "text_config": "big"}, "a gemma3 config needs its text_config"),
    ({"model_type": "mistral3", "text_config": {"model_type": "llama"}}, "text_config.model_type 'llama' is not supported for mistral3"),
])
def test_bad_configs_are_refused_naming_field_and_value(config, message):
    with pytest.raises(PlannerError, match=message):
        from_hf_config(config)


def test_contradictory_catalogue_entry_is_refused(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(textwrap.dedent("""
        models:
          - name: wrong
            family: mistral
            source: https://huggingface.co/x/config.json
            config: {model_type: llama, hidden_size: 64, num_attention_heads: 4, intermediate_size: 128,
                     num_hidden_layers: 1, vocab_size: 10}
    """))
    with pytest.raises(PlannerError, match="family 'mistral' contradicts config.model_type 'llama'"):
        load_catalogue.__wrapped__(path)


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - name: [unclosed\n")
    with pytest.raises(PlannerError, match="malformed YAML/JSON at line"):
        load_catalogue.__wrapped__(path)


def test_catalogue_form_and_hf_form_agree():
    entry = load_catalogue()["llama-3.2-1b"]
    a = model_from_config(entry.config)
    b = model_from_config({"name": "x", "config": entry.config})
    assert a.parameters == b.parameters == parameter_count(a.architecture) == 1_235_814_400


# Every new family's reader against transformers' own config defaults and a small variant with
# the features that change the layer list (sliding/global patterns, dense-then-MoE, NoPE layers).
FAMILY_CONFIGS = [
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2,
     "num_hidden_layers": 4, "attention_bias": True},
    {"model_type": "qwen3_moe", "num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 2},
    {"model_type": "olmo2", "num_key_value_heads": 8},
    {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window_pattern": 3},
    {"model_type": "gemma3"},
    {"model_type": "smollm3", "use_sliding_window": True, "sliding_window": 128, "num_hidden_layers": 8},
    {"model_type": "mistral3"},
    {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 8},
    {"model_type": "deepseek_v2", "num_experts_per_tok": 6, "q_lora_rank": None, "num_hidden_layers": 3,
     "first_k_dense_replace": 1, "mlp_bias": True},
    {"model_type": "deepseek_v3", "num_hidden_layers": 5, "attention_bias": True},
    {"model_type": "llama4_text", "num_hidden_layers": 6, "interleave_moe_layer_step": 2},
    {"model_type": "llama4"},
]


@pytest.mark.parametrize("config", FAMILY_CONFIGS, ids=[c["model_type"] for c in FAMILY_CONFIGS])
def test_new_family_counts_match_transformers(config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(config)
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    if config["model_type"] in MULTIMODAL:
        hf = hf.text_config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    numels = [p.numel() for p in model.parameters()]
    arch = from_hf_config(config)
    assert parameter_count(arch) == sum(numels)
    assert sorted(parameter_numels(arch)) == sorted(numels)


def test_layer_specs_follow_the_config_patterns():
    from planner.model.architecture import block_parameters, layer_specs

    v3 = from_hf_config({"model_type": "deepseek_v3", "num_hidden_layers": 5})
    kinds = [spec.mlp.is_moe for spec in layer_specs(v3)]
    assert kinds == [False, False, False, True, True]  # first_k_dense_replace = 3
    assert layer_specs(v3)[0].attention.kind == "mla" and layer_specs(v3)[0].attention.kv_lora_rank == 512
    assert block_parameters(v3)[0] < block_parameters(v3)[3]
    gemma = from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 6})
    assert [s.attention.window for s in layer_specs(gemma)] == ["sliding"] * 5 + ["full"]
    scout = catalogue_model("llama-4-scout").architecture
    assert [s.attention.window for s in layer_specs(scout)][:4] == ["chunked"] * 3 + ["full"]
    oss = catalogue_model("gpt-oss-20b").architecture
    assert oss.attention_implementation == "eager" and any("SDPA" in n for n in oss.notes)
    assert any("vision tower" in n for n in catalogue_model("gemma-3-4b").architecture.notes)


@pytest.mark.parametrize("name", sorted(NEW_FAMILIES))
def test_new_families_estimate_with_their_notes(name):
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    result = estimate(EstimateRequest(model=name, gpus=8, strategy="zero3", micro_batch=1, seq_len=4096))
    assert result.parameters == as_loaded(catalogue_model(name)).parameters  # gemma3: the vision tower too
    assert any(item.component == "activations" and item.bytes > 0 for phase in result.phases for item in phase.items)


def test_sink_attention_is_predicted_eager_whatever_was_asked():
    from planner.model.activations import estimate_activations

    for name in ("gpt-oss-20b", "gemma-2-9b"):  # transformers 5: _supports_sdpa = False for both
        arch = catalogue_model(name).architecture
        sdpa = estimate_activations(arch, micro_batch=1, seq_len=2048, compute_bytes=2, attention="sdpa")
        eager = estimate_activations(arch, micro_batch=1, seq_len=2048, compute_bytes=2, attention="eager")
        assert sdpa == eager and arch.attention_implementation == "eager"


def test_moe_activations_follow_the_routed_tokens():
    """Qwen3-MoE's routed part grows with top-k (per (token, expert) pair), Llama-4's with every
    expert (it runs all experts on all tokens)."""
    from planner.model.activations import estimate_activations

    def saved(config):
        return estimate_activations(from_hf_config(config), micro_batch=1, seq_len=256, compute_bytes=2).saved_bytes

    base = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "moe_intermediate_size": 128, "num_experts": 8, "vocab_size": 1000}
    one, two = saved(base | {"num_experts_per_tok": 1}), saved(base | {"num_experts_per_tok": 2})
    # one more pair per token and layer: 3 int64 indices, the gathered input and the down output
    # (h each), 4 x I of the gated expert, its routing weight; the router saves 8 + 4 bytes more
    per_pair = 3 * 8 + 2 * (256 + 256 + 4 * 128 + 1) + 8 + 4
    assert two - one == 2 * 256 * per_pair
    llama4 = {"model_type": "llama4_text", "num_hidden_layers": 1, "hidden_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 128, "vocab_size": 1000}
    assert saved(llama4 | {"num_local_experts": 8}) > saved(llama4 | {"num_local_experts": 4})


@pytest.mark.parametrize("name", sorted(NEW_FAMILIES))
def test_dumped_architecture_reads_back(name):
    from planner.model.architecture import Architecture

    arch = catalogue_model(name).architecture
    assert Architecture.model_validate(arch.model_dump()) == arch
    assert Architecture.model_validate_json(arch.model_dump_json()) == arch


def test_uniform_stacks_dump_as_before():
    dumped = catalogue_model("llama-3.2-1b").architecture.model_dump()
    assert "layers" not in dumped and "notes" not in dumped
    olmo = catalogue_model("olmo-2-7b").architecture.model_dump()
    assert olmo["layers"][0]["count"] == 32 and olmo["layers"][0]["attention"]["qk_norm"] == "projection"


def test_verify_scales_a_multimodal_config_inside_its_text_config_and_moe_too():
    from backend.verify import scale_config

    gemma = load_catalogue()["gemma-3-27b"].config
    scaled, note = scale_config(dict(gemma), 0.1)
    assert scaled["model_type"] == "gemma3" and scaled["text_config"]["num_hidden_layers"] == 6
    assert parameter_count(from_hf_config(scaled)) < parameter_count(from_hf_config(gemma)) // 100
    moe, note = scale_config(dict(load_catalogue()["qwen3-30b-a3b"].config), 0.1)  # tests/test_scale.py
    assert moe["num_experts"] == 13 and "experts 128->13" in note
