"""Remotes: where a node gets layers from and where ``layerfs push`` sends them.

:class:`~layerfs.remote.base.Remote` is the interface; :func:`open_remote` picks the kind
from a URL (a chunk server over HTTP or a unix socket, or a shared directory);
:mod:`layerfs.remote.server` is the chunk server and :func:`push` copies a layer to a
remote.
"""

from layerfs.remote.base import PushRejectedError, Remote, RemoteError
from layerfs.remote.connect import open_remote
from layerfs.remote.push import PushResult, push

__all__ = ["PushRejectedError", "PushResult", "Remote", "RemoteError", "open_remote", "push"]
