"""Where a new sandbox goes: power of k choices over the nodes' last reports, with this
client's own in-flight placements laid over them; the node's admission has the last word.

DSec §3.2 and §7: the placement layer filters the nodes that can take a sandbox (healthy,
the backend and labels asked for), samples k of them at random and takes the least loaded;
it lays the placements it made since the last report over that report (otherwise every
create until the next report would see the same "least loaded" node: a herd); and a node
that refuses (its own admission, on measured use, is the authority) sends the create
elsewhere. Sampling k rather than taking the global minimum keeps many independent clients,
each with a slightly stale view, from all picking the same node.

Load is the fraction of a node's capacity in use: ``(held + in flight) / (held + free)``, with
``free`` the sandboxes it can still admit (``GET /v1/node``'s ``free``, the density work's
sandbox-sized units) and ``held`` the ones it holds. Equal load everywhere means placements
in proportion to free capacity, whatever the nodes' sizes.

Times that decide whether a report reflects a placement are the *node's* clock: a create's
``created_at`` (the daemon's record) and a refusal's time (stamped by the node's relay, or
the client's own clock when it reached a daemon on its own host) against the report's
``taken_at`` (stamped by the node's relay just before it asks the daemon). A report taken
after a create was admitted counts it (the daemon admits and records a create in one step,
with no wait in between), so the overlay entry goes. Entries also expire after
``overlay_ttl_s`` of the client's time, so a lost report never pins one for good.

Other clients' arrivals (``estimate``): a client sees only its own placements, so with many
independent clients every node's report looks emptier than the node is by the time it is
read, most of all for a node that reported just before a rush (all clients prefer it: a
herd). Each node's net arrival rate is taken from its last two reports (``held`` growth per
second of its own clock), and a node's load counts the larger of this client's in-flight
placements there and that rate times the report's age (``age_s`` from the registry, plus
the time since this client read it): a node filling fast looks as full as it will be.

Thread-safe: one lock around the views and the overlay (the sync client is used from many
threads at once).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NodeView:
    """One node as the registry last heard of it.

    ``state``: ``up`` (reports arrive, its daemon answers), ``down`` (reports arrive, its
    daemon does not), ``dead`` (no report for the registry's ``dead_after_s``), ``left``.
    ``free``: sandboxes it can still admit (see :func:`free_slots`); ``held``: sandboxes it
    holds; ``taken_at``: the node's wall-clock time (s) when the report was taken; ``seq``:
    the report's number (per relay incarnation); ``http_url``, ``http_token``: its HTTP
    relay (:mod:`edged.cluster.http_relay`; empty: none); ``age_s``: the report's age when
    the registry was read (s, the registry's clock).
    """

    name: str
    state: str = "up"
    free: int = 0
    held: int = 0
    backends: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    taken_at: float = 0.0
    seq: int = 0
    ray_node_id: str = ""
    socket: str = ""
    http_url: str = ""
    http_token: str = ""
    age_s: float = 0.0

    @property
    def capacity(self) -> int:
        """Sandboxes it holds plus those it can still admit."""
        return self.held + self.free

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeView:
        """From the registry's node object (:meth:`edged.cluster.registry.Registry.nodes`)."""
        http = d.get("http") or {}
        return cls(name=str(d["name"]), state=str(d["state"]), free=int(d.get("free", 0)),
                   held=int(d.get("held", 0)), backends=tuple(d.get("backends", ())),
                   labels=dict(d.get("labels", {})), taken_at=float(d.get("taken_at", 0.0)),
                   seq=int(d.get("seq", 0)), ray_node_id=str(d.get("ray_node_id", "")),
                   socket=str(d.get("socket", "")), http_url=str(http.get("url", "")),
                   http_token=str(http.get("token", "")), age_s=float(d.get("age_s", 0.0)))


def free_slots(info: Mapping[str, Any]) -> int:
    """Sandboxes a node can still admit, from its ``GET /v1/node``: the smaller of the
    memory headroom in sandbox-sized units and the room under ``max_sandboxes``
    (``free.sandboxes``, ``free.max_sandboxes``; :meth:`edged.node.admission.Admission.snapshot`).
    A daemon without ``free`` (older) counts its ``max_sandboxes`` less what it holds."""
    free = info.get("free")
    if isinstance(free, Mapping):
        return max(0, min(int(free.get("sandboxes", 0)), int(free.get("max_sandboxes", 0))))
    cap = info.get("capacity", {}).get("max_sandboxes", 0)
    held = info.get("allocated", {}).get("sandboxes", 0)
    return max(0, int(cap) - int(held))


@dataclass(frozen=True)
class Constraints:
    """What a node must offer: ``backend`` among its backends, every ``labels`` item among
    its labels, and its name ``node``; None / empty: anything."""

    backend: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    node: str | None = None

    def allows(self, v: NodeView) -> bool:
        """Whether node ``v`` meets these constraints (its state aside)."""
        if self.node is not None and v.name != self.node:
            return False
        if self.backend is not None and self.backend not in v.backends:
            return False
        return all(v.labels.get(k) == val for k, val in self.labels.items())


@dataclass
class Ticket:
    """One placement in flight: on ``node``, from the moment it was chosen."""

    node: str
    started: float
    sandbox_id: str = ""
    created_at: float | None = None  # node clock; set once the create succeeded
    refused_at: float | None = None  # node clock; set if the node refused


@dataclass
class _Overlay:
    pending: int = 0  # chosen, no answer yet
    placed: list[Ticket] = field(default_factory=list)  # created, not in a report yet
    refused_at: float | None = None  # full (said the node) until a report taken after this


@dataclass
class _Trend:
    """A node's net arrival rate from its reports: ``rate`` sandboxes/s (node clock), and
    when (this client's clock) the report now in use was taken."""

    held: int
    taken_at: float
    read_at: float
    rate: float = 0.0


class Placer:
    """Power of ``k`` choices over :class:`NodeView` reports plus this client's in-flight
    placements (module docstring). ``rng``: the random source (tests seed it); ``clock``:
    the client's monotonic clock, for ``overlay_ttl_s``.

    ``k = 1`` is random placement among the nodes with room; ``k`` at least the number of
    nodes is least-loaded placement; ``overlay = False`` decides on the reports alone, as a
    client that keeps no count of its own placements would (both for comparison:
    ``bench/bench_cluster.py``); ``estimate``: count other clients' arrivals since each
    report (module docstring; with ``overlay`` only)."""

    def __init__(self, k: int = 2, *, rng: random.Random | None = None,
                 overlay_ttl_s: float = 30.0, overlay: bool = True, estimate: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if k < 1:
            raise ValueError(f"k: must be >= 1, not {k}")
        self.k = k
        self.overlay = overlay
        self.estimate = estimate and overlay
        self.rng = rng or random.Random()
        self.overlay_ttl_s = overlay_ttl_s
        self.clock = clock
        self._views: dict[str, NodeView] = {}
        self._overlay: dict[str, _Overlay] = {}
        self._trends: dict[str, _Trend] = {}
        self._lock = threading.Lock()

    # -- reports ----------------------------------------------------------------------------

    def update(self, views: Iterable[NodeView]) -> None:
        """Take the registry's latest views of every node (those not listed are forgotten);
        overlay entries a newer report reflects are dropped."""
        now = self.clock()
        with self._lock:
            self._views = {v.name: v for v in views}
            for name in set(self._trends) - set(self._views):
                del self._trends[name]
            for v in self._views.values():
                self._trend(v, now)
            for name in list(self._overlay):
                if name not in self._views and not self._overlay[name].pending:
                    del self._overlay[name]
            for name, ov in self._overlay.items():
                self._prune(ov, self._views.get(name))

    def _trend(self, v: NodeView, now: float) -> None:
        tr = self._trends.get(v.name)
        if tr is None or v.taken_at < tr.taken_at:  # new, or a restarted relay's clock
            self._trends[v.name] = _Trend(v.held, v.taken_at, now - v.age_s)
            return
        if v.taken_at == tr.taken_at:
            return
        rate = max(0.0, (v.held - tr.held) / (v.taken_at - tr.taken_at))
        self._trends[v.name] = _Trend(v.held, v.taken_at, now - v.age_s, rate)

    def views(self) -> list[NodeView]:
        """The views placement decides on."""
        with self._lock:
            return list(self._views.values())

    def _prune(self, ov: _Overlay, v: NodeView | None) -> None:
        old = self.clock() - self.overlay_ttl_s
        taken = v.taken_at if v is not None else float("-inf")
        ov.placed = [t for t in ov.placed
                     if t.started > old and t.created_at is not None and t.created_at >= taken]
        if ov.refused_at is not None and (taken > ov.refused_at or v is None):
            ov.refused_at = None

    # -- the choice -------------------------------------------------------------------------

    def _in_flight(self, name: str) -> int:
        ov = self._overlay.get(name)
        own = 0 if ov is None or not self.overlay else ov.pending + len(ov.placed)
        tr = self._trends.get(name) if self.estimate else None
        if tr is None or tr.rate <= 0.0:
            return own
        return max(own, int(tr.rate * max(0.0, self.clock() - tr.read_at)))

    def _free(self, v: NodeView) -> int:
        ov = self._overlay.get(v.name)
        if ov is not None and ov.refused_at is not None and self.overlay:
            return 0
        return v.free - self._in_flight(v.name)

    def _load(self, v: NodeView) -> float:
        cap = v.capacity
        return 1.0 if cap <= 0 else (v.held + self._in_flight(v.name)) / cap

    def effective(self, name: str) -> tuple[int, float]:
        """``(free, load)`` of node ``name`` with this client's overlay laid over its report."""
        with self._lock:
            v = self._views[name]
            return self._free(v), self._load(v)

    def place(self, want: Constraints = Constraints(),
              exclude: Iterable[str] = ()) -> Ticket | None:
        """Choose a node for one sandbox and count it in flight there: among the nodes that
        are ``up``, meet ``want``, are not in ``exclude`` and have room with the overlay laid
        over their report, ``k`` sampled at random, the least loaded of them (ties: the
        most free). None if no node has room. Every ticket must end in :meth:`placed` or
        :meth:`failed`."""
        skip = set(exclude)
        with self._lock:
            cands = [v for v in self._views.values()
                     if v.state == "up" and v.name not in skip and want.allows(v)
                     and self._free(v) >= 1]
            if not cands:
                return None
            sample = self.rng.sample(cands, min(self.k, len(cands)))
            best = min(sample, key=lambda v: (self._load(v), -self._free(v)))
            ov = self._overlay.setdefault(best.name, _Overlay())
            ov.pending += 1
            return Ticket(best.name, self.clock())

    def placed(self, t: Ticket, created_at: float) -> None:
        """``t``'s create succeeded; ``created_at``: the sandbox's creation time on its node
        (node clock). It stays in the overlay until a report taken after it."""
        with self._lock:
            ov = self._overlay.setdefault(t.node, _Overlay())
            ov.pending = max(0, ov.pending - 1)
            t.created_at = created_at
            ov.placed.append(t)
            self._prune(ov, self._views.get(t.node))

    def failed(self, t: Ticket, refused_at: float | None = None) -> None:
        """``t``'s create failed. ``refused_at`` (node clock): the node refused it for want
        of capacity; it counts as full until a report taken after that time."""
        with self._lock:
            ov = self._overlay.setdefault(t.node, _Overlay())
            ov.pending = max(0, ov.pending - 1)
            if refused_at is not None:
                t.refused_at = refused_at
                ov.refused_at = max(ov.refused_at or refused_at, refused_at)

    def released(self, node: str, sandbox_id: str) -> None:
        """This client deleted ``sandbox_id`` on ``node``: if no report counted it yet, it
        leaves the overlay (a report that did count it will show it gone soon)."""
        with self._lock:
            ov = self._overlay.get(node)
            if ov is not None:
                ov.placed = [t for t in ov.placed if t.sandbox_id != sandbox_id]

    def in_flight(self) -> dict[str, int]:
        """Placements in flight per node (chosen and not answered, or created and in no
        report yet)."""
        with self._lock:
            return {n: self._in_flight(n) for n in self._overlay if self._in_flight(n)}
