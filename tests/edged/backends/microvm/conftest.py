"""Fixtures for real microVMs (marked ``vm``): the guest kit made by scripts/install.sh, an
initramfs with this checkout's sbx-init, busybox layers as EROFS image files, a template
store shared by the session's tests, and a check that no QEMU of a test is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import edged
from edged.backends.microvm import guestkit
from edged.backends.microvm.backend import MicroVmBackend
from edged.backends.microvm.qemu import QemuVmm
from edged.backends.microvm.template import Templates
from edged.backends.microvm.vmm import Machine
from layerfs.sources.directory import load_directory
from layerfs.writer import write_image
from tests.busybox import install_busybox


@contextlib.contextmanager
def busy_loops() -> Iterator[None]:
    """A busy loop per CPU on the host (a loaded node) while the block runs, killed after."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


SBX_INIT = Path(edged.__file__).resolve().parent / "_bin" / "sbx-init"
#: The user the tests' VMMs run as: unprivileged, below the container uid grid (1 << 30).
VMM_UID = 900_000_000 + os.getpid() % 100_000


@pytest.fixture(scope="session")
def kit() -> guestkit.GuestKit:
    try:
        return guestkit.load()
    except guestkit.GuestKitError as e:
        pytest.skip(f"no guest kit: {e}")


@pytest.fixture(scope="session")
def vm_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("i13vm")


@pytest.fixture(scope="session")
def initrd(kit: guestkit.GuestKit, vm_root: Path) -> Path:
    return guestkit.build_initramfs(kit, SBX_INIT, vm_root / "initrd")


def make_layer(root: Path, out: Path, files: dict[str, str] | None = None) -> Path:
    """A busybox rootfs (+ ``files``: path -> text) written as an EROFS image by layerfs."""
    install_busybox(root)
    for d in ("etc", "tmp", "usr", "root"):
        (root / d).mkdir(exist_ok=True)
    for rel, text in (files or {}).items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    write_image(load_directory(root), out)
    return out


@pytest.fixture(scope="session")
def layer(vm_root: Path) -> Path:
    return make_layer(vm_root / "bb", vm_root / "bb.erofs", {"etc/hostname": "layer\n"})


@pytest.fixture(scope="session")
def machine(kit: guestkit.GuestKit, initrd: Path) -> Machine:
    """256 MiB, 1 vCPU, TCG, one layer disk + the upper (64 MiB)."""
    return Machine(str(kit.kernel), str(initrd), guestkit.cmdline(), memory_mib=256, ndisks=2,
                   upper_bytes=64 << 20)


@pytest.fixture
def templates(vm_root: Path) -> Iterator[Templates]:
    """A template store shared by the session (the first test pays the cold boot)."""
    t = Templates(QemuVmm(run_as=(VMM_UID, VMM_UID)), vm_root / "templates", vm_root / "run")
    yield t
    t.close()


def qemu_pids(mark: str) -> list[int]:
    """Pids of QEMU processes whose command line mentions ``mark`` (a test's directory)."""
    out = []
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{e.name}/cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" in cmd and mark.encode() in cmd:
            out.append(int(e.name))
    return out


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory for the test's VMs; afterwards no QEMU of it may be left."""
    d = tmp_path / "vms"
    d.mkdir()
    yield d
    left = qemu_pids(str(d))
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"QEMU processes left running: {left}"


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (AF_UNIX paths are limited to 108 bytes; pytest's
    tmp_path can be longer than a VM's sockets allow)."""
    d = Path(tempfile.mkdtemp(prefix="i13-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def vmm_processes(run_root: Path) -> list[int]:
    """Pids of VMMs whose guest name (their run directory) is under ``run_root``."""
    return qemu_pids(str(run_root) + "/")


def assert_left_clean(b: MicroVmBackend) -> None:
    """Tear down whatever a test left on ``b`` (it should leave nothing), remove its parent
    cgroups, then fail if anything was left: a sandbox, a VMM, a disk or snapshot file, a
    socket, a cgroup, a uid claim."""
    removed = asyncio.run(b.cleanup_leftovers(set()))
    left_vmm = vmm_processes(b.run_root)
    for pid in left_vmm:
        os.kill(pid, 9)
    cgs = [str(d) for p in b.cgroups.all_parents() if p.exists()
           for d, _s, _f in os.walk(p) if Path(d) != p]
    for p in b.cgroups.all_parents():
        if p.exists():
            p.rmdir()
    files = [str(p) for d in (b.sandboxes_dir, b.vms_dir, b.pool_run, b.pool_data)
             if d.exists() for p in d.rglob("*")]
    claims = [c for c in (b.uid_slots.read(int(e.name)) for e in os.scandir(b.uid_slots.dir)
                          if e.name.isdigit())
              if b.uid_slots.ours(c)] if b.uid_slots.dir.exists() else []
    assert not removed, f"test left sandboxes behind: {removed}"
    assert not left_vmm, f"test left VMMs running: {left_vmm}"
    assert not cgs, f"test left cgroups behind: {cgs}"
    assert not files, f"test left files behind: {files}"
    assert not claims, f"test left uid claims behind: {claims}"


@pytest.fixture
def make_backend(short_dir: Path, vm_root: Path, kit: guestkit.GuestKit,
                 machine: Machine) -> Iterator[Callable[..., MicroVmBackend]]:
    """``make(**kw)``: a microVM backend (TCG) on private run and state dirs under one short
    directory, sharing the session's templates; every one is checked for leftovers after
    the test."""
    made: list[MicroVmBackend] = []

    def make(**kw: Any) -> MicroVmBackend:
        kw.setdefault("accel", "tcg")
        b = MicroVmBackend(short_dir / "run", short_dir / "state", cache_dir=vm_root, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        asyncio.run(b.close())
    if made:
        assert_left_clean(made[-1])
