"""The storage worker's queue: a rank's storage ops and plain jobs, run one at a time.

In submission order, with one exception: a probe (existence checks, a few small calls) goes
ahead of the prefetches queued after the last job of any other kind. A probe answers whether a
request needs storage at all, often for a request whose pages are all in device or host
memory; behind other requests' reads it would wait out each of them (at a remote store's
speed, seconds) for nothing. It never passes a backup or a plain job (a commit), whose writes
decide what it finds; passing a read changes only when the read's result comes (a read that
finds a unit corrupt and removes it could have made the probe count one page fewer: the read
that follows the probe then ends there, a miss like any other). Probes stay in order among
themselves, so the ranks, whose queues see the same submissions, answer them in the same order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from kvstrata.cache.ops import PREFETCH, PROBE, TransferOp

Job = TransferOp | Callable[[], None] | None
"""An op, a plain job (a callable run in order, reporting nothing), or None: stop."""


def _is_prefetch(job: Job) -> bool:
    return isinstance(job, TransferOp) and job.kind == PREFETCH


class StorageJobs:
    """A blocking queue of Jobs in the order above."""

    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()
        self._ready = threading.Condition()

    def put(self, job: Job) -> None:
        """Queue `job`: at the end, or a probe ahead of the prefetches queued last."""
        with self._ready:
            at = len(self._jobs)
            if isinstance(job, TransferOp) and job.kind == PROBE:
                while at > 0 and _is_prefetch(self._jobs[at - 1]):
                    at -= 1
            self._jobs.insert(at, job)
            self._ready.notify()

    def get(self) -> Job:
        """The next job, waiting for one (the worker's idle wait: it ends with a put)."""
        with self._ready:
            while not self._jobs:
                self._ready.wait()
            return self._jobs.popleft()

    def __len__(self) -> int:
        with self._ready:
            return len(self._jobs)
