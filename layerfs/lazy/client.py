"""Talk to a node's lazy layer server, and start or stop it.

The server listens on ``CACHE/control.sock`` (HTTP/1.1 + JSON)::

    GET    /v1/health                      {"ok": true, "pid": N}
    GET    /v1/stats                       {"cache": {...}, "layers": {digest: {...}}}
    POST   /v1/layers   {"digest", "remote"}  register; the layer's stats (with "file")
    DELETE /v1/layers/{digest}             unregister
    POST   /v1/prefetch {"digest", "chunks"?}  {"queued": n}
    POST   /v1/trace    {"digest", "save"?, "reset"?}  {"chunks": [...]}
    POST   /v1/evict    {"target": bytes}  {"freed": bytes}

Errors come back as ``{"error": {"code", "message"}}`` and raise :class:`LazyServerError`.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from layerfs.errors import LayerfsError, NotFoundError
from layerfs.lazy import DEFAULT_CACHE as DEFAULT_CACHE  # re-exported, used by others
from layerfs.lazy import default_cache as default_cache
from layerfs.lazy.cache import ChunkCache

log = logging.getLogger("layerfs.lazy")


class LazyServerError(LayerfsError, OSError):
    """The lazy server is not running, or refused a request (message says why)."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


class LazyClient:
    """A client of the lazy server of cache directory ``cache`` (blocking calls).
    ``timeout``: seconds per request."""

    def __init__(self, cache: str | None = None, *, timeout: float = 60.0) -> None:
        self.cache = os.path.abspath(cache or default_cache())
        self.sock = os.path.join(self.cache, "control.sock")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        conn = _UnixConnection(self.sock, self.timeout)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if payload else {}
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise LazyServerError(exc.errno or 0, f"no lazy server is running for the cache "
                                                  f"{self.cache} (it starts with `layerfs "
                                                  f"mount` or the node daemon)") from None
        except OSError as exc:
            raise LazyServerError(exc.errno or 0, f"lazy server of {self.cache}: {method} "
                                                  f"{path}: {exc}") from None
        finally:
            conn.close()
        try:
            obj = json.loads(data)
        except ValueError:
            obj = {"error": {"message": data[:200].decode("utf-8", "replace")}}
        if resp.status >= 400:
            msg = obj.get("error", {}).get("message", "") if isinstance(obj, dict) else ""
            if resp.status == 404:
                raise NotFoundError(msg)
            raise LazyServerError(0, f"lazy server of {self.cache}: {method} {path}: HTTP "
                                     f"{resp.status}: {msg}")
        return obj

    def health(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/health"))

    def alive(self) -> bool:
        try:
            self.health()
        except LazyServerError:
            return False
        return True

    def stats(self) -> dict[str, Any]:
        """Cache and per-layer metrics (see ``LazyServer.layer_stats``)."""
        return dict(self._call("GET", "/v1/stats"))

    def register(self, digest: str, remote: str) -> dict[str, Any]:
        """Expose layer ``digest`` from ``remote``; returns its stats, whose ``"file"``
        is the lazy image file to mount."""
        return dict(self._call("POST", "/v1/layers", {"digest": digest, "remote": remote}))

    def unregister(self, digest: str) -> None:
        self._call("DELETE", f"/v1/layers/{digest}")

    def prefetch(self, digest: str, chunks: list[int] | None = None) -> int:
        """Queue background fetches (default: the recorded trace); returns how many."""
        body: dict[str, Any] = {"digest": digest}
        if chunks is not None:
            body["chunks"] = chunks
        return int(self._call("POST", "/v1/prefetch", body)["queued"])

    def trace(self, digest: str, *, save: bool = False, reset: bool = False) -> list[int]:
        return list(self._call("POST", "/v1/trace",
                               {"digest": digest, "save": save, "reset": reset})["chunks"])

    def evict(self, target: int) -> int:
        return int(self._call("POST", "/v1/evict", {"target": target})["freed"])

    def server_pid(self) -> int | None:
        """PID of the server process (not the supervisor), if one is recorded."""
        try:
            with open(os.path.join(self.cache, "server.pid")) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return None


def fuse_state(cache: str | None = None) -> str:
    """The FUSE mount of ``cache``'s lazy server: ``"absent"`` (none), ``"live"`` (its
    connection is up: something holds an fd on it) or ``"dead"`` (aborted: every holder
    of its fd died; every read through it, and through the EROFS mounts of its files,
    fails with ENOTCONN or EIO for good)."""
    fuse = os.path.join(os.path.abspath(cache or default_cache()), "fuse")
    try:
        os.stat(fuse)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            return "dead"
        return "absent"
    return "live" if os.path.ismount(fuse) else "absent"


def detach(cache: str | None = None) -> int:
    """Detach (lazily unmount) every dead FUSE mount stacked on ``cache``'s ``fuse/`` (the
    EROFS mounts of their files keep them until they go); returns how many. A new server
    must never be mounted over a dead one: its files would stay unreachable under it."""
    fuse = os.path.join(os.path.abspath(cache or default_cache()), "fuse")
    from layerfs.mount import umount

    n = 0
    while fuse_state(cache) == "dead" and n < 64:
        try:
            umount(fuse, lazy=True)
        except OSError:
            break
        n += 1
    return n


def take_fd(cache: str | None = None, *, timeout: float = 5.0) -> int | None:
    """A copy of the fd on ``cache``'s FUSE connection, from its supervisor (see
    :mod:`layerfs.lazy.supervisor`), or None if no supervisor lends one. While the caller
    holds it the connection outlives the supervisor and the server (close it when done)."""
    path = os.path.join(os.path.abspath(cache or default_cache()), "fuse.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        # close-on-exec from the start: a sandbox spawned meanwhile must not inherit it
        _msg, fds, _flags, _addr = socket.recv_fds(s, 16, 1, socket.MSG_CMSG_CLOEXEC)
    except OSError:
        return None
    finally:
        s.close()
    for extra in fds[1:]:
        os.close(extra)
    return fds[0] if fds else None


#: How long :func:`start` waits for a new server to answer by default (seconds): 20, or
#: ``LAYERFS_LAZY_START_WAIT_S`` from the environment (a slow machine's, e.g. the emulated
#: node VM's, where the interpreter's start alone can take longer). A supervisor that ends
#: ends the wait at once.
START_WAIT_S = float(os.environ.get("LAYERFS_LAZY_START_WAIT_S") or 20.0)


#: cache -> a supervisor :func:`start` left starting its server (on the caller's
#: connection), handed to the caller of the call that finds its server answering
_STARTING: dict[str, subprocess.Popen[bytes]] = {}


def start(cache: str | None = None, *, fetch_timeout: float = 30.0,
          attempt_timeout: float = 10.0, cache_limit: int | None = None,
          speculate: int | None = None, fuse_fd: int | None = None,
          wait: float | None = None) -> subprocess.Popen[bytes] | None:
    """Start the supervisor and lazy server for ``cache`` unless one answers already, and
    wait until it answers. Returns the supervisor's Popen (None if it was running); it
    runs in its own session, so it outlives the caller. ``speculate``: chunks fetched
    ahead of a sequential miss (None: the server's default,
    :data:`layerfs.lazy.server.DEFAULT_SPECULATE`).

    ``fuse_fd``: an fd the caller holds on the connection of the mount already on
    ``fuse/`` (:func:`take_fd`): the new supervisor takes that connection over (reads that
    waited for a server are answered). Without one, a live mount nobody serves is
    detached, and a dead one always is (:func:`detach`), before a new one is made.

    A server that answers with no supervisor left (it was killed) is replaced when the
    caller holds ``fuse_fd``: ended (SIGTERM) and started again under a new supervisor on
    that connection, since nothing would restart it if it died too. Without ``fuse_fd``
    it is left serving (ending it would abort the connection).

    A server that runs under its supervisor and does not answer for ``wait`` seconds is
    wedged (stopped, deadlocked) if it started :data:`START_WAIT_S` or more ago: it is
    killed (SIGKILL) and its supervisor's next one waited for, ``wait`` seconds more; a
    younger one is still starting, and is left to start (LazyServerError meanwhile). A
    supervisor started here on the caller's connection (``fuse_fd``) whose server does
    not answer within ``wait`` is left running too (LazyServerError): the next call
    waits for its server and returns that supervisor's Popen.

    Raises :class:`LazyServerError` (with the end of its log) if it does not come up
    within ``wait`` seconds (None: :data:`START_WAIT_S`)."""
    if wait is None:
        wait = START_WAIT_S
    client = LazyClient(cache, timeout=min(5.0, wait))  # a wedged one must not hold us
    if client.alive():
        if fuse_fd is None or _running_supervisor(client.cache) is not None:
            return _STARTING.pop(client.cache, None)
        _end_orphan_server(client.cache)
    running = _running_supervisor(client.cache)
    if running is not None:
        # Its server is restarting (or still starting): a second supervisor would stack
        # another FUSE mount on fuse/ and the first would outlive every stop().
        answer = _await_supervised(client, wait)
        if answer == "timeout" and (wedged := _running_server(client.cache)) is not None:
            age = _age(wedged)
            if age < START_WAIT_S:
                # Still starting (an interpreter start on a loaded or swapping node can
                # take longer than a restart's wait): killing it would kill its
                # successors too, each as young, and reads would wait for ever.
                raise LazyServerError(0, f"lazy server of {client.cache}: pid {wedged} "
                                         f"started {age:.0f} s ago and does not answer "
                                         f"yet (waited {wait:g} s)")
            # A server that runs and does not answer for so long is wedged (stopped,
            # deadlocked): nothing else would end it. Killed, its supervisor starts
            # another on the same connection (reads waiting on it are answered then).
            log.warning("lazy server of %s: pid %d has not answered for %.0f s: killing "
                        "it (its supervisor starts another)", client.cache, wedged, wait)
            with contextlib.suppress(ProcessLookupError):
                os.kill(wedged, signal.SIGKILL)
            answer = _await_supervised(client, wait)
        if answer == "alive":
            return _STARTING.pop(client.cache, None)
        if answer == "timeout":
            raise LazyServerError(0, f"lazy server of {client.cache}: supervisor pid "
                                     f"{running} runs but its server does not answer "
                                     f"within {wait:g} s: {_log_tail(client.cache)}")
    ChunkCache(client.cache)  # create or check the layout before anything mounts
    cmd = [sys.executable, "-m", "layerfs.lazy.supervisor", "--cache", client.cache,
           "--fetch-timeout", str(fetch_timeout), "--attempt-timeout", str(attempt_timeout)]
    if cache_limit is not None:
        cmd += ["--cache-limit", str(cache_limit)]
    if speculate is not None:
        cmd += ["--speculate", str(speculate)]
    state = fuse_state(client.cache)
    adopt = fuse_fd is not None and state == "live"
    if adopt:
        cmd += ["--fuse-fd", str(fuse_fd), "--resumed"]
    elif state != "absent":
        # dead, or live with nobody to serve it and no fd to take it over: a new mount
        # stacked on it would leave it there for good, after every stop too
        from layerfs.mount import umount

        if state == "dead":
            detach(client.cache)
        else:
            with contextlib.suppress(OSError):
                umount(os.path.join(client.cache, "fuse"), lazy=True)
    with open(os.path.join(client.cache, "server.log"), "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True, close_fds=True,
                                pass_fds=(fuse_fd,) if adopt and fuse_fd is not None else ())
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if client.alive():
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if adopt and proc.poll() is None:
        # Ours, on the caller's connection, and still starting its server (slow on a
        # loaded node): ending it would only start the next attempt from scratch, as
        # slowly. The next call finds it running, waits for its server and returns it.
        _STARTING[client.cache] = proc
        raise LazyServerError(0, f"lazy server of {client.cache}: supervisor pid {proc.pid} "
                                 f"started; its server does not answer within {wait:g} s "
                                 f"yet: {_log_tail(client.cache)}")
    # The supervisor unmounts its FUSE mount on SIGTERM; a stale one would fail every
    # later start.
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    fuse = os.path.join(client.cache, "fuse")
    if os.path.ismount(fuse) and not adopt:  # an adopted one may still be served later
        from layerfs.mount import umount

        with contextlib.suppress(OSError):
            umount(fuse, lazy=True)
    raise LazyServerError(0, f"lazy server of {client.cache} did not start: "
                             f"{_log_tail(client.cache)}")


def _await_supervised(client: LazyClient, wait: float) -> str:
    """Wait up to ``wait`` seconds for the server under a running supervisor to answer:
    ``"alive"``, ``"unsupervised"`` (the supervisor ended) or ``"timeout"``."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if client.alive():
            return "alive"
        if _running_supervisor(client.cache) is None:
            return "unsupervised"
        time.sleep(0.05)
    return "timeout"


def _running(cache: str, name: str) -> int | None:
    """PID of the live ``name`` (``supervisor`` or ``server``) recorded for ``cache`` in
    ``NAME.pid``, checked against its command line (never another process that reuses the
    number), if any."""
    try:
        with open(os.path.join(cache, f"{name}.pid")) as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    if f"layerfs.lazy.{name}".encode() not in argv or os.fsencode(cache) not in argv \
            or _zombie(pid):
        return None
    return pid


def _running_supervisor(cache: str) -> int | None:
    """PID of the live supervisor recorded for ``cache``, if any."""
    return _running(cache, "supervisor")


def _running_server(cache: str) -> int | None:
    """PID of the live lazy server recorded for ``cache``, if any."""
    return _running(cache, "server")


def _end_orphan_server(cache: str, wait: float = 10.0) -> bool:
    """End (SIGTERM; SIGKILL after ``wait`` seconds) the server of ``cache`` whose
    supervisor is gone; False if none runs. Whoever else holds an fd on its connection keeps
    the connection (and the reads waiting on it) alive."""
    pid = _running_server(cache)
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while _running_server(cache) == pid:
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)
    return True


def supervised(cache: str | None = None) -> bool:
    """Whether a supervisor runs for ``cache`` (it restarts a server that dies)."""
    return _running_supervisor(os.path.abspath(cache or default_cache())) is not None


def _log_tail(cache: str) -> str:
    try:
        with open(os.path.join(cache, "server.log"), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 600))
            return f.read().decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return "(no log)"


def stop(cache: str | None = None, *, proc: subprocess.Popen[bytes] | None = None,
         wait: float = 20.0) -> bool:
    """Stop the supervisor of ``cache`` (SIGTERM; SIGKILL after ``wait`` seconds), which
    stops the server and unmounts the FUSE mount. Returns False if none was running."""
    cache = os.path.abspath(cache or default_cache())
    pid: int | None = None
    if proc is not None and proc.poll() is None:
        pid = proc.pid
    else:
        proc, pid = None, _running_supervisor(cache)
    if pid is None:
        # No supervisor (killed): a server it left is ended and its mount detached here
        if not _end_orphan_server(cache, wait):
            return False
        from layerfs.mount import umount

        with contextlib.suppress(OSError):
            umount(os.path.join(cache, "fuse"), lazy=True)
        return True
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return True
        elif not os.path.exists(f"/proc/{pid}") or _zombie(pid):
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if proc is not None:
        proc.wait()
    return True


def _age(pid: int) -> float:
    """Seconds since process ``pid`` started (``/proc/PID/stat`` field 22, in clock ticks
    since boot, against ``/proc/uptime``); infinity if that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("inf")
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True
