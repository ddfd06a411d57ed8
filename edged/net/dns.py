"""edged's DNS resolver: one per node, the only resolver networked sandboxes can reach (the
egress programs send every port-53 packet of a sandbox here, whatever server it names).

A query is answered for the sandbox its source address belongs to, by that sandbox's policy:
- a name no rule allows: NXDOMAIN, and nothing is sent upstream (under default-deny a
  sandbox cannot exfiltrate data through query names, labels however long);
- an allowed name, type A or AAAA: the answer comes from the profile's static records or from
  the upstream servers (a fresh query of ours: the client's packet, with its EDNS options and
  flags, is never relayed); CNAME chains are flattened to the name asked; addresses in
  platform-denied ranges are dropped (no DNS rebinding onto the metadata address or the
  node); the TTL is clamped to the profile's [ttl_min, ttl_max]; then the addresses are
  installed, with that TTL, in the sandbox's BPF map (before the reply is sent, so the
  client's connect finds them) and the reply goes out with the same TTL;
- an allowed name, any other type (TXT, MX, HTTPS...): an empty answer (NODATA), not asked
  upstream;
- malformed queries: FORMERR; more than ``rate`` queries a second from one sandbox: REFUSED.

Wire format: dnspython (``dns.message``, ``dns.asyncquery``). UDP and TCP on the gateway
address(es), bound with IP_FREEBIND (the address lives on the sandboxes' host-side veths).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from edged.net.policy import Network, Policy, normalise_name

log = logging.getLogger("edged.net.dns")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
IP_FREEBIND = 15
IPV6_FREEBIND = 78
MAX_ADDRESSES = 8  # a UDP answer of 8 AAAA records fits in 512 bytes
UPSTREAM_TIMEOUT_S = 2.0


class Client(Protocol):
    """What the resolver needs of the sandbox that asked."""

    @property
    def sandbox_id(self) -> str: ...

    @property
    def policy(self) -> Policy: ...

    def allow_query(self) -> bool:
        """Rate limit: False refuses this query."""
        ...


@dataclass
class Answer:
    """The outcome of one query (what tests and the ledger look at)."""

    name: str
    qtype: str
    rcode: str
    addresses: list[Address] = field(default_factory=list)
    ttl: int = 0


def resolv_conf_servers(path: str = "/etc/resolv.conf") -> list[str]:
    """Nameservers of the host's resolv.conf (the default upstreams)."""
    out = []
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                out.append(parts[1])
    return out


def bind_socket(addr: Address, port: int, kind: int) -> socket.socket:
    """A non-blocking socket of ``kind`` bound to ``addr``:``port`` with IP_FREEBIND (the
    gateway address need not be on an interface yet). Raises OSError (EADDRINUSE)."""
    fam = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    s = socket.socket(fam, kind)
    try:
        if kind == socket.SOCK_STREAM:  # (on UDP it would share the port with another)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET:
            s.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)
        else:
            s.setsockopt(socket.IPPROTO_IPV6, IPV6_FREEBIND, 1)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((str(addr), port))
        s.setblocking(False)
    except OSError:
        s.close()
        raise
    return s


class Resolver:
    """The node's resolver.

    ``listen``: addresses to serve on (the gateway's), ``port``. ``upstreams``: servers asked
    for allowed names (``"ADDR"`` or ``"ADDR:PORT"``). ``client_of(addr)``: the sandbox a
    source address belongs to, or None (the query is dropped). ``learn(client, name,
    addresses, ttl)``: called before an answer goes out. ``refused(client, name, qtype,
    why)``: called for each refusal. ``denies``: platform denies (answers there are dropped).
    ``static``: name -> addresses answered without asking upstream.
    """

    def __init__(self, listen: Sequence[Address], port: int, upstreams: Sequence[str],
                 client_of: Callable[[Address], Client | None],
                 learn: Callable[[Client, str, list[Address], int], None],
                 refused: Callable[[Client, str, str, str], None], *,
                 denies: Sequence[Network] = (),
                 static: dict[str, tuple[Address, ...]] | None = None,
                 ttl_min: int = 5, ttl_max: int = 3600) -> None:
        self.listen = list(listen)
        self.port = port
        self.upstreams = [self._hostport(u) for u in upstreams]
        self.client_of = client_of
        self.learn = learn
        self.refused = refused
        self.denies = list(denies)
        self.static = dict(static or {})
        self.ttl_min, self.ttl_max = ttl_min, ttl_max
        self._transports: list[asyncio.BaseTransport] = []
        self._servers: list[asyncio.base_events.Server] = []
        self._cache: dict[tuple[str, int], tuple[float, str, list[Address], int]] = {}
        self.queries = 0

    @staticmethod
    def _hostport(u: str) -> tuple[str, int]:
        if u.startswith("["):
            host, _, port = u[1:].partition("]:")
            return host.rstrip("]"), int(port or 53)
        if u.count(":") == 1:
            host, port = u.split(":")
            return host, int(port)
        return u, 53

    async def start(self) -> None:
        """Bind UDP and TCP on every listen address. Raises OSError (EADDRINUSE: another
        resolver there), having closed what it had bound."""
        try:
            await self._bind()
        except BaseException:
            await self.close()
            raise

    async def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        for addr in self.listen:
            for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                s = bind_socket(addr, self.port, kind)
                if kind == socket.SOCK_DGRAM:
                    tr, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), sock=s)
                    self._transports.append(tr)
                else:
                    srv = await asyncio.start_server(self._tcp_client, sock=s)
                    self._servers.append(srv)

    async def close(self) -> None:
        for tr in self._transports:
            tr.close()
        for srv in self._servers:
            srv.close()
            await srv.wait_closed()
        self._transports.clear()
        self._servers.clear()

    async def _tcp_client(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            while True:
                hdr = await asyncio.wait_for(reader.readexactly(2), 10.0)
                data = await reader.readexactly(struct.unpack("!H", hdr)[0])
                reply = await self.handle(data, ipaddress.ip_address(peer[0]), tcp=True)
                if reply is None:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def handle(self, data: bytes, source: Address, *, tcp: bool = False) -> bytes | None:
        """The reply to one query from ``source`` (None: dropped)."""
        client = self.client_of(source)
        if client is None:
            return None
        self.queries += 1
        try:
            q = dns.message.from_wire(data)
        except dns.exception.DNSException:
            return _formerr(data)
        out: bytes | None = await self._answer(client, q, tcp)
        return out

    async def _answer(self, client: Client, q: dns.message.Message, tcp: bool) -> Any:
        if not client.allow_query():
            self.refused(client, "", "", "rate")
            return _reply(q, dns.rcode.REFUSED)
        if (q.opcode() != dns.opcode.QUERY or len(q.question) != 1
                or q.question[0].rdclass != dns.rdataclass.IN or q.flags & dns.flags.QR):
            return _reply(q, dns.rcode.FORMERR if len(q.question) != 1 else dns.rcode.REFUSED)
        qrr = q.question[0]
        name = normalise_name(qrr.name.to_text())
        qtype = dns.rdatatype.to_text(qrr.rdtype)
        if not client.policy.allows_name(name):
            self.refused(client, name, qtype, "not_allowed")
            return _reply(q, dns.rcode.NXDOMAIN)
        if qrr.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
            return _reply(q, dns.rcode.NOERROR)
        ans = await self.resolve(name, qrr.rdtype)
        if ans.rcode != "NOERROR":
            return _reply(q, dns.rcode.from_text(ans.rcode))
        if ans.addresses:
            self.learn(client, name, ans.addresses, ans.ttl)
        r = _reply(q, dns.rcode.NOERROR, raw=True)
        if ans.addresses:
            r.answer.append(dns.rrset.from_text_list(qrr.name, ans.ttl, "IN", qrr.rdtype,
                                                     [str(a) for a in ans.addresses]))
        return r.to_wire(max_size=65535 if tcp else 512)

    async def resolve(self, name: str, rdtype: int) -> Answer:
        """Addresses of ``name`` (static, cached or from upstream), denied ones dropped, TTL
        clamped."""
        qtype = dns.rdatatype.to_text(dns.rdatatype.RdataType(rdtype))
        want = 4 if rdtype == dns.rdatatype.A else 6
        if name in self.static:
            addrs = [a for a in self.static[name] if a.version == want]
            return Answer(name, qtype, "NOERROR", self._allowed(addrs), self.ttl_max)
        key = (name, rdtype)
        hit = self._cache.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            rest = max(self.ttl_min, int(hit[0] - now))
            return Answer(name, qtype, hit[1], list(hit[2]), min(rest, hit[3]))
        rcode, addrs, ttl = await self._upstream(name, rdtype)
        ttl = max(self.ttl_min, min(self.ttl_max, ttl))
        addrs = self._allowed(addrs)
        if rcode in ("NOERROR", "NXDOMAIN"):
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = (now + (ttl if rcode == "NOERROR" else self.ttl_min), rcode,
                                addrs, ttl)
        return Answer(name, qtype, rcode, addrs, ttl)

    def _allowed(self, addrs: list[Address]) -> list[Address]:
        out = [a for a in addrs
               if not any(a.version == d.version and a in d for d in self.denies)]
        return out[:MAX_ADDRESSES]

    async def _upstream(self, name: str, rdtype: int) -> tuple[str, list[Address], int]:
        if not self.upstreams:
            return "SERVFAIL", [], 0
        q = dns.message.make_query(name, dns.rdatatype.RdataType(rdtype))
        last = "SERVFAIL"
        for host, port in self.upstreams:
            try:
                r = await dns.asyncquery.udp(q, host, port=port, timeout=UPSTREAM_TIMEOUT_S)
                if r.flags & dns.flags.TC:
                    r = await dns.asyncquery.tcp(q, host, port=port, timeout=UPSTREAM_TIMEOUT_S)
            except (dns.exception.DNSException, OSError) as exc:
                log.debug("upstream %s:%d for %s: %s", host, port, name, exc)
                continue
            rcode = dns.rcode.to_text(r.rcode())
            if rcode != "NOERROR":
                last = rcode
                if rcode == "NXDOMAIN":
                    break
                continue
            return "NOERROR", *_flatten(r, dns.name.from_text(name), rdtype)
        return last, [], 0


def _flatten(r: dns.message.Message, qname: dns.name.Name,
             rdtype: int) -> tuple[list[Address], int]:
    """Addresses ``qname`` resolves to through its CNAME chain; the chain's smallest TTL."""
    names = {qname}
    ttl = 1 << 31
    for _ in range(16):  # CNAME hops
        grew = False
        for rrset in r.answer:
            if rrset.name in names and rrset.rdtype == dns.rdatatype.CNAME:
                for rd in rrset:
                    if rd.target not in names:
                        names.add(rd.target)
                        grew = True
                ttl = min(ttl, rrset.ttl)
        if not grew:
            break
    out: list[Address] = []
    for rrset in r.answer:
        if rrset.name in names and rrset.rdtype == rdtype:
            ttl = min(ttl, rrset.ttl)
            out += [ipaddress.ip_address(rd.address) for rd in rrset]
    return out, ttl if out else 0


def _reply(q: dns.message.Message, rcode: Any, raw: bool = False) -> Any:
    r = dns.message.make_response(q)
    r.flags |= dns.flags.RA
    r.set_rcode(rcode)
    return r if raw else r.to_wire()


def _formerr(data: bytes) -> bytes | None:
    """FORMERR with the query's id, when at least a header came."""
    if len(data) < 12:
        return None
    qid = struct.unpack("!H", data[:2])[0]
    return struct.pack("!HHHHHH", qid, 0x8000 | 0x0080 | dns.rcode.FORMERR, 0, 0, 0, 0)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, resolver: Resolver) -> None:
        self.r = resolver
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        task = asyncio.ensure_future(self._answer(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, data: bytes, addr: tuple[Any, ...]) -> None:
        try:
            reply = await self.r.handle(data, ipaddress.ip_address(addr[0]))
        except Exception:
            log.exception("dns: query from %s", addr[0])
            return
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)
