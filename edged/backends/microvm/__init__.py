"""MicroVM sandboxes: QEMU guests cloned from a booted template, the node's EROFS layer
images as read-only disks, sbx-init as the guest's PID 1 over virtio-serial
(:mod:`.backend`; the pieces in the modules beside it)."""

from __future__ import annotations

from edged.backends.base import EventSink
from edged.backends.microvm.backend import MicroVmBackend
from edged.config import Config


def from_config(config: Config, sink: EventSink | None) -> MicroVmBackend:
    """The daemon's microVM backend (:mod:`edged.backends.registry`): VMs' sockets under
    ``runtime_dir``, their disks, snapshots and templates under ``state_dir``, the
    accelerator ``microvm_accel``, ``microvm_pool`` clones started ahead per machine,
    events to ``sink``."""
    return MicroVmBackend(config.runtime_dir, config.state_dir, accel=config.microvm_accel,
                          tb_size_mib=config.microvm_tb_size_mib or None,
                          swap_share=config.sandbox_swap_share, pool=config.microvm_pool,
                          on_event=sink)


__all__ = ["MicroVmBackend", "from_config"]
