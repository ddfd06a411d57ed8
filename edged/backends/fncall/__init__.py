"""FnCall: stateless calls (source + stdin + limits -> verdict, output, time, memory) served
from a pool of warm container sandboxes per image (DSec §2.2, §3.1, §7): the backend
(:mod:`.backend`), its pools (:mod:`.pool`), the call server that runs inside each pool
sandbox (:mod:`.server`), languages as data (:mod:`.languages`), kept compile results
(:mod:`.artifacts`)."""

from __future__ import annotations

from edged.backends.base import EventSink, Resources
from edged.backends.fncall.backend import FnCallBackend
from edged.config import Config


def from_config(config: Config, sink: EventSink | None) -> FnCallBackend:
    """The daemon's FnCall backend (:mod:`edged.backends.registry`): the default pool of
    ``fncall_image`` or ``fncall_layers``, with the ``fncall_*`` limits and bounds."""
    layers = tuple(d.strip() for d in config.fncall_layers.split(",") if d.strip())
    b = FnCallBackend(
        image=config.fncall_image or None, layers=layers,
        resources=Resources(cpus=config.fncall_cpus, memory_bytes=config.fncall_memory_bytes,
                            disk_bytes=config.fncall_disk_bytes, pids=config.fncall_pids,
                            memory_request_bytes=min(64 << 20, config.fncall_memory_bytes)),
        pool_size=config.fncall_pool, recycle_after=config.fncall_recycle_after,
        queue=config.fncall_queue, preload=config.fncall_preload,
        keep_s=config.fncall_keep_s, keep_bytes=config.fncall_keep_bytes)
    b.on_event = sink
    return b


__all__ = ["FnCallBackend", "from_config"]
