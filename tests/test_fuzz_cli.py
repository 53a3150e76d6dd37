"""Fuzz the `planner` command line (hypothesis over argv): every subcommand, every flag the parser
declares, with free text (unicode, empty, leading dashes), numbers at and beyond each schema bound,
nan/inf, huge integers and awkward paths. No input may raise out of `main` (a traceback); the exit
code is 0, or 2 with the last line of stderr a `planner...: error: ...` line.

`verify` never launches and `serve` never binds: their entry points are replaced by recorders.
Everything a command writes lands in a temporary working directory (output paths are relative)."""

import argparse
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cli.main import FILE_FLAGS, build_parser, main
from planner.schema import EstimateRequest, PlanRequest

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["estimate", "plan", "topo", "models", "gpus", "runs", "verify", "serve", "calibrate"]
EXAMPLES = {"estimate": 60, "plan": 40, "topo": 40, "models": 5, "gpus": 5, "runs": 30, "verify": 40, "serve": 25,
            "calibrate": 25}  # cases per subcommand; ~20 s in all on a 2-core machine
SCALE = float(os.environ.get("PLANNER_FUZZ_SCALE", "1"))  # e.g. 20 for a deeper search by hand

# Inputs the commands read, all inside the working directory.
INPUTS = ["tiny.json", "ds.json", "bad.json", "topo.txt", "binary.bin", "empty.txt", "emitted/plan.json", "dir",
          ".", "", " ", "nope.json", "/dev/null", "ünï.json", "a\x00b", "-", "dir/", "x" * 300]
# Where they may write: relative names only, so nothing outside the working directory is touched.
OUTPUTS = ["out", "out/sub", "dir", "tiny.json", "", " ", ".", "a\x00b", "ünï", "x" * 300, "new.svg", "emitted"]
NUMBERS = ["0", "1", "-1", "2", "7", "255", "256", "1023", "1024", "1025", "65535", "65536", "65537", "100000",
           "100001", "16777216", "16777217", "4194304", "4194305", str(2**31), str(2**63 - 1), str(2**63),
           str(2**64), "99999999999999999999", "-99999999999999999999", "1e309", "1e-309", "nan", "NaN", "inf",
           "-inf", "Infinity", "0.0", "-0.0", "0.5", "1.5", "0.9", "4.0", "4.1", "86400", "86401", "1e14", "1e15",
           "7e9", "7B", "70b", "1.5T", "405_000_000_000", "0x10", " 5", "5 ", "1_0", "١٢", "²"]
NAMES = ["gpt2", "llama-3-8b", "LLAMA-3-8B", "meta-llama/Llama-3.1-8B", "h100-80gb", "cpu", "a100-80gb", "rtx-a6000",
         "hgx-h100", "dgx-a100", "a6000-nvlink-pairs", "ib-ndr", "eth-25g", "nope", "zero3", "hsdp", "time", "mine"]
TEXT = st.text(max_size=24)
CASES: dict[str, int] = {}


def _bounds(field) -> list[str]:
    """Each numeric bound of a schema field, and one step either side of it."""
    out = []
    for meta in field.metadata:
        for name in ("ge", "gt", "le", "lt"):
            bound = getattr(meta, name, None)
            if isinstance(bound, (int, float)):
                out += [str(bound), str(bound + 1), str(bound - 1)]
    return out


def _field(action):
    for model in (EstimateRequest, PlanRequest):
        if action.dest in model.model_fields:
            return model.model_fields[action.dest]
    return None


def values(action) -> st.SearchStrategy[str]:
    if action.dest in FILE_FLAGS or action.dest in ("file", "plan", "hostfile"):
        return st.sampled_from(INPUTS) | TEXT.filter(lambda t: "/" not in t and t not in ("..",))
    if action.dest in ("emit", "svg", "db"):
        return st.sampled_from(OUTPUTS) | TEXT.filter(lambda t: "/" not in t and t.strip(".") != "")
    field = _field(action)
    edges = NUMBERS + (_bounds(field) if field is not None else [])
    options = [st.sampled_from(edges), st.sampled_from(NAMES), TEXT]
    if action.choices:
        options.insert(0, st.sampled_from([str(c) for c in action.choices]))
    return st.one_of(options)


PARSER = build_parser()
SUBPARSERS = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices
BASES = {"estimate": [[], ["--model", "gpt2"], ["--model-file", "tiny.json"], ["--params", "7B"]],
         "plan": [[], ["--model", "gpt2"], ["--model-file", "tiny.json"]],
         "verify": [[], ["--model", "gpt2", "--gpu", "cpu", "--gpus", "2"], ["--plan", "emitted/plan.json"],
                    ["--model-file", "tiny.json", "--gpu", "cpu", "--gpus", "2"]],
         "topo": [[], ["--preset", "dgx-a100"], ["--file", "topo.txt", "--gpu", "rtx-a6000"]]}


@st.composite
def argvs(draw, command: str) -> list[str]:
    sub = SUBPARSERS[command]
    actions = [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    argv = [command] + draw(st.sampled_from(BASES.get(command, [[]])))
    for action in draw(st.lists(st.sampled_from(actions), max_size=5, unique_by=lambda a: a.dest)):
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            argv.append(flag)
            continue
        value = draw(values(action))
        argv += [f"{flag}={value}"] if value.startswith("-") or draw(st.booleans()) else [flag, value]
    positionals = [a for a in sub._actions if not a.option_strings]
    if positionals and draw(st.booleans()):
        argv.append(draw(st.sampled_from(NUMBERS) | TEXT.filter(lambda t: not t.startswith("-"))))
    if draw(st.integers(0, 9)) == 0:  # a stray token: an unknown flag, a bare word, --help
        argv.insert(draw(st.integers(1, len(argv))), draw(st.sampled_from(["--nope", "extra", "--help", "-h", "--"])
                                                              | TEXT))
    return argv


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The files the inputs name, written once."""
    from tests.real_runs import LLAMA

    root = tmp_path_factory.mktemp("fuzz-cli")
    (root / "tiny.json").write_text(json.dumps(dict(LLAMA, num_hidden_layers=2)))
    (root / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    (root / "bad.json").write_text("{not json")
    shutil.copy(ROOT / "tests" / "fixtures" / "topologies" / "rtx_a6000_8gpu_nvlink_bridge_pairs_2nic.txt",
                root / "topo.txt")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (root / "empty.txt").write_text("")
    (root / "dir").mkdir()
    assert main(["plan", "--model", "gpt2", "--gpus", "2", "--gpu", "h100-80gb",
                 "--global-batch", "4", "--seq-len", "128", "--emit", str(root / "emitted")]) == 0
    return root


@pytest.fixture()
def sandbox(workdir, monkeypatch):
    import backend.verify
    import uvicorn

    from planner.errors import PlannerError

    calls = []

    def verify(request, **options):
        calls.append(("verify", request))
        raise PlannerError("fuzz: the launch was recorded, not run")

    monkeypatch.setattr(backend.verify, "verify", verify)
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: calls.append(("serve", options)))
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("PLANNER_DB", str(workdir / "runs.sqlite"))
    monkeypatch.setenv("PLANNER_PROFILES", str(workdir / "profiles"))
    monkeypatch.delenv("PLANNER_API_TOKEN", raising=False)
    return calls


@pytest.mark.parametrize("command", COMMANDS)
def test_no_argv_gives_a_traceback(sandbox, capsys, monkeypatch, command):
    pytest.importorskip("backend.store")

    @settings(max_examples=max(1, int(EXAMPLES[command] * SCALE)), deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.filter_too_much])
    @given(argv=argvs(command))
    def check(argv):
        CASES[command] = CASES.get(command, 0) + 1
        monkeypatch.setattr("sys.stdin", io.StringIO(""))  # topo reads stdin without --file
        try:
            code = main(argv)
        except BaseException as exc:  # anything raised out of main is a traceback for the user
            raise AssertionError(f"{argv!r} raised {exc!r}") from exc
        out, err = capsys.readouterr()
        assert code in (0, 2), (argv, code, err)
        assert "Traceback" not in err and "Traceback" not in out, (argv, err)
        if code == 2:
            last = err.strip().splitlines()[-1] if err.strip() else ""
            assert last.startswith("planner") and ": error: " in last, (argv, err)

    check()
    assert all(kind in ("verify", "serve") for kind, _ in sandbox)  # recorded, never launched or bound


def test_the_fuzz_ran_its_cases():
    """Runs after the fuzz (file order): each subcommand's search ran its cases, not a shortcut."""
    if set(CASES) != set(COMMANDS):
        pytest.skip("run with the fuzz above")
    assert all(CASES[c] >= max(1, int(EXAMPLES[c] * SCALE)) for c in COMMANDS), CASES
