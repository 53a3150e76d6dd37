"""What a framework launches: the interface of its launcher (``Launcher``), which each framework
package implements in its own launch module (planner/frameworks/deepspeed/launch.py, planner/
frameworks/torch/launch.py) and a Framework names as ``Framework.launch``.

Two callers ask it: the launch files ``--emit`` writes (planner/plan/emit/: the shell lines of
launch.sh and job.sbatch, the framework's own config files, its sections of accelerate's and the
Trainer's files and of LAUNCH.md) and the verification backend (backend/launch.py: the command
that starts the ranks of ``planner verify``, the GPUs it runs on). Each method answers for one
configuration, given as the emitted ``Launch`` (below; planner/plan/emit/ builds it) or as plain values;
the launcher reads no file and no environment: the backend passes what it found.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from planner.errors import PlannerError
from planner.recipes.precision import Recipe
from planner.schema import EstimateRequest

if TYPE_CHECKING:
    from planner.setup_fields import SetupFields


class Launcher:
    """The launcher of one framework; subclasses answer every question below."""

    program: str = ""  # the program that starts the ranks
    module_flag: str = ""  # how it runs a Python module on every rank
    accelerate_type: str = ""  # accelerate's distributed_type for the framework's data parallelism
    # accelerate applies tensor/context parallelism itself, through FSDP2's ParallelismConfig and the
    # model's tp_plan (False: the framework's config carries the degree, DeepSpeed's AutoTP)
    accelerate_applies_tp: bool = False
    cpu_ops: tuple[str, ...] = ()  # JIT ops every CPU rank builds, built once before the ranks start

    # --- the files --emit writes ---------------------------------------------------------

    def config_files(self, setup: "SetupFields", launch: "Launch", users_config: dict[str, Any] | None) -> dict[str, str]:
        """The framework's own config files for this configuration (name -> text)."""
        return {}

    def layout_files(self, setup: "SetupFields") -> dict[str, str]:
        """Config files of another trainer that applies the same layout (torchtitan's)."""
        return {}

    def layout_guide(self, launch: "Launch", setup: "SetupFields", names: list[str],
                     peak_with: Callable[[dict[str, Any]], int]) -> list[str]:
        """LAUNCH.md's section for the layout_files among ``names``. ``peak_with``: the predicted
        peak bytes of this request with some fields changed ({}: this estimate's own)."""
        return []

    def node_files(self, launch: "Launch") -> dict[str, str]:
        """Files a multi-node launch of it needs beside the scripts (a hostfile)."""
        return {}

    def environment(self, launch: "Launch") -> tuple[str, list[str]]:
        """(What the scripts' header adds to the list of emitted files, the lines exporting them)."""
        return "", []

    def target_arguments(self, here: str) -> str:
        """Arguments the planner's trainer gets on every rank beside the plan."""
        return ""

    def exit_cleanup(self, launch: "Launch") -> str:
        """launch.sh lines that clean up after the ranks when the script exits ("" for none)."""
        return ""

    def node_command(self, launch: "Launch", target: str) -> tuple[list[str], list[str], str]:
        """launch.sh: (header comment lines, body lines, the command) starting this node's ranks."""
        raise NotImplementedError

    def sbatch_launcher(self, launch: "Launch", node_rank_comment: str) -> tuple[list[str], str]:
        """job.sbatch: (the lines before srun, the launcher command every task runs)."""
        raise NotImplementedError

    def sbatch_cleanup(self, launch: "Launch") -> tuple[str, str] | None:
        """(A comment line, what each Slurm task runs after its ranks end) or None: the launcher is exec'd."""
        return None

    def accelerate_section(self, launch: "Launch") -> tuple[str, dict[str, Any]] | None:
        """accelerate's config block for the framework (key, block), which then carries precision
        and sharding itself; None when accelerate's own mixed_precision and FSDP plugin do."""
        return None

    def trainer_arguments(self, launch: "Launch") -> dict[str, Any]:
        """TrainingArguments naming the framework's config (empty when the FSDP/DDP flags do)."""
        return {}

    def script_note(self) -> list[str]:
        """LAUNCH.md: where the user's own script finds the framework's config."""
        return []

    def multi_node_note(self) -> str:
        """LAUNCH.md: how to start several nodes without Slurm."""
        raise NotImplementedError

    def pipeline_guide(self, launch: "Launch", script: str) -> list[str] | None:
        """LAUNCH.md's section for a pipeline the framework's own engine runs (None: the
        planner's trainer and the accelerate/torchtitan sections cover it)."""
        return None

    # --- the verification backend -----------------------------------------------------------

    def verify_command(self, request: Any, target: list[str], port: int, *, python: str, program: str,
                       hostfile: str | None, device: str, visible: list[str]) -> list[str]:
        """The command starting every rank of a ``planner verify`` run on this host. ``target``:
        the worker and its arguments; ``program``: where the backend found this launcher;
        ``visible``: CUDA_VISIBLE_DEVICES's ids."""
        raise NotImplementedError

    def device_ids(self, request: Any, visible: list[str]) -> list[str]:
        """The GPUs this host's ranks run on, as CUDA_VISIBLE_DEVICES names them (physical indices
        when it is unset): what the device locks hold and what verify_command names."""
        raise NotImplementedError


def visible_device_ids(request: Any, visible: list[str]) -> list[str]:
    """The first ``request.gpus`` of the visible devices, or indices 0..gpus-1 when none are set."""
    if not visible:
        return [str(i) for i in range(request.gpus)]
    if len(visible) < request.gpus:
        raise PlannerError(f"CUDA_VISIBLE_DEVICES={','.join(visible)} makes {len(visible)} GPU(s) visible; "
                           f"gpus={request.gpus} needs {request.gpus}: list more devices or lower --gpus", field="gpus")
    return visible[:request.gpus]


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
class Launch:
    """One configuration to launch, resolved once."""

    request: EstimateRequest
    launcher: Launcher  # what starts the ranks: the framework's (Framework.launch)
    strategy: str  # the name, shown only; the files follow the degrees below
    fsdp: bool  # torch sharding its parameters (FSDP2), not DDP
    reshard_after_forward: bool  # False for SHARD_GRAD_OP: units stay gathered from forward to backward
    zero_stage: int | None
    recipe: Recipe  # the precision, decoded once (Setup.recipe)
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
        if self.launcher.accelerate_applies_tp and tp * cp > 1 and not self.fsdp:
            return ("accelerate applies tensor/context parallelism with FSDP2 only (its ParallelismConfig needs "
                    "fsdp_version 2); DDP with TP is not one of its layouts")
        if self.request.tp_plan == "transformers" and tp > 1 and self.data_parallel > 1:
            # backend/hf_tensor_parallel.py _distribution (measured on 4 CPU ranks)
            return ("under transformers 5.25 accelerate's FSDP2 cannot wrap a model loaded with "
                    "from_pretrained(tp_plan=\"auto\", device_mesh=...): the mesh is dropped and the plan spans every "
                    "rank, and FSDP2 raises 'Cannot concatenate overlapping meshes'; transformers composes TP and FSDP2 "
                    "itself (load_model.py)")
        if self.fsdp and tp * cp > 1 and self.degree("dp_shard") == 1 and cp == 1:
            return ("accelerate refuses FSDP2 without a dp_shard group or cp > 1 "
                    "(ParallelismConfig._validate_accelerator); this layout has dp_shard 1")
        return None
