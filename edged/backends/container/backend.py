"""The container backend: sandboxes made by ``edged-spawner`` and run by ``sbx-init``.

Per sandbox, on the host:
- ``<state_dir>/sandboxes/<id>/`` (0700): ``meta.json`` (pid, start time, id range),
  ``ctl.sock`` (sbx-init's control socket; host-only path), ``init.log`` (sbx-init's
  stderr), ``root/`` (an empty mount point: the rootfs is mounted on it only inside the
  sandbox's own mount namespace, so the host's mount table never changes);
- cgroups beneath the daemon's own (see :mod:`edged.cgroups`);
- nothing else: the overlay, its size-limited tmpfs upper and /dev, /proc, /sys all live in
  the sandbox's mount namespace and vanish with its last process.

Creating a sandbox never forks the daemon: ``os.posix_spawn`` (glibc: clone with CLONE_VM |
CLONE_VFORK) runs the spawner, which reports ``ok PID`` on a pipe once sbx-init runs. To keep
process start-up and namespace creation off a create's critical path, the backend holds a
small pool of spawners started ahead of demand (``--pool``: each has already cloned its child
into new namespaces with the uid range of a reserved slot and, on cgroup v1, moved both into
cgroups made for it, which the create renames to the sandbox's; it waits for the sandbox's
options on its stdin); a create takes a ready one, or spawns directly when none is, and the
pool is refilled in the background. A
sandbox outlives the daemon (sbx-init is re-parented to the host's init); a restarted daemon
finds it in the state dir (:meth:`ContainerBackend.list_existing`) and reconnects
(:meth:`ContainerBackend.adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import edged
from edged.backends import memadvise, records
from edged.backends.base import (
    EventSink,
    ExecSpec,
    FailureSink,
    FileInfo,
    LayerForm,
    MemoryUsage,
    Resources,
    SandboxSpec,
    UpperDir,
    failure_text,
    instance_subdir,
    readable,
    remove_leftovers,
)
from edged.backends.container import confinement, fileops, files, scratch
from edged.backends.uidslots import DEFAULT_DIR as UID_SLOTS_DIR
from edged.backends.uidslots import UidSlots
from edged.backends.uidslots import starttime as _starttime
from edged.cgroups import POOL_PREFIX, SandboxCgroup
from edged.cgroups import probe as probe_cgroups
from edged.errors import BackendError, BadRequest, Conflict, InvalidState, NotFound
from edged.sbxinit import SbxClient, SbxExec, connect_unix
from edged.security import apparmor, audit, landlock
from layerfs.fsutil import write_all
from layerfs.mount import erofs_file_backed

log = logging.getLogger("edged.container")
_T = TypeVar("_T")

BIN_DIR = Path(edged.__file__).resolve().parent / "_bin"
# sbx-init's first answer: a best-effort sandbox starts as SCHED_IDLE, so on a node whose
# CPUs are busy with normal work its start-up gets only what that work leaves
CONNECT_TIMEOUT_S = 30.0
# A SIGKILLed sandbox's tasks still need CPU to exit (and its PID 1 waits for them all): a
# best-effort one's, SCHED_IDLE beside busy normal tasks, took more than the 5 s once waited
# (then the delete failed). They get CPU first (SandboxCgroup.unthrottle); the wait is
# bounded, logged every EXIT_PROGRESS_S, a BackendError after EXIT_TIMEOUT_S (the record
# stays failed and a later delete retries).
EXIT_TIMEOUT_S = 60.0
EXIT_PROGRESS_S = 5.0
EXIT_LEAVE_IDLE_S = 1.0  # then out of the idle class too (see SandboxCgroup.unthrottle)
_NETNS_FD = 4  # where a networked sandbox's namespace fd is handed to the spawner


def _spawner_env() -> dict[str, str]:
    """The spawner's environment: empty, but ``EDGED_SPAWNER_STAGED`` passed on (``1``: the
    rootfs made the way kernels before 6.15 need, on any kernel; for its tests)."""
    v = os.environ.get("EDGED_SPAWNER_STAGED")
    return {} if v is None else {"EDGED_SPAWNER_STAGED": v}


@dataclass
class _Pooled:
    """A spawner started ahead of demand (``edged-spawner --pool``), holding uid slot
    ``slot``: it has made its child's namespaces and waits for options on ``stdin``."""

    pid: int
    slot: int
    stdin: int
    status: int
    ready: asyncio.Future[None]
    cg: SandboxCgroup | None = None  # its cgroups (``.pool-<slot>``), v1 only
    qos: str = SandboxSpec.qos  # the CPU class its cgroups were made for


@dataclass
class _Sandbox:
    id: str
    dir: Path
    pid: int
    pidfd: int
    uid_base: int
    slot: int
    cg: SandboxCgroup
    conn: SbxClient | None = None
    paused: bool = False
    policy: confinement.Policy | None = None
    limits: confinement.LimitWatch | None = None
    starttime: int | None = None  # sbx-init's, with pid naming it across pid reuse
    #: why its sbx-init ended, once it has (see ContainerBackend.on_failure)
    dead: dict[str, object] | None = None
    watched: asyncio.AbstractEventLoop | None = None  # whose loop watches its pidfd


class ContainerBackend:
    """Container sandboxes (implements :class:`edged.backends.base.Backend`).

    ``state_dir``: host directory for per-sandbox state (default ``/run/edged``; a
    non-default one also gets its own cgroup subtree, so several instances can coexist).
    ``uid_base``/``id_count``: sandbox slot ``n`` maps its ids 0..id_count-1 to host ids
    ``uid_base + n*id_count ...``; sandbox root is never host root. Slots are claimed
    host-wide in ``uid_slots_dir`` (see :mod:`edged.backends.uidslots`), so that daemons
    sharing the host never map the same host ids.
    ``bin_dir``: where ``edged-spawner`` and ``sbx-init`` are (default: ``edged/_bin``).
    ``scratch_dir``: a host directory (e.g. an XFS filesystem of the node's scratch storage)
    in which each sandbox's overlay upper lives (``<scratch_dir>/<id>/``), size-limited by
    that filesystem (per sandbox ``resources.disk_bytes`` where it is XFS with project quotas,
    see :mod:`.scratch`); default: a tmpfs of ``resources.disk_bytes`` per sandbox.
    ``on_event``: where security events go (see :mod:`.confinement`), e.g. a ledger's
    ``record``. ``on_failure``: told at once when a sandbox's sbx-init ends on its own
    (killed, crashed, out of memory), with what is known of why (see
    :data:`edged.backends.base.FailureSink`); its execs then fail with InvalidState, and
    :meth:`destroy` still removes everything. ``spawner_pool``: how many spawners to keep
    started ahead of demand (0: spawn one per create; each pooled one is two waiting
    processes and holds a uid range; call :meth:`close` to end them). ``swap_share``: on
    cgroup v2, the swap each sandbox may hold as a share of its memory limit (see
    :func:`edged.cgroups.swap_allowance`). ``spare_idle_s``: sbx-init forks each exec's child
    ahead of it (the spare: off the exec's latency) and drops it once no exec has started or
    ended for this long (seconds; 0, the default: kept for good; the daemon's config
    ``spare_idle_s`` says 10), since it is host kernel memory that no limit holds (its task,
    kernel stack, page tables and exec cgroup); the exec after forks its own child (~1 ms
    more) and the spare comes back at that exec's end. Raises
    :class:`edged.errors` exceptions only.
    """

    name = "container"
    layer_form: LayerForm = "tree"  # overlay lowers: the layers mounted
    can_reclaim = True
    #: descriptors the daemon holds per sandbox for its life: a pidfd, sbx-init's control
    #: socket (see :class:`edged.node.fds.FdBudget`)
    fds_per_sandbox = 2

    def __init__(self, state_dir: str | os.PathLike[str] = "/run/edged", *,
                 uid_base: int = 1 << 30, id_count: int = 65536,
                 bin_dir: str | os.PathLike[str] | None = None,
                 scratch_dir: str | os.PathLike[str] | None = None,
                 on_event: EventSink | None = None,
                 spawner_pool: int = 0,
                 uid_slots_dir: str | os.PathLike[str] = UID_SLOTS_DIR,
                 swap_share: float = 1.0, spare_idle_s: float = 0.0) -> None:
        if not 0 <= spare_idle_s <= 365 * 86400:
            raise BadRequest(f"spare_idle_s: {spare_idle_s} is not 0..{365 * 86400} seconds")
        self.spare_idle_ms = round(spare_idle_s * 1000)
        self.state_dir = Path(state_dir)
        self.scratch_dir = Path(scratch_dir) if scratch_dir is not None else None
        self.on_event = on_event
        self.on_failure: FailureSink | None = None
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.uid_base = uid_base
        self.id_count = id_count
        self.uid_slots = UidSlots(self.state_dir, uid_base=uid_base, id_count=id_count,
                                  directory=uid_slots_dir)
        self.max_slots = self.uid_slots.max_slots
        self.bin_dir = Path(bin_dir) if bin_dir else BIN_DIR
        self.cgroups = probe_cgroups(
            subdir=instance_subdir("edged", self.state_dir, Path("/run/edged")),
            swap_share=swap_share)
        self._sandboxes: dict[str, _Sandbox] = {}
        self._busy: set[str] = set()
        self._slots: set[int] = set()
        self._slots_loaded = False
        self.spawner_pool = max(0, spawner_pool)
        self._pool: list[_Pooled] = []
        #: the CPU class new pooled spawners' cgroups are made for: the last create's (a
        #: claim of another class moves the tasks between cpu cgroups, and a move waits for
        #: an RCU grace period: after an idle spell, milliseconds on the create)
        self._pool_qos = SandboxSpec.qos
        # pid -> (pidfd, what to do once it is reaped) of spawners being reaped
        self._reaping: dict[int, tuple[int, Callable[[], None] | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # of the pool's readers
        self._closed = False
        #: AppArmor denials of our sandboxes' profiles, from the kernel's audit messages
        #: (started with the first sandbox that has a profile)
        self._audit: audit.AuditReader | None = None

    # ---- helpers ------------------------------------------------------

    def _watch_apparmor(self) -> None:
        """Start reading AppArmor denials (once, in the running loop), where the kernel has
        AppArmor."""
        if self._audit is None and apparmor.probe()["kernel"]:
            self._audit = audit.AuditReader(self._on_apparmor_denial)
            if not self._audit.start():
                self._audit = None

    def _stop_watching_apparmor(self) -> None:
        """Close the audit socket (once no sandbox is left: the next one with a profile
        opens it again)."""
        if self._audit is not None:
            self._audit.close()
            self._audit = None

    def _on_apparmor_denial(self, d: audit.AppArmorDenial) -> None:
        """An ``apparmor_denied`` event for the sandbox whose profile was denied (denials of
        other profiles, and of sandboxes another backend runs, are not ours)."""
        sid = apparmor.sandbox_of(d.profile)
        if sid is None or sid not in self._sandboxes or self.on_event is None:
            return
        self.on_event(sid, "apparmor_denied", pid=d.pid, process=d.comm, path=d.name,
                      detail=d.detail())

    def _get(self, sandbox_id: str) -> _Sandbox:
        sbx = self._sandboxes.get(sandbox_id)
        if sbx is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        return sbx

    def _alloc_slot(self, sandbox: str | None = None) -> int:
        """A uid slot claimed host-wide for ``sandbox`` (None: a pooled spawner)."""
        if not self._slots_loaded:  # ranges held by sandboxes of an earlier daemon
            for meta in self._metas().values():
                self._slots.add(int(meta.get("slot", -1)))
            self._slots_loaded = True
        slot = self.uid_slots.claim(self._slots, sandbox)
        self._slots.add(slot)
        return slot

    def _free_slot(self, slot: int) -> None:
        self._slots.discard(slot)
        try:
            self.uid_slots.release(slot)
        except OSError as exc:  # the claim goes stale with us; another daemon takes it over
            log.warning("uid slot %d: cannot release its claim: %s", slot, exc)

    def _meta(self, sandbox_id: str) -> dict[str, Any] | None:
        return records.read(self.sandboxes_dir, sandbox_id)

    def _metas(self) -> dict[str, dict[str, Any]]:
        return records.read_all(self.sandboxes_dir)

    _write_meta = staticmethod(records.write)
    _alive = staticmethod(records.alive)

    async def _spawn(self, argv: list[str], pooled: _Pooled | None = None, *,
                     netns_fd: int | None = None) -> int:
        """Run the spawner with ``argv`` (or hand ``argv`` to a pooled one); returns sbx-init's
        host pid. The spawner is reaped in the background: after reporting it still closes
        mount fds, which can wait for an RCU grace period."""
        if pooled is None:
            spawner = str(self.bin_dir / "edged-spawner")
            r, w = os.pipe()
            try:
                actions = [(os.POSIX_SPAWN_DUP2, w, 3)]
                if netns_fd is not None:
                    actions.append((os.POSIX_SPAWN_DUP2, netns_fd, _NETNS_FD))
                pid = os.posix_spawn(spawner, argv, _spawner_env(), file_actions=actions)
            except OSError as exc:
                os.close(r)
                raise BackendError(f"posix_spawn {spawner}: {exc.strerror}") from exc
            finally:
                os.close(w)
        else:
            pid, r = pooled.pid, pooled.status
            try:
                write_all(pooled.stdin, b"".join(a.encode() + b"\0" for a in argv[1:]))
            except OSError as exc:
                os.close(r)
                self._reap(pid)  # its cgroups are the sandbox's now: the teardown's
                raise BackendError(f"pooled spawner {pid}: {exc.strerror}") from exc
            finally:
                os.close(pooled.stdin)
        try:
            out = await _read_line(r)
        finally:
            os.close(r)
            self._reap(pid)
        line = out.decode("utf-8", "replace").strip()
        if line.startswith("ok "):
            return int(line.split()[1])
        _, _, rest = line.partition(" ")
        code, _, msg = rest.partition(" ")
        raise BackendError(f"spawner: {msg or line or 'no status'} (errno {code or '?'})")

    def _reap(self, pid: int, then: Callable[[], None] | None = None) -> None:
        """Collect the exit of spawner ``pid`` without blocking, then call ``then`` (see
        :meth:`close`)."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if then is not None:
                then()
            return
        self._reaping[pid] = (pidfd, then)
        loop = asyncio.get_running_loop()

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self._reaping.pop(pid, None)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            if then is not None:
                then()

        loop.add_reader(pidfd, on_exit)

    def _adopt_loop(self) -> None:
        """Bind the pool's readers to the running loop. Used from another loop (e.g. one
        ``asyncio.run`` after another), pooled spawners are dropped and pending reaps
        re-registered."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._loop = loop
        stale, self._pool = self._pool, []
        for pid, (pidfd, then) in list(self._reaping.items()):
            self._reaping.pop(pid)
            os.close(pidfd)
            self._reap(pid, then)
        for p in stale:
            self._drop_pooled(p)
        for sbx in self._sandboxes.values():
            self._watch(sbx)

    def _watch(self, sbx: _Sandbox) -> None:
        """Learn at once when the sandbox's sbx-init ends (its pidfd becomes readable)."""
        loop = asyncio.get_running_loop()
        if sbx.dead is not None or sbx.watched is loop:
            return
        self._unwatch(sbx)
        loop.add_reader(sbx.pidfd, self._init_ended, sbx)
        sbx.watched = loop

    @staticmethod
    def _unwatch(sbx: _Sandbox) -> None:
        if sbx.watched is not None and not sbx.watched.is_closed():
            sbx.watched.remove_reader(sbx.pidfd)
        sbx.watched = None

    def _init_ended(self, sbx: _Sandbox) -> None:
        """sbx-init is gone, and with it every process of the sandbox (PID 1 of its pid
        namespace): the sandbox has failed. A destroy in progress is not a failure."""
        self._unwatch(sbx)
        if self._sandboxes.get(sbx.id) is not sbx or sbx.id in self._busy:
            return
        sbx.dead = _death_cause(sbx)
        # one line per failure: the daemon (on_failure) logs it with the sandbox's record
        log.log(logging.DEBUG if self.on_failure is not None else logging.WARNING,
                "sandbox %s has failed: %s", sbx.id, failure_text(sbx.dead))
        if self.on_failure is not None:
            try:
                self.on_failure(sbx.id, dict(sbx.dead))
            except Exception:
                log.exception("sandbox %s: failure report", sbx.id)

    def _take_pooled(self, qos: str) -> _Pooled | None:
        """A ready pooled spawner (removed from the pool), one whose cgroups were made for
        CPU class ``qos`` if there is one, or None."""
        self._adopt_loop()
        ready = [p for p in self._pool if p.ready.done() and p.ready.exception() is None]
        if not ready:
            return None
        p = next((p for p in ready if p.qos == qos), ready[0])
        self._pool.remove(p)
        return p

    def _fill_pool(self) -> None:
        """Start pooled spawners up to ``spawner_pool`` (they get ready in the background).
        A failure is logged and leaves the pool short until the next create."""
        loop = asyncio.get_running_loop()
        while not self._closed and len(self._pool) < self.spawner_pool:
            try:
                slot = self._alloc_slot()
            except BackendError as exc:
                log.warning("spawner pool: %s", exc)
                return
            uid_base = self.uid_base + slot * self.id_count
            try:
                qos = self._pool_qos
                cg = self.cgroups.create_pooled(str(slot), uid_base, qos=qos)
            except BackendError as exc:
                self._free_slot(slot)
                log.warning("spawner pool: %s", exc)
                return
            spawner = str(self.bin_dir / "edged-spawner")
            argv = ["edged-spawner", "--pool", "1", "--status-fd", "3", "--uid-base",
                    str(uid_base), "--id-count", str(self.id_count)]
            for j in cg.join if cg is not None else ():
                argv += ["--join", str(j)]
            r_in, w_in = os.pipe2(os.O_CLOEXEC)
            r_st, w_st = os.pipe2(os.O_CLOEXEC)
            try:
                pid = os.posix_spawn(
                    spawner, argv, _spawner_env(),
                    file_actions=[(os.POSIX_SPAWN_DUP2, r_in, 0), (os.POSIX_SPAWN_DUP2, w_st, 3)])
            except OSError as exc:
                for fd in (r_in, w_in, r_st):
                    os.close(fd)
                self._free_slot(slot)
                if cg is not None:
                    with contextlib.suppress(BackendError):
                        cg.remove()
                log.warning("spawner pool: posix_spawn %s: %s", spawner, exc.strerror)
                return
            finally:
                os.close(w_st)
            os.close(r_in)
            p = _Pooled(pid, slot, w_in, r_st, loop.create_future(), cg, qos)
            self._pool.append(p)
            loop.add_reader(r_st, self._pool_status, p)

    def _pool_status(self, p: _Pooled) -> None:
        """The pooled spawner ``p`` wrote its "ready" line, an error, or died."""
        asyncio.get_running_loop().remove_reader(p.status)
        try:
            line = os.read(p.status, 4096)  # "ok" comes only after options are sent
        except OSError as exc:
            line = str(exc).encode()
        if line == b"ready\n":
            p.ready.set_result(None)
            return
        if p in self._pool:
            self._pool.remove(p)
        self._drop_pooled(p)
        log.warning("spawner pool: spawner failed: %s",
                    line.decode("utf-8", "replace").strip() or "no status")

    def _drop_pooled(self, p: _Pooled) -> None:
        """Close a pooled spawner (EOF on its stdin: it kills its child and exits)."""
        for fd in (p.stdin, p.status):
            with contextlib.suppress(OSError):
                os.close(fd)
        if not p.ready.done():
            p.ready.cancel()
        self._free_slot(p.slot)
        cg = p.cg
        # its child dies before it exits: the cgroups are empty then
        self._reap(p.pid, None if cg is None else functools.partial(_remove_quietly, cg))

    async def _connect(self, sbx: _Sandbox) -> None:
        conn = await connect_unix(sbx.dir / "ctl.sock", sbx.id, sink=self.on_event,
                                  on_end=functools.partial(self._poll_limits, sbx),
                                  timeout_s=CONNECT_TIMEOUT_S)
        assert conn.info is not None
        log.debug("sandbox %s: sbx-init cgroup mode %s", sbx.id, conn.info.cgroup_mode)
        sbx.conn = conn

    def _poll_limits(self, sbx: _Sandbox) -> None:
        if sbx.limits is None:
            return
        try:
            upper = confinement.scratch_path(sbx.pid)
            sbx.limits.poll(self.on_event, sbx.id,
                            os.path.join(upper, "upper") if upper else None)
        except Exception as exc:  # a monitoring failure must not break the exec stream
            log.warning("sandbox %s: limit counters: %s", sbx.id, exc)

    async def _wait_exit(self, sandbox_id: str, pidfd: int,
                         cg: SandboxCgroup | None = None) -> None:
        """Wait until the SIGKILLed sbx-init behind ``pidfd`` has exited, re-killing and
        unthrottling what its cgroups hold meanwhile; a warning every EXIT_PROGRESS_S.
        Raises BackendError after EXIT_TIMEOUT_S."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        progress = start + EXIT_PROGRESS_S
        with readable(pidfd) as ended:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(ended), 0.25)
                    if loop.time() > start + EXIT_PROGRESS_S:
                        log.info("sandbox %s: sbx-init exited %.1f s after SIGKILL",
                                 sandbox_id, loop.time() - start)
                    return
                except TimeoutError as exc:
                    now = loop.time()
                    if now > progress or now > start + EXIT_TIMEOUT_S:
                        left = [] if cg is None else await asyncio.to_thread(cg.procs)
                        why = await asyncio.to_thread(_left_text, left)
                        if now > start + EXIT_TIMEOUT_S:
                            raise BackendError(
                                f"sbx-init did not exit {EXIT_TIMEOUT_S:.0f} s after SIGKILL "
                                f"({why}; a later delete finishes the removal once they "
                                f"are gone)") from exc
                        progress = now + EXIT_PROGRESS_S
                        log.warning("sandbox %s: sbx-init not gone %.0f s after SIGKILL "
                                    "(%s)", sandbox_id, now - start, why)
                # A dying PID 1 waits for every task of its namespace; one that sbx-init
                # froze (killing an exec's tree) just before its own SIGKILL stays frozen
                # until thawed; one forked since the last pass is still throttled.
                if cg is not None:
                    await asyncio.to_thread(_unthrottle_and_kill, cg,
                                            loop.time() > start + EXIT_LEAVE_IDLE_S)

    async def _teardown(self, sandbox_id: str, meta: dict[str, Any] | None) -> None:
        """Kill and remove everything of a sandbox, whatever state it is in."""
        d = self.sandboxes_dir / sandbox_id
        cg = self.cgroups.path_of(sandbox_id)
        pidfd = -1
        if meta and self._alive(meta):
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(int(meta["pid"]))
        try:
            # CPU for the dying first (see SandboxCgroup.unthrottle), then thaw and kill the
            # tasks: a frozen PID 1 cannot die on v1
            await asyncio.to_thread(_unthrottle_and_kill, cg)
            if pidfd >= 0:
                # PID 1 dying takes its whole pid namespace with it
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                await self._wait_exit(sandbox_id, pidfd, cg)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        await asyncio.to_thread(cg.remove)
        await asyncio.to_thread(confinement.release, sandbox_id)
        if self.scratch_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self.scratch_dir / sandbox_id, True)
        if meta and meta.get("quota"):
            try:
                await asyncio.to_thread(scratch.unlimit, str(meta["quota"][0]),
                                        int(meta["quota"][1]))
            except BackendError as exc:
                log.warning("sandbox %s: %s", sandbox_id, exc)
        shutil.rmtree(d, ignore_errors=True)
        if meta and "slot" in meta:
            self._free_slot(int(meta["slot"]))

    # ---- Backend ------------------------------------------------------

    async def probe(self) -> dict[str, object]:
        """Features: cgroup version and parents, user namespaces, kernel version (overlay
        layers by fd need Linux >= 6.13; id-mapped mounts >= 5.12), binaries present."""
        rel = os.uname().release
        m = re.match(r"(\d+)\.(\d+)", rel)
        ver = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        try:
            max_userns = int(Path("/proc/sys/user/max_user_namespaces").read_text())
        except OSError:
            max_userns = 0
        return {
            "backend": self.name,
            "kernel": rel,
            **self.cgroups.features(),
            "user_namespaces": max_userns > 0,
            "idmapped_mounts": ver >= (5, 12),
            "overlay_layers_by_fd": ver >= (6, 13),
            "spawner": (self.bin_dir / "edged-spawner").exists(),
            "sbx_init": (self.bin_dir / "sbx-init").exists(),
            "tree_kill": self.cgroups.tree_kill,
            "landlock_abi": landlock.abi(),
            "landlock": landlock.features(),
            "seccomp_notify": True,
            "apparmor": apparmor.probe(),
            # EROFS layers mounted from their image files, or else through loop devices
            # (kernels before 6.12: layerfs.mount)
            "erofs_file_backed": erofs_file_backed(),
        }

    async def create(self, spec: SandboxSpec) -> None:
        """Make and start the sandbox; returns once sbx-init has answered a hello. Raises
        BadRequest (spec), Conflict (id in use), BackendError (spawn, mount, cgroup: the
        half-made sandbox is removed first)."""
        _check_spec(spec)
        sid = spec.id
        d = self.sandboxes_dir / sid
        if sid in self._sandboxes or sid in self._busy or d.exists():
            raise Conflict(f"sandbox {sid!r} already exists")
        self._busy.add(sid)
        meta: dict[str, Any] = {"id": sid}
        pid = 0
        # a pooled spawner's child has a network namespace of its own already
        pooled = self._take_pooled(spec.qos) if spec.netns_fd is None else None
        self._pool_qos = spec.qos  # the refill's class: the next create's, likely
        try:
            slot = pooled.slot if pooled is not None else self._alloc_slot(sid)
            uid_base = self.uid_base + slot * self.id_count
            meta.update(slot=slot, uid_base=uid_base, task_profile=spec.task_profile,
                        seccomp_profile=spec.seccomp_profile, lowers=list(spec.lowers))
            if not self.sandboxes_dir.is_dir():
                self.sandboxes_dir.mkdir(parents=True, mode=0o700)
                os.chmod(self.state_dir, 0o700)  # host-only: control sockets live below
            d.mkdir(mode=0o700)
            (d / "root").mkdir()
            self._write_meta(d, meta)
            policy = confinement.prepare(spec)
            if policy is not None and policy.apparmor_profile is not None:
                self._watch_apparmor()
            if pooled is not None and pooled.cg is not None:
                cg = self.cgroups.claim(pooled.cg, sid, spec.resources, qos=spec.qos,
                                        bpf=spec.netns_fd is not None)
                pooled.cg = None
            else:
                cg = self.cgroups.create(sid, spec.resources, uid_base, qos=spec.qos,
                                         bpf=spec.netns_fd is not None)
            argv = ["edged-spawner", "--status-fd", "3", "--root", str(d / "root"),
                    "--ctl", str(d / "ctl.sock"), "--log", str(d / "init.log"),
                    "--init", str(self.bin_dir / "sbx-init"), "--uid-base", str(uid_base),
                    "--id-count", str(self.id_count), "--hostname", spec.hostname,
                    "--disk-bytes", str(spec.resources.disk_bytes),
                    "--spare-idle-ms", str(self.spare_idle_ms)]
            for lower in spec.lowers:
                argv += ["--lower", lower]
            if policy is not None:
                argv += confinement.spawner_args(policy, self.state_dir / "policies")
            if self.scratch_dir is not None:
                scratch_path = self.scratch_dir / sid
                scratch_path.mkdir(parents=True, mode=0o700)
                mnt = await asyncio.to_thread(scratch.project_quota_mount, self.scratch_dir)
                if mnt is not None:
                    meta["quota"] = [mnt, uid_base]
                    self._write_meta(d, meta)
                    await asyncio.to_thread(scratch.limit, mnt, scratch_path, uid_base,
                                            spec.resources.disk_bytes)
                argv += ["--upper-dir", str(scratch_path)]
            for j in cg.join:  # what the spawner has not joined yet
                argv += ["--join", str(j)]
            if spec.netns_fd is not None:
                argv += ["--netns-fd", str(_NETNS_FD)]
            for kind, path in cg.sbx_init_dirs().items():
                argv += [f"--cg-{kind}", str(path)]
            p, pooled = pooled, None
            pid = await self._spawn(argv, p, netns_fd=spec.netns_fd)
            meta.update(pid=pid, starttime=_starttime(pid))
            self._write_meta(d, meta)
            self.uid_slots.bind(slot, sid, pid)  # the claim now outlives this daemon
            sbx = _Sandbox(sid, d, pid, os.pidfd_open(pid), uid_base, slot, cg, policy=policy,
                           limits=confinement.LimitWatch(cg, fresh=True),
                           starttime=meta["starttime"])
            try:
                await self._connect(sbx)
            except BaseException:
                os.close(sbx.pidfd)
                raise
            self._sandboxes[sid] = sbx
            self._watch(sbx)
        except BaseException as exc:
            if pooled is not None:  # failed before the spawner was used: it holds the slot
                self._drop_pooled(pooled)
                meta.pop("slot", None)
            with contextlib.suppress(Exception):
                await self._teardown(sid, meta)
            if isinstance(exc, OSError):
                raise BackendError(f"create sandbox {sid}: {exc}") from exc
            raise
        finally:
            self._busy.discard(sid)
            if not self._closed and len(self._pool) < self.spawner_pool:
                asyncio.get_running_loop().call_soon(self._fill_pool)

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> SbxExec:
        """Start ``spec.argv`` in the sandbox; returns once the program runs (execve done).
        Raises NotFound, InvalidState (paused, sbx-init gone), BadRequest (bad spec, or the
        program cannot start: missing file, bad cwd...)."""
        sbx = self._get(sandbox_id)
        if sbx.paused:
            raise InvalidState(f"sandbox {sandbox_id} is paused")
        if sbx.dead is not None:
            raise InvalidState(f"sandbox {sandbox_id} has failed: {failure_text(sbx.dead)}")
        if sbx.conn is None or sbx.conn.closed:
            raise InvalidState(f"sandbox {sandbox_id}: sbx-init is not connected")
        spec.check(self.id_count)
        if spec.kill_leftovers:
            await self.kill_processes(sandbox_id)
        if spec.trusted:
            await self._check_untampered(sbx)
        grader = bool(spec.trusted and sbx.policy is not None and sbx.policy.task.grader_view)
        return await sbx.conn.exec(
            tuple(spec.argv), spec.env, cwd=spec.cwd, uid=spec.uid, gid=spec.gid,
            timeout_s=spec.timeout_s, output_limit=spec.output_limit, stdin=spec.stdin,
            pty=spec.pty, grader=grader)

    async def _check_untampered(self, sbx: _Sandbox) -> None:
        """Before a grader exec: refuse it if the upper shadows any protected path."""
        policy = sbx.policy
        if policy is None:
            policy = await asyncio.to_thread(_policy_from_dir, sbx.dir)
            sbx.policy = policy
        if policy is None:
            return
        try:
            hits = await asyncio.to_thread(confinement.tamper_check, self.on_event, sbx.id,
                                           sbx.pid, policy)
        except OSError as exc:
            raise BackendError(f"sandbox {sbx.id}: cannot check protected paths before the "
                               f"grader: {exc}") from exc
        if hits:
            raise InvalidState(f"sandbox {sbx.id}: protected paths changed {hits}; the "
                               f"grader exec was not run")

    async def kill_processes(self, sandbox_id: str) -> int:
        """SIGKILL every task of the sandbox but sbx-init: sbx-init is outside every
        workload Landlock domain and the workload cannot reach it, so it is the one task
        left. The sandbox is frozen while its tasks are listed and killed (a fork bomb
        cannot outrun it). Raises InvalidState (paused, or no cgroup to list tasks by),
        BackendError (tasks still alive after 30 s)."""
        sbx = self._get(sandbox_id)
        if sbx.paused:
            raise InvalidState(f"sandbox {sandbox_id} is paused")
        try:
            n = await asyncio.to_thread(sbx.cg.kill_workload, sbx.pid)
        except BackendError as exc:
            raise BackendError(f"sandbox {sandbox_id}: {exc}") from exc
        log.info("sandbox %s: killed %d workload processes", sandbox_id, n)
        return n

    async def pause(self, sandbox_id: str) -> None:
        """Freeze every task of the sandbox, sbx-init included (cgroup freezer). Raises
        InvalidState where the host gives it no freezer."""
        sbx = self._get(sandbox_id)
        await asyncio.to_thread(sbx.cg.freeze, True)
        sbx.paused = True

    async def resume(self, sandbox_id: str) -> None:
        """Thaw what :meth:`pause` froze. Raises InvalidState where there is no freezer."""
        sbx = self._get(sandbox_id)
        await asyncio.to_thread(sbx.cg.freeze, False)
        sbx.paused = False

    async def destroy(self, sandbox_id: str) -> None:
        """Kill everything (thaw, kill the cgroups' tasks, SIGKILL sbx-init, whose pid
        namespace dies with it), wait for it, remove cgroups and state. The mounts die with
        the sandbox's mount namespace. Idempotent; unknown ids are a no-op."""
        sbx = self._sandboxes.pop(sandbox_id, None)
        self._busy.add(sandbox_id)
        try:
            if sbx is not None:
                self._unwatch(sbx)
                if sbx.conn is not None:
                    await sbx.conn.close()
                os.close(sbx.pidfd)
            meta = self._meta(sandbox_id)
            if meta is None and sbx is not None:
                meta = {"pid": sbx.pid, "starttime": _starttime(sbx.pid), "slot": sbx.slot}
            await self._teardown(sandbox_id, meta)
        finally:
            self._busy.discard(sandbox_id)
            if not self._sandboxes and not self._busy:
                self._stop_watching_apparmor()

    def egress_cgroup_dir(self) -> Path | None:
        """:meth:`edged.cgroups.Hierarchy.bpf_dir` (see :class:`NetnsJoiner`)."""
        return self.cgroups.bpf_dir()

    def init_pid(self, sandbox_id: str) -> int:
        """Host pid of the sandbox's sbx-init (its namespaces are reached through it)."""
        return self._get(sandbox_id).pid

    async def stats(self, sandbox_id: str) -> dict[str, int]:
        """``memory_bytes``: what the sandbox's memory cgroup is charged now: its processes
        and, with the default tmpfs upper, every byte its upper holds (written by its
        processes or through the files API, which writes from a helper in that cgroup):
        the one number of the sandbox's memory. ``upper_bytes``: what its upper (and work
        dir) hold, part of ``memory_bytes`` (absent for an upper on the node's scratch
        filesystem, ``scratch_dir``, which is disk). ``cpu_usage_ns``, ``pids``."""
        sbx = self._get(sandbox_id)
        out = sbx.cg.stats()
        if self.scratch_dir is None:
            with contextlib.suppress(OSError):
                # overlayfs answers statfs with its upper's filesystem: the sandbox's own
                st = os.statvfs(f"/proc/{sbx.pid}/root")
                out["upper_bytes"] = (st.f_blocks - st.f_bfree) * st.f_frsize
        return out

    def limit_counters(self, sandbox_id: str) -> dict[str, int]:
        """The sandbox's limit counters now (``oom_kill``, ``pids_limit``,
        ``cpu_throttled``; see :meth:`edged.cgroups.SandboxCgroup.limit_counters`): cheap
        reads of its cgroup files, for a caller that judges one exec by them (FnCall's
        Memory Limit Exceeded). Raises NotFound."""
        return self._get(sandbox_id).cg.limit_counters()

    async def memory(self, sandbox_id: str) -> MemoryUsage:
        """The sandbox's memory as its memory cgroup counts it (NotFound if unknown)."""
        return await asyncio.to_thread(self._get(sandbox_id).cg.memory_usage)

    async def reclaim(self, sandbox_id: str, nbytes: int | None = None) -> int:
        """Page the sandbox's cold memory out to swap; returns the bytes its resident
        memory went down by. cgroup v2: ``memory.reclaim`` of ``nbytes`` (None: all it
        holds); v1: ``memory.force_empty`` (all of it: ``nbytes`` is no bound there), or,
        without a memory cgroup that can, ``process_madvise(MADV_PAGEOUT)`` over the
        private mappings of each of its processes (which leaves its tmpfs and the pages its
        processes share). Works on a frozen sandbox too. Raises NotFound, BackendError."""
        sbx = self._get(sandbox_id)
        return await asyncio.to_thread(self._reclaim, sbx, nbytes)

    def _reclaim(self, sbx: _Sandbox, nbytes: int | None) -> int:
        cg = sbx.cg
        before = cg.memory_usage().resident_bytes
        try:
            if not cg.reclaim(nbytes if nbytes is not None else before):
                for pid in cg.procs() or [sbx.pid]:
                    memadvise.advise(pid, memadvise.PAGEOUT)
        except OSError as exc:
            raise BackendError(f"sandbox {sbx.id}: reclaim: {exc}") from exc
        return max(0, before - cg.memory_usage().resident_bytes)

    def totals(self) -> MemoryUsage:
        """Every sandbox's memory together (their parent cgroup)."""
        return self.cgroups.totals()

    def set_memory_limit(self, nbytes: int) -> None:
        """Cap all sandboxes' memory together at ``nbytes`` (0: no cap); see
        :meth:`edged.cgroups.Hierarchy.set_memory_limit`."""
        self.cgroups.set_memory_limit(nbytes)

    async def prefetch(self, sandbox_id: str) -> None:
        """Start reading the sandbox's swapped pages back (``MADV_WILLNEED`` over each of its
        processes' private mappings: swap readahead into the swap cache, so the faults that
        follow a resume find them in RAM). Raises NotFound, BackendError."""
        sbx = self._get(sandbox_id)

        def run() -> None:
            for pid in sbx.cg.procs() or [sbx.pid]:
                memadvise.advise(pid, memadvise.WILLNEED)

        try:
            await asyncio.to_thread(run)
        except OSError as exc:
            raise BackendError(f"sandbox {sandbox_id}: prefetch: {exc}") from exc

    def _root_fd(self, sbx: _Sandbox) -> int:
        try:
            fd = os.open(f"/proc/{sbx.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidState(f"sandbox {sbx.id}: not running ({exc.strerror})") from exc
        if _starttime(sbx.pid) is None:  # the pid could have been reused before the open
            os.close(fd)
            raise InvalidState(f"sandbox {sbx.id}: not running")
        return fd

    async def put_file(self, sandbox_id: str, path: str, data: AsyncIterator[bytes],
                       mode: int = 0o644, uid: int = 0, gid: int = 0) -> int:
        sbx = self._get(sandbox_id)
        if not (0 <= uid < self.id_count and 0 <= gid < self.id_count):
            raise BadRequest(f"uid/gid {uid}/{gid} outside the sandbox's id range")
        root = self._root_fd(sbx)
        join = sbx.cg.memory_join()
        try:
            return await files.put(root, path, data, mode, sbx.uid_base + uid, sbx.uid_base + gid,
                                   charge_to=None if join is None else str(join))
        finally:
            os.close(root)

    async def get_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        sbx = self._get(sandbox_id)
        root = self._root_fd(sbx)
        try:
            fd = files.open_for_get(root, path)
        finally:
            os.close(root)
        return files.stream(fd)

    async def _in_root(self, sandbox_id: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(root_fd, *args)`` in a thread, with the sandbox's root open."""
        sbx = self._get(sandbox_id)
        root = self._root_fd(sbx)
        try:
            return await asyncio.to_thread(fn, root, *args)
        finally:
            os.close(root)

    async def list_dir(self, sandbox_id: str, path: str, depth: int = 1) -> list[FileInfo]:
        """See :class:`edged.backends.base.FileOps` (:mod:`.fileops`)."""
        return await self._in_root(sandbox_id, fileops.list_dir, path,
                                   self._get(sandbox_id).uid_base, depth)

    async def stat_path(self, sandbox_id: str, path: str) -> FileInfo:
        return await self._in_root(sandbox_id, fileops.stat_path, path,
                                   self._get(sandbox_id).uid_base)

    async def make_dir(self, sandbox_id: str, path: str, *, parents: bool = True,
                       uid: int = 0, gid: int = 0) -> bool:
        sbx = self._get(sandbox_id)
        if not (0 <= uid < self.id_count and 0 <= gid < self.id_count):
            raise BadRequest(f"uid/gid {uid}/{gid} outside the sandbox's id range")
        return await self._in_root(sandbox_id, fileops.make_dir, path, sbx.uid_base + uid,
                                   sbx.uid_base + gid, 0o755, parents)

    async def remove_path(self, sandbox_id: str, path: str) -> None:
        await self._in_root(sandbox_id, fileops.remove, path)

    async def rename_path(self, sandbox_id: str, src: str, dst: str) -> None:
        await self._in_root(sandbox_id, fileops.rename, src, dst)

    def upper_dir(self, sandbox_id: str) -> UpperDir:
        """The sandbox's overlay upper, through sbx-init's scratch fd (host root only:
        ``/proc/<pid>/fd/<n>/upper``; see :func:`.confinement.scratch_path`). Raises
        NotFound, InvalidState (sbx-init gone, no scratch dir)."""
        sbx = self._get(sandbox_id)
        scratch_dir = confinement.scratch_path(sbx.pid) if sbx.dead is None else None
        if scratch_dir is None or not os.path.isdir(os.path.join(scratch_dir, "upper")):
            raise InvalidState(f"sandbox {sandbox_id}: its writable layer is not reachable "
                               f"(sbx-init gone?)")
        return UpperDir(os.path.join(scratch_dir, "upper"), sbx.uid_base, self.id_count)

    async def list_existing(self) -> list[str]:
        """Ids under the state dir whose sbx-init is alive (pid and start time match)."""
        return sorted(sid for sid, meta in self._metas().items() if self._alive(meta))

    async def adopt(self, sandbox_id: str) -> None:
        """Reconnect to a live sandbox of an earlier daemon (sbx-init accepts the new
        connection in place of the old). Raises NotFound if it is not alive."""
        if sandbox_id in self._sandboxes:
            return
        meta = self._meta(sandbox_id)
        if meta is None or not self._alive(meta):
            raise NotFound(f"sandbox {sandbox_id!r}: no live sandbox to adopt")
        pid = int(meta["pid"])
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError as exc:
            raise NotFound(f"sandbox {sandbox_id!r} has just ended") from exc
        cg = self.cgroups.path_of(sandbox_id)
        sbx = _Sandbox(sandbox_id, self.sandboxes_dir / sandbox_id, pid, pidfd,
                       int(meta["uid_base"]), int(meta["slot"]), cg,
                       limits=confinement.LimitWatch(cg), starttime=meta.get("starttime"))
        sbx.paused = cg.frozen()
        self._watch_apparmor()
        if sbx.paused:
            await asyncio.to_thread(cg.freeze, False)  # sbx-init must answer the hello
        try:
            await self._connect(sbx)
            if sbx.paused:
                await asyncio.to_thread(cg.freeze, True)
        except BaseException:
            os.close(pidfd)
            raise
        self._slots.add(sbx.slot)
        try:
            self.uid_slots.bind(sbx.slot, sandbox_id, pid)  # names this daemon from now on
        except OSError as exc:  # BackendError too: the sandbox runs; its claim names its init
            log.warning("sandbox %s: uid slot %d: cannot update its claim: %s", sandbox_id,
                        sbx.slot, exc)
        self._sandboxes[sandbox_id] = sbx
        self._watch(sbx)

    async def cleanup_leftovers(self, keep: set[str]) -> list[str]:
        """Tear down every sandbox found in the state dir or our cgroups that is neither in
        ``keep`` nor attached to this backend: dead, half-made, or unwanted live ones.
        Returns the ids removed."""
        metas = self._metas()
        pool = {POOL_PREFIX + str(p.slot) for p in self._pool}
        ids = ((set(metas) | self.cgroups.existing()) - keep - set(self._sandboxes) - self._busy
               - pool)
        return await remove_leftovers(ids, metas, self._teardown)

    async def warm(self) -> None:
        """Start the spawner pool now rather than at the first create (the spawners get
        ready in the background)."""
        self._adopt_loop()
        self._fill_pool()

    async def close(self) -> None:
        """End the pooled spawners and drop the control connections (sandboxes keep running,
        for a later adopt). With no sandbox left in the state dir, also remove our (empty)
        parent cgroups. The backend stays usable (the pool refills on the next create)."""
        self._adopt_loop()
        self._closed = True
        loop = asyncio.get_running_loop()
        for p in self._pool:
            loop.remove_reader(p.status)
            self._drop_pooled(p)
        self._pool.clear()
        while self._reaping:
            pid, (pidfd, then) = self._reaping.popitem()
            loop.remove_reader(pidfd)
            os.close(pidfd)
            with contextlib.suppress(ChildProcessError):
                await asyncio.to_thread(os.waitpid, pid, 0)
            if then is not None:
                then()
        self._reaping.clear()
        for sbx in list(self._sandboxes.values()):
            self._unwatch(sbx)
            if sbx.conn is not None:
                await sbx.conn.close()
            os.close(sbx.pidfd)
        self._sandboxes.clear()
        self._stop_watching_apparmor()
        if not self._metas() and not self._busy:
            self.cgroups.prune()
        self._closed = False


def _death_cause(sbx: _Sandbox) -> dict[str, object]:
    """What can be known of why sbx-init ended: its exit status if it is still a zombie
    (it is not our child: its reaper, the host's init, may have been first), whether the
    sandbox's memory cgroup OOM-killed a process since the last exec's end, and the last
    line sbx-init logged."""
    cause: dict[str, object] = {"what": "sbx-init ended"}
    with contextlib.suppress(OSError, ValueError, IndexError):
        data = Path(f"/proc/{sbx.pid}/stat").read_text()
        fields = data[data.rindex(")") + 2 :].split()
        # state (field 3) a zombie, the same process (starttime, field 22), exit_code (52)
        if fields[0] == "Z" and int(fields[19]) == sbx.starttime:
            status = int(fields[49])
            if os.WIFSIGNALED(status):
                cause["signal"] = os.WTERMSIG(status)
            elif os.WIFEXITED(status):
                cause["exit_status"] = os.WEXITSTATUS(status)
    if sbx.limits is not None:
        with contextlib.suppress(OSError, ValueError, BackendError):
            if sbx.cg.oom_kills() > sbx.limits.last.get("oom_kill", 0):
                cause["oom_kill"] = True
    with contextlib.suppress(OSError):
        with open(sbx.dir / "init.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
        if lines:
            cause["log"] = lines[-1][-300:]
    return cause


def _left_text(pids: list[int]) -> str:
    """``pids`` (host pids of a sandbox's processes still there after SIGKILL) in words:
    how many, and those in uninterruptible sleep (``D`` in ``/proc/PID/stat``) with the
    kernel function they wait in (``/proc/PID/wchan``): a SIGKILLed process dies only when
    that wait ends, e.g. ``request_wait_answer``, a FUSE read its server took and has not
    answered (a stopped or wedged lazy layer server)."""
    stuck: list[str] = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
            if rest.split()[0] != "D":
                continue
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read().strip() or "?"
        except (OSError, IndexError):
            continue
        stuck.append(f"{comm.split('(', 1)[-1]}[{pid}] in {wchan}")
    text = f"{len(pids)} processes left"
    if stuck:
        text += (f", in uninterruptible sleep: {', '.join(stuck[:4])}"
                 f"{' ...' if len(stuck) > 4 else ''} (a read its filesystem has not "
                 f"answered, e.g. of a layer whose lazy server is stopped or wedged)")
    return text


def _unthrottle_and_kill(cg: SandboxCgroup, leave_idle: bool = False) -> None:
    cg.unthrottle(leave_idle)
    cg.kill_all()


def _remove_quietly(cg: SandboxCgroup) -> None:
    try:
        cg.remove()
    except BackendError as exc:
        log.warning("spawner pool: %s", exc)


def _policy_from_dir(d: Path) -> confinement.Policy | None:
    """The policy of an adopted sandbox, rebuilt from its meta.json (protected paths only
    matter here: the running sandbox keeps what it was started with)."""
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not meta.get("task_profile"):
        return None
    spec = SandboxSpec(id=d.name, lowers=tuple(meta.get("lowers") or ()),
                       resources=Resources(), env={}, hostname="x",
                       task_profile=meta["task_profile"],
                       seccomp_profile=meta.get("seccomp_profile"))
    return confinement.prepare(spec)


def _check_spec(spec: SandboxSpec) -> None:
    spec.check()
    if spec.network not in ("none", "policy") or (spec.network == "policy") != (
            spec.netns_fd is not None):
        raise BadRequest(f"network {spec.network!r}: 'none', or 'policy' with a namespace")
    for lower in spec.lowers:
        if not os.path.isabs(lower) or not os.path.isdir(lower):
            raise BadRequest(f"lower {lower!r} is not an existing absolute directory")


async def _read_line(fd: int) -> bytes:
    """Bytes from ``fd`` up to the first newline or EOF."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    done: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError as exc:
            if not done.done():
                done.set_exception(exc)
            return
        if data:
            chunks.append(data)
        if (not data or b"\n" in data) and not done.done():
            done.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


__all__ = ["ContainerBackend"]
