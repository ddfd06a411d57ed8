"""How a cluster handle reaches its sandbox's node: the SDK's transports, carried through
the node's relay actor, or straight to the daemon's socket where the caller is on that node.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import ray

from edged.client._http import Transport
from edged.client.async_sandbox import AsyncTransport
from edged.client.errors import BadRequestError, DaemonUnavailableError, SandboxError
from edged.cluster import wire
from edged.cluster.actors import STREAM_BACKLOG

#: bytes per call of a relayed upload
UPLOAD_CHUNK = 4 << 20

OnFail = Callable[[str, BaseException], SandboxError]
AsyncOnFail = Callable[[str, BaseException], Awaitable[SandboxError]]


def _chunks(body: bytes | Iterable[bytes]) -> Iterator[bytes]:
    if isinstance(body, bytes | bytearray | memoryview):
        data = bytes(body)
        for i in range(0, len(data), UPLOAD_CHUNK):
            yield data[i:i + UPLOAD_CHUNK]
        return
    buf = bytearray()
    for piece in body:
        buf += piece
        while len(buf) >= UPLOAD_CHUNK:
            yield bytes(buf[:UPLOAD_CHUNK])
            del buf[:UPLOAD_CHUNK]
    if buf:
        yield bytes(buf)


async def _achunks(body: bytes | AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if isinstance(body, bytes | bytearray | memoryview):
        for c in _chunks(bytes(body)):
            yield c
        return
    buf = bytearray()
    async for piece in body:
        buf += piece
        while len(buf) >= UPLOAD_CHUNK:
            yield bytes(buf[:UPLOAD_CHUNK])
            del buf[:UPLOAD_CHUNK]
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

    async def close(self) -> None:
        pass

    async def aclose(self) -> None:
        """Close the connection pool."""
        await super().close()
