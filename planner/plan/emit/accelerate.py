"""accelerate_config.yaml and trainer_args.json: the same choice for ``accelerate launch``
(accelerate 1.16's config format, accelerate/commands/config/config_args.py ClusterConfig) and
for ``transformers.TrainingArguments``: the framework's own section (the DeepSpeed plugin
pointing at ds_config.json: Launcher.accelerate_section), or accelerate's FSDP plugin (FSDP2)
for fsdp / fsdp-grad-op / hsdp, or plain multi-GPU for ddp."""

from __future__ import annotations

from typing import Any

from planner.frameworks.deepspeed.launch import same_optimizer
from planner.plan.emit.spec import DEFAULT_PORT, Launch

LEARNING_RATE = 1e-4  # build_ds_config's optimizer lr; the Trainer checks its learning_rate against it
# transformers' OptimizerNames (transformers/training_args.py) for the planner's optimizers
# (sgd-momentum: "sgd" with optim_args momentum; adafactor: transformers' "adafactor" is its own
# Adafactor, not torch's, and muon has no name there: both absent, so no TrainingArguments for them)
TRAINER_OPTIM = {"adamw": "adamw_torch", "sgd": "sgd", "sgd-momentum": "sgd", "adamw-8bit": "adamw_bnb_8bit",
                 "adamw-paged-8bit": "paged_adamw_8bit", "adamw-torchao-8bit": "adamw_torch_8bit",
                 "adamw-torchao-4bit": "adamw_torch_4bit", "lion": "lion_32bit"}


def accelerate_config(launch: Launch) -> dict[str, Any]:
    """``accelerate launch --config_file`` content (keys of accelerate 1.16's ClusterConfig)."""
    req = launch.request
    distributed = launch.launcher.accelerate_type
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
    section = launch.launcher.accelerate_section(launch)
    if section is not None:  # the framework's own config carries precision, sharding and accumulation
        config[section[0]] = section[1]
        return config
    config["mixed_precision"] = launch.recipe.autocast_dtype or "no"
    if distributed == "FSDP":
        config["fsdp_config"] = _fsdp_plugin(launch)
        parallel = parallelism_config(launch)
        if parallel:
            # FSDP2's mesh (dp_replicate, dp_shard, cp, tp) of consecutive ranks, tp innermost
            # (accelerate/parallelism_config.py _get_mesh), as backend/train.py builds it; the keys
            # are ClusterConfig.parallelism_config's, what `accelerate launch` reads into
            # PARALLELISM_CONFIG_* (commands/launch.py --parallelism_config_*)
            config["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in parallel.items()}
    return config


def parallelism_config(launch: Launch) -> dict[str, int]:
    """accelerate's ParallelismConfig keyword arguments for the layout; empty for plain FSDP."""
    sizes = {"dp_replicate_size": launch.degree("dp_replicate"), "dp_shard_size": launch.degree("dp_shard"),
             "tp_size": launch.degree("tp"), "cp_size": launch.degree("cp")}
    if not launch.fsdp or all(v == 1 for k, v in sizes.items() if k != "dp_shard_size"):
        return {}
    return {k: v for k, v in sizes.items() if k.startswith("dp") or v > 1}  # accelerate's default is 1


def _fsdp_plugin(launch: Launch) -> dict[str, Any]:
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


def trainer_arguments(launch: Launch) -> dict[str, Any]:
    """``transformers.TrainingArguments(**this)`` (transformers 5): batch, accumulation, precision,
    checkpointing and the DeepSpeed/FSDP choice of the plan. Values the DeepSpeed JSON also holds
    are equal, as the Trainer requires (HfTrainerDeepSpeedConfig.trainer_config_process)."""
    req = launch.request
    args: dict[str, Any] = {
        "per_device_train_batch_size": req.micro_batch,
        "gradient_accumulation_steps": req.gradient_accumulation,
        "bf16": launch.recipe.autocast_dtype == "bf16",
        "fp16": launch.recipe.autocast_dtype == "fp16",
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
    if req.loss == "liger-fused" or req.fused_kernels:
        # TrainingArguments: Liger's kernels, each part named (hf_trainer.py liger_kernel reads them back), so the
        # apply function's defaults turn on nothing the estimate did not count
        args["use_liger_kernel"] = True
        args["liger_kernel_config"] = {"fused_linear_cross_entropy": req.loss == "liger-fused",
                                       **{part: part in req.fused_kernels for part in ("rms_norm", "rope", "swiglu")}}
    if launch.fsdp and req.gradient_accumulation > 1 and not req.defer_gradient_sync:
        # the Trainer enters accelerator.no_sync on every micro-batch but the last unless told to sync each one
        # (trainer.py sync_context): the estimate reduce-scattered every micro-batch, so the job does too
        args["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    if launch.is_cpu:
        args["use_cpu"] = True
    named = launch.launcher.trainer_arguments(launch)
    if named:  # the framework's config file
        args |= named
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
    where the emitted config keeps the user's optimizer block (the same optimizer:
    planner/frameworks/deepspeed/launch.py _keep_users_config)."""
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
    if optimizer_name in ("adamw", "sgd") and same_optimizer(optimizer, {"type": optimizer_name}):
        if _number(params.get("eps")):
            args["adam_epsilon"] = params["eps"]
        betas = params.get("betas")
        if isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_number(b) for b in betas):
            args["adam_beta1"], args["adam_beta2"] = betas
    return args
