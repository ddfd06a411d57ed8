"""The call server's wipe of /tmp and /dev/shm between calls and the directory of its own it
keeps there (``server._wipe``, ``server._private``), run in a mount and pid namespace of its
own made here (``unshare --mount --pid --fork``; /tmp a directory of an overlay over two
fresh tmpfs, as a sandbox's root has it, and a tmpfs on /dev/shm, all private to it):
nothing of the host's /tmp is touched, and the mounts go with the namespace."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from edged.backends.fncall import server

pytestmark = [pytest.mark.root, pytest.mark.mount]

SCRIPT = r"""
import importlib.util, os, subprocess, sys
def sh(*argv):
    subprocess.run(argv, check=True)
# loaded before /tmp is mounted over: the checkout may be under /tmp (a CI clone there)
spec = importlib.util.spec_from_file_location("server", sys.argv[1])
server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server)
# /tmp as a sandbox has it, and /dev/shm so too (in a sandbox a tmpfs of its own; here held
# to the harder case): directories of an overlay root whose upper is a tmpfs and whose
# lower another file system (there an entry's inode number in a listing is not its st_ino)
sh("mount", "-t", "tmpfs", "tmpfs", "/tmp")
os.makedirs("/tmp/lower/tmp"); os.makedirs("/tmp/lower/shm"); os.makedirs("/tmp/scratch")
sh("mount", "-t", "tmpfs", "tmpfs", "/tmp/scratch")
os.makedirs("/tmp/scratch/upper"); os.makedirs("/tmp/scratch/work"); os.makedirs("/tmp/root")
sh("mount", "-t", "overlay", "overlay", "-o", "lowerdir=/tmp/lower,upperdir=/tmp/scratch/upper,"
   "workdir=/tmp/scratch/work", "/tmp/root")
for d in ("tmp", "shm"):
    os.chmod("/tmp/root/" + d, 0o1777)
sh("mount", "--bind", "/tmp/root/shm", "/dev/shm")
sh("mount", "--bind", "/tmp/root/tmp", "/tmp")
server._guarded = True  # this namespace is the sandbox here: its /tmp is its own tmpfs
P = server.PRIVATE

def dino():  # the directory's inode number as its parent's listing gives it (what the wipe reads)
    return [e.inode() for e in os.scandir("/dev/shm") if e.name == ".fncall"][0]

def tree():
    out = []
    for top in ("/tmp", "/dev/shm"):
        for d, dirs, files in os.walk(top):
            out += sorted(os.path.join(d, n) for n in dirs + files)
    return sorted(out)

server._wipe(); server._private()
ino = os.lstat(P).st_ino
# what a call leaves: files, a directory, a symlink out of the scratch
os.makedirs("/tmp/work/a/b"); open("/tmp/work/a/b/f", "w").close()
open("/dev/shm/x", "w").close(); os.symlink("/etc", "/tmp/link"); os.mkdir("/dev/shm/d")
open(P + "/stdout", "w").close()  # the server's own: _call removes it, not the wipe
server._wipe()
print("1", tree(), os.lstat(P).st_ino == ino, server._kept == dino())
os.unlink(P + "/stdout")
# another directory of that name in its place (what a call could do were its parent not
# sticky)
os.rmdir(P); os.mkdir(P, 0o777); open(P + "/planted", "w").close()
server._wipe()
print("2", tree(), server._kept)
server._private()
print("3", tree(), server._kept == dino(), oct(os.lstat(P).st_mode & 0o777))
os.rmdir(P); open(P, "w").close()  # not a directory: refused
try:
    server._private()
    print("4 made")
except server._Fatal as e:
    print("4 refused")
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_the_wipe_spares_the_servers_directory_and_nothing_else() -> None:
    """Everything a call left in /tmp and /dev/shm goes (a symlink removed, not followed);
    the server's own directory stays, the same inode, with what the server put in it
    (removed by the call's end in ``_call``, not by the wipe); another directory of the
    same name is wiped with all in it and the server makes its own again (mode 0700);
    something there that is not a directory is refused."""
    r = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc",
                        sys.executable, "-c", SCRIPT, server.__file__],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "1 ['/dev/shm/.fncall', '/dev/shm/.fncall/stdout'] True True", r.stdout
    assert lines[1] == "2 [] None", r.stdout
    assert lines[2] == "3 ['/dev/shm/.fncall'] True 0o700", r.stdout
    assert lines[3] == "4 refused", r.stdout
