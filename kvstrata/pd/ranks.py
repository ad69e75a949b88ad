"""P/D workers on several ranks (tp x pp): rank r of a prefill worker pairs with rank r of a
decode worker of the same layout, each pair over its own channel, each rank sending or
receiving only its own part of every page (its heads under TP, its stage's layers under PP).

Prefill: every rank listens on its own endpoint. Rank 0 checks decode rank 0's hand-off (layout,
key chain) and submits it through the rank-0 inbox, so every rank gets the request at the same
step (serve/ranks.py broadcasts it, with the held page count). The other ranks only check their
peer's layout and remember it; at the first token each rank copies its part of the pages decode
lacks (the same `Sink` as one rank) and sends it once its peer has asked (bounded wait).

Decode: every rank runs the same Lease/admission and starts its own hand-off thread
(pd/decode.py). Whether a hand-off lands is decided by the step's one collective: HandoffGate
adds two fields per running remote request to the consensus vector, "arrived here" (MIN: every
rank has its part) and "failed here" (MAX: any rank failed, with its status). So every rank
writes its pages and samples the first token at the same step, never on one rank's word or on
arrival time.

Prefill's pulls (held pages its tiers lack, kvstrata/pd/pull.py): every rank asks its own peer
for its part at the same step; what they keep is agreed the same way (PullGate: pages kept by
MIN, a silent peer by MAX), so every rank lands the same pages at the same step.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from kvstrata.engine.request import Request, State
from kvstrata.engine.step_io import Abort, NewRequest, SideCount, SideReady
from kvstrata.pd.config import PDConfig
from kvstrata.pd.cp_pages import CPSink, check_owners, rank_sink
from kvstrata.pd.decode import DecodeSide
from kvstrata.pd.layout import layout_of
from kvstrata.pd.prefill import HandoffListener, Sink, check_handoff
from kvstrata.pd.pull import Puller, PullGate
from kvstrata.pd.transport import Listener, transport_of
from kvstrata.pd.wire import Frames, Layout, WireError, header, layout_mismatch, read_header

_SIDES: dict[int, RankPD] = {}  # id(engine) -> its rank's P/D side (one rank per process)


class RankMetrics:
    """This rank's own P/D counters, measured; rank 0 forwards them (whole pages) to the HTTP
    process's PDMetrics (`out`: rank 0's outbox, None on the other ranks)."""

    NAMES = ("pages_sent", "bytes_sent", "pages_received", "bytes_received", "ok", "failed")

    def __init__(self, out: Any) -> None:
        self.out = out
        self.page_bytes = self.part_bytes = 0  # a whole page / this rank's part (attach)
        pulls = [f"{x}_pull_{d}" for d in ("sent", "received") for x in ("pages", "bytes")]
        self.counts = dict.fromkeys((*self.NAMES, "retried", *pulls), 0)

    def _forward(self, name: str, *args: Any) -> None:
        if self.out is not None:
            self.out.put(SideCount(name, args))

    def sent(self, pages: int, nbytes: int) -> None:
        """A hand-off's pages are queued (its bytes are counted as they go: `wire`)."""
        self.counts["ok"] += 1
        self.counts["pages_sent"] += pages
        self._forward("sent", pages, pages * self.page_bytes)

    def wire(self, nbytes: int) -> None:
        self.counts["bytes_sent"] += nbytes

    def received(self, usage: dict[str, Any], part_bytes: int) -> None:
        self.counts["ok"] += 1
        self.counts["pages_received"] += part_bytes // self.part_bytes  # this rank's pages
        self.counts["bytes_received"] += part_bytes
        self._forward("received", usage)

    def pulled(self, direction: str, pages: int, nbytes: int) -> None:
        """Held pages pulled (pull_sent on decode, pull_received on prefill): this rank's part
        bytes here, whole pages forwarded (as usage.pd counts them)."""
        self.counts[f"pages_{direction}"] += pages
        self.counts[f"bytes_{direction}"] += nbytes
        self._forward("pulled", direction, pages, pages * self.page_bytes)

    def failed(self) -> None:
        self.counts["failed"] += 1
        self._forward("failed")

    def retried(self) -> None:
        self.counts["retried"] += 1
        self._forward("retried")


class HandoffGate:
    """The decode ranks' landing decision, as fields of the step consensus (parallel/ranks.py:
    RankEngine adds them to its one all_reduce). Slot i is the i-th remote request still
    prefilling in `engine.running` (the same list on every rank: it changes only by agreed
    steps); slots: max_running, so every such request has one."""

    def __init__(self, slots: int, rank: int) -> None:
        self.rank = rank
        self.min_fields = tuple(f"pd_arrived{i}" for i in range(slots))
        self.max_fields = tuple(f"pd_failed{i}" for i in range(slots))
        self.engine: Any = None
        self.side: DecodeSide | None = None
        self._window: list[str] = []
        self._decided: list[tuple[str, int, int]] = []

    def local(self) -> dict[str, int]:
        """This rank's counts: 1 if the slot's outcome arrived here; 1000 x status + rank if it
        is a failure (MAX: the worst status, and a rank that saw it)."""
        assert self.engine is not None and self.side is not None
        running = self.engine.running
        window = [r.rid for r in running if r.remote and r.state is State.PREFILL]
        self._window = window[: len(self.min_fields)]
        counts = {}
        for i, (arrived, failed) in enumerate(zip(self.min_fields, self.max_fields, strict=True)):
            out = self.side.ready.get(self._window[i]) if i < len(self._window) else None
            counts[arrived] = int(out is not None)
            bad = out is not None and out.failure is not None
            counts[failed] = out.failure[0] * 1000 + self.rank if bad else 0  # type: ignore[union-attr]
        return counts

    def agreed(self, values: dict[str, int]) -> None:
        self._decided = [
            (rid, values[self.min_fields[i]], values[self.max_fields[i]])
            for i, rid in enumerate(self._window)
        ]

    def landable(self, ready: dict[str, Any]) -> list[tuple[str, tuple[int, str] | None]]:
        """(rid, failure) of each hand-off this step lands: arrived on every rank, or failed on
        one (`ready`: this rank's arrived outcomes). Used once: a later step lands only what its
        own collective agreed."""
        decided, self._decided = self._decided, []
        return [
            (rid, self._failure(rid, failed, ready.get(rid)) if failed else None)
            for rid, arrived, failed in decided
            if arrived or failed
        ]

    def _failure(self, rid: str, code: int, out: Any) -> tuple[int, str]:
        """The agreed failure with the failing rank's own reason: that rank broadcasts it (one
        collective, only in a step that lands a failure; every rank lands the same list)."""
        status, src = divmod(code, 1000)
        mine = out.failure[1] if self.rank == src and out is not None and out.failure else None
        box = [mine]
        dist.broadcast_object_list(box, src=src)
        why = box[0] or f"P/D hand-off of {rid} failed on rank {src} of this decode worker"
        return status, f"{why} (rank {src})" if src else why


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank r binds port + r (port 0: a free port for each rank)."""
    head, port = endpoint.rsplit(":", 1)
    return endpoint if port in ("0", "*") else f"{head}:{int(port) + rank}"


class RankPD:
    """One rank's P/D side inside serve/ranks.py's rank loop (prefill or decode)."""

    def __init__(
        self, role: str, cfg: PDConfig | None, rank: int, slots: int, inbox: Any, out: Any
    ) -> None:
        cfg = cfg or PDConfig()
        self.role, self.cfg, self.rank, self.out = role, cfg, rank, out
        self.metrics = RankMetrics(out)
        transport = transport_of(cfg)
        # fields of the step's one collective: decode's landings, or prefill's pulls
        self.gate: HandoffGate | PullGate = (
            HandoffGate(slots, rank)
            if role == "decode"
            else PullGate(slots, rank, cfg.pd_timeout_s)
        )
        self.decode = DecodeSide(cfg, transport, self.metrics) if role == "decode" else None
        self.prefill: RankPrefill | None = None
        if role == "prefill":
            listener = transport.listen(rank_endpoint(cfg.pd_transfer_endpoint, rank))
            self.prefill = RankPrefill(cfg, listener, self.metrics, rank, inbox)
        self.engine: Any = None

    def attach(self, re: Any) -> None:
        """Every rank, once its engine is built: hooks, and rank 0 tells the HTTP process the
        layout and every rank's endpoint (one all_gather, at start, on every rank)."""
        eng, ctx = re.engine, re.ctx
        if self.decode is not None and eng.cache is None:
            raise ValueError(
                "a P/D decode worker on several ranks needs a cache (not --tiers none)"
            )
        c = ctx.config
        layout = layout_of(eng, c.tp, c.cp, c.pp, shape=re.part.full, rank=ctx.rank)
        self.metrics.page_bytes = layout.page_bytes
        self.metrics.part_bytes = eng.pool.shape.page_nbytes
        self.engine = eng
        _SIDES[id(eng)] = self
        if self.decode is not None and isinstance(self.gate, HandoffGate):
            self.decode.attach(eng, layout, self.gate)
            self.decode.cp_rank = ctx.cp_rank
            self.gate.engine, self.gate.side = eng, self.decode
        if self.prefill is not None and isinstance(self.gate, PullGate):
            self.prefill.cp = (ctx.cp_rank, ctx.cp_group)
            self.prefill.attach(eng, layout, self.gate)
        mine = self.prefill.listener.endpoint if self.prefill is not None else ""
        endpoints: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(endpoints, mine)
        if self.out is not None:
            self.out.put(SideReady({**layout.as_dict(), "rank": 0}, endpoints))

    def submitted(self, req: Request, handoff: dict[str, Any] | None) -> None:
        if self.prefill is not None and handoff is not None:
            self.prefill.submitted(req, handoff)

    def on_token(self, req: Request, token: int) -> None:
        if self.prefill is not None:
            sink = self.prefill.sinks.get(req.rid)
            if sink is not None:
                sink.push("token", token)

    def ended(self, req: Request, error: str | None = None) -> None:
        """Its peer hears why a failed hand-off failed (a pull's wait ran out: req.failure)."""
        req.state = State.DONE  # also one the engine refused at submit: its pull sink goes
        if self.prefill is not None:
            sink = self.prefill.sinks.pop(req.rid, None)
            why = error or req.failure
            if sink is not None:
                sink.push("error", why) if why else sink.push("done", req)

    def stats(self) -> dict[str, Any]:
        shape = self.engine.pool.shape
        part = {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads}
        return {
            "rank": self.rank,
            **part,
            "part_page_bytes": shape.page_nbytes,
            "prompt_tokens_computed": self.engine.prompt_tokens,  # what this rank's forwards ran
            **self.metrics.counts,
        }

    def close(self) -> None:
        _SIDES.pop(id(self.engine), None)
        if self.prefill is not None:
            self.prefill.close()


def rank_stats(engine: Any) -> dict[str, Any]:
    """A RankedLoop call (every rank): this rank's P/D part and counters."""
    return _SIDES[id(engine)].stats()


class RankPrefill(HandoffListener):
    """One prefill rank's listener thread. Only this thread touches flight/peers/queued; the
    engine thread hands it sinks and frames through `outbox` (FIFO: a sink before its frames)."""

    def __init__(
        self, cfg: PDConfig, listener: Listener, metrics: RankMetrics, rank: int, inbox: Any
    ) -> None:
        super().__init__(cfg, listener, "pd-prefill-rank")
        self.metrics, self.rank, self.inbox = metrics, rank, inbox
        self.loop = SimpleNamespace(engine=None)  # what Sink reads: loop.engine
        self.layout: Layout | None = None
        self.cp: tuple[int, Any] = (0, None)  # (cp rank, cp group): a CPSink's gather
        self.sinks: dict[str, Sink] = {}  # engine thread: rid -> sink, until the request ends
        self.flight: dict[str, Sink] = {}  # hand-off id -> sink, until answered
        self.peers: dict[str, tuple[bytes, float]] = {}  # hand-off id -> (decode peer, since)
        self.queued: dict[str, list[Frames]] = {}  # answers waiting for their peer
        self.puller = Puller(cfg, metrics, lambda sink, f: self.outbox.put((sink, f)), rank=rank)

    # ---- engine thread -------------------------------------------------------------------------
    def attach(self, engine: Any, layout: Layout, gate: PullGate) -> None:
        self.loop.engine, self.layout = engine, layout
        self.layerwise = self.cfg.pd_layerwise and layout.cp == 1  # cp: whole pages
        self.pulls = engine.cache is not None
        if self.pulls:  # the agreement rides in the cache's step consensus
            self.puller.gate, gate.engine, gate.puller = gate, engine, self.puller
        engine.connector = self
        self.thread.start()

    def submitted(self, req: Request, extra: dict[str, Any]) -> None:
        """Every rank, at the same step: the hand-off's request, before the engine has it."""
        sink = rank_sink(self, req, extra)
        self.sinks[req.rid] = sink
        self.outbox.put((sink, "new"))
        if sink.held and self.puller.gate is not None and not isinstance(sink, CPSink):
            self.puller.add(sink)  # it may pull held pages its tiers lack (every rank alike)

    def on_layer(self, reqs: list[Request], layer: int) -> None:
        for req in reqs:
            sink = self.sinks.get(req.rid)
            if sink is not None:
                sink.on_layer(layer)

    # ---- listener thread -----------------------------------------------------------------------
    def _on_message(self, peer: bytes, frames: Frames) -> None:
        try:
            head = read_header(frames)
        except WireError:
            return
        hid = str(head["id"])
        if head["type"] == "cancel":
            self.peers.pop(hid, None)
            self.queued.pop(hid, None)
            self.flight.pop(hid, None)
            if self.rank == 0:  # every rank aborts it at the same step (broadcast)
                self.inbox.put(Abort(f"pd-{hid}"))
            return
        if head["type"] == "pulled":  # only from this hand-off's own peer
            if self.peers.get(hid, (None,))[0] == peer:
                part = self.loop.engine.pool.shape.page_nbytes  # this rank's part of a page
                self.puller.receive(self.flight.get(hid), head, frames, part)
            return
        if head["type"] != "handoff":
            return
        try:
            self._check(hid, head)
        except (WireError, ValueError, KeyError, TypeError) as exc:
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
            bad = layout_mismatch(self.layout, head["layout"], "decode")
            if bad:
                raise WireError(bad)
            return
        req, held = check_handoff(self.layout, head, self.loop.engine.kv)
        handoff = {"pd_held": held, **check_owners(self.layout, head, held)}
        self.inbox.put(NewRequest(req.rid, req.tokens, 1, None, req.cache_salt, handoff=handoff))

    def _flush(self) -> None:
        for sink, frames in self._taken():
            if isinstance(frames, str):  # "new": a request every rank now runs
                self.flight[sink.hid] = sink
                continue
            if self.flight.get(sink.hid) is not sink:
                continue  # cancelled, or answered already
            if frames is None:
                frames = [header("refused", sink.hid, message="prefill ended the request")]
            self.queued.setdefault(sink.hid, []).append(frames)
        for hid in [h for h in self.queued if h in self.peers]:
            for frames in self.queued.pop(hid):
                self._send(hid, frames)

    def _send(self, hid: str, frames: Frames) -> None:
        sink = self.flight.get(hid)
        if sink is None:
            return
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
                del self.flight[hid]
                self.queued.pop(hid, None)
        for hid, (_, since) in list(self.peers.items()):
            if hid not in self.flight and now - since > limit:
                del self.peers[hid]
