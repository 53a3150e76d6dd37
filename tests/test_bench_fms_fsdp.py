"""bench/published_fms_fsdp.py: its rows parse, each row's request is the run the README describes,
and its selective-checkpointing arithmetic is fms-fsdp's."""

import pytest

from bench.published_fms_fsdp import (FABRIC, every_for, fms_blocks, p_from_ratio, p_range, planner_blocks,
                                      predict, rows)
from planner.cluster.topology import link_rates


def test_rows_are_the_readme_table():
    data = rows()
    assert len(data) == 8
    assert {(r.model, r.gpu) for r in data} == {(m, g) for m in ("7b", "13b", "34b", "70b")
                                                 for g in ("a100_80gb", "h100_80gb")}
    assert sorted({r.line for r in data}) == [16, 17, 18, 19] and sorted({r.mfu_line for r in data}) == [27, 28, 29, 30]
    h100_70b = next(r for r in data if r.model == "70b" and r.gpu == "h100_80gb")
    assert (h100_70b.published, h100_70b.mfu, h100_70b.hfu, h100_70b.gpus) == (890, 0.38, 0.47, 96)


def test_each_row_builds_the_run_it_describes():
    for row in rows():
        req = row.request()
        assert req.gpus * req.nodes == row.gpus and req.seq_len == 4096 and req.micro_batch == 2
        assert req.strategy == ("hsdp" if row.model == "7b" else "fsdp")
        assert (req.compile, req.precision, req.reduce_dtype, req.gradient_clipping) == ("model", "bf16-mixed",
                                                                                          "compute", True)
        # the fabric gives the per-node rate the README's column names: NICs x GB/s x 8 bits
        assert req.nics_per_node * link_rates()["fabric"][req.fabric]["gbps"] * 8 == row.gbps
        assert req.checkpointing == ("none" if row.model == "7b" else "full")
        if row.model == "34b":
            assert req.model_config_["num_hidden_layers"] == 48 and req.model_config_["intermediate_size"] == 22016
    assert set(FABRIC) == {r.gbps for r in rows()}


@pytest.mark.parametrize("p,wrapped", [(0, 0), (1 / 100, 0), (1 / 5, 3), (1 / 3, 5), (1 / 2, 8), (3 / 5, 9),
                                       (2 / 3, 10), (1, 15), (5 / 3, 15), (-1, 0)])
def test_fms_blocks_counts_as_fms_fsdp_own_test(p, wrapped):
    # fms-fsdp tests/test_selective_ac.py at 5a296af: the wrapped blocks of a 15-block model
    assert fms_blocks(15, p) == wrapped


def test_p_from_the_published_ratio():
    assert p_from_ratio(0.68, 0.68) == 0.0
    assert p_from_ratio(0.55, 0.74) == 1.0  # 1.036 before the clamp
    assert abs(p_from_ratio(0.61, 0.69) - 3 * (0.69 / 0.61 - 1)) < 1e-12
    low, high = p_range(0.61, 0.69)
    assert low < p_from_ratio(0.61, 0.69) < high
    # 13b on A100: p 0.39 wraps 16 of 40 blocks; every 3 checkpoints 14, every 2 twenty
    assert fms_blocks(40, p_from_ratio(0.61, 0.69)) == 16 and every_for(40, p_from_ratio(0.61, 0.69)) == 3
    assert planner_blocks(40, 3) == 14 and planner_blocks(80, 1) == 80
    assert every_for(32, 0.0) is None


def test_a_refused_request_is_reported_not_raised():
    req = rows()[1].request().model_copy(update={"activation_offload": True})  # not modelled under compile
    tps, why, result = predict(req)
    assert tps is None and result is None and "compile" in why
