"""The scheduler side's PageMover: the cache manager's ops become worker jobs, results come back.

kvstrata's device page ids are *transit* ids here: vLLM owns device memory, so a device id only
names "the vLLM blocks of page i of some running request" (`bind`). An op submitted during a
scheduler step is turned into a job when the step's metadata is built (its transit ids are
bound by then), runs on every worker in that step, and its pages-moved count comes back
through `report` (the minimum over workers) before the manager's next step.

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
        self._blocks: dict[int, tuple[int, ...]] = {}  # transit id -> vLLM blocks (-1: skip)
        self._owner: dict[int, str] = {}  # transit id -> the vLLM request it was bound for

    # ---- transit ids --------------------------------------------------------------------------
    def bind(self, transit_id: int, blocks: tuple[int, ...], request_id: str = "") -> None:
        """Transit page `transit_id` is these vLLM blocks of `request_id` (until bound again)."""
        self._blocks[transit_id] = blocks
        self._owner[transit_id] = request_id

    # ---- PageMover ----------------------------------------------------------------------------
    def submit(self, op: TransferOp) -> None:
        op.handle = next(self._ids)
        self._queued.append(op)

    def poll(self, op: TransferOp) -> int | None:
        return self._results.get(id(op))

    def cancel(self, op: TransferOp) -> None:
        op.cancelled = True  # a job runs whole within one step; a queued one is still sent

    def release(self, op: TransferOp) -> None:
        self._results.pop(id(op), None)

    # ---- step plumbing ------------------------------------------------------------------------
    def take_jobs(self) -> StepJobs:
        """The queued ops as this step's jobs (transit ids resolved to vLLM blocks now)."""
        jobs = StepJobs()
        for op in self._queued:
            self._sent[op.handle] = op
            if op.kind == LOAD:
                jobs.loads.append(self._copy_job(op.handle, op.src, op.dst))
            elif op.kind == STORE:
                jobs.stores.append(self._copy_job(op.handle, op.dst, op.src))
            elif op.kind == BACKUP:
                jobs.storage.append(StorageJob(op.handle, BACKUP, tuple(op.keys), tuple(op.src)))
            elif op.kind == PREFETCH:
                jobs.storage.append(StorageJob(op.handle, PREFETCH, tuple(op.keys), tuple(op.dst)))
            else:
                assert op.kind == PROBE, op.kind
                jobs.storage.append(StorageJob(op.handle, PROBE, tuple(op.keys)))
        self._queued.clear()
        return jobs

    def _copy_job(self, op_id: int, host_ids: list[int], transit_ids: list[int]) -> CopyJob:
        pages = tuple(
            BlockCopy(h, self._blocks[t]) for h, t in zip(host_ids, transit_ids, strict=True)
        )
        owners = tuple(sorted({self._owner[t] for t in transit_ids if self._owner.get(t)}))
        return CopyJob(op_id, pages, owners)

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

    @property
    def outstanding(self) -> int:
        """Ops queued or sent whose result has not come back yet."""
        return len(self._queued) + len(self._sent)
