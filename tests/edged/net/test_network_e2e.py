"""Networked sandboxes end to end (root): a daemon with a network pool of its own, test
servers in a network namespace the test makes (198.18.0.0/24, RFC 2544 benchmarking space),
DNS answers from edged's resolver with static records. No traffic leaves the machine."""

from __future__ import annotations

import ctypes
import hashlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.client import InvalidStateError, Sandbox
from edged.net import libbpf
from tests.edged.test_e2e_container import layer_store, real_node  # noqa: F401

pytestmark = [pytest.mark.root, pytest.mark.mount]

SRV_NET = "198.18.0"
CLONE_NEWNET = 0x40000000


class ServerNetns:
    """A namespace with two addresses and TCP listeners that answer 'hi-<addr>:<port>'."""

    def __init__(self, tag: str) -> None:
        self.host_if = f"t{tag}"
        self.ready = threading.Event()
        self.stop = False
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        from pyroute2 import IPRoute

        assert self._libc.unshare(CLONE_NEWNET) == 0
        fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        inner = IPRoute()
        with open("/proc/self/ns/net") as f, IPRoute() as host:
            assert self._libc.setns(f.fileno(), CLONE_NEWNET) == 0
            host = IPRoute()
            host.link("add", ifname=self.host_if, kind="veth",
                      peer={"ifname": "eth0", "net_ns_fd": fd})
            i = host.link_lookup(ifname=self.host_if)[0]
            host.addr("add", index=i, address=f"{SRV_NET}.1", prefixlen=24)
            host.link("set", index=i, state="up")
            Path(f"/proc/sys/net/ipv4/conf/{self.host_if}/forwarding").write_text("1")
            host.close()
        assert self._libc.setns(fd, CLONE_NEWNET) == 0
        e = inner.link_lookup(ifname="eth0")[0]
        inner.link("set", index=inner.link_lookup(ifname="lo")[0], state="up")
        for a in (2, 3):
            inner.addr("add", index=e, address=f"{SRV_NET}.{a}", prefixlen=24)
        inner.link("set", index=e, state="up")
        inner.route("add", dst="0.0.0.0/0", gateway=f"{SRV_NET}.1")
        inner.close()
        socks = []
        for a in (2, 3):
            for p in (80, 8080):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((f"{SRV_NET}.{a}", p))
                s.listen(64)
                s.settimeout(0.2)
                socks.append(s)
        self.ready.set()
        while not self.stop:
            for s in socks:
                try:
                    c, _ = s.accept()
                except TimeoutError:
                    continue
                a, p = c.getsockname()
                with c:
                    c.sendall(f"hi-{a}:{p}\n".encode())
                    time.sleep(0.05)
        for s in socks:
            s.close()
        os.close(fd)

    def close(self) -> None:
        self.stop = True
        self.thread.join(10)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)


@pytest.fixture
def net_node(real_node, tmp_path) -> Iterator:  # noqa: F811
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:4]
    srv = ServerNetns(tag)
    prof = tmp_path / "net.toml"
    default = (Path(__file__).resolve().parents[3] / "profiles/network/default.toml").read_text()
    prof.write_text(default.replace("# static = {", "static = { \"ok.test\" = [\"198.18.0.2\"], "
                                    "\"other.test\" = [\"198.18.0.3\"] }\n# x = {"))
    third = int(tag[:2], 16)
    node = real_node(network_pool=f"10.214.{third}.0/24", network_pool6="",
                     network_profile=str(prof), network_prefix="n" + tag,
                     network_dns_upstreams="")
    table = f"edged_n{tag}"
    assert subprocess.run(["nft", "list", "table", "ip", table], capture_output=True,
                          text=True).stdout.count("masquerade") == 1, "the NAT rule is in place"
    yield node
    node.stop()
    gone = subprocess.run(["nft", "list", "table", "ip", table], capture_output=True)
    assert gone.returncode != 0, "the NAT table is removed with the last networked sandbox"
    srv.close()


def sh(sbx: Sandbox, cmd: str) -> str:
    r = sbx.exec(cmd, timeout=20)
    return r.stdout + r.stderr


def test_allowlist_dns_and_phase_switch(net_node, layer_store) -> None:  # noqa: F811
    _, digest = layer_store
    node = net_node
    feats = Sandbox.list
    del feats
    with Sandbox.create(layers=[digest], id="net-1", env={"PATH": "/bin"}, socket=node.socket,
                        network={"allow": ["ok.test", f"{SRV_NET}.3:8080"]}) as sbx:
        out = sh(sbx, "nslookup ok.test 8.8.8.8")
        assert "198.18.0.2" in out, out
        out = sh(sbx, "nslookup other.test 8.8.8.8; echo rc=$?")
        assert "198.18.0.3" not in out, out
        t0 = time.monotonic()
        assert "hi-198.18.0.2:80" in sh(sbx, "nc -w 3 198.18.0.2 80 </dev/null")
        out = sh(sbx, "nc -w 3 198.18.0.3 80 </dev/null; echo rc=$?")
        assert "hi-" not in out and "rc=1" in out, out
        assert time.monotonic() - t0 < 3, "a refused connect must be fast"
        assert "hi-198.18.0.3:8080" in sh(sbx, "nc -w 3 198.18.0.3 8080 </dev/null")
        evs = sbx.events(kind="egress_denied")
        assert any(e["address"] == "198.18.0.3:80" for e in evs), evs
        assert sbx.events(kind="dns_denied"), "the refused name is in the ledger"
        out = sbx.set_network("none")
        assert out["generation"] == 1
        out = sh(sbx, "nc -w 3 198.18.0.2 80 </dev/null; echo rc=$?")
        assert "hi-" not in out, out


def test_none_sandbox_cannot_switch(net_node, layer_store) -> None:  # noqa: F811
    _, digest = layer_store
    with Sandbox.create(layers=[digest], id="net-2", env={"PATH": "/bin"},
                        socket=net_node.socket) as sbx, pytest.raises(InvalidStateError):
        sbx.set_network({"allow": ["ok.test"]})


def test_no_bpf_objects_left(net_node, layer_store) -> None:  # noqa: F811
    _, digest = layer_store
    for i in range(3):
        with Sandbox.create(layers=[digest], id=f"net-l{i}", env={"PATH": "/bin"},
                            socket=net_node.socket, network={"allow": ["ok.test"]}) as sbx:
            sbx.exec("true")
    prefix = net_node.server.manager.net.prefix
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    # the prepared namespace (prepare_ahead) is the only one left
    assert sum(1 for ln in links.splitlines() if ln.startswith(prefix)) <= 1, links
    assert libbpf.next_ids("prog")
