"""The client side of sbx-init's control protocol (:mod:`edged.sbxinit.protocol`), over any
byte stream: a Unix socket (containers), a pipe pair or a socketpair (tests, a directly
spawned sbx-init), a virtio-serial port or a vsock connection (microVM guests). One
:class:`SbxClient` per connection; one :class:`SbxExec` per exec it started.

What the transport must give is an :class:`asyncio.StreamReader` and an
:class:`asyncio.StreamWriter`; :func:`connect_unix` and :func:`open_fds` make them for a
socket path and for a pair of fds. Everything raised is an :mod:`edged.errors` exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import signal
import socket
import stat
import struct
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from edged.datatypes import EventSink, ExecEnd
from edged.errors import BackendError, BadRequest, InvalidState, NotFound, PidsExhausted
from edged.sbxinit import events
from edged.sbxinit import protocol as P

log = logging.getLogger("edged.sbxinit")

#: Output bytes consumed before they are credited back to sbx-init in one CREDIT frame.
CREDIT_BATCH = 32 << 10
#: Bytes the reader buffers (a frame's payload is at most protocol.MAX_PAYLOAD).
READ_LIMIT = 1 << 20
#: Seconds after an exec's timeout by which its END must have come from sbx-init; past
#: them the exec ends here, ``timeout`` with a message saying why (:meth:`SbxClient._overdue`).
#: sbx-init kills the tree at the timeout and sends END once the main process is reaped and
#: its output read: a process in uninterruptible sleep is never reaped while it sleeps (a
#: FUSE read its server has taken and not answered: a stopped or wedged lazy layer server,
#: or a remote slower than the fetch timeout, ``fuse/dev.c`` request_wait_answer waits
#: uninterruptibly for a request already sent), and a trainer must get every exec's end
#: within its timeout however the sandbox's filesystem behaves. Wide enough for a sbx-init
#: throttled by its sandbox's CPU quota to read the last output and report on real CPUs
#: (at ``cpus: 0.05`` that is 1 s of CPU). ``EDGED_EXEC_END_GRACE_S`` in the environment
#: sets it for a slower machine: the emulated node VM's (tests/nodevm/guest/run.sh: there a
#: sbx-init at 5% of an emulated CPU took more than 20 s to drain 8 short execs, and their
#: output, read after the end, was dropped).
END_GRACE_S = float(os.environ.get("EDGED_EXEC_END_GRACE_S") or 20.0)
#: errno values of an exec that cannot start because of what was asked (a missing program, a
#: bad cwd...): a BadRequest, not a backend failure. ENOENT EACCES ENOTDIR EISDIR E2BIG
#: ENOEXEC EINVAL ENAMETOOLONG ELOOP.
USER_ERRNOS = frozenset({2, 13, 20, 21, 7, 8, 22, 36, 40})


@dataclass(frozen=True)
class Hello:
    """sbx-init's answer to HELLO: protocol ``version``, its per-exec cgroup mode
    (``"none" | "v1" | "v2"``) and how many execs it runs now."""

    version: int
    cgroup_mode: str
    execs: int


class SbxExec:
    """A running exec (implements :class:`edged.backends.base.ExecHandle`)."""

    def __init__(self, client: SbxClient, exec_id: int, pty: bool) -> None:
        self.exec_id = exec_id
        #: the exec's main process in the sandbox's pid namespace (once started)
        self.pid = 0
        self._client = client
        self._pty = pty
        self._q: asyncio.Queue[tuple[str, bytes] | ExecEnd] = asyncio.Queue()
        self._uncredited = 0
        #: its end has come (queued, whether or not consumed yet)
        self.ended = False
        #: its consumer went away (:meth:`abandon`)
        self.abandoned = False
        #: ended here, its END from sbx-init overdue (see :data:`END_GRACE_S`); sbx-init
        #: still has it until its process is reaped
        self.overdue = False
        self._watchdog: asyncio.TimerHandle | None = None
        #: the consumer's callback (:meth:`tap`), None while it reads :meth:`events`
        self._tap: Callable[[tuple[str, bytes] | ExecEnd], None] | None = None

    def _push(self, item: tuple[str, bytes] | ExecEnd) -> None:
        if isinstance(item, ExecEnd):
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
            if not self.ended:
                self.ended = True
                if self._tap is not None:
                    self._tap(item)
                else:
                    self._q.put_nowait(item)
            return
        if self.ended or self.abandoned:
            # nobody reads it (gone, or its end given already): give the window back at
            # once, so sbx-init reads on to the end instead of waiting for credit
            self._client.write_now(P.frame(P.CREDIT, self.exec_id,
                                           P.CREDIT_S.pack(len(item[1]), 0)))
            return
        if self._tap is not None:
            self._tap(item)
            self._credit(len(item[1]))
            return
        self._q.put_nowait(item)

    def _credit(self, n: int) -> None:
        """``n`` more bytes consumed by a tap: credited back in batches, at once."""
        self._uncredited += n
        if self._uncredited >= CREDIT_BATCH:
            n, self._uncredited = self._uncredited, 0
            self._client.write_now(P.frame(P.CREDIT, self.exec_id, P.CREDIT_S.pack(n, 0)))

    def tap(self, fn: Callable[[tuple[str, bytes] | ExecEnd], None]) -> None:
        """Have every item :meth:`events` would yield given to ``fn`` as it arrives, from
        the connection's reader (what came already first), instead of queued for
        :meth:`events` (not to be used then): no task hop per chunk for a consumer that
        keeps all of it anyway. ``fn`` must not block or raise. Output is credited back
        as it is given (the consumer holds it, so no backpressure is left to it); the
        :class:`ExecEnd` comes last, once."""
        while not self._q.empty():
            item = self._q.get_nowait()
            fn(item)
            if not isinstance(item, ExecEnd):
                self._credit(len(item[1]))
        self._tap = fn

    async def events(self) -> AsyncIterator[tuple[str, bytes] | ExecEnd]:
        """Output chunks in order, then one :class:`ExecEnd`. Output is credited back to
        sbx-init only as it is consumed, so a consumer that stops reading stops the
        process once its pipe and the credit window (protocol.WINDOW) are full."""
        while True:
            item = await self._q.get()
            yield item
            if isinstance(item, ExecEnd):
                return
            self._uncredited += len(item[1])
            if self._uncredited >= CREDIT_BATCH and not self.ended:
                n, self._uncredited = self._uncredited, 0
                await self._client.send_quiet(
                    P.frame(P.CREDIT, self.exec_id, P.CREDIT_S.pack(n, 0)))

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the process's stdin, in chunks of at most protocol.MAX_DATA."""
        for i in range(0, len(data), P.MAX_DATA):
            await self._client.send(P.frame(P.STDIN, self.exec_id, data[i : i + P.MAX_DATA]))

    async def close_stdin(self) -> None:
        await self._client.send(P.frame(P.STDIN_EOF, self.exec_id))

    async def signal(self, sig: int) -> None:
        """Signal the exec's process group. Raises BadRequest for a signal out of 1..64."""
        if not 1 <= sig <= 64:
            raise BadRequest(f"signal {sig} out of range 1..64")
        await self._client.send(P.frame(P.SIGNAL_T, self.exec_id, P.SIGNAL.pack(sig, 0)))

    async def resize(self, rows: int, cols: int) -> None:
        """Set the pty's size (characters). Raises BadRequest if not a pty exec."""
        if not self._pty:
            raise BadRequest(f"exec {self.exec_id} has no pty")
        if not (0 < rows < 65536 and 0 < cols < 65536):
            raise BadRequest(f"pty size {rows}x{cols} out of range")
        await self._client.send(P.frame(P.RESIZE_T, self.exec_id,
                                        P.RESIZE.pack(rows, cols, 0)))

    async def kill(self) -> None:
        """Kill the exec's whole process tree (ends with reason ``killed``)."""
        await self._client.send(P.frame(P.KILL, self.exec_id))

    def abandon(self) -> None:
        """The consumer is gone (cancelled, disconnected): kill the exec's whole process
        tree now, without waiting, and drop its output still to come (credited back at once,
        so that sbx-init ends the exec and frees its slot). Idempotent; a no-op once
        ended."""
        if self.ended or self.abandoned:
            return
        self.abandoned = True
        owed = self._uncredited
        while not self._q.empty():
            item = self._q.get_nowait()
            if not isinstance(item, ExecEnd):
                owed += len(item[1])
        self._uncredited = 0
        data = P.frame(P.KILL, self.exec_id)
        if owed:
            data += P.frame(P.CREDIT, self.exec_id, P.CREDIT_S.pack(owed, 0))
        self._client.write_now(data)


@dataclass
class _Request:
    """A KILL_ALL or a file transfer waiting for its DONE (``count``); a get's data frames
    go to ``chunks`` (None ends them)."""

    done: asyncio.Future[int]
    chunks: asyncio.Queue[bytes | None] | None = None


#: errno values of a file request that are about the request (a missing file, a path that
#: leaves the root or crosses a mount, a directory...): ENOENT is NotFound, these BadRequest.
FILE_USER_ERRNOS = frozenset({1, 13, 20, 21, 22, 18, 30, 36, 40})  # EPERM EACCES ENOTDIR
# EISDIR EINVAL EXDEV EROFS ENAMETOOLONG ELOOP


class SbxClient:
    """The control connection to one sbx-init over ``reader``/``writer``.

    ``sandbox_id`` names the sandbox in errors and events; ``sink`` receives its security
    events (denied syscalls, limit hits, protocol violations); ``on_end`` is called after
    each exec end (e.g. to poll limit counters). A connection that breaks ends every exec
    it started with reason ``killed`` (sbx-init kills their trees when its client goes).
    """

    def __init__(self, sandbox_id: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, sink: EventSink | None = None,
                 on_end: Callable[[], None] | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.sink = sink
        self.on_end = on_end
        self.reader = reader
        self.writer = writer
        self.handles: dict[int, SbxExec] = {}
        self.pending: dict[int, asyncio.Future[int]] = {}
        self.requests: dict[int, _Request] = {}
        self.closed = False
        #: sbx-init's answer to the last :meth:`hello`
        self.info: Hello | None = None
        self._hello: asyncio.Future[tuple[int, ...]] = (
            asyncio.get_running_loop().create_future())
        self._next_exec = 1
        self._lock = asyncio.Lock()
        #: frames queued while the transport is away (:meth:`quiesce`), None otherwise;
        #: :meth:`send` waits for ``_attached`` then
        self._held: list[bytes] | None = None
        self._attached = asyncio.Event()
        self._attached.set()
        self._task = asyncio.create_task(self._read_loop())

    # -- sending ---------------------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        """Write encoded frames (while the transport is away, see :meth:`quiesce`, once it
        is back). Raises InvalidState once the connection is closed."""
        while True:
            await self._attached.wait()
            if self.closed:
                raise InvalidState(f"sandbox {self.sandbox_id}: control connection closed")
            async with self._lock:
                if not self._attached.is_set():
                    continue  # quiesced while we waited for the lock: nothing may follow
                self.writer.write(data)
                await self.writer.drain()
                return

    def write_now(self, data: bytes) -> bool:
        """Queue encoded frames on the transport at once, without waiting for it to drain
        (for a caller that is being cancelled: whole frames, in order; while the transport
        is away, they go first once it is back). False once the connection is closed."""
        if self.closed:
            return False
        if self._held is not None:
            self._held.append(data)
            return True
        if self.writer.is_closing():
            return False
        self.writer.write(data)
        return True

    async def quiesce(self, timeout_s: float = 10.0) -> None:
        """Take everything sbx-init sent and stop it sending (protocol QUIESCE): from the
        answer on, frames to send are held here (:meth:`send` waits) and sbx-init sends
        nothing, its execs running on, until :meth:`reattach` speaks again. Then the
        transport may go (:meth:`detach`): a microVM is saved in this state. Raises
        BackendError (no answer within ``timeout_s``: sbx-init is made to speak again and
        nothing is held), InvalidState (closed)."""
        if self._held is not None:
            raise InvalidState(f"sandbox {self.sandbox_id}: control connection already "
                               f"quiesced")
        if self.closed:
            raise InvalidState(f"sandbox {self.sandbox_id}: control connection closed")
        rid = self._request_id()
        req = _Request(asyncio.get_running_loop().create_future())
        self.requests[rid] = req
        async with self._lock:  # no frame of another sender may follow QUIESCE
            self._held = []
            self._attached.clear()
            self.writer.write(P.frame(P.QUIESCE, rid))
        try:
            await self.writer.drain()
            await asyncio.wait_for(asyncio.shield(req.done), timeout_s)
        except BaseException as exc:
            self.requests.pop(rid, None)
            self.unquiesce()  # whatever the answer, have it speak again
            if isinstance(exc, TimeoutError):
                raise BackendError(f"sandbox {self.sandbox_id}: sbx-init did not quiesce "
                                   f"within {timeout_s} s") from exc
            raise

    def unquiesce(self) -> None:
        """Speak again over the same transport (a pause that did not happen): HELLO, then
        the frames held since :meth:`quiesce`. Nothing if not quiesced."""
        if self._held is None:
            return
        held, self._held = self._held, None
        self._attached.set()
        if not self.closed and not self.writer.is_closing():
            self.writer.write(b"".join([P.frame(P.HELLO), *held]))

    async def detach(self) -> None:
        """Drop the transport of a quiesced connection, keeping every exec, request and
        held frame for :meth:`reattach`."""
        if self._held is None:
            raise InvalidState(f"sandbox {self.sandbox_id}: detach without quiesce")
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()

    async def reattach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       timeout_s: float = 5.0) -> Hello:
        """Go on over a new transport to the same sbx-init (a restored microVM's): HELLO,
        which makes it speak again, then the frames held since :meth:`quiesce`; execs and
        requests carry on. Raises BackendError (no hello: the connection is then lost,
        its execs ended ``killed``)."""
        if self._held is None:
            raise InvalidState(f"sandbox {self.sandbox_id}: reattach without quiesce")
        self.reader, self.writer = reader, writer
        self._hello = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read_loop())
        held, self._held = self._held, None
        writer.write(b"".join([P.frame(P.HELLO), *held]))
        self._attached.set()
        try:
            version, mode, execs, _r = await asyncio.wait_for(asyncio.shield(self._hello),
                                                             timeout_s)
        except (TimeoutError, OSError, BackendError) as exc:
            await self.close()
            raise BackendError(f"sandbox {self.sandbox_id}: no hello from sbx-init after "
                               f"the transport came back: {_why(exc, timeout_s)}") from exc
        self.info = Hello(version, P.CGROUP_MODES.get(mode, str(mode)), execs)
        return self.info

    async def send_quiet(self, data: bytes) -> None:
        """:meth:`send`, ignoring a closed or broken connection; while the transport is
        away, held without waiting (credits: a consumer goes on with what it has)."""
        if self._held is not None:
            self._held.append(data)
            return
        with contextlib.suppress(InvalidState, ConnectionError):
            await self.send(data)

    async def hello(self, timeout_s: float = 5.0, new_client: bool = False) -> Hello:
        """Send HELLO and wait (``timeout_s``) for the answer. ``new_client``: on a stream
        another client had (a restored microVM's), that client's execs go first. Raises
        BackendError if none comes or sbx-init speaks another protocol version."""
        try:
            await self.send(P.frame(P.HELLO, flags=P.HELLO_NEW_CLIENT if new_client else 0))
            version, mode, execs, _r = await asyncio.wait_for(asyncio.shield(self._hello),
                                                             timeout_s)
        except (TimeoutError, OSError) as exc:
            raise BackendError(f"sandbox {self.sandbox_id}: no hello from sbx-init: "
                               f"{_why(exc, timeout_s)}") from exc
        if version != P.VERSION:
            raise BackendError(f"sandbox {self.sandbox_id}: sbx-init speaks protocol "
                               f"{version}, not {P.VERSION}")
        self.info = Hello(version, P.CGROUP_MODES.get(mode, str(mode)), execs)
        return self.info

    async def exec(self, argv: tuple[str, ...], env: Mapping[str, str], *, cwd: str = "/",
                   uid: int = 0, gid: int = 0, timeout_s: float | None = None,
                   output_limit: int | None = None, stdin: bool = False, pty: bool = False,
                   grader: bool = False, rows: int = 0, cols: int = 0) -> SbxExec:
        """Start ``argv``; returns once the program runs (its execve done). ``timeout_s``
        (seconds) and ``output_limit`` (stdout+stderr bytes) end the tree when passed;
        ``grader``: the exec sees the grader view (SBX_EXEC_GRADER). Raises BadRequest
        (input sbx-init refuses, or a program that cannot start: missing file, bad cwd...),
        PidsExhausted (fork at the pids limit, or too many execs), BackendError, and
        InvalidState when the connection is closed."""
        flags = ((P.EXEC_STDIN if stdin else 0) | (P.EXEC_PTY if pty else 0)
                 | (P.EXEC_GRADER if grader else 0))
        eid = self._request_id()
        try:
            data = P.exec_frame(eid, tuple(argv), dict(env), cwd, uid, gid,
                                math.ceil(timeout_s * 1000) if timeout_s else 0,
                                output_limit or 0, flags, rows, cols)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        h = SbxExec(self, eid, pty)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        if not self.write_now(data):
            raise InvalidState(f"sandbox {self.sandbox_id}: control connection closed")
        self.handles[eid] = h
        self.pending[eid] = fut
        if timeout_s:
            h._watchdog = loop.call_later(timeout_s + END_GRACE_S, self._overdue, eid,
                                          timeout_s, time.monotonic())
        try:
            async with self._lock:
                await self.writer.drain()
            h.pid = await fut
        except BaseException:
            self.pending.pop(eid, None)
            if fut.done():  # refused (ERROR) or the connection lost: nothing runs
                self.handles.pop(eid, None)
            else:
                # Cancelled (a caller's timeout) with the request on its way: the exec may
                # be starting. Killed, its handle kept until its END (or ERROR) comes.
                fut.cancel()
                h.abandon()
            raise
        return h

    def _overdue(self, eid: int, timeout_s: float, t0: float) -> None:
        """Exec ``eid``'s END has not come :data:`END_GRACE_S` after its timeout: end it here
        (``timeout``, with a message), SIGKILL its tree again, and let sbx-init's late END
        (or ERROR) only free the handle. An exec whose program had not even started (its
        execve blocked in the same way) ends so too: :meth:`exec` returns its handle."""
        h = self.handles.get(eid)
        if h is None or h.ended or h.abandoned:  # ended, or nobody waits for its end
            return
        h.overdue = True
        started = eid not in self.pending
        fut = self.pending.pop(eid, None)
        if fut is not None and not fut.done():
            fut.set_result(0)
        self.write_now(P.frame(P.KILL, eid))
        msg = (f"timed out after {timeout_s:g} s; its process "
               f"{'was killed but could not be reaped' if started else 'could not be started'}"
               f" within {END_GRACE_S:g} s (no end from sbx-init: a process in uninterruptible"
               f" sleep, e.g. a read of a layer whose server does not answer, or a stalled "
               f"sbx-init); ended by the daemon, output after this point is dropped")
        log.warning("sandbox %s: exec %d: %s", self.sandbox_id, eid, msg)
        end = ExecEnd(reason="timeout", exit_code=None, signal=None,
                      duration_s=time.monotonic() - t0, peak_memory_bytes=None, message=msg)
        h._push(end)
        events.record_end(self.sink, self.sandbox_id, eid, end)

    def _request_id(self) -> int:
        """A nonzero id for an exec or a request, none of the ones running."""
        while True:
            rid = self._next_exec
            self._next_exec = rid + 1 if rid < 0xFFFFFFFF else 1
            if rid not in self.handles and rid not in self.requests:
                return rid

    async def _request(self, data_of: Callable[[int], bytes],
                       chunks: bool = False) -> tuple[int, _Request]:
        rid = self._request_id()
        req = _Request(asyncio.get_running_loop().create_future(),
                       asyncio.Queue() if chunks else None)
        self.requests[rid] = req
        try:
            await self.send(data_of(rid))
        except BaseException:
            self.requests.pop(rid, None)
            raise
        return rid, req

    async def kill_all(self) -> int:
        """SIGKILL every process of the sandbox but sbx-init, until none is left (running
        execs end ``killed``); returns how many there were. Raises BackendError,
        InvalidState (connection closed)."""
        _rid, req = await self._request(lambda rid: P.frame(P.KILL_ALL, rid))
        return await req.done

    async def put_file(self, path: str, data: bytes | AsyncIterator[bytes], *,
                       mode: int = 0o644, uid: int = 0, gid: int = 0) -> int:
        """Write ``data`` to ``path`` inside the sandbox (it appears whole, renamed into
        place, owned ``uid``:``gid`` with ``mode``); returns the bytes written. Raises
        BadRequest (a path that leaves the root or crosses a mount, a directory...),
        NotFound (no such directory), BackendError."""
        try:
            head = P.file_frame(P.FILE_PUT, 0, path, mode, uid, gid)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        rid, req = await self._request(lambda rid: P.frame(P.FILE_PUT, rid, head[P.HDR.size:]))
        try:
            if isinstance(data, bytes | bytearray | memoryview):
                await self._put_chunks(rid, bytes(data))
            else:
                async for chunk in data:
                    if req.done.done():  # refused on the way: the ERROR says why
                        break
                    await self._put_chunks(rid, chunk)
            await self.send(P.frame(P.FILE_END, rid))
            return await req.done
        except BaseException:
            if not req.done.done():
                self.requests.pop(rid, None)
                self.write_now(P.frame(P.FILE_ABORT, rid))
            raise

    async def _put_chunks(self, rid: int, data: bytes) -> None:
        for i in range(0, len(data), P.MAX_DATA):
            await self.send(P.frame(P.FILE_DATA, rid, data[i : i + P.MAX_DATA]))

    async def get_file(self, path: str) -> AsyncIterator[bytes]:
        """Open the file at ``path`` inside the sandbox and return an iterator of its
        chunks; a missing file raises NotFound here, at the call (BadRequest: a path that
        leaves the root, a directory; BackendError). The data comes under a credit window:
        not consuming it stops sbx-init reading."""
        try:
            head = P.file_frame(P.FILE_GET, 0, path)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        rid, req = await self._request(
            lambda rid: P.frame(P.FILE_GET, rid, head[P.HDR.size:]), chunks=True)
        assert req.chunks is not None
        first = await req.chunks.get()
        if first is None:
            await req.done  # raises what sbx-init refused
        return self._get_rest(rid, req, first)

    async def _get_rest(self, rid: int, req: _Request,
                        first: bytes | None) -> AsyncIterator[bytes]:
        assert req.chunks is not None
        uncredited = 0
        chunk = first
        try:
            while chunk is not None:
                yield chunk
                uncredited += len(chunk)
                if uncredited >= CREDIT_BATCH:
                    await self.send_quiet(P.frame(P.FILE_CREDIT, rid,
                                                  P.CREDIT_S.pack(uncredited, 0)))
                    uncredited = 0
                chunk = await req.chunks.get()
            await req.done
        finally:
            if not req.done.done():  # left before the end
                self.requests.pop(rid, None)
                self.write_now(P.frame(P.FILE_ABORT, rid))

    # -- receiving -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        dec = P.Decoder()
        broken = False
        try:
            while True:
                data = await self.reader.read(1 << 18)
                if not data:
                    break
                for f in dec.feed(data):
                    try:
                        self._dispatch(f)
                    except struct.error as exc:
                        raise ValueError(f"frame type {f.type:#x}: bad payload ({exc})") from exc
        except ConnectionError as exc:
            log.warning("sandbox %s: control connection: %s", self.sandbox_id, exc)
        except ValueError as exc:
            # sbx-init broke the protocol: only a compromised PID 1 would
            log.warning("sandbox %s: control connection: %s", self.sandbox_id, exc)
            self._violation({"from": "sbx-init", "error": str(exc)})
            broken = True
        finally:
            # quiesced, the transport may go (a paused microVM's VMM ends) to come back
            if broken or self._held is None:
                self._lost()

    def _violation(self, detail: dict[str, object]) -> None:
        if self.sink is not None:
            self.sink(self.sandbox_id, "protocol_violation", detail=detail)

    def _dispatch(self, f: P.Frame) -> None:
        if f.type in (P.STDOUT, P.STDERR):
            h = self.handles.get(f.exec_id)
            if h:
                h._push(("stdout" if f.type == P.STDOUT else "stderr", f.payload))
        elif f.type == P.END:
            reason, code, sig, _r, dur_ns, peak = P.END_S.unpack(f.payload)
            h = self.handles.pop(f.exec_id, None)
            end = ExecEnd(reason=P.REASONS.get(reason, "killed"),
                          exit_code=code if code >= 0 else None,
                          signal=sig or None, duration_s=dur_ns / 1e9,
                          peak_memory_bytes=peak or None)
            if h is not None and h.overdue:  # ended here already, and recorded
                log.info("sandbox %s: exec %d reaped at last, %.1f s after it started",
                         self.sandbox_id, f.exec_id, end.duration_s)
            else:
                if h is not None:
                    h._push(end)
                events.record_end(self.sink, self.sandbox_id, f.exec_id, end)
            if self.on_end is not None:
                self.on_end()
        elif f.type == P.EVENT:
            events.record_event(self.sink, self.sandbox_id, f.exec_id, f.payload)
        elif f.type == P.STARTED:
            pid = P.STARTED_S.unpack(f.payload)[0]
            fut = self.pending.pop(f.exec_id, None)
            if fut and not fut.done():
                fut.set_result(pid)
        elif f.type == P.FILE_DATA:
            req = self.requests.get(f.exec_id)
            if req is not None and req.chunks is not None:
                req.chunks.put_nowait(f.payload)
        elif f.type == P.DONE:
            count, _r = P.DONE_S.unpack(f.payload)
            req = self.requests.pop(f.exec_id, None)
            if req is not None:
                if not req.done.done():
                    req.done.set_result(count)
                if req.chunks is not None:
                    req.chunks.put_nowait(None)
        elif f.type == P.ERROR:
            self._on_error(f)
        elif f.type == P.HELLO_OK:
            if not self._hello.done():
                self._hello.set_result(P.HELLO_S.unpack(f.payload))
        else:
            raise ValueError(f"unknown frame type {f.type:#x} from sbx-init")

    def _on_error(self, f: P.Frame) -> None:
        code = P.ERROR_S.unpack_from(f.payload)[0]
        msg = f.payload[P.ERROR_S.size :].decode("utf-8", "replace")
        req = self.requests.pop(f.exec_id, None)
        if req is not None:
            cls_: type[Exception] = BackendError
            if code == errno.ENOENT:
                cls_ = NotFound
            elif code in FILE_USER_ERRNOS:
                cls_ = BadRequest
            if not req.done.done():
                req.done.set_exception(cls_(f"sandbox {self.sandbox_id}: {msg}"))
            if req.chunks is not None:
                req.chunks.put_nowait(None)
            return
        h = self.handles.get(f.exec_id)
        if h is not None and (h.abandoned or h.overdue) and f.exec_id not in self.pending:
            self.handles.pop(f.exec_id)  # an abandoned (or overdue) exec that could not start
            return
        fut = self.pending.pop(f.exec_id, None)
        if fut and not fut.done():
            self.handles.pop(f.exec_id, None)
            cls: type[Exception] = BackendError
            if code in USER_ERRNOS:
                cls = BadRequest
            elif code == errno.EAGAIN:  # fork at the pids limit, or too many execs
                cls = PidsExhausted
            fut.set_exception(cls(f"sandbox {self.sandbox_id}: {msg}"))
            return
        if code == errno.ESRCH:  # a message for an exec that has just ended: a benign race
            log.debug("sandbox %s: sbx-init: %s", self.sandbox_id, msg)
            return
        log.warning("sandbox %s: sbx-init error (exec %d): %s", self.sandbox_id,
                    f.exec_id, msg)
        if code in (errno.EINVAL, errno.EMSGSIZE):
            # sbx-init refused a malformed frame (not a benign race such as a signal for an
            # exec that has just ended, ESRCH)
            self._violation({"from": "client", "exec_id": f.exec_id, "errno": code,
                             "message": msg})

    def _lost(self) -> None:
        self.closed = True
        self._held = None
        self._attached.set()  # senders waiting for a transport get InvalidState
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(BackendError(f"sandbox {self.sandbox_id}: sbx-init went away"))
        self.pending.clear()
        for req in self.requests.values():
            if not req.done.done():
                req.done.set_exception(BackendError(f"sandbox {self.sandbox_id}: sbx-init went "
                                                    f"away"))
                req.done.exception()  # retrieved: nobody may be waiting
            if req.chunks is not None:
                req.chunks.put_nowait(None)
        self.requests.clear()
        for h in self.handles.values():
            h._push(ExecEnd(reason="killed", exit_code=None, signal=signal.SIGKILL,
                            duration_s=0.0, peak_memory_bytes=None))
        self.handles.clear()
        if not self._hello.done():
            self._hello.set_exception(BackendError(f"sandbox {self.sandbox_id}: no hello"))
            self._hello.exception()  # retrieved: nobody may be waiting

    async def close(self) -> None:
        """Close the connection (sbx-init then kills the trees of this client's execs) and
        end every exec handle still open."""
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._lost()


def _why(exc: BaseException, timeout_s: float) -> str:
    """Why a wait of ``timeout_s`` seconds ended, in words: ``str(TimeoutError())`` is
    empty, so a timeout says what it waited for and how long."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    return str(exc) or type(exc).__name__


# -- transports ------------------------------------------------------------------------------

async def connect_unix(path: str | os.PathLike[str], sandbox_id: str, *,
                       sink: EventSink | None = None, on_end: Callable[[], None] | None = None,
                       timeout_s: float = 5.0) -> SbxClient:
    """Connect to sbx-init's listening Unix socket ``path`` and exchange HELLO (both within
    ``timeout_s`` each; the answer is the client's ``info``). Raises BackendError."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(path), limit=READ_LIMIT), timeout_s)
    except (TimeoutError, OSError) as exc:
        raise BackendError(f"sandbox {sandbox_id}: connect to sbx-init {path}: "
                           f"{_why(exc, timeout_s)}") from exc
    client = SbxClient(sandbox_id, reader, writer, sink, on_end)
    try:
        await client.hello(timeout_s)
    except BaseException:
        await client.close()
        raise
    return client


async def open_fds(rfd: int, wfd: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A reader on ``rfd`` and a writer on ``wfd``: the same fd for a socket (Unix, vsock)
    or a port (a character device such as a virtio-serial port), two for a pipe pair. The
    fds are owned by the transports from then on (closed with the writer and at EOF)."""
    loop = asyncio.get_running_loop()
    if rfd == wfd and stat.S_ISSOCK(os.fstat(rfd).st_mode):
        sock = socket.socket(fileno=rfd)
        return await asyncio.open_connection(sock=sock, limit=READ_LIMIT)
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    rproto = asyncio.StreamReaderProtocol(reader)
    if wfd == rfd:
        # each pipe transport closes its own file; asyncio watches a write pipe's fd for
        # its reader going away only when it is a FIFO or a socket, never a device
        wfd = os.dup(rfd)
    rtransport, _ = await loop.connect_read_pipe(lambda: rproto,
                                                 os.fdopen(rfd, "rb", buffering=0))
    wtransport, wproto = await loop.connect_write_pipe(
        lambda: _WritePipeProtocol(rtransport), os.fdopen(wfd, "wb", buffering=0))
    writer = asyncio.StreamWriter(wtransport, wproto, None, loop)
    return reader, writer


class _WritePipeProtocol(asyncio.streams.FlowControlMixin):
    """The write half of a pipe pair: closing it (the writer) closes the read half too, as
    closing a socket does."""

    def __init__(self, read_transport: asyncio.BaseTransport) -> None:
        super().__init__()
        self._read_transport = read_transport

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._read_transport.close()


__all__ = [
    "CREDIT_BATCH",
    "USER_ERRNOS",
    "Hello",
    "SbxClient",
    "SbxExec",
    "connect_unix",
    "open_fds",
]
