"""An exec stream cut before its end event is a lost connection, never a quiet end.

Found by the cluster suite at load: a node's HTTP relay killed while an exec began answered
with a stream that closed without an ``end`` event, and the SDK raised a bare
``SandboxError`` (not :class:`DaemonUnavailableError`), so the cluster client could not
say the node was unavailable or its sandbox lost. Here a fake daemon on a Unix socket cuts
the stream three ways: a clean close without ``end``, an abort in the middle of the chunked
body, and a truncated line.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from edged.client import AsyncSandbox, DaemonUnavailableError, Sandbox
from edged.client._http import Transport
from edged.client.async_sandbox import AsyncTransport

START = b'{"start": {"exec_id": 1}}\n'
OUT = b'{"stdout": "aGkK"}\n'  # "hi\n"
HOW = web.AppKey("how", str)


async def _exec(request: web.Request) -> web.StreamResponse:
    how = request.app[HOW]
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    await resp.write(START + OUT)
    if how == "whole":
        await resp.write(b'{"end": {"reason": "exited", "exit_code": 0}}\n')
    elif how == "truncated":
        await resp.write(b'{"stdout": "aGk')
    elif how == "abort":
        await resp.drain()
        assert request.transport is not None
        request.transport.abort()  # no last chunk: the body stops mid-way
        return resp
    await resp.write_eof()  # "clean", "truncated": a well-formed end of the HTTP body
    return resp


@contextlib.contextmanager
def serving(how: str, sock: str) -> Iterator[int]:
    """A fake daemon on ``sock`` and on a TCP port of 127.0.0.1 (yielded) whose exec stream
    ends as ``how`` says."""
    app = web.Application()
    app[HOW] = how
    app.router.add_post("/v1/sandboxes/{id}/exec", _exec)
    runner = web.AppRunner(app)
    ready = threading.Event()
    port: list[int] = []

    loop = asyncio.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.UnixSite(runner, sock).start())
        tcp = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(tcp.start())
        port.append(tcp._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield port[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


@pytest.fixture(params=["clean", "abort", "truncated", "whole"])
def daemon(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(socket, how) of a fake daemon (:func:`serving`)."""
    sock = str(tmp_path / "d.sock")
    with serving(request.param, sock):
        yield sock, request.param


def test_sync_sdk(daemon: tuple[str, str]) -> None:
    sock, how = daemon
    sbx = Sandbox({"id": "x", "state": "running"}, Transport(sock))
    if how == "whole":
        assert sbx.exec("echo hi").stdout == "hi\n"
        return
    got: list[str] = []
    with pytest.raises(DaemonUnavailableError, match="end event"):
        sbx.exec("echo hi", on_stdout=got.append)
    assert got == ["hi\n"]  # what came before the cut was still delivered as it came


def test_async_sdk(daemon: tuple[str, str]) -> None:
    sock, how = daemon

    async def main() -> None:
        t = AsyncTransport(sock)
        try:
            sbx = AsyncSandbox({"id": "x", "state": "running"}, t)
            if how == "whole":
                assert (await sbx.exec("echo hi")).stdout == "hi\n"
                return
            with pytest.raises(DaemonUnavailableError, match="end event"):
                await sbx.exec("echo hi")
        finally:
            await t.close()

    asyncio.run(main())
