"""HTTP routes of the security-event ledger, for the daemon to mount on its aiohttp app.

``GET /v1/sandboxes/{id}/events``: ``{"events": [event...], "next": seq, "truncated": n}``;
query ``since`` (seq, default 0), ``kind`` (repeatable), ``limit`` (1..100000, default 1000).
With ``follow=1`` the answer is NDJSON instead: the backlog, then new events as they happen,
one JSON object per line; ``{"gap": n}`` when the reader fell behind and n events were lost.
``GET /v1/events``: the node-wide NDJSON stream (same ``since``/``kind``; backlog from memory).

Errors are :mod:`edged.errors` exceptions (404 for a sandbox the ledger does not know, 400 for
bad parameters), which the daemon's error middleware turns into the one error body shape.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from edged.errors import BadRequest
from edged.security.ledger import Ledger, SecurityEvent, Subscription

LEDGER: web.AppKey[Ledger] = web.AppKey("security_ledger", Ledger)


def _int_param(request: web.Request, name: str, default: int) -> int:
    """A non-negative integer query parameter (event sequence numbers start at 1)."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError as e:
        raise BadRequest(f"query {name}: {raw!r} is not an integer") from e
    if v < 0:
        raise BadRequest(f"query {name}: {v} must be >= 0")
    return v


def _kinds(request: web.Request) -> list[str] | None:
    ks = request.query.getall("kind", [])
    return ks or None


async def _stream(request: web.Request, backlog: list[SecurityEvent], sub: Subscription
                  ) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    last = 0
    try:
        for ev in backlog:
            await resp.write(json.dumps(ev.to_json()).encode() + b"\n")
            last = ev.seq
        dropped = 0
        async for ev in sub:
            if sub.dropped != dropped:
                await resp.write(json.dumps({"gap": sub.dropped - dropped}).encode() + b"\n")
                dropped = sub.dropped
            if ev.seq <= last:
                continue  # already sent in the backlog
            await resp.write(json.dumps(ev.to_json()).encode() + b"\n")
    finally:
        sub.close()
    return resp


async def sandbox_events(request: web.Request) -> web.StreamResponse:
    """``GET /v1/sandboxes/{id}/events`` (see the module docstring)."""
    ledger = request.app[LEDGER]
    sid = request.match_info["id"]
    since = _int_param(request, "since", 0)
    limit = _int_param(request, "limit", 1000)
    kinds = _kinds(request)
    if request.query.get("follow") in ("1", "true"):
        sub = ledger.subscribe(sid, kinds=kinds)  # before the backlog: no event falls between
        try:
            backlog = ledger.events(sid, since=since, kinds=kinds, limit=100_000)
        except Exception:
            sub.close()
            raise
        return await _stream(request, backlog, sub)
    events = ledger.events(sid, since=since, kinds=kinds, limit=limit)
    body: dict[str, Any] = {
        "events": [e.to_json() for e in events],
        "next": events[-1].seq if events else since,
        "truncated": ledger.truncated(sid),
    }
    return web.json_response(body)


async def node_events(request: web.Request) -> web.StreamResponse:
    """``GET /v1/events``: node-wide NDJSON stream (see the module docstring)."""
    ledger = request.app[LEDGER]
    kinds = _kinds(request)
    since = _int_param(request, "since", ledger.last_seq)
    sub = ledger.subscribe(None, kinds=kinds)
    return await _stream(request, ledger.backlog(since=since, kinds=kinds), sub)


def add_routes(app: web.Application, ledger: Ledger) -> None:
    """Mount the ledger's routes on ``app`` (before the app starts)."""
    app[LEDGER] = ledger
    app.router.add_get("/v1/sandboxes/{id}/events", sandbox_events)
    app.router.add_get("/v1/events", node_events)
