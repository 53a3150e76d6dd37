"""What every framework's phases are built from: the backward sweep of a model's blocks, the
named items, and the optimizer states and temporaries all of them hold.

Each framework's own phases live in its module (planner/frameworks/): DeepSpeed 0.19.8's ZeRO
stages in deepspeed_0_19.py, torch 2.13's DDP and FSDP2 in torch_2.py. Every buffer term names the
source that allocates it, confirmed allocation by allocation with the verification backend's peak
trace (``backend.train.live_at``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

from planner.model.activations import Activations
from planner.model.architecture import block_parameters, blocks_parameters, layer_parameters, vision_parameters
from planner.memory.moments import PhaseKind
from planner.memory.optimizer import flat, spec_of, states_bytes, step_temporaries
from planner.memory.phase_plan import PhasePlan  # noqa: F401 (re-exported: the frameworks build it from here)
from planner.schema import MemoryItem, Phase

if TYPE_CHECKING:
    from planner.model.architecture import Architecture
    from planner.setup_fields import SetupFields

FP32 = 4


_COMPONENTS = frozenset(get_args(MemoryItem.model_fields["component"].annotation))
_new, _set = object.__new__, object.__setattr__


def _filled(cls, fields: dict):
    """A ``cls`` model holding ``fields``, filled in as pydantic 2's model_construct does (main.py:
    __dict__, the fields set, no extra and no private attributes): for what the core builds from
    values of the fields' types already, tens of thousands per plan."""
    m = _new(cls)
    _set(m, "__dict__", fields)
    _set(m, "__pydantic_fields_set__", set(fields))
    _set(m, "__pydantic_extra__", None)
    _set(m, "__pydantic_private__", None)
    return m


def item(name: str, nbytes: int, component: str, source: str = "", stream: str = "default") -> MemoryItem:
    """``stream``: the CUDA stream its tensors are allocated on (the caching allocator's pools are
    per stream: planner/memory/reserved.py).

    A plan builds tens of thousands of items, a few hundred of them distinct: an item is made
    once per value and shared (nothing in the core changes an item; model_copy copies), filled in
    (_filled) after the one check validation would make (the component)."""
    key = (name, nbytes, component, source, stream)
    m = _ITEMS.get(key)
    if m is not None:
        return m
    if component not in _COMPONENTS:
        raise ValueError(f"component({component!r}) is not one of {sorted(_COMPONENTS)}")
    m = _filled(MemoryItem, {"name": name, "bytes": int(nbytes), "component": component, "source": source,
                             "stream": stream})
    if len(_ITEMS) >= 1 << 16:
        _ITEMS.clear()
    _ITEMS[key] = m
    return m


_ITEMS: dict[tuple, MemoryItem] = {}  # item's memo, by its arguments


def phase(kind: PhaseKind, name: str, items: list[MemoryItem]) -> Phase:
    """A phase of this kind shown under ``name``; items of zero bytes are left out. Filled in as an
    item is (_filled: a plan builds thousands of phases from items already made), after the one
    check validation would make that the arguments' types do not (the kind)."""
    if not isinstance(kind, PhaseKind):
        raise ValueError(f"kind({kind!r}) is not a PhaseKind")
    kept = [i for i in items if i.bytes > 0]
    return _filled(Phase, {"name": name, "bytes": sum(i.bytes for i in kept), "items": kept, "kind": kind})


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- the backward sweep ----------------------------------------------------------------------

@dataclass(frozen=True)
class SweepPoint:
    kind: PhaseKind
    label: str  # for display only: code reads the kind
    activation_bytes: int
    grad_elements: int  # gradient elements produced so far
    in_flight_elements: int  # of which produced since the last block boundary (not yet reduced)
    transient_bytes: int
    # A tied LM head's contribution to the embedding weight's gradient (counted in grad_elements),
    # held by autograd until the embedding's own arrives: no parameter hook has seen it yet.
    held_elements: int = 0
    # At the embedding's backward, the two tied contributions live while autograd sums them.
    tied_sum_elements: int = 0
    # At the start of a block after the first in backward: the block reduced before it, whose
    # reduce-scatter input FSDP2 keeps until this block's post_backward (_fsdp_items)
    reduced_before_elements: int = 0


@dataclass(frozen=True)
class Layout:
    """What the backward sweep needs of a model's blocks, from its Architecture or from a profile
    traced outside the core (catalogue.TracedProfile): the one place either is read."""

    num_layers: int
    layer_parameters: int  # one block's (the per-block step of the sweep)
    blocks_parameters: int  # all blocks together
    late_parameters: int  # gradients produced after the last block: the untied input embeddings
    lm_head_elements: int  # vocab x hidden, the LM head's matmul (tied or not)
    tied_head_elements: int = 0  # the LM head's gradient contribution to a tied embedding (_tied_head_elements)
    # The biggest block, which FSDP gathers, prefetches and autocast recasts as one unit: in a
    # mixed stack (dense then MoE, MoE every other layer) it exceeds the mean block.
    largest_block_parameters: int = 0


def layout(setup: "SetupFields") -> Layout | None:
    traced = setup.model.traced
    if traced is not None:
        return Layout(traced.num_layers, traced.layer_parameters, traced.blocks_parameters,
                      traced.late_parameters, traced.lm_head_elements, traced.tied_head_elements,
                      traced.largest_block_parameters)
    arch = setup.arch
    if arch is None:
        return None
    if setup.finetune is not None:  # only adapters make gradients (planner/recipes/finetune.py)
        from planner.recipes.finetune import layout_fields

        return Layout(**layout_fields(arch, setup.finetune))
    # Backward meets the input embeddings last; a tied head's gradient is the embedding's,
    # allocated at the head.
    embedding = arch.vocab_size * arch.hidden_size + arch.learned_positions * arch.hidden_size
    # include_vision: the vision tower and projector run before the decoder on an image batch, so
    # their gradients come last, with the embeddings' (on a text batch they get none: counting them
    # here is the bound). They are no block: FSDP wraps them with the root (psi - blocks).
    late = (0 if arch.tie_word_embeddings else embedding) + vision_parameters(arch)
    return Layout(arch.num_layers, layer_parameters(arch), blocks_parameters(arch),
                  late, arch.vocab_size * arch.hidden_size,
                  _tied_head_elements(arch), max(block_parameters(arch)))


def _tied_head_elements(arch: "Architecture") -> int:
    """Elements of the LM head's contribution to a tied embedding weight's gradient.

    The tied weight is one leaf used twice, so autograd gives it one AccumulateGrad node and
    sums both contributions in that node's input buffer before running it (torch 2.13,
    torch/csrc/autograd/input_buffer.cpp, InputBuffer::add): the LM head's V x h gradient waits
    there from the head's backward to the embedding's, at the very end, where the embedding's
    dense gradient (embedding_dense_backward) and their out-of-place sum are made. Only then
    does the parameter's post-accumulate hook run (ZeRO's reduction, DDP's bucket copy).
    Measured with the backend's peak trace on ZeRO-2 (qwen2 fp32, gpt2 bf16, exact): three V x h
    tensors live at the embedding's backward, and the head's contribution unreduced through
    every block; on ZeRO-1 (qwen2 fp32, exact) the same sum, with every gradient and the bucket
    live, before the reduction; on FSDP2 (qwen2 fp32 and bf16, exact) the same sum, beside the
    root's unsharded gradients; on ZeRO-3 (qwen2 fp32, exact) held through every block, then
    summed with the embedding's gradient in place (two V x h: frameworks/deepspeed/v0_19.py
    _zero3_embedding_backward). DDP was within 3% without the term and does not use it."""
    return arch.vocab_size * arch.hidden_size if arch.tie_word_embeddings else 0


def head_and_late(shape: Layout, numels: list[int], total: int | None = None) -> tuple[int, int]:
    """(gradient elements backward produces before the first block: LM head and final norm;
    those it produces after the last block: the untied input embeddings); ``total``: sum(numels),
    where the caller has it."""
    total = sum(numels) if total is None else total
    return total - shape.blocks_parameters - shape.late_parameters, shape.late_parameters


def backward_sweep(acts: Activations | None, numels: list[int], shape: Layout | None) -> list[SweepPoint]:
    """Live activations and produced gradients at each moment of the backward pass where the
    live total can peak: the loss, after the LM head, the start and the end of every block (last
    to first), and the end. A block's saved activations are freed by the end of its backward,
    and its parameters' gradients exist from then on."""
    total = sum(numels)
    if acts is None or shape is None:
        return [SweepPoint(PhaseKind.BACKWARD, "backward", 0, total, max(numels), 0)]
    per_layer = shape.layer_parameters
    head, late = head_and_late(shape, numels, total)
    held = shape.tied_head_elements
    body = acts.saved_bytes - acts.head_saved_bytes
    # activation_offload: the saved set is on the host; the device holds what is brought back
    # (Activations.host_offload): the loss's, the final norm's, then one block's at a time
    # and what every block keeps there until its backward (device_block_bytes: its repeated saves)
    waiting = acts.device_block_bytes * shape.num_layers
    at_loss, after_head = (acts.device_head_bytes + waiting, acts.device_after_head_bytes + waiting) \
        if acts.host_offload else (acts.saved_bytes + waiting + acts.duplicate_head_bytes,
                                   body + waiting + acts.duplicate_head_bytes)
    # torchtitan's chunked loss runs the LM head's backward inside the loss's call: its gradient is made there
    early = head if acts.head_gradient_in_loss else 0
    points = [SweepPoint(PhaseKind.START_OF_BACKWARD, "start of backward", at_loss, early, early,
                         acts.loss_transient_bytes),
              SweepPoint(PhaseKind.AFTER_LM_HEAD, "after the LM head", after_head, head, head,
                         acts.final_norm_transient_bytes)]
    recompute = acts.layer_saved_bytes if acts.checkpointed else 0
    # Live activations fall and produced gradients rise linearly with the block index, so every
    # phase total is linear in it and its maximum is at the first or the last block; from the
    # second block on FSDP2 also holds the reduce-scatter input of the block before
    # (reduced_before_elements), a step between the first block and the second, so the second is
    # listed too. The blocks between can never be the peak and are not listed.
    # Blocks unlike each other (checkpointing_every, the selective policies: Activations.kept_blocks)
    # are all listed.
    indices = range(shape.num_layers) if acts.kept_blocks else \
        sorted({0, min(1, shape.num_layers - 1), shape.num_layers - 1})
    for index in indices:
        block = shape.num_layers - index
        done, rebuilt, own = acts.backward_of(index) if acts.kept_blocks else \
            (index * acts.layer_kept_bytes, recompute, acts.layer_kept_bytes)
        # offloaded: the block's own set brought back, and the earlier blocks' kept saves; on shared
        # memory (CPU ranks) the saved set as without offloading, with the kept saves beside it
        earlier = (shape.num_layers - 1 - index) * acts.device_block_bytes
        start, end = (own + earlier, earlier) if acts.host_offload else \
            (body - done + earlier + acts.device_block_bytes, body - done - own + earlier)
        produced = head + index * per_layer
        points.append(SweepPoint(PhaseKind.START_OF_BLOCK, f"start of block {block} backward", start + rebuilt, produced,
                                 0, acts.layer_transient_bytes, held_elements=held,
                                 reduced_before_elements=per_layer if index else 0))
        points.append(SweepPoint(PhaseKind.END_OF_BLOCK, f"end of block {block} backward", end,
                                 produced + per_layer, per_layer, 0, held_elements=held))
    # The embeddings' backward comes last: an untied embedding's gradient awaits its hook, or a
    # tied weight's two contributions live while autograd sums them.
    points.append(SweepPoint(PhaseKind.END_OF_BACKWARD, "end of backward", 0, total, late or per_layer, 0, held_elements=held,
                             tied_sum_elements=2 * held))
    return points


# --- items every framework holds ----------------------------------------------------------

def step_temporaries_flat(elements: int, setup: "SetupFields") -> int:
    """Temporaries of a DeepSpeed optimizer step over ``elements`` of one flat fp32 tensor (a
    partition, a sub-group, or the largest parameter), from the registry
    (planner/recipes/optimizers.py): on CPU ranks the library's CPU path (torch.optim.AdamW's
    single-tensor sqrt and division: two fp32 copies); on CUDA, FusedAdam's multi_tensor_apply
    (Framework.cuda_adam_copies = 0)."""
    return step_temporaries(setup, flat(elements), FP32 * 8)


def optimizer_items(setup: "SetupFields", elements: int, where: str) -> list[MemoryItem]:
    items = []
    if setup.zero.offload_optimizer == "none":
        spec = spec_of(setup)
        items.append(item(f"fp32 master weights ({where})", FP32 * elements, "optimizer_states",
                           "ZeRO paper Sec. 3.1; DeepSpeed keeps an fp32 copy even for fp32 training"))
        items.append(item(f"{setup.request.optimizer} states ({where})",
                           states_bytes(spec, flat(elements), FP32 * 8), "optimizer_states", spec.source))
    return items


# the items planner/memory/reserved.py cuts into the loss's tensors
SAVED, TRANSIENTS = "saved activations", "backward transients"


def activation_items(point: SweepPoint) -> list[MemoryItem]:
    return [
        item(SAVED, point.activation_bytes, "activations"),
        item(TRANSIENTS, point.transient_bytes, "activations",
              "gradients of the loss (2 x fp32 tokens x vocab) or of one block's intermediates"),
    ]


def tied_sum_item(point: SweepPoint, grad_bytes: int) -> MemoryItem:
    return item("tied embedding: LM head's and embedding's gradients being summed",
                 grad_bytes * point.tied_sum_elements, "gradients",
                 "autograd input_buffer.cpp: one AccumulateGrad node per leaf, contributions summed out of place")
