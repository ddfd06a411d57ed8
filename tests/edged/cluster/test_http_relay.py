"""The node's HTTP relay without Ray, against a daemon over the test doubles: its token,
the daemon's protocol through it (JSON, exec streams, files both ways), a daemon gone
behind it, and the client transports' fallback when the relay itself is gone."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from edged.client import AsyncSandbox, Sandbox
from edged.client._http import Transport
from edged.client.async_sandbox import AsyncTransport
from edged.client.errors import NotFoundError, SandboxError
from edged.cluster.node import NodeAgent
from edged.cluster.registry import Registry
from edged.cluster.transport import AsyncHttpRelayTransport, HttpRelayTransport
from tests.edged.fakes import digest


class Loop:
    """An event loop in a thread of its own (the relay serves while the test blocks)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Lost(SandboxError):
    """What the tests' ``on_fail`` turns a daemon the relay cannot reach into."""

    code = "test_lost"


def on_fail(node: str, e: BaseException) -> SandboxError:
    return Lost(f"{node}: {e}")


async def aon_fail(node: str, e: BaseException) -> SandboxError:
    return on_fail(node, e)


class Counting(Transport):
    """A stand-in for the relay actor's transport: the node's socket, calls counted."""

    def __init__(self, socket: str) -> None:
        super().__init__(socket)
        self.calls = 0

    def open(self, *a: Any, **kw: Any) -> Any:
        self.calls += 1
        return super().open(*a, **kw)


class ACounting(AsyncTransport):
    def __init__(self, socket: str) -> None:
        super().__init__(socket)
        self.calls = 0

    async def request(self, *a: Any, **kw: Any) -> Any:
        self.calls += 1
        return await super().request(*a, **kw)


@pytest.fixture
def relay(make_node: Any) -> Iterator[tuple[Any, NodeAgent, Loop]]:
    node = make_node()
    reg = Registry()

    async def send(r: dict[str, Any]) -> dict[str, Any]:
        return reg.report(r)

    loop = Loop()
    agent = NodeAgent("n1", node.socket, send, http_host="127.0.0.1", list_every=3)
    try:
        assert loop.run(agent.serve_http()) is not None
        yield node, agent, loop
    finally:
        loop.run(agent.stop())
        loop.stop()


def raw(agent: NodeAgent, method: str, path: str, body: Any = None,
        token: str | None = None) -> tuple[int, Any]:
    assert agent.http.url is not None
    host, port = agent.http.url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    c.request(method, path, body=data, headers=headers)
    r = c.getresponse()
    out = json.loads(r.read())
    c.close()
    return r.status, out


def transport(agent: NodeAgent, socket: str, token: str | None = None
              ) -> tuple[HttpRelayTransport, Counting]:
    fallback = Counting(socket)
    assert agent.http.url is not None
    t = HttpRelayTransport("n1", agent.http.url, token or agent.http.token,
                           fallback, on_fail)  # type: ignore[arg-type]
    return t, fallback


def test_the_token_is_required_and_nothing_reaches_the_daemon(relay: Any) -> None:
    node, agent, loop = relay
    body = {"id": "s1", "layers": [digest(1)]}
    for token in (None, "", "x" * len(agent.http.token), agent.http.token[:-1]):
        status, out = raw(agent, "POST", "/v1/sandboxes", body, token)
        assert (status, out["error"]["code"]) == (401, "unauthorized"), token
    status, _ = raw(agent, "GET", "/v1/sandboxes", None, "Basic " + agent.http.token)
    assert status == 401
    assert agent.http.calls == 0
    assert Sandbox.list(socket=node.socket) == []
    loop.run(agent.report_once())  # the first report lists all; the next ones changes
    # the right token: the daemon answers (and only /v1/ is relayed)
    assert raw(agent, "POST", "/v1/sandboxes", body, agent.http.token)[0] == 201
    assert raw(agent, "GET", "/metrics", None, agent.http.token)[0] == 400
    assert agent.http.calls == 1
    # the report carries the relay's URL and token; the create is in it before a listing
    loop.run(agent.report_once())
    assert agent.last["http"] == {"url": agent.http.url, "token": agent.http.token}
    assert agent.last["sandboxes"] == {"full": False, "added": {"s1": "running"},
                                       "removed": []}


def test_the_sdk_through_the_relay_exec_streams_and_files(relay: Any) -> None:
    node, agent, loop = relay
    t, fallback = transport(agent, node.socket)
    sbx = Sandbox(t.json("POST", "/v1/sandboxes", {"id": "s1", "layers": [digest(1)]}), t)
    out: list[str] = []
    r = sbx.exec("echo a; sleep 0.2; echo b; echo c >&2", on_stdout=out.append)
    assert (r.exit_code, r.stdout, r.stderr) == (0, "a\nb\n", "c\n") and out == ["a\n", "b\n"]
    data = os.urandom(3 << 20)
    sbx.files.write("/big", data)
    assert sbx.files.read_bytes("/big") == data
    sbx.files.write("/streamed", iter([b"x" * 100_000] * 30))
    assert sbx.files.read_bytes("/streamed") == b"x" * 3_000_000
    with pytest.raises(NotFoundError):
        sbx.files.read("/none")
    with pytest.raises(NotFoundError):
        Sandbox(dict(sbx.info, id="nope"), t).exec("true")
    sbx.kill()
    assert fallback.calls == 0 and agent.http.calls >= 8
    # kept-alive: many calls, few connections
    loop.run(agent.report_once())
    assert len(t._idle) >= 1
    t.close()


def test_a_daemon_gone_behind_the_relay_is_a_typed_error(relay: Any) -> None:
    node, agent, _ = relay
    t, fallback = transport(agent, node.socket)
    sbx = Sandbox(t.json("POST", "/v1/sandboxes", {"id": "s1", "layers": [digest(1)]}), t)
    node.stop()
    status, out = raw(agent, "GET", "/v1/sandboxes/s1", None, agent.http.token)
    assert (status, out["error"]["code"]) == (502, "unavailable")
    with pytest.raises(Lost, match="n1: edged at"):
        sbx.refresh()
    with pytest.raises(Lost):
        sbx.exec("true")
    with pytest.raises(Lost):
        sbx.files.read("/x")
    assert fallback.calls == 0  # the relay answered: no second route tried
    t.close()


def test_a_relay_gone_or_restarted_falls_back_to_the_actor(relay: Any) -> None:
    node, agent, loop = relay
    t, fallback = transport(agent, node.socket)
    info = t.json("POST", "/v1/sandboxes", {"id": "s1", "layers": [digest(1)]})
    assert fallback.calls == 0
    url = agent.http.url
    loop.run(agent.http.stop())  # the relay's process gone: connections refused
    sbx = Sandbox(info, t)
    assert sbx.exec("echo hi").stdout == "hi\n"  # the kept-alive connection is closed too
    assert fallback.calls == 1 and t.route.failed_at is not None
    assert t.json("GET", "/v1/sandboxes/s1")["id"] == "s1"
    assert fallback.calls == 2  # not tried again for HTTP_RETRY_S
    # a relay back on another port with another token (a restarted actor): the next
    # report names it, and calls go over HTTP again
    agent.http._token = b"another"
    agent.http.token = "another"
    new = loop.run(agent.serve_http())
    assert new is not None
    t.set_http(new, "another")
    assert sbx.exec("echo again").stdout == "again\n" and fallback.calls == 2
    # a token the relay no longer takes: refused before the daemon, and the call falls back
    t2, fallback2 = transport(agent, node.socket, token="stale")
    before = agent.http.calls
    assert t2.json("GET", "/v1/sandboxes/s1")["id"] == "s1"
    assert fallback2.calls == 1 and agent.http.calls == before
    assert url is not None
    t.close()


def test_the_async_sdk_through_the_relay_and_its_fallback(relay: Any) -> None:
    node, agent, loop = relay

    async def main() -> None:
        fallback = ACounting(node.socket)
        assert agent.http.url is not None
        t = AsyncHttpRelayTransport("n1", agent.http.url, agent.http.token,
                                    fallback, aon_fail)  # type: ignore[arg-type]
        info = await t.json("POST", "/v1/sandboxes", {"id": "s1", "layers": [digest(1)]})
        sbx = AsyncSandbox(info, t)
        out: list[str] = []
        r = await sbx.exec("echo a; echo b >&2", on_stdout=out.append)
        assert (r.stdout, r.stderr, out) == ("a\n", "b\n", ["a\n"])
        data = os.urandom(512 << 10)
        await sbx.files.write("/f", data)
        assert await sbx.files.read_bytes("/f") == data

        async def chunks() -> Any:
            for _ in range(20):
                yield b"y" * 100_000
        assert await sbx.files.write("/g", chunks()) == 2_000_000
        assert await sbx.files.read_bytes("/g") == b"y" * 2_000_000
        with pytest.raises(NotFoundError):
            await sbx.files.read("/none")
        assert fallback.calls == 0
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agent.http.stop(),
                                                                   loop.loop))
        assert (await sbx.exec("echo hi")).stdout == "hi\n"
        assert fallback.calls == 1
        await t.aclose()
        await fallback.close()
        # a daemon gone behind a relay that answers: the typed error, no fallback
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agent.serve_http(),
                                                                   loop.loop))
        assert agent.http.url is not None
        t = AsyncHttpRelayTransport("n1", agent.http.url, agent.http.token,
                                    fallback, aon_fail)  # type: ignore[arg-type]
        await asyncio.to_thread(node.stop)
        with pytest.raises(Lost):
            await AsyncSandbox(info, t).refresh()
        assert fallback.calls == 1
        await t.aclose()
        await fallback.close()

    asyncio.run(main())


def test_an_abandoned_exec_through_the_relay_is_ended(relay: Any) -> None:
    node, agent, _ = relay
    t, _ = transport(agent, node.socket)
    t.json("POST", "/v1/sandboxes", {"id": "s1", "layers": [digest(1)]})
    stream = t.ndjson("POST", "/v1/sandboxes/s1/exec", {"cmd": "echo up; sleep 60"})
    for ev in stream:
        if ev.get("stdout"):
            break
    stream.close()  # the client gives up: its connection to the relay closes
    deadline = time.monotonic() + 15
    while True:
        evs = t.json("GET", "/v1/sandboxes/s1/events?kind=exec_abandoned")["events"]
        if evs or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert evs, "the daemon did not see the exec abandoned"
    t.close()


def test_an_unbindable_address_serves_no_relay(make_node: Any) -> None:
    node = make_node()

    async def main() -> None:
        async def send(r: dict[str, Any]) -> dict[str, Any]:
            return {}
        a = NodeAgent("n1", node.socket, send, http_host="192.0.2.1")  # not this host's
        assert await a.serve_http() is None
        assert a.http_advert() is None
        await a.stop()
    asyncio.run(main())
