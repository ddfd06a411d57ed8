"""Prometheus view of a node's lazy layer server, for the daemon's ``/metrics``.

``registry.register(LazyCollector(LazyClient(cache)))``: every scrape asks the server for
its stats (one request on the control socket) and yields, labelled by layer digest:

- ``layerfs_lazy_layer_bytes`` (gauge): layer size;
- ``layerfs_lazy_fetched_bytes_total``, ``layerfs_lazy_fetched_chunks_total``;
- ``layerfs_lazy_fraction_fetched`` (gauge): bytes fetched / layer size;
- ``layerfs_lazy_reads_total``, ``layerfs_lazy_read_hits_total`` (answered from the cache
  at once), ``layerfs_lazy_hit_ratio`` (gauge);
- ``layerfs_lazy_inflight_chunks`` (gauge), ``layerfs_lazy_failed_fetches_total``,
  ``layerfs_lazy_corrupt_chunks_total``;
- ``layerfs_lazy_fetch_seconds`` (histogram): one remote fetch;

and ``layerfs_lazy_cache_bytes`` (gauge). A server that does not answer yields nothing
but ``layerfs_lazy_up 0``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from layerfs.lazy.client import LazyClient, LazyServerError


class LazyCollector:
    """A prometheus-client collector over :meth:`LazyClient.stats`."""

    def __init__(self, client: LazyClient) -> None:
        self.client = client

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("layerfs_lazy_up", "Whether the lazy layer server answered")
        try:
            st = self.client.stats()
        except LazyServerError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        cache = GaugeMetricFamily("layerfs_lazy_cache_bytes", "Bytes of chunks in the cache")
        cache.add_metric([], st["cache"]["bytes"])
        yield cache
        lab = ["layer"]
        fams: dict[str, Any] = {
            "size": GaugeMetricFamily("layerfs_lazy_layer_bytes", "Layer size", labels=lab),
            "bytes_fetched": CounterMetricFamily("layerfs_lazy_fetched_bytes",
                                                 "Bytes fetched from the remote", labels=lab),
            "chunks_fetched": CounterMetricFamily("layerfs_lazy_fetched_chunks",
                                                  "Chunks fetched from the remote",
                                                  labels=lab),
            "fraction_fetched": GaugeMetricFamily("layerfs_lazy_fraction_fetched",
                                                  "Bytes fetched / layer size", labels=lab),
            "reads": CounterMetricFamily("layerfs_lazy_reads", "FUSE reads", labels=lab),
            "hits": CounterMetricFamily("layerfs_lazy_read_hits",
                                        "Reads answered from the cache at once", labels=lab),
            "hit_ratio": GaugeMetricFamily("layerfs_lazy_hit_ratio", "hits / reads",
                                           labels=lab),
            "inflight": GaugeMetricFamily("layerfs_lazy_inflight_chunks",
                                          "Chunks being fetched", labels=lab),
            "failed": CounterMetricFamily("layerfs_lazy_failed_fetches",
                                          "Fetches that failed for good", labels=lab),
            "corrupt": CounterMetricFamily("layerfs_lazy_corrupt_chunks",
                                           "Fetched chunks that did not match their digest",
                                           labels=lab),
        }
        hist = HistogramMetricFamily("layerfs_lazy_fetch_seconds",
                                     "Time of one chunk fetch from the remote", labels=lab)
        for digest, layer in st["layers"].items():
            for key, fam in fams.items():
                fam.add_metric([digest], layer[key])
            lat = layer["fetch_latency"]
            cum, buckets = 0, []
            for bound, n in zip([*lat["buckets"], float("inf")], lat["counts"], strict=True):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else str(bound), cum))
            hist.add_metric([digest], buckets, lat["sum"])
        yield from fams.values()
        yield hist
