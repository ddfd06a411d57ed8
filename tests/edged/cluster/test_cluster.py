"""The cluster end to end over a local Ray cluster: nodes joined by ``edged cluster join``,
placement by free capacity, refusals, a node killed, left or dead, ids found by any client,
the relay's exec streams and files, the direct path (fake-backend daemons: see
tests/edged/cluster/conftest.py)."""

from __future__ import annotations

import collections
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest

from edged.client import (
    BadRequestError,
    CapacityExhaustedError,
    NotFoundError,
    Sandbox,
)
from edged.cluster import AsyncClusterClient, ClusterClient, ClusterError, SandboxLostError
from edged.cluster.errors import NodeUnavailableError
from edged.cluster.transport import DirectTransport, HttpRelayTransport, RelayTransport
from tests.edged.cluster.conftest import DEAD_S, REPORT_S, LocalCluster, ray
from tests.edged.cluster.fakenode import LAYERS
from tests.edged.cluster.procs import ROOT, VENV_BIN, wait_for

LAYER = sorted(LAYERS)[0]
MAIN = {"group": "main"}
AUX = {"group": "aux"}


@pytest.fixture
def client(cluster: LocalCluster):
    c = ClusterClient(refresh_s=REPORT_S / 2, direct=False)
    yield c
    c.close()


def _counts(boxes) -> dict[str, int]:
    return dict(collections.Counter(b.node for b in boxes))


def test_joined_nodes_report_capacity_and_are_pinned(cluster: LocalCluster, client) -> None:
    nodes = {n["name"]: n for n in client.nodes()}
    assert set(nodes) >= {"a", "b", "c", "x", "y"}
    for name, cap in (("a", 100), ("b", 200), ("c", 300), ("x", 4), ("y", 3)):
        n = nodes[name]
        assert (n["state"], n["free"], n["held"]) == ("up", cap, 0), n
        assert n["backends"] == ["container"] and n["socket"] == cluster.nodes[name].socket
    assert nodes["x"]["labels"] == AUX and nodes["a"]["labels"] == MAIN
    # each relay runs on the Ray node its join process is on
    by_ip = {r["NodeManagerAddress"]: r["NodeID"] for r in ray.nodes() if r["Alive"]}
    for name, n in nodes.items():
        if name in cluster.nodes:
            assert n["ray_node_id"] == by_ip[cluster.nodes[name].ip], name
            actor = ray.get_actor(f"edged-node:{name}", namespace="edged")
            assert ray.get(actor.ping.remote())["ray_node_id"] == by_ip[cluster.nodes[name].ip]
    # and the CLI lists them too
    out = subprocess.run([str(VENV_BIN / "edged"), "cluster", "nodes", "--ray-address",
                          cluster.ray.address, "--node-ip-address", "127.0.0.2", "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert {n["name"]: n["free"] for n in json.loads(out.stdout)}["c"] == 300


def test_placement_proportional_to_free_capacity(cluster: LocalCluster, client) -> None:
    _settled(cluster)
    boxes = [client.create(layers=[LAYER], node_labels=MAIN) for _ in range(60)]
    counts = _counts(boxes)
    # 60 of 600 slots: 10 / 20 / 30 if every node is equally loaded. Within 5: power of k
    # choices draws at random, and reports lag on a loaded host (b=16 was seen at load 40);
    # a placement blind to capacity (20 / 20 / 20) is still 10 off.
    for name, want in (("a", 10), ("b", 20), ("c", 30)):
        assert abs(counts.get(name, 0) - want) <= 5, counts
    assert all(b.id.startswith(b.node + ".") for b in boxes)
    assert {b.node for b in boxes} <= {"a", "b", "c"}
    for name, want in counts.items():
        assert len(cluster.nodes[name].sandboxes()) == want


def test_burst_of_500_spreads_with_the_capacity_ratio(cluster: LocalCluster, client) -> None:
    """500 creates from one client at once (24 threads), with reports every 0.2 s, spread
    in proportion to capacity (100:200:300): a placement blind to capacity would put ~167
    on each (a: twice its share), one herding on the last report's emptiest node most of
    a burst on one node.

    Within 35% of each node's share: one CI run on a clean machine placed 65 on a (want
    83; 22% off; not reproduced in 60 bursts at load 16, nor in a simulation of lagging,
    jittered reports), so what every node saw and answered is recorded and printed with
    any failure (refusals, errors, down or stale reports explain a skew)."""
    _settled(cluster)
    watch = _Watch(cluster, client)
    try:
        with ThreadPoolExecutor(24) as pool:
            boxes = list(pool.map(lambda _: client.create(layers=[LAYER], node_labels=MAIN),
                                  range(500)))
    finally:
        watch.stop()
    counts = _counts(boxes)
    assert sum(counts.values()) == 500 and len({b.id for b in boxes}) == 500
    for name, cap in (("a", 100), ("b", 200), ("c", 300)):
        want = 500 * cap / 600
        assert abs(counts[name] - want) <= 0.35 * want, (counts, name, watch.summary())
        assert len(cluster.nodes[name].sandboxes()) == counts[name]
    with ThreadPoolExecutor(24) as pool:
        list(pool.map(lambda b: b.kill(), boxes))
    assert all(not cluster.nodes[n].sandboxes() for n in ("a", "b", "c"))


class _Watch:
    """What a burst met, for a failing assertion's message: per node the client's failed
    attempts (refused or not) and, every REPORT_S / 2 from the registry, the states seen,
    the least free, the oldest report (age_s) and the largest in-flight count this client
    laid over it."""

    def __init__(self, cluster: LocalCluster, client: ClusterClient) -> None:
        self.failed: collections.Counter = collections.Counter()
        self.refused: collections.Counter = collections.Counter()
        self.states: dict[str, set[str]] = collections.defaultdict(set)
        self.min_free: dict[str, int] = {}
        self.max_age: dict[str, float] = {}
        self.max_in_flight: dict[str, int] = collections.defaultdict(int)
        self._cluster, self._client = cluster, client
        self._placer_failed = client.placer.failed
        client.placer.failed = self._on_failed  # type: ignore[method-assign]
        self._done = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()

    def _on_failed(self, t, refused_at=None) -> None:
        (self.refused if refused_at is not None else self.failed)[t.node] += 1
        self._placer_failed(t, refused_at)

    def _sample(self) -> None:
        while not self._done.wait(REPORT_S / 2):
            for n in ray.get(self._cluster.registry.nodes.remote()):
                name = n["name"]
                if name not in ("a", "b", "c"):
                    continue
                self.states[name].add(n["state"])
                self.min_free[name] = min(self.min_free.get(name, 1 << 30), n.get("free", 0))
                self.max_age[name] = max(self.max_age.get(name, 0.0), n.get("age_s", 0.0))
            for name, k in self._client.placer.in_flight().items():
                self.max_in_flight[name] = max(self.max_in_flight[name], k)

    def stop(self) -> None:
        self._done.set()
        self._t.join(10)
        self._client.placer.failed = self._placer_failed  # type: ignore[method-assign]

    def summary(self) -> dict[str, dict[str, object]]:
        return {n: {"refused": self.refused[n], "failed": self.failed[n],
                    "states": sorted(self.states[n]), "min_free": self.min_free.get(n),
                    "max_age_s": self.max_age.get(n), "max_in_flight": self.max_in_flight[n]}
                for n in ("a", "b", "c")}


def test_refused_create_lands_elsewhere(aux: LocalCluster) -> None:
    """x (4) looks emptiest to a client whose view is stale; x is full meanwhile (filled
    through its own socket): x's admission refuses, the create lands on y, and x counts as
    full for this client until a report taken after the refusal."""
    client = ClusterClient(refresh_s=1e9, direct=False, k=2)
    try:
        for _ in range(4):
            Sandbox.create(layers=[LAYER], socket=aux.nodes["x"].socket)
        sbx = client.create(layers=[LAYER], node_labels=AUX)
        assert sbx.node == "y"
        assert client.placer.effective("x")[0] == 0  # marked full by the refusal
        time.sleep(3 * REPORT_S)
        client.refresh()
        assert client.placer.effective("x")[0] == 0  # its report says so now
        assert [s.id for s in aux.nodes["y"].sandboxes()] == [sbx.id]
        # every node refuses: bounded, and the refusal is what the caller gets
        for _ in range(2):
            client.create(layers=[LAYER], node_labels=AUX)
        with pytest.raises(CapacityExhaustedError) as ei:
            client.create(layers=[LAYER], node_labels=AUX)
        assert ei.value.retry_after is not None
    finally:
        client.close()


def test_bad_request_is_not_retried_elsewhere(cluster: LocalCluster, client) -> None:
    before = {n: len(cluster.nodes[n].sandboxes()) for n in ("a", "b", "c")}
    with pytest.raises(BadRequestError):
        client.create(layers=[LAYER], node_labels=MAIN, cpus=-1)
    with pytest.raises(NotFoundError):
        client.create(layers=["sha256:" + "e" * 64], node_labels=MAIN)
    with pytest.raises(ClusterError):
        client.create(layers=[LAYER], node_labels={"group": "none"})
    with pytest.raises(ClusterError):
        client.create(layers=[LAYER], backend="microvm")
    assert client.placer.in_flight() == {}
    assert before == {n: len(cluster.nodes[n].sandboxes()) for n in ("a", "b", "c")}


def test_kill_9_of_a_daemon_loses_its_sandboxes(aux: LocalCluster, client) -> None:
    x = aux.nodes["x"]
    boxes = [client.create(layers=[LAYER], node_labels=AUX) for _ in range(5)]
    on_x = [b for b in boxes if b.node == "x"]
    assert on_x and len(on_x) < 5
    aux.wait_listed(*boxes)
    x.kill_daemon()
    aux.wait_state("x", "down")
    lost = client.lost("x")
    assert set(lost) == {b.id for b in on_x}
    assert all("does not answer" in v["cause"] and v["state"] == "running"
               for v in lost.values())
    with pytest.raises(SandboxLostError) as ei:
        on_x[0].exec("true")
    assert ei.value.node == "x"
    with pytest.raises(SandboxLostError):
        client.connect(on_x[0].id)
    with pytest.raises(SandboxLostError):
        on_x[0].kill()  # not silently "done"
    listed = {s.id: s for s in client.list()}
    assert {i for i, s in listed.items() if s.info["state"] == "lost"} >= {b.id for b in on_x}
    # new creates go to the others (y had room for 3; it holds 5 - len(on_x))
    room = 3 - (5 - len(on_x))

    def y_has_room() -> bool:  # by a report taken after the creates above (CI once saw
        client.refresh()  # "no node has room by the last reports" here): what it saw, below
        seen.append((client.placer.effective("y"), client.placer.in_flight(),
                     next(v for v in client.placer.views() if v.name == "y")))
        return seen[-1][0][0] >= room
    seen: list[object] = []
    try:
        wait_for(y_has_room, 10, "y's room in the reports", step=REPORT_S)
    except AssertionError as e:
        raise AssertionError(f"{e}: the placer saw (free, load), in flight, y: {seen[-3:]}") \
            from e
    new = [client.create(layers=[LAYER], node_labels=AUX) for _ in range(room)]
    assert {b.node for b in new} == {"y"}
    # the daemon comes back without them (this backend keeps no sandbox across a restart):
    # they stay lost, and it is said that they are gone
    x.start_daemon()
    aux.wait_state("x", "up")
    wait_for(lambda: all(v["confirmed"] for v in client.lost("x").values()), 10,
             "the loss confirmed")
    assert set(client.lost("x")) == {b.id for b in on_x}
    assert client.create(layers=[LAYER], node_labels=AUX, node="x").node == "x"


def _refuses(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` any more."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _actor_dead(actor: object) -> bool:
    """Whether a killed actor no longer answers (its worker process gone)."""
    try:
        ray.get(actor.ping.remote(), timeout=2)  # type: ignore[attr-defined]
    except Exception:  # RayActorError, GetTimeoutError: not answering
        return True
    return False


def test_a_node_whose_relay_dies_is_dead_and_its_sandboxes_lost(aux: LocalCluster,
                                                                client) -> None:
    sbx = client.create(layers=[LAYER], node="y")
    aux.wait_listed(sbx)
    y = aux.nodes["y"]
    actor = ray.get_actor("edged-node:y", namespace="edged")
    assert isinstance(sbx._t, HttpRelayTransport)
    calls = ray.get(actor.ping.remote())["http_calls"]
    y.join.stop(sig=signal.SIGKILL)  # the join process gone: the detached relay goes on
    time.sleep(3 * REPORT_S)
    assert aux.states()["y"] == "up"
    assert sbx.exec("echo still").stdout == "still\n"  # over the HTTP relay, still
    assert ray.get(actor.ping.remote())["http_calls"] > calls
    ray.kill(actor, no_restart=True)  # its HTTP relay goes with it
    # ray.kill returns before the actor's worker process is gone; until it is, its HTTP
    # relay still answers (CI saw the next exec succeed): wait for the actor to be dead.
    wait_for(lambda: _actor_dead(actor), 30, "the killed relay actor gone")
    # ... and even once Ray says so, its worker process (and HTTP relay) may still be going:
    # CI saw the exec below succeed. Wait until the relay's port refuses connections.
    url = urllib.parse.urlsplit(next(v for v in client.placer.views() if v.name == "y").http_url)
    wait_for(lambda: _refuses(url.hostname or "", url.port or 0), 30, "y's HTTP relay gone")
    with pytest.raises((NodeUnavailableError, SandboxLostError)):
        sbx.exec("true")  # the HTTP relay refuses connections, the actor is gone
    t0 = time.monotonic()
    aux.wait_state("y", "dead", DEAD_S + 5)
    assert time.monotonic() - t0 >= DEAD_S - 3 * REPORT_S
    assert sbx.id in client.lost("y")
    assert "no report" in client.lost("y")[sbx.id]["cause"]
    with pytest.raises(SandboxLostError):
        sbx.exec("true")
    # a new join takes it back: its sandbox is found again
    y.start_join()
    aux.wait_state("y", "up")
    wait_for(lambda: sbx.id not in client.lost("y"), 10, "the sandbox found again")
    assert client.connect(sbx.id).exec("echo back").stdout == "back\n"


def test_leave_on_sigterm(aux: LocalCluster, client) -> None:
    sbx = client.create(layers=[LAYER], node="x")
    aux.wait_listed(sbx)
    x = aux.nodes["x"]
    assert x.join.stop(sig=signal.SIGTERM) == 0
    assert "node x left" in x.join.text()
    assert aux.states()["x"] == "left"
    assert "left the cluster" in client.lost("x")[sbx.id]["cause"]
    with pytest.raises(ValueError):
        ray.get_actor("edged-node:x", namespace="edged")
    for _ in range(3):
        assert client.create(layers=[LAYER], node_labels=AUX).node == "y"


def test_a_new_client_finds_a_sandbox_by_id(cluster: LocalCluster, client) -> None:
    sbx = client.create(layers=[LAYER], node_labels=MAIN, labels={"job": "t"})
    sbx.files.write("/note", "from the first client")
    code = (
        "import sys, json\n"
        "from edged.cluster import ClusterClient\n"
        f"c = ClusterClient({cluster.ray.address!r}, node_ip_address='127.0.0.2')\n"
        "s = c.connect(sys.argv[1])\n"
        "print(json.dumps([s.node, s.files.read('/note'), s.exec('echo ok').stdout,"
        " sorted(x.id for x in c.list({'job': 't'}))]))\n"
        "c.close()\n")
    out = subprocess.run([sys.executable, "-c", code, sbx.id], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    node, note, echoed, listed = json.loads(out.stdout.strip().splitlines()[-1])
    assert (node, note, echoed, listed) == (sbx.node, "from the first client", "ok\n",
                                             [sbx.id])
    with pytest.raises(NotFoundError):
        client.connect(f"{sbx.node}.nosuch")


@pytest.mark.parametrize("http", [True, False], ids=["http-relay", "actor-relay"])
def test_relayed_exec_streams_files_and_states(cluster: LocalCluster, http: bool) -> None:
    client = ClusterClient(refresh_s=REPORT_S / 2, direct=False, http=http)
    sbx = client.create(layers=[LAYER], node="b")
    assert type(sbx._t) is (HttpRelayTransport if http else RelayTransport)
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    r = sbx.exec("echo one; sleep 1; echo two >&2; exit 4",
                 on_stdout=lambda s: seen.append((time.monotonic() - t0, s)))
    assert (r.exit_code, r.stdout, r.stderr) == (4, "one\n", "two\n")
    assert seen and seen[0][1] == "one\n" and seen[0][0] < r.duration  # before the end
    data = bytes(range(256)) * (40 << 10)  # 10 MiB: several relayed chunks each way
    assert sbx.files.write("/big.bin", data) == len(data)
    assert sbx.files.read_bytes("/big.bin") == data
    assert sbx.files.write("/parts", iter([b"a" * (3 << 20), b"b" * (3 << 20)])) == 6 << 20
    with pytest.raises(NotFoundError):
        sbx.files.read("/missing")
    sbx.pause()
    assert sbx.state == "paused"
    sbx.resume()
    assert sbx.stats()["pids"] >= 0 and sbx.commands.run("echo x").stdout == "x\n"
    sbx.kill()
    sbx.kill()  # idempotent
    with pytest.raises(NotFoundError):
        client.connect(sbx.id)
    if http:  # all of it over HTTP: not one call fell back to the actor
        assert isinstance(sbx._t, HttpRelayTransport) and sbx._t.route.failed_at is None
    client.close()


@pytest.mark.parametrize("http", [True, False], ids=["http-relay", "actor-relay"])
def test_abandoned_relayed_exec_is_killed(cluster: LocalCluster, http: bool) -> None:
    client = ClusterClient(refresh_s=REPORT_S / 2, direct=False, http=http)
    sbx = client.create(layers=[LAYER], node="c")
    stream = sbx._t.ndjson("POST", f"/v1/sandboxes/{sbx.id}/exec",
                           {"cmd": "echo started; sleep 60"})
    assert "start" in next(stream)
    assert next(stream) == {"stdout": "started\n"}
    stream.close()  # the client gives up: the relay's request is cancelled
    wait_for(lambda: sbx.events(kind="exec_abandoned"), 10, "exec_abandoned")
    assert sbx.exec("echo next").stdout == "next\n"
    client.close()


def test_direct_path_on_the_same_ray_node(cluster: LocalCluster) -> None:
    with ClusterClient(refresh_s=REPORT_S) as c:  # direct where it can be
        assert c.local_node() == "a"
        here = c.create(layers=[LAYER], node="local")
        there = c.create(layers=[LAYER], node="b")
        assert here.node == "a" and isinstance(here._t, DirectTransport)
        assert isinstance(there._t, HttpRelayTransport)
        assert here.exec("echo d").stdout == "d\n" and there.exec("echo r").stdout == "r\n"
        here.kill()
        there.kill()


@pytest.mark.parametrize("http", [True, False], ids=["http-relay", "actor-relay"])
def test_async_client(cluster: LocalCluster, http: bool) -> None:
    import asyncio

    async def main() -> None:
        async with AsyncClusterClient(refresh_s=REPORT_S / 2, direct=False, http=http) as c:
            boxes = await asyncio.gather(*(c.create(layers=[LAYER], node_labels=MAIN)
                                           for _ in range(30)))
            counts = _counts(boxes)
            assert sum(counts.values()) == 30 and counts.get("c", 0) >= counts.get("a", 0)
            chunks: list[str] = []
            r = await boxes[0].exec("echo a; echo b", on_stdout=chunks.append)
            assert r.stdout == "a\nb\n" and "".join(chunks) == "a\nb\n"
            assert await boxes[0].files.write("/f", b"z" * (5 << 20)) == 5 << 20
            assert await boxes[0].files.read_bytes("/f") == b"z" * (5 << 20)
            again = await c.connect(boxes[1].id)
            assert again.node == boxes[1].node
            assert {s.id for s in await c.list()} >= {b.id for b in boxes}
            await asyncio.gather(*(b.kill() for b in boxes))
            assert not {s.id for s in await c.list(lost=False)} & {b.id for b in boxes}

    asyncio.run(main())


def _settled(cluster: LocalCluster) -> None:
    """Until the registry's reports show a, b and c up, empty and with room: a burst that
    starts while a report still counts the last test's sandboxes, or while a node is down,
    measures the cluster's state, not placement."""
    def empty() -> bool:
        got = {n["name"]: n for n in ray.get(cluster.registry.nodes.remote())}
        return all(got.get(k, {}).get("state") == "up" and got[k].get("held") == 0
                   and got[k].get("free", 0) > 0 for k in ("a", "b", "c"))
    wait_for(empty, 30, "a, b and c up and empty in their reports", step=REPORT_S / 2)


def test_concurrent_threads_and_clients(cluster: LocalCluster) -> None:
    """Two clients with their own overlays at once, no client's burst herding: every
    node takes some."""
    _settled(cluster)
    clients = [ClusterClient(refresh_s=REPORT_S, direct=False) for _ in range(2)]
    boxes: list = []
    # (client, node, what that client saw then: state, free, held, age of each report)
    seen: list[tuple[int, str, dict[str, tuple[str, int, int, float]]]] = []
    lock = threading.Lock()

    def burst(i: int, c: ClusterClient) -> None:
        for _ in range(30):
            b = c.create(layers=[LAYER], node_labels=MAIN)
            view = {v.name: (v.state, v.free, v.held, round(v.age_s, 2))
                    for v in c.placer.views() if v.name in ("a", "b", "c")}
            with lock:
                boxes.append(b)
                seen.append((i, b.node, view))
    try:
        ts = [threading.Thread(target=burst, args=(i, c)) for i, c in enumerate(clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        counts = _counts(boxes)
        assert len(boxes) == 60 and set(counts) == {"a", "b", "c"}, (counts, seen)
        # no herding: no node takes two thirds of the burst (each client's overlay knows only
        # its own placements, so the split need not follow the capacity ratio: 15 on c
        # against 16 on a was seen with 100:200:300). The views each create saw are in
        # the message: a node that was down or reported full explains a skew.
        assert max(counts.values()) <= 40, (counts, seen)
    finally:
        for c in clients:
            c.close()
