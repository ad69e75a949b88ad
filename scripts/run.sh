#!/usr/bin/env bash
# The main job: set up (first time only) and run `kvstrata run` on its embedded defaults.
# Extra arguments go to `kvstrata run` (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/kvstrata run "$@"
