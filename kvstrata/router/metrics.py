"""The router's own Prometheus metrics, `kvstrata:router_*` (the workers keep theirs)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstrata.http.latency import LATENCY_BUCKETS


class RouterMetrics:
    """Requests per worker, worker failures by kind, and latency as the client sees it."""

    def __init__(self, name: str) -> None:
        self.registry = reg = CollectorRegistry()
        self.name = name
        self.requests = Counter(
            "kvstrata:router_requests",
            "completion requests routed, per worker and role",
            ["role", "worker"],
            registry=reg,
        )
        self.upstream_errors = Counter(
            "kvstrata:router_upstream_errors",
            "workers that could not be reached, timed out or cut a stream, by error kind",
            ["role", "worker", "kind"],
            registry=reg,
        )
        self.handoff_retries = Counter(
            "kvstrata:router_handoff_retries",
            "requests tried once more after a failed hand-off with a prefill worker (its info "
            "read again), by that worker and whether the retry went to it or another",
            ["worker", "to"],
            registry=reg,
        )
        self.responses = Counter(
            "kvstrata:router_whole_responses",
            "non-streamed answers relayed, by the worker's HTTP status",
            ["status"],
            registry=reg,
        )

        def hist(metric: str, doc: str) -> Histogram:
            return Histogram(
                f"kvstrata:router_{metric}", doc, registry=reg, buckets=LATENCY_BUCKETS
            )

        self.ttft = hist("time_to_first_chunk_seconds", "arrival to the first relayed SSE bytes")
        self.e2e = hist("e2e_request_latency_seconds", "arrival to the end of the relayed answer")

    def observe_whole(self, status: int, seconds: float) -> None:
        self.responses.labels(status=str(status)).inc()
        if status == 200:
            self.e2e.observe(seconds)


class FleetMetrics:
    """A fleet router's own series (beside RouterMetrics' requests per worker and latencies)."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.reg = reg
        self._request_series()
        self._stream_series()

    def counter(self, name: str, doc: str, labels: list[str]) -> Counter:
        return Counter(f"kvstrata:router_{name}", doc, labels, registry=self.reg)

    def gauge(self, name: str, doc: str, labels: list[str]) -> Gauge:
        return Gauge(f"kvstrata:router_{name}", doc, labels, registry=self.reg)

    def _request_series(self) -> None:
        """What each request was predicted, reported and routed by."""
        counter = self.counter
        self.predictions = counter(
            "cached_tokens_predictions",
            "answered requests by whether the cached_tokens the router predicted for the replica "
            "it chose equal what the replica reported (outcome: equal | unequal)",
            ["outcome"],
        )
        self.predicted_tokens = counter(
            "predicted_cached_tokens", "cached tokens the router predicted, summed", []
        )
        self.reported_tokens = counter(
            "reported_cached_tokens", "cached tokens the replicas reported (usage), summed", []
        )
        self.retries = counter(
            "replica_retries",
            "requests sent to another replica after one refused the connection (nothing started)",
            ["replica"],
        )
        self.decisions = counter(
            "routing_decisions",
            "requests routed, by why the replica was chosen: prefix (held pages), session (no "
            "prefix: the session's hash), load (no prefix, no session), round_robin",
            ["reason"],
        )

    def _stream_series(self) -> None:
        """The routing set, the index, the event streams and the background loops."""
        counter, gauge = self.counter, self.gauge
        self.index_pages = gauge(
            "index_pages", "pages in the router's index per medium, over every replica", ["medium"]
        )
        self.replicas_up = gauge("replicas_up", "replicas in the routing set", [])
        self.load = gauge(
            "replica_load", "running + waiting requests per replica, as last polled", ["replica"]
        )
        self.event_lag = gauge(
            "event_lag_seconds",
            "per replica: time from its last applied KV event batch's timestamp to its arrival",
            ["replica"],
        )
        self.events_applied = counter(
            "event_batches", "KV event batches applied to the index, per replica", ["replica"]
        )
        self.event_gaps = counter(
            "event_gaps",
            "sequence gaps in a replica's stream (filled from its replay)",
            ["replica"],
        )
        self.event_replays = counter(
            "event_replays", "replays asked of a replica's replay socket", ["replica"]
        )
        self.index_whole = gauge(
            "index_whole",
            "per replica: 1 when its index entries are whole, 0 while a failed replay is retried "
            "(its holdings then count as none)",
            ["replica"],
        )
        self.event_resets = counter(
            "event_resets",
            "a replica's entries rebuilt from scratch (its publisher restarted)",
            ["replica"],
        )
        self.event_failures = counter(
            "event_failures",
            "event messages or replays that failed (skipped; the stream goes on), by error kind",
            ["replica", "kind"],
        )
        self.indexer_failures = counter(
            "indexer_failures",
            "--kv-indexer-url queries that failed (the router's own index answered), by kind",
            ["kind"],
        )
        self.health_failures = counter(
            "health_failures",
            "health-loop rounds on a replica that raised, by kind",
            ["replica", "kind"],
        )
