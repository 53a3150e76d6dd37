#!/usr/bin/env bash
# Fresh machine -> the main job: install the core into .venv and estimate an embedded default
# (Mistral-7B from the catalogue) under every strategy. No GPU, no network, no account.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --disable-pip-version-check -e .
planner estimate --model mistral-7b-v0.1 --strategy ddp --precision bf16-pure --gpu a100-80gb
for strategy in zero1 zero2 zero3 fsdp; do
  echo
  planner estimate --model mistral-7b-v0.1 --strategy "$strategy" --gpus 8 --gpu a100-80gb --seq-len 4096
done
