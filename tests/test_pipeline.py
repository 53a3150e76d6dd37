"""Pipeline parallelism: the schedule arithmetic against torch 2.13's own schedules, the stage
split, the expert sharding, and the refusals (issue 12)."""

from types import SimpleNamespace

import pytest

from planner.errors import PlannerError
from planner.pipeline import bubble_fraction, check_schedule, max_in_flight, rank_actions, stage_bounds


def _torch_order(actions) -> list[tuple[int, str, int]]:
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [(a.stage_index, kinds[a.computation_type.name], a.microbatch_index)
            for a in actions if a is not None and a.computation_type.name in kinds]


def _mine(schedule, pp, v, m, rank):
    return [(a.stage, a.kind, a.micro_batch) for a in rank_actions(schedule, pp, v, m, rank)]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16, 24])
def test_interleaved_order_is_torchs(pp, v, m):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rounds = max(1, m // pp)
    if m % rounds:
        with pytest.raises(PlannerError, match=f"multiple of max\\(1, gradient_accumulation // pp\\({pp}\\)\\) = {rounds}"):
            check_schedule(pp, "interleaved", v, m, pp * v)
        return
    fake = SimpleNamespace(n_local_stages=v, _n_microbatches=m, pp_group_size=pp, microbatches_per_round=m // rounds)
    for rank in range(pp):
        expected = _torch_order(schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank))
        assert _mine("interleaved", pp, v, m, rank) == expected


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 6), (8, 9)])
def test_gpipe_order_is_torchs(pp, m):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    gpipe = schedules.ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    for rank in range(pp):
        assert _mine("gpipe", pp, 1, m, rank) == _torch_order(gpipe[rank])


def test_1f1b_order_is_what_torch_runs():
    # Schedule1F1B._step_microbatches (what runs; its _get_pipeline_order IR is for display and
    # puts the first steady forward before the first backward): min(m, pp - stage) forwards, then
    # one backward and one forward, then the cool-down backwards
    assert _mine("1f1b", 4, 1, 6, 0) == [(0, "F", 0), (0, "F", 1), (0, "F", 2), (0, "F", 3), (0, "B", 0), (0, "F", 4),
                                         (0, "B", 1), (0, "F", 5), (0, "B", 2), (0, "B", 3), (0, "B", 4), (0, "B", 5)]
    assert _mine("1f1b", 4, 1, 6, 3) == [(3, "F", 0), (3, "B", 0), (3, "F", 1), (3, "B", 1), (3, "F", 2), (3, "B", 2),
                                         (3, "F", 3), (3, "B", 3), (3, "F", 4), (3, "B", 4), (3, "F", 5), (3, "B", 5)]


def test_micro_batches_in_flight():
    # gpipe holds every micro-batch; 1F1B min(pp - stage, m) (Schedule1F1B warmup_chunks)
    assert [max_in_flight("gpipe", 4, 1, 8, r) for r in range(4)] == [8, 8, 8, 8]
    assert [max_in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [max_in_flight("1f1b", 4, 1, 4, r) for r in range(4)] == [4, 3, 2, 1]
    # interleaved: the warm-up ((v-1) * m_round + 2 * (pp-1-rank)) plus the first 1F1B forward
    assert [max_in_flight("interleaved", 4, 2, 8, r) for r in range(4)] == [11, 9, 7, 5]
    assert max_in_flight("interleaved", 2, 2, 1, 0) == 2  # capped at m * v


def test_bubble():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(8, 32, 4) < bubble_fraction(8, 32, 1)


@pytest.mark.parametrize("args,needle", [
    ((2, "1f1b", 2, 4, 4), r"pp_virtual_stages\(2\) needs pp_schedule interleaved, got 1f1b"),
    ((4, "gpipe", 1, 4, 3), r"num_layers\(3\) is fewer than pp\(4\) \* pp_virtual_stages\(1\) = 4 stages"),
    ((2, "interleaved", 2, 4, 3), r"num_layers\(3\) is fewer than pp\(2\) \* pp_virtual_stages\(2\) = 4 stages"),
    ((4, "1f1b", 1, 2, 8), r"gradient_accumulation\(2\) micro-batches must be at least pp\(4\)"),
    ((2, "zigzag", 1, 4, 4), r"pp_schedule\('zigzag'\) is unknown"),
])
def test_schedule_refusals_name_operands(args, needle):
    with pytest.raises(PlannerError, match=needle):
        check_schedule(*args)


def test_stage_split_is_torchtitans():
    # torchtitan generate_split_points: base blocks each, the remainder one each to the middle stages
    assert stage_bounds(126, 8) == [(0, 15), (15, 31), (31, 47), (47, 63), (63, 79), (79, 95), (95, 111), (111, 126)]
    assert stage_bounds(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert stage_bounds(5, 2) == [(0, 2), (2, 5)]
    assert stage_bounds(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]


def test_pipeline_time():
    from planner.pipeline import pipeline_time

    t = pipeline_time(8.0, pp=4, micro_batches=8, virtual_stages=1, boundary_bytes=2 * 10**9 // 100,
                      link_gbps=20.0)
    assert t.compute_seconds == pytest.approx(2.0 * 11 / 8)  # 1/pp of the work, over (1 - 3/11)
    assert t.bubble_seconds == pytest.approx(2.0 * 3 / 8)
    assert t.p2p_bytes == 2 * 8 * 2 * 10**7  # m x v boundaries, forward and back
    assert t.exposed_p2p_seconds == pytest.approx(2 * 3 * 2e7 / 20e9)
    interleaved = pipeline_time(8.0, pp=4, micro_batches=8, virtual_stages=2, boundary_bytes=2 * 10**7, link_gbps=20.0)
    assert interleaved.bubble_seconds < t.bubble_seconds and interleaved.p2p_bytes == 2 * t.p2p_bytes
    assert pipeline_time(8.0, 1, 8, 1, 10**6, 20.0).compute_seconds == 8.0


def test_expert_parallel_sharding_and_all_to_all():
    from planner.architecture import from_hf_config, parameter_numels
    from planner.experts import all_to_all_bytes_per_step, all_to_all_seconds, dispatch_buffers, expert_sharding
    from tests.real_runs import DEEPSEEK_V3, LLAMA

    a = from_hf_config(dict(DEEPSEEK_V3))
    total = sum(parameter_numels(a))
    s = expert_sharding(a, total, 4)
    # 2 MoE blocks (first_k_dense_replace 1) of 8 experts x (2 x 128 x 256 gate/up + 128 x 256 down)
    assert s.moe_layers == 2 and s.routed_elements == 2 * 8 * 3 * 128 * 256
    assert s.parameters_per_rank == total - s.routed_elements * 3 // 4
    d = dispatch_buffers(a, tokens=512, compute_bytes=2, ep=4)
    assert d.all_to_all_bytes == 2 * 512 * 2 * 256 * 2 and d.saved_extra_bytes == 0
    padded = dispatch_buffers(a, tokens=512, compute_bytes=2, ep=4, capacity_factor=1.25)
    assert padded.routed_tokens == 1280 and padded.saved_extra_bytes == 256 * 256 * 2
    # dispatch + combine, forward and backward, per MoE block and micro-batch
    assert all_to_all_bytes_per_step(a, 512, 2, 4, micro_batches=2) == 4 * d.sent_bytes * 2 * 2
    assert all_to_all_seconds(10**9, 100.0, 8) == pytest.approx(0.01)
    with pytest.raises(PlannerError, match=r"num_experts\(8\) is not divisible by ep\(3\)"):
        expert_sharding(a, total, 3)
    with pytest.raises(PlannerError, match="no routed experts"):
        expert_sharding(from_hf_config(dict(LLAMA)), 1, 2)


def test_cp_under_pp_splits_the_sequence_and_shards_over_dp_shard_x_cp():
    """With pp, a cp group holds seq_len / cp tokens per rank and FSDP shards over dp_shard x cp
    (torchtitan's dp_shard_cp): cp=2 at twice the sequence is the cp=1 layout's peak plus ring
    attention's buffers, not twice the activations over unsharded states."""
    from planner.memory import estimate
    from planner.schema import EstimateRequest

    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", precision="bf16-mixed",
                  tp=2, pp=2, micro_batch=1, gradient_accumulation=4, checkpointing="full")
    base = estimate(EstimateRequest(**fields, seq_len=8192)).per_device
    split = estimate(EstimateRequest(**fields, seq_len=16384, cp=2)).per_device
    assert split.parameters_bytes == base.parameters_bytes
    assert split.optimizer_states_bytes == base.optimizer_states_bytes
    assert base.peak_bytes <= split.peak_bytes < 1.05 * base.peak_bytes


def test_sequence_parallel_shards_the_stage_boundary_over_tp():
    """Under sequence parallelism the residual stream between blocks is sequence-sharded: a
    checkpointed stage keeps 1/tp of each block input it would keep without it."""
    from planner.memory import estimate
    from planner.schema import EstimateRequest

    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", precision="bf16-mixed",
                  tp=4, pp=2, micro_batch=1, gradient_accumulation=4, checkpointing="full", seq_len=8192)
    on = estimate(EstimateRequest(**fields, sequence_parallel=True)).per_device.activations_bytes
    off = estimate(EstimateRequest(**fields, sequence_parallel=False)).per_device.activations_bytes
    assert on < off
