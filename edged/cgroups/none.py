"""No usable cgroups (no controllers we may use): sandboxes run without limits, cannot be
frozen (pause, resume and killing every process raise InvalidState), and sbx-init kills an
exec's tree by its session."""

from __future__ import annotations

from pathlib import Path

from edged.cgroups.base import Hierarchy, SandboxCgroup
from edged.datatypes import MemoryUsage, Resources
from edged.errors import InvalidState


class NoCgroup(SandboxCgroup):
    """Nothing to make, read or remove."""

    version = "none"

    def sbx_init_dirs(self) -> dict[str, Path]:
        return {}

    def freeze(self, frozen: bool, timeout_s: float = 5.0) -> None:
        raise InvalidState(f"{'pause' if frozen else 'resume'} needs a freezer cgroup, none "
                           "on this host")

    def kill_workload(self, keep_pid: int, timeout_s: float = 30.0) -> int:
        raise InvalidState("killing every process needs the sandbox's cgroups, none on this "
                           "host")

    def frozen(self) -> bool:
        return False

    def stats(self) -> dict[str, int]:
        return {"memory_bytes": 0, "cpu_usage_ns": 0, "pids": 0}

    def memory_usage(self) -> MemoryUsage:
        return MemoryUsage()

    def procs(self) -> list[int]:
        return []

    def set_qos(self, qos: str) -> None:
        return None

    def oom_kills(self) -> int:
        return 0

    def limit_counters(self) -> dict[str, int]:
        return {"pids_limit": 0, "cpu_throttled": 0, "oom_kill": 0}

    def unthrottle(self, leave_idle: bool = False) -> None:
        return None

    def kill_all(self) -> None:
        return None

    def _thaw_after_kill(self) -> None:
        return None


class NoHierarchy(Hierarchy):
    """A host where no cgroup can be made for sandboxes."""

    def path_of(self, sandbox_id: str) -> SandboxCgroup:
        return NoCgroup({})

    def create(self, sandbox_id: str, res: Resources, root_uid: int, *,
               qos: str = "best_effort", bpf: bool = False) -> SandboxCgroup:
        return NoCgroup({})
