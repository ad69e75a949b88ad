"""Prometheus metrics of the server, vLLM-style names under `kvstrata:`, label `model_name`.

Latencies and per-request token sources are recorded on the engine thread as they happen
(prometheus_client is thread-safe); cache counters and pool usage are read at scrape time, from
plain integers only, so a scrape never walks the tree while the engine thread changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.cache.counters import CacheCounters
from kvstrata.engine.engine import Engine
from kvstrata.engine.speculative import SpecStats
from kvstrata.http.latency import LATENCY_BUCKETS
from kvstrata.serve.request_record import RequestRecord
from kvstrata.serve.stream import LoopObserver, Stream
from kvstrata.storage.base import StorageBackend


@dataclass
class PoolStats:
    """Pool occupancy and the cache's counters: read live (one rank) or sent by rank 0."""

    device_free: int
    device_capacity: int
    host_free: int | None = None
    host_capacity: int | None = None
    counters: CacheCounters | None = None
    running: int = 0
    waiting: int = 0
    spec: SpecStats | None = None  # speculative decoding's counters (None: off)
    storage: StorageCounts | None = None  # the storage backend's trouble counters (None: none)


@dataclass(frozen=True)
class StorageCounts:
    """A storage backend's counters of bad units, read live from its stats()."""

    backend: str  # the URL scheme: file, redis, mooncake, ...
    seal_failures: int  # units that failed their seal (MAC/decryption), read or write path
    corrupt: int  # values whose header or checksum failed (removed)
    rewrites: int  # units written again over a stored one that failed its seal or checksum

    @classmethod
    def of(cls, storage: StorageBackend) -> StorageCounts:
        """The counters of a mover's storage (a UnitStorage: its `backend` names the scheme)."""
        st = storage.stats()
        backend = str(getattr(storage, "backend", "") or "unknown")
        return cls(
            backend,
            int(st.get("seal_failures", 0)),
            int(st.get("corrupt", 0)),
            int(st.get("rewrites", 0)),
        )


def engine_stats(engine: Engine) -> PoolStats:
    """Plain integers of a live engine (safe to read from another thread)."""
    alloc, cache = engine.pool.allocator, engine.cache
    host = cache.tiers.host if cache is not None else None
    spec = None
    if engine.spec is not None:  # a copy: the engine thread goes on counting
        st = engine.spec.stats
        spec = SpecStats(st.steps, st.proposed, st.accepted, list(st.accepted_per_pos))
    storage = getattr(cache.mover, "storage", None) if cache is not None else None
    depths = engine.queue_depths()
    return PoolStats(
        alloc.num_free,
        alloc.capacity,
        host.num_free if host is not None else None,
        host.capacity if host is not None else None,
        cache.counters if cache is not None else None,
        depths.running,
        depths.waiting,
        spec,
        StorageCounts.of(storage) if storage is not None else None,
    )


SOURCES = {"device": "local_device_hit", "host": "local_host_hit", "storage": "storage_hit"}


class ServeMetrics(LoopObserver):
    """Observer of the engine loop that feeds one CollectorRegistry."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.name = model_name
        lbl, reg = ["model_name"], self.registry

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"kvstrata:{name}", doc, lbl, registry=reg, buckets=LATENCY_BUCKETS)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(f"kvstrata:{name}", doc, [*lbl, *extra], registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvstrata:{name}", doc, lbl, registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "HTTP arrival to first token")
        self.itl = hist("inter_token_latency_seconds", "time between two tokens of a request")
        self.e2e = hist("e2e_request_latency_seconds", "HTTP arrival to the last token")
        self.queue = hist("request_queue_time_seconds", "HTTP arrival to admission (pages given)")
        self.queries = counter("prefix_cache_queries", "prompt tokens looked up")
        self.hits = counter("prefix_cache_hits", "prompt tokens found in any tier")
        self.by_source = counter(
            "prompt_tokens_by_source", "prompt tokens by where their KV came from", "source"
        )
        self.generated = counter("generation_tokens", "tokens generated")
        self.finished = counter("request_success", "finished requests", "finished_reason")
        self.running = gauge("num_requests_running", "decoding or prefilling")
        self.waiting = gauge("num_requests_waiting", "waiting for admission")
        self.consensus = Histogram(
            "kvstrata:step_consensus_seconds",
            "one step's cross-rank agreement on cache progress (several ranks)",
            lbl,
            registry=reg,
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
        )
        self.page = 1

    def attach(self, source: Callable[[], PoolStats | None], page_size: int) -> None:
        """Once the engine is up: pool and cache numbers come from `source` at scrape time."""
        self.page = page_size
        self.registry.register(_PoolCollector(source, self.name))

    # ---- LoopObserver ---------------------------------------------------------------------------
    def on_token(self, req: RequestRecord, stream: Stream, now_s: float) -> None:
        if stream.last_token_s is None:
            self.ttft.labels(self.name).observe(now_s - stream.received_s)
        else:
            self.itl.labels(self.name).observe(now_s - stream.last_token_s)
        self.generated.labels(self.name).inc()

    def on_admitted(self, req: RequestRecord, stream: Stream, now_s: float) -> None:
        self.queue.labels(self.name).observe(now_s - stream.received_s)
        cached = {t: n * self.page for t, n in req.hits.items()}
        self.queries.labels(self.name).inc(len(req.tokens))
        self.hits.labels(self.name).inc(sum(cached.values()))
        for tier, source in SOURCES.items():
            self.by_source.labels(self.name, source).inc(cached[tier])
        self.by_source.labels(self.name, "computed").inc(len(req.tokens) - sum(cached.values()))

    def on_finished(self, req: RequestRecord, stream: Stream, now_s: float) -> None:
        self.e2e.labels(self.name).observe(now_s - stream.received_s)
        self.finished.labels(self.name, req.finish_reason or "abort").inc()

    def on_stats(self, stats: PoolStats, consensus_s: list[float]) -> None:
        """The step loop's report (every iteration on one rank, periodic from rank 0 under
        several): gauges and agreement latencies."""
        self.running.labels(self.name).set(stats.running)
        self.waiting.labels(self.name).set(stats.waiting)
        for x in consensus_s:
            self.consensus.labels(self.name).observe(x)


class _PoolCollector(Collector):
    """Pool usage and the cache's monotone counters, from a PoolStats source."""

    def __init__(self, source: Callable[[], PoolStats | None], model_name: str) -> None:
        self.source, self.name = source, model_name

    def collect(self) -> Iterator[Metric]:
        st = self.source()
        if st is None:
            return
        usage = GaugeMetricFamily(
            "kvstrata:kv_cache_usage_perc",
            "fraction of a pool's pages in use",
            labels=["model_name", "pool"],
        )
        usage.add_metric([self.name, "device"], 1 - st.device_free / st.device_capacity)
        if st.host_free is not None and st.host_capacity:
            usage.add_metric([self.name, "host"], 1 - st.host_free / st.host_capacity)
        yield usage
        if st.counters is not None:
            yield from self._counters(st.counters)
        if st.spec is not None:
            yield from self._spec(st.spec)
        if st.storage is not None:
            yield from self._storage(st.storage)

    def _storage(self, s: StorageCounts) -> Iterator[Metric]:
        lbl = ["model_name", "backend"]
        for name, doc, value in (
            ("storage_seal_failures", "stored units that failed their seal (MAC)", s.seal_failures),
            ("storage_corrupt_units", "stored values whose checksum failed (removed)", s.corrupt),
            ("storage_unit_rewrites", "units rewritten over a stored unit that failed", s.rewrites),
        ):
            fam = CounterMetricFamily(f"kvstrata:{name}", doc, labels=lbl)
            fam.add_metric([self.name, s.backend], value)
            yield fam

    def _spec(self, s: SpecStats) -> Iterator[Metric]:
        """vLLM's spec_decode_* counters: mean accepted length = 1 + accepted / drafts."""
        lbl = ["model_name"]
        for name, doc, value in (
            ("num_drafts", "verify steps (one draft sequence each)", s.steps),
            ("num_draft_tokens", "tokens the draft proposed", s.proposed),
            ("num_accepted_tokens", "drafted tokens the target accepted", s.accepted),
        ):
            fam = CounterMetricFamily(f"kvstrata:spec_decode_{name}", doc, labels=lbl)
            fam.add_metric([self.name], value)
            yield fam
        per_pos = CounterMetricFamily(
            "kvstrata:spec_decode_num_accepted_tokens_per_pos",
            "verify steps that accepted the draft at this position (0-based)",
            labels=[*lbl, "position"],
        )
        for pos, n in enumerate(s.accepted_per_pos):
            per_pos.add_metric([self.name, str(pos)], n)
        yield per_pos

    def _counters(self, c: CacheCounters) -> Iterator[Metric]:
        moved = CounterMetricFamily(
            "kvstrata:kv_moved_bytes",
            "KV bytes copied between tiers",
            labels=["model_name", "direction"],
        )
        errors = CounterMetricFamily(
            "kvstrata:kv_transfer_failed_pages",
            "pages a copy or storage op failed to move (storage errors included)",
            labels=["model_name", "direction"],
        )
        for direction, nbytes in c.bytes_moved.items():
            moved.add_metric([self.name, direction], nbytes)
            errors.add_metric([self.name, direction], c.failed_pages[direction])
        yield moved
        yield errors
        prefetch = CounterMetricFamily(
            "kvstrata:prefetch", "storage prefetch outcomes", labels=["model_name", "outcome"]
        )
        for outcome, n in c.prefetch.items():
            prefetch.add_metric([self.name, outcome], n)
        yield prefetch
        evicted = CounterMetricFamily(
            "kvstrata:evicted_pages", "pages evicted from a tier", labels=["model_name", "tier"]
        )
        for tier, n in c.evictions.items():
            evicted.add_metric([self.name, tier], n)
        yield evicted
        yield from self._plain(
            (
                "lost_pages",
                "pages whose last cached copy went while storage held none of them",
                c.lost_pages,
            ),
            (
                "prefetch_no_room_pages",
                "pages storage held for a prompt that no reload read for lack of host room",
                c.prefetch_no_room_pages,
            ),
        )
        yield from self._pins(c)

    def _plain(self, *rows: tuple[str, str, int]) -> Iterator[Metric]:
        """One counter family a (name, help, value) row, labelled only by the model."""
        for name, doc, value in rows:
            fam = CounterMetricFamily(f"kvstrata:{name}", doc, labels=["model_name"])
            fam.add_metric([self.name], value)
            yield fam

    def _pins(self, c: CacheCounters) -> Iterator[Metric]:
        """Client pins (cache_control, kv_pin_s): pages kept per tier, and their fates."""
        pinned = GaugeMetricFamily(
            "kvstrata:pinned_pages",
            "pages client pins keep, per tier",
            labels=["model_name", "tier"],
        )
        for tier, n in c.pins.pinned_pages.items():
            pinned.add_metric([self.name, tier], n)
        yield pinned
        p = c.pins
        yield from self._plain(
            ("pins_made", "client pins that took hold", p.made),
            ("pins_renewed", "pins whose TTL a hit or a new hint restarted", p.renewed),
            ("pins_expired", "pins let go at the end of their TTL", p.expired),
            (
                "pins_dropped_for_budget",
                "older pins let go to make room under --pin-budget",
                p.dropped_for_budget,
            ),
            (
                "pins_refused_for_budget",
                "pins larger than the whole --pin-budget",
                p.refused_for_budget,
            ),
        )
