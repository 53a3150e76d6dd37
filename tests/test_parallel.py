"""Parallel degrees (planner/parallel/dims.py): strategy names parse into dims, every refusal names its
operands, and a degree whose memory model has not landed is one line naming the field and value:
exit 2 on the CLI, 422 on the API."""

import json

import pytest

from cli.main import main
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate, resolve
from planner.parallel.dims import ModelShape, ParallelDims, check_dims, data_parallel_size, dims_for
from planner.schema import EstimateRequest


def test_dims_world_dp_and_construction_checks():
    d = ParallelDims(dp_replicate=2, dp_shard=4, tp=2, pp=3, cp=2, ep=4)
    assert d.world == 2 * 4 * 2 * 2 * 3 and d.dp == 8 and d.model_parallel == 12
    with pytest.raises(PlannerError, match=r"tp\(0\) must be an integer >= 1"):
        ParallelDims(tp=0)
    with pytest.raises(PlannerError, match=r"ep\(3\) must divide dp_shard\(4\) \* cp\(1\) = 4"):
        ParallelDims(dp_shard=4, ep=3)


@pytest.mark.parametrize("strategy, shard, expected", [
    ("ddp", None, (8, 1)), ("zero0", None, (8, 1)), ("zero1", None, (1, 8)), ("zero2", None, (1, 8)),
    ("zero3", None, (1, 8)), ("fsdp", None, (1, 8)), ("fsdp-grad-op", None, (1, 8)), ("hsdp", 2, (4, 2))])
def test_strategy_names_parse_into_dims(strategy, shard, expected):
    setup = resolve(EstimateRequest(model="gpt2", strategy=strategy, gpus=8, hsdp_shard_size=shard))
    assert (setup.dims.dp_replicate, setup.dims.dp_shard) == expected
    assert setup.dims.world == 8 and (setup.dims.tp, setup.dims.pp, setup.dims.cp, setup.dims.ep) == (1, 1, 1, 1)


def test_hsdp_two_nodes_replicates_across_nodes():
    setup = resolve(EstimateRequest(model="gpt2", strategy="hsdp", gpus=4, nodes=2))
    assert (setup.dims.dp_replicate, setup.dims.dp_shard) == (2, 4)


def test_result_carries_the_parallel_object():
    result = estimate(EstimateRequest(model="gpt2", strategy="zero2", gpus=4))
    assert result.parallel.model_dump() == {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "pp": 1, "cp": 1, "ep": 1}


def test_data_parallel_size_names_gpus_nodes_and_degrees():
    assert data_parallel_size(16, tp=2, pp=2, cp=1) == 4
    with pytest.raises(PlannerError, match=r"gpus\(6\) \* nodes\(2\) = 12 is not divisible by "
                                           r"tp\(8\) \* pp\(1\) \* cp\(1\) = 8"):
        data_parallel_size(12, tp=8, gpus=6, nodes=2)
    with pytest.raises(PlannerError, match=r"hsdp_shard_size\(3\) must divide the data-parallel size 8"):
        dims_for(True, 3, 8)


LLAMA = ModelShape(num_attention_heads=32, num_key_value_heads=8, num_layers=32, num_experts=None)


@pytest.mark.parametrize("dims, kwargs, message", [
    (ParallelDims(dp_shard=4), {}, r"dp_replicate\(1\) \* dp_shard\(4\) \* cp\(1\) \* tp\(1\) \* pp\(1\) = 4 "
                                   r"differs from gpus\(8\) \* nodes\(1\) = 8"),
    (ParallelDims(dp_shard=1, tp=8), {"model": ModelShape(num_attention_heads=12)},
     r"num_attention_heads\(12\) is not divisible by tp\(8\)"),
    (ParallelDims(dp_shard=1, tp=8), {"model": ModelShape(num_attention_heads=24, num_key_value_heads=6)},
     r"num_key_value_heads\(6\) and tp\(8\)"),
    (ParallelDims(dp_shard=1, pp=8), {"model": ModelShape(num_layers=4)},
     r"num_layers\(4\) is fewer than pp\(8\) \* pp_virtual_stages\(1\) = 8 stages"),
    (ParallelDims(dp_shard=2, pp=4), {"pp_virtual_stages": 2},
     r"pp_virtual_stages\(2\) needs a multi-stage pp_schedule \(interleaved, looped-bfs, interleaved-zb, zbv, "
     r"dualpipev\), got 1f1b"),
    (ParallelDims(dp_shard=4, cp=2), {"seq_len": 4095}, r"seq_len\(4095\) is not divisible by 2 \* cp\(2\) = 4"),
    (ParallelDims(dp_shard=8, ep=2), {"model": LLAMA}, r"ep\(2\) needs a mixture-of-experts model"),
    (ParallelDims(dp_shard=8, ep=8), {"model": ModelShape(num_experts=12)},
     r"num_experts\(12\) is not divisible by ep\(8\)"),
])
def test_validator_names_every_operand(dims, kwargs, message):
    args = {"gpus": 8, "nodes": 1, "model": LLAMA, "seq_len": 4096} | kwargs
    with pytest.raises(PlannerError, match=message):
        check_dims(dims, **args)


def test_validator_accepts_a_possible_layout():
    check_dims(ParallelDims(dp_shard=2, tp=4), gpus=8, nodes=1, model=LLAMA, seq_len=4096)
    check_dims(ParallelDims(dp_shard=2, tp=16), gpus=32, nodes=1, model=LLAMA, seq_len=4096)  # kv heads replicated
    check_dims(ParallelDims(dp_shard=1, pp=4), gpus=4, nodes=1, model=LLAMA, seq_len=4096,
               pp_virtual_stages=8, pp_schedule="interleaved")
    check_dims(ParallelDims(dp_shard=8, ep=8), gpus=8, nodes=1, model=ModelShape(num_experts=64), seq_len=4096)


def test_sequence_parallel_without_tp_is_refused(capsys):
    code = main(["estimate", "--model", "gpt2", "--sequence-parallel", "true"])
    assert code == 2 and "sequence_parallel=true needs tp > 1" in capsys.readouterr().err
    code = main(["estimate", "--model", "gpt2", "--sequence-parallel", "false", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["request"]["sequence_parallel"] is False


def test_plan_candidates_carry_the_parallel_object(capsys):
    code = main(["plan", "--model", "gpt2", "--gpus", "2", "--global-batch", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    for c in data["candidates"]:
        p = c["parallel"]
        assert p["dp_replicate"] * p["dp_shard"] * p["tp"] * p["pp"] * p["cp"] in (1, 2)
        expected_shard = 1 if c["strategy"] in ("ddp", "zero0") else p["dp_replicate"] * p["dp_shard"]
        assert p["dp_shard"] == expected_shard
