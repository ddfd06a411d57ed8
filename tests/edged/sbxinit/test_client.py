"""The sbx-init client over byte streams other than the container's Unix socket: the real
sbx-init binary, started here as a plain process (no sandbox, no cgroups: a tree is killed by
its session), driven over a socketpair and over a pipe pair (``sbx-init -c FD[:WFD]``); and a
misbehaving peer."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

import edged
from edged.backends.base import ExecEnd
from edged.errors import BadRequest
from edged.sbxinit import SbxClient, SbxExec, open_fds
from edged.sbxinit import protocol as P
from edged.security.ledger import Ledger

SBX_INIT = Path(edged.__file__).resolve().parent / "_bin" / "sbx-init"
ENV = {"PATH": "/usr/bin:/bin"}
IDS = {"uid": os.getuid(), "gid": os.getgid()}


@pytest.fixture(params=["socketpair", "pipes"])
def init(request: pytest.FixtureRequest) -> Iterator[tuple[int, int]]:
    """A running sbx-init and the client's (read fd, write fd) of its control stream."""
    if not SBX_INIT.exists():
        pytest.skip("sbx-init is not built (pip install -e .)")
    if request.param == "socketpair":
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([str(SBX_INIT), "-c", str(theirs.fileno())],
                                pass_fds=[theirs.fileno()])
        theirs.close()
        rfd = wfd = ours.detach()
    else:
        to_init_r, to_init_w = os.pipe()
        from_init_r, from_init_w = os.pipe()
        proc = subprocess.Popen([str(SBX_INIT), "-c", f"{to_init_r}:{from_init_w}"],
                                pass_fds=[to_init_r, from_init_w])
        os.close(to_init_r)
        os.close(from_init_w)
        rfd, wfd = from_init_r, to_init_w
    try:
        yield rfd, wfd
    finally:
        proc.kill()
        proc.wait(10)


def run(fds: tuple[int, int], body: Callable[[SbxClient], Awaitable[None]],
        sink: Ledger | None = None) -> None:
    async def main() -> None:
        reader, writer = await open_fds(*fds)
        client = SbxClient("t", reader, writer, None if sink is None else sink.record)
        try:
            await body(client)
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


async def collect(h: SbxExec) -> tuple[bytes, bytes, ExecEnd]:
    out, err = bytearray(), bytearray()
    async for ev in h.events():
        if isinstance(ev, ExecEnd):
            return bytes(out), bytes(err), ev
        (out if ev[0] == "stdout" else err).extend(ev[1])
    raise AssertionError("no ExecEnd")


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if stat[stat.rindex(")") + 2] in "ZX":
            return True
        time.sleep(0.01)
    return False


def test_hello_exec_stdin_and_exit_code(init: tuple[int, int]) -> None:
    async def body(c: SbxClient) -> None:
        info = await c.hello()
        assert (info.version, info.cgroup_mode, info.execs) == (P.VERSION, "none", 0)
        h = await c.exec(("/bin/sh", "-c", "echo out; echo err >&2; read x; echo got $x; "
                          "exit 3"), ENV, stdin=True, **IDS)
        assert h.pid > 0
        await h.write_stdin(b"hi\n")
        await h.close_stdin()
        out, err, end = await collect(h)
        assert (out, err) == (b"out\ngot hi\n", b"err\n")
        assert (end.reason, end.exit_code, end.signal) == ("exited", 3, None)
        with pytest.raises(BadRequest, match="nonexistent"):
            await c.exec(("nonexistent",), ENV, **IDS)

    run(init, body)


def test_flow_control_carries_more_than_the_window(init: tuple[int, int]) -> None:
    """Output far beyond the credit window arrives whole: credits flow back over the same
    stream (a pipe pair's write end is not the read end)."""
    async def body(c: SbxClient) -> None:
        n = 8 * P.WINDOW + 12345
        h = await c.exec(("/bin/sh", "-c", f"head -c {n} /dev/zero"), ENV, **IDS)
        out, _, end = await collect(h)
        assert len(out) == n and end.exit_code == 0

    run(init, body)


def test_signal_kill_and_closing_the_client_ends_execs(init: tuple[int, int]) -> None:
    pids: list[int] = []

    async def body(c: SbxClient) -> None:
        h = await c.exec(("sleep", "100"), ENV, **IDS)
        await h.signal(signal.SIGTERM)
        _, _, end = await collect(h)
        assert (end.reason, end.signal) == ("signalled", signal.SIGTERM)
        h = await c.exec(("sleep", "100"), ENV, **IDS)
        await h.kill()
        _, _, end = await collect(h)
        assert end.reason == "killed"
        h = await c.exec(("sleep", "100"), ENV, **IDS)
        pids.append(h.pid)

    run(init, body)  # closes the client with the last sleep running
    assert _gone(pids[0]), "sbx-init kept an exec of a client that went away"


@pytest.mark.parametrize("garbage", [
    P.frame(0x99, 0, b"x"),  # unknown type
    P.frame(P.STARTED, 1, b"\x00"),  # wrong payload size
    P.HDR.pack(P.MAX_PAYLOAD + 1, P.STDOUT, 0, 1, 0),  # oversized
])
def test_a_misbehaving_sbx_init_is_a_recorded_violation(garbage: bytes) -> None:
    """Frames only a compromised PID 1 would send end the connection and are recorded."""
    led = Ledger(None)

    async def body() -> None:
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=a)
        conn = SbxClient("bad", reader, writer, led.record)
        b.sendall(garbage)
        for _ in range(100):
            if conn.closed:
                break
            await asyncio.sleep(0.01)
        assert conn.closed
        await conn.close()
        b.close()

    asyncio.run(asyncio.wait_for(body(), 10))
    ev = led.events("bad")
    assert [e.kind for e in ev] == ["protocol_violation"] and ev[0].detail["from"] == "sbx-init"
