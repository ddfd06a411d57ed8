"""Container sandboxes: namespaces + id-mapped overlay rootfs made by the C spawner
(``csrc/spawner``), run by sbx-init (``csrc/sbx-init``) as PID 1, limited by cgroups."""

from __future__ import annotations

from edged.backends.base import EventSink
from edged.backends.container.backend import ContainerBackend
from edged.config import Config


def from_config(config: Config, sink: EventSink | None) -> ContainerBackend:
    """The daemon's container backend (:mod:`edged.backends.registry`): per-sandbox state
    under ``runtime_dir``, ``spawner_pool`` spawners started ahead, events to ``sink``."""
    return ContainerBackend(config.runtime_dir, on_event=sink,
                            spawner_pool=config.spawner_pool,
                            swap_share=config.sandbox_swap_share,
                            spare_idle_s=config.spare_idle_s)


__all__ = ["ContainerBackend", "from_config"]
