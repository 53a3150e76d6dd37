"""The start-up path of a single `planner estimate` (issue 10, Speed): it imports no numpy (only a
plan searches arrays of options) and no PyYAML (the data files are read from their cache), builds
no plan request or result schema, and its ring search answers what the exhaustive search over every
ring answers. The data files' cache is used only while it was made from the file's very bytes."""

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from planner import datafile
from planner.model.catalogue import load_catalogue
from planner.datafile import DATA_DIR, cache_path, load_data_yaml, write_caches
from planner.time.collectives import _best_ring

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "ddp", "fsdp", "hsdp"])
def test_an_estimate_process_imports_no_numpy_and_builds_no_plan_catalogue_or_profile_schema(tmp_path, strategy):
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
        "from planner.model.catalogue import ModelEntry\n"
        "print(code, 'numpy' in sys.modules, PlanRequest.__pydantic_complete__, PlanResult.__pydantic_complete__,\n"
        "      ModelEntry.__pydantic_complete__, 'planner.time.profiles' in sys.modules, '\"time\": {' in out.getvalue())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.split() == ["0", "False", "False", "False", "False", "False", "True"], done.stdout + done.stderr


def test_an_estimate_process_with_its_data_caches_imports_no_yaml(tmp_path):
    """With the data files' caches written (where an installed tool's first run writes them; here
    under a private pycache prefix), an estimate reads gpus.yaml, links.yaml and cuda_context.yaml without PyYAML, and
    prints what the process that parsed them printed."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(load_catalogue()["llama-3-8b"].config))
    prefix = ["-X", f"pycache_prefix={tmp_path / 'cache'}"]
    argv = ["estimate", "--model-file", str(config), "--strategy", "zero3", "--gpus", "8", "--gpu", "h100-80gb", "--json"]
    code = ("import contextlib, io, sys\nfrom cli.main import main\nout = io.StringIO()\n"
            f"with contextlib.redirect_stdout(out):\n    code = main({argv!r})\n"
            "print(code, 'yaml' in sys.modules, file=sys.stderr)\nprint(out.getvalue())")

    def run(*options):
        done = subprocess.run([sys.executable, *options, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        return done.stderr.split()[-2:], done.stdout

    parsed = run("-B", *prefix)  # -B: nothing written; the files are parsed
    subprocess.run([sys.executable, *prefix, "-c", "from planner.datafile import write_caches; write_caches()"],
                   check=True, cwd=ROOT, timeout=120)
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*.marshal")) == [
        f"{name}.yaml.{sys.implementation.cache_tag}.marshal" for name in ("cuda_context", "gpus", "links", "models")]
    cached = run("-B", *prefix)
    assert parsed[0] == ["0", "True"] and cached[0] == ["0", "False"], (parsed, cached)
    assert cached[1] == parsed[1] and '"peak_bytes"' in cached[1]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """Caches go under a private prefix (never into the checkout), and are written on a read."""
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    return tmp_path


def _no_parse(monkeypatch):
    def refuse(source):
        raise AssertionError("parsed although the cache is current")

    monkeypatch.setattr(datafile, "_parse", refuse)


@pytest.mark.parametrize("path", sorted(DATA_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_a_shipped_file_reads_the_same_from_its_cache(cache_dir, monkeypatch, path):
    assert cache_path(path) in write_caches()
    _no_parse(monkeypatch)
    assert repr(load_data_yaml(path)) == repr(yaml.safe_load(path.read_text()))


def test_the_cache_is_written_on_a_read_and_used_while_the_file_is_unchanged(cache_dir, monkeypatch):
    path = cache_dir / "data.yaml"
    path.write_text("gpus: [{name: a, memory_mib: 1}]\nrate: 1e-05\n")
    assert load_data_yaml(path) == {"gpus": [{"name": "a", "memory_mib": 1}], "rate": "1e-05"}
    assert cache_path(path).is_file() and str(cache_path(path)).startswith(str(cache_dir / "prefix"))
    with monkeypatch.context() as m:
        _no_parse(m)
        assert load_data_yaml(path) == {"gpus": [{"name": "a", "memory_mib": 1}], "rate": "1e-05"}
    path.write_text("gpus: [{name: b, memory_mib: 2}]\nrate: 1e-05\n")  # same length, same mtime second
    assert load_data_yaml(path) == {"gpus": [{"name": "b", "memory_mib": 2}], "rate": "1e-05"}
    _no_parse(monkeypatch)  # the edited file's cache replaced the old one
    assert load_data_yaml(path)["gpus"][0]["name"] == "b"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "other version"])
def test_a_damaged_cache_is_parsed_around_and_replaced(cache_dir, damage):
    path = cache_dir / "data.yaml"
    path.write_text("a: [1, 2.5, true, null, x]\n")
    load_data_yaml(path)
    cache = cache_path(path)
    blob = cache.read_bytes()
    cache.write_bytes({"truncated": blob[:-3], "garbage": blob[:-3] + b"\xff\xff\xff", "empty": b"",
                       "other version": blob.replace(b"cache 1", b"cache 0")}[damage])
    assert load_data_yaml(path) == {"a": [1, 2.5, True, None, "x"]}
    assert cache.read_bytes() == blob


def test_nothing_is_written_when_bytecode_writing_is_off_or_impossible(cache_dir, monkeypatch):
    path = cache_dir / "data.yaml"
    path.write_text("a: 1\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # -B, PYTHONDONTWRITEBYTECODE
    assert load_data_yaml(path) == {"a": 1} and not cache_path(path).exists()
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    (cache_dir / "__pycache__").write_text("a file where the cache folder would be")  # as unwritable
    assert load_data_yaml(path) == {"a": 1} and load_data_yaml(path) == {"a": 1}
    assert sorted(p.name for p in cache_dir.iterdir()) == ["__pycache__", "data.yaml"]


def test_a_value_marshal_cannot_keep_is_parsed_each_time(cache_dir):
    path = cache_dir / "data.yaml"
    path.write_text("released: 2024-03-01\n")  # a YAML timestamp: a datetime.date
    assert repr(load_data_yaml(path)) == "{'released': datetime.date(2024, 3, 1)}"
    assert not cache_path(path).exists()


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


def test_a_run_builds_only_its_own_commands_parser():
    """`planner estimate ...` builds the estimate parser alone; help and a mistyped command build
    (and list) every command."""
    from cli.main import build_parser

    def commands(parser):
        return sorted(parser._subparsers._group_actions[0].choices)

    everything = ["calibrate", "check", "estimate", "gpus", "models", "plan", "runs", "serve", "topo", "verify"]
    assert commands(build_parser("estimate", list_choices=False)) == ["estimate"]
    assert commands(build_parser("estimat", list_choices=False)) == everything
    assert commands(build_parser()) == everything
