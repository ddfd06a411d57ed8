"""Pieces shared by the sync and async SDK: request bodies and the exec result."""

from __future__ import annotations

import base64
import codecs
import inspect
import json
import random
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar
from urllib.parse import quote, urlencode

from edged.client.errors import BadRequestError, PayloadTooLargeError

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


def path_for(*parts: str, query: dict[str, Any] | list[tuple[str, str]] | None = None) -> str:
    """``/v1/...`` with each part percent-encoded (``:`` and ``/`` of image refs kept)."""
    p = "/v1/" + "/".join(quote(x, safe=":/") for x in parts)
    if query:
        p += "?" + urlencode(query)
    return p


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries a request the node refused with 503 because it is full
    (``capacity_exhausted``): up to ``retries`` more times, after the ``Retry-After`` the
    daemon named, else ``backoff_s`` doubling with each attempt (times a jitter in
    [0.5, 1.5)); no wait longer than ``max_wait_s`` seconds. A request whose body is a
    stream is never retried (it cannot be sent twice). ``RetryPolicy(retries=0)``: none."""

    retries: int = 3
    backoff_s: float = 0.5
    max_wait_s: float = 30.0

    def wait(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        if retry_after is not None and retry_after >= 0:
            return float(min(retry_after, self.max_wait_s))
        return float(min(self.backoff_s * 2.0 ** attempt * (0.5 + random.random()),
                         self.max_wait_s))


def merge_env(env: Mapping[str, str] | None,
              envs: Mapping[str, str] | None) -> dict[str, str] | None:
    """``env`` and E2B's ``envs`` together (both given: one dict of both)."""
    if env is None and envs is None:
        return None
    return {**(env or {}), **(envs or {})}


def uid_of(user: int | str | None) -> int | None:
    """A uid, or ``"root"``; other names need the sandbox's passwd: give the number.
    Raises :class:`~edged.client.errors.BadRequestError` for another name."""
    if user is None or isinstance(user, int):
        return user
    if user == "root":
        return 0
    if user.isdigit():
        return int(user)
    raise BadRequestError(f"user {user!r}: give a uid (only 'root' is known by name)")


def fs_call(sandbox_id: str, op: str, **args: Any) -> tuple[str, str, Any]:
    """(method, path, JSON body) of a file operation of ``/v1/sandboxes/{id}/fs``: ``list``
    (``path``, ``depth``), ``stat`` (``path``), ``mkdir`` (``path``, ``parents``),
    ``remove`` (``path``), ``rename`` (``src``, ``dst``)."""
    if op in ("list", "stat"):
        q = {k: str(v) for k, v in args.items()}
        return "GET", path_for("sandboxes", sandbox_id, "fs", op, query=q), None
    if op in ("mkdir", "remove", "rename"):
        return "POST", path_for("sandboxes", sandbox_id, "fs", op), dict(args)
    raise ValueError(f"no file operation {op!r}")


@dataclass
class ExecResult:
    """The outcome of one command.

    ``exit_code``: the exit status (None unless ``reason == "exited"``; ``returncode`` is
    the same). ``reason``: ``exited | signalled | timeout | oom | output_limit | killed``
    (a session run: ``session_ended`` too). ``stdout``/``stderr``: text (UTF-8, invalid
    bytes replaced); ``stdout_bytes``/``stderr_bytes``: the bytes as written; ``output``:
    ``(stream, text)`` chunks in the order they came (``combined``: their text joined).
    Partial output is kept on timeout or limit. ``duration``: seconds. ``message``: what the
    daemon says more of this end, when it does (e.g. a timeout whose process could not be
    reaped), else None.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    reason: str
    duration: float
    signal: int | None = None
    exec_id: int | None = None
    peak_memory_bytes: int | None = None
    message: str | None = None
    raw_end: dict[str, Any] = field(default_factory=dict, repr=False)
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)
    output: list[tuple[str, str]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """True if the command exited with status 0."""
        return self.reason == "exited" and self.exit_code == 0

    @property
    def returncode(self) -> int | None:
        """``exit_code`` under subprocess's and Modal's name."""
        return self.exit_code

    @property
    def combined(self) -> str:
        """stdout and stderr interleaved as they came."""
        return "".join(t for _, t in self.output)

    def check(self) -> ExecResult:
        """Raise :class:`~edged.client.errors.CommandExitError` unless the command exited
        with status 0; returns itself otherwise."""
        if not self.ok:
            from edged.client.errors import CommandExitError

            raise CommandExitError(self)
        return self


class ExecCollector:
    """Folds exec events into an :class:`ExecResult`, calling the output callbacks with
    text as it comes. Output events may be text or base64 (``"encoding": "base64"``, what
    the SDK asks for: bytes arrive as written)."""

    def __init__(self, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                 b64: bool = True):
        self.raw: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.output: list[tuple[str, str]] = []
        self.cbs = {"stdout": on_stdout, "stderr": on_stderr}
        self.dec = {s: codecs.getincrementaldecoder("utf-8")("replace")
                    for s in ("stdout", "stderr")}
        self.b64 = b64
        self.exec_id: int | None = None
        self.end: dict[str, Any] | None = None

    def feed(self, ev: dict[str, Any]) -> tuple[str, bytes] | None:
        """Take one event; returns ``(stream, bytes)`` for an output event."""
        if "start" in ev:
            self.exec_id = ev["start"].get("exec_id")
        got = None
        for name in ("stdout", "stderr"):
            if name in ev:
                data = base64.b64decode(ev[name]) if self.b64 else str(ev[name]).encode()
                got = (name, data)
                self._text(name, data, final=False)
        if "end" in ev:
            self.end = ev["end"]
            for name in ("stdout", "stderr"):
                self._text(name, b"", final=True)
        return got

    def _text(self, name: str, data: bytes, final: bool) -> None:
        if data:
            self.raw[name].append(data)
        text = self.dec[name].decode(data, final)
        if text:
            self.output.append((name, text))
            cb = self.cbs[name]
            if cb is not None:
                cb(text)

    def result(self) -> ExecResult:
        from edged.client.errors import DaemonUnavailableError

        if self.end is None:
            raise DaemonUnavailableError("exec stream ended without an end event (the "
                                         "connection to the daemon was lost)")
        e = self.end
        out, err = b"".join(self.raw["stdout"]), b"".join(self.raw["stderr"])
        return ExecResult(
            exit_code=e.get("exit_code"),
            stdout="".join(t for s, t in self.output if s == "stdout"),
            stderr="".join(t for s, t in self.output if s == "stderr"),
            reason=e["reason"],
            duration=float(e.get("duration_s", 0.0)),
            signal=e.get("signal"),
            exec_id=self.exec_id,
            peak_memory_bytes=e.get("peak_memory_bytes"),
            message=e.get("message"),
            raw_end=e,
            stdout_bytes=out,
            stderr_bytes=err,
            output=self.output,
        )


def exec_body(cmd: str | Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None,
              cwd: str | None, stdin: str | bool | None, output_limit: int | None,
              user: int | None = None, trusted: bool = False,
              kill_leftovers: bool = False, pty: bool = False,
              size: tuple[int, int] | None = None) -> dict[str, Any]:
    """The ``POST .../exec`` body. A string runs through ``/bin/sh -c``; a list is argv.
    ``stdin``: text fed then closed, or True (kept open for a process handle).
    ``trusted``: a grader exec (system paths as the layers have them, refused if the
    workload changed a protected path); ``kill_leftovers``: kill every workload process of
    the sandbox first. ``pty``: on a pseudo-terminal of ``size`` (rows, cols). Output
    comes base64-encoded (bytes as written)."""
    body: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    body["encoding"] = "base64"
    if pty:
        body["pty"] = True
        if size is not None:
            body["rows"], body["cols"] = size
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


class ExecOptions(TypedDict, total=False):
    """The options of an exec, by keyword (:meth:`edged.client.Sandbox.exec`,
    :meth:`edged.client.AsyncSandbox.exec`; what each means is said there): one list for
    both, checked by type at the call (``**opts: Unpack[ExecOptions]``, PEP 692)."""

    timeout: float | None
    env: Mapping[str, str] | None
    envs: Mapping[str, str] | None
    cwd: str | None
    stdin: str | None
    output_limit: int | None
    user: int | str | None
    on_stdout: OutputCallback | None
    on_stderr: OutputCallback | None
    trusted: bool
    kill_leftovers: bool
    check: bool


def exec_request(cmd: str | Sequence[str], opts: ExecOptions, *,
                 background: bool = False) -> dict[str, Any]:
    """The ``POST .../exec`` body (:func:`exec_body`) of an exec's ``cmd`` and ``opts``
    (``background``: stdin kept open unless given). Raises ``TypeError`` for an option
    :class:`ExecOptions` does not have (as a keyword the signature lacked would),
    :class:`~edged.client.errors.BadRequestError` for a ``user`` name other than root."""
    unknown = sorted(set(opts) - set(ExecOptions.__annotations__))
    if unknown:
        raise TypeError(f"exec() got an unexpected keyword argument {unknown[0]!r}")
    stdin = opts.get("stdin")
    return exec_body(cmd, timeout=opts.get("timeout"),
                     env=merge_env(opts.get("env"), opts.get("envs")), cwd=opts.get("cwd"),
                     stdin=True if background and stdin is None else stdin,
                     output_limit=opts.get("output_limit"), user=uid_of(opts.get("user")),
                     trusted=opts.get("trusted", False),
                     kill_leftovers=opts.get("kill_leftovers", False))


def create_body(image: str | None, layers: Sequence[str] | None, *, id: str | None,
                cpus: float | None, memory_bytes: int | None, pids: int | None,
                disk_bytes: int | None, env: Mapping[str, str] | None, timeout: float | None,
                idle_timeout: float | None, labels: Mapping[str, str] | None,
                task_profile: str | None = None,
                seccomp_profile: str | None = None, memory_request_bytes: int | None = None,
                qos: str | None = None,
                auto_pause_after: float | None = None,
                network: Any = None, template: str | None = None,
                envs: Mapping[str, str] | None = None, cpu: float | None = None,
                memory_mib: int | None = None,
                backend: str | None = None) -> dict[str, Any]:
    """The ``POST /v1/sandboxes`` body. E2B's and Modal's names are taken too: ``template``
    (``image``), ``envs`` (merged with ``env``), ``cpu`` (``cpus``), ``memory_mib``
    (``memory_bytes`` in MiB); the edged name wins where both are given."""
    image = image if image is not None else template
    env = merge_env(env, envs)
    cpus = cpus if cpus is not None else cpu
    if memory_mib is not None and memory_bytes is None:
        memory_bytes = memory_mib << 20
    body = _given(backend=backend, image=image,
                  layers=None if layers is None else list(layers), id=id)
    res = _given(cpus=cpus, memory_bytes=memory_bytes, pids=pids, disk_bytes=disk_bytes,
                 memory_request_bytes=memory_request_bytes)
    if res:
        body["resources"] = res
    if env:
        body["env"] = dict(env)
    body.update(_given(ttl_s=timeout, idle_timeout_s=idle_timeout))
    if labels:
        body["labels"] = dict(labels)
    body.update(_given(task_profile=task_profile, seccomp_profile=seccomp_profile, qos=qos,
                       auto_pause_after_s=auto_pause_after,
                       network=None if network is None else network_value(network)))
    return body


def _given(**fields: Any) -> dict[str, Any]:
    """The ``fields`` that are not None (a request body's optional fields)."""
    return {k: v for k, v in fields.items() if v is not None}


TransportT = TypeVar("TransportT")


class SandboxBase(Generic[TransportT]):
    """What the sync and async sandbox share: the sandbox object ``info`` (``GET
    /v1/sandboxes/{id}``), its ``id``, the transport to its node and the answer of the last
    ``snapshot``."""

    def __init__(self, info: dict[str, Any], transport: TransportT) -> None:
        self.info = info
        self.id: str = info["id"]
        self._t = transport
        #: the answer of the last :meth:`snapshot`
        self.last_snapshot: dict[str, Any] = {}


#: :func:`create_body`'s arguments: every create takes them by these names (the SDK's
#: ``Sandbox.create`` and ``AsyncSandbox.create``, the cluster clients' ``create``)
CREATE_ARGS = tuple(inspect.signature(create_body).parameters)


def create_body_of(args: Mapping[str, Any], **given: Any) -> dict[str, Any]:
    """:func:`create_body` of a create's own arguments: ``args``, its ``locals()`` (it takes
    every one of :data:`CREATE_ARGS` by that name), with ``given`` over them (the cluster's
    ``id`` for the node tried). One list of the create's fields for the sync and async SDK
    and the cluster clients, whose signatures stay written out for their readers (the tests
    check they take every one)."""
    return create_body(**{**{n: args[n] for n in CREATE_ARGS}, **given})


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
