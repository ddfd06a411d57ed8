"""This tree against an earlier commit of it, in the same run: create→first-exec latency and
exec round trips (`bench_create.py`, the container backend directly; `bench_api.py`, through
the daemon and the SDK), each tree running its own copy of both benchmarks, in turns.

    .venv/bin/python bench/bench_tree.py --ref REV [--rounds 2] [--n 100] [--execs 300]
                                         [--qos latency_sensitive] [--keep DIR] [--json]

Needs root. REV is cloned from this checkout into a temporary directory (``--keep DIR``:
there, and kept, so that a second run skips the build) and installed by its own
``scripts/install.sh`` (its own .venv and C core: a few minutes). Then, ``--rounds`` times,
REV's benchmarks and this tree's run one after the other (REV first in odd rounds, this tree
first in even ones, so drift in the machine's load does not favour one). Printed per figure:
the median over the rounds for each tree and this tree's over REV's (above 1: this tree is
slower or, for rates, faster). The sandboxes run ``latency_sensitive`` by default: the
daemon's default class, ``best_effort``, yields the CPU to every other process (SCHED_IDLE),
so on a shared machine it would measure the others' load against a tree from before the
classes, whose sandboxes ran at normal weight. Issue 10 asks for it with REV the commit before the
restructuring (`1440189`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent

#: (figure, where in the benchmark's --json output; rate: higher is better)
FIGURES: list[tuple[str, str, tuple[str, ...], bool]] = [
    ("create→exec p50 ms (backend)", "create", ("results", "edged", "p50_ms"), False),
    ("create→exec p99 ms (backend)", "create", ("results", "edged", "p99_ms"), False),
    ("creates/s (backend, 4 at once)", "create", ("results", "edged", "creates_per_s"), True),
    ("exec RT p50 ms (backend)", "create", ("results", "edged", "exec_roundtrip_p50_ms"),
     False),
    ("after idle create→exec p50 ms", "create", ("results", "edged", "after_idle_p50_ms"),
     False),
    ("create→exec p50 ms (API)", "api", ("api", "create_first_exec_p50_ms"), False),
    ("exec RT p50 ms (API)", "api", ("api", "exec_roundtrip_p50_ms"), False),
    ("exec RT p99 ms (API)", "api", ("api", "exec_roundtrip_p99_ms"), False),
    ("cycles/s (API)", "api", ("api", "cycles_per_s"), True),
]


def prepare(ref: str, keep: Path | None) -> Path:
    """A checkout of ``ref`` with its .venv and C core built (in ``keep`` when given: a clone
    there is reused)."""
    tree = keep if keep is not None else Path(tempfile.mkdtemp(prefix="edged-bench-tree-"))
    if not (tree / ".git").exists():
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(HERE), str(tree)],
                       check=True)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", ref], check=True)
    subprocess.run(["bash", "scripts/install.sh"], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL)  # idempotent: quick where it was done
    return tree


def run(tree: Path, bench: str, args: list[str], qos: str | None) -> dict[str, Any]:
    """One benchmark of ``tree``'s, run by ``tree``'s interpreter; its --json output.
    ``qos`` goes to a benchmark that takes ``--qos`` (a tree from before the CPU classes
    has none: its sandboxes ran at normal CPU weight, as ``latency_sensitive`` ones do)."""
    py = str(tree / ".venv/bin/python")
    if qos is not None and "--qos" in subprocess.run(
            [py, f"bench/{bench}", "--help"], cwd=tree, capture_output=True, text=True).stdout:
        args = [*args, "--qos", qos]
    out = subprocess.run([py, f"bench/{bench}", *args, "--json"],
                         cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"bench_tree: {tree}'s bench/{bench} {' '.join(args)} failed "
                 f"({out.returncode}):\n{out.stderr[-4000:]}")
    return dict(json.loads(out.stdout))


def dig(d: dict[str, Any], path: tuple[str, ...]) -> float:
    v: Any = d
    for k in path:
        v = v[k]
    return float(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="the earlier commit to hold this tree against")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", type=int, default=100, help="sandboxes per creates/s and API cycles")
    ap.add_argument("--execs", type=int, default=300, help="exec round trips (API)")
    ap.add_argument("--keep", type=Path, help="clone and build REV here, and keep it")
    ap.add_argument("--qos", default="latency_sensitive",
                    help="the sandboxes' CPU class where a tree has classes (default "
                         "latency_sensitive: what every sandbox was before them; 'daemon': "
                         "each benchmark's own default)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_tree: needs root")
    qos = None if a.qos == "daemon" else a.qos
    old = prepare(a.ref, a.keep)
    trees = {"ref": old, "this": HERE}
    samples: dict[str, dict[str, list[float]]] = {t: {f[0]: [] for f in FIGURES} for t in trees}
    loads = [os.getloadavg()[0]]
    try:
        for r in range(a.rounds):
            for t in (("ref", "this") if r % 2 == 0 else ("this", "ref")):
                got = {"create": run(trees[t], "bench_create.py", ["--n", str(a.n)], qos),
                       "api": run(trees[t], "bench_api.py",
                                  ["--n", str(a.n), "--execs", str(a.execs)], qos)}
                for name, bench, path, _ in FIGURES:
                    samples[t][name].append(dig(got[bench], path))
                loads.append(os.getloadavg()[0])
    finally:
        if a.keep is None:
            shutil.rmtree(old, ignore_errors=True)
    head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    table = {name: {"ref": statistics.median(samples["ref"][name]),
                    "this": statistics.median(samples["this"][name]), "rate": rate}
             for name, _, _, rate in FIGURES}
    for v in table.values():
        v["this_over_ref"] = v["this"] / v["ref"] if v["ref"] else float("nan")
    if a.json:
        print(json.dumps({"ref": a.ref, "this": head, "rounds": a.rounds, "n": a.n, "qos": a.qos,
                          "figures": table, "samples": samples, "loadavg_1min": loads},
                         indent=2))
        return 0
    print(f"this tree ({head}) against {a.ref}, median of {a.rounds} rounds, n={a.n}, "
          f"qos {a.qos}")
    print(f"{'figure':<34}{a.ref[:12]:>12}{head[:12]:>12}{'this/ref':>10}")
    for name, v in table.items():
        print(f"{name:<34}{v['ref']:>12.2f}{v['this']:>12.2f}{v['this_over_ref']:>10.2f}")
    print(f"load average (1 min) before and after each run: "
          f"{' '.join(f'{x:.1f}' for x in loads)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
