"""Where a warm FnCall call's CPU goes: sequential calls through a daemon of its own, the CPU
per call of each party.

    .venv/bin/python bench/fnprof.py [--lang python|true|JSON-BODY] [--n 500] [--pool 2]
                                     [--perf FILE] [--ref REV [--rounds 2]] [--json]

The daemon (``edged serve --fncall-layers ...``, started by ``bench_fncall.py``'s
``start_daemon``, same layer cache) serves ``--n`` calls one at a time (after a warm-up of
20), each ``print(i)`` in Python (``--lang python``, default), ``/bin/true`` (``--lang
true``) or the JSON body given. Per call:

- ``daemon_ms``: the daemon process's own CPU (``/proc/PID/stat`` utime + stime);
- ``client_ms``: this process's CPU (the HTTP client);
- ``sandbox_ms``: the pool sandboxes' CPU, the ``cpuacct.usage`` of the daemon's cgroup
  subdirectory that holds the pool sandboxes (its sandboxes only, recycled ones
  included), and of it, from ``/proc/PID/stat`` of the processes in those cgroups:
  ``io_ms`` (the server's io process), ``zygote_ms`` (the zygote itself), ``child_ms``
  (its children, the calls: the zygote's cutime + cstime), ``spawner_ms`` (fncall-spawn
  and its children), ``other_ms`` (the rest: sbx-init, exits not yet reaped);
- ``child_minflt``: minor page faults of the zygote's children per call (its cminflt):
  the forked child's copy-on-write and first-touch faults.

``--ref REV``: this tree against an earlier commit of it, in turns (``--rounds`` each, REV
first in odd rounds; REV checked out as ``bench_fncall.py --ref`` does): each figure's
median per tree and this tree's over REV's.

``--perf FILE``: ``perf record -g`` of the pool sandboxes' processes during the calls
(then ``perf report -i FILE``). Needs root, the FnCall image (``scripts/fncall-rootfs.sh``)
and cgroup v1's cpuacct controller (this machine's; a v2-only host has none).
CPU times from /proc are in clock ticks (10 ms): keep ``--n`` at 300 or more.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fncall as bf

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
TICK = os.sysconf("SC_CLK_TCK")
BODIES = {"python": None, "true": {"argv": ["/bin/true"]}}


def proc_stat(pid: int | str) -> dict[str, float]:
    """utime, stime, cutime, cstime (s) and minflt, cminflt of one process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3 of proc(5)): field N is fields[N - 3]
    return {"minflt": int(fields[7]), "cminflt": int(fields[8]),
            "utime": int(fields[11]) / TICK, "stime": int(fields[12]) / TICK,
            "cutime": int(fields[13]) / TICK, "cstime": int(fields[14]) / TICK}


def cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def pool_processes(cg: Path) -> dict[str, list[str]]:
    """The pool sandboxes' server processes by role (host pids): io, zygote, spawner."""
    roles: dict[str, list[str]] = {"io": [], "zygote": [], "spawner": []}
    tasks = {t for p in cg.rglob("tasks") for t in p.read_text().split()}
    for t in sorted(tasks):
        argv0 = cmdline(t).split(b"\0", 1)[0]
        if argv0.endswith(b"/fncall-spawn"):
            roles["spawner"].append(t)
        elif argv0.startswith(b"python3"):
            try:
                with open(f"/proc/{t}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]
            except OSError:
                continue
            parent = cmdline(ppid).split(b"\0", 1)[0]
            roles["zygote" if parent.startswith(b"python3") else "io"].append(t)
    return roles


def snapshot(cg: Path, daemon: int) -> dict[str, float]:
    out = {"daemon": sum(proc_stat(daemon)[k] for k in ("utime", "stime")),
           "client": time.process_time(),
           "sandbox": int((cg / "cpuacct.usage").read_text()) / 1e9}
    roles = pool_processes(cg)
    for role, pids in roles.items():
        out[role] = out[role + "_children"] = out[role + "_cminflt"] = 0.0
        for p in pids:
            with contextlib.suppress(OSError):
                s = proc_stat(p)
                out[role] += s["utime"] + s["stime"]
                out[role + "_children"] += s["cutime"] + s["cstime"]
                out[role + "_cminflt"] += s["cminflt"]
    out["pids"] = sum(len(p) for p in roles.values())
    return out


def instance_cgroup(c: bf.Conn) -> Path:
    """The daemon's cpuacct cgroup subdirectory (its sandboxes' parent), found from a pool
    sandbox's id."""
    st, rep = c.call("GET", "/v1/sandboxes")
    assert st == 200, rep
    ids = [s["id"] for s in rep["sandboxes"]]
    for sub in CPUACCT.iterdir():
        if sub.is_dir() and any((sub / i).is_dir() for i in ids):
            return sub
    raise SystemExit(f"fnprof: no cpuacct cgroup holds the pool sandboxes {ids}")


def profile(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement (see the module) against a daemon of ``tree``'s."""
    fixed = BODIES[args.lang] if args.lang in BODIES else json.loads(args.lang)

    def body(i: int) -> dict[str, Any]:
        return fixed or {"language": "python", "source": f"print({i})"}

    store = Path(args.store)
    store.mkdir(parents=True, exist_ok=True)
    digest = bf.layer(store)
    run = Path(tempfile.mkdtemp(prefix="edged-fnprof-", dir="/run"))
    sock, state = str(run / "s.sock"), run / "state"
    stop, daemon = bf.start_daemon(["--socket", sock, "--state-dir", str(state),
                                    "--runtime-dir", str(run), "--store-dir", str(store),
                                    "--log-level", "warning", "--fncall-layers", digest,
                                    "--fncall-pool", str(args.pool), "--layer-linger-s", "60"],
                                   sock, tree)
    perf = None
    try:
        c = bf.Conn(sock)
        for i in range(20):
            st, rep = c.call("POST", "/v1/fncalls", body(i))
            assert st == 200, rep
        cg = instance_cgroup(c)
        if args.perf:
            roles = pool_processes(cg)
            pids = [p for ps in roles.values() for p in ps]
            perf = subprocess.Popen(["perf", "record", "-q", "-g", "-o", args.perf,
                                     "-p", ",".join(pids)])
            time.sleep(1.0)
        load0 = os.getloadavg()[0]
        s0 = snapshot(cg, daemon)
        t0 = time.perf_counter()
        for i in range(args.n):
            st, rep = c.call("POST", "/v1/fncalls", body(i))
            assert st == 200 and rep["results"][0]["status"] == "Accepted", rep
        wall = time.perf_counter() - t0
        time.sleep(0.2)  # the last call's exit and wipe are done by now
        s1 = snapshot(cg, daemon)
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait()
    finally:
        if perf is not None and perf.poll() is None:
            perf.kill()
            perf.wait()
        stop()
        shutil.rmtree(run, ignore_errors=True)
    n: int = args.n

    def per(key: str) -> float:
        return float(s1[key] - s0[key]) / n * 1e3

    if s1["pids"] != s0["pids"]:
        print(f"fnprof: the pool's processes changed ({s0['pids']} -> {s1['pids']}: a member"
              " was recycled); the per-process split is off, the totals are not",
              file=sys.stderr)
    out = {"n": n, "lang": args.lang, "wall_ms": wall / n * 1e3, "daemon_ms": per("daemon"),
           "client_ms": per("client"), "sandbox_ms": per("sandbox"), "io_ms": per("io"),
           "zygote_ms": per("zygote"), "child_ms": per("zygote_children"),
           "spawner_ms": per("spawner") + per("spawner_children"),
           "child_minflt": (s1["zygote_cminflt"] - s0["zygote_cminflt"]) / n,
           "loadavg_1min": [load0, os.getloadavg()[0]],
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    out["other_ms"] = out["sandbox_ms"] - sum(out[k] for k in ("io_ms", "zygote_ms",
                                                               "child_ms", "spawner_ms"))
    out["all_ms"] = out["daemon_ms"] + out["client_ms"] + out["sandbox_ms"]
    return out


KEYS = ("daemon_ms", "client_ms", "sandbox_ms", "io_ms", "zygote_ms", "child_ms", "spawner_ms",
        "other_ms", "all_ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lang", default="python", help="python, true, or a JSON request body")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--pool", type=int, default=2)
    ap.add_argument("--store", default="/var/tmp/edged-bench-fncall-store")
    ap.add_argument("--perf", default=None, help="perf record -g into this file")
    ap.add_argument("--ref", default=None, help="an earlier commit to run against, in turns")
    ap.add_argument("--rounds", type=int, default=2, help="with --ref: turns of each tree")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("fnprof: needs root")
    if args.ref:
        return compare(args)
    out = profile(bf.ROOT, args)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.lang}: {out['n']} sequential calls, {out['wall_ms']:.2f} ms wall per call; "
          "CPU ms per call:")
    for k in KEYS:
        print(f"  {k[:-3]:10} {out[k]:6.2f}")
    print(f"  child minor faults per call: {out['child_minflt']:.0f}")
    print(f"load average (1 min) before/after: {out['loadavg_1min'][0]:.2f} / "
          f"{out['loadavg_1min'][1]:.2f}")
    return 0


def compare(args: argparse.Namespace) -> int:
    """``--ref``: REV's daemon and this tree's, in turns."""
    load0 = os.getloadavg()[0]
    got = bf.in_turns(args.ref, args.rounds, lambda tree: profile(tree, args))
    keys = (*KEYS, "wall_ms", "child_minflt")
    med = {who: {k: statistics.median(o[k] for o in runs) for k in keys}
           for who, runs in got.items()}
    out = {"ref": args.ref, "rounds": args.rounds, "lang": args.lang, "n": args.n,
           "median": med, "runs": got, "loadavg_1min": [load0, os.getloadavg()[0]],
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.lang}: {args.n} sequential calls, this tree against {args.ref}, median of "
          f"{args.rounds} turns each; CPU ms per call:")
    print(f"  {'':12} {'ref':>7} {'this':>7} {'x':>6}")
    for k in keys:
        a, b = med["ref"][k], med["this"][k]
        print(f"  {k.removesuffix('_ms'):12} {a:7.2f} {b:7.2f} {b / a if a else 0:6.2f}")
    print(f"load average (1 min) before/after: {load0:.2f} / {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
