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

from planner.model.architecture import Architecture, block_numels, layer_specs
from planner.model.linears import block_linears


@dataclass(frozen=True)
class TensorShape:
    """One parameter: its dimensions and whether it is the token embedding or the LM head (the
    input/output matrices Moonlight and torchtitan keep out of Muon)."""

    dims: tuple[int, ...]
    io: bool = False

    @property
    def numel(self) -> int:
        out = 1
        for d in self.dims:
            out *= d
        return out


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


def parameter_shapes(a: Architecture) -> list[TensorShape]:
    """Every parameter's shape in ``parameter_numels`` order (tied weights once); a vision tower's
    tensors as vectors (its shapes are not described)."""
    h = a.hidden_size
    out = vectors(list(a.vision_numels)) + [TensorShape((a.vocab_size, h), io=True)]
    if a.learned_positions:
        out.append(TensorShape((a.learned_positions, h)))
    for spec, numels in zip(layer_specs(a), block_numels(a)):
        out += _block_shapes(a, numels, spec)
    out += vectors([h] * (2 if a.norm == "layernorm" else 1))
    if not a.tie_word_embeddings:
        out.append(TensorShape((a.vocab_size, h), io=True))
    return out


def matching(shapes: list[TensorShape], numels: list[int]) -> list[TensorShape]:
    """``shapes`` where they account for ``numels`` one for one, else the numels as vectors (a
    tensor-parallel rank's split embedding, a traced model): never a shape the rank does not hold."""
    if len(shapes) == len(numels):
        return [s if s.numel == n else TensorShape((n,)) for s, n in zip(shapes, numels)]
    return vectors(numels)
