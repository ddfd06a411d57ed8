"""The call server refuses to run outside a sandbox's own pid namespace, having done nothing.

It is meant for PID 2+ of a sandbox whose PID 1 is sbx-init; run by hand on a host, as
root, its wipe of /tmp would remove the host's files (and an earlier version of it killed
every process of the host with ``kill(-1, SIGKILL)``). These tests run it ON THE HOST, each
time in a throwaway child process with a bounded timeout, next to a sleeping sibling
process and a file in /tmp that must both survive.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.backends.fncall import server

SERVER = Path(server.__file__)


@pytest.fixture
def bystanders() -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A sleeping process and a file in /tmp: what a server that did not refuse would have
    killed or wiped."""
    sibling = subprocess.Popen(["sleep", "300"])
    fd, name = tempfile.mkstemp(prefix="fncall-guard-", dir="/tmp")
    os.write(fd, b"keep me\n")
    os.close(fd)
    try:
        yield sibling, Path(name)
    finally:
        sibling.kill()
        sibling.wait()
        Path(name).unlink(missing_ok=True)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)


def _assert_untouched(bystanders: tuple[subprocess.Popen[bytes], Path]) -> None:
    sibling, kept = bystanders
    assert sibling.poll() is None, "the sleeping sibling was killed"
    assert kept.read_text() == "keep me\n", "a file in /tmp was removed"


def test_refuses_on_the_host(bystanders) -> None:
    """PID 1 of the host is not sbx-init: exit REFUSED at once, nothing done."""
    host_ns = os.readlink("/proc/self/ns/pid")
    r = _run([sys.executable, "-I", "-B", str(SERVER), "--host-pidns", host_ns])
    assert r.returncode == server.REFUSED, r
    assert "refusing to run" in r.stderr and "not sbx-init" in r.stderr
    assert r.stdout == ""  # not even the ready line
    _assert_untouched(bystanders)


@pytest.mark.root
def test_refuses_in_the_host_pid_namespace_even_if_pid1_looks_like_sbx_init(
        bystanders, tmp_path: Path) -> None:
    """/proc/1/comm faked to read sbx-init (a bind mount in a private mount namespace):
    the pid namespace check still refuses (the initial pid namespace's fixed inode, and the
    daemon's, both)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1)")
    fake = tmp_path / "comm"
    fake.write_text("sbx-init\n")
    host_ns = os.readlink("/proc/self/ns/pid")
    for given in (host_ns, "pid:[1]"):
        script = (f"mount --bind {fake} /proc/1/comm && "
                  f"exec {sys.executable} -I -B {SERVER} --host-pidns '{given}'")
        r = _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script])
        assert r.returncode == server.REFUSED, r
        assert "pid namespace" in r.stderr, r.stderr
        assert r.stdout == ""
    _assert_untouched(bystanders)


def test_the_wipe_itself_refuses_without_the_guard() -> None:
    """Called directly (as an import would let one), the wipe raises before touching /tmp."""
    assert server._guarded is False
    with pytest.raises(RuntimeError, match="outside a sandbox"):
        server._wipe()


def test_the_guard_names_what_is_wrong() -> None:
    """On this host: PID 1 is not sbx-init."""
    why = server.why_not_in_sandbox(os.readlink("/proc/self/ns/pid"))
    assert why is not None and "not sbx-init" in why


def test_no_broad_kill_in_the_server() -> None:
    """The server signals nothing but its own child's pidfd: no kill(), killpg() or
    pthread_kill() call anywhere in it (parsed, so a docstring does not count)."""
    import ast

    calls = [n.func for n in ast.walk(ast.parse(SERVER.read_text()))
             if isinstance(n, ast.Call)]
    names = [f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "") for f in calls]
    assert not {"kill", "killpg", "pthread_kill"} & set(names)
    assert names.count("pidfd_send_signal") == 1
