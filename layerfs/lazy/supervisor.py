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

The connection outlives the supervisor too, as long as some process holds an fd on it: the
supervisor hands a copy to whoever asks on ``DIR/fuse.sock`` (SCM_RIGHTS; only to a peer of
its own uid, the socket is mode 0600), and the node's daemon keeps one. A supervisor killed
with its server then leaves the mount waiting, not dead: ``--fuse-fd N`` starts a new
supervisor on that connection (no mount of its own; N is an inherited fd) with
``--resumed`` servers, and the reads that waited are answered. Only when every holder is
gone is the connection aborted: every read on it fails (ENOTCONN) for good, and the mount
is dead (see :func:`layerfs.lazy.client.fuse_state`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from types import FrameType

from layerfs.lazy.cache import ChunkCache
from layerfs.native import check, lib, new_error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerfs.lazy.supervisor")
    p.add_argument("--cache", required=True)
    p.add_argument("--fuse-fd", type=int, default=None,
                   help="an inherited fd on the FUSE connection already mounted on CACHE/fuse")
    p.add_argument("--resumed", action="store_true",
                   help="the first server resumes a connection another one served")
    args, server_args = p.parse_known_args(argv)
    cache = ChunkCache(args.cache)
    mp = cache.path("fuse")
    log = open(cache.path("server.log"), "ab", buffering=0)  # noqa: SIM115 - lives until exit
    err = new_error()
    if args.fuse_fd is not None:
        fd = args.fuse_fd
    else:
        fd = check(lib.lfs_lazy_mount(mp.encode(), err), err, "lazy supervisor")
    os.set_inheritable(fd, True)
    lender = _lend_fd(cache.path("fuse.sock"), fd)
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
    resumed = args.resumed
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
        with contextlib.suppress(OSError):
            lender.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        lender.close()
        lib.lfs_lazy_umount(mp.encode(), 1, new_error())
        os.close(fd)
        for name in ("supervisor.pid", "server.pid", "control.sock", "fuse.sock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cache.path(name))
    return 0


def _lend_fd(path: str, fd: int) -> socket.socket:
    """Listen on ``path`` (mode 0600) and send a copy of ``fd`` (SCM_RIGHTS) to every peer
    of our own uid that connects, from a thread; closing the returned socket ends it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    srv.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return  # closed: the supervisor is ending
            with conn:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                if uid != os.getuid():
                    continue
                with contextlib.suppress(OSError):
                    socket.send_fds(conn, [b"fuse"], [fd])

    threading.Thread(target=serve, name="fuse-fd", daemon=True).start()
    return srv


if __name__ == "__main__":
    sys.exit(main())
