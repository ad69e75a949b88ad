"""A hand-off's sink on a prefill rank: the pages decode lacks, whole or layer by layer.

When the hand-off's request ends with its first token (the connector's request_finished, on the
engine thread) its answer is queued for the listener thread: the first-token logits row and the
pages decode lacks. Those pages are read from the device pool by the listener thread when it
sends them, while the engine holds them (kvstrata/pd/holds.py); under cp they are gathered by a
collective on the engine thread at once, and with layer-by-layer sending each layer's pages are
queued as the forward computes them (nothing is left to hold).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvstrata.engine.kv_connector import EngineView
from kvstrata.engine.request import Request
from kvstrata.pd.metrics import RankCounts
from kvstrata.pd.pages import host_pages
from kvstrata.pd.wire import Frames, header, layer_message, pages_message


@dataclass(frozen=True)
class HeldPages:
    """A `pages` answer whose page frames the listener thread reads from the device pool when
    it sends it (the engine holds device pages `ids` until then)."""

    ids: list[int]  # device pages of prompt pages [held, n) (none: they went layer by layer)
    row: np.ndarray  # the first-token logits row [vocab], host copy
    state: np.ndarray | None  # the speculator's hand-off state, host copy (None: none)
    stats: dict[str, int]


class SinkSide(Protocol):
    """What a sink uses of its prefill rank's side (kvstrata.pd.prefill.PrefillSide)."""

    outbox: queue.SimpleQueue[tuple[Sink, Any]]  # to the listener thread, FIFO
    view: EngineView  # the engine's pool and KV manager
    metrics: RankCounts  # this rank's hand-off counters
    cp: tuple[int, Any]  # (cp rank, cp group): a CPSink's gather


class Sink:
    """One hand-off's request on a prefill rank: what it sends decode, when.

    `answer`, `refuse` and `end` run on the engine thread (the prefill side's connector calls);
    `frames` on the listener thread. `lock` orders the listener's read of held pages against
    the engine dropping them (`drop`)."""

    def __init__(self, side: SinkSide, peer: bytes, req: Request, held: int, hid: str) -> None:
        self.side, self.peer, self.req, self.held, self.hid = side, peer, req, held, hid
        self.pages: list[int] = []  # the request's device pages (set at its admission)
        self.received_s = time.monotonic()
        self.last_token_s: float | None = None
        self.last_sent_s = self.received_s  # the listener thread's last message to decode
        self.sent = False  # pages queued (engine thread)
        self.lock = threading.Lock()
        self.dropped = False  # they went back unread: never read them again
        self.layers_sent = 0  # layered: layers [0, layers_sent) queued (engine thread)
        # a pull (kvstrata/pd/pull.py): pages [asked, held) asked of decode (engine thread),
        # the verified reply (listener thread) and how many of its pages were used
        self.asked: int | None = None
        self.asked_s = 0.0
        self.reply: tuple[list[memoryview], str] | None = None
        self.pulled = 0

    def answer(self, may_hold: bool) -> bool:
        """The request ended with its first token (its pages still its own): queue its answer.
        True: the listener reads the pages when it sends them (the engine must hold them until
        then; may_hold: it can); False: nothing of the pool is read later."""
        if self.sent:
            return False
        self.sent = True
        reply = self._reply()
        defer = may_hold and self.can_hold() and bool(reply.ids)
        self.side.outbox.put((self, reply if defer else self._pages(reply)))
        return defer

    def refuse(self, why: str) -> None:
        """The request failed: decode hears why."""
        self.side.outbox.put((self, [header("refused", self.hid, message=why)]))

    def end(self) -> None:
        """The request ended (its answer, if any, was queued before)."""
        self.side.outbox.put((self, None))

    def can_hold(self) -> bool:
        """Whether the listener thread may read this sink's pages itself (not a collective)."""
        return True

    def frames(self, item: Frames | HeldPages) -> Frames | None:
        """Listener thread: the frames of a queued answer, reading held pages now (None: they
        were dropped, the request's pages went back unread)."""
        if not isinstance(item, HeldPages):
            return item
        with self.lock:
            return None if self.dropped else self._pages(item)

    def drop(self) -> None:
        """Engine thread: the held pages go back; no read is under way after this returns."""
        with self.lock:
            self.dropped = True

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

    def _reply(self) -> HeldPages:
        """Engine thread: the answer's parts but the pages' bytes: the device pages of prompt
        pages [held, n) (none when they went layer by layer), the first-token logits row, the
        speculator's state (an MTP head's last hidden state) if it has one."""
        view = self.side.view
        pool, req, ids = view.pool, self.req, self._ids()
        computed = len(req.tokens) - (sum(req.hits.values()) + self.pulled) * view.page_size
        stats = {"computed_tokens": computed, "pulled_kept": self.pulled}
        self.side.metrics.sent(len(ids), len(ids) * pool.shape.page_nbytes)
        row = req.logits[-1].float().cpu().numpy()
        st = view.spec.handoff_state(req) if view.spec is not None else None
        state = None if st is None else st.float().cpu().numpy()
        if self.layers_sent == pool.shape.num_layers:
            return HeldPages([], row, state, {**stats, "layers": 1})
        return HeldPages(ids, row, state, stats)

    def _pages(self, reply: HeldPages) -> Frames:
        """The `pages` message: pages [held, n) of the prompt in host layout, every pool layer
        (so a speculator's tail layers travel in the same frame), read from the pool now."""
        if reply.stats.get("layers"):
            return pages_message(self.hid, self.held, [], reply.row, reply.state, **reply.stats)
        pages, where = self._host(self.side.view.pool, reply.ids)
        return pages_message(
            self.hid, self.held, pages, reply.row, reply.state, **reply.stats, **where
        )

    def _host(self, pool: Any, ids: list[int]) -> tuple[list[Any], dict[str, Any]]:
        """The frames of device pages `ids` this side sends, and header fields naming them
        (none: all of [held, n); a cp rank sends its peer's share, kvstrata/pd/cp_pages.py)."""
        return host_pages(pool, ids), {}
