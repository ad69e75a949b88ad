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

from typing import Any

import torch.distributed as dist

from kvstrata.engine.request import Request
from kvstrata.engine.step_io import SideCount, SideReady
from kvstrata.listeners import exit_process
from kvstrata.pd.config import PDConfig
from kvstrata.pd.connectors import pd_side
from kvstrata.pd.decode import DecodeSide
from kvstrata.pd.layout import layout_of
from kvstrata.pd.prefill import PrefillSide
from kvstrata.pd.pull import PullGate
from kvstrata.pd.transport import transport_of

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
    RankEngine adds them to its one all_reduce). Slot i is the i-th hand-off in flight, in
    admission order (DecodeSide.window: the same list on every rank, it changes only by agreed
    steps); slots: max_running, so every such request has one."""

    def __init__(self, slots: int, rank: int) -> None:
        self.rank = rank
        self.min_fields = tuple(f"pd_arrived{i}" for i in range(slots))
        self.max_fields = tuple(f"pd_failed{i}" for i in range(slots))
        self.side: DecodeSide | None = None
        self._window: list[str] = []
        self._decided: list[tuple[str, int, int]] = []

    def local(self) -> dict[str, int]:
        """This rank's counts: 1 if the slot's outcome arrived here; 1000 x status + rank if it
        is a failure (MAX: the worst status, and a rank that saw it)."""
        assert self.side is not None
        self._window = self.side.window()[: len(self.min_fields)]
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


class RankPD:
    """One rank's P/D side inside serve/ranks.py's rank loop (prefill or decode)."""

    def __init__(
        self, role: str, cfg: PDConfig | None, rank: int, slots: int, inbox: Any, out: Any
    ) -> None:
        cfg = cfg or PDConfig()
        self.role, self.cfg, self.rank, self.out = role, cfg, rank, out
        self.metrics = RankMetrics(out)
        transport = transport_of(cfg)
        side = pd_side(role, cfg, transport, self.metrics, rank)
        # fields of the step's one collective: decode's landings, or prefill's pulls
        self.gate: HandoffGate | PullGate = (
            HandoffGate(slots, rank)
            if role == "decode"
            else PullGate(slots, rank, cfg.pd_timeout_s)
        )
        self.decode = side if isinstance(side, DecodeSide) else None
        self.prefill = side if isinstance(side, PrefillSide) else None
        if self.prefill is not None:  # a rank whose listener died leaves; its server follows
            self.prefill.listeners.on_death.append(exit_process)
        self.inbox = inbox
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
        self.engine = eng
        _SIDES[id(eng)] = self
        if self.decode is not None and isinstance(self.gate, HandoffGate):
            self.decode.attach(eng, layout, self.gate)
            self.decode.cp_rank = ctx.cp_rank
            self.gate.side = self.decode
        if self.prefill is not None and isinstance(self.gate, PullGate):
            self.prefill.cp = (ctx.cp_rank, ctx.cp_group)
            self.prefill.attach(eng, layout, self.inbox, self.gate)
        side = self.decode if self.decode is not None else self.prefill
        assert side is not None
        self.metrics.part_bytes = side.view.pool.shape.page_nbytes
        mine = self.prefill.listener.endpoint if self.prefill is not None else ""
        endpoints: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(endpoints, mine)
        if self.out is not None:
            self.out.put(SideReady({**layout.as_dict(), "rank": 0}, endpoints))

    def submitted(self, req: Request) -> None:
        if self.prefill is not None:
            self.prefill.submitted(req)

    def on_token(self, req: Request, token: int) -> None:
        if self.prefill is not None:
            self.prefill.on_token(req, token)

    def ended(self, req: Request, error: str | None = None) -> None:
        if self.prefill is not None:
            self.prefill.ended(req, error)

    def stats(self, prompt_tokens: int) -> dict[str, Any]:
        """prompt_tokens: what this rank's forwards computed."""
        side = self.decode if self.decode is not None else self.prefill
        assert side is not None
        shape = side.view.pool.shape
        part = {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads}
        return {
            "rank": self.rank,
            **part,
            "part_page_bytes": shape.page_nbytes,
            "prompt_tokens_computed": prompt_tokens,
            **self.metrics.counts,
        }

    def close(self) -> None:
        _SIDES.pop(id(self.engine), None)
        if self.prefill is not None:
            self.prefill.close()


def rank_stats(engine: Any) -> dict[str, Any]:
    """A RankedLoop call (every rank): this rank's P/D part and counters."""
    return _SIDES[id(engine)].stats(engine.prompt_tokens)
