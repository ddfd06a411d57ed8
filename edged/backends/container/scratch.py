"""Size limits for sandbox uppers kept on the node's scratch filesystem (``scratch_dir``).

On XFS mounted with project quotas (``prjquota``), each sandbox's scratch directory gets its
own project (id = the sandbox's host uid base: unique per live sandbox) with a hard block
limit of ``resources.disk_bytes``: a full upper is ENOSPC inside that sandbox only, and
``statfs`` inside it reports the quota, so the daemon sees it fill. Elsewhere (no XFS, no
project quotas) the upper is bounded only by the filesystem, which is logged once.

Sources: xfs_quota(8) (``project -s``, ``limit -p bhard=``), xfs(5) (``prjquota``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from edged.errors import BackendError

log = logging.getLogger("edged.container")
_warned: set[str] = set()


def _mount_of(path: Path) -> tuple[str, str, set[str]]:
    """(mount point, fs type, options) of the mount holding ``path``."""
    best = ("/", "", set[str]())
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields = pre.split()
            mnt = fields[4].replace("\\040", " ")
            fstype, _src, sopts = post.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best[0]):
                best = (mnt, fstype, set(fields[5].split(",")) | set(sopts.split(",")))
    return best


def project_quota_mount(scratch_dir: Path) -> str | None:
    """The mount point of ``scratch_dir`` if it is XFS with project quotas enforced, else
    None (logged once per directory)."""
    mnt, fstype, opts = _mount_of(scratch_dir)
    if fstype == "xfs" and opts & {"prjquota", "pquota"} and shutil.which("xfs_quota"):
        return mnt
    key = str(scratch_dir)
    if key not in _warned:
        _warned.add(key)
        log.info("scratch dir %s (%s) has no XFS project quotas: sandbox uppers there are "
                 "bounded by the filesystem only", scratch_dir, fstype or "?")
    return None


def _xfs_quota(mnt: str, *cmds: str) -> None:
    argv = ["xfs_quota", "-x"]
    for c in cmds:
        argv += ["-c", c]
    r = subprocess.run([*argv, mnt], capture_output=True, text=True, timeout=30)
    if r.returncode != 0 or r.stderr.strip():
        raise BackendError(f"xfs_quota {' ; '.join(cmds)} on {mnt}: "
                           f"{(r.stderr or r.stdout).strip()}")


def limit(mnt: str, directory: Path, project: int, nbytes: int) -> None:
    """Make ``directory`` (empty) project ``project`` with a hard limit of ``nbytes``.
    Raises BackendError when xfs_quota refuses."""
    _xfs_quota(mnt, f"project -s -p {directory} {project}",
               f"limit -p bhard={max(nbytes // 1024, 1)}k {project}")


def unlimit(mnt: str, project: int) -> None:
    """Drop the limit of ``project`` (its directory is gone). Raises BackendError."""
    _xfs_quota(mnt, f"limit -p bhard=0 {project}")


__all__ = ["limit", "project_quota_mount", "unlimit"]
