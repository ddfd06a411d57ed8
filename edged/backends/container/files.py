"""Files in and out of a container sandbox, resolved strictly inside its root.

Every path is resolved with ``openat2(root_fd, path, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS |
RESOLVE_NO_XDEV)`` where ``root_fd`` is the sandbox's ``/`` (``/proc/<sbx-init pid>/root``):
``..`` and symlinks (absolute or relative, planted by the workload) are resolved as if the
sandbox root were the filesystem root, so they cannot lead out; ``/proc/<pid>/fd``-style magic
links are refused; and no path crosses a mount: not into /proc, /sys or /dev, nor into a
protected path's read-only bind mount (BadRequest). A read may cross into a bind mount of the
rootfs itself (the protected paths: same filesystem, read-only), never into another
filesystem. A path whose ``..`` would climb above ``/`` is refused outright rather than
silently clamped. Source: openat2(2), include/uapi/linux/openat2.h.

Writes go to a temporary file in the target directory, are chowned to the sandbox's view of
``uid``/``gid`` and renamed over the target, so a failed upload leaves nothing behind and a
symlink at the target name is replaced, never followed. The bytes are written by a helper
process in the sandbox's memory cgroup (``charge_to``, see :func:`copy_charged`): an upper on
tmpfs is RAM, and pages are charged to the memory cgroup of the process that writes them, so
a 1 GiB upload written by the daemon itself had put 1 GiB into the daemon's cgroup, unseen by
the sandbox's limit, its stats and admission. A target that is a mount point in the
sandbox (a protected file such as /etc/passwd is a read-only bind mount of itself) is refused:
the daemon renames from the host's mount namespace, where the kernel would not see the mount
and would replace the file under it, detaching the read-only mount.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import signal
import stat
from collections.abc import AsyncIterator

from edged.errors import BackendError, BadRequest, EdgedError, NotFound
from layerfs.fsutil import write_all

SYS_openat2 = 437  # x86_64 and aarch64 (include/uapi/asm-generic/unistd.h)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
RESOLVE_ANY_MOUNT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
RESOLVE = RESOLVE_ANY_MOUNT | RESOLVE_NO_XDEV
CHUNK = 256 << 10
MAX_PATH = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64))


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = RESOLVE) -> int:
    """openat2(2); returns an fd or raises OSError with the errno."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(SYS_openat2, dirfd, os.fsencode(path), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return int(fd)


def check_path(path: str) -> str:
    """Validate a sandbox path and return it relative to the root ("." for ``/``).

    Raises BadRequest for an empty path, a NUL byte, an over-long path, or ``..`` climbing
    above the root."""
    if not path or "\0" in path or len(path.encode()) > MAX_PATH:
        raise BadRequest(f"path {path[:80]!r}: empty, over-long or containing NUL")
    depth = 0
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            depth -= 1
            if depth < 0:
                raise BadRequest(f"path {path!r} escapes the sandbox root")
            parts.pop()
            continue
        depth += 1
        parts.append(part)
    return "/".join(parts) or "."


def _map_error(exc: OSError, path: str, what: str) -> EdgedError:
    if exc.errno in (errno.ENOENT,):
        return NotFound(f"{what} {path!r}: no such file or directory in the sandbox")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return BadRequest(f"{what} {path!r}: the sandbox's disk limit is reached")
    if exc.errno == errno.EXDEV:
        return BadRequest(f"{what} {path!r}: crosses a mount (a protected path, /proc, /sys or "
                          f"/dev): not reachable through the files API")
    if exc.errno in (errno.EXDEV, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EINVAL,
                     errno.ENAMETOOLONG, errno.EACCES, errno.EPERM, errno.EROFS):
        return BadRequest(f"{what} {path!r}: {exc.strerror}")
    return BackendError(f"{what} {path!r}: {exc.strerror}")


async def put(root_fd: int, path: str, data: AsyncIterator[bytes], mode: int, uid: int,
              gid: int, *, charge_to: str | None = None) -> int:
    """Write ``data`` to ``path`` (host ids ``uid``/``gid``, permission bits ``mode``);
    returns bytes written. ``charge_to``: the sandbox's :meth:`memory_join` file; the bytes
    are then written by a helper in its memory cgroup (None: by the daemon). Raises
    BadRequest (also when the file does not fit in the sandbox's disk or memory limit),
    NotFound or BackendError; on error the target is unchanged."""
    rel = check_path(path)
    if rel == ".":
        raise BadRequest(f"path {path!r} is the sandbox root, not a file")
    if not 0 <= mode <= 0o7777:
        raise BadRequest(f"mode {mode:#o} out of range")
    parent, _, name = rel.rpartition("/")
    try:
        pfd = openat2(root_fd, parent or ".", os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        raise _map_error(exc, path, "put: parent of") from exc
    try:
        t = openat2(pfd, name, os.O_PATH | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            os.close(pfd)
            raise _map_error(exc, path, "put") from exc
    else:
        os.close(t)  # the name is no mount point (that would have been EXDEV)
    tmp = f".edged-put-{secrets.token_hex(6)}"
    total = 0
    fd = -1
    try:
        # the parent fd was resolved inside the root; a plain name below it cannot escape
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=pfd)
        if charge_to is not None:
            total = await copy_charged(fd, data, charge_to, path)
        else:
            async for chunk in data:
                write_all(fd, chunk)
                total += len(chunk)
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        os.close(fd)
        fd = -1
        os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        tmp = ""
    except OSError as exc:
        raise _map_error(exc, path, "put") from exc
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=pfd)
        os.close(pfd)
    return total


SH = shutil.which("sh", path="/usr/bin:/bin") or "/bin/sh"
CAT = shutil.which("cat", path="/usr/bin:/bin") or "/bin/cat"
#: The helper: most likely victim of an OOM kill in the sandbox's cgroup (an upload that
#: does not fit must not kill the workload), moves itself into the cgroup, becomes cat.
_HELPER = 'echo 1000 > /proc/self/oom_score_adj && echo $$ > "$1" || exit 125; exec "$2"'
_JOIN_FAILED = 125


async def copy_charged(fd: int, data: AsyncIterator[bytes], join: str, path: str) -> int:
    """Copy ``data`` into the open file ``fd`` through a helper process (``sh``, then
    ``cat``: host binaries, run as the daemon outside every sandbox namespace, reading a
    pipe and writing ``fd``, touching no path of the sandbox) that first writes its pid to
    ``join`` (a sandbox's memory cgroup), so that the pages it writes are charged there.
    Returns the bytes copied. Raises BadRequest (``path`` does not fit: ENOSPC, or the
    sandbox's memory limit killed the helper), BackendError (the helper failed)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    er, ew = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.posix_spawn(SH, [SH, "-c", _HELPER, "sh", join, CAT], {"PATH": "/usr/bin:/bin"},
                             file_actions=[(os.POSIX_SPAWN_DUP2, r, 0),
                                           (os.POSIX_SPAWN_DUP2, fd, 1),
                                           (os.POSIX_SPAWN_DUP2, ew, 2)])
    except OSError as exc:
        for x in (w, er):
            os.close(x)
        raise BackendError(f"put {path!r}: cannot start the copy helper: {exc.strerror}") from exc
    finally:
        os.close(r)
        os.close(ew)
    total = 0
    status = None
    try:
        try:
            async for chunk in data:
                await asyncio.to_thread(write_all, w, chunk)
                total += len(chunk)
        except BrokenPipeError:
            pass  # the helper ended early: its status says why
        finally:
            os.close(w)
            w = -1
        status = (await asyncio.to_thread(os.waitpid, pid, 0))[1]
    finally:
        if w >= 0:
            os.close(w)
        if status is None:  # the caller went away (or the data failed): stop the helper
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(os.waitpid, pid, 0)
        try:
            err = os.read(er, 4096).decode("utf-8", "replace").strip()
        finally:
            os.close(er)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return total
    if (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL) or (
            os.strerror(errno.ENOMEM) in err):
        raise BadRequest(f"put {path!r}: the file does not fit in the sandbox's memory limit "
                         f"(its upper layer is RAM, charged to the sandbox)")
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == _JOIN_FAILED:
        raise BackendError(f"put {path!r}: cannot join the sandbox's memory cgroup: {err}")
    for e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        if os.strerror(e) in err:
            raise _map_error(OSError(e, os.strerror(e)), path, "put")
    raise BackendError(f"put {path!r}: the copy helper failed: {err or status}")


def open_for_get(root_fd: int, path: str) -> int:
    """Open a regular file inside the root for reading; raises BadRequest (not a regular
    file, escapes), NotFound or BackendError."""
    rel = check_path(path)
    flags = os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK
    try:
        fd = openat2(root_fd, rel, flags)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise _map_error(exc, path, "get") from exc
        # A mount: readable only if it is the rootfs itself (a protected path's bind mount
        # of it), told by the filesystem id (st_dev of an overlay file is its layer's).
        # Checked on an O_PATH fd first, so that nothing in /proc, /sys or /dev is opened.
        fsid = os.fstatvfs(root_fd).f_fsid
        try:
            fd = openat2(root_fd, rel, os.O_PATH, resolve=RESOLVE_ANY_MOUNT)
        except OSError:
            raise _map_error(exc, path, "get") from exc
        try:
            same = os.fstatvfs(fd).f_fsid == fsid
        finally:
            os.close(fd)
        if not same:
            raise _map_error(exc, path, "get") from exc
        try:
            fd = openat2(root_fd, rel, flags, resolve=RESOLVE_ANY_MOUNT)
        except OSError as exc2:
            raise _map_error(exc2, path, "get") from exc2
        if os.fstatvfs(fd).f_fsid != fsid:  # changed under us
            os.close(fd)
            raise _map_error(exc, path, "get") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BadRequest(f"get {path!r}: not a regular file")
    os.set_blocking(fd, True)
    return fd


async def stream(fd: int) -> AsyncIterator[bytes]:
    """Chunks of an open file (closed at the end). Reads run in a thread: a lazily loaded
    layer may fetch over the network on a page-cache miss."""
    try:
        while True:
            chunk = await asyncio.to_thread(os.read, fd, CHUNK)
            if not chunk:
                return
            yield chunk
    finally:
        os.close(fd)
