"""Blocking HTTP/1.1 over the daemon's Unix socket, on the standard library only (so that
importing the SDK stays cheap): one connection per request."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from edged.client._common import RetryPolicy, encode_json
from edged.client._common import path_for as path_for  # where the SDK's modules import it
from edged.client.errors import (
    CapacityExhaustedError,
    DaemonUnavailableError,
    SandboxError,
    from_body,
)

DEFAULT_SOCKET = "/run/edged/edged.sock"


def default_socket() -> str:
    """``$EDGED_SOCKET``, else ``/run/edged/edged.sock``."""
    return os.environ.get("EDGED_SOCKET") or DEFAULT_SOCKET


class UnixConnection(http.client.HTTPConnection):
    """An HTTP connection to the daemon's Unix socket ``path``; a failure to connect raises
    :class:`~edged.client.errors.DaemonUnavailableError`."""

    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.unix_path)
        except OSError as e:
            s.close()
            raise DaemonUnavailableError(f"edged at {self.unix_path}: {e.strerror or e}") from e
        self.sock = s


def retry_policy(retry: RetryPolicy | None, retries: int | None, backoff_s: float | None,
                 max_wait_s: float | None) -> RetryPolicy:
    """``retry`` (default :class:`~edged.client._common.RetryPolicy`) with the fields given
    one by one put in."""
    base = retry or RetryPolicy()
    return RetryPolicy(
        retries=max(0, base.retries if retries is None else retries),
        backoff_s=base.backoff_s if backoff_s is None else backoff_s,
        max_wait_s=base.max_wait_s if max_wait_s is None else max_wait_s)


def stream_cut(where: str | None, e: BaseException | None) -> DaemonUnavailableError:
    """The error of an NDJSON stream that stopped before its ``end`` event (``e``: how, if
    an exception said so)."""
    how = f": {type(e).__name__}: {e}" if e is not None else ""
    return DaemonUnavailableError(f"edged at {where}: the stream ended before its end event "
                                  f"(connection lost{how}); the outcome is unknown")


class Transport:
    """Requests to one daemon socket. ``timeout``: seconds per socket operation (None: wait
    forever, used by exec streams whose command decides its own time). A request refused
    with 503 (the node is full: ``capacity_exhausted``) is retried as ``retry`` says
    (:class:`~edged.client._common.RetryPolicy`; ``retries``, ``backoff_s``, ``max_wait_s``
    set its fields one by one)."""

    def __init__(self, socket_path: str | None = None, timeout: float | None = 60.0, *,
                 retry: RetryPolicy | None = None, retries: int | None = None,
                 backoff_s: float | None = None, max_wait_s: float | None = None) -> None:
        self.socket_path = socket_path or default_socket()
        self.timeout = timeout
        self.retry = retry_policy(retry, retries, backoff_s, max_wait_s)

    def retry_wait(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        return self.retry.wait(attempt, retry_after)

    def connection(self, timeout: float | None) -> http.client.HTTPConnection:
        """A connection to the daemon (not yet connected; a subclass may reach it
        otherwise, as the cluster's HTTP relay does)."""
        return UnixConnection(self.socket_path, timeout)

    def _open_once(self, method: str, path: str, body: bytes | Iterable[bytes] | None = None,
             headers: dict[str, str] | None = None,
             timeout: float | None = -1.0
             ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request and return the connection and response (caller closes both).
        Raises the :mod:`edged.client.errors` exception of an error response."""
        conn = self.connection(self.timeout if timeout == -1.0 else timeout)
        hdrs = dict(headers or {})
        try:
            if body is not None and not isinstance(body, bytes):
                conn.request(method, path, body=body, headers=hdrs, encode_chunked=True)
            else:
                conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
        except SandboxError:
            conn.close()
            raise
        except OSError as e:
            conn.close()
            raise DaemonUnavailableError(f"edged at {self.socket_path}: {e}") from e
        if resp.status >= 400:
            raw = resp.read()
            conn.close()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
            raise from_body(resp.status, parsed, resp.getheader("Retry-After"))
        return conn, resp

    def open(self, method: str, path: str, body: bytes | Iterable[bytes] | None = None,
             headers: dict[str, str] | None = None,
             timeout: float | None = -1.0
             ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request (retried on 503, see the class) and return the connection and
        response (caller closes both). Raises the :mod:`edged.client.errors` exception of
        an error response."""
        attempt = 0
        while True:
            try:
                return self._open_once(method, path, body, headers, timeout)
            except CapacityExhaustedError as e:
                if attempt >= self.retry.retries or not (body is None or isinstance(body, bytes)):
                    raise
                time.sleep(self.retry_wait(attempt, e.retry_after))
                attempt += 1

    def read_whole(self, conn: http.client.HTTPConnection,
                   resp: http.client.HTTPResponse) -> bytes:
        """The whole body of ``resp``; ``conn`` is done with (closed: one connection per
        request; a subclass may keep it for the next)."""
        try:
            return resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, payload: Any = None) -> Any:
        """A JSON request/response round trip."""
        body = None if payload is None else encode_json(payload)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn, resp = self.open(method, path, body, headers)
        return json.loads(self.read_whole(conn, resp))

    def ndjson(self, method: str, path: str, payload: Any,
               on_open: Callable[[http.client.HTTPConnection], object] | None = None
               ) -> Iterator[dict[str, Any]]:
        """Stream the objects of an NDJSON response (``on_open`` gets the connection once
        the response has begun: closing it ends the stream). Every stream the daemon sends
        ends with an ``end`` event: one cut before it (the connection lost, a truncated
        line, or a clean close without it) raises
        :class:`~edged.client.errors.DaemonUnavailableError`, never a silent end — what ran
        and what it wrote is then unknown."""
        conn, resp = self.open(method, path, encode_json(payload),
                               {"Content-Type": "application/json"}, timeout=None)
        if on_open is not None:
            on_open(conn)
        ended = False
        try:
            for line in resp:
                if line.strip():
                    ev = json.loads(line)
                    ended = ended or "end" in ev
                    yield ev
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise stream_cut(self.socket_path, e) from e
        finally:
            conn.close()
        if not ended:
            raise stream_cut(self.socket_path, None)

    def upload(self, path: str, body: bytes | Iterable[bytes]) -> Any:
        """``PUT`` a byte body (whole, or streamed from an iterable of chunks); the JSON
        answer."""
        conn, resp = self.open("PUT", path, body, {"Content-Type": "application/octet-stream"})
        return json.loads(self.read_whole(conn, resp))

    def download(self, path: str, chunk: int = 256 << 10) -> Iterator[bytes]:
        """``GET`` a byte body, streamed in chunks of up to ``chunk`` bytes."""
        conn, resp = self.open("GET", path)
        try:
            while data := resp.read(chunk):
                yield data
        finally:
            conn.close()
