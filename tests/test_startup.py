"""The start-up path of a single `planner estimate` (issue 10, Speed): it imports no numpy (only a
plan searches arrays of options), builds no plan result schema, and its ring search answers what the
exhaustive search over every ring answers."""

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from planner.catalogue import load_catalogue
from planner.timing import _best_ring

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "ddp", "fsdp", "hsdp"])
def test_an_estimate_process_imports_no_numpy_and_builds_no_plan_schema(tmp_path, strategy):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(load_catalogue()["llama-3-8b"].config))
    code = (
        "import sys, io, contextlib\n"
        "from cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    code = main(['estimate', '--model-file', {str(config)!r}, '--strategy', {strategy!r}, '--gpus', '8',\n"
        "                 '--nodes', '2', '--gpu', 'h100-80gb', '--json'])\n"
        "from planner.schema import PlanRequest, PlanResult\n"
        "print(code, 'numpy' in sys.modules, PlanRequest.__pydantic_complete__, PlanResult.__pydantic_complete__,\n"
        "      '\"time\": {' in out.getvalue())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.split() == ["0", "False", "True", "False", "True"], done.stdout + done.stderr


def _every_ring(bandwidth, n):
    """The exhaustive search as it was: every ring in permutations order, the first strictly best."""
    best, best_bw = (), -1.0
    for rest in itertools.permutations(range(1, n)):
        ring = (0, *rest)
        bw = min(bandwidth[ring[k]][ring[(k + 1) % n]] for k in range(n))
        if bw > best_bw:
            best, best_bw = ring, bw
    return best, best_bw


def test_the_pruned_ring_search_answers_what_every_ring_answers():
    rng = random.Random(10)
    for _ in range(400):
        n = rng.randint(2, 8)
        levels = rng.choice([[25.0], [12.0, 50.0], [5.0, 12.0, 50.0, 300.0], [rng.random() * 100 for _ in range(5)]])
        m = [[0.0] * n for _ in range(n)]
        for i, j in itertools.combinations(range(n), 2):
            m[i][j] = m[j][i] = rng.choice(levels)
        matrix = tuple(tuple(row) for row in m)
        assert _best_ring(matrix, n) == _every_ring(matrix, n), matrix
