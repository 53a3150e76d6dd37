"""bench/published_torchtitan.py: each row asks the run its published table describes."""

from bench.published_torchtitan import A100_TABLE, H200_TABLE, POLICIES, ROWS, _line, predict
from bench.summary import error_summary


def test_rows_are_the_published_tables():
    a100 = [r for r in ROWS if r.table == A100_TABLE]
    h200 = [r for r in ROWS if r.table == H200_TABLE]
    assert len(a100) == 8 and len(h200) == 2
    assert sum(r.published for r in a100) == 2904 + 2973 + 331 + 2162 + 1914 + 1904 + 355 + 353
    assert {r.model for r in a100} == {"llama-3-8b", "llama-3-70b", "llama-2-13b", "llama-2-70b"}
    # the 70B configs' norm_type is rmsnorm, the 8B and 13B ones fused_rmsnorm (train_configs at 157a12c)
    assert all((r.norm == "fused_rmsnorm") == ("70b" not in r.model) for r in a100)
    assert {r.norm for r in ROWS if r.table == H200_TABLE} == {"nn.RMSNorm"}
    assert [(r.cluster["nodes"], r.published, r.memory_gib) for r in h200] == [(4, 10938, 47.96), (8, 10753, 46.97)]


def test_each_row_builds_the_run_it_describes():
    for row in ROWS:
        req = row.request()
        assert (req.gpus, req.strategy, req.reduce_dtype) == (8, "fsdp", "fp32")
        assert req.seq_len == (4096 if row.model.startswith("llama-2") else 8192)
        assert req.micro_batch == row.local_batch and req.gradient_accumulation == 1
        if row.table == H200_TABLE:
            assert (req.gpu, req.compile, req.low_precision, req.float8_all_gather) == ("h200", "blocks",
                                                                                       "float8-tensorwise", True)
            assert (req.fabric, req.nics_per_node, req.checkpointing) == ("ib-ndr", 8, "selective-op")
        else:
            assert (req.gpu, req.nodes, req.compile) == ("a100-80gb", 8, "none")
        assert tuple(req.fused_kernels) == (("rms_norm",) if row.norm == "fused_rmsnorm" else ())
    layer = ROWS[0].request()  # "selective layer": every second block checkpointed
    assert (layer.checkpointing, layer.checkpointing_every) == ("full", 2)
    assert set(POLICIES) == {"no", "selective layer", "selective op", "full"}


def test_a_prediction_carries_its_error_or_the_refusal():
    row = ROWS[3]
    p = predict(row)
    assert p["error"] == p["tokens"] / row.published - 1
    assert 0 < p["mfu"] < 1 and p["peak_gib"] <= p["reserved_gib"]
    refused = {"refused": "compile: not modelled"}
    assert "not predicted: compile: not modelled" in _line(ROWS[-1], refused)
    assert error_summary([0.1, -0.2, 0.05], span=True).startswith("2/3 within 15%, median |error| 10.0%, median "
                                                                  "signed +5.0%")
