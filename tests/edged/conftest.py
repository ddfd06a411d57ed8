"""Fixtures for the daemon's tests: a real edged Server (API, manager, metrics) running in a
thread with its own event loop, on a Unix socket in a private temp dir, over the test
doubles of tests/edged/fakes.py."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from edged.config import Config
from edged.daemon import Server, ServerThread
from tests.edged.fakes import FakeBackend, FakeLayerOps, digest, fake_layers

LAYERS = {digest(i) for i in range(1, 6)}


@dataclass
class Node:
    thread: ServerThread
    backend: FakeBackend
    layer_ops: FakeLayerOps
    socket: str

    @property
    def server(self) -> Server:
        return self.thread.server

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.thread.loop

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.thread.stop(30)


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
        node = Node(ServerThread(Server(cfg, backend=be, layers=layers)), be, ops, cfg.socket)
        node.thread.start()
        nodes.append(node)
        return node

    yield start
    for n in nodes:
        n.stop()


@pytest.fixture
def node(make_node: NodeFactory) -> Node:
    return make_node()
