"""The WebSocket exec variant: interactive stdin, EOF, signals."""

from __future__ import annotations

import asyncio

import aiohttp

from edged.api.requests import parse_create
from tests.edged.api.speccheck import SPEC, validate
from tests.edged.fakes import digest


async def _ws(node, sid: str, first: dict) -> list[dict]:
    events: list[dict] = []
    conn = aiohttp.UnixConnector(path=node.socket)
    async with (
        aiohttp.ClientSession(connector=conn) as s,
        s.ws_connect(f"http://edged/v1/sandboxes/{sid}/exec/ws") as ws,
    ):
        await ws.send_json(first)
        async for msg in ws:
            ev = msg.json()
            events.append(ev)
            if "start" in ev:
                await ws.send_json({"stdin": "line one\n"})
                await ws.send_bytes(b"line two\n")
                await ws.send_json({"eof": True})
            if "end" in ev or "error" in ev:
                break
    return events


def test_ws_interactive_stdin(node) -> None:
    node.call(node.server.manager.create(parse_create({"id": "ws", "layers": [digest(1)]})))
    events = asyncio.run(_ws(node, "ws", {"argv": ["cat"]}))
    schema = SPEC["components"]["schemas"]["ExecEvent"]
    for ev in events:
        validate(ev, schema)
    out = "".join(e.get("stdout", "") for e in events)
    assert out == "line one\nline two\n"
    assert events[-1]["end"]["reason"] == "exited" and events[-1]["end"]["exit_code"] == 0


def test_ws_errors_use_the_one_shape(node) -> None:
    node.call(node.server.manager.create(parse_create({"id": "ws2", "layers": [digest(1)]})))
    events = asyncio.run(_ws(node, "ws2", {"argv": []}))
    assert events == [{"error": {"code": "bad_request",
                                 "message": "argv: must be a non-empty list of strings "
                                            "without NUL"}}]


def test_ws_bad_control_message_is_answered_and_ignored(node) -> None:
    """A bad control message gets an error message; the reader goes on: later stdin, EOF
    reach the exec, it ends, and the sandbox has no active exec left (idle reaping works)."""
    node.call(node.server.manager.create(parse_create({"id": "ws3", "layers": [digest(1)]})))

    async def go() -> list[dict]:
        events: list[dict] = []
        conn = aiohttp.UnixConnector(path=node.socket)
        async with (
            aiohttp.ClientSession(connector=conn) as s,
            s.ws_connect("http://edged/v1/sandboxes/ws3/exec/ws") as ws,
        ):
            await ws.send_json({"argv": ["cat"]})
            async for msg in ws:
                ev = msg.json()
                events.append(ev)
                if "start" in ev:
                    for bad in ({"resize": {"rows": "x"}}, {"signal": 0}, {"signal": "x"},
                                {"stdin_b64": "!!"}, {"stdin": 5}, [1]):
                        await ws.send_json(bad)
                    await ws.send_str("not json")
                    await ws.send_json({"stdin": "still here\n"})
                    await ws.send_json({"eof": True})
                if "end" in ev:
                    break
        return events

    events = asyncio.run(asyncio.wait_for(go(), 20))
    errors = [e for e in events if "error" in e]
    assert len(errors) == 7 and all(e["error"]["code"] == "bad_request" for e in errors), errors
    assert "".join(e.get("stdout", "") for e in events) == "still here\n"
    assert events[-1]["end"]["reason"] == "exited"
    assert node.server.manager.get("ws3").active_execs == 0
