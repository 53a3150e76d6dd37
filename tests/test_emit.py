"""`--emit DIR`: launch files a user can run, checked by the tools that read them.

The emitted CPU launch trains end to end; the accelerate config goes through accelerate's own
loader and launch validation; the Trainer arguments through transformers' own checks; the Slurm
script runs against stand-in `scontrol`/`srun`/launchers that record what each node would start.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from cli.files import write_files
from planner.plan.emit import Script, emit_estimate_files
from planner.errors import PlannerError
from planner.time.step import estimate_with_time
from planner.schema import EstimateRequest
from tests.real_runs import LLAMA
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(LLAMA, num_hidden_layers=2)


def emitted(tmp_path: Path, script: Script | None = None, **fields) -> Path:
    kw = dict(model="llama-3.2-1b", gpu="h100-80gb", gpus=8, seq_len=2048)
    kw.update(fields)
    out = tmp_path / "emit"
    write_files(out, emit_estimate_files(estimate_with_time(EstimateRequest(**kw)), script))
    return out


# --- the emitted CPU launch, end to end ----------------------------------------------------------

@pytest.mark.deepspeed
@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_emitted_cpu_launch_trains_two_ranks_end_to_end(tmp_path, capsys, strategy):
    """`planner estimate --emit` for a tiny model on 2 CPU ranks, then the emitted launch.sh, run
    from another directory as a user would: deepspeed (zero2) or torchrun (fsdp) starts the
    planner's trainer on the emitted plan.json; both ranks train and leave their records."""
    pytest.importorskip("deepspeed")
    from backend.launch import prepare_extensions

    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY))
    out = tmp_path / "emit"
    code = main(["estimate", "--model-file", str(model), "--gpu", "cpu", "--gpus", "2", "--strategy", strategy,
                 "--seq-len", "64", "--precision", "fp32", "--emit", str(out)])
    assert code == 0 and "see LAUNCH.md" in capsys.readouterr().err
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MASTER_ADDR", "NODE_RANK")}
    port = free_port()
    env.update(PLANNER_ROOT=str(ROOT), MASTER_PORT=str(port), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    if strategy == "zero2":
        prepare_extensions(env)  # DeepSpeed's CPU op built once, under the planner's lock
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    done = subprocess.run(["bash", str(out / "launch.sh"), "--steps", "1", "--warmup", "1"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=900, start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((out / "planner-run" / f"rank{rank}.json").read_text())
        assert record["status"] == "ok" and record["world_size"] == 2 and record["peak_bytes"] > 0
        assert len(record["all_step_seconds"]) == 2  # one warm-up step, one measured
        assert f"rank {rank}/2: trained 1 steps after 1 warm-up" in done.stdout + done.stderr
    # the launch removed the /dev/shm segments of its own port (DeepSpeed's CPU all-reduce)
    assert not list(Path("/dev/shm").glob(f"deepspeed_*_{port}_*")) if Path("/dev/shm").is_dir() else True


# --- accelerate ----------------------------------------------------------------------------------

ACCELERATE_CASES = [
    ("zero3", dict(offload_optimizer="cpu", offload_params="cpu", checkpointing="full")),
    ("zero2", dict(nodes=2)),
    ("zero1", dict(precision="fp16-mixed")),
    ("fsdp", dict(offload_optimizer="cpu", offload_params="cpu", checkpointing="full")),
    ("fsdp-grad-op", dict(precision="fp32")),
    ("hsdp", dict(nodes=2, hsdp_shard_size=4)),
    ("ddp", dict(model="gpt2", precision="fp16-mixed")),
]


@pytest.mark.parametrize("strategy,fields", ACCELERATE_CASES, ids=[c[0] for c in ACCELERATE_CASES])
def test_accelerate_config_loads_in_accelerates_own_loader(tmp_path, monkeypatch, strategy, fields):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DistributedType
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    out = emitted(tmp_path, strategy=strategy, **fields)
    config = load_config_from_file(str(out / "accelerate_config.yaml"))
    nodes = fields.get("nodes", 1)
    assert isinstance(config, ClusterConfig)
    assert config.num_processes == 8 * nodes and config.num_machines == nodes and config.use_cpu is False
    precision = fields.get("precision", "bf16-mixed")
    if strategy.startswith("zero"):
        assert config.distributed_type == DistributedType.DEEPSPEED
        assert config.deepspeed_config["deepspeed_config_file"] == "ds_config.json"
        assert config.deepspeed_config["zero3_init_flag"] is (strategy == "zero3")
        assert config.mixed_precision is None  # the DeepSpeed JSON holds it (accelerate refuses both)
    elif strategy == "ddp":
        assert config.distributed_type == DistributedType.MULTI_GPU and config.mixed_precision == "fp16"
    else:
        assert config.distributed_type == DistributedType.FSDP
        assert config.mixed_precision == {"bf16-mixed": "bf16", "fp32": "no"}[precision]
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert fsdp["fsdp_reshard_after_forward"] is (strategy != "fsdp-grad-op")
        assert fsdp["fsdp_offload_params"] is (fields.get("offload_params") == "cpu")
        assert fsdp["fsdp_activation_checkpointing"] is (fields.get("checkpointing") == "full")
        if strategy == "hsdp":
            assert config.parallelism_config == {"parallelism_config_dp_replicate_size": 4,
                                                 "parallelism_config_dp_shard_size": 4}
    # What `accelerate launch --config_file accelerate_config.yaml train.py` makes of it, up to the
    # environment of the ranks, and the plugin a rank builds from that environment.
    monkeypatch.chdir(out)
    args = launch_command_parser().parse_args(["--config_file", "accelerate_config.yaml", "--main_process_port",
                                               str(free_port()), "train.py"])
    args, defaults, mixed_from_config = _validate_launch_command(args)
    if strategy.startswith("zero"):
        args.deepspeed_fields_from_accelerate_config = ",".join(
            list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_from_config else []))
        _, env = prepare_deepspeed_cmd_env(args)
        from accelerate.utils import DeepSpeedPlugin

        for key, value in env.items():
            monkeypatch.setenv(key, value)
        plugin = DeepSpeedPlugin()  # raises on fields that contradict deepspeed_config_file
        ds = json.loads((out / "ds_config.json").read_text())
        assert plugin.deepspeed_config["zero_optimization"]["stage"] == int(strategy[-1]) == ds["zero_optimization"]["stage"]
        assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 1
    else:
        env = prepare_multi_gpu_env(args)
        if strategy != "ddp":
            from accelerate.utils import FullyShardedDataParallelPlugin

            for key, value in env.items():
                monkeypatch.setenv(key, value)
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is (strategy != "fsdp-grad-op")
            assert plugin.activation_checkpointing is (fields.get("checkpointing") == "full")
            assert (plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") \
                is (fields.get("offload_params") == "cpu")
        if strategy == "hsdp":
            assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "4" and env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "4"


def test_accelerate_config_on_one_gpu_and_on_cpu_ranks(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    one = load_config_from_file(str(emitted(tmp_path / "a", model="gpt2", strategy="ddp", gpus=1) / "accelerate_config.yaml"))
    assert one.distributed_type == DistributedType.NO and one.num_processes == 1
    cpu = load_config_from_file(str(emitted(tmp_path / "b", model_config=TINY, model=None, strategy="ddp", gpu="cpu",
                                            gpus=2, seq_len=64) / "accelerate_config.yaml"))
    assert cpu.distributed_type == DistributedType.MULTI_CPU and cpu.use_cpu is True


# --- the HF Trainer ---------------------------------------------------------------------------

@pytest.mark.parametrize("strategy,fields", ACCELERATE_CASES, ids=[c[0] for c in ACCELERATE_CASES])
def test_trainer_arguments_are_accepted_and_match_the_deepspeed_config(tmp_path, strategy, fields):
    pytest.importorskip("transformers")
    import dataclasses
    import types

    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    out = emitted(tmp_path, strategy=strategy, **fields)
    emitted_args = json.loads((out / "trainer_args.json").read_text())
    deepspeed = emitted_args.pop("deepspeed", None)
    # use_cpu: this host has no GPU, and TrainingArguments refuses bf16 without one
    args = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, **emitted_args)
    assert args.per_device_train_batch_size == 1 and args.gradient_accumulation_steps == 1
    precision = fields.get("precision", "bf16-mixed")
    assert (args.bf16, args.fp16) == (precision == "bf16-mixed", precision == "fp16-mixed")
    if strategy.startswith("zero"):
        assert deepspeed == "ds_config.json"
        ds = HfTrainerDeepSpeedConfig(json.loads((out / "ds_config.json").read_text()))
        # the Trainer's own consistency check, at the job's world size (TrainingArguments here is one process)
        as_launched = types.SimpleNamespace(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)},
                                            world_size=8 * fields.get("nodes", 1))
        ds.trainer_config_process(as_launched)
        assert ds.mismatches == []
        assert args.gradient_checkpointing is (fields.get("checkpointing") == "full")
    elif strategy == "ddp":
        assert deepspeed is None and not args.fsdp
    else:
        plugin = args.fsdp_plugin_args
        assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is (strategy != "fsdp-grad-op")
        assert plugin.get("cpu_offload", False) is (fields.get("offload_params") == "cpu")
        assert plugin["activation_checkpointing"] is (fields.get("checkpointing") == "full")
        assert args.gradient_checkpointing is False  # FSDP checkpoints its own units
    if strategy == "hsdp":
        guide = (out / "LAUNCH.md").read_text()
        assert "ParallelismConfig(dp_replicate_size=4, dp_shard_size=4)" in guide


def test_every_emitted_deepspeed_config_parses_including_cpu_ranks(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    for name, fields in [("gpu", dict(strategy="zero3", offload_optimizer="cpu")),
                         ("cpu", dict(model=None, model_config=TINY, strategy="zero2", gpu="cpu", gpus=2, seq_len=64))]:
        config = json.loads((emitted(tmp_path / name, **fields) / "ds_config.json").read_text())
        world = config["train_batch_size"]  # micro-batch 1 x accumulation 1 x world
        config.pop("train_batch_size")  # outside a process group DeepSpeedConfig assumes world size 1
        parsed = DeepSpeedConfig(config)
        assert parsed.zero_optimization_stage == int(fields["strategy"][-1]) and world == fields.get("gpus", 8)
        assert config["optimizer"]["params"].get("torch_adam") is (True if name == "cpu" else None)


# --- Slurm and multi-node ---------------------------------------------------------------------

def _stand_ins(tmp_path: Path, hosts: list[str]) -> tuple[Path, Path]:
    """scontrol, srun, deepspeed and torchrun that record instead of launching. srun starts its
    command once per node with that node's SLURM_NODEID and SLURM_PROCID, as with
    --ntasks-per-node=1."""
    bin_dir, log = tmp_path / "bin", tmp_path / "launched.log"
    bin_dir.mkdir()
    stubs = {
        "scontrol": f'[ "$1 $2" = "show hostnames" ] && printf "%s\\n" {" ".join(hosts)}\n',
        "srun": ('while [ "${1#--}" != "$1" ]; do shift; done\n'
                 f'for node in $(seq 0 {len(hosts) - 1}); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" || exit $?; done\n'),
        "deepspeed": f'echo "deepspeed node=$SLURM_NODEID $*" >> {log}\n',
        "torchrun": f'echo "torchrun node=$SLURM_NODEID $*" >> {log}\n',
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return bin_dir, log


def _slurm_env(bin_dir: Path, submit_dir: Path, nodes: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NODE_RANK"))}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", PYTHONPATH=str(ROOT),
               SLURM_SUBMIT_DIR=str(submit_dir), SLURM_JOB_NODELIST="gpu-[7-8]", SLURM_NNODES=str(nodes),
               SLURM_JOB_ID="4242")
    return env


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sbatch_derives_node_rank_and_master_address_from_slurm(tmp_path, strategy):
    out = emitted(tmp_path, strategy=strategy, nodes=2)
    sbatch = (out / "job.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(out / "job.sbatch")]).returncode == 0
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --ntasks-per-node=1" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in sbatch and "SLURM_NODEID" in sbatch
    bin_dir, log = _stand_ins(tmp_path, ["gpu-7", "gpu-8"])
    done = subprocess.run(["bash", str(out / "job.sbatch"), "--steps", "5"], cwd=tmp_path, capture_output=True,
                          text=True, env=_slurm_env(bin_dir, out, 2), timeout=120)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert len(lines) == 2
    for node, line in enumerate(lines):
        tail = f"--plan {out}/plan.json --out {out}/planner-run"
        if strategy == "fsdp":
            assert line.startswith(f"torchrun node={node} --nnodes 2 --node_rank {node} --nproc_per_node 8 "
                                   "--master_addr gpu-7 --master_port 29500 -m backend.worker")
            assert line.endswith(f"{tail} --steps 5")
        else:
            assert line.startswith(f"deepspeed node={node} --hostfile {out}/hostfile.slurm-4242 --no_ssh "
                                   f"--node_rank {node} --master_addr gpu-7 --master_port 29500 --module backend.worker")
            assert line.endswith(f"{tail} --deepspeed_config {out}/ds_config.json --steps 5")
    if strategy == "zero3":
        assert (out / "hostfile.slurm-4242").read_text() == "gpu-7 slots=8\ngpu-8 slots=8\n"


def test_sbatch_and_launch_pass_the_users_script_and_its_arguments_through(tmp_path):
    out = emitted(tmp_path, Script.parse("my train.py --data 'a b' --lr=3e-4"), strategy="fsdp", nodes=2)
    bin_dir, log = _stand_ins(tmp_path, ["gpu-7", "gpu-8"])
    env = _slurm_env(bin_dir, out, 2)
    assert subprocess.run(["bash", str(out / "job.sbatch"), "--epochs", "1"], cwd=tmp_path, env=env,
                          timeout=120).returncode == 0
    first = log.read_text().splitlines()[0]
    assert first.endswith("--master_port 29500 my train.py --data a b --lr=3e-4 --epochs 1")
    assert "backend.worker" not in (out / "launch.sh").read_text()
    # launch.sh on one node of the two, given its rank and the master's address
    log.unlink()
    env.update(NODE_RANK="1", MASTER_ADDR="gpu-7")
    assert subprocess.run(["bash", str(out / "launch.sh"), "--epochs", "1"], env=env, timeout=60).returncode == 0
    assert log.read_text().split(" ", 2)[2].strip() == (
        "--nnodes 2 --nproc_per_node 8 --node_rank 1 --master_addr gpu-7 --master_port 29500 "
        "my train.py --data a b --lr=3e-4 --epochs 1")


def test_multi_node_launch_says_what_it_needs(tmp_path):
    torch_out = emitted(tmp_path / "t", strategy="fsdp", nodes=2)
    ds_out = emitted(tmp_path / "d", strategy="zero3", nodes=2)
    bin_dir, log = _stand_ins(tmp_path, ["gpu-7", "gpu-8"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NODE_RANK"))}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", PYTHONPATH=str(ROOT))
    for out in (torch_out, ds_out):
        assert subprocess.run(["bash", "-n", str(out / "launch.sh")]).returncode == 0
    done = subprocess.run(["bash", str(torch_out / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "set NODE_RANK to the index of this node, 0..1" in done.stderr
    # DeepSpeed multi-node: the hostfile explains itself and launch.sh refuses it until it lists 2 nodes
    hostfile = (ds_out / "hostfile").read_text()
    assert "HOSTNAME slots=8" in hostfile and all(line.startswith("#") for line in hostfile.splitlines())
    done = subprocess.run(["bash", str(ds_out / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "hostfile lists 0 nodes; the plan is for 2" in done.stderr
    (ds_out / "hostfile").write_text(hostfile + "gpu-7 slots=8\ngpu-8 slots=8\n")
    assert subprocess.run(["bash", str(ds_out / "launch.sh")], env=env, timeout=60).returncode == 0
    assert log.read_text().startswith(f"deepspeed node= --hostfile {ds_out}/hostfile --num_nodes 2 --num_gpus 8 "
                                      "--master_addr gpu-7 --master_port 29500 --module backend.worker")


def test_hostfile_only_where_deepspeed_spans_nodes(tmp_path):
    def names(**fields):
        return {p.name for p in emitted(tmp_path / str(len(list(tmp_path.iterdir()))), **fields).iterdir()}

    common = {"launch.sh", "job.sbatch", "plan.json", "accelerate_config.yaml", "trainer_args.json", "LAUNCH.md"}
    assert names(strategy="zero3") == common | {"ds_config.json"}
    assert names(strategy="zero3", nodes=2) == common | {"ds_config.json", "hostfile"}
    assert names(strategy="fsdp", nodes=2) == common
    assert names(strategy="ddp") == common
    # the planner's trainer runs DeepSpeed with the optimizers its config names: no launch.sh for a client
    # optimizer (bitsandbytes' adamw-8bit), and LAUNCH.md says why; the torch strategies build every optimizer
    assert names(strategy="zero2", optimizer="adamw-8bit") == (common | {"ds_config.json"}) - {"launch.sh", "job.sbatch"}
    assert names(strategy="fsdp", optimizer="adamw-8bit") == common
    # transformers names neither torch's Adafactor nor Muon: no trainer_args.json
    assert names(strategy="ddp", optimizer="muon") == common - {"trainer_args.json"}


def test_launch_sh_fails_clearly_without_the_planners_trainer(tmp_path):
    out = emitted(tmp_path, strategy="fsdp")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a Python without the planner installed (this venv has it, editable)
    (bin_dir / "python").write_text('#!/usr/bin/env bash\necho "No module named backend" >&2; exit 1\n')
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PLANNER_ROOT")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    done = subprocess.run(["bash", str(out / "launch.sh")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "cannot import backend.worker" in done.stderr and "PLANNER_ROOT" in done.stderr


# --- the CLI ------------------------------------------------------------------------------------

def test_cli_script_flag(tmp_path, capsys):
    base = ["estimate", "--model", "gpt2", "--gpu", "h100-80gb", "--gpus", "2", "--strategy", "zero2"]
    assert main(base + ["--script", "train.py"]) == 2
    assert "--script names the training script of the emitted launch files: give --emit DIR too" in capsys.readouterr().err
    assert main(base + ["--emit", str(tmp_path / "a"), "--script", "  "]) == 2
    assert "--script: empty" in capsys.readouterr().err
    assert main(base + ["--emit", str(tmp_path / "b"), "--script", "train.py --cfg 'x y'"]) == 0
    assert "train.py --cfg 'x y' \"$@\"" in (tmp_path / "b" / "launch.sh").read_text()
    assert "does not fit" not in capsys.readouterr().err
    assert "$PLANNER_DS_CONFIG" in (tmp_path / "b" / "LAUNCH.md").read_text()
    from cli.main import _request_from_plan  # what `planner verify --plan` reads

    assert _request_from_plan(str(tmp_path / "b" / "plan.json")).strategy == "zero2"
    assert main(["estimate", "--model", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "2", "--strategy", "ddp",
                 "--emit", str(tmp_path / "f")]) == 0
    assert "GiB does not fit 79.65 GiB of h100-80gb; the files are written as asked" in capsys.readouterr().err
    # without an architecture the planner's trainer cannot run: the configs are written, no launch.sh, and why
    assert main(["estimate", "--params", "7000000000", "--strategy", "zero3", "--emit", str(tmp_path / "c")]) == 0
    assert "note: No launch.sh or job.sbatch: the planner's trainer needs an architecture" in capsys.readouterr().err
    assert {p.name for p in (tmp_path / "c").iterdir()} == {"ds_config.json", "accelerate_config.yaml",
                                                           "trainer_args.json", "plan.json", "LAUNCH.md"}
    assert main(["estimate", "--params", "7000000000", "--strategy", "zero3", "--emit", str(tmp_path / "e"),
                 "--script", "train.py"]) == 0
    assert (tmp_path / "e" / "launch.sh").exists()
    assert main(["plan", "--model", "gpt2", "--gpu", "h100-80gb", "--gpus", "8", "--global-batch", "64",
                 "--seq-len", "512", "--emit", str(tmp_path / "d"), "--script", "run.py --fast"]) == 0
    assert "run.py --fast" in (tmp_path / "d" / "job.sbatch").read_text()


def test_script_parse_errors():
    with pytest.raises(PlannerError, match="No closing quotation"):
        Script.parse("train.py 'open")
    assert Script.parse("a.py -x 'y z'") == Script("a.py", ("-x", "y z"))


def test_trainer_entry_point_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys):
    from backend.worker import main as worker_main

    assert worker_main(["--plan", str(tmp_path / "none.json")]) == 2
    assert "--plan" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"estimate_request": {"strategy": "zero9"}}')
    assert worker_main(["--plan", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a runnable plan.json" in err
    out = emitted(tmp_path, strategy="fsdp")
    assert worker_main(["--plan", str(out / "plan.json"), "--deepspeed_config", str(out / "plan.json")]) == 2
    assert "the plan's strategy fsdp is not a DeepSpeed one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        worker_main(["--plan", str(out / "plan.json"), "--steps", "0"])
