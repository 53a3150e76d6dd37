"""Flash attention's varlen path over a padded batch (schema attention_unpad, planner/time/kernels.py UNPAD)."""

import pytest
from pydantic import ValidationError

from planner.model.architecture import from_hf_config
from planner.cluster.gpus import load_gpus
from planner.schema import EstimateRequest, PlanRequest
from planner.time import kernels
from planner.time.kernels import UNPAD, micro_batch_terms, rates, work
from planner.time.step import HOST_TERM, estimate_with_time

# an MPT-1b-like block: 16 heads of 128, no grouped keys (bench/published_throughput.py mpt_config)
GPT2 = {"model_type": "gpt2", "n_embd": 2048, "n_head": 16, "n_layer": 24, "n_inner": 8192, "n_positions": 2048,
        "vocab_size": 50368}


def test_the_gathers_and_the_scatter_are_counted_per_layer():
    arch = from_hf_config(GPT2)
    r = rates(load_gpus()["h100-80gb"], "bf16")
    plain, flash = (work(arch, 2048, 1, 1, False, 2, False, r, unpad=u) for u in ("none", "flash-attn"))
    d, tokens, layers = 2048, 2048, 24
    # forward: q, k, v gathered (read + write) and the output scattered into zeros (zeros, read, write);
    # backward: three scatters into zeros (3 each) and the output's gradient gathered (2), bf16
    assert flash.elementwise_bytes - plain.elementwise_bytes == pytest.approx((2 * 3 * d + 3 * d) * 2 * tokens * layers)
    assert flash.elementwise_backward_bytes - plain.elementwise_backward_bytes == pytest.approx(
        (3 * 3 * d + 2 * d) * 2 * tokens * layers)
    assert flash.stall_launches == layers * (UNPAD["flash-attn"].syncs + UNPAD["flash-attn"].launches)
    assert plain.stall_launches == 0.0
    # the stalls do not grow with the micro-batch (one synchronisation per call, whatever its size); full
    # checkpointing reruns the forward's, selective-op does not rerun attention
    none = micro_batch_terms(flash, 4, r, 2, "none")
    assert none.stalls == pytest.approx(flash.stall_launches * kernels.HOST_SECONDS_PER_KERNEL)
    assert micro_batch_terms(flash, 8, r, 2, "none").stalls == none.stalls
    assert micro_batch_terms(flash, 4, r, 2, "full").stalls == pytest.approx(2 * none.stalls)
    # transformers unpads once per layer: fewer synchronisations, the same bytes
    hf = work(arch, 2048, 1, 1, False, 2, False, r, unpad="transformers")
    assert hf.elementwise_bytes == flash.elementwise_bytes and hf.stall_launches < flash.stall_launches


def test_an_unpadded_step_is_slower_and_says_why():
    base = dict(model_config=GPT2, gpu="h100-80gb", gpus=8, strategy="fsdp", seq_len=2048, micro_batch=12)
    plain = estimate_with_time(EstimateRequest(**base)).time
    flash = estimate_with_time(EstimateRequest(**base, attention_unpad="flash-attn")).time
    assert flash.step_seconds > plain.step_seconds
    wait = next(t for t in flash.terms if t.name == HOST_TERM)
    assert wait.seconds > 0 and "attention_unpad flash-attn" in wait.source
    assert not any("attention_unpad" in t.source for t in plain.terms)


@pytest.mark.parametrize("fields,named", [({"attention": "eager"}, "attention=eager"),
                                          ({"attention_kernel": "flash-attention-triton"}, "flash-attention-triton"),
                                          ({"attention_kernel": "cudnn"}, "attention_kernel=cudnn")])
def test_a_kernel_without_a_varlen_path_is_refused(fields, named):
    for schema in (EstimateRequest, PlanRequest):
        with pytest.raises(ValidationError) as caught:
            schema(model="gpt2", attention_unpad="flash-attn", **fields)
        assert "attention_unpad=flash-attn" in str(caught.value) and named in str(caught.value)


def test_a_family_timed_eager_refuses_the_varlen_path():
    from planner.errors import PlannerError

    with pytest.raises(PlannerError) as caught:
        estimate_with_time(EstimateRequest(model="gemma-2-9b", gpu="h100-80gb", attention_unpad="transformers"))
    assert caught.value.field == "attention_unpad" and "timed eager" in str(caught.value)
