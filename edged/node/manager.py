"""The sandbox manager: the daemon's one owner of sandbox state.

It validates requests, admits them against :class:`~edged.node.admission.Capacity`, mounts
their layers once per node (:class:`~edged.images.LayerMounts`), drives the backend, keeps each
record's state machine, persists records atomically in ``<state_dir>/sandboxes/<id>.json``,
reaps sandboxes whose TTL or idle timeout passed, and re-adopts or tears down sandboxes found
after a restart. Every failure path gives back what was taken (reservation, layer mounts,
backend resources): bad input never leaves partial state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import signal as signal_mod
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from edged.backends.base import (
    QOS_CLASSES,
    Backend,
    ExecHandle,
    ExecSpec,
    MemoryUsage,
    Resources,
    SandboxSpec,
)
from edged.config import Config
from edged.errors import BackendError, BadRequest, Conflict, EdgedError, InvalidState, NotFound
from edged.images.mounts import LayerCounters, LayerMounts
from edged.images.registry import ImageRegistry, check_digest
from edged.metrics import Metrics
from edged.node.admission import Admission, Capacity, Usage
from edged.node.reclaim import ReclaimConfig, Reclaimer
from edged.node.sandbox import LABEL_KEY_RE, SandboxRecord, State, check_id
from edged.node.swap import SwapManager
from edged.security.ledger import Ledger

log = logging.getLogger("edged.node")

#: The documented ranges of every numeric request field (openapi.json states the same), checked
#: in one place: finite numbers, integers where integers; anything else is a 400 naming the
#: field, never an overflow further down (C structs hold u64 milliseconds and bytes).
MAX_SECONDS = 31_536_000.0  # one year: timeouts, TTLs
MAX_BYTES = 1 << 50
#: resources: (kind, minimum, maximum). The minimums are what a sandbox needs to start and run
#: one exec (sbx-init, its spare exec child and the exec: a few pids, a few MiB).
_RESOURCE_FIELDS: dict[str, tuple[type, float, float]] = {
    "cpus": (float, 0.01, 1024.0),
    "memory_bytes": (int, 16 << 20, MAX_BYTES),
    "swap_bytes": (int, 0, MAX_BYTES),
    "pids": (int, 8, 4_194_304),
    "disk_bytes": (int, 1 << 20, MAX_BYTES),
    "memory_request_bytes": (int, 0, MAX_BYTES),
}
_CREATE_FIELDS = {
    "id", "backend", "image", "layers", "resources", "env", "ttl_s", "idle_timeout_s",
    "labels", "network", "hostname", "task_profile", "seccomp_profile", "qos",
    "auto_pause_after_s",
}
_PROFILE_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}\Z")


def _profile_name(v: object, what: str, default: str | None) -> str | None:
    """A profile name from a request: a bare name (never a path, so a client cannot make the
    daemon read a file of its choosing), loaded and validated now so a bad profile is a 400
    before anything is created."""
    if v is None:
        return default
    if not isinstance(v, str) or not _PROFILE_NAME.match(v):
        raise BadRequest(f"{what}: must be a profile name matching [a-z0-9][a-z0-9_.-]{{0,62}}")
    from edged.security import seccomp, tasks

    if what == "task_profile":
        seccomp.load(tasks.load(v).seccomp)
    else:
        seccomp.load(v)
    return v



def _str_map(v: object, what: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items()
    ):
        raise BadRequest(f"{what}: must be an object of string to string")
    return dict(v)


def _flag(v: object, what: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{what}: must be true or false")
    return v


def _number(v: object, what: str, *, minimum: float = 0.0,
            maximum: float = MAX_SECONDS) -> float:
    """A finite number in [minimum, maximum] (JSON has no NaN or Infinity; Python's parser
    accepts them, and 1e400 parses as inf)."""
    if (isinstance(v, bool) or not isinstance(v, int | float)
            or not math.isfinite(v) or not minimum <= v <= maximum):
        raise BadRequest(f"{what}: must be a number in [{minimum:g}, {maximum:g}]")
    return float(v)


def _integer(v: object, what: str, *, minimum: int, maximum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise BadRequest(f"{what}: must be an integer in [{minimum}, {maximum}]")
    return v


def _env(v: object, what: str) -> dict[str, str]:
    """Environment variables: names non-empty without '=' or NUL, values without NUL."""
    env = _str_map(v, what)
    for k, x in env.items():
        if not k or "=" in k or "\0" in k:
            raise BadRequest(f"{what}: bad variable name {k!r}")
        if "\0" in x:
            raise BadRequest(f"{what}.{k}: NUL in the value")
    return env


def parse_resources(v: object, default: Resources) -> Resources:
    """``{"cpus", "memory_bytes", "swap_bytes", "pids", "disk_bytes",
    "memory_request_bytes"}`` (each optional) over ``default``; :class:`BadRequest` names a
    bad field. A request above the limit is refused; one not given is the default's, at
    most the limit."""
    if v is None:
        v = {}
    if not isinstance(v, dict):
        raise BadRequest("resources: must be an object")
    vals: dict[str, Any] = {}
    for k, x in v.items():
        field = _RESOURCE_FIELDS.get(k)
        if field is None:
            raise BadRequest(f"resources.{k}: unknown field")
        kind, lo, hi = field
        if kind is int:
            vals[k] = _integer(x, f"resources.{k}", minimum=int(lo), maximum=int(hi))
        else:
            vals[k] = _number(x, f"resources.{k}", minimum=lo, maximum=hi)
    res = Resources(**{**default.__dict__, **vals})
    if "memory_request_bytes" not in vals:
        res = dataclasses.replace(res, memory_request_bytes=min(res.memory_request_bytes,
                                                                res.memory_bytes))
    elif res.memory_request_bytes > res.memory_bytes:
        raise BadRequest("resources.memory_request_bytes: must be at most memory_bytes")
    return res


def parse_labels(v: object) -> dict[str, str]:
    """Labels: string → string, keys ``[A-Za-z0-9][A-Za-z0-9_./-]{0,62}``, values ≤ 256."""
    labels = _str_map(v, "labels")
    for k, x in labels.items():
        if not LABEL_KEY_RE.fullmatch(k):
            raise BadRequest(f"labels: key {k!r} must match [A-Za-z0-9][A-Za-z0-9_./-]{{0,62}}")
        if len(x) > 256:
            raise BadRequest(f"labels.{k}: value longer than 256 characters")
    return labels


class SandboxManager:
    """Owns every :class:`SandboxRecord` of this node. One per daemon."""

    def __init__(
        self,
        config: Config,
        backend: Backend,
        images: ImageRegistry,
        layers: LayerMounts,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        backend.on_failure = self._sandbox_failed
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
        self.reclaimer = Reclaimer(
            ReclaimConfig(enabled=config.reclaim, idle_after_s=config.idle_after_s,
                          idle_cpu=config.idle_cpu, interval_s=config.reclaim_interval_s,
                          rate_bytes=config.reclaim_rate_bytes,
                          psi_target=config.reclaim_psi_target,
                          low_bytes=2 * config.memory_reserve()),
            backend, self._running_records, on_reclaimed=self._reclaimed,
            ensure_swap=self._ensure_swap)
        self.admission = Admission(
            self.capacity, reserve_bytes=config.memory_reserve(),
            memory_pressure_limit=config.memory_pressure_limit,
            cpu_pressure_limit=config.cpu_pressure_limit,
            window_s=config.admission_window_s, usage=self._usage,
            reclaimable=self._reclaimable, reclaim_retry_s=config.reclaim_interval_s)
        self.records_dir = Path(config.state_dir) / "sandboxes"
        self._sandboxes: dict[str, SandboxRecord] = {}
        self._execs: dict[str, dict[int, ExecHandle]] = {}
        #: sandbox -> {layer: counters} at create, until its first exec ends
        #: (see Metrics.start_fetched_fraction)
        self._starts: dict[str, dict[str, LayerCounters]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: layer -> timer: a reference kept for ``layer_linger_s`` after the last sandbox
        #: using the layer is gone, so that the next create finds it mounted (and its page
        #: cache warm) instead of paying a mount, an unmount and cold reads
        self._linger: dict[str, asyncio.TimerHandle] = {}
        self._bg: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self.features: dict[str, object] = {}
        #: the security-event ledger (set by the daemon; None: events are not kept)
        self.ledger: Ledger | None = None
        self.default_resources = Resources()

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

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _release_layers(self, digests: list[str]) -> None:
        """Drop a sandbox's layer references, top first. The last reference to a layer is
        kept for ``layer_linger_s`` (see ``_linger``); a release error is logged."""
        loop = asyncio.get_running_loop()
        linger = self.config.layer_linger_s
        for d in reversed(digests):
            held = self._linger.pop(d, None)
            if held is not None:
                held.cancel()
            if linger > 0:
                self._linger[d] = loop.call_later(linger, self._unlinger, d)
                if held is None:
                    continue  # this sandbox's reference becomes the lingering one
            try:
                await self.layers.release(d)
            except EdgedError as e:
                log.warning("layer release failed: %s", e)

    def _unlinger(self, digest: str) -> None:
        if self._linger.pop(digest, None) is not None:
            self._background(self._release_layer(digest))

    async def _release_layer(self, digest: str) -> None:
        try:
            await self.layers.release(digest)
        except EdgedError as e:
            log.warning("layer release failed: %s", e)

    def lingering(self) -> list[str]:
        """Layers held only because they were used recently (``layer_linger_s``)."""
        return sorted(self._linger)

    async def _flush_background(self) -> None:
        """Release the lingering layer references and wait for background work."""
        for d in list(self._linger):
            self._linger.pop(d).cancel()
            await self._release_layer(d)
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    def _running_records(self) -> list[SandboxRecord]:
        return [r for r in self._sandboxes.values() if r.state is State.RUNNING]

    def _ensure_swap(self) -> bool:
        return self.swap.ensure() if self.swap is not None else False

    def _reclaimed(self, sandbox_id: str, nbytes: int) -> None:
        self.metrics.reclaimed_bytes.inc(nbytes)

    def _usage(self) -> Usage:
        """The sandboxes' own memory: their cgroups together and our zram device."""
        totals = getattr(self.backend, "totals", None)
        use = totals() if callable(totals) else MemoryUsage()
        z = self.swap.zram_stats() if self.swap is not None else None
        return Usage(resident=use.resident_bytes, swap=use.swap_bytes,
                     zram=z["mem_used_bytes"] if z else 0)

    def _swap_ratio(self) -> float:
        """Observed compression of what is in our zram device (2.5 before anything is; 1.0
        for the host's swap, which may be disk)."""
        z = self.swap.zram_stats() if self.swap is not None else None
        if z is None:
            return 2.5 if self.swap is not None and self.swap.zram is not None else 1.0
        if z["orig_bytes"] < (64 << 20) or z["mem_used_bytes"] <= 0:
            return 2.5
        return z["orig_bytes"] / z["mem_used_bytes"]

    def _reclaimable(self) -> int:
        """What reclaim can free now, bounded by the swap left to page into."""
        if not self.config.reclaim or self.swap is None:
            return 0
        use = self.swap.usage()
        room = use["total_bytes"] - use["used_bytes"]
        z_limit, z_used = use.get("zram_mem_limit_bytes", 0), use.get("zram_mem_used_bytes", 0)
        ratio = self._swap_ratio()
        if z_limit:
            room = min(room, int((z_limit - z_used) * ratio))
        return max(0, min(self.reclaimer.reclaimable(ratio), int(room * (1 - 1 / ratio))))

    def _forget(self, rec: SandboxRecord, cause: str) -> None:
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

    # -- lifecycle ------------------------------------------------------------------------

    def parse_create(self, body: object) -> SandboxRecord:
        """Validate a ``POST /v1/sandboxes`` body into a fresh record (state ``creating``, not
        yet registered). :class:`BadRequest` names the first bad field; :class:`NotFound` for
        an unknown image."""
        if not isinstance(body, dict):
            raise BadRequest("body: must be a JSON object")
        unknown = set(body) - _CREATE_FIELDS
        if unknown:
            raise BadRequest(f"body: unknown field {sorted(unknown)[0]!r}")
        backend = body.get("backend", self.backend.name)
        if backend != self.backend.name:
            raise BadRequest(f"backend: {backend!r} is not available (have {self.backend.name!r})")
        sid = body.get("id")
        if sid is None:
            sid = f"sbx-{time.time_ns():x}"[:63]
            while sid in self._sandboxes:
                sid = f"sbx-{time.time_ns():x}"[:63]
        check_id(sid)
        image = body.get("image")
        layers_v = body.get("layers")
        if (image is None) == (layers_v is None):
            raise BadRequest("body: give exactly one of image or layers")
        if image is not None:
            layers = list(self.images.get(image)["layers"])
        else:
            if not isinstance(layers_v, list) or not 1 <= len(layers_v) <= 64:
                raise BadRequest("layers: must be a list of 1 to 64 digests, bottom first")
            layers = [check_digest(d) for d in layers_v]
        network = body.get("network", "none")
        if network != "none":
            raise BadRequest(f"network: {network!r} is not supported (only 'none')")
        hostname = body.get("hostname", sid)
        if not isinstance(hostname, str) or not 1 <= len(hostname) <= 63:
            raise BadRequest("hostname: must be a string of 1 to 63 characters")
        task_profile = _profile_name(body.get("task_profile"), "task_profile", "default")
        seccomp_profile = _profile_name(body.get("seccomp_profile"), "seccomp_profile", None)
        ttl = body.get("ttl_s", self.config.default_ttl_s)
        idle = body.get("idle_timeout_s", self.config.default_idle_timeout_s)
        qos = body.get("qos", "best_effort")
        if qos not in QOS_CLASSES:
            raise BadRequest(f"qos: must be one of {', '.join(QOS_CLASSES)}")
        auto_pause = _number(body.get("auto_pause_after_s",
                                      self.config.default_auto_pause_after_s),
                             "auto_pause_after_s")
        rec = SandboxRecord(
            id=sid,
            backend=backend,
            layers=layers,
            resources=parse_resources(body.get("resources"), self.default_resources),
            env=_env(body.get("env"), "env"),
            labels=parse_labels(body.get("labels")),
            image=image,
            network=network,
            hostname=hostname,
            idle_timeout_s=_number(idle, "idle_timeout_s"),
            task_profile=task_profile or "default",
            seccomp_profile=seccomp_profile,
            qos=qos,
            auto_pause_after_s=auto_pause,
        )
        rec.set_ttl(_number(ttl, "ttl_s"))
        return rec

    async def create(self, body: object) -> SandboxRecord:
        """Create a sandbox from a request body and return its record once ``running``.

        Raises :class:`BadRequest`, :class:`NotFound` (image or layer), :class:`Conflict` (id
        in use), :class:`CapacityExhausted` (with ``retry_after``), :class:`BackendError`. On
        any failure nothing is left: reservation, layer mounts and backend state are undone.
        """
        rec = self.parse_create(body)
        if rec.id in self._sandboxes:
            raise Conflict(f"sandbox {rec.id}: id already in use")
        t0 = time.monotonic()
        self.admission.admit(rec.id, rec.resources)
        self._sandboxes[rec.id] = rec
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
                rec.lowers = await self.layers.acquire_all(rec.layers)
                try:
                    self._save(rec)
                    spec = SandboxSpec(
                        id=rec.id,
                        lowers=tuple(rec.lowers),
                        resources=rec.resources,
                        env=dict(rec.env),
                        hostname=rec.hostname,
                        network=rec.network,
                        task_profile=rec.task_profile,
                        seccomp_profile=rec.seccomp_profile,
                        qos=rec.qos,
                    )
                    try:
                        await self.backend.create(spec)
                    except BaseException:
                        with contextlib.suppress(Exception):
                            await self.backend.destroy(rec.id)
                        raise
                except BaseException:
                    await self._release_layers(rec.layers)
                    raise
                rec.transition(State.RUNNING)
                rec.touch()
                self._save(rec)
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
        """Stop and remove a sandbox (any state but ``stopping``); returns its final record
        (state ``stopped``). If the backend fails the record stays as ``failed`` with the
        error, and a later delete retries."""
        rec = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            if self._sandboxes.get(sandbox_id) is not rec:
                raise NotFound(f"sandbox {sandbox_id}: no such sandbox")
            rec.require(State.RUNNING, State.PAUSED, State.FAILED, op="delete")
            rec.transition(State.STOPPING)
            self._save(rec)
            try:
                await self.backend.destroy(sandbox_id)
            except Exception as e:
                log.warning("sandbox %s: destroy failed: %s", sandbox_id, e,
                            extra={"sandbox": sandbox_id})
                rec.state = State.FAILED
                rec.error = f"destroy failed: {e}"
                self._save(rec)
                self._update_gauges()
                if isinstance(e, EdgedError):
                    raise
                raise BackendError(f"sandbox {sandbox_id}: destroy failed: {e}") from e
            await self._release_layers(rec.layers)
            rec.transition(State.STOPPED)
            self._forget(rec, "deleted" if cause == "api" else cause)
        self.metrics.destroys.labels(cause=cause).inc()
        log.info("sandbox stopped", extra={"sandbox": sandbox_id, "cause": cause})
        return rec

    async def pause(self, sandbox_id: str, cause: str = "api") -> SandboxRecord:
        """Freeze a running sandbox (:class:`InvalidState` otherwise) and, with
        ``pause_reclaim``, page its memory out to swap (DSec §5.2: freeze, swap, reclaim; a
        reclaim failure is logged, the sandbox stays paused). ``cause``: ``api`` or ``auto``
        (``auto_pause_after_s``)."""
        rec = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            rec.require(State.RUNNING, op="pause")
            await self.backend.pause(sandbox_id)
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
            prefetch = getattr(self.backend, "prefetch", None)
            if callable(prefetch) and self.reclaimer.woke(sandbox_id):
                try:
                    await prefetch(sandbox_id)
                except EdgedError as e:
                    log.warning("sandbox %s: prefetch before resume: %s", sandbox_id, e)
            await self.backend.resume(sandbox_id)
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

    def set_timeout(self, sandbox_id: str, body: object) -> SandboxRecord:
        """``{"ttl_s": s}`` (from now; 0 clears) and/or ``{"idle_timeout_s": s}``."""
        rec = self.get(sandbox_id)
        rec.require(State.RUNNING, State.PAUSED, op="set a timeout")
        if not isinstance(body, dict) or not body or set(body) - {"ttl_s", "idle_timeout_s"}:
            raise BadRequest("body: give ttl_s and/or idle_timeout_s")
        if "ttl_s" in body:
            rec.set_ttl(_number(body["ttl_s"], "ttl_s"))
        if "idle_timeout_s" in body:
            rec.idle_timeout_s = _number(body["idle_timeout_s"], "idle_timeout_s")
            rec.touch()
        self._save(rec)
        return rec

    async def stats(self, sandbox_id: str) -> dict[str, int]:
        """Backend usage figures of a running or paused sandbox."""
        rec = self.get(sandbox_id)
        rec.require(State.RUNNING, State.PAUSED, op="read stats")
        return await self.backend.stats(sandbox_id)

    # -- exec, signals, files -------------------------------------------------------------

    def exec_spec(self, sandbox_id: str, body: object) -> ExecSpec:
        """Validate an exec body into an :class:`ExecSpec` (env merged over the sandbox's).

        Body: ``argv`` (list of strings) or ``cmd`` (a string run by ``/bin/sh -c``), ``env``,
        ``cwd``, ``uid``, ``gid``, ``timeout_s``, ``output_limit``, ``pty``, ``stdin`` (bool:
        keep stdin open for a WebSocket; text: fed then closed) and ``encoding``.
        """
        rec = self.get(sandbox_id)
        if not isinstance(body, dict):
            raise BadRequest("body: must be a JSON object")
        known = {"argv", "cmd", "env", "cwd", "uid", "gid", "timeout_s", "output_limit", "pty",
                 "stdin", "encoding", "rows", "cols", "trusted", "kill_leftovers"}
        unknown = set(body) - known
        if unknown:
            raise BadRequest(f"body: unknown field {sorted(unknown)[0]!r}")
        argv_v, cmd = body.get("argv"), body.get("cmd")
        if (argv_v is None) == (cmd is None):
            raise BadRequest("body: give exactly one of argv or cmd")
        if cmd is not None:
            if not isinstance(cmd, str) or not cmd:
                raise BadRequest("cmd: must be a non-empty string")
            argv: tuple[str, ...] = ("/bin/sh", "-c", cmd)
        else:
            if (not isinstance(argv_v, list) or not argv_v
                    or not all(isinstance(a, str) and "\0" not in a for a in argv_v)):
                raise BadRequest("argv: must be a non-empty list of strings without NUL")
            argv = tuple(argv_v)
        trusted = _flag(body.get("trusted", False), "trusted")
        base_env = dict(rec.env)
        if trusted:
            # A grader trusts nothing the sandbox env could steer: the interpreter's
            # start-up hooks and the dynamic loader's; its HOME is the fresh empty /root
            # of its own view. What the request itself gives wins.
            base_env = {k: v for k, v in base_env.items()
                        if not k.startswith(("PYTHON", "LD_"))}
            base_env.update(PYTHONNOUSERSITE="1", HOME="/root")
        env = {**base_env, **_env(body.get("env"), "env")}
        cwd = body.get("cwd", "/")
        if not isinstance(cwd, str) or not cwd.startswith("/"):
            raise BadRequest("cwd: must be an absolute path")
        ids = {}
        for k in ("uid", "gid"):
            x = body.get(k, 0)
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 65536:
                raise BadRequest(f"{k}: must be an integer in [0, 65536)")
            ids[k] = x
        timeout = body.get("timeout_s")
        limit = body.get("output_limit")
        if limit is not None:
            _integer(limit, "output_limit", minimum=1, maximum=MAX_BYTES)
        pty = _flag(body.get("pty", False), "pty")
        for k in ("rows", "cols"):  # the PTY's size, refused before anything starts
            if k in body:
                _integer(body[k], k, minimum=1, maximum=65535)
        return ExecSpec(
            argv=argv,
            env=env,
            cwd=cwd,
            uid=ids["uid"],
            gid=ids["gid"],
            stdin=body.get("stdin") not in (None, False, ""),
            timeout_s=None if timeout is None else _number(timeout, "timeout_s", minimum=0.001),
            output_limit=limit,
            pty=pty,
            trusted=trusted,
            kill_leftovers=_flag(body.get("kill_leftovers", False), "kill_leftovers"),
        )

    @asynccontextmanager
    async def exec(self, sandbox_id: str, spec: ExecSpec) -> AsyncIterator[ExecHandle]:
        """Start ``spec`` in a running sandbox; yields the handle while the caller streams
        its events. Counts as activity (no idle reaping while an exec runs).

        An exec left before its end (the caller cancelled, e.g. a trainer's per-step
        timeout; its client disconnected; an error) is abandoned: its whole process tree is
        killed at once, its slot freed, and that is recorded once (``exec_abandoned`` in the
        ledger, one log line, ``edged_execs{reason="abandoned"}``), however it went."""
        rec = await self._awake(sandbox_id, "exec")
        reclaimed = self.reclaimer.woke(sandbox_id)
        t0 = time.monotonic()
        try:
            handle = await self.backend.exec(sandbox_id, spec)
        except asyncio.CancelledError:
            self._abandoned(sandbox_id, None, spec, "cancelled")  # the backend killed it
            raise
        if reclaimed:  # the first exec on a reclaimed sandbox: its wake
            self.metrics.wake_seconds.observe(time.monotonic() - t0)
        rec.active_execs += 1
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
            rec.active_execs -= 1
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
        what = str(cause.get("what", "the sandbox died"))
        known = [f"{k} {cause[k]}" for k in ("signal", "exit_status") if k in cause]
        if cause.get("oom_kill"):
            known.append("out of memory")
        rec.transition(State.FAILED)
        rec.error = f"{what} ({', '.join(known) or 'status unknown'})"
        log.warning("sandbox %s failed: %s", sandbox_id, rec.error,
                    extra={"sandbox": sandbox_id})
        if self.ledger is not None:
            self.ledger.record(sandbox_id, "sandbox_failed", detail={"cause": dict(cause)})
        try:
            self._save(rec)
        except OSError as e:
            log.warning("sandbox %s: cannot save its record: %s", sandbox_id, e)
        self._update_gauges()

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

    async def signal(self, sandbox_id: str, body: object) -> dict[str, Any]:
        """Send ``{"signal": int | "SIGTERM", "exec_id": optional}`` to one exec or to every
        running exec of the sandbox; returns ``{"exec_ids": [ids signalled]}``. With
        ``"all": true`` (SIGKILL only) every workload process of the sandbox is killed, also
        those no exec lists any more (daemonized leftovers, fork bombs): see
        :meth:`kill_processes`; returns ``{"exec_ids": [...], "killed": n}``."""
        rec = self.get(sandbox_id)
        rec.require(State.RUNNING, State.PAUSED, op="signal")
        if not isinstance(body, dict):
            raise BadRequest("body: must be a JSON object")
        unknown = set(body) - {"signal", "exec_id", "all"}
        if unknown:
            raise BadRequest(f"body: unknown field {sorted(unknown)[0]!r}")
        sig_v = body.get("signal", "SIGTERM")
        try:
            if isinstance(sig_v, str):
                sig = int(signal_mod.Signals[sig_v if sig_v.startswith("SIG") else "SIG" + sig_v])
            elif isinstance(sig_v, int) and not isinstance(sig_v, bool):
                sig = int(signal_mod.Signals(sig_v))
            else:
                raise ValueError(sig_v)
        except (KeyError, ValueError) as e:
            raise BadRequest(f"signal: {sig_v!r} is not a signal") from e
        kill_all = _flag(body.get("all", False), "all")
        rec = await self._awake(sandbox_id, "signal")  # a paused sandbox is resumed first
        self.reclaimer.woke(sandbox_id)
        execs = self._execs.get(sandbox_id, {})
        eid = body.get("exec_id")
        if kill_all:
            if sig != signal_mod.SIGKILL or eid is not None:
                raise BadRequest("all: only with signal 9 (SIGKILL) and without exec_id")
            running = list(execs)
            return {"exec_ids": running, "killed": await self.kill_processes(sandbox_id)}
        if eid is not None:
            if isinstance(eid, bool) or not isinstance(eid, int):
                raise BadRequest(f"exec_id: {eid!r} is not an integer")
            if eid not in execs:
                raise NotFound(f"sandbox {sandbox_id}: no running exec {eid}")
            targets = [eid]
        else:
            targets = list(execs)
        for t in targets:
            await execs[t].signal(sig)
        rec.touch()
        return {"exec_ids": targets}

    async def kill_processes(self, sandbox_id: str) -> int:
        """SIGKILL every workload process of a running sandbox (the sandbox stays up); for a
        grader that must not race what the agent left running. Returns how many were
        killed. Raises NotFound, InvalidState (not running), BackendError."""
        rec = self.get(sandbox_id)
        rec.require(State.RUNNING, op="kill processes")
        n = await self.backend.kill_processes(sandbox_id)
        rec.touch()
        return n

    async def put_file(self, sandbox_id: str, path: str, data: AsyncIterator[bytes],
                       mode: int = 0o644, uid: int = 0, gid: int = 0) -> int:
        """Stream ``data`` into ``path`` in a running sandbox; returns bytes written."""
        _check_path(path)
        rec = await self._awake(sandbox_id, "write files")
        self.reclaimer.woke(sandbox_id)
        rec.touch()
        return await self.backend.put_file(sandbox_id, path, data, mode=mode, uid=uid, gid=gid)

    async def get_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """Open ``path`` in a running sandbox; returns an iterator of its chunks."""
        _check_path(path)
        rec = await self._awake(sandbox_id, "read files")
        self.reclaimer.woke(sandbox_id)
        rec.touch()
        it: Any = self.backend.get_file(sandbox_id, path)
        if asyncio.iscoroutine(it):
            it = await it
        result: AsyncIterator[bytes] = it
        return result

    # -- reaping, recovery, shutdown ------------------------------------------------------

    async def reap_once(self, now: float | None = None) -> list[str]:
        """Stop every sandbox whose TTL or idle timeout passed; returns their ids. Pauses
        running sandboxes idle for their ``auto_pause_after_s``."""
        now = time.time() if now is None else now
        done = []
        for rec in list(self._sandboxes.values()):
            if rec.state not in (State.RUNNING, State.PAUSED):
                continue
            why = rec.expired(now)
            if why is None:
                if (rec.state is State.RUNNING and rec.auto_pause_after_s > 0
                        and rec.idle_for(now) >= rec.auto_pause_after_s):
                    try:
                        await self.pause(rec.id, cause="auto")
                    except EdgedError as e:
                        log.warning("auto-pause: sandbox %s: %s", rec.id, e)
                continue
            try:
                await self.delete(rec.id, cause=why)
                done.append(rec.id)
            except EdgedError as e:
                log.warning("reaper: sandbox %s: %s", rec.id, e)
        return done

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reaper_interval_s)
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
        """After a (re)start: read the persisted records, ask the backend which sandboxes
        live, re-adopt (``on_start = "adopt"``) or destroy them, forget records of dead ones,
        then let the backend clean leftovers and unmount layers no sandbox holds. Returns
        ``{"adopted", "destroyed", "lost", "cleaned", "layers_unmounted"}`` lists."""
        self.features = await self.backend.probe()
        live = set(await self.backend.list_existing())
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
            usable = sid in live and rec.state in (State.RUNNING, State.PAUSED)
            if usable and self.config.on_start == "adopt":
                try:
                    await self.backend.adopt(sid)
                    await self.layers.acquire_all(rec.layers)
                    self.capacity.hold(sid, rec.resources)
                    rec.touch()
                    self._sandboxes[sid] = rec
                    self._save(rec)
                    out["adopted"].append(sid)
                    continue
                except EdgedError as e:
                    log.warning("cannot adopt %s: %s", sid, e)
            if sid in live:
                with contextlib.suppress(EdgedError):
                    await self.backend.destroy(sid)
                out["destroyed"].append(sid)
            else:
                out["lost"].append(sid)
            (self.records_dir / f"{sid}.json").unlink(missing_ok=True)
        for sid in live - set(records):
            if self.config.on_start == "destroy":
                with contextlib.suppress(EdgedError):
                    await self.backend.destroy(sid)
                out["destroyed"].append(sid)
        out["cleaned"] = await self.backend.cleanup_leftovers(set(out["adopted"]))
        warm = getattr(self.backend, "warm", None)
        if warm is not None:  # e.g. the container backend's spawner pool, ahead of creates
            await warm()
        out["layers_unmounted"] = await self.layers.sweep()
        self._update_gauges()
        return out

    async def shutdown(self, timeout_s: float) -> None:
        """Stop the reaper; with ``on_shutdown = "stop"`` destroy every sandbox (at most
        ``timeout_s`` seconds) and unmount every layer; with ``"keep"`` leave them running for
        the next daemon to re-adopt."""
        await self.stop_reaper()
        await self._flush_background()
        if self.config.on_shutdown != "stop":
            return
        ids = [r.id for r in self._sandboxes.values()
               if r.state in (State.RUNNING, State.PAUSED, State.FAILED)]

        async def stop(sid: str) -> None:
            try:
                await self.delete(sid, cause="shutdown")
            except EdgedError as e:
                log.warning("shutdown: sandbox %s: %s", sid, e)

        try:
            await asyncio.wait_for(asyncio.gather(*(stop(s) for s in ids)), timeout_s)
        except TimeoutError:
            log.error("shutdown: sandboxes still stopping after %.1f s", timeout_s)
        await self._flush_background()
        if not self._sandboxes:
            await self.layers.close()

    def node_info(self) -> dict[str, Any]:
        """``GET /v1/node``: capacity, allocations, states, layer mounts, probed features;
        measured memory (host, sandboxes, swap, kernel overhead per sandbox), pressure
        (PSI), what reclaim can get back and has, and the free capacity in sandbox-sized
        units that placement reads (see :meth:`Admission.snapshot`)."""
        info = self.capacity.to_json()
        counts: dict[str, int] = {}
        for r in self._sandboxes.values():
            counts[r.state.value] = counts.get(r.state.value, 0) + 1
        info["sandboxes"] = counts
        info["backend"] = self.backend.name
        info["features"] = self.features
        info["layers"] = self.layers.refs()
        info.update(self.admission.snapshot())
        rt = self.reclaimer.totals()
        info["reclaim"] = {
            "enabled": self.config.reclaim and self.reclaimer.supported,
            "idle_after_s": self.config.idle_after_s,
            "budget_bytes": self.reclaimer.budget,
            "refault_pct_per_min": self.reclaimer.refault_rate(),
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
