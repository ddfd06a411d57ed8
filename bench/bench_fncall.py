"""FnCall throughput and latency through the daemon (``POST /v1/fncalls`` on its Unix
socket), 16 calls in flight, against a cold ``python3 -c`` in a fresh container (create,
exec, delete: what a call costs without a warm pool) in the same run.

    .venv/bin/python bench/bench_fncall.py [--inflight 16] [--pool 8] [--n 400] [--json]
                                           [--rows python,python_1,cpp,cpp_cases,true,cold]
                                           [--ref REV [--rounds 2]]

Needs root and the FnCall image's rootfs (``scripts/fncall-rootfs.sh``: Debian minbase with
python3, gcc, g++), built into a layer once (cached in ``--store``). The daemon runs as a
process of its own (``edged serve --fncall-layers ...``, pool of ``--pool`` sandboxes), the
clients are ``--inflight`` threads here, each with its own keep-alive connection. Rows:

- ``python``: ``print(i)`` in Python (the pool's warm interpreter forks a child per call);
  goal >= 200 calls/s, p50 <= 20 ms; ``python_1``: the same, one call in flight (a call's
  own latency: at 16 in flight the p50 is mostly queueing, about 16 / rate by Little's law);
- ``cpp``: a tiny C++ program (a + b) compiled once (kept), then run once per call naming
  the kept result, one case each; goal >= 500 runs/s; ``cpp_cases``: the same, 100 cases in
  one request;
- ``true``: ``/bin/true`` (``argv``); goal >= 800 calls/s (go-judge's single-thread figure);
- ``cold``: ``python3 -c 'print(1)'`` in a fresh container per call, same image, same
  concurrency (the baseline; each ratio is a row's rate over this one's).

``--ref REV``: this tree against an earlier commit of it in the same run: REV is checked out
(``git worktree add --detach``, removed at the end) with this tree's built C binaries
(``edged/_bin``, the cffi modules: refused unless ``csrc/`` is the same at REV), and
``--rounds`` times the rows run against REV's daemon and this tree's, in turns (REV first in
odd rounds); printed per row: each tree's median rate and p50, and this tree's over REV's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from edged.client._http import UnixConnection

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TAR = Path(os.environ.get("EDGED_TEST_CACHE", "/var/cache/edged-test")) / "fncall-rootfs.tar"
ADD = ("#include <cstdio>\n"
       "int main(){long a,b;if(scanf(\"%ld %ld\",&a,&b)==2)printf(\"%ld\\n\",a+b);}\n")


ROWS = {"python", "python_1", "cpp", "cpp_cases", "true", "cold"}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


class Conn(UnixConnection):
    """A keep-alive HTTP connection to the daemon's Unix socket."""

    def __init__(self, path: str) -> None:
        super().__init__(path, timeout=300)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        self.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"})
        r = self.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None


def layer(store: Path) -> str:
    """The FnCall image's layer digest (built into ``store`` once)."""
    from layerfs.build import build_layer
    from layerfs.store import Store

    marker = store / "fncall-layer"
    if marker.exists():
        return marker.read_text().strip()
    if not TAR.exists():
        raise SystemExit(f"bench_fncall: {TAR} missing: run scripts/fncall-rootfs.sh")
    digest = build_layer(str(TAR), kind="base", store=Store(str(store))).digest
    marker.write_text(digest)
    return digest


def start_daemon(argv: list[str], sock: str, tree: Path = ROOT
                 ) -> tuple[Callable[[], None], int]:
    """``edged serve ARGV`` as a process of its own (the ``edged`` package of ``tree``),
    once it answers on ``sock``: (a function that stops it, its pid)."""
    proc = subprocess.Popen([sys.executable, "-c",
                             "import sys; from edged.cli import main; sys.exit(main())",
                             "serve", *argv], cwd=str(tree))
    deadline = time.monotonic() + 60
    while True:
        try:
            c = Conn(sock)
            if c.call("GET", "/v1/node")[0] == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("bench_fncall: the daemon did not start")
        time.sleep(0.1)

    def stop() -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return stop, proc.pid


def load(sock: str, inflight: int, n: int, one: Callable[[Conn, int], float | None]
         ) -> dict[str, float]:
    """``n`` operations over ``inflight`` threads; each returns its latency (None:
    failed). Rate, p50, p99."""
    lat: list[float] = []
    failed = [0]
    lock = threading.Lock()
    counter = iter(range(n))

    def worker() -> None:
        c = Conn(sock)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t = one(c, i)
            with lock:
                if t is None:
                    failed[0] += 1
                else:
                    lat.append(t)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(inflight) as ex:
        for f in [ex.submit(worker) for _ in range(inflight)]:
            f.result()
    wall = time.perf_counter() - t0
    return {"per_s": len(lat) / wall, "p50_ms": pct(lat, 50) * 1e3 if lat else 0.0,
            "p99_ms": pct(lat, 99) * 1e3 if lat else 0.0, "n": len(lat), "failed": failed[0]}


def fncall(body: Callable[[int], dict[str, Any]], check: Callable[[dict[str, Any], int], bool]
           ) -> Callable[[Conn, int], float | None]:
    def one(c: Conn, i: int) -> float | None:
        t = time.perf_counter()
        status, rep = c.call("POST", "/v1/fncalls", body(i))
        dt = time.perf_counter() - t
        return dt if status == 200 and check(rep, i) else None
    return one


def cold(digest: str) -> Callable[[Conn, int], float | None]:
    """A fresh container per call: create, exec ``python3 -c``, delete."""
    def one(c: Conn, i: int) -> float | None:
        t = time.perf_counter()
        status, _ = c.call("POST", "/v1/sandboxes", {"layers": [digest], "id": f"cold-{i}",
                                                       "resources": {"memory_bytes": 256 << 20}})
        if status != 201:
            return None
        try:
            c.request("POST", f"/v1/sandboxes/cold-{i}/exec",
                      json.dumps({"argv": ["python3", "-c", f"print({i})"]}),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            out = r.read().decode()
            ok = r.status == 200 and f'"stdout": "{i}\\n"' in out
        finally:
            c.call("DELETE", f"/v1/sandboxes/cold-{i}")
        return time.perf_counter() - t if ok else None
    return one


def measure(tree: Path, args: argparse.Namespace, want: set[str], digest: str
            ) -> dict[str, dict[str, float]]:
    """The rows ``want`` against a daemon of ``tree``'s."""
    run = Path(tempfile.mkdtemp(prefix="edged-bench-fncall-", dir="/run"))
    sock = str(run / "s.sock")
    stop, _ = start_daemon(["--socket", sock, "--state-dir", str(run / "state"), "--runtime-dir",
                         str(run), "--store-dir", args.store, "--log-level", "warning",
                         "--fncall-layers", digest, "--fncall-pool", str(args.pool),
                         "--layer-linger-s", "60"], sock, tree)
    rows: dict[str, dict[str, float]] = {}
    try:
        c = Conn(sock)
        status, warm = c.call("POST", "/v1/fncalls", {"argv": ["/bin/true"]})
        assert status == 200, warm
        status, comp = c.call("POST", "/v1/fncalls", {"language": "cpp", "source": ADD,
                                                      "keep": True, "stdin": "1 2"})
        assert status == 200 and comp["results"][0]["stdout"] == "3\n", comp
        art = comp["artifact"]["id"]
        k = args.inflight
        # a warm-up round, so every pool sandbox is up
        load(sock, k, 2 * args.pool, fncall(lambda i: {"argv": ["/bin/true"]},
                                            lambda r, i: True))
        if "python" in want:
            rows["python"] = load(sock, k, args.n, fncall(
                lambda i: {"language": "python", "source": f"print({i})"},
                lambda r, i: r["results"][0]["stdout"] == f"{i}\n"))
        if "python_1" in want:
            rows["python_1"] = load(sock, 1, max(20, args.n // 4), fncall(
                lambda i: {"language": "python", "source": f"print({i})"},
                lambda r, i: r["results"][0]["stdout"] == f"{i}\n"))
        if "cpp" in want:
            rows["cpp"] = load(sock, k, args.n, fncall(
                lambda i: {"artifact": art, "stdin": f"{i} 1"},
                lambda r, i: r["results"][0]["stdout"] == f"{i + 1}\n"))
        if "cpp_cases" in want:
            t = time.perf_counter()
            status, many = c.call("POST", "/v1/fncalls", {"artifact": art, "cases": [
                {"stdin": f"{i} 2"} for i in range(100)]})
            dt = time.perf_counter() - t
            good = status == 200 and [r["stdout"] for r in many["results"]] == [
                f"{i + 2}\n" for i in range(100)]
            rows["cpp_cases"] = {"per_s": 100 / dt if good else 0.0, "p50_ms": dt * 1e3,
                                 "p99_ms": dt * 1e3, "n": 100 if good else 0,
                                 "failed": 0 if good else 1}
        if "true" in want:
            rows["true"] = load(sock, k, 2 * args.n, fncall(
                lambda i: {"argv": ["/bin/true"]}, lambda r, i: r["results"][0]["status"] ==
                "Accepted"))
        if "cold" in want:
            rows["cold"] = load(sock, k, max(16, args.n // 8), cold(digest))
    finally:
        stop()
        shutil.rmtree(run, ignore_errors=True)
    return rows


def checkout(rev: str) -> Path:
    """REV in a worktree of its own, with this tree's built binaries (same C sources)."""
    if subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", "csrc"]).returncode:
        raise SystemExit(f"bench_fncall: csrc/ differs at {rev}: its binaries would need "
                         "a build of their own")
    tree = Path(tempfile.mkdtemp(prefix="edged-bench-fncall-ref-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev],
                   check=True)
    shutil.copytree(ROOT / "edged" / "_bin", tree / "edged" / "_bin", dirs_exist_ok=True)
    for so in [*ROOT.glob("edged/*.so"), *ROOT.glob("layerfs/*.so")]:
        shutil.copy2(so, tree / so.relative_to(ROOT))
    return tree


def remove_checkout(tree: Path) -> None:
    """Undo :func:`checkout`."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                   check=False)
    shutil.rmtree(tree, ignore_errors=True)


T = TypeVar("T")


def in_turns(rev: str, rounds: int, run: Callable[[Path], T]) -> dict[str, list[T]]:
    """``run(tree)`` for REV's tree (:func:`checkout`) and this one, ``rounds`` times each,
    in turns (REV first in odd rounds, so drift in the load favours neither): {"ref": [...],
    "this": [...]}."""
    tree = checkout(rev)
    got: dict[str, list[T]] = {"ref": [], "this": []}
    try:
        for r in range(rounds):
            for who in (("ref", "this") if r % 2 == 0 else ("this", "ref")):
                got[who].append(run(tree if who == "ref" else ROOT))
    finally:
        remove_checkout(tree)
    return got


def compare(args: argparse.Namespace, want: set[str], digest: str, load0: float) -> int:
    """``--ref``: the rows against REV's daemon and this tree's, in turns."""
    got = in_turns(args.ref, args.rounds, lambda tree: measure(tree, args, want, digest))
    out: dict[str, Any] = {"ref": args.ref, "rounds": args.rounds, "rows": {},
                           "loadavg_1min": [load0, os.getloadavg()[0]],
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": got}
    for name in sorted(got["this"][0]):
        row = {}
        for fig in ("per_s", "p50_ms"):
            ref = statistics.median(run[name][fig] for run in got["ref"])
            this = statistics.median(run[name][fig] for run in got["this"])
            row[fig] = {"ref": ref, "this": this, "this_over_ref": this / ref if ref else None}
        out["rows"][name] = row
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"this tree against {args.ref}, median of {args.rounds} turns each")
    print(f"{'row':10} {'per s ref':>10} {'this':>8} {'x':>6} {'p50 ref':>9} {'this':>8} {'x':>6}")
    for name, row in out["rows"].items():
        a, b = row["per_s"], row["p50_ms"]
        print(f"{name:10} {a['ref']:10.1f} {a['this']:8.1f} {a['this_over_ref'] or 0:6.2f} "
              f"{b['ref']:9.2f} {b['this']:8.2f} {b['this_over_ref'] or 0:6.2f}")
    print(f"load average (1 min) before/after: {load0:.2f} / {os.getloadavg()[0]:.2f}; "
          f"{args.inflight} in flight, pool {args.pool}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--pool", type=int, default=8)
    ap.add_argument("--n", type=int, default=400, help="calls per row (cold: n/8)")
    ap.add_argument("--store", default="/var/tmp/edged-bench-fncall-store")
    ap.add_argument("--rows", default=",".join(sorted(ROWS)),
                    help="the rows to run, comma-separated (without cold: no ratios)")
    ap.add_argument("--ref", default=None, help="an earlier commit to run against, in turns")
    ap.add_argument("--rounds", type=int, default=2, help="with --ref: turns of each tree")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    want = set(args.rows.split(","))
    if want - ROWS:
        raise SystemExit(f"bench_fncall: no such row: {', '.join(sorted(want - ROWS))}")
    if os.geteuid() != 0:
        raise SystemExit("bench_fncall: needs root")
    store = Path(args.store)
    store.mkdir(parents=True, exist_ok=True)
    digest = layer(store)
    load0 = os.getloadavg()[0]
    if args.ref:
        return compare(args, want, digest, load0)
    rows = measure(ROOT, args, want, digest)
    base = rows.get("cold", {}).get("per_s") or float("nan")
    goals = {"python": (200, 20), "python_1": (0, 20), "cpp": (500, None), "true": (800, None)}
    out = {"rows": rows, "ratio_over_cold": {k: v["per_s"] / base for k, v in rows.items()},
           "goals": {k: {"per_s": g[0], "p50_ms": g[1]} for k, g in goals.items()},
           "inflight": args.inflight, "pool": args.pool,
           "loadavg_1min": [load0, os.getloadavg()[0]],
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{'row':10} {'per s':>9} {'p50 ms':>8} {'p99 ms':>8} {'n':>5} {'failed':>6}"
          f" {'x cold':>7}  goal")
    for name, r in rows.items():
        g = goals.get(name)
        goal = "" if g is None else ", ".join(
            ([f">= {g[0]}/s"] if g[0] else []) + ([f"p50 <= {g[1]} ms"] if g[1] else []))
        print(f"{name:10} {r['per_s']:9.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['n']:5.0f}"
              f" {r['failed']:6.0f} {out['ratio_over_cold'][name]:7.1f}  {goal}")
    print(f"load average (1 min) before/after: {load0:.2f} / {os.getloadavg()[0]:.2f}; "
          f"{args.inflight} in flight, pool {args.pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
