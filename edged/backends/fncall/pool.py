"""A pool of warm FnCall sandboxes of one image: container sandboxes made through the node
(:class:`~edged.backends.base.SandboxHost`, task profile ``fncall``), each running the call
server (:mod:`edged.backends.fncall.server`) as one long exec and serving one call at a
time.

The pool keeps ``size`` members, refilled in the background: a member is replaced (the
sandbox removed through the node, which kills everything in it through its cgroups) after
``recycle_after`` calls or at any sign of tampering or trouble: processes the call left
(``leftovers``), System V IPC objects left, a server that answered an error, broke the
protocol, did not answer within the call's wall time plus :data:`ANSWER_MARGIN_S`, or ended.

Backpressure: a call waits for an idle member; at most ``queue`` calls wait, the next one
is refused at once with :class:`~edged.errors.CapacityExhausted` (503, ``Retry-After``).
A call never waits longer than :data:`ACQUIRE_TIMEOUT_S` (the same refusal), and while no
member can be made at all (a broken image), waiting calls fail with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.backends.base import ExecEnd, ExecHandle, ExecSpec, Resources, SandboxHost
from edged.backends.fncall import server
from edged.errors import BackendError, CapacityExhausted, EdgedError

log = logging.getLogger("edged.fncall")

SERVER_SOURCE = Path(server.__file__).read_text()
#: the call spawner (csrc/fncall/spawn.c), sent to every pool sandbox's server at its start
SPAWNER = Path(server.__file__).resolve().parents[2] / "_bin" / "fncall-spawn"
#: label every pool sandbox carries (value: the pool's name)
LABEL = "edged.fncall.pool"
READY_TIMEOUT_S = 30.0
ANSWER_MARGIN_S = 10.0
ACQUIRE_TIMEOUT_S = 30.0
#: seconds between attempts while members cannot be made
RETRY_S = 1.0


@dataclass(frozen=True)
class PoolSpec:
    """One pool: ``name`` (its label value), the image (``name:tag``) or its layers,
    each member's ``resources``, ``size`` members, a member replaced after
    ``recycle_after`` calls (0: never), at most ``queue`` calls waiting, the Python modules
    the warm interpreter imports (``preload``, comma-separated), the members' CPU class."""

    name: str
    image: str | None
    layers: tuple[str, ...]
    resources: Resources
    size: int = 4
    recycle_after: int = 1000
    queue: int = 256
    preload: str = ""
    qos: str = "latency_sensitive"


class Broken(BackendError):
    """A member failed (its server ended, answered garbage, or not at all): it is replaced;
    the call it served gets Internal Error."""


class _Channel:
    """The bytes a member's server writes on its stdout, read as lines and exact sizes."""

    def __init__(self, handle: ExecHandle, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self.buf = bytearray()
        self.end: ExecEnd | None = None
        self.stderr = bytearray()
        self._more = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        tap = getattr(handle, "tap", None)
        if tap is not None:  # sbx-init's exec: fed from the connection's reader directly,
            tap(self._take)  # without a task hop per answer (one event-loop turn less)
        else:
            self._task = asyncio.create_task(self._pump(handle))

    def _take(self, ev: tuple[str, bytes] | ExecEnd) -> None:
        if isinstance(ev, ExecEnd):
            self.end = ev
        elif ev[0] == "stdout":
            self.buf += ev[1]
        else:
            self.stderr = (self.stderr + ev[1])[-4096:]
        self._more.set()

    async def _pump(self, handle: ExecHandle) -> None:
        try:
            async for ev in handle.events():
                self._take(ev)
        finally:
            if self.end is None:
                self.end = ExecEnd("killed", None, None, 0.0, None)
            self._more.set()

    def _gone(self) -> Broken:
        tail = self.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        return Broken(f"fncall sandbox {self.sandbox_id}: call server ended ({self.end}); "
                      f"stderr: {' | '.join(tail) or 'empty'}")

    async def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + 1]
                return out
            if self.end is not None:
                raise self._gone()
            self._more.clear()
            await self._more.wait()

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if self.end is not None:
                raise self._gone()
            self._more.clear()
            await self._more.wait()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class Member:
    """One warm pool sandbox: its id, the server exec, how many calls it served."""

    def __init__(self, sandbox_id: str, handle: ExecHandle, chan: _Channel,
                 backend: Any) -> None:
        self.id = sandbox_id
        self.handle = handle
        self.chan = chan
        self.backend = backend
        self.calls = 0
        #: OOM kills of its memory cgroup seen so far (the backend's verdicts)
        self.oom_seen = 0
        #: the pid of its call spawner (in the sandbox's pid namespace), None without one
        self.spawner_pid: int | None = None
        self._next = 1

    async def request(self, head: dict[str, Any], blobs: list[bytes],
                      timeout_s: float) -> tuple[dict[str, Any], list[bytes]]:
        """Send one call, return the server's answer and its payloads (stdout, stderr,
        then each fetched file that exists). Raises :class:`Broken`."""
        head = {**head, "id": self._next}
        self._next += 1
        try:
            await self.handle.write_stdin(json.dumps(head).encode() + b"\n" + b"".join(blobs))
            async with asyncio.timeout(timeout_s):  # the whole answer (no task per read)
                raw = await self.chan.line()
                rep: dict[str, Any] = json.loads(raw)
                if rep.get("id") != head["id"]:
                    raise Broken(f"fncall sandbox {self.id}: answer to call "
                                 f"{rep.get('id')}, not {head['id']}")
                sizes = [rep["stdout"][0], rep["stderr"][0]] if "stdout" in rep else []
                sizes += [s for _, s in rep.get("files", []) if s is not None]
                out = [await self.chan.exactly(int(n)) for n in sizes]
        except TimeoutError as exc:
            raise Broken(f"fncall sandbox {self.id}: no answer within {timeout_s:.0f} s"
                         ) from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise Broken(f"fncall sandbox {self.id}: bad answer: {exc}") from exc
        except EdgedError as exc:
            raise Broken(f"fncall sandbox {self.id}: {exc}") from exc
        self.calls += 1
        return rep, out

    def close(self) -> None:
        self.chan.close()
        self.handle.abandon()


class Pool:
    """The members of one :class:`PoolSpec` on ``host``. ``host_pidns``: the daemon's pid
    namespace (the server refuses to run in it). ``probe``: paths of the image to look for
    (the programs languages require)."""

    def __init__(self, spec: PoolSpec, host: SandboxHost, host_pidns: str, *,
                 probe: tuple[str, ...] = ()) -> None:
        self.spec = spec
        #: paths whose presence in the image the first member reports (:attr:`present`)
        self.probe = probe
        self.present: set[str] | None = None
        self._first = asyncio.Event()
        self.host = host
        self.host_pidns = host_pidns
        self._idle: deque[Member] = deque()
        self._busy: set[Member] = set()
        self._making = 0
        self._waiters: deque[asyncio.Future[Member]] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.last_error: str | None = None
        #: members made, replaced (by cause), calls served
        self.stats: dict[str, int] = {"made": 0, "calls": 0}

    # -- members --------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def fill(self) -> None:
        """Start making members up to ``size`` (in the background)."""
        while not self._closed and (len(self._idle) + len(self._busy) + self._making
                                    < self.spec.size):
            self._making += 1
            self._spawn(self._make())

    async def _make(self) -> None:
        try:
            while not self._closed:
                try:
                    m = await self._new_member()
                except EdgedError as exc:
                    self.last_error = str(exc)
                    self._first.set()
                    log.warning("fncall pool %s: cannot make a sandbox: %s", self.spec.name, exc)
                    self._fail_waiters_if_empty()
                    await asyncio.sleep(RETRY_S)
                    continue
                if self._closed:
                    await self._remove(m, "closed")
                    return
                self.last_error = None
                self.stats["made"] += 1
                self._give(m)
                return
        finally:
            self._making -= 1

    async def _new_member(self) -> Member:
        sp = self.spec
        sid = await self.host.create_sandbox(
            backend="container", layers=sp.layers, image=sp.image, resources=sp.resources,
            task_profile="fncall", qos=sp.qos, labels={LABEL: sp.name})
        try:
            backend = self.host.backend_of(sid)
            argv: tuple[str, ...] = ("python3", "-I", "-B", "-c", SERVER_SOURCE, "--host-pidns",
                    self.host_pidns, "--preload", sp.preload, "--probe", ",".join(self.probe))
            spawner = _spawner()
            if spawner:
                argv += ("--spawn-size", str(len(spawner)))
            handle = await backend.exec(sid, ExecSpec(argv=argv, env={}, stdin=True))
            chan = _Channel(handle, sid)
            m = Member(sid, handle, chan, backend)
            try:
                if spawner:
                    await handle.write_stdin(spawner)
                ready = json.loads(await asyncio.wait_for(chan.line(), READY_TIMEOUT_S))
            except (TimeoutError, ValueError) as exc:
                m.close()
                raise BackendError(f"fncall sandbox {sid}: the call server did not start: "
                                   f"{exc or 'timed out'}") from exc
            except BaseException:
                m.close()
                raise
            if not ready.get("ready"):
                m.close()
                raise BackendError(f"fncall sandbox {sid}: the call server said {ready}")
            m.spawner_pid = ready.get("spawner")
            if ready.get("spawner_error"):
                log.warning("fncall pool %s: the call spawner did not start (%s): programs "
                            "run from the zygote", sp.name, ready["spawner_error"])
            self.present = set(ready.get("present") or ())
            self._first.set()
            if ready.get("preload_failed"):
                log.warning("fncall pool %s: preload failed: %s", sp.name,
                            "; ".join(ready["preload_failed"]))
            return m
        except BaseException:
            with contextlib.suppress(Exception):
                await self.host.delete_sandbox(sid)
            raise

    def _give(self, m: Member) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                self._busy.add(m)
                w.set_result(m)
                return
        self._idle.append(m)

    def _fail_waiters_if_empty(self) -> None:
        if self._idle or self._busy:
            return
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(BackendError(f"fncall pool {self.spec.name}: no sandbox: "
                                             f"{self.last_error}"))

    async def _remove(self, m: Member, why: str) -> None:
        m.close()
        self.stats[f"replaced_{why}"] = self.stats.get(f"replaced_{why}", 0) + 1
        try:
            await self.host.delete_sandbox(m.id)
        except EdgedError as exc:
            log.warning("fncall pool %s: removing sandbox %s: %s", self.spec.name, m.id, exc)

    # -- calls ----------------------------------------------------------------------------

    async def ready(self) -> None:
        """Wait until a first member has started (so :attr:`present` is known) or making
        one failed. Raises BackendError in that case, CapacityExhausted after
        ACQUIRE_TIMEOUT_S."""
        if self.present is not None:
            return
        self.fill()
        try:
            await asyncio.wait_for(self._first.wait(), ACQUIRE_TIMEOUT_S)
        except TimeoutError as exc:
            raise CapacityExhausted(f"fncall pool {self.spec.name}: no sandbox started "
                                    f"within {ACQUIRE_TIMEOUT_S:.0f} s", retry_after=1.0) from exc
        if self.present is None:
            raise BackendError(f"fncall pool {self.spec.name}: no sandbox: {self.last_error}")

    async def acquire(self) -> Member:
        """An idle member, for one call. Raises CapacityExhausted (queue full, or none
        within ACQUIRE_TIMEOUT_S), BackendError (no member can be made)."""
        if self._closed:
            raise BackendError(f"fncall pool {self.spec.name}: closed")
        while self._idle:
            m = self._idle.popleft()
            if m.chan.end is not None:  # its server ended while idle (sandbox deleted...)
                self._spawn(self._remove(m, "died"))
                self.fill()
                continue
            self._busy.add(m)
            return m
        self.fill()
        if len(self._waiters) >= self.spec.queue:
            raise CapacityExhausted(f"fncall pool {self.spec.name}: {len(self._waiters)} calls "
                                    f"waiting already", retry_after=1.0)
        if not self._busy and not self._making and self.last_error:
            raise BackendError(f"fncall pool {self.spec.name}: no sandbox: {self.last_error}")
        fut: asyncio.Future[Member] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), ACQUIRE_TIMEOUT_S)
        except BaseException as exc:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                m = fut.result()  # given just as this call gave up: back to idle
                self._busy.discard(m)
                self._give(m)
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            if isinstance(exc, TimeoutError):
                raise CapacityExhausted(f"fncall pool {self.spec.name}: no sandbox free "
                                        f"within {ACQUIRE_TIMEOUT_S:.0f} s",
                                        retry_after=1.0) from exc
            raise

    def release(self, m: Member, replace: str | None) -> None:
        """The call on ``m`` is over: back to idle, or ``replace`` (why) it."""
        self._busy.discard(m)
        self.stats["calls"] += 1
        sp = self.spec
        if replace is None and sp.recycle_after and m.calls >= sp.recycle_after:
            replace = "recycled"
        if replace is None and self._closed:
            replace = "closed"
        if replace is None:
            self._give(m)
            return
        log.info("fncall pool %s: replacing sandbox %s (%s)", sp.name, m.id, replace)
        self._spawn(self._remove(m, replace))
        self.fill()

    def counts(self) -> dict[str, int]:
        """Idle, busy and starting members, waiting calls."""
        return {"idle": len(self._idle), "busy": len(self._busy), "starting": self._making,
                "waiting": len(self._waiters)}

    async def close(self) -> None:
        """Remove every member (busy ones once their call ends)."""
        self._closed = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(BackendError(f"fncall pool {self.spec.name}: closed"))
        idle = list(self._idle)
        self._idle.clear()
        await asyncio.gather(*(self._remove(m, "closed") for m in idle),
                             return_exceptions=True)
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t


_spawner_bytes: bytes | None = None


def _spawner() -> bytes:
    """The spawner's binary (read once), b"" if it was not built: the zygote then runs
    every call."""
    global _spawner_bytes
    if _spawner_bytes is None:
        try:
            _spawner_bytes = SPAWNER.read_bytes()
        except OSError as exc:
            log.warning("fncall: no call spawner (%s): programs run from the zygote", exc)
            _spawner_bytes = b""
    return _spawner_bytes


def host_pidns() -> str:
    """This process's pid namespace, as ``/proc/self/ns/pid`` names it."""
    return os.readlink("/proc/self/ns/pid")


__all__ = ["LABEL", "Broken", "Member", "Pool", "PoolSpec", "host_pidns"]
