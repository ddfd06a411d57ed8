"""A local Ray cluster for the cluster tests, and edged nodes joined to it.

One Ray cluster for the whole package (three Ray nodes on 127.0.0.2-4, ~10 s to start):
this test process is a driver on the first. Daemons are processes of their own (a test may
``kill -9`` one), each joined by its own ``edged cluster join`` process. Everything is
stopped at the end and checked gone: no Ray process, daemon or join process outlives the
package (tests/edged/cluster/procs.py has how, without ``ray stop``).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from edged.client import Sandbox, SandboxError
from tests.edged.cluster.procs import VENV_BIN, Proc, RayCluster, in_session, wait_for

ray = pytest.importorskip("ray", reason="the cluster tests need Ray (pip install edged[test])")

IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
REPORT_S = 0.2  # the relays' report interval in these tests
DEAD_S = 2.0  # the registry's dead_after_s


@dataclass
class EdgedNode:
    """One edged node of the test cluster: its daemon and its join process."""

    name: str
    ip: str
    dir: Path
    daemon_argv: Sequence[str]
    labels: dict[str, str]
    ray_address: str
    daemon: Proc | None = None
    join: Proc | None = None
    old: list[Proc] = field(default_factory=list)

    @property
    def socket(self) -> str:
        return str(self.dir / "edged.sock")

    def start_daemon(self, timeout: float = 60.0) -> None:
        self.daemon = Proc(self.daemon_argv, self.dir / "daemon.log")

        def answers() -> bool:
            if not self.daemon or not self.daemon.alive():
                raise AssertionError(f"daemon {self.name} ended:\n{self.daemon_log()}")
            try:
                Sandbox.list(socket=self.socket)
            except SandboxError:
                return False
            return True
        wait_for(answers, timeout, f"daemon {self.name}", step=0.1)

    def start_join(self) -> Proc:
        argv = [str(VENV_BIN / "edged"), "cluster", "join", "--ray-address", self.ray_address,
                "--node-ip-address", self.ip, "--socket", self.socket, "--node-name", self.name,
                "--report-interval", str(REPORT_S), "--dead-after", str(DEAD_S),
                "--list-every", "2"]
        for k, v in self.labels.items():
            argv += ["--label", f"{k}={v}"]
        self.join = Proc(argv, self.dir / "join.log")
        return self.join

    def kill_daemon(self) -> None:
        """kill -9 of the daemon alone (sandboxes and helpers it started are left)."""
        assert self.daemon is not None
        self.daemon.send(signal.SIGKILL)
        self.daemon.p.wait(10)
        self.old.append(self.daemon)
        self.daemon = None

    def daemon_log(self) -> str:
        return (self.dir / "daemon.log").read_text(errors="replace")

    def sandboxes(self) -> list[Sandbox]:
        return Sandbox.list(socket=self.socket)

    def stop(self) -> None:
        for p in (self.join, self.daemon, *self.old):
            if p is not None:
                p.stop(30)
        self.join = self.daemon = None
        self.old.clear()


@dataclass
class LocalCluster:
    ray: RayCluster
    nodes: dict[str, EdgedNode]
    registry: Any

    def states(self) -> dict[str, str]:
        return {n["name"]: n["state"] for n in ray.get(self.registry.nodes.remote())}

    def wait_state(self, name: str, state: str, timeout: float = 15.0) -> None:
        wait_for(lambda: self.states().get(name) == state, timeout,
                 f"node {name} {state} (now {self.states().get(name)})")

    def wait_listed(self, *boxes: Any, timeout: float = 15.0) -> None:
        """Until the registry lists each of ``boxes`` (cluster handles) on its node: a
        report has carried it (a fixed sleep is too short on a loaded machine)."""
        def listed() -> bool:
            where = [ray.get(self.registry.locate.remote(b.id)) for b in boxes]
            return all(w is not None and w["node"] == b.node and w["state"] != "lost"
                       for w, b in zip(where, boxes, strict=True))
        wait_for(listed, timeout, "the sandboxes listed in a report")


def joined(rc: RayCluster, nodes: dict[str, EdgedNode]) -> LocalCluster:
    """``nodes`` (their joins started) once the registry lists each of them up."""
    def registry() -> Any:
        with contextlib.suppress(ValueError):
            return ray.get_actor("edged-registry", namespace="edged")
        return None
    tc = LocalCluster(rc, nodes, wait_for(registry, 60, "the registry", step=0.2))
    for name in nodes:
        tc.wait_state(name, "up", 60)
    return tc


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[RayCluster]:
    tmp = Path(tempfile.mkdtemp(prefix="edged-i16-", dir="/tmp"))
    rc = RayCluster(tmp, IPS)
    try:
        rc.start()
        ray.init(address=rc.address, _node_ip_address=IPS[0], namespace="edged",
                 log_to_driver=False, logging_level="warning")
        rc.wait_nodes()
        yield rc
    finally:
        if ray.is_initialized():
            ray.shutdown()
        rc.stop()
        for p in rc.procs:
            assert not in_session(p.pid), f"Ray processes left in session {p.pid}"
        shutil.rmtree(tmp, ignore_errors=True)


def fake_daemon_argv(d: Path, cap: int) -> list[str]:
    return [str(VENV_BIN / "python"), "-m", "tests.edged.cluster.fakenode", "--socket",
            str(d / "edged.sock"), "--dir", str(d), "--max-sandboxes", str(cap)]


#: the fake nodes: name -> (Ray node address, capacity in sandboxes, group label)
FAKE_NODES = {"a": (IPS[0], 100, "main"), "b": (IPS[1], 200, "main"),
              "c": (IPS[2], 300, "main"), "x": (IPS[1], 4, "aux"), "y": (IPS[2], 3, "aux")}


@pytest.fixture(scope="package")
def cluster(ray_cluster: RayCluster) -> Iterator[LocalCluster]:
    """Five fake-backend daemons joined: a, b, c (100, 200, 300 sandboxes; label
    group=main) and x, y (4 and 3; group=aux) for the tests that kill, fill or remove a
    node."""
    nodes: dict[str, EdgedNode] = {}
    try:
        for name, (ip, cap, group) in FAKE_NODES.items():
            d = ray_cluster.tmp / name
            d.mkdir()
            nodes[name] = EdgedNode(name, ip, d, fake_daemon_argv(d, cap), {"group": group},
                                    ray_cluster.address)
            nodes[name].start_daemon()
        for n in nodes.values():
            n.start_join()
        tc = joined(ray_cluster, nodes)
        yield tc
    finally:
        for n in nodes.values():
            n.stop()


@pytest.fixture
def aux(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The cluster with x and y up and empty, before and after the test."""
    _restore(cluster)
    yield cluster
    _restore(cluster)


def _restore(tc: LocalCluster) -> None:
    for name in ("x", "y"):
        n = tc.nodes[name]
        if n.daemon is None or not n.daemon.alive():
            n.start_daemon()
        if n.join is None or not n.join.alive():
            if n.join is not None:
                n.join.stop()
            n.start_join()
        for s in n.sandboxes():
            s.kill()
        tc.wait_state(name, "up")
    cap = {"x": FAKE_NODES["x"][1], "y": FAKE_NODES["y"][1]}
    wait_for(lambda: all(n["free"] == cap[n["name"]] and n["held"] == 0
                         for n in ray.get(tc.registry.nodes.remote()) if n["name"] in cap),
             10, "x and y reported empty")


@pytest.fixture(autouse=True)
def _empty_nodes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every sandbox a test left on a fake node is removed after it."""
    yield
    if "cluster" not in request.fixturenames:
        return
    tc: LocalCluster = request.getfixturevalue("cluster")
    for n in tc.nodes.values():
        if n.daemon is not None and n.daemon.alive():
            for s in n.sandboxes():
                s.kill()
