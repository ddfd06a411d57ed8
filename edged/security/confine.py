"""Applying confinement to the calling process, and recording seccomp denials.

The spawner/sbx-init apply the same C functions (csrc/include/lfs_confine.h) in C; these
bindings serve tests, benchmarks and any Python-forked helper. Order matters and is the one
sbx-init uses: Landlock (needs no privilege), capabilities (drop), then seccomp last, since
the filter may deny calls the earlier steps make.

:class:`SeccompRecorder` is the observability half of the deny mode ``notify``: it owns a
seccomp user-notification listener fd (SECCOMP_FILTER_FLAG_NEW_LISTENER, handed over by the
confined process over SCM_RIGHTS), answers every notification with EPERM and records a
``seccomp_denied`` event in the ledger. If the recorder dies, the kernel answers ENOSYS: the
syscall stays denied.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from typing import Any

from edged.native import check, ffi, lib, new_error, raise_error
from edged.security.ledger import Ledger
from edged.security.seccomp import syscall_name

log = logging.getLogger("edged.security")

#: Capabilities a workload keeps inside its user namespace (bit = capability number, from
#: linux/capability.h): file ownership and permission handling for package installs
#: (CHOWN 0, DAC_OVERRIDE 1, FOWNER 3, FSETID 4), signals to its own processes (KILL 5),
#: switching users (SETGID 6, SETUID 7), binding low ports (NET_BIND_SERVICE 10). Dropped:
#: SYS_ADMIN (mount, namespaces), SYS_PTRACE, NET_RAW, NET_ADMIN, SYS_CHROOT, MKNOD,
#: SETPCAP, SETFCAP, AUDIT_*, and everything else.
WORKLOAD_CAPS = sum(1 << c for c in (0, 1, 3, 4, 5, 6, 7, 10))

AUDIT_ARCH_X86_64 = 0xC000003E


def apply_landlock(blob: bytes) -> None:
    """Restrict the calling process with a serialised ruleset (sets no_new_privs).
    Raises ``BackendError`` (``OSError``) on failure, ``BadRequest`` (``ValueError``) for a
    bad blob."""
    check(lib.lfs_landlock_apply(blob, len(blob), err := new_error()), err, "landlock")


def restrict_caps(keep: int = WORKLOAD_CAPS) -> None:
    """Keep only the capabilities in ``keep`` (bounding, permitted, effective, inheritable;
    ambient cleared) and set no_new_privs."""
    check(lib.lfs_caps_restrict(keep, err := new_error()), err, "restrict capabilities")


def install_seccomp(prog: bytes, *, listener: bool = True, log_denials: bool = False) -> int:
    """Install the compiled program on the calling thread; returns the listener fd (or 0).
    Sets no_new_privs first (required without CAP_SYS_ADMIN, and wanted anyway)."""
    restrict_caps((1 << 64) - 1)
    err = new_error()
    return check(lib.lfs_seccomp_install(prog, len(prog), int(listener), int(log_denials), err),
                 err, "install seccomp filter")


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


class SeccompRecorder:
    """Answer and record the seccomp notifications of one sandbox.

    ``listener``: the notification fd (owned: closed by :meth:`close`). ``proc_pid``:
    translate for ``/proc`` reads (the notification's pid is in the recorder's pid namespace;
    0 when the target is not visible there).
    """

    def __init__(self, ledger: Ledger, sandbox_id: str, listener: int) -> None:
        self.ledger = ledger
        self.sandbox_id = sandbox_id
        self.fd = listener
        self.handled = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_one(self) -> bool:
        """Receive one notification, deny it with EPERM and record it. Returns False if the
        target died before it could be read."""
        ev = ffi.new("struct lfs_seccomp_event *")
        err = new_error()
        if lib.lfs_seccomp_notif_recv(self.fd, ev, err) < 0:
            if int(err.code) in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                return False
            raise_error(err, f"sandbox {self.sandbox_id}: seccomp listener")
        pid = int(ev.pid)
        process = _comm(pid) if pid else None  # read before answering: the pid is still ours
        if lib.lfs_seccomp_notif_deny(self.fd, ev.id, errno.EPERM, err) < 0 and int(
            err.code
        ) != errno.ENOENT:
            raise_error(err, f"sandbox {self.sandbox_id}: answer seccomp notification")
        nr = int(ev.nr)
        args = [int(a) for a in ev.args]
        foreign = int(ev.arch) != AUDIT_ARCH_X86_64 or nr & 0x40000000
        detail: dict[str, Any] = {
            "nr": nr,
            "arch": f"{int(ev.arch):#x}",
            "args": [f"{a:#x}" for a in args],
            "errno": "EPERM",
        }
        if foreign:
            detail["abi"] = "foreign (i386 or x32)"
        name = f"syscall_{nr}" if foreign else syscall_name(nr)
        if name == "ioctl":
            detail["ioctl"] = f"{args[1] & 0xFFFFFFFF:#x}"
        self.ledger.record(self.sandbox_id, "seccomp_denied", pid=pid or None, process=process,
                           syscall=name, detail=detail)
        self.handled += 1
        return True

    def start(self) -> None:
        """Serve the listener from the running event loop (non-blocking reads on readiness)."""
        os.set_blocking(self.fd, False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.fd, self._on_ready)

    def _on_ready(self) -> None:
        try:
            self.handle_one()
        except OSError as e:
            log.warning("sandbox %s: seccomp listener: %s", self.sandbox_id, e)
            self.close()

    def close(self) -> None:
        """Stop serving and close the listener (pending and future denials get ENOSYS)."""
        if self.fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1
