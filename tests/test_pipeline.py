"""Pipeline parallelism: the schedule arithmetic against torch 2.13's own schedules, the stage
split, the expert sharding, and the refusals (issue 12)."""

from types import SimpleNamespace

import pytest

from planner.errors import PlannerError
from planner.parallel.pipeline import bubble_fraction, check_schedule, max_in_flight, rank_actions, stage_bounds


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


def _torch_split_order(actions) -> list[tuple[int, str, int]]:
    """Compute actions, an overlapped forward+backward as its sub-actions in the order the runtime runs them."""
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    out = []
    for a in actions:
        if a is None:
            continue
        for b in (a.sub_actions if a.computation_type.name == "OVERLAP_F_B" else (a,)):
            if b.computation_type.name in kinds:
                out.append((b.stage_index, kinds[b.computation_type.name], b.microbatch_index))
    return out


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 12, 16, 24])
def test_looped_and_zero_bubble_orders_are_torchs(pp, m):
    # issue 25: every rank's order of the schedules torch 2.13 adds, against its own
    # _calculate_single_rank_operations (the runtime's bubbles only insert idle slots)
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for v in (1, 2, 3):
        fake = SimpleNamespace(_stages=[None] * v, pp_group_size=pp, _n_microbatches=m)
        for rank in range(pp):
            assert _mine("looped-bfs", pp, v, m, rank) == \
                _torch_split_order(schedules.ScheduleLoopedBFS._calculate_single_rank_operations(fake, rank))
        rounds = max(1, m // pp)
        if m % rounds == 0:
            fake = SimpleNamespace(n_local_stages=v, _n_microbatches=m, pp_group_size=pp,
                                   microbatches_per_round=m // rounds)
            for rank in range(pp):
                assert _mine("interleaved-zb", pp, v, m, rank) == _torch_split_order(
                    schedules.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, rank))
    fake = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
    for rank in range(pp):
        assert _mine("zbv", pp, 2, m, rank) == \
            _torch_split_order(schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, rank))
        if m >= 2 * pp:
            assert _mine("dualpipev", pp, 2, m, rank) == \
                _torch_split_order(schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, rank))


def test_v_placement_is_torchs():
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    from planner.parallel.pipeline import rank_stages

    for pp in (2, 3, 4, 8):
        mapping = generate_rank_to_stage_mapping(pp, 2 * pp, style="v")
        assert [list(rank_stages("zbv", pp, 2, r)) for r in range(pp)] == [mapping[r] for r in range(pp)]
        assert rank_stages("interleaved-zb", pp, 2, 1) == (1, 1 + pp)


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
    # looped BFS: every micro-batch of every local stage before the first backward
    assert [max_in_flight("looped-bfs", 4, 2, 8, r) for r in range(4)] == [16] * 4
    # a split backward keeps its chunk in flight until W: ZB-H1 holds 1F1B's first rank's count on every
    # rank (Qi et al. 2024, Sec. 3.1: its peak memory is 1F1B's), ZB-V 2pp half-stage chunks on every rank
    # (the same activations: Sec. 6), DualPipeV one chunk more (DeepSeek-V3 report Table 2: PP+1)
    assert [max_in_flight("interleaved-zb", 4, 1, 8, r) for r in range(4)] == [4, 4, 4, 4]
    assert [max_in_flight("zbv", 4, 2, 8, r) for r in range(4)] == [8, 8, 8, 8]
    assert [max_in_flight("dualpipev", 4, 2, 16, r) for r in range(4)] == [9, 9, 9, 9]


def test_bubble():
    from planner.parallel.pipeline import _simulated_idle

    # the simulation in units (F = I = W = 1, B = 2) gives 1F1B's and GPipe's closed form: 3(p-1) idle units
    for pp, m in [(2, 4), (4, 8), (8, 9)]:
        assert _simulated_idle("1f1b", pp, 1, m) == 3 * (pp - 1) == _simulated_idle("gpipe", pp, 1, m)
    # ZB-H1 (torch's ScheduleInterleavedZeroBubble, one stage per rank): (p-1)(T_F + T_B - T_W) = p-1
    # units, a third of 1F1B's (Qi et al. 2024, Sec. 3.1)
    assert bubble_fraction(4, 8, 1, "interleaved-zb") == pytest.approx(3 / (3 * 8 + 3))
    # ZB-V and DualPipeV: p-1 units of half-stage chunks; too few micro-batches leave ZB-V's slots idle
    assert bubble_fraction(4, 8, 2, "zbv") == pytest.approx(3 / (3 * 16 + 3))
    assert bubble_fraction(16, 4, 2, "zbv") > 0.6
    # past 2p micro-batches the steady state adds no idle time: the extrapolation is the simulation
    for schedule, v in [("zbv", 2), ("interleaved-zb", 2), ("interleaved-zb", 1), ("dualpipev", 2)]:
        for pp in (2, 4, 8):
            assert _simulated_idle(schedule, pp, v, 8 * pp) == _simulated_idle(schedule, pp, v, 2 * pp) == pp - 1
    assert bubble_fraction(4, 8, 2, "looped-bfs") == bubble_fraction(4, 8, 2, "interleaved")
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(8, 32, 4) < bubble_fraction(8, 32, 1)


@pytest.mark.parametrize("args,needle", [
    ((2, "1f1b", 2, 4, 4), r"pp_virtual_stages\(2\) needs a multi-stage pp_schedule \(interleaved, looped-bfs, "
                           r"interleaved-zb, zbv, dualpipev\), got 1f1b"),
    ((2, "zbv", 3, 4, 8), r"pp_virtual_stages\(3\): pp_schedule zbv runs exactly 2 stages per rank \(torch's "
                          r"ScheduleZBVZeroBubble\)"),
    ((2, "dualpipev", 1, 4, 8), r"pp_virtual_stages\(1\): pp_schedule dualpipev runs exactly 2"),
    ((2, "dualpipev", 2, 3, 8), r"gradient_accumulation\(3\) micro-batches must be at least pp\(2\) \* "
                                r"pp_virtual_stages\(2\) = 4 stages for pp_schedule dualpipev"),
    ((2, "interleaved-zb", 2, 7, 8), r"gradient_accumulation\(7\) micro-batches must be a multiple of max\(1, "
                                     r"gradient_accumulation // pp\(2\)\) = 3 for pp_schedule interleaved-zb \(torch's "
                                     r"ScheduleInterleavedZeroBubble\)"),
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
    from planner.parallel.pipeline import pipeline_time

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
    from planner.model.architecture import from_hf_config, parameter_numels
    from planner.parallel.experts import all_to_all_bytes_per_step, all_to_all_seconds, dispatch_buffers, expert_sharding
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
    from planner.memory.orchestrator import estimate
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
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", precision="bf16-mixed",
                  tp=4, pp=2, micro_batch=1, gradient_accumulation=4, checkpointing="full", seq_len=8192)
    on = estimate(EstimateRequest(**fields, sequence_parallel=True)).per_device.activations_bytes
    off = estimate(EstimateRequest(**fields, sequence_parallel=False)).per_device.activations_bytes
    assert on < off


# --- stages are shares of the whole model's activations (one mechanism with TP, SP and CP) -------

def _setup_and_stages(**fields):
    from planner.memory.orchestrator import activations, resolve
    from planner.parallel.pipeline import stages
    from planner.schema import EstimateRequest

    setup = resolve(EstimateRequest(**fields))
    return setup, activations(setup), stages(setup, setup.dims.pp, setup.request.pp_virtual_stages, setup.dims.dp)


@pytest.mark.parametrize("tp,cp,sp", [(1, 1, None), (2, 1, True), (2, 1, False), (4, 1, True), (1, 2, None),
                                      (2, 2, True)])
def test_stages_add_up_to_the_whole_models_activations(tp, cp, sp):
    """Over the stages, the saved sets are the whole model's (memory.activations, with
    tp_activations and cp_activations applied), plus what the pipeline itself holds: each stage's
    RoPE tables, the outputs kept in fwd_cache (the sequence-sharded stream under SP, the last
    stage's logits). bf16-pure: a 16-bit stream, so no receive buffer doubles a block's input."""
    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", precision="bf16-pure",
                  micro_batch=1, seq_len=4096, pp=2, gradient_accumulation=4, tp=tp, cp=cp)
    if sp is not None:
        fields["sequence_parallel"] = sp
    setup, acts, cut = _setup_and_stages(**fields)
    tokens = 4096 // cp
    boundary = 2 * tokens * 4096 // (tp if setup.sequence_parallel else 1)
    logits = 2 * tokens * setup.arch.vocab_size
    assert sum(s.activation_bytes for s in cut) == (acts.saved_bytes + (len(cut) - 1) * acts.edges.rope_saved
                                                    + (len(cut) - 1) * boundary + logits)
    assert [s.output_bytes for s in cut] == [boundary, 0] and [s.input_bytes for s in cut] == [0, boundary]
    # the transients are the whole model's: loss_parallel's on the last stage, ring attention's in each block
    assert cut[-1].transient_bytes == max(acts.loss_transient_bytes, acts.layer_transient_bytes)
    assert cut[0].transient_bytes == acts.layer_transient_bytes


def test_tp_stage_shards_its_norms_and_pays_loss_parallel():
    """Under tp 2 with SP, a stage's blocks keep 1/2 of what their norms save (tp_activations), and
    the last stage's loss backward has loss_parallel's third vocab/tp tensor (measured on CPU ranks,
    tests/real_runs.py llama-tp2-pp2-fp32-sp-m4): the stage split used to leave both out."""
    from planner.parallel.tensor import loss_parallel_extra_bytes

    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", precision="bf16-pure",
                  micro_batch=1, seq_len=4096, pp=2, gradient_accumulation=4, tp=2)
    _, _, on = _setup_and_stages(**fields, sequence_parallel=True)
    setup, _, off = _setup_and_stages(**fields, sequence_parallel=False)
    tokens, h, blocks = 4096, 4096, 16
    norms = blocks * 2 * (4 * tokens * h + 2 * tokens * h + 4 * tokens) // 2  # RMSNorm's sharded share, halved
    assert off[0].activation_bytes - on[0].activation_bytes == norms + 2 * tokens * h // 2  # and the stage's output
    final = (4 * tokens * h + 2 * tokens * h + 4 * tokens) // 2
    assert off[1].activation_bytes - on[1].activation_bytes == norms + final
    assert on[1].transient_bytes == 2 * 4 * tokens * setup.arch.vocab_size + loss_parallel_extra_bytes(setup.arch, tokens)


def test_cp_stage_holds_ring_attentions_buffers():
    """A checkpointed stage under cp 2 keeps the same block inputs as the unsplit half-length
    sequence; the block it recomputes also holds ring attention's copy of the merged output, and
    its backward transient is context_parallel's (the larger of the MLP's and the ring's, which
    come after the MLP's saved tensors are freed)."""
    from planner.parallel.context import cp_activations, merged_output_copy_bytes

    fields = dict(model="llama-3.1-8b", strategy="fsdp", gpu="h100-80gb", precision="bf16-pure",
                  micro_batch=1, pp=2, gradient_accumulation=4, checkpointing="full")
    setup, acts, split = _setup_and_stages(**fields, seq_len=16384, cp=2, gpus=8)
    _, whole_acts, whole = _setup_and_stages(**fields, seq_len=8192, gpus=4)
    copy = merged_output_copy_bytes(setup.arch, 8192, 2)
    assert split[0].activation_bytes == whole[0].activation_bytes
    assert acts.layer_transient_bytes == cp_activations(whole_acts, setup.arch, cp=2, tokens=16384,
                                                        b=2).layer_transient_bytes
    assert split[0].transient_bytes == (whole[0].transient_bytes - whole_acts.layer_transient_bytes
                                        + acts.layer_transient_bytes + copy)


def test_checkpointed_stage_recomputes_its_largest_block():
    """DeepSeek-V3's first blocks are dense and the rest MoE: a stage recomputes each of its blocks in
    turn, so the transient is its largest block's saved set, not its first block's."""
    fields = dict(model="deepseek-v3", strategy="fsdp", gpus=8, gpu="h100-80gb", precision="bf16-mixed",
                  micro_batch=1, seq_len=4096, pp=2, gradient_accumulation=4, checkpointing="full")
    _, acts, cut = _setup_and_stages(**fields)
    first, last = cut[0].first_block, cut[0].last_block
    assert acts.blocks[first] < max(acts.blocks[first:last])
    assert cut[0].transient_bytes == max(acts.blocks[first:last]) + acts.layer_transient_bytes


def test_every_stage_computes_every_rope_table():
    # Gemma-3's sliding and global layers use two cos/sin tables; each stage computes both
    fields = dict(model="gemma-3-27b", strategy="fsdp", gpus=8, gpu="h100-80gb", precision="bf16-pure",
                  micro_batch=1, seq_len=4096, pp=2, gradient_accumulation=4, text_only=True)
    setup, acts, _ = _setup_and_stages(**fields)
    assert acts.edges.rope_saved == 2 * (2 * 4096 * setup.arch.head_dim * 2)


def test_uneven_split_is_megatrons_and_refused_when_the_rest_is_not_even():
    """Megatron-LM d98e8a6 transformer_block.py get_num_layers_to_build: the given first and last
    stages' blocks out, the other stages share the rest evenly, or it refuses."""
    from planner.parallel.pipeline import check_split

    assert stage_bounds(126, 16, 7, 7) == [(0, 7)] + [(7 + 8 * k, 15 + 8 * k) for k in range(14)] + [(119, 126)]
    assert stage_bounds(4, 2, 1, 3) == [(0, 1), (1, 4)]
    assert stage_bounds(10, 3, 2, None) == [(0, 2), (2, 6), (6, 10)]  # the other two share 8
    check_split(126, 16, 1, 7, 7)
    with pytest.raises(PlannerError, match=r"num_layers\(126\) - pp_first_stage_layers\(6\), pp_last_stage_layers\(7\) "
                       r"= 113 blocks do not split evenly over the other 14 of pp\(16\)"):
        check_split(126, 16, 1, 6, 7)
    with pytest.raises(PlannerError, match=r"pp_first_stage_layers\(1\), pp_last_stage_layers\(2\): the 2 stages must "
                       r"hold num_layers\(4\) blocks, not 3"):
        check_split(4, 2, 1, 1, 2)
    with pytest.raises(PlannerError, match=r"needs pp > 1"):
        check_split(4, 1, 1, 1, None)


def test_uneven_stages_in_memory_and_time():
    """Each stage holds its own blocks (the first the embedding, the last the norm and head); the
    per-device answer is the worst rank's, and the slowest stage sets the pipeline's pace."""
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest
    from planner.time.step import estimate_time

    base = dict(model="llama-3.1-8b", strategy="fsdp", gpus=8, nodes=2, micro_batch=1, seq_len=4096,
                gradient_accumulation=8, pp=2)
    even = estimate(EstimateRequest(**base))
    heavy_last = estimate(EstimateRequest(**base, pp_first_stage_layers=8, pp_last_stage_layers=24))
    assert any("first 8 and last 24, the rest even (Megatron's uneven split)" in n and "worst rank 1 (stages 1)" in n
               for n in heavy_last.notes)
    assert heavy_last.per_device.peak_bytes > even.per_device.peak_bytes
    t_even, t_heavy = (estimate_time(e.request, e) for e in (even, heavy_last))
    assert t_heavy.compute_seconds > 1.4 * t_even.compute_seconds  # 24 of 32 blocks and the head set the pace
    with pytest.raises(PlannerError, match="pp_first_stage_layers"):
        estimate(EstimateRequest(**base, pp_first_stage_layers=8, pp_last_stage_layers=8))


def test_every_rank_replayed_in_integers_matches_its_written_phases():
    """pipeline_phases writes items for the worst rank only and sums the others in integers
    (_rank_step): each rank's integer phases are the written phases' names and bytes, and its
    in-flight count is max_in_flight's."""
    from planner.memory.orchestrator import resolve
    from planner.parallel import pipeline as P
    from planner.schema import EstimateRequest

    checked = buckets = 0
    for strategy in ("fsdp", "ddp", "zero1"):
        for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
            if strategy == "zero1" and schedule != "1f1b":
                continue
            for checkpointing in ("none", "full"):
                setup = resolve(EstimateRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=4, seq_len=2048,
                                                micro_batch=1, gradient_accumulation=8, strategy=strategy, pp=4,
                                                pp_schedule=schedule, pp_virtual_stages=v,
                                                checkpointing=checkpointing))
                dp, shard = P._data_parallel_group(setup)
                all_stages = P._checked_stages(setup, 4, v, schedule, dp)
                parallel = P.data_parallel(setup, dp, shard)
                for rank in range(4):
                    step = P._rank_step(setup, all_stages, rank, 4, v, schedule, parallel)
                    resident, phases = P.rank_phases(setup, all_stages, rank, 4, v, schedule, parallel)
                    assert [(p.name, p.bytes) for p in phases] == step.phase_bytes()
                    assert step.peak() == max(step.phase_bytes(), key=lambda p: p[1])
                    # the integer resident bytes are the written items' (DDP's: with its gradient buckets)
                    written = [i for i in resident if i.component in ("parameters", "optimizer_states")
                               or "receive buffers" in i.name or "gradient buckets" in i.name]
                    assert step.resident_bytes == sum(i.bytes for i in written) > 0
                    buckets += any("gradient buckets" in i.name for i in written)
                    assert step.in_flight == max_in_flight(schedule, 4, v, 8, rank)
                    checked += 1
    assert checked == 4 * 2 * 7
    assert buckets  # a DDP rank's resident bytes counted its gradient buckets


def _replayed_worst(mine, ops, base, per_mb, sent, prev_local, grad_bytes_per, fresh_bytes_per):
    """The schedule replayed action by action, every moment recorded: what _worst_moments must equal."""
    v = len(mine)
    live, done = [0] * v, [False] * v
    worst, records = {}, 0
    held = grads = acts = count = most = pending = kept = 0

    def record(name, extra, stage):
        nonlocal records
        records += 1
        total = base + grads + acts + held + pending + extra
        if name not in worst or total > worst[name][0]:
            worst[name] = (total, (stage, tuple(live), tuple(done), held, acts, pending, extra))

    for k, kind, micro_batch in ops:
        stage = mine[k]
        if kind == "F":
            live[k] += 1
            acts += per_mb[k]
            count += 1
            most = max(most, count)
            continue
        if kind == "I" and stage.is_first:
            continue
        if kind == "I":
            record("loss input-gradient backward" if stage.is_last else "stage input-gradient backward",
                   stage.input_backward_bytes, stage)
            pending += stage.weight_grad_inputs_bytes
            acts -= stage.freed_at_input_backward
            held += sent[k]
            kept += 0 if prev_local[k] else stage.input_bytes
            continue
        if kind == "W" and not stage.is_first:
            record("weight-gradient backward", fresh_bytes_per * stage.largest_tensor if done[k] else 0, stage)
            acts -= per_mb[k] - stage.freed_at_input_backward
            pending -= stage.weight_grad_inputs_bytes
        else:
            record("loss backward" if stage.is_last else "stage backward", stage.transient_bytes, stage)
            acts -= per_mb[k]
            held += sent[k]
        live[k] -= 1
        count -= 1
        if not done[k]:
            done[k] = True
            grads += grad_bytes_per * stage.parameters
        if stage.is_first and micro_batch > 0:
            record("embedding backward (first stage)", fresh_bytes_per * stage.largest_tensor, stage)
    return worst, kept, most, records


def test_schedule_moments_equal_the_replay_of_every_action(monkeypatch):
    """_worst_moments evaluates each rank's schedule from its moments replayed once in counts, the
    repeats of a steady state dropped (or, for a schedule's first few stage bytes, by its own replay
    of every action): at any stage bytes (zeros and ties included, where the earlier moment is a
    phase's worst) both equal the replay of every action."""
    import random

    from planner.parallel import pipeline as P

    rng = random.Random(12)
    cases = records = moments = 0
    for schedule, spec in P.SCHEDULE_SPECS.items():
        for pp in (2, 3, 4):
            for v in ((spec.stages_per_rank,) if spec.stages_per_rank else (1, 2, 3)):
                for m in (1, 2, 3, 4, 6, 8, 9, 12, 16):
                    try:
                        check_schedule(pp, schedule, v, m, pp * v)
                    except PlannerError:
                        continue
                    for rank in range(pp):
                        for _ in range(3):
                            small = rng.random() < 0.5  # few distinct bytes: many ties

                            def nbytes():
                                return rng.choice((0, 1, 2, 3)) if small else rng.choice((0, rng.randrange(1, 10**9)))

                            indices = P.rank_stages(schedule, pp, v, rank)
                            mine = tuple(P.Stage(i, 0, 1, i == 0, i == pp * v - 1, nbytes(), nbytes(), nbytes(),
                                                 nbytes(), nbytes(), nbytes(), nbytes(), nbytes(), nbytes())
                                         for i in indices)
                            per_mb = [nbytes() for _ in mine]
                            sent = [nbytes() for _ in mine]
                            prev_local = [i - 1 in indices for i in indices]
                            args = (nbytes(), per_mb, sent, prev_local, rng.choice((2, 4)), rng.choice((2, 4)))
                            *expected, n = _replayed_worst(mine, P._rank_ops(schedule, pp, v, m, rank), *args)
                            for compile_after in (0, 10**9):  # from the moments; by the module's own replay
                                monkeypatch.setattr(P, "_COMPILE_AFTER", compile_after)
                                P._worst_at.cache_clear()
                                got = P._worst_moments(mine, schedule, pp, v, m, rank, *args)
                                assert (list(got[0].items()), *got[1:]) == \
                                    (list(expected[0].items()), *expected[1:]), (schedule, pp, v, m, rank, args)
                            cases += 1
                            records += n
                            moments += len(P._schedule_moments(schedule, pp, v, m, rank,
                                                               tuple(s.is_first for s in mine),
                                                               tuple(s.is_last for s in mine),
                                                               tuple(b == 0 for b in sent))[1])
    assert cases > 1000
    assert moments < records
    # a schedule with a steady state keeps as many moments at 64 micro-batches as at 16: its repeats were
    # dropped, not replayed (GPipe and the breadth-first schedule have none: all forwards, then all backwards)
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2)):
        for rank in range(4):
            indices = P.rank_stages(schedule, 4, v, rank)
            flags = (tuple(i == 0 for i in indices), tuple(i == 4 * v - 1 for i in indices), (False,) * v)
            assert len(P._schedule_moments(schedule, 4, v, 64, rank, *flags)[1]) == \
                len(P._schedule_moments(schedule, 4, v, 16, rank, *flags)[1]) < 64


def test_stage_bits_remembered_across_settings_are_each_settings_own():
    """_shared_bits remembers a stage's bits per architecture across settings: over strategies of
    both frameworks, precisions, optimizers and micro-batches asked in one order, every answer is
    the setting's own _bits (a setting input the memo's key missed would hand one setting another's)."""
    from planner.memory.orchestrator import resolve
    from planner.parallel import pipeline as P
    from planner.schema import EstimateRequest

    checked = 0
    for optimizer in ("adamw", "adamw-8bit", "sgd", "adafactor"):
        for precision in ("bf16-mixed", "bf16-pure", "fp32"):
            for strategy in ("ddp", "fsdp", "zero1"):
                for micro_batch in (1, 2):
                    try:
                        setup = resolve(EstimateRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=2,
                                                        seq_len=2048, micro_batch=micro_batch, pp=2,
                                                        gradient_accumulation=4, strategy=strategy,
                                                        precision=precision, optimizer=optimizer))
                    except PlannerError:
                        continue
                    for params in (1000, 123_456_789, 4_000_000_000):
                        assert P._shared_bits(setup, params) == P._bits(setup, params)
                        checked += 1
    assert checked >= 3 * 3 * 2 * 3 * 3


def test_resident_floor_without_the_replay_is_the_estimates():
    """pipeline_resident_bytes (the plan's floor: the stages' parameters and boundaries, no
    activations, no replay) is measure's resident bytes over schedules, strategies, precisions,
    tensor and sequence parallelism, and Megatron's uneven split (below it where the backward is split)."""
    from planner.memory.orchestrator import pipeline_resident_bytes

    checked = 0
    for schedule, strategy, extra, setup, measured in _pipeline_setups(
            (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zbv", 2), ("looped-bfs", 3)),
            ({}, {"precision": "fp32"}, {"tp": 2}, {"pp_first_stage_layers": 3}, {"micro_batch": 2, "seq_len": 1024})):
        expected = measured.resident_bytes
        floor = pipeline_resident_bytes(setup)
        # a zero-bubble rank also keeps its input gradients on the receive buffers, which
        # the floor leaves out (a bound: at most the resident bytes)
        assert floor == expected if schedule != "zbv" else floor < expected, (schedule, strategy, extra)
        checked += 1
    assert checked >= 60


def _pipeline_setups(schedules, extras):
    """(schedule, strategy, extra, setup, measure(setup)) of Llama-3-8B on 2 x 8 H100s at pp 2 over
    these schedules (name, virtual stages), the four data-parallel strategies and these request
    fields; the combinations the planner refuses are skipped."""
    from planner.memory.orchestrator import measure, resolve
    from planner.schema import EstimateRequest

    for schedule, v in schedules:
        for strategy in ("ddp", "fsdp", "hsdp", "zero1"):
            for extra in extras:
                try:
                    setup = resolve(EstimateRequest(**{
                        "model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "nodes": 2, "seq_len": 2048,
                        "micro_batch": 1, "gradient_accumulation": 8, "strategy": strategy, "pp": 2,
                        "pp_schedule": schedule, "pp_virtual_stages": v, **extra}))
                    measured = measure(setup)
                except PlannerError:
                    continue
                yield schedule, strategy, extra, setup, measured


def test_pipeline_peak_without_the_phases_is_the_estimates():
    """pipeline_peak_bytes (the plan search's judgement of a pipeline option: every rank replayed,
    the worst rank's phases not written out) is measure's peak over schedules (split backward
    included), strategies, precisions, checkpointing, tensor parallelism, Megatron's uneven split
    and micro-batch counts."""
    from planner.memory.orchestrator import pipeline_peak_bytes

    checked = 0
    for schedule, strategy, extra, setup, measured in _pipeline_setups(
            (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved-zb", 2), ("zbv", 2), ("looped-bfs", 3)),
            ({}, {"precision": "fp32"}, {"tp": 2}, {"pp_first_stage_layers": 3}, {"checkpointing": "full"},
             {"micro_batch": 2, "gradient_accumulation": 3}, {"gradient_accumulation": 16})):
        expected = measured.peak_bytes
        assert pipeline_peak_bytes(setup) == expected, (schedule, strategy, extra)
        # asked whether it exceeds a limit: the peak at or below it, a lower bound above it
        for above in (expected - 1, expected, expected // 2):
            bounded = pipeline_peak_bytes(setup, above)
            assert bounded == expected if expected <= above else above < bounded <= expected
        checked += 1
    assert checked >= 100


def test_the_worst_ranks_phase_bytes_without_the_phases_are_the_estimates():
    """worst_rank_phases (what the plan search adds an expert layout's items to) lists the kind and
    bytes of each phase estimate_plan writes for its worst rank, in its order, and
    replayed_resident_bytes its resident bytes, over schedules (split
    backward included), strategies, precisions, checkpointing, tensor parallelism, Megatron's uneven
    split and micro-batch counts."""
    from planner.parallel.pipeline import estimate_plan, replayed_resident_bytes, worst_rank_phases

    checked = 0
    for schedule, strategy, extra, setup, _ in _pipeline_setups(
            (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved-zb", 2), ("zbv", 2)),
            ({}, {"precision": "fp32"}, {"tp": 2}, {"pp_first_stage_layers": 3}, {"checkpointing": "full"},
             {"micro_batch": 2, "gradient_accumulation": 3})):
        plan, _, _ = estimate_plan(setup)
        assert worst_rank_phases(setup) == [(p.kind, p.bytes) for p in plan.phases], (schedule, strategy, extra)
        # the resident bytes with the schedule replayed: exact where the backward is split, too
        assert replayed_resident_bytes(setup) == plan.resident_bytes, (schedule, strategy, extra)
        checked += 1
    assert checked >= 80


def test_zero_bubble_keeps_input_gradients_on_the_receive_buffers():
    # torch 2.13 pipelining/_backward.py stage_backward_input sets inp.grad = dinput on the receive
    # buffer; stage.py clear_runtime_states drops it at the next step: between steps a zero-bubble rank
    # keeps one stage-input gradient per micro-batch of each stage it receives into (measured:
    # llama-pp2-interleaved-zb-v2-fp32-m4 resident 35.24 MB against interleaved's 33.14 MB)
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest
    from tests.real_runs import LLAMA

    fields = dict(model_config=LLAMA, strategy="fsdp", gpu="cpu", gpus=2, pp=2, micro_batch=2, seq_len=128,
                  gradient_accumulation=4, precision="fp32", pp_virtual_stages=2)
    zb = estimate(EstimateRequest(**fields, pp_schedule="interleaved-zb"))
    looped = estimate(EstimateRequest(**fields, pp_schedule="interleaved"))
    boundary = 2 * 128 * 256 * 4  # micro-batch x seq x hidden x fp32
    assert zb.per_device.resident_bytes - looped.per_device.resident_bytes == 2 * 4 * boundary  # rank 1: stages 1, 3
    assert any(p.name.startswith("weight-gradient backward") for p in zb.phases)


def test_the_stages_autocast_terms_are_each_blocks_own():
    """stages() reads the per-block autocast extra and linear weights from one memo per architecture:
    each equals the block's own (its spec's extra; its tensors wider than the hidden size)."""
    from planner.model.architecture import block_numels, layer_specs
    from planner.model.catalogue import catalogue_model
    from planner.parallel import pipeline as P

    for name in ("llama-3-8b", "qwen3-30b-a3b", "gpt2"):
        a = catalogue_model(name).architecture
        extras, linears = P._block_autocast(a)
        assert extras == [P._autocast_fp32_stream_extra(spec) for spec in layer_specs(a)]
        assert linears == [sum(n for n in block if n > a.hidden_size) for block in block_numels(a)]
        assert P._block_autocast(a) is P._block_autocast(a) and all(n > 0 for n in linears)
    assert any(P._block_autocast(catalogue_model(n).architecture)[0][0] for n in ("llama-3-8b",))
