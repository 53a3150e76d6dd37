"""How long CI takes: a fresh clone's `.ci/run` (set-up and the whole suite), timed on this machine.

    python bench/ci_time.py [--ref HEAD] [--timeout 5400] [--readme README.md]

Clones this repository at REF into a temporary directory (nothing beside it: the tests must not
need ../shared), runs `bash .ci/run` there as CI does (a fresh .venv, the pinned CPU torch, the
package index), and prints the wall time of the whole run, the tests' own time and pytest's
summary. The run is started with SIGINT at its default disposition, as a terminal's foreground job
has it (a job started in the background of a non-interactive shell ignores SIGINT, and the suite's
Ctrl-C test would then see its CLI rightly ignore the signal). Exits 1, publishing nothing, when
the run fails; its log's tail is printed.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# pytest -q's last line, e.g. "1264 passed, 3 skipped, 24 warnings in 845.12s (0:14:05)"
SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ passed.*?) in (?P<seconds>[\d.]+)s", re.MULTILINE)


def _clone(ref: str, into: Path) -> Path:
    target = into / "planner"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(target)], check=True)
    subprocess.run(["git", "-C", str(target), "checkout", "--quiet", ref], check=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default="HEAD", help="commit to clone (default HEAD)")
    parser.add_argument("--timeout", type=int, default=5400, help="seconds before the run is ended (CI's limit)")
    parser.add_argument("--readme", help="replace the citime block of this README")
    args = parser.parse_args()

    ref = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.ref], check=True,
                         capture_output=True, text=True).stdout.strip()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the child's SIGINT: default, after exec
    with tempfile.TemporaryDirectory(prefix="planner-ci-") as tmp:
        clone = _clone(ref, Path(tmp))
        start = time.monotonic()
        try:
            done = subprocess.run(["bash", ".ci/run"], cwd=clone, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"bench/ci_time.py: .ci/run at {ref} did not finish in {args.timeout} s", file=sys.stderr)
            return 1
        seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    summary = SUMMARY.search(output)
    if done.returncode != 0 or summary is None:
        # the tests' own tail (stdout) first: the installers' warnings on stderr would push it out
        print(done.stdout[-6000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
        print(f"bench/ci_time.py: .ci/run at {ref} failed (exit {done.returncode})", file=sys.stderr)
        return 1
    counts = summary.group("counts").replace("\n", " ")
    text = (f"`python bench/ci_time.py` at {ref}: a fresh clone's `.ci/run` took **{seconds / 60:.1f} minutes** "
            f"on this 2-core machine (set-up included), the tests {float(summary.group('seconds')) / 60:.1f} "
            f"minutes: {counts}.")
    from bench.readme import publish

    return publish(text, args.readme, "citime")


if __name__ == "__main__":
    sys.exit(main())
