"""bench/published_torchtitan_a100.py: each row asks the run torchtitan's April 2024 table describes."""

from bench.published_torchtitan_a100 import POLICIES, ROWS, predict, summary


def test_rows_are_the_published_table():
    assert len(ROWS) == 8
    assert sum(r.published for r in ROWS) == 2904 + 2973 + 331 + 2162 + 1914 + 1904 + 355 + 353
    assert {r.model for r in ROWS} == {"llama-3-8b", "llama-3-70b", "llama-2-13b", "llama-2-70b"}
    # the 70B configs' norm_type is rmsnorm, the 8B and 13B ones fused_rmsnorm
    assert all(r.fused_norm == ("70b" not in r.model) for r in ROWS)


def test_each_row_builds_the_run_it_describes():
    for row in ROWS:
        req = row.request()
        assert (req.gpus, req.nodes, req.strategy, req.reduce_dtype, req.gpu) == (8, 8, "fsdp", "fp32", "a100-80gb")
        assert req.seq_len == (8192 if row.model.startswith("llama-3") else 4096)
        assert req.micro_batch == row.local_batch and req.gradient_accumulation == 1
    layer = ROWS[0].request()  # "selective layer": every second block checkpointed
    assert (layer.checkpointing, layer.checkpointing_every) == ("full", 2)
    assert ROWS[1].request().checkpointing == "selective-op" and set(POLICIES) == {"no", "selective layer",
                                                                                   "selective op", "full"}


def test_a_prediction_carries_its_error_against_the_published_figure():
    row = ROWS[3]
    p = predict(row)
    assert p["error"] == p["tokens"] / row.published - 1
    assert 0 < p["mfu"] < 1 and p["peak_gib"] <= p["reserved_gib"]
    assert summary([0.1, -0.2, 0.05]).startswith("2/3 within 15%, median |error| 10.0%, median signed +5.0%")
