"""The security-event ledger: what each sandbox's workload tried, kept after it is gone.

Each denial or limit hit that can be observed is one :class:`SecurityEvent` (time, sandbox,
kind, process, syscall/path/address, detail). The ledger keeps, per sandbox, the most recent
``max_per_sandbox`` events in memory; persists every event as one JSON line appended to a
segment file in ``<state_dir>/security/`` (``events-<first seq>.jsonl``); and fans events out
to any number of asyncio subscribers (one sandbox or node-wide), each with a bounded queue
that drops its oldest events when the reader is too slow (the count is reported).

Bounds: ``rate_per_s`` events per sandbox per second (the excess is counted and reported on the
next kept event as ``detail["suppressed"]``, with the ``dropped_before`` counts they carried
as ``detail["suppressed_dropped"]``, so a workload looping on a denied syscall cannot fill the
disk and no denial goes uncounted; summaries, ``detail["summary"]``, are never suppressed);
``max_bytes`` on disk (when passed, the ledger compacts: rewrites the newest retained events
that fit in half of it into one new segment and deletes the rest; older ones count as
``truncated``); events of a sandbox are dropped ``retention_s`` seconds after
:meth:`Ledger.sandbox_gone`.

Crash safety: appends are whole lines with O_APPEND; a torn last line is skipped on load;
compaction writes a new segment and renames it into place before deleting old ones, so a crash
loses nothing (duplicates are removed by ``seq`` on load).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edged.errors import BadRequest, NotFound

log = logging.getLogger("edged.security.ledger")

#: Event kinds. ``sandbox_gone`` marks the end of a sandbox (retention counts from it).
KINDS = frozenset(
    {
        "seccomp_denied",  # a syscall denied by the seccomp profile (user notification)
        "landlock_denied",  # a file/network/scope access Landlock refused (where reported)
        "apparmor_denied",  # an AppArmor denial (production hosts)
        "protected_path_tampered",  # a protected path changed in the upper layer
        "oom_kill",  # the memory limit killed a process
        "pids_limit",  # fork/clone failed at the pids limit
        "cpu_throttled",  # the CPU quota throttled the sandbox
        "disk_full",  # the upper layer reached its size limit
        "output_limit",  # an exec hit its output limit
        "timeout",  # an exec hit its wall-time limit
        "protocol_violation",  # a malformed or oversized control-channel frame
        "exec_abandoned",  # its caller went away before its end: the exec's tree was killed
        "sandbox_failed",  # the sandbox's init (sbx-init) ended on its own: detail["cause"]
        "egress_denied",  # a connection or datagram the sandbox's network policy refused
        "dns_denied",  # a DNS query for a name the policy does not allow (NXDOMAIN)
        "sandbox_gone",
    }
)

_MAX_TEXT = 4096


def _clip(v: str | None) -> str | None:
    return v if v is None or len(v) <= _MAX_TEXT else v[:_MAX_TEXT] + "…"


@dataclass(frozen=True)
class SecurityEvent:
    """One recorded attempt or limit hit.

    ``seq``: node-wide increasing number (resume point for streams). ``time``: Unix seconds.
    ``pid``: in the sandbox's pid namespace when known. ``process``: its command name.
    ``syscall`` / ``path`` / ``address``: what was involved, when applicable (address as
    ``host:port`` or an abstract socket name). ``detail``: kind-specific JSON object.
    """

    seq: int
    time: float
    sandbox_id: str
    kind: str
    pid: int | None = None
    process: str | None = None
    syscall: str | None = None
    path: str | None = None
    address: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The API/NDJSON shape (all fields, ``None`` for absent ones)."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SecurityEvent:
        """Inverse of :meth:`to_json`; ``ValueError``/``KeyError``/``TypeError`` if malformed."""
        ev = cls(
            seq=int(d["seq"]),
            time=float(d["time"]),
            sandbox_id=str(d["sandbox_id"]),
            kind=str(d["kind"]),
            pid=None if d.get("pid") is None else int(d["pid"]),
            process=d.get("process"),
            syscall=d.get("syscall"),
            path=d.get("path"),
            address=d.get("address"),
            detail=dict(d.get("detail") or {}),
        )
        if ev.kind not in KINDS:
            raise ValueError(f"unknown kind {ev.kind!r}")
        return ev


class Subscription:
    """A live feed of events (async iterator). ``dropped``: events lost because this reader
    fell more than ``maxsize`` events behind."""

    def __init__(self, ledger: Ledger, sandbox_id: str | None, kinds: frozenset[str] | None,
                 maxsize: int) -> None:
        self._ledger = ledger
        self.sandbox_id = sandbox_id
        self.kinds = kinds
        self.queue: asyncio.Queue[SecurityEvent | None] = asyncio.Queue(maxsize)
        self.dropped = 0

    def _offer(self, ev: SecurityEvent) -> None:
        if self.sandbox_id is not None and ev.sandbox_id != self.sandbox_id:
            return
        if self.kinds is not None and ev.kind not in self.kinds:
            return
        if self.queue.full():
            with contextlib.suppress(asyncio.QueueEmpty):
                self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(ev)

    def close(self) -> None:
        """Stop the feed: the iterator ends after the queued events."""
        self._ledger._subs.discard(self)
        if self.queue.full():
            with contextlib.suppress(asyncio.QueueEmpty):
                self.queue.get_nowait()
        self.queue.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[SecurityEvent]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[SecurityEvent]:
        try:
            while True:
                ev = await self.queue.get()
                if ev is None:
                    return
                yield ev
        finally:
            self._ledger._subs.discard(self)


@dataclass
class _Sandbox:
    events: collections.deque[SecurityEvent]
    gone_at: float | None = None
    truncated: int = 0  # events pushed out of memory by max_per_sandbox
    window: int = 0  # second of the rate window
    in_window: int = 0
    suppressed: int = 0
    suppressed_dropped: int = 0  # ``dropped_before`` counts the suppressed events carried


class Ledger:
    """Per-sandbox security events with persistence, retention and streaming.

    ``state_dir``: where ``security/`` segments live (None: memory only). ``retention_s``:
    how long events are kept after the sandbox is gone. Not thread-safe: call from the
    daemon's event loop thread (subscriptions need a running loop).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        retention_s: float = 24 * 3600.0,
        max_per_sandbox: int = 10_000,
        rate_per_s: int = 200,
        segment_bytes: int = 8 << 20,
        max_bytes: int = 256 << 20,
    ) -> None:
        if retention_s < 0 or max_per_sandbox < 1 or rate_per_s < 1 or segment_bytes < 1024:
            raise BadRequest("ledger: retention_s >= 0, max_per_sandbox, rate_per_s >= 1, "
                             "segment_bytes >= 1024")
        self.retention_s = retention_s
        self.max_per_sandbox = max_per_sandbox
        self.rate_per_s = rate_per_s
        self.segment_bytes = segment_bytes
        self.max_bytes = max(max_bytes, 2 * segment_bytes)
        self._sandboxes: dict[str, _Sandbox] = {}
        self._subs: set[Subscription] = set()
        self._seq = 0
        self._dir = Path(state_dir, "security") if state_dir is not None else None
        self._fd = -1
        self._seg_size = 0
        self._total = 0
        self.corrupt_lines = 0
        self.write_errors = 0  #: events kept in memory only (their write failed)
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._load()

    # ---- persistence ----

    def _segments(self) -> list[Path]:
        assert self._dir is not None
        return sorted(self._dir.glob("events-*.jsonl"))

    def _load(self) -> None:
        seen: dict[int, SecurityEvent] = {}
        for seg in self._segments():
            self._total += seg.stat().st_size
            with open(seg, "rb") as f:
                for line in f:
                    try:
                        ev = SecurityEvent.from_json(json.loads(line))
                    except (ValueError, KeyError, TypeError):
                        self.corrupt_lines += 1  # a torn last line after a crash
                        continue
                    seen[ev.seq] = ev
        for seq in sorted(seen):
            self._insert(seen[seq])
            self._seq = max(self._seq, seq)
        if self.corrupt_lines:
            log.warning("ledger: skipped %d unreadable lines in %s", self.corrupt_lines, self._dir)
        self.prune()

    def _append(self, ev: SecurityEvent) -> None:
        if self._dir is None:
            return
        line = (json.dumps(ev.to_json(), separators=(",", ":")) + "\n").encode()
        try:
            if self._fd < 0 or self._seg_size + len(line) > self.segment_bytes:
                self._open_segment(ev.seq)
            os.write(self._fd, line)
            self._seg_size += len(line)
            self._total += len(line)
            if self._total > self.max_bytes:
                self.compact()
        except OSError as e:
            # A full disk or EMFILE must not fail what recorded the event (a create, a
            # delete); the event stays in memory and is served, only not persisted.
            self.write_errors += 1
            log.warning("ledger: cannot persist event %d: %s", ev.seq, e)

    def _open_segment(self, first_seq: int) -> None:
        assert self._dir is not None
        if self._fd >= 0:
            os.close(self._fd)
        path = self._dir / f"events-{first_seq:016d}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._seg_size = os.fstat(self._fd).st_size

    def compact(self) -> None:
        """Rewrite the retained events into one new segment and delete the older ones."""
        if self._dir is None:
            return
        events = sorted((e for s in self._sandboxes.values() for e in s.events),
                        key=lambda e: e.seq)
        old = self._segments()
        lines = [(json.dumps(e.to_json(), separators=(",", ":")) + "\n").encode()
                 for e in events]
        # Keep the newest events that fit in half the budget, so that the disk stays bounded
        # even when every sandbox is alive, and compaction does not run again at once.
        budget, keep = self.max_bytes // 2, len(lines)
        size = 0
        while keep > 0 and size + len(lines[keep - 1]) <= budget:
            size += len(lines[keep - 1])
            keep -= 1
        for e in events[:keep]:
            sb = self._sandboxes[e.sandbox_id]
            sb.events.remove(e)
            sb.truncated += 1
        events, lines = events[keep:], lines[keep:]
        first = events[0].seq if events else self._seq + 1
        path = self._dir / f"events-{first:016d}.jsonl"
        tmp = path.with_suffix(".tmp")
        data = b"".join(lines)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        os.replace(tmp, path)
        for seg in old:
            if seg != path:
                seg.unlink(missing_ok=True)
        self._total = len(data)
        self._open_segment(first)

    def close(self) -> None:
        """Close the segment file and end every subscription."""
        for sub in list(self._subs):
            sub.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- recording ----

    def _insert(self, ev: SecurityEvent) -> None:
        sb = self._sandboxes.get(ev.sandbox_id)
        if sb is None:
            sb = self._sandboxes[ev.sandbox_id] = _Sandbox(
                collections.deque(maxlen=self.max_per_sandbox)
            )
        if len(sb.events) == self.max_per_sandbox:
            sb.truncated += 1
        sb.events.append(ev)
        if ev.kind == "sandbox_gone":
            sb.gone_at = ev.time

    def sandbox_created(self, sandbox_id: str) -> None:
        """Make ``sandbox_id`` known (its event list is empty, not 404). A re-used id starts a
        new retention period."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            self._sandboxes[sandbox_id] = _Sandbox(collections.deque(maxlen=self.max_per_sandbox))
        else:
            sb.gone_at = None

    def record(
        self,
        sandbox_id: str,
        kind: str,
        *,
        pid: int | None = None,
        process: str | None = None,
        syscall: str | None = None,
        path: str | None = None,
        address: str | None = None,
        detail: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> SecurityEvent | None:
        """Record one event and publish it; returns it, or None when rate-limited (counted).

        Raises :class:`~edged.errors.BadRequest` for an unknown ``kind``."""
        if kind not in KINDS:
            raise BadRequest(f"ledger: unknown event kind {kind!r}")
        t = time.time() if now is None else now
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            self.sandbox_created(sandbox_id)
            sb = self._sandboxes[sandbox_id]
        sec = int(t)
        if sec != sb.window:
            sb.window, sb.in_window = sec, 0
        sb.in_window += 1
        # A summary (counts of what was not reported one by one) is never suppressed.
        summary = kind == "sandbox_gone" or bool(detail and detail.get("summary"))
        if sb.in_window > self.rate_per_s and not summary:
            sb.suppressed += 1
            # what a suppressed event stood for beyond itself (sbx-init's dropped denials)
            extra = (detail or {}).get("dropped_before")
            if isinstance(extra, int) and extra > 0:
                sb.suppressed_dropped += extra
            return None
        d = dict(detail or {})
        if sb.suppressed:
            d["suppressed"] = sb.suppressed  # events dropped by the rate limit before this one
            sb.suppressed = 0
        if sb.suppressed_dropped:
            d["suppressed_dropped"] = sb.suppressed_dropped  # their dropped_before, summed
            sb.suppressed_dropped = 0
        self._seq += 1
        ev = SecurityEvent(self._seq, t, sandbox_id, kind, pid, _clip(process), _clip(syscall),
                           _clip(path), _clip(address), d)
        self._insert(ev)
        self._append(ev)
        for sub in list(self._subs):
            sub._offer(ev)
        return ev

    def sandbox_gone(self, sandbox_id: str, now: float | None = None,
                     cause: str | None = None) -> None:
        """Mark the sandbox as gone: its events are kept ``retention_s`` from now.
        ``cause`` (``deleted``, ``ttl``, ``idle``, ``shutdown``, ``create_failed``) goes in
        the event's detail."""
        self.record(sandbox_id, "sandbox_gone", now=now,
                    detail=None if cause is None else {"cause": cause})

    def prune(self, now: float | None = None) -> int:
        """Forget sandboxes gone for longer than ``retention_s``; returns how many. Compacts the
        files when it forgot any."""
        t = time.time() if now is None else now
        expired = [sid for sid, sb in self._sandboxes.items()
                   if sb.gone_at is not None and t - sb.gone_at > self.retention_s]
        for sid in expired:
            del self._sandboxes[sid]
        if expired:
            self.compact()
        return len(expired)

    # ---- reading ----

    def known(self, sandbox_id: str) -> bool:
        """Whether the ledger holds (or may hold) events for ``sandbox_id``."""
        return sandbox_id in self._sandboxes

    def events(
        self,
        sandbox_id: str,
        *,
        since: int = 0,
        kinds: Iterable[str] | None = None,
        limit: int = 1000,
    ) -> list[SecurityEvent]:
        """Events of ``sandbox_id`` with ``seq > since``, oldest first, at most ``limit``.

        Raises :class:`~edged.errors.NotFound` for a sandbox the ledger does not know (never
        created, or its retention ended) and :class:`~edged.errors.BadRequest` for a bad
        kind or limit."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise NotFound(f"sandbox {sandbox_id!r}: no security events (unknown or expired)")
        ks = self._kinds(kinds)
        if not 1 <= limit <= 100_000:
            raise BadRequest(f"limit {limit}: must be 1..100000")
        out = [e for e in sb.events if e.seq > since and (ks is None or e.kind in ks)]
        return out[:limit]

    def truncated(self, sandbox_id: str) -> int:
        """How many of the sandbox's events were pushed out of memory by ``max_per_sandbox``."""
        sb = self._sandboxes.get(sandbox_id)
        return sb.truncated if sb else 0

    def backlog(self, *, since: int, kinds: Iterable[str] | None = None) -> list[SecurityEvent]:
        """Node-wide events with ``seq > since`` still in memory, oldest first."""
        ks = self._kinds(kinds)
        out = [e for s in self._sandboxes.values() for e in s.events
               if e.seq > since and (ks is None or e.kind in ks)]
        return sorted(out, key=lambda e: e.seq)

    def subscribe(
        self, sandbox_id: str | None = None, *, kinds: Iterable[str] | None = None,
        maxsize: int = 1024,
    ) -> Subscription:
        """A live feed of new events (of one sandbox, or node-wide when None). Close it with
        :meth:`Subscription.close` (or stop iterating)."""
        sub = Subscription(self, sandbox_id, self._kinds(kinds), maxsize)
        self._subs.add(sub)
        return sub

    @property
    def last_seq(self) -> int:
        """The newest event's ``seq`` (0 when none)."""
        return self._seq

    @staticmethod
    def _kinds(kinds: Iterable[str] | None) -> frozenset[str] | None:
        if kinds is None:
            return None
        ks = frozenset(kinds)
        bad = ks - KINDS
        if bad:
            raise BadRequest(f"unknown event kinds {sorted(bad)}")
        return ks or None
