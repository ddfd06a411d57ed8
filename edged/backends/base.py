"""The contract between the daemon and a sandbox backend.

The daemon owns state (the sandbox state machine, admission, images, layer mounts); a backend
owns mechanism (namespaces, cgroups, overlay, sbx-init). Backends raise only
:mod:`edged.errors` exceptions (``NotFound``, ``InvalidState``, ``BadRequest``,
``BackendError``...), so the API maps them to responses in one place.

Units: CPU in cores, memory and disk in bytes, times in seconds (float).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from edged.datatypes import EventSink as EventSink
from edged.datatypes import ExecEnd as ExecEnd
from edged.datatypes import MemoryUsage as MemoryUsage
from edged.datatypes import Resources as Resources
from edged.errors import BackendError, BadRequest

log = logging.getLogger(__name__)

#: Where a backend reports a sandbox that died on its own (its init ended: killed, crashed,
#: out of memory), at once: ``sink(sandbox_id, cause)``; ``cause`` is a JSON object,
#: ``{"what": str, "signal": int, "exit_status": int, "oom_kill": bool, "log": str,
#: "layers": [digest]}`` with the fields that are known (the daemon reports its own causes
#: the same way, e.g. ``layers``: lost with the layer service). The sandbox stays until it is
#: destroyed.
FailureSink = Callable[[str, Mapping[str, object]], None]


def failure_text(cause: Mapping[str, object]) -> str:
    """A :data:`FailureSink` cause in words, e.g. ``sbx-init ended (signal 9)``,
    ``sbx-init ended (exit status 1, out of memory)``, ``... (status unknown)``."""
    layers = cause.get("layers")
    known = [f"signal {cause['signal']}" if "signal" in cause else "",
             f"exit status {cause['exit_status']}" if "exit_status" in cause else "",
             "out of memory" if cause.get("oom_kill") else "",
             "layers " + ", ".join(map(str, layers)) if isinstance(layers, list) else ""]
    what = cause.get("what", "the sandbox died")
    return f"{what} ({', '.join(k for k in known if k) or 'status unknown'})"


#: What a backend needs of each layer of a sandbox: ``"tree"``, the layer mounted (a
#: read-only directory, e.g. an overlay lower), or ``"image"``, the layer's EROFS image
#: file (e.g. a microVM's read-only disk). The daemon gives it that and nothing else.
LayerForm = Literal["tree", "image"]


QOS_CLASSES = ("best_effort", "latency_sensitive")


#: what a sandbox id matches (the API checks it too, :mod:`edged.node.sandbox`)
SANDBOX_ID_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}\Z")


@dataclass(frozen=True)
class SandboxSpec:
    """What a backend needs to create one sandbox.

    ``id``: matches ``[a-z0-9][a-z0-9_.-]{0,62}`` (checked by the daemon).
    ``lowers``: host paths of the layers, BOTTOM FIRST (base, workspace, toolkit), in the
    backend's :data:`LayerForm`: read-only directories (EROFS mountpoints or plain
    directories) or EROFS image files. ``env``: default environment of every exec.
    ``network``: ``"none"`` (an empty netns with loopback up, made by the spawner) or
    ``"policy"``: then ``netns_fd`` is a network namespace the daemon made (:mod:`edged.net`)
    for the sandbox to join, and the sandbox gets a cgroup v2 directory of its own beneath
    the backend's ``cgroups.bpf_dir()``, where the egress programs are attached.
    ``task_profile``: name of the task profile (``profiles/tasks``) that confines the
    sandbox (protected paths, Landlock, seccomp, capabilities); None runs it unconfined
    (benchmarks and tests only: the daemon always names one). ``seccomp_profile``: overrides
    the task profile's seccomp profile. ``qos``: CPU class, one of :data:`QOS_CLASSES`:
    ``best_effort`` runs at the kernel's idle priority (``SCHED_IDLE`` for the sandbox's
    whole cgroup: it takes only CPU nothing else wants), ``latency_sensitive`` at normal
    weight, each sandbox in its own core-scheduling group where the kernel has core
    scheduling (DSec §6.3).
    """

    id: str
    lowers: tuple[str, ...]
    resources: Resources
    env: Mapping[str, str]
    hostname: str
    network: str = "none"
    task_profile: str | None = "default"
    seccomp_profile: str | None = None
    qos: str = "best_effort"
    netns_fd: int | None = None

    def check(self) -> None:
        """Refuse what no backend can create: an ``id`` that does not match
        :data:`SANDBOX_ID_RE`, no ``lowers``, a ``qos`` not in :data:`QOS_CLASSES`, a
        ``hostname`` that is empty, over 64 bytes or holds a NUL (``HOST_NAME_MAX``,
        include/uapi/linux/utsname.h), a limit of ``resources`` that is not positive (swap:
        negative). Each backend then checks what it alone needs (network, layer forms).
        Raises :class:`edged.errors.BadRequest`."""
        if not SANDBOX_ID_RE.match(self.id):
            raise BadRequest(f"sandbox id {self.id!r} does not match "
                             f"[a-z0-9][a-z0-9_.-]{{0,62}}")
        if not self.lowers:
            raise BadRequest("lowers: at least one layer is needed")
        if self.qos not in QOS_CLASSES:
            raise BadRequest(f"qos {self.qos!r}: not one of {', '.join(QOS_CLASSES)}")
        if not self.hostname or len(self.hostname) > 64 or "\0" in self.hostname:
            raise BadRequest(f"hostname {self.hostname!r} must be 1..64 bytes")
        r = self.resources
        if not (r.cpus > 0 and r.memory_bytes > 0 and r.swap_bytes >= 0 and r.pids > 0
                and r.disk_bytes > 0):
            raise BadRequest(f"resources {r}: every limit must be positive")


@dataclass(frozen=True)
class ExecSpec:
    """One command to run in a sandbox.

    ``env`` is already merged over the sandbox env by the daemon. ``uid``/``gid`` are inside
    the sandbox's user namespace. ``stdin`` False means stdin is /dev/null. ``timeout_s``: wall
    time before the whole process tree is killed. ``output_limit``: total stdout+stderr bytes
    before the tree is killed. ``pty``: run on a pseudo-terminal (stdout carries both streams).
    ``trusted``: a grader exec: the backend first checks that no protected path was changed
    (and refuses to run it if one was); it still runs confined, in a Landlock domain of its
    own that the workload's processes cannot signal or trace.
    ``kill_leftovers``: before it starts, every workload process of the sandbox is killed
    (as :meth:`Backend.kill_processes`), so nothing the agent left running can race it.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    stdin: bool = False
    timeout_s: float | None = None
    output_limit: int | None = None
    pty: bool = False
    trusted: bool = False
    kill_leftovers: bool = False

    def check(self, id_count: int) -> None:
        """Refuse what no backend can run: ``uid``/``gid`` outside the sandbox's
        ``0..id_count-1``, a ``timeout_s`` or ``output_limit`` that is not positive.
        Raises :class:`edged.errors.BadRequest`."""
        if not (0 <= self.uid < id_count and 0 <= self.gid < id_count):
            raise BadRequest(f"uid/gid {self.uid}/{self.gid} outside the sandbox's id range "
                             f"0..{id_count - 1}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise BadRequest(f"timeout_s {self.timeout_s} must be positive")
        if self.output_limit is not None and self.output_limit <= 0:
            raise BadRequest(f"output_limit {self.output_limit} must be positive")


def instance_subdir(name: str, root: Path, default_root: Path) -> str:
    """The cgroup subdirectory of one backend instance: ``name`` for the one whose state
    lives at ``default_root`` (the system daemon), else ``name-<10 hex digits>`` of a sha256
    of ``root``'s resolved path, so that daemons with other state dirs (tests, a second
    instance) never share cgroups."""
    resolved = root.resolve()
    if resolved == default_root:
        return name
    return f"{name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:10]}"



async def remove_leftovers(ids: Iterable[str], metas: Mapping[str, dict[str, object]],
                           teardown: Callable[[str, dict[str, object] | None],
                                              Awaitable[None]]) -> list[str]:
    """Tear down each leftover sandbox of ``ids`` (in sorted order) with
    ``teardown(id, its record or None)``; one that fails (:class:`BackendError`) is logged
    and skipped, the next is tried. Returns the ids removed. The leftovers sweep of the
    container and microVM backends."""
    removed = []
    for sid in sorted(ids):
        try:
            await teardown(sid, metas.get(sid))
        except BackendError as exc:
            log.warning("leftover sandbox %s: %s", sid, exc)
            continue
        removed.append(sid)
    return removed

@contextlib.contextmanager
def readable(fd: int) -> Iterator[asyncio.Future[None]]:
    """A future of the running loop, done once ``fd`` is readable (a pidfd: its process has
    ended, ``pidfd_open(2)``); the loop watches ``fd`` only inside the ``with``. The pidfd
    waits of the container and microVM backends."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, ready)
    try:
        yield fut
    finally:
        loop.remove_reader(fd)
        if not fut.done():
            fut.cancel()


class ExecHandle(Protocol):
    """A running exec. ``exec_id`` is unique within its sandbox; ``ended`` is True once its
    :class:`ExecEnd` has come (whether or not it was consumed yet)."""

    exec_id: int
    ended: bool

    def events(self) -> AsyncIterator[tuple[str, bytes] | ExecEnd]:
        """``("stdout", bytes)`` / ``("stderr", bytes)`` chunks in order, then exactly one
        :class:`ExecEnd`. Backpressure: not consuming stops the process's output (pipe
        fills)."""
        ...

    async def write_stdin(self, data: bytes) -> None:
        """Write to the process's stdin (only if ``ExecSpec.stdin``)."""
        ...

    async def close_stdin(self) -> None:
        """Close the process's stdin (EOF)."""
        ...

    async def signal(self, sig: int) -> None:
        """Send signal number ``sig`` to the exec's process (group)."""
        ...

    async def resize(self, rows: int, cols: int) -> None:
        """Resize the pseudo-terminal (pty execs only)."""
        ...

    def abandon(self) -> None:
        """Its consumer is gone (cancelled, disconnected): kill its whole process tree at
        once, without waiting, and drop the output still to come. Idempotent; a no-op once
        ended."""
        ...


class Backend(Protocol):
    """One kind of sandbox (``name``: ``"container"``, ...). All methods raise
    :mod:`edged.errors` exceptions; ``NotFound`` for an unknown sandbox id.

    ``layer_form``: what it needs of a layer (:data:`LayerForm`). ``on_event``: where it
    sends security events (:data:`EventSink`); set by whoever builds it (the registry,
    :mod:`edged.backends.registry`), None: dropped. ``can_reclaim``: whether
    :meth:`reclaim` pages anything out (the node's reclaim leaves it alone otherwise).
    ``fds_per_sandbox``: the descriptors it holds in the daemon per live sandbox (pidfds,
    control connections), which the node's descriptor budget counts
    (:class:`edged.node.fds.FdBudget`); 0 for none.
    """

    name: str
    layer_form: LayerForm
    on_event: EventSink | None
    #: set by the daemon: told when a sandbox dies on its own (None: nobody listens)
    on_failure: FailureSink | None
    can_reclaim: bool
    fds_per_sandbox: int

    async def probe(self) -> dict[str, object]:
        """Features found on this host (cgroup v1/v2, userns, idmapped mounts...)."""
        ...

    async def create(self, spec: SandboxSpec) -> None:
        """Create and start a sandbox; returns when sbx-init is ready for exec."""
        ...

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> ExecHandle:
        """Start a command in a running sandbox."""
        ...

    async def kill_processes(self, sandbox_id: str) -> int:
        """SIGKILL every workload process of the sandbox (running execs, their daemonized
        descendants, fork bombs), leaving the sandbox itself (its init) running; repeated
        until none is left. Returns the number of processes killed."""
        ...

    async def pause(self, sandbox_id: str) -> None:
        """Freeze every task of the sandbox (cgroup freezer)."""
        ...

    async def resume(self, sandbox_id: str) -> None:
        """Thaw a paused sandbox."""
        ...

    async def destroy(self, sandbox_id: str) -> None:
        """Kill everything, remove mounts, cgroups and the upper dir. Idempotent."""
        ...

    async def stats(self, sandbox_id: str) -> dict[str, int]:
        """Current usage: ``memory_bytes``, ``cpu_usage_ns``, ``pids``."""
        ...

    # -- memory, for the node's density policy (edged.node.reclaim, admission) ----------

    async def memory(self, sandbox_id: str) -> MemoryUsage:
        """The sandbox's memory as the backend counts it (zeros where it cannot tell)."""
        ...

    async def reclaim(self, sandbox_id: str, nbytes: int | None = None) -> int:
        """Page up to ``nbytes`` (None: all it can) of the sandbox's cold memory out to swap;
        returns the bytes its resident memory went down by (0 where it cannot, see
        :attr:`can_reclaim`)."""
        ...

    async def prefetch(self, sandbox_id: str) -> None:
        """Start reading the sandbox's swapped pages back ahead of a resume (nothing where
        it cannot)."""
        ...

    def totals(self) -> MemoryUsage:
        """Every sandbox of this backend together (zeros where it cannot tell)."""
        ...

    def set_memory_limit(self, nbytes: int) -> None:
        """Cap all of this backend's sandboxes together at ``nbytes`` (0: no cap), the
        backstop that keeps the host's share free (nothing where it cannot)."""
        ...

    async def put_file(
        self,
        sandbox_id: str,
        path: str,
        data: AsyncIterator[bytes],
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
    ) -> int:
        """Write ``data`` to ``path`` resolved strictly inside the sandbox root (never
        following a symlink out; ``BadRequest`` if it escapes). Returns bytes written."""
        ...

    async def get_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """Open the file at ``path`` resolved strictly inside the sandbox root
        (``BadRequest`` if it escapes, ``NotFound`` if absent) and return an iterator of its
        chunks (await the call, then ``async for``)."""
        ...

    async def list_existing(self) -> list[str]:
        """Ids of sandboxes found on the host (restart recovery)."""
        ...

    async def adopt(self, sandbox_id: str) -> None:
        """Re-attach to a live sandbox after a daemon restart."""
        ...

    async def cleanup_leftovers(self, keep: set[str]) -> list[str]:
        """Remove half-made or orphaned sandboxes not in ``keep``; returns the ids removed."""
        ...

    async def warm(self) -> None:
        """Start what serves creates ahead of demand (e.g. pooled spawners); called once
        the daemon has recovered. Nothing to do is fine."""
        ...

    async def close(self) -> None:
        """Release what the backend holds for itself (pools, control connections) at
        daemon shutdown; live sandboxes keep running for a later :meth:`adopt`."""
        ...


class NoReclaim:
    """The memory half of :class:`Backend` for a backend that cannot page a sandbox out nor
    cap its sandboxes together (``can_reclaim`` False): :meth:`Backend.reclaim` frees
    nothing, :meth:`Backend.prefetch` and :meth:`Backend.set_memory_limit` do nothing,
    :meth:`Backend.totals` is zeros. A backend inherits it (before its own methods)."""

    can_reclaim = False

    async def reclaim(self, sandbox_id: str, nbytes: int | None = None) -> int:
        return 0

    async def prefetch(self, sandbox_id: str) -> None:
        return None

    def totals(self) -> MemoryUsage:
        return MemoryUsage()

    def set_memory_limit(self, nbytes: int) -> None:
        return None


@dataclass(frozen=True)
class UpperDir:
    """A sandbox's writable layer as the host sees it: ``path``, an overlayfs upper
    directory (whiteouts as 0:0 character devices, opaque directories by xattr), owned by
    the host ids ``id_base .. id_base + id_count - 1`` of the sandbox's user namespace."""

    path: str
    id_base: int
    id_count: int


@runtime_checkable
class NetnsJoiner(Protocol):
    """A backend whose sandboxes can join a network namespace the daemon made
    (:mod:`edged.net`, a create's ``netns_fd``): optional, the daemon asks with
    ``isinstance`` and gives the node's network to the first that is one (``name``: the
    backend's, :attr:`Backend.name`)."""

    name: str

    def egress_cgroup_dir(self) -> Path | None:
        """The cgroup v2 directory that every sandbox cgroup of the backend's is beneath
        (made if missing), where the node's egress BPF programs attach; None on a host
        without a v2 hierarchy (the network then refuses networked sandboxes)."""
        ...

    def init_pid(self, sandbox_id: str) -> int:
        """The host pid of the sandbox's PID 1, whose namespaces a helper of the network
        enters (the DNS resolver's and proxy's per-sandbox listeners). NotFound."""
        ...


@runtime_checkable
class SnapshotSource(Protocol):
    """A backend whose sandboxes' disk changes can become a layer (``POST
    /v1/sandboxes/{id}/snapshot``): optional, the daemon asks with ``isinstance``."""

    def upper_dir(self, sandbox_id: str) -> UpperDir:
        """Where the sandbox's upper directory is now. Raises NotFound, InvalidState (the
        sandbox has no upper the host can read)."""
        ...


@dataclass(frozen=True)
class FileInfo:
    """One entry of a sandbox's filesystem. ``type``: ``"file"`` (anything not a directory
    or symlink), ``"dir"`` or ``"symlink"`` (the link itself; ``symlink_target`` its text);
    ``path``: absolute in the sandbox; ``mode``: permission bits; ``permissions``: as
    ``ls -l`` shows them; ``owner``/``group``: names from the sandbox's passwd/group (the
    number if none); ``mtime``: seconds since the epoch."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    mtime: float
    symlink_target: str | None = None


@runtime_checkable
class FileOps(Protocol):
    """A backend that lists, stats, makes, removes and renames paths in its sandboxes
    (``/v1/sandboxes/{id}/fs/...``): optional, the daemon asks with ``isinstance``. Paths
    resolve strictly inside the sandbox root, as :meth:`Backend.put_file`'s do."""

    async def list_dir(self, sandbox_id: str, path: str, depth: int = 1) -> list[FileInfo]:
        """Entries below the directory ``path`` down to ``depth`` levels. NotFound,
        BadRequest (not a directory, escapes)."""
        ...

    async def stat_path(self, sandbox_id: str, path: str) -> FileInfo:
        """The entry at ``path`` (a symlink as itself). NotFound, BadRequest."""
        ...

    async def make_dir(self, sandbox_id: str, path: str, *, parents: bool = True,
                       uid: int = 0, gid: int = 0) -> bool:
        """Make a directory (owned by the sandbox's ``uid``/``gid``); False if it already
        was one. Conflict (a file in the way), NotFound, BadRequest."""
        ...

    async def remove_path(self, sandbox_id: str, path: str) -> None:
        """Remove a file, symlink or whole directory. NotFound, BadRequest."""
        ...

    async def rename_path(self, sandbox_id: str, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``. NotFound, BadRequest."""
# -- stateless calls (the FnCall backend) -------------------------------------------------------

#: Verdicts of a call, as go-judge names them (``Status`` of its API): the first that applies,
#: in this order. ``Internal Error``: the node failed, not the program.
VERDICTS = ("Accepted", "Memory Limit Exceeded", "Time Limit Exceeded",
            "Output Limit Exceeded", "File Error", "Nonzero Exit Status", "Signalled",
            "Dangerous Syscall", "Internal Error")


@dataclass(frozen=True)
class CallFile:
    """A file a call gets in its working directory: ``path`` relative to it (no ``..``
    out), its bytes, its mode."""

    path: str
    data: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class CallLimits:
    """Limits of one run (a compile step is a run too). ``cpu_s``: CPU seconds (user +
    system; RLIMIT_CPU is whole seconds, the verdict compares the exact figure); ``wall_s``:
    wall seconds before its main process is killed; ``memory_bytes``: what the run may use
    (None: the pool sandbox's limit); ``output_bytes``: per stream (stdout, stderr), beyond
    it the stream is cut and the verdict is Output Limit Exceeded; ``file_bytes``: the
    largest file it may write (RLIMIT_FSIZE; at most half the pool sandbox's disk)."""

    cpu_s: float = 10.0
    wall_s: float = 20.0
    memory_bytes: int | None = None
    output_bytes: int = 1 << 20
    file_bytes: int = 64 << 20


@dataclass(frozen=True)
class CallCase:
    """One test case of a run: its stdin, extra arguments, extra files."""

    stdin: bytes | None = None
    args: tuple[str, ...] = ()
    files: tuple[CallFile, ...] = ()


@dataclass(frozen=True)
class CallRequest:
    """One stateless call: ``language`` + ``source`` (compiled first where the language has
    a compile step), or ``argv`` (a program of the image, e.g. ``("/bin/true",)``), or
    ``artifact`` (the id of a kept compile result). Run once per case of ``cases`` (one
    empty case when none is given), each with its own verdict. ``files``: given to the
    compile and to every run; ``fetch``: paths read back after each run (``files`` of its
    result). ``keep``: keep the compile result (its id in the response) for
    ``keep_s`` seconds. ``pool``: the image (``name:tag``) whose pool runs it (None: the
    default pool)."""

    language: str | None = None
    source: bytes | None = None
    argv: tuple[str, ...] | None = None
    artifact: str | None = None
    cases: tuple[CallCase, ...] = (CallCase(),)
    files: tuple[CallFile, ...] = ()
    fetch: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    limits: CallLimits = CallLimits()
    compile_limits: CallLimits = CallLimits(cpu_s=30.0, wall_s=60.0, memory_bytes=None,
                                            output_bytes=1 << 20, file_bytes=256 << 20)
    keep: bool = False
    keep_s: float | None = None
    pool: str | None = None


@dataclass(frozen=True)
class CallResult:
    """How one run ended. ``status``: one of :data:`VERDICTS`; ``exit_code`` when it
    exited, ``signal`` when a signal ended it; ``cpu_s`` (user + system), ``wall_s``,
    ``memory_bytes`` (peak resident set of its largest process, ``wait4``'s ru_maxrss);
    ``stdout``/``stderr`` cut at the output limit (``*_truncated``); ``files``: the fetched
    files that exist, by the path asked for; ``error``: why, for Internal Error."""

    status: str
    exit_code: int | None = None
    signal: int | None = None
    cpu_s: float = 0.0
    wall_s: float = 0.0
    memory_bytes: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    files: Mapping[str, bytes] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class CallResponse:
    """A call's outcome: its compile step's result (None: no compile step), the kept
    compile result's id and seconds to live (None: not kept), one result per case (none
    when the compile failed)."""

    compile: CallResult | None
    results: tuple[CallResult, ...]
    artifact: str | None = None
    artifact_ttl_s: float | None = None


class SandboxHost(Protocol):
    """What the node gives a backend whose sandboxes are another backend's (FnCall's pool
    of container sandboxes): sandboxes made and removed through the node (admission,
    layers, records, events), and the backend each runs on."""

    async def create_sandbox(self, *, backend: str, layers: tuple[str, ...], image: str | None,
                             resources: Resources, task_profile: str, qos: str,
                             labels: Mapping[str, str]) -> str:
        """Create a sandbox (TTL and idle timeout none); returns its id once it runs."""
        ...

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """Remove a sandbox (NotFound-tolerant)."""
        ...

    def sandboxes(self, label: str) -> list[str]:
        """Ids of the sandboxes carrying the label ``label`` (whatever its value)."""
        ...

    def backend_of(self, sandbox_id: str) -> Backend:
        """The backend a sandbox runs on."""
        ...

    def image_layers(self, ref: str) -> tuple[str, ...]:
        """The layers of a registered image (NotFound)."""
        ...

    def event_seq(self) -> int:
        """The newest security event's number (0: none, or no ledger)."""
        ...

    def event_kinds(self, sandbox_id: str, since: int) -> list[str]:
        """Kinds of the sandbox's security events newer than ``since``."""
        ...


@runtime_checkable
class CallBackend(Protocol):
    """A backend that runs stateless calls (FnCall): given the node at start-up
    (:meth:`attach`), it answers :meth:`call` from sandboxes it makes through it."""

    def attach(self, host: SandboxHost) -> None:
        """Where its sandboxes come from (before :meth:`Backend.warm`)."""
        ...

    async def call(self, req: CallRequest) -> CallResponse:
        """Run ``req``. Raises BadRequest (unknown language, bad input), NotFound (an
        artifact or image that is not there), CapacityExhausted (its queue is full, with
        ``retry_after``), BackendError."""
        ...

    def languages(self) -> dict[str, dict[str, object]]:
        """The languages it offers: name -> {"compiled": bool, "source": file name}."""
        ...
