"""Routes of the ``/v1`` API on aiohttp.

Errors have one body shape everywhere, ``{"error": {"code": str, "message": str}}``, with the
HTTP status of the :class:`~edged.errors.EdgedError` subclass (Firecracker's API is the
model); ``capacity_exhausted`` adds ``Retry-After`` (whole seconds). The spec of every route
and response is ``openapi.json`` in this package; tests check the server against it.

Exec output streams as NDJSON over chunked HTTP: ``{"start": {"exec_id"}}``, then
``{"stdout": s}`` / ``{"stderr": s}`` (text, or base64 with ``"encoding": "base64"``), then
one ``{"end": {...}}``. The WebSocket variant (``/exec/ws``) carries the same events as text
messages and takes stdin, EOF, resize and signal messages from the client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import errno
import json
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from aiohttp import WSMsgType, web

from edged.api import fncalls, harness, requests
from edged.api.common import (
    FILE_CHUNK,
    MANAGER,
    MAX_JSON_BODY,
    ClientGone,
    Handler,
    OutputEncoder,
    client_gone,
    json_body,
    manager_of,
    sandbox_id_of,
    stream_events,
    stream_file,
    until_gone,
)
from edged.backends.base import ExecEnd, ExecHandle
from edged.errors import BadRequest, EdgedError
from edged.node.manager import SandboxManager
from edged.security import http as security_http
from edged.security.ledger import Ledger

log = logging.getLogger("edged.api")

def error_response(code: str, message: str, status: int,
                   retry_after: float | None = None) -> web.Response:
    """The one error body shape, ``{"error": {"code", "message"}}``."""
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return web.json_response(
        {"error": {"code": code, "message": message}}, status=status, headers=headers
    )


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every exception into the one error body shape (typed errors keep their status;
    anything unexpected is a logged 500 ``internal``)."""
    mgr = request.app[MANAGER]
    try:
        return await handler(request)
    except EdgedError as e:
        mgr.metrics.api_errors.labels(code=e.code).inc()
        return error_response(e.code, e.message, e.status, e.retry_after)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            e.status, "bad_request")
        mgr.metrics.api_errors.labels(code=code).inc()
        return error_response(code, f"{request.method} {request.path}: {e.reason}", e.status)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            # Out of descriptors for a moment (creates are refused before this, see
            # edged.node.fds): a typed 503 the client retries, not a 500 and a traceback.
            log.warning("%s %s: %s", request.method, request.path, e)
            mgr.metrics.api_errors.labels(code="capacity_exhausted").inc()
            return error_response("capacity_exhausted",
                                  f"node out of file descriptors: {e.strerror}", 503,
                                  mgr.config.retry_after_s)
        if isinstance(e, ConnectionError) and client_gone(request):
            # aiohttp says so in several ways (ConnectionResetError, "Cannot write to
            # closing transport", ConnectionError("Connection lost") from a drain): none
            # is an error of ours, and there is nobody left to answer
            log.debug("%s %s: the client went away (%s)", request.method, request.path, e)
            return web.Response(status=499)
        log.exception("unhandled error in %s %s", request.method, request.path)
        mgr.metrics.api_errors.labels(code="internal").inc()
        return error_response("internal", f"internal error: {type(e).__name__}: {e}", 500)


# -- sandboxes ----------------------------------------------------------------------------


async def create_sandbox(request: web.Request) -> web.Response:
    """POST /v1/sandboxes → 201 sandbox (spec: createSandbox)."""
    rec = await manager_of(request).create(requests.parse_create(await json_body(request)))
    return web.json_response(rec.to_json(), status=201)


async def list_sandboxes(request: web.Request) -> web.Response:
    """GET /v1/sandboxes?label=k=v... → sandboxes carrying every label."""
    want: dict[str, str] = {}
    for sel in request.query.getall("label", []):
        k, sep, v = sel.partition("=")
        if not sep:
            raise BadRequest(f"label {sel!r}: must be key=value")
        want[k] = v
    requests.labels(want, bounded=False)
    recs = manager_of(request).find(want)
    return web.json_response({"sandboxes": [r.to_json() for r in recs]})


async def get_sandbox(request: web.Request) -> web.Response:
    """GET /v1/sandboxes/{id} → the sandbox object."""
    return web.json_response(manager_of(request).get(sandbox_id_of(request)).to_json())


async def delete_sandbox(request: web.Request) -> web.Response:
    """DELETE /v1/sandboxes/{id} → the final object (state stopped)."""
    rec = await manager_of(request).delete(sandbox_id_of(request))
    return web.json_response(rec.to_json())


async def pause_sandbox(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/pause → the sandbox (paused)."""
    return web.json_response((await manager_of(request).pause(sandbox_id_of(request))).to_json())


async def resume_sandbox(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/resume → the sandbox (running)."""
    return web.json_response((await manager_of(request).resume(sandbox_id_of(request))).to_json())


async def set_timeout(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/timeout {ttl_s, idle_timeout_s} → the sandbox."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    body = await json_body(request)
    mgr.get(sid)  # an unknown sandbox is a 404 whatever the body
    rec = mgr.set_timeout(sid, requests.parse_timeout(body))
    return web.json_response(rec.to_json())


async def signal_sandbox(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/signal {signal, exec_id?, all?} → {exec_ids, killed?}."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    body = await json_body(request)
    mgr.get(sid)
    return web.json_response(await mgr.signal(sid, requests.parse_signal(body)))


async def put_network(request: web.Request) -> web.Response:
    """PUT /v1/sandboxes/{id}/network ("none" | {"allow": [...]}) → {policy, generation, cut}."""
    out = await manager_of(request).set_network(
        sandbox_id_of(request), requests.parse_network(await json_body(request)))
    return web.json_response(out)


async def get_network(request: web.Request) -> web.Response:
    """GET /v1/sandboxes/{id}/network → policy, addresses, resolver, counters."""
    return web.json_response(manager_of(request).network_info(sandbox_id_of(request)))


async def sandbox_stats(request: web.Request) -> web.Response:
    """GET /v1/sandboxes/{id}/stats → backend usage figures."""
    return web.json_response(await manager_of(request).stats(sandbox_id_of(request)))


# -- exec ---------------------------------------------------------------------------------


def end_json(end: ExecEnd, exec_id: int) -> dict[str, Any]:
    """The ``end`` event's object (``message`` only when the end has one)."""
    d = asdict(end)
    if d["message"] is None:
        del d["message"]
    d["exec_id"] = exec_id
    return d


async def _events(handle: ExecHandle, enc: OutputEncoder) -> AsyncIterator[dict[str, Any]]:
    yield {"start": {"exec_id": handle.exec_id}}
    async for ev in handle.events():
        if isinstance(ev, ExecEnd):
            for s, text in enc.flush():
                yield {s: text}
            yield {"end": end_json(ev, handle.exec_id)}
            return
        stream, data = ev
        text = enc.encode(stream, data)
        if text:
            yield {stream: text}


async def exec_ndjson(request: web.Request) -> web.StreamResponse:
    """POST /v1/sandboxes/{id}/exec → NDJSON stream: start, output chunks, end."""
    mgr = manager_of(request)
    sid = sandbox_id_of(request)
    body = await json_body(request)
    mgr.get(sid)  # an unknown sandbox is a 404 whatever the body
    req = requests.parse_exec(body)
    spec = mgr.exec_spec(sid, req)
    enc = OutputEncoder(req.encoding)
    stdin = req.stdin
    # stdin true: kept open, fed by POST .../execs/{exec_id}/stdin (or use exec/ws)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    resp.enable_chunked_encoding()
    ended: dict[str, Any] | None = None

    async def send(ev: dict[str, Any]) -> None:
        nonlocal ended
        if "end" in ev:
            ended = ev["end"]
        try:
            await resp.write(json.dumps(ev).encode() + b"\n")
        except ConnectionError as e:
            raise ClientGone(str(e)) from e

    try:
        async with mgr.exec(sid, spec) as handle:
            if spec.pty and req.rows is not None and req.cols is not None:
                await handle.resize(req.rows, req.cols)
            feeder = None
            if isinstance(stdin, str) and stdin:
                async def feed() -> None:
                    with contextlib.suppress(Exception):
                        await handle.write_stdin(stdin.encode())
                        await handle.close_stdin()
                feeder = asyncio.ensure_future(feed())
            try:
                await resp.prepare(request)
                await stream_events(_events(handle, enc), send, until_gone(request))
            finally:
                if feeder is not None:
                    feeder.cancel()
                if ended is not None:
                    mgr.metrics.execs.labels(reason=ended["reason"]).inc()
                    mgr.metrics.exec_seconds.observe(ended["duration_s"])
        await resp.write_eof()
    except ClientGone as e:
        log.debug("exec in %s: the client went away (%s)", sid, e)
    return resp


async def exec_ws(request: web.Request) -> web.StreamResponse:
    """GET /v1/sandboxes/{id}/exec/ws: the WebSocket variant (stdin, PTY, resize)."""
    mgr = manager_of(request)
    sid = sandbox_id_of(request)
    mgr.get(sid)  # 404 before the upgrade
    ws = web.WebSocketResponse(heartbeat=30)
    await ws.prepare(request)
    try:
        msg = await ws.receive_json(timeout=30)
        if not isinstance(msg, dict):
            raise BadRequest("first message: must be the exec object")
        req = requests.parse_exec(msg, stdin_default=True)
        spec = mgr.exec_spec(sid, req)
        enc = OutputEncoder(req.encoding)

        async def send(ev: dict[str, Any]) -> None:
            try:
                await ws.send_json(ev)
            except ConnectionError as e:
                raise ClientGone(str(e)) from e
            if "end" in ev:
                mgr.metrics.execs.labels(reason=ev["end"]["reason"]).inc()

        async with mgr.exec(sid, spec) as handle:
            if spec.pty and req.rows is not None and req.cols is not None:
                await handle.resize(req.rows, req.cols)
            # the reader ends when the client closes the WebSocket (or loses it)
            await stream_events(_events(handle, enc), send, _ws_input(ws, handle))
    except ClientGone as e:
        log.debug("exec in %s: the client went away (%s)", sid, e)
    except EdgedError as e:
        with contextlib.suppress(ConnectionError):
            await ws.send_json({"error": {"code": e.code, "message": e.message}})
    except (ValueError, TypeError) as e:
        with contextlib.suppress(ConnectionError):
            await ws.send_json({"error": {"code": "bad_request", "message": str(e)}})
    finally:
        await ws.close()
    return ws


async def _ws_input(ws: web.WebSocketResponse, handle: ExecHandle) -> None:
    """Client → exec: binary = stdin bytes; text JSON ``{"stdin": s}``, ``{"stdin_b64": s}``,
    ``{"eof": true}``, ``{"resize": {"rows", "cols"}}``, ``{"signal": n}``. A bad message
    is answered with an error message (the one error shape) and ignored: the reader goes on,
    so later stdin, EOF and signals still reach the exec."""
    async for msg in ws:
        if msg.type == WSMsgType.BINARY:
            await handle.write_stdin(msg.data)
            continue
        if msg.type != WSMsgType.TEXT:
            break
        try:
            await _ws_control(handle, msg.data)
        except (EdgedError, ValueError, TypeError, KeyError, binascii.Error,
                RecursionError) as e:
            text = e.message if isinstance(e, EdgedError) else f"{type(e).__name__}: {e}"
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await ws.send_json({"error": {"code": "bad_request",
                                              "message": f"control message: {text}"}})


def _int_field(m: dict[str, Any], k: str, lo: int, hi: int) -> int:
    v = m.get(k)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"{k}: must be an integer in [{lo}, {hi}]")
    return v


async def _ws_control(handle: ExecHandle, data: str) -> None:
    """Carry out one text message of the WebSocket exec; BadRequest (or ValueError) if it is
    not a well-formed one."""
    m = json.loads(data)
    if not isinstance(m, dict):
        raise BadRequest("must be a JSON object")
    if "stdin" in m:
        if not isinstance(m["stdin"], str):
            raise BadRequest("stdin: must be a string")
        await handle.write_stdin(m["stdin"].encode())
    if "stdin_b64" in m:
        if not isinstance(m["stdin_b64"], str):
            raise BadRequest("stdin_b64: must be a string")
        await handle.write_stdin(base64.b64decode(m["stdin_b64"], validate=True))
    if m.get("eof"):
        await handle.close_stdin()
    if "resize" in m:
        r = m["resize"]
        if not isinstance(r, dict):
            raise BadRequest("resize: must be {rows, cols}")
        await handle.resize(_int_field(r, "rows", 1, 65535), _int_field(r, "cols", 1, 65535))
    if "signal" in m:
        await handle.signal(_int_field(m, "signal", 1, 64))


# -- files --------------------------------------------------------------------------------


def _path_query(request: web.Request) -> str:
    path = request.query.get("path")
    if not path:
        raise BadRequest("path: query parameter required")
    return path


async def put_file(request: web.Request) -> web.Response:
    """PUT /v1/sandboxes/{id}/files?path=&mode= (streamed body) → bytes written."""
    path = _path_query(request)
    try:
        mode = int(request.query.get("mode", "644"), 8)
        uid = int(request.query.get("uid", "0"))
        gid = int(request.query.get("gid", "0"))
    except ValueError as e:
        raise BadRequest(f"mode/uid/gid: {e}") from e
    parents = request.query.get("parents", "0")
    if parents not in ("0", "1", "true", "false"):
        raise BadRequest("parents: must be 0 or 1")
    if not 0 <= mode <= 0o7777:
        raise BadRequest("mode: must be octal within 0..7777")

    async def chunks() -> AsyncIterator[bytes]:
        async for chunk in request.content.iter_chunked(FILE_CHUNK):
            yield chunk

    n = await manager_of(request).put_file(sandbox_id_of(request), path, chunks(), mode=mode,
                                           uid=uid, gid=gid,
                                           parents=parents in ("1", "true"))
    return web.json_response({"path": path, "bytes": n})


async def get_file(request: web.Request) -> web.StreamResponse:
    """GET /v1/sandboxes/{id}/files?path= → the file, streamed."""
    path = _path_query(request)
    return await stream_file(request, await manager_of(request).get_file(
        sandbox_id_of(request), path))


# -- images, node, metrics ----------------------------------------------------------------


async def list_images(request: web.Request) -> web.Response:
    """GET /v1/images → every registered image."""
    return web.json_response({"images": manager_of(request).images.all()})


async def put_image(request: web.Request) -> web.Response:
    """POST /v1/images {name, layers} → 201 image."""
    body = await json_body(request)
    if not isinstance(body, dict) or set(body) != {"name", "layers"}:
        raise BadRequest("body: must be {\"name\": \"name:tag\", \"layers\": [digest, ...]}")
    mgr = manager_of(request)
    return web.json_response(mgr.images.put(body["name"], body["layers"]), status=201)


async def get_image(request: web.Request) -> web.Response:
    """GET /v1/images/{name:tag} → the image."""
    return web.json_response(manager_of(request).images.get(request.match_info["ref"]))


async def delete_image(request: web.Request) -> web.Response:
    """DELETE /v1/images/{name:tag} → the image removed."""
    mgr = manager_of(request)
    ref = request.match_info["ref"]
    img = mgr.images.get(ref)
    mgr.images.delete(ref)
    return web.json_response(img)


async def run_fncall(request: web.Request) -> web.Response:
    """POST /v1/fncalls → the call's compile result, one result per case, its kept
    artifact (see :mod:`edged.api.fncalls`)."""
    req, encoding = fncalls.parse_call(await json_body(request))
    resp = await fncalls.call_backend(manager_of(request).backends).call(req)
    return web.json_response(fncalls.response_json(resp, encoding))


async def fncall_languages(request: web.Request) -> web.Response:
    """GET /v1/fncalls/languages → {name: {compiled, source, available}}."""
    return web.json_response(fncalls.call_backend(manager_of(request).backends).languages())


async def node_info(request: web.Request) -> web.Response:
    """GET /v1/node → capacity, allocations, layer mounts, probed features."""
    return web.json_response(manager_of(request).node_info())


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics → Prometheus text format."""
    m = manager_of(request).metrics
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/v1/sandboxes", create_sandbox),
    ("GET", "/v1/sandboxes", list_sandboxes),
    ("GET", "/v1/sandboxes/{id}", get_sandbox),
    ("DELETE", "/v1/sandboxes/{id}", delete_sandbox),
    ("POST", "/v1/sandboxes/{id}/exec", exec_ndjson),
    ("GET", "/v1/sandboxes/{id}/exec/ws", exec_ws),
    ("POST", "/v1/sandboxes/{id}/signal", signal_sandbox),
    ("PUT", "/v1/sandboxes/{id}/files", put_file),
    ("GET", "/v1/sandboxes/{id}/files", get_file),
    ("POST", "/v1/sandboxes/{id}/pause", pause_sandbox),
    ("POST", "/v1/sandboxes/{id}/resume", resume_sandbox),
    ("POST", "/v1/sandboxes/{id}/timeout", set_timeout),
    ("GET", "/v1/sandboxes/{id}/stats", sandbox_stats),
    ("PUT", "/v1/sandboxes/{id}/network", put_network),
    ("GET", "/v1/sandboxes/{id}/network", get_network),
    ("GET", "/v1/images", list_images),
    ("POST", "/v1/images", put_image),
    ("GET", "/v1/images/{ref}", get_image),
    ("DELETE", "/v1/images/{ref}", delete_image),
    ("GET", "/v1/node", node_info),
    ("POST", "/v1/fncalls", run_fncall),
    ("GET", "/v1/fncalls/languages", fncall_languages),
    ("GET", "/v1/sandboxes/{id}/events", security_http.sandbox_events),
    ("GET", "/v1/events", security_http.node_events),
    ("GET", "/metrics", metrics),
    *harness.ROUTES,
]


def make_app(manager: SandboxManager) -> web.Application:
    """The aiohttp application serving :data:`ROUTES` for ``manager``."""
    app = web.Application(middlewares=[errors_middleware], client_max_size=MAX_JSON_BODY)
    app[MANAGER] = manager
    # the security-event ledger's routes (edged.security.http) read it from the app
    app[security_http.LEDGER] = manager.ledger if manager.ledger is not None else Ledger(None)
    for method, path, handler in ROUTES:
        # Image refs contain ':' and may contain '/'.
        app.router.add_route(method, path.replace("{ref}", "{ref:.+}"), handler)
    return app
