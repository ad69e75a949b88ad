"""`kvstrata bench vllm --quick` through the CLI: vLLM alone and vLLM + kvstrata, one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli.main import main

pytestmark = pytest.mark.slow


def test_bench_vllm_quick(tmp_path: Path) -> None:
    out = tmp_path / "vllm.json"
    assert main(["bench", "vllm", "--quick", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    for key in (
        "hit_rate_vllm",
        "hit_rate_kvstrata",
        "ttft_p50_s_vllm",
        "ttft_p50_s_kvstrata",
        "outputs_identical",
    ):
        assert key in rep, key
    assert rep["outputs_identical"] is True
    # cached-token counts are deterministic: kvstrata's host memory keeps what vLLM evicted
    assert rep["hit_rate_kvstrata"] > rep["hit_rate_vllm"]
