"""``edged serve``: startup → serve → graceful shutdown (uvicorn's ``server.py`` shape).

:class:`Server` holds the daemon's state in one object. ``should_exit`` (first SIGTERM or
SIGINT) stops accepting requests and shuts down gracefully: sandboxes are destroyed or kept for
re-adoption per ``on_shutdown``, waiting at most ``shutdown_timeout_s``. ``force_exit`` (a
second signal) skips the wait for in-flight requests. Signal handlers are restored on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import grp
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

from aiohttp import web

from edged.api.app import make_app
from edged.api.common import MAX_JSON_BODY, json_body
from edged.api.fncalls import fusion_app
from edged.backends.base import Backend, CallBackend, NetnsJoiner
from edged.backends.registry import Backends
from edged.compat.e2b.listener import Listener
from edged.config import Config, mem_total
from edged.errors import BackendError, BadRequest, Conflict, EdgedError
from edged.images.mounts import LayerMounts
from edged.images.registry import ImageRegistry
from edged.images.service import LayerService
from edged.logutil import RateLimitFilter
from edged.metrics import Metrics
from edged.node.fds import raise_nofile
from edged.node.manager import SandboxManager
from edged.node.swap import SwapManager, zram_budget, zram_sizing
from edged.security.apikeys import ApiKeys
from edged.security.ledger import Ledger

log = logging.getLogger("edged")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Seconds a graceful stop waits, past ``shutdown_timeout_s``, for destroys still under way
#: (rather than leave their sandboxes, layer mounts and lazy server behind): the default
#: 30 s and this stay inside the systemd unit's TimeoutStopSec (90 s).
SHUTDOWN_OVERRUN_S = 45.0


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra`` fields."""

    _STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in self._STD:
                d[k] = v
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


def setup_logging(level: str) -> None:
    """Structured (JSON lines) logs on stderr at ``level``: edged's own, and asyncio's and
    aiohttp's warnings (one line each, the traceback in ``exc``). Repeated lines are
    throttled (:class:`~edged.logutil.RateLimitFilter`: 5 of a kind per 10 s, the next one
    counts what was dropped)."""
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    h.addFilter(RateLimitFilter())
    for name, lvl in (("edged", level.upper()), ("asyncio", "WARNING"), ("aiohttp", "WARNING")):
        lg = logging.getLogger(name)
        lg.handlers[:] = [h]
        lg.setLevel(lvl)
        lg.propagate = False



def network_backend(backends: Iterable[Backend]) -> NetnsJoiner | None:
    """The first of ``backends`` whose sandboxes can join a network namespace the daemon
    made (:class:`~edged.backends.base.NetnsJoiner`), which the node's network serves; None
    if none can."""
    return next((b for b in backends if isinstance(b, NetnsJoiner)), None)

class Server:
    """One edged daemon. Inject ``backend`` (or several, ``backends``) and ``layers`` in
    tests; by default they come from the config (:meth:`Backends.from_config`,
    :meth:`LayerMounts.for_layerfs`)."""

    def __init__(self, config: Config, backend: Backend | None = None,
                 layers: LayerMounts | None = None, *,
                 backends: Backends | None = None) -> None:
        self.config = config
        self._backend = backend
        self._backends = backends
        self._layers = layers
        self.should_exit = False
        self.force_exit = False
        self.started = asyncio.Event()
        self.manager: SandboxManager | None = None
        self.recovered: dict[str, list[str]] = {}
        self._runner: web.AppRunner | None = None
        self._fusion: web.AppRunner | None = None  # the SandboxFusion listener
        self._prev_handlers: dict[int, Any] = {}
        self._wake: asyncio.Event | None = None
        self._forced = asyncio.Event()
        self._lock_fds: list[int] = []  # flocks on the runtime dir's pid file, the state dir
        self._owns_socket = False
        self.swap: SwapManager | None = None
        #: the E2B-compatible listener, when ``e2b_listen`` is set
        self.e2b: Listener | None = None

    def _start_swap(self, backends: Backends) -> SwapManager:
        """The node's swap (recovered now, set up at the first reclaim) and the cap on all
        sandboxes' memory together (capacity less the host's reserve)."""
        cfg = self.config
        cap = cfg.capacity_memory()
        # zram: its RAM limit, not its slots, is the wall (sized for 3:1, its slot table
        # within the RAM it may take, which the node's real RAM bounds;
        # edged.node.swap.zram_sizing, zram_budget)
        zram_ram = cfg.zram_mem_limit_bytes or zram_budget(cap, mem_total(),
                                                           cfg.memory_reserve())
        disksize, mem_limit = zram_sizing(zram_ram)
        if cfg.zram_bytes:
            disksize, mem_limit = cfg.zram_bytes, zram_ram
        swap = SwapManager(Path(cfg.state_dir), mode=cfg.swap,
                           zram_bytes=disksize, zram_mem_limit_bytes=mem_limit,
                           algorithm=cfg.zram_algorithm,
                           file_bytes=(cfg.swap_file_bytes or 2 * cap) if cfg.swap_files else 0,
                           file_step_bytes=max(256 << 20, min(4 << 30, cap // 8)),
                           disk_reserve=float(cfg.swap_disk_reserve_bytes or 0.1))
        swap.start()
        for b in backends:
            try:
                b.set_memory_limit(max(0, min(cap, mem_total() - cfg.memory_reserve())))
            except BackendError as e:
                log.warning("%s", e)
        return swap

    # -- signals --------------------------------------------------------------------------

    def handle_exit(self, sig: int, frame: FrameType | None = None) -> None:
        """First signal: graceful shutdown; second: force it."""
        if self.should_exit:
            self.force_exit = True
            self._forced.set()
        self.should_exit = True
        if self._wake is not None:
            self._wake.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in HANDLED_SIGNALS:
            self._prev_handlers[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, self.handle_exit, sig, None)

    def _restore_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig, prev in self._prev_handlers.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, prev)
        self._prev_handlers.clear()

    # -- lifecycle ------------------------------------------------------------------------

    async def serve(self, *, install_signals: bool = True) -> None:
        """Start, serve until :attr:`should_exit`, shut down. Signal handlers (if installed)
        are restored whatever happens."""
        self._wake = asyncio.Event()
        if install_signals:
            self._install_signal_handlers()
        loop = asyncio.get_running_loop()
        prev_handler = loop.get_exception_handler()
        loop.set_exception_handler(_loop_exception)
        try:
            await self.startup()
            await self.main_loop()
        finally:
            try:
                await self.shutdown()
            finally:
                loop.set_exception_handler(prev_handler)
                if install_signals:
                    self._restore_signal_handlers()

    async def startup(self) -> None:
        """Make the state and runtime dirs, recover sandboxes, start the reaper, listen on
        the Unix socket (mode 0660, group ``socket_group`` if it exists)."""
        cfg = self.config
        t0 = time.monotonic()
        state = Path(cfg.state_dir)
        runtime = Path(cfg.runtime_dir)
        for d in (state, runtime):
            d.mkdir(parents=True, exist_ok=True, mode=0o750)
        # Before recovery: a second daemon on the same dirs would tear down the first one's
        # sandboxes as leftovers of a crash.
        self._lock(runtime / "edged.pid", write_pid=True)
        self._lock(state / "edged.lock", write_pid=False)
        # Each sandbox holds descriptors here; a soft limit left at 1024 by a shell or a
        # supervisor ended in EMFILE at ~500 sandboxes (creates are admitted against it).
        before, now = raise_nofile()
        if now != before:
            log.info("raised the soft NOFILE limit", extra={"before": before, "now": now})
        sock = Path(cfg.socket)
        if sock.is_socket() and _answers(sock):
            raise Conflict(f"another daemon answers on {sock}; not starting")
        # security events are kept under the state dir and outlive their sandbox
        ledger = Ledger(state, retention_s=cfg.events_retention_s)
        if self._backends is not None:
            backends = self._backends
            backends.set_sink(ledger.record)
        elif self._backend is not None:
            backends = Backends.single(self._backend, ledger.record)
        else:
            backends = Backends.from_config(cfg, ledger.record)
        layers = self._layers
        if layers is None:
            layers = await asyncio.to_thread(
                LayerMounts.for_layerfs, cfg.store_dir, state / "layer-cache",
                runtime / "layers", remote=cfg.layers_remote,
                cache_limit=cfg.layers_cache_bytes or None,
                fetch_timeout=cfg.layers_fetch_timeout_s)
        layers.linger_s = cfg.layer_linger_s  # the one owner of a mounted layer's lifetime
        images = ImageRegistry(state / "images.json", has_layer=layers.ops.has)
        metrics = Metrics()
        if layers.ops.collector is not None:
            metrics.registry.register(layers.ops.collector)
        self.manager = SandboxManager(cfg, backends, images, layers, metrics)
        self.manager.ledger = ledger
        self.swap = await asyncio.to_thread(self._start_swap, backends)
        self.manager.swap = self.swap
        self.manager.net = await self._start_network(backends, ledger)
        service = LayerService(layers, interval_s=cfg.layers_check_interval_s,
                               metrics=metrics)
        self.manager.layer_service = service
        # Layer mounts over a connection that died with every holder (the node's services
        # killed together): found before sandboxes are adopted, failed once they are
        lost_at_start = await service.first_check()
        self.recovered = await self.manager.recover()
        service.on_lost = self.manager.layers_lost
        if lost_at_start:
            self.manager.layers_lost(lost_at_start)
        log.info("recovered", extra={k: len(v) for k, v in self.recovered.items()})
        # the feature probe, said once at start (also GET /v1/node): what this kernel has and
        # what each backend does where it lacks something
        log.info("features", extra={"backends": self.manager.features})
        self.manager.start_reaper()
        service.start()
        app = make_app(self.manager)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     shutdown_timeout=cfg.shutdown_timeout_s * 0.5)
        await self._runner.setup()
        sock.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        if sock.is_socket():
            if _answers(sock):  # one that started serving meanwhile: leave it alone
                raise Conflict(f"another daemon answers on {sock}; not starting")
            sock.unlink()  # a stale socket of a dead daemon
        site = web.UnixSite(self._runner, str(sock))
        await site.start()
        self._owns_socket = True
        self._secure_socket(sock)
        if cfg.fncall_listen:
            await self._start_fusion(cfg)
        if cfg.e2b_listen:
            self.e2b = Listener(self.manager, cfg.e2b_listen, cfg.api_keys_file, cfg.state_dir)
            await self.e2b.start()
        log.info("serving", extra={"socket": str(sock), "pid": os.getpid(),
                                   "startup_s": round(time.monotonic() - t0, 3)})
        self.started.set()

    async def _start_fusion(self, cfg: Config) -> None:
        """SandboxFusion's ``/run_code`` on TCP ``fncall_listen`` (HOST:PORT), keys from
        ``api_keys_file`` (no key, no listener: ApiKeyError). Raises BadRequest for a bad
        address, OSError when it cannot bind."""
        assert self.manager is not None
        host, sep, port = cfg.fncall_listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadRequest(f"config fncall_listen {cfg.fncall_listen!r}: not HOST:PORT")
        keys = ApiKeys(cfg.api_keys_file)
        app = fusion_app(self.manager.backends, keys, json_body, MAX_JSON_BODY)
        self._fusion = web.AppRunner(app, handle_signals=False, access_log=None,
                                     shutdown_timeout=cfg.shutdown_timeout_s * 0.5)
        await self._fusion.setup()
        site = web.TCPSite(self._fusion, host.strip("[]") or "127.0.0.1", int(port))
        await site.start()
        log.info("SandboxFusion listener", extra={"listen": cfg.fncall_listen,
                                                   "keys": len(keys.ids)})

    async def _start_network(self, backends: Backends, ledger: Ledger) -> Any:
        """The node's networking (:mod:`edged.net`), or None with ``network_pool`` empty. It
        serves the first backend whose sandboxes can join a namespace the daemon made (a
        cgroups room with a v2 directory for the egress programs, and an init pid to enter
        the namespace by: the container backend). A host without what it needs (cgroup v2,
        BPF) gets one that refuses networked sandboxes with the reason (``GET /v1/node``)."""
        cfg = self.config
        if not cfg.network_pool:
            return None
        from edged.net.manager import NetworkManager, Settings

        chosen = network_backend(backends)
        settings = Settings(
            state_dir=Path(cfg.state_dir), pool4=cfg.network_pool, pool6=cfg.network_pool6,
            prefix=cfg.network_prefix, profile=cfg.network_profile,
            dns_port=cfg.network_dns_port,
            upstreams=tuple(u.strip() for u in cfg.network_dns_upstreams.split(",") if u.strip()),
            nat=cfg.network_nat, uplink=cfg.network_uplink,
            prepare_ahead=cfg.network_prepare_ahead, proxy=cfg.network_proxy,
            proxy_tls_port=cfg.network_proxy_tls_port,
            proxy_http_port=cfg.network_proxy_http_port,
            cgroup_dir=chosen.egress_cgroup_dir() if chosen is not None else None,
            backend=chosen.name if chosen is not None else backends.default)
        net = NetworkManager(settings, ledger.record,
                             chosen.init_pid if chosen is not None else None)
        feats = await net.start()
        log.info("network", extra={"network": feats})
        return net

    def _lock(self, path: Path, *, write_pid: bool) -> None:
        """Hold an exclusive flock on ``path`` for the daemon's life (released by the kernel
        when the process dies, so a crash leaves no stale lock). Raises Conflict naming the
        holder if another daemon has it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            holder = f"pid {other}" if other else "another daemon"
            raise Conflict(f"{holder} holds {path}: one daemon per state and runtime dir; "
                           f"not starting") from None
        if write_pid:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fds.append(fd)

    def _unlock(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds.clear()

    def _secure_socket(self, sock: Path) -> None:
        os.chmod(sock, 0o660)
        try:
            gid = grp.getgrnam(self.config.socket_group).gr_gid
        except KeyError:
            return
        with contextlib.suppress(PermissionError):
            os.chown(sock, -1, gid)

    async def main_loop(self) -> None:
        """Wait until asked to exit; meanwhile forget security events past their retention
        (once a minute)."""
        assert self._wake is not None
        next_prune = time.monotonic() + 60.0
        while not self.should_exit:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            if time.monotonic() >= next_prune and self.manager and self.manager.ledger:
                next_prune = time.monotonic() + 60.0
                try:
                    self.manager.ledger.prune()
                except OSError as e:
                    log.warning("ledger prune: %s", e)

    async def shutdown(self) -> None:
        """Stop listening, let in-flight requests end (unless forced), then stop or keep
        sandboxes per ``on_shutdown``; all within ``shutdown_timeout_s`` (in-flight requests
        get half of it, then are cancelled, which ends exec streams)."""
        log.info("shutting down", extra={"force": self.force_exit})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_timeout_s
        if self.manager is not None and self.manager.ledger is not None:
            # ends the event streams, which would otherwise hold the runner's cleanup
            self.manager.ledger.close()
        if self._fusion is not None:
            await self._fusion.cleanup()
            self._fusion = None
        if self._runner is not None:
            # In-flight requests (exec streams) may take up to shutdown_timeout_s; a second
            # signal cuts the wait short.
            cleanup = asyncio.ensure_future(self._runner.cleanup())
            forced = asyncio.ensure_future(self._forced.wait())
            await asyncio.wait({cleanup, forced}, return_when=asyncio.FIRST_COMPLETED,
                               timeout=self.config.shutdown_timeout_s * 0.6)
            for t in (cleanup, forced):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            self._runner = None
        if self.e2b is not None:
            await self.e2b.stop()
            self.e2b = None
        if self._owns_socket:  # never a live daemon's socket that made this one give up
            with contextlib.suppress(FileNotFoundError):
                Path(self.config.socket).unlink()
            self._owns_socket = False
        if self.manager is not None:
            for b in self.manager.backends:
                if isinstance(b, CallBackend):  # its pools first: no refill while stopping
                    try:
                        await b.close()
                    except EdgedError as e:
                        log.warning("%s: %s", b.name, e)
            if self.manager.layer_service is not None:
                await self.manager.layer_service.stop()
            left = max(0.5, deadline - loop.time())
            if self.force_exit:
                await self.manager.shutdown(min(1.0, left))
            else:  # slow destroys are waited for, within systemd's TimeoutStopSec slack
                await self.manager.shutdown(left, overrun_s=SHUTDOWN_OVERRUN_S)
            # pools and control connections; kept sandboxes live on
            await self.manager.backends.close()
            if self.manager.net is not None:
                await self.manager.net.close()
        if self.swap is not None:  # after the sandboxes: swapoff reads back what is left
            kept = self.manager is not None and bool(self.manager.find())
            await asyncio.to_thread(self.swap.stop, kept)
            self.swap = None
        self._unlock()
        log.info("stopped")


class ServerThread:
    """A :class:`Server` embedded in a process that has other work: its own event loop in
    a background thread (the rollout, benchmarks and tests use it; ``edged serve`` uses
    :func:`run`). No signal handlers are installed.

    :meth:`start` returns once the daemon serves, or raises its start-up error (e.g. a
    :class:`~edged.errors.Conflict` when another daemon holds the socket) or
    :class:`TimeoutError`. :meth:`stop` asks for a graceful shutdown as SIGTERM would,
    joins the thread, and re-raises an error the daemon died of.
    """

    def __init__(self, server: Server, *, name: str = "edged") -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(install_signals=False))
        except BaseException as e:  # surfaced by start() or stop()
            self.errors.append(e)
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start the thread and wait until the daemon serves (``timeout`` seconds)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        # Server.started is an asyncio.Event of the daemon's loop: only read from here.
        while not self.server.started.is_set():
            if self.errors or not self._thread.is_alive():
                self._thread.join(timeout)
                raise self.errors[0] if self.errors else RuntimeError("edged exited at start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"edged did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 120.0) -> None:
        """Shut the daemon down gracefully and join its thread (``timeout`` seconds)."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # loop already closed
                self.loop.call_soon_threadsafe(self.server.handle_exit, signal.SIGTERM)
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"edged did not stop within {timeout} s")
        if self.errors:
            raise self.errors[0]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def run(config: Config) -> int:
    """Run a daemon to completion (``edged serve``); returns the process exit status."""
    setup_logging(config.log_level)
    server = Server(config)
    try:
        asyncio.run(server.serve())
    except EdgedError as e:
        log.error("cannot start: %s", e)
        return 1
    return 0


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's unhandled errors, logged so that the rate limit sees repeats as one
    kind of line: asyncio's own handler appends the handle's repr, whose timer deadline
    differs on every line. (At EMFILE, asyncio's accept loop schedules a retry of
    ``_start_serving`` per failed ``accept``: hundreds of them a second.)"""
    exc = context.get("exception")
    msg = str(context.get("message") or "unhandled exception in the event loop")
    logging.getLogger("asyncio").error(
        msg, exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)


def _answers(sock: Path) -> bool:
    """Whether something accepts connections on the Unix socket ``sock``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(sock))
    except OSError:
        return False
    finally:
        s.close()
    return True
