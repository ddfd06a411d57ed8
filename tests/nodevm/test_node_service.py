"""edged as a node runs it (inside the node VM only, see conftest.py): the wheel installed
into /opt/edged, edged.service enabled and started by systemd (cgroup v2, Delegate=yes),
AppArmor enforcing. A sandbox through the service's socket: its processes in cgroups
beneath the service's own, under its AppArmor profile in enforce mode, its layer mounted
from a loop device where EROFS has no file-backed mounts (Linux < 6.12)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from edged.client import Sandbox
from layerfs import mount
from tests.edged.backends.container.conftest import busybox_tree  # noqa: F401 (fixture)

SOCKET = "/run/edged/edged.sock"
pytestmark = [pytest.mark.root, pytest.mark.mount]


def _systemctl(*args: str) -> str:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True).stdout.strip()


def _main_pid() -> int:
    return int(_systemctl("show", "-p", "MainPID", "--value", "edged"))


def test_the_service_runs_delegated_on_cgroup_v2() -> None:
    assert _systemctl("is-enabled", "edged") == "enabled"
    assert _systemctl("is-active", "edged") == "active"
    assert _systemctl("show", "-p", "Delegate", "--value", "edged") == "yes"
    assert os.statvfs("/sys/fs/cgroup") and Path("/sys/fs/cgroup/cgroup.controllers").exists()
    cg = Path(f"/proc/{_main_pid()}/cgroup").read_text().strip()
    # v2 only ("0::"), beneath the service's cgroup: the daemon moved itself into a leaf so
    # that its sandboxes' cgroups can have controllers ("no internal processes")
    assert cg.startswith("0::/system.slice/edged.service/"), cg
    node = json.loads(subprocess.run(["/opt/edged/bin/edged", "node", "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    feats = json.dumps(node)
    assert '"v2"' in feats, node


def test_a_sandbox_through_the_service(busybox_tree: Path, tmp_path: Path) -> None:  # noqa: F811
    built = subprocess.run(["/opt/edged/bin/layerfs", "build", str(busybox_tree), "--kind",
                            "base", "--json"], capture_output=True, text=True, check=True)
    digest = json.loads(built.stdout)["digest"]
    with Sandbox.create(layers=[digest], id="nodevm-svc", socket=SOCKET,
                        env={"PATH": "/bin"}) as sbx:
        r = sbx.exec(["cat", "/proc/self/attr/current", "/proc/self/cgroup"])
        assert r.exit_code == 0, r
        label, cgroup = r.stdout.splitlines()[:2]
        assert label == "edged-sbx-nodevm-svc (enforce)", r.stdout
        assert cgroup.startswith("0::/"), cgroup  # its own cgroup namespace
        profiles = Path("/sys/kernel/security/apparmor/profiles").read_text()
        assert "edged-sbx-nodevm-svc (enforce)" in profiles
        procs = [p for p in Path("/sys/fs/cgroup/system.slice/edged.service").rglob(
            "cgroup.procs") if "nodevm-svc" in str(p)]
        assert any(p.read_text().split() for p in procs), procs
        erofs = [line.split() for line in Path("/proc/mounts").read_text().splitlines()
                 if line.split()[2] == "erofs"]
        assert erofs, "the layer is not mounted"
        if not mount.erofs_file_backed():
            assert all(m[0].startswith("/dev/loop") for m in erofs), erofs
    profiles = Path("/sys/kernel/security/apparmor/profiles").read_text()
    assert "edged-sbx-nodevm-svc " not in profiles, "the profile outlived its sandbox"
