"""The security-event ledger: recording, bounds, persistence across restarts, retention,
fan-out streaming, and its HTTP routes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from edged.errors import BadRequest, EdgedError, NotFound
from edged.security.http import add_routes
from edged.security.ledger import Ledger


def test_record_and_read_back(tmp_path: Path) -> None:
    led = Ledger(tmp_path)
    led.sandbox_created("a")
    assert led.events("a") == []
    ev = led.record("a", "seccomp_denied", pid=7, process="sh", syscall="mount",
                    detail={"args": ["0x0"]})
    assert ev is not None and ev.seq == 1
    led.record("b", "oom_kill", pid=9, detail={"limit": 1 << 20})
    assert [e.kind for e in led.events("a")] == ["seccomp_denied"]
    assert [e.seq for e in led.events("b")] == [2]
    assert led.events("a", since=1) == []
    assert led.events("b", kinds=["oom_kill"])[0].detail == {"limit": 1 << 20}
    with pytest.raises(NotFound):
        led.events("nope")
    with pytest.raises(BadRequest):
        led.record("a", "made_up")
    with pytest.raises(BadRequest):
        led.events("a", kinds=["made_up"])
    led.close()


def test_survives_restart_and_torn_line(tmp_path: Path) -> None:
    led = Ledger(tmp_path)
    for i in range(5):
        led.record("a", "seccomp_denied", syscall="bpf", detail={"i": i})
    led.close()
    seg = sorted((tmp_path / "security").glob("*.jsonl"))[-1]
    with open(seg, "ab") as f:
        f.write(b'{"seq": 99, "time": 1')  # a crash mid-append
    led2 = Ledger(tmp_path)
    assert [e.detail["i"] for e in led2.events("a")] == [0, 1, 2, 3, 4]
    assert led2.corrupt_lines == 1
    ev = led2.record("a", "timeout")
    assert ev is not None and ev.seq == 6  # numbering continues
    led2.close()


def test_retention_after_sandbox_gone(tmp_path: Path) -> None:
    led = Ledger(tmp_path, retention_s=10)
    led.record("a", "pids_limit", now=1000.0)
    led.record("b", "pids_limit", now=1000.0)
    led.sandbox_gone("a", now=1001.0)
    assert led.prune(now=1005.0) == 0
    assert len(led.events("a")) == 2  # kept after the sandbox is gone
    assert led.prune(now=1012.0) == 1
    with pytest.raises(NotFound):
        led.events("a")
    led.close()
    led2 = Ledger(tmp_path, retention_s=10)  # compaction removed "a" from disk too
    assert not led2.known("a") and len(led2.events("b")) == 1
    led2.close()


def test_bounds_rate_memory_and_disk(tmp_path: Path) -> None:
    led = Ledger(tmp_path, rate_per_s=5, max_per_sandbox=8, segment_bytes=2048, max_bytes=8192)
    kept = [led.record("a", "seccomp_denied", syscall="mount", now=50.0) for _ in range(100)]
    assert sum(e is not None for e in kept) == 5
    nxt = led.record("a", "seccomp_denied", now=51.0)
    assert nxt is not None and nxt.detail["suppressed"] == 95
    for i in range(200):
        led.record(f"s{i}", "output_limit", path="/x" * 20, now=100.0 + i)
    assert len(led.events("a")) <= 8
    total = sum(p.stat().st_size for p in (tmp_path / "security").glob("*.jsonl"))
    assert total <= 2 * 8192 + 2048
    led.close()


def test_fan_out_and_slow_reader() -> None:
    async def main() -> None:
        led = Ledger()
        everything = led.subscribe()
        only_a = led.subscribe("a")
        slow = led.subscribe(maxsize=2)
        for sid in ("a", "b", "a"):
            led.record(sid, "disk_full")
        led.close()
        assert [e.sandbox_id async for e in everything] == ["a", "b", "a"]
        assert [e.seq async for e in only_a] == [1, 3]
        got = [e.seq async for e in slow]
        assert got[-1] == 3 and slow.dropped >= 1

    asyncio.run(main())


def test_http_routes() -> None:
    async def main() -> None:
        led = Ledger()
        led.record("a", "seccomp_denied", syscall="mount")

        @web.middleware
        async def errors(request: web.Request, handler):  # type: ignore[no-untyped-def]
            try:
                return await handler(request)
            except EdgedError as e:
                return web.json_response({"error": {"code": e.code, "message": e.message}},
                                         status=e.status)

        app = web.Application(middlewares=[errors])
        add_routes(app, led)
        async with TestClient(TestServer(app)) as client:
            r = await client.get("/v1/sandboxes/a/events")
            body = await r.json()
            assert r.status == 200 and body["events"][0]["syscall"] == "mount"
            assert body["next"] == 1
            r = await client.get("/v1/sandboxes/zz/events")
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
            r = await client.get("/v1/sandboxes/a/events?since=x")
            assert r.status == 400
            resp = await client.get("/v1/sandboxes/a/events?follow=1")
            first = json.loads(await resp.content.readline())
            assert first["seq"] == 1
            node = await client.get("/v1/events?since=0")
            assert json.loads(await node.content.readline())["seq"] == 1
            led.record("a", "oom_kill")
            assert json.loads(await resp.content.readline())["kind"] == "oom_kill"
            assert json.loads(await node.content.readline())["kind"] == "oom_kill"
            led.close()
            resp.close()
            node.close()

    asyncio.run(main())


def test_suppressed_events_keep_their_dropped_counts_and_summaries_pass() -> None:
    # Review finding: the rate limit counted a suppressed event as one, losing the denials
    # sbx-init had folded into it (dropped_before), and suppressed its summaries.
    led = Ledger(None, rate_per_s=2)
    for _ in range(5):
        led.record("a", "seccomp_denied", syscall="mount", detail={"dropped_before": 10},
                   now=7.0)
    summary = led.record("a", "seccomp_denied", detail={"dropped_before": 4, "summary": True},
                         now=7.0)
    assert summary is not None  # not suppressed
    assert summary.detail["suppressed"] == 3 and summary.detail["suppressed_dropped"] == 30
    evs = led.events("a")
    total = sum(1 + e.detail.get("suppressed", 0) + e.detail.get("suppressed_dropped", 0) +
                e.detail["dropped_before"] for e in evs) - 1  # the summary is no denial
    assert total == 5 * 11 + 4
    led.close()
