"""Ready-to-launch files for a plan candidate: the DeepSpeed JSON, the launch commands, a hostfile."""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from pathlib import Path

from planner.dsconfig import ZeroSettings, build_ds_config
from planner.errors import PlannerError
from planner.schema import Candidate, EstimateRequest, PlanRequest
from planner.strategies import explicit_hsdp_shard, strategy as lookup_strategy

TRAIN_SCRIPT = "train.py"  # the user's training script; the commands name it as a placeholder to replace


def emit_files(req: PlanRequest, c: Candidate) -> dict[str, str]:
    s = lookup_strategy(c.strategy)
    files: dict[str, str] = {}
    world = req.gpus * req.nodes
    hosts = "".join(f"node{i} slots={req.gpus}\n" for i in range(req.nodes))
    files["hostfile"] = hosts
    if s.framework == "deepspeed":
        zero = ZeroSettings(stage=s.zero_stage, offload_optimizer=c.offload_optimizer, offload_params=c.offload_params)
        config = build_ds_config(stage=s.zero_stage, precision=req.precision, micro_batch=c.micro_batch,
                                 gradient_accumulation=c.gradient_accumulation, optimizer=req.optimizer, zero=zero)
        config["train_batch_size"] = c.micro_batch * c.gradient_accumulation * world
        files["ds_config.json"] = json.dumps(config, indent=2) + "\n"
        nodes = f" --num_nodes {req.nodes} --hostfile hostfile" if req.nodes > 1 else ""
        files["launch.sh"] = ("#!/usr/bin/env bash\n# planner: " + _summary(req, c) + "\nset -euo pipefail\n"
                              f"deepspeed --num_gpus {req.gpus}{nodes} {TRAIN_SCRIPT} --deepspeed "
                              f"--deepspeed_config ds_config.json \"$@\"\n")
    else:
        sharding = {"ddp": None, "fsdp": "FULL_SHARD", "fsdp-grad-op": "SHARD_GRAD_OP", "hsdp": "HYBRID_SHARD"}[s.name]
        settings = {"strategy": s.name, "fsdp_sharding_strategy": sharding, "micro_batch": c.micro_batch,
                    "gradient_accumulation": c.gradient_accumulation, "precision": req.precision,
                    "activation_checkpointing": c.checkpointing, "cpu_offload": c.offload_params == "cpu"}
        if s.name == "hsdp":  # a 2-D device mesh (replicate, shard) of consecutive ranks
            shard = c.hsdp_shard_size or req.gpus
            settings["device_mesh"] = {"replicate": req.gpus * req.nodes // shard, "shard": shard}
        files["torch_settings.json"] = json.dumps(settings, indent=2) + "\n"
        rdzv = " --nnodes {n} --node_rank $NODE_RANK --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500".format(
            n=req.nodes) if req.nodes > 1 else " --standalone"
        files["launch.sh"] = ("#!/usr/bin/env bash\n# planner: " + _summary(req, c) + "\nset -euo pipefail\n"
                              f"torchrun --nproc_per_node {req.gpus}{rdzv} {TRAIN_SCRIPT} "
                              "--settings torch_settings.json \"$@\"\n")
    files["job.sbatch"] = _sbatch(req, c, s.framework)
    files["plan.json"] = json.dumps({"request": req.model_dump(by_alias=True), "candidate": c.model_dump(),
                                     "estimate_request": estimate_request_for(req, c).model_dump(by_alias=True)},
                                    indent=2) + "\n"
    return files


def estimate_request_for(req: PlanRequest, c: Candidate) -> EstimateRequest:
    """The candidate as an estimate/verify request (what `planner verify --plan plan.json` runs)."""
    model = {"model": req.model} if req.model else {"model_config": req.model_config_}
    return EstimateRequest(**model, strategy=c.strategy, gpus=req.gpus, nodes=req.nodes, gpu=req.gpu,
                           precision=req.precision, optimizer=req.optimizer, micro_batch=c.micro_batch,
                           seq_len=req.seq_len, gradient_accumulation=c.gradient_accumulation,
                           checkpointing=c.checkpointing, attention=req.attention,
                           offload_optimizer=c.offload_optimizer, offload_params=c.offload_params,
                           hsdp_shard_size=explicit_hsdp_shard(c.strategy, c.hsdp_shard_size, req.gpus),
                           topology=req.topology, topology_text=req.topology_text)


def _sbatch(req: PlanRequest, c: Candidate, framework: str) -> str:
    """A Slurm batch script: one task per node, the launcher starts the node's GPUs."""
    if framework == "deepspeed":
        run = (f"deepspeed --num_gpus {req.gpus} --num_nodes $SLURM_NNODES --hostfile hostfile "
               f"--master_addr $MASTER_ADDR {TRAIN_SCRIPT} --deepspeed --deepspeed_config ds_config.json")
        hostfile = 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/ slots=%d/" > hostfile\n' % req.gpus
    else:
        run = (f"srun torchrun --nnodes $SLURM_NNODES --nproc_per_node {req.gpus} --rdzv_backend c10d "
               f"--rdzv_endpoint $MASTER_ADDR:29500 {TRAIN_SCRIPT} --settings torch_settings.json")
        hostfile = ""
    return ("#!/usr/bin/env bash\n"
            f"#SBATCH --job-name=planner-{c.strategy}\n"
            f"#SBATCH --nodes={req.nodes}\n"
            "#SBATCH --ntasks-per-node=1\n"
            f"#SBATCH --gpus-per-node={req.gpus}\n"
            "#SBATCH --exclusive\n"
            f"# planner: {_summary(req, c)}\n"
            "set -euo pipefail\n"
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
            + hostfile + run + "\n")


def _summary(req: PlanRequest, c: Candidate) -> str:
    return shlex.quote(f"{c.strategy} micro-batch {c.micro_batch} x {c.gradient_accumulation} accumulation, "
                       f"checkpointing {c.checkpointing}, offload {c.offload_optimizer}/{c.offload_params}, "
                       f"predicted peak {c.per_device.peak_bytes / 2**30:.2f} GiB, step {c.step_seconds:.3f} s")


def write_files(directory: str | Path, files: dict[str, str]) -> list[Path]:
    """Write every file or none: each goes to a temporary name first, then all are renamed."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlannerError(f"--emit {directory}: cannot create the directory ({exc.strerror})") from None
    staged = []
    try:
        for name, text in files.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            staged.append((tmp, out / name))
        for tmp, final in staged:
            os.replace(tmp, final)
            final.chmod(0o755 if final.name.endswith(".sh") else 0o644)
    except OSError as exc:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise PlannerError(f"--emit {directory}: cannot write ({exc.strerror})") from None
    return [final for _, final in staged]
