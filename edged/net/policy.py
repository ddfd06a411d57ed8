"""Egress policies: what a networked sandbox may reach, parsed from a request and checked
against the node's network profile.

A request's ``network`` is ``"none"`` (no network at all: an empty namespace with a loopback)
or ``{"allow": [RULE, ...]}``. A RULE is a string:

- a **service** defined by the node's network profile (``profiles/network/<name>.toml``,
  :mod:`edged.net.profile`): ``"pypi"``, ``"npm"``, ``"debian"``, ``"github"``,
  ``"huggingface"``; each expands to its domains, CIDRs and ports;
- a **domain**, optionally with a port: ``"pypi.org"``, ``"pypi.org:443"``, or a wildcard
  for every name beneath one: ``"*.pythonhosted.org"`` (not the name itself); names are
  ASCII (IDNs as their ``xn--`` form), case-insensitive;
- an **address or CIDR**, optionally with a port: ``"203.0.113.7"``, ``"198.51.100.0/24:8080"``,
  ``"2001:db8::/32"``, ``"[2001:db8::1]:443"`` (IPv6 with a port in brackets);

or an object ``{"rule": STRING, "protocol": "tcp" | "udp"}`` for UDP. A string rule allows TCP
(UDP egress is the classic tunnel, so it is asked for by name). A rule without a port allows
every port. Domains are allowed through the node's resolver only: a name resolves (and its
addresses become reachable, for the TTL of the answer) when some rule allows it.

The node's platform denies (metadata addresses, private ranges, the node's own addresses)
always win: no rule opens them, and a rule that lies wholly inside one is refused (400), so a
caller is never told a policy was accepted that cannot work. The DSec form
``{"pypi": True, "npm": False}`` is accepted by the SDK, which sends the services set to true.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edged.errors import BadRequest

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_RULES = 256
MAX_EXPANDED = 4096  # rules after service expansion
PROTOCOLS = ("tcp", "udp")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")
_SERVICE = re.compile(r"[a-z][a-z0-9_-]{0,62}\Z")


@dataclass(frozen=True)
class Rule:
    """One allow rule after service expansion. Exactly one of ``domain`` (lower-case, no
    trailing dot; ``*.`` prefix for a wildcard) and ``net`` is set. ``port``: 0 for every
    port. ``origin``: the request rule (or service) it came from, for messages."""

    protocol: str
    port: int
    domain: str | None = None
    net: Network | None = None
    origin: str = ""

    def matches(self, name: str) -> bool:
        """Whether the domain rule allows DNS name ``name`` (normalised, see
        :func:`normalise_name`)."""
        if self.domain is None:
            return False
        if self.domain.startswith("*."):
            return name.endswith(self.domain[1:]) and len(name) > len(self.domain) - 1
        return name == self.domain


@dataclass(frozen=True)
class Policy:
    """A sandbox's egress policy. ``networked``: False for ``"none"`` (no namespace plumbing
    at all). ``rules``: the expanded allow rules. ``request``: the policy as the client gave
    it (normalised), what ``GET`` shows and what a restarted daemon re-parses."""

    networked: bool
    rules: tuple[Rule, ...] = ()
    request: Any = "none"
    services: tuple[str, ...] = field(default=())

    def name_ports(self, name: str) -> list[tuple[int, str]]:
        """``(port, protocol)`` pairs the domain rules give DNS name ``name`` (port 0: every
        port); empty when no rule allows the name."""
        out: list[tuple[int, str]] = []
        for r in self.rules:
            if r.matches(name) and (r.port, r.protocol) not in out:
                out.append((r.port, r.protocol))
        return out

    def allows_name(self, name: str) -> bool:
        return any(r.matches(name) for r in self.rules)

    def cidr_rules(self) -> list[Rule]:
        return [r for r in self.rules if r.net is not None]

    def domains(self) -> list[str]:
        return sorted({r.domain for r in self.rules if r.domain is not None})


NONE = Policy(networked=False)


def normalise_name(name: str) -> str:
    """A DNS name in the form rules are matched on: lower case, no trailing dot."""
    return name.rstrip(".").lower()


def _domain(text: str, what: str) -> str:
    d = normalise_name(text)
    wild = d.startswith("*.")
    body = d[2:] if wild else d
    labels = body.split(".")
    if len(d) > 253 or len(labels) < 2 or not all(_LABEL.match(x) for x in labels):
        raise BadRequest(f"{what}: {text!r} is not a domain name (ASCII labels of letters, "
                         f"digits and '-', at least two; a wildcard only as a leading '*.')")
    if labels[-1].isdigit():
        raise BadRequest(f"{what}: {text!r} looks like an address, not a domain")
    return d


def _port_of(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise BadRequest(f"{what}: port {text!r} must be 1..65535")
    return int(text)


def parse_target(text: str, what: str) -> tuple[str | None, Network | None, int]:
    """``(domain, network, port)`` of a domain or address rule string (port 0: any).
    Raises :class:`BadRequest`."""
    s = text.strip()
    if not s or len(s) > 300:
        raise BadRequest(f"{what}: empty or longer than 300 characters")
    port = 0
    if s.startswith("["):  # [v6] or [v6/len] with an optional :port
        end = s.find("]")
        if end < 0:
            raise BadRequest(f"{what}: {text!r}: unclosed '['")
        rest = s[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise BadRequest(f"{what}: {text!r}: expected ':PORT' after ']'")
            port = _port_of(rest[1:], what)
        s = s[1:end]
        return None, _net(s, text, what), port
    if s.count(":") == 1:  # host:port or v4/len:port
        s, p = s.split(":")
        port = _port_of(p, what)
    try:
        return None, _net(s, text, what), port
    except BadRequest:
        if ":" in s or re.fullmatch(r"[0-9./]+", s):
            raise
    return _domain(s, what), None, port


def _net(s: str, text: str, what: str) -> Network:
    try:
        return ipaddress.ip_network(s, strict=True)
    except ValueError as exc:
        raise BadRequest(f"{what}: {text!r} is not an address or CIDR ({exc})") from exc


@dataclass(frozen=True)
class Service:
    """A named service of the network profile: domains, CIDRs and ports (empty: every port)
    for ``protocol``."""

    name: str
    domains: tuple[str, ...] = ()
    cidrs: tuple[Network, ...] = ()
    ports: tuple[int, ...] = ()
    protocol: str = "tcp"
    description: str = ""

    def rules(self) -> list[Rule]:
        ports = self.ports or (0,)
        out = [Rule(self.protocol, p, domain=d, origin=self.name)
               for d in self.domains for p in ports]
        out += [Rule(self.protocol, p, net=n, origin=self.name) for n in self.cidrs for p in ports]
        return out


def parse(value: object, services: Mapping[str, Service], denies: Iterable[Network] = (),
          *, what: str = "network") -> Policy:
    """Parse a request's ``network`` value. Raises :class:`BadRequest` naming the bad part:
    an unknown service or field, a malformed domain, address or port, too many rules, or a
    CIDR rule that lies wholly inside a platform deny."""
    if value is None or value == "none":
        return NONE
    if not isinstance(value, dict):
        raise BadRequest(f'{what}: must be "none" or {{"allow": [RULE, ...]}}')
    unknown = set(value) - {"allow"}
    if unknown:
        raise BadRequest(f"{what}: unknown field {sorted(unknown)[0]!r} (only 'allow')")
    allow = value.get("allow", [])
    if not isinstance(allow, list):
        raise BadRequest(f"{what}.allow: must be a list of rules")
    if len(allow) > MAX_RULES:
        raise BadRequest(f"{what}.allow: more than {MAX_RULES} rules")
    deny = list(denies)
    rules: list[Rule] = []
    used: list[str] = []
    request: list[Any] = []
    for i, item in enumerate(allow):
        w = f"{what}.allow[{i}]"
        proto = "tcp"
        if isinstance(item, dict):
            extra = set(item) - {"rule", "protocol"}
            if extra or not isinstance(item.get("rule"), str):
                raise BadRequest(f'{w}: an object rule is {{"rule": STRING, "protocol": '
                                 f'"tcp"|"udp"}}')
            proto = item.get("protocol", "tcp")
            if proto not in PROTOCOLS:
                raise BadRequest(f"{w}.protocol: must be 'tcp' or 'udp'")
            text = item["rule"]
            request.append({"rule": text, "protocol": proto})
        elif isinstance(item, str):
            text = item
            request.append(item)
        else:
            raise BadRequest(f"{w}: must be a string or {{\"rule\", \"protocol\"}}")
        if _SERVICE.match(text) and "." not in text:
            svc = services.get(text)
            if svc is None:
                raise BadRequest(f"{w}: unknown service {text!r} (this node has: "
                                 f"{', '.join(sorted(services)) or 'none'})")
            if proto != "tcp" and isinstance(item, dict):
                raise BadRequest(f"{w}: a service names its own protocol")
            rules += svc.rules()
            used.append(text)
            continue
        domain, net, port = parse_target(text, w)
        if net is not None:
            for d in deny:
                if d.version == net.version and net.subnet_of(d):  # type: ignore[arg-type]
                    raise BadRequest(f"{w}: {text!r} lies inside the platform deny {d}; "
                                     f"platform denies always win")
        rules.append(Rule(proto, port, domain=domain, net=net, origin=text))
    if len(rules) > MAX_EXPANDED:
        raise BadRequest(f"{what}.allow: more than {MAX_EXPANDED} rules after expansion")
    return Policy(networked=True, rules=tuple(dict.fromkeys(rules)),
                  request={"allow": request}, services=tuple(used))


def from_dsec(value: Mapping[str, object]) -> dict[str, list[str]]:
    """The DSec form ``{"pypi": True, "npm": False}`` as a request: ``{"allow": [services
    set to true]}``. Raises :class:`BadRequest` for a value that is not a bool."""
    for k, v in value.items():
        if not isinstance(v, bool):
            raise BadRequest(f"network[{k!r}]: must be true or false")
    return {"allow": [k for k, v in value.items() if v]}
