"""Process handles: a command running in the background (``sbx.exec(cmd, background=True)``)
or on a pseudo-terminal (``sbx.pty()``), driven while it runs.

The exec streams over one NDJSON request that a reader thread consumes into a queue; its
stdin is kept open and fed by ``POST .../execs/{exec_id}/stdin``, its pseudo-terminal
resized by ``.../resize``, signals sent by ``POST .../signal``. Dropping the handle's
stream (:meth:`ProcessHandle.close`, or the process ending the program) kills the process,
as for any exec whose caller goes away.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from edged.client._common import ExecCollector, ExecResult, OutputCallback
from edged.client._http import Transport, path_for
from edged.client.errors import SandboxError

_END = object()


class _Sandbox(Protocol):
    id: str
    _t: Transport


class ProcessHandle:
    """A running command. ``exec_id``: its id in the sandbox; ``pty``: whether it runs on a
    pseudo-terminal (then everything it writes is ``stdout``).

    Read its output with :meth:`events` (``(stream, bytes)`` in order), or :attr:`stdout` /
    :attr:`stderr` (text chunks of one stream; the other's are kept for :meth:`wait`), or
    just :meth:`wait` for the :class:`~edged.client.ExecResult`."""

    def __init__(self, sbx: _Sandbox, body: dict[str, Any], *,
                 on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None) -> None:
        self._sbx = sbx
        self.pty = bool(body.get("pty"))
        self._col = ExecCollector(on_stdout, on_stderr)
        self._q: queue.Queue[Any] = queue.Queue()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._conn: Any = None
        self.exec_id: int | None = None
        self._thread = threading.Thread(target=self._read, args=(body,), daemon=True,
                                        name=f"edged-exec-{sbx.id}")
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _read(self, body: dict[str, Any]) -> None:
        path = path_for("sandboxes", self._sbx.id, "exec")
        try:
            for ev in self._sbx._t.ndjson("POST", path, body, on_open=self._opened):
                got = self._col.feed(ev)
                if "start" in ev:
                    self.exec_id = self._col.exec_id
                    self._started.set()
                if got is not None:
                    self._q.put(got)
                if "end" in ev:
                    break
        except BaseException as e:
            self._error = e
        finally:
            self._started.set()
            self._q.put(_END)

    def _opened(self, conn: Any) -> None:
        self._conn = conn

    def events(self) -> Iterator[tuple[str, bytes]]:
        """``(stream, bytes)`` chunks in the order they came, until the process ends."""
        while True:
            item = self._q.get()
            if item is _END:
                self._q.put(_END)
                return
            yield item

    def _stream(self, name: str) -> Iterator[str]:
        dec = ExecCollector(None, None).dec[name]
        for stream, data in self.events():
            if stream == name:
                text = dec.decode(data)
                if text:
                    yield text
        rest = dec.decode(b"", True)
        if rest:
            yield rest

    @property
    def stdout(self) -> Iterator[str]:
        """Text chunks of stdout as they come (those of stderr are passed over)."""
        return self._stream("stdout")

    @property
    def stderr(self) -> Iterator[str]:
        """Text chunks of stderr as they come."""
        return self._stream("stderr")

    def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait for the end (``timeout`` seconds: :class:`TimeoutError`; the process goes
        on) and return the result with all output, also what iterators already read."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"exec {self.exec_id} still running after {timeout} s")
        if self._error is not None and self._col.end is None:
            raise self._error
        return self._col.result()

    @property
    def done(self) -> bool:
        """Whether it has ended."""
        return not self._thread.is_alive()

    def _post(self, what: str, body: bytes | None = None, json_body: Any = None,
              query: dict[str, str] | None = None) -> Any:
        if self.exec_id is None:
            raise SandboxError("the exec has not started")
        path = path_for("sandboxes", self._sbx.id, "execs", str(self.exec_id), what,
                        query=query)
        if json_body is not None:
            return self._sbx._t.json("POST", path, json_body)
        conn, resp = self._sbx._t.open("POST", path, body or b"",
                                       {"Content-Type": "application/octet-stream"})
        try:
            return resp.read()
        finally:
            conn.close()

    def write_stdin(self, data: str | bytes) -> None:
        """Write to its stdin (text as UTF-8); on a pseudo-terminal, its input."""
        self._post("stdin", data.encode() if isinstance(data, str) else data)

    def close_stdin(self) -> None:
        """Close its stdin (EOF)."""
        self._post("stdin", b"", query={"eof": "1"})

    def resize(self, rows: int, cols: int) -> None:
        """Resize its pseudo-terminal."""
        self._post("resize", json_body={"rows": rows, "cols": cols})

    def signal(self, sig: int | str = "SIGTERM") -> None:
        """Send it a signal (its process group)."""
        if self.exec_id is None:
            raise SandboxError("the exec has not started")
        self._sbx._t.json("POST", path_for("sandboxes", self._sbx.id, "signal"),
                          {"signal": sig, "exec_id": self.exec_id})

    def kill(self) -> None:
        """SIGKILL it (a no-op once it has ended)."""
        if not self.done:
            with contextlib.suppress(SandboxError):
                self.signal(9)

    def close(self) -> None:
        """Drop the stream: the daemon kills what is left of the process."""
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(2)
        self._thread.join(10)


__all__ = ["ProcessHandle"]
