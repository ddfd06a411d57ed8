"""The SDK (sync and async) against a real daemon over the test-double backend."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys

import pytest

from edged.client import (
    AsyncSandbox,
    BadRequestError,
    CapacityExhaustedError,
    CommandExitError,
    DaemonUnavailableError,
    InvalidStateError,
    NotFoundError,
    Sandbox,
    SandboxError,
)
from tests.edged.fakes import digest


def test_sync_sandbox(node) -> None:
    chunks: list[str] = []
    with Sandbox.create(layers=[digest(1)], id="sdk", labels={"a": "b"}, env={"X": "1"},
                        socket=node.socket) as sbx:
        r = sbx.exec("echo $X; echo e >&2", on_stdout=chunks.append)
        assert (r.exit_code, r.stdout, r.stderr, r.reason, r.ok) == (0, "1\n", "e\n", "exited",
                                                                     True)
        assert "".join(chunks) == "1\n" and r.duration >= 0
        r = sbx.commands.run(["sh", "-c", "exit 4"], check=False)
        assert r.exit_code == 4 and not r.ok
        with pytest.raises(CommandExitError):  # as E2B's commands.run
            sbx.commands.run(["sh", "-c", "exit 4"])
        r = sbx.exec("sleep 20", timeout=0.3)
        assert r.reason == "timeout" and r.exit_code is None
        assert sbx.files.write("/d/x.txt", "héllo") == 6
        assert sbx.files.read("/d/x.txt") == "héllo"
        assert sbx.files.write("/d/big", io.BytesIO(b"z" * 700_000)) == 700_000
        assert sbx.files.read_bytes("/d/big") == b"z" * 700_000
        with pytest.raises(NotFoundError):
            sbx.files.read("/nope")
        with pytest.raises(BadRequestError):
            sbx.files.write("/../../x", b"")
        sbx.pause()
        assert sbx.state == "paused"
        with pytest.raises(InvalidStateError) as ei:
            sbx.pause()
        assert ei.value.code == "invalid_state" and ei.value.status == 409
        assert isinstance(ei.value, RuntimeError)
        assert sbx.exec("echo awake").stdout == "awake\n"  # any request resumes it
        assert sbx.state == "running"
        with pytest.raises(InvalidStateError):
            sbx.resume()
        sbx.set_timeout(100)
        assert sbx.info["ttl_s"] == 100
        assert [s.id for s in Sandbox.list(labels={"a": "b"}, socket=node.socket)] == ["sdk"]
        assert Sandbox.list(labels={"a": "c"}, socket=node.socket) == []
    with pytest.raises(NotFoundError):
        Sandbox.connect("sdk", socket=node.socket)
    sbx.kill()  # idempotent


def test_sync_errors(make_node, sockdir) -> None:
    node = make_node(max_sandboxes=1, retry_after_s=3)
    Sandbox.create(layers=[digest(1)], socket=node.socket)
    with pytest.raises(CapacityExhaustedError) as ei:
        Sandbox.create(layers=[digest(1)], socket=node.socket)
    assert ei.value.retry_after == 3.0
    with pytest.raises(NotFoundError):
        Sandbox.create(image="no:such", socket=node.socket)
    with pytest.raises(KeyError):  # builtin side of NotFoundError
        Sandbox.connect("absent", socket=node.socket)
    with pytest.raises(DaemonUnavailableError):
        Sandbox.create(layers=[digest(1)], socket=str(sockdir / "nothing.sock"))


def test_env_socket(node, monkeypatch) -> None:
    monkeypatch.setenv("EDGED_SOCKET", node.socket)
    with Sandbox.create(layers=[digest(1)]) as sbx:
        assert sbx.exec("echo ok").stdout == "ok\n"


def test_async_sandbox(node) -> None:
    async def main() -> None:
        got: list[str] = []
        async with await AsyncSandbox.create(layers=[digest(1), digest(2)], id="as",
                                             socket=node.socket) as sbx:
            r = await sbx.exec("echo a; echo b >&2; exit 2", on_stderr=got.append)
            assert (r.exit_code, r.stdout, r.stderr) == (2, "a\n", "b\n") and got == ["b\n"]
            rs = await asyncio.gather(*(sbx.commands.run(f"echo {i}") for i in range(5)))
            assert [x.stdout for x in rs] == [f"{i}\n" for i in range(5)]
            assert await sbx.files.write("/f", b"\x00\x01") == 2
            assert await sbx.files.read_bytes("/f") == b"\x00\x01"
            await sbx.pause()
            with pytest.raises(InvalidStateError):
                await sbx.pause()
            assert (await sbx.exec("echo awake")).stdout == "awake\n"  # resumed by it
            with pytest.raises(InvalidStateError):
                await sbx.resume()
            await sbx.set_timeout(50)
        with pytest.raises(NotFoundError):
            await AsyncSandbox.connect("as", socket=node.socket)
        with pytest.raises(SandboxError):
            await AsyncSandbox.create(layers=["bad"], socket=node.socket)

    asyncio.run(main())


def test_sdk_import_is_cheap() -> None:
    code = (
        "import sys, edged.client\n"
        "bad = [m for m in sys.modules if m.startswith(('layerfs', 'aiohttp', 'edged.node',"
        " 'edged.api', 'edged.daemon', 'edged.images', 'edged.backends', 'prometheus_client',"
        " 'cffi'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_parallel_creates_admitted_exactly_to_capacity(make_node) -> None:
    node = make_node(max_sandboxes=10)
    node.backend.create_delay = 0.05  # creates overlap in the daemon

    async def one(i: int) -> str:
        try:
            sbx = await AsyncSandbox.create(layers=[digest(1)], id=f"p{i}", socket=node.socket)
        except CapacityExhaustedError:
            return "full"
        await sbx.close()
        return "ok"

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(main())
    assert results.count("ok") == 10 and results.count("full") == 10
    assert len(node.backend.live) == 10
    assert node.server.manager.capacity.to_json()["allocated"]["sandboxes"] == 10
