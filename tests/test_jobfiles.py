"""Job files in (issue 23): the projects' published Llama-3-8B configs read and answered, one job
in two formats answered alike, emitted files loaded back by their own project's loader, bad files
named by file, line and key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from planner.check import check, job_request
from planner.errors import PlannerError
from planner.jobfiles.job import read_job
from planner.jobfiles.keys import schema_accepts
from planner.jobfiles.write import emit
from planner.schema import CheckRequest
from planner.time.step import estimate_with_time

FIXTURES = Path(__file__).parent / "fixtures" / "jobfiles"


def _file(path: Path) -> dict[str, str]:
    return {"name": path.name, "text": path.read_text()}


def _body(*paths: Path, **cluster) -> CheckRequest:
    return CheckRequest(files=[_file(p) for p in paths], **cluster)


def _trl_accelerate(name: str) -> Path:
    trl = pytest.importorskip("trl")
    return Path(trl.__file__).parent / "accelerate_configs" / name


@pytest.mark.parametrize("paths", [
    ("llamafactory/llama3_lora_sft.yaml",),
    ("llamafactory/llama3_full_sft.yaml", "llamafactory/ds_z3_config.json"),
    ("trl/example_config.yaml",),
])
def test_published_examples_are_answered(paths):
    result = check(_body(*(FIXTURES / p for p in paths)), estimate_with_time)
    assert result.fits and result.peak_bytes > 8 * 10**9 and result.step_seconds > 0
    assert result.unknown_keys == []


@pytest.mark.parametrize("accelerate", ["multi_gpu.yaml", "zero1.yaml", "zero2.yaml", "zero3.yaml", "fsdp2.yaml"])
def test_trl_shipped_accelerate_configs_with_the_trl_example(accelerate):
    result = check(_body(_trl_accelerate(accelerate), FIXTURES / "trl/example_config.yaml"), estimate_with_time)
    assert [kind for _, kind in result.formats] == ["accelerate", "trl-sft"]
    expected = {"multi_gpu.yaml": "ddp", "zero1.yaml": "zero1", "zero2.yaml": "zero2", "zero3.yaml": "zero3",
                "fsdp2.yaml": "fsdp"}[accelerate]
    assert result.request.strategy == expected
    assert result.request.model == "Qwen/Qwen2.5-0.5B" and result.request.seq_len == 1024  # SFTConfig's default


def test_trl_fsdp1_config_is_answered_as_torch_fsdp_and_said_so():
    """TRL's fsdp1.yaml (FULL_SHARD, BACKWARD_PRE, forward_prefetch, use_orig_params) is the job of
    its fsdp2.yaml written for FSDP1: the same memory, with the note that FSDP1 is estimated with
    FSDP2's per-unit model, and a shorter step (no FSDP2 copies on the compute stream)."""
    one = check(_body(_trl_accelerate("fsdp1.yaml"), FIXTURES / "trl/example_config.yaml"), estimate_with_time)
    two = check(_body(_trl_accelerate("fsdp2.yaml"), FIXTURES / "trl/example_config.yaml"), estimate_with_time)
    assert (one.request.fsdp_version, two.request.fsdp_version) == (1, 2)
    assert one.request.model_copy(update={"fsdp_version": 2}) == two.request
    assert one.request.strategy == "fsdp" and one.unknown_keys == []
    assert one.peak_bytes == two.peak_bytes and one.step_seconds < two.step_seconds
    assert any("fsdp1.yaml:" in n and "FSDP2's per-unit model" in n for n in one.notes)
    assert not any("FSDP2's per-unit model" in n for n in two.notes)


def test_fsdp_forward_prefetch_is_refused_under_fsdp2_and_a_bad_prefetch_named():
    text = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_forward_prefetch: true\n"
    with pytest.raises(PlannerError, match=r"acc.yaml:4: fsdp_config\.fsdp_forward_prefetch"):
        read_job([("acc.yaml", text), ("sft.json", json.dumps({"model_name_or_path": "x", "output_dir": "o"}))], 8)
    text = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n  fsdp_backward_prefetch: SOMETIMES\n"
    with pytest.raises(PlannerError, match=r"acc.yaml:4: fsdp_config\.fsdp_backward_prefetch: \('SOMETIMES'\)"):
        read_job([("acc.yaml", text)], 8)
    text = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n"
    with pytest.raises(PlannerError, match=r"fsdp_version: \(3\) must be 1 or 2"):
        read_job([("acc.yaml", text)], 8)


def test_torchtitan_llama3_8b_toml():
    body = _body(FIXTURES / "torchtitan/llama3_8b.toml", gpus=8, nodes=8)  # its preset: 64 A100s
    if not schema_accepts("checkpointing", "selective-op"):
        with pytest.raises(PlannerError, match=r"llama3_8b.toml:58: activation_checkpoint.mode: .*selective-op"):
            check(body, estimate_with_time)
    body = body.model_copy(update={"overrides": {"activation_checkpoint.mode": "full"}})
    result = check(body, estimate_with_time)
    request = result.request
    assert (request.model, request.strategy, request.micro_batch, request.seq_len) == ("llama-3.1-8b", "fsdp", 1, 8192)
    assert request.reduce_dtype == "fp32" and request.checkpointing == "full"
    assert result.steps == 1000 and result.wall_seconds == pytest.approx(1000 * result.step_seconds)


def test_torchtitan_launch_reads_the_registry_and_overrides():
    launch = "torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_8b " \
             "--training.local_batch_size 2 --training.steps 50 activation-checkpoint:full"
    body = CheckRequest(files=[{"name": "run.sh", "text": launch}], overrides=None)
    job = read_job([("run.sh", launch.replace("activation-checkpoint:full", "activation-checkpoint:none"))], 8,
                   {"loss.chunked": "false"})
    assert (job.fields["checkpointing"], job.fields["micro_batch"], job.steps) == ("none", 2, 50)
    assert job.fields["model"] == "llama-3.1-8b" and job.fields["strategy"] == "fsdp"
    if not schema_accepts("loss", "chunked"):
        with pytest.raises(PlannerError, match="loss.chunked|ChunkedLossWrapper"):
            check(body, estimate_with_time)
        return
    result = check(body, estimate_with_time)
    assert result.request.micro_batch == 2 and result.steps == 50


def test_axolotl_lora_8b_is_read():
    job, request = job_request(_body(FIXTURES / "axolotl/lora-8b.yml", gpus=1))
    assert (request.model, request.finetune, request.quantize_base) == ("NousResearch/Meta-Llama-3-8B", "qlora", "int8")
    assert (request.lora_rank, request.lora_targets, request.train_embeddings) == (32, "all-linear", True)
    assert (request.micro_batch, request.gradient_accumulation, request.seq_len) == (2, 4, 4096)
    assert request.optimizer == "adamw-8bit" and request.checkpointing == "full" and job.epochs == 4
    assert job.origin["seq_len"].startswith("lora-8b.yml:18 sequence_len")


@pytest.mark.parametrize("example", ["lora-8b.yml", "qlora.yml"])
@pytest.mark.parametrize("deepspeed", ["zero1.json", "zero2.json"])
def test_axolotl_examples_with_axolotls_deepspeed_configs_are_answered(example, deepspeed):
    body = _body(FIXTURES / "axolotl" / example, FIXTURES / "axolotl" / deepspeed, gpus=2,
                 overrides={"deepspeed": f"deepspeed_configs/{deepspeed}"})
    result = check(body, estimate_with_time)
    assert result.fits and result.request.strategy == f"zero{deepspeed[4]}" and result.request.finetune == "qlora"
    assert result.request.ds_config["bf16"]["enabled"] is True  # "auto", filled from the file's bf16: auto
    assert result.unknown_keys == []


def test_axolotl_int8_example_on_one_gpu_is_answered_as_single():
    """Without a DeepSpeed config one process runs the bare module (no DDP), and LoRA on its LLM.int8
    base under autocast is modelled (planner/recipes/finetune.py; tests/real_runs.py llama-int8-lora-*)."""
    result = check(_body(FIXTURES / "axolotl/lora-8b.yml", gpus=1), estimate_with_time)
    assert result.request.strategy == "single" and result.request.quantize_base == "int8"
    assert result.request.checkpointing == "full" and result.request.train_embeddings
    assert result.fits and result.peak_bytes > 8 * 10**9 and result.unknown_keys == []
    two = check(_body(FIXTURES / "axolotl/lora-8b.yml", gpus=2), estimate_with_time)
    assert two.request.strategy == "ddp" and two.peak_bytes > result.peak_bytes  # DDP's buckets


def test_axolotl_fft_8b_paged_8bit_waits_for_its_optimizer():
    body = _body(FIXTURES / "axolotl/fft-8b.yaml")
    if schema_accepts("optimizer", "adamw-paged-8bit"):
        assert check(body, estimate_with_time).request.optimizer == "adamw-paged-8bit"
    else:
        with pytest.raises(PlannerError, match=r"fft-8b.yaml:25: optimizer: .*adamw-paged-8bit"):
            job_request(body)


def test_the_same_job_in_two_formats_gives_the_same_answer():
    trl_job = {"model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct", "per_device_train_batch_size": 1,
               "gradient_accumulation_steps": 8, "bf16": True, "max_length": 2048, "use_peft": True, "lora_r": 8,
               "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": "all-linear",
               "gradient_checkpointing": True, "num_train_epochs": 3.0, "output_dir": "out"}
    trl = CheckRequest(files=[{"name": "sft.json", "text": json.dumps(trl_job)}])
    factory = _body(FIXTURES / "llamafactory/llama3_lora_sft.yaml")
    a, b = check(trl, estimate_with_time), check(factory, estimate_with_time)
    assert a.request == b.request
    assert (a.peak_bytes, a.step_seconds) == (b.peak_bytes, b.step_seconds)


def test_axolotls_int8_lora_and_the_same_job_as_trl_give_the_same_answer():
    """Axolotl's lora-8b.yml (an LLM.int8 base, LoRA r 32 on every linear, embed_tokens and lm_head
    trained, checkpointed, on one GPU) and the same job as a TRL SFTConfig + ModelConfig."""
    trl_job = {"model_name_or_path": "NousResearch/Meta-Llama-3-8B", "load_in_8bit": True, "use_peft": True,
               "lora_r": 32, "lora_alpha": 16, "lora_dropout": 0.05, "lora_target_modules": "all-linear",
               "lora_modules_to_save": ["embed_tokens", "lm_head"], "per_device_train_batch_size": 2,
               "gradient_accumulation_steps": 4, "max_length": 4096, "packing": True, "num_train_epochs": 4,
               "bf16": True, "gradient_checkpointing": True, "optim": "adamw_bnb_8bit",
               "attn_implementation": "flash_attention_2", "output_dir": "out"}
    trl = CheckRequest(files=[{"name": "sft.json", "text": json.dumps(trl_job)}], gpus=1)
    a, b = check(trl, estimate_with_time), check(_body(FIXTURES / "axolotl/lora-8b.yml", gpus=1), estimate_with_time)
    assert a.request == b.request and a.request.quantize_base == "int8" and a.request.strategy == "single"
    assert (a.peak_bytes, a.step_seconds) == (b.peak_bytes, b.step_seconds)


def test_flash_attention_3_is_timed_at_its_own_rates_and_refused_off_hopper():
    """attn_implementation flash_attention_3 runs flash-attn's Hopper kernel: attention_kernel
    flash-attention-3 (its FlashAttention-3 paper rates), faster than flash_attention_2's on H100;
    the same job on an A100, where no rate of it is measured, is refused with the field."""
    job = {"model_name_or_path": "NousResearch/Meta-Llama-3-8B", "use_peft": True, "lora_r": 16,
           "per_device_train_batch_size": 1, "max_length": 8192, "bf16": True, "output_dir": "out"}

    def checked(implementation: str, gpu: str):
        text = json.dumps({**job, "attn_implementation": implementation})
        return check(CheckRequest(files=[{"name": "sft.json", "text": text}], gpus=1, gpu=gpu), estimate_with_time)

    fa3, fa2 = checked("flash_attention_3", "h100-80gb"), checked("flash_attention_2", "h100-80gb")
    assert (fa3.request.attention_kernel, fa2.request.attention_kernel) == ("flash-attention-3", "flash-attention-2")
    assert fa3.request.attention == fa2.request.attention == "sdpa" and fa3.peak_bytes == fa2.peak_bytes
    assert fa3.step_seconds < fa2.step_seconds
    assert checked("kernels-community/vllm-flash-attn3", "h100-80gb").request.attention_kernel == "flash-attention-3"
    with pytest.raises(PlannerError, match="attention_kernel 'flash-attention-3'"):
        checked("flash_attention_3", "a100-80gb")


def test_emitted_trl_and_accelerate_files_load_in_their_own_loaders(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig
    from transformers import HfArgumentParser

    trl = pytest.importorskip("trl")
    body = _body(_trl_accelerate("multi_gpu.yaml"), FIXTURES / "trl/example_config.yaml")
    job, _ = job_request(body)
    texts = emit(job, {"nodes": 2, "micro_batch": 4, "gradient_accumulation": 2}, {"gpus": 8})
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    cluster = ClusterConfig.from_yaml_file(str(tmp_path / "multi_gpu.yaml"))
    assert (cluster.num_machines, cluster.num_processes) == (2, 16)
    sft, model, script = HfArgumentParser((trl.SFTConfig, trl.ModelConfig, trl.ScriptArguments)).parse_yaml_file(
        _with_output_dir(tmp_path / "example_config.yaml"))
    assert (sft.per_device_train_batch_size, sft.gradient_accumulation_steps) == (4, 2)
    assert model.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    again = check(CheckRequest(files=[_file(tmp_path / "multi_gpu.yaml"), _file(tmp_path / "example_config.yaml")],
                               nodes=2), estimate_with_time)
    assert (again.request.micro_batch, again.request.nodes) == (4, 2)


def _with_output_dir(path: Path) -> str:
    """TRL's CLI gives output_dir on the command line (`--output_dir test-sft`, as the example's
    comment says); the parser of a file alone needs it in the file. TrainingArguments refuses bf16
    on a machine without a bf16 GPU unless use_cpu (this test machine): added to the copy only."""
    data = yaml.safe_load(path.read_text())
    data.setdefault("output_dir", "test-sft")
    data["use_cpu"] = True
    target = path.with_name("with_output_dir.yaml")
    target.write_text(yaml.safe_dump(data))
    return str(target)


def test_emitted_torchtitan_toml_parses_and_reads_back():
    import tomllib

    job, _ = job_request(_body(FIXTURES / "torchtitan/llama3_8b.toml", overrides={"activation_checkpoint.mode": "full"}))
    text = emit(job, {"micro_batch": 2, "checkpointing": "none"}, {"gpus": 8})["llama3_8b.toml"]
    data = tomllib.loads(text)
    assert data["training"]["local_batch_size"] == 2 and data["activation_checkpoint"]["mode"] == "none"
    assert read_job([("llama3_8b.toml", text)], 8).fields["micro_batch"] == 2
    # micro-batch 1 x accumulation 4 over 8 ranks: torchtitan's global_batch_size 32 says the accumulation
    text = emit(job, {"micro_batch": 1, "gradient_accumulation": 4}, {"gpus": 8, "micro_batch": 1})["llama3_8b.toml"]
    assert tomllib.loads(text)["training"]["global_batch_size"] == 32
    fields = read_job([("llama3_8b.toml", text)], 8).fields
    assert (fields["micro_batch"], fields["gradient_accumulation"]) == (1, 4)


@pytest.mark.parametrize("name,text,message", [
    ("deploy.yaml", "apiVersion: v1\nkind: Pod\n", "Kubernetes manifest"),
    ("config.json", json.dumps({"model_type": "llama", "hidden_size": 8}), "only a model config.json"),
    ("bad.yaml", "base_model: x\n  micro_batch_size: [\n", r"bad.yaml:\d+: not valid YAML"),
    ("bad.toml", "[training]\nseq_len = \n", r"bad.toml: not valid TOML.*line 2"),
    ("a.yaml", "base_model: NousResearch/Meta-Llama-3-8B\nmicro_batch_size: two\n",
     r"a.yaml:2: micro_batch_size: must be a whole number"),
    ("a.yaml", "base_model: NousResearch/Meta-Llama-3-8B\ntorch_compile: true\ntorch_compile_mode: max-autotune\n",
     r"a.yaml:3: torch_compile_mode"),
    ("ds.json", json.dumps({"zero_optimization": {"stage": 3}}) + "\n", "do not name the model.*give --model"),
    ("config_registry.py", "def llama3_8b():\n    return Trainer.Config()\n", "Python file is not read.*launch line"),
    ("run.sh", "torchrun -m torchtitan.train --module llama3 --config llama3_405b_custom\n",
     r"run.sh:1: config: \(llama3.llama3_405b_custom\) is not a torchtitan 0.3 config function read here"),
])
def test_bad_files_are_named(name, text, message):
    with pytest.raises(PlannerError, match=message):
        check(CheckRequest(files=[{"name": name, "text": text}]), estimate_with_time)


def test_unknown_keys_are_listed_not_dropped():
    text = (FIXTURES / "axolotl/lora-8b.yml").read_text() + "\nmy_new_knob: 3\n"
    job = read_job([("lora-8b.yml", text)], 8)
    assert "lora-8b.yml: my_new_knob" in job.unknown


def test_a_named_deepspeed_file_must_be_given():
    with pytest.raises(PlannerError, match=r"llama3_full_sft.yaml:\d+: deepspeed: .*ds_z3_config.json.*give that"):
        read_job([("llama3_full_sft.yaml", (FIXTURES / "llamafactory/llama3_full_sft.yaml").read_text())], 8)


def test_deepspeed_auto_values_filled_as_the_trainer_fills_them():
    job = read_job([(p.name, p.read_text()) for p in (FIXTURES / "llamafactory/llama3_full_sft.yaml",
                                                        FIXTURES / "llamafactory/ds_z3_config.json")], 8)
    zero = job.fields["ds_config"]["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096 * 4096 and zero["stage3_param_persistence_threshold"] == 40960
    assert job.fields["ds_config"]["bf16"]["enabled"] is True and job.fields["ds_config"]["fp16"]["enabled"] is False


AXOLOTL_LORA = "base_model: NousResearch/Meta-Llama-3-8B\nadapter: lora\nsequence_len: 1024\n"


@pytest.mark.parametrize("name,text,clipping", [
    ("args.yaml", "per_device_train_batch_size: 2\n", True),  # TrainingArguments' max_grad_norm 1.0
    ("args.yaml", "per_device_train_batch_size: 2\nmax_grad_norm: 0\n", False),
    ("args.yaml", "per_device_train_batch_size: 2\nmax_grad_norm: 0.3\n", True),
    ("lora.yaml", AXOLOTL_LORA, True),
    ("lora.yaml", AXOLOTL_LORA + "max_grad_norm: null\n", True),  # axolotl passes only a value
    ("lora.yaml", AXOLOTL_LORA + "max_grad_norm: 0.0\n", False),
    ("job.toml", "[model]\nname = 'llama3'\nflavor = '8B'\n[training]\nseq_len = 2048\n", True),  # every step
    ("job.toml", "[model]\nname = 'llama3'\nflavor = '8B'\n[training]\nmax_norm = 0.5\n", True),
])
def test_gradient_clipping_is_read_from_each_format(name, text, clipping):
    job = read_job([(name, text)], 8)
    assert job.fields["gradient_clipping"] is clipping


@pytest.mark.parametrize("text,key", [
    ("per_device_train_batch_size: 2\nmax_grad_norm: strong\n", "max_grad_norm"),
    ("per_device_train_batch_size: 2\nmax_grad_norm: null\n", "max_grad_norm"),  # the Trainer's `> 0` fails
    ("per_device_train_batch_size: 2\nmax_grad_norm: .inf\n", "max_grad_norm"),
])
def test_a_bad_gradient_clipping_norm_is_named(text, key):
    with pytest.raises(PlannerError, match=rf"args.yaml:2: {key}: must be a"):
        read_job([("args.yaml", text)], 8)


def test_a_clipping_job_is_charged_the_clipping_passes():
    base = "model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct\nstage: sft\nfinetuning_type: full\nbf16: true\n"
    clipped = check(CheckRequest(files=[{"name": "sft.yaml", "text": base}]), estimate_with_time)
    unclipped = check(CheckRequest(files=[{"name": "sft.yaml", "text": base + "max_grad_norm: 0\n"}]),
                      estimate_with_time)
    assert clipped.peak_bytes == unclipped.peak_bytes and clipped.step_seconds > unclipped.step_seconds


def test_api_check_route():
    from fastapi.testclient import TestClient

    from web.app import create_app

    client = TestClient(create_app(db=os.devnull))
    text = (FIXTURES / "llamafactory/llama3_lora_sft.yaml").read_text()
    ok = client.post("/v1/check", json={"files": [{"name": "job.yaml", "text": text}], "gpus": 1})
    assert ok.status_code == 200 and ok.json()["fits"] is True and ok.json()["request"]["finetune"] == "lora"
    bad = client.post("/v1/check", json={"files": [{"name": "job.yaml", "text": text + "\nuse_unsloth: true\n"}]})
    assert bad.status_code == 422 and "job.yaml:" in bad.json()["detail"][0]["msg"]
    assert "use_unsloth" in bad.json()["detail"][0]["msg"]
    huge = client.post("/v1/check", json={"files": [{"name": "j.yaml", "text": "a: 1\n" * 100_000}]})
    assert huge.status_code == 413


ODD_VALUES = (None, -1, 0, "x", [1], {"a": 1}, 1e30, True, "auto")
READABLE = ("llamafactory/llama3_lora_sft.yaml", "axolotl/lora-8b.yml", "trl/example_config.yaml",
            "torchtitan/llama3_8b.toml")


@pytest.mark.parametrize("path", READABLE)
def test_any_value_of_any_key_is_read_or_refused_in_one_line(path):
    """Each key of a real file set to values of every type: the reader answers or refuses with a
    PlannerError (the CLI's exit 2, the API's 422), never another exception."""
    from planner.jobfiles.parse import parse_text

    source = FIXTURES / path
    data = parse_text(source.name, source.read_text())
    flat = [(f"{section}.{key}", None) for section, block in data.items() if isinstance(block, dict)
            for key in block] + [(key, None) for key, value in data.items() if not isinstance(value, dict)]
    for dotted, _ in flat:
        for value in ODD_VALUES:
            body = _body(source, overrides={dotted: value})
            try:
                job_request(body)
            except PlannerError as exc:
                assert "\n" not in str(exc) and exc.field


def test_every_training_arguments_and_trl_field_is_in_a_table():
    import dataclasses

    import transformers

    from planner.jobfiles.hf_trainer import TRAINING_ARGUMENTS, TRL

    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    assert fields - set(TRAINING_ARGUMENTS) == set()
    trl = pytest.importorskip("trl")
    own = {f.name for cls in (trl.SFTConfig, trl.ModelConfig, trl.ScriptArguments) for f in dataclasses.fields(cls)
           if f.init} - fields
    assert own - set(TRL) == set()


def test_every_accelerate_config_key_is_in_a_table():
    import dataclasses
    import inspect
    import re

    from accelerate.commands.config import cluster
    from accelerate.commands.config.config_args import ClusterConfig

    from planner.jobfiles.accelerate_config import DEEPSPEED, FSDP, TOP

    assert {f.name for f in dataclasses.fields(ClusterConfig)} - set(TOP) == set()
    source = inspect.getsource(cluster)  # the keys `accelerate config` writes into each section
    assert set(re.findall(r'deepspeed_config\["(\w+)"\]', source)) - set(DEEPSPEED) == set()
    assert set(re.findall(r'fsdp_config\["(\w+)"\]', source)) - set(FSDP) == set()


def test_docs_table_is_the_code_table():
    from planner.jobfiles.tables import markdown

    assert (Path(__file__).parent.parent / "docs" / "JOBFILES.md").read_text() == markdown()


def test_cli_check_and_from(capsys, tmp_path):
    from cli.main import main

    lora = str(FIXTURES / "llamafactory/llama3_lora_sft.yaml")
    assert main(["check", lora, "--gpus", "1", "--tokens", "10000000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == -(-10_000_000 // (1 * 8 * 2048)) and out["wall_seconds"] > 0
    assert main(["estimate", "--from", lora, "--gpus", "1", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["per_device"]["peak_bytes"] == out["peak_bytes"]
    assert main(["estimate", "--from", lora, "--gpus", "1", "--micro-batch", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["micro_batch"] == 2  # a flag wins over the file
    assert main(["plan", "--from", lora, "--gpus", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["global_batch"] == 8
    bad = tmp_path / "job.yaml"
    bad.write_text((FIXTURES / "llamafactory/llama3_lora_sft.yaml").read_text() + "use_unsloth: true\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}:47: use_unsloth" in err


def test_cli_emit_writes_the_change_in_the_files_format(capsys, tmp_path):
    from cli.main import main

    files = [str(FIXTURES / "llamafactory/llama3_full_sft.yaml"), str(FIXTURES / "llamafactory/ds_z3_config.json")]
    assert main(["check", *files, "--emit", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    written = yaml.safe_load((tmp_path / "llama3_full_sft.yaml").read_text())
    applied = next(c for c in result["changes"] if set(c["fields"]) <= {"micro_batch", "gradient_accumulation",
                                                                          "checkpointing"})
    again = check(CheckRequest(files=[_file(tmp_path / "llama3_full_sft.yaml"), _file(tmp_path / "ds_z3_config.json")]),
                  estimate_with_time)
    assert again.peak_bytes == applied["peak_bytes"]
    assert written["deepspeed"] == "examples/deepspeed/ds_z3_config.json"


def test_accelerate_inline_zero3_and_a_deepspeed_json_named_by_the_sft_config_agree():
    """accelerate's DeepSpeed section builds {stage, offloads, "auto" batch} (accelerate 1.16
    utils/dataclasses.py DeepSpeedPlugin); the same written as a DeepSpeed JSON that the SFT config
    names (`deepspeed:`) is the same job."""
    example = FIXTURES / "trl/example_config.yaml"
    inline = check(_body(_trl_accelerate("zero3.yaml"), example), estimate_with_time)
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
    named = check(CheckRequest(files=[_file(example), {"name": "ds.json", "text": json.dumps(ds)}],
                               overrides={"deepspeed": "configs/ds.json"}), estimate_with_time)
    assert inline.request.strategy == named.request.strategy == "zero3"
    assert (inline.peak_bytes, inline.peak_phase, inline.step_seconds) == (named.peak_bytes, named.peak_phase,
                                                                           named.step_seconds)


def test_training_arguments_need_the_model_and_the_length_the_script_gives():
    args = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": True, "max_steps": 100,
            "gradient_checkpointing": True, "optim": "adamw_torch_fused", "output_dir": "out"}
    files = [{"name": "args.json", "text": json.dumps(args)}]
    with pytest.raises(PlannerError, match="give --model"):
        check(CheckRequest(files=files), estimate_with_time)
    with pytest.raises(PlannerError, match="give --seq-len"):
        check(CheckRequest(files=files, model="llama-3-8b"), estimate_with_time)
    result = check(CheckRequest(files=files, model="llama-3-8b", seq_len=2048), estimate_with_time)
    assert [kind for _, kind in result.formats] == ["hf-trainer"]
    assert (result.request.micro_batch, result.request.precision, result.steps) == (4, "bf16-mixed", 100)
    assert result.origin["micro_batch"] == "args.json:1 per_device_train_batch_size"


@pytest.mark.parametrize("cls", ["TrainingArguments", "SFTConfig"])
def test_a_dump_written_by_the_projects_own_class_has_no_unknown_key(cls):
    """TrainingArguments.to_json_string() writes every field; each is in a table."""
    import transformers

    module = pytest.importorskip("trl") if cls == "SFTConfig" else transformers
    args = getattr(module, cls)(output_dir="out", use_cpu=True, per_device_train_batch_size=2, max_steps=10)
    data = json.loads(args.to_json_string()) | {"use_cpu": False}
    result = check(CheckRequest(files=[{"name": "args.json", "text": json.dumps(data)}], model="llama-3-8b",
                                seq_len=2048), estimate_with_time)
    assert result.unknown_keys == [] and result.request.micro_batch == 2 and result.steps == 10


def test_a_local_model_path_is_joined_to_the_config_json_given_beside_it():
    job_text = "base_model: ./models/tiny\nsequence_len: 512\nmicro_batch_size: 2\nbf16: true\n"
    config = (Path(__file__).parent.parent / "examples" / "tiny-llama.json").read_text()
    with pytest.raises(PlannerError, match=r"job.yml:1 base_model names a local model './models/tiny'; give its"):
        read_job([("job.yml", job_text)], 2)
    _, request = job_request(CheckRequest(files=[{"name": "job.yml", "text": job_text},
                                                 {"name": "config.json", "text": config}], gpus=2))
    assert request.model is None and request.model_config_["config"]["hidden_size"] == 256
    assert (request.seq_len, request.micro_batch, request.precision) == (512, 2, "bf16-pure")  # axolotl's full bf16


# axolotl's documented FSDP2 section (docs/multi-gpu.qmd at axolotl 067b021): keys without
# accelerate's fsdp_ prefix, which axolotl deprecates and strips (validation.py
# check_fsdp_config_kwargs_prefix)
AXOLOTL_FSDP2 = """base_model: NousResearch/Meta-Llama-3.1-8B
sequence_len: 4096
micro_batch_size: 1
gradient_accumulation_steps: 4
bf16: auto
flash_attention: true
fsdp_version: 2
fsdp_config:
  offload_params: false
  cpu_ram_efficient_loading: true
  auto_wrap_policy: TRANSFORMER_BASED_WRAP
  transformer_layer_cls_to_wrap: LlamaDecoderLayer
  state_dict_type: FULL_STATE_DICT
  reshard_after_forward: {reshard}
  activation_checkpointing: true
"""


def test_axolotl_fsdp_config_is_read_as_axolotl_writes_it():
    """Every key of axolotl's own FSDP2 example is read (none unknown): activation_checkpointing turns
    checkpointing on, reshard_after_forward false is SHARD_GRAD_OP; the prefixed spelling gives the
    same request, and a key set both ways is refused naming the one written second, at its line."""
    reading = read_job([("ax.yml", AXOLOTL_FSDP2.format(reshard="true"))], 8)
    assert reading.unknown == []
    request = reading.fields
    assert request["checkpointing"] == "full" and request["strategy"] == "fsdp"
    assert "ax.yml:15 fsdp_config.activation_checkpointing" in reading.origin["checkpointing"]
    assert read_job([("ax.yml", AXOLOTL_FSDP2.format(reshard="false"))], 8).fields["strategy"] == "fsdp-grad-op"
    prefixed = AXOLOTL_FSDP2.format(reshard="true").replace("  activation_checkpointing", "  fsdp_activation_checkpointing")
    assert read_job([("ax.yml", prefixed)], 8).fields == request
    both = AXOLOTL_FSDP2.format(reshard="true") + "  fsdp_reshard_after_forward: false\n"
    with pytest.raises(PlannerError, match=r"ax.yml:16: fsdp_config\.fsdp_reshard_after_forward: sets what "
                                           r"fsdp_config\.reshard_after_forward sets"):
        read_job([("ax.yml", both)], 8)
    wrap = AXOLOTL_FSDP2.format(reshard="true").replace("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP")
    with pytest.raises(PlannerError, match=r"ax.yml:11: fsdp_config\.auto_wrap_policy: \('SIZE_BASED_WRAP'\) is not "):
        read_job([("ax.yml", wrap)], 8)


# axolotl's FSDP1 examples (examples/dbrx/16bit-lora.yaml at 067b021): the option list with
# fsdp_config's prefixed keys, no fsdp_version (axolotl keeps FSDP1 then)
AXOLOTL_FSDP1 = """base_model: NousResearch/Meta-Llama-3.1-8B
sequence_len: 2048
micro_batch_size: 1
gradient_accumulation_steps: 1
bf16: auto
fsdp:
  - {word}
  - auto_wrap
fsdp_config:
  fsdp_sync_module_states: true
  fsdp_offload_params: false
  fsdp_use_orig_params: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_activation_checkpointing: true
"""


@pytest.mark.parametrize("word, strategy", [("full_shard", "fsdp"), ("shard_grad_op", "fsdp-grad-op"),
                                            ("hybrid_shard", "hsdp")])
def test_axolotl_fsdp1_option_list_is_read_as_transformers_reads_it(word, strategy):
    reading = read_job([("ax.yml", AXOLOTL_FSDP1.format(word=word))], 8)
    assert reading.fields["strategy"] == strategy and reading.fields["checkpointing"] == "full"
    assert reading.origin["strategy"] == "ax.yml:6 fsdp"  # the option word decided it
    assert any("FSDP2's per-unit model" in n for n in reading.notes)  # FSDP1, said so
    with pytest.raises(PlannerError, match=r"ax.yml:6: fsdp: \('no_shard'\) is not modelled"):
        read_job([("ax.yml", AXOLOTL_FSDP1.format(word="no_shard"))], 8)


def test_hf_trainer_fsdp_reads_fsdp_config_as_transformers_does():
    """transformers 5.25: fsdp_config's keys without the fsdp_ prefix (activation_checkpointing was
    ignored before), FSDP2 when no version is given, cpu_offload the offload; hybrid_shard is FSDP1
    only; a file path for fsdp_config is refused in one line."""
    sft = {"model_name_or_path": "Qwen/Qwen2.5-0.5B", "output_dir": "o", "fsdp": "full_shard auto_wrap",
           "fsdp_config": {"activation_checkpointing": True, "cpu_offload": True}}
    reading = read_job([("sft.json", json.dumps(sft))], 8)
    assert reading.fields["strategy"] == "fsdp" and reading.fields["checkpointing"] == "full"
    assert reading.fields["offload_params"] == "cpu" and reading.unknown == []
    assert not any("FSDP2's per-unit model" in n for n in reading.notes)  # FSDP2: transformers' default
    with pytest.raises(PlannerError, match=r"fsdp: \('hybrid_shard'\) is not modelled: .*FSDP1 only"):
        read_job([("sft.json", json.dumps(dict(sft, fsdp="hybrid_shard")))], 8)
    with pytest.raises(PlannerError, match=r"fsdp_config: \('fsdp.json'\) names a file"):
        read_job([("sft.json", json.dumps(dict(sft, fsdp_config="fsdp.json")))], 8)


def test_torchtitan_launch_of_the_70b_and_405b_registry_configs():
    """torchtitan 0.3.0's llama3_70b (TP 8, full AC, local batch 8) and llama3_405b (as 70B, local
    batch 2, a float8 converter, torch.compile of the blocks and the loss) are read."""
    job = read_job([("run.sh", "torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_70b")], 8)
    assert (job.fields["model"], job.fields["tp"], job.fields["checkpointing"], job.fields["micro_batch"],
            job.steps) == ("llama-3.1-70b", 8, "full", 8, 1000)
    launch = "torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_405b"
    job = read_job([("run.sh", launch)], 8)
    assert (job.fields["model"], job.fields["micro_batch"], job.fields["low_precision"], job.fields["compile"],
            job.steps) == ("llama-3.1-405b", 2, "float8-tensorwise", "blocks", 3000)
    assert job.fields["async_tp"] is True  # CompileConfig(enable_async_tensor_parallel=True)
    # torchtitan refuses async TP without compile (CompileConfig.__post_init__): so does the reader
    with pytest.raises(PlannerError, match=r"compile.enable_async_tensor_parallel: \(true\) needs compile.enable"):
        read_job([("run.sh", launch + " --compile.enable false")], 8)
    job = read_job([("run.sh", launch + " --compile.enable false --compile.enable_async_tensor_parallel false")], 8)
    assert "compile" not in job.fields and "async_tp" not in job.fields
    with pytest.raises(PlannerError, match=r"compile.components: \(model\): compile blocks models"):
        read_job([("run.sh", launch + " --compile.components model")], 8)


@pytest.mark.parametrize("name,text,compiled", [
    ("sft.json", json.dumps({"model_name_or_path": "Qwen/Qwen3-8B", "torch_compile": True}), "model"),
    ("sft.json", json.dumps({"model_name_or_path": "Qwen/Qwen3-8B", "torch_compile_backend": "inductor"}), "model"),
    ("sft.json", json.dumps({"model_name_or_path": "Qwen/Qwen3-8B", "torch_compile": False}), None),
    ("a.yaml", "base_model: NousResearch/Meta-Llama-3-8B\ntorch_compile: auto\n", "model"),
    ("a.yaml", "base_model: NousResearch/Meta-Llama-3-8B\ntorch_compile: false\n", None),
])
def test_torch_compile_keys_set_compile(name, text, compiled):
    """TrainingArguments' torch_compile (or a backend/mode, which turns it on) and axolotl's torch_compile
    (true or auto) compile the whole model: compile model."""
    job = read_job([(name, text)], 8)
    assert job.fields.get("compile") == compiled


@pytest.mark.parametrize("text,compiled,error", [
    ("dynamo_config:\n  dynamo_backend: INDUCTOR\n", "model", None),
    ("dynamo_config:\n  dynamo_backend: NO\n", None, None),
    ("dynamo_backend: inductor\n", "model", None),
    ("dynamo_config:\n  dynamo_backend: EAGER\n", None, "dynamo_backend: .*other than INDUCTOR"),
    ("dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n", None, "dynamo_mode"),
    ("dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_use_regional_compilation: true\n", None,
     "regional_compilation"),
])
def test_accelerate_dynamo_sets_compile(text, compiled, error):
    from planner.jobfiles import accelerate_config
    from planner.jobfiles.keys import Where

    data = yaml.safe_load("distributed_type: FSDP\n" + text)
    if error:
        with pytest.raises(PlannerError, match=error):
            accelerate_config.read(data, Where("acc.yaml", text))
        return
    reading = accelerate_config.read(data, Where("acc.yaml", text))
    assert reading.fields.get("compile") == compiled


def test_check_says_a_job_refused_on_its_reserved_peak(capsys, tmp_path):
    """LLaMA-Factory's qwen3 full SFT (examples/train_full/qwen3_full_sft.yaml at ff6d4d1, on Qwen3-8B) with
    its examples/accelerate/fsdp2_config.yaml on 2 H100s: the live peak is under the device, the
    reserved peak is not; the fits line gives both, and the JSON has reserved_peak_bytes."""
    from cli.main import main

    sft = tmp_path / "qwen3_full_sft.yaml"
    sft.write_text("model_name_or_path: Qwen/Qwen3-8B\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
                   "dataset: identity,alpaca_en_demo\ntemplate: qwen3_nothink\ncutoff_len: 2048\n"
                   "output_dir: saves/qwen3-8b/full/sft\nper_device_train_batch_size: 1\n"
                   "gradient_accumulation_steps: 2\nlearning_rate: 1.0e-5\nnum_train_epochs: 3.0\nbf16: true\n")
    accelerate = tmp_path / "fsdp2_config.yaml"
    accelerate.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                          "  fsdp_offload_params: false\n  fsdp_reshard_after_forward: true\n  fsdp_version: 2\n"
                          "mixed_precision: bf16\nnum_machines: 1\nnum_processes: 2\n")
    assert main(["check", str(sft), str(accelerate), "--gpus", "2", "--gpu", "h100-80gb", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert not result["fits"] and result["peak_bytes"] <= result["device_capacity_bytes"] < result["reserved_peak_bytes"]
    assert main(["check", str(sft), str(accelerate), "--gpus", "2", "--gpu", "h100-80gb"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("fits: NO  peak ") and f"reserved {result['reserved_peak_bytes'] / 2**30:.2f} GiB of" in line
