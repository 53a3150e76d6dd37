"""Invariants of the memory model (hypothesis)."""

from hypothesis import given, settings, strategies as st

from planner.memory.orchestrator import estimate
from planner.recipes.optimizers import OPTIMIZERS
from planner.schema import EstimateRequest

MODELS = st.sampled_from(["gpt2", "llama-3.2-1b", "qwen2.5-0.5b", "mistral-7b-v0.1", "mixtral-8x7b", "gemma-2-9b"])
PRECISION = st.sampled_from(["bf16-mixed", "fp16-mixed", "fp32"])
# every optimizer both DeepSpeed and FSDP2 run (Muon and Adafactor are refused under one of them:
# tests/test_optimizers.py)
OPTIMIZER = st.sampled_from([name for name, spec in OPTIMIZERS.items() if not spec.whole_matrices and spec.steps_dtensors])
GPUS = st.sampled_from([1, 2, 4, 8])


def states(r):
    d = r.per_device
    return d.parameters_bytes + d.gradients_bytes + d.optimizer_states_bytes


def est(**kw):
    kw.setdefault("gpu", "h200")
    return estimate(EstimateRequest(**kw))


@settings(max_examples=60, deadline=None)
@given(MODELS, PRECISION, OPTIMIZER, GPUS, st.integers(1, 8))
def test_sharding_more_never_increases_model_states(model, precision, optimizer, gpus, nodes):
    order = ["zero0", "zero1", "zero2", "zero3"]
    values = [states(est(model=model, strategy=s, gpus=gpus, nodes=nodes, precision=precision,
                         optimizer=optimizer)) for s in order]
    assert values == sorted(values, reverse=True)
    assert states(est(model=model, strategy="fsdp", gpus=gpus, nodes=nodes, precision=precision,
                      optimizer=optimizer)) <= states(est(model=model, strategy="ddp", gpus=gpus, nodes=nodes,
                                                          precision=precision, optimizer=optimizer))


@settings(max_examples=60, deadline=None)
@given(MODELS, PRECISION, st.integers(1, 64), st.integers(1, 64))
def test_more_gpus_never_increase_zero3_model_states(model, precision, a, b):
    small, large = sorted((a, b))
    assert states(est(model=model, strategy="zero3", gpus=large, precision=precision)) <= \
        states(est(model=model, strategy="zero3", gpus=small, precision=precision))


@settings(max_examples=60, deadline=None)
@given(MODELS, PRECISION, GPUS, st.sampled_from(["zero1", "zero2", "zero3"]), st.sampled_from(["cpu", "nvme"]))
def test_offload_never_increases_device_bytes(model, precision, gpus, strategy, device):
    base = est(model=model, strategy=strategy, gpus=gpus, precision=precision)
    off = est(model=model, strategy=strategy, gpus=gpus, precision=precision, offload_optimizer=device)
    assert states(off) <= states(base)
    assert off.per_device.peak_bytes <= base.per_device.peak_bytes
    assert off.per_device.resident_bytes <= base.per_device.resident_bytes
    if strategy == "zero3":
        both = est(model=model, strategy=strategy, gpus=gpus, precision=precision, offload_optimizer=device,
                   offload_params=device)
        assert both.per_device.peak_bytes <= off.per_device.peak_bytes


@settings(max_examples=40, deadline=None)
@given(MODELS, PRECISION, GPUS, st.sampled_from([1, 2, 4]), st.sampled_from([256, 1024, 4096]))
def test_checkpointing_never_increases_activations_and_longer_sequences_never_decrease_them(
        model, precision, gpus, micro, seq):
    full = est(model=model, strategy="zero3", gpus=gpus, precision=precision, micro_batch=micro, seq_len=seq,
               checkpointing="full")
    none = est(model=model, strategy="zero3", gpus=gpus, precision=precision, micro_batch=micro, seq_len=seq)
    assert full.per_device.peak_bytes <= none.per_device.peak_bytes
    longer = est(model=model, strategy="zero3", gpus=gpus, precision=precision, micro_batch=micro, seq_len=2 * seq)
    assert longer.per_device.peak_bytes >= none.per_device.peak_bytes
