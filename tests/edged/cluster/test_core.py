"""What the sync and async cluster clients share without I/O (issue 10: each had a copy):
the upload's re-chunking, a relayed create's answer, the plan's reading of an answer, the
lost sandboxes' handles, the handles' node and placer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from edged.client.errors import CapacityExhaustedError, SandboxError
from edged.cluster.client import ClientCore, CreatePlan, OnNode, relay_answer
from edged.cluster.errors import SandboxLostError
from edged.cluster.placement import Constraints, NodeView, Placer
from edged.cluster.transport import UPLOAD_CHUNK, _achunks, _chunks

PIECES = [b"a" * (UPLOAD_CHUNK - 1), b"bc", b"d" * (2 * UPLOAD_CHUNK), b"", b"e"]


def test_chunks_are_full_but_the_last_and_keep_every_byte() -> None:
    whole = b"".join(PIECES)

    async def pieces() -> AsyncIterator[bytes]:
        for p in PIECES:
            yield p

    async def collect() -> list[bytes]:
        return [c async for c in _achunks(pieces())]

    for got in (list(_chunks(PIECES)), asyncio.run(collect()), list(_chunks(whole))):
        assert b"".join(got) == whole
        assert [len(c) for c in got] == [UPLOAD_CHUNK] * 3 + [len(whole) - 3 * UPLOAD_CHUNK]


def test_a_relayed_answer_is_the_sandbox_or_the_nodes_refusal() -> None:
    assert relay_answer(("ok", {"id": "n1.a"})) == ({"id": "n1.a"}, None, None)
    info, e, at = relay_answer(("err", {"status": 503, "code": "capacity_exhausted",
                                        "message": "full", "at": 12.5}))
    assert info is None and isinstance(e, SandboxError) and at == 12.5


def _view(name: str, free: int = 4) -> NodeView:
    return NodeView.from_json({"name": name, "state": "up", "free": free, "backends":
                               ["container"], "labels": {}, "ray_node_id": "r-" + name,
                               "taken_at": 1.0})


def test_the_plan_reads_an_answer_once_for_both_clients() -> None:
    placer = Placer(2)
    placer.update([_view("n1"), _view("n2")])
    plan = CreatePlan(placer, Constraints(None, {}, None), 3, "x", 0.5)
    step = plan.next()
    assert step is not None
    t, _ = step
    full = CapacityExhaustedError("full", status=503)
    assert plan.answered(t, None, full, 1.0) is None  # refused: another node may take it
    step = plan.next()
    assert step is not None
    t2, _ = step
    assert t2.node != t.node
    assert plan.answered(t2, {"id": t2.sandbox_id}, None, None) == {"id": t2.sandbox_id}
    step = plan.next()
    assert step is None
    bad = SandboxError("bad request", status=400)
    plan2 = CreatePlan(placer, Constraints(None, {}, None), 3, "y", 0.5)
    step = plan2.next()
    assert step is not None
    with pytest.raises(SandboxError, match="bad request"):  # not retried on another node
        plan2.answered(step[0], None, bad, None)


def test_lost_handles_carry_the_loss_and_raise_it() -> None:
    lost = {"n2.b": {"node": "n2", "cause": "node died", "since": 3.0, "state": "running",
                     "confirmed": False},
            "n1.a": {"node": "n1", "cause": "left", "since": 2.0, "state": "paused",
                     "confirmed": True}}
    got = list(ClientCore._lost_handles(lost))
    assert [(info["id"], info["state"], node) for info, _, node in got] == [
        ("n1.a", "lost", "n1"), ("n2.b", "lost", "n2")]
    info, err, _ = got[0]
    assert info["lost"] == lost["n1.a"] and info["labels"] == {}
    assert isinstance(err, SandboxLostError) and err.node == "n1" and err.cause == "left"


def test_a_handle_tells_its_placer_it_is_gone_and_says_its_node() -> None:
    released: list[tuple[str, str]] = []

    class P(Placer):
        def released(self, node: str, sandbox_id: str) -> None:
            released.append((node, sandbox_id))

    class H(OnNode):
        id = "n1.a"

    h = H()
    h._on("n1", P(2))
    h._released()
    assert released == [("n1", "n1.a")] and repr(h) == "<H n1.a on n1>"
    h._on("n1", None)
    h._released()  # no placer: nothing to tell
    assert released == [("n1", "n1.a")]
