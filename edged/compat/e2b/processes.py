"""The processes that E2B clients start in a sandbox (envd's process service, server side).

E2B's processes outlive the stream that started them: ``commands.run(background=True)``
returns while the command runs, a client may reconnect (``Connect``) by pid, send it input,
signal it, list it. An edged exec is tied to its caller instead (a caller that goes away
gets its exec killed), so each E2B process is an exec held open here by a task of its own,
whose events are fanned out to whoever is attached at the time (the ``Start`` stream,
``Connect`` streams). Output written while nobody is attached is not kept, as in envd.
A subscriber that falls :data:`MAX_BACKLOG` chunks behind is detached (its stream ends
with an error) rather than holding the process's output back for everyone.

Processes end with their sandbox; the table forgets ended ones (``Connect`` to one is a
``not_found``, as envd answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

from edged.backends.base import ExecEnd, ExecHandle, ExecSpec
from edged.errors import BadRequest, NotFound
from edged.node.requests import ExecRequest

log = logging.getLogger("edged.compat")

MAX_BACKLOG = 4096
MAX_PROCESSES = 256


class _Manager(Protocol):
    def exec_spec(self, sandbox_id: str, req: ExecRequest) -> ExecSpec: ...

    def exec(self, sandbox_id: str, spec: ExecSpec, *,
             counts_active: bool = True) -> AbstractAsyncContextManager[ExecHandle]: ...


Event = tuple[str, bytes] | ExecEnd | None  # None: detached (too far behind)


@dataclass
class Proc:
    """One process: its E2B config (``cmd``, ``args``, ``envs``, ``cwd``), ``pid`` (its pid
    in the sandbox; the exec id where the backend does not tell), ``tag``, ``pty``."""

    sandbox_id: str
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    pty: bool
    handle: ExecHandle | None = None
    pid: int = 0
    end: ExecEnd | None = None
    started_at: float = field(default_factory=time.time)
    subscribers: list[asyncio.Queue[Event]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    def subscribe(self) -> asyncio.Queue[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        if self.end is not None:
            q.put_nowait(self.end)
        else:
            self.subscribers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[Event]) -> None:
        with contextlib.suppress(ValueError):
            self.subscribers.remove(q)

    def _publish(self, ev: tuple[str, bytes] | ExecEnd) -> None:
        for q in list(self.subscribers):
            if q.qsize() >= MAX_BACKLOG and not isinstance(ev, ExecEnd):
                self.subscribers.remove(q)
                q.put_nowait(None)
            else:
                q.put_nowait(ev)


class Processes:
    """The E2B processes of every sandbox. One per listener."""

    def __init__(self, manager: _Manager) -> None:
        self._m = manager
        self._by_sandbox: dict[str, dict[int, Proc]] = {}

    def running(self, sandbox_id: str) -> list[Proc]:
        """Running processes of the sandbox, oldest first."""
        return sorted((p for p in self._by_sandbox.get(sandbox_id, {}).values()
                       if p.end is None), key=lambda p: p.started_at)

    def find(self, sandbox_id: str, *, pid: int | None = None,
             tag: str | None = None) -> Proc:
        """The running process with ``pid`` (or ``tag``); NotFound otherwise."""
        for p in self._by_sandbox.get(sandbox_id, {}).values():
            if p.end is None and ((pid is not None and p.pid == pid) or
                                  (tag is not None and p.tag == tag)):
                return p
        raise NotFound(f"process with {'pid ' + str(pid) if pid is not None else 'tag ' + str(tag)}"
                       f" not found")

    async def start(self, sandbox_id: str, *, cmd: str, args: list[str],
                    envs: Mapping[str, str], cwd: str | None, tag: str | None,
                    pty: tuple[int, int] | None, stdin: bool, uid: int, gid: int) -> Proc:
        """Start a process and return it once it runs (its events go to subscribers from
        then on). Raises what the exec raises (NotFound, InvalidState, BadRequest...)."""
        table = self._by_sandbox.setdefault(sandbox_id, {})
        for pid in [k for k, p in table.items() if p.end is not None]:
            del table[pid]
        if len(table) >= MAX_PROCESSES:
            raise BadRequest(f"sandbox {sandbox_id}: {MAX_PROCESSES} processes at most")
        if tag is not None and any(p.tag == tag and p.end is None for p in table.values()):
            raise BadRequest(f"a process tagged {tag!r} is running")
        proc = Proc(sandbox_id, cmd, list(args), dict(envs), cwd, tag, pty is not None)
        req = ExecRequest(argv=(cmd, *args), env=dict(envs), cwd=cwd or "/", uid=uid, gid=gid,
                          pty=pty is not None, stdin=bool(stdin or pty),
                          rows=pty[0] if pty else None, cols=pty[1] if pty else None)
        spec = self._m.exec_spec(sandbox_id, req)
        started: asyncio.Future[ExecHandle] = asyncio.get_running_loop().create_future()
        proc.task = asyncio.ensure_future(self._hold(proc, spec, started))
        handle = await started
        proc.handle = handle
        proc.pid = int(getattr(handle, "pid", 0) or handle.exec_id)
        if pty is not None:
            with contextlib.suppress(Exception):
                await handle.resize(pty[0], pty[1])
        table[proc.pid] = proc
        return proc

    async def _hold(self, proc: Proc, spec: ExecSpec,
                    started: asyncio.Future[ExecHandle]) -> None:
        try:
            async with self._m.exec(proc.sandbox_id, spec) as handle:
                started.set_result(handle)
                async for ev in handle.events():
                    if isinstance(ev, ExecEnd):
                        proc.end = ev
                    proc._publish(ev)
                    if proc.end is not None:
                        return
        except BaseException as e:
            if not started.done():
                started.set_exception(e if isinstance(e, Exception) else
                                      RuntimeError("the process did not start"))
            elif isinstance(e, Exception):
                log.warning("e2b process %s in %s: %s", proc.pid, proc.sandbox_id, e)
            if not isinstance(e, Exception):
                raise
        finally:
            if proc.end is None:
                proc.end = ExecEnd("killed", None, 9, time.time() - proc.started_at, None)
                proc._publish(proc.end)

    async def events(self, proc: Proc, keepalive_s: float | None
                     ) -> AsyncIterator[tuple[str, bytes] | ExecEnd | None]:
        """What ``proc`` does from now on: output chunks, then its end; None every
        ``keepalive_s`` of silence (a keep-alive for the stream). Raises
        :class:`BadRequest` if this subscriber fell too far behind."""
        q = proc.subscribe()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), keepalive_s)
                except TimeoutError:
                    yield None
                    continue
                if ev is None:
                    raise BadRequest("the stream fell too far behind the process's output")
                yield ev
                if isinstance(ev, ExecEnd):
                    return
        finally:
            proc.unsubscribe(q)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: drop its processes (their execs ended with it)."""
        for p in self._by_sandbox.pop(sandbox_id, {}).values():
            if p.task is not None and not p.task.done():
                p.task.cancel()


__all__ = ["Proc", "Processes"]
