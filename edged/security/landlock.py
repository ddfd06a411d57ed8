"""Landlock rulesets: describe, probe the kernel's ABI, serialise for the spawner/sbx-init.

A :class:`LandlockRuleset` is the whole policy of one workload exec: handled rights (denied
unless a rule grants them), path rules, TCP port rules and scopes. :meth:`serialize` produces
the blob of ``csrc/include/lfs_confine.h`` (``struct lfs_ll_hdr`` + rules), which sbx-init
applies in C (``lfs_landlock_apply``) in the exec's child just before exec, after the fork, so
every exec (the agent's and the grader's) is its own Landlock domain: sibling domains cannot
signal, ptrace or connect to each other's abstract sockets, and none can reach sbx-init.

Facts: include/uapi/linux/landlock.h and Documentation/userspace-api/landlock.rst (Linux 6.18):
ABI 1 fs rights, 2 REFER, 3 TRUNCATE, 4 TCP bind/connect, 5 IOCTL_DEV, 6 scopes (abstract unix
sockets, signals), 7 audit logging flags. Rights the running kernel lacks are dropped by the C
side (best effort, as the kernel documentation advises); :func:`abi` says which apply.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from edged.errors import BadRequest
from edged.native import check, lib, new_error

# Filesystem rights (uapi landlock.h).
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13
FS_TRUNCATE = 1 << 14
FS_IOCTL_DEV = 1 << 15
FS_ALL = (1 << 16) - 1
#: What a protected path keeps: read, list, execute.
FS_READ_EXEC = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
NET_BIND_TCP = 1 << 0
NET_CONNECT_TCP = 1 << 1
NET_ALL = NET_BIND_TCP | NET_CONNECT_TCP
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1
SCOPE_ALL = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL

_MAGIC = 0x4C4C464C
_HDR = struct.Struct("<IHHQQQII")
_RULE = struct.Struct("<HHIQQ")
_OPTIONAL = 1
assert _HDR.size == 40 and _RULE.size == 24


def abi() -> int:
    """The running kernel's Landlock ABI version (0: absent or disabled)."""
    return int(lib.lfs_landlock_abi())


#: What each Landlock ABI adds, and what edged does on a kernel without it (kernels before
#: the version, e.g. the 6.1 LTS with ABI 2). Documentation/userspace-api/landlock.rst.
ABI_FEATURES: dict[int, tuple[str, str]] = {
    1: ("filesystem rights (Linux 5.13)",
        "protected paths rest on read-only mounts, seccomp and AppArmor"),
    2: ("linking and renaming across directories, REFER (5.19)",
        "renames into protected trees are refused by their read-only mounts"),
    3: ("truncate(2) of files, TRUNCATE (6.2)",
        "protected files are read-only mounts (EROFS) and AppArmor-denied; others may be "
        "truncated"),
    4: ("TCP bind and connect rules (6.7)",
        "a task profile with tcp_bind/tcp_connect is refused at create"),
    5: ("ioctl on device files, IOCTL_DEV (6.10)",
        "the sandbox's /dev holds only null, zero, full, random, urandom, tty, pts; seccomp "
        "filters ioctl numbers"),
    6: ("scoping of signals and abstract unix sockets (6.12)",
        "signals to sbx-init and between profiles are AppArmor's (where loaded); the "
        "workload's execs share one profile, so they can signal each other and reach each "
        "other's abstract sockets; abstract sockets are per network namespace, and each "
        "sandbox has its own"),
    7: ("audit logging of denials (6.15)", "Landlock denials are not recorded"),
}


def features() -> dict[str, object]:
    """The feature probe's Landlock part: ``abi``, ``lacks`` (for each ABI version above the
    kernel's: what it would add and what edged does instead)."""
    n = abi()
    return {"abi": n, "lacks": {str(v): {"feature": what, "instead": instead}
                                for v, (what, instead) in sorted(ABI_FEATURES.items())
                                if v > n}}


@dataclass(frozen=True)
class PathRule:
    """Grant ``access`` beneath ``path`` (absolute, inside the sandbox's root). ``optional``:
    skip when the path does not exist at apply time."""

    path: str
    access: int
    optional: bool = True


@dataclass(frozen=True)
class LandlockRuleset:
    """One Landlock domain. Units: rights are bit masks of the constants above; ports are TCP
    port numbers. ``handled_net`` 0 leaves TCP unrestricted."""

    handled_fs: int = FS_ALL
    handled_net: int = 0
    scoped: int = SCOPE_ALL
    paths: tuple[PathRule, ...] = ()
    ports: tuple[tuple[int, int], ...] = ()  # (port, access)
    restrict_flags: int = 0
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def serialize(self) -> bytes:
        """The ``lfs_ll_hdr`` blob. Raises :class:`~edged.errors.BadRequest` naming a bad rule
        (relative path, NUL, rights outside the handled set, port out of range)."""
        if self.handled_fs & ~FS_ALL or self.handled_net & ~NET_ALL or self.scoped & ~SCOPE_ALL:
            raise BadRequest("landlock: unknown rights in the handled set")
        rules = len(self.paths) + len(self.ports)
        if rules > 4096:
            raise BadRequest(f"landlock: {rules} rules (max 4096)")
        out = [_HDR.pack(_MAGIC, 1, rules, self.handled_fs, self.handled_net, self.scoped,
                         self.restrict_flags, 0)]
        for r in self.paths:
            p = r.path.encode()
            if not p.startswith(b"/") or b"\0" in p or not 0 < len(p) <= 4095:
                raise BadRequest(f"landlock rule {r.path!r}: path must be absolute, no NUL")
            if r.access & ~self.handled_fs:
                raise BadRequest(f"landlock rule {r.path!r}: grants rights that are not handled")
            pad = (-len(p)) % 8
            out.append(_RULE.pack(1, len(p), _OPTIONAL if r.optional else 0, r.access, 0))
            out.append(p + b"\0" * pad)
        for port, access in self.ports:
            if not 0 <= port <= 65535 or access & ~self.handled_net or not access:
                raise BadRequest(f"landlock port rule {port}: bad port or rights")
            out.append(_RULE.pack(2, 0, 0, access, port))
        blob = b"".join(out)
        check(lib.lfs_landlock_check(blob, len(blob), err := new_error()), err, "landlock blob")
        return blob


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def protected_ruleset(
    lowers: Sequence[str],
    protected: Iterable[str],
    *,
    extra_top: Iterable[str] = ("proc", "dev", "sys", "tmp", "run"),
    tcp_bind: Iterable[int] | None = None,
    tcp_connect: Iterable[int] | None = None,
) -> LandlockRuleset:
    """The ruleset that makes ``protected`` paths read+execute-only and leaves the rest of the
    sandbox writable.

    Landlock grants are inherited by everything beneath a path, so "everything but X" is spelt
    as read+exec on ``/`` plus full rights on every sibling of each protected path and of its
    ancestors. The tree is read from ``lowers`` (host paths of the sandbox's layers, bottom
    first; their union is the sandbox's root) plus ``extra_top`` (mounts the spawner adds).
    Symlinks are never granted (a grant would land on their target). Consequence: new
    top-level directories cannot be created (``mkdir /x`` fails); every existing one that is
    not protected stays fully writable.

    ``tcp_bind`` / ``tcp_connect``: when given, TCP is handled and only these ports allowed.
    """
    prot = sorted({os.path.normpath("/" + p.strip("/")) for p in protected})
    rules: list[PathRule] = [PathRule("/", FS_READ_EXEC, optional=False)]
    # /dev nodes need IOCTL_DEV for ttys; the spawner's /dev is minimal and read-only-safe.

    def children(rel: str) -> set[tuple[str, bool]]:
        seen: dict[str, bool] = {}
        for low in lowers:
            d = os.path.join(low, rel.lstrip("/"))
            try:
                with os.scandir(d) as it:
                    for e in it:
                        seen.setdefault(e.name, e.is_symlink())
            except (NotADirectoryError, FileNotFoundError):
                continue
        if rel == "/":
            for name in extra_top:
                seen.setdefault(name, False)
        return set(seen.items())

    def walk(rel: str) -> None:
        for name, is_link in sorted(children(rel)):
            p = os.path.join(rel, name)
            if any(_under(p, q) for q in prot) or is_link:
                continue
            if any(_under(q, p) for q in prot):
                walk(p)  # an ancestor of a protected path: grant its other children
            else:
                rules.append(PathRule(p, FS_ALL))

    if "/" in prot:
        pass  # the whole root is protected: read+exec only
    else:
        walk("/")
    handled_net = 0
    ports: list[tuple[int, int]] = []
    if tcp_bind is not None or tcp_connect is not None:
        handled_net = NET_ALL
        ports += [(p, NET_BIND_TCP) for p in (tcp_bind or ())]
        ports += [(p, NET_CONNECT_TCP) for p in (tcp_connect or ())]
    return LandlockRuleset(handled_net=handled_net, paths=tuple(rules), ports=tuple(ports))


#: What a device node keeps under :func:`writable_ruleset`: read, write, truncate and ioctl
#: an existing node (``/dev/null``, a pty), never make, remove or rename one.
FS_DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_READ_DIR | FS_TRUNCATE | FS_IOCTL_DEV


def writable_ruleset(writable: Iterable[str], *, devices: str = "/dev") -> LandlockRuleset:
    """The ruleset that leaves only ``writable`` (absolute paths that exist when the sandbox
    starts, e.g. ``/tmp`` and ``/dev/shm``) changeable: read and execute everywhere, every
    right beneath each writable path, and the existing nodes beneath ``devices`` opened for
    writing (:data:`FS_DEVICE`: ``> /dev/null`` works; nothing new can be made there). What
    a workload may leave behind is then only what lies under ``writable``: the FnCall
    backend wipes those between calls (:mod:`edged.backends.fncall`)."""
    rules = [PathRule("/", FS_READ_EXEC, optional=False),
             PathRule(devices, FS_READ_EXEC | FS_DEVICE)]
    for p in sorted({os.path.normpath("/" + w.strip("/")) for w in writable}):
        if p == "/":
            raise BadRequest("landlock: '/' cannot be the writable scratch")
        rules.append(PathRule(p, FS_ALL))
    return LandlockRuleset(paths=tuple(rules))

