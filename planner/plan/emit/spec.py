"""What every emitted format reads of one configuration to launch: the ``Launch`` and the user's
``Script`` (defined beside the framework's Launcher, planner/frameworks/launcher.py, which takes
them: no cycle even among type-only imports), the trainer's module, the default port and the
layout in words."""

from __future__ import annotations

from planner.frameworks.launcher import Launch, Script

__all__ = ["DEFAULT_PORT", "TRAINER_MODULE", "Launch", "Script", "layout_words"]

TRAINER_MODULE = "backend.worker"  # the planner's own trainer, `python -m backend.worker --plan plan.json`
DEFAULT_PORT = 29500  # torchrun's and DeepSpeed's default master port


def layout_words(launch: Launch) -> str:
    """The layout's degrees as the plan chose them: "dp_replicate 1 x dp_shard 8 x tp 4"."""
    degrees = " x ".join(f"{name} {launch.degree(name)}" for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
                         if name.startswith("dp") or launch.degree(name) > 1)
    if launch.fsdp and launch.replicas > 1:
        degrees += (f"; HSDP: shard groups of {launch.degree('dp_shard')} data-parallel ranks, replicated "
                    f"{launch.replicas} times")
    return degrees
