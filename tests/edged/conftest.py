"""Fixtures for the daemon's tests: a real edged Server (API, manager, metrics) running in a
thread with its own event loop, on a Unix socket in a private temp dir, over the test
doubles of tests/edged/fakes.py."""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from edged.config import Config
from edged.daemon import Server
from tests.edged.fakes import FakeBackend, FakeLayerOps, digest, fake_layers

LAYERS = {digest(i) for i in range(1, 6)}


@dataclass
class Node:
    server: Server
    backend: FakeBackend
    layer_ops: FakeLayerOps
    socket: str
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    errors: list[BaseException] = field(default_factory=list)

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.handle_exit, signal.SIGTERM)
            self.thread.join(30)
        assert not self.thread.is_alive(), "daemon did not stop"
        if self.errors:
            raise self.errors[0]


NodeFactory = Callable[..., Node]


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="edged-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_node(tmp_path: Path, sockdir: Path) -> Iterator[NodeFactory]:
    nodes: list[Node] = []
    live: dict[str, Path] = {}

    def start(*, backend: FakeBackend | None = None, **overrides: Any) -> Node:
        cfg = Config(
            socket=str(sockdir / "edged.sock"),
            state_dir=str(tmp_path / "state"),
            runtime_dir=str(tmp_path / "run"),
            cpus=2.0,
            memory_bytes=4 << 30,
            reaper_interval_s=0.05,
            default_ttl_s=0.0,
            layer_linger_s=0.0,  # unmount at the last release (tests of linger set it)
        )
        for k, v in overrides.items():
            setattr(cfg, k, v)
        be = backend or FakeBackend(tmp_path / "sandboxes", live)
        layers, ops = fake_layers(tmp_path, LAYERS)
        server = Server(cfg, backend=be, layers=layers)
        loop = asyncio.new_event_loop()
        errors: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(server.serve(install_signals=False))
            except BaseException as e:  # surfaced by Node.stop
                errors.append(e)
                server.started.set()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        t = threading.Thread(target=run, daemon=True)
        node = Node(server, be, ops, cfg.socket, loop, t, errors)
        t.start()
        for _ in range(300):
            if server.started.is_set() or errors:
                break
            threading.Event().wait(0.01)
        if errors:
            raise errors[0]
        nodes.append(node)
        return node

    yield start
    for n in nodes:
        n.stop()


@pytest.fixture
def node(make_node: NodeFactory) -> Node:
    return make_node()
