"""The prefill worker's side of a hand-off.

One thread owns the transport's listener. A `handoff` from decode is checked first (layout, then
decode's key chain against the prompt under the request's cache_salt namespace, then the rule
that the page of the last prompt token is never held); a bad one is refused with the reason.
A good one runs as an ordinary engine request (max 1 token, logits kept), so its own Lease
serves what prefill's L1/L2/L3 hold and only the rest is computed. When its first token is
produced (on the engine thread, before the request's pages are released) the pages decode lacks
are copied out to host memory and queued; the listener thread sends them with the logits row,
and heartbeats each hand-off that is still computing every pd_heartbeat_s. Held pages that
prefill's own tiers lack are pulled from decode first (kvstrata/pd/pull.py).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from kvstrata.cache.lease import hittable_pages
from kvstrata.engine.connector import (
    ConnectorMeta,
    EngineView,
    KVConnector,
    RemoteDone,
    SaveMeta,
)
from kvstrata.engine.request import Request, State
from kvstrata.pd.config import PDConfig
from kvstrata.pd.pages import host_pages
from kvstrata.pd.pull import Puller
from kvstrata.pd.transport import Listener
from kvstrata.pd.wire import (
    Frames,
    Layout,
    WireError,
    header,
    layer_message,
    layout_mismatch,
    pages_message,
    read_header,
    unpack_keys,
)


class Sink:
    """Where the engine loop sends a hand-off request's events (duck-types serve.loop.Stream).

    `push` runs on the engine thread: on the first token the request still owns its pages."""

    def __init__(self, side: Any, peer: bytes, req: Request, held: int, hid: str) -> None:
        self.side, self.peer, self.req, self.held, self.hid = side, peer, req, held, hid
        self.pages: list[int] = []  # the request's device pages (set at its admission)
        self.received_s = time.monotonic()
        self.last_token_s: float | None = None
        self.last_sent_s = self.received_s  # the listener thread's last message to decode
        self.sent = False  # pages queued (engine thread)
        self.layers_sent = 0  # layered: layers [0, layers_sent) queued (engine thread)
        # a pull (kvstrata/pd/pull.py): pages [asked, held) asked of decode (engine thread),
        # the verified reply (listener thread) and how many of its pages were used
        self.asked: int | None = None
        self.asked_s = 0.0
        self.reply: tuple[list[memoryview], str] | None = None
        self.pulled = 0

    def push(self, kind: str, value: Any) -> None:
        if kind == "token" and not self.sent:
            self.sent = True
            self.side.outbox.put((self, self._pages()))
        elif kind == "error":
            self.side.sinks.pop(self.req.rid, None)
            why = value[1] if isinstance(value, tuple) else value  # (status, message): a failure
            self.side.outbox.put((self, [header("refused", self.hid, message=str(why))]))
        elif kind == "done":
            self.side.sinks.pop(self.req.rid, None)
            self.side.outbox.put((self, None))

    def _ids(self) -> list[int]:
        """Device pages of prompt pages [held, n): what decode lacks."""
        return self.pages[self.held : -(-len(self.req.tokens) // self.side.view.page_size)]

    def on_layer(self, layer: int) -> None:
        """Engine thread, mid-forward: layer `layer` of the prompt is final; queue its pages."""
        if layer != self.layers_sent:
            return  # a layer was missed (not expected): the pages go whole at the end
        pool = self.side.view.pool
        # [2, k, page, heads, dim] -> [k, 2, page, heads, dim]: each page's slice contiguous
        part = pool.data[layer][:, pool.local_slot(self._ids())].transpose(0, 1).contiguous()
        flat = part.cpu().reshape(part.shape[0], -1).view(torch.uint8).numpy()
        self.side.outbox.put((self, layer_message(self.hid, layer, self.held, list(flat))))
        self.layers_sent += 1

    def _pages(self) -> Frames:
        """Pages [held, n) of the prompt, host layout (unless they went layer by layer): every
        pool layer, so a speculator's tail layers travel in the same frame; the first-token
        logits row; the speculator's state (an MTP head's last hidden state) if it has one."""
        view = self.side.view
        pool, req, ids = view.pool, self.req, self._ids()
        computed = len(req.tokens) - (sum(req.hits.values()) + self.pulled) * view.page_size
        stats = {"computed_tokens": computed, "pulled_kept": self.pulled}
        self.side.metrics.sent(len(ids), len(ids) * pool.shape.page_nbytes)
        row = req.logits[-1].float().cpu().numpy()
        st = view.spec.handoff_state(req) if view.spec is not None else None
        state = None if st is None else st.float().cpu().numpy()
        if self.layers_sent == pool.shape.num_layers:
            return pages_message(self.hid, self.held, [], row, state, layers=1, **stats)
        pages, where = self._host(pool, ids)
        return pages_message(self.hid, self.held, pages, row, state, **stats, **where)

    def _host(self, pool: Any, ids: list[int]) -> tuple[list[Any], dict[str, Any]]:
        """The frames of device pages `ids` this side sends, and header fields naming them
        (none: all of [held, n); a cp rank sends its peer's share, kvstrata/pd/cp_pages.py)."""
        return host_pages(pool, ids), {}


class HandoffListener(KVConnector):
    """A prefill listener thread (one rank's, or each rank's of several): it takes decode's
    messages, sends what the engine thread queued, and keeps the hand-offs in flight alive."""

    def __init__(self, cfg: PDConfig, listener: Listener, name: str) -> None:
        self.cfg, self.listener = cfg, listener
        # what the engine thread hands this thread, FIFO: (sink, frames, None (ended) or "new")
        self.outbox: queue.SimpleQueue[tuple[Sink, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def close(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(5.0)
        self.listener.close()

    def _serve(self) -> None:
        wait = min(0.05, self.cfg.pd_heartbeat_s / 2)
        while not self._stop.is_set():
            got = self.listener.recv(wait)
            if got is not None:
                self._on_message(*got)
            self._flush()
            self._heartbeat()
        self._flush()  # stopping: requests the loop aborted are answered, not left to time out

    # ---- the engine's connector (engine thread) --------------------------------------------------
    layerwise = False  # hand-offs' pages go layer by layer as the forward computes them
    pulls = True  # held pages this side lacks are pulled from decode (kvstrata/pd/pull.py)
    view: EngineView

    def register_kv_caches(self, view: EngineView) -> None:
        self.view = self.puller.view = view

    def sink_of(self, rid: str) -> Sink | None:
        """The hand-off sink of an engine request (None: not a hand-off)."""
        raise NotImplementedError

    def get_num_new_matched_tokens(self, req: Request, local_tokens: int) -> int:
        return self.puller.matched(req, local_tokens) if self.pulls else 0

    def update_state_after_alloc(self, req: Request, pages: list[int], remote_tokens: int) -> None:
        sink = self.sink_of(req.rid)
        if sink is not None and sink.req is req:
            sink.pages = pages
        if remote_tokens:
            self.puller.ask(req, req.computed)

    def get_finished(self, idle_wait_s: float) -> list[RemoteDone]:
        return self.puller.finished(idle_wait_s) if self.pulls else []

    def request_finished(self, req: Request) -> None:
        self.puller.forget(req)

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
    def _taken(self) -> list[tuple[Sink, Any]]:
        """Everything the engine thread queued so far, in order."""
        out = []
        while True:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                return out

    def _on_message(self, peer: bytes, frames: Frames) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        raise NotImplementedError

    def _heartbeat(self) -> None:
        raise NotImplementedError


class PrefillSide(HandoffListener):
    """The listener thread of one rank and what it knows of hand-offs in flight."""

    def __init__(self, cfg: PDConfig, listener: Listener, metrics: Any) -> None:
        super().__init__(cfg, listener, "pd-prefill")
        self.metrics = metrics
        self.loop: Any = None  # the server's EngineLoop (set by attach)
        self.layout: Layout | None = None
        self.flight: dict[str, Sink] = {}  # hand-off id -> its sink, until sent or failed
        self.sinks: dict[str, Sink] = {}  # request id -> its sink, until the request ends
        self.puller = Puller(cfg, metrics, lambda sink, frames: self.outbox.put((sink, frames)))

    def attach(self, loop: Any, engine: Any, layout: Layout) -> None:
        """On the engine thread while it is built (loop.engine is not set yet)."""
        self.loop, self.layout = loop, layout
        self.layerwise = self.cfg.pd_layerwise
        engine.use_connector(self)
        self.thread.start()

    def sink_of(self, rid: str) -> Sink | None:
        return self.sinks.get(rid)

    def request_finished(self, req: Request) -> None:
        super().request_finished(req)
        self.sinks.pop(req.rid, None)

    def _on_message(self, peer: bytes, frames: Frames) -> None:
        try:
            head = read_header(frames)
        except WireError:
            return  # not ours to answer: no id to answer to
        hid = str(head["id"])
        if head["type"] == "cancel":
            sink = self.flight.pop(hid, None)
            if sink is not None:
                self.loop.abort(sink.req.rid)  # its lease gives back every page
            return
        if head["type"] == "pulled":
            self._on_pulled(peer, hid, head, frames)
            return
        try:
            if hid in self.flight:
                raise WireError(f"hand-off {hid} is already in flight")
            req, held = self._admit(head)
        except (WireError, ValueError, KeyError, TypeError) as exc:
            self.metrics.failed()
            self.listener.send(peer, [header("refused", hid, message=str(exc))])
            return
        sink = Sink(self, peer, req, held, hid)
        self.flight[hid] = sink
        self.sinks[req.rid] = sink
        if held:
            self.puller.add(sink)  # decode holds pages prefill may lack: it may pull them
        self.loop.submit(req, sink)

    def _on_pulled(self, peer: bytes, hid: str, head: dict[str, Any], frames: Frames) -> None:
        """Decode's reply to a pull: its leading verified pages go to the engine thread."""
        sink = self.flight.get(hid)
        if sink is not None and sink.peer == peer:  # only from the hand-off's own decode
            self.puller.receive(sink, head, frames, self.view.pool.shape.page_nbytes)

    def _admit(self, head: dict[str, Any]) -> tuple[Request, int]:
        assert self.layout is not None
        return check_handoff(self.layout, head, self.view.kv)

    def _flush(self) -> None:
        """Send what the engine thread queued (pages, refusals); each hand-off is answered once."""
        for sink, frames in self._taken():
            hid = sink.hid
            if self.flight.get(hid) is not sink:
                continue  # cancelled by decode, or answered already (a "done" after the pages)
            if frames is None:
                frames = [header("refused", hid, message="prefill ended the request (stopping)")]
            self.listener.send(sink.peer, frames)
            sink.last_sent_s = time.monotonic()
            if read_header(frames)["type"] not in ("layer", "pull"):
                del self.flight[hid]  # answered: pages (with the logits) or a refusal

    def _heartbeat(self) -> None:
        """Tell decode each hand-off still computing is alive (its timeout counts silence)."""
        now = time.monotonic()
        for hid, sink in self.flight.items():
            if now - sink.last_sent_s >= self.cfg.pd_heartbeat_s:
                self.listener.send(sink.peer, [header("heartbeat", hid)])
                sink.last_sent_s = now


def check_handoff(layout: Layout, head: dict[str, Any], kv: Any) -> tuple[Request, int]:
    """The engine request of a checked hand-off, and how many leading pages decode holds.

    Checks, in order: decode's layout (the first differing field named), then decode's key
    chain against the prompt under the request's namespace (cache_salt), then the rule that the
    page of the last prompt token is never held. WireError (or a KeyError / TypeError of a
    malformed header) when one fails."""
    bad = layout_mismatch(layout, head["layout"], "decode")
    if bad:
        raise WireError(bad)
    tokens, salt = [int(t) for t in head["tokens"]], str(head["salt"])
    req = Request(handoff_rid(str(head["id"])), tokens, 1, keep_logits=True, cache_salt=salt)
    held = unpack_keys(head["keys"])
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
    req.kv_params = {"pd_id": str(head["id"]), "pd_held": len(held)}
    return req, len(held)


def handoff_rid(hid: str) -> str:
    """The engine request id of hand-off `hid` (its own namespace: never a client's id)."""
    return f"pd-{hid}"
