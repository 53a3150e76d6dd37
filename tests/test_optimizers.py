"""The optimizer registry (planner/recipes/optimizers.py) pinned to numbers derived by hand from each
library's source, its refusals, and the job files' optimizer names."""

import json

import pytest

from planner.check import job_request
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate
from planner.model.architecture import from_hf_config, parameter_numels
from planner.model.shapes import TensorShape, parameter_shapes
from planner.recipes.optimizers import OPTIMIZERS
from planner.schema import CheckRequest, EstimateRequest
from tests.real_runs import LLAMA

MLP = TensorShape((688, 256))  # a Llama down/up projection of the tiny real-run model: 176,128 values
NORM = TensorShape((256,))
EMBED = TensorShape((4096, 256), io=True)


def states(name, t, bits=32):
    return OPTIMIZERS[name].group_of(t).states(t, bits)


@pytest.mark.parametrize("name,t,bits,expected", [
    # torch 2.13 optim/adam.py _init_group: exp_avg, exp_avg_sq = zeros_like(p)
    ("adamw", MLP, 32, 2 * 4 * 176_128), ("adamw", MLP, 16, 2 * 2 * 176_128),
    # bitsandbytes 0.50 optimizer.py:502-529: uint8 states, one fp32 absmax per 256 values (688 blocks);
    # under min_8bit_size=4096 values fp32 states
    ("adamw-8bit", MLP, 32, 2 * (176_128 + 4 * 688)), ("adamw-8bit", NORM, 16, 2 * 4 * 256),
    ("adamw-paged-8bit", MLP, 16, 2 * (176_128 + 4 * 688)),
    # torchao 0.18 subclass_8bit.py zeros: codes, 688 fp32 scales, a 256-entry fp32 qmap, per state
    ("adamw-torchao-8bit", MLP, 32, 2 * (176_128 + 4 * 688 + 4 * 256)),
    # adam.py _new_buffer: under 4096 values, or not whole blocks, zeros_like(p) in the parameter's dtype
    ("adamw-torchao-8bit", NORM, 16, 2 * 2 * 256),
    ("adamw-torchao-8bit", TensorShape((100, 50)), 32, 2 * 4 * 5_000),
    # subclass_4bit.py zeros: two codes per byte, 176,128 / 128 = 1,376 fp32 scales, a 16-entry qmap
    ("adamw-torchao-4bit", MLP, 32, 2 * (88_064 + 4 * 1_376 + 4 * 16)),
    # torch 2.13 optim/_adafactor.py:100-113: row_var (688, 1) and col_var (1, 256); a vector's variance;
    # a 3-D tensor factors its last two dimensions: (8, 384, 1) and (8, 1, 256)
    ("adafactor", MLP, 32, 4 * (688 + 256)), ("adafactor", MLP, 16, 2 * (688 + 256)), ("adafactor", NORM, 32, 4 * 256),
    ("adafactor", TensorShape((8, 384, 256)), 32, 4 * (8 * 384 + 8 * 256)),
    # bitsandbytes Lion (Optimizer1State, 32 bits): one fp32 state whatever the parameter's dtype
    ("lion", MLP, 16, 4 * 176_128),
    ("sgd", MLP, 32, 0), ("sgd-momentum", MLP, 16, 2 * 176_128),  # optim/sgd.py momentum_buffer = clone(grad)
    # torch 2.13 optim/_muon.py: one momentum_buffer for a hidden matrix; the embedding and vectors go to AdamW
    ("muon", MLP, 32, 4 * 176_128), ("muon", EMBED, 32, 2 * 4 * 4096 * 256), ("muon", NORM, 32, 2 * 4 * 256),
])
def test_states_per_parameter_from_the_library_source(name, t, bits, expected):
    assert states(name, t, bits) == expected


def test_step_temporaries_from_the_library_source():
    # _muon.py on (688, 256), k = 256, fp32: the fp32 lerp, two bf16 m x n, the Gram matrix and its update
    assert OPTIMIZERS["muon"].cpu_temporaries([MLP], 32) == 4 * 176_128 + 4 * 176_128 + 4 * 256 * 256
    # _adafactor.py single-tensor loop: the previous update overlaps the next var_estimate (and a vector's
    # grad_squared lingers): matrix, vector, matrix
    assert OPTIMIZERS["adafactor"].cpu_temporaries([MLP, NORM, MLP], 32) == 4 * (256 + 176_128 + 256)
    # bitsandbytes' CPU 8-bit step: both states dequantized, the fp32 gradient, sqrt and its quotient
    assert OPTIMIZERS["adamw-8bit"].cpu_temporaries([NORM, MLP], 32) == 5 * 4 * 176_128
    assert OPTIMIZERS["sgd-momentum"].cpu_temporaries([MLP], 32) == 0
    # torchao's 4-bit step compiled on CPU: per state the unpacked uint8 codes, the scaled fp32 values,
    # the int64 binary-search codes and 1,376 fp32 block scales
    assert OPTIMIZERS["adamw-torchao-4bit"].cpu_temporaries([MLP], 32) == 2 * (176_128 * (1 + 4 + 8) + 4 * 1_376)
    # on CUDA Adafactor's foreach path builds every matrix's var_estimate at once
    assert OPTIMIZERS["adafactor"].cuda_temporaries([MLP, NORM, MLP], 16, 1) == 2 * 2 * 176_128


def test_single_tensor_adamw_copies_one_tensor_at_a_time_on_cuda():
    """torch's AdamW(foreach=False) and composer's DecoupledAdamW: exp_avg_sq.sqrt() and its quotient by
    the bias correction, for one parameter at a time; the foreach path copies the group's exp_avg_sq."""
    group = [MLP, NORM, MLP, EMBED]
    assert OPTIMIZERS["adamw-single-tensor"].cuda_temporaries(group, 32, 1) == 2 * 4 * 4096 * 256
    assert OPTIMIZERS["adamw"].cuda_temporaries(group, 32, 1) == 4 * (2 * 176_128 + 256 + 4096 * 256)
    assert states("adamw-single-tensor", MLP) == states("adamw", MLP)


def test_single_tensor_adamw_lowers_the_fsdp_step_peak():
    fields = dict(model_config=LLAMA, gpus=2, gpu="h100-80gb", strategy="fsdp", micro_batch=1, seq_len=256)
    foreach = estimate(EstimateRequest(**fields))
    loop = estimate(EstimateRequest(**fields, optimizer="adamw-single-tensor"))
    step = {p.name: p.bytes for p in foreach.phases}["optimizer step"]
    assert {p.name: p.bytes for p in loop.phases}["optimizer step"] < step
    assert loop.per_device.optimizer_states_bytes == foreach.per_device.optimizer_states_bytes
    assert any("foreach=False" in n for n in loop.notes)


def test_newton_schulz_flops():
    # five iterations of X X^T (2 k^2 l), the Gram's square (2 k^3) and its product with X (2 k^2 l)
    assert OPTIMIZERS["muon"].flops(MLP) == 5 * (4 * 256 * 256 * 688 + 2 * 256 ** 3)
    assert OPTIMIZERS["adamw"].flops(MLP) == 0


def test_shapes_account_for_every_parameter():
    arch = from_hf_config(LLAMA)
    shapes = parameter_shapes(arch)
    assert [s.numel for s in shapes] == parameter_numels(arch)
    assert shapes[0] == EMBED and shapes[-1] == EMBED  # untied: embedding first, LM head last
    assert sum(len(s.dims) == 2 and not s.io for s in shapes) == 4 * 7  # q, k, v, o, gate, up, down per block


def _request(**fields):
    return EstimateRequest(**({"model_config": LLAMA, "gpu": "cpu", "gpus": 1, "strategy": "single",
                               "micro_batch": 1, "seq_len": 64} | fields))


def test_adafactor_states_are_what_a_factored_model_keeps_and_deepspeed_cannot_factor():
    arch = from_hf_config(LLAMA)
    factored = sum(states("adafactor", t) for t in parameter_shapes(arch))
    single = estimate(_request(precision="fp32", optimizer="adafactor"))  # fp32: the weights are no master copy
    assert single.per_device.optimizer_states_bytes == factored
    # DeepSpeed steps a flat fp32 partition: a full second moment, 4 bytes per parameter (+ the fp32 master)
    zero = estimate(_request(precision="fp32", optimizer="adafactor", strategy="zero2", gpus=2))
    momentum = estimate(_request(precision="fp32", optimizer="sgd-momentum", strategy="zero2", gpus=2))
    assert zero.per_device.optimizer_states_bytes == momentum.per_device.optimizer_states_bytes


@pytest.mark.parametrize("fields,field,message", [
    ({"optimizer": "muon", "strategy": "zero2", "gpus": 2}, "optimizer", "'Param gradient must be a 2D matrix'"),
    ({"optimizer": "muon", "strategy": "hsdp", "gpus": 4, "hsdp_shard_size": 2}, "optimizer", "not for HSDP's 2-D mesh"),
    ({"optimizer": "muon", "strategy": "fsdp", "gpus": 2, "tp": 2}, "optimizer", "tp=2, offload_params=none: torch"),
    ({"optimizer": "muon", "strategy": "fsdp", "gpus": 2, "offload_params": "cpu", "offload_optimizer": "cpu"},
     "optimizer", "offloaded parameters"),
    ({"optimizer": "muon", "strategy": "zero0", "gpus": 2}, "optimizer", "ZeRO-0 steps whole matrices"),
    ({"optimizer": "adafactor", "strategy": "fsdp", "gpus": 2}, "optimizer", "DTensor refuses"),
    ({"optimizer_in_backward": True, "gradient_accumulation": 2}, "optimizer_in_backward",
     "gradients cannot accumulate over micro-batches"),
    ({"optimizer_in_backward": True, "strategy": "ddp", "gpus": 2}, "optimizer_in_backward", "unreduced gradients"),
    ({"optimizer_in_backward": True, "strategy": "zero2", "gpus": 2}, "optimizer_in_backward", "engine.step()"),
    ({"optimizer": "adamw-paged-8bit", "strategy": "fsdp", "gpus": 2, "offload_optimizer": "cpu",
      "offload_params": "cpu"}, "offload_optimizer", "paged states page between the GPU and the host"),
])
def test_compositions_refused_with_the_reason(fields, field, message):
    with pytest.raises(PlannerError, match=message) as caught:
        estimate(_request(**fields))
    assert caught.value.field == field


def test_deepspeed_offload_takes_what_its_config_names_and_a_client_optimizer_becomes_cpu_adam():
    for name in ("adamw", "lion", "sgd-momentum", "adafactor"):
        est = estimate(_request(optimizer=name, strategy="zero2", gpus=2, offload_optimizer="cpu"))
        assert est.per_device.optimizer_states_bytes == 0
    adam = estimate(_request(strategy="zero2", gpus=2, offload_optimizer="cpu"))
    client = estimate(_request(optimizer="adamw-8bit", strategy="zero2", gpus=2, offload_optimizer="cpu"))
    assert client.host == adam.host and any("DeepSpeedCPUAdam" in n for n in client.notes)


def test_unknown_optimizer_names_the_field_and_the_choices(capsys):
    from cli.main import main

    assert main(["estimate", "--model", "gpt2", "--optimizer", "adam"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer" in err and "adamw-torchao-4bit" in err and "muon" in err and len(err.strip().splitlines()) == 1


def test_step_in_backward_holds_one_gradient_not_all():
    """States-dominated (64 tokens): no moment holds all the gradients, so the peak falls; with many
    tokens the largest parameter's step runs beside the activations instead (the LM head's, after its
    backward), which can raise it: llama-single-fp32-inbwd-t256 measures that."""
    base = estimate(_request(precision="fp32"))
    hooked = estimate(_request(precision="fp32", optimizer_in_backward=True))
    step = next(p for p in hooked.phases if p.kind == "optimizer_step")
    assert not any(i.bytes for i in step.items if i.component == "gradients")
    largest = 4 * max(parameter_numels(from_hf_config(LLAMA)))
    assert all(sum(i.bytes for i in p.items if i.component == "gradients") <= largest for p in hooked.phases)
    assert hooked.per_device.peak_bytes < base.per_device.peak_bytes


# One torch.optim.Muon step on FSDP2 shards over 2 and 4 gloo ranks (torch 2.13.0), the most bytes above
# the step's start with every thread's frees counted (backend/train.py count_every_thread), each run of a
# shape seen: (m, n, parameter bits, ranks) -> peaks. They move between runs with when gloo's thread frees
# a collective's buffers. oneDNN's bf16 matmuls on CPU add a workspace the model leaves out, at most
# 99,328 bytes in these traces (an addmm's, where the transposed case peaks).
MEASURED_DTENSOR_STEP = {(256, 688, 32, 2): (1_704_960,), (256, 688, 16, 2): (1_528_832, 1_716_224),
                         (688, 256, 32, 2): (1_197_056,), (688, 256, 16, 2): (1_152_000, 1_020_928),
                         (256, 688, 32, 4): (1_238_016, 1_562_624), (256, 688, 16, 4): (1_474_560, 1_386_496),
                         (688, 256, 32, 4): (975_872, 887_812), (688, 256, 16, 4): (799_748, 799_748)}
ONEDNN_WORKSPACE = 99_328


@pytest.mark.parametrize("key", sorted(MEASURED_DTENSOR_STEP))
def test_muon_on_fsdp2_shards_holds_the_gathered_matrices(key):
    m, n, bits, world = key
    measured = max(MEASURED_DTENSOR_STEP[key])
    predicted = OPTIMIZERS["muon"].dtensor_temporaries([TensorShape((-(-m // world), n))], bits, world)
    # never under but for the CPU-only workspace, and at most a quarter over (gloo's late frees counted)
    assert measured - ONEDNN_WORKSPACE <= predicted <= 1.26 * measured
    # with a bf16 parameter, more than the whole matrix's step where X is gathered (rows <= columns)
    if m <= n and bits == 16:
        assert predicted > OPTIMIZERS["muon"].cpu_temporaries([TensorShape((m, n))], bits)


def test_muon_on_fsdp2_estimates_and_charges_its_collectives():
    from planner.time.step import estimate_with_time

    kwargs = dict(precision="bf16-mixed", gpu="h100-80gb", model_config=None, model="llama-3-8b", gpus=8,
                  strategy="fsdp", seq_len=2048)
    adamw, muon = estimate_with_time(_request(**kwargs)), estimate_with_time(_request(**kwargs, optimizer="muon"))
    assert any("15 all-gathers" in n for n in muon.notes)
    exposed = {t.name: t.seconds for t in muon.time.terms}["exposed communication"]
    assert exposed > {t.name: t.seconds for t in adamw.time.terms}["exposed communication"]


def test_muon_time_charges_newton_schulz():
    from planner.time.step import estimate_with_time

    adamw = estimate_with_time(_request(precision="bf16-mixed", gpu="h100-80gb", model_config=None,
                                        model="llama-3-8b", gpus=8, strategy="ddp", seq_len=2048))
    muon = estimate_with_time(_request(precision="bf16-mixed", gpu="h100-80gb", model_config=None,
                                       model="llama-3-8b", gpus=8, strategy="ddp", seq_len=2048, optimizer="muon"))
    assert muon.time.step_seconds > adamw.time.step_seconds


@pytest.mark.parametrize("name,optimizer", [("paged_adamw_8bit", "adamw-paged-8bit"), ("lion_32bit", "lion"),
                                            ("adamw_torch_4bit", "adamw-torchao-4bit"), ("sgd", "sgd")])
def test_hf_optim_names(name, optimizer):
    text = json.dumps({"model_name_or_path": "gpt2", "per_device_train_batch_size": 1, "optim": name})
    assert job_request(CheckRequest(files=[{"name": "args.json", "text": text}]))[1].optimizer == optimizer


def test_hf_sgd_with_momentum_and_refused_names():
    def request(**args):
        text = json.dumps({"model_name_or_path": "gpt2", "per_device_train_batch_size": 1} | args)
        return job_request(CheckRequest(files=[{"name": "args.json", "text": text}]))[1]

    assert request(optim="sgd", optim_args="momentum=0.9,nesterov=True").optimizer == "sgd-momentum"
    assert request(optim="sgd", optim_args="dampening=0.1").optimizer == "sgd"
    with pytest.raises(PlannerError, match="transformers' own Adafactor"):
        request(optim="adafactor")
    with pytest.raises(PlannerError, match="8-bit Lion"):
        request(optim="lion_8bit")


@pytest.mark.parametrize("shard", [2, 8, 7, 1000])
def test_dim0_shards_of_a_models_tensors_are_each_tensors_own(shard):
    """dim0_shards shards each shape object once and shares it among the tensors of that shape
    (planner/memory/optimizer.py _distinct_shards): the same shapes, in order, as sharding every
    tensor (fully_shard's Shard(0), rounded up), for a model's tuple and a stage's list alike."""
    from planner.memory.optimizer import dim0_shards
    from planner.model.catalogue import load_catalogue

    shapes = parameter_shapes(from_hf_config(load_catalogue()["llama-3-70b"].config))
    one_by_one = [TensorShape((-(-t.dims[0] // shard),) + t.dims[1:], t.io) for t in shapes]
    sharded = dim0_shards(shapes, shard)
    assert isinstance(sharded, tuple) and list(sharded) == one_by_one
    assert [t.numel for t in sharded] == [t.numel for t in one_by_one]
    assert len({id(t) for t in sharded}) < len(shapes) // 10  # shared: a few shapes, many tensors
    assert dim0_shards(list(shapes), shard) == one_by_one


def test_matching_answers_a_ranks_tensors_with_one_tuple():
    """matching's memo (planner/model/shapes.py _MATCHED) returns, for the same shapes and counts,
    the same tuple: each tensor whose count differs (a tensor-parallel split) as a vector, the others
    their shape; a stage's counts (another length) are vectors in a new list."""
    from planner.model.catalogue import load_catalogue
    from planner.model.shapes import matching

    shapes = parameter_shapes(from_hf_config(load_catalogue()["llama-3-8b"].config))
    split = [t.numel // 8 if t.numel > 10**6 else t.numel for t in shapes]
    first = matching(shapes, split)
    assert matching(shapes, list(split)) is first and isinstance(first, tuple)
    assert list(first) == [s if s.numel == n else TensorShape((n,)) for s, n in zip(shapes, split)]
    assert matching(shapes, [t.numel for t in shapes]) is shapes
    assert matching(shapes, [123, 456]) == [TensorShape((123,)), TensorShape((456,))]


def test_the_plan_search_weighs_muon_on_fsdp2():
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    result = plan(PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, optimizer="muon"))
    strategies = {c.strategy for c in result.candidates}
    assert strategies & {"fsdp", "fsdp-grad-op"} and not strategies & {"zero1", "zero2", "zero3", "hsdp"}
