"""Blocking HTTP/1.1 over the daemon's Unix socket, on the standard library only (so that
importing the SDK stays cheap): one connection per request."""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import quote, urlencode

from edged.client._common import encode_json
from edged.client.errors import DaemonUnavailableError, SandboxError, from_body

DEFAULT_SOCKET = "/run/edged/edged.sock"


def default_socket() -> str:
    """``$EDGED_SOCKET``, else ``/run/edged/edged.sock``."""
    return os.environ.get("EDGED_SOCKET") or DEFAULT_SOCKET


class _UnixConnection(http.client.HTTPConnection):
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


def path_for(*parts: str, query: dict[str, Any] | list[tuple[str, str]] | None = None) -> str:
    """``/v1/...`` with each part percent-encoded (``:`` and ``/`` of image refs kept)."""
    p = "/v1/" + "/".join(quote(x, safe=":/") for x in parts)
    if query:
        p += "?" + urlencode(query)
    return p


class Transport:
    """Requests to one daemon socket. ``timeout``: seconds per socket operation (None: wait
    forever, used by exec streams whose command decides its own time)."""

    def __init__(self, socket_path: str | None = None, timeout: float | None = 60.0) -> None:
        self.socket_path = socket_path or default_socket()
        self.timeout = timeout

    def open(self, method: str, path: str, body: bytes | Iterable[bytes] | None = None,
             headers: dict[str, str] | None = None,
             timeout: float | None = -1.0) -> tuple[_UnixConnection, http.client.HTTPResponse]:
        """Send a request and return the connection and response (caller closes both).
        Raises the :mod:`edged.client.errors` exception of an error response."""
        conn = _UnixConnection(self.socket_path, self.timeout if timeout == -1.0 else timeout)
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

    def json(self, method: str, path: str, payload: Any = None) -> Any:
        """A JSON request/response round trip."""
        body = None if payload is None else encode_json(payload)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn, resp = self.open(method, path, body, headers)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def ndjson(self, method: str, path: str, payload: Any) -> Iterator[dict[str, Any]]:
        """Stream the objects of an NDJSON response."""
        conn, resp = self.open(method, path, encode_json(payload),
                               {"Content-Type": "application/json"}, timeout=None)
        try:
            for line in resp:
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()

    def upload(self, path: str, body: bytes | Iterable[bytes]) -> Any:
        """``PUT`` a byte body (whole, or streamed from an iterable of chunks); the JSON
        answer."""
        conn, resp = self.open("PUT", path, body, {"Content-Type": "application/octet-stream"})
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def download(self, path: str, chunk: int = 256 << 10) -> Iterator[bytes]:
        """``GET`` a byte body, streamed in chunks of up to ``chunk`` bytes."""
        conn, resp = self.open("GET", path)
        try:
            while data := resp.read(chunk):
                yield data
        finally:
            conn.close()
