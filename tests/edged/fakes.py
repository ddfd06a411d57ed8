"""Test doubles for the daemon's tests: a backend that runs execs as plain host subprocesses
in a per-sandbox directory, and layer operations that "mount" by recording. NOT a sandbox:
nothing here confines anything. The real backend is edged.backends.container."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

from edged.backends.base import (
    EventSink,
    ExecEnd,
    ExecSpec,
    FailureSink,
    LayerForm,
    MemoryUsage,
    NoReclaim,
    SandboxSpec,
)
from edged.errors import BackendError, BadRequest, NotFound
from edged.images.mounts import LayerMounts, LayerOps


class FakeExec:
    def __init__(self, exec_id: int, proc: asyncio.subprocess.Process, spec: ExecSpec) -> None:
        self.exec_id = exec_id
        self.proc = proc
        self.spec = spec
        self.t0 = time.monotonic()
        self.killed_for: str | None = None
        self.ended = False
        self.abandoned = False

    def _kill(self, why: str) -> None:
        if self.killed_for is None:
            self.killed_for = why
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def events(self) -> AsyncIterator[tuple[str, bytes] | ExecEnd]:
        q: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue(maxsize=4)
        total = 0

        async def pump(name: str, stream: asyncio.StreamReader | None) -> None:
            assert stream is not None
            while chunk := await stream.read(65536):
                await q.put((name, chunk))
            await q.put(None)

        tasks = [asyncio.ensure_future(pump("stdout", self.proc.stdout)),
                 asyncio.ensure_future(pump("stderr", self.proc.stderr))]
        timer = None
        if self.spec.timeout_s is not None:
            timer = asyncio.get_running_loop().call_later(
                self.spec.timeout_s, self._kill, "timeout")
        try:
            open_streams = 2
            while open_streams:
                item = await q.get()
                if item is None:
                    open_streams -= 1
                    continue
                if self.spec.output_limit is not None:
                    room = self.spec.output_limit - total
                    if room <= 0:
                        continue
                    if len(item[1]) > room:
                        item = (item[0], item[1][:room])
                    total += len(item[1])
                    if total >= self.spec.output_limit:
                        self._kill("output_limit")
                yield item
            rc = await self.proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            for t in tasks:
                t.cancel()
        dur = time.monotonic() - self.t0
        self.ended = True
        if self.killed_for:
            yield ExecEnd(self.killed_for, None, signal.SIGKILL, dur, None)
        elif rc < 0:
            yield ExecEnd("signalled", None, -rc, dur, None)
        else:
            yield ExecEnd("exited", rc, None, dur, None)

    async def write_stdin(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    async def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    async def resize(self, rows: int, cols: int) -> None:
        pass

    def abandon(self) -> None:
        if not self.ended:
            self.abandoned = True
            self._kill("killed")


class FakeBackend(NoReclaim):
    """``live`` (id → root dir) may be shared between instances to simulate a daemon restart
    with sandboxes still running. No memory policy (:class:`NoReclaim`)."""

    name = "container"
    layer_form: LayerForm = "tree"
    fds_per_sandbox = 0

    def __init__(self, root: Path, live: dict[str, Path] | None = None) -> None:
        self.on_event: EventSink | None = None
        self.warmed = 0
        self.closed = 0
        self.root = root
        self.live: dict[str, Path] = live if live is not None else {}
        self.paused: set[str] = set()
        self.specs: dict[str, SandboxSpec] = {}
        self.procs: dict[str, list[FakeExec]] = {}
        self.adopted: list[str] = []
        self.destroyed: list[str] = []
        self.leftovers: set[str] = set()
        self.fail_create: set[str] = set()
        self.create_delay = 0.0
        self.on_failure: FailureSink | None = None
        self._next = 1

    def _get(self, sid: str) -> Path:
        if sid not in self.live:
            raise NotFound(f"sandbox {sid}: not in backend")
        return self.live[sid]

    async def probe(self) -> dict[str, object]:
        return {"fake": True, "cgroup": "none"}

    async def create(self, spec: SandboxSpec) -> None:
        if self.create_delay:
            await asyncio.sleep(self.create_delay)
        d = self.root / spec.id
        d.mkdir(parents=True)
        self.live[spec.id] = d
        self.specs[spec.id] = spec
        if spec.id in self.fail_create:
            raise BackendError(f"sandbox {spec.id}: injected create failure")

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> FakeExec:
        d = self._get(sandbox_id)
        cwd = d / spec.cwd.lstrip("/")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **spec.env}
        proc = await asyncio.create_subprocess_exec(
            *spec.argv, cwd=cwd if cwd.is_dir() else d, env=env,
            stdin=asyncio.subprocess.PIPE if spec.stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        h = FakeExec(self._next, proc, spec)
        self._next += 1
        self.procs.setdefault(sandbox_id, []).append(h)
        return h

    async def kill_processes(self, sandbox_id: str) -> int:
        self._get(sandbox_id)
        n = 0
        for h in self.procs.get(sandbox_id, []):
            if h.proc.returncode is None:
                h._kill("killed")
                n += 1
        return n

    async def pause(self, sandbox_id: str) -> None:
        self._get(sandbox_id)
        self.paused.add(sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        self._get(sandbox_id)
        self.paused.discard(sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        for h in self.procs.pop(sandbox_id, []):
            h._kill("killed")
            with contextlib.suppress(Exception):
                await h.proc.wait()
        d = self.live.pop(sandbox_id, None)
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)
            self.destroyed.append(sandbox_id)
        self.paused.discard(sandbox_id)

    async def stats(self, sandbox_id: str) -> dict[str, int]:
        self._get(sandbox_id)
        return {"memory_bytes": 1 << 20, "cpu_usage_ns": 0, "pids": 1}

    def _resolve(self, sid: str, path: str) -> Path:
        d = self._get(sid)
        p = (d / path.lstrip("/")).resolve()
        if not p.is_relative_to(d.resolve()):
            raise BadRequest(f"path {path}: escapes the sandbox root")
        return p

    async def put_file(self, sandbox_id: str, path: str, data: AsyncIterator[bytes],
                       mode: int = 0o644, uid: int = 0, gid: int = 0) -> int:
        p = self._resolve(sandbox_id, path)
        p.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        with open(p, "wb") as f:
            async for chunk in data:
                f.write(chunk)
                n += len(chunk)
        os.chmod(p, mode)
        return n

    async def get_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        p = self._resolve(sandbox_id, path)
        if not p.is_file():
            raise NotFound(f"file {path}: no such file in sandbox {sandbox_id}")

        async def gen() -> AsyncIterator[bytes]:
            with open(p, "rb") as f:
                while chunk := f.read(65536):
                    yield chunk

        return gen()

    async def list_existing(self) -> list[str]:
        return sorted(set(self.live) | self.leftovers)

    async def adopt(self, sandbox_id: str) -> None:
        self._get(sandbox_id)
        self.adopted.append(sandbox_id)

    async def cleanup_leftovers(self, keep: set[str]) -> list[str]:
        gone = sorted(s for s in self.leftovers if s not in keep)
        self.leftovers -= set(gone)
        return gone

    async def warm(self) -> None:
        self.warmed += 1

    async def memory(self, sandbox_id: str) -> MemoryUsage:
        self._get(sandbox_id)
        return MemoryUsage()

    async def close(self) -> None:
        self.closed += 1


class FakeLayerOps:
    """Layer images as small files under ``cache``, "mounted" as records in ``mounted``."""

    def __init__(self, digests: set[str], cache: Path) -> None:
        self.digests = set(digests)
        self.cache = cache
        self.mounted: dict[str, str] = {}
        self.mount_calls = 0
        self.umount_calls = 0

    def ops(self) -> LayerOps:
        return LayerOps(image=self.image, mount=self.mount, umount=self.umount,
                        is_mounted=lambda mp: mp in self.mounted, has=self.digests.__contains__)

    def image(self, digest: str) -> str:
        if digest not in self.digests:
            raise KeyError(digest)
        self.cache.mkdir(parents=True, exist_ok=True)
        out = self.cache / (digest[7:] + ".erofs")
        out.write_bytes(digest.encode())
        return str(out)

    def mount(self, img: str, mp: str) -> None:
        self.mount_calls += 1
        self.mounted[mp] = img

    def umount(self, mp: str) -> None:
        self.umount_calls += 1
        del self.mounted[mp]


def digest(n: int) -> str:
    return "sha256:" + f"{n:x}".rjust(64, "0")


def fake_layers(tmp: Path, digests: set[str]) -> tuple[LayerMounts, FakeLayerOps]:
    f = FakeLayerOps(digests, tmp / "cache")
    return LayerMounts(f.ops(), tmp / "mnt"), f
