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
- ``torchtitan.toml``: a torch layout with model parallelism as torchtitan's job config.
- ``megatron_args.txt``: a pipeline layout as Megatron-LM's arguments (planner/plan/megatron.py).
- ``lora_config.json`` / ``bnb_config.json``: LoRA's PEFT config and a quantized base's bitsandbytes one.
- ``accelerate_config.yaml``: the same choice for ``accelerate launch`` (accelerate 1.16's config
  format, accelerate/commands/config/config_args.py ClusterConfig): the DeepSpeed plugin pointing at
  ds_config.json, the FSDP plugin (FSDP2) for fsdp / fsdp-grad-op / hsdp, or plain multi-GPU for ddp.
- ``trainer_args.json``: the matching ``transformers.TrainingArguments`` keyword arguments.
- ``plan.json``: the request and the prediction; ``planner verify --plan plan.json`` runs it.

One module per format: the framework's launcher answers for its own lines and files (planner/
frameworks/launcher.py; deepspeed/launch.py: the ``deepspeed`` runner, hostfile, ds_config.json;
torch/launch.py: ``torchrun``, torchtitan.toml), emit/shell.py writes launch.sh and job.sbatch
around it, emit/accelerate.py accelerate's and the Trainer's files, emit/guide.py LAUNCH.md. The
result is a mapping of file names to text: the adapters write it (cli/files.py).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import yaml

from planner.errors import PlannerError
from planner.frameworks import version_field
from planner.memory.orchestrator import estimate, estimate_resolved, resolve, setup_of
from planner.model.catalogue import UnsupportedModelTypeError
from planner.plan.emit.accelerate import TRAINER_OPTIM, accelerate_config, trainer_arguments
from planner.plan.emit.guide import guide
from planner.plan.emit.hf_tp import hf_tp_loader
from planner.plan.emit.shell import launch_sh, sbatch
from planner.plan.emit.spec import Launch, Script
from planner.parallel.pipeline import SCHEDULE_SPECS
from planner.plan.megatron import megatron_arguments, megatron_file
from planner.plan.search import finetune_fields
from planner.recipes.finetune import bnb_config, lora_config
from planner.schema import SHARDING_STRATEGIES, Candidate, EstimateRequest, EstimateResult, PlanRequest
from planner.setup import Setup
from planner.strategies import explicit_hsdp_shard, strategy as lookup_strategy


__all__ = ["Script", "emit_estimate_files", "emit_files", "estimate_request_for", "finetune_files"]


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
                           **version_field(lookup_strategy(c.strategy), req.framework_version),
                           **{k: v for k, v in c.parallel.model_dump().items() if k in ("tp", "pp", "cp", "ep") and v > 1},
                           **({"tp_plan": req.tp_plan} if c.parallel.tp > 1 and req.tp_plan != "torchtitan" else {}),
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
    if est.activation_offload:
        # transformers' TrainingArguments, accelerate and DeepSpeed have no activation offloading; TRL's
        # SFTConfig(activation_offloading=True), Axolotl's activation_offloading and torchtune's
        # enable_activation_offloading wrap the forward in the training script's own loop
        raise PlannerError("--emit with activation_offload: the emitted Trainer, accelerate and DeepSpeed configs "
                           "have no such setting; the training script applies it (TRL SFTConfig "
                           "activation_offloading=True)", field="activation_offload")
    if est.async_tp:
        # accelerate's ParallelismConfig and the Trainer's TP (transformers' tp_plan) have no async TP, and
        # torchtitan runs it under torch.compile only, which the emitted files do not switch on (compile, below)
        raise PlannerError("--emit with async_tp: torchtitan runs async TP under torch.compile, which the emitted "
                           "files do not switch on, and the Trainer, accelerate and DeepSpeed configs have no async "
                           "TP; emit without it", field="async_tp")
    if est.fsdp_version == 1:
        # the emitted accelerate and Trainer configs are FSDP2's (emit/accelerate.py fsdp_version 2): an FSDP1
        # job estimated but emitted as FSDP2 would be another job
        raise PlannerError("--emit with fsdp_version=1: the emitted accelerate and Trainer configs run FSDP2 "
                           "(fsdp_version 2); emit with fsdp_version 2", field="fsdp_version")
    if est.compile != "none":
        # the emitted configs do not switch torch.compile on (TrainingArguments torch_compile, accelerate
        # dynamo_backend): a job estimated with it but emitted without it would be another job (cmem2)
        raise PlannerError(f"--emit with compile={est.compile}: the emitted Trainer, accelerate and DeepSpeed configs "
                           "do not set torch.compile; emit with compile=none", field="compile")
    unavailable = None if script is not None else _trainer_unavailable(setup, est)
    s = setup.strategy
    launcher = setup.framework.launch
    launch = Launch(request=setup.request, launcher=launcher, strategy=s.name,
                    fsdp=setup.framework.fsdp_sharding(s) is not None,
                    reshard_after_forward=not s.params_unsharded_in_step,
                    zero_stage=s.zero_stage, recipe=setup.recipe,
                    is_cpu=setup.gpu.is_cpu, shard_size=setup.shard_size, script=script, summary=summary,
                    unavailable=unavailable, dims=tuple(setup.dims.as_dict().items()))
    files = launcher.config_files(setup, launch, est.ds_config)
    if launch.accelerate_layout is None:
        # accelerate's DeepSpeed plugin and the Trainer wrap a module, never a PipelineModule: for
        # a pipeline (or a layout accelerate has not) their files would run another layout
        files["accelerate_config.yaml"] = yaml.safe_dump(accelerate_config(launch), sort_keys=False)
        if est.optimizer in TRAINER_OPTIM:  # transformers has no name for torch's Adafactor or Muon
            files["trainer_args.json"] = json.dumps(trainer_arguments(launch), indent=2) + "\n"
    if setup.finetune is not None:
        files.update(finetune_files(setup))
    if unavailable is None:
        files["launch.sh"] = launch_sh(launch)
        files["job.sbatch"] = sbatch(launch)
        files |= launcher.node_files(launch)
    if setup.tp > 1 and est.tp_plan == "transformers":
        files["load_model.py"] = hf_tp_loader(setup)
    files |= launcher.layout_files(setup)
    megatron = _megatron_file(setup)
    if megatron is not None:
        files["megatron_args.txt"] = megatron
    files["plan.json"] = json.dumps(plan_doc, indent=2) + "\n"
    names = sorted(files) + ["LAUNCH.md"]
    files["LAUNCH.md"] = guide(launch, names, launcher.layout_guide(launch, setup, names, _peaks(setup)))
    return files


def _peaks(setup: Setup) -> Callable[[dict[str, Any]], int]:
    """The peak bytes of ``setup``'s request with some fields changed; unchanged, the Setup
    already resolved is estimated, not resolved again."""
    def peak_with(update: dict[str, Any]) -> int:
        result = estimate(setup.request.model_copy(update=update)) if update else estimate_resolved(setup)
        return result.per_device.peak_bytes

    return peak_with


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
    return megatron_file(args, f"Megatron-LM (d98e8a6) arguments of this pipeline layout; {twin}.{uneven}"
                         + _megatron_schedule_note(req.pp_schedule, req.pp_virtual_stages))


def _megatron_schedule_note(schedule: str, virtual_stages: int) -> str:
    """Megatron-LM runs 1F1B, interleaved over virtual stages (core/pipeline_parallel/schedules.py
    forward_backward_pipelining_with/without_interleaving); it has no GPipe, breadth-first,
    zero-bubble or V-shaped schedule: the arguments run the nearest one it has, whose peak and bubble
    differ."""
    spec = SCHEDULE_SPECS[schedule]
    if spec.megatron:
        return ""
    nearest = "interleaved 1F1B" if virtual_stages > 1 else "1F1B"
    return (f" Megatron-LM has no schedule like torch's {spec.torch_class} (pp_schedule {schedule}): these arguments "
            f"run its {nearest} instead, whose peak and bubble differ from this estimate's (estimate pp_schedule "
            f"{'interleaved' if virtual_stages > 1 else '1f1b'} for that run).")


def finetune_files(setup) -> dict[str, str]:
    """LoRA/QLoRA: the PEFT LoraConfig (``LoraConfig(**json.load(...))``) and, for a quantized base,
    transformers' BitsAndBytesConfig (``BitsAndBytesConfig(**json.load(...))``, its compute dtype
    as a string). The planner's trainer reads them from plan.json's request, the same settings."""
    files = {"lora_config.json": json.dumps(lora_config(setup.finetune), indent=2) + "\n"}
    quantization = bnb_config(setup.finetune, setup.recipe.compute)
    if quantization is not None:
        files["bnb_config.json"] = json.dumps(quantization, indent=2) + "\n"
    return files


def _trainer_unavailable(setup, est: EstimateRequest) -> str | None:
    """Why the planner's own trainer cannot run this configuration, if it cannot."""
    if setup.model.config is None:
        return "the planner's trainer needs an architecture (--model or --model-file), not --params"
    if est.optimizer not in setup.framework.probe_optimizers:
        return (f"the planner's trainer runs {setup.strategy.name} with {', '.join(setup.framework.probe_optimizers)}, "
                f"not {est.optimizer}")
    if setup.cp > 1:
        return "the planner's trainer does not run context parallelism (torch's ring attention needs CUDA)"
    if est.tp_plan == "transformers" and setup.tp != setup.world_size:
        if setup.dims.dp_replicate > 1 or setup.dims.tp * setup.dims.dp_shard != setup.world_size:
            return ("the planner's trainer runs transformers' own TP over a (dp_shard, tp) mesh of the whole world "
                    "only; your script loads the model as load_model.py does")
        if setup.recipe.compute != "fp32":
            return ("the planner's trainer runs transformers' TP x FSDP2 composition in fp32 only; your script loads "
                    "the model as load_model.py does")
    if setup.dims.pp > 1 and setup.framework.own_pipeline_engine:
        return ("DeepSpeed's pipeline engine trains a PipelineModule your script builds (the planner's trainer "
                "runs pipelines with torch's pipelining: emit with --strategy fsdp for that)")
    return None


def _summary(strategy: str, micro: int, accumulation: int, checkpointing: str, offload_optimizer: str,
             offload_params: str, peak_bytes: int, step_seconds: float | None) -> str:
    step = f", step {step_seconds:.3f} s" if step_seconds is not None else ""
    return (f"{strategy} micro-batch {micro} x {accumulation} accumulation, checkpointing {checkpointing}, "
                       f"offload {offload_optimizer}/{offload_params}, predicted peak {peak_bytes / 2**30:.2f} GiB{step}")
