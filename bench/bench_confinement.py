"""Overhead of confinement, confined vs unconfined in the same run.

Measures: compiling the default seccomp profile (once per profile; cached after), building and
serialising the protected-path Landlock ruleset, applying Landlock + capabilities + seccomp in
a fresh child, and a syscall-heavy workload (``dd bs=1``: one read and one write syscall per
byte, so every syscall walks the filter) run unconfined and confined.

    .venv/bin/python bench/bench_confinement.py [--bytes N] [--rounds R] [--json]

Not measured here yet: create->ready latency of a confined sandbox (needs the container backend
wired to apply the compiled policy; see the report in the security commit log).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=300_000, help="dd bs=1 count (syscalls / 2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
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
    subprocess.run(["true"], check=True)
    out = {
        "seccomp_compile_s": compile_s,
        "seccomp_insns": len(prog) // 8,
        "landlock_ruleset_s": landlock_s,
        "landlock_abi": landlock.abi(),
        "workloads": rows,
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


if __name__ == "__main__":
    main()
