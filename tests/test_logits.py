"""The loss / LM-head terms of the memory model, and the real runs that guard them.

The real runs themselves are measured by tests/test_deepspeed_cpu.py (CI) and bench/accuracy.py;
these fast tests keep the suite able to see a logits error, and pin the mechanisms the model
counts (planner/model/activations.py: _loss_saved, _loss_transient; planner/memory/buffers.py:
_tied_head_elements).
"""

import pytest

from planner.memory.orchestrator import estimate
from planner.schema import EstimateRequest
from tests.real_runs import BENCH_RUNS, CPU_RUNS, GPT2_50K, LLAMA_32K, QWEN2_64K, _run

FP32 = 4


def _phase(result, name):
    return next(p for p in result.phases if p.name == name)


def _item_bytes(phase, prefix):
    return sum(i.bytes for i in phase.items if i.name.startswith(prefix))


def _logits_share(fields) -> float:
    """Share of the predicted peak that is the loss's fp32 tokens x vocab tensors (the saved
    log-probabilities and the two gradients of the loss's backward)."""
    request = EstimateRequest(**fields)
    # a vocab-parallel rank (tp > 1, loss_parallel) holds 1/tp of them
    tokens, vocab = request.micro_batch * request.seq_len, _vocab(fields) // request.tp
    return 3 * FP32 * tokens * vocab / estimate(request).per_device.peak_bytes


def _vocab(fields) -> int:
    config = fields["model_config"]
    return config.get("vocab_size") or config["text_config"]["vocab_size"]


def _logits_runs(runs):
    # full fine-tuning only: with a frozen base (LoRA, issue 13) the loss's tensors are most of the
    # peak even at a small vocabulary, which is not what these runs are chosen to guard
    return [(name, fields) for name, fields in runs
            if fields.get("finetune", "full") == "full" and _logits_share(fields) >= 0.5]


def test_the_suite_has_logits_dominated_runs_across_families_strategies_and_dtypes():
    ci, bench = _logits_runs(CPU_RUNS), _logits_runs(BENCH_RUNS)
    assert len(ci) >= 4 and len(ci) + len(bench) >= 8, [n for n, _ in ci + bench]
    runs = [fields for _, fields in ci + bench]
    assert {f["model_config"]["model_type"] for f in runs} >= {"llama", "qwen2", "gpt2"}
    assert {f["strategy"] for f in runs} >= {"zero0", "zero1", "zero2", "zero3", "ddp", "fsdp"}
    assert {f["precision"] for f in runs} >= {"bf16-mixed", "fp32"}
    assert {f["checkpointing"] for f in runs} == {"none", "full"}
    assert all(f["micro_batch"] * f["seq_len"] >= 1024 and _vocab(f) >= 32_000 for f in runs)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
@pytest.mark.parametrize("ckpt", ["none", "full"])
@pytest.mark.parametrize("vocab", [32_000, 128_256, 262_144])
def test_loss_backward_holds_three_fp32_logits_whatever_the_dtype(precision, ckpt, vocab):
    """At the start of backward: the saved fp32 log-probabilities, nll_loss's gradient and
    log_softmax's gradient, all fp32 tokens x vocab; the training-dtype logits, their upcast
    and the cast back are never live at that moment."""
    tokens = 1024
    _, fields = _run("x", dict(LLAMA_32K, vocab_size=vocab), "zero2", precision, small=True, ckpt=ckpt,
                     micro=1, seq=tokens)
    result = estimate(EstimateRequest(**fields))
    start = _phase(result, "start of backward")
    assert _item_bytes(start, "backward transients") == 2 * FP32 * tokens * vocab
    after_head = _phase(result, "after the LM head")
    logits_saved = _item_bytes(start, "saved activations") - _item_bytes(after_head, "saved activations")
    assert FP32 * tokens * vocab <= logits_saved < FP32 * tokens * vocab * 1.05


@pytest.mark.parametrize("precision,grad_bytes", [("fp32", 4), ("bf16-mixed", 2)])
@pytest.mark.parametrize("model", [QWEN2_64K, GPT2_50K], ids=["qwen2", "gpt2"])
@pytest.mark.parametrize("strategy,phase", [("zero2", "end of backward"),
                                            ("zero1", "embeddings' backward (tied gradients summed)"),
                                            ("fsdp", "embeddings' backward (tied gradients summed)")])
def test_a_tied_embedding_gradient_is_summed_at_the_embeddings_backward(strategy, phase, precision, grad_bytes,
                                                                          model):
    """A tied weight's two gradient contributions (the LM head's, the embedding's) and their
    sum are live together at the embeddings' backward; an untied model has no such term."""
    _, fields = _run("x", model, strategy, precision, small=True, micro=1, seq=128)
    at = _phase(estimate(EstimateRequest(**fields)), phase)
    vocab, hidden = model["vocab_size"], model.get("hidden_size", model.get("n_embd"))
    if strategy == "fsdp":
        grad_bytes = 2 if precision != "fp32" else 4  # FSDP2 computes in the param_dtype
    assert _item_bytes(at, "tied embedding") == 2 * grad_bytes * vocab * hidden
    if strategy == "zero2":
        assert _item_bytes(at, "16-bit gradients not yet reduced") == grad_bytes * vocab * hidden
    _, untied = _run("x", dict(model, tie_word_embeddings=False), strategy, precision, small=True, micro=1, seq=128)
    untied_result = estimate(EstimateRequest(**untied))
    assert all(_item_bytes(p, "tied embedding") == 0 for p in untied_result.phases)


def test_zero2_has_not_reduced_a_tied_head_gradient_before_the_embeddings_backward():
    """ZeRO-2's hook runs after the weight's AccumulateGrad node, which waits for the
    embedding's contribution: through every block the head's V x h gradient is not reduced."""
    _, fields = _run("x", QWEN2_64K, "zero2", "fp32", small=True, micro=1, seq=128)
    result = estimate(EstimateRequest(**fields))
    for phase in result.phases:
        if phase.name.startswith(("start of block", "end of block")):
            assert _item_bytes(phase, "16-bit gradients not yet reduced") >= FP32 * 64_000 * 256
