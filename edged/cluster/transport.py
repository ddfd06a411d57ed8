"""How a cluster handle reaches its sandbox's node: the SDK's transports, carried over the
node's HTTP relay (:mod:`edged.cluster.http_relay`: the daemon's own protocol over TCP,
no Ray call), through the node's relay actor where that cannot be reached, or straight to
the daemon's socket where the caller is on that node.

Each class here is the SDK transport it subclasses (:class:`edged.client._http.Transport`,
:class:`edged.client.async_sandbox.AsyncTransport`) with the same four calls (``json``,
``ndjson``, ``upload``, ``download``), so :class:`edged.client.Sandbox` and
:class:`edged.client.AsyncSandbox` work over them unchanged, exec streaming and files
included. Failures to reach a node go through ``on_fail(node, error)``, which says what
they mean (:class:`~edged.cluster.errors.SandboxLostError` if the registry no longer counts
the node as up).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import ray

from edged.client._http import Transport
from edged.client.async_sandbox import AsyncTransport
from edged.client.errors import BadRequestError, DaemonUnavailableError, SandboxError
from edged.cluster import wire
from edged.cluster.actors import STREAM_BACKLOG
from edged.cluster.errors import NodeUnavailableError, RelayUnreachableError

#: bytes per call of a relayed upload
UPLOAD_CHUNK = 4 << 20
#: an HTTP relay that could not be reached is tried again after this long (s), or at once
#: when the node's report names another URL
HTTP_RETRY_S = 5.0
#: kept-alive connections to an HTTP relay: at most this many idle, each for this long (s;
#: the relay keeps them longer, :data:`edged.cluster.http_relay.KEEPALIVE_S`)
HTTP_IDLE_MAX = 64
HTTP_IDLE_S = 15.0

log = logging.getLogger("edged.cluster.transport")
T = TypeVar("T")

OnFail = Callable[[str, BaseException], SandboxError]
AsyncOnFail = Callable[[str, BaseException], Awaitable[SandboxError]]


def _full(buf: bytearray, piece: bytes) -> Iterator[bytes]:
    """Add ``piece`` to ``buf``; take out the :data:`UPLOAD_CHUNK`-sized chunks it fills."""
    buf += piece
    while len(buf) >= UPLOAD_CHUNK:
        yield bytes(buf[:UPLOAD_CHUNK])
        del buf[:UPLOAD_CHUNK]


def _chunks(body: bytes | Iterable[bytes]) -> Iterator[bytes]:
    """``body`` in chunks of :data:`UPLOAD_CHUNK` bytes (the last one shorter)."""
    if isinstance(body, bytes | bytearray | memoryview):
        data = bytes(body)
        for i in range(0, len(data), UPLOAD_CHUNK):
            yield data[i:i + UPLOAD_CHUNK]
        return
    buf = bytearray()
    for piece in body:
        yield from _full(buf, piece)
    if buf:
        yield bytes(buf)


async def _achunks(body: bytes | AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """:func:`_chunks` of a body that comes in awaited."""
    if isinstance(body, bytes | bytearray | memoryview):
        for c in _chunks(bytes(body)):
            yield c
        return
    buf = bytearray()
    async for piece in body:
        for c in _full(buf, piece):
            yield c
    if buf:
        yield bytes(buf)


class _Relay:
    """The handle of a node's relay, looked up by name (``lookup``) when first needed and
    again after the relay died (a new ``join`` starts another under the same name)."""

    def __init__(self, lookup: Callable[[], Any]) -> None:
        self.lookup = lookup
        self._actor: Any = None

    @property
    def actor(self) -> Any:
        if self._actor is None:
            self._actor = self.lookup()
        return self._actor

    def failed(self, e: BaseException) -> bool:
        """Whether ``e`` says the relay is gone (the handle is dropped)."""
        if isinstance(e, ray.exceptions.ActorDiedError | ray.exceptions.ActorUnavailableError):
            self._actor = None
            return True
        return False


class RelayTransport(Transport):
    """Calls to node ``node``'s daemon through its relay (blocking); ``lookup()`` gives the
    relay actor's handle. A ``GET`` whose relay died is sent once more to its successor."""

    def __init__(self, node: str, lookup: Callable[[], Any], on_fail: OnFail,
                 timeout: float | None = 60.0) -> None:
        super().__init__(f"ray:{node}", timeout)
        self.node = node
        self.relay = _Relay(lookup)
        self.on_fail = on_fail

    @property
    def actor(self) -> Any:
        """The relay actor's handle."""
        try:
            return self.relay.actor
        except ValueError as e:  # no actor of that name
            raise self.on_fail(self.node, e) from e

    def _get(self, ref: Any, timeout: float | None = -1.0) -> Any:
        try:
            return ray.get(ref, timeout=self.timeout if timeout == -1.0 else timeout)
        except ray.exceptions.RayError as e:
            self.relay.failed(e)
            raise self.on_fail(self.node, e) from e

    def result(self, method: str, path: str, payload: Any = None) -> wire.Result:
        """The relay's answer as data (``("ok", v)`` or ``("err", {...})``)."""
        try:
            r: wire.Result = ray.get(self.actor.call.remote(method, path, payload),
                                     timeout=self.timeout)
        except ray.exceptions.RayError as e:
            if not (self.relay.failed(e) and method == "GET"):
                raise self.on_fail(self.node, e) from e
            r = self._get(self.actor.call.remote(method, path, payload))
        return r

    def unwrap(self, r: wire.Result) -> Any:
        """The value of a relay's answer; its error raised (a daemon the relay cannot reach
        read by ``on_fail``)."""
        try:
            return wire.unwrap(r)
        except DaemonUnavailableError as e:
            raise self.on_fail(self.node, e) from e

    def json(self, method: str, path: str, payload: Any = None) -> Any:
        return self.unwrap(self.result(method, path, payload))

    def _stream(self, gen: Any) -> Iterator[Any]:
        done = False
        try:
            for ref in gen:
                yield self.unwrap(self._get(ref, None))
            done = True
        finally:
            if not done:  # given up: the relay ends the daemon's request (exec abandoned)
                with contextlib.suppress(Exception):
                    ray.cancel(gen)

    def ndjson(self, method: str, path: str, payload: Any,
               on_open: Callable[[Any], object] | None = None) -> Iterator[dict[str, Any]]:
        if on_open is not None:  # a process handle: it holds the node's connection itself
            raise BadRequestError("a process handle (exec background=True, pty) needs the "
                                  "node's own socket: not through the cluster's relay")
        gen = self.actor.stream.options(
            _generator_backpressure_num_objects=STREAM_BACKLOG).remote(method, path, payload)
        yield from self._stream(gen)

    def upload(self, path: str, body: bytes | Iterable[bytes]) -> Any:
        chunks = _chunks(body)
        first = next(chunks, b"")
        second = next(chunks, None)
        if second is None:
            return self.unwrap(self._get(self.actor.upload.remote(path, first)))
        token = self.unwrap(self._get(self.actor.upload_open.remote(path)))
        try:
            for chunk in (first, second, *chunks):
                if not chunk:
                    continue
                r = self._get(self.actor.upload_chunk.remote(token, chunk))
                if r[0] == "err" or r[1] is not None:  # the daemon ended the request
                    return self.unwrap(r)
        except BaseException:
            with contextlib.suppress(Exception):
                self.actor.upload_abort.remote(token)
            raise
        return self.unwrap(self._get(self.actor.upload_close.remote(token)))

    def download(self, path: str, chunk: int = 256 << 10) -> Iterator[bytes]:
        gen = self.actor.download.options(
            _generator_backpressure_num_objects=STREAM_BACKLOG).remote(path)
        yield from self._stream(gen)


class DirectTransport(Transport):
    """The SDK's own transport to a daemon on this host, its failures read by ``on_fail``."""

    def __init__(self, node: str, socket_path: str, on_fail: OnFail,
                 timeout: float | None = 60.0) -> None:
        super().__init__(socket_path, timeout)
        self.node = node
        self.on_fail = on_fail

    def open(self, *a: Any, **kw: Any) -> Any:
        try:
            return super().open(*a, **kw)
        except DaemonUnavailableError as e:
            raise self.on_fail(self.node, e) from e

    def ndjson(self, method: str, path: str, payload: Any,
               on_open: Callable[[Any], object] | None = None) -> Iterator[dict[str, Any]]:
        try:
            yield from super().ndjson(method, path, payload, on_open)
        except NodeUnavailableError:  # read by on_fail already (in open)
            raise
        except DaemonUnavailableError as e:  # the stream cut mid-way
            raise self.on_fail(self.node, e) from e


class AsyncRelayTransport(AsyncTransport):
    """Calls to node ``node``'s daemon through its relay, awaited (see
    :class:`RelayTransport`; ``lookup`` is called in a thread). Shared by the handles of one
    client: :meth:`close` leaves it open (the client has nothing to close)."""

    def __init__(self, node: str, lookup: Callable[[], Any], on_fail: AsyncOnFail) -> None:
        super().__init__(f"ray:{node}")
        self.node = node
        self.relay = _Relay(lookup)
        self.on_fail = on_fail

    @property
    def actor(self) -> Any:
        """The relay actor's handle (None until :meth:`_ensure` looked it up)."""
        return self.relay._actor

    async def _ensure(self) -> Any:
        if self.relay._actor is None:
            try:
                self.relay._actor = await asyncio.to_thread(self.relay.lookup)
            except ValueError as e:
                raise await self.on_fail(self.node, e) from e
        return self.relay._actor

    async def _get(self, ref: Any) -> Any:
        try:
            return await ref
        except ray.exceptions.RayError as e:
            self.relay.failed(e)
            raise await self.on_fail(self.node, e) from e

    async def request(self, method: str, path: str, **kw: Any) -> Any:
        raise TypeError("a relayed transport has no raw requests")

    async def result(self, method: str, path: str, payload: Any = None) -> wire.Result:
        """The relay's answer as data."""
        actor = await self._ensure()
        try:
            r: wire.Result = await actor.call.remote(method, path, payload)
        except ray.exceptions.RayError as e:
            if not (self.relay.failed(e) and method == "GET"):
                raise await self.on_fail(self.node, e) from e
            r = await self._get((await self._ensure()).call.remote(method, path, payload))
        return r

    async def unwrap(self, r: wire.Result) -> Any:
        """See :meth:`RelayTransport.unwrap`."""
        try:
            return wire.unwrap(r)
        except DaemonUnavailableError as e:
            raise await self.on_fail(self.node, e) from e

    async def json(self, method: str, path: str, payload: Any = None) -> Any:
        return await self.unwrap(await self.result(method, path, payload))

    async def _stream(self, gen: Any) -> AsyncIterator[Any]:
        done = False
        try:
            async for ref in gen:
                yield await self.unwrap(await self._get(ref))
            done = True
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    ray.cancel(gen)

    async def ndjson(self, method: str, path: str, payload: Any) -> AsyncIterator[dict[str, Any]]:
        gen = (await self._ensure()).stream.options(
            _generator_backpressure_num_objects=STREAM_BACKLOG).remote(method, path, payload)
        async for item in self._stream(gen):
            yield item

    async def upload(self, path: str, body: bytes | AsyncIterator[bytes]) -> Any:
        await self._ensure()
        if isinstance(body, bytes | bytearray | memoryview) and len(body) <= UPLOAD_CHUNK:
            return await self.unwrap(await self._get(self.actor.upload.remote(path,
                                                                             bytes(body))))
        token = await self.unwrap(await self._get(self.actor.upload_open.remote(path)))
        try:
            async for chunk in _achunks(body):
                r = await self._get(self.actor.upload_chunk.remote(token, chunk))
                if r[0] == "err" or r[1] is not None:  # the daemon ended the request
                    return await self.unwrap(r)
        except BaseException:
            with contextlib.suppress(Exception):
                self.actor.upload_abort.remote(token)
            raise
        return await self.unwrap(await self._get(self.actor.upload_close.remote(token)))

    async def download(self, path: str, chunk: int = 256 << 10) -> AsyncIterator[bytes]:
        gen = (await self._ensure()).download.options(
            _generator_backpressure_num_objects=STREAM_BACKLOG).remote(path)
        async for item in self._stream(gen):
            yield item

    async def close(self) -> None:
        pass


class AsyncDirectTransport(AsyncTransport):
    """The async SDK transport to a daemon on this host, its failures read by ``on_fail``.
    Shared by the handles of one client: :meth:`close` leaves it open, :meth:`aclose`
    closes it."""

    def __init__(self, node: str, socket_path: str, on_fail: AsyncOnFail) -> None:
        super().__init__(socket_path)
        self.node = node
        self.on_fail = on_fail

    async def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return await super().request(method, path, **kw)
        except DaemonUnavailableError as e:
            raise await self.on_fail(self.node, e) from e

    async def ndjson(self, method: str, path: str, payload: Any) -> AsyncIterator[dict[str, Any]]:
        try:
            async for ev in super().ndjson(method, path, payload):
                yield ev
        except NodeUnavailableError:  # read by on_fail already (in request)
            raise
        except DaemonUnavailableError as e:  # the stream cut mid-way
            raise await self.on_fail(self.node, e) from e

    async def close(self) -> None:
        pass

    async def aclose(self) -> None:
        """Close the connection pool."""
        await super().close()


class _RelayConnection(http.client.HTTPConnection):
    """A TCP connection to an HTTP relay; failing to connect raises
    :class:`RelayUnreachableError` (nothing was sent)."""

    def __init__(self, host: str, port: int, timeout: float | None) -> None:
        super().__init__(host, port, timeout=timeout)
        self.reused = False
        self.idle_since = 0.0

    def connect(self) -> None:
        try:
            super().connect()
        except OSError as e:
            raise RelayUnreachableError(f"HTTP relay {self.host}:{self.port}: {e}") from e
        assert self.sock is not None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _HttpRoute:
    """Where a node's HTTP relay is (``url``, ``token``) and whether it answered lately;
    shared by the sync and async transports."""

    def __init__(self, node: str, url: str, token: str) -> None:
        self.node = node
        self.url = ""
        self.token = ""
        self.failed_at: float | None = None
        self.set(url, token)

    def set(self, url: str, token: str) -> bool:
        """The node's report names ``url`` and ``token``; whether they changed."""
        if (url, token) == (self.url, self.token):
            return False
        self.url, self.token, self.failed_at = url, token, None
        parts = urllib.parse.urlsplit(url) if url else None
        self.host = parts.hostname or "" if parts else ""
        self.port = parts.port or 80 if parts else 0
        self.auth = f"Bearer {token}"
        return True

    @property
    def usable(self) -> bool:
        """Whether to try the HTTP relay (it has not failed in the last
        :data:`HTTP_RETRY_S`)."""
        return bool(self.url) and (self.failed_at is None
                                   or time.monotonic() - self.failed_at > HTTP_RETRY_S)

    def failed(self, e: BaseException) -> None:
        if self.failed_at is None:
            log.warning("node %s: its HTTP relay %s: %s (calling through Ray)",
                        self.node, self.url, e)
        self.failed_at = time.monotonic()


def _relay_error(route: _HttpRoute, e: SandboxError) -> SandboxError:
    """What an error answer over an HTTP relay means: the relay's refusal of this client's
    token (a relay restarted with another one: nothing reached the daemon) is
    :class:`RelayUnreachableError`; the relay's word that the daemon does not answer is
    :class:`DaemonUnavailableError`; the daemon's own errors are as they are."""
    if e.status == 401 and e.code == "unauthorized":
        return RelayUnreachableError(f"HTTP relay {route.url}: {e}")
    if e.code == DaemonUnavailableError.code:
        return DaemonUnavailableError(e.message, status=e.status, code=e.code)
    return e


def _stale(e: BaseException) -> bool:
    """Whether ``e`` is a kept-alive connection the relay had closed meanwhile."""
    return isinstance(e.__cause__, http.client.RemoteDisconnected | ConnectionResetError
                      | BrokenPipeError)


class HttpRelayTransport(Transport):
    """Calls to node ``node``'s daemon over its HTTP relay at ``url`` (blocking; the SDK's
    own transport over TCP, connections kept alive), falling back to ``relay`` (its actor)
    while the HTTP relay cannot be reached or refuses the token. A daemon the relay cannot
    reach is read by ``on_fail``, as on the other routes."""

    def __init__(self, node: str, url: str, token: str, relay: RelayTransport,
                 on_fail: OnFail, timeout: float | None = 60.0) -> None:
        super().__init__(f"http-relay:{node}", timeout)
        self.node = node
        self.relay = relay
        self.on_fail = on_fail
        self.route = _HttpRoute(node, url, token)
        self._idle: list[_RelayConnection] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    def set_http(self, url: str, token: str) -> None:
        """The node's latest report names the HTTP relay ``url``, ``token``."""
        with self._lock:
            if self.route.set(url, token):
                idle, self._idle = self._idle, []
            else:
                idle = []
        for c in idle:
            c.close()

    def connection(self, timeout: float | None) -> http.client.HTTPConnection:
        now = time.monotonic()
        conn: _RelayConnection | None = None
        with self._lock:
            while self._idle and conn is None:
                c = self._idle.pop()
                if now - c.idle_since < HTTP_IDLE_S and c.sock is not None:
                    conn = c
                else:
                    c.close()
        if conn is not None:
            conn.reused = True
            conn.timeout = timeout
            assert conn.sock is not None
            conn.sock.settimeout(timeout)
        else:
            conn = _RelayConnection(self.route.host, self.route.port, timeout)
        self._local.conn = conn
        return conn

    def read_whole(self, conn: http.client.HTTPConnection,
                   resp: http.client.HTTPResponse) -> bytes:
        try:
            data = resp.read()
        except BaseException:
            conn.close()
            raise
        if resp.will_close or not isinstance(conn, _RelayConnection):
            conn.close()
            return data
        conn.idle_since = time.monotonic()
        with self._lock:
            if len(self._idle) < HTTP_IDLE_MAX:
                self._idle.append(conn)
                return data
        conn.close()
        return data

    def _open_once(self, method: str, path: str, body: bytes | Iterable[bytes] | None = None,
                   headers: dict[str, str] | None = None, timeout: float | None = -1.0
                   ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        hdrs = {**(headers or {}), "Authorization": self.route.auth}
        for again in (True, False):
            try:
                return super()._open_once(method, path, body, hdrs, timeout)
            except RelayUnreachableError:
                raise
            except DaemonUnavailableError as e:
                conn = getattr(self._local, "conn", None)
                if not (again and conn is not None and conn.reused and _stale(e)
                        and (body is None or isinstance(body, bytes))):
                    raise
                with self._lock:  # the others kept alive are likely closed too
                    idle, self._idle = self._idle, []
                for c in idle:
                    c.close()
            except SandboxError as e:
                raise _relay_error(self.route, e) from e
        raise AssertionError("unreachable")

    def _via(self, over_http: Callable[[], T], over_ray: Callable[[], T]) -> T:
        if self.route.usable:
            try:
                return over_http()
            except RelayUnreachableError as e:
                self.route.failed(e)
            except DaemonUnavailableError as e:
                raise self.on_fail(self.node, e) from e
        return over_ray()

    def _via_stream(self, over_http: Callable[[], Iterator[T]],
                    over_ray: Callable[[], Iterator[T]]) -> Iterator[T]:
        if not self.route.usable:
            yield from over_ray()
            return
        gen = over_http()
        try:
            first = next(gen)
        except StopIteration:
            return
        except RelayUnreachableError as e:
            self.route.failed(e)
            yield from over_ray()
            return
        except DaemonUnavailableError as e:
            raise self.on_fail(self.node, e) from e
        yield first
        try:
            yield from gen
        except DaemonUnavailableError as e:  # cut mid-way: no other route can take over
            raise self.on_fail(self.node, e) from e

    def json(self, method: str, path: str, payload: Any = None) -> Any:
        return self._via(lambda: super(HttpRelayTransport, self).json(method, path, payload),
                         lambda: self.relay.json(method, path, payload))

    def ndjson(self, method: str, path: str, payload: Any,
               on_open: Callable[[Any], object] | None = None) -> Iterator[dict[str, Any]]:
        return self._via_stream(
            lambda: super(HttpRelayTransport, self).ndjson(method, path, payload, on_open),
            lambda: self.relay.ndjson(method, path, payload, on_open))

    def upload(self, path: str, body: bytes | Iterable[bytes]) -> Any:
        return self._via(lambda: super(HttpRelayTransport, self).upload(path, body),
                         lambda: self.relay.upload(path, body))

    def download(self, path: str, chunk: int = 256 << 10) -> Iterator[bytes]:
        return self._via_stream(
            lambda: super(HttpRelayTransport, self).download(path, chunk),
            lambda: self.relay.download(path, chunk))

    def close(self) -> None:
        """Close the kept-alive connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()


class AsyncHttpRelayTransport(AsyncTransport):
    """Calls to node ``node``'s daemon over its HTTP relay, awaited (see
    :class:`HttpRelayTransport`: falls back to ``relay``). Shared by the handles of one
    client: :meth:`close` leaves it open, :meth:`aclose` closes it."""

    def __init__(self, node: str, url: str, token: str, relay: AsyncRelayTransport,
                 on_fail: AsyncOnFail) -> None:
        super().__init__(f"http-relay:{node}")
        self.node = node
        self.relay = relay
        self.on_fail = on_fail
        self.route = _HttpRoute(node, url, token)
        self.base_url = url

    async def set_http(self, url: str, token: str) -> None:
        """The node's latest report names the HTTP relay ``url``, ``token`` (the
        connections to the old one are dropped)."""
        if self.route.set(url, token):
            self.base_url = url
            old, self._session = self._session, None
            if old is not None:
                await old.close()

    def session(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=HTTP_IDLE_S),
                headers={"Authorization": self.route.auth},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        return self._session

    async def _request_once(self, method: str, path: str, **kw: Any) -> Any:
        import aiohttp

        try:
            return await super()._request_once(method, path, **kw)
        except DaemonUnavailableError as e:
            if isinstance(e.__cause__, aiohttp.ClientConnectorError):
                raise RelayUnreachableError(f"HTTP relay {self.route.url}: {e}") from e
            raise
        except SandboxError as e:
            raise _relay_error(self.route, e) from e

    async def _via(self, over_http: Callable[[], Awaitable[T]],
                   over_ray: Callable[[], Awaitable[T]]) -> T:
        if self.route.usable:
            try:
                return await over_http()
            except RelayUnreachableError as e:
                self.route.failed(e)
            except DaemonUnavailableError as e:
                raise await self.on_fail(self.node, e) from e
        return await over_ray()

    async def _via_stream(self, over_http: Callable[[], AsyncIterator[T]],
                          over_ray: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
        if self.route.usable:
            gen = over_http()
            try:
                first = await gen.__anext__()
            except StopAsyncIteration:
                return
            except RelayUnreachableError as e:
                self.route.failed(e)
            except DaemonUnavailableError as e:
                raise await self.on_fail(self.node, e) from e
            else:
                yield first
                try:
                    async for item in gen:
                        yield item
                except DaemonUnavailableError as e:  # cut mid-way: no other route takes over
                    raise await self.on_fail(self.node, e) from e
                return
        async for item in over_ray():
            yield item

    async def json(self, method: str, path: str, payload: Any = None) -> Any:
        return await self._via(
            lambda: super(AsyncHttpRelayTransport, self).json(method, path, payload),
            lambda: self.relay.json(method, path, payload))

    async def ndjson(self, method: str, path: str, payload: Any) -> AsyncIterator[dict[str, Any]]:
        async for item in self._via_stream(
                lambda: super(AsyncHttpRelayTransport, self).ndjson(method, path, payload),
                lambda: self.relay.ndjson(method, path, payload)):
            yield item

    async def upload(self, path: str, body: bytes | AsyncIterator[bytes]) -> Any:
        # a body over 1 MiB goes as a file-like object (aiohttp warns of one given as bytes)
        big = isinstance(body, bytes | bytearray | memoryview) and len(body) > 1 << 20
        return await self._via(
            lambda: super(AsyncHttpRelayTransport, self).upload(
                path, io.BytesIO(body) if big else body),  # type: ignore[arg-type]
            lambda: self.relay.upload(path, body))

    async def download(self, path: str, chunk: int = 256 << 10) -> AsyncIterator[bytes]:
        async for item in self._via_stream(
                lambda: super(AsyncHttpRelayTransport, self).download(path, chunk),
                lambda: self.relay.download(path, chunk)):
            yield item

    async def close(self) -> None:
        pass

    async def aclose(self) -> None:
        """Close the connection pool."""
        await super().close()
