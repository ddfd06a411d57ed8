"""The asyncio SDK: :class:`AsyncSandbox`, the methods of :class:`edged.client.Sandbox`,
awaited (not yet: process handles and PTYs, ``exec(background=True)`` and ``pty()``; run an
exec as a task instead). aiohttp is imported when first used, not when ``edged.client`` is
imported."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import io
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack

from edged.client._common import (
    ExecCollector,
    ExecOptions,
    ExecResult,
    OutputCallback,
    RetryPolicy,
    SandboxBase,
    create_body_of,
    encode_json,
    exec_request,
    fs_call,
    network_value,
    path_for,
)
from edged.client._http import default_socket, retry_policy, stream_cut
from edged.client.errors import (
    CapacityExhaustedError,
    DaemonUnavailableError,
    NotFoundError,
    from_body,
)
from edged.client.session import SessionBase, run_body, session_body

if TYPE_CHECKING:
    import aiohttp

FILE_CHUNK = 256 << 10


class AsyncTransport:
    """An aiohttp session over the daemon's Unix socket. A request refused with 503 (the
    node is full) is retried as ``retry`` says (see :class:`edged.client._http.Transport`);
    one whose body is a stream (an async iterator) is not."""

    #: what request paths are joined to (a subclass may reach the daemon otherwise, as the
    #: cluster's HTTP relay does)
    base_url = "http://edged"

    def __init__(self, socket_path: str | None = None, *, retry: RetryPolicy | None = None,
                 retries: int | None = None, backoff_s: float | None = None,
                 max_wait_s: float | None = None) -> None:
        self.socket_path = socket_path or default_socket()
        self.retry = retry_policy(retry, retries, backoff_s, max_wait_s)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            # let the loop run the transports' connection_lost: a loop closed right after
            # (asyncio.run) would leave them unclosed
            await asyncio.sleep(0)

    async def request(self, method: str, path: str, **kw: Any) -> aiohttp.ClientResponse:
        """Send a request (retried on 503, see the class); raise the mapped exception for
        an error status."""
        data = kw.get("data")
        replayable = data is None or isinstance(data, bytes | str)
        attempt = 0
        while True:
            try:
                return await self._request_once(method, path, **kw)
            except CapacityExhaustedError as e:
                if attempt >= self.retry.retries or not replayable:
                    raise
                await asyncio.sleep(self.retry.wait(attempt, e.retry_after))
                attempt += 1

    async def _request_once(self, method: str, path: str,
                            **kw: Any) -> aiohttp.ClientResponse:
        import aiohttp

        try:
            resp = await self.session().request(method, self.base_url + path, **kw)
        except aiohttp.ClientConnectionError as e:
            raise DaemonUnavailableError(f"edged at {self.socket_path}: {e}") from e
        if resp.status >= 400:
            try:
                body = await resp.json(content_type=None)
            except ValueError:
                body = None
            if resp.status == 413:
                # Refused before the body was read: what is still buffered for the daemon
                # would hold the connection until written; drop it at once.
                conn = resp.connection
                if conn is not None and conn.transport is not None:
                    conn.transport.abort()
                resp.close()
            else:
                resp.release()
            raise from_body(resp.status, body, resp.headers.get("Retry-After"))
        return resp

    async def json(self, method: str, path: str, payload: Any = None) -> Any:
        """A JSON request/response round trip."""
        resp = await self.request(method, path, **json_kw(payload))
        async with resp:
            return await resp.json()

    async def ndjson(self, method: str, path: str, payload: Any) -> AsyncIterator[dict[str, Any]]:
        """The objects of an NDJSON response, as they arrive; one cut before its ``end``
        event raises :class:`~edged.client.errors.DaemonUnavailableError` (see
        :meth:`edged.client._http.Transport.ndjson`)."""
        import aiohttp

        resp = await self.request(method, path, **json_kw(payload))
        ended = False
        async with resp:
            try:
                async for line in resp.content:
                    if line.strip():
                        ev = json.loads(line)
                        ended = ended or "end" in ev
                        yield ev
            except (aiohttp.ClientError, OSError, ValueError) as e:
                raise stream_cut(self.socket_path, e) from e
        if not ended:
            raise stream_cut(self.socket_path, None)

    async def upload(self, path: str, body: bytes | AsyncIterator[bytes]) -> Any:
        """``PUT`` a byte body (whole, or streamed from an async iterator); the JSON answer."""
        resp = await self.request("PUT", path, data=body)
        async with resp:
            return await resp.json()

    async def download(self, path: str, chunk: int = FILE_CHUNK) -> AsyncIterator[bytes]:
        """``GET`` a byte body, streamed in chunks of up to ``chunk`` bytes."""
        resp = await self.request("GET", path)
        async with resp:
            async for data in resp.content.iter_chunked(chunk):
                yield data


def json_kw(payload: Any) -> dict[str, Any]:
    """aiohttp request arguments sending ``payload`` as a JSON body (see
    :func:`~edged.client._common.encode_json`). A body over 1 MiB goes as a file-like
    object: aiohttp warns (ResourceWarning) about one given as bytes."""
    if payload is None:
        return {}
    data = encode_json(payload)
    return {"data": io.BytesIO(data) if len(data) > 1 << 20 else data,
            "headers": {"Content-Type": "application/json"}}


class AsyncCommands:
    """``sbx.commands.run(...)``: :meth:`AsyncSandbox.exec` as E2B has it: a non-zero exit
    raises :class:`~edged.client.CommandExitError` (``check=False`` returns it)."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    async def run(self, cmd: str | Sequence[str], *, check: bool = True,
                  **kw: Any) -> ExecResult:
        """See :meth:`AsyncSandbox.exec`."""
        return await self._sbx.exec(cmd, check=check, **kw)


class AsyncFiles:
    """``sbx.files``: streamed file transfer."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    async def write(self, path: str, data: str | bytes | AsyncIterator[bytes],
                    mode: int = 0o644, *, parents: bool = True) -> int:
        """Write text (UTF-8), bytes or an async iterator of chunks to ``path``, making its
        missing parent directories unless ``parents`` is False; returns bytes written."""
        body = data.encode() if isinstance(data, str) else data
        q = {"path": path, "mode": f"{mode:o}", "parents": "1" if parents else "0"}
        out = await self._sbx._t.upload(
            path_for("sandboxes", self._sbx.id, "files", query=q), body)
        return int(out["bytes"])

    async def iter_bytes(self, path: str) -> AsyncIterator[bytes]:
        """Stream the file at ``path`` in chunks."""
        async for chunk in self._sbx._t.download(
                path_for("sandboxes", self._sbx.id, "files", query={"path": path}), FILE_CHUNK):
            yield chunk

    async def read_bytes(self, path: str) -> bytes:
        """The whole file at ``path``."""
        return b"".join([c async for c in self.iter_bytes(path)])

    async def read(self, path: str) -> str:
        """The file at ``path`` as UTF-8 text (invalid bytes replaced)."""
        return (await self.read_bytes(path)).decode("utf-8", "replace")

    async def list(self, path: str, depth: int = 1) -> builtins.list[dict[str, Any]]:
        """See :meth:`edged.client.sandbox.Files.list`."""
        t, sid = self._sbx._t, self._sbx.id
        return builtins.list((await t.json(*fs_call(sid, "list", path=path,
                                                    depth=depth)))["entries"])

    async def stat(self, path: str) -> dict[str, Any]:
        """The entry at ``path`` (a symlink as itself); ``NotFoundError`` if none."""
        return dict(await self._sbx._t.json(*fs_call(self._sbx.id, "stat", path=path)))

    async def exists(self, path: str) -> bool:
        """Whether anything is at ``path``."""
        try:
            await self.stat(path)
        except NotFoundError:
            return False
        return True

    async def mkdir(self, path: str, *, parents: bool = True) -> bool:
        """Make the directory ``path`` (and its parents); False if it already was one."""
        out = await self._sbx._t.json(*fs_call(self._sbx.id, "mkdir", path=path,
                                               parents=parents))
        return bool(out["created"])

    async def remove(self, path: str) -> None:
        """Remove a file, a symlink or a directory with all it holds."""
        await self._sbx._t.json(*fs_call(self._sbx.id, "remove", path=path))

    async def rename(self, src: str, dst: str) -> dict[str, Any]:
        """Move ``src`` to ``dst``; returns the entry at ``dst``."""
        return dict(await self._sbx._t.json(*fs_call(self._sbx.id, "rename", src=src,
                                                     dst=dst)))


class AsyncSession(SessionBase["AsyncSandbox"]):
    """A shell session of an :class:`AsyncSandbox` (see :class:`edged.client.session.Session`)."""

    async def run(self, cmd: str, *, timeout: float | None = None,
                  output_limit: int | None = None, on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None) -> ExecResult:
        """See :meth:`edged.client.session.Session.run`."""
        col = ExecCollector(on_stdout, on_stderr)
        path = path_for("sandboxes", self._sbx.id, "sessions", self.id, "run")
        resp = await self._sbx._t.request(
            "POST", path, json=run_body(cmd, timeout=timeout, output_limit=output_limit))
        async with resp:
            async for line in resp.content:
                if line.strip():
                    col.feed(json.loads(line))
        return col.result()

    async def refresh(self) -> dict[str, Any]:
        self.info = await self._sbx._t.json(
            "GET", path_for("sandboxes", self._sbx.id, "sessions", self.id))
        return self.info

    async def close(self) -> None:
        """End the session (idempotent)."""
        with contextlib.suppress(NotFoundError):
            self.info = await self._sbx._t.json(
                "DELETE", path_for("sandboxes", self._sbx.id, "sessions", self.id))

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSandbox(SandboxBase[AsyncTransport]):
    """One sandbox, asyncio flavour. ``async with await AsyncSandbox.create(...) as sbx``
    kills it and closes the session on exit."""

    def __init__(self, info: dict[str, Any], transport: AsyncTransport) -> None:
        super().__init__(info, transport)
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @classmethod
    async def create(cls, image: str | None = None, layers: Sequence[str] | None = None, *,
                     id: str | None = None, cpus: float | None = None,
                     memory_bytes: int | None = None, pids: int | None = None,
                     disk_bytes: int | None = None, env: Mapping[str, str] | None = None,
                     timeout: float | None = None, idle_timeout: float | None = None,
                     labels: Mapping[str, str] | None = None,
                     socket: str | None = None, task_profile: str | None = None,
                     seccomp_profile: str | None = None,
                     memory_request_bytes: int | None = None, qos: str | None = None,
                     auto_pause_after: float | None = None,
                     network: Any = None, template: str | None = None,
                     envs: Mapping[str, str] | None = None, cpu: float | None = None,
                     memory_mib: int | None = None, retry: RetryPolicy | None = None,
                     backend: str | None = None) -> AsyncSandbox:
        """See :meth:`edged.client.Sandbox.create`."""
        t = AsyncTransport(socket, retry=retry)
        body = create_body_of(locals())
        try:
            info = await t.json("POST", path_for("sandboxes"), body)
        except BaseException:
            await t.close()
            raise
        return cls(info, t)

    @classmethod
    async def connect(cls, sandbox_id: str, socket: str | None = None,
                      retry: RetryPolicy | None = None) -> AsyncSandbox:
        """Attach to an existing sandbox."""
        t = AsyncTransport(socket, retry=retry)
        try:
            return cls(await t.json("GET", path_for("sandboxes", sandbox_id)), t)
        except BaseException:
            await t.close()
            raise

    async def refresh(self) -> dict[str, Any]:
        """Re-read and return the sandbox object."""
        self.info = await self._t.json("GET", path_for("sandboxes", self.id))
        return self.info

    async def exec(self, cmd: str | Sequence[str],
                   **opts: Unpack[ExecOptions]) -> ExecResult:
        """See :meth:`edged.client.Sandbox.exec` (no ``background`` here: run it as a task)."""
        body = exec_request(cmd, opts)
        col = ExecCollector(opts.get("on_stdout"), opts.get("on_stderr"))
        async for ev in self._t.ndjson("POST", path_for("sandboxes", self.id, "exec"), body):
            col.feed(ev)
        r = col.result()
        return r.check() if opts.get("check") else r

    async def signal(self, sig: int | str = "SIGTERM", exec_id: int | None = None) -> list[int]:
        """Signal one exec or all running execs."""
        body: dict[str, Any] = {"signal": sig}
        if exec_id is not None:
            body["exec_id"] = exec_id
        out = await self._t.json("POST", path_for("sandboxes", self.id, "signal"), body)
        return list(out["exec_ids"])

    async def kill_processes(self) -> int:
        """SIGKILL every process in the sandbox (running execs, whatever they left running,
        fork bombs) but its init; the sandbox stays up. Returns how many were killed."""
        body = {"signal": 9, "all": True}
        out = await self._t.json("POST", path_for("sandboxes", self.id, "signal"), body)
        return int(out["killed"])

    async def set_network(self, network: Any) -> dict[str, Any]:
        """Replace the sandbox's egress policy at once (same forms as ``create``'s
        ``network``; ``"none"`` allows nothing); connections the new policy forbids are cut.
        Returns ``{"policy", "generation", "cut"}``."""
        out = await self._t.json("PUT", path_for("sandboxes", self.id, "network"),
                             network_value(network))
        return dict(out)

    async def network(self) -> dict[str, Any]:
        """The sandbox's network: ``policy`` (``"none"`` or ``{"allow": [...]}``), and for
        a networked one ``address``/``address6``, ``gateway``, ``resolver``, ``generation``
        (policy changes so far), ``learned`` (addresses installed from DNS answers),
        ``denied`` (refusals counted in the kernel), ``proxied`` (open SNI/Host-checked
        connections)."""
        return dict(await self._t.json("GET", path_for("sandboxes", self.id, "network")))

    async def pause(self) -> None:
        """Freeze the sandbox."""
        self.info = await self._t.json("POST", path_for("sandboxes", self.id, "pause"), {})

    async def resume(self) -> None:
        """Thaw the sandbox."""
        self.info = await self._t.json("POST", path_for("sandboxes", self.id, "resume"), {})

    async def set_timeout(self, seconds: float) -> None:
        """Expire ``seconds`` from now (0: never)."""
        self.info = await self._t.json("POST", path_for("sandboxes", self.id, "timeout"),
                                       {"ttl_s": seconds})

    async def events(self, since: int = 0, kind: str | None = None) -> list[dict[str, Any]]:
        """See :meth:`edged.client.Sandbox.events`."""
        q: list[tuple[str, str]] = [("since", str(since))]
        if kind is not None:
            q.append(("kind", kind))
        data = await self._t.json("GET", path_for("sandboxes", self.id, "events", query=q))
        return list(data["events"])

    async def session(self, *, id: str | None = None, shell: str | None = None,
                      env: Mapping[str, str] | None = None, cwd: str | None = None,
                      user: int | None = None) -> AsyncSession:
        """Start a persistent shell session (see :meth:`edged.client.Sandbox.session`)."""
        body = session_body(id=id, shell=shell, env=env, cwd=cwd, user=user)
        return AsyncSession(self, await self._t.json(
            "POST", path_for("sandboxes", self.id, "sessions"), body))

    async def sessions(self) -> builtins.list[AsyncSession]:
        """The sandbox's shell sessions, oldest first."""
        data = await self._t.json("GET", path_for("sandboxes", self.id, "sessions"))
        return [AsyncSession(self, s) for s in data["sessions"]]

    async def snapshot(self, kind: str = "workspace", exclude: Sequence[str] = (),
                       image: str | None = None) -> str:
        """See :meth:`edged.client.Sandbox.snapshot`; the whole answer in
        :attr:`last_snapshot`."""
        body: dict[str, Any] = {"kind": kind, "exclude": list(exclude)}
        if image is not None:
            body["image"] = image
        self.last_snapshot = dict(await self._t.json(
            "POST", path_for("sandboxes", self.id, "snapshot"), body))
        return str(self.last_snapshot["digest"])

    async def stats(self) -> dict[str, int]:
        """See :meth:`edged.client.Sandbox.stats`."""
        return dict(await self._t.json("GET", path_for("sandboxes", self.id, "stats")))

    @classmethod
    async def list(cls, labels: Mapping[str, str] | None = None,
                   socket: str | None = None,
                   retry: RetryPolicy | None = None) -> builtins.list[AsyncSandbox]:
        """Sandboxes on the node, optionally those carrying every label given (they share
        one HTTP session; close any of them when done)."""
        t = AsyncTransport(socket, retry=retry)
        q = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        try:
            data = await t.json("GET", path_for("sandboxes", query=q))
        except BaseException:
            await t.close()
            raise
        return [cls(s, t) for s in data["sandboxes"]]

    async def kill(self) -> None:
        """Destroy the sandbox (idempotent)."""
        with contextlib.suppress(NotFoundError):
            self.info = await self._t.json("DELETE", path_for("sandboxes", self.id))

    async def terminate(self) -> None:
        """:meth:`kill` under Modal's name."""
        await self.kill()

    async def close(self) -> None:
        """Close the HTTP session (the sandbox lives on)."""
        await self._t.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        finally:
            await self.close()
