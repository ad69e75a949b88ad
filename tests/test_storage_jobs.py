"""The storage workers' queue: submission order, except that a probe goes ahead of the reads
and backups queued after the last probe or plain job, and probes keep their order among
themselves; reads run together where there are several workers, a write alone; with the probe
lane, a probe need not wait for the reads or backups in progress either, and a write still
waits for every probe put before it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from kvstrata.cache.ops import BACKUP, PREFETCH, PROBE, TransferOp
from kvstrata.memory.layout import KVShape
from kvstrata.memory.pool import DevicePool, HostPool
from kvstrata.memory.storage_jobs import Job, StorageJobs
from kvstrata.memory.transfer import TensorMover
from kvstrata.storage.memory_store import MemoryStorage


def op(kind: str, tag: int) -> TransferOp:
    return TransferOp(kind, [tag], [tag], [tag])


def names(jobs: StorageJobs) -> list[str]:
    out = []
    while len(jobs):
        job = jobs.get()
        jobs.done(job)
        out.append(f"{job.kind}{job.keys[0]}" if isinstance(job, TransferOp) else "job")
    return out


def test_a_probe_passes_queued_reads_and_backups_but_never_a_job() -> None:
    jobs = StorageJobs()
    for job in (op(PREFETCH, 1), op(BACKUP, 2), op(PREFETCH, 3), op(PREFETCH, 4)):
        jobs.put(job)
    jobs.put(op(PROBE, 5))
    jobs.put(op(PROBE, 6))  # after the first probe, still ahead of the reads and the backup
    jobs.put(lambda: None)
    jobs.put(op(BACKUP, 7))
    jobs.put(op(PROBE, 8))  # the plain job stops it
    assert names(jobs) == [
        "probe5", "probe6", "prefetch1", "backup2", "prefetch3", "prefetch4", "job", "probe8",
        "backup7",
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


def test_the_lane_takes_a_probe_while_no_plain_job_is_queued_or_running() -> None:
    jobs = StorageJobs(probe_lane=True)
    jobs.put(op(PREFETCH, 1))
    jobs.put(op(PREFETCH, 2))
    running = jobs.get()  # the worker reads prefetch1
    jobs.put(op(PROBE, 3))  # beside it, on the lane
    assert running.keys == [1] and jobs.get_probe().keys == [3] and len(jobs) == 1
    jobs.probe_done()
    jobs.done(running)
    assert names(jobs) == ["prefetch2"]
    jobs.put(op(BACKUP, 4))
    backup = jobs.get()  # the worker writes backup4
    jobs.put(op(PREFETCH, 5))
    jobs.put(op(PROBE, 6))  # beside the backup, on the lane: it asks for none of its pages
    assert backup.keys == [4] and jobs.get_probe().keys == [6] and len(jobs) == 1
    jobs.probe_done()
    jobs.done(backup)
    jobs.put(lambda: None)
    jobs.put(op(PROBE, 7))  # a plain job is queued: behind it (it decides what exists)
    jobs.put(op(PROBE, 8))  # a probe waits in the queue: after it, never the lane
    assert names(jobs) == ["prefetch5", "job", "probe7", "probe8"]
    jobs.put(lambda: None)
    plain = jobs.get()  # the worker runs the plain job
    jobs.put(op(PROBE, 9))  # a plain job is running: into the queue
    assert callable(plain) and len(jobs) == 1
    jobs.done(plain)
    assert names(jobs) == ["probe9"]


def test_a_write_waits_for_the_lanes_probes_put_before_it() -> None:
    jobs = StorageJobs(probe_lane=True)
    jobs.put(op(PROBE, 1))  # idle worker: the lane
    jobs.put(lambda: None)
    jobs.put(op(PROBE, 3))  # behind the plain job
    took: list[Job] = []
    worker = threading.Thread(target=lambda: took.append(jobs.get()))
    worker.start()
    probe = jobs.get_probe()
    worker.join(timeout=0.3)
    assert worker.is_alive() and not took  # the commit would change what probe1 finds
    jobs.probe_done()
    worker.join(timeout=10)
    assert not worker.is_alive() and callable(took[0]) and probe.keys == [1]
    jobs.done(took[0])
    assert names(jobs) == ["probe3"]
    jobs.put(op(PROBE, 4))  # the lane again
    jobs.put(op(BACKUP, 5))  # a backup put after it waits for it too
    jobs.put(op(PROBE, 6))  # passes the queued backup: the lane
    worker, took = taker(jobs)
    worker.join(timeout=0.3)
    assert worker.is_alive() and not took
    assert [jobs.get_probe().keys for _ in range(2)] == [[4], [6]]
    jobs.probe_done()
    worker.join(timeout=0.3)
    assert worker.is_alive() and not took  # probe6 is open still
    jobs.probe_done()
    worker.join(timeout=10)
    assert [t.keys for t in took] == [[5]]
    jobs.done(took[0])
    jobs.stop_lane()
    assert jobs.get_probe() is None


def taker(jobs: StorageJobs) -> tuple[threading.Thread, list[Job]]:
    """A worker thread that takes one job."""
    took: list[Job] = []
    thread = threading.Thread(target=lambda: took.append(jobs.get()))
    thread.start()
    return thread, took


def test_reads_run_together_and_a_write_runs_alone_in_its_place() -> None:
    jobs = StorageJobs(workers=3)
    for job in (op(PREFETCH, 1), op(PROBE, 2), op(BACKUP, 3), op(PREFETCH, 4), op(PREFETCH, 5)):
        jobs.put(job)
    first, second = jobs.get(), jobs.get()  # two reads at once
    assert (first.kind, second.kind) == (PROBE, PREFETCH)  # the probe went ahead
    thread, took = taker(jobs)
    thread.join(timeout=0.3)
    assert thread.is_alive() and not took  # the backup waits for both reads
    jobs.done(first)
    thread.join(timeout=0.3)
    assert thread.is_alive() and not took
    jobs.done(second)
    thread.join(timeout=10)
    assert [t.keys for t in took] == [[3]]
    reader, read = taker(jobs)
    reader.join(timeout=0.3)
    assert reader.is_alive() and not read  # nothing after a write starts before it ends
    jobs.done(took[0])
    reader.join(timeout=10)
    assert [t.keys for t in read] == [[4]] and jobs.get().keys == [5]  # then reads together
    jobs.put(None)
    assert jobs.get() is None and jobs.get() is None  # every worker takes the stop marker


def test_one_worker_takes_one_job_at_a_time() -> None:
    jobs = StorageJobs()
    jobs.put(op(PREFETCH, 1))
    jobs.put(op(PREFETCH, 2))
    first = jobs.get()
    thread, took = taker(jobs)
    thread.join(timeout=0.3)
    assert thread.is_alive() and not took
    jobs.done(first)
    thread.join(timeout=10)
    assert [t.keys for t in took] == [[2]]
    with pytest.raises(ValueError, match="storage workers must be >= 1, got 0"):
        StorageJobs(workers=0)


SHAPE = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2)


class HeldReads:
    """A memory store whose reads wait until `release` (a read in progress, held)."""

    def __init__(self, beside: bool, together: bool = False) -> None:
        self.inner, self.page_nbytes = MemoryStorage(SHAPE.page_nbytes), SHAPE.page_nbytes
        self.concurrent_exists, self.concurrent_reads = beside, together
        self.release, self.reading, self.two_reading = (threading.Event() for _ in range(3))
        self._entered = 0
        self._lock = threading.Lock()

    def exists_prefix(self, keys: Sequence[int]) -> int:
        return self.inner.exists_prefix(keys)

    def get(self, keys: Sequence[int], out: Sequence[np.ndarray]) -> int:
        with self._lock:
            self._entered += 1
            (self.two_reading if self._entered >= 2 else self.reading).set()
        assert self.release.wait(10), "the test never released the held read"
        return self.inner.get(keys, out)

    def put(self, keys: Sequence[int], pages: Sequence[np.ndarray]) -> int:
        return self.inner.put(keys, pages)


def answer(mover: TensorMover, probe: TransferOp, bound_s: float) -> int | None:
    """The op's result, polled for at most `bound_s` (None: none came)."""
    for _ in range(int(bound_s / 0.01)):
        if (got := mover.poll(probe)) is not None:
            return got
        time.sleep(0.01)
    return None


@pytest.mark.parametrize("beside", [True, False])
def test_a_probe_answers_beside_a_held_read_where_the_store_allows(beside: bool) -> None:
    store = HeldReads(beside)
    store.put([10, 11, 12], [np.full(SHAPE.page_nbytes, i, np.uint8) for i in range(3)])
    mover = TensorMover(DevicePool(SHAPE, 4), HostPool(SHAPE, 4), store)  # type: ignore[arg-type]
    try:
        read = TransferOp(PREFETCH, [], [0, 1], [10, 11])
        probe = TransferOp(PROBE, [], [], [10, 11, 12, 13])
        mover.submit(read)
        assert store.reading.wait(10)  # the worker runs the read (a probe put now can't pass it)
        mover.submit(probe)
        assert answer(mover, probe, 5.0 if beside else 0.3) == (3 if beside else None)
        assert mover.poll(read) is None  # still held
        store.release.set()
        assert answer(mover, read, 10.0) == 2 and answer(mover, probe, 10.0) == 3
        assert mover.host is not None and int(mover.host.page_bytes(1)[0]) == 1
    finally:
        store.release.set()
        mover.close()


@pytest.mark.parametrize("together", [True, False])
def test_two_requests_reads_run_together_where_the_store_allows(together: bool) -> None:
    store = HeldReads(beside=False, together=together)
    store.put([10, 11], [np.full(SHAPE.page_nbytes, i + 1, np.uint8) for i in range(2)])
    host = HostPool(SHAPE, 4)
    mover = TensorMover(DevicePool(SHAPE, 4), host, store, read_threads=2)  # type: ignore[arg-type]
    try:
        reads = [TransferOp(PREFETCH, [], [0], [10]), TransferOp(PREFETCH, [], [1], [11])]
        for read in reads:
            mover.submit(read)
        assert store.two_reading.wait(5.0 if together else 0.3) is together
        store.release.set()
        assert [answer(mover, read, 10.0) for read in reads] == [1, 1]
        assert [int(host.page_bytes(i)[0]) for i in (0, 1)] == [1, 2]
    finally:
        store.release.set()
        mover.close()
