"""The cluster client's cost per create, and its placement at scale.

    .venv/bin/python bench/bench_cluster.py [--n 200] [--threads 8] [--nodes 160]
        [--slots 3200] [--burst 32000] [--clients 16] [--skip-overhead] [--skip-sim] [--json]

**Overhead** (needs root): a local Ray cluster on loopback (``ray start --head`` on
127.0.0.2, its own session, stopped at the end), one ``edged serve`` daemon (container
backend, a busybox layer built by layerfs, the default confined task profile) joined with
``edged cluster join``. Interleaved, in the same run: ``Sandbox.create`` on the daemon's
socket (the node's SDK: the baseline), ``ClusterClient.create`` from a client that is not
on the node (``direct=False``: what a client on another host pays) through the node's HTTP
relay (the default data path) and through its relay actor (``http=False``: a Ray actor call
each way), and ``ClusterClient.create`` on the same Ray node (the direct path). Create
latency (the call; the delete is not timed), p50/p99 and the cluster's overhead (its p50
less the SDK's: goal <= 2 ms); creates/s of ``--threads`` threads creating at once (create +
delete cycles, ``--n`` of them); exec round trips (``true``) through each.

**Simulation** (no Ray, no sandboxes): ``--nodes`` node processes, each a modelled node of
``--slots`` slots that admits a create if it has a free slot (refuses it otherwise) and
answers after ``--service-ms``, writing a report (held, free, time) every
``--report-s``; ``--clients`` client processes share a burst of ``--burst`` creates, up to
``--inflight`` each in flight, each with its own :class:`edged.cluster.placement.Placer`
reading the reports every ``--report-s``, retrying a refusal on another node (3 nodes at
most). Placement policies compared on the same cluster: power of 2 choices with the
in-flight overlay and the estimate of other clients' arrivals since each report (edged's),
the same without the estimate, without the overlay, least-loaded with and without the
overlay, and random. Two scenarios: an empty cluster, and a busy one (each node's load drawn from
U(0.5, 1.0) before the burst). Figures: imbalance (max/mean of the nodes' load after the
burst; 1.0 is perfect), refusal rate (refused attempts / attempts), creates that failed
(3 refusals, or no node with room by reports 3 intervals old), and the burst's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from edged.cluster.placement import NodeView, Placer  # noqa: E402

ENV = {"PATH": "/bin"}
POLICIES = {
    "power of 2 + overlay + arrivals (edged)": {"k": 2, "overlay": True, "estimate": True},
    "power of 2 + overlay": {"k": 2, "overlay": True},
    "power of 2, reports only": {"k": 2, "overlay": False},
    "least-loaded + overlay": {"k": 1 << 30, "overlay": True},
    "least-loaded, reports only": {"k": 1 << 30, "overlay": False},
    "random": {"k": 1, "overlay": False},
}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# -- overhead on one real node ------------------------------------------------------------


def overhead(n: int, threads: int, execs: int) -> dict[str, Any]:
    import ray
    from bench_api import busybox_layer, start_daemon

    from edged.client import Sandbox, SandboxError
    from edged.cluster import ClusterClient
    from edged.cluster.transport import DirectTransport, HttpRelayTransport, RelayTransport
    from edged.config import Config
    from tests.edged.cluster.procs import VENV_BIN, Proc, RayCluster, wait_for

    work = Path(tempfile.mkdtemp(prefix="edged-bench-cluster-", dir="/tmp"))
    runtime = tempfile.mkdtemp(prefix="edged-bench-cluster-", dir="/run")
    rc = RayCluster(work, ["127.0.0.2"])
    join: Proc | None = None
    stop_daemon = None
    try:
        store, digest = busybox_layer(work)
        cfg = Config(socket=str(work / "s.sock"), state_dir=str(work / "state"),
                     runtime_dir=runtime, store_dir=store, log_level="warning",
                     default_ttl_s=0.0)
        stop_daemon = start_daemon(cfg, False)
        rc.start()
        join = Proc([str(VENV_BIN / "edged"), "cluster", "join", "--ray-address", rc.address,
                     "--node-ip-address", "127.0.0.2", "--socket", cfg.socket,
                     "--node-name", "bench"], work / "join.log")
        ray.init(address=rc.address, _node_ip_address="127.0.0.2", namespace="edged",
                 log_to_driver=False, logging_level="warning")

        def up() -> bool:
            with contextlib.suppress(Exception):
                return any(x["state"] == "up" for x in
                           ray.get(ray.get_actor("edged-registry").nodes.remote()))
            return False
        wait_for(up, 120, "the node joined", step=0.2)
        relay = ClusterClient(direct=False, http=False)
        http = ClusterClient(direct=False)
        direct = ClusterClient()
        kill_failed: list[str] = []

        def kill(s: Any) -> None:  # a delete that fails under load is counted, not fatal:
            try:                   # the delete is not what is measured
                s.kill()
            except SandboxError as e:
                kill_failed.append(f"{s.id}: {e}")
        sdk = lambda: Sandbox.create(layers=[digest], env=ENV, socket=cfg.socket)  # noqa: E731
        via = {"sdk": sdk,
               "relay": lambda: relay.create(layers=[digest], env=ENV),
               "http": lambda: http.create(layers=[digest], env=ENV),
               "direct": lambda: direct.create(layers=[digest], env=ENV)}
        for f in via.values():  # warm-up (layer mounted, actor handles, pools)
            for _ in range(3):
                kill(f())
        lat: dict[str, list[float]] = {k: [] for k in via}
        for _ in range(n):
            for k, f in via.items():
                t0 = time.perf_counter()
                s = f()
                lat[k].append(time.perf_counter() - t0)
                kill(s)
        boxes = {k: f() for k, f in via.items()}
        assert type(boxes["relay"]._t) is RelayTransport
        assert type(boxes["http"]._t) is HttpRelayTransport
        assert isinstance(boxes["direct"]._t, DirectTransport)
        rt: dict[str, list[float]] = {k: [] for k in via}
        for _ in range(execs):
            for k, s in boxes.items():
                t0 = time.perf_counter()
                s.exec("true")
                rt[k].append(time.perf_counter() - t0)
        assert boxes["http"]._t.route.failed_at is None  # none of it fell back to the actor
        for s in boxes.values():
            kill(s)
        rate: dict[str, float] = {}
        for k, f in via.items():
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda _, f=f: kill(f()), range(n)))
            rate[k] = n / (time.perf_counter() - t0)
        relay.close()
        http.close()
        direct.close()
        return {
            "create_p50_ms": {k: pct(v, 50) * 1e3 for k, v in lat.items()},
            "create_p99_ms": {k: pct(v, 99) * 1e3 for k, v in lat.items()},
            "create_overhead_p50_ms": {k: (pct(lat[k], 50) - pct(lat["sdk"], 50)) * 1e3
                                       for k in ("relay", "http", "direct")},
            "exec_roundtrip_p50_ms": {k: pct(v, 50) * 1e3 for k, v in rt.items()},
            "creates_per_s": rate, "n": n, "threads": threads,
            "deletes_failed": kill_failed,
        }
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if join is not None:
            join.stop(30)
        rc.stop()
        if stop_daemon is not None:
            stop_daemon()
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# -- the simulation -----------------------------------------------------------------------


def node_main(i: int, cap: int, held: int, req: Any, replies: list[Any], reports: Any,
              report_s: float, service_s: float, done: Any) -> None:
    """A modelled node: admits at once if it has a slot, answers after ``service_s``."""
    pending: list[tuple[float, int, tuple[int, bool, int, float]]] = []
    seq = 0
    next_report = time.time()
    while True:
        now = time.time()
        if now >= next_report:
            reports[3 * i:3 * i + 3] = [float(held), float(cap - held), now]
            next_report = now + report_s
        while pending and pending[0][0] <= now:
            _, _, (c, ok, rid, at) = heapq.heappop(pending)
            replies[c].put((rid, ok, i, at))
        wait = min(next_report, pending[0][0] if pending else next_report) - time.time()
        try:
            msg = req.get(timeout=max(0.0, wait))
        except queue.Empty:
            continue
        if msg is None:
            done.put((i, held))
            return
        c, rid = msg
        ok = held < cap
        if ok:
            held += 1
        seq += 1
        heapq.heappush(pending, (now + service_s, seq, (c, ok, rid, time.time())))


def client_main(c: int, policy: dict[str, Any], creates: int, inflight: int, reqs: list[Any],
                reply: Any, reports: Any, n: int, report_s: float, seed: int, out: Any,
                go: Any) -> None:
    """One client: ``creates`` creates, at most ``inflight`` at once, 3 nodes at most each."""
    placer = Placer(policy["k"], overlay=policy["overlay"],
                    estimate=policy.get("estimate", False), rng=random.Random(seed))

    def refresh() -> None:
        r = list(reports[:])
        now = time.time()  # the nodes' clock is this host's: a report's age
        placer.update(NodeView(str(i), free=int(r[3 * i + 1]), held=int(r[3 * i]),
                               taken_at=r[3 * i + 2], age_s=max(0.0, now - r[3 * i + 2]))
                      for i in range(n))
    refresh()
    go.wait()
    t_refresh = time.monotonic()
    outstanding: dict[int, tuple[Any, list[str]]] = {}
    todo, rid, attempts, refused, failed = creates, 0, 0, 0, 0
    stalled: float | None = None  # since when no node had room by the reports
    while todo or outstanding:
        if time.monotonic() - t_refresh >= report_s:
            refresh()
            t_refresh = time.monotonic()
        while todo and len(outstanding) < inflight:
            t = placer.place()
            if t is None:
                break
            rid += 1
            attempts += 1
            outstanding[rid] = (t, [t.node])
            reqs[int(t.node)].put((c, rid))
            todo -= 1
        try:
            got, ok, _node, at = reply.get(timeout=report_s / 4)
        except queue.Empty:
            if todo and not outstanding:  # no room by the reports: wait for the next ones,
                if stalled is None:       # then give the rest up (the burst does not fit)
                    stalled = time.monotonic()
                elif time.monotonic() - stalled > 3 * report_s:
                    failed, todo = failed + todo, 0
                time.sleep(report_s / 4)
            continue
        stalled = None
        t, tried = outstanding.pop(got)
        if ok:
            placer.placed(t, at)
            continue
        refused += 1
        placer.failed(t, at)
        nxt = placer.place(exclude=tried) if len(tried) < 3 else None
        if nxt is None:
            failed += 1
            continue
        rid += 1
        attempts += 1
        outstanding[rid] = (nxt, [*tried, nxt.node])
        reqs[int(nxt.node)].put((c, rid))
    out.put({"attempts": attempts, "refused": refused, "failed": failed})


def simulate(policy: dict[str, Any], prefill: list[int], a: argparse.Namespace,
             seed: int) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    n = len(prefill)
    reports = ctx.Array("d", 3 * n, lock=False)
    reqs = [ctx.Queue() for _ in range(n)]
    replies = [ctx.Queue() for _ in range(a.clients)]
    done, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    nodes = [ctx.Process(target=node_main, args=(i, a.slots, prefill[i], reqs[i], replies,
                                                 reports, a.report_s, a.service_ms / 1e3,
                                                 done), daemon=True) for i in range(n)]
    for p in nodes:
        p.start()
    while min(reports[2::3]) == 0.0:  # every node's first report
        time.sleep(0.01)
    share = [a.burst // a.clients + (c < a.burst % a.clients) for c in range(a.clients)]
    clients = [ctx.Process(target=client_main,
                           args=(c, policy, share[c], a.inflight, reqs, replies[c], reports,
                                 n, a.report_s, seed * 1000 + c, out, go), daemon=True)
               for c in range(a.clients)]
    for p in clients:
        p.start()
    time.sleep(0.5)  # every client has read the reports
    t0 = time.perf_counter()
    go.set()
    stats = [out.get(timeout=600) for _ in clients]
    wall = time.perf_counter() - t0
    for p in clients:
        p.join(30)
    for q in reqs:
        q.put(None)
    held = dict(done.get(timeout=60) for _ in nodes)
    for p in nodes:
        p.join(30)
    loads = [held[i] / a.slots for i in range(n)]
    attempts = sum(s["attempts"] for s in stats)
    refused = sum(s["refused"] for s in stats)
    return {"imbalance": max(loads) / statistics.mean(loads),
            "max_load": max(loads), "mean_load": statistics.mean(loads),
            "refusal_rate": refused / attempts if attempts else 0.0,
            "failed": sum(s["failed"] for s in stats),
            "placed": sum(held.values()) - sum(prefill), "wall_s": wall}


def simulation(a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    scenarios = {"empty": [0] * a.nodes,
                 "busy": [int(a.slots * rng.uniform(0.5, 1.0)) for _ in range(a.nodes)]}
    out: dict[str, Any] = {}
    for sname, prefill in scenarios.items():
        out[sname] = {pname: simulate(pol, prefill, a, a.seed)
                      for pname, pol in POLICIES.items()}
    return out


# -- the report ---------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="creates per contender (overhead)")
    ap.add_argument("--threads", type=int, default=8, help="threads for creates/s")
    ap.add_argument("--execs", type=int, default=200, help="exec round trips per contender")
    ap.add_argument("--nodes", type=int, default=160)
    ap.add_argument("--slots", type=int, default=3200)
    ap.add_argument("--burst", type=int, default=32000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=64, help="creates in flight per client")
    ap.add_argument("--report-s", type=float, default=1.0, help="report interval (s)")
    ap.add_argument("--service-ms", type=float, default=5.0, help="a node's create time")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    if not a.skip_overhead and os.geteuid() != 0:
        print("bench_cluster: the overhead part needs root (--skip-overhead)", file=sys.stderr)
        return 2
    if not a.skip_sim:  # first: its processes are forked from one that has no Ray in it
        res["simulation"] = simulation(a)
        res["simulation_args"] = {k: getattr(a, k) for k in
                                  ("nodes", "slots", "burst", "clients", "inflight",
                                   "report_s", "service_ms", "seed")}
    if not a.skip_overhead:
        res["overhead"] = overhead(a.n, a.threads, a.execs)
    res["loadavg_end"] = os.getloadavg()
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    if "overhead" in res:
        o = res["overhead"]
        print(f"create through the cluster client vs the node's SDK ({o['n']} each, "
              "interleaved)")
        print(f"{'path':<10}{'p50 ms':>9}{'p99 ms':>9}{'overhead p50':>14}"
              f"{'creates/s':>11}{'exec rt p50':>13}")
        for k in ("sdk", "relay", "http", "direct"):
            ov = o["create_overhead_p50_ms"].get(k)
            print(f"{k:<10}{o['create_p50_ms'][k]:>9.2f}{o['create_p99_ms'][k]:>9.2f}"
                  f"{'' if ov is None else f'{ov:+.2f} ms':>14}"
                  f"{o['creates_per_s'][k]:>11.1f}{o['exec_roundtrip_p50_ms'][k]:>13.2f}")
        print(f"(creates/s: {o['threads']} threads; exec rt: `true`, ms; "
              f"{len(o['deletes_failed'])} deletes failed)")
    if "simulation" in res:
        s = res["simulation_args"]
        print(f"\nsimulation: {s['nodes']} nodes x {s['slots']} slots, a burst of "
              f"{s['burst']} from {s['clients']} clients ({s['inflight']} in flight each), "
              f"reports every {s['report_s']} s, {s['service_ms']} ms per create")
        print(f"{'scenario':<9}{'policy':<41}{'imbalance':>10}{'max load':>9}"
              f"{'refusals':>10}{'failed':>8}{'wall s':>8}")
        for sname, rows in res["simulation"].items():
            for pname, r in rows.items():
                print(f"{sname:<9}{pname:<41}{r['imbalance']:>10.3f}{r['max_load']:>9.3f}"
                      f"{r['refusal_rate']:>10.2%}{r['failed']:>8}{r['wall_s']:>8.2f}")
    la0, la1 = res["loadavg_start"][0], res["loadavg_end"][0]
    print(f"\nload average (1 min): {la0:.2f} at the start, {la1:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
