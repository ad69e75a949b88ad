"""The storage worker's queue: submission order, except that a probe goes ahead of the reads
queued after the last backup or plain job, and probes keep their order among themselves."""

from __future__ import annotations

import threading

from kvstrata.cache.ops import BACKUP, PREFETCH, PROBE, TransferOp
from kvstrata.memory.storage_jobs import Job, StorageJobs


def op(kind: str, tag: int) -> TransferOp:
    return TransferOp(kind, [tag], [tag], [tag])


def names(jobs: StorageJobs) -> list[str]:
    out = []
    while len(jobs):
        job = jobs.get()
        out.append(f"{job.kind}{job.keys[0]}" if isinstance(job, TransferOp) else "job")
    return out


def test_a_probe_passes_queued_reads_but_never_a_backup_or_a_job() -> None:
    jobs = StorageJobs()
    for job in (op(PREFETCH, 1), op(BACKUP, 2), op(PREFETCH, 3), op(PREFETCH, 4)):
        jobs.put(job)
    jobs.put(op(PROBE, 5))
    jobs.put(op(PROBE, 6))  # after the first probe, still ahead of the reads
    jobs.put(lambda: None)
    jobs.put(op(PREFETCH, 7))
    jobs.put(op(PROBE, 8))  # the plain job stops it
    assert names(jobs) == [
        "prefetch1", "backup2", "probe5", "probe6", "prefetch3", "prefetch4", "job", "probe8",
        "prefetch7",
    ]  # fmt: skip


def test_a_probe_on_an_idle_queue_and_the_stop_marker() -> None:
    jobs = StorageJobs()
    got: list[Job] = []
    worker = threading.Thread(target=lambda: got.extend([jobs.get(), jobs.get()]))
    worker.start()
    probe = op(PROBE, 1)
    jobs.put(probe)
    jobs.put(None)
    worker.join(timeout=10)
    assert not worker.is_alive() and got == [probe, None]
