"""The sandbox manager: the daemon's one owner of sandbox state.

It takes typed requests (:mod:`edged.node.requests`, validated by the API), admits them
against :class:`~edged.node.admission.Capacity`, gives each sandbox its layers in the form
its backend needs (mounted once per node, or image files: :class:`~edged.images.LayerMounts`),
drives the backend its record names (:class:`~edged.backends.registry.Backends`), keeps each
record's state machine, persists records atomically in ``<state_dir>/sandboxes/<id>.json``,
reaps sandboxes whose TTL or idle timeout passed, and re-adopts or tears down sandboxes found
after a restart. Every failure path gives back what was taken (reservation, layers, backend
resources): bad input never leaves partial state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from edged.backends.base import (
    Backend,
    CallBackend,
    ExecHandle,
    ExecSpec,
    FileInfo,
    FileOps,
    LayerForm,
    MemoryUsage,
    Resources,
    SandboxSpec,
    SnapshotSource,
    failure_text,
)
from edged.backends.registry import Backends
from edged.config import Config
from edged.errors import (
    BackendError,
    BadRequest,
    Conflict,
    EdgedError,
    InvalidState,
    LayersUnavailable,
    NotFound,
)
from edged.images.mounts import LayerCounters, LayerMounts
from edged.images.registry import ImageRegistry, check_ref
from edged.images.service import LayerService
from edged.metrics import Metrics
from edged.net.manager import NetworkManager
from edged.net.policy import NONE as NO_NETWORK
from edged.net.policy import Policy
from edged.node.admission import Admission, Capacity, SpareHolder, Usage
from edged.node.fds import FdBudget
from edged.node.reclaim import ReclaimConfig, Reclaimer
from edged.node.requests import CreateRequest, ExecRequest, SignalRequest, TimeoutRequest
from edged.node.sandbox import SandboxRecord, State, default_hostname
from edged.node.sessions import Sessions
from edged.node.swap import SwapManager
from edged.security.ledger import Ledger

log = logging.getLogger("edged.node")

#: the reaper scans at least this often (seconds), whatever the sandboxes' deadlines say
REAP_SCAN_MAX_S = 60.0


class SandboxManager:
    """Owns every :class:`SandboxRecord` of this node. One per daemon."""

    def __init__(
        self,
        config: Config,
        backends: Backends,
        images: ImageRegistry,
        layers: LayerMounts,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.backends = backends
        for b in backends:
            b.on_failure = self._sandbox_failed
            if isinstance(b, CallBackend):  # its sandboxes are made through this node
                b.attach(NodeHost(self))
        self.images = images
        self.layers = layers
        self.metrics = metrics or Metrics()
        self.capacity = Capacity(
            cpus=config.capacity_cpus(),
            memory_bytes=config.capacity_memory(),
            cpu_overcommit=config.cpu_overcommit,
            memory_overcommit=config.memory_overcommit,
            max_sandboxes=config.max_sandboxes,
            retry_after_s=config.retry_after_s,
        )
        #: the node's swap (set by the daemon; None: reclaim uses whatever the host has)
        self.swap: SwapManager | None = None
        # a shortage (reclaim sooner, at least the deficit a pass) begins at 4 × the
        # reserve: at ~10 creates a second of ~11 MiB each, the few seconds from a create
        # to its reclaim hold ~1 GiB, and admission stops at the reserve
        self.reclaimer = Reclaimer(
            ReclaimConfig(enabled=config.reclaim, idle_after_s=config.idle_after_s,
                          idle_cpu=config.idle_cpu, interval_s=config.reclaim_interval_s,
                          rate_bytes=config.reclaim_rate_bytes,
                          psi_target=config.reclaim_psi_target,
                          low_bytes=4 * config.memory_reserve()),
            _ByRecord(self), self._live_records, on_reclaimed=self._reclaimed,
            ensure_swap=self._ensure_swap, swap_room=self._swap_room)
        self.admission = Admission(
            self.capacity, reserve_bytes=config.memory_reserve(),
            memory_pressure_limit=config.memory_pressure_limit,
            cpu_pressure_limit=config.cpu_pressure_limit,
            window_s=config.admission_window_s, usage=self._usage,
            reclaimable=self._reclaimable, reclaim_rate=self._reclaim_rate,
            reclaim_retry_s=config.reclaim_interval_s,
            spares=[b for b in backends if isinstance(b, SpareHolder)])
        #: the layer service's supervision (set by the daemon; None: nothing to supervise)
        self.layer_service: LayerService | None = None
        #: the daemon's descriptors: a create is refused (503) before EMFILE is possible
        self.fds = FdBudget(retry_after_s=config.retry_after_s)
        self.records_dir = Path(config.state_dir) / "sandboxes"
        self._sandboxes: dict[str, SandboxRecord] = {}
        self._execs: dict[str, dict[int, ExecHandle]] = {}
        #: sandbox -> {layer: counters} at create, until its first exec ends
        #: (see Metrics.start_fetched_fraction)
        self._starts: dict[str, dict[str, LayerCounters]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._bg: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        #: wall time of the reaper's next scan (see _reap_forever); 0: at its next tick
        self._reap_next = 0.0
        self._reap_pokes = 0
        #: what each backend probed at start, by name
        self.features: dict[str, dict[str, object]] = {}
        #: the security-event ledger (set by the daemon; None: events are not kept)
        self.ledger: Ledger | None = None
        #: networked sandboxes (set by the daemon; None: only ``"none"``)
        self.net: NetworkManager | None = None
        self.default_resources = Resources()
        #: the sandboxes' shell sessions (POST /v1/sandboxes/{id}/sessions)
        self.sessions = Sessions(self)

    # -- records --------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The record of ``sandbox_id`` (:class:`NotFound` if none)."""
        rec = self._sandboxes.get(sandbox_id)
        if rec is None:
            raise NotFound(f"sandbox {sandbox_id}: no such sandbox")
        return rec

    def find(self, labels: Mapping[str, str] | None = None) -> list[SandboxRecord]:
        """Records whose labels include every ``labels`` pair, oldest first."""
        want = dict(labels or {})
        out = [
            r for r in self._sandboxes.values()
            if all(r.labels.get(k) == v for k, v in want.items())
        ]
        return sorted(out, key=lambda r: (r.created_at, r.id))

    def _save(self, rec: SandboxRecord) -> None:
        # Atomic (temp file, rename) but not fsynced: a record describes live processes, which
        # only a daemon restart can outlive, and the page cache survives that; after an OS
        # crash there is nothing left to adopt, and recover() drops a torn record.
        path = self.records_dir / f"{rec.id}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(rec.persisted(), indent=1, sort_keys=True))
        except FileNotFoundError:
            self.records_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(rec.persisted(), indent=1, sort_keys=True))
        os.replace(tmp, path)

    def _save_quietly(self, rec: SandboxRecord) -> bool:
        """:meth:`_save`, logging a failure (a full disk, EMFILE) instead of raising: for
        saves whose failure must not stop what follows (a delete, a shutdown). The record
        in memory stays the truth; recovery after a restart sees the last saved state."""
        try:
            self._save(rec)
        except OSError as e:
            log.warning("sandbox %s: cannot save its record (state %s): %s", rec.id,
                        rec.state.value, e, extra={"sandbox": rec.id})
            return False
        return True

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _release_layers(self, digests: list[str], form: LayerForm) -> None:
        """Drop a sandbox's layer references, top first (the layer mounts keep the last one a
        while: ``layer_linger_s``); a release error is logged."""
        for d in reversed(digests):
            try:
                await self.layers.release(d, form)
            except EdgedError as e:
                log.warning("layer release failed: %s", e)

    async def _flush_background(self) -> None:
        """Drop the lingering layer references and wait for background work."""
        await self.layers.flush()
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    def _live_records(self) -> list[SandboxRecord]:
        return [r for r in self._sandboxes.values()
                if r.state in (State.RUNNING, State.PAUSED)]

    def _ensure_swap(self) -> bool:
        return self.swap.ensure() if self.swap is not None else False

    def _reclaimed(self, sandbox_id: str, nbytes: int) -> None:
        self.metrics.reclaimed_bytes.inc(nbytes)

    def _usage(self) -> Usage:
        """The sandboxes' own memory: their cgroups together and our zram device."""
        use = MemoryUsage()
        for b in self.backends:
            t = b.totals()
            use = MemoryUsage(resident_bytes=use.resident_bytes + t.resident_bytes,
                              swap_bytes=use.swap_bytes + t.swap_bytes)
        z = self.swap.zram_stats() if self.swap is not None else None
        return Usage(resident=use.resident_bytes, swap=use.swap_bytes,
                     zram=z["mem_used_bytes"] if z else 0)

    def _swap_room(self) -> int | None:
        """Bytes of pages the node's swap can take now (None: no swap manager, the host's
        own business, or no swap at all: reclaim then only drops page cache): reclaim pages
        no sandbox into a swap that has no room."""
        if self.swap is None or not self.swap.areas():
            return None
        return sum(self.swap.room())

    def _reclaim_rate(self) -> float:
        """Bytes a second reclaim frees lately (0.0 with reclaim off)."""
        return self.reclaimer.rate() if self.config.reclaim else 0.0

    def _reclaimable(self) -> int:
        """What reclaim can free now: the idle sandboxes' swappable memory, the part that
        goes to zram saving all but its compressed size, the part that goes to disk all of
        it, within the room swap has (:meth:`SwapManager.room`)."""
        if not self.config.reclaim or self.swap is None:
            return 0
        idle = self.reclaimer.idle_bytes()
        if idle <= 0:
            return 0
        ratio = self.swap.ratio()
        compressed, plain = self.swap.room(ratio)
        to_zram = min(idle, compressed)
        to_disk = min(idle - to_zram, plain)
        return max(0, int(to_zram * (1 - 1 / ratio)) + to_disk)

    def _forget(self, rec: SandboxRecord, cause: str) -> None:
        self.sessions.forget(rec.id)
        self._starts.pop(rec.id, None)
        self.reclaimer.forget(rec.id)
        if self.ledger is not None and rec.id in self._sandboxes:
            self.ledger.sandbox_gone(rec.id, cause=cause)
        self._sandboxes.pop(rec.id, None)
        self._execs.pop(rec.id, None)
        self._locks.pop(rec.id, None)
        self.admission.release(rec.id)
        with contextlib.suppress(FileNotFoundError):
            (self.records_dir / f"{rec.id}.json").unlink()
        self._update_gauges()

    def _update_gauges(self) -> None:
        counts = dict.fromkeys(State, 0)
        for r in self._sandboxes.values():
            counts[r.state] += 1
        for s, n in counts.items():
            self.metrics.sandboxes.labels(state=s.value).set(n)
        self.metrics.allocated_cpus.set(self.capacity.allocated_cpus)
        self.metrics.allocated_memory.set(self.capacity.allocated_memory)
        self.metrics.layer_mounts.set(len(self.layers.refs()))

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _fds_held(self) -> int:
        """Descriptors the daemon holds for its sandboxes (their backends' counts)."""
        per = {b.name: b.fds_per_sandbox for b in self.backends}
        return sum(per.get(r.backend, 0) for r in self._sandboxes.values())

    def backend_of(self, sandbox_id: str) -> Backend:
        """The backend running ``sandbox_id`` (the one its record names)."""
        return self.backends.get(self.get(sandbox_id).backend)

    # -- lifecycle ------------------------------------------------------------------------

    def _record(self, req: CreateRequest) -> SandboxRecord:
        """A fresh record for ``req`` (state ``creating``, not yet registered), the node's
        defaults filled in. Raises :class:`BadRequest` (a backend not running here),
        :class:`NotFound` (an unknown image)."""
        backend = self.backends.get(req.backend).name if req.backend else self.backends.default
        sid = req.id
        if sid is None:
            sid = f"sbx-{time.time_ns():x}"[:63]
            while sid in self._sandboxes:
                sid = f"sbx-{time.time_ns():x}"[:63]
        if req.image is not None:
            layers = list(self.images.get(req.image)["layers"])
        else:
            layers = list(req.layers or ())
        cfg = self.config
        rec = SandboxRecord(
            id=sid,
            backend=backend,
            layers=layers,
            resources=req.resources_over(self.default_resources),
            env=dict(req.env),
            labels=dict(req.labels),
            image=req.image,
            network=req.network,
            hostname=req.hostname or default_hostname(sid),
            idle_timeout_s=(cfg.default_idle_timeout_s if req.idle_timeout_s is None
                            else req.idle_timeout_s),
            task_profile=req.task_profile,
            seccomp_profile=req.seccomp_profile,
            qos=req.qos,
            auto_pause_after_s=(cfg.default_auto_pause_after_s
                                if req.auto_pause_after_s is None else req.auto_pause_after_s),
        )
        rec.set_ttl(cfg.default_ttl_s if req.ttl_s is None else req.ttl_s)
        return rec

    def parse_network(self, value: object, backend: str) -> Policy:
        """A ``network`` value (``"none"`` or ``{"allow": [...]}``) for a sandbox of
        ``backend``; :class:`BadRequest` names the bad rule or a backend that runs no
        networked sandboxes, :class:`InvalidState` when this node has no networking."""
        if value is None or value == "none":
            return NO_NETWORK
        if self.net is None:
            raise InvalidState("network: this node runs no networked sandboxes "
                               "(network_pool is empty)")
        pol = self.net.parse(value)
        self.net.require_enabled()
        if backend != self.net.backend:
            raise BadRequest(f"network: the {backend} backend runs no networked sandboxes "
                             f"(on this node: {self.net.backend})")
        return pol

    async def create(self, req: CreateRequest) -> SandboxRecord:
        """Create the sandbox ``req`` asks for and return its record once ``running``.

        Raises :class:`BadRequest`, :class:`NotFound` (image or layer), :class:`Conflict` (id
        in use), :class:`CapacityExhausted` (with ``retry_after``), :class:`BackendError`. On
        any failure nothing is left: reservation, layers and backend state are undone.
        """
        rec = self._record(req)
        backend = self.backends.get(rec.backend)
        policy = self.parse_network(req.network, rec.backend)
        rec.network = policy.request
        if rec.id in self._sandboxes:
            raise Conflict(f"sandbox {rec.id}: id already in use")
        t0 = time.monotonic()
        svc = self.layer_service
        if svc is not None and not svc.available and rec.layers:
            raise LayersUnavailable("layers unavailable: the node's layer service is down and "
                                    "being restarted", retry_after=svc.retry_after())
        self.fds.check(self._fds_held(), backend.fds_per_sandbox)
        self.admission.admit(rec.id, rec.resources)
        self._sandboxes[rec.id] = rec
        self._reap_soon()
        if self.ledger is not None:
            self.ledger.sandbox_created(rec.id)
        lock = self._lock(rec.id)
        fetching: asyncio.Future[dict[str, LayerCounters] | None] | None = None
        try:
            async with lock:
                # The start's baseline, read in a thread alongside the create; before it
                # when a layer is to be mounted now (what the mount reads counts as the start's)
                held = self.layers.refs()
                fetching = asyncio.ensure_future(self.layers.fetched(rec.layers))
                if not all(d in held for d in rec.layers):
                    await asyncio.wait({fetching})
                rec.lowers = await self.layers.acquire_all(rec.layers, backend.layer_form)
                attached = None
                try:
                    self._save(rec)
                    if policy.networked:
                        assert self.net is not None
                        attached = await self.net.attach(rec.id, policy)
                    spec = SandboxSpec(
                        id=rec.id,
                        lowers=tuple(rec.lowers),
                        resources=rec.resources,
                        env=dict(rec.env),
                        hostname=rec.hostname,
                        network="policy" if attached else "none",
                        task_profile=rec.task_profile,
                        seccomp_profile=rec.seccomp_profile,
                        qos=rec.qos,
                        netns_fd=attached.netns_fd if attached else None,
                    )
                    try:
                        await backend.create(spec)
                    except BaseException:
                        with contextlib.suppress(Exception):
                            await backend.destroy(rec.id)
                        raise
                except BaseException:
                    if attached and self.net is not None:
                        with contextlib.suppress(Exception):
                            await self.net.detach(rec.id)
                    await self._release_layers(rec.layers, backend.layer_form)
                    raise
                rec.transition(State.RUNNING)
                rec.touch()
                # a scan during the create skipped it (not running yet) and may have set the
                # next one a minute off: its TTL counts from now
                self._reap_soon()
                # The sandbox runs: a failed save must not orphan it (a restart then finds
                # the record at "creating" and destroys the sandbox)
                self._save_quietly(rec)
                fetched0 = await fetching
        except BaseException as e:
            if fetching is not None:
                fetching.cancel()
            self._forget(rec, "create_failed")
            self.metrics.creates.labels(result=getattr(e, "code", "error")).inc()
            if isinstance(e, Exception) and getattr(e, "status", 500) >= 500:
                log.warning("sandbox %s: create failed: %s", rec.id, e,
                            extra={"sandbox": rec.id})
            if isinstance(e, EdgedError):
                raise
            if isinstance(e, Exception):
                raise BackendError(f"sandbox {rec.id}: create failed: {e}") from e
            raise
        if fetched0 is not None:
            self._starts[rec.id] = fetched0
        self.metrics.creates.labels(result="ok").inc()
        self.metrics.create_seconds.observe(time.monotonic() - t0)
        self._update_gauges()
        log.info("sandbox created", extra={"sandbox": rec.id, "layers": len(rec.layers)})
        return rec

    async def delete(self, sandbox_id: str, cause: str = "api") -> SandboxRecord:
        """Stop and remove a sandbox; returns its final record (state ``stopped``). One being
        created or deleted is waited for. If the backend fails, or the delete is cancelled
        half-way, the record stays as ``failed`` with the error, and a later delete retries.
        A record that cannot be saved (a full disk, EMFILE) never stops a delete."""
        rec = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            if self._sandboxes.get(sandbox_id) is not rec:
                raise NotFound(f"sandbox {sandbox_id}: no such sandbox")
            if rec.state is State.STOPPING:
                # No delete runs while the lock is free: one that ended half-way
                rec.state = State.FAILED
            rec.require(State.RUNNING, State.PAUSED, State.FAILED, op="delete")
            rec.transition(State.STOPPING)
            # "stopping" on disk only tells a daemon restarted mid-destroy not to adopt it
            self._save_quietly(rec)
            try:
                await self.backend_of(sandbox_id).destroy(sandbox_id)
            except BaseException as e:
                rec.state = State.FAILED
                rec.error = f"destroy failed: {e or type(e).__name__}"
                self._save_quietly(rec)
                self._update_gauges()
                if not isinstance(e, Exception):
                    raise  # cancelled: a later delete (or the shutdown) retries
                log.warning("sandbox %s: destroy failed: %s", sandbox_id, e,
                            extra={"sandbox": sandbox_id})
                if isinstance(e, EdgedError):
                    raise
                raise BackendError(f"sandbox {sandbox_id}: destroy failed: {e}") from e
            if self.net is not None:
                await self.net.detach(sandbox_id)
            await self._release_layers(rec.layers, self.backend_of(sandbox_id).layer_form)
            rec.transition(State.STOPPED)
            self._forget(rec, "deleted" if cause == "api" else cause)
        self.metrics.destroys.labels(cause=cause).inc()
        log.info("sandbox stopped", extra={"sandbox": sandbox_id, "cause": cause})
        return rec

    async def set_network(self, sandbox_id: str, value: object) -> dict[str, Any]:
        """``PUT /v1/sandboxes/{id}/network``: replace a running or paused sandbox's policy
        at once (see :meth:`edged.net.manager.NetworkManager.set_policy`); returns
        ``{"policy", "generation", "cut"}``. Raises BadRequest, InvalidState (created
        without a network, or not running), NotFound."""
        rec = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            rec.require(State.RUNNING, State.PAUSED, op="change the network policy")
            if self.net is None or not self.net.has(sandbox_id):
                raise InvalidState(f"sandbox {sandbox_id} was created without a network "
                                   f"(\"none\"); its policy cannot change")
            policy = self.net.parse(value)
            out = await self.net.set_policy(sandbox_id, policy)
            rec.network = out["policy"]
            rec.touch()
            self._save(rec)
        return out

    def network_info(self, sandbox_id: str) -> dict[str, Any]:
        """``GET /v1/sandboxes/{id}/network``: policy, addresses, resolver, counters."""
        self.get(sandbox_id)
        if self.net is None:
            return {"policy": "none"}
        return self.net.info(sandbox_id)

    async def pause(self, sandbox_id: str, cause: str = "api") -> SandboxRecord:
        """Freeze a running sandbox (:class:`InvalidState` otherwise) and, with
        ``pause_reclaim``, page its memory out to swap (DSec §5.2: freeze, swap, reclaim; a
        reclaim failure is logged, the sandbox stays paused). ``cause``: ``api`` or ``auto``
        (``auto_pause_after_s``)."""
        rec = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            rec.require(State.RUNNING, op="pause")
            await self.backend_of(sandbox_id).pause(sandbox_id)
            rec.transition(State.PAUSED)
            self._save(rec)
        self._update_gauges()
        if self.config.pause_reclaim:
            try:
                moved = await self.reclaimer.reclaim_now(sandbox_id)
                log.info("sandbox paused", extra={"sandbox": sandbox_id, "cause": cause,
                                                  "reclaimed_bytes": moved})
            except EdgedError as e:
                log.warning("sandbox %s: paused, but reclaim failed: %s", sandbox_id, e)
        return rec

    async def resume(self, sandbox_id: str) -> SandboxRecord:
        """Thaw a paused sandbox (:class:`InvalidState` otherwise); resets the idle clock.
        Its swapped pages are read back ahead first (``MADV_WILLNEED``), then it is thawed."""
        rec = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            rec.require(State.PAUSED, op="resume")
            t0 = time.monotonic()
            if self.reclaimer.woke(sandbox_id):
                try:
                    await self.backend_of(sandbox_id).prefetch(sandbox_id)
                except EdgedError as e:
                    log.warning("sandbox %s: prefetch before resume: %s", sandbox_id, e)
            await self.backend_of(sandbox_id).resume(sandbox_id)
            rec.transition(State.RUNNING)
            rec.touch()
            self._save(rec)
            self.metrics.resume_seconds.observe(time.monotonic() - t0)
        self._update_gauges()
        return rec

    async def _awake(self, sandbox_id: str, op: str) -> SandboxRecord:
        """The record of a sandbox a request is for, running: a paused one is resumed first
        (any request to a paused sandbox resumes it). Raises NotFound, InvalidState (any
        state but running or paused)."""
        rec = self.get(sandbox_id)
        if rec.state is State.PAUSED:
            with contextlib.suppress(InvalidState):  # resumed by a request racing this one
                await self.resume(sandbox_id)
        rec.require(State.RUNNING, op=op)
        return rec

    def set_timeout(self, sandbox_id: str, req: TimeoutRequest) -> SandboxRecord:
        """A new TTL (from now; 0 clears) and/or idle timeout."""
        rec = self.get(sandbox_id)
        rec.require(State.RUNNING, State.PAUSED, op="set a timeout")
        if req.ttl_s is not None:
            rec.set_ttl(req.ttl_s)
        if req.idle_timeout_s is not None:
            rec.idle_timeout_s = req.idle_timeout_s
            rec.touch()
        self._reap_soon()
        self._save(rec)
        return rec

    async def stats(self, sandbox_id: str) -> dict[str, int]:
        """Backend usage figures of a running or paused sandbox."""
        rec = self.get(sandbox_id)
        rec.require(State.RUNNING, State.PAUSED, op="read stats")
        return await self.backend_of(sandbox_id).stats(sandbox_id)

    # -- exec, signals, files -------------------------------------------------------------

    def exec_spec(self, sandbox_id: str, req: ExecRequest) -> ExecSpec:
        """The :class:`ExecSpec` of ``req`` in ``sandbox_id``: its env merged over the
        sandbox's (for a grader, over the sandbox's without what could steer it)."""
        rec = self.get(sandbox_id)
        base_env = dict(rec.env)
        if req.trusted:
            # A grader trusts nothing the sandbox env could steer: the interpreter's
            # start-up hooks and the dynamic loader's; its HOME is the fresh empty /root
            # of its own view. What the request itself gives wins.
            base_env = {k: v for k, v in base_env.items()
                        if not k.startswith(("PYTHON", "LD_"))}
            base_env.update(PYTHONNOUSERSITE="1", HOME="/root")
        return ExecSpec(
            argv=req.argv,
            env={**base_env, **req.env},
            cwd=req.cwd,
            uid=req.uid,
            gid=req.gid,
            stdin=req.stdin not in (None, False, ""),
            timeout_s=req.timeout_s,
            output_limit=req.output_limit,
            pty=req.pty,
            trusted=req.trusted,
            kill_leftovers=req.kill_leftovers,
        )

    @asynccontextmanager
    async def exec(self, sandbox_id: str, spec: ExecSpec, *,
                   counts_active: bool = True) -> AsyncIterator[ExecHandle]:
        """Start ``spec`` in a running sandbox; yields the handle while the caller streams
        its events. Counts as activity (no idle reaping while an exec runs), unless
        ``counts_active`` is False (a shell session waiting between runs: its runs count).

        An exec left before its end (the caller cancelled, e.g. a trainer's per-step
        timeout; its client disconnected; an error) is abandoned: its whole process tree is
        killed at once, its slot freed, and that is recorded once (``exec_abandoned`` in the
        ledger, one log line, ``edged_execs{reason="abandoned"}``), however it went."""
        rec = await self._awake(sandbox_id, "exec")
        reclaimed = self.reclaimer.woke(sandbox_id)
        t0 = time.monotonic()
        try:
            handle = await self.backend_of(sandbox_id).exec(sandbox_id, spec)
        except asyncio.CancelledError:
            self._abandoned(sandbox_id, None, spec, "cancelled")  # the backend killed it
            raise
        if reclaimed:  # the first exec on a reclaimed sandbox: its wake
            self.metrics.wake_seconds.observe(time.monotonic() - t0)
        active = 1 if counts_active else 0
        rec.active_execs += active
        rec.touch()
        execs = self._execs.setdefault(sandbox_id, {})
        execs[handle.exec_id] = handle
        how = "left"
        try:
            yield handle
        except BaseException as e:
            how = _gone_how(e)
            raise
        finally:
            if not handle.ended:
                handle.abandon()
                self._abandoned(sandbox_id, handle.exec_id, spec, how)
            execs.pop(handle.exec_id, None)
            rec.active_execs -= active
            rec.touch()
            start = self._starts.pop(sandbox_id, None)
            if start is not None:  # off the exec's path: the stream ends without waiting
                self._background(self._observe_start(rec, start))

    def _sandbox_failed(self, sandbox_id: str, cause: Mapping[str, object]) -> None:
        """The backend says the sandbox died on its own (its init ended): ``failed`` now,
        with the cause in its record and in the ledger (``sandbox_failed``), rather than
        ``running`` with every exec refused. A delete still removes everything."""
        rec = self._sandboxes.get(sandbox_id)
        if rec is None or rec.state not in (State.CREATING, State.RUNNING, State.PAUSED):
            return  # being deleted, or already failed
        rec.transition(State.FAILED)
        rec.error = failure_text(cause)
        log.warning("sandbox %s failed: %s", sandbox_id, rec.error,
                    extra={"sandbox": sandbox_id})
        if self.ledger is not None:
            self.ledger.record(sandbox_id, "sandbox_failed", detail={"cause": dict(cause)})
        self._save_quietly(rec)
        self._update_gauges()

    def layers_lost(self, digests: list[str]) -> None:
        """The layer service's connection was lost with every holder of it (see
        :mod:`edged.images.service`): the sandboxes reading the mounts that went with it
        (``digests``; and every one whose backend reads image files, all served over that
        connection) can no longer read what the page cache lacks, so they fail, with the
        cause, rather than compute on; a delete still cleans them."""
        lost = set(digests)
        for rec in list(self._sandboxes.values()):
            form = self.backends.get(rec.backend).layer_form
            hit = sorted(lost & set(rec.layers)) if form == "tree" else list(rec.layers)
            if hit:
                self._sandbox_failed(rec.id, {
                    "what": "its layers were lost with the layer service's connection (reads "
                            "of layer data not in memory fail)", "layers": hit})

    def _abandoned(self, sandbox_id: str, exec_id: int | None, spec: ExecSpec,
                   how: str) -> None:
        """Record an exec whose caller went away before its end (its tree is killed)."""
        self.metrics.execs.labels(reason="abandoned").inc()
        log.info("sandbox %s: exec %s abandoned (%s): its processes are killed", sandbox_id,
                 exec_id if exec_id is not None else "(starting)", how,
                 extra={"sandbox": sandbox_id})
        if self.ledger is not None:
            self.ledger.record(sandbox_id, "exec_abandoned", process=spec.argv[0][-64:],
                               detail={"exec_id": exec_id, "how": how})

    async def _observe_start(self, rec: SandboxRecord,
                             start: dict[str, LayerCounters]) -> None:
        now = await self.layers.fetched(rec.layers)
        size = sum(c.size for c in (now or {}).values())
        if not now or size <= 0:
            return
        zero = LayerCounters(0, 0)

        def delta(field: str) -> float:
            return float(sum(max(0, getattr(c, field) - getattr(start.get(d, zero), field))
                             for d, c in now.items()))

        fetched, reads = delta("fetched"), delta("reads")
        self.metrics.start_fetched_bytes.inc(fetched)
        self.metrics.start_fetched_fraction.observe(fetched / size)
        self.metrics.start_fetch_wait_seconds.observe(delta("wait_s"))
        if reads:
            self.metrics.start_hit_ratio.observe(delta("hits") / reads)

    async def signal(self, sandbox_id: str, req: SignalRequest) -> dict[str, Any]:
        """Send ``req.signal`` to one exec or to every running exec of the sandbox; returns
        ``{"exec_ids": [ids signalled]}``. With ``all`` (SIGKILL only) every workload process
        of the sandbox is killed, also those no exec lists any more (daemonized leftovers,
        fork bombs): see :meth:`kill_processes`; returns ``{"exec_ids": [...], "killed":
        n}``. A paused sandbox is resumed first."""
        rec = self.get(sandbox_id)
        rec.require(State.RUNNING, State.PAUSED, op="signal")
        rec = await self._awake(sandbox_id, "signal")
        self.reclaimer.woke(sandbox_id)
        execs = self._execs.get(sandbox_id, {})
        if req.all:
            running = list(execs)
            return {"exec_ids": running, "killed": await self.kill_processes(sandbox_id)}
        if req.exec_id is not None:
            if req.exec_id not in execs:
                raise NotFound(f"sandbox {sandbox_id}: no running exec {req.exec_id}")
            targets = [req.exec_id]
        else:
            targets = list(execs)
        for t in targets:
            await execs[t].signal(req.signal)
        rec.touch()
        return {"exec_ids": targets}

    def exec_handle(self, sandbox_id: str, exec_id: int) -> ExecHandle:
        """The running exec ``exec_id`` of the sandbox (NotFound if none): for its stdin
        and its pseudo-terminal's size, from requests other than the one streaming it."""
        handle = self._execs.get(self.get(sandbox_id).id, {}).get(exec_id)
        if handle is None or handle.ended:
            raise NotFound(f"sandbox {sandbox_id}: no running exec {exec_id}")
        return handle

    async def kill_processes(self, sandbox_id: str) -> int:
        """SIGKILL every workload process of a running sandbox (the sandbox stays up); for a
        grader that must not race what the agent left running. Returns how many were
        killed. Raises NotFound, InvalidState (not running), BackendError."""
        rec = self.get(sandbox_id)
        rec.require(State.RUNNING, op="kill processes")
        n = await self.backend_of(sandbox_id).kill_processes(sandbox_id)
        rec.touch()
        return n

    async def _file_ops(self, sandbox_id: str, op: str) -> FileOps:
        """The backend of a running sandbox (a paused one resumed) as :class:`FileOps`;
        BadRequest if its backend has none."""
        rec = await self._awake(sandbox_id, op)
        self.reclaimer.woke(sandbox_id)
        rec.touch()
        backend = self.backend_of(sandbox_id)
        if not isinstance(backend, FileOps):
            raise BadRequest(f"sandbox {sandbox_id}: the {backend.name} backend cannot {op}")
        return backend

    async def list_dir(self, sandbox_id: str, path: str, depth: int = 1) -> list[FileInfo]:
        """Entries below ``path`` (see :class:`FileOps`)."""
        _check_path(path)
        return await (await self._file_ops(sandbox_id, "list files")).list_dir(
            sandbox_id, path, depth)

    async def stat_path(self, sandbox_id: str, path: str) -> FileInfo:
        """The entry at ``path`` (see :class:`FileOps`)."""
        _check_path(path)
        return await (await self._file_ops(sandbox_id, "stat files")).stat_path(
            sandbox_id, path)

    async def make_dir(self, sandbox_id: str, path: str, *, parents: bool = True,
                       uid: int = 0, gid: int = 0) -> bool:
        """Make a directory; False if it already was one (see :class:`FileOps`)."""
        _check_path(path)
        return await (await self._file_ops(sandbox_id, "make directories")).make_dir(
            sandbox_id, path, parents=parents, uid=uid, gid=gid)

    async def remove_path(self, sandbox_id: str, path: str) -> None:
        """Remove a file, symlink or directory tree (see :class:`FileOps`)."""
        _check_path(path)
        await (await self._file_ops(sandbox_id, "remove files")).remove_path(sandbox_id, path)

    async def rename_path(self, sandbox_id: str, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (see :class:`FileOps`)."""
        _check_path(src)
        _check_path(dst)
        await (await self._file_ops(sandbox_id, "rename files")).rename_path(sandbox_id, src,
                                                                            dst)

    async def put_file(self, sandbox_id: str, path: str, data: AsyncIterator[bytes],
                       mode: int = 0o644, uid: int = 0, gid: int = 0,
                       parents: bool = False) -> int:
        """Stream ``data`` into ``path`` in a running sandbox; returns bytes written.
        ``parents``: make its missing parent directories first (owned by ``uid``/``gid``)."""
        _check_path(path)
        rec = await self._awake(sandbox_id, "write files")
        self.reclaimer.woke(sandbox_id)
        rec.touch()
        parent = os.path.dirname(os.path.normpath(path))
        backend = self.backend_of(sandbox_id)
        if parents and parent != "/" and isinstance(backend, FileOps):
            # (a backend without directory operations writes where the parent exists)
            await backend.make_dir(sandbox_id, parent, uid=uid, gid=gid)
        return await self.backend_of(sandbox_id).put_file(sandbox_id, path, data, mode=mode,
                                                          uid=uid, gid=gid)

    async def get_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """Open ``path`` in a running sandbox; returns an iterator of its chunks."""
        _check_path(path)
        rec = await self._awake(sandbox_id, "read files")
        self.reclaimer.woke(sandbox_id)
        rec.touch()
        return await self.backend_of(sandbox_id).get_file(sandbox_id, path)

    async def snapshot(self, sandbox_id: str, *, kind: str = "workspace",
                       exclude: list[str] | None = None,
                       image: str | None = None) -> dict[str, Any]:
        """The sandbox's disk changes (its upper: files added and changed, deletions as
        whiteouts, opaque directories) as a new layer in the node's store, so that the
        sandbox's layers + [digest] start new sandboxes with them (DSec §6.1's pack_diff).
        The sandbox is frozen while its upper is read and written out, then thawed (a
        paused one stays paused). ``exclude``: path patterns left out (see
        :func:`layerfs.sources.upper.compile_excludes`); ``image``: also register
        ``layers + [digest]`` under this name. Returns ``{"digest", "size", "kind",
        "layers", "frozen_s", ...counts}``. Raises NotFound, InvalidState (not running or
        paused), BadRequest (a backend or node that cannot snapshot, an entry a layer
        cannot hold, a bad pattern), BackendError."""
        rec = self.get(sandbox_id)
        backend = self.backend_of(sandbox_id)
        add = self.layers.ops.add_upper
        if not isinstance(backend, SnapshotSource):
            raise BadRequest(f"sandbox {sandbox_id}: the {backend.name} backend cannot "
                             f"snapshot")
        if add is None:
            raise BadRequest("snapshot: the node loads layers from a remote it cannot add "
                             "to (layers_remote); snapshots need a store of its own")
        if image is not None:
            check_ref(image)
        async with self._lock(sandbox_id):
            rec.require(State.RUNNING, State.PAUSED, op="snapshot")
            frozen_here = rec.state is State.RUNNING
            upper = backend.upper_dir(sandbox_id)
            t0 = time.monotonic()
            if frozen_here:
                await backend.pause(sandbox_id)
            try:
                out = await asyncio.to_thread(add, upper, kind, list(exclude or ()))
            finally:
                frozen_s = time.monotonic() - t0
                if frozen_here:
                    await backend.resume(sandbox_id)
            rec.touch()
        out["layers"] = [*rec.layers, out["digest"]]
        out["frozen_s"] = frozen_s
        if image is not None:
            self.images.put(image, out["layers"])
            out["image"] = image
        log.info("sandbox snapshot", extra={"sandbox": sandbox_id, "digest": out["digest"],
                                            "bytes": out["size"], "frozen_s": frozen_s})
        return out

    # -- reaping, recovery, shutdown ------------------------------------------------------

    async def reap_once(self, now: float | None = None) -> list[str]:
        """Stop every sandbox whose TTL or idle timeout passed; returns their ids. Pauses
        running sandboxes idle for their ``auto_pause_after_s``."""
        now = time.time() if now is None else now
        done = []
        nxt = now + REAP_SCAN_MAX_S
        pokes = self._reap_pokes
        for rec in list(self._sandboxes.values()):
            if rec.state not in (State.RUNNING, State.PAUSED):
                continue
            due = rec.reap_due(now)
            if due is not None and due > now:
                nxt = min(nxt, due)
                continue
            why = rec.expired(now)
            if why is None:
                if (rec.state is State.RUNNING and rec.auto_pause_after_s > 0
                        and rec.idle_for(now) >= rec.auto_pause_after_s):
                    try:
                        await self.pause(rec.id, cause="auto")
                    except EdgedError as e:
                        log.warning("auto-pause: sandbox %s: %s", rec.id, e)
                        nxt = now  # tried again at the next tick
                continue
            try:
                await self.delete(rec.id, cause=why)
                done.append(rec.id)
            except EdgedError as e:
                log.warning("reaper: sandbox %s: %s", rec.id, e)
                nxt = now
        # a deadline that came earlier during the scan: scan again at the next tick
        self._reap_next = nxt if self._reap_pokes == pokes else 0.0
        return done

    def _reap_soon(self) -> None:
        """A sandbox's deadline may have come earlier (a new one, a new timeout): the reaper
        scans at its next tick."""
        self._reap_pokes += 1
        self._reap_next = 0.0

    async def _reap_forever(self) -> None:
        """Every ``reaper_interval_s``, a scan if one may be due: the earliest of the
        sandboxes' :meth:`SandboxRecord.reap_due` at the last scan, at most
        ``REAP_SCAN_MAX_S`` later (3,200 idle sandboxes' records were read every second)."""
        while True:
            await asyncio.sleep(self.config.reaper_interval_s)
            if time.time() < self._reap_next:
                continue
            try:
                await self.reap_once()
            except Exception:
                log.exception("reaper pass failed")

    def start_reaper(self) -> None:
        """Run :meth:`reap_once` every ``reaper_interval_s`` and the reclaim passes until
        :meth:`stop_reaper`."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        self.reclaimer.start()

    async def stop_reaper(self) -> None:
        """Stop the reaper and reclaim tasks."""
        await self.reclaimer.stop()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    async def recover(self) -> dict[str, list[str]]:
        """After a (re)start: read the persisted records, ask each backend which sandboxes
        live, re-adopt (``on_start = "adopt"``) or destroy them, forget records of dead ones
        (and of backends not running here), then let each backend clean its leftovers, warm
        it up, and unmount layers no sandbox holds. Returns ``{"adopted", "destroyed",
        "lost", "cleaned", "layers_unmounted"}`` lists."""
        self.features = await self.backends.probe()
        live = {name: set(await self.backends.get(name).list_existing())
                for name in self.backends.names()}
        records: dict[str, SandboxRecord] = {}
        if self.records_dir.is_dir():
            for p in sorted(self.records_dir.glob("*.json")):
                try:
                    rec = SandboxRecord.from_json(json.loads(p.read_text()))
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("dropping unreadable sandbox record %s: %s", p, e)
                    p.unlink(missing_ok=True)
                    continue
                records[rec.id] = rec
        out: dict[str, list[str]] = {"adopted": [], "destroyed": [], "lost": [], "cleaned": [],
                                     "layers_unmounted": []}
        for sid, rec in records.items():
            if rec.backend not in live:
                log.warning("sandbox %s: its backend %r does not run here; record dropped",
                            sid, rec.backend)
                out["lost"].append(sid)
                (self.records_dir / f"{sid}.json").unlink(missing_ok=True)
                continue
            backend = self.backends.get(rec.backend)
            alive = sid in live[rec.backend]
            if alive and rec.state in (State.RUNNING, State.PAUSED) \
                    and self.config.on_start == "adopt":
                try:
                    await backend.adopt(sid)
                    if rec.network != "none" and self.net is not None:
                        await self.net.adopt(sid)
                    await self.layers.acquire_all(rec.layers, backend.layer_form)
                    self.capacity.hold(sid, rec.resources)
                    rec.touch()
                    self._sandboxes[sid] = rec
                    self._reap_soon()
                    if self.ledger is not None:  # its events: [] if it had none, not 404
                        self.ledger.sandbox_created(sid)
                    self._save_quietly(rec)
                    out["adopted"].append(sid)
                    continue
                except EdgedError as e:
                    log.warning("cannot adopt %s: %s", sid, e)
            if alive:
                with contextlib.suppress(EdgedError):
                    await backend.destroy(sid)
                out["destroyed"].append(sid)
            else:
                out["lost"].append(sid)
            (self.records_dir / f"{sid}.json").unlink(missing_ok=True)
        for name, ids in live.items():
            backend = self.backends.get(name)
            for sid in sorted(ids - set(records)):
                if self.config.on_start == "destroy":
                    with contextlib.suppress(EdgedError):
                        await backend.destroy(sid)
                    out["destroyed"].append(sid)
            keep = {s for s in out["adopted"] if records[s].backend == name}
            out["cleaned"] += await backend.cleanup_leftovers(keep)
        if self.net is not None:
            await self.net.forget_unadopted(set(out["adopted"]))
        await self.backends.warm()  # e.g. the container backend's spawner pool
        out["layers_unmounted"] = await self.layers.sweep()
        self._update_gauges()
        return out

    async def shutdown(self, timeout_s: float, overrun_s: float = 0.0) -> None:
        """Stop the reaper; with ``on_shutdown = "stop"`` destroy every sandbox and unmount
        every layer, and stop the layer source; with ``"keep"`` leave them running for the
        next daemon to re-adopt.

        Destroys still under way after ``timeout_s`` seconds (slow under load: a throttled
        sandbox takes long to die) are not cut short, which would leave the sandboxes, their
        layer mounts and the lazy server behind: they are waited for up to ``overrun_s``
        seconds more (each destroy is bounded itself). Only sandboxes still there after that
        are left, and the layers they use with them (logged as an error)."""
        await self.stop_reaper()
        await self._flush_background()
        if self.config.on_shutdown != "stop":
            await self.layers.leave()
            return
        # Every record, whatever its state: one being created or deleted is waited for (its
        # lock), then stopped if it still exists; none is left running because a save or
        # an earlier destroy failed.
        ids = list(self._sandboxes)

        async def stop(sid: str) -> None:
            try:
                await self.delete(sid, cause="shutdown")
            except NotFound:
                pass  # its create failed, or a delete finished meanwhile
            except EdgedError as e:
                log.warning("shutdown: sandbox %s: %s", sid, e)

        tasks = [asyncio.ensure_future(stop(s)) for s in ids]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending and overrun_s > 0:
                log.warning("shutdown: %d sandboxes still stopping after %.1f s: waiting up "
                            "to %.0f s more", len(pending), timeout_s, overrun_s)
                _, pending = await asyncio.wait(pending, timeout=overrun_s)
            if pending:
                log.error("shutdown: %d sandboxes still stopping after %.1f s: left running "
                          "with their layers", len(pending), timeout_s + overrun_s)
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending)
            for t in tasks:
                if not t.cancelled() and t.exception() is not None:
                    log.error("shutdown: stopping a sandbox: %r", t.exception())
        await self._flush_background()
        if not self._sandboxes:
            await self.layers.close()
        else:
            await self.layers.leave()

    def node_info(self) -> dict[str, Any]:
        """``GET /v1/node``: capacity, allocations, states, layer mounts, the backends (the
        default's probed features also as ``features``);
        measured memory (host, sandboxes, swap, kernel overhead per sandbox), pressure
        (PSI), what reclaim can get back and has, and the free capacity in sandbox-sized
        units that placement reads (see :meth:`Admission.snapshot`)."""
        info = self.capacity.to_json()
        counts: dict[str, int] = {}
        for r in self._sandboxes.values():
            counts[r.state.value] = counts.get(r.state.value, 0) + 1
        info["sandboxes"] = counts
        info["backend"] = self.backends.default
        info["features"] = dict(self.features.get(self.backends.default, {}))
        info["features"]["network"] = self.net.features if self.net is not None else {
            "enabled": False, "reason": "network_pool is empty"}
        info["backends"] = {
            name: {"layer_form": self.backends.get(name).layer_form,
                   "features": self.features.get(name, {})}
            for name in self.backends.names()}
        info["layers"] = self.layers.refs()
        info.update(self.admission.snapshot())
        rt = self.reclaimer.totals()
        info["reclaim"] = {
            "enabled": self.config.reclaim and self.reclaimer.supported,
            "idle_after_s": self.config.idle_after_s,
            "budget_bytes": self.reclaimer.budget,
            "refault_pct_per_min": self.reclaimer.refault_rate(),
            "swap_full_sandboxes": self.reclaimer.swap_full,
            "rate_bytes_per_s": self.reclaimer.rate(),
            **rt,
        }
        info["swap"] = (self.swap.features() | self.swap.usage()) if self.swap else None
        return info


def _gone_how(e: BaseException) -> str:
    """How an exec's caller went away, from what ended its stream: ``cancelled`` (e.g. an
    ``asyncio.wait_for`` timeout), ``disconnected`` (the client's connection closed or
    broke, however the transport says so), or the error's type."""
    if isinstance(e, asyncio.CancelledError):
        return "cancelled"
    if isinstance(e, ConnectionError):
        return "disconnected"
    return f"error: {type(e).__name__}"


def _check_path(path: str) -> None:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise BadRequest(f"path {path!r}: must be an absolute path without NUL")


class _ByRecord:
    """The memory side of every backend, each sandbox's through the backend its record
    names: what the node's reclaim (:class:`~edged.node.reclaim.Reclaimer`) drives."""

    def __init__(self, manager: SandboxManager) -> None:
        self._m = manager

    @property
    def can_reclaim(self) -> bool:
        return any(b.can_reclaim for b in self._m.backends)

    async def memory(self, sandbox_id: str) -> MemoryUsage:
        return await self._m.backend_of(sandbox_id).memory(sandbox_id)

    async def reclaim(self, sandbox_id: str, nbytes: int | None) -> int:
        b = self._m.backend_of(sandbox_id)
        return await b.reclaim(sandbox_id, nbytes) if b.can_reclaim else 0


class NodeHost:
    """The node as a backend whose sandboxes are another backend's sees it
    (:class:`~edged.backends.base.SandboxHost`): FnCall's pool sandboxes are container
    sandboxes made through the manager like any other (admitted, given their layers,
    recorded, their security events in the ledger), so nothing of the container backend or
    of the node's bookkeeping is done twice."""

    def __init__(self, manager: SandboxManager) -> None:
        self._m = manager

    async def create_sandbox(self, *, backend: str, layers: tuple[str, ...], image: str | None,
                             resources: Resources, task_profile: str, qos: str,
                             labels: Mapping[str, str]) -> str:
        req = CreateRequest(backend=backend, image=image,
                            layers=None if image is not None else tuple(layers),
                            resources=dict(resources.__dict__), labels=dict(labels),
                            task_profile=task_profile, qos=qos, ttl_s=0.0, idle_timeout_s=0.0,
                            auto_pause_after_s=0.0)
        return (await self._m.create(req)).id

    async def delete_sandbox(self, sandbox_id: str) -> None:
        with contextlib.suppress(NotFound):
            await self._m.delete(sandbox_id, cause="recycled")

    def sandboxes(self, label: str) -> list[str]:
        return [r.id for r in self._m.find() if label in r.labels]

    def backend_of(self, sandbox_id: str) -> Backend:
        return self._m.backend_of(sandbox_id)

    def image_layers(self, ref: str) -> tuple[str, ...]:
        return tuple(self._m.images.get(ref)["layers"])

    def event_seq(self) -> int:
        return self._m.ledger.last_seq if self._m.ledger is not None else 0

    def event_kinds(self, sandbox_id: str, since: int) -> list[str]:
        if self._m.ledger is None:
            return []
        try:
            return [e.kind for e in self._m.ledger.events(sandbox_id, since=since)]
        except NotFound:
            return []
