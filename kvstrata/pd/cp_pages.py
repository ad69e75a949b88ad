"""P/D workers on `--cp` ranks: which rank moves which page.

Under context parallelism a rank owns whole pages (owner = logical page id % cp,
kvstrata/memory/cp_ownership.py), not a part of every page, and the two workers' page ids differ:
prefill's page i may sit on its rank 0 while decode's page i sits on its rank 1. Decode's page
tables are the same on every decode rank (one logical cache), so decode rank 0's hand-off says
who owns each page decode lacks (`owners`: decode's page id % cp of pages [held, n)). Rank 0 of
prefill checks it and submits it with the request, so every prefill rank knows it at the same
step. At the first token every prefill rank gathers the missing pages from its cp group (one
all_gather, on the engine thread, at the same step on every rank: the engine runs the same steps
everywhere) and sends its peer, decode rank r, exactly the pages decode rank r owns, whole
(every layer and head), in prompt order; the reply names them (`cp_pages`). Decode rank r checks
that they are the pages it owns and writes only those; the landing stays agreed by HandoffGate.

Not under cp: layer-by-layer sending (a layer's pages are on several ranks, and CPModel calls
`before_layer(i + 1)` before layer i is computed) and prefill's pulls of held pages (decode rank
r holds other pages than prefill rank r needs): prefill computes held pages its tiers lack.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvstrata.engine.request import Request
from kvstrata.memory.cp_ownership import CPOwnership
from kvstrata.pd.sink import Sink, SinkSide
from kvstrata.pd.wire import Layout, WireError

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def owners_of(page_table: list[int], held: int, n_pages: int, cp: int) -> list[int]:
    """Decode's owning rank of each prompt page it lacks, pages [held, n_pages)."""
    return [int(p) % cp for p in page_table[held:n_pages]]


def mine(owners: list[int], held: int, cp_rank: int) -> list[int]:
    """Prompt page indices (from `held`) that decode rank `cp_rank` owns: what it receives."""
    return [held + i for i, o in enumerate(owners) if o == cp_rank]


def check_owners(layout: Layout, head: dict[str, Any], held: int) -> dict[str, Any]:
    """The submit extra for a hand-off (of a checked prompt and key chain): {"pd_owners": [...]}
    under cp > 1, one valid rank per page decode lacks, else {}."""
    if layout.cp == 1:
        return {}
    n_missing = -(-len(head["tokens"]) // layout.page_size) - held
    owners = head.get("owners")
    if (
        not isinstance(owners, list)
        or len(owners) != n_missing
        or not all(isinstance(o, int) and 0 <= o < layout.cp for o in owners)
    ):
        raise WireError(
            f"under cp={layout.cp} a hand-off names the owning decode rank of each of the "
            f"{n_missing} pages it lacks (`owners`), got {owners!r}"
        )
    return {"pd_owners": owners}


def gather_pages(pool: Any, ids: list[int], group: Any = None) -> list[np.ndarray]:
    """Every rank: device pages `ids` (spread over the cp group) as host frames in the host
    page layout, one uint8 row of page_bytes per page, in `ids` order. A collective: every rank
    of the group calls it with the same ids at the same point."""
    if not ids:
        return []
    own = CPOwnership(pool.n_shards)
    shares = own.shares(ids)
    m = max(shares)
    pos, slots = own.owned(ids, pool.rank)
    # [layers, 2, k, page, heads, dim] -> page-first [k, layers, 2, page, heads, dim]
    part = pool.data[:, :, torch.tensor(slots, dtype=torch.long)].permute(2, 0, 1, 3, 4, 5)
    send = part.new_zeros((m, *part.shape[1:]))  # padded to the largest share
    send[: len(slots)] = part
    recv = part.new_empty((own.cp * m, *part.shape[1:]))  # rank r's pages at rows [r*m, ...)
    _all_gather_single(recv, send.contiguous(), group=group)
    seen = [0] * own.cp
    rows = []
    for p in ids:  # the k-th page rank r owns sits at row r * m + k
        r = own.owner(p)
        rows.append(r * m + seen[r])
        seen[r] += 1
    block = recv[torch.tensor(rows, dtype=torch.long)].contiguous()
    return list(block.cpu().reshape(len(ids), -1).view(torch.uint8).numpy())


class CPSink(Sink):
    """A hand-off's sink on a cp rank of prefill: whole pages, only those its peer owns."""

    def __init__(
        self,
        side: SinkSide,
        req: Request,
        held: int,
        hid: str,
        owners: list[int],
        cp_rank: int,
        group: Any,
    ) -> None:
        super().__init__(side, b"", req, held, hid)
        self.owners, self.cp_rank, self.group = owners, cp_rank, group

    def on_layer(self, layer: int) -> None:
        return  # never layer by layer under cp (see the module docstring)

    def can_hold(self) -> bool:
        return False  # the pages leave through a collective gather, on the engine thread

    def _host(self, pool: Any, ids: list[int]) -> tuple[list[Any], dict[str, Any]]:
        """Gather every missing page (collective), keep the ones decode rank cp_rank owns."""
        assert len(self.owners) == len(ids), "owners were checked against [held, n) at submit"
        frames = gather_pages(pool, ids, self.group)
        want = mine(self.owners, self.held, self.cp_rank)
        return [frames[i - self.held] for i in want], {"cp_pages": want}


def received_pages(got: Any, expect: list[int] | None) -> list[int]:
    """Prompt page indices of a `pages` reply's frames; decode checks them against `expect`
    (the pages it owns under cp; None: every page it lacks, [held, n))."""
    sent = got.stats.get("cp_pages")
    if sent is None:
        sent = list(range(got.first_page, got.first_page + len(got.pages)))
    if expect is not None and (sent != expect or len(got.pages) != len(expect)):
        raise WireError(f"sent prompt pages {sent}; decode rank owns {expect}")
    return [int(i) for i in sent]


def rank_sink(side: SinkSide, req: Request, extra: dict[str, Any]) -> Sink:
    """A prefill rank's sink of a submitted hand-off (a CPSink when decode named owners)."""
    held, owners, hid = int(extra["pd_held"]), extra.get("pd_owners"), str(extra["pd_id"])
    if owners is None:
        return Sink(side, b"", req, held, hid)
    return CPSink(side, req, held, hid, owners, *side.cp)
