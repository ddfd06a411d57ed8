"""What a network costs a sandbox: create→first exec with a network against without, the
egress programs' cost per connect(), and host memory per networked idle sandbox, in one run.

    .venv/bin/python bench/bench_network.py [--n 60] [--connects 5000] [--rounds 25]
        [--idle 40] [--json]

Needs root. One daemon (``edged serve``, its own process, default settings but a network pool
of its own) on a busybox layer. Figures:
- create→first exec: ``Sandbox.create`` then ``exec("true")`` until its end, ``--n`` times
  each with ``network="none"`` and with :data:`POLICY` (a UDP range and a name),
  interleaved (one of each in turn, so both see the same machine); the delete is not timed.
  Goal: networked p50 <= none p50 + 10 ms.
- connect(): a helper process in a networked sandbox's namespace times ``--connects`` UDP
  ``connect()`` calls (with socket() and close(); no packet is sent: the call is the connect
  hook and a route lookup) to an allowed address and to a refused one (EPERM), in the
  sandbox's cgroup v2 directory (the egress programs run) and outside it (they do not),
  alternating, best of ``--rounds``: the difference is the programs' cost. Goal: <= 5 µs. Each
  round first checks that only the refused address inside is refused (else it stops).
- memory: ``--idle`` idle sandboxes without a network, deleted, then ``--idle`` with one;
  per sandbox for each: the memory charged to this benchmark's memory cgroup (the daemon, its
  sandboxes beneath it, and the kernel objects they allocate with accounting: netns, veth,
  sockets; other work on the machine is not in it) and of it kernel memory, the daemon's RSS,
  and the host's MemAvailable drop (moves with everything else on the machine); the
  difference is what a network costs.
The machine is shared: the load average is printed with the figures; compare the two sides
of each ratio, which ran side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_api import busybox_layer, pct, start_daemon

from edged.cgroups import fs as cgfs
from edged.client import Sandbox
from edged.config import Config
from edged.node.admission import kernel_bytes
from edged.node.hostmem import meminfo

ENV = {"PATH": "/bin"}
ALLOWED, REFUSED = "198.51.100.7", "203.0.113.9"  # TEST-NET-2 (a rule), TEST-NET-3 (none)
# UDP to the allowed range (the connect() timer's datagram sockets), TCP to a name
POLICY = {"allow": [{"rule": "198.51.100.0/24", "protocol": "udp"}, "bench.test"]}

# The connect() timer, run as a process of its own (it joins a namespace and a cgroup).
TIMER = r"""
import ctypes, json, os, socket, sys, time
pid, mnt, cg, n, allowed, refused = int(sys.argv[1]), *sys.argv[2:4], int(sys.argv[4]), \
    *sys.argv[5:7]
rounds = int(sys.argv[7])
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
assert libc.setns(fd, 0x40000000) == 0, ctypes.get_errno()
home = mnt + open("/proc/self/cgroup").read().split("0::", 1)[1].split()[0]
def run(addr):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect((addr, 9))
        except PermissionError:
            pass
        s.close()
    return (time.perf_counter_ns() - t0) / n
def refused_here(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((addr, 9))
        return False
    except PermissionError:
        return True
    finally:
        s.close()
def join(d):
    with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
out, wrong = {}, []
for _ in range(rounds):  # rounds alternate outside and inside: both see the same machine
    for where, d in (("outside", home), ("inside", cg)):
        join(d)
        for kind, addr in (("allowed", allowed), ("refused", refused)):
            k = f"{where}_{kind}"
            if refused_here(addr) != (k == "inside_refused"):  # the programs ran, or not
                wrong.append(k)
            out[k] = min(out.get(k, float("inf")), run(addr))
join(home)
print(json.dumps({"ns": out, "wrong": sorted(set(wrong))}))
"""


def create_first_exec(sock: str, digest: str, network: Any) -> float:
    t0 = time.perf_counter()
    s = Sandbox.create(layers=[digest], env=ENV, socket=sock, network=network)
    s.exec(["true"])
    dt = time.perf_counter() - t0
    s.kill()
    return dt


def creates(sock: str, digest: str, n: int) -> dict[str, list[float]]:
    for net in ("none", POLICY):  # warm-up: layer mount, pool, first namespace
        create_first_exec(sock, digest, net)
    out: dict[str, list[float]] = {"none": [], "network": []}
    for _ in range(n):
        out["none"].append(create_first_exec(sock, digest, "none"))
        out["network"].append(create_first_exec(sock, digest, POLICY))
    return out


def connect_cost(sock: str, digest: str, node: dict[str, Any], n: int,
                 rounds: int) -> dict[str, float]:
    cgroup_dir = node["features"]["network"]["cgroup_dir"]
    mnt = cgfs.v2_mount()
    assert mnt is not None  # the egress programs are attached (cgroup_dir is set)
    with Sandbox.create(layers=[digest], env=ENV, socket=sock, network=POLICY) as sbx:
        # the sandbox's processes are in its directory beneath cgroup_dir (hybrid: in it;
        # cgroup v2: in its init/); the timer joins the same v2 cgroup as sbx-init
        pid = min(cgfs.procs(Path(cgroup_dir, sbx.id)))
        own = Path(f"/proc/{pid}/cgroup").read_text().split("0::", 1)[1].split()[0]
        out = subprocess.run([sys.executable, "-c", TIMER, str(pid), str(mnt),
                              str(mnt) + own, str(n), ALLOWED, REFUSED, str(rounds)],
                             capture_output=True, text=True, check=True)
        t = json.loads(out.stdout)
    if t["wrong"]:  # a figure of programs that did not run (or ran outside) means nothing
        raise RuntimeError(f"connect() refused where it should not be, or not where it "
                           f"should: {t['wrong']}")
    return {k: v / 1e3 for k, v in t["ns"].items()}  # µs


def daemon_rss(pid: int) -> int:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) * 1024
    return 0


def own_memcg() -> Path:
    for ln in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctl, path = ln.split(":", 2)
        if "memory" in ctl.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return Path("/sys/fs/cgroup") / Path("/proc/self/cgroup").read_text().split("::")[1].strip()


def sample(pid: int) -> dict[str, int]:
    time.sleep(2.0)
    cg = own_memcg()
    mi = meminfo()
    out = {"host": -mi["MemAvailable"], "host_kernel": kernel_bytes(mi), "daemon_rss":
           daemon_rss(pid)}
    for name, f in (("cgroup", "memory.usage_in_bytes"), ("cgroup_kernel",
                                                             "memory.kmem.usage_in_bytes")):
        with contextlib.suppress(OSError):
            out[name] = int((cg / f).read_text())
    return out


def idle_memory(sock: str, digest: str, k: int, network: Any, pid: int) -> dict[str, float]:
    before = sample(pid)
    made = [Sandbox.create(layers=[digest], env=ENV, socket=sock, network=network)
            for _ in range(k)]
    after = sample(pid)
    for s in made:
        s.kill()
    return {f"{key}_kib_per_sandbox": (after[key] - before[key]) / k / 1024 for key in after}


def node_info(sock: str) -> dict[str, Any]:
    from edged.client._http import Transport

    return dict(Transport(sock).json("GET", "/v1/node"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=60, help="creates of each kind")
    ap.add_argument("--connects", type=int, default=5000, help="connect() calls per sample")
    ap.add_argument("--rounds", type=int, default=25, help="connect() samples of each kind")
    ap.add_argument("--idle", type=int, default=40, help="idle sandboxes of each kind")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_network: needs root", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="edged-bench-net-"))
    runtime = tempfile.mkdtemp(prefix="edged-bench-net-", dir="/run")
    prof = work / "net.toml"
    default = Path(__file__).resolve().parents[1] / "profiles/network/default.toml"
    prof.write_text(default.read_text().replace(
        "# static = {", 'static = { "bench.test" = ["198.51.100.8"] }\n# x = {'))
    store, digest = busybox_layer(work)
    cfg = Config(socket=str(work / "s.sock"), state_dir=str(work / "state"),
                 runtime_dir=runtime, store_dir=store, log_level="warning",
                 default_ttl_s=0.0, network_pool="10.216.0.0/22",
                 network_pool6="fd8e:dbe7:ed9e:b0::/64", network_prefix="bnet",
                 network_profile=str(prof))
    stop = start_daemon(cfg, in_process=False)
    try:
        pid = int(Path(runtime, "edged.pid").read_text().split()[0])
        node = node_info(cfg.socket)
        if not node["features"]["network"].get("enabled"):
            print(f"bench_network: networking is off: {node['features']['network']}",
                  file=sys.stderr)
            return 1
        c = creates(cfg.socket, digest, a.n)
        conn = connect_cost(cfg.socket, digest, node, a.connects, a.rounds)
        mem = {"none": idle_memory(cfg.socket, digest, a.idle, "none", pid),
               "network": idle_memory(cfg.socket, digest, a.idle, POLICY, pid)}
    finally:
        stop()
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    p50 = {k: statistics.median(v) * 1e3 for k, v in c.items()}
    p99 = {k: pct(v, 99) * 1e3 for k, v in c.items()}
    res = {
        "create_first_exec_ms": {"p50": p50, "p99": p99,
                                 "p50_added_by_network": p50["network"] - p50["none"],
                                 "p50_ratio": p50["network"] / p50["none"]},
        "connect_us": conn,
        "connect_us_added_by_programs": {
            "allowed": conn["inside_allowed"] - conn["outside_allowed"],
            "refused": conn["inside_refused"] - conn["outside_refused"]},
        "idle_memory": mem,
        "idle_memory_added_by_network_kib": {
            k: mem["network"][k] - mem["none"][k] for k in mem["none"]},
    }
    goals = {
        "create_p50_within_10ms": res["create_first_exec_ms"]["p50_added_by_network"] <= 10,
        "connect_within_5us": res["connect_us_added_by_programs"]["allowed"] <= 5,
    }
    load = os.getloadavg()
    if a.json:
        print(json.dumps({"results": res, "goals": goals, "params": vars(a),
                          "loadavg": load}, indent=2))
        return 0
    cr = res["create_first_exec_ms"]
    print(f"create→first exec, {a.n} of each, interleaved")
    print(f"{'':12}{'p50 ms':>9}{'p99 ms':>9}")
    for k in ("none", "network"):
        print(f"{k:12}{cr['p50'][k]:9.2f}{cr['p99'][k]:9.2f}")
    print(f"network adds {cr['p50_added_by_network']:.2f} ms at p50 "
          f"(x{cr['p50_ratio']:.2f})")
    print(f"\nUDP connect(), best of {a.rounds} rounds x {a.connects}, µs per call")
    print(f"{'':10}{'outside':>9}{'inside':>9}{'added':>9}")
    for k in ("allowed", "refused"):
        print(f"{k:10}{conn['outside_' + k]:9.2f}{conn['inside_' + k]:9.2f}"
              f"{res['connect_us_added_by_programs'][k]:9.2f}")
    print(f"\nidle sandboxes, {a.idle} of each, KiB per sandbox")
    print(f"{'':32}{'none':>9}{'network':>9}{'added':>9}")
    for k in mem["none"]:
        print(f"{k:32}{mem['none'][k]:9.0f}{mem['network'][k]:9.0f}"
              f"{res['idle_memory_added_by_network_kib'][k]:9.0f}")
    print(f"\nload average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for k, v in goals.items():
        print(f"goal {k}: {'met' if v else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
