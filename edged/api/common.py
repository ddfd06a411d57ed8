"""What the API's route modules share: the manager's app key, JSON bodies, the output
encoder of streamed execs and runs, and streaming until the client goes away."""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from edged.errors import BadRequest, PayloadTooLarge
from edged.node.manager import SandboxManager

MANAGER: web.AppKey[SandboxManager] = web.AppKey("manager", SandboxManager)
FILE_CHUNK = 256 << 10
#: how often a streaming exec checks that its client is still there (seconds)
DISCONNECT_POLL_S = 0.2
MAX_JSON_BODY = 4 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def client_gone(request: web.Request) -> bool:
    """Whether the request's client has closed (or lost) its connection."""
    t = request.transport
    return t is None or t.is_closing()


async def json_body(request: web.Request) -> Any:
    """The request's whole JSON body ({} if empty); :class:`BadRequest` if not JSON,
    :class:`PayloadTooLarge` (413) over ``MAX_JSON_BODY`` bytes."""
    if not request.body_exists:
        return {}
    # StreamReader.read(n) returns what has arrived so far, not n bytes: read to EOF
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(MAX_JSON_BODY + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_JSON_BODY:
            raise PayloadTooLarge(f"body: larger than {MAX_JSON_BODY} bytes")
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"body: not valid JSON: {e}") from e
    except RecursionError as e:  # e.g. 100,000 nested arrays: no body of ours nests that deep
        raise BadRequest("body: JSON nested too deeply") from e


def manager_of(request: web.Request) -> SandboxManager:
    return request.app[MANAGER]


def sandbox_id_of(request: web.Request) -> str:
    return request.match_info["id"]


class OutputEncoder:
    """Output chunks → JSON-safe strings: text (incremental UTF-8, invalid bytes replaced, a
    character split across chunks kept whole) or base64."""

    def __init__(self, encoding: str) -> None:
        self.b64 = encoding == "base64"
        self.dec = {s: codecs.getincrementaldecoder("utf-8")("replace")
                    for s in ("stdout", "stderr")}

    def encode(self, stream: str, data: bytes, final: bool = False) -> str:
        if self.b64:
            return base64.b64encode(data).decode()
        return str(self.dec[stream].decode(data, final))

    def flush(self) -> list[tuple[str, str]]:
        if self.b64:
            return []
        out = []
        for s, d in self.dec.items():
            rest = d.decode(b"", True)
            if rest:
                out.append((s, rest))
        return out


class ClientGone(ConnectionResetError):
    """The client closed or lost its connection while its exec streamed."""


async def until_gone(request: web.Request) -> None:
    """Return once the request's client has gone. Polled: aiohttp neither cancels a handler
    when its client goes nor tells it, and a silent exec (``sleep``) writes nothing that
    could fail."""
    while not client_gone(request):
        await asyncio.sleep(DISCONNECT_POLL_S)


async def stream_events(events: AsyncIterator[dict[str, Any]],
                  send: Callable[[dict[str, Any]], Awaitable[None]],
                  gone: Awaitable[None]) -> None:
    """``send`` every event, unless ``gone`` (the client's going) completes first: then
    :class:`ClientGone` (an error ``gone`` raised is raised as it is). The exec's
    context (:meth:`SandboxManager.exec`) then kills what is left of the exec."""

    async def pump() -> None:
        async for ev in events:
            await send(ev)

    pumping = asyncio.ensure_future(pump())
    watching = asyncio.ensure_future(gone)
    try:
        await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (pumping, watching):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
    if pumping.done() and not pumping.cancelled():
        pumping.result()
        return
    watching.result()
    raise ClientGone("the client went away")


async def stream_file(request: web.Request, it: AsyncIterator[bytes]) -> web.StreamResponse:
    """Answer with a file's chunks (``application/octet-stream``, chunked). The first chunk
    is pulled before the answer starts, so that a file that cannot be read is a proper
    error status, not a truncated 200."""
    try:
        first: bytes | None = await it.__anext__()
    except StopAsyncIteration:
        first = None
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    if first:
        await resp.write(first)
        async for chunk in it:
            await resp.write(chunk)
    await resp.write_eof()
    return resp
