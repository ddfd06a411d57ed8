"""Network namespaces and veth pairs for networked sandboxes (pyroute2 over netlink).

Topology (routed, point-to-point, like the CNI ``ptp`` plugin): each sandbox gets its own
namespace, made here and owned by the initial user namespace (the sandbox's root has no
capability over it), with ``lo`` up and ``eth0``, the inner end of a veth pair, holding the
sandbox's address (/32, and /128 when the node has an IPv6 pool) and a default route via the
gateway address ``onlink``. The host end (``<prefix><index>``) holds the gateway address
(/32, /128: the same on every host end) and a host route to the sandbox's address; it has
forwarding on (for that interface only: the host's global switch is left as it is) and
strict reverse-path filtering, so a packet whose source is not the sandbox's own address is
dropped on the host. No bridge: sandboxes share no link layer.

Nothing is named in ``/run/netns``: a namespace lives while an fd or a process holds it, so
a sandbox's namespace, and with it its veth pair and host route, vanish with its last process,
and a crashed daemon leaves nothing behind. All netlink and ``setns`` work runs in one
dedicated thread (``setns`` changes the calling thread only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from edged.errors import BackendError

log = logging.getLogger("edged.net")

CLONE_NEWNET = 0x40000000
SO_NETNS_COOKIE = 71  # asm-generic/socket.h, Linux >= 5.14
IFA_F_NODAD = 0x02  # linux/if_addr.h: no duplicate address detection (no tentative wait)
RTNH_F_ONLINK = 0x04  # linux/rtnetlink.h
INNER_IF = "eth0"
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        code = ctypes.get_errno()
        raise BackendError(f"{what}: {os.strerror(code)} (errno {code})")


def netns_cookie() -> int:
    """The cookie of the calling thread's network namespace (what the BPF programs key on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), "little")


@dataclass
class Netns:
    """One prepared namespace. ``fd``: holds it (None once handed over and closed).
    ``cookie``: its netns cookie. ``host_if``: the host end of its veth. ``index``: the
    address index in the pool (also the sandbox's index in the BPF maps)."""

    fd: int | None
    cookie: int
    host_if: str
    index: int
    addr4: ipaddress.IPv4Address
    addr6: ipaddress.IPv6Address | None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _sysctl(path: str, value: str) -> None:
    with contextlib.suppress(FileNotFoundError), open(path, "w") as f:
        f.write(value)  # FileNotFoundError: force_forwarding needs Linux >= 6.17


IPV6_CONF = Path("/proc/sys/net/ipv6/conf")


def ipv6_forwarding(conf: Path = IPV6_CONF) -> tuple[bool, str]:
    """Whether the host forwards the IPv6 of sandboxes' host ends, and how: ``(True, why)``
    with per-interface ``force_forwarding`` (Linux >= 6.17, set by :meth:`Plumber.make` on
    each host end) or, before it, where the host's own switch
    (``net.ipv6.conf.all.forwarding``) is on, since an older kernel's per-interface IPv6
    ``forwarding`` forwards nothing (net/ipv6/ip6_output.c ``ip6_forward``); ``(False,
    why)`` otherwise: edged does not turn the host's switch on (it would also make every
    interface a router, ignoring router advertisements). ``conf``: the sysctl directory
    (for tests)."""
    if (conf / "all" / "force_forwarding").exists():
        return True, "per-interface force_forwarding (Linux >= 6.17)"
    try:
        on = (conf / "all" / "forwarding").read_text().strip() == "1"
    except OSError as exc:
        return False, f"no IPv6 sysctls ({exc})"
    if on:
        return True, "the host forwards IPv6 (net.ipv6.conf.all.forwarding=1; no per-interface "\
                     "force_forwarding before Linux 6.17)"
    return False, ("no per-interface IPv6 forwarding before Linux 6.17 and the host's "
                   "net.ipv6.conf.all.forwarding is 0 (edged leaves it): sandboxes get no IPv6")


class Plumber:
    """Makes and inspects sandbox namespaces. ``prefix``: host interface name prefix (unique
    per daemon, <= 6 characters). ``gw4``/``gw6``: gateway addresses."""

    def __init__(self, prefix: str, gw4: ipaddress.IPv4Address,
                 gw6: ipaddress.IPv6Address | None) -> None:
        if not 1 <= len(prefix) <= 6:
            raise BackendError(f"interface prefix {prefix!r}: 1..6 characters")
        self.prefix = prefix
        self.gw4 = gw4
        self.gw6 = gw6
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edged-netns")
        self._host_ns = -1

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the netlink thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._host_ns >= 0:
            os.close(self._host_ns)
            self._host_ns = -1

    def host_if(self, index: int) -> str:
        return f"{self.prefix}{index:x}"

    # -- in the netlink thread ------------------------------------------------------------

    def _enter_host(self) -> None:
        if self._host_ns < 0:
            self._host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        _check(_libc.setns(self._host_ns, CLONE_NEWNET), "setns back to the host namespace")

    def make(self, index: int, addr4: ipaddress.IPv4Address,
             addr6: ipaddress.IPv6Address | None) -> Netns:
        """A new namespace with its veth pair, addresses and routes. Raises BackendError
        (nothing is left: the namespace dies with its fd, the veth with the namespace)."""
        from pyroute2 import IPRoute

        if self._host_ns < 0:
            self._host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        host_if = self.host_if(index)
        _check(_libc.unshare(CLONE_NEWNET), "unshare a network namespace")
        fd = -1
        inner = None
        try:
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            cookie = netns_cookie()
            inner = IPRoute()  # its socket stays in the new namespace
            # no IPv6 autoconfiguration or router solicitations from the sandbox's side
            _sysctl("/proc/sys/net/ipv6/conf/default/accept_ra", "0")
        finally:
            self._enter_host()
        try:
            with IPRoute() as host:
                with contextlib.suppress(Exception):  # a leftover of a crashed daemon
                    idx = host.link_lookup(ifname=host_if)
                    if idx:
                        host.link("del", index=idx[0])
                host.link("add", ifname=host_if, kind="veth",
                          peer={"ifname": INNER_IF, "net_ns_fd": fd})
                hidx = host.link_lookup(ifname=host_if)[0]
                conf = f"/proc/sys/net/ipv4/conf/{host_if}"
                _sysctl(f"{conf}/forwarding", "1")
                _sysctl(f"{conf}/rp_filter", "1")
                _sysctl(f"/proc/sys/net/ipv6/conf/{host_if}/accept_ra", "0")
                host.addr("add", index=hidx, address=str(self.gw4), prefixlen=32)
                if self.gw6 is not None and addr6 is not None:
                    _sysctl(f"/proc/sys/net/ipv6/conf/{host_if}/force_forwarding", "1")
                    host.addr("add", index=hidx, address=str(self.gw6), prefixlen=128,
                              flags=IFA_F_NODAD)
                host.link("set", index=hidx, state="up")
                host.route("add", dst=f"{addr4}/32", oif=hidx)
                if self.gw6 is not None and addr6 is not None:
                    host.route("add", dst=f"{addr6}/128", oif=hidx, family=socket.AF_INET6)
            lo = inner.link_lookup(ifname="lo")[0]
            inner.link("set", index=lo, state="up")
            eidx = inner.link_lookup(ifname=INNER_IF)[0]
            inner.addr("add", index=eidx, address=str(addr4), prefixlen=32)
            if self.gw6 is not None and addr6 is not None:
                inner.addr("add", index=eidx, address=str(addr6), prefixlen=128,
                           flags=IFA_F_NODAD)
            inner.link("set", index=eidx, state="up")
            inner.route("add", dst="0.0.0.0/0", gateway=str(self.gw4), oif=eidx,
                        flags=RTNH_F_ONLINK)
            if self.gw6 is not None and addr6 is not None:
                inner.route("add", dst="::/0", gateway=str(self.gw6), oif=eidx,
                            flags=RTNH_F_ONLINK, family=socket.AF_INET6)
        except Exception as exc:
            os.close(fd)
            with contextlib.suppress(Exception):
                self._delete_link(host_if)
            raise BackendError(f"network namespace for index {index}: {exc}") from exc
        finally:
            inner.close()
        return Netns(fd, cookie, host_if, index, addr4, addr6 if self.gw6 else None)

    def _delete_link(self, name: str) -> None:
        from pyroute2 import IPRoute

        with IPRoute() as host:
            idx = host.link_lookup(ifname=name)
            if idx:
                host.link("del", index=idx[0])

    def delete_link(self, name: str) -> None:
        """Remove a host interface (a veth whose namespace is still held elsewhere)."""
        with contextlib.suppress(Exception):
            self._delete_link(name)

    def pool_users(self, pools: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> list[str]:
        """Host interfaces, other than ours, with an address or a route in ``pools`` (another
        daemon's, or a network of the host's that the pool would collide with)."""
        from pyroute2 import IPRoute

        def inside(text: str | None) -> bool:
            if not text:
                return False
            a = ipaddress.ip_address(text)
            return any(a.version == p.version and a in p for p in pools)

        with IPRoute() as host:
            names = {ln["index"]: ln.get_attr("IFLA_IFNAME") or "" for ln in host.get_links()}
            users = {names.get(a["index"], "?") for a in host.get_addr()
                     if inside(a.get_attr("IFA_ADDRESS"))}
            for fam in (socket.AF_INET, socket.AF_INET6):
                users |= {names.get(r.get_attr("RTA_OIF"), "?")
                          for r in host.get_routes(family=fam, table=254)
                          if inside(r.get_attr("RTA_DST"))}
        return sorted(u for u in users if not u.startswith(self.prefix))

    def links(self) -> list[str]:
        """Host interfaces with our prefix (leak checks, leftovers)."""
        from pyroute2 import IPRoute

        with IPRoute() as host:
            names = [ln.get_attr("IFLA_IFNAME") for ln in host.get_links()]
        return sorted(n for n in names if n and n.startswith(self.prefix))

    def cookie_of_pid(self, pid: int) -> int:
        """Netns cookie of process ``pid``'s namespace (an adopted sandbox)."""
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), f"setns into pid {pid}'s namespace")
            try:
                return netns_cookie()
            finally:
                self._enter_host()
        finally:
            os.close(fd)

    def in_netns(self, fd_or_pid: int, fn: Callable[[], T], *, pid: bool = False) -> T:
        """Run ``fn`` with this thread in a sandbox's namespace (by fd, or by pid)."""
        if self._host_ns < 0:
            self._host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        fd = os.open(f"/proc/{fd_or_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC) if pid \
            else fd_or_pid
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), "setns into a sandbox's namespace")
            try:
                return fn()
            finally:
                self._enter_host()
        finally:
            if pid:
                os.close(fd)
