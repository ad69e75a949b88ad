"""`torchrun --nproc-per-node 2 -m kvstrata.cli.main serve --tp 2`: rank 0 serves HTTP, both
ranks step together over gloo; the openai client gets cached tokens, the same text streamed or
not, a prefix-cache reset on both ranks; SIGTERM to rank 0 stops every rank and torchrun exits 0."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.serve_helpers import TINY_ENGINE, Server, reserved_ports
from tests.tiny_models import make_llama

PROMPT = [(7 * i + 5) % 97 for i in range(37)]  # 4 hittable pages of 8


@pytest.mark.slow
def test_torchrun_tp2_server(tmp_path: Path) -> None:
    ckpt = make_llama(tmp_path / "tiny", seed=6, max_position_embeddings=512)
    args = ["--model", str(ckpt), *TINY_ENGINE, "--device-pages", "64", "--tp", "2"]
    log = tmp_path / "torchrun.log"
    with reserved_ports(1) as (master,):  # held until torchrun's store binds it (SO_REUSEADDR)
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(master),
        ]  # fmt: skip
        srv = Server([*args, "--debug-endpoints"], log, launcher=launcher)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        first = client.completions.create(**body)
        again = client.completions.create(**body)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == 32
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**body, stream=True)
        )
        assert again.choices[0].text == first.choices[0].text == streamed
        rep = srv.wait_idle()  # the integrity check ran on both ranks
        assert rep["ok"] and rep["accounting"]["device"]["cached"] > 0
        assert httpx.post(f"{srv.url}/reset_prefix_cache", timeout=60).json() == {"success": True}
        after = client.completions.create(**body)
        tiers = after.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
        assert tiers == {"device": 0, "host": 32, "storage": 0}  # device reset on both ranks
        assert after.choices[0].text == first.choices[0].text
        assert srv.wait_idle()["ok"]
        pid = int(re.search(r"\(pid (\d+)\)", log.read_text()).group(1))  # rank 0
        os.kill(pid, signal.SIGTERM)
        assert srv.proc.wait(90) == 0, log.read_text()  # every rank stopped in step: torchrun 0
    finally:
        srv.stop()
    assert "Traceback" not in log.read_text()
