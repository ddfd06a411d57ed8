"""A node's HTTP relay: the cluster's data path to one daemon, without a Ray call.

The node's relay actor (:class:`~edged.cluster.node.NodeAgent`) serves it on the node's Ray
IP address (``host``; port ``port``, 0 for any free one) and advertises its URL and token in
its reports; the registry hands them to cluster clients (:meth:`ClusterClient.nodes
<edged.cluster.ClusterClient.nodes>` readers see the URL, never the token in ``edged cluster
nodes``). A client speaks the daemon's own HTTP/NDJSON API to it (the SDK's transport, over
TCP instead of the Unix socket), with ``Authorization: Bearer <token>``; the relay forwards
each ``/v1/`` request to the daemon's socket over kept-alive connections and streams the
answer back as it comes (exec output, downloads), the request body too (uploads).

Answers of the relay itself (never the daemon's), in the daemon's error form
``{"error": {"code", "message"}}``:

- 401 ``unauthorized``: no token or a wrong one (compared in constant time,
  :func:`hmac.compare_digest`); nothing is sent to the daemon;
- 400 ``bad_request``: a path outside ``/v1/``;
- 502 ``unavailable``: the daemon's socket does not answer (the SDK raises
  :class:`~edged.client.errors.DaemonUnavailableError`).

A client that goes away mid-answer cancels the forwarded request (the daemon sees its
connection close: an exec is abandoned and ended). Nothing here imports Ray.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("edged.cluster.http_relay")

#: ``on_answer(method, path, status, body)``: called with each whole JSON answer of a
#: create (``POST /v1/sandboxes``) or delete (``DELETE /v1/sandboxes/<id>``)
OnAnswer = Callable[[str, str, int, Any], None]
#: request headers passed on to the daemon
_PASS_REQUEST = ("Content-Type", "Accept")
#: answer headers passed back to the client
_PASS_ANSWER = ("Content-Type", "Retry-After")
#: bodies up to this size are read whole and sent in one piece; larger or unsized ones are
#: streamed as they come
_WHOLE_MAX = 1 << 20
#: idle client connections are closed after this long (s); clients drop theirs sooner
KEEPALIVE_S = 75.0


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _noted(method: str, path: str) -> bool:
    return (method == "POST" and path == "/v1/sandboxes") or \
        (method == "DELETE" and path.startswith("/v1/sandboxes/") and path.count("/") == 3)


class HttpRelay:
    """An authenticated HTTP relay for the daemon on ``socket`` (see the module docstring).
    ``token``: the secret clients must send; ``on_answer``: told of creates and deletes
    (the node's reports list them at once)."""

    def __init__(self, socket: str, token: str, on_answer: OnAnswer | None = None) -> None:
        if not token:
            raise ValueError("an HTTP relay needs a token")
        self.socket = socket
        self.token = token
        self._token = token.encode()
        self.on_answer = on_answer
        self.url: str | None = None
        self.calls = 0  # requests forwarded to the daemon
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    def session(self) -> aiohttp.ClientSession:
        """The pool of connections to the daemon (no cap: every exec stream is one)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket, limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
                auto_decompress=False)
        return self._session

    async def start(self, host: str, port: int = 0) -> str:
        """Listen on ``host``:``port`` (0: any free port); the relay's URL. Raises
        ``OSError`` if the address cannot be bound."""
        app = web.Application(client_max_size=0)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               keepalive_timeout=KEEPALIVE_S)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        h = f"[{host}]" if ":" in host else host
        self.url = f"http://{h}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        """Stop listening; close the daemon connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.url = None

    def authorized(self, request: web.Request) -> bool:
        """Whether ``request`` carries this relay's token (constant-time comparison)."""
        got = request.headers.get("Authorization", "")
        scheme, _, token = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self._token)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Forward one request (see the module docstring)."""
        if not self.authorized(request):
            return _error(401, "unauthorized", "the cluster relay needs its node's token")
        path = request.path
        if not path.startswith("/v1/"):
            return _error(400, "bad_request", f"path {path!r}: only /v1/ paths are relayed")
        headers = {h: request.headers[h] for h in _PASS_REQUEST if h in request.headers}
        data: Any = None
        if request.body_exists:  # a small sized body (a create) whole, others streamed
            size = request.content_length
            data = await request.read() if size is not None and size <= _WHOLE_MAX \
                else request.content.iter_any()
        self.calls += 1
        try:
            upstream = await self.session().request(
                request.method, "http://edged" + request.path_qs, data=data, headers=headers)
        except aiohttp.ClientConnectionError as e:
            return _error(502, "unavailable", f"edged at {self.socket}: {e}")
        async with upstream:
            out = {h: upstream.headers[h] for h in _PASS_ANSWER if h in upstream.headers}
            size = upstream.content_length
            if size is not None and size <= _WHOLE_MAX:
                try:
                    body = await upstream.read()
                except aiohttp.ClientError as e:
                    return _error(502, "unavailable", f"edged at {self.socket}: {e}")
                if self.on_answer is not None and _noted(request.method, path):
                    self._tell(request.method, path, upstream.status, body)
                return web.Response(status=upstream.status, body=body, headers=out)
            resp = web.StreamResponse(status=upstream.status, headers=out)
            await resp.prepare(request)
            try:
                async for piece in upstream.content.iter_any():
                    await resp.write(piece)
            except ConnectionResetError:  # the client went away: the daemon's request ends
                return resp
            except aiohttp.ClientError as e:  # the daemon went away mid-answer: cut it short
                log.warning("relay %s %s: the daemon's answer broke off: %s",
                            request.method, path, e)
                if request.transport is not None:
                    request.transport.abort()
                return resp
            await resp.write_eof()
            return resp

    def _tell(self, method: str, path: str, status: int, body: bytes) -> None:
        assert self.on_answer is not None
        try:
            value = json.loads(body)
        except ValueError:
            return
        try:
            self.on_answer(method, path, status, value)
        except Exception:  # a note gone wrong must not fail the client's call
            log.exception("relay: noting %s %s", method, path)

