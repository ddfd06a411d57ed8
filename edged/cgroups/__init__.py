"""Sandbox cgroups behind one interface (:class:`Hierarchy` makes :class:`SandboxCgroup`),
with v1 (:mod:`.v1`, hybrid included) and v2 (:mod:`.v2`) implementations; :func:`probe`
picks the one this host has. Every backend that confines with cgroups uses it; cgroup BPF
attaches to :meth:`Hierarchy.bpf_dir` or a sandbox's ``bpf_dir``."""

from __future__ import annotations

from pathlib import Path

from edged.cgroups import fs
from edged.cgroups.base import (
    CGROUP_ROOT,
    POOL_PREFIX,
    Hierarchy,
    SandboxCgroup,
    swap_allowance,
)
from edged.cgroups.none import NoHierarchy
from edged.cgroups.v1 import V1Hierarchy
from edged.cgroups.v2 import V2Hierarchy


def probe(root: Path = CGROUP_ROOT, subdir: str = "edged",
          swap_share: float = 1.0) -> Hierarchy:
    """This host's hierarchy for sandbox cgroups beneath this process's own: v2 where this
    process is in the unified hierarchy alone (with cpu, memory and pids), else v1 where every
    controller we need is mounted, else none. ``swap_share``: see :func:`swap_allowance`."""
    own = fs.self_cgroups()
    return (V2Hierarchy.probe(root, subdir, own, swap_share)
            or V1Hierarchy.probe(root, subdir, own, swap_share)
            or NoHierarchy(root, subdir, swap_share))


__all__ = ["CGROUP_ROOT", "POOL_PREFIX", "Hierarchy", "SandboxCgroup", "probe",
           "swap_allowance"]
