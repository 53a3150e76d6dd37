"""Every file `--emit` writes describes the planned layout and batch (issue 27, item 1).

Each file is read back with its own reader (accelerate's config loader, transformers'
HfArgumentParser, DeepSpeed's config class, PEFT's LoraConfig; torchtitan.toml by its TOML keys,
torchtitan itself needs another torch) and its degrees and global batch are compared with the
estimate's: the sequences per optimizer step are micro-batch x accumulation x the data-parallel
ranks (world / (tp x cp x pp)), whatever reads the file."""

import json
import re
import tomllib
from pathlib import Path

import pytest

from cli.main import main
from cli.files import write_files
from planner.plan.emit import emit_estimate_files
from planner.schema import EstimateRequest
from planner.time.step import estimate_with_time

LAYOUTS = {
    # the issue's plan: fsdp x tp 4 over 4 nodes of 8, 32 micro-batches per data-parallel rank
    "fsdp-tp4": dict(model="llama-3.1-70b", strategy="fsdp", nodes=4, tp=4, gradient_accumulation=32),
    "hsdp": dict(strategy="hsdp", nodes=2, gradient_accumulation=4),
    "fsdp-cp2": dict(strategy="fsdp", cp=2, gradient_accumulation=2, seq_len=8192),
    "fsdp-pp2": dict(strategy="fsdp", pp=2, gradient_accumulation=4),
    "ddp-tp2": dict(strategy="ddp", tp=2, gradient_accumulation=2),
    "zero3": dict(strategy="zero3", gradient_accumulation=4),
    "zero3-tp2": dict(strategy="zero3", tp=2, gradient_accumulation=4),
    "zero1-pp2": dict(strategy="zero1", pp=2, gradient_accumulation=4),
    "lora-zero2": dict(strategy="zero2", finetune="lora", lora_alpha=32, lora_rank=16, gradient_accumulation=2),
    "single": dict(strategy="single", gpus=1, gradient_accumulation=8),
}


def _emit(tmp_path: Path, **fields):
    kw = dict(model="llama-3.2-1b", gpu="h100-80gb", gpus=8, seq_len=2048)
    kw.update(fields)
    result = estimate_with_time(EstimateRequest(**kw))
    out = tmp_path / "emit"
    write_files(out, emit_estimate_files(result))
    return out, result


def _planned(result) -> tuple[dict[str, int], int]:
    p = result.parallel
    dims = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp, "cp": p.cp, "pp": p.pp, "ep": p.ep}
    req = result.request
    return dims, req.micro_batch * req.gradient_accumulation * p.dp_replicate * p.dp_shard


def _accelerate(out: Path, dims: dict, world: int):
    """accelerate's own loader; the ParallelismConfig a rank builds from it (None: plain DDP/FSDP/DeepSpeed)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.parallelism_config import ParallelismConfig

    config = load_config_from_file(str(out / "accelerate_config.yaml"))
    assert config.num_processes == world
    sizes = {k.removeprefix("parallelism_config_"): v for k, v in (config.parallelism_config or {}).items()}
    if not sizes:
        assert dims["tp"] * dims["cp"] * dims["pp"] == 1 or config.distributed_type.value == "DEEPSPEED"
        return config, None
    parallel = ParallelismConfig(**sizes)
    assert parallel.total_size == world
    assert (parallel.dp_replicate_size, parallel.dp_shard_size, parallel.tp_size, parallel.cp_size) == (
        dims["dp_replicate"], dims["dp_shard"], dims["tp"], dims["cp"])
    return config, parallel


def _trainer_batch(out: Path, tmp_path: Path, parallel, ds_tp: int, world: int) -> int:
    """The Trainer's own formula (transformers trainer.py get_total_train_batch_size):
    per-device batch x accumulation x world // tp // cp."""
    from transformers import HfArgumentParser, TrainingArguments

    given = json.loads((out / "trainer_args.json").read_text())
    if "deepspeed" in given:  # relative to the emitted directory, where the script is launched
        given["deepspeed"] = str(out / given["deepspeed"])
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(
        {**given, "output_dir": str(tmp_path / "o"), "use_cpu": True})
    tp = parallel.tp_size if parallel is not None else ds_tp
    cp = parallel.cp_size if parallel is not None else 1
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * (world // tp // cp)


def _deepspeed(out: Path, dims: dict, world: int) -> tuple[int, int]:
    """DeepSpeed's config class; its train_batch_size is checked against the world (0.19.8
    runtime/config.py), so the sequences per step are that over tp; for its pipeline engine,
    over the data-parallel ranks of the (pipe, data) grid."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = json.loads((out / "ds_config.json").read_text())
    total = config.pop("train_batch_size")  # outside a process group DeepSpeedConfig takes world size 1
    parsed = DeepSpeedConfig(config)
    tp = parsed.tensor_parallel_config.autotp_size if "tensor_parallel" in config else 1
    assert tp == dims["tp"]
    ranks = world // dims["pp"] if dims["pp"] > 1 else world
    assert total == parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps * ranks
    return total // (tp if dims["pp"] == 1 else 1), tp


def _torchtitan(out: Path, dims: dict, batch: int, micro: int) -> None:
    doc = tomllib.loads((out / "torchtitan.toml").read_text())
    p, t = doc["parallelism"], doc["training"]
    assert (p["data_parallel_replicate_degree"], p["data_parallel_shard_degree"], p["tensor_parallel_degree"],
            p["context_parallel_degree"], p["pipeline_parallel_degree"], p["expert_parallel_degree"]) == (
        dims["dp_replicate"], dims["dp_shard"], dims["tp"], dims["cp"], dims["pp"], dims["ep"])
    assert t["global_batch_size"] == batch
    if dims["pp"] > 1:  # torchtitan splits a rank's local batch into the pipeline's micro-batches
        assert p["pipeline_parallel_microbatch_size"] == micro
        assert t["local_batch_size"] * dims["dp_replicate"] * dims["dp_shard"] == batch
    else:
        assert t["local_batch_size"] == micro


def _launch_sh(out: Path, gpus: int) -> None:
    text = (out / "launch.sh").read_text()
    assert f"--nproc_per_node {gpus}" in text or f"--num_gpus {gpus}" in text or "--include" in text \
        or "PLANNER_DS_DEVICES" in text


def _guide(out: Path, parallel, batch: int) -> None:
    guide = (out / "LAUNCH.md").read_text()
    assert f"= {batch} sequences per optimizer step" in guide
    shown = re.search(r"ParallelismConfig\(([^)]*)\)\)", guide)
    if parallel is None:
        assert shown is None
    else:
        sizes = dict((k, int(v)) for k, v in (kv.split("=") for kv in shown.group(1).split(", ")))
        assert (sizes.get("dp_replicate_size", 1), sizes.get("dp_shard_size", 1), sizes.get("tp_size", 1),
                sizes.get("cp_size", 1)) == (parallel.dp_replicate_size, parallel.dp_shard_size, parallel.tp_size,
                                             parallel.cp_size)
        assert "HSDP" not in guide or parallel.dp_replicate_size > 1


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_emitted_file_reads_back_as_the_planned_layout_and_batch(tmp_path, name):
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    out, result = _emit(tmp_path, **LAYOUTS[name])
    dims, batch = _planned(result)
    req = result.request
    world = req.world_size
    files = {p.name for p in out.iterdir()}
    ds_tp = 1
    if "ds_config.json" in files:
        ds_batch, ds_tp = _deepspeed(out, dims, world)
        assert ds_batch == batch
    if "accelerate_config.yaml" in files:
        config, parallel = _accelerate(out, dims, world)
        assert _trainer_batch(out, tmp_path, parallel, ds_tp, world) == batch
    else:  # only where accelerate has no such layout, and LAUNCH.md says why
        parallel = None
        assert dims["pp"] * dims["ep"] > 1 or (dims["tp"] * dims["cp"] > 1 and not result.strategy.startswith("fsdp")), name
        assert "No accelerate_config.yaml or trainer_args.json" in (out / "LAUNCH.md").read_text() \
            or "DeepSpeed's pipeline engine" in (out / "LAUNCH.md").read_text()
    if "torchtitan.toml" in files:
        _torchtitan(out, dims, batch, req.micro_batch)
    if "launch.sh" in files:
        _launch_sh(out, req.gpus)
    plan_doc = json.loads((out / "plan.json").read_text())
    again = EstimateRequest(**plan_doc["estimate_request"])
    assert (again.tp, again.pp, again.cp, again.gradient_accumulation) == (req.tp, req.pp, req.cp,
                                                                           req.gradient_accumulation)
    if "lora_config.json" in files:
        from peft import LoraConfig

        lora = LoraConfig(**json.loads((out / "lora_config.json").read_text()))
        assert lora.lora_alpha == LAYOUTS[name]["lora_alpha"] and lora.r == LAYOUTS[name]["lora_rank"]
    _guide(out, parallel, batch)


def test_the_issues_plan_emits_files_that_agree_with_it(tmp_path, capsys):
    """`planner plan --model llama-3.1-70b --gpus 8 --nodes 4 --fabric ib-ndr --emit DIR`, as typed."""
    out = tmp_path / "plan"
    assert main(["plan", "--model", "llama-3.1-70b", "--gpus", "8", "--nodes", "4", "--fabric", "ib-ndr",
                 "--emit", str(out), "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["recommended"]
    p = best["parallel"]
    dims = {k: p[k] for k in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")}
    batch = best["micro_batch"] * best["gradient_accumulation"] * p["dp_replicate"] * p["dp_shard"]
    assert batch == 256
    _, parallel = _accelerate(out, dims, 32)
    assert _trainer_batch(out, tmp_path, parallel, 1, 32) == 256
    _guide(out, parallel, 256)
    if (out / "torchtitan.toml").exists():
        _torchtitan(out, dims, 256, best["micro_batch"])
    guide = (out / "LAUNCH.md").read_text()
    assert "replicated 4 times" not in guide


def test_plan_lora_fields_reach_the_emitted_config(tmp_path, capsys):
    """`plan --lora-alpha 32 --quantize-base int8 --finetune qlora --emit`: alpha and storage as given."""
    out = tmp_path / "q"
    code = main(["plan", "--model", "llama-3.2-1b", "--gpus", "1", "--gpu", "rtx-4090", "--finetune", "qlora",
                 "--lora-alpha", "32", "--lora-rank", "16", "--quantize-base", "int8", "--global-batch", "8",
                 "--seq-len", "1k", "--emit", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    lora = json.loads((out / "lora_config.json").read_text())
    assert lora["lora_alpha"] == 32 and lora["r"] == 16
    bnb = json.loads((out / "bnb_config.json").read_text())
    assert bnb.get("load_in_8bit") is True
    assert "QLoRA" in text.split("rejected")[0]  # the table says which rows are QLoRA
