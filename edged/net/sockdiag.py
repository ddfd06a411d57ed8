"""Cutting a sandbox's connections that a new policy forbids: ``SOCK_DESTROY`` over
NETLINK_SOCK_DIAG (``linux/inet_diag.h``, ``linux/sock_diag.h``; needs
CONFIG_INET_DIAG_DESTROY and CAP_NET_ADMIN over the socket's namespace, which the daemon has:
the sandbox's namespace belongs to the initial user namespace). A destroyed TCP socket sends a
reset to its peer and its owner's next call fails with ECONNABORTED; a destroyed UDP socket's
next call fails the same way. Call these with the thread inside the sandbox's namespace.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
SOCK_DESTROY = 21
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_LISTEN = 10
_NLH = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI")  # inet_diag_req_v2 head: family, protocol, ext, pad, states
_SOCKID = struct.Struct("!HH16s16s")  # sport, dport, src, dst (then if, cookie: native)
_MSG = struct.Struct("=BBBB")  # inet_diag_msg head: family, state, timer, retrans

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Sock:
    """One socket of the namespace: its 48-byte ``inet_diag_sockid`` (to destroy it by)."""

    family: int
    protocol: int
    state: int
    dst: Address
    dport: int
    sockid: bytes


def _request(sock: socket.socket, msg_type: int, flags: int, body: bytes, seq: int) -> bytes:
    sock.send(_NLH.pack(_NLH.size + len(body), msg_type, flags, seq, 0) + body)
    return b""


def _sockid_zero() -> bytes:
    return _SOCKID.pack(0, 0, bytes(16), bytes(16)) + struct.pack("=I", 0) + struct.pack(
        "=II", 0xFFFFFFFF, 0xFFFFFFFF)


def dump() -> list[Sock]:
    """TCP and UDP sockets of the calling thread's namespace (listeners left out)."""
    out: list[Sock] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        seq = 0
        for fam in (socket.AF_INET, socket.AF_INET6):
            for proto in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                seq += 1
                body = _REQ.pack(fam, proto, 0, 0, 0xFFFFFFFF & ~(1 << TCP_LISTEN)) + \
                    _sockid_zero()
                _request(nl, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, body, seq)
                done = False
                while not done:
                    data = nl.recv(1 << 16)
                    off = 0
                    while off + _NLH.size <= len(data):
                        ln, typ, _fl, _seq, _pid = _NLH.unpack_from(data, off)
                        if typ in (NLMSG_DONE, NLMSG_ERROR):
                            done = True
                            break
                        f, state, _t, _r = _MSG.unpack_from(data, off + _NLH.size)
                        sid = data[off + _NLH.size + 4: off + _NLH.size + 52]
                        _sp, dport, _src, dst = _SOCKID.unpack_from(sid)
                        addr: Address = (ipaddress.IPv4Address(dst[:4]) if f == socket.AF_INET
                                         else ipaddress.IPv6Address(dst))
                        out.append(Sock(f, proto, state, addr, dport, sid))
                        off += (ln + 3) & ~3
    return out


def destroy(s: Sock) -> bool:
    """SOCK_DESTROY one socket; False if it was gone already."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        body = _REQ.pack(s.family, s.protocol, 0, 0, 0xFFFFFFFF) + s.sockid
        _request(nl, SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, body, 1)
        data = nl.recv(4096)
        _ln, typ, _f, _s, _p = _NLH.unpack_from(data, 0)
        if typ == NLMSG_ERROR:
            err = -struct.unpack_from("=i", data, _NLH.size)[0]
            if err == 0:
                return True
            if err == 2:  # ENOENT
                return False
            raise OSError(err, f"SOCK_DESTROY: {os.strerror(err)}")
    return True


def cut(keep: Callable[[Sock], bool]) -> list[Sock]:
    """Destroy every connected socket of the namespace for which ``keep`` is False (sockets
    with no peer, such as unconnected UDP, are left: each of their sends is checked);
    returns those destroyed."""
    gone = []
    for s in dump():
        if s.dport == 0 or s.dst.is_unspecified:
            continue
        if not keep(s) and destroy(s):
            gone.append(s)
    return gone
