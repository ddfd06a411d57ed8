"""edged on many nodes: nodes join a Ray cluster, clients place sandboxes by free capacity.

>>> from edged.cluster import ClusterClient                  # doctest: +SKIP
>>> cluster = ClusterClient("head:6379")                       # doctest: +SKIP
>>> sbx = cluster.create(image="py:3.11")                      # doctest: +SKIP

- ``edged cluster join --ray-address ADDR --socket SOCK`` (:mod:`edged.cluster.join`) puts a
  node's relay actor (:mod:`edged.cluster.node`, :mod:`edged.cluster.actors`) on its Ray node;
  it reports the node to the registry (:mod:`edged.cluster.registry`) and relays calls.
- :class:`ClusterClient` / :class:`AsyncClusterClient` place creates by power of k choices
  (:mod:`edged.cluster.placement`) and hand back :class:`edged.client.Sandbox`-like handles
  whose ids name their node (:mod:`edged.cluster.ids`).

Needs Ray (``pip install 'edged[cluster]'``); the names here are imported when first used, so
``import edged.cluster`` alone does not import Ray. :mod:`edged.client` never imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.cluster.async_client import AsyncClusterClient, AsyncClusterSandbox
    from edged.cluster.client import LOCAL, ClusterClient, ClusterSandbox
    from edged.cluster.errors import ClusterError, NodeUnavailableError, SandboxLostError

_WHERE = {
    "ClusterClient": "edged.cluster.client",
    "ClusterSandbox": "edged.cluster.client",
    "LOCAL": "edged.cluster.client",
    "AsyncClusterClient": "edged.cluster.async_client",
    "AsyncClusterSandbox": "edged.cluster.async_client",
    "ClusterError": "edged.cluster.errors",
    "NodeUnavailableError": "edged.cluster.errors",
    "SandboxLostError": "edged.cluster.errors",
}

__all__ = ["LOCAL", "AsyncClusterClient", "AsyncClusterSandbox", "ClusterClient", "ClusterError",
           "ClusterSandbox", "NodeUnavailableError", "SandboxLostError"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'edged.cluster' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name == "ray":
            raise ImportError("edged.cluster needs Ray: pip install 'edged[cluster]'") from e
        raise
