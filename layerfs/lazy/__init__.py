"""On-demand layer loading on a node.

A layer's EROFS image is exposed as a file on one FUSE mount per node (the C file server
in csrc/lib/lazy.c) and mounted file-backed by the kernel; only the chunks that are read
are fetched from the remote, once, verified, and cached. :mod:`layerfs.lazy.server` is the
server process, :mod:`layerfs.lazy.supervisor` keeps its FUSE connection across restarts,
:mod:`layerfs.lazy.client` talks to it and :mod:`layerfs.lazy.cache` owns the cache
directory.
"""

from __future__ import annotations

import os

DEFAULT_CACHE = "/var/cache/layerfs"


def default_cache() -> str:
    """The node cache directory: ``$LAYERFS_CACHE`` or ``/var/cache/layerfs``. (Here,
    not in :mod:`layerfs.lazy.client`, so the CLI's parser can name it cheaply.)"""
    return os.environ.get("LAYERFS_CACHE") or DEFAULT_CACHE
