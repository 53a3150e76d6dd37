"""The framework's own Python on the host (planner/time/host_hooks.py): the measured figures, what they
are charged for, and when the GPU waits for them (kernels.host_exposed_seconds)."""

import json
import re

import pytest

from planner.model.catalogue import catalogue_model
from planner.model.shapes import parameter_shapes
from planner.schema import EstimateRequest
from planner.time import host_hooks
from planner.time.kernels import host_exposed_seconds
from planner.time.step import HOST_TERM, estimate_with_time


def _host_term(**fields):
    """The host's term (None: the GPU never waits, so the estimate lists no such term) and the time."""
    t = estimate_with_time(EstimateRequest(gpu="h100-80gb", gpus=8, **fields)).time
    return next((x for x in t.terms if x.name == HOST_TERM), None), t


def test_the_measurement_file_holds_each_framework_per_hooked_thing():
    data = json.loads(host_hooks.DATA.read_text())
    assert "bench/host_hooks.py" in data["source"]
    for arm, per in (("zero1", "parameter"), ("zero2", "parameter"), ("zero3", "module"), ("fsdp2", "unit")):
        assert data["frameworks"][arm]["per"] == per
        rate = host_hooks.rate(arm)
        assert rate.per == per and rate.forward_ops >= 0 and rate.backward_ops > 0 and arm in rate.source
        # the figure per hooked thing is the block's over the block's count of them
        block = data["frameworks"][arm]["backward_ops_per_block"]
        count = {"parameter": data["block_parameters"], "module": data["block_modules"], "unit": 1}[per]
        assert rate.backward_ops == pytest.approx(block / count, abs=0.06)  # each rounded apart
    # ZeRO-3's hooks run in both passes, ZeRO-1/2's on the gradients alone: their forward is noise
    assert host_hooks.rate("zero3").forward_ops > 10 * host_hooks.rate("zero2").forward_ops


def test_what_each_framework_hooks_is_counted_from_the_architecture():
    arch = catalogue_model("llama-3-8b").architecture
    # per block: q, k, v, o, gate, up, down, two norms, and the block, attention, MLP and activation modules
    assert host_hooks.hooked(arch, "module") == host_hooks.EDGE_MODULES + 32 * 13
    assert host_hooks.hooked(arch, "parameter") == len(parameter_shapes(arch))
    assert host_hooks.hooked(arch, "unit") == 33


def test_the_gpu_waits_only_for_a_pass_whose_launches_outlast_its_kernels():
    assert host_exposed_seconds(1.0, 2.0, 3.0, 6.0) == 0.0  # the host ahead in both passes
    # a host-bound forward shows its excess; the device-bound backward absorbs none of it
    assert host_exposed_seconds(4.0, 1.0, 3.0, 6.0) == pytest.approx(1.0)
    # a host-bound backward: the GPU ends with the host's last launch
    assert host_exposed_seconds(1.0, 9.0, 3.0, 6.0) == pytest.approx(1.0)
    # never less than the whole micro-batch's excess
    assert host_exposed_seconds(5.0, 5.0, 3.0, 6.0) >= 10.0 - 9.0


def test_zero3_hooks_make_a_small_model_on_short_sequences_host_bound():
    small = dict(model="gpt2", seq_len=512, micro_batch=1)
    zero3, t3 = _host_term(strategy="zero3", **small)
    ddp, td = _host_term(strategy="ddp", **small)
    assert "hooks" in zero3.source and "zero3" in zero3.source and zero3.seconds > 0
    assert ddp is None or ("hooks" not in ddp.source and ddp.seconds < zero3.seconds)
    assert t3.compute_seconds > td.compute_seconds
    fsdp, _ = _host_term(strategy="fsdp", **small)
    assert "fsdp2" in fsdp.source and 0 < fsdp.seconds < zero3.seconds


def test_a_large_model_on_long_sequences_hides_the_hooks():
    zero3, t = _host_term(model="llama-3-8b", strategy="zero3", seq_len=8192, micro_batch=1)
    assert zero3 is None  # the GPU's kernels outlast every launch and hook: no wait, no term
    assert t.step_seconds > 0


def test_zero3_reruns_its_module_hooks_with_the_recompute():
    arch = catalogue_model("gpt2").architecture
    from planner.time.step import _hook_seconds
    from planner.time.kernels import rates, recompute_shares
    from planner.cluster.gpus import load_gpus

    r = rates(load_gpus()["h100-80gb"], "bf16")

    class Settings:  # what _hook_seconds reads of the request
        fsdp_version = 2

        @staticmethod
        def framework(s):
            from planner.frameworks import framework_of
            return framework_of(s)

    class Combo:
        strategy, checkpointing_every = "zero3", None

    plain, full = Combo(), Combo()
    plain.checkpointing, full.checkpointing = "none", "full"
    f0, b0, _ = _hook_seconds(Settings, plain, arch, r)
    f1, b1, _ = _hook_seconds(Settings, full, arch, r)
    rerun = recompute_shares(arch, "full").matmul  # the blocks' share of the model's modules that rerun
    assert 0.5 < rerun <= 1 and f1 == f0 and b1 == pytest.approx(b0 + rerun * f0)


def test_lora_hooks_peft_modules_and_only_the_adapters_gradients():
    arch = catalogue_model("llama-3-8b").architecture
    adapted = 32 * 2  # q_proj and v_proj in every block
    assert host_hooks.hooked(arch, "module", adapted) == (host_hooks.hooked(arch, "module") + host_hooks.PEFT_WRAPPERS
                                                          + host_hooks.PEFT_MODULES_PER_ADAPTER * adapted)
    assert host_hooks.hooked(arch, "parameter", adapted) == 2 * adapted
    assert host_hooks.hooked(arch, "unit", adapted) == 33
    small = dict(model="qwen3-0.6b", seq_len=256, micro_batch=1)
    full, _ = _host_term(strategy="zero2", **small)
    lora, _ = _host_term(strategy="zero2", finetune="lora", **small)
    assert full is not None and "hooks" in full.source
    assert lora is None or lora.seconds < full.seconds  # a handful of adapters' gradient hooks, not every weight's
    zero3, _ = _host_term(strategy="zero3", finetune="lora", **small)
    counted = int(re.search(r"(\d+) modules' hooks", zero3.source).group(1))
    base = host_hooks.hooked(catalogue_model("qwen3-0.6b").architecture, "module")
    assert counted > base + host_hooks.PEFT_WRAPPERS  # PEFT's modules counted beside the model's


def test_the_text_says_when_a_step_is_host_bound(capsys):
    from cli.main import main

    assert main(["estimate", "--model", "qwen3-0.6b", "--gpu", "h100-80gb", "--gpus", "8", "--strategy", "zero3",
                 "--seq-len", "512", "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "host-bound: the GPU waits" in out and "modules' hooks" in out
    assert main(["estimate", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "8", "--strategy", "fsdp",
                 "--seq-len", "4096"]) == 0
    assert "host-bound" not in capsys.readouterr().out
