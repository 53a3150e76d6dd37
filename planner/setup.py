"""A request resolved into typed mechanisms (planner/memory/orchestrator.py ``resolve``): the one input every
memory term, phase plan, time term and launch file reads.

It lives apart from the orchestrator so that the mechanisms (planner/memory/buffers.py, the frameworks,
pipeline, tensor and context parallelism, experts) can take it without importing the module that
composes them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from planner.model.architecture import Architecture, parameter_numels
from planner.model.catalogue import ResolvedModel
from planner.frameworks.deepspeed.config import ZeroSettings
from planner.recipes.finetune import Finetune, trainable_numels
from planner.frameworks import Framework, framework_of
from planner.cluster.gpus import Gpu
from planner.parallel.dims import ParallelDims
from planner.recipes.precision import Recipe
from planner.schema import EstimateRequest
from planner.strategies import Strategy
from planner.parallel.tensor import rank_numels


@dataclass(frozen=True)
class Setup:
    """A request resolved into typed mechanisms: the input of every term below."""

    request: EstimateRequest
    model: ResolvedModel
    strategy: Strategy
    recipe: Recipe
    gpu: Gpu
    zero: ZeroSettings
    world_size: int
    shard_size: int
    dims: ParallelDims
    # tensor parallelism: the narrower model one TP rank holds and runs (planner/parallel/tensor.py)
    sequence_parallel: bool = False
    vocab_parallel_loss: bool = False
    embedding_split: int = 1  # DeepSpeed AutoTP, tied or no tp_plan: the embedding split along the hidden dimension
    lm_head_split: int = 1  # DeepSpeed AutoTP (HF tp_plan): the untied LM head's rows split, its output gathered
    embedding_rows: bool = False  # transformers' tp_plan: embedding_split is over the vocabulary rows
    rank_architecture: Architecture | None = None
    loss_chunks: int = 1  # the loss's backward in this many chunks (planner/recipes/losses.py)

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def cp(self) -> int:
        """Context parallelism: this rank holds seq_len / cp tokens of each sequence."""
        return self.dims.cp
    finetune: Finetune | None = None  # LoRA / QLoRA (planner/recipes/finetune.py); None: full fine-tuning

    @property
    def arch(self) -> Architecture | None:
        """The architecture one device holds and runs: the TP rank's shard of it under tp > 1."""
        return self.rank_architecture if self.rank_architecture is not None else self.model.architecture

    @property
    def psi(self) -> int:
        return self.model.parameters

    @property
    def rank_psi(self) -> int:
        """Parameters on one device before data-parallel sharding (the TP rank's shards)."""
        return sum(numels(self)) if self.rank_architecture is not None else self.psi

    @property
    def data_parallel_wrapped(self) -> bool:
        """False for a TP-only layout (one data-parallel rank): nothing wraps the model, as
        torchtitan applies FSDP only when dp_shard > 1 or cp > 1 (parallelize.py)."""
        if self.strategy.one_device:
            return False
        return self.rank_architecture is None or self.dims.dp * self.dims.cp > 1

    @property
    def weight_bytes(self) -> int:
        return self.recipe.weight_bits // 8

    @property
    def framework(self) -> Framework:
        """The framework version that realises the strategy (planner/frameworks/)."""
        return framework_of(self.strategy, self.request.framework_version)

    @property
    def device(self) -> str:
        return "cpu" if self.gpu.is_cpu else "cuda"


def with_fields(setup: Setup, **changes) -> Setup:
    """dataclasses.replace(setup, **changes) without running the generated __init__ again: every
    field of a Setup is an init field, none is computed after (no __post_init__), and an instance
    holds its fields in its __dict__, so a new instance holding the same fields with ``changes`` is
    the replaced one (a test compares the two). The plan search gives a setting's Setup each
    option's request, thousands of times a plan, where replace's frozen __init__ cost more than
    the rest of the copy."""
    unknown = changes.keys() - _SETUP_FIELDS
    if unknown:
        raise TypeError(f"Setup has no field(s) {sorted(unknown)}")
    held = setup.__dict__
    new = object.__new__(type(setup))
    new.__dict__.update({name: held[name] for name in _SETUP_FIELDS})
    new.__dict__.update(changes)
    return new


_SETUP_FIELDS = tuple(f.name for f in fields(Setup))


def numels(setup: Setup) -> list[int]:
    if setup.finetune is not None:
        return trainable_numels(setup.arch, setup.finetune)  # the frozen base: with_frozen
    if setup.model.traced is not None:
        return list(setup.model.traced.numels)
    if setup.rank_architecture is not None:
        return rank_numels(setup.rank_architecture, setup.embedding_split, setup.lm_head_split, setup.embedding_rows)
    if setup.arch is not None:
        return parameter_numels(setup.arch)
    return [setup.psi]  # only a count: one flat tensor is the best that can be said
