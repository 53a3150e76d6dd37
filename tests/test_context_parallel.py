"""Context parallelism: the memory model against torch 2.13's ring attention as measured on CPU
ranks, and what `verify --cp N` launches or refuses. The real-rank checks (torch's own
context_parallel on two gloo ranks) are marked deepspeed (they spawn training processes)."""

from __future__ import annotations

import pytest

from planner.model.activations import FP32, estimate_activations
from planner.model.architecture import from_hf_config
from planner.parallel.context import cp_activations, merged_output_copy_bytes, ring_attention_transient_bytes
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate
from planner.schema import EstimateRequest
from tests.ports import free_port
from tests.real_runs import LLAMA, LLAMA_CP_LONG

MHA_V1024 = dict(LLAMA, vocab_size=1024, num_key_value_heads=4, max_position_embeddings=8192)


def _request(model=MHA_V1024, **fields) -> EstimateRequest:
    kw = dict(model_config=model, strategy="fsdp", gpus=2, gpu="cpu", precision="fp32", optimizer="adamw",
              micro_batch=1, seq_len=4096, cp=2)
    return EstimateRequest(**(kw | fields))


def _phase(request: EstimateRequest, name: str) -> int:
    return next(p.bytes for p in estimate(request).phases if p.name == name)


def test_ring_backward_phase_is_the_traced_one():
    """Peak trace of rank 0 (llama 4 x 64 heads, MHA, fp32, 4,096 tokens over cp 2, FSDP2 over
    the two ranks): inside block 4's backward the ring attention reached 230,994,872 bytes. The
    block's MLP saved tensors are freed by then; the ring holds the fp32 accumulators, copies of
    K and V, the local and the gathered K/V, the rotating fp32 K/V gradients and one step's kernel
    gradients. (The previous model put the ring on top of the MLP's transient and the whole
    saved set: 240,359,424, +4.1%.)"""
    predicted = _phase(_request(), "start of block 4 backward")
    assert abs(predicted - 230_994_872) / 230_994_872 < 0.005


def test_ring_transient_terms():
    """The terms of _templated_ring_attention_backward at its largest, for 2,048 local tokens of
    a 4,096-token sequence (q and kv widths 256, fp32): accumulators 3 x 2 MiB, K/V contiguous
    copies 4 MiB, local K/V cat 4 MiB, gathered K/V 8 MiB, rotating fp32 K/V gradients 2 x 4 MiB,
    one step's q/k/v gradients 6 MiB."""
    a = from_hf_config(dict(MHA_V1024))
    mib = 1 << 20
    assert ring_attention_transient_bytes(a, 4096, 2, FP32) == (6 + 4 + 4 + 8 + 8 + 6) * mib


def test_non_last_cp_ranks_save_a_copy_of_the_merged_output():
    """Rank 0 of cp 2 saves 2 x 2.1 MB per layer at the attention (the merged output and
    transformers' contiguous copy of it), rank 1 2.1 MB (peak trace): the worst rank's saved set
    is the cp=1 set at the same tokens plus one q-width tensor per layer."""
    a = from_hf_config(dict(MHA_V1024))
    local = 2048
    base = estimate_activations(a, micro_batch=1, seq_len=local, compute_bytes=FP32, attention="sdpa",
                                checkpointing="none", device="cpu")
    split = cp_activations(base, a, cp=2, tokens=4096, b=FP32)
    copy = merged_output_copy_bytes(a, local, FP32)
    assert copy == FP32 * local * 256
    assert split.saved_bytes - base.saved_bytes == a.num_layers * copy
    assert split.layer_kept_bytes - base.layer_kept_bytes == copy


def test_checkpointed_cp_keeps_the_copy_in_the_recomputed_layer_only():
    a = from_hf_config(dict(MHA_V1024))
    base = estimate_activations(a, micro_batch=1, seq_len=2048, compute_bytes=FP32, attention="sdpa",
                                checkpointing="full", device="cpu")
    split = cp_activations(base, a, cp=2, tokens=4096, b=FP32)
    assert split.saved_bytes == base.saved_bytes
    assert split.layer_saved_bytes == base.layer_saved_bytes + merged_output_copy_bytes(a, 2048, FP32)


def test_hsdp_by_cp_shards_over_dp_shard_by_cp():
    """HSDP x CP (torchtitan: FSDP2 on (dp_replicate, dp_shard_cp)): a rank holds what FSDP2 over
    its shard group of dp_shard x cp ranks holds, the same peak as fsdp over those ranks alone;
    the replicas all-reduce a 1/(dp_shard x cp) shard of the gradients (it counted the whole
    gradient when the time model took the shard group as dp_shard alone)."""
    from planner.time.step import collective_volumes

    hsdp = _request(model=LLAMA_CP_LONG, seq_len=2048, strategy="hsdp", gpus=2, nodes=2)
    result = estimate(hsdp)
    assert result.parallel.dp_replicate == 2 and result.parallel.dp_shard == 1 and result.parallel.cp == 2
    assert result.per_device.peak_bytes == estimate(_request(model=LLAMA_CP_LONG, seq_len=2048)).per_device.peak_bytes
    for request, shard in ((hsdp, 2), (_request(model=LLAMA_CP_LONG, seq_len=2048, strategy="hsdp", gpus=8,
                                                  hsdp_shard_size=4), 4)):
        rows = {r["what"]: r["bytes_per_step"] for r in collective_volumes(request)}
        assert rows["replica all-reduce of each shard"] * shard == rows["gradient reduce-scatter"]


def test_hsdp_by_cp_estimate_times_what_the_plan_times():
    """The plan's HSDP shard groups under cp are GPUs (dp_shard x cp); an estimate of the same
    request takes the same shard group, so the two give one communication time (the estimate
    timed dp_shard alone: 0.7155 s where the plan said 0.7854 s for shard groups of 8)."""
    from planner.plan.search import plan
    from planner.schema import PlanRequest
    from planner.time.step import estimate_with_time

    common = dict(model="meta-llama/Llama-3.1-8B", gpu="h100-80gb", gpus=8, nodes=2, cp=2, seq_len=32768,
                  fabric="ib-ndr")
    found = [c for c in plan(PlanRequest(global_batch=32, **common)).candidates
             if c.strategy == "hsdp" and c.parallel.pp == 1]  # (the dp x cp x pp family's best is listed too)
    assert {c.hsdp_shard_size for c in found} >= {2, 4, 8}
    for c in found:
        request = EstimateRequest(strategy="hsdp", hsdp_shard_size=c.hsdp_shard_size, micro_batch=c.micro_batch,
                                  gradient_accumulation=c.gradient_accumulation, checkpointing=c.checkpointing,
                                  **common)
        assert estimate_with_time(request).time.communication_seconds == pytest.approx(c.communication_seconds,
                                                                                      rel=1e-9)


@pytest.mark.parametrize("fields", [{"gpus": 8, "cp": 4, "hsdp_shard_size": 2},
                                    {"gpus": 8, "cp": 2, "tp": 2, "hsdp_shard_size": 2},
                                    {"gpus": 2, "nodes": 4, "cp": 4}])
def test_hsdp_shard_group_holds_whole_cp_groups(fields):
    """A shard group that would split a cp group is refused, naming hsdp_shard_size: the cp ranks
    shard the parameters together with the data-parallel ranks."""
    with pytest.raises(PlannerError, match=r"hsdp_shard_size\(2\) with cp=\d: a shard group must hold whole") as caught:
        estimate(_request(model=LLAMA_CP_LONG, seq_len=2048, strategy="hsdp", **fields))
    assert caught.value.field == "hsdp_shard_size"


def test_verify_job_carries_the_cp_mesh(tmp_path):
    """cp 2 on 2 ranks: the (dp_replicate, dp_shard, cp, tp) mesh (1, 1, 2, 1); FSDP2 over dp_shard x cp."""
    from backend.launch import worker_job

    job = worker_job(_request(model=LLAMA_CP_LONG, seq_len=1024), steps=1, warmup_steps=0,
                     out_dir=tmp_path).for_rank()
    assert job["framework"] == "torch" and job["torch"]["strategy"] == "fsdp"
    assert job["parallel"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "sequence_parallel": False, "cp": 2,
                               "tp_plan": "torchtitan"}


@pytest.mark.parametrize("fields", [{"gpus": 4, "hsdp_shard_size": 2}, {"gpus": 2, "nodes": 2}])
def test_verify_job_carries_the_hsdp_by_cp_mesh(tmp_path, fields):
    """hsdp with cp 2 on 4 ranks, shard groups of 2: the (dp_replicate, dp_shard, cp, tp) mesh
    (2, 1, 2, 1), FSDP2 on (dp_replicate, dp_shard x cp) (verify refused it before: "the probe
    composes context parallelism with FSDP2 over dp_shard x cp (strategy fsdp)")."""
    from backend.launch import worker_job

    job = worker_job(_request(model=LLAMA_CP_LONG, seq_len=1024, strategy="hsdp", **fields), steps=1,
                     warmup_steps=0, out_dir=tmp_path).for_rank()
    assert job["torch"]["strategy"] == "hsdp" and job["torch"]["sharding"] == "HYBRID_SHARD"
    assert (job["torch"]["replicas"], job["torch"]["shard_size"]) == (2, 2)
    assert job["parallel"] == {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "sequence_parallel": False, "cp": 2,
                               "tp_plan": "torchtitan"}
    wide = worker_job(_request(model=LLAMA_CP_LONG, seq_len=1024, strategy="hsdp", gpus=8, hsdp_shard_size=4),
                      steps=1, warmup_steps=0, out_dir=tmp_path).for_rank()
    assert wide["parallel"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "sequence_parallel": False, "cp": 2,
                               "tp_plan": "torchtitan"}


@pytest.mark.parametrize("fields, message", [
    ({"strategy": "fsdp-grad-op"},
     "cp=2 with strategy fsdp-grad-op: the probe composes context parallelism with FSDP2 over dp_shard x cp "
     "(strategy fsdp, with tp or without), or with HSDP over (dp_replicate, dp_shard x cp) (strategy hsdp, tp 1)"),
    ({"strategy": "hsdp", "gpus": 8, "hsdp_shard_size": 4, "tp": 2},
     "cp=2 with strategy hsdp and tp=2: the probe composes context parallelism"),
    ({"model": dict(LLAMA_CP_LONG, model_type="qwen3", head_dim=64)},
     "cp=2: the context-parallel probe does not run model_type 'qwen3': no context-parallel run of it"),
])
def test_verify_refuses_what_the_cp_probe_does_not_run(tmp_path, fields, message):
    from backend.launch import worker_job

    with pytest.raises(PlannerError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        worker_job(_request(**({"model": LLAMA_CP_LONG, "seq_len": 1024} | fields)), steps=1, warmup_steps=0,
                   out_dir=tmp_path)
    assert caught.value.field == "cp"


@pytest.mark.parametrize("fields", [{}, {"strategy": "hsdp", "gpus": 2, "nodes": 2}, {"tp": 2, "gpus": 4}])
def test_verify_refuses_offload_under_cp(tmp_path, fields):
    """The estimate offloads the parameters, gradients and states (FSDP2's CPUOffloadPolicy); the
    TP/CP probe's FSDP2 runs without one, so verify refuses rather than measure another layout."""
    from backend.launch import worker_job

    request = _request(model=LLAMA_CP_LONG, seq_len=1024, offload_optimizer="cpu", offload_params="cpu", **fields)
    assert estimate(request).per_device.peak_bytes < estimate(request.model_copy(
        update={"offload_optimizer": "none", "offload_params": "none"})).per_device.peak_bytes
    with pytest.raises(PlannerError, match="offload_params=cpu with tp=.*: the tensor/context-parallel probe's FSDP2 "
                                           "does not offload") as caught:
        worker_job(request, steps=1, warmup_steps=0, out_dir=tmp_path)
    assert caught.value.field == "offload_params"


@pytest.mark.parametrize("sp", [True, False])
def test_verify_job_carries_the_cp_by_tp_mesh(tmp_path, sp):
    """cp 2 x tp 2 on 4 ranks: the (dp_shard, cp, tp) mesh (1, 2, 2), tp innermost; FSDP2 over the
    cp ranks (verify refused it before: "tp x cp is estimated, not probed")."""
    from backend.launch import worker_job

    job = worker_job(_request(model=LLAMA_CP_LONG, seq_len=1024, tp=2, gpus=4, sequence_parallel=sp), steps=1,
                     warmup_steps=0, out_dir=tmp_path).for_rank()
    assert job["framework"] == "torch" and job["torch"]["strategy"] == "fsdp"
    assert job["parallel"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "sequence_parallel": sp, "cp": 2,
                               "tp_plan": "torchtitan"}


def test_cp_by_tp_keeps_the_tp_probes_refusals(tmp_path):
    """cp x tp runs the TP plan too: a family the TP probe refuses is refused by name under cp."""
    from backend.launch import PROBE_REFUSALS, worker_job

    assert ("qwen3", "tp") in PROBE_REFUSALS and ("qwen3", "cp") in PROBE_REFUSALS
    with pytest.raises(PlannerError, match="cp=2: the context-parallel probe does not run model_type 'qwen3'"):
        worker_job(_request(model=dict(LLAMA_CP_LONG, model_type="qwen3", head_dim=64), seq_len=1024, tp=2, gpus=4),
                   steps=1, warmup_steps=0, out_dir=tmp_path)
    with pytest.raises(PlannerError, match="cp=2 with strategy hsdp and tp=2"):
        worker_job(_request(model=LLAMA_CP_LONG, seq_len=1024, tp=2, gpus=8, strategy="hsdp", hsdp_shard_size=4),
                   steps=1, warmup_steps=0, out_dir=tmp_path)


def test_cp_with_pipeline_stages_is_still_refused(tmp_path):
    """torchtitan composes CP with PP too; the probe's pipeline schedule does not run its stages
    inside context_parallel, so verify refuses it, naming pp."""
    from backend.launch import worker_job

    message = r"pipeline probe runs pp x dp x tp only \(CP: its schedule does not run"
    with pytest.raises(PlannerError, match=message) as caught:
        worker_job(_request(model=LLAMA_CP_LONG, seq_len=1024, pp=2, gpus=4, gradient_accumulation=2), steps=1,
                   warmup_steps=0, out_dir=tmp_path)
    assert caught.value.field == "pp"


def test_gloo_ring_scratch_note_bounds_the_cp_by_tp_run():
    """llama-v256-mha-cp2-tp2-fsdp-fp32-sp-t2048 (4 CPU ranks): at the K/V gradients' all-to-all
    of block 4's ring the peak trace holds 67,349,440 bytes and gloo's 2 MiB scratch of the K/V
    all-gather, which the worker thread let go during the first ring step's kernel in one traced
    run and after it in the others (69,446,592). The block's modelled ring phase holds the first;
    the estimate names the race and its bound, which covers the run."""
    from planner.parallel.context import gloo_ring_scratch_bytes
    from tests.real_runs import BENCH_RUNS

    fields = dict(BENCH_RUNS)["llama-v256-mha-cp2-tp2-fsdp-fp32-sp-t2048"]
    result = estimate(EstimateRequest(**fields))
    block = next(p.bytes for p in result.phases if p.name == "start of block 4 backward")
    assert block - (69_446_592 - 2 * 1024 * 1024) == 361_536
    rank = from_hf_config(dict(LLAMA_CP_LONG, num_attention_heads=2, num_key_value_heads=2, head_dim=64))
    assert gloo_ring_scratch_bytes(rank, 2048, FP32) == 2 * 1024 * 1024
    note = next(n for n in result.notes if "ring attention's K/V all-gather" in n)
    above = int(note.split("up to ")[1].split(" bytes")[0].replace(",", ""))
    assert result.per_device.peak_bytes + above >= 69_446_592
    on_gpu = estimate(EstimateRequest(**(fields | {"gpu": "h100-80gb"})))
    assert not any("ring attention's K/V all-gather" in n for n in on_gpu.notes)


def test_cp_by_sp_ring_phase_counts_the_sharded_stream_and_what_the_norm_kept():
    """Under cp x tp with sequence parallelism the ring's block phase has the residual gradient
    over tokens/tp (peak trace: 524,288 bytes at 1,024 local tokens, fp32, tp 2) and the
    post-attention norm frees only what SP left of it (its shard and gathered output: 7,733,248
    bytes freed with the MLP's, where the whole norm would be 8,785,920): +526,336 bytes over the
    same phase without SP's accounting."""
    from planner.parallel.context import _freed_before_attention_bytes

    rank = from_hf_config(dict(LLAMA_CP_LONG, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                               intermediate_size=344))
    assert _freed_before_attention_bytes(rank, 1024, FP32) == 8_785_920
    assert _freed_before_attention_bytes(rank, 1024, FP32, sp_cut=1_050_624) == 7_735_296
    base = estimate_activations(rank, micro_batch=1, seq_len=1024, compute_bytes=FP32, attention="sdpa",
                                checkpointing="none", device="cpu")
    whole = cp_activations(base, rank, cp=2, tokens=2048, b=FP32, tp=2, sequence_parallel=False)
    split = cp_activations(base, rank, cp=2, tokens=2048, b=FP32, tp=2, sequence_parallel=True)
    ring_phase = FP32 * (512 * 256 + 1024 * 128) + ring_attention_transient_bytes(rank, 2048, 2, FP32) - 7_735_296
    assert ring_phase > base.layer_transient_bytes  # the ring, not the MLP, is the block's transient here
    assert split.layer_transient_bytes == ring_phase
    assert whole.layer_transient_bytes == max(base.layer_transient_bytes, ring_phase - 526_336)


def test_cpu_ring_counts_the_promoted_q_gradient_in_16_bit():
    """On CPU ranks in bf16, ``grad_query += grad_query_`` copies the bf16 step gradient to fp32
    first (TensorIterator's CPU input promotion): 524,288 bytes for 1,024 local tokens x 128 (peak
    trace, bf16 cp 2 x tp 2, at the peak); none in fp32, none on CUDA."""
    rank = from_hf_config(dict(LLAMA_CP_LONG, num_attention_heads=2, num_key_value_heads=2, head_dim=64))
    cpu, cuda = (ring_attention_transient_bytes(rank, 2048, 2, 2, device) for device in ("cpu", "cuda"))
    assert cpu - cuda == 524_288
    assert ring_attention_transient_bytes(rank, 2048, 2, FP32, "cpu") == ring_attention_transient_bytes(rank, 2048, 2,
                                                                                                         FP32, "cuda")


def test_every_cp_record_is_under_the_peak_plus_the_notes_bound():
    """The note's bound covers each recorded CP run (the prediction plus gloo's scratch, at most
    what the largest block-backward start plus the scratch exceeds the peak by)."""
    import json
    from pathlib import Path

    records = sorted((Path(__file__).resolve().parent.parent / "bench" / "results" / "runs").glob("*-cp2-*.json"))
    assert len(records) >= 3
    for path in records:
        record = json.loads(path.read_text())
        result = estimate(EstimateRequest(**record["fields"]))
        # no note where the scratch over the largest block start stays under the peak (the peak is
        # elsewhere: the final norm's backward of the run without SP)
        note = next((n for n in result.notes if "ring attention's K/V all-gather" in n), None)
        above = int(note.split("up to ")[1].split(" bytes")[0].replace(",", "")) if note else 0
        assert record["measured_peak"] <= result.per_device.peak_bytes + above, path.stem


def _cp_tp_request(**fields) -> EstimateRequest:
    kw = dict(model_config=LLAMA_CP_LONG, strategy="fsdp", gpus=4, gpu="cpu", precision="fp32", micro_batch=1,
              seq_len=2048, cp=2, tp=2)
    return EstimateRequest(**(kw | fields))


def _items(request: EstimateRequest, phase: str) -> dict[str, int]:
    found = next(p for p in estimate(request).phases if p.name == phase)
    return {i.name: i.bytes for i in found.items}


def test_fsdp_holds_the_block_befores_reduce_scatter_input_through_the_next_blocks_backward():
    """torch 2.13 _fsdp_param_group.py post_backward keeps a unit's reduce-scatter input in
    reduce_scatter_states until the next unit's post_backward (rs_wait). Peak trace (fp32, cp 2 x
    tp 2, checkpointed, rank 2, two runs): block 3's 1,583,104-byte input, allocated in its
    post_backward_reduce, live through block 2's ring backward; the record was -6.73% without it."""
    request = _cp_tp_request(checkpointing="full")
    name = "reduce-scatter input of the block before (held until this block's post_backward)"
    assert name not in _items(request, "start of block 4 backward")  # the first block in backward: none
    assert _items(request, "start of block 3 backward")[name] == 1_583_104
    assert _items(request, "start of block 1 backward")[name] == 1_583_104
    assert estimate(request).per_device.peak_phase == "start of block 1 backward"


def test_final_norms_backward_follows_the_lm_head():
    """The final LlamaRMSNorm's backward after the LM head's: its fp32 input and rsqrt saved, five
    fp32 tokens x hidden temporaries at PowBackward0 (peak trace, bf16 cp 2 x tp 2 without SP,
    rank 0: 1,048,576 bytes each, the rank's peak). Under SP the norm runs on tokens / tp. The last
    block is not yet copied out of its prefetched all-gather output then (copy-out at its own
    pre_backward, after the norm): the root alone is gathered."""
    nosp = _items(_cp_tp_request(precision="bf16-mixed", sequence_parallel=False), "after the LM head")
    assert nosp["backward transients"] == 6 * 1_048_576 + 4 * 1024
    assert nosp["all-gathered units"] == 131_584  # the root's bf16 weights
    sp = _items(_cp_tp_request(precision="bf16-mixed"), "after the LM head")
    assert sp["backward transients"] == 6 * 524_288 + 4 * 512
    gpt2 = from_hf_config(dict(model_type="gpt2", vocab_size=256, n_embd=256, n_layer=2, n_head=4, n_positions=1024))
    assert estimate_activations(gpt2, micro_batch=1, seq_len=512, compute_bytes=FP32).final_norm_transient_bytes == 0


def test_cp_by_tp_records_after_the_fixes():
    """Each new cp x tp record: checkpointed (-6.73% before the held reduce-scatter input), without
    SP (-2.87% before the final norm's backward, its peak), and over dp_shard 2 x cp 2 x tp 2."""
    import json
    from pathlib import Path

    from planner.memory.orchestrator import cpu_rank_bytes

    runs = Path(__file__).resolve().parent.parent / "bench" / "results" / "runs"
    for name, phase, bound in [("llama-v256-mha-cp2-tp2-fsdp-fp32-sp-ckpt-t2048", "start of block 1 backward", 3.0),
                               ("llama-v256-mha-cp2-tp2-fsdp-bf16-nosp-t2048", "after the LM head", 1.5),
                               ("llama-v256-mha-dp2-cp2-tp2-fsdp-fp32-sp-t1024", "start of block 4 backward", 3.0)]:
        record = json.loads((runs / f"{name}.json").read_text())
        request = EstimateRequest(**record["fields"])
        result = estimate(request)
        peak, _ = cpu_rank_bytes(result, request.gpus)
        assert result.per_device.peak_phase == phase, name
        assert abs(peak - record["measured_peak"]) / record["measured_peak"] * 100 < bound, name


def test_hsdp_by_cp_run_is_gloos_scratch_above_the_model():
    """llama-v256-mha-cp2-hsdp-fp32-2x2-t2048 (4 CPU ranks, peak trace): ranks 0 and 2 (cp rank 0
    of each replica) run the same step; rank 2 peaked at 127,764,416 bytes as gloo's 4 MiB scratch
    of block 4's K/V all-gather appeared and let it go during the ring step's kernel; rank 0's
    worker held it on through the K/V gradients' cat, 130,909,120 (the record). Without the
    scratch rank 0 held 126,714,816: the model's block phase is above both, and its note's bound
    covers the record."""
    import json
    from pathlib import Path

    from planner.parallel.context import gloo_ring_scratch_bytes

    path = Path(__file__).resolve().parent.parent / "bench" / "results" / "runs"
    record = json.loads((path / "llama-v256-mha-cp2-hsdp-fp32-2x2-t2048.json").read_text())
    predicted = estimate(EstimateRequest(**record["fields"])).per_device.peak_bytes
    scratch = gloo_ring_scratch_bytes(from_hf_config(dict(LLAMA_CP_LONG)), 2048, FP32)
    assert scratch == 4 * 1024 * 1024 and record["measured_peak"] == 130_909_120
    assert record["measured_peak"] - scratch <= predicted < record["measured_peak"]


def test_a_trace_follows_the_step_that_holds_the_peak():
    """trace_peak writes the step in which the live total first peaks: a race between threads can
    put the peak in the middle step of three (the bf16 cp 2 x tp 2 run's did), and the last
    step's trace would not show it; a peak between steps falls back to the last step."""
    pytest.importorskip("torch")
    from backend.train import peak_window

    windows = {0: (0, 100), 1: (200, 300), 2: (400, 500)}
    totals = [(50, 10), (250, 30), (260, 29), (450, 30), (480, 20)]
    assert peak_window(totals, windows) == (200, 300)
    assert peak_window([(50, 10), (350, 40), (450, 30)], windows) == (400, 500)
    assert peak_window([(450, 30), (460, 30)], windows) == (400, 500)


def test_verify_job_without_cp_or_tp_has_no_parallel_settings(tmp_path):
    from backend.job import ParallelSettings
    from backend.launch import worker_job

    job = worker_job(_request(cp=1, seq_len=1024), steps=1, warmup_steps=0, out_dir=tmp_path)
    assert job.parallel is None
    with pytest.raises(ValueError, match="tp > 1 or cp > 1"):
        ParallelSettings(dp_shard=2, tp=1, cp=1, sequence_parallel=False)


# --- torch's own context_parallel on two gloo CPU ranks --------------------------------------------

def _ranks(rank: int, world: int, port: int, mode: str, rotate: str, results) -> None:
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        from transformers import LlamaConfig, LlamaForCausalLM

        from backend.context_parallel import RING_ATTENTION, cpu_ring_attention

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, 128, (1, 32))
        positions = torch.arange(32).unsqueeze(0)
        whole = model.model(input_ids=ids, position_ids=positions).last_hidden_state
        (whole ** 2).sum().backward()
        reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        set_rotate_method(rotate)
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        AttentionInterface.register(RING_ATTENTION, sdpa_attention_forward)
        model.set_attn_implementation(RING_ATTENTION)
        try:
            with context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1]):
                ring = cpu_ring_attention() if mode == "cpu-ring" else __import__("contextlib").nullcontext()
                with ring:
                    local = model.model(input_ids=ids, position_ids=positions).last_hidden_state
                    (local ** 2).sum().backward()
        except NotImplementedError as exc:
            results[rank] = ("error", str(exc))
            return
        worst = 0.0
        for name, grad in reference.items():
            summed = dict(model.named_parameters())[name].grad.clone()
            dist.all_reduce(summed)  # each rank's tokens' share of the whole sequence's gradient
            worst = max(worst, ((summed - grad).abs().max() / grad.abs().max()).item())
        results[rank] = ("ok", worst, tuple(local.shape))
    finally:
        dist.destroy_process_group()


def _spawn(mode: str, rotate: str = "allgather") -> dict:
    import torch.multiprocessing as mp

    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(_ranks, args=(2, port, mode, rotate, results), nprocs=2, join=True)
    return dict(results)


@pytest.mark.deepspeed
def test_torchs_context_parallel_stops_at_cpus_sdpa_kernel():
    """torch 2.13 as shipped: the CP dispatcher's tables name CUDA's flash/efficient/cuDNN kernels,
    SDPA on CPU decomposes into _scaled_dot_product_flash_attention_for_cpu, and DTensor stops."""
    from backend.context_parallel import CPU_KERNEL_ERROR

    results = _spawn("stock")
    assert results[0][0] == "error" and CPU_KERNEL_ERROR in results[0][1]


@pytest.mark.deepspeed
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_torchs_ring_attention_on_cpu_ranks_gives_the_whole_sequences_gradients(rotate):
    """With the CPU kernel given to torch's ring (backend/context_parallel.py), each rank runs its
    16 load-balanced tokens of 32, and the two ranks' parameter gradients sum to the single
    process's over the whole sequence (fp32: relative 1e-3 at worst)."""
    results = _spawn("cpu-ring", rotate)
    for rank in (0, 1):
        status, worst, shape = results[rank]
        assert status == "ok" and shape == (1, 16, 64) and worst < 1e-3


def _cp_by_tp_ranks(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of cp 2 x tp 2 (dp_shard 1): the probe's construction (backend/train_parallel.py
    build_mesh, apply_tp, ContextParallelLM, FSDP2 over dp_shard x cp) and one micro-batch as
    ContextParallelEngine runs it, against the unsharded model on the whole sequence; with and
    without sequence parallelism."""
    import json
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.parallel import loss_parallel
        from transformers import LlamaConfig, LlamaForCausalLM

        from backend.context_parallel import ContextParallelLM, cpu_ring_attention
        from backend.train_parallel import apply_fsdp, apply_tp, build_mesh, fsdp_mesh

        def whole(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        parallel = {"dp_shard": 1, "cp": 2, "tp": 2}
        seq = 64
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                             use_cache=False)
        ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(1))
        labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        errors = {}
        for sp in (True, False):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            reference = LlamaForCausalLM(config)
            reference.load_state_dict(model.state_dict())
            mesh = build_mesh(parallel, torch.device("cpu"))
            apply_tp(model, mesh["tp"], sp)
            module = ContextParallelLM(model)
            apply_fsdp(module, fsdp_mesh(mesh, parallel), {"strategy": "fsdp"}, None)
            seen = {}
            model.lm_head.register_forward_hook(lambda m, args, out: seen.update(logits=out))
            inputs, shifted, positions = ids.clone(), labels.clone().contiguous(), torch.arange(seq).unsqueeze(0)
            buffers = [inputs, shifted, positions]
            with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                  no_restore_buffers=set(buffers)), cpu_ring_attention():
                loss = module(inputs, shifted, positions)
                with loss_parallel():
                    loss.backward()
            # the reference: every token's logits; the loss the cp ranks train, the mean over
            # the cp ranks (FSDP2's reduce-scatter average) of each rank's mean over its tokens
            logits = reference(input_ids=ids, position_ids=torch.arange(seq).unsqueeze(0)).logits
            per_token = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="none")
            held = [None] * world
            dist.all_gather_object(held, positions[0].tolist())
            cp_rank = mesh["cp"].get_local_rank()
            means = []
            for tokens in {tuple(h) for h in held}:
                index = torch.tensor(tokens)
                means.append(per_token[index][labels[0, index] != -100].mean())
            torch.stack(means).mean().backward()
            own = torch.tensor(held[rank])
            scale = logits.abs().max()
            prefix = "sp" if sp else "nosp"
            errors[f"{prefix} logits"] = ((whole(seen["logits"])[0] - logits[0, own]).abs().max() / scale).item()
            own_loss = per_token[own][labels[0, own] != -100].mean()
            errors[f"{prefix} loss"] = abs(whole(loss).item() - own_loss.item())
            grads = dict(reference.named_parameters())
            for name, parameter in model.named_parameters():
                expected = grads[name].grad
                errors[f"{prefix} {name}"] = ((whole(parameter.grad) - expected).abs().max()
                                              / expected.abs().max()).item()
            errors[f"{prefix} local tokens"] = len(held[rank])
            errors[f"{prefix} cp rank"] = cp_rank
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(errors, handle)
    finally:
        dist.destroy_process_group()


@pytest.mark.deepspeed
def test_cp_by_tp_gives_the_unsharded_models_logits_and_gradients(tmp_path):
    """cp 2 x tp 2 on 4 gloo ranks: each rank runs 32 load-balanced tokens of 64 on 2 of the 4
    heads (the TP plan first, then torch's ring over the cp ranks on the local heads, then FSDP2
    over the cp ranks, torchtitan's order), and its logits, its loss and every parameter's
    gradient equal the unsharded model's on the whole sequence (fp32: relative 1e-4 at worst),
    with sequence parallelism and without."""
    import json

    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_cp_by_tp_ranks, args=(4, port, str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for prefix in ("sp", "nosp"):
            assert errors.pop(f"{prefix} local tokens") == 32 and errors.pop(f"{prefix} cp rank") == rank // 2
        assert sum(".self_attn.q_proj." in name for name in errors) == 4  # 2 layers, sp and not
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-4, (rank, worst, errors[worst])


def _hsdp_by_cp_ranks(rank: int, world: int, port: int, out_dir: str, parallel: dict) -> None:
    """One rank of HSDP x CP: the probe's (dp_replicate, dp_shard, cp, tp) mesh (build_mesh),
    ContextParallelLM, FSDP2 on (dp_replicate, dp_shard x cp) (fsdp_mesh, apply_fsdp), one
    micro-batch as ContextParallelEngine runs it. Each replica trains its own sequence, so the
    replicas' all-reduce is seen: every rank's gradients must be the mean over the replicas of the
    unsharded model's gradients of the mean over the cp ranks of each rank's mean loss."""
    import json
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import context_parallel
        from transformers import LlamaConfig, LlamaForCausalLM

        from backend.context_parallel import ContextParallelLM, cpu_ring_attention
        from backend.train_parallel import apply_fsdp, build_mesh, fsdp_mesh

        seq = 64
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                             use_cache=False)
        replicas = parallel["dp_replicate"]
        sequences = torch.randint(0, 128, (replicas, seq), generator=torch.Generator().manual_seed(1))
        labels = torch.nn.functional.pad(sequences, (0, 1), value=-100)[:, 1:]
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        reference = LlamaForCausalLM(config)
        reference.load_state_dict(model.state_dict())
        mesh = build_mesh(parallel, torch.device("cpu"))
        module = ContextParallelLM(model)
        dp_mesh = fsdp_mesh(mesh, parallel)
        apply_fsdp(module, dp_mesh, {"strategy": "hsdp"}, None)
        replica = mesh["dp_replicate"].get_local_rank()
        seen = {}
        model.lm_head.register_forward_hook(lambda m, args, out: seen.update(logits=out))
        inputs, shifted = sequences[replica:replica + 1].clone(), labels[replica:replica + 1].clone().contiguous()
        positions = torch.arange(seq).unsqueeze(0)
        buffers = [inputs, shifted, positions]
        with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1],
                              no_restore_buffers=set(buffers)), cpu_ring_attention():
            loss = module(inputs, shifted, positions)
            loss.backward()
        held = [None] * world
        dist.all_gather_object(held, (replica, positions[0].tolist()))
        replica_means, errors = [], {}
        for r in range(replicas):
            logits = reference(input_ids=sequences[r:r + 1], position_ids=torch.arange(seq).unsqueeze(0)).logits
            per_token = torch.nn.functional.cross_entropy(logits[0], labels[r], ignore_index=-100, reduction="none")
            means = [per_token[torch.tensor(t)][labels[r, torch.tensor(t)] != -100].mean()
                     for t in sorted({tuple(t) for rr, t in held if rr == r})]
            replica_means.append(torch.stack(means).mean())
            if r == replica:
                own = torch.tensor(held[rank][1])
                errors["logits"] = ((seen["logits"][0] - logits[0, own]).abs().max() / logits.abs().max()).item()
                errors["loss"] = abs(loss.item() - per_token[own][labels[r, own] != -100].mean().item())
        torch.stack(replica_means).mean().backward()
        grads = dict(reference.named_parameters())
        for name, parameter in model.named_parameters():
            expected = grads[name].grad
            got = parameter.grad.full_tensor() if isinstance(parameter.grad, DTensor) else parameter.grad
            errors[name] = ((got - expected).abs().max() / expected.abs().max()).item()
        errors["local tokens"] = len(held[rank][1])
        errors["replica"] = replica
        errors["mesh"] = [list(dp_mesh.mesh_dim_names), list(dp_mesh.shape)]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(errors, handle)
    finally:
        dist.destroy_process_group()


def _spawn_hsdp_by_cp(out_dir, parallel: dict) -> dict:
    import json

    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_hsdp_by_cp_ranks, args=(4, port, str(out_dir), parallel), nprocs=4, join=True)
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(4)}


@pytest.mark.deepspeed
def test_hsdp_by_cp_gives_the_unsharded_models_logits_and_gradients(tmp_path):
    """HSDP x CP on 4 gloo ranks, (dp_replicate 2, dp_shard 1, cp 2): ranks 0-1 and 2-3 are the
    two replicas, each pair the ring over its own sequence's 32 + 32 load-balanced tokens, FSDP2
    sharding over the pair and all-reducing the shards across the replicas. Each rank's logits
    and loss equal the unsharded model's on its tokens, and every parameter's gradient the
    unsharded model's of the replicas' mean loss (fp32: relative 1e-4 at worst)."""
    results = _spawn_hsdp_by_cp(tmp_path, {"dp_replicate": 2, "dp_shard": 1, "cp": 2, "tp": 1})
    for rank, errors in results.items():
        assert errors.pop("local tokens") == 32 and errors.pop("replica") == rank // 2
        mesh = errors.pop("mesh")
        assert sum(".self_attn.q_proj." in name for name in errors) == 2
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-4, (rank, worst, errors[worst])
        assert mesh == [["dp_replicate", "dp_shard_cp"], [2, 2]]


@pytest.mark.parametrize("checkpointing, gathers", [("none", 8), ("full", 12)])
def test_cp_exchange_is_what_the_ranks_sent(checkpointing, gathers):
    """Counted on rank 0 of cp 2 (4 layers, 1,024 tokens, K/V width 256, fp32): the ring's K/V
    all-gathers, 2,097,152 bytes each, 8 per step, 12 under full checkpointing (the recomputed
    forward gathers again); the fp32 K/V gradients' permute, 1,048,576 bytes sent, 8 per step."""
    from planner.time.step import collective_volumes

    rows = {r["what"]: r["bytes_per_step"] for r in
            collective_volumes(_request(model=LLAMA_CP_LONG, seq_len=1024, checkpointing=checkpointing))
            if r["what"].startswith("CP ")}
    gathered = next(v for k, v in rows.items() if k.startswith("CP K/V all-gathers"))
    assert gathered == gathers * 2_097_152
    assert rows["CP K/V gradient ring (fp32)"] == 8 * 1_048_576
