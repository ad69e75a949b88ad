"""Delayed free: a connector that still reads an ended request's pages keeps them held (not
freed, not evictable, not reused) until get_finished reports the request sent; a hold never
reported is given up after pd_timeout_s; an abort takes held pages back at once.

The engine's side is checked exactly with a connector of the test's own (pool counts and
integrity after every step); the P/D prefill connector's side in-process, with its real
listener and a raw decode client over a real socket."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.cache.config import CacheConfig
from kvstrata.engine.build import Built, build_engine
from kvstrata.engine.config import EngineConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.kv_connector import Finished, KVConnector
from kvstrata.engine.request import Request
from kvstrata.model.checkpoint import load_model
from kvstrata.pd.config import PDConfig
from kvstrata.pd.connectors import pd_side
from kvstrata.pd.holds import HoldGate, Holds
from kvstrata.pd.layout import layout_of
from kvstrata.pd.metrics import RankCounts
from kvstrata.pd.pages import host_pages
from kvstrata.pd.prefill import PrefillSide, handoff_rid
from kvstrata.pd.transport import transport_of
from kvstrata.pd.wire import read_pages
from tests.pd_helpers import raw_handoff

PAGE = 8
DEVICE_PAGES = 16
PROMPT = [(7 * i + 3) % 97 for i in range(2 * PAGE + 3)]  # 2 full pages + a tail page

CKPT = {"seed": 11}


class HoldingConnector(KVConnector):
    """Keeps every finished request's pages until the test says they were sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.dropped: list[str] = []

    def request_finished(self, req: Request) -> bool:
        return req.failure is None

    def get_finished(self, idle_wait_s: float) -> Finished:
        sent, self.sent = self.sent, []
        return Finished(sent=sent)

    def drop_held(self, req: Request) -> None:
        self.dropped.append(req.rid)


@pytest.fixture
def built(ckpt: Path) -> Iterator[Built]:
    cfg = EngineConfig(model=str(ckpt), chunk_tokens=256)
    cache = CacheConfig(page_size=PAGE, device_pages=DEVICE_PAGES).with_tiers("device")
    out = build_engine(cfg, cache, model=load_model(ckpt))
    yield out
    out.close()


def device(eng: Engine) -> dict[str, int]:
    assert eng.cache is not None
    return dict(eng.cache.accounting()["device"]) | {"owned": len(eng.cache.owned)}


def run_to_end(eng: Engine, req: Request, submit: bool = True) -> None:
    if submit:
        eng.submit(req)
    for _ in range(20):
        result = eng.step()
        eng.check_integrity()
        if req in result.ended:
            return
    raise AssertionError(f"{req.rid} did not end in 20 steps")


def test_pages_stay_held_until_sent_then_go_back(built: Built) -> None:
    eng, conn = built.engine, HoldingConnector()
    eng.use_connector(conn)
    req = Request("a", PROMPT, 1)
    run_to_end(eng, req)
    held = list(req.page_table)
    assert len(held) == 3 and eng.scheduler.held == {"a": req}
    # its 2 full pages are the tree's, locked by its lease; the tail page is its own (locked
    # counts both: each page once)
    want = {"free": DEVICE_PAGES - 3, "cached": 0, "locked": 3, "in_flight": 0, "owned": 1}
    for _ in range(3):  # nothing reported: nothing moves, however many steps
        assert device(eng) == want
        assert eng.has_work()
        eng.step()
        eng.check_integrity()
    # a request needing every other page cannot take the held ones (not evictable)
    big = Request("big", [5] * (DEVICE_PAGES - 2) * PAGE, 1)
    eng.submit(big)
    eng.step()
    eng.check_integrity()
    assert big in eng.waiting and all(not eng.pool.allocator.is_free(p) for p in held)
    conn.sent.append("a")
    eng.step()  # released at this step's get_finished; `big` is admitted at the next
    eng.check_integrity()
    assert eng.scheduler.held == {} and req.page_table == held[:2]  # its tree part, kept
    assert device(eng)["owned"] == 0 and device(eng)["locked"] == 0
    run_to_end(eng, big, submit=False)  # it now evicts what `a` left cached
    conn.sent.append("big")  # held too, until now
    eng.step()
    eng.check_integrity()
    assert conn.dropped == [] and not eng.has_work()
    d = device(eng)
    assert d["locked"] == d["owned"] == 0 and d["free"] + d["cached"] == DEVICE_PAGES


def test_without_a_hold_pages_go_back_at_once(built: Built) -> None:
    eng = built.engine
    eng.use_connector(KVConnector())  # request_finished: False
    run_to_end(eng, Request("a", PROMPT, 1))
    assert eng.scheduler.held == {} and not eng.has_work()
    want = {"free": DEVICE_PAGES - 2, "cached": 2, "locked": 0, "in_flight": 0, "owned": 0}
    assert device(eng) == want


def test_an_abort_frees_held_pages_at_once(built: Built) -> None:
    eng, conn = built.engine, HoldingConnector()
    eng.use_connector(conn)
    req = Request("a", PROMPT, 1)
    run_to_end(eng, req)
    assert eng.abort("a") is None  # ended already: nothing more to report
    eng.check_integrity()
    assert conn.dropped == ["a"] and eng.scheduler.held == {}
    want = {"free": DEVICE_PAGES - 2, "cached": 2, "locked": 0, "in_flight": 0, "owned": 0}
    assert device(eng) == want
    assert eng.abort("a") is None and conn.dropped == ["a"]  # a second abort changes nothing


# ---- the P/D prefill connector ------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prefill(eng: Engine, timeout_s: float = 5.0) -> tuple[PrefillSide, queue.Queue[Any]]:
    """A prefill connector on `eng`, whole pages at the end (not layer by layer), listening."""
    cfg = PDConfig(pd_insecure=True, pd_layerwise=False, pd_timeout_s=timeout_s, pd_heartbeat_s=0.2)
    side = pd_side("prefill", cfg, transport_of(cfg), RankCounts(None))
    assert isinstance(side, PrefillSide)
    inbox: queue.Queue[Any] = queue.Queue()
    side.attach(eng, layout_of(eng), inbox)
    return side, inbox


def handoff(hid: str) -> Request:
    """The engine request of a hand-off decode holds no page of (as the listener submits it)."""
    req = Request(handoff_rid(hid), PROMPT, 1, keep_logits=True)
    req.kv_params = {"pd_id": hid, "pd_held": 0}
    return req


def test_a_hold_never_sent_is_released_after_the_timeout(
    built: Built, capfd: pytest.CaptureFixture[str]
) -> None:
    eng, clock = built.engine, FakeClock()
    eng.clock = clock
    side, _ = prefill(eng, timeout_s=5.0)
    side.close()  # the listener is gone: nothing will read or send the pages
    req = handoff("lost")
    run_to_end(eng, req)
    assert eng.scheduler.held == {req.rid: req}
    clock.now += 5.0  # not past the bound yet
    eng.step()
    eng.check_integrity()
    assert eng.scheduler.held == {req.rid: req} and side.metrics.counts["held_expired"] == 0
    clock.now += 0.5
    eng.step()
    eng.check_integrity()
    assert eng.scheduler.held == {} and side.metrics.counts["held_expired"] == 1
    assert f"request {req.rid}" in capfd.readouterr().err
    want = {"free": DEVICE_PAGES - 2, "cached": 2, "locked": 0, "in_flight": 0, "owned": 0}
    assert device(eng) == want


def test_held_pages_are_sent_then_freed(built: Built) -> None:
    eng = built.engine
    side, inbox = prefill(eng)
    try:
        layout = layout_of(eng).as_dict()
        got: list[Any] = []
        endpoint = side.listener.endpoint
        client = threading.Thread(
            target=lambda: got.append(
                raw_handoff(endpoint, PROMPT, [], layout, hid="h1", insecure=True)
            )
        )
        client.start()
        new = inbox.get(timeout=30)
        req = new.build()
        run_to_end(eng, req)
        assert eng.scheduler.held == {req.rid: req}  # until a later step hears it was sent
        sent = host_pages(eng.pool, list(req.page_table))  # the held pages' bytes
        client.join(30)
        head, frames = got[0]
        assert head["type"] == "pages"
        got = read_pages(head, frames, layout["page_bytes"])
        assert [bytes(p) for p in got.pages] == [bytes(p) for p in sent]
        assert got.logits.tolist() == req.logits[-1].float().tolist()
        for _ in range(2000):  # bounded: the listener reports within a few of its turns
            eng.step()
            eng.check_integrity()
            if not eng.scheduler.held:
                break
        assert eng.scheduler.held == {} and side.metrics.counts["held_expired"] == 0
        want = {"free": DEVICE_PAGES - 2, "cached": 2, "locked": 0, "in_flight": 0, "owned": 0}
        assert device(eng) == want
    finally:
        side.close()


# ---- several ranks: pages go back on every rank at the same step ---------------------------------
class StubSink:
    """What Holds uses of a sink: its request, its hand-off id, `drop`."""

    def __init__(self, rid: str) -> None:
        self.req, self.hid, self.dropped = Request(rid, [1, 2], 1), rid, False

    def drop(self) -> None:
        self.dropped = True


def agree(ranks: list[Holds]) -> None:
    """One step's collective over the ranks' HoldGate fields (MIN), as RankEngine runs it."""
    gates = [h.gate for h in ranks]
    assert all(g is not None for g in gates)
    local = [g.local() for g in gates]  # type: ignore[union-attr]
    values = {f: min(v[f] for v in local) for f in local[0]}
    for g in gates:
        g.agreed(values)  # type: ignore[union-attr]


def test_ranks_release_a_hold_once_every_rank_sent_its_part() -> None:
    ranks = [Holds(5.0, RankCounts(None), HoldGate(slots=2)) for _ in range(2)]
    sinks = [[StubSink(f"pd-{i}") for i in range(3)] for _ in ranks]
    for holds, mine in zip(ranks, sinks, strict=True):
        for s in mine:
            holds.hold(s, 100.0)  # type: ignore[arg-type]
    ranks[0].done(sinks[0][0])  # type: ignore[arg-type]
    ranks[0].done(sinks[0][2])  # type: ignore[arg-type]  # outside the 2-slot window
    agree(ranks)
    assert [h.finished(101.0) for h in ranks] == [[], []]  # rank 1 has not sent pd-0
    ranks[1].done(sinks[1][0])  # type: ignore[arg-type]
    ranks[1].done(sinks[1][2])  # type: ignore[arg-type]
    agree(ranks)
    assert [h.finished(102.0) for h in ranks] == [["pd-0"], ["pd-0"]]
    agree(ranks)  # pd-2 now has a slot, done on both ranks
    assert [h.finished(103.0) for h in ranks] == [["pd-2"], ["pd-2"]]
    agree(ranks)  # pd-1: never sent anywhere; given up on the agreed clock, on every rank alike
    assert [h.finished(105.0) for h in ranks] == [[], []]
    assert [h.finished(105.5) for h in ranks] == [["pd-1"], ["pd-1"]]
    assert [s[1].dropped for s in sinks] == [True, True]
    assert [h.metrics.counts["held_expired"] for h in ranks] == [1, 1]
    assert all(not h.held and not h.done_here for h in ranks)
