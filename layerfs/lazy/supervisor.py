"""The supervisor of a node's lazy layer server: holds the FUSE connection, restarts the
server when it dies.

``python -m layerfs.lazy.supervisor --cache DIR [server options]`` mounts FUSE on
``DIR/fuse`` (mount(2) with an fd of /dev/fuse), then runs the server
(:mod:`layerfs.lazy.server`) with that fd inherited. The supervisor keeps its own copy of
the fd: the kernel aborts a FUSE connection only when the last fd on it closes, so while
the supervisor lives the mount survives the server's death. Reads that arrive meanwhile
wait in the kernel; the restarted server (``--resumed``) asks the kernel to requeue the
requests the dead one had taken (FUSE_NOTIFY_RESEND) and answers them.

SIGTERM/SIGINT: stop the server, unmount (lazily, if EROFS mounts still hold layer files)
and exit. If the server exits by itself with status 0, the connection has gone (someone
unmounted it) and the supervisor exits too. A server that keeps crashing is restarted at
most once a second.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from layerfs.lazy.cache import ChunkCache
from layerfs.native import check, lib, new_error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerfs.lazy.supervisor")
    p.add_argument("--cache", required=True)
    args, server_args = p.parse_known_args(argv)
    cache = ChunkCache(args.cache)
    mp = cache.path("fuse")
    log = open(cache.path("server.log"), "ab", buffering=0)  # noqa: SIM115 - lives until exit
    err = new_error()
    fd = check(lib.lfs_lazy_mount(mp.encode(), err), err, "lazy supervisor")
    os.set_inheritable(fd, True)
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with open(cache.path("supervisor.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    resumed = False
    last_start = 0.0
    try:
        while not stopping:
            wait = last_start + 1.0 - time.monotonic()
            if resumed and wait > 0:
                time.sleep(wait)  # crash loop: at most one restart a second
            last_start = time.monotonic()
            cmd = [sys.executable, "-m", "layerfs.lazy.server", "--cache", cache.root,
                   "--fuse-fd", str(fd), *server_args]
            if resumed:
                cmd.append("--resumed")
            child = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=log)
            # A full disk must not end the supervisor: it holds every lazy mount.
            with contextlib.suppress(OSError), open(cache.path("server.pid"), "w") as f:
                f.write(f"{child.pid}\n")
            rc = child.wait()
            if stopping or rc == 0:
                break
            with contextlib.suppress(OSError):
                log.write(f"supervisor: server pid {child.pid} ended with status {rc}; "
                          f"restarting\n".encode())
            resumed = True
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        # Detach: EROFS mounts of layer files may still be up; the connection then ends
        # when they go.
        lib.lfs_lazy_umount(mp.encode(), 1, new_error())
        os.close(fd)
        for name in ("supervisor.pid", "server.pid", "control.sock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cache.path(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
