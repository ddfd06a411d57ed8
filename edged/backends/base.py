"""The contract between the daemon and a sandbox backend.

The daemon owns state (the sandbox state machine, admission, images, layer mounts); a backend
owns mechanism (namespaces, cgroups, overlay, sbx-init). Backends raise only
:mod:`edged.errors` exceptions (``NotFound``, ``InvalidState``, ``BadRequest``,
``BackendError``...), so the API maps them to responses in one place.

Units: CPU in cores, memory and disk in bytes, times in seconds (float).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

#: Where a backend sends security events: ``sink(sandbox_id, kind, *, pid=, process=,
#: syscall=, path=, address=, detail=)``, the signature of
#: :meth:`edged.security.ledger.Ledger.record` (what the daemon passes).
EventSink = Callable[..., object]

#: Where a backend reports a sandbox that died on its own (its init ended: killed, crashed,
#: out of memory), at once: ``sink(sandbox_id, cause)``; ``cause`` is a JSON object,
#: ``{"what": str, "signal": int, "exit_status": int, "oom_kill": bool, "log": str}`` with
#: the fields that are known. The sandbox stays until it is destroyed.
FailureSink = Callable[[str, Mapping[str, object]], None]

#: What a backend needs of each layer of a sandbox: ``"tree"``, the layer mounted (a
#: read-only directory, e.g. an overlay lower), or ``"image"``, the layer's EROFS image
#: file (e.g. a microVM's read-only disk). The daemon gives it that and nothing else.
LayerForm = Literal["tree", "image"]


@dataclass(frozen=True)
class Resources:
    """Limits of one sandbox.

    ``cpus``: CPU quota in cores (cgroup cfs quota/period; the weight is derived from it).
    ``memory_bytes``: memory limit. ``swap_bytes``: extra swap allowed beyond memory.
    ``pids``: max tasks. ``disk_bytes``: size limit of the writable upper layer.
    ``memory_request_bytes``: what the sandbox is expected to use soon after it starts (its
    request; it may burst to ``memory_bytes``, its limit): the node's admission sets this
    much aside until the sandbox's own use is measured (:mod:`edged.node.admission`).
    """

    cpus: float = 1.0
    memory_bytes: int = 512 << 20
    swap_bytes: int = 0
    pids: int = 1024
    disk_bytes: int = 1 << 30
    memory_request_bytes: int = 32 << 20


QOS_CLASSES = ("best_effort", "latency_sensitive")


@dataclass(frozen=True)
class MemoryUsage:
    """One sandbox's memory as its memory cgroup counts it (bytes; counters cumulative).

    ``resident_bytes``: charged now (anon + page cache + shmem + kernel objects charged);
    ``anon_bytes``, ``file_bytes`` (page cache, shmem excluded), ``shmem_bytes`` (tmpfs: the
    upper and /dev/shm) of it; ``swap_bytes``: pages of it in swap; ``major_faults``: page
    faults that had to read (from swap, or from a layer); ``cpu_usage_ns``: CPU time used.
    """

    resident_bytes: int = 0
    anon_bytes: int = 0
    file_bytes: int = 0
    shmem_bytes: int = 0
    swap_bytes: int = 0
    major_faults: int = 0
    cpu_usage_ns: int = 0


@dataclass(frozen=True)
class SandboxSpec:
    """What a backend needs to create one sandbox.

    ``id``: matches ``[a-z0-9][a-z0-9_.-]{0,62}`` (checked by the daemon).
    ``lowers``: host paths of the layers, BOTTOM FIRST (base, workspace, toolkit), in the
    backend's :data:`LayerForm`: read-only directories (EROFS mountpoints or plain
    directories) or EROFS image files. ``env``: default environment of every exec.
    ``network``: only ``"none"`` for now: an empty netns with loopback up.
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


@dataclass(frozen=True)
class ExecEnd:
    """How an exec ended.

    ``reason``: ``"exited" | "signalled" | "timeout" | "oom" | "output_limit" | "killed"``.
    ``exit_code``: set when reason is ``exited``, None otherwise (enforced here); ``signal``:
    the signal that killed the exec's main process, when one did. ``duration_s``: wall time.
    ``peak_memory_bytes``: when known.
    """

    reason: str
    exit_code: int | None
    signal: int | None
    duration_s: float
    peak_memory_bytes: int | None

    def __post_init__(self) -> None:
        # The contract, whoever reports the end: an exec that did not end by its own exit
        # has no exit code (sbx-init reports the main process's status with an "oom" end
        # when another process of its tree was killed: `sh -c 'dd ...; echo'` said
        # oom with exit_code 0).
        if self.reason != "exited" and self.exit_code is not None:
            object.__setattr__(self, "exit_code", None)


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
    """

    name: str
    layer_form: LayerForm
    on_event: EventSink | None
    #: set by the daemon: told when a sandbox dies on its own (None: nobody listens)
    on_failure: FailureSink | None
    can_reclaim: bool

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


@dataclass(frozen=True)
class UpperDir:
    """A sandbox's writable layer as the host sees it: ``path``, an overlayfs upper
    directory (whiteouts as 0:0 character devices, opaque directories by xattr), owned by
    the host ids ``id_base .. id_base + id_count - 1`` of the sandbox's user namespace."""

    path: str
    id_base: int
    id_count: int


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
        ...
