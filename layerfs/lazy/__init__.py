"""On-demand layer loading on a node.

A layer's EROFS image is exposed as a file on one FUSE mount per node (the C file server
in csrc/lib/lazy.c) and mounted file-backed by the kernel; only the chunks that are read
are fetched from the remote, once, verified, and cached. :mod:`layerfs.lazy.server` is the
server process, :mod:`layerfs.lazy.supervisor` keeps its FUSE connection across restarts,
:mod:`layerfs.lazy.client` talks to it and :mod:`layerfs.lazy.cache` owns the cache
directory.
"""
