"""What torch 2.13 launches: ``torchrun``'s command lines (emitted launch.sh and job.sbatch, and
``planner verify``'s ranks), and torchtitan's job config of a layout with model parallelism
(torchtitan.toml, planner/frameworks/torch/torchtitan.py) with its section of LAUNCH.md. DDP
and FSDP2 need no config file of their own: accelerate's FSDP plugin and the Trainer's flags
(planner/plan/emit/accelerate.py) carry them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from planner.errors import PlannerError
from planner.frameworks.launcher import Launch, Launcher, visible_device_ids
from planner.frameworks.torch.torchtitan import (HEAD_NAME, MIXED_PARAM, pipeline_overrides, torchtitan_config,
                                                 torchtitan_toml)
from planner.parallel.stages import stage_bounds
from planner.units import GIB

if TYPE_CHECKING:
    from planner.setup_fields import SetupFields

TORCHTITAN_FILE = "torchtitan.toml"


class TorchrunLauncher(Launcher):
    program = "torchrun"
    module_flag = "-m"
    accelerate_type = "MULTI_GPU"
    accelerate_applies_tp = True

    def layout_files(self, setup: "SetupFields") -> dict[str, str]:
        """torchtitan's job config for a layout with model parallelism (tp, pp or cp > 1): the
        trainer that applies these degrees to a llama-style model as the estimate assumes. None
        for pure data parallelism (the accelerate/Trainer files cover it) and for fp16
        (torchtitan's mixed_precision_param takes bfloat16 or float32 only)."""
        req = setup.request
        if max(setup.tp, req.pp, req.cp) == 1 or setup.recipe.compute not in MIXED_PARAM:
            return {}
        if req.tp_plan == "transformers":
            return {}  # torchtitan's apply_tp is not the model's own plan: load_model.py says how it is loaded
        return {TORCHTITAN_FILE: torchtitan_toml(_torchtitan_config(setup))}

    def layout_guide(self, launch: "Launch", setup: "SetupFields", names: list[str],
                     peak_with: Callable[[dict[str, Any]], int]) -> list[str]:
        """LAUNCH.md's torchtitan section, when torchtitan.toml is written; ``peak_with`` gives the
        peak of torchtitan's own fp32 gradient reduction."""
        if TORCHTITAN_FILE not in names:
            return []
        req = launch.request
        torchrun = f"torchrun --nproc_per_node {req.gpus}" + (
            f" --nnodes {req.nodes} --node_rank $NODE_RANK --master_addr $MASTER_ADDR" if req.nodes > 1 else "")
        out = ["## With torchtitan", "", "torchtitan applies the same tensor/pipeline/context-parallel degrees "
               "(torchtitan.toml's [parallelism]) to its own llama-style models. torchtitan 0.2 reads the file:", "",
               "```", torchrun + " -m torchtitan.train --job.config_file torchtitan.toml", "```", ""]
        out += _torchtitan_03_guide(torchrun, _torchtitan_config(setup))
        reduce = _torchtitan_reduce_note(setup, peak_with)
        if reduce is not None:
            out += [reduce, ""]
        if setup.arch is not None and setup.arch.tie_word_embeddings and req.pp > 1:
            # torchtitan 0.3.0 models/common/decoder.py: "Weight tying is not supported with Pipeline Parallel"
            out += ["The model ties its LM head to the embedding; torchtitan refuses weight tying under pipeline "
                    "parallelism (0.3: \"Weight tying is not supported with Pipeline Parallel\"), so train it "
                    "untied there: the estimate already counts the last stage's own head.", ""]
        return out

    def node_command(self, launch: "Launch", target: str) -> tuple[list[str], list[str], str]:
        req = launch.request
        if req.nodes == 1:
            return [], [], f'torchrun --standalone --nproc_per_node {req.gpus} {target} "$@"'
        head = [f"# {req.nodes} nodes: run this on every node with NODE_RANK (0..{req.nodes - 1}, 0 on the master) and",
                "# MASTER_ADDR (node 0's hostname or IP, reachable from the others). Under Slurm submit",
                "# job.sbatch instead: it derives both from Slurm's variables."]
        body = [
            f': "${{NODE_RANK:?set NODE_RANK to the index of this node, 0..{req.nodes - 1} (0 on MASTER_ADDR)}}"',
            ': "${MASTER_ADDR:?set MASTER_ADDR to the address of the node with NODE_RANK=0}"',
        ]
        run = (f'torchrun --nnodes {req.nodes} --nproc_per_node {req.gpus} --node_rank "$NODE_RANK" '
               f'--master_addr "$MASTER_ADDR" --master_port "$port" '
               f'{target} "$@"')
        return head, body, run

    def sbatch_launcher(self, launch: "Launch", node_rank_comment: str) -> tuple[list[str], str]:
        return [node_rank_comment], (f'torchrun --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" '
                                     f'--nproc_per_node {launch.request.gpus} '
                                     '--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"')

    def multi_node_note(self) -> str:
        return "run `NODE_RANK=<0..N-1> MASTER_ADDR=<node 0> ./launch.sh` on every node."

    def verify_command(self, request: Any, target: list[str], port: int, *, python: str, program: str,
                       hostfile: str | None, device: str, visible: list[str]) -> list[str]:
        """torchrun starts the ranks of one node. On CPU ranks, a multi-node torch job (HSDP) is
        run on this host with every node's ranks (gpus x nodes processes, a 2-D device mesh); on
        GPUs, run the emitted torchrun command on each node instead (planner plan --emit)."""
        if request.nodes > 1 and device != "cpu":
            raise PlannerError(f"nodes={request.nodes}: a multi-node {request.strategy} run is started on each node "
                               "by torchrun; use the sbatch script from `planner plan --emit`", field="nodes")
        return [python, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc_per_node", str(request.gpus * request.nodes), "--master_port", str(port), *target]

    def device_ids(self, request: Any, visible: list[str]) -> list[str]:
        """torchrun keeps the environment: rank r uses cuda:r, the r-th visible device."""
        return visible_device_ids(request, visible)


LAUNCHER = TorchrunLauncher()


def _torchtitan_reduce_note(setup: "SetupFields", peak_with: Callable[[dict[str, Any]], int]) -> str | None:
    """torchtitan reduces FSDP2's gradients in fp32 only (mixed_precision_reduce = "float32": 0.2.2
    job_config.py, 0.3 config/configs.py:93); an estimate made with the compute dtype (accelerate's
    and verify's) is not that job's. The torchtitan job's own peak, estimated with reduce_dtype fp32."""
    req = setup.request
    if req.reduce_dtype == "fp32" or not setup.strategy.shards_parameters:
        return None
    return (f"torchtitan reduces gradients in fp32 (`mixed_precision_reduce = \"float32\"`, its only value), "
            f"while this estimate reduces in the compute dtype: the torchtitan job's peak is "
            f"{peak_with({'reduce_dtype': 'fp32'}) / GIB:.2f} GiB per device (this estimate: "
            f"{peak_with({}) / GIB:.2f} GiB); `--reduce-dtype fp32` estimates it.")


def _torchtitan_config(setup: "SetupFields") -> dict[str, dict[str, Any]]:
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
