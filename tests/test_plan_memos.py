"""The plan search's memos for mixture-of-experts and multimodal models give what the unmemoized
paths give: the ep-local architecture once per (architecture, ep), the routed-expert count and MoE
block indices once per architecture, the loaded multimodal model once per model, and the optimizer
states summed per distinct shape object instead of per tensor (bench/plan_speed.py measures the
speed; these check only that nothing changed)."""

import random
from collections import Counter

import pytest

from planner.memory import optimizer
from planner.model.architecture import layer_specs, parameter_count
from planner.model.catalogue import _with_vision_once, as_loaded, catalogue_model, load_catalogue, with_vision
from planner.model.shapes import TensorShape, parameter_shapes
from planner.parallel import experts
from planner.recipes.optimizers import OPTIMIZERS

CATALOGUE = sorted(load_catalogue())


def _moe_experts(a):
    return sorted({spec.mlp.num_experts for spec in layer_specs(a) if spec.mlp.is_moe})


@pytest.mark.parametrize("name", CATALOGUE)
def test_routed_count_and_moe_blocks_equal_the_per_block_sums(name):
    a = catalogue_model(name).architecture
    if a is None:
        pytest.skip(f"{name} has no architecture")
    specs = layer_specs(a)
    assert experts.routed_total(a) == sum(experts.routed_numels(s.mlp, a.hidden_size) for s in specs)
    assert experts.moe_blocks(a) == [i for i, s in enumerate(specs) if s.mlp.is_moe]
    experts.moe_blocks(a).append(-1)  # a caller's list is its own: the memo is not changed through it
    assert experts.moe_blocks(a) == [i for i, s in enumerate(specs) if s.mlp.is_moe]


@pytest.mark.parametrize("name", CATALOGUE)
def test_the_local_architecture_is_one_instance_per_ep_equal_to_a_fresh_one(name):
    a = catalogue_model(name).architecture
    counts = _moe_experts(a) if a is not None else []
    if not counts:
        pytest.skip(f"{name} has no routed experts")
    for ep in (d for d in range(2, counts[0] + 1) if all(c % d == 0 for c in counts)):
        local = experts.local_architecture(a, ep)
        assert local is experts.local_architecture(a, ep)
        fresh = experts._local_architecture(a, ep)
        assert local == fresh and local is not fresh
        assert parameter_count(local) == parameter_count(fresh)
        assert parameter_shapes(local) == parameter_shapes(fresh)
        assert experts.routed_total(local) * ep == experts.routed_total(a)


@pytest.mark.parametrize("name", CATALOGUE)
def test_the_loaded_model_is_one_instance_per_model_equal_to_a_fresh_read(name):
    model = catalogue_model(name)
    try:
        fresh = with_vision(model)
    except Exception:  # noqa: BLE001 - a model with no vision tower: the memo must refuse alike
        with pytest.raises(Exception):
            _with_vision_once(model)
        return
    once = _with_vision_once(model)
    assert once is _with_vision_once(model)
    assert once == fresh and once.architecture == fresh.architecture
    assert as_loaded(model, include_vision=True) is once


def _per_tensor(spec, tensors, bits):
    return sum(count * spec.group_of(t).states(t, bits) for t, count in Counter(tensors).items())


@pytest.mark.parametrize("seed", range(20))
def test_states_per_shape_object_equal_states_per_tensor_on_random_shapes(seed):
    rng = random.Random(seed)
    pool = [TensorShape(tuple(rng.randint(1, 300_000 if k == 0 else 4096) for k in range(rng.randint(1, 3))),
                        io=rng.random() < 0.1) for _ in range(rng.randint(1, 12))]
    # shared objects, and equal shapes held by distinct objects (as a tensor-parallel rank's may be)
    tensors = tuple(rng.choice(pool) if rng.random() < 0.8 else TensorShape(rng.choice(pool).dims)
                    for _ in range(rng.randint(2, 2000)))
    shard = rng.randint(1, 64)
    sharded = optimizer.dim0_shards(tensors, shard)
    for name, spec in OPTIMIZERS.items():
        for bits in (16, 32):
            for ts in (tensors, sharded):
                assert optimizer.states_bytes(spec, ts, bits) == _per_tensor(spec, list(ts), bits), (name, bits)
                assert optimizer.states_bytes(spec, list(ts), bits) == _per_tensor(spec, list(ts), bits)


@pytest.mark.parametrize("name", CATALOGUE)
def test_states_per_shape_object_equal_states_per_tensor_on_every_catalogue_model(name):
    model = catalogue_model(name)
    if model.architecture is None:
        pytest.skip(f"{name} has no architecture")
    shapes = parameter_shapes(model.architecture)
    for shard in (1, 8):
        ts = optimizer.dim0_shards(shapes, shard)
        for spec in OPTIMIZERS.values():
            assert optimizer.states_bytes(spec, ts, 32) == _per_tensor(spec, list(ts), 32)


def test_localize_builds_one_local_model_per_model_and_ep_equal_to_a_fresh_one():
    from planner.memory.orchestrator import resolve, textbook_states
    from planner.model.catalogue import ResolvedModel
    from planner.schema import EstimateRequest

    model = catalogue_model("mixtral-8x7b")
    setups = [resolve(EstimateRequest(model="mixtral-8x7b", gpu="h100-80gb", gpus=8, ep=4, strategy=strategy,
                                      seq_len=1024, micro_batch=micro), model)
              for strategy, micro in (("fsdp", 1), ("fsdp", 2), ("zero2", 1))]
    locals_ = [experts.localize(s, textbook_states)[0].model for s in setups]
    assert locals_[0] is locals_[1] is locals_[2]
    a = setups[0].arch
    fresh = ResolvedModel(name=model.name, source=model.source, config=model.config,
                          architecture=experts._local_architecture(a, 4),
                          parameters=parameter_count(experts._local_architecture(a, 4)))
    assert locals_[0] == fresh


def test_a_settings_remembered_hash_is_the_dataclass_hash_and_is_not_pickled():
    """Setting remembers its hash (it keys the search's memos): the value dataclass would generate
    (the fields' tuple, so sets of settings iterate as before), equal settings equal hashes, a
    replaced field a fresh one, and the pickled state without it (a string's hash differs between
    processes)."""
    import dataclasses
    import pickle

    from planner.plan.settings import Setting

    a = Setting(8, "hsdp", "full", "none", "none", 4, 2, 1, True, 2, 1, (3, 4), "zbv", 2)
    fields = tuple(getattr(a, f.name) for f in dataclasses.fields(Setting))
    assert hash(a) == hash(fields) and hash(a) == hash(a)  # the second from the remembered value
    b = Setting(8, "hsdp", "full", "none", "none", 4, 2, 1, True, 2, 1, (3, 4), "zbv", 2)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    other = dataclasses.replace(a, checkpointing="none")
    assert "_hash" not in other.__dict__ and hash(other) == hash(fields[:2] + ("none",) + fields[3:])
    state = pickle.loads(pickle.dumps(a))
    assert "_hash" not in state.__dict__ and state == a and hash(state) == hash(a)


def test_with_fields_is_dataclasses_replace():
    """planner.setup.with_fields (the search's Setup copy with another request, model or shard
    size) is the Setup dataclasses.replace builds: equal, the same fields by identity, nothing else
    held, the original unchanged; a name that is not a field is refused, as replace refuses it."""
    import dataclasses

    from planner.memory.orchestrator import resolve
    from planner.schema import EstimateRequest
    from planner.setup import Setup, with_fields

    setup = resolve(EstimateRequest(model="llama-3-8b", strategy="hsdp", gpus=8, nodes=2, hsdp_shard_size=4, tp=2,
                                    micro_batch=1, seq_len=4096))
    request = setup.request.model_copy(update={"micro_batch": 2})
    for changes in ({"request": request}, {"shard_size": 3}, {"request": request, "world_size": 8}):
        got, expected = with_fields(setup, **changes), dataclasses.replace(setup, **changes)
        assert type(got) is Setup and got == expected and got is not setup
        assert got.__dict__.keys() == expected.__dict__.keys()
        assert all(got.__dict__[k] is expected.__dict__[k] for k in expected.__dict__)
    assert setup.request.micro_batch == 1 and setup.shard_size != 3
    with pytest.raises(TypeError, match="no field"):
        with_fields(setup, micro_batch=2)
