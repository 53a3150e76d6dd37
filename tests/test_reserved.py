"""Reserved memory (issue 24): the step's allocation stream derived from the phase model, NCCL's
buffers, fits judged on reserved, the emitted allocator settings. Checked on one H200 (bench/results/gpu_check_h200_*.json)."""

import json
from pathlib import Path

import pytest

from cli.main import main
from planner.memory import reserved
from planner.memory.allocator import replay
from planner.memory.buffers import PhasePlan, item, phase
from planner.memory.orchestrator import estimate, resolve
from planner.memory.rank_activations import activations
from planner.model.catalogue import catalogue_model
from planner.setup import numels
from planner.memory.moments import PhaseKind
from planner.schema import EstimateRequest

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20
FSDP8 = dict(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h100-80gb")


def _step(events):
    """The events of the phases' items, without the BLAS workspaces (test_blas_workspaces_...)."""
    return [e for e in events if not str(e[1]).startswith("blas workspace")]


def _plan(*moments, resident=()):
    phases = [phase(PhaseKind.START_OF_BLOCK, f"m{k}", items) for k, items in enumerate(moments)]
    return PhasePlan(phases=phases, resident_bytes=sum(i.bytes for i in resident), buffers=[], resident=list(resident))


def test_items_appearing_and_disappearing_become_mallocs_and_frees():
    setup = resolve(EstimateRequest(**FSDP8))
    buf = item("a buffer", 30 * MIB, "buffers")
    plan = _plan([buf], [], [item("another", 30 * MIB, "buffers")])
    events = _step(reserved.allocation_events(setup, plan, parameters=1))
    ops = [e[0] for e in events]
    # step 1: malloc, free, malloc (the second buffer reuses the first's block); step 2: free the
    # second at the resident moment, then the same again; the final resident moment frees the last
    assert ops == ["malloc", "free", "malloc", "free", "malloc", "free", "malloc", "free"]
    assert replay(events).reserved_peak_bytes == 30 * MIB and replay(events).segments_peak == 1


def test_a_side_stream_buffer_is_recorded_on_the_compute_stream_and_has_its_own_pool():
    setup = resolve(EstimateRequest(**FSDP8))
    gathered = item("all-gather output", 40 * MIB, "buffers", stream="all_gather")
    plan = _plan([gathered], [item("activations", 40 * MIB, "buffers")])
    events = _step(reserved.allocation_events(setup, plan, parameters=1))
    assert ("malloc", 0, 40 * MIB, "all_gather") in events
    assert ("record", 0, "default") in events and ("complete", "default") in events
    # the default stream cannot reuse the all-gather stream's block: two segments
    assert replay(events).reserved_peak_bytes == 80 * MIB


def test_a_shrinking_item_frees_its_last_tensors_only():
    setup = resolve(EstimateRequest(**FSDP8))
    unit = reserved._activation_unit(setup)  # 1 x 4096 x 4096 x 2 bytes
    assert unit == 4096 * 4096 * 2
    plan = _plan([item("saved activations", 4 * unit, "activations")], [item("saved activations", 3 * unit, "activations")])
    events = _step(reserved.allocation_events(setup, plan, parameters=1))
    first_step = events[:events.index(("free", 3)) + 1]
    assert [e[0] for e in first_step] == ["malloc"] * 4 + ["free"]


def test_nccl_buffers_per_communicator_from_nccls_constants():
    # 32 channels x 2 ring connections x (LL 512 KiB + LL128 4,915,200 B + NCCL_BUFFSIZE 4 MiB)
    assert reserved.nccl_communicator_bytes(None) == 32 * 2 * (524_288 + 4_915_200 + 4_194_304) == 616_562_688
    assert reserved.nccl_communicator_bytes(2 * MIB) == 32 * 2 * (524_288 + 4_915_200 + 2 * MIB)
    # within NVIDIA/nccl#964's 544-688 MB per process group (4 A100)
    assert 544e6 <= reserved.nccl_communicator_bytes(None) <= 688e6


def test_communicators_are_the_mesh_dimensions_of_more_than_one_rank():
    setup = resolve(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", tp=2, cp=2))
    assert reserved.communicators(setup) == ("dp_shard(2)", "tp(2)", "cp(2)", "dp_shard_cp(4)")


def test_the_estimate_reports_reserved_with_its_terms():
    e = estimate(EstimateRequest(**FSDP8))
    d, a = e.per_device, e.allocator
    # the replay, the measured shortfall held back beyond it (test_gpu_check.py), context and NCCL
    assert a.replay_shortfall_bytes > 0
    assert d.reserved_peak_bytes == a.reserved_peak_bytes + a.replay_shortfall_bytes + d.cuda_context_bytes + d.nccl_bytes
    assert a.allocated_peak_bytes >= d.peak_bytes - d.framework_bytes  # 512-byte rounding never loses bytes
    assert a.reserved_peak_bytes >= a.allocated_peak_bytes
    nvls = 16 * 2 * 128 * 1024 * 8 * 8  # NVLS on the H100's NVSwitch: 16 channels x 2 x 1 MiB x 8 heads
    assert d.nccl_bytes == reserved.nccl_communicator_bytes(None) + nvls and a.communicators == ["dp_shard(8)"]
    assert e.headroom_bytes == e.device_capacity_bytes - d.reserved_peak_bytes
    assert a.alloc_conf == "" and a.other_alloc_conf == "expandable_segments:True"
    assert any(n.startswith("reserved (simulated") for n in e.notes)
    # expandable segments grow one segment per stream: it reserves less here, and says so
    assert a.other_reserved_peak_bytes < a.reserved_peak_bytes


def test_expandable_segments_and_nccl_buffsize_change_the_terms():
    base = estimate(EstimateRequest(**FSDP8))
    other = estimate(EstimateRequest(**FSDP8, alloc_conf="expandable_segments:True", nccl_buffsize_bytes=2 * MIB))
    assert other.allocator.reserved_peak_bytes == base.allocator.other_reserved_peak_bytes
    assert other.per_device.nccl_bytes < base.per_device.nccl_bytes
    assert other.per_device.peak_bytes == base.per_device.peak_bytes  # the live set is the same


def test_fits_is_judged_on_reserved_not_on_the_live_peak():
    e = estimate(EstimateRequest(**FSDP8))
    d = e.per_device
    between = (d.peak_bytes + d.reserved_peak_bytes) / 2 / 2**30  # above the live peak, below reserved
    tight = estimate(EstimateRequest(**FSDP8, device_memory_gib=between))
    assert tight.per_device.peak_bytes < tight.device_capacity_bytes
    assert tight.headroom_bytes == tight.device_capacity_bytes - tight.per_device.reserved_peak_bytes
    # at capacity the allocator empties its cache and retries: it fits if the live set can be placed
    # without what was only cached; a device below the allocated peak plus the terms cannot
    low = (d.peak_bytes + d.nccl_bytes) / 2**30 * 0.999
    assert not estimate(EstimateRequest(**FSDP8, device_memory_gib=low)).fits
    assert e.fits and e.per_device.reserved_peak_bytes <= e.device_capacity_bytes


def test_cpu_ranks_have_no_allocator():
    e = estimate(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=2, gpu="cpu", device_memory_gib=400))
    assert e.allocator is None and e.per_device.reserved_peak_bytes == e.per_device.peak_bytes
    assert e.per_device.nccl_bytes == 0


def test_a_bad_alloc_conf_is_one_line_exit_2(capsys):
    code = main(["estimate", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--alloc-conf", "pinned_use_cuda_host_register:True"])
    err = capsys.readouterr().err
    assert code == 2 and "option 'pinned_use_cuda_host_register' is not modelled" in err and len(err.splitlines()) == 1


def test_emit_sets_the_allocator_settings_in_the_launch_files(tmp_path, capsys):
    code = main(["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--gpus", "8", "--gpu", "h100-80gb",
                 "--alloc-conf", "expandable_segments:True", "--emit", str(tmp_path)])
    assert code == 0
    for name in ("launch.sh", "job.sbatch"):
        text = (tmp_path / name).read_text()
        assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text and "unset PYTORCH_ALLOC_CONF" in text
    code = main(["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--gpus", "8", "--gpu", "h100-80gb",
                 "--emit", str(tmp_path / "d")])
    assert code == 0 and "unset PYTORCH_CUDA_ALLOC_CONF" in (tmp_path / "d" / "launch.sh").read_text()


def test_the_plan_replays_its_recommendation():
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    r = plan(PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, seq_len=4096, global_batch=64))
    best = r.recommended.per_device
    assert best.reserved_peak_bytes > best.peak_bytes + best.nccl_bytes  # replayed, not the lower bound
    assert best.reserved_peak_bytes <= 80 * 2**30 and any(n.startswith("memory: the search judges") for n in r.notes)


def test_the_published_allocator_rows_are_predicted():
    from bench import allocator_published as ap

    for row in ap.ROWS:
        p = ap.predict(row)
        assert "error" not in p, (row.name, p)
        assert p["reserved"] >= p["allocated"] and p["terms"] > 0
    text = ap.table([(ap.ROWS[-1], ap.predict(ap.ROWS[-1]))])
    assert "llama-cookbook #120" in text and "Simulated" in text


def test_the_plan_rejects_a_setting_whose_reserved_peak_exceeds_the_card():
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    # TP 2 x FSDP 4 at micro-batch 2: live peak 45.7 GiB of the A6000's 48, reserved (simulated,
    # torch's default allocator) 55.3 GiB: it falls back to micro-batch 1; a candidate whose live
    # peak + NCCL's buffers already exceed the card is rejected unreplayed; the recommendation's
    # replay fits
    r = plan(PlanRequest(model="llama-2-13b", gpu="rtx-a6000", gpus=8, topology="a6000-nvlink-pairs", seq_len=2048,
                         global_batch=64, headroom=0.02, compute_efficiency=0.45))  # TP 2 wins at 45%: test_tensor_parallel
    best = r.recommended.per_device
    assert best.reserved_peak_bytes <= 48 * 2**30 and best.reserved_peak_bytes > best.peak_bytes + best.nccl_bytes
    rejected = [c for c in r.candidates if c.rejected_reason and "reserved peak" in c.rejected_reason]
    assert rejected and all(c.per_device.peak_bytes <= 48 * 2**30 for c in rejected)
    tp2 = [c for c in r.candidates if c.parallel.tp == 2 and c.strategy == "fsdp" and c.fits]
    assert tp2 and all(c.micro_batch == 1 for c in tp2)


@pytest.mark.parametrize("gpu, blas", [("h100-80gb", 32 * MIB), ("a100-80gb", 8_519_680), ("b200", 8_519_680),
                                       ("mi300x", 128 * MIB)])
def test_blas_workspaces_are_allocated_at_the_first_matmul_and_kept(gpu, blas):
    """torch's CublasHandlePool.cpp: cuBLAS's 32 MiB on Hopper (sm 9.0 only), 8,519,680 bytes
    elsewhere, cuBLASLt's 1 MiB (hipBLAS 128 MiB on gfx94x, hipBLASLt 76 MiB); one pair for the
    forward's thread and one for autograd's backward thread, never freed."""
    setup = resolve(EstimateRequest(**dict(FSDP8, gpu=gpu)))
    plan = _plan([item("a buffer", 30 * MIB, "buffers")], resident=[item("weights", 10 * MIB, "parameters")])
    events = reserved.allocation_events(setup, plan, parameters=1)
    lt = 76 * 1024 * 1024 if gpu == "mi300x" else MIB
    mallocs = [e for e in events if str(e[1]).startswith("blas workspace")]
    assert [e[2] for e in mallocs] == [blas, lt, blas, lt]
    assert events.index(mallocs[0]) == 1  # after the resident weights, before the step's first tensor
    assert not [e for e in events if e[0] == "free" and str(e[1]).startswith("blas")]
    assert setup.gpu.blas_workspace_bytes == 2 * (blas + lt)
    e = estimate(EstimateRequest(**dict(FSDP8, gpu=gpu)))
    assert e.per_device.framework_bytes == e.per_device.cuda_context_bytes + 2 * (blas + lt)


def test_cpu_ranks_have_no_workspaces_and_no_context():
    setup = resolve(EstimateRequest(model_config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                                                  "intermediate_size": 128, "num_hidden_layers": 2,
                                                  "num_attention_heads": 4}, strategy="ddp", gpus=2, gpu="cpu"))
    assert setup.gpu.blas_workspace_bytes == 0 and setup.gpu.cuda_context_bytes == 0


def test_every_gpu_has_an_architecture_and_its_context_covers_the_published_ones():
    """data/cuda_context.yaml places every non-CPU GPU of gpus.yaml; each measurement names its
    source; the context used is never below a published lazy context of the architecture (the
    RTX 6000 Ada's 426 MiB raises gpus.yaml's 384 MiB for the RTX 4090 and the L4)."""
    from planner.cluster import cuda_context
    from planner.cluster.gpus import load_gpus

    for g in load_gpus().values():
        arch = cuda_context.architecture(g.name)
        if g.is_cpu:
            assert arch is None
            continue
        assert arch is not None, g.name
        # a published page, or this project's own measurement file (bench/gpu_check.py's results)
        assert all(s.startswith("https://") or (ROOT / s).is_file() for s in arch.sources), arch.sources
        assert g.cuda_context_bytes >= max((g.cuda_context_mib,) + arch.measured_mib) * MIB
    assert load_gpus()["rtx-4090"].cuda_context_bytes == 426 * MIB
    # the H200 lease's 685 MiB (bench/results/gpu_check_h200_1.json) raises every Hopper's 512 MiB envelope
    assert load_gpus()["h100-80gb"].cuda_context_bytes == 685 * MIB


def test_nvls_buffers_for_communicators_of_three_or_more_gpus_inside_an_nvswitch_node():
    """NCCL's ncclNvlsBufferSetup: channels (16) x 2 x chunk (128 KiB) x NCCL_STEPS (8) per head,
    a head per GPU of the communicator; none for 2 GPUs (ncclNvlsInit), none across nodes, none
    without NVSwitch multicast (A100, H100 PCIe)."""
    ring = reserved.nccl_communicator_bytes(None)
    setup = resolve(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h100-80gb", tp=2, cp=2))
    groups = {c.name: c for c in reserved.communicator_groups(setup)}
    assert groups["tp(2)"].intra_node and groups["cp(2)"].intra_node and groups["dp_shard_cp(4)"].intra_node
    assert [reserved.nvls_bytes(setup, c) for c in groups.values()] == [0, 0, 0, 16 * 2 * MIB * 4]
    assert reserved.nccl_bytes(setup) == 4 * ring + 64 * MIB * 2
    # 2 nodes of 8: dp_shard(16) spans both nodes, NVLS does not apply
    two = resolve(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, nodes=2, gpu="h100-80gb"))
    assert [c.intra_node for c in reserved.communicator_groups(two)] == [False]
    assert reserved.nccl_bytes(two) == ring
    for gpu in ("a100-80gb", "h100-pcie"):
        assert reserved.nccl_bytes(resolve(EstimateRequest(**dict(FSDP8, gpu=gpu)))) == ring


def test_the_plans_inverse_answers_are_judged_on_reserved_memory():
    """max_seq_len and max_micro_batch: the live peak's answers replayed through the caching
    allocator with the CUDA context and NCCL's buffers. A 512 MiB NCCL_BUFFSIZE (32 channels x 2
    connections: ~33 GiB outside the allocator) leaves the live answers standing and shortens
    the reserved ones; each answer's own estimate fits the device."""
    from planner.plan.search import plan
    from planner.plan.settings import reduce_field
    from planner.schema import PlanRequest

    base = dict(model="llama-3-8b", gpus=8, gpu="h100-80gb", seq_len=4096)
    wide = plan(PlanRequest(**base))
    narrow = plan(PlanRequest(**base, nccl_buffsize_bytes=512 * MIB))
    # the longest sequence is the recommended layout's: shorter under the narrow setting when both
    # plans recommend one layout (the narrow one may recommend another, e.g. with the optimizer offloaded)
    assert narrow.recommended.strategy != wide.recommended.strategy or narrow.max_seq_len < wide.max_seq_len
    assert narrow.max_micro_batch["fsdp"] < wide.max_micro_batch["fsdp"]
    c = narrow.recommended
    accumulation = 2 if c.micro_batch * c.gradient_accumulation > 1 else 1
    at = estimate(EstimateRequest(model="llama-3-8b", strategy=c.strategy, gpus=8, gpu="h100-80gb", micro_batch=1,
                                  seq_len=narrow.max_seq_len, checkpointing="full", gradient_accumulation=accumulation,
                                  nccl_buffsize_bytes=512 * MIB, offload_optimizer=c.offload_optimizer,
                                  offload_params=c.offload_params, **reduce_field(PlanRequest(**base), c.strategy)))
    assert at.fits and at.per_device.reserved_peak_bytes <= at.device_capacity_bytes
    assert at.per_device.peak_bytes < 0.95 * at.device_capacity_bytes  # and the live judgement alone passes

    # the longest, not only one that fits: one unit more does not fit the device once replayed
    more = estimate(at.request.model_copy(update={"seq_len": narrow.max_seq_len + 256}))
    assert not more.fits


def _probe(fits: bool, reserve: int, peak: int):
    """What longest_replayed reads of an estimate: its fit and its numbers (a 80 GB device, 1 GB
    outside the allocator)."""
    from types import SimpleNamespace

    return SimpleNamespace(fits=fits, device_capacity_bytes=80 * 2**30, per_device=SimpleNamespace(
        reserved_peak_bytes=reserve, peak_bytes=peak, cuda_context_bytes=2**29, nccl_bytes=2**29))


@pytest.mark.parametrize("step_scale", [0.0, 0.1, 1.0, 10.0])
def test_the_longest_replayed_sequence_is_the_bracket_a_bisection_closes(step_scale):
    """longest_replayed places its probes where the reserve predicts the boundary; whatever the
    prediction (a step of 0: bisection; one ten times too small or too large), the answer is the
    longest k up to the live answer whose replay fits, for every boundary, with the fragmentation
    of the capped replays jumping from unit to unit (the fit is what the replay says)."""
    import random

    from planner.plan.inverse import longest_replayed

    rng = random.Random(22)
    for live in (1, 2, 7, 60, 400):
        grow = 50 * 2**30 // live  # the live peak's growth per unit, from 20 GiB to 70 GiB
        for boundary in sorted({0, 1, live // 3, live - 1, live} | {rng.randrange(live + 1) for _ in range(4)}):
            probed = []

            def replayed(k, boundary=boundary, grow=grow):
                probed.append(k)
                peak = 20 * 2**30 + k * grow
                fits = k <= boundary
                jitter = rng.randrange(2**30)
                # a replay that fits reports its capped reserve, one that does not its uncapped one
                return _probe(fits, peak + (2**30 + jitter if fits else 12 * 2**30 + jitter), peak)

            assert longest_replayed(replayed, live, step_scale * grow) == boundary
            assert len(set(probed)) == len(probed) and max(probed) <= live


def test_the_longest_sequence_takes_few_replays(monkeypatch):
    """The plan's longest sequence on reserved memory (Llama-3-70B on 8 nodes of 8 H100s,
    bench/plan_speed.py's plan): the live answer's replay, then probes placed where the reserve
    predicts the boundary, the answer and the unit after it among them; the bisection this
    search replaced took 7 replays here."""
    from planner.memory.orchestrator import estimated
    from planner.plan import inverse
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    replayed = []

    def counted(m, *args, **kwargs):
        replayed.append(m.setup.request.seq_len)
        return estimated(m, *args, **kwargs)

    monkeypatch.setattr(inverse, "estimated", counted)
    r = plan(PlanRequest(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=8, topology="hgx-h100", seq_len=4096,
                         global_batch=55440 * 64))
    assert len(replayed) <= 4
    assert r.max_seq_len in replayed and r.max_seq_len + 256 in replayed

# --- the forward and the loss's tensors (the H200 runs of bench/gpu_check.py) --------------------

def _h200_request(seq_len: int, micro_batch: int, **fields) -> EstimateRequest:
    """A row of bench/gpu_check.py's grid: Llama-3-8B width, 2 layers, one H200, bf16-mixed."""
    config = dict(catalogue_model("llama-3-8b").config, num_hidden_layers=2)
    return EstimateRequest(model_config=config, strategy=fields.pop("strategy", "single"), gpus=1, gpu="h200",
                           precision="bf16-mixed", micro_batch=micro_batch, seq_len=seq_len, **fields)


def _live_peak(events) -> int:
    live, sizes, peak = 0, {}, 0
    for e in events:
        if e[0] == "malloc":
            sizes[e[1]] = e[2]
            live += e[2]
        elif e[0] == "free":
            live -= sizes.pop(e[1])
        peak = max(peak, live)
    return peak


def test_the_loss_tensors_are_whole_allocations_of_the_logits_size():
    setup = resolve(_h200_request(4096, 2))
    loss = reserved.loss_tensors(setup, activations(setup))
    fp32 = 4 * 8192 * 128_256  # tokens x vocab
    assert loss.forward == (fp32 // 2, fp32) and loss.backward == (fp32, fp32) and loss.saved == (fp32,)
    assert len(loss.blocks) == 2 and loss.blocks[0] < loss.blocks[1]
    plan = setup.framework.phases(setup, activations(setup), numels(setup))
    sizes = [e[2] for e in reserved.allocation_events(setup, plan, len(numels(setup)), loss) if e[0] == "malloc"]
    assert sizes.count(fp32) >= 3 and fp32 // 2 in sizes  # log-probabilities, upcast or gradients; bf16 logits
    for other in (dict(loss="chunked"), dict(keeps_outputs=True)):
        s = resolve(_h200_request(4096, 2, **other))
        got = reserved.loss_tensors(s, activations(s))
        assert got is None if "loss" in other else got.forward == (fp32,)  # kept outputs hold the logits already


@pytest.mark.parametrize("fields", [dict(strategy="ddp"), dict(strategy="ddp", checkpointing="full"),
                                    dict(finetune="qlora", checkpointing="full"), dict(finetune="lora"),
                                    dict(checkpointing="selective-op"), dict(keeps_outputs=True)])
def test_the_added_moments_never_exceed_the_phase_models_peak(fields):
    setup = resolve(_h200_request(2048, 2, **fields))
    acts = activations(setup)
    plan = setup.framework.phases(setup, acts, numels(setup))
    n = len(numels(setup))
    loss = reserved.loss_tensors(setup, acts)
    assert loss is not None
    assert _live_peak(reserved.allocation_events(setup, plan, n, loss)) == \
        _live_peak(reserved.allocation_events(setup, plan, n))


def test_the_replayed_reserved_peak_against_the_h200():
    """bench/results/gpu_check_h200_1.json and _2.json (torch.cuda.memory_stats of the real runs):
    the QLoRA rows were 21.5% and 13.5% under before the forward and the loss's tensors were
    replayed; what remains under (2.0% and 5.2%) is not accounted for (planner/memory/reserved.py)."""
    results = Path(__file__).parents[1] / "bench" / "results"
    rows = [r for name in ("gpu_check_h200_1.json", "gpu_check_h200_2.json")
            for r in json.loads((results / name).read_text())["runs"]
            if r.get("status") == "ok" and "finetune" in r["recipe"]]
    assert len(rows) == 2
    for r in rows:
        recipe = dict(r["recipe"])
        if r["checkpointing"] != "none":
            recipe["checkpointing"] = r["checkpointing"]
        sim = estimate(_h200_request(r["seq_len"], r["micro_batch"], **recipe)).allocator.reserved_peak_bytes
        assert 0.94 < sim / r["measured_reserved_peak_bytes"] < 1.2


def _events_one_at_a_time(setup, plan, parameters, loss=None):
    """allocation_events as it was written before its loops were batched: one event appended at a
    time, the common prefix asked of every key (the reference the batched loops must equal)."""
    moments = reserved._moments(plan, loss)
    units = reserved._units(setup, moments, parameters)
    tags, held, live_bytes, events, tag = {}, {}, {}, [], 0
    for n, items in enumerate(moments):
        if n == 1:
            events += [("malloc", f"blas workspace {i}", size, "default")
                       for i, size in enumerate(reserved.cuda_context.blas_workspaces(setup.gpu.name))]
        totals = {}
        for i in items:
            totals.setdefault(reserved._key(i), []).append(i.bytes)
        want = {k: [] if live_bytes.get(k) == b else reserved._cut(b, units[k]) for k, b in totals.items()}
        recorded = False
        for k in list(tags):
            if k in want and not want[k] and live_bytes.get(k) == totals[k]:
                continue
            keep = reserved._common_prefix(held[k], want.get(k, []))
            for t in reversed(tags[k][keep:]):
                if k[1] != "default":
                    events.append(("record", t, "default"))
                    recorded = True
                events.append(("free", t))
            del tags[k][keep:], held[k][keep:]
            live_bytes.pop(k, None)
        for k, sizes in want.items():
            if not sizes:
                continue
            live_bytes[k] = totals[k]
            tags.setdefault(k, []), held.setdefault(k, [])
            for size in sizes[len(held[k]):]:
                events.append(("malloc", tag, size, k[1]))
                tags[k].append(tag)
                tag += 1
            held[k][:] = sizes
        if recorded:
            events.append(("complete", "default"))
    return events


def test_the_common_prefix_is_the_first_difference():
    """_common_prefix against a walk to the first difference, on runs of equal sizes such as
    _cut makes (a set that grows, shrinks, or changes a tensor anywhere)."""
    import random

    rng = random.Random(24)
    for _ in range(500):
        held = [rng.choice((7, 7, 7, 3)) for _ in range(rng.randrange(0, 300))]
        sizes = held[:rng.randrange(0, len(held) + 1)] + [rng.choice((7, 3, 5)) for _ in range(rng.randrange(0, 50))]
        if sizes and rng.random() < 0.3:
            sizes[rng.randrange(len(sizes))] = 11
        walked = 0
        while walked < min(len(held), len(sizes)) and held[walked] == sizes[walked]:
            walked += 1
        assert reserved._common_prefix(held, sizes) == walked


@pytest.mark.parametrize("fields,records", [
    (dict(FSDP8, seq_len=4096, micro_batch=2), True),  # all-gathers on their stream: record_stream
    (dict(model="llama-3-8b", strategy="zero3", gpus=8, gpu="h100-80gb", checkpointing="full"), False),
    (dict(model="llama-3-8b", strategy="fsdp", gpus=8, nodes=2, gpu="h100-80gb", pp=2, gradient_accumulation=4,
          seq_len=2048), True),
    # per-parameter states and a resident set that changes within the step; HSDP's replicas
    (dict(model="llama-3-8b", strategy="ddp", gpus=8, gpu="h100-80gb", checkpointing="selective-attention",
          micro_batch=2, gradient_accumulation=2), False),
    (dict(model="llama-3-70b", strategy="hsdp", gpus=8, nodes=8, gpu="h100-80gb", checkpointing="full",
          micro_batch=5, seq_len=4096), True),
    # offloaded: the resident set's (empty) tensors freed at the step's start, made anew after it
    (dict(model="llama-3-70b", strategy="fsdp", gpus=8, nodes=8, gpu="h100-80gb", checkpointing="full",
          micro_batch=5, gradient_accumulation=2, offload_optimizer="cpu", offload_params="cpu"), True)])
def test_the_batched_event_loops_equal_one_event_at_a_time(fields, records):
    """allocation_events (its runs written out, the second step a copy of the first with its tags
    moved) against the loop that writes every event of every moment (_events_one_at_a_time)."""
    setup = resolve(EstimateRequest(**fields))
    acts = activations(setup)
    plan = setup.framework.phases(setup, acts, numels(setup))
    n = len(numels(setup))
    loss = reserved.loss_tensors(setup, acts)
    events = reserved.allocation_events(setup, plan, n, loss)
    assert len(events) > 100 and any(e[0] == "record" for e in events) == records
    assert events == _events_one_at_a_time(setup, plan, n, loss)


def test_the_recommendation_is_always_one_whose_replay_fits():
    """With 33 GiB of NCCL buffers outside the allocator (NCCL_BUFFSIZE 512 MiB), every shortlisted
    candidate's replay can miss; the ones after the shortlist fit only on their live peak + NCCL, a
    lower bound of what they reserve. The plan replays on until one fits, so the recommendation's
    own estimate fits the device on reserved memory."""
    from planner.plan.search import plan
    from planner.plan.settings import reduce_field
    from planner.schema import PlanRequest

    base = dict(model="llama-3-8b", gpus=8, gpu="h100-80gb", seq_len=4096)
    r = plan(PlanRequest(**base, nccl_buffsize_bytes=512 * MIB))
    c = r.recommended
    e = estimate(EstimateRequest(model="llama-3-8b", strategy=c.strategy, gpus=8, gpu="h100-80gb", seq_len=4096,
                                 micro_batch=c.micro_batch, gradient_accumulation=c.gradient_accumulation,
                                 checkpointing=c.checkpointing, nccl_buffsize_bytes=512 * MIB,
                                 offload_optimizer=c.offload_optimizer, offload_params=c.offload_params,
                                 **reduce_field(PlanRequest(**base), c.strategy)))
    assert e.fits and e.per_device.reserved_peak_bytes <= e.device_capacity_bytes
    assert c.per_device.reserved_peak_bytes == e.per_device.reserved_peak_bytes  # the plan shows the replay
    assert c is next(x for x in r.candidates if x.fits)
