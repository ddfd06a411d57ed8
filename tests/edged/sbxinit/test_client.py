"""The sbx-init client over byte streams other than the container's Unix socket: the real
sbx-init binary, started here as a plain process (no sandbox, no cgroups: a tree is killed by
its session), driven over a socketpair and over a pipe pair (``sbx-init -c FD[:WFD]``); and a
misbehaving peer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

import edged
from edged.errors import BackendError, BadRequest, NotFound
from edged.sbxinit import SbxClient, open_fds
from edged.sbxinit import protocol as P
from edged.sbxinit.client import connect_unix
from edged.security.ledger import Ledger
from tests.edged.execs import collect, gone

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


def test_a_tap_gets_everything_in_order_past_the_window_then_the_end(
        init: tuple[int, int]) -> None:
    """An exec tapped (``SbxExec.tap``, what a FnCall pool member uses) gets what came before
    the tap and what comes after it, in order, beyond the credit window (credited back as
    it is given), then its end once, last."""
    async def body(c: SbxClient) -> None:
        n = 4 * P.WINDOW + 777
        h = await c.exec(("/bin/sh", "-c", f"echo first; read x; head -c {n} /dev/zero; "
                          "echo err >&2; exit 4"), ENV, stdin=True, **IDS)
        got: list[object] = []
        done = asyncio.Event()

        def take(item: object) -> None:
            got.append(item)
            if not isinstance(item, tuple):
                done.set()

        for _ in range(100):  # "first" queued before the tap
            if not h._q.empty():
                break
            await asyncio.sleep(0.01)
        h.tap(take)
        await h.write_stdin(b"go\n")
        await asyncio.wait_for(done.wait(), 30)
        out = b"".join(i[1] for i in got if isinstance(i, tuple) and i[0] == "stdout")
        err = b"".join(i[1] for i in got if isinstance(i, tuple) and i[0] == "stderr")
        assert out == b"first\n" + bytes(n) and err == b"err\n"
        ends = [i for i in got if not isinstance(i, tuple)]
        assert ends == [got[-1]] and getattr(ends[0], "exit_code", None) == 4

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
    assert gone(pids[0]), "sbx-init kept an exec of a client that went away"


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


def test_a_silent_sbx_init_times_out_saying_what_and_how_long(tmp_path: Path) -> None:
    """Bug (issue 9, item 2): str(TimeoutError()) is empty, and the reattach after a pause
    said only "... came back: timed out"; every wait on sbx-init that times out names what
    it waited for and for how long."""
    async def body() -> None:
        a, b = socket.socketpair()
        c = SbxClient("mute", *await asyncio.open_unix_connection(sock=a))
        with pytest.raises(BackendError, match=r"no hello from sbx-init: no answer within "
                                               r"0\.05 s"):
            await c.hello(0.05)
        # a peer that answers QUIESCE (DONE) and nothing else: the reattach gets no hello
        peer = await asyncio.open_unix_connection(sock=b)

        async def answer_quiesce() -> None:
            while True:  # the HELLO above first (no payload)
                _n, type_, _f, rid, _r = P.HDR.unpack(await peer[0].readexactly(P.HDR.size))
                if type_ == P.QUIESCE:
                    peer[1].write(P.frame(P.DONE, rid, P.DONE_S.pack(0, 0)))
                    return

        answering = asyncio.create_task(answer_quiesce())
        await c.quiesce(5)
        await answering
        await c.detach()
        x, y = socket.socketpair()
        with pytest.raises(BackendError, match=r"after the transport came back: no answer "
                                               r"within 0\.05 s"):
            await c.reattach(*await asyncio.open_unix_connection(sock=x), timeout_s=0.05)
        peer[1].close()
        y.close()
        # connect_unix to a socket that accepts and never answers
        path = tmp_path / "mute.sock"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.listen()
        with pytest.raises(BackendError, match=r"no answer within 0\.05 s"):
            await connect_unix(path, "mute", timeout_s=0.05)
        server.close()

    asyncio.run(asyncio.wait_for(body(), 30))


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def test_files_in_and_out_through_sbx_init(init: tuple[int, int], tmp_path: Path) -> None:
    """FILE_PUT / FILE_GET: what a guest needs without host-side access. A put appears
    whole with its owner and mode, a get streams back beyond the credit window, and what
    is not a file there is refused as what it is."""
    big = os.urandom(4 * P.WINDOW + 777)
    target = tmp_path / "sub" / "file.bin"
    target.parent.mkdir()

    async def body(c: SbxClient) -> None:
        n = await c.put_file(str(target), _chunks(big[:100_000], big[100_000:]), mode=0o640,
                             uid=os.getuid(), gid=os.getgid())
        assert n == len(big) and target.read_bytes() == big
        st = target.stat()
        assert (st.st_mode & 0o7777, st.st_uid) == (0o640, os.getuid())
        assert [p.name for p in target.parent.iterdir()] == ["file.bin"]  # no temp left
        got = b"".join([chunk async for chunk in await c.get_file(str(target))])
        assert got == big
        assert b"".join([x async for x in await c.get_file(str(tmp_path / "sub" / "../sub/"
                                                                 "file.bin"))]) == big
        with pytest.raises(NotFound):
            await c.get_file(str(tmp_path / "missing"))
        with pytest.raises(BadRequest, match="regular file"):
            await c.get_file(str(tmp_path))
        with pytest.raises(BadRequest):  # /proc is another mount: no writes there
            await c.put_file("/proc/sys/kernel/hostname", b"x")
        with pytest.raises(BadRequest, match="absolute"):
            await c.put_file("relative", b"x")
        empty = tmp_path / "empty"
        assert await c.put_file(str(empty), b"") == 0 and empty.read_bytes() == b""
        assert b"".join([x async for x in await c.get_file(str(empty))]) == b""

    run(init, body)


def test_an_abandoned_put_leaves_nothing(init: tuple[int, int], tmp_path: Path) -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"partial"
        raise RuntimeError("the source broke")

    async def body(c: SbxClient) -> None:
        with pytest.raises(RuntimeError):
            await c.put_file(str(tmp_path / "f"), failing())
        await c.hello()  # a round trip: the abort was handled before the answer
        assert list(tmp_path.iterdir()) == []

    run(init, body)


def test_kill_all_ends_every_exec(init: tuple[int, int]) -> None:
    """Outside a pid namespace of its own (as here) sbx-init kills each exec's tree, never
    kill(-1) (that would reach the host's processes)."""
    async def body(c: SbxClient) -> None:
        hs = [await c.exec(("sleep", "100"), ENV, **IDS) for _ in range(2)]
        assert await c.kill_all() == 2
        for h in hs:
            _, _, end = await collect(h)
            assert end.reason == "killed"
        h = await c.exec(("/bin/sh", "-c", "echo still"), ENV, **IDS)
        out, _, _ = await collect(h)
        assert out == b"still\n"

    run(init, body)


class _Relay:
    """Plays a microVM's VMM between the client and sbx-init: sbx-init keeps its end of the
    stream while the client's side goes away and comes back (a paused VM's restore);
    ``from_init`` counts the bytes sbx-init sent."""

    def __init__(self, init_sock: socket.socket) -> None:
        self.init_sock = init_sock
        self.from_init = 0
        self.client: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def attach(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        self.client = ours
        loop = asyncio.get_running_loop()

        async def pump(src: socket.socket, dst: socket.socket, count: bool) -> None:
            while True:
                data = await loop.sock_recv(src, 65536)
                if not data:
                    return
                if count:
                    self.from_init += len(data)
                await loop.sock_sendall(dst, data)

        self._tasks = [asyncio.create_task(pump(self.init_sock, ours, True)),
                       asyncio.create_task(pump(ours, self.init_sock, False))]
        return await asyncio.open_unix_connection(sock=theirs)

    async def detach(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        assert self.client is not None
        self.client.close()


def test_quiesce_keeps_execs_across_a_transport_that_goes_and_comes_back() -> None:
    """A microVM's pause: quiesce (everything sbx-init sent before the answer is taken, and
    it sends nothing after), the transport goes; what the client sends meanwhile is held;
    over a new transport the exec goes on and ends with all its output."""
    if not SBX_INIT.exists():
        pytest.skip("sbx-init is not built (pip install -e .)")
    theirs, init_side = socket.socketpair()
    proc = subprocess.Popen([str(SBX_INIT), "-c", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()])
    theirs.close()
    init_side.setblocking(False)

    async def body() -> None:
        relay = _Relay(init_side)
        c = SbxClient("q", *await relay.attach())
        try:
            await c.hello()
            h = await c.exec(("/bin/sh", "-c", "echo a; sleep 0.5; echo b; read x; "
                              "echo got $x"), ENV, stdin=True, **IDS)
            events = h.events()
            assert await events.__anext__() == ("stdout", b"a\n")
            await c.quiesce()
            await c.detach()
            await relay.detach()
            sent = relay.from_init
            await asyncio.sleep(1.0)  # "b" is written meanwhile: sbx-init holds it
            assert relay.from_init == sent
            stdin = asyncio.create_task(h.write_stdin(b"x\n"))  # waits for the transport
            await asyncio.sleep(0.1)
            assert not stdin.done()
            info = await c.reattach(*await relay.attach())
            assert info.execs == 1
            await stdin
            out = bytearray()
            async for ev in events:
                if isinstance(ev, tuple):
                    out += ev[1]
                else:
                    assert (ev.reason, ev.exit_code) == ("exited", 0)
            assert bytes(out) == b"b\ngot x\n"
            # a second pause of the same connection works the same way
            await c.quiesce()
            await c.detach()
            await relay.detach()
            await c.reattach(*await relay.attach())
            h = await c.exec(("echo", "again"), ENV, **IDS)
            assert (await collect(h))[0] == b"again\n"
        finally:
            await c.close()
            await relay.detach()

    try:
        asyncio.run(asyncio.wait_for(body(), 30))
    finally:
        proc.kill()
        proc.wait(10)
        init_side.close()


class _Peer:
    """The sbx-init end of a socketpair, driven by hand: what frames came, and frames sent
    at will (a sbx-init whose exec never ends, then ends late)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.got: list[tuple[int, int, bytes]] = []  # (type, exec id, payload)

    async def start(self) -> None:
        self.reader, self.writer = await asyncio.open_unix_connection(sock=self.sock)
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                n, type_, _f, eid, _r = P.HDR.unpack(await self.reader.readexactly(P.HDR.size))
                self.got.append((type_, eid, await self.reader.readexactly(n)))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def wait_for(self, type_: int, eid: int | None = None) -> bytes:
        for _ in range(500):
            for t, e, payload in self.got:
                if t == type_ and eid in (None, e):
                    return payload
            await asyncio.sleep(0.01)
        raise AssertionError(f"no frame {type_:#x} for exec {eid}")

    def close(self) -> None:
        self._task.cancel()
        self.writer.close()


def test_an_exec_whose_end_never_comes_ends_at_its_timeout_plus_the_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug (CI 22:46: an exec with timeout 150 s still running after 5 min): sbx-init sends
    an exec's END once it has reaped the killed process, and a process in uninterruptible
    sleep (a FUSE read its server took and does not answer) is never reaped; the client
    waited with it for ever. Now the exec ends END_GRACE_S after its timeout, ``timeout``
    with a message, whether it had started or not; its tree is sent KILL again, output
    that comes after is credited back (sbx-init's slot is freed by its late END, which is
    not recorded twice), and the exec's id is not reused before that."""
    from edged.sbxinit import client as sbxclient

    monkeypatch.setattr(sbxclient, "END_GRACE_S", 0.2, raising=False)
    led = Ledger(None)

    async def body() -> None:
        a, b = socket.socketpair()
        peer = _Peer(b)
        await peer.start()
        c = SbxClient("stuck", *await asyncio.open_unix_connection(sock=a), led.record)
        # started, some output, never an end
        run = asyncio.create_task(c.exec(("stat", "/x"), ENV, timeout_s=0.1, **IDS))
        await peer.wait_for(P.EXEC_T, 1)
        peer.send(P.frame(P.STARTED, 1, P.STARTED_S.pack(42, 0)) + P.frame(P.STDOUT, 1, b"a"))
        h = await run
        out, _, end = await asyncio.wait_for(collect(h), 5)
        assert out == b"a" and (end.reason, end.exit_code) == ("timeout", None)
        assert end.message and "could not be reaped" in end.message, end
        assert 0.3 <= end.duration_s < 3, end
        await peer.wait_for(P.KILL, 1)
        # the late output is credited back; the late end frees the handle, unrecorded
        peer.send(P.frame(P.STDOUT, 1, b"bcd"))
        assert P.CREDIT_S.unpack(await peer.wait_for(P.CREDIT, 1)) == (3, 0)
        assert c._request_id() != 1  # still sbx-init's
        peer.send(P.frame(P.END, 1, P.END_S.pack(3, -1, 9, 0, 10**9, 0)))
        for _ in range(100):
            if not c.handles:
                break
            await asyncio.sleep(0.01)
        assert not c.handles
        # never started (its execve blocked): exec() returns a handle that ends so too
        run = asyncio.create_task(c.exec(("stat", "/y"), ENV, timeout_s=0.1, **IDS))
        for _ in range(500):
            execs = [e for t, e, _ in peer.got if t == P.EXEC_T]
            if len(execs) == 2:
                break
            await asyncio.sleep(0.01)
        eid = execs[-1]
        h = await asyncio.wait_for(run, 5)
        _, _, end = await asyncio.wait_for(collect(h), 5)
        assert end.reason == "timeout" and "could not be started" in (end.message or ""), end
        await peer.wait_for(P.KILL, eid)
        await c.close()
        peer.close()

    asyncio.run(asyncio.wait_for(body(), 30))
    assert [e.kind for e in led.events("stuck")] == ["timeout", "timeout"]


def test_the_end_grace_comes_from_the_environment_on_a_slow_machine() -> None:
    """``EDGED_EXEC_END_GRACE_S`` sets END_GRACE_S (the node VM's run sets 120: at 20 s a
    sbx-init at 5% of an emulated CPU had its execs ended before it had read their output);
    without it, 20 s."""
    code = "from edged.sbxinit import client; print(client.END_GRACE_S)"
    env = {k: v for k, v in os.environ.items() if k != "EDGED_EXEC_END_GRACE_S"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert float(out) == 20.0
    out = subprocess.run([sys.executable, "-c", code],
                         env={**env, "EDGED_EXEC_END_GRACE_S": "120"}, capture_output=True,
                         text=True, check=True).stdout
    assert float(out) == 120.0
