"""Who a P/D worker exchanges KV with, between real worker processes on 127.0.0.1: decode hands
off only to its configured prefill workers (a client naming its own zmq peer or an http:// URL
is refused with a 403 before anything is dialled or fetched, and nothing is cached); the router's
way of naming one (its transfer endpoint) still works; a later honest request's output equals the
cold run."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvstrata.serve.codec import ByteCodec
from tests.pd_helpers import complete, info, start_all, worker_args
from tests.serve_helpers import Server, free_port
from tests.tiny_models import hf_greedy, load_hf

pytestmark = pytest.mark.slow  # two real worker processes

CKPT = {"seed": 3, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""

PROMPT = [(13 * i + 5) % 97 for i in range(41)]  # 6 pages of 8


@pytest.fixture(scope="module")
def workers(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """A prefill p and a decode d that lists p as its one prefill worker."""
    tmp = tmp_path_factory.mktemp("pdtrust")
    port = free_port()
    p, d = start_all(
        [
            (worker_args(ckpt, "--role", "prefill"), tmp / "p.log", port),
            (worker_args(ckpt, "--role", "decode", "--pd-prefill", f"http://127.0.0.1:{port}",
                         "--pd-timeout-s", "3"), tmp / "d.log"),
        ]
    )  # fmt: skip
    yield {"p": p, "d": d}
    for s in (p, d):
        s.stop()


def cold(ckpt: Path, prompt: list[int], n: int = 4) -> str:
    return ByteCodec(97).decode(hf_greedy(load_hf(ckpt), prompt, n))


class Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        Recorder.hits.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_client_chosen_prefill_is_refused_and_nothing_is_cached(
    workers: dict[str, Server], ckpt: Path
) -> None:
    d = workers["d"]
    free = d.wait_idle()["device_free"]
    rogue = zmq.Context.instance().socket(zmq.ROUTER)  # would answer with made-up pages
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    web = http.server.HTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        for wanted in (f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{web.server_port}"):
            r = complete(d, PROMPT, pd_prefill=wanted)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert err["param"] == "pd_prefill" and err["type"] == "PermissionDeniedError"
            assert wanted in err["message"] and workers["p"].url in err["message"]
        assert rogue.poll(500) == 0  # never dialled
        assert Recorder.hits == []  # never fetched (no server-side request forgery)
    finally:
        rogue.close(0)
        web.shutdown()
    rep = d.wait_idle()
    assert rep["ok"] and rep["device_free"] == free  # nothing of the refused requests stays
    # the honest request: decode held nothing of the prompt, so every page crosses
    r = complete(d, PROMPT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == cold(ckpt, PROMPT)
    assert r.json()["usage"]["pd"]["pages_received"] == 6
    assert r.json()["usage"]["pd"]["pages_skipped"] == 0


def test_the_router_names_a_configured_prefill_by_its_transfer_endpoint(
    workers: dict[str, Server], ckpt: Path
) -> None:
    prompt = [(3 * i + 11) % 97 for i in range(30)]
    endpoint = info(workers["p"])["transfer_endpoint"]
    for wanted in (endpoint, workers["p"].url):
        r = complete(workers["d"], prompt, pd_prefill=wanted)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == cold(ckpt, prompt)
        assert r.json()["usage"]["pd"]["prefill"] == endpoint
    assert workers["d"].wait_idle()["ok"] and workers["p"].wait_idle()["ok"]
