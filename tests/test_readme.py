"""Every `planner ...` command in the README's console blocks runs, from a clone alone, with the files
in examples/. The README cannot drift from the tool: a renamed flag, a missing example file or a
command that no longer parses fails here.

The fast test runs every command in-process (`cli.main.main`) except that `verify` stops before the
launch (its request is built and estimated) and `serve` stops before binding a port. The test marked
`deepspeed` runs the verify commands for real with the fewest steps, then `runs`, `runs show` and
`calibrate` over the runs they recorded."""

import re
import shlex
import shutil
from pathlib import Path

import pytest

from cli.main import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SIMULATED = {"nvidia-smi topo -m > topo.txt": ("examples/topo-rtx-a6000.txt", "topo.txt")}


def console_commands(text: str) -> list[str]:
    """The `$ ...` lines of every ```console block as words joined by one space (continuation lines
    joined, comments and a trailing `&` dropped)."""
    commands = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if line.startswith("$ "):
                commands.append(" ".join(w for w in shlex.split(line[2:], comments=True) if w != "&"))
    return commands


COMMANDS = console_commands(README.read_text())
PLANNER = [c for c in COMMANDS if c.startswith("planner ")]


def test_the_readme_has_the_commands_this_test_expects():
    """A guard on the extraction itself: the README's walk-through, every subcommand it shows."""
    assert all(len(shlex.split(c)) == len(c.split(" ")) for c in PLANNER)
    assert {c.split(" ")[1] for c in PLANNER} >= {"estimate", "plan", "verify", "runs", "calibrate", "serve"}
    others = [c for c in COMMANDS if not c.startswith("planner ")]
    assert all(c in SIMULATED or c.startswith("curl ") for c in others), others


@pytest.fixture()
def clone(tmp_path, monkeypatch):
    """A working directory holding what a clone holds for these commands (examples/), with the
    runs database and the profiles in it."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANNER_DB", str(tmp_path / "runs.sqlite"))
    monkeypatch.setenv("PLANNER_PROFILES", str(tmp_path / "profiles"))
    for source, target in SIMULATED.values():  # what `nvidia-smi topo -m > topo.txt` would write there
        shutil.copy(tmp_path / source, tmp_path / target)
    return tmp_path


def _argv(command: str) -> list[str]:
    return command.split(" ")[1:]  # no README planner command has a word with a space in it


def _stop_before_launch(monkeypatch) -> list:
    import backend.verify
    import uvicorn

    calls = []

    def verify(request, **options):
        from planner.memory.orchestrator import estimate

        calls.append(("verify", estimate(request)))  # the request a real run would launch resolves
        raise KeyboardInterrupt  # cmd_verify's own path for a run that ended before it started

    monkeypatch.setattr(backend.verify, "verify", verify)
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: calls.append(("serve", options)))
    return calls


@pytest.mark.parametrize("command", PLANNER)
def test_every_readme_command_runs(clone, monkeypatch, capsys, command):
    pytest.importorskip("backend.store")
    calls = _stop_before_launch(monkeypatch)
    code = main(_argv(command))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    verb = _argv(command)[0]
    if verb == "verify":
        assert code == 130 and calls and calls[0][0] == "verify", err
    elif verb == "serve":
        assert code == 0 and calls == [("serve", {"host": "127.0.0.1", "port": 8000, "log_level": "info"})]
    elif command in ("planner runs show 1", ) or verb == "calibrate":
        # they read the runs the verify commands recorded; this database is empty (the deepspeed test
        # below runs them over real runs): a one-line refusal, not a traceback
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    else:
        assert code == 0, err


def test_the_first_estimate_says_what_the_readme_says(clone, capsys):
    text = README.read_text()
    command = next(c for c in PLANNER if _argv(c)[0] == "estimate")
    assert main(_argv(command) + ["--json"]) == 0
    import json

    per_device = json.loads(capsys.readouterr().out)["per_device"]
    claim = re.search(r"([\d.]+) GB of parameters, ([\d.]+) GB of gradients and ([\d.]+) GB of Adam moments", text)
    assert claim, "the README's first estimate lost its numbers"
    shown = (per_device["parameters_bytes"], per_device["gradients_bytes"], per_device["optimizer_states_bytes"])
    assert tuple(f"{b / 1e9:.2f}" for b in shown) == claim.groups()
    peak = re.search(r"peak at ([\d.]+) GB", text)
    assert peak and f"{per_device['peak_bytes'] / 1e9:.2f}" == peak.group(1)


@pytest.mark.deepspeed
def test_readme_verify_runs_for_real_then_runs_and_calibrate(clone, capsys):
    pytest.importorskip("deepspeed")
    for command in PLANNER:
        argv = _argv(command)
        if argv[0] == "serve":
            continue
        if argv[0] == "verify":
            argv += ["--steps", "1", "--warmup", "0"]  # the smallest run that measures
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 0 and "Traceback" not in err, (command, err)
