"""Task profiles (``profiles/tasks/<name>.toml``): the per-sandbox choice of confinement.

Keys: ``seccomp`` (profile name), ``protected`` (absolute paths the workload may read and
execute but never change), ``grader`` (absolute paths of programs the grader exec runs; treated
as protected), ``grader_view`` (absolute paths that a grader exec sees as the layers hold
them, whatever the workload wrote there, which it may: default :data:`DEFAULT_GRADER_VIEW`),
``tcp_bind`` / ``tcp_connect`` (port lists; absent means TCP not restricted by Landlock),
``sysfs`` (true: a sysfs of the sandbox's network namespace on /sys; default false, /sys
empty: each sysfs is a superblock, and every superblock on the host grows the kernel's tables
of every memory cgroup, so it costs the node in proportion to its sandboxes), ``writable``
(absolute paths that exist when the sandbox starts: when given, the workload may change
nothing else, see :func:`edged.security.landlock.writable_ruleset`; absent, everything but
the protected paths is writable), ``hidden`` (absolute paths the workload may not read or
change at all, e.g. a task's answer files, while grader execs may: enforced by AppArmor, so a
sandbox whose profile hides paths is refused where the kernel has no AppArmor).
Unknown keys are an error, so a typo cannot silently weaken a policy.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from edged.security import landlock
from edged.security.profile import ProfileError, profile_path, profile_problem

#: What a grader exec sees from the layers when a task profile names nothing else: the
#: system binaries, libraries and configuration (a ``sitecustomize.py`` in /etc/python3.x or
#: /usr/lib/python3.x, a ``.pth`` file, an ld.so.preload) and the rollout's toolkit.
DEFAULT_GRADER_VIEW = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
                       "/opt/toolkit")


@dataclass(frozen=True)
class TaskProfile:
    """A validated task profile. Paths are normalised absolute paths."""

    name: str
    seccomp: str
    protected: tuple[str, ...]
    grader: tuple[str, ...]
    tcp_bind: tuple[int, ...] | None
    tcp_connect: tuple[int, ...] | None
    grader_view: tuple[str, ...] = DEFAULT_GRADER_VIEW
    sysfs: bool = False
    writable: tuple[str, ...] | None = None
    hidden: tuple[str, ...] = ()

    def all_protected(self) -> tuple[str, ...]:
        """``protected`` plus the grader's programs, sorted, without duplicates."""
        return tuple(sorted(set(self.protected) | set(self.grader)))

    def landlock_ruleset(self, lowers: Iterable[str]) -> landlock.LandlockRuleset:
        """The Landlock ruleset for a sandbox built from ``lowers`` (host paths, bottom
        first); see :func:`edged.security.landlock.protected_ruleset`, or with ``writable``
        :func:`edged.security.landlock.writable_ruleset`."""
        if self.writable is not None:
            return landlock.writable_ruleset(self.writable)
        return landlock.protected_ruleset(list(lowers), self.all_protected(),
                                          tcp_bind=self.tcp_bind, tcp_connect=self.tcp_connect)


def _paths(v: object, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise ProfileError(f"{where}: must be a list of paths")
    out = []
    for p in v:
        if not p.startswith("/") or "\0" in p or ":" in p or ".." in p.split("/"):
            raise ProfileError(f"{where}: {p!r} must be absolute, without '..'")
        out.append(os.path.normpath(p))
    return tuple(out)


def _ports(v: object, where: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(
        isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= 65535 for p in v
    ):
        raise ProfileError(f"{where}: must be a list of TCP ports 0..65535")
    return tuple(v)


def load(name: str = "default") -> TaskProfile:
    """Load and validate ``profiles/tasks/<name>.toml`` (or a path). Raises
    :class:`ProfileError` naming the key at fault."""
    path = profile_path("tasks", name, ".toml")
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ProfileError(f"task profile {name!r}: {profile_problem(e)}") from e
    unknown = set(doc) - {"seccomp", "protected", "grader", "grader_view", "tcp_bind",
                          "tcp_connect", "sysfs", "writable", "hidden"}
    if unknown:
        raise ProfileError(f"task profile {name}: unknown keys {sorted(unknown)}")
    sc = doc.get("seccomp", "default")
    if not isinstance(sc, str):
        raise ProfileError(f"task profile {name}: seccomp must be a profile name")
    sysfs = doc.get("sysfs", False)
    if not isinstance(sysfs, bool):
        raise ProfileError(f"task profile {name}: sysfs must be true or false")
    return TaskProfile(
        name=name,
        seccomp=sc,
        protected=_paths(doc.get("protected", []), f"task profile {name}: protected"),
        grader=_paths(doc.get("grader", []), f"task profile {name}: grader"),
        tcp_bind=_ports(doc.get("tcp_bind"), f"task profile {name}: tcp_bind"),
        tcp_connect=_ports(doc.get("tcp_connect"), f"task profile {name}: tcp_connect"),
        grader_view=tuple(sorted(set(_paths(doc.get("grader_view", list(DEFAULT_GRADER_VIEW)),
                                            f"task profile {name}: grader_view"))
                                 - {"/"})),
        sysfs=sysfs,
        writable=(None if "writable" not in doc else
                  _paths(doc["writable"], f"task profile {name}: writable")),
        hidden=tuple(sorted(set(_paths(doc.get("hidden", []),
                                       f"task profile {name}: hidden")))),
    )


def tampered(upper: str | os.PathLike[str], protected: Iterable[str]) -> list[str]:
    """Protected paths that the sandbox's overlay upper directory shadows (a copy-up, a
    whiteout, an opaque directory or a new file): with read-only EROFS lowers, the upper is
    the only place a change can live, so an empty answer means every protected path is
    exactly what the layers hold. The daemon calls this before a grader exec and records
    ``protected_path_tampered`` for each hit. Paths are sandbox-absolute."""
    hits = []
    for p in protected:
        rel = p.strip("/")
        parts = rel.split("/") if rel else []
        # A shadowing entry may be the path itself, anything beneath it, or an ancestor that
        # the upper replaced (e.g. /bin turned into a directory or a whiteout).
        for i in range(1, len(parts) + 1):
            cand = os.path.join(upper, *parts[:i])
            if os.path.lexists(cand) and (i == len(parts) or not os.path.isdir(cand)
                                          or os.path.islink(cand)):
                hits.append(p)
                break
        else:
            full = os.path.join(upper, rel)
            if os.path.isdir(full) and not os.path.islink(full) and any(os.scandir(full)):
                hits.append(p)
    return sorted(set(hits))
