"""The synchronous SDK: :class:`Sandbox` (E2B/Modal-style names)."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, Literal, Unpack, overload

from edged.client._common import (
    ExecCollector,
    ExecOptions,
    ExecResult,
    OutputCallback,
    RetryPolicy,
    SandboxBase,
    create_body_of,
    exec_body,
    exec_request,
    fs_call,
    network_value,
    path_for,
    uid_of,
)
from edged.client._http import Transport
from edged.client.errors import NotFoundError
from edged.client.process import ProcessHandle
from edged.client.session import Session, session_body

FILE_CHUNK = 256 << 10


class Commands:
    """``sbx.commands.run(...)``: :meth:`Sandbox.exec` as E2B has it: a non-zero exit
    raises :class:`~edged.client.CommandExitError` (``check=False`` returns it)."""

    def __init__(self, sbx: Sandbox) -> None:
        self._sbx = sbx

    def run(self, cmd: str | Sequence[str], *, check: bool = True, **kw: Any) -> Any:
        """See :meth:`Sandbox.exec` (``background=True``: a process handle)."""
        return self._sbx.exec(cmd, check=check and not kw.get("background"), **kw)


class Files:
    """``sbx.files``: streamed file transfer, paths resolved inside the sandbox root."""

    def __init__(self, sbx: Sandbox) -> None:
        self._sbx = sbx

    def write(self, path: str, data: str | bytes | IO[bytes] | Iterable[bytes],
              mode: int = 0o644, *, parents: bool = True) -> int:
        """Write ``data`` (text as UTF-8, bytes, a binary file object or an iterable of
        chunks, streamed) to absolute ``path``, making its missing parent directories
        unless ``parents`` is False; returns bytes written."""
        body: bytes | Iterable[bytes]
        if isinstance(data, str):
            body = data.encode()
        elif isinstance(data, bytes):
            body = data
        elif hasattr(data, "read"):
            f = data

            def chunks() -> Iterator[bytes]:
                while chunk := f.read(FILE_CHUNK):
                    yield chunk

            body = chunks()
        else:
            body = data
        q = {"path": path, "mode": f"{mode:o}", "parents": "1" if parents else "0"}
        out = self._sbx._t.upload(path_for("sandboxes", self._sbx.id, "files", query=q), body)
        return int(out["bytes"])

    def iter_bytes(self, path: str) -> Iterator[bytes]:
        """Stream the file at ``path`` in chunks."""
        yield from self._sbx._t.download(path_for("sandboxes", self._sbx.id, "files",
                                                  query={"path": path}), FILE_CHUNK)

    def read_bytes(self, path: str) -> bytes:
        """The whole file at ``path``."""
        return b"".join(self.iter_bytes(path))

    def read(self, path: str) -> str:
        """The file at ``path`` decoded as UTF-8 (invalid bytes replaced)."""
        return self.read_bytes(path).decode("utf-8", "replace")

    def list(self, path: str, depth: int = 1) -> builtins.list[dict[str, Any]]:
        """Entries below the directory ``path`` (``depth`` levels), sorted by path: each
        ``{"name", "path", "type": "file"|"dir"|"symlink", "size", "mode", "permissions",
        "owner", "group", "mtime", "symlink_target"}``."""
        data = self._sbx._t.json(*fs_call(self._sbx.id, "list", path=path, depth=depth))
        return builtins.list(data["entries"])

    def stat(self, path: str) -> dict[str, Any]:
        """The entry at ``path`` (a symlink as itself); ``NotFoundError`` if none."""
        return dict(self._sbx._t.json(*fs_call(self._sbx.id, "stat", path=path)))

    def exists(self, path: str) -> bool:
        """Whether anything is at ``path``."""
        try:
            self.stat(path)
        except NotFoundError:
            return False
        return True

    def mkdir(self, path: str, *, parents: bool = True) -> bool:
        """Make the directory ``path`` (and its parents); False if it already was one."""
        out = self._sbx._t.json(*fs_call(self._sbx.id, "mkdir", path=path, parents=parents))
        return bool(out["created"])

    def remove(self, path: str) -> None:
        """Remove a file, a symlink or a directory with all it holds."""
        self._sbx._t.json(*fs_call(self._sbx.id, "remove", path=path))

    def rename(self, src: str, dst: str) -> dict[str, Any]:
        """Move ``src`` to ``dst``; returns the entry at ``dst``."""
        return dict(self._sbx._t.json(*fs_call(self._sbx.id, "rename", src=src, dst=dst)))


class Sandbox(SandboxBase[Transport]):
    """One sandbox on an edged node. Use as a context manager to kill it on exit.

    Errors: the :mod:`edged.client.errors` hierarchy (``NotFoundError``,
    ``InvalidStateError``, ``CapacityExhaustedError`` with ``retry_after``,
    ``BadRequestError``, ``BackendError``, ``DaemonUnavailableError``).
    """

    def __init__(self, info: dict[str, Any], transport: Transport) -> None:
        super().__init__(info, transport)
        self.commands = Commands(self)
        self.files = Files(self)

    @classmethod
    def create(cls, image: str | None = None, layers: Sequence[str] | None = None, *,
               id: str | None = None, cpus: float | None = None,
               memory_bytes: int | None = None, pids: int | None = None,
               disk_bytes: int | None = None, env: Mapping[str, str] | None = None,
               timeout: float | None = None, idle_timeout: float | None = None,
               labels: Mapping[str, str] | None = None, socket: str | None = None,
               task_profile: str | None = None,
               seccomp_profile: str | None = None, memory_request_bytes: int | None = None,
               qos: str | None = None, auto_pause_after: float | None = None,
               network: Any = None, template: str | None = None,
               envs: Mapping[str, str] | None = None, cpu: float | None = None,
               memory_mib: int | None = None, retry: RetryPolicy | None = None,
               backend: str | None = None) -> Sandbox:
        """Create a sandbox from ``image`` ("name:tag") or ``layers`` (digests, bottom first).
        ``timeout``: TTL in seconds (0: none); ``idle_timeout``: seconds without exec.
        ``task_profile`` / ``seccomp_profile``: confinement profile names (node default:
        ``default``). ``memory_request_bytes``: what it will use soon (admission sets it
        aside; ``memory_bytes`` is the limit it may burst to). ``qos``: ``"best_effort"``
        (default) or ``"latency_sensitive"``. ``auto_pause_after``: pause it once idle this
        many seconds (any request resumes it). ``network``: ``"none"`` (default), ``{"allow":
        ["pypi", "pypi.org:443", "203.0.113.0/24"]}``, a list of rules, or the DSec form
        ``{"pypi": True, "npm": False}``. ``backend``: the node's backend to run it
        (``GET /v1/node`` lists them; None: the node's default). E2B's and Modal's names work
        too: ``template`` (``image``), ``envs`` (``env``), ``cpu`` (``cpus``), ``memory_mib``
        (``memory_bytes`` in MiB). ``retry``: how a full node's 503 is retried, by this
        sandbox's every request (default :class:`~edged.client.RetryPolicy`: 3 times)."""
        t = Transport(socket, retry=retry)
        body = create_body_of(locals())
        return cls(t.json("POST", path_for("sandboxes"), body), t)

    @classmethod
    def connect(cls, sandbox_id: str, socket: str | None = None,
                retry: RetryPolicy | None = None) -> Sandbox:
        """Attach to an existing sandbox (``NotFoundError`` if none)."""
        t = Transport(socket, retry=retry)
        return cls(t.json("GET", path_for("sandboxes", sandbox_id)), t)

    @classmethod
    def list(cls, labels: Mapping[str, str] | None = None,
             socket: str | None = None, retry: RetryPolicy | None = None) -> list[Sandbox]:
        """Sandboxes on the node, optionally those carrying every label given."""
        t = Transport(socket, retry=retry)
        q = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        data = t.json("GET", path_for("sandboxes", query=q))
        return [cls(s, t) for s in data["sandboxes"]]

    def refresh(self) -> dict[str, Any]:
        """Re-read and return the sandbox object."""
        self.info = self._t.json("GET", path_for("sandboxes", self.id))
        return self.info

    @property
    def state(self) -> str:
        """Current state (a round trip)."""
        return str(self.refresh()["state"])

    @overload
    def exec(self, cmd: str | Sequence[str], *, background: Literal[False] = False,
             **opts: Unpack[ExecOptions]) -> ExecResult: ...

    @overload
    def exec(self, cmd: str | Sequence[str], *, background: Literal[True],
             **opts: Unpack[ExecOptions]) -> ProcessHandle: ...

    def exec(self, cmd: str | Sequence[str], *, background: bool = False,
             **opts: Unpack[ExecOptions]) -> ExecResult | ProcessHandle:
        """Run ``cmd`` (a string via ``/bin/sh -c``, or an argv list) and wait for it.
        Options (:class:`~edged.client._common.ExecOptions`, by keyword): ``timeout``
        (seconds) kills the whole process tree; the result keeps partial output and says
        ``reason == "timeout"``. ``env`` (``envs``: the same under E2B's name), ``cwd``,
        ``stdin`` (text fed, then closed), ``output_limit`` (bytes kept per stream),
        ``user``: a uid, or ``"root"``. ``on_stdout``, ``on_stderr``: callbacks that get
        text chunks as they arrive. ``trusted``: a grader exec; ``kill_leftovers``: kill
        every workload process first. ``check``: raise
        :class:`~edged.client.CommandExitError` unless it exits with 0 (E2B's
        ``commands.run`` does). ``background``: return a
        :class:`~edged.client.process.ProcessHandle` at once (stdin kept open:
        ``write_stdin``, ``close_stdin``; ``wait``, ``signal``, ``kill``)."""
        body = exec_request(cmd, opts, background=background)
        on_stdout, on_stderr = opts.get("on_stdout"), opts.get("on_stderr")
        if background:
            return ProcessHandle(self, body, on_stdout=on_stdout, on_stderr=on_stderr)
        col = ExecCollector(on_stdout, on_stderr)
        for ev in self._t.ndjson("POST", path_for("sandboxes", self.id, "exec"), body):
            col.feed(ev)
        r = col.result()
        return r.check() if opts.get("check") else r

    def pty(self, cmd: str | Sequence[str] = ("/bin/sh", "-i"), *, rows: int = 24,
            cols: int = 80, env: Mapping[str, str] | None = None, cwd: str | None = None,
            user: int | str | None = None, timeout: float | None = None,
            on_stdout: OutputCallback | None = None) -> ProcessHandle:
        """Start ``cmd`` on a pseudo-terminal of ``rows`` x ``cols``: a
        :class:`~edged.client.process.ProcessHandle` whose ``write_stdin`` types, whose
        output (``stdout``) is the terminal's, and which ``resize``\\s."""
        body = exec_body(cmd, timeout=timeout, env=env, cwd=cwd, stdin=True,
                         output_limit=None, user=uid_of(user), pty=True, size=(rows, cols))
        return ProcessHandle(self, body, on_stdout=on_stdout)

    def signal(self, sig: int | str = "SIGTERM", exec_id: int | None = None) -> builtins.list[int]:
        """Signal one exec or all running execs; returns the exec ids signalled."""
        body: dict[str, Any] = {"signal": sig}
        if exec_id is not None:
            body["exec_id"] = exec_id
        out = self._t.json("POST", path_for("sandboxes", self.id, "signal"), body)
        return list(out["exec_ids"])

    def kill_processes(self) -> int:
        """SIGKILL every process in the sandbox (running execs, whatever they left running,
        fork bombs) but its init; the sandbox stays up. Returns how many were killed."""
        body = {"signal": 9, "all": True}
        out = self._t.json("POST", path_for("sandboxes", self.id, "signal"), body)
        return int(out["killed"])

    def set_network(self, network: Any) -> dict[str, Any]:
        """Replace the sandbox's egress policy at once (same forms as ``create``'s
        ``network``; ``"none"`` allows nothing); connections the new policy forbids are cut.
        Returns ``{"policy", "generation", "cut"}``."""
        out = self._t.json("PUT", path_for("sandboxes", self.id, "network"),
                             network_value(network))
        return dict(out)

    def network(self) -> dict[str, Any]:
        """The sandbox's network: ``policy`` (``"none"`` or ``{"allow": [...]}``), and for
        a networked one ``address``/``address6``, ``gateway``, ``resolver``, ``generation``
        (policy changes so far), ``learned`` (addresses installed from DNS answers),
        ``denied`` (refusals counted in the kernel), ``proxied`` (open SNI/Host-checked
        connections)."""
        return dict(self._t.json("GET", path_for("sandboxes", self.id, "network")))

    def pause(self) -> None:
        """Freeze the sandbox."""
        self.info = self._t.json("POST", path_for("sandboxes", self.id, "pause"), {})

    def resume(self) -> None:
        """Thaw the sandbox."""
        self.info = self._t.json("POST", path_for("sandboxes", self.id, "resume"), {})

    def set_timeout(self, seconds: float) -> None:
        """Make the sandbox expire ``seconds`` from now (0: never)."""
        self.info = self._t.json("POST", path_for("sandboxes", self.id, "timeout"),
                                 {"ttl_s": seconds})

    def stats(self) -> dict[str, int]:
        """Usage: ``memory_bytes`` (the sandbox's memory: its processes and what its
        writable layer holds in RAM), ``upper_bytes`` (what the writable layer holds),
        ``cpu_usage_ns``, ``pids``."""
        return dict(self._t.json("GET", path_for("sandboxes", self.id, "stats")))

    def events(self, since: int = 0, kind: str | None = None) -> builtins.list[dict[str, Any]]:
        """The sandbox's security events after sequence number ``since`` (up to 1000), e.g.
        ``{"kind": "seccomp_denied", "syscall": "mount", "pid": 12, ...}``; still readable
        for a while after the sandbox is gone."""
        q: builtins.list[tuple[str, str]] = [("since", str(since))]
        if kind is not None:
            q.append(("kind", kind))
        data = self._t.json("GET", path_for("sandboxes", self.id, "events", query=q))
        return builtins.list(data["events"])

    def session(self, *, id: str | None = None, shell: str | None = None,
                env: Mapping[str, str] | None = None, cwd: str | None = None,
                user: int | None = None) -> Session:
        """Start a persistent shell session (``shell``: ``"bash"``, ``"sh"`` or None: bash
        if the sandbox has it). See :class:`edged.client.session.Session`."""
        body = session_body(id=id, shell=shell, env=env, cwd=cwd, user=user)
        return Session(self, self._t.json("POST", path_for("sandboxes", self.id, "sessions"),
                                          body))

    def snapshot(self, kind: str = "workspace", exclude: Sequence[str] = (),
                 image: str | None = None) -> str:
        """The sandbox's disk changes as a new layer; returns its digest, so that
        ``Sandbox.create(layers=[*sbx.info["layers"], digest])`` starts from them. The
        sandbox is frozen while its changes are copied, then thawed. ``exclude``: path
        patterns left out (``"__pycache__"``, ``"/tmp"``, ``"/root/.cache"``; a pattern
        with a ``/`` is anchored at ``/``, ``**`` crosses directories); ``image``: also
        register the layers + the new one as this ``name:tag``. The whole answer (sizes,
        counts, ``frozen_s``) is in :attr:`last_snapshot`."""
        body: dict[str, Any] = {"kind": kind, "exclude": list(exclude)}
        if image is not None:
            body["image"] = image
        self.last_snapshot = dict(self._t.json("POST", path_for("sandboxes", self.id,
                                                                "snapshot"), body))
        return str(self.last_snapshot["digest"])

    def sessions(self) -> builtins.list[Session]:
        """The sandbox's shell sessions, oldest first."""
        data = self._t.json("GET", path_for("sandboxes", self.id, "sessions"))
        return [Session(self, s) for s in data["sessions"]]

    def kill(self) -> None:
        """Destroy the sandbox (idempotent: an already gone sandbox is fine)."""
        with contextlib.suppress(NotFoundError):
            self.info = self._t.json("DELETE", path_for("sandboxes", self.id))

    def terminate(self) -> None:
        """:meth:`kill` under Modal's name."""
        self.kill()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
