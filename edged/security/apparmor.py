"""AppArmor profiles for sandbox workloads: generation from ``profiles/apparmor/*.profile.in``,
compile check with ``apparmor_parser``, and loading where the kernel has AppArmor.

Probe: AppArmor is usable when ``/sys/kernel/security/apparmor`` exists (the securityfs
interface of the LSM) and ``apparmor_parser`` is installed. Where it is absent (this dev
machine), :func:`load` logs a notice and returns False; Landlock and seccomp still apply. On
production hosts the spawner/sbx-init applies the loaded profile at exec
(``/proc/self/attr/apparmor/exec`` = ``exec <name>``, the aa_change_onexec protocol).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import string
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from edged.security.profile import PROFILES_DIR, ProfileError

log = logging.getLogger("edged.security.apparmor")

SECURITYFS = "/sys/kernel/security/apparmor"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
# AppArmor path globs treat these as special; protected paths must be plain.
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9_.+/-]*$")


def probe() -> dict[str, object]:
    """``{"kernel": bool, "parser": str | None}``: whether the running kernel has AppArmor
    and where ``apparmor_parser`` is."""
    return {"kernel": os.path.isdir(SECURITYFS), "parser": shutil.which("apparmor_parser")}


def render(
    sandbox_id: str,
    protected: Iterable[str],
    *,
    template: str = "sandbox",
    init_profile: str = "edged-sbx-init",
) -> str:
    """The profile text for one sandbox: profile name ``edged-sbx-<id>``; every protected
    path (and everything beneath it) read/map/execute-only.

    Raises :class:`ProfileError` for a bad sandbox id, a protected path with glob or quote
    characters, or a missing template."""
    if not _NAME.match(sandbox_id):
        raise ProfileError(f"apparmor: sandbox id {sandbox_id!r} is not a valid profile name")
    rules = []
    for p in sorted(set(protected)):
        if not _PLAIN_PATH.match(p) or ".." in p.split("/"):
            raise ProfileError(f"apparmor: protected path {p!r} must be plain and absolute")
        p = p.rstrip("/") or "/"
        rules.append(f"  deny {p} wl,")
        rules.append(f"  deny {p}/** wl,")
    path = PROFILES_DIR / "apparmor" / f"{template}.profile.in"
    try:
        tpl = string.Template(path.read_text())
    except OSError as e:
        raise ProfileError(f"apparmor template {path}: {e}") from e
    try:
        return tpl.substitute(name=f"edged-sbx-{sandbox_id}", init_profile=init_profile,
                              protected_rules="\n".join(rules))
    except (KeyError, ValueError) as e:
        raise ProfileError(f"apparmor template {path}: bad placeholder {e}") from e


def _parser() -> str:
    p = shutil.which("apparmor_parser") or (
        "/usr/sbin/apparmor_parser" if os.path.exists("/usr/sbin/apparmor_parser") else None)
    if p is None:
        raise ProfileError("apparmor_parser is not installed (Debian package apparmor)")
    return p


def check(text: str) -> None:
    """Compile ``text`` with ``apparmor_parser -Q -K`` (parse and compile, no kernel load, no
    cache). Raises :class:`ProfileError` with the parser's message on failure."""
    with tempfile.NamedTemporaryFile("w", suffix=".profile") as f:
        f.write(text)
        f.flush()
        r = subprocess.run([_parser(), "-Q", "-K", f.name], capture_output=True, text=True,
                           timeout=60)
    if r.returncode != 0:
        raise ProfileError(f"apparmor_parser refused the profile: {r.stderr.strip()}")


def load(text: str) -> bool:
    """Load (or replace) the profile in the kernel; returns False, with a logged notice, where
    the kernel has no AppArmor. Raises :class:`ProfileError` when the parser refuses it."""
    if not probe()["kernel"]:
        log.info("apparmor: not in this kernel (%s absent); profile not loaded", SECURITYFS)
        return False
    with tempfile.NamedTemporaryFile("w", suffix=".profile") as f:
        f.write(text)
        f.flush()
        r = subprocess.run([_parser(), "-r", "-K", f.name], capture_output=True, text=True,
                           timeout=60)
    if r.returncode != 0:
        raise ProfileError(f"apparmor_parser -r: {r.stderr.strip()}")
    return True


def unload(name: str) -> None:
    """Remove profile ``name`` from the kernel (``.remove`` in securityfs); a no-op where the
    kernel has no AppArmor or the profile is not loaded."""
    if not _NAME.match(name.removeprefix("edged-sbx-")):
        raise ProfileError(f"apparmor: {name!r} is not a profile name of ours")
    try:
        with open(os.path.join(SECURITYFS, ".remove"), "w") as f:
            f.write(name)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("apparmor: remove profile %s: %s", name, e)


def template_names() -> list[str]:
    """Names of the templates in ``profiles/apparmor/``."""
    return sorted(p.name[: -len(".profile.in")]
                  for p in Path(PROFILES_DIR, "apparmor").glob("*.profile.in"))
