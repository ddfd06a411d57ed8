"""The store's defaults, in a module of their own so that the CLI can build its parser
(whose help names them) without importing the store (zstandard, a thread pool):
start-up time of every ``layerfs`` command. :mod:`layerfs.store` re-exports them."""

from __future__ import annotations

import os

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_LEVEL", "DEFAULT_ROOT", "default_root"]

DEFAULT_ROOT = "/var/lib/edged/layers"
DEFAULT_CHUNK_SIZE = 256 << 10
"""Chunk size of layers (bytes), chosen from bench/bench_lazy_coldstart.py (README): a cold
``import numpy`` from a 1.3 GB image fetched 3.0% / 3.7% / 4.6% / 5.9% of it at 128 KiB /
256 KiB / 512 KiB / 1 MiB chunks, in 313 / 195 / 120 / 77 requests, with 1079 / 540 /
272 / 136 KiB of manifests. 1 MiB misses the 5% goal; 256 KiB stays well under it, and
its cold pytest start was the quickest (128 KiB's extra requests cost more than its
smaller over-fetch saves), at half 128 KiB's requests and manifest bytes."""
DEFAULT_LEVEL = 3


def default_root() -> str:
    """The store root: ``$LAYERFS_STORE`` if set, else ``/var/lib/edged/layers``."""
    return os.environ.get("LAYERFS_STORE") or DEFAULT_ROOT
