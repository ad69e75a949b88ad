"""The storage worker's queue: a rank's storage ops and plain jobs, run one at a time, and a
lane beside it where a probe need not wait for a read at all.

In submission order, with one exception: a probe (existence checks, a few small calls) goes
ahead of the prefetches queued after the last job of any other kind. A probe answers whether a
request needs storage at all, often for a request whose pages are all in device or host
memory; behind other requests' reads it would wait out each of them (at a remote store's
speed, seconds) for nothing. It never passes a backup or a plain job (a commit), whose writes
decide what it finds; passing a read changes only when the read's result comes (a read that
finds a unit corrupt and removes it could have made the probe count one page fewer: the read
that follows the probe then ends there, a miss like any other). Probes stay in order among
themselves, so the ranks, whose queues see the same submissions, answer them in the same order.

The probe lane (a store whose existence checks may run beside its reads and writes:
`storage.base.exists_runs_beside_io`): a probe put while the worker runs or holds nothing but
reads does not wait for the read in progress either; a second thread runs it. The same rule
holds as in one queue: a write (a backup or a plain job) the worker takes next waits until every
probe put before it is done, so a probe finds exactly the writes put before it; a probe put
while a write is queued or running goes into the one queue behind that write, and no probe is
put in the lane while one waits there, so probes keep their order.
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


def _is_probe(job: Job) -> bool:
    return isinstance(job, TransferOp) and job.kind == PROBE


class StorageJobs:
    """A blocking queue of Jobs in the order above; `probe_lane`: probes may go to the lane
    (taken by `get_probe`, each reported by `probe_done`)."""

    def __init__(self, probe_lane: bool = False) -> None:
        self.probe_lane = probe_lane
        self._jobs: deque[Job] = deque()
        self._probes: deque[TransferOp | None] = deque()  # the lane; None: stop
        self._lane_open = 0  # probes put in the lane and not reported done
        self._running: Job = None  # the job the worker took last and has not finished
        self._ready = threading.Condition()

    def put(self, job: Job) -> None:
        """Queue `job`: at the end, or a probe ahead of the prefetches queued last (or in the
        lane, where only reads are queued or running)."""
        with self._ready:
            if self._lane_takes(job):
                assert isinstance(job, TransferOp)
                self._probes.append(job)
                self._lane_open += 1
            else:
                at = len(self._jobs)
                if _is_probe(job):
                    while at > 0 and _is_prefetch(self._jobs[at - 1]):
                        at -= 1
                self._jobs.insert(at, job)
            self._ready.notify_all()

    def _lane_takes(self, job: Job) -> bool:
        """A probe goes to the lane while the worker holds and runs only reads (caller holds
        the condition's lock)."""
        return (
            self.probe_lane
            and _is_probe(job)
            and (self._running is None or _is_prefetch(self._running))
            and all(_is_prefetch(j) for j in self._jobs)
        )

    def get(self) -> Job:
        """The worker's next job (the one before it is finished), waiting for one; a write
        waits until the lane's probes put before it are done (the worker's idle wait: it ends
        with a put, or a probe done)."""
        with self._ready:
            self._running = None
            while not self._jobs or self._write_waits(self._jobs[0]):
                self._ready.wait()
            self._running = self._jobs.popleft()
            return self._running

    def _write_waits(self, job: Job) -> bool:
        """A backup or plain job waits while probes put in the lane before it are open (any
        open one was put before it: none enters the lane while a write is queued)."""
        return (
            job is not None and not _is_prefetch(job) and not _is_probe(job) and self._lane_open > 0
        )

    def get_probe(self) -> TransferOp | None:
        """The lane's next probe, waiting for one; None: stop."""
        with self._ready:
            while not self._probes:
                self._ready.wait()
            return self._probes.popleft()

    def probe_done(self) -> None:
        """The lane's probe taken last is answered: a write waiting on it may start."""
        with self._ready:
            self._lane_open -= 1
            self._ready.notify_all()

    def stop_lane(self) -> None:
        """The lane's thread stops after the probes already in it."""
        with self._ready:
            self._probes.append(None)
            self._ready.notify_all()

    def __len__(self) -> int:
        """Jobs queued in the one queue (the lane's not counted)."""
        with self._ready:
            return len(self._jobs)
