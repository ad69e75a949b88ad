"""A hand-off's sink on a prefill rank: the pages decode lacks, whole or layer by layer.

When the hand-off's request ends with its first token (the connector's request_finished, on the
engine thread, before the request's pages are released) the pages decode lacks are copied out to host memory and queued for the listener
thread, with the first-token logits row; with layer-by-layer sending each layer's pages are
queued as the forward computes them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvstrata.engine.request import Request
from kvstrata.pd.pages import host_pages
from kvstrata.pd.wire import Frames, header, layer_message, pages_message


class Sink:
    """One hand-off's request on a prefill rank: what it sends decode, when.

    `push` runs on the engine thread (the prefill side's connector calls): at "token" the
    request still owns its pages."""

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
            why = value[1] if isinstance(value, tuple) else value  # (status, message): a failure
            self.side.outbox.put((self, [header("refused", self.hid, message=str(why))]))
        elif kind == "done":
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
