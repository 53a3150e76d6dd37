#!/usr/bin/env bash
# Fresh machine -> the whole test suite: install the core, the verification backend (torch CPU
# build pinned, DeepSpeed, transformers) and the test tools into .venv, then run pytest, which
# includes the real DeepSpeed runs on CPU ranks (marker `deepspeed`; the part of the matrix in
# tests/real_runs.py CI_RUNS) and a headless-browser test.
set -euo pipefail
cd "$(dirname "$0")/.."
# The end-to-end page test drives Debian's chromium (no browser download); install it where we
# may, else that one test skips (or fails, with PLANNER_REQUIRE_BROWSER=1 as in CI).
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "scripts/test.sh: could not install chromium; the browser test will skip" >&2
fi
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e '.[backend,web,test]'
export PATH="$PWD/.venv/bin:$PATH"
# the long real-run matrix (marker slow_matrix) is bench/accuracy.py's; CI runs its representative part
python -m pytest -q -m "not slow_matrix" "$@"
