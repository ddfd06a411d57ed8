"""The daemon supervises the lazy layer service it starts (issue 9, item 3): restarts back
off and are logged, a lost connection is told, creates are refused (typed 503) while
layers cannot be served. Over test doubles; the real service: test_layer_service_e2e.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from edged.client import LayersUnavailableError, Sandbox
from edged.images.mounts import LayerMounts, LayerOps
from edged.images.service import LayerService
from tests.edged.fakes import digest

# -- supervision over doubles ---------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Source:
    """A layer source that goes down and comes back when told to."""

    def __init__(self) -> None:
        self.up = True
        self.fail_restarts = 0
        self.restarts = 0
        self.lose: list[str] | None = None

    def healthy(self) -> bool:
        return self.up

    def recover(self) -> list[str] | None:
        self.restarts += 1
        if self.fail_restarts:
            self.fail_restarts -= 1
            raise OSError("the lazy server did not start")
        self.up = True
        lost, self.lose = self.lose, None
        return lost


def _service(tmp_path: Path, src: _Source, lost: list[list[str]]) -> tuple[LayerService,
                                                                          LayerMounts]:
    ops = LayerOps(image=lambda d: "", mount=lambda i, m: None, umount=lambda m: None,
                   is_mounted=lambda m: True, has=lambda d: True,
                   healthy=src.healthy, recover=src.recover)
    layers = LayerMounts(ops, tmp_path / "layers")
    return LayerService(layers, interval_s=1.0, max_backoff_s=8.0, on_lost=lost.append), layers


def test_restarts_back_off_and_say_when_to_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    clock = _Clock()
    monkeypatch.setattr("edged.images.service.time.monotonic", clock)
    src, lost = _Source(), []
    svc, _ = _service(tmp_path, src, lost)

    async def body() -> None:
        await svc.check_once()
        assert svc.available and src.restarts == 0
        src.up, src.fail_restarts = False, 5
        gaps = []
        while src.restarts < 6:
            assert clock.t < 200, "no restart attempt"
            before = src.restarts
            await svc.check_once()
            if src.restarts > before and src.restarts < 6:
                assert not svc.available
                gaps.append(round(svc.retry_after()))
            clock.t += 1.0
        # 1, 2, 4, then the cap (8 s), and a restart that works at last
        assert gaps == [1, 2, 4, 8, 8]
        assert svc.available and svc.failures == 0

    with caplog.at_level(logging.INFO, logger="edged.images"):
        asyncio.run(body())
    msgs = [r.getMessage() for r in caplog.records]
    assert any("restart failed" in m and "next attempt in 8 s" in m for m in msgs)
    assert any("serves layers again" in m for m in msgs)


def test_a_lost_connection_remounts_and_tells(tmp_path: Path) -> None:
    import asyncio

    src, lost = _Source(), []
    svc, layers = _service(tmp_path, src, lost)
    remounted: list[str] = []

    async def remount(digests: list[str]) -> list[str]:
        remounted.extend(digests)
        return digests

    layers.remount = remount  # type: ignore[method-assign]

    async def body() -> None:
        src.up, src.lose = False, [digest(1)]
        await svc.check_once()

    asyncio.run(body())
    assert svc.available and lost == [[digest(1)]] and remounted == [digest(1)]


def test_a_check_that_cannot_tell_changes_nothing(tmp_path: Path) -> None:
    """The daemon out of descriptors cannot reach the server: that is not the server down
    (it had refused creates and restarted a server that was fine)."""
    import asyncio
    import errno

    src, lost = _Source(), []
    svc, _ = _service(tmp_path, src, lost)

    def emfile() -> bool:
        raise OSError(errno.EMFILE, "Too many open files")

    svc.layers.ops.healthy = emfile
    asyncio.run(svc.check_once())
    assert svc.available and src.restarts == 0


def test_a_service_down_at_start_refuses_creates_until_it_is_back(tmp_path: Path) -> None:
    import asyncio

    src, lost = _Source(), []
    svc, _ = _service(tmp_path, src, lost)
    src.up, src.fail_restarts, src.lose = False, 1, [digest(2)]

    async def body() -> None:
        assert await svc.first_check() is None
        assert not svc.available and svc.failures == 1 and 0.5 < svc.retry_after() <= 1.0
        svc._next_try = 0.0
        await svc.check_once()  # the next check brings it back and tells what was lost

    asyncio.run(body())
    assert svc.available and lost == [[digest(2)]]


def test_creates_are_refused_while_layers_cannot_be_served(node) -> None:
    svc = node.server.manager.layer_service
    assert svc is not None and svc.available
    svc.available = False
    svc._next_try = time.monotonic() + 7.0
    try:
        with pytest.raises(LayersUnavailableError) as ei:
            Sandbox.create(layers=[digest(1)], socket=node.socket)
        assert ei.value.status == 503 and ei.value.code == "layers_unavailable"
        assert 6.0 <= (ei.value.retry_after or 0) <= 7.0
        assert Sandbox.list(socket=node.socket) == []
    finally:
        svc.available = True
    Sandbox.create(layers=[digest(1)], socket=node.socket).kill()
