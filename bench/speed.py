"""Speed next to `accelerate estimate-memory`, on the same architecture from a local config.json.

    python bench/speed.py [--model llama-3-8b] [--repeat 7] [--readme README.md]

Writes the catalogue entry's config.json to a temporary directory, then times, each as the median
of REPEAT runs in this one process (imports done beforehand):
  - planner: one `estimate` (ZeRO-3, 8 GPUs, activations included) and one full `plan`, both from
    that config.json (planner.model.catalogue.model_from_file, as `--model-file` does);
  - accelerate: what `accelerate estimate-memory DIR --library_name transformers` does after its
    Hub look-up (which needs the network, so is skipped): AutoConfig.from_pretrained(DIR), the
    model built on the meta device under init_empty_weights, calculate_maximum_sizes and
    estimate_training_usage (accelerate/commands/estimate.py).
Also times both as fresh command-line processes (imports included), in turn, each after one
untimed run, and prints their ratio; beside them, the same way, a process that imports pydantic and
validates a one-field model (PYDANTIC_FLOOR): what any process validating with the one schema costs.
The planner's own modules are byte-compiled first, as `pip install` does for an installed tool
(PYTHONDONTWRITEBYTECODE=1 would otherwise recompile them in every process; the libraries
accelerate loads are byte-compiled in site-packages), and the data files' caches are written
(planner/datafile.py; an installed tool's first run writes them, unless bytecode writing is off).
The figures are ratios from one run on one machine, not absolute promises.
"""

from __future__ import annotations

import argparse
import compileall
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ACCELERATE_PIPELINE = """
import sys, torch
from transformers import AutoConfig, AutoModel
from accelerate import init_empty_weights
from accelerate.utils import calculate_maximum_sizes
from accelerate.commands.estimate import estimate_training_usage
config = AutoConfig.from_pretrained(sys.argv[1])
with init_empty_weights():
    model = AutoModel.from_config(config, dtype=torch.float32)
total, largest = calculate_maximum_sizes(model)
print(total, estimate_training_usage(total, "float16"))
"""

# The least any process can do that validates a request with the one pydantic schema (STYLE.md:
# CLI, API, form and backend share it): start Python, import pydantic, build and validate a model
# of one constrained field, print it as JSON. The planner's process pays this before its own work.
PYDANTIC_FLOOR = """
from pydantic import BaseModel, Field
class Request(BaseModel):
    gpus: int = Field(8, ge=1)
print(Request(gpus=8).model_dump_json())
"""


def _median_seconds(function, repeat: int) -> float:
    function()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _process_seconds(commands: list[list[str]], repeat: int) -> list[float]:
    """Median wall time of each command as a fresh process, run in turn (one, two, one, two, ...)
    so a machine shared with other work loads both alike; one untimed run each first."""
    times: list[list[float]] = [[] for _ in commands]
    for round_ in range(repeat + 1):
        for command, mine in zip(commands, times):
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
            if round_:
                mine.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--readme", help="replace the speed block of this README")
    args = parser.parse_args()

    import torch
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoConfig, AutoModel

    from planner.model.catalogue import load_catalogue, model_from_file
    from planner.datafile import write_caches
    from planner.plan.search import plan
    from planner.time.step import estimate_with_time
    from planner.schema import EstimateRequest, PlanRequest

    entry = load_catalogue()[args.model]
    for package in ("planner", "cli", "backend"):
        compileall.compile_dir(ROOT / package, quiet=1)
    write_caches()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(entry.config))

        def planner_estimate():
            config = model_from_file(config_path).config
            return estimate_with_time(EstimateRequest(model_config=config, strategy="zero3", gpus=8, gpu="h100-80gb",
                                                      seq_len=4096, micro_batch=1))

        def planner_plan():
            config = model_from_file(config_path).config
            return plan(PlanRequest(model_config=config, gpu="h100-80gb", gpus=8, topology="hgx-h100",
                                    seq_len=4096, global_batch=256))

        def accelerate_estimate():
            config = AutoConfig.from_pretrained(tmp)
            with init_empty_weights():
                model = AutoModel.from_config(config, dtype=torch.float32)
            total, _ = calculate_maximum_sizes(model)
            return estimate_training_usage(total, "float16")

        evaluated = planner_plan().candidates_evaluated
        ours_estimate = _median_seconds(planner_estimate, args.repeat)
        ours_plan = _median_seconds(planner_plan, args.repeat)
        theirs = _median_seconds(accelerate_estimate, args.repeat)
        planner_cli = Path(sys.executable).with_name("planner")
        cli_ours, cli_theirs, floor = _process_seconds(
            [[str(planner_cli), "estimate", "--model-file", str(config_path), "--strategy", "zero3", "--gpus", "8",
              "--gpu", "h100-80gb", "--seq-len", "4096", "--json"],
             [sys.executable, "-c", ACCELERATE_PIPELINE, tmp],
             [sys.executable, "-c", PYDANTIC_FLOOR]], max(3, args.repeat // 2))

    rows = [
        ("planner estimate (ZeRO-3, activations, time model)", ours_estimate, cli_ours),
        (f"planner plan ({evaluated:,} candidates, all strategies)", ours_plan, None),
        ("accelerate estimate-memory pipeline (model states only)", theirs, cli_theirs),
    ]
    lines = ["| what | in-process median (ms) | vs accelerate | fresh process median (s) |", "|---|---:|---:|---:|"]
    for name, seconds, process in rows:
        lines.append(f"| {name} | {1000 * seconds:,.1f} | {seconds / theirs:.2f}x | "
                     f"{process:.2f} |" if process is not None else
                     f"| {name} | {1000 * seconds:,.1f} | {seconds / theirs:.2f}x | n/a |")
    lines.append(f"| python + pydantic, one one-field model validated (no planner code) | n/a | n/a | {floor:.2f} |")
    lines.append(f"\nA whole `planner estimate` process is {cli_theirs / cli_ours:.1f}x faster than the accelerate "
                 f"process on the same config.json. A process that only imports pydantic and validates one "
                 f"one-field model is {cli_theirs / floor:.1f}x faster: the floor of any process that validates "
                 f"with the one pydantic schema; the planner's own modules, data files and estimate add "
                 f"{1000 * (cli_ours - floor):.0f} ms to it.")
    lines.append(f"\n`python bench/speed.py --model {args.model} --repeat {args.repeat}` on this machine; "
                 "the same config.json for both; accelerate's Hub look-up (network) is left out.")
    text = "\n".join(lines) + "\n"
    from bench.readme import publish

    return publish(text, args.readme, "speed")


if __name__ == "__main__":
    sys.exit(main())
