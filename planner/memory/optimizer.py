"""One rank's optimizer, from the registry (planner/recipes/optimizers.py): the tensors it steps
(whole, FSDP2's dim-0 shards, or DeepSpeed's flat partitions), their states and the step's
temporaries, and the compositions the model refuses (strategy, offload, step-in-backward)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from planner.errors import PlannerError
from planner.model.shapes import TensorShape, matching, parameter_shapes, vectors
from planner.recipes.optimizers import OPTIMIZERS, OptimizerSpec

if TYPE_CHECKING:
    from collections.abc import Sequence

    from planner.setup_fields import SetupFields


def spec_of(setup: "SetupFields") -> OptimizerSpec:
    return OPTIMIZERS[setup.request.optimizer]


def rank_tensors(setup: "SetupFields", counts: list[int]) -> "Sequence[TensorShape]":
    """The parameters this rank trains (``counts``: planner.setup.numels), with their shapes where
    the architecture gives them (a LoRA adapter or a traced model's tensors as vectors:
    planner/model/shapes.py says why that is the conservative reading)."""
    if setup.finetune is None and setup.model.traced is None and setup.arch is not None:
        return matching(parameter_shapes(setup.arch), counts)
    return vectors(counts)


def dim0_shards(tensors: "Sequence[TensorShape]", shard: int) -> "Sequence[TensorShape]":
    """FSDP2's shards (fully_shard: Shard(0), the first dimension split, rounded up)."""
    if shard <= 1:
        return tensors
    if not isinstance(tensors, tuple):
        return [_shard(t, shard) for t in tensors]
    return _seen(("shards", shard), tensors, lambda: _distinct_shards(tensors, shard))


def _shard(t: TensorShape, shard: int) -> TensorShape:
    return TensorShape((-(-t.dims[0] // shard),) + t.dims[1:], t.io)


def _distinct_shards(tensors: tuple[TensorShape, ...], shard: int) -> tuple[TensorShape, ...]:
    """dim0_shards of a model's tensors, each shape object sharded once: an architecture's blocks
    of one kind share their shapes' objects (planner/model/shapes.py _shapes: a few shapes, a
    thousand tensors), so their shards are shared too and each numel is computed once."""
    one: dict[int, TensorShape] = {}  # by the shape object's identity (a dataclass hash costs more)
    for t in tensors:
        if id(t) not in one:
            one[id(t)] = _shard(t, shard)
    return tuple(one[id(t)] for t in tensors)


# What was computed for a tuple of tensors, by the tuple's identity: an Architecture's shapes are one
# tuple (planner/model/shapes.py memoizes it), and the plan's search asks about it per candidate.
_SEEN: dict[tuple, tuple] = {}


def _seen(what: tuple, tensors: tuple[TensorShape, ...], compute):
    key = what + (id(tensors),)
    hit = _SEEN.get(key)
    if hit is not None and hit[0] is tensors:
        return hit[1]
    if len(_SEEN) > 4096:
        _SEEN.clear()
    value = compute()
    _SEEN[key] = (tensors, value)
    return value


def flat(elements: int) -> list[TensorShape]:
    """DeepSpeed's flat fp32 partition: one 1-D tensor, whatever the parameters' shapes were."""
    return [TensorShape((max(elements, 1),))]


def states_bytes(spec: OptimizerSpec, tensors: list[TensorShape], bits: int) -> int:
    """The states of ``tensors``, each distinct shape computed once (a model's blocks repeat theirs)."""
    if len(tensors) == 1:  # DeepSpeed's flat partition, a pipeline stage's
        return spec.group_of(tensors[0]).states(tensors[0], bits)
    if not isinstance(tensors, tuple):
        return sum(count * spec.group_of(t).states(t, bits) for t, count in Counter(tensors).items())
    return _seen(("states", spec.name, bits), tensors,
                 lambda: sum(count * spec.group_of(t).states(t, bits) for t, count in _multiplicities(tensors)))


def _multiplicities(tensors: tuple[TensorShape, ...]) -> list[tuple[TensorShape, int]]:
    """Each shape object of ``tensors`` with how often it occurs, counted by identity: an
    architecture's blocks share their shapes' objects (planner/model/shapes.py _shapes), so this is
    a few entries for thousands of tensors, without hashing a dataclass per tensor. Equal shapes
    held by different objects stay separate entries; the states are whole bytes per shape, so the
    sum is the same as counting equal shapes together (Counter)."""
    counts: dict[int, int] = {}
    objects: dict[int, TensorShape] = {}
    for t in tensors:
        key = id(t)
        if key in counts:
            counts[key] += 1
        else:
            counts[key] = 1
            objects[key] = t
    return [(objects[key], count) for key, count in counts.items()]


def state_bits(spec: OptimizerSpec, tensors: list[TensorShape], bits: int) -> float:
    """Bits of state per stepped element, averaged over ``tensors``: what the element counts of the
    model-state terms multiply."""
    total = _seen(("numel",), tensors, lambda: sum(t.numel for t in tensors)) if isinstance(tensors, tuple) \
        else sum(t.numel for t in tensors)
    return 8 * states_bytes(spec, tensors, bits) / total if total else 0.0


def _temporaries(setup: "SetupFields", tensors: list[TensorShape], bits: int, shard: int = 1) -> int:
    """The most bytes the step's temporaries hold at once. Each group (Muon's matrices, its AdamW
    rest) steps after the other, so the groups' temporaries do not overlap. ``shard`` > 1: ``tensors``
    are FSDP2's Shard(0) DTensor shards over that many ranks (an optimizer whose step is not
    elementwise redistributes them: OptimizerSpec.dtensor_temporaries)."""
    spec = spec_of(setup)
    groups: dict[str, tuple[OptimizerSpec, list[TensorShape]]] = {}
    for t in tensors:
        owner = spec.group_of(t)
        groups.setdefault(owner.name, (owner, []))[1].append(t)
    if shard > 1 and any(g.dtensor_temporaries for g, _ in groups.values()):
        return max((g.dtensor_temporaries(ts, bits, shard) if g.dtensor_temporaries else
                    g.cpu_temporaries(ts, bits) if setup.device == "cpu" else
                    g.cuda_temporaries(ts, bits, setup.framework.cuda_adam_copies)
                    for g, ts in groups.values()), default=0)
    if setup.device == "cpu":
        return max((g.cpu_temporaries(ts, bits) for g, ts in groups.values()), default=0)
    copies = setup.framework.cuda_adam_copies
    return max((g.cuda_temporaries(ts, bits, copies) for g, ts in groups.values()), default=0)


def step_temporaries(setup: "SetupFields", tensors, bits: int, shard: int = 1) -> int:
    """The most bytes the step's temporaries hold at once (``_temporaries``), once per tuple of tensors."""
    if not isinstance(tensors, tuple):
        return _temporaries(setup, tensors, bits, shard)
    return _seen(("step", setup.request.optimizer, setup.device, setup.framework.cuda_adam_copies, bits, shard),
                 tensors, lambda: _temporaries(setup, tensors, bits, shard))


def step_flops(setup: "SetupFields", tensors: list[TensorShape]) -> int:
    spec = spec_of(setup)
    return sum(spec.group_of(t).flops(t) for t in tensors)


def notes(setup: "SetupFields") -> list[str]:
    """What the estimate says about the optimizer: its source, and what is not verified."""
    spec = spec_of(setup)
    out = [f"optimizer {spec.name}: states and step read from {spec.source}"]
    if spec.paged and setup.device == "cuda":
        out.append("paged optimizer states (tensors of at least 100,000 values) are CUDA unified memory "
                   "(cudaMallocManaged), outside torch's caching allocator: counted on the device because the "
                   "step touches all of them; under device-memory pressure the driver evicts pages to the host "
                   "(up to the same bytes of host memory) instead of failing, at the cost of PCIe traffic. "
                   "Unverified: on CPU ranks bitsandbytes falls back to ordinary states (optimizer.py:376)")
    if setup.device == "cuda" and not spec.verified_on_cpu:
        out.append(f"optimizer {spec.name}: no real run has measured it (unverified)")
    elif setup.device == "cuda" and spec.name != "adamw":
        out.append(f"optimizer {spec.name}: the CUDA step (fused kernels or foreach) is modelled from the source, "
                   "unverified; its states are the ones CPU runs measured")
    shards = setup.strategy.shards_parameters and setup.data_parallel_wrapped and setup.framework.shards_as_dtensors
    if spec.dtensor_temporaries is not None and shards and setup.shard_size > 1:
        out.append(f"optimizer {spec.name} on FSDP2's DTensor shards: DTensor redistributes inside each Newton-Schulz "
                   "iteration, so every rank builds its rows of the whole matrix's update: per matrix and step 15 "
                   "all-gathers (X.T, the Gram, X; rows <= columns) or 10 all-reduces of the Partial Gram (rows > "
                   "columns), charged to the step time as exposed communication, and the gathered buffers in its "
                   "temporaries (measured on CPU ranks; on CUDA from the same placements, unverified)")
    if setup.request.optimizer_in_backward:
        out.append("optimizer step in backward (torchtune optimizer_in_bwd): each parameter steps in its "
                   "post-accumulate-grad hook and its gradient is freed, so at most one parameter's gradient "
                   "and its step's temporaries exist at once")
    return out


def check(setup: "SetupFields") -> None:
    """Refuse what the optimizer cannot be composed with, naming the field and the reason."""
    req, s, spec = setup.request, setup.strategy, spec_of(setup)
    setup.framework.check_optimizer(setup, spec)
    sharded = s.shards_optimizer and setup.data_parallel_wrapped
    dtensor_shards = sharded and s.shards_parameters and setup.framework.shards_as_dtensors
    if spec.whole_matrices and (setup.tp > 1 or (sharded and (s.shard_within_node or not dtensor_shards
                                                               or setup.zero.offload_params != "none"))):
        # Measured on 2 and 4 CPU ranks (FSDP2, gloo; every thread's frees counted as backend/train.py does):
        # torch.optim.Muon steps the DTensor shards and DTensor's sharding propagation redistributes inside
        # _zeropower_via_newtonschulz, so the update is the whole matrix's (equal to the unsharded step to
        # rounding, 34-37% from Newton-Schulz on each shard alone); what that allocates and sends on a 1-D
        # mesh is modelled (optimizers.py _muon_dtensor_temporaries, muon_dtensor_collectives) and measured
        # by the fsdp runs in tests/real_runs.py. Not measured: HSDP's 2-D mesh (Replicate, Shard(0)), a TP
        # rank's Shard(0)/Shard(1) weights, and FSDP2's CPUOffloadPolicy (the step on host DTensors). The
        # distributed Muons that gather each matrix once (Moonlight: Liu et al. 2025, arXiv 2502.16982
        # Sec. 2.3; torchtitan b5bcd76 distributed/flex_shard/dist_muon.py DistMuon) are other optimizers.
        raise PlannerError(
            f"optimizer {spec.name} with strategy {s.name}, tp={setup.tp}, offload_params="
            f"{setup.zero.offload_params}: torch 2.13's Muon on DTensor shards orthogonalises the whole matrix "
            "through DTensor's collectives inside each Newton-Schulz iteration; modelled and measured for "
            "FSDP2 over one shard group (strategy fsdp or fsdp-grad-op, tp=1, no offload), not for HSDP's "
            "2-D mesh, tensor-parallel weights or offloaded parameters; nor are the distributed Muons that "
            "gather each matrix once (Moonlight, torchtitan's DistMuon)",
            field="optimizer")
    dtensors = setup.tp > 1 or (s.shards_parameters and setup.data_parallel_wrapped
                                  and setup.framework.shards_as_dtensors)
    if not spec.steps_dtensors and dtensors:
        raise PlannerError(
            f"optimizer {spec.name} with strategy {s.name}, tp={setup.tp}: the parameters are DTensors, and torch "
            "2.13's Adafactor fails on them (torch.norm(grad, dim=-1).square_(): an in-place op on a partial "
            "placement, which DTensor refuses; measured on CPU ranks); use single, ddp or a ZeRO stage",
            field="optimizer")
    if spec.paged and setup.zero.offload_optimizer != "none":
        raise PlannerError(f"optimizer {spec.name} with offload_optimizer={setup.zero.offload_optimizer}: paged states "
                           "page between the GPU and the host themselves; offloading them as well is not modelled",
                           field="offload_optimizer")
    if not req.optimizer_in_backward:
        return
    if req.gradient_accumulation > 1:
        raise PlannerError(f"optimizer_in_backward with gradient_accumulation={req.gradient_accumulation}: each "
                           "parameter steps as soon as its gradient exists, so gradients cannot accumulate over "
                           "micro-batches (torchtune refuses optimizer_in_bwd with gradient_accumulation_steps > 1)",
                           field="optimizer_in_backward")
    if setup.dims.pp > 1 or setup.tp > 1 or setup.dims.cp > 1 or setup.dims.ep > 1:
        raise PlannerError(f"optimizer_in_backward with tp={setup.tp}, pp={setup.dims.pp}, cp={setup.dims.cp}, "
                           f"ep={setup.dims.ep}: modelled on one device only", field="optimizer_in_backward")
    if setup.zero.offload_optimizer != "none" or setup.zero.offload_params != "none":
        raise PlannerError("optimizer_in_backward with offload: the step runs in the backward hook on the device; "
                           "an offloaded step is not modelled", field="optimizer_in_backward")
