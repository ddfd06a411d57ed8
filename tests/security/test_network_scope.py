"""Landlock TCP rules where the task profile asks for them: only the listed ports can be bound
or connected to (ABI >= 4), even by sandbox root. Landlock denials are not recorded (the kernel
reports them only through audit); the workload sees EACCES. On a kernel whose Landlock has no
TCP rules (ABI < 4: the 6.1 LTS of scripts/node-vm.sh) such a sandbox is refused at create,
never run without them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edged.errors import BadRequest
from edged.security import landlock
from edged.security.profile import PROFILES_DIR
from tests.security.conftest import Node, run, sh, spec

pytestmark = [pytest.mark.root, pytest.mark.mount]


def test_tcp_ports_limited_by_the_task_profile(node: Node, rootfs: Path, tmp_path: Path) -> None:
    prof = tmp_path / "netonly.toml"
    default = (PROFILES_DIR / "tasks" / "default.toml").read_text()
    prof.write_text(default + "\ntcp_bind = [8080]\ntcp_connect = [8080]\n")
    b = node.backend

    async def refused() -> None:
        with pytest.raises(BadRequest, match=r"Landlock ABI 4 .*this kernel has ABI \d"):
            await b.create(dataclasses.replace(spec(rootfs, "net"), task_profile=str(prof)))
        assert await b.list_existing() == []

    if landlock.abi() < 4:
        run(refused)
        return

    async def body() -> None:
        await b.create(dataclasses.replace(spec(rootfs, "net"), task_profile=str(prof)))
        try:
            out, err, _ = await sh(
                b, "net",
                "nc -l -p 8081 </dev/null; echo b8081=$?;"
                # the listener's stdin stays open: at EOF it would quit before reading
                " sleep 5 | nc -l -p 8080 >/tmp/got 2>&1 & c=1; i=0;"
                " while [ $c -ne 0 ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1));"
                "   echo hi | nc -w 1 127.0.0.1 8080 2>/dev/null; c=$?; done; echo c8080=$c;"
                " nc -w 1 127.0.0.1 8081 </dev/null; echo c8081=$?;"
                " i=0; until grep -q hi /tmp/got || [ $i -gt 50 ]; do sleep 0.1; i=$((i+1));"
                " done; cat /tmp/got",
                timeout_s=20)
            assert "b8081=1" in out and "c8080=0" in out and "c8081=1" in out, (out, err)
            assert out.rstrip().endswith("hi"), out
            assert "bind: Permission denied" in err and "connect" in err, err
        finally:
            await b.destroy("net")

    run(body)
