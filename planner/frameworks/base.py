"""The interface every framework module implements (``Framework``), what they share (``Buckets``,
``Traffic``, the offload rule), and the registry that chooses one by name and version. The
package (planner/frameworks/__init__.py) imports each framework module, which registers itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.frameworks.deepspeed.config import (DEFAULT_ALLGATHER_BUCKET, DEFAULT_MAX_REUSE_DISTANCE, DEFAULT_PERSISTENCE_THRESHOLD,
                                                 DEFAULT_PREFETCH_BUCKET, DEFAULT_REDUCE_BUCKET)
from planner.errors import PlannerError
from planner.memory.optimizer import flat, spec_of, state_bits
from planner.frameworks.launcher import Launcher

if TYPE_CHECKING:
    import numpy as np

    from planner.model.activations import Activations
    from planner.memory.phase_plan import PhasePlan
    from planner.setup_fields import SetupFields
    from planner.model.shapes import TensorShape
    from planner.recipes.optimizers import OptimizerSpec
    from planner.recipes.precision import Recipe
    from planner.strategies import Strategy

# (what, bytes per optimizer step, ring passes, message bytes, group: world | shard | replicas, the
# share of those bytes sent during the forward pass: a gradient collective's is 0, it has nothing to
# send before backward; the rest is sent in backward or, ZeRO-1/2's gather, after the step)
Collective = tuple[str, "np.ndarray", int, float, str, float]


@dataclass(frozen=True)
class Buckets:
    """DeepSpeed's message sizes in elements, defaulting to DeepSpeed's own (defined once, in
    planner/frameworks/deepspeed/config.py beside the config reader); the torch frameworks send per unit and ignore them."""

    reduce: int = DEFAULT_REDUCE_BUCKET
    allgather: int = DEFAULT_ALLGATHER_BUCKET
    prefetch: int = DEFAULT_PREFETCH_BUCKET
    # stage3_param_persistence_threshold: a ZeRO-3 parameter of at most this many elements is kept
    # whole on every rank and never gathered
    persistence: int = DEFAULT_PERSISTENCE_THRESHOLD
    # stage3_max_reuse_distance: a parameter used again within this many elements is not released
    # after its forward, so a model within it is gathered once per step, not twice
    reuse: int = DEFAULT_MAX_REUSE_DISTANCE
    # contiguous_gradients: ZeRO-1/2 copy each gradient into the reduce bucket as its hook fires
    contiguous: bool = True


@dataclass(frozen=True)
class Traffic:
    """What the collectives of one step depend on: the model's elements, the bytes per element on
    the wire, one transformer block's elements (the FSDP / ZeRO-3 unit), and per micro-batch option
    the steps (ones) and micro-steps per optimizer step."""

    psi: int
    wire_bytes: int
    block: int
    step: "np.ndarray"
    accumulation: "np.ndarray"
    recipe: "Recipe"  # the precision, decoded once (planner/recipes/precision.py)
    shard: int  # HSDP's shard group size (the world for the others)
    buckets: Buckets = Buckets()
    trainable: int | None = None  # elements that make gradients (LoRA: the adapters); None: psi
    reduce_bytes: int | None = None  # bytes per gradient element reduced (FSDP2's reduce dtype); None: wire_bytes
    # a data-parallel wrapper runs (steptime.Combo.data_parallel_wrapped): not on a TP-only layout
    wrapped: bool = True
    # each parameter's elements, of the model psi counts (empty when unknown, or when psi is a
    # tensor-parallel rank's share): what a framework that treats small parameters apart reads
    numels: tuple[int, ...] = ()
    # float8_all_gather: (the model's, one block's) weight elements FSDP2 gathers in fp8, 1 byte each
    # (planner/recipes/low_precision.py fp8_gather_bytes)
    fp8_gathered: tuple[int, int] = (0, 0)
    fsdp_version: int = 2  # torch FSDP: 2 (fully_shard) or 1 (FullyShardedDataParallel: its copies off the compute stream)
    pipelined: bool = False  # pp > 1: FSDP2 keeps each unit gathered across the schedule's micro-batches
    deferred_sync: bool = False  # the loop's no_sync on all but the last micro-batch: FSDP reduces once per step

    @property
    def trained(self) -> int:
        """Elements whose gradients are reduced and whose updates are gathered: a frozen
        parameter has neither (DDP's buckets and ZeRO's partitions hold trainable ones only)."""
        return self.psi if self.trainable is None else self.trainable


class Framework:
    """One framework version. Subclasses answer every question below for their strategies."""

    name: str = ""  # what Strategy.framework names: "deepspeed" | "torch"
    # The allocator's view of the model states (planner/memory/reserved.py): one tensor per parameter, or
    # DeepSpeed's flat partitions (stage_1_and_2.py / stage3.py flatten each group into one buffer)
    state_tensors_per_parameter: bool = False
    version: str = ""  # the version whose source the module was read from
    launch: Launcher = Launcher()  # what starts its ranks and the config files a launch of it reads
    # fp32 copies of a tensor the CUDA optimizer step allocates (FusedAdam: 0; torch foreach: 1)
    cuda_adam_copies: int = 0
    # its sharded parameters are DTensors the optimizer steps (FSDP2), not flat partitions of its own
    shards_as_dtensors: bool = False
    # the optimizers the verification backend's rank builds for this framework (backend/train.py)
    probe_optimizers: tuple[str, ...] = ("adamw", "sgd", "sgd-momentum")
    # CPU offload of the parameters also moves their gradients to the host
    offloads_gradients_with_params: bool = False
    # The module's own weights are the master copy (fp32 under a mixed recipe, cast for compute by
    # torch.autocast or FSDP2's MixedPrecisionPolicy) and their gradients are in the weights' dtype;
    # False: the module is cast to 16 bits and the fp32 master lives in the optimizer (DeepSpeed)
    weights_are_master: bool = False
    # Tensor parallelism by DeepSpeed's AutoTP: the linears split as the model's HF tp_plan says,
    # the logits gathered whole, no Megatron-style sequence parallelism (False: torch's DTensor
    # plans, torchtitan's SequenceParallel and loss_parallel)
    autotp: bool = False
    # Pipeline stages run by the framework's own engine (DeepSpeed's PipelineEngine over a
    # PipelineModule the script builds); False: torch.distributed.pipelining with DDP/FSDP2 per stage
    own_pipeline_engine: bool = False
    # the low_precision recipes (planner/recipes/low_precision.py) whose library applies to this framework's
    # model: Transformer Engine's modules run under any of them (accelerate's fp8 with TE backend)
    low_precision: frozenset[str] = frozenset({"none", "te-fp8"})
    # its tensor parallelism shards the residual stream over the sequence between blocks
    tp_sequence_parallel: bool = False
    # its wrapper has the no_sync a training loop skips the gradient sync with between micro-batches
    # (defer_gradient_sync: torch DDP's no_sync, FSDP's no_sync and set_requires_gradient_sync); DeepSpeed's
    # engine accumulates itself, and the HF Trainer keeps every micro-batch's sync under it
    loop_no_sync: bool = False
    # a training loop's own precision context (composer's torch.autocast for amp_bf16 / amp_fp16) wraps the code it
    # runs beside the engine's forward (the train metrics: planner/recipes/loop.py); under DeepSpeed composer enters
    # none (trainer.py _get_precision_context: a null context when DeepSpeed is enabled)
    loop_autocasts: bool = True

    def phases(self, setup: "SetupFields", acts: "Activations | None", numels: list[int]) -> "PhasePlan":
        raise NotImplementedError

    def optimizer_tensors(self, setup: "SetupFields", counts: list[int], shard: int) -> tuple[list["TensorShape"], int]:
        """The tensors the optimizer steps on one rank whose parameters are ``counts``, their states
        split over ``shard`` ranks, and the bits of each element: DeepSpeed's flat fp32 partition
        (stage_1_and_2.py / stage3.py flatten each group) unless a framework says otherwise."""
        return flat(-(-sum(counts) // max(shard, 1))), 32

    def optimizer_state_bits(self, setup: "SetupFields", counts: list[int], shard: int = 1) -> float:
        """Bits per stepped element of the optimizer's states (beyond a master copy), from the
        registry (planner/recipes/optimizers.py) over ``optimizer_tensors``."""
        tensors, bits = self.optimizer_tensors(setup, counts, shard)
        return state_bits(spec_of(setup), tensors, bits)

    def check_optimizer(self, setup: "SetupFields", spec: "OptimizerSpec") -> None:
        """Refuse an optimizer (or its step in backward) the framework does not run, naming why."""

    def collectives(self, s: "Strategy", t: Traffic) -> list[Collective]:
        """What one optimizer step sends, per collective (before the ring's factor)."""
        raise NotImplementedError

    def compute_stream_copies(self, s: "Strategy", t: Traffic, gradient_bytes: int) -> tuple[object, object, object]:
        """(in the forward, in the backward, after the backward's collectives) bytes per step the
        framework's own copies read and write on the compute stream around its collectives (the step
        waits for them; a copy on a side stream overlaps the compute and is not counted; what runs after
        the collectives hides none of them). ``gradient_bytes``: bytes per element of the gradients the
        model's weights receive. None by default."""
        return 0.0, 0.0, 0.0

    def overlap_windows(self, s: "Strategy", forward_seconds: float, backward_seconds: float) -> tuple[float, float]:
        """(forward, backward): how much of each pass's compute the collectives sent in that pass
        can hide behind (``forward_seconds``, ``backward_seconds``: the passes' compute, the
        recomputation inside backward; planner/time/kernels.py)."""
        raise NotImplementedError

    def offload_options(self, s: "Strategy") -> list[tuple[str, str]]:
        """The (offload_optimizer, offload_params) settings the plan search tries."""
        raise NotImplementedError

    def check_offload(self, s: "Strategy", offload_optimizer: str, offload_params: str) -> None:
        """Refuse offload combinations the framework does not implement, naming both settings."""
        raise NotImplementedError

    def fsdp_sharding(self, s: "Strategy") -> str | None:
        """The FSDP variant the strategy runs (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD), None when
        it is no FSDP."""
        return None

    def check_precision(self, s: "Strategy", recipe: "Recipe") -> None:
        """Refuse a precision recipe the framework does not implement."""

    def check_context_parallel(self, s: "Strategy", cp: int) -> None:
        """Refuse context parallelism (cp > 1) where the framework has none for strategy ``s``."""

    def check_pipeline(self, setup: "SetupFields", schedule: str) -> None:
        """Refuse a pipeline layout (pp > 1) the framework's pipeline does not run."""

    def host_hooks(self, s: "Strategy") -> str | None:
        """The measurement of the framework's own Python on every micro-batch, beside the model's kernels
        (planner/data/host_hooks.json: zero1, zero2, zero3 or fsdp2, each per module, parameter or unit;
        planner/time/host_hooks.py); None where its hooks are C++ or absent."""
        return None

    def linears_save_inputs(self, s: "Strategy") -> bool:
        """The framework's own autograd function around every linear saves its input (DeepSpeed
        ZeRO-3's LinearFunctionForZeroStage3), beside what the model saves."""
        return False

    def gradient_bucket_copy(self, s: "Strategy") -> bool:
        """A data-parallel wrapper keeps a second copy of every gradient in its buckets (torch DDP's
        Reducer with gradient_as_bucket_view=False)."""
        return False
    def check_tp_plan(self, s: "Strategy", tp_plan: str, tp: int, dp: int) -> None:
        """Refuse a tensor-parallel layout (the request's tp_plan) the framework does not train over
        ``dp`` data-parallel ranks. By default only torchtitan's (the framework's own TP)."""
        if tp_plan != "torchtitan":
            raise PlannerError(f"tp_plan={tp_plan} with strategy {s.name}: its framework shards by its own tensor-"
                               "parallel layout (tp_plan torchtitan); from_pretrained(tp_plan=\"auto\") is trained by "
                               "torch (fsdp, or no data parallelism)", field="tp_plan")
    def takes_layout(self, s: "Strategy", tp: int, cp: int, pp: int, schedule: str) -> bool:
        """Whether the strategy realises the data-parallel part of a (tp, cp, pp) layout, pp with
        this pipeline schedule (what the plan searches)."""
        raise NotImplementedError

    def worker_settings(self, setup: "SetupFields", request: Any) -> dict[str, Any]:
        """What the verification backend's rank needs to build this framework's engine."""
        raise NotImplementedError


def check_sharded_offload(s: "Strategy", offload_optimizer: str, offload_params: str, params_ok: bool) -> None:
    """The rules every framework shares: optimizer offload needs a sharded optimizer; parameter
    offload needs a strategy that offloads them."""
    if offload_optimizer != "none" and not s.shards_optimizer:
        raise PlannerError(
            f"offload_optimizer={offload_optimizer} needs a sharded optimizer (zero1-3 or an FSDP variant); "
            f"strategy {s.name} keeps the optimizer on the device", field="offload_optimizer")
    if offload_params != "none" and not params_ok:
        raise PlannerError(
            f"offload_params={offload_params} needs zero3 (ZeRO-Infinity) or fsdp/hsdp (CPU offload); "
            f"strategy {s.name} does not offload parameters", field="offload_params")


_REGISTRY: dict[tuple[str, str], Framework] = {}
_DEFAULT: dict[str, str] = {}


def register(framework: Framework, default: bool = True) -> Framework:
    _REGISTRY[(framework.name, framework.version)] = framework
    if default or framework.name not in _DEFAULT:
        _DEFAULT[framework.name] = framework.version
    return framework


def framework(name: str, version: str | None = None) -> Framework:
    """The registered framework of this name: its default version, or the one ``version`` names,
    exactly or as a prefix at a dot ("0.19" chooses 0.19.8). An unknown version is refused with the
    modelled ones."""
    if version is None:
        version = _DEFAULT.get(name, "")
        if (name, version) not in _REGISTRY:
            known = ", ".join(f"{n} {v}" for n, v in sorted(_REGISTRY))
            raise PlannerError(f"framework {name}: not modelled; known: {known}", field="strategy")
        return _REGISTRY[(name, version)]
    versions = sorted(v for n, v in _REGISTRY if n == name)
    chosen = [v for v in versions if _matches(version, v)]
    if len(chosen) != 1:
        raise PlannerError(f"{name} {version} is not modelled; choose from "
                           f"{', '.join(versions)}", field="framework_version", value=version)
    return _REGISTRY[(name, chosen[0])]


def _matches(version: str, modelled: str) -> bool:
    return modelled == version or modelled.startswith(version + ".")


def check_version(version: str | None) -> None:
    """A plan's ``framework_version`` names a modelled version of some framework (exactly or as a
    prefix at a dot); refused with every modelled one otherwise."""
    if version is not None and not any(_matches(version, v) for _, v in _REGISTRY):
        known = ", ".join(f"{n} {v}" for n, v in sorted(_REGISTRY))
        raise PlannerError(f"framework_version {version} is not modelled; choose from {known}",
                           field="framework_version", value=version)


def version_for(s: "Strategy", version: str | None) -> str | None:
    """The version a plan's candidate of strategy ``s`` is estimated at: the plan's
    ``framework_version`` when it is one of ``s``'s framework's, else None (its default): a plan
    asked for DeepSpeed 0.19 estimates its torch candidates at torch's newest."""
    if version is None or not any(n == s.framework and _matches(version, v) for n, v in _REGISTRY):
        return None
    return version


def version_field(s: "Strategy", version: str | None) -> dict[str, str]:
    """``version_for`` as the estimate request's field: none when it is the default, so that the
    request stays the one it always was."""
    chosen = version_for(s, version)
    return {"framework_version": chosen} if chosen is not None else {}


def framework_of(s: "Strategy", version: str | None = None) -> Framework:
    """The framework version that realises strategy ``s``: the request's ``framework_version``, or
    the default one of its framework."""
    return framework(s.framework, version)
