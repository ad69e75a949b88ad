"""A P/D worker's side on each of its ranks (RankPD; one rank is the N=1 case of many, with no
gate): under tp x pp, rank r of a prefill worker pairs with rank r of a decode worker of the same
layout, each pair over its own channel, each rank sending or receiving only its own part of every
page (its heads under TP, its stage's layers under PP).

Prefill: every rank listens on its own endpoint. Rank 0 checks decode rank 0's hand-off (layout,
key chain) and submits it through the rank-0 inbox, so every rank gets the request at the same
step (serve/ranks.py broadcasts it, with the held page count). The other ranks only check their
peer's layout and remember it; at the first token every rank's engine holds the request's pages
and each rank's listener reads and sends its part of the pages decode lacks (the same `Sink` as
one rank) once its peer has asked (bounded wait). The pages go back on every rank at the same
step, once every rank has sent its part (HoldGate, kvstrata/pd/holds.py: "done here" by MIN).

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

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from kvstrata.engine.engine import Engine
from kvstrata.engine.step_io import Inbox
from kvstrata.listeners import Listeners, exit_process
from kvstrata.pd.config import PDConfig
from kvstrata.pd.connectors import pd_side
from kvstrata.pd.decode import DecodeSide
from kvstrata.pd.holds import HoldGate
from kvstrata.pd.metrics import RankCounts, Report
from kvstrata.pd.prefill import PrefillSide
from kvstrata.pd.pull import PullGate
from kvstrata.pd.reports import SideUp
from kvstrata.pd.transport import transport_of
from kvstrata.pd.wire import Layout


class HandoffGate:
    """The decode ranks' landing decision, as fields of the step consensus (ranks/rank_engine.py:
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


class PrefillGate:
    """A prefill worker's fields of the step's one collective: its pulls' (PullGate) and its
    held pages' (HoldGate), side by side."""

    def __init__(self, slots: int, rank: int, timeout_s: float) -> None:
        self.pulls = PullGate(slots, rank, timeout_s)
        self.holds = HoldGate(slots)
        self.min_fields = self.pulls.min_fields + self.holds.min_fields
        self.max_fields = self.pulls.max_fields + self.holds.max_fields

    def local(self) -> dict[str, int]:
        return {**self.pulls.local(), **self.holds.local()}

    def agreed(self, values: dict[str, int]) -> None:
        self.pulls.agreed(values)
        self.holds.agreed(values)


class RankPD:
    """One rank's P/D side (prefill or decode), on one rank and on each of many: its connector,
    its counters (RankCounts, reporting to the HTTP side through `report`) and, under several
    ranks, the fields it adds to the step's one collective (`gate`)."""

    def __init__(
        self,
        role: str,
        cfg: PDConfig,
        rank: int,
        report: Report | None,
        inbox: Inbox,
        gate_slots: int = 0,
        listeners: Listeners | None = None,
    ) -> None:
        """inbox: the step loop's (rank 0's under ranks): checked hand-offs go in there.
        gate_slots: several ranks: max_running (a slot per request in flight); 0: one rank.
        listeners: the process's listener threads (one rank: a death stops the server); None:
        a rank's own, whose death ends its process (the server follows)."""
        self.role, self.cfg, self.rank, self.inbox = role, cfg, rank, inbox
        self.metrics = RankCounts(report)
        side = pd_side(role, cfg, transport_of(cfg), self.metrics, rank)
        self.decode = side if isinstance(side, DecodeSide) else None
        self.prefill = side if isinstance(side, PrefillSide) else None
        # fields of the step's one collective: decode's landings, or prefill's pulls and holds
        self.gate: HandoffGate | PrefillGate | None = None
        if gate_slots:
            self.gate = (
                HandoffGate(gate_slots, rank)
                if role == "decode"
                else PrefillGate(gate_slots, rank, cfg.pd_timeout_s)
            )
        if self.prefill is not None:
            if listeners is not None:
                self.prefill.listeners = listeners
            else:  # a rank whose listener died leaves; its server follows
                self.prefill.listeners.on_death.append(exit_process)
        self.side: PrefillSide | DecodeSide = side

    def attach(
        self,
        eng: Engine,
        layout: Layout,
        cp: tuple[int, Any] = (0, None),
        gather: Callable[[str], list[str]] = lambda mine: [mine],
    ) -> None:
        """Every rank, once its engine is built: its connector, and the HTTP side hears the
        layout and every rank's endpoint (`gather`: this rank's endpoint -> every rank's, on
        every rank; one all_gather at start under ranks). cp: (cp rank, cp group) of this rank."""
        if self.decode is not None and self.gate is not None and eng.cache is None:
            raise ValueError(
                "a P/D decode worker on several ranks needs a cache (not --tiers none)"
            )
        self.metrics.page_bytes = layout.page_bytes
        if self.decode is not None:
            gate = self.gate if isinstance(self.gate, HandoffGate) else None
            self.decode.attach(eng, layout, gate)
            self.decode.cp_rank = cp[0]
            if gate is not None:
                gate.side = self.decode
        if self.prefill is not None:
            self.prefill.cp = cp
            gate = self.gate if isinstance(self.gate, PrefillGate) else None
            pulls, holds = (gate.pulls, gate.holds) if gate is not None else (None, None)
            self.prefill.attach(eng, layout, self.inbox, pulls, holds)
        self.metrics.part_bytes = self.side.view.pool.shape.page_nbytes
        mine = self.prefill.listener.endpoint if self.prefill is not None else ""
        endpoints = gather(mine)
        if self.metrics.report is not None:
            self.metrics.report(SideUp({**layout.as_dict(), "rank": 0}, endpoints))

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()


def rank_stats(engine: Engine) -> dict[str, Any]:
    """A call on every rank of a P/D worker: this rank's part of a page and its own counters
    (its connector's)."""
    side = engine.connector
    assert isinstance(side, PrefillSide | DecodeSide), "not a P/D worker's engine"
    shape = side.view.pool.shape
    return {
        "rank": side.rank,
        "layers": shape.num_layers,
        "kv_heads": shape.num_kv_heads,
        "part_page_bytes": shape.page_nbytes,
        "prompt_tokens_computed": engine.prompt_tokens,
        **side.metrics.counts,
    }
