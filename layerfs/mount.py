"""Mount EROFS layers and overlayfs stacks with the mount(2) syscall.

EROFS is mounted *file-backed* where the kernel can (6.12+, ``CONFIG_EROFS_FS_BACKED_BY_FILE``):
the image file itself is the mount source, no loop device. ``mount(8)`` from util-linux
2.38 would still make a loop device, hence the direct syscall (through ctypes to libc).
Where it cannot (older kernels, e.g. the 6.1 LTS of production nodes: :func:`erofs_file_backed`
probes once), or for an image file on overlayfs (refused file-backed with ``ENOTBLK``), the
image is attached read-only to a free loop device (``LOOP_CONFIGURE`` with autoclear) and
that is mounted: the kernel detaches the loop device by itself when the mount goes (its last
user), also after a lazy unmount or a failed mount, so nothing is left to clean up.
Everything here needs CAP_SYS_ADMIN in the initial user namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence

from layerfs.errors import NativeError

__all__ = ["erofs_file_backed", "mount_erofs", "mount_overlay", "mount_tmpfs", "mounted_erofs",
           "mounted_overlay", "umount"]

# include/uapi/linux/mount.h
MS_RDONLY = 0x1
MNT_DETACH = 0x2
# include/uapi/linux/loop.h
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_READ_ONLY = 1
LO_FLAGS_AUTOCLEAR = 4
# struct loop_config {u32 fd; u32 block_size; struct loop_info64 info; u64 __reserved[8];}
# with loop_info64 {u64 device, inode, rdevice, offset, sizelimit; u32 number, encrypt_type,
# encrypt_key_size, flags; u8 file_name[64], crypt_name[64], encrypt_key[32]; u64 init[2]}
_LOOP_CONFIG = struct.Struct("=II5Q4I64s64s32s2Q8Q")
assert _LOOP_CONFIG.size == 304

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


_file_backed: bool | None = None


def erofs_file_backed() -> bool:
    """Whether the running kernel mounts EROFS straight from a regular file. Probed once
    (then remembered) by mounting a 4 KiB file of zeros on a temporary directory in
    ``/var/tmp`` (a disk's filesystem: a file on tmpfs is refused with ``ENOTBLK`` even where
    file-backed mounts exist, as is one on overlayfs): a kernel with file-backed mounts
    reads it and refuses the missing superblock (``EINVAL``), one without wants a block
    device (``ENOTBLK``). Nothing is left
    mounted either way. Without the privilege to mount (``EPERM``), or with no EROFS at all
    (``ENODEV``), the answer is the kernel release's (6.12 or later) and is not remembered."""
    global _file_backed
    if _file_backed is not None:
        return _file_backed
    base = "/var/tmp" if os.path.isdir("/var/tmp") else None
    with tempfile.TemporaryDirectory(prefix="layerfs-probe-", dir=base) as d:
        img, mp = os.path.join(d, "zeros.erofs"), os.path.join(d, "mnt")
        with open(img, "wb") as f:
            f.write(bytes(4096))
        os.mkdir(mp)
        if _libc.mount(os.fsencode(img), os.fsencode(mp), b"erofs", MS_RDONLY, None) == 0:
            umount(mp, lazy=True)  # a kernel that took zeros for an image: file-backed
            _file_backed = True
            return True
        code = ctypes.get_errno()
    if code == errno.ENOTBLK:
        _file_backed = False
        return False
    if code in (errno.EPERM, errno.ENODEV, errno.EACCES):
        rel = os.uname().release.split(".")
        try:
            return (int(rel[0]), int(rel[1].split("-")[0])) >= (6, 12)
        except (ValueError, IndexError):
            return False
    _file_backed = True
    return True


def _loop_attach(path: str) -> tuple[int, str]:
    """Attach ``path`` read-only to a free loop device with autoclear; returns (an open fd of
    the device, its path). The caller closes the fd once the device is in use (mounted):
    from then on the kernel detaches it when its last user goes. Raises OSError (no
    ``/dev/loop-control``: the ``loop`` module is not loaded and cannot be)."""
    img = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):
                n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
                dev = f"/dev/loop{n}"
                try:
                    fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # its node not made yet: ask again
                cfg = _LOOP_CONFIG.pack(img, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR,
                                        os.fsencode(path)[:63], b"", b"", 0, 0, *([0] * 8))
                try:
                    fcntl.ioctl(fd, LOOP_CONFIGURE, cfg)
                except OSError as e:
                    os.close(fd)
                    if e.errno == errno.EBUSY:
                        continue  # taken by someone else between GET_FREE and here
                    raise
                return fd, dev
            raise OSError(errno.EBUSY, "no free loop device after 64 tries")
        finally:
            os.close(ctl)
    finally:
        os.close(img)


def mount_erofs(image_path: StrPath, mountpoint: StrPath, *, readonly: bool = True,
                options: str | None = None) -> None:
    """Mount the EROFS image file ``image_path`` on ``mountpoint``: file-backed where the
    kernel has it (:func:`erofs_file_backed`), else (or for a file it refuses so: on overlayfs
    or tmpfs) through an
    autoclear loop device, which the kernel removes with the mount.

    EROFS is read-only whatever ``readonly`` says; it only sets ``MS_RDONLY`` on the
    mount. ``options`` is the fs-specific data string (e.g. ``"device=/path"``: on a loop
    mount each such file gets a loop device of its own).
    Raises :class:`NativeError` (``OSError``) with the errno of mount(2) or of the loop
    device's set-up: ``EPERM`` without privilege, ``EINVAL``/``EFSCORRUPTED`` (``EUCLEAN``)
    for a bad image.
    """
    src = os.path.abspath(image_path)
    flags = MS_RDONLY if readonly else 0
    what = f"mount erofs {src} on {os.fspath(mountpoint)}"
    if erofs_file_backed():
        try:
            _mount(os.fsencode(src), mountpoint, b"erofs", flags,
                   options.encode() if options else None, what)
            return
        except NativeError as e:
            if e.errno != errno.ENOTBLK:
                raise
    fds: list[int] = []
    try:
        try:
            fd, dev = _loop_attach(src)
            fds.append(fd)
            opts = []
            for opt in (options.split(",") if options else []):
                if opt.startswith("device="):
                    xfd, xdev = _loop_attach(os.path.abspath(opt[len("device="):]))
                    fds.append(xfd)
                    opt = f"device={xdev}"
                opts.append(opt)
        except OSError as e:
            code = e.errno or errno.EIO
            raise NativeError(code, f"{what}: loop device: {os.strerror(code)}") from e
        _mount(os.fsencode(dev), mountpoint, b"erofs", flags,
               ",".join(opts).encode() if opts else None, f"{what} (on {dev})")
    finally:
        for fd in fds:
            os.close(fd)


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
