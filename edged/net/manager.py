"""The node's networking: one :class:`NetworkManager` per daemon owns the address pool, the
prepared namespaces, the egress programs and their maps, the DNS resolver and the NAT rule,
and each networked sandbox's policy.

Per networked sandbox: :meth:`NetworkManager.attach` hands out a prepared namespace (made
ahead, off the create's path: ``prepare_ahead`` of them are kept ready) and registers the
sandbox's policy in the BPF maps before its first process runs; the spawner joins that
namespace (``--netns-fd``) and the cgroup v2 directory the programs are attached to
(``--join``); :meth:`detach` forgets it (the namespace, veth and host route go with the
sandbox's last process). :meth:`set_policy` replaces a policy at once: the maps are rewritten,
the policy generation bumped (the skb backstop re-checks every socket made under the old
one), and each connected socket whose peer the new policy forbids is destroyed
(``SOCK_DESTROY``: its owner gets ECONNABORTED, a TCP peer a reset). What survives a switch:
connections to what the new policy still allows, loopback traffic, and unconnected UDP
sockets (each datagram they send is checked).

State that outlives the daemon: the programs stay attached (see :mod:`edged.net.bpf`) and
``<state_dir>/network/<id>.json`` records each sandbox's index, namespace cookie, addresses
and policy, so a restarted daemon adopts them; what it learned from DNS is in the maps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.errors import BackendError, BadRequest, EdgedError, InvalidState, NotFound
from edged.net import bpf, dns, netns, policy, profile, proxy, sockdiag
from edged.net.policy import Network, Policy

log = logging.getLogger("edged.net")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
EventSink = Callable[..., object]

QUERY_RATE, QUERY_BURST = 100, 200  # DNS queries a second per sandbox
#: proxy refusals reported a second per sandbox (as the programs' own denials: bpf.EVENT_RATE)
PROXY_EVENT_RATE, PROXY_EVENT_BURST = 100, 100
#: A learned address stays in the map this long past its TTL (a client that cached the
#: answer until the last second still connects), then is collected.
LEARN_GRACE_S = 2.0
GC_INTERVAL_S = 10.0


@dataclass
class Settings:
    """The daemon's network knobs (see :class:`edged.config.Config`, ``network_*``)."""

    state_dir: Path
    pool4: str = "10.213.0.0/16"
    pool6: str = "fd8e:dbe7:ed9e:1::/64"
    prefix: str = ""
    profile: str = "default"
    dns_port: int = 53
    upstreams: tuple[str, ...] = ()
    nat: bool = True
    uplink: str = ""
    prepare_ahead: int = 1
    cgroup_dir: Path | None = None
    #: the SNI/Host proxy (:mod:`edged.net.proxy`) and its ports on the gateway addresses
    proxy: bool = True
    proxy_tls_port: int = 443
    proxy_http_port: int = 80
    #: the backend whose sandboxes join these namespaces (the one with ``cgroup_dir``)
    backend: str = "container"


@dataclass
class _Bucket:
    """A token bucket: ``rate`` a second up to ``burst``."""

    rate: float
    burst: float
    tokens: float = -1.0
    last: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class _Sandbox:
    sid: str
    ns: netns.Netns
    policy: Policy
    gen: int = 0
    rule_keys: set[tuple[str, bytes]] = field(default_factory=set)
    #: (map, key) -> expiry (monotonic ns) of learned addresses
    learned: dict[tuple[str, bytes], int] = field(default_factory=dict)
    #: address -> names it was answered for (for the ledger's "name it came from")
    names: dict[Address, set[str]] = field(default_factory=dict)
    queries: _Bucket = field(default_factory=lambda: _Bucket(QUERY_RATE, QUERY_BURST))
    events: _Bucket = field(default_factory=lambda: _Bucket(PROXY_EVENT_RATE,
                                                            PROXY_EVENT_BURST))
    dropped: int = 0  # proxy refusals not reported since the last one

    @property
    def sandbox_id(self) -> str:
        return self.sid

    def allow_query(self) -> bool:
        return self.queries.take()

    def record(self) -> dict[str, Any]:
        return {"id": self.sid, "index": self.ns.index, "cookie": self.ns.cookie,
                "host_if": self.ns.host_if, "addr4": str(self.ns.addr4),
                "addr6": str(self.ns.addr6) if self.ns.addr6 else None,
                "policy": self.policy.request, "gen": self.gen,
                "names": {str(a): sorted(n) for a, n in self.names.items()}}


@dataclass
class Attachment:
    """What the backend needs to place a sandbox in its network: ``netns_fd`` (to pass to
    the spawner; the daemon closes its copy in :meth:`NetworkManager.spawned`) and
    ``cgroup_dir`` (the cgroup v2 directory its processes must live in)."""

    netns_fd: int
    cgroup_dir: str | None
    addr4: str
    addr6: str | None


def _prefix_for(state_dir: Path) -> str:
    return "e" + hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:4]


class NetworkManager:
    """Networking of one node. ``sink``: the ledger's ``record`` (``egress_denied`` and
    ``dns_denied`` events). ``pid_of(sandbox_id)``: the host pid of a process in the
    sandbox's namespace (its init; raises an :mod:`edged.errors` exception for an unknown
    sandbox): how the daemon enters a namespace it no longer holds an fd of. Call
    :meth:`start` first; every method raises :mod:`edged.errors` exceptions."""

    def __init__(self, settings: Settings, sink: EventSink | None = None,
                 pid_of: Callable[[str], int] | None = None) -> None:
        self.s = settings
        self.sink = sink
        self.pid_of = pid_of
        self.backend = settings.backend
        self.prefix = settings.prefix or _prefix_for(settings.state_dir)
        try:
            self.pool4 = ipaddress.IPv4Network(settings.pool4)
            self.pool6 = ipaddress.IPv6Network(settings.pool6) if settings.pool6 else None
        except ValueError as exc:
            raise BadRequest(f"network pool: {exc}") from exc
        if self.pool4.num_addresses < 8:
            raise BadRequest(f"network pool {self.pool4}: at least a /29")
        self.gw4 = self.pool4[1]
        self.gw6 = self.pool6[1] if self.pool6 is not None else None
        self.profile = profile.load(settings.profile)
        self.denies: list[Network] = list(self.profile.deny)
        self.records = settings.state_dir / "network"
        self.filter: bpf.EgressFilter | None = None
        self.resolver: dns.Resolver | None = None
        self.proxy: proxy.Proxy | None = None
        self.plumber = netns.Plumber(self.prefix, self.gw4, self.gw6)
        self._sandboxes: dict[str, _Sandbox] = {}
        self._by_addr: dict[Address, _Sandbox] = {}
        self._ready: list[netns.Netns] = []
        self._used: set[int] = set()
        self._filling: asyncio.Task[None] | None = None
        self._gc: asyncio.Task[None] | None = None
        self._events_fd = -1
        self.features: dict[str, object] = {"enabled": False}
        self.nat_table = f"edged_{self.prefix}"

    # -- start / stop ---------------------------------------------------------------------

    async def start(self) -> dict[str, object]:
        """Probe and start: the egress programs on the cgroup v2 directory, the resolver,
        NAT. Returns the features found (also :attr:`features`); networked sandboxes are
        refused (409) when ``enabled`` is False, with ``reason``."""
        feats: dict[str, object] = {"enabled": False, "pool4": str(self.pool4),
                                    "pool6": str(self.pool6) if self.pool6 else None,
                                    "interface_prefix": self.prefix,
                                    "profile": self.profile.path,
                                    "services": sorted(self.profile.services)}
        self.features = feats
        self._check_ipv6(feats)
        if self.s.cgroup_dir is None:
            feats["reason"] = "no cgroup v2 directory to attach the egress programs to"
            return feats
        ok, why = bpf.available()
        feats["cgroup_bpf"] = False
        if not ok:
            feats["reason"] = why
            return feats
        pools: list[Network] = [self.pool4] + ([self.pool6] if self.pool6 else [])
        users = await self.plumber.run(self.plumber.pool_users, pools)
        if users:
            feats["reason"] = (f"network pool {', '.join(map(str, pools))} in use on this host "
                               f"(interfaces {', '.join(users)}): configure network_pool")
            return feats
        try:
            self.s.cgroup_dir.mkdir(exist_ok=True)
            self.filter = await asyncio.to_thread(bpf.EgressFilter.open, self.s.cgroup_dir)
        except (OSError, BackendError) as exc:
            feats["reason"] = f"egress programs: {exc}"
            return feats
        feats["cgroup_bpf"] = True
        feats["cgroup_dir"] = str(self.s.cgroup_dir)
        feats["netns"] = True
        if self.profile.deny_node_addresses:
            self.denies += await self.plumber.run(_node_addresses, self.prefix)
        await asyncio.to_thread(self.filter.set_denies, self.denies)
        upstreams = list(self.s.upstreams) or dns.resolv_conf_servers()
        self.resolver = dns.Resolver(
            [self.gw4] + ([self.gw6] if self.gw6 else []), self.s.dns_port, upstreams,
            self._client_of, self._learn, self._dns_refused, denies=self.denies,
            static=self.profile.static, ttl_min=self.profile.ttl_min,
            ttl_max=self.profile.ttl_max)
        try:
            await self.resolver.start()
        except OSError as exc:
            feats["reason"] = f"resolver on {self.gw4}:{self.s.dns_port}: {exc}"
            self.resolver = None
            await self._close_filter(detach=not self._live_records())
            return feats
        feats["dns"] = {"listen": [str(a) for a in self.resolver.listen],
                        "port": self.s.dns_port, "upstreams": upstreams}
        feats["sni_check"] = await self._start_proxy(feats)
        feats["nat"] = await asyncio.to_thread(self._nat_setup)
        feats["uplink_forwarding"] = _uplink_forwarding(self.s.uplink)
        self._events_fd = self.filter.start_events()
        asyncio.get_running_loop().add_reader(self._events_fd, self._drain_events)
        await self._adopt_records()
        feats["enabled"] = True
        self._gc = asyncio.ensure_future(self._gc_loop())
        await self._fill()  # ready before the first create (and its fds open from the start)
        return feats

    def _check_ipv6(self, feats: dict[str, object]) -> None:
        """Sandboxes get IPv6 only where the host forwards it (:func:`netns.ipv6_forwarding`):
        an address and a default route that lead nowhere would make every client that tries
        IPv6 first wait for a timeout. Sets ``ipv6`` and ``ipv6_reason`` in ``feats``; without
        forwarding, the v6 pool is dropped (``pool6`` None) and a warning logged."""
        if self.pool6 is None:
            feats["ipv6"], feats["ipv6_reason"] = False, "no network_pool6"
            return
        ok, why = netns.ipv6_forwarding()
        feats["ipv6"], feats["ipv6_reason"] = ok, why
        if not ok:
            log.warning("networked sandboxes without IPv6: %s", why)
            self.pool6 = self.gw6 = self.plumber.gw6 = None
            feats["pool6"] = None

    async def _start_proxy(self, feats: dict[str, object]) -> bool:
        """The SNI/Host proxy on the gateway addresses; False (and ``sni_reason``) when off
        or its ports cannot be bound (names are then reached directly, through NAT)."""
        if not self.s.proxy:
            feats["sni_reason"] = "network_proxy is off"
            return False
        assert self.resolver is not None
        p = proxy.Proxy(self.resolver.listen, self.s.proxy_tls_port, self.s.proxy_http_port,
                        self._client_of, self.resolver.resolve, self._proxy_refused)
        try:
            await p.start()
        except OSError as exc:
            feats["sni_reason"] = (f"proxy on {self.gw4} ports {self.s.proxy_tls_port}, "
                                   f"{self.s.proxy_http_port}: {exc}")
            log.warning("network: %s", feats["sni_reason"])
            return False
        self.proxy = p
        feats["proxy"] = {"tls_port": self.s.proxy_tls_port,
                          "http_port": self.s.proxy_http_port}
        return True

    async def close(self) -> None:
        """Stop the resolver, the proxy and background work and release prepared
        namespaces. With no networked sandbox left, also detach the programs (freeing every
        map) and remove the NAT rules and the cgroup directory; otherwise leave them for the
        next daemon (proxied connections end with this daemon)."""
        for t in (self._filling, self._gc):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._filling = self._gc = None
        if self.proxy is not None:
            await self.proxy.close()
            self.proxy = None
        if self.resolver is not None:
            await self.resolver.close()
            self.resolver = None
        for ns in self._ready:
            ns.close()
            self._used.discard(ns.index)
        self._ready.clear()
        last = not self._sandboxes and not self._live_records()
        for sb in self._sandboxes.values():  # kept: what they learned, for the next daemon
            with contextlib.suppress(OSError):
                self._save(sb)
        await self._close_filter(detach=last)
        if last:
            await asyncio.to_thread(self._nat_teardown)
            if self.s.cgroup_dir is not None:
                with contextlib.suppress(OSError):
                    self.s.cgroup_dir.rmdir()
        self._sandboxes.clear()
        self._by_addr.clear()
        await asyncio.get_running_loop().run_in_executor(None, self.plumber.close)

    async def _close_filter(self, *, detach: bool) -> None:
        if self._events_fd >= 0:
            asyncio.get_running_loop().remove_reader(self._events_fd)
            self._events_fd = -1
        if self.filter is not None:
            await asyncio.to_thread(self.filter.close, detach=detach)
            self.filter = None

    def _live_records(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return [p.stem for p in self.records.glob("*.json")]
        return []

    # -- policies -------------------------------------------------------------------------

    def parse(self, value: object) -> Policy:
        """A request's ``network`` value as a :class:`Policy` (:class:`BadRequest`)."""
        return policy.parse(value, self.profile.services, self.denies)

    def require_enabled(self) -> None:
        if not self.features.get("enabled"):
            raise InvalidState("networked sandboxes are not available on this node: "
                               f"{self.features.get('reason', 'not started')}")

    # -- namespaces ahead of demand -------------------------------------------------------

    def _alloc(self) -> int:
        for i in range(2, self.pool4.num_addresses - 1):
            if i not in self._used:
                self._used.add(i)
                return i
        raise InvalidState(f"network pool {self.pool4} has no free address")

    def _addr6(self, index: int) -> ipaddress.IPv6Address | None:
        return self.pool6[index] if self.pool6 is not None else None

    async def _make(self) -> netns.Netns:
        index = self._alloc()
        try:
            return await self.plumber.run(self.plumber.make, index, self.pool4[index],
                                          self._addr6(index))
        except BaseException:
            self._used.discard(index)
            raise

    def _refill(self) -> None:
        if self._filling is None or self._filling.done():
            self._filling = asyncio.ensure_future(self._fill())

    async def _fill(self) -> None:
        while len(self._ready) < self.s.prepare_ahead and self.filter is not None:
            try:
                self._ready.append(await self._make())
            except (BackendError, InvalidState) as exc:
                log.warning("network: preparing a namespace: %s", exc)
                return

    # -- per sandbox ----------------------------------------------------------------------

    async def attach(self, sid: str, pol: Policy) -> Attachment:
        """A namespace for sandbox ``sid`` with ``pol`` in force from its first process on.
        Raises InvalidState (networking unavailable, pool exhausted), BackendError."""
        self.require_enabled()
        assert self.filter is not None
        if sid in self._sandboxes:
            raise InvalidState(f"sandbox {sid}: already has a network")
        ns = self._ready.pop(0) if self._ready else await self._make()
        self._refill()
        sb = _Sandbox(sid, ns, pol)
        try:
            self._register(sb)
            self._write_policy(sb, pol, cut=False)
            self._save(sb)
        except BaseException:
            self._unregister(sb)
            ns.close()
            self._used.discard(ns.index)
            raise
        assert ns.fd is not None
        return Attachment(ns.fd, str(self.s.cgroup_dir) if self.s.cgroup_dir else None,
                          str(ns.addr4), str(ns.addr6) if ns.addr6 else None)

    def spawned(self, sid: str) -> None:
        """The sandbox's processes hold its namespace now: close the daemon's fd."""
        sb = self._sandboxes.get(sid)
        if sb is not None:
            sb.ns.close()

    async def detach(self, sid: str) -> None:
        """Forget sandbox ``sid``'s network (idempotent): its map entries and record. Its
        namespace goes with its last process (or now, if it never ran)."""
        sb = self._sandboxes.get(sid)
        if sb is None:
            (self.records / f"{sid}.json").unlink(missing_ok=True)
            return
        self._unregister(sb)
        if self.proxy is not None:
            # reset its proxied connections now: the client's FIN may wait behind unsent
            # data in a full window until its namespace is gone, and then nothing would
            # ever end the server's leg
            self.proxy.cut(sid, every=True)
        sb.ns.close()
        await self.plumber.run(self.plumber.delete_link, sb.ns.host_if)
        self._used.discard(sb.ns.index)
        (self.records / f"{sid}.json").unlink(missing_ok=True)

    def has(self, sid: str) -> bool:
        return sid in self._sandboxes

    def info(self, sid: str) -> dict[str, Any]:
        """``GET`` view of a sandbox's network: policy, addresses, resolver, counters."""
        sb = self._sandboxes.get(sid)
        if sb is None:
            return {"policy": "none"}
        return {"policy": sb.policy.request, "address": str(sb.ns.addr4),
                "address6": str(sb.ns.addr6) if sb.ns.addr6 else None,
                "gateway": str(self.gw4), "resolver": f"{self.gw4}:{self.s.dns_port}",
                "generation": sb.gen, "learned": len(sb.learned),
                "denied": self.filter.denied(sb.ns.index) if self.filter else 0,
                "proxied": len(self.proxy.connections(sid)) if self.proxy else 0}

    async def set_policy(self, sid: str, pol: Policy) -> dict[str, Any]:
        """Replace sandbox ``sid``'s policy at once; cut its connections the new one
        forbids. ``"none"`` on a networked sandbox allows nothing (the namespace stays).
        Returns ``{"policy", "generation", "cut"}``. Raises NotFound (no network: a sandbox
        created with ``"none"`` cannot get one later)."""
        sb = self._sandboxes.get(sid)
        if sb is None:
            raise InvalidState(f"sandbox {sid} was created without a network (\"none\"); "
                               f"create it with {{\"allow\": [...]}} to change its policy")
        if not pol.networked:
            pol = Policy(networked=True, rules=(), request="none")
        sb.gen += 1
        self._write_policy(sb, pol, cut=True)
        self._save(sb)
        cut = await self._cut(sb)
        if self.proxy is not None:
            cut += self.proxy.cut(sid)
        return {"policy": pol.request, "generation": sb.gen, "cut": cut}

    async def _cut(self, sb: _Sandbox) -> int:
        pid = self._pid_of(sb)
        if pid is None:
            return 0

        def work() -> int:
            return len(sockdiag.cut(lambda s: self._keeps(sb, s)))

        try:
            return await self.plumber.run(functools.partial(self.plumber.in_netns, pid, work,
                                                            pid=True))
        except (OSError, BackendError) as exc:
            log.warning("sandbox %s: cutting forbidden connections: %s", sb.sid, exc)
            return 0

    def _pid_of(self, sb: _Sandbox) -> int | None:
        if self.pid_of is None:
            return None
        try:
            return self.pid_of(sb.sid)
        except EdgedError:
            return None

    def _keeps(self, sb: _Sandbox, s: sockdiag.Sock) -> bool:
        a = s.dst
        if a.is_loopback or a in (self.gw4, self.gw6):
            return True
        if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
            a = a.ipv4_mapped
        if any(a.version == d.version and a in d for d in self.denies):
            return False
        proto = "tcp" if s.protocol == 6 else "udp"
        for r in sb.policy.cidr_rules():
            if (r.protocol == proto and r.port in (0, s.dport) and r.net is not None
                    and a.version == r.net.version and a in r.net):
                return True
        for name in sb.names.get(a, ()):
            if (s.dport, proto) in sb.policy.name_ports(name) or \
                    (0, proto) in sb.policy.name_ports(name):
                return True
        return False

    # -- maps -----------------------------------------------------------------------------

    def _entry(self, sb: _Sandbox) -> bpf.SandboxEntry:
        on = self.proxy is not None
        return bpf.SandboxEntry(id=sb.ns.index, gen=sb.gen, dns4=self.gw4,
                                dns_port=self.s.dns_port, addr4=sb.ns.addr4,
                                addr6=sb.ns.addr6, dns6=self.gw6 if sb.ns.addr6 else None,
                                proxy_tls=self.s.proxy_tls_port if on else 0,
                                proxy_http=self.s.proxy_http_port if on else 0)

    def _learned_flags(self, port: int) -> int:
        """A learned address's flags: through the proxy for 443/80 (and any-port rules)."""
        return bpf.A_PROXY if self.proxy is not None and port in (0, 443, 80) else 0

    def _register(self, sb: _Sandbox) -> None:
        assert self.filter is not None
        self._sandboxes[sb.sid] = sb
        self._by_addr[sb.ns.addr4] = sb
        if sb.ns.addr6 is not None:
            self._by_addr[sb.ns.addr6] = sb
        self.filter.reset_rate(sb.ns.index)
        self.filter.set_sandbox(sb.ns.cookie, self._entry(sb))

    def _unregister(self, sb: _Sandbox) -> None:
        self._sandboxes.pop(sb.sid, None)
        for a in (sb.ns.addr4, sb.ns.addr6):
            if a is not None and self._by_addr.get(a) is sb:
                self._by_addr.pop(a, None)
        if self.filter is None:
            return
        with contextlib.suppress(BackendError):
            self.filter.remove_sandbox(sb.ns.cookie, sb.ns.addr4, sb.ns.addr6)
            self.filter.delete_keys(list(sb.rule_keys) + list(sb.learned))
            self.filter.delete_keys(self.filter.keys_of(sb.ns.index))

    def _write_policy(self, sb: _Sandbox, pol: Policy, *, cut: bool) -> None:
        """Make the maps say ``pol`` for ``sb``: new keys first, then the old ones removed,
        then the entry (generation) updated."""
        assert self.filter is not None
        f = self.filter
        keys: set[tuple[str, bytes]] = set()
        for r in pol.cidr_rules():
            assert r.net is not None
            keys.add(("cidr4" if r.net.version == 4 else "cidr6",
                      f.put_rule(sb.ns.index, r.net, r.port, bpf.PROTO_NUM[r.protocol])))
        learned: dict[tuple[str, bytes], int] = {}
        names: dict[Address, set[str]] = {}
        for addr, ns in sb.names.items():
            for name in ns:
                if not pol.allows_name(name):
                    continue
                exp = max((e for (m, k), e in sb.learned.items()
                           if k.endswith(addr.packed)), default=0)
                if not exp:
                    continue
                for port, proto in pol.name_ports(name):
                    k = f.put_learned(sb.ns.index, addr, port, bpf.PROTO_NUM[proto], exp,
                                      flags=self._learned_flags(port))
                    learned[("learned4" if addr.version == 4 else "learned6", k)] = exp
                names.setdefault(addr, set()).add(name)
        f.delete_keys((sb.rule_keys - keys) | (set(sb.learned) - set(learned)))
        sb.rule_keys, sb.learned, sb.policy = keys, learned, pol
        if cut:
            sb.names = names
        f.set_sandbox(sb.ns.cookie, self._entry(sb))

    # -- resolver callbacks ---------------------------------------------------------------

    def _client_of(self, addr: Address) -> dns.Client | None:
        return self._by_addr.get(addr)

    def _learn(self, client: dns.Client, name: str, addrs: list[Address], ttl: int) -> None:
        sb = client if isinstance(client, _Sandbox) else self._sandboxes.get(client.sandbox_id)
        if sb is None or self.filter is None:
            return
        exp = bpf.now_ns() + int((ttl + LEARN_GRACE_S) * 1e9)
        for a in addrs:
            for port, proto in sb.policy.name_ports(name):
                k = self.filter.put_learned(sb.ns.index, a, port, bpf.PROTO_NUM[proto], exp,
                                            flags=self._learned_flags(port))
                sb.learned[("learned4" if a.version == 4 else "learned6", k)] = exp
            sb.names.setdefault(a, set()).add(name)

    def _dns_refused(self, client: dns.Client, name: str, qtype: str, why: str) -> None:
        if self.sink is not None:
            self.sink(client.sandbox_id, "dns_denied", path=name or None,
                      detail={"qtype": qtype, "why": why})

    def _proxy_refused(self, client: dns.Client, name: str, port: int, why: str) -> None:
        sb = client if isinstance(client, _Sandbox) else self._sandboxes.get(client.sandbox_id)
        if sb is None or self.sink is None:
            return
        if not sb.events.take():
            sb.dropped += 1
            return
        detail: dict[str, Any] = {"protocol": "tcp", "port": port, "hook": "proxy", "why": why}
        if name:
            detail["names"] = [name]
        if sb.dropped:
            detail["dropped_before"], sb.dropped = sb.dropped, 0
        self.sink(sb.sid, "egress_denied", address=f"{name or '?'}:{port}", detail=detail)

    def _drain_events(self) -> None:
        if self.filter is None:
            return
        try:
            evs = self.filter.drain()
        except BackendError as exc:
            log.warning("egress events: %s", exc)
            return
        by_cookie = {sb.ns.cookie: sb for sb in self._sandboxes.values()}
        for ev in evs:
            sb = by_cookie.get(ev.netns)
            if sb is None or self.sink is None:
                continue
            host = f"[{ev.address}]" if ev.address.version == 6 else str(ev.address)
            detail: dict[str, Any] = {"protocol": ev.protocol, "port": ev.port,
                                      "hook": ev.hook, "why": ev.why}
            names = sorted(sb.names.get(ev.address, ()))
            if names:
                detail["names"] = names
            if ev.dropped:
                detail["dropped_before"] = ev.dropped
            self.sink(sb.sid, "egress_denied", address=f"{host}:{ev.port}", detail=detail)

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(GC_INTERVAL_S)
            self.collect()

    def collect(self) -> int:
        """Remove learned addresses whose TTL (and grace) passed; returns how many."""
        if self.filter is None:
            return 0
        now = bpf.now_ns()
        n = 0
        for sb in self._sandboxes.values():
            old = [k for k, e in sb.learned.items() if e < now]
            self.filter.delete_keys(old)
            for k in old:
                del sb.learned[k]
            n += len(old)
        return n

    # -- persistence and adoption ---------------------------------------------------------

    def _save(self, sb: _Sandbox) -> None:
        self.records.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.records / f".{sb.sid}.tmp"
        tmp.write_text(json.dumps(sb.record()))
        os.replace(tmp, self.records / f"{sb.sid}.json")

    async def _adopt_records(self) -> None:
        """Re-register sandboxes recorded by an earlier daemon (their namespaces are checked
        when the backend adopts them: :meth:`adopt`)."""
        for sid in self._live_records():
            try:
                rec = json.loads((self.records / f"{sid}.json").read_text())
                pol = self.parse(rec["policy"] if rec["policy"] != "none" else {"allow": []})
                ns = netns.Netns(None, int(rec["cookie"]), rec["host_if"], int(rec["index"]),
                                 ipaddress.IPv4Address(rec["addr4"]),
                                 ipaddress.IPv6Address(rec["addr6"]) if rec.get("addr6")
                                 else None)
            except (OSError, ValueError, KeyError, TypeError, BadRequest) as exc:
                log.warning("network record %s unreadable: %s", sid, exc)
                continue
            sb = _Sandbox(sid, ns, pol, gen=int(rec.get("gen", 0)) + 1)
            # what it learned: the addresses are in the maps, the names they were answered
            # for in the record (saved at shutdown; after a crash none: a policy change
            # then drops those addresses, and the sandbox asks the resolver again)
            sb.names = {ipaddress.ip_address(a): set(n)
                        for a, n in (rec.get("names") or {}).items()}
            assert self.filter is not None
            for name, key in self.filter.keys_of(ns.index):
                if name.startswith("cidr"):
                    sb.rule_keys.add((name, key))  # rewritten (or deleted) below
                elif raw := self.filter.maps[name].lookup(key):
                    sb.learned[(name, key)] = bpf.ALLOW.unpack(raw)[0]
            self._used.add(ns.index)
            self._register(sb)
            self._write_policy(sb, pol, cut=False)

    async def adopt(self, sid: str) -> None:
        """Check that adopted sandbox ``sid`` is in the namespace recorded for it. Raises
        NotFound when it has no network record, BackendError when its namespace is another."""
        sb = self._sandboxes.get(sid)
        if sb is None:
            raise NotFound(f"sandbox {sid}: no network record")
        pid = self._pid_of(sb)
        if pid is None:
            raise BackendError(f"sandbox {sid}: no process to find its network namespace by")
        cookie = await self.plumber.run(self.plumber.cookie_of_pid, pid)
        if cookie != sb.ns.cookie:
            raise BackendError(f"sandbox {sid}: its network namespace is not the one recorded")

    async def forget_unadopted(self, keep: set[str]) -> list[str]:
        """Drop the records (and map entries) of sandboxes not in ``keep``."""
        gone = [sid for sid in list(self._sandboxes) if sid not in keep]
        for sid in gone:
            await self.detach(sid)
        return gone

    # -- NAT ------------------------------------------------------------------------------

    def _nat_setup(self) -> bool:
        """Masquerade the pools' traffic leaving for anywhere else (nftables, a table of our
        own). False when disabled or nft is missing."""
        if not self.s.nat or shutil.which("nft") is None:
            return False
        # one rule per line: nft 1.0's one-line form refuses "masquerade; }"
        rules = [f"table ip {self.nat_table} {{\n chain post {{\n"
                 f"  type nat hook postrouting priority srcnat; policy accept;\n"
                 f"  ip saddr {self.pool4} ip daddr != {self.pool4} masquerade\n }}\n}}"]
        if self.pool6 is not None:
            rules.append(f"table ip6 {self.nat_table} {{\n chain post {{\n"
                         f"  type nat hook postrouting priority srcnat; policy accept;\n"
                         f"  ip6 saddr {self.pool6} ip6 daddr != {self.pool6} masquerade\n }}\n}}")
        self._nat_teardown()
        proc = subprocess.run(["nft", "-f", "-"], input="\n".join(rules), text=True,
                              capture_output=True)
        if proc.returncode != 0:
            log.warning("network: NAT rules: %s", proc.stderr.strip())
            return False
        return True

    def _nat_teardown(self) -> None:
        if shutil.which("nft") is None:
            return
        for fam in ("ip", "ip6"):
            subprocess.run(["nft", "delete", "table", fam, self.nat_table],
                           capture_output=True)


def _node_addresses(prefix: str) -> list[Network]:
    """Every address on the host's interfaces but ours (the node itself), as /32 or /128."""
    from pyroute2 import IPRoute

    out: list[Network] = []
    with IPRoute() as ipr:
        names = {ln["index"]: ln.get_attr("IFLA_IFNAME") for ln in ipr.get_links()}
        for a in ipr.get_addr():
            if (names.get(a["index"]) or "").startswith(prefix):
                continue
            addr = a.get_attr("IFA_ADDRESS")
            if addr:
                out.append(ipaddress.ip_network(addr))
    return out


def _uplink_forwarding(uplink: str) -> bool:
    """Whether the host forwards packets arriving on ``uplink`` (replies to NATed traffic):
    the host's setting, which edged does not change."""
    dev = uplink or "all"
    try:
        return Path(f"/proc/sys/net/ipv4/conf/{dev}/forwarding").read_text().strip() == "1"
    except OSError:
        return False
