"""Done-when 1: overwrite, truncate, rename over, unlink, chmod or bind-mount over protected
binaries (/bin/busybox, /bin/sh, /usr/bin/attack, the symlinked /lib) fail, even as sandbox
root; then a grader exec runs the pristine binary.

Layers: /bin and /usr are read-only bind mounts the sandbox cannot remount (no CAP_SYS_ADMIN;
locked in any user namespace it makes), Landlock denies the same writes, seccomp denies the
mount calls. Recorded: the seccomp denials (mount, umount2, unshare). Not recorded: the EROFS
and EACCES answers of the read-only mounts and of Landlock (Landlock reports denials only
through audit, which the daemon cannot read here).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from edged.backends.container import confinement
from edged.errors import InvalidState
from edged.security import apparmor
from tests.security.conftest import (
    Node,
    assert_all_failed,
    denied_syscalls,
    execv,
    results,
    run,
    sh,
    spec,
)

pytestmark = [pytest.mark.root, pytest.mark.mount]

ATTEMPTS = {"open_write", "open_trunc", "truncate", "rename_over", "unlink", "chmod",
            "bind_over", "remount_rw", "umount", "unshare_userns"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_protected_binaries_survive_and_grader_runs_pristine(node: Node, rootfs: Path) -> None:
    b, ledger = node.backend, node.ledger
    want = {"/bin/busybox": _sha(rootfs / "bin" / "busybox"),
            "/usr/bin/attack": _sha(rootfs / "usr" / "bin" / "attack")}

    async def body() -> None:
        await b.create(spec(rootfs, "prot"))
        try:
            for target in ("/bin/sh", "/bin/busybox", "/usr/bin/attack"):
                out, err, end = await execv(b, "prot", ("/usr/bin/attack", "protect", target))
                assert end.exit_code == 0, err
                res = results(out)
                assert_all_failed(res, ATTEMPTS)
                # the read-only mount answers first for writes; seccomp for mount calls
                assert res["open_write"] in ("EROFS", "EACCES", "ETXTBSY")  # ETXTBSY: itself
                assert res["bind_over"] == "EPERM" and res["unshare_userns"] == "EPERM"
            # /lib is a symlink at the top (merged /usr): no mount can cover it; Landlock does
            out, err, end = await sh(b, "prot", "rm /lib; echo rm=$?; ln -sfn /tmp /lib;"
                                     " echo ln=$?; echo x > /lib/libc.so; echo w=$?;"
                                     " readlink /lib")
            assert "rm=1" in out and "ln=1" in out and "w=1" in out, (out, err)
            assert out.strip().endswith("usr/lib")
            # the loader's preload list (absent): cannot be created
            out, err, end = await sh(b, "prot", "echo /tmp/evil.so > /etc/ld.so.preload;"
                                     " echo rc=$?; ls /etc/ld.so.preload")
            assert "rc=1" in out and "/etc/ld.so.preload" not in out, (out, err)
            # the grader: a trusted exec, in a Landlock domain of its own
            out, err, end = await sh(b, "prot", "sha256sum /bin/busybox /usr/bin/attack;"
                                     " /bin/sh -c 'echo grader ran'", trusted=True)
            assert end.exit_code == 0, err
            got = dict(reversed(line.split()) for line in out.splitlines()[:2])
            assert got == want
            assert "grader ran" in out
        finally:
            await b.destroy("prot")

    run(body)
    assert {"mount", "umount2", "unshare"} <= denied_syscalls(ledger, "prot")
    assert "protected_path_tampered" not in {e.kind for e in ledger.events("prot")}


def test_grader_refused_when_a_layer_was_broken(node: Node, rootfs: Path) -> None:
    """If a protected path ever reaches the upper (a layer broken), the grader does not run
    and the ledger says which path. Simulated by writing into the upper from the host."""
    b, ledger = node.backend, node.ledger

    async def body() -> None:
        await b.create(spec(rootfs, "tamper"))
        try:
            out, _, end = await sh(b, "tamper", "echo ok", trusted=True)
            assert out == "ok\n"
            pid = b._get("tamper").pid
            scratch = confinement.scratch_path(pid)
            assert scratch is not None
            evil = Path(scratch, "upper", "bin")
            evil.mkdir()
            (evil / "busybox").write_text("#!/bin/sh\necho pwned\n")
            with pytest.raises(InvalidState, match="/bin"):
                await sh(b, "tamper", "echo grader", trusted=True)
            # an untrusted exec still runs (the agent's own business)
            _, _, end = await sh(b, "tamper", "true")
            assert end.exit_code is not None
        finally:
            await b.destroy("tamper")

    run(body)
    hits = [e for e in ledger.events("tamper") if e.kind == "protected_path_tampered"]
    assert [e.path for e in hits] == ["/bin"]  # the protected entry the change lies under


def test_protected_mounts_are_read_only_even_for_a_new_user_namespace(
        node: Node, rootfs: Path, tmp_path: Path) -> None:
    """With the seccomp layer off (a profile allowing unshare and mount), a user namespace
    made by the workload still cannot remount, unmount or write the protected mounts: the
    kernel locks mounts copied into a less privileged namespace, and Landlock refuses mount
    changes from inside a domain. Where the kernel has AppArmor (the 6.1 node VM), the
    sandbox's profile stops it a step earlier: the new user namespace's mount namespace
    needs CAP_SYS_ADMIN in it, and the profile's ``deny capability sys_admin`` holds in every
    namespace (AppArmor mediates the capability, not the namespace), so ``unshare`` fails."""
    prof = tmp_path / "allow-userns.json"
    doc = json.loads((Path(__file__).resolve().parents[2] / "profiles" / "seccomp" /
                      "default.json").read_text())
    doc["rules"] = [r for r in doc["rules"]
                    if not set(r.get("names", [])) & {"unshare", "mount", "umount2"}]
    prof.write_text(json.dumps(doc))
    b = node.backend

    async def body() -> None:
        await b.create(dataclasses.replace(spec(rootfs, "userns"), seccomp_profile=str(prof)))
        try:
            out, err, _ = await execv(b, "userns", ("/usr/bin/attack", "userns", "/bin"))
            res = results(out)
            if apparmor.probe()["kernel"]:
                assert res == {"unshare": "EPERM"}, (out, err)
                return
            assert res.get("unshare") == "SUCCEEDED", (out, err)  # the profile allowed it
            assert_all_failed({k: v for k, v in res.items() if k != "unshare"},
                              {"ns_remount_rw", "ns_umount", "ns_write"})
        finally:
            await b.destroy("userns")

    run(body)
    assert not (rootfs / "bin" / "x").exists()
    assert os.path.islink(rootfs / "lib")

