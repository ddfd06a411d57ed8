"""The CLI of remotes and lazy loading: serve, push, mount, stats, prefetch, umount."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from layerfs.build import build_layer
from layerfs.store import Store
from tests.layerfs.lazy_helpers import CHUNK, make_tree

LAYERFS = [sys.executable, "-m", "layerfs.cli"]


def _run(*args: str) -> dict[str, object]:
    out = subprocess.run([*LAYERFS, "--json", *args], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return dict(json.loads(out))


@pytest.mark.root
@pytest.mark.fuse
@pytest.mark.mount
def test_serve_push_mount_stats_umount(tmp_path: pathlib.Path) -> None:
    tree = make_tree(tmp_path / "tree")
    local = Store(tmp_path / "local", chunk_size=CHUNK)
    digest = build_layer(str(tree), kind="base", store=local, chunk_size=CHUNK).manifest.digest
    sock = tmp_path / "serve.sock"
    serve = subprocess.Popen([*LAYERFS, "--store", str(tmp_path / "served"), "serve",
                              "--listen", f"unix:{sock}"], stdout=subprocess.PIPE, text=True)
    mp = tmp_path / "mnt"
    mp.mkdir()
    cache = tmp_path / "cache"
    try:
        assert serve.stdout is not None
        assert "serving" in serve.stdout.readline()
        first = _run("--store", local.root, "push", digest[7:19], "--to", f"unix:{sock}")
        assert first["sent_chunks"] and first["manifest_new"] is True
        again = _run("--store", local.root, "push", digest, "--to", f"unix:{sock}")
        assert again["sent_chunks"] == 0 and again["manifest_new"] is False
        m = _run("mount", digest, str(mp), "--remote", f"unix:{sock}", "--cache", str(cache))
        try:
            assert (mp / "etc" / "hostname").read_text() == "node\n"
            st = _run("stats", "--cache", str(cache))
            layer = st["layers"][digest]  # type: ignore[index]
            assert 0 < layer["bytes_fetched"] < m["size"]  # type: ignore[operator]
            assert st["slots"]["live"] == 1  # type: ignore[index]
            # a second mount on the same mountpoint is refused, not stacked
            twice = subprocess.run([*LAYERFS, "mount", digest, str(mp), "--remote",
                                    f"unix:{sock}", "--cache", str(cache)],
                                   capture_output=True, text=True, timeout=60)
            assert twice.returncode == 1 and "mounted there already" in twice.stderr
        finally:
            _run("umount", str(mp))
        assert not os.path.ismount(mp)
        # umount recorded the access trace and stopped the node's server
        assert (cache / "traces" / f"{digest[7:]}.json").exists()
        assert not (cache / "supervisor.pid").exists()
        assert str(cache) not in pathlib.Path("/proc/mounts").read_text()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(30)
        if serve.stdout is not None:
            serve.stdout.close()
    assert serve.returncode == 0


def _fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAYERFS, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:99999", "unix:", ":80", "::1"])
def test_serve_bad_listen_address_is_a_usage_error(tmp_path: pathlib.Path,
                                                   listen: str) -> None:
    # Review finding: these printed Python tracebacks (exit 1).
    r = _fails("--store", str(tmp_path / "s"), "serve", "--listen", listen)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr and "Traceback" not in r.stderr


def test_serve_on_a_socket_in_a_missing_directory_names_it(tmp_path: pathlib.Path) -> None:
    sock = tmp_path / "no" / "such" / "dir" / "s.sock"
    r = _fails("--store", str(tmp_path / "s"), "serve", "--listen", f"unix:{sock}")
    assert r.returncode == 1 and str(sock) in r.stderr and "Traceback" not in r.stderr


def test_stats_without_a_server_says_so(tmp_path: pathlib.Path) -> None:
    r = _fails("stats", "--cache", str(tmp_path / "cache"))
    assert r.returncode == 1 and "no lazy server is running" in r.stderr, r.stderr
