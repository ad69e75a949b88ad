#!/usr/bin/env bash
# The test suite: set up (venv, pinned deps, the native module, Debian's redis-server), lint, and run pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_sglang.sh  # the sglang package for the HiCache integration tests
bash scripts/apt_need.sh /usr/bin/redis-server redis-server
# vLLM's CPU build in its own venv (its pins clash with ours): the connector tests run it
bash scripts/setup_vllm.sh
# Dynamo's standalone KV indexer in its own venv: the fleet router's tests drive it (they skip, saying
# why, only where it cannot install)
bash scripts/setup_dynamo.sh
# the house checks over every file (no folder skipped), before the tests
.venv/bin/ruff check --no-cache .
.venv/bin/ruff format --check --no-cache .
# loadfile: a file's tests run together in one worker (fewer server starts per file; tests no longer
# depend on order, and tests/conftest.py's tiny checkpoints are built once per worker)
exec .venv/bin/python -m pytest -n 2 --dist loadfile -p no:cacheprovider "$@"
