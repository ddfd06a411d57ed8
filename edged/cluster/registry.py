"""The cluster's view of its nodes, rebuilt from their reports: which nodes there are, how
much each can still take, which sandboxes each holds, and which sandboxes were lost.

Every node's relay (:mod:`edged.cluster.node`) reports every ``report_interval_s``: the
capacity part of its daemon's ``GET /v1/node``, whether the daemon answered, and the changes
to its sandboxes since the last report (the whole list after a change of registry, of relay
or of the daemon's state). Nothing here is durable: a registry that restarts (a new
``epoch``) asks every node for its whole list and has the same view one report later (DSec
§3.2's Watcher rebuilds its view from probes the same way).

A node is ``up`` while reports arrive and its daemon answers, ``down`` while reports arrive
and its daemon does not (killed, restarting), ``dead`` once no report came for
``dead_after_s`` (its relay, its Ray node or its host is gone), ``left`` after it left. When a
node stops being ``up``, each of its sandboxes is **lost**: kept in :meth:`Registry.lost`
with the node, the cause and the time, never silently dropped. A lost sandbox its node lists
again (a daemon restarted with ``on_start = "adopt"`` took it back) is found again; one it
no longer lists after its return stays lost, with that said.

Times: the registry's own monotonic clock for liveness (no clocks of other hosts compared);
``since`` fields are its wall clock, for people.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: how long a lost sandbox is remembered (s)
LOST_RETENTION_S = 3600.0


@dataclass
class _Node:
    name: str
    report: dict[str, Any]
    agent: str  # the relay incarnation that sent it
    received: float  # registry monotonic time
    state: str = "up"
    cause: str = ""
    sandboxes: dict[str, str] = field(default_factory=dict)  # id -> state


@dataclass
class Lost:
    """A sandbox whose node stopped answering: ``node``, ``cause``, ``since`` (wall clock),
    ``state`` (its last known state), ``confirmed`` (its node came back without it)."""

    node: str
    cause: str
    since: float
    state: str
    confirmed: bool = False
    at: float = 0.0  # registry monotonic time, for retention

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "cause": self.cause, "since": self.since,
                "state": self.state, "confirmed": self.confirmed}


class Registry:
    """State of the cluster's directory (see the module docstring). ``dead_after_s``: a node
    with no report this long is dead. ``clock``/``wall``: monotonic and wall clocks
    (injectable for tests)."""

    def __init__(self, dead_after_s: float = 5.0, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.dead_after_s = dead_after_s
        self.clock = clock
        self.wall = wall
        self.epoch = uuid.uuid4().hex
        self._nodes: dict[str, _Node] = {}
        self._left: dict[str, str] = {}  # node name -> the relay incarnation that left
        self._lost: dict[str, Lost] = {}

    # -- what nodes say ---------------------------------------------------------------------

    def report(self, r: Mapping[str, Any]) -> dict[str, Any]:
        """Take one report; returns ``{"epoch", "want_full"}`` (``want_full``: send the whole
        sandbox list next time, this registry does not know it).

        ``r``: ``name``, ``agent`` (the relay's incarnation id), ``seq``, ``taken_at``,
        ``daemon`` (``up``/``down``), ``error``, ``free``, ``held``, ``backends``, ``labels``,
        ``ray_node_id``, ``socket``, ``epoch`` (the registry it last heard from) and
        ``sandboxes``: ``{"full": bool, "added": {id: state}, "removed": [id]}`` or None."""
        name, agent = str(r["name"]), str(r["agent"])
        if self._left.get(name) == agent:
            return {"epoch": self.epoch, "want_full": False, "left": True}
        self._left.pop(name, None)
        now = self.clock()
        node = self._nodes.get(name)
        known = node is not None and node.agent == agent and r.get("epoch") == self.epoch
        was_up = node is not None and node.state == "up"
        if node is None:
            node = self._nodes[name] = _Node(name, dict(r), agent, now)
        node.report, node.agent, node.received = dict(r), agent, now
        changes = r.get("sandboxes")
        full = isinstance(changes, Mapping) and bool(changes.get("full"))
        if isinstance(changes, Mapping) and (full or known):
            self._apply(node, changes)
        if r.get("daemon") == "up":
            if node.state != "up":
                node.state, node.cause = "up", ""
        else:
            self._not_up(node, "down", f"its daemon does not answer: {r.get('error') or '?'}")
        # the whole list is wanted from a node this registry has no list of, or one coming
        # back (its lost sandboxes are found again, or not, by that list)
        want = not full and (not known or not was_up) and node.state == "up"
        return {"epoch": self.epoch, "want_full": want}

    def _apply(self, node: _Node, changes: Mapping[str, Any]) -> None:
        added = {str(k): str(v) for k, v in dict(changes.get("added") or {}).items()}
        if changes.get("full"):
            node.sandboxes = dict(added)
            # lost ones its node lists again are found; those it does not are gone for good
            for sid, lost in list(self._lost.items()):
                if lost.node != node.name:
                    continue
                if sid in added:
                    del self._lost[sid]
                elif not lost.confirmed:
                    lost.confirmed = True
                    lost.cause += "; its node came back without it"
        else:
            node.sandboxes.update(added)
            for sid in added:
                self._lost.pop(sid, None)
        for sid in changes.get("removed") or ():
            node.sandboxes.pop(str(sid), None)

    def leave(self, name: str, agent: str | None = None) -> bool:
        """Node ``name`` leaves (its sandboxes lost: nothing will reach them through the
        cluster). ``agent``: the relay incarnation leaving (later reports from it are
        ignored; a new join is heard). False if the node is unknown."""
        node = self._nodes.get(name)
        if node is None:
            return False
        self._left[name] = agent or node.agent
        self._not_up(node, "left", "its node left the cluster")
        return True

    def _not_up(self, node: _Node, state: str, cause: str) -> None:
        if node.state == state:
            return
        was_up = node.state == "up"
        node.state, node.cause = state, cause
        if not was_up:
            return
        since, now = self.wall(), self.clock()
        for sid, st in node.sandboxes.items():
            self._lost[sid] = Lost(node.name, f"node {node.name}: {cause}", since, st, at=now)

    def sweep(self) -> None:
        """Mark nodes whose last report is older than ``dead_after_s`` dead, and forget lost
        sandboxes older than :data:`LOST_RETENTION_S`."""
        now = self.clock()
        for node in self._nodes.values():
            if node.state not in ("dead", "left") and now - node.received > self.dead_after_s:
                self._not_up(node, "dead", f"no report for {now - node.received:.1f} s")
        for sid in [s for s, lost in self._lost.items() if now - lost.at > LOST_RETENTION_S]:
            del self._lost[sid]

    # -- what clients read ------------------------------------------------------------------

    def nodes(self) -> list[dict[str, Any]]:
        """Every node known: ``name``, ``state``, ``cause``, ``free``, ``held``, ``backends``,
        ``labels``, ``taken_at``, ``seq``, ``ray_node_id``, ``socket``, ``http`` (the node's
        HTTP relay: ``url`` and ``token``, or None), ``sandboxes`` (count known), ``lost``
        (count), ``age_s`` (since its last report)."""
        self.sweep()
        now = self.clock()
        lost: dict[str, int] = {}
        for x in self._lost.values():
            lost[x.node] = lost.get(x.node, 0) + 1
        out = []
        for n in self._nodes.values():
            r = n.report
            out.append({
                "name": n.name, "state": n.state, "cause": n.cause,
                "free": int(r.get("free", 0)), "held": int(r.get("held", 0)),
                "backends": list(r.get("backends", [])), "labels": dict(r.get("labels", {})),
                "taken_at": float(r.get("taken_at", 0.0)), "seq": int(r.get("seq", 0)),
                "ray_node_id": str(r.get("ray_node_id", "")), "socket": str(r.get("socket", "")),
                "http": dict(r["http"]) if isinstance(r.get("http"), Mapping) else None,
                "sandboxes": len(n.sandboxes), "lost": lost.get(n.name, 0),
                "age_s": round(now - n.received, 3),
            })
        return sorted(out, key=lambda d: d["name"])

    def node(self, name: str) -> dict[str, Any] | None:
        """The node object of :meth:`nodes` for ``name``, or None."""
        return next((n for n in self.nodes() if n["name"] == name), None)

    def lost(self, node: str | None = None) -> dict[str, dict[str, Any]]:
        """Lost sandboxes (of ``node``, or all): id → :class:`Lost` as JSON."""
        self.sweep()
        return {sid: x.to_json() for sid, x in self._lost.items()
                if node is None or x.node == node}

    def locate(self, sandbox_id: str) -> dict[str, Any] | None:
        """Where ``sandbox_id`` is: ``{"node", "state"}`` or ``{"node", "lost": {...}}``, or
        None if no node listed it."""
        self.sweep()
        if sandbox_id in self._lost:
            x = self._lost[sandbox_id]
            return {"node": x.node, "state": "lost", "lost": x.to_json()}
        for n in self._nodes.values():
            if sandbox_id in n.sandboxes:
                return {"node": n.name, "state": n.sandboxes[sandbox_id]}
        return None
