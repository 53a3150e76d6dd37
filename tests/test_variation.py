"""The slowest GPU of a synchronous step (planner/time/variation.py)."""

import math

import pytest

from planner.schema import EstimateRequest
from planner.time import variation
from planner.time.step import SLOWEST_GPU_TERM, estimate_with_time


def test_expected_maximum_of_normals_matches_the_closed_forms():
    assert variation.expected_max_normal(1) == 0.0
    # E[max of 2] = 1/sqrt(pi), of 3 = 3/(2 sqrt(pi)) (order statistics of the normal)
    assert variation.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-5)
    assert variation.expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-5)
    # Harter's table: 1.42360 for 8, 3.04 for 512 (Blom's approximation 3.04)
    assert variation.expected_max_normal(8) == pytest.approx(1.42360, abs=1e-4)
    assert variation.expected_max_normal(512) == pytest.approx(3.04, abs=0.01)


def test_the_spread_reads_back_as_one_nodes_five_percent():
    # the expected range of eight GPUs (twice the expected maximum) is the 5% Bekman saw on one node
    assert 2 * variation.expected_max_normal(8) * variation.SPEED_SIGMA == pytest.approx(variation.NODE_SPREAD)
    shares = [variation.slowest_share(n) for n in (1, 2, 8, 64, 512, 16384)]
    assert shares[0] == 0.0 and shares == sorted(shares) and len(set(shares)) == len(shares)
    assert shares[2] == pytest.approx(0.025) and shares[-1] < 0.075  # slow growth: sqrt(2 ln N)


def _request(gpus: int, nodes: int = 1, gpu: str = "h100-80gb") -> EstimateRequest:
    return EstimateRequest(model="llama-3-8b", gpu=gpu, gpus=gpus, nodes=nodes, strategy="fsdp", seq_len=4096,
                           micro_batch=1, gradient_accumulation=1, precision="bf16-mixed", checkpointing="full")


def _terms(result) -> dict[str, float]:
    return {t.name: t.seconds for t in result.time.terms}


def test_every_rank_waits_for_the_slowest_gpus_clock_bound_kernels():
    one = _terms(estimate_with_time(_request(1)))
    assert one.get(SLOWEST_GPU_TERM, 0.0) == 0.0  # alone, a GPU waits for nobody (a zero term is not listed)
    for gpus, nodes in ((8, 1), (8, 16)):
        result = estimate_with_time(_request(gpus, nodes))
        terms = _terms(result)
        clocked = terms["matmul"] + terms["attention"]
        recompute = next(v for k, v in terms.items() if k.startswith("recompute"))
        share = variation.slowest_share(gpus * nodes)
        # the GEMMs and attention, the recompute's included (full: all of them but its elementwise rerun)
        assert clocked * share < terms[SLOWEST_GPU_TERM] < (clocked + recompute) * share
        source = next(t.source for t in result.time.terms if t.name == SLOWEST_GPU_TERM)
        assert f"{gpus * nodes:,} GPUs" in source
    assert _terms(estimate_with_time(_request(8, 16)))[SLOWEST_GPU_TERM] > _terms(
        estimate_with_time(_request(8, 1)))[SLOWEST_GPU_TERM]
