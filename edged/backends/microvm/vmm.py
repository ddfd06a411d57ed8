"""The VMM interface: what the microVM backend asks of a virtual machine monitor.

One implementation now, QEMU (:mod:`.qemu`); Firecracker or Cloud Hypervisor can implement
the same where installed (both boot a bzImage/vmlinux with an initramfs, have virtio-blk,
a serial/vsock channel and snapshot/restore; Firecracker restores a memory file mapped
MAP_PRIVATE like the template clone here).

A VM is described by a :class:`Machine` (what a template is keyed by: the clone must have the
same devices and RAM size as the template it restores) and its :class:`Disk` list; it runs in
a run directory of its own holding its sockets (``qmp.sock``, ``ctl.sock``: the guest's control
port) and ``console.log``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Machine:
    """A guest machine. ``memory_mib``: guest RAM; ``vcpus``; ``accel``: ``"tcg"`` or
    ``"kvm"``; ``ndisks``: virtio-blk devices (lowers + 1 upper); ``free_page_reporting``:
    virtio-balloon that hands pages the guest frees back to the host. Off by default: QEMU
    7.2 discards a reported range of file-backed RAM by punching a hole in the *file*, also
    for a private mapping (its own warning: "possibly dangerous ... will affect other users
    of the file"), so a template clone would have zeroed the template under every other
    clone; the sealed memfd refuses it (nothing is returned, an error is logged per report).
    It works for anonymous RAM (cold boots, resumed snapshots) and wants a QEMU that
    discards private file mappings with ``MADV_DONTNEED`` alone for clones; ``tb_size_mib``: TCG's
    translation cache (None: QEMU's default, 1 GiB, filled on use, so a busy guest's VMM
    could grow by up to that). Measured here (2026-12-01, load ~7): an idle clone fills
    ~24 MiB of it; 8 MiB cuts that to ~7 MiB but the guest then retranslates all the time
    (exec round trip 570 ms vs 25 ms at 32 MiB and 32 ms at 16 MiB); 32 MiB bounds the
    growth with no slowdown seen;
    ``upper_bytes``: the upper disk's size (a template's upper is mounted by its guest and
    copied for each clone, so the size is the template's);
    ``kernel``/``initrd``/``cmdline``: the guest's boot files."""

    kernel: str
    initrd: str
    cmdline: str
    memory_mib: int = 512
    vcpus: int = 1
    accel: str = "tcg"
    ndisks: int = 4
    free_page_reporting: bool = False
    tb_size_mib: int | None = 32
    upper_bytes: int = 1 << 30

    def key(self) -> str:
        """A short stable digest of everything that must match between a template and its
        clones (the kernel and initrd by content-addressed path, so a changed file is a new
        template)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Jail:
    """How a VMM process is confined on the host, by ``edged-vmm-jail``
    (``csrc/vmm-jail/jail.c``) before the VMM runs: ``uid``/``gid`` (None: the caller's),
    ``groups`` (supplementary; none by default); ``join``: cgroup files it writes itself
    into (``tasks`` on v1, ``cgroup.procs`` on v2), so that everything it uses from its
    first instruction is charged to its cgroups; ``netns``: a network and IPC namespace of
    its own (a guest without a network needs no socket of the host's); ``fs``: a mount
    namespace that shows it nothing of the host's files but ``/usr`` (read-only),
    ``/etc/ld.so.cache``, a ``/proc`` of its own processes and a ``/dev`` of null, zero,
    urandom and ``devices`` (``/dev/kvm``): every file it works on is an fd it inherits."""

    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] = ()
    join: tuple[str, ...] = ()
    netns: bool = True
    fs: bool = True
    devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Disk:
    """A virtio-blk disk: ``path`` (a raw image file), ``serial`` (how the guest finds it),
    ``read_only``. ``path`` None: an empty placeholder (templates)."""

    path: str | None
    serial: str
    read_only: bool = True


class Vm(Protocol):
    """A running VMM process."""

    pid: int
    run_dir: Path

    @property
    def ctl_path(self) -> Path:
        """The host end of the guest's control port (a unix socket)."""
        ...

    def alive(self) -> bool:
        """Whether the VMM process still runs."""
        ...

    def take_port(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The control port's connection if the VMM made it already (a restore connects
        before the state loads), else None; given out once."""
        ...

    async def wait_exit(self, timeout: float | None = None) -> int | None:
        """Wait for the process to end; its exit status if it was our child, else None.
        Raises TimeoutError after ``timeout`` seconds."""
        ...

    async def save(self, state: Path) -> None:
        """Write the guest's device state (and the RAM that is not a shared file) to
        ``state``; the guest is stopped from then on, and a VM restored from ``state`` runs
        at once."""
        ...

    async def pause(self) -> None:
        """Stop the guest's vCPUs (the process stays)."""
        ...

    async def cont(self) -> None:
        """Resume the vCPUs."""
        ...

    async def bind_disks(self, disks: Sequence[tuple[int, Disk]]) -> None:
        """Put each ``(index, disk)``'s file under the placeholder disk ``index`` (a VM
        restored with ``swappable`` placeholders), the guest running. Raises
        BackendError."""
        ...

    async def kill(self) -> None:
        """End the VMM process at once (SIGKILL) and reap it. Idempotent."""
        ...

    def close(self) -> None:
        """Drop our connections to the VMM (it keeps running)."""
        ...


class Vmm(Protocol):
    """Starts VMs. ``name``: ``"qemu"``, ..."""

    name: str

    def available(self) -> str | None:
        """None if usable here, else why not (binary missing...)."""
        ...

    def default_jail(self) -> Jail:
        """How a VM started without a :class:`Jail` of its own is confined."""
        ...

    async def boot(self, machine: Machine, disks: Sequence[Disk], run_dir: Path,
                   mem_path: Path | int | None, share: bool, jail: Jail | None = None) -> Vm:
        """Cold-boot ``machine`` with its RAM in the file ``mem_path`` (a path, or an fd the
        VMM inherits; ``share``: mapped shared, so a template's RAM is the file itself), or
        anonymous RAM when None; confined as ``jail`` says (None: the VMM's default)."""
        ...

    async def restore(self, machine: Machine, disks: Sequence[Disk], run_dir: Path,
                      mem_path: Path | int | None, state: Path,
                      jail: Jail | None = None, swappable: bool = False) -> Vm:
        """Start ``machine`` from a state written by :meth:`Vm.save`, its RAM mapped
        privately (copy-on-write) from ``mem_path`` (a template's RAM: a file, or an fd the
        VMM inherits), or anonymous RAM when None (a full snapshot, which carries every
        page), with ``disks`` in place of the saved VM's; the guest runs as soon as the
        state is loaded. ``swappable``: placeholder disks (``path`` None) can be bound to
        files later (:meth:`Vm.bind_disks`)."""
        ...
