"""``edged suite``: a real project's test suite in N sandboxes on one node, end to end.

1. Layers (:func:`edged.projects.build_project_image`): **base** from a Debian rootfs
   tarball; **workspace** with a real project's sdist from the package index at
   ``/work/<project>`` and the project installed with its test dependencies (read from its
   metadata, dependency groups, tox configuration or requirements files) into a venv at
   ``/work/.venv``; **toolkit** with pytest at ``/opt/toolkit``. The project's venv comes
   first on the path, so its versions of shared dependencies win.
2. A daemon (:class:`edged.daemon.Server`, real container backend) on a private socket and
   runtime dir; the image ``rollout/<project>:latest`` registered.
3. N sandboxes in parallel (SDK :class:`~edged.client.AsyncSandbox`), each running the
   project's tests; a per-sandbox table (create latency, run time, pass/fail counts, pytest's
   summary), why each red one failed, and totals. Everything is torn down at the end
   (sandboxes, daemon, layer mounts, its runtime dir and cgroups).

Exit status: 0 when every sandbox's tests passed, 1 when some did not, 2 when the project's
tests could not be run at all (the message says why: no such release, no sdist, no tests in
it, a build or a dependency that failed...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged.projects.errors import ProjectError
from edged.projects.image import DEFAULT_ROOTFS, ProjectImage, build_project_image

if TYPE_CHECKING:
    from edged.config import Config
    from edged.daemon import ServerThread

DEFAULT_PROJECT = "more-itertools==10.5.0"
_SUMMARY_RE = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")
#: pytest's exit codes (``pytest.ExitCode``).
_PYTEST_EXIT = {1: "tests failed", 2: "interrupted (errors during collection)",
                3: "pytest internal error", 4: "pytest usage error", 5: "no tests collected"}
_REASONS = {"timeout": "timed out", "oom": "killed: out of memory",
            "output_limit": "output over its limit", "signalled": "killed by a signal"}

log = logging.getLogger("edged.rollout")


@dataclass
class Outcome:
    """One sandbox of the batch. Times in seconds; counts from pytest's summary line;
    ``cause``: why it is not green ("" when it is)."""

    id: str
    create_s: float
    run_s: float
    exit_code: int | None
    reason: str
    passed: int
    failed: int
    skipped: int
    summary: str
    cause: str = ""

    @property
    def green(self) -> bool:
        """Exited 0 with some test passed and none failed."""
        return self.exit_code == 0 and self.failed == 0 and self.passed > 0


def parse_pytest(output: str) -> tuple[int, int, int, str]:
    """(passed, failed+errors, skipped, summary line) from pytest's last summary line."""
    lines = [x for x in output.strip().splitlines() if _SUMMARY_RE.search(x)]
    if not lines:
        return 0, 0, 0, ""
    last = lines[-1].strip("= ")
    counts: dict[str, int] = {}
    for n, kind in _SUMMARY_RE.findall(last):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    return (counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0),
            counts.get("skipped", 0), last)


def explain(stdout: str, stderr: str, exit_code: int | None, reason: str,
            max_lines: int = 3) -> str:
    """Why a test run is not green, in one line: the end (pytest's exit code, or a timeout,
    an OOM kill...), then the first ``max_lines`` of pytest's short summary (``ERROR``/
    ``FAILED`` lines, which name the test and the exception), else its ``E`` lines, else the
    last lines of output."""
    if reason != "exited":
        head = _REASONS.get(reason, reason)
    elif exit_code == 0:
        head = "no test passed"
    else:
        head = f"pytest exit {exit_code}: {_PYTEST_EXIT.get(exit_code or 0, 'error')}"
    lines = [re.sub(r"\s+", " ", x.strip()) for x in (stdout + "\n" + stderr).splitlines()
             if x.strip()]
    summary = [x for x in lines if x.startswith(("ERROR ", "FAILED "))]
    elines = [x for x in lines if x.startswith("E ")]
    if summary and all(" - " in x for x in summary):
        detail = summary  # "ERROR tests/t.py - ImportError: ..." names test and exception
    elif summary:  # a collection error's summary names only the file: add the exception
        detail = summary[:1] + elines[:1] + summary[1:]
    else:
        detail = elines or lines[-max_lines:]
    detail = list(dict.fromkeys(detail))
    more = f" (+{len(detail) - max_lines} more)" if len(detail) > max_lines else ""
    return f"{head}: {' | '.join(detail[:max_lines])}{more}" if detail else head


async def run_batch(socket: str, image: str, project_dir: str, env: dict[str, str],
                    argv: Sequence[str], n: int, parallel: int, timeout: float, cpus: float,
                    memory: int, output_dir: Path | None = None) -> list[Outcome]:
    """Run ``n`` sandboxes (``parallel`` at a time), each running ``argv`` in
    ``project_dir`` with ``env``; each run's whole stdout and stderr is saved as
    ``output_dir/<sandbox id>.log`` when ``output_dir`` is given."""
    from edged.client import AsyncSandbox

    sem = asyncio.Semaphore(parallel)
    run_id = uuid.uuid4().hex[:8]  # two rollouts on a node never share sandbox ids

    async def one(i: int) -> Outcome:
        async with sem:
            sid = f"rollout-{run_id}-{i}"
            t0 = time.monotonic()
            sbx = await AsyncSandbox.create(
                image=image, id=sid, cpus=cpus, memory_bytes=memory, timeout=timeout + 60,
                env=env, labels={"job": "rollout"}, socket=socket)
            create_s = time.monotonic() - t0
            try:
                t1 = time.monotonic()
                r = await sbx.exec(list(argv), cwd=project_dir, timeout=timeout,
                                   output_limit=16 << 20)
                run_s = time.monotonic() - t1
            finally:
                await sbx.kill()
                await sbx.close()
            if output_dir is not None:
                output_dir.mkdir(parents=True, exist_ok=True)
                (output_dir / f"{sid}.log").write_text(
                    f"$ {' '.join(argv)}  # in {project_dir}\n{r.stdout}\n"
                    f"--- stderr ---\n{r.stderr}\n--- end: {r.reason} {r.exit_code}\n")
            passed, failed, skipped, summary = parse_pytest(r.stdout)
            o = Outcome(sid, create_s, run_s, r.exit_code, r.reason, passed, failed,
                        skipped, summary or (r.stdout + r.stderr).strip()[-200:])
            if not o.green:
                o.cause = explain(r.stdout, r.stderr, r.exit_code, r.reason)
            return o

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def report(outcomes: list[Outcome], wall_s: float, image: ProjectImage) -> dict[str, Any]:
    """Totals of a batch (what ``--json`` prints)."""
    creates = [o.create_s for o in outcomes]
    runs = [o.run_s for o in outcomes]
    return {
        "project": image.requirement,
        "version": image.version,
        "layers": image.layers,
        "test_deps": {"sources": list(image.test_deps.sources),
                      "extras": list(image.test_deps.extras),
                      "requirements": list(image.test_deps.requirements),
                      "skipped": list(image.test_deps.skipped)},
        "workspace_dists": image.workspace_dists,
        "toolkit_dists": image.toolkit_dists,
        "toolkit_pytest_used": image.pytest_pinned,
        "sandboxes": len(outcomes),
        "succeeded": sum(o.green for o in outcomes),
        "tests_passed": sum(o.passed for o in outcomes),
        "tests_failed": sum(o.failed for o in outcomes),
        "create_s": {"p50": statistics.median(creates), "p99": _pct(creates, 99),
                     "max": max(creates)},
        "run_s": {"p50": statistics.median(runs), "max": max(runs)},
        "wall_s": wall_s,
        "outcomes": [asdict(o) for o in outcomes],
    }


def format_table(outcomes: Sequence[dict[str, Any]]) -> list[str]:
    """The per-sandbox table: columns as wide as their widest cell (ids of any length),
    numbers right-aligned, pytest's summary whole in the last column."""
    header = ("SANDBOX", "CREATE", "RUN", "EXIT", "PASS", "FAIL", "SUMMARY")
    rows = [header]
    for o in outcomes:
        code = o["exit_code"] if o["exit_code"] is not None else o["reason"]
        rows.append((o["id"], f"{o['create_s'] * 1000:.1f}ms", f"{o['run_s']:.2f}s", str(code),
                     str(o["passed"]), str(o["failed"]), o["summary"].replace("\n", " ")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:],
                                                                       strict=True)]
        out.append(("  ".join(cells) + "  " + r[-1]).rstrip())
    return out


def print_human(rep: dict[str, Any]) -> None:
    """The per-sandbox table, why the red ones failed (one line per distinct cause), and the
    totals."""
    for line in format_table(rep["outcomes"]):
        print(line)
    causes: dict[str, list[str]] = {}
    for o in rep["outcomes"]:
        if o["cause"]:
            causes.setdefault(o["cause"], []).append(o["id"])
    if causes:
        print()
    for cause, ids in causes.items():
        print(f"why {', '.join(ids)}: {cause}")
    c, r = rep["create_s"], rep["run_s"]
    print(f"\n{rep['project']}: {rep['succeeded']}/{rep['sandboxes']} sandboxes green, "
          f"{rep['tests_passed']} tests passed, {rep['tests_failed']} failed; "
          f"create p50 {c['p50'] * 1000:.1f} ms, p99 {c['p99'] * 1000:.1f} ms; "
          f"run p50 {r['p50']:.2f} s; wall {rep['wall_s']:.1f} s")


def _mounts_under(path: str) -> list[str]:
    """Mount points at or below ``path`` (from /proc/self/mountinfo, octal escapes undone)."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if mp == real or mp.startswith(real.rstrip("/") + "/"):
                out.append(mp)
    return out


def remove_runtime_dir(path: str) -> bool:
    """Remove the rollout daemon's runtime dir and what the daemon left in it (its pid file,
    the compiled policy cache, empty layer and sandbox dirs). Never through a mount: if
    anything is still mounted at or below ``path``, nothing is removed and the mounts are
    logged. Returns True when the dir is gone."""
    mounts = _mounts_under(path)
    if mounts:
        log.warning("runtime dir %s kept: still mounted there: %s", path, ", ".join(mounts))
        return False
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("runtime dir %s not removed: %s", path, e)
        return False
    return True


def _remove_cgroup_subtree(runtime_dir: str) -> None:
    """Remove the (now empty) cgroup parents the container backend made for ``runtime_dir``
    (``edged-<sha256(path)[:10]>`` under each hierarchy), so a rollout leaves nothing."""
    import hashlib

    name = "edged-" + hashlib.sha256(str(Path(runtime_dir).resolve()).encode()).hexdigest()[:10]
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        if name in dirnames:
            try:
                os.rmdir(os.path.join(dirpath, name))
            except OSError as e:
                log.warning("cgroup %s/%s not removed: %s", dirpath, name, e)
        if dirpath.count("/") > 6:
            dirnames.clear()


def _logging() -> None:
    """Progress of the rollout and of the layer builds on stderr, ``rollout: ...``."""
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("rollout: %(message)s"))
    for name in ("edged.rollout", "edged.projects"):
        lg = logging.getLogger(name)
        if not lg.handlers:
            lg.addHandler(h)
        lg.setLevel(logging.INFO)


@contextlib.contextmanager
def private_daemon(work: Path, store: str | None, runtime_dir: str | None,
                   ) -> Iterator[tuple[ServerThread, Config]]:
    """A daemon of a job's own (real container backend) on a socket and state dir under
    ``work`` and a private runtime dir (two jobs at once must not share one: the second
    daemon's recovery would tear down the first's sandboxes), stopped at the end with all
    it made: sandboxes, layer mounts, the cgroup subtree the backend keys on the runtime
    dir, and the runtime dir itself (unless ``runtime_dir`` was given)."""
    from edged.config import Config
    from edged.daemon import Server, ServerThread

    rt = runtime_dir or tempfile.mkdtemp(
        prefix="edged-rollout-", dir="/run" if os.access("/run", os.W_OK) else None)
    cfg = Config(socket=str(work / "edged.sock"), state_dir=str(work / "state"),
                 runtime_dir=rt, store_dir=store or "", on_shutdown="stop", default_ttl_s=0.0)
    node = ServerThread(Server(cfg), name="edged")
    try:
        node.start()
        yield node, cfg
    finally:
        try:
            node.stop(120)
        finally:
            _remove_cgroup_subtree(rt)
            if runtime_dir is None:
                remove_runtime_dir(rt)


def _run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    image = build_project_image(a.project, work=work, rootfs=a.rootfs, store_dir=a.store,
                                extra_test_deps=a.test_dep)
    with private_daemon(work, a.store, a.runtime_dir) as (node, cfg):
        server = node.server
        assert server.manager is not None
        ref = f"rollout/{image.name}:latest"
        server.manager.images.put(ref, image.lowers)
        log.info("daemon up; running %d sandboxes of %s, %d at a time", a.n, ref, a.parallel)
        t0 = time.monotonic()
        outcomes = asyncio.run(run_batch(cfg.socket, ref, image.project_dir, image.env,
                                         image.test_argv, a.n, a.parallel, a.timeout,
                                         a.cpus, a.memory, a.output_dir))
        return report(outcomes, time.monotonic() - t0, image)


def main(argv: list[str] | None = None) -> int:
    """``edged suite``; returns 0 if every sandbox's tests passed, 1 if some did not, 2 if
    the project's tests could not be run (the error says why)."""
    p = argparse.ArgumentParser(prog="edged suite", description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=4, help="sandboxes (default 4)")
    p.add_argument("--parallel", type=int, default=4, help="at a time (default 4)")
    p.add_argument("--project", default=DEFAULT_PROJECT,
                   help=f"NAME or NAME==VERSION on the package index (default {DEFAULT_PROJECT})")
    p.add_argument("--test-dep", action="append", default=[],
                   help="extra test dependency for the project's environment (repeatable)")
    p.add_argument("--rootfs", default=DEFAULT_ROOTFS, help="Debian rootfs tarball")
    p.add_argument("--store", default=None, help="layerfs store (default layerfs's)")
    p.add_argument("--timeout", type=float, default=600.0, help="per test run, seconds")
    p.add_argument("--cpus", type=float, default=1.0)
    p.add_argument("--memory", type=int, default=1 << 30, help="bytes per sandbox")
    p.add_argument("--runtime-dir", default=None,
                   help="the rollout daemon's runtime dir (layer mounts, sandbox state); "
                        "default: a private one made for this run under /run, removed after")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="save each sandbox's whole test output as DIR/<sandbox>.log")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    _logging()
    try:
        with tempfile.TemporaryDirectory(prefix="edged-rollout-") as tmp:
            rep = _run(a, Path(tmp))
    except ProjectError as e:
        if a.json:
            print(json.dumps({"project": a.project,
                              "error": {"code": e.code, "message": e.message}}, indent=2))
        else:
            print(f"edged suite: {a.project}: tests cannot run ({e.code}): {e.message}",
                  file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print_human(rep)
    return 0 if rep["succeeded"] == rep["sandboxes"] else 1
