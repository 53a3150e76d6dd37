"""What the mechanisms Setup is composed of read of it: ``SetupFields``, the type their methods take.

planner/setup.py's ``Setup`` imports the frameworks (to answer ``framework``), tensor parallelism and
fine-tuning; the frameworks' phases and launch files, and planner/memory/{buffers,optimizer}.py that they
build on, take a Setup in turn. Naming ``Setup`` there, even only for type checking, is an import cycle;
they name this Protocol instead, which imports only the value types below all of them. ``Setup`` is the
one implementation (tests/test_imports.py holds its members and this Protocol's equal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from planner.cluster.gpus import Gpu
    from planner.frameworks.deepspeed.config import ZeroSettings
    from planner.model.architecture import Architecture
    from planner.model.catalogue import ResolvedModel
    from planner.parallel.dims import ParallelDims
    from planner.recipes.finetune_fields import Finetune
    from planner.recipes.precision import Recipe
    from planner.schema import EstimateRequest
    from planner.strategies import Strategy


class SetupFields(Protocol):
    """A request resolved into typed mechanisms (planner.setup.Setup), as the frameworks and the
    memory terms they build on read it."""

    request: EstimateRequest
    model: ResolvedModel
    strategy: Strategy
    recipe: Recipe
    gpu: Gpu
    zero: ZeroSettings
    shard_size: int  # the data-parallel group ZeRO/FSDP shard over
    dims: ParallelDims
    tp: int
    lm_head_split: int  # DeepSpeed AutoTP: the untied LM head's rows split, its output gathered
    finetune: Finetune | None  # LoRA / QLoRA; None: full fine-tuning
    arch: Architecture | None  # what one device holds and runs: the TP rank's shard under tp > 1
    data_parallel_wrapped: bool  # False for a TP-only layout: nothing wraps the model
    weight_bytes: int
    device: str  # "cpu" | "cuda"
    # The Framework (planner/frameworks/base.py) that realises the strategy. Typed loosely: base.py's
    # methods take SetupFields, and base.py imports planner/memory/optimizer.py, which takes it too.
    framework: Any
