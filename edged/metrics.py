"""Prometheus metrics of one daemon (served at ``GET /metrics``).

Each :class:`Metrics` owns its own ``CollectorRegistry`` (no module-level global registry), so
two daemons in one process — as in tests — do not collide.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The daemon's counters, gauges and histograms (seconds, bytes)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.creates = Counter(
            "edged_sandbox_creates", "Sandbox create requests by result", ["result"], registry=r
        )
        self.create_seconds = Histogram(
            "edged_sandbox_create_seconds", "Create→ready latency", buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.destroys = Counter(
            "edged_sandbox_destroys", "Sandboxes stopped, by cause", ["cause"], registry=r
        )
        self.sandboxes = Gauge("edged_sandboxes", "Sandboxes by state", ["state"], registry=r)
        self.execs = Counter("edged_execs", "Execs finished, by end reason", ["reason"],
                             registry=r)
        self.exec_seconds = Histogram(
            "edged_exec_seconds", "Exec wall time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.allocated_cpus = Gauge("edged_allocated_cpus", "Cores promised", registry=r)
        self.allocated_memory = Gauge(
            "edged_allocated_memory_bytes", "Memory promised", registry=r
        )
        self.layer_mounts = Gauge("edged_layer_mounts", "Layers mounted on the node", registry=r)
        self.layers_available = Gauge(
            "edged_layers_available", "1 while the layer service serves layers (else creates "
            "are refused with layers_unavailable)", registry=r)
        self.layers_available.set(1)
        self.layer_service_restarts = Counter(
            "edged_layer_service_restarts", "Restarts of the layer service, by result",
            ["result"], registry=r)
        # A start: from create to the end of the sandbox's first exec. What the node fetched
        # of the sandbox's layers meanwhile, whoever read it (starts that overlap on shared
        # layers each count the other's fetches; the first start of an image pays for all).
        self.start_fetched_fraction = Histogram(
            "edged_sandbox_start_fetched_fraction",
            "Bytes of its layers fetched during a sandbox start / their size",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r,
        )
        self.start_fetched_bytes = Counter(
            "edged_sandbox_start_fetched_bytes", "Bytes of layers fetched during sandbox starts",
            registry=r,
        )
        self.start_hit_ratio = Histogram(
            "edged_sandbox_start_chunk_hit_ratio",
            "Reads of its layers answered at once from the node cache during a sandbox start "
            "/ all such reads",
            buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0), registry=r,
        )
        self.start_fetch_wait_seconds = Histogram(
            "edged_sandbox_start_fetch_wait_seconds",
            "Seconds reads of its layers waited for chunks during a sandbox start, summed",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.api_errors = Counter("edged_api_errors", "API errors by code", ["code"], registry=r)
        # Density: reclaim of idle sandboxes (edged.node.reclaim)
        self.reclaimed_bytes = Counter(
            "edged_reclaimed_bytes", "Bytes of sandbox memory paged out to swap by reclaim",
            registry=r)
        self.wake_seconds = Histogram(
            "edged_sandbox_wake_seconds",
            "First exec on a reclaimed sandbox: request to the program running",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.resume_seconds = Histogram(
            "edged_sandbox_resume_seconds", "Resume of a paused sandbox (prefetch and thaw)",
            buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
