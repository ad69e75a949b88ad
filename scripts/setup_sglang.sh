#!/usr/bin/env bash
# Installs the sglang package (requirements-sglang.txt, --no-deps) into .venv/sglang-extra, a
# directory put on PYTHONPATH only for what needs sglang (its contract tests, `kvstrata bench
# sglang`): .venv itself keeps exactly our pinned set (importing sglang patches transformers, and
# its torchvision would be picked up by transformers). Idempotent; scripts/test.sh calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
dest=.venv/sglang-extra
stamp=$dest/.kvstrata-sglang
want=$(sha256sum requirements-sglang.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  rm -rf "$dest"
  # no torch here: --no-deps pulls nothing, and torch comes from .venv (2.13.0, CPU)
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps --target "$dest" \
    -r requirements-sglang.txt
  echo "$want" > "$stamp"
fi
