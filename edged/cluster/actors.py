"""The Ray actors of an edged cluster: one registry, and one relay per node.

- ``edged-registry`` (namespace ``edged``): :class:`~edged.cluster.registry.Registry` in a
  detached actor, created by the first node that joins (``get_if_exists``), restarted by Ray
  wherever it can be if its node dies (it rebuilds its view from the next reports).
- ``edged-node:<name>``: the node's :class:`~edged.cluster.node.NodeAgent` in a detached,
  async actor pinned to the Ray node it joined from (``NodeAffinitySchedulingStrategy``,
  not soft: it talks to a Unix socket on that host, so it may run nowhere else), restarted
  there by Ray if its process dies. Calls are never retried by Ray (``max_task_retries=0``):
  a create retried behind the client's back could make two sandboxes.

Both take no CPU (``num_cpus=0``): they must not compete with a trainer's tasks for slots.
This module imports Ray; nothing else of edged does at import time.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from edged.cluster import wire
from edged.cluster.node import NodeAgent
from edged.cluster.registry import Registry

NAMESPACE = "edged"
REGISTRY = "edged-registry"
#: items of a relayed stream Ray may hold ahead of a slow reader
STREAM_BACKLOG = 64
#: calls a relay runs at once (every exec stream of its node's sandboxes is one)
MAX_CONCURRENCY = 10000

log = logging.getLogger("edged.cluster")


def node_actor_name(node: str) -> str:
    """The Ray name of node ``node``'s relay actor."""
    return f"edged-node:{node}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class RegistryActor:
    """The cluster's registry (:class:`~edged.cluster.registry.Registry`); calls run one at
    a time."""

    def __init__(self, dead_after_s: float = 5.0) -> None:
        self.r = Registry(dead_after_s)

    def report(self, r: Mapping[str, Any]) -> dict[str, Any]:
        return self.r.report(r)

    def leave(self, name: str, agent: str | None = None) -> bool:
        return self.r.leave(name, agent)

    def nodes(self) -> list[dict[str, Any]]:
        return self.r.nodes()

    def lost(self, node: str | None = None) -> dict[str, dict[str, Any]]:
        return self.r.lost(node)

    def locate(self, sandbox_id: str) -> dict[str, Any] | None:
        return self.r.locate(sandbox_id)

    def epoch(self) -> str:
        return self.r.epoch


def registry(namespace: str = NAMESPACE, *, create: bool = False,
             dead_after_s: float = 5.0) -> Any:
    """The registry actor's handle; with ``create``, made if there is none yet. Raises
    ``ValueError`` (Ray's) if there is none and ``create`` is false."""
    if not create:
        return ray.get_actor(REGISTRY, namespace=namespace)
    return RegistryActor.options(  # type: ignore[attr-defined]
        name=REGISTRY, namespace=namespace, lifetime="detached",
        get_if_exists=True).remote(dead_after_s)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class NodeActor:
    """Node ``name``'s relay (:class:`~edged.cluster.node.NodeAgent`) for the daemon on
    ``socket``. It starts reporting at its first call (after a restart too: the join
    process pings it). ``http_port``: its HTTP relay's port on this Ray node's IP address
    (0: any free one; None: no HTTP relay)."""

    def __init__(self, name: str, socket: str, labels: Mapping[str, str],
                 report_interval_s: float, list_every: int, namespace: str,
                 dead_after_s: float, http_port: int | None = 0) -> None:
        self.name = name
        self.namespace = namespace
        self.dead_after_s = dead_after_s
        self._registry: Any = None
        self.agent = NodeAgent(name, socket, self._send, labels=labels,
                               report_interval_s=report_interval_s, list_every=list_every,
                               ray_node_id=ray.get_runtime_context().get_node_id(),
                               http_host=None if http_port is None
                               else ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
                               http_port=http_port or 0)

    async def _send(self, report: dict[str, Any]) -> Mapping[str, Any]:
        if self._registry is None:
            self._registry = registry(self.namespace, create=True,
                                      dead_after_s=self.dead_after_s)
        try:
            ack: Mapping[str, Any] = await self._registry.report.remote(report)
        except ray.exceptions.RayError:
            self._registry = None  # gone for good: made again at the next report
            raise
        return ack

    def _up(self) -> NodeAgent:
        self.agent.start()
        return self.agent

    async def start(self) -> dict[str, Any]:
        """Serve the HTTP relay, report once now (the daemon's answer in it) and keep
        reporting."""
        await self.agent.serve_http()
        await self.agent.report_once()
        self._up()
        return dict(self.agent.last)

    def ping(self) -> dict[str, Any]:
        """Who this relay is and how its last report went."""
        a = self._up()
        return {"name": a.name, "socket": a.socket, "ray_node_id": a.ray_node_id,
                "http_url": a.http.url, "http_calls": a.http.calls, "pid": os.getpid(),
                "agent": a.agent, "seq": a.seq, "daemon_up": a.daemon_up,
                "error": a.last.get("error")}

    async def leave(self) -> bool:
        """Stop reporting and tell the registry this node left."""
        await self.agent.stop()
        reg = self._registry or registry(self.namespace, create=True,
                                         dead_after_s=self.dead_after_s)
        left: bool = await reg.leave.remote(self.name, self.agent.agent)
        return left

    async def call(self, method: str, path: str, payload: Any = None) -> wire.Result:
        return await self._up().call(method, path, payload)

    async def stream(self, method: str, path: str,
                     payload: Any = None) -> AsyncIterator[wire.Result]:
        async for item in self._up().stream(method, path, payload):
            yield item

    async def download(self, path: str) -> AsyncIterator[wire.Result]:
        async for item in self._up().download(path):
            yield item

    async def upload(self, path: str, data: bytes) -> wire.Result:
        return await self._up().upload(path, data)

    async def upload_open(self, path: str) -> wire.Result:
        return await self._up().upload_open(path)

    async def upload_chunk(self, token: str, data: bytes) -> wire.Result:
        return await self._up().upload_chunk(token, data)

    async def upload_close(self, token: str) -> wire.Result:
        return await self._up().upload_close(token)

    async def upload_abort(self, token: str) -> None:
        await self._up().upload_abort(token)


def node_actor(node: str, namespace: str = NAMESPACE) -> Any:
    """The handle of node ``node``'s relay. Raises ``ValueError`` (Ray's) if there is none."""
    return ray.get_actor(node_actor_name(node), namespace=namespace)


def start_node_actor(name: str, socket: str, *, labels: Mapping[str, str],
                     report_interval_s: float, list_every: int, namespace: str,
                     dead_after_s: float, ray_node_id: str, http_port: int | None = 0) -> Any:
    """Node ``name``'s relay pinned to Ray node ``ray_node_id`` (the one already running
    under that name if there is one), serving its HTTP relay on ``http_port`` (see
    :class:`NodeActor`)."""
    return NodeActor.options(  # type: ignore[attr-defined]
        name=node_actor_name(name), namespace=namespace, lifetime="detached",
        get_if_exists=True, max_concurrency=MAX_CONCURRENCY,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ray_node_id, soft=False),
    ).remote(name, socket, dict(labels), report_interval_s, list_every, namespace,
             dead_after_s, http_port)


def connect(address: str | None, namespace: str = NAMESPACE,
            node_ip_address: str | None = None) -> bool:
    """Connect this process to the Ray cluster at ``address`` (None: ``$RAY_ADDRESS``, else
    the one this host runs) unless it is connected already (code in a Ray task or actor, or
    a trainer that called ``ray.init``); returns whether this call connected it (and so
    should disconnect it). The process's SIGTERM handler is left as it was (``ray.init``
    replaces it with one that exits)."""
    if ray.is_initialized():
        return False
    # never start a Ray of our own: "auto" finds the one running on this host, or fails
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    kw: dict[str, Any] = {}
    if node_ip_address:
        kw["_node_ip_address"] = node_ip_address
    main = threading.current_thread() is threading.main_thread()
    old = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(address=address, namespace=namespace, log_to_driver=False,
             logging_level=logging.WARNING, **kw)
    if main:  # ray.init makes SIGTERM exit at once: the caller's handling is given back
        signal.signal(signal.SIGTERM, old)
    return True
