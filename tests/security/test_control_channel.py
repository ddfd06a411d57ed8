"""Done-when 3 and 4: the control channel and the daemon are out of the workload's reach.

3. From sandbox root: /proc/1/mem, /proc/1/fd/*, ptrace and process_vm_writev on PID 1,
   signals to PID 1 (kill, tgkill, pidfd_open, and a /proc/1 dir fd used as a pidfd), fds
   inherited from sbx-init, and every unix socket visible in the sandbox (connected to and fed
   garbage). sbx-init must be the same process afterwards and still serve. Recorded: the
   seccomp denials (ptrace, process_vm_writev, kill, tgkill, pidfd_open). Not recorded: the
   EACCES of /proc/1 (ptrace access checks: sbx-init is not dumpable and the workload has no
   CAP_SYS_PTRACE) and the EPERM of Landlock's signal scoping (audit only).
   Garbage and oversized frames on the control connection itself (a compromised peer): sbx-init
   answers with errors and keeps serving; each refused frame is a ``protocol_violation``.
4. The daemon: no path, socket or name of edged's exists inside the sandbox (nothing to deny,
   so nothing is recorded).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from edged.backends.base import ExecSpec
from edged.sbxinit import protocol as P
from tests.security.conftest import (
    Node,
    assert_all_failed,
    denied_syscalls,
    execv,
    kinds,
    results,
    run,
    sh,
    spec,
)

pytestmark = [pytest.mark.root, pytest.mark.mount]

CTL_ATTEMPTS = {"proc1_mem", "ptrace_attach", "ptrace_seize",
                "process_vm_writev", "kill_TERM", "kill_KILL", "kill_STOP", "tgkill",
                "pidfd_open", "procfd_signal"}


def test_sbx_init_unreachable_from_the_workload(node: Node, rootfs: Path) -> None:
    b, ledger = node.backend, node.ledger

    async def body() -> None:
        await b.create(spec(rootfs, "ctl"))
        try:
            pid = b._get("ctl").pid
            # a long-running exec the attacker might want to hijack, as sbx-init's child
            bg = await b.exec("ctl", ExecSpec(argv=("sleep", "30"), env={"PATH": "/bin"}))
            out, err, end = await execv(b, "ctl", ("/usr/bin/attack", "ctl"))
            assert end.exit_code == 0, err
            res = results(out)
            assert_all_failed(res, CTL_ATTEMPTS)
            assert not [k for k in res if k.startswith(("inherited_fd", "unix_connect"))]
            # (the pidfd signal: EPERM from Landlock's signal scoping; EACCES from AppArmor
            # where Landlock has none, ABI < 6: tests/security/test_apparmor.py)
            assert res["proc1_mem"] == "EACCES" and res["procfd_signal"] in ("EPERM", "EACCES")
            # still the same sbx-init, still serving
            assert b._get("ctl").pid == pid
            out, _, end = await sh(b, "ctl", "echo alive")
            assert out == "alive\n" and end.exit_code == 0
            await bg.kill()
        finally:
            await b.destroy("ctl")

    run(body)
    assert {"ptrace", "process_vm_writev", "kill", "tgkill",
            "pidfd_open"} <= denied_syscalls(ledger, "ctl")


def test_garbage_frames_on_the_control_connection(node: Node, rootfs: Path) -> None:
    b, ledger = node.backend, node.ledger

    async def body() -> None:
        await b.create(spec(rootfs, "frames"))
        try:
            conn = b._get("frames").conn
            assert conn is not None
            await conn.send(P.frame(0x55, 0, b"\xff" * 100))  # unknown type
            await conn.send(P.frame(P.SIGNAL_T, 999, b"x"))  # wrong size, unknown exec
            await conn.send(P.frame(P.EXEC_T, 7, b"\x00" * 41))  # strings missing
            rng = random.Random(5)
            # random well-framed garbage: types, ids, sizes, bytes. Its exec ids are ones the
            # client does not give out soon (it counts from 1): at load, sbx-init's error
            # answer to a garbage EXEC with id 3 came after the client had given 3 to the
            # real exec below, which then ended with that error ("argc ... out of range")
            for _ in range(300):
                t = rng.choice([rng.randrange(0, 0x100), P.EXEC_T, P.SIGNAL_T, P.RESIZE_T,
                                P.CREDIT, P.STDIN, P.KILL])
                await conn.send(P.frame(t, rng.randrange(0xFFFF0000, 0xFFFF0005),
                                        rng.randbytes(rng.randrange(0, 200))))
            await asyncio.sleep(0.2)
            out, _, _ = await sh(b, "frames", "echo still")
            assert out == "still\n"
            # a header announcing more than MAX_PAYLOAD: sbx-init drops that connection
            await conn.send(P.HDR.pack(P.MAX_PAYLOAD + 1, P.STDIN, 0, 1, 0))
            for _ in range(100):
                if conn.closed:
                    break
                await asyncio.sleep(0.02)
            assert conn.closed
            await b.close()
            await b.adopt("frames")  # the same sbx-init takes a new connection
            out, _, _ = await sh(b, "frames", "echo again")
            assert out == "again\n"
        finally:
            await b.destroy("frames")

    run(body)
    pv = [e for e in ledger.events("frames") if e.kind == "protocol_violation"]
    assert len(pv) >= 3, pv
    assert "protocol_violation" in kinds(ledger, "frames")


def test_no_trace_of_edged_inside(node: Node, rootfs: Path) -> None:
    b = node.backend
    state = str(b.state_dir)

    async def body() -> None:
        await b.create(spec(rootfs, "reach"))
        try:
            out, _err, _ = await sh(
                b, "reach",
                "find / -xdev \\( -type s -o -name '*edged*' -o -name 'ctl.sock' \\) 2>/dev/null;"
                " find /proc/1/root /proc/self/root -maxdepth 3 -name '*edged*' 2>/dev/null;"
                " cat /proc/net/unix; cat /proc/mounts; ls -a /run /var/run 2>/dev/null;"
                f" ls -d {state} /run/edged 2>&1; echo done")
            assert out.rstrip().endswith("done")
            lines = out.splitlines()
            assert "edged" not in out.replace(f"ls: {state}", "").replace(
                "ls: /run/edged", ""), out
            # /proc/net/unix of the sandbox's own net namespace: no socket anyone can reach,
            # i.e. none with a path or an abstract name, none listening; only sbx-init's
            # unnamed connected pairs (to the spare exec child it keeps ready)
            hdr = [i for i, line in enumerate(lines) if line.startswith("Num ")]
            assert hdr, out
            socks = []
            for line in lines[hdr[0] + 1:]:
                if not line.startswith("0000"):
                    break
                socks.append(line.split())
            assert all(len(f) == 7 and f[5] == "03" for f in socks), out
            assert len(socks) <= 2, out
            assert f"ls: {state}: No such file or directory" in out
        finally:
            await b.destroy("reach")

    run(body)
