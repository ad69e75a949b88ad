"""Hand-off messages: per-page checksums, all or nothing, layout mismatches named, and the zmq
transport carrying them unchanged between real sockets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvstrata.pd.config import PDConfig
from kvstrata.pd.transport import TRANSPORTS
from kvstrata.pd.wire import (
    Layout,
    WireError,
    assemble,
    checksum,
    int_list,
    layer_message,
    layout_mismatch,
    pack_keys,
    pages_message,
    pull_message,
    pulled_message,
    read_header,
    read_layer,
    read_pages,
    read_pulled,
    typed,
    unpack_keys,
)
from kvstrata.serve.process import ROOT
from tests.tiny_models import make_llama

PAGE_BYTES = 64
LAYOUT = Layout(8, "float32", "fp", "", 2, 2, 16, page_bytes=PAGE_BYTES)


def pages(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8) for _ in range(n)]


def test_checksum_is_xxh3_64_of_the_bytes() -> None:
    a = pages(1)[0]
    assert checksum(a) == checksum(bytes(a))
    b = a.copy()
    b[17] ^= 1
    assert checksum(b) != checksum(a)
    assert 0 <= checksum(a) < 1 << 64


def test_keys_round_trip_128_bit() -> None:
    keys = [0, 1, (1 << 128) - 1, 0x1234_5678_9ABC_DEF0_1122_3344_5566_7788]
    assert unpack_keys(pack_keys(keys)) == keys
    with pytest.raises(WireError, match="multiple of 16"):
        unpack_keys(b"\x00" * 17)


def test_layout_mismatch_names_the_field() -> None:
    assert layout_mismatch(LAYOUT, LAYOUT.as_dict(), "decode") is None
    for field, other in [("page_size", 16), ("dtype", "bfloat16"), ("model", "x"), ("tp", 2)]:
        msg = layout_mismatch(LAYOUT, {**LAYOUT.as_dict(), field: other}, "decode")
        assert msg is not None and msg.startswith(f"layout mismatch: {field} ")
        assert repr(other) in msg and "decode" in msg
    missing = {k: v for k, v in LAYOUT.as_dict().items() if k != "head_dim"}
    assert "head_dim" in (layout_mismatch(LAYOUT, missing, "decode") or "")


def test_any_peer_value_is_checked_never_raised_on() -> None:
    for theirs, why in [
        ("x", "is a str, not a map"),
        (5, "is a int, not a map"),
        (None, "is a NoneType"),
        ({**LAYOUT.as_dict(), "tp": True}, "tp is 1 here but True"),
        ({**LAYOUT.as_dict(), "page_size": float(LAYOUT.page_size)}, "page_size"),
    ]:
        assert why in (layout_mismatch(LAYOUT, theirs, "decode") or ""), theirs
    head = {"type": "pages", "first_page": "0", "vocab": True, "n": -1, "ids": [1, "2"]}
    for name, kind, words in [
        ("first_page", int, "'first_page': expected int, got str"),
        ("vocab", int, "'vocab': expected int, got bool"),
        ("n", int, r"'n': -1 is outside \[0,"),
        ("absent", str, "'absent': expected str, got nothing"),
    ]:
        with pytest.raises(WireError, match=words):
            typed(head, name, kind)
    with pytest.raises(WireError, match="'ids': not a list of ints in"):
        int_list(head, "ids")
    for frames in ([msgpack.packb({"type": "x", "id": 7})], [msgpack.packb([1])], [b"\xc1"]):
        with pytest.raises(WireError):
            read_header(frames)
    bad = dict(read_header(pages_message("h", 0, pages(1), np.ones(3, np.float32))), vocab="3")
    with pytest.raises(WireError, match="'vocab'"):
        read_pages(bad, pages_message("h", 0, pages(1), np.ones(3, np.float32)), PAGE_BYTES)


def test_pages_round_trip_and_all_or_nothing() -> None:
    sent, row = pages(3), np.arange(97, dtype=np.float32)
    frames = pages_message("h1", 2, sent, row, computed_tokens=9)
    head = read_header(frames)
    got = read_pages(head, frames, PAGE_BYTES)
    assert got.first_page == 2 and got.stats["computed_tokens"] == 9
    assert [bytes(p) for p in got.pages] == [bytes(p) for p in sent]
    assert got.nbytes == 3 * PAGE_BYTES and np.array_equal(got.logits, row)
    for bad_page in range(3):  # one flipped bit anywhere: the whole hand-off is refused
        broken = [*frames]
        page = np.array(sent[bad_page])
        page[5] ^= 0x40
        broken[1 + bad_page] = page
        with pytest.raises(WireError, match=f"page {bad_page} .*checksum"):
            read_pages(head, broken, PAGE_BYTES)
    with pytest.raises(WireError, match="expected 5 frames"):
        read_pages(head, frames[:-1], PAGE_BYTES)
    with pytest.raises(WireError, match="expected 128"):
        read_pages(head, frames, 2 * PAGE_BYTES)
    bad_row = [*frames[:-1], row + 1]
    with pytest.raises(WireError, match="logits"):
        read_pages(head, bad_row, PAGE_BYTES)


def test_zmq_transport_carries_frames_unchanged() -> None:
    zmq_t = TRANSPORTS.create("zmq")
    listener = zmq_t.listen("tcp://127.0.0.1:0")
    assert listener.endpoint.startswith("tcp://127.0.0.1:") and not listener.endpoint.endswith(":0")
    ch = zmq_t.connect(listener.endpoint)
    try:
        ch.send([b"hello"])
        got = listener.recv(5.0)
        assert got is not None and bytes(got[1][0]) == b"hello"
        sent, row = pages(4, seed=3), np.ones(11, dtype=np.float32)
        listener.send(got[0], pages_message("h", 0, sent, row))
        frames = ch.recv(5.0)
        assert frames is not None
        rec = read_pages(read_header(frames), frames, PAGE_BYTES)
        assert [bytes(p) for p in rec.pages] == [bytes(p) for p in sent]
        assert ch.recv(0.05) is None  # a bounded wait, nothing more
    finally:
        ch.close()
        listener.close()
    with pytest.raises(ValueError, match="unknown pd transport 'nixl'; known: zmq"):
        TRANSPORTS.create("nixl")


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="pd_timeout_s must be positive"):
        PDConfig(pd_timeout_s=0)
    with pytest.raises(ValueError, match="must be below pd_timeout_s"):
        PDConfig(pd_timeout_s=1, pd_heartbeat_s=1)
    with pytest.raises(ValueError, match="not an http"):
        PDConfig(pd_prefill="127.0.0.1:8000")
    assert PDConfig(pd_prefill="http://a:1, tcp://b:2").prefill_urls == ["http://a:1", "tcp://b:2"]


def test_multi_rank_pd_workers_are_refused_by_name(tmp_path: Path) -> None:
    ckpt = make_llama(tmp_path / "tiny", seed=1)
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", str(ckpt)]
    for extra, why in [
        (["--role", "prefill", "--cp", "2", "--tp", "2"], "not --cp together with --tp/--pp"),
        (["--role", "decode", "--tp", "2", "--spec-draft", "self:1"], "runs on one rank"),
        (["--role", "decode", "--pd-prefill", "localhost:1"], "is not an http(s):// or tcp://"),
        (["--role", "prefill", "--pd-timeout-s", "0.1"], "must be below pd_timeout_s"),
    ]:
        r = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 2 and why in r.stderr, r.stderr


def test_layered_pages_assemble_into_host_pages() -> None:
    n_layers, n_pages = 2, 3
    whole = pages(n_pages, seed=5)  # host layout: [layers, 2, ...] -> layer l is the l-th half
    half = PAGE_BYTES // n_layers
    msgs = [
        layer_message("h", layer, 4, [p[layer * half : (layer + 1) * half] for p in whole])
        for layer in (1, 0)  # any order
    ]
    layers = {read_header(m)["layer"]: read_layer(read_header(m), m, half) for m in msgs}
    assert [bytes(p) for p in assemble(layers, n_layers, n_pages)] == [bytes(p) for p in whole]
    with pytest.raises(WireError, match="incomplete"):
        assemble({0: layers[0]}, n_layers, n_pages)
    bad = [*msgs[0]]
    bad[2] = np.array(bad[2]) ^ 1
    with pytest.raises(WireError, match="page 1 failed"):
        read_layer(read_header(bad), bad, half)


def test_pulled_pages_keep_the_leading_good_ones() -> None:
    """A pull is not all or nothing: the pages before the first bad one are used, the rest are
    misses (computed by prefill); a reply that does not answer the pull uses none."""
    assert read_header(pull_message("h", 2, 5)) == {
        "type": "pull", "id": "h", "first_page": 2, "end_page": 5
    }  # fmt: skip
    ps = pages(3, seed=3)
    msg = pulled_message("h", 2, ps)
    good, why = read_pulled(read_header(msg), msg, PAGE_BYTES, 2, 5)
    assert [bytes(g) for g in good] == [p.tobytes() for p in ps] and why == ""
    bad = list(msg)
    page = bytearray(msg[2])
    page[7] ^= 1
    bad[2] = bytes(page)  # page 3 of the prompt flipped
    good, why = read_pulled(read_header(bad), bad, PAGE_BYTES, 2, 5)
    assert len(good) == 1 and why == "pulled page 3 failed its size or checksum"
    short = pulled_message("h", 2, ps[:1])
    good, why = read_pulled(read_header(short), short, PAGE_BYTES, 2, 5)
    assert len(good) == 1 and why == "decode sent 1 of 3 pages"
    assert read_pulled(read_header(msg), msg, PAGE_BYTES, 1, 5)[0] == []  # not what was asked
    assert read_pulled(read_header(msg), msg, PAGE_BYTES, 2, 4)[0] == []  # more than asked
    assert read_pulled(read_header(msg), msg[:-1], PAGE_BYTES, 2, 5)[0] == []  # a frame lost
    assert read_pulled(read_header(msg), msg, PAGE_BYTES * 2, 2, 5)[0] == []  # wrong size
