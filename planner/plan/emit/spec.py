"""One configuration to launch, as every emitted format reads it (``Launch``), and the user's
script run in place of the planner's trainer (``Script``)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from planner.errors import PlannerError
from planner.frameworks.launcher import Launcher
from planner.recipes.precision import Recipe
from planner.schema import EstimateRequest

TRAINER_MODULE = "backend.worker"  # the planner's own trainer, `python -m backend.worker --plan plan.json`
DEFAULT_PORT = 29500  # torchrun's and DeepSpeed's default master port


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
        if self.fsdp and tp * cp > 1 and self.degree("dp_shard") == 1 and cp == 1:
            return ("accelerate refuses FSDP2 without a dp_shard group or cp > 1 "
                    "(ParallelismConfig._validate_accelerator); this layout has dp_shard 1")
        return None


def layout_words(launch: Launch) -> str:
    """The layout's degrees as the plan chose them: "dp_replicate 1 x dp_shard 8 x tp 4"."""
    degrees = " x ".join(f"{name} {launch.degree(name)}" for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
                         if name.startswith("dp") or launch.degree(name) > 1)
    if launch.fsdp and launch.replicas > 1:
        degrees += (f"; HSDP: shard groups of {launch.degree('dp_shard')} data-parallel ranks, replicated "
                    f"{launch.replicas} times")
    return degrees
