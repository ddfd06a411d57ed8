"""End to end: a sandbox whose layer exists only on a remote chunk server (``layerfs serve``
on 127.0.0.1), created through the real daemon and container backend. The node loads the
layer lazily: the sandbox runs a command, and the bytes fetched are a small fraction of
the layer, as the daemon's /metrics shows, per layer and for the sandbox's start
(root, FUSE)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from edged.client import Sandbox
from tests.busybox import install_busybox
from tests.edged.test_e2e_container import real_node  # noqa: F401 - fixture

pytestmark = [pytest.mark.root, pytest.mark.mount, pytest.mark.fuse]

LAYERFS = [sys.executable, "-m", "layerfs.cli"]
BLOB = 24 << 20  # never read by the sandbox


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int]]:
    """A busybox layer with a large unread file, pushed to a ``layerfs serve`` on
    loopback and absent from the node's store: (url, digest, layer size)."""
    from layerfs.build import build_layer
    from layerfs.store import Store

    root = install_busybox(tmp_path_factory.mktemp("lazyroot"), ("sh", "cat", "ls", "wc", "id"))
    for d in ("etc", "tmp", "data"):
        (root / d).mkdir()
    (root / "etc" / "marker").write_text("from the remote\n")
    (root / "data" / "blob").write_bytes(os.urandom(BLOB))
    local = Store(tmp_path_factory.mktemp("build-store"), chunk_size=256 << 10)
    m = build_layer(str(root), kind="base", store=local, chunk_size=256 << 10).manifest
    serve = subprocess.Popen([*LAYERFS, "--json", "--store",
                              str(tmp_path_factory.mktemp("served")), "serve", "--listen",
                              "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        url = json.loads(serve.stdout.readline())["url"]
        subprocess.run([*LAYERFS, "--store", local.root, "push", m.digest, "--to", url],
                       check=True, capture_output=True, timeout=120)
        shutil.rmtree(local.root)  # the remote is the only copy now
        yield url, m.digest, m.size
    finally:
        serve.terminate()
        serve.wait(30)
        if serve.stdout is not None:
            serve.stdout.close()


@pytest.fixture(scope="module")
def layer_store(served: tuple[str, str, int],
                tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Overrides the container e2e fixture: an empty node store, the remote's layer."""
    return str(tmp_path_factory.mktemp("node-store")), served[1]


def _metrics(sock: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock)
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: edged\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out.decode()


def _sample(text: str, name: str, digest: str) -> float:
    m = re.search(rf'^{name}{{layer="{digest}"}} (\S+)$', text, re.M)
    assert m, f"{name} for {digest} not in /metrics"
    return float(m.group(1))


def test_sandbox_from_a_remote_only_layer_fetches_a_fraction(
        real_node, served: tuple[str, str, int]) -> None:  # noqa: F811 - fixture
    url, digest, size = served
    node = real_node(layers_remote=url)
    with Sandbox.create(layers=[digest], env={"PATH": "/bin"}, socket=node.socket) as sbx:
        r = sbx.exec("cat /etc/marker; id -u; ls /data")
        assert (r.exit_code, r.stdout) == (0, "from the remote\n0\nblob\n")
        deadline = time.monotonic() + 10
        while "edged_sandbox_start_fetched_fraction_count 1.0" not in (
                text := _metrics(node.socket)) and time.monotonic() < deadline:
            time.sleep(0.05)  # the start is observed as the first exec's stream ends
    assert "layerfs_lazy_up 1.0" in text
    fetched = _sample(text, "layerfs_lazy_fetched_bytes_total", digest)
    assert _sample(text, "layerfs_lazy_layer_bytes", digest) == size
    # busybox and the metadata were read; the 24 MiB blob was not
    assert 0 < fetched < 0.25 * size
    assert _sample(text, "layerfs_lazy_fraction_fetched", digest) == pytest.approx(
        fetched / size)
    # the sandbox's start (create to the end of its first exec) fetched all of it
    m = re.search(r"^edged_sandbox_start_fetched_bytes_total (\S+)$", text, re.M)
    assert m and float(m.group(1)) == fetched
    m = re.search(r"^edged_sandbox_start_fetched_fraction_sum (\S+)$", text, re.M)
    assert m and float(m.group(1)) == pytest.approx(fetched / size)
    # a cold start: some reads waited for chunks, and not every read was a hit
    m = re.search(r"^edged_sandbox_start_fetch_wait_seconds_sum (\S+)$", text, re.M)
    assert m and float(m.group(1)) > 0
    m = re.search(r"^edged_sandbox_start_chunk_hit_ratio_sum (\S+)$", text, re.M)
    assert m and 0 <= float(m.group(1)) < 1
    assert "edged_sandbox_start_chunk_hit_ratio_count 1.0" in text
