"""torch.compile with the selective checkpointing policies (planner/recipes/compile.py): torchtitan's default
recipe compiles each block over its per-op SAC wrapper. Measured on CPU: a compiled block saves at most what
eager SAC (and eager core-attention recompute) keeps, so the planner's eager saved set bounds the compiled
run's; the compiled backward reruns the linears the policy recomputes, and the forward's fused kernels as
inductor schedules them among the backward's (planner/time/fusion.py recompute_bytes)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from planner.cluster.gpus import load_gpus
from planner.errors import PlannerError
from planner.memory.orchestrator import estimate, measure, resolve
from planner.model.activations import estimate_activations
from planner.model.architecture import from_hf_config, layer_specs
from planner.schema import EstimateRequest
from planner.time import fusion
from planner.time.kernels import Recompute, micro_batch_terms, rates, recompute_shares, work
from planner.time.step import estimate_with_time
from tests.real_runs import LLAMA, OLMO2, QWEN3
from tests.test_compile import BASE, TOKENS, _block, _build, _forward_backward_bytes, _request

POLICIES = ("selective-op", "selective-attention")
LINEARS = 7  # q, k, v, o, gate, up, down: two matmuls each in backward
BLOCKS = {"llama": LLAMA, "qwen3": QWEN3}


def _checkpointed(block, kwargs, policy: str, torch):
    """The block as torchtitan wraps it before compiling (a non-reentrant checkpoint with the per-op policy,
    backend/checkpointing.py), or as is where core-attention recompute sits inside its attention."""
    from torch.utils.checkpoint import checkpoint

    from backend.checkpointing import selective_op_context

    if policy == "selective-op":
        return lambda x: checkpoint(block, x, use_reentrant=False, context_fn=selective_op_context, **kwargs)
    return lambda x: block(x, **kwargs)


def _live_after_forward(fn, x, torch) -> int:
    """Bytes the forward leaves live beyond its output, by the c10 CPU allocator's running total (as
    tests/test_compile.py _forward_backward_bytes): what the block keeps for backward."""
    from torch._C._profiler import _EventType

    from backend.train import _profiled_events, count_every_thread

    count_every_thread()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.profiler.record_function("sac_test_forward"):
            y = fn(x)
    y = y[0] if isinstance(y, tuple) else y
    output = y.untyped_storage().nbytes()
    totals, start, end = [], None, None
    for event in _profiled_events(prof):
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            totals.append((event.start_time_ns, int(event.typed[1].total_allocated)))
        elif event.typed[0] == _EventType.TorchOp and event.name == "sac_test_forward":
            start, end = event.start_time_ns, event.start_time_ns + event.duration_time_ns
    totals.sort()
    before = [total for t, total in totals if t < start]
    base = before[-1] if before else totals[0][1]
    after = [total for t, total in totals if t <= end][-1]
    y.sum().backward()
    return after - base - output


def _backward_ops(fn, x, torch) -> tuple[int, int]:
    """(matmuls, attention forwards) in the compiled backward graph, as the partitioner inductor runs
    (min_cut_rematerialization_partition, compiler="inductor") cuts the joint graph; an attention forward
    rerun for recompute runs inside run_with_rng_state (SDPA draws from the RNG)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    counts = []

    def backward(gm, _):
        nodes = list(gm.graph.nodes)
        mms = sum(n.target == torch.ops.aten.mm.default for n in nodes)
        attention = sum(("scaled_dot_product" in str(n.target) and "backward" not in str(n.target))
                        or ("rng_state" in str(n.target) and any("scaled_dot_product" in str(a) for a in n.args))
                        for n in nodes)
        counts.append((mms, attention))
        return make_boxed_func(gm.forward)

    compiler = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward,
                            partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"))
    torch._dynamo.reset()
    y = torch.compile(fn, backend=compiler, fullgraph=True)(x)
    (y[0] if isinstance(y, tuple) else y).sum().backward()
    torch._dynamo.reset()
    assert len(counts) == 1, "one graph: the block compiled whole"
    return counts[0]


@pytest.fixture
def side_effects_skipped():
    """torchtitan's apply_compile sets it (torchtitan b5bcd76 distributed/compile.py lines 57-64): the
    transformers block's kernel-hub context variable is a forward side effect a checkpoint may not replay."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config = torch._dynamo.config
    before = config.skip_fwd_side_effects_in_bwd_under_checkpoint
    config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    yield torch
    config.skip_fwd_side_effects_in_bwd_under_checkpoint = before


# the compiled block's saved bytes over eager's, as planner/recipes/compile.py states them
RATIOS = {"selective-op": (0.80, 0.88), "selective-attention": (0.55, 0.70)}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_compiled_checkpointed_block_saves_at_most_eager_and_the_planners(name, policy, side_effects_skipped):
    torch = side_effects_skipped
    from backend.checkpointing import core_attention_recompute

    torch.manual_seed(0)
    attention = core_attention_recompute("sdpa") if policy == "selective-attention" else "sdpa"
    block, x, kwargs = _block(BLOCKS[name], torch, attention)
    fn = _checkpointed(block, kwargs, policy, torch)
    eager = _live_after_forward(fn, x, torch)
    mms, attention_reruns = _backward_ops(fn, x, torch)
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    for _ in range(2):  # compile, then run as trained
        compiled(x).sum().backward()
    saved = _live_after_forward(compiled, x, torch)
    torch._dynamo.reset()

    arch = from_hf_config(BLOCKS[name])
    acts = estimate_activations(arch, micro_batch=1, seq_len=TOKENS, compute_bytes=2, checkpointing=policy,
                                device="cpu")
    planned = acts.kept_blocks[0] - 2 * TOKENS * arch.hidden_size  # beyond the block's input, live before
    low, high = RATIOS[policy]
    assert saved <= eager <= planned, (saved, eager, planned)
    assert low <= saved / eager <= high, (saved, eager)
    if policy == "selective-op":
        assert eager == planned  # eager SAC: the planner's count to the byte
        assert (mms, attention_reruns) == (2 * LINEARS + 3, 0)  # k, o and up rerun (every second mm)
    else:
        assert (mms, attention_reruns) == (2 * LINEARS, 1)  # the attention forward rerun, no linear


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_checkpointed_runs_save_at_most_eagers_bytes(policy, side_effects_skipped, monkeypatch):
    """Whole tiny Llamas (two fp32 blocks, the loss): eager under the policy, its blocks compiled in place
    (torchtitan: after the checkpoint wrapping), and the whole model compiled."""
    from backend.checkpointing import core_attention_recompute
    from backend.train import apply_checkpointing
    import tests.test_compile as compiled_runs

    def build(family):
        model = _build(family)
        if policy == "selective-attention":
            model.set_attn_implementation(core_attention_recompute("sdpa"))
        apply_checkpointing(model, {"checkpointing": policy, "checkpointing_every": None})
        return model

    monkeypatch.setattr(compiled_runs, "_build", build)
    acts = measure(resolve(EstimateRequest(**BASE, checkpointing=policy))).acts
    predicted_peak = acts.saved_bytes + acts.peak_extra_bytes
    saved, peak = _forward_backward_bytes("llama", "none")
    assert abs(saved - acts.saved_bytes) <= 0.1 * acts.saved_bytes, (saved, acts.saved_bytes)
    for mode in ("blocks", "model"):
        compiled_saved, compiled_peak = _forward_backward_bytes("llama", mode)
        print(f"{policy} {mode}: saved {compiled_saved:,} vs eager {saved:,} (planner {acts.saved_bytes:,}); "
              f"peak {compiled_peak:,} vs eager {peak:,} (planner {predicted_peak:,})")
        assert compiled_saved <= saved and compiled_saved <= acts.saved_bytes, (mode, compiled_saved, saved)
        assert compiled_peak <= predicted_peak, (mode, compiled_peak, predicted_peak)
        if mode == "blocks":  # the whole model's backward graph holds its parameter gradients to its end (README)
            assert compiled_peak <= peak, (mode, compiled_peak, peak)


def test_recompute_bytes_hand_derived():
    """From fusion.py's kernels (per token, bf16): pre-norm (Llama) drops the last residual add (read x, attn_out,
    mlp_out; write out: 4 hidden-width tensors) and the activation's reads of gate and up, and under per-op SAC
    the attention-input norm's read of x; post-norm (OLMo-2) drops its last kernel (read x2, mlp_out; write out
    and norm2's statistic), and under per-op SAC only the activation's reads (full reruns the down projection
    for norm2's backward, so the product is needed first)."""
    c = 2
    for config, output in ((LLAMA, lambda h: 4 * c * h), (OLMO2, lambda h: 3 * c * h + 4)):
        arch = from_hf_config(config)
        spec = layer_specs(arch)[0]
        h, act_reads = arch.hidden_size, 2 * c * spec.mlp.intermediate_size
        forward = fusion.block_traffic(arch, spec, 1, False, c).forward_bytes
        pre = spec.norm_placement == "pre"
        assert fusion.recompute_bytes(arch, spec, 1, False, c, "selective-op") == \
            forward - output(h) - act_reads - (c * h if pre else 0)
        assert fusion.recompute_bytes(arch, spec, 1, False, c, "full") == \
            forward - output(h) - (act_reads if pre else 0)
    with pytest.raises(ValueError, match="selective-attention"):
        fusion.recompute_bytes(arch, spec, 1, False, c, "selective-attention")


def _rerun_bytes(config: dict, policy: str, torch) -> float:
    """Per token, the bytes inductor's CPU kernels of a checkpointed block's backward move beyond the plain
    block's (tests/test_fusion.py _compile_block: inductor's own per-kernel count); the CPU flash attention's
    logsumexp copy left out (a kernel whose every per-token buffer is the logsumexp's: fp32 per head)."""
    from torch.utils.checkpoint import checkpoint

    from backend.checkpointing import selective_op_context
    from tests.test_fusion import TOKENS as FUSION_TOKENS, _compile_block, _is_bias_gradient

    options = {"context_fn": selective_op_context} if policy == "selective-op" else {}
    wrap = (lambda block: lambda x, **kw: checkpoint(block, x, use_reentrant=False, **options, **kw))
    lse = 4 * from_hf_config(config).num_attention_heads * FUSION_TOKENS

    def moved(graphs) -> float:
        kernels = [k for k in graphs[1] if not _is_bias_gradient(k) and set(k[3].values()) != {lse}]
        return sum(k[0] for k in kernels) / FUSION_TOKENS

    return moved(_compile_block(config, torch, wrap)) - moved(_compile_block(config, torch))


@pytest.mark.parametrize("name, config, policy", [("llama", LLAMA, "selective-op"), ("qwen3", QWEN3, "selective-op"),
                                                  ("olmo2", OLMO2, "selective-op"), ("qwen3", QWEN3, "full"),
                                                  ("llama", LLAMA, "full")])
def test_recompute_bytes_match_inductor_on_cpu(name, config, policy, side_effects_skipped):
    """Per-op SAC: Llama, Qwen3 (pre-norm) and OLMo-2 (post-norm) to 2%; full: Qwen3 to 2%, Llama's CPU rerun
    writes the rotated q and k once more (one more q-width and kv-width write per token)."""
    torch = side_effects_skipped
    arch = from_hf_config(config)
    spec = layer_specs(arch)[0]
    model = fusion.recompute_bytes(arch, spec, 1, False, 2, policy, "cpp")
    measured = _rerun_bytes(config, policy, torch)
    if (name, policy) == ("llama", "full"):
        assert measured == pytest.approx(model + 2 * (spec.attention.q_width + spec.attention.kv_width), rel=0.02)
    else:
        assert measured == pytest.approx(model, rel=0.02), (measured, model)


def test_compiled_recompute_term_composes_the_fused_rerun():
    arch = from_hf_config(LLAMA)
    r = rates(load_gpus()["h100-80gb"], "bf16")
    eager, compiled = (work(arch, 1024, 1, 1, False, 2, False, r, compiled=mode) for mode in ("none", "blocks"))
    assert eager.elementwise_rerun_bytes == ()
    for policy in ("selective-op", "full"):
        rerun = sum(fusion.recompute_bytes(arch, s, 1, False, 2, policy) for s in layer_specs(arch)) * 1024
        assert dict(compiled.elementwise_rerun_bytes)[policy] == pytest.approx(rerun)
        shares = recompute_shares(arch, policy)
        terms = micro_batch_terms(compiled, 2, r, 2, policy, shares=shares)
        alone = micro_batch_terms(compiled, 2, r, 2, policy, shares=Recompute(shares.matmul, shares.attention))
        assert terms.recompute - alone.recompute == pytest.approx(2 * rerun / r.memory_bytes_per_s)
    # eager reruns its whole forward op by op
    eager_terms = micro_batch_terms(eager, 2, r, 2, "selective-op", shares=Recompute(elementwise=1.0))
    assert eager_terms.recompute == pytest.approx(2 * (eager.elementwise_bytes + eager.elementwise_excess_bytes)
                                                  / r.memory_bytes_per_s)


# torchtitan's Llama 3.1 8B H200 recipe (benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md: local batch 2,
# seq 8192 from llama3_8b.toml, --training.compile, the toml's selective op AC), here on one node, bf16
H200_8B = dict(model="llama-3.1-8b", gpu="h200", gpus=8, strategy="fsdp", seq_len=8192, micro_batch=2)


def _recompute_seconds(result) -> float:
    return sum(t.seconds for t in result.time.terms if t.name.startswith("recompute"))


def test_compiled_selective_op_between_none_and_full_on_8b_h200():
    runs = {(c, p): estimate_with_time(EstimateRequest(**H200_8B, compile=c, checkpointing=p))
            for c in ("none", "blocks") for p in ("none", "selective-op", "full")}
    rec = {k: _recompute_seconds(r) for k, r in runs.items()}
    step = {k: r.time.step_seconds for k, r in runs.items()}
    assert rec[("blocks", "none")] == 0 < rec[("blocks", "selective-op")] < rec[("blocks", "full")]
    assert step[("blocks", "none")] < step[("blocks", "selective-op")] < step[("blocks", "full")]
    # the same linears rerun (k, o and up: every second mm); the elementwise rerun shrinks to inductor's fused
    # kernels: 0.125 s compiled against 0.215 s eager per step (matmul 0.11 s of it)
    assert 0.1 < rec[("blocks", "selective-op")] < 0.16 < 0.2 < rec[("none", "selective-op")]
    assert step[("blocks", "selective-op")] < step[("none", "selective-op")]
    # memory: eager SAC's saved set, an upper bound (0.84 of it measured compiled)
    peaks = [runs[(c, "selective-op")].per_device.peak_bytes for c in ("blocks", "none")]
    assert peaks[0] == peaks[1]
    note = next(n for n in runs[("blocks", "selective-op")].notes if n.startswith("torch.compile"))
    assert "84% of eager per-op SAC's" in note and "checkpointing selective-op" in note


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ("blocks", "model"))
def test_compile_estimates_the_selective_policies_at_eager_memory(policy, mode):
    eager, compiled = (estimate_with_time(_request(compile=c, checkpointing=policy)) for c in ("none", mode))
    assert compiled.per_device.peak_bytes == eager.per_device.peak_bytes
    assert compiled.time.step_seconds < eager.time.step_seconds
    assert 0 < _recompute_seconds(compiled) <= _recompute_seconds(eager)


@pytest.mark.parametrize("fields, why", [({"pp": 2, "gpus": 8, "checkpointing": "selective-op"}, "pp=2"),
                                         ({"activation_offload": True, "checkpointing": "selective-op"},
                                          "activation_offload"),
                                         ({"finetune": "lora", "checkpointing": "selective-attention"},
                                          "finetune lora")])
def test_compile_with_selective_policies_still_refuses_the_rest(fields, why):
    with pytest.raises(PlannerError) as e:
        estimate(_request(compile="blocks", **fields))
    assert e.value.field == "compile" and why in str(e.value)


def test_torchtitan_llama3_8b_toml_compiled_with_its_selective_op():
    """The toml's own AC (selective, op) with compile.enable: read and estimated, no longer refused."""
    from planner.check import check
    from planner.schema import CheckRequest

    path = Path(__file__).parent / "fixtures" / "jobfiles" / "torchtitan" / "llama3_8b.toml"
    body = CheckRequest(files=[{"name": path.name, "text": path.read_text()}], gpus=8, nodes=8,
                        overrides={"compile.enable": "true"})
    request = check(body, estimate_with_time).request
    assert (request.compile, request.checkpointing) == ("blocks", "selective-op")



def test_plan_under_compile_with_selective_op_runs_faster_than_eager():
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    base = {"model": "llama-3.1-8b", "gpu": "h200", "gpus": 8, "seq_len": 8192, "global_batch": 16,
            "checkpointing": "selective-op"}
    eager, compiled = plan(PlanRequest(**base)), plan(PlanRequest(**base, compile="blocks"))
    assert compiled.candidates and all(c.checkpointing == "selective-op" and c.parallel.pp == 1
                                       for c in compiled.candidates)
    assert compiled.recommended.step_seconds < eager.recommended.step_seconds


def test_whole_model_compile_under_accumulation_is_refused_and_the_plan_searches_one_micro_batch():
    """A whole-model compiled backward returns every gradient when it ends, beside the accumulated .grad from
    the second micro-batch on: not in the memory model, so refused with the field; the plan keeps each
    rank's share of the batch as one micro-batch."""
    import pytest as _pytest

    from planner.errors import PlannerError
    from planner.memory.orchestrator import estimate
    from planner.plan.search import plan
    from planner.schema import EstimateRequest, PlanRequest

    base = dict(model="llama-3.2-1b", strategy="ddp", gpus=8, gpu="h100-80gb", seq_len=2048, micro_batch=2)
    with _pytest.raises(PlannerError, match="gradient_accumulation 4") as info:
        estimate(EstimateRequest(**base, gradient_accumulation=4, compile="model"))
    assert info.value.field == "compile"
    assert estimate(EstimateRequest(**base, gradient_accumulation=4, compile="blocks")).fits
    assert estimate(EstimateRequest(**base, gradient_accumulation=1, compile="model")).fits
    planned = plan(PlanRequest(model="llama-3.2-1b", gpu="h100-80gb", gpus=8, seq_len=2048, global_batch=64,
                               compile="model"))
    assert planned.recommended is not None
    assert planned.recommended.gradient_accumulation == 1
    assert all(c.gradient_accumulation == 1 for c in planned.candidates)
    assert any("without gradient accumulation" in n for n in planned.notes)
