"""A microVM sandbox's confinement inside its guest, from its task profile: what the boot
record carries (:class:`~edged.backends.microvm.boot.BootSpec`) and sbx-init applies there
(``csrc/sbx-init/guest.c``, ``child.c``), the container's confinement where the guest's kernel
has it:

- every exec keeps only :data:`edged.security.confine.WORKLOAD_CAPS` (bounding set too):
  no CAP_SYS_ADMIN, CAP_MKNOD, CAP_SYS_MODULE, CAP_SYS_RAWIO, so the workload cannot reach
  the raw disks or the control port, remount, or load modules;
- the task profile's protected paths are read-only binds made by the guest's init, and
  read+execute-only under Landlock (the same ruleset as a container's, which the guest's
  kernel applies as far as its ABI goes: 6.1 has no scopes);
- the seccomp program (user notifications, served by sbx-init as in a container);
- a grader exec sees the ``grader_view`` paths as the layers hold them.

What a container has and a guest does not: AppArmor (not in the guest's kernel), and the
host-side check of the upper before a grader exec (the upper is an ext4 disk the guest has
mounted; the grader's view of the layers is what keeps it from what the workload wrote).

The Landlock ruleset lists the layers' directories (``/`` and each ancestor of a protected
path, see :func:`edged.security.landlock.protected_ruleset`), so the image files are mounted
on the host for the moment it takes (file-backed EROFS, read-only), once per profile and layer
set: the result is cached by the images' paths, which name their content (a digest).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from edged.backends.base import SandboxSpec
from edged.backends.microvm.boot import BootSpec
from edged.errors import BackendError
from edged.security import landlock, seccomp, tasks
from edged.security.confine import WORKLOAD_CAPS

log = logging.getLogger("edged.microvm")


@dataclass(frozen=True)
class GuestPolicy:
    """What one guest is confined with (see the module): ``caps`` (None: every
    capability, an unconfined sandbox), ``protected`` and ``grader_paths`` (absolute),
    ``landlock`` and ``seccomp`` blobs (empty: none)."""

    caps: int | None = None
    protected: tuple[str, ...] = ()
    grader_paths: tuple[str, ...] = ()
    landlock: bytes = b""
    seccomp: bytes = b""

    def boot_spec(self, spec: SandboxSpec) -> BootSpec:
        """The boot record of ``spec``'s sandbox under this policy."""
        r = spec.resources
        return BootSpec(nlayers=len(spec.lowers), hostname=spec.hostname,
                        realtime_ns=time.time_ns(), memory_max=r.memory_bytes,
                        pids_max=r.pids, caps=self.caps, protected=self.protected,
                        grader_paths=self.grader_paths, landlock=self.landlock,
                        seccomp=self.seccomp)


_cache: dict[tuple[str, str | None, tuple[str, ...]], GuestPolicy] = {}
_CACHE_MAX = 256


def _stamp(path: str) -> str:
    """An image by path and what it holds (a file rewritten in place is another key)."""
    try:
        st = os.stat(path)
    except OSError:
        return path
    return f"{path}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


@contextlib.contextmanager
def _mounted(images: Sequence[str]) -> Iterator[list[str]]:
    from layerfs.mount import mounted_erofs  # a layerfs mount helper, only when needed

    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(mounted_erofs(img)) for img in images]


def prepare(spec: SandboxSpec) -> GuestPolicy:
    """The guest policy of ``spec`` (``spec.lowers``: EROFS image files): none for a
    sandbox without a task profile. Raises :class:`edged.security.profile.ProfileError`
    (a BadRequest) for a bad profile, BackendError when the layers cannot be read for the
    Landlock ruleset."""
    if spec.task_profile is None:
        return GuestPolicy()
    key = (spec.task_profile, spec.seccomp_profile, tuple(_stamp(p) for p in spec.lowers))
    hit = _cache.get(key)
    if hit is not None:
        return hit
    task = tasks.load(spec.task_profile)
    prog = seccomp.load(spec.seccomp_profile or task.seccomp).compile("notify")
    blob = b""
    if landlock.abi() > 0:  # the host's ABI builds the blob; the guest's kernel takes its part
        try:
            with _mounted(spec.lowers) as trees:
                blob = task.landlock_ruleset(trees).serialize()
        except OSError as e:
            raise BackendError(f"sandbox {spec.id}: reading the layers for Landlock: {e}") from e
    policy = GuestPolicy(WORKLOAD_CAPS, task.all_protected(), task.grader_view, blob, prog)
    if len(_cache) >= _CACHE_MAX:
        _cache.pop(next(iter(_cache)))
    _cache[key] = policy
    return policy


def image_paths_ok(paths: Sequence[str]) -> str | None:
    """None if every path is an absolute regular file (a layer image), else what is
    wrong."""
    for p in paths:
        if not os.path.isabs(p) or not os.path.isfile(p):
            return f"lower {p!r} is not an existing absolute image file"
    return None


__all__ = ["GuestPolicy", "image_paths_ok", "prepare"]
