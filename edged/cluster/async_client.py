"""The cluster client for asyncio (a trainer's rollout loop): :class:`AsyncClusterClient`,
the same calls as :class:`edged.cluster.ClusterClient`, awaited; its handles are
:class:`edged.client.AsyncSandbox` objects with :attr:`~AsyncClusterSandbox.node`.

Ray calls are awaited (an ``ObjectRef`` is awaitable); the blocking ones (connecting,
looking an actor up by name) run in a thread, so the event loop never waits on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from edged.client import AsyncSandbox
from edged.client._common import create_body_of
from edged.client._http import path_for
from edged.client.async_sandbox import AsyncTransport
from edged.client.errors import NotFoundError, SandboxError
from edged.cluster import actors, ids
from edged.cluster.client import LOCAL, ClientCore, OnNode, relay_answer
from edged.cluster.errors import ClusterError, NodeUnavailableError, SandboxLostError
from edged.cluster.placement import Placer
from edged.cluster.transport import (
    AsyncDirectTransport,
    AsyncHttpRelayTransport,
    AsyncRelayTransport,
)


class AsyncClusterSandbox(OnNode, AsyncSandbox):
    """A sandbox on a node of the cluster (see :class:`edged.cluster.ClusterSandbox`).
    ``close()`` leaves the client's connections open: they are shared."""

    def __init__(self, info: dict[str, Any], transport: AsyncTransport, node: str,
                 placer: Placer | None = None) -> None:
        super().__init__(info, transport)
        self._on(node, placer)

    async def kill(self) -> None:
        """Destroy the sandbox (idempotent; a lost one raises :class:`SandboxLostError`)."""
        await super().kill()
        self._released()


class _AsyncLostTransport(AsyncTransport):
    def __init__(self, error: SandboxLostError) -> None:
        super().__init__("lost:")
        self.error = error

    async def request(self, method: str, path: str, **kw: Any) -> Any:
        raise self.error

    async def json(self, method: str, path: str, payload: Any = None) -> Any:
        raise self.error


class AsyncClusterClient(ClientCore):
    """See :class:`edged.cluster.ClusterClient` (same arguments). Nothing is done until the
    first call (or ``async with``); :meth:`close` disconnects from Ray if this client
    connected."""

    def __init__(self, ray_address: str | None = None, *, namespace: str = actors.NAMESPACE,
                 k: int = 2, max_attempts: int = 3, refresh_s: float = 0.5,
                 direct: bool | None = None, node_ip_address: str | None = None,
                 placer: Placer | None = None, http: bool = True) -> None:
        self.ray_address = ray_address
        self.http = http
        self.namespace = namespace
        self.max_attempts = max_attempts
        self.refresh_s = refresh_s
        self.direct = direct
        self.node_ip_address = node_ip_address
        self.placer = placer or Placer(k)
        self.ray_node_id = ""
        self._owns_ray = False
        self._registry: Any = None
        self._nodes: dict[str, dict[str, Any]] = {}
        self._refreshed = -1e9
        self._refreshing: asyncio.Task[list[dict[str, Any]]] | None = None
        self._routes: dict[str, AsyncTransport] = {}
        self._ready_lock = asyncio.Lock()

    async def _ready(self) -> None:
        if self._registry is not None:
            return
        async with self._ready_lock:
            if self._registry is not None:
                return
            self._owns_ray = await asyncio.to_thread(
                actors.connect, self.ray_address, self.namespace, self.node_ip_address)
            try:
                reg = await asyncio.to_thread(actors.registry, self.namespace)
            except ValueError as e:
                await self.close()
                raise ClusterError(f"no edged node has joined this Ray cluster (namespace "
                                   f"{self.namespace!r}): {e}") from e
            self.ray_node_id = ray.get_runtime_context().get_node_id()
            self._registry = reg
        await self.refresh()

    # -- the nodes --------------------------------------------------------------------------

    async def refresh(self) -> list[dict[str, Any]]:
        """Read the nodes' latest reports (see :meth:`ClusterClient.refresh`)."""
        await self._ready()
        nodes: list[dict[str, Any]] = await self._registry.nodes.remote()
        for v in self._took(nodes):
            t = self._routes.get(v.name)
            if isinstance(t, AsyncHttpRelayTransport):
                await t.set_http(v.http_url, v.http_token)
        return nodes

    async def _fresh(self) -> None:
        await self._ready()
        if not self._stale():
            return
        # one refresh at a time: a burst of creates shares it
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh())
        await asyncio.shield(self._refreshing)

    async def nodes(self) -> list[dict[str, Any]]:
        """See :meth:`ClusterClient.nodes`."""
        return await self.refresh()

    async def lost(self, node: str | None = None) -> dict[str, dict[str, Any]]:
        """See :meth:`ClusterClient.lost`."""
        await self._ready()
        out: dict[str, dict[str, Any]] = await self._registry.lost.remote(node)
        return out

    async def local_node(self) -> str | None:
        """See :meth:`ClusterClient.local_node`."""
        await self._fresh()
        return self._local()

    async def _unreachable(self, node: str, e: BaseException) -> SandboxError:
        try:
            await self.refresh()
        except Exception:
            return NodeUnavailableError(f"node {node}: {e}")
        return self._lost(node, e)

    async def _route(self, node: str) -> AsyncTransport:
        t = self._routes.get(node)
        if t is not None:
            return t
        view = self._view(node)
        sock = self._direct(view)
        if sock is not None:
            t = AsyncDirectTransport(node, sock, self._unreachable)
        else:
            t = AsyncRelayTransport(node, self._lookup(node), self._unreachable)
            if self.http and view.http_url:
                t = AsyncHttpRelayTransport(node, view.http_url, view.http_token, t,
                                            self._unreachable)
        return self._routes.setdefault(node, t)

    async def _create_on(self, t: AsyncTransport, body: dict[str, Any]
                         ) -> tuple[dict[str, Any] | None, SandboxError | None, float | None]:
        if isinstance(t, AsyncRelayTransport):
            try:
                return relay_answer(await t.result("POST", path_for("sandboxes"), body))
            except SandboxError as e:
                return None, e, None
        try:
            return await t.json("POST", path_for("sandboxes"), body), None, None
        except SandboxError as e:
            return self._refused(getattr(t, "node", ""), e,
                                 isinstance(t, AsyncDirectTransport))

    # -- sandboxes --------------------------------------------------------------------------

    async def create(self, image: str | None = None, layers: Sequence[str] | None = None, *,
                     id: str | None = None, cpus: float | None = None,
                     memory_bytes: int | None = None, pids: int | None = None,
                     disk_bytes: int | None = None, env: Mapping[str, str] | None = None,
                     timeout: float | None = None, idle_timeout: float | None = None,
                     labels: Mapping[str, str] | None = None,
                     task_profile: str | None = None, seccomp_profile: str | None = None,
                     memory_request_bytes: int | None = None, qos: str | None = None,
                     auto_pause_after: float | None = None, network: Any = None,
                     backend: str | None = None,
                     template: str | None = None, envs: Mapping[str, str] | None = None,
                     cpu: float | None = None, memory_mib: int | None = None,
                     node_labels: Mapping[str, str] | None = None,
                     node: str | None = None) -> AsyncClusterSandbox:
        """See :meth:`ClusterClient.create`."""
        args = dict(locals())  # the create's own arguments (create_body_of)
        await self._fresh()
        if node == LOCAL:
            node = await self.local_node()
            if node is None:
                raise self._no_local()
        plan = self._plan(id, backend, node_labels, node)
        for step in plan.attempts():
            if step is None:  # no node with room by the reports: read them once more
                await self.refresh()
                continue
            t, sid = step
            try:
                route = await self._route(t.node)
                info, e, at = await self._create_on(route, create_body_of(args, id=sid))
            except BaseException as x:
                plan.crashed(t, x)
                continue
            if (made := plan.answered(t, info, e, at)) is not None:
                return AsyncClusterSandbox(made, route, t.node, self.placer)
        raise plan.error()

    async def connect(self, sandbox_id: str) -> AsyncClusterSandbox:
        """See :meth:`ClusterClient.connect`."""
        await self._ready()
        node = ids.node_of(sandbox_id)
        if node is None:
            where = await self._registry.locate.remote(sandbox_id)
            if where is None:
                raise NotFoundError(f"sandbox {sandbox_id}: no node of the cluster lists it",
                                    status=404)
            node = str(where["node"])
        await self._fresh()
        self._up(node)
        t = await self._route(node)
        return AsyncClusterSandbox(await t.json("GET", path_for("sandboxes", sandbox_id)),
                                   t, node, self.placer)

    async def list(self, labels: Mapping[str, str] | None = None, *,
                   lost: bool = True) -> list[AsyncClusterSandbox]:
        """See :meth:`ClusterClient.list`."""
        await self.refresh()
        path = self._listing(labels)

        async def one(name: str) -> list[AsyncClusterSandbox]:
            try:
                t = await self._route(name)
                got = await t.json("GET", path)
            except (SandboxLostError, NodeUnavailableError):
                return []
            return [AsyncClusterSandbox(s, t, name, self.placer) for s in got["sandboxes"]]

        up = sorted(n for n, d in self._nodes.items() if d["state"] == "up")
        out = [s for part in await asyncio.gather(*(one(n) for n in up)) for s in part]
        if lost and not labels:
            out += [AsyncClusterSandbox(info, _AsyncLostTransport(err), node)
                    for info, err, node in self._lost_handles(await self.lost())]
        return out

    # -- the client -------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the direct connections; disconnect from Ray if this client connected."""
        for t in self._routes.values():
            if isinstance(t, AsyncDirectTransport | AsyncHttpRelayTransport):
                await t.aclose()
        self._routes.clear()
        if self._owns_ray and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)
        self._owns_ray = False
        self._registry = None

    async def __aenter__(self) -> AsyncClusterClient:
        await self._ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
