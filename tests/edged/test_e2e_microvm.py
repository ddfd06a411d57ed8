"""End to end through the daemon with ``backend: "microvm"`` (marked ``vm``): the SDK's
create names the backend, the node's layers reach the guest as EROFS image files, every
operation goes through the API as a container's does (exec streams, stdin, typed ends,
files, signals, kill_processes, stats, pause and a request that resumes it, delete), the
node lists the backend, a restarted daemon adopts the VM, and nothing is left: no VMM, no
disk or snapshot file, no socket, no cgroup."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edged.backends.microvm import guestkit
from edged.client import BadRequestError, InvalidStateError, NotFoundError, Sandbox
from edged.client._http import Transport
from tests.edged.backends.microvm.conftest import qemu_pids
from tests.edged.test_e2e_container import RealNode, layer_store  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.mount]

ENV = {"PATH": "/bin"}


def _vm_cgroup_parents(runtime: Path) -> list[Path]:
    h = hashlib.sha256(str((runtime / "microvm").resolve()).encode()).hexdigest()[:10]
    names = {f"edged-vm-{h}", f"edged-vm-{h}-idle"}
    return [Path(d, n) for d in Path("/sys/fs/cgroup").iterdir() if d.is_dir()
            for n in names if Path(d, n).is_dir()]


@pytest.fixture
def vm_node(layer_store: tuple[str, str], tmp_path: Path) -> Iterator[Callable[..., RealNode]]:  # noqa: F811
    try:
        guestkit.load()
    except guestkit.GuestKitError as e:
        pytest.skip(f"no guest kit: {e}")
    store_dir, _ = layer_store
    # AF_UNIX paths are short: the VMs' sockets live under the runtime dir
    sockdir = Path(tempfile.mkdtemp(prefix="i13-e2e-", dir="/tmp"))
    runtime = Path(tempfile.mkdtemp(prefix="i13-e2e-", dir="/run"))
    nodes: list[RealNode] = []

    def start(**overrides: object) -> RealNode:
        node = RealNode.start(sockdir, runtime, tmp_path / "state", store_dir, 120,
                              {"backends": "container,microvm", "microvm_accel": "tcg",
                               "network_pool": ""}, overrides)
        nodes.append(node)
        return node

    yield start
    for n in nodes:
        n.stop()
    left = qemu_pids(str(runtime))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    cgs = _vm_cgroup_parents(runtime)
    sub = [str(p) for cg in cgs for p in cg.iterdir() if p.is_dir()]
    files = [str(p) for d in (runtime / "microvm" / "sandboxes",
                              tmp_path / "state" / "microvm" / "vms") if d.exists()
             for p in d.iterdir()]
    mounts = str(runtime) in Path("/proc/mounts").read_text()
    for cg in cgs:
        for p in cg.iterdir():
            if p.is_dir():
                p.rmdir()
        cg.rmdir()
    shutil.rmtree(runtime, ignore_errors=True)
    shutil.rmtree(sockdir, ignore_errors=True)
    assert not left, f"VMMs left running: {left}"
    assert not sub, f"VMM cgroups left: {sub}"
    assert not files, f"sandbox files left: {files}"
    assert not mounts, "mounts left behind"


def test_microvm_through_the_api(vm_node: Callable[..., RealNode],
                                 layer_store: tuple[str, str]) -> None:  # noqa: F811
    _, digest = layer_store
    node = vm_node()
    info = Transport(node.socket).json("GET", "/v1/node")
    assert set(info["backends"]) >= {"container", "microvm"}
    mv = info["backends"]["microvm"]
    assert mv["layer_form"] == "image" and mv["features"]["available"] is True, mv
    assert mv["features"]["accel"] == "tcg"
    assert mv["features"]["pool"]["size"] == 2  # microvm_pool's default
    with Sandbox.create(layers=[digest], id="mvm-1", env=ENV, backend="microvm",
                        memory_bytes=256 << 20, disk_bytes=128 << 20,
                        qos="latency_sensitive", socket=node.socket) as sbx:
        assert sbx.refresh()["backend"] == "microvm"
        # clones of its machine are started ahead; their memory is in GET /v1/node
        deadline = time.monotonic() + 120
        while Transport(node.socket).json("GET", "/v1/node")["memory"]["spare_bytes"] <= 0:
            assert time.monotonic() < deadline, "no memory held by the pool"
            time.sleep(0.2)
        r = sbx.exec("echo out; echo err >&2; cat /etc/marker; hostname; exit 5")
        assert (r.exit_code, r.stdout, r.stderr) == (5, "out\nfrom the layer\nmvm-1\n",
                                                     "err\n")
        # the guest's kernel, not the host's
        assert sbx.exec("uname -r").stdout.strip() != os.uname().release
        r = sbx.exec("read x; echo got $x", stdin="hi\n")
        assert r.stdout == "got hi\n"
        r = sbx.exec("echo started; sleep 100", timeout=0.5)
        assert r.reason == "timeout" and r.stdout == "started\n"
        r = sbx.exec("kill -9 $$")
        assert (r.reason, r.signal) == ("signalled", 9)
        r = sbx.exec("yes", output_limit=50_000)
        assert r.reason == "output_limit" and 0 < len(r.stdout) <= 50_000
        r = sbx.exec("dd if=/dev/zero of=/dev/null bs=300M count=1")
        assert r.reason == "oom", r
        # files
        assert sbx.files.write("/work/data.bin", b"\x00\x01" * 300_000) == 600_000
        assert sbx.files.read_bytes("/work/data.bin") == b"\x00\x01" * 300_000
        assert sbx.exec("wc -c < /work/data.bin").stdout.strip() == "600000"
        with pytest.raises((BadRequestError, NotFoundError)):
            sbx.files.read("/nope")
        # leftovers and kill_processes
        sbx.exec("(sleep 1000 &); (sleep 1000 &)")
        assert sbx.kill_processes() >= 2
        assert sbx.exec("pidof sleep || echo none").stdout == "none\n"
        st = sbx.stats()
        assert st["memory_bytes"] > 0 and st["cpu_usage_ns"] > 0, st
        # pause: the VMM goes; any request resumes it, what it held is there
        sbx.exec("echo kept > /work/state")
        sbx.pause()
        assert sbx.refresh()["state"] == "paused"
        # (the pool's clones started ahead may run beside it, under microvm/pool/)
        assert not qemu_pids(str(Path(node.server.config.runtime_dir) / "microvm"
                                 / "sandboxes"))
        with pytest.raises(InvalidStateError):
            sbx.pause()
        assert sbx.exec("cat /work/state").stdout == "kept\n"
        assert sbx.state == "running"
    assert Sandbox.list(socket=node.socket) == []
    # a TTL ends it as it ends a container
    Sandbox.create(layers=[digest], env=ENV, backend="microvm", timeout=2,
                   qos="latency_sensitive", socket=node.socket)
    deadline = time.monotonic() + 30
    while Sandbox.list(socket=node.socket) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert Sandbox.list(socket=node.socket) == []
    assert node.server.manager.layers.refs() == {}


def test_a_restarted_daemon_adopts_the_vm(vm_node: Callable[..., RealNode],
                                          layer_store: tuple[str, str]) -> None:  # noqa: F811
    _, digest = layer_store
    node = vm_node(on_shutdown="keep")
    sbx = Sandbox.create(layers=[digest], id="mvm-keep", env=ENV, backend="microvm",
                         qos="latency_sensitive", socket=node.socket)
    sbx.exec("echo kept > /tmp/state")
    microvm = Path(node.server.config.runtime_dir) / "microvm"
    pid = qemu_pids(str(microvm / "sandboxes"))
    node.stop()
    assert qemu_pids(str(microvm / "sandboxes")) == pid  # the VM outlives its daemon
    assert qemu_pids(str(microvm)) == pid  # the pool's clones do not
    t0 = time.monotonic()
    node2 = vm_node(on_start="adopt", on_shutdown="stop")
    assert node2.server.recovered["adopted"] == ["mvm-keep"], time.monotonic() - t0
    again = Sandbox.connect("mvm-keep", socket=node2.socket)
    assert again.exec("cat /tmp/state").stdout == "kept\n"
    again.kill()
