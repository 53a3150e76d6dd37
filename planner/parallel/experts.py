"""Expert parallelism: routed experts sharded over the ep group, token dispatch and combine (issue 12).

As torchtitan 0.3 composes it (torchtitan/distributed/parallel_dims.py ``efsdp``,
torchtitan/distributed/fsdp.py, torchtitan/models/common/token_dispatcher.py), and as
``planner verify --ep`` runs it (backend/train_experts.py, measured within 3%): the ep
group borrows its ranks from dp_shard x cp, so ep must divide dp_shard * cp and does not multiply
the world. Each rank of the group holds ``num_experts / ep`` routed experts of every MoE block;
the router (gate) and the shared experts are replicated over the group like the dense weights.
Under FSDP the routed experts are further sharded over dp_shard * cp / ep, the rest over
dp_shard * cp.

Tokens reach their experts by an all-to-all before the experts (dispatch) and come back by
another after them (combine); backward runs the two again in reverse (Lepikhin et al. 2020,
"GShard", Sec. 3.2; Fedus et al. 2021, "Switch Transformers", Sec. 2.2). Each all-to-all moves
``tokens x experts_per_token x hidden`` elements of the compute dtype per rank and holds a send
and a receive buffer of that size while it runs. Dropless routing (torchtitan, Megablocks)
sends exactly the routed tokens (the mean is counted: the imbalance of a step is data);
capacity-factor routing pads every expert to ``ceil(cf x tokens x k / E)`` slots (GShard), so
buffers and the experts' saved inputs grow by ``cf``.

What a rank holds, as measured: the router scores all E experts before the dispatch, and a rank
computes as many (token, expert) pairs as without ep on average, so its activations are the whole
model's (planner/memory/orchestrator.py estimate); the all-to-all buffers live inside a MoE block's forward and
backward, not at the loss; the mean is modelled, and the rank whose experts the router favours
holds more (a top-4 run at 2,048 tokens: rank 0 +2.3% over the mean's prediction, rank 1 -1.6%).
Not modelled: torchtitan 0.3 multiplies the combined output by the scores in fp32
(token_dispatcher.py combine), which under bf16 saves a 4-byte (tokens x k x hidden) copy per MoE
block where the probe, computing as the transformers model does, saves a 2-byte one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.model.architecture import Architecture, derived_memo, layer_specs
from planner.errors import PlannerError
from planner.memory.moments import PhaseKind
from planner.model.layers import MlpSpec, mlp_numels
from planner.parallel.stages import stage_bounds
from planner.setup import with_fields

if TYPE_CHECKING:
    from planner.setup import Setup


def routed_numels(m: MlpSpec, hidden: int) -> int:
    """Elements of one MoE block's routed experts (gate/up and down, with their biases)."""
    if not m.is_moe:
        return 0
    whole = sum(mlp_numels(m, hidden))
    router = hidden * m.num_experts + (m.num_experts if m.router_bias else 0)
    shared = sum(mlp_numels(m.model_copy(update={"num_experts": 0, "experts_per_token": 0,
                                                 "intermediate_size": m.shared_intermediate_size}), hidden)) \
        if m.shared_intermediate_size else 0
    return whole - router - shared


def routed_total(a: Architecture) -> int:
    """Elements of the model's routed experts (every block's routed_numels), once per Architecture
    (the plan's search asks for every candidate)."""
    memo = derived_memo(a)
    if memo.get("_routed") is None:
        memo["_routed"] = sum(routed_numels(spec.mlp, a.hidden_size) for spec in layer_specs(a))
    return memo["_routed"]


def moe_blocks(a: Architecture) -> list[int]:
    """Indices of the blocks whose MLP is a mixture of experts (dense-then-MoE stacks, MoE every
    other layer)."""
    memo = derived_memo(a)
    if memo.get("_moe_blocks") is None:
        memo["_moe_blocks"] = tuple(i for i, spec in enumerate(layer_specs(a)) if spec.mlp.is_moe)
    return list(memo["_moe_blocks"])


def check_ep(a: Architecture | None, ep: int) -> None:
    if ep == 1:
        return
    if a is None:
        raise PlannerError(f"ep={ep} needs an architecture (its experts are sharded): give a model, not params",
                           field="ep")
    memo = derived_memo(a)
    if memo.get("_expert_counts") is None:
        memo["_expert_counts"] = frozenset(spec.mlp.num_experts for spec in layer_specs(a) if spec.mlp.is_moe)
    experts = memo["_expert_counts"]
    if not experts:
        raise PlannerError(f"ep={ep}: the model has no routed experts; expert parallelism needs a mixture-of-experts model",
                           field="ep")
    for count in sorted(experts):
        if count % ep:
            raise PlannerError(f"num_experts({count}) is not divisible by ep({ep})", field="ep")


@dataclass(frozen=True)
class ExpertSharding:
    ep: int
    routed_elements: int  # all routed expert parameters of the model
    routed_local_elements: int  # this rank's share, before any FSDP sharding
    parameters_per_rank: int  # every parameter a rank of the ep group holds
    moe_layers: int


def expert_sharding(a: Architecture, total_parameters: int, ep: int) -> ExpertSharding:
    check_ep(a, ep)
    routed = routed_total(a)
    local = routed // ep
    return ExpertSharding(ep, routed, local, total_parameters - routed + local, len(moe_blocks(a)))


def local_numels(a: Architecture, numels_of_block: list[list[int]], ep: int) -> list[list[int]]:
    """Each block's parameter tensors as one rank of the ep group holds them: the routed experts'
    (E, ...) tensors cut to E / ep experts."""
    out = []
    for spec, numels in zip(layer_specs(a), numels_of_block):
        m = spec.mlp
        if not m.is_moe or ep == 1:
            out.append(list(numels))
            continue
        routed = _routed_tensors(m, a.hidden_size)
        cut, remaining = [], dict(routed)
        for n in numels:
            if remaining.get(n, 0) > 0:
                remaining[n] -= 1
                cut.append(n // ep)
            else:
                cut.append(n)
        out.append(cut)
    return out


def _routed_tensors(m: MlpSpec, hidden: int) -> dict[int, int]:
    """The routed experts' tensors of one MoE block (size -> count), as mlp_numels lays them out."""
    e, inner = m.num_experts, m.intermediate_size
    up = (2 if m.gated else 1) * inner
    sizes = [e * up * hidden] + ([e * up] if m.bias else []) + [e * hidden * inner] + ([e * hidden] if m.bias else [])
    counts: dict[int, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return counts


@dataclass(frozen=True)
class DispatchBuffers:
    """Per MoE block and micro-batch, in bytes."""

    routed_tokens: int  # token copies one rank sends (= receives, on average) per all-to-all
    all_to_all_bytes: int  # send + receive buffers live during one all-to-all
    saved_extra_bytes: int  # what capacity padding adds to the experts' saved inputs
    sent_bytes: int  # what one all-to-all sends to the other ranks of the group


def dispatch_buffers(a: Architecture, tokens: int, compute_bytes: int, ep: int,
                     capacity_factor: float | None = None) -> DispatchBuffers:
    """Token dispatch/combine of one MoE block for one micro-batch of ``tokens`` on one rank."""
    m = next((spec.mlp for spec in layer_specs(a) if spec.mlp.is_moe), None)
    if m is None or ep == 1:
        return DispatchBuffers(0, 0, 0, 0)
    k, e, h = m.experts_per_token, m.num_experts, a.hidden_size
    routed = tokens * k
    if capacity_factor is not None:
        if capacity_factor <= 0:
            raise PlannerError(f"capacity_factor ({capacity_factor}) must be > 0", field=None)
        slots = e * -(-int(capacity_factor * tokens * k * 1000) // (e * 1000))  # ceil(cf*T*k/E) per expert
        padded = max(slots, routed) if capacity_factor >= 1 else slots
    else:
        padded = routed
    one = padded * h * compute_bytes
    return DispatchBuffers(routed_tokens=padded, all_to_all_bytes=2 * one,
                           saved_extra_bytes=max(0, padded - routed) * h * compute_bytes,
                           sent_bytes=one * (ep - 1) // ep)


def all_to_alls_per_block(checkpointing: str = "none") -> int:
    """Data all-to-alls per MoE block and micro-batch: dispatch and combine in forward, the two
    again in backward, and under full activation checkpointing the forward's two once more when
    the block is recomputed (counted in a checkpointed verify run: 8 forward dispatches for 4
    blocks, backend/train_experts.py)."""
    return 6 if checkpointing == "full" else 4


def all_to_all_bytes_per_step(a: Architecture, tokens: int, compute_bytes: int, ep: int, micro_batches: int,
                              capacity_factor: float | None = None, checkpointing: str = "none") -> int:
    """Bytes one rank sends over the ep group per step: every data all-to-all of every MoE block
    and micro-batch (all_to_alls_per_block)."""
    one = dispatch_buffers(a, tokens, compute_bytes, ep, capacity_factor).sent_bytes
    return all_to_alls_per_block(checkpointing) * one * len(moe_blocks(a)) * micro_batches


def all_to_all_seconds(sent_bytes: int, link_gbps: float, ranks: int, latency_us: float = 0.0) -> float:
    """One all-to-all over ``ranks``: each rank sends ``sent_bytes`` (its (ep-1)/ep share) through its
    own link of ``link_gbps`` GB/s, one message per peer (the slowest link the group crosses:
    NVLink inside a node, the NIC when the group spans nodes)."""
    if ranks <= 1 or link_gbps <= 0:
        return 0.0
    return sent_bytes / (link_gbps * 1e9) + (ranks - 1) * latency_us * 1e-6


def local_architecture(a: Architecture, ep: int) -> Architecture:
    """The architecture one rank of the ep group holds: every MoE block with num_experts / ep
    routed experts (tokens still pick experts_per_token of them: on average a rank computes as
    many token-expert pairs as without EP). Another instance (the memo of ``a`` is not shared)."""
    if ep == 1:
        return a
    # one instance per (architecture, ep), kept in the architecture's memo: the plan's search asks
    # for it per candidate, and what is memoized on an instance (its shapes, its optimizer states:
    # planner/memory/optimizer.py _seen) is then computed once per ep, not per candidate
    memo = derived_memo(a)
    key = ("_local", ep)
    if memo.get(key) is None:
        memo[key] = _local_architecture(a, ep)
    return memo[key]


def _local_architecture(a: Architecture, ep: int) -> Architecture:
    data = a.model_dump()
    data["num_experts"] = a.num_experts // ep if a.num_experts else 0
    if a.layers:
        for layer in data["layers"]:
            if layer["mlp"]["num_experts"]:
                layer["mlp"]["num_experts"] //= ep
                # the router still scores every expert: keep its width by the expert count's
                # groups where routing is group-limited (DeepSeek n_group must divide experts)
                if layer["mlp"].get("groups") and layer["mlp"]["num_experts"] % layer["mlp"]["groups"]:
                    layer["mlp"]["groups"] = 0
                    layer["mlp"]["groups_kept"] = 0
    return Architecture.model_validate(data)


# localize's local models by (the model's and the architecture's identities, ep), both kept beside the
# answer so that an identity is never reused while its entry stands
_LOCAL_MODELS: dict[tuple, tuple] = {}


def localize(setup, textbook_states):
    """(the setup as one rank of the ep group sees the model, items to add to every phase, the
    transient of one all-to-all). ``textbook_states``: planner.memory.orchestrator.textbook_states (passed in,
    memory imports this module).

    The frameworks then count the local model: replicated states shrink by the other ranks'
    experts, as they do. A state the strategy shards over the data-parallel ranks does not: the
    routed experts are sharded over the expert-data-parallel group (dp_shard * cp / ep, torchtitan
    parallel_dims ``efsdp``; DeepSpeed's expert data-parallel group), so each rank still holds
    1 / (dp_shard * cp) of them; that share is added back, with the router's columns for the other
    ranks' experts (replicated: every rank scores every expert)."""
    from planner.schema import MemoryItem

    a, ep = setup.arch, setup.dims.ep
    if getattr(setup, "finetune", None) is not None:
        raise PlannerError(f"ep={ep} with finetune {setup.request.finetune}: expert parallelism is modelled for full "
                           "fine-tuning; estimate LoRA/QLoRA without ep", field="ep")
    if setup.model.traced is not None:
        raise PlannerError(f"ep={ep}: {setup.model.name} is estimated by tracing; its experts cannot be sharded",
                           field="ep")
    local, items = _local_states(setup, textbook_states)
    tokens = setup.request.micro_batch * setup.request.seq_len
    compute = 4 if setup.recipe.compute == "fp32" else 2
    buffers = dispatch_buffers(a, tokens, compute, ep)
    transient = MemoryItem(name=f"all-to-all send and receive buffers (dispatch/combine over ep {ep}, dropless)",
                           bytes=buffers.all_to_all_bytes, component="buffers",
                           source="GShard Sec. 3.2; torchtitan 0.3 models/common/token_dispatcher.py "
                                  "AllToAllTokenDispatcher (all_to_all_single)")
    return local, list(items), transient


# _local_states' answers: the batch fields left out of the key (a setting's options share them)
_LOCAL_STATES: dict[tuple, tuple] = {}


def _local_states(setup, textbook_states):
    """(the local setup, the items localize adds back: the routed experts' sharded weights,
    optimizer states and gradients, the other ranks' router columns), once per setting: they are
    the model's states (textbook_states, the framework's resident parameters and optimizer states),
    which do not read the request's batch fields (micro_batch, gradient_accumulation: resolve
    builds the same Setup apart from its request for any of them, planner/plan/evaluate.py
    Search.resolved), so the plan's options of one setting ask once (a test compares them with a
    fresh computation at each option). The returned setup carries the request it was asked with."""
    from dataclasses import fields

    from planner.model.catalogue import ResolvedModel
    from planner.schema import MemoryItem

    a, ep = setup.arch, setup.dims.ep
    # the Setup's other fields by identity (Search.resolved's Setups of one setting share them)
    held = tuple(getattr(setup, f.name) for f in fields(setup) if f.name != "request")
    states_key = (tuple(map(id, held)),
                  setup.request.model_dump_json(exclude={"micro_batch", "gradient_accumulation"}))
    hit = _LOCAL_STATES.get(states_key)
    if hit is not None and all(x is y for x, y in zip(hit[0], held)):
        return with_fields(hit[1], request=setup.request), hit[2]
    full = expert_sharding(a, setup.psi, ep)
    local_arch = local_architecture(a, ep)
    from planner.model.architecture import parameter_count

    local_count = parameter_count(local_arch)
    # one local model per (model, its architecture, ep), as local_architecture: the plan's search
    # localizes every expert-parallel candidate of one model
    key = (id(setup.model), id(a), ep)
    hit = _LOCAL_MODELS.get(key)
    if hit is not None and hit[0] is setup.model and hit[1] is a:
        model = hit[2]
    else:
        model = ResolvedModel(name=setup.model.name, source=setup.model.source, config=setup.model.config,
                              architecture=local_arch, parameters=local_count)
        if len(_LOCAL_MODELS) > 64:
            _LOCAL_MODELS.clear()
        _LOCAL_MODELS[key] = (setup.model, a, model)
    local = with_fields(setup, model=model)
    full_states = textbook_states(setup)
    local_states = textbook_states(local)
    s = setup.strategy
    sharded = (s.shards_parameters, s.shards_gradients, s.shards_optimizer)
    # weights and optimizer states stay between steps; the sharded gradients exist from the end
    # of backward to the optimizer step (with_items puts them there). torch keeps them in the
    # weights' fp32 under the mixed recipes (frameworks/torch/v2.py), as a third of the textbook's
    # 16-bit-weight + 12-byte-state sum.
    from planner.model.architecture import parameter_numels

    def resident(of) -> dict[str, int]:
        totals: dict[str, int] = {}
        for i in of.framework.phases(of, None, parameter_numels(of.arch)).resident:
            totals[i.component] = totals.get(i.component, 0) + i.bytes
        return totals

    full_resident, local_resident = resident(setup), resident(local)
    back = {c: full_resident.get(c, 0) - local_resident.get(c, 0) if on else 0
            for c, on in (("parameters", s.shards_parameters), ("optimizer_states", s.shards_optimizer))}
    grads_back = full_states[1] - local_states[1] if s.shards_gradients else 0
    if setup.framework.weights_are_master and setup.recipe.master_bits:
        grads_back *= 2
    router = full.parameters_per_rank - local_count
    if setup.dims.pp > 1:
        # a pipeline rank holds its stages' MoE blocks only: the add-back is that share of the
        # model's routed experts (the most any rank holds, so no rank is under-counted)
        share = pipeline_expert_share(a, setup.dims.pp, setup.request.pp_virtual_stages,
                                      setup.request.pp_first_stage_layers, setup.request.pp_last_stage_layers)
        back = {c: int(v * share) for c, v in back.items()}
        grads_back, router = int(grads_back * share), int(router * share)
    router_bytes = sum(f * router // max(1, setup.psi) for f, on in zip(full_states, sharded) if not on) \
        if setup.psi else 0
    # each in its own component, as the verify run attributes the rank's tensors (weights vs the
    # optimizer's states): one item of both read 4.7 MB of weights as optimizer states
    items = [MemoryItem(name=f"routed experts' sharded {what} over the expert-data-parallel group (ep {ep})",
                        bytes=int(back[component]), component=component,
                        source="torchtitan parallel_dims efsdp mesh; DeepSpeed expert data-parallel group")
             for component, what in (("parameters", "weights"), ("optimizer_states", "optimizer states"))] + [
             MemoryItem(name="router columns of the other ranks' experts (replicated)", bytes=int(max(0, router_bytes)),
                        component="parameters", source="the gate scores every expert on every rank")]
    items.append(MemoryItem(name=f"routed experts' sharded gradients over the expert-data-parallel group (ep {ep})",
                            bytes=int(grads_back), component="gradients", source="after backward, until the step"))
    items = tuple(i for i in items if i.bytes > 0)
    if len(_LOCAL_STATES) > 256:
        _LOCAL_STATES.clear()
    _LOCAL_STATES[states_key] = (held, local, items)
    return local, items


def pipeline_expert_share(a: Architecture, pp: int, virtual_stages: int, first: int | None,
                          last: int | None) -> float:
    """The largest share of the model's MoE blocks one pipeline rank holds (its stages' blocks,
    planner/parallel/pipeline.py stage_bounds)."""
    moe = set(moe_blocks(a))
    if not moe:
        return 0.0
    bounds = stage_bounds(a.num_layers, pp * virtual_stages, first, last)
    per_rank = [sum(1 for k in range(rank, len(bounds), pp) for i in range(*bounds[k]) if i in moe)
                for rank in range(pp)]
    return max(per_rank) / len(moe)


def with_items(plan, items, transient):
    """The plan with the add-back items in every phase and between steps, and one all-to-all's
    buffers on top at every block's backward (where the combine's backward all-to-all runs)."""
    from dataclasses import replace as dc_replace

    from planner.schema import Phase

    kept_between = _kept_between(items)
    phases = []
    for p in plan.phases:
        kept = [i for i in p.items + _added(items, transient, p.kind) if i.bytes > 0]
        phases.append(Phase(name=p.name, bytes=sum(i.bytes for i in kept), items=kept, kind=p.kind))
    resident = list(plan.resident) + kept_between
    notes = list(plan.notes) + ["expert parallelism: each rank holds num_experts / ep routed experts of every MoE "
                                "block; routing dropless (the mean tokens per expert: a step's imbalance is data)"]
    return dc_replace(plan, phases=phases, resident=resident,
                      resident_bytes=plan.resident_bytes + sum(i.bytes for i in kept_between), notes=notes)


def _kept_between(items) -> list:
    """The add-back items with_items keeps between steps: all but the gradients (they exist from the
    end of backward to the optimizer step)."""
    return [i for i in items if i.component != "gradients"]


def kept_between_bytes(items) -> int:
    """What with_items adds to the resident bytes."""
    return sum(i.bytes for i in _kept_between(items))


def _added(items, transient, kind) -> list:
    """The items with_items adds to a phase of this kind: the add-back items (the gradients only once
    they exist), and one all-to-all's buffers where the all-to-alls run."""
    extra = [i for i in items if i.component != "gradients" or kind in _GRADIENTS_EXIST]
    return extra + ([transient] if transient is not None and transient.bytes and kind in _ALL_TO_ALLS else [])


# the all-to-alls run inside the MoE blocks (forward, and backward from each block's start), never at
# the loss: START_OF_BACKWARD is the loss's backward, with every block's saved set
_ALL_TO_ALLS = (PhaseKind.START_OF_BLOCK, PhaseKind.BACKWARD)
_GRADIENTS_EXIST = (PhaseKind.END_OF_BACKWARD, PhaseKind.GRADIENT_ALLREDUCE, PhaseKind.OPTIMIZER_STEP)


def added_bytes(items, transient, kind) -> int:
    """The bytes with_items adds to a phase of this kind whose own items all hold bytes (a phase
    keeps those only: planner/memory/buffers.py phase): its new total less its old."""
    return sum(i.bytes for i in _added(items, transient, kind) if i.bytes > 0)


def data_parallel_share(a: Architecture, dims, parameters: int) -> float:
    """The fraction of a data-parallel ring's time that remains under ep: the dense parameters
    still ring over all dp_shard * cp ranks, the routed experts over the expert-data-parallel group
    (dp_shard * cp / ep ranks, each with 1/ep of them; nothing at one rank), each ring moving
    (n-1)/n of its payload (the measured all-gathers of the ep 2 run: the dense 38% only)."""
    routed = routed_total(a)
    group = dims.dp_shard * dims.cp
    if dims.ep == 1 or not routed or parameters <= 0 or group <= 1:
        return 1.0
    efsdp = group // dims.ep
    whole = parameters * (group - 1) / group
    return ((parameters - routed) * (group - 1) / group + routed / dims.ep * (efsdp - 1) / efsdp) / whole


def expert_volumes(a: Architecture, setup: Setup, rows: list[dict], parameters: int) -> list[dict]:
    """The data-parallel rows of collective_volumes under ep, and the all-to-alls.

    A data-parallel collective carries the dense parameters over its group and the routed experts
    over the expert-data-parallel group only (dp_shard * cp / ep ranks holding the same experts:
    torchtitan's efsdp mesh; a one-rank group sends nothing, as measured: FSDP2 over one rank
    gathered and reduced only the dense 38% of the qwen3_moe run); the dispatch and combine
    payloads are the routed pairs' hidden states (what the rank's all_to_all_single sends,
    its own share included)."""
    dims, request = setup.dims, setup.request
    routed = routed_total(a)
    if dims.ep == 1 or not routed or parameters <= 0:
        return rows
    efsdp = dims.dp_shard * dims.cp // dims.ep
    dense_share, expert_share = (parameters - routed) / parameters, routed / dims.ep / parameters
    out = []
    for row in rows:
        out.append(dict(row, bytes_per_step=int(row["bytes_per_step"] * dense_share)))
        if efsdp > 1:
            out.append(dict(row, what=f"{row['what']} (routed experts)",
                            bytes_per_step=int(row["bytes_per_step"] * expert_share), group="expert data-parallel"))
    compute = setup.recipe.compute_bytes  # the hidden states in the compute dtype
    tokens = request.micro_batch * request.seq_len
    m = next(spec.mlp for spec in layer_specs(a) if spec.mlp.is_moe)
    one = tokens * m.experts_per_token * a.hidden_size * compute
    calls = all_to_alls_per_block(request.checkpointing) * len(moe_blocks(a)) * request.gradient_accumulation
    out.append({"what": "expert dispatch/combine all-to-alls", "bytes_per_step": calls * one, "message_bytes": one,
                "group": "expert parallel"})
    return out
