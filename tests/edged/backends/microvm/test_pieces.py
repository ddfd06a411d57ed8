"""The microVM backend's pieces without a VM: module order from modinfo, the initramfs's
cpio format, the boot record, the QEMU command line, the QMP client."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from pathlib import Path

import pytest

from edged.backends.microvm import boot, disks, guestkit, qemu
from edged.backends.microvm.guest import GuestVm
from edged.backends.microvm.qmp import Qmp, QmpError
from edged.backends.microvm.template import Template, Templates
from edged.backends.microvm.vmm import Disk, Machine
from edged.errors import BackendError


def _fake_modules(tmp_path: Path, deps: dict[str, list[str]],
                  monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "kernel" / "drivers"
    d.mkdir(parents=True)
    for name in deps:
        (d / f"{name}.ko").write_bytes(b"\x7fELF")
    monkeypatch.setattr(guestkit, "module_depends", lambda ko: deps[ko.name[:-3]])
    return tmp_path / "kernel"


def test_module_closure_loads_dependencies_first(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    deps = {"virtio_ring": [], "virtio": ["virtio_ring"], "virtio_blk": ["virtio", "virtio_ring"],
            "virtio_mmio": ["virtio", "virtio_ring"], "erofs": ["libcrc32c"], "libcrc32c": []}
    moddir = _fake_modules(tmp_path, deps, monkeypatch)
    (tmp_path / "modules.builtin").write_text("kernel/fs/ext4/ext4.ko\n")
    order = [p.name for p in guestkit.module_closure(moddir, ["virtio_mmio", "erofs", "ext4"])]
    # a plain list order (virtio before virtio_ring) is what failed to load in the guest
    assert order == ["virtio_ring.ko", "virtio.ko", "virtio_mmio.ko", "libcrc32c.ko",
                     "erofs.ko"]
    late = guestkit.module_closure(moddir, ["virtio_blk"], loaded=["virtio", "virtio_ring"])
    assert [p.name for p in late] == ["virtio_blk.ko"]


def test_module_closure_names_a_missing_module_and_a_cycle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moddir = _fake_modules(tmp_path, {"a": ["b"], "b": ["a"], "c": ["nope"]}, monkeypatch)
    with pytest.raises(guestkit.GuestKitError, match="cycle"):
        guestkit.module_closure(moddir, ["a"])
    with pytest.raises(guestkit.GuestKitError, match="module nope"):
        guestkit.module_closure(moddir, ["c"])


def _parse_newc(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    out: dict[str, tuple[int, bytes, tuple[int, int]]] = {}
    off = 0
    while True:
        assert data[off:off + 6] == b"070701"
        f = [int(data[off + 6 + 8 * i: off + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rmaj, rmin, namesize = f[1], f[6], f[9], f[10], f[11]
        name = data[off + 110: off + 110 + namesize - 1].decode()
        off += 110 + namesize
        off += -off % 4
        body = data[off: off + size]
        off += size
        off += -off % 4
        if name == "TRAILER!!!":
            assert off == len(data)
            return out
        out[name] = (mode, body, (rmaj, rmin))


def test_initramfs_is_deterministic_newc(tmp_path: Path) -> None:
    mods = tmp_path / "m"
    mods.mkdir()
    (mods / "virtio.ko").write_bytes(b"v" * 5)
    (mods / "virtio_blk.ko").write_bytes(b"b" * 7)
    init = tmp_path / "sbx-init"
    init.write_bytes(b"\x7fELF init")
    kit = guestkit.GuestKit(tmp_path, "6.1.0-x", tmp_path / "vmlinuz",
                            (mods / "virtio.ko",), (mods / "virtio_blk.ko",))
    data = guestkit.initramfs_bytes(kit, init)
    assert data == guestkit.initramfs_bytes(kit, init)
    entries = _parse_newc(data)
    assert entries["init"][0] == 0o100755 and entries["init"][1] == b"\x7fELF init"
    assert entries["dev/console"][0] == 0o020600 and entries["dev/console"][2] == (5, 1)
    assert entries["lib/modules/virtio_blk.ko"][1] == b"b" * 7
    assert entries["etc/sbx/modules.early"][1] == b"/lib/modules/virtio.ko\n"
    assert entries["etc/sbx/modules.late"][1] == b"/lib/modules/virtio_blk.ko\n"
    p1 = guestkit.build_initramfs(kit, init, tmp_path / "out")
    init.write_bytes(b"\x7fELF changed")
    p2 = guestkit.build_initramfs(kit, init, tmp_path / "out")
    assert p1 != p2 and p1.is_file() and p2.is_file()  # a new sbx-init, a new template key


def test_cmdline_has_the_guest_mode_and_tsc() -> None:
    c = guestkit.cmdline(2299998)
    assert c.endswith(" -- -g") and "tsc_early_khz=2299998" in c and "panic=-1" in c
    assert "reboot=t" in c
    assert "acpi=off" not in c and "pit=off" not in c


def test_boot_record_layout_and_checks() -> None:
    s = boot.BootSpec(nlayers=3, hostname="h", realtime_ns=5, memory_max=1 << 20,
                      pids_max=9, caps=0b101, protected=("/usr", "/etc/passwd"),
                      grader_paths=("/opt",), landlock=b"LL", seccomp=b"SECC")
    rec = boot.boot_record(s)
    f = boot.BOOT.unpack_from(rec)
    assert f[0] == b"SBXBOOT1" and f[1] == len(rec) - boot.BOOT.size and f[2] == 3
    assert f[3:8] == (5, 1 << 20, 0b101, 9, boot.FLAG_CONFINE_CAPS)
    assert f[8:11] == (2, 4, len(b"h\0/usr:/etc/passwd\0/opt\0"))
    assert rec[boot.BOOT.size:] == b"LLSECCh\0/usr:/etc/passwd\0/opt\0"
    assert boot.BOOT.unpack_from(boot.boot_record(
        boot.BootSpec(nlayers=1, hostname="h", realtime_ns=0)))[7] == 0  # caps: keep all
    for bad in (dict(nlayers=0), dict(nlayers=17), dict(protected=("rel",)),
                dict(protected=("/a:b",)), dict(hostname="")):
        with pytest.raises(ValueError):
            boot.boot_record(boot.BootSpec(**{"nlayers": 1, "hostname": "h",  # type: ignore[arg-type]
                                              "realtime_ns": 0, **bad}))
    with pytest.raises(ValueError):
        boot.parse_ready(b"SBXNOPE!" + bytes(16))
    assert boot.parse_ready(boot.READY.pack(b"SBXREADY", 1, 0, 77)) == 77


def test_qemu_argv() -> None:
    m = Machine("/k", "/i", "console=ttyS0", memory_mib=256, ndisks=2, tb_size_mib=16)
    disks = [Disk("/layer.erofs", "sbx-l0"), Disk("/upper.img", "sbx-upper", read_only=False)]
    fds = qemu.Fds(5, 6, 7, 8, 9, (20, 21))
    a = qemu.argv(m, disks, Path("/mem"), False, fds)
    s = " ".join(a)
    assert "-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny" in s
    assert "mem-path=/mem,share=off" in s and "tcg,tb-size=16" in s
    # every file is an inherited fd: the VMM needs access to no path of ours
    assert "-add-fd fd=20,set=10" in s and "-add-fd fd=21,set=11" in s
    assert "driver=file,filename=/dev/fdset/10,node-name=d0,read-only=on" in s
    assert "-kernel /proc/self/fd/8 -initrd /proc/self/fd/9" in s
    assert "-add-fd fd=7,set=1 -chardev file,id=con,path=/dev/fdset/1" in s
    assert "/layer.erofs" not in s and "/upper.img" not in s
    assert "virtio-blk-device,drive=d1,serial=sbx-upper" in s
    assert "-incoming" not in a and "-no-reboot" in a
    assert "socket,id=qmp,fd=5,server=on" in s and "socket,id=ctl,fd=6,server=on" in s
    t = qemu.argv(m, [Disk(None, "p0"), Disk(None, "p1")], 30, True,
                  qemu.Fds(5, 6, 7, 8, 9, (None, None)), incoming=True)
    assert "driver=null-co" in " ".join(t) and t[-2:] == ["-incoming", "defer"]
    assert "mem-path=/proc/self/fd/30,share=on" in " ".join(t)
    assert "memory-backend-ram" in " ".join(qemu.argv(m, disks, None, False, fds))
    with pytest.raises(ValueError):
        qemu.argv(m, disks[:1], Path("/mem"), False, fds)
    with pytest.raises(ValueError):
        qemu.argv(m, disks, Path("/mem"), False, qemu.Fds(5, 6, 7, 8, 9, (20, None)))
    assert m.key() == Machine("/k", "/i", "console=ttyS0", memory_mib=256, ndisks=2,
                              tb_size_mib=16).key()
    assert m.key() != Machine("/k", "/i2", "console=ttyS0", memory_mib=256, ndisks=2).key()


class _FakeQemu(threading.Thread):
    """A QMP server: greets, answers commands, emits an event, records passed fds."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(str(path))
        self.srv.listen(1)
        self.fds: list[int] = []

    def run(self) -> None:
        c, _ = self.srv.accept()
        with c:
            self._serve(c)

    def _serve(self, c: socket.socket) -> None:
        c.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\n')
        buf = b""
        while True:
            msg, fds, _f, _a = socket.recv_fds(c, 4096, 4)
            if not msg:
                return
            self.fds += fds
            buf += msg
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                cmd, rid = req["execute"], req["id"]
                if cmd == "fail":
                    c.sendall(json.dumps({"error": {"class": "GenericError", "desc": "no"},
                                          "id": rid}).encode() + b"\n")
                    continue
                if cmd == "stop":
                    c.sendall(b'{"event": "STOP", "data": {}}\n')
                c.sendall(json.dumps({"return": {"cmd": cmd}, "id": rid}).encode() + b"\n")


def test_qmp_client(tmp_path: Path) -> None:
    srv = _FakeQemu(tmp_path / "q.sock")
    srv.start()

    async def go() -> None:
        q = await Qmp.connect(str(tmp_path / "q.sock"))
        assert await q.execute("query-status") == {"cmd": "query-status"}
        with pytest.raises(QmpError, match="no") as ei:
            await q.execute("fail")
        assert ei.value.cls == "GenericError"
        await q.execute("stop")
        assert (await q.wait_event("STOP", 1))["event"] == "STOP"
        r, w = os.pipe()
        try:
            await q.execute("getfd", {"fdname": "x"}, fds=[r])
        finally:
            os.close(r)
            os.close(w)
        q.close()

    asyncio.run(go())
    srv.join(5)
    assert len(srv.fds) == 1
    for fd in srv.fds:
        os.close(fd)
    srv.srv.close()


def test_qmp_connect_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(QmpError, match="QMP"):
        asyncio.run(Qmp.connect(str(tmp_path / "none.sock"), timeout=1))


def test_copy_upper_keeps_the_bytes_and_the_holes(tmp_path: Path) -> None:
    """A clone's upper is the template's copied extent by extent: the same bytes and size,
    holes left holes (a 1 GiB disk costs what its template wrote); a failed copy leaves
    no file."""
    src = tmp_path / "t.img"
    with open(src, "wb") as f:
        f.truncate(1 << 30)
        for off in (0, 5 << 20, (1 << 30) - 4096):
            f.seek(off)
            f.write(os.urandom(4096) * 3 if off < (1 << 29) else os.urandom(4096))
    dst = tmp_path / "c.img"
    disks.copy_upper(src, dst)
    assert dst.stat().st_size == 1 << 30
    assert dst.stat().st_blocks * 512 <= 1 << 20
    with open(src, "rb") as a, open(dst, "rb") as b:
        for off in (0, 5 << 20, (1 << 30) - 4096, 300 << 20):
            a.seek(off)
            b.seek(off)
            assert a.read(3 * 4096) == b.read(3 * 4096)
    with pytest.raises(BackendError):  # never over an existing file
        disks.copy_upper(src, dst)
    with pytest.raises(BackendError):
        disks.copy_upper(tmp_path / "missing.img", tmp_path / "never.img")
    assert not (tmp_path / "never.img").exists()


def test_clone_refuses_an_upper_size_not_the_templates(tmp_path: Path) -> None:
    """The clone's upper is a copy of its template's, so its size is the template's: any
    other is refused before anything is started or made."""
    m = Machine("/k", "/i", "c", ndisks=2, upper_bytes=64 << 20)
    t = Template(m, tmp_path / "t", 1.0)
    sb = boot.BootSpec(nlayers=1, hostname="h", realtime_ns=0)
    with pytest.raises(BackendError, match="upper disk of"):
        asyncio.run(GuestVm.clone(Templates(qemu.QemuVmm(), tmp_path, tmp_path), t,
                                  ["/l.erofs"], tmp_path / "run", sb, disk_bytes=1 << 30))
    assert not (tmp_path / "run").exists()
