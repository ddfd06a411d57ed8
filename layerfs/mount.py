"""Mount EROFS layers and overlayfs stacks with the mount(2) syscall.

EROFS is mounted *file-backed* (kernel 6.12+, ``CONFIG_EROFS_FS_BACKED_BY_FILE``): the
image file itself is the mount source, no loop device. ``mount(8)`` from util-linux
2.38 would still make a loop device, hence the direct syscall (through ctypes to libc).
Everything here needs CAP_SYS_ADMIN in the initial user namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence

from layerfs.errors import NativeError

__all__ = ["mount_erofs", "mount_overlay", "mount_tmpfs", "mounted_erofs", "mounted_overlay",
           "umount"]

# include/uapi/linux/mount.h
MS_RDONLY = 0x1
MNT_DETACH = 0x2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

StrPath = str | os.PathLike[str]


def _mount(source: bytes, target: StrPath, fstype: bytes, flags: int,
           data: bytes | None, what: str) -> None:
    if _libc.mount(source, os.fsencode(target), fstype, flags, data) != 0:
        code = ctypes.get_errno()
        raise NativeError(code, f"{what}: {os.strerror(code)}")


def mount_erofs(image_path: StrPath, mountpoint: StrPath, *, readonly: bool = True,
                options: str | None = None) -> None:
    """File-backed mount of the EROFS image ``image_path`` on ``mountpoint``.

    EROFS is read-only whatever ``readonly`` says; it only sets ``MS_RDONLY`` on the
    mount. ``options`` is the fs-specific data string (e.g. ``"device=/path"``).
    Raises :class:`NativeError` (``OSError``) with the errno of mount(2): ``EPERM``
    without privilege, ``EINVAL``/``EFSCORRUPTED`` (``EUCLEAN``) for a bad image,
    ``ENOTBLK`` if the kernel lacks file-backed mounts or the file sits on overlayfs.
    """
    src = os.fsencode(os.path.abspath(image_path))
    _mount(src, mountpoint, b"erofs", MS_RDONLY if readonly else 0,
           options.encode() if options else None,
           f"mount erofs {os.fsdecode(src)} on {os.fspath(mountpoint)}")


def _overlay_path(path: StrPath) -> str:
    p = os.path.abspath(os.fspath(path))
    # overlayfs splits its option string on ',' and lowerdir on ':'; '\\' escapes.
    if any(c in p for c in ",:\\"):
        raise ValueError(f"overlay path {p!r} contains ',', ':' or '\\'")
    return p


def mount_overlay(lowers: Sequence[StrPath], upper: StrPath | None, work: StrPath | None,
                  mountpoint: StrPath, *, readonly: bool = False,
                  extra: str | None = None) -> None:
    """Mount overlayfs on ``mountpoint``: ``lowers`` top first, then ``upper`` and
    ``work`` (both or neither; neither gives a read-only stack of the lowers).

    ``extra`` is appended to the option string (e.g. ``"userxattr"``). Raises
    :class:`ValueError` for unusable paths and :class:`NativeError` for mount(2)
    errors (documentation: Documentation/filesystems/overlayfs.rst).
    """
    if not lowers:
        raise ValueError("overlay needs at least one lower directory")
    if (upper is None) != (work is None):
        raise ValueError("overlay upper and work go together")
    opts = ["lowerdir=" + ":".join(_overlay_path(p) for p in lowers)]
    if upper is not None and work is not None:
        opts += [f"upperdir={_overlay_path(upper)}", f"workdir={_overlay_path(work)}"]
    if extra:
        opts.append(extra)
    _mount(b"overlay", mountpoint, b"overlay", MS_RDONLY if readonly else 0,
           ",".join(opts).encode(), f"mount overlay on {os.fspath(mountpoint)}")


def mount_tmpfs(mountpoint: StrPath, *, size: int, mode: int = 0o700) -> None:
    """Mount a tmpfs of at most ``size`` bytes (a write past it fails with ENOSPC) on
    ``mountpoint``, its root directory with permission bits ``mode``.

    Raises :class:`ValueError` for a size that is not positive and :class:`NativeError`
    with the errno of mount(2) (documentation: Documentation/filesystems/tmpfs.rst).
    """
    if size <= 0:
        raise ValueError(f"tmpfs size {size} must be positive bytes")
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"tmpfs mode {mode:o} is not permission bits")
    _mount(b"tmpfs", mountpoint, b"tmpfs", 0, f"size={size},mode={mode:o}".encode(),
           f"mount tmpfs on {os.fspath(mountpoint)}")


def umount(mountpoint: StrPath, lazy: bool = False) -> None:
    """Unmount ``mountpoint`` (``lazy``: detach now, finish when no longer busy).
    Raises :class:`NativeError` with the errno of umount2(2)."""
    if _libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0) != 0:
        code = ctypes.get_errno()
        raise NativeError(code, f"umount {os.fspath(mountpoint)}: {os.strerror(code)}")


def _cleanup(mountpoint: str) -> None:
    try:
        umount(mountpoint)
    except OSError:
        umount(mountpoint, lazy=True)
    os.rmdir(mountpoint)


@contextlib.contextmanager
def _on_temp_mountpoint(prefix: str, mount: Callable[[str], None]) -> Iterator[str]:
    """Make a temporary directory, ``mount(it)``, yield it; always unmounts (lazily if
    busy) and removes the directory on exit, also when the mount itself fails."""
    mp = tempfile.mkdtemp(prefix=prefix)
    try:
        mount(mp)
    except BaseException:
        os.rmdir(mp)
        raise
    try:
        yield mp
    finally:
        _cleanup(mp)


def mounted_erofs(image: StrPath, *, options: str | None = None
                  ) -> contextlib.AbstractContextManager[str]:
    """Mount ``image`` on a fresh temporary directory and yield its path; always
    unmounts (lazily if busy) and removes the directory on exit."""
    return _on_temp_mountpoint("layerfs-mnt-",
                               lambda mp: mount_erofs(image, mp, options=options))


def mounted_overlay(lowers: Sequence[StrPath], upper: StrPath | None = None,
                    work: StrPath | None = None, *, extra: str | None = None,
                    readonly: bool = False) -> contextlib.AbstractContextManager[str]:
    """:func:`mount_overlay` on a fresh temporary directory, yielded; always unmounted
    and removed on exit."""
    return _on_temp_mountpoint(
        "layerfs-ovl-",
        lambda mp: mount_overlay(lowers, upper, work, mp, extra=extra, readonly=readonly))
