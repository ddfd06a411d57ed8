"""The node's network profile (``profiles/network/<name>.toml``): the services policies may
name, the platform denies, and the resolver's settings (TTL clamps, static answers). Loaded
once at start-up; a bad profile is a start-up error naming the key."""

from __future__ import annotations

import ipaddress
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from edged.errors import BadRequest
from edged.net.policy import PROTOCOLS, Network, Service, _domain
from edged.security.profile import PROFILES_DIR

NETWORK_DIR = PROFILES_DIR / "network"
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class NetworkProfile:
    """``services``: name -> :class:`Service`. ``deny``: platform denies (the node's own
    addresses are added by the daemon when ``deny_node_addresses``). ``ttl_min``/``ttl_max``:
    seconds. ``static``: DNS name -> addresses answered without asking upstream."""

    services: dict[str, Service] = field(default_factory=dict)
    deny: tuple[Network, ...] = ()
    deny_node_addresses: bool = True
    ttl_min: int = 5
    ttl_max: int = 3600
    static: dict[str, tuple[Address, ...]] = field(default_factory=dict)
    path: str = ""


def _list(v: object, where: str) -> list[object]:
    if not isinstance(v, list):
        raise BadRequest(f"{where}: must be a list")
    return v


def load(name: str) -> NetworkProfile:
    """Load profile ``name`` (a bare name in ``profiles/network``, or a path to a TOML file).
    Raises :class:`BadRequest` naming the bad key."""
    path = Path(name) if "/" in name else NETWORK_DIR / f"{name}.toml"
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BadRequest(f"network profile {path}: {exc}") from exc
    where = f"network profile {path}"
    unknown = set(doc) - {"services", "platform", "dns"}
    if unknown:
        raise BadRequest(f"{where}: unknown table {sorted(unknown)[0]!r}")
    services: dict[str, Service] = {}
    for sname, sv in (doc.get("services") or {}).items():
        w = f"{where}: services.{sname}"
        if not isinstance(sv, dict) or set(sv) - {"description", "domains", "cidrs", "ports",
                                                   "protocol"}:
            raise BadRequest(f"{w}: keys are description, domains, cidrs, ports, protocol")
        try:
            ports = tuple(int(p) for p in _list(sv.get("ports", []), w + ".ports"))  # type: ignore[call-overload]
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"{w}.ports: integers 1..65535") from exc
        if not all(1 <= p <= 65535 for p in ports):
            raise BadRequest(f"{w}.ports: integers 1..65535")
        proto = sv.get("protocol", "tcp")
        if proto not in PROTOCOLS:
            raise BadRequest(f"{w}.protocol: 'tcp' or 'udp'")
        try:
            cidrs = tuple(ipaddress.ip_network(str(c)) for c in _list(sv.get("cidrs", []), w))
        except ValueError as exc:
            raise BadRequest(f"{w}.cidrs: {exc}") from exc
        domains = tuple(_domain(str(d), w + ".domains")
                        for d in _list(sv.get("domains", []), w))
        services[sname] = Service(sname, domains, cidrs, ports, proto,
                                  str(sv.get("description", "")))
    plat = doc.get("platform") or {}
    try:
        deny = tuple(ipaddress.ip_network(str(c)) for c in _list(plat.get("deny", []),
                                                                 where + ": platform.deny"))
    except ValueError as exc:
        raise BadRequest(f"{where}: platform.deny: {exc}") from exc
    dns = doc.get("dns") or {}
    static: dict[str, tuple[Address, ...]] = {}
    for host, addrs in (dns.get("static") or {}).items():
        try:
            static[_domain(host, where + ": dns.static")] = tuple(
                ipaddress.ip_address(str(a)) for a in _list(addrs, where + ": dns.static"))
        except ValueError as exc:
            raise BadRequest(f"{where}: dns.static.{host}: {exc}") from exc
    ttl_min, ttl_max = int(dns.get("ttl_min", 5)), int(dns.get("ttl_max", 3600))
    if not 1 <= ttl_min <= ttl_max:
        raise BadRequest(f"{where}: dns: 1 <= ttl_min <= ttl_max")
    return NetworkProfile(services, deny, bool(plat.get("deny_node_addresses", True)),
                          ttl_min, ttl_max, static, str(path))
