"""edged's resolver by itself (no root): queries in wire format from a fake sandbox, a fake
upstream on the loopback. What is refused never reaches the upstream."""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass, field

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from edged.net import policy, profile
from edged.net.dns import Resolver
from tests.edged.net.servers import FakeUpstream

SANDBOX = ipaddress.ip_address("10.213.0.2")


@dataclass
class Client:
    policy: policy.Policy
    sandbox_id: str = "s1"
    budget: int = 1000

    def allow_query(self) -> bool:
        self.budget -= 1
        return self.budget >= 0


@dataclass
class Seen:
    learned: list[tuple[str, list[str], int]] = field(default_factory=list)
    refused: list[tuple[str, str, str]] = field(default_factory=list)


def resolver(client: Client, up: FakeUpstream, seen: Seen, **kw: object) -> Resolver:
    prof = profile.load("default")
    return Resolver([ipaddress.ip_address("10.213.0.1")], 53, [f"127.0.0.1:{up.port}"],
                    lambda a: client if a == SANDBOX else None,
                    lambda c, n, a, t: seen.learned.append((n, [str(x) for x in a], t)),
                    lambda c, n, q, w: seen.refused.append((n, q, w)),
                    denies=prof.deny, **kw)  # type: ignore[arg-type]


def ask(r: Resolver, name: str, qtype: str = "A") -> dns.message.Message:
    q = dns.message.make_query(name, qtype)
    q.use_edns(0, payload=4096)
    out = asyncio.run(r.handle(q.to_wire(), SANDBOX))
    assert out is not None
    return dns.message.from_wire(out)


@pytest.fixture
def up():
    u = FakeUpstream({"pypi.org": (["203.0.113.80", "10.0.0.7"], 99999),
                      "short.pypi.org": (["203.0.113.81"], 0),
                      "files.pythonhosted.org": (["203.0.113.82", "2001:db8::82"], 60)})
    yield u
    u.close()


def allow(*rules: str) -> Client:
    return Client(policy.parse({"allow": list(rules)}, profile.load("default").services))


def test_allowed_names_are_asked_and_learned(up) -> None:
    seen = Seen()
    r = resolver(allow("pypi", "*.pypi.org"), up, seen, ttl_min=5, ttl_max=3600)
    m = ask(r, "PyPI.org.")
    assert m.rcode() == dns.rcode.NOERROR and m.flags & dns.flags.RA
    (rrset,) = m.answer
    # the private address an answer carried is dropped (no DNS rebinding); TTL clamped
    assert [rd.address for rd in rrset] == ["203.0.113.80"] and rrset.ttl == 3600
    assert seen.learned == [("pypi.org", ["203.0.113.80"], 3600)]
    assert ask(r, "short.pypi.org").answer[0].ttl == 5  # TTL 0 raised to ttl_min
    m = ask(r, "files.pythonhosted.org", "AAAA")
    assert [rd.address for rd in m.answer[0]] == ["2001:db8::82"]
    assert up.queries == [("pypi.org", "A"), ("short.pypi.org", "A"),
                          ("files.pythonhosted.org", "AAAA")]
    ask(r, "pypi.org")  # cached: not asked again
    assert len(up.queries) == 3


def test_refused_names_and_types_never_go_upstream(up) -> None:
    seen = Seen()
    r = resolver(allow("pypi"), up, seen)
    long = ".".join(["a" * 63] * 3) + ".exfil.example"
    for name in (long, "pypi.org.evil.example", "evilpypi.org", "x.pypi.org"):
        assert ask(r, name).rcode() == dns.rcode.NXDOMAIN, name
    for qtype in ("TXT", "MX", "ANY", "HTTPS"):
        m = ask(r, "pypi.org", qtype)
        assert m.rcode() == dns.rcode.NOERROR and not m.answer, qtype  # NODATA
    assert up.queries == []
    assert [x[0] for x in seen.refused] == [long, "pypi.org.evil.example", "evilpypi.org",
                                            "x.pypi.org"]


def test_malformed_strangers_and_floods(up) -> None:
    seen = Seen()
    c = allow("pypi")
    r = resolver(c, up, seen)
    assert asyncio.run(r.handle(b"\x12\x34" + bytes(10), ipaddress.ip_address("10.9.9.9"))) \
        is None  # not a sandbox's address: dropped
    bad = asyncio.run(r.handle(b"\x12\x34\x01\x00" + b"\xff" * 9, SANDBOX))
    assert bad is not None and dns.message.from_wire(bad, ignore_trailing=True).rcode() == \
        dns.rcode.FORMERR
    c.budget = 1
    assert ask(r, "pypi.org").rcode() == dns.rcode.NOERROR
    assert ask(r, "pypi.org").rcode() == dns.rcode.REFUSED  # over its rate
    assert ("", "", "rate") in seen.refused
