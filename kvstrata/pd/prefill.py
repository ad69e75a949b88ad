"""The prefill worker's side of a hand-off, on each of its ranks (one rank: N=1).

One thread per rank owns the transport's listener. A `handoff` from decode is checked first
(layout, then decode's key chain against the prompt under the request's cache_salt namespace,
then the rule that the page of the last prompt token is never held); a bad one is refused with
the reason. A good one runs as an ordinary engine request (max 1 token, logits kept), submitted
through the step loop's inbox, so its own Lease serves what prefill's device/host/storage hold and
only the rest is computed. The engine drives this side through its connector calls only: when
the request ends with its first token (request_finished) each rank's sink (kvstrata/pd/sink.py)
queues its answer and request_finished returns True: the engine holds the request's pages until
the listener thread has read and sent the pages decode lacks, with the logits row
(kvstrata/pd/holds.py: reported in get_finished's `sent`, bounded by pd_timeout_s). The listener
heartbeats each hand-off that is still waiting or computing every pd_heartbeat_s. Held pages
that prefill's own tiers lack are
pulled from decode first (kvstrata/pd/pull.py); under several ranks see kvstrata/pd/ranks.py.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from kvstrata.cache.lease import hittable_pages
from kvstrata.engine.engine import Engine
from kvstrata.engine.kv_connector import (
    ConnectorMeta,
    EngineView,
    Finished,
    KVConnector,
    SaveMeta,
)
from kvstrata.engine.kv_manager import KVManager
from kvstrata.engine.request import Request, State
from kvstrata.engine.step_io import Abort, Inbox, NewRequest
from kvstrata.listeners import Listeners
from kvstrata.pd.config import PDConfig
from kvstrata.pd.cp_pages import CPSink, check_owners, rank_sink
from kvstrata.pd.holds import HoldGate, Holds
from kvstrata.pd.metrics import RankCounts
from kvstrata.pd.pull import Puller, PullGate
from kvstrata.pd.sink import HeldPages, Sink
from kvstrata.pd.transport import Listener
from kvstrata.pd.wire import (
    Frames,
    Layout,
    WireError,
    header,
    int_list,
    layout_mismatch,
    read_header,
    typed,
    unpack_keys,
)

LISTENER = "pd-prefill"  # the listener thread's name (/metrics label, debug kill)


class PrefillSide(KVConnector):
    """One prefill rank's side of its hand-offs (one rank is the N=1 case of many): the
    listener thread and the engine's connector.

    The listener thread takes decode's messages: rank 0 checks a hand-off (layout, key chain)
    and submits it through the step loop's inbox (under ranks rank 0's, broadcast, so every rank
    gets it at the same step, with the held page count); the other ranks only check their
    peer's layout and remember it. On the engine thread the engine tells this side of each
    hand-off through the connector's calls only: `add_request` (its sink starts),
    `save_kv_layer` (layer by layer), `request_finished` (the sink queues its answer; True: the
    engine holds the pages until `get_finished` reports them sent); the listener thread reads
    and sends what was queued once the peer has asked.
    Only the listener thread touches flight/peers/queued; the engine thread hands it sinks and
    frames through `outbox` (FIFO: a sink before its frames)."""

    def __init__(
        self, cfg: PDConfig, listener: Listener, metrics: RankCounts, rank: int = 0
    ) -> None:
        self.cfg, self.listener, self.metrics, self.rank = cfg, listener, metrics, rank
        self.inbox: Inbox | None = None  # the step loop's (rank 0's under ranks; by attach)
        self.view: EngineView = None  # type: ignore[assignment]  # set by register_kv_caches
        self.layout: Layout | None = None
        self.layerwise = False  # hand-offs' pages go layer by layer as the forward computes them
        self.pulls = True  # held pages this side lacks are pulled from decode (pd/pull.py)
        self.cp: tuple[int, Any] = (0, None)  # (cp rank, cp group): a CPSink's gather
        # what the engine thread hands the listener thread, FIFO: (sink, frames, None or "new")
        self.outbox: queue.SimpleQueue[tuple[Sink, Any]] = queue.SimpleQueue()
        self.sinks: dict[str, Sink] = {}  # engine thread: rid -> sink, until the request ends
        self.flight: dict[str, Sink] = {}  # hand-off id -> sink, until answered
        self.peers: dict[str, tuple[bytes, float]] = {}  # hand-off id -> (decode peer, since)
        self.queued: dict[str, list[Frames | HeldPages]] = {}  # answers waiting for their peer
        self.puller = Puller(cfg, metrics, lambda sink, f: self.outbox.put((sink, f)), rank=rank)
        self.holds: Holds | None = None  # the pages the engine holds for the listener (attach)
        self.listeners = Listeners()  # the process's (a server's: its death stops the server)
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def attach(
        self,
        engine: Engine,
        layout: Layout,
        inbox: Inbox,
        gate: PullGate | None = None,
        hold_gate: HoldGate | None = None,
    ) -> None:
        """On the engine thread, once the engine is built. gate, hold_gate: the pulls' and the
        held pages' agreement under several ranks (they ride in the cache's step consensus: no
        cache, no pulls, and the pages are copied out when the request ends, not held)."""
        self.layout, self.inbox = layout, inbox
        self.layerwise = self.cfg.pd_layerwise and layout.cp == 1  # cp: whole pages
        self.pulls = gate is None or engine.cache is not None
        if gate is not None and self.pulls:
            self.puller.gate, gate.puller = gate, self.puller
        if hold_gate is None or engine.cache is not None:
            self.holds = Holds(self.cfg.pd_timeout_s, self.metrics, hold_gate)
        engine.use_connector(self)
        # stopping: requests the loop aborted are answered (_flush), not left to time out
        self.thread = self.listeners.start(LISTENER, self._step, self._stop, self._flush)

    def close(self) -> None:
        self._stop.set()
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(5.0)
        self.listener.close()

    # ---- the engine's connector (engine thread) --------------------------------------------------
    def register_kv_caches(self, view: EngineView) -> None:
        self.view = self.puller.view = view

    def add_request(self, req: Request) -> None:
        """Every rank, at the same step: a hand-off's request entered the engine; its sink
        starts (the listener thread heartbeats its peer while it waits and computes)."""
        if not (req.kv_params and "pd_held" in req.kv_params):
            return  # not a hand-off
        sink = rank_sink(self, req, req.kv_params)
        self.sinks[req.rid] = sink
        self.outbox.put((sink, "new"))
        if sink.held and self.pulls and not isinstance(sink, CPSink):
            self.puller.add(sink)  # it may pull held pages its tiers lack (every rank alike)

    def sink_of(self, rid: str) -> Sink | None:
        """The hand-off sink of an engine request (None: not a hand-off)."""
        return self.sinks.get(rid)

    def get_num_new_matched_tokens(self, req: Request, local_tokens: int) -> int:
        return self.puller.matched(req, local_tokens) if self.pulls else 0

    def update_state_after_alloc(self, req: Request, pages: list[int], remote_tokens: int) -> None:
        sink = self.sink_of(req.rid)
        if sink is not None and sink.req is req:
            sink.pages = pages
        if remote_tokens:
            self.puller.ask(req, req.computed)

    def get_finished(self, idle_wait_s: float) -> Finished:
        remote = self.puller.finished(idle_wait_s) if self.pulls else []
        sent = self.holds.finished(self.view.clock()) if self.holds is not None else []
        return Finished(remote, sent)

    def request_finished(self, req: Request) -> bool:
        """A hand-off's request ended, its pages still its own: with its first token its answer
        is queued, and True when the listener reads the pages decode lacks later (the engine
        holds them until get_finished reports them sent; those that went layer by layer are
        not sent again); else its peer hears why it failed (req.failure: a pull's wait ran out,
        the engine refused it) or that it ended."""
        self.puller.forget(req)
        sink = self.sinks.get(req.rid)
        if sink is None:
            return False
        hold = False
        if req.failure is None and req.output:
            sink.pages = self.view.kv.page_table(req)  # committed pages may be the tree's copies
            # may raise: the request then fails alone and is ended again, with req.failure
            hold = sink.answer(may_hold=self.holds is not None)
            if hold and self.holds is not None:
                self.holds.hold(sink, self.view.clock())
        del self.sinks[req.rid]
        sink.refuse(str(req.failure[1])) if req.failure else sink.end()
        return hold

    def drop_held(self, req: Request) -> None:
        if self.holds is not None:
            self.holds.drop(req.rid)

    def build_connector_meta(self, work: list[tuple[Request, list[int]]]) -> ConnectorMeta:
        """Layer by layer (not while speculating): the hand-offs whose prompt this forward
        completes."""
        if not self.layerwise or self.view.spec is not None:
            return ConnectorMeta()
        saves = [
            r
            for r, t in work
            if r.state is State.PREFILL
            and r.computed + len(t) == len(r.tokens)
            and self.sink_of(r.rid) is not None
        ]
        return SaveMeta(per_layer=bool(saves), saves=saves)

    def save_kv_layer(self, layer: int) -> None:
        """Mid-forward: `layer` of the bound hand-offs is computed; each sends its pages."""
        meta = self.meta
        for req in meta.saves if isinstance(meta, SaveMeta) else []:
            sink = self.sink_of(req.rid)
            if sink is not None and sink.req is req:
                sink.on_layer(layer)

    # ---- listener thread -----------------------------------------------------------------------
    def _step(self) -> None:
        """One turn of the listener thread: at most one message, then what is queued to send."""
        got = self.listener.recv(min(0.05, self.cfg.pd_heartbeat_s / 2))
        if got is not None:
            try:
                self._on_message(*got)
            except Exception as exc:  # noqa: BLE001 - one message fails alone; the next is served
                self.listeners.failed(LISTENER, exc)
        self._flush()
        self._heartbeat()

    def _taken(self) -> list[tuple[Sink, Any]]:
        """Everything the engine thread queued so far, in order."""
        out = []
        while True:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                return out

    def _on_message(self, peer: bytes, frames: Frames) -> None:
        head = read_header(frames)  # not even a header: no id to refuse it by (counted, dropped)
        hid = head["id"]
        if head["type"] == "cancel":
            self.peers.pop(hid, None)
            self._unqueue(hid)
            self.flight.pop(hid, None)
            if self.rank == 0 and self.inbox is not None:  # every rank, the same step (broadcast)
                self.inbox.put(Abort(handoff_rid(hid)))
            return
        if head["type"] == "pulled":  # only from this hand-off's own peer
            if self.peers.get(hid, (None,))[0] == peer:
                part = self.view.pool.shape.page_nbytes  # this rank's part of a page
                self.puller.receive(self.flight.get(hid), head, frames, part)
            return
        if head["type"] != "handoff":
            return
        try:
            self._check(hid, head)
        except Exception as exc:  # noqa: BLE001 - a bad hand-off is refused with the reason
            self.metrics.failed()
            self.listener.send(peer, [header("refused", hid, message=str(exc))])
            return
        self.peers[hid] = (peer, time.monotonic())

    def _check(self, hid: str, head: dict[str, Any]) -> None:
        """Every rank: its peer's layout (rank included). Rank 0 also checks the key chain and
        submits the request for every rank (the held page count rides with it)."""
        assert self.layout is not None
        if hid in self.peers:
            raise WireError(f"hand-off {hid} is already in flight")
        if self.rank:
            bad = layout_mismatch(self.layout, head.get("layout"), "decode")
            if bad:
                raise WireError(bad)
            return
        req, held = check_handoff(self.layout, head, self.view.kv)
        handoff = {**(req.kv_params or {}), **check_owners(self.layout, head, held)}
        new = NewRequest(req.rid, req.tokens, 1, None, req.cache_salt, handoff, keep_logits=True)
        assert self.inbox is not None, "rank 0 submits hand-offs once attached"
        self.inbox.put(new)

    def _flush(self) -> None:
        for sink, frames in self._taken():
            if isinstance(frames, str):  # "new": a request every rank now runs
                self.flight[sink.hid] = sink
                continue
            if self.flight.get(sink.hid) is not sink:
                self._let_go(sink, frames)
                continue  # cancelled, or answered already
            if frames is None:
                frames = [header("refused", sink.hid, message="prefill ended the request")]
            self.queued.setdefault(sink.hid, []).append(frames)
        for hid in [h for h in self.queued if h in self.peers]:
            for frames in self.queued.pop(hid):
                self._send(hid, frames)

    def _let_go(self, sink: Sink, item: Frames | HeldPages | str | None) -> None:
        """An answer that will not be sent: held pages are read no more."""
        if isinstance(item, HeldPages) and self.holds is not None:
            self.holds.done(sink)

    def _unqueue(self, hid: str) -> None:
        sink = self.flight.get(hid)
        for item in self.queued.pop(hid, []):
            if sink is not None:
                self._let_go(sink, item)

    def _send(self, hid: str, item: Frames | HeldPages) -> None:
        sink = self.flight.get(hid)
        if sink is None:
            return
        try:
            frames = sink.frames(item)  # held pages are read from the pool now
        finally:
            self._let_go(sink, item)
        if frames is None:  # the engine took the held pages back (abort, or it gave up)
            why = "prefill released the request's pages before they were sent"
            frames = [header("refused", hid, message=why)]
        self.listener.send(self.peers[hid][0], frames)
        sink.last_sent_s = time.monotonic()
        kind = read_header(frames)["type"]
        payload = frames[1:] if kind == "layer" else frames[1:-1] if kind == "pages" else []
        self.metrics.wire(sum(memoryview(f).nbytes for f in payload))
        if kind not in ("layer", "pull"):  # answered: the pages (with the logits) or a refusal
            del self.flight[hid]
            self.peers.pop(hid, None)

    def _heartbeat(self) -> None:
        """Heartbeats to peers whose request runs; a peer whose request never came, or an
        answer whose peer never asked, is dropped after pd_timeout_s."""
        now, limit = time.monotonic(), self.cfg.pd_timeout_s
        for hid, sink in list(self.flight.items()):
            if hid in self.peers and now - sink.last_sent_s >= self.cfg.pd_heartbeat_s:
                self.listener.send(self.peers[hid][0], [header("heartbeat", hid)])
                sink.last_sent_s = now
            elif hid not in self.peers and now - sink.received_s > limit:
                self._unqueue(hid)
                del self.flight[hid]
        for hid, (_, since) in list(self.peers.items()):
            if hid not in self.flight and now - since > limit:
                del self.peers[hid]


def check_handoff(layout: Layout, head: dict[str, Any], kv: KVManager) -> tuple[Request, int]:
    """The engine request of a checked hand-off, and how many leading pages decode holds.

    Checks, in order: every field's type and range (tokens: ints below the vocabulary), decode's
    layout (the first differing field named), then decode's key chain against the prompt under
    the request's namespace (cache_salt), then the rule that the page of the last prompt token
    is never held. WireError when one fails: nothing of the hand-off is used."""
    bad = layout_mismatch(layout, head.get("layout"), "decode")
    if bad:
        raise WireError(bad)
    tokens = int_list(head, "tokens", 0, kv.vocab_size - 1)
    if not tokens:
        raise WireError("handoff field 'tokens': the prompt is empty")
    salt, blob = typed(head, "salt", str), typed(head, "keys", bytes)
    req = Request(handoff_rid(head["id"]), tokens, 1, keep_logits=True, cache_salt=salt)
    held = unpack_keys(blob)
    most = hittable_pages(len(tokens), layout.page_size)
    if len(held) > most:
        raise WireError(
            f"decode claims {len(held)} pages of a {len(tokens)}-token prompt; at most {most} "
            "(the page of the last prompt token is always computed)"
        )
    mine = kv.prompt_keys(req)[: len(held)]
    for i, (a, b) in enumerate(zip(held, mine, strict=True)):
        if a != b:
            raise WireError(f"page {i}: decode's key does not match the prompt (namespace/salt)")
    req.kv_params = {"pd_id": head["id"], "pd_held": len(held)}
    return req, len(held)


def handoff_rid(hid: str) -> str:
    """The engine request id of hand-off `hid` (its own namespace: never a client's id)."""
    return f"pd-{hid}"
