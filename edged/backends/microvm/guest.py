"""One running microVM sandbox: its VMM, its disks and the sbx-init connection on its
control port.

:meth:`GuestVm.clone` is the fast create: upper disk, template clone, boot record, HELLO.
The sbx-init client is the shared one (:mod:`edged.sbxinit`): the protocol is the
container's, only the byte stream (the guest's virtio-serial port) differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edged.backends.base import EventSink, ExecEnd
from edged.backends.microvm import boot, disks
from edged.backends.microvm.qemu import QemuVm, qemu_log_tail
from edged.backends.microvm.template import (
    BOOT_TIMEOUT_S,
    Template,
    Templates,
    boot_guest,
    console_tail,
    open_port,
    read_exact,
)
from edged.backends.microvm.vmm import Disk, Jail, Machine, Vm, Vmm
from edged.errors import BackendError
from edged.sbxinit import SbxClient, SbxExec

HELLO_TIMEOUT_S = 30.0
#: A restarted daemon's first HELLO waits this long (seconds; times the attempt after that)
#: before it drops the connection and tries again: a guest whose sbx-init had not yet seen
#: the old daemon's connection go answers on the old stream, and that answer never comes
#: back (seen under load: a 30 s wait for nothing); once sbx-init sees a connection end it
#: reopens its port, and the next connection is heard.
ATTACH_HELLO_S = 2.0
#: Seconds (times the attempt) between dropping a connection that got no answer and the
#: next: enough for the guest to see the host go.
ATTACH_GONE_S = 0.2


async def _hello(name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 sink: EventSink | None = None, on_end: Callable[[], None] | None = None,
                 new_client: bool = False, timeout_s: float = HELLO_TIMEOUT_S) -> SbxClient:
    conn = SbxClient(name, reader, writer, sink, on_end)
    try:
        await conn.hello(timeout_s, new_client)
    except BaseException:
        await conn.close()
        raise
    return conn


def vmm_state(vm: Vm) -> str:
    """What a failed restore's VMM says of itself, for the error: whether it still runs
    (else its exit status or signal, when it was our child), the end of QEMU's log and of
    the guest's console (a guest that panicked, a state that did not load)."""
    if vm.alive():
        state = "the VMM still runs"
    else:
        code = vm.returncode() if isinstance(vm, QemuVm) else None
        state = ("the VMM exited" if code is None else
                 f"the VMM was killed by signal {-code}" if code < 0 else
                 f"the VMM exited with status {code}")
    return (f"{state}; qemu: {qemu_log_tail(vm.run_dir, 600)!r}; "
            f"console: {console_tail(vm.run_dir, 600)!r}")


@dataclass
class Timings:
    """Where a create's time went, seconds: ``upper`` (the upper disk's copy, or mkfs),
    ``vmm`` (VMM start and state load requested), ``boot`` (boot record to answer, host
    side), ``guest_boot`` (the guest's own count of that, by step in ``guest_steps``),
    ``hello``; ``total``."""

    upper: float = 0.0
    vmm: float = 0.0
    boot: float = 0.0
    guest_boot: float = 0.0
    hello: float = 0.0
    total: float = 0.0
    guest_steps: dict[str, float] = field(default_factory=dict)


@dataclass
class GuestVm:
    """A microVM sandbox that is up: ``vm``, ``conn`` (sbx-init), ``run_dir`` (sockets,
    console, logs), ``data_dir`` (the upper disk, a paused VM's snapshot: on the node's
    disk, not in memory), ``disks``."""

    vm: Vm
    conn: SbxClient
    run_dir: Path
    disks: list[Disk]
    timings: Timings = field(default_factory=Timings)
    data_dir: Path | None = None

    @property
    def upper(self) -> Path:
        """The upper disk file."""
        return (self.data_dir or self.run_dir) / "upper.img"

    @classmethod
    async def clone(cls, templates: Templates, template: Template, layers: Sequence[str],
                    run_dir: Path, spec: boot.BootSpec, disk_bytes: int = 1 << 30,
                    sandbox_id: str = "", *, data_dir: Path | None = None,
                    jail: Jail | None = None, sink: EventSink | None = None,
                    on_end: Callable[[], None] | None = None) -> GuestVm:
        """Create a sandbox from ``template``: ``layers`` are EROFS image files, bottom
        first (one disk each, read-only, no copy); the upper disk, a copy of the
        template's (which the guest has mounted already), is made in ``data_dir`` (default
        ``run_dir``). The machine's disk count must be ``len(layers) + 1``, its upper's
        size ``disk_bytes``. The VMM is confined by ``jail``; ``sink``/``on_end`` go to
        the sbx-init client
        (:class:`~edged.sbxinit.SbxClient`). Raises BackendError (and leaves nothing
        running, nor ``run_dir`` and ``data_dir``) if any step fails."""
        if len(layers) + 1 != template.machine.ndisks:
            raise BackendError(f"{len(layers)} layers for a template with "
                               f"{template.machine.ndisks - 1} layer disks")
        if disk_bytes != template.machine.upper_bytes:
            raise BackendError(f"upper disk of {disk_bytes} bytes for a template whose upper "
                               f"has {template.machine.upper_bytes}")

        async def start(dl: list[Disk]) -> Vm:
            return await templates.clone(template, dl, run_dir, jail)

        def upper(path: Path) -> None:
            disks.copy_upper(template.upper, path)

        return await cls._launch(start, False, layers, run_dir, data_dir, spec, upper,
                                 sandbox_id, sink, on_end)

    @classmethod
    async def prestart(cls, templates: Templates, template: Template, run_dir: Path, *,
                       data_dir: Path | None = None, jail: Jail | None = None) -> Vm:
        """A clone of ``template`` started ahead of its sandbox, for :meth:`from_prestarted`:
        its VMM up, the template's state loaded and its guest waiting for a boot record on
        the control port (connected: :meth:`~.vmm.Vm.take_port`), its upper disk (a copy
        of the template's) in ``data_dir`` (default ``run_dir``), its layer disks
        placeholders. What a create then no longer waits for is the VMM's start and the
        state's load (~35 ms of ~330 quiet here; 2026-12-01). Raises BackendError (and
        leaves nothing running, nor the upper)."""
        upper = (data_dir or run_dir) / "upper.img"
        for d in (run_dir, data_dir):
            if d is not None:
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
        await asyncio.to_thread(disks.copy_upper, template.upper, upper)
        dl = [*(Disk(None, f"{boot.SERIAL_LOWER}{i}")
                for i in range(template.machine.ndisks - 1)),
              Disk(str(upper), boot.SERIAL_UPPER, read_only=False)]
        try:
            return await templates.clone(template, dl, run_dir, jail, swappable=True)
        except BaseException:
            upper.unlink(missing_ok=True)
            raise

    @classmethod
    async def from_prestarted(cls, vm: Vm, template: Template, layers: Sequence[str],
                              run_dir: Path, spec: boot.BootSpec, sandbox_id: str = "", *,
                              data_dir: Path | None = None, sink: EventSink | None = None,
                              on_end: Callable[[], None] | None = None) -> GuestVm:
        """Create a sandbox on ``vm``, a clone of ``template`` from :meth:`prestart` (with
        the same ``run_dir`` and ``data_dir``): ``layers`` bound under its placeholder
        disks while its guest waits (:meth:`~.vmm.Vm.bind_disks`), then the boot record
        and HELLO as in :meth:`clone`. Raises BackendError (and leaves nothing running,
        nor ``run_dir`` and ``data_dir``) if any step fails."""
        async def start(dl: list[Disk]) -> Vm:
            try:
                if len(layers) + 1 != template.machine.ndisks:
                    raise BackendError(f"{len(layers)} layers for a template with "
                                       f"{template.machine.ndisks - 1} layer disks")
                await vm.bind_disks(list(enumerate(dl[:-1])))
            except BaseException:
                port = vm.take_port()
                if port is not None:
                    port[1].close()
                await vm.kill()
                raise
            return vm

        def upper(path: Path) -> None:
            if not path.is_file():
                raise BackendError(f"VM {run_dir.name}: no upper disk {path} (prestart)")

        return await cls._launch(start, False, layers, run_dir, data_dir, spec, upper,
                                 sandbox_id, sink, on_end)

    @classmethod
    async def cold_boot(cls, vmm: Vmm, machine: Machine, layers: Sequence[str],
                        run_dir: Path, spec: boot.BootSpec, disk_bytes: int = 1 << 30,
                        sandbox_id: str = "", *, data_dir: Path | None = None,
                        jail: Jail | None = None, sink: EventSink | None = None,
                        on_end: Callable[[], None] | None = None) -> GuestVm:
        """As :meth:`clone`, but boot the kernel afresh (RAM anonymous, private; the upper
        disk made by mkfs): the baseline a template saves, and the way when no template can
        be made."""
        async def start(dl: list[Disk]) -> Vm:
            return await vmm.boot(machine, dl, run_dir, None, share=False, jail=jail)

        def upper(path: Path) -> None:
            disks.make_upper(path, disk_bytes)

        return await cls._launch(start, True, layers, run_dir, data_dir, spec, upper,
                                 sandbox_id, sink, on_end)

    @classmethod
    async def _launch(cls, start: Callable[[list[Disk]], Awaitable[Vm]], wait_ready: bool,
                      layers: Sequence[str], run_dir: Path, data_dir: Path | None,
                      spec: boot.BootSpec, make_upper: Callable[[Path], None],
                      sandbox_id: str, sink: EventSink | None,
                      on_end: Callable[[], None] | None) -> GuestVm:
        t = Timings()
        t0 = time.monotonic()
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if data_dir is not None:
            data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        upper = (data_dir or run_dir) / "upper.img"
        vm: Vm | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            await asyncio.to_thread(make_upper, upper)
            t.upper = time.monotonic() - t0
            dl = [Disk(p, f"{boot.SERIAL_LOWER}{i}") for i, p in enumerate(layers)]
            dl.append(Disk(str(upper), boot.SERIAL_UPPER, read_only=False))
            vm = await start(dl)
            reader, writer = await open_port(vm)
            if wait_ready:
                boot.parse_ready(await read_exact(reader, boot.READY.size, "ready record", vm,
                                                  BOOT_TIMEOUT_S))
            t.vmm = time.monotonic() - t0 - t.upper
            t1 = time.monotonic()
            t.guest_boot, t.guest_steps = await boot_guest(reader, writer, vm, spec)
            t.boot = time.monotonic() - t1
            t2 = time.monotonic()
            conn = await _hello(sandbox_id or run_dir.name, reader, writer, sink, on_end)
            t.hello = time.monotonic() - t2
        except BaseException:
            if writer is not None:
                writer.close()
            if vm is not None:
                await vm.kill()
            await asyncio.to_thread(shutil.rmtree, run_dir, True)
            if data_dir is not None:
                await asyncio.to_thread(shutil.rmtree, data_dir, True)
            raise
        t.total = time.monotonic() - t0
        return cls(vm, conn, run_dir, dl, t, data_dir)

    @property
    def snapshot(self) -> Path:
        """Where :meth:`pause` saves the VM."""
        return (self.data_dir or self.run_dir) / "snapshot"

    async def pause(self, snapshot: Path | None = None) -> None:
        """Snapshot the VM to ``snapshot`` (default :attr:`snapshot`: device state and every
        RAM page the guest has, zero pages excepted) and end the VMM: nothing of it stays in
        host memory but what the page cache keeps of the snapshot file. The upper disk
        stays as it is.

        Execs go on across the pause: sbx-init is first quiesced (it has sent all it had
        and sends nothing more; :meth:`~edged.sbxinit.SbxClient.quiesce`), so the guest is
        saved with nothing in flight between it and us; their processes stop with the
        guest, and after :meth:`resume` they run on and their output and ends come over
        the same connection. Raises BackendError (the VM then still runs)."""
        await self.conn.quiesce()
        try:
            await self.vm.save(snapshot or self.snapshot)
        except BaseException:
            # a save that failed leaves the guest running as it was: speak to it again
            self.conn.unquiesce()
            with contextlib.suppress(Exception):
                await self.vm.cont()
            raise
        await self.vm.kill()
        await self.conn.detach()

    async def resume(self, vmm: Vmm, machine: Machine, snapshot: Path | None = None,
                     jail: Jail | None = None, fresh: bool = False,
                     sink: EventSink | None = None,
                     on_end: Callable[[], None] | None = None) -> None:
        """Start a VMM from ``snapshot`` (default :attr:`snapshot`) with this sandbox's
        disks, confined by ``jail``, and go on over the same sbx-init connection (the
        guest's execs carry on). ``fresh``: a new client instead (a restarted daemon, which
        has none of the paused one's execs): the guest's sbx-init sees its old client go,
        which kills the execs it had, and a new connection is made (``sink``, ``on_end``).
        Raises BackendError (the VMM is then gone).

        RAM: anonymous, filled from the snapshot (only the pages it holds are allocated).
        Not the template's file mapped privately as a clone has it: loading a stream writes
        every page it holds and zeroes every other page that is not zero in the file, so
        the resumed VM had a private copy of all its RAM (309 MiB PSS for a 256 MiB guest
        measured here, against ~94 MiB before the pause)."""
        if fresh or self.conn.closed:
            # ours end "killed"; the guest's sbx-init drops them (HELLO_NEW_CLIENT)
            await self.conn.close()
            again = await self.restored(vmm, machine, self.disks, self.run_dir,
                                        self.data_dir, self.conn.sandbox_id, snapshot,
                                        jail=jail, sink=sink, on_end=on_end)
            self.vm, self.conn = again.vm, again.conn
            return
        vm = await vmm.restore(machine, self.disks, self.run_dir, None,
                               snapshot or self.snapshot, jail)
        try:
            await self.conn.reattach(*await open_port(vm), HELLO_TIMEOUT_S)
        except BackendError as exc:
            why = vmm_state(vm)
            await vm.kill()
            raise BackendError(f"{exc}; {why}") from exc
        except BaseException:
            await vm.kill()
            raise
        self.vm = vm

    @classmethod
    async def restored(cls, vmm: Vmm, machine: Machine, disks: list[Disk], run_dir: Path,
                       data_dir: Path | None, sandbox_id: str, snapshot: Path | None = None,
                       *, jail: Jail | None = None, sink: EventSink | None = None,
                       on_end: Callable[[], None] | None = None) -> GuestVm:
        """A paused sandbox of which nothing is left but its files (a restarted daemon's):
        restored from ``snapshot`` (default ``<data_dir>/snapshot``) and spoken to as a new
        client, which ends the execs the guest still had of the old one. Raises
        BackendError (the VMM is then gone)."""
        snap = snapshot or (data_dir or run_dir) / "snapshot"
        vm = await vmm.restore(machine, disks, run_dir, None, snap, jail)
        try:
            reader, writer = await open_port(vm)
            conn = await _hello(sandbox_id, reader, writer, sink, on_end, new_client=True)
        except BackendError as exc:
            why = vmm_state(vm)
            await vm.kill()
            raise BackendError(f"{exc}; {why}") from exc
        except BaseException:
            await vm.kill()
            raise
        return cls(vm, conn, run_dir, list(disks), data_dir=data_dir)

    @classmethod
    async def attach(cls, vm: Vm, run_dir: Path, data_dir: Path | None, disks: list[Disk],
                     sandbox_id: str, *, sink: EventSink | None = None,
                     on_end: Callable[[], None] | None = None) -> GuestVm:
        """A running VM of a restarted daemon: connected to its control port again as a new
        client (the guest's sbx-init ends the old client's execs, if it has not seen it go
        yet). Raises BackendError."""
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        for attempt in itertools.count(1):
            reader, writer = await open_port(vm)
            left = deadline - time.monotonic()
            try:
                conn = await _hello(sandbox_id, reader, writer, sink, on_end, new_client=True,
                                    timeout_s=min(left, ATTACH_HELLO_S * attempt))
            except BackendError:
                if time.monotonic() + ATTACH_HELLO_S >= deadline:
                    raise
                # Come back once the guest has seen this connection go (see ATTACH_HELLO_S)
                await asyncio.sleep(ATTACH_GONE_S * attempt)
                continue
            return cls(vm, conn, run_dir, list(disks), data_dir=data_dir)
        raise AssertionError("unreachable")  # pragma: no cover

    async def start(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                    cwd: str = "/", timeout_s: float | None = None, uid: int = 0,
                    gid: int = 0) -> SbxExec:
        """Start a command (stdin /dev/null); returns once it runs. Raises BackendError or
        BadRequest as sbx-init answers."""
        return await self.conn.exec(tuple(argv), env or {"PATH": "/usr/bin:/bin"}, cwd=cwd,
                                    uid=uid, gid=gid, timeout_s=timeout_s)

    async def run(self, argv: Sequence[str], **kw: object) -> tuple[ExecEnd, bytes, bytes]:
        """Run a command to its end: ``(end, stdout, stderr)``."""
        h = await self.start(argv, **kw)  # type: ignore[arg-type]
        out, err = bytearray(), bytearray()
        async for item in h.events():
            if isinstance(item, ExecEnd):
                return item, bytes(out), bytes(err)
            (out if item[0] == "stdout" else err).extend(item[1])
        raise BackendError("exec ended without an END")  # pragma: no cover

    async def destroy(self) -> None:
        """Kill the VMM, drop the connection, remove the run and data directories (upper
        disk, snapshot, sockets, console). Idempotent."""
        await self.vm.kill()
        with contextlib.suppress(Exception):
            await self.conn.close()
        await asyncio.to_thread(shutil.rmtree, self.run_dir, True)
        if self.data_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self.data_dir, True)
