"""Shell sessions: a persistent shell per session whose state (cwd, environment, shell
variables, functions, aliases, options) persists between runs, several per sandbox (the
reference system's "chronus", SWE-ReX's sessions).

A session is one exec of the sandbox's shell (``/bin/bash`` if it runs, else ``/bin/sh``)
with its stdin kept open: the daemon's channel. The shell runs a small loop
(:func:`bootstrap`) that reads one command per run from that channel and ``eval``s it in the
shell itself, so ``cd``, ``export``, variables and functions stay; each command's own stdin
is ``/dev/null`` (an agent's command never waits on a terminal), its stdout and stderr are
the exec's.

**How a run's end is found.** Not by scraping a prompt out of the output (any output can
look like a prompt). Per run the daemon draws a 128-bit random nonce and sends it on the
channel *after* the command; the loop reads it only once the command has finished, then
writes an end marker holding it to copies of stdout and stderr that it made at start (fds
7 and 8, closed for the command itself): ``\\x1e NONCE \\x1e`` on stdout, ``\\x1e NONCE
STATUS \\x1e`` on stderr. The run has ended when both markers have come, each stream's
bytes before its marker being the run's. No earlier output can hold the nonce: it does not
exist until the run is sent, and while the command runs it sits unread in the channel's
pipe (the shell's ``read`` takes one byte at a time from a pipe, and the command gets the
channel closed). What a command *cannot* do is hide its own output from the daemon;
what a hostile one can do (steal the nonce through ``/proc``, close fds 7/8, ``exec`` the
shell away) at most breaks its own session: the run then times out or the session ends,
typed either way, and other sessions and the daemon are unaffected.

**Ends of a run** (``end.reason``): ``exited`` (``exit_code`` the command's status),
``timeout`` (its ``timeout_s`` passed), ``output_limit`` (its ``output_limit`` bytes of
stdout+stderr passed), ``session_ended`` (the shell itself ended: ``exit``, killed, out of
memory; ``exit_code``/``signal`` are the shell's). A run that times out, overruns its output
or loses its client is interrupted: SIGINT to the session's processes (the shell traps it
while the command runs and goes on; the command's processes die), then SIGTERM
(:data:`INTERRUPTS`, over ~10 s); a run that survives them (a
busy builtin loop, a program that ignores them) costs the session, which is killed
(``session_ended: true`` in the end). The session's own SIGINT/SIGTERM traps are the loop's.

Runs of one session are serialised (a second concurrent run is a 409 ``conflict``); runs of
different sessions of a sandbox run concurrently. A session's shell waiting between runs
does not count as activity (a sandbox holding only idle sessions may be idle-reaped or
paused); a run does. Output written between runs (background jobs) is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from edged.backends.base import ExecEnd, ExecHandle, ExecSpec
from edged.errors import BackendError, BadRequest, Conflict, InvalidState, NotFound
from edged.node.requests import ExecRequest
from edged.node.sandbox import SandboxRecord

log = logging.getLogger("edged.node")

#: how an interrupted run is stopped: (signal, seconds to wait after it) to the session's
#: processes until the run ends, then SIGKILL of the session. A signal that comes before the
#: command starts is ignored by the loop, hence several, and spread over ~10 s: six 0.5 s
#: apart (3 s in all) once reached a shell that a loaded host (load 36 on 2 cores) had not
#: yet let start its command, and the session was killed for a client gone early.
INTERRUPTS: tuple[tuple[int, float], ...] = (
    (2, 0.5), (2, 0.5), (2, 1.0), (2, 2.0), (15, 2.0), (15, 4.0))
MAX_SESSIONS = 64
#: bytes of one command (it travels as one line through the shell's ``read``)
MAX_COMMAND = 1 << 20
SESSION_ID_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}\Z")
_MARK = b"\x1e"


def bootstrap(bash: bool) -> str:
    """The loop a session's shell runs (POSIX sh; bash gets ``printf -v``, no fork per run).

    Channel protocol, per run: one line, the command with ``\\`` doubled and newlines as
    ``\\n`` (so ``printf %b`` gives it back byte for byte), then one line, the nonce."""
    decode = ('printf -v __edged_c "%b" "$__edged_l"' if bash else
              '__edged_c=$(printf "%b." "$__edged_l"); __edged_c=${__edged_c%.}')
    # SIGINT and SIGTERM are ignored while the loop reads and reports, trapped (so the
    # command's processes get them and the shell goes on) while the command runs: an
    # interrupt that comes before the command has started must not cut a read short (the
    # channel would lose its place), one that comes while it runs must reach it.
    return "\n".join((
        "exec 3<&0 </dev/null 7>&1 8>&2",
        "trap '' INT TERM",
        '__edged_rc() { return "$1"; }',
        "__edged_s=0",
        "while IFS= read -r __edged_l <&3; do",
        f"  {decode}",
        "  trap : INT TERM",
        '  __edged_rc "$__edged_s"',
        '  eval "$__edged_c" 3<&- 7>&- 8>&-',
        "  __edged_s=$?",
        "  trap '' INT TERM",
        "  IFS= read -r __edged_n <&3 || break",
        "  printf '\\036%s\\036' \"$__edged_n\" >&7",
        "  printf '\\036%s %s\\036' \"$__edged_n\" \"$__edged_s\" >&8",
        "done",
    ))


def encode_command(cmd: str) -> bytes:
    """A command as the channel's one line (see :func:`bootstrap`). Raises BadRequest for a
    NUL (no shell string holds one) or a command over :data:`MAX_COMMAND` bytes."""
    if "\0" in cmd:
        raise BadRequest("cmd: NUL in the command")
    raw = cmd.encode("utf-8", "surrogateescape")
    if len(raw) > MAX_COMMAND:
        raise BadRequest(f"cmd: longer than {MAX_COMMAND} bytes (send files with the files "
                         f"API)")
    return raw.replace(b"\\", b"\\\\").replace(b"\n", b"\\n") + b"\n"


class _Splitter:
    """One stream of one run: passes bytes through until the run's end marker, holding back
    a tail that could be the start of it. ``done`` once the marker came; ``status`` the
    exit status it carried (stderr's)."""

    def __init__(self, nonce: bytes, with_status: bool) -> None:
        self.head = _MARK + nonce
        self.with_status = with_status
        self.pending = b""
        self.done = False
        self.status: int | None = None

    def feed(self, data: bytes) -> bytes:
        """The bytes of ``data`` (after what was held back) that belong to the run and can
        be passed on now."""
        if self.done:
            return b""
        buf = self.pending + data
        i = buf.find(self.head)
        if i >= 0:
            rest = buf[i + len(self.head):]
            if not self.with_status:
                if rest[:1] == _MARK:
                    self.done = True
                    self.pending = b""
                    return buf[:i]
                if not rest:
                    self.pending = buf[i:]
                    return buf[:i]
            else:
                m = re.match(rb" (\d{1,3})\x1e", rest)
                if m:
                    self.done = True
                    self.status = int(m.group(1))
                    self.pending = b""
                    return buf[:i]
                if re.fullmatch(rb"( \d{0,3})?", rest):
                    self.pending = buf[i:]
                    return buf[:i]
            # the nonce followed by something else: ordinary output (cannot happen by
            # chance; a command that stole the nonce wrote it): pass it on
        j = buf.rfind(_MARK)
        if j >= 0 and self.head.startswith(buf[j:]):
            self.pending = buf[j:]
            return buf[:j]
        self.pending = b""
        return buf


@dataclass
class RunEnd:
    """How one run ended (see the module docstring for ``reason``)."""

    reason: str
    exit_code: int | None
    signal: int | None
    duration_s: float
    session_ended: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "exit_code": self.exit_code, "signal": self.signal,
                "duration_s": self.duration_s, "session_ended": self.session_ended}


@dataclass
class Session:
    """One shell session of a sandbox. ``state``: ``running`` or ``ended``; ``end``: the
    shell's end once it has ended."""

    id: str
    sandbox_id: str
    shell: str
    handle: ExecHandle
    created_at: float
    runs: int = 0
    dropped_bytes: int = 0
    end: ExecEnd | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: (stream, bytes) | ExecEnd of the exec, demultiplexed by the reader task
    queue: asyncio.Queue[tuple[str, bytes] | ExecEnd] | None = None
    reader: asyncio.Task[None] | None = None
    holder: asyncio.Task[None] | None = None
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    running: bool = False

    @property
    def state(self) -> str:
        return "ended" if self.end is not None else "running"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "sandbox_id": self.sandbox_id, "shell": self.shell,
                "pid": getattr(self.handle, "pid", 0) or None, "state": self.state,
                "created_at": self.created_at, "runs": self.runs, "busy": self.running,
                "dropped_bytes": self.dropped_bytes,
                "end": None if self.end is None else {
                    "reason": self.end.reason, "exit_code": self.end.exit_code,
                    "signal": self.end.signal}}


@dataclass
class _Run:
    """The run in progress of a session: its streams' end markers and its output queue."""

    nonce: str
    out: _Splitter
    err: _Splitter
    queue: asyncio.Queue[tuple[str, bytes] | ExecEnd] = field(
        default_factory=lambda: asyncio.Queue(maxsize=256))

    @property
    def done(self) -> bool:
        return self.out.done and self.err.done


class _Manager(Protocol):
    """What sessions need of the sandbox manager (:class:`edged.node.manager.SandboxManager`)."""

    def get(self, sandbox_id: str) -> SandboxRecord: ...

    async def _awake(self, sandbox_id: str, op: str) -> SandboxRecord: ...

    def exec_spec(self, sandbox_id: str, req: ExecRequest) -> ExecSpec: ...

    def exec(self, sandbox_id: str, spec: ExecSpec, *,
             counts_active: bool = True) -> AbstractAsyncContextManager[ExecHandle]: ...

    def _background(self, coro: Coroutine[Any, Any, None]) -> None: ...


class _RunEvents:
    """The events of one run (what :meth:`Sessions.run` returns): iterate, then close.
    Closed early, or never iterated at all, it still hands the session back (see
    :meth:`Sessions._left`), which a plain async generator that never started would not."""

    def __init__(self, owner: Sessions, s: Session, run: _Run, rec: SandboxRecord,
                 items: AsyncGenerator[tuple[str, bytes] | RunEnd, None]) -> None:
        self._owner, self._s, self._run, self._rec, self._items = owner, s, run, rec, items
        self._done = False
        self._finished = False

    def __aiter__(self) -> _RunEvents:
        return self

    async def __anext__(self) -> tuple[str, bytes] | RunEnd:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._items.__anext__()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, RunEnd):
            self._finished = True
        return item

    async def aclose(self) -> None:
        """Done with the run (idempotent)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            await self._items.aclose()
        self._owner._left(self._s, self._run, self._rec, finished=self._finished)


class Sessions:
    """Every shell session of a node, by sandbox. One per sandbox manager."""

    def __init__(self, manager: _Manager) -> None:
        self._m = manager
        self._by_sandbox: dict[str, dict[str, Session]] = {}
        self._runs: dict[tuple[str, str], _Run] = {}
        self._next: dict[str, int] = {}

    def list(self, sandbox_id: str) -> list[Session]:
        """The sessions of a sandbox (NotFound if the sandbox is unknown), oldest first."""
        self._m.get(sandbox_id)
        return sorted(self._by_sandbox.get(sandbox_id, {}).values(), key=lambda s: s.created_at)

    def get(self, sandbox_id: str, session_id: str) -> Session:
        """One session (NotFound for an unknown sandbox or session)."""
        self._m.get(sandbox_id)
        s = self._by_sandbox.get(sandbox_id, {}).get(session_id)
        if s is None:
            raise NotFound(f"sandbox {sandbox_id}: no session {session_id!r}")
        return s

    async def create(self, sandbox_id: str, *, session_id: str | None = None,
                     shell: str | None = None, env: dict[str, str] | None = None,
                     cwd: str = "/", uid: int = 0, gid: int = 0) -> Session:
        """Start a session's shell: ``shell`` ``"bash"``, ``"sh"`` or None (bash if it runs,
        else sh). Raises NotFound, InvalidState (sandbox not running), Conflict (the id is
        taken, or :data:`MAX_SESSIONS` reached), BadRequest (no such shell, bad cwd)."""
        rec = await self._m._awake(sandbox_id, "start a session")
        table = self._by_sandbox.setdefault(sandbox_id, {})
        if session_id is None:
            n = self._next.get(sandbox_id, 0) + 1
            while f"s{n}" in table:
                n += 1
            self._next[sandbox_id] = n
            session_id = f"s{n}"
        elif not SESSION_ID_RE.match(session_id):
            raise BadRequest("id: must match [a-z0-9][a-z0-9_.-]{0,62}")
        if session_id in table:
            raise Conflict(f"sandbox {sandbox_id}: session {session_id!r} exists")
        if len(table) >= MAX_SESSIONS:
            raise Conflict(f"sandbox {sandbox_id}: {MAX_SESSIONS} sessions at most")
        if shell not in (None, "bash", "sh"):
            raise BadRequest("shell: must be 'bash' or 'sh'")
        shells = [s for s in ("bash", "sh") if shell in (None, s)]
        last: Exception | None = None
        for name in shells:
            argv = (f"/bin/{name}", "-c", bootstrap(name == "bash"), "edged-session")
            req = ExecRequest(argv=argv, env=dict(env or {}), cwd=cwd, uid=uid, gid=gid,
                              stdin=True)
            spec = self._m.exec_spec(sandbox_id, req)
            started: asyncio.Future[ExecHandle] = asyncio.get_running_loop().create_future()
            s = Session(session_id, sandbox_id, f"/bin/{name}", handle=None,  # type: ignore[arg-type]
                        created_at=time.time())
            s.holder = asyncio.ensure_future(self._hold(s, spec, started))
            try:
                s.handle = await started
            except BadRequest as e:  # not there or not runnable: the next shell
                last = e
                continue
            table[session_id] = s
            # A first, empty run: the shell has set its traps (a signal before that would
            # end it) and answers on its channel before the session is handed out.
            end: RunEnd | None = None
            events = await self.run(sandbox_id, session_id, ":", timeout_s=30.0)
            try:
                async for item in events:
                    if isinstance(item, RunEnd):
                        end = item
            finally:
                await events.aclose()
            if end is None or end.reason != "exited":
                table.pop(session_id, None)
                await self._kill(s)
                raise BackendError(f"sandbox {sandbox_id}: the session's shell {s.shell} did "
                                   f"not answer ({end.reason if end else 'no end'})")
            s.runs = 0
            rec.touch()
            log.info("session started", extra={"sandbox": sandbox_id, "session": session_id,
                                               "shell": s.shell})
            return s
        assert last is not None
        raise BadRequest(f"sandbox {sandbox_id}: no shell to start a session: {last}") from last

    async def _hold(self, s: Session, spec: ExecSpec, started: asyncio.Future[ExecHandle]) -> None:
        """Keep the session's exec open and route its output to the run in progress (or
        drop it between runs) until the shell ends or the session is closed."""
        try:
            async with self._m.exec(s.sandbox_id, spec, counts_active=False) as handle:
                started.set_result(handle)
                async for ev in handle.events():
                    run = self._runs.get((s.sandbox_id, s.id))
                    if isinstance(ev, ExecEnd):
                        s.end = ev
                        if run is not None:
                            await run.queue.put(ev)
                        log.info("session ended", extra={
                            "sandbox": s.sandbox_id, "session": s.id, "reason": ev.reason,
                            "exit_code": ev.exit_code})
                        return
                    if run is None:
                        s.dropped_bytes += len(ev[1])
                    else:
                        await run.queue.put(ev)
        except BaseException as e:
            if not started.done():
                started.set_exception(e if isinstance(e, Exception) else
                                      InvalidState("the session's shell did not start"))
            if isinstance(e, Exception) and not isinstance(e, asyncio.CancelledError):
                log.warning("session %s/%s: %s", s.sandbox_id, s.id, e)
            if not isinstance(e, Exception):
                raise
        finally:
            if s.end is None:
                s.end = ExecEnd("killed", None, None, time.time() - s.created_at, None)
            run = self._runs.get((s.sandbox_id, s.id))
            if run is not None:
                with contextlib.suppress(asyncio.QueueFull):
                    run.queue.put_nowait(s.end)

    async def run(self, sandbox_id: str, session_id: str, cmd: str, *,
                  timeout_s: float | None = None, output_limit: int | None = None
                  ) -> _RunEvents:
        """Start ``cmd`` in the session and return its events: ``(stream, bytes)`` chunks,
        then one :class:`RunEnd` (close them when done: ``aclose``). Raises NotFound,
        InvalidState (the session ended, the sandbox is not running), Conflict (a run is in
        progress), BadRequest. Closed before
        its end (the caller went away), the run is interrupted in the background and the
        session stays usable."""
        s = self.get(sandbox_id, session_id)
        line = encode_command(cmd)
        if s.end is not None:
            raise InvalidState(f"session {session_id}: its shell has ended "
                               f"({s.end.reason}); start a new session")
        if s.lock.locked():
            raise Conflict(f"session {session_id}: a run is in progress")
        rec = await self._m._awake(sandbox_id, "run in a session")
        if s.lock.locked():
            raise Conflict(f"session {session_id}: a run is in progress")
        await s.lock.acquire()
        nonce = secrets.token_hex(16)
        run = _Run(nonce, _Splitter(nonce.encode(), False), _Splitter(nonce.encode(), True))
        self._runs[(sandbox_id, session_id)] = run
        s.runs += 1
        s.running = True
        rec.active_execs += 1
        rec.touch()
        try:
            await s.handle.write_stdin(line + nonce.encode() + b"\n")
        except BaseException:
            self._left(s, run, rec, finished=False)
            raise
        return _RunEvents(self, s, run, rec, self._drive(s, run, timeout_s, output_limit))

    def _left(self, s: Session, run: _Run, rec: SandboxRecord, *, finished: bool) -> None:
        """The caller is done with a run: its end came, or it left before (then the run is
        interrupted in the background and the session freed once it has ended)."""
        rec.active_execs -= 1
        rec.touch()
        if finished or s.end is not None:
            self._release(s)
        else:
            self._m._background(self._abandon(s, run))

    def _release(self, s: Session) -> None:
        self._runs.pop((s.sandbox_id, s.id), None)
        s.running = False
        if s.lock.locked():
            s.lock.release()

    async def _abandon(self, s: Session, run: _Run) -> None:
        try:
            async for _ in self._drive(s, run, 0.0, None, why="abandoned"):
                pass
        finally:
            self._release(s)

    async def _drive(self, s: Session, run: _Run, timeout_s: float | None,
                     output_limit: int | None,
                     why: str | None = None
                     ) -> AsyncGenerator[tuple[str, bytes] | RunEnd, None]:
        """The run's events until both end markers (or the shell's end), interrupting it when
        its time or output is up (or at once with ``why``)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reason = why
        steps = list(INTERRUPTS)
        step_at = t0 if why else (t0 + timeout_s if timeout_s else None)
        sent = 0
        sig: int | None = None
        while True:
            now = loop.time()
            if step_at is not None and now >= step_at:
                if reason is None:
                    reason = "timeout"
                if not steps:  # survived SIGINT and SIGTERM: the session goes
                    await self._kill(s)
                    yield RunEnd(reason, None, 9, loop.time() - t0, session_ended=True)
                    return
                sig, wait_s = steps.pop(0)
                with contextlib.suppress(Exception):
                    await s.handle.signal(sig)
                step_at = loop.time() + wait_s
                continue
            try:
                ev = await asyncio.wait_for(run.queue.get(),
                                            None if step_at is None else step_at - now)
            except TimeoutError:
                continue
            if isinstance(ev, ExecEnd):
                yield RunEnd(reason or "session_ended", ev.exit_code, ev.signal,
                             loop.time() - t0, session_ended=True)
                return
            stream, data = ev
            part = (run.out if stream == "stdout" else run.err).feed(data)
            if part and reason is None:
                if output_limit is not None and sent + len(part) > output_limit:
                    part = part[:output_limit - sent]
                    reason, step_at = "output_limit", loop.time()
                sent += len(part)
                if part:
                    yield stream, part
            if run.done:
                code = run.err.status if reason is None else None
                yield RunEnd(reason or "exited", code, sig if reason else None,
                             loop.time() - t0)
                return

    async def _kill(self, s: Session) -> None:
        """End the session's shell and everything it started (SIGKILL to its processes),
        waiting for its end a moment."""
        with contextlib.suppress(Exception):
            await s.handle.signal(9)
        if s.holder is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(s.holder), 2.0)
            if not s.holder.done():
                s.holder.cancel()  # the manager abandons the exec: its tree is killed
                with contextlib.suppress(BaseException):
                    await s.holder

    async def close(self, sandbox_id: str, session_id: str) -> Session:
        """End a session (its shell and whatever it left running are killed) and forget it.
        Raises NotFound."""
        s = self.get(sandbox_id, session_id)
        self._by_sandbox.get(sandbox_id, {}).pop(session_id, None)
        await self._kill(s)
        self._release(s)
        return s

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: drop its sessions (their execs ended with it)."""
        for s in self._by_sandbox.pop(sandbox_id, {}).values():
            if s.holder is not None and not s.holder.done():
                s.holder.cancel()
            self._runs.pop((sandbox_id, s.id), None)
        self._next.pop(sandbox_id, None)
