"""bench/published_nemo.py: its rows are NVIDIA's published tables, each row asks the run it describes, the
published tokens/s follow Megatron's FLOP formula, and the summary's arithmetic holds."""

import dataclasses

import pytest

from bench import published_nemo
from bench.published_nemo import MEGATRON, NEMO, ROWS, STRATEGIES, _line, at_dp1, megatron_flops_per_token, predict
from planner.errors import PlannerError

MEGATRON_ROWS = [r for r in ROWS if r.table == MEGATRON]
NEMO_ROWS = [r for r in ROWS if r.table == NEMO]


def test_rows_are_the_published_tables():
    # Megatron-LM images/model_table.png at f2e5db402c: nine models, data-parallel size 48 in every row
    assert [r.name for r in MEGATRON_ROWS] == [f"GPT {s}" for s in ("1.7B", "7.1B", "16B", "32B", "70B", "119B",
                                                                     "177B", "314B", "462B")]
    assert all(r.data_parallel == 48 for r in MEGATRON_ROWS)
    assert sum(r.published_tflops for r in MEGATRON_ROWS) == pytest.approx(
        408.8 + 465.9 + 489.1 + 459.6 + 419.7 + 420.5 + 432.8 + 474.4 + 459.9)
    last = MEGATRON_ROWS[-1]
    assert (last.arch, last.tp, last.pp, last.gpus, last.global_batch) == ((144, 18432, 112), 8, 16, 6144, 3072)
    # the assumed micro-batch 1 gives every pipelined row 4 x pp micro-batches per step
    assert all(r.accumulation == 4 * r.pp for r in MEGATRON_ROWS)
    # NeMo performance_summary.md at 8e3d65dc: the Llama rows, FP8, tokens/s/GPU as published
    assert [(r.name, r.published_tokens, r.vp, r.cp) for r in NEMO_ROWS] == [
        ("LLAMA2-7B", 16934, 1, 1), ("LLAMA2-13B", 8715, 10, 1), ("LLAMA2-70B", 1728, 20, 1),
        ("LLAMA3-8B", 12273, 1, 2), ("LLAMA3-70B", 1524, 5, 2)]


def test_published_tokens_follow_megatrons_formula():
    # Narayanan et al. 2021 eq. 3 without recomputation: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per step
    for row in MEGATRON_ROWS:
        heads, h, layers = row.arch
        s, v = row.seq_len, published_nemo.VOCAB
        paper = 72 * layers * h ** 2 * (1 + s / (6 * h) + v / (12 * layers * h))
        assert megatron_flops_per_token(h, layers) == pytest.approx(paper, rel=1e-12)
        assert row.tokens == pytest.approx(row.published_tflops * 1e12 / paper, rel=1e-12)
    assert MEGATRON_ROWS[0].tokens == pytest.approx(36259, abs=1)  # 408.8 TFLOP/s over 11.27 GFLOP per token
    assert NEMO_ROWS[0].tokens == 16934  # published directly


def test_each_row_builds_the_run_it_describes():
    for row in ROWS:
        for strategy in STRATEGIES:
            fields = row.fields(strategy)
            req = row.request(strategy)
            assert req.strategy == strategy and req.gpus * req.nodes == row.gpus
            assert (req.tp, req.pp, req.cp, req.seq_len, req.micro_batch) == (row.tp, row.pp, row.cp, row.seq_len,
                                                                            row.micro_batch)
            # the global batch: micro-batch x accumulation x data-parallel ranks
            assert req.micro_batch * req.gradient_accumulation * row.data_parallel == row.global_batch
            assert (req.pp_schedule, req.pp_virtual_stages) == (("interleaved", row.vp) if row.vp > 1 else ("1f1b", 1))
            assert (req.gpu, req.precision, req.checkpointing) == ("h100-80gb", "bf16-mixed", "none")
            assert req.low_precision == ("te-fp8" if row.table == NEMO else "none")
            assert ("model" in fields) == (row.table == NEMO)
    dp1 = at_dp1(MEGATRON_ROWS[4])  # 70B: TP 8 x PP 2 is one replica on two nodes
    assert (dp1.gpus, dp1.nodes, dp1.gradient_accumulation) == (8, 2, 8)


def test_megatron_gpts_have_the_published_sizes():
    # the table's size column is about 12 l h^2 + 2 V h (untied output layer), its labels cut to two digits
    # (1.754B is "1.7B", 31.5B "32B"): tied embeddings (1.48B) or a narrower MLP would miss by over 10%
    for row in MEGATRON_ROWS:
        p = predict(row, "ddp")
        size = float(row.name.split()[1].rstrip("B")) * 1e9
        assert p["parameters"] == pytest.approx(size, rel=0.04), row.name


def test_a_prediction_carries_its_error_or_the_refusal():
    row = MEGATRON_ROWS[1]
    p = predict(row, "ddp")
    assert p["error"] == p["tokens"] / row.tokens - 1
    assert 0 < p["mfu"] < 1 and 0 <= p["exposed_dp1"] <= p["step"] and p["gemm"] < p["step"]
    refused = predict(NEMO_ROWS[3], "ddp")  # context parallelism under ddp: refused by name
    assert "cp=2" in refused["refused"] and "tokens" not in refused
    line = _line(NEMO_ROWS[3], {s: predict(NEMO_ROWS[3], s) for s in STRATEGIES})
    assert line.count("refused: cp=2") == 2 and len(line.split("|")) == 16
    assert len(_line(row, {s: predict(row, s) for s in STRATEGIES}).split("|")) == 16


def test_an_indivisible_batch_is_refused():
    bad = dataclasses.replace(MEGATRON_ROWS[0], global_batch=100)
    with pytest.raises(PlannerError, match=r"global batch 100 .* micro_batch\(1\) x data_parallel\(48\) = 48"):
        bad.accumulation




def test_readme_block(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- published-nemo:start -->\nOLD-BLOCK\n<!-- published-nemo:end -->\ny\n")
    assert published_nemo.main(["--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "OLD-BLOCK" not in text and text.startswith("x\n") and text.endswith("y\n")
    rows = [line for line in text.splitlines() if line.startswith("| GPT ") or line.startswith("| LLAMA")]
    assert len(rows) == len(ROWS)
    assert text.count("- H100, asked as ") == 4
    assert capsys.readouterr().out.count("| GPT ") == len(MEGATRON_ROWS)
