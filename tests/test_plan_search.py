"""The plan's search over pipeline and expert degrees, and the bounds that keep it fast: a searched
candidate is the estimate of the same configuration, and every bound the search prunes with holds."""

import pytest

from cli.main import main
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate
from planner.plan.evaluate import TIE_TOLERANCE
from planner.plan.search import Setting, plan
from planner.plan.settings import estimate_request
from planner.recipes.precision import RECIPES
from planner.schema import EstimateRequest, EstimateResult, PlanRequest
from planner.time.step import estimate_with_time

SLOW_TWO_NODES = dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=2, nics_per_node=1, global_batch=256,
                      fabric="eth-25g")


def _as_estimate(req: PlanRequest, c) -> EstimateRequest:
    degrees = {k: v for k, v in c.parallel.model_dump().items() if k in ("tp", "cp", "pp", "ep") and v > 1}
    return EstimateRequest(model=req.model, strategy=c.strategy, gpus=req.gpus, nodes=req.nodes, gpu=req.gpu,
                           micro_batch=c.micro_batch, gradient_accumulation=c.gradient_accumulation,
                           seq_len=req.seq_len, checkpointing=c.checkpointing, offload_optimizer=c.offload_optimizer,
                           offload_params=c.offload_params, fabric=req.fabric, nics_per_node=req.nics_per_node,
                           topology=req.topology, **degrees)


def _assert_candidate_is_the_estimate(req: PlanRequest, c) -> None:
    e = estimate_with_time(_as_estimate(req, c))
    d = c.per_device
    if d.reserved_peak_bytes == d.peak_bytes + d.nccl_bytes:
        # a candidate the plan did not replay through the allocator (issue 24: only its fitting
        # candidates, in rank order, until one fits): every field but the replay's is the estimate's
        e = e.model_copy(update={"per_device": estimate(_as_estimate(req, c), simulate=False).per_device})
    assert e.per_device == c.per_device and e.parallel == c.parallel
    t = e.time
    assert (t.step_seconds, t.compute_seconds, t.communication_seconds, t.exposed_communication_seconds,
            t.tokens_per_second, t.mfu) == (c.step_seconds, c.compute_seconds, c.communication_seconds,
                                            c.exposed_communication_seconds, c.tokens_per_second, c.mfu)


def test_pipeline_across_a_slow_fabric_wins_and_is_its_estimate():
    """Two 8 x H100 nodes joined by one 25 GbE NIC each: data parallelism sends its gradients (HSDP:
    the replica all-reduce) through the NIC every step; a pipeline whose stage boundary is the node
    boundary sends only each micro-batch's activations across, and wins. Its numbers are the
    estimate's of the same configuration (pipeline memory, bubble and p2p: planner/parallel/pipeline.py)."""
    req = PlanRequest(**SLOW_TWO_NODES)
    r = plan(req)
    best = r.recommended
    assert best.parallel.pp == 2
    data_parallel = min((c for c in r.candidates if c.fits and c.parallel.pp == 1), key=lambda c: c.step_seconds)
    assert best.step_seconds < 0.8 * data_parallel.step_seconds
    _assert_candidate_is_the_estimate(req, best)
    assert any(n.startswith("pipeline layouts searched: pp 2 (1f1b") for n in r.notes)


def test_expert_parallel_candidate_is_its_estimate():
    req = PlanRequest(model="mixtral-8x7b", gpu="h100-80gb", gpus=8, global_batch=64, ep=2)
    r = plan(req)
    assert r.candidates and {c.parallel.ep for c in r.candidates} == {2}
    fitting = [c for c in r.candidates if c.fits]
    _assert_candidate_is_the_estimate(req, (fitting or r.candidates)[0])


def test_a_fixed_pipeline_degree_is_kept():
    r = plan(PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=2, global_batch=256, pp=2))
    assert r.candidates and {c.parallel.pp for c in r.candidates} == {2}
    assert {c.strategy for c in r.candidates} <= {"ddp", "zero0", "zero1", "fsdp", "fsdp-grad-op", "hsdp"}


def test_a_fixed_pipeline_degree_with_lora_is_refused_with_its_field(capsys):
    code = main(["plan", "--model", "llama-3-8b", "--nodes", "2", "--pp", "2", "--finetune", "lora"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("planner: error: pp=2 with finetune lora:") and err.count("\n") == 1


def test_pipeline_degrees_name_their_operands():
    """128 nodes: pp 2..16 split Llama-3-70B's 80 blocks evenly; over 32 stages the others would
    hold 2 and the first and last 10 (no shorter ends: refused); 128 stages are more than the blocks."""
    r = plan(PlanRequest(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=128, topology="hgx-h100",
                         global_batch=1024))
    assert ("pp=32 not searched: num_layers(80) is not divisible by pp(32) * pp_virtual_stages(1) = 32, and no "
            "shorter first and last stages leave the others equal") in r.notes
    assert ("pp=128 not searched: num_layers(80) is fewer than pp(128) * pp_virtual_stages(1) = 128 stages") in r.notes
    assert any(n.startswith("pipeline layouts searched: pp 2, 4, 8, 16 (1f1b") for n in r.notes)


def test_uneven_pipelines_are_searched_with_shorter_ends():
    """Llama-3.1-405B's 126 blocks on 16 nodes: pp 4, 8 and 16 are planned with the first and
    last stages one block shorter (31/32/32/31, 15/16x6/15, 7/8x14/7: the Llama 3 paper's split at
    16 stages), each candidate carrying its split."""
    from planner.parallel.pipeline import balanced_split
    from planner.model.catalogue import catalogue_model

    arch = catalogue_model("llama-3.1-405b").architecture
    assert [balanced_split(arch, pp, 1, 8192) for pp in (4, 8, 16)] == [(31, 31), (15, 15), (7, 7)]
    assert balanced_split(arch, 2, 1, 8192) is None  # even
    r = plan(PlanRequest(model="llama-3.1-405b", gpu="h100-80gb", gpus=8, nodes=16, seq_len=8192, global_batch=128,
                         objective="memory"))
    assert any(n.startswith("pipeline layouts searched: pp 2, 4, 8, 16 (1f1b") for n in r.notes)
    piped = [c for c in r.candidates if c.parallel.pp == 16]
    assert any(c.pp_schedule == "1f1b" for c in piped)
    assert all((c.pp_first_stage_layers, c.pp_last_stage_layers) == balanced_split(arch, 16, c.pp_virtual_stages, 8192)
               for c in piped)
    assert all((c.pp_first_stage_layers, c.pp_last_stage_layers) == (7, 7) for c in piped if c.pp_virtual_stages == 1)
    assert all(c.pp_first_stage_layers is None for c in r.candidates
               if c.parallel.pp == 1 or (c.parallel.pp == 2 and c.pp_virtual_stages == 1))


def test_one_node_plans_search_no_pipeline():
    r = plan(PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, global_batch=64))
    assert {c.parallel.pp for c in r.candidates} == {1}
    assert not any("pipeline" in n for n in r.notes)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3", "fsdp", "hsdp"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_every_phase_grows_with_the_micro_batch(strategy, checkpointing):
    """The bound of plan._evaluate_setting: no phase shrinks with a larger micro-batch, so a setting
    that does not fit at micro-batch 1 fits at no larger one."""
    kw = dict(model="llama-3-8b", strategy=strategy, gpus=8, nodes=2, checkpointing=checkpointing, seq_len=2048)
    one, two = (estimate(EstimateRequest(micro_batch=m, **kw)) for m in (1, 2))
    assert all(b.bytes >= a.bytes for a, b in zip(one.phases, two.phases))


@pytest.mark.parametrize("strategy,schedule,tp", [("fsdp", "1f1b", 1), ("ddp", "gpipe", 1), ("zero1", "1f1b", 1),
                                                   ("fsdp", "1f1b", 2), ("hsdp", "interleaved", 1)])
def test_the_pipeline_resident_floor_is_the_estimates(strategy, schedule, tp):
    """plan._resident_floor extrapolates a pipeline's resident bytes from pp micro-batches of 1 and
    of 2 sequences; it equals the estimate at every micro-batch split of the rank's share."""
    from planner.plan.evaluate import Search, _resident_floor

    virtual = 2 if schedule == "interleaved" else 1
    req = PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=4, global_batch=512, pp_schedule=schedule,
                      pp_virtual_stages=virtual, seq_len=2048)
    combo = Setting(8, strategy, "full", "none", "none", 4 if strategy == "hsdp" else None, tp, 1, tp > 1, 2, 1)
    per_rank = 512 * tp * 2 // 32
    search = Search(req, None, None, None, {}, 1, 0.0, {"model": "llama-3-8b"}, RECIPES[req.precision])
    floor = _resident_floor(search, req, combo, per_rank)
    for micro in (1, 2, 4):
        e = estimate(estimate_request(req, combo, micro, {"model": "llama-3-8b"}))
        assert e.per_device.resident_bytes == floor, micro


def test_bounds_do_not_change_the_recommendation_of_an_exhaustive_search(monkeypatch):
    """With every bound switched off (no time bound, no floors) the same candidates win."""
    import planner.plan.evaluate as p

    req = PlanRequest(**SLOW_TWO_NODES)
    bounded = plan(req)
    monkeypatch.setattr(p, "_resident_floor", lambda *a: None)
    original = p._evaluate_setting
    monkeypatch.setattr(p, "_evaluate_setting", lambda search, r, combo, t, pk: original(search, r, combo, None, None))
    exhaustive = plan(req)
    assert exhaustive.recommended == bounded.recommended
    # the bound keeps what comes within the ties of its family's fastest fitting setting (evaluate_layouts);
    # the recommendation may be another tie than the fastest (ties go to headroom), so the fastest is the reference
    fastest = min(c.step_seconds for c in exhaustive.candidates if c.fits)
    listed = {(c.strategy, c.checkpointing, c.offload_optimizer, c.hsdp_shard_size, c.parallel.tp, c.parallel.pp)
              for c in exhaustive.candidates if c.fits and c.step_seconds <= fastest * (1 + TIE_TOLERANCE)}
    found = {(c.strategy, c.checkpointing, c.offload_optimizer, c.hsdp_shard_size, c.parallel.tp, c.parallel.pp)
             for c in bounded.candidates}
    assert listed <= found


def test_the_fewer_nodes_bound_changes_no_advice(monkeypatch):
    """plan._fewer_node_rows skips a node count whose compute alone cannot beat the advice's
    threshold; without the bound the advice is the same."""
    import planner.plan.evaluate as p

    kw = dict(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=4, seq_len=4096, global_batch=256, tp=1, pp=1)
    for fabric in ({"fabric": "eth-25g", "nics_per_node": 1}, {}):
        bounded = plan(PlanRequest(**kw, **fabric))
        with monkeypatch.context() as m:
            m.setattr(p, "_compute_floor", lambda *a: None)
            unbounded = plan(PlanRequest(**kw, **fabric))
        assert bounded.faster_on_fewer_nodes == unbounded.faster_on_fewer_nodes
        assert [n for n in bounded.notes if n.startswith("fewer nodes")] == \
            [n for n in unbounded.notes if n.startswith("fewer nodes")]


def test_the_fewer_nodes_search_bounded_by_the_recommendation_changes_no_answer(monkeypatch):
    """fewer_node_rows asked with the recommendation (ranked) bounds every setting by the advice's
    threshold; the plan is the one the search without that bound gives: the advice, its note and
    the candidates evaluated (counted as without it), where fewer nodes win and where they do not,
    by time and by cost."""
    import planner.plan.evaluate as p
    import planner.plan.search as search_module

    def without_elapsed(r):
        dumped = r.model_dump(mode="json")
        dumped["notes"] = [n for n in dumped["notes"] if "candidates evaluated in" not in n]
        return dumped

    asked = []
    original = p.fewer_node_rows

    def unranked(search, req, rows, ranked=False, recommended=None):
        asked.append(ranked)
        return original(search, req, rows)

    cases = (dict(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=4, seq_len=4096, global_batch=256, tp=1,
                  fabric="eth-25g", nics_per_node=1),
             SLOW_TWO_NODES, dict(SLOW_TWO_NODES, objective="cost"),
             dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=2, global_batch=256))
    advised = 0
    for fields in cases:
        bounded = plan(PlanRequest(**fields))
        with monkeypatch.context() as m:
            m.setattr(search_module, "fewer_node_rows", unranked)
            unbounded = plan(PlanRequest(**fields))
        assert asked and asked[-1] is True  # the ranking asked, with its recommendation
        assert without_elapsed(bounded) == without_elapsed(unbounded), fields
        advised += bounded.faster_on_fewer_nodes is not None
    assert advised >= 1


def test_the_min_gpus_bounds_change_no_answer(monkeypatch):
    """plan._search answers None at once when the replicated weights, or the most nodes searched,
    prove it, and skips a node's fewer GPUs when the whole node does not fit: the same answers as
    the plain doubling search."""
    import planner.plan.inverse as p

    req = PlanRequest(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=2, global_batch=256)
    usable = 80 * 2**30 * 0.95
    fields = {"model": "llama-3-70b"}
    bounded = {n: p.strategy_min_gpus(req, n, usable, fields) for n in ("ddp", "zero1", "zero3", "fsdp", "hsdp")}
    monkeypatch.setattr(p, "_replicated_weights_exceed", lambda *a: False)
    monkeypatch.setattr(p, "MAX_SEARCH_GPUS", 8)  # no "most nodes" check: the loop alone
    plain = {}
    for n in bounded:
        gpus = next((g for g in range(1, 9) if p._fits(req, n, usable, fields, g, 1)), None)
        nodes = 2
        while gpus is None and nodes <= 8192:
            if p._fits(req, n, usable, fields, 8, nodes):
                low = max(2, nodes // 2)
                while low < nodes:
                    mid = (low + nodes) // 2
                    if p._fits(req, n, usable, fields, 8, mid):
                        nodes = mid
                    else:
                        low = mid + 1
                gpus = nodes * 8
            nodes *= 2
        plain[n] = gpus
    assert bounded == plain


def test_a_fixed_pipeline_degree_that_cannot_divide_the_cluster_is_one_line(capsys):
    code = main(["plan", "--model", "llama-3-8b", "--pp", "3", "--global-batch", "64"])
    assert code == 2 and capsys.readouterr().err.strip() == (
        "planner: error: gpus(8) * nodes(1) = 8 is not divisible by tp(1) * pp(3) * cp(1) = 3")


def test_the_longest_sequence_of_a_pipeline_recommendation():
    """max_seq_len for a pipeline layout: micro-batches of 1 sequence, as many as the candidate's
    micro-batches (planner/plan/inverse.py: a count its schedule accepts), in the request's
    schedule; it fits, 256 tokens more do not."""
    req = PlanRequest(**SLOW_TWO_NODES)
    r = plan(req)
    best, longest = r.recommended, r.max_seq_len
    assert best.parallel.pp == 2 and longest is not None and longest % 256 == 0
    from planner.cluster.gpus import gpu as lookup_gpu

    usable = lookup_gpu(req.gpu).memory_bytes * (1 - req.headroom)

    def fits(seq: int) -> bool:
        """Live peak within the headroom and the caching allocator's replay on the device."""
        e = estimate(EstimateRequest(model=req.model, strategy=best.strategy, gpus=8, nodes=2, micro_batch=1,
                                     gradient_accumulation=best.micro_batch * best.gradient_accumulation,
                                     seq_len=seq, checkpointing="full", tp=best.parallel.tp,
                                     pp=2, pp_schedule=best.pp_schedule, pp_virtual_stages=best.pp_virtual_stages))
        return e.per_device.peak_bytes <= usable and e.fits

    assert fits(longest) and not fits(longest + 256)


@pytest.mark.parametrize("fields", [dict(model="llama-3-8b", strategy="fsdp", tp=2),
                                    dict(model="llama-3-8b", strategy="zero2", tp=2),
                                    dict(model="mixtral-8x7b", strategy="fsdp", ep=2),
                                    dict(model="llama-3-8b", strategy="ddp", finetune="lora"),
                                    dict(model="llama-3-8b", strategy="zero2", finetune="qlora"),
                                    dict(model="llama-3-8b", strategy="zero3", offload_optimizer="cpu",
                                         offload_params="cpu")],
                         ids=["fsdp-tp2", "zero2-tp2", "mixtral-ep2", "ddp-lora", "zero2-qlora", "zero3-offload"])
def test_every_phase_grows_with_the_micro_batch_in_every_layout_searched(fields):
    one, two = (estimate(EstimateRequest(micro_batch=m, gpus=8, seq_len=2048, **fields)) for m in (1, 2))
    assert all(b.bytes >= a.bytes for a, b in zip(one.phases, two.phases))


@pytest.mark.parametrize("strategy,schedule", [("fsdp", "1f1b"), ("fsdp", "interleaved"), ("ddp", "gpipe"),
                                               ("zero1", "1f1b"), ("hsdp", "1f1b")])
def test_a_pipeline_ranks_resident_bytes_do_not_depend_on_checkpointing(strategy, schedule):
    """The plan's resident floor of a pipeline setting is estimated once, without checkpointing,
    for both: every rank keeps the same states and receive buffers between steps either way."""
    from planner.memory.orchestrator import resolve
    from planner.parallel.pipeline import estimate_plan
    from planner.schema import EstimateRequest

    def residents(checkpointing):
        request = EstimateRequest(model="llama-3.1-8b", strategy=strategy, gpus=8, nodes=4, gpu="h100-80gb", pp=4,
                                  gradient_accumulation=8, checkpointing=checkpointing, pp_schedule=schedule,
                                  pp_virtual_stages=2 if schedule == "interleaved" else 1,
                                  **({"hsdp_shard_size": 4} if strategy == "hsdp" else {}))
        return [r.resident_bytes for r in estimate_plan(resolve(request))[2]]

    assert residents("none") == residents("full")


def test_llama3_pretraining_setup_is_planned_with_families_and_a_reason():
    """The Llama 3 405B pretraining setup (Llama 3 paper, Sec. 3.3: 16,384 H100, 8,192 tokens,
    2,048 sequences per step) is accepted: the batch divides the data-parallel ranks of the TP 8
    layouts (2,048 with dp alone over tp 8; 128 at TP8 x PP16), not the world; the table lists the
    best of each layout family and says why the winner won against each. (Its time, under 3 s for the
    whole process, is a benchmark: bench/plan_speed.py, README block planspeed.)"""
    r = plan(PlanRequest(model="llama-3.1-405b", gpu="h100-80gb", gpus=8, nodes=2048, seq_len=8192,
                         global_batch=2048))
    assert r.recommended is not None and r.recommended.parallel.tp == 8  # TP inside the node
    families = {(c.parallel.tp > 1, c.parallel.pp > 1) for c in r.families}
    assert {(True, False), (True, True)} <= families  # and dp x pp (16 x 1,024 ranks do not divide 2,048)
    assert r.winner_reason.startswith(f"recommended {r.recommended.strategy}")
    from planner.plan.search import layout_family

    winner = layout_family(*(getattr(r.recommended.parallel, d) for d in ("tp", "cp", "pp", "ep")))
    others = {layout_family(*(getattr(c.parallel, d) for d in ("tp", "cp", "pp", "ep"))) for c in r.families} - {winner}
    assert others and "against the best of each other layout family:" in r.winner_reason
    assert all(f"{family} (best: " in r.winner_reason for family in others)
    # every schedule torch 2.13 ships that can win is searched, the multi-stage ones at 2 stages per rank
    # (looped-bfs and dualpipev are dominated: planner/plan/settings.py PIPELINE_SCHEDULES)
    assert any("pipeline layouts searched: pp 2, 4, 8, 16, 32, 64 (1f1b, interleaved with 2 virtual stages, gpipe, "
               "interleaved-zb with 2 virtual stages, zbv with 2 virtual stages)" in n for n in r.notes)
    fixed = plan(PlanRequest(model="llama-3.1-405b", gpu="h100-80gb", gpus=8, nodes=2048, seq_len=8192,
                             global_batch=2048, tp=8, pp=16, pp_schedule="1f1b"))
    c = fixed.recommended
    assert c is not None and (c.parallel.dp_replicate * c.parallel.dp_shard, c.pp_first_stage_layers,
                              c.pp_last_stage_layers) == (128, 7, 7)
    assert c.micro_batch * c.gradient_accumulation * 128 == 2048


def test_a_given_split_is_for_a_fixed_pipeline():
    """--pp-first/last-stage-layers split the pipeline the request fixes; a searched pp takes its
    own best split; a schedule whose stages the given split cannot fill is not searched."""
    base = dict(model="llama-3.1-405b", gpu="h100-80gb", gpus=8, nodes=16, seq_len=8192, global_batch=128)
    with pytest.raises(PlannerError, match=r"pp_first_stage_layers\(7\) / pp_last_stage_layers\(7\) split a fixed "
                                           r"pipeline: give pp too"):
        plan(PlanRequest(**base, pp_first_stage_layers=7, pp_last_stage_layers=7))
    with pytest.raises(PlannerError, match=r"num_layers\(126\) - pp_first_stage_layers\(6\), pp_last_stage_layers\(7\)"):
        plan(PlanRequest(**base, pp=16, pp_first_stage_layers=6, pp_last_stage_layers=7))
    r = plan(PlanRequest(**base, tp=8, pp=16, pp_first_stage_layers=7, pp_last_stage_layers=7, objective="memory"))
    piped = [c for c in r.candidates if c.parallel.pp == 16]
    # 7 + 14 x 8 + 7 over 16 stages; over 32 (interleaved) the other 30 would hold 112 / 30: not searched
    assert piped and all((c.pp_first_stage_layers, c.pp_last_stage_layers, c.pp_virtual_stages) == (7, 7, 1)
                         for c in piped)


# what orchestrator.measure (the plan search's memory) is asked with: every recipe axis that
# resolve checks or the phases count (tp_plan, optimizers, fused loss, low precision, LoRA on an
# int8 base, pipeline, experts, offload, activation offload, a vision tower, CPU ranks), those
# refused among them
MEASURED = [
    dict(strategy="fsdp", tp=2, tp_plan="transformers"),
    dict(strategy="ddp", tp=2, tp_plan="transformers"),  # refused: DDP x transformers' TP
    dict(strategy="zero3", tp=2, tp_plan="transformers"),  # refused: not torch's
    dict(strategy="fsdp", tp=2),
    dict(strategy="single", gpus=1, optimizer="muon"),
    dict(strategy="fsdp", optimizer="muon"),
    dict(strategy="zero3", optimizer="adafactor"),
    dict(strategy="fsdp", optimizer="adafactor", checkpointing="full"),
    dict(strategy="fsdp", loss="liger-fused"),
    dict(strategy="fsdp", loss="liger-fused", keeps_outputs=True),
    dict(strategy="fsdp", tp=2, loss="liger-fused"),
    dict(strategy="fsdp", low_precision="float8-tensorwise"),
    dict(strategy="ddp", low_precision="float8-rowwise"),
    dict(strategy="zero2", low_precision="te-fp8"),
    dict(strategy="fsdp", low_precision="nvfp4"),  # refused on an H100
    dict(strategy="fsdp", finetune="qlora", quantize_base="int8"),  # refused: a sharded int8 base
    dict(strategy="zero3", finetune="qlora", quantize_base="int8"),  # refused too
    dict(strategy="ddp", finetune="qlora", quantize_base="int8"),
    dict(strategy="single", gpus=1, finetune="qlora", quantize_base="int8", loss="liger-fused"),
    dict(strategy="fsdp", tp=2, low_precision="float8-rowwise"),
    dict(strategy="ddp", finetune="lora", checkpointing="full"),
    dict(strategy="zero3", offload_optimizer="cpu", offload_params="cpu"),
    dict(strategy="fsdp", nodes=2, pp=2, gradient_accumulation=4, pp_schedule="interleaved", pp_virtual_stages=2),
    dict(strategy="zero1", nodes=2, pp=2, gradient_accumulation=4),
    dict(model="gpt-oss-20b", strategy="fsdp", ep=2),
    dict(strategy="ddp", gpu="cpu", gpus=2, model="llama-3.2-1b", seq_len=256),
    dict(strategy="fsdp", activation_offload=True),
    dict(strategy="ddp", gpu="cpu", gpus=2, model="llama-3.2-1b", seq_len=256, activation_offload=True),
    dict(strategy="fsdp", nodes=2, pp=2, gradient_accumulation=4, activation_offload=True),  # refused
    dict(model="gemma-3-4b", strategy="zero3"),
    dict(model="gemma-3-4b", strategy="fsdp", text_only=True, nodes=2, pp=2, gradient_accumulation=4),
    dict(model="gemma-3-4b", strategy="fsdp", nodes=2, pp=2, gradient_accumulation=4),  # refused: the vision tower
]


@pytest.mark.parametrize("fields", MEASURED, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_measure_gives_the_estimates_numbers_and_refusals(fields):
    """The plan judges its settings on orchestrator.measure(resolve(request)) and shows
    Measured.candidate(replay=True): the same numbers as estimate(request) (live peak, resident,
    states, every phase; with the allocator replayed, the reserved peak and the fit), and the same
    refusal where the estimate refuses."""
    from planner.memory.orchestrator import measure, resolve

    request = EstimateRequest(**({"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "seq_len": 2048,
                                  "micro_batch": 2} | fields))
    try:
        e = estimate(request, simulate=False)
    except PlannerError as refused:
        with pytest.raises(PlannerError) as again:
            measure(resolve(request))
        assert (str(again.value), again.value.field) == (str(refused), refused.field)
        return
    m = measure(resolve(request))
    d = e.per_device
    assert (m.peak_bytes, m.resident_bytes, m.states) == (d.peak_bytes, d.resident_bytes, (
        d.parameters_bytes, d.gradients_bytes, d.optimizer_states_bytes))
    assert m.phase_bytes() == [p.bytes for p in e.phases]
    assert m.result().model_dump() == e.model_dump()
    shown, replayed = m.candidate(replay=True), estimate(request)
    assert shown.per_device == replayed.per_device and shown.fits == replayed.fits
    assert shown.host == replayed.host and shown.parallel == replayed.parallel
    # a brief result is filled in without validation: every field of the type validation gives
    brief = m.candidate()
    validated = EstimateResult(**{name: getattr(brief, name) for name in brief.model_fields_set})
    assert brief.model_dump_json(warnings="error") == validated.model_dump_json()


@pytest.mark.parametrize("pp,strategy", [(1, "fsdp"), (1, "hsdp"), (2, "fsdp"), (1, "zero3")])
def test_a_settings_later_requests_are_the_ones_validation_builds(pp, strategy):
    """estimate_request answers a setting's later micro-batches with its first request, the batch
    fields replaced: each equals the request built and validated from scratch, fields set
    included; a batch validation refuses is refused as before."""
    from pydantic import ValidationError

    from planner.plan.settings import _degree_fields, _estimate_request

    req = PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=4, global_batch=4096, seq_len=2048)
    fields = {"model": "llama-3-8b"}
    combo = Setting(8, strategy, "full", "none", "none", 4 if strategy == "hsdp" else None, 1, 1, False, pp, 1)
    for micro, accumulation in ((1, None), (2, 2), (1, 2), (4, None), (8, 3), (2, None)):
        got = estimate_request(req, combo, micro, fields, accumulation)
        steps = {"gradient_accumulation": accumulation} if pp == 1 and accumulation and accumulation > 1 else {}
        built = _estimate_request(req, combo, micro, fields, steps, _degree_fields(req, combo, micro, accumulation))
        assert got == built and got.model_fields_set == built.model_fields_set, (micro, accumulation)
    with pytest.raises(ValidationError):
        estimate_request(req, combo, 1 << 14, fields)  # 2^14 x 2,048 tokens: over MAX_TOKENS


def test_plan_pauses_the_cyclic_collector_and_restores_it():
    """plan() runs without the cyclic garbage collector and leaves it as it found it, enabled or not,
    also when the plan is refused."""
    import gc

    seen = []
    import planner.plan.search as search

    original = search._plan
    try:
        search._plan = lambda req, profile=None: seen.append(gc.isenabled()) or original(req, profile)
        req = PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, seq_len=2048, global_batch=64)
        assert gc.isenabled()
        search.plan(req)
        assert gc.isenabled() and seen == [False]
        gc.disable()
        search.plan(req)
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(PlannerError):
            search.plan(PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, seq_len=2048, global_batch=64,
                                    pp=3))
        assert gc.isenabled()
    finally:
        search._plan = original
        gc.enable()


@pytest.mark.parametrize("fields", [{}, {"loss": "liger-fused"}])  # liger's head reads the gradients' dtype
def test_a_settings_step_times_are_its_own_where_the_search_shares_them(monkeypatch, fields):
    """Search.step_times_of answers the settings whose time-model fields (their Combo's) agree
    with one call (a pipeline's schedules and splits), and its calls share the data-parallel
    collectives of a setting's checkpointing options: each answer equals step_times of the setting
    itself, and the plan asks fewer calls than settings."""
    import planner.plan.evaluate as p
    from planner.time.step import step_times

    calls, checked = [], []
    original = p.Search.step_times_of
    monkeypatch.setattr(p, "step_times", lambda *a, **k: calls.append(a[1]) or step_times(*a, **k))

    def checking(self, req, combo, micro, per_rank, frozen, offloaded):
        got = original(self, req, combo, micro, per_rank, frozen, offloaded)
        own = step_times(self.settings_of(req), combo, micro, per_rank, self.model.parameters,
                         self.model.architecture, self.g, self.topo, self.fabric, self.nics, frozen=frozen,
                         offloaded_per_sequence=offloaded)
        assert [t[:10] + (t.terms,) for t in got] == [t[:10] + (t.terms,) for t in own], combo
        checked.append(combo)
        return got

    monkeypatch.setattr(p.Search, "step_times_of", checking)
    plan(PlanRequest(**({"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "nodes": 4, "global_batch": 512,
                         "seq_len": 2048} | fields)))
    pipelines = {c for c in checked if c.pp > 1}
    if not fields:  # liger's fused loss is searched without pipelines
        assert len({(c.schedule, c.virtual_stages, c.split) for c in pipelines}) > 1
        assert len(calls) < len(checked)


@pytest.mark.parametrize("fields", [dict(strategy="fsdp", tp=2), dict(strategy="zero3", tp=2),
                                    dict(strategy="fsdp", tp=4, checkpointing="full"),
                                    dict(strategy="ddp", tp=2, nodes=2, pp=2, gradient_accumulation=4)])
def test_a_tp_ranks_remembered_activations_are_its_own(fields):
    """rank_activations remembers tensor_parallel.tp_activations per its arguments (the plan asks
    the same for every strategy and schedule of a TP layout): the answer equals a fresh call's,
    and a second request of the same arguments gets the same object."""
    from planner.memory.orchestrator import resolve
    from planner.memory.rank_activations import _activations, _autocast, _model_activations
    from planner.model.architecture import derived
    from planner.parallel.tensor import tp_activations

    request = EstimateRequest(**({"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "seq_len": 2048,
                                  "micro_batch": 2} | fields))
    setup = resolve(request)
    derived(setup.model.architecture).pop("_tp_activations", None)
    got, _ = _activations(setup)
    autocast = _autocast(setup)
    whole = _model_activations(setup.arch, 2, 2048, setup.recipe.compute_bytes, request.attention,
                               request.checkpointing, setup.device, autocast, None, setup.loss_chunks)
    fresh = tp_activations(whole, setup.model.architecture, setup.arch, tp=setup.tp,
                           sequence_parallel=setup.sequence_parallel, tokens=2 * 2048, b=setup.recipe.compute_bytes,
                           vocab_parallel_loss=setup.vocab_parallel_loss, autocast=autocast)
    assert got == fresh
    assert _activations(resolve(request))[0] is got


@pytest.mark.parametrize("fields", [dict(), dict(optimizer_in_backward=True, gpus=1, nodes=1),
                                    dict(tp=2), dict(pp=2)])
def test_a_settings_later_setups_are_the_ones_resolve_builds(fields):
    """Search.resolved answers a setting's later requests with its first Setup and their own
    request: each equals resolve's Setup, the request's fields set included; what resolve refuses
    of a later batch (optimizer_in_backward with accumulation) is refused alike."""
    from planner.memory.orchestrator import resolve
    from planner.plan.evaluate import Search

    req = PlanRequest(**({"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "nodes": 4, "global_batch": 4096,
                          "seq_len": 2048} | {k: v for k, v in fields.items() if k not in ("tp", "pp")}))
    model_fields = {"model": "llama-3-8b"}
    search = Search(req, None, None, None, {}, 1, 0.0, model_fields, RECIPES[req.precision])
    tp, pp = fields.get("tp", 1), fields.get("pp", 1)
    strategy = "single" if req.gpus * req.nodes == 1 else "fsdp"
    combo = Setting(req.gpus, strategy, "full", "none", "none", None, tp, 1, tp > 1, pp, 1)
    for micro, accumulation in ((1, 2), (2, 2), (4, None), (1, None), (8, 3)):
        request = estimate_request(req, combo, micro, model_fields, accumulation)
        try:
            expected = resolve(request)
        except PlannerError as refused:
            with pytest.raises(PlannerError) as again:
                search.resolved(req, combo, request)
            assert (str(again.value), again.value.field) == (str(refused), refused.field)
            continue
        got = search.resolved(req, combo, request)
        assert got == expected and got.request.model_fields_set == expected.request.model_fields_set, micro


def test_a_pipelines_remembered_stages_are_its_own():
    """pipeline.stages remembers its stages per architecture and inputs (the plan asks the same for
    the strategies, shard groups and schedules of a layout): after every setting below has asked,
    each one's answer equals _stages computed for it alone."""
    from planner.memory.orchestrator import resolve
    from planner.memory.rank_activations import activations
    from planner.parallel.pipeline import _data_parallel_group, _stages, stages

    base = {"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "nodes": 2, "seq_len": 2048, "pp": 2,
            "gradient_accumulation": 4}
    settings = [dict(strategy="fsdp"), dict(strategy="ddp"), dict(strategy="zero1"), dict(strategy="hsdp"),
                dict(strategy="fsdp", checkpointing="full"), dict(strategy="fsdp", micro_batch=2),
                dict(strategy="fsdp", pp_schedule="zbv", pp_virtual_stages=2),
                dict(strategy="fsdp", pp_schedule="interleaved", pp_virtual_stages=2),
                dict(strategy="ddp", precision="fp32"), dict(strategy="fsdp", tp=2),
                dict(strategy="fsdp", pp_first_stage_layers=14)]
    setups = [resolve(EstimateRequest(**(base | s))) for s in settings]
    for setup in setups + setups:
        dp = _data_parallel_group(setup)[0]
        stages(setup, 2, setup.request.pp_virtual_stages, dp)
    for setup in setups:
        dp = _data_parallel_group(setup)[0]
        assert stages(setup, 2, setup.request.pp_virtual_stages, dp) == _stages(
            setup, 2, setup.request.pp_virtual_stages, dp, activations(setup)), setup.request


def test_step_times_read_one_by_one_are_the_ones_read_together():
    """StepTimes makes an option's StepTime when read: by index (negative too), by slice and by
    iteration alike, the same fields and term values; past the end an IndexError."""
    import numpy as np

    from planner.time.collectives import step_times_of

    labels = (("matmul", "a"), ("attention", "b"))
    columns = [np.array([1.0, 2.0, 3.0]), 0.5, np.array([0.1, 0.2, 0.3]), 0.0, np.array([4.0, 5.0, 6.0]),
               np.array([7.0, 8.0, 9.0]), 0.25, np.array([0.3, 0.4, 0.5]), np.array([0.6, 0.7, 0.8]), 0.9]
    times = step_times_of(columns, 100.0, (0, 1), labels, 3)
    together = list(times)
    one_by_one = [times[k] for k in range(len(times))]
    assert len(together) == 3 and [times[-1]] == times[2:3]
    for a, b, c in zip(together, one_by_one, times[:]):
        assert a[:10] == b[:10] == c[:10] and a.terms == b.terms == c.terms and a.term_option == b.term_option
    assert together[1].terms == (("matmul", 0.7, "a"), ("attention", 0.9, "b"))
    with pytest.raises(IndexError):
        times[3]


@pytest.mark.parametrize("model", ["llama-3-8b", "gemma-3-4b", "gpt-oss-20b"])
def test_the_frameworks_remembered_sums_are_their_own(model):
    """What the frameworks' phases remember per model (the blocks' norm elements autocast never
    casts, ZeRO-1/2's partition span) equals the sum and the walk made afresh, asked twice."""
    from planner.frameworks.deepspeed.v0_19 import _partition_span, _partition_span_of
    from planner.frameworks.torch.v2 import _block_norms
    from planner.model.architecture import layer_specs, parameter_numels
    from planner.model.catalogue import catalogue_model
    from planner.model.layers import norm_numels

    a = catalogue_model(model).architecture
    fresh = sum(sum(norm_numels(spec.norm, a.hidden_size)) * spec.norms for spec in layer_specs(a))
    assert _block_norms(a) == _block_norms(a) == fresh
    numels = parameter_numels(a)
    for dp in (1, 3, 8, 64, 5000):
        assert _partition_span(numels, dp) == _partition_span(list(numels), dp) == _partition_span_of(numels, dp)


def test_a_pipelines_option_timed_on_its_first_request_is_timed_as_on_its_copy(monkeypatch):
    """_parallel_times times every option on the setting's first request's Setup with the option's
    micro-batch size and count (parallel_step's micro_batch, micro_batches) rather than on a copy of
    the request with those batch fields: the same step as on the copy, for every option."""
    from dataclasses import replace

    import planner.plan.evaluate as p
    from planner.parallel.pipeline import parallel_step

    seen = []
    original = p._parallel_times

    def checking(search, req, combo, micro, per_rank, times, first):
        got = original(search, req, combo, micro, per_rank, times, first)
        setup = search.setup_of(first)
        for k, mb in enumerate(micro.tolist()):
            copy = setup.request.model_copy(update={"micro_batch": mb, "gradient_accumulation": per_rank // mb})
            own = parallel_step(times[k], replace(setup, request=copy), search.model.architecture, search.topo,
                                search.fabric, search.nics, req.link_efficiency)
            assert got[k][:10] == own[:10] and got[k].terms == own.terms
            seen.append(mb == setup.request.micro_batch)
        return got

    monkeypatch.setattr(p, "_parallel_times", checking)
    plan(PlanRequest(**SLOW_TWO_NODES))
    assert any(seen) and not all(seen)


@pytest.mark.parametrize("fields", [SLOW_TWO_NODES,
                                    # a large share per rank: GPipe's (fewer micro-batches than stages) has no option
                                    dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=4, global_batch=55440 * 32,
                                         seq_len=2048),
                                    dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=4, global_batch=96,
                                         seq_len=2048, pp_virtual_stages=2, pp_schedule="interleaved", pp=2)])
def test_the_schedules_without_options_skipped_change_no_evaluation(monkeypatch, fields):
    """evaluate_layouts skips a layout's schedule option whose settings have no micro-batch option
    (_has_options asks one setting): every setting it skips has none, and the plan is the one
    evaluating every setting gives."""
    import planner.plan.evaluate as p

    def recorded(skip: bool):
        seen = []
        original = p._evaluate_setting

        def recording(search, req, combo, time_bound, peak_bound):
            found, count = original(search, req, combo, time_bound, peak_bound)
            seen.append((combo, count))
            return found, count

        monkeypatch.setattr(p, "_evaluate_setting", recording)
        if not skip:
            monkeypatch.setattr(p, "_has_options", lambda *a: True)
        result = plan(PlanRequest(**fields))
        monkeypatch.undo()
        return seen, result

    skipping, bounded = recorded(True)
    every, exhaustive = recorded(False)
    assert [s for s in every if s[1]] == [s for s in skipping if s[1]]
    assert len(every) - len(skipping) == len([s for s in every if not s[1]])
    assert fields["global_batch"] < 1000 or len(every) > len(skipping)
    assert bounded.candidates == exhaustive.candidates and bounded.recommended == exhaustive.recommended
    assert bounded.candidates_evaluated == exhaustive.candidates_evaluated


def test_pipeline_rows_judged_on_the_peak_alone_are_the_estimates_rows(monkeypatch):
    """Search.peak_of (a pipeline option's peak without its phases written out; above the usable
    memory, under a time bound, perhaps one rank's) gives the plan the estimates' answer: the same
    plan with every option estimated in full."""
    import planner.plan.evaluate as p

    req = PlanRequest(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=8, seq_len=4096, global_batch=256)
    fast = plan(req)
    monkeypatch.setattr(p.Search, "peak_of",
                        lambda self, r, combo, micro, above=None: self.estimate(r, combo, micro).peak_bytes)
    full = plan(req)
    fast_fields, full_fields = fast.model_dump(), full.model_dump()
    assert fast_fields.pop("notes")[1:] == full_fields.pop("notes")[1:]  # the first: the search's seconds
    assert fast_fields == full_fields
