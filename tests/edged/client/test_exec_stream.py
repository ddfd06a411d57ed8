"""Exec output through the API and both SDKs arrives whole, however it is chunked."""

from __future__ import annotations

import asyncio

from edged.client import AsyncSandbox, Sandbox
from tests.edged.fakes import digest

# 64 KiB chunks (the backend's largest) of bytes that are not UTF-8: each becomes U+FFFD,
# six bytes of JSON ("\ufffd"), so one NDJSON line is ~390 KB
NOT_UTF8 = ["python3", "-c", "import sys; sys.stdout.buffer.write(b'\\xff' * 200000)"]


def test_async_sdk_takes_lines_longer_than_aiohttp_buffers(node) -> None:
    # A check, not a bug found: the async SDK reads the NDJSON stream with aiohttp's line
    # iterator, whose buffer is 64 KiB (2x for a line); lines several times longer must pass.
    async def body() -> None:
        async with await AsyncSandbox.create(layers=[digest(1)], id="long",
                                             socket=node.socket) as sbx:
            r = await sbx.exec(NOT_UTF8)
            assert (r.reason, r.exit_code) == ("exited", 0)
            assert r.stdout == "\ufffd" * 200_000

    asyncio.run(body())


def test_sync_sdk_takes_long_lines(node) -> None:
    with Sandbox.create(layers=[digest(1)], id="long-sync", socket=node.socket) as sbx:
        r = sbx.exec(NOT_UTF8)
        assert (r.reason, r.exit_code, r.stdout) == ("exited", 0, "\ufffd" * 200_000)
