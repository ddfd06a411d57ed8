"""Pieces shared by the sync and async SDK: request bodies and the exec result."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edged.client.errors import PayloadTooLargeError

OutputCallback = Callable[[str], object]

#: The daemon's limit on a JSON request body (``edged.api.app.MAX_JSON_BODY``).
MAX_JSON_BODY = 4 << 20


def encode_json(payload: Any) -> bytes:
    """A request's JSON body. Raises :class:`~edged.client.errors.PayloadTooLargeError`
    for one over :data:`MAX_JSON_BODY` bytes, which the daemon would refuse (413) after
    reading the first 4 MiB of it: refused here without being sent."""
    body = json.dumps(payload).encode()
    if len(body) > MAX_JSON_BODY:
        raise PayloadTooLargeError(f"request body of {len(body)} bytes: larger than the "
                                   f"daemon's {MAX_JSON_BODY}", status=413)
    return body


@dataclass
class ExecResult:
    """The outcome of one command.

    ``exit_code``: the exit status (None unless ``reason == "exited"``). ``reason``:
    ``exited | signalled | timeout | oom | output_limit | killed``. ``stdout``/``stderr``:
    decoded text, partial output kept on timeout or limit. ``duration``: seconds.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    reason: str
    duration: float
    signal: int | None = None
    exec_id: int | None = None
    peak_memory_bytes: int | None = None
    raw_end: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """True if the command exited with status 0."""
        return self.reason == "exited" and self.exit_code == 0


class ExecCollector:
    """Folds exec events into an :class:`ExecResult`, calling the output callbacks."""

    def __init__(self, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None):
        self.out: list[str] = []
        self.err: list[str] = []
        self.cbs = {"stdout": on_stdout, "stderr": on_stderr}
        self.exec_id: int | None = None
        self.end: dict[str, Any] | None = None

    def feed(self, ev: dict[str, Any]) -> None:
        if "start" in ev:
            self.exec_id = ev["start"].get("exec_id")
        for name, buf in (("stdout", self.out), ("stderr", self.err)):
            if name in ev:
                buf.append(ev[name])
                cb = self.cbs[name]
                if cb is not None:
                    cb(ev[name])
        if "end" in ev:
            self.end = ev["end"]

    def result(self) -> ExecResult:
        from edged.client.errors import SandboxError

        if self.end is None:
            raise SandboxError("exec stream ended without an end event (daemon went away?)")
        e = self.end
        return ExecResult(
            exit_code=e.get("exit_code"),
            stdout="".join(self.out),
            stderr="".join(self.err),
            reason=e["reason"],
            duration=float(e.get("duration_s", 0.0)),
            signal=e.get("signal"),
            exec_id=self.exec_id,
            peak_memory_bytes=e.get("peak_memory_bytes"),
            raw_end=e,
        )


def exec_body(cmd: str | Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None,
              cwd: str | None, stdin: str | None, output_limit: int | None,
              user: int | None = None, trusted: bool = False,
              kill_leftovers: bool = False) -> dict[str, Any]:
    """The ``POST .../exec`` body. A string runs through ``/bin/sh -c``; a list is argv.
    ``trusted``: a grader exec (system paths as the layers have them, refused if the
    workload changed a protected path); ``kill_leftovers``: kill every workload process of
    the sandbox first."""
    body: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    if timeout is not None:
        body["timeout_s"] = timeout
    if env:
        body["env"] = dict(env)
    if cwd:
        body["cwd"] = cwd
    if stdin is not None:
        body["stdin"] = stdin
    if output_limit is not None:
        body["output_limit"] = output_limit
    if user is not None:
        body["uid"] = body["gid"] = user
    if trusted:
        body["trusted"] = True
    if kill_leftovers:
        body["kill_leftovers"] = True
    return body


def create_body(image: str | None, layers: Sequence[str] | None, *, id: str | None,
                cpus: float | None, memory_bytes: int | None, pids: int | None,
                disk_bytes: int | None, env: Mapping[str, str] | None, timeout: float | None,
                idle_timeout: float | None, labels: Mapping[str, str] | None,
                task_profile: str | None = None,
                seccomp_profile: str | None = None, memory_request_bytes: int | None = None,
                qos: str | None = None,
                auto_pause_after: float | None = None,
                network: Any = None,
                backend: str | None = None) -> dict[str, Any]:
    """The ``POST /v1/sandboxes`` body."""
    body: dict[str, Any] = {}
    if backend is not None:
        body["backend"] = backend
    if image is not None:
        body["image"] = image
    if layers is not None:
        body["layers"] = list(layers)
    if id is not None:
        body["id"] = id
    res = {k: v for k, v in (("cpus", cpus), ("memory_bytes", memory_bytes), ("pids", pids),
                             ("disk_bytes", disk_bytes),
                             ("memory_request_bytes", memory_request_bytes)) if v is not None}
    if res:
        body["resources"] = res
    if env:
        body["env"] = dict(env)
    if timeout is not None:
        body["ttl_s"] = timeout
    if idle_timeout is not None:
        body["idle_timeout_s"] = idle_timeout
    if labels:
        body["labels"] = dict(labels)
    if task_profile is not None:
        body["task_profile"] = task_profile
    if seccomp_profile is not None:
        body["seccomp_profile"] = seccomp_profile
    if qos is not None:
        body["qos"] = qos
    if auto_pause_after is not None:
        body["auto_pause_after_s"] = auto_pause_after
    if network is not None:
        body["network"] = network_value(network)
    return body


def network_value(network: Any) -> Any:
    """A ``network`` argument as the API takes it: ``"none"``, ``{"allow": [RULE, ...]}``, a
    list of rules (shorthand for ``{"allow": [...]}``), or the DSec form ``{"pypi": True,
    "npm": False}`` (the services set to true are allowed)."""
    if network == "none" or (isinstance(network, str) and network != "none"):
        return network
    if isinstance(network, list | tuple):
        return {"allow": list(network)}
    if isinstance(network, Mapping) and "allow" not in network and network and all(
            isinstance(v, bool) for v in network.values()):
        return {"allow": [k for k, v in network.items() if v]}
    return dict(network) if isinstance(network, Mapping) else network


def describe(cmd: str | Sequence[str]) -> str:
    """A shell-like rendering of a command, for messages."""
    return cmd if isinstance(cmd, str) else shlex.join(cmd)
