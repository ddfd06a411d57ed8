"""Directory operations inside a container sandbox's root: list, stat, make, remove, rename.

Every path is resolved as :mod:`.files` resolves it (``openat2`` with ``RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV`` from the sandbox's ``/``): ``..`` and planted
symlinks cannot lead out, and nothing crosses a mount (``/proc``, ``/sys``, ``/dev``, a
protected path's read-only bind mount): such a path is a BadRequest. The last component is
never followed: a symlink is listed, stat'ed, removed or renamed as itself. Removal is
recursive and goes by directory fds (:func:`shutil.rmtree` with ``dir_fd``), so a symlink
swapped in mid-way is unlinked, never followed; a mount point inside the tree stops it
with an error. Owners are named from the sandbox's own ``/etc/passwd`` and ``/etc/group``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator

from edged.backends.base import FileInfo
from edged.backends.container.files import _map_error, check_path, open_for_get, openat2
from edged.errors import BadRequest, Conflict, EdgedError

MAX_ENTRIES = 100_000


def _names(root_fd: int, path: str) -> dict[int, str]:
    """id → name from a passwd/group file of the sandbox (empty if unreadable)."""
    out: dict[int, str] = {}
    try:  # (a protected file is a bind mount of the rootfs: open_for_get reads it)
        fd = open_for_get(root_fd, path)
    except EdgedError:
        return out
    with os.fdopen(fd, "rb") as f:
        for line in f.read(1 << 20).decode("utf-8", "replace").splitlines():
            parts = line.split(":")
            if len(parts) >= 3 and parts[2].isdigit():
                out.setdefault(int(parts[2]), parts[0])
    return out


class _Owners:
    def __init__(self, root_fd: int, uid_base: int) -> None:
        self.uid_base = uid_base
        self.users = _names(root_fd, "etc/passwd")
        self.groups = _names(root_fd, "etc/group")

    def user(self, host_uid: int) -> str:
        uid = host_uid - self.uid_base
        return self.users.get(uid, str(uid))

    def group(self, host_gid: int) -> str:
        gid = host_gid - self.uid_base
        return self.groups.get(gid, str(gid))


def _parent(root_fd: int, path: str, what: str) -> tuple[int, str, str]:
    """(fd of the parent directory, the last name, the normalised sandbox path)."""
    rel = check_path(path)
    if rel == ".":
        raise BadRequest(f"{what} {path!r}: the sandbox root itself")
    parent, _, name = rel.rpartition("/")
    try:
        pfd = openat2(root_fd, parent or ".", os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        raise _map_error(exc, path, what) from exc
    return pfd, name, "/" + rel


def _info(st: os.stat_result, name: str, path: str, target: str | None,
          owners: _Owners) -> FileInfo:
    kind = ("dir" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode)
            else "file")
    return FileInfo(name=name, path=path, type=kind, size=st.st_size,
                    mode=stat.S_IMODE(st.st_mode), permissions=stat.filemode(st.st_mode),
                    owner=owners.user(st.st_uid), group=owners.group(st.st_gid),
                    mtime=st.st_mtime, symlink_target=target)


def _entry(dfd: int, name: str, path: str, owners: _Owners) -> FileInfo:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
    return _info(st, name, path, target, owners)


def stat_path(root_fd: int, path: str, uid_base: int) -> FileInfo:
    """The entry at ``path`` (a symlink as itself). Raises NotFound, BadRequest."""
    rel = check_path(path)
    owners = _Owners(root_fd, uid_base)
    if rel == ".":
        return _info(os.fstat(root_fd), "/", "/", None, owners)
    pfd, name, full = _parent(root_fd, path, "stat")
    try:
        return _entry(pfd, name, full, owners)
    except OSError as exc:
        raise _map_error(exc, path, "stat") from exc
    finally:
        os.close(pfd)


def list_dir(root_fd: int, path: str, uid_base: int, depth: int = 1) -> list[FileInfo]:
    """The entries of the directory ``path``, down to ``depth`` levels (1: its own),
    sorted by path; symlinked directories are not descended. Raises NotFound, BadRequest
    (not a directory, crosses a mount, more than :data:`MAX_ENTRIES`)."""
    if not 1 <= depth <= 64:
        raise BadRequest("depth: must be 1 to 64")
    rel = check_path(path)
    owners = _Owners(root_fd, uid_base)
    try:
        fd = openat2(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise _map_error(exc, path, "list") from exc
    out: list[FileInfo] = []
    base = "" if rel == "." else "/" + rel

    def walk(dfd: int, prefix: str, level: int) -> Iterator[FileInfo]:
        for name in sorted(os.listdir(dfd)):
            info = _entry(dfd, name, f"{prefix}/{name}", owners)
            yield info
            if info.type == "dir" and level < depth:
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                  dir_fd=dfd)
                except OSError:
                    continue
                try:
                    if os.fstatvfs(sub).f_fsid == os.fstatvfs(dfd).f_fsid:  # not a mount
                        yield from walk(sub, f"{prefix}/{name}", level + 1)
                finally:
                    os.close(sub)

    try:
        for info in walk(fd, base, 1):
            out.append(info)
            if len(out) > MAX_ENTRIES:
                raise BadRequest(f"list {path!r}: more than {MAX_ENTRIES} entries")
    except OSError as exc:
        raise _map_error(exc, path, "list") from exc
    finally:
        os.close(fd)
    return out


def make_dir(root_fd: int, path: str, uid: int, gid: int, mode: int = 0o755,
             parents: bool = True) -> bool:
    """Make the directory ``path`` (and, with ``parents``, its missing parents), each owned
    by host ``uid``/``gid``; returns False if it was already a directory. Raises Conflict
    (a file is in the way), NotFound (a missing parent without ``parents``), BadRequest."""
    rel = check_path(path)
    if rel == ".":
        return False
    parts = rel.split("/")
    fd = os.dup(root_fd)
    created = False
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = openat2(fd, part, os.O_PATH | os.O_DIRECTORY)
                created = False
            except OSError as exc:
                if exc.errno == errno.ENOTDIR:
                    raise Conflict(f"mkdir {path!r}: a file is in the way") from exc
                if exc.errno != errno.ENOENT or not (last or parents):
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile: fine
                    os.mkdir(part, mode, dir_fd=fd)
                    os.chown(part, uid, gid, dir_fd=fd, follow_symlinks=False)
                    created = True
                nfd = openat2(fd, part, os.O_PATH | os.O_DIRECTORY)
            os.close(fd)
            fd = nfd
        return created
    except OSError as exc:
        raise _map_error(exc, path, "mkdir") from exc
    finally:
        os.close(fd)


def remove(root_fd: int, path: str) -> None:
    """Remove ``path``: a file, a symlink (itself), or a directory and all it holds.
    Raises NotFound, BadRequest (the root, a mount in the way, read-only)."""
    pfd, name, _ = _parent(root_fd, path, "remove")
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=pfd)
        else:
            os.unlink(name, dir_fd=pfd)
    except OSError as exc:
        raise _map_error(exc, path, "remove") from exc
    finally:
        os.close(pfd)


def rename(root_fd: int, src: str, dst: str) -> None:
    """Move ``src`` to ``dst`` (replacing a file there, as rename(2)). Raises NotFound,
    BadRequest (across a mount, onto a non-empty directory...)."""
    sfd, sname, _ = _parent(root_fd, src, "rename")
    try:
        dfd, dname, _ = _parent(root_fd, dst, "rename")
        try:
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        except OSError as exc:
            raise _map_error(exc, f"{src} -> {dst}", "rename") from exc
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def make_parents(root_fd: int, path: str, uid: int, gid: int) -> None:
    """Make the missing parent directories of the file ``path``."""
    rel = check_path(path)
    parent = rel.rpartition("/")[0]
    if parent:
        with contextlib.suppress(Conflict):
            make_dir(root_fd, "/" + parent, uid, gid)


__all__ = ["list_dir", "make_dir", "make_parents", "remove", "rename", "stat_path"]
