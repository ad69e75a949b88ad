"""`kvstrata bench serve` against a real server: cache on vs off report, PNG, errors counted;
and the SmolLM2 server once (real tokenizer, chat template, EOS, exact cached tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from kvstrata.cli.main import main
from tests.serve_helpers import Server

KEYS = (
    "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "output_tokens_per_s", "hit_rate",
    "errors",
)  # fmt: skip


CKPT = {"seed": 5, "max_position_embeddings": 4096}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""


def check_report(path: Path) -> dict:
    rep = json.loads(path.read_text())
    for mode in ("cache_on", "cache_off"):
        assert all(k in rep[mode] for k in KEYS), rep[mode]
        assert rep[mode]["errors"] == 0 and rep[mode]["requests"] == 6
        assert rep[mode]["output_tokens_per_s"] > 0
    assert rep["cache_on"]["hit_rate"] > 0.3  # turns repeat their whole history
    assert rep["cache_off"]["hit_rate"] == 0
    assert Path(rep["plot"]).stat().st_size > 0
    return rep


def test_bench_serve_drives_a_url(ckpt: Path, tmp_path: Path) -> None:
    srv = Server(["--model", str(ckpt), "--page-size", "16", "--threads", "1"], tmp_path / "s.log")
    try:
        args = ["bench", "serve", "--quick", "--url", srv.url, "--out", str(tmp_path)]
        assert main([*args, "--json", str(tmp_path / "r.json")]) == 0
        rep = check_report(tmp_path / "r.json")
        assert rep["url"] == srv.url  # cache off here: a fresh cache_salt per request
    finally:
        assert srv.terminate() == 0


def test_bench_options_belong_to_serve(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "radix", "--quick", "--url", "http://x"]) == 2
    assert "--url is not an option of bench radix" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_serve_starts_our_server_twice(ckpt: Path, tmp_path: Path) -> None:
    args = ["bench", "serve", "--quick", "--model", str(ckpt), "--out", str(tmp_path)]
    assert main([*args, "--json", str(tmp_path / "r.json")]) == 0
    rep = check_report(tmp_path / "r.json")
    over = rep["device_hit_overhead"]
    assert over["prompt_tokens"] > 64 and over["http_ttft_s"] > 0 and over["engine_ttft_s"] > 0
    direct = rep["direct"]  # the same load with no HTTP: the same prompts, turn by turn
    assert direct["requests"] == 6 and direct["errors"] == 0
    assert direct["prompt_tokens"] == rep["cache_on"]["prompt_tokens"]
    assert direct["hit_rate"] > 0.3 and rep["ttft_p50_http_over_direct"] > 0
    target = rep["direct_target"]  # the same load under the decode-latency target
    assert target["requests"] == 6 and target["errors"] == 0 and target["tpot_p50_s"] > 0
    assert rep["tpot_p50_s_target_over_off"] > 0 and rep["ttft_p90_s_target_over_off"] > 0


@pytest.mark.slow
def test_smollm2_chat(tmp_path: Path) -> None:
    srv = Server(["--threads", "2", "--debug-endpoints"], tmp_path / "smol.log")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        system = "You are a helpful assistant. " * 20  # a shared prefix of two full pages
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
        a = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=msgs, max_tokens=24, temperature=0
        )
        assert a.choices[0].message.content.strip()
        assert a.choices[0].finish_reason in ("stop", "length")
        if a.choices[0].finish_reason == "stop":  # EOS ended it early
            assert a.usage.completion_tokens < 24
        assert a.usage.prompt_tokens_details.cached_tokens == 0
        b = client.chat.completions.create(
            model=a.model, messages=msgs, max_tokens=24, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in b if c.choices) == (
            a.choices[0].message.content
        )
        c = client.chat.completions.create(
            model=a.model, messages=msgs, max_tokens=1, temperature=0
        )
        full_pages = (c.usage.prompt_tokens - 1) // 64
        assert c.usage.prompt_tokens_details.cached_tokens == 64 * full_pages > 0
        assert srv.wait_idle()["ok"]
    finally:
        assert srv.terminate() == 0


@pytest.mark.slow
def test_vllm_client_replays_the_heldout_trace_against_our_server(
    ckpt: Path, tmp_path: Path
) -> None:
    """`vllm bench serve` (vLLM's own client) drives our server with the trace, in file order:
    every row completes, its figures come back, and later turns hit the earlier turns' pages."""
    from kvstrata.bench.serve_replay import prefix_counts
    from kvstrata.bench.vllm_replay_client import replay
    from kvstrata.model.smollm2 import ensure_smollm2
    from kvstrata.workloads.heldout_trace import TraceSpec, trace_rows, write_trace

    spec = TraceSpec(sessions=3, turns=2, first_lines=8, tool_lines=4, output_tokens=4)
    render = lambda msgs: "".join(f"<{m['role']}>{m['content']}\n" for m in msgs)  # noqa: E731
    data = write_trace(tmp_path / "trace.jsonl", trace_rows(spec, render))
    srv = Server(["--model", str(ckpt), "--page-size", "16", "--threads", "1"], tmp_path / "s.log")
    try:
        got = replay(srv.url, ensure_smollm2(), data, 6, 2, tmp_path / "replay.json")
        queries, hits = prefix_counts(srv.url)
    finally:
        assert srv.terminate() == 0
    assert got["completed"] == 6 and got["failed"] == 0
    assert 0 < got["ttft_p50_s"] <= got["ttft_p90_s"] and got["tpot_p50_s"] > 0
    assert got["output_tokens"] == 6 * 4 and got["output_tokens_per_s"] > 0  # the rows' lengths
    assert queries > 0 and hits / queries > 0.3  # turn 1 resends turn 0 whole


DECODE_KEYS = frozenset(
    f"{d}_{k}"
    for d in ("float32", "bfloat16")
    for k in (
        "hf_generate_tps", "b1_tps", "b4_tps", "b4_tpot_p50_ms", "b4_python_ms",
        "b4_memory_bound_step_ms", "b1_tps_vs_hf", "python_top_b8",
    )
)  # fmt: skip


@pytest.mark.slow
def test_bench_decode_drives_a_server_per_dtype(tmp_path: Path) -> None:
    """bench decode's quick run (its smoke test): every figure real; `--vllm-url` serves the fp32
    rows only: the client streams every token of every batch from a real OpenAI-compatible server
    (ours, SmolLM2 in fp32); bf16 has no server here."""
    srv = Server(["--threads", "1"], tmp_path / "s.log")
    try:
        out = tmp_path / "d.json"
        assert main(["bench", "decode", "--quick", "--vllm-url", srv.url, "--json", str(out)]) == 0
    finally:
        assert srv.terminate() == 0
    rep = json.loads(out.read_text())
    assert DECODE_KEYS <= rep.keys(), sorted(DECODE_KEYS - rep.keys())
    assert all(rep[k] > 0 for k in DECODE_KEYS if isinstance(rep[k], float))
    assert rep["float32_vllm"] == srv.url and rep["bfloat16_vllm"] == "not measured"
    for b in (1, 4):
        assert rep[f"float32_b{b}_vllm_tps"] > 0 and rep[f"float32_b{b}_tps_vs_vllm"] > 0
        assert f"bfloat16_b{b}_vllm_tps" not in rep
