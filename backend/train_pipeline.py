"""Train one rank of a pipeline-parallel job and measure what it allocates (issue 12).

The model is the same transformers model backend/train.py builds (random weights, from its
config), cut into stages by hand as torchtitan does (torchtitan/distributed/pipeline_parallel.py,
"manual split"): every stage runs a contiguous run of decoder layers; the first also the token
embedding, the last also the final norm and the LM head; the loss (transformers'
ForCausalLMLoss, the loss the single-model path computes) runs on the last stage as the
schedule's ``loss_fn``. Each stage is a ``torch.distributed.pipelining.PipelineStage`` and the
step is run by the request's torch 2.13 schedule (torch/distributed/pipelining/schedules.py:
ScheduleGPipe, Schedule1F1B, or a multi-stage one with ``virtual_stages`` stages per rank, looped:
rank r holds stages r, r+pp, r+2pp, ... (ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble), or in a V: stages r and 2pp-1-r (ScheduleZBVZeroBubble,
ScheduleDualPipeV)), as planner/parallel/pipeline.py SCHEDULE_SPECS names them.

Ranks form a mesh (pp, dp, tp), pp outermost and tp innermost as torchtitan's ParallelDims
orders it (build_mesh: pp, dp_replicate, dp_shard, cp, tp), so the tensor-parallel group of a
stage is consecutive ranks and its data-parallel replicas the next stride. With tp > 1 the whole
model is first laid out by backend/train_parallel.py's ``apply_tp`` (torchtitan's apply_tp:
column/row-parallel linears, SequenceParallel norms, vocab-parallel embedding and LM head), then
cut into stages, as torchtitan's pipeline_llm applies TP to each model part: the residual stream
crossing a stage boundary is the local (sequence-sharded under SP) tensor of RowwiseParallel's
output, and the last stage's logits stay a vocab-sharded DTensor for ``loss_parallel``. Over dp
each stage's modules are wrapped by FSDP2 (fully_shard per decoder layer, then the stage), or
left alone (dp = 1).

Memory is measured exactly as the single-model CPU path measures it (backend/train.py
run_profiled_cpu): the c10 CPU allocator's live total, global to every thread
(count_every_thread), sampled at every allocation of the training thread under the profiler.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

from backend.train import (COUNTER, STEP_MARK, _median, _tokens_per_second, _write_last_step_events, build_model,
                           count_every_thread, live_at, resident_by_category, summarize_timeline, synthetic_batch)
from planner.parallel.pipeline import SCHEDULE_SPECS, check_schedule, rank_stages, stage_bounds


class StageModule(torch.nn.Module):
    """One pipeline stage of a decoder-only transformers model: [embedding] layers [norm, head].

    The rotary embedding (no parameters) is recomputed on every stage, as each stage of a
    manually split torchtitan model does."""

    def __init__(self, model: torch.nn.Module, first: int, last: int, is_first: bool, is_last: bool,
                 autocast_dtype: torch.dtype | None, seq_len: int):
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if is_first else None
        self.layers = torch.nn.ModuleList(inner.layers[first:last])
        self.norm = inner.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.rotary_emb = inner.rotary_emb
        self.autocast_dtype = autocast_dtype
        # the positions of the whole sequence: under sequence parallelism a stage receives its
        # tp rank's slice of it, from which the length would come out too short
        self.seq_len = seq_len

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is None:
            return self._forward(hidden)
        with torch.autocast(device_type=hidden.device.type, dtype=self.autocast_dtype):
            return self._forward(hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(hidden)
        positions = torch.arange(self.seq_len, device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            # no mask: transformers' SDPA attention is causal when the mask is None
            # (integrations/sdpa_attention.py), what create_causal_mask leaves for unpadded batches
            hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings,
                           position_ids=positions)
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def _mesh(pp: int, dp: int, tp: int = 1):
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        return init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    return init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def _wrap_data_parallel(stage: StageModule, settings: dict[str, Any], mesh, dtype) -> torch.nn.Module:
    """DDP or FSDP2 over this stage's data-parallel group (torchtitan applies FSDP to each
    stage's model part the same way: every decoder layer a unit, then the part)."""
    if settings["dp_strategy"] == "none":  # else FSDP2, the one wrapper the job allows (backend/job.py)
        return stage
    from torch.distributed.fsdp import fully_shard

    from backend.train import mixed_precision_policy

    mixed = mixed_precision_policy(dtype, settings)
    # torchtitan keeps parameters gathered from forward to backward under PP
    # (reshard_after_forward=False when pp > 1: torchtitan/models/llama3/parallelize.py apply_fsdp),
    # since every micro-batch would otherwise gather them again; the planner models the same.
    options = dict(mesh=mesh["dp"], reshard_after_forward=False, mp_policy=mixed)
    for layer in stage.layers:
        fully_shard(layer, **options)
    fully_shard(stage, **options)
    return stage


class PipelineEngine:
    """What resident_by_category reads: the stages' modules and the optimizer."""

    def __init__(self, modules: list[torch.nn.Module], optimizer: torch.optim.Optimizer):
        self.module = torch.nn.ModuleList(modules)
        self.optimizer = optimizer


def build_pipeline(job: dict[str, Any], device: torch.device):
    from torch.distributed import pipelining

    settings = job["pipeline"]
    pp, virtual, dp = int(settings["pp"]), int(settings["virtual_stages"]), int(settings["dp"])
    schedule_name = settings["schedule"]
    spec = SCHEDULE_SPECS[schedule_name]
    tp = int(settings.get("tp", 1))
    mesh = _mesh(pp, dp, tp)
    pp_rank = mesh["pp"].get_local_rank()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[settings["compute_dtype"]]
    model = build_model(job)
    # the planner's refusals of what torch's schedule refuses (stages per rank, micro-batches)
    check_schedule(pp, schedule_name, virtual, int(job.get("gradient_accumulation", 1)), len(model.model.layers))
    if tp > 1:
        from backend.train_parallel import apply_tp

        apply_tp(model.to(device), mesh["tp"], bool(settings.get("sequence_parallel", True)))
    stages_total = pp * virtual
    # the planner's split: torchtitan's, or the request's uneven first and last stages (Megatron's)
    bounds = stage_bounds(len(model.model.layers), stages_total, settings.get("first_stage_layers"),
                          settings.get("last_stage_layers"))
    mine = list(rank_stages(schedule_name, pp, virtual, pp_rank))  # looped, or the V
    modules, stages = [], []
    autocast = dtype if settings["dp_strategy"] == "none" else None
    for index in mine:
        first, last = bounds[index]
        stage = StageModule(model, first, last, index == 0, index == stages_total - 1, autocast,
                            int(job["seq_len"])).to(device)
        wrapped = _wrap_data_parallel(stage, settings, mesh, dtype)
        modules.append(wrapped)
        stages.append(pipelining.PipelineStage(wrapped, index, stages_total, device, group=mesh["pp"].get_group()))
    del model
    gc.collect()
    vocab = int(job["vocab_size"])

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        if tp > 1:
            # the vocab-sharded logits (a DTensor): backend/train_parallel.py's loss, under the
            # loss_parallel context _pipeline_step holds around the schedule
            shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(),
                                                     ignore_index=-100)
        return ForCausalLMLoss(logits, labels, vocab)

    schedule_class = getattr(pipelining.schedules, spec.torch_class)
    m = int(job.get("gradient_accumulation", 1))
    if spec.stages_per_rank == 1:
        schedule = schedule_class(stages[0], n_microbatches=m, loss_fn=loss_fn)
    else:
        schedule = schedule_class(stages, n_microbatches=m, loss_fn=loss_fn)
    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    optimizer = ({"sgd": lambda: torch.optim.SGD(params, lr=1e-4),
                  "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-4, momentum=0.9)}.get(settings["optimizer"])
                 or (lambda: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)))()
    first_rank = 0 in mine
    last_rank = stages_total - 1 in mine
    return schedule, PipelineEngine(modules, optimizer), first_rank, last_rank


def _pipeline_step(job: dict[str, Any], schedule, engine: PipelineEngine, first_rank: bool, last_rank: bool,
                   device: torch.device, step: int) -> None:
    """One optimizer step: the whole batch (m micro-batches) through the schedule, then the
    optimizer. Every data-parallel replica draws the same synthetic tokens (memory does not
    depend on their values)."""
    m = int(job.get("gradient_accumulation", 1))
    tokens = torch.cat([synthetic_batch(job, step * m + micro, device) for micro in range(m)])
    arguments = (tokens,) if first_rank else ()
    target = tokens if last_rank else None
    if int(job["pipeline"].get("tp", 1)) > 1:
        # the loss and its backward on vocab-sharded logits (torch/distributed/tensor/parallel/loss.py);
        # torchtitan holds the same context around its pipeline schedule's step (train.py train_context)
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            schedule.step(*arguments, target=target, return_outputs=False)
    else:
        schedule.step(*arguments, target=target, return_outputs=False)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    del tokens, target, arguments


def run_pipeline_cpu(job: dict[str, Any], device: torch.device, progress) -> dict[str, Any]:
    count_every_thread()
    trace = bool(job.get("trace_peak"))
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                      with_stack=trace)
    warmup, total = int(job["warmup_steps"]), int(job["warmup_steps"]) + int(job["steps"])
    step_seconds: list[float] = []
    with profiler:
        schedule, engine, first_rank, last_rank = build_pipeline(job, device)
        for step in range(total):
            start = time.perf_counter()
            with torch.profiler.record_function(f"{STEP_MARK}{step}"):
                _pipeline_step(job, schedule, engine, first_rank, last_rank, device, step)
                # as backend/train.py _train_steps: let gloo's threads let go, then sample the total
                torch.distributed.barrier()
                gc.collect()
                sample = torch.empty(1)
                del sample
            step_seconds.append(time.perf_counter() - start)
            progress(step, total)
        collectives = _count_collectives(job, schedule, engine, first_rank, last_rank, device, total)
    timeline = summarize_timeline(profiler, warmup)
    timeline["collectives"] = collectives
    timeline["by_category_resident"] = resident_by_category(engine, timeline["resident_bytes"])
    timeline["step_seconds"] = _median(step_seconds[warmup:])
    timeline["tokens_per_second"] = _tokens_per_second(job, timeline["step_seconds"])
    timeline["all_step_seconds"] = step_seconds
    timeline["pipeline"] = dict(job["pipeline"], first_stage=first_rank, last_stage=last_rank)
    if trace:
        timeline["live_at_peak"] = live_at(profiler, timeline["peak_time_ns"])
        timeline["live_at_end"] = live_at(profiler, timeline["end_time_ns"])
        _write_last_step_events(profiler, job, int(os.environ.get("RANK", "0")))
    return timeline


def _count_collectives(job, schedule, engine, first_rank, last_rank, device, step) -> dict[str, Any]:
    """One more step with every collective and point-to-point send counted (payload and time),
    outside the measured windows. A stage's sends are the P2POps its get_fwd_send_ops /
    get_bwd_send_ops return (pipelining/stage.py); the counted size is what this rank sends."""
    COUNTER.wrap_torch_distributed()
    if int(job["pipeline"].get("tp", 1)) > 1:
        from backend.train_parallel import count_dtensor_collectives

        count_dtensor_collectives(COUNTER)  # the TP/SP redistributions of the stages' DTensors
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    originals = []
    for stage in stages:
        for name, label in (("get_fwd_send_ops", "send activations (p2p)"), ("get_bwd_send_ops", "send gradients (p2p)")):
            original = getattr(stage, name)
            originals.append((stage, name, original))

            def counted(*args, _original=original, _label=label, **kwargs):
                ops = _original(*args, **kwargs)
                for op in ops:
                    COUNTER.add(_label, op.tensor.numel() * op.tensor.element_size())
                return ops

            setattr(stage, name, counted)
    COUNTER.counts, COUNTER.seconds, COUNTER.on = {}, {}, True
    try:
        _pipeline_step(job, schedule, engine, first_rank, last_rank, device, step)
    finally:
        COUNTER.on = False
        for stage, name, original in originals:
            setattr(stage, name, original)
    return {name: {"calls": sum(sizes.values()), "bytes": sum(size * n for size, n in sizes.items()),
                   "seconds": float(COUNTER.seconds.get(name, 0.0))}
            for name, sizes in sorted(COUNTER.counts.items())}
