"""Routes for agent harnesses: shell sessions (``/v1/sandboxes/{id}/sessions``) and
snapshots of a sandbox into a layer (``/v1/sandboxes/{id}/snapshot``).

A run streams as NDJSON like an exec: ``{"start": {"session", "run"}}``, ``{"stdout": s}`` /
``{"stderr": s}`` (text, or base64 with ``"encoding": "base64"``), then one ``{"end": {reason,
exit_code, signal, duration_s, session_ended}}`` (see :mod:`edged.node.sessions`). A client
that goes away mid-run gets its run interrupted; the session stays.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from aiohttp import web

from edged.api import requests
from edged.api.common import (
    FILE_CHUNK,
    ClientGone,
    Handler,
    OutputEncoder,
    json_body,
    manager_of,
    sandbox_id_of,
    stream_events,
    until_gone,
)
from edged.errors import BadRequest
from edged.node.sessions import RunEnd

log = logging.getLogger("edged.api")

_SESSION_FIELDS = {"id", "shell", "env", "cwd", "uid", "gid"}
_RUN_FIELDS = {"cmd", "timeout_s", "output_limit", "encoding"}


async def create_session(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/sessions {id?, shell?, env?, cwd?, uid?, gid?} → 201 session."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    b = requests.fields(await json_body(request), _SESSION_FIELDS)
    mgr.get(sid)
    session_id = b.get("id")
    if session_id is not None and not isinstance(session_id, str):
        raise BadRequest("id: must be a string")
    shell = b.get("shell")
    if shell is not None and shell not in ("bash", "sh"):
        raise BadRequest("shell: must be 'bash' or 'sh'")
    cwd = b.get("cwd", "/")
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd:
        raise BadRequest("cwd: must be an absolute path")
    ids = {k: requests.integer(b.get(k, 0), k, minimum=0, maximum=65535) for k in ("uid", "gid")}
    s = await mgr.sessions.create(sid, session_id=session_id, shell=shell,
                                  env=requests.env(b.get("env"), "env"), cwd=cwd, **ids)
    return web.json_response(s.to_json(), status=201)


async def list_sessions(request: web.Request) -> web.Response:
    """GET /v1/sandboxes/{id}/sessions → {"sessions": [...]}."""
    sessions = manager_of(request).sessions.list(sandbox_id_of(request))
    return web.json_response({"sessions": [s.to_json() for s in sessions]})


async def get_session(request: web.Request) -> web.Response:
    """GET /v1/sandboxes/{id}/sessions/{session} → the session."""
    s = manager_of(request).sessions.get(sandbox_id_of(request), request.match_info["session"])
    return web.json_response(s.to_json())


async def delete_session(request: web.Request) -> web.Response:
    """DELETE /v1/sandboxes/{id}/sessions/{session} → the session, ended."""
    s = await manager_of(request).sessions.close(sandbox_id_of(request),
                                                 request.match_info["session"])
    return web.json_response(s.to_json())


async def run_in_session(request: web.Request) -> web.StreamResponse:
    """POST /v1/sandboxes/{id}/sessions/{session}/run {cmd, timeout_s?, output_limit?,
    encoding?} → NDJSON: start, output chunks, end."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    session_id = request.match_info["session"]
    b = requests.fields(await json_body(request), _RUN_FIELDS)
    mgr.sessions.get(sid, session_id)
    cmd = b.get("cmd")
    if not isinstance(cmd, str) or not cmd.strip():
        raise BadRequest("cmd: must be a non-empty string")
    timeout = b.get("timeout_s")
    if timeout is not None:
        timeout = requests.number(timeout, "timeout_s", minimum=0.001)
    limit = b.get("output_limit")
    if limit is not None:
        limit = requests.integer(limit, "output_limit", minimum=1, maximum=requests.MAX_BYTES)
    encoding = b.get("encoding", "text")
    if encoding not in ("text", "base64"):
        raise BadRequest(f"encoding: {encoding!r} is not 'text' or 'base64'")
    enc = OutputEncoder(encoding)
    items = await mgr.sessions.run(sid, session_id, cmd, timeout_s=timeout,
                                   output_limit=limit)
    number = mgr.sessions.get(sid, session_id).runs
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    resp.enable_chunked_encoding()
    # (from here on the run is ours to close: `items.aclose()` below, whatever happens)

    async def events() -> AsyncIterator[dict[str, Any]]:
        yield {"start": {"session": session_id, "run": number}}
        async for item in items:
            if isinstance(item, RunEnd):
                for s, text in enc.flush():
                    yield {s: text}
                yield {"end": item.to_json()}
                return
            text = enc.encode(item[0], item[1])
            if text:
                yield {item[0]: text}

    async def send(ev: dict[str, Any]) -> None:
        try:
            await resp.write(json.dumps(ev).encode() + b"\n")
        except ConnectionError as e:
            raise ClientGone(str(e)) from e

    try:
        await resp.prepare(request)
        await stream_events(events(), send, until_gone(request))
        await resp.write_eof()
    except ClientGone as e:
        log.debug("session run in %s/%s: the client went away (%s)", sid, session_id, e)
    finally:
        await items.aclose()  # an unfinished run is interrupted in the background
    return resp


_SNAPSHOT_FIELDS = {"kind", "exclude", "image"}
LAYER_KINDS = ("base", "workspace", "toolkit")


async def snapshot_sandbox(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/snapshot {kind?, exclude?, image?} → 201 the new layer."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    b = requests.fields(await json_body(request), _SNAPSHOT_FIELDS)
    mgr.get(sid)
    kind = b.get("kind", "workspace")
    if kind not in LAYER_KINDS:
        raise BadRequest(f"kind: must be one of {', '.join(LAYER_KINDS)}")
    exclude = b.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise BadRequest("exclude: must be a list of path patterns")
    image = b.get("image")
    if image is not None and not isinstance(image, str):
        raise BadRequest("image: must be a name:tag string")
    out = await mgr.snapshot(sid, kind=kind, exclude=exclude, image=image)
    return web.json_response(out, status=201)


def _query_path(request: web.Request, key: str = "path") -> str:
    path = request.query.get(key)
    if not path:
        raise BadRequest(f"{key}: query parameter required")
    return path


def _body_path(b: dict[str, Any], key: str) -> str:
    v = b.get(key)
    if not isinstance(v, str) or not v.startswith("/"):
        raise BadRequest(f"{key}: must be an absolute path")
    return v


async def fs_list(request: web.Request) -> web.Response:
    """GET /v1/sandboxes/{id}/fs/list?path=&depth= → {"entries": [...]}."""
    try:
        depth = int(request.query.get("depth", "1"))
    except ValueError as e:
        raise BadRequest("depth: must be an integer") from e
    entries = await manager_of(request).list_dir(sandbox_id_of(request), _query_path(request),
                                                 depth)
    return web.json_response({"entries": [asdict(e) for e in entries]})


async def fs_stat(request: web.Request) -> web.Response:
    """GET /v1/sandboxes/{id}/fs/stat?path= → the entry."""
    info = await manager_of(request).stat_path(sandbox_id_of(request), _query_path(request))
    return web.json_response(asdict(info))


async def fs_mkdir(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/fs/mkdir {path, parents?, uid?, gid?} → {created, entry}."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    b = requests.fields(await json_body(request), {"path", "parents", "uid", "gid"})
    path = _body_path(b, "path")
    ids = {k: requests.integer(b.get(k, 0), k, minimum=0, maximum=65535) for k in ("uid", "gid")}
    created = await mgr.make_dir(sid, path, parents=requests.flag(b.get("parents", True),
                                                                  "parents"), **ids)
    return web.json_response({"created": created,
                              "entry": asdict(await mgr.stat_path(sid, path))})


async def fs_remove(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/fs/remove {path} → {"removed": path}."""
    b = requests.fields(await json_body(request), {"path"})
    path = _body_path(b, "path")
    await manager_of(request).remove_path(sandbox_id_of(request), path)
    return web.json_response({"removed": path})


async def fs_rename(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/fs/rename {src, dst} → the entry at dst."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    b = requests.fields(await json_body(request), {"src", "dst"})
    src, dst = _body_path(b, "src"), _body_path(b, "dst")
    await mgr.rename_path(sid, src, dst)
    return web.json_response(asdict(await mgr.stat_path(sid, dst)))


def _exec_id(request: web.Request) -> int:
    v = request.match_info["exec_id"]
    if not v.isdigit() or len(v) > 18:
        raise BadRequest("exec_id: must be an integer")
    return int(v)


async def exec_stdin(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/execs/{exec_id}/stdin?eof=0|1 (raw body) → bytes written.
    For an exec started with ``"stdin": true`` on the NDJSON endpoint; ``eof=1`` closes
    its stdin after the body."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    handle = mgr.exec_handle(sid, _exec_id(request))
    eof = request.query.get("eof", "0")
    if eof not in ("0", "1"):
        raise BadRequest("eof: must be 0 or 1")
    n = 0
    async for chunk in request.content.iter_chunked(FILE_CHUNK):
        await handle.write_stdin(chunk)
        n += len(chunk)
    if eof == "1":
        await handle.close_stdin()
    return web.json_response({"bytes": n, "eof": eof == "1"})


async def exec_resize(request: web.Request) -> web.Response:
    """POST /v1/sandboxes/{id}/execs/{exec_id}/resize {rows, cols} → the size set."""
    mgr, sid = manager_of(request), sandbox_id_of(request)
    b = requests.fields(await json_body(request), {"rows", "cols"})
    rows = requests.integer(b.get("rows"), "rows", minimum=1, maximum=65535)
    cols = requests.integer(b.get("cols"), "cols", minimum=1, maximum=65535)
    await mgr.exec_handle(sid, _exec_id(request)).resize(rows, cols)
    return web.json_response({"rows": rows, "cols": cols})


ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/v1/sandboxes/{id}/execs/{exec_id}/stdin", exec_stdin),
    ("POST", "/v1/sandboxes/{id}/execs/{exec_id}/resize", exec_resize),
    ("GET", "/v1/sandboxes/{id}/fs/list", fs_list),
    ("GET", "/v1/sandboxes/{id}/fs/stat", fs_stat),
    ("POST", "/v1/sandboxes/{id}/fs/mkdir", fs_mkdir),
    ("POST", "/v1/sandboxes/{id}/fs/remove", fs_remove),
    ("POST", "/v1/sandboxes/{id}/fs/rename", fs_rename),
    ("POST", "/v1/sandboxes/{id}/snapshot", snapshot_sandbox),
    ("POST", "/v1/sandboxes/{id}/sessions", create_session),
    ("GET", "/v1/sandboxes/{id}/sessions", list_sessions),
    ("GET", "/v1/sandboxes/{id}/sessions/{session}", get_session),
    ("DELETE", "/v1/sandboxes/{id}/sessions/{session}", delete_session),
    ("POST", "/v1/sandboxes/{id}/sessions/{session}/run", run_in_session),
]
