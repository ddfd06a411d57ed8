"""Egress policy parsing (no root): rules, services, platform denies, the DSec form."""

from __future__ import annotations

import ipaddress

import pytest

from edged.client._common import network_value
from edged.errors import BadRequest
from edged.net import policy, profile


@pytest.fixture(scope="module")
def prof() -> profile.NetworkProfile:
    return profile.load("default")


def parse(p: profile.NetworkProfile, *rules: object) -> policy.Policy:
    return policy.parse({"allow": list(rules)}, p.services, p.deny)


def test_services_domains_cidrs_ports(prof) -> None:
    pol = parse(prof, "pypi", "example.org:8080", "*.pythonhosted.org", "198.51.100.0/24:5432",
                "[2001:db8::1]:443", {"rule": "203.0.113.9:53", "protocol": "udp"})
    assert pol.networked and pol.services == ("pypi",)
    assert pol.name_ports("pypi.org") == [(443, "tcp")]
    assert pol.name_ports("files.pythonhosted.org") == [(443, "tcp"), (0, "tcp")]
    assert pol.name_ports("a.pythonhosted.org") == [(0, "tcp")]
    assert not pol.allows_name("pythonhosted.org")  # a wildcard is not the name itself
    assert not pol.allows_name("evilpythonhosted.org")
    assert pol.name_ports("example.org") == [(8080, "tcp")]
    nets = {(str(r.net), r.port, r.protocol) for r in pol.cidr_rules()}
    assert nets == {("198.51.100.0/24", 5432, "tcp"), ("2001:db8::1/128", 443, "tcp"),
                    ("203.0.113.9/32", 53, "udp")}


@pytest.mark.parametrize("bad", ["10.1.0.0/16", "169.254.169.254", "nosuch", "a..b", "1.2.3",
                                 "x.org:0", "x.org:65536", "[::1", "*.", "*.*.org", "",
                                 {"rule": "x.org", "protocol": "icmp"}, 7, "fd00::/8"])
def test_bad_rules_are_refused(prof, bad) -> None:
    with pytest.raises(BadRequest):
        parse(prof, bad)


def test_none_and_shape(prof) -> None:
    assert policy.parse("none", prof.services, prof.deny) is policy.NONE
    assert parse(prof).networked and parse(prof).rules == ()
    for bad in ({"deny": []}, {"allow": "pypi"}, ["pypi"], 5):
        with pytest.raises(BadRequest):
            policy.parse(bad, prof.services, prof.deny)


def test_platform_denies_cover_metadata_and_private(prof) -> None:
    for a in ("169.254.169.254", "10.1.2.3", "192.168.1.1", "127.0.0.1", "fd00::1"):
        ip = ipaddress.ip_address(a)
        assert any(ip.version == d.version and ip in d for d in prof.deny), a


def test_sdk_dsec_form() -> None:
    assert network_value({"pypi": True, "npm": False}) == {"allow": ["pypi"]}
    assert network_value(["pypi", "x.org:443"]) == {"allow": ["pypi", "x.org:443"]}
    assert network_value("none") == "none"
    assert network_value({"allow": ["pypi"]}) == {"allow": ["pypi"]}
