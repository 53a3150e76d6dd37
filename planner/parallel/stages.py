"""Which blocks each pipeline stage holds: torchtitan's default split and Megatron's uneven first and
last stages (planner/parallel/pipeline.py builds the stages' memory and schedules on it; planner/parallel/experts.py
reads a stage's share of the experts)."""

from __future__ import annotations


def stage_bounds(num_layers: int, stages: int, first: int | None = None,
                 last: int | None = None) -> list[tuple[int, int]]:
    """[first, last) blocks of each stage. With neither ``first`` nor ``last`` given, split as
    torchtitan does when no split points are given (torchtitan/distributed/pipeline.py
    generate_split_points): every stage gets ``layers // stages`` blocks, the remainder goes one
    each to the middle stages (the first holds the embedding, the last the head), and the last
    stage takes what is left. With either given, Megatron's uneven split (Megatron-LM d98e8a6
    megatron/core/transformer/transformer_block.py get_num_layers_to_build: the given first and
    last stages' blocks are taken out and the stages left share the rest evenly); check_split
    refuses a split that does not come out whole."""
    if first is None and last is None:
        base, extra = divmod(num_layers, stages)
        bounds, start = [], 0
        for index in range(stages - 1):
            size = base + (1 if index > 0 and extra > 0 else 0)
            if index > 0 and extra > 0:
                extra -= 1
            bounds.append((start, start + size))
            start += size
        bounds.append((start, num_layers))
        return bounds
    sizes = _uneven_sizes(num_layers, stages, first, last)
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def _uneven_sizes(num_layers: int, stages: int, first: int | None, last: int | None) -> list[int]:
    fixed = [n for n in (first, last) if n is not None]
    left, rest = stages - len(fixed), num_layers - sum(fixed)
    middle = rest // left if left else 0
    return [first if first is not None else middle] + [middle] * (stages - 2) + [last if last is not None else middle]
