"""The in-sandbox agent API of E2B ("envd") for edged's sandboxes: its process and filesystem
services (Connect RPC, :mod:`edged.compat.connect`) and its HTTP routes (``/health``,
``/files``), served by the listener for the sandbox named in the ``E2b-Sandbox-Id`` header.

Facts from E2B's public protocol (its ``.proto`` files and envd's HTTP spec), not code:
``Authorization: Basic base64(user:)`` names the user (uid/gid from the sandbox's
``/etc/passwd``; none: root); relative paths are relative to that user's home; ``GET
/files?path=`` answers the file, ``POST /files?path=`` takes an ``application/octet-stream``
body or a ``multipart/form-data`` one (each part's file name its path) and answers
``[{"name", "type", "path"}]``, making missing parent directories. Errors of the HTTP
routes are ``{"code": status, "message"}``.

A directory watch (``WatchDir``, ``CreateWatcher``) is a poll of the tree every
:data:`WATCH_POLL_S` through the backend's directory listing: creates, removes, writes
(size or mtime) and mode changes are told; a rename shows as a remove and a create.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import posixpath
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.hdrs import CONTENT_DISPOSITION
from google.protobuf.timestamp_pb2 import Timestamp

from edged.api.common import stream_file
from edged.backends.base import ExecEnd, FileInfo
from edged.compat.connect import ConnectError, client_stream, from_edged, server_stream, unary
from edged.compat.e2b.proto import filesystem_pb2 as fs_pb
from edged.compat.e2b.proto import process_pb2 as pr_pb
from edged.compat.e2b.state import SANDBOX, E2bState
from edged.errors import BadRequest, EdgedError, NotFound

log = logging.getLogger("edged.compat")

WATCH_POLL_S = 0.2
KEEPALIVE_DEFAULT_S = 50.0
FILE_CHUNK = 256 << 10
_FT = {"file": fs_pb.FILE_TYPE_FILE, "dir": fs_pb.FILE_TYPE_DIRECTORY,
       "symlink": fs_pb.FILE_TYPE_SYMLINK}


def _err(e: Exception) -> ConnectError:
    if isinstance(e, EdgedError):
        return from_edged(e)
    log.exception("envd: unexpected error", exc_info=e)
    return ConnectError("internal", f"{type(e).__name__}: {e}")


class Envd:
    """envd for the listener's sandboxes (``state``: the listener's shared state)."""

    def __init__(self, state: E2bState) -> None:
        self.s = state
        self.m = state.manager
        self._users: dict[str, dict[str, tuple[int, int, str]]] = {}
        self._watchers: dict[str, tuple[str, asyncio.Task[None], list[Any]]] = {}

    # -- users and paths ------------------------------------------------------------------

    async def _passwd(self, sid: str) -> dict[str, tuple[int, int, str]]:
        if sid not in self._users:
            users: dict[str, tuple[int, int, str]] = {"root": (0, 0, "/root")}
            with contextlib.suppress(EdgedError):
                data = b"".join([c async for c in await self.m.get_file(sid, "/etc/passwd")])
                for line in data.decode("utf-8", "replace").splitlines():
                    f = line.split(":")
                    if len(f) >= 6 and f[2].isdigit() and f[3].isdigit():
                        users.setdefault(f[0], (int(f[2]), int(f[3]), f[5] or "/"))
            self._users[sid] = users
        return self._users[sid]

    async def user(self, request: web.Request, sid: str,
                   username: str | None = None) -> tuple[int, int, str]:
        """(uid, gid, home) of the request's user (``username`` or the Basic auth's)."""
        if username is None:
            auth = request.headers.get("Authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() == "basic" and token:
                try:
                    username = base64.b64decode(token, validate=True).decode().split(":")[0]
                except (binascii.Error, UnicodeDecodeError) as e:
                    raise BadRequest("Authorization: a bad Basic credential") from e
        if not username:
            return 0, 0, "/root"
        users = await self._passwd(sid)
        if username not in users:
            raise BadRequest(f"user {username!r} not found in the sandbox")
        return users[username]

    @staticmethod
    def path(p: str, home: str) -> str:
        if not p:
            raise BadRequest("path: required")
        return posixpath.normpath(p if p.startswith("/") else posixpath.join(home, p))

    # -- process service ------------------------------------------------------------------

    def _selected(self, sid: str, sel: pr_pb.ProcessSelector) -> Any:
        which = sel.WhichOneof("selector")
        if which == "pid":
            return self.s.processes.find(sid, pid=sel.pid)
        if which == "tag":
            return self.s.processes.find(sid, tag=sel.tag)
        raise BadRequest("process: a pid or a tag is required")

    async def _proc_events(self, request: web.Request, proc: Any,
                           cls: type[Any]) -> AsyncIterator[Any]:
        ka = request.headers.get("Keepalive-Ping-Interval", "")
        keepalive = float(ka) if ka.isdigit() and 0 < int(ka) <= 3600 else KEEPALIVE_DEFAULT_S
        yield cls(event=pr_pb.ProcessEvent(start=pr_pb.ProcessEvent.StartEvent(pid=proc.pid)))
        async for ev in self.s.processes.events(proc, keepalive):
            if ev is None:
                yield cls(event=pr_pb.ProcessEvent(keepalive=pr_pb.ProcessEvent.KeepAlive()))
            elif isinstance(ev, ExecEnd):
                yield cls(event=pr_pb.ProcessEvent(end=_end(ev)))
                return
            else:
                stream, data = ev
                key = "pty" if proc.pty else stream
                yield cls(event=pr_pb.ProcessEvent(
                    data=pr_pb.ProcessEvent.DataEvent(**{key: data})))

    async def start(self, request: web.Request, req: pr_pb.StartRequest) -> AsyncIterator[Any]:
        sid = request[SANDBOX]
        uid, gid, home = await self.user(request, sid)
        cfg = req.process
        if not cfg.cmd:
            raise BadRequest("process.cmd: required")
        pty = (req.pty.size.rows or 24, req.pty.size.cols or 80) if req.HasField("pty") else None
        kw: dict[str, Any] = dict(
            args=list(cfg.args), envs=dict(cfg.envs),
            cwd=self.path(cfg.cwd, home) if cfg.HasField("cwd") else home,
            tag=req.tag if req.HasField("tag") else None, pty=pty,
            stdin=req.stdin if req.HasField("stdin") else True, uid=uid, gid=gid)
        try:
            proc = await self.s.processes.start(sid, cmd=cfg.cmd, **kw)
        except BadRequest:
            if cfg.cmd != "/bin/bash":
                raise
            # an image without bash (busybox): its sh takes the SDK's -l -c too
            proc = await self.s.processes.start(sid, cmd="/bin/sh", **kw)
        proc.cmd = cfg.cmd
        async for out in self._proc_events(request, proc, pr_pb.StartResponse):
            yield out

    async def connect(self, request: web.Request,
                      req: pr_pb.ConnectRequest) -> AsyncIterator[Any]:
        proc = self._selected(request[SANDBOX], req.process)
        async for out in self._proc_events(request, proc, pr_pb.ConnectResponse):
            yield out

    async def list_processes(self, request: web.Request,
                             req: pr_pb.ListRequest) -> pr_pb.ListResponse:
        out = pr_pb.ListResponse()
        for p in self.s.processes.running(request[SANDBOX]):
            info = out.processes.add(pid=p.pid)
            info.config.cmd = p.cmd
            info.config.args.extend(p.args)
            info.config.envs.update(p.envs)
            if p.cwd is not None:
                info.config.cwd = p.cwd
            if p.tag is not None:
                info.tag = p.tag
        return out

    async def _input(self, proc: Any, inp: pr_pb.ProcessInput) -> None:
        which = inp.WhichOneof("input")
        if which is None:
            return
        assert proc.handle is not None
        await proc.handle.write_stdin(getattr(inp, which))

    async def send_input(self, request: web.Request,
                         req: pr_pb.SendInputRequest) -> pr_pb.SendInputResponse:
        await self._input(self._selected(request[SANDBOX], req.process), req.input)
        return pr_pb.SendInputResponse()

    async def stream_input(self, request: web.Request,
                           reqs: AsyncIterator[Any]) -> pr_pb.StreamInputResponse:
        proc = None
        async for r in reqs:
            which = r.WhichOneof("event")
            if which == "start":
                proc = self._selected(request[SANDBOX], r.start.process)
            elif which == "data":
                if proc is None:
                    raise BadRequest("stream input: data before the start event")
                await self._input(proc, r.data.input)
        return pr_pb.StreamInputResponse()

    async def send_signal(self, request: web.Request,
                          req: pr_pb.SendSignalRequest) -> pr_pb.SendSignalResponse:
        proc = self._selected(request[SANDBOX], req.process)
        sig = {pr_pb.SIGNAL_SIGKILL: 9, pr_pb.SIGNAL_SIGTERM: 15}.get(req.signal)
        if sig is None:
            raise BadRequest("signal: SIGTERM or SIGKILL")
        assert proc.handle is not None
        await proc.handle.signal(sig)
        return pr_pb.SendSignalResponse()

    async def close_stdin(self, request: web.Request,
                          req: pr_pb.CloseStdinRequest) -> pr_pb.CloseStdinResponse:
        proc = self._selected(request[SANDBOX], req.process)
        assert proc.handle is not None
        await proc.handle.close_stdin()
        return pr_pb.CloseStdinResponse()

    async def update(self, request: web.Request,
                     req: pr_pb.UpdateRequest) -> pr_pb.UpdateResponse:
        proc = self._selected(request[SANDBOX], req.process)
        if req.HasField("pty"):
            assert proc.handle is not None
            await proc.handle.resize(req.pty.size.rows or 24, req.pty.size.cols or 80)
        return pr_pb.UpdateResponse()

    # -- filesystem service ---------------------------------------------------------------

    async def _fs_path(self, request: web.Request, p: str) -> tuple[str, str]:
        sid = request[SANDBOX]
        _, _, home = await self.user(request, sid)
        return sid, self.path(p, home)

    async def stat(self, request: web.Request, req: fs_pb.StatRequest) -> fs_pb.StatResponse:
        sid, path = await self._fs_path(request, req.path)
        return fs_pb.StatResponse(entry=_entry(await self.m.stat_path(sid, path)))

    async def list_dir(self, request: web.Request,
                       req: fs_pb.ListDirRequest) -> fs_pb.ListDirResponse:
        sid, path = await self._fs_path(request, req.path)
        entries = await self.m.list_dir(sid, path, max(1, req.depth))
        return fs_pb.ListDirResponse(entries=[_entry(e) for e in entries])

    async def make_dir(self, request: web.Request,
                       req: fs_pb.MakeDirRequest) -> fs_pb.MakeDirResponse:
        sid = request[SANDBOX]
        uid, gid, home = await self.user(request, sid)
        path = self.path(req.path, home)
        if not await self.m.make_dir(sid, path, uid=uid, gid=gid):
            raise ConnectError("already_exists", f"directory {path} already exists")
        return fs_pb.MakeDirResponse(entry=_entry(await self.m.stat_path(sid, path)))

    async def move(self, request: web.Request, req: fs_pb.MoveRequest) -> fs_pb.MoveResponse:
        sid, src = await self._fs_path(request, req.source)
        _, dst = await self._fs_path(request, req.destination)
        await self.m.rename_path(sid, src, dst)
        return fs_pb.MoveResponse(entry=_entry(await self.m.stat_path(sid, dst)))

    async def remove(self, request: web.Request,
                     req: fs_pb.RemoveRequest) -> fs_pb.RemoveResponse:
        sid, path = await self._fs_path(request, req.path)
        await self.m.remove_path(sid, path)
        return fs_pb.RemoveResponse()

    async def _tree(self, sid: str, path: str, recursive: bool) -> dict[str, FileInfo]:
        return {e.path: e for e in await self.m.list_dir(sid, path, 64 if recursive else 1)}

    async def _baseline(self, sid: str, path: str, recursive: bool) -> dict[str, FileInfo]:
        """The first listing of a watch (``BadRequest`` if ``path`` is not a directory)."""
        info = await self.m.stat_path(sid, path)
        if info.type != "dir":
            raise BadRequest(f"watch {path}: not a directory")
        return await self._tree(sid, path, recursive)

    async def _watch(self, sid: str, path: str, recursive: bool, include_entry: bool,
                     before: dict[str, FileInfo]) -> AsyncIterator[fs_pb.FilesystemEvent]:
        """The events of ``path`` since the listing ``before``: one poll every
        :data:`WATCH_POLL_S`; ends when ``path`` is gone."""
        while True:
            await asyncio.sleep(WATCH_POLL_S)
            try:
                now = await self._tree(sid, path, recursive)
            except NotFound:
                return
            for p in sorted(set(before) | set(now)):
                old, new = before.get(p), now.get(p)
                if old is None:
                    kind = fs_pb.EVENT_TYPE_CREATE
                elif new is None:
                    kind = fs_pb.EVENT_TYPE_REMOVE
                elif (old.size, old.mtime) != (new.size, new.mtime):
                    kind = fs_pb.EVENT_TYPE_WRITE
                elif old.mode != new.mode:
                    kind = fs_pb.EVENT_TYPE_CHMOD
                else:
                    continue
                ev = fs_pb.FilesystemEvent(name=posixpath.relpath(p, path), type=kind)
                if include_entry and new is not None:
                    ev.entry.CopyFrom(_entry(new))
                yield ev
            before = now

    async def watch_dir(self, request: web.Request,
                        req: fs_pb.WatchDirRequest) -> AsyncIterator[fs_pb.WatchDirResponse]:
        sid, path = await self._fs_path(request, req.path)
        # the baseline (and its errors) before "start": what changes after start is told
        before = await self._baseline(sid, path, req.recursive)
        yield fs_pb.WatchDirResponse(start=fs_pb.WatchDirResponse.StartEvent())
        async for ev in self._watch(sid, path, req.recursive, req.include_entry, before):
            yield fs_pb.WatchDirResponse(filesystem=ev)

    async def create_watcher(self, request: web.Request,
                             req: fs_pb.CreateWatcherRequest) -> fs_pb.CreateWatcherResponse:
        sid, path = await self._fs_path(request, req.path)
        # the baseline is listed before the answer: a change made once the client has the
        # watcher's id is one it will be told (a half-poll sleep had raced a slow listing)
        before = await self._baseline(sid, path, req.recursive)
        wid = secrets.token_hex(8)
        events: list[Any] = []

        async def collect() -> None:
            async for ev in self._watch(sid, path, req.recursive, req.include_entry, before):
                events.append(ev)
                del events[:-10000]

        self._watchers[wid] = (sid, asyncio.ensure_future(collect()), events)
        return fs_pb.CreateWatcherResponse(watcher_id=wid)

    def _watcher(self, request: web.Request, wid: str) -> tuple[str, asyncio.Task[None],
                                                                list[Any]]:
        w = self._watchers.get(wid)
        if w is None or w[0] != request[SANDBOX]:
            raise NotFound(f"watcher {wid} not found")
        return w

    async def get_watcher_events(self, request: web.Request, req: Any) -> Any:
        _, task, events = self._watcher(request, req.watcher_id)
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        out = fs_pb.GetWatcherEventsResponse(events=list(events))
        events.clear()
        return out

    async def remove_watcher(self, request: web.Request, req: Any) -> Any:
        _, task, _ = self._watcher(request, req.watcher_id)
        task.cancel()
        self._watchers.pop(req.watcher_id, None)
        return fs_pb.RemoveWatcherResponse()

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: drop what was kept for it."""
        self._users.pop(sandbox_id, None)
        for wid, (sid, task, _) in list(self._watchers.items()):
            if sid == sandbox_id:
                task.cancel()
                del self._watchers[wid]

    # -- HTTP routes ----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=204)

    async def get_files(self, request: web.Request) -> web.StreamResponse:
        sid = request[SANDBOX]
        _, _, home = await self.user(request, sid, request.query.get("username") or None)
        path = self.path(request.query.get("path", ""), home)
        return await stream_file(request, await self.m.get_file(sid, path))

    async def post_files(self, request: web.Request) -> web.StreamResponse:
        sid = request[SANDBOX]
        uid, gid, home = await self.user(request, sid, request.query.get("username") or None)
        qpath = request.query.get("path")
        written: list[dict[str, str]] = []

        async def put(path: str, data: AsyncIterator[bytes]) -> None:
            full = self.path(path, home)
            await self.m.put_file(sid, full, data, uid=uid, gid=gid, parents=True)
            written.append({"name": posixpath.basename(full), "type": "file", "path": full})

        ctype = request.headers.get("Content-Type", "")
        if ctype.startswith("multipart/form-data"):
            reader = await request.multipart()
            while True:
                part = await reader.next()
                if part is None:
                    break
                if not isinstance(part, BodyPartReader):
                    raise BadRequest("multipart: nested multipart is not a file")
                name = _part_filename(part.headers.get(CONTENT_DISPOSITION, "")) or qpath
                if not name:
                    raise BadRequest("multipart: a part without a file name or path")

                async def chunks(p: Any = part) -> AsyncIterator[bytes]:
                    while chunk := await p.read_chunk(FILE_CHUNK):
                        yield chunk

                await put(name, chunks())
        else:
            if not qpath:
                raise BadRequest("path: query parameter required")
            if request.headers.get("Content-Encoding", "").lower() == "gzip":
                raise BadRequest("Content-Encoding gzip: not supported; send it plain")

            async def body() -> AsyncIterator[bytes]:
                async for chunk in request.content.iter_chunked(FILE_CHUNK):
                    yield chunk

            await put(qpath, body())
        return web.json_response(written)

    def routes(self) -> list[tuple[str, str, Any]]:
        """(method, path, handler) of envd, Connect procedures included."""
        P, F = "/process.Process/", "/filesystem.Filesystem/"
        return [
            ("GET", "/health", self.health),
            ("GET", "/files", self.get_files),
            ("POST", "/files", self.post_files),
            ("POST", P + "Start", server_stream(pr_pb.StartRequest, self.start, _err)),
            ("POST", P + "Connect", server_stream(pr_pb.ConnectRequest, self.connect, _err)),
            ("POST", P + "List", unary(pr_pb.ListRequest, self.list_processes, _err)),
            ("POST", P + "SendInput", unary(pr_pb.SendInputRequest, self.send_input, _err)),
            ("POST", P + "StreamInput",
             client_stream(pr_pb.StreamInputRequest, self.stream_input, _err)),
            ("POST", P + "SendSignal", unary(pr_pb.SendSignalRequest, self.send_signal, _err)),
            ("POST", P + "CloseStdin", unary(pr_pb.CloseStdinRequest, self.close_stdin, _err)),
            ("POST", P + "Update", unary(pr_pb.UpdateRequest, self.update, _err)),
            ("POST", F + "Stat", unary(fs_pb.StatRequest, self.stat, _err)),
            ("POST", F + "ListDir", unary(fs_pb.ListDirRequest, self.list_dir, _err)),
            ("POST", F + "MakeDir", unary(fs_pb.MakeDirRequest, self.make_dir, _err)),
            ("POST", F + "Move", unary(fs_pb.MoveRequest, self.move, _err)),
            ("POST", F + "Remove", unary(fs_pb.RemoveRequest, self.remove, _err)),
            ("POST", F + "WatchDir", server_stream(fs_pb.WatchDirRequest, self.watch_dir, _err)),
            ("POST", F + "CreateWatcher",
             unary(fs_pb.CreateWatcherRequest, self.create_watcher, _err)),
            ("POST", F + "GetWatcherEvents",
             unary(fs_pb.GetWatcherEventsRequest, self.get_watcher_events, _err)),
            ("POST", F + "RemoveWatcher",
             unary(fs_pb.RemoveWatcherRequest, self.remove_watcher, _err)),
        ]


_FILENAME = re.compile(r'filename="((?:[^"\\]|\\.)*)"|filename=([^;\s]+)', re.I)


def _part_filename(disposition: str) -> str | None:
    """A multipart part's file name as the client sent it: E2B's clients send the target
    path there, and aiohttp's parser drops a leading ``/`` from it (a defence for servers
    that write where a client says; here the path is resolved inside the sandbox)."""
    m = _FILENAME.search(disposition)
    if m is None:
        return None
    if m.group(1) is not None:
        return re.sub(r"\\(.)", r"\1", m.group(1))
    return m.group(2)


def _end(ev: ExecEnd) -> pr_pb.ProcessEvent.EndEvent:
    """envd's end of a process: ``exited`` with its code, else a signal (code -1)."""
    if ev.reason == "exited" and ev.exit_code is not None:
        return pr_pb.ProcessEvent.EndEvent(exit_code=ev.exit_code, exited=True,
                                           status=f"exit status {ev.exit_code}")
    sig = ev.signal or 9
    end = pr_pb.ProcessEvent.EndEvent(exit_code=-1, exited=False,
                                      status=f"signal: {'killed' if sig == 9 else sig}")
    if ev.reason != "signalled":
        end.error = ev.reason  # timeout, oom, output_limit, killed
    return end


def _entry(e: FileInfo) -> fs_pb.EntryInfo:
    ts = Timestamp()
    ts.FromNanoseconds(int(e.mtime * 1e9))
    out = fs_pb.EntryInfo(name=e.name, type=_FT.get(e.type, fs_pb.FILE_TYPE_FILE),
                          path=e.path, size=e.size, mode=e.mode, permissions=e.permissions,
                          owner=e.owner, group=e.group, modified_time=ts,
                          is_symlink=e.type == "symlink")
    if e.symlink_target is not None:
        out.symlink_target = e.symlink_target
    return out


def now_ms() -> int:
    return int(time.time() * 1000)


__all__ = ["Envd"]
