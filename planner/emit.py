"""Ready-to-launch files for a plan candidate: the DeepSpeed JSON, the launch commands, a hostfile."""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from pathlib import Path

from planner.dsconfig import ZeroSettings, build_ds_config
from planner.errors import PlannerError
from planner.schema import Candidate, PlanRequest
from planner.strategies import strategy as lookup_strategy

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
        files["torch_settings.json"] = json.dumps(settings, indent=2) + "\n"
        rdzv = " --nnodes {n} --node_rank $NODE_RANK --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500".format(
            n=req.nodes) if req.nodes > 1 else " --standalone"
        files["launch.sh"] = ("#!/usr/bin/env bash\n# planner: " + _summary(req, c) + "\nset -euo pipefail\n"
                              f"torchrun --nproc_per_node {req.gpus}{rdzv} {TRAIN_SCRIPT} "
                              "--settings torch_settings.json \"$@\"\n")
    files["plan.json"] = json.dumps({"request": req.model_dump(by_alias=True), "candidate": c.model_dump()},
                                    indent=2) + "\n"
    return files


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
