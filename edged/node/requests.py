"""What the sandbox manager is asked to do, as typed values: made from request bodies by
:mod:`edged.api.requests` (which validates every field), taken by
:class:`~edged.node.manager.SandboxManager`. A field left None means "the node's default"
(the manager's to fill in: an id, the default backend, the configured TTL...).

Units: seconds, bytes, cores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edged.backends.base import Resources


@dataclass(frozen=True)
class CreateRequest:
    """A sandbox to create: exactly one of ``image`` (a registered ``name:tag``) and
    ``layers`` (digests, bottom first). ``resources``: the limits the request sets, over the
    node's defaults. ``task_profile``/``seccomp_profile``: names of profiles that exist.
    ``qos``: the CPU class (:data:`~edged.backends.base.QOS_CLASSES`);
    ``auto_pause_after_s``: idle seconds before the sandbox is paused (0: never)."""

    id: str | None = None
    backend: str | None = None
    image: str | None = None
    layers: tuple[str, ...] | None = None
    resources: Mapping[str, int | float] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    #: ``"none"`` or ``{"allow": [RULE, ...]}`` (:mod:`edged.net.policy`)
    network: str | Mapping[str, Any] = "none"
    hostname: str | None = None
    task_profile: str = "default"
    seccomp_profile: str | None = None
    ttl_s: float | None = None
    idle_timeout_s: float | None = None
    qos: str = "best_effort"
    auto_pause_after_s: float | None = None

    def resources_over(self, default: Resources) -> Resources:
        """The sandbox's limits: ``default`` with the fields this request sets."""
        return Resources(**{**default.__dict__, **self.resources})


@dataclass(frozen=True)
class ExecRequest:
    """A command to run: ``argv`` (a ``cmd`` string arrives as ``/bin/sh -c cmd``), ``env``
    over the sandbox's, ``stdin``: None or False (``/dev/null``), True (kept open: WebSocket
    only), or text fed then closed. ``encoding`` of output events: ``"text" | "base64"``.
    ``rows``/``cols``: the PTY's first size. ``trusted``: a grader's exec;
    ``kill_leftovers``: every workload process is killed before it starts."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    timeout_s: float | None = None
    output_limit: int | None = None
    pty: bool = False
    stdin: bool | str | None = None
    encoding: str = "text"
    rows: int | None = None
    cols: int | None = None
    trusted: bool = False
    kill_leftovers: bool = False


@dataclass(frozen=True)
class SignalRequest:
    """Signal number ``signal`` to one exec (``exec_id``) or every running exec; ``all``
    (SIGKILL only): every workload process of the sandbox."""

    signal: int
    exec_id: int | None = None
    all: bool = False


@dataclass(frozen=True)
class TimeoutRequest:
    """New ``ttl_s`` (from now; 0 clears) and/or ``idle_timeout_s``; None leaves it."""

    ttl_s: float | None = None
    idle_timeout_s: float | None = None


__all__ = ["CreateRequest", "ExecRequest", "SignalRequest", "TimeoutRequest"]
