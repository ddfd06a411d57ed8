"""Shared pieces of profile loading: where profiles live and the error for a bad one."""

from __future__ import annotations

import os
from pathlib import Path

from edged.errors import BadRequest

#: The repository's ``profiles/`` directory, or ``EDGED_PROFILES`` when set (installed nodes).
PROFILES_DIR = Path(
    os.environ.get("EDGED_PROFILES", Path(__file__).resolve().parent.parent.parent / "profiles")
)


class ProfileError(BadRequest):
    """A profile (seccomp JSON, task profile, template) is malformed or names something that
    does not exist. The message names the profile and the offending rule or key; nothing is
    applied from a profile that raised this."""

    code = "bad_profile"


def profile_path(kind: str, name: str, suffix: str) -> Path:
    """Path of profile ``name`` of ``kind`` (``seccomp``, ``tasks``...): a bare name is looked up
    in :data:`PROFILES_DIR`; a name with a ``/`` is taken as a path. Raises
    :class:`ProfileError` for a name that tries to leave the profiles directory."""
    if "/" in name:
        return Path(name)
    if not name or name.startswith(".") or "\\" in name:
        raise ProfileError(f"{kind} profile name {name!r} is not valid")
    return PROFILES_DIR / kind / f"{name}{suffix}"
