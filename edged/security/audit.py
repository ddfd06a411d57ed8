"""The kernel's audit messages as security events: AppArmor denials of a sandbox's profile.

AppArmor reports a denial (and nothing else reports it: the workload sees ``EACCES`` or
``EPERM``) as an audit record of type ``AVC`` (1400). The kernel sends every audit record to
the multicast group ``AUDIT_NLGRP_READLOG`` of its ``NETLINK_AUDIT`` socket family, to any
number of readers holding ``CAP_AUDIT_READ``, whether or not an audit daemon (auditd,
systemd-journald) also takes them; so edged reads them there, in its own loop, and needs no
audit daemon and no log file. Sources: include/uapi/linux/audit.h (``AUDIT_AVC``,
``AUDIT_NLGRP_READLOG``), include/uapi/linux/netlink.h (``struct nlmsghdr``),
security/apparmor/audit.c and lib/audit.c (the record's fields: ``apparmor="DENIED"``,
``operation``, ``profile``, ``name``, ``pid``, ``comm``, ``requested_mask``,
``denied_mask``, ``signal``, ``peer``; untrusted strings quoted, or hex when they hold
spaces, quotes or control characters).

A record is one netlink message whose payload is text: ``audit(SECONDS.MS:SERIAL): k=v ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("edged.security.audit")

NETLINK_AUDIT = 9
AUDIT_NLGRP_READLOG = 1
AUDIT_AVC = 1400
_NLMSGHDR = struct.Struct("=IHHII")

_FIELD = re.compile(r'(\w+)=("([^"]*)"|(\S+))')
#: Fields the kernel logs with audit_log_untrustedstring: quoted, or hex when unsafe.
_UNTRUSTED = {"name", "comm", "exe", "profile", "peer", "target", "info", "name2", "srcname",
              "addr", "peer_addr"}


@dataclass(frozen=True)
class AuditRecord:
    """One audit record: ``type`` (e.g. 1400), ``serial`` (the audit event number),
    ``fields`` (decoded ``key=value`` pairs, in order)."""

    type: int
    serial: int
    fields: dict[str, str] = field(default_factory=dict)


def _decode(key: str, quoted: str | None, bare: str | None) -> str:
    if quoted is not None:
        return quoted
    assert bare is not None
    if key in _UNTRUSTED and len(bare) % 2 == 0 and re.fullmatch(r"[0-9A-F]+", bare):
        with contextlib.suppress(ValueError):
            return bytes.fromhex(bare).decode("utf-8", "replace")
    return bare


def parse_record(rtype: int, text: str) -> AuditRecord:
    """Parse a record's text (``audit(1700000000.123:45): apparmor="DENIED" ...``, with or
    without a leading ``type=N`` as printk writes it). Raises ValueError for text that is
    not an audit record."""
    m = re.search(r"audit\((\d+)\.(\d+):(\d+)\):\s?", text)
    if m is None:
        raise ValueError(f"not an audit record: {text[:80]!r}")
    fields = {f.group(1): _decode(f.group(1), f.group(3), f.group(4))
              for f in _FIELD.finditer(text, m.end())}
    return AuditRecord(rtype, int(m.group(3)), fields)


def parse_messages(data: bytes) -> list[AuditRecord]:
    """The records in one datagram read from the audit socket (one or more netlink messages:
    ``struct nlmsghdr`` then the text, each padded to 4 bytes). Messages that are not audit
    text are left out."""
    out = []
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, rtype, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            break
        text = data[off + _NLMSGHDR.size: off + length].rstrip(b"\0").decode("utf-8", "replace")
        with contextlib.suppress(ValueError):
            out.append(parse_record(rtype, text))
        off += (length + 3) & ~3
    return out


@dataclass(frozen=True)
class AppArmorDenial:
    """An AppArmor denial of one of our profiles: ``profile`` (the label, e.g.
    ``edged-sbx-abc``), ``operation`` (``open``, ``signal``, ``connect``, ...), ``name`` (the
    path, when a file), ``pid`` (host pid), ``comm``, ``requested``/``denied`` (masks),
    ``peer`` (a signal's or socket's other side), ``signal``, ``serial``."""

    profile: str
    operation: str
    name: str | None
    pid: int | None
    comm: str | None
    requested: str | None
    denied: str | None
    peer: str | None
    signal: str | None
    serial: int

    def detail(self) -> dict[str, object]:
        """The fields worth a ledger event's ``detail`` (the ones present)."""
        d: dict[str, object] = {"operation": self.operation, "profile": self.profile,
                                "audit_serial": self.serial}
        for k in ("requested", "denied", "peer", "signal"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d


def apparmor_denial(rec: AuditRecord) -> AppArmorDenial | None:
    """The AppArmor denial in ``rec``, or None (another record type, an ``ALLOWED`` or
    ``AUDIT`` record, a profile change)."""
    f = rec.fields
    if rec.type != AUDIT_AVC or f.get("apparmor") != "DENIED" or "profile" not in f:
        return None
    pid = None
    with contextlib.suppress(KeyError, ValueError):
        pid = int(f["pid"])
    return AppArmorDenial(f["profile"], f.get("operation", ""), f.get("name"), pid,
                          f.get("comm"), f.get("requested_mask"), f.get("denied_mask"),
                          f.get("peer") or f.get("target"), f.get("signal"), rec.serial)


class AuditReader:
    """Reads the kernel's audit multicast in the running event loop and calls
    ``on_denial(denial)`` for each AppArmor denial. :meth:`start` (returns False, with a
    logged notice, where the socket cannot be had: no audit in the kernel, no
    CAP_AUDIT_READ), :meth:`close`. One reader per backend; several may run at once."""

    def __init__(self, on_denial: Callable[[AppArmorDenial], None]) -> None:
        self.on_denial = on_denial
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.records = 0

    def start(self) -> bool:
        if self._sock is not None:
            return True
        try:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC
                              | socket.SOCK_NONBLOCK, NETLINK_AUDIT)
        except OSError as e:
            log.warning("audit: no NETLINK_AUDIT socket (%s): AppArmor denials are not "
                        "recorded", e)
            return False
        try:
            s.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        except OSError as e:
            s.close()
            log.warning("audit: cannot join the audit log's multicast group (%s: needs "
                        "CAP_AUDIT_READ): AppArmor denials are not recorded", e)
            return False
        self._sock = s
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(s.fileno(), self._readable)
        return True

    def _readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError as e:  # ENOBUFS: the kernel dropped records for us
                log.warning("audit: %s (records lost)", e)
                return
            for rec in parse_messages(data):
                self.records += 1
                d = apparmor_denial(rec)
                if d is not None:
                    try:
                        self.on_denial(d)
                    except Exception:
                        log.exception("audit: handling a denial")

    def close(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
