"""What the E2B-compatible listener keeps: the sandboxes it made (owner, template,
metadata), their envd access tokens, their processes."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from edged.compat.e2b.processes import Processes
from edged.errors import EdgedError
from edged.node.manager import SandboxManager
from edged.security.apikeys import ApiKeys

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENVD_VERSION = "0.6.1"
#: the sandbox of an envd request (from its E2b-Sandbox-Id header, authenticated)
SANDBOX: web.RequestKey[str] = web.RequestKey("e2b_sandbox", str)
#: the key id (owner) of a control request
TEAM: web.RequestKey[str] = web.RequestKey("e2b_team", str)


@dataclass
class Meta:
    """What the listener keeps of one of its sandboxes."""

    team: str
    template: str
    alias: str
    metadata: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0
    timeout_s: float = 300.0


class E2bState:
    """The listener's state: the manager, the keys, the token secret, the sandboxes it made
    (:class:`Meta`), their processes (:class:`~.processes.Processes`) and envd."""

    def __init__(self, manager: SandboxManager, keys: ApiKeys, state_dir: str) -> None:
        self.manager = manager
        self.keys = keys
        self.dir = Path(state_dir) / "e2b"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.secret = self._secret()
        self.meta: dict[str, Meta] = {}
        for p in self.dir.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                self.meta[p.stem] = Meta(**json.loads(p.read_text()))
        self.processes = Processes(manager)
        #: told when a sandbox is forgotten (envd's per-sandbox state)
        self.on_forget: list[Callable[[str], None]] = [self.processes.forget]
        #: envd's routes, by (method, path), dispatched on the E2b-Sandbox-Id header
        self.envd_routes: dict[tuple[str, str], Handler] = {}

    def _secret(self) -> bytes:
        p = self.dir / "secret"
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return p.read_bytes()
        with os.fdopen(fd, "wb") as f:
            data = secrets.token_bytes(32)
            f.write(data)
        return data

    def token(self, sandbox_id: str) -> str:
        """The envd access token of a sandbox."""
        return hmac.new(self.secret, sandbox_id.encode(), hashlib.sha256).hexdigest()

    def save(self, sandbox_id: str, meta: Meta) -> None:
        self.meta[sandbox_id] = meta
        tmp = self.dir / f".{sandbox_id}.tmp"
        tmp.write_text(json.dumps(meta.__dict__))
        os.replace(tmp, self.dir / f"{sandbox_id}.json")

    def forget(self, sandbox_id: str) -> None:
        self.meta.pop(sandbox_id, None)
        with contextlib.suppress(FileNotFoundError):
            (self.dir / f"{sandbox_id}.json").unlink()
        for hook in self.on_forget:
            hook(sandbox_id)

    def prune(self) -> None:
        """Forget sandboxes the node no longer has (deleted elsewhere, reaped)."""
        for sid in list(self.meta):
            try:
                self.manager.get(sid)
            except EdgedError:
                self.forget(sid)


STATE: web.AppKey[E2bState] = web.AppKey("e2b_state", E2bState)

__all__ = ["ENVD_VERSION", "SANDBOX", "STATE", "TEAM", "E2bState", "Handler", "Meta"]
