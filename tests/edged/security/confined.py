"""Test helper: run a Python function in a forked child under real confinement.

The child applies what it is given in sbx-init's order (Landlock, capabilities, seccomp with a
notification listener passed back over SCM_RIGHTS), runs ``fn`` and sends its JSON-able result
back; the parent serves the listener with a real :class:`SeccompRecorder` into ``ledger`` while
the child runs. No stub: every denial is the kernel's.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import socket
import traceback
from collections.abc import Callable
from typing import Any

from edged.security import confine
from edged.security.ledger import Ledger

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def raw_syscall(nr: int, *args: int) -> int:
    """syscall(2) with 64-bit register values; returns the result or ``-errno``."""
    cargs = [ctypes.c_ulong(a & 0xFFFFFFFFFFFFFFFF) for a in args]
    r = libc.syscall(ctypes.c_long(nr), *cargs)
    return -ctypes.get_errno() if r == -1 else int(r)


def run_confined(
    fn: Callable[[], Any],
    *,
    seccomp: bytes | None = None,
    notify: bool = True,
    landlock: bytes | None = None,
    caps: int | None = None,
    ledger: Ledger | None = None,
    sandbox_id: str = "t1",
    timeout: float = 30.0,
) -> Any:
    """Fork, confine, run ``fn`` in the child; return its result (re-raise its failure)."""
    ctl_parent, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        code = 0
        try:
            ctl_parent.close()
            os.close(rd)
            try:
                if landlock is not None:
                    confine.apply_landlock(landlock)
                if caps is not None:
                    confine.restrict_caps(caps)
                if seccomp is not None:
                    fd = confine.install_seccomp(seccomp, listener=notify)
                    if notify:
                        socket.send_fds(ctl_child, [b"L"], [fd])
                        os.close(fd)
                ctl_child.close()
                out = {"ok": fn()}
            except BaseException:
                out = {"error": traceback.format_exc()}
            os.write(wr, json.dumps(out).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    ctl_child.close()
    os.close(wr)
    recorder = None
    try:
        if seccomp is not None and notify:
            ctl_parent.settimeout(timeout)
            _, fds, _, _ = socket.recv_fds(ctl_parent, 1, 1)
            assert fds, "child sent no listener fd"
            recorder = confine.SeccompRecorder(ledger or Ledger(), sandbox_id, fds[0])
        data = b""
        while True:
            watch = [rd] + ([recorder.fd] if recorder else [])
            ready, _, _ = select.select(watch, [], [], timeout)
            assert ready, "confined child timed out"
            if recorder and recorder.fd in ready:
                recorder.handle_one()
            if rd in ready:
                chunk = os.read(rd, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        if recorder:
            recorder.close()
        os.close(rd)
        ctl_parent.close()
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child status {status}"
    out = json.loads(data)
    if "error" in out:
        raise AssertionError("confined child failed:\n" + out["error"])
    return out["ok"]
