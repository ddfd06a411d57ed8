"""The asyncio SDK does what the blocking one does: the same methods and keyword names
(E2B/Modal names, file operations, sessions, terminate), E2B-style raising of
``commands.run``, and retries of a full node's 503 with a configurable policy."""

from __future__ import annotations

import asyncio
import inspect
import json
import time

import pytest

from edged.client import (
    AsyncSandbox,
    AsyncSession,
    CapacityExhaustedError,
    CommandExitError,
    ConflictError,
    NotFoundError,
    RetryPolicy,
    Sandbox,
    Session,
)
from edged.client.async_sandbox import AsyncCommands, AsyncFiles, AsyncTransport
from edged.client.sandbox import Commands, Files
from tests.edged.conftest import LAYERS


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def _params(fn: object) -> set[str]:
    return set(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_the_async_sdk_has_the_blocking_sdks_methods_and_names() -> None:
    # what only the blocking SDK has (documented in edged.client.async_sandbox): process
    # handles on a PTY, and a property that would be a round trip
    assert _public(Sandbox) - _public(AsyncSandbox) == {"pty", "state"}
    for sync, aio in ((Files, AsyncFiles), (Commands, AsyncCommands), (Session, AsyncSession)):
        assert _public(sync) <= _public(aio), (sync, _public(sync) - _public(aio))
        for name in _public(sync):
            if callable(getattr(sync, name)):
                assert _params(getattr(sync, name)) <= _params(getattr(aio, name)), name
    for name in ("create", "connect", "list", "session", "snapshot", "events"):
        assert _params(getattr(Sandbox, name)) == _params(getattr(AsyncSandbox, name)), name
    assert _params(Sandbox.exec) - _params(AsyncSandbox.exec) == {"background"}


@pytest.mark.root
@pytest.mark.mount
def test_async_sdk_on_a_real_sandbox(deb_node, debian_layer) -> None:
    node = deb_node()

    async def main() -> None:
        sbx = await AsyncSandbox.create(layers=[debian_layer[1]], socket=node.socket,
                                        cpu=1.0, memory_mib=256, envs={"X": "1"})
        try:
            assert sbx.info["resources"]["memory_bytes"] == 256 << 20
            assert sbx.info["resources"]["cpus"] == 1.0
            r = await sbx.exec("echo $X-$Y", envs={"Y": "2"}, user="root")
            assert r.stdout == "1-2\n"
            with pytest.raises(CommandExitError) as ei:
                await sbx.commands.run("echo out; exit 4")
            assert (ei.value.exit_code, ei.value.stdout) == (4, "out\n")
            assert (await sbx.commands.run("exit 4", check=False)).exit_code == 4
            # files: parents made, list/stat/exists/mkdir/remove/rename
            assert await sbx.files.write("/root/a/b/c.txt", "deep") == 4
            with pytest.raises(NotFoundError):
                await sbx.files.write("/root/x/y.txt", "no", parents=False)
            assert await sbx.files.mkdir("/root/d1/d2") is True
            assert await sbx.files.mkdir("/root/d1/d2") is False
            with pytest.raises(ConflictError):
                await sbx.files.mkdir("/root/a/b/c.txt/sub")
            ents = await sbx.files.list("/root/a", depth=2)
            assert [(e["path"], e["type"]) for e in ents] == [("/root/a/b", "dir"),
                                                              ("/root/a/b/c.txt", "file")]
            assert (await sbx.files.stat("/root/a/b/c.txt"))["size"] == 4
            assert (await sbx.files.rename("/root/a/b/c.txt", "/root/m.txt"))["type"] == "file"
            assert await sbx.files.read("/root/m.txt") == "deep"
            assert not await sbx.files.exists("/root/a/b/c.txt")
            await sbx.files.remove("/root/a")
            assert not await sbx.files.exists("/root/a")
            async with await sbx.session() as s:
                await s.run("cd /tmp")
                assert [x.id for x in await sbx.sessions()] == [s.id]
                assert (await s.run("pwd")).stdout == "/tmp\n"
            await sbx.terminate()
            with pytest.raises(NotFoundError):
                await sbx.refresh()
        finally:
            await sbx.kill()
            await sbx.close()

    asyncio.run(main())


def test_async_503_is_retried_until_capacity_frees(make_node) -> None:
    node = make_node(max_sandboxes=1, retry_after_s=1.0)
    layer = sorted(LAYERS)[0]

    async def main() -> None:
        first = await AsyncSandbox.create(layers=[layer], socket=node.socket)
        # none retried: the 503 at once, with the daemon's Retry-After
        t0 = time.monotonic()
        with pytest.raises(CapacityExhaustedError) as ei:
            await AsyncSandbox.create(layers=[layer], socket=node.socket,
                                      retry=RetryPolicy(retries=0))
        assert ei.value.retry_after == 1.0 and time.monotonic() - t0 < 0.9
        # the default policy waits the node out
        asyncio.get_running_loop().call_later(1.5, lambda: asyncio.ensure_future(first.kill()))
        t0 = time.monotonic()
        second = await AsyncSandbox.create(layers=[layer], socket=node.socket)
        assert time.monotonic() - t0 >= 1.0
        await second.kill()
        await second.close()
        await first.close()
        # a stream body is never retried (it cannot be sent twice)
        t = AsyncTransport(node.socket, retries=5)
        assert t.retry == RetryPolicy(retries=5)

        async def body():  # type: ignore[no-untyped-def]
            yield json.dumps({"layers": [layer]}).encode()

        blocker = await AsyncSandbox.create(layers=[layer], socket=node.socket)
        t0 = time.monotonic()
        with pytest.raises(CapacityExhaustedError):
            await t.request("POST", "/v1/sandboxes", data=body(),
                            headers={"Content-Type": "application/json"})
        assert time.monotonic() - t0 < 0.9
        await t.close()
        await blocker.kill()
        await blocker.close()

    asyncio.run(main())
    assert RetryPolicy(backoff_s=0.1).wait(2, None) <= 0.6
    assert RetryPolicy(max_wait_s=2.0).wait(0, 30.0) == 2.0
