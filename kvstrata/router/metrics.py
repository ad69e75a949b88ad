"""The router's own Prometheus metrics, `kvstrata:router_*` (the workers keep theirs)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstrata.serve.metrics import LATENCY_BUCKETS


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
