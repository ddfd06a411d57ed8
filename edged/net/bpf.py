"""The egress programs of ``csrc/bpf/egress.bpf.c``: loaded once per daemon, attached to one
cgroup v2 directory, and their maps written per sandbox.

Lifetime: the programs are attached with ``bpf_prog_attach`` (not a BPF link), so the
attachment belongs to the cgroup and outlives the daemon: sandboxes that survive a daemon
restart stay filtered, and the next daemon finds the programs on the directory and reopens
their maps by id (:meth:`EgressFilter.open`), the learned addresses included. Nothing is pinned
in a BPF filesystem; the maps live as long as the attached programs, and
:meth:`EgressFilter.close` with ``detach=True`` (no networked sandbox left) frees all of it.

Map layouts: ``csrc/bpf/egress.h`` (struct formats below, sizes checked at import).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.net import libbpf
from edged.net.libbpf import BpfError, Map

log = logging.getLogger("edged.net")

#: The compiled object (built by ``csrc/build_bins.py`` at install time).
OBJECT = Path(__file__).resolve().parent.parent / "_bin" / "egress.bpf.o"

PROGRAMS = (
    ("egress_connect4", libbpf.CGROUP_INET4_CONNECT),
    ("egress_connect6", libbpf.CGROUP_INET6_CONNECT),
    ("egress_sendmsg4", libbpf.CGROUP_UDP4_SENDMSG),
    ("egress_sendmsg6", libbpf.CGROUP_UDP6_SENDMSG),
    ("egress_recvmsg4", libbpf.CGROUP_UDP4_RECVMSG),
    ("egress_skb", libbpf.CGROUP_INET_EGRESS),
)

# egress.h layouts ("=": native order, no padding; ports and addresses are packed as bytes in
# network order where the struct has them)
SBX = struct.Struct("=IIII2s2s2sHII16s")  # egress_sbx
ALLOW = struct.Struct("=QII")  # egress_allow
RATE = struct.Struct("=QIIQ")  # egress_rate
EVENT = struct.Struct("=QIIBBBB2sH16s")  # egress_event
MAPS = {  # name: (key size, value size)
    "sandboxes": (8, SBX.size),
    "addrs4": (4, 8),
    "addrs6": (16, 8),
    "cidr4": (16, ALLOW.size),
    "cidr6": (28, ALLOW.size),
    "learned4": (12, ALLOW.size),
    "learned6": (24, ALLOW.size),
    "deny4": (8, 1),
    "deny6": (20, 1),
    "ratelimit": (4, RATE.size),
    "events": (0, 0),
}
assert (SBX.size, ALLOW.size, RATE.size, EVENT.size) == (48, 16, 24, 40)

F_ENFORCE = 1 << 0
F_DNS6 = 1 << 1
A_PROXY = 1 << 0
EVENT_RATE, EVENT_BURST = 100, 100
HOOKS = {1: "connect", 2: "sendmsg", 3: "packet"}
WHY = {1: "not_allowed", 2: "platform_deny", 3: "expired", 4: "no_policy"}
PROTOS = {6: "tcp", 17: "udp"}
PROTO_NUM = {"tcp": 6, "udp": 17}

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _port(p: int) -> bytes:
    return p.to_bytes(2, "big")


def now_ns() -> int:
    """The programs' clock (``bpf_ktime_get_ns``: CLOCK_MONOTONIC), in ns."""
    return time.monotonic_ns()


@dataclass(frozen=True)
class SandboxEntry:
    """What the programs know of one sandbox (value of ``sandboxes``). ``dns4``/``dns6``:
    the resolver's addresses; ``proxy_tls``/``proxy_http``: the SNI/Host proxy's ports on
    ``dns4``/``dns6`` (0: none)."""

    id: int
    gen: int
    dns4: ipaddress.IPv4Address
    dns_port: int
    addr4: ipaddress.IPv4Address | None = None
    addr6: ipaddress.IPv6Address | None = None
    dns6: ipaddress.IPv6Address | None = None
    proxy_tls: int = 0
    proxy_http: int = 0
    enforce: bool = True

    def pack(self) -> bytes:
        flags = (F_ENFORCE if self.enforce else 0) | (F_DNS6 if self.dns6 else 0)
        return SBX.pack(self.id, flags, self.gen, int.from_bytes(self.dns4.packed, "little"),
                        _port(self.dns_port), _port(self.proxy_tls), _port(self.proxy_http),
                        0, 0, 0, self.dns6.packed if self.dns6 else bytes(16))


@dataclass(frozen=True)
class Denial:
    """One denial reported by the programs (``egress_event``)."""

    netns: int
    id: int
    dropped: int
    address: Address
    port: int
    protocol: str
    hook: str
    why: str


def rule_key(family: int, sid: int, net: Network, port: int, proto: int) -> bytes:
    """Key of ``cidr4``/``cidr6`` for a static rule."""
    head = struct.pack("=I", 64 + net.prefixlen) + struct.pack("=I", sid)
    return head + _port(port) + bytes((proto, 0)) + net.network_address.packed


def learned_key(sid: int, addr: Address, port: int, proto: int) -> bytes:
    """Key of ``learned4``/``learned6``."""
    return struct.pack("=I", sid) + _port(port) + bytes((proto, 0)) + addr.packed


class EgressFilter:
    """The loaded programs and their maps (one per daemon).

    ``cgroup_dir``: the cgroup v2 directory they are attached to. ``adopted``: True when an
    earlier daemon's attached programs were found and their maps reopened.
    """

    def __init__(self, cgroup_dir: Path, maps: dict[str, Map], prog_fds: dict[str, int],
                 obj: Any, adopted: bool) -> None:
        self.cgroup_dir = cgroup_dir
        self.maps = maps
        self._prog_fds = prog_fds
        self._obj = obj
        self.adopted = adopted
        self._rb: Any = None
        self._rb_cb: Any = None
        self._pending: list[Denial] = []

    # -- open / close -------------------------------------------------------------------

    @classmethod
    def open(cls, cgroup_dir: Path, obj_path: Path = OBJECT) -> EgressFilter:
        """Attach the programs to ``cgroup_dir`` (an existing cgroup v2 directory), or adopt
        those an earlier daemon attached there. Raises :class:`BpfError` (EPERM without
        CAP_BPF, ENOENT without the object or libbpf, a verifier refusal with its errno)."""
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            found = cls._find_attached(fd, cgroup_dir)
            if found is not None:
                return found
            return cls._load(fd, cgroup_dir, obj_path)
        finally:
            os.close(fd)

    @classmethod
    def _find_attached(cls, cg_fd: int, cgroup_dir: Path) -> EgressFilter | None:
        progs: dict[str, int] = {}
        maps: dict[str, Map] = {}
        try:
            for name, kind in PROGRAMS:
                for pid in libbpf.query(cg_fd, kind):
                    pfd = libbpf.prog_fd_by_id(pid)
                    pname, map_ids = libbpf.prog_info(pfd)
                    if pname != name[:15]:
                        os.close(pfd)
                        continue
                    progs[name] = pfd
                    for mid in map_ids:
                        m = libbpf.map_by_id(mid)
                        if m.name in MAPS and m.name not in maps:
                            maps[m.name] = m
                        else:
                            m.close()
            if not progs:
                return None
            missing = [n for n, _ in PROGRAMS if n not in progs]
            bad = [n for n, (ks, vs) in MAPS.items()
                   if n not in maps or (ks and (maps[n].key_size, maps[n].value_size) != (ks, vs))]
            if missing or bad:
                # a half-attached set, or another layout: replace it (its learned addresses
                # are lost; the sandboxes are filtered by the new set at once)
                log.warning("egress programs on %s are incomplete or of another layout "
                            "(%s): replacing them", cgroup_dir, missing or bad)
                for name, kind in PROGRAMS:
                    if name in progs:
                        with contextlib.suppress(BpfError):
                            libbpf.detach(progs[name], cg_fd, kind)
                raise LookupError
        except (BpfError, LookupError):
            for pfd in progs.values():
                os.close(pfd)
            for m in maps.values():
                m.close()
            if not progs:
                raise
            return None
        log.info("egress programs adopted on %s", cgroup_dir)
        return cls(cgroup_dir, maps, progs, None, adopted=True)

    @classmethod
    def _load(cls, cg_fd: int, cgroup_dir: Path, obj_path: Path) -> EgressFilter:
        ffi, L = libbpf.lib()
        if not obj_path.is_file():
            raise BpfError(2, f"egress programs: {obj_path} not built (pip install -e .)")
        obj = L.bpf_object__open_file(str(obj_path).encode(), ffi.NULL)
        if obj == ffi.NULL:
            libbpf.check(-1, f"open {obj_path}")
        try:
            libbpf.check(L.bpf_object__load(obj), f"load {obj_path.name} (verifier)")
            progs: dict[str, int] = {}
            for name, _kind in PROGRAMS:
                p = L.bpf_object__find_program_by_name(obj, name.encode())
                if p == ffi.NULL:
                    raise BpfError(2, f"{obj_path.name}: no program {name}")
                progs[name] = os.dup(libbpf.check(L.bpf_program__fd(p), f"program {name}"))
            maps: dict[str, Map] = {}
            for name, (ks, vs) in MAPS.items():
                m = L.bpf_object__find_map_by_name(obj, name.encode())
                if m == ffi.NULL:
                    raise BpfError(2, f"{obj_path.name}: no map {name}")
                maps[name] = Map(os.dup(libbpf.check(L.bpf_map__fd(m), f"map {name}")),
                                 name, ks, vs)
            done: list[tuple[str, int]] = []
            try:
                for name, kind in PROGRAMS:
                    libbpf.attach(progs[name], cg_fd, kind)
                    done.append((name, kind))
            except BpfError:
                for name, kind in done:
                    with contextlib.suppress(BpfError):
                        libbpf.detach(progs[name], cg_fd, kind)
                raise
        finally:
            # our dup'ed fds keep programs and maps alive; the object's own are not needed
            L.bpf_object__close(obj)
        log.info("egress programs attached to %s", cgroup_dir)
        return cls(cgroup_dir, maps, progs, None, adopted=False)

    def close(self, *, detach: bool) -> None:
        """Close our fds; with ``detach``, first take the programs off the cgroup (then the
        kernel frees programs and maps: do it only when no networked sandbox is left)."""
        self.stop_events()
        if detach:
            try:
                fd = os.open(self.cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = -1  # removed already: the kernel released its programs with it
            try:
                for name, kind in PROGRAMS:
                    if fd >= 0 and name in self._prog_fds:
                        with contextlib.suppress(BpfError):
                            libbpf.detach(self._prog_fds[name], fd, kind)
            finally:
                if fd >= 0:
                    os.close(fd)
        for pfd in self._prog_fds.values():
            os.close(pfd)
        self._prog_fds.clear()
        for m in self.maps.values():
            m.close()
        self.maps.clear()

    # -- per sandbox ----------------------------------------------------------------------

    def set_sandbox(self, netns: int, entry: SandboxEntry) -> None:
        """Register (or update) the sandbox whose network namespace has cookie ``netns``."""
        if entry.addr4 is not None:
            self.maps["addrs4"].update(entry.addr4.packed, struct.pack("=Q", netns))
        if entry.addr6 is not None:
            self.maps["addrs6"].update(entry.addr6.packed, struct.pack("=Q", netns))
        self.maps["sandboxes"].update(struct.pack("=Q", netns), entry.pack())

    def reset_rate(self, sid: int) -> None:
        """A fresh event budget for sandbox index ``sid`` (a new sandbox)."""
        self.maps["ratelimit"].update(struct.pack("=I", sid),
                                      RATE.pack(now_ns(), EVENT_BURST, 0, 0))

    def denied(self, sid: int) -> int:
        """Denials counted for sandbox index ``sid`` (reported or not)."""
        raw = self.maps["ratelimit"].lookup(struct.pack("=I", sid))
        return RATE.unpack(raw)[3] if raw else 0

    def remove_sandbox(self, netns: int, addr4: ipaddress.IPv4Address | None,
                       addr6: ipaddress.IPv6Address | None) -> None:
        """Forget a sandbox's entry and addresses (its rules: :meth:`delete_keys`)."""
        self.maps["sandboxes"].delete(struct.pack("=Q", netns))
        if addr4 is not None:
            self.maps["addrs4"].delete(addr4.packed)
        if addr6 is not None:
            self.maps["addrs6"].delete(addr6.packed)

    def sandbox_cookies(self) -> list[int]:
        """Netns cookies registered (what a restarted daemon reconciles)."""
        return [struct.unpack("=Q", k)[0] for k in self.maps["sandboxes"].keys()]  # noqa: SIM118

    def put_rule(self, sid: int, net: Network, port: int, proto: int, *,
                 flags: int = 0) -> bytes:
        """A static rule (never expires); returns its key (for :meth:`delete_keys`)."""
        m = self.maps["cidr4" if net.version == 4 else "cidr6"]
        key = rule_key(net.version, sid, net, port, proto)
        m.update(key, ALLOW.pack(0, flags, 0))
        return key

    def put_learned(self, sid: int, addr: Address, port: int, proto: int, expires_ns: int, *,
                    flags: int = 0) -> bytes:
        """An address a DNS answer gave, allowed for new connections until ``expires_ns``
        (:func:`now_ns` clock); returns its key."""
        m = self.maps["learned4" if addr.version == 4 else "learned6"]
        key = learned_key(sid, addr, port, proto)
        m.update(key, ALLOW.pack(expires_ns, flags, 0))
        return key

    def delete_keys(self, keys: Iterable[tuple[str, bytes]]) -> None:
        """Delete ``(map name, key)`` pairs (absent ones are fine)."""
        for name, key in keys:
            self.maps[name].delete(key)

    def keys_of(self, sid: int) -> list[tuple[str, bytes]]:
        """Every rule and learned key of sandbox index ``sid`` (a scan: for cleanup after a
        restart, not the hot path)."""
        out = []
        for name in ("cidr4", "cidr6"):
            out += [(name, k) for k in self.maps[name].keys()  # noqa: SIM118
                    if struct.unpack_from("=I", k, 4)[0] == sid]
        for name in ("learned4", "learned6"):
            out += [(name, k) for k in self.maps[name].keys()  # noqa: SIM118
                    if struct.unpack_from("=I", k, 0)[0] == sid]
        return out

    def set_denies(self, nets: Iterable[Network]) -> None:
        """Make the platform deny list exactly ``nets``."""
        want: dict[str, set[bytes]] = {"deny4": set(), "deny6": set()}
        for n in nets:
            want["deny4" if n.version == 4 else "deny6"].add(
                struct.pack("=I", n.prefixlen) + n.network_address.packed)
        for name, keys in want.items():
            m = self.maps[name]
            for k in set(m.keys()) - keys:
                m.delete(k)
            for k in keys:
                m.update(k, b"\x01")

    # -- denial events --------------------------------------------------------------------

    def start_events(self) -> int:
        """Open the ring buffer; returns an fd to poll (readable: call :meth:`drain`)."""
        ffi, L = libbpf.lib()

        def on_sample(_ctx: Any, data: Any, size: int) -> int:
            if size >= EVENT.size:
                self._pending.append(_decode(bytes(ffi.buffer(data, EVENT.size))))
            return 0

        self._rb_cb = ffi.callback("int(void *, void *, size_t)", on_sample)
        rb = L.ring_buffer__new(self.maps["events"].fd, self._rb_cb, ffi.NULL, ffi.NULL)
        if rb == ffi.NULL:
            libbpf.check(-1, "ring buffer")
        self._rb = rb
        return int(L.ring_buffer__epoll_fd(rb))

    def drain(self) -> list[Denial]:
        """Denials reported since the last call."""
        if self._rb is None:
            return []
        _, L = libbpf.lib()
        libbpf.check(L.ring_buffer__consume(self._rb), "consume ring buffer")
        out, self._pending = self._pending, []
        return out

    def stop_events(self) -> None:
        if self._rb is not None:
            _, L = libbpf.lib()
            L.ring_buffer__free(self._rb)
            self._rb = None
            self._rb_cb = None


def _decode(raw: bytes) -> Denial:
    netns, sid, dropped, family, proto, hook, why, port, _pad, addr = EVENT.unpack(raw)
    a: Address = (ipaddress.IPv4Address(addr[:4]) if family == 4
                  else ipaddress.IPv6Address(addr))
    return Denial(netns, sid, dropped, a, int.from_bytes(port, "big"),
                  PROTOS.get(proto, str(proto)), HOOKS.get(hook, str(hook)),
                  WHY.get(why, str(why)))


def available() -> tuple[bool, str]:
    """Whether the egress programs can be used here: the object built and libbpf present
    (the kernel's answer comes only from loading them)."""
    if not OBJECT.is_file():
        return False, f"{OBJECT} not built"
    try:
        libbpf.lib()
    except BpfError as exc:
        return False, str(exc)
    return True, "ok"


__all__ = ["Denial", "EgressFilter", "SandboxEntry", "available", "now_ns"]
