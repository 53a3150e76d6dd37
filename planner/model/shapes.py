"""Each parameter's shape, in the order ``parameter_numels`` lists them: what an optimizer whose
states depend on the shape reads (Adafactor factors a matrix's second moment into a row and a column
vector; Muon orthogonalises 2-D hidden weights and leaves the rest to AdamW).

A block's linears come from ``planner/model/linears.py`` (the names PEFT matches), matched in
registration order against the block's numels; a tensor no linear accounts for (a norm, a bias, a
sink, an MoE's fused 3-D experts, a router) is listed as a vector of its numel. A vector is the
conservative reading for both optimizers that read shapes: Adafactor keeps a full second moment for
it, and the Muon recipe gives it to AdamW, two states instead of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod

from planner.model.architecture import Architecture, derived_memo, distinct_specs, layer_specs
from planner.model.layers import layer_numels
from planner.model.linears import block_linears


@dataclass(frozen=True)
class TensorShape:
    """One parameter: its dimensions and whether it is the token embedding or the LM head (the
    input/output matrices Moonlight and torchtitan keep out of Muon)."""

    dims: tuple[int, ...]
    io: bool = False

    @cached_property
    def numel(self) -> int:
        return prod(self.dims)


def _numel(t: TensorShape) -> int:
    return t.numel


def vectors(numels: list[int]) -> list[TensorShape]:
    """Shapes known only by their element counts."""
    return [TensorShape((n,)) for n in numels]


def _block_shapes(arch: Architecture, numels: list[int], spec) -> list[TensorShape]:
    linears = iter(block_linears(arch, spec))
    pending = next(linears, None)
    out = []
    for n in numels:
        if pending is not None and pending.in_features * pending.out_features == n:
            out.append(TensorShape((pending.out_features, pending.in_features)))  # nn.Linear.weight (out, in)
            pending = next(linears, None)
        else:
            out.append(TensorShape((n,)))
    return out


def parameter_shapes(a: Architecture) -> tuple[TensorShape, ...]:
    """Every parameter's shape in ``parameter_numels`` order (tied weights once); a vision tower's
    tensors as vectors (its shapes are not described). Computed once per Architecture (the plan's
    search asks for every candidate)."""
    memo = derived_memo(a)
    if memo.get("_shapes") is None:
        memo["_shapes"] = tuple(_shapes(a))
    return memo["_shapes"]


def _shapes(a: Architecture) -> list[TensorShape]:
    h = a.hidden_size
    per_kind = {key: _block_shapes(a, layer_numels(spec, h), spec) for key, spec in distinct_specs(a).items()}
    out = vectors(list(a.vision_numels)) + [TensorShape((a.vocab_size, h), io=True)]
    if a.learned_positions:
        out.append(TensorShape((a.learned_positions, h)))
    for spec in layer_specs(a):
        out += per_kind[id(spec)]
    out += vectors([h] * (2 if a.norm == "layernorm" else 1))
    if not a.tie_word_embeddings:
        out.append(TensorShape((a.vocab_size, h), io=True))
    return out


def matching(shapes: tuple[TensorShape, ...], numels: list[int]) -> "tuple[TensorShape, ...] | list[TensorShape]":
    """``shapes`` where they account for ``numels`` one for one, else the numels as vectors (a
    tensor-parallel rank's split embedding, a traced model): never a shape the rank does not hold.

    What is computed from a tuple of shapes is remembered by the tuple's identity
    (planner/memory/optimizer.py _seen), so the answer for one rank's tensors is the same tuple
    each time it is asked (a tensor-parallel rank's, asked for every candidate of its layout:
    _MATCHED); a stage's few tensors (a pipeline's, thousands per plan, their counts all
    different) are a new list, which would only crowd those memos out."""
    if len(shapes) != len(numels):
        return vectors(numels)
    key = (id(shapes), tuple(numels))
    hit = _MATCHED.get(key)
    if hit is not None and hit[0] is shapes:
        return hit[1]
    if list(map(_numel, shapes)) == numels:
        answer = shapes
    else:
        answer = tuple(s if s.numel == n else TensorShape((n,)) for s, n in zip(shapes, numels))
    if len(_MATCHED) > 256:
        _MATCHED.clear()
    _MATCHED[key] = (shapes, answer)
    return answer


# matching's answers by (the shapes' identity, the counts); the shapes are kept beside the answer so
# that an identity is never reused while its entry stands
_MATCHED: dict[tuple, tuple] = {}
