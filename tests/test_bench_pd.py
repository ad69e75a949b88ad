"""`kvstrata bench pd --quick` on a tiny model through the CLI: router + prefill + decode and a
single server, real processes. Exact where deterministic: the pages decode received are the
prompt pages it did not hold (all when cold, then all but the previous turn's full pages), the
bytes are those pages x page bytes, and both setups give the same greedy text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.bench.pd import PAGE, QUICK
from kvstrata.cli.main import main
from kvstrata.workloads.agent import build_workload
from tests.tiny_models import make_llama

pytestmark = pytest.mark.slow  # five real server processes

KEYS = {
    "bytes_sent_ratio", "new_token_share", "outputs_identical", "ttft_p50_s_pd",
    "ttft_p50_s_single", "ttft_p90_s_pd", "ttft_p90_s_single", "prefill_tokens_computed_pd",
    "prefill_tokens_computed_single",
}  # fmt: skip


def test_bench_pd_quick_sends_exactly_the_missing_pages(tmp_path: Path) -> None:
    ckpt = make_llama(tmp_path / "tiny", seed=3, max_position_embeddings=1024)
    out = tmp_path / "pd.json"
    args = ["bench", "pd", "--quick", "--json", str(out), "--model", str(ckpt)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    rep = json.loads(out.read_text())
    assert KEYS <= rep.keys()
    assert rep["outputs_identical"] is True
    lens = [[len(p) for p in s] for s in build_workload(QUICK, 97)]  # tiny vocab: 97 ids
    cold = sum(-(-s[0] // PAGE) for s in lens)
    later = sum(-(-b // PAGE) - a // PAGE for s in lens for a, b in zip(s, s[1:], strict=False))
    assert rep["pages_sent"] == rep["pages_expected"] == cold + later and rep["pages_exact"]
    assert rep["bytes_sent"] == rep["pages_sent"] * rep["page_bytes"]
    whole = sum(-(-n // PAGE) for s in lens for n in s) * rep["page_bytes"]
    assert rep["bytes_sent_ratio"] == rep["bytes_sent"] / whole
    new = sum(s[-1] for s in lens)  # each turn extends the last: the new tokens add up to it
    assert rep["new_token_share"] == new / sum(map(sum, lens))
    assert rep["prompt_tokens"] == sum(map(sum, lens)) and rep["requests"] == 6
    first = [s[0] for s in lens]
    assert rep["bytes_sent_by_turn"][0] == rep["bytes_whole_prefix_by_turn"][0]  # cold turn
    assert (
        rep["bytes_whole_prefix_by_turn"][0]
        == sum(-(-n // PAGE) for n in first) * rep["page_bytes"]
    )
    assert rep["new_token_share_by_turn"][0] == 1.0
    # decode skipped every full page of the previous turn; prefill computed what nobody held
    assert rep["pages_skipped"] == sum(a // PAGE for s in lens for a in s[:-1])
    assert 0 < rep["prefill_tokens_computed_pd"] <= rep["prompt_tokens"]
