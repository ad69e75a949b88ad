#!/usr/bin/env bash
# Adds the sglang package (requirements-sglang.txt, --no-deps) to .venv for the SGLang HiCache
# integration: our pinned torch/transformers stay as they are. Idempotent; scripts/test.sh calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
stamp=.venv/.kvstrata-sglang
want=$(sha256sum requirements-sglang.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps torch==2.13.0 \
    -r requirements-sglang.txt
  echo "$want" > "$stamp"
fi
