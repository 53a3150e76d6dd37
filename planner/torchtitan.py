"""The torchtitan job config (TOML) of a layout: its degrees, batch, precision and checkpointing.

Names are torchtitan's JobConfig fields (torchtitan/config/job_config.py, pytorch/torchtitan at
000204a4a8bf3d0f31adc44fc29855fbb6ea13d8; the 0.3 line): ``[parallelism]``
data_parallel_replicate_degree, data_parallel_shard_degree, tensor_parallel_degree,
pipeline_parallel_degree, pipeline_parallel_schedule, context_parallel_degree,
expert_parallel_degree, enable_async_tensor_parallel, disable_loss_parallel;
``[training]`` local_batch_size, global_batch_size, seq_len, mixed_precision_param;
``[activation_checkpoint]`` mode. torchtitan always applies sequence parallelism with TP
(models/llama3/infra/parallelize.py apply_tp: SequenceParallel norms); it has no switch for it.
"""

from __future__ import annotations

from typing import Any

# torch.distributed.pipelining's schedule class names, as torchtitan's pipeline_parallel_schedule takes them
PP_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "gpipe": "GPipe"}
# training.mixed_precision_param by the recipe's compute dtype (torchtitan takes bfloat16 or float32 only)
MIXED_PARAM = {"bf16": "bfloat16", "fp32": "float32"}


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def torchtitan_config(*, dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int, ep: int,
                      pp_schedule: str, micro_batch: int, gradient_accumulation: int, seq_len: int,
                      compute: str, checkpointing: str, reshard_after_forward: bool,
                      model_name: str) -> dict[str, dict[str, Any]]:
    """The sections and values of the job config (what ``torchtitan_toml`` writes)."""
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
        parallelism["pipeline_parallel_schedule"] = PP_SCHEDULES[pp_schedule]
        parallelism["pipeline_parallel_microbatch_size"] = micro_batch
    local = micro_batch * (gradient_accumulation if pp > 1 else 1)
    return {
        "job": {"description": f"{model_name}: planner layout dp_replicate {dp_replicate} x dp_shard {dp_shard} "
                               f"x cp {cp} x tp {tp} x pp {pp}"},
        "training": {"local_batch_size": local, "global_batch_size": micro_batch * gradient_accumulation * dp,
                     "seq_len": seq_len, "mixed_precision_param": MIXED_PARAM[compute]},
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": "full" if checkpointing == "full" else "none"},
    }


def torchtitan_toml(config: dict[str, dict[str, Any]]) -> str:
    lines = ["# torchtitan job config written by `planner ... --emit` (see LAUNCH.md);",
             "# merge it into your model's train config: [model] and the data paths stay yours."]
    for section, values in config.items():
        lines += ["", f"[{section}]"] + [f"{key} = {_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"
