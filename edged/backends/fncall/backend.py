"""The FnCall backend: stateless calls (source + stdin + limits -> verdict, output, time,
memory) served from pools of warm container sandboxes (:mod:`.pool`), one pool per image.

A call is a compile step where its language has one (:mod:`.languages`), then one run per
case, each run in a clean scratch of a pool sandbox (its own working directory; /tmp and
/dev/shm wiped after it; its processes gone or the sandbox replaced) and with its own
verdict (:data:`~edged.backends.base.VERDICTS`, first that applies):

- Time Limit Exceeded: the wall time ran out (its main process was killed), or its CPU time
  passed ``cpu_s`` (RLIMIT_CPU's SIGXCPU, or the figure measured);
- Memory Limit Exceeded: the pool sandbox's memory cgroup OOM-killed it, or its peak
  resident set passed ``memory_bytes`` (which is also its RLIMIT_AS when given), or it
  failed (non-zero exit, or a signal) saying that an allocation failed: the runtimes' own
  words at the end of its stderr (:data:`OUT_OF_MEMORY`: Python's MemoryError, C++'s
  std::bad_alloc, Java's OutOfMemoryError, Go's and Rust's and Node's messages, ENOMEM's
  text), which is how going past RLIMIT_AS shows (mmap/brk fail with ENOMEM). A program can
  print those words itself, but only to turn its own failure into another failure;
- Output Limit Exceeded: stdout or stderr passed ``output_bytes`` (cut there, flagged), or
  a file it wrote reached ``file_bytes`` (RLIMIT_FSIZE's SIGXFSZ);
- Dangerous Syscall: it failed (non-zero exit, or a signal) after the seccomp profile
  denied it a system call (each denial is in the ledger; the call got EPERM). A denial the
  program survives is no verdict: ordinary tools probe denied calls (``cp`` tries the
  FICLONE ioctl, then copies);
- Signalled / Nonzero Exit Status / Accepted: how its main process ended;
- Internal Error: the pool sandbox failed (its call server ended or broke the protocol).

"Compile once, run many": a compile result can be kept (``keep``) by id
(:mod:`.artifacts`) and named by later calls; one call runs its cases concurrently over the
pool's sandboxes.

As a backend of the registry it has no sandboxes of its own (``create`` is refused with a
pointer to ``POST /v1/fncalls``); its pool sandboxes are the container backend's, made
through the node (:class:`~edged.backends.base.SandboxHost`) and labelled
:data:`.pool.LABEL`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from typing import Any

from edged.backends.base import (
    CallFile,
    CallLimits,
    CallRequest,
    CallResponse,
    CallResult,
    EventSink,
    ExecHandle,
    ExecSpec,
    FailureSink,
    LayerForm,
    MemoryUsage,
    NoReclaim,
    Resources,
    SandboxHost,
    SandboxSpec,
)
from edged.backends.fncall.artifacts import Artifacts
from edged.backends.fncall.languages import LANGUAGES, Language, lookup
from edged.backends.fncall.pool import LABEL, Broken, Member, Pool, PoolSpec, host_pidns
from edged.errors import BackendError, BadRequest, NotFound

log = logging.getLogger("edged.fncall")

#: the uid and gid a call runs as inside the pool sandbox (Debian's nobody)
CALL_UID = CALL_GID = 65534
#: the environment of every run, under the request's ``env``
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp/work", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8"}
#: what a runtime writes on stderr when an allocation failed (see the module: verdicts);
#: looked for in the last :data:`OOM_TAIL` bytes of a failed run's stderr
OUT_OF_MEMORY = (b"MemoryError", b"std::bad_alloc", b"java.lang.OutOfMemoryError",
                 b"runtime: out of memory", b"fatal error: out of memory",
                 b"memory allocation of", b"JavaScript heap out of memory",
                 b"Cannot allocate memory", b"cannot allocate memory",
                 b"xmalloc: cannot allocate")
OOM_TAIL = 4096
#: at most this many pools (one per image) at once
MAX_POOLS = 8
MAX_FILES = 1000


class FnCallBackend(NoReclaim):
    """Implements :class:`~edged.backends.base.Backend` (no sandboxes of its own) and
    :class:`~edged.backends.base.CallBackend`.

    ``image`` (``name:tag``) or ``layers`` (digests, bottom first): the default pool's
    image; ``resources``: each pool sandbox's limits (so a call's at most); ``pool_size``,
    ``recycle_after``, ``queue``, ``preload``: see :class:`.pool.PoolSpec`; ``keep_s`` and
    ``keep_bytes``: bounds of the kept compile results (:class:`.artifacts.Artifacts`).
    """

    name = "fncall"
    layer_form: LayerForm = "tree"
    fds_per_sandbox = 0  # no sandboxes of its own (its pools' are the node's)

    def __init__(self, *, image: str | None = None, layers: tuple[str, ...] = (),
                 resources: Resources | None = None, pool_size: int = 4,
                 recycle_after: int = 1000, queue: int = 256, preload: str = "",
                 keep_s: float = 300.0, keep_bytes: int = 256 << 20,
                 qos: str = "latency_sensitive") -> None:
        self.on_event: EventSink | None = None
        self.on_failure: FailureSink | None = None
        self.default_image = image
        self.default_layers = tuple(layers)
        self.resources = resources or Resources(cpus=1.0, memory_bytes=512 << 20,
                                                disk_bytes=256 << 20, pids=128)
        self.pool_size = pool_size
        self.recycle_after = recycle_after
        self.queue = queue
        self.preload = preload
        self.qos = qos
        self.artifacts = Artifacts(max_bytes=keep_bytes, max_ttl_s=keep_s)
        self.host: SandboxHost | None = None
        self.pools: dict[str, Pool] = {}
        self._present: dict[str, set[str]] = {}
        self._pidns = host_pidns()

    # -- CallBackend ----------------------------------------------------------------------

    def attach(self, host: SandboxHost) -> None:
        self.host = host

    def _pool(self, image: str | None) -> Pool:
        if self.host is None:
            raise BackendError("fncall: not attached to a node")
        key = image or "default"
        pool = self.pools.get(key)
        if pool is not None:
            return pool
        if image is None:
            if not (self.default_image or self.default_layers):
                raise BadRequest("fncall: no image configured (fncall_image or "
                                 "fncall_layers) and none named in the call")
            img, layers = self.default_image, self.default_layers
        else:
            img, layers = image, self.host.image_layers(image)  # NotFound if unknown
        if len(self.pools) >= MAX_POOLS:
            raise BadRequest(f"fncall: {MAX_POOLS} pools (images) at most")
        spec = PoolSpec(name=key.replace(":", "_").replace("/", "_")[:63], image=img,
                        layers=layers, resources=self.resources, size=self.pool_size,
                        recycle_after=self.recycle_after, queue=self.queue,
                        preload=self.preload, qos=self.qos)
        pool = Pool(spec, self.host, self._pidns,
                    probe=tuple(sorted({lang.requires for lang in LANGUAGES.values()})))
        self.pools[key] = pool
        pool.fill()
        return pool

    def languages(self) -> dict[str, dict[str, object]]:
        pool = self.pools.get("default")
        present = pool.present if pool is not None else None
        return {lang.name: {"compiled": lang.compiled, "source": lang.source,
                            "available": None if present is None else lang.requires in present}
                for lang in LANGUAGES.values()}

    async def call(self, req: CallRequest) -> CallResponse:
        pool = self._pool(req.pool)
        _check_files(req.files)
        for case in req.cases:
            _check_files(case.files)
        env = {**BASE_ENV, **req.env}
        compile_result: CallResult | None = None
        art_id: str | None = None
        art_ttl: float | None = None
        lang: Language | None = None
        run_files: tuple[CallFile, ...]
        if req.artifact is not None:
            art = self.artifacts.get(req.artifact)
            lang = lookup(art.language)
            run_files = art.files
        elif req.argv is not None:
            run_files = ()
        else:
            if req.language is None or req.source is None:
                raise BadRequest("fncall: give language and source, argv, or artifact")
            lang = lookup(req.language)
            if lang is None:
                raise BadRequest(f"fncall: language {req.language!r} unknown (have "
                                 f"{', '.join(sorted(LANGUAGES))})")
            await pool.ready()
            if pool.present is not None and lang.requires not in pool.present:
                raise BadRequest(f"fncall: language {lang.name}: the image has no "
                                 f"{lang.requires}")
            src = CallFile(lang.source, req.source, 0o644)
            if lang.compile is not None:
                compile_result, outputs = await self._run(
                    pool, argv=lang.compile, script=None, files=(src, *req.files),
                    stdin=None, fetch=lang.outputs, limits=req.compile_limits, env=env)
                if compile_result.status != "Accepted":
                    return CallResponse(compile=compile_result, results=())
                if not outputs:
                    return CallResponse(compile=_internal("the compile step made none of "
                                                          f"{list(lang.outputs)}"), results=())
                run_files = tuple(CallFile(p, d, 0o755) for p, d in sorted(outputs.items()))
            else:
                run_files = (src,)
        if req.keep:
            if lang is None:
                raise BadRequest("fncall: keep needs a language and source")
            if req.artifact is None:
                art = self.artifacts.put(lang.name, run_files, req.keep_s)
            art_id, art_ttl = art.id, self.artifacts.ttl_of(art)
        files = (*run_files, *req.files)
        runs = []
        for case in req.cases:
            if lang is None:
                assert req.argv is not None
                argv, script = (*req.argv, *case.args), None
            elif lang.run is None:
                argv, script = None, lang.source
            else:
                argv, script = (*lang.run, *case.args), None
            runs.append(self._run(pool, argv=argv, script=script, args=case.args,
                                  files=(*files, *case.files), stdin=case.stdin,
                                  fetch=req.fetch, limits=req.limits, env=env))
        # one case (the usual call): no gather, whose task per run costs loop turns
        done = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        return CallResponse(compile=compile_result, results=tuple(r for r, _ in done),
                            artifact=art_id, artifact_ttl_s=art_ttl)

    async def _run(self, pool: Pool, *, argv: tuple[str, ...] | None, script: str | None,
                   files: tuple[CallFile, ...], stdin: bytes | None, fetch: tuple[str, ...],
                   limits: CallLimits, env: dict[str, str], args: tuple[str, ...] = ()
                   ) -> tuple[CallResult, dict[str, bytes]]:
        """One run on one member of ``pool``: its result and the fetched files."""
        m = await pool.acquire()
        replace: str | None = "cancelled"
        try:
            assert self.host is not None
            seq0 = self.host.event_seq()
            head = {"files": [[f.path, len(f.data), f.mode] for f in files],
                    "stdin": None if stdin is None else len(stdin),
                    "argv": list(argv) if argv is not None else None, "script": script,
                    "args": list(args), "env": env, "uid": CALL_UID, "gid": CALL_GID,
                    "wall_s": limits.wall_s, "cpu_s": limits.cpu_s,
                    # a file may not take more than half the sandbox's disk: the rest is
                    # for its outputs and error messages
                    "fsize": min(max(limits.output_bytes + 1, limits.file_bytes),
                                 self.resources.disk_bytes // 2),
                    "as_bytes": limits.memory_bytes, "output": limits.output_bytes,
                    "fetch": list(fetch), "fetch_limit": limits.file_bytes}
            blobs = [f.data for f in files] + ([] if stdin is None else [stdin])
            try:
                rep, out = await m.request(head, blobs, limits.wall_s + 10.0)
            except Broken as exc:
                replace = "broken"
                log.warning("%s", exc)
                return _internal(str(exc)), {}
            replace = None
            if rep.get("error"):
                if rep.get("fatal"):
                    replace = "error"
                return _internal(str(rep["error"])), {}
            if rep.get("leftovers"):
                replace = "leftovers"
            elif rep.get("ipc"):
                replace = "ipc"
            fetched = {}
            names = [n for n, s in rep.get("files", []) if s is not None]
            for n, data in zip(names, out[2:], strict=True):
                fetched[n] = data
            oom = False
            if rep.get("signal") == signal.SIGKILL and not rep.get("timed_out"):
                oom = self._oom_since(m)
            seccomp = "seccomp_denied" in self.host.event_kinds(m.id, seq0)
            res = CallResult(
                status=verdict(rep, limits, oom=oom, seccomp=seccomp, stderr=out[1]),
                exit_code=rep.get("exit_code"), signal=rep.get("signal"),
                cpu_s=float(rep.get("cpu_s") or 0.0), wall_s=float(rep.get("wall_s") or 0.0),
                memory_bytes=int(rep.get("rss_bytes") or 0), stdout=out[0], stderr=out[1],
                stdout_truncated=rep["stdout"][1] > limits.output_bytes,
                stderr_truncated=rep["stderr"][1] > limits.output_bytes,
                files=fetched)
            return res, fetched
        finally:
            pool.release(m, replace)

    @staticmethod
    def _oom_since(m: Member) -> bool:
        """Whether the member's memory cgroup OOM-killed since the last look."""
        counters = getattr(m.backend, "limit_counters", None)
        if counters is None:
            return False
        try:
            n = int(counters(m.id).get("oom_kill", 0))
        except Exception:  # a counter that cannot be read is no verdict
            return False
        seen, m.oom_seen = m.oom_seen, n
        return n > seen

    # -- Backend: no sandboxes of its own --------------------------------------------------

    async def probe(self) -> dict[str, object]:
        return {"backend": self.name, "image": self.default_image,
                "layers": list(self.default_layers), "pool_size": self.pool_size,
                "pools": {k: p.counts() for k, p in self.pools.items()},
                "languages": sorted(LANGUAGES)}

    async def create(self, spec: SandboxSpec) -> None:
        raise BadRequest("backend fncall: it has no sandboxes of its own; calls are "
                         "POST /v1/fncalls (or the SandboxFusion /run_code listener)")

    def _none(self, sandbox_id: str) -> NotFound:
        return NotFound(f"sandbox {sandbox_id!r}: the fncall backend has no sandboxes")

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> ExecHandle:
        raise self._none(sandbox_id)

    async def kill_processes(self, sandbox_id: str) -> int:
        raise self._none(sandbox_id)

    async def pause(self, sandbox_id: str) -> None:
        raise self._none(sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        raise self._none(sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        return None

    async def stats(self, sandbox_id: str) -> dict[str, int]:
        raise self._none(sandbox_id)

    async def memory(self, sandbox_id: str) -> MemoryUsage:
        return MemoryUsage()

    async def put_file(self, sandbox_id: str, path: str, data: AsyncIterator[bytes],
                       mode: int = 0o644, uid: int = 0, gid: int = 0) -> int:
        raise self._none(sandbox_id)

    async def get_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        raise self._none(sandbox_id)

    async def list_existing(self) -> list[str]:
        return []

    async def adopt(self, sandbox_id: str) -> None:
        raise self._none(sandbox_id)

    async def cleanup_leftovers(self, keep: set[str]) -> list[str]:
        return []

    async def warm(self) -> None:
        """Remove pool sandboxes an earlier daemon left (their call servers died with its
        connections), then start the default pool."""
        if self.host is None:
            return
        for sid in self.host.sandboxes(LABEL):
            await self.host.delete_sandbox(sid)
        if self.default_image or self.default_layers:
            self._pool(None)

    async def close(self) -> None:
        """Remove every pool sandbox."""
        pools, self.pools = list(self.pools.values()), {}
        await asyncio.gather(*(p.close() for p in pools), return_exceptions=True)


def verdict(rep: dict[str, Any], limits: CallLimits, *, oom: bool, seccomp: bool,
            stderr: bytes = b"") -> str:
    """The verdict of one run from the call server's answer ``rep`` and its ``stderr`` (see
    the module)."""
    sig = rep.get("signal")
    failed = sig is not None or bool(rep.get("exit_code"))
    out_total = max(int(rep["stdout"][1]), int(rep["stderr"][1]))
    if rep.get("timed_out") or sig == signal.SIGXCPU or float(rep.get("cpu_s") or 0) > \
            limits.cpu_s:
        return "Time Limit Exceeded"
    if oom or (limits.memory_bytes is not None
               and int(rep.get("rss_bytes") or 0) > limits.memory_bytes):
        return "Memory Limit Exceeded"
    if failed and any(w in stderr[-OOM_TAIL:] for w in OUT_OF_MEMORY):
        return "Memory Limit Exceeded"
    if out_total > limits.output_bytes or sig == signal.SIGXFSZ:
        return "Output Limit Exceeded"
    if seccomp and failed:
        return "Dangerous Syscall"
    if sig is not None:
        return "Signalled"
    if rep.get("exit_code"):
        return "Nonzero Exit Status"
    return "Accepted"


def _internal(why: str) -> CallResult:
    return CallResult(status="Internal Error", error=why)


def _check_files(files: tuple[CallFile, ...]) -> None:
    if len(files) > MAX_FILES:
        raise BadRequest(f"fncall: {len(files)} files (max {MAX_FILES})")
    for f in files:
        parts = f.path.split("/")
        if (not f.path or f.path.startswith("/") or "\0" in f.path or ".." in parts
                or len(f.path.encode()) > 1024):
            raise BadRequest(f"fncall: file {f.path[:80]!r}: a relative path inside the "
                             f"working directory, no '..'")
        if not 0 <= f.mode <= 0o777:
            raise BadRequest(f"fncall: file {f.path[:80]!r}: mode {f.mode:o}")

__all__ = ["FnCallBackend", "verdict"]
