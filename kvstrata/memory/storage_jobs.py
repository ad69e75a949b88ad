"""The storage workers' queue: a rank's storage ops and plain jobs, taken in order by one
worker, or by several where the store takes concurrent reads, and a lane beside it where a
probe need not wait for a read or a backup at all.

In submission order, with one exception: a probe (existence checks, a few small calls) goes
ahead of the prefetches and backups queued after the last probe or plain job. A probe answers
whether a request needs storage at all, often for a request whose pages are all in device or
host memory; behind other requests' reads and backups it would wait out each of them (at a
remote store's speed, seconds) for nothing. Passing them changes nothing it finds: its keys
start where the request's memory match ended, and a backup queued before it writes pages the
tree held when the probe was put (held by the backup, so in memory for that match), which a
probe never asks for; passing a read changes only when the read's result comes (a read that
finds a unit corrupt and removes it could have made the probe count one page fewer: the read
that follows the probe then ends there, a miss like any other). It never passes a plain job (a
commit), which decides what exists. Probes stay in order among themselves, so the ranks, whose
queues see the same submissions, answer them in the same order.

Jobs start in queue order. Reads (prefetches, probes) may run together, up to one per worker
(`workers` > 1: a store whose reads may run at once, `storage.base.reads_run_together`); a
write (a backup or a plain job) starts only once everything before it is done, and nothing
after it starts until it is done. So each job finds exactly the writes queued before it, as
with one worker: several workers change only when a read's result comes.

The probe lane (a store whose existence checks may run beside its reads and writes:
`storage.base.exists_runs_beside_io`): a probe put while the workers run or hold nothing but
reads and backups does not wait for them either; a thread of its own runs it. A write still
waits until every probe put before it is done; a probe put while a plain job is queued or
running goes into the queue behind that job, and no probe is put in the lane while one waits in
the queue, so probes keep their order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from kvstrata.cache.ops import BACKUP, PREFETCH, PROBE, TransferOp

Job = TransferOp | Callable[[], None] | None
"""An op, a plain job (a callable run in order, reporting nothing), or None: stop."""


def _is_prefetch(job: Job) -> bool:
    return isinstance(job, TransferOp) and job.kind == PREFETCH


def _is_probe(job: Job) -> bool:
    return isinstance(job, TransferOp) and job.kind == PROBE


def _is_read(job: Job) -> bool:
    return _is_prefetch(job) or _is_probe(job)


def _probe_passes(job: Job) -> bool:
    """A probe put after this job may go ahead of it (the module doc says why)."""
    return _is_prefetch(job) or (isinstance(job, TransferOp) and job.kind == BACKUP)


class StorageJobs:
    """A blocking queue of Jobs in the order above, for `workers` threads (each takes a job
    with `get` and reports it with `done`); `probe_lane`: probes may go to the lane (taken by
    `get_probe`, each reported by `probe_done`)."""

    def __init__(self, probe_lane: bool = False, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"storage workers must be >= 1, got {workers}")
        self.probe_lane, self.workers = probe_lane, workers
        self._jobs: deque[Job] = deque()
        self._probes: deque[TransferOp | None] = deque()  # the lane; None: stop
        self._lane_open = 0  # probes put in the lane and not reported done
        self._reads = 0  # reads the workers took and have not reported done
        self._writing = False  # a worker took a write and has not reported it done
        self._committing = False  # ... and that write is a plain job
        self._ready = threading.Condition()

    def put(self, job: Job) -> None:
        """Queue `job`: at the end, or a probe ahead of the prefetches and backups queued last
        (or in the lane, where no plain job is queued or running)."""
        with self._ready:
            if self._lane_takes(job):
                assert isinstance(job, TransferOp)
                self._probes.append(job)
                self._lane_open += 1
            else:
                at = len(self._jobs)
                if _is_probe(job):
                    while at > 0 and _probe_passes(self._jobs[at - 1]):
                        at -= 1
                self._jobs.insert(at, job)
            self._ready.notify_all()

    def _lane_takes(self, job: Job) -> bool:
        """A probe goes to the lane while the workers hold and run only reads and backups
        (caller holds the condition's lock)."""
        return (
            self.probe_lane
            and _is_probe(job)
            and not self._committing
            and all(_probe_passes(j) for j in self._jobs)
        )

    def get(self) -> Job:
        """A worker's next job, waiting until the one at the head may start (the workers' idle
        wait: it ends with a put or a job done). The stop marker stays queued: every worker
        takes it."""
        with self._ready:
            while not self._jobs or not self._may_start(self._jobs[0]):
                self._ready.wait()
            job = self._jobs[0]
            if job is None:
                return None
            self._jobs.popleft()
            if _is_read(job):
                self._reads += 1
            else:
                self._writing = True
                self._committing = not _probe_passes(job)
            return job

    def _may_start(self, job: Job) -> bool:
        """Reads start beside reads; a write alone, after every job before it (the lane's
        probes too: any open one was put before it, since none enters while a write waits)."""
        if job is None or self._writing:
            return job is None
        if _is_read(job):
            return self._reads < self.workers
        return self._reads == 0 and self._lane_open == 0

    def done(self, job: Job) -> None:
        """A worker finished `job` (taken with `get`)."""
        with self._ready:
            if _is_read(job):
                self._reads -= 1
            else:
                self._writing = self._committing = False
            self._ready.notify_all()

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
        """Jobs queued (the lane's and the stop marker not counted)."""
        with self._ready:
            return sum(1 for j in self._jobs if j is not None)
