"""Every catalogue entry's analytic parameter count equals what transformers builds (meta device)."""

import textwrap

import pytest

from planner.architecture import from_hf_config, parameter_count, parameter_numels
from planner.catalogue import catalogue_model, load_catalogue, model_from_config
from planner.errors import PlannerError, UnknownModelError

ENTRIES = sorted(load_catalogue())


def test_catalogue_has_the_required_models():
    required = {"mistral-7b-v0.1", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b",
                "llama-3.1-405b", "llama-3.2-1b", "llama-3.2-3b", "qwen2.5-7b", "qwen2.5-72b", "gemma-2-9b",
                "gemma-2-27b", "mixtral-8x7b", "gpt2", "gpt2-xl", "falcon-7b", "phi-3-mini-4k"}
    assert required <= set(ENTRIES)
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
    from planner.catalogue import aliases

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
    from planner.catalogue import UnsupportedModelTypeError

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
