"""Fixtures for real container sandboxes: a busybox-static rootfs tree, a backend on a
private state dir (its own cgroup subtree), and a leak check after every test."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.backends.container import ContainerBackend
from tests.busybox import install_busybox


def _is_static(path: str) -> bool:
    out = subprocess.run(["file", "-L", path], capture_output=True, text=True).stdout
    return "statically linked" in out or "static-pie" in out


@pytest.fixture(scope="session")
def busybox_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rootfs directory: /bin/busybox (static) and a symlink per applet."""
    root = install_busybox(tmp_path_factory.mktemp("busybox-root"))
    (root / "etc").mkdir()
    (root / "etc" / "hostname").write_text("layer\n")
    os.chmod(root, 0o755)
    return root


def sandbox_processes(backend: ContainerBackend) -> list[int]:
    """Host pids of processes running our sbx-init binary in this backend's cgroups (other
    backends on the machine, e.g. other tests running at the same time, are not counted)."""
    init = str((backend.bin_dir / "sbx-init").resolve())
    mark = f"/{backend.cgroups.subdir}/"
    out = []
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                if (os.readlink(f"/proc/{e.name}/exe").startswith(init)
                        and mark in Path(f"/proc/{e.name}/cgroup").read_text()):
                    out.append(int(e.name))
            except OSError:
                pass
    return out


def cgroup_dirs(backend: ContainerBackend) -> list[str]:
    out = []
    for p in backend.cgroups.all_parents():
        if p.exists():
            out += [str(d) for d, _s, _f in os.walk(p) if Path(d) != p]
    return out


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "state"
    yield d
    # whatever a test left (it should leave nothing): tear it down, then insist
    assert_left_clean(ContainerBackend(d))


def assert_left_clean(b: ContainerBackend) -> None:
    """Tear down whatever a test left on ``b`` (it should leave nothing), remove the
    backend's parent cgroups, then fail if there was anything to tear down."""
    removed = asyncio.run(b.cleanup_leftovers(set()))
    leftover_cg = cgroup_dirs(b)
    for p in b.cgroups.all_parents():
        if p.exists():
            p.rmdir()
    assert not removed, f"test left sandboxes behind: {removed}"
    assert not leftover_cg, f"test left cgroups behind: {leftover_cg}"


@pytest.fixture
def backend(state_dir: Path) -> ContainerBackend:
    b = ContainerBackend(state_dir)
    if not (b.bin_dir / "edged-spawner").exists():
        pytest.skip("edged/_bin not built: run `pip install -e .`")
    return b
