"""transformers' own tensor parallelism on one rank (imported only inside a launched rank): the model
loaded with ``from_pretrained(path, tp_plan="auto")``, as a user's script hands it to accelerate or
the Trainer, and trained with the model's own loss; with FSDP2 over dp_shard, transformers' own
DistributedConfig composition (_distribution).

transformers 5.25 shards it while loading (modeling_utils.py from_pretrained: ``tp_plan`` becomes a
``DistributedConfig``, distributed/mixin.py ``maybe_distribute_model`` applies the model's plan on a
(pp, dp_replicate, fsdp, tp) mesh of the whole world): q/k/v and gate/up colwise, o and down
rowwise, the embedding's vocabulary rows (embedding_rowwise), the LM head colwise with its output
gathered (colwise_gather_output), so ``model(input_ids, labels=...)`` returns the whole logits and
ForCausalLMLoss runs on them as on one device. The planner's model of it: planner/parallel/hf_plan.py.

The checkpoint is the job's own randomly initialised model (backend/train.py build_model), written
once by rank 0 under the run's directory and read by every rank; nothing is downloaded. Every rank
sees the same batch (backend/train.py synthetic_batch is seeded by the step), as TP needs.
Accelerate 1.16 adds nothing for a TP-only model (Accelerator.prepare_model: no DDP wrap when
parallelism_config.tp_enabled, it checks the model's tp size), so the engine is the plain
AccumulatingEngine over the loaded module.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from backend.train import COUNTER, AccumulatingEngine, apply_checkpointing, attention_implementation, torch_optimizer
from backend.train_parallel import count_dtensor_collectives


def _checkpoint(job: dict[str, Any], model: torch.nn.Module, dtype: torch.dtype) -> Path:
    """Rank 0 writes the built model (in the dtype it will be trained in); the others wait."""
    path = Path(job["out_dir"]) / "hf_tp_checkpoint"
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        model.to(dtype).save_pretrained(path)
    torch.distributed.barrier()
    return path


def own_shards(model: torch.nn.Module) -> None:
    """Give every parameter its own storage of its shard's size.

    transformers 5.25 loads each tensor whole and keeps the rank's shard as a view of it (measured:
    a vocab/2 x hidden embedding shard whose storage holds the whole vocab x hidden); on a GPU the
    move to the rank's device copies the view's elements only, but on CPU ranks the view stays in
    the whole tensor's storage, memory-mapped from the safetensors file, which the CPU allocator's
    live total never sees. Copying each shard here gives the CPU run what a GPU rank holds. A
    parameter tied to another (embedding and head) stays one parameter."""
    from torch.distributed.tensor import DTensor

    fresh: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in fresh:
                    if isinstance(param, DTensor):
                        local = param.to_local().clone(memory_format=torch.contiguous_format)
                        value = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                                   shape=param.shape, stride=param.stride())
                    else:
                        value = param.detach().clone(memory_format=torch.contiguous_format)
                    fresh[id(param)] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
                module._parameters[name] = fresh[id(param)]


def _distribution(tp: int, dp_shard: int) -> dict[str, Any]:
    """How a script asks transformers 5.25 for TP alone, or TP with FSDP2 over dp_shard.

    With FSDP2 the only composition that trains is transformers' own: ``DistributedConfig(tp_plan=
    "auto", tp_size, fsdp_size)`` builds the (fsdp, tp) mesh, applies the TP plan, then FSDP2 by the
    model's fsdp plan (distributed/fsdp.py apply_fully_sharded_data_parallelism: the embedding and
    every block resharded after forward, the final norm and ``lm_head`` one unit kept gathered
    through backward, ``keep_full_weight``; then the root). accelerate's pattern,
    ``from_pretrained(path, tp_plan="auto", device_mesh=mesh["tp"])`` then fully_shard over
    dp_shard, does not: 5.25 drops ``device_mesh`` when ``tp_plan`` is given (modeling_utils.py
    from_pretrained: ``DistributedConfig(tp_plan=tp_plan, tp_size=tp_size)`` and its own mesh), so the
    plan spans the whole world and fully_shard then fails "Cannot concatenate overlapping meshes";
    ``tp_size=2`` on 4 ranks fails "The parallel mesh requires 2 processes, but world_size is 4"
    (both measured on 4 CPU ranks, gloo)."""
    if dp_shard == 1:
        return {"tp_plan": "auto"}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp, fsdp_size=dp_shard)}


def hf_tp_engine(job: dict[str, Any], model: torch.nn.Module, device: torch.device) -> AccumulatingEngine:
    from transformers import AutoModelForCausalLM

    COUNTER.wrap_torch_distributed()
    count_dtensor_collectives(COUNTER)
    settings, parallel = job["torch"], job["parallel"]
    world = torch.distributed.get_world_size()
    tp, dp_shard = int(parallel["tp"]), int(parallel.get("dp_shard", 1))
    if tp * dp_shard != world:
        raise RuntimeError(f"tp_plan=transformers: the probe runs over a (dp_shard, tp) mesh of the whole world "
                           f"(dp_shard {dp_shard} x tp {tp}, world {world})")
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[settings["compute_dtype"]]
    stored = compute if settings["pure_16bit"] else torch.float32
    path = _checkpoint(job, model, stored)
    del model
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=stored, attn_implementation=attention_implementation(job),
                                                  **_distribution(tp, dp_shard))
    loaded.config.use_cache = False
    if device.type == "cpu":  # under FSDP2 too: its lazy init re-reads a swapped shard (reset_sharded_param)
        own_shards(loaded)
    apply_checkpointing(loaded, job)
    loaded.train()
    optimizer = torch_optimizer(job, loaded)
    autocast = None if settings["pure_16bit"] else compute
    return AccumulatingEngine(loaded, optimizer, accumulation=int(job.get("gradient_accumulation", 1)),
                              autocast_dtype=autocast, device=device)
