"""Reviewer follow-ups: emitted files keep the user's DeepSpeed settings; launches and locks name
the GPUs DeepSpeed really runs on; slow estimate requests leave the event loop; a synthesised
topology is not held to the paste limit; the collector runs while tracing; one /dev/shm pattern."""

import json

import pytest

from planner.plan.emit import emit_estimate_files
from planner.memory.orchestrator import estimate
from planner.schema import EstimateRequest

USERS_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000},
    "steps_per_print": 10,
}


def _emit_users_config(config=USERS_DS_CONFIG, **fields):
    request = EstimateRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, ds_config=config, **fields)
    return request, emit_estimate_files(estimate(request))


def test_emit_keeps_the_users_deepspeed_settings_and_carries_them_to_the_trainer():
    _, files = _emit_users_config()
    ds = json.loads(files["ds_config.json"])
    assert ds["optimizer"] == USERS_DS_CONFIG["optimizer"]
    assert ds["scheduler"] == USERS_DS_CONFIG["scheduler"]
    assert ds["gradient_clipping"] == 1.0 and ds["steps_per_print"] == 10
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 200_000_000
    batch = (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"])
    assert batch == (2, 4, 64)
    args = json.loads(files["trainer_args.json"])
    assert (args["learning_rate"], args["weight_decay"], args["max_grad_norm"]) == (3e-4, 0.1, 1.0)
    assert (args["adam_beta1"], args["adam_beta2"], args["warmup_steps"]) == (0.9, 0.95, 100)
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (2, 4)


def test_the_trainer_accepts_the_carried_arguments_against_the_users_config(tmp_path):
    """transformers' own consistency check (HfTrainerDeepSpeedConfig.trainer_config_process) finds
    no mismatch between trainer_args.json and the emitted ds_config.json."""
    pytest.importorskip("transformers")
    import dataclasses
    import types

    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    _, files = _emit_users_config()
    emitted_args = json.loads(files["trainer_args.json"])
    emitted_args.pop("deepspeed")
    args = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, **emitted_args)
    ds = HfTrainerDeepSpeedConfig(json.loads(files["ds_config.json"]))
    as_launched = types.SimpleNamespace(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)},
                                        world_size=8)
    ds.trainer_config_process(as_launched)
    assert ds.mismatches == []


def test_emit_overwrites_what_the_plan_decides_over_the_users_config():
    """An explicit offload and precision win over the config's; the user's other keys stay."""
    config = dict(USERS_DS_CONFIG, communication_data_type="bf16")
    _, files = _emit_users_config(config, offload_optimizer="cpu", precision="fp16-mixed", micro_batch=1)
    ds = json.loads(files["ds_config.json"])
    assert "bf16" not in ds and ds["fp16"]["enabled"] is True
    assert "communication_data_type" not in ds  # bf16 messages for an fp16 run would not be what was modelled
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["train_batch_size"] == 32
    assert ds["scheduler"] == USERS_DS_CONFIG["scheduler"]


def test_an_emitted_user_config_parses_and_estimates_back_the_same():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    request, files = _emit_users_config()
    ds = json.loads(files["ds_config.json"])
    read_back = EstimateRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, ds_config=ds)
    assert estimate(read_back).per_device.peak_bytes == estimate(request).per_device.peak_bytes
    ds.pop("train_batch_size")  # outside a process group DeepSpeedConfig assumes world size 1
    parsed = DeepSpeedConfig(ds)
    assert parsed.gradient_clipping == 1.0 and parsed.scheduler_name == "WarmupDecayLR"
    assert parsed.optimizer_params["lr"] == 3e-4


# --- the GPUs DeepSpeed really runs on ------------------------------------------------------------
# DeepSpeed 0.19.8 launcher/runner.py:451-460: with --num_gpus (or --include/--exclude/--num_nodes)
# the runner prints that it ignores CUDA_VISIBLE_DEVICES and deletes it, so --num_gpus N runs on
# physical GPUs 0..N-1; without them it sets --include localhost:<visible>. The launch names the
# visible devices itself, and the locks hold exactly those.

def _gpu_request(**fields):
    return EstimateRequest(model="gpt2", gpu="h100-80gb", gpus=2, strategy="zero2", **fields)


def test_verify_launches_deepspeed_on_the_visible_gpus_and_locks_those(monkeypatch, tmp_path):
    from backend.launch import launcher_command
    from backend.verify import device_lock, device_names
    from planner.errors import PlannerError

    monkeypatch.setenv("PLANNER_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,3,1")
    command = launcher_command(tmp_path / "job.json", _gpu_request(), port=29600)
    assert "--num_gpus" not in command
    assert command[command.index("--include") + 1] == "localhost:6,3"
    assert device_names(_gpu_request()) == ["cuda-6", "cuda-3"]
    with device_lock(_gpu_request()):
        assert sorted(p.name for p in (tmp_path / "locks").glob("*.lock")) == ["cuda-3.lock", "cuda-6.lock"]
    # unset: DeepSpeed's own numbering, physical 0..N-1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    command = launcher_command(tmp_path / "job.json", _gpu_request(), port=29600)
    assert command[command.index("--num_gpus") + 1] == "2" and "--include" not in command
    assert device_names(_gpu_request()) == ["cuda-0", "cuda-1"]
    # too few visible, or UUIDs (the runner parses slots as integers, runner.py:280-289): refused
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    with pytest.raises(PlannerError, match=r"CUDA_VISIBLE_DEVICES=4 makes 1 GPU\(s\) visible; gpus=2"):
        launcher_command(tmp_path / "job.json", _gpu_request())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1a2b,GPU-3c4d")
    with pytest.raises(PlannerError, match="by index"):
        device_names(_gpu_request())
    # torchrun keeps the environment (rank r on the r-th visible device): UUIDs are fine there
    fsdp = EstimateRequest(model="gpt2", gpu="h100-80gb", gpus=2, strategy="fsdp")
    assert device_names(fsdp) == ["cuda-GPU-1a2b", "cuda-GPU-3c4d"]


def _run_launch_sh(tmp_path, visible):
    import os
    import subprocess

    from cli.files import write_files

    out = tmp_path / "emit"
    write_files(out, emit_estimate_files(estimate(_gpu_request())))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "launched.log"
    (bin_dir / "deepspeed").write_text(f'#!/usr/bin/env bash\necho "$*" > {log}\n')
    (bin_dir / "deepspeed").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CUDA_VISIBLE_DEVICES=visible)
    done = subprocess.run(["bash", str(out / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    return done, (log.read_text() if log.exists() else "")


def test_the_emitted_launch_names_the_visible_gpus(tmp_path):
    done, launched = _run_launch_sh(tmp_path, "5,2,7")
    assert done.returncode == 0, done.stderr
    assert launched.startswith("--include localhost:5,2 --master_port 29500 --module backend.worker")
    done, launched = _run_launch_sh(tmp_path, "")
    assert done.returncode == 0 and launched.startswith("--num_gpus 2 --master_port")
    done, _ = _run_launch_sh(tmp_path, "3")
    assert done.returncode == 2 and "makes 1 GPU(s) visible; the plan needs 2" in done.stderr


# --- the event loop --------------------------------------------------------------------------------

def test_a_pasted_topology_or_a_deep_config_is_estimated_in_the_threadpool(recorded_hops):
    """Parsing a pasted `nvidia-smi topo -m` (~28 ms uncached) or reading a config of thousands of
    layers would hold the event loop; a catalogue model on its preset stays on it."""
    from backend.anymodel import estimate_any
    from tests.real_runs import LLAMA

    client, hops = recorded_hops
    catalogue = {"model": "llama-3-8b", "strategy": "zero3", "gpus": 2, "gpu": "a100-80gb"}
    assert client.post("/v1/estimate", json=catalogue).status_code == 200 and hops == []
    shallow = dict(catalogue, model=None, model_config=dict(LLAMA, num_hidden_layers=2))
    assert client.post("/v1/estimate", json=shallow).status_code == 200 and hops == []
    pasted = dict(catalogue, topology_text="\tGPU0\tGPU1\nGPU0\t X \tNV12\nGPU1\tNV12\t X \n")
    r = client.post("/v1/estimate", json=pasted)
    assert r.status_code == 200 and hops == ["estimate_any"]
    assert r.json() == json.loads(estimate_any(EstimateRequest(**pasted)).model_dump_json(by_alias=True))
    deep = dict(shallow, model_config=dict(LLAMA, num_hidden_layers=201))
    assert client.post("/v1/estimate", json=deep).status_code == 200 and hops == ["estimate_any"] * 2
    bad = dict(pasted, topology_text="not a topology")  # refused in the threadpool as on the loop: 422
    assert client.post("/v1/estimate", json=bad).status_code == 422 and hops == ["estimate_any"] * 3


# --- the topology assumed without a preset -----------------------------------------------------------

def test_the_assumed_topology_is_what_parsing_its_nvidia_smi_text_gives():
    from planner.cluster.gpus import gpu
    from planner.cluster.hardware import one_host_bridge as _one_host_bridge
    from planner.cluster.topology import parse_topology

    g = gpu("h100-pcie")  # a GPU without a preset
    for n in (1, 2, 8):
        text = "\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\n" + "".join(
            f"GPU{i}\t" + "\t".join(" X " if i == j else "PHB" for j in range(n)) + "\n" for i in range(n))
        source = f"assumed: {n} GPUs under one PCIe host bridge"
        assert _one_host_bridge(n, g) == parse_topology(text, g, source=source)


def test_a_preset_less_gpu_count_beyond_the_paste_limit_is_estimated():
    """190 GPUs: their nvidia-smi text would be 146,841 bytes, over the paste limit (64 KiB), which
    is for what users paste, not for what the planner assumes."""
    from planner.time.step import estimate_with_time

    result = estimate_with_time(EstimateRequest(model="gpt2", gpu="h100-pcie", gpus=190, strategy="zero2"))
    assert result.time is not None and result.time.step_seconds > 0


# --- the collector while tracing --------------------------------------------------------------------

def test_the_collector_runs_while_a_traced_estimate_builds_its_models(monkeypatch):
    """`planner estimate` disables the cyclic GC for its quick start-up (cli/main.py main); a traced
    estimate builds transformers models, so tracing runs with it on, and the caller's state returns."""
    import gc

    import backend.trace
    from backend.anymodel import traced_estimate
    from planner.model.catalogue import UnsupportedModelTypeError

    seen = []

    class Stop(Exception):
        pass

    def count(*_):
        seen.append(gc.isenabled())
        raise Stop

    monkeypatch.setattr(backend.trace, "cached_count", count)
    refusal = UnsupportedModelTypeError("no reader", {"model_type": "unknown-kind"}, "unknown", "test")
    was = gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(Stop):
            traced_estimate(EstimateRequest(params=1_000_000), refusal)
        assert seen == [True] and not gc.isenabled()
    finally:
        if was:
            gc.enable()


# --- one /dev/shm pattern -----------------------------------------------------------------------------

def test_the_emitted_cleanup_removes_exactly_the_segments_the_supervisor_removes(tmp_path, monkeypatch):
    """DeepSpeed names them deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (shm.cpp:350-367):
    the launch.sh trap and job.sbatch remove this user's of this port, as backend/supervisor.py does."""
    import os
    import re
    import subprocess

    import backend.supervisor
    from tests.real_runs import LLAMA

    uid, port = os.getuid(), 29517
    names = [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_0",
             f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_1",
             f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_{port}_0",  # another user's run on the same port
             f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port + 1}_0",  # another run of ours
             "unrelated_segment"]
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in names:
        (shm / name).write_bytes(b"")
    monkeypatch.setattr(backend.supervisor, "SHM_DIR", shm)
    expected = {p.name for p in backend.supervisor.shm_segments(port)}
    assert expected == set(names[:2])

    files = emit_estimate_files(estimate(EstimateRequest(model_config=dict(LLAMA, num_hidden_layers=2), gpu="cpu",
                                                         gpus=2, strategy="zero2", seq_len=64, precision="fp32")))
    trap = re.search(r"^trap '(.*)' EXIT$", files["launch.sh"], re.M).group(1)
    sbatch = re.search(r"; rc=\$\?; (rm -f [^;]*);", files["job.sbatch"]).group(1)
    assert sbatch == trap.replace('"$port"', '"$MASTER_PORT"')
    subprocess.run(["bash", "-c", trap.replace("/dev/shm/", f"{shm}/")], env=dict(os.environ, port=str(port)),
                   check=True, timeout=30)
    assert {p.name for p in shm.iterdir()} == set(names) - expected


def test_a_multi_node_zero_run_on_cpu_ranks_runs_every_nodes_ranks_here(tmp_path, capsys):
    """DeepSpeed's runner refuses --num_nodes > 1 without a hostfile ("Num nodes is >1 but no extra
    nodes available via hostfile"): the run crashed with every rank missing. On CPU ranks without
    a hostfile every node's ranks run on this host, as the torch path runs them; with a hostfile it
    is passed on; a hostfile that cannot be read is refused before anything is launched."""
    from backend.launch import launcher_command
    from cli.main import main
    from planner.schema import EstimateRequest
    from tests.real_runs import LLAMA

    request = EstimateRequest(model_config=LLAMA, strategy="zero3", gpus=2, nodes=2, gpu="cpu", seq_len=128)
    here = launcher_command(tmp_path / "job.json", request, port=29600, device="cpu")
    assert here[1:3] == ["--num_gpus", "4"] and "--num_nodes" not in here
    hosts = tmp_path / "hostfile"
    hosts.write_text("a slots=2\nb slots=2\n")
    there = launcher_command(tmp_path / "job.json", request, hostfile=str(hosts), port=29600, device="cpu")
    assert there[there.index("--num_nodes") + 1] == "2" and there[there.index("--hostfile") + 1] == str(hosts)
    model = tmp_path / "model.json"
    model.write_text(json.dumps(LLAMA))
    code = main(["verify", "--model-file", str(model), "--gpus", "2", "--nodes", "2", "--gpu", "cpu",
                 "--hostfile", str(tmp_path / "missing"), "--db", str(tmp_path / "runs.sqlite")])
    assert code == 2 and f"--hostfile {tmp_path / 'missing'}: cannot be read" in capsys.readouterr().err
    assert not (tmp_path / "runs.sqlite").exists()
