"""Real microVMs: a template booted once, clones with their own disks, the guest's sbx-init
answering over virtio-serial, and what a guest may and may not do (marked ``vm``)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from pathlib import Path

import pytest

from edged.backends.microvm import accel, boot
from edged.backends.microvm.guest import GuestVm
from edged.backends.microvm.qemu import QemuVmm
from edged.backends.microvm.template import Templates, console_tail
from edged.backends.microvm.vmm import Machine
from edged.errors import BackendError
from edged.security.confine import WORKLOAD_CAPS

from .conftest import VMM_UID, busy_loops, make_layer, qemu_pids, run


def qemu_pids_of(d: Path) -> list[int]:
    return qemu_pids(str(d))

pytestmark = [pytest.mark.vm, pytest.mark.root]


def spec(name: str = "sbx", **kw: object) -> boot.BootSpec:
    return boot.BootSpec(nlayers=1, hostname=name, realtime_ns=time.time_ns(),
                         memory_max=160 << 20, pids_max=256, **kw)  # type: ignore[arg-type]


async def _clone(templates: Templates, machine: Machine, layer: Path, d: Path,
                 name: str = "sbx", **kw: object) -> GuestVm:
    t = await templates.get(machine)
    return await GuestVm.clone(templates, t, [str(layer)], d, spec(name, **kw),
                               disk_bytes=64 << 20)


def test_clone_runs_commands_in_the_layer_rootfs(templates: Templates, machine: Machine,
                                                 layer: Path, run_dir: Path) -> None:
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a", name="guest-a")
        try:
            end, out, err = await g.run(["sh", "-c", "hostname; cat /etc/hostname; "
                                         "grep -c erofs /proc/mounts; date +%Y"])
            assert (end.reason, end.exit_code) == ("exited", 0), err
            host, layer_host, n_erofs, year = out.decode().split()
            assert host == "guest-a" and layer_host == "layer"
            # the lowers are mounted outside the sandbox's root: not in its mount table
            assert n_erofs == "0"
            # the clock was set from the host at boot (a clone has the template's)
            assert year == time.strftime("%Y")
            end, out, _ = await g.run(["sh", "-c", "echo hi > /tmp/f; cat /tmp/f; exit 3"])
            assert (end.reason, end.exit_code, out) == ("exited", 3, b"hi\n")
        finally:
            await g.destroy()
        assert not g.vm.alive()
        assert not (run_dir / "a").exists()

    run(go())


def test_clones_see_their_own_disks(templates: Templates, machine: Machine, layer: Path,
                                    run_dir: Path, tmp_path: Path) -> None:
    """The template's guest probed placeholders for the layers; each clone binds the files
    it was started with (two clones of one template, different layer files, at the same
    time). The upper the template's guest mounted is each clone's own copy: what one
    writes no other clone sees, and the template's file stays as it was."""
    other = make_layer(tmp_path / "other", tmp_path / "other.erofs",
                       {"etc/hostname": "other\n", "marker": "only in the other layer\n"})

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    async def go() -> None:
        t = await templates.get(machine)
        before = digest(t.upper)
        a, b = await asyncio.gather(_clone(templates, machine, layer, run_dir / "a"),
                                    _clone(templates, machine, other, run_dir / "b"))
        try:
            ra, rb = await asyncio.gather(a.run(["cat", "/etc/hostname"]),
                                          b.run(["cat", "/etc/hostname", "/marker"]))
            assert ra[1] == b"layer\n"
            assert rb[1] == b"other\nonly in the other layer\n"
            # what one writes the other does not see
            await a.run(["sh", "-c", "echo a > /written; sync"])
            end, _, _ = await b.run(["cat", "/written"])
            assert end.exit_code == 1
            assert digest(run_dir / "a" / "upper.img") != before  # a's own file took it
            c = await _clone(templates, machine, layer, run_dir / "c")
            try:  # a later clone starts from the template's upper, not from a's
                end, out, err = await c.run(["sh", "-c", "test ! -e /written && ls -A /tmp"])
                assert (end.exit_code, out) == (0, b""), err
            finally:
                await c.destroy()
        finally:
            await asyncio.gather(a.destroy(), b.destroy())
        assert digest(t.upper) == before

    run(go())


def test_a_prestarted_clone_runs_on_the_layers_bound_while_it_waited(
        templates: Templates, machine: Machine, layer: Path, run_dir: Path,
        tmp_path: Path) -> None:
    """A clone started ahead (VMM up, state loaded, guest waiting for its boot record, its
    layer disks placeholders) runs on the layer files bound under its placeholders at
    create: each of two such clones reads its own layer and writes only its own upper; a
    layer count that does not match the machine, or a layer that cannot be opened, fails
    typed and leaves no VMM and no directory."""
    other = make_layer(tmp_path / "other", tmp_path / "other.erofs",
                       {"etc/hostname": "other\n", "marker": "only in the other layer\n"})

    async def go() -> None:
        t = await templates.get(machine)
        va, vb = await asyncio.gather(GuestVm.prestart(templates, t, run_dir / "a"),
                                      GuestVm.prestart(templates, t, run_dir / "b"))
        await asyncio.sleep(0.5)  # waiting, as in a pool
        a, b = await asyncio.gather(
            GuestVm.from_prestarted(va, t, [str(layer)], run_dir / "a", spec("pa")),
            GuestVm.from_prestarted(vb, t, [str(other)], run_dir / "b", spec("pb")))
        try:
            ra, rb = await asyncio.gather(
                a.run(["sh", "-c", "cat /etc/hostname; hostname; echo a > /w; sync"]),
                b.run(["sh", "-c", "cat /etc/hostname /marker; test ! -e /w"]))
            assert (ra[0].exit_code, ra[1]) == (0, b"layer\npa\n"), ra
            assert (rb[0].exit_code, rb[1]) == (0, b"other\nonly in the other layer\n"), rb
            assert a.vm.pid == va.pid
        finally:
            await asyncio.gather(a.destroy(), b.destroy())
        for layers in ([], [str(tmp_path / "missing.erofs")]):
            v = await GuestVm.prestart(templates, t, run_dir / "c")
            with pytest.raises(BackendError):
                await GuestVm.from_prestarted(v, t, layers, run_dir / "c", spec("pc"))
            assert not v.alive()
            assert not (run_dir / "c").exists()

    run(go())


def test_upper_disk_is_size_limited(templates: Templates, machine: Machine, layer: Path,
                                    run_dir: Path) -> None:
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a")
        try:
            end, _, err = await g.run(["dd", "if=/dev/zero", "of=/big", "bs=1M", "count=200"],
                                      timeout_s=120)
            assert end.exit_code != 0 and b"No space left" in err
            # the guest goes on; the host file never grew past its size
            end, out, _ = await g.run(["sh", "-c", "rm /big; echo ok"])
            assert out == b"ok\n"
            assert os.stat(run_dir / "a" / "upper.img").st_size == 64 << 20
        finally:
            await g.destroy()

    run(go())


def test_workload_reaches_no_device_port_or_cgroup(templates: Templates, machine: Machine,
                                                   layer: Path, run_dir: Path) -> None:
    """The sandbox's /dev has no disk, console or control port; it cannot make one; kill -9
    -1 as guest root leaves sbx-init (PID 1) serving."""
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a", caps=WORKLOAD_CAPS)
        try:
            _, out, _ = await g.run(["ls", "/dev"])
            names = set(out.decode().split())
            assert names >= {"null", "zero", "urandom", "pts", "shm"}
            assert not {n for n in names if n.startswith(("vd", "vport", "ttyS", "hvc", "mem"))}
            end, _, _ = await g.run(["mknod", "/tmp/vda", "b", "254", "0"])
            assert end.exit_code != 0, "CAP_MKNOD must be gone"
            end, _, _ = await g.run(["sh", "-c", "ls /sys/fs/cgroup/cgroup.procs"])
            assert end.exit_code != 0, "the cgroup tree must not be in the sandbox"
            end, _, _ = await g.run(["mount", "-t", "tmpfs", "x", "/tmp"])
            assert end.exit_code != 0, "CAP_SYS_ADMIN must be gone"
            await g.run(["sh", "-c", "sleep 100 & sleep 100 & kill -9 -1"])
            end, out, _ = await g.run(["echo", "alive"])
            assert out == b"alive\n"
        finally:
            await g.destroy()

    run(go())


def test_guest_kernel_crash_ends_only_that_vm(templates: Templates, machine: Machine,
                                              layer: Path, run_dir: Path) -> None:
    async def go() -> None:
        a, b = await asyncio.gather(_clone(templates, machine, layer, run_dir / "a"),
                                    _clone(templates, machine, layer, run_dir / "b"))
        try:
            h = await a.start(["sh", "-c", "echo c > /proc/sysrq-trigger"])

            async def last_event() -> object:
                async for item in h.events():
                    last = item
                return last

            try:
                end = await asyncio.wait_for(last_event(), 60)
            except TimeoutError:
                pytest.fail(f"no end after the crash; alive={a.vm.alive()}; console: "
                            f"{console_tail(a.run_dir, 3000)!r}")
            assert end.reason == "killed"  # type: ignore[attr-defined]
            await asyncio.wait_for(a.vm.wait_exit(), 30)
            assert "Kernel panic - not syncing: sysrq triggered crash" in console_tail(
                a.run_dir, 20000)
            _, out, _ = await b.run(["echo", "still here"])
            assert out == b"still here\n"
        finally:
            await asyncio.gather(a.destroy(), b.destroy())

    run(go())


def test_bad_layer_fails_the_create_with_the_guests_reason(
        templates: Templates, machine: Machine, run_dir: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.erofs"
    junk.write_bytes(os.urandom(1 << 20))

    async def go() -> None:
        with pytest.raises(BackendError, match="mount erofs"):
            await _clone(templates, machine, junk, run_dir / "a")

    run(go())


def test_pause_to_a_snapshot_and_resume(templates: Templates, machine: Machine, layer: Path,
                                        run_dir: Path) -> None:
    """Pause ends the VMM (nothing left running) with the guest in a file; resume brings the
    same guest back: what it wrote, a process it left running, and an exec that was running
    at the pause (its output from before and after, its stdin, its end) are still there."""
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a")
        try:
            await g.run(["sh", "-c", "echo kept > /state; (sleep 1000 &) ; echo $(hostname)"])
            _, ps_before, _ = await g.run(["sh", "-c", "pidof sleep"])
            h = await g.conn.exec(("sh", "-c", "echo before; read x; echo after $x"),
                                  {"PATH": "/bin"}, stdin=True)
            events = h.events()
            assert await events.__anext__() == ("stdout", b"before\n")
            snap = run_dir / "a.snapshot"
            await g.pause(snap)
            assert not g.vm.alive() and not qemu_pids_of(run_dir / "a")
            assert snap.stat().st_size > 1 << 20  # the guest's RAM is in it
            stdin = asyncio.create_task(h.write_stdin(b"x\n"))  # waits for the resume
            await g.resume(templates.vmm, machine, snap)
            await stdin
            rest = [ev async for ev in events]
            assert rest[0] == ("stdout", b"after x\n"), rest
            assert (rest[-1].reason, rest[-1].exit_code) == ("exited", 0)  # type: ignore[union-attr]
            _, out, _ = await g.run(["sh", "-c", "cat /state; pidof sleep"])
            assert out == b"kept\n" + ps_before
        finally:
            await g.destroy()

    run(go())


def test_resume_by_a_new_client_ends_the_old_clients_execs(
        templates: Templates, machine: Machine, layer: Path, run_dir: Path) -> None:
    """A daemon restarted while its VM was paused has none of its execs: resumed ``fresh``,
    the guest's sbx-init sees its old client go and kills that client's execs (as a
    container's does when its daemon goes), keeping what runs on its own."""
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a")
        try:
            await g.run(["sh", "-c", "(sleep 1000 &)"])
            h = await g.start(["sh", "-c", "sleep 500"])
            assert h.pid > 0
            await g.pause()
            await g.resume(templates.vmm, machine, fresh=True)
            _, out, _ = await g.run(["sh", "-c", "ps -o args | grep -c '^sleep [15]00'"])
            assert out == b"1\n"  # sleep 1000 is left, sleep 500 was killed
            end, _, _ = await g.run(["echo", "ok"])
            assert end.exit_code == 0
        finally:
            await g.destroy()

    run(go())


def test_cold_boot_without_a_template(machine: Machine, layer: Path, run_dir: Path) -> None:
    async def go() -> None:
        g = await GuestVm.cold_boot(QemuVmm(run_as=(VMM_UID, VMM_UID)), machine,
                                    [str(layer)], run_dir / "a",
                                    spec("cold"), disk_bytes=64 << 20)
        try:
            _, out, _ = await g.run(["hostname"])
            assert out == b"cold\n"
        finally:
            await g.destroy()

    run(go())


def test_clones_map_the_template_ram_from_a_write_sealed_memfd(
        templates: Templates, machine: Machine, layer: Path, run_dir: Path) -> None:
    """A clone's QEMU never has the template's file: its RAM is a memfd that refuses
    writes (a VMM taken over by its guest cannot change what other clones map)."""
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a")
        try:
            pid = g.vm.pid
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "memfd:sbx-template-" in maps
            assert str(templates.root) not in maps
            fds = [os.readlink(f"/proc/{pid}/fd/{f}") for f in os.listdir(f"/proc/{pid}/fd")]
            assert not [f for f in fds if str(templates.root) in f]
            memfd = next(f for f in os.listdir(f"/proc/{pid}/fd")
                         if os.readlink(f"/proc/{pid}/fd/{f}").startswith("/memfd:sbx-template"))
            # the same open file QEMU has, writable by its mode, refused by its seals
            with open(f"/proc/{pid}/fd/{memfd}", "r+b", buffering=0) as f, \
                    pytest.raises(PermissionError):
                f.write(b"x")
            _, out, _ = await g.run(["echo", "ok"])
            assert out == b"ok\n"
        finally:
            await g.destroy()

    run(go())


def test_vmm_runs_jailed_as_its_own_user_with_only_fds(templates: Templates, machine: Machine,
                                                layer: Path, run_dir: Path) -> None:
    """The clone's QEMU runs as an unprivileged user in namespaces of its own (no network,
    no host file but /usr) and still reads its layer in a 0700 root-owned directory and its
    kernel/initramfs: every file it has is an fd we gave it."""
    async def go() -> None:
        assert os.stat(layer.parent).st_mode & 0o077 == 0 and os.stat(layer.parent).st_uid == 0
        g = await _clone(templates, machine, layer, run_dir / "a")
        try:
            status = Path(f"/proc/{g.vm.pid}/status").read_text()
            uids = next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1:]
            gids = next(ln for ln in status.splitlines() if ln.startswith("Gid:")).split()[1:]
            groups = next(ln for ln in status.splitlines() if ln.startswith("Groups:"))
            assert uids == [str(VMM_UID)] * 4 and gids == [str(VMM_UID)] * 4
            assert groups.split()[1:] == []
            # its jail: no network and no host file but /usr (read-only) and its own /proc
            for ns in ("net", "ipc", "mnt"):
                assert os.readlink(f"/proc/{g.vm.pid}/ns/{ns}") != os.readlink(
                    f"/proc/self/ns/{ns}"), ns
            root = f"/proc/{g.vm.pid}/root"
            assert sorted(os.listdir(root)) == ["bin", "dev", "etc", "lib", "lib64", "proc",
                                                "sbin", "usr"]
            assert sorted(os.listdir(f"{root}/dev")) == ["null", "urandom", "zero"]
            assert os.listdir(f"{root}/etc") == ["ld.so.cache"]
            assert not os.path.exists(f"{root}/{layer}")
            mounts = Path(f"/proc/{g.vm.pid}/mounts").read_text().splitlines()
            assert any(m.split()[1] == "/usr" and " ro," in m for m in mounts), mounts
            _, out, _ = await g.run(["cat", "/etc/hostname"])
            assert out == b"layer\n"
        finally:
            await g.destroy()

    run(go())


def test_grader_view_in_the_guest(templates: Templates, machine: Machine, layer: Path,
                                  run_dir: Path) -> None:
    """A grader exec sees the grader paths as the layers hold them: what the workload
    wrote under /etc is not there for it (on the guest's 6.1 kernel, whose overlay has no
    lowerdir+, through the layers' fd paths)."""
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a", caps=WORKLOAD_CAPS,
                         grader_paths=("/etc",))
        try:
            await g.run(["sh", "-c", "echo evil > /etc/injected; echo x >> /etc/hostname"])
            h = await g.conn.exec(("sh", "-c", "ls /etc; cat /etc/hostname"),
                                  {"PATH": "/bin"}, grader=True)
            out = bytearray()
            async for item in h.events():
                if isinstance(item, tuple):
                    out += item[1]
                else:
                    assert item.exit_code == 0, (item, bytes(out))
            assert bytes(out) == b"hostname\nlayer\n"
            _, seen, _ = await g.run(["ls", "/etc"])
            assert b"injected" in seen
        finally:
            await g.destroy()

    run(go())


def test_accelerator_probe_boots_within_its_bound(machine: Machine, run_dir: Path) -> None:
    """KVM only if a KVM guest reaches sbx-init within the bound (here /dev/kvm exists but
    hangs guests: TCG with the reason); the probe leaves no VM behind."""
    async def go() -> None:
        t0 = time.monotonic()
        verdict = await accel.probe(QemuVmm(), machine, run_dir / "probe", bound_s=5)
        assert time.monotonic() - t0 < 30
        assert verdict.accel in ("kvm", "tcg")
        if verdict.accel == "kvm":
            assert verdict.boot_s is not None and verdict.boot_s < 5
        elif os.path.exists("/dev/kvm"):
            assert "no guest within 5 s" in verdict.reason or "refused" in verdict.reason
        assert not list((run_dir / "probe").iterdir())

    run(go())


def test_free_page_reporting_cannot_punch_the_template(
        templates: Templates, machine: Machine, layer: Path, run_dir: Path) -> None:
    """QEMU 7.2 discards reported pages of file-backed RAM with a hole punched in the file,
    private mapping or not: a clone's guest freeing memory would have zeroed those pages of
    the template under every other clone. The clones' RAM is a sealed memfd: the template
    stays as it was, and another clone still runs."""
    fpr = dataclasses.replace(machine, free_page_reporting=True)

    async def go() -> None:
        t = await templates.get(fpr)
        a = await GuestVm.clone(templates, t, [str(layer)], run_dir / "a", spec("a"),
                                disk_bytes=64 << 20)
        try:
            def digests() -> tuple[str, ...]:
                # the template's file, and what clones map (a sealed copy of it)
                memfd = templates._ram_fds.get(t.dir.name)
                return tuple(hashlib.sha256(data).hexdigest() for data in (
                    t.mem.read_bytes(),
                    *([os.pread(memfd, 256 << 20, 0)] if memfd is not None else [])))

            before = digests()
            end, _, err = await a.run(["sh", "-c", "dd if=/dev/zero of=/dev/shm/x bs=1M "
                                       "count=60 2>/dev/null; rm /dev/shm/x"])
            assert end.exit_code == 0, err
            await asyncio.sleep(6)  # the guest reports freed pages after ~2 s
            assert digests() == before
            b = await GuestVm.clone(templates, t, [str(layer)], run_dir / "b", spec("b"),
                                    disk_bytes=64 << 20)
            try:
                _, out, _ = await b.run(["echo", "ok"])
                assert out == b"ok\n"
            finally:
                await b.destroy()
        finally:
            await a.destroy()

    run(go())



def test_resume_again_and_again_beside_busy_loops(templates: Templates, machine: Machine,
                                                  layer: Path, run_dir: Path) -> None:
    """Pause and resume a guest over and over on a loaded host, an exec running across each
    pause: every resume hears sbx-init again and the exec carries on to its end."""
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a")
        try:
            for i in range(int(os.environ.get("I13_RESUME_ROUNDS", "6"))):
                h = await g.start(["sh", "-c", f"sleep 0.3; echo round {i}"])
                await g.pause()
                await g.resume(templates.vmm, machine)
                out = [ev async for ev in h.events()]
                assert out[0] == ("stdout", f"round {i}\n".encode()), (i, out)
        finally:
            await g.destroy()

    with busy_loops():
        run(go())


def test_a_resume_whose_vmm_dies_says_why(templates: Templates, machine: Machine,
                                          layer: Path, run_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume that got no HELLO said only "no hello" (seen once at load, cause unknown):
    it now says what became of the VMM (here killed as soon as its state was loading) and
    the ends of its log and the guest's console."""
    async def go() -> None:
        g = await _clone(templates, machine, layer, run_dir / "a")
        try:
            await g.pause()
            real = templates.vmm.restore

            async def restore_then_kill(*a: object, **kw: object) -> object:
                vm = await real(*a, **kw)  # type: ignore[arg-type]
                os.kill(vm.pid, 9)  # our child, started just now
                await vm.wait_exit(10)
                return vm

            monkeypatch.setattr(templates.vmm, "restore", restore_then_kill)
            with pytest.raises(BackendError, match=r"no hello.*killed by signal 9; qemu: "):
                await g.resume(templates.vmm, machine)
        finally:
            await g.destroy()

    run(go())
