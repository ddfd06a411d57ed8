"""A node's relay: what runs in its Ray actor, next to its daemon, on its Unix socket.

It reports the node to the registry every ``report_interval_s`` (the capacity part of
``GET /v1/node``, whether the daemon answered, the changes to its sandboxes), and carries
clients' calls to the daemon: JSON requests, NDJSON streams (exec output as it comes),
file uploads in chunks and downloads in chunks. Only ``/v1/`` paths are relayed. Errors go
back as data (:mod:`edged.cluster.wire`), stamped with this host's clock. It also serves the
node's HTTP relay (:mod:`edged.cluster.http_relay`: the clients' data path without a Ray
call) and puts its URL and token in every report.

Nothing here imports Ray: :mod:`edged.cluster.actors` wraps it in an actor, tests drive it
directly. The sandbox list is read with ``GET /v1/sandboxes`` every ``list_every`` reports
(and when the registry asks for the whole of it); between reads, the creates and deletes
relayed here (either way) are reported at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from edged.client._http import path_for
from edged.client.async_sandbox import AsyncTransport
from edged.client.errors import BadRequestError, NotFoundError, SandboxError
from edged.cluster import wire
from edged.cluster.http_relay import HttpRelay
from edged.cluster.placement import free_slots

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger("edged.cluster.node")

Sender = Callable[[dict[str, Any]], Awaitable[Mapping[str, Any]]]
#: bytes per item of a relayed download
DOWNLOAD_CHUNK = 1 << 20
#: an upload nobody added to for this long is dropped (s)
UPLOAD_IDLE_S = 60.0


class _Transport(AsyncTransport):
    """The SDK's transport with no cap on connections: a relay carries every exec stream of
    its node's sandboxes at once (aiohttp's default is 100)."""

    def session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path, limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            )
        return self._session


def _relayable(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/v1/"):
        raise BadRequestError(f"path {path!r}: only /v1/ paths are relayed", status=400)
    return path


class _Upload:
    def __init__(self, task: asyncio.Future[Any], queue: asyncio.Queue[bytes | None]) -> None:
        self.task = task
        self.queue = queue
        self.touched = time.monotonic()


class NodeAgent:
    """The relay of node ``name`` for the daemon on ``socket`` (see the module docstring).
    ``send``: delivers a report to the registry and returns its answer
    (:meth:`edged.cluster.registry.Registry.report`); ``labels``: the node's placement
    labels; ``ray_node_id``: the Ray node it runs on (clients there may skip the relay);
    ``http_host``, ``http_port``: where to serve its HTTP relay
    (:mod:`edged.cluster.http_relay`; None: none, clients call through Ray only)."""

    def __init__(self, name: str, socket: str, send: Sender, *,
                 labels: Mapping[str, str] | None = None, report_interval_s: float = 1.0,
                 list_every: int = 5, ray_node_id: str = "",
                 http_host: str | None = None, http_port: int = 0) -> None:
        self.name = name
        self.socket = socket
        self.send = send
        self.labels = dict(labels or {})
        self.report_interval_s = report_interval_s
        self.list_every = max(1, list_every)
        self.ray_node_id = ray_node_id
        self.agent = uuid.uuid4().hex  # this incarnation
        self.seq = 0
        self.epoch: str | None = None
        self.want_full = True
        self.daemon_up: bool | None = None
        self.last: dict[str, Any] = {}
        self._known: dict[str, str] = {}  # what the registry was told: id -> state
        self._added: dict[str, str] = {}
        self._removed: set[str] = set()
        self._sent: tuple[dict[str, str], set[str]] = ({}, set())
        self._t = _Transport(socket)
        self._task: asyncio.Task[None] | None = None
        self._uploads: dict[str, _Upload] = {}
        self._left = False
        self.http_host = http_host
        self.http_port = http_port
        self.http = HttpRelay(socket, secrets.token_urlsafe(32), self._answered)
        self._http_lock = asyncio.Lock()

    # -- reports ----------------------------------------------------------------------------

    async def collect(self) -> tuple[dict[str, Any], dict[str, str] | None]:
        """One report (see :meth:`edged.cluster.registry.Registry.report`), and the sandbox
        list the registry will know once it took it (None: unchanged)."""
        self.seq += 1
        taken_at = time.time()  # before the daemon is asked: it reflects all admitted by then
        r: dict[str, Any] = {"name": self.name, "agent": self.agent, "seq": self.seq,
                             "taken_at": taken_at, "labels": self.labels,
                             "ray_node_id": self.ray_node_id, "socket": self.socket,
                             "epoch": self.epoch, "sandboxes": None, "error": None,
                             "http": self.http_advert()}
        added, removed = dict(self._added), set(self._removed)
        try:
            info = await self._t.json("GET", path_for("node"))
            listing = None
            if self.want_full or self.seq % self.list_every == 0 or not self.daemon_up:
                listing = await self._t.json("GET", path_for("sandboxes"))
        except (SandboxError, OSError) as e:
            r.update(daemon="down", error=str(e), free=0, held=0,
                     backends=self.last.get("backends", []))
            self.daemon_up = False
            self.last = r
            return r, None
        self.daemon_up = True
        backends = info.get("backends")
        r.update(daemon="up", free=free_slots(info),
                 held=int(info.get("allocated", {}).get("sandboxes", 0)),
                 backends=list(backends) if isinstance(backends, Mapping)
                 else [info.get("backend", "container")],
                 default_backend=info.get("backend"))
        known: dict[str, str] | None = None
        if listing is not None:
            known = {s["id"]: s["state"] for s in listing.get("sandboxes", [])}
            if self.want_full:
                r["sandboxes"] = {"full": True, "added": known, "removed": []}
            else:
                r["sandboxes"] = {
                    "full": False,
                    "added": {k: v for k, v in known.items() if self._known.get(k) != v},
                    "removed": sorted(set(self._known) - set(known))}
        elif added or removed:
            r["sandboxes"] = {"full": False, "added": added, "removed": sorted(removed)}
            known = {k: v for k, v in self._known.items() if k not in removed} | added
        self._sent = (added, removed)
        self.last = r
        return r, known

    async def report_once(self) -> Mapping[str, Any]:
        """Collect a report and send it; the registry's answer."""
        r, known = await self.collect()
        added, removed = self._sent
        ack = await self.send(r)
        if known is not None:
            # the registry has these now; notes made meanwhile stay for the next report
            # (those a list taken meanwhile does not agree with yet)
            self._known = known
            for k, v in added.items():
                if self._added.get(k) == v and k in known:
                    del self._added[k]
            self._removed -= {k for k in removed if k not in known}
        if r["daemon"] == "up":
            self.want_full = bool(ack.get("want_full"))
        self.epoch = str(ack.get("epoch"))
        if ack.get("left"):
            self._left = True
        return ack

    async def run(self) -> None:
        """Report every ``report_interval_s`` until stopped (a failed report is logged and
        the next one tried; the registry sees the gap)."""
        await self.serve_http()
        while not self._left:
            t0 = time.monotonic()
            try:
                await self.report_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("node %s: report failed: %s", self.name, e)
                self.want_full = True
            self._drop_idle_uploads()
            await asyncio.sleep(max(0.0, self.report_interval_s - (time.monotonic() - t0)))

    def http_advert(self) -> dict[str, str] | None:
        """What the reports tell clients of the HTTP relay: ``url`` and ``token``; None
        while it is not serving."""
        if self.http.url is None:
            return None
        return {"url": self.http.url, "token": self.http.token}

    async def serve_http(self) -> str | None:
        """Start the HTTP relay if it should run and does not yet (idempotent); its URL.
        An address that cannot be bound is logged: clients then call through Ray."""
        async with self._http_lock:  # one server, however many callers start it at once
            if self.http_host is None or self.http.url is not None:
                return self.http.url
            try:
                url = await self.http.start(self.http_host, self.http_port)
            except OSError as e:
                log.warning("node %s: HTTP relay on %s:%s: %s (clients call through Ray)",
                            self.name, self.http_host, self.http_port, e)
                return None
            log.info("node %s: HTTP relay at %s", self.name, url)
            return url

    def start(self) -> None:
        """Start :meth:`run` in the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._left = False
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        """Stop reporting; abort uploads; close the connection pool."""
        self._left = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for token in list(self._uploads):
            await self.upload_abort(token)
        await self.http.stop()
        await self._t.close()

    # -- relayed calls ----------------------------------------------------------------------

    def _answered(self, method: str, path: str, status: int, body: Any) -> None:
        """A create or delete the HTTP relay carried (see :meth:`_note`)."""
        if status < 400:
            self._note(method, path, body)
        elif method == "DELETE" and status == 404:
            self._removed.add(path.rsplit("/", 1)[-1])

    def _note(self, method: str, path: str, value: Any) -> None:
        """Keep the registry's list current with what this relay did."""
        if method == "POST" and path == "/v1/sandboxes" and isinstance(value, dict):
            self._added[value["id"]] = value.get("state", "running")
            self._removed.discard(value["id"])
        elif method == "DELETE" and path.startswith("/v1/sandboxes/") and \
                path.count("/") == 3 and isinstance(value, dict):
            self._added.pop(value["id"], None)
            self._removed.add(value["id"])

    async def call(self, method: str, path: str, payload: Any = None) -> wire.Result:
        """A JSON request to the daemon: ``("ok", answer)`` or ``("err", {...})``."""
        try:
            value = await self._t.json(method, _relayable(path), payload)
        except SandboxError as e:
            if method == "DELETE" and isinstance(e, NotFoundError):
                self._removed.add(path.rsplit("/", 1)[-1])
            return wire.err(e)
        self._note(method, path, value)
        return wire.ok(value)

    async def stream(self, method: str, path: str,
                     payload: Any = None) -> AsyncIterator[wire.Result]:
        """An NDJSON stream, one ``("ok", event)`` per object; an error ends it with one
        ``("err", {...})``. Cancelling it (the client gave up) closes the daemon request, so
        the daemon ends the exec as abandoned."""
        try:
            async for ev in self._t.ndjson(method, _relayable(path), payload):
                yield wire.ok(ev)
        except SandboxError as e:
            yield wire.err(e)

    async def download(self, path: str) -> AsyncIterator[wire.Result]:
        """A byte body in ``("ok", chunk)`` items of up to :data:`DOWNLOAD_CHUNK` bytes; an
        error as one ``("err", {...})``."""
        buf = bytearray()
        try:
            # aiohttp hands over what has arrived: gathered into whole items, each of
            # which is one Ray object
            async for piece in self._t.download(_relayable(path), DOWNLOAD_CHUNK):
                buf += piece
                if len(buf) >= DOWNLOAD_CHUNK:
                    yield wire.ok(bytes(buf[:DOWNLOAD_CHUNK]))
                    del buf[:DOWNLOAD_CHUNK]
        except SandboxError as e:
            yield wire.err(e)
            return
        if buf:
            yield wire.ok(bytes(buf))

    async def upload(self, path: str, data: bytes) -> wire.Result:
        """``PUT`` ``data`` whole."""
        try:
            return wire.ok(await self._t.upload(_relayable(path), data))
        except SandboxError as e:
            return wire.err(e)

    async def upload_open(self, path: str) -> wire.Result:
        """Start a ``PUT`` fed by :meth:`upload_chunk`; ``("ok", token)``."""
        try:
            _relayable(path)
        except SandboxError as e:
            return wire.err(e)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=2)

        async def body() -> AsyncIterator[bytes]:
            while (chunk := await queue.get()) is not None:
                yield chunk

        token = secrets.token_hex(8)
        task = asyncio.ensure_future(self._t.upload(path, body()))
        self._uploads[token] = _Upload(task, queue)
        return wire.ok(token)

    async def upload_chunk(self, token: str, data: bytes) -> wire.Result:
        """Add ``data`` to upload ``token`` (waits while the daemon is behind)."""
        up = self._uploads.get(token)
        if up is None:
            return wire.err(NotFoundError(f"upload {token}: none such (expired?)", status=404))
        up.touched = time.monotonic()
        put = asyncio.ensure_future(up.queue.put(data))
        done, _ = await asyncio.wait({put, up.task}, return_when=asyncio.FIRST_COMPLETED)
        if put not in done:  # the request ended before taking it: its answer says why
            put.cancel()
            return await self.upload_close(token)
        return wire.ok(None)

    async def upload_close(self, token: str) -> wire.Result:
        """End upload ``token``; the daemon's answer."""
        up = self._uploads.pop(token, None)
        if up is None:
            return wire.err(NotFoundError(f"upload {token}: none such (expired?)", status=404))
        if not up.task.done():
            put = asyncio.ensure_future(up.queue.put(None))
            await asyncio.wait({put, up.task}, return_when=asyncio.FIRST_COMPLETED)
            if not put.done():
                put.cancel()
        try:
            return wire.ok(await up.task)
        except SandboxError as e:
            return wire.err(e)

    async def upload_abort(self, token: str) -> None:
        """Drop upload ``token`` (nothing is written: the daemon renames a file into place
        only when its body ended whole)."""
        up = self._uploads.pop(token, None)
        if up is not None:
            up.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await up.task

    def _drop_idle_uploads(self) -> None:
        now = time.monotonic()
        for token, up in list(self._uploads.items()):
            if now - up.touched > UPLOAD_IDLE_S:
                del self._uploads[token]
                up.task.cancel()
