"""How fast a full plan is: candidates evaluated per second on this machine.

    python bench/plan_speed.py [--repeat 5]

Plans Llama-3-70B on 8 nodes of 8 H100s with a global batch whose per-rank share has 120 divisors,
so that layouts (tp, and pp across the nodes) x strategies x checkpointing x offload x micro-batch
exceed 10,000 candidates: a candidate is a (setting, micro-batch) whose step time (for a pipeline or
expert layout, the bound of its compute) was computed. Then the plan of 1,024 GPUs (Llama-3-70B on
128 nodes of 8 H100s, Llama 3's 4M-token batch: 1,024 sequences of 4,096 tokens). Then issue 25's
scale target as a user meets it, the whole process: `planner plan` of Llama-3.1-405B on 16,384 H100s
(2,048 nodes of 8; Llama 3 paper Sec. 3.3: 2,048 sequences of 8,192 tokens) run as a fresh
subprocess, interpreter start and imports included. Prints the median over repeats, wall-clock and
CPU time (the machine may be shared).

Then other plans (OTHER_MODELS), each one's candidates/s: dense models at an ordinary global batch,
and mixture-of-experts and multimodal models (their expert-parallel layouts and vision towers take
other paths: the ep-local architecture, the loaded multimodal model). They are far below the first
plan's rate: a candidate is a (setting, micro-batch), and the first plan's per-rank batch has 120
divisors, so each setting's work (its estimate, its step-time terms, its pipeline or expert memory)
is shared by many micro-batches; an ordinary batch gives a setting a handful, and the plan's fixed
work (the allocator replays of the shortlist, the longest sequence, the fewest GPUs) weighs more.
Written to the README block ``planspeedother``, which says so.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.plan.search import plan  # noqa: E402
from planner.schema import PlanRequest  # noqa: E402


def _measure(request: PlanRequest, repeat: int) -> tuple[float, float, float, int]:
    """(best wall-clock seconds, median wall-clock seconds, median CPU seconds, candidates evaluated)
    of the plan."""
    plan(request)  # warm caches (catalogue, ring search)
    seconds, cpu, evaluated = [], [], 0
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = plan(request)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        evaluated = result.candidates_evaluated
    return min(seconds), statistics.median(seconds), statistics.median(cpu), evaluated


LLAMA3_405B_PRETRAINING = ("--model", "llama-3.1-405b", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "2048",
                           "--seq-len", "8192", "--global-batch", "2048")


def _measure_process(arguments: tuple[str, ...], repeat: int) -> tuple[float, float]:
    """(median wall-clock seconds, median CPU seconds) of `planner plan ARGUMENTS` as a fresh process."""
    command = [sys.executable, "-m", "cli.main", "plan", *arguments]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    seconds, cpu = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(seconds), statistics.median(cpu)


# (label, PlanRequest fields): DeepSeek-V3 and Qwen3-235B-A22B (routed experts, ep layouts over many
# nodes), Gemma-3-27B (multimodal, its vision tower loaded), Llama-4-Scout text-only (MoE from a
# multimodal config), Mixtral-8x7B (MoE, no shared experts)
OTHER_MODELS = (
    ("Llama-3-70B on 8 nodes of 8 H100s, global batch 256", dict(model="llama-3-70b", gpu="h100-80gb", gpus=8,
                                                                 nodes=8, seq_len=4096, global_batch=256)),
    ("Qwen3-8B on 2 nodes of 8 H100s, global batch 256", dict(model="qwen3-8b", gpu="h100-80gb", gpus=8, nodes=2,
                                                              seq_len=8192, global_batch=256)),
    ("DeepSeek-V3 on 32 nodes of 8 H100s", dict(model="deepseek-v3", gpu="h100-80gb", gpus=8, nodes=32, seq_len=4096,
                                                 global_batch=1024)),
    ("Qwen3-235B-A22B on 8 nodes of 8 H200s", dict(model="qwen3-235b-a22b", gpu="h200", gpus=8, nodes=8,
                                                    seq_len=8192, global_batch=512)),
    ("Gemma-3-27B on 8 A100-80GB", dict(model="gemma-3-27b", gpu="a100-80gb", gpus=8, nodes=1, seq_len=4096,
                                        global_batch=64)),
    ("Llama-4-Scout (text only) on 2 nodes of 8 H100s", dict(model="llama-4-scout", gpu="h100-80gb", gpus=8, nodes=2,
                                                             seq_len=8192, global_batch=64, text_only=True)),
    ("Mixtral-8x7B on 4 nodes of 8 H100s", dict(model="mixtral-8x7b", gpu="h100-80gb", gpus=8, nodes=4, seq_len=4096,
                                                global_batch=256)),
)


def other_models(repeat: int) -> str:
    """One line per OTHER_MODELS plan: its candidates, median seconds and candidates/s."""
    lines = []
    for label, fields in OTHER_MODELS:
        best, seconds, cpu, evaluated = _measure(PlanRequest(**fields), repeat)
        lines.append(f"- {label}: {evaluated:,} candidates in {best:.3f} s (median {seconds:.3f} s), "
                     f"**{evaluated / best:,.0f} candidates/s**")
    return (f"Other plans (`python bench/plan_speed.py --repeat {repeat}`, the best and the median of {repeat} plans "
            f"each; on "
            f"{os.cpu_count()} CPU cores): dense models at an ordinary global batch, then mixture-of-experts and "
            "multimodal models. **The 10^5 candidates/s hold for the plan above, not for these**: there each "
            "setting's work is shared by the 120 micro-batch sizes its batch allows; here a setting has a "
            "handful, and the plan's fixed work (the shortlist's allocator replays, the longest sequence, the "
            "fewest GPUs) weighs more. Their whole plans take the seconds below.\n\n" + "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--readme", help="replace the plan-speed block of this README")
    args = parser.parse_args()
    request = PlanRequest(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=8, topology="hgx-h100",
                          seq_len=4096, global_batch=55440 * 64)
    large = PlanRequest(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=128, topology="hgx-h100",
                        seq_len=4096, global_batch=1024)
    (best, seconds, cpu, evaluated), (large_best, large_seconds, _, _) = (_measure(r, args.repeat)
                                                                           for r in (request, large))
    scale_seconds, scale_cpu = _measure_process(LLAMA3_405B_PRETRAINING, args.repeat)

    text = (f"`python bench/plan_speed.py --repeat {args.repeat}`: a full plan of Llama-3-70B on 8 nodes of 8 H100s, "
            f"**{evaluated:,} candidates in {best:.3f} s** (the best of {args.repeat}, as timeit states a time; "
            f"median {seconds:.3f} s, {cpu:.3f} s of CPU), **{evaluated / best:,.0f} candidates/s** "
            f"({evaluated / seconds:,.0f} at the median); the plan of 1,024 GPUs (128 nodes of 8 H100s, global batch "
            f"1,024 x 4,096 tokens): **{large_best:.3f} s** (median {large_seconds:.3f} s); the whole `planner plan {' '.join(LLAMA3_405B_PRETRAINING)}` process "
            f"(Llama 3 405B's pretraining setup on 16,384 H100s, interpreter start and imports included): "
            f"**{scale_seconds:.2f} s** ({scale_cpu:.2f} s of CPU); on {os.cpu_count()} CPU cores.")
    from bench.readme import publish

    return publish(text, args.readme, "planspeed") or publish(other_models(args.repeat), args.readme,
                                                               "planspeedother")


if __name__ == "__main__":
    sys.exit(main())
