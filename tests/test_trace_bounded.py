"""A traced model never runs unbounded (issue 27, item 2): a family whose forward loops over the
tokens in Python (transformers' Mamba on CPU kernels) is traced at two short sequences and scaled,
the notes say so, and the scaled figures agree with a full trace where one is affordable.

tests/fixtures/models/mamba-small.json: transformers' MambaConfig fields (configuration_mamba.py,
transformers 5.25) at a small size written for this test (2 blocks, hidden 64, vocab 1,024)."""

import json
import time
from pathlib import Path

import pytest

from cli.main import main

pytest.importorskip("transformers")
from backend import trace  # noqa: E402

MAMBA = json.loads((Path(__file__).parent / "fixtures" / "models" / "mamba-small.json").read_text())


def test_a_token_loop_is_traced_short_and_scaled_and_the_notes_say_so(capsys, tmp_path):
    path = tmp_path / "mamba.json"
    path.write_text(json.dumps(MAMBA))
    started = time.perf_counter()
    assert main(["estimate", "--model-file", str(path), "--gpus", "8", "--seq-len", "32k"]) == 0
    assert time.perf_counter() - started < 120  # a full trace of 32,768 steps of the loop would take hours
    out = capsys.readouterr().out
    assert "extended linearly to 32,768" in out
    assert "--params gives no layer sizes" not in out  # --params was not given


def test_the_scaled_figures_are_those_of_a_full_trace():
    """At 96 tokens a full trace is affordable: the figures scaled from 16 and 32 tokens agree with it."""
    seq = 96
    count = trace.count_parameters(MAMBA)
    scaled = trace.trace_profile(MAMBA, micro_batch=2, seq_len=seq, compute="bf16", attention="eager",
                                 checkpointing="none", count=count)
    assert any("extended linearly" in a for a in scaled.assumptions)
    torch, transformers = trace._imports()
    with trace._quiet(transformers):
        hf = trace._hf_config(transformers, MAMBA, "m")
        full = trace._run(torch, transformers, hf, micro_batch=2, seq_len=seq, dtype=torch.bfloat16,
                          attention="eager", checkpointing=False, blocks_path=count.blocks_path)
    assert scaled.saved_bytes >= full.saved
    assert scaled.saved_bytes == pytest.approx(full.saved, rel=0.05)
    assert scaled.layer_saved_bytes == pytest.approx(max(full.kept), rel=0.05)
