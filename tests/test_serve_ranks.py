"""`kvstrata serve --tp 2`: two real gloo ranks behind one HTTP server give the tokens and cache
hits of the single-rank server; streaming, a dropped stream and SIGTERM (exit 0) work there too."""

from __future__ import annotations

import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.serve_helpers import TINY_ENGINE, Server
from tests.tiny_models import make_llama

PROMPTS = [[(11 * i + k) % 97 for i in range(33 + 8 * k)] for k in range(3)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(
        tmp_path_factory.mktemp("llama") / "tiny", seed=6, max_position_embeddings=512
    )


def served(srv: Server) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for p in [*PROMPTS, PROMPTS[0]]:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
        out.append((r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens))
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True
    )
    out.append(("".join(c.choices[0].text for c in stream), -1))
    return out


@pytest.mark.slow
def test_tp2_server_equals_one_rank(ckpt: Path, tmp_path: Path) -> None:
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "64"]
    one = Server(args, tmp_path / "one.log")
    try:
        want = served(one)
    finally:
        assert one.terminate() == 0
    two = Server([*args, "--tp", "2"], tmp_path / "two.log")
    try:
        assert served(two) == want
        assert want[3][1] == 32  # the repeated prompt: its 4 full pages from L1, on both ranks
        body = {"prompt": PROMPTS[2], "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{two.url}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # then the client goes away: every rank aborts it
        again = openai.OpenAI(base_url=f"{two.url}/v1", api_key="none", max_retries=0)
        r2 = again.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
        assert r2.choices[0].text == want[0][0]
        time.sleep(1.0)  # rank 0 reports pools and agreement latencies every 0.5 s
        metrics = httpx.get(f"{two.url}/metrics").text
        count = [
            x for x in metrics.splitlines() if x.startswith("kvstrata:step_consensus_seconds_count")
        ]
        assert count and float(count[0].rsplit(" ", 1)[1]) > 0
        assert 'kvstrata:kv_cache_usage_perc{model_name="tiny",pool="device"}' in metrics
        assert "kvstrata:kv_moved_bytes_total" in metrics
    finally:
        assert two.terminate(timeout_s=120) == 0, (tmp_path / "two.log").read_text()
    assert "Traceback" not in (tmp_path / "two.log").read_text()
