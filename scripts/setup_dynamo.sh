#!/usr/bin/env bash
# Creates .venv-dynamo: Dynamo's standalone KV indexer (`python -m dynamo.indexer`, from
# ai-dynamo-runtime, pinned) in its own venv (its pins are not ours). Idempotent: a second call only
# checks. Used by scripts/test.sh; the fleet tests drive this indexer with our KV events and
# `kvstrata serve --role router --kv-indexer-url` talks to it. If the install fails (no wheel for
# this platform, no network), the script says so and exits 0: the tests that need it then skip
# naming the reason (.venv-dynamo/.kvstrata-dynamo-failed holds it).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-dynamo
stamp=$V/.kvstrata-dynamo
failed=$V/.kvstrata-dynamo-failed
want=$(sha256sum scripts/setup_dynamo.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" == "$want" ]; then
  exit 0
fi
if [ ! -x "$V/bin/python" ]; then
  "$PY" -m venv "$V" || { echo "setup_dynamo: cannot create $V"; exit 0; }
fi
rm -f "$failed"
if ! log=$("$V/bin/pip" install --quiet --disable-pip-version-check ai-dynamo-runtime==1.6.1 2>&1) \
  || ! log=$("$V/bin/python" -m dynamo.indexer --help 2>&1 >/dev/null); then
  echo "ai-dynamo-runtime==1.6.1 did not install: $(echo "$log" | tail -n 1)" > "$failed"
  echo "setup_dynamo: $(cat "$failed") (the Dynamo tests will skip)"
  exit 0
fi
echo "$want" > "$stamp"
