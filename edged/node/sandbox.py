"""A sandbox record and its state machine.

States (DESIGN.md): ``creating → running ⇄ paused → stopping → stopped``, or ``failed``.
:func:`require` raises :class:`~edged.errors.InvalidState` for an operation in the wrong
state; :meth:`SandboxRecord.transition` refuses an edge not in :data:`TRANSITIONS`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from edged.backends.base import Resources
from edged.errors import BadRequest, InvalidState

ID_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
LABEL_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,62}")


class State(StrEnum):
    """Lifecycle state of a sandbox."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.CREATING: frozenset({State.RUNNING, State.STOPPING, State.FAILED}),
    State.RUNNING: frozenset({State.PAUSED, State.STOPPING, State.FAILED}),
    State.PAUSED: frozenset({State.RUNNING, State.STOPPING, State.FAILED}),
    State.STOPPING: frozenset({State.STOPPED, State.FAILED}),
    State.STOPPED: frozenset(),
    # A failed sandbox can still be torn down (DELETE).
    State.FAILED: frozenset({State.STOPPING}),
}


def check_id(sandbox_id: str) -> str:
    """Return ``sandbox_id`` if it matches ``[a-z0-9][a-z0-9_.-]{0,62}``, else raise
    :class:`BadRequest` (the id becomes a cgroup, hostname and directory name)."""
    if not isinstance(sandbox_id, str) or not ID_RE.fullmatch(sandbox_id):
        raise BadRequest(f"id {sandbox_id!r}: must match [a-z0-9][a-z0-9_.-]{{0,62}}")
    return sandbox_id


@dataclass
class SandboxRecord:
    """Everything the daemon knows about one sandbox; persisted as JSON in the state dir.

    Times are ``time.time()`` seconds; ``ttl_s``/``idle_timeout_s`` of 0 mean none.
    ``layers`` are digests bottom first; ``lowers`` the host paths they are mounted at.
    """

    id: str
    backend: str
    layers: list[str]
    resources: Resources
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    image: str | None = None
    #: ``"none"`` or the egress policy as the client gave it (``{"allow": [...]}``)
    network: Any = "none"
    hostname: str = ""
    lowers: list[str] = field(default_factory=list)
    state: State = State.CREATING
    created_at: float = field(default_factory=time.time)
    ttl_s: float = 0.0
    idle_timeout_s: float = 0.0
    expires_at: float | None = None
    last_active: float = field(default_factory=time.time)
    active_execs: int = 0
    error: str | None = None
    task_profile: str = "default"
    seccomp_profile: str | None = None
    qos: str = "best_effort"
    auto_pause_after_s: float = 0.0

    @property
    def paused(self) -> bool:
        """Whether it is paused (frozen; its memory paged out at the pause)."""
        return self.state is State.PAUSED

    def transition(self, new: State) -> None:
        """Move to ``new``; :class:`InvalidState` if the edge does not exist."""
        if new not in TRANSITIONS[self.state]:
            raise InvalidState(
                f"sandbox {self.id}: cannot go from {self.state.value} to {new.value}"
            )
        self.state = new

    def require(self, *states: State, op: str) -> None:
        """Raise :class:`InvalidState` naming ``op`` unless the state is one of ``states``."""
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise InvalidState(
                f"sandbox {self.id}: cannot {op} while {self.state.value} (needs {allowed})"
            )

    def set_ttl(self, ttl_s: float, now: float | None = None) -> None:
        """Expire ``ttl_s`` seconds from ``now`` (0: never)."""
        self.ttl_s = ttl_s
        self.expires_at = (now or time.time()) + ttl_s if ttl_s > 0 else None

    def touch(self, now: float | None = None) -> None:
        """Record activity (resets the idle clock)."""
        self.last_active = now or time.time()

    def idle_for(self, now: float) -> float:
        """Seconds since the last activity, 0 while an exec runs."""
        return 0.0 if self.active_execs else max(0.0, now - self.last_active)

    def expired(self, now: float) -> str | None:
        """``"ttl"`` or ``"idle"`` if the reaper should stop this sandbox, else None. A paused
        sandbox is never idle-reaped (pausing is how a client parks one), but its TTL holds."""
        if self.expires_at is not None and now >= self.expires_at:
            return "ttl"
        if (
            self.idle_timeout_s > 0
            and self.state is State.RUNNING
            and self.active_execs == 0
            and now - self.last_active >= self.idle_timeout_s
        ):
            return "idle"
        return None

    def reap_due(self, now: float) -> float | None:
        """The earliest wall time the reaper may have to act on this sandbox (its TTL's end,
        its idle timeout's, its auto-pause's), or None if never. A lower bound: activity only
        moves it later (while an exec runs or it is paused, the idle clocks count from
        ``now`` at the earliest: the exec's end and a resume :meth:`touch` it); a new TTL or
        idle timeout may move it earlier (the reaper is told, see ``set_timeout``)."""
        due = [self.expires_at] if self.expires_at is not None else []
        quiet = self.last_active if (self.state is State.RUNNING and not self.active_execs) \
            else max(now, self.last_active)
        due += [quiet + t for t in (self.idle_timeout_s, self.auto_pause_after_s) if t > 0]
        return min(due) if due else None

    def to_json(self) -> dict[str, Any]:
        """The API's sandbox object (also the persisted form)."""
        r = self.resources
        return {
            "id": self.id,
            "backend": self.backend,
            "state": self.state.value,
            "image": self.image,
            "layers": list(self.layers),
            "resources": {
                "cpus": r.cpus,
                "memory_bytes": r.memory_bytes,
                "swap_bytes": r.swap_bytes,
                "pids": r.pids,
                "disk_bytes": r.disk_bytes,
                "memory_request_bytes": r.memory_request_bytes,
            },
            "env": dict(self.env),
            "labels": dict(self.labels),
            "network": self.network,
            "hostname": self.hostname,
            "created_at": self.created_at,
            "ttl_s": self.ttl_s,
            "idle_timeout_s": self.idle_timeout_s,
            "expires_at": self.expires_at,
            "last_active": self.last_active,
            "active_execs": self.active_execs,
            "error": self.error,
            "task_profile": self.task_profile,
            "seccomp_profile": self.seccomp_profile,
            "qos": self.qos,
            "auto_pause_after_s": self.auto_pause_after_s,
        }

    def persisted(self) -> dict[str, Any]:
        """:meth:`to_json` plus the fields only the daemon needs after a restart."""
        d = self.to_json()
        d["lowers"] = list(self.lowers)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxRecord:
        """Inverse of :meth:`persisted`; raises ``KeyError``/``ValueError`` on a bad record."""
        rec = cls(
            id=check_id(d["id"]),
            backend=str(d["backend"]),
            layers=[str(x) for x in d["layers"]],
            resources=Resources(**d["resources"]),
            env={str(k): str(v) for k, v in d.get("env", {}).items()},
            labels={str(k): str(v) for k, v in d.get("labels", {}).items()},
            image=d.get("image"),
            network=d.get("network", "none"),
            hostname=str(d.get("hostname", "")),
            lowers=[str(x) for x in d.get("lowers", [])],
            state=State(d["state"]),
            created_at=float(d["created_at"]),
            ttl_s=float(d.get("ttl_s", 0.0)),
            idle_timeout_s=float(d.get("idle_timeout_s", 0.0)),
            expires_at=d.get("expires_at"),
            last_active=float(d.get("last_active", time.time())),
            task_profile=str(d.get("task_profile", "default")),
            seccomp_profile=d.get("seccomp_profile"),
            qos=str(d.get("qos", "best_effort")),
            auto_pause_after_s=float(d.get("auto_pause_after_s", 0.0)),
        )
        rec.error = d.get("error")
        return rec


def default_hostname(sandbox_id: str) -> str:
    """The hostname of a sandbox that asks for none: its id made an RFC 1123 name
    (``_`` → ``-``, hyphens at a label's ends and empty labels dropped)."""
    labels = (label.strip("-") for label in sandbox_id.replace("_", "-").split("."))
    return ".".join(label for label in labels if label) or "sandbox"
