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

    from planner.setup import Setup


def spec_of(setup: "Setup") -> OptimizerSpec:
    return OPTIMIZERS[setup.request.optimizer]


def rank_tensors(setup: "Setup", counts: list[int]) -> "Sequence[TensorShape]":
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
    if not isinstance(tensors, tuple):
        return sum(count * spec.group_of(t).states(t, bits) for t, count in Counter(tensors).items())
    return _seen(("states", spec.name, bits), tensors,
                 lambda: sum(count * spec.group_of(t).states(t, bits) for t, count in Counter(tensors).items()))


def state_bits(spec: OptimizerSpec, tensors: list[TensorShape], bits: int) -> float:
    """Bits of state per stepped element, averaged over ``tensors``: what the element counts of the
    model-state terms multiply."""
    total = sum(t.numel for t in tensors)
    return 8 * states_bytes(spec, tensors, bits) / total if total else 0.0


def _temporaries(setup: "Setup", tensors: list[TensorShape], bits: int) -> int:
    """The most bytes the step's temporaries hold at once. Each group (Muon's matrices, its AdamW
    rest) steps after the other, so the groups' temporaries do not overlap."""
    spec = spec_of(setup)
    groups: dict[str, tuple[OptimizerSpec, list[TensorShape]]] = {}
    for t in tensors:
        owner = spec.group_of(t)
        groups.setdefault(owner.name, (owner, []))[1].append(t)
    if setup.device == "cpu":
        return max((g.cpu_temporaries(ts, bits) for g, ts in groups.values()), default=0)
    copies = setup.framework.cuda_adam_copies
    return max((g.cuda_temporaries(ts, bits, copies) for g, ts in groups.values()), default=0)


def step_temporaries(setup: "Setup", tensors, bits: int) -> int:
    """The most bytes the step's temporaries hold at once (``_temporaries``), once per tuple of tensors."""
    if not isinstance(tensors, tuple):
        return _temporaries(setup, tensors, bits)
    return _seen(("step", setup.request.optimizer, setup.device, setup.framework.cuda_adam_copies, bits), tensors,
                 lambda: _temporaries(setup, tensors, bits))


def step_flops(setup: "Setup", tensors: list[TensorShape]) -> int:
    spec = spec_of(setup)
    return sum(spec.group_of(t).flops(t) for t in tensors)


def notes(setup: "Setup") -> list[str]:
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
    if setup.request.optimizer_in_backward:
        out.append("optimizer step in backward (torchtune optimizer_in_bwd): each parameter steps in its "
                   "post-accumulate-grad hook and its gradient is freed, so at most one parameter's gradient "
                   "and its step's temporaries exist at once")
    return out


def check(setup: "Setup") -> None:
    """Refuse what the optimizer cannot be composed with, naming the field and the reason."""
    req, s, spec = setup.request, setup.strategy, spec_of(setup)
    setup.framework.check_optimizer(setup, spec)
    if spec.whole_matrices and (setup.tp > 1 or (s.shards_optimizer and setup.data_parallel_wrapped)):
        # Measured on 2 and 4 CPU ranks (FSDP2, gloo; every thread's frees counted as backend/train.py does):
        # torch.optim.Muon steps the DTensor shards and DTensor's sharding propagation redistributes inside
        # _zeropower_via_newtonschulz, so the update is the whole matrix's (equal to the unsharded step to
        # rounding, 34-37% from Newton-Schulz on each shard alone). Per iteration, (m, n) with r = m / world:
        # rows <= columns: X is Shard(0); X @ X.T all-gathers X.T (Shard(1): a contiguous copy of the local
        # rows, the gathered buffer, then a cat: two whole bf16 m x n matrices beside the shard), the Gram is
        # Shard(0) (r x m), addmm(gram, gram, gram) all-gathers it (m x m) and addmm(X, update, X) all-gathers
        # X again: 3 all-gathers (2mn, 2m^2, 2mn bytes) per iteration, 15 per step, and 1 all-reduce (the
        # norm). Rows > columns: X.T is Shard(1), the Gram a Partial n x n on every rank, all-reduced to
        # Replicate as mat1 of the Gram update and again as the update's: 2 all-reduces of 2n^2 bytes per
        # iteration, 11 per step. Step peaks above its start: 256x688 1.70 MB (fp32) / 1.53 MB (bf16) on 2
        # ranks, 1.24 / 1.39-1.47 MB on 4; 688x256 1.20 / 1.15 MB on 2, 0.98 / 0.80 MB on 4; the
        # whole-matrix step (_muon_temporaries) says 1.67 / 1.32 MB: 42% below to 16% above. What makes the
        # CPU figures move between runs of one shape (1.39 vs 1.47 MB) is gloo: a collective's gathered
        # output is freed by its Work on gloo's thread, sometimes after the next iteration's all-gather has
        # allocated (one more whole m x n matrix live), and oneDNN's bf16 matmuls add 50-110 KB workspaces.
        # Neither is modelled, so the step is refused rather than under-predicted. The distributed Muons
        # that gather each matrix once (Moonlight: Liu et al. 2025, arXiv 2502.16982 Sec. 2.3; torchtitan
        # b5bcd76 distributed/flex_shard/dist_muon.py DistMuon) are other optimizers.
        raise PlannerError(
            f"optimizer {spec.name} with strategy {s.name}, tp={setup.tp}: torch 2.13's Muon on DTensor shards "
            "does orthogonalise the whole matrix, through DTensor's collectives inside each Newton-Schulz "
            "iteration (measured on CPU ranks under FSDP2: per matrix and step 15 all-gathers of whole bf16 "
            "matrices and Gram matrices when rows <= columns, 11 all-reduces of the Gram matrix otherwise; the "
            "step's temporaries 42% below to 16% above a whole matrix's step, moving with when gloo frees a "
            "gathered buffer); not modelled, nor are the distributed Muons that gather each matrix once "
            "(Moonlight, torchtitan's DistMuon): use strategy single or ddp with tp=1",
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
