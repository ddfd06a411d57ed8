"""The call spawner (``fncall-spawn``, csrc/fncall/spawn.c): programs a call execs run from
it (vfork), with the zygote's verdicts and clean-up; its guard; bad input to it; a spawner
killed under its pool sandbox. A real daemon, real pool sandboxes (root, mounts)."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from edged.backends.fncall import pool as fnpool

pytestmark = [pytest.mark.root, pytest.mark.mount]

LIMITS = {"cpu_s": 1, "wall_s": 2, "output_bytes": 1000}


def test_programs_run_from_the_spawner_not_the_zygote(fn_node) -> None:
    r = fn_node.run({"argv": ["/bin/sh", "-c", "cat /proc/$PPID/comm; id -u; ls /proc/self/fd"]})
    assert r["status"] == "Accepted", r
    assert r["stdout"].split() == ["fncall-spawn", "65534", "0", "1", "2", "3"], r
    # its peak resident set is the program's, not a forked interpreter's
    assert 0 < r["memory_bytes"] < 8 << 20, r
    assert fnpool.SPAWNER.is_file()


@pytest.mark.parametrize("argv, status, check", [
    (["/bin/sleep", "30"], "Time Limit Exceeded", lambda r: r["wall_s"] < 6),
    (["/bin/bash", "-c", "while :; do :; done"], "Time Limit Exceeded",
     lambda r: r["signal"] in (9, 24)),
    (["/bin/sh", "-c", "head -c 100000 /dev/zero"], "Output Limit Exceeded",
     lambda r: r["stdout"] == "\0" * 1000 and r["stdout_truncated"]),
    (["/no/such/program"], "Nonzero Exit Status",
     lambda r: r["exit_code"] == 127 and "No such file" in r["stderr"]),
    (["no-such-program-on-path"], "Nonzero Exit Status",
     lambda r: r["exit_code"] == 127 and "no-such-program-on-path" in r["stderr"]),
    (["/etc/passwd"], "Nonzero Exit Status",
     lambda r: r["exit_code"] == 127 and "Permission denied" in r["stderr"]),
    (["/bin/sh", "-c", "kill -SEGV $$"], "Signalled", lambda r: r["signal"] == 11),
    (["/bin/sh", "-c", "exit 7"], "Nonzero Exit Status", lambda r: r["exit_code"] == 7),
])
def test_verdicts_of_programs(fn_node, argv, status, check) -> None:
    r = fn_node.run({"argv": argv, "limits": LIMITS})
    assert r["status"] == status, r
    assert check(r), r


def test_limits_and_environment_reach_the_program(fn_node) -> None:
    r = fn_node.run({"argv": ["/bin/sh", "-c", "ulimit -t; ulimit -c; ulimit -v; echo $X; trap"],
                     "env": {"X": "y z"}, "limits": {**LIMITS, "memory_bytes": 64 << 20}})
    assert r["status"] == "Accepted", r
    assert r["stdout"].split("\n")[:4] == ["1", "0", str(64 << 10), "y z"], r
    assert "trap" not in r["stdout"]  # no signal ignored (the io process ignores SIGPIPE)


def test_a_daemon_left_by_a_program_replaces_the_sandbox(fn_node) -> None:
    pool = fn_node.backend().pools["default"]
    before = pool.stats.get("replaced_leftovers", 0)
    r = fn_node.run({"argv": ["/bin/bash", "-c", "(setsid sleep 1000 &); echo started"]})
    assert (r["status"], r["stdout"]) == ("Accepted", "started\n"), r
    deadline = time.monotonic() + 30
    while pool.stats.get("replaced_leftovers", 0) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats["replaced_leftovers"] == before + 1
    for _ in range(4):
        r = fn_node.run({"argv": ["/bin/sh", "-c", "ps -eo comm | grep -c sleep"]})
        assert r["stdout"] == "0\n", r


def test_refuses_on_the_host() -> None:
    r = subprocess.run([str(fnpool.SPAWNER), "--host-pidns",
                        os.readlink("/proc/self/ns/pid")], capture_output=True, text=True,
                       timeout=10)
    assert r.returncode == 3 and "refusing to run" in r.stderr, r


def test_bad_input_is_answered_and_the_spawner_goes_on(fn_node) -> None:
    """The spawner run by hand in a pool sandbox (by a call, as nobody): every malformed
    job gets {"error": ...} and the next one is still read; the end of its socket ends it
    with status 0."""
    script = r"""
import json, os, socket, subprocess, sys
os.chmod("spawn", 0o755)
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
os.dup2(b.fileno(), 9)
b.close()
p = subprocess.Popen(["/bin/sh", "-c", 'exec 3<&9 9<&-; exec ./spawn --host-pidns "$1"', "sh",
                      sys.argv[1]], pass_fds=[9], stdin=subprocess.DEVNULL)
os.close(9)
full = b"u1000\0g1000\0i/dev/null\0o/tmp/o\0e/tmp/e\0d/tmp\0"
for job in [b"u1\0g1", b"zzz\0", b"u-1\0", b"ux\0", b"Enovalue\0", full,
            full.replace(b"u1000", b"u0") + b"a/bin/true\0"]:
    a.send(job)
    print(json.loads(a.recv(4096)).get("error", "NO ERROR"))
a.close()
print("exit", p.wait(10))
"""
    spawn = base64.b64encode(fnpool.SPAWNER.read_bytes()).decode()
    r = fn_node.run({"language": "python", "source": script, "files": {"spawn": spawn},
                     "cases": [{"args": [os.readlink("/proc/self/ns/pid")]}],
                     "limits": {"wall_s": 10, "cpu_s": 5}})
    assert r["status"] == "Accepted", r["stderr"]
    lines = r["stdout"].splitlines()
    expect = ["must end in a NUL", "unknown field", "not a non-negative number",
              "not a non-negative number", "has no '='", "a field is missing",
              "never runs as root"]
    assert len(lines) == len(expect) + 1, r
    for line, want in zip(lines, expect, strict=False):
        assert line.startswith("fncall-spawn: ") and want in line, (line, want)
    assert lines[-1] == "exit 0", r


def test_a_killed_spawner_ends_the_call_typed_and_the_sandbox_is_replaced(
        fn_node_factory) -> None:
    node = fn_node_factory(fncall_pool=1, fncall_listen="", api_keys_file="")
    assert node.run({"argv": ["/bin/true"]})["status"] == "Accepted"
    pool = node.backend().pools["default"]
    (m,) = list(pool._idle)
    assert m.spawner_pid, "no spawner in the pool sandbox"

    # its host pid: the process in that sandbox's pid namespace whose pid there is the
    # spawner's (an exec cannot signal it: each exec has a Landlock domain of its own)
    ns = os.readlink(f"/proc/{m.backend.init_pid(m.id)}/ns/pid")
    (pid,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and _in_ns(p, ns)
              and _nspid(p) == m.spawner_pid]
    fd = os.pidfd_open(pid)
    try:
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "fncall-spawn"
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)
    r = node.run({"argv": ["/bin/true"]})
    assert r["status"] == "Internal Error" and "spawner" in r["error"], r
    for _ in range(3):
        assert node.run({"argv": ["/bin/true"]})["status"] == "Accepted"
    assert pool.stats.get("replaced_error", 0) == 1


def _in_ns(pid: str, ns: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == ns
    except OSError:
        return False


def _nspid(pid: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except OSError:
        pass
    return None


def test_a_spawner_that_cannot_start_leaves_programs_to_the_zygote(
        fn_node_factory, monkeypatch) -> None:
    monkeypatch.setattr(fnpool, "_spawner_bytes", b"#!/nonexistent/interpreter\n")
    node = fn_node_factory(fncall_pool=1, fncall_listen="", api_keys_file="")
    r = node.run({"argv": ["/bin/sh", "-c", "cat /proc/$PPID/comm"]})
    assert (r["status"], r["stdout"]) == ("Accepted", "python3\n"), r
    (m,) = list(node.backend().pools["default"]._idle)
    assert m.spawner_pid is None


def test_a_program_from_the_zygote_gets_every_signal_at_its_default(
        fn_node_factory, monkeypatch) -> None:
    """Without the spawner a program runs from the zygote, whose Python ignores SIGPIPE
    and SIGXFSZ: the program gets them at their default (a Python call keeps them ignored,
    as an interpreter start sets them)."""
    monkeypatch.setattr(fnpool, "_spawner_bytes", b"#!/nonexistent/interpreter\n")
    node = fn_node_factory(fncall_pool=1, fncall_listen="", api_keys_file="")
    r = node.run({"argv": ["/bin/sh", "-c", "grep -E '^Sig(Ign|Cgt)' /proc/self/status"]})
    masks = dict(line.split(":") for line in r["stdout"].splitlines())
    glibc = (1 << 31) | (1 << 32)  # 32, 33: glibc's own, sigaction refuses them
    assert int(masks["SigIgn"], 16) & ~glibc == 0, r
    r = node.run({"language": "python", "source": "import signal\n"
                  "print(int(signal.getsignal(signal.SIGPIPE)), "
                  "int(signal.getsignal(signal.SIGXFSZ)))"})
    assert r["stdout"] == f"{int(signal.SIG_IGN)} {int(signal.SIG_IGN)}\n", r
