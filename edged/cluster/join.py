"""``edged cluster join | leave | nodes``: a node's daemon in a Ray cluster.

``join`` checks that the daemon answers on its socket, connects to Ray, and puts the node's
relay (:class:`~edged.cluster.actors.NodeActor`, a named detached actor) on this host's Ray
node, pinned there; it waits for the relay's first report, then stays in the foreground
(a systemd service) and checks the relay every ``report_interval_s``: a relay that died for
good is started again. SIGTERM or SIGINT makes the node *leave*: the relay stops, the
registry counts the node as left and its sandboxes as lost (nothing reaches them through the
cluster any more), and the process exits 0. The relay is detached, so a join process that is
killed without leaving (``kill -9``) leaves the node in the cluster; the next ``join`` (systemd
restarts it) takes the running relay over. ``leave`` does the leaving from anywhere.

Exit status: 0 left, 1 the daemon or Ray cannot be reached, 2 usage (a node name taken by
another Ray node).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TypeVar

from edged.client._http import Transport, default_socket, path_for
from edged.client.errors import SandboxError
from edged.cluster import ids

T = TypeVar("T")
log = logging.getLogger("edged.cluster.join")


def _labels(items: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for x in items or ():
        k, sep, v = x.partition("=")
        if not sep or not k:
            raise SystemExit(f"edged cluster: --label {x!r}: must be KEY=VALUE")
        out[k] = v
    return out


def add_parser(sub: Any) -> None:
    """Add ``cluster join|leave|nodes`` to the ``edged`` command's subparsers."""
    p = sub.add_parser("cluster", help="this node in a Ray cluster: join, leave, list nodes")
    csub = p.add_subparsers(dest="cluster_command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--ray-address", required=True, help="the Ray cluster (HOST:PORT)")
        sp.add_argument("--namespace", default="edged", help="Ray namespace (default edged)")
        sp.add_argument("--node-ip-address", help="this host's address in Ray (default: "
                                                  "Ray's choice)")

    sp = csub.add_parser("join", help="register the local daemon with the Ray cluster and "
                                      "stay in the foreground (SIGTERM: leave)")
    common(sp)
    sp.add_argument("--socket", default=None, help="the daemon's socket (default "
                                                   "$EDGED_SOCKET or /run/edged/edged.sock)")
    sp.add_argument("--node-name", help="the node's name in the cluster, [a-z0-9][a-z0-9_-]"
                                        "{0,31} (default: from the host name)")
    sp.add_argument("--label", action="append", help="KEY=VALUE placement label "
                                                     "(repeatable)")
    sp.add_argument("--report-interval", type=float, default=1.0,
                    help="seconds between capacity reports (default 1)")
    sp.add_argument("--dead-after", type=float, default=5.0,
                    help="seconds without a report before the registry counts a node dead "
                         "(default 5; set by the first node to join)")
    sp.add_argument("--list-every", type=int, default=5,
                    help="read the sandbox list every N reports (default 5)")
    sp.add_argument("--http-port", type=int, default=0,
                    help="the node's HTTP relay (the clients' data path) on this port of "
                         "its Ray IP address (default 0: any free port)")
    sp.add_argument("--no-http-relay", action="store_true",
                    help="serve no HTTP relay: clients call through Ray actor calls only")
    sp.set_defaults(fn=cmd_join)

    sp = csub.add_parser("leave", help="take a node out of the cluster")
    common(sp)
    sp.add_argument("--node-name", required=True)
    sp.set_defaults(fn=cmd_leave)

    sp = csub.add_parser("nodes", help="the cluster's nodes and what each can still take")
    common(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_nodes)


def _connect(a: argparse.Namespace) -> None:
    from edged.cluster import actors

    actors.connect(a.ray_address, a.namespace, a.node_ip_address)


def _on_ray(a: argparse.Namespace, command: str, fn: Callable[[], T]) -> T | None:
    """``fn()`` connected to the Ray of ``a`` (disconnected after); None where Ray or the
    registry could not be reached, said on stderr as ``edged cluster <command>: ...``."""
    import ray

    try:
        _connect(a)
        return fn()
    except (ValueError, ConnectionError, RuntimeError) as e:
        print(f"edged cluster {command}: {e}", file=sys.stderr)
        return None
    finally:
        if ray.is_initialized():
            ray.shutdown()


def cmd_join(a: argparse.Namespace) -> int:
    """``edged cluster join``: see the module docstring."""
    import ray

    from edged.cluster import actors

    name = ids.check_node_name(a.node_name or ids.default_node_name())
    sock = a.socket or default_socket()
    labels = _labels(a.label)
    try:
        Transport(sock, timeout=10).json("GET", path_for("node"))
    except SandboxError as e:
        print(f"edged cluster join: the daemon at {sock} does not answer: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            _connect(a)  # (keeps the handlers: see actors.connect)
        except (ConnectionError, RuntimeError, ValueError) as e:
            print(f"edged cluster join: Ray at {a.ray_address}: {e}", file=sys.stderr)
            return 1
        here = ray.get_runtime_context().get_node_id()
        if not _take_over(name, sock, here, a.namespace):
            print(f"edged cluster join: node name {name!r} is taken by a relay on another "
                  "Ray node (pick another --node-name, or `edged cluster leave` it)",
                  file=sys.stderr)
            return 2

        def start() -> Any:
            act = actors.start_node_actor(
                name, sock, labels=labels, report_interval_s=a.report_interval,
                list_every=a.list_every, namespace=a.namespace, dead_after_s=a.dead_after,
                ray_node_id=here, http_port=None if a.no_http_relay else a.http_port)
            ray.get(act.start.remote(), timeout=60)
            return act

        actor = start()
        print(f"edged cluster join: node {name} joined (Ray node {here[:12]}, daemon {sock})",
              flush=True)
        while not stop.wait(a.report_interval):
            try:
                ray.get(actor.ping.remote(), timeout=max(10.0, 3 * a.report_interval))
            except ray.exceptions.ActorDiedError as e:
                log.warning("node %s: its relay died (%s); starting it again", name, e)
                actor = start()
            except ray.exceptions.RayError as e:
                log.warning("node %s: its relay does not answer: %s", name, e)
        try:
            ray.get(actor.leave.remote(), timeout=30)
        except ray.exceptions.RayError as e:
            log.warning("node %s: leave: %s", name, e)
        ray.kill(actor)
        print(f"edged cluster join: node {name} left", flush=True)
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if ray.is_initialized():
            ray.shutdown()


def _take_over(name: str, sock: str, here: str, namespace: str) -> bool:
    """Whether this Ray node may run node ``name``'s relay: a relay already running under
    that name here is taken over (replaced if it is for another socket, or does not
    answer); False if it runs on another Ray node."""
    import ray

    from edged.cluster import actors

    try:
        old = actors.node_actor(name, namespace)
    except ValueError:
        return True
    try:
        info = ray.get(old.ping.remote(), timeout=30)
    except ray.exceptions.RayError:
        ray.kill(old)  # dead or wedged: a new one is started
        return True
    if info["ray_node_id"] != here:
        return False
    if info["socket"] != sock:
        ray.kill(old)
    return True


def cmd_leave(a: argparse.Namespace) -> int:
    """``edged cluster leave``: stop node ``--node-name``'s relay, tell the registry."""
    import ray

    from edged.cluster import actors

    name = ids.check_node_name(a.node_name)

    def leave() -> bool:
        reg = actors.registry(a.namespace)
        try:
            act = actors.node_actor(name, a.namespace)
            ray.get(act.leave.remote(), timeout=30)
            ray.kill(act)
        except (ValueError, ray.exceptions.RayError):
            pass  # no relay, or a dead one: the registry is told below anyway
        return bool(ray.get(reg.leave.remote(name), timeout=30))

    left = _on_ray(a, "leave", leave)
    if left is None:
        return 1
    if not left:
        print(f"edged cluster leave: no node {name!r} in the cluster", file=sys.stderr)
        return 1
    print(f"node {name} left")
    return 0


def cmd_nodes(a: argparse.Namespace) -> int:
    """``edged cluster nodes``: the registry's table of nodes."""
    import ray

    from edged.cluster import actors

    nodes: list[dict[str, Any]] | None = _on_ray(
        a, "nodes", lambda: ray.get(actors.registry(a.namespace).nodes.remote(), timeout=30))
    if nodes is None:
        return 1
    for n in nodes:  # the relays' tokens are for cluster clients, not for listings
        if n.get("http"):
            n["http"] = {"url": n["http"].get("url")}
    if a.json:
        print(json.dumps(nodes, indent=2, sort_keys=True))
        return 0
    from edged.tabular import table

    rows = [[n["name"], n["state"], str(n["free"]), str(n["held"]), str(n["sandboxes"]),
             str(n["lost"]), ",".join(n["backends"]),
             ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())),
             f"{n['age_s']:.1f}s", n["cause"]] for n in nodes]
    print(table(rows, ["NODE", "STATE", "FREE", "HELD", "SANDBOXES", "LOST", "BACKENDS",
                        "LABELS", "REPORT", "CAUSE"]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edged.cluster.join``: the same as ``edged cluster``."""
    p = argparse.ArgumentParser(prog="edged")
    add_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return int(a.fn(a))


if __name__ == "__main__":
    sys.exit(main())
