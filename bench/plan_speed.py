"""How fast a full plan is: candidates evaluated per second on this machine.

    python bench/plan_speed.py [--repeat 5]

Plans Llama-3-70B on 8 nodes of 8 H100s with a global batch whose per-rank share has 120 divisors,
so that GPU counts x strategies x checkpointing x offload x micro-batch exceed 10,000 candidates.
Prints the median over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.plan import plan  # noqa: E402
from planner.schema import PlanRequest  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--readme", help="replace the plan-speed block of this README")
    args = parser.parse_args()
    request = PlanRequest(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=8, topology="hgx-h100",
                          seq_len=4096, global_batch=55440 * 64)
    plan(request)  # warm caches (catalogue, ring search)
    seconds, evaluated = [], 0
    for _ in range(args.repeat):
        start = time.perf_counter()
        result = plan(request)
        seconds.append(time.perf_counter() - start)
        evaluated = result.candidates_evaluated
    median = statistics.median(seconds)
    import os

    text = (f"`python bench/plan_speed.py --repeat {args.repeat}`: a full plan of Llama-3-70B on 8 nodes of 8 H100s, "
            f"**{evaluated:,} candidates in {median:.3f} s** (median of {args.repeat}), "
            f"**{evaluated / median:,.0f} candidates/s**, on {os.cpu_count()} CPU cores.")
    from bench.readme import publish

    return publish(text, args.readme, "planspeed")


if __name__ == "__main__":
    sys.exit(main())
