"""What DeepSpeed 0.19.8 launches: the ``deepspeed`` runner's command lines (emitted launch.sh and
job.sbatch, and ``planner verify``'s ranks), its hostfile, ds_config.json as a launch writes it
(the prediction's settings over the user's own config), and the parts of accelerate's, the
Trainer's and LAUNCH.md's text that are DeepSpeed's. A later DeepSpeed whose runner or config
differs subclasses ``DeepSpeedLauncher`` beside this module.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError
from planner.frameworks.deepspeed.shm import segment_glob
from planner.frameworks.launcher import Launch, Launcher, visible_device_ids
from planner.recipes.precision import DTYPE_SPELLINGS

if TYPE_CHECKING:
    from planner.setup_fields import SetupFields

CONFIG_FILE = "ds_config.json"


class DeepSpeedLauncher(Launcher):
    program = "deepspeed"
    module_flag = "--module"
    accelerate_type = "DEEPSPEED"
    # DeepSpeed's TorchBackend builds this on CPU in every rank (comm/torch.py)
    cpu_ops = ("ShareMemCommBuilder",)

    def config_files(self, setup: "SetupFields", launch: "Launch", users_config: dict[str, Any] | None) -> dict[str, str]:
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
        if users_config is not None:
            config = _keep_users_config(users_config, config)
        if launch.is_cpu:  # the same switch backend/launch.py worker_job makes for `planner verify`
            setup.framework.use_torch_adam(config)
        return {CONFIG_FILE: json.dumps(config, indent=2) + "\n"}

    def node_files(self, launch: "Launch") -> dict[str, str]:
        return {"hostfile": _hostfile(launch)} if launch.request.nodes > 1 else {}

    def environment(self, launch: "Launch") -> tuple[str, list[str]]:
        return ", $PLANNER_DS_CONFIG (DeepSpeed's JSON)", [f'export PLANNER_DS_CONFIG="$here/{CONFIG_FILE}"']

    def target_arguments(self, here: str) -> str:
        return f' --deepspeed_config "{here}/{CONFIG_FILE}"'

    def exit_cleanup(self, launch: "Launch") -> str:
        """DeepSpeed's CPU shm all-reduce leaves /dev/shm segments, about 69 MB per rank
        (planner/frameworks/deepspeed/shm.py): this user's of this run, by uid and port, go when
        the script exits."""
        if not launch.is_cpu:
            return ""
        return ("# DeepSpeed's CPU all-reduce leaves shared-memory segments (~69 MB per rank): remove this run's\n"
                f"trap '{_remove_segments('$port')}' EXIT\n")

    def node_command(self, launch: "Launch", target: str) -> tuple[list[str], list[str], str]:
        req = launch.request
        if req.nodes == 1:
            devices = _deepspeed_devices(req.gpus).rstrip("\n")
            return [], [devices], f'deepspeed $ds_devices --master_port "$port" {target} "$@"'
        head = [f"# {req.nodes} nodes: run this on the first node of the hostfile; DeepSpeed's launcher starts",
                "# the other nodes over ssh (pdsh), in this directory at the same path (a shared filesystem).",
                "# Under Slurm submit job.sbatch instead (no ssh needed)."]
        body = [
            "# the hostfile must list every node: one line per node, `HOSTNAME slots=GPUS`",
            'nodes=$(grep -cE "^[^#[:space:]]+[[:space:]]+slots=" "$here/hostfile" || true)',
            f'if [ "$nodes" -ne {req.nodes} ]; then echo "$0: $here/hostfile lists $nodes nodes; the plan is for '
            f'{req.nodes}: one line per node, HOSTNAME slots={req.gpus}" >&2; exit 2; fi',
            "# the master address: the first node of the hostfile, where this script runs, unless given",
            'MASTER_ADDR="${MASTER_ADDR:-$(grep -m1 -oE "^[^#[:space:]]+" "$here/hostfile")}"',
        ]
        run = (f'deepspeed --hostfile "$here/hostfile" --num_nodes {req.nodes} --num_gpus {req.gpus} '
               f'--master_addr "$MASTER_ADDR" --master_port "$port" '
               f'{target} "$@"')
        return head, body, run

    def sbatch_launcher(self, launch: "Launch", node_rank_comment: str) -> tuple[list[str], str]:
        req = launch.request
        if req.nodes > 1:
            lines = [
                "# DeepSpeed's hostfile: every node of the allocation with its GPUs, written for this job",
                'export PLANNER_HOSTFILE="$here/hostfile.slurm-$SLURM_JOB_ID"',
                f'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\\$/ slots={req.gpus}/" > "$PLANNER_HOSTFILE"',
                node_rank_comment,
                "# --no_ssh: every node starts its own ranks (no pdsh); the hostfile gives the world's layout.",
            ]
            return lines, ('deepspeed --hostfile "$PLANNER_HOSTFILE" --no_ssh --node_rank "$SLURM_NODEID" '
                           '--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"')
        lines = ["# one node: DeepSpeed's launcher starts its ranks",
                 _deepspeed_devices(req.gpus, "PLANNER_DS_DEVICES").rstrip("\n"),
                 "export PLANNER_DS_DEVICES"]
        return lines, 'deepspeed $PLANNER_DS_DEVICES --master_port "$MASTER_PORT"'

    def sbatch_cleanup(self, launch: "Launch") -> tuple[str, str] | None:
        if not launch.is_cpu:
            return None
        return ("# each node removes the shared-memory segments DeepSpeed's CPU all-reduce leaves (~69 MB per rank)",
                f'; rc=$?; {_remove_segments("$MASTER_PORT")}; exit $rc')

    def accelerate_section(self, launch: "Launch") -> tuple[str, dict[str, Any]] | None:
        # With deepspeed_config_file, precision, ZeRO stage, offload and accumulation come from the
        # JSON alone; accelerate refuses them in this file (DeepSpeedPlugin._deepspeed_config_checks).
        block: dict[str, Any] = {"deepspeed_config_file": CONFIG_FILE, "zero3_init_flag": launch.zero_stage == 3}
        if launch.request.nodes > 1:
            block["deepspeed_multinode_launcher"] = "standard"  # torchrun on every node, no ssh/pdsh
        return "deepspeed_config", block

    def trainer_arguments(self, launch: "Launch") -> dict[str, Any]:
        return {"deepspeed": CONFIG_FILE}

    def script_note(self) -> list[str]:
        return ["", "Your script finds the DeepSpeed JSON at `$PLANNER_DS_CONFIG` (for example "
                "`deepspeed.initialize(..., config=os.environ[\"PLANNER_DS_CONFIG\"])`)."]

    def multi_node_note(self) -> str:
        return "fill `hostfile` and run `./launch.sh` on its first node."

    def pipeline_guide(self, launch: "Launch", script: str) -> list[str] | None:
        return _deepspeed_pipeline_guide(launch, script) if launch.request.pp > 1 else None

    def verify_command(self, request: Any, target: list[str], port: int, *, python: str, program: str,
                       hostfile: str | None, device: str, visible: list[str]) -> list[str]:
        # --num_gpus N makes DeepSpeed's runner delete CUDA_VISIBLE_DEVICES and run on physical GPUs
        # 0..N-1 (deepspeed 0.19.8 launcher/runner.py:451-460); --include keeps the visible ones.
        if request.nodes > 1 and device == "cpu" and not hostfile:
            # CPU ranks without a hostfile: every node's ranks on this host, as the torch path runs them
            # (a ZeRO rank's memory depends on the data-parallel world, not on where its peers are);
            # DeepSpeed's runner would refuse --num_nodes > 1 without one ("Num nodes is >1 but no extra
            # nodes available via hostfile", deepspeed 0.19.8 launcher/runner.py:477)
            return [program, "--num_gpus", str(request.gpus * request.nodes), "--master_port", str(port), *target]
        shown = visible if device != "cpu" and request.nodes == 1 else None
        devices = (["--include", "localhost:" + ",".join(self.device_ids(request, visible))] if shown
                   else ["--num_gpus", str(request.gpus)])
        command = [program, *devices, "--master_port", str(port)]
        if request.nodes > 1:
            command += ["--num_nodes", str(request.nodes)]
            if hostfile:
                command += ["--hostfile", hostfile]
        return command + target

    def device_ids(self, request: Any, visible: list[str]) -> list[str]:
        """On one node the visible devices through ``--include localhost:<ids>``, the first --gpus
        of them; the runner checks each slot against range(device_count) as an integer
        (runner.py:280-289 parse_node_config_list, 329-331), so ids must be indices, not UUIDs.
        Over several nodes each node's launcher sets CUDA_VISIBLE_DEVICES to the hostfile's slots
        0..N-1 (deepspeed/launcher/launch.py:172), whatever was visible."""
        if request.nodes > 1:
            return [str(i) for i in range(request.gpus)]
        ids = visible_device_ids(request, visible)
        if visible and not all(i.isdigit() for i in ids):
            raise PlannerError(f"CUDA_VISIBLE_DEVICES={','.join(visible)}: DeepSpeed's launcher selects GPUs by "
                               "index (--include localhost:0,1), not by UUID or MIG name; list the devices by index",
                               field=None)
        return ids


LAUNCHER = DeepSpeedLauncher()


def _deepspeed_pipeline(config: dict[str, Any], setup: "SetupFields") -> None:
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
        if isinstance(mine, dict) and same_optimizer(mine, optimizer):
            optimizer = json.loads(json.dumps(mine))
        elif isinstance(mine, dict) and isinstance(mine.get("params"), dict):
            # another optimizer than the user's (an explicit --optimizer): its learning rate and decay carry over
            kept = {k: v for k, v in mine["params"].items() if k in ("lr", "weight_decay")}
            optimizer = optimizer | {"params": optimizer["params"] | kept}
        config["optimizer"] = optimizer
    for key, value in planned.items():
        config.setdefault(key, value)  # what the plan writes that the user left out (steps_per_print)
    # communication_data_type is modelled only as the training dtype (planner.frameworks.deepspeed.config
    # check_communication_dtype); with another precision than the config's, the plan's dtype is reduced
    training = "bf16" if "bf16" in planned else "fp16" if "fp16" in planned else "fp32"
    if config.get("communication_data_type") not in (None, "auto", *DTYPE_SPELLINGS[training]):
        del config["communication_data_type"]
    return config


def same_optimizer(mine: dict[str, Any], planned: dict[str, Any]) -> bool:
    """Adam and AdamW are the planner's adamw (planner.frameworks.deepspeed.config._optimizer), SGD its sgd."""
    kinds = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd", "lion": "lion", "adafactor": "adafactor"}
    kind = mine.get("type")
    return isinstance(kind, str) and kinds.get(kind.lower()) == kinds[planned["type"].lower()]


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


def _hostfile(launch: "Launch") -> str:
    req = launch.request
    return (f"# DeepSpeed hostfile for {req.nodes} nodes of {req.gpus} GPUs: one line per node, `HOSTNAME slots={req.gpus}`,\n"
            "# the first one the node launch.sh runs on (it reaches the others over passwordless ssh/pdsh).\n"
            f"# Fill in the {req.nodes} hostnames, e.g. from `scontrol show hostnames \"$SLURM_JOB_NODELIST\"`;\n"
            "# job.sbatch writes its own from the Slurm allocation instead.\n"
            + "".join(f"# HOSTNAME{i} slots={req.gpus}\n" for i in range(req.nodes)))


def _deepspeed_pipeline_guide(launch: "Launch", script: str) -> list[str]:
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
