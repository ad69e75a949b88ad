#!/usr/bin/env bash
# The test suite: set up (venv, pinned deps, Debian's redis-server), lint, and run pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
# the house checks over every file (no folder skipped), before the tests
.venv/bin/ruff check --no-cache .
.venv/bin/ruff format --check --no-cache .
# loadfile: a file's tests run in order in one worker (some share servers a test before started)
exec .venv/bin/python -m pytest -n 2 --dist loadfile -p no:cacheprovider "$@"
