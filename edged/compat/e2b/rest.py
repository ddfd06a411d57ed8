"""E2B's control API (facts of its public OpenAPI spec) over edged's sandbox manager.

``POST /sandboxes`` and ``/v2/sandboxes`` create (``templateID``: an edged image name,
``name:tag``, or ``name`` for ``name:latest``; ``timeout``: the TTL in seconds, default
300; ``envVars``: the sandbox's environment; ``metadata``: kept and filtered on); ``GET
/sandboxes``, ``/v2/sandboxes`` list (``metadata=k=v&...``, ``state=running,paused``,
``limit`` and ``nextToken`` pages, the next in ``x-next-token``); ``GET /sandboxes/{id}``;
``DELETE /sandboxes/{id}``; ``POST /sandboxes/{id}/timeout`` (a new TTL from now);
``POST /sandboxes/{id}/pause`` (freeze; 409 if paused) and ``/resume`` or
``/v2/sandboxes/{id}/connect`` (thaw; 201 when it was paused, 200 when it ran);
``POST /sandboxes/{id}/refreshes`` (keep-alive: a new TTL of ``duration``); ``GET
/sandboxes/{id}/metrics``. Every answer that names a sandbox carries its envd access token.
"""

from __future__ import annotations

import datetime
import json
import secrets
import time
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web

from edged.compat.e2b.state import ENVD_VERSION, STATE, TEAM, E2bState, Meta
from edged.errors import BadRequest, Conflict, NotFound
from edged.node.requests import CreateRequest, TimeoutRequest
from edged.node.sandbox import SandboxRecord, State

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 86400.0
CLIENT_ID = "edged"


def _iso(t: float | None) -> str:
    return datetime.datetime.fromtimestamp(t or 0, datetime.UTC).isoformat().replace(
        "+00:00", "Z")


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.body_exists:
        return {}
    try:
        b = json.loads(await request.read() or b"{}")
    except ValueError as e:
        raise BadRequest(f"body: not valid JSON: {e}") from e
    if not isinstance(b, dict):
        raise BadRequest("body: must be a JSON object")
    return b


def _timeout(v: object, default: float | None) -> float | None:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= MAX_TIMEOUT_S:
        raise BadRequest(f"timeout: must be 0 to {MAX_TIMEOUT_S:g} seconds")
    return float(v)


def _str_map(v: object, what: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str)
                                          for k, x in v.items()):
        raise BadRequest(f"{what}: must be an object of string to string")
    if len(v) > 256 or sum(len(k) + len(x) for k, x in v.items()) > 64 << 10:
        raise BadRequest(f"{what}: too large")
    return dict(v)


def _mine(request: web.Request, sandbox_id: str) -> tuple[E2bState, Meta, SandboxRecord]:
    st = request.app[STATE]
    meta = st.meta.get(sandbox_id)
    if meta is None or meta.team != request[TEAM]:
        raise NotFound(f"sandbox {sandbox_id} not found")
    try:
        rec = st.manager.get(sandbox_id)
    except NotFound:
        st.forget(sandbox_id)
        raise
    return st, meta, rec


def _sandbox(st: E2bState, sid: str, meta: Meta) -> dict[str, Any]:
    return {"sandboxID": sid, "templateID": meta.template, "alias": meta.alias,
            "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
            "envdAccessToken": st.token(sid)}


def _state(rec: SandboxRecord) -> str:
    return "paused" if rec.state is State.PAUSED else "running"


def _listed(st: E2bState, sid: str, meta: Meta, rec: SandboxRecord) -> dict[str, Any]:
    r = rec.resources
    return {"sandboxID": sid, "templateID": meta.template, "alias": meta.alias,
            "clientID": CLIENT_ID, "startedAt": _iso(meta.started_at or rec.created_at),
            "endAt": _iso(rec.expires_at or time.time() + 365 * 86400),
            "cpuCount": max(1, round(r.cpus)), "memoryMB": r.memory_bytes >> 20,
            "diskSizeMB": r.disk_bytes >> 20, "metadata": meta.metadata,
            "state": _state(rec), "envdVersion": ENVD_VERSION}


async def create(request: web.Request) -> web.StreamResponse:
    """POST /sandboxes, /v2/sandboxes → 201 Sandbox."""
    st = request.app[STATE]
    b = await _body(request)
    template = b.get("templateID")
    if not isinstance(template, str) or not template:
        raise BadRequest("templateID: required (an edged image name)")
    image = template if ":" in template else template + ":latest"
    try:
        st.manager.images.get(image)
    except NotFound as e:
        raise NotFound(f"template {template!r}: no image {image!r} on this node") from e
    timeout = _timeout(b.get("timeout"), DEFAULT_TIMEOUT_S)
    metadata = _str_map(b.get("metadata"), "metadata")
    env = _str_map(b.get("envVars"), "envVars")
    sid = "e2b-" + secrets.token_hex(8)
    meta = Meta(team=request[TEAM], template=template, alias=template, metadata=metadata,
                started_at=time.time(), timeout_s=timeout or 0.0)
    st.save(sid, meta)
    try:
        await st.manager.create(CreateRequest(id=sid, image=image, env=env, ttl_s=timeout,
                                              labels={"e2b": "1"}))
    except BaseException:
        st.forget(sid)
        raise
    return web.json_response(_sandbox(st, sid, meta), status=201)


def _matches(meta: Meta, rec: SandboxRecord, want: dict[str, str], states: set[str]) -> bool:
    return (all(meta.metadata.get(k) == v for k, v in want.items())
            and (not states or _state(rec) in states))


async def list_sandboxes(request: web.Request) -> web.StreamResponse:
    """GET /sandboxes, /v2/sandboxes → [ListedSandbox] (pages: limit, nextToken)."""
    st = request.app[STATE]
    st.prune()
    want = dict(parse_qsl(request.query.get("metadata", ""), keep_blank_values=True))
    states = {s for s in request.query.get("state", "").split(",") if s}
    if states - {"running", "paused"}:
        raise BadRequest("state: running and/or paused")
    rows = []
    for sid, meta in sorted(st.meta.items(), key=lambda kv: (kv[1].started_at, kv[0])):
        if meta.team != request[TEAM]:
            continue
        try:
            rec = st.manager.get(sid)
        except NotFound:
            continue
        if rec.state in (State.RUNNING, State.PAUSED) and _matches(meta, rec, want, states):
            rows.append(_listed(st, sid, meta, rec))
    try:
        limit = int(request.query.get("limit", "1000"))
        start = int(request.query.get("nextToken") or "0")
    except ValueError as e:
        raise BadRequest("limit / nextToken: integers") from e
    if not 1 <= limit <= 1000 or start < 0:
        raise BadRequest("limit: 1 to 1000")
    page = rows[start:start + limit]
    headers = {"x-next-token": str(start + limit)} if start + limit < len(rows) else {}
    return web.json_response(page, headers=headers)


async def get(request: web.Request) -> web.StreamResponse:
    """GET /sandboxes/{id} → SandboxDetail."""
    sid = request.match_info["id"]
    st, meta, rec = _mine(request, sid)
    return web.json_response({**_listed(st, sid, meta, rec), "envdAccessToken": st.token(sid)})


async def kill(request: web.Request) -> web.StreamResponse:
    """DELETE /sandboxes/{id} → 204."""
    sid = request.match_info["id"]
    st, _, _ = _mine(request, sid)
    await st.manager.delete(sid)
    st.forget(sid)
    return web.Response(status=204)


async def set_timeout(request: web.Request) -> web.StreamResponse:
    """POST /sandboxes/{id}/timeout {timeout} → 204."""
    sid = request.match_info["id"]
    st, meta, _ = _mine(request, sid)
    b = await _body(request)
    timeout = _timeout(b.get("timeout"), None)
    if timeout is None:
        raise BadRequest("timeout: required")
    st.manager.set_timeout(sid, TimeoutRequest(ttl_s=timeout))
    meta.timeout_s = timeout
    st.save(sid, meta)
    return web.Response(status=204)


async def refresh(request: web.Request) -> web.StreamResponse:
    """POST /sandboxes/{id}/refreshes {duration} → 204 (a new TTL of duration seconds)."""
    sid = request.match_info["id"]
    st, _, _ = _mine(request, sid)
    b = await _body(request)
    st.manager.set_timeout(sid, TimeoutRequest(ttl_s=_timeout(b.get("duration"), 60.0)))
    return web.Response(status=204)


async def pause(request: web.Request) -> web.StreamResponse:
    """POST /sandboxes/{id}/pause → 204; 409 if already paused."""
    sid = request.match_info["id"]
    st, _, rec = _mine(request, sid)
    if rec.state is State.PAUSED:
        raise Conflict(f"sandbox {sid} is already paused")
    await st.manager.pause(sid)
    return web.Response(status=204)


async def connect(request: web.Request) -> web.StreamResponse:
    """POST /sandboxes/{id}/resume, /v2/sandboxes/{id}/connect {timeout} → 201 Sandbox if
    it was paused (now running), 200 if it was running."""
    sid = request.match_info["id"]
    st, meta, rec = _mine(request, sid)
    b = await _body(request)
    timeout = _timeout(b.get("timeout"), None)
    status = 200
    if rec.state is State.PAUSED:
        await st.manager.resume(sid)
        status = 201
    if timeout is not None:
        st.manager.set_timeout(sid, TimeoutRequest(ttl_s=timeout))
    return web.json_response(_sandbox(st, sid, meta), status=status)


async def metrics(request: web.Request) -> web.StreamResponse:
    """GET /sandboxes/{id}/metrics → one sample of now."""
    sid = request.match_info["id"]
    st, _, rec = _mine(request, sid)
    s = await st.manager.stats(sid)
    r = rec.resources
    return web.json_response([{
        "timestamp": _iso(time.time()), "timestampUnix": int(time.time()),
        "cpuCount": max(1, round(r.cpus)), "cpuUsedPct": 0.0,
        "memUsed": int(s.get("memory_bytes", 0)), "memTotal": r.memory_bytes,
        "memCache": 0, "diskUsed": int(s.get("upper_bytes", 0)), "diskTotal": r.disk_bytes}])


def routes() -> list[tuple[str, str, Any]]:
    """(method, path, handler) of the control API."""
    return [
        ("POST", "/sandboxes", create), ("POST", "/v2/sandboxes", create),
        ("GET", "/sandboxes", list_sandboxes), ("GET", "/v2/sandboxes", list_sandboxes),
        ("GET", "/sandboxes/{id}", get), ("DELETE", "/sandboxes/{id}", kill),
        ("POST", "/sandboxes/{id}/timeout", set_timeout),
        ("POST", "/sandboxes/{id}/refreshes", refresh),
        ("POST", "/sandboxes/{id}/pause", pause),
        ("POST", "/sandboxes/{id}/resume", connect),
        ("POST", "/v2/sandboxes/{id}/connect", connect),
        ("GET", "/sandboxes/{id}/metrics", metrics),
    ]


__all__ = ["routes"]
