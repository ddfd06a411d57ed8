"""Confinement of container sandboxes: the per-sandbox policy files, the limit events the
cgroups report, and the grader's tamper check.

Who applies what (see also ``csrc/spawner/spawner.c`` and ``csrc/sbx-init/child.c``):

- the spawner, as sandbox root before it execs sbx-init: read-only bind mounts of the task
  profile's protected paths, then the capability set :data:`edged.security.confine.
  WORKLOAD_CAPS` (bounding set too) and ``no_new_privs``. Without CAP_SYS_ADMIN the sandbox
  cannot remount or unmount those mounts, and in any user namespace it creates they are
  locked by the kernel;
- sbx-init, for EACH exec just before execve: the AppArmor profile where the kernel has
  AppArmor (the workload's, or the grader's for a grader exec: both loaded here at create),
  Landlock (the ruleset prepared once at start-up from the pristine rootfs; a fresh domain
  per exec), then the seccomp program with a notification listener that sbx-init itself
  serves (EPERM at once) and reports as ``SBX_EVENT`` frames, recorded as
  ``seccomp_denied`` (:mod:`edged.sbxinit.events`).

A sandbox never gets less than its task profile asks for: a profile that restricts TCP
ports (Landlock ABI 4, Linux 6.7) or hides paths (AppArmor) is refused at create where the
kernel cannot enforce that, naming what is missing. AppArmor denials are recorded
(``apparmor_denied``, read from the kernel's audit messages by the backend); Landlock
denials are not (Linux reports them through audit only from ABI 7, and nothing ties such a
record to a sandbox yet), so an attack stopped by Landlock alone leaves its trace only in
the workload's own EACCES/EPERM.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from edged.backends.base import EventSink, SandboxSpec
from edged.cgroups import SandboxCgroup
from edged.security import apparmor, landlock, seccomp, tasks
from edged.security.confine import WORKLOAD_CAPS
from edged.security.profile import ProfileError, profile_path

log = logging.getLogger("edged.container")


@dataclass(frozen=True)
class Policy:
    """What one sandbox is confined with. ``landlock_blob`` is None where the kernel has no
    Landlock (logged; the read-only mounts and seccomp still apply)."""

    task: tasks.TaskProfile
    seccomp_name: str
    seccomp_prog: bytes
    landlock_blob: bytes | None
    caps: int
    apparmor_profile: str | None = None

    @property
    def protected(self) -> tuple[str, ...]:
        return self.task.all_protected()


_Stamp = tuple[object, ...]
#: (task profile, seccomp profile, lowers) -> (stamp of what the policy was built from, policy)
_cache: dict[tuple[str, str | None, tuple[str, ...]], tuple[_Stamp, Policy]] = {}
_CACHE_MAX = 256


def _stat(path: str | os.PathLike[str]) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _stamp(task: tasks.TaskProfile, sc_name: str, lowers: tuple[str, ...]) -> _Stamp:
    """What a policy is built from, cheaply: the two profile files, and every directory of
    the layers whose listing the Landlock ruleset reads (``/`` and each ancestor of a
    protected path: see :func:`edged.security.landlock.protected_ruleset`). A directory's
    mtime changes with any entry added, removed or renamed in it."""
    dirs = {"/"}
    for p in task.all_protected():
        parent = os.path.dirname(os.path.normpath("/" + p.strip("/")))
        while parent not in dirs:
            dirs.add(parent)
            parent = os.path.dirname(parent)
    return (_stat(profile_path("tasks", task.name, ".toml")),
            _stat(profile_path("seccomp", sc_name, ".json")), landlock.abi(),
            tuple(_stat(os.path.join(low, d.lstrip("/"))) for low in lowers
                  for d in sorted(dirs)))


def _build(spec: SandboxSpec) -> Policy:
    """The policy without its AppArmor part, from a cache checked against :func:`_stamp`:
    building the Landlock ruleset lists the layers' directories, milliseconds per create."""
    assert spec.task_profile is not None
    key = (spec.task_profile, spec.seccomp_profile, tuple(spec.lowers))
    hit = _cache.get(key)
    if hit is not None and hit[0] == _stamp(hit[1].task, hit[1].seccomp_name, key[2]):
        return hit[1]
    task = tasks.load(spec.task_profile)
    _check_enforceable(task)
    sc_name = spec.seccomp_profile or task.seccomp
    stamp = _stamp(task, sc_name, key[2])  # before reading: a change in between misses next
    prog = seccomp.load(sc_name).compile("notify")
    blob = None
    if landlock.abi() > 0:
        blob = task.landlock_ruleset(spec.lowers).serialize()
    else:
        log.info("sandbox %s: no Landlock in this kernel; protected paths rest on read-only "
                 "mounts and seccomp", spec.id)
    policy = Policy(task, sc_name, prog, blob, WORKLOAD_CAPS)
    if len(_cache) >= _CACHE_MAX:
        _cache.pop(next(iter(_cache)))
    _cache[key] = (stamp, policy)
    return policy


#: The Landlock ABI that has TCP bind/connect rules (Linux 6.7).
TCP_RULES_ABI = 4


def _check_enforceable(task: tasks.TaskProfile) -> None:
    """Refuse (ProfileError, a BadRequest) a task profile this kernel cannot enforce whole:
    TCP port rules need Landlock ABI 4, hidden paths need AppArmor."""
    abi = landlock.abi()
    if (task.tcp_bind is not None or task.tcp_connect is not None) and abi < TCP_RULES_ABI:
        raise ProfileError(
            f"task profile {task.name}: tcp_bind/tcp_connect need Landlock ABI "
            f"{TCP_RULES_ABI} (Linux 6.7); this kernel has ABI {abi}: refused rather than "
            "run without them")
    if task.hidden and not apparmor.probe()["kernel"]:
        raise ProfileError(
            f"task profile {task.name}: hidden paths need AppArmor, which this kernel does "
            "not have: refused rather than run with them readable")


def prepare(spec: SandboxSpec) -> Policy | None:
    """Load and compile the policy ``spec`` names (None when it asks for none); where the
    kernel has AppArmor, render and load the sandbox's profile (``edged-sbx-<id>``, applied
    by sbx-init at each exec; unload with :func:`release`). Raises
    :class:`edged.security.profile.ProfileError` (a ``BadRequest``) for a bad profile: a
    sandbox is never created with less confinement than it asked for. Built policies are
    cached, and rebuilt when a profile file or a layer directory they were read from
    changes."""
    if spec.task_profile is None:
        return None
    base = _build(spec)
    task = base.task
    aa = None
    if apparmor.probe()["kernel"]:
        text = apparmor.render(spec.id, task.all_protected(), hidden=task.hidden)
        if apparmor.load(text):
            aa = ",".join(apparmor.profile_names(spec.id))  # sbx-init's -A WORKLOAD,GRADER
    else:
        _notice_once("no AppArmor in this kernel: sandboxes run without an AppArmor profile "
                     "(Landlock, seccomp and read-only mounts still apply)")
    if aa is None:
        return base
    return Policy(task, base.seccomp_name, base.seccomp_prog, base.landlock_blob, base.caps, aa)


def release(sandbox_id: str) -> None:
    """Undo what :func:`prepare` left in the kernel (the AppArmor profiles, if any)."""
    if apparmor.probe()["kernel"]:
        for name in apparmor.profile_names(sandbox_id):
            apparmor.unload(name)


_noticed: set[str] = set()


def _notice_once(msg: str) -> None:
    if msg not in _noticed:
        _noticed.add(msg)
        log.info(msg)


def _policy_file(policy_dir: Path, data: bytes, suffix: str) -> Path:
    """``<policy_dir>/<sha256 of data><suffix>``, written once (atomically) and shared by
    every sandbox with the same policy: the spawner opens it for sbx-init."""
    path = policy_dir / (hashlib.sha256(data).hexdigest() + suffix)
    if not path.exists():
        policy_dir.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def spawner_args(policy: Policy, policy_dir: Path) -> list[str]:
    """Write the policy files (once) into ``policy_dir``, which must be host-only (in the
    0700 state dir); return the spawner's options for them."""
    args = ["--caps", str(policy.caps)]
    if policy.task.sysfs:
        args += ["--sysfs", "1"]
    for p in policy.protected:
        args += ["--protect", p]
    for p in policy.task.grader_view:
        args += ["--pristine", p]
    args += ["--seccomp", str(_policy_file(policy_dir, policy.seccomp_prog, ".bpf"))]
    if policy.landlock_blob is not None:
        args += ["--landlock", str(_policy_file(policy_dir, policy.landlock_blob, ".landlock"))]
    if policy.apparmor_profile is not None:
        args += ["--apparmor", policy.apparmor_profile]
    return args


class LimitWatch:
    """Counters of a sandbox's cgroups that mean a limit was hit (pids.events ``max``,
    cpu.stat ``nr_throttled``, memory OOM kills) and its upper's free space; :meth:`poll`
    records what grew since the last call. Sources: Documentation/admin-guide/cgroup-v1/
    pids.rst, cgroup-v2.rst (pids.events, cpu.stat), sched-bwc.rst (nr_throttled)."""

    def __init__(self, cg: SandboxCgroup, fresh: bool = False) -> None:
        """``fresh``: the cgroups were just made, every counter is 0 (saves the reads)."""
        self.cg = cg
        self.last = ({"pids_limit": 0, "cpu_throttled": 0, "oom_kill": 0} if fresh
                     else self._read())
        self.disk_full = False

    def _read(self) -> dict[str, int]:
        return self.cg.limit_counters()

    def poll(self, sink: EventSink | None, sandbox_id: str, upper: str | None) -> None:
        """Record each counter that grew (``oom_kill`` is left to the exec end that reports
        it, unless no exec did) and a newly full upper (``disk_full``)."""
        now = self._read()
        if sink is None:
            self.last = now
            return
        for kind in ("pids_limit", "cpu_throttled"):
            if now[kind] > self.last[kind]:
                sink(sandbox_id, kind, detail={"count": now[kind] - self.last[kind],
                                               "total": now[kind]})
        self.last = now
        if upper is not None:
            try:
                st = os.statvfs(upper)
            except OSError:
                return
            full = st.f_bavail == 0 or (st.f_files > 0 and st.f_favail == 0)
            if full and not self.disk_full:
                sink(sandbox_id, "disk_full", detail={"bytes": st.f_blocks * st.f_frsize})
            self.disk_full = full


_U_RE = re.compile(rb"(?:^|\0)-U\0(\d+)\0")


def scratch_path(pid: int) -> str | None:
    """Host path of the sandbox's scratch dir (``upper/``, ``work/``) through sbx-init's
    ``-U`` fd: ``/proc/<pid>/fd/<n>`` (only host root can follow it). None if sbx-init has
    none or is gone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    m = _U_RE.search(cmdline)
    return f"/proc/{pid}/fd/{int(m.group(1))}" if m else None


def tamper_check(sink: EventSink | None, sandbox_id: str, pid: int,
                 policy: Policy) -> list[str]:
    """Protected paths that the sandbox's upper shadows (see
    :func:`edged.security.tasks.tampered`), each recorded as ``protected_path_tampered``.
    Raises OSError when the upper cannot be read (the caller refuses the grader then)."""
    scratch = scratch_path(pid)
    if scratch is None:
        raise FileNotFoundError(f"sandbox {sandbox_id}: no scratch dir to check")
    upper = os.path.join(scratch, "upper")
    os.stat(upper)
    hits = tasks.tampered(upper, policy.protected)
    for p in hits:
        if sink is not None:
            sink(sandbox_id, "protected_path_tampered", path=p,
                 detail={"checked": "before a grader exec"})
    return hits


__all__ = ["LimitWatch", "Policy", "prepare", "release", "scratch_path", "spawner_args",
           "tamper_check"]
