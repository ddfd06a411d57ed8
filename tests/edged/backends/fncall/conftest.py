"""A real daemon with FnCall on: its pool of container sandboxes made from a layer of the
FnCall image's rootfs (``scripts/fncall-rootfs.sh``: Debian minbase + python3, gcc, g++),
built once per session; one daemon per test module (root, mounts)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from edged.client._http import UnixConnection
from edged.config import Config
from edged.daemon import Server, ServerThread

CACHE = Path(os.environ.get("EDGED_TEST_CACHE", "/var/cache/edged-test"))
FNCALL_TAR = CACHE / "fncall-rootfs.tar"
KEY = "fncall-test-key-0123456789abcdef"


@pytest.fixture(scope="session")
def fncall_layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(store directory, digest) of the FnCall image's one layer."""
    if os.geteuid() != 0:
        pytest.skip("FnCall's pool sandboxes need root")
    if not FNCALL_TAR.exists():
        pytest.skip(f"{FNCALL_TAR} missing: run scripts/fncall-rootfs.sh")
    from layerfs.build import build_layer
    from layerfs.store import Store

    store = str(tmp_path_factory.mktemp("fncall-store"))
    return store, build_layer(str(FNCALL_TAR), kind="base", store=Store(store)).digest


@dataclass
class FnNode:
    thread: ServerThread
    socket: str
    port: int | None

    @property
    def server(self) -> Server:
        return self.thread.server

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any, dict[str, str]]:
        c = UnixConnection(self.socket, 120)
        c.request(method, path, None if body is None else json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, json.loads(data) if data else None, dict(r.getheaders())

    def call(self, body: dict[str, Any]) -> dict[str, Any]:
        status, rep, _ = self.request("POST", "/v1/fncalls", body)
        assert status == 200, rep
        return rep  # type: ignore[no-any-return]

    def run(self, body: dict[str, Any]) -> dict[str, Any]:
        """The one result of a one-case call."""
        rep = self.call(body)
        assert len(rep["results"]) == 1, rep
        return rep["results"][0]  # type: ignore[no-any-return]

    def backend(self) -> Any:
        mgr = self.server.manager
        assert mgr is not None
        return mgr.backends.get("fncall")

    def in_loop(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.thread.loop).result(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def fn_node_factory(fncall_layer, tmp_path_factory) -> Iterator[Any]:
    store, digest = fncall_layer
    made: list[tuple[FnNode, Path, Path]] = []

    def start(**overrides: Any) -> FnNode:
        run = Path(tempfile.mkdtemp(prefix="edged-fncall-", dir="/run"))
        sockdir = Path(tempfile.mkdtemp(prefix="edged-fncall-", dir="/tmp"))
        keys = sockdir / "keys"
        keys.write_text(f"tests {KEY}\n")
        os.chmod(keys, 0o600)
        port = _free_port()
        cfg = Config(socket=str(sockdir / "s.sock"),
                     state_dir=str(tmp_path_factory.mktemp("fncall-state")),
                     runtime_dir=str(run), store_dir=store, log_level="warning", cpus=2.0,
                     memory_bytes=8 << 30, layer_linger_s=0.0, fncall_layers=digest,
                     fncall_pool=2, fncall_memory_bytes=256 << 20, fncall_disk_bytes=64 << 20,
                     fncall_listen=f"127.0.0.1:{port}", api_keys_file=str(keys))
        for k, v in overrides.items():
            setattr(cfg, k, v)
        node = FnNode(ServerThread(Server(cfg)).start(timeout=60), cfg.socket,
                      port if cfg.fncall_listen else None)
        made.append((node, run, sockdir))
        return node

    yield start
    for node, run, sockdir in made:
        node.thread.stop(60)
        assert str(run) not in Path("/proc/mounts").read_text(), "mounts left behind"
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture(scope="module")
def fn_node(fn_node_factory) -> FnNode:
    return fn_node_factory()
