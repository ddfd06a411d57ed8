"""The cluster client: sandboxes on many edged nodes joined to one Ray cluster.

>>> from edged.cluster import ClusterClient
>>> with ClusterClient("10.0.0.1:6379") as cluster:                     # doctest: +SKIP
...     sbx = cluster.create(image="py:3.11", cpus=1)
...     sbx.node, sbx.exec("python3 -c 'print(1)'").stdout
('node-07', '1\\n')

A handle (:class:`ClusterSandbox`) is an :class:`edged.client.Sandbox` whose calls go to its
node: through the node's relay actor, or straight to the daemon's Unix socket when this
process runs on that node's host (a Ray task or actor there, or a trainer started there:
no extra hop). Its id names its node (:mod:`edged.cluster.ids`), so :meth:`ClusterClient.connect`
finds it from any client, a new one after a restart included. Placement:
:mod:`edged.cluster.placement`. What happens when a node dies: :class:`SandboxLostError`.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ray

from edged.client import Sandbox
from edged.client._common import create_body_of
from edged.client._http import Transport, path_for
from edged.client.errors import (
    CapacityExhaustedError,
    DaemonUnavailableError,
    LayersUnavailableError,
    NotFoundError,
    SandboxError,
)
from edged.cluster import actors, ids, wire
from edged.cluster.errors import ClusterError, NodeUnavailableError, SandboxLostError
from edged.cluster.placement import Constraints, NodeView, Placer, Ticket
from edged.cluster.transport import DirectTransport, HttpRelayTransport, RelayTransport

#: the node constraint meaning "the node this process runs on"
LOCAL = "local"
#: errors after which a create tries another node: the node could not take it now
RETRYABLE: tuple[type[SandboxError], ...] = (
    CapacityExhaustedError, LayersUnavailableError, DaemonUnavailableError, SandboxLostError)


class CreatePlan:
    """The attempts of one create, without I/O (shared by the sync and async clients): up
    to ``max_attempts`` nodes, each chosen by ``placer`` among those not tried yet; a
    refusal (:data:`RETRYABLE`) moves on, any other error ends it."""

    def __init__(self, placer: Placer, want: Constraints, max_attempts: int,
                 name: str | None, retry_after: float) -> None:
        self.placer = placer
        self.want = want
        self.max_attempts = max_attempts
        self.name = name
        self.retry_after = retry_after
        self.tried: list[str] = []
        self.errors: list[SandboxError] = []

    def next(self) -> tuple[Ticket, str] | None:
        """The next node to try and the sandbox id there, or None (see :meth:`error`)."""
        if len(self.tried) >= self.max_attempts:
            return None
        t = self.placer.place(self.want, exclude=self.tried)
        if t is None:
            return None
        self.tried.append(t.node)
        try:
            t.sandbox_id = ids.make_id(t.node, self.name)
        except BaseException:
            self.placer.failed(t)
            raise
        return t, t.sandbox_id

    def failed(self, t: Ticket, e: SandboxError, at: float | None) -> bool:
        """Attempt ``t`` failed with ``e`` (at node time ``at``); whether to go on."""
        self.placer.failed(t, at if isinstance(e, CapacityExhaustedError) else None)
        self.errors.append(e)
        return isinstance(e, RETRYABLE)

    def placed(self, t: Ticket, info: Mapping[str, Any]) -> None:
        """Attempt ``t`` made the sandbox ``info``."""
        self.placer.placed(t, float(info.get("created_at") or time.time()))

    def attempts(self) -> Iterator[tuple[Ticket, str] | None]:
        """The loop of the sync and async clients' create: the attempts (:meth:`next`) and,
        once, None where no node has room by the reports, for the caller to read them again
        (``refresh``) before the next. After the last, raise :meth:`error`."""
        again = True
        while (step := self.next()) is not None or (again and not self.tried):
            if step is None:
                again = False
            yield step

    def crashed(self, t: Ticket, x: BaseException) -> None:
        """Attempt ``t`` raised ``x`` (in the call, not as the node's answer): returns where
        another node may take the sandbox, else re-raises ``x``."""
        if isinstance(x, SandboxError) and self.failed(t, x, None):
            return
        self.placer.failed(t)
        raise x

    def answered(self, t: Ticket, info: dict[str, Any] | None, e: SandboxError | None,
                 at: float | None) -> dict[str, Any] | None:
        """The node of attempt ``t`` made the sandbox ``info`` (returned), or answered ``e``
        (at its time ``at``): None where another node may take the sandbox, else raises
        ``e``."""
        if info is not None:
            self.placed(t, info)
            return info
        assert e is not None
        if not self.failed(t, e, at):
            raise e
        return None

    def error(self) -> SandboxError:
        """Why no attempt succeeded."""
        if self.errors:
            e = self.errors[-1]
            if len(self.errors) > 1:
                e.message = (f"{e.message} (after {len(self.errors)} nodes refused: "
                             f"{', '.join(self.tried)})")
                e.args = (e.message,)
            return e
        views = [v for v in self.placer.views() if self.want.allows(v)]
        if not any(v.state == "up" for v in views):
            have = ", ".join(f"{v.name} ({v.state})" for v in self.placer.views()) or "none"
            return ClusterError(f"no node is up that meets {self._want()} (nodes: {have})")
        return CapacityExhaustedError(
            f"capacity exhausted: no node that meets {self._want()} has room (by the last "
            f"reports)", status=503, retry_after=self.retry_after)

    def _want(self) -> str:
        w = self.want
        parts = [f"node={w.node}"] if w.node else []
        parts += [f"backend={w.backend}"] if w.backend else []
        parts += [f"label {k}={v}" for k, v in w.labels.items()]
        return " ".join(parts) or "no constraint"


def lost_error(node: Mapping[str, Any] | None, name: str, e: BaseException) -> SandboxError:
    """What a failure to reach node ``name`` means, given the registry's node object
    ``node``: its sandboxes are lost if it is not up, else it is unavailable for now."""
    if node is not None and node["state"] != "up":
        cause = node.get("cause") or node["state"]
        return SandboxLostError(f"node {name} is {node['state']}: {cause}", node=name,
                                cause=cause)
    if node is None:
        return SandboxLostError(f"node {name}: not in the cluster", node=name,
                                cause="unknown node")
    return NodeUnavailableError(f"node {name}: {e}")


def refused_at(node: str, nodes: Mapping[str, Mapping[str, Any]], direct: bool) -> float:
    """When (node clock) a create on ``node`` was refused, for the placement's overlay:
    now on the ``direct`` route (this host's clock is the node's); over an HTTP relay, just
    after the node's last report (its clock is not this host's: the node counts as full
    until its next report)."""
    taken = nodes.get(node, {}).get("taken_at")
    if direct or taken is None:
        return time.time()
    return float(taken) + 1e-6


def direct_socket(view: NodeView, ray_node_id: str, direct: bool | None) -> str | None:
    """The daemon socket to use for ``view`` instead of its relay: only on its own Ray node,
    and only where this process may open it; None to go through the relay."""
    if direct is False or not view.socket or view.ray_node_id != ray_node_id:
        return None
    return view.socket if os.access(view.socket, os.R_OK | os.W_OK) else None


class OnNode:
    """What the sync and async cluster handles add to the SDK's: :attr:`node`, and the
    placer told when the sandbox is gone (:meth:`_released`)."""

    id: str

    def _on(self, node: str, placer: Placer | None) -> None:
        self.node = node
        self._placer = placer

    def _released(self) -> None:
        if self._placer is not None:
            self._placer.released(self.node, self.id)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} on {self.node}>"


class ClientCore:
    """What the sync and async cluster clients share, without I/O: the nodes' last reports
    (:meth:`_took`), the node a handle needs (:meth:`_view`, :meth:`_up`), the way to it
    (:meth:`_direct`, :meth:`_lookup`), the create's plan and the lost sandboxes' handles'
    data. Each client does the calls (blocking, or awaited)."""

    namespace: str
    max_attempts: int
    refresh_s: float
    direct: bool | None
    http: bool
    placer: Placer
    ray_node_id: str
    _nodes: dict[str, dict[str, Any]]
    _refreshed: float

    def _took(self, nodes: builtins.list[dict[str, Any]]) -> builtins.list[NodeView]:
        """Keep the registry's ``nodes`` (and tell the placer); returns their views."""
        self._nodes = {n["name"]: n for n in nodes}
        views = [NodeView.from_json(n) for n in nodes]
        self.placer.update(views)
        self._refreshed = time.monotonic()
        return views

    def _stale(self) -> bool:
        return time.monotonic() - self._refreshed > self.refresh_s

    def _local(self) -> str | None:
        """The node on this process's Ray node, by the last reports."""
        return next((n["name"] for n in self._nodes.values()
                     if n["ray_node_id"] == self.ray_node_id), None)

    def _lost(self, node: str, e: BaseException) -> SandboxError:
        return lost_error(self._nodes.get(node), node, e)

    def _view(self, node: str) -> NodeView:
        """The placer's view of ``node``; raises :class:`SandboxLostError` if none."""
        view = next((v for v in self.placer.views() if v.name == node), None)
        if view is None:
            raise lost_error(None, node, KeyError(node))
        return view

    def _up(self, node: str) -> None:
        """Raises what :func:`lost_error` says unless ``node`` is up."""
        n = self._nodes.get(node)
        if n is None or n["state"] != "up":
            raise lost_error(n, node, KeyError(node))

    def _direct(self, view: NodeView) -> str | None:
        return direct_socket(view, self.ray_node_id, self.direct)

    def _lookup(self, node: str) -> Callable[[], Any]:
        """How to find ``node``'s relay actor (again after it died)."""
        return functools.partial(actors.node_actor, node, self.namespace)

    def _plan(self, id: str | None, backend: str | None,
              node_labels: Mapping[str, str] | None, node: str | None) -> CreatePlan:
        return CreatePlan(self.placer, Constraints(backend, dict(node_labels or {}), node),
                          self.max_attempts, id, self.refresh_s)

    def _refused(self, node: str, e: SandboxError, direct: bool
                 ) -> tuple[None, SandboxError, float]:
        """A create's refusal by ``node``'s daemon (reached ``direct``ly or over HTTP)."""
        return None, e, refused_at(node, self._nodes, direct)

    @staticmethod
    def _no_local() -> ClusterError:
        return ClusterError("node='local': no edged node runs on this Ray node")

    @staticmethod
    def _listing(labels: Mapping[str, str] | None) -> str:
        return path_for("sandboxes", query=[("label", f"{k}={v}")
                                            for k, v in (labels or {}).items()])

    @staticmethod
    def _lost_handles(lost: Mapping[str, Mapping[str, Any]]
                      ) -> Iterator[tuple[dict[str, Any], SandboxLostError, str]]:
        """Per sandbox lost with its node (``lost``: the registry's): the handle's info,
        the error its every call raises, its node."""
        for sid, x in sorted(lost.items()):
            err = SandboxLostError(f"sandbox {sid}: {x['cause']}", node=x["node"],
                                   cause=x["cause"])
            yield ({"id": sid, "state": "lost", "node": x["node"], "lost": dict(x),
                    "labels": {}}, err, x["node"])


def relay_answer(r: wire.Result) -> tuple[dict[str, Any] | None, SandboxError | None,
                                          float | None]:
    """A relayed create's answer: (the sandbox, None, None), or (None, the node's refusal,
    when at its clock)."""
    tag, v = r
    return (v, None, None) if tag == "ok" else (None, wire.error_of(v), v.get("at"))


class ClusterSandbox(OnNode, Sandbox):
    """A sandbox on a node of the cluster: the :class:`edged.client.Sandbox` methods
    (``exec`` with output callbacks, ``commands.run``, ``files``, ``pause``, ``resume``,
    ``kill``, ``stats``, ``events`` ...) and :attr:`node`. Calls to a sandbox whose node is
    not up raise :class:`SandboxLostError`."""

    def __init__(self, info: dict[str, Any], transport: Transport, node: str,
                 placer: Placer | None = None) -> None:
        super().__init__(info, transport)
        self._on(node, placer)

    def kill(self) -> None:
        """Destroy the sandbox (idempotent; a lost one raises :class:`SandboxLostError`)."""
        super().kill()
        self._released()


class _LostTransport(Transport):
    """The transport of a lost sandbox's handle: every call raises its error."""

    def __init__(self, error: SandboxLostError) -> None:
        super().__init__("lost:")
        self.error = error

    def open(self, *a: Any, **kw: Any) -> Any:
        raise self.error

    def json(self, *a: Any, **kw: Any) -> Any:
        raise self.error


class ClusterClient(ClientCore):
    """Sandboxes on the edged nodes joined to the Ray cluster at ``ray_address`` (None:
    the Ray this process is connected to already, as in a Ray task or actor, else
    ``$RAY_ADDRESS`` or this host's).

    ``k``: nodes sampled per placement; ``max_attempts``: nodes tried per create before its
    refusal is raised; ``refresh_s``: the nodes' reports are read again when older than
    this; ``direct``: reach daemons on this host through their socket (None: where this
    process may open it; False: always through the relays); ``http``: reach the others
    through their HTTP relays (:mod:`edged.cluster.http_relay`) where they serve one, else
    (and while one cannot be reached) through their relay actors. Thread-safe: many threads may
    create at once (a burst's placements are spread by the in-flight overlay).
    """

    def __init__(self, ray_address: str | None = None, *, namespace: str = actors.NAMESPACE,
                 k: int = 2, max_attempts: int = 3, refresh_s: float = 0.5,
                 direct: bool | None = None, node_ip_address: str | None = None,
                 placer: Placer | None = None, timeout: float | None = 60.0,
                 http: bool = True) -> None:
        self.namespace = namespace
        self.max_attempts = max_attempts
        self.refresh_s = refresh_s
        self.direct = direct
        self.http = http
        self.timeout = timeout
        self._owns_ray = actors.connect(ray_address, namespace, node_ip_address)
        try:
            self._registry = actors.registry(namespace)
        except ValueError as e:
            self.close()
            raise ClusterError(f"no edged node has joined this Ray cluster (namespace "
                               f"{namespace!r}): {e}") from e
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.placer = placer or Placer(k)
        self._nodes: dict[str, dict[str, Any]] = {}
        self._refreshed = -1e9
        self._refresh_lock = threading.Lock()
        self._routes: dict[str, Transport] = {}
        self._routes_lock = threading.Lock()
        self.refresh()

    # -- the nodes --------------------------------------------------------------------------

    def refresh(self) -> list[dict[str, Any]]:
        """Read the nodes' latest reports from the registry (placement decides on them)."""
        nodes: list[dict[str, Any]] = ray.get(self._registry.nodes.remote(),
                                              timeout=self.timeout)
        for v in self._took(nodes):
            t = self._routes.get(v.name)
            if isinstance(t, HttpRelayTransport):
                t.set_http(v.http_url, v.http_token)
        return nodes

    def _fresh(self) -> None:
        if self._stale() and self._refresh_lock.acquire(blocking=False):
            try:
                self.refresh()
            finally:
                self._refresh_lock.release()

    def nodes(self) -> list[dict[str, Any]]:
        """Every node: ``name``, ``state`` (``up``, ``down``, ``dead``, ``left``), ``cause``,
        ``backends``, ``labels``, ``free`` (sandboxes it can still admit), ``held``,
        ``sandboxes`` (known to the registry), ``lost``, ``age_s`` of its last report."""
        return self.refresh()

    def lost(self, node: str | None = None) -> dict[str, dict[str, Any]]:
        """Sandboxes lost with their node (of ``node``, or all): id → ``node``, ``cause``,
        ``since`` (wall clock), ``state`` (last known), ``confirmed`` (the node came back
        without it)."""
        out: dict[str, dict[str, Any]] = ray.get(self._registry.lost.remote(node),
                                                 timeout=self.timeout)
        return out

    def local_node(self) -> str | None:
        """The node this process runs on (same Ray node), or None."""
        self._fresh()
        return self._local()

    def _unreachable(self, node: str, e: BaseException) -> SandboxError:
        try:
            self.refresh()
        except Exception:  # the registry itself is out of reach: say what failed first
            return NodeUnavailableError(f"node {node}: {e}")
        return self._lost(node, e)

    def _route(self, node: str) -> Transport:
        with self._routes_lock:
            t = self._routes.get(node)
            if t is not None:
                return t
        view = self._view(node)
        sock = self._direct(view)
        if sock is not None:
            t = DirectTransport(node, sock, self._unreachable, self.timeout)
        else:
            t = RelayTransport(node, self._lookup(node), self._unreachable, self.timeout)
            if self.http and view.http_url:
                t = HttpRelayTransport(node, view.http_url, view.http_token, t,
                                       self._unreachable, self.timeout)
        with self._routes_lock:
            return self._routes.setdefault(node, t)

    def _create_on(self, t: Transport, body: dict[str, Any]
                   ) -> tuple[dict[str, Any] | None, SandboxError | None, float | None]:
        if isinstance(t, RelayTransport):
            try:
                return relay_answer(t.result("POST", path_for("sandboxes"), body))
            except SandboxError as e:
                return None, e, None
        try:
            return t.json("POST", path_for("sandboxes"), body), None, None
        except SandboxError as e:
            return self._refused(getattr(t, "node", ""), e, isinstance(t, DirectTransport))

    # -- sandboxes --------------------------------------------------------------------------

    def create(self, image: str | None = None, layers: Sequence[str] | None = None, *,
               id: str | None = None, cpus: float | None = None,
               memory_bytes: int | None = None, pids: int | None = None,
               disk_bytes: int | None = None, env: Mapping[str, str] | None = None,
               timeout: float | None = None, idle_timeout: float | None = None,
               labels: Mapping[str, str] | None = None, task_profile: str | None = None,
               seccomp_profile: str | None = None, memory_request_bytes: int | None = None,
               qos: str | None = None, auto_pause_after: float | None = None,
               network: Any = None, backend: str | None = None,
               template: str | None = None, envs: Mapping[str, str] | None = None,
               cpu: float | None = None, memory_mib: int | None = None,
               node_labels: Mapping[str, str] | None = None,
               node: str | None = None) -> ClusterSandbox:
        """Create a sandbox on the node placement picks. The arguments of
        :meth:`edged.client.Sandbox.create`, plus the placement's constraints: ``backend``
        (a node running it; also the backend the sandbox gets), ``node_labels`` (labels the
        node joined with) and ``node`` (that node only; :data:`LOCAL`: this process's). The
        sandbox's id is ``<node>.<id>`` (``id`` random if None).

        Raises what the last node tried said (:class:`CapacityExhaustedError` once
        ``max_attempts`` nodes refused, with ``retry_after``), :class:`ClusterError` if no
        node that is up meets the constraints, and any other SDK error at once (a bad
        request is not sent to a second node)."""
        args = dict(locals())  # the create's own arguments (create_body_of)
        self._fresh()
        if node == LOCAL:
            node = self.local_node()
            if node is None:
                raise self._no_local()
        plan = self._plan(id, backend, node_labels, node)
        for step in plan.attempts():
            if step is None:  # no node with room by the reports: read them once more
                self.refresh()
                continue
            t, sid = step
            try:
                route = self._route(t.node)
                info, e, at = self._create_on(route, create_body_of(args, id=sid))
            except BaseException as x:
                plan.crashed(t, x)
                continue
            if (made := plan.answered(t, info, e, at)) is not None:
                return ClusterSandbox(made, route, t.node, self.placer)
        raise plan.error()

    def connect(self, sandbox_id: str) -> ClusterSandbox:
        """The handle of an existing sandbox, from its id alone (its node is in it; an id
        without a node part is looked up in the registry). Raises
        :class:`~edged.client.NotFoundError` (no such sandbox on its node, or no node
        knows it), :class:`SandboxLostError` (its node is not up)."""
        node = ids.node_of(sandbox_id)
        if node is None:
            where = ray.get(self._registry.locate.remote(sandbox_id), timeout=self.timeout)
            if where is None:
                raise NotFoundError(f"sandbox {sandbox_id}: no node of the cluster lists it",
                                    status=404)
            node = str(where["node"])
        self._fresh()
        self._up(node)
        t = self._route(node)
        return ClusterSandbox(t.json("GET", path_for("sandboxes", sandbox_id)), t, node,
                              self.placer)

    def list(self, labels: Mapping[str, str] | None = None, *,
             lost: bool = True) -> builtins.list[ClusterSandbox]:
        """The sandboxes of every node that is up (asked now), carrying every label given;
        and, unless ``lost`` is false or labels are given, the lost ones: handles whose
        ``info["state"]`` is ``"lost"`` (with ``info["lost"]``) and whose calls raise
        :class:`SandboxLostError`."""
        self.refresh()
        path = self._listing(labels)
        out: builtins.list[ClusterSandbox] = []
        relayed: builtins.list[tuple[str, RelayTransport, Any]] = []
        for name, n in sorted(self._nodes.items()):
            if n["state"] != "up":
                continue
            try:
                t = self._route(name)
            except SandboxError:
                continue
            if isinstance(t, RelayTransport):  # asked of every relay at once
                with _skip_unreachable():
                    relayed.append((name, t, t.actor.call.remote("GET", path, None)))
                continue
            with _skip_unreachable():
                out += [ClusterSandbox(s, t, name, self.placer)
                        for s in t.json("GET", path)["sandboxes"]]
        for name, t, ref in relayed:
            with _skip_unreachable():
                got = t.unwrap(t._get(ref))
                out += [ClusterSandbox(s, t, name, self.placer) for s in got["sandboxes"]]
        if lost and not labels:
            out += [ClusterSandbox(info, _LostTransport(err), node)
                    for info, err, node in self._lost_handles(self.lost())]
        return out

    # -- the client -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the HTTP relays' kept-alive connections; disconnect from Ray if this client
        connected (the sandboxes live on)."""
        with self._routes_lock:
            routes, self._routes = list(self._routes.values()), {}
        for t in routes:
            if isinstance(t, HttpRelayTransport):
                t.close()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _skip_unreachable() -> contextlib.suppress:
    """A node that fails to answer a listing is left out of it (the registry will say)."""
    return contextlib.suppress(DaemonUnavailableError, SandboxLostError)
