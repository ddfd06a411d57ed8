"""The cluster over real nodes: two ``edged serve`` daemons with the container backend
(confined sandboxes of a busybox layer built by layerfs), joined to the test Ray cluster.
Through the relays: exec, files, pause/resume, kill; a daemon killed with kill -9 loses its
sandboxes, and the same daemon restarted adopts them and they are found again."""

from __future__ import annotations

import http.client
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.client import NotFoundError, Sandbox
from edged.cluster import ClusterClient, SandboxLostError
from edged.cluster.transport import HttpRelayTransport
from tests.edged.backends.container.conftest import busybox_tree  # noqa: F401 (a fixture)
from tests.edged.cluster.conftest import (
    IPS,
    REPORT_S,
    EdgedNode,
    LocalCluster,
    joined,
    ray,
)
from tests.edged.cluster.procs import VENV_BIN, RayCluster, wait_for
from tests.edged.test_e2e_container import _cgroup_parents

pytestmark = [pytest.mark.root, pytest.mark.mount]

REAL = {"group": "real"}
ENV = {"PATH": "/bin"}


@pytest.fixture(scope="module")
def layer(busybox_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:  # noqa: F811
    from layerfs.build import build_layer
    from layerfs.store import Store

    store = str(tmp_path_factory.mktemp("store"))
    return store, build_layer(str(busybox_tree), kind="base", store=Store(store)).digest


@pytest.fixture(scope="module")
def real(ray_cluster: RayCluster, layer: tuple[str, str]) -> Iterator[LocalCluster]:
    store, _ = layer
    runtime = Path(tempfile.mkdtemp(prefix="edged-i16-", dir="/run"))
    nodes: dict[str, EdgedNode] = {}
    try:
        for name, ip in (("r1", IPS[1]), ("r2", IPS[2])):
            d = ray_cluster.tmp / name
            d.mkdir()
            argv = [str(VENV_BIN / "edged"), "serve", "--socket", str(d / "edged.sock"),
                    "--state-dir", str(d / "state"), "--runtime-dir", str(runtime / name),
                    "--store-dir", store, "--max-sandboxes", "2", "--log-level", "warning",
                    "--default-ttl-s", "0", "--layer-linger-s", "0",
                    "--reaper-interval-s", "0.2", "--on-shutdown", "stop"]
            nodes[name] = EdgedNode(name, ip, d, argv, dict(REAL), ray_cluster.address)
            nodes[name].start_daemon()
            nodes[name].start_join()
        yield joined(ray_cluster, nodes)
    finally:
        for n in nodes.values():
            n.stop()
        mounts = Path("/proc/mounts").read_text()
        assert str(runtime) not in mounts, "mounts left behind"
        for name in nodes:
            for cg in _cgroup_parents(str(runtime / name)):
                assert not [p for p in cg.iterdir() if p.is_dir()], f"cgroups left in {cg}"
                cg.rmdir()
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture
def client(real: LocalCluster) -> Iterator[ClusterClient]:
    c = ClusterClient(refresh_s=REPORT_S / 2, direct=False)
    yield c
    c.close()
    for n in real.nodes.values():
        if n.daemon is not None and n.daemon.alive():
            for s in n.sandboxes():
                s.kill()


def test_real_sandboxes_through_the_relays(real: LocalCluster, client: ClusterClient,
                                           layer: tuple[str, str]) -> None:
    _, digest = layer
    boxes = [client.create(layers=[digest], env=ENV, node_labels=REAL) for _ in range(4)]
    assert sorted(b.node for b in boxes) == ["r1", "r1", "r2", "r2"]  # 2 + 2: full
    b = boxes[0]
    r = b.exec("hostname; id -u; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, f"{b.id}\n0\n", "err\n")
    data = bytes(range(256)) * (24 << 10)  # 6 MiB: two relayed chunks
    assert b.files.write("/tmp/data", data) == len(data)
    assert b.exec("wc -c < /tmp/data").stdout.strip() == str(len(data))
    assert b.files.read_bytes("/tmp/data") == data
    # an upload whose client gives up half-way leaves nothing in the sandbox: through the
    # relay actor, and over the HTTP relay
    assert isinstance(b._t, HttpRelayTransport)
    route = b._t.route
    c = http.client.HTTPConnection(route.host, route.port, timeout=30)
    c.putrequest("PUT", f"/v1/sandboxes/{b.id}/files?path=/tmp/half-http&mode=644")
    c.putheader("Authorization", route.auth)
    c.putheader("Content-Length", str(1 << 20))
    c.endheaders()
    c.send(b"y" * 100_000)
    c.close()
    t = b._t.relay
    tok = t.unwrap(ray.get(t.actor.upload_open.remote(
        f"/v1/sandboxes/{b.id}/files?path=/tmp/half&mode=644")))
    ray.get(t.actor.upload_chunk.remote(tok, b"x" * 100_000))
    ray.get(t.actor.upload_abort.remote(tok))
    with pytest.raises(NotFoundError):
        b.files.read("/tmp/half")
    with pytest.raises(NotFoundError):
        b.files.read("/tmp/half-http")
    b.pause()
    assert b.state == "paused"
    assert b.exec("echo thawed").stdout == "thawed\n"  # any request resumes it
    for x in boxes:
        x.kill()
    assert not real.nodes["r1"].sandboxes() and not real.nodes["r2"].sandboxes()


def test_kill_9_then_adopted_again(real: LocalCluster, client: ClusterClient,
                                   layer: tuple[str, str]) -> None:
    _, digest = layer
    r1 = real.nodes["r1"]
    # r1 admits two: the earlier tests' sandboxes are gone, but its last report may be older
    wait_for(lambda: any(n["name"] == "r1" and n["free"] >= 1 for n in client.nodes()), 15,
             "r1 reporting room")
    sbx = client.create(layers=[digest], env=ENV, node="r1")
    sbx.exec("echo kept > /tmp/state")
    real.wait_listed(sbx)
    r1.kill_daemon()
    real.wait_state("r1", "down")
    assert sbx.id in client.lost("r1")
    with pytest.raises(SandboxLostError):
        sbx.exec("true")
    # the sandbox itself lives on without its daemon; the daemon restarted adopts it
    r1.start_daemon()
    real.wait_state("r1", "up", 30)
    wait_for(lambda: sbx.id not in client.lost("r1"), 15, "the sandbox found again")
    again = client.connect(sbx.id)
    assert again.exec("cat /tmp/state").stdout == "kept\n"
    assert [s.id for s in r1.sandboxes()] == [sbx.id]
    again.kill()
    assert Sandbox.list(socket=r1.socket) == []
