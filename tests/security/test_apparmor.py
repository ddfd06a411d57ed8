"""The attacks AppArmor must stop, where the kernel has AppArmor (the node VM: Debian's 6.1 LTS
with AppArmor enforcing, ``scripts/node-vm.sh``): each denied **and** recorded, the denial
read from the kernel's audit messages into the ledger as ``apparmor_denied``. Where the kernel
has no AppArmor (the development machine), each test holds what edged does instead.

- Reading (or changing) a task's answer files, which the task profile hides (``hidden``):
  denied to the workload's execs, readable by the grader's (its own profile). Without
  AppArmor such a sandbox is refused at create.
- Writing a protected binary: AppArmor's rules on their own, with no read-only mount,
  Landlock or seccomp in the way (a process on the node itself, under the sandbox's
  profile): the write, a removal and a new file in a protected tree are denied. (Inside a
  sandbox the read-only mounts refuse such writes first, with EROFS, before any LSM looks:
  tests/security/test_protected_paths.py.)
- Signalling sbx-init through a pidfd (``pidfd_send_signal`` on a ``/proc/1`` fd: the one
  signal path seccomp lets through): Landlock's signal scoping (ABI 6) stops it where it
  exists; on the 6.1 kernel, whose Landlock is ABI 2, AppArmor does, and records it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edged.errors import BadRequest, NotFound
from edged.security import apparmor, landlock
from edged.security.ledger import SecurityEvent
from edged.security.profile import PROFILES_DIR
from tests.security.conftest import Node, execv, make_rootfs, results, run, sh, spec

pytestmark = [pytest.mark.root, pytest.mark.mount]

HAS_APPARMOR = bool(apparmor.probe()["kernel"])


async def _apparmor_events(node: Node, sid: str, want: int = 1,
                           bound_s: float = 20.0) -> list[SecurityEvent]:
    """The sandbox's ``apparmor_denied`` events once there are ``want`` of them (the audit
    record reaches the daemon a moment after the denial), or what there is after the
    bound."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            evs = [e for e in node.ledger.events(sid, limit=10_000)
                   if e.kind == "apparmor_denied"]
        except NotFound:  # the ledger knows a sandbox from its first event on
            evs = []
        if len(evs) >= want or time.monotonic() > deadline:
            return evs
        await asyncio.sleep(0.1)


def _hiding_profile(tmp_path: Path) -> Path:
    prof = tmp_path / "answers.toml"
    prof.write_text((PROFILES_DIR / "tasks" / "default.toml").read_text()
                    + '\nhidden = ["/answers"]\n')
    return prof


def test_answer_files_are_hidden_from_the_workload_not_the_grader(
        node: Node, attack_bin: Path, tmp_path: Path) -> None:
    root = make_rootfs(tmp_path / "root", attack_bin)
    (root / "answers").mkdir()
    (root / "answers" / "key.txt").write_text("42\n")
    sp = dataclasses.replace(spec(root, "ans"), task_profile=str(_hiding_profile(tmp_path)))
    b = node.backend

    async def refused() -> None:
        with pytest.raises(BadRequest, match="hidden paths need AppArmor"):
            await b.create(sp)
        assert await b.list_existing() == []

    if not HAS_APPARMOR:
        run(refused)
        return

    async def body() -> None:
        await b.create(sp)
        try:
            out, _, end = await sh(
                b, "ans", "cat /answers/key.txt; echo read=$?; ls /answers; echo list=$?;"
                " echo 0 > /answers/key.txt; echo write=$?; cp /answers/key.txt /tmp/k;"
                " echo copy=$?; rm /answers/key.txt; echo rm=$?")
            assert end.exit_code == 0, end
            assert "42" not in out, out
            got = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
            assert {k: got.get(k) for k in ("read", "list", "write", "copy", "rm")} == {
                "read": "1", "list": "1", "write": "1", "copy": "1", "rm": "1"}, out
            # the grader's exec, under the grader's profile, reads them, untouched
            out, err, end = await sh(b, "ans", "cat /answers/key.txt", trusted=True)
            assert (out, end.exit_code) == ("42\n", 0), (out, err, end)
            evs = await _apparmor_events(node, "ans", want=3)
            paths = {e.path for e in evs}
            assert "/answers/key.txt" in paths and "/answers/" in paths | {
                p + "/" for p in paths if p}, evs
            assert all(e.detail["profile"] == "edged-sbx-ans" for e in evs), evs
            assert {e.detail["operation"] for e in evs} >= {"open"}, evs
        finally:
            await b.destroy("ans")
        listing = (Path(apparmor.SECURITYFS) / "profiles").read_text()
        assert "-ans " not in listing, "the sandbox's profiles outlived it"

    run(body)


def test_apparmor_alone_stops_writes_to_protected_binaries(node: Node, rootfs: Path) -> None:
    b = node.backend
    sid = "aa-alone"

    async def without() -> None:
        await b.create(spec(rootfs, sid))
        try:
            assert b._get(sid).policy is not None
            assert b._get(sid).policy.apparmor_profile is None  # type: ignore[union-attr]
            feats = await b.probe()
            assert feats["apparmor"] == {"kernel": False, "parser": feats["apparmor"]["parser"]}
        finally:
            await b.destroy(sid)

    if not HAS_APPARMOR:
        run(without)
        return
    victim = Path("/usr/lib") / f"edged-redteam-{os.getpid()}"
    created = Path("/usr/lib") / f"edged-redteam-new-{os.getpid()}"
    workload, _ = apparmor.profile_names(sid)
    change = ("import os, sys; open('/proc/self/attr/apparmor/exec', 'w')"
              f".write('exec {workload}'); os.execv('/bin/sh', ['sh', '-c', sys.argv[1]])")
    script = (f"cat /proc/self/attr/current; echo evil > {victim}; echo write=$?;"
              f" rm -f {victim}; echo rm=$?; touch {created}; echo create=$?")

    async def body() -> None:
        await b.create(spec(rootfs, sid))
        victim.write_text("original\n")
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", change, script, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
            out_b, err_b = await proc.communicate()
            out = out_b.decode()
            assert out.splitlines()[0] == f"{workload} (enforce)", (out, err_b)
            got = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
            assert got == {"write": "2", "rm": "1", "create": "1"}, (out, err_b)
            assert victim.read_text() == "original\n" and not created.exists()
            evs = await _apparmor_events(node, sid, want=3)
            assert {e.path for e in evs} >= {str(victim), str(created)}, evs
            assert all(e.detail["denied"] for e in evs), evs
        finally:
            victim.unlink(missing_ok=True)
            created.unlink(missing_ok=True)
            await b.destroy(sid)

    run(body)


def test_signalling_sbx_init_through_a_pidfd_is_denied(node: Node, rootfs: Path) -> None:
    b = node.backend

    async def body() -> None:
        await b.create(spec(rootfs, "sig"))
        try:
            pid = b._get("sig").pid
            out, err, end = await execv(b, "sig", ("/usr/bin/attack", "ctl"))
            assert end.exit_code == 0, err
            res = results(out)
            assert res["procfd_signal"] in ("EPERM", "EACCES"), res
            assert b._get("sig").pid == pid and os.path.exists(f"/proc/{pid}")
            out, _, end = await sh(b, "sig", "echo alive")
            assert out == "alive\n"
            if HAS_APPARMOR and landlock.abi() < 6:
                # AppArmor decided (no Landlock signal scoping here) and it is recorded
                evs = await _apparmor_events(node, "sig")
                assert any(e.detail["operation"] == "signal"
                           and e.detail.get("peer") == "unconfined" for e in evs), evs
        finally:
            await b.destroy("sig")

    run(body)


def test_the_workload_reads_its_netns_over_netlink(node: Node, rootfs: Path) -> None:
    """NETLINK_ROUTE is opened as a raw socket by busybox's and iproute2's ``ip`` and by
    glibc (getifaddrs; getaddrinfo with AI_ADDRCONFIG): the profile allows it, while raw IP
    and packet sockets stay denied (tests/security/test_host_attacks.py). Its old bare
    ``deny network raw`` denied netlink too: ``ip link`` printed nothing in every sandbox of
    an AppArmor node (found in the node VM)."""
    b = node.backend

    async def body() -> None:
        await b.create(spec(rootfs, "nl"))
        try:
            out, err, end = await sh(b, "nl", "ip -o link; ip -o addr")
            assert end.exit_code == 0, (out, err)
            lines = out.splitlines()
            assert lines and lines[0].startswith("1: lo: <LOOPBACK,UP"), (out, err)
            assert any(" lo " in x and "inet 127.0.0.1/8" in x for x in lines), (out, err)
            if HAS_APPARMOR:
                assert not await _apparmor_events(node, "nl", bound_s=2.0)
        finally:
            await b.destroy("nl")

    run(body)
