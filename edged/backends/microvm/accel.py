"""Which accelerator the node's microVMs use: KVM where a guest actually runs on it, TCG
otherwise.

``/dev/kvm`` existing is not enough: on the development machines it is a nested paravirtual
KVM on which guests hang (``../shared/reference/host.md``). So the probe boots a real guest
(the same kernel and initramfs, 128 MiB, a placeholder layer disk and a small upper, which
its sbx-init mounts before it is ready) with ``-accel kvm`` and waits
for sbx-init's ready record on the control port within a bound; a guest that does not answer
by then, or a QEMU that refuses KVM, means TCG.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from edged.backends.microvm import boot, disks
from edged.backends.microvm.template import open_port, read_exact
from edged.backends.microvm.vmm import Disk, Machine, Vmm
from edged.errors import BackendError

#: A KVM guest reaches sbx-init in well under a second; TCG takes ~3-5 s here.
KVM_BOUND_S = 8.0


@dataclass(frozen=True)
class AccelProbe:
    """The probe's verdict: ``accel`` (``"kvm"`` or ``"tcg"``), ``reason`` (why not KVM, or
    ``"ok"``), ``boot_s`` (the KVM guest's time to ready, when it came up)."""

    accel: str
    reason: str
    boot_s: float | None = None


async def probe(vmm: Vmm, machine: Machine, run_root: Path,
                bound_s: float = KVM_BOUND_S) -> AccelProbe:
    """Boot ``machine`` (its kernel/initrd) under KVM with 128 MiB, a placeholder layer
    disk and a 16 MiB upper; KVM if its guest is ready within ``bound_s`` seconds, else TCG
    with the reason."""
    dev = Path("/dev/kvm")
    if not dev.exists():
        return AccelProbe("tcg", "no /dev/kvm")
    if not os.access(dev, os.R_OK | os.W_OK):
        return AccelProbe("tcg", "/dev/kvm not accessible")
    m = dataclasses.replace(machine, accel="kvm", memory_mib=128, vcpus=1, ndisks=2,
                            free_page_reporting=False, tb_size_mib=None,
                            upper_bytes=disks.MIN_BYTES)
    run_root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="kvm-probe-", dir=run_root))
    t0 = time.monotonic()
    vm = None
    try:
        upper = run_dir / "upper.img"
        await asyncio.to_thread(disks.make_upper, upper, m.upper_bytes)
        vm = await vmm.boot(m, [Disk(None, f"{boot.SERIAL_LOWER}0"),
                                Disk(str(upper), boot.SERIAL_UPPER, read_only=False)],
                            run_dir, None, share=False)
        reader, writer = await open_port(vm)
        try:
            boot.parse_ready(await read_exact(reader, boot.READY.size, "ready record", vm,
                                              bound_s))
        finally:
            writer.close()
        return AccelProbe("kvm", "ok", time.monotonic() - t0)
    except BackendError as e:
        what = "QEMU refused KVM" if vm is not None and not vm.alive() else (
            f"no guest within {bound_s:.0f} s")
        return AccelProbe("tcg", f"{what}: {str(e)[:300]}")
    except ValueError as e:
        return AccelProbe("tcg", f"KVM guest sent a bad ready record: {e}")
    finally:
        if vm is not None:
            await vm.kill()
        await asyncio.to_thread(shutil.rmtree, run_dir, True)
