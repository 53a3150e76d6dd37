"""Ready-to-launch files for one configuration: a plan candidate, or an estimate's request.

What `--emit DIR` writes (LAUNCH.md in the directory says the same to the user):
- ``launch.sh``: the command for one node. ``deepspeed`` for ZeRO, ``torchrun`` for DDP/FSDP/HSDP,
  running the planner's own trainer (``python -m backend.worker --plan plan.json``, what
  ``planner verify`` runs: the architecture with random weights on synthetic tokens, every rank's
  memory measured) unless the user named a script with ``--script``.
- ``job.sbatch``: the same under Slurm; node rank and master address come from Slurm's variables.
- ``hostfile``: DeepSpeed multi-node only (its launcher starts the other nodes over ssh from it).
- ``ds_config.json`` (zero0-3): every size the prediction assumed (planner.frameworks.deepspeed.config.build_ds_config),
  written over the user's own config when the request has one (--ds-config), whose other keys stay.
- ``accelerate_config.yaml``: the same choice for ``accelerate launch`` (accelerate 1.16's config
  format, accelerate/commands/config/config_args.py ClusterConfig): the DeepSpeed plugin pointing at
  ds_config.json, the FSDP plugin (FSDP2) for fsdp / fsdp-grad-op / hsdp, or plain multi-GPU for ddp.
- ``trainer_args.json``: the matching ``transformers.TrainingArguments`` keyword arguments.
- ``plan.json``: the request and the prediction; ``planner verify --plan plan.json`` runs it.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from planner.model.catalogue import UnsupportedModelTypeError
from planner.recipes.finetune import bnb_config, lora_config
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate, resolve, setup_of
from planner.plan.search import finetune_fields
from planner.recipes.precision import DTYPE_SPELLINGS, RECIPES
from planner.schema import SHARDING_STRATEGIES, Candidate, EstimateRequest, EstimateResult, PlanRequest
from planner.setup import Setup
from planner.frameworks.deepspeed.shm import segment_glob
from planner.strategies import explicit_hsdp_shard
from planner.plan.megatron import megatron_arguments, megatron_file
from planner.parallel.pipeline import stage_bounds
from planner.units import GIB
from planner.frameworks.torch.torchtitan import (HEAD_NAME, MIXED_PARAM, pipeline_overrides, torchtitan_config,
                                 torchtitan_toml)

TRAINER_MODULE = "backend.worker"  # the planner's own trainer, `python -m backend.worker --plan plan.json`
DEFAULT_PORT = 29500  # torchrun's and DeepSpeed's default master port
LEARNING_RATE = 1e-4  # build_ds_config's optimizer lr; the Trainer checks its learning_rate against it

# transformers' OptimizerNames (transformers/training_args.py) for the planner's optimizers
# (sgd-momentum: "sgd" with optim_args momentum; adafactor: transformers' "adafactor" is its own
# Adafactor, not torch's, and muon has no name there: both absent, so no TrainingArguments for them)
TRAINER_OPTIM = {"adamw": "adamw_torch", "sgd": "sgd", "sgd-momentum": "sgd", "adamw-8bit": "adamw_bnb_8bit",
                 "adamw-paged-8bit": "paged_adamw_8bit", "adamw-torchao-8bit": "adamw_torch_8bit",
                 "adamw-torchao-4bit": "adamw_torch_4bit", "lion": "lion_32bit"}


@dataclass(frozen=True)
class Script:
    """The user's training script and its arguments, run instead of the planner's trainer."""

    path: str
    args: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Script":
        """``--script 'path/to/train.py --data x'``: the first word is the script, the rest its arguments."""
        try:
            words = shlex.split(text)
        except ValueError as exc:
            raise PlannerError(f"--script {text!r}: {exc}", field="script") from None
        if not words:
            raise PlannerError("--script: empty; give the training script's path, then its arguments", field="script")
        return cls(words[0], tuple(words[1:]))


@dataclass(frozen=True)
class _Launch:
    """One configuration to launch, resolved once."""

    request: EstimateRequest
    framework: str  # deepspeed | torch
    strategy: str  # the name, shown only; the files follow the degrees below
    fsdp: bool  # torch sharding its parameters (FSDP2), not DDP
    reshard_after_forward: bool  # False for SHARD_GRAD_OP: units stay gathered from forward to backward
    zero_stage: int | None
    precision: str
    is_cpu: bool
    shard_size: int
    script: Script | None
    summary: str
    unavailable: str | None = None  # why the planner's trainer cannot run it (then no launch.sh / job.sbatch)
    dims: tuple[tuple[str, int], ...] = ()  # the layout's degrees (ParallelDims.as_dict): dp_replicate, dp_shard, tp, ...

    @property
    def world(self) -> int:
        return self.request.world_size

    def degree(self, name: str) -> int:
        return dict(self.dims).get(name, 1)

    @property
    def replicas(self) -> int:
        """HSDP's replicate degree (1 when one shard group spans the data-parallel ranks)."""
        return self.degree("dp_replicate") if self.fsdp else 1

    @property
    def data_parallel(self) -> int:
        """The ranks that read different sequences: the world over tp x cp x pp."""
        return self.degree("dp_replicate") * self.degree("dp_shard")

    @property
    def accelerate_layout(self) -> str | None:
        """Why accelerate 1.16 (and the Trainer on it) cannot run this layout, or None when it can:
        its ParallelismConfig has dp_replicate, dp_shard, tp and cp, applied through FSDP2
        (commands/launch.py: parallelism_config needs --use_fsdp and fsdp_version 2), which it
        refuses without dp_shard or cp > 1 (parallelism_config.py _validate_accelerator); DeepSpeed
        reads AutoTP's degree from ds_config.json (the Trainer's get_tp_size). No pipeline or
        expert parallelism in either."""
        tp, cp, pp, ep = (self.degree(n) for n in ("tp", "cp", "pp", "ep"))
        if pp > 1 or ep > 1:
            return f"accelerate and the Trainer have no {'pipeline' if pp > 1 else 'expert'} parallelism"
        if self.framework == "torch" and tp * cp > 1 and not self.fsdp:
            return ("accelerate applies tensor/context parallelism with FSDP2 only (its ParallelismConfig needs "
                    "fsdp_version 2); DDP with TP is not one of its layouts")
        if self.fsdp and tp * cp > 1 and self.degree("dp_shard") == 1 and cp == 1:
            return ("accelerate refuses FSDP2 without a dp_shard group or cp > 1 "
                    "(ParallelismConfig._validate_accelerator); this layout has dp_shard 1")
        return None


def emit_files(req: PlanRequest, c: Candidate, script: Script | None = None) -> dict[str, str]:
    """The launch files of a plan candidate."""
    est = estimate_request_for(req, c)
    summary = _summary(c.strategy, c.micro_batch, c.gradient_accumulation, c.checkpointing, c.offload_optimizer,
                       c.offload_params, c.per_device.peak_bytes, c.step_seconds)
    plan_doc = {"request": req.model_dump(by_alias=True), "candidate": c.model_dump(),
                "estimate_request": est.model_dump(by_alias=True)}
    return _emit(est, summary, plan_doc, script)


def emit_estimate_files(result: EstimateResult, script: Script | None = None) -> dict[str, str]:
    """The launch files of one estimated configuration (`planner estimate --emit DIR`)."""
    req = result.request
    summary = _summary(req.strategy, req.micro_batch, req.gradient_accumulation, req.checkpointing,
                       req.offload_optimizer, req.offload_params, result.per_device.peak_bytes,
                       result.time.step_seconds if result.time else None)
    plan_doc = {"estimate": {"per_device": result.per_device.model_dump(), "fits": result.fits,
                             "time": result.time.model_dump() if result.time else None},
                "estimate_request": req.model_dump(by_alias=True)}
    known = setup_of(result)  # a traced model's is not taken: resolving it refuses --emit, as it should
    return _emit(req, summary, plan_doc, script, known if known is not None and known.model.traced is None else None)


def estimate_request_for(req: PlanRequest, c: Candidate) -> EstimateRequest:
    """The candidate as an estimate/verify request (what `planner verify --plan plan.json` runs)."""
    model = {"model": req.model} if req.model else {"model_config": req.model_config_}
    return EstimateRequest(**model, strategy=c.strategy, gpus=req.gpus, nodes=req.nodes, gpu=req.gpu,
                           precision=req.precision, optimizer=req.optimizer,
                           optimizer_in_backward=req.optimizer_in_backward, micro_batch=c.micro_batch,
                           seq_len=req.seq_len, gradient_accumulation=c.gradient_accumulation,
                           checkpointing=c.checkpointing, attention=req.attention,
                           offload_optimizer=c.offload_optimizer, offload_params=c.offload_params,
                           hsdp_shard_size=explicit_hsdp_shard(c.strategy, c.hsdp_shard_size, req.gpus),
                           topology=req.topology, topology_text=req.topology_text, fabric=req.fabric,
                           nics_per_node=req.nics_per_node, profile=req.profile,
                           **finetune_fields(req.model_copy(update={"finetune": c.finetune})),
                           **({"reduce_dtype": req.reduce_dtype} if c.strategy in SHARDING_STRATEGIES else {}),
                           **{k: v for k, v in c.parallel.model_dump().items() if k in ("tp", "pp", "cp", "ep") and v > 1},
                           **{k: v for k, v in (("pp_first_stage_layers", c.pp_first_stage_layers),
                                                ("pp_last_stage_layers", c.pp_last_stage_layers),
                                                ("pp_schedule", c.pp_schedule),
                                                ("pp_virtual_stages", c.pp_virtual_stages)) if v is not None})


def _emit(est: EstimateRequest, summary: str, plan_doc: dict[str, Any], script: Script | None,
          setup: Setup | None = None) -> dict[str, str]:
    """``setup``: ``est`` already resolved (the estimate's own), not resolved again."""
    try:
        setup = setup if setup is not None else resolve(est)
    except UnsupportedModelTypeError as exc:
        raise PlannerError(f"{exc.name}: model_type {exc.config.get('model_type')!r} is estimated by tracing only; "
                           "--emit writes launch files for the families the core reads analytically "
                           "(see `planner models`)", field="model") from None
    if est.checkpointing not in ("none", "full") or est.checkpointing_every is not None:
        # the Trainer's and DeepSpeed's configs name full checkpointing only; the selective policies
        # and every-N are applied by the training script (torchtitan's ac config, the model's
        # activation_checkpointing_enable(every_n_layers=...))
        field = "checkpointing_every" if est.checkpointing == "full" else "checkpointing"
        raise PlannerError(f"--emit with {field}={getattr(est, field)}: the emitted Trainer, accelerate and DeepSpeed "
                           "configs have no such setting; the training script applies it", field=field)
    for field, value, default in (("loss", est.loss, ("hf", "chunked", "liger-fused", "vocab-parallel")),
                                  ("low_precision", est.low_precision, ("none",))):
        if value not in default:
            # the Trainer's configs have no switch for them (Liger's is use_liger_kernel, emitted below):
            # the training script applies CCE's patch or the fp8 converters (the chunked loss: as before)
            raise PlannerError(f"--emit with {field}={value}: the emitted Trainer, accelerate and DeepSpeed configs "
                               "have no such setting; the training script applies it", field=field)
    unavailable = None if script is not None else _trainer_unavailable(setup, est)
    s = setup.strategy
    launch = _Launch(request=setup.request, framework=s.framework, strategy=s.name,
                     fsdp=setup.framework.fsdp_sharding(s) is not None,
                     reshard_after_forward=not s.params_unsharded_in_step,
                     zero_stage=s.zero_stage, precision=setup.request.precision,
                     is_cpu=setup.gpu.is_cpu, shard_size=setup.shard_size, script=script, summary=summary,
                     unavailable=unavailable, dims=tuple(setup.dims.as_dict().items()))
    files: dict[str, str] = {}
    if launch.framework == "deepspeed":
        req = launch.request  # the request as resolved: a ds_config's batch and optimizer filled in
        config = setup.framework.ds_config(setup, req)
        # DeepSpeedConfig checks train_batch_size against the whole world even under AutoTP (0.19.8
        # runtime/config.py: no mpu is given, so world_size = dist.get_world_size()); the ranks of a TP
        # group read the same micro-batch, so the global batch in sequences is this / tp
        config["train_batch_size"] = req.micro_batch * req.gradient_accumulation * launch.world
        if setup.tp > 1:
            # deepspeed 0.19.8 runtime/config.py tensor_parallel (TPTrainingConfig.autotp_size): AutoTP
            # training splits the linears over consecutive ranks (engine.py _configure_tensor_parallel)
            config["tensor_parallel"] = {"autotp_size": setup.tp}
        if setup.dims.pp > 1:
            _deepspeed_pipeline(config, setup)
        if est.ds_config is not None:
            config = _keep_users_config(est.ds_config, config)
        if launch.is_cpu:  # the same switch backend/launch.py worker_job makes for `planner verify`
            setup.framework.use_torch_adam(config)
        files["ds_config.json"] = json.dumps(config, indent=2) + "\n"
    if launch.accelerate_layout is None:
        # accelerate's DeepSpeed plugin and the Trainer wrap a module, never a PipelineModule: for
        # a pipeline (or a layout accelerate has not) their files would run another layout
        files["accelerate_config.yaml"] = yaml.safe_dump(accelerate_config(launch), sort_keys=False)
        if est.optimizer in TRAINER_OPTIM:  # transformers has no name for torch's Adafactor or Muon
            files["trainer_args.json"] = json.dumps(trainer_arguments(launch), indent=2) + "\n"
    if setup.finetune is not None:
        files.update(finetune_files(setup))
    if unavailable is None:
        files["launch.sh"] = _launch_sh(launch)
        files["job.sbatch"] = _sbatch(launch)
        if launch.framework == "deepspeed" and est.nodes > 1:
            files["hostfile"] = _hostfile(launch)
    titan = _torchtitan_file(setup)
    if titan is not None:
        files["torchtitan.toml"] = titan
    megatron = _megatron_file(setup)
    if megatron is not None:
        files["megatron_args.txt"] = megatron
    files["plan.json"] = json.dumps(plan_doc, indent=2) + "\n"
    files["LAUNCH.md"] = _guide(launch, sorted(files) + ["LAUNCH.md"],
                                _torchtitan_config(setup) if titan is not None else None,
                                tied=setup.arch is not None and setup.arch.tie_word_embeddings,
                                titan_reduce=_torchtitan_reduce_note(setup) if titan is not None else None)
    return files


def _deepspeed_pipeline(config: dict[str, Any], setup) -> None:
    """What DeepSpeed 0.19.8's pipeline engine takes from its config. The stages are built in the
    training script, ``PipelineModule(layers, num_stages=pp, ...)`` (runtime/pipe/module.py; the
    config's ``pipeline.stages`` and ``pipeline.partition`` are defaults nothing reads, runtime/
    config.py get_pipeline_config); the engine runs ``gradient_accumulation_steps`` micro-batches of
    ``train_micro_batch_size_per_gpu`` per ``train_batch()`` and asserts ``train_batch_size ==
    micro_batch_size * micro_batches * grid.data_parallel_size`` (pipe/engine.py: the data-parallel
    size of its (pipe, data) grid, world / pp, as deepspeed.initialize passes the module's mpu);
    ``pipeline.activation_checkpoint_interval`` seeds the module's (pipe/engine.py: 1 checkpoints
    every layer, the planner's full checkpointing)."""
    d, req = setup.dims, setup.request
    if d.tp > 1:
        raise PlannerError(f"pp={d.pp} with tp={d.tp} under strategy {setup.strategy.name}: DeepSpeed's pipeline "
                           "engine takes its model-parallel groups from the PipelineModule's topology "
                           "(deepspeed.initialize: mpu = model.mpu()), AutoTP from tensor_parallel.autotp_size; "
                           "the planner emits no launch for the two together: use a torch strategy (torchtitan "
                           "applies pp x tp)", field="tp")
    config["train_batch_size"] = req.micro_batch * req.gradient_accumulation * d.dp
    config["pipeline"] = {"activation_checkpoint_interval": 1 if req.checkpointing == "full" else 0}


def _torchtitan_file(setup) -> str | None:
    """torchtitan's job config for a torch layout with model parallelism (tp, pp or cp > 1): the
    trainer that applies these degrees to a llama-style model as the estimate assumes. None for
    pure data parallelism (the accelerate/Trainer files cover it) and for fp16 (torchtitan's
    mixed_precision_param takes bfloat16 or float32 only)."""
    req = setup.request
    if setup.strategy.framework != "torch" or max(setup.tp, req.pp, req.cp) == 1 or setup.recipe.compute not in MIXED_PARAM:
        return None
    return torchtitan_toml(_torchtitan_config(setup))


def _megatron_file(setup) -> str | None:
    """Megatron-LM's arguments for a pipeline layout (planner/plan/megatron.py), or None without pp."""
    req, d = setup.request, setup.dims
    if d.pp == 1 or setup.arch is None:
        return None
    s = setup.strategy
    args = megatron_arguments(tp=d.tp, pp=d.pp, cp=d.cp, ep=d.ep, sequence_parallel=setup.sequence_parallel,
                              virtual_stages=req.pp_virtual_stages, first_stage_layers=req.pp_first_stage_layers,
                              last_stage_layers=req.pp_last_stage_layers, micro_batch=req.micro_batch,
                              gradient_accumulation=req.gradient_accumulation, data_parallel=d.dp,
                              seq_len=req.seq_len, num_layers=setup.arch.num_layers, compute=setup.recipe.compute,
                              checkpointing=req.checkpointing, shards_optimizer=s.shards_optimizer)
    twin = ("its distributed optimizer shards the optimizer states only (ZeRO-1): the planner's zero1 estimate "
            "of this layout is that run's; Megatron refuses FSDP2 under a pipeline" if s.shards_parameters
            else "the same data-parallel states as this estimate")
    uneven = (" Megatron counts --decoder-first/last-pipeline-num-layers per pipeline rank, the planner per stage: "
              "with virtual stages the uneven split is not written." if req.pp_virtual_stages > 1 and
              req.pp_first_stage_layers is not None else "")
    return megatron_file(args, f"Megatron-LM (d98e8a6) arguments of this pipeline layout; {twin}.{uneven}")


def _torchtitan_reduce_note(setup) -> str | None:
    """torchtitan reduces FSDP2's gradients in fp32 only (mixed_precision_reduce = "float32": 0.2.2
    job_config.py, 0.3 config/configs.py:93); an estimate made with the compute dtype (accelerate's
    and verify's) is not that job's. The torchtitan job's own peak, estimated with reduce_dtype fp32."""
    req = setup.request
    if req.reduce_dtype == "fp32" or req.strategy not in SHARDING_STRATEGIES:
        return None
    titan = estimate(req.model_copy(update={"reduce_dtype": "fp32"}))
    return (f"torchtitan reduces gradients in fp32 (`mixed_precision_reduce = \"float32\"`, its only value), "
            f"while this estimate reduces in the compute dtype: the torchtitan job's peak is "
            f"{titan.per_device.peak_bytes / GIB:.2f} GiB per device (this estimate: "
            f"{estimate(req).per_device.peak_bytes / GIB:.2f} GiB); `--reduce-dtype fp32` estimates it.")


def _torchtitan_config(setup) -> dict[str, dict[str, Any]]:
    req, d = setup.request, setup.dims
    # the degrees as resolved (ParallelDims): setup.shard_size spans the pipeline's ranks too, so the
    # data-parallel degrees are read from the dims (torchtitan's own ParallelDims shape)
    bounds = stage_bounds(setup.arch.num_layers, d.pp * req.pp_virtual_stages, req.pp_first_stage_layers,
                          req.pp_last_stage_layers) if d.pp > 1 else None
    return torchtitan_config(dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, tp=d.tp, pp=d.pp, cp=d.cp,
                             ep=d.ep, pp_schedule=req.pp_schedule, micro_batch=req.micro_batch,
                             gradient_accumulation=req.gradient_accumulation, seq_len=req.seq_len,
                             compute=setup.recipe.compute, checkpointing=req.checkpointing,
                             reshard_after_forward=not setup.strategy.params_unsharded_in_step,
                             model_name=setup.model.name, stage_bounds=bounds)


def finetune_files(setup) -> dict[str, str]:
    """LoRA/QLoRA: the PEFT LoraConfig (``LoraConfig(**json.load(...))``) and, for a quantized base,
    transformers' BitsAndBytesConfig (``BitsAndBytesConfig(**json.load(...))``, its compute dtype
    as a string). The planner's trainer reads them from plan.json's request, the same settings."""
    files = {"lora_config.json": json.dumps(lora_config(setup.finetune), indent=2) + "\n"}
    quantization = bnb_config(setup.finetune, setup.recipe.compute)
    if quantization is not None:
        files["bnb_config.json"] = json.dumps(quantization, indent=2) + "\n"
    return files


# What a plan decides in a ds_config: the rest of a user's config (optimizer hyper-parameters,
# scheduler, gradient_clipping, logging, checkpointing, ...) is written back as the user gave it.
_PLANNED_TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16")
# zero_optimization keys the plan writes, with the aliases and deprecated spellings DeepSpeed 0.19.8
# reads for the same settings (zero/config.py DeepSpeedZeroConfig): an alias left behind would
# contradict the planned value.
_PLANNED_ZERO = ("stage", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                 "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_param_persistence_threshold",
                 "param_persistence_threshold", "stage3_max_live_parameters", "max_live_parameters",
                 "stage3_max_reuse_distance", "max_reuse_distance", "sub_group_size", "offload_optimizer",
                 "offload_param", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")


def _keep_users_config(user: dict[str, Any], planned: dict[str, Any]) -> dict[str, Any]:
    """The user's ds_config with the plan's decisions written over it (stage, buckets, offload,
    precision, batch sizes); everything else of the user's is kept. The user's own settings inside
    a planned block stay where they still apply: an offload block's extra keys (nvme_path,
    buffer_count) on the same device, a bf16/fp16 block's loss-scale settings for the same
    precision, the optimizer's hyper-parameters for the same optimizer."""
    config = {k: v for k, v in json.loads(json.dumps(user)).items() if k not in _PLANNED_TOP and k != "optimizer"}
    users_zero = user.get("zero_optimization") if isinstance(user.get("zero_optimization"), dict) else {}
    zero = {k: v for k, v in users_zero.items() if k not in _PLANNED_ZERO}
    for key in ("offload_optimizer", "offload_param"):
        if key in planned["zero_optimization"]:
            block = dict(planned["zero_optimization"][key])
            mine = users_zero.get(key)
            if isinstance(mine, dict) and mine.get("device") == block["device"]:
                block = mine | {"device": block["device"], "pin_memory": block["pin_memory"]}
            zero[key] = block
    zero |= {k: v for k, v in planned["zero_optimization"].items() if k not in ("offload_optimizer", "offload_param")}
    config["zero_optimization"] = zero
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        config[key] = planned[key]
    for key in ("bf16", "fp16"):
        if key in planned:
            mine = user.get(key)
            config[key] = (planned[key] | mine | {"enabled": True}) if isinstance(mine, dict) else planned[key]
    if "optimizer" in planned:
        optimizer = planned["optimizer"]
        mine = user.get("optimizer")
        if isinstance(mine, dict) and _same_optimizer(mine, optimizer):
            optimizer = json.loads(json.dumps(mine))
        elif isinstance(mine, dict) and isinstance(mine.get("params"), dict):
            # another optimizer than the user's (an explicit --optimizer): its learning rate and decay carry over
            kept = {k: v for k, v in mine["params"].items() if k in ("lr", "weight_decay")}
            optimizer = optimizer | {"params": optimizer["params"] | kept}
        config["optimizer"] = optimizer
    for key, value in planned.items():
        config.setdefault(key, value)  # what the plan writes that the user left out (steps_per_print)
    # communication_data_type is modelled only as the training dtype (planner.frameworks.deepspeed.config
    # _communication_dtype); with another precision than the config's, the plan's dtype is reduced
    training = "bf16" if "bf16" in planned else "fp16" if "fp16" in planned else "fp32"
    if config.get("communication_data_type") not in (None, "auto", *DTYPE_SPELLINGS[training]):
        del config["communication_data_type"]
    return config


def _same_optimizer(mine: dict[str, Any], planned: dict[str, Any]) -> bool:
    """Adam and AdamW are the planner's adamw (planner.frameworks.deepspeed.config._optimizer), SGD its sgd."""
    kinds = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd", "lion": "lion", "adafactor": "adafactor"}
    kind = mine.get("type")
    return isinstance(kind, str) and kinds.get(kind.lower()) == kinds[planned["type"].lower()]


def _trainer_unavailable(setup, est: EstimateRequest) -> str | None:
    """Why the planner's own trainer cannot run this configuration, if it cannot."""
    if setup.model.config is None:
        return "the planner's trainer needs an architecture (--model or --model-file), not --params"
    if est.optimizer not in setup.framework.probe_optimizers:
        return (f"the planner's trainer runs {setup.strategy.name} with {', '.join(setup.framework.probe_optimizers)}, "
                f"not {est.optimizer}")
    if setup.cp > 1:
        return "the planner's trainer does not run context parallelism (torch's ring attention needs CUDA)"
    if setup.dims.pp > 1 and setup.strategy.framework == "deepspeed":
        return ("DeepSpeed's pipeline engine trains a PipelineModule your script builds (the planner's trainer "
                "runs pipelines with torch's pipelining: emit with --strategy fsdp for that)")
    return None


# --- accelerate and the HF Trainer -----------------------------------------------------------

def accelerate_config(launch: _Launch) -> dict[str, Any]:
    """``accelerate launch --config_file`` content (keys of accelerate 1.16's ClusterConfig)."""
    req = launch.request
    distributed = {"deepspeed": "DEEPSPEED", "torch": "MULTI_GPU"}[launch.framework]
    if launch.fsdp:
        distributed = "FSDP"
    if distributed == "MULTI_GPU" and launch.world == 1:
        distributed = "NO"  # accelerate refuses --multi_gpu with one process
    elif launch.is_cpu and distributed == "MULTI_GPU":
        distributed = "MULTI_CPU"
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed,
        "num_machines": req.nodes,
        "num_processes": launch.world,  # over all machines (accelerate divides by num_machines)
        "machine_rank": 0,  # per node: `accelerate launch --machine_rank R` (job.sbatch passes SLURM_NODEID)
        "main_process_port": DEFAULT_PORT,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": launch.is_cpu,
        "debug": False,
    }
    # main_process_ip is per job: `accelerate launch --main_process_ip` (node 0's address), as machine_rank
    if launch.framework == "deepspeed":
        # With deepspeed_config_file, precision, ZeRO stage, offload and accumulation come from the
        # JSON alone; accelerate refuses them in this file (DeepSpeedPlugin._deepspeed_config_checks).
        block: dict[str, Any] = {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": launch.zero_stage == 3}
        if req.nodes > 1:
            block["deepspeed_multinode_launcher"] = "standard"  # torchrun on every node, no ssh/pdsh
        config["deepspeed_config"] = block
        return config
    config["mixed_precision"] = RECIPES[launch.precision].autocast_dtype or "no"
    if distributed == "FSDP":
        config["fsdp_config"] = _fsdp_plugin(launch)
        parallel = _parallelism_config(launch)
        if parallel:
            # FSDP2's mesh (dp_replicate, dp_shard, cp, tp) of consecutive ranks, tp innermost
            # (accelerate/parallelism_config.py _get_mesh), as backend/train.py builds it; the keys
            # are ClusterConfig.parallelism_config's, what `accelerate launch` reads into
            # PARALLELISM_CONFIG_* (commands/launch.py --parallelism_config_*)
            config["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in parallel.items()}
    return config


def _parallelism_config(launch: _Launch) -> dict[str, int]:
    """accelerate's ParallelismConfig keyword arguments for the layout; empty for plain FSDP."""
    sizes = {"dp_replicate_size": launch.degree("dp_replicate"), "dp_shard_size": launch.degree("dp_shard"),
             "tp_size": launch.degree("tp"), "cp_size": launch.degree("cp")}
    if not launch.fsdp or all(v == 1 for k, v in sizes.items() if k != "dp_shard_size"):
        return {}
    return {k: v for k, v in sizes.items() if k.startswith("dp") or v > 1}  # accelerate's default is 1


def _fsdp_plugin(launch: _Launch) -> dict[str, Any]:
    """FSDP2 as backend/train.py wraps it: every transformer block a unit (accelerate takes the
    block class from the model's ``_no_split_modules`` when none is named), SHARD_GRAD_OP =
    reshard_after_forward False, parameter offload = CPUOffloadPolicy."""
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": launch.reshard_after_forward,
        "fsdp_offload_params": launch.request.offload_params != "none",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_activation_checkpointing": launch.request.checkpointing == "full",
    }


def trainer_arguments(launch: _Launch) -> dict[str, Any]:
    """``transformers.TrainingArguments(**this)`` (transformers 5): batch, accumulation, precision,
    checkpointing and the DeepSpeed/FSDP choice of the plan. Values the DeepSpeed JSON also holds
    are equal, as the Trainer requires (HfTrainerDeepSpeedConfig.trainer_config_process)."""
    req = launch.request
    args: dict[str, Any] = {
        "per_device_train_batch_size": req.micro_batch,
        "gradient_accumulation_steps": req.gradient_accumulation,
        "bf16": RECIPES[launch.precision].autocast_dtype == "bf16",
        "fp16": RECIPES[launch.precision].autocast_dtype == "fp16",
        "learning_rate": LEARNING_RATE,
        "weight_decay": 0.0,
        "optim": TRAINER_OPTIM[req.optimizer],
    }
    if req.optimizer == "sgd-momentum":
        args["optim_args"] = "momentum=0.9"  # backend/train.py's and build_ds_config's momentum
    args |= _users_hyperparameters(req.ds_config, req.optimizer)
    if req.checkpointing == "full" and not launch.fsdp:
        # non-reentrant, as backend/train.py enables it. transformers 5.24 calls these
        # activation_checkpointing(_kwargs) and keeps the old names until v6 (training_args.py:1541);
        # the old names are the ones every transformers 5 release accepts.
        args["gradient_checkpointing"] = True
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if req.loss == "liger-fused":
        args["use_liger_kernel"] = True  # TrainingArguments: Liger's kernels, its fused linear cross-entropy
    if launch.is_cpu:
        args["use_cpu"] = True
    if launch.framework == "deepspeed":
        args["deepspeed"] = "ds_config.json"
    elif launch.fsdp:
        # FSDP checkpoints inside its own units (fsdp_config activation_checkpointing), not with
        # gradient_checkpointing, which transformers warns adds an all-gather in backward.
        plugin = _fsdp_plugin(launch)
        args["fsdp"] = True
        args["fsdp_config"] = {
            "version": 2,
            "reshard_after_forward": plugin["fsdp_reshard_after_forward"],
            "cpu_offload": plugin["fsdp_offload_params"],
            "auto_wrap_policy": plugin["fsdp_auto_wrap_policy"],
            "state_dict_type": plugin["fsdp_state_dict_type"],
            "activation_checkpointing": plugin["fsdp_activation_checkpointing"],
        }
    return args


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _users_hyperparameters(config: dict[str, Any] | None, optimizer_name: str) -> dict[str, Any]:
    """The TrainingArguments fields a user's ds_config sets, which the Trainer checks against it
    (transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process:
    optimizer.params lr, betas, eps, weight_decay; gradient_clipping = max_grad_norm;
    scheduler.params warmup_max_lr = learning_rate; trainer_config_finalize: warmup_num_steps =
    warmup_steps). "auto" values are the Trainer's to fill, so they are left out. Betas and eps only
    where the emitted config keeps the user's optimizer block (the same optimizer, _keep_users_config)."""
    if not config:
        return {}
    args: dict[str, Any] = {}
    scheduler = config.get("scheduler") if isinstance(config.get("scheduler"), dict) else {}
    sched = scheduler.get("params") if isinstance(scheduler.get("params"), dict) else {}
    optimizer = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
    params = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
    if _number(sched.get("warmup_max_lr")):
        args["learning_rate"] = sched["warmup_max_lr"]
    if _number(params.get("lr")):
        args["learning_rate"] = params["lr"]
    if _number(params.get("weight_decay")):
        args["weight_decay"] = params["weight_decay"]
    if _number(config.get("gradient_clipping")):
        args["max_grad_norm"] = config["gradient_clipping"]
    if isinstance(sched.get("warmup_num_steps"), int) and not isinstance(sched["warmup_num_steps"], bool):
        args["warmup_steps"] = sched["warmup_num_steps"]
    if optimizer_name in ("adamw", "sgd") and _same_optimizer(optimizer, {"type": optimizer_name}):
        if _number(params.get("eps")):
            args["adam_epsilon"] = params["eps"]
        betas = params.get("betas")
        if isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_number(b) for b in betas):
            args["adam_beta1"], args["adam_beta2"] = betas
    return args


# --- shell -----------------------------------------------------------------------------------

def _q(words: list[str] | tuple[str, ...]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def _preamble(launch: _Launch) -> str:
    """Find the planner's trainer (installed, or a checkout named by PLANNER_ROOT) and set the
    environment the ranks expect."""
    lines = ["# The emitted files, for the training script too: $PLANNER_PLAN (what to run)"
             + (", $PLANNER_DS_CONFIG (DeepSpeed's JSON)" if launch.framework == "deepspeed" else ""),
             'export PLANNER_PLAN="$here/plan.json"']
    if launch.framework == "deepspeed":
        lines.append('export PLANNER_DS_CONFIG="$here/ds_config.json"')
    if launch.script is None:
        lines += [
            "# The planner's trainer: pip install -e '.[backend]' in its checkout, or PLANNER_ROOT=/path/to/it",
            'if [ -n "${PLANNER_ROOT:-}" ]; then export PYTHONPATH="$PLANNER_ROOT${PYTHONPATH:+:$PYTHONPATH}"; fi',
            f"python -c 'import {TRAINER_MODULE}' 2>/dev/null || {{ echo \"$0: cannot import {TRAINER_MODULE}: in the "
            "planner checkout run pip install -e '.[backend]', or set PLANNER_ROOT to it\" >&2; exit 2; }",
            "# Where every rank writes its record (rank<N>.json: measured peak, step time)",
            'out="${PLANNER_OUT:-$here/planner-run}"',
        ]
    if not launch.is_cpu:
        lines += _allocator_env(launch.request)
    if launch.is_cpu:
        lines += [
            "# CPU ranks over gloo: DeepSpeed's CPU accelerator, no GPU, one thread per rank unless told",
            "export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=",
            'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"',
        ]
    return "\n".join(lines) + "\n"


def _allocator_env(req) -> list[str]:
    """The caching allocator's and NCCL's settings the estimate assumed (planner/memory/reserved.py): the
    run must use them for its reserved memory to be the one predicted. torch 2.13 reads
    PYTORCH_ALLOC_CONF before PYTORCH_CUDA_ALLOC_CONF (c10/core/AllocatorConfig.h), so that one is unset."""
    conf = req.alloc_conf or ""
    lines = ["# The caching allocator's settings the memory estimate assumed (" + (conf or "torch's defaults") + ")",
             "unset PYTORCH_ALLOC_CONF",
             f"export PYTORCH_CUDA_ALLOC_CONF={shlex.quote(conf)}" if conf else "unset PYTORCH_CUDA_ALLOC_CONF"]
    if req.nccl_buffsize_bytes is not None:
        lines.append(f"export NCCL_BUFFSIZE={req.nccl_buffsize_bytes}  # NCCL's Simple-protocol buffer the estimate assumed")
    return lines


def _shm_cleanup(launch: _Launch) -> str:
    """DeepSpeed's CPU shm all-reduce leaves /dev/shm segments, about 69 MB per rank (planner/frameworks/deepspeed/shm.py):
    this user's of this run, by uid and port, go when the script exits."""
    if not (launch.is_cpu and launch.framework == "deepspeed"):
        return ""
    return ("# DeepSpeed's CPU all-reduce leaves shared-memory segments (~69 MB per rank): remove this run's\n"
            f"trap '{_remove_segments('$port')}' EXIT\n")


def _remove_segments(port_variable: str) -> str:
    """The shell command removing this user's segments of one run (planner/frameworks/deepspeed/shm.py, the pattern
    backend/supervisor.py removes too): no single quotes, so it fits a trap or a `bash -c '...'`."""
    return "rm -f /dev/shm/" + segment_glob(uid='"$(id -u)"', port=f'"{port_variable}"')


def _deepspeed_devices(gpus: int, variable: str = "ds_devices") -> str:
    """Shell lines setting ``$variable`` to the GPUs of a one-node ``deepspeed`` launch: DeepSpeed's
    runner deletes CUDA_VISIBLE_DEVICES when given --num_gpus and runs on physical GPUs 0..N-1
    (deepspeed 0.19.8 launcher/runner.py:451-460), so the visible ones, when set, are named with
    --include localhost:<ids> (the first N; indices, as runner.py:280-289 parses them), as
    backend/launch.py launcher_command does for `planner verify`."""
    return (
        f"# The GPUs: the first {gpus} of CUDA_VISIBLE_DEVICES when set (deepspeed --num_gpus would ignore it)\n"
        'IFS=, read -ra visible <<< "${CUDA_VISIBLE_DEVICES:-}"\n'
        'if [ "${#visible[@]}" -gt 0 ]; then\n'
        f'  if [ "${{#visible[@]}}" -lt {gpus} ]; then echo "$0: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES makes '
        f'${{#visible[@]}} GPU(s) visible; the plan needs {gpus}" >&2; exit 2; fi\n'
        f'  ids="$(IFS=,; echo "${{visible[*]:0:{gpus}}}")"\n'
        '  case "$ids" in *[!0-9,]*) echo "$0: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: deepspeed selects GPUs by '
        'index (--include localhost:0,1), not by UUID" >&2; exit 2;; esac\n'
        f'  {variable}="--include localhost:$ids"\n'
        'else\n'
        f'  {variable}="--num_gpus {gpus}"\n'
        'fi\n')


def _target(launch: _Launch, module_flag: str, here: str = "$here") -> str:
    """What every rank runs: the planner's trainer on this plan, or the user's script."""
    if launch.script is None:
        words = f'{module_flag} {TRAINER_MODULE} --plan "{here}/plan.json" --out "$out"'
        if launch.framework == "deepspeed":
            words += f' --deepspeed_config "{here}/ds_config.json"'
        return words
    return _q((launch.script.path,) + launch.script.args)


def _launch_sh(launch: _Launch) -> str:
    req = launch.request
    head = ["#!/usr/bin/env bash",
            f"# planner: {launch.summary}",
            "# Usage: ./launch.sh [more arguments for the training script]",
            f"# Runs {_what_runs(launch)}."]
    body: list[str] = []
    if req.nodes == 1:
        if launch.framework == "deepspeed":
            body.append(_deepspeed_devices(req.gpus).rstrip("\n"))
            run = (f'deepspeed $ds_devices --master_port "$port" '
                   f'{_target(launch, "--module")} "$@"')
        else:
            run = f'torchrun --standalone --nproc_per_node {req.gpus} {_target(launch, "-m")} "$@"'
    elif launch.framework == "deepspeed":
        head += [f"# {req.nodes} nodes: run this on the first node of the hostfile; DeepSpeed's launcher starts",
                 "# the other nodes over ssh (pdsh), in this directory at the same path (a shared filesystem).",
                 "# Under Slurm submit job.sbatch instead (no ssh needed)."]
        body += [
            "# the hostfile must list every node: one line per node, `HOSTNAME slots=GPUS`",
            f'nodes=$(grep -cE "^[^#[:space:]]+[[:space:]]+slots=" "$here/hostfile" || true)',
            f'if [ "$nodes" -ne {req.nodes} ]; then echo "$0: $here/hostfile lists $nodes nodes; the plan is for '
            f'{req.nodes}: one line per node, HOSTNAME slots={req.gpus}" >&2; exit 2; fi',
            "# the master address: the first node of the hostfile, where this script runs, unless given",
            'MASTER_ADDR="${MASTER_ADDR:-$(grep -m1 -oE "^[^#[:space:]]+" "$here/hostfile")}"',
        ]
        run = (f'deepspeed --hostfile "$here/hostfile" --num_nodes {req.nodes} --num_gpus {req.gpus} '
               f'--master_addr "$MASTER_ADDR" --master_port "$port" '
               f'{_target(launch, "--module")} "$@"')
    else:
        head += [f"# {req.nodes} nodes: run this on every node with NODE_RANK (0..{req.nodes - 1}, 0 on the master) and",
                 "# MASTER_ADDR (node 0's hostname or IP, reachable from the others). Under Slurm submit",
                 "# job.sbatch instead: it derives both from Slurm's variables."]
        body += [
            f': "${{NODE_RANK:?set NODE_RANK to the index of this node, 0..{req.nodes - 1} (0 on MASTER_ADDR)}}"',
            ': "${MASTER_ADDR:?set MASTER_ADDR to the address of the node with NODE_RANK=0}"',
        ]
        run = (f'torchrun --nnodes {req.nodes} --nproc_per_node {req.gpus} --node_rank "$NODE_RANK" '
               f'--master_addr "$MASTER_ADDR" --master_port "$port" '
               f'{_target(launch, "-m")} "$@"')
    return ("\n".join(head) + "\nset -euo pipefail\n"
            + 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"  # the directory of the emitted files\n'
            + _preamble(launch) + f'port="${{MASTER_PORT:-{DEFAULT_PORT}}}"\n' + _shm_cleanup(launch)
            + "".join(line + "\n" for line in body) + run + "\n")


def _sbatch(launch: _Launch) -> str:
    """One srun task per node; each task reads its own SLURM_NODEID (its node rank) and starts the
    node's ranks with the same launcher as launch.sh."""
    req = launch.request
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name=planner-{launch.strategy}",
        f"#SBATCH --nodes={req.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={req.gpus}" if not launch.is_cpu else f"#SBATCH --cpus-per-task={req.gpus}",
        "#SBATCH --exclusive",
        f"# planner: {launch.summary}",
        "# Submit from this directory: sbatch job.sbatch [more arguments for the training script]",
        f"# Runs {_what_runs(launch)}.",
        f"# --nodes: the plan's {req.nodes} node(s); --ntasks-per-node=1: one launcher per node, which starts",
        f"# that node's {req.gpus} ranks." + (" Every node reads this directory at the same path (a shared filesystem)."
                                             if req.nodes > 1 else ""),
        "set -euo pipefail",
        "# sbatch runs a copy of this file: the emitted files are in the directory it was submitted from",
        'here="${SLURM_SUBMIT_DIR:-$PWD}"',
        'if [ ! -f "$here/plan.json" ]; then echo "$0: submit from the directory with plan.json" >&2; exit 2; fi',
        _preamble(launch).rstrip("\n"),
        "# the master address: the first host of the allocation, which is node rank 0",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        f'export MASTER_PORT="${{MASTER_PORT:-{DEFAULT_PORT}}}"',
    ]
    if launch.script is None:
        lines.append("export out")
    node_rank = ("# In each task: SLURM_NNODES, the node count; SLURM_NODEID, this node's index 0..N-1 (with one task\n"
                 "# per node it equals SLURM_PROCID): the node rank. Single-quoted, so each task reads its own.")
    if launch.framework == "deepspeed" and req.nodes > 1:
        lines += [
            "# DeepSpeed's hostfile: every node of the allocation with its GPUs, written for this job",
            'export PLANNER_HOSTFILE="$here/hostfile.slurm-$SLURM_JOB_ID"',
            f'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\\$/ slots={req.gpus}/" > "$PLANNER_HOSTFILE"',
            node_rank,
            "# --no_ssh: every node starts its own ranks (no pdsh); the hostfile gives the world's layout.",
        ]
        launcher = ('deepspeed --hostfile "$PLANNER_HOSTFILE" --no_ssh --node_rank "$SLURM_NODEID" '
                    '--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"')
    elif launch.framework == "deepspeed":
        lines.append("# one node: DeepSpeed's launcher starts its ranks")
        lines.append(_deepspeed_devices(req.gpus, "PLANNER_DS_DEVICES").rstrip("\n"))
        lines.append("export PLANNER_DS_DEVICES")
        launcher = 'deepspeed $PLANNER_DS_DEVICES --master_port "$MASTER_PORT"'
    else:
        lines.append(node_rank)
        launcher = (f'torchrun --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" --nproc_per_node {req.gpus} '
                    '--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"')
    # The task's shell gets the emitted directory as $0 and the script's words as "$@": no quoting
    # of the user's meets the single quotes.
    module_flag = "--module" if launch.framework == "deepspeed" else "-m"
    command = f'{launcher} {_target(launch, module_flag, "$0")} "$@"' if launch.script is None else f'{launcher} "$@"'
    positional = '"$here" "$@"' if launch.script is None else f'"$here" {_target(launch, "")} "$@"'
    if launch.is_cpu and launch.framework == "deepspeed":
        lines.append("# each node removes the shared-memory segments DeepSpeed's CPU all-reduce leaves (~69 MB per rank)")
        command += f'; rc=$?; {_remove_segments("$MASTER_PORT")}; exit $rc'
    else:
        command = "exec " + command
    lines.append(f"srun --kill-on-bad-exit=1 bash -c '{command}' {positional}")
    return "\n".join(lines) + "\n"


def _hostfile(launch: _Launch) -> str:
    req = launch.request
    return (f"# DeepSpeed hostfile for {req.nodes} nodes of {req.gpus} GPUs: one line per node, `HOSTNAME slots={req.gpus}`,\n"
            "# the first one the node launch.sh runs on (it reaches the others over passwordless ssh/pdsh).\n"
            f"# Fill in the {req.nodes} hostnames, e.g. from `scontrol show hostnames \"$SLURM_JOB_NODELIST\"`;\n"
            "# job.sbatch writes its own from the Slurm allocation instead.\n"
            + "".join(f"# HOSTNAME{i} slots={req.gpus}\n" for i in range(req.nodes)))


def _what_runs(launch: _Launch) -> str:
    if launch.script is not None:
        return f"{launch.script.path} on every rank"
    return ("the planner's trainer (backend/worker.py, what `planner verify` runs): the model with random "
            "weights on synthetic tokens, each rank's measured memory and step time in planner-run/")


def _guide(launch: _Launch, names: list[str], titan: dict[str, dict[str, Any]] | None = None,
           tied: bool = False, titan_reduce: str | None = None) -> str:
    """LAUNCH.md: what each file is and how to run it. ``titan``: torchtitan's job config, when written."""
    req = launch.request
    roles = {
        "launch.sh": "the command for one node (deepspeed or torchrun); see its header",
        "job.sbatch": "the same under Slurm: `sbatch job.sbatch` from this directory",
        "hostfile": "DeepSpeed multi-node: list the nodes here before running launch.sh",
        "ds_config.json": "the DeepSpeed config the prediction assumed",
        "accelerate_config.yaml": "the same choice for `accelerate launch`",
        "trainer_args.json": "the matching transformers.TrainingArguments keyword arguments",
        "plan.json": "the request and the prediction; `planner verify --plan plan.json` runs it here",
        "torchtitan.toml": "the same degrees as a torchtitan job config (merge into your model's train config)",
        "megatron_args.txt": "the same pipeline layout as Megatron-LM arguments (its uneven first and last stages, "
                             "batch and recomputation; the first line says which data-parallel states it holds)",
        "lora_config.json": "the PEFT LoraConfig the prediction assumed: `get_peft_model(model, "
                            "LoraConfig(**json.load(open('lora_config.json'))))`",
        "bnb_config.json": "the quantized base: `from_pretrained(..., quantization_config=BitsAndBytesConfig("
                           "**json.load(open('bnb_config.json'))))`, then `prepare_model_for_kbit_training`",
        "LAUNCH.md": "this file",
    }
    script = launch.script.path if launch.script else "your_train.py"
    accelerate = "accelerate launch --config_file accelerate_config.yaml"
    if req.nodes > 1:
        accelerate += " --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR"
    model_parallel = "".join(f" x {n} {launch.degree(n)}" for n in ("tp", "cp", "pp", "ep") if launch.degree(n) > 1)
    out = [f"# Launching {launch.strategy}{model_parallel} on {req.nodes} x {req.gpus} {req.gpu}", "",
           f"planner: {launch.summary}", "", "## Files", ""]
    out += [f"- `{name}`: {roles[name]}" for name in names]
    out += ["", "## Run it", ""]
    if launch.unavailable:
        out += [f"No launch.sh or job.sbatch: {launch.unavailable}. Emit again with `--script 'your_train.py ARGS'` "
                "to get them for your own script."]
    else:
        out += [f"`./launch.sh` runs {_what_runs(launch)}."]
        if launch.script is None:
            out += ["", "Arguments go to the trainer: `./launch.sh --steps 10 --warmup 2` trains longer; "
                    "`PLANNER_OUT=DIR` moves the records; `PLANNER_ROOT=/path/to/planner` finds the trainer in a "
                    "checkout that is not installed."]
        elif launch.framework == "deepspeed":
            out += ["", "Your script finds the DeepSpeed JSON at `$PLANNER_DS_CONFIG` (for example "
                    "`deepspeed.initialize(..., config=os.environ[\"PLANNER_DS_CONFIG\"])`)."]
    if req.nodes > 1 and not launch.unavailable:
        out += ["", "Several nodes: under Slurm, `sbatch job.sbatch` (it derives the node rank from `SLURM_NODEID` and "
                "the master address from the first host of the allocation). Otherwise "
                + ("fill `hostfile` and run `./launch.sh` on its first node." if launch.framework == "deepspeed"
                   else "run `NODE_RANK=<0..N-1> MASTER_ADDR=<node 0> ./launch.sh` on every node.")]
    batch = req.micro_batch * req.gradient_accumulation * launch.data_parallel
    out += ["", f"Global batch: micro-batch {req.micro_batch} x {req.gradient_accumulation} accumulation x "
            f"{launch.data_parallel} data-parallel ranks = {batch} sequences per optimizer step "
            f"({_layout_words(launch)})."]
    if launch.framework == "deepspeed" and req.pp > 1:
        out += [""] + _deepspeed_pipeline_guide(launch, script)
        return "\n".join(out)
    if launch.accelerate_layout is not None:
        out += ["", f"No accelerate_config.yaml or trainer_args.json: {launch.accelerate_layout}; "
                "launch.sh" + (" and torchtitan.toml apply" if "torchtitan.toml" in names else " applies")
                + " the whole layout.", ""]
    else:
        out += _accelerate_guide(launch, accelerate, script)
    return _guide_tail(launch, out, names, titan, tied, titan_reduce)


def _accelerate_guide(launch: _Launch, accelerate: str, script: str) -> list[str]:
    """LAUNCH.md's section for accelerate and the Trainer (the layouts accelerate has)."""
    req = launch.request
    out: list[str] = []
    if launch.framework == "torch" and launch.degree("tp") > 1:
        out += ["", "accelerate applies tensor parallelism to a model loaded with `from_pretrained(..., "
                f"tp_plan=\"auto\")` (it checks the model's tp size against tp_size {launch.degree('tp')})."]
    out += ["", "## With Hugging Face accelerate or the Trainer", "",
            "For a script of your own that uses `transformers.Trainer` or `accelerate.Accelerator`, from this directory:",
            "", "```", f"{accelerate} {script}", "```", ""]
    if req.optimizer not in TRAINER_OPTIM:
        return out + [f"transformers' TrainingArguments name no optimizer that is {req.optimizer} (its \"adafactor\" "
                      "is transformers' own Adafactor; it has no Muon): the script builds torch's and passes it to "
                      "the Trainer (optimizers=(optimizer, None)), so no trainer_args.json is written."]
    out += ["with these `TrainingArguments` (trainer_args.json):", "", "```python",
            "import json", ""]
    parallel = _parallelism_config(launch)
    if parallel:
        out += ["from accelerate.parallelism_config import ParallelismConfig",
                "from transformers import TrainingArguments", "",
                f"# {_layout_words(launch)} (accelerate_config.yaml carries the same)",
                'args = TrainingArguments(output_dir="out", **json.load(open("trainer_args.json")),',
                "                         parallelism_config=ParallelismConfig("
                + ", ".join(f"{k}={v}" for k, v in parallel.items()) + "))"]
    else:
        out += ["from transformers import TrainingArguments", "",
                'args = TrainingArguments(output_dir="out", **json.load(open("trainer_args.json")))']
    out += ["```", "",
            "These arguments carry the same DeepSpeed / FSDP choice, so the script also runs under plain "
            f"`torchrun --nproc_per_node {req.gpus} {script}`" + (" (with --nnodes, --node_rank and --master_addr "
                                                                  "on each node)" if req.nodes > 1 else "") + ".", ""]
    return out


def _guide_tail(launch: _Launch, out: list[str], names: list[str], titan, tied: bool, titan_reduce) -> str:
    req = launch.request
    if "torchtitan.toml" in names:
        torchrun = f"torchrun --nproc_per_node {req.gpus}" + (
            f" --nnodes {req.nodes} --node_rank $NODE_RANK --master_addr $MASTER_ADDR" if req.nodes > 1 else "")
        out += ["## With torchtitan", "", "torchtitan applies the same tensor/pipeline/context-parallel degrees "
                "(torchtitan.toml's [parallelism]) to its own llama-style models. torchtitan 0.2 reads the file:", "",
                "```", torchrun + " -m torchtitan.train --job.config_file torchtitan.toml", "```", ""]
        out += _torchtitan_03_guide(torchrun, titan)
        if titan_reduce is not None:
            out += [titan_reduce, ""]
        if tied and req.pp > 1:
            # torchtitan 0.3.0 models/common/decoder.py: "Weight tying is not supported with Pipeline Parallel"
            out += ["The model ties its LM head to the embedding; torchtitan refuses weight tying under pipeline "
                    "parallelism (0.3: \"Weight tying is not supported with Pipeline Parallel\"), so train it "
                    "untied there: the estimate already counts the last stage's own head.", ""]
    if RECIPES[launch.precision].casts_model:
        out += ["bf16-pure: load the model in bf16 (`from_pretrained(..., dtype=torch.bfloat16)`); "
                "no autocast, no fp32 master copy.", ""]
    if launch.framework == "deepspeed" and "trainer_args.json" in names:
        out += ["The Trainer checks `trainer_args.json` against `ds_config.json` (batch, accumulation, learning rate, "
                "precision): change both together.", ""]
    return "\n".join(out)


def _layout_words(launch: _Launch) -> str:
    """The layout's degrees as the plan chose them: "dp_replicate 1 x dp_shard 8 x tp 4"."""
    degrees = " x ".join(f"{name} {launch.degree(name)}" for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
                         if name.startswith("dp") or launch.degree(name) > 1)
    if launch.fsdp and launch.replicas > 1:
        degrees += (f"; HSDP: shard groups of {launch.degree('dp_shard')} data-parallel ranks, replicated "
                    f"{launch.replicas} times")
    return degrees


def _torchtitan_03_guide(torchrun: str, titan: dict[str, dict[str, Any]]) -> list[str]:
    """torchtitan 0.3.0 reads no TOML (planner/frameworks/torch/torchtitan.py): its --module/--config and the
    pipeline's overrides, and the stage lists for the config function."""
    overrides = pipeline_overrides(titan)
    out = ["torchtitan 0.3 takes a config function (`--module llama3 --config <yours>`) and `--section.field` "
           "overrides with the same names; set the other [parallelism] and [training] values in that function"
           + (", or give them the same way" if not overrides else ", and the pipeline's here") + ":", "", "```",
           torchrun + " -m torchtitan.train --module llama3 --config YOUR_CONFIG" + "".join(
               f" \\\n    {o}" for o in overrides), "```", ""]
    if overrides:
        parts = titan["parallelism"]["module_fqns_per_model_part"]
        lists = [
            [HEAD_NAME["0.3"] if name == HEAD_NAME["0.2"] else name for name in part] for part in parts]
        out += [f"The {len(parts)} stages ({len(parts) // titan['parallelism']['pipeline_parallel_degree']} per "
                "rank) are the planner's split; torchtitan's own would weigh the embedding and the head as a layer "
                "each and may cut elsewhere. In the config function (0.3 names the head `lm_head`):", "", "```python",
                f"parallelism.module_fqns_per_model_part = {json.dumps(lists)}", "```", ""]
    return out


def _deepspeed_pipeline_guide(launch: _Launch, script: str) -> list[str]:
    """DeepSpeed's pipeline engine is built in code: what ds_config.json carries and what the script does."""
    req = launch.request
    ckpt = 1 if req.checkpointing == "full" else 0
    return ["## DeepSpeed's pipeline engine", "",
            f"DeepSpeed builds its {req.pp} stages from a `PipelineModule` in your script; ds_config.json carries "
            f"the micro-batch ({req.micro_batch}), the micro-batches per step (gradient_accumulation_steps "
            f"{req.gradient_accumulation}), the batch over the {launch.world // req.pp} data-parallel ranks "
            "(train_batch_size) and the activation checkpointing interval. No accelerate or Trainer files: "
            "neither drives a PipelineModule (they would run ZeRO over every rank instead).", "",
            "```python", "import deepspeed", "from deepspeed.pipe import PipelineModule", "",
            "# the layers in order: embedding, each decoder block, final norm + LM head (each a module taking one tensor)",
            f"model = PipelineModule(layers=layers, num_stages={req.pp}, loss_fn=loss_fn,",
            "                       partition_method=\"type:DecoderLayer\",  # the blocks by count, as the planner splits them",
            f"                       activation_checkpoint_interval={ckpt})",
            "engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),",
            "                                       config=\"ds_config.json\")",
            "loss = engine.train_batch(data_iter)  # one optimizer step", "```", "",
            f"Launch it with `deepspeed --num_gpus {req.gpus} {script}`" + (" (and the hostfile)" if req.nodes > 1 else "")
            + "; `--script` makes launch.sh and job.sbatch for it.", ""]


def _summary(strategy: str, micro: int, accumulation: int, checkpointing: str, offload_optimizer: str,
             offload_params: str, peak_bytes: int, step_seconds: float | None) -> str:
    step = f", step {step_seconds:.3f} s" if step_seconds is not None else ""
    return (f"{strategy} micro-batch {micro} x {accumulation} accumulation, checkpointing {checkpointing}, "
                       f"offload {offload_optimizer}/{offload_params}, predicted peak {peak_bytes / 2**30:.2f} GiB{step}")


def write_files(directory: str | Path, files: dict[str, str]) -> list[Path]:
    """Write every file or none: each goes to a temporary name first, then all are renamed."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlannerError(f"--emit {directory}: cannot create the directory ({exc.strerror})", field="emit") from None
    staged = []
    try:
        for name, text in files.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            staged.append((tmp, out / name))
        for tmp, final in staged:
            os.replace(tmp, final)
            final.chmod(0o755 if final.name.endswith((".sh", ".sbatch")) else 0o644)
    except OSError as exc:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        raise PlannerError(f"--emit {directory}: cannot write ({exc.strerror})", field="emit") from None
    return [final for _, final in staged]
