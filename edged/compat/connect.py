"""A Connect RPC server on aiohttp: unary, server-streaming and client-streaming procedures
over HTTP/1.1, with the protobuf binary and JSON codecs.

Facts from the Connect protocol specification (connectrpc.com/docs/protocol): a procedure is
``POST /<package>.<Service>/<Method>``. Unary: the body is one message
(``application/proto`` or ``application/json``), the answer one message with status 200, or
an error: an HTTP status for its code and a JSON body ``{"code", "message"}``. Streaming
(``application/connect+proto`` or ``+json``): the bodies are sequences of envelopes (1 flag
byte, a 4-byte big-endian length, the message); the server's last envelope has flag
``0x02`` (end of stream) and holds JSON ``{}`` or ``{"error": {"code", "message"}}``, so a
streamed error comes with status 200. ``Connect-Timeout-Ms`` bounds the call
(``deadline_exceeded``). Compression is not offered (the identity encoding only), which
clients must accept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from edged.errors import (
    BadRequest,
    CapacityExhausted,
    Conflict,
    EdgedError,
    InvalidState,
    NotFound,
    PayloadTooLarge,
)

log = logging.getLogger("edged.compat")

#: largest message accepted (bytes)
MAX_MESSAGE = 16 << 20
FLAG_COMPRESSED = 0x01
FLAG_END = 0x02
_HEADER = struct.Struct(">BI")

#: Connect code -> HTTP status (the specification's table)
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}

M = TypeVar("M", bound=Message)


class ConnectError(Exception):
    """An error to answer with: ``code`` one of :data:`HTTP_STATUS`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def from_edged(e: EdgedError) -> ConnectError:
    """The Connect error for one of edged's."""
    if isinstance(e, NotFound):
        code = "not_found"
    elif isinstance(e, Conflict):
        code = "already_exists"
    elif isinstance(e, InvalidState):
        code = "resource_exhausted" if e.code == "pids_exhausted" else "failed_precondition"
    elif isinstance(e, PayloadTooLarge):
        code = "resource_exhausted"
    elif isinstance(e, BadRequest):
        code = "invalid_argument"
    elif isinstance(e, CapacityExhausted):
        code = "unavailable"
    else:
        code = "internal"
    return ConnectError(code, e.message)


@dataclass(frozen=True)
class Codec:
    """How messages travel: ``"proto"`` (binary) or ``"json"`` (proto3 JSON mapping)."""

    name: str

    def decode(self, data: bytes, cls: type[M]) -> M:
        msg = cls()
        try:
            if self.name == "json":
                json_format.Parse(data or b"{}", msg, ignore_unknown_fields=True)
            else:
                msg.ParseFromString(data)
        except (DecodeError, json_format.ParseError, ValueError) as e:
            raise ConnectError("invalid_argument", f"cannot decode {cls.__name__}: {e}") from e
        return msg

    def encode(self, msg: Message) -> bytes:
        if self.name == "json":
            return json_format.MessageToJson(msg, indent=None).encode()
        return msg.SerializeToString()


def _codec(request: web.Request, streaming: bool) -> Codec:
    ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    prefix = "application/connect+" if streaming else "application/"
    if ctype in (prefix + "proto", prefix + "json"):
        return Codec(ctype.rsplit("+", 1)[-1].rsplit("/", 1)[-1])
    raise ConnectError("invalid_argument" if ctype else "unknown",
                       f"content type {ctype!r}: expected {prefix}proto or {prefix}json")


def _deadline(request: web.Request) -> float | None:
    v = request.headers.get("Connect-Timeout-Ms")
    if not v:
        return None
    if not v.isdigit() or len(v) > 10:
        raise ConnectError("invalid_argument", "Connect-Timeout-Ms: must be 1 to 10 digits")
    return int(v) / 1000.0


def error_response(e: ConnectError) -> web.Response:
    """A unary error answer."""
    return web.json_response({"code": e.code, "message": e.message},
                             status=HTTP_STATUS.get(e.code, 500))


def envelope(data: bytes, flags: int = 0) -> bytes:
    """One envelope of a streamed body."""
    return _HEADER.pack(flags, len(data)) + data


async def read_envelopes(request: web.Request) -> AsyncIterator[tuple[int, bytes]]:
    """The envelopes of a streamed request body as they arrive: (flags, data)."""
    content = request.content
    while True:
        try:
            head = await content.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise ConnectError("invalid_argument", "truncated envelope") from e
            return
        flags, n = _HEADER.unpack(head)
        if n > MAX_MESSAGE:
            raise ConnectError("resource_exhausted", f"message of {n} bytes")
        if flags & FLAG_COMPRESSED:
            raise ConnectError("unimplemented", "compressed messages: identity only")
        try:
            data = await content.readexactly(n)
        except asyncio.IncompleteReadError as e:
            raise ConnectError("invalid_argument", "truncated envelope") from e
        yield flags, data
        if flags & FLAG_END:
            return


Unary = Callable[[web.Request, Any], Awaitable[Message]]
ServerStream = Callable[[web.Request, Any], AsyncIterator[Message]]
ClientStream = Callable[[web.Request, AsyncIterator[Any]], Awaitable[Message]]


def unary(req_cls: type[Message], impl: Unary,
          on_error: Callable[[Exception], ConnectError]) -> Callable[
              [web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler of a unary procedure."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            codec = _codec(request, streaming=False)
            deadline = _deadline(request)
            body = await request.content.read(MAX_MESSAGE + 1)
            if len(body) > MAX_MESSAGE:
                raise ConnectError("resource_exhausted", "message too large")
            msg = codec.decode(body, req_cls)
            out = await asyncio.wait_for(impl(request, msg), deadline)
        except TimeoutError:
            return error_response(ConnectError("deadline_exceeded", "deadline exceeded"))
        except ConnectError as e:
            return error_response(e)
        except Exception as e:
            return error_response(on_error(e))
        return web.Response(body=codec.encode(out),
                            content_type="application/" + codec.name)

    return handler


def server_stream(req_cls: type[Message], impl: ServerStream,
                  on_error: Callable[[Exception], ConnectError]) -> Callable[
                      [web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler of a server-streaming procedure. An error before the first
    message is still sent in the end-of-stream envelope (status 200), as the protocol has
    it; the stream ends when the implementation's iterator ends, the deadline passes, or
    the client goes away (then the iterator is closed)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            codec = _codec(request, streaming=True)
        except ConnectError as e:
            return error_response(e)
        # the request's one message before the answer starts (aiohttp drops a request
        # body still unread once the response is under way)
        msg: Message | None = None
        end: dict[str, Any] = {}
        deadline: float | None = None
        try:
            deadline = _deadline(request)
            first = None
            async for flags, data in read_envelopes(request):
                if first is None and not flags & FLAG_END:
                    first = data
            msg = codec.decode(first or b"", req_cls)
        except ConnectError as e:
            end = {"error": {"code": e.code, "message": e.message}}
        resp = web.StreamResponse(headers={"Content-Type": "application/connect+" + codec.name})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        stream: AsyncIterator[Message] | None = None
        try:
            if msg is None:
                raise ConnectError(end["error"]["code"], end["error"]["message"])
            stream = impl(request, msg)

            async def pump() -> None:
                assert stream is not None
                async for out in stream:
                    await resp.write(envelope(codec.encode(out)))

            await asyncio.wait_for(pump(), deadline)
        except TimeoutError:
            end = {"error": {"code": "deadline_exceeded", "message": "deadline exceeded"}}
        except ConnectError as e:
            end = {"error": {"code": e.code, "message": e.message}}
        except ConnectionError:
            return resp  # the client went away
        except Exception as e:
            ce = on_error(e)
            end = {"error": {"code": ce.code, "message": ce.message}}
        finally:
            if stream is not None:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
        with contextlib.suppress(ConnectionError):
            await resp.write(envelope(json.dumps(end).encode(), FLAG_END))
            await resp.write_eof()
        return resp

    return handler


def client_stream(req_cls: type[Message], impl: ClientStream,
                  on_error: Callable[[Exception], ConnectError]) -> Callable[
                      [web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler of a client-streaming procedure (the answer is one message in an
    envelope, then the end-of-stream envelope)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            codec = _codec(request, streaming=True)
        except ConnectError as e:
            return error_response(e)

        async def messages() -> AsyncIterator[Any]:
            async for flags, data in read_envelopes(request):
                if flags & FLAG_END:
                    return
                yield codec.decode(data, req_cls)

        resp = web.StreamResponse(headers={"Content-Type": "application/connect+" + codec.name})
        end: dict[str, Any] = {}
        out: Message | None = None
        try:
            out = await asyncio.wait_for(impl(request, messages()), _deadline(request))
        except TimeoutError:
            end = {"error": {"code": "deadline_exceeded", "message": "deadline exceeded"}}
        except ConnectError as e:
            end = {"error": {"code": e.code, "message": e.message}}
        except Exception as e:
            ce = on_error(e)
            end = {"error": {"code": ce.code, "message": ce.message}}
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            if out is not None:
                await resp.write(envelope(codec.encode(out)))
            await resp.write(envelope(json.dumps(end).encode(), FLAG_END))
            await resp.write_eof()
        return resp

    return handler


__all__ = ["Codec", "ConnectError", "client_stream", "envelope", "error_response",
           "from_edged", "read_envelopes", "server_stream", "unary"]
