"""Overhead of confinement, confined vs unconfined in the same run.

Measures: compiling the default seccomp profile (once per profile; cached after), building and
serialising the protected-path Landlock ruleset, applying Landlock + capabilities + seccomp in
a fresh child, and a syscall-heavy workload (``dd bs=1``: one read and one write syscall per
byte, so every syscall walks the filter) run unconfined and confined.

    .venv/bin/python bench/bench_confinement.py [--bytes N] [--rounds R] [--json]

As root, also through real container sandboxes (busybox rootfs, the container backend):
create->ready latency (spawner + sbx-init answering its hello) with the default task profile
vs none (unconfined: no read-only mounts, capability drop, Landlock or seccomp), an exec's
round trip (``true``), and ``dd bs=1`` inside the sandbox, each exec confined by Landlock and
seccomp vs not. ``--no-sandboxes`` skips that part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from edged.security import confine, landlock, seccomp, tasks


def _child(cmd: list[str], prog: bytes | None, blob: bytes | None) -> float:
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            if blob is not None:
                confine.apply_landlock(blob)
                confine.restrict_caps()
            if prog is not None:
                confine.install_seccomp(prog, listener=False)
            os.execv(cmd[0], cmd)
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd} failed: {status}")
    return time.perf_counter() - t0


def _busybox_root(d: Path) -> Path:
    bb = shutil.which("busybox") or "/bin/busybox"
    (d / "bin").mkdir(parents=True)
    shutil.copy2(bb, d / "bin" / "busybox")
    for a in subprocess.run([bb, "--list"], capture_output=True, text=True,
                            check=True).stdout.split():
        if a != "busybox":
            (d / "bin" / a).symlink_to("busybox")
    (d / "etc").mkdir()
    (d / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\n")
    os.chmod(d, 0o755)
    return d


async def _sandbox_rows(nbytes: int, rounds: int) -> dict[str, dict[str, float]]:
    from edged.backends.base import ExecEnd, ExecSpec, Resources, SandboxSpec
    from edged.backends.container import ContainerBackend

    tmp = Path(tempfile.mkdtemp(prefix="bench-confine-"))
    env = {"PATH": "/bin"}
    try:
        root = _busybox_root(tmp / "root")
        b = ContainerBackend(tmp / "state")

        async def run(sid: str, argv: tuple[str, ...]) -> float:
            t0 = time.perf_counter()
            h = await b.exec(sid, ExecSpec(argv=argv, env=env))
            async for ev in h.events():
                if isinstance(ev, ExecEnd) and ev.exit_code != 0:
                    raise RuntimeError(f"{argv}: {ev}")
            return time.perf_counter() - t0

        times: dict[str, dict[str, list[float]]] = {}

        def add(label: str, kind: str, v: float) -> None:
            times.setdefault(label, {"unconfined": [], "confined": []})[kind].append(v)

        dd = ("dd", "if=/dev/zero", "of=/dev/null", "bs=1", f"count={nbytes}")
        for i in range(rounds):
            for kind, profile in (("unconfined", None), ("confined", "default")):
                sid = f"{kind[0]}{i}"
                spec = SandboxSpec(id=sid, lowers=(str(root),), resources=Resources(), env=env,
                                   hostname=sid, task_profile=profile)
                t0 = time.perf_counter()
                await b.create(spec)
                add("create->ready", kind, time.perf_counter() - t0)
                try:
                    await run(sid, ("true",))  # warm
                    add("exec true (round trip)", kind, await run(sid, ("true",)))
                    add(f"exec dd bs=1 x{nbytes}", kind, await run(sid, dd))
                finally:
                    await b.destroy(sid)
        await b.close()
        for parent in b.cgroups.parents.values():  # our subtree, empty by now
            if parent.exists():
                parent.rmdir()
        return {label: {"unconfined_s": statistics.median(v["unconfined"]),
                        "confined_s": statistics.median(v["confined"]),
                        "ratio": statistics.median(v["confined"]) /
                        statistics.median(v["unconfined"])}
                for label, v in times.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=300_000, help="dd bs=1 count (syscalls / 2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-sandboxes", action="store_true",
                    help="skip the container sandbox measurements (they need root)")
    a = ap.parse_args()

    prof = seccomp.load()
    t0 = time.perf_counter()
    seccomp._compile_cached.cache_clear()
    prog = prof.compile("errno")
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    blob = tasks.load().landlock_ruleset(["/"]).serialize()
    landlock_s = time.perf_counter() - t0

    dd = ["/bin/dd", "if=/dev/zero", "of=/dev/null", "bs=1", f"count={a.bytes}"]
    true = ["/bin/true"]
    rows = {}
    for label, cmd in (("spawn /bin/true", true), (f"dd bs=1 x{a.bytes}", dd)):
        base, conf = [], []
        for _ in range(a.rounds):  # interleaved, so drift hits both alike
            base.append(_child(cmd, None, None))
            conf.append(_child(cmd, prog, blob))
        b, c = statistics.median(base), statistics.median(conf)
        rows[label] = {"unconfined_s": b, "confined_s": c, "ratio": c / b}
    sandboxes: dict[str, Any] = {}
    if not a.no_sandboxes and os.geteuid() == 0:
        sandboxes = asyncio.run(_sandbox_rows(a.bytes, a.rounds))
    out = {
        "seccomp_compile_s": compile_s,
        "seccomp_insns": len(prog) // 8,
        "landlock_ruleset_s": landlock_s,
        "landlock_abi": landlock.abi(),
        "workloads": rows,
        "sandboxes": sandboxes,
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"seccomp compile (once per profile): {compile_s * 1e3:.2f} ms, "
          f"{out['seccomp_insns']} BPF instructions")
    print(f"landlock ruleset build+serialise:   {landlock_s * 1e3:.2f} ms (ABI {landlock.abi()})")
    print(f"{'workload':<24}{'unconfined':>12}{'confined':>12}{'ratio':>8}")
    for label, r in rows.items():
        print(f"{label:<24}{r['unconfined_s'] * 1e3:>10.2f}ms{r['confined_s'] * 1e3:>10.2f}ms"
              f"{r['ratio']:>8.2f}")
    if sandboxes:
        print(f"\n{'container sandbox':<28}{'unconfined':>12}{'confined':>12}{'ratio':>8}")
        for label, r in sandboxes.items():
            print(f"{label:<28}{r['unconfined_s'] * 1e3:>10.2f}ms"
                  f"{r['confined_s'] * 1e3:>10.2f}ms{r['ratio']:>8.2f}")


if __name__ == "__main__":
    main()
