"""Servers the network tests start themselves: a network namespace with test addresses
(``NET4``.0/24, a /24 of 198.18.0.0/15, RFC 2544 benchmarking space, and ``NET6``/64, in
2001:db8:18::/48, documentation space) reached from the host through a veth of the test's
own, and a fake upstream DNS server on the host's loopback. Nothing here talks to another
host. The subnets are this test process's own (:func:`_claim_slot`): test runs in other
worktrees start the same servers at the same time, and the host routes to them (the proxy
connects from the host), so two runs on one subnet would reach each other's servers.

Services in the namespace, on ``NET4``.2, ``NET4``.3 and ``NET6``2, ``NET6``3:
- TCP 80: HTTP/1.x: reads the request head, answers ``hi-ADDR:80 host=HOST`` and closes; for
  ``GET /hold`` it then echoes each further line (``echo:LINE``) until the client goes away
  or sends ``bye`` (a held connection); for ``GET /stall`` it reads nothing more and waits
  (at most 30 s) for the client's end (``eof``) or a reset (``reset``): a peer whose
  receive window fills;
- TCP 443: the same over TLS (a self-signed certificate made per run), ``sni=NAME`` added;
- TCP 8080: sends ``hi-ADDR:8080`` and closes (server speaks first);
- TCP 9000: echoes lines until the client goes away or sends ``bye`` (a held connection);
- UDP 5353: echoes each datagram (and logs it: :attr:`ServerNetns.datagrams`).
Every TCP connection is logged (:attr:`ServerNetns.log`): address, port, lines received and how
it ended (``eof`` or ``reset``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import os
import select
import selectors
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

CLONE_NEWNET = 0x40000000
IFA_F_NODAD = 0x02


def _claim_slot() -> tuple[int, TextIO]:
    """A slot 1-255 no other process on this host holds: an exclusive ``flock`` on
    ``/run/edged-test-servers.N.lock``, held (the returned file) while this process lives.
    (Slot 0 was every run's subnet before slots.)"""
    for n in range(1, 256):
        f = open(f"/run/edged-test-servers.{n}.lock", "w")  # noqa: SIM115 (held)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        return n, f
    raise RuntimeError("every test server subnet is in use on this host")


_SLOT, _SLOT_LOCK = _claim_slot()
NET4, NET6 = f"198.18.{_SLOT}", f"2001:db8:18:{_SLOT:x}::"
ADDRS = (f"{NET4}.2", f"{NET4}.3", f"{NET6}2", f"{NET6}3")


@dataclass
class Conn:
    addr: str
    port: int
    lines: list[str] = field(default_factory=list)
    sni: str | None = None
    host: str | None = None
    end: str = ""


def _stall(c: socket.socket) -> str:
    """Read nothing; wait for the peer's FIN (``eof``) or reset (``reset``), 30 s at most."""
    p = select.poll()
    p.register(c.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    for _ in range(300):
        if ev := p.poll(100):
            return "reset" if ev[0][1] & (select.POLLHUP | select.POLLERR) else "eof"
    return "timeout"


def _cert(work: Path) -> tuple[str, str]:
    key, crt = work / "srv.key", work / "srv.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=test", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    return str(crt), str(key)


def _remember_sni(sock: ssl.SSLSocket, name: str | None, _ctx: ssl.SSLContext) -> None:
    sock.sni = name or ""  # type: ignore[attr-defined]


class ServerNetns:
    """The server namespace (see the module doc). ``tag``: makes the host interface name
    unique (``t<tag>``). :meth:`close` stops it and removes the veth."""

    def __init__(self, tag: str, work: Path) -> None:
        self.host_if = f"t{tag}"
        self.log: list[Conn] = []
        self.datagrams: list[tuple[str, bytes]] = []  # (address it came to, data) on UDP 5353
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        crt, key = _cert(work)
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(crt, key)
        # busybox's own TLS (wget in the sandbox) sends no signature_algorithms: TLS 1.2 then
        # means SHA-1 signatures (RFC 5246 §7.4.1.4.1), which OpenSSL 3 allows at level 0 only
        self.tls.set_ciphers("DEFAULT:@SECLEVEL=0")
        self.tls.sni_callback = _remember_sni
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        if not self.ready.wait(15):
            raise RuntimeError(f"server namespace did not start: {self.error}")
        if self.error is not None:
            raise RuntimeError(f"server namespace: {self.error}")

    # -- set-up, in the namespace's thread ----------------------------------------------

    def _main(self) -> None:
        try:
            listeners = self._setup()
        except BaseException as exc:
            self.error = exc
            self.ready.set()
            return
        self.ready.set()
        self._serve(listeners)

    def _setup(self) -> list[tuple[socket.socket, int]]:
        from pyroute2 import IPRoute

        host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            assert self._libc.unshare(CLONE_NEWNET) == 0
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            inner = IPRoute()
            assert self._libc.setns(host_ns, CLONE_NEWNET) == 0
            with IPRoute() as host:
                host.link("add", ifname=self.host_if, kind="veth",
                          peer={"ifname": "eth0", "net_ns_fd": fd})
                i = host.link_lookup(ifname=self.host_if)[0]
                host.addr("add", index=i, address=f"{NET4}.1", prefixlen=24)
                host.addr("add", index=i, address=f"{NET6}1", prefixlen=64, flags=IFA_F_NODAD)
                host.link("set", index=i, state="up")
                Path(f"/proc/sys/net/ipv4/conf/{self.host_if}/forwarding").write_text("1")
                # IPv6: per interface from Linux 6.17 on; before, the host's own switch
                # (net.ipv6.conf.all.forwarding, which the node VM's guest turns on)
                ff = Path(f"/proc/sys/net/ipv6/conf/{self.host_if}/force_forwarding")
                if ff.exists():
                    ff.write_text("1")
            assert self._libc.setns(fd, CLONE_NEWNET) == 0
            os.close(fd)
        finally:
            os.close(host_ns)
        e = inner.link_lookup(ifname="eth0")[0]
        inner.link("set", index=inner.link_lookup(ifname="lo")[0], state="up")
        for a in ADDRS:
            v6 = ":" in a
            inner.addr("add", index=e, address=a, prefixlen=64 if v6 else 24,
                       flags=IFA_F_NODAD if v6 else 0)
        inner.link("set", index=e, state="up")
        inner.route("add", dst="0.0.0.0/0", gateway=f"{NET4}.1")
        inner.route("add", dst="::/0", gateway=f"{NET6}1", family=socket.AF_INET6)
        inner.close()
        out = []
        for a in ADDRS:
            fam = socket.AF_INET6 if ":" in a else socket.AF_INET
            for p in (80, 443, 8080, 9000):
                s = socket.socket(fam, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((a, p))
                s.listen(64)
                out.append((s, p))
            u = socket.socket(fam, socket.SOCK_DGRAM)
            u.bind((a, 5353))
            out.append((u, 5353))
        return out

    # -- serving --------------------------------------------------------------------------

    def _serve(self, listeners: list[tuple[socket.socket, int]]) -> None:
        sel = selectors.DefaultSelector()
        for s, p in listeners:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, p)
        while not self.stop.is_set():
            for key, _ in sel.select(0.2):
                s: socket.socket = key.fileobj  # type: ignore[assignment]
                if key.data == 5353:
                    with contextlib.suppress(OSError):
                        data, peer = s.recvfrom(2048)
                        self.datagrams.append((s.getsockname()[0], data))
                        s.sendto(b"echo:" + data, peer)
                    continue
                with contextlib.suppress(OSError):
                    c, _ = s.accept()
                    threading.Thread(target=self._conn, args=(c, key.data), daemon=True).start()
        for s, _ in listeners:
            s.close()

    def _conn(self, c: socket.socket, port: int) -> None:
        c.setblocking(True)
        c.settimeout(30)
        conn = Conn(c.getsockname()[0], port)
        with self.lock:
            self.log.append(conn)
        try:
            if port == 443:
                c = self.tls.wrap_socket(c, server_side=True)
                conn.sni = getattr(c, "sni", "")
            f = c.makefile("rb")
            if port in (80, 443):
                head = []
                while (ln := f.readline()) not in (b"\r\n", b"\n", b""):
                    head.append(ln.decode("latin-1").strip())
                conn.host = next((h.split(":", 1)[1].strip() for h in head
                                  if h.lower().startswith("host:")), "")
                msg = f"hi-{conn.addr}:{port} host={conn.host}"
                if port == 443:
                    msg += f" sni={conn.sni}"
                c.sendall(f"HTTP/1.0 200 OK\r\n\r\n{msg}\n".encode())
                if head and " /stall " in head[0]:
                    conn.end = _stall(c)
                    return
                if not head or " /hold " not in head[0]:
                    conn.end = "sent"
                    return
            if port == 8080:
                c.sendall(f"hi-{conn.addr}:8080\n".encode())
                conn.end = "sent"
                return
            while True:
                ln = f.readline()
                if not ln:
                    conn.end = "eof"
                    return
                conn.lines.append(ln.decode().strip())
                c.sendall(b"echo:" + ln)
                if conn.lines[-1] == "bye":
                    conn.end = "done"
                    return
        except (ConnectionResetError, ssl.SSLError, OSError) as exc:
            conn.end = "reset" if isinstance(exc, ConnectionResetError) else f"error:{exc}"
        finally:
            with contextlib.suppress(OSError):
                c.close()

    def conns(self, port: int, addr: str | None = None) -> list[Conn]:
        with self.lock:
            return [c for c in self.log if c.port == port and addr in (None, c.addr)]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)


class FakeUpstream:
    """An upstream DNS server on 127.0.0.1 (UDP): ``records`` name -> (addresses, TTL);
    other names NXDOMAIN. ``queries``: (name, type) of every query that arrived."""

    def __init__(self, records: dict[str, tuple[list[str], int]]) -> None:
        self.records = records
        self.queries: list[tuple[str, str]] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            q = dns.message.from_wire(data)
            qq = q.question[0]
            name = qq.name.to_text().rstrip(".").lower()
            self.queries.append((name, dns.rdatatype.to_text(qq.rdtype)))
            r = dns.message.make_response(q)
            rec = self.records.get(name)
            if rec is None:
                r.set_rcode(dns.rcode.NXDOMAIN)
            else:
                want = 4 if qq.rdtype == dns.rdatatype.A else 6
                addrs = [a for a in rec[0] if ipaddress.ip_address(a).version == want]
                if addrs and qq.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    r.answer.append(dns.rrset.from_text_list(qq.name, rec[1], "IN",
                                                             qq.rdtype, addrs))
            self.sock.sendto(r.to_wire(), peer)

    def names(self) -> set[str]:
        return {n for n, _ in self.queries}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
