"""AppArmor profiles for sandbox workloads: generation from ``profiles/apparmor/*.profile.in``,
compile check with ``apparmor_parser``, and loading where the kernel has AppArmor.

Probe: AppArmor is usable when ``/sys/kernel/security/apparmor`` exists (the securityfs
interface of the LSM) and ``apparmor_parser`` is installed. Where it is absent (this dev
machine), :func:`load` logs a notice and returns False; Landlock and seccomp still apply. On
production hosts the spawner/sbx-init applies the loaded profile at exec
(``/proc/self/attr/apparmor/exec`` = ``exec <name>``, the aa_change_onexec protocol).

Each sandbox has two profiles, rendered from one template into one file (loaded and removed
together): ``edged-sbx-<id>`` for the workload's execs and ``edged-grader-<id>`` for grader
execs (the same rules, but the task profile's hidden paths readable, and a label of its own,
so the workload's processes can neither signal nor trace a grader). The prefixes differ, so
no sandbox id can name another sandbox's profile. Denials of either reach the ledger as
``apparmor_denied`` events through the kernel's audit messages (:mod:`.audit`).
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
WORKLOAD_PREFIX = "edged-sbx-"
GRADER_PREFIX = "edged-grader-"
# AppArmor path globs treat these as special; protected paths must be plain.
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9_.+/-]*$")


def probe() -> dict[str, object]:
    """``{"kernel": bool, "parser": str | None}``: whether the running kernel has AppArmor
    and where ``apparmor_parser`` is."""
    return {"kernel": os.path.isdir(SECURITYFS), "parser": shutil.which("apparmor_parser")}


def profile_names(sandbox_id: str) -> tuple[str, str]:
    """(workload profile, grader profile) of a sandbox."""
    return f"{WORKLOAD_PREFIX}{sandbox_id}", f"{GRADER_PREFIX}{sandbox_id}"


def sandbox_of(label: str) -> str | None:
    """The sandbox id whose profile ``label`` is (``edged-sbx-<id>`` or
    ``edged-grader-<id>``, also with a ``//...`` child part), or None for another label."""
    name = label.split("//", 1)[0].removesuffix(" (enforce)")
    for prefix in (WORKLOAD_PREFIX, GRADER_PREFIX):
        if name.startswith(prefix) and _NAME.match(name[len(prefix):]):
            return name[len(prefix):]
    return None


def _path_rules(paths: Iterable[str], what: str, perms: str) -> list[str]:
    rules = []
    for p in sorted(set(paths)):
        if not _PLAIN_PATH.match(p) or ".." in p.split("/"):
            raise ProfileError(f"apparmor: {what} path {p!r} must be plain and absolute")
        p = p.rstrip("/")
        # "audit": a bare deny rule is quiet (AppArmor logs no denial of it), and every
        # denial must reach the ledger; "p/": a directory is matched with its slash, which
        # neither "p" nor "p/**" matches (without it a hidden directory could be listed).
        if p:
            rules.append(f"  audit deny {p} {perms},")
        rules.append(f"  audit deny {p}/ {perms},")
        rules.append(f"  audit deny {p}/** {perms},")
    return rules


def render(
    sandbox_id: str,
    protected: Iterable[str],
    *,
    hidden: Iterable[str] = (),
    template: str = "sandbox",
    init_profile: str = "edged-sbx-init",
) -> str:
    """The profile text for one sandbox: the workload's profile (``edged-sbx-<id>``: every
    protected path, and everything beneath it, read/map/execute-only; every ``hidden`` path
    not accessible at all) and the grader's (``edged-grader-<id>``: the same but the hidden
    paths), in one text to load at once.

    Raises :class:`ProfileError` for a bad sandbox id, a protected or hidden path with glob
    or quote characters, or a missing or bad template."""
    if not _NAME.match(sandbox_id):
        raise ProfileError(f"apparmor: sandbox id {sandbox_id!r} is not a valid profile name")
    protected_rules = "\n".join(_path_rules(protected, "protected", "wl"))
    hidden_rules = "\n".join(_path_rules(hidden, "hidden", "rwlkmx"))
    path = PROFILES_DIR / "apparmor" / f"{template}.profile.in"
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"apparmor template {path}: {e}") from e
    m = re.search(r"^profile ", text, re.MULTILINE)
    if m is None:
        raise ProfileError(f"apparmor template {path}: no 'profile' block")
    workload, grader = profile_names(sandbox_id)
    try:
        return (string.Template(text).substitute(
                    name=workload, init_profile=init_profile,
                    protected_rules=protected_rules, hidden_rules=hidden_rules)
                + "\n" + string.Template(text[m.start():]).substitute(
                    name=grader, init_profile=init_profile,
                    protected_rules=protected_rules, hidden_rules=""))
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
    kernel has no AppArmor or the profile is not loaded. Raises ProfileError for a name
    that is not one of ours (``edged-sbx-<id>``, ``edged-grader-<id>``)."""
    if sandbox_of(name) is None or "//" in name:
        raise ProfileError(f"apparmor: {name!r} is not a profile name of ours")
    try:
        with open(os.path.join(SECURITYFS, ".remove"), "w") as f:
            f.write(name)
    except (FileNotFoundError, ProcessLookupError):
        pass  # no AppArmor, or not loaded (ENOENT)
    except OSError as e:
        log.warning("apparmor: remove profile %s: %s", name, e)


def template_names() -> list[str]:
    """Names of the templates in ``profiles/apparmor/``."""
    return sorted(p.name[: -len(".profile.in")]
                  for p in Path(PROFILES_DIR, "apparmor").glob("*.profile.in"))
