"""A small asyncio client of the QEMU Machine Protocol (QMP).

QMP is JSON lines over a stream socket: a greeting, ``qmp_capabilities``, then commands
``{"execute": C, "arguments": A, "id": N}`` answered by ``{"return": ...}`` or
``{"error": {"class", "desc"}}`` with the same ``id``; asynchronous ``{"event": ...}`` lines
come in between (QEMU ``docs/interop/qmp-spec``). File descriptors for ``getfd`` go along a
command as SCM_RIGHTS ancillary data.

Our own client rather than a library because it must pass fds with a command (the migration
stream goes to a file we opened, so QEMU's ``-sandbox spawn=deny`` holds: no ``exec:`` URI), and
it is ~100 lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Sequence
from typing import Any

from edged.errors import BackendError


class QmpError(BackendError):
    """A QMP command failed (``cls``: QEMU's error class) or the monitor went away."""

    def __init__(self, message: str, cls: str = "") -> None:
        super().__init__(message)
        self.cls = cls


class Qmp:
    """One QMP connection. Use :meth:`connect`; then :meth:`execute`; :meth:`close`.
    Events are kept in :attr:`events` (a bounded list of the last 256), and waiters of
    :meth:`wait_event` are woken. Not safe for concurrent commands: they are serialised by a
    lock."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""
        self._lock = asyncio.Lock()
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self._event_waiters: list[tuple[str, asyncio.Future[dict[str, Any]]]] = []

    @classmethod
    async def connect(cls, path: str, timeout: float = 5.0) -> Qmp:
        """Connect to QMP at unix socket ``path`` and negotiate capabilities. Raises QmpError
        if nothing answers within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, path)
                self = cls(sock)
                greeting = await self._read_msg()
                if "QMP" not in greeting:
                    raise QmpError(f"QMP {path}: unexpected greeting {greeting!r}")
                await self.execute("qmp_capabilities")
        except QmpError:
            sock.close()
            raise
        except (OSError, TimeoutError) as e:
            sock.close()
            raise QmpError(f"QMP {path}: {str(e) or 'timed out'}") from e
        except BaseException:
            sock.close()
            raise
        return self

    def close(self) -> None:
        """Close the connection; pending event waiters get QmpError."""
        with contextlib.suppress(OSError):
            self._sock.close()
        for _, fut in self._event_waiters:
            if not fut.done():
                fut.set_exception(QmpError("QMP connection closed"))
        self._event_waiters.clear()

    async def _read_msg(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            data = await loop.sock_recv(self._sock, 65536)
            if not data:
                raise QmpError("QMP: monitor closed the connection (QEMU exited?)")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    def _on_event(self, msg: dict[str, Any]) -> None:
        name = msg.get("event", "")
        taken = False
        keep = []
        for want, fut in self._event_waiters:
            if fut.done():
                continue
            if want == name and not taken:
                fut.set_result(msg)
                taken = True
            else:
                keep.append((want, fut))
        self._event_waiters = keep
        if not taken:
            self.events.append(msg)
            del self.events[:-256]

    async def execute(
        self, command: str, arguments: dict[str, Any] | None = None,
        fds: Sequence[int] = (), timeout: float = 30.0,
    ) -> Any:
        """Run ``command`` and return its ``return`` value. ``fds`` are sent with it
        (for ``getfd``/``add-fd``). Raises QmpError with QEMU's error description and class,
        or on timeout / a closed monitor."""
        async with self._lock:
            self._next_id += 1
            req: dict[str, Any] = {"execute": command, "id": self._next_id}
            if arguments:
                req["arguments"] = arguments
            data = json.dumps(req).encode() + b"\n"
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(timeout):
                    if fds:
                        # sock_sendmsg is not in every loop: the message is tiny, send it
                        # blocking with the fds, then go back to non-blocking
                        self._sock.setblocking(True)
                        try:
                            socket.send_fds(self._sock, [data], list(fds))
                        finally:
                            self._sock.setblocking(False)
                    else:
                        await loop.sock_sendall(self._sock, data)
                    while True:
                        msg = await self._read_msg()
                        if "event" in msg:
                            self._on_event(msg)
                            continue
                        if msg.get("id") != self._next_id:
                            continue
                        if "error" in msg:
                            err = msg["error"]
                            raise QmpError(f"QMP {command}: {err.get('desc')}",
                                           err.get("class", ""))
                        return msg.get("return")
            except TimeoutError as e:
                raise QmpError(f"QMP {command}: no answer in {timeout} s") from e
            except QmpError:
                raise  # an OSError too: not to be wrapped again below
            except OSError as e:
                raise QmpError(f"QMP {command}: {e}") from e

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        """Wait for the next event ``name`` (reading the socket while no command does).
        Raises QmpError on timeout or a closed connection."""
        for msg in self.events:
            if msg.get("event") == name:
                self.events.remove(msg)
                return msg
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._event_waiters.append((name, fut))
        try:
            async with asyncio.timeout(timeout):
                while not fut.done():
                    async with self._lock:
                        if fut.done():
                            break
                        msg = await self._read_msg()
                        if "event" in msg:
                            self._on_event(msg)
                return fut.result()
        except TimeoutError as e:
            raise QmpError(f"QMP: no {name} event in {timeout} s") from e
