"""bench/published_parallel.py runs, lists at least five published TP/PP/CP configurations with
their figure and source, and predicts each or says in one line why it cannot."""

import re

from bench import published_parallel


def test_published_parallel_table(tmp_path, capsys):
    runs = published_parallel.RUNS
    assert len(runs) >= 5
    degrees = [r for r in runs if any(r.fields.get(k, 1) > 1 for k in ("tp", "pp", "cp"))]
    assert len(degrees) >= 5  # (the CP tables' CP 1 rows are their baselines)
    assert {r.fields.get("pp_schedule", "1f1b") for r in runs if r.fields.get("pp", 1) > 1} == {"1f1b", "interleaved"}
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- published-parallel:start -->\nold\n<!-- published-parallel:end -->\ny\n")
    assert published_parallel.main(["--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and text.startswith("x\n") and text.endswith("y\n")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "torchtitan docs/performance.md" in line]
    assert len(rows) == len(runs)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[4].replace(",", "")) > 0  # the published figures
        if cells[2]:  # predicted: the gap is shown
            assert re.fullmatch(r"[+-]\d+%", cells[3])
        else:
            assert cells[8].startswith("not predicted: ") and "\n" not in cells[8]
    assert capsys.readouterr().out.count("torchtitan docs/performance.md") == len(runs)
