"""The microVM backend: sandboxes that are QEMU guests cloned from a booted template, their
layers the node's EROFS image files as read-only disks, sbx-init the guest's PID 1 over a
virtio-serial port (the pieces: :mod:`.guest`, :mod:`.template`, :mod:`.qemu`).

Per sandbox, on the host:

- ``<runtime_dir>/microvm/sandboxes/<id>/`` (0700): ``meta.json`` (the VMM's pid and start
  time, its uid slot, the machine, the disks, the state), the VMM's sockets (``qmp.sock``,
  ``ctl.sock``: the guest's control port), ``console.log`` (the guest kernel's messages: a
  panic's cause), ``qemu.log``, ``jail/`` (the empty mount point of the VMM's own root);
- ``<state_dir>/microvm/vms/<id>/``: ``upper.img`` (the writable disk, a sparse ext4 file of
  ``disk_bytes``) and, while paused, ``snapshot`` (on disk: a paused sandbox keeps no host
  memory);
- the VMM's cgroups (:mod:`edged.cgroups`, beneath the daemon's own, ``<subdir>-vm``): the
  sandbox's CPU quota and class (the normal class while the VMM starts, resumes, is
  snapshotted or killed: :meth:`MicroVmBackend._settle`), and a memory limit of twice the
  guest's RAM plus the VMM's own overhead (:data:`VMM_OVERHEAD_BYTES`; twice, see
  :meth:`_vmm_resources`);
  inside the guest, the workload's cgroup has the sandbox's memory and pids limits;
- the VMM runs as the first uid of a slot of the host-wide uid grid
  (:mod:`edged.backends.uidslots`: no container's ids and no other VMM share it), in
  ``edged-vmm-jail`` (:class:`~.vmm.Jail`: joined to its cgroups before it runs, its own
  network, IPC and mount namespaces, no host file but ``/usr``) under QEMU's seccomp sandbox.

Machines: the guest's RAM is the sandbox's memory limit plus :data:`GUEST_HEADROOM_MIB` for
the guest kernel, rounded up to a power of two (at least 256 MiB: untouched guest RAM costs
the host nothing); vCPUs the sandbox's CPUs rounded up; one disk per layer plus the upper. A
template is booted once per machine (:mod:`.template`; ~5 s under TCG, on first use).

Pause is a snapshot to ``snapshot`` and the VMM's exit (its cgroups removed, its uid given
back); execs go on across it (:meth:`.guest.GuestVm.pause`); resume restores it onto
anonymous RAM. A sandbox outlives the daemon: a restarted daemon adopts live VMs by their
meta (reconnecting to the port: the guest's sbx-init then ends the old client's execs, as a
container's does) and paused ones by their snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import edged
from edged.backends import memadvise, records
from edged.backends.base import (
    EventSink,
    ExecSpec,
    FailureSink,
    LayerForm,
    MemoryUsage,
    Resources,
    SandboxSpec,
    failure_text,
    instance_subdir,
    readable,
    remove_leftovers,
)
from edged.backends.microvm import accel as accel_probe
from edged.backends.microvm import guestkit
from edged.backends.microvm import policy as guest_policy
from edged.backends.microvm.guest import GuestVm
from edged.backends.microvm.pool import MACHINES as pool_machines
from edged.backends.microvm.pool import VmPool
from edged.backends.microvm.qemu import QemuVm, QemuVmm
from edged.backends.microvm.template import Template, Templates, console_tail
from edged.backends.microvm.vmm import Disk, Jail, Machine
from edged.backends.uidslots import DEFAULT_DIR as UID_SLOTS_DIR
from edged.backends.uidslots import UidSlots, starttime
from edged.cgroups import POOL_PREFIX, SandboxCgroup
from edged.cgroups import probe as probe_cgroups
from edged.errors import BackendError, BadRequest, Conflict, InvalidState, NotFound
from edged.sbxinit import SbxExec

log = logging.getLogger("edged.microvm")

SBX_INIT = Path(edged.__file__).resolve().parent / "_bin" / "sbx-init"
#: Guest RAM beyond the sandbox's memory limit: the guest kernel, sbx-init, page cache.
GUEST_HEADROOM_MIB = 96
#: The VMM's own memory beyond the guest's RAM in its cgroup's limit: QEMU's heap, the
#: device model, TCG's translation cache (:attr:`Machine.tb_size_mib`) and soft TLB, the
#: host page cache of the upper disk's writes.
VMM_OVERHEAD_BYTES = 160 << 20
#: The CPU class a VMM starts, resumes and is snapshotted in (then its sandbox's):
#: :meth:`MicroVmBackend._settle`.
STARTING_QOS = "latency_sensitive"
#: The CPU weight (v1 ``cpu.shares``; a sandbox's is 1024 per CPU) of a clone the pool
#: starts: it runs beside the sandbox whose create took the last one, and at the normal
#: weight its QEMU's start (~0.1 CPU-s) slowed that sandbox's first exec.
POOL_CPU_SHARES = 2
#: Tasks of one VMM (QEMU's main loop, vCPU, RCU and I/O worker threads).
VMM_PIDS = 256
#: QEMU's microvm machine has 8 virtio-mmio transports (hw/i386/microvm.c,
#: VIRTIO_NUM_TRANSPORTS): one is the control port's virtio-serial, one the upper disk.
MAX_LAYERS = 6


@dataclass
class _Vm:
    """One sandbox of this backend. ``guest`` is None while a paused one adopted by this
    daemon has no VMM and no connection yet; ``slot``/``cg`` are None while paused."""

    id: str
    run_dir: Path
    data_dir: Path
    machine: Machine
    disks: list[Disk]
    meta: dict[str, Any]
    guest: GuestVm | None = None
    slot: int | None = None
    cg: SandboxCgroup | None = None
    paused: bool = False
    pidfd: int | None = None
    watched: asyncio.AbstractEventLoop | None = None
    #: why its VMM ended, once it has (see MicroVmBackend.on_failure)
    dead: dict[str, object] | None = None
    throttled: int = 0
    policy: guest_policy.GuestPolicy | None = None


@dataclass
class _PoolVm:
    """A clone waiting in the pool (:mod:`.pool`) for a sandbox: its VMM ``vm`` (a clone of
    ``template`` from :meth:`.guest.GuestVm.prestart`, its layer disks placeholders), the uid
    ``slot`` it runs as, its cgroups ``cg`` (``.pool-<slot>``: no limits while it waits; a
    create renames them to the sandbox's, :meth:`~edged.cgroups.Hierarchy.claim`), and
    ``run_dir``/``data_dir`` (``<runtime_dir>/microvm/pool/<slot>``,
    ``<state_dir>/microvm/pool/<slot>``: renamed to the sandbox's at the create)."""

    vm: QemuVm
    template: Template
    slot: int
    cg: SandboxCgroup
    run_dir: Path
    data_dir: Path

    @property
    def pid(self) -> int:
        return self.vm.pid

    def alive(self) -> bool:
        return self.vm.alive()


class MicroVmBackend:
    """MicroVM sandboxes (implements :class:`edged.backends.base.Backend`).

    ``runtime_dir``/``state_dir``: the daemon's (the backend keeps ``microvm/`` in each, see
    the module). ``accel``: ``"tcg"``, ``"kvm"`` or ``"auto"`` (KVM if a guest boots on it
    within a bound, probed once: :mod:`.accel`). ``uid_base``/``id_count``/``uid_slots_dir``:
    the host-wide uid grid the VMMs' users come from (the container backend's). ``vmm``: the
    VMM (default QEMU). ``cache_dir``: where templates and the initramfs are kept (default
    ``<state_dir>/microvm``; shared by backends on other dirs, e.g. tests).
    ``tb_size_mib``: TCG's translation cache per VM. ``swap_share``: see
    :func:`edged.cgroups.swap_allowance`. ``pool``: clones started ahead per machine of
    the last creates (:mod:`.pool`; 0: none). ``on_event``: where security events go.
    ``on_failure``: told at once when a VMM ends on its own (a guest kernel crash, the VMM
    killed or out of memory), with what is known of why. Raises :mod:`edged.errors`
    exceptions only.
    """

    name = "microvm"
    layer_form: LayerForm = "image"  # read-only disks: the layers' EROFS image files
    can_reclaim = True
    #: descriptors the daemon holds per running sandbox: the control port's connection and
    #: two pidfds of its VMM (ours, the watcher's)
    fds_per_sandbox = 3

    def __init__(self, runtime_dir: str | os.PathLike[str] = "/run/edged",
                 state_dir: str | os.PathLike[str] = "/var/lib/edged", *,
                 accel: str = "auto", uid_base: int = 1 << 30, id_count: int = 65536,
                 uid_slots_dir: str | os.PathLike[str] = UID_SLOTS_DIR,
                 vmm: QemuVmm | None = None, kit_dir: str | os.PathLike[str] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None,
                 tb_size_mib: int | None = 32, swap_share: float = 1.0,
                 pool: int = 0, on_event: EventSink | None = None) -> None:
        if accel not in ("auto", "tcg", "kvm"):
            raise BadRequest(f"microvm accel {accel!r}: not 'auto', 'tcg' or 'kvm'")
        self.run_root = Path(runtime_dir) / "microvm"
        self.sandboxes_dir = self.run_root / "sandboxes"
        self.data_root = Path(state_dir) / "microvm"
        self.vms_dir = self.data_root / "vms"
        self.on_event = on_event
        self.on_failure: FailureSink | None = None
        self.vmm = vmm or QemuVmm()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else self.data_root
        self.templates = Templates(self.vmm, self.cache_dir / "templates", self.run_root)
        self.kit_dir = Path(kit_dir) if kit_dir is not None else None
        self.tb_size_mib = tb_size_mib
        self._accel = accel
        self._accel_reason = "configured" if accel != "auto" else ""
        self._accel_lock = asyncio.Lock()
        self.uid_base = uid_base
        self.id_count = id_count
        self.uid_slots = UidSlots(self.run_root, uid_base=uid_base, id_count=id_count,
                                  directory=uid_slots_dir)
        self.cgroups = probe_cgroups(
            subdir=instance_subdir("edged-vm", self.run_root, Path("/run/edged/microvm")),
            swap_share=swap_share)
        self._vms: dict[str, _Vm] = {}
        self._busy: set[str] = set()
        self._slots: set[int] = set()
        self._kit: guestkit.GuestKit | None = None
        self._initrd: Path | None = None
        self.pool_run = self.run_root / "pool"
        self.pool_data = self.data_root / "pool"
        self.pool: VmPool[_PoolVm] = VmPool(pool, self._pool_start, self._pool_stop)
        #: slots of the clones the pool is starting or holds (their cgroups and dirs)
        self._pool_slots: set[int] = set()
        self._pool_off = "" if pool > 0 else "configured off (microvm_pool 0)"

    # ---- helpers ---------------------------------------------------------------------------

    def _get(self, sandbox_id: str) -> _Vm:
        vm = self._vms.get(sandbox_id)
        if vm is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        return vm

    def _running(self, sandbox_id: str) -> tuple[_Vm, GuestVm]:
        """The sandbox and its guest, running (InvalidState otherwise)."""
        vm = self._get(sandbox_id)
        if vm.paused or vm.guest is None:
            raise InvalidState(f"sandbox {sandbox_id} is paused")
        if vm.dead is not None:
            raise InvalidState(f"sandbox {sandbox_id} has failed: {_cause_text(vm.dead)}")
        if vm.guest.conn.closed:
            raise InvalidState(f"sandbox {sandbox_id}: sbx-init is not connected")
        return vm, vm.guest

    def _boot_files(self) -> tuple[guestkit.GuestKit, Path]:
        """The guest kit and the initramfs with this build's sbx-init (made once). Raises
        BackendError if there is no kit (``scripts/install.sh`` makes it)."""
        if self._kit is None or self._initrd is None:
            try:
                self._kit = guestkit.load(self.kit_dir)
            except guestkit.GuestKitError as e:
                raise BackendError(f"microvm: {e}") from e
            self._initrd = guestkit.build_initramfs(self._kit, SBX_INIT,
                                                    self.cache_dir / "initrd")
        return self._kit, self._initrd

    async def _accelerator(self) -> str:
        """``"tcg"`` or ``"kvm"``: as configured, or probed once (``"auto"``)."""
        if self._accel != "auto":
            return self._accel
        async with self._accel_lock:
            if self._accel == "auto":
                kit, initrd = await asyncio.to_thread(self._boot_files)
                m = Machine(str(kit.kernel), str(initrd), guestkit.cmdline())
                verdict = await accel_probe.probe(self.vmm, m, self.run_root / "probe")
                self._accel, self._accel_reason = verdict.accel, verdict.reason
                log.info("microvm: accelerator %s (%s)", verdict.accel, verdict.reason)
        return self._accel

    def machine_for(self, spec: SandboxSpec, accel: str, kit: guestkit.GuestKit,
                    initrd: Path) -> Machine:
        """The machine of ``spec``'s sandbox (see the module: RAM class, vCPUs, disks)."""
        need = math.ceil(spec.resources.memory_bytes / (1 << 20)) + GUEST_HEADROOM_MIB
        memory_mib = max(256, 1 << (need - 1).bit_length())
        vcpus = max(1, min(math.ceil(spec.resources.cpus), os.cpu_count() or 1))
        return Machine(str(kit.kernel), str(initrd), guestkit.cmdline(), memory_mib=memory_mib,
                       vcpus=vcpus, accel=accel, ndisks=len(spec.lowers) + 1,
                       tb_size_mib=self.tb_size_mib if accel == "tcg" else None,
                       upper_bytes=spec.resources.disk_bytes)

    def _vmm_resources(self, machine: Machine, res: Resources) -> Resources:
        """The VMM's cgroup limits. Memory: a guest page can be charged twice to the VMM
        that touched it — the template RAM file's page (a hole of the memfd is filled with
        a shmem page at the first fault, read or write, of the private mapping) and the
        VMM's private copy of it on a write — and a pause's save reads every guest page.
        With the guest's RAM once plus overhead, a guest whose workload had used its memory
        had its VMM OOM-killed in the middle of the save (583 MiB charged: 333 anon + 245
        shmem, for a 512 MiB guest)."""
        return Resources(cpus=res.cpus, memory_bytes=2 * (machine.memory_mib << 20)
                         + VMM_OVERHEAD_BYTES, pids=VMM_PIDS, disk_bytes=res.disk_bytes)

    def _uid_of(self, slot: int) -> int:
        return self.uid_base + slot * self.id_count

    def _claim_slot(self, sandbox_id: str | None) -> int:
        if not self._slots:  # slots held by VMs of an earlier daemon
            for meta in self._metas().values():
                if isinstance(meta.get("slot"), int):
                    self._slots.add(meta["slot"])
        slot = self.uid_slots.claim(self._slots, sandbox_id)
        self._slots.add(slot)
        return slot

    def _free_slot(self, slot: int | None) -> None:
        if slot is None:
            return
        self._slots.discard(slot)
        try:
            self.uid_slots.release(slot)
        except OSError as exc:
            log.warning("uid slot %d: cannot release its claim: %s", slot, exc)

    def _jail(self, slot: int, cg: SandboxCgroup | None) -> Jail:
        uid = self._uid_of(slot)
        join: tuple[str, ...] = ()
        if cg is not None:
            tasks = "tasks" if cg.version == "v1" else "cgroup.procs"
            join = tuple(str(d / tasks) for d in dict.fromkeys(cg.dirs.values()))
        return Jail(uid=uid, gid=uid, join=join)

    def _meta(self, sandbox_id: str) -> dict[str, Any] | None:
        return records.read(self.sandboxes_dir, sandbox_id)

    def _metas(self) -> dict[str, dict[str, Any]]:
        return records.read_all(self.sandboxes_dir)

    @staticmethod
    def _write_meta(vm: _Vm) -> None:
        records.write(vm.run_dir, vm.meta)

    _alive = staticmethod(records.alive)

    def _watch(self, vm: _Vm) -> None:
        """Learn at once when the sandbox's VMM ends (a pidfd of our own becomes
        readable)."""
        loop = asyncio.get_running_loop()
        if vm.guest is None or vm.dead is not None or vm.watched is loop:
            return
        self._unwatch(vm)
        if vm.pidfd is None:
            try:
                vm.pidfd = os.pidfd_open(vm.guest.vm.pid)
            except ProcessLookupError:
                loop.call_soon(self._vmm_ended, vm)
                return
        loop.add_reader(vm.pidfd, self._vmm_ended, vm)
        vm.watched = loop

    @staticmethod
    def _unwatch(vm: _Vm) -> None:
        if vm.watched is not None and not vm.watched.is_closed() and vm.pidfd is not None:
            vm.watched.remove_reader(vm.pidfd)
        vm.watched = None
        if vm.pidfd is not None:
            os.close(vm.pidfd)
            vm.pidfd = None

    def _vmm_ended(self, vm: _Vm) -> None:
        """The VMM is gone, and the guest with it: the sandbox has failed (a pause or a
        destroy in progress is no failure)."""
        self._unwatch(vm)
        if self._vms.get(vm.id) is not vm or vm.id in self._busy or vm.paused:
            return
        vm.dead = self._death_cause(vm)
        log.warning("sandbox %s: its VMM ended (%s); the sandbox has failed", vm.id,
                    _cause_text(vm.dead))
        if self.on_failure is not None:
            try:
                self.on_failure(vm.id, dict(vm.dead))
            except Exception:
                log.exception("sandbox %s: failure report", vm.id)

    def _death_cause(self, vm: _Vm) -> dict[str, object]:
        """What can be known of why a VMM ended: its exit status (when it was our child), an
        OOM kill in its cgroup, the guest kernel's panic line or the console's last line."""
        cause: dict[str, object] = {"what": "the VMM ended"}
        guest = vm.guest
        if guest is not None and isinstance(guest.vm, QemuVm):
            code = guest.vm.returncode()
            if code is not None and code < 0:
                cause["signal"] = -code
            elif code is not None:
                cause["exit_status"] = code
        if vm.cg is not None:
            with contextlib.suppress(OSError, ValueError, BackendError):
                if vm.cg.oom_kills() > 0:
                    cause["oom_kill"] = True
        tail = console_tail(vm.run_dir, 8000).splitlines()
        panic = [ln for ln in tail if "Kernel panic" in ln]
        if panic:
            cause["what"] = "the guest kernel crashed"
            cause["log"] = panic[-1].strip()[-300:]
        elif tail:
            cause["log"] = tail[-1].strip()[-300:]
        return cause

    def _poll_limits(self, vm: _Vm) -> None:
        """After an exec's end: the VMM's CPU quota throttled since the last one
        (``cpu_throttled``). A full upper disk (``disk_full``) is the guest's sbx-init's to
        tell (an event before the exec's end): what the guest's page cache holds is not yet
        in the host's file, which lagged the guest's ENOSPC by seconds."""
        if self.on_event is None:
            return
        try:
            if vm.cg is not None:
                n = vm.cg.limit_counters()["cpu_throttled"]
                if n > vm.throttled:
                    self.on_event(vm.id, "cpu_throttled",
                                  detail={"count": n - vm.throttled, "total": n})
                vm.throttled = n
        except Exception as exc:  # a monitoring failure must not break the exec stream
            log.warning("sandbox %s: limit counters: %s", vm.id, exc)

    async def _start_guest(self, vm: _Vm, template_jail: Jail, spec: SandboxSpec,
                           pol: guest_policy.GuestPolicy) -> GuestVm:
        template = await self.templates.get(vm.machine, template_jail)
        assert vm.slot is not None
        return await GuestVm.clone(
            self.templates, template, list(spec.lowers), vm.run_dir, pol.boot_spec(spec),
            spec.resources.disk_bytes, spec.id, data_dir=vm.data_dir,
            jail=self._jail(vm.slot, vm.cg), sink=self.on_event,
            on_end=functools.partial(self._poll_limits, vm))

    async def _template_jail(self) -> tuple[Jail, int]:
        """A jail for a template's boot: a uid slot of its own while it boots."""
        slot = await asyncio.to_thread(self._claim_slot, None)
        return self._jail(slot, None), slot

    async def _teardown(self, sandbox_id: str, meta: dict[str, Any] | None) -> None:
        """Kill and remove everything of a sandbox, whatever state it is in (by its meta:
        also one of an earlier daemon, or half made)."""
        run_dir = self.sandboxes_dir / sandbox_id
        await _kill_recorded(meta or {})
        cg = self.cgroups.path_of(sandbox_id)
        await asyncio.to_thread(cg.remove)
        await asyncio.to_thread(shutil.rmtree, run_dir, True)
        await asyncio.to_thread(shutil.rmtree, self.vms_dir / sandbox_id, True)
        if meta and isinstance(meta.get("slot"), int):
            self._free_slot(meta["slot"])

    # ---- the pool of clones started ahead ------------------------------------------------

    async def _pool_start(self, machine: Machine) -> _PoolVm:
        """A clone of ``machine``'s template for the pool: a uid slot, cgroups
        ``.pool-<slot>`` (the normal CPU class; the create that takes it renames them), its
        VMM started and its guest waiting (:meth:`.guest.GuestVm.prestart`), recorded in
        ``pool/<slot>/meta.json`` (so that a restarted daemon finds and ends it). Raises
        BackendError (nothing left)."""
        template = self.templates.find(machine)
        if template is None:
            raise BackendError(f"no template for machine {machine.key()} yet")
        slot = await asyncio.to_thread(self._claim_slot, None)
        self._pool_slots.add(slot)
        run_dir, data_dir = self.pool_run / str(slot), self.pool_data / str(slot)
        cg: SandboxCgroup | None = None
        vm: QemuVm | None = None
        try:
            cg = await asyncio.to_thread(self.cgroups.create_pooled, str(slot),
                                         self._uid_of(slot), qos=STARTING_QOS)
            if cg is None:
                self._pool_off = (f"cgroup {self.cgroups.version}: a pooled VMM's cgroups "
                                  "cannot be handed to its sandbox (no rename)")
                self.pool.size = 0
                raise BackendError(f"microvm pool off: {self._pool_off}")
            cpu = cg.dirs.get("cpu")
            if cpu is not None:  # (v1) the sandbox's weight is set when one takes it
                with contextlib.suppress(OSError):
                    (cpu / "cpu.shares").write_text(f"{POOL_CPU_SHARES}\n")
            for d in (run_dir, data_dir):
                await asyncio.to_thread(shutil.rmtree, d, True)
            self.pool_run.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.run_root, 0o700)  # host-only: control sockets live below
            run_dir.mkdir(mode=0o700)
            meta: dict[str, Any] = {"slot": slot, "state": "pooled", "key": machine.key()}
            records.write(run_dir, meta)
            started = await GuestVm.prestart(self.templates, template, run_dir,
                                             data_dir=data_dir, jail=self._jail(slot, cg))
            assert isinstance(started, QemuVm)
            vm = started
            # ready once its state is loaded: a create must not wait for the rest of a
            # start that runs at the pool's low CPU weight
            await vm.wait_running()
            meta.update(pid=vm.pid, starttime=starttime(vm.pid))
            records.write(run_dir, meta)
            await asyncio.to_thread(self.uid_slots.bind, slot, POOL_PREFIX + str(slot),
                                    vm.pid)
        except BaseException:
            if vm is not None:
                _close_port(vm)
                await vm.kill()
            await self._pool_remove(slot, cg)
            raise
        return _PoolVm(vm, template, slot, cg, run_dir, data_dir)

    async def _pool_stop(self, p: _PoolVm) -> None:
        """End a pooled clone and remove all of it (VMM, cgroups, dirs, uid slot)."""
        try:
            await p.vm.kill()
            _close_port(p.vm)
            await self._pool_remove(p.slot, p.cg)
        except Exception:
            log.exception("microvm pool: removing the clone of slot %d", p.slot)

    async def _pool_remove(self, slot: int, cg: SandboxCgroup | None) -> None:
        """Remove a pooled clone's cgroups, run and data dirs, and give its slot back."""
        if cg is not None:
            with contextlib.suppress(BackendError):
                await asyncio.to_thread(cg.remove)
        for d in (self.pool_run / str(slot), self.pool_data / str(slot)):
            await asyncio.to_thread(shutil.rmtree, d, True)
        self._pool_slots.discard(slot)
        self._free_slot(slot)

    async def _pool_leftovers(self) -> int:
        """End the pooled clones of an earlier daemon (by their records: pid and start
        time) and remove their cgroups, dirs and slots; returns how many were found."""
        found = set(records.read_all(self.pool_run))
        for root in (self.pool_run, self.pool_data):
            with contextlib.suppress(FileNotFoundError):
                found |= {e.name for e in os.scandir(root)}
        found |= {n.removeprefix(POOL_PREFIX) for n in self.cgroups.existing()
                  if n.startswith(POOL_PREFIX)}
        n = 0
        for tag in sorted(found):
            if not tag.isdigit() or int(tag) in self._pool_slots:
                continue
            meta = records.read(self.pool_run, tag) or {}
            await _kill_recorded(meta)
            slot = int(tag)
            await self._pool_remove(slot, self.cgroups.path_of(POOL_PREFIX + tag))
            n += 1
        return n

    async def _from_pool(self, vm: _Vm, p: _PoolVm, spec: SandboxSpec,
                         pol: guest_policy.GuestPolicy) -> GuestVm:
        """Make ``vm`` (its run dir made, empty) the sandbox of the pooled clone ``p``: its
        run and data dirs renamed to the sandbox's (the VMM keeps its open files: sockets,
        logs, the upper disk), its uid slot and cgroups (renamed, the sandbox's limits set)
        the sandbox's, the layers bound under its placeholders and the boot record sent.
        Raises BackendError or OSError (the caller removes what is left)."""
        os.rename(p.run_dir, vm.run_dir)  # over the empty dir made as the create's claim
        p.vm.run_dir = vm.run_dir
        vm.slot = p.slot
        # its VMM named from now on: a daemon that dies before the create ends leaves a
        # sandbox whose clean-up kills it
        vm.meta.update(pid=p.vm.pid, starttime=starttime(p.vm.pid))
        self._write_meta(vm)
        vm.cg = await asyncio.to_thread(
            self.cgroups.claim, p.cg, vm.id, self._vmm_resources(vm.machine, spec.resources),
            qos=STARTING_QOS)
        self._pool_slots.discard(p.slot)
        self.vms_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.rename(p.data_dir, vm.data_dir)
        return await GuestVm.from_prestarted(
            p.vm, p.template, list(spec.lowers), vm.run_dir, pol.boot_spec(spec), spec.id,
            data_dir=vm.data_dir, sink=self.on_event,
            on_end=functools.partial(self._poll_limits, vm))

    def pool_bytes(self) -> int:
        """Memory the pool's waiting clones hold (their cgroups' resident bytes)."""
        total = 0
        for p in self.pool.waiting():
            with contextlib.suppress(OSError, ValueError, BackendError):
                total += p.cg.memory_usage().resident_bytes
        return total

    def drain_pool(self) -> int:
        """End the pool's waiting clones now and start none for a while (the node is short
        of memory); returns how many."""
        return self.pool.drain()

    # ---- Backend ---------------------------------------------------------------------------

    async def probe(self) -> dict[str, object]:
        """Features: the VMM and its version, the accelerator (and why, once probed), the
        guest kernel, the VMM's cgroups, what a pause keeps, limits of the machine."""
        feats: dict[str, object] = {"backend": self.name, "vmm": self.vmm.name,
                                    "available": True}
        why = self.vmm.available()
        try:
            kit, _ = await asyncio.to_thread(self._boot_files)
            feats["guest_kernel"] = kit.release
        except BackendError as e:
            why = why or str(e)
        if why:
            feats.update(available=False, reason=why)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = await asyncio.to_thread(
                subprocess.run, [self.vmm.binary, "--version"], capture_output=True, text=True,
                timeout=10)
            feats["vmm_version"] = out.stdout.split("\n", 1)[0].strip()
        feats.update({
            "accel": self._accel, "accel_reason": self._accel_reason,
            "kvm_device": os.path.exists("/dev/kvm"),
            "vsock": os.path.exists("/dev/vhost-vsock"),
            "control_channel": "virtio-serial",
            "cgroup": self.cgroups.version,
            "jail": ["cgroup", "uid", "netns", "ipc", "mount", "seccomp"],
            "max_layers": MAX_LAYERS,
            "pause": "snapshot",
            "execs_across_pause": True,
            "free_page_reporting": False,
            "tb_size_mib": self.tb_size_mib,
            "pool": {"size": self.pool.size, "machines": pool_machines,
                     **({"reason": self._pool_off} if self._pool_off else {})},
        })
        return feats

    async def create(self, spec: SandboxSpec) -> None:
        """Create the sandbox (template clone: boot record, HELLO); returns once sbx-init
        answers. Raises BadRequest (spec), Conflict (id in use), BackendError (no guest
        kit, the VMM or the guest failing: the half-made sandbox is removed first)."""
        _check_spec(spec)
        sid = spec.id
        run_dir = self.sandboxes_dir / sid
        if sid in self._vms or sid in self._busy or run_dir.exists():
            raise Conflict(f"sandbox {sid!r} already exists")
        self._busy.add(sid)
        meta: dict[str, Any] = {"id": sid}
        vm: _Vm | None = None
        tslot: int | None = None
        pooled: _PoolVm | None = None
        try:
            pol = await asyncio.to_thread(guest_policy.prepare, spec)
            kit, initrd = await asyncio.to_thread(self._boot_files)
            machine = self.machine_for(spec, await self._accelerator(), kit, initrd)
            if not self.sandboxes_dir.is_dir():
                self.sandboxes_dir.mkdir(parents=True, mode=0o700)
                os.chmod(self.run_root, 0o700)  # host-only: control sockets live below
            run_dir.mkdir(mode=0o700)
            vm = _Vm(sid, run_dir, self.vms_dir / sid, machine, [], meta, policy=pol)
            meta.update(state="creating", machine=dataclasses.asdict(machine),
                        lowers=list(spec.lowers), task_profile=spec.task_profile,
                        resources=dataclasses.asdict(spec.resources), qos=spec.qos)
            pooled = self.pool.take(machine)
            if pooled is not None:
                meta["slot"] = pooled.slot
                try:
                    vm.guest = await self._from_pool(vm, pooled, spec, pol)
                except BaseException as exc:
                    _close_port(pooled.vm)
                    await pooled.vm.kill()
                    with contextlib.suppress(Exception):
                        await self._teardown(sid, None)  # the cgroups if claimed, the dirs
                    await self._pool_remove(pooled.slot, pooled.cg)
                    vm.slot = vm.cg = None
                    meta.pop("slot", None)
                    if not isinstance(exc, BackendError | OSError):
                        raise
                    self.pool.replaced += 1  # e.g. its VMM died as it was taken
                    log.warning("sandbox %s: its clone from the pool failed (%s); cloning "
                                "afresh", sid, exc)
                    run_dir.mkdir(mode=0o700)
            if vm.guest is None:
                vm.slot = await asyncio.to_thread(self._claim_slot, sid)
                meta["slot"] = vm.slot
                self._write_meta(vm)
                # normal CPU class while it starts, the sandbox's once it runs (_settle)
                vm.cg = await asyncio.to_thread(
                    self.cgroups.create, sid, self._vmm_resources(machine, spec.resources),
                    0, qos=STARTING_QOS)
                if self.templates.find(machine) is None:
                    tjail, tslot = await self._template_jail()
                else:
                    tjail = Jail()
                vm.guest = await self._start_guest(vm, tjail, spec, pol)
            vm.disks = vm.guest.disks
            meta.update(pid=vm.guest.vm.pid, starttime=starttime(vm.guest.vm.pid),
                        state="running",
                        disks=[[d.path, d.serial, d.read_only] for d in vm.disks])
            self._write_meta(vm)
            assert vm.slot is not None
            await asyncio.to_thread(self.uid_slots.bind, vm.slot, sid, vm.guest.vm.pid)
            await self._settle(vm, spec.qos)
            self._drop_qmp(vm.guest)
            self._vms[sid] = vm
            self._watch(vm)
            self.pool.want(machine)  # its template exists now: keep clones of it ready
        except BaseException as exc:
            if vm is not None and vm.guest is not None:
                with contextlib.suppress(Exception):
                    await vm.guest.destroy()
            with contextlib.suppress(Exception):
                await self._teardown(sid, meta)
            if isinstance(exc, OSError):
                raise BackendError(f"create sandbox {sid}: {exc}") from exc
            raise
        finally:
            self._busy.discard(sid)
            self._free_slot(tslot)
            if pooled is not None:
                self.pool.done()

    async def _settle(self, vm: _Vm, qos: str) -> None:
        """Move the VMM's CPU cgroup to class ``qos``. A VMM starts (and is snapshotted) in
        :data:`STARTING_QOS` and runs in its sandbox's class: a best-effort VMM is
        SCHED_IDLE, and one that started so on a busy host got no CPU for longer than the
        QMP and boot bounds (30 s at a load average of 60), so creates, resumes and pauses
        of best-effort microVMs failed. Raises BackendError."""
        if vm.cg is not None:
            await asyncio.to_thread(self.cgroups.reclass, vm.cg, qos)

    @staticmethod
    def _drop_qmp(guest: GuestVm) -> None:
        """Close the VMM's monitor connection until it is needed again (one fd less)."""
        if isinstance(guest.vm, QemuVm):
            guest.vm.drop_qmp()

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> SbxExec:
        """Start ``spec.argv`` in the guest; returns once the program runs. Raises NotFound,
        InvalidState (paused, the VMM gone), BadRequest (bad spec, or the program cannot
        start)."""
        vm, guest = self._running(sandbox_id)
        spec.check(self.id_count)
        if spec.kill_leftovers:
            await self.kill_processes(sandbox_id)
        grader = bool(spec.trusted and vm.policy is not None and vm.policy.grader_paths)
        return await guest.conn.exec(
            tuple(spec.argv), spec.env, cwd=spec.cwd, uid=spec.uid, gid=spec.gid,
            timeout_s=spec.timeout_s, output_limit=spec.output_limit, stdin=spec.stdin,
            pty=spec.pty, grader=grader)

    async def kill_processes(self, sandbox_id: str) -> int:
        """SIGKILL every process of the guest but sbx-init, until none is left (sbx-init's
        KILL_ALL: as PID 1 it walks the task list under its lock, so a fork bomb cannot
        outrun it). Raises InvalidState (paused, failed), BackendError."""
        _vm, guest = self._running(sandbox_id)
        n = await guest.conn.kill_all()
        log.info("sandbox %s: killed %d workload processes", sandbox_id, n)
        return n

    async def pause(self, sandbox_id: str) -> None:
        """Snapshot the guest to its data directory and end its VMM (see
        :meth:`.guest.GuestVm.pause`); its cgroups and uid go back. Raises InvalidState
        (failed), BackendError (the VM then still runs)."""
        vm, guest = self._running(sandbox_id)
        self._busy.add(sandbox_id)
        try:
            qos = vm.meta.get("qos", "best_effort")
            await self._settle(vm, STARTING_QOS)  # the snapshot in the normal class too
            try:
                await guest.pause()
            except BaseException:
                with contextlib.suppress(BackendError):
                    await self._settle(vm, qos)
                raise
            vm.paused = True
            self._unwatch(vm)
            vm.meta.update(state="paused", pid=None, starttime=None, slot=None)
            self._write_meta(vm)
            if vm.cg is not None:
                await asyncio.to_thread(vm.cg.remove)
            self._free_slot(vm.slot)
            vm.slot, vm.cg = None, None
        finally:
            self._busy.discard(sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        """Restore a paused guest from its snapshot (a new VMM, cgroups and uid); its execs
        carry on. Raises InvalidState (not paused), BackendError (it then stays paused)."""
        vm = self._get(sandbox_id)
        if not vm.paused:
            raise InvalidState(f"sandbox {sandbox_id} is not paused")
        self._busy.add(sandbox_id)
        slot: int | None = None
        cg: SandboxCgroup | None = None
        try:
            slot = await asyncio.to_thread(self._claim_slot, sandbox_id)
            res = Resources(**vm.meta.get("resources", {}))
            cg = await asyncio.to_thread(self.cgroups.create, sandbox_id,
                                         self._vmm_resources(vm.machine, res), 0,
                                         qos=STARTING_QOS)
            jail = self._jail(slot, cg)
            on_end = functools.partial(self._poll_limits, vm)
            if vm.guest is None:  # adopted while paused: a new client
                vm.guest = await GuestVm.restored(
                    self.vmm, vm.machine, vm.disks, vm.run_dir, vm.data_dir, sandbox_id,
                    jail=jail, sink=self.on_event, on_end=on_end)
            else:
                await vm.guest.resume(self.vmm, vm.machine, jail=jail, sink=self.on_event,
                                      on_end=on_end)
        except BaseException:
            if cg is not None:
                with contextlib.suppress(BackendError):
                    await asyncio.to_thread(cg.remove)
            self._free_slot(slot)
            raise
        finally:
            self._busy.discard(sandbox_id)
        vm.slot, vm.cg, vm.paused = slot, cg, False
        try:
            await self._settle(vm, vm.meta.get("qos", "best_effort"))
        except BackendError as exc:  # it runs; only its class is not yet the sandbox's
            log.warning("sandbox %s: %s", sandbox_id, exc)
        pid = vm.guest.vm.pid
        vm.meta.update(state="running", pid=pid, starttime=starttime(pid), slot=slot)
        self._write_meta(vm)
        with contextlib.suppress(FileNotFoundError):
            (vm.data_dir / "snapshot").unlink()  # stale from now on
        try:
            await asyncio.to_thread(self.uid_slots.bind, slot, sandbox_id, pid)
        except (OSError, BackendError) as exc:
            log.warning("sandbox %s: uid slot %d: cannot update its claim: %s", sandbox_id,
                        slot, exc)
        self._drop_qmp(vm.guest)
        self._watch(vm)

    async def destroy(self, sandbox_id: str) -> None:
        """Kill the VMM, remove its cgroups, disks, snapshot and run directory. Idempotent;
        unknown ids are a no-op."""
        vm = self._vms.pop(sandbox_id, None)
        self._busy.add(sandbox_id)
        try:
            meta = self._meta(sandbox_id)
            if vm is not None:
                self._unwatch(vm)
                if vm.guest is not None:
                    with contextlib.suppress(BackendError):  # a dying VMM gets CPU too
                        await self._settle(vm, STARTING_QOS)
                    await vm.guest.destroy()
                meta = meta or vm.meta
            await self._teardown(sandbox_id, meta)
        finally:
            self._busy.discard(sandbox_id)

    async def stats(self, sandbox_id: str) -> dict[str, int]:
        """``memory_bytes``: what the VMM's memory cgroup is charged (the guest RAM it has
        touched that is not the template's, QEMU's own memory, the upper's page cache);
        ``cpu_usage_ns``: the VMM's CPU; ``upper_bytes``: what the upper disk file holds on
        the host; ``guest_memory_bytes``: the guest's RAM size; paused: ``snapshot_bytes``
        and no memory. (No ``pids``: the guest's tasks are the guest's.)"""
        vm = self._get(sandbox_id)
        out: dict[str, int] = {"memory_bytes": 0, "cpu_usage_ns": 0,
                               "guest_memory_bytes": vm.machine.memory_mib << 20}
        if vm.cg is not None:
            st = await asyncio.to_thread(vm.cg.stats)
            out["memory_bytes"], out["cpu_usage_ns"] = st["memory_bytes"], st["cpu_usage_ns"]
        with contextlib.suppress(OSError):
            out["upper_bytes"] = os.stat(vm.data_dir / "upper.img").st_blocks * 512
        if vm.paused:
            with contextlib.suppress(OSError):
                out["snapshot_bytes"] = os.stat(vm.data_dir / "snapshot").st_blocks * 512
        return out

    async def memory(self, sandbox_id: str) -> MemoryUsage:
        """The VMM's memory as its cgroup counts it (zeros while paused)."""
        vm = self._get(sandbox_id)
        if vm.cg is None:
            return MemoryUsage()
        return await asyncio.to_thread(vm.cg.memory_usage)

    async def reclaim(self, sandbox_id: str, nbytes: int | None = None) -> int:
        """Page the VMM's cold private memory out to swap (``process_madvise(MADV_PAGEOUT)``
        over its private mappings: the guest pages it copied from the template or filled,
        QEMU's own heap and translation cache; pages shared with other clones stay);
        ``nbytes`` is not a bound. Returns the bytes its cgroup's resident memory went down
        by (0 while paused: it holds none). Raises NotFound, BackendError."""
        vm = self._get(sandbox_id)
        if vm.cg is None or vm.guest is None or vm.paused:
            return 0
        cg, pid = vm.cg, vm.guest.vm.pid

        def run() -> int:
            before = cg.memory_usage().resident_bytes
            memadvise.advise(pid, memadvise.PAGEOUT)
            return max(0, before - cg.memory_usage().resident_bytes)

        try:
            return await asyncio.to_thread(run)
        except OSError as exc:
            raise BackendError(f"sandbox {sandbox_id}: reclaim: {exc}") from exc

    async def prefetch(self, sandbox_id: str) -> None:
        """Start reading the VMM's swapped pages back (``MADV_WILLNEED``); nothing while
        paused (a resume reads the snapshot)."""
        vm = self._get(sandbox_id)
        if vm.guest is None or vm.paused:
            return
        try:
            await asyncio.to_thread(memadvise.advise, vm.guest.vm.pid, memadvise.WILLNEED)
        except OSError as exc:
            raise BackendError(f"sandbox {sandbox_id}: prefetch: {exc}") from exc

    def totals(self) -> MemoryUsage:
        """Every VMM's memory together (their parent cgroup)."""
        return self.cgroups.totals()

    def set_memory_limit(self, nbytes: int) -> None:
        """Cap all VMMs' memory together at ``nbytes`` (0: no cap)."""
        self.cgroups.set_memory_limit(nbytes)

    async def put_file(self, sandbox_id: str, path: str, data: AsyncIterator[bytes],
                       mode: int = 0o644, uid: int = 0, gid: int = 0) -> int:
        """Write a file in the guest (sbx-init's FILE_PUT: resolved inside the sandbox's
        root, renamed into place whole). Raises BadRequest, NotFound, InvalidState."""
        _vm, guest = self._running(sandbox_id)
        if not (0 <= uid < self.id_count and 0 <= gid < self.id_count):
            raise BadRequest(f"uid/gid {uid}/{gid} outside 0..{self.id_count - 1}")
        return await guest.conn.put_file(path, data, mode=mode, uid=uid, gid=gid)

    async def get_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """Stream a file of the guest (sbx-init's FILE_GET). Raises NotFound (absent),
        BadRequest, InvalidState."""
        _vm, guest = self._running(sandbox_id)
        return await guest.conn.get_file(path)

    async def list_existing(self) -> list[str]:
        """Ids whose VMM is alive (pid and start time match) or that are paused (their
        snapshot is on disk)."""
        out = []
        for sid, meta in self._metas().items():
            if self._alive(meta) or (meta.get("state") == "paused"
                                     and (self.vms_dir / sid / "snapshot").is_file()):
                out.append(sid)
        return sorted(out)

    async def adopt(self, sandbox_id: str) -> None:
        """Take over a sandbox of an earlier daemon: a live VMM is reconnected to (the
        guest's sbx-init ends the execs of its old client), a paused one is kept for its
        resume. Raises NotFound if it is neither."""
        if sandbox_id in self._vms:
            return
        meta = self._meta(sandbox_id)
        if meta is None:
            raise NotFound(f"sandbox {sandbox_id!r}: no sandbox to adopt")
        try:
            machine = Machine(**meta["machine"])
            disks = [Disk(p, s, bool(ro)) for p, s, ro in meta.get("disks") or []]
        except (KeyError, TypeError, ValueError) as e:
            raise NotFound(f"sandbox {sandbox_id!r}: unreadable meta: {e}") from e
        vm = _Vm(sandbox_id, self.sandboxes_dir / sandbox_id, self.vms_dir / sandbox_id,
                 machine, disks, meta)
        if meta.get("state") == "paused" and (vm.data_dir / "snapshot").is_file():
            vm.paused = True
            self._vms[sandbox_id] = vm
            return
        if not self._alive(meta):
            raise NotFound(f"sandbox {sandbox_id!r}: no live sandbox to adopt")
        pid = int(meta["pid"])
        vm.slot = meta.get("slot")
        vm.cg = self.cgroups.path_of(sandbox_id)
        vm.guest = await GuestVm.attach(QemuVm(pid, vm.run_dir), vm.run_dir,
                                        vm.data_dir, disks, sandbox_id, sink=self.on_event,
                                        on_end=functools.partial(self._poll_limits, vm))
        if isinstance(vm.slot, int):
            self._slots.add(vm.slot)
            try:
                await asyncio.to_thread(self.uid_slots.bind, vm.slot, sandbox_id, pid)
            except (OSError, BackendError) as exc:
                log.warning("sandbox %s: uid slot %d: cannot update its claim: %s",
                            sandbox_id, vm.slot, exc)
        with contextlib.suppress(OSError, ValueError):
            vm.policy = await asyncio.to_thread(guest_policy.prepare, SandboxSpec(
                id=sandbox_id, lowers=tuple(meta.get("lowers") or ()), resources=Resources(),
                env={}, hostname="x", task_profile=meta.get("task_profile")))
        self._vms[sandbox_id] = vm
        self._watch(vm)

    async def cleanup_leftovers(self, keep: set[str]) -> list[str]:
        """Tear down every sandbox found in the run or data directories or our cgroups that
        is neither in ``keep`` nor attached here: dead, half-made, or unwanted live ones;
        and templates' half-made directories. Returns the ids removed. Clones of an earlier
        daemon's pool are ended and removed too (never adopted)."""
        metas = self._metas()
        found = set(metas) | {n for n in self.cgroups.existing()
                              if not n.startswith(POOL_PREFIX)}
        with contextlib.suppress(FileNotFoundError):
            found |= {e.name for e in os.scandir(self.vms_dir)}
        ids = found - keep - set(self._vms) - self._busy
        removed = await remove_leftovers(ids, metas, self._teardown)
        n = await self._pool_leftovers()  # never adopted: a pool's clone is no sandbox
        if n:
            log.info("microvm pool: removed %d clones of an earlier daemon", n)
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.templates.root):
                # ".<key>.<pid>": a template boot of a daemon that died before it finished
                pid = e.name.rpartition(".")[2]
                if e.name.startswith(".") and pid.isdigit() and starttime(int(pid)) is None:
                    await asyncio.to_thread(shutil.rmtree, e.path, True)
        return removed

    async def warm(self) -> None:
        """Nothing ahead of demand: the first create of a machine boots its template, and
        the pool keeps clones of the machines of the last creates (:mod:`.pool`)."""

    async def close(self) -> None:
        """End the pool's clones (no VMM, cgroup, socket or file of theirs left) and drop
        the control connections (the guests' sbx-init then end the execs of this daemon,
        as a container's do) and the templates' memfds; sandboxes' VMs keep running for a
        later adopt. With no sandbox left, also remove our (empty) parent cgroups."""
        await self.pool.close()
        for vm in list(self._vms.values()):
            self._unwatch(vm)
            if vm.guest is not None:
                with contextlib.suppress(Exception):
                    await vm.guest.conn.close()
                if isinstance(vm.guest.vm, QemuVm):
                    vm.guest.vm.close()
        self._vms.clear()
        self.templates.close()
        if not self._metas() and not self._busy:
            self.cgroups.prune()


async def _wait_readable(fd: int, timeout_s: float) -> None:
    """Wait until ``fd`` (a pidfd) is readable: its process ended. Raises BackendError after
    ``timeout_s``."""
    with readable(fd) as ended:
        try:
            await asyncio.wait_for(ended, timeout_s)
        except TimeoutError as exc:
            raise BackendError(f"VMM still running {timeout_s} s after SIGKILL") from exc


def _close_port(vm: QemuVm) -> None:
    """Close the control port connection a started-ahead clone holds (if any)."""
    port = vm.take_port()
    if port is not None:
        with contextlib.suppress(RuntimeError):  # its loop closed (the process goes on)
            port[1].close()


async def _kill_recorded(meta: dict[str, Any]) -> None:
    """SIGKILL the process a record names (pid and start time: not a reused pid) and wait
    until it has ended."""
    if not (meta and records.alive(meta)):
        return
    try:
        pidfd = os.pidfd_open(int(meta["pid"]))
    except ProcessLookupError:
        return
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        await _wait_readable(pidfd, 10.0)
    finally:
        os.close(pidfd)


def _cause_text(cause: dict[str, object]) -> str:
    """A failure cause in words (:func:`edged.backends.base.failure_text`) and the guest
    console's line that says why: ``the guest kernel crashed (status unknown): Kernel panic
    - ...``."""
    log_line = cause.get("log")
    return failure_text(cause) + (f": {log_line}" if log_line else "")


def _check_spec(spec: SandboxSpec) -> None:
    spec.check()
    if spec.network != "none":
        raise BadRequest(f"network {spec.network!r}: only 'none' is supported")
    if len(spec.lowers) > MAX_LAYERS:
        raise BadRequest(f"lowers: a microVM takes at most {MAX_LAYERS} layers, not "
                         f"{len(spec.lowers)}")
    bad = guest_policy.image_paths_ok(spec.lowers)
    if bad:
        raise BadRequest(bad)
    if spec.resources.disk_bytes < (16 << 20):
        raise BadRequest(f"disk_bytes {spec.resources.disk_bytes}: a microVM's upper disk "
                         f"needs at least 16 MiB")


__all__ = ["MAX_LAYERS", "MicroVmBackend"]
