"""The framework registry (planner/frameworks/): one module per framework version answers every
strategy's phases, collectives, offload rules and launch settings."""

import pytest

from planner.errors import PlannerError
from planner.frameworks import framework, framework_of, version_for
from planner.memory.orchestrator import resolve
from planner.plan.emit import estimate_request_for
from planner.plan.search import plan
from planner.schema import EstimateRequest, PlanRequest
from planner.strategies import STRATEGIES, strategy


def test_registry_keyed_by_name_and_version():
    assert (framework("deepspeed").name, framework("deepspeed").version) == ("deepspeed", "0.19.8")
    assert framework("deepspeed", "0.19.8") is framework("deepspeed")
    assert (framework("torch").name, framework("torch").version) == ("torch", "2.13")
    with pytest.raises(PlannerError, match=r"deepspeed 0\.12\.0 is not modelled; choose from 0\.19\.8"):
        framework("deepspeed", "0.12.0")


@pytest.mark.parametrize("name, expected", [
    ("ddp", None), ("fsdp", "FULL_SHARD"), ("fsdp-grad-op", "SHARD_GRAD_OP"), ("hsdp", "HYBRID_SHARD"),
    ("zero0", None), ("zero3", None)])
def test_fsdp_sharding_map_is_one_place(name, expected):
    s = strategy(name)
    assert framework_of(s).fsdp_sharding(s) == expected


@pytest.mark.parametrize("name", STRATEGIES)
def test_offload_options_the_plan_tries_are_accepted(name):
    s = strategy(name)
    fw = framework_of(s)
    for optimizer, params in fw.offload_options(s):
        fw.check_offload(s, optimizer, params)  # raises if the search tried what the estimate refuses


def test_worker_settings_carry_the_sharding_and_the_ds_config(tmp_path):
    pytest.importorskip("torch")
    from backend.launch import worker_job

    job = worker_job(EstimateRequest(model="gpt2", strategy="fsdp-grad-op", gpus=2, gpu="cpu", seq_len=512), steps=1,
                     warmup_steps=0, out_dir=tmp_path)
    assert job.framework == "torch" and job.torch.sharding == "SHARD_GRAD_OP"  # a typed VerifyJob
    job = worker_job(EstimateRequest(model="gpt2", strategy="zero2", gpus=2, gpu="cpu", seq_len=512), steps=1,
                     warmup_steps=0, out_dir=tmp_path)
    assert job.framework == "deepspeed" and job.ds_config["zero_optimization"]["stage"] == 2
    assert job.ds_config["optimizer"]["params"]["torch_adam"] is True


def test_setup_names_its_framework():
    assert resolve(EstimateRequest(model="gpt2", strategy="hsdp", gpus=2, nodes=2)).framework.name == "torch"
    assert resolve(EstimateRequest(model="gpt2", strategy="zero1", gpus=2)).framework.launch.program == "deepspeed"


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_phase_has_a_kind(name):
    from planner.memory.orchestrator import estimate
    from planner.memory.moments import PhaseKind

    shard = {"hsdp_shard_size": 2} if name == "hsdp" else {}
    gpus = 1 if name == "single" else 4  # one device, no framework
    result = estimate(EstimateRequest(model="gpt2", strategy=name, gpus=gpus, **shard))
    kinds = [p.kind for p in result.phases]
    assert None not in kinds and kinds[0] is PhaseKind.RESIDENT and kinds[-1] is PhaseKind.OPTIMIZER_STEP
    assert PhaseKind.START_OF_BACKWARD in kinds and PhaseKind.END_OF_BACKWARD in kinds
    assert "kind" not in result.model_dump()["phases"][0]  # display names only in the output


def test_torch_bf16_pure_keeps_adamw_states_in_bf16():
    """torch.optim.AdamW's exp_avg and exp_avg_sq are zeros_like the parameters: under torch's
    bf16-pure (the model cast to bf16) 2 x 2 bytes per parameter, sharded by FSDP2 (measured:
    llama-fsdp-bf16pure-t512, 9,998,848 B of states on each of 2 ranks); fp32 under the mixed recipe."""
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest
    from tests.real_runs import LLAMA

    def states(strategy):
        r = estimate(EstimateRequest(model_config=LLAMA, strategy=strategy, precision="bf16-pure", gpus=2, gpu="cpu"))
        return r.per_device.optimizer_states_bytes, r.parameters

    fsdp, psi = states("fsdp")
    assert fsdp == 2 * 2 * psi // 2
    ddp, _ = states("ddp")
    assert ddp == 2 * 2 * psi
    mixed = estimate(EstimateRequest(model_config=LLAMA, strategy="ddp", precision="bf16-mixed", gpus=2, gpu="cpu"))
    assert mixed.per_device.optimizer_states_bytes == 12 * psi  # the ZeRO paper's K: fp32 master + fp32 moments


def test_zero3_gathers_what_it_partitions_once_per_reuse():
    """ZeRO-3's forward gathers every partitioned parameter (the persistent small ones too: their
    updated partitions after a step); its backward gathers again what forward released, all but
    the parameters under stage3_param_persistence_threshold, unless the whole model is within
    stage3_max_reuse_distance (then nothing is released: the memory model's _zero3_gathered). The
    tiny llama's verify run (4 CPU ranks) gathered 10.00 MB in one step, the whole model once in
    bf16, where two passes over it (20 MB) were modelled."""
    from planner.model.architecture import parameter_numels
    from planner.time.step import collective_volumes
    from tests.real_runs import LLAMA

    def gathers(request):
        return next(c["bytes_per_step"] for c in collective_volumes(request) if c["what"] == "parameter all-gathers")

    tiny = EstimateRequest(model_config=LLAMA, strategy="zero3", gpus=4, gpu="cpu", seq_len=128)
    assert gathers(tiny) == 2 * sum(parameter_numels(resolve(tiny).arch))  # bf16, once
    big = EstimateRequest(model="llama-3-8b", strategy="zero3", gpus=8)
    numels = parameter_numels(resolve(big).arch)
    persistent = sum(n for n in numels if n <= 100_000)
    assert sum(numels) > 1_000_000_000 and persistent == (2 * 32 + 1) * 4096  # the norms
    assert gathers(big) == 2 * (2 * sum(numels) - persistent)
    assert gathers(big.model_copy(update={"max_reuse_distance": 10**10})) == 2 * sum(numels)


def test_a_request_names_a_framework_version_exactly_or_by_its_prefix():
    ds = framework("deepspeed")
    assert framework("deepspeed", "0.19.8") is ds and framework("deepspeed", "0.19") is ds
    assert framework_of(strategy("fsdp"), "2") is framework("torch", "2.13")
    setup = resolve(EstimateRequest(model="gpt2", strategy="zero2", gpus=2, seq_len=512, framework_version="0.19"))
    assert setup.framework is ds


@pytest.mark.parametrize("version", ["0.20", "0.1", "0.19.80"])
def test_an_unmodelled_framework_version_is_refused_with_the_choices(version):
    with pytest.raises(PlannerError, match=f"deepspeed {version} is not modelled; choose from 0.19.8") as caught:
        resolve(EstimateRequest(model="gpt2", strategy="zero3", gpus=2, seq_len=512, framework_version=version))
    assert caught.value.field == "framework_version"


def test_the_cli_refuses_an_unmodelled_framework_version_in_one_line(capsys):
    from cli.main import main

    code = main(["estimate", "--model", "gpt2", "--strategy", "fsdp", "--framework-version", "3.0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--framework-version" in err and "torch 3.0 is not modelled; choose from 2.13" in err


def test_a_plan_names_a_framework_version_that_applies_to_that_frameworks_candidates():
    assert version_for(strategy("zero3"), "0.19") == "0.19" and version_for(strategy("fsdp"), "0.19") is None
    assert version_for(strategy("fsdp"), "2") == "2" and version_for(strategy("zero1"), None) is None
    req = PlanRequest(model="gpt2", gpus=2, seq_len=512, framework_version="0.19")
    result = plan(req)
    by_framework = {strategy(c.strategy).framework: c for c in result.candidates}
    assert {"deepspeed", "torch"} <= set(by_framework)
    assert estimate_request_for(req, by_framework["deepspeed"]).framework_version == "0.19"
    assert estimate_request_for(req, by_framework["torch"]).framework_version is None


@pytest.mark.parametrize("version", ["0.20", "3", "2.13.1"])
def test_a_plan_refuses_an_unmodelled_framework_version_naming_the_field_and_the_choices(version):
    with pytest.raises(PlannerError, match=f"framework_version {version} is not modelled; choose from "
                                           "deepspeed 0.19.8, torch 2.13") as caught:
        plan(PlanRequest(model="gpt2", gpus=2, seq_len=512, framework_version=version))
    assert caught.value.field == "framework_version"


def test_a_framework_version_reaches_the_time_model_and_the_plans_offload_options(monkeypatch):
    # a DeepSpeed version that overlaps nothing and offers no offload, registered for this test only:
    # the estimate's step time and the plan's candidates must follow the request's version
    from planner.frameworks import base
    from planner.plan.settings import offload_options
    from planner.time.step import estimate_with_time

    current = framework("deepspeed")

    class NoOverlap(type(current)):
        version = "0.99.0"

        def overlap_windows(self, s, forward, backward):
            return 0 * forward, 0 * backward

        def offload_options(self, s):
            return [("none", "none")]

    monkeypatch.setitem(base._REGISTRY, ("deepspeed", "0.99.0"), NoOverlap())
    request = dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, strategy="zero3", seq_len=2048, micro_batch=1)
    default = estimate_with_time(EstimateRequest(**request)).time
    chosen = estimate_with_time(EstimateRequest(**request, framework_version="0.99")).time
    assert chosen.exposed_communication_seconds > default.exposed_communication_seconds
    assert chosen.step_seconds > default.step_seconds
    plan = dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, seq_len=2048, global_batch=64)
    chosen, default = PlanRequest(**plan, framework_version="0.99"), PlanRequest(**plan)
    assert offload_options("zero3", chosen) == [("none", "none")]
    assert len(offload_options("zero3", default)) > 1
    assert offload_options("fsdp", chosen) == offload_options("fsdp", default)  # a DeepSpeed version: torch's default
