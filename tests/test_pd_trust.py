"""Who a P/D worker exchanges KV with, between real worker processes on 127.0.0.1 whose transfer
sockets run ZMQ CURVE (keys from `kvstrata keys curve`): decode hands off only to its configured
prefill workers (a client naming its own zmq peer or an http:// URL is refused with a 403 before
anything is dialled or fetched, and nothing is cached); the router's way of naming one (its
transfer endpoint) still works; a peer without an allowed key (or without CURVE) gets nothing
through to prefill, which commits nothing of it; the honest CURVE pair works end to end, and
every output equals the cold run."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvstrata.cli.keys_cmd import write_curve_pair
from kvstrata.pd.transport import ZmqTransport
from kvstrata.pd.wire import header, pack_keys
from kvstrata.serve.codec import ByteCodec
from kvstrata.zmq_curve import CurveKeys
from tests.pd_helpers import complete, info, keys_of, metrics, raw_handoff, start_all, worker_args
from tests.serve_helpers import free_port
from tests.tiny_models import hf_greedy, load_hf

pytestmark = pytest.mark.slow  # two real worker processes

CKPT = {"seed": 3, "max_position_embeddings": 512}
"""This module's tiny Llama (the `ckpt` fixture of tests/conftest.py)."""

PROMPT = [(13 * i + 5) % 97 for i in range(41)]  # 6 pages of 8


def key_pairs(tmp: Path) -> dict[str, Path]:
    """Key pairs p (prefill), d (decode), rogue, each in its own directory; p's peers directory
    holds d's public key, d's holds p's (the rogue's is in neither)."""
    for name in ("p", "d", "rogue"):
        write_curve_pair(tmp / name, name)
    for me, peer in (("p", "d"), ("d", "p")):
        (tmp / f"{me}_peers").mkdir()
        (tmp / f"{me}_peers" / f"{peer}.key").write_bytes((tmp / peer / f"{peer}.key").read_bytes())
    return {n: tmp / n / f"{n}.key_secret" for n in ("p", "d", "rogue")}


def curve_args(tmp: Path, me: str, secrets: dict[str, Path]) -> list[str]:
    return [
        "--pd-curve-secret-file",
        str(secrets[me]),
        "--pd-curve-peers-dir",
        str(tmp / f"{me}_peers"),
    ]


@pytest.fixture(scope="module")
def workers(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A prefill p and a decode d that lists p as its one prefill worker, CURVE between them."""
    tmp = tmp_path_factory.mktemp("pdtrust")
    secrets = key_pairs(tmp)
    port = free_port()
    p, d = start_all(
        [
            (worker_args(ckpt, "--role", "prefill", *curve_args(tmp, "p", secrets)), tmp / "p.log",
             port),
            (worker_args(ckpt, "--role", "decode", "--pd-prefill", f"http://127.0.0.1:{port}",
                         "--pd-timeout-s", "3", *curve_args(tmp, "d", secrets)), tmp / "d.log"),
        ]
    )  # fmt: skip
    yield {"p": p, "d": d, "tmp": tmp, "secrets": secrets}
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
    workers: dict[str, Any], ckpt: Path
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
    workers: dict[str, Any], ckpt: Path
) -> None:
    prompt = [(3 * i + 11) % 97 for i in range(30)]
    endpoint = info(workers["p"])["transfer_endpoint"]
    for wanted in (endpoint, workers["p"].url):
        r = complete(workers["d"], prompt, pd_prefill=wanted)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == cold(ckpt, prompt)
        assert r.json()["usage"]["pd"]["prefill"] == endpoint
    assert workers["d"].wait_idle()["ok"] and workers["p"].wait_idle()["ok"]


def keys_with_peer(tmp: Path, secret: Path, peer: str) -> CurveKeys:
    """A client's keys that trust `peer`'s public key (its peers directory holds only that)."""
    return CurveKeys.load(str(secret), str(tmp / f"{'d' if peer == 'p' else 'p'}_peers"), "test")


def test_a_peer_without_an_allowed_curve_key_gets_nothing_through(
    workers: dict[str, Any], ckpt: Path
) -> None:
    p, d, tmp, secrets = workers["p"], workers["d"], workers["tmp"], workers["secrets"]
    pinfo = info(p)
    ep, lay, public = pinfo["transfer_endpoint"], pinfo["layout"], pinfo["curve_public_key"]
    assert public.encode() == (tmp / "p" / "p.key_secret").read_bytes().split(b'"')[1]
    prompt = [(29 * i + 7) % 97 for i in range(41)]
    blocks = p.integrity()
    handoffs = metrics(p)
    # a hand-off claiming decode holds 4 pages: prefill would pull them and commit what came
    ask = header(
        "handoff",
        "rogue",
        layout=lay,
        tokens=prompt,
        salt="",
        keys=pack_keys(keys_of(lay, prompt)[:4]),
    )
    rogue = keys_with_peer(tmp, secrets["rogue"], "p")  # knows p's public key, not an allowed one
    for transport in (ZmqTransport(rogue), ZmqTransport()):  # wrong key; no CURVE at all
        ch = transport.connect(ep, "rogue", public.encode() if transport.curve else b"")
        try:
            ch.send([ask])
            assert ch.recv(2.0) is None  # no refusal, no pull, no page: the handshake failed
        finally:
            ch.close()
    rep = p.wait_idle()
    assert rep["ok"] and rep["device_free"] == blocks["device_free"]
    assert metrics(p) == handoffs  # no hand-off ran, nothing pulled or sent
    # the honest CURVE client (d's key pair) is answered
    head, _ = raw_handoff(
        ep, prompt, [], lay, hid="honest", curve=keys_with_peer(tmp, secrets["d"], "p")
    )
    assert head["type"] == "pages" and head["computed_tokens"] == 41
    # and end to end: prefill committed nothing of the rogue's claim, decode lands real pages
    r = complete(d, prompt)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == cold(ckpt, prompt)
    assert r.json()["usage"]["pd"]["pages_pulled"] == 0
    assert d.wait_idle()["ok"] and p.wait_idle()["ok"]
