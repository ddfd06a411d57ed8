"""A step run every few seconds in the daemon's event loop, until stopped: the layer
service's checks, reclaim passes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable


class Periodic:
    """Runs ``await step()`` every ``interval()`` seconds (read before each sleep, so a
    changed setting takes effect at the next round) from :meth:`start` until :meth:`stop`.
    An exception of one step is logged to ``log`` as "``what`` failed" with its traceback
    and never ends the loop; cancellation does."""

    def __init__(self, step: Callable[[], Awaitable[object]], interval: Callable[[], float],
                 what: str, log: logging.Logger) -> None:
        self.step = step
        self.interval = interval
        self.what = what
        self.log = log
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Started and not stopped."""
        return self._task is not None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval())
            try:
                await self.step()
            except Exception:
                self.log.exception("%s failed", self.what)

    def start(self) -> None:
        """Start the loop in the running event loop (no-op when it runs already)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Cancel the loop and wait for it to end (no-op when it does not run); a step under
        way is cancelled at its next await."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


__all__ = ["Periodic"]
