"""The original parameters a rank's optimizer steps under torch FSDP1 (FullyShardedDataParallel with
use_orig_params, composer's default).

FSDP1 flattens each wrapped unit's parameters, in registration order, into one flat parameter and gives
rank r the r-th of its ``world`` chunks (torch 2.13 distributed/fsdp/_flat_param.py: ``_get_unpadded_shard``
chunks the flat tensor with ``torch.chunk(world_size)``, so each chunk holds ceil(T / world) elements and the
last ones fewer or none). With use_orig_params every original parameter is a view of what of it lies in the
rank's chunk, and one that lies wholly outside it gets no gradient (``_use_sharded_grad_views``: ``if not
shard_param_info.in_shard: param.grad = None``), so an optimizer that skips gradient-less parameters (torch's
AdamW collects only parameters with a gradient; composer's DecoupledAdamW: ``if p.grad is None or not
p.requires_grad: continue``, composer/optim/decoupled_weight_decay.py line 307 at v0.14.0) steps only the
parameters the rank's chunk meets. Under use_orig_params each parameter starts at an address aligned to 16 bytes of the unsharded dtype
(``_get_aligned_numel``: padding elements before it). FSDP2 shards every parameter on its dim 0 over the whole
group instead, so every rank steps every parameter. The units are composer's wrapping: one per
block, and the root holding the embeddings, the final norm and an untied head; each unit's parameters in the
planner's order (layers.layer_numels: attention, MLP, then norms, where GPT-2's and MPT's blocks register their
norms between: the worst rank meets one parameter more per block than it would).
"""

from __future__ import annotations

from collections import Counter

from planner.model.architecture import Architecture, block_numels, derived_memo, parameter_numels

ALIGNMENT_BYTES = 16  # _flat_param.py _get_aligned_numel: 16 bytes of the unsharded (forward) dtype


def root_numels(a: Architecture) -> list[int]:
    """The root unit's parameters in registration order: parameter_numels without the blocks' (the vision
    tower, embeddings and positions lead them; the final norm and an untied head follow)."""
    every = parameter_numels(a)
    lead = len(a.vision_numels) + 1 + bool(a.learned_positions)
    return every[:lead] + every[lead + sum(len(b) for b in block_numels(a)):]


def per_rank(numels: list[int] | tuple[int, ...], world: int, align: int) -> list[int]:
    """How many of one flat parameter's original parameters each of ``world`` ranks' chunks meets."""
    offsets, total = [], 0
    for n in numels:
        total += -total % align if n else 0  # the padding that aligns the parameter's start
        offsets.append((total, n))
        total += n
    chunk = -(-total // world) if total else 1
    diff = [0] * (world + 1)
    for start, n in offsets:
        if n:
            diff[start // chunk] += 1
            diff[(start + n - 1) // chunk + 1] -= 1
    counts, running = [], 0
    for r in range(world):
        running += diff[r]
        counts.append(running)
    return counts


def stepped_tensors(a: Architecture, world: int, forward_bytes: int) -> int:
    """The most original parameters any one rank steps (the step waits for the slowest rank): summed over the
    units, per rank, then the largest. ``forward_bytes``: the gathered parameters' element size (the alignment)."""
    key = ("_fsdp1_stepped", world, forward_bytes)
    memo = derived_memo(a)
    if memo.get(key) is None:
        align = max(1, ALIGNMENT_BYTES // forward_bytes)
        units = Counter(tuple(n) for n in block_numels(a))
        units[tuple(root_numels(a))] += 1
        totals = [0] * world
        for numels, times in units.items():
            for r, count in enumerate(per_rank(numels, world, align)):
                totals[r] += times * count
        memo[key] = max(totals)
    return memo[key]
