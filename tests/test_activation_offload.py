"""activation_offload (planner/recipes/activation_offload.py): TRL 1.16's OffloadActivations keeps the
saved tensors in pinned host memory; the device holds what is brought back, one block at a time."""

import pytest

from planner.errors import PlannerError
from planner.memory.orchestrator import estimate, resolve
from planner.memory.rank_activations import activations
from planner.model.activations import estimate_activations
from planner.model.catalogue import catalogue_model
from planner.schema import EstimateRequest
from planner.time.step import PCIE_DEVICE_TO_HOST_GBPS, estimate_with_time

BASE = dict(model="llama-3-8b", gpus=8, gpu="h100-80gb", strategy="zero3", micro_batch=2, seq_len=4096)


def _acts_at(result, kind):
    phase = next(p for p in result.phases if p.kind == kind)
    return sum(i.bytes for i in phase.items if i.name == "saved activations")


def test_the_device_holds_the_loss_at_its_backward_and_one_block_in_its_own():
    on, off = estimate(EstimateRequest(**BASE, activation_offload=True)), estimate(EstimateRequest(**BASE))
    acts = estimate_activations(catalogue_model("llama-3-8b").architecture, micro_batch=2, seq_len=4096,
                                compute_bytes=2, attention="sdpa")
    tokens, hidden, vocab = 2 * 4096, 4096, 128_256
    lm_head_input = tokens * hidden * 2
    norm = 4 * tokens * hidden + 4 * tokens  # an RMSNorm's fp32 input and rsqrt, each saved twice
    # each block keeps on the device what it saves twice: its two norms', and the normed inputs of
    # q/k/v and of gate/up (bf16, ZeRO-3: no autocast)
    kept = 2 * norm + 2 * (2 * tokens * hidden)
    rope = 2 * 4096 * 128 * 2
    # the loss's saved fp32 log-probabilities and int64 labels brought back, the LM head's input kept
    at_loss = 4 * tokens * vocab + 8 * tokens + lm_head_input + norm + rope
    assert _acts_at(on, "start_of_backward") == at_loss + 32 * kept
    assert _acts_at(off, "start_of_backward") == acts.saved_bytes
    starts = {p.name: _acts_at_phase(p) for p in on.phases if p.kind == "start_of_block"}
    # block 32 (the first backward meets): its own saved set, and the 31 blocks before it keep theirs
    assert starts["start of block 32 backward"] == acts.layer_saved_bytes + 31 * kept
    assert starts["start of block 1 backward"] == acts.layer_saved_bytes
    assert {p.name: _acts_at_phase(p) for p in on.phases if p.kind == "end_of_block"}["end of block 1 backward"] == 0
    assert on.per_device.peak_bytes < off.per_device.peak_bytes
    # the host: every saved tensor but the LM head's input, per rank, summed over the node's 8 ranks,
    # in power-of-two pinned blocks (hidden 4,096 and 14,336 wide at 8,192 tokens: 14,336 rounds up by 8/7)
    moved = acts.saved_bytes - lm_head_input
    assert on.host.peak_bytes == on.host.pinned_bytes == on.host.resident_bytes
    assert on.host.peak_bytes == 8 * int(moved * (2 ** 28 / (tokens * 14_336 * 2)))
    assert off.host.peak_bytes == 0
    assert any(f"{moved:,} bytes per micro-batch per rank to the host and back" in n for n in on.notes)


def _acts_at_phase(phase):
    return sum(i.bytes for i in phase.items if i.name == "saved activations")


def test_with_full_checkpointing_only_the_block_inputs_go_to_the_host():
    req = BASE | {"checkpointing": "full"}
    on = estimate(EstimateRequest(**req, activation_offload=True))
    setup = resolve(EstimateRequest(**req, activation_offload=True))
    acts = activations(setup)
    tokens = 2 * 4096
    assert acts.host_offload and acts.layer_kept_bytes == tokens * 4096 * 2  # each block's input
    assert acts.offloaded_bytes == acts.saved_bytes - tokens * 4096 * 2
    # a block's backward: its input brought back, and its recomputed saved set
    start = [p for p in on.phases if p.kind == "start_of_block"]
    assert all(_acts_at_phase(p) == acts.layer_kept_bytes + acts.layer_saved_bytes for p in start)
    without = estimate(EstimateRequest(**req))
    assert on.per_device.peak_bytes <= without.per_device.peak_bytes


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero0", "zero1", "zero2", "zero3", "fsdp", "hsdp"])
def test_every_strategy_holds_less_on_the_device_and_the_same_on_the_host(strategy):
    gpus = 1 if strategy == "single" else 8
    req = BASE | {"strategy": strategy, "gpus": gpus, "model": "llama-3.2-1b", "micro_batch": 4} | (
        {"hsdp_shard_size": 4} if strategy == "hsdp" else {})
    on, off = estimate(EstimateRequest(**req, activation_offload=True)), estimate(EstimateRequest(**req))
    assert on.per_device.peak_bytes < off.per_device.peak_bytes
    assert on.per_device.resident_bytes == off.per_device.resident_bytes
    assert on.host.peak_bytes > 0 and on.host.peak_bytes % gpus == 0


def test_lora_composes():
    req = dict(model="llama-3-8b", gpus=1, gpu="h100-80gb", micro_batch=4, seq_len=2048, finetune="qlora")
    on, off = estimate(EstimateRequest(**req, activation_offload=True)), estimate(EstimateRequest(**req))
    assert on.per_device.peak_bytes < off.per_device.peak_bytes
    assert on.per_device.frozen_weights_bytes == off.per_device.frozen_weights_bytes
    assert on.host.peak_bytes > 0


def test_on_cpu_ranks_the_live_total_adds_only_what_is_kept_beside_its_copy():
    """Host and device are one memory: TRL's host copies replace the originals, Tensor.to("cpu")
    returns the copy itself at unpack, and the repeated saves stay beside their copies (what the
    CPU runs measure); at the loss, the forward's end (the log-probabilities and their copy, the
    bf16 logits and their fp32 upcast: 10 bytes per logit) exceeds the backward's 8."""
    req = dict(model="llama-3.2-1b", gpu="cpu", gpus=2, strategy="zero2", micro_batch=1, seq_len=256)
    on, off = estimate(EstimateRequest(**req, activation_offload=True)), estimate(EstimateRequest(**req))
    tokens, hidden, layers, vocab = 256, 2048, 16, 128_256
    norm = 4 * tokens * hidden + 4 * tokens
    kept = 2 * norm + 2 * (2 * tokens * hidden)
    start = {p.kind: p for p in on.phases}["start_of_backward"]
    before = {p.kind: p for p in off.phases}["start_of_backward"]
    assert start.bytes - before.bytes == layers * kept + norm + 2 * tokens * vocab
    ends = [(a.bytes, b.bytes) for a, b in zip(on.phases, off.phases) if a.kind == "end_of_backward"]
    assert ends and all(a == b for a, b in ends)
    assert on.host.peak_bytes == 0
    assert any("on CPU ranks the host copies are the rank's own memory" in n for n in on.notes)


def test_the_step_pays_the_host_link():
    """Backward's copies back are waited for (no prefetch), the forward's hide behind the forward's
    compute up to its length: moved / pcie <= the term <= 2 x moved / pcie."""
    pcie = PCIE_DEVICE_TO_HOST_GBPS["gen5"] * 1e9  # h100-80gb's host link
    for checkpointing in ("none", "full"):
        req = BASE | {"checkpointing": checkpointing}
        on = estimate_with_time(EstimateRequest(**req, activation_offload=True)).time
        off = estimate_with_time(EstimateRequest(**req)).time
        moved = activations(resolve(EstimateRequest(**req, activation_offload=True))).offloaded_bytes
        term = next(t for t in on.terms if t.name == "of which activation offload")
        assert moved / pcie <= term.seconds <= 2 * moved / pcie
        assert on.offload_seconds == pytest.approx(off.offload_seconds + term.seconds, rel=1e-9)
        assert on.step_seconds == pytest.approx(off.step_seconds + term.seconds, rel=1e-6)
        if checkpointing == "full":  # 6.6 GB: the forward's copies fit in its compute
            assert term.seconds == pytest.approx(moved / pcie, rel=1e-9)
        else:  # 57 GB: they do not (over a second of copying against a forward of 0.2 s)
            assert term.seconds > 1.5 * moved / pcie


def test_refusals_name_the_field():
    with pytest.raises(PlannerError, match=r"^activation_offload with pp=2: .* not modelled") as caught:
        estimate(EstimateRequest(model="llama-3-8b", gpus=8, gpu="h100-80gb", strategy="fsdp", pp=2,
                                 activation_offload=True))
    assert caught.value.field == "activation_offload"
    with pytest.raises(PlannerError, match=r"^activation_offload: .* is only a parameter count"):
        estimate(EstimateRequest(params="7B", activation_offload=True))


def test_the_plan_carries_it_to_every_candidate():
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    req = dict(model="llama-3-8b", gpus=8, gpu="h100-80gb", seq_len=4096, global_batch=64)
    on, off = plan(PlanRequest(**req, activation_offload=True)), plan(PlanRequest(**req))
    assert all(c.parallel.pp == 1 for c in on.candidates)
    assert all(c.host is not None and c.host.peak_bytes > 0 for c in on.candidates if c.fits)
    def key(c):
        return c.strategy, c.checkpointing, c.micro_batch, c.hsdp_shard_size, c.parallel.tp, c.offload_optimizer

    best_on = {key(c): c for c in on.candidates}
    pairs = [(c, best_on[key(c)]) for c in off.candidates if c.parallel.pp == 1 and key(c) in best_on
             and c.offload_optimizer == "none" and c.parallel.tp == 1]
    assert pairs
    for without, with_offload in pairs:
        assert with_offload.offload_seconds > without.offload_seconds
        assert with_offload.per_device.peak_bytes <= without.per_device.peak_bytes


def test_cli_flag(capsys):
    import json

    from cli.main import main

    assert main(["estimate", "--model", "llama-3-8b", "--gpus", "8", "--activation-offload", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["request"]["activation_offload"] is True and data["host"]["peak_bytes"] > 0


def test_emit_refuses_what_its_configs_cannot_say(tmp_path, capsys):
    from cli.main import main

    assert main(["estimate", "--model", "llama-3-8b", "--gpus", "8", "--activation-offload",
                 "--emit", str(tmp_path / "out")]) == 2
    assert "--emit with activation_offload" in capsys.readouterr().err


def test_under_autocast_the_weight_casts_go_to_the_host_too():
    """torch.autocast's 16-bit weight casts are saved by each linear and are no parameter's storage:
    TRL copies them with the activations (measured: llama-offload-ddp-bf16-t512); on the device the
    cast cache is gone after the forward, the LM head's cast and one block's remain in backward."""
    from planner.model.linears import block_linears
    from planner.model.architecture import layer_specs

    req = dict(model="llama-3.2-1b", gpus=8, gpu="h100-80gb", strategy="ddp", micro_batch=2, seq_len=2048)
    on, fp32 = estimate(EstimateRequest(**req, activation_offload=True)), None
    setup = resolve(EstimateRequest(**req, activation_offload=True))
    arch = setup.arch
    casts = 2 * sum(l.in_features * l.out_features for spec in layer_specs(arch) for l in block_linears(arch, spec))
    acts = activations(setup)
    assert acts.offloaded_bytes == acts.saved_bytes - 2 * 4096 * arch.hidden_size + casts
    start = [p for p in on.phases if p.kind == "start_of_block"][0]
    copies = next(i for i in start.items if i.name.startswith("autocast copies"))
    largest = max(sum(l.in_features * l.out_features + (l.out_features if l.bias else 0)
                      for l in block_linears(arch, spec)) for spec in layer_specs(arch))
    assert copies.bytes <= 2 * (arch.vocab_size * arch.hidden_size + largest + 4 * arch.hidden_size)
