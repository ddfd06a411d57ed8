"""Shell sessions in the SDK: ``s = sbx.session(); s.run("cd /tmp"); s.run("pwd")``.

A session is a persistent shell in the sandbox (bash if it has one, else sh): the working
directory, environment, shell variables and functions of one run are there in the next.
Each run has its own ``timeout`` and ``output_limit`` and a typed end in
:attr:`ExecResult.reason`: ``exited``, ``timeout``, ``output_limit`` or ``session_ended``
(the shell itself ended: ``exit``, killed; later runs raise :class:`InvalidStateError`).
See ``edged/node/sessions.py`` for how a run's end is found without trusting its output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar

from edged.client._common import ExecCollector, ExecResult, OutputCallback
from edged.client._http import Transport, path_for
from edged.client.errors import NotFoundError


class _Sandbox(Protocol):
    """What a session needs of its :class:`~edged.client.Sandbox`."""

    id: str
    _t: Transport


SbxT = TypeVar("SbxT")


class SessionBase(Generic[SbxT]):
    """What the sync and async sessions share: their sandbox, the session object ``info``
    (``id``, ``shell``, ``state``, ``runs``...) and its ``id``."""

    def __init__(self, sbx: SbxT, info: dict[str, Any]) -> None:
        self._sbx = sbx
        self.info = info
        self.id: str = info["id"]

    @property
    def shell(self) -> str:
        """The shell's path in the sandbox (``/bin/bash`` or ``/bin/sh``)."""
        return str(self.info["shell"])


def session_body(*, id: str | None, shell: str | None, env: Mapping[str, str] | None,
                 cwd: str | None, user: int | None) -> dict[str, Any]:
    """The ``POST .../sessions`` body."""
    body: dict[str, Any] = {}
    for k, v in (("id", id), ("shell", shell), ("cwd", cwd)):
        if v is not None:
            body[k] = v
    if env:
        body["env"] = dict(env)
    if user is not None:
        body["uid"] = body["gid"] = user
    return body


def run_body(cmd: str, *, timeout: float | None, output_limit: int | None) -> dict[str, Any]:
    """The ``POST .../sessions/{id}/run`` body."""
    body: dict[str, Any] = {"cmd": cmd, "encoding": "base64"}
    if timeout is not None:
        body["timeout_s"] = timeout
    if output_limit is not None:
        body["output_limit"] = output_limit
    return body


class Session(SessionBase[_Sandbox]):
    """One shell session of a :class:`~edged.client.Sandbox`; a context manager that closes
    it on exit. ``info``: the session object (``id``, ``shell``, ``state``, ``runs``...)."""

    def run(self, cmd: str, *, timeout: float | None = None, output_limit: int | None = None,
            on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None) -> ExecResult:
        """Run ``cmd`` in the session's shell and wait for its end. ``timeout`` (seconds):
        the run is interrupted (SIGINT, SIGTERM; the session stays unless the command
        survives both); ``output_limit``: bytes of stdout+stderr kept. Raises
        :class:`~edged.client.ConflictError` (a run in progress),
        :class:`~edged.client.InvalidStateError` (the session's shell has ended),
        :class:`~edged.client.NotFoundError`."""
        col = ExecCollector(on_stdout, on_stderr)
        path = path_for("sandboxes", self._sbx.id, "sessions", self.id, "run")
        for ev in self._sbx._t.ndjson("POST", path, run_body(cmd, timeout=timeout,
                                                            output_limit=output_limit)):
            col.feed(ev)
        return col.result()

    def refresh(self) -> dict[str, Any]:
        """Re-read and return the session object."""
        self.info = self._sbx._t.json("GET", path_for("sandboxes", self._sbx.id, "sessions",
                                                      self.id))
        return self.info

    def close(self) -> None:
        """End the session: its shell and whatever it left running are killed (idempotent)."""
        with contextlib.suppress(NotFoundError):
            self.info = self._sbx._t.json(
                "DELETE", path_for("sandboxes", self._sbx.id, "sessions", self.id))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
