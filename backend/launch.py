"""Launch a configuration through the real `deepspeed` launcher and collect every rank's record.

The launcher is started by a supervisor process (backend/supervisor.py), which ends the launcher's
group and every descendant when the run ends: at its end, on a timeout, a crashing rank, a cancel,
Ctrl-C, SIGTERM or SIGHUP of the owner, and on the owner's death however it died (SIGKILL
included). No rank is left behind and no /dev/shm segment of the run stays. Heavy imports (torch,
deepspeed) happen only in the ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.recipes.finetune import lora_config
from planner.recipes.loop import metric_autocasts
from backend.job import VerifyJob
from planner.errors import PlannerError
from planner.frameworks import framework as lookup_framework
from planner.frameworks.deepspeed.launch import DeepSpeedLauncher
from planner.frameworks.launcher import Launcher
from planner.frameworks.torch.v2 import FULL_SHARD, HYBRID_SHARD
from planner.memory.orchestrator import position_limit_error, resolve
from planner.schema import EstimateRequest
from planner.setup import Setup

WORKER = Path(__file__).with_name("worker.py")
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ProbeResult:
    status: str  # ok | oom | crashed | timeout | interrupted | launcher-error
    ranks: list[dict[str, Any]]
    job: VerifyJob
    log_tail: str
    seconds: float
    message: str = ""
    returncode: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def worker_job(request: EstimateRequest, *, steps: int, warmup_steps: int, out_dir: Path,
               setup: Setup | None = None) -> VerifyJob:
    """What every rank needs: the architecture, the DeepSpeed config the prediction assumed.
    ``setup``: the request already resolved (the prediction's own), not resolved again."""
    setup = setup if setup is not None else resolve(request)
    request = setup.request  # with what a --ds-config fixed: precision, micro-batch, accumulation, optimizer
    if setup.model.config is None:
        raise PlannerError("a real run needs an architecture: give --model or --model-file, not --params",
                           field="model")
    too_long = position_limit_error(setup)
    if too_long:
        raise PlannerError(too_long, field="seq_len")
    model_parallel = {n: getattr(setup.dims, n) for n in ("tp", "pp", "cp", "ep") if getattr(setup.dims, n) > 1}
    if request.activation_offload and model_parallel:
        raise PlannerError(f"activation_offload with {', '.join(f'{n}={d}' for n, d in model_parallel.items())}: the "
                           "model-parallel probes do not run TRL's offloading; estimate it (unverified)",
                           field="activation_offload")
    if setup.arch is not None and setup.arch.vision_numels and model_parallel:
        # the tp/pp/cp/ep probes walk the text decoder's blocks (model.model.layers), not a
        # conditional-generation class's language_model
        raise PlannerError(f"{', '.join(f'{n}={d}' for n, d in model_parallel.items())} with the vision tower counted: "
                           "the model-parallel probes build the text decoder; give text_only", field="text_only")
    probe_optimizers = setup.framework.probe_optimizers if request.pp == 1 else ("adamw", "sgd", "sgd-momentum")
    if request.optimizer not in probe_optimizers:
        # DeepSpeed's probe trains what its config names (a client optimizer is the training script's),
        # the pipeline probe torch's AdamW and SGD: either would measure another optimizer than predicted.
        raise PlannerError(f"optimizer {request.optimizer} with strategy {setup.strategy.name}, pp={request.pp}: the "
                           f"probe trains {', '.join(probe_optimizers)} there", field="optimizer")
    if request.loss == "chunked" and setup.strategy.shards_parameters:
        # backend/losses.py calls the LM head from its own forward, beside FSDP2's root: the run
        # crashed there (the head's unsharded storage freed); the estimate stands unverified
        raise PlannerError("loss=chunked with a sharded strategy: the probe's chunked loss runs under single, ddp and "
                           "zero0-2 only", field="loss")
    if request.loss in ("liger-fused", "cce") and setup.strategy.shards_parameters:
        # backend/losses.py FusedLinearLoss reads the LM head's weight from its own forward, beside
        # FSDP2's root, as the chunked loss does
        raise PlannerError(f"loss={request.loss} with a sharded strategy: the probe's fused loss runs under single, "
                           "ddp and zero0-2 only", field="loss")
    if request.loss == "flash-attn" and setup.strategy.shards_parameters:
        # backend/losses.py FlashAttnLoss wraps the model as the fused losses do (above)
        raise PlannerError("loss=flash-attn with a sharded strategy: the probe's flash-attn loss runs under single, "
                           "ddp and zero0-2 only", field="loss")
    if request.fsdp_version == 1:
        # the probe wraps the model with FSDP2's fully_shard (backend/train.py); FSDP1's memory is estimated
        # with FSDP2's per-unit model (planner/jobfiles/accelerate_config.py FSDP1_NOTE)
        raise PlannerError("fsdp_version=1: the probe trains FSDP2 (fully_shard), not FSDP1; the estimate of an FSDP1 "
                           "job uses FSDP2's per-unit memory model, verify it as fsdp_version 2", field="fsdp_version")
    parallel = {n: d for n, d in (("tp", request.tp), ("cp", request.cp), ("ep", request.ep)) if d > 1}
    if request.defer_gradient_sync and parallel:
        # ParallelEngine (backend/train_parallel.py) syncs every micro-batch: only TorchEngine defers
        raise PlannerError(f"defer_gradient_sync with {', '.join(f'{n}={d}' for n, d in parallel.items())}: the "
                           "probe's model-parallel engines sync every micro-batch; verify it data-parallel",
                           field="defer_gradient_sync")
    if request.async_tp:
        # symmetric memory over NVLink: neither gloo CPU ranks nor the probe's eager TP run it
        raise PlannerError("async_tp: the probe trains torch's TP eager, without symmetric memory; estimate it "
                           "without verify", field="async_tp")
    if request.compile != "none":
        # the probe trains eager (backend/train.py); compile's memory is eager's saved set, an upper bound
        # (planner/recipes/compile.py), and its step time is a GPU's
        raise PlannerError(f"compile {request.compile}: the probe trains the model eager; the estimate's memory is "
                           "eager's (an upper bound for a compiled run), estimate it without verify", field="compile")
    if request.fused_kernels and (setup.gpu.is_cpu or model_parallel):
        # Liger's kernels are Triton, GPU only (the estimate refuses them on CPU ranks first); the probe patches
        # them into the single-model trainer (backend/train.py, backend/fused_kernels.py), not the model-parallel
        # ones, which build their own modules
        raise PlannerError(f"fused_kernels={','.join(request.fused_kernels)}: the probe patches Liger's kernels on a "
                           "GPU into a data-parallel model only (the tp, cp, pp and ep probes build their own "
                           "modules); this layout stays unverified, estimate it without verify", field="fused_kernels")
    if request.low_precision in ("nvfp4", "te-fp8"):
        raise PlannerError(f"low_precision={request.low_precision}: the probe swaps torchao's float8 and mxfp8 "
                           "linears only (backend/low_precision.py); this recipe stays unverified", field="low_precision")
    common = {
        "model_config": setup.model.config,
        "attn_implementation": request.attention,
        "checkpointing": request.checkpointing,
        "checkpointing_every": request.checkpointing_every,
        "loss": request.loss,
        "loss_chunks": setup.loss_chunks,
        "micro_batch": request.micro_batch,
        "seq_len": request.seq_len,
        "gradient_accumulation": request.gradient_accumulation,
        "steps": steps,
        "warmup_steps": warmup_steps,
        "device": "cpu" if setup.gpu.is_cpu else "cuda",
        "dist_backend": "gloo" if setup.gpu.is_cpu else None,
        "out_dir": str(out_dir),
        "seed": 0,
        "keeps_outputs": request.keeps_outputs,
        "train_metrics": request.train_metrics,
        "metric_autocast": (setup.recipe.autocast_dtype
                            if metric_autocasts(setup.framework, setup.recipe.autocast_dtype) else None),
        "vision": bool(setup.arch is not None and setup.arch.vision_numels),
        "activation_offload": request.activation_offload,
    }
    if request.fused_kernels:
        common["fused_kernels"] = request.fused_kernels
    if request.low_precision != "none":
        common["low_precision"] = request.low_precision
        common["float8_all_gather"] = request.float8_all_gather
    if setup.dims.pp > 1:
        return VerifyJob(**(common | _pipeline_settings(setup, request)))
    if setup.finetune is not None:
        common["finetune"] = finetune_job(setup)
    if setup.dims.ep > 1:
        return VerifyJob(**(common | setup.framework.worker_settings(setup, request) | _expert_settings(setup, request)))
    settings = setup.framework.worker_settings(setup, request)
    if setup.tp > 1 and setup.framework.autotp:
        # AutoTP training (deepspeed 0.19.8 runtime/engine.py _configure_tensor_parallel): the engine
        # splits the linears over tp consecutive ranks when the config names the degree
        settings["ds_config"]["tensor_parallel"] = {"autotp_size": setup.tp}
    elif setup.tp > 1 or setup.dims.cp > 1:
        settings = settings | {"parallel": _parallel_settings(request, setup)}
    return VerifyJob(**(common | settings))


def finetune_job(setup) -> dict[str, Any]:
    """What backend/finetune.py builds: the resolved LoraConfig and quantization, and the dtype the
    frozen base is loaded in (the recipe's 16-bit type, or fp32)."""
    f, recipe = setup.finetune, setup.recipe
    return {"rank": f.rank, "alpha": f.alpha, "dropout": f.dropout, "quantize": f.quantize,
            "double_quant": f.double_quant,
            "targets": f.peft_targets(), "modules_to_save": lora_config(f)["modules_to_save"],
            "compute_dtype": recipe.reduced_dtype,
            "base_dtype": None if recipe.weight_bits == 32 else recipe.reduced_dtype}


# What each probe runs, by transformers model_type: one table. Every family trains whole (train.py:
# DeepSpeed ZeRO, DDP, FSDP2); the two model-parallel probes name modules, so each runs only on the
# families whose modules are those names, and tried there:
# - "tp" (backend/train_parallel.py apply_tp): model.embed_tokens, model.norm, lm_head and, per block,
#   self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm;
# - "pp" (backend/train_pipeline.py StageModule): model.{embed_tokens, layers, norm, rotary_emb} and
#   lm_head, each layer called as layer(hidden, attention_mask=None, position_embeddings=...), the mask
#   left to SDPA's causal path.
# A family lists the probes it runs; each probe it does not run has its reason in PROBE_REFUSALS.
# The EP probe (backend/train_experts.py) swaps transformers 5's fused experts module, (E, ...)
# tensors under @use_experts_implementation (integrations/moe.py), for its all-to-all forward.
PROBES: dict[str, str] = {"tp": "tensor-parallel", "pp": "pipeline", "ep": "expert-parallel",
                          "cp": "context-parallel"}
FAMILY_PROBES: dict[str, tuple[str, ...]] = {
    "llama": ("tp", "pp", "cp"),
    "mistral": ("tp", "pp", "cp"),
    "qwen2": ("tp", "pp", "cp"),
    "qwen3": ("pp",),
    "qwen3_moe": ("pp", "ep"),
    "olmo2": ("pp",),
    "smollm3": ("pp",),
    "qwen2_moe": ("ep",),
    "mixtral": ("ep",),
    "deepseek_v2": ("ep",),
    "deepseek_v3": ("ep",),
    "gpt_oss": ("ep",),
}
PROBE_REFUSALS: dict[tuple[str, str], str] = {
    ("qwen3", "tp"): "its names are the plan's, with per-head q/k norms a column split keeps whole, but no TP run "
                     "of it has been measured",
    ("smollm3", "tp"): "llama-shaped (its NoPE layers skip RoPE only), but no TP run of it has been measured",
    ("qwen3_moe", "tp"): "its MLP is a sparse MoE block (mlp.gate router, mlp.experts), not the gate/up/down "
                         "projections the TP plan splits",
    ("llama4_text", "ep"): "Llama4TextExperts runs every expert on every token (dense bmm over all experts), "
                           "not the routed fused-experts module the probe shards",
    ("llama4", "ep"): "Llama4TextExperts runs every expert on every token (dense bmm over all experts), "
                      "not the routed fused-experts module the probe shards",
    ("olmo2", "tp"): "its q/k norms span the whole projection (Olmo2Attention q_norm over heads x head_dim), which a "
                     "column split would normalise per shard, and it has no input_layernorm for SequenceParallel",
}
_DENSE = "a dense model: it has no routed experts for the expert-parallel probe to shard"
_MOE_MLP = ("its MLP is a sparse MoE block (a router and a fused experts module), not the gate/up/down "
            "projections the TP plan splits")
PROBE_REFUSALS |= {(family, "ep"): _DENSE for family in ("llama", "mistral", "qwen2", "qwen3", "olmo2", "smollm3")}
PROBE_REFUSALS |= {(family, "tp"): _MOE_MLP for family in ("qwen2_moe", "mixtral", "gpt_oss")}
PROBE_REFUSALS |= {
    ("qwen2_moe", "pp"): "llama-shaped modules, but no pipeline run of it has been measured",
    ("mixtral", "pp"): "llama-shaped modules, but no pipeline run of it has been measured",
    ("deepseek_v2", "tp"): "multi-head latent attention, which the planner's TP refuses",
    ("deepseek_v3", "tp"): "multi-head latent attention, which the planner's TP refuses",
    ("deepseek_v2", "pp"): "its dense-then-MoE stack has not been cut into pipeline stages by a measured run",
    ("deepseek_v3", "pp"): "its dense-then-MoE stack has not been cut into pipeline stages by a measured run",
    ("gpt_oss", "pp"): "its layers need attention sinks and sliding-window masks the pipeline stages do not pass",
}
# context parallelism (backend/context_parallel.py) shards the sequence of a llama-shaped decoder
# whose attention runs transformers' SDPA causal without a mask; what the others add was not run
PROBE_REFUSALS |= {(family, "cp"): "no context-parallel run of it has been measured (the probe was tried on "
                                   "llama, mistral and qwen2 decoders)" for family in ("qwen3", "smollm3", "olmo2")}
PROBE_REFUSALS |= {(family, "cp"): "its MoE blocks are not run under context parallelism by the probe"
                   for family in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss")}
# families outside the table: their CausalLM is not model.{embed_tokens, layers, norm} + lm_head
# (gpt2: transformer.{wte, wpe, h} with fused Conv1D c_attn; phi3: fused qkv_proj and gate_up_proj),
# or a layer needs what the probes do not pass (gemma2/gemma3: sliding-window masks, Gemma3's second
# rotary table; gpt_oss: sinks and sliding masks; deepseek_v2/v3: MLA, which the planner's TP refuses)
OUTSIDE_TABLE = "its modules are not the llama-shaped names the probes split (see backend/launch.py FAMILY_PROBES)"


def check_probe(model_type: str | None, probe: str, degree: str) -> None:
    """Refuse, with the table's reason, a model-parallel probe the family does not run."""
    if probe in FAMILY_PROBES.get(model_type or "", ()):
        return
    why = PROBE_REFUSALS.get((model_type or "", probe), OUTSIDE_TABLE)
    runs = sorted(f for f, probes in FAMILY_PROBES.items() if probe in probes)
    raise PlannerError(f"{degree}: the {PROBES[probe]} probe does not run model_type {model_type!r}: {why}; it runs "
                       f"{', '.join(runs)}; model_type {model_type!r} is estimated, not probed",
                       field=probe if probe in ("tp", "cp") else "model")


def _parallel_settings(request: EstimateRequest, setup) -> dict[str, Any]:
    """How the rank lays out tensor and context parallelism (backend/train_parallel.py): a
    (dp_replicate, dp_shard, cp, tp) mesh, tp innermost; FSDP2 over dp_shard (x cp) when there is
    more than one rank to shard over, HSDP over (dp_replicate, dp_shard x cp) with strategy hsdp."""
    model_type = setup.model.config.get("model_type")
    cp = setup.dims.cp
    if request.tp_plan == "transformers":
        return _hf_tp_settings(request, setup)
    if cp > 1:
        _check_context_parallel_probe(request, setup, model_type)
    dp = setup.world_size // (setup.tp * cp)
    sharding = setup.framework.fsdp_sharding(setup.strategy)
    if (dp > 1 and sharding not in (FULL_SHARD, HYBRID_SHARD)) or (setup.tp > 1 and sharding == HYBRID_SHARD):
        raise PlannerError(f"tp={setup.tp} with strategy {request.strategy} over {dp} data-parallel ranks: the probe "
                           "composes TP with FSDP2 (strategy fsdp) only", field="tp")
    if setup.tp > 1:
        check_probe(model_type, "tp", f"tp={setup.tp}")
    if setup.zero.offload_params != "none":
        # apply_fsdp passes no CPUOffloadPolicy: the run would keep on the device what the estimate offloads
        raise PlannerError(f"offload_params={setup.zero.offload_params} with tp={setup.tp}, cp={cp}: the tensor/context-"
                           "parallel probe's FSDP2 does not offload; verify it without offload", field="offload_params")
    replicas = setup.dims.dp_replicate if setup.strategy.shard_within_node else 1
    return {"dp_replicate": replicas, "dp_shard": dp // replicas, "tp": setup.tp,
            "sequence_parallel": setup.sequence_parallel, "cp": cp}


def _hf_tp_settings(request: EstimateRequest, setup) -> dict[str, Any]:
    """transformers' own TP (backend/hf_tensor_parallel.py): the model loaded with
    from_pretrained(tp_plan="auto") over every rank of the run, or, with FSDP2 over dp_shard,
    with transformers' own DistributedConfig(tp_size, fsdp_size) composition; the core refused what
    transformers refuses (planner/parallel/hf_plan.py)."""
    d = setup.dims
    if d.tp * d.dp_shard != setup.world_size or d.dp_replicate > 1:
        raise PlannerError(f"tp={d.tp} with tp_plan=transformers over {setup.world_size} ranks: the probe loads the "
                           "model over a (dp_shard, tp) mesh of the whole world (dp_replicate 1)", field="tp")
    if d.dp_shard > 1 and setup.recipe.compute != "fp32":
        # DistributedConfig(fsdp_mixed_precision=True) is MixedPrecisionPolicy(bf16, reduce fp32) and
        # nothing else (transformers 5.25 distributed/fsdp.py _get_fsdp_policy_kwargs): not probed
        raise PlannerError(f"precision {request.precision} with tp_plan=transformers and FSDP2 over dp_shard "
                           f"{d.dp_shard}: the probe runs transformers' TP x FSDP2 composition in fp32 only",
                           field="precision")
    if setup.zero.offload_params != "none":
        raise PlannerError(f"offload_params={setup.zero.offload_params} with tp_plan=transformers: the probe does not "
                           "offload", field="offload_params")
    return {"dp_replicate": 1, "dp_shard": d.dp_shard, "tp": d.tp, "sequence_parallel": False, "cp": 1,
            "tp_plan": "transformers"}


def _check_context_parallel_probe(request: EstimateRequest, setup, model_type) -> None:
    """What the CP probe runs: torch's context_parallel (ring attention over the cp ranks, the
    sequence load-balanced head-tail) on a llama-shaped decoder, FSDP2 over dp_shard x cp, as
    torchtitan composes it (backend/context_parallel.py); with strategy hsdp, FSDP2 on the 2-D
    mesh (dp_replicate, dp_shard x cp): replicated over the first, sharded over the second
    (torchtitan's parallelize.py: dp_mesh_dim_names ("dp_replicate", "dp_shard_cp")). With tp > 1
    the blocks are first laid out by the TP plan (apply_tp: each rank's SDPA sees its heads/tp
    heads, whose local q/k/v the ring shards over cp), torchtitan's order (parallelize.py:
    apply_tp, then context_parallel per step, then FSDP2 over dp_shard x cp); the TP probe's own
    family checks apply (_parallel_settings). HSDP x CP x TP is not probed."""
    cp = setup.dims.cp
    sharding = setup.framework.fsdp_sharding(setup.strategy)
    hsdp = sharding == HYBRID_SHARD
    if sharding != FULL_SHARD and not (hsdp and setup.tp == 1):
        raise PlannerError(f"cp={cp} with strategy {request.strategy}{f' and tp={setup.tp}' if hsdp else ''}: the "
                           "probe composes context parallelism with FSDP2 over dp_shard x cp (strategy fsdp, with tp "
                           "or without), or with HSDP over (dp_replicate, dp_shard x cp) (strategy hsdp, tp 1), as "
                           "torchtitan does", field="cp")
    check_probe(model_type, "cp", f"cp={cp}")


def _expert_settings(setup, request: EstimateRequest) -> dict[str, Any]:
    """An expert-parallel run (backend/train_experts.py): routed experts over ep consecutive ranks,
    all-to-all dispatch and combine, FSDP2 over every rank for the rest and over the ranks holding
    the same experts for them (torchtitan's composition). What it does not run is refused here."""
    d, s = setup.dims, setup.strategy
    if setup.framework.fsdp_sharding(s) is None:  # FSDP2 (fsdp, fsdp-grad-op, hsdp)
        raise PlannerError(f"ep={d.ep} with strategy {request.strategy}: the probe runs expert parallelism with "
                           "FSDP2 (strategy fsdp or fsdp-grad-op), as torchtitan composes it; DeepSpeed-MoE's expert "
                           "groups need its deepspeed.moe MoE layers, which a transformers model does not have",
                           field="ep")
    if d.dp_replicate > 1 or setup.zero.offload_params != "none":
        raise PlannerError(f"ep={d.ep} with strategy {request.strategy}{' and offload' if d.dp_replicate == 1 else ''}: "
                           "the expert-parallel probe shards over one data-parallel dimension without offload; "
                           "use --strategy fsdp", field="ep")
    if d.tp > 1 or d.cp > 1 or d.pp > 1:
        raise PlannerError(f"ep={d.ep} with tp={d.tp}, cp={d.cp}, pp={d.pp}: the expert-parallel probe runs ep x "
                           "FSDP2 only", field="ep")
    if setup.finetune is not None:
        raise PlannerError(f"ep={d.ep} with finetune {request.finetune}: expert parallelism is modelled for full "
                           "fine-tuning", field="ep")
    check_probe(setup.model.config.get("model_type"), "ep", f"ep={d.ep}")
    if setup.gpu.is_cpu is False:
        raise PlannerError(f"ep={d.ep} on {setup.gpu.name}: the expert-parallel probe runs on CPU ranks (--gpu cpu)",
                           field="gpu")
    return {"experts": {"ep": d.ep}}


def _pipeline_settings(setup, request: EstimateRequest) -> dict[str, Any]:
    """A pipeline-parallel run (backend/train_pipeline.py): torch.distributed.pipelining stages on
    a (pp, dp) mesh, FSDP2 over dp > 1 or no wrapper at dp = 1, as planner.parallel.pipeline models it."""
    d = setup.dims
    if setup.framework.own_pipeline_engine:
        raise PlannerError(f"pp={d.pp} with strategy {request.strategy}: verify runs pipeline stages with torch's "
                           "pipelining; DeepSpeed's pipeline engine needs a PipelineModule the probe does not build: "
                           "verify with --strategy fsdp (or ddp at one data-parallel rank)", field="pp")
    if d.dp > 1 and not setup.strategy.shards_parameters:
        # torch 2.13: DDP under the pipelining schedules fails in its reducer on the second
        # micro-batch ("params_.size() == rebuilt_param_indices_.size() INTERNAL ASSERT FAILED")
        raise PlannerError(f"pp={d.pp} with strategy {request.strategy} over {d.dp} data-parallel ranks: torch 2.13's "
                           "DDP fails under the pipelining schedules; verify with --strategy fsdp (torchtitan's "
                           "composition)", field="pp")
    if d.dp > 1 and d.dp_replicate > 1:
        raise PlannerError(f"pp={d.pp} with strategy {request.strategy}: verify shards over one data-parallel "
                           "dimension; use --strategy fsdp", field="pp")
    if d.cp > 1 or d.ep > 1:
        raise PlannerError(f"pp={d.pp} with cp={d.cp}, ep={d.ep}: the pipeline probe runs pp x dp x tp only (CP: its "
                           "schedule does not run the stages inside torch's context_parallel; EP is not probed)",
                           field="pp")
    if setup.recipe.casts_model:  # the probe autocasts over fp32 parameters (or FSDP2's mixed precision)
        raise PlannerError(f"precision={request.precision} with pp={d.pp}: the pipeline probe trains fp32, or "
                           "bf16-mixed / fp16-mixed (autocast, or FSDP2's mixed precision)", field="precision")
    model_type = setup.model.config.get("model_type")
    check_probe(model_type, "pp", f"pp={d.pp}")
    if d.tp > 1:
        check_probe(model_type, "tp", f"pp={d.pp} x tp={d.tp}")
    from planner.model.architecture import from_hf_config

    return {"framework": setup.framework.name, "vocab_size": from_hf_config(dict(setup.model.config)).vocab_size,
            "pipeline": {"pp": d.pp, "dp": d.dp, "schedule": request.pp_schedule,
                         "virtual_stages": request.pp_virtual_stages,
                         "first_stage_layers": request.pp_first_stage_layers,
                         "last_stage_layers": request.pp_last_stage_layers,
                         "dp_strategy": "fsdp" if d.dp > 1 else "none",
                         "compute_dtype": setup.recipe.autocast_dtype, "reduce_dtype": request.reduce_dtype,
                         "optimizer": request.optimizer, "tp": d.tp, "sequence_parallel": setup.sequence_parallel}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_command(job_path: Path, request: EstimateRequest, hostfile: str | None = None,
                     port: int | None = None, framework: str = "deepspeed", device: str = "cuda") -> list[str]:
    """The real launcher of ``framework``'s ranks (its Launcher.verify_command: `deepspeed` for ZeRO,
    torch.distributed.run for DDP/FSDP), with what it needs found here: the program on PATH
    (or beside this Python) and CUDA_VISIBLE_DEVICES."""
    launcher = _launcher(framework, request)
    program = shutil.which(launcher.program) or str(Path(sys.executable).with_name(launcher.program))
    return launcher.verify_command(request, [str(WORKER), "--job", str(job_path)], port or _free_port(),
                                   python=sys.executable, program=program, hostfile=hostfile, device=device,
                                   visible=_visible_ids())


def _launcher(framework: str, request: EstimateRequest) -> Launcher:
    """The Launcher of the framework version the request was resolved at."""
    return lookup_framework(framework, request.framework_version).launch


def _visible_ids() -> list[str]:
    """CUDA_VISIBLE_DEVICES's ids; [] when it is unset or empty (DeepSpeed's runner, too, takes an
    empty value as unset: runner.py:451 ``len(visible_devices)``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ""
    return [v.strip() for v in visible.split(",") if v.strip()]


def gpu_ids(request: EstimateRequest, framework: str) -> list[str]:
    """The GPUs this host's ranks run on, as CUDA_VISIBLE_DEVICES names them (physical indices
    when it is unset): what the device locks hold (backend.verify.device_names) and what
    launcher_command names (the framework's Launcher.device_ids)."""
    return _launcher(framework, request).device_ids(request, _visible_ids())


def extensions_dir() -> Path:
    """A torch-extensions directory of the planner's own, one per Python and torch: another venv's
    rebuild of the same op never races with ours."""
    import hashlib

    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "planner"
    try:
        import importlib.metadata

        torch_version = importlib.metadata.version("torch")
    except Exception:
        torch_version = "unknown"
    key = hashlib.sha1(f"{sys.executable}|{torch_version}".encode()).hexdigest()[:12]
    return base / f"torch_extensions-{key}"


def prepare_extensions(env: dict[str, str], timeout_seconds: float = 900.0,
                       ops: tuple[str, ...] = DeepSpeedLauncher.cpu_ops) -> None:
    """Build DeepSpeed's JIT ops (``ops``: the framework's Launcher.cpu_ops) once, before any rank starts.

    torch's cpp_extension guards a build with a bare lock file (FileBaton); a process killed while
    it holds that file (a timeout, Ctrl-C) leaves it behind, and every later rank then waits for it
    forever. Here one planner process at a time builds, under an fcntl lock the kernel releases if
    the holder dies, and removes a baton left by a build that was killed; the ranks then only load."""
    import fcntl

    directory = extensions_dir()
    directory.mkdir(parents=True, exist_ok=True)
    env["TORCH_EXTENSIONS_DIR"] = str(directory)
    with open(directory / ".planner-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for baton in directory.glob("*/lock"):
            baton.unlink(missing_ok=True)
        code = ("from deepspeed.accelerator import get_accelerator\n"
                f"for name in {ops!r}:\n"
                "    builder = get_accelerator().create_op_builder(name)\n"
                "    if builder is not None and builder.is_compatible():\n"
                "        builder.load(verbose=False)\n")
        try:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  timeout=timeout_seconds, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise PlannerError(f"building DeepSpeed's CPU ops took over {timeout_seconds:.0f} s", field=None) from None
        if done.returncode != 0:
            raise PlannerError("building DeepSpeed's CPU ops failed: " + (done.stderr.strip().splitlines() or ["?"])[-1],
                               field=None)


SECRET_ENV = ("PLANNER_API_TOKEN", "PLANNER_API_TOKEN_FILE")


class Interrupted(KeyboardInterrupt):
    """The owner was asked to stop by a signal (SIGTERM, SIGHUP): handled like Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _environment(job: VerifyJob) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"  # nothing is ever downloaded
    env["TRANSFORMERS_OFFLINE"] = "1"
    for secret in SECRET_ENV:  # the API's token never reaches a training rank
        env.pop(secret, None)
    if job.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_probe(request: EstimateRequest, *, out_dir: Path, steps: int = 2, warmup_steps: int = 1,
              timeout_seconds: float = 900.0, hostfile: str | None = None,
              on_progress=None, cancel=None, lock_fds: tuple[int, ...] = (), db: str | None = None,
              run_id: int | None = None, registry: Path | None = None, setup: Setup | None = None) -> ProbeResult:
    """``cancel``: an object with ``is_set()`` (a threading.Event); when set, every rank is ended
    and the result is 'cancelled' (or the event's ``status``/``message`` attributes, when it has
    them: the server sets 'interrupted' when it stops). ``lock_fds``: the device locks, held by the
    supervisor until the last process of the run is gone. ``db``/``run_id``: where the supervisor
    records the run as interrupted if this process dies. ``registry``: where the supervisor
    registers the run, so that the next verify removes its /dev/shm segments if the supervisor
    itself is killed (backend.supervisor.clean_stale_runs). ``setup``: the request as the
    prediction resolved it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    job = worker_job(request, steps=steps, warmup_steps=warmup_steps, out_dir=out_dir, setup=setup)
    job_path = out_dir / "job.json"
    job_path.write_text(job.to_json())
    log_path = out_dir / "launcher.log"
    port = _free_port()
    command = launcher_command(job_path, request, hostfile, port, job.framework, job.device)
    start = time.monotonic()
    env = _environment(job)
    ops = _launcher(job.framework, request).cpu_ops
    if job.device == "cpu" and ops:
        prepare_extensions(env, ops=ops)
    log_path.write_bytes(b"")
    spec = {"command": command, "cwd": str(REPO_ROOT), "env": env, "log_path": str(log_path), "port": port,
            "state_path": str(out_dir / "supervisor.json"), "result_path": str(out_dir / "supervisor-result.json"),
            "db": db, "run_id": run_id, "owner_pid": os.getpid(), "grace_seconds": GRACE_SECONDS,
            "registry": str(registry) if registry else None}
    try:
        supervisor, stop_fd = _start_supervisor(spec, out_dir, env, lock_fds)
    except OSError as exc:
        return ProbeResult("launcher-error", [], job, "", 0.0, f"cannot start the run's supervisor: {exc}")
    status, message = "ok", ""
    try:
        finished = _wait(supervisor, start, timeout_seconds, out_dir, on_progress, cancel,
                         world=request.world_size)
        if finished == "recorded":  # every rank wrote its record; a teardown that hung was ended
            finished, torn_down = True, False
        else:
            torn_down = True
        if not finished and cancel is not None and cancel.is_set():
            status = getattr(cancel, "status", "cancelled")
            message = getattr(cancel, "message", "cancelled") + "; all ranks ended"
        elif not finished:
            status, message = "timeout", f"no result after {timeout_seconds:.0f} s; all ranks ended"
    except KeyboardInterrupt as exc:
        why = str(exc) if isinstance(exc, Interrupted) else "Ctrl-C"
        status, message = "interrupted", f"interrupted ({why}); all ranks ended"
    finally:
        outcome = _stop_supervisor(supervisor, stop_fd, spec)
    returncode = outcome.get("returncode")
    ranks = _collect(out_dir, request.world_size)
    if status == "ok" and outcome.get("reason") == "launch-failed":
        status, message = "launcher-error", f"cannot start the launcher: {outcome.get('error', '?')}"
    elif status == "ok" and outcome.get("reason") == "terminated":
        status, message = "interrupted", "the run's supervisor was terminated; all ranks ended"
    elif status == "ok" and "reason" not in outcome:
        status, message = "launcher-error", (f"the run's supervisor ended without a result (exit "
                                             f"{supervisor.returncode}); see {out_dir / 'supervisor.log'}")
    if status == "ok":
        # ranks that all wrote their records trained; a launcher ended in its teardown has no code
        status, message = _verdict(ranks, returncode if torn_down else 0, request.world_size)
        if not torn_down and status == "ok":
            message += f" (the process groups' teardown did not end within {TEARDOWN_SECONDS:.0f} s; ended)"
    return ProbeResult(status, ranks, job, _tail(log_path), time.monotonic() - start, message, returncode)


GRACE_SECONDS = 5.0  # SIGTERM, then this long, then SIGKILL


def _start_supervisor(spec: dict, out_dir: Path, env: dict[str, str],
                      lock_fds: tuple[int, ...]) -> tuple[subprocess.Popen, int]:
    """The supervisor in a session of its own (a Ctrl-C or a SIGHUP of the terminal reaches only
    the owner), holding the read end of a pipe whose write end only this process has."""
    read_fd, write_fd = os.pipe()  # not inheritable (PEP 446): only pass_fds hands read_fd on
    try:
        with open(out_dir / "supervisor.log", "wb") as log:
            supervisor = subprocess.Popen(
                [sys.executable, "-m", "backend.supervisor", "-", str(read_fd), *map(str, lock_fds)],
                cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(read_fd, *lock_fds), start_new_session=True)
    except OSError:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    # the spec (with the environment) goes over stdin, never into a file
    supervisor.stdin.write(json.dumps(spec).encode())
    supervisor.stdin.close()
    return supervisor, write_fd


def _stop_supervisor(supervisor: subprocess.Popen, stop_fd: int, spec: dict) -> dict[str, Any]:
    """Tell the supervisor to end the run (a no-op if it already ended), wait until it has ended
    every process, and read its result. A second Ctrl-C while waiting does not abandon the wait."""
    try:
        os.write(stop_fd, b"stop\n")
    except OSError:
        pass
    os.close(stop_fd)
    deadline = time.monotonic() + 3 * GRACE_SECONDS + 30
    while supervisor.poll() is None and time.monotonic() < deadline:
        try:
            supervisor.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:
            continue
    if supervisor.poll() is None:  # never seen: the launcher has PDEATHSIG, every rank watches it
        supervisor.kill()
        supervisor.wait()
    try:
        return json.loads(Path(spec["result_path"]).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


# Once every rank has written its record the run has its result: the launcher then has this long to
# exit (the process groups' teardown: gloo's and DeepSpeed's destructors at interpreter exit, which
# a loaded machine has been seen to hang in) before the run is ended and its records stand.
TEARDOWN_SECONDS = 30.0
# A run whose ranks all finished their steps is past what its timeout was sized for (the steps):
# the measurement's post-processing (the profiler's events, by Python) gets this much longer, at
# most, for the records to be written, however loaded the machine.
FINISH_SECONDS = 600.0


def _wait(supervisor: subprocess.Popen, start: float, timeout: float, out_dir: Path, on_progress,
          cancel=None, world: int = 0) -> bool | str:
    """True once the supervisor has ended (the launcher exited); "recorded" once every rank's
    record has been written and the launcher has not exited TEARDOWN_SECONDS later; False on a
    cancel or a timeout (extended by FINISH_SECONDS when every rank has finished its steps)."""
    seen = 0
    recorded_at = None
    while True:
        if cancel is not None and cancel.is_set():
            return False
        code = supervisor.poll()
        if on_progress is not None:
            seen = _report_progress(out_dir, seen, on_progress)
        if code is not None:
            return True
        now = time.monotonic()
        if world and recorded_at is None and _all_recorded(out_dir, world):
            recorded_at = now
        if recorded_at is not None and now - recorded_at > TEARDOWN_SECONDS:
            return "recorded"
        if now - start > timeout + (FINISH_SECONDS if world and _steps_finished(out_dir, world) else 0.0):
            return False
        time.sleep(0.2)


def _all_recorded(out_dir: Path, world: int) -> bool:
    return all((out_dir / f"rank{rank}.json").exists() for rank in range(world))


def _steps_finished(out_dir: Path, world: int) -> bool:
    """Every rank reported its last step (progress<N>.txt: "step total time" per step)."""
    for rank in range(world):
        try:
            lines = (out_dir / f"progress{rank}.txt").read_text().split()
        except OSError:
            return False
        if len(lines) < 3 or lines[-3] != lines[-2]:
            return False
    return True


def _report_progress(out_dir: Path, seen: int, on_progress) -> int:
    path = out_dir / "progress0.txt"
    if not path.exists():
        return seen
    lines = path.read_text().splitlines()
    for line in lines[seen:]:
        step, total, _ = line.split()
        on_progress(int(step), int(total))
    return len(lines)


def _collect(out_dir: Path, world_size: int) -> list[dict[str, Any]]:
    ranks = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        if path.exists():
            try:
                ranks.append(json.loads(path.read_text()))
            except json.JSONDecodeError:
                ranks.append({"rank": rank, "status": "crashed", "error": "unreadable rank record"})
        else:
            ranks.append({"rank": rank, "status": "missing", "error": "the rank left no record"})
    return ranks


def _verdict(ranks: list[dict[str, Any]], returncode: int | None, world: int) -> tuple[str, str]:
    failed = [r for r in ranks if r.get("status") != "ok"]
    if not failed and returncode == 0:
        return "ok", f"{world} ranks trained"
    if any(r.get("status") == "oom" for r in failed):
        first = next(r for r in failed if r.get("status") == "oom")
        return "oom", f"rank {first['rank']} ran out of memory: {first.get('error', '')[:300]}"
    if failed:
        first = failed[0]
        return "crashed", f"rank {first['rank']} {first.get('status')}: {first.get('error', '')[:300]}"
    return "launcher-error", f"the launcher exited with code {returncode}"


def _tail(path: Path, limit: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""
