"""The `planner` CLI: its public flags and JSON fields are frozen; bad input is one line, exit 2."""

import json

import pytest

from cli.main import main

ESTIMATE_FIELDS = {"parameters", "model", "strategy", "world_size", "dp_size", "shard_size", "parallel", "gpu", "per_device",
                   "host", "nvme_bytes", "device_capacity_bytes", "fits", "headroom_bytes", "phases", "buffers",
                   "notes", "request", "time", "trainable_parameters",
                   "allocator"}  # issue 24
PER_DEVICE_FIELDS = {"parameters_bytes", "gradients_bytes", "optimizer_states_bytes", "activations_bytes",
                     "buffers_bytes", "framework_bytes", "resident_bytes", "peak_bytes", "peak_phase",
                     "frozen_weights_bytes", "at_peak",
                     "reserved_peak_bytes", "cuda_context_bytes", "nccl_bytes"}  # issue 24
HOST_FIELDS = {"resident_bytes", "peak_bytes", "pinned_bytes", "capacity_bytes", "fits"}
ESTIMATE_FLAGS = {"--compile", "--fused-kernels", "--model", "--model-file", "--params", "--strategy", "--gpus", "--nodes", "--gpu",
                  "--device-memory-gib", "--host-memory-gib", "--precision", "--optimizer", "--optimizer-in-backward", "--micro-batch", "--seq-len",
                  "--gradient-accumulation", "--checkpointing", "--attention", "--attention-kernel", "--attention-unpad", "--offload-optimizer",
                  "--offload-params", "--hsdp-shard-size", "--ds-config", "--reduce-bucket-size", "--allgather-bucket-size",
                  "--prefetch-bucket-size", "--param-persistence-threshold", "--max-live-parameters",
                  "--max-reuse-distance", "--topology", "--topology-file", "--fabric", "--nics-per-node", "--profile",
                  "--include-vision", "--text-only", "--activation-offload", "--tp", "--pp", "--cp", "--ep", "--pp-schedule", "--pp-virtual-stages", "--pp-first-stage-layers", "--pp-last-stage-layers",
                  "--sequence-parallel", "--async-tp", "--defer-gradient-sync", "--reduce-dtype", "--fsdp-version", "--json", "--emit", "--script",
                  # LoRA / QLoRA (issue 13)
                  "--finetune", "--lora-rank", "--lora-alpha", "--lora-targets", "--lora-dropout", "--quantize-base",
                  "--train-embeddings",
                  # the caching allocator and NCCL (issue 24)
                  "--alloc-conf", "--nccl-buffsize-bytes",
                  # job files (issue 23)
                  "--from",
                  # the recipes as they are run (issue 21)
                  "--keeps-outputs", "--train-metrics", "--double-quant", "--checkpointing-every", "--loss", "--loss-chunks", "--tp-plan", "--low-precision", "--float8-all-gather",
                  # the framework version a strategy is modelled at (issue 20)
                  "--framework-version",
                  # the step time's gradient clipping (issue 22)
                  "--gradient-clipping"}


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_flags_are_frozen():
    from cli.main import build_parser

    parser = build_parser()
    estimate = parser._subparsers._group_actions[0].choices["estimate"]
    flags = {s for a in estimate._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert flags == ESTIMATE_FLAGS


def test_estimate_json_fields_are_frozen(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--gpus", "8", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == ESTIMATE_FIELDS
    assert set(data["per_device"]) == PER_DEVICE_FIELDS
    assert set(data["host"]) == HOST_FIELDS
    assert data["parameters"] == 8_030_261_248
    assert all(isinstance(data["per_device"][k], int) for k in PER_DEVICE_FIELDS - {"peak_phase", "at_peak"})
    d = data["per_device"]
    assert d["peak_bytes"] >= d["resident_bytes"] > 0
    assert data["notes"] and all(isinstance(n, str) for n in data["notes"])


def test_estimate_table_labels_units_and_verdict(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "mistral-7b-v0.1", "--strategy", "ddp", "--precision",
                       "bf16-pure", "--gpu", "a100-80gb")
    assert code == 0
    assert "GiB" in out and "GB" in out
    assert "DOES NOT FIT" in out and "headroom" in out


def test_models_json_lists_every_entry(capsys):
    code, out, _ = run(capsys, "models", "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) >= 15
    mistral = next(r for r in rows if r["name"] == "mistral-7b-v0.1")
    assert mistral["parameters"] == 7_241_732_096 and mistral["config"]["model_type"] == "mistral"


def test_model_file_accepts_hf_config_json_and_yaml(capsys, tmp_path):
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
                              "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                              "_name_or_path": "meta-llama/Llama-3.2-1B", "architectures": ["LlamaForCausalLM"]}))
    code, out, _ = run(capsys, "estimate", "--model-file", str(hf), "--json")
    assert code == 0 and json.loads(out)["parameters"] == 1_235_814_400
    yml = tmp_path / "mine.yaml"
    yml.write_text("name: tiny\nconfig:\n  model_type: gpt2\n  n_embd: 64\n  n_layer: 2\n  n_head: 4\n  vocab_size: 100\n")
    code, out, _ = run(capsys, "estimate", "--model-file", str(yml), "--json")
    assert code == 0 and json.loads(out)["model"]["name"] == "tiny"


def test_params_only_reports_activations_unknown(capsys):
    code, out, _ = run(capsys, "estimate", "--params", "1000000000", "--strategy", "zero2", "--gpus", "4", "--json")
    assert code == 0 and json.loads(out)["per_device"]["activations_bytes"] is None


def test_ds_config_sets_stage_buckets_and_offload(capsys, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000000,
                                                     "offload_optimizer": {"device": "cpu", "pin_memory": True}}}))
    code, out, _ = run(capsys, "estimate", "--model", "llama-3-8b", "--strategy", "zero2", "--gpus", "8",
                       "--ds-config", str(cfg), "--json")
    data = json.loads(out)
    assert code == 0
    assert data["per_device"]["optimizer_states_bytes"] == 0  # offloaded
    assert data["host"]["resident_bytes"] > 0 and data["host"]["pinned_bytes"] > 0
    assert any(b["name"].startswith("ipg reduce bucket (1,000,000") for b in data["buffers"])
    # an explicit flag wins over the file
    code, out, _ = run(capsys, "estimate", "--model", "llama-3-8b", "--strategy", "zero2", "--gpus", "8",
                       "--ds-config", str(cfg), "--reduce-bucket-size", "3000000", "--json")
    assert any(b["name"].startswith("ipg reduce bucket (3,000,000") for b in json.loads(out)["buffers"])


BAD = [
    (["estimate", "--model", "llama-9"], "unknown model 'llama-9'"),
    (["estimate", "--model", "gpt2", "--gpus", "0"], "--gpus: got 0"),
    (["estimate", "--model", "gpt2", "--gpus", "-3"], "--gpus: got -3"),
    (["estimate", "--model", "gpt2", "--seq-len", "99999999999"], "--seq-len"),
    (["estimate", "--model", "gpt2", "--micro-batch", "4096", "--seq-len", "1000000"], "exceeds"),
    (["estimate", "--model", "gpt2", "--strategy", "zero9"], "invalid choice: 'zero9'"),
    (["estimate", "--model", "gpt2", "--gpus", "two"], "invalid int value: 'two'"),
    (["estimate", "--params", "0"], "--params: got '0'"),
    (["estimate", "--model", "gpt2", "--params", "10"], "give exactly one of"),
    (["estimate"], "give exactly one of"),
    (["estimate", "--model", "gpt2", "--gpu", "tpu-v5"], "unknown gpu 'tpu-v5'"),
    (["estimate", "--model", "gpt2", "--gpu", "v100-32gb"], "does not support"),
    (["estimate", "--model", "gpt2", "--strategy", "ddp", "--offload-optimizer", "cpu"], "offload_optimizer=cpu"),
    (["estimate", "--model", "gpt2", "--strategy", "hsdp"], "single shard group (all 8 GPUs) is fsdp"),
    (["estimate", "--model", "gpt2", "--strategy", "hsdp", "--gpus", "8", "--hsdp-shard-size", "3"],
     "hsdp_shard_size(3) must divide the world size"),
    (["estimate", "--model", "gpt2", "--strategy", "zero3", "--gpus", "8", "--hsdp-shard-size", "2"],
     "applies to hsdp only"),
    (["estimate", "--model", "gpt2", "--strategy", "zero2", "--precision", "bf16-pure"], "bf16-pure"),
    (["estimate", "--model-file", "/no/such/file.json"], "cannot be read"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("content,message", [
    ("{not json", "malformed YAML/JSON at line 1"),
    ('{"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 30}', "not divisible by num_attention_heads(30)"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_model_files(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, err = run(capsys, "estimate", "--model-file", str(path))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("config,message", [
    ({"zero_optimization": {"stage": 5}}, "stage must be 0, 1, 2 or 3, got 5"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}}, "unknown key 'reduce_bucket_sise'"),
    ({"zero_optimisation": {}}, "unknown key 'zero_optimisation'"),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}, "offload_param needs stage 3"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}, "reduce_bucket_size must be at least 1"),
    ({"zero_optimization": {"stage": 3}}, "contradicts ds_config zero_optimization.stage(3)"),
])
def test_bad_ds_configs(capsys, tmp_path, config, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--strategy", "zero2", "--ds-config", str(path))
    assert code == 2 and message in err, err


def _seconds(text: str, what: str) -> float:
    import re

    return float(re.search(rf"{what} ([0-9.]+) s", text).group(1))


def test_estimate_describes_the_network(capsys):
    argv = ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--nodes", "2", "--nics-per-node", "1"]
    _, slow, _ = run(capsys, *argv, "--fabric", "eth-25g")
    _, fast, _ = run(capsys, *argv, "--fabric", "ib-ndr")
    assert _seconds(slow, "communication") > 10 * _seconds(fast, "communication")
    code, out, _ = run(capsys, *argv, "--fabric", "ib-ndr", "--json")
    assert code == 0 and json.loads(out)["request"]["fabric"] == "ib-ndr"


def test_params_alone_says_the_buffers_assume_the_whole_model(capsys):
    code, out, _ = run(capsys, "estimate", "--params", "7000000000", "--strategy", "zero3")
    assert code == 0
    assert "gathered 16-bit parameters" in out and "13.04 GiB" in out  # 7e9 x 2 bytes, gathered at once
    assert "--params gives no layer sizes, so the model is taken as ONE tensor" in out
    code, out, _ = run(capsys, "estimate", "--model", "llama-3-8b", "--strategy", "zero3")
    assert "ONE tensor" not in out and "at the peak (start of backward), by item" in out


def test_a_long_item_name_wraps_and_its_figures_stay_in_their_column(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "qwen3-30b-a3b", "--strategy", "fsdp", "--ep", "8",
                       "--gpus", "8", "--gpu", "h100-80gb")
    items = out.split("by item\n")[1].split("\n\n")[0].splitlines()
    with_figures = [line for line in items if line.endswith(" GB")]
    assert code == 0 and len(with_figures) >= 5 and len(items) > len(with_figures)  # some names wrapped
    assert len({line.index(" GiB") for line in with_figures}) == 1
    assert max(map(len, items)) <= 4 + 54 + 30
    assert any("expert-data-parallel group (ep 8)" in line for line in items)  # wrapped whole, not at a hyphen


@pytest.mark.parametrize("nodes", ["1", "2"])
def test_plan_on_one_gpu_per_node_has_no_ring_and_no_traceback(capsys, nodes):
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--gpus", "1", "--nodes", nodes, "--global-batch", "8")
    assert code == 0 and err == "" and "one GPU per node, no ring" in out


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_an_unknown_fabric_is_one_line(capsys, command):
    code, out, err = run(capsys, command, "--model", "gpt2", "--nodes", "2", "--fabric", "ib-nd")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--fabric: got 'ib-nd': unknown fabric 'ib-nd' (did you mean ib-ndr" in err
