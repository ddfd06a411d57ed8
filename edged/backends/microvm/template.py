"""Booted templates and their copy-on-write clones: how a microVM is created in ~100 ms
under TCG instead of booting for seconds.

**Template**: per :class:`~.vmm.Machine` (kernel, initramfs, RAM size, vCPUs, disk count...),
boot once with RAM in a file mapped shared (``share=on``), wait for the guest's ready record
(sbx-init has loaded its early modules and waits for its sandbox on the control port), then
save with ``x-ignore-shared``: the RAM stays in ``mem`` (the file *is* the RAM) and only device
state (~50 KB) goes to ``state``. Both files are immutable from then on: clones map ``mem``
privately, and a change to the file would show through every page a clone has not copied.

**Clone**: a new VMM with the same devices, RAM ``mem`` mapped privately (``share=off``: pages
are read from the page cache shared by every clone and copied only when the guest writes one),
loading ``state``; the guest resumes inside its read of the control port.

**The template's RAM as clones see it: a write-sealed memfd.** QEMU 7.2 opens a private
(``share=off``) memory-backend-file read-write (its ``readonly=on`` makes the guest's RAM
read-only: the guest hangs) and keeps the fd: a clone's QEMU taken over by its guest could
``pwrite`` the template and so reach every later clone, and every running clone's pages it
has not copied yet. So clones never get the file: :meth:`Templates.clone` copies it once
into a memfd (holes and zero pages left out) sealed against writes, growing and shrinking
(``F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL``), which each clone inherits
and maps privately through ``/proc/self/fd/N``: writes through the fd are refused (EPERM),
private copy-on-write mappings are not. The cost: the template's pages are shmem (swap,
not eviction, takes them from memory), once per node. The seal also stops QEMU 7.2's free
page reporting from punching holes in the template (see :class:`~.vmm.Machine`).

**The sandbox's disks** (the question this module answers): a clone needs the template's
device set (migration restores device state onto the destination's devices, matched by
their order), but its *own* backing files. QEMU takes a device's backend from the
destination's command line, not from the stream, so the clone is started with the same
``virtio-blk-device`` list bound to the sandbox's files (layers read-only, the upper
writable, as the template's placeholders were: virtio-blk's read-only feature is negotiated
when the guest probes). What remains is the guest's view, set when the template's kernel
probed its placeholders (``null-co``, 1 TiB of zeros) and its upper:

- which disk is which: by virtio serial number (``sbx-l0``.., ``sbx-upper``); the
  template's placeholders carry the clone's serials, so the template's guest finds them
  (the same devices in the same order in every clone);
- what it cached of them (its partition scan): dropped with ``BLKFLSBUF``, in the template;
- the layers' size: the guest keeps the placeholder's 1 TiB. Harmless: EROFS keeps to the
  size its superblock records, and no workload process can reach the raw disks;
- **the upper is not a placeholder**: the template's guest mounts a real ext4 file of the
  machine's ``upper_bytes`` (with its ``upper/``, ``work/``, ``empty/``) and syncs it before
  it is saved; each clone's upper is a copy of that file (:func:`~.disks.copy_upper`), so
  the clone's guest has its upper mounted already and what it caches of it is what its
  file holds. The ext4 mount was ~40% of a clone's mounts (2026-12-01).

Everything else of the sandbox that does not depend on the clone is made in the template
too (the workload's cgroup, ``/proc``, ``/sys``, ``/dev``: ``csrc/sbx-init/guest.h``): under
TCG a clone's QEMU translates every guest instruction it runs for the first time, and what
the template did a clone never runs. Before (the disks found and flushed, the upper mounted
and the rest made in each clone): 0.41 CPU-s of QEMU per create and first exec, after:
0.345 (2026-12-01 18:10, 6 interleaved creates each, load 26).

So no hot-plug (microvm's virtio-mmio has none), no ``blockdev-reopen`` and no re-probe: a
first version left ``virtio_blk`` unbound in the template (the virtio bus's autoprobe off) and
bound it in the clone, which cost ~15% more guest CPU per create, mostly in the probe
(2026-12-01, 0.32 vs 0.27 CPU-seconds of QEMU per create). :mod:`.guestkit`'s *late* module
list is what remains of it, for a driver that must probe a clone's own device.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edged.backends.microvm import boot
from edged.backends.microvm.disks import data_extents, make_upper
from edged.backends.microvm.qemu import qemu_log_tail
from edged.backends.microvm.vmm import Disk, Jail, Machine, Vm, Vmm
from edged.errors import BackendError

log = logging.getLogger("edged.microvm")

#: A cold boot under TCG takes ~2-5 s here, a clone's boot ~0.2 s; a guest not ready after
#: this is not coming (on this 2-core machine at load 40, clones were seen taking 30 s).
BOOT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Template:
    """A saved template: ``mem`` (the guest RAM file), ``state`` (device state),
    ``boot_s`` (how long its cold boot took)."""

    machine: Machine
    dir: Path
    boot_s: float

    @property
    def mem(self) -> Path:
        return self.dir / "mem"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def upper(self) -> Path:
        """The upper disk as the template's guest left it mounted (copied for each clone)."""
        return self.dir / "upper.img"


async def read_exact(reader: asyncio.StreamReader, n: int, what: str, vm: Vm,
                     timeout: float) -> bytes:
    """``n`` bytes from the guest's control port, or BackendError naming ``what`` (with the
    console's last lines) if the VM exits or ``timeout`` passes first."""
    try:
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except (asyncio.IncompleteReadError, TimeoutError, OSError) as e:
        why = "timed out" if isinstance(e, TimeoutError) else "the port closed"
        if not vm.alive():
            why = "the VMM exited"
        raise BackendError(f"VM {vm.run_dir.name}: {what}: {why}; "
                           f"console: {console_tail(vm.run_dir)!r}; "
                           f"qemu: {qemu_log_tail(vm.run_dir)!r}") from e


def console_tail(run_dir: Path, limit: int = 1500) -> str:
    """The end of the guest's console (its kernel's messages)."""
    try:
        with open(run_dir / "console.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


async def open_port(vm: Vm, timeout: float = 5.0) -> tuple[asyncio.StreamReader,
                                                           asyncio.StreamWriter]:
    """Connect to the VM's control port (the socket exists from the VMM's start), or take
    the connection the VMM made before a restore."""
    port = vm.take_port()
    if port is not None:
        return port
    try:
        return await asyncio.wait_for(
            asyncio.open_unix_connection(str(vm.ctl_path), limit=1 << 20), timeout)
    except (OSError, TimeoutError) as e:
        raise BackendError(f"VM {vm.run_dir.name}: control port: {e}") from e


class Templates:
    """Templates under ``root`` (one directory per :meth:`Machine.key`), made on first use
    and reused across daemon restarts. ``run_root``: where template VMs run while they boot.
    """

    def __init__(self, vmm: Vmm, root: Path, run_root: Path) -> None:
        self.vmm = vmm
        self.root = root
        self.run_root = run_root
        self._locks: dict[str, asyncio.Lock] = {}
        self._ram_fds: dict[str, int] = {}

    def _disks(self, machine: Machine, upper: Path) -> list[Disk]:
        # placeholders for the layers (with the clone's serials), the real upper file
        return [*(Disk(None, f"{boot.SERIAL_LOWER}{i}") for i in range(machine.ndisks - 1)),
                Disk(str(upper), boot.SERIAL_UPPER, read_only=False)]

    def find(self, machine: Machine) -> Template | None:
        """The saved template of ``machine``, or None."""
        d = self.root / machine.key()
        try:
            meta = json.loads((d / "template.json").read_text())
        except (OSError, ValueError):
            return None
        if not all((d / f).is_file() for f in ("mem", "state", "upper.img")):
            return None
        return Template(machine, d, float(meta.get("boot_s", 0.0)))

    async def get(self, machine: Machine, jail: Jail | None = None) -> Template:
        """The template of ``machine``, booting and saving it first if there is none (one
        boot at a time per machine; its VMM confined by ``jail``, by default the VMM's).
        Raises BackendError if the guest does not come up within :data:`BOOT_TIMEOUT_S`."""
        key = machine.key()
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            found = self.find(machine)
            if found is not None:
                return found
            return await self._make(machine, jail)

    async def _make(self, machine: Machine, jail: Jail | None = None) -> Template:
        key = machine.key()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.root / f".{key}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        run_dir = self.run_root / f"template-{key}"
        shutil.rmtree(run_dir, ignore_errors=True)
        jail = jail or self.vmm.default_jail()
        t0 = time.monotonic()
        # The RAM file reaches the (jailed) VMM as an fd; it re-opens it through
        # /proc/self/fd, which checks the file's owner and mode: its user owns it while it
        # boots, root once it is saved.
        mem_fd = os.open(tmp / "mem", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        vm: Vm | None = None
        try:
            os.ftruncate(mem_fd, machine.memory_mib << 20)
            if jail.uid is not None:
                os.fchown(mem_fd, jail.uid, jail.gid if jail.gid is not None else -1)
            await asyncio.to_thread(make_upper, tmp / "upper.img", machine.upper_bytes)
            vm = await self.vmm.boot(machine, self._disks(machine, tmp / "upper.img"),
                                     run_dir, mem_fd, share=True, jail=jail)
            reader, writer = await open_port(vm)
            try:
                boot.parse_ready(await read_exact(reader, boot.READY.size, "ready record",
                                                  vm, BOOT_TIMEOUT_S))
                boot_s = time.monotonic() - t0
                await vm.save(tmp / "state")
            finally:
                writer.close()
        except BaseException:
            if vm is not None:
                await vm.kill()
            os.close(mem_fd)
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        await vm.kill()
        os.fchown(mem_fd, 0, 0)
        os.close(mem_fd)
        shutil.rmtree(run_dir, ignore_errors=True)
        for f in ("mem", "state", "upper.img"):
            os.chmod(tmp / f, 0o400)
        (tmp / "template.json").write_text(json.dumps(
            {"machine": machine.__dict__, "boot_s": boot_s, "made": time.time()}) + "\n")
        dest = self.root / key
        if dest.exists():  # made by a previous daemon that died before it was found
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        log.info("template %s: cold boot %.2f s (%d MiB, %d vCPU, %s)", key, boot_s,
                 machine.memory_mib, machine.vcpus, machine.accel)
        return Template(machine, dest, boot_s)

    async def clone(self, template: Template, disks: Sequence[Disk], run_dir: Path,
                    jail: Jail | None = None, swappable: bool = False) -> Vm:
        """Start a clone of ``template`` with ``disks`` (same count as the machine's), its
        RAM the template's sealed memfd (made on first use), its VMM confined by ``jail``
        (None: the VMM's default); ``swappable``: placeholder disks can be bound to files
        later (:meth:`~.vmm.Vm.bind_disks`)."""
        key = template.dir.name
        fd = self._ram_fds.get(key)
        if fd is None:
            fd = await asyncio.to_thread(sealed_copy, template.mem)
            self._ram_fds[key] = fd
        return await self.vmm.restore(template.machine, disks, run_dir, fd, template.state,
                                      jail, swappable=swappable)

    def close(self) -> None:
        """Close the templates' memfds (running clones keep their own references)."""
        for fd in self._ram_fds.values():
            os.close(fd)
        self._ram_fds.clear()

    def remove_stale(self, keep: set[str]) -> list[str]:
        """Remove template directories whose key is not in ``keep`` and half-made ones;
        returns the names removed. Running clones keep their mapping of a removed file."""
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for d in self.root.iterdir():
                if d.name not in keep:
                    fd = self._ram_fds.pop(d.name, None)
                    if fd is not None:
                        os.close(fd)
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(d.name)
        return removed


F_ADD_SEALS = 1033  # fcntl.h: F_LINUX_SPECIFIC_BASE + 9
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
_PAGE = 4096


def sealed_copy(path: Path) -> int:
    """A memfd holding ``path``'s bytes (same size; holes and all-zero pages left as
    holes), sealed against writes, growing, shrinking and further sealing; returns its fd
    (close-on-exec; the caller owns it). Raises BackendError on I/O failure."""
    fd = os.memfd_create(f"sbx-template-{path.parent.name}",
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(path, "rb", buffering=0) as src:
            os.ftruncate(fd, os.fstat(src.fileno()).st_size)
            zero = bytes(_PAGE)
            for start, end in data_extents(src.fileno()):
                while start < end:
                    buf = os.pread(src.fileno(), min(end - start, 1 << 20), start)
                    if not buf:
                        break
                    run = -1  # start of the current run of non-zero pages in buf
                    for i in range(0, len(buf) + _PAGE, _PAGE):
                        nonzero = i < len(buf) and buf[i : i + _PAGE] != zero[: len(buf) - i]
                        if nonzero and run < 0:
                            run = i
                        elif not nonzero and run >= 0:
                            os.pwrite(fd, buf[run:i], start + run)
                            run = -1
                    start += len(buf)
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL)
    except OSError as e:
        os.close(fd)
        raise BackendError(f"template RAM {path}: sealed copy: {e}") from e
    return fd


async def boot_guest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, vm: Vm,
                     spec: boot.BootSpec,
                     timeout: float = BOOT_TIMEOUT_S) -> tuple[float, dict[str, float]]:
    """Send a clone's guest its boot record and wait for its answer; returns the seconds the
    guest spent booting its sandbox and its steps (name -> seconds: ``record``, ``disks``,
    ``lowers+upper``, ``overlay``, ``cgroup``, ``root``). Raises BackendError with the guest's
    errno message."""
    writer.write(boot.boot_record(spec))
    await writer.drain()
    head = await read_exact(reader, boot.DONE.size, "boot answer", vm, timeout)
    code, msg_len, boot_ns = boot.parse_done(head)
    msg = (await read_exact(reader, msg_len, "boot message", vm, timeout)).decode(
        errors="replace") if msg_len else ""
    if code:
        raise BackendError(f"VM {vm.run_dir.name}: guest boot failed: {msg} (errno {code})")
    return boot_ns / 1e9, boot.parse_steps(msg)
