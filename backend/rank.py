"""One launched rank: the engine its job asks for, its steps and its measurement
(backend/worker.py runs ``run_rank`` inside the rank).

The dimension probes (backend/train_parallel.py, train_experts.py, train_pipeline.py,
context_parallel.py) build on backend/train.py's engine and measurement; this module alone chooses
among them, so none of them imports another's chooser. Each probe is imported only by the jobs
that run it: its import registers kernels and wraps collectives the other jobs do not use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from backend.job import uses_deepspeed
from backend.train import (COUNTER, deepspeed_engine, init_distributed, progress_writer, run_cuda,
                           run_profiled_cpu, torch_engine, torch_optimizer)

if TYPE_CHECKING:
    from backend.train_parallel import ParallelEngine


def engine_for(job: dict[str, Any], model: torch.nn.Module, device: torch.device):
    if (job.get("parallel") or {}).get("tp_plan") == "transformers":  # from_pretrained(tp_plan="auto")
        from backend.hf_tensor_parallel import hf_tp_engine

        return hf_tp_engine(job, model, device)
    if job.get("parallel"):  # tensor/sequence parallel (x FSDP2): backend/train_parallel.py
        return parallel_engine(job, model, device)
    if job.get("experts"):  # expert parallelism x FSDP2: backend/train_experts.py
        from backend.train_experts import expert_engine

        return expert_engine(job, model, device)
    if uses_deepspeed(job):
        return deepspeed_engine(job, model)
    return torch_engine(job, model, device)


def parallel_engine(job: dict[str, Any], model: torch.nn.Module, device: torch.device) -> "ParallelEngine":
    from backend.train_parallel import (CausalLMWithParallelLoss, ParallelEngine, apply_fsdp, apply_tp, build_mesh,
                                        count_dtensor_collectives, fsdp_mesh)

    COUNTER.wrap_torch_distributed()  # FSDP2's all-gathers and reduce-scatters
    count_dtensor_collectives(COUNTER)

    settings, parallel = job["torch"], job["parallel"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[settings["compute_dtype"]]
    if settings["pure_16bit"]:
        model = model.to(dtype)
    model = model.to(device)
    mesh = build_mesh(parallel, device)
    cp = int(parallel.get("cp", 1))
    in_forward = job.get("loss") == "chunked-in-forward"
    if int(parallel["tp"]) > 1:
        apply_tp(model, mesh["tp"], bool(parallel.get("sequence_parallel", True)), head_replicated=in_forward)
    if in_forward:
        from backend.train_parallel import InForwardParallelLoss

        model = InForwardParallelLoss(model, int(job["loss_chunks"]), mesh["tp"])
    elif cp > 1:
        from backend.context_parallel import ContextParallelLM

        model = ContextParallelLM(model)
    else:
        model = CausalLMWithParallelLoss(model)
    # the strategy names the data-parallel framework over dp_shard (x cp): FSDP2 wraps when there
    # is more than one data-parallel rank (HSDP: over dp_replicate too); ddp (no sharding) leaves
    # the TP model as it is
    replicas = int(parallel.get("dp_replicate", 1))
    sharded = settings["sharding"] is not None and int(parallel["dp_shard"]) * cp * replicas > 1
    if sharded:
        apply_fsdp(model, fsdp_mesh(mesh, parallel), settings, None if settings["pure_16bit"] else dtype)
    autocast = None if settings["pure_16bit"] or sharded else dtype
    optimizer = torch_optimizer(job, model)
    options = dict(accumulation=int(job.get("gradient_accumulation", 1)), autocast_dtype=autocast, device=device)
    if cp > 1:
        from backend.context_parallel import ContextParallelEngine, count_ring_collectives

        count_ring_collectives(COUNTER)
        return ContextParallelEngine(model, optimizer, cp_mesh=mesh["cp"], **options)
    return ParallelEngine(model, optimizer, **options)


def run_rank(job: dict[str, Any], rank: int) -> dict[str, Any]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if job["device"] == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_distributed(job)
    progress = progress_writer(job, rank)
    if job.get("pipeline") and device.type == "cpu":
        from backend.train_pipeline import run_pipeline_cpu

        measured = run_pipeline_cpu(job, device, progress)
    elif job.get("pipeline"):
        raise RuntimeError("pipeline-parallel verification runs on CPU ranks (--gpu cpu)")
    elif device.type == "cpu":
        measured = run_profiled_cpu(job, device, progress, engine_for)
    else:
        measured = run_cuda(job, device, progress, engine_for)
    measured["rank"] = rank
    measured["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    return measured
