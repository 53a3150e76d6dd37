"""A multimodal checkpoint's vision tower and projector counted as model states, equal to
transformers' whole ForConditionalGeneration on the meta device (issue 11); counted by default where
the loader builds the whole class (AutoModelForCausalLM on gemma3, issue 21), text_only for a script
that loads the text decoder, include_vision where AutoModelForCausalLM builds the text one (llama4)."""

import pytest

from planner.model.architecture import (active_parameter_count, from_hf_config, parameter_count, parameter_numels,
                                        vision_parameters)
from planner.model.catalogue import load_catalogue
from planner.errors import PlannerError

TINY_GEMMA3_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}
TINY_SIGLIP = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 64, "patch_size": 8}
# google/gemma-3-4b-it's vision_config (SigLIP-so400m), as its config.json on the Hub gives it
GEMMA3_SIGLIP = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                 "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                 "vision_use_head": False}
TINY_LLAMA4_TEXT = {"hidden_size": 64, "intermediate_size": 64, "intermediate_size_mlp": 128, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
                    "num_local_experts": 2, "interleave_moe_layer_step": 2}
TINY_LLAMA4_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "image_size": 56, "patch_size": 14, "vision_output_dim": 48, "projector_input_dim": 48,
                      "projector_output_dim": 48}
TINY_MISTRAL_TEXT = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}
TINY_PIXTRAL = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "head_dim": 8, "image_size": 64, "patch_size": 8}

CONFIGS = {
    "gemma3-tiny": {"model_type": "gemma3", "text_config": TINY_GEMMA3_TEXT, "vision_config": TINY_SIGLIP,
                    "mm_tokens_per_image": 16},
    "gemma3-tiny-head": {"model_type": "gemma3", "text_config": TINY_GEMMA3_TEXT,
                         "vision_config": TINY_SIGLIP | {"vision_use_head": True}, "mm_tokens_per_image": 16},
    "gemma3-4b-real": {"model_type": "gemma3", "vision_config": GEMMA3_SIGLIP,
                       "text_config": load_catalogue()["gemma-3-4b"].config["text_config"]},
    # the catalogue's multimodal entries, with the vision_config of their published config.json
    "gemma3-4b-catalogue": dict(load_catalogue()["gemma-3-4b"].config),
    "gemma3-27b-catalogue": dict(load_catalogue()["gemma-3-27b"].config),
    "gemma3-27b-no-vision-config": {k: v for k, v in load_catalogue()["gemma-3-27b"].config.items()
                                    if k != "vision_config"},  # SiglipVisionConfig's defaults
    "llama4-tiny": {"model_type": "llama4", "text_config": TINY_LLAMA4_TEXT, "vision_config": TINY_LLAMA4_VISION},
    "llama4-scout-catalogue": dict(load_catalogue()["llama-4-scout"].config),
    "llama4-scout-no-vision-config": {k: v for k, v in load_catalogue()["llama-4-scout"].config.items()
                                      if k != "vision_config"},  # Llama4VisionConfig's defaults
    "mistral3-tiny": {"model_type": "mistral3", "text_config": TINY_MISTRAL_TEXT, "vision_config": TINY_PIXTRAL},
    "mistral3-tiny-bias-layers": {"model_type": "mistral3", "text_config": TINY_MISTRAL_TEXT,
                                  "vision_config": TINY_PIXTRAL, "multimodal_projector_bias": True,
                                  "vision_feature_layer": [-1, -2], "spatial_merge_size": 4},
    "mistral3-default": {"model_type": "mistral3"},  # Mistral-Small-3.1 24B, text and Pixtral defaults
}


def _meta_model(config):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(config)
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return transformers.AutoModelForImageTextToText.from_config(hf)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_whole_multimodal_count_matches_transformers(name):
    config = CONFIGS[name]
    numels = [p.numel() for p in _meta_model(config).parameters()]
    arch = from_hf_config(config, include_vision=True)
    assert parameter_count(arch) == sum(numels)
    assert parameter_numels(arch) == numels  # DeepSpeed's flattening order: vision tower, projector, text
    text = from_hf_config(config)
    text_part = parameter_numels(arch)[len(arch.vision_numels):]
    # the text decoder unchanged, but for the LM head the whole model ties by the top-level flag
    untied_head = not text.tie_word_embeddings and arch.tie_word_embeddings
    assert text_part == (parameter_numels(text)[:-1] if untied_head else parameter_numels(text))
    assert untied_head == (config["model_type"] == "mistral3" and "tie_word_embeddings" not in config)
    assert vision_parameters(text) == 0 and vision_parameters(arch) > 0
    head = text.vocab_size * text.hidden_size if untied_head else 0
    assert active_parameter_count(arch) == active_parameter_count(text) - head  # a text token never meets it


def test_notes_say_what_was_counted_and_which_defaults():
    arch = from_hf_config(CONFIGS["gemma3-4b-real"], include_vision=True)
    counted = [n for n in arch.notes if "Gemma3ForConditionalGeneration is counted" in n]
    assert len(counted) == 1 and "image activations are not modelled" in counted[0] and "text_only" in counted[0]
    assert not any("not counted" in n or "are not (" in n for n in arch.notes)
    assert not any("no vision_config" in n for n in arch.notes)
    scout = from_hf_config(CONFIGS["llama4-scout-no-vision-config"], include_vision=True)
    assert any("no vision_config" in n and "Llama4VisionConfig" in n for n in scout.notes)
    assert any("vision tower and projector of the multimodal checkpoint are not" in n
               for n in from_hf_config(CONFIGS["gemma3-tiny"]).notes)


def test_text_only_models_and_bad_vision_configs_are_refused():
    with pytest.raises(PlannerError, match="include_vision: .*text-only model .*'llama'"):
        from_hf_config({"model_type": "llama"}, include_vision=True)
    with pytest.raises(PlannerError, match="include_vision: .*text-only model .*'gemma3_text'"):
        from_hf_config({"model_type": "gemma3_text"}, include_vision=True)
    with pytest.raises(PlannerError, match="vision_config.model_type 'clip_vision_model' is not supported for gemma3"):
        from_hf_config(CONFIGS["gemma3-tiny"] | {"vision_config": TINY_SIGLIP | {"model_type": "clip_vision_model"}},
                       include_vision=True)
    with pytest.raises(PlannerError, match="vision_config: hidden_size must be positive, got 0"):
        from_hf_config(CONFIGS["mistral3-tiny"] | {"vision_config": TINY_PIXTRAL | {"hidden_size": 0}},
                       include_vision=True)
    with pytest.raises(PlannerError, match="patch_size\\(128\\) exceeds image_size\\(64\\)"):
        from_hf_config(CONFIGS["gemma3-tiny"] | {"vision_config": TINY_SIGLIP | {"patch_size": 128}},
                       include_vision=True)


def test_the_dump_reads_back_with_the_vision_numels():
    from planner.model.architecture import Architecture

    arch = from_hf_config(CONFIGS["mistral3-tiny"], include_vision=True)
    assert Architecture.model_validate(arch.model_dump()) == arch
    assert "vision_numels" not in from_hf_config(CONFIGS["mistral3-tiny"]).model_dump()


def test_estimate_counts_the_vision_states_sharded_and_keeps_the_text_activations():
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    base = dict(model_config=CONFIGS["gemma3-4b-real"], strategy="zero3", gpus=8, seq_len=1024)
    text, whole = estimate(EstimateRequest(**base, text_only=True)), estimate(EstimateRequest(**base))
    vision = vision_parameters(from_hf_config(CONFIGS["gemma3-4b-real"], include_vision=True))
    assert whole.parameters == text.parameters + vision
    # ZeRO-3: 16-bit parameters and gradients, fp32 master and two AdamW moments, each 1/8
    assert whole.per_device.parameters_bytes - text.per_device.parameters_bytes == pytest.approx(2 * vision / 8, abs=16)
    assert whole.per_device.optimizer_states_bytes - text.per_device.optimizer_states_bytes == \
        pytest.approx(12 * vision / 8, abs=64)
    assert whole.per_device.activations_bytes == text.per_device.activations_bytes
    assert any("Gemma3ForConditionalGeneration is counted" in n for n in whole.notes)
    assert any("text decoder alone is counted" in n for n in text.notes)
    ddp = estimate(EstimateRequest(**base | {"strategy": "ddp"}))
    assert ddp.per_device.parameters_bytes == 2 * whole.parameters  # unsharded


# google/gemma-3-12b-it's config.json (text: 48 layers of 3840, 16/8 heads, inner 15360, sliding 1024, linear
# RoPE scaling 8; vision: the SigLIP-so400m of the 4B and 27B), the catalogue's gemma-3-12b entry
GEMMA3_12B = dict(load_catalogue()["gemma-3-12b"].config)


def test_the_default_counts_what_auto_model_for_causal_lm_builds():
    """transformers 5.25's AutoModelForCausalLM on gemma-3-12b-it's config builds
    Gemma3ForConditionalGeneration: 12,187,325,040 parameters, 11,766,034,176 of them the text
    decoder's (issue 21's figures); both pinned against transformers on the meta device."""
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(GEMMA3_12B)
    hf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(hf)
        text = transformers.AutoModelForCausalLM.from_config(hf.text_config)
    assert type(built).__name__ == "Gemma3ForConditionalGeneration"
    assert sum(p.numel() for p in built.parameters()) == 12_187_325_040
    assert sum(p.numel() for p in text.parameters()) == 11_766_034_176
    req = dict(model="gemma-3-12b", gpus=8, seq_len=1024)
    assert estimate(EstimateRequest(**req)).parameters == 12_187_325_040
    assert estimate(EstimateRequest(**req, text_only=True)).parameters == 11_766_034_176
    assert estimate(EstimateRequest(**req, include_vision=True)).parameters == 12_187_325_040
    # llama4: AutoModelForCausalLM builds Llama4ForCausalLM, the text decoder; include_vision the whole class
    scout = dict(model="llama-4-scout", gpus=8, seq_len=1024)
    with torch.device("meta"):
        fields = dict(load_catalogue()["llama-4-scout"].config)
        causal = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert type(causal).__name__ == "Llama4ForCausalLM"
    assert estimate(EstimateRequest(**scout)).parameters == sum(p.numel() for p in causal.parameters())
    assert estimate(EstimateRequest(**scout, include_vision=True)).parameters > sum(p.numel() for p in causal.parameters())


def test_multimodal_switch_refusals_name_the_field():
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    with pytest.raises(PlannerError, match="^include_vision: llama-3-8b is a text-only model"):
        estimate(EstimateRequest(model="llama-3-8b", include_vision=True))
    with pytest.raises(PlannerError, match="^include_vision: .* is only a parameter count"):
        estimate(EstimateRequest(params="7B", include_vision=True))
    with pytest.raises(PlannerError, match="^text_only: llama-3-8b is model_type 'llama', which has no vision tower"):
        estimate(EstimateRequest(model="llama-3-8b", text_only=True))
    with pytest.raises(PlannerError, match="^include_vision with text_only") as caught:
        estimate(EstimateRequest(model="gemma-3-4b", text_only=True, include_vision=True))
    assert caught.value.field == "text_only"
    with pytest.raises(PlannerError, match="^finetune=lora with the vision tower counted .* give text_only"):
        estimate(EstimateRequest(model="gemma-3-4b", finetune="lora", lora_targets="q_proj,v_proj"))


def catalogue_text(name):
    return parameter_count(from_hf_config(load_catalogue()[name].config))


def test_plan_counts_the_vision_tower_too():
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    req = dict(model_config=CONFIGS["mistral3-tiny"], gpu="h100-80gb", gpus=2, seq_len=256, global_batch=4)
    text, whole = plan(PlanRequest(**req, text_only=True)), plan(PlanRequest(**req))
    vision = vision_parameters(from_hf_config(CONFIGS["mistral3-tiny"], include_vision=True))
    head = 1000 * 64  # the whole mistral3 model ties its head (Mistral3Config's default)
    ddp = [{c.per_device.parameters_bytes for c in r.candidates if c.strategy == "ddp" and c.parallel.tp == 1}
           for r in (text, whole)]
    assert len(ddp[0]) == len(ddp[1]) == 1  # unsharded: the same on every ddp candidate
    assert ddp[1].pop() - ddp[0].pop() == 2 * (vision - head)
    assert any("Mistral3ForConditionalGeneration is counted" in n for n in whole.notes)
    assert not any("is counted (" in n for n in text.notes)


def test_cli_flags(capsys):
    import json

    from cli.main import main

    assert main(["estimate", "--model", "gemma-3-4b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = from_hf_config(load_catalogue()["gemma-3-4b"].config, include_vision=True)
    assert data["parameters"] == parameter_count(expected) > catalogue_text("gemma-3-4b")
    assert main(["estimate", "--model", "gemma-3-4b", "--text-only", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"] == catalogue_text("gemma-3-4b") and data["request"]["text_only"] is True
    assert main(["estimate", "--model", "llama-3-8b", "--include-vision"]) == 2
    assert "include_vision" in capsys.readouterr().err
    assert main(["estimate", "--model", "gemma-3-4b", "--include-vision", "--text-only"]) == 2
    assert "include_vision with text_only" in capsys.readouterr().err


def test_verify_takes_both_flags():
    """verify builds what the estimate counted (backend/train.py build_model: the whole class, or
    the text decoder with --text-only)."""
    import argparse

    from cli.main import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    flags = {cmd: {s for a in subs[cmd]._actions for s in a.option_strings} for cmd in ("estimate", "plan", "verify")}
    for cmd in ("estimate", "plan", "verify"):
        assert {"--include-vision", "--text-only"} <= flags[cmd]


# Published totals of the whole multimodal checkpoints (Hugging Face's safetensors parameter count on each
# model page: gemma-3-4b-it 4.3B, gemma-3-27b-it 27.4B; the exact figures are transformers' own, checked
# on the meta device above). Before the catalogue carried the real vision_config, the towers were
# transformers' class defaults: SigLIP-base (86M) for Gemma 3, and a default Llama4VisionConfig.
@pytest.mark.parametrize("name, total, tower", [
    ("gemma-3-4b", 4_300_079_472, 416_866_032),
    ("gemma-3-27b", 27_432_406_640, 416_866_032),
])
def test_catalogue_multimodal_entries_count_their_published_vision_tower(name, total, tower):
    from planner.model.catalogue import catalogue_model, with_vision

    model = with_vision(catalogue_model(name))
    assert model.parameters == total
    assert not any("no vision_config" in n for n in model.architecture.notes)
    assert any(f"the vision tower ({tower:,} parameters)" in n for n in model.architecture.notes)


def test_llama4_scout_counts_its_published_vision_tower():
    from planner.model.catalogue import catalogue_model, with_vision

    scout = with_vision(catalogue_model("llama-4-scout"))
    config = load_catalogue()["llama-4-scout"].config["vision_config"]
    # Llama-4-Scout-17B-16E's vision_config: 34 layers of 1408 wide, 336-pixel images in 14-pixel patches
    assert (config["hidden_size"], config["num_hidden_layers"], config["image_size"]) == (1408, 34, 336)
    assert not any("no vision_config" in n for n in scout.architecture.notes)
    h, inner, layers = 1408, 5632, 34
    layer = 4 * (h * h + h) + (inner * h + inner) + (h * inner + h) + 4 * h
    embeddings = h + ((336 // 14) ** 2 + 1) * h + h * 3 * 14 * 14 + 4 * h  # class, positions, patch linear, 2 norms
    adapter = 4096 * inner + 4096 * 4096  # vision_adapter fc1 (projector_input_dim x inner), fc2
    projector = 5120 * 4096  # multi_modal_projector.linear_1: vision_output_dim -> text hidden
    assert vision_parameters(scout.architecture) == embeddings + layers * layer + adapter + projector


def test_a_pipeline_trains_the_text_decoder():
    from planner.memory.orchestrator import estimate
    from planner.plan.search import plan
    from planner.schema import EstimateRequest, PlanRequest

    fields = dict(model="gemma-3-27b", strategy="fsdp", gpus=8, gpu="h100-80gb", pp=2, gradient_accumulation=4)
    with pytest.raises(PlannerError, match=r"^pp=2 with the vision tower counted .* give text_only") as caught:
        estimate(EstimateRequest(**fields))
    assert caught.value.field == "text_only"
    assert estimate(EstimateRequest(**fields, text_only=True)).parameters == catalogue_text("gemma-3-27b")
    result = plan(PlanRequest(model="gemma-3-27b", gpus=8, nodes=2, gpu="h100-80gb", seq_len=4096, global_batch=64))
    assert result.candidates and all(c.parallel.pp == 1 for c in result.candidates)
