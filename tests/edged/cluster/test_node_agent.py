"""The node relay without Ray, against a daemon over the test doubles: its reports, the
sandbox list it keeps the registry's in step with, relayed calls, streams, files."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from edged.client import Sandbox
from edged.cluster import wire
from edged.cluster.node import NodeAgent
from edged.cluster.registry import Registry
from tests.edged.fakes import digest


def agent_for(socket: str, registry: Registry, **kw: Any) -> NodeAgent:
    async def send(r: dict[str, Any]) -> dict[str, Any]:
        return registry.report(r)
    return NodeAgent("n1", socket, send, labels={"zone": "z"}, list_every=3, **kw)


def test_reports_capacity_and_keeps_the_list(make_node) -> None:
    node = make_node(max_sandboxes=5)
    reg = Registry()

    async def main() -> None:
        a = agent_for(node.socket, reg)
        await a.report_once()  # first: the whole list
        assert a.last["sandboxes"] == {"full": True, "added": {}, "removed": []}
        await a.report_once()
        assert a.last["sandboxes"] is None  # nothing changed
        (n,) = reg.nodes()
        assert (n["name"], n["state"], n["free"], n["held"], n["labels"]) == \
            ("n1", "up", 5, 0, {"zone": "z"})
        # a create through the relay is in the next report, before any listing
        body = {"id": "n1.a", "layers": [digest(1)]}
        tag, info = await a.call("POST", "/v1/sandboxes", body)
        assert tag == "ok" and info["id"] == "n1.a"
        await a.report_once()
        assert a.last["sandboxes"] == {"full": False, "added": {"n1.a": "running"},
                                       "removed": []}
        assert reg.locate("n1.a") == {"node": "n1", "state": "running"}
        assert reg.nodes()[0]["held"] == 1 and reg.nodes()[0]["free"] == 4
        # one made on the node directly is found by the next listing (every 3rd report)
        await asyncio.to_thread(Sandbox.create, layers=[digest(1)], id="direct",
                                socket=node.socket)
        for _ in range(3):
            await a.report_once()
        assert reg.locate("direct") is not None
        # a delete through the relay, at once
        assert (await a.call("DELETE", "/v1/sandboxes/n1.a"))[0] == "ok"
        await a.report_once()
        assert reg.locate("n1.a") is None
        await a.stop()

    asyncio.run(main())


def test_a_daemon_that_does_not_answer(make_node) -> None:
    node = make_node()
    reg = Registry()

    async def main() -> None:
        a = agent_for(node.socket, reg)
        await a.report_once()
        await a.report_once()
        await a.call("POST", "/v1/sandboxes", {"id": "n1.a", "layers": [digest(1)]})
        await a.report_once()
        node.stop()
        await a.report_once()
        assert a.last["daemon"] == "down" and "edged at" in a.last["error"]
        assert reg.nodes()[0]["state"] == "down"
        assert set(reg.lost()) == {"n1.a"}
        tag, e = await a.call("GET", "/v1/sandboxes/n1.a")
        assert tag == "err" and e["code"] == "unavailable" and abs(e["at"] - time.time()) < 5
        assert isinstance(wire.error_of(e), ConnectionError)
        await a.stop()

    asyncio.run(main())


def test_relayed_calls_streams_and_files(make_node) -> None:
    node = make_node()
    reg = Registry()

    async def main() -> None:
        a = agent_for(node.socket, reg)
        assert (await a.call("POST", "/v1/sandboxes", {"id": "s1",
                                                       "layers": [digest(1)]}))[0] == "ok"
        tag, e = await a.call("GET", "/metrics")
        assert tag == "err" and e["code"] == "bad_request"
        tag, e = await a.call("POST", "/v1/sandboxes", {"id": "s1", "layers": [digest(1)]})
        assert (tag, e["code"], e["status"]) == ("err", "conflict", 409)
        events = [ev async for ev in a.stream("POST", "/v1/sandboxes/s1/exec",
                                              {"cmd": "echo a; echo b >&2"})]
        assert all(tag == "ok" for tag, _ in events)
        evs = [ev for _, ev in events]
        assert "start" in evs[0] and evs[-1]["end"]["exit_code"] == 0
        assert {"stdout": "a\n"} in evs and {"stderr": "b\n"} in evs
        bad = [x async for x in a.stream("POST", "/v1/sandboxes/nope/exec", {"cmd": "true"})]
        assert bad == [("err", bad[0][1])] and bad[0][1]["code"] == "not_found"
        # an upload in chunks, then the same back in chunks
        data = os.urandom(3 << 20)
        tag, tok = await a.upload_open("/v1/sandboxes/s1/files?path=/big&mode=644")
        for i in range(0, len(data), 1 << 20):
            assert await a.upload_chunk(tok, data[i:i + (1 << 20)]) == ("ok", None)
        tag, out = await a.upload_close(tok)
        assert (tag, out["bytes"]) == ("ok", len(data))
        parts = [x async for x in a.download("/v1/sandboxes/s1/files?path=/big")]
        assert all(t == "ok" for t, _ in parts) and len(parts) == 3
        assert b"".join(c for _, c in parts) == data
        missing = [x async for x in a.download("/v1/sandboxes/s1/files?path=/none")]
        assert missing[0][0] == "err" and missing[0][1]["code"] == "not_found"
        # an aborted upload is forgotten (what the node keeps of a body that never ended
        # is the backend's rule: the container backend keeps nothing, see
        # test_cluster_real.py)
        tag, tok = await a.upload_open("/v1/sandboxes/s1/files?path=/half")
        await a.upload_chunk(tok, b"x" * 1000)
        await a.upload_abort(tok)
        assert (await a.upload_close(tok))[1]["code"] == "not_found"
        assert a._uploads == {}
        await a.stop()

    asyncio.run(main())


def test_a_cancelled_stream_abandons_the_exec(make_node) -> None:
    node = make_node()
    reg = Registry()

    async def main() -> None:
        a = agent_for(node.socket, reg)
        await a.call("POST", "/v1/sandboxes", {"id": "s1", "layers": [digest(1)]})
        got: list[Any] = []

        async def consume() -> None:
            async for item in a.stream("POST", "/v1/sandboxes/s1/exec",
                                       {"cmd": "echo up; sleep 60"}):
                got.append(item)

        task = asyncio.ensure_future(consume())
        while len(got) < 2:
            await asyncio.sleep(0.02)
        task.cancel()
        deadline = time.monotonic() + 10
        while True:
            evs = (await a.call("GET", "/v1/sandboxes/s1/events?kind=exec_abandoned"))[1]
            if evs["events"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert evs["events"], "the daemon did not see the exec abandoned"
        await a.stop()

    asyncio.run(main())
