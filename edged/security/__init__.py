"""Confinement policies for sandboxed workloads and the security-event ledger.

Policy is data in ``profiles/`` (seccomp JSON, Landlock presets, AppArmor templates, task
profiles); this package loads and validates it, compiles it into what the spawner/sbx-init apply
in C (a seccomp BPF program, a Landlock ruleset blob, a capability mask), and records what the
workload tried (:mod:`edged.security.ledger`). It does not depend on the daemon's transport.
"""

from __future__ import annotations

from edged.security.profile import PROFILES_DIR, ProfileError

__all__ = ["PROFILES_DIR", "ProfileError"]
