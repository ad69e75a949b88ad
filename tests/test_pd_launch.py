"""LocalPD: router + prefill + decode as real local processes sharing one storage directory; the
router's answers equal a single server's, exact pages cross (all when cold, the last one when
decode holds the rest), the store fills, stop() exits every process with 0, and a worker that
cannot start is reported by role with nothing left running."""

from __future__ import annotations

import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from kvstrata.bench.local_pd import LocalPD, LocalPDConfig
from tests.serve_helpers import TINY_ENGINE
from tests.tiny_models import make_llama

pytestmark = pytest.mark.slow  # several real server processes (minutes on a loaded box)

WORKER = [*TINY_ENGINE, "--device-pages", "64", "--host-pages", "64", "--debug-endpoints",
          "--prefetch-policy", "wait_complete"]  # fmt: skip
PROMPT = [(3 * i + 1) % 97 for i in range(41)]  # 5 full pages of 8 (+1 token)


def settled(url: str, timeout_s: float = 30.0) -> None:
    """Wait until the worker has no request and no cache op (its storage writes are done)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rep = httpx.get(f"{url}/debug/integrity", timeout=10).json()
        if rep["running"] == rep["waiting"] == rep["pending_ops"] == 0:
            return
        assert time.monotonic() < deadline, f"{url} not idle within {timeout_s} s: {rep}"
        time.sleep(0.05)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_local_pd_serves_shares_the_store_and_stops_cleanly(tmp_path: Path) -> None:
    ckpt = make_llama(tmp_path / "tiny", seed=2, max_position_embeddings=256)
    cfg = LocalPDConfig(
        model=str(ckpt), store_dir=str(tmp_path / "storage"), log_dir=str(tmp_path / "logs"),
        worker_args=tuple(WORKER), start_timeout_s=240,
    )  # fmt: skip
    pd = LocalPD(cfg).start()
    try:
        assert httpx.get(f"{pd.url}/health", timeout=10).status_code == 200
        info = httpx.get(f"{pd.workers['prefill'].url}/v1/pd/info", timeout=10).json()
        page_bytes = info["layout"]["page_bytes"]
        rc = client_of(pd.url)
        cold = rc.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        use = cold.usage.model_extra["pd"]
        assert (use["pages_received"], use["bytes_received"]) == (6, 6 * page_bytes)
        settled(pd.workers["decode"].url)
        assert any((tmp_path / "storage").rglob("*")), "the shared storage directory holds nothing"
        again = rc.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        use = again.usage.model_extra["pd"]  # decode holds the 5 full pages: only the last
        assert (use["pages_received"], use["pages_skipped"]) == (1, 5)
        direct = client_of(pd.workers["prefill"].url).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0
        )  # the single-server path of the same model
        assert direct.choices[0].text == cold.choices[0].text == again.choices[0].text
    finally:
        codes = pd.stop()
    assert codes == {"router": 0, "prefill": 0, "decode": 0}
    for name in ("router", "prefill", "decode"):
        assert "Traceback" not in (tmp_path / "logs" / f"{name}.log").read_text()


def test_a_worker_that_cannot_start_is_named(tmp_path: Path) -> None:
    cfg = LocalPDConfig(
        model=str(tmp_path / "missing"), store_dir=str(tmp_path / "storage"),
        log_dir=str(tmp_path / "logs"), start_timeout_s=120,
    )  # fmt: skip
    pd = LocalPD(cfg)
    with pytest.raises(RuntimeError, match="prefill worker.*exited 2") as exc:
        pd.start()
    assert "decode worker" in str(exc.value) and pd.router is None and not pd.workers
