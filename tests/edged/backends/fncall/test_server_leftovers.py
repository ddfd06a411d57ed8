"""The call server's check for what a call left running (``server._leftovers``), run in a
pid namespace of its own made here (``unshare --pid --fork --mount-proc``), so that /proc
holds only the processes this test made: the helper reads /proc and signals nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from edged.backends.fncall import server

pytestmark = [pytest.mark.root]

SCRIPT = r"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("server", sys.argv[1])
server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server)
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # a call's process left behind: nobody's
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    os.close(r); os.write(w, b"x"); time.sleep(30); os._exit(0)
os.close(w); os.read(r, 1)
own = frozenset({"1", str(os.getpid())})
print(server._leftovers(65534, own), server._leftovers(65534, own | {str(pid)}),
      server._leftovers(0, own))
os.kill(pid, 9); os.waitpid(pid, 0)
print(server._leftovers(65534, own))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_left_process_is_found_and_the_servers_own_are_not_read() -> None:
    """A live process of the call's uid is a leftover; the pids named as the server's own
    are skipped (with the left process among them, none is found); the server's own
    processes (uid 0) are not read, so they are no call's leftovers even for uid 0; once
    the left process is gone (reaped), nothing is left."""
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                        SCRIPT, server.__file__], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "False", "False"], r.stdout
