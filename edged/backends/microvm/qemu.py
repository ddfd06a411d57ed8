"""QEMU as the VMM: the ``microvm`` machine, TCG or KVM.

Command line (see :func:`argv`): ``-M microvm`` with virtio-mmio devices only (no PCI, no
firmware: ``x-option-roms=off``, the kernel loaded directly), ``isa-serial`` for the console
(the guest kernel's panic message is the recorded cause of a crash), ``rtc=off``; RAM from a
``memory-backend-file``; one ``virtio-serial-device`` with the control port
(``virtserialport name=sbx.ctl``), ``virtio-balloon-device,free-page-reporting=on``, and the
disks as ``virtio-blk-device`` with a ``serial`` each. ``-no-reboot``: a guest that panics
(``panic=-1`` reboots at once) or powers off ends the process. ``-sandbox on`` with every
optional class denied (obsolete syscalls, setuid/setgid, fork/exec, scheduler/affinity
changes): QEMU's own seccomp filter, so a guest that escapes into QEMU cannot start programs.

Sockets: ``qmp.sock`` and ``ctl.sock`` in the VM's run directory are bound and listened on
*here* and handed to QEMU as fds (``-chardev socket,fd=N,server=on``), so that they exist
before the process does (no connect-retry loop) and outlive a daemon restart (a restarted
daemon reconnects by path).

Template clones (:mod:`.template` has the why): the template runs with ``share=on`` (its RAM is
the file), and is saved with the ``x-ignore-shared`` migration capability (shared RAM is left
out of the stream: ~50 KB of device state). A clone runs with ``share=off`` (the file mapped
MAP_PRIVATE: untouched pages are the page cache's, shared by every clone) and
``-incoming defer``; over QMP ``migrate-set-capabilities x-ignore-shared`` (QEMU 7.2 has no
``-global migration.x-ignore-shared``) and ``migrate-incoming fd:N`` on the state file it
inherited; without ``-S`` the guest runs as soon as the state is in (a stream saved from a
running VM restores running). The stream goes to and from files we open (QMP ``getfd`` +
``migrate fd:``, the inherited fd), never through ``exec:``, which spawn=deny forbids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edged.backends.base import readable
from edged.backends.microvm.boot import PORT_NAME
from edged.backends.microvm.qmp import Qmp, QmpError
from edged.backends.microvm.vmm import Disk, Jail, Machine
from edged.errors import BackendError

log = logging.getLogger("edged.microvm")

QEMU = "qemu-system-x86_64"
#: A QEMU starting on a busy host (2 cores, load 10+) was seen to take over 5 s to answer.
QMP_TIMEOUT_S = 30.0
#: The environment a VMM starts with (nothing of the daemon's).
VMM_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
#: The jail every VMM starts in (``csrc/vmm-jail/jail.c``, built into ``edged/_bin``).
JAIL = Path(__file__).resolve().parents[2] / "_bin" / "edged-vmm-jail"
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
#: A template's placeholder disk: the template's guest probes it, and a clone's guest keeps
#: this as its disk's size (larger than any layer or upper file: filesystems keep to their
#: superblock's size). 1 TiB of nothing (null-co reads zeros, stores nothing).
PLACEHOLDER_BYTES = 1 << 40


def _listen(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    os.chmod(path, 0o600)
    s.listen(4)
    return s


@dataclass(frozen=True)
class Fds:
    """The files a QEMU process gets as inherited fds rather than paths (so that, run as a
    user of its own, it needs access to no path of ours): ``qmp``/``ctl`` listening
    sockets, ``console`` (the log, open for appending), ``kernel``/``initrd`` (read through
    ``/proc/self/fd/N``, which reaches the file whatever its directories' modes), ``disks``
    (one per disk, None for a placeholder; fd sets: ``-add-fd``, ``/dev/fdset/N``)."""

    qmp: int
    ctl: int
    console: int
    kernel: int
    initrd: int
    disks: tuple[int | None, ...]

    def all(self) -> list[int]:
        return [self.qmp, self.ctl, self.console, self.kernel, self.initrd,
                *(fd for fd in self.disks if fd is not None)]


def argv(machine: Machine, disks: Sequence[Disk], mem_path: Path | int | None, share: bool,
         fds: Fds, incoming: bool = False, binary: str = QEMU, name: str = "sbx",
         swappable: bool = False) -> list[str]:
    """The QEMU command line (see the module docstring); ``name``: the guest's name (its
    run directory: what names its process in ``ps``); ``swappable``: each placeholder disk
    is a ``raw`` node over its ``null-co`` one, so that :meth:`QemuVm.bind_disks` can put
    a file under it later. Raises ValueError if ``disks`` or ``fds.disks`` does not match
    ``machine.ndisks``."""
    disk_fds = fds.disks
    if not len(disks) == len(disk_fds) == machine.ndisks:
        raise ValueError(f"{len(disks)} disks ({len(disk_fds)} fds) for a machine with "
                         f"{machine.ndisks}")
    if mem_path is None:  # a resumed snapshot: every page it has is in the stream
        memory = f"memory-backend-ram,id=mem,size={machine.memory_mib}M"
    elif isinstance(mem_path, int):  # an inherited fd (a template's sealed memfd)
        memory = (f"memory-backend-file,id=mem,size={machine.memory_mib}M,"
                  f"mem-path=/proc/self/fd/{mem_path},share={'on' if share else 'off'}")
    else:
        memory = (f"memory-backend-file,id=mem,size={machine.memory_mib}M,"
                  f"mem-path={mem_path},share={'on' if share else 'off'}")
    accel = machine.accel
    if accel == "tcg" and machine.tb_size_mib:
        accel += f",tb-size={machine.tb_size_mib}"
    a = [
        binary, "-name", f"{name.replace(',', ',,')},debug-threads=on",
        "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=off,memory-backend=mem",
        "-accel", accel, "-cpu", "max" if machine.accel == "tcg" else "host",
        "-smp", str(machine.vcpus), "-m", f"{machine.memory_mib}M",
        "-object", memory,
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-sandbox", SANDBOX,
        "-kernel", f"/proc/self/fd/{fds.kernel}", "-initrd", f"/proc/self/fd/{fds.initrd}",
        "-append", machine.cmdline,
        "-add-fd", f"fd={fds.console},set=1",
        "-chardev", "file,id=con,path=/dev/fdset/1", "-serial", "chardev:con",
        "-chardev", f"socket,id=qmp,fd={fds.qmp},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-device", "virtio-serial-device,max_ports=2",
        "-chardev", f"socket,id=ctl,fd={fds.ctl},server=on,wait=off",
        "-device", f"virtserialport,chardev=ctl,name={PORT_NAME}",
    ]
    if machine.free_page_reporting:
        a += ["-device", "virtio-balloon-device,free-page-reporting=on"]
    for i, (d, fd) in enumerate(zip(disks, disk_fds, strict=True)):
        if d.path is not None:
            if fd is None:
                raise ValueError(f"disk {i} ({d.path}): no fd")
            a += ["-add-fd", f"fd={fd},set={10 + i}"]
        if d.path is None:
            # read-only like the disk a clone puts in its place: virtio-blk's F_RO is
            # negotiated when the template's guest probes it
            ro = "on" if d.read_only else "off"
            node = (f"driver=null-co,node-name={'p' if swappable else 'd'}{i},"
                    f"size={PLACEHOLDER_BYTES},read-zeroes=on,read-only={ro}")
            if swappable:
                a += ["-blockdev", node]
                node = f"driver=raw,node-name=d{i},file=p{i},read-only={ro}"
        elif d.read_only:
            # locking=off: many VMs read one layer file and none ever writes it
            node = (f"driver=file,filename=/dev/fdset/{10 + i},node-name=d{i},read-only=on,"
                    "locking=off")
        else:
            node = f"driver=file,filename=/dev/fdset/{10 + i},node-name=d{i},discard=unmap"
        a += ["-blockdev", node, "-device", f"virtio-blk-device,drive=d{i},serial={d.serial}"]
    if incoming:
        a += ["-incoming", "defer"]
    return a


class QemuVm:
    """A QEMU process: ``child`` if this process started it (then it is reaped here and
    its exit status known), else one of an earlier daemon's (adopted)."""

    def __init__(self, pid: int, run_dir: Path, qmp: Qmp | None = None,
                 child: bool = False) -> None:
        self.pid = pid
        self.run_dir = run_dir
        self._qmp = qmp
        self._child = child
        self._status: int | None = None  # wait status, once reaped
        self._pidfd: int | None = None
        self._port: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(pid)

    @property
    def ctl_path(self) -> Path:
        return self.run_dir / "ctl.sock"

    def take_port(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The control port connection made before the state was loaded (restores), once."""
        port, self._port = self._port, None
        return port

    @property
    def qmp_path(self) -> Path:
        return self.run_dir / "qmp.sock"

    async def qmp(self) -> Qmp:
        """The QMP connection (made on first use). Raises QmpError."""
        if self._qmp is None:
            self._qmp = await Qmp.connect(str(self.qmp_path), QMP_TIMEOUT_S)
        return self._qmp

    def _reap(self) -> bool:
        """Collect our child's exit if it has ended; True once it has."""
        if self._status is not None:
            return True
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self._child = False  # reaped elsewhere: no status to know
            return not self.alive()
        if pid == 0:
            return False
        self._status = status
        return True

    def alive(self) -> bool:
        if self._child:
            return not self._reap()
        if self._status is not None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def returncode(self) -> int | None:
        """The process's exit status (negative: the signal that ended it) once it has
        ended, if it was our child; else None."""
        if not self._child or not self._reap() or self._status is None:
            return None
        if os.WIFSIGNALED(self._status):
            return -os.WTERMSIG(self._status)
        return os.WEXITSTATUS(self._status)

    async def wait_exit(self, timeout: float | None = None) -> int | None:
        async with asyncio.timeout(timeout):
            if self._pidfd is not None and self.alive():
                with readable(self._pidfd) as ended:
                    await ended
            while self.alive():
                await asyncio.sleep(0.01)
        return self.returncode()

    async def save(self, state: Path) -> None:
        qmp = await self.qmp()
        # No "stop" first: migration stops the vCPUs itself before it saves the devices, and
        # a stream saved from a running VM makes the restored one start running at once
        # (one saved from a stopped VM would restore paused and need a "cont").
        await qmp.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": True}]})
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            await qmp.execute("getfd", {"fdname": "state"}, fds=[fd])
        finally:
            os.close(fd)
        await qmp.execute("migrate", {"uri": "fd:state"})
        while True:
            info = await qmp.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise BackendError(f"QEMU {self.pid}: save failed: {info.get('error-desc')}")
            await asyncio.sleep(0.005)

    async def wait_running(self, timeout: float = QMP_TIMEOUT_S) -> None:
        """Wait until the guest runs (a restore's state is loaded: ``query-status`` is
        ``running``, not ``inmigrate``). Raises BackendError (QEMU's status, or none within
        ``timeout`` seconds)."""
        deadline = asyncio.get_running_loop().time() + timeout
        qmp = await self.qmp()
        while True:
            status = (await qmp.execute("query-status")).get("status")
            if status == "running":
                return
            if status not in ("inmigrate", "prelaunch", "restore-vm"):
                raise BackendError(f"QEMU {self.pid}: guest {status} after its restore; "
                                   f"qemu: {qemu_log_tail(self.run_dir)!r}")
            if asyncio.get_running_loop().time() > deadline:
                raise BackendError(f"QEMU {self.pid}: state not loaded within {timeout} s")
            await asyncio.sleep(0.005)

    async def pause(self) -> None:
        await (await self.qmp()).execute("stop")

    async def cont(self) -> None:
        await (await self.qmp()).execute("cont")

    async def bind_disks(self, disks: Sequence[tuple[int, Disk]]) -> None:
        """Put each ``(index, disk)``'s file under the placeholder disk ``index`` of a VM
        started with ``swappable`` placeholders, while it runs: per disk the file goes over
        QMP (``add-fd`` into fd set ``30 + index``) and becomes a ``file`` node
        (``blockdev-add``), then one ``blockdev-reopen`` makes it the ``file`` child of
        each placeholder's ``raw`` node (QEMU drains the nodes first; the guest's device
        and what its driver negotiated stay as they are). Three QMP round trips per disk
        and one more: 2-38 ms here at load 57 (2026-12-01). Raises BackendError (QMP's
        error)."""
        qmp = await self.qmp()
        options = []
        for i, d in disks:
            if d.path is None:
                raise BackendError(f"VM {self.run_dir.name}: disk {i}: nothing to bind")
            try:
                fd = os.open(d.path, (os.O_RDONLY if d.read_only else os.O_RDWR)
                             | os.O_CLOEXEC)
            except OSError as e:
                raise BackendError(f"VM {self.run_dir.name}: open {d.path}: {e}") from e
            try:
                await qmp.execute("add-fd", {"fdset-id": 30 + i}, fds=[fd])
            finally:
                os.close(fd)  # QEMU has its own copy
            node: dict[str, object] = {"driver": "file", "node-name": f"f{i}",
                                       "filename": f"/dev/fdset/{30 + i}",
                                       "read-only": d.read_only}
            if d.read_only:
                node["locking"] = "off"  # as on the command line (see argv)
            await qmp.execute("blockdev-add", node)
            options.append({"driver": "raw", "node-name": f"d{i}", "file": f"f{i}",
                            "read-only": d.read_only})
        if options:
            await qmp.execute("blockdev-reopen", {"options": options})

    def drop_qmp(self) -> None:
        """Close the monitor connection (made again on the next use)."""
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await self.wait_exit(10)
        self.close()

    def close(self) -> None:
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class QemuVmm:
    """Starts QEMU ``microvm`` guests (the :class:`~.vmm.Vmm` interface), each in
    ``edged-vmm-jail`` (:class:`~.vmm.Jail`)."""

    name = "qemu"

    def __init__(self, binary: str = QEMU, run_as: tuple[int, int] | None = None,
                 jail_bin: Path = JAIL) -> None:
        """``run_as``: ``(uid, gid)`` of a VM started without a :class:`Jail` of its own
        (None: the caller's): a user of their own means one VMM taken over by its guest
        holds nothing but its own fds, and cannot signal or trace VMMs of other users.
        ``binary``: QEMU, by name on ``PATH`` or absolute; in a jail with ``fs`` it must
        be under ``/usr`` (all the jail shows)."""
        self.binary = binary
        self.run_as = run_as
        self.jail_bin = jail_bin

    def available(self) -> str | None:
        if shutil.which(self.binary) is None:
            return f"{self.binary} not installed (Debian qemu-system-x86)"
        if not self.jail_bin.is_file():
            return f"{self.jail_bin} not built (pip install -e . builds it)"
        return None

    def default_jail(self) -> Jail:
        """The jail of a VM started without one: :attr:`run_as`, every namespace."""
        if self.run_as is None:
            return Jail()
        return Jail(uid=self.run_as[0], gid=self.run_as[1])

    def _jail_argv(self, jail: Jail, machine: Machine, run_dir: Path) -> list[str]:
        a = [str(self.jail_bin)]
        for j in jail.join:
            a += ["--join", j]
        devices, groups = list(jail.devices), list(jail.groups)
        if machine.accel == "kvm" and "/dev/kvm" not in devices:
            devices.append("/dev/kvm")
            with contextlib.suppress(OSError):  # the node's group (Debian: kvm, 0660)
                groups.append(os.stat("/dev/kvm").st_gid)
        if jail.uid is not None:
            a += ["--uid", str(jail.uid), "--gid", str(jail.gid)]
            for g in dict.fromkeys(groups):
                a += ["--group", str(g)]
        if jail.netns:
            a.append("--netns")
        if jail.fs:
            root = run_dir / "jail"
            root.mkdir(exist_ok=True)
            a += ["--root", str(root)]
            for d in devices:
                a += ["--dev", d]
        return [*a, "--"]

    def _binary_path(self, jail: Jail) -> str:
        path = shutil.which(self.binary) or self.binary
        path = os.path.realpath(path)
        if jail.fs and not path.startswith("/usr/"):
            raise BackendError(f"{path}: a jailed VMM must be under /usr (all its jail shows)")
        return path

    async def _start(self, machine: Machine, disks: Sequence[Disk], run_dir: Path,
                     mem_path: Path | int | None, share: bool,
                     state: Path | None, jail: Jail | None,
                     swappable: bool = False) -> QemuVm:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        jail = jail if jail is not None else self.default_jail()
        if isinstance(mem_path, Path) and jail.fs:
            raise BackendError(f"VM {run_dir.name}: a jailed VMM takes its RAM file as an fd")
        opened: list[int] = []

        def open_fd(path: str | Path, flags: int, mode: int = 0o600) -> int:
            try:
                fd = os.open(path, flags | os.O_CLOEXEC, mode)
            except OSError as e:
                raise BackendError(f"VM {run_dir.name}: open {path}: {e}") from e
            opened.append(fd)
            return fd

        qs = _listen(run_dir / "qmp.sock")
        cs = _listen(run_dir / "ctl.sock")
        try:
            sfd = open_fd(state, os.O_RDONLY) if state is not None else None
            out = open_fd(run_dir / "qemu.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            fds = Fds(
                qs.fileno(), cs.fileno(),
                open_fd(run_dir / "console.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                open_fd(machine.kernel, os.O_RDONLY), open_fd(machine.initrd, os.O_RDONLY),
                tuple(None if d.path is None else
                      open_fd(d.path, os.O_RDONLY if d.read_only else os.O_RDWR)
                      for d in disks))
            a = [*self._jail_argv(jail, machine, run_dir),
                 *argv(machine, disks, mem_path, share, fds, sfd is not None,
                       self._binary_path(jail), name=str(run_dir), swappable=swappable)]
            inherit = [*fds.all(), *([sfd] if sfd is not None else []),
                       *([mem_path] if isinstance(mem_path, int) else [])]
            # posix_spawn, not Popen: a VMM outlives this daemon (a Popen object would warn
            # at collection that its process still runs). dup2(fd, fd) clears close-on-exec
            # (POSIX 2024, glibc >= 2.29): exactly these fds are inherited.
            actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                       (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, out, 2),
                       *((os.POSIX_SPAWN_DUP2, fd, fd) for fd in inherit)]
            try:
                pid = os.posix_spawn(a[0], a, VMM_ENV, file_actions=actions, setsid=True)
            except OSError as e:
                raise BackendError(f"start {self.binary}: {e}") from e
        finally:
            qs.close()
            cs.close()
            for fd in opened:
                os.close(fd)  # QEMU has its own copies
        (run_dir / "qemu.pid").write_text(f"{pid}\n")
        vm = QemuVm(pid, run_dir, child=True)
        if sfd is not None:
            try:
                qmp = await vm.qmp()
                # Connected before the load: the port's "host connected" state travels in
                # the stream, and a guest restored without a host on the port would see it
                # go away (sbx-init then ends the execs of the lost connection).
                vm._port = await asyncio.wait_for(
                    asyncio.open_unix_connection(str(vm.ctl_path), limit=1 << 20),
                    QMP_TIMEOUT_S)
                await qmp.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "x-ignore-shared", "state": True}]})
                await qmp.execute("migrate-incoming", {"uri": f"fd:{sfd}"})
            except BaseException as e:
                if vm._port is not None:
                    vm._port[1].close()
                await vm.kill()
                if isinstance(e, QmpError | OSError | TimeoutError):
                    raise BackendError(f"restore: {e}; qemu: {qemu_log_tail(run_dir)!r}") from e
                raise
        return vm

    async def boot(self, machine: Machine, disks: Sequence[Disk], run_dir: Path,
                   mem_path: Path | int | None, share: bool,
                   jail: Jail | None = None) -> QemuVm:
        return await self._start(machine, disks, run_dir, mem_path, share, None, jail)

    async def restore(self, machine: Machine, disks: Sequence[Disk], run_dir: Path,
                      mem_path: Path | int | None, state: Path,
                      jail: Jail | None = None, swappable: bool = False) -> QemuVm:
        return await self._start(machine, disks, run_dir, mem_path, False, state, jail,
                                 swappable)


def qemu_log_tail(run_dir: Path, limit: int = 2000) -> str:
    """The end of QEMU's own stderr log (for error messages)."""
    try:
        data = (run_dir / "qemu.log").read_bytes()[-limit:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


__all__ = ["QemuVm", "QemuVmm", "QmpError", "argv", "qemu_log_tail"]
