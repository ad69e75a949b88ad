"""The scheduler side's PageMover: the cache manager's ops become worker jobs, results come back.

kvstrata's device page ids are *transit* ids here: vLLM owns device memory, so a device id only
names "the vLLM blocks of page i of some running request" (`bind`). An op submitted during a
scheduler step is turned into a job when the step's metadata is built (its transit ids are
bound by then), runs on every worker in that step, and its pages-moved count comes back
through `report` (the minimum over workers) before the manager's next step.

Transit ids and vLLM's blocks: a load writes the blocks bound for it at admission (`bind_load`);
a store reads the blocks of a request that holds the page's KV *now* (`bind_source`: vLLM's hit,
loaded or computed by the end of the step). A request that goes away (finished, preempted) is
`forget`-ten: its blocks are never read again. A store of a page no live request holds is a
failed store (0 pages, no job): a later miss, never stale bytes.

Storage visibility: workers write their own units of a backed-up page and never its commit
marker. Only once the aggregated (minimum) result says every worker wrote every page of a backup
does `report` commit it (the `commit` callback writes the markers): a page is never visible with
one worker's heads missing. A backup some worker did not finish counts 0 pages (never committed;
its units are swept as stale).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

from kvstrata.cache.ops import BACKUP, LOAD, PREFETCH, PROBE, STORE, TransferOp
from kvstrata.integrations.vllm.metadata import BlockCopy, CopyJob, StepJobs, StorageJob

log = logging.getLogger(__name__)

Commit = Callable[[Sequence[int]], int]
"""Writes the commit markers of these page keys; returns how many were written."""


class JobMover:
    """Queues ops as jobs for the next step's metadata; results arrive with `report`."""

    def __init__(self, commit: Commit | None = None) -> None:
        self._commit = commit
        self._ids = itertools.count(1)
        self._queued: list[TransferOp] = []
        self._sent: dict[int, TransferOp] = {}  # op id -> op, until its result came back
        self._results: dict[int, int] = {}  # id(op) -> pages moved (agreed over workers)
        # transit id -> (vLLM blocks a load writes, -1: skip; the request they belong to)
        self._load_to: dict[int, tuple[tuple[int, ...], str]] = {}
        # transit id -> request -> its vLLM blocks holding the page (the last bound is read)
        self._sources: dict[int, dict[str, tuple[int, ...]]] = {}
        self._bound: dict[str, set[int]] = {}  # request -> transit ids it is a source of

    # ---- transit ids --------------------------------------------------------------------------
    def bind_load(self, transit_id: int, blocks: tuple[int, ...], request_id: str) -> None:
        """A load of `transit_id` writes these blocks of `request_id` (-1: not copied)."""
        self._load_to[transit_id] = (blocks, request_id)

    def bind_source(self, transit_id: int, blocks: tuple[int, ...], request_id: str) -> None:
        """`request_id`'s blocks hold page `transit_id` by the end of this step."""
        sources = self._sources.setdefault(transit_id, {})
        sources.pop(request_id, None)  # re-bound: the latest source is read first
        sources[request_id] = blocks
        self._bound.setdefault(request_id, set()).add(transit_id)

    def unbind(self, transit_ids: Sequence[int]) -> None:
        """These transit ids were freed: nothing may read or write blocks through them."""
        for t in transit_ids:
            self._load_to.pop(t, None)
            for request_id in self._sources.pop(t, {}):
                self._bound.get(request_id, set()).discard(t)

    def forget(self, request_id: str) -> None:
        """vLLM may reuse `request_id`'s blocks from now on: no job reads them again."""
        for t in self._bound.pop(request_id, set()):
            sources = self._sources.get(t)
            if sources is not None:
                sources.pop(request_id, None)
                if not sources:
                    del self._sources[t]

    def reads(self, request_id: str) -> bool:
        """Whether a queued store reads blocks of `request_id` (vLLM must keep them)."""
        return any(
            self._source(t)[1] == request_id
            for op in self._queued
            if op.kind == STORE
            for t in op.src
        )

    def _source(self, transit_id: int) -> tuple[tuple[int, ...], str]:
        sources = self._sources.get(transit_id)
        if not sources:
            return (), ""
        request_id = next(reversed(sources))
        return sources[request_id], request_id

    # ---- PageMover ----------------------------------------------------------------------------
    def submit(self, op: TransferOp) -> None:
        op.handle = next(self._ids)
        self._queued.append(op)

    def poll(self, op: TransferOp) -> int | None:
        return self._results.get(id(op))

    def cancel(self, op: TransferOp) -> None:
        op.cancelled = True  # a job runs whole within one step; a queued one is still sent

    def wait_answered(self, op: TransferOp, timeout_s: float) -> None:
        """Results come with the workers' step outputs: nothing to wait for between them."""

    def release(self, op: TransferOp) -> None:
        self._results.pop(id(op), None)

    # ---- step plumbing ------------------------------------------------------------------------
    def take_jobs(self) -> StepJobs:
        """The queued ops as this step's jobs (transit ids resolved to vLLM blocks now)."""
        jobs = StepJobs()
        for op in self._queued:
            if op.kind == STORE and not all(self._source(t)[1] for t in op.src):
                self._results[id(op)] = 0  # a page no live request holds: a failed store
                continue
            self._sent[op.handle] = op
            if op.kind == LOAD:
                to = [self._load_to[t] for t in op.dst]
                jobs.loads.append(_copy_job(op.handle, op.src, to))
            elif op.kind == STORE:
                jobs.stores.append(_copy_job(op.handle, op.dst, [self._source(t) for t in op.src]))
            elif op.kind == BACKUP:
                jobs.storage.append(StorageJob(op.handle, BACKUP, tuple(op.keys), tuple(op.src)))
            elif op.kind == PREFETCH:
                jobs.storage.append(StorageJob(op.handle, PREFETCH, tuple(op.keys), tuple(op.dst)))
            else:
                assert op.kind == PROBE, op.kind
                jobs.storage.append(StorageJob(op.handle, PROBE, tuple(op.keys)))
        self._queued.clear()
        return jobs

    def report(self, results: dict[int, int]) -> None:
        """Pages moved per op id (agreed over workers) for ops sent in an earlier step."""
        for op_id, pages in results.items():
            op = self._sent.pop(op_id, None)
            if op is not None:
                self._results[id(op)] = self._committed(op, pages) if op.kind == BACKUP else pages

    def _committed(self, op: TransferOp, agreed: int) -> int:
        """A backup every worker completed becomes visible now; anything less is 0 pages."""
        keys = list(op.keys)
        if agreed != len(keys) or not keys or self._commit is None:
            return 0
        try:
            done = self._commit(keys)
        except Exception as exc:  # noqa: BLE001 - unreachable storage: the pages stay invisible
            log.warning("kvstrata: commit of %d backed-up pages failed: %s", len(keys), exc)
            return 0
        return len(keys) if done == len(keys) else 0


def _copy_job(
    op_id: int, host_ids: list[int], blocks: list[tuple[tuple[int, ...], str]]
) -> CopyJob:
    """Host page i <-> blocks[i] = (its vLLM blocks, the request they belong to)."""
    pages = tuple(BlockCopy(h, b) for h, (b, _) in zip(host_ids, blocks, strict=True))
    return CopyJob(op_id, pages, tuple(sorted({r for _, r in blocks if r})))
