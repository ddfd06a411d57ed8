"""edged.periodic: the step runs every interval, a failing step is logged and the loop goes
on, stop ends it (and waits), start and stop twice are harmless."""

from __future__ import annotations

import asyncio
import logging

import pytest

from edged.periodic import Periodic


def test_a_failing_step_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    async def step() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("boom")

    async def main() -> None:
        p = Periodic(step, lambda: 0.01, "test step", logging.getLogger("edged.test"))
        p.start()
        p.start()  # already running: no second loop
        assert p.running
        for _ in range(500):
            if len(calls) >= 4:
                break
            await asyncio.sleep(0.01)
        await p.stop()
        assert not p.running
        n = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == n  # stopped: no more steps
        await p.stop()  # stopping twice is fine

    with caplog.at_level(logging.ERROR, logger="edged.test"):
        asyncio.run(main())
    assert len(calls) >= 4  # the step after the failing one ran
    failed = [r for r in caplog.records if r.getMessage() == "test step failed"]
    assert len(failed) == 1 and failed[0].exc_info is not None


def test_the_interval_is_read_each_round() -> None:
    seen: list[float] = []
    interval = [3600.0]

    async def step() -> None:
        seen.append(asyncio.get_running_loop().time())

    async def main() -> None:
        p = Periodic(step, lambda: interval[0], "step", logging.getLogger("edged.test"))
        interval[0] = 0.01  # changed before the first sleep: taken
        p.start()
        for _ in range(500):
            if len(seen) >= 2:
                break
            await asyncio.sleep(0.01)
        await p.stop()

    asyncio.run(main())
    assert len(seen) >= 2
