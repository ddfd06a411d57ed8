"""The sandbox state machine and its expiry rules."""

from __future__ import annotations

import pytest

from edged.backends.base import Resources
from edged.errors import BadRequest, InvalidState
from edged.node.sandbox import TRANSITIONS, SandboxRecord, State, check_id


def rec(**kw) -> SandboxRecord:
    return SandboxRecord(id="a", backend="container", layers=["sha256:" + "0" * 64],
                         resources=Resources(), **kw)


def test_transitions_follow_the_design() -> None:
    r = rec()
    for s in (State.RUNNING, State.PAUSED, State.RUNNING, State.STOPPING, State.STOPPED):
        r.transition(s)
    with pytest.raises(InvalidState, match="cannot go from stopped to running"):
        r.transition(State.RUNNING)
    assert TRANSITIONS[State.STOPPED] == frozenset()
    r = rec()
    with pytest.raises(InvalidState):
        r.transition(State.PAUSED)  # creating → paused skips running


def test_require_names_the_operation() -> None:
    r = rec(state=State.PAUSED)
    with pytest.raises(InvalidState, match="cannot exec while paused"):
        r.require(State.RUNNING, op="exec")
    r.require(State.PAUSED, State.RUNNING, op="x")


@pytest.mark.parametrize("bad", ["", "A", "-x", "a" * 64, "a/b", "a b", "ä"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(BadRequest):
        check_id(bad)


def test_good_ids() -> None:
    for good in ("a", "0", "a.b-c_d", "a" * 63):
        assert check_id(good) == good


def test_expiry() -> None:
    r = rec(state=State.RUNNING, idle_timeout_s=10)
    r.set_ttl(100, now=1000)
    r.touch(1000)
    assert r.expired(1005) is None
    assert r.expired(1010) == "idle"
    r.active_execs = 1
    assert r.expired(1050) is None  # an exec running is activity
    assert r.expired(1100) == "ttl"
    r.active_execs = 0
    r.state = State.PAUSED
    assert r.expired(1050) is None  # paused: parked, not idle
    r.set_ttl(0)
    assert r.expires_at is None


def test_json_roundtrip() -> None:
    r = rec(labels={"k": "v"}, env={"A": "B"}, state=State.PAUSED, lowers=["/x"])
    r.set_ttl(5)
    back = SandboxRecord.from_json(r.persisted())
    assert back.persisted() == r.persisted()
