"""The registry without Ray: reports, sandbox lists by delta, states, lost sandboxes."""

from __future__ import annotations

from typing import Any

from edged.cluster.registry import Registry


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def rep(name: str = "a", agent: str = "g1", seq: int = 1, daemon: str = "up",
        sandboxes: dict[str, Any] | None = None, epoch: str | None = None,
        **kw: Any) -> dict[str, Any]:
    return {"name": name, "agent": agent, "seq": seq, "taken_at": 1000.0 + seq,
            "daemon": daemon, "error": None if daemon == "up" else "connection refused",
            "free": 5, "held": 1, "backends": ["container"], "labels": {}, "ray_node_id": "r",
            "socket": "/s", "epoch": epoch, "sandboxes": sandboxes, **kw}


def full(*sids: str) -> dict[str, Any]:
    return {"full": True, "added": dict.fromkeys(sids, "running"), "removed": []}


def delta(added: tuple[str, ...] = (), removed: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"full": False, "added": dict.fromkeys(added, "running"), "removed": list(removed)}


def joined(r: Registry, *sids: str, name: str = "a") -> str:
    ack = r.report(rep(name))
    assert ack["want_full"]
    r.report(rep(name, seq=2, epoch=ack["epoch"], sandboxes=full(*sids)))
    return str(ack["epoch"])


def test_a_node_is_listed_with_its_report() -> None:
    r = Registry()
    joined(r, "a.1", "a.2")
    (n,) = r.nodes()
    assert (n["name"], n["state"], n["free"], n["held"], n["sandboxes"]) == ("a", "up", 5, 1, 2)
    assert r.locate("a.1") == {"node": "a", "state": "running"} and r.locate("a.9") is None


def test_deltas_apply_only_to_a_known_list() -> None:
    r = Registry()
    ep = joined(r, "a.1")
    assert not r.report(rep(seq=3, epoch=ep, sandboxes=delta(("a.2",), ("a.1",))))["want_full"]
    assert r.locate("a.2") and r.locate("a.1") is None
    # a relay that restarted (a new incarnation) is asked for its whole list
    ack = r.report(rep(agent="g2", seq=1, epoch=ep, sandboxes=delta(("a.3",))))
    assert ack["want_full"] and r.locate("a.3") is None
    # so is every relay after a registry restart (another epoch)
    r2 = Registry()
    assert r2.report(rep(seq=4, epoch=ep, sandboxes=delta(("a.4",))))["want_full"]


def test_daemon_down_loses_sandboxes_and_a_return_finds_them() -> None:
    r = Registry()
    ep = joined(r, "a.1", "a.2")
    r.report(rep(seq=3, epoch=ep, daemon="down"))
    assert r.nodes()[0]["state"] == "down"
    lost = r.lost()
    assert set(lost) == {"a.1", "a.2"}
    assert "does not answer: connection refused" in lost["a.1"]["cause"]
    assert r.locate("a.1")["state"] == "lost"
    # back up: its whole list is asked for; a.1 is there again, a.2 is not
    assert r.report(rep(seq=4, epoch=ep))["want_full"]
    r.report(rep(seq=5, epoch=ep, sandboxes=full("a.1")))
    assert set(r.lost()) == {"a.2"} and r.lost()["a.2"]["confirmed"]
    assert "came back without it" in r.lost()["a.2"]["cause"]
    assert r.locate("a.1") == {"node": "a", "state": "running"}


def test_no_reports_make_a_node_dead() -> None:
    clock = Clock()
    r = Registry(dead_after_s=5.0, clock=clock)
    joined(r, "a.1")
    joined(r, "b.1", name="b")
    clock.t = 4.0
    r.report(rep("b", seq=3, epoch=r.epoch))
    clock.t = 6.0
    states = {n["name"]: n["state"] for n in r.nodes()}
    assert states == {"a": "dead", "b": "up"}
    assert set(r.lost()) == {"a.1"} and "no report for 6.0 s" in r.lost()["a.1"]["cause"]
    # a dead node is not lost twice (the cause stays the first one)
    clock.t = 60.0
    r.sweep()
    assert "no report for 6.0 s" in r.lost()["a.1"]["cause"]


def test_leave_and_a_later_join() -> None:
    r = Registry()
    ep = joined(r, "a.1")
    assert r.leave("a") and not r.leave("zz")
    assert r.nodes()[0]["state"] == "left"
    assert "left the cluster" in r.lost()["a.1"]["cause"]
    # a late report of the relay that left changes nothing
    assert r.report(rep(seq=9, epoch=ep))["left"]
    assert r.nodes()[0]["state"] == "left"
    # a new join (another incarnation) is heard
    ack = r.report(rep(agent="g2", seq=1, epoch=ep))
    assert ack["want_full"] and r.nodes()[0]["state"] == "up"
    r.report(rep(agent="g2", seq=2, epoch=ep, sandboxes=full("a.1")))
    assert r.lost() == {}


def test_deleted_while_up_is_not_lost() -> None:
    r = Registry()
    ep = joined(r, "a.1", "a.2")
    r.report(rep(seq=3, epoch=ep, sandboxes=delta(removed=("a.2",))))
    r.report(rep(seq=4, epoch=ep, daemon="down"))
    assert set(r.lost()) == {"a.1"}
