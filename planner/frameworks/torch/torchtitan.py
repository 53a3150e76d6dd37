"""The torchtitan job config (TOML) of a layout: its degrees, batch, precision, checkpointing and
pipeline stages.

The TOML is torchtitan's JobConfig as its 0.2 line reads it (``--job.config_file``; torchtitan
0.2.2 on PyPI, torchtitan/config/job_config.py): ``[parallelism]`` data_parallel_replicate_degree,
data_parallel_shard_degree, fsdp_reshard_after_forward, tensor_parallel_degree,
enable_async_tensor_parallel, disable_loss_parallel, pipeline_parallel_degree,
pipeline_parallel_schedule, pipeline_parallel_microbatch_size, module_fqns_per_model_part,
context_parallel_degree, expert_parallel_degree; ``[training]`` local_batch_size,
global_batch_size, seq_len, mixed_precision_param, mixed_precision_reduce; ``[activation_checkpoint]``
mode.

torchtitan 0.3.0 (PyPI) reads no TOML: its trainer takes ``--module M --config F`` (a
config_registry function) and ``--section.field`` overrides (torchtitan/config/manager.py
ConfigManager). Its pipeline fields keep the 0.2 names (torchtitan/config/configs.py
ParallelismConfig: pipeline_parallel_degree, pipeline_parallel_schedule,
pipeline_parallel_microbatch_size, module_fqns_per_model_part), so ``pipeline_overrides`` gives
them as command-line overrides beside the file.

Stages. Neither line has a "virtual stages" field: the number of stages is that of
``module_fqns_per_model_part`` when it is given (0.2.2 and 0.3.0 distributed/pipeline_parallel.py:
the given list wins over the generated one, and its length is num_stages), else pp for a
single-stage schedule and 2 x pp for a looped one (``_get_pipeline_metadata``: "default is 2
virtual stages per rank"), split by ``generate_llm_fqn_per_model_part`` with the embedding and
the head weighed as one layer each (pipeline_parallel_first/last_stage_less_layers = 1). That
split is not always the planner's (``planner.parallel.pipeline.stage_bounds``: 5 layers over 2 stages are
2 + 3 here, 3 + 2 there), so the file lists the planner's stages explicitly: the stage count
carries the virtual stages, the lists carry the split the memory was predicted for. Module names:
the 0.2 line's llama (tok_embeddings, layers.N, norm, output); 0.3.0 names the head lm_head.
Uneven stages (pp_first_stage_layers / pp_last_stage_layers) are the same lists, shorter at the
ends; torchtitan's own pipeline_parallel_first/last_stage_less_layers (b5bcd76 config/configs.py)
weigh the ends instead and are ignored when the lists are given. torchtitan itself is not
installed beside the planner: pip's dry run of torchtitan 0.3.0 would change installed packages
(huggingface_hub, pillow, fsspec among them), so the keys are read from its source.
"""

from __future__ import annotations

from typing import Any

# torch.distributed.pipelining's schedule class names, as torchtitan's pipeline_parallel_schedule takes them
# (torch 2.13 schedules.py get_schedule_class; torchtitan b5bcd76 distributed/pipeline_parallel.py places
# ZBVZeroBubble and DualPipeV's two stages per rank in a V, stage_ids_this_rank style "v")
PP_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "gpipe": "GPipe", "looped-bfs": "LoopedBFS",
                "interleaved-zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
# training.mixed_precision_param by the recipe's compute dtype (torchtitan takes bfloat16 or float32 only)
MIXED_PARAM = {"bf16": "bfloat16", "fp32": "float32"}
HEAD_NAME = {"0.2": "output", "0.3": "lm_head"}  # the LM head's module name in torchtitan's llama


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def stage_modules(bounds: list[tuple[int, int]], head: str = HEAD_NAME["0.2"]) -> list[list[str]]:
    """module_fqns_per_model_part of the planner's stages ([first, last) blocks each): the token
    embedding on the first, the final norm and the head on the last."""
    out = []
    for index, (first, last) in enumerate(bounds):
        names = [f"layers.{i}" for i in range(first, last)]
        if index == 0:
            names.insert(0, "tok_embeddings")
        if index == len(bounds) - 1:
            names += ["norm", head]
        out.append(names)
    return out


def torchtitan_config(*, dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int, ep: int,
                      pp_schedule: str, micro_batch: int, gradient_accumulation: int, seq_len: int,
                      compute: str, checkpointing: str, reshard_after_forward: bool,
                      model_name: str, stage_bounds: list[tuple[int, int]] | None = None) -> dict[str, dict[str, Any]]:
    """The sections and values of the job config (what ``torchtitan_toml`` writes). ``stage_bounds``:
    the planner's pp x virtual-stages split (planner.parallel.pipeline.stage_bounds), needed when pp > 1."""
    dp = dp_replicate * dp_shard
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": dp_replicate,
        "data_parallel_shard_degree": dp_shard,
        "fsdp_reshard_after_forward": "default" if reshard_after_forward else "never",
        "tensor_parallel_degree": tp,
        # async TP needs torch.compile and symmetric memory (tensor_parallel.py maybe_enable_async_tp):
        # the estimate assumes neither
        "enable_async_tensor_parallel": False,
        "disable_loss_parallel": False,
        "pipeline_parallel_degree": pp,
        "context_parallel_degree": cp,
        "expert_parallel_degree": ep,
    }
    if pp > 1:
        # pipeline_parallel_microbatch_size: torchtitan cuts local_batch_size into local / this
        # micro-batches (build_pipeline_schedule n_microbatches), the planner's gradient_accumulation
        parallelism["pipeline_parallel_schedule"] = PP_SCHEDULES[pp_schedule]
        parallelism["pipeline_parallel_microbatch_size"] = micro_batch
        parallelism["module_fqns_per_model_part"] = stage_modules(stage_bounds)
    local = micro_batch * (gradient_accumulation if pp > 1 else 1)
    return {
        "job": {"description": f"{model_name}: planner layout dp_replicate {dp_replicate} x dp_shard {dp_shard} "
                               f"x cp {cp} x tp {tp} x pp {pp}"
                               + (f" ({len(stage_bounds)} stages)" if pp > 1 else "")},
        "training": {"local_batch_size": local, "global_batch_size": micro_batch * gradient_accumulation * dp,
                     "seq_len": seq_len, "mixed_precision_param": MIXED_PARAM[compute],
                     # the only value torchtitan takes (0.2.2 job_config.py, 0.3 config/configs.py:93):
                     # the estimate of this job is the one with reduce_dtype fp32 (LAUNCH.md says so)
                     "mixed_precision_reduce": "float32"},
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": "full" if checkpointing == "full" else "none"},
    }


def pipeline_overrides(config: dict[str, dict[str, Any]]) -> list[str]:
    """torchtitan 0.3.0's command-line overrides for the pipeline part of ``config`` (the same field
    names; module_fqns_per_model_part, a list of lists, goes into the config function instead)."""
    p = config["parallelism"]
    if p["pipeline_parallel_degree"] == 1:
        return []
    return [f"--parallelism.{key} {p[key]}" for key in
            ("pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size")] + \
        [f"--training.local_batch_size {config['training']['local_batch_size']}"]


def torchtitan_toml(config: dict[str, dict[str, Any]]) -> str:
    lines = ["# torchtitan job config written by `planner ... --emit` (see LAUNCH.md);",
             "# merge it into your model's train config: [model] and the data paths stay yours."]
    for section, values in config.items():
        lines += ["", f"[{section}]"] + [f"{key} = {_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"
