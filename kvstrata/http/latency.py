"""Histogram buckets (seconds) of the request latencies every server exports on /metrics
(`kvstrata serve` and the router), so their histograms line up bucket for bucket."""

from __future__ import annotations

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
