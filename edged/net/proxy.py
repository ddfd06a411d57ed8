"""The node's SNI/Host proxy: what an IP filter cannot tell apart, checked by name.

Names that share an address (a CDN, a registry mirror, one egress proxy for every registry)
are one destination to the egress programs: allowing ``pypi.org`` would admit every site on
its address. So a sandbox's TCP connections to an address it learned from a DNS answer, on
port 443 or 80, are sent by the connect hook to this proxy instead (on the gateway address,
``csrc/bpf/egress.bpf.c``: ``EGRESS_A_PROXY``), which:

- port 443: reads the TLS ClientHello (RFC 8446 §4.1.2; the ``server_name`` extension,
  RFC 6066 §3) and takes its SNI name; a ClientHello without one, or anything that is not
  TLS, is refused;
- port 80: reads the HTTP/1.x request head and takes the ``Host`` header (or the host of an
  absolute-form target, RFC 9112 §3.2); ``CONNECT`` and anything that is not HTTP are
  refused;
- refuses the connection (closes it; ``egress_denied`` with ``hook: "proxy"``) unless the
  sandbox's *current* policy allows that name on that port;
- resolves the name itself (the node resolver's :meth:`~edged.net.dns.Resolver.resolve`:
  static records, cache, upstream; platform-denied answers dropped), connects there, sends
  what it read and relays both ways. The address the sandbox connected to is not used: a
  spoofed SNI or Host reaches the servers of the name it claims, never another site.

The TLS stays end to end (the proxy never holds a key), so what it cannot see: the HTTP
``Host`` inside TLS (domain fronting to another site behind the same CDN stays possible),
requests after the first on a kept-alive port-80 connection, and an Encrypted ClientHello's
inner name (the outer, public name is what is checked). A policy change closes the proxied
connections the new policy forbids (:meth:`Proxy.cut`).

Because the proxy connects from the host, proxied names work on a node whose uplink does not
forward (NAT needs the host to route the replies).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dns.rdatatype

from edged.net.dns import Answer, Client, bind_socket
from edged.net.policy import normalise_name

log = logging.getLogger("edged.net.proxy")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_HEAD = 16 << 10  # bytes read before the name must be known (a ClientHello, a request head)
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
CHUNK = 64 << 10
_LINGER_RESET = struct.pack("ii", 1, 0)  # struct linger {l_onoff 1, l_linger 0}: close resets


class NotNamed(Exception):
    """The first bytes name no host (``why``: ``not_tls``, ``no_sni``, ``not_http``,
    ``no_host``, ``connect_method``)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def tls_server_name(data: bytes) -> str | None:
    """The SNI host name of the TLS ClientHello that ``data`` begins with; None when more
    bytes are needed. Raises :class:`NotNamed` (``not_tls``: not a ClientHello; ``no_sni``:
    one without a host name). Handshake messages may span records (RFC 8446 §5.1)."""
    hs = b""
    off = 0
    while True:
        if len(data) < off + 5:
            return None
        ctype, major, rlen = data[off], data[off + 1], struct.unpack_from("!H", data, off + 3)[0]
        if ctype != 22 or major != 3 or rlen == 0:
            raise NotNamed("not_tls")
        if len(data) < off + 5 + rlen:
            hs += data[off + 5:]
            if len(hs) >= 4 and hs[0] != 1:
                raise NotNamed("not_tls")
            return None
        hs += data[off + 5: off + 5 + rlen]
        off += 5 + rlen
        if len(hs) >= 4:
            if hs[0] != 1:  # client_hello
                raise NotNamed("not_tls")
            need = 4 + int.from_bytes(hs[1:4], "big")
            if need > MAX_HEAD:
                raise NotNamed("not_tls")
            if len(hs) >= need:
                return _sni(hs[4:need])


def _sni(body: bytes) -> str:
    try:
        p = 2 + 32  # legacy_version, random
        p += 1 + body[p]  # session id
        p += 2 + struct.unpack_from("!H", body, p)[0]  # cipher suites
        p += 1 + body[p]  # compression methods
        if p == len(body):
            raise NotNamed("no_sni")  # no extensions at all
        end = p + 2 + struct.unpack_from("!H", body, p)[0]
        p += 2
        while p + 4 <= end:
            etype, elen = struct.unpack_from("!HH", body, p)
            p += 4
            if etype == 0:  # server_name: ServerNameList
                q, qend = p + 2, p + 2 + struct.unpack_from("!H", body, p)[0]
                while q + 3 <= qend:
                    ntype, nlen = body[q], struct.unpack_from("!H", body, q + 1)[0]
                    name = body[q + 3: q + 3 + nlen]
                    if ntype == 0 and len(name) == nlen and nlen:
                        return normalise_name(name.decode("ascii"))
                    q += 3 + nlen
            p += elen
    except (IndexError, struct.error, UnicodeDecodeError):
        raise NotNamed("not_tls") from None
    raise NotNamed("no_sni")


_METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE")


def http_host(data: bytes) -> str | None:
    """The host an HTTP/1.x request head that ``data`` begins with is for; None when more
    bytes are needed. Raises :class:`NotNamed`."""
    first = data.split(b" ", 1)[0]
    if first == b"CONNECT":
        raise NotNamed("connect_method")
    if (len(data) >= 8 or b" " in data or b"\n" in data) and first not in _METHODS:
        raise NotNamed("not_http")
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise NotNamed("not_http")
    target = parts[1]
    host = ""
    if target.lower().startswith("http://"):
        host = target[7:].split("/", 1)[0]
    else:
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            if k.strip().lower() == "host":
                host = v.strip()
                break
    host = host.rsplit("@", 1)[-1]
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":")[0]
    if not host:
        raise NotNamed("no_host")
    return normalise_name(host)


@dataclass(eq=False)
class _Conn:
    client: Client
    name: str
    port: int
    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]

    def abort(self) -> None:
        """Reset both legs: to the sandbox and to the server. ``SO_LINGER`` 0 makes the
        close a reset that drops what is queued (a plain close queues a FIN behind unsent
        data, which a peer that stopped reading never gets: the server's end stayed open)."""
        for w in self.writers:
            tr = w.transport
            if tr is not None and not tr.is_closing():
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                tr.abort()


class Proxy:
    """The proxy. ``listen``: the gateway addresses; ``tls_port``/``http_port``: its ports
    there. ``client_of(addr)``: the sandbox a source address belongs to (None: the
    connection is closed at once). ``resolve(name, rdtype)``: the node resolver's answer.
    ``refused(client, name, port, why)``: called for each refusal. Raises OSError from
    :meth:`start`."""

    def __init__(self, listen: Sequence[Address], tls_port: int, http_port: int,
                 client_of: Callable[[Address], Client | None],
                 resolve: Callable[[str, int], Awaitable[Answer]],
                 refused: Callable[[Client, str, int, str], None]) -> None:
        self.listen = list(listen)
        self.tls_port, self.http_port = tls_port, http_port
        self.client_of = client_of
        self.resolve = resolve
        self.refused = refused
        self._servers: list[asyncio.base_events.Server] = []
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.relayed = 0

    async def start(self) -> None:
        try:
            for addr in self.listen:
                for port, tls in ((self.tls_port, True), (self.http_port, False)):
                    sock = bind_socket(addr, port, socket.SOCK_STREAM)
                    handler = functools.partial(self._accept, tls=tls)
                    self._servers.append(await asyncio.start_server(handler, sock=sock))
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        for srv in self._servers:
            srv.close()
        for c in list(self._conns):
            c.abort()
        for t in list(self._tasks):
            t.cancel()
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await srv.wait_closed()
        self._servers.clear()

    def connections(self, sandbox_id: str) -> list[tuple[str, int]]:
        """``(name, port)`` of the sandbox's proxied connections."""
        return [(c.name, c.port) for c in self._conns if c.client.sandbox_id == sandbox_id]

    def cut(self, sandbox_id: str, *, every: bool = False) -> int:
        """Close (reset) the sandbox's proxied connections its current policy no longer
        allows (``every``: all of them: the sandbox is going); returns how many."""
        n = 0
        for c in list(self._conns):
            if c.client.sandbox_id == sandbox_id and (
                    every or not _allows(c.client, c.name, c.port)):
                c.abort()
                self._conns.discard(c)
                n += 1
        return n

    @property
    def open(self) -> int:
        """Proxied connections open now (all sandboxes)."""
        return len(self._conns)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                      tls: bool) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._serve(reader, writer, tls)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.exception("proxy: a connection failed")
        finally:
            if task is not None:
                self._tasks.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     tls: bool) -> None:
        peer = writer.get_extra_info("peername")
        client = self.client_of(ipaddress.ip_address(peer[0])) if peer else None
        if client is None:
            return
        port = 443 if tls else 80
        head = b""
        name: str | None = None
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                while name is None:
                    chunk = await reader.read(MAX_HEAD - len(head))
                    if not chunk:
                        if head:  # a name was still to come
                            self.refused(client, "", port, "incomplete")
                        return
                    head += chunk
                    name = tls_server_name(head) if tls else http_host(head)
                    if name is None and len(head) >= MAX_HEAD:
                        raise NotNamed("not_tls" if tls else "not_http")
        except NotNamed as exc:
            self.refused(client, "", port, exc.why)
            return
        except TimeoutError:
            self.refused(client, "", port, "no_name_in_time")
            return
        if not _allows(client, name, port):
            self.refused(client, name, port, "name_not_allowed")
            return
        addrs: list[Address] = []
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            ans = await self.resolve(name, rdtype)
            addrs += ans.addresses
        if not addrs:
            self.refused(client, name, port, "unresolved")
            return
        up_r, up_w = await self._connect(addrs, port)
        if up_w is None or up_r is None:
            self.refused(client, name, port, "unreachable")
            return
        conn = _Conn(client, name, port, (writer, up_w))
        try:
            self._conns.add(conn)
            self.relayed += 1
            up_w.write(head)
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        finally:
            self._conns.discard(conn)
            up_w.close()

    async def _connect(self, addrs: list[Address], port: int) -> tuple[
            asyncio.StreamReader | None, asyncio.StreamWriter | None]:
        for a in addrs:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    return await asyncio.open_connection(str(a), port)
            except (OSError, TimeoutError) as exc:
                log.debug("proxy: %s:%d: %s", a, port, exc)
        return None, None


def _allows(client: Client, name: str, port: int) -> bool:
    ports = client.policy.name_ports(name)
    return (port, "tcp") in ports or (0, "tcp") in ports


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await r.read(CHUNK)
            if not data:
                break
            w.write(data)
            await w.drain()
        if w.can_write_eof():
            w.write_eof()
    except (ConnectionError, OSError):
        w.transport.abort()


__all__ = ["NotNamed", "Proxy", "http_host", "tls_server_name"]
