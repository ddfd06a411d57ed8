"""Done-when 5: host attacks from sandbox root — mount, /proc/sysrq-trigger, kernel modules,
kexec, keyctl/add_key, bpf, perf_event_open, userfaultfd, raw sockets (SOCK_CLOEXEC set too),
setns, open_by_handle_at, swapon, and changing the host's hostname — all fail, the host's
hostname is unchanged, and every syscall the seccomp profile denies is in the ledger.

Not recorded: /proc/sysrq-trigger (EACCES: the file belongs to host root, unmapped in the
sandbox's user namespace; no syscall is denied, so seccomp never sees it; on a kernel without
magic SysRq the file does not exist at all).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.security.conftest import (
    Node,
    assert_all_failed,
    denied,
    denied_syscalls,
    execv,
    results,
    run,
    sh,
    spec,
)

pytestmark = [pytest.mark.root, pytest.mark.mount]

ATTEMPTS = {"mount_tmpfs", "sysrq_open", "init_module", "finit_module", "kexec_load",
            "kexec_file_load", "keyctl", "add_key", "bpf", "perf_event_open", "userfaultfd",
            "raw_packet", "raw_inet", "raw_inet_cloexec", "sethostname", "setns",
            "open_by_handle_at", "swapon"}
RECORDED = {"mount", "init_module", "finit_module", "kexec_load", "kexec_file_load", "keyctl",
            "add_key", "bpf", "perf_event_open", "userfaultfd", "socket", "sethostname",
            "setns", "open_by_handle_at", "swapon"}


def test_host_attacks_fail_and_are_recorded(node: Node, rootfs: Path) -> None:
    b, ledger = node.backend, node.ledger
    host_name = socket.gethostname()

    async def body() -> None:
        await b.create(spec(rootfs, "host"))
        try:
            out, err, end = await execv(b, "host", ("/usr/bin/attack", "host"))
            assert end.exit_code == 0, err
            res = results(out)
            assert_all_failed(res, ATTEMPTS)
            # EACCES where the kernel has magic SysRq; this one has none (ENOENT on the host too)
            assert res["sysrq_open"] == ("EACCES" if Path("/proc/sysrq-trigger").exists()
                                         else "ENOENT")
            assert {res[k] for k in ATTEMPTS - {"sysrq_open"}} == {"EPERM"}, res
            out, _, _ = await sh(b, "host", "hostname")
            assert out == "host-host\n"  # its own UTS namespace, unchanged too
        finally:
            await b.destroy("host")

    run(body)
    assert socket.gethostname() == host_name
    assert denied_syscalls(ledger, "host") >= RECORDED, RECORDED - denied_syscalls(ledger, "host")
    ev = next(e for e in denied(ledger, "host") if e.syscall == "sethostname")
    assert ev.process == "attack" and ev.pid is not None and ev.detail["errno"] == "EPERM"
    # the three raw sockets: AF_PACKET, AF_INET SOCK_RAW, and SOCK_RAW|SOCK_CLOEXEC
    socks = [e for e in denied(ledger, "host") if e.syscall == "socket"]
    assert len(socks) == 3
