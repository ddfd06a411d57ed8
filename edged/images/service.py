"""Supervision of the node's layer service (the lazy server behind every layer mount).

The daemon starts the lazy server (:meth:`LayerMounts.for_layerfs`) and so must keep it
alive: every ``interval_s`` it asks whether it answers, and when it does not, restarts it
(:meth:`layerfs.manager.LayerManager.recover`), backing off 1, 2, 4 ... up to
``max_backoff_s`` seconds between failed attempts, each logged. While the service is down,
creates are refused with :class:`~edged.errors.LayersUnavailable` (503, ``Retry-After``:
the time to the next attempt), since a sandbox made then could not read its layers.

What running sandboxes see (tested in ``tests/edged/images/test_layer_service_e2e.py``):

- The supervisor or the server killed, or both: the daemon holds a copy of the FUSE
  connection's fd, so the connection lives on; reads of data not yet in memory wait in the
  kernel, the restarted server answers them (``--resumed``: FUSE_NOTIFY_RESEND) and the
  sandboxes carry on, a few seconds late. A server whose supervisor alone was killed is
  replaced by one under a new supervisor (nothing would restart it otherwise). A server
  that runs but does not answer (stopped, deadlocked) is killed once it has not answered
  the health check (5 s) and then the restart's wait (10 s); its supervisor starts another
  (:func:`layerfs.lazy.client.start`). Reads wait for as long as the service is down, by
  choice: the daemon brings it back, and a read that failed instead (the kernel's FUSE
  request timeout, ``/proc/sys/fs/fuse/default_request_timeout``, 0 = none, a host-wide
  setting edged leaves alone) would be a wrong result in the sandbox, not a late one.
- Every holder of the connection gone (the daemon too, e.g. the node's services killed
  together): the kernel aborts the connection, and nothing brings it back. The layer mounts
  over it are detached; the sandboxes using them keep what the page cache has, the rest of
  their layer reads fail (EIO), so they are marked ``failed`` (``on_lost``) rather than left
  to compute wrong results; new sandboxes get the layers mounted again over the new
  connection. The dead FUSE mount is detached, never stacked under the new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from edged.images.mounts import LayerMounts
from edged.metrics import Metrics
from edged.periodic import Periodic

log = logging.getLogger("edged.images")


class LayerService:
    """Keeps ``layers``'s source alive (see the module docstring). ``on_lost(digests)``:
    called when the source's connection was lost, with the digests whose mounts went with
    it (after they are mounted again for new holders)."""

    def __init__(self, layers: LayerMounts, *, interval_s: float = 1.0,
                 max_backoff_s: float = 30.0, metrics: Metrics | None = None,
                 on_lost: Callable[[list[str]], object] | None = None) -> None:
        self.layers = layers
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.metrics = metrics
        self.on_lost = on_lost
        self.available = True
        self.failures = 0  #: failed restarts in a row
        self._next_try = 0.0
        self._loop = Periodic(self.check_once, lambda: self.interval_s,
                              "layer service check", log)

    @property
    def supervised(self) -> bool:
        """Whether there is anything to supervise (the tests' doubles cannot fail)."""
        ops = self.layers.ops
        return ops.healthy is not None and ops.recover is not None

    def retry_after(self) -> float:
        """Seconds until the next restart attempt (at least one)."""
        return max(1.0, self._next_try - time.monotonic())

    def _set_available(self, up: bool) -> None:
        if up != self.available:
            if up:
                log.info("layer service serves layers again")
            else:
                log.warning("layer service does not answer: creates are refused until it "
                            "is back")
        self.available = up
        if self.metrics is not None:
            self.metrics.layers_available.set(1 if up else 0)

    async def _healthy(self) -> bool | None:
        """Whether the service answers; None when the check could not tell (it raised
        OSError: this process out of descriptors, say, which a restart would not mend)."""
        assert self.layers.ops.healthy is not None
        try:
            return bool(await asyncio.to_thread(self.layers.ops.healthy))
        except OSError as e:
            log.debug("layer service check could not tell: %s", e)
            return None
        except Exception:
            return False

    async def recover(self) -> list[str] | None:
        """One attempt to bring the service back: returns what :meth:`LayerOps.recover` did
        (None, or the digests whose mounts were lost with the connection), having handled
        a lost connection (those of them still held mounted again, ``on_lost`` told).
        Raises what the restart raised."""
        assert self.layers.ops.recover is not None
        lost = await asyncio.to_thread(self.layers.ops.recover)
        if lost:
            log.error("layer service: its connection was lost with every holder; %d layer "
                      "mounts over it detached (the sandboxes using them fail)", len(lost),
                      extra={"layers": lost})
            await self.layers.remount(lost)
            if self.on_lost is not None:
                self.on_lost(lost)
        return lost

    async def first_check(self) -> list[str] | None:
        """At the daemon's start, before sandboxes are adopted (``on_lost`` not yet set):
        :meth:`recover`, returning the layers whose mounts an earlier connection took with
        it (its sandboxes are to be failed once adopted). A service that does not come back
        is logged and marked unavailable (creates refused) until a check brings it back."""
        if not self.supervised:
            return None
        try:
            return await self.recover()
        except Exception as e:
            log.error("layer service does not answer at start: %s", e)
            self._set_available(False)
            self._failed()
            return None

    def _failed(self) -> None:
        """One more failed restart: the next one backs off."""
        self.failures += 1
        backoff = min(self.max_backoff_s, self.interval_s * 2 ** (self.failures - 1))
        self._next_try = time.monotonic() + backoff
        if self.metrics is not None:
            self.metrics.layer_service_restarts.labels(result="failed").inc()

    async def check_once(self) -> None:
        """Check the service; restart it if it does not answer and the backoff allows."""
        if not self.supervised:
            return
        up = await self._healthy()
        if up is None:
            return  # as it was
        if up:
            self.failures = 0
            self._set_available(True)
            return
        self._set_available(False)
        now = time.monotonic()
        if now < self._next_try:
            return
        log.warning("layer service: restarting it (attempt %d)", self.failures + 1)
        try:
            await self.recover()
        except Exception as e:
            self._failed()
            log.error("layer service: restart failed: %s; next attempt in %.0f s", e,
                      self.retry_after())
            return
        if self.metrics is not None:
            self.metrics.layer_service_restarts.labels(result="ok").inc()
        self.failures = 0
        self._next_try = 0.0
        up = await self._healthy()
        log.info("layer service: restarted", extra={"answers": up})
        self._set_available(up is not False)

    def start(self) -> None:
        """Check every ``interval_s`` until :meth:`stop`."""
        if self.supervised:
            self._loop.start()

    async def stop(self) -> None:
        """Stop checking (the daemon's shutdown, before the layers are let go)."""
        await self._loop.stop()


__all__ = ["LayerService"]
