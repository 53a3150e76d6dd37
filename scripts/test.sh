#!/usr/bin/env bash
# Fresh machine -> the whole test suite: install the core, the verification backend (torch CPU
# build pinned, DeepSpeed, transformers) and the test tools into .venv, then run pytest, which
# includes the real DeepSpeed runs on CPU ranks (marker `deepspeed`).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e '.[backend,web,test]'
export PATH="$PWD/.venv/bin:$PATH"
python -m pytest -q "$@"
