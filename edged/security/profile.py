"""Shared pieces of profile loading: where profiles live and the error for a bad one."""

from __future__ import annotations

import os
from pathlib import Path

from edged.errors import BadRequest


def find_profiles_dir() -> Path:
    """Where the policy data (``seccomp/``, ``tasks/``, ``apparmor/``, ``landlock/``) is, in
    this order: ``$EDGED_PROFILES`` when set; ``edged/_profiles`` inside the installed package
    (a wheel: setup.py's build step copies the top-level ``profiles/`` there); the checkout's
    top-level ``profiles/`` (an editable install or a source tree, where ``profiles/`` is the
    source of truth and edits take effect without a reinstall). Raises nothing: a directory
    that does not exist shows up as the path in the first profile error."""
    env = os.environ.get("EDGED_PROFILES")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parent.parent
    shipped = package / "_profiles"
    if shipped.is_dir():
        return shipped
    return package.parent / "profiles"


#: The policy data directory of this process (:func:`find_profiles_dir`, read at import).
PROFILES_DIR = find_profiles_dir()


class ProfileError(BadRequest):
    """A profile (seccomp JSON, task profile, template) is malformed or names something that
    does not exist. The message names the profile and the offending rule or key; nothing is
    applied from a profile that raised this."""

    code = "bad_profile"


def profile_problem(e: Exception) -> str:
    """What is wrong with a profile file, for a message an API client sees: never the host
    path (an OSError's ``str`` names it)."""
    if isinstance(e, FileNotFoundError):
        return "no such profile"
    if isinstance(e, OSError):
        return f"cannot read it: {e.strerror or type(e).__name__}"
    return f"malformed: {e}"


def profile_path(kind: str, name: str, suffix: str) -> Path:
    """Path of profile ``name`` of ``kind`` (``seccomp``, ``tasks``...): a bare name is looked up
    in :data:`PROFILES_DIR`; a name with a ``/`` is taken as a path. Raises
    :class:`ProfileError` for a name that tries to leave the profiles directory."""
    if "/" in name:
        return Path(name)
    if not name or name.startswith(".") or "\\" in name:
        raise ProfileError(f"{kind} profile name {name!r} is not valid")
    return PROFILES_DIR / kind / f"{name}{suffix}"
